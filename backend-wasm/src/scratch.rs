//! Private sandbox folders (`workspace/` and `tmp/` under one root), recycled when empty.
//!
//! Creating and removing folders costs hundreds of microseconds on many disks, more than
//! a whole JavaScript or WASI call. A folder is reused only when the last holder (the
//! sandbox, an interpreter, an in-flight module run) has let go **and** both subfolders are
//! empty, so nothing of one sandbox can reach the next. Folders that hold files are removed
//! by a background thread. Spare folders left at process exit are removed by an `atexit`
//! handler.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

use sandbox_core::{Error, Result};

const MAX_SPARE: usize = 8;

static SPARE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static REAPER: OnceLock<Option<Mutex<mpsc::Sender<PathBuf>>>> = OnceLock::new();
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

fn reap(path: PathBuf) {
    let tx = REAPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<PathBuf>();
        std::thread::Builder::new()
            .name("agent-sandbox-reaper".into())
            .spawn(move || {
                for p in rx {
                    let _ = std::fs::remove_dir_all(&p);
                }
            })
            .ok()
            .map(|_| Mutex::new(tx))
    });
    let unsent = match tx {
        Some(tx) => match tx.lock() {
            Ok(tx) => tx.send(path).err().map(|e| e.0),
            Err(_) => Some(path),
        },
        None => Some(path),
    };
    if let Some(p) = unsent {
        let _ = std::fs::remove_dir_all(p);
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
}

impl Scratch {
    /// A fresh (or recycled, verified empty) root with `workspace/` and `tmp/`.
    pub(crate) fn new() -> Result<Arc<Scratch>> {
        let spare = SPARE.lock().ok().and_then(|mut g| g.pop());
        if let Some(root) = spare {
            let s = Scratch { root };
            if is_empty(&s.workspace()) && is_empty(&s.tmp()) {
                return Ok(Arc::new(s));
            }
            // Not what we left: drop it (removed in the background) and make a new one.
        }
        let root = tempfile::Builder::new()
            .prefix("agent-sandbox-wasm-")
            .tempdir()
            .map_err(|e| Error::io("create the sandbox folder", e))?
            .keep();
        let s = Scratch { root };
        for d in [s.workspace(), s.tmp()] {
            std::fs::create_dir(&d).map_err(|e| Error::io_path("create", &d, e))?;
        }
        Ok(Arc::new(s))
    }

    /// The root.
    #[cfg(test)]
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// `root/workspace`.
    pub(crate) fn workspace(&self) -> PathBuf {
        self.root.join("workspace")
    }

    /// `root/tmp`.
    pub(crate) fn tmp(&self) -> PathBuf {
        self.root.join("tmp")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let root = std::mem::take(&mut self.root);
        if root.as_os_str().is_empty() {
            return;
        }
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
        reap(root);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_roots_are_recycled_and_used_ones_are_not() {
        let a = Scratch::new().unwrap();
        let root = a.root().to_path_buf();
        drop(a);
        let b = Scratch::new().unwrap();
        assert_eq!(b.root(), root, "an empty root is reused");
        std::fs::write(b.workspace().join("f"), "x").unwrap();
        drop(b);
        let c = Scratch::new().unwrap();
        assert_ne!(c.root(), root, "a root that held files is never reused");
        assert!(is_empty(&c.workspace()));
    }
}
