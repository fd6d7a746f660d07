//! # backend-microvm — tier 4: our own KVM microVM monitor
//!
//! A sandbox of this tier is a **Linux guest behind hardware virtualization**: its own kernel
//! (Debian's, or one you give), booted in a virtual machine that our own monitor (VMM) runs
//! with KVM, with our guest agent as `/init`. Code in the guest shares nothing with the host
//! kernel but the KVM interface; this is the tier for public multi-tenant agents and for
//! anything that needs a kernel of its own. Firecracker is the model (and the numbers to
//! beat); the difference is that the monitor is a library: `cargo add` and no VMM binary to
//! install.
//!
//! [`MicrovmBackend`] implements [`sandbox_core::Backend`]; the parts it is made of are public
//! modules, usable on their own:
//!
//! - [`vmm`]: the monitor on the rust-vmm crates (`kvm-ioctls`, `vm-memory`, `linux-loader`,
//!   `vm-superio`): memfd-backed guest RAM, vCPU threads, an 8250 serial console, a virtio-mmio
//!   transport with a virtio-console device, a read-only virtio-blk device (an image's
//!   root disk) and a virtio-net device on a TAP (`docs/microvm-network.md`), KVM's
//!   in-kernel irqchip and PIT, snapshot/restore, VMs made ahead of time ([`vmm::VmPool`]).
//! - [`boot`] + [`acpi`]: the Linux 64-bit boot protocol (vmlinux ELF, `boot_params`, e820,
//!   command line, initrd) and the ACPI tables (RSDP, XSDT, FADT, MADT, DSDT) that describe
//!   the virtio-mmio devices: Debian's kernel has no `virtio_mmio.device=` command-line
//!   devices, so ACPI is how it finds them (as with Firecracker and cloud-hypervisor).
//! - [`guest`]: kernel extraction (bzImage with an xz payload → `vmlinux`), the initramfs we
//!   build (cpio newc: the agent as `/init`, static busybox, the virtio modules), and the
//!   cache [`guest::install`] prepares.
//! - [`agent_client`]: the host side of the agent's framed protocol (exec with streamed
//!   output, files, ping, shutdown).
//! - [`probe`]: what this host's KVM can really do, measured.
//!
//! ## The monitor runs in-process, contained
//! There is no external VMM binary and no fork from the caller's (threaded, async) process:
//! a VM is a set of threads of the library user's process (one per vCPU, one for device
//! I/O). A crash or a hostile guest must still not take that process down, so every path the
//! guest can reach (exit decoding, port and MMIO accesses, virtqueue parsing) validates what
//! it reads, uses checked arithmetic on guest addresses and returns errors instead of
//! panicking; each VMM thread runs under `catch_unwind` and under a **thread-scoped seccomp
//! filter** allowing only the syscalls and ioctls its loop needs ([`seccomp`]); guest memory
//! is bounded by the spec. A guest that triple-faults, spins, floods the serial port or
//! writes garbage into a virtqueue ends that VM with a typed [`vmm::VmExit`]; other VMs and
//! the host process carry on. A wall-clock deadline (the spec's `lifetime_ms`) kills the VM
//! from the host side whatever the guest does.
//!
//! ## The agent channel: virtio-console
//! The host talks to the guest agent over **one virtio-console port** (`/dev/hvc0` in the
//! guest, put in raw mode by the agent) on the virtio-mmio transport. One byte stream is all
//! the framed protocol needs (it multiplexes concurrent requests by id), and the device model
//! is far smaller than virtio-vsock's (no connection state machine, no credit accounting):
//! less guest-reachable code in the host process. The host end is one side of a Unix
//! socketpair, so [`agent_client::AgentClient`] is plain blocking stream code; the backend
//! calls it on tokio's blocking pool. The agent runs every command with exactly the
//! environment the host sends (the spec's `env`, its secrets, and `PATH`/`HOME`/`LANG`
//! defaults), in `/workspace` (a tmpfs in the guest), kills a command's process group at its
//! timeout and caps the output it forwards; the host caps and redacts again.
//!
//! ## Snapshots
//! [`Sandbox::snapshot`] pauses the vCPUs and saves every
//! vCPU's state (registers, special registers, FPU/XSAVE, XCRs, debug registers, MSRs,
//! LAPIC, pending events), the VM's (irqchip, PIT, KVM clock), the devices' (serial,
//! virtio transport and queues) and guest memory. The VMM writes a versioned JSON state file
//! (`vm-state.json`, format [`vmm::vm::SNAPSHOT_FORMAT_VERSION`]) and a sparse memory file;
//! the sandbox stores them in the [`SnapshotStore`] as two
//! artifacts, `vm-state.json` and `memory.extents` (only the non-zero pages, as
//! offset/length/bytes runs: a guest that touched 40 MiB of 512 stores 40). The manifest's
//! engine string names the VMM version and the snapshot format version; metadata records the
//! memory size, vCPU count and agent build. Restore writes the memory back as a sparse file
//! (once per snapshot: the file is kept for its next restores), maps it **copy-on-write**
//! (`MAP_PRIVATE`) into a new VM (one made ahead of time when the pool has one), so restore
//! cost does not grow with memory size and copies share the pages none of them wrote, and
//! pings the agent: processes, files in `/workspace` and the guest
//! kernel's state continue exactly where they were. A snapshot from another format version,
//! another engine or of another memory size is refused with a typed error before anything
//! starts. The sandbox waits for its in-flight agent calls before it snapshots, so no request
//! is cut in half on the channel.
//!
//! Every sandbox, booted or restored, gets a fresh identity from the agent's `Refresh`
//! before it is handed out: its id as hostname, 64 bytes of this host's randomness mixed into
//! the guest's pool and its generator reseeded, and this host's wall clock. Copies restored
//! from one snapshot would otherwise share the snapshot's random state (the same "random"
//! keys and nonces in every copy), clock and name. Background processes are kept: the agent
//! holds its output while the VM is saved, the snapshot records them, and a restored copy's
//! client (whose request ids start after the snapshotted one's) adopts them and releases the
//! hold (docs/interactive.md). A snapshot is refused while a published port has open
//! connections.
//!
//! ## Boot once, start many
//! The first sandbox of a kind (kernel, initramfs, command line, memory, vCPUs, image disk)
//! boots, and is snapshotted the moment its agent is ready, before its identity and before
//! any command of its own; later sandboxes of that kind restore that snapshot instead of
//! booting, each given its own identity as above, their memory shared copy-on-write
//! ([`MicrovmConfig::boot_snapshots`], on by default; a copy with a network gets its own
//! link, and the agent moves `eth0` to it).
//! Restores take VMs made ahead of time from a pool ([`MicrovmConfig::pool_size`]). What
//! copies share and why that is safe: `docs/microvm-snapshots.md`.
//!
//! ## What this host can run
//! [`probe::probe_kvm`] runs the same tiny loop at CPL 3 and at CPL 0 in throwaway VMs (each
//! bounded by a deadline: the probe never hangs) and compares. On hosts with hardware
//! virtualization both take about as long and the tier is available (once the guest is
//! installed). On **nested, PVM-style KVM** (the `kvm_pvm` module, as on the machines this
//! project is developed on) guest user mode runs natively but guest kernel mode is emulated
//! at ~2 million instructions/s, and a stock Linux kernel never finishes booting; the probe
//! then reports *"Linux guests unsupported on this host: kernel mode is emulated"* with a fix,
//! `create` returns [`Error::Unavailable`] at once, and
//! `--tier auto` never picks this tier. Tiny freestanding guests that run in user mode still
//! work there: they are what the VMM's own test suite (`tests/tiny_guest.rs`,
//! `tests/adversarial.rs`) boots.
//!
//! The guest side is still checked on a real kernel there: `tests/qemu_guest.rs` boots the
//! installed Debian kernel with our initramfs under QEMU's software emulation (`microvm`
//! machine, its virtio-mmio console described by ACPI as ours is) and drives the agent over
//! the console with [`agent_client`]: module loading, `/dev/hvc0`, exec, files, streaming,
//! timeouts and shutdown. What only a hardware-KVM host shows is our VMM's own devices and
//! tables under Linux (`tests/linux_guest.rs`, `tests/backend.rs`: they skip here with the
//! probe's reason).
//!
//! ## Installing the guest
//! ```text
//! agent-sandbox install microvm-guest                 # Debian's linux-image-amd64 (apt-get download)
//! agent-sandbox install microvm-guest --kernel vmlinux [--modules /lib/modules/VER] [--dir DIR]
//! ```
//! prepares `vmlinux` and the initramfs (agent + busybox-static + the virtio modules) in
//! `$XDG_CACHE_HOME/agent-sandbox/microvm` (else `~/.cache/agent-sandbox/microvm`), each
//! file recorded with its size and SHA-256 in a manifest ([`guest::install`]). From Rust:
//! [`guest::install::install`].
//!
//! ## Your own kernel
//! `--kernel` takes an uncompressed `vmlinux` ELF or a bzImage with an xz payload (extracted),
//! for example Firecracker's CI kernels; a kernel with `virtio_mmio` and `virtio_console`
//! built in needs no modules. Or skip the cache and point the backend at files directly:
//! [`MicrovmBackend::builder`]`().kernel(path).initramfs(path)` (the kernel may then be a
//! `vmlinux` ELF or a bzImage, loaded as it is and entered at its 64-bit `startup_64`; the
//! initramfs must hold this library's agent as `/init`: build one with
//! [`guest::initramfs::build`]).
//!
//! ## Limits
//! `limits.memory_bytes` is the guest's RAM (at least 32 MiB); vCPUs come from the backend
//! configuration (default 1); `lifetime_ms` is the VM's wall-clock deadline; per-exec
//! `wall_time_ms` (or the request's shorter timeout) is enforced by the agent, which kills the
//! command's process group; `output_bytes` caps each stream. CPU time, pids, open files and
//! disk are bounded by the VM as a whole (its vCPUs and RAM), not per command. `/workspace`,
//! `/tmp` and `/dev/shm` are tmpfs mounts in guest RAM, which nothing can reclaim: the agent
//! caps them together at 5/8 of the RAM the kernel and initramfs left, and one inode per
//! 8 KiB of it (the policy of [`Limits::tmpfs_caps`](sandbox_core::Limits::tmpfs_caps);
//! `limits.disk_bytes` does not reach the guest), so a full disk is `ENOSPC` and not the
//! guest's OOM killer taking the agent (tested under QEMU).
//!
//! ## Network
//! Deny-all (the default) boots a guest without a network device. With an egress enforcer
//! plugged in ([`MicrovmBuilder::egress`]; the facade's `Runtime` plugs in the shared one),
//! allowlist and internet policies get a virtio-net device on a TAP in the sandbox's own
//! network namespace, bridged to the enforcer's link: the guest holds the sandbox's address,
//! its gateway is the proxy, and the enforcer's host-side rules police it as they do a
//! container's namespace ([`network`], `docs/microvm-network.md`). A snapshot of such a
//! sandbox records the guest's MAC; a restored copy gets a link, address and TAP of its own
//! (the snapshot's spec's policy) and the agent moves `eth0` to them (`Network`).
//!
//! **Proxy-held secrets** ([`SecretExposure::Proxy`](sandbox_core::SecretExposure::Proxy))
//! ride on that network: the backend asks the enforcer to `bind_secrets`
//! ([`GuestNetwork::bind_secrets`](network::GuestNetwork::bind_secrets)), each secret's
//! variable gets its placeholder, `SSL_CERT_FILE` and the other
//! [`CA_BUNDLE_VARS`](sandbox_core::egress::CA_BUNDLE_VARS) name `/etc/agent-sandbox-ca.crt`,
//! and right after the boot the agent writes the guest root's own system bundle plus the
//! proxy's interception CA there and over `/etc/ssl/certs/ca-certificates.crt`
//! (`Trust`; the host cannot read an image's bundle inside its disk, the agent can; a link
//! planted on the way is refused or replaced, never followed). Without an enforcer such a
//! spec is `Unsupported`, naming [`MicrovmBuilder::egress`].
//! Host directories (`Workspace::HostDir`, `mounts`, a `rootfs` directory) are not shared
//! into the guest: such specs are refused with `Unsupported`.
//!
//! ## Images
//! A spec with an [`image`](sandbox_core::SandboxSpec::image) boots with that image as the
//! guest's root: [`ImageStore::ensure`] finds or pulls it (the store from
//! [`MicrovmBuilder::image_store`], else [`ImageStore::shared_default`]),
//! [`ImageStore::rootfs_image`] makes its layers into a read-only ext4 file once per image,
//! the VM serves that file with its read-only virtio-blk device, and the kernel command line
//! gets `agent.root=/dev/vda` (and `agent.user=<uid>:<gid>` for an image whose `User` is not
//! root): the agent mounts the disk under a writable overlay in guest RAM and switches to it.
//! Commands get the image's `Env` under the spec's, its `WorkingDir`, and its own `python3`
//! or `node` for code strings ([`Capabilities::image_languages`]). Snapshots pin the image's
//! digest and the disk's identity. See `docs/images.md`.

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
pub struct MicrovmBuilder {
    config: MicrovmConfig,
    kernel: Option<PathBuf>,
    initramfs: Option<PathBuf>,
    dir: Option<PathBuf>,
    images: Option<ImageStore>,
    egress: Option<Arc<dyn EgressEnforcer>>,
}

impl MicrovmBuilder {
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

impl Default for MicrovmBackend {
    fn default() -> Self {
        Self::new()
    }
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
    /// The default backend: the installed guest in the default cache directory, 1 vCPU.
    pub fn new() -> Self {
        Self::with(MicrovmConfig::default(), None, None)
    }

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

    /// A builder for other settings.
    pub fn builder() -> MicrovmBuilder {
        MicrovmBuilder::default()
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
                                "point the backend at an existing {what} (MicrovmBuilder::kernel, ::initramfs), or use the installed guest ({})",
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
            .map_err(|e| Error::backend(TIER, format!("cleanup task failed: {e}")))
    }
}

/// Shared handle type for the facade.
pub fn backend(config: MicrovmConfig) -> Arc<dyn Backend> {
    Arc::new(MicrovmBackend::with(config, None, None))
}
