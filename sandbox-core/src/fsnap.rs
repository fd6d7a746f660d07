//! Filesystem snapshots shared by backends: a directory tree packed as a tar archive, and
//! unpacked only into a fresh directory, refusing entries that would leave it.

use std::path::Path;

use crate::error::{Error, Result};

/// Packs `dir` (recursively, symlinks kept as links, not followed) into a tar archive.
pub fn pack_dir(dir: &Path) -> Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Deterministic);
    b.append_dir_all(".", dir)
        .map_err(|e| Error::io_path("pack", dir, e))?;
    b.into_inner().map_err(|e| Error::io_path("pack", dir, e))
}

/// Unpacks an archive made by [`pack_dir`] into `dir`, which must exist and be empty.
/// Entries with absolute paths or `..` are refused (the `tar` crate never writes outside
/// the destination); device nodes are refused too.
pub fn unpack_into(archive: &[u8], dir: &Path) -> Result<()> {
    let mut a = tar::Archive::new(archive);
    a.set_preserve_permissions(true);
    a.set_overwrite(false);
    let entries = a
        .entries()
        .map_err(|e| Error::io_path("read archive for", dir, e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| Error::io_path("read archive for", dir, e))?;
        let kind = entry.header().entry_type();
        if !(kind.is_file() || kind.is_dir() || kind.is_symlink()) {
            return Err(Error::invalid(
                "snapshot",
                format!("archive holds a {kind:?} entry"),
            ));
        }
        let ok = entry
            .unpack_in(dir)
            .map_err(|e| Error::io_path("unpack into", dir, e))?;
        if !ok {
            let p = entry
                .path()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            return Err(Error::PathEscape { path: p });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_files_and_links() {
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("a/b")).unwrap();
        std::fs::write(src.path().join("a/b/f.txt"), "hello").unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink("b/f.txt", src.path().join("a/link")).unwrap();
        let tar = pack_dir(src.path()).unwrap();
        let dst = tempfile::tempdir().unwrap();
        unpack_into(&tar, dst.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(dst.path().join("a/b/f.txt")).unwrap(),
            "hello"
        );
        #[cfg(unix)]
        assert_eq!(
            std::fs::read_to_string(dst.path().join("a/link")).unwrap(),
            "hello"
        );
    }

    #[test]
    fn hostile_archive_is_refused() {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_entry_type(tar::EntryType::Regular);
        // Write the raw name bytes: the builder would refuse `..` itself.
        h.as_old_mut().name[..9].copy_from_slice(b"../escape");
        h.set_cksum();
        b.append(&h, &b"x"[..]).unwrap();
        let bytes = b.into_inner().unwrap();
        let dst = tempfile::tempdir().unwrap();
        assert!(unpack_into(&bytes, dst.path()).is_err());
        assert!(!dst.path().parent().unwrap().join("escape").exists());
    }
}
