//! What the cache holds ([`ImageStore::usage`], [`ImageStore::list`]) and letting go of it:
//! [`ImageStore::remove`] and [`ImageStore::prune`] delete whatever no image needs any more.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::Path;

use nix::fcntl::{Flock, FlockArg};
use sandbox_core::ImageRef;
use serde::Serialize;

use super::{hex_of, read_size, ImageStore, Record};
use crate::error::{ImageError, Result};

/// One image in the cache, as [`ImageStore::list`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ImageInfo {
    /// References naming it (none: only `prune` will remove it).
    pub references: Vec<String>,
    /// The manifest digest.
    pub digest: String,
    /// Number of layers.
    pub layers: usize,
    /// Bytes of its blobs plus its unpacked layers (layers shared with other images are
    /// counted in each), plus its filesystem image when one was built (the disk space it
    /// takes: the file is sparse).
    pub bytes: u64,
    /// Whether a sandbox uses it now.
    pub in_use: bool,
}

/// What [`ImageStore::prune`] or [`ImageStore::remove`] freed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PruneReport {
    /// Image records removed.
    pub images: usize,
    /// Blobs removed.
    pub blobs: usize,
    /// Unpacked layers removed.
    pub layers: usize,
    /// Filesystem images ([`ImageStore::rootfs_image`]) removed.
    pub fs_images: usize,
    /// Bytes freed.
    pub bytes: u64,
}

impl ImageStore {
    /// Bytes the cache holds: blobs, unpacked layers and filesystem images (the disk space
    /// they take: they are sparse).
    ///
    /// # Errors
    /// [`ImageError::Io`] listing the cache.
    pub fn usage(&self) -> Result<u64> {
        let fsimages = self.p("fsimages");
        let mut total = match fs::read_dir(&fsimages) {
            Ok(rd) => rd
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| disk_bytes(&m))
                .sum(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
            Err(e) => return Err(ImageError::io("list", &fsimages, e)),
        };
        for (dir, suffix) in [("blobs/sha256", None), ("layers", Some(".size"))] {
            let d = self.p(dir);
            let rd = fs::read_dir(&d).map_err(|e| ImageError::io("list", &d, e))?;
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                match suffix {
                    None => total += e.metadata().map(|m| m.len()).unwrap_or(0),
                    Some(s) if name.ends_with(s) => total += read_size(&e.path()),
                    Some(_) => {}
                }
            }
        }
        Ok(total)
    }

    /// Every image in the cache.
    ///
    /// # Errors
    /// [`ImageError::Io`] reading the cache.
    pub fn list(&self) -> Result<Vec<ImageInfo>> {
        let refs = self.refs()?;
        let mut by_digest: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (r, d) in refs {
            by_digest.entry(d).or_default().push(r);
        }
        let mut out = Vec::new();
        for rec in self.records()? {
            let mut bytes = 0;
            for l in &rec.layers {
                if let (Ok(b), Ok(d)) = (hex_of(&l.digest), hex_of(&l.diff_id)) {
                    bytes += fs::metadata(self.p(format!("blobs/sha256/{b}")))
                        .map(|m| m.len())
                        .unwrap_or(0);
                    bytes += read_size(&self.p(format!("layers/{d}.size")));
                }
            }
            if let Ok(h) = hex_of(&rec.digest) {
                bytes += fs::symlink_metadata(self.p(format!("fsimages/{h}.ext4")))
                    .map(|m| disk_bytes(&m))
                    .unwrap_or(0);
            }
            out.push(ImageInfo {
                references: by_digest.remove(&rec.digest).unwrap_or_default(),
                digest: rec.digest.clone(),
                layers: rec.layers.len(),
                bytes,
                in_use: self.in_use(&rec.digest),
            });
        }
        Ok(out)
    }

    fn records(&self) -> Result<Vec<Record>> {
        let d = self.p("images");
        let rd = fs::read_dir(&d).map_err(|e| ImageError::io("list", &d, e))?;
        let mut v = Vec::new();
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().ends_with(".json") {
                if let Ok(b) = fs::read(e.path()) {
                    if let Ok(r) = serde_json::from_slice::<Record>(&b) {
                        v.push(r);
                    }
                }
            }
        }
        Ok(v)
    }

    fn in_use(&self, digest: &str) -> bool {
        self.unused(digest).is_none()
    }

    /// The image's record locked exclusively, when no sandbox holds it.
    fn unused(&self, digest: &str) -> Option<Flock<fs::File>> {
        let hex = hex_of(digest).ok()?;
        let f = fs::File::open(self.p(format!("images/{hex}.json"))).ok()?;
        Flock::lock(f, FlockArg::LockExclusiveNonblock).ok()
    }

    /// Removes the reference `name` (as written to `pull`, or a manifest digest, which
    /// removes every reference to it), then everything no image needs any more. An image a
    /// sandbox uses keeps its files until the next `prune` after it ends.
    ///
    /// # Errors
    /// [`ImageError::NotCached`] when nothing has that name; [`ImageError::Io`].
    pub fn remove(&self, name: &str) -> Result<PruneReport> {
        let key = if name.starts_with("sha256:") {
            name.to_owned()
        } else {
            ImageRef::parse(name)
                .map(|r| r.to_string())
                .unwrap_or_else(|_| name.to_owned())
        };
        let mut found = false;
        self.update_refs(|refs| {
            let before = refs.len();
            refs.retain(|r, d| r != &key && d != &key);
            found = refs.len() != before;
        })?;
        if !found && self.record(&key).ok().flatten().is_none() {
            return Err(ImageError::NotCached(name.to_owned()));
        }
        self.prune()
    }

    /// Removes images no reference names (unless in use), then every blob, layer and
    /// filesystem image no image needs, and leftovers of interrupted pulls and builds.
    ///
    /// # Errors
    /// [`ImageError::Io`].
    pub fn prune(&self) -> Result<PruneReport> {
        let _store = self.lock_blocking("store", true)?;
        let mut report = PruneReport::default();
        let named: BTreeSet<String> = self.refs()?.into_values().collect();
        let mut keep_blobs = BTreeSet::new();
        let mut keep_layers = BTreeSet::new();
        let mut keep_fs = BTreeSet::new();
        for rec in self.records()? {
            if !named.contains(&rec.digest) {
                // Removed only while we hold it exclusively: no sandbox leases it.
                if let Some(_held) = self.unused(&rec.digest) {
                    let p = self.p(format!("images/{}.json", hex_of(&rec.digest)?));
                    report.bytes += fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
                    fs::remove_file(&p).map_err(|e| ImageError::io("remove", &p, e))?;
                    report.images += 1;
                    continue;
                }
            }
            keep_fs.insert(format!("{}.ext4", hex_of(&rec.digest)?));
            for l in &rec.layers {
                keep_blobs.insert(hex_of(&l.digest)?.to_owned());
                keep_layers.insert(hex_of(&l.diff_id)?.to_owned());
            }
        }
        let blobs = self.p("blobs/sha256");
        for e in fs::read_dir(&blobs)
            .map_err(|e| ImageError::io("list", &blobs, e))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if !keep_blobs.contains(&name) {
                report.bytes += e.metadata().map(|m| m.len()).unwrap_or(0);
                fs::remove_file(e.path()).map_err(|err| ImageError::io("remove", e.path(), err))?;
                report.blobs += 1;
            }
        }
        let layers = self.p("layers");
        for e in fs::read_dir(&layers)
            .map_err(|e| ImageError::io("list", &layers, e))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let hex = name.trim_end_matches(".size");
            if keep_layers.contains(hex) {
                continue;
            }
            if name.ends_with(".size") {
                report.bytes += read_size(&e.path());
                let _ = fs::remove_file(e.path());
            } else {
                remove_tree(&e.path())?;
                report.layers += 1;
            }
        }
        // Filesystem images of removed images, and anything else there (none is being
        // renamed into place now: builds hold the store lock shared).
        let fsimages = self.p("fsimages");
        match fs::read_dir(&fsimages) {
            Ok(rd) => {
                for e in rd.flatten() {
                    if keep_fs.contains(e.file_name().to_string_lossy().as_ref()) {
                        continue;
                    }
                    report.bytes += e.metadata().map(|m| disk_bytes(&m)).unwrap_or(0);
                    remove_tree(&e.path())?;
                    report.fs_images += 1;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(ImageError::io("list", &fsimages, e)),
        }
        // Leftovers of pulls and builds that were killed (none runs now: we hold the store
        // lock).
        let tmp = self.p("tmp");
        for e in fs::read_dir(&tmp)
            .map_err(|e| ImageError::io("list", &tmp, e))?
            .flatten()
        {
            let _ = remove_tree(&e.path());
        }
        Ok(report)
    }
}

/// The disk space a file takes (less than its length when it is sparse).
fn disk_bytes(m: &fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    m.len().min(m.blocks().saturating_mul(512))
}

/// Removes a tree that may hold read-only directories (an unpacked layer keeps its modes).
/// Only directories' modes are ever changed, never files' (a staged filesystem image
/// hard-links the layers' files).
pub(crate) fn remove_tree(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if fs::symlink_metadata(path).is_ok_and(|m| !m.is_dir()) {
        return fs::remove_file(path).map_err(|e| ImageError::io("remove", path, e));
    }
    if fs::remove_dir_all(path).is_ok() || !path.exists() {
        return Ok(());
    }
    // Each directory is opened up before it is read: one without read or search permission
    // (mode 0, 0o300) hides its children from a user other than root until then.
    let mut dirs = vec![path.to_path_buf()];
    let mut i = 0;
    while i < dirs.len() {
        let _ = fs::set_permissions(&dirs[i], fs::Permissions::from_mode(0o700));
        if let Ok(rd) = fs::read_dir(&dirs[i]) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(e.path());
                }
            }
        }
        i += 1;
    }
    fs::remove_dir_all(path).map_err(|e| ImageError::io("remove", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A layer's directories keep their modes, unreadable and unsearchable ones included:
    /// removal opens each before reading it (what matters for a user other than root, whom
    /// the modes bind).
    #[test]
    fn a_tree_with_closed_directories_is_removed() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("layer");
        let closed = root.join("closed");
        let inner = closed.join("read-only");
        fs::create_dir_all(&inner).unwrap();
        fs::write(inner.join("file"), b"x").unwrap();
        fs::set_permissions(&inner, fs::Permissions::from_mode(0o555)).unwrap();
        fs::set_permissions(&closed, fs::Permissions::from_mode(0o000)).unwrap();
        remove_tree(&root).unwrap();
        assert!(!root.exists());
    }
}
