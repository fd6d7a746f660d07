//! One sandbox's cgroup ([`SandboxCgroup`]): the files its init joins through, the event
//! counters every exec reads, freezing, and removal (or, on v1, keeping for the next one).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{kill_procs, v1, v2, CgroupVersion};

/// One sandbox's cgroup directories.
#[derive(Debug)]
pub(crate) struct SandboxCgroup {
    pub version: CgroupVersion,
    /// (controller or "unified", directory).
    pub(super) dirs: Vec<(String, PathBuf)>,
    /// Where [`SandboxCgroup::release`] may give the directories back (v1).
    pub(super) recycle: Option<&'static v1::Recycled>,
}

impl SandboxCgroup {
    /// The directory of controller `ctrl` (`"unified"` on v2).
    fn dir(&self, ctrl: &str) -> Option<&PathBuf> {
        self.dirs.iter().find(|(c, _)| c == ctrl).map(|(_, p)| p)
    }

    /// The directories, for bookkeeping.
    pub fn dirs(&self) -> impl Iterator<Item = &PathBuf> {
        self.dirs.iter().map(|(_, d)| d)
    }

    /// The files the (single-threaded) init writes `0` to in order to join the sandbox's
    /// cgroups itself (v1: `tasks`, v2: `cgroup.procs`). We open them, so our credentials
    /// authorize the write (cgroup checks the opener's).
    pub fn join_files(&self) -> Vec<PathBuf> {
        let f = match self.version {
            CgroupVersion::V1 => "tasks",
            CgroupVersion::V2 => "cgroup.procs",
        };
        self.dirs.iter().map(|(_, d)| d.join(f)).collect()
    }

    /// The OOM-kill and `pids.max` counters as a command starts, with their files kept
    /// open for that command only (see [`LimitCounters`]).
    pub fn limit_counters(&self) -> LimitCounters {
        let (oom, pids) = self.event_files();
        let files = [oom, pids].map(|p| p.and_then(|p| fs::File::open(p).ok()));
        let before = [read_key(&files[0], OOM_KEY), read_key(&files[1], PIDS_KEY)];
        LimitCounters { files, before }
    }

    /// Paths of the OOM-kill and `pids.max` event files.
    fn event_files(&self) -> (Option<PathBuf>, Option<PathBuf>) {
        match self.version {
            CgroupVersion::V1 => (
                self.dir("memory").map(|d| d.join("memory.oom_control")),
                self.dir("pids").map(|d| d.join("pids.events")),
            ),
            CgroupVersion::V2 => (
                self.dir("unified").map(|d| d.join("memory.events")),
                self.dir("unified").map(|d| d.join("pids.events")),
            ),
        }
    }

    /// Memory charged to the sandbox now, bytes (v1 `memory.usage_in_bytes`, v2
    /// `memory.current`); `None` without a memory controller.
    pub fn memory_bytes(&self) -> Option<u64> {
        let f = match self.version {
            CgroupVersion::V1 => self.dir("memory")?.join("memory.usage_in_bytes"),
            CgroupVersion::V2 => self.dir("unified")?.join("memory.current"),
        };
        fs::read_to_string(f).ok()?.trim().parse().ok()
    }

    /// CPU time the sandbox's processes have used, microseconds: v2's `cpu.stat`
    /// `usage_usec`; on v1 (where this backend does not join `cpuacct`), the sum over the
    /// processes in it now of their own and their reaped children's times
    /// (`/proc/PID/stat` fields 14 to 17): every process ever in it is counted once, by
    /// itself while it runs and by its reaper after (the sandbox's init reaps orphans).
    pub fn cpu_time_us(&self) -> Option<u64> {
        match self.version {
            CgroupVersion::V2 => {
                let stat = fs::read_to_string(self.dir("unified")?.join("cpu.stat")).ok()?;
                stat.lines()
                    .find_map(|l| l.strip_prefix("usage_usec "))
                    .and_then(|v| v.trim().parse().ok())
            }
            CgroupVersion::V1 => {
                let procs = fs::read_to_string(self.dir("memory")?.join("cgroup.procs")).ok()?;
                // SAFETY: sysconf(3) with a valid name has no preconditions.
                let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
                let hz = u64::try_from(hz).ok().filter(|h| *h > 0)?;
                let ticks: u64 = procs
                    .split_whitespace()
                    .filter_map(|pid| fs::read_to_string(format!("/proc/{pid}/stat")).ok())
                    .map(|stat| proc_ticks(&stat))
                    .sum();
                Some(ticks.saturating_mul(1_000_000) / hz)
            }
        }
    }

    /// Whether pause/resume works (v1 freezer or v2 `cgroup.freeze`).
    pub fn can_freeze(&self) -> bool {
        match self.version {
            CgroupVersion::V1 => self.dir("freezer").is_some(),
            CgroupVersion::V2 => self
                .dir("unified")
                .is_some_and(|d| d.join("cgroup.freeze").exists()),
        }
    }

    /// Freezes (or thaws) every process of the sandbox and waits until it is done.
    pub fn freeze(&self, frozen: bool) -> io::Result<()> {
        let unsupported = || io::Error::from(io::ErrorKind::Unsupported);
        match self.version {
            CgroupVersion::V1 => v1::freeze(self.dir("freezer").ok_or_else(unsupported)?, frozen),
            CgroupVersion::V2 => v2::freeze(self.dir("unified").ok_or_else(unsupported)?, frozen),
        }
    }

    /// At destroy, once the sandbox's processes are gone: gives the directories back for
    /// the next sandbox (see [`v1::Recycled`]) when they are v1, empty (no process, no child
    /// cgroup), thawed, with at most [`v1::RECYCLE_MAX_CHARGE`] of memory still charged, and
    /// fewer than [`v1::RECYCLE_MAX`] sets are kept; else removes them ([`Self::remove`]).
    /// Returns the directories that could not be removed.
    pub fn release(&self, patience: Duration) -> Vec<PathBuf> {
        match self.recycle {
            Some(pool) if v1::reusable(self) => v1::keep(self, pool, patience),
            _ => self.remove(patience),
        }
    }

    /// Removes the sandbox's directories (leaves first), retrying while they drain.
    /// Returns the directories that could not be removed.
    pub fn remove(&self, patience: Duration) -> Vec<PathBuf> {
        let deadline = Instant::now() + patience;
        let mut left = Vec::new();
        for (_, dir) in &self.dirs {
            if let Ok(rd) = fs::read_dir(dir) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        if let Err(p) = rmdir_patiently(&e.path(), deadline) {
                            left.push(p);
                        }
                    }
                }
            }
            if let Err(p) = rmdir_patiently(dir, deadline) {
                left.push(p);
            }
        }
        left
    }
}

/// The key of OOM kills in `memory.oom_control` (v1) and `memory.events` (v2).
const OOM_KEY: &str = "oom_kill";
/// The key of forks refused on `pids.max` in `pids.events`.
const PIDS_KEY: &str = "max";

/// A sandbox's limit counters (OOM kills, forks refused on `pids.max`) as one command
/// started, and their files held open until it ends, so its failure can be blamed on a
/// limit it hit. Opened per command, not per sandbox: an idle sandbox holds no descriptor
/// for them (a host's open-files limit is what stops density first), and the two opens
/// (~13 µs each here beyond a `pread`) run while the command's supervisor spawns it.
#[derive(Debug)]
pub(crate) struct LimitCounters {
    files: [Option<fs::File>; 2],
    before: [u64; 2],
}

impl LimitCounters {
    /// Counters that never report a hit (a sandbox without cgroups).
    pub fn none() -> LimitCounters {
        LimitCounters {
            files: [None, None],
            before: [0, 0],
        }
    }

    /// Whether the sandbox had an OOM kill, and a fork refused on `pids.max`, since the
    /// counters were taken.
    pub fn hit(&self) -> (bool, bool) {
        (
            read_key(&self.files[0], OOM_KEY) > self.before[0],
            read_key(&self.files[1], PIDS_KEY) > self.before[1],
        )
    }
}

/// [`read_key_at`] of an event file that may be missing (0 then).
fn read_key(f: &Option<fs::File>, key: &str) -> u64 {
    f.as_ref().map_or(0, |f| read_key_at(f, key))
}

/// `utime + stime + cutime + cstime` of a `/proc/PID/stat` line, in clock ticks (0 if it
/// cannot be read). The command name (field 2) may hold spaces and parentheses: the fields
/// are counted from its last `)`.
fn proc_ticks(stat: &str) -> u64 {
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    // `rest` starts at field 3 (state): fields 14..=17 are its 12th to 15th.
    rest.split_whitespace()
        .skip(11)
        .take(4)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum()
}

/// Removes `dir`, killing what is still in it, until `deadline`; `Err` names it if it
/// stayed.
fn rmdir_patiently(dir: &Path, deadline: Instant) -> Result<(), PathBuf> {
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(_) if Instant::now() < deadline => {
                // Tasks still leaving: kill stragglers, then retry.
                kill_procs(dir);
                std::thread::sleep(Duration::from_micros(500));
            }
            Err(_) => return Err(dir.to_path_buf()),
        }
    }
}

/// The value of `key` in a flat-keyed cgroup file (`key value` lines), 0 if absent.
fn parse_key(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok()).flatten()
        })
        .unwrap_or(0)
}

/// [`parse_key`] of an open cgroup file, read from its start.
fn read_key_at(f: &fs::File, key: &str) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 512];
    let n = f.read_at(&mut buf, 0).unwrap_or(0);
    std::str::from_utf8(&buf[..n]).map_or(0, |t| parse_key(t, key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_times_are_read_after_the_command_name() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
        // utime stime cutime cstime ...
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 10 0 0 0 7 3 20 5 20 0 1 0 100";
        assert_eq!(proc_ticks(stat), 35);
        assert_eq!(proc_ticks("garbage"), 0);
    }

    #[test]
    fn read_key_parses_flat_keyed_files() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        fs::write(&p, "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n").unwrap();
        let f = fs::File::open(&p).unwrap();
        assert_eq!(read_key_at(&f, "oom_kill"), 3);
        assert_eq!(read_key_at(&f, "missing"), 0);
        // Read again from the start, not from where the last read stopped.
        assert_eq!(read_key_at(&f, "oom_kill"), 3);
    }
}
