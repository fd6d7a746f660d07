//! The life of a sandbox: live, paused, gone (with the reason), its teardown, and the
//! transitions between them, checked in one place so that every tier answers the same way:
//!
//! | operation | live | paused | gone | releasing | released |
//! |---|---|---|---|---|---|
//! | `exec`, `exec_stream` | runs | [`Error::SandboxPaused`] | [`Error::SandboxGone`] | [`Error::SandboxGone`] | [`Error::SandboxGone`] |
//! | `pause` | pauses | `Ok`, nothing done | [`Error::SandboxGone`] | [`Error::SandboxGone`] | [`Error::SandboxGone`] |
//! | `resume` | `Ok`, nothing done | resumes | [`Error::SandboxGone`] | [`Error::SandboxGone`] | [`Error::SandboxGone`] |
//! | `destroy` | ends it, frees it | ends it, frees it | frees it | waits for the teardown under way | `Ok`, nothing done |
//! | anything else | runs | the tier's choice (see its docs) | [`Error::SandboxGone`] | [`Error::SandboxGone`] | [`Error::SandboxGone`] |
//!
//! *Gone*, *releasing* and *released* all answer as ended: they differ only in what the host
//! still holds. A sandbox that ends on its own (its lifetime ran out, its init exited) is
//! *gone* and may still hold its resources; [`Lifecycle::release`] ends it if need be and runs
//! its teardown exactly once (*releasing* while it runs, *released* once it is done).
//!
//! A sandbox ends once: the first reason ("destroyed", [`LIFETIME_REACHED`], "its init
//! exited"...) is the one every later [`Error::SandboxGone`] reports.
//!
//! Backends keep one [`Lifecycle`] per sandbox and call it before each operation:
//!
//! - The engine's work of a pause or a resume (freezing a cgroup, pausing vCPUs) happens while
//!   the [`Step`] that [`Lifecycle::begin`] returned is held, and [`Step::complete`] records
//!   it. Pause, resume and destroy of one sandbox are serialised: `begin` and
//!   [`Lifecycle::hold`] (which `destroy` takes, and anything else that must not overlap a
//!   transition) wait for the transition under way to finish. So a resume that returns `Ok`
//!   leaves the sandbox running until a later pause, never paused by one it overlapped.
//! - [`Lifecycle::lapse`] is the lifetime check, written once for every tier.
//! - [`Lifecycle::release`] runs the teardown once; callers that come while it runs wait for
//!   it, and a teardown that panicked is run again by the next caller (no lock here poisons).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::OwnedMutexGuard;

use crate::error::{Error, Result};

/// The reason a sandbox whose lifetime ran out ended with ([`Lifecycle::lapse`]).
pub const LIFETIME_REACHED: &str = "lifetime limit reached";

/// Where a sandbox is in its life. `#[non_exhaustive]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum State {
    /// Created and running: commands may run.
    Live,
    /// Frozen by [`Sandbox::pause`](crate::Sandbox::pause): nothing runs until resumed.
    Paused,
    /// Ended for good, with the reason; what it holds on the host is not yet released.
    Gone(String),
    /// Ended, with the reason; its teardown has begun and has not finished.
    Releasing(String),
    /// Ended, with the reason; its resources are freed.
    Released(String),
}

impl State {
    /// The reason it ended, once it has (gone, releasing or released).
    pub fn ended(&self) -> Option<&str> {
        match self {
            State::Gone(r) | State::Releasing(r) | State::Released(r) => Some(r),
            State::Live | State::Paused => None,
        }
    }
}

/// A pause or a resume, for [`Lifecycle::begin`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transition {
    /// Live to paused.
    Pause,
    /// Paused to live.
    Resume,
}

/// One sandbox's state, shared by its operations (the sandbox keeps it behind its own `Arc`).
#[derive(Debug)]
pub struct Lifecycle {
    id: String,
    state: Mutex<State>,
    /// Held across a transition's engine work (and by destroy): one at a time per sandbox.
    transition: Arc<tokio::sync::Mutex<()>>,
    /// Held by the one running the teardown; later releases wait on it.
    release: Mutex<()>,
}

/// A pause or a resume under way, from [`Lifecycle::begin`]: other transitions of the sandbox
/// wait until it is dropped. [`complete`](Step::complete) records it; dropped without that
/// (the engine's work failed), the state is unchanged.
#[derive(Debug)]
#[must_use = "a step records nothing until `complete` is called"]
pub struct Step<'a> {
    life: &'a Lifecycle,
    t: Transition,
    _held: OwnedMutexGuard<()>,
}

impl Step<'_> {
    /// Records the finished pause or resume and lets the next transition in. A sandbox that
    /// ended meanwhile stays ended.
    pub fn complete(self) {
        let mut s = self.life.lock();
        if matches!(*s, State::Live | State::Paused) {
            *s = match self.t {
                Transition::Pause => State::Paused,
                Transition::Resume => State::Live,
            };
        }
    }
}

/// The sandbox's transition lock held with no transition recorded, from [`Lifecycle::hold`]:
/// no pause or resume starts while it lives. `'static`, for work that outlives the call that
/// began it (a snapshot's background resume).
#[derive(Debug)]
pub struct Held {
    _guard: OwnedMutexGuard<()>,
}

impl Lifecycle {
    /// A live sandbox named `id` (the id errors report).
    pub fn new(id: impl Into<String>) -> Self {
        Lifecycle {
            id: id.into(),
            state: Mutex::new(State::Live),
            transition: Arc::new(tokio::sync::Mutex::new(())),
            release: Mutex::new(()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every write is a single assignment: a panic elsewhere cannot leave it half-made.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The sandbox's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The current state.
    pub fn state(&self) -> State {
        self.lock().clone()
    }

    /// Whether the sandbox has ended (gone, releasing or released).
    pub fn is_gone(&self) -> bool {
        self.lock().ended().is_some()
    }

    /// Whether the sandbox is paused.
    pub fn is_paused(&self) -> bool {
        matches!(*self.lock(), State::Paused)
    }

    /// Whether its teardown has begun (releasing) or is done (released).
    pub fn release_begun(&self) -> bool {
        matches!(*self.lock(), State::Releasing(_) | State::Released(_))
    }

    /// Whether its teardown is done.
    pub fn is_released(&self) -> bool {
        matches!(*self.lock(), State::Released(_))
    }

    /// Why the sandbox ended, if it has.
    pub fn gone_reason(&self) -> Option<String> {
        self.lock().ended().map(str::to_string)
    }

    /// For operations that need the sandbox to exist, paused or not.
    ///
    /// # Errors
    /// [`Error::SandboxGone`] with the reason it ended.
    pub fn check_not_gone(&self) -> Result<()> {
        match self.lock().ended() {
            Some(r) => Err(self.gone(r)),
            None => Ok(()),
        }
    }

    /// For operations that need the sandbox running: commands.
    ///
    /// # Errors
    /// [`Error::SandboxGone`] once it ended, [`Error::SandboxPaused`] while it is paused.
    pub fn check_running(&self) -> Result<()> {
        let s = self.lock();
        match &*s {
            State::Live => Ok(()),
            State::Paused => Err(Error::SandboxPaused {
                id: self.id.clone(),
            }),
            ended => Err(self.gone(ended.ended().unwrap_or("destroyed"))),
        }
    }

    /// The lifetime check: once more than `lifetime` has passed since `born`, ends the
    /// sandbox with [`LIFETIME_REACHED`]. `true` for the call that ended it (the caller then
    /// frees what its tier frees at that point); `false` while time is left, and once it
    /// ended (for this or any other reason).
    pub fn lapse(&self, born: Instant, lifetime: Duration) -> bool {
        born.elapsed() > lifetime && self.end(LIFETIME_REACHED)
    }

    /// Starts a pause or a resume, once any other transition of this sandbox (or a destroy)
    /// has finished: `Some(step)` when the backend has work to do (do it, then
    /// [`Step::complete`]), `None` when the sandbox is already there (pausing a paused
    /// sandbox, resuming a live one: nothing to do, and no error).
    ///
    /// # Errors
    /// [`Error::SandboxGone`] once the sandbox ended (also when it ended while this waited).
    pub async fn begin(&self, t: Transition) -> Result<Option<Step<'_>>> {
        let held = Arc::clone(&self.transition).lock_owned().await;
        match (&*self.lock(), t) {
            (State::Live, Transition::Pause) | (State::Paused, Transition::Resume) => {}
            (State::Paused, Transition::Pause) | (State::Live, Transition::Resume) => {
                return Ok(None)
            }
            (ended, _) => return Err(self.gone(ended.ended().unwrap_or("destroyed"))),
        }
        Ok(Some(Step {
            life: self,
            t,
            _held: held,
        }))
    }

    /// Waits for the transition under way (if any) and keeps any other from starting until
    /// the returned guard is dropped: what `destroy` holds, so that it never overlaps a pause
    /// or a resume.
    pub async fn hold(&self) -> Held {
        Held {
            _guard: Arc::clone(&self.transition).lock_owned().await,
        }
    }

    /// Ends the sandbox for `reason`. Returns `true` for the call that ended it; later calls
    /// change nothing (the first reason sticks) and return `false`.
    pub fn end(&self, reason: impl Into<String>) -> bool {
        let mut s = self.lock();
        if s.ended().is_some() {
            return false;
        }
        *s = State::Gone(reason.into());
        true
    }

    /// Ends the sandbox for `reason` (unless it ended already: the first reason sticks) and
    /// frees it: runs `teardown` while the state is *releasing*, then records *released*.
    /// Exactly one call runs a teardown to its end; a call made while one runs blocks until
    /// it is done, and one made after returns at once. A teardown that panicked left the
    /// state *releasing*: the next call runs it again. Returns what `teardown` returned, or
    /// `None` when this call did not run it.
    ///
    /// Blocking: from async code, call it where blocking is allowed (`spawn_blocking`) when
    /// the teardown is slow.
    pub fn release<T>(&self, reason: impl Into<String>, teardown: impl FnOnce() -> T) -> Option<T> {
        self.end(reason);
        // A lock no panic can leave closed for good: a teardown that panicked is run again.
        let _one = self.release.lock().unwrap_or_else(PoisonError::into_inner);
        {
            let mut s = self.lock();
            let r = match &*s {
                State::Released(_) => return None,
                State::Gone(r) | State::Releasing(r) => r.clone(),
                // `end` above made it gone and nothing revives a sandbox: unreachable, and
                // harmless (it is freed under the reason every call reports for it).
                State::Live | State::Paused => "destroyed".to_string(),
            };
            *s = State::Releasing(r);
        }
        let out = teardown();
        let mut s = self.lock();
        if let State::Releasing(r) = &*s {
            *s = State::Released(r.clone());
        }
        Some(out)
    }

    /// [`Error::SandboxGone`] for this sandbox, with the reason it ended ("destroyed" if it
    /// has not: a backend that lost its handles without recording why).
    pub fn gone_error(&self) -> Error {
        let reason = self.gone_reason().unwrap_or_else(|| "destroyed".into());
        Error::SandboxGone {
            id: self.id.clone(),
            reason,
        }
    }

    fn gone(&self, reason: &str) -> Error {
        Error::SandboxGone {
            id: self.id.clone(),
            reason: reason.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn gone_reason<T: std::fmt::Debug>(r: Result<T>) -> String {
        match r {
            Err(Error::SandboxGone { id, reason }) => {
                assert_eq!(id, "sb-1");
                reason
            }
            other => panic!("expected SandboxGone, got {other:?}"),
        }
    }

    async fn pause(l: &Lifecycle) {
        l.begin(Transition::Pause)
            .await
            .unwrap()
            .unwrap()
            .complete();
    }

    #[test]
    fn a_new_sandbox_is_live_and_runs_commands() {
        let l = Lifecycle::new("sb-1");
        assert_eq!(l.state(), State::Live);
        l.check_running().unwrap();
        l.check_not_gone().unwrap();
        assert!(!l.is_gone() && !l.is_paused() && l.gone_reason().is_none());
        assert!(!l.release_begun() && !l.is_released());
    }

    #[tokio::test]
    async fn live_to_paused_refuses_commands_but_exists() {
        let l = Lifecycle::new("sb-1");
        let step = l.begin(Transition::Pause).await.unwrap().unwrap();
        // Until the backend's work is done, it is still live.
        l.check_running().unwrap();
        step.complete();
        assert_eq!(l.state(), State::Paused);
        match l.check_running() {
            Err(e @ Error::SandboxPaused { .. }) => {
                assert!(e.to_string().contains("paused"), "{e}")
            }
            other => panic!("expected SandboxPaused, got {other:?}"),
        }
        l.check_not_gone().unwrap();
    }

    #[tokio::test]
    async fn pause_while_paused_and_resume_while_live_are_no_ops() {
        let l = Lifecycle::new("sb-1");
        assert!(l.begin(Transition::Resume).await.unwrap().is_none());
        pause(&l).await;
        assert!(l.begin(Transition::Pause).await.unwrap().is_none());
        assert_eq!(l.state(), State::Paused);
    }

    #[tokio::test]
    async fn paused_to_live_runs_commands_again() {
        let l = Lifecycle::new("sb-1");
        pause(&l).await;
        l.begin(Transition::Resume)
            .await
            .unwrap()
            .unwrap()
            .complete();
        assert_eq!(l.state(), State::Live);
        l.check_running().unwrap();
    }

    #[tokio::test]
    async fn a_failed_transition_changes_nothing() {
        let l = Lifecycle::new("sb-1");
        drop(l.begin(Transition::Pause).await.unwrap().unwrap());
        assert_eq!(l.state(), State::Live);
        // ...and does not keep the next one out.
        pause(&l).await;
        assert_eq!(l.state(), State::Paused);
    }

    #[tokio::test]
    async fn live_to_gone_keeps_the_first_reason() {
        let l = Lifecycle::new("sb-1");
        assert!(l.end(LIFETIME_REACHED));
        assert!(!l.end("destroyed"), "ending twice is a no-op");
        assert_eq!(l.state(), State::Gone(LIFETIME_REACHED.into()));
        assert_eq!(gone_reason(l.check_running()), LIFETIME_REACHED);
        assert_eq!(gone_reason(l.check_not_gone()), LIFETIME_REACHED);
        assert_eq!(
            gone_reason(l.begin(Transition::Pause).await),
            LIFETIME_REACHED
        );
        assert_eq!(
            gone_reason(l.begin(Transition::Resume).await),
            LIFETIME_REACHED
        );
        assert_eq!(gone_reason::<()>(Err(l.gone_error())), LIFETIME_REACHED);
        assert!(!l.release_begun(), "ended, not yet freed");
    }

    #[tokio::test]
    async fn paused_to_gone() {
        let l = Lifecycle::new("sb-1");
        pause(&l).await;
        assert!(l.end("destroyed"));
        assert_eq!(gone_reason(l.check_running()), "destroyed");
    }

    #[tokio::test]
    async fn a_transition_finishing_after_the_end_does_not_revive() {
        let l = Lifecycle::new("sb-1");
        let step = l.begin(Transition::Pause).await.unwrap().unwrap();
        l.end("its init exited");
        step.complete();
        assert!(l.is_gone());
        assert_eq!(l.gone_reason().as_deref(), Some("its init exited"));
    }

    #[test]
    fn gone_error_without_a_recorded_end_says_destroyed() {
        let l = Lifecycle::new("sb-1");
        assert_eq!(gone_reason::<()>(Err(l.gone_error())), "destroyed");
    }

    #[test]
    fn lapse_ends_once_and_only_after_the_lifetime() {
        let l = Lifecycle::new("sb-1");
        let born = Instant::now();
        assert!(!l.lapse(born, Duration::from_secs(3600)));
        assert_eq!(l.state(), State::Live);
        assert!(l.lapse(born, Duration::ZERO), "the call that ended it");
        assert!(!l.lapse(born, Duration::ZERO), "ended already");
        assert_eq!(l.state(), State::Gone(LIFETIME_REACHED.into()));
    }

    #[test]
    fn release_ends_and_frees_once() {
        let l = Lifecycle::new("sb-1");
        let runs = AtomicUsize::new(0);
        let out = l.release("destroyed", || {
            assert_eq!(l.state(), State::Releasing("destroyed".into()));
            runs.fetch_add(1, Ordering::SeqCst);
            7
        });
        assert_eq!(out, Some(7));
        assert_eq!(l.state(), State::Released("destroyed".into()));
        assert!(l.is_released() && l.release_begun() && l.is_gone());
        assert_eq!(
            l.release("dropped", || runs.fetch_add(1, Ordering::SeqCst)),
            None
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the teardown ran once");
        assert_eq!(gone_reason(l.check_running()), "destroyed");
    }

    #[test]
    fn release_of_a_gone_sandbox_keeps_why_it_ended() {
        let l = Lifecycle::new("sb-1");
        l.end(LIFETIME_REACHED);
        assert_eq!(l.release("destroyed", || ()), Some(()));
        assert_eq!(l.state(), State::Released(LIFETIME_REACHED.into()));
    }

    #[test]
    fn a_release_made_while_one_runs_waits_for_it() {
        let l = Arc::new(Lifecycle::new("sb-1"));
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let first = {
            let l = Arc::clone(&l);
            std::thread::spawn(move || {
                l.release("destroyed", || {
                    started_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                })
            })
        };
        started_rx.recv().unwrap();
        assert_eq!(l.state(), State::Releasing("destroyed".into()));
        let second = {
            let l = Arc::clone(&l);
            std::thread::spawn(move || {
                let ran = l.release("dropped", || ()).is_some();
                // Once it returns, the first teardown is done.
                (ran, l.state())
            })
        };
        go_tx.send(()).unwrap();
        assert_eq!(first.join().unwrap(), Some(()));
        let (ran, seen) = second.join().unwrap();
        assert!(!ran, "the second call found it freed");
        assert_eq!(seen, State::Released("destroyed".into()));
    }

    #[test]
    fn a_teardown_that_panicked_runs_again() {
        let l = Arc::new(Lifecycle::new("sb-1"));
        let panicked = {
            let l = Arc::clone(&l);
            std::thread::spawn(move || l.release("destroyed", || panic!("teardown failed"))).join()
        };
        assert!(panicked.is_err());
        assert_eq!(l.state(), State::Releasing("destroyed".into()));
        // The poisoned lock does not skip the teardown.
        assert_eq!(l.release("dropped", || 1), Some(1));
        assert_eq!(l.state(), State::Released("destroyed".into()));
    }

    #[tokio::test]
    async fn transitions_wait_for_the_one_under_way() {
        let l = Arc::new(Lifecycle::new("sb-1"));
        let step = l.begin(Transition::Pause).await.unwrap().unwrap();
        // A resume asked for while the pause runs: it must wait, then resume.
        let resume = {
            let l = Arc::clone(&l);
            tokio::spawn(async move {
                match l.begin(Transition::Resume).await {
                    Ok(Some(s)) => {
                        s.complete();
                        true
                    }
                    Ok(None) => false,
                    Err(e) => panic!("{e}"),
                }
            })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!resume.is_finished(), "the resume waits for the pause");
        step.complete();
        assert!(resume.await.unwrap(), "the resume had work to do");
        assert_eq!(l.state(), State::Live);
    }

    #[tokio::test]
    async fn hold_keeps_transitions_out_and_a_destroy_under_it_wins() {
        let l = Arc::new(Lifecycle::new("sb-1"));
        let held = l.hold().await;
        let pause = {
            let l = Arc::clone(&l);
            tokio::spawn(async move { l.begin(Transition::Pause).await.map(|s| s.is_some()) })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!pause.is_finished(), "the pause waits for the holder");
        l.release("destroyed", || ());
        drop(held);
        assert_eq!(gone_reason(pause.await.unwrap()), "destroyed");
    }

    #[test]
    fn ended_names_the_reason_of_every_ended_state() {
        assert_eq!(State::Live.ended(), None);
        assert_eq!(State::Paused.ended(), None);
        for s in [
            State::Gone("a".into()),
            State::Releasing("a".into()),
            State::Released("a".into()),
        ] {
            assert_eq!(s.ended(), Some("a"));
        }
    }
}
