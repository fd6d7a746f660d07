//! What a process that dies with microVM sandboxes leaves on the host, and its removal.
//!
//! The monitor runs in the library user's process: a VM is a set of its threads, its guest
//! memory a `memfd`, its network namespace and TAP held by descriptors. When that process dies,
//! however it dies, they all go with it, a VM whose vCPUs were paused (a client's `pause`,
//! an idle server's `on_idle: pause`, a snapshot being written) included: the kernel has no
//! paused vCPU to thaw. What the kernel does not take is on disk: the directories of boot
//! snapshots, snapshots being written and unpacked snapshots (a state file and a sparse
//! memory file each, as big as the guest's touched memory).
//!
//! Those are made in one directory per process, `$TMPDIR/agent-sandbox-microvm-<pid>-<random>`
//! ([`scratch_dir`], removed when the process exits normally), holding an `owner` file that
//! the process keeps locked (a shared `flock`) for its whole life: the kernel drops the lock
//! when the process dies, and a reused pid cannot fake it. [`sweep`] removes every such
//! directory whose lock it can take exclusively; the first [`scratch_dir`] of each process
//! sweeps in the background, and
//! [`MicrovmBackend::cleanup_stale`](crate::MicrovmBackend) does on demand. A directory
//! without an `owner` file (a process killed between the two) is removed once it is ten
//! minutes old.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sandbox_core::sandbox::StaleCleanup;

/// The prefix of every per-process directory.
const PREFIX: &str = "agent-sandbox-microvm-";
/// Name of the lock file in each.
const OWNER: &str = "owner";
/// How old a directory without an `owner` file must be to count as abandoned.
const OWNERLESS_AFTER: Duration = Duration::from_secs(600);

/// This process's directory and its held lock.
struct Scratch {
    dir: PathBuf,
    /// The process that made it (a forked child running `atexit` handlers is not it).
    pid: u32,
    _owner: File,
}

/// This process's scratch directory, once made.
static SCRATCH: std::sync::OnceLock<Scratch> = std::sync::OnceLock::new();

/// This process's directory for snapshot files under `$TMPDIR` (made, locked and the
/// others swept in the background on first use; removed when the process exits normally).
pub(crate) fn scratch_dir() -> std::io::Result<&'static Path> {
    static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    if let Some(s) = SCRATCH.get() {
        return Ok(&s.dir);
    }
    let _one = INIT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = SCRATCH.get() {
        return Ok(&s.dir);
    }
    let tmp = std::env::temp_dir();
    let s = claim(&tmp)?;
    let _ = std::thread::Builder::new()
        .name("microvm-stale-sweep".into())
        .spawn(move || sweep(&tmp));
    let dir = &SCRATCH.get_or_init(|| s).dir;
    // SAFETY: registers a plain `extern "C"` function with atexit(3).
    unsafe {
        libc::atexit(remove_at_exit);
    }
    Ok(dir)
}

/// Removes this process's scratch directory as it exits normally (one that is killed
/// leaves it to the next sweep).
extern "C" fn remove_at_exit() {
    if let Some(s) = SCRATCH.get() {
        if s.pid == std::process::id() {
            let _ = std::fs::remove_dir_all(&s.dir);
        }
    }
}

/// A new directory for snapshot files, named `<prefix>XXXXXX`, in this process's
/// [`scratch_dir`]; removed when dropped.
pub(crate) fn tempdir(prefix: &str) -> std::io::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(scratch_dir()?)
}

/// Makes a new `tmp/agent-sandbox-microvm-<pid>-<random>` (mode 0700) with its `owner` file
/// locked shared. The file is locked under a private name and renamed into place, so a
/// sweeper never sees an unlocked `owner` of a live process.
fn claim(tmp: &Path) -> std::io::Result<Scratch> {
    let pid = std::process::id();
    let dir = tempfile::Builder::new()
        .prefix(&format!("{PREFIX}{pid}-"))
        .tempdir_in(tmp)?
        .keep();
    let private = dir.join(format!(".{OWNER}-{pid}"));
    let mut file = File::create(&private)?;
    file.lock_shared()?;
    writeln!(file, "{pid}")?;
    std::fs::rename(&private, dir.join(OWNER))?;
    Ok(Scratch {
        dir,
        pid,
        _owner: file,
    })
}

/// Whether `dir` has an `owner` file that no live process holds. On `Some`, the returned file
/// holds the lock exclusively until dropped.
fn abandoned(dir: &Path) -> Option<File> {
    use std::os::unix::fs::MetadataExt;
    let path = dir.join(OWNER);
    let file = File::open(&path).ok()?;
    file.try_lock().ok()?;
    // Still the directory's owner file, not one another sweeper removed meanwhile.
    let (locked, now) = (file.metadata().ok()?, std::fs::metadata(&path).ok()?);
    (locked.ino() == now.ino() && locked.dev() == now.dev()).then_some(file)
}

/// Whether `dir` has no `owner` file and was last modified over [`OWNERLESS_AFTER`] ago.
fn ownerless(dir: &Path) -> bool {
    !dir.join(OWNER).exists()
        && std::fs::metadata(dir)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= OWNERLESS_AFTER)
}

/// Removes every per-process directory under `tmp` whose process is gone (see the module's
/// docs). Counts directories; no microVM is ever thawed (none outlives its process).
pub(crate) fn sweep(tmp: &Path) -> StaleCleanup {
    let mut out = StaleCleanup::default();
    let Ok(rd) = std::fs::read_dir(tmp) else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        // `<pid>-<random>`: the older versions' directories (`snap-*`, `boot-*`,
        // `restore-*` right under `$TMPDIR`) have no owner to judge them by.
        let is_ours = name
            .strip_prefix(PREFIX)
            .and_then(|p| p.split_once('-'))
            .is_some_and(|(pid, rest)| {
                !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()) && !rest.is_empty()
            });
        // Not a symlink planted in a shared /tmp: only real directories.
        if !is_ours || !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = e.path();
        let lock = abandoned(&dir);
        if lock.is_none() && !ownerless(&dir) {
            continue;
        }
        tracing::info!(dir = %dir.display(), "removing the snapshot files of a microVM process that died");
        if std::fs::remove_dir_all(&dir).is_ok() {
            out.removed += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_processs_directory_stays_and_a_dead_ones_goes() {
        let tmp = tempfile::tempdir().unwrap();
        let live = claim(tmp.path()).unwrap();
        std::fs::write(live.dir.join("memory"), b"x").unwrap();
        // Another process's directory whose lock is free: its process died.
        let dead = tmp.path().join(format!("{PREFIX}999999999-abcdef"));
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join(OWNER), b"999999999\n").unwrap();
        std::fs::write(dead.join("memory"), b"x").unwrap();
        // Not ours to judge: other names, young directories without an owner file.
        let other = tmp.path().join(format!("{PREFIX}snap-abc"));
        let young = tmp.path().join(format!("{PREFIX}123-young"));
        for d in [&other, &young] {
            std::fs::create_dir(d).unwrap();
        }
        assert_eq!(sweep(tmp.path()).removed, 1);
        assert!(!dead.exists());
        assert!(live.dir.join("memory").exists() && other.exists() && young.exists());
        // An old directory without an owner file goes.
        let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
        File::open(&young)
            .unwrap()
            .set_times(std::fs::FileTimes::new().set_modified(hour_ago))
            .unwrap();
        assert_eq!(sweep(tmp.path()).removed, 1);
        assert!(!young.exists());
        // Released (as the kernel does when the process dies): swept. (A child that another
        // test of this process is spawning holds a copy of the descriptor, and the lock,
        // until it execs: polled.)
        let dir = live.dir.clone();
        drop(live);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while dir.exists() {
            assert!(std::time::Instant::now() < deadline, "never swept");
            assert_eq!(sweep(tmp.path()).thawed, Vec::<String>::new());
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_lock_held_by_another_process_keeps_its_directory() {
        let has_flock = std::process::Command::new("flock")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success());
        if !has_flock {
            eprintln!("SKIP: no flock(1) here");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join(format!("{PREFIX}4242-held"));
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join(OWNER), b"").unwrap();
        // `-o`: the lock is flock's own, not its command's.
        let mut holder = std::process::Command::new("flock")
            .args(["-s", "-o"])
            .arg(dir.join(OWNER))
            .args(["sleep", "30"])
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        // Until the holder has its lock, the directory may be taken for abandoned: wait
        // for it (a held lock is what this test is about).
        while File::open(dir.join(OWNER)).unwrap().try_lock().is_ok() {
            assert!(std::time::Instant::now() < deadline, "flock never locked");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(sweep(tmp.path()).removed, 0);
        assert!(dir.exists());
        holder.kill().unwrap();
        holder.wait().unwrap();
        // (As above, a child being spawned may hold the lock for a moment.)
        while dir.exists() {
            assert!(std::time::Instant::now() < deadline, "never swept");
            sweep(tmp.path());
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
