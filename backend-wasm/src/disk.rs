//! The disk cap of a sandbox's private folders (`limits.disk_bytes`).
//!
//! A guest writes through WASI into host folders: unmetered, a loop writing chunks (or
//! creating empty files) filled the host's disk. The sandbox's own folders (its `Empty`
//! workspace and its `/tmp`, under one root) are capped: every write to a file under that
//! root, and every file or directory made there, is admitted against an estimate of their
//! usage (what was measured, plus what was written since, overwrites included). When the
//! estimate would pass a cap the folders are measured again (their size is bounded by the
//! cap itself), and what still does not fit gets `ENOSPC`. Host folders a spec grants (a
//! `HostDir` workspace, mounts) are the caller's and are not capped, as in the other tiers.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Entries allowed per byte of the cap: one per 8 KiB, at least 256.
const BYTES_PER_ENTRY: u64 = 8 << 10;

/// The cap and the usage estimate of one sandbox's private folders.
#[derive(Debug)]
pub(crate) struct DiskQuota {
    root: PathBuf,
    cap_bytes: u64,
    cap_entries: u64,
    /// Measured usage plus what was admitted since (an overestimate).
    bytes: u64,
    entries: u64,
    measured: bool,
    /// Guest descriptors (files or directories) under `root`.
    fds: HashSet<u32>,
    /// A write or create was refused since the flag was last cleared.
    pub(crate) hit: bool,
}

impl DiskQuota {
    /// A cap of `cap_bytes` (and one entry per 8 KiB of it) on the folders under `root`.
    pub(crate) fn new(root: PathBuf, cap_bytes: u64) -> DiskQuota {
        DiskQuota {
            root,
            cap_bytes,
            cap_entries: (cap_bytes / BYTES_PER_ENTRY).max(256),
            bytes: 0,
            entries: 0,
            measured: false,
            fds: HashSet::new(),
            hit: false,
        }
    }

    /// Whether `path` (a preopened host folder) is under the capped root.
    pub(crate) fn covers(&self, path: &Path) -> bool {
        path.starts_with(&self.root)
    }

    /// Whether guest descriptor `fd` is under the capped root.
    pub(crate) fn metered(&self, fd: u32) -> bool {
        self.fds.contains(&fd)
    }

    /// Records whether descriptor `fd` (new, or renumbered) is under the capped root.
    pub(crate) fn track(&mut self, fd: u32, metered: bool) {
        if metered {
            self.fds.insert(fd);
        } else {
            self.fds.remove(&fd);
        }
    }

    /// Whether `bytes` more bytes and `entries` more files or directories fit; measures the
    /// folders again when the estimate would pass a cap. Admitted amounts join the estimate.
    pub(crate) fn admit(&mut self, bytes: u64, entries: u64) -> bool {
        let over = |q: &DiskQuota| {
            q.bytes.saturating_add(bytes) > q.cap_bytes
                || q.entries.saturating_add(entries) > q.cap_entries
        };
        if !self.measured || over(self) {
            (self.bytes, self.entries) = usage(&self.root);
            self.measured = true;
        }
        if over(self) {
            self.hit = true;
            return false;
        }
        self.bytes += bytes;
        self.entries += entries;
        true
    }
}

/// Whether `bytes` more bytes and `entries` more entries fit a cap of `cap_bytes` on the
/// folders under `root` as they are now (the file API's check: no estimate to keep).
pub(crate) fn fits(root: &Path, cap_bytes: u64, bytes: u64, entries: u64) -> bool {
    let mut q = DiskQuota::new(root.to_path_buf(), cap_bytes);
    q.admit(bytes, entries)
}

/// What the folders under `root` take: bytes allocated (the apparent size where a
/// filesystem reports no blocks) and entries. Symbolic links are not followed.
fn usage(root: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let (mut bytes, mut entries) = (0u64, 0u64);
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(md) = e.path().symlink_metadata() else {
                continue;
            };
            entries += 1;
            let allocated = md.blocks().saturating_mul(512);
            bytes = bytes.saturating_add(if allocated == 0 { md.len() } else { allocated });
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    (bytes, entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_cap_and_measures_again_before_refusing() {
        let d = tempfile::tempdir().unwrap();
        let mut q = DiskQuota::new(d.path().to_path_buf(), 1 << 20);
        assert!(q.admit(600 << 10, 1));
        std::fs::write(d.path().join("a"), vec![1u8; 600 << 10]).unwrap();
        // The estimate says 1.2 MiB: measured again, still over: refused.
        assert!(!q.admit(600 << 10, 0));
        assert!(q.hit);
        // Overwrites only count until the next measurement.
        std::fs::remove_file(d.path().join("a")).unwrap();
        assert!(q.admit(600 << 10, 1));
    }

    #[test]
    fn entries_are_capped_too() {
        let d = tempfile::tempdir().unwrap();
        let mut q = DiskQuota::new(d.path().to_path_buf(), 1 << 20);
        for i in 0..256 {
            assert!(q.admit(0, 1));
            std::fs::write(d.path().join(i.to_string()), b"").unwrap();
        }
        assert!(!q.admit(0, 1), "the 257th entry");
    }

    #[test]
    fn only_folders_under_the_root_are_covered() {
        let q = DiskQuota::new(PathBuf::from("/s/root"), 1);
        assert!(q.covers(Path::new("/s/root/workspace")));
        assert!(!q.covers(Path::new("/s/rootless")));
        assert!(!q.covers(Path::new("/home/user/repo")));
    }
}
