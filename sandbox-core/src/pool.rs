//! Warm pools: N ready sandboxes of one spec, refilled in the background.
//!
//! `checkout` never waits for a creation while a ready sandbox exists: it pops one, checks it
//! (age, then health), and wakes the refiller. Only a miss (pool empty) creates inline.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::error::Result;
use crate::sandbox::{DynBackend, Sandbox};
use crate::secrets::ResolvedSecrets;
use crate::spec::SandboxSpec;

/// Pool settings: start from [`PoolConfig::default`] and use the setters;
/// `#[non_exhaustive]`: later versions add settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PoolConfig {
    /// Ready sandboxes to keep.
    pub size: usize,
    /// A ready sandbox idle longer than this is destroyed instead of handed out.
    #[serde(with = "millis")]
    pub max_idle: Duration,
    /// Run [`Sandbox::health_check`] on checkout.
    pub health_check: bool,
    /// How long the refiller waits after a checkout before creating a replacement, so the
    /// creation does not compete for the CPUs with the caller's first command.
    #[serde(with = "millis", default = "default_refill_delay")]
    pub refill_delay: Duration,
    /// A command each pooled sandbox runs once, in the background, after its creation and
    /// before it is handed out: e.g. a no-op, so the first real command finds the backend's
    /// exec path warm (in the container tier, the supervisor that serves it has run before),
    /// or a session's heavy imports. A warm-up that fails or exits non-zero discards the
    /// sandbox (counted in [`PoolStats::create_failures`]). A miss (a sandbox created at
    /// checkout) does not run it.
    #[serde(default)]
    pub warm_up: Option<crate::exec::ExecRequest>,
}

fn default_refill_delay() -> Duration {
    Duration::from_millis(10)
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(crate::spec::millis(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            size: 2,
            max_idle: Duration::from_secs(300),
            health_check: true,
            refill_delay: default_refill_delay(),
            warm_up: None,
        }
    }
}

impl PoolConfig {
    /// Ready sandboxes to keep. Default: 2.
    pub fn size(mut self, size: usize) -> Self {
        self.size = size;
        self
    }

    /// Idle time after which a ready sandbox is destroyed instead of handed out.
    /// Default: 5 minutes.
    pub fn max_idle(mut self, d: Duration) -> Self {
        self.max_idle = d;
        self
    }

    /// Whether checkout runs [`Sandbox::health_check`]. Default: `true`.
    pub fn health_check(mut self, on: bool) -> Self {
        self.health_check = on;
        self
    }

    /// Pause between a checkout and the replacement's creation. Default: 10 ms.
    pub fn refill_delay(mut self, d: Duration) -> Self {
        self.refill_delay = d;
        self
    }

    /// A command each pooled sandbox runs once before it is handed out (see the field).
    /// Default: none.
    pub fn warm_up(mut self, req: crate::exec::ExecRequest) -> Self {
        self.warm_up = Some(req);
        self
    }
}

/// Counters and checkout latency of a pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PoolStats {
    /// Checkouts served from ready sandboxes.
    pub hits: u64,
    /// Checkouts that had to create inline.
    pub misses: u64,
    /// Sandboxes created by the refiller.
    pub created: u64,
    /// Sandboxes destroyed for idling past `max_idle`.
    pub evicted: u64,
    /// Sandboxes destroyed because their health check failed.
    pub unhealthy: u64,
    /// Failed background creations.
    pub create_failures: u64,
    /// The last background creation error, if any.
    pub last_error: Option<String>,
    /// Sandboxes ready now.
    pub ready: usize,
    /// Median checkout latency over the last 1024 checkouts, microseconds.
    pub checkout_p50_us: u64,
    /// 99th percentile of the same, microseconds.
    pub checkout_p99_us: u64,
}

struct Ready {
    sandbox: Box<dyn Sandbox>,
    since: Instant,
}

struct State {
    ready: VecDeque<Ready>,
    stats: PoolStats,
    latencies: VecDeque<u64>,
}

struct Inner {
    backend: DynBackend,
    spec: SandboxSpec,
    secrets: ResolvedSecrets,
    config: PoolConfig,
    state: Mutex<State>,
    wake: Notify,
    closed: AtomicBool,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave `State` inconsistent (plain pushes/pops).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A warm pool of sandboxes of one spec on one backend.
pub struct WarmPool {
    inner: Arc<Inner>,
    refiller: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for WarmPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WarmPool")
            .field("tier", &self.inner.backend.tier())
            .field("config", &self.inner.config)
            .finish()
    }
}

impl WarmPool {
    /// Starts a pool (must be called inside a tokio runtime). The spec is validated now.
    pub fn start(
        backend: DynBackend,
        spec: SandboxSpec,
        secrets: ResolvedSecrets,
        config: PoolConfig,
    ) -> Result<Self> {
        spec.validate()?;
        let inner = Arc::new(Inner {
            backend,
            spec,
            secrets,
            config,
            state: Mutex::new(State {
                ready: VecDeque::new(),
                stats: PoolStats::default(),
                latencies: VecDeque::new(),
            }),
            wake: Notify::new(),
            closed: AtomicBool::new(false),
        });
        let refiller = tokio::spawn(refill_loop(Arc::clone(&inner)));
        Ok(WarmPool { inner, refiller })
    }

    /// Hands out a sandbox: a ready one if there is one (checked for age and health), else a
    /// new one created now (a miss). The caller owns it; it is not returned to the pool.
    pub async fn checkout(&self) -> Result<Box<dyn Sandbox>> {
        let started = Instant::now();
        loop {
            let next = self.inner.state().ready.pop_front();
            self.inner.wake.notify_one();
            let Some(r) = next else { break };
            if r.since.elapsed() > self.inner.config.max_idle {
                self.inner.state().stats.evicted += 1;
                let _ = r.sandbox.destroy().await;
                continue;
            }
            if self.inner.config.health_check && r.sandbox.health_check().await.is_err() {
                self.inner.state().stats.unhealthy += 1;
                let _ = r.sandbox.destroy().await;
                continue;
            }
            self.record(started, true);
            return Ok(r.sandbox);
        }
        let sb = self
            .inner
            .backend
            .create(&self.inner.spec, self.inner.secrets.clone())
            .await?;
        self.record(started, false);
        Ok(sb)
    }

    fn record(&self, started: Instant, hit: bool) {
        let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        let mut st = self.inner.state();
        if hit {
            st.stats.hits += 1;
        } else {
            st.stats.misses += 1;
        }
        if st.latencies.len() == 1024 {
            st.latencies.pop_front();
        }
        st.latencies.push_back(us);
    }

    /// Current counters.
    pub fn stats(&self) -> PoolStats {
        let st = self.inner.state();
        let mut s = st.stats.clone();
        s.ready = st.ready.len();
        let mut l: Vec<u64> = st.latencies.iter().copied().collect();
        l.sort_unstable();
        if !l.is_empty() {
            s.checkout_p50_us = l[l.len() / 2];
            s.checkout_p99_us = l[(l.len() * 99 / 100).min(l.len() - 1)];
        }
        s
    }

    /// Waits until `n` sandboxes are ready or `timeout` passes; returns whether they are.
    pub async fn wait_ready(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.inner.state().ready.len() >= n {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        self.inner.state().ready.len() >= n
    }

    /// Stops refilling and destroys every ready sandbox.
    pub async fn shutdown(self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        self.inner.wake.notify_one();
        self.refiller.abort();
        let drained: Vec<Ready> = self.inner.state().ready.drain(..).collect();
        for r in drained {
            let _ = r.sandbox.destroy().await;
        }
    }
}

impl Drop for WarmPool {
    fn drop(&mut self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        self.refiller.abort();
        // Ready sandboxes are dropped with `inner`; each backend destroys on drop.
    }
}

/// A sandbox for the pool: created, then warmed up ([`PoolConfig::warm_up`]); one whose
/// warm-up fails is destroyed. The error says why, for [`PoolStats::last_error`].
async fn prepare(inner: &Inner) -> std::result::Result<Box<dyn Sandbox>, String> {
    let sb = inner
        .backend
        .create(&inner.spec, inner.secrets.clone())
        .await
        .map_err(|e| e.to_string())?;
    let Some(req) = &inner.config.warm_up else {
        return Ok(sb);
    };
    let failed = match sb.exec(req.clone()).await {
        Ok(r) if r.success() => return Ok(sb),
        Ok(r) => format!("warm-up exited with {:?}", r.exit_code),
        Err(e) => format!("warm-up failed: {e}"),
    };
    let _ = sb.destroy().await;
    Err(failed)
}

async fn refill_loop(inner: Arc<Inner>) {
    let mut backoff = Duration::from_millis(10);
    let tick = (inner.config.max_idle / 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
    let mut woken = false;
    while !inner.closed.load(Ordering::SeqCst) {
        // Evict what idled too long.
        let stale: Vec<Ready> = {
            let mut st = inner.state();
            let max_idle = inner.config.max_idle;
            let (keep, stale): (VecDeque<Ready>, VecDeque<Ready>) = st
                .ready
                .drain(..)
                .partition(|r| r.since.elapsed() <= max_idle);
            st.ready = keep;
            st.stats.evicted += stale.len() as u64;
            stale.into_iter().collect()
        };
        for r in stale {
            let _ = r.sandbox.destroy().await;
        }
        if inner.state().ready.len() < inner.config.size {
            if woken && !inner.config.refill_delay.is_zero() {
                // Just after a checkout: let the caller's first command run first.
                tokio::time::sleep(inner.config.refill_delay).await;
            }
            woken = false;
            match prepare(&inner).await {
                Ok(sb) => {
                    let mut st = inner.state();
                    st.stats.created += 1;
                    st.ready.push_back(Ready {
                        sandbox: sb,
                        since: Instant::now(),
                    });
                    backoff = Duration::from_millis(10);
                    continue;
                }
                Err(why) => {
                    tracing::warn!(tier = %inner.backend.tier(), error = %why, "warm pool refill failed");
                    {
                        let mut st = inner.state();
                        st.stats.create_failures += 1;
                        st.stats.last_error = Some(why);
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            }
        }
        woken = tokio::time::timeout(tick, inner.wake.notified())
            .await
            .is_ok();
    }
}
