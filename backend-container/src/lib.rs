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
//! let backend = ContainerBackend::new()?;
//! let spec = SandboxSpec::builder(Language::Python).memory_mib(256).build()?;
//! let sb = backend.create(&spec, ResolvedSecrets::none()).await?;
//! let r = sb.exec(ExecRequest::code("print(2 + 2)")).await?;
//! assert_eq!(r.stdout_str(), "4\n");
//! sb.destroy().await?;
//! # Ok(()) }
//! ```
//!
//! ## Configuring
//!
//! [`ContainerBackend::builder`] sets the backend-wide options ([`ContainerConfig`]): a
//! state directory for [`ContainerBackend::cleanup_stale`], the host name, the uid range
//! used as root, whether cgroups are required, seccomp and Landlock on or off, and the
//! [`EgressEnforcer`] that allowlisted network policies need ([`network`]; without one only
//! deny-all is accepted). Per sandbox, the [`SandboxSpec`] gives the language, workspace
//! (a private tmpfs or a host directory), mounts, environment, secrets, [`Limits`](sandbox_core::Limits)
//! and network policy; its [`rootfs`](SandboxSpec::rootfs) replaces the default view of the
//! host's `/usr` ([`RootfsMode::HostTools`]) with a root filesystem directory (a Debian tree,
//! an unpacked OCI image) under a throwaway overlay.
//!
//! ## Requirements
//!
//! - Linux with user namespaces (`user.max_user_namespaces` > 0), `pivot_root` and
//!   tmpfs/proc mounts inside them, and exec from a sealed memfd (`vm.memfd_noexec` = 0).
//! - seccomp (`CONFIG_SECCOMP_FILTER`), unless the filter is turned off; Landlock is used
//!   when the kernel has it.
//! - cgroups for memory, pids and CPU limits and pause/resume: as root, nothing to do; rootless,
//!   a cgroup delegated to the user (v1: `memory`, `pids`, `cpu`; v2: with the `memory` and
//!   `pids` controllers) that the process starts in, or `require_cgroups(false)` to run
//!   without those limits.
//! - Root or not: as root each sandbox gets a private uid range and commands run as an
//!   unprivileged user; rootless, the caller's uid is root inside with every capability
//!   dropped.
//!
//! [`ContainerBackend::probe`](sandbox_core::Backend::probe) checks all of this with a real
//! smoke test and says what to fix.
//!
//! ## More
//!
//! `docs/container.md` in the repository is the design: how the init, its zygote and execs
//! work, the root filesystem, the cgroup v1/v2 handling and delegation, how each limit is
//! enforced, rootless vs root, the seccomp filter and Landlock rules, and the threat model
//! with its gaps. `docs/network.md` covers the egress path.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use sandbox_core::{
    Backend, Capabilities, EgressEnforcer, Error, IsolationBoundary, Language, NetworkMode, Phase,
    ResolvedSecrets, Result, Sandbox, SandboxSpec, SnapshotId, SnapshotKind, SnapshotStore, Tier,
    TierStatus, TimelineRecorder, Workspace,
};

mod cgroup;
mod ctl;
mod files;
mod landlock;
pub mod network;
#[path = "../init/proto.rs"]
#[allow(missing_docs, clippy::all)]
mod proto;
mod rootfs;
mod sandbox;
pub mod seccomp;
mod spawn;

pub use cgroup::CgroupVersion;
pub use sandbox::ContainerSandbox;

use crate::sandbox::{Inner, ENGINE, TIER};
use crate::spawn::IdMap;

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
pub struct ContainerConfig {
    /// Where a small record of each live sandbox (init pid, cgroup directories) is kept, so
    /// [`ContainerBackend::cleanup_stale`] can remove what a crashed process left. `None`:
    /// no record.
    pub state_dir: Option<PathBuf>,
    /// Root filesystem mode.
    pub rootfs: RootfsMode,
    /// The sandbox's host name.
    pub hostname: String,
    /// As root: the first host uid/gid of the ranges mapped into sandboxes (65536 per
    /// sandbox, 4096 slots).
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
        }
    }
}

/// Builder for [`ContainerBackend`].
#[derive(Debug, Clone, Default)]
pub struct ContainerBuilder {
    cfg: ContainerConfig,
}

impl ContainerBuilder {
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
        if c.uid_base == 0 || u64::from(c.uid_base) + 4096 * 65536 > u64::from(u32::MAX) {
            return Err(Error::invalid(
                "uid_base",
                "must be positive and leave room for 4096 ranges of 65536",
            ));
        }
        if let Some(d) = &c.state_dir {
            std::fs::create_dir_all(d).map_err(|e| Error::io_path("create state dir", d, e))?;
        }
        let mut host = cgroup::CgroupHost::detect();
        if !self.cfg.require_cgroups {
            host.allow_v2_without_limits();
        }
        host.sweep_orphans();
        Ok(ContainerBackend {
            cfg: Arc::new(self.cfg),
            host,
            landlock_abi: landlock::abi(),
            bpf: Arc::new(seccomp::program_bytes()),
            slot: Arc::new(AtomicU64::new(0)),
            host_ops: Arc::new(std::sync::OnceLock::new()),
            cgroups_ok: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        })
    }
}

/// The container backend. Cheap to clone; sandboxes outlive nothing but their own handle.
#[derive(Debug, Clone)]
pub struct ContainerBackend {
    cfg: Arc<ContainerConfig>,
    host: cgroup::CgroupHost,
    landlock_abi: Option<u32>,
    bpf: Arc<Vec<u8>>,
    slot: Arc<AtomicU64>,
    host_ops: Arc<std::sync::OnceLock<Vec<proto::Op>>>,
    /// Set once the cgroup directories were found writable (see `cgroups_usable`).
    cgroups_ok: Arc<std::sync::atomic::AtomicBool>,
}

/// The cgroup (and state record) name of sandbox `id`: tagged with our pid, so leftovers of a
/// dead process can be told from other processes' live sandboxes.
fn cgroup_name(id: &str) -> String {
    format!("asb-{}-{id}", std::process::id())
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

impl ContainerBackend {
    /// A backend with the default configuration.
    pub fn new() -> Result<Self> {
        Self::builder().build()
    }

    /// Starts a builder.
    pub fn builder() -> ContainerBuilder {
        ContainerBuilder::default()
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
    fn cgroups_usable(&self) -> std::result::Result<(), String> {
        if self.cgroups_ok.load(Ordering::Relaxed) {
            return Ok(());
        }
        let r = self.host.usable().map(|_| ());
        if r.is_ok() {
            self.cgroups_ok.store(true, Ordering::Relaxed);
        }
        r
    }

    /// As root, a writable host-directory workspace owned by an unprivileged user (outside
    /// our uid ranges): the sandbox user becomes that user, so it can write its workspace.
    /// (A root-owned directory is never mapped: commands would own host root's files.)
    fn workspace_owner(&self, spec: &SandboxSpec) -> Option<(u32, u32)> {
        use std::os::unix::fs::MetadataExt;
        let Workspace::HostDir {
            path,
            read_only: false,
        } = &spec.workspace
        else {
            return None;
        };
        let md = std::fs::metadata(path).ok()?;
        let (lo, hi) = (
            u64::from(self.cfg.uid_base),
            u64::from(self.cfg.uid_base) + 4096 * 65536,
        );
        let ours = |id: u32| (lo..hi).contains(&u64::from(id));
        (md.uid() != 0 && md.gid() != 0 && !ours(md.uid()) && !ours(md.gid()))
            .then(|| (md.uid(), md.gid()))
    }

    /// Checks `spec` against this backend; returns the egress enforcer its network needs and
    /// whether sandboxes get cgroups (see `cgroups_usable`).
    fn check_spec(&self, spec: &SandboxSpec) -> Result<(Option<Arc<dyn EgressEnforcer>>, bool)> {
        spec.validate()?;
        if spec.language == Language::Wasm {
            return Err(Error::unsupported(
                TIER,
                "the wasm language (use the wasm tier)",
            ));
        }
        let enforcer =
            sandbox_core::egress::enforcer_for(TIER, self.cfg.egress.as_ref(), &spec.network)?;
        rootfs::check_mounts(spec)?;
        // Always asked, and before the first create starts this process's zygote: on v2
        // it may move this process into a leaf cgroup, which must hold all of ours.
        let cgroups = self.cgroups_usable();
        if self.cfg.require_cgroups {
            cgroups.clone().map_err(|reason| Error::Unavailable {
                tier: TIER,
                reason,
                fix: "run as root, or delegate a cgroup to this user (chown its directory and cgroup.procs \
                      in each controller and start the process inside it), or build the backend with \
                      require_cgroups(false) to run without memory/pids limits"
                    .into(),
            })?;
        }
        Ok((enforcer, cgroups.is_ok()))
    }

    /// Creates a sandbox and returns the concrete type (for [`ContainerSandbox::init_pid`]).
    pub async fn create_container(&self, spec: &SandboxSpec) -> Result<ContainerSandbox> {
        self.create_sandbox(spec, ResolvedSecrets::none()).await
    }

    async fn create_sandbox(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<ContainerSandbox> {
        self.create_inner(spec, secrets, None).await
    }

    /// Creates a sandbox; `upper` (a snapshot's `upper.tar`, rootfs-directory mode) is
    /// unpacked into the overlay's upper layer before the overlay is mounted.
    async fn create_inner(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
        upper: Option<&[u8]>,
    ) -> Result<ContainerSandbox> {
        let (enforcer, with_cgroups) = self.check_spec(spec)?;
        let mut t = TimelineRecorder::start();
        let id = uuid::Uuid::new_v4().simple().to_string();
        let rootless = !is_root();
        let ids = if rootless {
            IdMap {
                host_root: nix::unistd::geteuid().as_raw(),
                host_root_gid: nix::unistd::getegid().as_raw(),
                count: 1,
                rootless: true,
                user_override: None,
            }
        } else {
            let slot = u32::try_from(self.slot.fetch_add(1, Ordering::Relaxed) % 4096).unwrap_or(0);
            let base = self.cfg.uid_base + slot * 65536;
            IdMap {
                host_root: base,
                host_root_gid: base,
                count: 65536,
                rootless: false,
                // Rootfs mode runs commands as root inside: a host-directory workspace is
                // not mapped to its owner then.
                user_override: if spec.rootfs.is_some() {
                    None
                } else {
                    self.workspace_owner(spec)
                },
            }
        };
        // A rootfs directory is an image: commands run as its root (uid 0 inside, with no
        // capabilities, like rootless mode), which owns its files through the idmapping.
        let stay_root = rootless || spec.rootfs.is_some();
        let user = if stay_root { 0 } else { spawn::SANDBOX_USER };
        // The plan and the seal are ready before the init starts: both are queued behind the
        // bootstrap, and the init runs them in order, stopping at the first failure.
        let egress = match enforcer {
            Some(e) => {
                let plan = e.prepare(&id, &spec.network)?;
                Some((e, plan))
            }
            None => None,
        };
        // From here on, a failed create must give the prepared link back.
        let release = EgressRelease(egress.as_ref().map(|(e, _)| (e.clone(), id.clone())));
        let resolv = egress
            .as_ref()
            .map(|(_, plan)| plan.resolv_conf.clone())
            .unwrap_or_else(|| network::DEFAULT_RESOLV_CONF.to_string());
        // As root, a host-tools root without spec mounts or an egress link (whose
        // `resolv.conf` is the sandbox's own) starts from a template (see
        // `rootfs::template_ops`), built once per process for each set of `/etc` files.
        // A host-directory workspace reaches a template-mode init as a detached mount made
        // here, from our current view (see `rootfs::template_fits`); if we cannot make one,
        // the classic setup binds the directory instead.
        let mut ws_tree = None;
        let mut fits = !rootless && egress.is_none() && rootfs::template_fits(spec);
        if let (true, Workspace::HostDir { path, .. }) = (fits, &spec.workspace) {
            match path.canonicalize().and_then(|p| spawn::detached_tree(&p)) {
                Ok(t) => ws_tree = Some(t),
                Err(_) => fits = false,
            }
        }
        let template = if fits {
            spawn::template_root(rootfs::etc_files(user, &self.cfg.hostname, &resolv))
        } else {
            None
        };
        if template.is_none() {
            ws_tree = None;
        }
        // The init makes its namespaces (~0.5 ms; a spare has them already) while we plan
        // its setup.
        let starting = spawn::start_init(true, template.is_some(), &ids)
            .await
            .map_err(|e| Error::backend(TIER, e))?;
        let planned = (|| {
            let plan = rootfs::Plan {
                spec,
                user,
                hostname: &self.cfg.hostname,
                resolv_conf: &resolv,
                caps: rootfs::tmpfs_caps(spec),
                landlock: if self.cfg.landlock {
                    self.landlock_abi
                } else {
                    None
                },
                host: if spec.rootfs.is_some() {
                    &[]
                } else {
                    self.host_ops.get_or_init(rootfs::host_ops)
                },
                // As root the library brings `lo` up meanwhile (see `network::loopback_up`),
                // unless the init (a spare) did so while it waited.
                loopback: rootless,
            };
            let ops = match &template {
                Some(root) => rootfs::template_plan(&plan, root)?,
                None => rootfs::plan(&plan)?,
            };
            let enc = |ops: &[proto::Op]| {
                let mut e = proto::Enc::default();
                e.ops(ops);
                e.0
            };
            let seal = enc(&rootfs::seal_ops(
                self.cfg.seccomp.then_some(self.bpf.as_slice()),
            ));
            // Queued behind the bootstrap: everything, or (restoring an upper layer) only the
            // preparation; the rest follows once the upper layer is filled.
            let (queued, later): (Vec<Vec<u8>>, Vec<Vec<u8>>) = match upper {
                Some(_) if spec.rootfs.is_some() => {
                    (vec![enc(&ops.prep)], vec![enc(&ops.main), seal])
                }
                _ => (vec![enc(&ops.all()), seal], Vec::new()),
            };
            let lower = match (&spec.rootfs, rootless) {
                (Some(r), false) => Some(
                    r.canonicalize()
                        .map_err(|e| Error::io_path("resolve the rootfs directory", r, e))?,
                ),
                _ => None,
            };
            Ok((queued, later, lower))
        })();
        let (queued, later, lower): (Vec<Vec<u8>>, Vec<Vec<u8>>, Option<std::path::PathBuf>) =
            match planned {
                Ok(p) => p,
                Err(e) => {
                    spawn::abandon(starting);
                    return Err(e);
                }
            };
        // The cgroups are made in parallel with the init's start-up (the job is ~0.3 ms),
        // started once the setup is planned so the init gets a CPU first (on 2 CPUs a third
        // busy thread delayed its start). The init joins them itself (see `spawn::CgroupJob`
        // for why) before it starts anything.
        let cg_job = {
            let host = self.host.clone();
            let (name, limits) = (cgroup_name(&id), spec.limits.clone());
            tokio::task::spawn_blocking(move || {
                if !with_cgroups {
                    return Ok(None);
                }
                let c = host
                    .create(&name, &limits)
                    .map_err(|e| format!("create the sandbox cgroup: {e}"))?;
                let mut files = Vec::new();
                for p in c.join_files() {
                    match std::fs::OpenOptions::new().write(true).open(&p) {
                        Ok(f) => files.push(std::os::fd::OwnedFd::from(f)),
                        Err(e) => {
                            c.remove(std::time::Duration::from_millis(500));
                            return Err(format!("open {}: {e}", p.display()));
                        }
                    }
                }
                Ok(Some((c, files)))
            })
        };
        let requests: Vec<&[u8]> = queued.iter().map(Vec::as_slice).collect();
        let spawned =
            spawn::spawn_init(starting, &ids, &requests, lower.as_deref(), ws_tree, cg_job)
                .await
                .map_err(|e| Error::backend(TIER, e))?;
        let (pid, ctl, cgroup) = (spawned.pid, spawned.ctl, spawned.cgroup);
        let lo = (!rootless && !spawned.lo_up).then(|| network::loopback_up(pid));
        if lower.is_some() && !spawned.idmapped {
            tracing::warn!(sandbox = %id, "rootfs directory used without idmapping");
        }
        t.mark(Phase::Allocation);
        let gone = || std::io::Error::new(std::io::ErrorKind::BrokenPipe, "sandbox init is gone");
        let mut ids_used: Vec<u64> = spawned.queued.iter().map(|(i, _)| *i).collect();
        let done = async {
            let wait = |mut rx: tokio::sync::mpsc::UnboundedReceiver<ctl::Reply>| async move {
                let r = rx
                    .recv()
                    .await
                    .ok_or_else(gone)
                    .map_err(|e| Error::io("set up the sandbox", e))?;
                check_reply(&r, "set up the sandbox")
            };
            for (_, rx) in spawned.queued {
                wait(rx).await?;
            }
            if !later.is_empty() {
                if let Some(tar) = upper {
                    restore_upper(pid, tar, &ids, user)?;
                }
                for next in &later {
                    let (rid, rx) = ctl.register();
                    ids_used.push(rid);
                    ctl.send(proto::MSG_SETUP, rid, next, &[])
                        .await
                        .map_err(|e| Error::io("set up the sandbox", e))?;
                    wait(rx).await?;
                }
            }
            Ok::<(), Error>(())
        };
        let mut done = done.await;
        if let (Ok(()), Some(lo)) = (&done, lo) {
            done = match lo.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(Error::io("bring up the sandbox's loopback interface", e)),
                Err(_) => Err(Error::backend(TIER, "the loopback thread vanished")),
            };
        }
        for rid in ids_used {
            ctl.unregister(rid);
        }
        if let Err(e) = done {
            spawn::reap(pid, true);
            if let Some(c) = &cgroup {
                c.remove(std::time::Duration::from_millis(500));
            }
            return Err(e);
        }
        let mut env = spec.base_env();
        for (k, v) in secrets.env() {
            env.insert(k.to_string(), v.to_string());
        }
        env.entry("PATH".into()).or_insert_with(|| {
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()
        });
        env.insert("HOME".into(), "/workspace".into());
        env.entry("LANG".into()).or_insert_with(|| "C.UTF-8".into());
        if let Some((_, plan)) = &egress {
            for (k, v) in &plan.env {
                env.insert(k.clone(), v.clone());
            }
        }
        let state_file = self
            .cfg
            .state_dir
            .as_ref()
            .map(|d| d.join(cgroup_name(&id)));
        let inner = Arc::new(Inner {
            id: id.clone(),
            spec: spec.clone(),
            env,
            redactor: secrets.redactor(),
            born: Instant::now(),
            gone: Default::default(),
            gone_reason: Mutex::new(String::new()),
            pid,
            ctl,
            cgroup,
            ids,
            user,
            stay_root,
            egress: egress.as_ref().map(|(e, _)| e.clone()),
            state_file,
            terminated: Mutex::new(false),
            timer: Mutex::new(None),
            paused: Default::default(),
        });
        // From here on, dropping `sb` tears everything down.
        let mut sb = ContainerSandbox {
            inner,
            timeline: Default::default(),
        };
        if let Some(f) = &sb.inner.state_file {
            let mut rec = format!("{pid}\n");
            if let Some(c) = &sb.inner.cgroup {
                for d in c.dirs() {
                    rec.push_str(&format!("{}\n", d.display()));
                }
            }
            std::fs::write(f, rec).map_err(|e| Error::io_path("write state record", f, e))?;
        }
        t.mark(Phase::Filesystem);

        // The sandbox owns the link now: its teardown detaches it.
        release.disarm();
        if let Some((e, plan)) = &egress {
            e.attach(plan, pid).await?;
            t.mark(Phase::Network);
        }

        t.mark(Phase::Runtime);
        sb.timeline = t.finish();

        // Lifetime: destroy the sandbox when it runs out, even if nobody calls it.
        let weak = Arc::downgrade(&sb.inner);
        let life = spec.limits.lifetime();
        let timer = tokio::spawn(async move {
            tokio::time::sleep(life).await;
            if let Some(inner) = weak.upgrade() {
                let _ =
                    tokio::task::spawn_blocking(move || inner.terminate("lifetime limit reached"))
                        .await;
            }
        });
        if let Ok(mut t) = sb.inner.timer.lock() {
            *t = Some(timer.abort_handle());
        }
        Ok(sb)
    }

    /// Removes what crashed processes left behind: for every record in the state directory
    /// whose init is gone, its cgroup directories. Returns how many records were cleaned.
    pub fn cleanup_stale(&self) -> usize {
        let Some(dir) = &self.cfg.state_dir else {
            return 0;
        };
        let Ok(rd) = std::fs::read_dir(dir) else {
            return 0;
        };
        let mut n = 0;
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with("asb-") {
                continue;
            }
            let Ok(rec) = std::fs::read_to_string(e.path()) else {
                continue;
            };
            let mut lines = rec.lines();
            let Some(pid) = lines.next().and_then(|p| p.parse::<i32>().ok()) else {
                continue;
            };
            let dirs: Vec<PathBuf> = lines.map(PathBuf::from).collect();
            // Live: its cgroups still hold processes (the init dies when its process does),
            // or, without cgroups, its init still runs.
            let live = if dirs.is_empty() {
                std::fs::read_link(format!("/proc/{pid}/exe"))
                    .is_ok_and(|e| e.to_string_lossy().contains("agent-sandbox-init"))
            } else {
                dirs.iter().any(|d| {
                    std::fs::read_to_string(d.join("cgroup.procs"))
                        .is_ok_and(|p| !p.trim().is_empty())
                })
            };
            if live {
                continue;
            }
            for p in dirs {
                if p.file_name().is_some_and(|f| f.to_string_lossy() == name) {
                    if let Ok(sub) = std::fs::read_dir(&p) {
                        for s in sub.flatten() {
                            if s.file_type().is_ok_and(|t| t.is_dir()) {
                                cgroup::kill_procs(&s.path());
                                let _ = std::fs::remove_dir(s.path());
                            }
                        }
                    }
                    cgroup::kill_procs(&p);
                    let _ = std::fs::remove_dir(&p);
                }
            }
            let _ = std::fs::remove_file(e.path());
            n += 1;
        }
        n
    }

    async fn probe_status(&self) -> TierStatus {
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
                e,
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
                reason,
                "run as root, or delegate a cgroup (v1: in each of memory, pids, cpu; v2: with memory and pids \
                 controllers) to this user and start the process inside it",
            ));
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
                let mut s = TierStatus::available(
                    TIER,
                    format!(
                        "namespaces + cgroup {} + seccomp + landlock {} ({})",
                        details.get("cgroup").map_or("?", |s| s.as_str()),
                        details.get("landlock_abi").map_or("?", |s| s.as_str()),
                        if root { "root" } else { "rootless" }
                    ),
                );
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

fn check_reply(r: &ctl::Reply, what: &str) -> Result<()> {
    match r.kind {
        proto::REP_OK => Ok(()),
        proto::REP_ERR => {
            let mut d = proto::Dec::new(&r.payload);
            let _ = d.u32();
            let errno = d.i32().unwrap_or(0);
            let msg = d.str().unwrap_or_default();
            if errno == libc::ENOSPC || errno == libc::ENOMEM {
                return Err(Error::ResourceExhausted {
                    what: format!("{what}: {msg}"),
                });
            }
            Err(Error::backend(TIER, format!("{what}: {msg}")))
        }
        k => Err(Error::backend(
            TIER,
            format!("{what}: unexpected reply {k}"),
        )),
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
        Capabilities {
            tier: TIER,
            languages: vec![
                Language::Python,
                Language::Shell,
                Language::Node,
                Language::Javascript,
                Language::C,
            ],
            argv: true,
            boundary: IsolationBoundary::SharedKernel,
            snapshots: vec![SnapshotKind::Filesystem],
            network,
            pause_resume: freezer && self.cgroups_usable().is_ok(),
            streaming: true,
            persistent_state: true,
        }
    }

    async fn probe(&self) -> TierStatus {
        self.probe_status().await
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
        let upper = if spec.rootfs.is_some() {
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

    /// The records of the state directory whose sandboxes are gone
    /// ([`ContainerBackend::cleanup_stale`]), then the cgroups named after dead processes
    /// (which building a backend also sweeps). Counts records and cgroup directories.
    async fn cleanup_stale(&self) -> Result<usize> {
        Ok(ContainerBackend::cleanup_stale(self) + self.host.sweep_orphans())
    }
}

/// Unpacks a snapshot's `upper.tar` into the overlay upper layer the init keeps open (before
/// the overlay is mounted), as the sandbox's root.
fn restore_upper(pid: libc::pid_t, tar: &[u8], ids: &IdMap, user: u32) -> Result<()> {
    use std::os::fd::AsRawFd;
    let p = format!("/proc/{pid}/fd/{}", proto::UPPER_FD);
    let dir = std::fs::File::open(&p).map_err(|e| Error::io(format!("open {p}"), e))?;
    let owner = (!ids.rootless).then(|| files::Owner {
        uid: ids.host_uid(user),
        gid: ids.host_gid(user),
    });
    let _ids = files::FsIds::switch(owner);
    files::unpack_upper(dir.as_raw_fd(), tar, owner)
}

fn files_unpack(sb: &ContainerSandbox, ws: &std::os::fd::OwnedFd, tar: &[u8]) -> Result<()> {
    use std::os::fd::AsRawFd;
    let _ids = files::FsIds::switch(sb.inner.owner());
    files::unpack(ws.as_raw_fd(), tar, sb.inner.owner())
}

/// Gives a prepared egress link back if a create fails before the sandbox owns it.
struct EgressRelease(Option<(Arc<dyn EgressEnforcer>, String)>);

impl EgressRelease {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for EgressRelease {
    fn drop(&mut self) {
        if let Some((e, id)) = self.0.take() {
            e.detach_in_background(&id);
        }
    }
}
