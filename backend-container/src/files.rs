//! The file API and workspace snapshots, done from the host through `/proc/<init>/root`,
//! without ever following a path out of the workspace:
//!
//! - every lookup is `openat2(workspace_fd, rel, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`:
//!   `..` or a symlink (absolute or relative) that leaves the workspace fails with `EXDEV`,
//!   reported as [`Error::PathEscape`];
//! - the snapshot walk opens one name at a time relative to a directory fd with
//!   `O_NOFOLLOW`, so a symlink swapped in during the walk is recorded as a link, never
//!   followed (a path-based walk through `/proc/<pid>/root` would resolve absolute links
//!   against the *host* root).

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use sandbox_core::{DirEntry, EntryKind, Error, Result, WorkspacePath};

/// Who new files belong to, as host ids (`None`: leave as created).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// Switches the calling thread's filesystem uid/gid (they are per thread) for the life of
/// the guard, so files are created as the sandbox user: the host's root is not mapped in the
/// sandbox's user namespace and could not create inodes on its filesystems (`EOVERFLOW`).
/// Holders must not await while it lives.
pub(crate) struct FsIds {
    saved: Option<(u32, u32)>,
}

impl FsIds {
    pub(crate) fn switch(o: Option<Owner>) -> FsIds {
        let Some(o) = o else {
            return FsIds { saved: None };
        };
        // SAFETY: setfsuid/setfsgid only change this thread's filesystem ids; they return
        // the previous value.
        let saved = unsafe {
            let g = libc::syscall(libc::SYS_setfsgid, o.gid) as u32;
            let u = libc::syscall(libc::SYS_setfsuid, o.uid) as u32;
            (u, g)
        };
        FsIds { saved: Some(saved) }
    }
}

impl Drop for FsIds {
    fn drop(&mut self) {
        if let Some((u, g)) = self.saved {
            // SAFETY: restores this thread's previous filesystem ids.
            unsafe {
                libc::syscall(libc::SYS_setfsuid, u);
                libc::syscall(libc::SYS_setfsgid, g);
            }
        }
    }
}

fn cstr(s: &[u8]) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid("path", "paths cannot contain NUL"))
}

fn last_err() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn map_err(e: std::io::Error, shown: &str, op: &str) -> Error {
    match e.raw_os_error() {
        Some(libc::EXDEV) | Some(libc::ELOOP) => Error::PathEscape {
            path: shown.to_string(),
        },
        Some(libc::ENOENT) => Error::NotFound {
            path: shown.to_string(),
        },
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => Error::ResourceExhausted {
            what: format!("workspace disk space (limits.disk_bytes) while writing {shown}"),
        },
        _ => Error::io(format!("{op} {shown}"), e),
    }
}

/// `openat2(dir, rel, flags, mode, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`.
pub(crate) fn open_beneath(
    dir: RawFd,
    rel: &Path,
    flags: i32,
    mode: u32,
) -> std::io::Result<OwnedFd> {
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let c = CString::new(rel.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: open_how is a plain struct; zeroed is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.mode = if flags & libc::O_CREAT != 0 {
        u64::from(mode)
    } else {
        0
    };
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    loop {
        // SAFETY: openat2 with a valid path and struct of the stated size.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir,
                c.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if fd >= 0 {
            // SAFETY: we own the new fd.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
        }
        let e = last_err();
        if e.raw_os_error() != Some(libc::EAGAIN) && e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

fn fchown(fd: RawFd, o: Option<Owner>) -> std::io::Result<()> {
    if let Some(o) = o {
        // SAFETY: fchown on an fd we own.
        if unsafe { libc::fchown(fd, o.uid, o.gid) } < 0 {
            return Err(last_err());
        }
    }
    Ok(())
}

/// Opens (creating as needed) the directory `rel` beneath `ws`.
fn mkdirs(ws: RawFd, rel: &Path, owner: Option<Owner>, shown: &str) -> Result<OwnedFd> {
    let mut cur = open_beneath(ws, Path::new("."), libc::O_PATH | libc::O_DIRECTORY, 0)
        .map_err(|e| map_err(e, shown, "open"))?;
    for c in rel.components() {
        let Component::Normal(name) = c else {
            return Err(Error::PathEscape { path: shown.into() });
        };
        let cname = cstr(name.as_bytes())?;
        // SAFETY: mkdirat relative to a directory fd we own; never follows a final symlink.
        let r = unsafe { libc::mkdirat(cur.as_raw_fd(), cname.as_ptr(), 0o755) };
        let created = r == 0;
        if r < 0 && last_err().raw_os_error() != Some(libc::EEXIST) {
            return Err(map_err(last_err(), shown, "mkdir"));
        }
        let next = open_beneath(
            cur.as_raw_fd(),
            Path::new(name),
            libc::O_RDONLY | libc::O_DIRECTORY,
            0,
        )
        .map_err(|e| map_err(e, shown, "open"))?;
        if created {
            fchown(next.as_raw_fd(), owner).map_err(|e| map_err(e, shown, "chown"))?;
        }
        cur = next;
    }
    Ok(cur)
}

/// Writes a file beneath the workspace fd, creating parents.
pub(crate) fn write_file(ws: RawFd, path: &str, data: &[u8], owner: Option<Owner>) -> Result<()> {
    let wp = WorkspacePath::parse(path)?;
    if wp.is_root() {
        return Err(Error::invalid("path", "the workspace root is a directory"));
    }
    let rel = wp.relative();
    let shown = wp.in_sandbox();
    let parent = rel.parent().unwrap_or(Path::new(""));
    let name = rel.file_name().unwrap_or(OsStr::new(""));
    let dir = mkdirs(ws, parent, owner, &shown)?;
    let fd = open_beneath(
        dir.as_raw_fd(),
        Path::new(name),
        libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_NONBLOCK,
        0o644,
    )
    .map_err(|e| map_err(e, &shown, "open"))?;
    let mut f = File::from(fd);
    let md = f.metadata().map_err(|e| map_err(e, &shown, "stat"))?;
    if !md.is_file() {
        return Err(Error::invalid(
            "path",
            format!("{shown} is not a regular file"),
        ));
    }
    fchown(f.as_raw_fd(), owner).map_err(|e| map_err(e, &shown, "chown"))?;
    f.write_all(data).map_err(|e| map_err(e, &shown, "write"))
}

/// Reads a regular file beneath the workspace fd.
pub(crate) fn read_file(ws: RawFd, path: &str) -> Result<Vec<u8>> {
    let wp = WorkspacePath::parse(path)?;
    let shown = wp.in_sandbox();
    let fd = open_beneath(ws, &wp.relative(), libc::O_RDONLY | libc::O_NONBLOCK, 0)
        .map_err(|e| map_err(e, &shown, "open"))?;
    let mut f = File::from(fd);
    let md = f.metadata().map_err(|e| map_err(e, &shown, "stat"))?;
    if !md.is_file() {
        return Err(Error::invalid(
            "path",
            format!("{shown} is not a regular file"),
        ));
    }
    let mut out = Vec::with_capacity(usize::try_from(md.len()).unwrap_or(0).min(64 << 20));
    f.read_to_end(&mut out)
        .map_err(|e| map_err(e, &shown, "read"))?;
    Ok(out)
}

fn kind_of(mode: u32) -> EntryKind {
    match mode & libc::S_IFMT {
        libc::S_IFREG => EntryKind::File,
        libc::S_IFDIR => EntryKind::Dir,
        libc::S_IFLNK => EntryKind::Symlink,
        _ => EntryKind::Other,
    }
}

fn lstat_at(dir: RawFd, name: &CString) -> std::io::Result<libc::stat> {
    // SAFETY: zeroed stat is valid; fstatat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat relative to a directory fd, not following symlinks.
    if unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } < 0 {
        return Err(last_err());
    }
    Ok(st)
}

/// Names in a directory fd (without `.` and `..`).
fn names(dir: &OwnedFd) -> std::io::Result<Vec<CString>> {
    let dup = dir.try_clone()?;
    let mut d = nix::dir::Dir::from_fd(dup).map_err(std::io::Error::from)?;
    let mut out = Vec::new();
    for e in d.iter() {
        let e = e.map_err(std::io::Error::from)?;
        let n = e.file_name();
        if n.to_bytes() == b"." || n.to_bytes() == b".." {
            continue;
        }
        out.push(n.to_owned());
    }
    Ok(out)
}

/// Lists a workspace directory.
pub(crate) fn list(ws: RawFd, path: &str) -> Result<Vec<DirEntry>> {
    let wp = WorkspacePath::parse(path)?;
    let shown = wp.in_sandbox();
    let dir = open_beneath(ws, &wp.relative(), libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .map_err(|e| map_err(e, &shown, "open"))?;
    let mut out = Vec::new();
    for n in names(&dir).map_err(|e| map_err(e, &shown, "list"))? {
        let Ok(st) = lstat_at(dir.as_raw_fd(), &n) else {
            continue;
        };
        out.push(DirEntry::new(
            String::from_utf8_lossy(n.to_bytes()),
            kind_of(st.st_mode),
            u64::try_from(st.st_size).unwrap_or(0),
        ));
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The xattr overlayfs (mounted with `userxattr`) marks an opaque upper directory with.
const OPAQUE_XATTR: &str = "user.overlay.opaque";
/// The same, as a PAX record of the snapshot archive.
const OPAQUE_PAX: &str = "SCHILY.xattr.user.overlay.opaque";

/// Packs the workspace (fd) into a tar archive, one `O_NOFOLLOW` name at a time.
pub(crate) fn pack(ws: RawFd) -> Result<Vec<u8>> {
    pack_tree(ws, false)
}

/// Packs an overlay upper layer (fd): like [`pack`], plus whiteouts (0/0 character devices:
/// files deleted from the lower layer) and opaque directories (`user.overlay.opaque`).
pub(crate) fn pack_upper(upper: RawFd) -> Result<Vec<u8>> {
    pack_tree(upper, true)
}

fn pack_tree(ws: RawFd, overlay: bool) -> Result<Vec<u8>> {
    let root = open_beneath(ws, Path::new("."), libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .map_err(|e| Error::io("open workspace", e))?;
    let mut b = tar::Builder::new(Vec::new());
    pack_dir(&mut b, &root, Path::new(""), 0, overlay)?;
    b.into_inner()
        .map_err(|e| Error::io("finish snapshot archive", e))
}

fn header(st: &libc::stat, kind: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(st.st_mode & 0o7777);
    h.set_size(size);
    h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    h.set_uid(0);
    h.set_gid(0);
    h
}

fn is_opaque(dir: RawFd) -> bool {
    let mut v = [0u8; 4];
    let name = c"user.overlay.opaque";
    debug_assert_eq!(name.to_bytes(), OPAQUE_XATTR.as_bytes());
    // SAFETY: fgetxattr into a local buffer of the stated size.
    let n = unsafe { libc::fgetxattr(dir, name.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
    n == 1 && v[0] == b'y'
}

fn pack_dir(
    b: &mut tar::Builder<Vec<u8>>,
    dir: &OwnedFd,
    prefix: &Path,
    depth: u32,
    overlay: bool,
) -> Result<()> {
    if depth > 256 {
        return Err(Error::invalid(
            "workspace",
            "directory tree deeper than 256 levels",
        ));
    }
    let shown = || format!("/workspace/{}", prefix.display());
    let mut entries = names(dir).map_err(|e| Error::io(format!("list {}", shown()), e))?;
    entries.sort();
    for n in entries {
        let Ok(st) = lstat_at(dir.as_raw_fd(), &n) else {
            continue;
        };
        let rel = prefix.join(OsStr::from_bytes(n.to_bytes()));
        let io = |e| Error::io(format!("snapshot /workspace/{}", rel.display()), e);
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                // SAFETY: openat of one name relative to our dir fd, refusing symlinks.
                let fd = unsafe {
                    libc::openat(
                        dir.as_raw_fd(),
                        n.as_ptr(),
                        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                    )
                };
                if fd < 0 {
                    continue; // replaced meanwhile
                }
                // SAFETY: we own the new fd.
                let sub = unsafe { OwnedFd::from_raw_fd(fd) };
                if overlay && is_opaque(sub.as_raw_fd()) {
                    b.append_pax_extensions([(OPAQUE_PAX, &b"y"[..])])
                        .map_err(io)?;
                }
                let mut h = header(&st, tar::EntryType::Directory, 0);
                b.append_data(&mut h, &rel, std::io::empty()).map_err(io)?;
                pack_dir(b, &sub, &rel, depth + 1, overlay)?;
            }
            libc::S_IFCHR if overlay && st.st_rdev == 0 => {
                // A whiteout: the name was deleted from the lower layer.
                let mut h = header(&st, tar::EntryType::Char, 0);
                h.set_device_major(0).map_err(io)?;
                h.set_device_minor(0).map_err(io)?;
                b.append_data(&mut h, &rel, std::io::empty()).map_err(io)?;
            }
            libc::S_IFREG => {
                // SAFETY: as above, for a regular file; O_NONBLOCK so a swapped-in FIFO cannot hang us.
                let fd = unsafe {
                    libc::openat(
                        dir.as_raw_fd(),
                        n.as_ptr(),
                        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
                    )
                };
                if fd < 0 {
                    continue;
                }
                // SAFETY: we own the new fd.
                let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
                let md = f.metadata().map_err(io)?;
                if !md.is_file() {
                    continue;
                }
                let size = md.len();
                let mut data = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
                f.take(size).read_to_end(&mut data).map_err(io)?;
                data.resize(usize::try_from(size).unwrap_or(0), 0);
                let mut h = header(&st, tar::EntryType::Regular, size);
                b.append_data(&mut h, &rel, data.as_slice()).map_err(io)?;
            }
            libc::S_IFLNK => {
                let mut buf = vec![0u8; 4096];
                // SAFETY: readlinkat into our buffer.
                let len = unsafe {
                    libc::readlinkat(
                        dir.as_raw_fd(),
                        n.as_ptr(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                    )
                };
                if len < 0 {
                    continue;
                }
                buf.truncate(len as usize);
                let mut h = header(&st, tar::EntryType::Symlink, 0);
                b.append_link(&mut h, &rel, Path::new(OsStr::from_bytes(&buf)))
                    .map_err(io)?;
            }
            _ => {} // sockets, FIFOs, devices: not snapshotted
        }
    }
    Ok(())
}

/// Unpacks an archive made by [`pack`] into an empty workspace (fd), refusing any entry
/// that would leave it, and any device/FIFO entry.
pub(crate) fn unpack(ws: RawFd, archive: &[u8], owner: Option<Owner>) -> Result<()> {
    unpack_tree(ws, archive, owner, false)
}

/// Unpacks an archive made by [`pack_upper`] into an empty, not yet mounted overlay upper
/// layer (fd): also whiteouts and opaque directories.
pub(crate) fn unpack_upper(upper: RawFd, archive: &[u8], owner: Option<Owner>) -> Result<()> {
    unpack_tree(upper, archive, owner, true)
}

fn unpack_tree(ws: RawFd, archive: &[u8], owner: Option<Owner>, overlay: bool) -> Result<()> {
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
                dir.as_raw_fd(),
                Path::new(OsStr::from_bytes(name.to_bytes())),
                libc::O_RDONLY | libc::O_DIRECTORY,
                0,
            )
            .map_err(|e| map_err(e, &shown, "open"))?;
            fchown(d.as_raw_fd(), owner).map_err(|e| map_err(e, &shown, "chown"))?;
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
        } else if kind.is_file() {
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
            std::io::copy(&mut entry, &mut f).map_err(|e| map_err(e, &shown, "write"))?;
            fchown(f.as_raw_fd(), owner).map_err(|e| map_err(e, &shown, "chown"))?;
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
        write_file(fd.as_raw_fd(), "a/b/c.txt", b"hi", None).unwrap();
        assert_eq!(
            read_file(fd.as_raw_fd(), "/workspace/a/b/c.txt").unwrap(),
            b"hi"
        );
        let l = list(fd.as_raw_fd(), "a").unwrap();
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].kind, EntryKind::Dir);
        std::os::unix::fs::symlink("/etc", d.path().join("out")).unwrap();
        std::os::unix::fs::symlink("../../..", d.path().join("a/up")).unwrap();
        assert!(matches!(
            read_file(fd.as_raw_fd(), "out/passwd"),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(
            read_file(fd.as_raw_fd(), "a/up/etc/passwd"),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(
            write_file(fd.as_raw_fd(), "out/x", b"", None),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(
            read_file(fd.as_raw_fd(), "../x"),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(
            read_file(fd.as_raw_fd(), "nope"),
            Err(Error::NotFound { .. })
        ));
        // A link that stays inside is fine.
        std::os::unix::fs::symlink("b/c.txt", d.path().join("a/in")).unwrap();
        assert_eq!(read_file(fd.as_raw_fd(), "a/in").unwrap(), b"hi");
    }

    #[test]
    fn pack_unpack_round_trip_keeps_links_as_links() {
        let (d, fd) = ws();
        write_file(fd.as_raw_fd(), "x/y.txt", b"data", None).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", d.path().join("x/host")).unwrap();
        let tar = pack(fd.as_raw_fd()).unwrap();
        let (d2, fd2) = ws();
        unpack(fd2.as_raw_fd(), &tar, None).unwrap();
        assert_eq!(std::fs::read(d2.path().join("x/y.txt")).unwrap(), b"data");
        assert_eq!(
            std::fs::read_link(d2.path().join("x/host")).unwrap(),
            Path::new("/etc/passwd")
        );
        // And the packer never followed it.
        assert!(!String::from_utf8_lossy(&tar).contains("root:x:0:0"));
    }
}
