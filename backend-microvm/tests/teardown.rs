//! Teardown without leaks: 50 create/run/destroy cycles leave the process's descriptor
//! and thread counts unchanged. Alone in its binary so no other test's VMs skew the counts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use backend_microvm::vmm::{Entry, VmExit};
use common::*;

fn host_still_fine() {
    let (vm, exit) = run(cfg(), t::HELLO);
    assert_eq!(exit, VmExit::GuestExit { code: 42 });
    assert_eq!(serial_string(&vm), "hello from the guest\n");
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

#[test]
fn fifty_create_destroy_cycles_leak_no_fds_or_threads() {
    if let Some(why) = skip_reason() {
        eprintln!("SKIP: {why}");
        return;
    }
    // Warm up process-wide state (signal handler, seccomp programs, MSR list, the ELF).
    host_still_fine();
    let fds = count("/proc/self/fd");
    let threads = count("/proc/self/task");
    for i in 0..50 {
        let mut c = cfg();
        c.virtio_console = i % 2 == 0;
        let (mut vm, entry) = vm_with_guest(c);
        let _console = vm.take_console();
        vm.start(Entry::user(entry).with_arg(if i % 3 == 0 { t::SPIN } else { t::HELLO }))
            .unwrap();
        if i % 3 == 0 {
            vm.kill();
        }
        vm.wait();
        drop(vm);
    }
    assert_eq!(count("/proc/self/fd"), fds);
    assert_eq!(count("/proc/self/task"), threads);
}
