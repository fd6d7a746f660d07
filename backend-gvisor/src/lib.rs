//! # backend-gvisor — tier 3: untrusted code under gVisor
//!
//! We drive the `runsc` binary (gVisor's OCI runtime; Debian package `runsc`); we do not
//! reimplement it. Each sandbox is one runsc container with its own state root:
//!
//! 1. **create**: write an OCI bundle ([`bundle`]): a read-only root holding only mount
//!    points, read-only binds of the host's `/usr` and the `/etc` files tools need, generated
//!    `passwd`/`group`/`hosts`, a tmpfs `/tmp`, and `/workspace`; then `runsc run --detach`
//!    starts pid 1, a tiny shell loop that stays up and reaps orphans, so files and
//!    background processes persist across an agent's turns.
//! 2. **exec**: the two calls `runsc exec` would make on the sandbox's control socket, made
//!    directly (`containerManager.ExecuteAsync` with the stdio pipes attached, then
//!    `WaitPID`; see the `urpc` module): ~4.6 ms instead of ~30 ms for a `runsc exec`
//!    process. Exactly the spec's environment (never on a command line, where `ps` would
//!    show secrets), no capabilities, the sandbox's uid/gid (a `HostDir` workspace's owner's:
//!    runsc's gofer gives new files the process's ids, so they are the owner's on the host,
//!    see "Identity" in `docs/container.md`) and rlimits; output is captured
//!    with caps and secret redaction. A wall timeout kills the exec's whole process group
//!    inside the sandbox. (The socket is abstract, so per network namespace: for a sandbox
//!    in a namespace of its own, for egress, a short-lived thread joins it to connect.)
//!    Where that socket cannot be used (a runsc whose interface differs), commands go
//!    through `runsc exec --process <0600 json file>`.
//! 3. **snapshot**: `runsc checkpoint` (full memory state of every process) + the workspace
//!    files, stored in a [`SnapshotStore`]; the sandbox is
//!    restored in place from the image and keeps running. **restore** recreates the bundle
//!    under a new id and `runsc restore`s the image: processes resume where they were.
//!    Background processes are kept, with a terminal or not (a keeper inside runs each; a
//!    snapshot detaches from them first and attaches again after: `docs/interactive.md`).
//!
//!    With [`SandboxSpec::rootfs`](sandbox_core::SandboxSpec) set, that directory is the root
//!    instead, wrapped by runsc in an in-memory overlay (`--overlay2=root:memory`): the
//!    sandbox can write where its user may, and the directory itself is never modified. The
//!    path must be traversable by unprivileged users (gVisor's sandbox process is one).
//! 4. **destroy**: `runsc delete --force`, reaping the sandbox's runsc processes ([`reaper`]),
//!    unmounting the workspace and removing the state directory.

//! ## A process that dies without destroying its sandboxes
//! runsc's sandbox and gofer processes are not tied to the process that started them: a
//! program killed with its sandboxes alive would leave their Sentries running (untrusted
//! code included), their cgroups, the workspace mounts and the state directories. Each
//! sandbox's creator holds a shared `flock` on `<state dir>/<id>/owner` for the sandbox's
//! life; the kernel releases it when that process dies, however it dies. Two sweeps tear
//! down the sandboxes whose lock nobody holds (`runsc delete --force`, the unmount, the
//! removal; see the `stale` module):
//! - **at once**: the first `create` of each process starts a watchdog (`/bin/sh` tagged
//!   `asb-gvisor-watchdog`, reading a pipe only this process writes to, in a process group
//!   of its own, ignoring terminal signals) that sweeps the state directory when the
//!   process ends;
//! - **at the next start**, for owners whose watchdog died with them (a whole process tree
//!   or container killed): the first `create` of each process sweeps in the background, and
//!   [`GvisorBackend::cleanup_stale`] does it on demand.
//!
//! Both are tested by `SIGKILL`ing a process that owns a sandbox running a background
//! command (and, for the second, its watchdog first), also while the sandbox is paused
//! (resumed first, and reported by [`GvisorBackend::cleanup_stale_report`]) or being
//! checkpointed. A sandbox directory without an
//! `owner` file older than ten minutes (an older version's, or a state root that a late
//! `runsc` call made again after a teardown, e.g. a resume cut short by the end of the
//! program) is swept too.

//! ## Limits
//! Memory, pids and CPU quota go to OCI `linux.resources` (cgroups v1 or v2, created by runsc
//! under `agent-sandbox-gvisor-<id>`); an OOM kill is reported as `limit: memory`. Per-exec
//! wall time, output bytes, open files and CPU seconds (`RLIMIT_CPU`) are enforced per exec.
//!
//! **Disk is memory here too.** The workspace of an `Empty` spec and `/tmp` + `/dev/shm`
//! (the `tmp/` and `shm/` of one scratch tmpfs) are host tmpfs mounts the Sentry reaches
//! through its gofer, and it also keeps their files in its memory, charged to the sandbox's
//! limit. They are capped by [`Limits::tmpfs_caps`](sandbox_core::Limits::tmpfs_caps) of
//! what the Sentry leaves (the limit less 16 MiB; an idle Sentry takes 14 MiB), with file
//! counts at their measured cost (~6 KiB a file). gVisor's own tmpfs, which these mounts
//! replace for `/tmp` and `/dev/shm`, ignores `nr_inodes`: a flood of empty files there
//! grew the Sentry until it was OOM-killed and the sandbox lost. Now 100 MB written, or
//! 100,000 empty files created, in any of them is `ENOSPC` reported as `limit: disk`, and the
//! sandbox goes on (tested). `/tmp` and `/dev/shm` share their cap, are saved with
//! snapshots (`scratch.tar`) and restored with them. A caller's rootfs without a `tmp` or
//! `dev/shm` directory is seen through a host overlay that has them (runsc would create a
//! bind mount's point in the directory itself, which is never written); where that overlay
//! cannot be made (a path overlayfs cannot name, a state directory overlayfs cannot use),
//! those mounts fall back to gVisor's tmpfs and its unbounded file count. The cost:
//! file operations in `/tmp` go through the gofer, like the workspace's (measured with 3,000
//! small files on the ptrace platform: `stat` 87–113 µs against 40–53 µs in gVisor's tmpfs,
//! create + write 502–508 µs against 326–517 µs, read 586–643 µs against 466–510 µs).

//! ## Network
//! Deny-all (the default): `--network=none`, the sandbox has only gVisor's own loopback.
//!
//! Any other policy needs an [`EgressEnforcer`] ([`GvisorConfig::egress`]; refused with
//! `Unsupported` without one). runsc then starts in a **network namespace of its own** (made
//! for it at spawn time) with `--network=host`: gVisor passes socket calls to the host kernel
//! *of that namespace*, whose only link is the enforcer's veth to the egress proxy
//! (`--network=sandbox` fails on current kernels with "cannot run with network enabled in root
//! network namespace"). Commands get the proxy variables, `/etc/resolv.conf` names the proxy's
//! DNS responder, and code that ignores the proxy is captured transparently or dropped on the
//! far side of the link. Such sandboxes cannot be snapshotted: runsc refuses to checkpoint
//! a sandbox that uses host networking (`Unsupported` says so).
//!
//! **Proxy-held secrets** ([`SecretExposure::Proxy`](sandbox_core::SecretExposure::Proxy);
//! design: `docs/network.md`, "Secrets the sandbox never holds") ride on that path: the
//! backend asks the enforcer to `bind_secrets` right after `prepare`, each secret's variable
//! gets its placeholder, and the certificates the sandbox trusts
//! ([`SecretPlan::ca_bundle`](sandbox_core::SecretPlan::ca_bundle): the root's system bundle
//! plus the proxy's interception CA) are at `/etc/agent-sandbox-ca.crt`, named by
//! [`CA_BUNDLE_VARS`](sandbox_core::egress::CA_BUNDLE_VARS) (`SSL_CERT_FILE`,
//! `REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE`, `PIP_CERT`, `GIT_SSL_CAINFO`,
//! `NODE_EXTRA_CA_CERTS`), and also **over the root's system bundle**
//! (`/etc/ssl/certs/ca-certificates.crt`), so clients that read only that path trust it too:
//! in the host-tools view both are read-only binds of one file of the state directory; an
//! image's (or a caller's rootfs's) root gets them written into its overlay view (the layers
//! are never written; the system path only where the root has that file). Without an
//! enforcer such a spec is refused (`Unsupported`), and
//! [`Capabilities::proxy_secrets`](sandbox_core::Capabilities::proxy_secrets) is false.
//!
//! ## Troubleshooting
//! `AGENT_SANDBOX_RUNSC_DEBUG=/some/dir` makes every runsc call write its debug logs there.
//!
//! ## Known runsc quirks (Debian's 2022-12-19 build)
//! - `statx` with `AT_NO_AUTOMOUNT` is rejected ("Invalid argument"), and coreutils' `ls DIR`,
//!   `ls -l` and `stat` always pass it. The host-tools view therefore preloads a 4 KiB shim
//!   (`/etc/ld.so.preload` names [`bundle::STATX_SHIM_PATH`], built from
//!   `shim/statx_compat.rs`, no std) whose `statx` drops the flag, which means nothing in
//!   gVisor (it has no automount points): `ls -la` and `stat` work (tested). A caller's
//!   rootfs directory with glibc's loader gets it too, through the host overlay view of the
//!   directory (its `ld.so.preload` kept, ours appended in the overlay; the directory is
//!   never written; tested with a tree of the host's own `sh`, `ls`, `stat`); where that
//!   view cannot be made, or its `etc` is a symbolic link, it does not. Not covered: static
//!   and musl programs (they do not read `ld.so.preload`); a 32-bit program would get a
//!   loader warning on stderr (the shim is 64-bit). An OCI seccomp rule cannot do it: this
//!   runsc answers `EPERM` whatever `errnoRet` says, and glibc falls back to `fstatat` only
//!   on `ENOSYS`.
//! - The bundle's OCI seccomp profile (`--oci-seccomp`; [`bundle::seccomp`]: no new
//!   namespaces, the container tier's rule for untrusted code) reaches the container's init
//!   only, not the commands started by `runsc exec` or the control socket. The same shim
//!   installs that filter in its constructor, so every dynamically linked program (and all
//!   it starts) runs under it: `unshare -r true` fails with `EPERM` from the shell, Python
//!   and argv (the conformance case `isolation.no-userns`). Not covered: a static program
//!   started directly as argv, and rootfs directories that do not get the shim.
//! - Rootless `create` and `restore` are refused by this runsc: the tier needs root
//!   (`probe()` says so).
//! - `checkpoint --leave-running` hangs: snapshots checkpoint, delete and restore in place.
//! - The `systrap` platform does not exist in this build (ptrace is used); `kvm` hangs on
//!   nested hosts, so it is used only when asked for.
//! - Without a child subreaper, `delete` takes 1.3-2 s on hosts whose pid 1 reaps slowly:
//!   the backend makes the process a subreaper while `runsc run --detach` runs (so the
//!   processes it leaves become ours) and reaps exactly those ([`reaper`]).

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

/// Settings of the gVisor backend.
#[derive(Debug, Clone, Default)]
pub struct GvisorConfig {
    /// The runsc binary (default: `runsc` on `PATH`).
    pub runsc: Option<PathBuf>,
    /// The platform (default: systrap where available, else ptrace).
    pub platform: Option<Platform>,
    /// Where per-sandbox state lives (default: `$TMPDIR/agent-sandbox-gvisor`).
    pub state_dir: Option<PathBuf>,
    /// The egress enforcer for policies other than deny-all, if any (see the crate docs).
    pub egress: Option<Arc<dyn EgressEnforcer>>,
    /// Start every command with a `runsc exec` process instead of through the sandbox's
    /// control socket (~30 ms instead of ~5 ms a command; for a runsc whose control
    /// interface is in doubt, and to test that path).
    pub runsc_exec: bool,
    /// Where images named by [`SandboxSpec::image`](sandbox_core::SandboxSpec::image) are
    /// pulled and cached (default: [`ImageStore::shared_default`], opened on the first image).
    pub images: Option<ImageStore>,
}

impl GvisorConfig {
    /// Uses this runsc binary.
    pub fn runsc(mut self, path: impl Into<PathBuf>) -> Self {
        self.runsc = Some(path.into());
        self
    }

    /// Forces a platform.
    pub fn platform(mut self, p: Platform) -> Self {
        self.platform = Some(p);
        self
    }

    /// Keeps sandbox state under this directory.
    pub fn state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.state_dir = Some(dir.into());
        self
    }

    /// Plugs in the egress enforcer that gives allowlisted sandboxes their path out.
    pub fn egress(mut self, enforcer: Arc<dyn EgressEnforcer>) -> Self {
        self.egress = Some(enforcer);
        self
    }

    /// Starts commands with `runsc exec` processes (see [`GvisorConfig::runsc_exec`]).
    pub fn runsc_exec(mut self, yes: bool) -> Self {
        self.runsc_exec = yes;
        self
    }

    /// Pulls and caches images in `store` (default: [`ImageStore::shared_default`]).
    pub fn image_store(mut self, store: ImageStore) -> Self {
        self.images = Some(store);
        self
    }
}

/// The gVisor backend.
#[derive(Debug, Clone)]
pub struct GvisorBackend {
    config: GvisorConfig,
    /// The runsc facts, found once (a successful discovery is cached; failures are retried).
    resolved: Arc<OnceLock<Resolved>>,
}

impl Default for GvisorBackend {
    fn default() -> Self {
        Self::new(GvisorConfig::default())
    }
}

/// Everything `create` needs, resolved once per call.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub info: RunscInfo,
    pub platform: Platform,
    pub state_dir: PathBuf,
}

impl GvisorBackend {
    /// A backend with these settings. Nothing is checked until `probe` or `create`.
    pub fn new(config: GvisorConfig) -> Self {
        GvisorBackend {
            config,
            resolved: Arc::new(OnceLock::new()),
        }
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
        c.streaming = true;
        c.persistent_state = true;
        c.processes = true;
        c.tty = true;
        c.publish = true;
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
            .map_err(|e| Error::backend(TIER, format!("cleanup task failed: {e}")))?
    }
}

/// Shared handle type for the facade.
pub fn backend(config: GvisorConfig) -> Arc<dyn Backend> {
    Arc::new(GvisorBackend::new(config))
}
