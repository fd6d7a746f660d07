//! Hostile tiny guests: each misbehaviour ends as a typed outcome for that VM only; the
//! host process (and the next VM) is fine.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use backend_microvm::vmm::{Entry, Vm, VmExit};
use common::*;

macro_rules! skip_without_kvm {
    () => {
        if let Some(why) = skip_reason() {
            eprintln!("SKIP: {why}");
            return;
        }
    };
}

/// After each hostile guest, a fresh VM must still work.
fn host_still_fine() {
    let (vm, exit) = run(cfg(), t::HELLO);
    assert_eq!(exit, VmExit::GuestExit { code: 42 });
    assert_eq!(serial_string(&vm), "hello from the guest\n");
}

#[test]
fn triple_fault_is_a_typed_exit() {
    skip_without_kvm!();
    let (_vm, exit) = run(cfg(), t::TRIPLE_FAULT);
    assert_eq!(exit, VmExit::TripleFault);
    host_still_fine();
}

#[test]
fn spinning_guest_is_killed_at_the_deadline() {
    skip_without_kvm!();
    let mut c = cfg();
    c.deadline = Some(Duration::from_millis(200));
    let (_vm, exit) = run(c, t::SPIN);
    assert_eq!(exit, VmExit::DeadlineExceeded);
    host_still_fine();
}

#[test]
fn spinning_guest_can_be_killed_by_the_host() {
    skip_without_kvm!();
    let (mut vm, entry) = vm_with_guest(cfg());
    vm.start(Entry::user(entry).with_arg(t::SPIN)).unwrap();
    assert_eq!(vm.wait_timeout(Duration::from_millis(20)), None);
    vm.kill();
    assert_eq!(vm.wait(), VmExit::Killed);
    // Operations on a dead VM are typed errors.
    assert!(vm.pause().is_err());
    assert!(vm.snapshot(tempfile::tempdir().unwrap().path()).is_err());
}

#[test]
fn serial_flood_is_capped_and_counted() {
    skip_without_kvm!();
    let mut c = cfg();
    c.serial_cap = 4096;
    let (vm, exit) = run(c, t::SERIAL_FLOOD);
    assert_eq!(exit, VmExit::GuestExit { code: 5 });
    assert_eq!(vm.serial_output().len(), 4096);
    assert_eq!(vm.serial_dropped(), 100_000 - 4096);
    host_still_fine();
}

#[test]
fn virtqueue_outside_ram_breaks_the_device_not_the_host() {
    skip_without_kvm!();
    let mut c = cfg();
    c.virtio_console = true;
    let (vm, exit) = run(c, t::VIRTIO_GARBAGE_ADDR);
    // The guest reads back the status: NEEDS_RESET (64) is set.
    match exit {
        VmExit::GuestExit { code } => assert_ne!(code & 64, 0, "status {code:#x}"),
        other => panic!("unexpected exit {other:?}"),
    }
    let errs = vm.virtio_errors();
    assert!(
        errs[0].as_deref().unwrap().contains("not inside guest RAM"),
        "{errs:?}"
    );
    host_still_fine();
}

#[test]
fn garbage_virtqueue_contents_break_the_device_not_the_host() {
    skip_without_kvm!();
    let mut c = cfg();
    c.virtio_console = true;
    let (vm, exit) = run(c, t::VIRTIO_GARBAGE_RING);
    match exit {
        VmExit::GuestExit { code } => assert_ne!(code & 64, 0, "status {code:#x}"),
        other => panic!("unexpected exit {other:?}"),
    }
    assert!(vm.virtio_errors()[0].is_some());
    host_still_fine();
}

#[test]
fn unmapped_mmio_is_ignored_and_counted() {
    skip_without_kvm!();
    let (vm, exit) = run(cfg(), t::UNMAPPED_MMIO);
    assert_eq!(exit, VmExit::GuestExit { code: 0xffff_ffff });
    assert_eq!(vm.unhandled_io_count(), 3);
    host_still_fine();
}

#[test]
fn bad_images_and_configs_are_typed_errors() {
    skip_without_kvm!();
    let vm = Vm::new(cfg()).unwrap();
    assert!(vm.load_elf(b"\x7fELF garbage").is_err());
    let mut elf = tiny_guest().to_vec();
    elf.truncate(100);
    assert!(vm.load_elf(&elf).is_err());
    let mut c = cfg();
    c.mem_size = 12345;
    assert!(Vm::new(c).is_err());
    let mut c = cfg();
    c.vcpus = 0;
    assert!(Vm::new(c).is_err());
}

#[test]
fn stopping_and_continuing_the_process_leaves_vms_running() {
    // A debugger, strace attaching or Ctrl-Z stops and continues every thread; the VMM's
    // threads (in poll/futex under seccomp) must resume, not fail.
    skip_without_kvm!();
    // One VM running (its vCPU in KVM_RUN), one paused (its vCPU waiting on a condvar); both
    // have their I/O thread in poll.
    let vms: Vec<_> = [false, true]
        .into_iter()
        .map(|paused| {
            let mut c = cfg();
            c.virtio_console = paused;
            let (mut vm, entry) = vm_with_guest(c);
            let console = vm.take_console();
            vm.start(Entry::user(entry).with_arg(t::WAIT_GO)).unwrap();
            assert!(wait_serial(&vm, "W"));
            if paused {
                vm.pause().unwrap();
            }
            (vm, console)
        })
        .collect();
    let pid = std::process::id();
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("kill -STOP {pid}; sleep 0.2; kill -CONT {pid}"))
        .status()
        .unwrap();
    assert!(st.success());
    for (vm, _console) in &vms {
        vm.resume().unwrap();
        set_go(vm);
        assert_eq!(vm.wait(), VmExit::GuestExit { code: 11 });
    }
    host_still_fine();
}
