//! The VMM with tiny guests (freestanding x86-64 code at CPL 3, built with gcc by the test
//! harness in `tests/common`), on this host's KVM.
//!
//! `cargo bench -p backend-microvm --bench vmm` (needs `/dev/kvm` and gcc; skips, printing
//! the probe's reason, without KVM). Every row is `iter_custom`: only the named span is timed,
//! tear-down (dropping the VM) is not.
//!
//! - `create -> first serial byte`: `Vm::new` + `load_elf` + `start` until the serial
//!   callback sees the guest's first byte; 16 MiB. Every row runs without KVM's in-kernel
//!   irqchip + PIT (`irqchip: false`: tiny guests take no interrupts) and with them (the
//!   default, what Linux guests need).
//! - `create -> exit`: the same to the guest's exit (`hello from the guest\n`, 21 port
//!   writes, then the exit port).
//! - `snapshot (running, 16 MiB)`: `Vm::snapshot` of a guest spinning at CPL 3 (files in
//!   a temporary directory, on ext4 here).
//! - `snapshot + restore (16 MiB)`: both, into a fresh VM that is running when restore returns;
//!   `... from the pool`: into a VM of a `VmPool` (made ahead of time, untimed), which only
//!   maps the memory, makes its devices and loads the state.
//! - `restore` / `restore + run to exit` for 16 MiB and 256 MiB side by side: the memory file
//!   is mapped copy-on-write, so size should not matter.
//! - memory overhead per VM: printed, not timed (criterion cannot measure memory): the
//!   growth of this process's RSS (split into anonymous memory, which is the VMM's own, and
//!   shared memory, which is guest RAM the guest touched) and of the host's used memory
//!   (kernel side: KVM structures) over N idle (started, then paused) VMs.

// A benchmark that cannot set itself up should stop loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backend_microvm::vmm::{Entry, Vm, VmConfig, VmExit, VmPool};
use criterion::{criterion_group, criterion_main, Criterion};

use common::{set_go, skip_reason, t, tiny_guest, wait_serial};

fn cfg(mem_mib: u64, irqchip: bool) -> VmConfig {
    VmConfig::default()
        .mem_size(mem_mib << 20)
        .irqchip(irqchip)
        .deadline(Some(Duration::from_secs(60)))
}

/// Creates, loads and starts a tiny guest running `test`.
fn start(c: VmConfig, test: u64) -> Vm {
    let mut vm = Vm::new(c).unwrap();
    let entry = vm.load_elf(tiny_guest()).unwrap();
    vm.start(Entry::user(entry).with_arg(test)).unwrap();
    vm
}

/// Time from `Vm::new` to the first serial byte (seen by the serial callback on the vCPU
/// thread).
fn create_to_first_byte(irqchip: bool) -> Duration {
    let first: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let me = std::thread::current();
    let slot = first.clone();
    let mut c = cfg(16, irqchip);
    c.serial_callback = Some(Arc::new(move |_b: &[u8]| {
        let mut g = slot.lock().unwrap();
        if g.is_none() {
            *g = Some(Instant::now());
            me.unpark();
        }
    }));
    let t0 = Instant::now();
    let vm = start(c, t::HELLO);
    let at = loop {
        if let Some(at) = *first.lock().unwrap() {
            break at;
        }
        std::thread::park_timeout(Duration::from_millis(100));
    };
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 42 });
    at - t0
}

fn create_to_exit(irqchip: bool) -> Duration {
    let t0 = Instant::now();
    let vm = start(cfg(16, irqchip), t::HELLO);
    let e = vm.wait();
    let dt = t0.elapsed();
    assert_eq!(e, VmExit::GuestExit { code: 42 });
    dt
}

/// A guest waiting (spinning at CPL 3) for GO_FLAG. No deadline: some live through many
/// benchmark rows.
fn waiting_guest(mut c: VmConfig) -> Vm {
    c.deadline = None;
    let vm = start(c, t::WAIT_GO);
    assert!(wait_serial(&vm, "W"));
    vm
}

/// The configurations measured: tiny guests need no interrupt controller (`irqchip:
/// false`); Linux guests do (the default), which costs several in-kernel synchronisations.
const CONFIGS: [(bool, &str); 2] = [(false, "no irqchip"), (true, "irqchip")];

fn bench_create(c: &mut Criterion) {
    let mut g = c.benchmark_group("microvm");
    g.sample_size(30).measurement_time(Duration::from_secs(5));
    for (irqchip, name) in CONFIGS {
        g.bench_function(
            format!("create -> first serial byte (16 MiB, {name})"),
            |b| {
                b.iter_custom(|n| (0..n).map(|_| create_to_first_byte(irqchip)).sum());
            },
        );
        g.bench_function(format!("create -> exit (16 MiB, {name})"), |b| {
            b.iter_custom(|n| (0..n).map(|_| create_to_exit(irqchip)).sum());
        });
    }
    g.finish();
}

fn bench_snapshot(c: &mut Criterion) {
    let mut g = c.benchmark_group("microvm");
    g.sample_size(30).measurement_time(Duration::from_secs(5));
    let dir = tempfile::tempdir().unwrap();
    for (irqchip, name) in CONFIGS {
        let vm = waiting_guest(cfg(16, irqchip));
        g.bench_function(format!("snapshot (running, 16 MiB, {name})"), |b| {
            b.iter_custom(|n| {
                let mut total = Duration::ZERO;
                for i in 0..n {
                    let d = dir.path().join(format!("s{i}"));
                    let t0 = Instant::now();
                    vm.snapshot(&d).unwrap();
                    total += t0.elapsed();
                    std::fs::remove_dir_all(&d).unwrap();
                }
                total
            });
        });
        g.bench_function(format!("snapshot + restore (16 MiB, {name})"), |b| {
            b.iter_custom(|n| {
                let mut total = Duration::ZERO;
                for i in 0..n {
                    let d = dir.path().join(format!("r{i}"));
                    let t0 = Instant::now();
                    vm.snapshot(&d).unwrap();
                    let r = Vm::restore(&d, cfg(16, irqchip)).unwrap();
                    total += t0.elapsed();
                    r.kill();
                    drop(r);
                    std::fs::remove_dir_all(&d).unwrap();
                }
                total
            });
        });
        // The same into a VM made ahead of time (irqchip, PIT, vCPUs ready): the pool is
        // refilled before each snapshot, untimed.
        let pool = VmPool::new(16 << 20, 1, irqchip, 1).unwrap();
        g.bench_function(
            format!("snapshot + restore from the pool (16 MiB, {name})"),
            |b| {
                b.iter_custom(|n| {
                    let mut total = Duration::ZERO;
                    for i in 0..n {
                        pool.fill().unwrap();
                        let d = dir.path().join(format!("p{i}"));
                        let t0 = Instant::now();
                        vm.snapshot(&d).unwrap();
                        let r = Vm::restore_pooled(&d, cfg(16, irqchip), &pool).unwrap();
                        total += t0.elapsed();
                        assert_eq!(pool.ready(), 0, "restored into the pooled VM");
                        r.kill();
                        drop(r);
                        std::fs::remove_dir_all(&d).unwrap();
                    }
                    total
                });
            },
        );
        vm.kill();
    }
    for (irqchip, name) in CONFIGS {
        for mib in [16u64, 256] {
            let d = dir.path().join(format!("snap-{mib}-{irqchip}"));
            {
                let vm = waiting_guest(cfg(mib, irqchip));
                vm.snapshot(&d).unwrap();
                vm.kill();
            }
            g.bench_function(format!("restore ({mib} MiB, {name})"), |b| {
                b.iter_custom(|n| {
                    let mut total = Duration::ZERO;
                    for _ in 0..n {
                        let t0 = Instant::now();
                        let r = Vm::restore(&d, cfg(mib, irqchip)).unwrap();
                        total += t0.elapsed();
                        r.kill();
                    }
                    total
                });
            });
            g.bench_function(format!("restore + run to exit ({mib} MiB, {name})"), |b| {
                b.iter_custom(|n| {
                    let mut total = Duration::ZERO;
                    for _ in 0..n {
                        let t0 = Instant::now();
                        let r = Vm::restore(&d, cfg(mib, irqchip)).unwrap();
                        set_go(&r);
                        let e = r.wait();
                        total += t0.elapsed();
                        assert_eq!(e, VmExit::GuestExit { code: 11 });
                    }
                    total
                });
            });
        }
    }
    g.finish();
}

fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn pss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn meminfo_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn memory_overhead(irqchip: bool) {
    const N: u64 = 16;
    // Warm up process-wide state (the guest ELF, caches, the allocator) first.
    drop(waiting_guest(cfg(16, irqchip)));
    let before = (
        status_kib("VmRSS:"),
        status_kib("RssAnon:"),
        status_kib("RssShmem:"),
        pss_kib(),
        meminfo_kib("MemAvailable:"),
        meminfo_kib("Slab:") + meminfo_kib("KernelStack:") + meminfo_kib("PageTables:"),
    );
    let vms: Vec<Vm> = (0..N)
        .map(|_| {
            let vm = waiting_guest(cfg(16, irqchip));
            vm.pause().unwrap();
            vm
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let after = (
        status_kib("VmRSS:"),
        status_kib("RssAnon:"),
        status_kib("RssShmem:"),
        pss_kib(),
        meminfo_kib("MemAvailable:"),
        meminfo_kib("Slab:") + meminfo_kib("KernelStack:") + meminfo_kib("PageTables:"),
    );
    let per = |a: u64, b: u64| (a as f64 - b as f64) / N as f64;
    println!(
        "microvm memory per idle VM ({N} VMs, 16 MiB, {}): RSS {:.0} KiB = anonymous \
         (VMM heap, stacks) {:.0} KiB + shared (guest RAM the guest touched) {:.0} KiB; \
         PSS {:.0} KiB; kernel (slab + kernel stacks + page tables) {:.0} KiB; host \
         MemAvailable drop {:.0} KiB",
        if irqchip { "irqchip" } else { "no irqchip" },
        per(after.0, before.0),
        per(after.1, before.1),
        per(after.2, before.2),
        per(after.3, before.3),
        per(after.5, before.5),
        per(before.4, after.4),
    );
    for vm in &vms {
        vm.kill();
    }
}

fn bench_memory(_c: &mut Criterion) {
    memory_overhead(true);
    memory_overhead(false);
}

fn all(c: &mut Criterion) {
    if let Some(why) = skip_reason() {
        eprintln!("SKIP microvm benches: {why}");
        return;
    }
    bench_memory(c);
    bench_create(c);
    bench_snapshot(c);
}

criterion_group!(benches, all);
criterion_main!(benches);
