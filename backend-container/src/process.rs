//! Background processes ([`Sandbox::spawn`](sandbox_core::Sandbox::spawn)) and published
//! ports of a container sandbox.
//!
//! A process is an exec sent through the init with `EXEC_JOB`: its supervisor is forked on
//! demand (the spare stays for short execs) and gets its own socket, which carries its exit
//! report and our kill and signal requests. Its stdin is a pipe we keep open; its output is
//! pumped into the [`Process`]'s bounded channel, redacted, with no cap and no flood kill (a
//! reader that does not keep up holds the process back, as a full pipe does). It lives in
//! the sandbox's cgroup and pid namespace, so it counts against the limits, is frozen with
//! the sandbox, and dies with the init.
//!
//! A published port's connections are made by the init: it creates a TCP socket in the
//! sandbox's network namespace (`MSG_SOCKET`) and we connect it to the sandbox's loopback,
//! which needs no privilege over the namespace (the rootless case) and no route out.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use sandbox_core::process::command_line;
use sandbox_core::{
    Dialer, Error, ExecEvent, ExecRequest, ExecResult, Process, ProcessControl, ProcessId,
    PtyMaster, Result, Signal, Tty,
};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::{watch, Notify};

use crate::ctl::{Ctl, Job, Reply};
use crate::proto::{self, Dec, Enc, EncodeInit};
use crate::sandbox::{pipe, pump, set_nonblocking, wait_status_code, Inner, PumpSink, TIER};

/// Chunks a process may have in flight to its reader before it is held back (each at most
/// 16 KiB: our memory per process stays under ~1 MiB).
const QUEUE: usize = 64;

/// Where a process's input goes: its stdin pipe, or its terminal's master.
#[derive(Debug)]
enum Input {
    Pipe(pipe::Sender),
    Pty(PtyMaster),
}

impl tokio::io::AsyncWrite for Input {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Input::Pipe(p) => std::pin::Pin::new(p).poll_write(cx, buf),
            Input::Pty(m) => std::pin::Pin::new(m).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// What a [`Process`] handle drives: its input, its supervisor's socket, its terminal.
#[derive(Debug)]
struct Control {
    id: ProcessId,
    exec: u64,
    job: Arc<Job>,
    stdin: Arc<tokio::sync::Mutex<Option<Input>>>,
    /// The terminal's master (a copy), for resizes.
    tty: Option<PtyMaster>,
    ended: AtomicBool,
}

#[async_trait]
impl ProcessControl for Control {
    async fn write_stdin(&self, data: Bytes) -> Result<()> {
        let ended = self.ended.load(Ordering::SeqCst);
        sandbox_core::process::write_input(self.id, ended, &self.stdin, &data).await
    }

    async fn close_stdin(&self) -> Result<()> {
        sandbox_core::process::close_input(&self.stdin, self.tty.is_some()).await
    }

    async fn resize(&self, tty: Tty) -> Result<()> {
        let ended = self.ended.load(Ordering::SeqCst);
        sandbox_core::process::resize_terminal(self.id, self.tty.as_ref(), ended, tty)
    }

    async fn signal(&self, signal: Signal) -> Result<()> {
        if self.ended.load(Ordering::SeqCst) {
            return Err(Error::ProcessExited { id: self.id });
        }
        self.job.signal(self.exec, signal.number());
        Ok(())
    }
}

/// A terminal's master as the process's input, the handle kept for resizing, and the
/// reader of its output.
fn terminal(m: OwnedFd) -> Result<(Option<Input>, Option<PtyMaster>, Option<OwnedFd>)> {
    let io = |e: std::io::Error| Error::io("copy the terminal's master", e);
    let r = m.try_clone().map_err(io)?;
    let m = PtyMaster::from_fd(m).map_err(|e| Error::io("register the terminal", e))?;
    let w = m.try_clone().map_err(io)?;
    Ok((Some(Input::Pty(w)), Some(m), Some(r)))
}

impl Inner {
    /// Starts `req` in the background (see the module docs).
    pub(crate) async fn spawn(self: &Arc<Self>, req: ExecRequest) -> Result<Process> {
        self.alive()?;
        req.validate()?;
        self.life.check_running()?;
        let mut x = self.exec_spec(&req)?;
        x.flags |= proto::EXEC_JOB;
        x.flags |= if req.tty.is_some() {
            proto::EXEC_TTY
        } else {
            proto::EXEC_STDIN
        };
        let io = |what: &'static str| move |e: std::io::Error| Error::io(what, e);
        let (out_r, out_w) = pipe().map_err(io("create stdout pipe"))?;
        let (err_r, err_w) = pipe().map_err(io("create stderr pipe"))?;
        let (in_r, in_w) = pipe().map_err(io("create stdin pipe"))?;
        let (job, theirs) = Job::pair().map_err(io("create the process's socket"))?;
        // Everything that can fail on our side happens before the process is sent: once it
        // runs, it is tracked.
        let pipe_in = if req.tty.is_none() {
            set_nonblocking(in_w.as_raw_fd());
            Some(pipe::Sender::from_owned_fd(in_w).map_err(io("register the stdin pipe"))?)
        } else {
            None
        };
        let mut payload = Enc::default();
        payload.exec(&x);
        // Replies before its supervisor takes over (a fork failure, a malformed request)
        // come on the control socket.
        let (exec, mut early) = self.ctl.register();
        let mut fds: Vec<BorrowedFd<'_>> = vec![out_w.as_fd(), err_w.as_fd()];
        if req.tty.is_none() {
            fds.push(in_r.as_fd());
        }
        fds.push(theirs.as_fd());
        if let Err(e) = self.ctl.send(proto::MSG_EXEC, exec, &payload.0, &fds).await {
            self.ctl.unregister(exec);
            if self.ctl.is_closed() {
                return Err(self.gone_err());
            }
            return Err(Error::io("send the process to the sandbox init", e));
        }
        drop(fds);
        drop((out_w, err_w, in_r, theirs));
        // A terminal's master comes first (unless the command could not start: then its
        // exit report, handled by the watcher like any other).
        let (mut master, mut first_reply) = (None, None);
        if req.tty.is_some() {
            let r = tokio::select! {
                r = job.recv() => r,
                r = early.recv() => r,
            };
            match r {
                Some(Reply {
                    kind: proto::REP_PTY,
                    fd: Some(fd),
                    ..
                }) => master = Some(fd),
                other => first_reply = other,
            }
        }
        let (input, tty, tty_r) = match master {
            Some(m) => match terminal(m) {
                Ok(t) => t,
                Err(e) => {
                    // The process runs but we cannot reach its terminal: end it, not leak it.
                    job.kill(exec);
                    self.ctl.unregister(exec);
                    return Err(e);
                }
            },
            None => (pipe_in.map(Input::Pipe), None, None),
        };
        let stdin = Arc::new(tokio::sync::Mutex::new(input));
        // The request's stdin goes first: held before anyone else can write.
        let first = Arc::clone(&stdin).try_lock_owned().ok();
        let id = self.procs.start(command_line(&req.command));
        let job = Arc::new(job);
        let control = Arc::new(Control {
            id,
            exec,
            job: Arc::clone(&job),
            stdin: Arc::clone(&stdin),
            tty,
            ended: AtomicBool::new(false),
        });
        self.procs
            .attach(id, Arc::clone(&control) as Arc<dyn ProcessControl>);
        if let (Some(mut g), Some(data)) = (first, req.stdin.clone()) {
            tokio::spawn(async move {
                if let Some(tx) = g.as_mut() {
                    let _ = tx.write_all(&data).await;
                }
            });
        }
        let (tx, rx) = tokio::sync::mpsc::channel(QUEUE);
        let me = Arc::clone(self);
        let timeout = req.timeout;
        let handle = Arc::clone(&control);
        tokio::spawn(async move {
            let pipes = Pipes {
                out_r,
                err_r,
                tty_r,
            };
            let last = me
                .watch(
                    exec,
                    &job,
                    &mut early,
                    first_reply,
                    pipes,
                    tx.clone(),
                    timeout,
                )
                .await;
            me.ctl.unregister(exec);
            control.ended.store(true, Ordering::SeqCst);
            control.stdin.lock().await.take();
            me.procs
                .exited(id, last.as_ref().ok().and_then(|r| r.exit_code));
            let _ = tx.send(last.map(ExecEvent::Exit)).await;
        });
        Ok(Process::new(
            id,
            rx,
            handle as Arc<dyn ProcessControl>,
            self.spec.limits.output_bytes,
        ))
    }

    /// Pumps a process's output until it exits; its result (output already streamed).
    #[allow(clippy::too_many_arguments)]
    async fn watch(
        &self,
        exec: u64,
        job: &Job,
        early: &mut tokio::sync::mpsc::UnboundedReceiver<Reply>,
        first: Option<Reply>,
        pipes: Pipes,
        tx: tokio::sync::mpsc::Sender<Result<ExecEvent>>,
        timeout: Option<Duration>,
    ) -> Result<ExecResult> {
        let Pipes {
            out_r,
            err_r,
            tty_r,
        } = pipes;
        let counters = self.limit_counters();
        let (stop_tx, stop_rx) = watch::channel(false);
        let never = Arc::new(Notify::new());
        let sink = |tx| Some(PumpSink::new(tx, &self.redactor, u64::MAX));
        let out_pump = pump(
            out_r,
            0,
            u64::MAX,
            sink(tx.clone()),
            true,
            stop_rx.clone(),
            Arc::clone(&never),
        );
        let err_pump = pump(
            err_r,
            0,
            u64::MAX,
            sink(tx.clone()),
            false,
            stop_rx.clone(),
            Arc::clone(&never),
        );
        // A terminal's output (stdout and stderr merged) is stdout.
        let has_tty = tty_r.is_some();
        let tty_pump = async {
            match tty_r {
                Some(fd) => pump(fd, 0, u64::MAX, sink(tx), true, stop_rx, never).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(out_pump, err_pump, tty_pump);
        let (mut out_done, mut err_done, mut tty_done) = (false, false, false);
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let mut timed_out = false;
        // What the init or the supervisor reported: `Some(Ok(status))` ends the watch with
        // the process's wait status, `Some(Err)` ends it with the init's refusal, `None` is
        // a message that does not end it.
        let outcome = |r: &Reply| -> Option<Result<Option<i32>>> {
            match r.kind {
                proto::REP_EXITED => Some(Ok(Dec::new(&r.payload).i32().ok())),
                proto::REP_ERR => {
                    let mut d = Dec::new(&r.payload);
                    let _ = (d.u32(), d.i32());
                    Some(Err(Error::backend(
                        TIER,
                        format!(
                            "sandbox init refused the process: {}",
                            d.str().unwrap_or_default()
                        ),
                    )))
                }
                _ => None,
            }
        };
        // The reply to the exec itself, when it came before the watch began.
        let settled = match first {
            Some(r) => match outcome(&r) {
                Some(Ok(status)) => Some(status),
                Some(Err(e)) => return Err(e),
                None => return Err(self.gone_err()),
            },
            None => None,
        };
        let status = match settled {
            Some(status) => status,
            None => loop {
                tokio::select! {
                    r = job.recv() => match r {
                        Some(r) if r.kind == proto::REP_EXITED => {
                            if let Some(Ok(status)) = outcome(&r) {
                                break status;
                            }
                        }
                        Some(_) => {}
                        None if self.ctl.is_closed() || self.life.is_gone() => return Err(self.gone_err()),
                        None => {
                            // The supervisor hung up without a report: let the init's reader see
                            // whether the whole sandbox went.
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            if self.ctl.is_closed() || self.life.is_gone() {
                                return Err(self.gone_err());
                            }
                            return Err(Error::backend(TIER, "the process's supervisor died before reporting (killed from outside?)"));
                        }
                    },
                    r = early.recv() => match r {
                        Some(r) => match outcome(&r) {
                            Some(Ok(status)) => break status,
                            Some(Err(e)) => return Err(e),
                            None => {}
                        },
                        None => return Err(self.gone_err()),
                    },
                    _ = sleep_until(deadline), if !timed_out => {
                        timed_out = true;
                        job.kill(exec);
                    }
                    _ = &mut out_pump, if !out_done => out_done = true,
                    _ = &mut err_pump, if !err_done => err_done = true,
                    _ = &mut tty_pump, if !tty_done => tty_done = true,
                }
            },
        };
        let _ = stop_tx.send(true);
        if !out_done {
            out_pump.await;
        }
        if !err_done {
            err_pump.await;
        }
        if has_tty && !tty_done {
            // Drains what the terminal holds (bounded). Without a terminal there is nothing
            // to drain (its pump stays pending): no wait.
            let _ = tokio::time::timeout(Duration::from_secs(1), tty_pump).await;
        }
        let (exit_code, signal) = status.map_or((None, None), wait_status_code);
        let limit = self.blame(exit_code, signal, &counters, false, timed_out);
        Ok(ExecResult::new(exit_code, Vec::new(), Vec::new()).with_limit(limit))
    }

    /// A TCP stream to `port` on the sandbox's loopback, from a socket the init made in the
    /// sandbox's network namespace: IPv4 first, then IPv6 (a server bound to `::1` only).
    pub(crate) async fn dial(ctl: &Ctl, port: u16) -> std::io::Result<tokio::net::TcpStream> {
        let mut last = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        for (family, addr) in [
            (4u8, SocketAddr::from((Ipv4Addr::LOCALHOST, port))),
            (6u8, SocketAddr::from((Ipv6Addr::LOCALHOST, port))),
        ] {
            let r = ctl.call(proto::MSG_SOCKET, &[family], &[]).await?;
            let fd = match r {
                Reply {
                    kind: proto::REP_OK,
                    fd: Some(fd),
                    ..
                } => fd,
                _ => {
                    last = std::io::Error::other("the sandbox init could not make a socket");
                    continue;
                }
            };
            set_nonblocking(fd.as_raw_fd());
            let sock = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(fd));
            match sock.connect(addr).await {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

/// The read ends of a process's output.
struct Pipes {
    out_r: OwnedFd,
    err_r: OwnedFd,
    /// The terminal's master, with a terminal.
    tty_r: Option<OwnedFd>,
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The container tier's way into a sandbox's network, for published ports.
pub(crate) struct InitDialer(pub Arc<Ctl>);

#[async_trait]
impl Dialer for InitDialer {
    async fn dial(&self, port: u16) -> std::io::Result<Box<dyn sandbox_core::Connection>> {
        let s = Inner::dial(&self.0, port).await?;
        let _ = s.set_nodelay(true);
        Ok(Box::new(s))
    }
}
