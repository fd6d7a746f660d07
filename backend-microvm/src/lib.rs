//! # backend-microvm — tier 4: our own KVM microVM monitor
//!
//! A sandbox of this tier is a **Linux guest behind hardware virtualization**: its own kernel
//! (Debian's, or one you give), booted in a virtual machine that our own monitor (VMM) runs
//! with KVM, with our guest agent as `/init`. Code in the guest shares nothing with the host
//! kernel but the KVM interface; this is the tier for public multi-tenant agents and for
//! anything that needs a kernel of its own. Firecracker is the model; the difference is that
//! the monitor is a library: `cargo add` and no VMM binary to install.
//!
//! [`MicrovmBackend`] implements [`sandbox_core::Backend`]; the parts it is made of are public
//! modules, usable on their own: [`vmm`] (the monitor on the rust-vmm crates: guest RAM, vCPU
//! threads, serial, virtio-mmio console, read-only block and net devices, snapshots, a pool
//! of VMs made ahead), [`boot`] + [`acpi`] (the Linux boot protocol and the tables that
//! describe the devices), [`guest`] (kernel extraction, our initramfs, the install cache),
//! [`agent_client`] (the agent's protocol over the virtio-console), [`network`] (the TAP
//! bridged to the egress enforcer's link) and [`probe`] (what this host's KVM can run).
//!
//! The VMM runs **in-process, contained**: every guest-reachable path validates what it reads
//! and returns errors instead of panicking, each VMM thread runs under `catch_unwind` and a
//! thread-scoped [`seccomp`] filter, and a hostile guest ends its own VM with a typed
//! [`vmm::VmExit`], never the host process. Snapshots save every vCPU, device and (sparse)
//! memory page; restores map memory copy-on-write, and later sandboxes of a kind start from
//! the first one's boot ([`MicrovmConfig::boot_snapshots`]), each with a fresh identity.
//!
//! ```text
//! agent-sandbox install microvm-guest                 # Debian's linux-image-amd64
//! agent-sandbox install microvm-guest --kernel vmlinux [--modules /lib/modules/VER] [--dir DIR]
//! ```
//!
//! On nested, PVM-style KVM hosts guest kernel mode is emulated and Linux cannot boot: the
//! probe says so, `create` is [`Error::Unavailable`] at once and `--tier auto` never picks
//! the tier.
//!
//! `docs/microvm.md` in the repository is the design: how it works and isolates, the agent
//! channel, capabilities and limits tables, network and proxy-held secrets, images,
//! snapshots, the probe, installing the guest and your own kernel, configuration and known
//! limits; `docs/microvm-network.md` and `docs/microvm-snapshots.md` go deeper;
//! `docs/threat-model.md` places the tier among the others.

mod sandbox;
mod stale;

pub mod acpi;
pub mod agent_client;
pub mod boot;
pub mod devices;
pub mod guest;
pub mod layout;
pub mod network;
pub mod probe;
pub mod seccomp;
pub mod vmm;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sandbox_core::egress::EgressEnforcer;
use sandbox_core::{
    Backend, Capabilities, Error, Language, LimitKind, NetworkMode, ResolvedSecrets, Result,
    Sandbox, SandboxSpec, SnapshotId, SnapshotKind, SnapshotStore, Tier, TierStatus,
};

pub use sandbox::MicrovmSandbox;
pub use sandbox_image::ImageStore;

use crate::guest::install::{self, Verify};
use crate::guest::GuestError;

const TIER: Tier = Tier::Microvm;

/// The command that installs the guest artifacts, named (with the Rust call that does the
/// same, [`guest::install::install`]) by every fix for a missing or unusable guest.
pub const INSTALL_FIX: &str = "agent-sandbox install microvm-guest";

/// The fix for a guest missing from `dir` (`None`: the default cache), for library users and
/// for the command line alike.
fn install_fix(dir: Option<&std::path::Path>) -> String {
    match dir {
        None => format!(
            "from Rust, call backend_microvm::guest::install::install(&InstallOptions::debian()); \
             from a shell, run `{INSTALL_FIX}`"
        ),
        Some(d) => format!(
            "from Rust, call backend_microvm::guest::install::install with InstallOptions {{ dir: \
             {d:?}.into(), ..InstallOptions::debian() }}; from a shell, run `{INSTALL_FIX} --dir {}`",
            d.display()
        ),
    }
}
/// Default time from starting the kernel to the agent's `Ready`.
pub const DEFAULT_BOOT_TIMEOUT: Duration = Duration::from_secs(20);
/// Default VMs made ahead per memory size and vCPU count ([`MicrovmConfig::pool_size`]).
pub const DEFAULT_POOL_SIZE: usize = 2;
/// The smallest guest RAM a Linux guest is given (the spec's `limits.memory_bytes` must be at
/// least this).
pub const MIN_GUEST_MEMORY: u64 = 32 << 20;

/// Where the guest kernel and initramfs come from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GuestSource {
    /// A cache prepared by `agent-sandbox install microvm-guest` ([`guest::install`]).
    Installed {
        /// The cache directory.
        dir: PathBuf,
    },
    /// Explicit files: an uncompressed `vmlinux` ELF and an initramfs (cpio newc) holding this
    /// library's agent as `/init`.
    Files {
        /// The kernel.
        kernel: PathBuf,
        /// The initramfs.
        initramfs: PathBuf,
    },
}

/// Settings of the microVM backend (see [`MicrovmBackend::builder`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MicrovmConfig {
    /// Guest kernel and initramfs.
    pub guest: GuestSource,
    /// vCPUs per VM (1-32).
    pub vcpus: u8,
    /// How long the guest may take from kernel start to agent ready.
    pub boot_timeout: Duration,
    /// The kernel command line.
    pub cmdline: String,
    /// Boot once, then start from a snapshot: the first sandbox of a kind (guest files,
    /// command line, memory, vCPUs, image) boots and is snapshotted as soon as its agent is
    /// ready; later ones restore that snapshot copy-on-write, each with its own identity
    /// (default on). See `docs/microvm-snapshots.md`.
    pub boot_snapshots: bool,
    /// VMs made ahead of time (KVM's VM, irqchip, PIT and vCPUs; no guest memory) per memory
    /// size and vCPU count, taken by starts from a boot snapshot and by restores, and
    /// refilled in the background (default 2; 0: none).
    pub pool_size: usize,
}

impl Default for MicrovmConfig {
    fn default() -> Self {
        MicrovmConfig {
            guest: GuestSource::Installed {
                dir: install::default_cache_dir(),
            },
            vcpus: 1,
            boot_timeout: DEFAULT_BOOT_TIMEOUT,
            cmdline: boot::DEFAULT_CMDLINE.to_string(),
            boot_snapshots: true,
            pool_size: DEFAULT_POOL_SIZE,
        }
    }
}

impl MicrovmConfig {
    /// The default settings (as [`Default`]; for code outside this crate, which cannot name
    /// the fields of this growing struct in a literal).
    pub fn new() -> Self {
        Self::default()
    }
}

/// Builder for [`MicrovmBackend`].
#[derive(Debug, Clone, Default)]
pub struct MicrovmBackendBuilder {
    config: MicrovmConfig,
    kernel: Option<PathBuf>,
    initramfs: Option<PathBuf>,
    dir: Option<PathBuf>,
    images: Option<ImageStore>,
    egress: Option<Arc<dyn EgressEnforcer>>,
}

impl MicrovmBackendBuilder {
    /// Uses the guest cache in `dir` (default: [`guest::install::default_cache_dir`]).
    pub fn guest_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// Boots this kernel (an uncompressed `vmlinux` ELF) instead of the cached one; needs
    /// [`initramfs`](Self::initramfs) too.
    pub fn kernel(mut self, path: impl Into<PathBuf>) -> Self {
        self.kernel = Some(path.into());
        self
    }

    /// Uses this initramfs (with this library's agent as `/init`) instead of the cached one;
    /// needs [`kernel`](Self::kernel) too.
    pub fn initramfs(mut self, path: impl Into<PathBuf>) -> Self {
        self.initramfs = Some(path.into());
        self
    }

    /// vCPUs per VM (default 1).
    pub fn vcpus(mut self, n: u8) -> Self {
        self.config.vcpus = n;
        self
    }

    /// Time from kernel start to agent ready before `create` gives up (default 20 s).
    pub fn boot_timeout(mut self, d: Duration) -> Self {
        self.config.boot_timeout = d;
        self
    }

    /// Replaces the kernel command line (default [`boot::DEFAULT_CMDLINE`]).
    pub fn cmdline(mut self, cmdline: impl Into<String>) -> Self {
        self.config.cmdline = cmdline.into();
        self
    }

    /// Boot once, then start from a snapshot (default on): see
    /// [`MicrovmConfig::boot_snapshots`]. Off, every sandbox boots its kernel.
    pub fn boot_snapshots(mut self, on: bool) -> Self {
        self.config.boot_snapshots = on;
        self
    }

    /// VMs made ahead of time per memory size and vCPU count (default
    /// [`DEFAULT_POOL_SIZE`]; 0: none): see [`MicrovmConfig::pool_size`].
    pub fn pool_size(mut self, n: usize) -> Self {
        self.config.pool_size = n;
        self
    }

    /// Pulls and caches images in `store` (default: [`ImageStore::shared_default`], opened on
    /// the first sandbox with an image).
    pub fn image_store(mut self, store: ImageStore) -> Self {
        self.images = Some(store);
        self
    }

    /// Plugs in the egress enforcer that gives sandboxes with a policy other than deny-all
    /// their path out: the guest's virtio-net device on a TAP bridged to the enforcer's link
    /// (see [`network`]). Without one, only deny-all is offered (no network device at all).
    pub fn egress(mut self, enforcer: Arc<dyn EgressEnforcer>) -> Self {
        self.egress = Some(enforcer);
        self
    }

    /// Checks the settings and builds the backend (nothing on the host is touched).
    pub fn build(self) -> Result<MicrovmBackend> {
        let mut config = self.config;
        config.guest = match (self.kernel, self.initramfs, self.dir) {
            (Some(kernel), Some(initramfs), None) => GuestSource::Files { kernel, initramfs },
            (None, None, Some(dir)) => GuestSource::Installed { dir },
            (None, None, None) => config.guest,
            (Some(_), None, _) | (None, Some(_), _) => {
                return Err(Error::invalid(
                    "microvm.guest",
                    "give both a kernel and an initramfs, or neither",
                ))
            }
            (Some(_), Some(_), Some(_)) => {
                return Err(Error::invalid(
                    "microvm.guest",
                    "give either a guest cache directory or kernel + initramfs files, not both",
                ))
            }
        };
        if !(1..=32).contains(&config.vcpus) {
            return Err(Error::invalid("microvm.vcpus", "must be between 1 and 32"));
        }
        if config.boot_timeout.is_zero() {
            return Err(Error::invalid("microvm.boot_timeout", "must be positive"));
        }
        if config.cmdline.contains('\0') || config.cmdline.len() >= layout::CMDLINE_MAX {
            return Err(Error::invalid(
                "microvm.cmdline",
                format!("must be under {} bytes, without NUL", layout::CMDLINE_MAX),
            ));
        }
        if config.pool_size > MAX_POOL_SIZE {
            return Err(Error::invalid(
                "microvm.pool_size",
                format!("at most {MAX_POOL_SIZE} VMs made ahead"),
            ));
        }
        Ok(MicrovmBackend::with(config, self.images, self.egress))
    }
}

/// Most VMs made ahead per memory size and vCPU count.
pub const MAX_POOL_SIZE: usize = 64;

/// The microVM backend: one KVM VM per sandbox, booting a Linux guest with our agent.
///
/// Clones share the boot snapshots and the pool of VMs made ahead
/// ([`MicrovmConfig::boot_snapshots`]); they are released when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct MicrovmBackend {
    config: Arc<MicrovmConfig>,
    images: Option<ImageStore>,
    /// The egress enforcer for policies other than deny-all, if any.
    egress: Option<Arc<dyn EgressEnforcer>>,
    /// Boot snapshots, unpacked snapshots and VMs made ahead.
    warm: Arc<sandbox::warm::WarmStarts>,
}

/// The guest files a VM boots.
#[derive(Debug, Clone)]
pub(crate) struct GuestFiles {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// The kernel release, when known (from the install manifest).
    pub kernel_version: Option<String>,
    /// Whether the files were verified by an install manifest (else the initramfs is checked
    /// for the agent before booting).
    pub installed: bool,
}

impl MicrovmBackend {
    fn with(
        config: MicrovmConfig,
        images: Option<ImageStore>,
        egress: Option<Arc<dyn EgressEnforcer>>,
    ) -> Self {
        let warm = sandbox::warm::WarmStarts::new(
            config.boot_snapshots,
            config.pool_size.min(MAX_POOL_SIZE),
        );
        MicrovmBackend {
            config: Arc::new(config),
            images,
            egress,
            warm: Arc::new(warm),
        }
    }

    /// Starts a builder (every setting at its default: the installed guest in the default
    /// cache directory, 1 vCPU).
    pub fn builder() -> MicrovmBackendBuilder {
        MicrovmBackendBuilder::default()
    }

    /// The settings.
    pub fn config(&self) -> &MicrovmConfig {
        &self.config
    }

    /// The image store: the configured one, else the process's default.
    pub(crate) fn image_store(&self) -> Result<ImageStore> {
        match &self.images {
            Some(s) => Ok(s.clone()),
            None => ImageStore::shared_default().map_err(|e| e.into_core(TIER)),
        }
    }

    /// The engine string recorded in snapshots: the VMM version and its snapshot format.
    pub fn engine() -> String {
        format!(
            "agent-sandbox-microvm {} (snapshot format {})",
            env!("CARGO_PKG_VERSION"),
            vmm::vm::SNAPSHOT_FORMAT_VERSION
        )
    }

    /// KVM must run Linux guests here: the probe's verdict as an error.
    pub(crate) fn check_kvm() -> Result<probe::KvmProbe> {
        let p = probe::probe_kvm();
        if p.linux_guests_supported() {
            Ok(p)
        } else {
            Err(Error::Unavailable {
                tier: TIER,
                reason: p.reason.clone(),
                fix: p
                    .fix
                    .clone()
                    .unwrap_or_else(|| "run on a host with hardware virtualization".into()),
            })
        }
    }

    /// The guest artifacts, checked (sizes; the install verified checksums).
    pub(crate) fn guest_files(&self) -> Result<GuestFiles> {
        match &self.config.guest {
            GuestSource::Installed { dir } => match install::load(dir, Verify::Sizes) {
                Ok(a) => Ok(GuestFiles {
                    kernel: a.vmlinux,
                    initramfs: a.initramfs,
                    kernel_version: a.manifest.kernel_version,
                    installed: true,
                }),
                Err(e @ GuestError::NotInstalled { .. }) => Err(Error::Unavailable {
                    tier: TIER,
                    reason: format!("the microVM guest (kernel + initramfs) is not installed: {e}"),
                    fix: if *dir == install::default_cache_dir() {
                        install_fix(None)
                    } else {
                        install_fix(Some(dir))
                    },
                }),
                Err(e) => Err(Error::Unavailable {
                    tier: TIER,
                    reason: format!("the microVM guest in {} is unusable: {e}", dir.display()),
                    fix: format!(
                        "prepare it again: {}",
                        install_fix(
                            (*dir != install::default_cache_dir()).then_some(dir.as_path())
                        )
                    ),
                }),
            },
            GuestSource::Files { kernel, initramfs } => {
                for (what, p) in [("kernel", kernel), ("initramfs", initramfs)] {
                    if !p.is_file() {
                        return Err(Error::Unavailable {
                            tier: TIER,
                            reason: format!("the configured guest {what} {} does not exist", p.display()),
                            fix: format!(
                                "point the backend at an existing {what} (MicrovmBackendBuilder::kernel, ::initramfs), or use the installed guest ({})",
                                install_fix(None)
                            ),
                        });
                    }
                }
                check_vmlinux(kernel)?;
                Ok(GuestFiles {
                    kernel: kernel.clone(),
                    initramfs: initramfs.clone(),
                    kernel_version: None,
                    installed: false,
                })
            }
        }
    }

    fn status(&self) -> TierStatus {
        let p = probe::probe_kvm();
        let mut details: Vec<(String, String)> = Vec::new();
        if let Some(u) = p.user_loop {
            details.push(("kvm.user_loop".into(), format!("{u:?}")));
        }
        if let Some(k) = p.kernel_loop {
            details.push(("kvm.kernel_loop".into(), format!("{k:?}")));
        }
        for d in &p.details {
            match d.split_once(": ") {
                Some((k, v)) => details.push((format!("kvm.{k}"), v.to_string())),
                None => details.push(("kvm".into(), d.clone())),
            }
        }
        let guest = match &self.config.guest {
            GuestSource::Installed { dir } => dir.display().to_string(),
            GuestSource::Files { kernel, initramfs } => {
                format!("{} + {}", kernel.display(), initramfs.display())
            }
        };
        details.push(("guest".into(), guest));
        // The guest is checked even where KVM cannot run it, so `probe` names every problem.
        let files = self.guest_files();
        details.push((
            "guest.status".into(),
            match &files {
                Ok(g) => format!(
                    "ready (kernel {})",
                    g.kernel_version.as_deref().unwrap_or("given by path")
                ),
                Err(Error::Unavailable { reason, fix, .. }) => format!("{reason}; fix: {fix}"),
                Err(e) => e.to_string(),
            },
        ));
        let status = if !p.linux_guests_supported() {
            TierStatus::unavailable(
                TIER,
                p.reason.clone(),
                p.fix
                    .clone()
                    .unwrap_or_else(|| "run on a host with hardware virtualization".into()),
            )
        } else {
            match files {
                Ok(g) => TierStatus::available(
                    TIER,
                    format!(
                        "hardware KVM; guest kernel {}",
                        g.kernel_version
                            .unwrap_or_else(|| g.kernel.display().to_string())
                    ),
                ),
                Err(Error::Unavailable { reason, fix, .. }) => {
                    TierStatus::unavailable(TIER, reason, fix)
                }
                Err(e) => TierStatus::unavailable(TIER, e.to_string(), INSTALL_FIX),
            }
        };
        details
            .into_iter()
            .fold(status, |s, (k, v)| s.with_detail(k, v))
    }
}

/// Refuses a kernel file that is not an x86-64 ELF (a bzImage must be extracted first).
fn check_vmlinux(kernel: &Path) -> Result<()> {
    use std::io::Read;
    let mut head = [0u8; 64];
    let n = std::fs::File::open(kernel)
        .and_then(|mut f| f.read(&mut head))
        .map_err(|e| Error::io_path("read", kernel, e))?;
    if head.get(..n).unwrap_or_default().starts_with(b"\x7fELF") {
        return Ok(());
    }
    Err(Error::Unavailable {
        tier: TIER,
        reason: format!(
            "the configured guest kernel {} is not an uncompressed vmlinux ELF",
            kernel.display()
        ),
        fix: format!(
            "{INSTALL_FIX} --kernel {} (extracts vmlinux from a bzImage)",
            kernel.display()
        ),
    })
}

#[async_trait]
impl Backend for MicrovmBackend {
    fn tier(&self) -> Tier {
        TIER
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::new(TIER);
        // The initramfs we build has busybox and our agent: shell, and any program given as
        // argv. No Python, Node or compiler in the guest unless an image brings them.
        c.languages = vec![Language::Shell];
        c.argv = true;
        // An image becomes the guest's root (a read-only ext4 disk under a writable overlay):
        // its own interpreters run code.
        c.images = true;
        c.image_languages = vec![
            Language::Python,
            Language::Shell,
            Language::Node,
            Language::Javascript,
        ];
        c.snapshots = vec![SnapshotKind::FullMemory, SnapshotKind::Filesystem];
        // Other policies through the egress enforcer, when one is plugged in (the guest's
        // network device exists only for them).
        c.network = vec![NetworkMode::DenyAll];
        if self.egress.is_some() {
            c.network
                .extend([NetworkMode::Allowlist, NetworkMode::Internet]);
        }
        // Proxy-held secrets ride on that network: the enforcer's proxy holds them, the agent
        // puts its CA in the guest's certificate bundles.
        c.proxy_secrets = self.egress.is_some();
        c.pause_resume = true;
        c.streaming = true;
        c.persistent_state = true;
        // Through the guest agent: background processes (flow-controlled output), terminals
        // from the guest's /dev/pts, and published ports (connections the agent opens to the
        // guest's loopback: no network device needed).
        c.processes = true;
        c.tty = true;
        c.publish = true;
        // inotify in the guest, relayed by the agent.
        c.watch = true;
        // The guest's RAM is the memory limit; the agent enforces wall time and output, the
        // VMM the lifetime. CPU time, pids, open files and disk (`disk_bytes`) are bounded by
        // the VM as a whole (its vCPUs and RAM), not per command: not listed.
        c.limits = vec![
            LimitKind::WallTime,
            LimitKind::Memory,
            LimitKind::Output,
            LimitKind::Lifetime,
        ];
        c
    }

    async fn probe(&self) -> TierStatus {
        let this = self.clone();
        match tokio::task::spawn_blocking(move || this.status()).await {
            Ok(s) => s,
            Err(e) => TierStatus::unavailable(TIER, format!("probe panicked: {e}"), "report a bug"),
        }
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(MicrovmSandbox::create(self, spec, secrets).await?))
    }

    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(
            MicrovmSandbox::restore(self, store, id, secrets).await?,
        ))
    }

    /// The snapshot files (boot snapshots, snapshots being written, unpacked ones) of
    /// processes that died with microVM sandboxes: their VMs, paused or not, died with them
    /// (the monitor runs in-process), so nothing is ever thawed here. Counts the
    /// per-process directories removed (see `docs/microvm-snapshots.md`).
    async fn cleanup_stale(&self) -> Result<usize> {
        tokio::task::spawn_blocking(|| stale::sweep(&std::env::temp_dir()).removed)
            .await
            .map_err(|e| Error::backend_caused(TIER, "the cleanup task", e))
    }
}
