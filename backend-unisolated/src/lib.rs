//! # backend-unisolated — NO ISOLATION, for tests only
//!
//! Runs commands as plain host processes in a private temporary directory. It exists so the
//! shared machinery (warm pools, snapshot stores, the facade, the CLI's plumbing) can be tested
//! against a real backend on any Linux machine. It enforces **only** the per-exec wall time, the
//! output caps, the clean environment (nothing of the host's passes unless named), the
//! workspace path rules of the file API, and deny-all networking (each command starts in a new,
//! empty network namespace; as non-root, inside a new user namespace too). It does **not**
//! enforce memory, pids or disk limits, and the code can read any host file the user can. The [`Selector`](sandbox_core::Selector) never
//! ranks it, so `auto` never picks it; callers must register it by hand.

use std::collections::BTreeMap;
use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use sandbox_core::{
    flood_threshold, fsnap, pump_output, Backend, Capabilities, Command, DirEntry, Error,
    ExecEvent, ExecRequest, ExecResult, ExecStream, FloodReader, Language, Lifecycle, LimitKind,
    OutputBuffer, Phase, Redactor, ResolvedSecrets, Result, Sandbox, SandboxSpec, SnapshotDraft,
    SnapshotId, SnapshotKind, SnapshotStore, StreamKind, StreamSink, Tier, TierStatus, Timeline,
    TimelineRecorder, Workspace, WorkspacePath,
};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

const ENGINE: &str = "unisolated 1";
const TIER: Tier = Tier::Unisolated;

/// The test-only, no-isolation backend. See the crate docs before using it.
#[derive(Debug, Clone, Default)]
pub struct UnisolatedBackend {
    _private: (),
}

impl UnisolatedBackend {
    /// A backend that runs host processes **without isolation**.
    pub fn new_without_isolation() -> Self {
        UnisolatedBackend { _private: () }
    }
}

#[async_trait]
impl Backend for UnisolatedBackend {
    fn tier(&self) -> Tier {
        TIER
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::new(TIER);
        c.languages = vec![
            Language::Python,
            Language::Shell,
            Language::Node,
            Language::Javascript,
        ];
        c.argv = true;
        c.snapshots = vec![SnapshotKind::Filesystem];
        c.network = vec![sandbox_core::NetworkMode::DenyAll];
        c.streaming = true;
        c.persistent_state = true;
        // The workspace is a host folder: watched from the host (`sandbox_core::watch`).
        c.watch = true;
        // Host processes: only what the driver itself stops.
        c.limits = vec![LimitKind::WallTime, LimitKind::Output, LimitKind::Lifetime];
        c
    }

    async fn probe(&self) -> TierStatus {
        TierStatus::available(TIER, "host processes with NO isolation (test-only backend)")
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        secrets.refuse_proxied(self.tier())?;
        // Called directly (not through the facade), a backend still refuses what its
        // capabilities do not list.
        let caps = self.capabilities();
        if !caps.supports_language(spec.language) {
            return Err(Error::unsupported(
                TIER,
                format!("the {} language", spec.language),
            ));
        }
        if spec.workspace_alias.is_some() {
            return Err(Error::unsupported(
                TIER,
                "a workspace alias (commands run in the host's own file system)",
            ));
        }
        if !caps.supports_network(&spec.network) {
            return Err(Error::unsupported(
                TIER,
                "network policies other than deny-all (there is no egress enforcer here)",
            ));
        }
        Ok(Box::new(UnisolatedSandbox::create(spec, secrets)?))
    }

    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        let m = store.manifest_for(id, TIER).await?;
        if m.engine != ENGINE {
            return Err(sandbox_core::SnapshotError::Incompatible {
                id: id.clone(),
                reason: format!("written by `{}`, this is `{ENGINE}`", m.engine),
            }
            .into());
        }
        let tar = store.artifact(id, "workspace.tar").await?;
        // The snapshot's files come back in a workspace of the restored sandbox's own.
        let mut spec = m.spec.clone();
        spec.workspace = Workspace::Empty;
        let sb = UnisolatedSandbox::create(&spec, secrets)?;
        fsnap::unpack_into(&tar, &sb.shared.root)?;
        Ok(Box::new(sb))
    }
}

/// A sandbox of [`UnisolatedBackend`]: a temporary directory and the processes run in it.
pub struct UnisolatedSandbox {
    shared: Arc<Shared>,
    // Owns the directory: dropping the sandbox removes it.
    dir: tempfile::TempDir,
    timeline: Timeline,
}

/// What an exec needs, shared with streaming tasks that outlive the borrow.
struct Shared {
    id: String,
    spec: SandboxSpec,
    root: PathBuf,
    env: BTreeMap<String, String>,
    redactor: Redactor,
    born: Instant,
    life: Lifecycle,
    running: Mutex<HashSet<i32>>,
    /// File watches (ended by `destroy`).
    watches: sandbox_core::watch::Watches,
}

impl std::fmt::Debug for UnisolatedSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnisolatedSandbox")
            .field("id", &self.shared.id)
            .finish()
    }
}

impl UnisolatedSandbox {
    fn create(spec: &SandboxSpec, secrets: ResolvedSecrets) -> Result<Self> {
        spec.validate_on_host()?;
        if spec.rootfs.is_some() || spec.image.is_some() {
            return Err(Error::unsupported(
                TIER,
                "a rootfs directory or an image (host processes see the host's /)",
            ));
        }
        let host_dir = match &spec.workspace {
            Workspace::HostDir {
                read_only: true, ..
            } => {
                return Err(Error::unsupported(
                    TIER,
                    "a read-only host workspace (host processes can write it)",
                ))
            }
            Workspace::HostDir { path, .. } => Some(path.clone()),
            _ => None,
        };
        let mut t = TimelineRecorder::start();
        let id = uuid::Uuid::new_v4().simple().to_string();
        t.mark(Phase::Allocation);
        let dir = tempfile::Builder::new()
            .prefix("agent-sandbox-unisolated-")
            .tempdir()
            .map_err(|e| Error::io("create workspace directory", e))?;
        t.mark(Phase::Filesystem);
        let mut env = spec.base_env();
        for (k, v) in secrets.env() {
            env.insert(k.to_string(), v.to_string());
        }
        env.entry("PATH".into())
            .or_insert_with(|| "/usr/local/bin:/usr/bin:/bin".into());
        env.insert("HOME".into(), dir.path().display().to_string());
        env.entry("LANG".into()).or_insert_with(|| "C.UTF-8".into());
        t.mark(Phase::Runtime);
        let shared = Arc::new(Shared {
            id: id.clone(),
            spec: spec.clone(),
            // A host folder as the workspace is used in place (and never emptied).
            root: host_dir.unwrap_or_else(|| dir.path().to_path_buf()),
            env,
            redactor: secrets.redactor(),
            born: Instant::now(),
            life: Lifecycle::new(id.clone()),
            running: Mutex::new(HashSet::new()),
            watches: Default::default(),
        });
        Ok(UnisolatedSandbox {
            shared,
            dir,
            timeline: t.finish(),
        })
    }
}

impl Shared {
    fn alive(&self) -> Result<()> {
        if self.life.lapse(self.born, self.spec.limits.lifetime()) {
            self.kill_all();
        }
        // No pause in this tier: running and existing are the same.
        self.life.check_running()
    }

    fn host_path(&self, path: &str) -> Result<PathBuf> {
        WorkspacePath::parse(path)?.resolve_under(&self.root)
    }

    fn argv(&self, cmd: &Command) -> Result<Vec<String>> {
        Ok(match cmd {
            Command::Argv(a) => a.clone(),
            Command::Code(code) => {
                let prog: &[&str] = match self.spec.language {
                    Language::Python => &["python3", "-c"],
                    Language::Shell => &["sh", "-c"],
                    Language::Node | Language::Javascript => &["node", "-e"],
                    other => {
                        return Err(Error::unsupported(TIER, format!("code strings in {other}")))
                    }
                };
                prog.iter()
                    .map(|s| s.to_string())
                    .chain([code.clone()])
                    .collect()
            }
            other => return Err(Error::unsupported(TIER, format!("the command {other:?}"))),
        })
    }

    fn sink(
        &self,
        tx: &Option<mpsc::Sender<Result<ExecEvent>>>,
        kind: StreamKind,
    ) -> Option<StreamSink> {
        tx.as_ref()
            .map(|tx| StreamSink::new(tx.clone(), &self.redactor, kind))
    }

    fn kill_all(&self) {
        // Also after a panic elsewhere: a poisoned set still names the groups to kill.
        let pgids: Vec<i32> = self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .copied()
            .collect();
        for pg in pgids {
            let _ = killpg(Pid::from_raw(pg), Signal::SIGKILL);
        }
    }

    async fn run(
        &self,
        req: ExecRequest,
        sink: Option<mpsc::Sender<Result<ExecEvent>>>,
    ) -> Result<ExecResult> {
        self.alive()?;
        req.validate()?;
        req.refuse_tty(TIER)?;
        let mut t = TimelineRecorder::start();
        let argv = self.argv(&req.command)?;
        let cwd = match &req.cwd {
            Some(c) => self.host_path(c)?,
            None => self.root.clone(),
        };
        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env_clear()
            .envs(&self.env)
            .envs(&req.env)
            .current_dir(&cwd)
            .stdin(if req.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let as_root = nix::unistd::geteuid().is_root();
        // SAFETY: the closure runs between fork and exec and only makes system calls
        // (`rt_sigaction`, `rt_sigprocmask`, `unshare`), which are async-signal-safe; it
        // touches no allocator or lock.
        unsafe {
            cmd.pre_exec(move || {
                // Default dispositions and an empty mask, whatever the caller had (a
                // background job ignores SIGINT and SIGQUIT), as every tier does.
                sandbox_core::process::reset_signals();
                let mut flags = nix::sched::CloneFlags::CLONE_NEWNET;
                if !as_root {
                    flags |= nix::sched::CloneFlags::CLONE_NEWUSER;
                }
                nix::sched::unshare(flags).map_err(std::io::Error::from)
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let msg = format!("{}: command not found\n", argv[0]);
                let mut r = ExecResult::new(Some(127), vec![], msg.into_bytes());
                r.timeline = t.finish();
                return Ok(r);
            }
            // Not executable (no permission, not a program): 126, as a shell reports it.
            Err(e)
                if e.kind() == std::io::ErrorKind::PermissionDenied
                    || e.raw_os_error() == Some(libc_enoexec()) =>
            {
                let msg = format!("{}: {e}\n", argv[0]);
                let mut r = ExecResult::new(Some(126), vec![], msg.into_bytes());
                r.timeline = t.finish();
                return Ok(r);
            }
            Err(e) => return Err(Error::io(format!("spawn {}", argv[0]), e)),
        };
        let pgid = child.id().and_then(|p| i32::try_from(p).ok());
        if let Some(pg) = pgid {
            // Recorded also after a panic elsewhere: `kill_all` must find it.
            self.running
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(pg);
        }
        t.mark(Phase::Allocation);
        if let (Some(data), Some(mut stdin)) = (req.stdin.clone(), child.stdin.take()) {
            tokio::spawn(async move {
                let _ = stdin.write_all(&data).await;
            });
        }
        let cap = self.spec.limits.output_bytes;
        // A command writing far past the cap is stopped (as the other tiers do), not only
        // truncated: the `output` limit.
        let flood = Arc::new(tokio::sync::Notify::new());
        let flood_at = flood_threshold(cap);
        let out = tokio::spawn(pump_output(
            child
                .stdout
                .take()
                .map(|r| FloodReader::new(r, flood_at, Arc::clone(&flood))),
            cap,
            self.sink(&sink, StreamKind::Stdout),
        ));
        let err = tokio::spawn(pump_output(
            child
                .stderr
                .take()
                .map(|r| FloodReader::new(r, flood_at, Arc::clone(&flood))),
            cap,
            self.sink(&sink, StreamKind::Stderr),
        ));
        let timeout = req.effective_timeout(self.spec.limits.wall_time());
        let stopped = tokio::select! {
            s = tokio::time::timeout(timeout, child.wait()) => match s {
                Ok(s) => Ok(s.map_err(|e| Error::io("wait for command", e))?),
                Err(_) => Err(LimitKind::WallTime),
            },
            () = flood.notified() => Err(LimitKind::Output),
        };
        let (status, limit) = match stopped {
            Ok(s) => (s, None),
            Err(kind) => {
                if let Some(pg) = pgid {
                    let _ = killpg(Pid::from_raw(pg), Signal::SIGKILL);
                }
                (
                    child
                        .wait()
                        .await
                        .map_err(|e| Error::io("reap command", e))?,
                    Some(kind),
                )
            }
        };
        // Anything the command left behind in its group dies with it.
        if let Some(pg) = pgid {
            let _ = killpg(Pid::from_raw(pg), Signal::SIGKILL);
            self.running
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&pg);
        }
        let join = |r: std::result::Result<OutputBuffer, tokio::task::JoinError>| {
            r.unwrap_or_else(|_| OutputBuffer::new(0))
        };
        let (out, err) = (join(out.await), join(err.await));
        t.mark(Phase::Command);
        use std::os::unix::process::ExitStatusExt;
        let exit_code = status.code().or_else(|| status.signal().map(|s| 128 + s));
        Ok(ExecResult::from_output(exit_code, out, err, &self.redactor)
            .with_limit(limit)
            .with_timeline(t.finish()))
    }
}

#[async_trait]
impl Sandbox for UnisolatedSandbox {
    fn id(&self) -> &str {
        &self.shared.id
    }

    fn tier(&self) -> Tier {
        TIER
    }

    fn spec(&self) -> &SandboxSpec {
        &self.shared.spec
    }

    fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecResult> {
        self.shared.run(req, None).await
    }

    async fn exec_stream(&self, req: ExecRequest) -> Result<ExecStream> {
        self.shared.alive()?;
        let shared = Arc::clone(&self.shared);
        Ok(ExecStream::spawn(move |tx| async move {
            shared.run(req, Some(tx)).await
        }))
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        let sh = &self.shared;
        sh.alive()?;
        let p = sh.host_path(path)?;
        if let Some(parent) = p.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| Error::io_path("create", parent, e))?;
        }
        // Re-check after creating parents: they may not have existed at the first check.
        let p = sh.host_path(path)?;
        tokio::fs::write(&p, data)
            .await
            .map_err(|e| Error::io_path("write", &p, e))
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.shared.alive()?;
        let p = self.shared.host_path(path)?;
        match tokio::fs::read(&p).await {
            Ok(d) => Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(Error::NotFound { path: path.into() })
            }
            Err(e) => Err(Error::io_path("read", &p, e)),
        }
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.shared.alive()?;
        sandbox_core::path::list_host_dir(&self.shared.host_path(path)?, path)
    }

    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.shared.alive()?;
        let tar = fsnap::pack_dir(&self.shared.root)?;
        let draft = SnapshotDraft::new(
            TIER,
            ENGINE,
            vec![SnapshotKind::Filesystem],
            self.shared.spec.clone(),
        )
        .artifact("workspace.tar", tar)
        .meta("sandbox_id", self.shared.id.clone());
        Ok(store.put(draft).await?)
    }

    async fn network_events(&self) -> Result<Vec<sandbox_core::NetworkEvent>> {
        // Deny-all only: nothing is ever asked. Gone answers as every other call.
        self.shared.life.check_not_gone()?;
        Ok(Vec::new())
    }

    fn redactor(&self) -> sandbox_core::secrets::Redactor {
        self.shared.redactor.clone()
    }

    async fn health_check(&self) -> Result<()> {
        self.shared.alive()?;
        if self.shared.root.is_dir() {
            Ok(())
        } else {
            Err(Error::SandboxGone {
                id: self.shared.id.clone(),
                reason: "workspace vanished".into(),
            })
        }
    }

    async fn watch(&self, path: &str, recursive: bool) -> Result<sandbox_core::Watch> {
        self.shared.alive()?;
        let ws = sandbox_core::beneath::open_dir(&self.shared.root)?;
        self.shared
            .watches
            .watch_blocking(ws, path, recursive)
            .await
    }

    async fn destroy(&self) -> Result<()> {
        // Idempotent: the first destroy (also one after the lifetime ran out) frees it, a
        // later one finds it released.
        let _held = self.shared.life.hold().await;
        self.shared.life.release("destroyed", || {
            self.shared.watches.close_all();
            self.shared.kill_all();
            // Empty the workspace now; the directory itself goes when the sandbox is dropped.
            if let Ok(rd) = std::fs::read_dir(self.dir.path()) {
                for e in rd.flatten() {
                    let p = e.path();
                    let _ = if p.is_dir() && !p.is_symlink() {
                        std::fs::remove_dir_all(&p)
                    } else {
                        std::fs::remove_file(&p)
                    };
                }
            }
        });
        Ok(())
    }
}

impl Drop for UnisolatedSandbox {
    fn drop(&mut self) {
        self.shared.kill_all();
        // `TempDir` removes the directory.
    }
}

/// `ENOEXEC` (not an executable format).
fn libc_enoexec() -> i32 {
    nix::errno::Errno::ENOEXEC as i32
}
