//! gVisor tier, side by side with runsc itself.
//!
//! `cargo bench -p agent-sandbox --bench gvisor` (root, runsc installed). Each iteration starts
//! real sandboxes, so sample counts are small; see docs/benchmarks.md for the figures.
//!
//! - `runsc run (same bundle)`: the baseline, `runsc run` of a bundle made by our bundle
//!   writer, running `/bin/true` (create + start + wait + delete inside runsc).
//! - `create + first command`: `Backend::create` then `exec(/bin/true)` (destroy not timed).
//! - `exec`: `/bin/true` in a running sandbox.
//! - `pool checkout + first command`: a warm pool's checkout then `exec(/bin/true)`.
//! - `checkpoint (idle python)` / `restore + first command`: full-memory snapshots.

// A benchmark that cannot set itself up should stop loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "shared/mod.rs"]
mod shared;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_sandbox::{
    Backend, ExecRequest, Language, ObjectSnapshotStore, ResolvedSecrets, SandboxSpec,
};
use backend_gvisor::{GvisorBackend, RunscInfo};
use criterion::{criterion_group, criterion_main, Criterion};

fn gvisor(c: &mut Criterion) {
    let backend = GvisorBackend::builder().build().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let status = rt.block_on(backend.probe());
    if !status.available {
        eprintln!(
            "SKIP gvisor benches: {} (fix: {})",
            status.reason,
            status.fix.unwrap_or_default()
        );
        return;
    }
    let info = RunscInfo::discover(None).unwrap();
    let platform = info.default_platform();
    let tmp = tempfile::tempdir().unwrap();
    let bundle_dir = shared::oci_bundle(
        tmp.path(),
        "bundle",
        &["/bin/true"],
        "agent-sandbox-bench-baseline",
    );
    let root = tmp.path().join("runsc-root");
    let spec = SandboxSpec::new(Language::Shell);
    let true_cmd = || ExecRequest::argv(["/bin/true"]);

    let mut g = c.benchmark_group("gvisor");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(8))
        .warm_up_time(Duration::from_secs(1));

    let mut n = 0u64;
    g.bench_function("runsc run (same bundle, /bin/true)", |b| {
        b.iter(|| {
            n += 1;
            let st = Command::new(&info.path)
                .arg(format!("--root={}", root.display()))
                .args([
                    "--network=none",
                    &format!("--platform={}", platform.name()),
                    "run",
                    "--bundle",
                ])
                .arg(&bundle_dir)
                .arg(format!("bench-{n}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .unwrap();
            assert!(st.success());
        })
    });

    g.bench_function("create + first command (/bin/true)", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let sb = backend
                        .create(&spec, ResolvedSecrets::none())
                        .await
                        .unwrap();
                    assert!(sb.exec(true_cmd()).await.unwrap().success());
                    total += t.elapsed();
                    sb.destroy().await.unwrap();
                }
                total
            })
        })
    });

    let live = rt
        .block_on(backend.create(&spec, ResolvedSecrets::none()))
        .unwrap();
    g.bench_function("exec /bin/true", |b| {
        b.iter(|| rt.block_on(async { assert!(live.exec(true_cmd()).await.unwrap().success()) }))
    });

    let pool = shared::ready_pool(&rt, Arc::new(backend.clone()), &spec, None);
    shared::bench_checkout_and_first_command(
        &mut g,
        "pool checkout + first command",
        &rt,
        pool,
        1,
        true_cmd(),
    );

    // Full-memory snapshots of an idle Python sandbox.
    let store_dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(store_dir.path()).unwrap();
    let py = rt
        .block_on(backend.create(&SandboxSpec::new(Language::Python), ResolvedSecrets::none()))
        .unwrap();
    rt.block_on(py.exec(ExecRequest::argv([
        "/bin/sh",
        "-c",
        "python3 -c 'import time; time.sleep(1e6)' >/dev/null 2>&1 &",
    ])))
    .unwrap();
    let mut last = None;
    g.bench_function("checkpoint (idle python)", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    // Wait for the previous snapshot's in-place resume (not what is measured).
                    assert!(py.exec(true_cmd()).await.unwrap().success());
                    let t = Instant::now();
                    last = Some(py.snapshot(&store).await.unwrap());
                    total += t.elapsed();
                }
                total
            })
        })
    });
    // A filtered run (`-- restore`) skips the checkpoint bench: take one snapshot here.
    let id = match last {
        Some(id) => id,
        None => rt.block_on(py.snapshot(&store)).unwrap(),
    };
    g.bench_function("restore + first command (idle python)", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let sb = backend
                        .restore(&store, &id, ResolvedSecrets::none())
                        .await
                        .unwrap();
                    assert!(sb.exec(true_cmd()).await.unwrap().success());
                    total += t.elapsed();
                    sb.destroy().await.unwrap();
                }
                total
            })
        })
    });
    g.finish();

    // Idle footprint: PSS of the sandbox and gofer processes of one idle sandbox.
    let idle = rt
        .block_on(backend.create(&spec, ResolvedSecrets::none()))
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    eprintln!(
        "idle sandbox PSS (sandbox + gofer): {} KiB",
        pss_kib_of(idle.id())
    );
    rt.block_on(async {
        idle.destroy().await.unwrap();
        live.destroy().await.unwrap();
        py.destroy().await.unwrap();
    });
}

/// Sum of `Pss` over processes whose command line mentions `needle`.
fn pss_kib_of(needle: &str) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmd).contains(needle) {
            continue;
        }
        let rollup = std::fs::read_to_string(e.path().join("smaps_rollup")).unwrap_or_default();
        total += rollup
            .lines()
            .find_map(|l| {
                l.strip_prefix("Pss:")?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0);
    }
    total
}

criterion_group!(benches, gvisor);
criterion_main!(benches);
