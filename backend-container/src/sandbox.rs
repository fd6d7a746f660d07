//! A live container sandbox: its init, cgroups, control channel, exec and file API.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use sandbox_core::{
    Command, DirEntry, EgressEnforcer, Error, ExecEvent, ExecRequest, ExecResult, ExecStream,
    Language, Lifecycle, LimitKind, NetworkEvent, NetworkPolicy, OutputBuffer, Phase, Ports,
    Process, ProcessId, ProcessInfo, PublishedPort, Redactor, Result, Sandbox, SandboxSpec, Signal,
    SnapshotDraft, SnapshotId, SnapshotKind, SnapshotStore, StreamRedactor, Tier, Timeline,
    TimelineRecorder, Transition,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{mpsc, watch, Notify};

use crate::cgroup::SandboxCgroup;
use crate::ctl::{self, Ctl, Reply};
use crate::files::{self, Owner};
use crate::proto::{self, Dec, Enc, EncodeInit, ExecSpec};
use crate::spawn::IdMap;

pub(crate) const ENGINE: &str = "agent-sandbox-container 1";
pub(crate) const TIER: Tier = Tier::Container;

/// Compiles and runs a C program given as `$1` (the code), cleaning up after itself.
const C_RUNNER: &str = r#"d=$(mktemp -d /tmp/.agent-c.XXXXXX) || exit 125
printf '%s' "$1" > "$d/main.c" && cc -O1 -o "$d/main" "$d/main.c" -lm || { rc=$?; rm -rf "$d"; exit $rc; }
"$d/main"; rc=$?; rm -rf "$d"; exit $rc"#;

/// Everything a sandbox owns, shared with its streaming and timer tasks.
pub(crate) struct Inner {
    pub id: String,
    pub spec: SandboxSpec,
    pub env: BTreeMap<String, String>,
    pub redactor: Redactor,
    pub born: Instant,
    /// Live, paused, gone with the reason, releasing or released (`terminate` runs the
    /// teardown once through it; later calls wait for it).
    pub life: Lifecycle,
    /// Host pid of the init (our child until reaped in `terminate`).
    pub pid: libc::pid_t,
    pub ctl: Arc<Ctl>,
    pub cgroup: Option<SandboxCgroup>,
    pub ids: IdMap,
    /// The lease on `ids`' host uid range (as root): released with this state.
    pub _lease: Option<crate::slots::SlotLease>,
    /// uid inside that runs commands.
    pub user: u32,
    /// gid inside that runs commands.
    pub group: u32,
    /// The working directory of commands that name none: the image's `WorkingDir`, else
    /// `/workspace`.
    pub cwd: String,
    /// The sandbox's image, if any (held: the cache keeps it while the sandbox lives).
    pub image: Option<sandbox_image::Image>,
    /// Commands keep uid 0 inside (with no capabilities): rootless, or a rootfs directory.
    pub stay_root: bool,
    /// The egress enforcer this sandbox is attached to (policies other than deny-all).
    pub egress: Option<Arc<dyn EgressEnforcer>>,
    pub state_file: Option<PathBuf>,
    /// The lifetime timer, aborted on terminate.
    pub timer: Mutex<Option<tokio::task::AbortHandle>>,
    /// Background processes.
    pub procs: sandbox_core::ProcessTable,
    /// Published ports (closed on terminate).
    pub ports: Ports,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContainerSandbox")
            .field("id", &self.id)
            .field("init_pid", &self.pid)
            .finish()
    }
}

/// A sandbox of [`ContainerBackend`](crate::ContainerBackend).
#[derive(Debug)]
pub struct ContainerSandbox {
    pub(crate) inner: Arc<Inner>,
    pub(crate) timeline: Timeline,
}

impl ContainerSandbox {
    /// Host pid of the sandbox's init (pid 1 inside). For diagnostics and tests.
    pub fn init_pid(&self) -> i32 {
        self.inner.pid
    }
}

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

pub(crate) fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut p = [0 as RawFd; 2];
    // SAFETY: pipe2 with a valid out array.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel gave us these fds.
    Ok(unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) })
}

pub(crate) fn set_nonblocking(fd: RawFd) {
    // SAFETY: fcntl on an fd we own.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
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

/// Where a pump streams its pipe's chunks: redacted (also a secret split across chunks),
/// the first `cap` bytes (an exec's output cap; a background process's output is not capped
/// here: its bounded channel holds the process back instead).
pub(crate) struct PumpSink {
    pub tx: mpsc::Sender<Result<ExecEvent>>,
    pub redactor: StreamRedactor,
    pub cap: u64,
}

impl PumpSink {
    pub(crate) fn new(tx: mpsc::Sender<Result<ExecEvent>>, redactor: &Redactor, cap: u64) -> Self {
        PumpSink {
            tx,
            redactor: StreamRedactor::new(redactor.clone()),
            cap,
        }
    }
}

/// Reads a pipe until EOF or until told to stop (then drains what is already there), keeping
/// the first `cap` bytes and streaming to `sink`; past `flood_at` bytes, `flood` is notified.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn pump(
    fd: OwnedFd,
    cap: u64,
    flood_at: u64,
    mut sink: Option<PumpSink>,
    stdout: bool,
    mut stop: watch::Receiver<bool>,
    flood: Arc<Notify>,
) -> OutputBuffer {
    let mut buf = OutputBuffer::new(cap);
    set_nonblocking(fd.as_raw_fd());
    // SAFETY: `fd` is an open pipe owned by the AsyncFd for its whole life.
    let Ok(afd) = (unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }) else {
        return buf;
    };
    let mut chunk = vec![0u8; 16 * 1024];
    let (mut seen, mut streamed) = (0u64, 0u64);
    let mut flooded = false;
    let event = move |b: Vec<u8>| {
        let b = Bytes::from(b);
        if stdout {
            ExecEvent::Stdout(b)
        } else {
            ExecEvent::Stderr(b)
        }
    };
    let raw_read = |fd: RawFd, chunk: &mut [u8]| {
        // SAFETY: read into a buffer we own.
        let n = unsafe { libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len()) };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    };
    macro_rules! take {
        ($n:expr) => {{
            let n = $n;
            seen += n as u64;
            buf.push(&chunk[..n]);
            if let Some(s) = &mut sink {
                let room = s.cap.saturating_sub(streamed);
                let take = usize::try_from(room).unwrap_or(usize::MAX).min(n);
                if take > 0 {
                    streamed += take as u64;
                    let out = s.redactor.push(&chunk[..take]);
                    if !out.is_empty() {
                        // A dropped receiver only means nobody listens any more.
                        let _ = s.tx.send(Ok(event(out))).await;
                    }
                }
            }
            if seen > flood_at && !flooded {
                flooded = true;
                flood.notify_one();
            }
        }};
    }
    loop {
        tokio::select! {
            g = afd.readable() => {
                let Ok(mut g) = g else { break };
                match g.try_io(|f| raw_read(f.as_raw_fd(), &mut chunk)) {
                    Ok(Ok(0)) => break,
                    Ok(Ok(n)) => take!(n),
                    Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Ok(Err(_)) => break,
                    Err(_would_block) => {}
                }
            }
            r = stop.changed() => {
                // The command exited: take what it wrote, not what a background child
                // keeps writing (bounded), then stop.
                let _ = r;
                let mut budget: u64 = 1 << 20;
                while budget > 0 {
                    match raw_read(afd.get_ref().as_raw_fd(), &mut chunk) {
                        Ok(0) => break,
                        Ok(n) => { budget = budget.saturating_sub(n as u64); take!(n) }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
                break;
            }
        }
    }
    if let Some(s) = &mut sink {
        let rest = s.redactor.finish(streamed >= s.cap && seen > streamed);
        if !rest.is_empty() {
            let _ = s.tx.send(Ok(event(rest))).await;
        }
    }
    buf
}

impl Inner {
    pub(crate) fn gone_err(&self) -> Error {
        self.life.gone_error()
    }

    pub(crate) fn alive(&self) -> Result<()> {
        self.life.check_not_gone()?;
        if self.life.lapse(self.born, self.spec.limits.lifetime()) {
            self.terminate(sandbox_core::LIFETIME_REACHED);
            return Err(self.gone_err());
        }
        if self.ctl.is_closed() {
            self.terminate("its init exited");
            return Err(self.gone_err());
        }
        Ok(())
    }

    /// Ends the sandbox for `reason` (unless it ended already), kills everything and removes
    /// every host-side trace. Idempotent, synchronous: the first call tears down, one made
    /// meanwhile waits for it (see [`Lifecycle::release`]).
    pub(crate) fn terminate(&self, reason: &str) {
        self.life.release(reason, || self.teardown());
    }

    fn teardown(&self) {
        self.ports.clear();
        // A frozen sandbox must be thawed or its processes cannot die.
        if let Some(c) = &self.cgroup {
            if c.can_freeze() {
                let _ = c.freeze(false);
            }
        }
        // The next create's init is cloned meanwhile (see `spawn::prefork`).
        crate::spawn::prefork();
        // The kernel then kills the whole pid namespace.
        crate::spawn::reap(self.pid, true);
        if let Some(cg) = &self.cgroup {
            let left = cg.release(Duration::from_secs(2));
            if !left.is_empty() {
                tracing::warn!(sandbox = %self.id, ?left, "cgroup directories could not be removed");
            }
        }
        if let Some(e) = &self.egress {
            e.detach_in_background(&self.id);
        }
        if let Some(f) = &self.state_file {
            let _ = std::fs::remove_file(f);
        }
        let timer = self
            .timer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = timer {
            t.abort();
        }
    }

    /// The workspace as seen by the init, as a directory fd.
    pub(crate) fn workspace_fd(&self) -> Result<OwnedFd> {
        let p = format!("/proc/{}/root/workspace", self.pid);
        let c = std::ffi::CString::new(p.clone())
            .map_err(|e| Error::backend_caused(TIER, "the workspace's /proc path", e))?;

        // SAFETY: open(2) with a NUL-terminated path.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            if self.ctl.is_closed() {
                self.terminate("its init exited");
                return Err(self.gone_err());
            }
            return Err(Error::io(format!("open {p}"), e));
        }
        // SAFETY: we own the new fd.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Whose ids the file API creates files with: the command user's, as commands do (on a
    /// host-directory workspace its idmapped mount stores them as the directory's owner),
    /// except rootless (we are that user already).
    pub(crate) fn owner(&self) -> Option<Owner> {
        if self.ids.rootless {
            None
        } else {
            Some(Owner {
                uid: self.ids.host_uid(self.user),
                gid: self.ids.host_gid(self.group),
            })
        }
    }

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

    /// The overlay's upper layer (rootfs-directory mode), as a directory fd.
    pub(crate) fn upper_fd(&self) -> Result<OwnedFd> {
        let p = format!("/proc/{}/fd/{}", self.pid, proto::UPPER_FD);
        std::fs::File::open(&p)
            .map(OwnedFd::from)
            .map_err(|e| Error::io(format!("open {p}"), e))
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
        let (oom0, pids0) = self
            .cgroup
            .as_ref()
            .map_or((0, 0), |c| (c.oom_kills(), c.pids_max_events()));
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
        let limit = self.blame(exit_code, signal, (oom0, pids0), flooded, timed_out);
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

    /// The limit that stopped a command that ended with `exit_code`/`signal`, given the
    /// cgroup counters when it started (`before`: OOM kills, pids-limit hits) and whether we
    /// stopped it for its output or its time. Only a failure is blamed on a limit: a success
    /// skips the counters.
    pub(crate) fn blame(
        &self,
        exit_code: Option<i32>,
        signal: Option<i32>,
        before: (u64, u64),
        flooded: bool,
        timed_out: bool,
    ) -> Option<LimitKind> {
        let failed = exit_code != Some(0);
        let (oom, pids) = match &self.cgroup {
            Some(c) if failed => (c.oom_kills() > before.0, c.pids_max_events() > before.1),
            _ => (false, false),
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

    pub(crate) async fn ping(&self) -> Result<()> {
        let r = tokio::time::timeout(
            Duration::from_secs(5),
            self.ctl.call(proto::MSG_PING, &[], &[]),
        )
        .await;
        match r {
            Ok(Ok(Reply {
                kind: proto::REP_OK,
                ..
            })) => Ok(()),
            _ => {
                self.terminate("its init stopped answering");
                Err(self.gone_err())
            }
        }
    }
}

#[async_trait]
impl Sandbox for ContainerSandbox {
    fn id(&self) -> &str {
        &self.inner.id
    }

    fn tier(&self) -> Tier {
        TIER
    }

    fn spec(&self) -> &SandboxSpec {
        &self.inner.spec
    }

    fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecResult> {
        self.inner.run(req, None).await
    }

    async fn exec_stream(&self, req: ExecRequest) -> Result<ExecStream> {
        self.inner.alive()?;
        req.validate()?;
        req.refuse_tty(TIER)?;
        let inner = Arc::clone(&self.inner);
        Ok(ExecStream::spawn(move |tx| async move {
            inner.run(req, Some(tx)).await
        }))
    }

    async fn spawn(&self, req: ExecRequest) -> Result<Process> {
        self.inner.spawn(req).await
    }

    async fn processes(&self) -> Result<Vec<ProcessInfo>> {
        self.inner.alive()?;
        Ok(self.inner.procs.list())
    }

    async fn signal(&self, id: ProcessId, signal: Signal) -> Result<()> {
        self.inner.alive()?;
        self.inner.procs.signal(id, signal).await
    }

    async fn publish(
        &self,
        sandbox_port: u16,
        host: std::net::SocketAddr,
    ) -> Result<std::net::SocketAddr> {
        self.inner.alive()?;
        let dialer = Arc::new(crate::process::InitDialer(Arc::clone(&self.inner.ctl)));
        self.inner.ports.publish(sandbox_port, host, dialer).await
    }

    async fn unpublish(&self, host: std::net::SocketAddr) -> Result<()> {
        self.inner.alive()?;
        self.inner.ports.unpublish(host)
    }

    async fn published(&self) -> Result<Vec<PublishedPort>> {
        self.inner.alive()?;
        Ok(self.inner.ports.list())
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        self.inner.alive()?;
        let ws = self.inner.workspace_fd()?;
        let _ids = files::FsIds::switch(self.inner.owner());
        files::write_file(ws.as_fd(), path, data, self.inner.owner())
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.inner.alive()?;
        let ws = self.inner.workspace_fd()?;
        // One read returns at most what the sandbox's disk holds (`limits.disk_bytes`).
        files::read_file(ws.as_fd(), path, self.inner.spec.limits.disk_bytes)
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.inner.alive()?;
        let ws = self.inner.workspace_fd()?;
        files::list(ws.as_fd(), path)
    }

    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.inner.alive()?;
        let ws = self.inner.workspace_fd()?;
        // Freeze the sandbox while packing when we can, for a consistent copy.
        let frozen = self
            .inner
            .cgroup
            .as_ref()
            .is_some_and(|c| c.can_freeze() && c.freeze(true).is_ok());
        // The snapshot holds at most the sandbox's disk: its own workspace and upper layer
        // are tmpfs mounts capped by `limits.disk_bytes`; a host-directory workspace is the
        // caller's, not capped (sparse files count their data only, either way).
        let cap = self.inner.spec.limits.disk_bytes;
        let ws_cap = match self.inner.spec.workspace {
            sandbox_core::Workspace::Empty => cap,
            _ => u64::MAX,
        };
        let tar = files::pack(ws.as_fd(), ws_cap);
        // Rootfs-directory mode: the changes made to the root too (the overlay's upper layer).
        let upper = if crate::own_root(&self.inner.spec) {
            Some(
                self.inner
                    .upper_fd()
                    .and_then(|u| files::pack_upper(u.as_fd(), cap)),
            )
        } else {
            None
        };
        if frozen {
            if let Some(c) = &self.inner.cgroup {
                let _ = c.freeze(false);
            }
        }
        let tar = tar?;
        let mut draft = SnapshotDraft::new(TIER, ENGINE, vec![SnapshotKind::Filesystem], {
            // Pinned to the image's digest: the restore gets this very image, pulled
            // again if it left the cache.
            let mut spec = self.inner.spec.clone();
            if let (Some(r), Some(img)) = (&spec.image, &self.inner.image) {
                spec.image = Some(r.pinned(img.digest()));
            }
            spec
        })
        .artifact("workspace.tar", tar)
        .meta("sandbox_id", self.inner.id.clone());
        if let Some(u) = upper {
            draft = draft.artifact("upper.tar", u?);
        }
        Ok(store.put(draft).await?)
    }

    async fn pause(&self) -> Result<()> {
        self.inner.alive()?;
        match &self.inner.cgroup {
            Some(c) if c.can_freeze() => {
                // Held across the freeze: a concurrent resume waits for it, then thaws.
                if let Some(step) = self.inner.life.begin(Transition::Pause).await? {
                    c.freeze(true)
                        .map_err(|e| Error::io("freeze the sandbox", e))?;
                    step.complete();
                }
                Ok(())
            }
            _ => Err(Error::unsupported(
                TIER,
                "pause/resume (no freezer cgroup on this host)",
            )),
        }
    }

    async fn resume(&self) -> Result<()> {
        self.inner.alive()?;
        match &self.inner.cgroup {
            Some(c) if c.can_freeze() => {
                if let Some(step) = self.inner.life.begin(Transition::Resume).await? {
                    c.freeze(false)
                        .map_err(|e| Error::io("thaw the sandbox", e))?;
                    step.complete();
                }
                Ok(())
            }
            _ => Err(Error::unsupported(
                TIER,
                "pause/resume (no freezer cgroup on this host)",
            )),
        }
    }

    async fn set_network_policy(&self, policy: NetworkPolicy) -> Result<()> {
        self.inner.alive()?;
        sandbox_core::egress::update_policy(
            TIER,
            self.inner.egress.as_deref(),
            &self.inner.id,
            &policy,
        )
    }

    async fn network_events(&self) -> Result<Vec<NetworkEvent>> {
        self.inner.life.check_not_gone()?;
        match &self.inner.egress {
            Some(e) => e.events(&self.inner.id),
            None => Ok(Vec::new()),
        }
    }

    async fn health_check(&self) -> Result<()> {
        self.inner.alive()?;
        self.inner.ping().await
    }

    async fn destroy(&self) -> Result<()> {
        let inner = Arc::clone(&self.inner);
        // No pause or resume overlaps it: one under way finishes first, none starts after.
        let _held = inner.life.hold().await;
        // Detach first and wait for it, so nothing of the link is left when this returns.
        if let Some(e) = &inner.egress {
            e.detach(&inner.id).await;
        }
        // A one-shot process has nothing else to run meanwhile: it tears down right here
        // rather than handing the work to a blocking-pool thread and waiting to be woken.
        if crate::spawn::one_shot() {
            inner.terminate("destroyed");
            return Ok(());
        }
        tokio::task::spawn_blocking(move || inner.terminate("destroyed"))
            .await
            .map_err(|e| Error::backend_caused(TIER, "the destroy task", e))?;

        Ok(())
    }
}

impl Drop for ContainerSandbox {
    fn drop(&mut self) {
        self.inner.terminate("dropped");
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
