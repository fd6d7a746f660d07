//! envd's `process.Process` service on our processes: `Start` (a command or a terminal,
//! its output streamed), `Connect` (another client follows a running one), `List`,
//! `SendInput`, `StreamInput`, `CloseStdin`, `SendSignal` and `Update` (a terminal's size).
//!
//! Each started process has a pump: one task that reads the library's [`Process`] and hands
//! every event to the streams following it (its `Start` and any `Connect`s), waiting for the
//! slowest, so a client that stops reading holds the process on a full pipe as the library
//! does; a stream that goes away is dropped from the list. With no stream left, output is
//! read and dropped, so a background command never blocks on a client that went away.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Request};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures::StreamExt;
use sandbox_core::{ExecEvent, ExecRequest, ExecResult, Process, ProcessHandle, Signal};
use serde::Deserialize;
use tokio::sync::mpsc;

use super::connect::{self, Code, Item, RpcError, StreamRequest, Unary};
use super::logs::Level;
use super::Envd;

/// Most processes one sandbox runs through envd at once.
const MAX_PROCS: usize = 256;

/// Messages a following stream may lag behind the process before the pump waits for it.
const FOLLOW_BUFFER: usize = 64;

/// Most streams following one process at once (its `Start` and `Connect`s).
const MAX_FOLLOWERS: usize = 8;

/// A sandbox's processes started through envd, by pid, while they run, and how many are
/// being started now (counted against [`MAX_PROCS`] with them).
#[derive(Default)]
pub(crate) struct Procs(
    Mutex<HashMap<u32, Arc<Proc>>>,
    Arc<std::sync::atomic::AtomicUsize>,
);

/// A place among a sandbox's [`MAX_PROCS`], held while a process starts.
struct Reserved(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Reserved {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Procs {
    /// Holds a place for a process about to start, or refuses when all are taken.
    fn reserve(&self) -> Result<Reserved, RpcError> {
        use std::sync::atomic::Ordering;
        let all = self.lock();
        if all.len() + self.1.load(Ordering::SeqCst) >= MAX_PROCS {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("this sandbox runs {MAX_PROCS} processes started through envd already"),
            ));
        }
        self.1.fetch_add(1, Ordering::SeqCst);
        drop(all);
        Ok(Reserved(Arc::clone(&self.1)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Proc>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn find(&self, sel: &Selector) -> Result<Arc<Proc>, RpcError> {
        let all = self.lock();
        let found = match (sel.pid, &sel.tag) {
            (Some(pid), _) => all.get(&pid).cloned(),
            (None, Some(tag)) => all
                .values()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()))
                .cloned(),
            (None, None) => {
                return Err(RpcError::invalid(
                    "the process selector names neither a pid nor a tag",
                ))
            }
        };
        found.ok_or_else(|| {
            RpcError::new(
                Code::NotFound,
                match (sel.pid, &sel.tag) {
                    (Some(pid), _) => format!("process with pid {pid} not found"),
                    (_, tag) => format!(
                        "process with tag {} not found",
                        tag.as_deref().unwrap_or("")
                    ),
                },
            )
        })
    }
}

/// One running process.
struct Proc {
    /// Its pid in the sandbox (what envd's clients see).
    pid: u32,
    /// The library's handle.
    id: sandbox_core::ProcessId,
    /// Whether `pid` is the sandbox's own (else the library's handle stands for it).
    own_pid: bool,
    tag: Option<String>,
    /// Its `ProcessConfig`, as the client gave it (for `List`).
    config: serde_json::Value,
    handle: ProcessHandle,
    pty: bool,
    /// The streams following it, and whether it has ended (then no stream may join).
    follow: Mutex<(Vec<mpsc::Sender<Item>>, bool)>,
}

impl Proc {
    /// A new stream following this process from now on: `Ok(None)` once it has ended, an
    /// error when it has [`MAX_FOLLOWERS`] already.
    fn follow(&self) -> Result<Option<mpsc::Receiver<Item>>, RpcError> {
        let mut f = self.follow.lock().unwrap_or_else(|p| p.into_inner());
        if f.1 {
            return Ok(None);
        }
        f.0.retain(|s| !s.is_closed());
        if f.0.len() >= MAX_FOLLOWERS {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!(
                    "process {} has {MAX_FOLLOWERS} streams following it already",
                    self.pid
                ),
            ));
        }
        let (tx, rx) = mpsc::channel(FOLLOW_BUFFER);
        f.0.push(tx);
        Ok(Some(rx))
    }
}

#[derive(Deserialize, Default)]
struct Config {
    #[serde(default)]
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: std::collections::BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Deserialize, Default, Clone, Copy)]
struct Size {
    #[serde(default)]
    cols: u32,
    #[serde(default)]
    rows: u32,
}

impl Size {
    /// Its rows and columns, each 1 to 65535.
    fn cells(self) -> Result<(u16, u16), RpcError> {
        let dim = |n: u32| u16::try_from(n).ok().filter(|n| *n > 0);
        match (dim(self.rows), dim(self.cols)) {
            (Some(rows), Some(cols)) => Ok((rows, cols)),
            _ => Err(RpcError::invalid(
                "a terminal's rows and cols are 1 to 65535",
            )),
        }
    }
}

#[derive(Deserialize, Default, Clone, Copy)]
struct Pty {
    size: Option<Size>,
}

#[derive(Deserialize, Default)]
struct StartRequest {
    process: Option<serde_json::Value>,
    pty: Option<Pty>,
    tag: Option<String>,
    stdin: Option<bool>,
}

#[derive(Deserialize, Default, Clone)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Deserialize, Default)]
struct Selected {
    process: Option<Selector>,
}

impl Selected {
    fn selector(&self) -> Result<&Selector, RpcError> {
        self.process
            .as_ref()
            .ok_or_else(|| RpcError::invalid("no process selector (`process`)"))
    }
}

#[derive(Deserialize, Default)]
struct Input {
    stdin: Option<String>,
    pty: Option<String>,
}

impl Input {
    fn bytes(&self) -> Result<Bytes, RpcError> {
        let b64 = self.stdin.as_deref().or(self.pty.as_deref()).unwrap_or("");
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map(Bytes::from)
            .map_err(|e| RpcError::invalid(format!("the input is not base64: {e}")))
    }
}

#[derive(Deserialize, Default)]
struct SendInput {
    process: Option<Selector>,
    input: Option<Input>,
}

#[derive(Deserialize, Default)]
struct SendSignal {
    process: Option<Selector>,
    #[serde(default)]
    signal: serde_json::Value,
}

#[derive(Deserialize, Default)]
struct Update {
    process: Option<Selector>,
    pty: Option<Pty>,
}

/// `POST /process.Process/{method}`.
pub(crate) async fn call(e: Envd, Path(method): Path<String>, req: Request) -> Response {
    let unary = |r: Result<serde_json::Value, RpcError>| match r {
        Ok(v) => connect::unary(v),
        Err(e) => e.into_response(),
    };
    match method.as_str() {
        "Start" => match StreamRequest::<StartRequest>::from_request(req, &()).await {
            Ok(r) => start(e, r).await,
            Err(resp) => resp,
        },
        "Connect" => match StreamRequest::<Selected>::from_request(req, &()).await {
            Ok(r) => follow(e, r).await,
            Err(resp) => resp,
        },
        "List" => unary(Ok(list(&e))),
        "SendInput" => match Unary::<SendInput>::from_request(req, &()).await {
            Ok(Unary(r)) => unary(send_input(&e, r).await),
            Err(err) => err.into_response(),
        },
        "CloseStdin" => match Unary::<Selected>::from_request(req, &()).await {
            Ok(Unary(r)) => unary(close_stdin(&e, r).await),
            Err(err) => err.into_response(),
        },
        "SendSignal" => match Unary::<SendSignal>::from_request(req, &()).await {
            Ok(Unary(r)) => unary(send_signal(&e, r).await),
            Err(err) => err.into_response(),
        },
        "Update" => match Unary::<Update>::from_request(req, &()).await {
            Ok(Unary(r)) => unary(update(&e, r).await),
            Err(err) => err.into_response(),
        },
        "StreamInput" => stream_input(&e, req).await.into_response(),
        other => RpcError::new(
            Code::Unimplemented,
            format!("process.Process/{other} is not a method of envd's process service"),
        )
        .into_response(),
    }
}

fn keepalive(r: &StreamRequest<impl Sized>) -> Option<(std::time::Duration, serde_json::Value)> {
    r.keepalive
        .map(|every| (every, serde_json::json!({ "event": { "keepalive": {} } })))
}

async fn start(e: Envd, r: StreamRequest<StartRequest>) -> Response {
    let ka = keepalive(&r);
    match spawn(&e, r.msg).await {
        Ok((pid, rx)) => answer(&e, pid, rx, ka, r.deadline),
        Err(err) => connect::stream_error(err),
    }
}

/// A stream following process `pid`: its `start` event, then what `rx` brings.
fn answer(
    e: &Envd,
    pid: u32,
    rx: mpsc::Receiver<Item>,
    keepalive: Option<(std::time::Duration, serde_json::Value)>,
    deadline: Option<std::time::Duration>,
) -> Response {
    let first = futures::stream::once(async move {
        Item::Msg(serde_json::json!({ "event": { "start": { "pid": pid } } }))
    });
    connect::stream(
        first.chain(follow_stream(rx)),
        keepalive,
        e.stop.clone(),
        deadline,
    )
}

/// The messages of a following stream, as a stream.
fn follow_stream(rx: mpsc::Receiver<Item>) -> impl futures::Stream<Item = Item> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move {
        let m = rx.recv().await?;
        Some((m, rx))
    })
}

/// How a command is started: through `sh`, which prints its own pid (the command's, after
/// `exec`) first, so envd's pids are the sandbox's own (`kill -0 PID` in it works) rather
/// than the library's handles.
const PID_WRAPPER: &str = r#"printf '\000E2B-PID %s\n' "$$" >&2; exec "$@""#;

/// The marker [`PID_WRAPPER`] prints before anything else.
const PID_MARK: &[u8] = b"\0E2B-PID ";

/// The longest a command's first output may take to show its pid.
const PID_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

async fn spawn(e: &Envd, r: StartRequest) -> Result<(u32, mpsc::Receiver<Item>), RpcError> {
    let config_json = r.process.unwrap_or_default();
    let config: Config = serde_json::from_value(config_json.clone())
        .map_err(|err| RpcError::invalid(format!("`process` is not a ProcessConfig: {err}")))?;
    if config.cmd.is_empty() {
        return Err(RpcError::invalid("`process.cmd` is empty"));
    }
    let _slot = e.meta.procs.reserve()?;
    let cwd = super::resolve(&e.meta.home, config.cwd.as_deref().unwrap_or(""))?;
    let mut argv: Vec<String> = ["/bin/sh", "-c", PID_WRAPPER, "envd"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    argv.push(config.cmd.clone());
    argv.extend(config.args.iter().cloned());
    let mut req = ExecRequest::argv(argv).cwd(cwd);
    if e.meta.home != sandbox_core::WORKSPACE_MOUNT {
        // A template's own home is the commands' `HOME` too, as E2B's user's is.
        req = req.env("HOME", e.meta.home.clone());
    }
    for (k, v) in &config.envs {
        req = req.env(k, v);
    }
    let pty = r.pty.map(|p| p.size.unwrap_or(Size { cols: 80, rows: 24 }));
    if let Some(size) = pty {
        let (rows, cols) = size.cells()?;
        req = req.tty(rows, cols);
    }
    let mut p = e.entry.sandbox.spawn(req).await?;
    if pty.is_none() && !r.stdin.unwrap_or(false) {
        // Without stdin the command reads end-of-file, as under envd.
        let _ = p.close_stdin().await;
    }
    let out = if pty.is_some() { "pty" } else { "stdout" };
    let (pid, early) = tokio::time::timeout(PID_WAIT, own_pid(&mut p, pty.is_some()))
        .await
        .unwrap_or_default();
    let own_pid = pid.is_some();
    let pid = match pid {
        Some(pid) => pid,
        // It ended (or said nothing) before its pid: the library's handle stands for it.
        None => u32::try_from(p.id()).map_err(|_| {
            RpcError::new(
                Code::Internal,
                "a process id over 2^32 (envd's pids are 32-bit)",
            )
        })?,
    };
    let proc = Arc::new(Proc {
        pid,
        id: p.id(),
        own_pid,
        tag: r.tag,
        config: config_json,
        handle: p.handle(),
        pty: pty.is_some(),
        follow: Mutex::new((Vec::new(), false)),
    });
    let rx = proc
        .follow()?
        .ok_or_else(|| RpcError::new(Code::Internal, "a process ended before it was started"))?;
    e.meta.procs.lock().insert(pid, Arc::clone(&proc));
    let mut cmdline = config.cmd.clone();
    for a in &config.args {
        cmdline.push(' ');
        cmdline.push_str(a);
    }
    e.meta.log.push(
        Level::Info,
        if pty.is_some() {
            "terminal started"
        } else {
            "process started"
        },
        &[("pid", pid.to_string()), ("cmd", cmdline)],
    );
    let early: Vec<serde_json::Value> = early.into_iter().map(|ev| event_json(ev, out)).collect();
    tokio::spawn(pump(
        Arc::clone(&e.entry),
        Arc::clone(&e.meta),
        proc,
        p,
        early,
    ));
    Ok((pid, rx))
}

/// Reads `p`'s first events until [`PID_WRAPPER`]'s line: the pid, and the events read on
/// the way (the marker taken out). `None` if it ended or spoke otherwise first.
async fn own_pid(p: &mut Process, pty: bool) -> (Option<u32>, Vec<ExecEvent>) {
    let mut seen: Vec<ExecEvent> = Vec::new();
    let mut line: Vec<u8> = Vec::new();
    loop {
        let ev = match p.next().await {
            Some(Ok(ev)) => ev,
            _ => return (None, seen),
        };
        let chunk = match (&ev, pty) {
            (ExecEvent::Stderr(b), false) | (ExecEvent::Stdout(b), true) => b.clone(),
            (ExecEvent::Exit(_), _) => {
                seen.push(ev);
                return (None, seen);
            }
            _ => {
                seen.push(ev);
                continue;
            }
        };
        line.extend_from_slice(&chunk);
        if !line.starts_with(&PID_MARK[..line.len().min(PID_MARK.len())]) {
            seen.push(ev);
            return (None, seen);
        }
        let Some(nl) = line.iter().position(|b| *b == b'\n') else {
            if line.len() > 64 {
                return (None, seen);
            }
            continue;
        };
        let digits = String::from_utf8_lossy(&line[PID_MARK.len().min(nl)..nl])
            .trim()
            .to_string();
        let rest = line[nl + 1..].to_vec();
        if !rest.is_empty() {
            seen.push(if pty {
                ExecEvent::Stdout(rest.into())
            } else {
                ExecEvent::Stderr(rest.into())
            });
        }
        return (digits.parse().ok(), seen);
    }
}

fn event_json(ev: ExecEvent, out: &str) -> serde_json::Value {
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    match ev {
        ExecEvent::Stdout(b) => serde_json::json!({ "event": { "data": { out: b64(&b) } } }),
        ExecEvent::Stderr(b) => serde_json::json!({ "event": { "data": { "stderr": b64(&b) } } }),
        ExecEvent::Exit(r) => end_event(Some(&r), None),
        _ => serde_json::json!({ "event": { "keepalive": {} } }),
    }
}

/// Reads `p` to its end, handing each event to the streams following it; `early`: events
/// read before the pump started. If the sandbox went away under it, the streams are cut
/// rather than ended, as E2B's are when a sandbox dies.
async fn pump(
    entry: Arc<crate::Entry>,
    meta: Arc<super::Meta>,
    proc: Arc<Proc>,
    mut p: Process,
    early: Vec<serde_json::Value>,
) {
    let out = if proc.pty { "pty" } else { "stdout" };
    let mut ended = false;
    let mut status = String::from("cut off: its sandbox went away");
    for m in early {
        if let Some(s) = m["event"]["end"]["status"].as_str() {
            status = s.to_string();
        }
        ended |= m["event"].get("end").is_some();
        send(&proc, Item::Msg(m), ended).await;
    }
    while !ended {
        let end = match p.next().await {
            Some(Ok(ExecEvent::Exit(r))) => end_event(Some(&r), None),
            Some(Ok(ev @ (ExecEvent::Stdout(_) | ExecEvent::Stderr(_)))) => {
                send(&proc, Item::Msg(event_json(ev, out)), false).await;
                continue;
            }
            Some(Ok(_)) => continue,
            Some(Err(err)) => end_event(None, Some(err.to_string())),
            None => end_event(p.exit(), None),
        };
        // A process that exited on its own says nothing of its sandbox; one killed or
        // broken off may have gone with it: then the health check tells (a round trip to
        // the tier, ~25 ms on gVisor, so only then).
        let exited =
            end["event"]["end"]["exited"] == true && end["event"]["end"].get("error").is_none();
        let gone = !exited && entry.sandbox.health_check().await.is_err();
        if !gone {
            if let Some(s) = end["event"]["end"]["status"].as_str() {
                status = s.to_string();
            }
        }
        send(&proc, if gone { Item::Abort } else { Item::Msg(end) }, true).await;
        ended = true;
    }
    meta.procs.lock().remove(&proc.pid);
    meta.log.push(
        Level::Info,
        "process ended",
        &[("pid", proc.pid.to_string()), ("status", status)],
    );
}

/// Sends `item` to every stream following `proc`, dropping those that went away; `last`:
/// no stream may join after it.
async fn send(proc: &Proc, item: Item, last: bool) {
    let subs = {
        let mut f = proc.follow.lock().unwrap_or_else(|p| p.into_inner());
        f.1 |= last;
        f.0.clone()
    };
    let mut gone = false;
    for s in &subs {
        let copy = match &item {
            Item::Msg(m) => Item::Msg(m.clone()),
            Item::Abort => Item::Abort,
            Item::Fail(e) => Item::Fail(e.clone()),
        };
        gone |= s.send(copy).await.is_err();
    }
    if gone {
        let mut f = proc.follow.lock().unwrap_or_else(|p| p.into_inner());
        f.0.retain(|s| !s.is_closed());
    }
}

/// envd's `EndEvent` for a process's result (or the error that ended following it).
fn end_event(r: Option<&ExecResult>, error: Option<String>) -> serde_json::Value {
    let (code, exited, status) = match r.and_then(|r| r.exit_code) {
        Some(c) if c > 128 && r.is_some_and(|r| r.limit.is_none()) && c - 128 <= 64 => {
            (-1, false, format!("signal: {}", signal_name(c - 128)))
        }
        Some(c) => (c, true, format!("exit status {c}")),
        None => (-1, false, "killed".to_string()),
    };
    let error = error.or_else(|| {
        r.and_then(|r| r.limit)
            .map(|l| format!("stopped by its {} limit", l.name()))
    });
    let mut end = serde_json::json!({ "exitCode": code, "exited": exited, "status": status });
    if let (Some(e), Some(o)) = (error, end.as_object_mut()) {
        o.insert("error".into(), serde_json::Value::String(e));
    }
    serde_json::json!({ "event": { "end": end } })
}

fn signal_name(n: i32) -> &'static str {
    match n {
        9 => "killed",
        15 => "terminated",
        2 => "interrupt",
        1 => "hangup",
        13 => "broken pipe",
        _ => "signal",
    }
}

async fn follow(e: Envd, r: StreamRequest<Selected>) -> Response {
    let ka = keepalive(&r);
    let found = r.msg.selector().and_then(|sel| e.meta.procs.find(sel));
    let proc = match found {
        Ok(p) => p,
        Err(err) => return connect::stream_error(err),
    };
    let followed = match proc.follow() {
        Ok(f) => f,
        Err(err) => return connect::stream_error(err),
    };
    let Some(rx) = followed else {
        return connect::stream_error(RpcError::new(
            Code::NotFound,
            format!("process with pid {} has ended", proc.pid),
        ));
    };
    answer(&e, proc.pid, rx, ka, r.deadline)
}

fn list(e: &Envd) -> serde_json::Value {
    let mut all: Vec<serde_json::Value> = e
        .meta
        .procs
        .lock()
        .values()
        .map(|p| {
            let mut v = serde_json::json!({ "config": p.config, "pid": p.pid });
            if let (Some(t), Some(o)) = (&p.tag, v.as_object_mut()) {
                o.insert("tag".into(), serde_json::Value::String(t.clone()));
            }
            v
        })
        .collect();
    all.sort_by_key(|v| v["pid"].as_u64());
    serde_json::json!({ "processes": all })
}

async fn send_input(e: &Envd, r: SendInput) -> Result<serde_json::Value, RpcError> {
    let sel = r
        .process
        .ok_or_else(|| RpcError::invalid("no process selector (`process`)"))?;
    let p = e.meta.procs.find(&sel)?;
    let data = r.input.unwrap_or_default().bytes()?;
    p.handle.write_stdin(data).await?;
    Ok(serde_json::json!({}))
}

async fn close_stdin(e: &Envd, r: Selected) -> Result<serde_json::Value, RpcError> {
    let p = e.meta.procs.find(r.selector()?)?;
    p.handle.close_stdin().await?;
    Ok(serde_json::json!({}))
}

async fn send_signal(e: &Envd, r: SendSignal) -> Result<serde_json::Value, RpcError> {
    let sel = r
        .process
        .ok_or_else(|| RpcError::invalid("no process selector (`process`)"))?;
    let sig = match &r.signal {
        serde_json::Value::String(s) if s == "SIGNAL_SIGKILL" => Signal::Kill,
        serde_json::Value::String(s) if s == "SIGNAL_SIGTERM" => Signal::Terminate,
        serde_json::Value::Number(n) if n.as_u64() == Some(9) => Signal::Kill,
        serde_json::Value::Number(n) if n.as_u64() == Some(15) => Signal::Terminate,
        other => {
            return Err(RpcError::invalid(format!(
                "signal {other}: SIGNAL_SIGKILL or SIGNAL_SIGTERM"
            )))
        }
    };
    let p = e.meta.procs.find(&sel)?;
    e.entry.sandbox.signal(p.id, sig).await?;
    if p.own_pid {
        // The library signals the process group it started; a shell on a terminal puts
        // itself in a group of its own (job control), so it is also signalled by its pid,
        // as envd does (it may have ended already: that is not an error).
        let n = sig.number().to_string();
        let pid = p.pid.to_string();
        let req = ExecRequest::argv([
            "/bin/sh",
            "-c",
            "kill -\"$1\" \"$2\" 2>/dev/null; true",
            "kill",
            &n,
            &pid,
        ]);
        let _ = e.entry.sandbox.exec(req).await;
    }
    Ok(serde_json::json!({}))
}

async fn update(e: &Envd, r: Update) -> Result<serde_json::Value, RpcError> {
    let sel = r
        .process
        .ok_or_else(|| RpcError::invalid("no process selector (`process`)"))?;
    let p = e.meta.procs.find(&sel)?;
    if let Some(size) = r.pty.and_then(|p| p.size) {
        let (rows, cols) = size.cells()?;
        p.handle.resize(rows, cols).await?;
    }
    Ok(serde_json::json!({}))
}

/// `StreamInput`: a client stream (`start` naming the process, then `data` messages), its
/// input written in order; answered once the client's stream ends.
async fn stream_input(e: &Envd, req: Request) -> Response {
    // Read as it comes: each envelope is written before the next is awaited.
    let mut body = req.into_body().into_data_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut target: Option<Arc<Proc>> = None;
    let result: Result<(), RpcError> = async {
        loop {
            // Whole envelopes in `buf` first.
            loop {
                let mut frames = connect::Frames::new(&buf);
                let Some(first) = frames.next() else { break };
                let (flags, data) = match first {
                    Ok(f) => (f.flags, f.data.to_vec()),
                    // Not yet whole: read on (an oversized one is refused at once).
                    Err(err) if err.code == Code::ResourceExhausted => return Err(err),
                    Err(_) => break,
                };
                buf.drain(..5 + data.len());
                if flags != 0 {
                    return Err(RpcError::new(
                        Code::Unimplemented,
                        "compressed or end-of-stream envelopes from a client are not accepted",
                    ));
                }
                let msg: serde_json::Value = serde_json::from_slice(&data).map_err(|err| {
                    RpcError::invalid(format!("a StreamInput message is not JSON: {err}"))
                })?;
                if let Some(start) = msg.get("start") {
                    let sel: Selected = serde_json::from_value(start.clone())
                        .map_err(|err| RpcError::invalid(format!("`start`: {err}")))?;
                    target = Some(e.meta.procs.find(sel.selector()?)?);
                } else if let Some(data) = msg.get("data") {
                    let p = target.as_ref().ok_or_else(|| {
                        RpcError::invalid("`data` before `start` named the process")
                    })?;
                    let input: Input = data
                        .get("input")
                        .cloned()
                        .map(serde_json::from_value)
                        .transpose()
                        .map_err(|err| RpcError::invalid(format!("`data.input`: {err}")))?
                        .unwrap_or_default();
                    p.handle.write_stdin(input.bytes()?).await?;
                }
            }
            match body.next().await {
                Some(Ok(chunk)) => {
                    if buf.len() + chunk.len() > connect::MAX_MESSAGE + 5 {
                        return Err(RpcError::new(
                            Code::ResourceExhausted,
                            "a StreamInput message is over the server's limit",
                        ));
                    }
                    buf.extend_from_slice(&chunk);
                }
                Some(Err(err)) => {
                    return Err(RpcError::new(
                        Code::Canceled,
                        format!("the client's stream broke: {err}"),
                    ))
                }
                None if buf.is_empty() => return Ok(()),
                None => {
                    return Err(RpcError::invalid(
                        "the client's stream ended inside an envelope",
                    ))
                }
            }
        }
    }
    .await;
    match result {
        Ok(()) => connect::stream(
            futures::stream::once(async { Item::Msg(serde_json::json!({})) }),
            None,
            e.stop.clone(),
            None,
        ),
        Err(err) => connect::stream_error(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_say_how_the_process_ended() {
        let ok = end_event(Some(&ExecResult::new(Some(0), vec![], vec![])), None);
        assert_eq!(ok["event"]["end"]["exitCode"], 0);
        assert_eq!(ok["event"]["end"]["exited"], true);
        let killed = end_event(Some(&ExecResult::new(Some(137), vec![], vec![])), None);
        assert_eq!(killed["event"]["end"]["exitCode"], -1);
        assert_eq!(killed["event"]["end"]["status"], "signal: killed");
        let broke = end_event(None, Some("sandbox gone".into()));
        assert_eq!(broke["event"]["end"]["error"], "sandbox gone");
    }
}
