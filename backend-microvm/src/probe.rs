//! What this host's KVM can do, measured once per process.
//!
//! Opening `/dev/kvm` tells whether KVM exists and is ours to use. Whether a Linux guest can
//! run is another matter: on nested, PVM-style KVM (the `kvm_pvm` module) guest code at
//! CPL 3 runs natively but CPL 0 is emulated (~2 M instructions/s), and a Linux kernel never
//! finishes booting. So the probe runs the same tiny loop at CPL 0 and at CPL 3 in
//! throwaway VMs (each bounded by a deadline: the probe never hangs) and compares.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::layout;
use crate::vmm::{Entry, Vm, VmConfig, VmExit, VmmError};

/// The message for hosts where kernel mode is emulated.
pub const EMULATED_KERNEL_MODE: &str =
    "Linux guests unsupported on this host: kernel mode is emulated (nested PVM-style KVM)";

/// Loop iterations of the probe guest.
const LOOP_ITERS: u32 = 200_000;
/// Where the probe code goes (2 MiB: its own large page, away from the boot structures).
const PROBE_CODE_ADDR: u64 = 0x20_0000;
/// Deadline of each probe VM.
const PROBE_DEADLINE: Duration = Duration::from_millis(250);

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KvmProbe {
    /// `/dev/kvm` can be opened and VMs created: tiny (user-mode) guests work.
    pub present: bool,
    /// Guest kernel mode runs at hardware speed: Linux guests work.
    pub hardware_kernel_mode: bool,
    /// One line for users: why not, or that all is well.
    pub reason: String,
    /// What to do about it, when something is missing.
    pub fix: Option<String>,
    /// Measured CPL 3 loop time.
    pub user_loop: Option<Duration>,
    /// Measured CPL 0 loop time (`None` if it hit the deadline or did not run).
    pub kernel_loop: Option<Duration>,
    /// Facts gathered on the way (`key: value` lines).
    pub details: Vec<String>,
}

impl KvmProbe {
    /// Whether Linux guests can run here.
    pub fn linux_guests_supported(&self) -> bool {
        self.present && self.hardware_kernel_mode
    }
}

/// Probes once per process and returns the cached result.
pub fn probe_kvm() -> KvmProbe {
    static PROBE: OnceLock<KvmProbe> = OnceLock::new();
    PROBE.get_or_init(run_probe).clone()
}

fn host_details() -> Vec<String> {
    let mut d = Vec::new();
    for m in ["kvm", "kvm_intel", "kvm_amd", "kvm_pvm"] {
        let present = std::path::Path::new(&format!("/sys/module/{m}")).exists();
        d.push(format!(
            "module {m}: {}",
            if present { "loaded" } else { "absent" }
        ));
    }
    for p in [
        "/sys/module/kvm_intel/parameters/nested",
        "/sys/module/kvm_amd/parameters/nested",
    ] {
        if let Ok(v) = std::fs::read_to_string(p) {
            d.push(format!("{p}: {}", v.trim()));
        }
    }
    if let Ok(c) = std::fs::read_to_string("/proc/cpuinfo") {
        if let Some(flags) = c.lines().find(|l| l.starts_with("flags")) {
            let has = |f: &str| flags.split_whitespace().any(|x| x == f);
            d.push(format!(
                "cpu flags: vmx={} svm={} hypervisor={}",
                has("vmx"),
                has("svm"),
                has("hypervisor")
            ));
        }
    }
    d
}

/// `mov ecx, N; 1: dec ecx; jnz 1b; mov dx, DEBUG_EXIT_PORT; out dx, al`.
fn loop_code(iters: u32) -> Vec<u8> {
    let mut c = vec![0xb9];
    c.extend_from_slice(&iters.to_le_bytes());
    c.extend_from_slice(&[0xff, 0xc9, 0x75, 0xfc, 0x66, 0xba]);
    c.extend_from_slice(&layout::DEBUG_EXIT_PORT.to_le_bytes());
    c.push(0xee);
    c
}

/// Runs the loop once in a throwaway VM; `Ok(None)` when it hit the deadline.
fn time_loop(kernel: bool) -> Result<Option<Duration>, VmmError> {
    let mut vm = Vm::new(VmConfig {
        mem_size: 4 << 20,
        deadline: Some(PROBE_DEADLINE),
        ..VmConfig::default()
    })?;
    vm.memory()
        .write_slice_at(&loop_code(LOOP_ITERS), PROBE_CODE_ADDR)?;
    let entry = if kernel {
        Entry::kernel(PROBE_CODE_ADDR)
    } else {
        Entry::user(PROBE_CODE_ADDR)
    };
    let t = Instant::now();
    vm.start(entry)?;
    let exit = vm.wait();
    let dt = t.elapsed();
    match exit {
        VmExit::GuestExit { .. } => Ok(Some(dt)),
        VmExit::DeadlineExceeded => Ok(None),
        other => Err(VmmError::State(format!("probe guest ended with: {other}"))),
    }
}

trait WriteAt {
    fn write_slice_at(&self, data: &[u8], addr: u64) -> Result<(), VmmError>;
}

impl WriteAt for vm_memory::GuestMemoryMmap {
    fn write_slice_at(&self, data: &[u8], addr: u64) -> Result<(), VmmError> {
        use vm_memory::Bytes;
        self.write_slice(data, vm_memory::GuestAddress(addr))
            .map_err(|e| VmmError::memory(e.to_string()))
    }
}

fn run_probe() -> KvmProbe {
    let mut details = host_details();
    let mut p = KvmProbe {
        present: false,
        hardware_kernel_mode: false,
        reason: String::new(),
        fix: None,
        user_loop: None,
        kernel_loop: None,
        details: Vec::new(),
    };
    match kvm_ioctls::Kvm::new() {
        Ok(kvm) => details.push(format!("KVM API version: {}", kvm.get_api_version())),
        Err(e) => {
            let (reason, fix) = match e.errno() {
                libc::ENOENT => (
                    "/dev/kvm does not exist",
                    "load kvm_intel/kvm_amd, or use a host (or VM type) with hardware virtualization",
                ),
                libc::EACCES | libc::EPERM => (
                    "no permission to open /dev/kvm",
                    "add this user to the `kvm` group (or grant it rw on /dev/kvm)",
                ),
                _ => ("/dev/kvm cannot be opened", "check the KVM setup"),
            };
            p.reason = format!("{reason} ({e})");
            p.fix = Some(fix.to_string());
            p.details = details;
            return p;
        }
    }
    let user = match time_loop(false) {
        Ok(Some(d)) => d,
        Ok(None) => {
            p.reason = "KVM is present but a user-mode guest loop did not finish in time".into();
            p.fix = Some("check host load and the KVM module".into());
            p.details = details;
            return p;
        }
        Err(e) => {
            p.reason = format!("KVM is present but a test VM failed: {e}");
            p.fix = Some("check the KVM module and its messages in dmesg".into());
            p.details = details;
            return p;
        }
    };
    p.present = true;
    p.user_loop = Some(user);
    let kernel = time_loop(true);
    match kernel {
        Ok(Some(k)) => {
            p.kernel_loop = Some(k);
            // Hardware: both loops take about as long. Emulated: orders of magnitude apart.
            p.hardware_kernel_mode = k <= user * 10 + Duration::from_millis(5);
        }
        Ok(None) => {}
        Err(e) => details.push(format!("kernel-mode loop failed: {e}")),
    }
    details.push(format!(
        "loop of {LOOP_ITERS} iterations: CPL3 {:?}, CPL0 {}",
        user,
        p.kernel_loop.map_or_else(
            || format!("> {PROBE_DEADLINE:?} (deadline)"),
            |k| format!("{k:?}")
        )
    ));
    if p.hardware_kernel_mode {
        p.reason = "hardware KVM: guest kernel mode runs natively".into();
    } else {
        p.reason = EMULATED_KERNEL_MODE.into();
        p.fix = Some(
            "run Linux microVMs on a host with hardware virtualization (bare metal or nested \
             VMX/SVM); tiny user-mode guests still work here"
                .into(),
        );
    }
    p.details = details;
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_code_is_well_formed() {
        let c = loop_code(5);
        assert_eq!(c[0], 0xb9);
        assert_eq!(&c[1..5], &5u32.to_le_bytes());
        assert_eq!(*c.last().unwrap(), 0xee);
    }
}
