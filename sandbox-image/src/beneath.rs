//! Directories reached without following any symlink, for the passes that set a directory's
//! mode, owner and times after everything else is written (unpacking a layer, merging layers
//! into a filesystem image's stage).
//!
//! Those passes run from a list made earlier; by then a later entry may have replaced the
//! directory, or one of its parents, with a symlink to anywhere on the host. A path-based
//! `chmod`/`chown`/`utimes` would follow it, as root. Here each component is opened relative
//! to the one before with `O_NOFOLLOW | O_DIRECTORY`, and the attributes are set on the open
//! handle (`fchmod`, `fchown`, `futimens`): what is changed is the directory that the walk
//! reached inside the root, or nothing.
//!
//! Why not `sandbox_core::beneath` (the workspace file API's `openat2(RESOLVE_BENEATH)`): a
//! sandbox's own paths may go through its own links that stay inside; a layer's recorded
//! directory must be reached through no link at all, inside or not.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

/// Attributes to give a directory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DirAttrs {
    /// Permission bits (and sticky/set-id bits as the caller allows).
    pub mode: u32,
    /// Owner and group, set only when given (root).
    pub owner: Option<(u32, u32)>,
    /// Access and modification time.
    pub mtime: filetime::FileTime,
}

/// Opens the directory `rel` (plain components only) beneath `root`, following no symlink.
///
/// `Ok(None)` when what is there now is not a directory reached through directories: a
/// component is missing, a symlink, or another kind of file (a later entry replaced it).
///
/// # Errors
/// `rel` has a component other than a plain name, or an open fails for another reason.
pub(crate) fn open_dir(root: &Path, rel: &Path) -> io::Result<Option<fs::File>> {
    let mut fd: OwnedFd = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(root)?
        .into();
    for c in rel.components() {
        let name: &OsStr = match c {
            Component::Normal(n) => n,
            Component::CurDir => continue,
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "`{}` is not a plain name",
                        other.as_os_str().to_string_lossy()
                    ),
                ))
            }
        };
        match nix::fcntl::openat(
            &fd,
            name,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(next) => fd = next,
            Err(
                nix::errno::Errno::ELOOP | nix::errno::Errno::ENOTDIR | nix::errno::Errno::ENOENT,
            ) => return Ok(None),
            Err(e) => return Err(io::Error::from(e)),
        }
    }
    Ok(Some(fs::File::from(fd)))
}

/// Gives the directory `rel` beneath `root` the attributes `a`, through a handle reached
/// without following a symlink. Returns whether it was there to change.
///
/// # Errors
/// As [`open_dir`], or setting an attribute fails.
pub(crate) fn set_dir_attrs(root: &Path, rel: &Path, a: DirAttrs) -> io::Result<bool> {
    let Some(dir) = open_dir(root, rel)? else {
        return Ok(false);
    };
    if let Some((uid, gid)) = a.owner {
        std::os::unix::fs::fchown(&dir, Some(uid), Some(gid))?;
    }
    dir.set_permissions(fs::Permissions::from_mode(a.mode))?;
    filetime::set_file_handle_times(&dir, Some(a.mtime), Some(a.mtime))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn attrs(mode: u32) -> DirAttrs {
        DirAttrs {
            mode,
            owner: None,
            mtime: filetime::FileTime::from_unix_time(1_000_000, 0),
        }
    }

    #[test]
    fn a_symlink_anywhere_on_the_way_stops_the_change() {
        let t = tempfile::tempdir().unwrap();
        let (root, outside) = (t.path().join("root"), t.path().join("outside"));
        fs::create_dir_all(root.join("real/sub")).unwrap();
        fs::create_dir_all(outside.join("sub")).unwrap();
        fs::set_permissions(outside.join("sub"), fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        std::os::unix::fs::symlink(outside.join("sub"), root.join("last")).unwrap();
        fs::write(root.join("file"), "").unwrap();

        assert!(set_dir_attrs(&root, Path::new("real/sub"), attrs(0o751)).unwrap());
        let m = fs::metadata(root.join("real/sub")).unwrap();
        assert_eq!((m.mode() & 0o7777, m.mtime()), (0o751, 1_000_000));
        // Through a symlinked parent, at a symlink, through a file, missing: nothing changes.
        for rel in ["link/sub", "last", "file/x", "file", "missing/sub"] {
            assert!(
                !set_dir_attrs(&root, Path::new(rel), attrs(0o777)).unwrap(),
                "{rel}"
            );
        }
        let m = fs::metadata(outside.join("sub")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o700);
        assert!(set_dir_attrs(&root, Path::new("../outside"), attrs(0o777)).is_err());
    }
}
