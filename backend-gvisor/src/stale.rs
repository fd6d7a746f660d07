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
//! still names the directory is killed, the workspace unmounted, the directory removed).
//! A directory without an `owner` file (made by an older version, or a create between its
//! `mkdir` and the file) is left alone.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

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
    /// Creates `dir/owner` (our pid, for people reading the directory) and locks it shared.
    pub(crate) fn claim(dir: &Path) -> std::io::Result<Owner> {
        let mut file = File::create(dir.join(OWNER))?;
        file.lock_shared()?;
        writeln!(file, "{}", std::process::id())?;
        Ok(Owner { _file: file })
    }
}

/// Whether `dir` is a sandbox directory that no live process owns. On `Some`, the returned
/// file holds the directory's lock exclusively until it is dropped.
fn abandoned(dir: &Path) -> Option<File> {
    let file = File::open(dir.join(OWNER)).ok()?;
    file.try_lock().ok()?;
    Some(file)
}

/// Tears down every sandbox under `state_dir` whose creator is gone; returns how many.
/// `runsc`: the binary to `delete` them with.
pub(crate) fn sweep(state_dir: &Path, runsc: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(state_dir) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let dir = e.path();
        if !name.starts_with("as-") || !dir.is_dir() {
            continue;
        }
        let Some(_lock) = abandoned(&dir) else {
            continue;
        };
        tracing::info!(sandbox = %name, "removing a gVisor sandbox whose process died without destroying it");
        remove(&dir, &name, runsc);
        n += 1;
    }
    n
}

/// Deletes the runsc container `id` whose state root is under `dir`, kills what is left of
/// its processes, unmounts the workspace and removes `dir`.
fn remove(dir: &Path, id: &str, runsc: &Path) {
    let root = dir.join("runsc");
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
    let left = processes_naming(&needle);
    for &pid in &left {
        // SAFETY: kill(2) on a process whose command line names this sandbox's state root
        // (a runsc process of it); a pid that exited meanwhile is at worst ESRCH.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    reaper::reap_while(&ours, Duration::from_secs(5), || true);
    let _ = nix::mount::umount2(&dir.join("workspace"), nix::mount::MntFlags::MNT_DETACH);
    let _ = std::fs::remove_dir_all(dir);
}

/// Every process (not only our children) whose command line contains `needle`.
pub(crate) fn processes_naming(needle: &str) -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .collect()
}

/// State directories already swept by this process (once each).
static SWEPT: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Sweeps `state_dir` in a background thread, the first time this process asks for it.
pub(crate) fn sweep_once_in_background(state_dir: &Path, runsc: &Path) {
    let Ok(mut swept) = SWEPT.lock() else {
        return;
    };
    if swept.iter().any(|d| d == state_dir) {
        return;
    }
    swept.push(state_dir.to_path_buf());
    let (dir, bin) = (state_dir.to_path_buf(), runsc.to_path_buf());
    let _ = std::thread::Builder::new()
        .name("gvisor-stale-sweep".into())
        .spawn(move || sweep(&dir, &bin));
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
        let lock = abandoned(d.path()).expect("released: abandoned");
        // While one sweeper holds it, another does not get it.
        assert!(abandoned(d.path()).is_none());
        drop(lock);
        // No owner file: not ours to judge.
        let bare = tempfile::tempdir().unwrap();
        assert!(abandoned(bare.path()).is_none());
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
        assert_eq!(sweep(state.path(), Path::new("/bin/false")), 0);
        assert!(live.exists() && bare.exists() && other.exists());
    }

    #[test]
    fn sweep_removes_an_abandoned_directory() {
        let state = tempfile::tempdir().unwrap();
        let dead = state.path().join("as-dead");
        std::fs::create_dir_all(dead.join("runsc")).unwrap();
        drop(Owner::claim(&dead).unwrap());
        assert_eq!(sweep(state.path(), Path::new("/bin/false")), 1);
        assert!(!dead.exists());
    }
}
