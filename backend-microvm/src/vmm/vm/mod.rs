//! The VM: KVM setup, memory, devices, vCPU threads, the I/O thread, lifecycle and
//! snapshot/restore.
//!
//! This module holds the configuration and the lifecycle (start, pause, resume, kill, wait,
//! the serial port). Its private submodules: `create` builds a VM ([`Vm::new`]), `threads`
//! runs its vCPU and I/O threads, `snapshot` saves and restores it ([`Vm::snapshot`],
//! [`Vm::restore`]).

mod create;
mod pool;
mod snapshot;
mod threads;

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
use crate::devices::virtio::blk::Block;
use crate::devices::virtio::console::Console;
use crate::devices::virtio::mmio::{MmioTransport, TransportState};
use crate::devices::virtio::net::Net;
use crate::layout;
use crate::vmm::bus::{Bus, SharedDevice};
use crate::vmm::cpu::{self, CpuMode};
use crate::vmm::error::{Result, VmmError};
use crate::vmm::memory::GuestRam;
use crate::vmm::vcpu::{self, Shared, VcpuContext, VcpuState, VmExit};

use pool::Shell;
pub use pool::VmPool;
use threads::Threads;

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
#[non_exhaustive]
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
    /// Attach a read-only virtio-blk device backed by this file (the virtio-mmio device
    /// after the console, if any).
    pub block: Option<BlockConfig>,
    /// Attach a virtio-net device (the virtio-mmio device after the console and the block
    /// device, if any).
    pub net: Option<NetConfig>,
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
            .field("block", &self.block)
            .field("net", &self.net)
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
            block: None,
            net: None,
            deadline: None,
            seccomp: true,
            irqchip: true,
        }
    }
}

/// A read-only virtio-blk device (see [`crate::devices::virtio::blk`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlockConfig {
    /// The backing file (or block device), opened read-only when the VM is built; its size
    /// in whole 512-byte sectors is the disk's capacity.
    pub path: PathBuf,
    /// The device id the guest reads with `GET_ID` (at most 20 bytes; Linux shows it as
    /// `/sys/block/vdX/serial`).
    pub id: String,
}

impl BlockConfig {
    /// A disk backed by `path`, whose device id is `id`.
    pub fn new(path: impl Into<PathBuf>, id: impl Into<String>) -> Self {
        BlockConfig {
            path: path.into(),
            id: id.into(),
        }
    }
}

impl VmConfig {
    /// Sets [`VmConfig::mem_size`].
    pub fn mem_size(mut self, mem_size: u64) -> Self {
        self.mem_size = mem_size;
        self
    }

    /// Sets [`VmConfig::vcpus`].
    pub fn vcpus(mut self, vcpus: u8) -> Self {
        self.vcpus = vcpus;
        self
    }

    /// Sets [`VmConfig::serial_cap`].
    pub fn serial_cap(mut self, serial_cap: usize) -> Self {
        self.serial_cap = serial_cap;
        self
    }

    /// Sets [`VmConfig::serial_callback`].
    pub fn serial_callback(mut self, serial_callback: Option<OutputCallback>) -> Self {
        self.serial_callback = serial_callback;
        self
    }

    /// Sets [`VmConfig::virtio_console`].
    pub fn virtio_console(mut self, virtio_console: bool) -> Self {
        self.virtio_console = virtio_console;
        self
    }

    /// Sets [`VmConfig::block`].
    pub fn block(mut self, block: Option<BlockConfig>) -> Self {
        self.block = block;
        self
    }

    /// Sets [`VmConfig::net`].
    pub fn net(mut self, net: Option<NetConfig>) -> Self {
        self.net = net;
        self
    }

    /// Sets [`VmConfig::deadline`].
    pub fn deadline(mut self, deadline: Option<Duration>) -> Self {
        self.deadline = deadline;
        self
    }

    /// Sets [`VmConfig::seccomp`].
    pub fn seccomp(mut self, seccomp: bool) -> Self {
        self.seccomp = seccomp;
        self
    }

    /// Sets [`VmConfig::irqchip`].
    pub fn irqchip(mut self, irqchip: bool) -> Self {
        self.irqchip = irqchip;
        self
    }
}

impl VmConfig {
    /// The virtio device types this configuration attaches, in virtio-mmio slot order.
    fn virtio_device_types(&self) -> Vec<u32> {
        let mut t = Vec::new();
        if self.virtio_console {
            t.push(crate::devices::virtio::console::DEVICE_ID_CONSOLE);
        }
        if self.block.is_some() {
            t.push(crate::devices::virtio::blk::DEVICE_ID_BLOCK);
        }
        if self.net.is_some() {
            t.push(crate::devices::virtio::net::DEVICE_ID_NET);
        }
        t
    }
}

/// A virtio-net device (see [`crate::devices::virtio::net`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct NetConfig {
    /// The guest's MAC address (a locally administered unicast one, e.g. `02:…`).
    pub mac: [u8; 6],
    /// The host side: one Ethernet frame per `read`/`write` (a TAP device from
    /// [`open_tap_in`](crate::devices::virtio::net::open_tap_in), or a `SOCK_SEQPACKET`
    /// socket). The VM uses its own duplicate, made when it is built.
    pub fd: std::sync::Arc<std::os::fd::OwnedFd>,
}

impl NetConfig {
    /// A network card of address `mac` whose frames go through `fd`.
    pub fn new(mac: [u8; 6], fd: std::sync::Arc<std::os::fd::OwnedFd>) -> Self {
        NetConfig { mac, fd }
    }
}

/// Where and how the vCPUs start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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
    /// The same entry with [`Entry::arg`] set to `arg`.
    pub fn with_arg(mut self, arg: u64) -> Self {
        self.arg = arg;
        self
    }

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
#[non_exhaustive]
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
#[non_exhaustive]
pub struct SnapshotInfo {
    /// The state file.
    pub state_file: PathBuf,
    /// The memory file (sparse).
    pub memory_file: PathBuf,
    /// Non-zero memory bytes actually written.
    pub memory_bytes_written: u64,
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
    net_counters: Option<Arc<crate::devices::virtio::net::NetCounters>>,
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

impl Vm {
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

    /// The network device's frame counters, when it has one.
    pub fn net_counters(&self) -> Option<Arc<crate::devices::virtio::net::NetCounters>> {
        self.net_counters.clone()
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
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.shared.finish(VmExit::Killed);
        self.threads.join();
    }
}

/// Reads raw bytes from guest RAM (a helper for tests and the boot path).
pub fn read_guest(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Result<Vec<u8>> {
    let mut v = vec![0u8; len];
    mem.read_slice(&mut v, GuestAddress(addr))
        .map_err(|e| VmmError::memory(format!("reading {len} bytes at {addr:#x}: {e}")))?;
    Ok(v)
}
