//! Warm pool behaviour against a real backend: refill, hits/misses, eviction, health checks.

// In tests a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use backend_unisolated::UnisolatedBackend;
use sandbox_core::{
    Backend, Capabilities, ExecRequest, Language, PoolConfig, ResolvedSecrets, Result, Sandbox,
    SandboxSpec, Tier, TierStatus, WarmPool,
};

/// Wraps the real backend to count creations (and optionally fail them).
struct Counting {
    inner: UnisolatedBackend,
    created: AtomicUsize,
    fail: bool,
    workspaces: std::sync::Mutex<Vec<String>>,
}

#[async_trait]
impl Backend for Counting {
    fn tier(&self) -> Tier {
        self.inner.tier()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn probe(&self) -> TierStatus {
        self.inner.probe().await
    }
    async fn create(&self, spec: &SandboxSpec, s: ResolvedSecrets) -> Result<Box<dyn Sandbox>> {
        if self.fail {
            return Err(sandbox_core::Error::backend(
                Tier::Unisolated,
                "injected failure",
            ));
        }
        self.created.fetch_add(1, Ordering::SeqCst);
        let sb = self.inner.create(spec, s).await?;
        let pwd = sb.exec(ExecRequest::code("pwd")).await?.stdout_str();
        self.workspaces.lock().unwrap().push(pwd.trim().to_string());
        Ok(sb)
    }
}

fn counting(fail: bool) -> Arc<Counting> {
    Arc::new(Counting {
        inner: UnisolatedBackend::new_without_isolation(),
        created: AtomicUsize::new(0),
        fail,
        workspaces: Default::default(),
    })
}

fn spec() -> SandboxSpec {
    SandboxSpec::new(Language::Shell)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fills_serves_hits_and_refills() {
    let b = counting(false);
    let pool = WarmPool::start(
        b.clone(),
        spec(),
        ResolvedSecrets::none(),
        PoolConfig::default().size(3),
    )
    .unwrap();
    assert!(pool.wait_ready(3, Duration::from_secs(10)).await);
    let sb = pool.checkout().await.unwrap();
    assert!(sb
        .exec(ExecRequest::code("echo ok"))
        .await
        .unwrap()
        .success());
    let s = pool.stats();
    assert_eq!((s.hits, s.misses), (1, 0));
    // refilled back to 3 in the background
    assert!(pool.wait_ready(3, Duration::from_secs(10)).await);
    assert_eq!(b.created.load(Ordering::SeqCst), 4);
    // drain faster than refill can keep up: at least some hits, and every checkout works
    let mut got = vec![];
    for _ in 0..6 {
        got.push(pool.checkout().await.unwrap());
    }
    let s = pool.stats();
    assert_eq!(s.hits + s.misses, 7);
    assert!(s.hits >= 3, "{s:?}");
    assert!(s.checkout_p50_us > 0 || s.hits > 0);
    let ids: std::collections::HashSet<_> = got.iter().map(|s| s.id().to_string()).collect();
    assert_eq!(ids.len(), 6, "every checkout is a distinct sandbox");
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sandboxes_are_evicted() {
    let b = counting(false);
    let cfg = PoolConfig::default()
        .size(2)
        .max_idle(Duration::from_millis(50))
        .health_check(true);
    let pool = WarmPool::start(b.clone(), spec(), ResolvedSecrets::none(), cfg).unwrap();
    assert!(pool.wait_ready(2, Duration::from_secs(10)).await);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let s = pool.stats();
    assert!(s.evicted >= 2, "{s:?}");
    assert!(
        b.created.load(Ordering::SeqCst) >= 4,
        "evicted ones were replaced"
    );
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unhealthy_sandboxes_are_skipped_on_checkout() {
    let b = counting(false);
    let cfg = PoolConfig::default()
        .size(2)
        .max_idle(Duration::from_secs(60))
        .health_check(true);
    let pool = WarmPool::start(b.clone(), spec(), ResolvedSecrets::none(), cfg).unwrap();
    assert!(pool.wait_ready(2, Duration::from_secs(10)).await);
    // Break the pooled sandboxes behind the pool's back: remove their workspaces.
    let dirs = b.workspaces.lock().unwrap().clone();
    assert_eq!(dirs.len(), 2);
    for d in dirs {
        assert!(d.contains("agent-sandbox-unisolated-"), "{d}");
        std::fs::remove_dir_all(d).unwrap();
    }
    let sb = pool.checkout().await.unwrap();
    sb.health_check().await.unwrap();
    let s = pool.stats();
    assert!(s.unhealthy >= 1, "{s:?}");
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_backend_reports_errors_and_misses_surface_them() {
    let b = counting(true);
    let pool = WarmPool::start(b, spec(), ResolvedSecrets::none(), PoolConfig::default()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = pool.stats();
    assert!(s.create_failures >= 1);
    assert!(s.last_error.unwrap().contains("injected failure"));
    let e = pool.checkout().await.err().unwrap();
    assert!(e.to_string().contains("injected failure"));
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_template_is_refused() {
    let mut bad = spec();
    bad.limits.pids = 0;
    assert!(WarmPool::start(
        counting(false),
        bad,
        ResolvedSecrets::none(),
        PoolConfig::default()
    )
    .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_up_runs_in_each_pooled_sandbox_and_a_failing_one_discards_it() {
    // Each pooled sandbox ran the warm-up once before it was handed out.
    let pool = WarmPool::start(
        counting(false),
        spec(),
        ResolvedSecrets::none(),
        PoolConfig::default()
            .size(2)
            .warm_up(ExecRequest::code("echo warm >> warmed")),
    )
    .unwrap();
    assert!(pool.wait_ready(2, Duration::from_secs(10)).await);
    let sb = pool.checkout().await.unwrap();
    let r = sb.exec(ExecRequest::code("cat warmed")).await.unwrap();
    assert_eq!(r.stdout_str(), "warm\n");
    sb.destroy().await.unwrap();
    assert_eq!(pool.stats().hits, 1);
    pool.shutdown().await;

    // A warm-up that fails: nothing is pooled, failures are counted with the reason, and a
    // checkout is a miss (which does not run the warm-up).
    let pool = WarmPool::start(
        counting(false),
        spec(),
        ResolvedSecrets::none(),
        PoolConfig::default()
            .size(1)
            .warm_up(ExecRequest::code("echo x >> warmed; exit 3")),
    )
    .unwrap();
    assert!(!pool.wait_ready(1, Duration::from_millis(300)).await);
    let st = pool.stats();
    assert!(st.create_failures >= 1, "{st:?}");
    assert!(
        st.last_error
            .as_deref()
            .unwrap_or_default()
            .contains("Some(3)"),
        "{st:?}"
    );
    let sb = pool.checkout().await.unwrap();
    let r = sb.exec(ExecRequest::code("cat warmed")).await.unwrap();
    assert!(!r.success(), "a miss ran the warm-up: {r:?}");
    assert_eq!(pool.stats().misses, 1);
    sb.destroy().await.unwrap();
    pool.shutdown().await;
}
