//! Private sandbox folders (`workspace/` and `tmp/` under one root), recycled when empty.
//!
//! Creating and removing folders costs hundreds of microseconds on many disks, more than
//! a whole JavaScript or WASI call. A folder is reused only when the last holder (the
//! sandbox, an interpreter, an in-flight module run) has let go **and** both subfolders are
//! empty, so nothing of one sandbox can reach the next. Both the emptiness check and the
//! removal of folders that hold files run on the janitor thread (see
//! `engine::drop_later`), off the caller's path; only checked folders enter the spare list. Spare folders left at process
//! exit are removed by an `atexit` handler.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use sandbox_core::{Error, Result};

const MAX_SPARE: usize = 64;

/// Folder names: `agent-sandbox-wasm-<pid of the owner>-<random>`.
pub(crate) const PREFIX: &str = "agent-sandbox-wasm-";

static SWEEP: OnceLock<()> = OnceLock::new();

/// Removes the sandbox folders under `dir` whose owning process no longer exists. Folders
/// of live processes (or with a name we did not make) are left alone.
fn sweep_dead(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let dead = !Path::new(&format!("/proc/{pid}")).exists();
        if dead
            && e.file_type().is_ok_and(|t| t.is_dir())
            && std::fs::remove_dir_all(e.path()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

static SPARE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static ATEXIT: OnceLock<()> = OnceLock::new();

extern "C" fn remove_spares() {
    let spares = match SPARE.lock() {
        Ok(mut g) => std::mem::take(&mut *g),
        Err(_) => return,
    };
    for p in spares {
        let _ = std::fs::remove_dir_all(p);
    }
}

/// Recycles `root` if both subfolders are empty and the spare list has room; else removes it.
fn recycle_or_remove(root: PathBuf) {
    if is_empty(&root.join("workspace")) && is_empty(&root.join("tmp")) {
        if let Ok(mut g) = SPARE.lock() {
            if g.len() < MAX_SPARE {
                ATEXIT.get_or_init(|| {
                    // SAFETY: registering a plain `extern "C" fn()` with no captured
                    // state; it only touches the `SPARE` static.
                    unsafe {
                        libc::atexit(remove_spares);
                    }
                });
                g.push(root);
                return;
            }
        }
    }
    let _ = std::fs::remove_dir_all(root);
}

/// A root whose last holder let go; checked (and recycled or removed) when dropped, which
/// happens on the janitor thread.
struct Released(PathBuf);

impl Drop for Released {
    fn drop(&mut self) {
        recycle_or_remove(std::mem::take(&mut self.0));
    }
}

fn is_empty(dir: &Path) -> bool {
    match std::fs::read_dir(dir) {
        Ok(mut rd) => rd.next().is_none(),
        Err(_) => false,
    }
}

/// A sandbox's private root. Share it (`Arc`) with everything that holds a handle into it.
#[derive(Debug)]
pub(crate) struct Scratch {
    root: PathBuf,
    workspace: PathBuf,
    tmp: PathBuf,
}

impl Scratch {
    /// A fresh (or recycled: verified empty by the reaper after its last holder let go)
    /// root with `workspace/` and `tmp/`.
    pub(crate) fn new() -> Result<Arc<Scratch>> {
        let spare = SPARE.lock().ok().and_then(|mut g| g.pop());
        if let Some(root) = spare {
            let s = Scratch::at(root);
            // Still there (a /tmp cleaner may have removed an old spare)?
            if s.workspace.is_dir() && s.tmp.is_dir() {
                return Ok(Arc::new(s));
            }
        }
        SWEEP.get_or_init(|| {
            // Folders of processes that died before their janitor finished (a crash, or an
            // exit with drops still queued): removed once per process, in the background.
            let _ = std::thread::Builder::new()
                .name("wasm-scratch-sweep".into())
                .spawn(|| sweep_dead(&std::env::temp_dir()));
        });
        let root = tempfile::Builder::new()
            .prefix(&format!("{PREFIX}{}-", std::process::id()))
            .tempdir()
            .map_err(|e| Error::io("create the sandbox folder", e))?
            .keep();
        let s = Scratch::at(root);
        for d in [&s.workspace, &s.tmp] {
            std::fs::create_dir(d).map_err(|e| Error::io_path("create", d, e))?;
        }
        Ok(Arc::new(s))
    }

    fn at(root: PathBuf) -> Scratch {
        Scratch {
            workspace: root.join("workspace"),
            tmp: root.join("tmp"),
            root,
        }
    }

    /// The root (what `limits.disk_bytes` caps: see `disk`).
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// `root/workspace`.
    pub(crate) fn workspace(&self) -> &Path {
        &self.workspace
    }

    /// `root/tmp`.
    pub(crate) fn tmp(&self) -> &Path {
        &self.tmp
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let root = std::mem::take(&mut self.root);
        if !root.as_os_str().is_empty() {
            crate::engine::drop_later(Released(root));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_of_dead_processes_are_swept_and_others_kept() {
        let d = tempfile::tempdir().unwrap();
        // A pid that cannot exist (above the kernel's pid_max limit of 2^22).
        let dead = d.path().join(format!("{PREFIX}{}-abc", 1u32 << 23));
        let mine = d.path().join(format!("{PREFIX}{}-def", std::process::id()));
        let foreign = d.path().join(format!("{PREFIX}xyz"));
        for p in [&dead, &mine, &foreign] {
            std::fs::create_dir_all(p.join("workspace")).unwrap();
            std::fs::write(p.join("workspace/f"), b"x").unwrap();
        }
        assert_eq!(sweep_dead(d.path()), 1);
        assert!(!dead.exists());
        assert!(mine.exists() && foreign.exists());
    }

    #[test]
    fn empty_roots_are_recycled_and_used_ones_are_not() {
        let a = Scratch::new().unwrap();
        let root = a.root().to_path_buf();
        drop(a);
        crate::engine::flush_drops();
        let b = Scratch::new().unwrap();
        assert_eq!(b.root(), root, "an empty root is reused");
        std::fs::write(b.workspace().join("f"), "x").unwrap();
        drop(b);
        crate::engine::flush_drops();
        let c = Scratch::new().unwrap();
        assert_ne!(c.root(), root, "a root that held files is never reused");
        assert!(is_empty(c.workspace()));
    }
}
