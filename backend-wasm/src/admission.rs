//! Admission control: a limit on guests running at once, per backend.
//!
//! Guests run inside this process on its CPUs. Without a bound, N sessions that each need a
//! few CPU-seconds at once (200 agents importing pandas on their first turn) time-slice the
//! machine: every one of them is slowed N-fold and their wall limits, which count from the
//! start of the run, stop them all. With admission, at most [`Admission::limit`] guest
//! calls run; the others wait in a fair first-in, first-out queue (tokio's semaphore hands
//! permits out in request order) and their wall, CPU and fuel limits start only when they
//! are admitted, because the limits are armed on the guest thread when the guest starts.
//! The wait is reported as the call's [`Phase::Queue`](sandbox_core::Phase::Queue).
//!
//! A caller that stops waiting (drops the call's future: its own deadline, a cancellation)
//! leaves the queue at once. An admitted call holds its slot until its guest job ends,
//! even if its caller has gone (the guest finishes or hits its deadline in the
//! background), so the bound holds for what really runs.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_core::{Error, Result, Tier};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The environment variable that sets the default limit on guests running at once (a
/// number; `0` for no limit). [`WasmBackendBuilder::max_running_guests`](crate::WasmBackendBuilder::max_running_guests)
/// overrides it.
pub const MAX_RUNNING_ENV: &str = "AGENT_SANDBOX_WASM_MAX_RUNNING";

/// Guests admitted per available CPU by default: one would leave a CPU idle while a guest
/// waits in a host tool or a sleep; more than two only stretches every running guest's wall
/// time without finishing work sooner.
pub const RUNNING_PER_CPU: usize = 2;

/// The default limit: [`MAX_RUNNING_ENV`] if it is set to a number (`0`: no limit), else
/// [`RUNNING_PER_CPU`] × the available parallelism (at least 2).
pub fn default_max_running() -> Option<usize> {
    if let Ok(v) = std::env::var(MAX_RUNNING_ENV) {
        match v.trim().parse::<usize>() {
            Ok(0) => return None,
            Ok(n) => return Some(n),
            Err(_) => tracing::warn!(
                "{MAX_RUNNING_ENV}={v:?} is not a number; using the default limit on running guests"
            ),
        }
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some((cpus * RUNNING_PER_CPU).max(2))
}

/// What a backend's admission control has done so far (see
/// [`WasmBackend::admission_stats`](crate::WasmBackend::admission_stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdmissionStats {
    /// Guests allowed to run at once (`None`: no limit).
    pub limit: Option<usize>,
    /// Guest calls running now.
    pub running: usize,
    /// Calls waiting for a slot now.
    pub queued: usize,
    /// The most guest calls that ever ran at once.
    pub peak_running: usize,
    /// Calls admitted so far.
    pub admitted: u64,
    /// Calls that had to wait for a slot (found none free).
    pub waited: u64,
    /// Their total wait.
    pub total_wait: Duration,
}

#[derive(Debug, Default)]
struct Counters {
    running: AtomicUsize,
    queued: AtomicUsize,
    peak: AtomicUsize,
    admitted: AtomicU64,
    waited: AtomicU64,
    wait_micros: AtomicU64,
}

/// A backend's admission control. Cheap to clone; clones share the limit and the queue.
#[derive(Debug, Clone)]
pub(crate) struct Admission {
    sem: Option<Arc<Semaphore>>,
    limit: Option<usize>,
    counters: Arc<Counters>,
}

/// A slot held by an admitted call; the slot is free again when the last clone drops
/// (move one into each guest job of the call).
#[derive(Debug)]
pub(crate) struct Ticket {
    _permit: Option<OwnedSemaphorePermit>,
    counters: Arc<Counters>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.counters.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Decrements the queue counter when a wait ends, also when the waiting future is dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Admission {
    /// At most `limit` guests at once; `None` or `Some(0)`: no limit.
    pub(crate) fn new(limit: Option<usize>) -> Self {
        let limit = limit.filter(|n| *n > 0);
        Admission {
            // Capped: tokio's semaphore holds at most `Semaphore::MAX_PERMITS`.
            sem: limit.map(|n| Arc::new(Semaphore::new(n.min(Semaphore::MAX_PERMITS)))),
            limit,
            counters: Arc::new(Counters::default()),
        }
    }

    /// The limit (`None`: none).
    pub(crate) fn limit(&self) -> Option<usize> {
        self.limit
    }

    /// Waits for a slot, first come first served. Cancel-safe: dropping the future leaves
    /// the queue.
    pub(crate) async fn admit(&self) -> Result<Arc<Ticket>> {
        let c = &self.counters;
        let permit = match &self.sem {
            None => None,
            Some(sem) => match Arc::clone(sem).try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    c.queued.fetch_add(1, Ordering::SeqCst);
                    let waiting = Waiting(&c.queued);
                    let start = Instant::now();
                    let p = Arc::clone(sem).acquire_owned().await.map_err(|_| {
                        Error::backend(Tier::Wasm, "the admission queue was closed (a bug)")
                    })?;
                    drop(waiting);
                    c.waited.fetch_add(1, Ordering::SeqCst);
                    c.wait_micros.fetch_add(
                        u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
                        Ordering::SeqCst,
                    );
                    Some(p)
                }
            },
        };
        let now = c.running.fetch_add(1, Ordering::SeqCst) + 1;
        c.peak.fetch_max(now, Ordering::SeqCst);
        c.admitted.fetch_add(1, Ordering::SeqCst);
        Ok(Arc::new(Ticket {
            _permit: permit,
            counters: Arc::clone(c),
        }))
    }

    /// A snapshot of the counters.
    pub(crate) fn stats(&self) -> AdmissionStats {
        let c = &self.counters;
        AdmissionStats {
            limit: self.limit,
            running: c.running.load(Ordering::SeqCst),
            queued: c.queued.load(Ordering::SeqCst),
            peak_running: c.peak.load(Ordering::SeqCst),
            admitted: c.admitted.load(Ordering::SeqCst),
            waited: c.waited.load(Ordering::SeqCst),
            total_wait: Duration::from_micros(c.wait_micros.load(Ordering::SeqCst)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn limit_one_admits_in_order_and_counts() {
        let a = Admission::new(Some(1));
        let first = a.admit().await.unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..4 {
            let (adm, order) = (a.clone(), Arc::clone(&order));
            waiters.push(tokio::spawn(async move {
                let t = adm.admit().await.unwrap();
                order.lock().unwrap().push(i);
                tokio::task::yield_now().await;
                drop(t);
            }));
            // Each waiter is queued before the next is spawned.
            while a.stats().queued < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(a.stats().running, 1);
        assert_eq!(a.stats().queued, 4);
        drop(first);
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(
            *order.lock().unwrap(),
            [0, 1, 2, 3],
            "first come, first served"
        );
        let s = a.stats();
        assert_eq!((s.running, s.queued, s.peak_running), (0, 0, 1));
        assert_eq!((s.admitted, s.waited), (5, 4));
    }

    #[tokio::test]
    async fn a_dropped_wait_leaves_the_queue() {
        let a = Admission::new(Some(1));
        let held = a.admit().await.unwrap();
        let r = tokio::time::timeout(Duration::from_millis(10), a.admit()).await;
        assert!(r.is_err(), "no slot while one is held");
        assert_eq!(a.stats().queued, 0);
        drop(held);
        let _again = a.admit().await.unwrap();
        assert_eq!(a.stats().running, 1);
    }

    #[tokio::test]
    async fn zero_or_none_is_unlimited() {
        for limit in [None, Some(0)] {
            let a = Admission::new(limit);
            assert_eq!(a.limit(), None);
            let held: Vec<_> = futures_all(&a, 100).await;
            assert_eq!(a.stats().running, 100);
            drop(held);
            assert_eq!(a.stats().running, 0);
        }
    }

    async fn futures_all(a: &Admission, n: usize) -> Vec<Arc<Ticket>> {
        let mut v = Vec::new();
        for _ in 0..n {
            v.push(a.admit().await.unwrap());
        }
        v
    }
}
