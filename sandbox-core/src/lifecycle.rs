//! The life of a sandbox: live, paused, gone (with the reason), and the transitions between
//! them, checked in one place so that every tier answers the same way:
//!
//! | operation | live | paused | gone |
//! |---|---|---|---|
//! | `exec`, `exec_stream` | runs | [`Error::SandboxPaused`] | [`Error::SandboxGone`] |
//! | `pause` | pauses | `Ok`, nothing done | [`Error::SandboxGone`] |
//! | `resume` | `Ok`, nothing done | resumes | [`Error::SandboxGone`] |
//! | `destroy` | ends it | ends it | `Ok`, nothing done |
//! | anything else | runs | the tier's choice (see its docs) | [`Error::SandboxGone`] |
//!
//! A sandbox ends once: the first reason ("destroyed", "lifetime limit reached", "its init
//! exited"...) is the one every later [`Error::SandboxGone`] reports.
//!
//! Backends keep one [`Lifecycle`] per sandbox and call it before each operation; the
//! engine-specific work (freezing a cgroup, pausing vCPUs) happens between
//! [`Lifecycle::begin`] and [`Lifecycle::complete`].

use std::sync::{Mutex, MutexGuard};

use crate::error::{Error, Result};

/// Where a sandbox is in its life. `#[non_exhaustive]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum State {
    /// Created and running: commands may run.
    Live,
    /// Frozen by [`Sandbox::pause`](crate::Sandbox::pause): nothing runs until resumed.
    Paused,
    /// Ended for good, with the reason.
    Gone(String),
}

/// A pause or a resume, for [`Lifecycle::begin`] and [`Lifecycle::complete`].
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
}

impl Lifecycle {
    /// A live sandbox named `id` (the id errors report).
    pub fn new(id: impl Into<String>) -> Self {
        Lifecycle {
            id: id.into(),
            state: Mutex::new(State::Live),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every write is a single assignment: a panic elsewhere cannot leave it half-made.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sandbox's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The current state.
    pub fn state(&self) -> State {
        self.lock().clone()
    }

    /// Whether the sandbox has ended.
    pub fn is_gone(&self) -> bool {
        matches!(*self.lock(), State::Gone(_))
    }

    /// Whether the sandbox is paused.
    pub fn is_paused(&self) -> bool {
        matches!(*self.lock(), State::Paused)
    }

    /// Why the sandbox ended, if it has.
    pub fn gone_reason(&self) -> Option<String> {
        match &*self.lock() {
            State::Gone(r) => Some(r.clone()),
            _ => None,
        }
    }

    /// For operations that need the sandbox to exist, paused or not.
    ///
    /// # Errors
    /// [`Error::SandboxGone`] with the reason it ended.
    pub fn check_not_gone(&self) -> Result<()> {
        match &*self.lock() {
            State::Gone(r) => Err(self.gone(r)),
            _ => Ok(()),
        }
    }

    /// For operations that need the sandbox running: commands.
    ///
    /// # Errors
    /// [`Error::SandboxGone`] once it ended, [`Error::SandboxPaused`] while it is paused.
    pub fn check_running(&self) -> Result<()> {
        match &*self.lock() {
            State::Live => Ok(()),
            State::Paused => Err(Error::SandboxPaused {
                id: self.id.clone(),
            }),
            State::Gone(r) => Err(self.gone(r)),
        }
    }

    /// Starts a pause or a resume: `Ok(true)` when the backend has work to do, `Ok(false)`
    /// when the sandbox is already there (pausing a paused sandbox, resuming a live one:
    /// nothing to do, and no error). Call [`complete`](Self::complete) once the work is done.
    ///
    /// # Errors
    /// [`Error::SandboxGone`] once the sandbox ended.
    pub fn begin(&self, t: Transition) -> Result<bool> {
        match (&*self.lock(), t) {
            (State::Gone(r), _) => Err(self.gone(r)),
            (State::Live, Transition::Pause) | (State::Paused, Transition::Resume) => Ok(true),
            (State::Paused, Transition::Pause) | (State::Live, Transition::Resume) => Ok(false),
        }
    }

    /// Records a finished pause or resume. A sandbox that ended meanwhile stays gone.
    pub fn complete(&self, t: Transition) {
        let mut s = self.lock();
        if !matches!(*s, State::Gone(_)) {
            *s = match t {
                Transition::Pause => State::Paused,
                Transition::Resume => State::Live,
            };
        }
    }

    /// Ends the sandbox for `reason`. Returns `true` for the call that ended it; later calls
    /// change nothing (the first reason sticks) and return `false`.
    pub fn end(&self, reason: impl Into<String>) -> bool {
        let mut s = self.lock();
        if matches!(*s, State::Gone(_)) {
            return false;
        }
        *s = State::Gone(reason.into());
        true
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

    #[test]
    fn a_new_sandbox_is_live_and_runs_commands() {
        let l = Lifecycle::new("sb-1");
        assert_eq!(l.state(), State::Live);
        l.check_running().unwrap();
        l.check_not_gone().unwrap();
        assert!(!l.is_gone() && !l.is_paused() && l.gone_reason().is_none());
    }

    #[test]
    fn live_to_paused_refuses_commands_but_exists() {
        let l = Lifecycle::new("sb-1");
        assert!(l.begin(Transition::Pause).unwrap());
        // Until the backend's work is done, it is still live.
        l.check_running().unwrap();
        l.complete(Transition::Pause);
        assert_eq!(l.state(), State::Paused);
        match l.check_running() {
            Err(e @ Error::SandboxPaused { .. }) => {
                assert!(e.to_string().contains("paused"), "{e}")
            }
            other => panic!("expected SandboxPaused, got {other:?}"),
        }
        l.check_not_gone().unwrap();
    }

    #[test]
    fn pause_while_paused_and_resume_while_live_are_no_ops() {
        let l = Lifecycle::new("sb-1");
        assert!(!l.begin(Transition::Resume).unwrap());
        assert!(l.begin(Transition::Pause).unwrap());
        l.complete(Transition::Pause);
        assert!(!l.begin(Transition::Pause).unwrap());
        assert_eq!(l.state(), State::Paused);
    }

    #[test]
    fn paused_to_live_runs_commands_again() {
        let l = Lifecycle::new("sb-1");
        l.complete(Transition::Pause);
        assert!(l.begin(Transition::Resume).unwrap());
        l.complete(Transition::Resume);
        assert_eq!(l.state(), State::Live);
        l.check_running().unwrap();
    }

    #[test]
    fn live_to_gone_keeps_the_first_reason() {
        let l = Lifecycle::new("sb-1");
        assert!(l.end("lifetime limit reached"));
        assert!(!l.end("destroyed"), "ending twice is a no-op");
        assert_eq!(l.state(), State::Gone("lifetime limit reached".into()));
        assert_eq!(gone_reason(l.check_running()), "lifetime limit reached");
        assert_eq!(gone_reason(l.check_not_gone()), "lifetime limit reached");
        assert_eq!(
            gone_reason(l.begin(Transition::Pause)),
            "lifetime limit reached"
        );
        assert_eq!(
            gone_reason(l.begin(Transition::Resume)),
            "lifetime limit reached"
        );
        assert_eq!(
            gone_reason::<()>(Err(l.gone_error())),
            "lifetime limit reached"
        );
    }

    #[test]
    fn paused_to_gone() {
        let l = Lifecycle::new("sb-1");
        l.complete(Transition::Pause);
        assert!(l.end("destroyed"));
        assert_eq!(gone_reason(l.check_running()), "destroyed");
    }

    #[test]
    fn a_transition_finishing_after_the_end_does_not_revive() {
        let l = Lifecycle::new("sb-1");
        assert!(l.begin(Transition::Pause).unwrap());
        l.end("its init exited");
        l.complete(Transition::Pause);
        assert!(l.is_gone());
        l.complete(Transition::Resume);
        assert_eq!(l.gone_reason().as_deref(), Some("its init exited"));
    }

    #[test]
    fn gone_error_without_a_recorded_end_says_destroyed() {
        let l = Lifecycle::new("sb-1");
        assert_eq!(gone_reason::<()>(Err(l.gone_error())), "destroyed");
    }
}
