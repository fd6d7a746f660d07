//! # backend-container — tier 2: our own hardened Linux containers
//!
//! Runs agent code (python, node, gcc, git, bash...) in a persistent Linux container built
//! from namespaces, cgroups, seccomp and Landlock, with our own tiny init as pid 1. No OCI
//! runtime, no daemon, no helper binary to install: the init is built with this crate (by
//! its build script, with the same `rustc`) and embedded in it. It shares the host's kernel:
//! for hostile code that must not reach it, use the gVisor or microVM tiers.
//!
//! ```no_run
//! # async fn demo() -> sandbox_core::Result<()> {
//! use backend_container::ContainerBackend;
//! use sandbox_core::{Backend, ExecRequest, Language, ResolvedSecrets, SandboxSpec};
//!
//! let backend = ContainerBackend::builder().build()?;
//! let spec = SandboxSpec::builder(Language::Python).memory_mib(256).build()?;
//! let sb = backend.create(&spec, ResolvedSecrets::none()).await?;
//! let r = sb.exec(ExecRequest::code("print(2 + 2)")).await?;
//! assert_eq!(r.stdout_str(), "4\n");
//! sb.destroy().await?;
//! # Ok(()) }
//! ```
//!
//! **Configuring.** [`ContainerBackend::builder`] sets the backend-wide options
//! ([`ContainerConfig`]): a state directory for [`ContainerBackend::cleanup_stale`], the host
//! name, the uid range used as root, whether cgroups are required, seccomp and Landlock on or
//! off, and the [`EgressEnforcer`] that allowlisted network policies need ([`network`];
//! without one only deny-all is accepted). Per sandbox, the [`SandboxSpec`] gives the
//! language, workspace (a private tmpfs or a host directory), mounts, environment, secrets,
//! [`Limits`](sandbox_core::Limits), network policy, and a [`rootfs`](SandboxSpec::rootfs)
//! or image replacing the default view of the host's `/usr` ([`RootfsMode::HostTools`])
//! under a throwaway overlay.
//!
//! **Requirements.** Linux with user namespaces (`user.max_user_namespaces` > 0), `pivot_root`
//! and tmpfs/proc mounts inside them, and exec from a sealed memfd (`vm.memfd_noexec` = 0);
//! seccomp (`CONFIG_SECCOMP_FILTER`) unless the filter is turned off; Landlock when the kernel
//! has it; cgroups for memory, pids and CPU limits and pause/resume: as root nothing to do;
//! rootless, a cgroup delegated to the user that the process starts in (v1: `memory`, `pids`,
//! `cpu`; v2: with the `memory` and `pids` controllers), or `require_cgroups(false)` to run
//! without those limits. As root each sandbox gets a private uid range and commands run as an
//! unprivileged user; rootless, the caller's uid is root inside with every capability
//! dropped. [`ContainerBackend::probe`](sandbox_core::Backend::probe) checks all of this with
//! a real smoke test and says what to fix.
//!
//! `docs/container.md` in the repository is the design: the init, its zygote and execs, the
//! root filesystem, cgroup v1/v2 and delegation, how each limit is enforced, rootless vs
//! root, the seccomp filter and Landlock rules, the threat model with its gaps, and a code
//! map. `docs/network.md` covers the egress path, `docs/threat-model.md` all tiers.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use sandbox_core::{
    Backend, Capabilities, EgressEnforcer, Error, Language, LimitKind, NetworkMode, Phase,
    ResolvedSecrets, Result, Sandbox, SandboxSpec, SnapshotId, SnapshotKind, SnapshotStore, Tier,
    TierStatus, TimelineRecorder, Workspace,
};

mod cgroup;
mod create;
mod ctl;
mod files;
mod init_image;
mod landlock;
pub mod network;
mod process;
#[path = "../init/proto.rs"]
mod proto;
mod rootfs;
mod sandbox;
pub mod seccomp;
mod slots;
mod spawn;

pub use cgroup::CgroupVersion;
pub use sandbox::ContainerSandbox;
pub use sandbox_image::ImageStore;
pub use slots::SLOTS;

use crate::sandbox::{ENGINE, TIER};

/// How the sandbox's root filesystem is made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RootfsMode {
    /// The host's `/usr` and a few `/etc` files, read-only (like bubblewrap's usual setup).
    /// A spec's [`rootfs`](SandboxSpec::rootfs) directory overrides it for that sandbox.
    #[default]
    HostTools,
}

/// Configuration of a [`ContainerBackend`]; build one with [`ContainerBackend::builder`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ContainerConfig {
    /// Where a small record of each live sandbox (init pid, cgroup directories, its owner's
    /// and init's start times) is kept, so [`ContainerBackend::cleanup_stale`] (and building
    /// a backend on the same directory) can remove what a crashed process left. `None`: no
    /// record.
    pub state_dir: Option<PathBuf>,
    /// Root filesystem mode.
    pub rootfs: RootfsMode,
    /// The sandbox's host name.
    pub hostname: String,
    /// As root: the first host uid/gid of the ranges mapped into sandboxes (65536 per
    /// sandbox, [`SLOTS`] of them: the base must leave room for all, and another backend's
    /// base must be 2^30 or more away, since leases are kept per base).
    pub uid_base: u32,
    /// Refuse to create sandboxes when cgroups are not usable (default `true`). With `false`
    /// and no usable cgroup, memory, pids and CPU-quota limits are **not enforced** (rlimits
    /// still are) and pause/resume is unavailable; on a host whose only hierarchy is a
    /// cgroup v2 one that does not offer memory and pids, sandboxes still get a v2 cgroup
    /// (pause/resume, one group killed at once, `cpu.max` where offered) without those two
    /// limits, and `probe()` says so.
    pub require_cgroups: bool,
    /// Install the seccomp filter (default `true`).
    pub seccomp: bool,
    /// Install the Landlock domain when the kernel has Landlock (default `true`).
    pub landlock: bool,
    /// The egress enforcer for policies other than deny-all, if any (see [`network`]).
    pub egress: Option<Arc<dyn EgressEnforcer>>,
    /// Where images named by [`SandboxSpec::image`] are pulled and cached. `None`: the
    /// process's default store ([`ImageStore::shared_default`]), opened on the first image.
    pub images: Option<ImageStore>,
}

impl Default for ContainerConfig {
    fn default() -> Self {
        ContainerConfig {
            state_dir: None,
            rootfs: RootfsMode::HostTools,
            hostname: "sandbox".into(),
            uid_base: 1 << 30,
            require_cgroups: true,
            seccomp: true,
            landlock: true,
            egress: None,
            images: None,
        }
    }
}

/// Builder for [`ContainerBackend`].
#[derive(Debug, Clone, Default)]
pub struct ContainerBackendBuilder {
    cfg: ContainerConfig,
}

impl ContainerBackendBuilder {
    /// Keeps a record of live sandboxes in `dir` (see [`ContainerConfig::state_dir`]).
    pub fn state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cfg.state_dir = Some(dir.into());
        self
    }

    /// Sets the root filesystem mode.
    pub fn rootfs(mut self, mode: RootfsMode) -> Self {
        self.cfg.rootfs = mode;
        self
    }

    /// Sets the sandbox host name.
    pub fn hostname(mut self, name: impl Into<String>) -> Self {
        self.cfg.hostname = name.into();
        self
    }

    /// Sets the first host uid of the mapped ranges (root mode).
    pub fn uid_base(mut self, base: u32) -> Self {
        self.cfg.uid_base = base;
        self
    }

    /// Whether to refuse creating sandboxes without usable cgroups.
    pub fn require_cgroups(mut self, yes: bool) -> Self {
        self.cfg.require_cgroups = yes;
        self
    }

    /// Whether to install the seccomp filter.
    pub fn seccomp(mut self, yes: bool) -> Self {
        self.cfg.seccomp = yes;
        self
    }

    /// Whether to install Landlock.
    pub fn landlock(mut self, yes: bool) -> Self {
        self.cfg.landlock = yes;
        self
    }

    /// Plugs in the egress enforcer that gives allowlisted sandboxes their path out.
    pub fn egress(mut self, enforcer: Arc<dyn EgressEnforcer>) -> Self {
        self.cfg.egress = Some(enforcer);
        self
    }

    /// Pulls and caches images in `store` (default: [`ImageStore::shared_default`]).
    pub fn image_store(mut self, store: ImageStore) -> Self {
        self.cfg.images = Some(store);
        self
    }

    /// Builds the backend.
    pub fn build(self) -> Result<ContainerBackend> {
        let c = &self.cfg;
        if c.hostname.is_empty()
            || c.hostname.len() > 64
            || !c
                .hostname
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(Error::invalid("hostname", "1-64 letters, digits or '-'"));
        }
        if c.uid_base == 0 || u64::from(c.uid_base) + u64::from(SLOTS) * 65536 > u64::from(u32::MAX)
        {
            return Err(Error::invalid(
                "uid_base",
                format!("must be positive and leave room for {SLOTS} ranges of 65536"),
            ));
        }
        if let Some(d) = &c.state_dir {
            std::fs::create_dir_all(d).map_err(|e| Error::io_path("create state dir", d, e))?;
        }
        let mut host = cgroup::CgroupHost::detect();
        if !self.cfg.require_cgroups {
            host.allow_v2_without_limits();
        }
        // What dead processes left (their state records, then their cgroups): reported by
        // this backend's first `cleanup_stale`.
        let b = ContainerBackend {
            swept_at_build: Default::default(),
            cfg: Arc::new(self.cfg),
            host,
            landlock_abi: landlock::abi(),
            bpf: Arc::new(seccomp::program_bytes()),
            bpf_setid_guard: Arc::new(seccomp::program_bytes_with(true)),
            slot: Arc::new(AtomicU64::new(0)),
            host_ops: Arc::new(std::sync::OnceLock::new()),
            cgroups_ok: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            layers_idmap: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        };
        let mut found = b.cleanup_stale_records();
        found.merge(b.host.sweep_orphans());
        if let Ok(mut s) = b.swept_at_build.lock() {
            *s = found;
        }
        Ok(b)
    }
}

/// The container backend. Cheap to clone; sandboxes outlive nothing but their own handle.
#[derive(Debug, Clone)]
pub struct ContainerBackend {
    cfg: Arc<ContainerConfig>,
    host: cgroup::CgroupHost,
    landlock_abi: Option<u32>,
    bpf: Arc<Vec<u8>>,
    /// The filter with the set-id guard, for sandboxes whose writable workspace belongs to
    /// host root (see `seccomp::program_with`).
    bpf_setid_guard: Arc<Vec<u8>>,
    slot: Arc<AtomicU64>,
    host_ops: Arc<std::sync::OnceLock<Vec<proto::Op>>>,
    /// Set once the cgroup directories were found writable (see `cgroups_usable`).
    cgroups_ok: Arc<std::sync::atomic::AtomicBool>,
    /// Set once root-filesystem layers were idmapped here (then own-root creates may use
    /// the zygote's spare inits, see `create::allocate`).
    layers_idmap: Arc<std::sync::atomic::AtomicBool>,
    /// What the sweep made when this backend was built removed, until a `cleanup_stale`
    /// reports it.
    swept_at_build: Arc<std::sync::Mutex<sandbox_core::sandbox::StaleCleanup>>,
}

/// Whether the process's zygote clones a spare init ahead of the next create, when a command
/// finishes and when a sandbox is torn down (default: on; it saves the next create ~0.3 ms
/// of clone). Process-wide, like the zygote. A process that creates one sandbox and exits
/// (the CLI's `run`) turns it off: the spare would be cloned, then killed, for nobody.
pub fn spare_inits(on: bool) {
    spawn::set_spares(on);
}

/// Declares that this process creates one sandbox, runs it and exits (the CLI's `run`):
/// nothing is prepared for a later sandbox. No spare init is cloned (as with
/// `spare_inits(false)`) and no root-filesystem template is built: the sandbox's init builds
/// its root itself (the classic setup, as for specs with their own mounts), which for a single
/// sandbox costs less than building a template and then cloning it. A sandbox's teardown
/// (one without an egress link) kills its processes and then leaves the rest to the
/// process's zygote, which waits for the sandbox's end, removes its cgroups and state
/// record and releases its uid range while this process exits (a `destroy` returns once
/// everything is killed, not once it is gone). Process-wide and for the rest of the
/// process; isolation and limits are unchanged. Call it before the first create, in a
/// process that exits after its sandbox: it reaps none of its sandboxes' inits (whoever
/// reaps the process's orphans does).
pub fn one_shot_process() {
    spawn::set_one_shot();
}

/// Whether a spec brings its own root filesystem (a directory or an image) instead of the
/// host-tools view: its root is an overlay whose upper layer is the sandbox's.
pub(crate) fn own_root(spec: &SandboxSpec) -> bool {
    spec.rootfs.is_some() || spec.image.is_some()
}

/// The cgroup (and state record) name of sandbox `id`: tagged with our pid, so leftovers of a
/// dead process can be told from other processes' live sandboxes.
fn cgroup_name(id: &str) -> String {
    format!("asb-{}-{id}", std::process::id())
}

/// A sandbox's state record in [`ContainerConfig::state_dir`], named like its cgroups
/// (`asb-<owner pid>-<id>`): its init's pid (first line), its cgroup directories (a line
/// each), and the start times (clock ticks after boot) of its owner and its init (a line
/// `start <owner> <init>`), so that [`ContainerBackend::cleanup_stale`] never takes a process
/// that reused either pid for them. Records of older versions have no `start` line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StateRecord {
    init: i32,
    dirs: Vec<PathBuf>,
    owner_start: Option<u64>,
    init_start: Option<u64>,
}

impl StateRecord {
    /// The record of a new sandbox of this process, whose init is `init`.
    fn new(init: i32, dirs: Vec<PathBuf>) -> StateRecord {
        static OWNER_START: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
        let start = |p: u32| cgroup::stale::proc_start(p).map(|(_, t)| t);
        StateRecord {
            init,
            dirs,
            owner_start: *OWNER_START.get_or_init(|| start(std::process::id())),
            init_start: u32::try_from(init).ok().and_then(start),
        }
    }

    fn parse(text: &str) -> Option<StateRecord> {
        let mut lines = text.lines();
        let init = lines.next()?.trim().parse().ok()?;
        let mut rec = StateRecord {
            init,
            dirs: Vec::new(),
            owner_start: None,
            init_start: None,
        };
        for l in lines {
            match l.strip_prefix("start ") {
                Some(t) => {
                    let mut t = t.split_whitespace().map(|v| v.parse::<u64>().ok());
                    rec.owner_start = t.next().flatten();
                    rec.init_start = t.next().flatten();
                }
                None if !l.is_empty() => rec.dirs.push(PathBuf::from(l)),
                None => {}
            }
        }
        Some(rec)
    }

    fn render(&self) -> String {
        let mut s = format!("{}\n", self.init);
        for d in &self.dirs {
            s.push_str(&format!("{}\n", d.display()));
        }
        if let (Some(o), Some(i)) = (self.owner_start, self.init_start) {
            s.push_str(&format!("start {o} {i}\n"));
        }
        s
    }
}

/// The hierarchy of sandbox cgroup directory `dir`, as [`cgroup::stale::tear_down`] names
/// them: `freezer` (v1), `unified` (v2) or another v1 controller.
fn cgroup_hierarchy(dir: &std::path::Path) -> String {
    if dir.join("freezer.state").exists() {
        "freezer".into()
    } else if dir.join("cgroup.freeze").exists() {
        "unified".into()
    } else {
        "other".into()
    }
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

impl ContainerBackend {
    /// Starts a builder (every setting at its default).
    pub fn builder() -> ContainerBackendBuilder {
        ContainerBackendBuilder::default()
    }

    /// The configuration.
    pub fn config(&self) -> &ContainerConfig {
        &self.cfg
    }

    /// The cgroup version sandboxes use here, if any.
    pub fn cgroup_version(&self) -> Option<CgroupVersion> {
        self.host.version()
    }

    /// Whether sandboxes are created rootless (the caller is not root).
    pub fn rootless(&self) -> bool {
        !is_root()
    }

    /// Whether we can make cgroups. Checked (`access(2)` on each controller's directory, ~15
    /// µs apiece here; on v2 also the controllers for the caller's cgroup's children, see
    /// `cgroup::delegation::delegate_v2`) until it first holds; should the permission go later, each
    /// create's cgroup job fails with the `mkdir` error instead.
    fn cgroups_usable(&self) -> std::result::Result<(), cgroup::CgroupError> {
        if self.cgroups_ok.load(Ordering::Relaxed) {
            return Ok(());
        }
        let r = self.host.usable().map(|_| ());
        if r.is_ok() {
            self.cgroups_ok.store(true, Ordering::Relaxed);
        }
        r
    }

    /// Removes what crashed processes left behind: for every record in the state directory
    /// whose owner (the process named in the record's name, `asb-<pid>-<id>`) is gone, its
    /// sandbox (thawed first if it was paused or frozen for a snapshot: see
    /// [`Backend::cleanup_stale_report`]) and its cgroup directories. Returns how many
    /// records were cleaned.
    pub fn cleanup_stale(&self) -> usize {
        self.cleanup_stale_records().removed
    }

    /// [`ContainerBackend::cleanup_stale`], saying which sandboxes were thawed.
    fn cleanup_stale_records(&self) -> sandbox_core::sandbox::StaleCleanup {
        let mut out = sandbox_core::sandbox::StaleCleanup::default();
        let Some(dir) = &self.cfg.state_dir else {
            return out;
        };
        let Ok(rd) = std::fs::read_dir(dir) else {
            return out;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(owner) = cgroup::stale::owner_of(&name) else {
                continue;
            };
            let Ok(text) = std::fs::read_to_string(e.path()) else {
                continue;
            };
            let Some(rec) = StateRecord::parse(&text) else {
                continue;
            };
            // Its own cgroup directories (the record's name is theirs).
            let dirs: Vec<PathBuf> = rec
                .dirs
                .iter()
                .filter(|p| p.file_name().is_some_and(|f| f.to_string_lossy() == name))
                .cloned()
                .collect();
            // Live while its owner is: a paused sandbox's processes still run (frozen), and
            // a sandbox whose processes ended may still be its owner's.
            let gone = match rec.owner_start {
                Some(t) => cgroup::stale::proc_start(owner)
                    .is_none_or(|(st, now)| now != t || matches!(st, 'Z' | 'X')),
                None => cgroup::stale::owner_gone(owner, &dirs),
            } && owner != std::process::id();
            if !gone {
                continue;
            }
            if dirs.is_empty() {
                // No cgroups: its init (whose pid may have been reused) goes if it is still
                // the one recorded.
                let same = |p: i32| {
                    let u = u32::try_from(p).unwrap_or(0);
                    match rec.init_start {
                        Some(t) => cgroup::stale::proc_start(u).is_some_and(|(_, now)| now == t),
                        None => std::fs::read_link(format!("/proc/{p}/exe"))
                            .is_ok_and(|e| e.to_string_lossy().contains("agent-sandbox-init")),
                    }
                };
                if same(rec.init) {
                    // SAFETY: kill(2) of the abandoned sandbox's init, checked just above.
                    unsafe { libc::kill(rec.init, libc::SIGKILL) };
                }
            } else {
                let hierarchies: Vec<(String, PathBuf)> = dirs
                    .iter()
                    .map(|d| (cgroup_hierarchy(d), d.clone()))
                    .collect();
                let (_, thawed) = cgroup::stale::tear_down(&hierarchies);
                if thawed {
                    out.thawed.push(name.clone());
                }
            }
            let _ = std::fs::remove_file(e.path());
            out.removed += 1;
        }
        out
    }

    /// The probe: the host's checks, then (with `smoke`) a real smoke test. Without it, the
    /// status says available when the checks pass (see [`Backend::preflight`]).
    async fn probe_status(&self, smoke: bool) -> TierStatus {
        let mut details = std::collections::BTreeMap::new();
        let root = is_root();
        details.insert(
            "mode".to_string(),
            if root { "root" } else { "rootless" }.to_string(),
        );
        let uname = nix::sys::utsname::uname().ok();
        if let Some(u) = &uname {
            details.insert("kernel".into(), u.release().to_string_lossy().into_owned());
        }
        let max_userns = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        let cgroups = self.cgroups_usable();
        details.insert(
            "cgroup".into(),
            match self.host.version() {
                Some(CgroupVersion::V1) => "v1".into(),
                Some(CgroupVersion::V2) => {
                    let mut v = match self.host.delegation() {
                        Some(cgroup::Delegation::MovedInto(leaf)) => {
                            format!("v2 (this process moved into {})", leaf.display())
                        }
                        _ => "v2".into(),
                    };
                    if self.host.v2_without_limits() {
                        v.push_str(", not offered memory and pids: those limits are not enforced");
                    }
                    v
                }
                None => "none".into(),
            },
        );
        details.insert("seccomp".into(), seccomp::available().to_string());
        details.insert(
            "landlock_abi".into(),
            self.landlock_abi.map_or("none".into(), |a| a.to_string()),
        );
        let with = |mut s: TierStatus| {
            s.details = details.clone();
            s
        };
        if max_userns == Some(0) {
            return with(TierStatus::unavailable(
                TIER,
                "user namespaces are disabled (user.max_user_namespaces = 0)",
                "sysctl -w user.max_user_namespaces=15000",
            ));
        }
        if let Err(e) = spawn::image() {
            return with(TierStatus::unavailable(
                TIER,
                e.to_string(),
                "check that memfd_create and exec from memfd are allowed (vm.memfd_noexec = 0)",
            ));
        }
        if !seccomp::available() && self.cfg.seccomp {
            return with(TierStatus::unavailable(
                TIER,
                "the kernel has no seccomp",
                "use a kernel built with CONFIG_SECCOMP_FILTER",
            ));
        }
        if let (Err(reason), true) = (cgroups, self.cfg.require_cgroups) {
            return with(TierStatus::unavailable(
                TIER,
                reason.to_string(),
                "run as root, or delegate a cgroup (v1: in each of memory, pids, cpu; v2: with memory and pids \
                 controllers) to this user and start the process inside it",
            ));
        }
        let summary = |details: &std::collections::BTreeMap<String, String>| {
            format!(
                "namespaces + cgroup {} + seccomp + landlock {} ({})",
                details.get("cgroup").map_or("?", |s| s.as_str()),
                details.get("landlock_abi").map_or("?", |s| s.as_str()),
                if root { "root" } else { "rootless" }
            )
        };
        if !smoke {
            let mut s = TierStatus::available(TIER, summary(&details));
            s.details = details;
            return s;
        }
        // A real smoke test, bounded.
        let spec = SandboxSpec::new(Language::Shell);
        let started = Instant::now();
        let smoke = async {
            let sb = self.create_sandbox(&spec, ResolvedSecrets::none()).await?;
            let r =
                sandbox_core::Sandbox::exec(&sb, sandbox_core::ExecRequest::argv(["/bin/true"]))
                    .await?;
            sandbox_core::Sandbox::destroy(&sb).await?;
            Ok::<_, Error>(r)
        };
        match tokio::time::timeout(std::time::Duration::from_secs(10), smoke).await {
            Ok(Ok(r)) if r.success() => {
                details.insert("smoke_test_us".into(), started.elapsed().as_micros().to_string());
                let mut s = TierStatus::available(TIER, summary(&details));
                s.details = details;
                s
            }
            Ok(Ok(r)) => with(TierStatus::unavailable(
                TIER,
                format!("smoke test `/bin/true` failed: exit {:?}, {}", r.exit_code, r.stderr_str().trim()),
                "check that /usr/bin is readable and the sandbox can exec host binaries",
            )),
            Ok(Err(e)) => with(TierStatus::unavailable(
                TIER,
                format!("smoke test failed: {e}"),
                "check that user namespaces (also for this uid), pivot_root and tmpfs/proc mounts work: \
                 `unshare --user --map-root-user --mount --pid --fork true`",
            )),
            Err(_) => with(TierStatus::unavailable(TIER, "smoke test timed out after 10 s", "check the host's load and kernel logs")),
        }
    }
}

#[async_trait]
impl Backend for ContainerBackend {
    fn tier(&self) -> Tier {
        TIER
    }

    fn capabilities(&self) -> Capabilities {
        let mut network = vec![NetworkMode::DenyAll];
        if self.cfg.egress.is_some() {
            network.extend([NetworkMode::Allowlist, NetworkMode::Internet]);
        }
        let freezer = match self.host.version() {
            Some(CgroupVersion::V1) => self.host.v1().iter().any(|(c, _)| c == "freezer"),
            Some(CgroupVersion::V2) => true,
            None => false,
        };
        let cgroups = self.cgroups_usable().is_ok();
        // rlimits (CPU seconds, open files), the supervisor (wall time, output, lifetime) and
        // the capped tmpfs mounts (disk) hold whatever the cgroups do.
        let mut limits = vec![
            LimitKind::WallTime,
            LimitKind::CpuTime,
            LimitKind::Output,
            LimitKind::Disk,
            LimitKind::OpenFiles,
            LimitKind::Lifetime,
        ];
        // Memory, pids and the CPU quota are cgroup limits: not enforced without a usable
        // cgroup (`require_cgroups(false)`), nor on a v2 host not offering those controllers.
        if cgroups && !self.host.v2_without_limits() {
            limits.extend([LimitKind::Memory, LimitKind::Pids, LimitKind::CpuShare]);
        }
        limits.sort();
        let mut c = Capabilities::new(TIER);
        c.languages = vec![
            Language::Python,
            Language::Shell,
            Language::Node,
            Language::Javascript,
            Language::C,
        ];
        c.argv = true;
        c.snapshots = vec![SnapshotKind::Filesystem];
        c.network = network;
        c.pause_resume = freezer && cgroups;
        c.streaming = true;
        c.persistent_state = true;
        c.images = true;
        // An image brings its own interpreters; the same languages run from it.
        c.image_languages = c.languages.clone();
        // The egress enforcer's proxy holds secrets; the sandbox gets placeholders.
        c.proxy_secrets = self.cfg.egress.is_some();
        c.limits = limits;
        c.processes = true;
        c.publish = true;
        c.tty = true;
        // CPU time and memory from the sandbox's cgroup (the memory controller is needed).
        c.usage = cgroups && !self.host.v2_without_limits();
        // From the host, with inotify on the workspace (`sandbox_core::watch`).
        c.watch = true;
        c.workspace_alias = true;
        c
    }

    async fn probe(&self) -> TierStatus {
        self.probe_status(true).await
    }

    /// The probe's checks without its smoke test: the create is the test.
    async fn preflight(&self) -> TierStatus {
        self.probe_status(false).await
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(self.create_sandbox(spec, secrets).await?))
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
        if !m.kinds.contains(&SnapshotKind::Filesystem) {
            return Err(sandbox_core::SnapshotError::Incompatible {
                id: id.clone(),
                reason: "not a filesystem snapshot".into(),
            }
            .into());
        }
        let tar = store.artifact(id, "workspace.tar").await?;
        let mut spec = m.spec.clone();
        // A snapshot of a host-directory workspace restores into a fresh one: restoring must
        // never write into a host directory.
        if matches!(spec.workspace, Workspace::HostDir { .. }) {
            spec.workspace = Workspace::Empty;
        }
        let upper = if own_root(&spec) {
            Some(store.artifact(id, "upper.tar").await?)
        } else {
            None
        };
        let mut t = TimelineRecorder::start();
        let mut sb = self.create_inner(&spec, secrets, upper.as_deref()).await?;
        let ws = sb.inner.workspace_fd()?;
        files_unpack(&sb, &ws, &tar)?;
        t.mark(Phase::Restore);
        sb.timeline.extend(&t.finish());
        Ok(Box::new(sb))
    }

    /// The records of the state directory whose owners are gone
    /// ([`ContainerBackend::cleanup_stale`]), then the cgroups named after dead processes
    /// (which building a backend also sweeps). Counts records and cgroup directories.
    async fn cleanup_stale(&self) -> Result<usize> {
        Ok(self.cleanup_stale_report().await?.removed)
    }

    /// [`Backend::cleanup_stale`], naming the sandbox cgroups (`asb-<owner pid>-<id>`) that
    /// were frozen (paused, or frozen for a snapshot, when their owner died) and were thawed
    /// to be killed. What building this backend swept is counted in its first report.
    async fn cleanup_stale_report(&self) -> Result<sandbox_core::sandbox::StaleCleanup> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut out = me
                .swept_at_build
                .lock()
                .map(|mut s| std::mem::take(&mut *s))
                .unwrap_or_default();
            out.merge(me.cleanup_stale_records());
            out.merge(me.host.sweep_orphans());
            out.thawed.sort();
            out.thawed.dedup();
            out
        })
        .await
        .map_err(|e| Error::backend_caused(TIER, "the cleanup task", e))
    }
}

fn files_unpack(sb: &ContainerSandbox, ws: &std::os::fd::OwnedFd, tar: &[u8]) -> Result<()> {
    use std::os::fd::AsFd;
    let _ids = files::FsIds::switch(sb.inner.owner());
    files::unpack(ws.as_fd(), tar, sb.inner.owner())
}

#[cfg(test)]
mod state_record_tests {
    use super::*;

    #[test]
    fn state_records_round_trip_and_old_ones_parse() {
        let rec = StateRecord {
            init: 42,
            dirs: vec![
                PathBuf::from("/sys/fs/cgroup/pids/asb-7-x"),
                PathBuf::from("/sys/fs/cgroup/freezer/asb-7-x"),
            ],
            owner_start: Some(100),
            init_start: Some(123),
        };
        assert_eq!(StateRecord::parse(&rec.render()), Some(rec.clone()));
        // An older version's record: pid and directories only.
        let old = "42\n/sys/fs/cgroup/pids/asb-7-x\n/sys/fs/cgroup/freezer/asb-7-x\n";
        assert_eq!(
            StateRecord::parse(old),
            Some(StateRecord {
                owner_start: None,
                init_start: None,
                ..rec
            })
        );
        assert_eq!(StateRecord::parse("not a pid\n"), None);
        // A new record of this process knows both start times.
        let me = StateRecord::new(i32::try_from(std::process::id()).unwrap(), Vec::new());
        assert!(me.owner_start.is_some() && me.owner_start == me.init_start);
    }

    #[test]
    fn a_uid_base_must_leave_room_for_every_slot() {
        // Room for 4,096 ranges of 65,536 ids but not for all of SLOTS.
        let base = u32::try_from(u64::from(u32::MAX) - 8192 * 65536).unwrap();
        let e = ContainerBackend::builder()
            .uid_base(base)
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("uid_base") && e.contains(&SLOTS.to_string()),
            "{e}"
        );
        assert!(ContainerBackend::builder().uid_base(0).build().is_err());
    }
}
