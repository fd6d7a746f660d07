//! The phase timeline of a create, restore or exec.

use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// One phase of bringing code to its first result. `#[non_exhaustive]`: later versions add
/// phases (an image pull, for example).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Phase {
    /// The sandbox's image found in the cache, or pulled and unpacked into it.
    Image,
    /// Resources reserved: process, VM, instance, cgroup.
    Allocation,
    /// Root filesystem and workspace ready.
    Filesystem,
    /// Language runtime / init / guest agent ready.
    Runtime,
    /// Dependencies (stdlib, packages, preloaded modules) ready.
    Dependencies,
    /// Network policy in place.
    Network,
    /// The first command ran to completion.
    FirstCommand,
    /// A later command ran to completion.
    Command,
    /// A snapshot was loaded.
    Restore,
    /// Waiting to run: the backend admits a bounded number of guests at once and this call
    /// (or create) waited for a slot, and for the sandbox's own earlier call. Limits on the
    /// command (its wall time, CPU, fuel) start after this phase.
    Queue,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Phase::Image => "image",
            Phase::Allocation => "allocation",
            Phase::Filesystem => "filesystem",
            Phase::Runtime => "runtime",
            Phase::Dependencies => "dependencies",
            Phase::Network => "network",
            Phase::FirstCommand => "first-command",
            Phase::Command => "command",
            Phase::Restore => "restore",
            Phase::Queue => "queue",
        };
        f.write_str(s)
    }
}

/// How long one phase took.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PhaseTiming {
    /// The phase.
    pub phase: Phase,
    /// Its duration in microseconds.
    pub micros: u64,
}

impl PhaseTiming {
    /// `phase` took `micros` microseconds.
    pub fn new(phase: Phase, micros: u64) -> Self {
        PhaseTiming { phase, micros }
    }
}

/// The phases recorded so far, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Timeline {
    /// Recorded phases.
    pub phases: Vec<PhaseTiming>,
}

impl Timeline {
    /// Sum of all phases.
    pub fn total(&self) -> Duration {
        Duration::from_micros(self.phases.iter().map(|p| p.micros).sum())
    }

    /// The duration of `phase`, if recorded.
    pub fn get(&self, phase: Phase) -> Option<Duration> {
        self.phases
            .iter()
            .find(|p| p.phase == phase)
            .map(|p| Duration::from_micros(p.micros))
    }

    /// Appends another timeline's phases (e.g. create's phases before the first exec's).
    pub fn extend(&mut self, other: &Timeline) {
        self.phases.extend_from_slice(&other.phases);
    }

    /// This timeline (a sandbox's creation) followed by its first command's, `command`: a
    /// wait for admission stays its own [`Phase::Queue`], the rest is
    /// [`Phase::FirstCommand`]. The timeline of a one-shot run.
    pub fn then_first_command(mut self, command: &Timeline) -> Timeline {
        let queued = command.get(Phase::Queue).unwrap_or_default();
        if !queued.is_zero() {
            self.phases.push(PhaseTiming {
                phase: Phase::Queue,
                micros: micros(queued),
            });
        }
        self.phases.push(PhaseTiming {
            phase: Phase::FirstCommand,
            micros: micros(command.total().saturating_sub(queued)),
        });
        self
    }
}

/// `d` in whole microseconds (saturating).
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Records phases as they finish: each `mark` measures from the previous mark.
#[derive(Debug)]
pub struct TimelineRecorder {
    last: Instant,
    timeline: Timeline,
}

impl Default for TimelineRecorder {
    fn default() -> Self {
        Self::start()
    }
}

impl TimelineRecorder {
    /// Starts the clock.
    pub fn start() -> Self {
        TimelineRecorder {
            last: Instant::now(),
            timeline: Timeline::default(),
        }
    }

    /// Ends `phase` now.
    pub fn mark(&mut self, phase: Phase) {
        let now = Instant::now();
        let micros = micros(now.duration_since(self.last));
        self.timeline.phases.push(PhaseTiming { phase, micros });
        self.last = now;
    }

    /// Ends `phase` at `at`, an instant observed elsewhere (e.g. reported by a helper
    /// process); clamped between the previous mark and now.
    pub fn mark_at(&mut self, phase: Phase, at: Instant) {
        let at = at.clamp(self.last, Instant::now());
        let micros = micros(at.duration_since(self.last));
        self.timeline.phases.push(PhaseTiming { phase, micros });
        self.last = at;
    }

    /// The recorded timeline.
    pub fn finish(self) -> Timeline {
        self.timeline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mark_at_is_clamped_to_the_previous_mark_and_now() {
        let mut r = TimelineRecorder::start();
        let before = Instant::now() - Duration::from_secs(5);
        r.mark_at(Phase::Allocation, before);
        r.mark_at(Phase::Command, Instant::now() + Duration::from_secs(3600));
        let t = r.finish();
        assert_eq!(t.get(Phase::Allocation), Some(Duration::ZERO));
        assert!(t.get(Phase::Command).unwrap() < Duration::from_secs(60));
    }

    #[test]
    fn a_first_command_keeps_its_queue_apart() {
        let phase = |phase, micros| PhaseTiming { phase, micros };
        let created = Timeline {
            phases: vec![phase(Phase::Allocation, 100)],
        };
        let queued = Timeline {
            phases: vec![phase(Phase::Queue, 30), phase(Phase::Command, 70)],
        };
        assert_eq!(
            created.clone().then_first_command(&queued).phases,
            [
                phase(Phase::Allocation, 100),
                phase(Phase::Queue, 30),
                phase(Phase::FirstCommand, 70)
            ]
        );
        let direct = Timeline {
            phases: vec![phase(Phase::Command, 70)],
        };
        assert_eq!(
            created.then_first_command(&direct).phases,
            [
                phase(Phase::Allocation, 100),
                phase(Phase::FirstCommand, 70)
            ]
        );
    }

    #[test]
    fn records_in_order_and_sums() {
        let mut r = TimelineRecorder::start();
        r.mark(Phase::Allocation);
        std::thread::sleep(Duration::from_millis(2));
        r.mark(Phase::Runtime);
        let t = r.finish();
        assert_eq!(
            t.phases.iter().map(|p| p.phase).collect::<Vec<_>>(),
            [Phase::Allocation, Phase::Runtime]
        );
        assert!(t.get(Phase::Runtime).unwrap() >= Duration::from_millis(2));
        assert_eq!(
            t.total(),
            t.get(Phase::Allocation).unwrap() + t.get(Phase::Runtime).unwrap()
        );
        let j = serde_json::to_string(&t).unwrap();
        assert!(j.contains("\"phase\":\"runtime\""), "{j}");
    }
}
