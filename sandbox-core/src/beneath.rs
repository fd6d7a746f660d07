//! Host-side file access beneath a directory handle, for backends whose workspace (or any
//! folder the sandbox can write) is a directory on the host.
//!
//! Code in the sandbox can change that folder at any moment: swap a file for a symlink to
//! `/etc/shadow`, a directory for a link to `/`. A check on a path followed by a second
//! lookup of the same path (`canonicalize`, then `open`) loses that race, and the host side
//! runs as root. Everything here therefore works on handles:
//!
//! - every lookup is `openat2(dir_fd, rel, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: `..`
//!   or a symlink (absolute or relative) that leaves `dir_fd` fails with `EXDEV`, reported as
//!   [`Error::PathEscape`]; links that stay inside are followed;
//! - missing parents are made one name at a time with `mkdirat` relative to the directory
//!   reached so far, then opened beneath it;
//! - data, owner and type are read and set on the opened handle (`fstat`, `fchown`,
//!   `read`/`write`), never by path again;
//! - what one [`read_file`] returns is capped: the size a file claims (`st_size`, which a
//!   sandbox sets at will with `truncate -s 1T`) is never used to allocate, and a file over
//!   the cap is refused before a byte is read.
//!
//! [`FsIds`] switches the calling thread's filesystem ids, for backends whose host root
//! cannot create files where the sandbox's user can (an unmapped root in a user namespace).
//!
//! The snapshot walk that goes with these ([`fsnap::pack_fd`](crate::fsnap::pack_fd)) opens
//! one name at a time with `O_NOFOLLOW` for the same reason.

use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io::Read;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use crate::error::{Error, Result};
use crate::path::{DirEntry, EntryKind, WorkspacePath};

/// Who new files belong to, as host ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    /// Host uid.
    pub uid: u32,
    /// Host gid.
    pub gid: u32,
}

/// Switches the calling thread's filesystem uid/gid (they are per thread) for the life of
/// the guard, so files are created as the sandbox's user (the host's root may not be mapped
/// in the sandbox's user namespace, and then cannot create inodes on its filesystems:
/// `EOVERFLOW`). Holders must not `.await` while it lives (the task could move threads).
#[derive(Debug)]
pub struct FsIds {
    saved: Option<(u32, u32)>,
}

impl FsIds {
    /// Switches to `o`'s ids; `None` changes nothing.
    pub fn switch(o: Option<Owner>) -> FsIds {
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

/// How an OS error on `shown` (the caller's path) reads for the caller: `EXDEV`/`ELOOP`
/// (a lookup that would leave the directory) is [`Error::PathEscape`], `ENOENT`
/// [`Error::NotFound`], a full disk [`Error::ResourceExhausted`], anything else
/// [`Error::Io`] saying `op`.
pub fn map_err(e: std::io::Error, shown: &str, op: &str) -> Error {
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

/// Opens a host directory that the host made (a sandbox's workspace folder), as the root
/// of the lookups here. The path itself is trusted: it is followed as given.
pub fn open_dir(path: &Path) -> Result<OwnedFd> {
    let c = cstr(path.as_os_str().as_bytes())?;
    // SAFETY: open of a NUL-terminated path; we own the new fd.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(Error::io_path("open", path, last_err()));
    }
    // SAFETY: a new fd, ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `openat2(dir, rel, flags | O_CLOEXEC, mode, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`:
/// `rel` (`""` is `dir` itself) is resolved without ever leaving `dir`, through `..` or any
/// symlink; leaving fails with `EXDEV`. `mode` is used with `O_CREAT` only.
pub fn open_beneath(
    dir: BorrowedFd<'_>,
    rel: &Path,
    flags: i32,
    mode: u32,
) -> std::io::Result<OwnedFd> {
    open_resolving(dir, rel, flags, mode, 0)
}

/// [`open_beneath`] with `extra` resolve flags besides `RESOLVE_BENEATH |
/// RESOLVE_NO_MAGICLINKS` (e.g. `RESOLVE_NO_SYMLINKS`: no symlink at all on the way).
pub(crate) fn open_resolving(
    dir: BorrowedFd<'_>,
    rel: &Path,
    flags: i32,
    mode: u32,
    extra: u64,
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
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS | extra;
    loop {
        // SAFETY: openat2 with a valid path and a struct of the stated size.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
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
        // EAGAIN: a rename raced the lookup (RESOLVE_BENEATH retries are the caller's).
        if e.raw_os_error() != Some(libc::EAGAIN) && e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// `fchown(fd, owner)`; nothing for `None`.
pub fn fchown(fd: BorrowedFd<'_>, owner: Option<Owner>) -> std::io::Result<()> {
    if let Some(o) = owner {
        // SAFETY: fchown on a live fd.
        if unsafe { libc::fchown(fd.as_raw_fd(), o.uid, o.gid) } < 0 {
            return Err(last_err());
        }
    }
    Ok(())
}

/// Opens (creating as needed, one name at a time, each new one given to `owner`) the
/// directory `rel` beneath `dir`; `shown` is the caller's path, for errors.
pub fn mkdirs(
    dir: BorrowedFd<'_>,
    rel: &Path,
    owner: Option<Owner>,
    shown: &str,
) -> Result<OwnedFd> {
    let mut cur = open_beneath(dir, Path::new("."), libc::O_PATH | libc::O_DIRECTORY, 0)
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
            cur.as_fd(),
            Path::new(name),
            libc::O_RDONLY | libc::O_DIRECTORY,
            0,
        )
        .map_err(|e| map_err(e, shown, "open"))?;
        if created {
            fchown(next.as_fd(), owner).map_err(|e| map_err(e, shown, "chown"))?;
        }
        cur = next;
    }
    Ok(cur)
}

/// Writes `data` to the workspace file `path` (as the file API takes it: relative, or under
/// `/workspace`) beneath the workspace handle `ws`, creating missing parents. New parents and
/// the file are given to `owner`. The file is opened beneath `ws` and written through that
/// handle: a symlink leading out is [`Error::PathEscape`], anything but a regular file at
/// the end is refused.
pub fn write_file(ws: BorrowedFd<'_>, path: &str, data: &[u8], owner: Option<Owner>) -> Result<()> {
    let wp = WorkspacePath::parse(path)?;
    if wp.is_root() {
        return Err(Error::invalid("path", "the workspace root is a directory"));
    }
    let rel = wp.relative();
    let shown = wp.in_sandbox();
    let parent = rel.parent().unwrap_or(Path::new(""));
    let name = rel.file_name().unwrap_or(OsStr::new(""));
    let dir = mkdirs(ws, parent, owner, &shown)?;
    // O_NONBLOCK: a FIFO swapped in cannot hang us (it is refused below).
    let fd = open_beneath(
        dir.as_fd(),
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
    fchown(f.as_fd(), owner).map_err(|e| map_err(e, &shown, "chown"))?;
    f.write_all(data).map_err(|e| map_err(e, &shown, "write"))
}

/// The error of a read over `max` bytes: [`Error::InvalidSpec`] on `path`, naming the limit.
fn too_large(shown: &str, size: Option<u64>, max: u64) -> Error {
    let what = match size {
        Some(n) => format!("{shown} is {n} bytes"),
        None => format!("{shown} grew while it was read"),
    };
    Error::invalid(
        "path",
        format!(
            "{what}, over the limit of one read_file ({max} bytes, the sandbox's \
             limits.disk_bytes): read it in parts inside the sandbox (e.g. `split`, `head -c`)"
        ),
    )
}

/// Reads the regular file `path` beneath the workspace handle `ws`, refusing one over `max`
/// bytes (the sandbox's `limits.disk_bytes`) with [`Error::InvalidSpec`] on `path`, before
/// a byte is read. What the file's size says is never allocated: the buffer grows with the
/// bytes actually read, and reading stops past `max` (a file that grows meanwhile is
/// refused the same way).
pub fn read_file(ws: BorrowedFd<'_>, path: &str, max: u64) -> Result<Vec<u8>> {
    let wp = WorkspacePath::parse(path)?;
    let shown = wp.in_sandbox();
    let fd = open_beneath(ws, &wp.relative(), libc::O_RDONLY | libc::O_NONBLOCK, 0)
        .map_err(|e| map_err(e, &shown, "open"))?;
    let f = File::from(fd);
    let md = f.metadata().map_err(|e| map_err(e, &shown, "stat"))?;
    if !md.is_file() {
        return Err(Error::invalid(
            "path",
            format!("{shown} is not a regular file"),
        ));
    }
    if md.len() > max {
        return Err(too_large(&shown, Some(md.len()), max));
    }
    let mut out = Vec::new();
    f.take(max.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| map_err(e, &shown, "read"))?;
    if out.len() as u64 > max {
        return Err(too_large(&shown, None, max));
    }
    Ok(out)
}

/// The size of what is at `path` beneath `ws` (not following a final symlink), or `None`
/// if nothing is there (or it cannot be reached beneath `ws`).
pub fn size_of(ws: BorrowedFd<'_>, path: &str) -> Option<u64> {
    let wp = WorkspacePath::parse(path).ok()?;
    let fd = open_beneath(ws, &wp.relative(), libc::O_PATH | libc::O_NOFOLLOW, 0).ok()?;
    File::from(fd).metadata().ok().map(|m| m.len())
}

pub(crate) fn kind_of(mode: u32) -> EntryKind {
    match mode & libc::S_IFMT {
        libc::S_IFREG => EntryKind::File,
        libc::S_IFDIR => EntryKind::Dir,
        libc::S_IFLNK => EntryKind::Symlink,
        _ => EntryKind::Other,
    }
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`.
pub(crate) fn lstat_at(dir: BorrowedFd<'_>, name: &CStr) -> std::io::Result<libc::stat> {
    // SAFETY: zeroed stat is valid; fstatat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat relative to a directory fd, not following symlinks.
    if unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    } < 0
    {
        return Err(last_err());
    }
    Ok(st)
}

/// The names in directory `dir` (without `.` and `..`), unsorted.
pub(crate) fn names(dir: BorrowedFd<'_>) -> std::io::Result<Vec<CString>> {
    names_bounded(dir, usize::MAX).map(|(n, _)| n)
}

/// The first `max` entry names of directory `dir` (not `.` and `..`), and whether there were
/// more.
pub(crate) fn names_bounded(
    dir: BorrowedFd<'_>,
    max: usize,
) -> std::io::Result<(Vec<CString>, bool)> {
    // A fresh open description of the same directory: its own offset, closed by closedir.
    let dup = open_beneath(dir, Path::new("."), libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    // SAFETY: fdopendir takes ownership of the fd on success.
    let d = unsafe { libc::fdopendir(dup.as_raw_fd()) };
    if d.is_null() {
        return Err(last_err());
    }
    // The DIR stream owns the fd now.
    std::mem::forget(dup);
    let mut out = Vec::new();
    let mut more = false;
    let result = loop {
        // SAFETY: errno is thread-local; clearing it tells end-of-stream from an error.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: readdir64 on a live DIR stream; the entry is valid until the next call.
        let e = unsafe { libc::readdir64(d) };
        if e.is_null() {
            let err = last_err();
            break if err.raw_os_error().unwrap_or(0) == 0 {
                Ok(())
            } else {
                Err(err)
            };
        }
        // SAFETY: d_name is a NUL-terminated name inside the live entry.
        let n = unsafe { CStr::from_ptr((*e).d_name.as_ptr()) };
        if n.to_bytes() == b"." || n.to_bytes() == b".." {
            continue;
        }
        if out.len() >= max {
            more = true;
            break Ok(());
        }
        out.push(n.to_owned());
    };
    // SAFETY: closes the stream (and its fd) once.
    unsafe { libc::closedir(d) };
    result.map(|()| (out, more))
}

/// Lists the workspace directory `path` beneath `ws` (symlinks listed as links, not
/// followed), sorted by name.
pub fn list(ws: BorrowedFd<'_>, path: &str) -> Result<Vec<DirEntry>> {
    let wp = WorkspacePath::parse(path)?;
    let shown = wp.in_sandbox();
    let dir = open_beneath(ws, &wp.relative(), libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .map_err(|e| map_err(e, &shown, "open"))?;
    let mut out = Vec::new();
    for n in names(dir.as_fd()).map_err(|e| map_err(e, &shown, "list"))? {
        let Ok(st) = lstat_at(dir.as_fd(), &n) else {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ws() -> (tempfile::TempDir, OwnedFd) {
        let d = tempfile::tempdir().unwrap();
        let fd = open_dir(d.path()).unwrap();
        (d, fd)
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
        assert_eq!(l[0].kind, EntryKind::Dir);
        std::os::unix::fs::symlink("/etc", d.path().join("out")).unwrap();
        std::os::unix::fs::symlink("../../..", d.path().join("a/up")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", d.path().join("pw")).unwrap();
        let escape = |r: Result<Vec<u8>>| matches!(r, Err(Error::PathEscape { .. }));
        assert!(escape(read_file(fd, "out/passwd", 1 << 20)));
        assert!(escape(read_file(fd, "a/up/etc/passwd", 1 << 20)));
        assert!(escape(read_file(fd, "pw", 1 << 20)));
        assert!(escape(read_file(fd, "../x", 1 << 20)));
        assert!(matches!(
            write_file(fd, "out/x", b"", None),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(
            write_file(fd, "pw", b"", None),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(list(fd, "out"), Err(Error::PathEscape { .. })));
        assert!(matches!(
            read_file(fd, "nope", 1 << 20),
            Err(Error::NotFound { .. })
        ));
        // A link that stays inside is fine.
        std::os::unix::fs::symlink("b/c.txt", d.path().join("a/in")).unwrap();
        assert_eq!(read_file(fd, "a/in", 1 << 20).unwrap(), b"hi");
        assert_eq!(size_of(fd, "a/b/c.txt"), Some(2));
        assert_eq!(size_of(fd, "nope"), None);
        let names = list(fd, "").unwrap();
        let kinds: Vec<_> = names.iter().map(|e| (e.name.as_str(), e.kind)).collect();
        assert_eq!(
            kinds,
            [
                ("a", EntryKind::Dir),
                ("out", EntryKind::Symlink),
                ("pw", EntryKind::Symlink)
            ]
        );
    }

    #[test]
    fn reads_are_capped_without_allocating_the_stated_size() {
        let (d, fd) = ws();
        let fd = fd.as_fd();
        // 1 TiB of nothing: refused at once, from its size alone.
        File::create(d.path().join("big"))
            .unwrap()
            .set_len(1 << 40)
            .unwrap();
        let t = std::time::Instant::now();
        let e = read_file(fd, "big", 64 << 20).unwrap_err();
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        assert!(
            matches!(&e, Error::InvalidSpec { field, reason } if field == "path" && reason.contains("limits.disk_bytes")),
            "{e}"
        );
        write_file(fd, "small", &[7u8; 100], None).unwrap();
        assert_eq!(read_file(fd, "small", 100).unwrap().len(), 100);
        assert!(matches!(
            read_file(fd, "small", 99),
            Err(Error::InvalidSpec { .. })
        ));
    }

    #[test]
    fn a_fifo_or_directory_is_not_a_file() {
        let (d, fd) = ws();
        let fd = fd.as_fd();
        let p = cstr(d.path().join("fifo").as_os_str().as_bytes()).unwrap();
        // SAFETY: mkfifo of a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(p.as_ptr(), 0o644) }, 0);
        assert!(matches!(
            read_file(fd, "fifo", 1 << 20),
            Err(Error::InvalidSpec { .. })
        ));
        assert!(matches!(
            write_file(fd, "fifo", b"x", None),
            Err(Error::InvalidSpec { .. }) | Err(Error::Io { .. })
        ));
        std::fs::create_dir(d.path().join("dir")).unwrap();
        assert!(read_file(fd, "dir", 1 << 20).is_err());
        assert!(write_file(fd, "", b"x", None).is_err());
    }
}
