//! What a sandbox uses now, from its tier's own accounting ([`Sandbox::usage`]).
//!
//! [`Sandbox::usage`]: crate::Sandbox::usage

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A sandbox's resource use at one moment. `#[non_exhaustive]`: build it with
/// [`Usage::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Usage {
    /// CPU time its processes have used since it started, all CPUs together, microseconds.
    pub cpu_time_us: u64,
    /// Memory charged to it now, bytes (its processes' memory and the page cache they
    /// caused, as its cgroup counts them).
    pub memory_bytes: u64,
}

impl Usage {
    /// `cpu_time` used so far, `memory_bytes` held now.
    pub fn new(cpu_time: Duration, memory_bytes: u64) -> Self {
        Usage {
            cpu_time_us: u64::try_from(cpu_time.as_micros()).unwrap_or(u64::MAX),
            memory_bytes,
        }
    }

    /// [`cpu_time_us`](Self::cpu_time_us) as a duration.
    pub fn cpu_time(&self) -> Duration {
        Duration::from_micros(self.cpu_time_us)
    }
}
