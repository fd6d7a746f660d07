//! The file API and workspace snapshots, done from the host through `/proc/<init>/root`,
//! without ever following a path out of the workspace. The fd-relative helpers are shared
//! with the other tiers ([`sandbox_core::beneath`], [`sandbox_core::fsnap::pack_fd`]):
//!
//! - every lookup is `openat2(workspace_fd, rel, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`:
//!   `..` or a symlink (absolute or relative) that leaves the workspace fails with `EXDEV`,
//!   reported as [`Error::PathEscape`];
//! - the snapshot walk opens one name at a time relative to a directory fd with
//!   `O_NOFOLLOW`, so a symlink swapped in during the walk is recorded as a link, never
//!   followed (a path-based walk through `/proc/<pid>/root` would resolve absolute links
//!   against the *host* root);
//! - no size a file states is allocated: reads are capped (`limits.disk_bytes`), snapshots
//!   stream each file's data, keep sparse files sparse and are capped too.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use sandbox_core::beneath::{self, fchown, map_err, mkdirs, open_beneath};
pub(crate) use sandbox_core::beneath::{FsIds, Owner};
use sandbox_core::fsnap::{self, PackOptions, OPAQUE_PAX};
use sandbox_core::{DirEntry, Error, Result};

fn cstr(s: &[u8]) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid("path", "paths cannot contain NUL"))
}

fn last_err() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Writes a file beneath the workspace fd, creating parents.
pub(crate) fn write_file(
    ws: BorrowedFd<'_>,
    path: &str,
    data: &[u8],
    owner: Option<Owner>,
) -> Result<()> {
    beneath::write_file(ws, path, data, owner)
}

/// Reads a regular file beneath the workspace fd, refusing one over `max` bytes.
pub(crate) fn read_file(ws: BorrowedFd<'_>, path: &str, max: u64) -> Result<Vec<u8>> {
    beneath::read_file(ws, path, max)
}

/// Lists a workspace directory.
pub(crate) fn list(ws: BorrowedFd<'_>, path: &str) -> Result<Vec<DirEntry>> {
    beneath::list(ws, path)
}

/// Packs the workspace (fd) into a tar archive, one `O_NOFOLLOW` name at a time, holding
/// at most `max_bytes` of file data.
pub(crate) fn pack(ws: BorrowedFd<'_>, max_bytes: u64) -> Result<Vec<u8>> {
    fsnap::pack_fd(ws, PackOptions::default().max_bytes(max_bytes))
}

/// Packs an overlay upper layer (fd): like [`pack`], plus whiteouts (0/0 character devices:
/// files deleted from the lower layer) and opaque directories (`user.overlay.opaque`).
pub(crate) fn pack_upper(upper: BorrowedFd<'_>, max_bytes: u64) -> Result<Vec<u8>> {
    fsnap::pack_fd(
        upper,
        PackOptions::default().overlay(true).max_bytes(max_bytes),
    )
}

/// Unpacks an archive made by [`pack`] into an empty workspace (fd), refusing any entry
/// that would leave it, and any device/FIFO entry.
pub(crate) fn unpack(ws: BorrowedFd<'_>, archive: &[u8], owner: Option<Owner>) -> Result<()> {
    unpack_tree(ws, archive, owner, false)
}

/// Unpacks an archive made by [`pack_upper`] into an empty, not yet mounted overlay upper
/// layer (fd): also whiteouts and opaque directories.
pub(crate) fn unpack_upper(
    upper: BorrowedFd<'_>,
    archive: &[u8],
    owner: Option<Owner>,
) -> Result<()> {
    unpack_tree(upper, archive, owner, true)
}

fn unpack_tree(
    ws: BorrowedFd<'_>,
    archive: &[u8],
    owner: Option<Owner>,
    overlay: bool,
) -> Result<()> {
    let mut a = tar::Archive::new(archive);
    let entries = a
        .entries()
        .map_err(|e| Error::io("read snapshot archive", e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| Error::io("read snapshot archive", e))?;
        let path = entry
            .path()
            .map_err(|e| Error::io("read snapshot archive", e))?
            .into_owned();
        let shown = format!("/workspace/{}", path.display());
        if path
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
            || path.as_os_str().is_empty()
        {
            return Err(Error::PathEscape { path: shown });
        }
        let parent = path.parent().unwrap_or(Path::new(""));
        let name = cstr(path.file_name().unwrap_or(OsStr::new("")).as_bytes())?;
        let dir = mkdirs(ws, parent, owner, &shown)?;
        let mode = entry.header().mode().unwrap_or(0o644) & 0o1777;
        let kind = entry.header().entry_type();
        let opaque = overlay
            && entry.pax_extensions().ok().flatten().is_some_and(|mut x| {
                x.any(|e| e.is_ok_and(|e| e.key_bytes() == OPAQUE_PAX.as_bytes()))
            });
        let whiteout = overlay
            && kind.is_character_special()
            && entry.header().device_major().ok().flatten() == Some(0)
            && entry.header().device_minor().ok().flatten() == Some(0);
        if whiteout {
            // SAFETY: mknodat of a 0/0 character device (a whiteout, allowed without
            // CAP_MKNOD) relative to our dir fd.
            if unsafe { libc::mknodat(dir.as_raw_fd(), name.as_ptr(), libc::S_IFCHR, 0) } < 0 {
                return Err(map_err(last_err(), &shown, "create whiteout"));
            }
            if let Some(o) = owner {
                // SAFETY: fchownat on the new node itself.
                unsafe {
                    libc::fchownat(
                        dir.as_raw_fd(),
                        name.as_ptr(),
                        o.uid,
                        o.gid,
                        libc::AT_SYMLINK_NOFOLLOW,
                    )
                };
            }
        } else if kind.is_dir() {
            // SAFETY: mkdirat relative to our dir fd.
            if unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) } < 0
                && last_err().raw_os_error() != Some(libc::EEXIST)
            {
                return Err(map_err(last_err(), &shown, "mkdir"));
            }
            let d = open_beneath(
                dir.as_fd(),
                Path::new(OsStr::from_bytes(name.to_bytes())),
                libc::O_RDONLY | libc::O_DIRECTORY,
                0,
            )
            .map_err(|e| map_err(e, &shown, "open"))?;
            fchown(d.as_fd(), owner).map_err(|e| map_err(e, &shown, "chown"))?;
            if opaque {
                // SAFETY: fsetxattr on our dir fd with a live 1-byte value.
                let r = unsafe {
                    libc::fsetxattr(
                        d.as_raw_fd(),
                        c"user.overlay.opaque".as_ptr(),
                        b"y".as_ptr().cast(),
                        1,
                        0,
                    )
                };
                if r < 0 {
                    return Err(map_err(last_err(), &shown, "mark opaque"));
                }
            }
        } else if kind.is_file() || kind.is_gnu_sparse() {
            // SAFETY: openat of one new name relative to our dir fd (O_EXCL: never an existing link).
            let fd = unsafe {
                libc::openat(
                    dir.as_raw_fd(),
                    name.as_ptr(),
                    libc::O_WRONLY
                        | libc::O_CREAT
                        | libc::O_EXCL
                        | libc::O_NOFOLLOW
                        | libc::O_CLOEXEC,
                    mode,
                )
            };
            if fd < 0 {
                return Err(map_err(last_err(), &shown, "create"));
            }
            // SAFETY: we own the new fd.
            let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            // A sparse file's holes stay holes: its data alone are written.
            fsnap::write_entry_data(archive, &mut entry, &mut f)
                .map_err(|e| map_err(e, &shown, "write"))?;
            fchown(f.as_fd(), owner).map_err(|e| map_err(e, &shown, "chown"))?;
            // SAFETY: fchmod on our fd (umask may have trimmed the mode).
            unsafe { libc::fchmod(f.as_raw_fd(), mode) };
        } else if kind.is_symlink() {
            let target = entry.link_name().ok().flatten().ok_or_else(|| {
                Error::invalid("snapshot", format!("{shown}: symlink without target"))
            })?;
            let t = cstr(target.as_os_str().as_bytes())?;
            // SAFETY: symlinkat relative to our dir fd.
            if unsafe { libc::symlinkat(t.as_ptr(), dir.as_raw_fd(), name.as_ptr()) } < 0 {
                return Err(map_err(last_err(), &shown, "symlink"));
            }
            if let Some(o) = owner {
                // SAFETY: fchownat on the link itself.
                unsafe {
                    libc::fchownat(
                        dir.as_raw_fd(),
                        name.as_ptr(),
                        o.uid,
                        o.gid,
                        libc::AT_SYMLINK_NOFOLLOW,
                    )
                };
            }
        } else {
            return Err(Error::invalid(
                "snapshot",
                format!("archive holds a {kind:?} entry at {shown}"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws() -> (tempfile::TempDir, OwnedFd) {
        let d = tempfile::tempdir().unwrap();
        let f = File::open(d.path()).unwrap();
        (d, OwnedFd::from(f))
    }

    #[test]
    fn write_read_list_and_escapes() {
        let (d, fd) = ws();
        let fd = fd.as_fd();
        write_file(fd, "a/b/c.txt", b"hi", None).unwrap();
        assert_eq!(
            read_file(fd, "/workspace/a/b/c.txt", 1 << 20).unwrap(),
            b"hi"
        );
        let l = list(fd, "a").unwrap();
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].kind, sandbox_core::EntryKind::Dir);
        std::os::unix::fs::symlink("/etc", d.path().join("out")).unwrap();
        std::os::unix::fs::symlink("../../..", d.path().join("a/up")).unwrap();
        assert!(matches!(
            read_file(fd, "out/passwd", 1 << 20),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(
            read_file(fd, "a/up/etc/passwd", 1 << 20),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(
            write_file(fd, "out/x", b"", None),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(
            read_file(fd, "../x", 1 << 20),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(
            read_file(fd, "nope", 1 << 20),
            Err(Error::NotFound { .. })
        ));
        // A link that stays inside is fine.
        std::os::unix::fs::symlink("b/c.txt", d.path().join("a/in")).unwrap();
        assert_eq!(read_file(fd, "a/in", 1 << 20).unwrap(), b"hi");
    }

    #[test]
    fn pack_unpack_round_trip_keeps_links_as_links() {
        let (d, fd) = ws();
        write_file(fd.as_fd(), "x/y.txt", b"data", None).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", d.path().join("x/host")).unwrap();
        let tar = pack(fd.as_fd(), u64::MAX).unwrap();
        let (d2, fd2) = ws();
        unpack(fd2.as_fd(), &tar, None).unwrap();
        assert_eq!(std::fs::read(d2.path().join("x/y.txt")).unwrap(), b"data");
        assert_eq!(
            std::fs::read_link(d2.path().join("x/host")).unwrap(),
            Path::new("/etc/passwd")
        );
        // And the packer never followed it.
        assert!(!String::from_utf8_lossy(&tar).contains("root:x:0:0"));
    }

    #[test]
    fn sparse_files_stay_sparse_through_pack_and_unpack() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let (d, fd) = ws();
        let f = File::create(d.path().join("big")).unwrap();
        f.set_len(1 << 40).unwrap();
        f.write_all_at(b"middle", 1 << 30).unwrap();
        drop(f);
        let tar = pack(fd.as_fd(), 1 << 20).unwrap();
        assert!(tar.len() < 1 << 20, "{} bytes", tar.len());
        let (d2, fd2) = ws();
        unpack(fd2.as_fd(), &tar, None).unwrap();
        let md = std::fs::metadata(d2.path().join("big")).unwrap();
        assert_eq!(md.len(), 1 << 40);
        assert!(md.blocks() * 512 < 1 << 20, "{} blocks", md.blocks());
        let mut buf = [0u8; 6];
        File::open(d2.path().join("big"))
            .unwrap()
            .read_exact_at(&mut buf, 1 << 30)
            .unwrap();
        assert_eq!(&buf, b"middle");
        // Data over the cap: refused, naming the limit.
        write_file(fd.as_fd(), "dense", &[1u8; 8192], None).unwrap();
        let e = pack(fd.as_fd(), 4096).unwrap_err();
        assert!(
            matches!(e, Error::ResourceExhausted { .. }) && e.to_string().contains("disk_bytes"),
            "{e}"
        );
    }
}
