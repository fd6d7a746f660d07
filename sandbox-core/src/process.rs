//! Background processes: commands that keep running after the call that started them.
//!
//! [`Sandbox::spawn`](crate::Sandbox::spawn) starts one and returns a [`Process`]: write to
//! its stdin, read its output as it comes, signal it, wait for it. It counts against the
//! sandbox's limits (it lives in the sandbox's cgroup, or its VM) and dies with the sandbox.
//!
//! Output reaches the caller through a bounded queue: while nobody reads, the process blocks
//! on its next write, as on a full pipe, and our memory stays bounded. Every chunk is
//! redacted like an exec's output (also a secret split across chunks).
//! [`Process::wait`] keeps at most the spec's `output_bytes` of what was not read yet and
//! drops the rest (`truncated`), so a chatty server can be waited for without reading it.
//!
//! Backends build a [`Process`] from a channel of [`ExecEvent`]s and a [`ProcessControl`],
//! and keep a [`ProcessTable`] for [`Sandbox::processes`](crate::Sandbox::processes).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::exec::{ExecEvent, ExecResult};
use crate::{Error, Result, Tty};

/// A process's id in its sandbox: unique for the sandbox's life, never reused.
pub type ProcessId = u64;

/// A signal a caller may send to a process (to its whole process group).
/// `#[non_exhaustive]`: later versions add signals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Signal {
    /// `SIGHUP`: the terminal hung up.
    Hangup,
    /// `SIGINT`: what Ctrl-C sends.
    Interrupt,
    /// `SIGQUIT`.
    Quit,
    /// `SIGKILL`: cannot be caught.
    Kill,
    /// `SIGUSR1`.
    User1,
    /// `SIGUSR2`.
    User2,
    /// `SIGTERM`: asks the process to end.
    Terminate,
}

impl Signal {
    /// Every signal, in number order.
    pub const ALL: [Signal; 7] = [
        Signal::Hangup,
        Signal::Interrupt,
        Signal::Quit,
        Signal::Kill,
        Signal::User1,
        Signal::User2,
        Signal::Terminate,
    ];

    /// Its number on Linux (x86-64 and arm64 agree on these).
    pub fn number(self) -> i32 {
        match self {
            Signal::Hangup => 1,
            Signal::Interrupt => 2,
            Signal::Quit => 3,
            Signal::Kill => 9,
            Signal::User1 => 10,
            Signal::User2 => 12,
            Signal::Terminate => 15,
        }
    }

    /// Its short name: `INT`, `TERM`, ...
    pub fn name(self) -> &'static str {
        match self {
            Signal::Hangup => "HUP",
            Signal::Interrupt => "INT",
            Signal::Quit => "QUIT",
            Signal::Kill => "KILL",
            Signal::User1 => "USR1",
            Signal::User2 => "USR2",
            Signal::Terminate => "TERM",
        }
    }
}

impl std::fmt::Display for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SIG{}", self.name())
    }
}

impl std::str::FromStr for Signal {
    type Err = Error;

    /// `INT`, `SIGINT`, `int` or `2`.
    fn from_str(s: &str) -> Result<Self> {
        let up = s.trim().to_ascii_uppercase();
        let bare = up.strip_prefix("SIG").unwrap_or(&up);
        Signal::ALL
            .into_iter()
            .find(|sig| sig.name() == bare || sig.number().to_string() == bare)
            .ok_or_else(|| {
                Error::invalid(
                    "signal",
                    format!("`{s}` is not one of HUP, INT, QUIT, KILL, USR1, USR2, TERM"),
                )
            })
    }
}

/// Where a process is in its life. `#[non_exhaustive]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum ProcessState {
    /// It runs (or is stopped with its sandbox).
    Running,
    /// It ended: its exit code (`128 + n` when signal `n` killed it), when known.
    Exited {
        /// The exit code.
        exit_code: Option<i32>,
    },
}

/// One process of a sandbox, as [`Sandbox::processes`](crate::Sandbox::processes) lists it.
/// `#[non_exhaustive]`: later versions add fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ProcessInfo {
    /// Its id.
    pub id: ProcessId,
    /// The command as started (an argv joined with spaces, or the code string's first line).
    pub command: String,
    /// When it was started.
    pub started_at: SystemTime,
    /// Running or exited.
    pub state: ProcessState,
}

/// What a backend does for a [`Process`]: its stdin and its signals. The output travels in
/// the event channel given to [`Process::new`].
#[async_trait]
pub trait ProcessControl: Send + Sync + 'static {
    /// Writes `data` to the process's stdin, waiting while the pipe is full.
    /// [`Error::ProcessExited`] once it ended or its stdin was closed.
    async fn write_stdin(&self, data: Bytes) -> Result<()>;

    /// Closes the process's stdin (it reads EOF). Closing twice is a no-op.
    async fn close_stdin(&self) -> Result<()>;

    /// Sends `signal` to the process's group. [`Error::ProcessExited`] once it ended.
    async fn signal(&self, signal: Signal) -> Result<()>;

    /// Resizes the process's terminal. The default: [`Error::InvalidSpec`] (it has none).
    async fn resize(&self, tty: crate::Tty) -> Result<()> {
        let _ = tty;
        Err(Error::invalid(
            "tty",
            "this process has no terminal to resize (spawn it with ExecRequest::tty)",
        ))
    }
}

/// A process's input side: stdin, signals and terminal size, without its output. Made by
/// [`Process::handle`]; cheap to clone and `Send`, so one task can type while another reads.
#[derive(Clone)]
pub struct ProcessHandle {
    id: ProcessId,
    control: Arc<dyn ProcessControl>,
}

impl std::fmt::Debug for ProcessHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessHandle")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl ProcessHandle {
    /// The process's id in its sandbox.
    pub fn id(&self) -> ProcessId {
        self.id
    }

    /// As [`Process::write_stdin`].
    pub async fn write_stdin(&self, data: impl Into<Bytes>) -> Result<()> {
        self.control.write_stdin(data.into()).await
    }

    /// As [`Process::close_stdin`].
    pub async fn close_stdin(&self) -> Result<()> {
        self.control.close_stdin().await
    }

    /// As [`Process::signal`].
    pub async fn signal(&self, signal: Signal) -> Result<()> {
        self.control.signal(signal).await
    }

    /// As [`Process::resize`].
    pub async fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        let tty = crate::Tty::new(rows, cols);
        tty.validate()?;
        self.control.resize(tty).await
    }
}

/// A running command of a sandbox (see the [module docs](self)).
///
/// Dropping a `Process` does not stop it: it runs until it exits, is signalled (through
/// another handle's id, or [`Sandbox::signal`](crate::Sandbox::signal)) or the sandbox ends.
pub struct Process {
    /// Its id and its input side.
    handle: ProcessHandle,
    events: mpsc::Receiver<Result<ExecEvent>>,
    cap: u64,
    pending: ExecResult,
    done: Option<ExecResult>,
    /// The sandbox failed under it (the error was delivered): nothing more comes.
    failed: bool,
}

impl std::fmt::Debug for Process {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Process")
            .field("id", &self.handle.id)
            .field("done", &self.done.is_some())
            .finish_non_exhaustive()
    }
}

/// A process's output as a stream: chunks, then the final [`ExecEvent::Exit`] (what
/// [`Process::next`] returns, for `futures::StreamExt` and friends).
impl futures::Stream for Process {
    type Item = Result<ExecEvent>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.get_mut().poll_event(cx)
    }
}

impl Process {
    /// A process fed by `events` (redacted output chunks, then [`ExecEvent::Exit`]) and driven
    /// through `control`. `output_cap`: what [`wait`](Self::wait) keeps of unread output.
    pub fn new(
        id: ProcessId,
        events: mpsc::Receiver<Result<ExecEvent>>,
        control: Arc<dyn ProcessControl>,
        output_cap: u64,
    ) -> Self {
        Process {
            handle: ProcessHandle { id, control },
            events,
            cap: output_cap,
            pending: ExecResult::new(None, Vec::new(), Vec::new()),
            done: None,
            failed: false,
        }
    }

    /// Its id in the sandbox.
    pub fn id(&self) -> ProcessId {
        self.handle.id
    }

    /// Writes to its stdin (waits while the pipe is full). [`Error::ProcessExited`] once it
    /// ended or its stdin was closed.
    pub async fn write_stdin(&self, data: impl Into<Bytes>) -> Result<()> {
        self.handle.write_stdin(data).await
    }

    /// Closes its stdin: it reads EOF.
    pub async fn close_stdin(&self) -> Result<()> {
        self.handle.close_stdin().await
    }

    /// Sends `signal` to its process group. [`Error::ProcessExited`] once it ended.
    pub async fn signal(&self, signal: Signal) -> Result<()> {
        self.handle.signal(signal).await
    }

    /// Resizes its terminal (it gets `SIGWINCH`). [`Error::InvalidSpec`] for a process
    /// without one, [`Error::ProcessExited`] once it ended.
    pub async fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        self.handle.resize(rows, cols).await
    }

    /// A cloneable handle on its stdin, signals and terminal, for another task to drive it
    /// while this one reads its output (the handle works after the `Process` is dropped).
    pub fn handle(&self) -> ProcessHandle {
        self.handle.clone()
    }

    /// The next output chunk, or the final [`ExecEvent::Exit`]; `None` after that. An error
    /// means the sandbox failed under the process. The same events as the process's
    /// [`Stream`](futures::Stream) implementation.
    pub async fn next(&mut self) -> Option<Result<ExecEvent>> {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }

    fn poll_event(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<ExecEvent>>> {
        use std::task::Poll;
        if self.done.is_some() || self.failed {
            return Poll::Ready(None);
        }
        let Poll::Ready(event) = self.events.poll_recv(cx) else {
            return Poll::Pending;
        };
        Poll::Ready(match event {
            Some(Ok(ExecEvent::Exit(r))) => {
                self.done = Some(r.clone());
                Some(Ok(ExecEvent::Exit(r)))
            }
            Some(Err(e)) => {
                self.failed = true;
                Some(Err(e))
            }
            Some(ev) => Some(ev),
            None => {
                self.failed = true;
                Some(Err(Error::io(
                    format!("process {} ended without an exit status", self.handle.id),
                    std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                )))
            }
        })
    }

    /// Waits for the process to exit, up to `timeout` (`None`: no bound), and returns how it
    /// ended with the output not read through [`next`](Self::next) (up to the spec's
    /// `output_bytes`; the rest is dropped and `truncated` set). On timeout the process keeps
    /// running: [`Error::Timeout`], and a later `wait` still returns that output.
    pub async fn wait(&mut self, timeout: Option<Duration>) -> Result<ExecResult> {
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        loop {
            if let Some(done) = &self.done {
                let mut r = done.clone();
                r.stdout = std::mem::take(&mut self.pending.stdout);
                r.stderr = std::mem::take(&mut self.pending.stderr);
                r.truncated |= std::mem::take(&mut self.pending.truncated);
                return Ok(r);
            }
            let ev = match deadline {
                None => self.events.recv().await,
                Some(d) => match tokio::time::timeout_at(d, self.events.recv()).await {
                    Ok(ev) => ev,
                    Err(_) => {
                        return Err(Error::Timeout {
                            what: format!("waiting for process {}", self.handle.id),
                            after: timeout.unwrap_or_default(),
                        })
                    }
                },
            };
            match ev {
                Some(Ok(ExecEvent::Stdout(b))) => self.keep(b, true),
                Some(Ok(ExecEvent::Stderr(b))) => self.keep(b, false),
                Some(Ok(ExecEvent::Exit(r))) => self.done = Some(r),
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(Error::io(
                        format!("process {} ended without an exit status", self.handle.id),
                        std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                    ))
                }
            }
        }
    }

    /// How it ended, once [`next`](Self::next) or [`wait`](Self::wait) saw it end.
    pub fn exit(&self) -> Option<&ExecResult> {
        self.done.as_ref()
    }

    fn keep(&mut self, b: Bytes, stdout: bool) {
        let p = &mut self.pending;
        let held = (p.stdout.len() + p.stderr.len()) as u64;
        let room = usize::try_from(self.cap.saturating_sub(held)).unwrap_or(usize::MAX);
        let take = room.min(b.len());
        if take < b.len() {
            p.truncated = true;
        }
        let dst = if stdout { &mut p.stdout } else { &mut p.stderr };
        dst.extend_from_slice(&b[..take]);
    }
}

/// Closes a process's input in `slot`: a pipe is dropped (its reader sees the end); a
/// terminal (`tty`) stays open and gets the end-of-file character (Ctrl-D), which a reader in
/// canonical mode takes as the end. For backends' [`ProcessControl::close_stdin`].
pub async fn close_input<W>(slot: &tokio::sync::Mutex<Option<W>>, tty: bool) -> Result<()>
where
    W: tokio::io::AsyncWrite + Unpin + Send,
{
    use tokio::io::AsyncWriteExt;
    let mut g = slot.lock().await;
    if tty {
        if let Some(input) = g.as_mut() {
            let _ = input.write_all(b"\x04").await;
        }
    } else {
        g.take();
    }
    Ok(())
}

/// The error for resizing process `id`, which has no terminal.
pub fn no_terminal(id: ProcessId) -> Error {
    Error::invalid(
        "tty",
        format!("process {id} has no terminal to resize (spawn it with ExecRequest::tty)"),
    )
}

/// Resizes the terminal `master` of process `id` (`None`: it has none, [`no_terminal`];
/// `ended`: [`Error::ProcessExited`]). For backends' [`ProcessControl::resize`].
pub fn resize_terminal(
    id: ProcessId,
    master: Option<&crate::PtyMaster>,
    ended: bool,
    size: Tty,
) -> Result<()> {
    let Some(m) = master else {
        return Err(no_terminal(id));
    };
    if ended {
        return Err(Error::ProcessExited { id });
    }
    m.resize(size)
        .map_err(|e| Error::io("resize the terminal", e))
}

/// For backends: writes `data` to a process's input held in `slot` (`None` once closed),
/// waiting while it is full. [`Error::ProcessExited`] when the process `ended`, the input
/// was closed, or nothing reads it any more (the slot is then emptied).
pub async fn write_input<W>(
    id: ProcessId,
    ended: bool,
    slot: &tokio::sync::Mutex<Option<W>>,
    data: &[u8],
) -> Result<()>
where
    W: tokio::io::AsyncWrite + Unpin + Send,
{
    use tokio::io::AsyncWriteExt;
    let exited = Error::ProcessExited { id };
    if ended {
        return Err(exited);
    }
    let mut g = slot.lock().await;
    let Some(w) = g.as_mut() else {
        return Err(exited);
    };
    match w.write_all(data).await {
        Ok(()) => Ok(()),
        // The process closed its input or exited: nothing will read this any more.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            *g = None;
            Err(exited)
        }
        Err(e) => Err(Error::io(format!("write to process {id}'s stdin"), e)),
    }
}

/// A sandbox's processes, for backends: ids, what runs, what ended, and the controls of the
/// running ones (for [`Sandbox::signal`](crate::Sandbox::signal)). Cloning shares the table.
#[derive(Clone, Default)]
pub struct ProcessTable {
    inner: Arc<Mutex<TableInner>>,
}

impl std::fmt::Debug for ProcessTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessTable")
            .field("procs", &self.lock().procs)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct TableInner {
    next: ProcessId,
    procs: BTreeMap<ProcessId, ProcessInfo>,
    live: BTreeMap<ProcessId, Arc<dyn ProcessControl>>,
}

/// How many exited processes a table remembers (the oldest are forgotten first).
const EXITED_KEPT: usize = 64;

impl ProcessTable {
    /// An empty table; ids start at 1.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a new running process started with `command`; returns its id.
    pub fn start(&self, command: impl Into<String>) -> ProcessId {
        let mut t = self.lock();
        t.next += 1;
        let id = t.next;
        t.procs.insert(
            id,
            ProcessInfo {
                id,
                command: command.into(),
                started_at: SystemTime::now(),
                state: ProcessState::Running,
            },
        );
        id
    }

    /// Gives running process `id` its control, for [`signal`](Self::signal).
    pub fn attach(&self, id: ProcessId, control: Arc<dyn ProcessControl>) {
        let mut t = self.lock();
        if t.procs
            .get(&id)
            .is_some_and(|p| p.state == ProcessState::Running)
        {
            t.live.insert(id, control);
        }
    }

    /// Signals process `id` through its control: [`Error::NotFound`] for an id never given,
    /// [`Error::ProcessExited`] for one that ended.
    pub async fn signal(&self, id: ProcessId, signal: Signal) -> Result<()> {
        let control = {
            let t = self.lock();
            match t.live.get(&id) {
                Some(c) => Arc::clone(c),
                None if t.procs.contains_key(&id) || (1..=t.next).contains(&id) => {
                    return Err(Error::ProcessExited { id })
                }
                None => {
                    return Err(Error::NotFound {
                        path: format!("process {id}"),
                    })
                }
            }
        };
        control.signal(signal).await
    }

    /// Records that process `id` ended with `exit_code` (its control is dropped).
    pub fn exited(&self, id: ProcessId, exit_code: Option<i32>) {
        let mut t = self.lock();
        t.live.remove(&id);
        if let Some(p) = t.procs.get_mut(&id) {
            p.state = ProcessState::Exited { exit_code };
        }
        let exited: Vec<ProcessId> = t
            .procs
            .values()
            .filter(|p| p.state != ProcessState::Running)
            .map(|p| p.id)
            .collect();
        for old in exited.iter().take(exited.len().saturating_sub(EXITED_KEPT)) {
            t.procs.remove(old);
        }
    }

    /// Every process: the running ones and the last ones that ended, by id.
    pub fn list(&self) -> Vec<ProcessInfo> {
        self.lock().procs.values().cloned().collect()
    }

    /// The running processes for a person: ``1 (`sleep 9`), 3 (`python3 -m http.server`)``;
    /// `None` when none runs (what a backend that cannot snapshot them names in its refusal).
    pub fn running_summary(&self) -> Option<String> {
        let running: Vec<String> = self
            .lock()
            .procs
            .values()
            .filter(|p| p.state == ProcessState::Running)
            .map(|p| format!("{} (`{}`)", p.id, p.command))
            .collect();
        (!running.is_empty()).then(|| running.join(", "))
    }

    /// Whether `id` is known and still running.
    pub fn is_running(&self, id: ProcessId) -> bool {
        self.lock()
            .procs
            .get(&id)
            .is_some_and(|p| p.state == ProcessState::Running)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TableInner> {
        // A panic while holding the lock leaves plain data behind: keep using it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The one-line form of a command for [`ProcessInfo::command`].
pub fn command_line(cmd: &crate::Command) -> String {
    match cmd {
        crate::Command::Argv(a) => a.join(" "),
        crate::Command::Code(c) => {
            let first = c.lines().next().unwrap_or_default();
            if c.lines().nth(1).is_some() {
                format!("{first} …")
            } else {
                first.to_string()
            }
        }
    }
}

/// Puts every signal's disposition back to its default (`SIG_DFL`) and empties the calling
/// thread's signal mask, in a child between `fork` and `execve` (which keeps ignored
/// dispositions and the mask). Signals 1 to 64 but `SIGKILL` and `SIGSTOP`, with the raw
/// system calls (glibc's `sigaction` refuses 32 and 33, its own). Async-signal-safe: system
/// calls only. The same code the in-sandbox agents run (`sandbox-agent-proto`).
pub fn reset_signals() {
    sandbox_agent_proto::signals::reset_signals();
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;

    #[async_trait]
    impl ProcessControl for Nothing {
        async fn write_stdin(&self, _: Bytes) -> Result<()> {
            Err(Error::ProcessExited { id: 1 })
        }
        async fn close_stdin(&self) -> Result<()> {
            Ok(())
        }
        async fn signal(&self, _: Signal) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn signals_parse_by_name_and_number() {
        for s in Signal::ALL {
            assert_eq!(s.name().parse::<Signal>().unwrap(), s);
            assert_eq!(format!("SIG{}", s.name()).parse::<Signal>().unwrap(), s);
            assert_eq!(s.number().to_string().parse::<Signal>().unwrap(), s);
        }
        assert_eq!("int".parse::<Signal>().unwrap(), Signal::Interrupt);
        let e = "STOP".parse::<Signal>().unwrap_err().to_string();
        assert!(e.contains("`STOP`") && e.contains("TERM"), "{e}");
    }

    #[tokio::test]
    async fn wait_keeps_unread_output_up_to_the_cap_and_survives_a_timeout() {
        let (tx, rx) = mpsc::channel(8);
        let mut p = Process::new(7, rx, Arc::new(Nothing), 5);
        tx.send(Ok(ExecEvent::Stdout(Bytes::from_static(b"abc"))))
            .await
            .unwrap();
        let e = p.wait(Some(Duration::from_millis(20))).await.unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("process 7"), "{e}");
        tx.send(Ok(ExecEvent::Stderr(Bytes::from_static(b"defgh"))))
            .await
            .unwrap();
        tx.send(Ok(ExecEvent::Exit(ExecResult::new(
            Some(3),
            vec![],
            vec![],
        ))))
        .await
        .unwrap();
        let r = p.wait(None).await.unwrap();
        assert_eq!(
            (r.exit_code, &r.stdout[..], &r.stderr[..]),
            (Some(3), &b"abc"[..], &b"de"[..])
        );
        assert!(r.truncated);
        assert!(p.next().await.is_none(), "nothing after the exit");
        assert_eq!(p.exit().and_then(|r| r.exit_code), Some(3));
        let again = p.wait(None).await.unwrap();
        assert!(again.stdout.is_empty() && again.exit_code == Some(3));
        assert!(matches!(
            p.write_stdin(&b"x"[..]).await,
            Err(Error::ProcessExited { id: 1 })
        ));
    }

    #[tokio::test]
    async fn a_process_is_a_stream_of_its_output_then_its_exit() {
        use futures::StreamExt;
        let (tx, rx) = mpsc::channel(8);
        let p = Process::new(4, rx, Arc::new(Nothing), 5);
        tx.send(Ok(ExecEvent::Stdout(Bytes::from_static(b"ab"))))
            .await
            .unwrap();
        tx.send(Ok(ExecEvent::Exit(ExecResult::new(
            Some(0),
            vec![],
            vec![],
        ))))
        .await
        .unwrap();
        tx.send(Ok(ExecEvent::Stdout(Bytes::from_static(b"late"))))
            .await
            .unwrap();
        let events: Vec<_> = p.collect().await;
        assert_eq!(events.len(), 2, "nothing after the exit: {events:?}");
        assert!(matches!(&events[0], Ok(ExecEvent::Stdout(b)) if &b[..] == b"ab"));
        assert!(matches!(&events[1], Ok(ExecEvent::Exit(r)) if r.exit_code == Some(0)));
    }

    #[tokio::test]
    async fn a_failure_is_the_last_event() {
        let (tx, rx) = mpsc::channel(8);
        let mut p = Process::new(2, rx, Arc::new(Nothing), 5);
        tx.send(Err(Error::SandboxGone {
            id: "x".into(),
            reason: "destroyed".into(),
        }))
        .await
        .unwrap();
        drop(tx);
        assert!(matches!(
            p.next().await,
            Some(Err(Error::SandboxGone { .. }))
        ));
        assert!(p.next().await.is_none());
        let (tx, rx) = mpsc::channel::<Result<ExecEvent>>(8);
        let mut q = Process::new(3, rx, Arc::new(Nothing), 5);
        drop(tx);
        assert!(
            matches!(q.next().await, Some(Err(Error::Io { .. }))),
            "a silent end"
        );
        assert!(q.next().await.is_none());
    }

    #[test]
    fn the_table_lists_running_and_recent_processes() {
        let t = ProcessTable::new();
        let a = t.start("sleep 1000");
        let b = t.start("true");
        assert_eq!((a, b), (1, 2));
        t.exited(b, Some(0));
        assert!(t.is_running(a) && !t.is_running(b) && !t.is_running(99));
        let l = t.list();
        assert_eq!(l.len(), 2);
        assert_eq!(l[1].state, ProcessState::Exited { exit_code: Some(0) });
        for _ in 0..(EXITED_KEPT + 10) {
            let id = t.start("x");
            t.exited(id, None);
        }
        let l = t.list();
        assert_eq!(l.len(), EXITED_KEPT + 1, "the oldest exited are forgotten");
        assert_eq!(l[0].id, a, "running ones are kept");
    }

    #[tokio::test]
    async fn signals_go_to_live_processes_only() {
        let t = ProcessTable::new();
        let a = t.start("sleep 9");
        t.attach(a, Arc::new(Nothing));
        t.signal(a, Signal::Terminate).await.unwrap();
        t.exited(a, Some(143));
        let e = t.signal(a, Signal::Terminate).await.unwrap_err();
        assert!(matches!(e, Error::ProcessExited { id } if id == a), "{e}");
        assert_eq!(t.running_summary(), None);
        let b = t.start("sleep 8");
        assert_eq!(t.running_summary(), Some(format!("{b} (`sleep 8`)")));
        for never_given in [0, 42] {
            let e = t.signal(never_given, Signal::Terminate).await.unwrap_err();
            assert!(matches!(e, Error::NotFound { .. }), "{never_given}: {e}");
        }
    }

    #[test]
    fn command_lines_are_one_line() {
        use crate::Command;
        assert_eq!(
            command_line(&Command::Argv(vec!["sleep".into(), "9".into()])),
            "sleep 9"
        );
        assert_eq!(command_line(&Command::Code("a\nb".into())), "a …");
        assert_eq!(command_line(&Command::Code("a".into())), "a");
    }
}
