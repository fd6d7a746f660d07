//! Shared helpers for the tiny-guest tests: building the guest with gcc, skipping when KVM
//! is unusable, running a guest to its end.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use backend_microvm::probe::probe_kvm;
use backend_microvm::vmm::{Entry, Vm, VmConfig, VmExit};

/// Where tests/guests/tiny.c is linked (its first PT_LOAD).
pub const LINK_ADDR: u64 = 0x20_0000;
/// The guest's GO_FLAG word.
pub const GO_FLAG: u64 = 0x30_0000;

/// Test selectors understood by tiny.c (passed in rsi).
pub mod t {
    pub const HELLO: u64 = 0;
    pub const COMPUTE: u64 = 1;
    pub const COMPUTE_WAIT_HALFWAY: u64 = 2;
    pub const TRIPLE_FAULT: u64 = 3;
    pub const SPIN: u64 = 4;
    pub const SERIAL_FLOOD: u64 = 5;
    pub const UNMAPPED_MMIO: u64 = 6;
    pub const CONSOLE_ECHO: u64 = 7;
    pub const VIRTIO_GARBAGE_ADDR: u64 = 8;
    pub const VIRTIO_GARBAGE_RING: u64 = 9;
    pub const TWO_VCPUS: u64 = 10;
    pub const WAIT_GO: u64 = 11;
    pub const REP_OUTSB: u64 = 12;
    pub const BLK_READ: u64 = 13;
    pub const BLK_READ_WAIT: u64 = 14;
    pub const NET_ECHO: u64 = 15;
    pub const NET_BAD_THEN_GOOD: u64 = 16;
    pub const NET_SMALL_BUFFERS: u64 = 17;
    pub const NET_BAD_THEN_WAIT: u64 = 18;
    pub const FILL_WAIT_READ: u64 = 19;
}

/// Why KVM tests must skip here, if they must (only when /dev/kvm is unusable).
pub fn skip_reason() -> Option<String> {
    let p = probe_kvm();
    if p.present {
        None
    } else {
        Some(format!("KVM unusable: {} (fix: {:?})", p.reason, p.fix))
    }
}

/// The tiny guest ELF, compiled once per test binary.
pub fn tiny_guest() -> &'static [u8] {
    static ELF: OnceLock<Vec<u8>> = OnceLock::new();
    ELF.get_or_init(|| {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/guests/tiny.c");
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("tiny");
        let st = Command::new("gcc")
            .args([
                "-O2",
                "-ffreestanding",
                "-nostdlib",
                "-static",
                "-fno-pic",
                "-no-pie",
                "-mno-red-zone",
                "-mgeneral-regs-only",
                "-fno-stack-protector",
                "-fno-asynchronous-unwind-tables",
                "-Wl,-Ttext-segment=0x200000",
                "-Wl,--build-id=none",
                "-o",
            ])
            .arg(&out)
            .arg(&src)
            .status()
            .expect("gcc must be installed to build the tiny test guest");
        assert!(st.success(), "gcc failed to build {}", src.display());
        std::fs::read(&out).unwrap()
    })
}

/// A config for tiny guests: 16 MiB, one vCPU, a generous deadline so a broken test
/// cannot hang CI.
pub fn cfg() -> VmConfig {
    VmConfig::default()
        .mem_size(16 << 20)
        .deadline(Some(Duration::from_secs(60)))
}

/// Creates a VM with the tiny guest loaded, not started. Returns it and the entry.
pub fn vm_with_guest(cfg: VmConfig) -> (Vm, u64) {
    let vm = Vm::new(cfg).unwrap();
    let entry = vm.load_elf(tiny_guest()).unwrap();
    (vm, entry)
}

/// Runs test `test` to its end.
pub fn run(cfg: VmConfig, test: u64) -> (Vm, VmExit) {
    let (mut vm, entry) = vm_with_guest(cfg);
    vm.start(Entry::user(entry).with_arg(test)).unwrap();
    let e = vm.wait();
    (vm, e)
}

/// A VM running the tiny guest's `WAIT_GO` test, which has said it is waiting (`W`).
pub fn waiting_vm(cfg: VmConfig) -> Vm {
    let (mut vm, entry) = vm_with_guest(cfg);
    vm.start(Entry::user(entry).with_arg(t::WAIT_GO)).unwrap();
    assert!(wait_serial(&vm, "W"));
    vm
}

/// Waits until the serial output contains `needle` (or the VM ends).
pub fn wait_serial(vm: &Vm, needle: &str) -> bool {
    loop {
        if String::from_utf8_lossy(&vm.serial_output()).contains(needle) {
            return true;
        }
        if vm.exit().is_some() {
            return String::from_utf8_lossy(&vm.serial_output()).contains(needle);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Sets the guest's GO_FLAG.
pub fn set_go(vm: &Vm) {
    use vm_memory::{Bytes, GuestAddress};
    vm.memory().write_obj(1u32, GuestAddress(GO_FLAG)).unwrap();
}

pub fn serial_string(vm: &Vm) -> String {
    String::from_utf8_lossy(&vm.serial_output()).into_owned()
}

/// Removes `dir` (recursively) when the test process exits: for directories that statics
/// own (a static is never dropped, so a `TempDir` in one leaked 139 MB per run).
pub fn remove_at_exit(dir: PathBuf) {
    static DIRS: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    extern "C" fn remove_all() {
        if let Ok(dirs) = DIRS.lock() {
            for d in dirs.iter() {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
    let mut dirs = DIRS.lock().unwrap();
    if dirs.is_empty() {
        // SAFETY: registers a plain `extern "C"` function with atexit(3).
        unsafe { libc::atexit(remove_all) };
    }
    dirs.push(dir);
}
