//! Interpreter contexts: a long-lived Python or bash in a sandbox that runs cells one after
//! another with state kept between them, each Python cell's rich outputs reported as on the
//! wasm tier ([`crate::cell`]). Built on [`Sandbox::spawn`], so every tier with background
//! processes has it (container, gVisor, microVM): one `python3` (or `bash`) per context, no
//! process per cell. Several contexts in one sandbox are independent (own globals, working
//! directory, environment).
//!
//! ```no_run
//! # async fn demo(sandbox: std::sync::Arc<dyn sandbox_core::Sandbox>) -> sandbox_core::Result<()> {
//! use sandbox_core::interpreter::{CellOptions, ContextSpec, Interpreter};
//!
//! let mut py = Interpreter::start(sandbox, ContextSpec::python().cwd("/workspace")).await?;
//! py.run("x = 20", &CellOptions::new()).await?;
//! let r = py.run("x * 2 + 2", &CellOptions::new()).await?;
//! assert_eq!(r.outputs[0].text(), Some("42"));
//! # Ok(()) }
//! ```
//!
//! The driver (`cells.py` and `driver.py` beside this file; `driver.sh` for bash) reads its
//! requests from its own stdin (the cells get `/dev/null`) and writes frames on the cell's
//! stdout and stderr, each line starting with a mark chosen here; everything it sends is
//! checked and capped by [`Collector`], because code in the cell can write anything there.

mod scan;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Deserialize;

use crate::cell::{CellError, Collector, FrameKind, Output};
use crate::exec::{ExecEvent, ExecRequest, ExecResult, LimitKind, OutputBuffer};
use crate::process::{Process, ProcessHandle, Signal};
use crate::secrets::Redactor;
use crate::{Error, Language, Result, Sandbox};

use scan::{Piece, Scanner};

/// The cell code every tier's Python driver shares (the wasm tier's session driver too):
/// bundles, `display`, results, errors and figures, sent through a `send(kind, frame)`
/// the driver supplies.
pub const PYTHON_CELLS: &str = include_str!("cells.py");

/// The process tiers' driver loop (after [`PYTHON_CELLS`]).
const PYTHON_DRIVER: &str = include_str!("driver.py");

/// The bash driver: cells `eval`ed in one long-lived shell.
const BASH_DRIVER: &str = include_str!("driver.sh");

/// How long a fresh driver may take to say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// How long an interrupted cell has to end before its interpreter is killed.
const GRACE: Duration = Duration::from_secs(3);

/// Frame bytes one cell may have parsed beyond twice its cap (dropped and malformed frames
/// count too).
const READ_SLACK: u64 = 64 << 10;

/// How long a reader of a cell's events may take nothing before it counts as gone.
const SEND_STALL: Duration = Duration::from_secs(60);

/// `after` from now (far in the future when that overflows).
fn later(after: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(after)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30))
}

/// Frames this small are always parsed (the driver's `done`), whatever the budget says.
const SMALL_FRAME: usize = 256;

/// What a context runs: its language, working directory and environment.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContextSpec {
    /// The language: [`Language::Python`] or [`Language::Shell`] (bash).
    pub language: Language,
    /// Working directory (the sandbox's default when `None`).
    pub cwd: Option<String>,
    /// Environment on top of the sandbox's.
    pub env: BTreeMap<String, String>,
}

impl ContextSpec {
    /// A Python context.
    pub fn python() -> Self {
        ContextSpec {
            language: Language::Python,
            cwd: None,
            env: BTreeMap::new(),
        }
    }

    /// A bash context: cells run in one long-lived shell (variables, functions and the
    /// working directory carry over); a cell's result is its output and exit status (a
    /// status other than 0 is its `error`, named `ExitStatus`).
    pub fn bash() -> Self {
        ContextSpec {
            language: Language::Shell,
            ..ContextSpec::python()
        }
    }

    /// The interpreter a context of this language runs.
    fn program(&self) -> &'static str {
        match self.language {
            Language::Shell => "bash",
            _ => "python3",
        }
    }

    /// Starts in `dir`.
    pub fn cwd(mut self, dir: impl Into<String>) -> Self {
        self.cwd = Some(dir.into());
        self
    }

    /// Sets an environment variable for every cell.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }
}

/// Options for one cell.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CellOptions {
    /// Environment for this cell only (restored afterwards, as E2B's `envs` on `run_code`).
    pub env: BTreeMap<String, String>,
    /// Wall time before the cell is interrupted (default: the spec's
    /// `limits.wall_time_ms`; a context is a long-lived process, like a background one, so a
    /// longer time given here is taken as it is).
    pub timeout: Option<Duration>,
}

impl CellOptions {
    /// No extra environment, the spec's wall time.
    pub fn new() -> Self {
        CellOptions::default()
    }

    /// Sets an environment variable for this cell.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Interrupts the cell after `timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

/// What a cell produces, as it happens (see [`Interpreter::run_streaming`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CellEvent {
    /// A chunk of the cell's stdout.
    Stdout(Bytes),
    /// A chunk of its stderr.
    Stderr(Bytes),
    /// A rich output (the last expression's value, a `display`, a figure).
    Output(Output),
    /// The exception that ended the cell.
    Error(CellError),
}

/// A running driver.
struct Driver {
    proc: Process,
    handle: ProcessHandle,
    out: Scanner,
    err: Scanner,
    version: String,
}

/// A driver dropped while it runs (its interpreter dropped, a cell's future cancelled) is
/// killed: dropping a [`Process`] alone leaves it running.
impl Drop for Driver {
    fn drop(&mut self) {
        if self.proc.exit().is_none() {
            kill_later(self.handle.clone());
        }
    }
}

/// Sends `SIGKILL` to `handle`'s process from a task (for `Drop`, which cannot wait).
fn kill_later(handle: ProcessHandle) {
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            let _ = handle.signal(Signal::Kill).await;
        });
    }
}

/// Kills a process it holds when dropped, unless [`disarm`](Self::disarm)ed: a driver
/// whose start was cancelled or failed.
struct KillOnDrop(Option<ProcessHandle>);

impl KillOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            kill_later(h);
        }
    }
}

/// Kills a context's running interpreter from elsewhere, while a cell holds the context
/// (`&mut Interpreter`): the cell then ends with an `InterpreterExited` error and the next
/// one starts a fresh interpreter. It follows restarts: it always names the interpreter
/// running now.
#[derive(Debug, Clone, Default)]
pub struct Killer(Arc<std::sync::Mutex<Option<ProcessHandle>>>);

impl Killer {
    /// Kills the interpreter running now, if one is.
    pub async fn kill(&self) {
        let h = self.0.lock().ok().and_then(|g| g.clone());
        if let Some(h) = h {
            let _ = h.signal(Signal::Kill).await;
        }
    }

    fn set(&self, h: Option<ProcessHandle>) {
        if let Ok(mut g) = self.0.lock() {
            *g = h;
        }
    }
}

/// One interpreter context in a sandbox. Cells run one at a time (`&mut self`); to stop a
/// running cell from elsewhere, give [`run_streaming`](Self::run_streaming) a `stop` future.
pub struct Interpreter {
    sandbox: Arc<dyn Sandbox>,
    spec: ContextSpec,
    driver: Option<Driver>,
    count: u64,
    killer: Killer,
}

impl std::fmt::Debug for Interpreter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interpreter")
            .field("sandbox", &self.sandbox.id())
            .field("spec", &self.spec)
            .field("running", &self.driver.is_some())
            .field("count", &self.count)
            .finish()
    }
}

#[derive(Deserialize)]
struct Tag {
    t: String,
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    version: Option<String>,
    /// A bash cell's exit status (in its `done`).
    #[serde(default)]
    exit: Option<i32>,
}

/// One cell's progress: what it kept, what is yet to be handed over.
struct Cell {
    n: u64,
    stdout: OutputBuffer,
    stderr: OutputBuffer,
    cells: Collector,
    /// Frame bytes it may still parse.
    budget: u64,
    out_done: bool,
    err_done: bool,
    /// The status its driver reported (bash).
    exit: Option<i32>,
    pending: Vec<CellEvent>,
    /// The sandbox's: what the cell's decoded outputs are redacted with.
    redactor: Redactor,
}

impl Cell {
    fn stdout_piece(&mut self, p: Piece) {
        match p {
            Piece::Text(t) => {
                self.stdout.push(&t);
                self.pending.push(CellEvent::Stdout(t));
            }
            Piece::Dropped => self.cells.mark_truncated(),
            Piece::Frame(f) => self.frame(&f),
        }
    }

    fn stderr_piece(&mut self, p: Piece) {
        match p {
            Piece::Text(t) => {
                self.stderr.push(&t);
                self.pending.push(CellEvent::Stderr(t));
            }
            // Only the driver's `done` travels on stderr.
            Piece::Frame(f) => {
                if let Ok(tag) = serde_json::from_slice::<Tag>(&f) {
                    self.err_done |= tag.t == "done" && tag.n == Some(self.n);
                }
            }
            Piece::Dropped => {}
        }
    }

    fn frame(&mut self, f: &[u8]) {
        if f.len() > SMALL_FRAME {
            let len = f.len() as u64;
            if len > self.budget {
                self.cells.mark_truncated();
                return;
            }
            self.budget -= len;
        }
        let Ok(tag) = serde_json::from_slice::<Tag>(f) else {
            return;
        };
        let kind = match tag.t.as_str() {
            "done" => {
                if tag.n == Some(self.n) {
                    self.out_done = true;
                    self.exit = tag.exit;
                }
                return;
            }
            "result" => FrameKind::Result,
            "display" => FrameKind::Display,
            "error" => FrameKind::Error,
            _ => return,
        };
        if !self.cells.room(kind, f.len()) {
            return;
        }
        if !self.cells.take(kind, f) {
            return;
        }
        let r = &self.redactor;
        let ev = if kind == FrameKind::Error {
            self.cells
                .error()
                .cloned()
                .map(|e| CellEvent::Error(e.redacted(r)))
        } else {
            self.cells
                .outputs()
                .last()
                .cloned()
                .map(|o| CellEvent::Output(o.redacted(r)))
        };
        self.pending.extend(ev);
    }
}

impl Interpreter {
    /// Starts a context in `sandbox`: its driver process, ready for cells.
    ///
    /// # Errors
    /// [`Error::InvalidSpec`] for a language without a driver (or a bash context's working
    /// directory with a line break or NUL byte); [`Error::Unsupported`] on tiers without background
    /// processes, or when the sandbox has no `python3` (`bash`); what starting the driver
    /// failed with otherwise.
    pub async fn start(sandbox: Arc<dyn Sandbox>, spec: ContextSpec) -> Result<Self> {
        if !matches!(spec.language, Language::Python | Language::Shell) {
            return Err(Error::invalid(
                "language",
                format!(
                    "interpreter contexts run Python and bash, not {}",
                    spec.language
                ),
            ));
        }
        if spec.language == Language::Shell
            && spec
                .cwd
                .as_deref()
                .is_some_and(|c| c.contains(['\n', '\r', '\0']))
        {
            return Err(Error::invalid(
                "cwd",
                "a line break or NUL byte in the working directory",
            ));
        }
        let mut me = Interpreter {
            sandbox,
            spec,
            driver: None,
            count: 0,
            killer: Killer::default(),
        };
        me.respawn().await?;
        Ok(me)
    }

    /// The context's spec.
    pub fn spec(&self) -> &ContextSpec {
        &self.spec
    }

    /// Cells run since the context (re)started.
    pub fn execution_count(&self) -> u64 {
        self.count
    }

    /// The interpreter's version (`3.11.2`; bash's `5.2.15`), once it is running.
    pub fn version(&self) -> Option<&str> {
        self.driver.as_ref().map(|d| d.version.as_str())
    }

    /// What kills this context's interpreter from elsewhere (see [`Killer`]).
    pub fn killer(&self) -> Killer {
        self.killer.clone()
    }

    /// The count the next cell will have.
    pub fn next_count(&self) -> u64 {
        if self.driver.is_some() {
            self.count + 1
        } else {
            1
        }
    }

    /// Ends the interpreter and starts a fresh one: every variable is gone, the count starts
    /// again.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub async fn restart(&mut self) -> Result<()> {
        self.stop().await;
        self.respawn().await
    }

    /// Ends the interpreter (killing a cell still running).
    pub async fn close(mut self) {
        self.stop().await;
    }

    /// Lets a driver that is gone (or failing) go: the next cell starts a fresh one.
    fn forget(&mut self) {
        self.killer.set(None);
        self.driver = None;
    }

    async fn stop(&mut self) {
        self.killer.set(None);
        if let Some(mut d) = self.driver.take() {
            let _ = d.handle.signal(Signal::Kill).await;
            let _ = tokio::time::timeout(GRACE, d.proc.wait(None)).await;
        }
    }

    /// A fresh driver, now the running one.
    async fn respawn(&mut self) -> Result<()> {
        self.count = 0;
        let d = self.spawn().await?;
        self.killer.set(Some(d.handle.clone()));
        self.driver = Some(d);
        Ok(())
    }

    async fn spawn(&self) -> Result<Driver> {
        let tier = self.sandbox.tier();
        let mark = format!("\x1eagent-sandbox:{}:", uuid::Uuid::new_v4().simple());
        let bash = self.spec.language == Language::Shell;
        let mut req = if bash {
            ExecRequest::argv(["bash", "--noprofile", "--norc", "-c", BASH_DRIVER, "bash"])
        } else {
            let program = format!("{PYTHON_CELLS}\n{PYTHON_DRIVER}");
            ExecRequest::argv(["python3", "-c", program.as_str()])
        };
        req.env = self.spec.env.clone();
        let mut proc = self.sandbox.spawn(req).await?;
        let handle = proc.handle();
        let guard = KillOnDrop(Some(handle.clone()));
        let line = if bash {
            format!("{mark}\n{}\n", self.spec.cwd.as_deref().unwrap_or("")).into_bytes()
        } else {
            let hello = serde_json::json!({ "mark": mark, "cwd": self.spec.cwd });
            let mut line =
                serde_json::to_vec(&hello).map_err(|e| Error::backend(tier, e.to_string()))?;
            line.push(b'\n');
            line
        };
        handle.write_stdin(line).await?;
        let limit = 4096;
        let mut out = Scanner::new(mark.as_bytes(), limit);
        let mut err_text = Vec::new();
        let mut pieces = Vec::new();
        let ready = async {
            loop {
                match proc.next().await {
                    Some(Ok(ExecEvent::Stdout(b))) => {
                        out.push(&b, &mut pieces);
                        for p in pieces.drain(..) {
                            if let Piece::Frame(f) = p {
                                if let Ok(tag) = serde_json::from_slice::<Tag>(&f) {
                                    if tag.t == "ready" {
                                        return Ok(tag.version.unwrap_or_default());
                                    }
                                }
                            }
                        }
                    }
                    Some(Ok(ExecEvent::Stderr(b))) => {
                        if err_text.len() < 8192 {
                            err_text.extend_from_slice(&b);
                        }
                    }
                    Some(Ok(ExecEvent::Exit(r))) => return Err(Ok(r.exit_code)),
                    Some(Err(e)) => return Err(Err(e)),
                    None => return Err(Ok(None)),
                }
            }
        };
        let version = match tokio::time::timeout(START_TIMEOUT, ready).await {
            Ok(Ok(v)) => v,
            Ok(Err(Err(e))) => return Err(e),
            Ok(Err(Ok(code))) => {
                let said = String::from_utf8_lossy(&err_text);
                let said = said.trim();
                let program = self.spec.program();
                if code == Some(127) {
                    return Err(Error::unsupported(
                        tier,
                        format!(
                            "{} interpreter contexts without `{program}` in the sandbox ({said})",
                            self.spec.language
                        ),
                    ));
                }
                return Err(Error::backend(
                    tier,
                    format!("`{program}` for the context did not start (exit {code:?}): {said}"),
                ));
            }
            // (The guard kills it.)
            Err(_) => {
                return Err(Error::Timeout {
                    what: format!("the context's `{}` start", self.spec.program()),
                    after: START_TIMEOUT,
                });
            }
        };
        guard.disarm();
        Ok(Driver {
            proc,
            handle,
            out,
            err: Scanner::new(mark.as_bytes(), limit),
            version,
        })
    }

    /// Runs one cell to its end: its output, rich outputs and error in an [`ExecResult`]
    /// (`exit_code` 0, or 1 when it raised; a bash cell's own status; `limit` `WallTime`
    /// when it was interrupted for its timeout).
    ///
    /// # Errors
    /// [`Error::InvalidSpec`] for a bash cell with a NUL byte, or an environment variable
    /// whose name is not a shell name (or one bash or the driver keeps: `UID`, `__asb_*`); when the interpreter cannot be (re)started or the
    /// sandbox fails under it.
    pub async fn run(&mut self, code: &str, opts: &CellOptions) -> Result<ExecResult> {
        self.run_streaming(code, opts, None).await
    }

    /// [`run`](Self::run), sending each event to `events` as it happens (waiting for room:
    /// a slow reader slows the cell down, as a full pipe does). When the receiver is
    /// dropped (a client went away) the cell is interrupted, as Ctrl-C does
    /// (`KeyboardInterrupt`); a cell that has not ended a few seconds after an interrupt is
    /// killed with its interpreter. An interpreter that died (killed, or a cell that called
    /// `os._exit`) is started afresh by the next cell, its state gone: the cell it died in
    /// says so in its `error`.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    pub async fn run_streaming(
        &mut self,
        code: &str,
        opts: &CellOptions,
        events: Option<&tokio::sync::mpsc::Sender<CellEvent>>,
    ) -> Result<ExecResult> {
        let bash = self.spec.language == Language::Shell;
        let bash_env = if bash {
            if code.contains('\0') {
                return Err(Error::invalid("code", "a bash cell cannot hold a NUL byte"));
            }
            Some(bash_env(&opts.env)?)
        } else {
            None
        };
        if self.driver.is_none() {
            self.respawn().await?;
        }
        let redactor = self.sandbox.redactor();
        let spec = self.sandbox.spec();
        let cap = spec.limits.output_bytes;
        let timeout = opts.timeout.unwrap_or_else(|| spec.limits.wall_time());
        self.count += 1;
        let n = self.count;
        let line = match bash_env {
            Some((pre, post)) => {
                let mut line =
                    format!("{n} {} {} {}\n", pre.len(), code.len(), post.len()).into_bytes();
                for part in [pre.as_bytes(), code.as_bytes(), post.as_bytes()] {
                    line.extend_from_slice(part);
                }
                line
            }
            None => {
                let request =
                    serde_json::json!({ "n": n, "code": code, "env": opts.env, "cap": cap });
                let mut line = serde_json::to_vec(&request)
                    .map_err(|e| Error::backend(self.sandbox.tier(), e.to_string()))?;
                line.push(b'\n');
                line
            }
        };
        let Some(d) = self.driver.as_mut() else {
            return Err(Error::backend(self.sandbox.tier(), "no interpreter"));
        };
        let mut cell = Cell {
            n,
            stdout: OutputBuffer::new(cap),
            stderr: OutputBuffer::new(cap),
            cells: Collector::new(cap),
            budget: cap.saturating_mul(2).saturating_add(READ_SLACK),
            out_done: false,
            err_done: false,
            exit: None,
            pending: Vec::new(),
            redactor: redactor.clone(),
        };
        d.out.limit = usize::try_from(cap.saturating_add(4096)).unwrap_or(usize::MAX);
        d.err.limit = SMALL_FRAME;
        let mut exited: Option<ExecResult> = None;
        let mut interrupted = false;
        let mut timed_out = false;
        let mut killed = false;
        let mut listening = events.is_some();
        let mut deadline = later(timeout);
        let mut pieces = Vec::new();
        let closed = async {
            match events {
                Some(tx) => tx.closed().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(closed);
        // The request, raced against the deadline and the caller: a driver that stopped
        // reading (a cell that forged its `done` and went on) never blocks us.
        tokio::select! {
            r = d.handle.write_stdin(line) => {
                if let Err(e) = r {
                    // The driver is gone: the next cell starts a fresh one.
                    self.forget();
                    return Err(e);
                }
            }
            () = tokio::time::sleep_until(deadline) => {
                (killed, timed_out) = (true, true);
            }
            () = &mut closed, if listening => {
                listening = false;
                killed = true;
            }
        }
        let drained = |c: &Cell| c.out_done && c.err_done;
        'cell: while !(killed || drained(&cell)) && exited.is_none() {
            // Why the cell is to stop now: the caller left, or its time is up.
            let mut stop_now = None;
            tokio::select! {
                ev = d.proc.next() => match ev {
                    Some(Ok(ExecEvent::Stdout(b))) => {
                        d.out.push(&b, &mut pieces);
                        for p in pieces.drain(..) {
                            cell.stdout_piece(p);
                        }
                    }
                    Some(Ok(ExecEvent::Stderr(b))) => {
                        d.err.push(&b, &mut pieces);
                        for p in pieces.drain(..) {
                            cell.stderr_piece(p);
                        }
                    }
                    Some(Ok(ExecEvent::Exit(r))) => exited = Some(r),
                    Some(Err(e)) => {
                        self.forget();
                        return Err(e);
                    }
                    None => exited = Some(ExecResult::new(None, Vec::new(), Vec::new())),
                },
                () = &mut closed, if listening => {
                    listening = false;
                    stop_now = Some(false);
                }
                () = tokio::time::sleep_until(deadline) => stop_now = Some(true),
            }
            // Hand the events over, waiting for room (not past the deadline).
            for ev in std::mem::take(&mut cell.pending) {
                let Some(tx) = events.filter(|_| listening) else {
                    continue;
                };
                let stall = later(SEND_STALL).min(deadline);
                match tokio::time::timeout_at(stall, tx.send(ev)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => {
                        listening = false;
                        stop_now.get_or_insert(false);
                    }
                    // A reader that takes nothing for a minute has left.
                    Err(_) if stall < deadline => {
                        listening = false;
                        stop_now.get_or_insert(false);
                        break;
                    }
                    Err(_) => {
                        stop_now = Some(true);
                        break;
                    }
                }
            }
            match stop_now {
                None => {}
                Some(_) if interrupted && tokio::time::Instant::now() >= deadline => {
                    killed = true;
                    break 'cell;
                }
                Some(_) if interrupted => {}
                Some(for_time) => {
                    interrupted = true;
                    timed_out = for_time;
                    let _ = d.handle.signal(Signal::Interrupt).await;
                    deadline = later(GRACE);
                }
            }
        }
        let Cell {
            mut stdout,
            mut stderr,
            cells,
            exit,
            ..
        } = cell;
        let mut tail = Vec::new();
        // What the scanners held back is the cell's (a mark that never came).
        if let Some(t) = d.out.finish() {
            stdout.push(&t);
            tail.push(CellEvent::Stdout(t));
        }
        if let Some(t) = d.err.finish() {
            stderr.push(&t);
            tail.push(CellEvent::Stderr(t));
        }
        let mut kept = cells.finish();
        kept.outputs = kept
            .outputs
            .into_iter()
            .map(|o| o.redacted(&redactor))
            .collect();
        kept.error = kept.error.map(|e| e.redacted(&redactor));
        kept.value = kept.value.map(|v| crate::cell::redact_json(&redactor, v));
        let mut exit_code = match exit {
            Some(status) if bash => Some(status),
            _ => Some(i32::from(kept.error.is_some())),
        };
        if killed {
            self.stop().await;
            let e = CellError::new(
                "InterpreterKilled",
                "the cell did not end when it was to stop (interrupted, or its request not \
                 taken): its interpreter was killed, and the next cell starts a fresh one",
                Vec::new(),
            );
            tail.push(CellEvent::Error(e.clone()));
            kept.error = Some(e);
            exit_code = None;
        } else if let Some(r) = exited {
            self.forget();
            let e = CellError::new(
                "InterpreterExited",
                format!(
                    "the interpreter exited (status {:?}): its state is gone, and the next \
                     cell starts a fresh one",
                    r.exit_code
                ),
                Vec::new(),
            );
            tail.push(CellEvent::Error(e.clone()));
            kept.error = Some(e);
            exit_code = r.exit_code;
        }
        if let Some(tx) = events.filter(|_| listening) {
            for ev in tail {
                if tx.send(ev).await.is_err() {
                    break;
                }
            }
        }
        let mut r = ExecResult::from_output(exit_code, stdout, stderr, &Redactor::default());
        r.truncated |= kept.truncated;
        r.outputs = kept.outputs;
        r.error = kept.error;
        r.value = kept.value;
        if timed_out {
            r.limit = Some(LimitKind::WallTime);
        }
        Ok(r)
    }
}

/// Variables bash keeps read-only: a cell cannot be given them.
const BASH_READONLY: [&str; 6] = [
    "BASHOPTS",
    "BASH_VERSINFO",
    "EUID",
    "PPID",
    "SHELLOPTS",
    "UID",
];

/// A bash cell's environment: the lines that set `env` (remembering what each name held)
/// and the lines that put it back after the cell.
fn bash_env(env: &BTreeMap<String, String>) -> Result<(String, String)> {
    let mut pre = String::new();
    let mut post = String::new();
    for (i, (k, v)) in env.iter().enumerate() {
        let name_ok = k
            .chars()
            .next()
            .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
            && k.chars().all(|c| c == '_' || c.is_ascii_alphanumeric());
        if !name_ok || v.contains('\0') {
            return Err(Error::invalid(
                "env",
                format!("`{k}`: not a shell name, or a NUL byte in its value"),
            ));
        }
        if k.starts_with("__asb_") || BASH_READONLY.contains(&k.as_str()) {
            return Err(Error::invalid(
                "env",
                format!("`{k}`: a name bash or the context's driver keeps for itself"),
            ));
        }
        let quoted = format!("'{}'", v.replace('\'', "'\\''"));
        pre.push_str(&format!(
            "__asb_had{i}=${{{k}+x}}; __asb_was{i}=${{{k}-}}; export {k}={quoted}\n"
        ));
        post.push_str(&format!(
            "if [ -n \"$__asb_had{i}\" ]; then export {k}=\"$__asb_was{i}\"; else unset {k}; fi; \
             unset __asb_had{i} __asb_was{i}\n"
        ));
    }
    Ok((pre, post))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The environment lines, run by the host's bash around a cell that prints what it
    /// sees: every value arrives as given, and what was there before comes back.
    #[test]
    fn bash_env_quotes_values_and_puts_back_what_was_there() {
        let odd = "it's $HOME `id` \"q\" \\ é\nline";
        let env = BTreeMap::from([
            ("KEPT".to_string(), odd.to_string()),
            ("NEW".to_string(), String::new()),
        ]);
        let (pre, post) = bash_env(&env).unwrap();
        let script = format!(
            "KEPT=before; export KEPT\n{pre}printf '%s|%s|' \"$KEPT\" \"${{NEW-unset}}\"\n{post}\
             printf '%s|%s' \"$KEPT\" \"${{NEW-unset}}\""
        );
        let out = std::process::Command::new("bash")
            .args(["--noprofile", "--norc", "-c", &script])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("{odd}||before|unset"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for bad in [
            "A;id",
            "1A",
            "",
            "A-B",
            "Ä",
            "__asb_code",
            "UID",
            "SHELLOPTS",
        ] {
            let env = BTreeMap::from([(bad.to_string(), "v".to_string())]);
            assert!(bash_env(&env).is_err(), "{bad:?} taken");
        }
        let env = BTreeMap::from([("A".to_string(), "a\0b".to_string())]);
        assert!(bash_env(&env).is_err(), "a NUL taken");
    }
}
