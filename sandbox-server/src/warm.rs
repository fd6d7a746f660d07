//! Warm pools ([`ServerConfig::warm`](crate::ServerConfig::warm)): sandboxes made ahead of
//! time for the specs clients created most recently, so the next create of the same spec
//! takes a ready one instead of waiting for a creation.
//!
//! A spec gets a pool on its first create (which is a plain create: the pool starts after it
//! succeeded, on the tier it landed on); each pool is the library's
//! [`WarmPool`](sandbox_core::WarmPool), refilled in the background right after each
//! checkout. A pool unused for [`ServerConfig::warm_idle`](crate::ServerConfig::warm_idle)
//! is shut down (its ready sandboxes destroyed); at most [`MAX_POOLS`] exist, the least
//! recently used giving way.
//!
//! Only specs whose sandboxes cannot go stale while they wait are pooled: nothing of the
//! server's host in them (a host directory could change or vanish before the sandbox is handed
//! out; see [`host_access`](crate::host_access)), no secrets (resolved at creation), and an
//! image only when pinned by digest (a tag could move). A pooled sandbox is unused when it is
//! handed out, is at most `warm_idle` old, and has passed its health check.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sandbox_core::{
    DynBackend, ImageRef, PoolConfig, ResolvedSecrets, Sandbox, SandboxSpec, Tier, WarmPool,
};

/// Most specs pooled at once.
pub(crate) const MAX_POOLS: usize = 8;

/// What identifies a poolable create: the tier asked for (or none) and the spec.
pub(crate) type Key = String;

struct Pooled {
    pool: Arc<WarmPool>,
    last: Instant,
}

/// The server's pools.
pub(crate) struct Warm {
    size: usize,
    idle: Duration,
    pools: Mutex<HashMap<Key, Pooled>>,
}

impl Warm {
    pub(crate) fn new(size: usize, idle: Duration) -> Self {
        Warm {
            size,
            idle,
            pools: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Pooled>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The key of a create of `spec` on `tier`, if pools are on and the spec may be pooled.
    pub(crate) fn key(&self, spec: &SandboxSpec, tier: Option<Tier>) -> Option<Key> {
        if self.size == 0 || !poolable(spec) {
            return None;
        }
        let spec = serde_json::to_string(spec).ok()?;
        Some(format!("{}\n{spec}", tier.map_or("auto", Tier::name)))
    }

    /// A sandbox from the pool of `key`, if there is one (it creates inline when the pool
    /// is empty); `None` when `key` has no pool yet.
    pub(crate) async fn checkout(
        &self,
        key: &Key,
    ) -> Option<sandbox_core::Result<Box<dyn Sandbox>>> {
        let pool = {
            let mut all = self.lock();
            let p = all.get_mut(key)?;
            p.last = Instant::now();
            Arc::clone(&p.pool)
        };
        Some(pool.checkout().await)
    }

    /// Starts a pool for `key` after a plain create of `spec` succeeded on `backend`'s tier.
    /// Must be called inside a tokio runtime.
    pub(crate) fn adopt(&self, key: Key, backend: DynBackend, spec: &SandboxSpec) {
        // The library's refill delay (10 ms) lets the command of the sandbox just handed out
        // run before its replacement's creation competes with it for the CPUs (measured: a
        // one-shot run's command 0.97 ms against 1.19 ms when the refill starts at once).
        let config = PoolConfig::default().size(self.size).max_idle(self.idle);
        let pool = match WarmPool::start(backend, spec.clone(), ResolvedSecrets::none(), config) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                tracing::debug!(error = %e, "no warm pool for this spec");
                return;
            }
        };
        let evicted = {
            let mut all = self.lock();
            if all.contains_key(&key) {
                return;
            }
            let evicted = if all.len() >= MAX_POOLS {
                let oldest = all
                    .iter()
                    .min_by_key(|(_, p)| p.last)
                    .map(|(k, _)| k.clone());
                oldest.and_then(|k| all.remove(&k))
            } else {
                None
            };
            all.insert(
                key,
                Pooled {
                    pool,
                    last: Instant::now(),
                },
            );
            evicted
        };
        if let Some(p) = evicted {
            tokio::spawn(shut(p.pool));
        }
    }

    /// Shuts down the pools unused for longer than `warm_idle`.
    pub(crate) async fn expire(&self) {
        let now = Instant::now();
        let stale: Vec<Pooled> = {
            let mut all = self.lock();
            let keys: Vec<Key> = all
                .iter()
                .filter(|(_, p)| now.saturating_duration_since(p.last) > self.idle)
                .map(|(k, _)| k.clone())
                .collect();
            keys.iter().filter_map(|k| all.remove(k)).collect()
        };
        for p in stale {
            shut(p.pool).await;
        }
    }

    /// Shuts every pool down, destroying its ready sandboxes.
    pub(crate) async fn shutdown_all(&self) {
        let all: Vec<Pooled> = self.lock().drain().map(|(_, p)| p).collect();
        for p in all {
            shut(p.pool).await;
        }
    }

    /// The pools' counters, summed.
    pub(crate) fn stats(&self) -> crate::WarmStats {
        let all = self.lock();
        let mut s = crate::WarmStats {
            pools: all.len(),
            ..Default::default()
        };
        for p in all.values() {
            let st = p.pool.stats();
            s.ready += st.ready;
            s.hits += st.hits;
            s.misses += st.misses;
        }
        s
    }
}

impl crate::Shared {
    /// A sandbox of `spec` on `tier` for a client: a ready one from the spec's pool when it
    /// has one (made inline when the pool is empty), else a plain create, after which the
    /// spec gets a pool when it may be pooled. Whether it came from a pool.
    pub(crate) async fn create_pooled(
        &self,
        spec: &SandboxSpec,
        tier: Option<Tier>,
    ) -> sandbox_core::Result<(Box<dyn Sandbox>, bool)> {
        let key = self.warm.key(spec, tier);
        if let Some(k) = &key {
            if let Some(pooled) = self.warm.checkout(k).await {
                return Ok((pooled?, true));
            }
        }
        let sandbox = self.provider.create(spec, tier).await?;
        // The spec's first create: from now on its sandboxes are made ahead of time.
        if let (Some(k), Some(backend)) = (key, self.provider.backend(sandbox.tier())) {
            self.warm.adopt(k, backend, spec);
        }
        Ok((sandbox, false))
    }
}

/// Shuts a pool down once nothing else holds it (a checkout in flight finishes first).
async fn shut(pool: Arc<WarmPool>) {
    let mut pool = pool;
    loop {
        match Arc::try_unwrap(pool) {
            Ok(p) => return p.shutdown().await,
            Err(still) => {
                pool = still;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
}

/// Whether sandboxes of `spec` may be made before they are asked for (see the module).
fn poolable(spec: &SandboxSpec) -> bool {
    crate::host_access(spec).is_none()
        && spec.secrets.is_empty()
        && match &spec.image {
            None => true,
            Some(ImageRef::Registry { digest, .. }) => digest.is_some(),
            Some(_) => false,
        }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_core::Language;

    #[test]
    fn only_specs_that_cannot_go_stale_are_pooled() {
        let w = Warm::new(1, Duration::from_secs(60));
        let plain = SandboxSpec::new(Language::Shell);
        assert!(w.key(&plain, Some(Tier::Container)).is_some());
        // The tier asked for is part of the key.
        assert_ne!(
            w.key(&plain, Some(Tier::Container)),
            w.key(&plain, None),
            "auto and an explicit tier share a pool"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let host = SandboxSpec::builder(Language::Shell)
            .workspace_dir(dir.path(), false)
            .build()
            .expect("spec");
        assert_eq!(w.key(&host, None), None, "a host directory was pooled");
        let tagged = SandboxSpec::builder(Language::Shell)
            .image("docker.io/library/alpine:3.20")
            .build()
            .expect("spec");
        assert_eq!(w.key(&tagged, None), None, "a tag that may move was pooled");
        let pinned = SandboxSpec::builder(Language::Shell)
            .image(format!(
                "docker.io/library/alpine@sha256:{}",
                "a".repeat(64)
            ))
            .build()
            .expect("spec");
        assert!(
            w.key(&pinned, None).is_some(),
            "a digest-pinned image was not pooled"
        );
        let off = Warm::new(0, Duration::from_secs(60));
        assert_eq!(off.key(&plain, None), None, "pools are off at size 0");
    }
}
