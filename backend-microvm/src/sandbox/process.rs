//! Background processes and terminals ([`Sandbox::spawn`](sandbox_core::Sandbox::spawn))
//! through the guest agent's `Spawn` request.
//!
//! The agent keeps the process's input open for `Input` frames, signals its group, resizes
//! its terminal (one it opens in the guest: `/dev/pts`, a session of its own), and sends its
//! output only within a window that we give back as the output is consumed: a thread of ours
//! per process moves each chunk (redacted) into the [`Process`]'s bounded queue and only then
//! grants its cost back. When nobody reads, the queue fills, the grants stop, the agent stops
//! reading the process's pipe, and the process blocks on its next write: nothing is dropped,
//! and neither the shared channel nor either side's memory grows. A process whose handle is
//! gone keeps running; its output is then read and dropped.

use std::sync::atomic::{AtomicBool, Ordering};

use sandbox_core::process::command_line;
use sandbox_core::{Process, ProcessControl, ProcessId, Signal, Tty};

use super::*;
use crate::agent_client::proto::FRAME_COST;

/// Output a process may have in flight to us before we give it back (at most this many
/// [`FRAME_COST`]-sized frames: well under the client's queue per request).
const WINDOW: u32 = 128 * 1024;
/// Chunks in flight to a process's reader before it is held back.
const QUEUE: usize = 64;
/// How long one control call (input, signal, resize) may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// What a [`Process`] handle drives.
struct Control {
    id: ProcessId,
    /// The spawn's request id on the agent channel.
    target: u32,
    agent: AgentClient,
    tty: bool,
    ended: AtomicBool,
}

impl Control {
    /// Runs a blocking control call; the agent's `NotFound` means the process has ended.
    async fn call<F>(&self, f: F) -> Result<()>
    where
        F: FnOnce(&AgentClient, u32) -> std::result::Result<(), AgentError> + Send + 'static,
    {
        if self.ended.load(Ordering::SeqCst) {
            return Err(Error::ProcessExited { id: self.id });
        }
        let (agent, target) = (self.agent.clone(), self.target);
        let r = tokio::task::spawn_blocking(move || f(&agent, target))
            .await
            .map_err(join_err)?;
        match r {
            Ok(()) => Ok(()),
            Err(AgentError::Remote {
                kind: ErrorKind::NotFound,
                ..
            }) => Err(Error::ProcessExited { id: self.id }),
            Err(e) => Err(map_agent_error(e, None)),
        }
    }
}

#[async_trait]
impl ProcessControl for Control {
    async fn write_stdin(&self, data: bytes::Bytes) -> Result<()> {
        self.call(move |a, t| a.input(t, &data, CONTROL_TIMEOUT))
            .await
    }

    async fn close_stdin(&self) -> Result<()> {
        match self.call(|a, t| a.close_input(t, CONTROL_TIMEOUT)).await {
            // Closing the input of a process that ended is done already.
            Err(Error::ProcessExited { .. }) => Ok(()),
            r => r,
        }
    }

    async fn signal(&self, signal: Signal) -> Result<()> {
        let n = signal.number();
        self.call(move |a, t| a.signal(t, n, CONTROL_TIMEOUT)).await
    }

    async fn resize(&self, tty: Tty) -> Result<()> {
        if !self.tty {
            return Err(sandbox_core::process::no_terminal(self.id));
        }
        self.call(move |a, t| a.resize(t, tty.rows, tty.cols, CONTROL_TIMEOUT))
            .await
    }
}

impl Inner {
    /// Starts `req` in the background (see the module docs).
    pub(super) async fn spawn(self: &Arc<Self>, req: ExecRequest) -> Result<Process> {
        req.validate()?;
        let mut areq = self.agent_request(&req)?;
        areq.timeout_ms = req.timeout.map_or(0, |t| {
            u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1)
        });
        let tty = req.tty.map(|t| (t.rows, t.cols));
        // Held while it starts only: a snapshot waits for the start, then refuses while the
        // process runs (see `snapshot`).
        let shared = Arc::clone(&self.lifecycle).read_owned().await;
        let (agent, _) = self.handles()?;
        let a = agent.clone();
        let handle = tokio::task::spawn_blocking(move || a.start_spawn(&areq, tty, WINDOW))
            .await
            .map_err(join_err)?
            .map_err(|e| self.fail(e, None))?;
        drop(shared);
        let (tx, rx) = mpsc::channel(QUEUE);
        let command = command_line(&req.command);
        let target = handle.id();
        let (id, control) = match self.follow(agent.clone(), handle, command, tty.is_some(), tx) {
            Ok(f) => f,
            Err(e) => {
                // The process runs but nothing would read it: end it.
                let _ =
                    tokio::task::spawn_blocking(move || agent.signal(target, 9, CONTROL_TIMEOUT))
                        .await;
                return Err(Error::io("start the process's output thread", e));
            }
        };
        Ok(Process::new(id, rx, control, self.spec.limits.output_bytes))
    }

    /// Lists `handle`'s process in the table and starts the thread that moves its output to
    /// `tx` (dropped when nobody listens) and records its exit. If the thread cannot start,
    /// the process is recorded as ended (the caller decides what to do with the guest's).
    fn follow(
        self: &Arc<Self>,
        agent: AgentClient,
        handle: agent_client::ExecHandle,
        command: String,
        tty: bool,
        tx: mpsc::Sender<Result<ExecEvent>>,
    ) -> std::io::Result<(ProcessId, Arc<dyn ProcessControl>)> {
        let id = self.procs.start(command.clone());
        let target = handle.id();
        let control = Arc::new(Control {
            id,
            target,
            agent: agent.clone(),
            tty,
            ended: AtomicBool::new(false),
        });
        self.procs
            .attach(id, Arc::clone(&control) as Arc<dyn ProcessControl>);
        lock(&self.background).insert(target, (command, tty));
        let me = Arc::clone(self);
        let c = Arc::clone(&control);
        let spawned = std::thread::Builder::new()
            .name(format!("microvm-proc-{id}"))
            .spawn(move || {
                let last = forward(&agent, handle, &me.redactor, &tx);
                c.ended.store(true, Ordering::SeqCst);
                lock(&me.background).remove(&target);
                let last = last.map_err(|e| me.fail(e, None));
                me.procs
                    .exited(id, last.as_ref().ok().and_then(|r| r.exit_code));
                let _ = tx.blocking_send(last.map(ExecEvent::Exit));
            });
        match spawned {
            Ok(_) => Ok((id, control as Arc<dyn ProcessControl>)),
            Err(e) => {
                lock(&self.background).remove(&target);
                self.procs.exited(id, None);
                Err(e)
            }
        }
    }

    /// The background processes a restored guest's agent still runs (recorded by the
    /// snapshot, their requests adopted by the new client): listed, signalled and resized as
    /// before; nobody holds their handles, so their output is read and dropped. Their window
    /// is given again (what was in flight at the snapshot is not coming back).
    pub(super) fn adopt_processes(
        self: &Arc<Self>,
        agent: &AgentClient,
        adopted: Vec<(agent_client::ExecHandle, String, bool)>,
    ) -> Result<()> {
        for (handle, command, tty) in adopted {
            let target = handle.id();
            let (tx, rx) = mpsc::channel(1);
            // Nobody reads: the output is dropped as it comes.
            drop(rx);
            self.follow(agent.clone(), handle, command, tty, tx)
                .map_err(|e| Error::io("start a restored process's output thread", e))?;
            agent
                .grant(target, WINDOW)
                .map_err(|e| map_agent_error(e, None))?;
        }
        Ok(())
    }

    /// The running background processes, as a snapshot records them.
    pub(super) fn background_processes(&self) -> Vec<(u32, String, bool)> {
        lock(&self.background)
            .iter()
            .map(|(t, (c, tty))| (*t, c.clone(), *tty))
            .collect()
    }
}

/// What a frame of `len` output bytes cost of its window: its length, at least
/// [`FRAME_COST`] (the agent's rule for `Spawn` and `Connect` windows).
pub(super) fn frame_cost(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX).max(FRAME_COST)
}

/// Moves a process's output (redacted) into its handle's queue, granting each frame's cost
/// back once it is queued (or dropped, when the handle is gone); returns how it ended.
fn forward(
    agent: &AgentClient,
    mut handle: agent_client::ExecHandle,
    redactor: &Redactor,
    tx: &mpsc::Sender<Result<ExecEvent>>,
) -> std::result::Result<ExecResult, AgentError> {
    let target = handle.id();
    let mut streams = [
        StreamRedactor::new(redactor.clone()),
        StreamRedactor::new(redactor.clone()),
    ];
    let mut listening = true;
    let mut send = |ev: ExecEvent| {
        if listening && tx.blocking_send(Ok(ev)).is_err() {
            // The handle is gone: the process goes on, its output is dropped.
            listening = false;
        }
    };
    loop {
        let (i, data) = match handle.next_event()? {
            agent_client::ExecEvent::Stdout(d) => (0, d),
            agent_client::ExecEvent::Stderr(d) => (1, d),
            agent_client::ExecEvent::Exit(x) => {
                for (i, s) in streams.iter_mut().enumerate() {
                    let rest = s.finish(false);
                    if !rest.is_empty() {
                        send(event(i, rest));
                    }
                }
                let exit_code = x
                    .code
                    .or(x.signal.map(|s| 128 + s))
                    .or(x.timed_out.then_some(137));
                let limit = x.timed_out.then_some(LimitKind::WallTime);
                return Ok(ExecResult::new(exit_code, Vec::new(), Vec::new()).with_limit(limit));
            }
        };
        let cost = frame_cost(data.len());
        let chunk = streams[i].push(&data);
        if !chunk.is_empty() {
            send(event(i, chunk));
        }
        agent.grant(target, cost)?;
    }
}

fn event(stream: usize, data: Vec<u8>) -> ExecEvent {
    if stream == 0 {
        ExecEvent::Stdout(data.into())
    } else {
        ExecEvent::Stderr(data.into())
    }
}

#[cfg(test)]
mod tests {
    //! Against the real agent binary as a host process (see the sandbox module's tests):
    //! the plumbing of input, output, flow control, signals and terminals, without a VM.
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::super::tests::over_a_host_agent::{assert_still_served, sandbox, spec, SECRET};
    use super::*;
    use sandbox_core::{ProcessState, Sandbox};

    /// Reads `p`'s output until it contains `needle` (30 s at most); returns all of it.
    async fn read_until(p: &mut Process, needle: &str) -> String {
        let mut all = String::new();
        while !all.contains(needle) {
            match tokio::time::timeout(Duration::from_secs(30), p.next()).await {
                Ok(Some(Ok(ExecEvent::Stdout(b) | ExecEvent::Stderr(b)))) => {
                    all.push_str(&String::from_utf8_lossy(&b))
                }
                other => panic!("waiting for {needle:?} after {all:?}: {other:?}"),
            }
        }
        all
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_process_reads_input_streams_output_and_takes_signals() {
        let (s, _ws) = sandbox(spec());
        let mut p = s
            .spawn(ExecRequest::code(
                "while read l; do echo \"line:$l\"; done; echo \"eof $API_TOKEN\"",
            ))
            .await
            .unwrap();
        p.write_stdin(&b"a\n"[..]).await.unwrap();
        read_until(&mut p, "line:a\n").await;
        // Execs run beside it, on the same channel.
        let r = s.exec(ExecRequest::code("echo beside")).await.unwrap();
        assert_eq!(r.stdout_str(), "beside\n");
        let listed = s.processes().await.unwrap();
        assert_eq!(
            (listed[0].id, listed[0].state),
            (p.id(), ProcessState::Running)
        );
        p.close_stdin().await.unwrap();
        let out = read_until(&mut p, "eof").await;
        assert!(!out.contains(SECRET), "{out:?}");
        let r = p.wait(Some(Duration::from_secs(30))).await.unwrap();
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        let e = p.write_stdin(&b"late"[..]).await.unwrap_err();
        assert!(matches!(e, Error::ProcessExited { .. }), "{e}");
        let e = p.signal(Signal::Terminate).await.unwrap_err();
        assert!(matches!(e, Error::ProcessExited { .. }), "{e}");

        // SIGINT reaches a handler; SIGKILL through the sandbox's table is 137.
        let mut q = s
            .spawn(ExecRequest::code(
                "trap 'echo got-int; exit 5' INT; echo ready; while :; do sleep 0.1; done",
            ))
            .await
            .unwrap();
        read_until(&mut q, "ready").await;
        q.signal(Signal::Interrupt).await.unwrap();
        read_until(&mut q, "got-int").await;
        assert_eq!(q.wait(None).await.unwrap().exit_code, Some(5));
        let mut k = s.spawn(ExecRequest::argv(["sleep", "30"])).await.unwrap();
        s.signal(k.id(), Signal::Kill).await.unwrap();
        assert_eq!(k.wait(None).await.unwrap().exit_code, Some(137));
        // A resize without a terminal is bad input.
        let e = k.resize(24, 80).await.unwrap_err();
        assert!(matches!(e, Error::InvalidSpec { .. }), "{e}");
        s.destroy().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_nobody_reads_holds_the_process_not_the_channel() {
        const N: usize = 16 << 20;
        let (s, _ws) = sandbox(spec());
        let mut p = s
            .spawn(ExecRequest::code(format!(
                "head -c {N} /dev/zero; echo done >&2"
            )))
            .await
            .unwrap();
        // Nobody reads: the process is held (its pipe full, our window spent) while the
        // channel still serves everyone else.
        assert_still_served(&s).await;
        let listed = s.processes().await.unwrap();
        assert_eq!(listed[0].state, ProcessState::Running, "{listed:?}");
        // Then read: every byte arrives, nothing was dropped.
        let (mut out, mut err) = (0usize, String::new());
        loop {
            match tokio::time::timeout(Duration::from_secs(60), p.next()).await {
                Ok(Some(Ok(ExecEvent::Stdout(b)))) => out += b.len(),
                Ok(Some(Ok(ExecEvent::Stderr(b)))) => err.push_str(&String::from_utf8_lossy(&b)),
                Ok(Some(Ok(ExecEvent::Exit(r)))) => {
                    assert_eq!(r.exit_code, Some(0));
                    break;
                }
                other => panic!("after {out} bytes: {other:?}"),
            }
        }
        assert_eq!((out, err.as_str()), (N, "done\n"));
        s.destroy().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_terminal_session_resizes_interrupts_and_exits_with_its_code() {
        let (s, _ws) = sandbox(spec());
        let mut sh = s
            .spawn(ExecRequest::argv(["/bin/sh", "-i"]).tty(24, 80))
            .await
            .unwrap();
        sh.write_stdin(&b"stty size; tty\n"[..]).await.unwrap();
        let out = read_until(&mut sh, "/dev/pts/").await;
        assert!(out.contains("24 80"), "{out:?}");
        sh.resize(30, 100).await.unwrap();
        sh.write_stdin(&b"stty size\n"[..]).await.unwrap();
        read_until(&mut sh, "30 100").await;
        // Ctrl-C reaches the foreground job through the terminal, not the shell.
        sh.write_stdin(&b"sleep 1000\n"[..]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        sh.write_stdin(&b"\x03echo after-$((6*7))\n"[..])
            .await
            .unwrap();
        read_until(&mut sh, "after-42").await;
        sh.write_stdin(&b"exit 3\n"[..]).await.unwrap();
        let r = sh.wait(Some(Duration::from_secs(30))).await.unwrap();
        assert_eq!(r.exit_code, Some(3), "{r:?}");
        let e = sh.resize(10, 10).await.unwrap_err();
        assert!(matches!(e, Error::ProcessExited { .. }), "{e}");
        // exec has no terminal.
        let e = s
            .exec(ExecRequest::argv(["true"]).tty(24, 80))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        s.destroy().await.unwrap();
    }
}
