//! The VM: KVM setup, memory, devices, vCPU threads, the I/O thread, lifecycle and
//! snapshot/restore.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_config, kvm_pit_state2, KVM_IRQCHIP_IOAPIC,
    KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::serial::{
    OutputCallback, SerialDevice, SerialOutput, SerialSnapshot, SharedOutput,
};
use crate::devices::virtio::console::Console;
use crate::devices::virtio::mmio::{MmioTransport, TransportState};
use crate::layout;
use crate::vmm::bus::{Bus, SharedDevice};
use crate::vmm::cpu::{self, CpuMode};
use crate::vmm::error::{Result, VmmError};
use crate::vmm::memory::GuestRam;
use crate::vmm::vcpu::{self, Shared, VcpuContext, VcpuState, VmExit};

/// Version of the snapshot state format; a snapshot with another version is refused.
pub const SNAPSHOT_FORMAT_VERSION: u32 = 1;
/// File name of the state inside a snapshot directory.
pub const SNAPSHOT_STATE_FILE: &str = "vm-state.json";
/// File name of the memory inside a snapshot directory.
pub const SNAPSHOT_MEMORY_FILE: &str = "memory.bin";
/// Stack pointer for the Linux 64-bit entry (below the page tables, above boot_params).
const KERNEL_BOOT_STACK: u64 = 0x8ff0;
/// Per-vCPU stack size for user-mode tiny guests (stacks grow down from the top of RAM).
pub const USER_STACK_SIZE: u64 = 64 * 1024;

/// How to build a VM.
#[derive(Clone)]
pub struct VmConfig {
    /// Guest RAM in bytes (multiple of 4 KiB, at least 2 MiB).
    pub mem_size: u64,
    /// Number of vCPUs (1-32).
    pub vcpus: u8,
    /// Serial output kept at most (bytes); the rest is counted and dropped.
    pub serial_cap: usize,
    /// Optional callback that sees serial output as it is kept.
    pub serial_callback: Option<OutputCallback>,
    /// Attach a virtio-console (virtio-mmio device 0); its host end is
    /// [`Vm::take_console`].
    pub virtio_console: bool,
    /// Wall-clock limit from [`Vm::start`] (or restore): the VM is then killed with
    /// [`VmExit::DeadlineExceeded`].
    pub deadline: Option<Duration>,
    /// Run the vCPU and I/O threads under seccomp filters (default on).
    pub seccomp: bool,
    /// Create KVM's in-kernel irqchip and PIT when the host supports them (default on;
    /// Linux guests need them). Guests that take no interrupts (tiny guests) are faster to
    /// create, restore and drop without: the in-kernel devices cost several kernel-side
    /// synchronisations each way (on a loaded nested host ~0.3-5 ms at creation and
    /// 10-50 ms at teardown, against ~0.3 ms without).
    pub irqchip: bool,
}

impl std::fmt::Debug for VmConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmConfig")
            .field("mem_size", &self.mem_size)
            .field("vcpus", &self.vcpus)
            .field("serial_cap", &self.serial_cap)
            .field("virtio_console", &self.virtio_console)
            .field("deadline", &self.deadline)
            .field("seccomp", &self.seccomp)
            .field("irqchip", &self.irqchip)
            .finish_non_exhaustive()
    }
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            mem_size: 16 << 20,
            vcpus: 1,
            serial_cap: 1 << 20,
            serial_callback: None,
            virtio_console: false,
            deadline: None,
            seccomp: true,
            irqchip: true,
        }
    }
}

/// Where and how the vCPUs start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// CPL 3 tiny guest or CPL 0 Linux.
    pub mode: CpuMode,
    /// Entry point (guest-physical = virtual: memory is identity-mapped).
    pub rip: u64,
    /// User mode: passed in `rsi` (vCPU index in `rdi`, RAM size in `rdx`).
    /// Kernel mode: ignored (`rsi` = `layout::BOOT_PARAMS_ADDR`).
    pub arg: u64,
}

impl Entry {
    /// A user-mode (CPL 3) entry.
    pub fn user(rip: u64) -> Self {
        Entry {
            mode: CpuMode::User,
            rip,
            arg: 0,
        }
    }

    /// A Linux 64-bit boot protocol entry (CPL 0).
    pub fn kernel(rip: u64) -> Self {
        Entry {
            mode: CpuMode::Kernel,
            rip,
            arg: 0,
        }
    }
}

/// A virtio-mmio device as the guest must be told about it (ACPI `_CRS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioMmioInfo {
    /// MMIO window base.
    pub base: u64,
    /// MMIO window size.
    pub size: u64,
    /// GSI (IOAPIC pin), edge-triggered via irqfd.
    pub irq: u32,
    /// Virtio device type.
    pub device_type: u32,
}

/// What a snapshot wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// The state file.
    pub state_file: PathBuf,
    /// The memory file (sparse).
    pub memory_file: PathBuf,
    /// Non-zero memory bytes actually written.
    pub memory_bytes_written: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct IrqchipState {
    pic_master: kvm_irqchip,
    pic_slave: kvm_irqchip,
    ioapic: kvm_irqchip,
    pit: kvm_pit_state2,
    clock: Option<kvm_clock_data>,
}

/// The serialised state of a VM (besides memory).
#[derive(Debug, Serialize, Deserialize)]
struct VmState {
    format_version: u32,
    vmm_version: String,
    mem_size: u64,
    vcpu_count: u8,
    irqchip: Option<IrqchipState>,
    vcpus: Vec<VcpuState>,
    serial: SerialSnapshot,
    virtio: Vec<TransportState>,
    unhandled_io: u64,
}

/// What [`Vm::build`] takes from a snapshot.
struct Restoring<'a> {
    irqchip: bool,
    serial: &'a SerialSnapshot,
}

/// A microVM.
///
/// Created stopped ([`Vm::new`]); load a guest ([`Vm::load_elf`] or write memory through
/// [`Vm::memory`]), then [`Vm::start`]. Dropping a `Vm` kills it and joins its threads.
pub struct Vm {
    // Threads first: they are joined in `Drop` before anything else goes.
    threads: Threads,
    shared: Arc<Shared>,
    pending_vcpus: Vec<VcpuFd>,
    vcpu_tids: Arc<Vec<AtomicI32>>,
    serial: Arc<Mutex<SerialDevice>>,
    serial_out: SharedOutput,
    virtio: Vec<Arc<Mutex<MmioTransport>>>,
    virtio_info: Vec<VirtioMmioInfo>,
    console_host: Option<UnixStream>,
    pio: Bus,
    mmio: Bus,
    cfg: VmConfig,
    has_irqchip: bool,
    started: bool,
    // KVM handles before memory: the VM (and its memory slots) goes before the mappings.
    vm_fd: VmFd,
    kvm: Arc<Kvm>,
    ram: GuestRam,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm")
            .field("cfg", &self.cfg)
            .field("started", &self.started)
            .field("exit", &self.exit())
            .finish_non_exhaustive()
    }
}

fn open_kvm() -> Result<Kvm> {
    Kvm::new().map_err(|e| {
        let (reason, fix) = match e.errno() {
            libc::ENOENT => (
                "/dev/kvm does not exist".to_string(),
                "load the kvm module (kvm_intel or kvm_amd) or run on a host with hardware \
                 virtualization"
                    .to_string(),
            ),
            libc::EACCES | libc::EPERM => (
                "no permission to open /dev/kvm".to_string(),
                "add the user to the `kvm` group (or grant rw on /dev/kvm)".to_string(),
            ),
            _ => (
                format!("opening /dev/kvm: {e}"),
                "check the KVM setup".to_string(),
            ),
        };
        VmmError::KvmUnavailable { reason, fix }
    })
}

/// The process's `/dev/kvm` handle, opened once (system ioctls such as
/// `KVM_GET_SUPPORTED_CPUID` go through it; each VM has its own VM fd). A failed open is not
/// cached: the next VM tries again.
fn kvm_handle() -> Result<Arc<Kvm>> {
    static KVM: OnceLock<Arc<Kvm>> = OnceLock::new();
    if let Some(k) = KVM.get() {
        return Ok(k.clone());
    }
    let k = Arc::new(open_kvm()?);
    Ok(KVM.get_or_init(|| k).clone())
}

impl Vm {
    /// Creates a VM with fresh (zeroed, memfd-backed) RAM and its devices, not yet running.
    pub fn new(cfg: VmConfig) -> Result<Vm> {
        let ram = GuestRam::new_memfd(cfg.mem_size)?;
        Self::build(cfg, ram, None)
    }

    /// Builds a VM around `ram`: fresh when `restoring` is `None`, else with the snapshot's
    /// irqchip choice and serial registers (the caller then loads the rest of the state).
    fn build(cfg: VmConfig, ram: GuestRam, restoring: Option<Restoring<'_>>) -> Result<Vm> {
        let want_irqchip = restoring.as_ref().map(|r| r.irqchip);
        let serial_state = restoring.as_ref().map(|r| r.serial);
        if cfg.vcpus == 0 || cfg.vcpus > 32 {
            return Err(VmmError::InvalidConfig(format!(
                "vCPU count {} must be 1-32",
                cfg.vcpus
            )));
        }
        let sig = vcpu::kick_signal()?;
        let kvm = kvm_handle()?;
        // The threads start now and install their seccomp filters while the VM is built.
        let vcpu_tids: Arc<Vec<AtomicI32>> =
            Arc::new((0..cfg.vcpus).map(|_| AtomicI32::new(0)).collect());
        let threads = Threads::spawn(&cfg, &vcpu_tids)?;
        let vm_fd = kvm.create_vm().map_err(VmmError::kvm("create vm"))?;
        vm_fd
            .set_tss_address(layout::KVM_TSS_ADDR as usize)
            .map_err(VmmError::kvm("set tss address"))?;
        vm_fd
            .set_identity_map_address(layout::KVM_IDENTITY_MAP_ADDR)
            .map_err(VmmError::kvm("set identity map address"))?;
        let has_irqchip = match want_irqchip {
            Some(w) => w,
            None => cfg.irqchip && vm_fd.check_extension(Cap::Irqchip),
        };
        // Memory slots before the irqchip (as Firecracker does): adding a slot to a VM that
        // already has an irqchip costs 4-12 ms on this host, before it ~40 µs.
        ram.register(&vm_fd)?;
        if has_irqchip {
            vm_fd
                .create_irq_chip()
                .map_err(VmmError::kvm("create irqchip"))?;
            let pit = kvm_pit_config {
                flags: KVM_PIT_SPEAKER_DUMMY,
                ..Default::default()
            };
            vm_fd
                .create_pit2(pit)
                .map_err(VmmError::kvm("create pit"))?;
        }

        let irqfd = |gsi: u32| -> Result<Option<EventFd>> {
            if !has_irqchip {
                return Ok(None);
            }
            let e = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                .map_err(VmmError::io("eventfd"))?;
            vm_fd
                .register_irqfd(&e, gsi)
                .map_err(VmmError::kvm("register irqfd"))?;
            Ok(Some(e))
        };

        let mut pio = Bus::new();
        let mut mmio = Bus::new();
        let serial_out: SharedOutput = Arc::new(Mutex::new(SerialOutput::new(
            cfg.serial_cap,
            cfg.serial_callback.clone(),
        )));
        let serial_irq = irqfd(layout::SERIAL_IRQ)?;
        let serial = match serial_state {
            Some(s) => SerialDevice::from_snapshot(s, serial_irq, serial_out.clone())?,
            None => SerialDevice::new(serial_irq, serial_out.clone()),
        };
        let serial = Arc::new(Mutex::new(serial));
        let dev: SharedDevice = serial.clone();
        pio.insert(u64::from(layout::SERIAL_PORT), 8, dev);

        let mut virtio = Vec::new();
        let mut virtio_info = Vec::new();
        let mut console_host = None;
        if cfg.virtio_console {
            let (host, dev_end) =
                UnixStream::pair().map_err(VmmError::io("creating the console socketpair"))?;
            let console = Console::new(dev_end).map_err(VmmError::io("console socket"))?;
            let irq = layout::VIRTIO_IRQ_BASE;
            let notify = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                .map_err(VmmError::io("eventfd"))?;
            let t = Arc::new(Mutex::new(MmioTransport::new(
                Box::new(console),
                ram.memory().clone(),
                irqfd(irq)?,
                notify,
            )));
            let dev: SharedDevice = t.clone();
            mmio.insert(layout::VIRTIO_MMIO_BASE, layout::VIRTIO_MMIO_SIZE, dev);
            virtio.push(t);
            virtio_info.push(VirtioMmioInfo {
                base: layout::VIRTIO_MMIO_BASE,
                size: layout::VIRTIO_MMIO_SIZE,
                irq,
                device_type: crate::devices::virtio::console::DEVICE_ID_CONSOLE,
            });
            console_host = Some(host);
        }

        let mut pending_vcpus = Vec::new();
        for id in 0..cfg.vcpus {
            let v = vm_fd
                .create_vcpu(u64::from(id))
                .map_err(VmmError::kvm("create vcpu"))?;
            // A restored vCPU gets its CPUID and LAPIC from the snapshot instead.
            if restoring.is_none() {
                let cpuid = cpu::guest_cpuid(&kvm, id, cfg.vcpus)?;
                v.set_cpuid2(&cpuid).map_err(VmmError::kvm("set cpuid"))?;
                if has_irqchip {
                    cpu::set_lint(&v)?;
                }
            }
            pending_vcpus.push(v);
        }
        let shared = Arc::new(Shared::new(usize::from(cfg.vcpus), sig)?);
        Ok(Vm {
            threads,
            shared,
            pending_vcpus,
            vcpu_tids,
            serial,
            serial_out,
            virtio,
            virtio_info,
            console_host,
            pio,
            mmio,
            cfg,
            has_irqchip,
            started: false,
            vm_fd,
            kvm,
            ram,
        })
    }

    /// Guest RAM (bounds-checked accessors). Write the guest image, boot params, ACPI
    /// tables etc. through it before [`Vm::start`].
    pub fn memory(&self) -> &GuestMemoryMmap {
        self.ram.memory()
    }

    /// RAM size in bytes.
    pub fn mem_size(&self) -> u64 {
        self.ram.size()
    }

    /// Whether KVM's in-kernel irqchip (IOAPIC, PIC, LAPICs) and PIT exist.
    pub fn has_irqchip(&self) -> bool {
        self.has_irqchip
    }

    /// The virtio-mmio devices (for ACPI tables / the kernel command line).
    pub fn virtio_devices(&self) -> &[VirtioMmioInfo] {
        &self.virtio_info
    }

    /// The host end of the virtio-console socketpair (once).
    pub fn take_console(&mut self) -> Option<UnixStream> {
        self.console_host.take()
    }

    /// Loads a static ELF (a tiny guest) into RAM and returns its entry point. Every
    /// `PT_LOAD` segment must lie in RAM at or above `layout::HIMEM_START`.
    pub fn load_elf(&self, image: &[u8]) -> Result<u64> {
        crate::vmm::loader::load_elf(self.ram.memory(), self.ram.size(), image)
    }

    /// Sets up the vCPUs for `entry` and starts them (and the deadline clock).
    pub fn start(&mut self, entry: Entry) -> Result<()> {
        if self.started {
            return Err(VmmError::State("the VM was already started".into()));
        }
        let mem = self.ram.memory();
        let low_top = self.ram.size().min(layout::MMIO_GAP_START);
        for (i, v) in self.pending_vcpus.iter().enumerate() {
            let sregs = v.get_sregs().map_err(VmmError::kvm("get sregs"))?;
            let sregs = cpu::boot_sregs(mem, entry.mode, sregs)?;
            v.set_fpu(&cpu::boot_fpu())
                .map_err(VmmError::kvm("set fpu"))?;
            let regs = match entry.mode {
                CpuMode::User => {
                    let top = low_top
                        .checked_sub(i as u64 * USER_STACK_SIZE)
                        .filter(|t| *t > layout::HIMEM_START)
                        .ok_or_else(|| {
                            VmmError::InvalidConfig("RAM too small for the vCPU stacks".into())
                        })?;
                    let mut r = cpu::boot_regs(entry.mode, entry.rip, top, i as u64, entry.arg);
                    r.rdx = self.ram.size();
                    if i != 0 && self.has_irqchip {
                        // With an in-kernel LAPIC, APs wait for INIT/SIPI; tiny guests start
                        // every vCPU at the entry instead.
                        v.set_mp_state(kvm_bindings::kvm_mp_state {
                            mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
                        })
                        .map_err(VmmError::kvm("set mp state"))?;
                    }
                    r
                }
                CpuMode::Kernel => {
                    if i != 0 {
                        // Application processors wait for INIT/SIPI from the BSP.
                        continue;
                    }
                    cpu::set_boot_msrs(&self.kvm, v)?;
                    cpu::boot_regs(entry.mode, entry.rip, KERNEL_BOOT_STACK, 0, 0)
                }
            };
            v.set_sregs(&sregs).map_err(VmmError::kvm("set sregs"))?;
            v.set_regs(&regs).map_err(VmmError::kvm("set regs"))?;
        }
        self.spawn_threads()
    }

    /// Hands each waiting thread its job: the vCPUs start running.
    fn spawn_threads(&mut self) -> Result<()> {
        self.started = true;
        let deadline = self.cfg.deadline.map(|d| Instant::now() + d);
        // The I/O thread first: once a vCPU runs, it may take this CPU from us.
        if let Some(job) = self.threads.io_job.take() {
            let sent = job.send(IoJob {
                shared: self.shared.clone(),
                transports: self.virtio.clone(),
                deadline,
            });
            if sent.is_err() {
                let why = "the I/O thread ended before it got its job";
                self.shared.finish(VmExit::VmmFailure(why.into()));
                return Err(VmmError::State(why.into()));
            }
        }
        let vcpus = std::mem::take(&mut self.pending_vcpus);
        let jobs = std::mem::take(&mut self.threads.vcpu_jobs);
        self.shared.lock().alive = vcpus.len();
        for (id, (v, job)) in vcpus.into_iter().zip(jobs).enumerate() {
            let ctx = VcpuContext {
                id: id as u8,
                vcpu: v,
                kvm: self.kvm.clone(),
                shared: self.shared.clone(),
                pio: self.pio.clone(),
                mmio: self.mmio.clone(),
                has_irqchip: self.has_irqchip,
            };
            if job.send(ctx).is_err() {
                let mut c = self.shared.lock();
                c.alive = c.alive.saturating_sub(1);
                drop(c);
                let why = "a vCPU thread ended before it got its vCPU";
                self.shared.finish(VmExit::VmmFailure(why.into()));
                return Err(VmmError::State(why.into()));
            }
        }
        Ok(())
    }

    fn check_live(&self) -> Result<()> {
        if !self.started {
            return Err(VmmError::State("the VM has not been started".into()));
        }
        if let Some(e) = self.exit() {
            return Err(VmmError::Exited(e.to_string()));
        }
        Ok(())
    }

    /// Pauses all vCPUs (returns once they are out of the guest). Devices keep serving the
    /// host side.
    pub fn pause(&self) -> Result<()> {
        self.check_live()?;
        let mut c = self.shared.lock();
        c.pause_requested = true;
        self.shared.attention.store(true, Ordering::SeqCst);
        self.shared.kick_all();
        while c.paused < c.alive && !c.stop {
            c = self
                .shared
                .cv
                .wait_timeout(c, Duration::from_millis(5))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
            // Re-kick: a vCPU that was between exits may have missed nothing, but this is cheap.
            self.shared.kick_all();
        }
        if c.stop {
            return Err(VmmError::Exited(
                c.exit.as_ref().map(|e| e.to_string()).unwrap_or_default(),
            ));
        }
        Ok(())
    }

    /// Resumes paused vCPUs.
    pub fn resume(&self) -> Result<()> {
        self.check_live()?;
        let mut c = self.shared.lock();
        c.pause_requested = false;
        if !c.stop {
            self.shared.attention.store(false, Ordering::SeqCst);
        }
        drop(c);
        self.shared.cv.notify_all();
        Ok(())
    }

    /// Kills the VM (no-op if it already ended): [`VmExit::Killed`].
    pub fn kill(&self) {
        self.shared.finish(VmExit::Killed);
    }

    /// Why the VM ended, if it has.
    pub fn exit(&self) -> Option<VmExit> {
        self.shared.lock().exit.clone()
    }

    /// Blocks until the VM ends.
    pub fn wait(&self) -> VmExit {
        let mut c = self.shared.lock();
        loop {
            if let Some(e) = &c.exit {
                return e.clone();
            }
            c = self.shared.cv.wait(c).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Blocks until the VM ends or `timeout` passes (then `None`; the VM keeps running).
    pub fn wait_timeout(&self, timeout: Duration) -> Option<VmExit> {
        let end = Instant::now() + timeout;
        let mut c = self.shared.lock();
        loop {
            if let Some(e) = &c.exit {
                return Some(e.clone());
            }
            let now = Instant::now();
            if now >= end {
                return None;
            }
            c = self
                .shared
                .cv
                .wait_timeout(c, end - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Waits (async) until the VM ends.
    pub async fn wait_async(&self) -> VmExit {
        let mut rx = self.shared.exit_tx.subscribe();
        loop {
            if let Some(e) = rx.borrow_and_update().clone() {
                return e;
            }
            if rx.changed().await.is_err() {
                return VmExit::Killed;
            }
        }
    }

    /// A copy of the serial output kept so far.
    pub fn serial_output(&self) -> Vec<u8> {
        self.serial_out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .data()
            .to_vec()
    }

    /// Takes the serial output kept so far out of the buffer.
    pub fn take_serial_output(&self) -> Vec<u8> {
        self.serial_out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Serial bytes dropped because of the output cap (a flooding guest).
    pub fn serial_dropped(&self) -> u64 {
        self.serial_out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .dropped()
    }

    /// Queues bytes on the serial port's input FIFO; returns how many fit.
    pub fn serial_input(&self, bytes: &[u8]) -> usize {
        self.serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .enqueue_input(bytes)
    }

    /// For each virtio device: why the guest broke it (NEEDS_RESET), if it did.
    pub fn virtio_errors(&self) -> Vec<Option<String>> {
        self.virtio
            .iter()
            .map(|t| {
                t.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .broken()
                    .map(str::to_string)
            })
            .collect()
    }

    /// Guest accesses to ports / MMIO addresses where no device lives (ignored).
    pub fn unhandled_io_count(&self) -> u64 {
        self.shared.unhandled_io.load(Ordering::Relaxed)
    }

    /// Linux thread ids of the vCPU threads (0 for one not started yet).
    pub fn vcpu_thread_ids(&self) -> Vec<i32> {
        self.vcpu_tids
            .iter()
            .map(|t| t.load(Ordering::SeqCst))
            .collect()
    }

    /// Snapshots the VM into `dir` (created if needed): `vm-state.json` (versioned) and
    /// `memory.bin` (sparse). The VM is paused meanwhile and left as it was (running or
    /// paused).
    pub fn snapshot(&self, dir: &Path) -> Result<SnapshotInfo> {
        self.check_live()?;
        std::fs::create_dir_all(dir).map_err(VmmError::io(format!(
            "creating snapshot dir {}",
            dir.display()
        )))?;
        // Pause, with every vCPU saving its own state.
        let was_paused;
        let states = {
            let mut c = self.shared.lock();
            was_paused = c.pause_requested;
            c.pause_requested = true;
            c.want_state = true;
            for s in c.states.iter_mut() {
                *s = None;
            }
            self.shared.attention.store(true, Ordering::SeqCst);
            drop(c);
            self.shared.cv.notify_all();
            self.shared.kick_all();
            let mut c = self.shared.lock();
            while !c.stop && c.states.iter().any(Option::is_none) {
                c = self
                    .shared
                    .cv
                    .wait_timeout(c, Duration::from_millis(5))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
                self.shared.kick_all();
            }
            c.want_state = false;
            if c.stop {
                return Err(VmmError::Exited(
                    c.exit.as_ref().map(|e| e.to_string()).unwrap_or_default(),
                ));
            }
            let states: Vec<_> = c.states.iter_mut().filter_map(Option::take).collect();
            states
        };
        let result = self.write_snapshot(dir, states);
        if !was_paused {
            let _ = self.resume();
        }
        result
    }

    fn write_snapshot(&self, dir: &Path, states: Vec<Result<VcpuState>>) -> Result<SnapshotInfo> {
        let mut vcpus = Vec::new();
        for s in states {
            vcpus.push(s.map_err(|e| VmmError::SaveVcpu(Box::new(e)))?);
        }
        let irqchip = if self.has_irqchip {
            let chip = |id: u32| -> Result<kvm_irqchip> {
                let mut c = kvm_irqchip {
                    chip_id: id,
                    ..Default::default()
                };
                self.vm_fd
                    .get_irqchip(&mut c)
                    .map_err(VmmError::kvm("get irqchip"))?;
                Ok(c)
            };
            Some(IrqchipState {
                pic_master: chip(KVM_IRQCHIP_PIC_MASTER)?,
                pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE)?,
                ioapic: chip(KVM_IRQCHIP_IOAPIC)?,
                pit: self.vm_fd.get_pit2().map_err(VmmError::kvm("get pit"))?,
                clock: self.vm_fd.get_clock().ok(),
            })
        } else {
            None
        };
        // Hold the device locks while saving device state and memory so the I/O thread
        // cannot change either in between.
        let serial = self.serial.lock().unwrap_or_else(|p| p.into_inner());
        let transports: Vec<_> = self
            .virtio
            .iter()
            .map(|t| t.lock().unwrap_or_else(|p| p.into_inner()))
            .collect();
        let state = VmState {
            format_version: SNAPSHOT_FORMAT_VERSION,
            vmm_version: env!("CARGO_PKG_VERSION").to_string(),
            mem_size: self.ram.size(),
            vcpu_count: self.cfg.vcpus,
            irqchip,
            vcpus,
            serial: serial.snapshot(),
            virtio: transports.iter().map(|t| t.save()).collect(),
            unhandled_io: self.unhandled_io_count(),
        };
        let memory_file = dir.join(SNAPSHOT_MEMORY_FILE);
        let written = self.ram.save_to_file(&memory_file)?;
        drop(transports);
        drop(serial);
        let state_file = dir.join(SNAPSHOT_STATE_FILE);
        let json = serde_json::to_vec(&state)
            .map_err(|e| VmmError::State(format!("serialising the VM state: {e}")))?;
        std::fs::write(&state_file, json).map_err(VmmError::io("writing the VM state"))?;
        Ok(SnapshotInfo {
            state_file,
            memory_file,
            memory_bytes_written: written,
        })
    }

    /// Restores a snapshot directory written by [`Vm::snapshot`] into a new, running VM.
    /// Memory is mapped copy-on-write from the snapshot's memory file, which must stay in
    /// place while the VM lives. `cfg.mem_size` and `cfg.vcpus` must match the snapshot
    /// (else [`VmmError::SnapshotIncompatible`]); `cfg.virtio_console` is taken from the
    /// snapshot; the deadline, serial cap/callback and seccomp come from `cfg`.
    pub fn restore(dir: &Path, cfg: VmConfig) -> Result<Vm> {
        let raw = std::fs::read(dir.join(SNAPSHOT_STATE_FILE))
            .map_err(VmmError::io(format!("reading {}", dir.display())))?;
        let st = parse_state(&raw)?;
        if st.mem_size != cfg.mem_size {
            return Err(VmmError::SnapshotIncompatible(format!(
                "snapshot has {} bytes of memory, the VM is configured for {}",
                st.mem_size, cfg.mem_size
            )));
        }
        if st.vcpu_count != cfg.vcpus || st.vcpus.len() != usize::from(cfg.vcpus) {
            return Err(VmmError::SnapshotIncompatible(format!(
                "snapshot has {} vCPUs, the VM is configured for {}",
                st.vcpu_count, cfg.vcpus
            )));
        }
        let ram = GuestRam::open_private(&dir.join(SNAPSHOT_MEMORY_FILE), st.mem_size)?;
        let mut cfg = cfg;
        cfg.virtio_console = !st.virtio.is_empty();
        let mut vm = Self::build(
            cfg,
            ram,
            Some(Restoring {
                irqchip: st.irqchip.is_some(),
                serial: &st.serial,
            }),
        )?;
        if vm.virtio.len() != st.virtio.len() {
            return Err(VmmError::SnapshotIncompatible(
                "virtio device set differs".into(),
            ));
        }
        for (t, s) in vm.virtio.iter().zip(&st.virtio) {
            t.lock().unwrap_or_else(|p| p.into_inner()).restore(s)?;
        }
        for (v, s) in vm.pending_vcpus.iter().zip(&st.vcpus) {
            vcpu::restore_state(v, s, vm.has_irqchip)?;
        }
        if let Some(ic) = &st.irqchip {
            for c in [&ic.pic_master, &ic.pic_slave, &ic.ioapic] {
                vm.vm_fd
                    .set_irqchip(c)
                    .map_err(VmmError::kvm("set irqchip"))?;
            }
            vm.vm_fd
                .set_pit2(&ic.pit)
                .map_err(VmmError::kvm("set pit"))?;
            if let Some(clock) = &ic.clock {
                let mut c = *clock;
                c.flags = 0;
                vm.vm_fd.set_clock(&c).map_err(VmmError::kvm("set clock"))?;
            }
        }
        vm.shared
            .unhandled_io
            .store(st.unhandled_io, Ordering::Relaxed);
        vm.spawn_threads()?;
        Ok(vm)
    }
}

/// Just the version of a state file (any other fields are skipped).
#[derive(Deserialize)]
struct StateVersion {
    format_version: Option<u64>,
}

/// Parses a state file in one pass; only when that fails is it parsed again for its version,
/// to tell another format version ([`VmmError::SnapshotIncompatible`]) from a corrupt file.
fn parse_state(raw: &[u8]) -> Result<VmState> {
    let incompatible = |version: Option<u64>| {
        VmmError::SnapshotIncompatible(format!(
            "format version {version:?}, this VMM reads {SNAPSHOT_FORMAT_VERSION}"
        ))
    };
    match serde_json::from_slice::<VmState>(raw) {
        Ok(st) if st.format_version == SNAPSHOT_FORMAT_VERSION => Ok(st),
        Ok(st) => Err(incompatible(Some(u64::from(st.format_version)))),
        Err(e) => match serde_json::from_slice::<StateVersion>(raw) {
            Ok(v) if v.format_version != Some(u64::from(SNAPSHOT_FORMAT_VERSION)) => {
                Err(incompatible(v.format_version))
            }
            _ => Err(VmmError::SnapshotCorrupt(format!("state file: {e}"))),
        },
    }
}

/// What the I/O thread gets when the VM starts.
struct IoJob {
    shared: Arc<Shared>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
    deadline: Option<Instant>,
}

/// A VM's threads. They are spawned when the VM is built, install their seccomp filters at
/// once and wait for their job, so that thread creation and filter installation (~0.1 ms
/// each here) overlap the rest of the set-up instead of delaying the guest's start. A
/// thread whose job sender goes away (the VM is dropped unstarted) just ends.
#[derive(Default)]
struct Threads {
    vcpu_jobs: Vec<mpsc::Sender<VcpuContext>>,
    io_job: Option<mpsc::Sender<IoJob>>,
    handles: Vec<JoinHandle<()>>,
}

/// Installs `prog` on the calling thread, if there is one.
fn install_filter(
    prog: Option<&seccompiler::BpfProgram>,
) -> std::result::Result<(), seccompiler::Error> {
    match prog {
        Some(p) => seccompiler::apply_filter(p),
        None => Ok(()),
    }
}

impl Threads {
    /// One thread per vCPU, and the I/O thread when there is something for it to do (a
    /// virtio device to serve or a deadline to enforce).
    fn spawn(cfg: &VmConfig, tids: &Arc<Vec<AtomicI32>>) -> Result<Threads> {
        let (vcpu_prog, io_prog) = if cfg.seccomp {
            (
                Some(crate::seccomp::vcpu_filter()?),
                Some(crate::seccomp::io_filter()?),
            )
        } else {
            (None, None)
        };
        // Dropping `t` on an error below ends and joins the threads spawned so far.
        let mut t = Threads::default();
        for id in 0..usize::from(cfg.vcpus) {
            let (tx, rx) = mpsc::channel::<VcpuContext>();
            let tids = tids.clone();
            let prog = vcpu_prog.clone();
            let h = std::thread::Builder::new()
                .name(format!("microvm-vcpu{id}"))
                .stack_size(256 * 1024)
                .spawn(move || {
                    // SAFETY: gettid has no preconditions.
                    let tid = unsafe { libc::gettid() };
                    if let Some(t) = tids.get(id) {
                        t.store(tid, Ordering::SeqCst);
                    }
                    let filtered = install_filter(prog.as_ref());
                    if let Ok(ctx) = rx.recv() {
                        vcpu::vcpu_thread(ctx, filtered);
                    }
                })
                .map_err(VmmError::Thread)?;
            t.vcpu_jobs.push(tx);
            t.handles.push(h);
        }
        if cfg.virtio_console || cfg.deadline.is_some() {
            let (tx, rx) = mpsc::channel::<IoJob>();
            let h = std::thread::Builder::new()
                .name("microvm-io".into())
                .stack_size(256 * 1024)
                .spawn(move || {
                    let filtered = install_filter(io_prog.as_ref());
                    if let Ok(job) = rx.recv() {
                        io_thread(job, filtered);
                    }
                })
                .map_err(VmmError::Thread)?;
            t.io_job = Some(tx);
            t.handles.push(h);
        }
        Ok(t)
    }

    /// Ends the threads that never got a job and joins all of them (the running ones must
    /// have been told to stop).
    fn join(&mut self) {
        self.vcpu_jobs.clear();
        self.io_job = None;
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        self.join();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.shared.finish(VmExit::Killed);
        self.threads.join();
    }
}

/// The I/O thread: virtio queue processing (on notify or host socket readiness) and the
/// wall-clock deadline.
fn io_thread(job: IoJob, seccomp: std::result::Result<(), seccompiler::Error>) {
    let IoJob {
        shared,
        transports,
        deadline,
    } = job;
    if let Err(e) = seccomp {
        shared.finish(VmExit::VmmFailure(format!("installing seccomp: {e}")));
        return;
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        io_loop(&shared, &transports, deadline)
    }));
    if r.is_err() {
        shared.finish(VmExit::VmmFailure("I/O thread panicked".into()));
    }
}

fn io_loop(shared: &Shared, transports: &[Arc<Mutex<MmioTransport>>], deadline: Option<Instant>) {
    fn lock(t: &Arc<Mutex<MmioTransport>>) -> std::sync::MutexGuard<'_, MmioTransport> {
        t.lock().unwrap_or_else(|p| p.into_inner())
    }
    // Notify fds are stable for the transport's life.
    let notify: Vec<RawFd> = transports
        .iter()
        .map(|t| lock(t).notify_fd().as_raw_fd())
        .collect();
    loop {
        if shared.lock().stop {
            return;
        }
        let mut fds = vec![libc::pollfd {
            fd: shared.stop_evt.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        for (t, n) in transports.iter().zip(&notify) {
            fds.push(libc::pollfd {
                fd: *n,
                events: libc::POLLIN,
                revents: 0,
            });
            if let Some((fd, r, w)) = lock(t).host_interest() {
                let mut ev = 0;
                if r {
                    ev |= libc::POLLIN;
                }
                if w {
                    ev |= libc::POLLOUT;
                }
                if ev != 0 {
                    fds.push(libc::pollfd {
                        fd,
                        events: ev,
                        revents: 0,
                    });
                }
            }
        }
        let timeout = match deadline {
            None => -1,
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    shared.finish(VmExit::DeadlineExceeded);
                    return;
                }
                let ms = (d - now).as_millis().saturating_add(1);
                i32::try_from(ms).unwrap_or(i32::MAX)
            }
        };
        // SAFETY: `fds` is a live, correctly sized array of pollfd; the descriptors stay
        // open for the call (owned by `shared` and the transports, which we hold).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                shared.finish(VmExit::VmmFailure(format!("I/O thread poll: {e}")));
                return;
            }
            continue;
        }
        for t in transports {
            let mut g = lock(t);
            let _ = g.notify_fd().read();
            g.process();
        }
    }
}

/// Reads raw bytes from guest RAM (a helper for tests and the boot path).
pub fn read_guest(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Result<Vec<u8>> {
    let mut v = vec![0u8; len];
    mem.read_slice(&mut v, GuestAddress(addr))
        .map_err(|e| VmmError::memory(format!("reading {len} bytes at {addr:#x}: {e}")))?;
    Ok(v)
}
