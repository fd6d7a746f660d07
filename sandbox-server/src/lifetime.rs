//! Sandbox lifetimes: a TTL (the sandbox is destroyed when it runs out, in use or not) and an
//! idle timeout with an action, pause or destroy. A sandbox paused for idleness resumes on the
//! next request that uses it; one that is in use (a request in flight, such as a long exec) is
//! never idle. A sandbox a client paused stays paused until a client resumes it: requests that
//! use it meanwhile get `409 sandbox_paused`, as the library's `SandboxPaused`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::api::{IdleAction, LifetimeSpec, SandboxState};
use crate::error::ApiError;
use crate::{Entry, Shared};

/// A sandbox's lifetime and the state the reaper and the requests share.
pub(crate) struct Lifetime {
    spec: LifetimeSpec,
    /// When the sandbox is destroyed, in use or not: its TTL from its creation, moved by a
    /// client that sets a new timeout ([`set_deadline`](Self::set_deadline)).
    deadline: Mutex<Option<(Instant, std::time::SystemTime)>>,
    /// Pause at the deadline instead of destroying (E2B's `autoPause`); the sandbox then
    /// waits, paused, for a client to resume it.
    pause_at_deadline: AtomicBool,
    /// Requests using the sandbox now.
    active: AtomicUsize,
    /// When the last request using it ended (or when it was created).
    last_used: Mutex<Instant>,
    /// Whether it is paused, and by whom; changed only under this lock, which the reaper
    /// holds while it pauses and a request while it resumes.
    paused: tokio::sync::Mutex<Paused>,
    /// The same, readable without waiting (for its info).
    paused_now: AtomicBool,
    /// Set (under `paused`) when the reaper took it out of the table.
    reaped: AtomicBool,
}

impl Lifetime {
    pub(crate) fn new(spec: LifetimeSpec) -> Self {
        let now = Instant::now();
        Lifetime {
            // (A TTL is at most ten years: `check_lifetime`. One past what a clock holds is
            // no deadline rather than a panic.)
            deadline: Mutex::new(spec.ttl_s.and_then(|t| {
                Some((
                    now.checked_add(secs(t))?,
                    std::time::SystemTime::now().checked_add(secs(t))?,
                ))
            })),
            pause_at_deadline: AtomicBool::new(false),
            spec,
            active: AtomicUsize::new(0),
            last_used: Mutex::new(now),
            paused: tokio::sync::Mutex::new(Paused::No),
            paused_now: AtomicBool::new(false),
            reaped: AtomicBool::new(false),
        }
    }

    pub(crate) fn state(&self) -> SandboxState {
        if self.paused_now.load(Ordering::Relaxed) {
            SandboxState::Paused
        } else {
            SandboxState::Running
        }
    }

    /// The pause state, locked, unless the reaper has taken the sandbox (`id`) away.
    async fn lock_live(&self, id: &str) -> Result<tokio::sync::MutexGuard<'_, Paused>, ApiError> {
        let paused = self.paused.lock().await;
        if self.reaped.load(Ordering::SeqCst) {
            return Err(ApiError::no_sandbox(id));
        }
        Ok(paused)
    }

    /// Sets the pause state (held locked) and its lock-free mirror.
    fn set(&self, paused: &mut Paused, to: Paused) {
        *paused = to;
        self.paused_now.store(to != Paused::No, Ordering::Relaxed);
    }

    fn idle_for(&self, now: Instant) -> Duration {
        let last = *self.last_used.lock().unwrap_or_else(|p| p.into_inner());
        now.saturating_duration_since(last)
    }

    fn expired(&self, now: Instant) -> bool {
        self.deadline().is_some_and(|d| now >= d)
    }

    /// When the sandbox will be destroyed (`None`: not for its age).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.deadline
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|(at, _)| at)
    }

    /// The same, as a time of day (fixed when it was set, so it reads the same each time).
    pub(crate) fn deadline_at(&self) -> Option<std::time::SystemTime> {
        self.deadline
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|(_, at)| at)
    }

    /// Destroys the sandbox at `at` instead (E2B's "set timeout": counted from now);
    /// `None`: not for its age.
    pub(crate) fn set_deadline(&self, at: Option<Instant>) {
        let wall = at.map(|at| {
            let now = Instant::now();
            (
                at,
                std::time::SystemTime::now() + at.saturating_duration_since(now),
            )
        });
        *self.deadline.lock().unwrap_or_else(|p| p.into_inner()) = wall;
    }

    /// Pauses the sandbox at its deadline instead of destroying it.
    pub(crate) fn pause_at_deadline(&self, pause: bool) {
        self.pause_at_deadline.store(pause, Ordering::SeqCst);
    }

    /// The idle action due now, if any (never while a request uses the sandbox).
    fn idle_due(&self, now: Instant) -> Option<IdleAction> {
        let limit = secs(self.spec.idle_timeout_s?);
        (self.active.load(Ordering::SeqCst) == 0 && self.idle_for(now) >= limit)
            .then_some(self.spec.on_idle)
    }
}

/// Whether a sandbox is paused, and by whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Paused {
    No,
    /// By its idle timeout: the next request that uses it resumes it.
    Idle,
    /// By a client: paused until a client resumes it.
    Client,
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// A sandbox in use by one request: while it lives the sandbox is not idle; when it drops
/// the idle clock restarts.
pub(crate) struct InUse(Arc<Entry>);

impl InUse {
    /// Marks `entry` in use, resuming it first if its idle timeout paused it.
    pub(crate) async fn enter(entry: Arc<Entry>) -> Result<InUse, ApiError> {
        let life = &entry.life;
        let mut paused = life.lock_live(&entry.info.id).await?;
        if *paused == Paused::Client {
            return Err(ApiError::from(sandbox_core::Error::SandboxPaused {
                id: entry.info.id.clone(),
            }));
        }
        life.active.fetch_add(1, Ordering::SeqCst);
        let guard = InUse(Arc::clone(&entry));
        if *paused == Paused::Idle {
            // On failure the guard drops and the sandbox stays marked paused: the next
            // request tries again.
            entry.sandbox.resume().await?;
            life.set(&mut paused, Paused::No);
        }
        Ok(guard)
    }
}

impl std::ops::Deref for InUse {
    type Target = Entry;

    fn deref(&self) -> &Entry {
        &self.0
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        let life = &self.0.life;
        *life.last_used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        life.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Pauses `entry` at a client's request; it stays paused until a client resumes it.
pub(crate) async fn pause(entry: Arc<Entry>) -> Result<(), ApiError> {
    let life = &entry.life;
    let mut paused = life.lock_live(&entry.info.id).await?;
    if life.active.load(Ordering::SeqCst) > 0 {
        return Err(ApiError::new(
            axum::http::StatusCode::CONFLICT,
            "busy",
            format!(
                "sandbox {} is in use by another request (an exec or a stream); pause it when \
                 that has ended",
                entry.info.id
            ),
        ));
    }
    // Pausing a paused sandbox does nothing (the library's rule); one the idle timeout paused
    // becomes the client's, so requests no longer resume it.
    if *paused == Paused::No {
        entry.sandbox.pause().await?;
    }
    life.set(&mut paused, Paused::Client);
    Ok(())
}

/// Resumes `entry` at a client's request (a running one: as the tier's `resume` does, which
/// is nothing where it has pause and `Unsupported` where it has not).
pub(crate) async fn resume(entry: Arc<Entry>) -> Result<(), ApiError> {
    let life = &entry.life;
    let mut paused = life.lock_live(&entry.info.id).await?;
    entry.sandbox.resume().await?;
    life.set(&mut paused, Paused::No);
    Ok(())
}

/// Enforces every sandbox's lifetime, every `reap_interval`, until aborted.
pub(crate) async fn reap(shared: Arc<Shared>) {
    let mut tick =
        tokio::time::interval(shared.config.reap_interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let entries: Vec<Arc<Entry>> = shared.lock().values().cloned().collect();
        for e in entries {
            reap_one(&shared, e).await;
        }
        shared.warm.expire().await;
    }
}

async fn reap_one(shared: &Shared, e: Arc<Entry>) {
    let now = Instant::now();
    let life = &e.life;
    if life.expired(now) && life.pause_at_deadline.load(Ordering::SeqCst) {
        let mut paused = life.paused.lock().await;
        if life.active.load(Ordering::SeqCst) > 0 {
            // In use: paused at the first moment it is not.
            return;
        }
        let done = *paused != Paused::No
            || {
                match e.sandbox.pause().await {
                    Ok(()) => true,
                    Err(err) => {
                        tracing::warn!(sandbox = %e.info.id, error = %err, "pause at its timeout failed: destroyed instead");
                        false
                    }
                }
            };
        if done {
            life.set(&mut paused, Paused::Client);
            life.set_deadline(None);
            tracing::info!(sandbox = %e.info.id, "paused: its timeout ran out");
            return;
        }
        life.reaped.store(true, Ordering::SeqCst);
        remove_and_destroy(shared, &e, "its timeout ran out and it could not be paused");
        return;
    }
    if life.expired(now) {
        let _paused = life.paused.lock().await;
        life.reaped.store(true, Ordering::SeqCst);
        remove_and_destroy(shared, &e, "its TTL ran out");
        return;
    }
    if life.idle_due(now).is_none() {
        return;
    }
    let mut paused = life.paused.lock().await;
    // Checked again under the lock: a request may have started meanwhile.
    match life.idle_due(Instant::now()) {
        Some(IdleAction::Destroy) => {
            life.reaped.store(true, Ordering::SeqCst);
            remove_and_destroy(shared, &e, "it was idle past its timeout");
        }
        Some(IdleAction::Pause) if *paused == Paused::No => match e.sandbox.pause().await {
            Ok(()) => {
                life.set(&mut paused, Paused::Idle);
                tracing::info!(sandbox = %e.info.id, "paused: idle past its timeout");
            }
            Err(err) => {
                tracing::warn!(sandbox = %e.info.id, error = %err, "pause when idle failed");
                // Not tried again until it has been idle that long once more.
                *life.last_used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
            }
        },
        _ => {}
    }
}

/// Takes `e` out of the table (if it is still there) and destroys it in the background.
fn remove_and_destroy(shared: &Shared, e: &Arc<Entry>, why: &'static str) {
    let id = e.info.id.clone();
    let mut all = shared.lock();
    if all.get(&id).is_some_and(|x| Arc::ptr_eq(x, e)) {
        all.remove(&id);
        drop(all);
        shared.destroy_later(id, Arc::clone(&e.sandbox), Some(why));
    }
}
