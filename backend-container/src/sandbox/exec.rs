//! Running a command: its argv and exec request, the exec (through a spare supervisor or
//! the init), its output pumped, its timeout and output flood, and the limit it hit.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_core::{
    Command, Error, ExecEvent, ExecRequest, ExecResult, Language, LimitKind, OutputBuffer, Phase,
    Result, TimelineRecorder,
};
use tokio::sync::{mpsc, watch, Notify};

use super::{pipe, pump, set_nonblocking, Inner, PumpSink, TIER};
use crate::cgroup::LimitCounters;
use crate::ctl::{self, Reply};
use crate::proto::{self, Dec, Enc, EncodeInit, ExecSpec};

/// Compiles and runs a C program given as `$1` (the code), cleaning up after itself.
const C_RUNNER: &str = r#"d=$(mktemp -d /tmp/.agent-c.XXXXXX) || exit 125
printf '%s' "$1" > "$d/main.c" && cc -O1 -o "$d/main" "$d/main.c" -lm || { rc=$?; rm -rf "$d"; exit $rc; }
"$d/main"; rc=$?; rm -rf "$d"; exit $rc"#;

pub(crate) fn wait_status_code(status: i32) -> (Option<i32>, Option<i32>) {
    if libc::WIFEXITED(status) {
        (Some(libc::WEXITSTATUS(status)), None)
    } else if libc::WIFSIGNALED(status) {
        let s = libc::WTERMSIG(status);
        (Some(128 + s), Some(s))
    } else {
        (None, None)
    }
}

/// The `Instant` of a CLOCK_MONOTONIC reading in nanoseconds (`Instant` is that clock on
/// Linux); `None` for 0 (unknown) or a reading from the future.
fn instant_of(ns: u64) -> Option<Instant> {
    if ns == 0 {
        return None;
    }
    let now = Instant::now();
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).ok()?;
    let now_ns = u64::try_from(t.tv_sec())
        .ok()?
        .checked_mul(1_000_000_000)?
        .checked_add(u64::try_from(t.tv_nsec()).ok()?)?;
    now.checked_sub(Duration::from_nanos(now_ns.checked_sub(ns)?))
}

impl Inner {
    fn argv(&self, cmd: &Command) -> Result<Vec<String>> {
        Ok(match cmd {
            Command::Argv(a) => a.clone(),
            Command::Code(code) => {
                // Code runs the image's own interpreter: say so if it has none.
                if let Some(img) = &self.image {
                    img.require_interpreter(self.spec.language)
                        .map_err(|e| e.into_core(TIER))?;
                }
                let v = |p: &[&str]| {
                    p.iter()
                        .map(|s| s.to_string())
                        .chain([code.clone()])
                        .collect::<Vec<_>>()
                };
                match self.spec.language {
                    // An image's own interpreter, found on its `PATH`.
                    Language::Python if self.image.is_some() => v(&["python3", "-c"]),
                    Language::Python => v(&["/usr/bin/python3", "-c"]),
                    Language::Shell => v(&["/bin/sh", "-c"]),
                    Language::Node | Language::Javascript => v(&["node", "-e"]),
                    Language::C => vec![
                        "/bin/sh".into(),
                        "-c".into(),
                        C_RUNNER.into(),
                        "agent-sandbox-c".into(),
                        code.clone(),
                    ],
                    other => {
                        return Err(Error::unsupported(TIER, format!("code strings in {other}")))
                    }
                }
            }
            other => return Err(Error::unsupported(TIER, format!("the command {other:?}"))),
        })
    }

    fn disk_full(&self) -> bool {
        let mut dirs = vec![
            format!("/proc/{}/root/workspace", self.pid),
            format!("/proc/{}/root/tmp", self.pid),
            format!("/proc/{}/root/dev/shm", self.pid),
        ];
        if crate::own_root(&self.spec) {
            dirs.push(format!("/proc/{}/fd/{}", self.pid, proto::UPPER_FD));
        }
        dirs.iter().any(|d| {
            nix::sys::statvfs::statvfs(d.as_str())
                .is_ok_and(|s| s.blocks_available() == 0 || s.files_available() == 0)
        })
    }

    /// Kills what exec `id` left running and waits (bounded) until it is gone.
    async fn kill_leftovers(&self, id: u64, replies: &mut Replies) {
        match replies {
            Replies::Job(job) => {
                job.kill(id);
                // Acknowledged once the tree is gone; a hang-up means the supervisor is.
                let _ = tokio::time::timeout(Duration::from_secs(10), async {
                    while let Some(r) = job.recv().await {
                        if r.kind == proto::REP_OK {
                            break;
                        }
                    }
                })
                .await;
            }
            Replies::Ctl(_) => {
                let mut rx = self.ctl.register_fixed(id);
                if self.ctl.send(proto::MSG_KILL, id, &[], &[]).await.is_ok() {
                    let _ = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
                }
                self.ctl.unregister(id);
            }
        }
    }

    async fn kill_tree(&self, id: u64, replies: &Replies) {
        // The exec's supervisor (a child subreaper) kills every descendant.
        match replies {
            Replies::Job(job) => job.kill(id),
            Replies::Ctl(_) => {
                let _ = self.ctl.send(proto::MSG_KILL, id, &[], &[]).await;
            }
        }
    }

    /// The init's exec request for `req`: argv, cwd, env, user and rlimits.
    #[allow(clippy::unnecessary_cast)] // RLIMIT_* types differ between libcs
    pub(crate) fn exec_spec(&self, req: &ExecRequest) -> Result<ExecSpec> {
        let argv = self.argv(&req.command)?;
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(Error::invalid("command", "code cannot contain NUL"));
        }
        let cwd = match &req.cwd {
            None => self.cwd.clone(),
            Some(c) if c.starts_with('/') => c.clone(),
            Some(c) => format!("/workspace/{c}"),
        };
        if cwd.contains('\0') {
            return Err(Error::invalid("cwd", "cannot contain NUL"));
        }
        let mut env = self.env.clone();
        for (k, v) in &req.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(Error::invalid(
                    "env",
                    format!("`{k}` is not a valid variable"),
                ));
            }
            env.insert(k.clone(), v.clone());
        }
        let l = &self.spec.limits;
        let cpu_s = l.cpu_time_ms.div_ceil(1000).max(1);
        let mut x = ExecSpec {
            flags: 0,
            uid: self.user,
            gid: self.group,
            cwd,
            argv,
            env: env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            rlimits: vec![
                (
                    libc::RLIMIT_NOFILE as u32,
                    u64::from(l.open_files),
                    u64::from(l.open_files),
                ),
                (libc::RLIMIT_CORE as u32, 0, 0),
                (libc::RLIMIT_CPU as u32, cpu_s, cpu_s + 1),
            ],
            tty: req.tty.map_or((0, 0), |t| (t.rows, t.cols)),
        };
        if self.stay_root {
            x.flags |= proto::EXEC_STAY_ROOT;
        }
        Ok(x)
    }

    pub(crate) async fn run(
        &self,
        req: ExecRequest,
        sink: Option<mpsc::Sender<Result<ExecEvent>>>,
    ) -> Result<ExecResult> {
        self.alive()?;
        req.validate()?;
        req.refuse_tty(TIER)?;
        self.life.check_running()?;
        let mut t = TimelineRecorder::start();
        let mut x = self.exec_spec(&req)?;
        let l = &self.spec.limits;
        let io = |what: &str| {
            let what = what.to_string();
            move |e: std::io::Error| Error::io(what, e)
        };
        let (out_r, out_w) = pipe().map_err(io("create stdout pipe"))?;
        let (err_r, err_w) = pipe().map_err(io("create stderr pipe"))?;
        let stdin = match &req.stdin {
            Some(d) => Some((pipe().map_err(io("create stdin pipe"))?, d.clone())),
            None => None,
        };
        let mut fds: Vec<BorrowedFd<'_>> = vec![out_w.as_fd(), err_w.as_fd()];
        if let Some(((r, _), _)) = &stdin {
            x.flags |= proto::EXEC_STDIN;
            fds.push(r.as_fd());
        }
        let mut payload = Enc::default();
        payload.exec(&x);
        // Straight to the init's spare supervisor when there is one; else through the init.
        let fits = payload.0.len() <= proto::INLINE_MAX;
        let job = fits.then(|| self.ctl.take_spare()).flatten().and_then(|j| {
            let id = self.ctl.next_id();
            j.start(id, &payload.0, &fds).ok().map(|()| (id, j))
        });
        let (id, mut replies) = match job {
            Some((id, j)) => (id, Replies::Job(j)),
            None => {
                let (id, rx) = self.ctl.register();
                if let Err(e) = self.ctl.send(proto::MSG_EXEC, id, &payload.0, &fds).await {
                    self.ctl.unregister(id);
                    if self.ctl.is_closed() {
                        return Err(self.gone_err());
                    }
                    return Err(Error::io("send exec request to the sandbox init", e));
                }
                (id, Replies::Ctl(rx))
            }
        };
        drop(fds);
        drop((out_w, err_w));
        // The limit counters before the command can have touched them: read while the
        // supervisor wakes up and spawns it (~0.2 ms), not before the request goes out.
        let counters = self.limit_counters();
        let stdin_task = stdin.map(|((r, w), data)| {
            drop(r);
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                set_nonblocking(w.as_raw_fd());
                if let Ok(mut tx) = tokio::net::unix::pipe::Sender::from_owned_fd(w) {
                    let _ = tx.write_all(&data).await;
                }
            })
        });
        let cap = l.output_bytes;
        let flood_at = cap.saturating_mul(4).max(cap.saturating_add(8 << 20));
        let (stop_tx, stop_rx) = watch::channel(false);
        let flood = Arc::new(Notify::new());
        // The pumps run inside this task (no task spawns, no cross-thread wake-ups per exec).
        let out_pump = pump(
            out_r,
            cap,
            flood_at,
            sink.clone()
                .map(|tx| PumpSink::new(tx, &self.redactor, cap)),
            true,
            stop_rx.clone(),
            Arc::clone(&flood),
        );
        let err_pump = pump(
            err_r,
            cap,
            flood_at,
            sink.map(|tx| PumpSink::new(tx, &self.redactor, cap)),
            false,
            stop_rx,
            Arc::clone(&flood),
        );
        tokio::pin!(out_pump, err_pump);
        let (mut out, mut err): (Option<OutputBuffer>, Option<OutputBuffer>) = (None, None);

        let timeout = req.effective_timeout(l.wall_time());
        let deadline = tokio::time::Instant::now() + timeout;
        let mut grace: Option<tokio::time::Instant> = None;
        let (mut timed_out, mut flooded) = (false, false);
        let mut status: Option<i32> = None;
        let mut reusable = false;
        let mut failure: Option<Error> = None;
        loop {
            let grace_at = grace.unwrap_or(deadline + Duration::from_secs(3600));
            tokio::select! {
                r = replies.recv() => match r {
                    Some(Reply { kind: proto::REP_EXITED, payload, .. }) => {
                        let mut d = Dec::new(&payload);
                        status = d.i32().ok();
                        let started = d.u8().and_then(|_| d.u64()).unwrap_or(0);
                        if let Some(at) = instant_of(started) {
                            t.mark_at(Phase::Allocation, at);
                        }
                        reusable = d.u8().is_ok_and(|f| f & proto::EXITED_REUSABLE != 0);
                        break;
                    }
                    Some(Reply { kind: proto::REP_ERR, payload, .. }) => {
                        let mut d = Dec::new(&payload);
                        let _ = (d.u32(), d.i32());
                        failure = Some(Error::backend(TIER, format!("sandbox init refused the exec: {}", d.str().unwrap_or_default())));
                        break;
                    }
                    Some(_) => {}
                    None if matches!(replies, Replies::Job(_)) && !self.init_died().await => {
                        failure = Some(Error::backend(TIER, "the command's supervisor died before reporting (killed from outside?)"));
                        break;
                    }
                    None => {
                        failure = Some(self.gone_err_after_init_death());
                        break;
                    }
                },
                _ = tokio::time::sleep_until(deadline), if grace.is_none() => {
                    timed_out = true;
                    self.kill_tree(id, &replies).await;
                    grace = Some(tokio::time::Instant::now() + Duration::from_secs(10));
                }
                _ = flood.notified(), if grace.is_none() => {
                    flooded = true;
                    self.kill_tree(id, &replies).await;
                    grace = Some(tokio::time::Instant::now() + Duration::from_secs(10));
                }
                _ = tokio::time::sleep_until(grace_at), if grace.is_some() => {
                    // The leader did not die within the grace period (uninterruptible sleep?).
                    break;
                }
                o = &mut out_pump, if out.is_none() => out = Some(o),
                e = &mut err_pump, if err.is_none() => err = Some(e),
            }
        }
        self.ctl.unregister(id);
        let _ = stop_tx.send(true);
        let out = match out {
            Some(o) => o,
            None => out_pump.await,
        };
        let err = match err {
            Some(e) => e,
            None => err_pump.await,
        };
        if let Some(s) = stdin_task {
            s.abort();
        }
        if let Some(f) = failure {
            return Err(f);
        }
        t.mark(Phase::Command);
        let (exit_code, signal) = status.map_or((None, None), wait_status_code);
        let limit = self.blame(exit_code, signal, &counters, flooded, timed_out);
        if matches!(limit, Some(LimitKind::Memory | LimitKind::Pids)) {
            // A runaway tree (fork bomb, leaking children) must not outlive the exec that
            // hit the limit: its leftovers are still grouped under the exec's supervisor.
            self.kill_leftovers(id, &mut replies).await;
        }
        // The spare that served this exec takes the next one, unless we asked it to kill
        // (it may be tearing the tree down) or the exec left anything behind.
        if let Replies::Job(j) = replies {
            if reusable
                && !timed_out
                && !flooded
                && limit.is_none_or(|l| !matches!(l, LimitKind::Memory | LimitKind::Pids))
            {
                self.ctl.give_back(j);
            }
        }
        crate::spawn::prefork();
        Ok(ExecResult::from_output(exit_code, out, err, &self.redactor)
            .with_limit(limit)
            .with_timeline(t.finish()))
    }

    /// The sandbox's limit counters as a command starts (see [`LimitCounters`]): taken
    /// while its supervisor wakes up and spawns it (~0.2 ms), not before the request goes
    /// out.
    pub(crate) fn limit_counters(&self) -> LimitCounters {
        self.cgroup
            .as_ref()
            .map_or_else(LimitCounters::none, |c| c.limit_counters())
    }

    /// The limit that stopped a command that ended with `exit_code`/`signal`, given the
    /// cgroup counters taken when it started and whether we stopped it for its output or
    /// its time. Only a failure is blamed on a limit: a success skips the counters.
    pub(crate) fn blame(
        &self,
        exit_code: Option<i32>,
        signal: Option<i32>,
        counters: &LimitCounters,
        flooded: bool,
        timed_out: bool,
    ) -> Option<LimitKind> {
        let failed = exit_code != Some(0);
        let (oom, pids) = if failed {
            counters.hit()
        } else {
            (false, false)
        };
        if failed && oom {
            Some(LimitKind::Memory)
        } else if failed && pids {
            Some(LimitKind::Pids)
        } else if flooded {
            Some(LimitKind::Output)
        } else if signal == Some(libc::SIGXCPU) {
            Some(LimitKind::CpuTime)
        } else if timed_out {
            Some(LimitKind::WallTime)
        } else if failed && self.disk_full() {
            Some(LimitKind::Disk)
        } else {
            None
        }
    }

    /// Whether the init is gone (or the sandbox torn down), allowing the control socket's
    /// reader up to ~10 ms to notice: a supervisor's socket hangs up at the same moment as the
    /// init's when the whole sandbox dies.
    async fn init_died(&self) -> bool {
        for _ in 0..20 {
            if self.ctl.is_closed() || self.life.is_gone() {
                return true;
            }
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        false
    }

    fn gone_err_after_init_death(&self) -> Error {
        self.terminate("its init exited");
        self.gone_err()
    }
}

/// Where an exec's replies come from: the control socket (routed by id), or the spare
/// supervisor's own socket (see [`ctl::Job`]).
#[derive(Debug)]
enum Replies {
    Ctl(mpsc::UnboundedReceiver<Reply>),
    Job(ctl::Job),
}

impl Replies {
    async fn recv(&mut self) -> Option<Reply> {
        match self {
            Replies::Ctl(rx) => rx.recv().await,
            Replies::Job(j) => j.recv().await,
        }
    }
}
