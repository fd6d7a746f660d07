//! Background processes that snapshots keep: started by the keeper inside the sandbox
//! (`relay serve`, see `relay/keep.rs`), which holds the command's pipes itself, and reached
//! through an attachment that carries frames both ways: the keeper's own stdio (our pipes)
//! at first, then `relay attach` processes connected to its socket. Relays start as execs
//! do: through the sandbox's control socket, else `runsc exec`.
//!
//! A snapshot detaches every attachment (the keeper acknowledges, then sends nothing more;
//! its own stdio become `/dev/null`), so when `runsc checkpoint` runs no process of the
//! sandbox holds a host pipe; the
//! processes go on inside, and the resumed sandbox (or a copy restored from the snapshot)
//! attaches again. While detached, the keeper reads nothing from the command: a command
//! that writes meanwhile waits once its pipe is full. A process with a terminal gets one
//! the keeper opens inside the sandbox (`/dev/pts`, with Ctrl-C delivered by the keeper:
//! `relay/keep.rs`), so it is kept the same way.

use std::collections::HashMap;
use std::sync::Weak;

use bytes::Bytes;
use sandbox_agent_proto::frame;
use sandbox_core::{Process, ProcessControl, ProcessId, Signal, Tty};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::process::Child;

use super::exec::{RunscExec, Stdin};
use super::*;

/// Chunks in flight to a process's reader before it is held back.
const QUEUE: usize = 64;
/// How long the keeper may take to answer a detach.
const DETACH_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest frame accepted from the keeper.
const MAX_FRAME: usize = 1 << 20;

/// A kept process as a snapshot records it: keeper name, pid inside, command line, terminal.
pub(super) type Recorded = (String, i32, String, bool);

/// The kept processes of a sandbox, by id.
pub(super) type KeptTable = Mutex<HashMap<ProcessId, Arc<Kept>>>;

/// Our end of a relay's input.
type Input = Box<dyn AsyncWrite + Send + Unpin>;
/// Our end of a relay's output.
type Output = Box<dyn AsyncRead + Send + Unpin>;

/// A relay program started inside the sandbox (`keep` or `attach`): its pipes, and how it
/// was started.
struct Relay {
    input: Option<Input>,
    output: Output,
    started: Started,
}

/// How a relay was started.
enum Started {
    /// Through the sandbox's control socket: it ends by itself (an attachment when the
    /// keeper closes its connection, or when its output pipe is gone); reaped by a task.
    Direct,
    /// `runsc exec` (killed on drop), with its process and pid files.
    Runsc(Box<(Child, [PathBuf; 2])>),
}

impl Drop for Started {
    fn drop(&mut self) {
        if let Started::Runsc(runsc) = self {
            let (child, files) = &mut **runsc;
            let _ = child.start_kill();
            for f in files.iter() {
                let _ = std::fs::remove_file(f);
            }
        }
    }
}

/// One attachment: the relay's output (its input is the [`Kept`]'s) and its process.
struct Attachment {
    output: Output,
    _started: Started,
}

/// A kept process: what its [`Process`] handle and the sandbox's snapshots drive.
pub(super) struct Kept {
    id: ProcessId,
    inner: Weak<Inner>,
    /// The keeper's name (its socket inside).
    name: String,
    /// The command's pid inside (0: it could not start).
    pid: i32,
    command: String,
    /// Whether it runs on a terminal (of the keeper's, inside the sandbox).
    tty: bool,
    /// The current attachment's input (frames to the keeper); `None` while detached.
    input: tokio::sync::Mutex<Option<Input>>,
    stdin_closed: AtomicBool,
    ended: AtomicBool,
    timed_out: AtomicBool,
    /// New attachments, for the task that reads the frames.
    attachments: mpsc::UnboundedSender<Attachment>,
    /// Told when the keeper answered a detach.
    detached: tokio::sync::Notify,
}

/// Sends one frame to the keeper (`sandbox_agent_proto`'s framing, id 0: see
/// `relay/keep.rs`).
async fn write_frame(
    w: &mut (impl AsyncWrite + Unpin + ?Sized),
    kind: u8,
    payload: &[u8],
) -> std::io::Result<()> {
    let head = frame::Header::for_payload(kind, 0, payload.len())
        .ok_or_else(|| std::io::Error::other("frame too long"))?;
    let mut frame = Vec::with_capacity(frame::HEADER_LEN + payload.len());
    frame.extend_from_slice(&head.to_bytes());
    frame.extend_from_slice(payload);
    w.write_all(&frame).await?;
    w.flush().await
}

/// Reads one frame from the keeper: its kind and payload (at most [`MAX_FRAME`] bytes,
/// checked before anything is allocated).
async fn read_frame(r: &mut (impl AsyncRead + Unpin + ?Sized)) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; frame::HEADER_LEN];
    r.read_exact(&mut head).await?;
    let head = frame::Header::parse(&head);
    let mut payload = vec![0u8; head.checked_len(MAX_FRAME)?];
    r.read_exact(&mut payload).await?;
    Ok((head.kind, payload))
}

impl Kept {
    /// Sends one frame on the current attachment (waiting out a snapshot's detach).
    async fn send(&self, kind: u8, payload: &[u8]) -> Result<()> {
        let exited = Error::ProcessExited { id: self.id };
        if self.ended.load(Ordering::SeqCst) {
            return Err(exited);
        }
        let inner = self.inner.upgrade().ok_or(exited)?;
        // Shared with execs: a snapshot (detached) is over before this goes.
        let _shared = inner.lifecycle.read().await;
        let mut g = self.input.lock().await;
        let Some(w) = g.as_mut() else {
            return Err(Error::ProcessExited { id: self.id });
        };
        write_frame(w, kind, payload)
            .await
            .map_err(|_| Error::ProcessExited { id: self.id })
    }

    /// Stops the keeper forwarding to us and ends the attachment; the process goes on.
    pub(super) async fn detach(&self) -> Result<()> {
        let notified = self.detached.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        {
            let mut g = self.input.lock().await;
            let Some(w) = g.as_mut() else {
                return Ok(());
            };
            if write_frame(w, b'D', b"").await.is_err() {
                // It ended meanwhile.
                return Ok(());
            }
            g.take();
        }
        if self.ended.load(Ordering::SeqCst) {
            return Ok(());
        }
        tokio::time::timeout(DETACH_TIMEOUT, notified)
            .await
            .map_err(|_| {
                Error::backend(
                    TIER,
                    format!(
                        "process {} (`{}`) did not detach for the snapshot",
                        self.id, self.command
                    ),
                )
            })
    }

    /// Attaches again (after a snapshot's resume, or in a restored copy).
    pub(super) async fn attach(&self, inner: &Inner) -> Result<()> {
        if self.ended.load(Ordering::SeqCst) {
            return Ok(());
        }
        let (att, input) = inner.attach_keeper(&self.name).await?;
        self.attach_to(att, input).await
    }

    /// Asks the keeper to forward to `att` and makes it the current attachment.
    async fn attach_to(&self, att: Attachment, mut input: Input) -> Result<()> {
        write_frame(&mut input, b'A', b"")
            .await
            .map_err(|e| Error::io("attach to a kept process", e))?;
        *self.input.lock().await = Some(input);
        self.attachments
            .send(att)
            .map_err(|_| Error::backend(TIER, "the process's reader is gone"))
    }

    /// What a snapshot records: the keeper's name, the pid, the command line, the terminal.
    pub(super) fn record(&self) -> Recorded {
        (self.name.clone(), self.pid, self.command.clone(), self.tty)
    }

    pub(super) fn id(&self) -> ProcessId {
        self.id
    }

    pub(super) fn running(&self) -> bool {
        !self.ended.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl ProcessControl for Kept {
    async fn write_stdin(&self, data: Bytes) -> Result<()> {
        if !self.tty && self.stdin_closed.load(Ordering::SeqCst) {
            return Err(Error::ProcessExited { id: self.id });
        }
        for chunk in data.chunks(64 * 1024) {
            self.send(b'I', chunk).await?;
        }
        Ok(())
    }

    async fn close_stdin(&self) -> Result<()> {
        // A terminal's end of file is a ^D the keeper types; its input stays open.
        if !self.tty && self.stdin_closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        match self.send(b'C', b"").await {
            Ok(()) | Err(Error::ProcessExited { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn resize(&self, tty: Tty) -> Result<()> {
        if !self.tty {
            return Err(sandbox_core::process::no_terminal(self.id));
        }
        let size = format!("{} {}", tty.rows, tty.cols);
        self.send(b'R', size.as_bytes()).await
    }

    async fn signal(&self, signal: Signal) -> Result<()> {
        let exited = Error::ProcessExited { id: self.id };
        if self.ended.load(Ordering::SeqCst) || self.pid <= 0 {
            return Err(exited);
        }
        let inner = self.inner.upgrade().ok_or(exited)?;
        inner.alive()?;
        inner.signal_exec(self.pid, signal.number()).await;
        Ok(())
    }
}

impl Inner {
    /// Starts the relay program with `args` (as the sandbox's user, in `cwd`, with `env`):
    /// through the sandbox's control socket where it can (as execs do), else `runsc exec`.
    async fn start_relay(
        &self,
        tag: &str,
        args: Vec<String>,
        env: Vec<String>,
        cwd: &str,
        input: bool,
    ) -> Result<Relay> {
        let mut argv = vec![bundle::RELAY_PATH.to_string()];
        argv.extend(args);
        if self.direct.load(Ordering::SeqCst) {
            if let Some(r) = self.start_relay_direct(&argv, &env, cwd, input).await? {
                return Ok(r);
            }
            self.direct.store(false, Ordering::SeqCst);
        }
        let stdin = if input { Stdin::Pipe } else { Stdin::Null };
        let RunscExec {
            mut child,
            pfile,
            pidfile,
            ..
        } = self.runsc_exec_on(tag, argv, env, cwd, stdin)?;
        let stdin = child.stdin.take().map(|w| Box::new(w) as Input);
        let Some(output) = child.stdout.take() else {
            let _ = child.start_kill();
            return Err(Error::backend(TIER, "runsc exec without its pipes"));
        };
        Ok(Relay {
            input: stdin,
            output: Box::new(output),
            started: Started::Runsc(Box::new((child, [pfile, pidfile]))),
        })
    }

    /// [`start_relay`](Self::start_relay) through the control socket; `None`: that
    /// interface is not available here (nothing was started).
    async fn start_relay_direct(
        &self,
        argv: &[String],
        env: &[String],
        cwd: &str,
        input: bool,
    ) -> Result<Option<Relay>> {
        let io = |what: &'static str| move |e: nix::Error| Error::io(what, e.into());
        let cloexec = nix::fcntl::OFlag::O_CLOEXEC;
        let null = || -> Result<std::os::fd::OwnedFd> {
            Ok(std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
                .map_err(|e| Error::io("open /dev/null", e))?
                .into())
        };
        let (out_r, out_w) = nix::unistd::pipe2(cloexec).map_err(io("create a pipe"))?;
        let (in_r, in_w) = if input {
            let (r, w) = nix::unistd::pipe2(cloexec).map_err(io("create a pipe"))?;
            (r, Some(w))
        } else {
            (null()?, None)
        };
        let err = null()?;
        let started = self
            .execute_direct(argv, env, cwd, [in_r, out_w, err])
            .await?;
        let pid = match started {
            Ok(pid) => pid,
            Err(crate::urpc::CallError::Unavailable(_)) => return Ok(None),
            Err(crate::urpc::CallError::Remote(why)) => {
                return Err(Error::backend(
                    TIER,
                    format!("the sandbox did not start its relay: {why}"),
                ))
            }
            Err(crate::urpc::CallError::Io(e)) => {
                return Err(Error::io("start the relay in the gVisor sandbox", e))
            }
        };
        // Reaped when it ends.
        let (id, ns) = (self.id.clone(), self.runsc.netns.clone());
        tokio::spawn(async move {
            let _ = crate::urpc::wait_pid(&id, ns.as_deref(), pid).await;
        });
        let nonblocking = |fd: &std::os::fd::OwnedFd| {
            let _ = nix::fcntl::fcntl(
                fd,
                nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
            );
        };
        nonblocking(&out_r);
        let output = tokio::net::unix::pipe::Receiver::from_owned_fd(out_r)
            .map_err(|e| Error::io("read the relay", e))?;
        let input = match in_w {
            Some(w) => {
                nonblocking(&w);
                Some(Box::new(
                    tokio::net::unix::pipe::Sender::from_owned_fd(w)
                        .map_err(|e| Error::io("write to the relay", e))?,
                ) as Input)
            }
            None => None,
        };
        Ok(Some(Relay {
            input,
            output: Box::new(output),
            started: Started::Direct,
        }))
    }

    /// Starts `relay attach NAME` and asks the keeper to forward to it.
    async fn attach_keeper(&self, name: &str) -> Result<(Attachment, Input)> {
        let args = vec!["attach".to_string(), name.to_string()];
        let relay = self
            .start_relay("attach", args, Vec::new(), "/", true)
            .await?;
        let Relay {
            input,
            output,
            started,
        } = relay;
        let input = input.ok_or_else(|| Error::backend(TIER, "the relay has no input"))?;
        Ok((
            Attachment {
                output,
                _started: started,
            },
            input,
        ))
    }

    /// Starts `req` under a keeper (see the module docs).
    pub(super) async fn spawn_kept(self: &Arc<Self>, req: ExecRequest) -> Result<Process> {
        let (shared, (argv, env, cwd)) = self.admit_spawn(&req).await?;
        let command = sandbox_core::process::command_line(&req.command);
        let name = format!(
            "{}-{}",
            &self.id[..self.id.len().min(12)],
            self.seq.fetch_add(1, Ordering::SeqCst)
        );
        let mut keep = vec!["serve".to_string(), name.clone()];
        if let Some(t) = req.tty {
            keep.extend(["--tty".into(), t.rows.to_string(), t.cols.to_string()]);
        }
        keep.push("--".into());
        keep.extend(argv);
        let relay = self.start_relay("serve", keep, env, &cwd, true).await?;
        let Relay {
            input,
            mut output,
            started,
        } = relay;
        // It says how the command started (one line), then is its first attachment.
        let mut said = Vec::new();
        let mut byte = [0u8; 1];
        while said.len() < 4096 && matches!(output.read(&mut byte).await, Ok(1)) {
            if byte[0] == b'\n' {
                break;
            }
            said.push(byte[0]);
        }
        let said = String::from_utf8_lossy(&said).into_owned();
        let pid = match said.trim().split_once(' ') {
            Some(("0", pid)) => pid.trim().parse::<i32>().unwrap_or(0),
            _ => {
                return Err(Error::backend(
                    TIER,
                    format!(
                        "the process keeper did not start `{command}`: {}",
                        said.trim()
                    ),
                ))
            }
        };
        let id = self.procs.start(command.clone());
        let (kept, rx) = self.keep(id, name, pid, command, req.tty.is_some());
        let attached = match input {
            Some(input) => {
                let att = Attachment {
                    output,
                    _started: started,
                };
                kept.attach_to(att, input).await
            }
            None => Err(Error::backend(TIER, "the relay has no input")),
        };
        drop(shared);
        if let Err(e) = attached {
            // Running but unreachable: end it rather than leak it.
            if pid > 0 {
                self.kill_exec(pid).await;
            }
            self.procs.exited(id, None);
            return Err(e);
        }
        // The request's stdin goes first: written before the handle is returned.
        if let Some(data) = &req.stdin {
            let _ = kept.write_stdin(Bytes::from(data.clone())).await;
        }
        let (tx, events) = mpsc::channel(QUEUE);
        self.follow(&kept, rx, tx, req.timeout);
        Ok(Process::new(
            id,
            events,
            kept as Arc<dyn ProcessControl>,
            self.spec.limits.output_bytes,
        ))
    }

    /// Registers a kept process (in the process table and the kept table).
    fn keep(
        self: &Arc<Self>,
        id: ProcessId,
        name: String,
        pid: i32,
        command: String,
        tty: bool,
    ) -> (Arc<Kept>, mpsc::UnboundedReceiver<Attachment>) {
        let (attachments, rx) = mpsc::unbounded_channel();
        let kept = Arc::new(Kept {
            id,
            inner: Arc::downgrade(self),
            name,
            pid,
            command,
            tty,
            input: tokio::sync::Mutex::new(None),
            stdin_closed: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            timed_out: AtomicBool::new(false),
            attachments,
            detached: tokio::sync::Notify::new(),
        });
        self.procs
            .attach(id, Arc::clone(&kept) as Arc<dyn ProcessControl>);
        lock(&self.kept).insert(id, Arc::clone(&kept));
        (kept, rx)
    }

    /// Reads the process's frames from attachment to attachment until its exit, into `tx`
    /// (redacted); a wall-time limit kills it.
    fn follow(
        self: &Arc<Self>,
        kept: &Arc<Kept>,
        mut attachments: mpsc::UnboundedReceiver<Attachment>,
        tx: mpsc::Sender<Result<ExecEvent>>,
        timeout: Option<Duration>,
    ) {
        let me = Arc::clone(self);
        let kept = Arc::clone(kept);
        let before = me.limit_counters();
        if let (Some(t), true) = (timeout, kept.pid > 0) {
            let (me, k) = (Arc::downgrade(&me), Arc::downgrade(&kept));
            tokio::spawn(async move {
                tokio::time::sleep(t).await;
                if let (Some(me), Some(k)) = (me.upgrade(), k.upgrade()) {
                    if k.running() {
                        k.timed_out.store(true, Ordering::SeqCst);
                        me.kill_exec(k.pid).await;
                    }
                }
            });
        }
        tokio::spawn(async move {
            let mut out = StreamSink::new(tx.clone(), &me.redactor, StreamKind::Stdout);
            let mut err = StreamSink::new(tx.clone(), &me.redactor, StreamKind::Stderr);
            let mut code = None;
            'attachments: while let Some(mut att) = attachments.recv().await {
                loop {
                    match read_frame(&mut att.output).await {
                        Ok((b'O', d)) => out.push(&d).await,
                        Ok((b'E', d)) => err.push(&d).await,
                        Ok((b'X', c)) => {
                            code = String::from_utf8_lossy(&c).trim().parse::<i32>().ok();
                            break 'attachments;
                        }
                        Ok((b'D', _)) => {
                            drop(att);
                            kept.detached.notify_one();
                            continue 'attachments;
                        }
                        Ok(_) => {}
                        // The attachment ended without the exit: the sandbox is gone (or
                        // the relay was killed); try once more while it lives.
                        Err(_) => {
                            drop(att);
                            if me.life.release_begun() || me.alive().is_err() {
                                break 'attachments;
                            }
                            if kept.attach(&me).await.is_err() {
                                break 'attachments;
                            }
                            continue 'attachments;
                        }
                    }
                }
            }
            out.finish().await;
            err.finish().await;
            kept.ended.store(true, Ordering::SeqCst);
            kept.input.lock().await.take();
            lock(&me.kept).remove(&kept.id);
            let limit = kept
                .timed_out
                .load(Ordering::SeqCst)
                .then_some(LimitKind::WallTime);
            // No exit status: the keeper was never reached again (the sandbox went).
            let last = match code {
                Some(_) => me.process_ended(kept.id, code, limit, before).await,
                None => Err(me.process_gone(kept.id)),
            };
            let _ = tx.send(last.map(ExecEvent::Exit)).await;
        });
    }

    /// The kept processes still running, as a snapshot records them.
    pub(super) fn kept_running(&self) -> Vec<Arc<Kept>> {
        lock(&self.kept)
            .values()
            .filter(|k| k.running())
            .cloned()
            .collect()
    }

    /// Attaches every kept process again (a snapshot's resume).
    pub(super) async fn reattach_kept(self: &Arc<Self>) {
        for k in self.kept_running() {
            if let Err(e) = k.attach(self).await {
                tracing::warn!(sandbox = %self.id, process = k.id, error = %e,
                    "could not attach to a kept process after the snapshot");
            }
        }
    }

    /// A restored copy's processes (recorded by the snapshot): listed, signalable, their
    /// output read and dropped (no handle was ever given for them here).
    pub(super) async fn adopt_kept(self: &Arc<Self>, recorded: Vec<Recorded>) {
        for (name, pid, command, tty) in recorded {
            let id = self.procs.start(command.clone());
            let (kept, rx) = self.keep(id, name, pid, command, tty);
            let (tx, events) = mpsc::channel(1);
            drop(events);
            self.follow(&kept, rx, tx, None);
            if let Err(e) = kept.attach(self).await {
                tracing::warn!(sandbox = %self.id, process = id, error = %e,
                    "could not attach to a restored process");
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
