//! # backend-gvisor — tier 3: untrusted code under gVisor
//!
//! We drive the `runsc` binary (gVisor's OCI runtime; Debian package `runsc`, root needed);
//! we do not reimplement it. Each sandbox is one runsc container with its own state root:
//!
//! 1. **create**: write an OCI bundle ([`bundle`]): a read-only root holding only mount
//!    points, read-only binds of the host's `/usr` and the `/etc` files tools need (or the
//!    spec's [`rootfs`](sandbox_core::SandboxSpec::rootfs) or image), a capped tmpfs `/tmp`,
//!    and `/workspace`; then `runsc run --detach` starts pid 1, which stays up and reaps
//!    orphans, so files and background processes persist across an agent's turns.
//! 2. **exec**: the calls `runsc exec` would make on the sandbox's control socket, made
//!    directly (~5 ms instead of ~30 ms a command), with exactly the spec's environment, no
//!    capabilities, the sandbox's uid/gid and rlimits; output capped and redacted.
//! 3. **snapshot**: `runsc checkpoint` (every process's memory) + the workspace files, in a
//!    [`SnapshotStore`]; **restore** `runsc restore`s them: processes resume where they were.
//! 4. **destroy**: `runsc delete --force`, reaping runsc's processes ([`reaper`]),
//!    unmounting the workspace and removing the state directory.
//!
//! runsc's processes outlive their creator, so each sandbox carries an owner lock, a
//! watchdog tears a dead owner's sandboxes down, and [`GvisorBackend::cleanup_stale`] sweeps
//! what is left. Limits go to OCI `linux.resources` and rlimits; `/tmp`, `/dev/shm` and an
//! empty workspace are capped tmpfs mounts charged to the memory limit. Deny-all is
//! `--network=none`; other policies (and proxy-held secrets) need an [`EgressEnforcer`]
//! ([`GvisorBackendBuilder::egress`]). `AGENT_SANDBOX_RUNSC_DEBUG=/some/dir` keeps runsc's debug logs.
//!
//! `docs/gvisor.md` in the repository is the design: how it works and isolates, the
//! capabilities and limits tables, the network path, crash recovery, configuration, the
//! known quirks of Debian's runsc (the `statx` shim, the seccomp profile that reaches only the
//! init, rootless refusals) and the threat model; `docs/threat-model.md` places the tier
//! among the others.

pub mod bundle;
pub mod reaper;
pub mod runsc;
mod sandbox;
mod stale;
mod urpc;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use sandbox_core::{
    Backend, Capabilities, EgressEnforcer, Error, Language, LimitKind, NetworkMode,
    ResolvedSecrets, Result, Sandbox, SandboxSpec, SnapshotId, SnapshotKind, SnapshotStore, Tier,
    TierStatus,
};

pub use runsc::{Platform, RunscInfo};
pub use sandbox::GvisorSandbox;
pub use sandbox_image::ImageStore;

const TIER: Tier = Tier::Gvisor;

/// The file in the state directory that remembers what runsc said about itself.
const RUNSC_INFO_CACHE: &str = "runsc-info";

/// Settings of the gVisor backend, as [`GvisorBackendBuilder`] collects them.
#[derive(Debug, Clone, Default)]
pub(crate) struct GvisorConfig {
    /// The runsc binary (default: `runsc` on `PATH`).
    pub(crate) runsc: Option<PathBuf>,
    /// The platform (default: systrap where available, else ptrace).
    pub(crate) platform: Option<Platform>,
    /// Where per-sandbox state lives (default: `$TMPDIR/agent-sandbox-gvisor`).
    pub(crate) state_dir: Option<PathBuf>,
    /// The egress enforcer for policies other than deny-all, if any (see the crate docs).
    pub(crate) egress: Option<Arc<dyn EgressEnforcer>>,
    /// Start every command with a `runsc exec` process instead of through the control socket.
    pub(crate) runsc_exec: bool,
    /// Where images are pulled and cached (default: the shared store, opened on first use).
    pub(crate) images: Option<ImageStore>,
}

/// Builder for [`GvisorBackend`]: [`GvisorBackend::builder`], the settings, then
/// [`build`](Self::build), which checks them. Nothing runs `runsc` until `probe` or `create`.
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct GvisorBackendBuilder {
    cfg: GvisorConfig,
}

impl GvisorBackendBuilder {
    /// Uses this runsc binary (an absolute path). Default: `runsc` on `PATH`.
    pub fn runsc(mut self, path: impl Into<PathBuf>) -> Self {
        self.cfg.runsc = Some(path.into());
        self
    }

    /// Forces a platform. Default: systrap where available, else ptrace.
    pub fn platform(mut self, p: Platform) -> Self {
        self.cfg.platform = Some(p);
        self
    }

    /// Keeps sandbox state under this directory (an absolute path). Default:
    /// `$TMPDIR/agent-sandbox-gvisor`.
    pub fn state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cfg.state_dir = Some(dir.into());
        self
    }

    /// Plugs in the egress enforcer that gives allowlisted sandboxes their path out.
    /// Default: none (a spec that allows any host is refused as `Unsupported`).
    pub fn egress(mut self, enforcer: Arc<dyn EgressEnforcer>) -> Self {
        self.cfg.egress = Some(enforcer);
        self
    }

    /// Starts every command with a `runsc exec` process instead of through the sandbox's
    /// control socket (~30 ms instead of ~5 ms a command; for a runsc whose control
    /// interface is in doubt, and to test that path). Default: off.
    pub fn runsc_exec(mut self, yes: bool) -> Self {
        self.cfg.runsc_exec = yes;
        self
    }

    /// Pulls and caches images named by [`SandboxSpec::image`] in `store`. Default:
    /// [`ImageStore::shared_default`], opened on the first image.
    pub fn image_store(mut self, store: ImageStore) -> Self {
        self.cfg.images = Some(store);
        self
    }

    /// Checks the settings and builds the backend.
    ///
    /// # Errors
    /// [`Error::InvalidSpec`] naming `runsc` or `state_dir` when it is not an absolute path.
    pub fn build(self) -> Result<GvisorBackend> {
        if let Some(p) = self.cfg.runsc.as_ref().filter(|p| !p.is_absolute()) {
            return Err(Error::invalid(
                "runsc",
                format!(
                    "`{}` is not an absolute path (give the binary's full path, or leave it \
                     unset for `runsc` on PATH)",
                    p.display()
                ),
            ));
        }
        if let Some(p) = self.cfg.state_dir.as_ref().filter(|p| !p.is_absolute()) {
            return Err(Error::invalid(
                "state_dir",
                format!("`{}` is not an absolute path", p.display()),
            ));
        }
        Ok(GvisorBackend {
            config: self.cfg,
            resolved: Arc::new(OnceLock::new()),
        })
    }
}

/// The gVisor backend.
#[derive(Debug, Clone)]
pub struct GvisorBackend {
    config: GvisorConfig,
    /// The runsc facts, found once (a successful discovery is cached; failures are retried).
    resolved: Arc<OnceLock<Resolved>>,
}

/// Everything `create` needs, resolved once per call.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub info: RunscInfo,
    pub platform: Platform,
    pub state_dir: PathBuf,
}

impl GvisorBackend {
    /// Starts a builder (every setting at its default).
    pub fn builder() -> GvisorBackendBuilder {
        GvisorBackendBuilder::default()
    }

    /// The image store: the configured one, else the default, opened once.
    pub(crate) fn image_store(&self) -> Result<ImageStore> {
        match &self.config.images {
            Some(s) => Ok(s.clone()),
            None => ImageStore::shared_default().map_err(|e| e.into_core(Tier::Gvisor)),
        }
    }

    /// Tears down the sandboxes that processes which died without destroying them left in
    /// the state directory (their Sentries keep running otherwise: `runsc run --detach`
    /// does not tie them to us): `runsc delete --force`, any runsc process still naming the
    /// sandbox is killed, its workspace unmounted and its directory removed. Returns how many.
    ///
    /// A sandbox counts as abandoned when nobody holds the lock its creator keeps on its
    /// directory for its whole life (the kernel releases it when that process dies, however it
    /// dies), so this never touches a live sandbox of any process. The first `create` of each
    /// process runs this in the background for its state directory. A sandbox that was
    /// paused when its creator died (a client's `pause`, an idle server's `on_idle: pause`)
    /// is resumed first (runsc does not delete a paused container cleanly); one caught in a
    /// checkpoint is deleted like any other.
    pub fn cleanup_stale(&self) -> Result<usize> {
        Ok(self.cleanup_stale_report()?.removed)
    }

    /// [`GvisorBackend::cleanup_stale`], naming the sandboxes that were paused and resumed to
    /// be deleted.
    pub fn cleanup_stale_report(&self) -> Result<sandbox_core::sandbox::StaleCleanup> {
        let r = self.resolve()?;
        Ok(stale::sweep(&r.state_dir, &r.info.path))
    }

    fn state_dir(&self) -> PathBuf {
        self.config
            .state_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("agent-sandbox-gvisor"))
    }

    pub(crate) fn resolve(&self) -> Result<Resolved> {
        if let Some(r) = self.resolved.get() {
            return Ok(r.clone());
        }
        let r = self.discover()?;
        Ok(self.resolved.get_or_init(|| r).clone())
    }

    fn discover(&self) -> Result<Resolved> {
        // runsc's facts are the same for every backend using the same binary: ask it once
        // per process (two runsc calls, ~50 ms), and remember the answer in the state
        // directory for the next processes (a one-shot `agent-sandbox run` among them) as
        // long as the binary is the same file (see `RunscInfo::discover_cached`).
        static FOUND: Mutex<BTreeMap<Option<PathBuf>, RunscInfo>> = Mutex::new(BTreeMap::new());
        let key = self.config.runsc.clone();
        let cached = FOUND.lock().ok().and_then(|m| m.get(&key).cloned());
        let info = match cached {
            Some(info) => info,
            None => {
                let state_dir = self.state_dir();
                // Only root runs this tier; its state directory is made here if need be.
                let info = if nix::unistd::geteuid().is_root()
                    && std::fs::create_dir_all(&state_dir).is_ok()
                {
                    RunscInfo::discover_cached(key.as_deref(), &state_dir.join(RUNSC_INFO_CACHE))?
                } else {
                    RunscInfo::discover(key.as_deref())?
                };
                if let Ok(mut m) = FOUND.lock() {
                    m.insert(key, info.clone());
                }
                info
            }
        };
        info.check_version()?;
        if !nix::unistd::geteuid().is_root() {
            return Err(Error::Unavailable {
                tier: TIER,
                reason: "runsc refuses rootless `create` and `restore` (this tier needs root)"
                    .into(),
                fix: "run as root, or use the container tier's rootless mode for trusted code"
                    .into(),
            });
        }
        let platform = self
            .config
            .platform
            .unwrap_or_else(|| info.default_platform());
        if !info.platforms.contains(&platform) {
            return Err(Error::Unavailable {
                tier: TIER,
                reason: format!("{} has no `{}` platform", info.version, platform.name()),
                fix: "use the default platform".into(),
            });
        }
        Ok(Resolved {
            info,
            platform,
            state_dir: self.state_dir(),
        })
    }
}

#[async_trait]
impl Backend for GvisorBackend {
    fn tier(&self) -> Tier {
        TIER
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::new(TIER);
        c.languages = vec![
            Language::Python,
            Language::Shell,
            Language::Node,
            Language::C,
        ];
        c.argv = true;
        c.snapshots = vec![SnapshotKind::Filesystem, SnapshotKind::FullMemory];
        c.network = if self.config.egress.is_some() {
            vec![
                NetworkMode::DenyAll,
                NetworkMode::Allowlist,
                NetworkMode::Internet,
            ]
        } else {
            vec![NetworkMode::DenyAll]
        };
        // Proxy-held secrets need the egress proxy (see "Secrets" in the crate docs).
        c.proxy_secrets = self.config.egress.is_some();
        c.pause_resume = true;
        // CPU time and memory from the sandbox process's cgroup (`sandbox/usage.rs`), where
        // the host has cgroup accounting (v1 `cpuacct` and `memory`, or v2).
        c.usage = std::path::Path::new("/sys/fs/cgroup/cpuacct/cpuacct.usage").exists()
            || std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
        c.streaming = true;
        c.persistent_state = true;
        c.processes = true;
        c.tty = true;
        c.publish = true;
        // The workspace is a host folder: watched from the host (`sandbox_core::watch`).
        c.watch = true;
        c.workspace_alias = true;
        c.images = true;
        // An image brings its own interpreters; the same languages run from it.
        c.image_languages = c.languages.clone();
        // OCI `linux.resources` (memory, pids, CPU quota), rlimits (CPU seconds, open
        // files), the exec driver (wall time, output), capped tmpfs mounts (disk), the
        // lifetime timer. No instruction budget.
        c.limits = vec![
            LimitKind::WallTime,
            LimitKind::CpuTime,
            LimitKind::Memory,
            LimitKind::Pids,
            LimitKind::Output,
            LimitKind::Disk,
            LimitKind::OpenFiles,
            LimitKind::Lifetime,
            LimitKind::CpuShare,
        ];
        c
    }

    async fn probe(&self) -> TierStatus {
        let this = self.clone();
        let r = tokio::task::spawn_blocking(move || this.resolve()).await;
        match r {
            Ok(Ok(r)) => {
                let platforms: Vec<&str> = r.info.platforms.iter().map(|p| p.name()).collect();
                TierStatus::available(
                    TIER,
                    format!("{} (platform {})", r.info.version, r.platform.name()),
                )
                .with_detail("runsc", r.info.path.display().to_string())
                .with_detail("version", r.info.version.clone())
                .with_detail("platforms", platforms.join(","))
                .with_detail("platform", r.platform.name())
            }
            Ok(Err(Error::Unavailable { reason, fix, .. })) => {
                TierStatus::unavailable(TIER, reason, fix)
            }
            Ok(Err(e)) => TierStatus::unavailable(TIER, e.to_string(), "see the error"),
            Err(e) => TierStatus::unavailable(TIER, format!("probe panicked: {e}"), "report a bug"),
        }
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(
            GvisorSandbox::create(self, spec, secrets, None).await?,
        ))
    }

    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(
            GvisorSandbox::restore(self, store, id, secrets).await?,
        ))
    }

    /// [`GvisorBackend::cleanup_stale`]: counts sandboxes.
    async fn cleanup_stale(&self) -> Result<usize> {
        Ok(Backend::cleanup_stale_report(self).await?.removed)
    }

    /// [`GvisorBackend::cleanup_stale_report`]: counts sandboxes, names the resumed ones.
    async fn cleanup_stale_report(&self) -> Result<sandbox_core::sandbox::StaleCleanup> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || GvisorBackend::cleanup_stale_report(&me))
            .await
            .map_err(|e| Error::backend_caused(TIER, "the cleanup task", e))?
    }
}
