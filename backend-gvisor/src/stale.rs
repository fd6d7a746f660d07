//! What a crashed process leaves behind, and its removal.
//!
//! `runsc run --detach` starts sandbox and gofer processes that outlive the process that
//! asked for them: if the embedding program dies without destroying its sandboxes (a
//! `SIGKILL`, an OOM kill, a panic with `abort`), their Sentries keep running untrusted code,
//! with their memory, their cgroups, the workspace's tmpfs mount and the state directory.
//!
//! Each sandbox directory holds an `owner` file that its creator keeps open with a shared
//! `flock` for the sandbox's whole life. The kernel drops that lock when the creator dies,
//! however it dies, and a reused pid cannot fake it. [`sweep`] takes the lock exclusively
//! (which also keeps two sweepers apart): a directory whose lock it gets has no owner left,
//! and is torn down like `destroy` would (`runsc delete --force`, then any runsc process that
//! still names the directory is killed, its cgroups removed, the workspace and scratch
//! tmpfs unmounted, the directory removed). A sandbox that was paused when its creator died
//! (a client's `pause`, an idle server's `on_idle: pause`) is resumed first: runsc
//! (20221219) kills a paused container on `delete --force` but then panics on the
//! `paused => stopped` transition (exit status 2) instead of finishing its teardown. One caught
//! in a checkpoint (a snapshot) is deleted like any other; the `runsc checkpoint` process,
//! which named the state root too, goes with the runsc processes.
//! A directory without an `owner` file is left alone while it is young (a create between
//! its `mkdir` and the file); one older than ten minutes (made by an older version, or the
//! state root a late `runsc` call made again after a teardown) is torn down too, under a
//! lock on the directory itself.
//!
//! Sweeps happen at two moments. **Right after the owner dies**: the first `create` of each
//! process (per state directory) starts a small watchdog, `/bin/sh` blocked reading a pipe
//! whose only writer is this process; when the process ends, however it ends, the read
//! returns and the watchdog tears down, with `flock` and `runsc delete --force` (for at most
//! ten seconds: from 2023 on, runsc waits with no end for a sandbox process that stays a
//! zombie, as it does under a subreaper that never reaps it; when it fails, any process still
//! naming the sandbox's state root is killed, as [`sweep`] does), every
//! directory whose lock is free (trying held ones again for five seconds: the pipe may
//! close before the dying process's lock descriptors do). It sits in a process group of its own and ignores the
//! terminal's signals, so a Ctrl-C of the program does not take it along; it needs
//! util-linux's `flock` and `umount` (both in every Debian system). **And at the next
//! start**: the same `create` sweeps the state directory in a background thread, for
//! owners whose watchdog died with them (a whole process tree or container killed).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use sandbox_core::sandbox::StaleCleanup;

use crate::reaper;

/// Name of the lock file in each sandbox directory.
const OWNER: &str = "owner";

/// The creator's hold on a sandbox directory: a shared lock on its `owner` file, released
/// when this is dropped or the process dies.
#[derive(Debug)]
pub(crate) struct Owner {
    _file: File,
}

impl Owner {
    /// Creates `dir/owner` (our pid, for people reading the directory), locked shared.
    /// The file is locked under a private name and renamed into place: a sweeper never sees
    /// an `owner` that is not locked yet (and would then take the new sandbox for an
    /// abandoned one).
    pub(crate) fn claim(dir: &Path) -> std::io::Result<Owner> {
        let private = dir.join(format!(".{OWNER}-{}", std::process::id()));
        let mut file = File::create(&private)?;
        file.lock_shared()?;
        writeln!(file, "{}", std::process::id())?;
        std::fs::rename(&private, dir.join(OWNER))?;
        Ok(Owner { _file: file })
    }
}

/// Whether `dir` is a sandbox directory that no live process owns. On `Some`, the returned
/// file holds the directory's lock exclusively until it is dropped.
fn abandoned(dir: &Path) -> Option<File> {
    use std::os::unix::fs::MetadataExt;
    let path = dir.join(OWNER);
    let file = File::open(&path).ok()?;
    file.try_lock().ok()?;
    // Still the directory's owner file, not one another sweeper removed meanwhile.
    let (locked, now) = (file.metadata().ok()?, std::fs::metadata(&path).ok()?);
    (locked.ino() == now.ino() && locked.dev() == now.dev()).then_some(file)
}

/// How old a sandbox directory without an `owner` file must be to count as abandoned.
const OWNERLESS_AFTER: Duration = Duration::from_secs(600);

/// Whether `dir` has no `owner` file and was last modified over [`OWNERLESS_AFTER`] ago. On
/// `Some`, the returned handle holds an exclusive lock on the directory itself.
fn ownerless(dir: &Path) -> Option<File> {
    if dir.join(OWNER).exists() {
        return None;
    }
    let age = std::fs::metadata(dir)
        .ok()?
        .modified()
        .ok()?
        .elapsed()
        .ok()?;
    if age < OWNERLESS_AFTER {
        return None;
    }
    let handle = File::open(dir).ok()?;
    handle.try_lock().ok()?;
    Some(handle)
}

/// Tears down every sandbox under `state_dir` whose creator is gone; returns how many, and
/// the ids of those that were paused (resumed first: see [`remove`]). `runsc`: the binary
/// to `delete` them with.
pub(crate) fn sweep(state_dir: &Path, runsc: &Path) -> StaleCleanup {
    let mut out = StaleCleanup::default();
    let Ok(rd) = std::fs::read_dir(state_dir) else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let dir = e.path();
        if !name.starts_with("as-") || !dir.is_dir() {
            continue;
        }
        let Some(_lock) = abandoned(&dir).or_else(|| ownerless(&dir)) else {
            continue;
        };
        tracing::info!(sandbox = %name, "removing a gVisor sandbox whose process died without destroying it");
        if remove(&dir, &name, runsc) {
            out.thawed.push(name);
        }
        out.removed += 1;
    }
    out
}

/// How long a `runsc state` or `runsc resume` of a sweep may take.
const RUNSC_QUICK: Duration = Duration::from_secs(10);

/// Runs `cmd` (its stdout piped) for at most `limit`; its stdout if it exited with success.
fn quick(mut cmd: Command, limit: Duration) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let mut out = Vec::new();
    // Its output is small (a state document) and complete once it exited.
    child.stdout.take()?.read_to_end(&mut out).ok()?;
    status.filter(|s| s.success()).map(|_| out)
}

/// Resumes runsc container `id` (state root `root`) if it is paused: a client's `pause`, an
/// idle server's `on_idle: pause`. runsc (20221219) does not `delete --force` a paused
/// container cleanly: it kills it, then panics on the `paused => stopped` transition (exit
/// status 2) instead of finishing. Returns whether it was paused.
fn resume_if_paused(runsc: &Path, root: &Path, id: &str) -> bool {
    let mut state = Command::new(runsc);
    state
        .arg(format!("--root={}", root.display()))
        .args(["state", id]);
    let paused = quick(state, RUNSC_QUICK)
        .and_then(|out| serde_json::from_slice::<serde_json::Value>(&out).ok())
        .is_some_and(|v| v["status"] == "paused");
    if paused {
        let mut resume = Command::new(runsc);
        resume
            .arg(format!("--root={}", root.display()))
            .args(["resume", id]);
        if quick(resume, RUNSC_QUICK).is_none() {
            tracing::warn!(sandbox = %id, "could not resume a paused abandoned gVisor sandbox; deleting it anyway");
        }
    }
    paused
}

/// Deletes the runsc container `id` whose state root is under `dir` (resumed first if it
/// was paused), kills what is left of its processes, unmounts the workspace and removes
/// `dir`. Returns whether it was paused.
fn remove(dir: &Path, id: &str, runsc: &Path) -> bool {
    let root = dir.join("runsc");
    let paused = resume_if_paused(runsc, &root, id);
    let needle = format!("--root={}", root.display());
    // Where we are their subreaper (this process adopted the dead creator's runsc
    // processes), `delete` waits for zombies only we can reap.
    let ours = reaper::children_matching(&needle);
    let child = Command::new(runsc)
        .arg(format!("--root={}", root.display()))
        .args(["delete", "--force", id])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    if let Ok(mut child) = child {
        reaper::reap_while(&ours, Duration::from_secs(20), || {
            matches!(child.try_wait(), Ok(Some(_)) | Err(_))
        });
        if !matches!(child.try_wait(), Ok(Some(_))) {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
    // `delete` failed or could not reach everything: what still names the state root goes.
    let left = reaper::processes_matching(&needle);
    for &pid in &left {
        // SAFETY: kill(2) on a process whose command line names this sandbox's state root
        // (a runsc process of it); a pid that exited meanwhile is at worst ESRCH.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    reaper::reap_while(&ours, Duration::from_secs(5), || true);
    remove_cgroups(id);
    unmount_all(dir);
    let _ = std::fs::remove_dir_all(dir);
    paused
}

/// The mounts a sandbox directory may hold, relative to it: the tmpfs of an `Empty`
/// workspace, the scratch tmpfs behind `/tmp` and `/dev/shm`, the overlay view of a
/// caller's rootfs. The watchdog's script names the same ones.
const MOUNTS: [&str; 3] = ["workspace", "scratch", "view/root"];

/// Detaches the mounts of sandbox directory `dir` (one it does not hold is skipped).
pub(crate) fn unmount_all(dir: &Path) {
    for m in MOUNTS {
        let _ = nix::mount::umount2(&dir.join(m), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// The cgroup (relative to runsc's own, in every hierarchy) of sandbox `id`.
pub(crate) fn cgroup_name(id: &str) -> String {
    format!("agent-sandbox-gvisor-{id}")
}

/// Removes sandbox `id`'s cgroups where `runsc delete` did not: it gives up when a process
/// of the sandbox stays a zombie (its parent, the nearest subreaper above the dead owner,
/// may never reap it), and a zombie does not keep a cgroup from being removed.
fn remove_cgroups(id: &str) {
    fn walk(dir: &Path, name: &str, depth: usize) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if e.file_name().to_str() == Some(name) {
                let _ = std::fs::remove_dir(e.path());
            } else if depth < CGROUP_DEPTH {
                walk(&e.path(), name, depth + 1);
            }
        }
    }
    walk(Path::new("/sys/fs/cgroup"), &cgroup_name(id), 0);
}

/// How deep below `/sys/fs/cgroup` a sandbox's cgroup is looked for: the controller (or
/// the v2 root), then the creator's own cgroup path, usually a few levels.
const CGROUP_DEPTH: usize = 6;

/// The watchdog (see the module's docs): `$1` the state directory, `$2` runsc. Waits for
/// end of file on its standard input (a pipe only the creator's process writes to), then
/// tears down each sandbox directory whose owner lock it can take. A dying process closes
/// its descriptors one after the other, so the pipe may report the end before the owner
/// locks are released (seen once in about 20 runs of the suite under load: every sandbox
/// skipped and left running): directories whose lock is still held are tried again, ten
/// times over five seconds (those of other live processes stay held throughout).
const WATCHDOG: &str = r#"trap '' INT TERM HUP QUIT PIPE
while read -r _; do :; done
command -v flock >/dev/null 2>&1 || exit 0
for try in 1 2 3 4 5 6 7 8 9 10; do
  held=0
  for d in "$1"/as-*; do
    [ -f "$d/owner" ] || continue
    flock -xn "$d/owner" sh -c 'case $("$3" --root="$1/runsc" state "$2" 2>/dev/null) in
        *\"paused\"*) "$3" --root="$1/runsc" resume "$2" >/dev/null 2>&1 ;; esac
      t=; timeout -s KILL 1 true >/dev/null 2>&1 && t="timeout -s KILL 10"
      $t "$3" --root="$1/runsc" delete --force "$2" >/dev/null 2>&1 ||
        for p in /proc/[0-9]*; do
          case $(tr "\0" " " <"$p/cmdline" 2>/dev/null) in
            *"--root=$1/runsc "*) kill -9 "${p#/proc/}" 2>/dev/null ;; esac
        done
      find /sys/fs/cgroup -maxdepth 7 -type d -name "agent-sandbox-gvisor-$2" \
        -exec rmdir {} + 2>/dev/null
      for m in workspace scratch view/root; do umount -l "$1/$m" 2>/dev/null; done
      rm -rf "$1"' _ "$d" "${d##*/}" "$2" || held=1
  done
  [ "$held" = 0 ] && exit 0
  sleep 0.5
done"#;

/// The tag in the watchdog's command line (`$0` of its shell).
pub(crate) const WATCHDOG_TAG: &str = "asb-gvisor-watchdog";

/// What this process did once per state directory: the write ends of its watchdogs' pipes
/// (kept open until the process ends) and the directories swept.
static ONCE: std::sync::Mutex<Vec<(PathBuf, Option<std::os::fd::OwnedFd>)>> =
    std::sync::Mutex::new(Vec::new());

/// The first time this process asks for `state_dir`: starts its watchdog and sweeps it in a
/// background thread.
pub(crate) fn guard_state_dir(state_dir: &Path, runsc: &Path) {
    let Ok(mut done) = ONCE.lock() else {
        return;
    };
    if done.iter().any(|(d, _)| d == state_dir) {
        return;
    }
    let writer = match start_watchdog(state_dir, runsc) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, "no gVisor watchdog: sandboxes of this process will only be swept at the next start if it dies without destroying them");
            None
        }
    };
    done.push((state_dir.to_path_buf(), writer));
    let (dir, bin) = (state_dir.to_path_buf(), runsc.to_path_buf());
    let _ = std::thread::Builder::new()
        .name("gvisor-stale-sweep".into())
        .spawn(move || sweep(&dir, &bin));
}

/// Starts the watchdog of `state_dir`; returns the write end of its pipe.
fn start_watchdog(state_dir: &Path, runsc: &Path) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    use std::os::unix::process::CommandExt;
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into a local array of two.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nothing else.
    let (r, w) = unsafe {
        (
            std::os::fd::OwnedFd::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        )
    };
    // As the sandboxes' own paths spell it (`a//b/` is `a/b`): the script matches it in
    // runsc's command lines.
    let state_dir: PathBuf = state_dir.components().collect();
    Command::new("/bin/sh")
        .args(["-c", WATCHDOG, WATCHDOG_TAG])
        .arg(&state_dir)
        .arg(runsc)
        .stdin(Stdio::from(r))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .current_dir("/")
        .process_group(0)
        .spawn()?;
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_directory_is_owned_and_a_released_one_is_abandoned() {
        let d = tempfile::tempdir().unwrap();
        let owner = Owner::claim(d.path()).unwrap();
        assert!(abandoned(d.path()).is_none(), "our own live lock was taken");
        // Another open file description of the same file (like another process's) sees
        // the shared lock too.
        drop(owner);
        // Polled: a child another test of this binary forks at that moment holds a copy of
        // the owner's descriptor, and its lock, until it execs.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let lock = loop {
            if let Some(l) = abandoned(d.path()) {
                break l;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "released, never abandoned"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        // While one sweeper holds it, another does not get it.
        assert!(abandoned(d.path()).is_none());
        drop(lock);
        // No owner file: not ours to judge.
        let bare = tempfile::tempdir().unwrap();
        assert!(abandoned(bare.path()).is_none());
    }

    #[test]
    fn a_sweeper_never_sees_a_new_owner_file_unlocked() {
        let state = tempfile::tempdir().unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        // Every owner holds a file open: stay well inside this process's limit (a user's
        // default soft limit is 1,024 where root's may be far higher).
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `getrlimit` writes the limit into the struct it is given.
        let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
        assert_eq!(got, 0, "getrlimit");
        let owners_at_once = usize::try_from(limit.rlim_cur)
            .unwrap_or(usize::MAX)
            .saturating_sub(256)
            .clamp(100, 2000);
        /// Stops the sweeper however the claiming loop ends, so a failed claim fails the test
        /// instead of leaving it waiting for the sweeper forever.
        struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        std::thread::scope(|s| {
            let stop = StopOnDrop(&done);
            let sweeper = s.spawn(|| {
                let mut taken = 0;
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    for e in std::fs::read_dir(state.path()).unwrap().flatten() {
                        taken += usize::from(abandoned(&e.path()).is_some());
                    }
                }
                taken
            });
            // Every owner stays alive until the sweeper stops.
            let mut owners = Vec::new();
            for i in 0..owners_at_once {
                let d = state.path().join(format!("as-{i}"));
                std::fs::create_dir(&d).unwrap();
                owners.push(Owner::claim(&d).unwrap());
            }
            drop(stop);
            assert_eq!(
                sweeper.join().unwrap(),
                0,
                "a live sandbox looked abandoned"
            );
            drop(owners);
        });
    }

    #[test]
    fn sweep_leaves_owned_and_unmarked_directories_alone() {
        let state = tempfile::tempdir().unwrap();
        let live = state.path().join("as-live");
        let bare = state.path().join("as-bare");
        let other = state.path().join("not-a-sandbox");
        for d in [&live, &bare, &other] {
            std::fs::create_dir(d).unwrap();
        }
        let _owner = Owner::claim(&live).unwrap();
        std::fs::write(other.join(OWNER), "1\n").unwrap();
        // `false` stands in for runsc: nothing to delete here anyway.
        assert_eq!(sweep(state.path(), Path::new("/bin/false")).removed, 0);
        assert!(live.exists() && bare.exists() && other.exists());
    }

    #[test]
    fn an_old_directory_without_an_owner_file_is_swept_and_a_young_one_is_not() {
        let state = tempfile::tempdir().unwrap();
        let (old, young) = (state.path().join("as-old"), state.path().join("as-young"));
        for d in [&old, &young] {
            std::fs::create_dir_all(d.join("runsc")).unwrap();
        }
        let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
        File::open(&old)
            .unwrap()
            .set_times(std::fs::FileTimes::new().set_modified(hour_ago))
            .unwrap();
        assert_eq!(sweep(state.path(), Path::new("/bin/false")).removed, 1);
        assert!(!old.exists() && young.exists());
    }

    #[test]
    fn the_watchdog_unmounts_what_the_sweep_does() {
        for m in MOUNTS {
            assert!(WATCHDOG.contains(m), "{m}");
        }
    }

    #[test]
    fn the_watchdog_retries_an_owner_lock_released_after_its_pipe_closed() {
        let has_flock = Command::new("flock")
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !has_flock {
            eprintln!("SKIP: no flock(1) (util-linux) here: the watchdog does nothing without it");
            return;
        }
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join("as-late");
        std::fs::create_dir_all(&dir).unwrap();
        let owner = dir.join("owner");
        std::fs::write(&owner, b"").unwrap();
        let free = || {
            Command::new("flock")
                .arg("-xn")
                .arg(&owner)
                .arg("true")
                .status()
                .is_ok_and(|s| s.success())
        };
        // The lock outlives the pipe by a second, like a dying process's last descriptors.
        let mut holder = Command::new("flock")
            .arg("-x")
            .arg(&owner)
            .args(["sleep", "1"])
            .spawn()
            .unwrap();
        while free() {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        drop(start_watchdog(state.path(), Path::new("/bin/true")).unwrap());
        let closed = std::time::Instant::now();
        while dir.exists() {
            assert!(
                closed.elapsed() < std::time::Duration::from_secs(8),
                "the watchdog gave up on a lock released after its pipe closed"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        holder.wait().unwrap();
    }

    #[test]
    fn sweep_removes_an_abandoned_directory() {
        let state = tempfile::tempdir().unwrap();
        let dead = state.path().join("as-dead");
        std::fs::create_dir_all(dead.join("runsc")).unwrap();
        drop(Owner::claim(&dead).unwrap());
        assert_eq!(sweep(state.path(), Path::new("/bin/false")).removed, 1);
        assert!(!dead.exists());
    }
}
