//! Benchmarks of the shared machinery: policy decisions, tier selection, snapshot store round
//! trips, and warm-pool checkout versus a cold create (with the test-only backend, so the
//! number is the pool's own overhead, not an engine's).
//!
//! `cargo bench -p agent-sandbox --bench core`

// A benchmark that cannot set itself up should stop loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use agent_sandbox::{
    Backend, IoProfile, KernelNeed, Language, NetworkPolicy, ObjectSnapshotStore, PoolConfig,
    Question, ResolvedSecrets, SandboxSpec, Selector, SnapshotDraft, SnapshotKind, SnapshotStore,
    Tier, Trust, WarmPool,
};
use backend_unisolated::UnisolatedBackend;
use criterion::{criterion_group, criterion_main, Criterion};

fn policy(c: &mut Criterion) {
    let p = NetworkPolicy::Allow {
        hosts: [
            "api.example.com",
            "*.pypi.org",
            "files.pythonhosted.org:443",
        ]
        .iter()
        .map(|h| h.parse().unwrap())
        .collect(),
        cidrs: vec!["10.201.0.0/16".parse().unwrap()],
        ports: vec![],
    };
    let public: IpAddr = "93.184.216.34".parse().unwrap();
    let metadata: IpAddr = "169.254.169.254".parse().unwrap();
    c.bench_function("policy/decide allowed wildcard", |b| {
        b.iter(|| p.decide(Some("x.pypi.org"), public, 443))
    });
    c.bench_function("policy/decide metadata refused", |b| {
        b.iter(|| p.decide(Some("api.example.com"), metadata, 80))
    });
}

fn selector(c: &mut Criterion) {
    let q = Question::new(Language::Python)
        .trust(Trust::Untrusted)
        .io(IoProfile::Compute)
        .kernel(KernelNeed::None);
    c.bench_function("selector/rank", |b| b.iter(|| Selector.rank(&q)));
}

fn snapshots(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let payload = vec![42u8; 1 << 20];
    c.bench_function("snapshot-store/put+verify 1 MiB", |b| {
        b.iter(|| {
            rt.block_on(async {
                let d = SnapshotDraft::new(
                    Tier::Unisolated,
                    "bench",
                    vec![SnapshotKind::Filesystem],
                    SandboxSpec::new(Language::Shell),
                )
                .artifact("blob", payload.clone());
                let id = store.put(d).await.unwrap();
                store.artifact(&id, "blob").await.unwrap()
            })
        })
    });
}

fn pool(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let backend: Arc<dyn Backend> = Arc::new(UnisolatedBackend::new_without_isolation());
    let spec = SandboxSpec::new(Language::Shell);
    let mut g = c.benchmark_group("pool");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("cold create (unisolated)", |b| {
        b.iter(|| {
            rt.block_on(async {
                backend
                    .create(&spec, ResolvedSecrets::none())
                    .await
                    .unwrap()
            })
        })
    });
    let pool = rt
        .block_on(async {
            let p = WarmPool::start(
                backend.clone(),
                spec.clone(),
                ResolvedSecrets::none(),
                PoolConfig::default()
                    .size(8)
                    .max_idle(Duration::from_secs(60))
                    .health_check(true),
            )?;
            p.wait_ready(8, Duration::from_secs(10)).await;
            Ok::<_, agent_sandbox::Error>(p)
        })
        .unwrap();
    g.bench_function("warm checkout (unisolated)", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    // Refill time is not what is measured: wait for a ready sandbox first.
                    pool.wait_ready(1, Duration::from_secs(5)).await;
                    let t = std::time::Instant::now();
                    let sb = pool.checkout().await.unwrap();
                    total += t.elapsed();
                    drop(sb);
                }
                total
            })
        })
    });
    g.finish();
    rt.block_on(pool.shutdown());
}

criterion_group!(benches, policy, selector, snapshots, pool);
criterion_main!(benches);
