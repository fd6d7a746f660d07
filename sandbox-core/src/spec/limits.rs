//! Resource limits ([`Limits`]) and the caps of memory-backed mounts derived from them
//! ([`TmpfsCaps`]).

use super::*;

/// Resource limits. Every field has a safe default; `None` where a limit can be absent means
/// "the backend's own cap", never "unlimited host resources".
///
/// Which of them a tier enforces is listed in [`Capabilities::limits`](crate::Capabilities);
/// set them through [`SpecBuilder`]'s setters (one per limit) or by assignment on
/// [`Limits::default`]. `#[non_exhaustive]`: later versions add limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Limits {
    /// Memory for the whole sandbox, bytes.
    pub memory_bytes: u64,
    /// CPU time per exec, milliseconds.
    pub cpu_time_ms: u64,
    /// Wall time per exec, milliseconds (a call's own timeout may lower it).
    pub wall_time_ms: u64,
    /// Wall time for the sandbox's whole life, milliseconds; then it is destroyed.
    pub lifetime_ms: u64,
    /// Processes/threads at once.
    pub pids: u32,
    /// Captured output per stream per exec, bytes; the rest is dropped and `truncated` set.
    pub output_bytes: u64,
    /// Writable disk (workspace + temp), bytes. A tier whose disk is memory (tmpfs in the
    /// container tier) may hold it to a part of `memory_bytes`, so that files cannot fill the
    /// memory limit; its docs say how.
    pub disk_bytes: u64,
    /// Open file descriptors per process.
    pub open_files: u32,
    /// Optional instruction budget (wasm fuel) per exec.
    pub fuel: Option<u64>,
    /// CPU share as a scheduler quota, in thousandths of a CPU (500 = half a CPU).
    pub cpu_millis: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_bytes: 512 << 20,
            cpu_time_ms: 60_000,
            wall_time_ms: 30_000,
            lifetime_ms: 3_600_000,
            pids: 256,
            output_bytes: 1 << 20,
            disk_bytes: 1 << 30,
            open_files: 256,
            fuel: None,
            cpu_millis: 1000,
        }
    }
}

/// Size and inode caps of one memory-backed (tmpfs) mount; see [`Limits::tmpfs_caps`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TmpfsCap {
    /// Data, bytes (tmpfs `size=`).
    pub bytes: u64,
    /// Files and directories (tmpfs `nr_inodes=`).
    pub inodes: u64,
}

/// Caps of a sandbox's memory-backed mounts; see [`Limits::tmpfs_caps`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TmpfsCaps {
    /// Each scratch mount (`/tmp`, `/dev/shm`).
    pub scratch: TmpfsCap,
    /// Each disk mount (the workspace, an overlay's upper layer).
    pub disk: TmpfsCap,
}

impl Limits {
    /// Kernel memory one tmpfs file costs, inode and dentry together (measured: 100,000
    /// empty files in a container sandbox's workspace raised its memory cgroup's usage by
    /// 91 MiB).
    pub const TMPFS_INODE_BYTES: u64 = 1024;

    /// Caps for a sandbox's memory-backed mounts: `scratch` mounts like `/tmp` (each asking
    /// a quarter of [`disk_bytes`](Self::disk_bytes)) and `disk` mounts like a tmpfs
    /// workspace (each asking `disk_bytes`).
    ///
    /// Files there are charged to the sandbox's memory limit, pages and inodes alike, and
    /// nothing can reclaim them (there is no swap to push them to). Sized by `disk_bytes`
    /// alone, they could fill the limit, and every later command, then the sandbox's own
    /// processes, would meet the OOM killer: the sandbox would be lost with its files.
    /// Together the mounts therefore hold at most **5/8 of [`memory_bytes`](Self::memory_bytes)
    /// in data and one inode per 8 KiB of it** (≈ 1/8 of the limit at
    /// [`TMPFS_INODE_BYTES`](Self::TMPFS_INODE_BYTES) each), which always leaves processes a
    /// quarter of the limit; a full mount fails writes with `ENOSPC`. Each scratch mount gets
    /// up to an eighth of the data and of the inodes; the disk mounts share the rest, each at
    /// most `disk_bytes`. Every mount keeps at least 1 MiB and 256 inodes.
    pub fn tmpfs_caps(&self, scratch: u64, disk: u64) -> TmpfsCaps {
        const MIN_BYTES: u64 = 1 << 20;
        const MIN_INODES: u64 = 256;
        let data = self.memory_bytes / 8 * 5;
        let inodes = self.memory_bytes / (8 * Self::TMPFS_INODE_BYTES);
        let small = TmpfsCap {
            bytes: (self.disk_bytes / 4).min(data / 8).max(MIN_BYTES),
            inodes: (inodes / 8).max(MIN_INODES),
        };
        let share = |total: u64, taken: u64| total.saturating_sub(scratch * taken) / disk.max(1);
        TmpfsCaps {
            scratch: small,
            disk: TmpfsCap {
                bytes: share(data, small.bytes).min(self.disk_bytes).max(MIN_BYTES),
                inodes: share(inodes, small.inodes).max(MIN_INODES),
            },
        }
    }

    /// The per-exec wall limit as a duration.
    pub fn wall_time(&self) -> Duration {
        Duration::from_millis(self.wall_time_ms)
    }

    /// The sandbox lifetime as a duration.
    pub fn lifetime(&self) -> Duration {
        Duration::from_millis(self.lifetime_ms)
    }

    /// Checks that every limit is possible.
    pub fn validate(&self) -> Result<()> {
        let check = |ok: bool, field: &str, why: &str| {
            if ok {
                Ok(())
            } else {
                Err(Error::invalid(format!("limits.{field}"), why))
            }
        };
        check(
            self.memory_bytes >= 4 << 20,
            "memory_bytes",
            "must be at least 4 MiB",
        )?;
        check(
            self.memory_bytes <= 1 << 40,
            "memory_bytes",
            "must be at most 1 TiB",
        )?;
        check(self.cpu_time_ms > 0, "cpu_time_ms", "must be positive")?;
        check(self.wall_time_ms > 0, "wall_time_ms", "must be positive")?;
        check(
            self.lifetime_ms >= self.wall_time_ms,
            "lifetime_ms",
            "must be at least wall_time_ms",
        )?;
        check(self.pids >= 1, "pids", "must be at least 1")?;
        check(self.output_bytes >= 1, "output_bytes", "must be at least 1")?;
        check(self.open_files >= 16, "open_files", "must be at least 16")?;
        check(
            (10..=1_024_000).contains(&self.cpu_millis),
            "cpu_millis",
            "must be between 10 (1% of a CPU) and 1024000",
        )?;
        check(self.fuel != Some(0), "fuel", "must be positive when set")?;
        Ok(())
    }
}
