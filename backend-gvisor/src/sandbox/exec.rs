//! Running commands: the argv of a code string, the direct path through the sandbox's
//! control socket and the `runsc exec` fallback, output pumping, and what stopped a command
//! (a limit counted by the cgroups, the disk, the sandbox's own death).

use std::os::fd::OwnedFd;

use super::*;

/// How long a sign that the Sentry is going (its control socket closed, runsc unable to wait
/// for a command) waits for its process to end before the sandbox is judged alive.
const SENTRY_EXIT_PATIENCE: Duration = Duration::from_secs(2);

/// A process's input in [`Inner::runsc_exec_on`].
#[derive(Debug, Clone, Copy)]
pub(super) enum Stdin {
    /// `/dev/null`.
    Null,
    /// A pipe (the child's `stdin`).
    Pipe,
    /// A terminal of ours of this size: input, output and the controlling terminal.
    Tty(sandbox_core::Tty),
}

impl From<bool> for Stdin {
    fn from(piped: bool) -> Self {
        if piped {
            Stdin::Pipe
        } else {
            Stdin::Null
        }
    }
}

/// A started `runsc exec` ([`Inner::runsc_exec_on`]).
pub(super) struct RunscExec {
    /// The `runsc exec` process: it ends with the command, with its exit code.
    pub child: tokio::process::Child,
    /// Its process file (removed by the caller when it ends).
    pub pfile: PathBuf,
    /// Where runsc writes the command's pid inside (removed by the caller when it ends).
    pub pidfile: PathBuf,
    /// The terminal's master, for [`Stdin::Tty`].
    pub master: Option<sandbox_core::PtyMaster>,
}

impl Inner {
    /// `(oom kills, pids-limit hits)` of the sandbox's cgroups, where readable.
    pub(super) fn limit_counters(&self) -> (Option<u64>, Option<u64>) {
        let (mem, pids) = self.cgroup.lock().map(|c| c.clone()).unwrap_or_default();
        let read = |rel: Option<String>, ctrl: &str, file: &str, key: &str| -> Option<u64> {
            let rel = rel?;
            let p = Path::new("/sys/fs/cgroup")
                .join(ctrl)
                .join(rel.trim_start_matches('/'))
                .join(file);
            let text = std::fs::read_to_string(p).ok()?;
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
        };
        (
            read(mem, "memory", "memory.oom_control", "oom_kill "),
            read(pids, "pids", "pids.events", "max "),
        )
    }

    /// Starts `argv` with `runsc exec` (its process file and pid file named `{tag}-N` in the
    /// sandbox's directory; removed by the caller when it ends), stdout and stderr piped,
    /// stdin piped or `/dev/null`.
    pub(super) fn runsc_exec(
        &self,
        tag: &str,
        argv: Vec<String>,
        env: Vec<String>,
        cwd: &str,
        stdin: bool,
    ) -> Result<(tokio::process::Child, PathBuf, PathBuf)> {
        let s = self.runsc_exec_on(tag, argv, env, cwd, Stdin::from(stdin))?;
        Ok((s.child, s.pfile, s.pidfile))
    }

    /// [`runsc_exec`](Self::runsc_exec) with the process's input chosen, on a terminal of
    /// ours for [`Stdin::Tty`]: `runsc exec` gets its slave as stdin, stdout and stderr and
    /// as its controlling terminal (it is a session's leader), and the process inside gets
    /// a terminal backed by it (`terminal: true`). runsc forwards the signals the host
    /// terminal sends it (`SIGWINCH` on a resize, `SIGINT` on Ctrl-C) to the process.
    pub(super) fn runsc_exec_on(
        &self,
        tag: &str,
        argv: Vec<String>,
        env: Vec<String>,
        cwd: &str,
        stdin: Stdin,
    ) -> Result<RunscExec> {
        let mut process = bundle::process(argv, env, cwd, self.who, &self.spec)?;
        let mut pty = None;
        if let Stdin::Tty(tty) = stdin {
            let size = oci_spec::runtime::BoxBuilder::default()
                .height(u64::from(tty.rows))
                .width(u64::from(tty.cols))
                .build()
                .map_err(|e| Error::backend_caused(TIER, "building the terminal's size", e))?;
            process.set_terminal(Some(true));
            process.set_console_size(Some(size));
            pty = Some(
                sandbox_core::PtyMaster::open(tty).map_err(|e| Error::io("open a terminal", e))?,
            );
        }
        let n = self.seq.fetch_add(1, Ordering::SeqCst);
        let pfile = self.dir.join(format!("{tag}-{n}.json"));
        let pidfile = self.dir.join(format!("{tag}-{n}.pid"));
        write_private(
            &pfile,
            &serde_json::to_vec(&process)
                .map_err(|e| Error::backend_caused(TIER, "encoding the process spec", e))?,
        )?;
        let mut cmd = self.runsc.async_command();
        cmd.arg("exec")
            .arg("--process")
            .arg(&pfile)
            .arg("--internal-pid-file")
            .arg(&pidfile)
            .arg(&self.id)
            .kill_on_drop(true);
        let master = match pty {
            Some((master, slave)) => {
                let copy =
                    |f: &OwnedFd| f.try_clone().map_err(|e| Error::io("copy the terminal", e));
                cmd.stdin(copy(&slave)?).stdout(copy(&slave)?).stderr(slave);
                // SAFETY: between fork and exec only async-signal-safe calls: setsid(2), and
                // ioctl(2) on fd 0 (the terminal's slave) to make it our controlling terminal.
                unsafe {
                    cmd.pre_exec(|| {
                        if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
                Some(master)
            }
            None => {
                cmd.stdin(match stdin {
                    Stdin::Pipe => Stdio::piped(),
                    _ => Stdio::null(),
                })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
                None
            }
        };
        // `cmd` (and with it every copy of a terminal's slave) is dropped on return, so
        // the master's reads end when runsc's own copies close.
        match cmd.spawn() {
            Ok(child) => Ok(RunscExec {
                child,
                pfile,
                pidfile,
                master,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&pfile);
                Err(Error::io("spawn runsc exec", e))
            }
        }
    }

    /// What runs for `req`: its argv, environment (`K=V`) and working directory.
    pub(super) fn command(&self, req: &ExecRequest) -> Result<(Vec<String>, Vec<String>, String)> {
        let (argv, extra) = self.argv(&req.command)?;
        let cwd = match &req.cwd {
            None => self.cwd.clone(),
            Some(c) if c.starts_with('/') => c.clone(),
            Some(c) => WorkspacePath::parse(c)?.in_sandbox(),
        };
        let mut env = self.env.clone();
        env.extend(extra);
        env.extend(req.env.clone());
        let env = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        Ok((argv, env, cwd))
    }

    pub(super) fn argv(&self, cmd: &Command) -> Result<(Vec<String>, BTreeMap<String, String>)> {
        let mut extra = BTreeMap::new();
        if let (Command::Code(_), Some(img)) = (cmd, &self.image) {
            // Code runs the image's own interpreter: say so if it has none.
            img.require_interpreter(self.spec.language)
                .map_err(|e| e.into_core(TIER))?;
        }
        let argv = match cmd {
            Command::Argv(a) => a.clone(),
            Command::Code(code) => match self.spec.language {
                // An image's own interpreter, found on its `PATH`.
                Language::Python if self.image.is_some() => {
                    vec!["python3".into(), "-c".into(), code.clone()]
                }
                Language::Python => vec!["/usr/bin/python3".into(), "-c".into(), code.clone()],
                Language::Shell => vec!["/bin/sh".into(), "-c".into(), code.clone()],
                Language::Node | Language::Javascript => {
                    vec!["node".into(), "-e".into(), code.clone()]
                }
                Language::C => {
                    // The source travels in the environment (not on a command line).
                    extra.insert("AGENT_SANDBOX_C_SOURCE".to_string(), code.clone());
                    vec![
                        "/bin/sh".into(),
                        "-c".into(),
                        "d=$(mktemp -d) && printf '%s' \"$AGENT_SANDBOX_C_SOURCE\" > \"$d/main.c\" && unset AGENT_SANDBOX_C_SOURCE && cc -O1 -o \"$d/main\" \"$d/main.c\" && exec \"$d/main\"".into(),
                    ]
                }
                Language::Wasm => return Err(Error::unsupported(TIER, "WebAssembly modules")),
                other => return Err(Error::unsupported(TIER, format!("code strings in {other}"))),
            },
            other => return Err(Error::unsupported(TIER, format!("the command {other:?}"))),
        };
        Ok((argv, extra))
    }

    pub(super) async fn run(
        &self,
        req: ExecRequest,
        sink: Option<mpsc::Sender<Result<ExecEvent>>>,
    ) -> Result<ExecResult> {
        self.alive()?;
        req.validate()?;
        req.refuse_tty(TIER)?;
        let _shared = self.lifecycle.read().await;
        self.alive()?;
        self.life.check_running()?;
        let mut t = TimelineRecorder::start();
        let (argv, env, cwd) = self.command(&req)?;
        if self.direct.load(Ordering::SeqCst) {
            match self
                .run_direct(&argv, &env, &cwd, &req, &sink, &mut t)
                .await?
            {
                Some(r) => return Ok(r),
                None => self.direct.store(false, Ordering::SeqCst),
            }
        }
        let before = self.limit_counters();
        let (mut child, pfile, pidfile) =
            self.runsc_exec("exec", argv, env, &cwd, req.stdin.is_some())?;
        t.mark(Phase::Allocation);
        let stdin = child.stdin.take();
        let (out, err, flood) = self.start_io(
            req.stdin.clone().zip(stdin),
            child.stdout.take(),
            child.stderr.take(),
            &sink,
        );
        let timeout = req.effective_timeout(self.spec.limits.wall_time());
        let stopped = tokio::select! {
            s = tokio::time::timeout(timeout, child.wait()) => match s {
                Ok(s) => Ok(s.map_err(|e| Error::io("wait for runsc exec", e))?),
                Err(_) => Err(LimitKind::WallTime),
            },
            () = flood.notified() => Err(LimitKind::Output),
        };
        let (status, limit) = match stopped {
            Ok(s) => (s, None),
            Err(kind) => {
                if let Some(pid) = std::fs::read_to_string(&pidfile)
                    .ok()
                    .and_then(|s| s.trim().parse::<i32>().ok())
                {
                    self.kill_exec(pid).await;
                }
                let s = match tokio::time::timeout(Duration::from_secs(10), child.wait()).await {
                    Ok(s) => s.map_err(|e| Error::io("reap runsc exec", e))?,
                    Err(_) => {
                        let _ = child.start_kill();
                        child
                            .wait()
                            .await
                            .map_err(|e| Error::io("reap runsc exec", e))?
                    }
                };
                (s, Some(kind))
            }
        };
        let _ = std::fs::remove_file(&pfile);
        let _ = std::fs::remove_file(&pidfile);
        let join = |r: std::result::Result<sandbox_core::OutputBuffer, tokio::task::JoinError>| {
            r.unwrap_or_else(|_| sandbox_core::OutputBuffer::new(0))
        };
        let (out, err) = (join(out.await), join(err.await));
        t.mark(Phase::Command);
        use std::os::unix::process::ExitStatusExt;
        let mut exit_code = status.code().or_else(|| status.signal().map(|s| 128 + s));
        if exit_code == Some(128) {
            // runsc exec's own failure to start the program: 127 when it does not exist,
            // as the control-socket path (and a shell) reports it. runsc is another process
            // whose only report is this text on stderr (its exit status is 128 for every
            // start failure): the words are the signal.
            let text = String::from_utf8_lossy(err.peek());
            if text.contains("failed to load") && text.contains("no such file or directory") {
                exit_code = Some(127);
            }
        }
        // runsc's own words when it lost the wait (the Sentry's socket closed), as opposed
        // to a command's own exit status 128 (git's for every fatal error).
        let lost = exit_code == Some(128) && {
            let text = String::from_utf8_lossy(err.peek());
            // Its message is last: cut off when the command's own stderr filled the buffer.
            err.truncated()
                || text.contains("containerManager.WaitPID")
                || text.contains("waiting on PID")
        };
        Ok(self
            .conclude(exit_code, lost, limit, before, out, err, t)
            .await)
    }

    /// The result of an exec whose command has ended: a non-zero end is checked against the
    /// sandbox's cgroup counters (`before`: taken when it started) and its liveness. `lost`:
    /// the wait for the command failed (not the command's own status), a sign the Sentry is
    /// going: its end is waited for up to [`SENTRY_EXIT_PATIENCE`].
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn conclude(
        &self,
        mut exit_code: Option<i32>,
        lost: bool,
        mut limit: Option<LimitKind>,
        before: (Option<u64>, Option<u64>),
        out: sandbox_core::OutputBuffer,
        err: sandbox_core::OutputBuffer,
        t: TimelineRecorder,
    ) -> ExecResult {
        if limit.is_none() && exit_code != Some(0) {
            let after = self.limit_counters();
            let grew =
                |a: Option<u64>, b: Option<u64>| matches!((a, b), (Some(a), Some(b)) if b > a);
            // The host's OOM killer, or a pids limit that stops the sentry from creating its
            // stubs, ends the whole sandbox (it is one host process tree): report the limit,
            // and the sandbox as gone from now on.
            // 128 may be runsc's failure to wait; a lost wait means the Sentry may be on its
            // way out, its socket closed before its process ended: patience then.
            let ended = if lost || exit_code == Some(128) || grew(before.1, after.1) {
                let patience = if lost {
                    SENTRY_EXIT_PATIENCE
                } else {
                    Duration::ZERO
                };
                self.ended_within(patience).await
            } else {
                false
            };
            let hit = if grew(before.0, after.0) {
                Some((LimitKind::Memory, "killed by its memory limit"))
            } else if grew(before.1, after.1) && ended {
                Some((LimitKind::Pids, "ended by its process limit"))
            } else {
                None
            };
            if hit.is_none() && exit_code == Some(128) && ended {
                // runsc could not wait for the process: the sandbox itself is gone.
                self.life.end("the gVisor sandbox exited unexpectedly");
            }
            if let Some((kind, why)) = hit {
                limit = Some(kind);
                exit_code = Some(137);
                self.life.end(why);
            } else if self.disk_full() {
                limit = Some(LimitKind::Disk);
            }
        }
        ExecResult::from_output(exit_code, out, err, &self.redactor)
            .with_limit(limit)
            .with_timeline(t.finish())
    }

    /// Feeds the command's stdin (if given) and pumps its output (capped, streamed to `sink`
    /// when there is one), each on a task of its own. The `Notify` wakes once the output
    /// passes [`sandbox_core::flood_threshold`]: the caller stops the command (the `output`
    /// limit).
    #[allow(clippy::type_complexity)]
    pub(super) fn start_io<W, O, E>(
        &self,
        stdin: Option<(Vec<u8>, W)>,
        out: Option<O>,
        err: Option<E>,
        sink: &Option<mpsc::Sender<Result<ExecEvent>>>,
    ) -> (
        tokio::task::JoinHandle<sandbox_core::OutputBuffer>,
        tokio::task::JoinHandle<sandbox_core::OutputBuffer>,
        Arc<tokio::sync::Notify>,
    )
    where
        W: tokio::io::AsyncWrite + Unpin + Send + 'static,
        O: tokio::io::AsyncRead + Unpin + Send + 'static,
        E: tokio::io::AsyncRead + Unpin + Send + 'static,
    {
        if let Some((data, mut w)) = stdin {
            tokio::spawn(async move {
                let _ = w.write_all(&data).await;
            });
        }
        let cap = self.spec.limits.output_bytes;
        let mk = |k| {
            sink.as_ref()
                .map(|tx| StreamSink::new(tx.clone(), &self.redactor, k))
        };
        let flood = Arc::new(tokio::sync::Notify::new());
        let at = sandbox_core::flood_threshold(cap);
        let watch = |r| sandbox_core::FloodReader::new(r, at, Arc::clone(&flood));
        let out = out.map(watch);
        let watch = |r| sandbox_core::FloodReader::new(r, at, Arc::clone(&flood));
        let err = err.map(watch);
        (
            tokio::spawn(pump_output(out, cap, mk(StreamKind::Stdout))),
            tokio::spawn(pump_output(err, cap, mk(StreamKind::Stderr))),
            flood,
        )
    }

    /// Starts `argv` through the sandbox's control socket ([`crate::urpc`]) as the
    /// sandbox's user, with `stdio` as its stdin, stdout and stderr (the sandbox takes its
    /// own copies; ours are closed here): its pid inside, or why not.
    pub(super) async fn execute_direct(
        &self,
        argv: &[String],
        env: &[String],
        cwd: &str,
        stdio: [std::os::fd::OwnedFd; 3],
    ) -> Result<std::result::Result<i32, crate::urpc::CallError>> {
        use std::os::fd::AsRawFd;
        let (id, who, ns) = (self.id.clone(), self.who, self.runsc.netns.clone());
        let (a, e, c) = (argv.to_vec(), env.to_vec(), cwd.to_string());
        // Connecting, sending and the sandbox creating the process block briefly.
        tokio::task::spawn_blocking(move || {
            let [i, o, err] = &stdio;
            crate::urpc::execute(
                &id,
                ns.as_deref(),
                &crate::urpc::Exec {
                    argv: &a,
                    env: &e,
                    cwd: &c,
                    uid: who.uid,
                    gid: who.gid,
                    stdio: [i.as_raw_fd(), o.as_raw_fd(), err.as_raw_fd()],
                },
            )
        })
        .await
        .map_err(|e| Error::backend_caused(TIER, "the exec task", e))
    }

    /// Runs a command through the sandbox's control socket ([`crate::urpc`]): what
    /// `runsc exec` does, without a runsc process. `Ok(None)`: that interface is not
    /// available (nothing was started); the caller uses `runsc exec`.
    pub(super) async fn run_direct(
        &self,
        argv: &[String],
        env: &[String],
        cwd: &str,
        req: &ExecRequest,
        sink: &Option<mpsc::Sender<Result<ExecEvent>>>,
        t: &mut TimelineRecorder,
    ) -> Result<Option<ExecResult>> {
        let io = |what: &'static str| move |e: nix::Error| Error::io(what, e.into());
        let cloexec = nix::fcntl::OFlag::O_CLOEXEC;
        let (out_r, out_w) = nix::unistd::pipe2(cloexec).map_err(io("create a pipe"))?;
        let (err_r, err_w) = nix::unistd::pipe2(cloexec).map_err(io("create a pipe"))?;
        let (stdin_r, stdin_w) = match &req.stdin {
            Some(_) => {
                let (r, w) = nix::unistd::pipe2(cloexec).map_err(io("create a pipe"))?;
                (r, Some(w))
            }
            None => (
                std::fs::File::open("/dev/null")
                    .map_err(|e| Error::io("open /dev/null", e))?
                    .into(),
                None,
            ),
        };
        let before = self.limit_counters();
        let started = self
            .execute_direct(argv, env, cwd, [stdin_r, out_w, err_w])
            .await?;
        let pid = match started {
            Ok(pid) => pid,
            Err(crate::urpc::CallError::Unavailable(why)) => {
                tracing::debug!(sandbox = %self.id, %why, "starting commands with runsc exec");
                return Ok(None);
            }
            Err(crate::urpc::CallError::Remote(why)) => {
                // The sandbox refused to start it (e.g. no such executable): a result, like
                // the message and status `runsc exec` gives. The urpc reply carries the
                // Sentry's error as text only (no errno field): the words are the signal.
                let cap = self.spec.limits.output_bytes;
                let mut err = sandbox_core::OutputBuffer::new(cap);
                err.push(format!("agent-sandbox: {}: {why}\n", argv[0]).as_bytes());
                let code = if why.contains("no such file") || why.contains("not found") {
                    127
                } else {
                    126
                };
                t.mark(Phase::Command);
                let r = self
                    .conclude(
                        Some(code),
                        false,
                        None,
                        before,
                        sandbox_core::OutputBuffer::new(cap),
                        err,
                        std::mem::take(t),
                    )
                    .await;
                return Ok(Some(r));
            }
            Err(crate::urpc::CallError::Io(e)) => {
                if self.ended_within(SENTRY_EXIT_PATIENCE).await {
                    let reason = "the gVisor sandbox exited unexpectedly".to_string();
                    self.life.end(reason.clone());
                    return Err(Error::SandboxGone {
                        id: self.id.clone(),
                        reason,
                    });
                }
                return Err(Error::io("start a command in the gVisor sandbox", e));
            }
        };
        t.mark(Phase::Allocation);
        let reader = |fd: std::os::fd::OwnedFd| {
            let _ = nix::fcntl::fcntl(
                &fd,
                nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
            );
            tokio::net::unix::pipe::Receiver::from_owned_fd(fd).ok()
        };
        let stdin = stdin_w.and_then(|w| {
            let _ = nix::fcntl::fcntl(
                &w,
                nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
            );
            tokio::net::unix::pipe::Sender::from_owned_fd(w).ok()
        });
        let (out, err, flood) = self.start_io(
            req.stdin.clone().zip(stdin),
            reader(out_r),
            reader(err_r),
            sink,
        );
        let (id, ns) = (self.id.clone(), self.runsc.netns.clone());
        let mut wait =
            tokio::spawn(async move { crate::urpc::wait_pid(&id, ns.as_deref(), pid).await });
        let timeout = req.effective_timeout(self.spec.limits.wall_time());
        let stopped = tokio::select! {
            s = tokio::time::timeout(timeout, &mut wait) => s.map_err(|_| LimitKind::WallTime),
            () = flood.notified() => Err(LimitKind::Output),
        };
        let (status, limit) = match stopped {
            Ok(s) => (s, None),
            Err(kind) => {
                self.kill_exec(pid).await;
                match tokio::time::timeout(Duration::from_secs(10), &mut wait).await {
                    Ok(s) => (s, Some(kind)),
                    Err(_) => {
                        wait.abort();
                        return Err(Error::backend(
                            TIER,
                            "a timed-out command did not end after SIGKILL",
                        ));
                    }
                }
            }
        };
        let join = |r: std::result::Result<sandbox_core::OutputBuffer, tokio::task::JoinError>| {
            r.unwrap_or_else(|_| sandbox_core::OutputBuffer::new(0))
        };
        let (out, err) = (join(out.await), join(err.await));
        t.mark(Phase::Command);
        // A raw wait status; 128 (like `runsc exec`) when the wait itself failed.
        let lost = !matches!(status, Ok(Ok(_)));
        let exit_code = match status {
            Ok(Ok(ws)) if ws & 0x7f == 0 => (ws >> 8) & 0xff,
            Ok(Ok(ws)) => 128 + (ws & 0x7f),
            _ => 128,
        };
        let t = std::mem::take(t);
        Ok(Some(
            self.conclude(Some(exit_code), lost, limit, before, out, err, t)
                .await,
        ))
    }

    /// Whether the sandbox has ended, waiting up to `patience` for its sandbox process to end
    /// (after a sign that it is going: runsc could not wait for a command, the control
    /// socket broke), then asking [`container_running`](Self::container_running).
    pub(super) async fn ended_within(&self, patience: Duration) -> bool {
        let boot = *lock(&self.boot);
        if let Some(pid) = boot {
            let deadline = Instant::now() + patience;
            while !reaper::any_ended(&[pid]) {
                if Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        !self.container_running().await
    }

    /// Whether the sandbox lives: its sandbox process has not ended, and runsc says it runs
    /// or is paused.
    pub(super) async fn container_running(&self) -> bool {
        // Our own record first: a sandbox process that ended (a zombie of ours until the
        // teardown reaps it) is a dead sandbox, whatever runsc's `state` says (from 2023 on it
        // answers "running" for a zombie: `reaper::any_ended`).
        let boot = *lock(&self.boot);
        if boot.is_some_and(|pid| reaper::any_ended(&[pid])) {
            return false;
        }
        let mut cmd = self.runsc.async_command();
        cmd.args(["state", &self.id]).stdout(Stdio::piped());
        match cmd.output().await {
            Ok(out) => serde_json::from_slice::<serde_json::Value>(&out.stdout)
                // Paused (by its user, or by a snapshot while it is taken) is alive too.
                .map(|v| v["status"] == "running" || v["status"] == "paused")
                .unwrap_or(false),
            Err(_) => false,
        }
    }

    /// Kills a timed-out exec's whole process group inside the sandbox.
    pub(super) async fn kill_exec(&self, pid: i32) {
        self.signal_exec(pid, 9).await;
    }

    /// Sends signal `signo` to the process group of the command whose pid (inside) is `pid`,
    /// or to the command alone when it leads no group: a `kill` run inside the sandbox.
    pub(super) async fn signal_exec(&self, pid: i32, signo: i32) {
        let script =
            format!("kill -{signo} -{pid} 2>/dev/null || kill -{signo} {pid} 2>/dev/null; true");
        let env = vec!["PATH=/usr/bin:/bin".to_string()];
        if self.direct.load(Ordering::SeqCst) {
            let (id, who, script) = (self.id.clone(), self.who, script.clone());
            let ns = self.runsc.netns.clone();
            let killed = tokio::task::spawn_blocking(move || {
                let null = std::fs::File::open("/dev/null").ok()?;
                use std::os::fd::AsRawFd;
                let fd = null.as_raw_fd();
                let argv = ["/bin/sh".to_string(), "-c".to_string(), script];
                let env = ["PATH=/usr/bin:/bin".to_string()];
                let x = crate::urpc::Exec {
                    argv: &argv,
                    env: &env,
                    cwd: "/",
                    uid: who.uid,
                    gid: who.gid,
                    stdio: [fd, fd, fd],
                };
                crate::urpc::execute(&id, ns.as_deref(), &x).ok()
            });
            if let Ok(Some(pid)) = killed.await {
                let (id, ns) = (&self.id, self.runsc.netns.as_deref());
                let waited = crate::urpc::wait_pid(id, ns, pid);
                if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(10), waited).await {
                    return;
                }
            }
        }
        let Ok(process) = bundle::process(
            vec!["/bin/sh".into(), "-c".into(), script],
            env,
            "/",
            self.who,
            &self.spec,
        ) else {
            return;
        };
        let n = self.seq.fetch_add(1, Ordering::SeqCst);
        let pfile = self.dir.join(format!("kill-{n}.json"));
        if let Ok(bytes) = serde_json::to_vec(&process) {
            if write_private(&pfile, &bytes).is_ok() {
                let mut cmd = self.runsc.async_command();
                cmd.arg("exec").arg("--process").arg(&pfile).arg(&self.id);
                let _ = tokio::time::timeout(Duration::from_secs(10), cmd.status()).await;
                let _ = std::fs::remove_file(&pfile);
            }
        }
    }
}
