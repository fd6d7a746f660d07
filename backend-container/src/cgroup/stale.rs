//! What processes that died without destroying their sandboxes left in the cgroup
//! hierarchies, and its removal ([`CgroupHost::sweep_orphans`](super::CgroupHost::sweep_orphans)).
//!
//! A sandbox's cgroup is named `asb-<owner pid>-<id>` after the process that made it. Whether
//! that sandbox is abandoned is judged **by its owner**, never by whether its processes still
//! run: a sandbox that was paused (a client's `pause`, an idle server's `on_idle: pause`) or
//! frozen for a snapshot when its owner died keeps its processes forever. A frozen task acts
//! on no signal, the parent-death signal its owner's death sends included, until it is
//! thawed; it sits in `D` state, its cgroups and its namespace's mounts with it.
//!
//! The owner is gone when no process has its pid any more (or only a zombie), or when the
//! process that has it now started after one of the cgroup's own processes did: an owner
//! starts before everything it makes, so that is a reused pid. Start times are the kernel's
//! (`/proc/<pid>/stat`, clock ticks since boot), so no wall clock is involved. Then
//! ([`tear_down`]): every process of the cgroup is sent `SIGKILL` while it is still frozen
//! (so it runs no instruction of its own again), the cgroup is thawed (v1
//! `freezer.state` = `THAWED`, v2 `cgroup.freeze` = 0), whatever is left is killed, and the
//! directories go. A sandbox's other resources die with its processes: its namespaces (and
//! the mounts in them), its egress link (whose other end is in its dead owner's egress
//! namespace) and its uid-range lease (a lock the kernel released with the owner).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use sandbox_core::sandbox::StaleCleanup;

use super::delegation::SELF_LEAF_PREFIX;
use super::{kill_procs, v1, v2};

/// The owner pid a sandbox cgroup's name gives (`asb-<pid>-<rest>`).
pub(crate) fn owner_of(name: &str) -> Option<u32> {
    name.strip_prefix("asb-")
        .and_then(|r| r.split_once('-'))
        .and_then(|(p, _)| p.parse::<u32>().ok())
}

/// The state (`R`, `S`, `D`, `Z`...) and start time (clock ticks after boot) of process
/// `pid`, from `/proc/<pid>/stat`; `None` when there is no such process.
pub(crate) fn proc_start(pid: u32) -> Option<(char, u64)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields are counted after
    // its last `)`; the state is field 3, the start time field 22.
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// The pids listed in `cgroup.procs` of `dir` and of its child cgroups.
fn members(dir: &Path) -> Vec<u32> {
    let read = |d: &Path| -> Vec<u32> {
        fs::read_to_string(d.join("cgroup.procs"))
            .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    };
    let mut pids = read(dir);
    for sub in subdirs(dir) {
        pids.extend(read(&sub));
    }
    pids
}

/// The child cgroups of `dir`.
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `owner`, the process a sandbox's cgroups (`dirs`) are named after, is gone (see
/// the module's docs): not this process, and no live process has its pid, or the one that
/// has it started after a process of the sandbox did (a reused pid). A cgroup without
/// processes cannot tell a reused pid from its owner: it stays while the pid is taken.
pub(crate) fn owner_gone(owner: u32, dirs: &[PathBuf]) -> bool {
    if owner == std::process::id() {
        return false;
    }
    let started = match proc_start(owner) {
        None | Some(('Z' | 'X', _)) => return true,
        Some((_, t)) => t,
    };
    // Every hierarchy's directory holds the same processes: the first one with any will do.
    dirs.iter()
        .map(|d| members(d))
        .find(|m| !m.is_empty())
        .unwrap_or_default()
        .into_iter()
        .filter_map(proc_start)
        .any(|(_, t)| t < started)
}

/// Whether cgroup `dir` of hierarchy `ctrl` (a v1 controller, or `"unified"`) is frozen or
/// freezing.
fn frozen(ctrl: &str, dir: &Path) -> bool {
    match ctrl {
        "freezer" => {
            fs::read_to_string(dir.join("freezer.state")).is_ok_and(|s| s.trim() != "THAWED")
        }
        "unified" => fs::read_to_string(dir.join("cgroup.freeze")).is_ok_and(|s| s.trim() == "1"),
        _ => false,
    }
}

/// Thaws cgroup `dir` of hierarchy `ctrl` and its children, where frozen. Returns whether
/// any was.
fn thaw(ctrl: &str, dir: &Path) -> bool {
    let mut was = false;
    for d in std::iter::once(dir.to_path_buf()).chain(subdirs(dir)) {
        if !frozen(ctrl, &d) {
            continue;
        }
        was = true;
        let r = match ctrl {
            "freezer" => v1::freeze(&d, false),
            _ => v2::freeze(&d, false),
        };
        if let Err(e) = r {
            tracing::warn!(cgroup = %d.display(), error = %e, "could not thaw a leftover sandbox cgroup");
        }
    }
    was
}

/// Sends `SIGKILL` to every process of `dir` and of its child cgroups, once, without waiting
/// (on v2, `cgroup.kill` too).
fn signal_all(dir: &Path) {
    for d in std::iter::once(dir.to_path_buf()).chain(subdirs(dir)) {
        if let Ok(mut f) = fs::OpenOptions::new()
            .write(true)
            .open(d.join("cgroup.kill"))
        {
            use std::io::Write;
            let _ = f.write_all(b"1");
        }
    }
    for p in members(dir) {
        let Ok(p) = i32::try_from(p) else { continue };
        // SAFETY: kill(2) with a pid just read from the cgroup of an abandoned sandbox; a
        // process that exited since is at worst ESRCH (pids are not reused that fast).
        unsafe {
            libc::kill(p, libc::SIGKILL);
        }
    }
}

/// Tears down one abandoned sandbox's cgroups, `(hierarchy, directory)` each: kills its
/// processes while they are frozen (the kill waits for the thaw), thaws them, kills what is
/// left and removes the directories (children first). Returns how many directories were
/// removed and whether any was frozen.
pub(crate) fn tear_down(dirs: &[(String, PathBuf)]) -> (usize, bool) {
    for (_, d) in dirs {
        signal_all(d);
    }
    let mut thawed = false;
    for (ctrl, d) in dirs {
        thawed |= thaw(ctrl, d);
    }
    let mut removed = 0;
    for (_, d) in dirs {
        for s in subdirs(d) {
            kill_procs(&s);
            let _ = fs::remove_dir(&s);
        }
        kill_procs(d);
        if fs::remove_dir(d).is_ok() {
            removed += 1;
        }
    }
    (removed, thawed)
}

/// The sweep of [`CgroupHost::sweep_orphans`](super::CgroupHost::sweep_orphans) over the
/// caller's cgroup directories `hierarchies` (`(controller or "unified", directory)`):
/// every `asb-<pid>-*` cgroup whose owner is gone is torn down, and a dead process's own v2
/// leaf (`asb-self-<pid>`, see [`super::delegation`]) is removed once empty. Counts removed
/// directories; names the sandbox cgroups that were frozen.
pub(super) fn sweep<'a>(
    hierarchies: impl IntoIterator<Item = (&'a str, &'a Path)>,
) -> StaleCleanup {
    let mut out = StaleCleanup::default();
    // Sandbox cgroup name -> its directory in each hierarchy.
    let mut found: BTreeMap<String, Vec<(String, PathBuf)>> = BTreeMap::new();
    for (ctrl, parent) in hierarchies {
        let Ok(rd) = fs::read_dir(parent) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // A dead process's own leaf (v2): what is left in it are that process's other
            // children, not sandboxes; removed once empty.
            if let Some(pid) = name
                .strip_prefix(SELF_LEAF_PREFIX)
                .and_then(|p| p.parse::<u32>().ok())
            {
                let dead =
                    pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists();
                if dead && fs::remove_dir(e.path()).is_ok() {
                    out.removed += 1;
                }
                continue;
            }
            if owner_of(&name).is_some() {
                found
                    .entry(name)
                    .or_default()
                    .push((ctrl.to_string(), e.path()));
            }
        }
    }
    for (name, dirs) in found {
        let Some(owner) = owner_of(&name) else {
            continue;
        };
        let paths: Vec<PathBuf> = dirs.iter().map(|(_, d)| d.clone()).collect();
        if !owner_gone(owner, &paths) {
            continue;
        }
        let (removed, thawed) = tear_down(&dirs);
        if thawed {
            tracing::info!(cgroup = %name, "thawed and removed a sandbox that was frozen when its process died");
            out.thawed.push(name);
        }
        out.removed += removed;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_give_their_owner() {
        assert_eq!(owner_of("asb-4242-0123abcd"), Some(4242));
        assert_eq!(owner_of("asb-4242-free-3"), Some(4242));
        assert_eq!(owner_of("asb-self-4242"), None);
        assert_eq!(owner_of("asb-4242"), None);
        assert_eq!(owner_of("runsc-4242-x"), None);
    }

    #[test]
    fn proc_start_reads_state_and_start_time() {
        let (state, start) = proc_start(std::process::id()).unwrap();
        assert!("RSD".contains(state), "{state}");
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let (_, child_start) = proc_start(child.id()).unwrap();
        assert!(child_start >= start);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(proc_start(child.id()), None);
    }

    #[test]
    fn an_owner_is_gone_when_dead_or_younger_than_its_sandbox() {
        let d = tempfile::tempdir().unwrap();
        // A sandbox cgroup (a plain directory stands in) holding `member`.
        let mut member = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        fs::write(d.path().join("cgroup.procs"), format!("{}\n", member.id())).unwrap();
        let dirs = [d.path().to_path_buf()];
        // We are older than the member: a live owner.
        assert!(!owner_gone(std::process::id(), &dirs));
        // Our parent too (a process that started before the member).
        let parent = std::os::unix::process::parent_id();
        assert!(!owner_gone(parent, &dirs));
        // A process that started after the member cannot have made it: its pid was reused.
        // (Start times have clock-tick resolution: wait until one has passed.)
        let (_, member_start) = proc_start(member.id()).unwrap();
        let mut younger = loop {
            let c = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            if proc_start(c.id()).unwrap().1 > member_start {
                break c;
            }
            let mut c = c;
            c.kill().unwrap();
            c.wait().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert!(owner_gone(younger.id(), &dirs));
        // A dead owner, and a zombie one.
        younger.kill().unwrap();
        let zombie = younger.id();
        while proc_start(zombie).is_some_and(|(s, _)| s != 'Z') {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert!(owner_gone(zombie, &dirs));
        younger.wait().unwrap();
        assert!(owner_gone(zombie, &dirs));
        // Without members nothing tells a reused pid: a live pid keeps its cgroups.
        let empty = tempfile::tempdir().unwrap();
        assert!(!owner_gone(parent, &[empty.path().to_path_buf()]));
        member.kill().unwrap();
        member.wait().unwrap();
    }

    /// The real v1 hierarchies of this process (as root, where the freezer is mounted):
    /// `(controller, our cgroup directory)`.
    fn v1_with_freezer() -> Option<Vec<(String, PathBuf)>> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: needs root");
            return None;
        }
        let host = super::super::CgroupHost::detect();
        let v1 = host.v1().to_vec();
        if !v1.iter().any(|(c, _)| c == "freezer") {
            eprintln!("SKIP: no v1 freezer hierarchy here");
            return None;
        }
        Some(v1)
    }

    #[test]
    fn a_frozen_v1_sandbox_of_a_dead_owner_is_thawed_killed_and_removed() {
        let Some(v1) = v1_with_freezer() else {
            return;
        };
        // The owner: alive (and older than the sandbox's process) until just before the
        // sweep, so that no other sweeper on this host takes the sandbox first.
        let mut owner = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        let name = format!("asb-{}-stale-test", owner.id());
        let dirs: Vec<(String, PathBuf)> =
            v1.iter().map(|(c, p)| (c.clone(), p.join(&name))).collect();
        for (_, d) in &dirs {
            fs::create_dir(d).unwrap();
        }
        let mut child = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        for (_, d) in &dirs {
            fs::write(d.join("cgroup.procs"), child.id().to_string()).unwrap();
        }
        let freezer = &dirs.iter().find(|(c, _)| c == "freezer").unwrap().1;
        v1::freeze(freezer, true).unwrap();
        // What the old sweep did: a frozen process ignores SIGKILL until it thaws.
        assert!(!kill_procs(freezer), "a frozen process died");
        owner.kill().unwrap();
        owner.wait().unwrap();
        let hierarchies: Vec<(&str, &Path)> =
            v1.iter().map(|(c, p)| (c.as_str(), p.as_path())).collect();
        let swept = sweep(hierarchies);
        assert!(swept.thawed.contains(&name), "{swept:?}");
        assert!(swept.removed >= dirs.len(), "{swept:?}");
        for (_, d) in &dirs {
            assert!(!d.exists(), "{} left", d.display());
        }
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn a_frozen_v1_sandbox_of_a_live_owner_is_left_alone() {
        let Some(v1) = v1_with_freezer() else {
            return;
        };
        // We are its owner's pid's holder and older than its process: live.
        let parent = std::os::unix::process::parent_id();
        let name = format!("asb-{parent}-stale-live-{}", std::process::id());
        let freezer = v1
            .iter()
            .find(|(c, _)| c == "freezer")
            .unwrap()
            .1
            .join(&name);
        fs::create_dir(&freezer).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        fs::write(freezer.join("cgroup.procs"), child.id().to_string()).unwrap();
        v1::freeze(&freezer, true).unwrap();
        let swept = sweep([("freezer", freezer.parent().unwrap())]);
        assert!(!swept.thawed.contains(&name), "{swept:?}");
        assert!(freezer.exists());
        assert_eq!(
            fs::read_to_string(freezer.join("freezer.state"))
                .unwrap()
                .trim(),
            "FROZEN"
        );
        // Cleaned up by hand.
        child.kill().unwrap();
        v1::freeze(&freezer, false).unwrap();
        child.wait().unwrap();
        fs::remove_dir(&freezer).unwrap();
    }
}
