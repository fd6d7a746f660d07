//! Tiny guests (freestanding x86-64 code at CPL 3, built with gcc by the harness) exercising
//! the VMM for real: VM and memory set-up, the run loop and its exits, the serial port, the
//! virtio-mmio console, snapshot/restore, seccomp and teardown.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;

use backend_microvm::vmm::VmExit;

macro_rules! skip_without_kvm {
    () => {
        if let Some(why) = skip_reason() {
            eprintln!("SKIP: {why}");
            return;
        }
    };
}

#[test]
fn hello_prints_on_serial_and_exits_with_code() {
    skip_without_kvm!();
    let (vm, exit) = run(cfg(), t::HELLO);
    assert_eq!(exit, VmExit::GuestExit { code: 42 });
    assert_eq!(serial_string(&vm), "hello from the guest\n");
    assert_eq!(vm.unhandled_io_count(), 0);
}

#[test]
fn probe_reports_this_host() {
    let p = backend_microvm::probe::probe_kvm();
    eprintln!("probe: {p:#?}");
    if !p.present {
        eprintln!("SKIP: {}", p.reason);
        return;
    }
    assert!(p.user_loop.is_some());
    if !p.hardware_kernel_mode {
        assert_eq!(p.reason, backend_microvm::probe::EMULATED_KERNEL_MODE);
        assert!(p.fix.is_some());
    }
    // Cached: the second call is the same answer.
    assert_eq!(backend_microvm::probe::probe_kvm(), p);
}

#[test]
fn rep_outsb_reaches_the_serial_port() {
    skip_without_kvm!();
    let (vm, exit) = run(cfg(), t::REP_OUTSB);
    assert_eq!(exit, VmExit::GuestExit { code: 12 });
    assert_eq!(serial_string(&vm), "ping from the guest");
}

#[test]
fn computation_gives_the_expected_result() {
    skip_without_kvm!();
    let (vm, exit) = run(cfg(), t::COMPUTE);
    assert_eq!(exit, VmExit::GuestExit { code: 7 });
    assert!(serial_string(&vm).starts_with("0x"));
}

#[test]
fn two_vcpus_run_concurrently() {
    skip_without_kvm!();
    let mut c = cfg();
    c.vcpus = 2;
    let (vm, exit) = run(c, t::TWO_VCPUS);
    assert_eq!(exit, VmExit::GuestExit { code: 10 });
    assert_eq!(serial_string(&vm), "both vCPUs ran\n");
}

#[test]
fn console_request_and_answer_over_virtio() {
    skip_without_kvm!();
    use std::io::{Read, Write};
    let mut c = cfg();
    c.virtio_console = true;
    let (mut vm, entry) = vm_with_guest(c);
    assert_eq!(vm.virtio_devices().len(), 1);
    let mut host = vm.take_console().unwrap();
    host.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    vm.start(backend_microvm::vmm::Entry {
        arg: t::CONSOLE_ECHO,
        ..backend_microvm::vmm::Entry::user(entry)
    })
    .unwrap();
    let mut got = Vec::new();
    let want = b"ping from the guest";
    while got.len() < want.len() {
        let mut b = [0u8; 64];
        let n = host.read(&mut b).unwrap();
        assert!(n > 0, "console closed early");
        got.extend_from_slice(&b[..n]);
    }
    assert_eq!(&got, want);
    host.write_all(b"pong from the host").unwrap();
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 0 });
    assert_eq!(serial_string(&vm), "guest got: pong from the host\n");
    assert_eq!(vm.virtio_errors(), vec![None]);
}

#[test]
fn pause_resume_and_seccomp_on_vcpu_threads() {
    skip_without_kvm!();
    let vm = waiting_vm(cfg());
    // The vCPU thread runs under its own seccomp filter; this (test) thread does not.
    let tid = vm.vcpu_thread_ids()[0];
    assert_ne!(tid, 0);
    assert_eq!(backend_microvm::seccomp::thread_seccomp_mode(tid), Some(2));
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() };
    assert_eq!(backend_microvm::seccomp::thread_seccomp_mode(me), Some(0));
    vm.pause().unwrap();
    vm.pause().unwrap();
    set_go(&vm);
    assert_eq!(vm.exit(), None);
    vm.resume().unwrap();
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 11 });
}

fn compute_reference() -> String {
    let (vm, exit) = run(cfg(), t::COMPUTE);
    assert_eq!(exit, VmExit::GuestExit { code: 7 });
    serial_string(&vm)
}

#[test]
fn snapshot_mid_computation_restores_into_a_new_vm() {
    skip_without_kvm!();
    let reference = compute_reference();
    let dir = tempfile::tempdir().unwrap();
    let (mut vm, entry) = vm_with_guest(cfg());
    vm.start(backend_microvm::vmm::Entry {
        arg: t::COMPUTE_WAIT_HALFWAY,
        ..backend_microvm::vmm::Entry::user(entry)
    })
    .unwrap();
    assert!(wait_serial(&vm, "H"));
    let t0 = std::time::Instant::now();
    let info = vm.snapshot(dir.path()).unwrap();
    let t_snap = t0.elapsed();
    assert!(info.memory_bytes_written > 0);
    assert!(
        info.memory_bytes_written < 16 << 20,
        "memory file is sparse"
    );

    let t1 = std::time::Instant::now();
    let restored = backend_microvm::vmm::Vm::restore(dir.path(), cfg()).unwrap();
    let t_restore = t1.elapsed();
    eprintln!(
        "snapshot {t_snap:?}, restore {t_restore:?}, {} bytes written",
        info.memory_bytes_written
    );
    // The restored VM has the serial output from before the snapshot only in the
    // original's buffer; it continues from the wait.
    set_go(&restored);
    assert_eq!(restored.wait(), VmExit::GuestExit { code: 7 });
    let out = serial_string(&restored);
    // The restored VM's serial buffer starts empty: it holds only what came after "H".
    assert_eq!(format!("H{out}"), format!("H{reference}"));

    // The original continues too, to the same result.
    set_go(&vm);
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 7 });
    assert_eq!(serial_string(&vm), format!("H{reference}"));

    // A second restore from the same files still works (copy-on-write kept them intact).
    let again = backend_microvm::vmm::Vm::restore(dir.path(), cfg()).unwrap();
    set_go(&again);
    assert_eq!(again.wait(), VmExit::GuestExit { code: 7 });
    assert_eq!(
        format!("H{}", serial_string(&again)),
        format!("H{reference}")
    );
}

#[test]
fn snapshot_of_a_virtio_vm_restores_and_serves_the_console() {
    skip_without_kvm!();
    use std::io::{Read, Write};
    let mut c = cfg();
    c.virtio_console = true;
    let (mut vm, entry) = vm_with_guest(c.clone());
    let mut host = vm.take_console().unwrap();
    vm.start(backend_microvm::vmm::Entry {
        arg: t::CONSOLE_ECHO,
        ..backend_microvm::vmm::Entry::user(entry)
    })
    .unwrap();
    // Wait for the guest's request, then snapshot while it polls for the answer.
    let mut got = Vec::new();
    while got.len() < 19 {
        let mut b = [0u8; 64];
        let n = host.read(&mut b).unwrap();
        got.extend_from_slice(&b[..n]);
    }
    let dir = tempfile::tempdir().unwrap();
    vm.snapshot(dir.path()).unwrap();
    drop(vm);
    let mut restored = backend_microvm::vmm::Vm::restore(dir.path(), c).unwrap();
    let mut host2 = restored.take_console().unwrap();
    host2.write_all(b"answer after restore").unwrap();
    assert_eq!(restored.wait(), VmExit::GuestExit { code: 0 });
    assert_eq!(
        serial_string(&restored),
        "guest got: answer after restore\n"
    );
}

#[test]
fn snapshot_with_another_version_or_memory_size_is_refused() {
    skip_without_kvm!();
    let vm = waiting_vm(cfg());
    let dir = tempfile::tempdir().unwrap();
    vm.snapshot(dir.path()).unwrap();
    let mut other = cfg();
    other.mem_size = 32 << 20;
    let e = backend_microvm::vmm::Vm::restore(dir.path(), other).unwrap_err();
    assert!(
        matches!(e, backend_microvm::vmm::VmmError::SnapshotIncompatible(_)),
        "{e}"
    );
    let state = dir.path().join("vm-state.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    v["format_version"] = serde_json::json!(999);
    std::fs::write(&state, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = backend_microvm::vmm::Vm::restore(dir.path(), cfg()).unwrap_err();
    assert!(
        matches!(e, backend_microvm::vmm::VmmError::SnapshotIncompatible(_)),
        "{e}"
    );
    std::fs::write(&state, b"{not json").unwrap();
    let e = backend_microvm::vmm::Vm::restore(dir.path(), cfg()).unwrap_err();
    assert!(
        matches!(e, backend_microvm::vmm::VmmError::SnapshotCorrupt(_)),
        "{e}"
    );
    set_go(&vm);
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 11 });
}

#[test]
fn back_to_back_snapshots_each_capture_the_vcpus() {
    // A resume followed at once by the next snapshot's pause must not lose the second
    // request (the vCPU thread may not have left its paused state in between).
    skip_without_kvm!();
    let vm = waiting_vm(cfg());
    let dir = tempfile::tempdir().unwrap();
    for i in 0..100 {
        vm.snapshot(&dir.path().join(format!("s{i}"))).unwrap();
    }
    let restored = backend_microvm::vmm::Vm::restore(&dir.path().join("s99"), cfg()).unwrap();
    set_go(&restored);
    assert_eq!(restored.wait(), VmExit::GuestExit { code: 11 });
    set_go(&vm);
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 11 });
}
