//! vCPU threads: the run loop, exit handling, kicks (a signal + `immediate_exit`), pause
//! and state capture.
//!
//! Each vCPU thread owns its `VcpuFd`. Other threads talk to it through shared control state: they set
//! a request under the control mutex, raise the `attention` flag and send the kick signal;
//! the signal handler sets `kvm_run.immediate_exit` on the vCPU's own thread, so a kick that
//! lands just before `KVM_RUN` is not lost (KVM returns `EINTR` at once).

use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_run, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId,
};
use kvm_ioctls::{VcpuExit, VcpuFd};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use vmm_sys_util::eventfd::EventFd;

use crate::layout;
use crate::vmm::bus::Bus;
use crate::vmm::cpu;
use crate::vmm::error::{Result, VmmError};

/// Why a VM stopped running. The first cause wins; later ones are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum VmExit {
    /// The guest wrote its exit code to [`layout::DEBUG_EXIT_PORT`].
    GuestExit {
        /// The value written.
        code: u32,
    },
    /// The guest asked for a reset (i8042 0xfe, or a KVM reset system event): Linux reboot.
    Reset,
    /// The guest asked to power off (KVM shutdown system event).
    PowerOff,
    /// The guest triple-faulted (KVM_EXIT_SHUTDOWN).
    TripleFault,
    /// A `hlt` exited to the VMM (only without an in-kernel irqchip).
    Halted,
    /// The wall-clock deadline passed: the VM was killed.
    DeadlineExceeded,
    /// The host killed the VM ([`crate::vmm::Vm::kill`] or drop).
    Killed,
    /// KVM could not emulate something (KVM_EXIT_INTERNAL_ERROR).
    InternalError {
        /// KVM's suberror (1 = emulation failure).
        suberror: u32,
    },
    /// The hardware refused to enter the guest.
    FailEntry {
        /// The hardware reason.
        reason: u64,
    },
    /// An exit the VMM does not handle, or a VMM failure while running (ioctl error,
    /// a caught panic). The host process is fine; this VM is over.
    VmmFailure(String),
}

impl std::fmt::Display for VmExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VmExit::GuestExit { code } => write!(f, "guest exited with code {code}"),
            VmExit::Reset => write!(f, "guest reset"),
            VmExit::PowerOff => write!(f, "guest powered off"),
            VmExit::TripleFault => write!(f, "guest triple-faulted"),
            VmExit::Halted => write!(f, "guest halted"),
            VmExit::DeadlineExceeded => write!(f, "wall-clock deadline exceeded"),
            VmExit::Killed => write!(f, "killed by the host"),
            VmExit::InternalError { suberror } => {
                write!(f, "KVM internal error (suberror {suberror})")
            }
            VmExit::FailEntry { reason } => write!(f, "VM entry failed (reason {reason:#x})"),
            VmExit::VmmFailure(m) => write!(f, "VMM failure: {m}"),
        }
    }
}

/// Everything KVM holds for one vCPU, for a snapshot.
#[derive(Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub struct VcpuState {
    /// vCPU index.
    pub id: u8,
    /// CPUID as set.
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// Multiprocessing state.
    pub mp_state: kvm_mp_state,
    /// General registers.
    pub regs: kvm_regs,
    /// Special registers.
    pub sregs: kvm_sregs,
    /// FPU/SSE/AVX state.
    pub xsave: kvm_xsave,
    /// XCR0 and friends.
    pub xcrs: Option<kvm_xcrs>,
    /// Debug registers.
    pub debug_regs: kvm_debugregs,
    /// Local APIC (with an in-kernel irqchip).
    pub lapic: Option<kvm_lapic_state>,
    /// MSRs that this host lets us read.
    pub msrs: Vec<kvm_msr_entry>,
    /// Pending exceptions/interrupts/NMIs.
    pub events: kvm_vcpu_events,
}

/// MSRs this host lets us read, found once per process.
static READABLE_MSRS: OnceLock<Vec<u32>> = OnceLock::new();

/// Captures a vCPU's state. Call only when the vCPU is not running and pending I/O has been
/// completed (the pausing vCPU thread does both).
pub fn save_state(
    kvm: &kvm_ioctls::Kvm,
    vcpu: &VcpuFd,
    id: u8,
    has_irqchip: bool,
) -> Result<VcpuState> {
    let cpuid = vcpu
        .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(VmmError::kvm("get cpuid"))?
        .as_slice()
        .to_vec();
    let msrs = match READABLE_MSRS.get() {
        Some(list) => cpu::get_msrs_tolerant(vcpu, list)?,
        None => {
            let list = cpu::msr_index_list(kvm)?;
            let got = cpu::get_msrs_tolerant(vcpu, list)?;
            let _ = READABLE_MSRS.set(got.iter().map(|m| m.index).collect());
            got
        }
    };
    Ok(VcpuState {
        id,
        cpuid,
        mp_state: vcpu.get_mp_state().map_err(VmmError::kvm("get mp state"))?,
        regs: vcpu.get_regs().map_err(VmmError::kvm("get regs"))?,
        sregs: vcpu.get_sregs().map_err(VmmError::kvm("get sregs"))?,
        xsave: vcpu.get_xsave().map_err(VmmError::kvm("get xsave"))?,
        xcrs: vcpu.get_xcrs().ok(),
        debug_regs: vcpu
            .get_debug_regs()
            .map_err(VmmError::kvm("get debug regs"))?,
        lapic: if has_irqchip {
            Some(vcpu.get_lapic().map_err(VmmError::kvm("get lapic"))?)
        } else {
            None
        },
        msrs,
        events: vcpu
            .get_vcpu_events()
            .map_err(VmmError::kvm("get vcpu events"))?,
    })
}

/// Loads a saved state into a fresh (never run) vCPU.
pub fn restore_state(vcpu: &VcpuFd, s: &VcpuState, has_irqchip: bool) -> Result<()> {
    let cpuid = CpuId::from_entries(&s.cpuid)
        .map_err(|e| VmmError::SnapshotCorrupt(format!("cpuid: {e:?}")))?;
    vcpu.set_cpuid2(&cpuid)
        .map_err(VmmError::kvm("set cpuid"))?;
    vcpu.set_mp_state(s.mp_state)
        .map_err(VmmError::kvm("set mp state"))?;
    vcpu.set_regs(&s.regs).map_err(VmmError::kvm("set regs"))?;
    vcpu.set_sregs(&s.sregs)
        .map_err(VmmError::kvm("set sregs"))?;
    // SAFETY: the buffer is a full `kvm_xsave` (4 KiB) and the guest CPUID never enables
    // features whose XSAVE area is larger (AMX is masked in `cpu::guest_cpuid`), so KVM reads
    // only inside the struct.
    unsafe { vcpu.set_xsave(&s.xsave) }.map_err(VmmError::kvm("set xsave"))?;
    if let Some(x) = &s.xcrs {
        vcpu.set_xcrs(x).map_err(VmmError::kvm("set xcrs"))?;
    }
    vcpu.set_debug_regs(&s.debug_regs)
        .map_err(VmmError::kvm("set debug regs"))?;
    match (&s.lapic, has_irqchip) {
        (Some(l), true) => vcpu.set_lapic(l).map_err(VmmError::kvm("set lapic"))?,
        (None, false) => {}
        _ => {
            return Err(VmmError::SnapshotIncompatible(
                "irqchip presence differs from the snapshot".into(),
            ))
        }
    }
    cpu::set_msrs_tolerant(vcpu, &s.msrs)?;
    vcpu.set_vcpu_events(&s.events)
        .map_err(VmmError::kvm("set vcpu events"))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Kicking.

thread_local! {
    /// This thread's `kvm_run` (null when the thread runs no vCPU).
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Async-signal-safe: a const-initialised thread-local read and a volatile store.
    let p = KVM_RUN.with(|c| c.get());
    if !p.is_null() {
        // SAFETY: `p` is this thread's live kvm_run mapping: it is set after the VcpuFd is
        // created on this thread and cleared before the VcpuFd is dropped.
        unsafe { std::ptr::write_volatile(std::ptr::addr_of_mut!((*p).immediate_exit), 1) };
    }
}

/// The kick signal (a real-time signal), its handler installed once per process.
pub fn kick_signal() -> Result<libc::c_int> {
    static SIG: OnceLock<std::result::Result<libc::c_int, std::sync::Arc<VmmError>>> =
        OnceLock::new();
    SIG.get_or_init(|| {
        let sig = vmm_sys_util::signal::SIGRTMIN() + 4;
        vmm_sys_util::signal::register_signal_handler(sig, kick_handler)
            .map(|()| sig)
            .map_err(|e| {
                std::sync::Arc::new(VmmError::Io {
                    context: "installing the vCPU kick signal handler".into(),
                    source: std::io::Error::from_raw_os_error(e.errno()),
                })
            })
    })
    .clone()
    .map_err(VmmError::Cached)
}

/// A handle to send kicks to one vCPU thread, valid only while the thread lives.
#[derive(Debug)]
pub(crate) struct Kicker {
    /// The pthread, `None` once the thread has finished (then nothing is sent).
    thread: Mutex<Option<libc::pthread_t>>,
}

impl Kicker {
    pub(crate) fn new() -> Self {
        Kicker {
            thread: Mutex::new(None),
        }
    }

    fn set(&self, t: Option<libc::pthread_t>) {
        *self.thread.lock().unwrap_or_else(|p| p.into_inner()) = t;
    }

    pub(crate) fn kick(&self, sig: libc::c_int) {
        let g = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = *g {
            // SAFETY: `t` names a thread that is still running: the thread clears this slot
            // (under the same lock) before it exits.
            unsafe { libc::pthread_kill(t, sig) };
        }
    }
}

// ---------------------------------------------------------------------------------------
// Shared control state.

/// Control state shared by the VM handle, its vCPU threads and its I/O thread.
#[derive(Debug)]
pub(crate) struct Ctl {
    pub pause_requested: bool,
    /// When pausing, each vCPU saves its state here.
    pub want_state: bool,
    pub stop: bool,
    pub exit: Option<VmExit>,
    pub paused: usize,
    pub alive: usize,
    pub states: Vec<Option<Result<VcpuState>>>,
}

/// Shared between all threads of one VM.
#[derive(Debug)]
pub(crate) struct Shared {
    pub ctl: Mutex<Ctl>,
    pub cv: Condvar,
    /// Fast check in the run loop: something in `ctl` wants the vCPUs' attention.
    pub attention: AtomicBool,
    pub kickers: Vec<Kicker>,
    pub sig: libc::c_int,
    /// Wakes the I/O thread (stop).
    pub stop_evt: EventFd,
    pub exit_tx: watch::Sender<Option<VmExit>>,
    /// Guest accesses to addresses with no device.
    pub unhandled_io: AtomicU64,
}

impl Shared {
    pub(crate) fn new(vcpus: usize, sig: libc::c_int) -> Result<Self> {
        Ok(Shared {
            ctl: Mutex::new(Ctl {
                pause_requested: false,
                want_state: false,
                stop: false,
                exit: None,
                paused: 0,
                alive: 0,
                states: (0..vcpus).map(|_| None).collect(),
            }),
            cv: Condvar::new(),
            attention: AtomicBool::new(false),
            kickers: (0..vcpus).map(|_| Kicker::new()).collect(),
            sig,
            stop_evt: EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                .map_err(VmmError::io("eventfd"))?,
            exit_tx: watch::channel(None).0,
            unhandled_io: AtomicU64::new(0),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn kick_all(&self) {
        for k in &self.kickers {
            k.kick(self.sig);
        }
    }

    /// Records why the VM ended (first cause wins) and stops every thread.
    pub(crate) fn finish(&self, why: VmExit) {
        let mut c = self.lock();
        if c.exit.is_none() {
            c.exit = Some(why.clone());
            self.exit_tx.send_replace(Some(why));
        }
        c.stop = true;
        self.attention.store(true, Ordering::SeqCst);
        drop(c);
        self.cv.notify_all();
        let _ = self.stop_evt.write(1);
        self.kick_all();
    }
}

// ---------------------------------------------------------------------------------------
// The run loop.

/// What a vCPU thread needs.
pub(crate) struct VcpuContext {
    pub id: u8,
    pub vcpu: VcpuFd,
    pub kvm: Arc<kvm_ioctls::Kvm>,
    pub shared: Arc<Shared>,
    pub pio: Bus,
    pub mmio: Bus,
    pub has_irqchip: bool,
}

enum Step {
    Continue,
    End(VmExit),
}

/// Completes an in-flight I/O or MMIO read (its data is already in `kvm_run`) without
/// running guest code, so the saved registers are consistent.
fn flush_pending_io(vcpu: &mut VcpuFd) {
    vcpu.set_kvm_immediate_exit(1);
    let _ = vcpu.run();
    vcpu.set_kvm_immediate_exit(0);
}

/// The vCPU thread body, once it has its vCPU. `seccomp` is how installing the thread's
/// filter went (done earlier, while the VM was being built): an error ends the VM before
/// the guest runs.
pub(crate) fn vcpu_thread(
    mut ctx: VcpuContext,
    seccomp: std::result::Result<(), seccompiler::Error>,
) {
    // SAFETY: pthread_self has no preconditions.
    let me = unsafe { libc::pthread_self() };
    let idx = usize::from(ctx.id);
    KVM_RUN.with(|c| c.set(ctx.vcpu.get_kvm_run() as *mut kvm_run));
    if let Some(k) = ctx.shared.kickers.get(idx) {
        k.set(Some(me));
    }
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        if let Err(e) = seccomp {
            return Some(VmExit::VmmFailure(format!("installing seccomp: {e}")));
        }
        run_loop(&mut ctx)
    }));
    let end = match outcome {
        Ok(e) => e,
        Err(_) => Some(VmExit::VmmFailure("vCPU thread panicked".into())),
    };
    if let Some(k) = ctx.shared.kickers.get(idx) {
        k.set(None);
    }
    KVM_RUN.with(|c| c.set(std::ptr::null_mut()));
    if let Some(e) = end {
        ctx.shared.finish(e);
    }
    let mut c = ctx.shared.lock();
    c.alive = c.alive.saturating_sub(1);
    drop(c);
    ctx.shared.cv.notify_all();
}

/// Returns the reason to end the VM, or `None` when the vCPU was merely stopped.
fn run_loop(ctx: &mut VcpuContext) -> Option<VmExit> {
    // Whether the last KVM_RUN returned an exit that KVM completes only on the next
    // KVM_RUN (I/O and MMIO reads write their result into guest registers then).
    let mut incomplete = false;
    loop {
        if ctx.shared.attention.load(Ordering::SeqCst) && !control(ctx, incomplete) {
            return None;
        }
        let r = ctx.vcpu.run();
        incomplete = r.is_ok();
        let step = match r {
            Ok(exit) => handle_exit(exit, &ctx.pio, &ctx.mmio, &ctx.shared),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                ctx.vcpu.set_kvm_immediate_exit(0);
                Step::Continue
            }
            Err(e) => Step::End(VmExit::VmmFailure(format!("KVM_RUN: {e}"))),
        };
        match step {
            Step::Continue => {}
            Step::End(VmExit::InternalError { .. }) => {
                let run = ctx.vcpu.get_kvm_run();
                // SAFETY: the last exit reason was KVM_EXIT_INTERNAL_ERROR, so `internal` is
                // the active union member.
                let suberror = unsafe { run.__bindgen_anon_1.internal.suberror };
                return Some(VmExit::InternalError { suberror });
            }
            Step::End(e) => return Some(e),
        }
    }
}

/// Handles pause/stop requests. Returns false when the thread must stop. `incomplete`: the
/// last exit must be completed (see [`flush_pending_io`]) before the state is consistent.
fn control(ctx: &mut VcpuContext, incomplete: bool) -> bool {
    ctx.vcpu.set_kvm_immediate_exit(0);
    let shared = ctx.shared.clone();
    let mut c = shared.lock();
    if c.stop {
        return false;
    }
    if !c.pause_requested {
        // A stale kick: clear attention unless someone still needs it.
        if !c.stop && !c.pause_requested {
            shared.attention.store(false, Ordering::SeqCst);
        }
        return true;
    }
    if incomplete {
        flush_pending_io(&mut ctx.vcpu);
    }
    c.paused += 1;
    let mut changed = true;
    loop {
        // Save the state whenever a snapshot asks for it, also while this vCPU is still
        // paused from an earlier request: a resume followed at once by a new pause (two
        // snapshots back to back) need not let this thread out of the loop in between.
        if c.want_state {
            if let Some(slot) = c.states.get_mut(usize::from(ctx.id)) {
                if slot.is_none() {
                    *slot = Some(save_state(&ctx.kvm, &ctx.vcpu, ctx.id, ctx.has_irqchip));
                    changed = true;
                }
            }
        }
        if changed {
            shared.cv.notify_all();
            changed = false;
        }
        if c.stop || !c.pause_requested {
            break;
        }
        c = shared.cv.wait(c).unwrap_or_else(|p| p.into_inner());
    }
    c.paused = c.paused.saturating_sub(1);
    !c.stop
}

fn le_value(data: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    for (d, s) in b.iter_mut().zip(data) {
        *d = *s;
    }
    u32::from_le_bytes(b)
}

fn handle_exit(exit: VcpuExit<'_>, pio: &Bus, mmio: &Bus, shared: &Shared) -> Step {
    match exit {
        VcpuExit::IoOut(port, data) => {
            if port == layout::DEBUG_EXIT_PORT {
                return Step::End(VmExit::GuestExit {
                    code: le_value(data),
                });
            }
            if port == layout::I8042_COMMAND_PORT && data.first() == Some(&0xfe) {
                return Step::End(VmExit::Reset);
            }
            if !pio.write(u64::from(port), data) && port != layout::I8042_COMMAND_PORT {
                shared.unhandled_io.fetch_add(1, Ordering::Relaxed);
            }
            Step::Continue
        }
        VcpuExit::IoIn(port, data) => {
            if port == layout::I8042_COMMAND_PORT || port == 0x60 {
                data.fill(0);
            } else if !pio.read(u64::from(port), data) {
                data.fill(0xff);
                shared.unhandled_io.fetch_add(1, Ordering::Relaxed);
            }
            Step::Continue
        }
        VcpuExit::MmioRead(addr, data) => {
            if !mmio.read(addr, data) {
                data.fill(0xff);
                shared.unhandled_io.fetch_add(1, Ordering::Relaxed);
            }
            Step::Continue
        }
        VcpuExit::MmioWrite(addr, data) => {
            if !mmio.write(addr, data) {
                shared.unhandled_io.fetch_add(1, Ordering::Relaxed);
            }
            Step::Continue
        }
        VcpuExit::Hlt => Step::End(VmExit::Halted),
        VcpuExit::Shutdown => Step::End(VmExit::TripleFault),
        VcpuExit::InternalError => Step::End(VmExit::InternalError { suberror: 0 }),
        VcpuExit::FailEntry(reason, _) => Step::End(VmExit::FailEntry { reason }),
        VcpuExit::SystemEvent(kind, _) => match kind {
            kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => Step::End(VmExit::PowerOff),
            kvm_bindings::KVM_SYSTEM_EVENT_RESET => Step::End(VmExit::Reset),
            other => Step::End(VmExit::VmmFailure(format!("system event {other}"))),
        },
        VcpuExit::Intr | VcpuExit::IrqWindowOpen => Step::Continue,
        other => Step::End(VmExit::VmmFailure(format!("unhandled exit {other:?}"))),
    }
}
