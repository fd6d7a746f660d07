//! Tiny guests (freestanding x86-64 code at CPL 3, built with gcc by the harness) exercising
//! the VMM for real: VM and memory set-up, the run loop and its exits, the serial port, the
//! virtio-mmio console and read-only block device, snapshot/restore, seccomp and teardown.
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
    vm.start(backend_microvm::vmm::Entry::user(entry).with_arg(t::CONSOLE_ECHO))
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
    vm.start(backend_microvm::vmm::Entry::user(entry).with_arg(t::COMPUTE_WAIT_HALFWAY))
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
    vm.start(backend_microvm::vmm::Entry::user(entry).with_arg(t::CONSOLE_ECHO))
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

/// The bytes of the block device's backing file: 16 sectors and a partial 17th, which the
/// guest does not see.
fn blk_image() -> Vec<u8> {
    (0..16 * 512 + 100)
        .map(|i: usize| (i.wrapping_mul(31) ^ (i >> 9).wrapping_mul(7)) as u8)
        .collect()
}

/// A backing file holding `data`.
fn blk_file(data: &[u8]) -> tempfile::NamedTempFile {
    use std::io::Write;
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(data).unwrap();
    f.flush().unwrap();
    f
}

/// A config with the console (device 0, unused) and the block device (device 1).
fn blk_cfg(path: &std::path::Path) -> backend_microvm::vmm::VmConfig {
    let mut c = cfg();
    c.virtio_console = true;
    c.block = Some(backend_microvm::vmm::BlockConfig::new(path, "tiny-disk"));
    c
}

/// FNV-1a (64-bit), as the tiny guest hashes what it read.
fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// What the guest prints for its 2-sector read from sector 1.
fn blk_in_lines(image: &[u8]) -> String {
    format!(
        "in status 0x0000000000000000 len 0x0000000000000401\nhash {:#018x}\n",
        fnv1a(&image[512..1536])
    )
}

/// What the guest prints for its configuration check.
const BLK_CONFIG_LINE: &str =
    "ro 0x0000000000000001 capacity 0x0000000000000010 seg_max 0x00000000000000fe\n";

/// What the guest prints after its reads: GET_ID, the refused OUT, the IN past the end.
const BLK_TAIL: &str = "id status 0x0000000000000000 len 0x0000000000000015\n\
                        id tiny-disk\n\
                        out status 0x0000000000000002 len 0x0000000000000001\n\
                        past end status 0x0000000000000001 len 0x0000000000000001\n";

/// The guest's exit code: the device status register, DRIVER_OK and no NEEDS_RESET.
const BLK_EXIT: u32 = 1 | 2 | 4 | 8;

#[test]
fn block_device_serves_reads_id_and_refuses_writes() {
    skip_without_kvm!();
    let image = blk_image();
    let f = blk_file(&image);
    let (vm, exit) = run(blk_cfg(f.path()), t::BLK_READ);
    let out = serial_string(&vm);
    assert_eq!(exit, VmExit::GuestExit { code: BLK_EXIT }, "{out}");
    assert_eq!(
        out,
        format!("{BLK_CONFIG_LINE}{}{BLK_TAIL}", blk_in_lines(&image))
    );
    assert_eq!(vm.virtio_errors(), vec![None, None]);
    let devs = vm.virtio_devices();
    assert_eq!(devs.len(), 2);
    assert_eq!((devs[0].device_type, devs[0].base), (3, 0xd000_0000));
    assert_eq!(
        (devs[1].device_type, devs[1].base, devs[1].irq),
        (2, 0xd000_1000, 6)
    );
    // Read-only by construction: the file is as it was.
    assert_eq!(std::fs::read(f.path()).unwrap(), image);
}

#[test]
fn block_device_config_errors_are_typed() {
    skip_without_kvm!();
    use backend_microvm::vmm::{Vm, VmmError};
    let dir = tempfile::tempdir().unwrap();
    let e = Vm::new(blk_cfg(&dir.path().join("missing"))).unwrap_err();
    assert!(matches!(e, VmmError::Io { .. }), "{e}");
    let f = blk_file(&blk_image());
    let mut c = blk_cfg(f.path());
    if let Some(b) = c.block.as_mut() {
        b.id = "x".repeat(21);
    }
    let e = Vm::new(c).unwrap_err();
    assert!(matches!(e, VmmError::InvalidConfig(_)), "{e}");
}

#[test]
fn snapshot_with_a_block_device_restores_and_keeps_reading() {
    skip_without_kvm!();
    use backend_microvm::vmm::{Vm, VmmError};
    let image = blk_image();
    let f = blk_file(&image);
    let (mut vm, entry) = vm_with_guest(blk_cfg(f.path()));
    vm.start(backend_microvm::vmm::Entry::user(entry).with_arg(t::BLK_READ_WAIT))
        .unwrap();
    assert!(wait_serial(&vm, "WAIT\n"), "{}", serial_string(&vm));
    let dir = tempfile::tempdir().unwrap();
    vm.snapshot(dir.path()).unwrap();
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("vm-state.json")).unwrap()).unwrap();
    let types: Vec<_> = state["virtio"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["device_type"].as_u64().unwrap())
        .collect();
    assert_eq!(types, vec![3, 2]);

    // Without the block device, or with a disk of another size: refused.
    let e = Vm::restore(dir.path(), cfg()).unwrap_err();
    assert!(matches!(e, VmmError::SnapshotIncompatible(_)), "{e}");
    let small = blk_file(&image[..8 * 512]);
    let e = Vm::restore(dir.path(), blk_cfg(small.path())).unwrap_err();
    assert!(matches!(e, VmmError::SnapshotIncompatible(_)), "{e}");

    // With it: the guest reads again after the restore, then finishes.
    let restored = Vm::restore(dir.path(), blk_cfg(f.path())).unwrap();
    set_go(&restored);
    let exit = restored.wait();
    let out = serial_string(&restored);
    assert_eq!(exit, VmExit::GuestExit { code: BLK_EXIT }, "{out}");
    assert_eq!(out, format!("{}{BLK_TAIL}", blk_in_lines(&image)));
    assert_eq!(restored.virtio_errors(), vec![None, None]);

    // The original goes on too.
    set_go(&vm);
    assert_eq!(vm.wait(), VmExit::GuestExit { code: BLK_EXIT });
    let in_lines = blk_in_lines(&image);
    assert_eq!(
        serial_string(&vm),
        format!("{BLK_CONFIG_LINE}{in_lines}WAIT\n{in_lines}{BLK_TAIL}")
    );
}

#[test]
fn a_pool_of_irqchip_vms_serves_restores_and_new_vms() {
    skip_without_kvm!();
    use backend_microvm::vmm::{Entry, Vm, VmPool, VmmError};
    let reference = compute_reference();
    let c = cfg();
    assert!(c.irqchip, "the pool is for the default (irqchip) VMs");
    let pool = VmPool::new(c.mem_size, c.vcpus, true, 2).unwrap();
    assert_eq!(pool.fill().unwrap(), 2);
    assert_eq!(pool.ready(), 2);

    // A snapshot in the middle of a computation, restored into pooled VMs: the same
    // result as the original, from each.
    let dir = tempfile::tempdir().unwrap();
    let (mut vm, entry) = vm_with_guest(cfg());
    vm.start(Entry::user(entry).with_arg(t::COMPUTE_WAIT_HALFWAY))
        .unwrap();
    assert!(wait_serial(&vm, "H"));
    vm.snapshot(dir.path()).unwrap();
    drop(vm);
    for left in [1, 0, 0] {
        // The third restore finds the pool empty and makes its VM as `restore` does.
        let r = Vm::restore_pooled(dir.path(), cfg(), &pool).unwrap();
        assert_eq!(pool.ready(), left);
        assert!(r.has_irqchip());
        set_go(&r);
        assert_eq!(r.wait(), VmExit::GuestExit { code: 7 });
        assert_eq!(format!("H{}", serial_string(&r)), format!("H{reference}"));
    }

    // A new VM from the pool runs a guest from its (fresh, zeroed) memory.
    pool.fill().unwrap();
    let mut vm = Vm::new_pooled(cfg(), &pool).unwrap();
    assert_eq!(pool.ready(), 1);
    let entry = vm.load_elf(tiny_guest()).unwrap();
    vm.start(Entry::user(entry).with_arg(t::HELLO)).unwrap();
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 42 });
    assert_eq!(serial_string(&vm), "hello from the guest\n");

    // Another size or irqchip choice is not taken from the pool (made as usual instead).
    let other = cfg().mem_size(32 << 20);
    drop(Vm::new_pooled(other, &pool).unwrap());
    drop(Vm::new_pooled(cfg().irqchip(false), &pool).unwrap());
    assert_eq!(pool.ready(), 1);

    // A memory file of the wrong size: a clear error, and the next restore still works.
    let bad = tempfile::tempdir().unwrap();
    for f in ["vm-state.json", "memory.bin"] {
        std::fs::copy(dir.path().join(f), bad.path().join(f)).unwrap();
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(bad.path().join("memory.bin"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let e = Vm::restore_pooled(bad.path(), cfg(), &pool).unwrap_err();
    assert!(matches!(e, VmmError::SnapshotCorrupt(_)), "{e}");
    pool.fill().unwrap();
    let r = Vm::restore_pooled(dir.path(), cfg(), &pool).unwrap();
    set_go(&r);
    assert_eq!(r.wait(), VmExit::GuestExit { code: 7 });
    assert!(
        VmPool::new(1 << 20, 1, true, 1).is_err(),
        "too little memory"
    );
    assert!(VmPool::new(16 << 20, 0, true, 1).is_err(), "no vCPU");
}

/// This process's proportional set size in KiB (`/proc/self/smaps_rollup`): pages mapped by
/// several VMs count once in all.
fn pss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Boot once, start many: VMs restored from one snapshot map its memory file copy-on-write,
/// so the memory they only read is one set of host pages, whoever restores them (a fresh VM
/// or one from the pool).
#[test]
fn copies_restored_from_one_snapshot_share_the_memory_they_read() {
    skip_without_kvm!();
    use backend_microvm::vmm::{Entry, Vm, VmPool};
    const COPIES: usize = 8;
    const FILLED_MIB: u64 = 16;
    let c = cfg().mem_size(64 << 20).irqchip(false);
    let dir = tempfile::tempdir().unwrap();
    let (mut vm, entry) = vm_with_guest(c.clone());
    vm.start(Entry::user(entry).with_arg(t::FILL_WAIT_READ))
        .unwrap();
    assert!(wait_serial(&vm, "F"), "{}", serial_string(&vm));
    vm.snapshot(dir.path()).unwrap();
    drop(vm);
    let n = (FILLED_MIB << 20) / 8;
    let want = (0..n).fold(0u64, |acc, i| {
        acc.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i)
    });
    let pool = VmPool::new(c.mem_size, c.vcpus, false, COPIES / 2).unwrap();
    pool.fill().unwrap();

    let before = pss_kib();
    let mut copies = Vec::new();
    for i in 0..COPIES {
        let r = if i % 2 == 0 {
            Vm::restore_pooled(dir.path(), c.clone(), &pool).unwrap()
        } else {
            Vm::restore(dir.path(), c.clone()).unwrap()
        };
        set_go(&r);
        assert_eq!(r.wait(), VmExit::GuestExit { code: 19 });
        // Each copy read all 16 MiB the original wrote.
        assert_eq!(serial_string(&r), format!("0x{want:016x}\n"));
        copies.push(r);
    }
    assert_eq!(pool.ready(), 0, "half of the copies came from the pool");
    let grown_mib = pss_kib().saturating_sub(before) / 1024;
    eprintln!("{COPIES} copies that read {FILLED_MIB} MiB each: PSS +{grown_mib} MiB");
    // Unshared, the copies would hold COPIES x 16 MiB (128 MiB) between them.
    assert!(
        grown_mib < 2 * FILLED_MIB + 8,
        "{COPIES} copies that read {FILLED_MIB} MiB each grew this process by {grown_mib} MiB"
    );
    drop(copies);
}
