//! Background processes ([`Sandbox::spawn`](sandbox_core::Sandbox::spawn)) in a root without
//! the relay (elsewhere a keeper inside runs them, see [`super::kept`]): a `runsc exec`
//! child per process, its stdin kept open and its output streamed (redacted, uncapped, held
//! back by the [`Process`]'s bounded channel when nobody reads). A process with a terminal
//! gets one of ours: `runsc exec` runs on its slave (see [`Inner::runsc_exec_on`]), we keep
//! the master for its input, output and size. Signals are sent by a `kill`
//! run inside the sandbox, to the pid runsc reports (`--internal-pid-file`). The process lives
//! in the sandbox, so it shares its limits, is stopped with a checkpoint's pause, and ends
//! with it.

use std::sync::Weak;

use bytes::Bytes;
use sandbox_core::process::command_line;
use sandbox_core::{stream_output, Process, ProcessControl, ProcessId, PtyMaster, Signal, Tty};
use tokio::io::AsyncWrite;

use super::exec::{RunscExec, Stdin};
use super::*;

/// Where a process's input goes: its stdin pipe, or its terminal's master.
type Input = Box<dyn AsyncWrite + Send + Unpin>;

/// Chunks in flight to a process's reader before it is held back.
const QUEUE: usize = 64;

/// What a [`Process`] handle drives.
struct Control {
    id: ProcessId,
    inner: Weak<Inner>,
    pidfile: PathBuf,
    stdin: tokio::sync::Mutex<Option<Input>>,
    /// The terminal's master (a copy), for resizes.
    tty: Option<PtyMaster>,
    ended: AtomicBool,
}

impl Control {
    /// The process's pid inside the sandbox, once runsc has written it (it does when the
    /// process starts).
    async fn pid(&self) -> Option<i32> {
        for _ in 0..200 {
            if let Some(pid) = std::fs::read_to_string(&self.pidfile)
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
            {
                return Some(pid);
            }
            if self.ended.load(Ordering::SeqCst) {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    }
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
        let exited = Error::ProcessExited { id: self.id };
        if self.ended.load(Ordering::SeqCst) {
            return Err(exited);
        }
        let (Some(inner), Some(pid)) = (self.inner.upgrade(), self.pid().await) else {
            return Err(exited);
        };
        inner.alive()?;
        inner.signal_exec(pid, signal.number()).await;
        Ok(())
    }
}

impl Inner {
    /// What every spawn checks and holds first: the sandbox runs, `req` is valid; the
    /// lifecycle lock shared (a snapshot waits for the start) and `req`'s argv, environment
    /// and working directory.
    pub(super) async fn admit_spawn(
        &self,
        req: &ExecRequest,
    ) -> Result<(
        tokio::sync::RwLockReadGuard<'_, ()>,
        (Vec<String>, Vec<String>, String),
    )> {
        self.alive()?;
        req.validate()?;
        let shared = self.lifecycle.read().await;
        self.alive()?;
        self.life.check_running()?;
        Ok((shared, self.command(req)?))
    }

    /// A background process ended with `code`: its result (its limit, if one stopped it),
    /// or, when the sandbox is gone, `SandboxGone`; recorded in the process table.
    pub(super) async fn process_ended(
        &self,
        id: ProcessId,
        code: Option<i32>,
        limit: Option<LimitKind>,
        before: (Option<u64>, Option<u64>),
    ) -> Result<ExecResult> {
        if self.life.release_begun() || self.alive().is_err() {
            return Err(self.process_gone(id));
        }
        let empty = || sandbox_core::OutputBuffer::new(0);
        let t = TimelineRecorder::start();
        let r = self
            .conclude(code, false, limit, before, empty(), empty(), t)
            .await;
        self.procs.exited(id, r.exit_code);
        Ok(r)
    }

    /// Records background process `id` as ended with the sandbox; the error its handle gets,
    /// with why the sandbox ended when it says (a failed resume after a snapshot, a limit).
    pub(super) fn process_gone(&self, id: ProcessId) -> Error {
        self.procs.exited(id, None);
        let reason = match self.life.gone_reason() {
            Some(why) => format!("the sandbox ended while the process ran: {why}"),
            None => "the sandbox ended while the process ran".to_string(),
        };
        Error::SandboxGone {
            id: self.id.clone(),
            reason,
        }
    }

    /// Starts `req` in the background (see the module docs).
    pub(super) async fn spawn(self: &Arc<Self>, req: ExecRequest) -> Result<Process> {
        let (shared, (argv, env, cwd)) = self.admit_spawn(&req).await?;
        let stdin = req.tty.map_or(Stdin::Pipe, Stdin::Tty);
        let RunscExec {
            mut child,
            pfile,
            pidfile,
            master,
        } = self.runsc_exec_on("proc", argv, env, &cwd, stdin)?;
        drop(shared);
        // With a terminal: one handle writes (the input), one reads (the output), one
        // resizes. Without: the child's pipes.
        let copies = master
            .map(|m| -> std::io::Result<_> { Ok((m.try_clone()?, m.try_clone()?, m)) })
            .transpose()
            .map_err(|e| Error::io("copy the terminal's master", e));
        let copies = match copies {
            Ok(c) => c,
            Err(e) => {
                // Running but unreachable: end it rather than leak it.
                let _ = child.start_kill();
                let _ = std::fs::remove_file(&pfile);
                return Err(e);
            }
        };
        let (input, output, tty): (Option<Input>, _, _) = match copies {
            Some((w, r, m)) => (Some(Box::new(w)), Some(r), Some(m)),
            None => (child.stdin.take().map(|w| Box::new(w) as Input), None, None),
        };
        let id = self.procs.start(command_line(&req.command));
        let control = Arc::new(Control {
            id,
            inner: Arc::downgrade(self),
            pidfile: pidfile.clone(),
            stdin: tokio::sync::Mutex::new(input),
            tty,
            ended: AtomicBool::new(false),
        });
        // The request's stdin goes first: written before the handle is returned.
        if let Some(data) = &req.stdin {
            let mut g = control.stdin.lock().await;
            if let Some(w) = g.as_mut() {
                let _ = w.write_all(data).await;
            }
        }
        self.procs
            .attach(id, Arc::clone(&control) as Arc<dyn ProcessControl>);
        let (tx, rx) = mpsc::channel(QUEUE);
        let sink = |k| StreamSink::new(tx.clone(), &self.redactor, k);
        let out = child
            .stdout
            .take()
            .map(|o| tokio::spawn(stream_output(o, sink(StreamKind::Stdout))));
        let err = child
            .stderr
            .take()
            .map(|e| tokio::spawn(stream_output(e, sink(StreamKind::Stderr))));
        // A terminal's output (stdout and stderr merged) is stdout.
        let term = output.map(|o| tokio::spawn(stream_output(o, sink(StreamKind::Stdout))));
        let me = Arc::clone(self);
        let handle = Arc::clone(&control);
        tokio::spawn(async move {
            let before = me.limit_counters();
            let timeout = req.timeout;
            let waited = match timeout {
                Some(t) => tokio::time::timeout(t, child.wait()).await.ok(),
                None => Some(child.wait().await),
            };
            let (status, limit) = match waited {
                Some(s) => (s, None),
                None => {
                    if let Some(pid) = control.pid().await {
                        me.kill_exec(pid).await;
                    }
                    let _ = child.start_kill();
                    (child.wait().await, Some(LimitKind::WallTime))
                }
            };
            for pump in [out, err].into_iter().flatten() {
                let _ = pump.await;
            }
            if let Some(mut pump) = term {
                // Drains what the terminal holds; bounded, should a copy of its slave
                // outlive runsc exec.
                if tokio::time::timeout(Duration::from_secs(1), &mut pump)
                    .await
                    .is_err()
                {
                    pump.abort();
                }
            }
            control.ended.store(true, Ordering::SeqCst);
            control.stdin.lock().await.take();
            let _ = std::fs::remove_file(&pfile);
            let _ = std::fs::remove_file(&pidfile);
            use std::os::unix::process::ExitStatusExt;
            let code = status
                .ok()
                .and_then(|s| s.code().or_else(|| s.signal().map(|n| 128 + n)));
            let last = me.process_ended(id, code, limit, before).await;
            let _ = tx.send(last.map(ExecEvent::Exit)).await;
        });
        Ok(Process::new(
            id,
            rx,
            handle as Arc<dyn ProcessControl>,
            self.spec.limits.output_bytes,
        ))
    }
}
