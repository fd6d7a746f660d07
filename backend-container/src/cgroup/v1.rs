//! cgroup v1: one directory per controller (`memory`, `pids`, `cpu`, `freezer`), their
//! limits, the freezer, and the emptied directory sets kept for the next sandboxes
//! ([`Recycled`]).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sandbox_core::Limits;

use super::{mkdir, pids_max, write, CgroupVersion, DirFd, SandboxCgroup};

/// Emptied v1 cgroups of destroyed sandboxes, kept for the next ones: one list per process,
/// whichever backend made them.
static RECYCLED: std::sync::LazyLock<Recycled> = std::sync::LazyLock::new(Recycled::default);

/// How many emptied sets of v1 cgroup directories a process keeps for reuse.
pub(super) const RECYCLE_MAX: usize = 2;
/// The most memory still charged to an emptied memory cgroup that may be reused (page cache
/// of host files a sandbox read first; kernel objects freed after a grace period).
pub(super) const RECYCLE_MAX_CHARGE: u64 = 2 << 20;

/// Emptied v1 cgroup directory sets (`asb-<pid>-free-<n>`, one directory per controller)
/// that the next sandboxes take instead of making new ones.
///
/// Why: making a v1 cgroup and removing it costs far more than its two system calls. A
/// removed cgroup is taken down by the kernel in deferred work (each controller's state
/// killed, released and freed after RCU grace periods; the memory cgroup's per-CPU charge
/// caches drained on every CPU), and that work lands on whatever runs next. Measured here
/// (2 vCPUs, after a 5 ms pause, interleaved with bubblewrap): create + first `/bin/true`
/// 3.6-3.9 ms with cgroups made and removed per sandbox, 2.25-2.7 ms without cgroups at all;
/// a pooled sandbox's first command after 12 ms idle 2.03-2.07 ms against 1.62-1.67 ms.
/// Renaming an emptied directory set costs a few µs per directory and leaves no deferred
/// work. Only v1 renames cgroup directories (cgroup2 refuses `rename`), so v2 makes and
/// removes them.
#[derive(Debug, Default)]
pub(super) struct Recycled {
    sets: std::sync::Mutex<Vec<Vec<(String, PathBuf)>>>,
    next: std::sync::atomic::AtomicU64,
}

/// Makes the v1 directories of sandbox cgroup `cg`, named `name`, one under each of the
/// caller's cgroups in `controllers`, and writes limits `l` (taking over an emptied set of
/// a destroyed sandbox when there is one: see [`Recycled`]).
pub(super) fn create(
    cg: &mut SandboxCgroup,
    controllers: &[(String, PathBuf)],
    name: &str,
    l: &Limits,
) -> io::Result<()> {
    cg.recycle = Some(&RECYCLED);
    // A set made under our cgroups (this process may have moved since).
    let set = RECYCLED.sets.lock().ok().and_then(|mut v| {
        let ours = |set: &Vec<(String, PathBuf)>| {
            set.len() == controllers.len()
                && set
                    .iter()
                    .zip(controllers)
                    .all(|((c, d), (hc, hp))| c == hc && d.parent() == Some(hp.as_path()))
        };
        let i = v.iter().rposition(ours)?;
        Some(v.swap_remove(i))
    });
    if let Some(set) = set {
        match reuse_v1(cg, set, name, l) {
            Ok(()) => return Ok(()),
            Err(_) => {
                // Whatever went wrong, a fresh set (this one goes).
                cg.remove(Duration::from_millis(200));
                cg.dirs.clear();
            }
        }
    }
    // Each write to a cgroup file is an open/write/close (~15 µs here): the files are
    // opened relative to their directory, and none is written that keeps its default
    // (a new cgroup's CFS period is the kernel's 100 ms).
    for (ctrl, parent) in controllers {
        let dir = parent.join(name);
        mkdir(&dir)?;
        cg.dirs.push((ctrl.clone(), dir.clone()));
        limit_v1(ctrl, &dir, l, false)?;
    }
    Ok(())
}

/// Removes the kept sets (see [`Recycled`]) as the process exits. Never blocks: a list
/// held by a thread still running then is left to the next backend's sweep.
extern "C" fn remove_kept_at_exit() {
    if let Ok(mut sets) = RECYCLED.sets.try_lock() {
        for set in sets.drain(..) {
            for (_, dir) in set {
                let _ = fs::remove_dir(dir);
            }
        }
    }
}

/// Writes `l` to the v1 controller `ctrl`'s directory `dir`. `reused`: the directory had
/// other limits (a recycled set), so the memory limits are raised out of the way first (v1
/// refuses a memory limit above the memory+swap one, and the reverse).
fn limit_v1(ctrl: &str, dir: &Path, l: &Limits, reused: bool) -> io::Result<()> {
    let at = || DirFd::open(dir);
    match ctrl {
        "memory" => {
            let d = at()?;
            let mem = l.memory_bytes.to_string();
            if reused {
                match d.write("memory.memsw.limit_in_bytes", "-1") {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
            d.write("memory.limit_in_bytes", &mem)?;
            match d.write("memory.memsw.limit_in_bytes", &mem) {
                Ok(()) => {}
                // No swap accounting: keep the sandbox's memory out of swap, if the host
                // has any.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if host_has_swap() {
                        let _ = d.write("memory.swappiness", "0");
                    }
                }
                Err(e) => return Err(e),
            }
        }
        "pids" => at()?.write("pids.max", &pids_max(l).to_string())?,
        "cpu" => {
            let period = 100_000u64;
            let quota = u64::from(l.cpu_millis) * period / 1000;
            at()?.write("cpu.cfs_quota_us", &quota.max(1000).to_string())?;
        }
        _ => {}
    }
    Ok(())
}

/// Takes over an emptied set (see [`Recycled`]): renames each directory to `name` and
/// writes the new limits (everything a new cgroup would have set; its counters, e.g. the
/// OOM-kill count, carry on, which is fine: execs compare them before and after).
fn reuse_v1(
    cg: &mut SandboxCgroup,
    set: Vec<(String, PathBuf)>,
    name: &str,
    l: &Limits,
) -> io::Result<()> {
    for (i, (ctrl, old)) in set.iter().enumerate() {
        let Some(parent) = old.parent() else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        let dir = parent.join(name);
        if let Err(e) = fs::rename(old, &dir) {
            // This one and the rest keep their free names: remove those too.
            cg.dirs.extend(set[i..].iter().cloned());
            return Err(e);
        }
        cg.dirs.push((ctrl.clone(), dir));
    }
    for (ctrl, dir) in &cg.dirs {
        limit_v1(ctrl, dir, l, true)?;
    }
    Ok(())
}

/// Whether the host has any swap space (`/proc/swaps` lists a device), read once.
fn host_has_swap() -> bool {
    static SWAP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SWAP.get_or_init(|| fs::read_to_string("/proc/swaps").map_or(true, |s| s.lines().count() > 1))
}

/// Freezes (or thaws) every process of the freezer cgroup `d` and waits until it is done.
pub(super) fn freeze(d: &Path, frozen: bool) -> io::Result<()> {
    let want = if frozen { "FROZEN" } else { "THAWED" };
    write(&d.join("freezer.state"), want)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = fs::read_to_string(d.join("freezer.state"))?;
        if s.trim() == want {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("freezer stuck in {}", s.trim()),
            ));
        }
        // FREEZING: ask again (the write is what retries in v1).
        let _ = write(&d.join("freezer.state"), want);
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Keeps the emptied directories of `cg` for the next sandbox (see [`Recycled`]) under
/// free names (`asb-<pid>-free-<n>`) when fewer than [`RECYCLE_MAX`] sets are kept; else
/// removes them. Returns the directories that could not be removed.
pub(super) fn keep(cg: &SandboxCgroup, pool: &Recycled, patience: Duration) -> Vec<PathBuf> {
    let mut sets = match pool.sets.lock() {
        Ok(s) => s,
        Err(_) => return cg.remove(patience),
    };
    if sets.len() >= RECYCLE_MAX {
        drop(sets);
        return cg.remove(patience);
    }
    let n = pool.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let free = format!("asb-{}-free-{n}", std::process::id());
    let mut set = Vec::new();
    for (i, (ctrl, dir)) in cg.dirs.iter().enumerate() {
        let to = dir.with_file_name(&free);
        if fs::rename(dir, &to).is_err() {
            // Remove what was renamed, and the rest where it is.
            drop(sets);
            set.extend(cg.dirs[i..].iter().cloned());
            return SandboxCgroup {
                version: cg.version,
                dirs: set,
                recycle: None,
            }
            .remove(patience);
        }
        set.push((ctrl.clone(), to));
    }
    sets.push(set);
    // Kept sets go when the process exits normally (one that is killed leaves
    // them to the next backend's sweep, like its sandboxes' cgroups).
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a plain `extern "C"` function with atexit(3).
    AT_EXIT.call_once(|| unsafe {
        libc::atexit(remove_kept_at_exit);
    });
    Vec::new()
}

/// Whether the directories of `cg` can serve another sandbox (see
/// [`SandboxCgroup::release`]).
pub(super) fn reusable(cg: &SandboxCgroup) -> bool {
    if cg.version != CgroupVersion::V1 {
        return false;
    }
    cg.dirs.iter().all(|(ctrl, dir)| {
        let empty = fs::read_to_string(dir.join("cgroup.procs")).is_ok_and(|s| s.trim().is_empty())
            && fs::read_dir(dir).is_ok_and(|rd| {
                !rd.flatten()
                    .any(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            });
        empty
            && match ctrl.as_str() {
                "memory" => fs::read_to_string(dir.join("memory.usage_in_bytes"))
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .is_some_and(|u| u <= RECYCLE_MAX_CHARGE),
                "freezer" => fs::read_to_string(dir.join("freezer.state"))
                    .is_ok_and(|s| s.trim() == "THAWED"),
                _ => true,
            }
    })
}
