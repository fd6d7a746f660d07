//! One gVisor sandbox: its state directory, bundle, workspace and runsc container.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sandbox_core::{
    fsnap, pump_output, Command, DirEntry, EgressEnforcer, EgressPlan, Error, ExecEvent,
    ExecRequest, ExecResult, ExecStream, Language, Lifecycle, LimitKind, NetworkEvent,
    NetworkPolicy, Phase, Redactor, ResolvedSecrets, Result, Sandbox, SandboxSpec, SnapshotDraft,
    SnapshotError, SnapshotId, SnapshotKind, SnapshotStore, StreamKind, StreamSink, Tier, Timeline,
    TimelineRecorder, Transition, Workspace, WorkspacePath,
};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, RwLock};

use crate::bundle::{self, Identity};
use crate::runsc::{run_checked_async, run_detached, Runsc};
use crate::{reaper, stale};
use crate::{GvisorBackend, TIER};

/// The default identity of the workload when the sandbox owns its workspace.
const SANDBOX_ID: Identity = Identity {
    uid: 1000,
    gid: 1000,
};

/// A running gVisor sandbox.
pub struct GvisorSandbox {
    inner: Arc<Inner>,
    timeline: Timeline,
}

struct Inner {
    id: String,
    spec: SandboxSpec,
    runsc: Runsc,
    engine: String,
    dir: PathBuf,
    bundle: PathBuf,
    workspace: PathBuf,
    /// We mount a tmpfs on `workspace` (an `Empty` spec: `<dir>/workspace`).
    workspace_tmpfs: bool,
    /// The host tmpfs whose `tmp/` and `shm/` are the sandbox's `/tmp` and `/dev/shm`
    /// (see [`bundle::tmpfs_caps`]; `<dir>/scratch`); mounted by `start`, unmounted with the
    /// others by `cleanup` ([`stale::unmount_all`]).
    scratch: PathBuf,
    who: Identity,
    env: BTreeMap<String, String>,
    redactor: Redactor,
    /// runsc processes (sandbox, gofer) re-parented to us, to reap on delete.
    pids: Mutex<Vec<i32>>,
    /// The sandbox's cgroup paths (v1 memory and pids hierarchies), to read OOM kills and
    /// pids-limit hits from.
    cgroup: Mutex<(Option<String>, Option<String>)>,
    /// Live, paused, or gone with the reason (destroyed, lifetime, killed by a limit...).
    life: Lifecycle,
    /// Set by the first teardown (container deleted, state removed): a sandbox can be gone
    /// (it died on its own) before it is torn down.
    torn_down: AtomicBool,
    born: Instant,
    seq: AtomicU64,
    /// Execs hold it shared; a snapshot holds it exclusively until the sandbox is resumed.
    lifecycle: Arc<RwLock<()>>,
    /// The egress enforcer and this sandbox's plan (policies other than deny-all).
    egress: Option<(Arc<dyn EgressEnforcer>, EgressPlan)>,
    /// Whether commands start through the sandbox's control socket ([`crate::urpc`]);
    /// cleared for good the first time that is not possible (then `runsc exec`).
    direct: AtomicBool,
    /// Our lock on the sandbox directory (see [`stale`]).
    _owner: stale::Owner,
    /// A snapshot's background resume is running; `resumed` is notified when it ends.
    resuming: AtomicBool,
    resumed: tokio::sync::Notify,
}

impl std::fmt::Debug for GvisorSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GvisorSandbox")
            .field("id", &self.inner.id)
            .finish()
    }
}

fn io(op: &str, p: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let what = format!("{op} {}", p.display());
    move |e| {
        if e.raw_os_error() == Some(libc::ENOSPC) {
            Error::ResourceExhausted {
                what: format!("disk space ({what})"),
            }
        } else {
            Error::io(what, e)
        }
    }
}

impl GvisorSandbox {
    pub(crate) async fn create(
        backend: &GvisorBackend,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
        restore: Option<Restore>,
    ) -> Result<Self> {
        spec.validate()?;
        let enforcer = sandbox_core::egress::enforcer_for(
            TIER,
            backend.config.egress.as_ref(),
            &spec.network,
        )?;
        if spec.language == Language::Wasm {
            return Err(Error::unsupported(
                TIER,
                "WebAssembly modules (use the wasm tier)",
            ));
        }
        let mut t = TimelineRecorder::start();
        let b = backend.clone();
        let r = tokio::task::spawn_blocking(move || b.resolve())
            .await
            .map_err(|e| Error::backend(TIER, format!("probe task failed: {e}")))??;
        // What crashed processes left in this state directory, and a watchdog for what
        // this one might leave (once per process).
        stale::guard_state_dir(&r.state_dir, &r.info.path);
        let id = format!("as-{}", &uuid::Uuid::new_v4().simple().to_string()[..20]);
        let dir = r.state_dir.join(&id);
        let bundle_dir = dir.join("bundle");
        let runsc_root = dir.join("runsc");
        let scratch_dir = dir.join("scratch");
        std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        // Held until the sandbox is gone: if this process dies first, a later sweep knows
        // the directory (and the runsc processes it names) have no owner left.
        let owner = stale::Owner::claim(&dir).map_err(io("lock", &dir.join("owner")))?;
        std::fs::create_dir_all(&bundle_dir).map_err(io("create", &bundle_dir))?;
        std::fs::create_dir_all(&runsc_root).map_err(io("create", &runsc_root))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))
            .map_err(io("chmod", &dir))?;
        let (workspace, who, tmpfs) = match &spec.workspace {
            Workspace::Empty => {
                let ws = dir.join("workspace");
                std::fs::create_dir_all(&ws).map_err(io("create", &ws))?;
                (ws, restore.as_ref().map_or(SANDBOX_ID, |r| r.who), true)
            }
            Workspace::HostDir { path, .. } => {
                use std::os::unix::fs::MetadataExt;
                let md = std::fs::metadata(path).map_err(io("stat", path))?;
                (
                    path.clone(),
                    Identity {
                        uid: md.uid(),
                        gid: md.gid(),
                    },
                    false,
                )
            }
            other => return Err(Error::unsupported(TIER, format!("the workspace {other:?}"))),
        };
        let mut env = spec.base_env();
        for (k, v) in secrets.env() {
            env.insert(k.to_string(), v.to_string());
        }
        env.entry("PATH".into())
            .or_insert_with(|| "/usr/local/bin:/usr/bin:/bin".into());
        env.entry("HOME".into())
            .or_insert_with(|| "/workspace".into());
        env.entry("LANG".into()).or_insert_with(|| "C.UTF-8".into());
        let netns = match enforcer {
            Some(_) => Some(Runsc::new_netns()?),
            None => None,
        };
        let egress = match enforcer {
            Some(e) => {
                let plan = e.prepare(&id, &spec.network)?;
                for (k, v) in &plan.env {
                    env.insert(k.clone(), v.clone());
                }
                Some((e, plan))
            }
            None => None,
        };
        let inner = Arc::new(Inner {
            id: id.clone(),
            spec: spec.clone(),
            runsc: Runsc {
                bin: r.info.path.clone(),
                root: runsc_root,
                platform: r.platform,
                overlay_root: spec.rootfs.is_some(),
                netns,
            },
            engine: r.info.version.clone(),
            dir,
            bundle: bundle_dir,
            workspace,
            workspace_tmpfs: tmpfs,
            scratch: scratch_dir,
            who,
            env,
            redactor: secrets.redactor(),
            pids: Mutex::new(Vec::new()),
            cgroup: Mutex::new((None, None)),
            life: Lifecycle::new(id.clone()),
            torn_down: AtomicBool::new(false),
            born: Instant::now(),
            seq: AtomicU64::new(0),
            direct: AtomicBool::new(!backend.config.runsc_exec),
            lifecycle: Arc::new(RwLock::new(())),
            egress,
            _owner: owner,
            resuming: AtomicBool::new(false),
            resumed: tokio::sync::Notify::new(),
        });
        t.mark(Phase::Allocation);
        // From here on, a failure tears down whatever was made.
        match inner.start(restore, &mut t).await {
            Ok(()) => Ok(GvisorSandbox {
                inner,
                timeline: t.finish(),
            }),
            Err(e) => {
                if let Some((enf, _)) = &inner.egress {
                    enf.detach(&inner.id).await;
                }
                let i = Arc::clone(&inner);
                let _ = tokio::task::spawn_blocking(move || i.teardown()).await;
                Err(e)
            }
        }
    }

    pub(crate) async fn restore(
        backend: &GvisorBackend,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Self> {
        let m = store.manifest_for(id, TIER).await?;
        let b = backend.clone();
        let r = tokio::task::spawn_blocking(move || b.resolve())
            .await
            .map_err(|e| Error::backend(TIER, format!("probe task failed: {e}")))??;
        if m.engine != r.info.version {
            return Err(SnapshotError::Incompatible {
                id: id.clone(),
                reason: format!(
                    "taken with `{}`, this host has `{}`",
                    m.engine, r.info.version
                ),
            }
            .into());
        }
        let who = Identity {
            uid: meta_u32(&m.metadata, "uid").unwrap_or(SANDBOX_ID.uid),
            gid: meta_u32(&m.metadata, "gid").unwrap_or(SANDBOX_ID.gid),
        };
        // Fetch (and verify) everything before anything is started.
        let image = store.artifact(id, "checkpoint.tar").await?;
        let workspace = match m.spec.workspace {
            Workspace::Empty => Some(store.artifact(id, "workspace.tar").await?),
            _ => None,
        };
        let scratch = match m.artifacts.contains_key(SCRATCH_TAR) {
            true => Some(store.artifact(id, SCRATCH_TAR).await?),
            false => None,
        };
        Self::create(
            backend,
            &m.spec,
            secrets,
            Some(Restore {
                image: image.to_vec(),
                workspace,
                scratch,
                who,
            }),
        )
        .await
    }
}

/// Mounts a tmpfs (`nosuid`, `nodev`) named `source` on `target`, capped by `cap`, with the
/// extra mount options `opts`.
fn mount_tmpfs(source: &str, target: &Path, cap: sandbox_core::TmpfsCap, opts: &str) -> Result<()> {
    use nix::mount::{mount, MsFlags};
    let data = format!("size={},nr_inodes={},{opts}", cap.bytes, cap.inodes);
    mount(
        Some(source),
        target,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(data.as_str()),
    )
    .map_err(|e| Error::io_path("mount a tmpfs on", target, e.into()))
}

/// The snapshot artifact holding `/tmp` and `/dev/shm` (the scratch tmpfs).
const SCRATCH_TAR: &str = "scratch.tar";

/// What a restore brings into `create`.
pub(crate) struct Restore {
    image: Vec<u8>,
    workspace: Option<bytes::Bytes>,
    /// `/tmp` and `/dev/shm` (absent from snapshots older than host-backed scratch mounts).
    scratch: Option<bytes::Bytes>,
    who: Identity,
}

fn meta_u32(m: &BTreeMap<String, String>, k: &str) -> Option<u32> {
    m.get(k)?.parse().ok()
}

impl Inner {
    async fn start(&self, restore: Option<Restore>, t: &mut TimelineRecorder) -> Result<()> {
        if self.workspace_tmpfs {
            self.mount_workspace()?;
        }
        self.mount_scratch()?;
        let who = self.who;
        if self.spec.rootfs.is_none() {
            bundle::write_rootfs(&self.bundle, who)?;
        }
        let cgroup = stale::cgroup_name(&self.id);
        let resolv = match &self.egress {
            Some((_, plan)) => {
                let p = self.dir.join("resolv.conf");
                std::fs::write(&p, &plan.resolv_conf).map_err(io("write", &p))?;
                Some(p)
            }
            None => None,
        };
        // A caller's rootfs lacking the scratch mount points is seen through an overlay
        // that has them (see `rootfs_view`).
        let view = self.rootfs_view();
        let spec = match &view {
            Some(root) => std::borrow::Cow::Owned({
                let mut spec = self.spec.clone();
                spec.rootfs = Some(root.clone());
                spec
            }),
            None => std::borrow::Cow::Borrowed(&self.spec),
        };
        let cfg = bundle::config(
            &spec,
            who,
            &self.workspace,
            self.read_only(),
            Some(&self.scratch),
            &cgroup,
            resolv.as_deref(),
        )?;
        bundle::save(&cfg, &self.bundle)?;
        let image_dir = self.dir.join("restore-image");
        if let Some(r) = &restore {
            if let Some(ws) = &r.workspace {
                fsnap::unpack_into(ws, &self.workspace)?;
            }
            if let Some(sc) = &r.scratch {
                fsnap::unpack_into(sc, &self.scratch)?;
            }
            std::fs::create_dir_all(&image_dir).map_err(io("create", &image_dir))?;
            fsnap::unpack_into(&r.image, &image_dir)?;
        }
        t.mark(Phase::Filesystem);
        let mut cmd = self.runsc.async_command();
        match &restore {
            None => cmd
                .args(["run", "--detach", "--bundle"])
                .arg(&self.bundle)
                .arg(&self.id),
            Some(_) => cmd
                .args(["restore", "--detach", "--bundle"])
                .arg(&self.bundle)
                .arg("--image-path")
                .arg(&image_dir)
                .arg(&self.id),
        };
        let what = if restore.is_some() { "restore" } else { "run" };
        run_detached(cmd, &self.dir.join("runsc.log"), what).await?;
        let boot = self.track_processes().await;
        self.attach_network(boot).await?;
        if self.egress.is_some() {
            t.mark(Phase::Network);
        }
        if restore.is_some() {
            let _ = std::fs::remove_dir_all(&image_dir);
            t.mark(Phase::Restore);
        } else {
            t.mark(Phase::Runtime);
        }
        Ok(())
    }

    fn read_only(&self) -> bool {
        matches!(
            self.spec.workspace,
            Workspace::HostDir {
                read_only: true,
                ..
            }
        )
    }

    /// Whether our tmpfs workspace, or the scratch tmpfs behind `/tmp` and `/dev/shm`, is out
    /// of space or inodes.
    fn disk_full(&self) -> bool {
        let full = |p: &Path| {
            nix::sys::statvfs::statvfs(p)
                .is_ok_and(|s| s.blocks_available() == 0 || s.files_available() == 0)
        };
        (self.workspace_tmpfs && full(&self.workspace)) || full(&self.scratch)
    }

    /// For a caller's rootfs without a `tmp` or `dev/shm` directory, or with glibc's loader
    /// (whose programs need the `statx` shim, see [`bundle::STATX_SHIM_PATH`]): a host
    /// overlay of it (`view/root` of the state directory; upper and work directories beside
    /// it) with those directories made and the shim added to its `/etc/ld.so.preload`, so
    /// `/tmp` and `/dev/shm` can be bind mounts of the scratch tmpfs (runsc would create a
    /// bind mount's point in the directory itself, which is never written). runsc's
    /// in-memory overlay still takes every write of the sandbox. `None` (and gVisor's own
    /// tmpfs there, no shim) when no view is needed or it cannot be made.
    fn rootfs_view(&self) -> Option<PathBuf> {
        let lower = self.spec.rootfs.as_ref()?;
        let points = bundle::SCRATCH_MOUNTS.map(|(dst, _)| dst.trim_start_matches('/'));
        let shim = bundle::statx_shim().filter(|_| bundle::needs_statx_shim(lower));
        if points.iter().all(|d| lower.join(d).is_dir()) && shim.is_none() {
            return None;
        }
        let lower_s = lower.to_str()?;
        let view = self.dir.join("view");
        let (upper, work, root) = (view.join("upper"), view.join("work"), view.join("root"));
        let made = (|| -> std::io::Result<()> {
            for d in [&upper, &work, &root] {
                std::fs::create_dir_all(d)?;
            }
            // `lowerdir` cannot express these characters; the state directory's path is ours.
            if lower_s.contains([',', ':', '\\']) {
                return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            }
            let data = format!(
                "lowerdir={lower_s},upperdir={},workdir={}",
                upper.display(),
                work.display()
            );
            nix::mount::mount(
                Some("agent-sandbox-rootfs"),
                &root,
                Some("overlay"),
                nix::mount::MsFlags::empty(),
                Some(data.as_str()),
            )?;
            for d in points {
                let p = root.join(d);
                if !p.is_dir() {
                    std::fs::create_dir_all(&p)?;
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o1777))?;
                }
            }
            if let Some(shim) = shim {
                // Without it `ls -l` and `stat` fail as they always did here; the view
                // itself is still good.
                if let Err(e) = bundle::add_statx_shim(&root, shim) {
                    tracing::warn!(sandbox = %self.id, error = %e, "no statx shim in the rootfs view");
                }
            }
            Ok(())
        })();
        match made {
            Ok(()) => Some(root),
            Err(e) => {
                tracing::warn!(sandbox = %self.id, error = %e, "no overlay view of the rootfs: /tmp or /dev/shm stays gVisor's tmpfs (no file-count cap), no statx shim");
                let _ = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH);
                None
            }
        }
    }

    /// Mounts the scratch tmpfs and makes its `tmp/` and `shm/` (sticky, world-writable).
    fn mount_scratch(&self) -> Result<()> {
        let cap = crate::bundle::tmpfs_caps(&self.spec).scratch;
        std::fs::create_dir_all(&self.scratch).map_err(io("create", &self.scratch))?;
        mount_tmpfs("agent-sandbox-scratch", &self.scratch, cap, "mode=0755")?;
        for (_, sub) in bundle::SCRATCH_MOUNTS {
            let d = self.scratch.join(sub);
            std::fs::create_dir(&d).map_err(io("create", &d))?;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777))
                .map_err(io("chmod", &d))?;
        }
        Ok(())
    }

    fn mount_workspace(&self) -> Result<()> {
        let cap = crate::bundle::tmpfs_caps(&self.spec).disk;
        let owner = format!("mode=0755,uid={},gid={}", self.who.uid, self.who.gid);
        mount_tmpfs("agent-sandbox-ws", &self.workspace, cap, &owner)
    }

    /// Connects the sandbox's namespace (that of its `boot` process) to the egress enforcer.
    async fn attach_network(&self, boot: Option<i32>) -> Result<()> {
        let Some((e, plan)) = &self.egress else {
            return Ok(());
        };
        let Some(pid) = boot else {
            return Err(Error::backend(
                TIER,
                "the gVisor sandbox process was not found: cannot attach its network",
            ));
        };
        e.attach(plan, pid).await
    }

    /// Finds the runsc processes of this sandbox; returns the sandbox (`boot`) process.
    async fn track_processes(&self) -> Option<i32> {
        let needle = format!("--root={}", self.runsc.root.display());
        let pids = reaper::children_matching(&needle);
        // The sandbox process (`runsc-sandbox ... boot`) carries the container's cgroups.
        let boot = pids.iter().copied().find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| c.split(|b| *b == 0).any(|a| a == b"boot"))
                .unwrap_or(false)
        });
        let cg = match boot {
            Some(pid) => (
                cgroup_of(i64::from(pid), "memory"),
                cgroup_of(i64::from(pid), "pids"),
            ),
            None => (None, None),
        };
        if let Ok(mut p) = self.pids.lock() {
            *p = pids;
        }
        if let Ok(mut m) = self.cgroup.lock() {
            *m = cg;
        }
        boot
    }

    /// `(oom kills, pids-limit hits)` of the sandbox's cgroups, where readable.
    fn limit_counters(&self) -> (Option<u64>, Option<u64>) {
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

    fn alive(&self) -> Result<()> {
        if self.born.elapsed() > self.spec.limits.lifetime()
            && self.life.end("lifetime limit reached")
        {
            self.teardown();
        }
        self.life.check_not_gone()
    }

    fn argv(&self, cmd: &Command) -> Result<(Vec<String>, BTreeMap<String, String>)> {
        let mut extra = BTreeMap::new();
        let argv = match cmd {
            Command::Argv(a) => a.clone(),
            Command::Code(code) => match self.spec.language {
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

    async fn run(
        &self,
        req: ExecRequest,
        sink: Option<mpsc::Sender<Result<ExecEvent>>>,
    ) -> Result<ExecResult> {
        self.alive()?;
        req.validate()?;
        let _shared = self.lifecycle.read().await;
        self.alive()?;
        self.life.check_running()?;
        let mut t = TimelineRecorder::start();
        let (argv, extra) = self.argv(&req.command)?;
        let cwd = match &req.cwd {
            None => "/workspace".to_string(),
            Some(c) if c.starts_with('/') => c.clone(),
            Some(c) => WorkspacePath::parse(c)?.in_sandbox(),
        };
        let mut env = self.env.clone();
        env.extend(extra);
        env.extend(req.env.clone());
        let env: Vec<String> = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        if self.direct.load(Ordering::SeqCst) {
            match self
                .run_direct(&argv, &env, &cwd, &req, &sink, &mut t)
                .await?
            {
                Some(r) => return Ok(r),
                None => self.direct.store(false, Ordering::SeqCst),
            }
        }
        let process = bundle::process(argv, env, &cwd, self.who, &self.spec)?;
        let n = self.seq.fetch_add(1, Ordering::SeqCst);
        let pfile = self.dir.join(format!("exec-{n}.json"));
        let pidfile = self.dir.join(format!("exec-{n}.pid"));
        write_private(
            &pfile,
            &serde_json::to_vec(&process).map_err(|e| Error::backend(TIER, e.to_string()))?,
        )?;
        let before = self.limit_counters();
        let mut cmd = self.runsc.async_command();
        cmd.arg("exec")
            .arg("--process")
            .arg(&pfile)
            .arg("--internal-pid-file")
            .arg(&pidfile)
            .arg(&self.id)
            .stdin(if req.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let spawned = cmd.spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_file(&pfile);
                return Err(Error::io("spawn runsc exec", e));
            }
        };
        t.mark(Phase::Allocation);
        let stdin = child.stdin.take();
        let (out, err) = self.start_io(
            req.stdin.clone().zip(stdin),
            child.stdout.take(),
            child.stderr.take(),
            &sink,
        );
        let timeout = req.effective_timeout(self.spec.limits.wall_time());
        let (status, limit) = match tokio::time::timeout(timeout, child.wait()).await {
            Ok(s) => (s.map_err(|e| Error::io("wait for runsc exec", e))?, None),
            Err(_) => {
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
                (s, Some(LimitKind::WallTime))
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
            // as the control-socket path (and a shell) reports it.
            let text = String::from_utf8_lossy(err.peek());
            if text.contains("failed to load") && text.contains("no such file or directory") {
                exit_code = Some(127);
            }
        }
        Ok(self.conclude(exit_code, limit, before, out, err, t).await)
    }

    /// The result of an exec whose command has ended: a non-zero end is checked against the
    /// sandbox's cgroup counters (`before`: taken when it started) and its liveness.
    async fn conclude(
        &self,
        mut exit_code: Option<i32>,
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
            let hit = if grew(before.0, after.0) {
                Some((LimitKind::Memory, "killed by its memory limit"))
            } else if grew(before.1, after.1) && !self.container_running().await {
                Some((LimitKind::Pids, "ended by its process limit"))
            } else {
                None
            };
            if hit.is_none() && exit_code == Some(128) && !self.container_running().await {
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
    /// when there is one), each on a task of its own.
    #[allow(clippy::type_complexity)]
    fn start_io<W, O, E>(
        &self,
        stdin: Option<(Vec<u8>, W)>,
        out: Option<O>,
        err: Option<E>,
        sink: &Option<mpsc::Sender<Result<ExecEvent>>>,
    ) -> (
        tokio::task::JoinHandle<sandbox_core::OutputBuffer>,
        tokio::task::JoinHandle<sandbox_core::OutputBuffer>,
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
        (
            tokio::spawn(pump_output(out, cap, mk(StreamKind::Stdout))),
            tokio::spawn(pump_output(err, cap, mk(StreamKind::Stderr))),
        )
    }

    /// Runs a command through the sandbox's control socket ([`crate::urpc`]): what
    /// `runsc exec` does, without a runsc process. `Ok(None)`: that interface is not
    /// available (nothing was started); the caller uses `runsc exec`.
    async fn run_direct(
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
        let (id, who, ns) = (self.id.clone(), self.who, self.runsc.netns.clone());
        let (a, e, c) = (argv.to_vec(), env.to_vec(), cwd.to_string());
        // Connecting, sending and the sandbox creating the process block briefly.
        let started = tokio::task::spawn_blocking(move || {
            use std::os::fd::AsRawFd;
            let r = crate::urpc::execute(
                &id,
                ns.as_deref(),
                &crate::urpc::Exec {
                    argv: &a,
                    env: &e,
                    cwd: &c,
                    uid: who.uid,
                    gid: who.gid,
                    stdio: [stdin_r.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()],
                },
            );
            // The sandbox holds its own copies now: the pipes end when the command's do.
            drop((stdin_r, out_w, err_w));
            r
        })
        .await
        .map_err(|e| Error::backend(TIER, format!("exec task failed: {e}")))?;
        let pid = match started {
            Ok(pid) => pid,
            Err(crate::urpc::CallError::Unavailable(why)) => {
                tracing::debug!(sandbox = %self.id, %why, "starting commands with runsc exec");
                return Ok(None);
            }
            Err(crate::urpc::CallError::Remote(why)) => {
                // The sandbox refused to start it (e.g. no such executable): a result, like
                // the message and status `runsc exec` gives.
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
                if !self.container_running().await {
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
        let (out, err) = self.start_io(
            req.stdin.clone().zip(stdin),
            reader(out_r),
            reader(err_r),
            sink,
        );
        let (id, ns) = (self.id.clone(), self.runsc.netns.clone());
        let mut wait =
            tokio::spawn(async move { crate::urpc::wait_pid(&id, ns.as_deref(), pid).await });
        let timeout = req.effective_timeout(self.spec.limits.wall_time());
        let (status, limit) = match tokio::time::timeout(timeout, &mut wait).await {
            Ok(s) => (s, None),
            Err(_) => {
                self.kill_exec(pid).await;
                match tokio::time::timeout(Duration::from_secs(10), &mut wait).await {
                    Ok(s) => (s, Some(LimitKind::WallTime)),
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
        let exit_code = match status {
            Ok(Ok(ws)) if ws & 0x7f == 0 => (ws >> 8) & 0xff,
            Ok(Ok(ws)) => 128 + (ws & 0x7f),
            _ => 128,
        };
        Ok(Some(
            self.conclude(Some(exit_code), limit, before, out, err, std::mem::take(t))
                .await,
        ))
    }

    async fn container_running(&self) -> bool {
        let mut cmd = self.runsc.async_command();
        cmd.args(["state", &self.id]).stdout(Stdio::piped());
        match cmd.output().await {
            Ok(out) => serde_json::from_slice::<serde_json::Value>(&out.stdout)
                .map(|v| v["status"] == "running")
                .unwrap_or(false),
            Err(_) => false,
        }
    }

    /// Kills a timed-out exec's whole process group inside the sandbox.
    async fn kill_exec(&self, pid: i32) {
        let script = format!("kill -9 -{pid} 2>/dev/null; kill -9 {pid} 2>/dev/null; true");
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

    fn host_path(&self, path: &str) -> Result<PathBuf> {
        WorkspacePath::parse(path)?.resolve_under(&self.workspace)
    }

    /// Deletes the container, reaps its processes, unmounts and removes the state. Idempotent.
    fn teardown(&self) {
        if self.torn_down.swap(true, Ordering::SeqCst) {
            return;
        }
        self.cleanup();
    }

    /// Deletes the container and removes the host state. Safe to repeat.
    fn cleanup(&self) {
        if let Some((e, _)) = &self.egress {
            e.detach_in_background(&self.id);
        }
        self.delete_container();
        stale::unmount_all(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    fn delete_container(&self) {
        let pids = self.pids.lock().map(|p| p.clone()).unwrap_or_default();
        let mut cmd = self.runsc.command();
        cmd.args(["delete", "--force", &self.id])
            .stderr(Stdio::null());
        match cmd.spawn() {
            Ok(mut child) => {
                reaper::reap_while(&pids, Duration::from_secs(20), || {
                    matches!(child.try_wait(), Ok(Some(_)) | Err(_))
                });
                let _ = child.wait();
            }
            Err(e) => {
                tracing::warn!(sandbox = %self.id, error = %e, "runsc delete could not start")
            }
        }
    }

    /// Checkpoints the whole sandbox (every process's memory) plus the workspace into `store`.
    ///
    /// `runsc checkpoint` stops the container; it is brought back from the same image in the
    /// background (delete, then restore under the same id), holding the lifecycle lock so
    /// the next exec waits for it. The call returns once the snapshot is stored.
    async fn snapshot(self: &Arc<Self>, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.alive()?;
        if self.egress.is_some() {
            // runsc: "checkpoint not supported when using hostinet".
            return Err(Error::unsupported(
                TIER,
                "snapshots of a sandbox with network access (gVisor cannot checkpoint a sandbox \
                 using the host network stack, which the egress path needs); snapshot a \
                 deny-all sandbox instead",
            ));
        }
        let guard = Arc::clone(&self.lifecycle).write_owned().await;
        self.alive()?;
        let image = self.dir.join(format!(
            "checkpoint-{}",
            self.seq.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&image).map_err(io("create", &image))?;
        let mut cmd = self.runsc.async_command();
        cmd.arg("checkpoint")
            .arg("--image-path")
            .arg(&image)
            .arg(&self.id);
        if let Err(e) = run_checked_async(cmd, "checkpoint").await {
            // Nothing consistent to resume from: the sandbox is gone.
            let me = Arc::clone(self);
            drop(guard);
            let _ = tokio::task::spawn_blocking(move || me.teardown()).await;
            return Err(e);
        }
        let packed = fsnap::pack_dir(&image);
        let ws = match self.spec.workspace {
            Workspace::Empty => Some(fsnap::pack_dir(&self.workspace)),
            _ => None,
        };
        // `/tmp` and `/dev/shm` live on the host too: not in the checkpoint image.
        let scratch = fsnap::pack_dir(&self.scratch);
        let me = Arc::clone(self);
        let resume_image = image.clone();
        self.resuming.store(true, Ordering::SeqCst);
        tokio::spawn(async move {
            let _exclusive = guard;
            me.resume_from(&resume_image).await;
            me.resuming.store(false, Ordering::SeqCst);
            me.resumed.notify_waiters();
        });
        let mut draft = SnapshotDraft::new(
            TIER,
            self.engine.clone(),
            vec![SnapshotKind::Filesystem, SnapshotKind::FullMemory],
            self.spec.clone(),
        )
        .artifact("checkpoint.tar", packed?)
        .meta("uid", self.who.uid.to_string())
        .meta("gid", self.who.gid.to_string())
        .meta("platform", self.runsc.platform.name())
        .meta("sandbox_id", self.id.clone());
        if let Some(ws) = ws {
            draft = draft.artifact("workspace.tar", ws?);
        }
        draft = draft.artifact(SCRATCH_TAR, scratch?);
        Ok(store.put(draft).await?)
    }

    /// Brings a checkpointed (stopped) container back from its image under the same id.
    async fn resume_from(self: &Arc<Self>, image: &Path) {
        let me = Arc::clone(self);
        let _ = tokio::task::spawn_blocking(move || me.delete_container()).await;
        let mut cmd = self.runsc.async_command();
        cmd.args(["restore", "--detach", "--bundle"])
            .arg(&self.bundle)
            .arg("--image-path")
            .arg(image)
            .arg(&self.id);
        let resumed = run_detached(cmd, &self.dir.join("runsc.log"), "restore").await;
        self.track_processes().await;
        let _ = std::fs::remove_dir_all(image);
        if let Err(e) = resumed {
            tracing::warn!(sandbox = %self.id, error = %e, "could not resume after a checkpoint");
            self.life
                .end(format!("could not resume after its snapshot: {e}"));
        }
        if self.torn_down.load(Ordering::SeqCst) {
            // Destroyed while resuming: remove what the restore brought back.
            let me = Arc::clone(self);
            let _ = tokio::task::spawn_blocking(move || me.cleanup()).await;
        }
    }
}

fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io("create", path))?;
    f.write_all(data).map_err(io("write", path))
}

/// The cgroup path of `pid` in the v1 hierarchy that has `controller`.
fn cgroup_of(pid: i64, controller: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        ctrls
            .split(',')
            .any(|c| c == controller)
            .then(|| path.to_string())
    })
}

fn chown_new(path: &Path, who: Identity) -> Result<()> {
    nix::unistd::chown(path, Some(who.uid.into()), Some(who.gid.into()))
        .map_err(|e| Error::io_path("chown", path, e.into()))
}

#[async_trait]
impl Sandbox for GvisorSandbox {
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
        let inner = Arc::clone(&self.inner);
        Ok(ExecStream::spawn(move |tx| async move {
            inner.run(req, Some(tx)).await
        }))
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        let s = &self.inner;
        s.alive()?;
        if s.read_only() {
            return Err(Error::invalid(
                "path",
                "the workspace is read-only in this sandbox's spec",
            ));
        }
        let target = s.host_path(path)?;
        // Create missing parents one by one, owned by the workload's user.
        let rel = WorkspacePath::parse(path)?.relative();
        let mut cur = s.workspace.clone();
        if let Some(parent) = rel.parent() {
            for c in parent.components() {
                cur.push(c);
                if !cur.exists() {
                    std::fs::create_dir(&cur).map_err(io("create", &cur))?;
                    chown_new(&cur, s.who)?;
                }
            }
        }
        // Re-check after creating parents, then refuse to write through a symlink.
        let target2 = s.host_path(path)?;
        if target2 != target || target.is_symlink() {
            return Err(Error::PathEscape { path: path.into() });
        }
        std::fs::write(&target, data).map_err(io("write", &target))?;
        chown_new(&target, s.who)
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.inner.alive()?;
        let p = self.inner.host_path(path)?;
        match std::fs::read(&p) {
            Ok(d) => Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(Error::NotFound { path: path.into() })
            }
            Err(e) => Err(io("read", &p)(e)),
        }
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.inner.alive()?;
        sandbox_core::path::list_host_dir(&self.inner.host_path(path)?, path)
    }

    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.inner.snapshot(store).await
    }

    async fn pause(&self) -> Result<()> {
        self.inner.alive()?;
        if !self.inner.life.begin(Transition::Pause)? {
            return Ok(());
        }
        let mut cmd = self.inner.runsc.async_command();
        cmd.args(["pause", &self.inner.id]);
        run_checked_async(cmd, "pause").await?;
        self.inner.life.complete(Transition::Pause);
        Ok(())
    }

    async fn resume(&self) -> Result<()> {
        self.inner.alive()?;
        if !self.inner.life.begin(Transition::Resume)? {
            return Ok(());
        }
        let mut cmd = self.inner.runsc.async_command();
        cmd.args(["resume", &self.inner.id]);
        run_checked_async(cmd, "resume").await?;
        self.inner.life.complete(Transition::Resume);
        Ok(())
    }

    async fn health_check(&self) -> Result<()> {
        self.inner.alive()?;
        if self.inner.container_running().await {
            Ok(())
        } else {
            Err(Error::SandboxGone {
                id: self.inner.id.clone(),
                reason: "runsc reports the sandbox is not running".into(),
            })
        }
    }

    async fn destroy(&self) -> Result<()> {
        // Not waiting for execs: a running one is killed with the container. A resume in
        // progress after a snapshot (~0.2 s) is waited for, so that nothing it makes comes
        // after the teardown (if it outlasts the wait, it sees `gone` when it finishes and
        // cleans up after itself).
        let inner = Arc::clone(&self.inner);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while inner.resuming.load(Ordering::SeqCst) {
            let done = inner.resumed.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if !inner.resuming.load(Ordering::SeqCst)
                || tokio::time::timeout_at(deadline, done).await.is_err()
            {
                break;
            }
        }
        // Detach first and wait, so nothing of the link is left when this returns.
        if let Some((e, _)) = &inner.egress {
            if !inner.torn_down.load(Ordering::SeqCst) {
                e.detach(&inner.id).await;
            }
        }
        inner.life.end("destroyed");
        tokio::task::spawn_blocking(move || inner.teardown())
            .await
            .map_err(|e| Error::backend(TIER, format!("teardown task failed: {e}")))
    }

    async fn set_network_policy(&self, policy: NetworkPolicy) -> Result<()> {
        self.inner.alive()?;
        sandbox_core::egress::update_policy(
            TIER,
            self.inner.egress.as_ref().map(|(e, _)| e.as_ref()),
            &self.inner.id,
            &policy,
        )
    }

    async fn network_events(&self) -> Result<Vec<NetworkEvent>> {
        match &self.inner.egress {
            Some((e, _)) => e.events(&self.inner.id),
            None => Ok(Vec::new()),
        }
    }
}

impl Drop for GvisorSandbox {
    fn drop(&mut self) {
        self.inner.teardown();
    }
}
