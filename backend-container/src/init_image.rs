//! The embedded init binary as a file the zygote can be executed from: a copy kept on disk
//! as root ([`CACHE_DIR`]), or a sealed memfd written for the process.
//!
//! Why a copy on disk: the image is ~1.2 MB, and writing it into a fresh memfd was ~1 ms
//! of CPU per process (page faults on the embedded bytes, new shmem pages, the copy): the
//! largest single cost of a one-shot `agent-sandbox run` in the process itself. The copy
//! is made once per build of the image (its name carries the hash of its bytes, computed
//! by build.rs) and then only opened and checked.
//!
//! What is trusted: as root only, a regular file in a directory that only root can write
//! (owned by root, not writable by group or others, not a symlink), itself owned by root,
//! not writable by group or others, of the image's size. Whoever can change it is root
//! already. The zygote is executed through the descriptor that was checked. Anything else
//! (rootless, a directory that cannot be made, a wrong owner or mode) falls back to the
//! memfd, sealed against writes, as before.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;

/// The init binary built by build.rs.
static INIT_IMAGE: &[u8] = include_bytes!(env!("AGENT_SANDBOX_INIT"));

/// FNV-1a 64 of [`INIT_IMAGE`], by build.rs.
const INIT_HASH: &str = env!("AGENT_SANDBOX_INIT_HASH");

/// Where root keeps the copies (one per image build, `init-<hash>-<size>`).
pub(crate) const CACHE_DIR: &str = "/run/agent-sandbox-init";

/// A read-only fd of the init image, shared by every sandbox of the process.
#[derive(Debug)]
pub(crate) struct InitImage {
    fd: OwnedFd,
}

impl InitImage {
    /// The descriptor to execute (`/proc/self/fd/N`).
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// The image: the copy on disk when it can be trusted (or made), else a sealed memfd.
pub(crate) fn load() -> io::Result<InitImage> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        match cached(std::path::Path::new(CACHE_DIR)) {
            Ok(fd) => return Ok(InitImage { fd }),
            Err(e) => tracing::debug!("sandbox init copy on disk not used ({e}); using a memfd"),
        }
    }
    memfd().map(|fd| InitImage { fd })
}

/// The file name of this build's copy.
fn file_name() -> String {
    format!("init-{INIT_HASH}-{}", INIT_IMAGE.len())
}

fn untrusted(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, what)
}

/// Whether `m` (of a file or directory in `dir`) can only have been written by us (root).
fn only_ours(m: &std::fs::Metadata) -> bool {
    // SAFETY: geteuid has no preconditions.
    m.uid() == unsafe { libc::geteuid() } && m.mode() & 0o022 == 0
}

/// Opens (making it first if missing) this build's copy in `dir`, checked as the module
/// docs say.
fn cached(dir: &std::path::Path) -> io::Result<OwnedFd> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let dir_fd = open_at(
        libc::AT_FDCWD,
        dir.as_os_str(),
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
    )?;
    let dm = std::fs::File::from(dir_fd.try_clone()?).metadata()?;
    if !dm.is_dir() || !only_ours(&dm) {
        return Err(untrusted(format!(
            "{} is not a directory only this user can write",
            dir.display()
        )));
    }
    let name = file_name();
    match open_checked(&dir_fd, &name) {
        Ok(fd) => return Ok(fd),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    // Written under a name of our own, then renamed into place: the final name only ever
    // names a complete copy (a concurrent writer renames an identical one over it).
    let tmp = format!(".{name}.{}", std::process::id());
    let _ = unlink_at(&dir_fd, &tmp);
    let w = open_at(
        dir_fd.as_raw_fd(),
        std::ffi::OsStr::new(&tmp),
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
    )?;
    let written = (|| {
        let mut f = std::fs::File::from(w);
        f.write_all(INIT_IMAGE)?;
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o500))?;
        // Closed before the rename: a file open for writing cannot be executed (ETXTBSY).
        drop(f);
        rename_at(&dir_fd, &tmp, &name)
    })();
    if let Err(e) = written {
        let _ = unlink_at(&dir_fd, &tmp);
        return Err(e);
    }
    remove_other_builds(dir, &name);
    open_checked(&dir_fd, &name)
}

/// Opens `name` in `dir_fd` read-only and checks it: a regular file of the image's size
/// that only we can have written.
fn open_checked(dir_fd: &OwnedFd, name: &str) -> io::Result<OwnedFd> {
    let fd = open_at(
        dir_fd.as_raw_fd(),
        std::ffi::OsStr::new(name),
        libc::O_RDONLY | libc::O_NOFOLLOW,
    )?;
    let m = std::fs::File::from(fd.try_clone()?).metadata()?;
    if !m.is_file() || !only_ours(&m) || m.len() != INIT_IMAGE.len() as u64 {
        return Err(untrusted(format!(
            "{CACHE_DIR}/{name}: not a regular file of {} bytes only this user can write",
            INIT_IMAGE.len()
        )));
    }
    Ok(fd)
}

/// Removes the copies of other builds of the image, and temporary files of writers that
/// are gone (best effort: a process of another build that has its copy open keeps it).
fn remove_other_builds(dir: &std::path::Path, keep: &str) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        let stale = if n.starts_with("init-") {
            n != keep
        } else if let Some(rest) = n.strip_prefix(".init-") {
            rest.rsplit_once('.')
                .and_then(|(_, pid)| pid.parse::<u32>().ok())
                .is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
        } else {
            false
        };
        if stale {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn cstr(p: &std::ffi::OsStr) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn open_at(dir: RawFd, path: &std::ffi::OsStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    let c = cstr(path)?;
    // SAFETY: openat(2) with a NUL-terminated path; the mode is used only with O_CREAT.
    let fd = unsafe { libc::openat(dir, c.as_ptr(), flags | libc::O_CLOEXEC, 0o600) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: we own the new fd.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn unlink_at(dir: &OwnedFd, name: &str) -> io::Result<()> {
    let c = cstr(std::ffi::OsStr::new(name))?;
    // SAFETY: unlinkat(2) with a NUL-terminated name relative to our directory fd.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn rename_at(dir: &OwnedFd, from: &str, to: &str) -> io::Result<()> {
    let (f, t) = (
        cstr(std::ffi::OsStr::new(from))?,
        cstr(std::ffi::OsStr::new(to))?,
    );
    // SAFETY: renameat(2) with NUL-terminated names relative to our directory fd.
    if unsafe { libc::renameat(dir.as_raw_fd(), f.as_ptr(), dir.as_raw_fd(), t.as_ptr()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The image written into a sealed memfd, re-opened read-only.
fn memfd() -> io::Result<OwnedFd> {
    const MFD_EXEC: libc::c_uint = 0x10;
    let name = c"agent-sandbox-init";
    let base = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: memfd_create with a NUL-terminated name.
    let mut fd = unsafe { libc::memfd_create(name.as_ptr(), base | MFD_EXEC) };
    if fd < 0 {
        // SAFETY: as above, without MFD_EXEC (kernels before 6.3).
        fd = unsafe { libc::memfd_create(name.as_ptr(), base) };
    }
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: we own the new fd.
    let rw = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut f = std::fs::File::from(rw);
    f.write_all(INIT_IMAGE)?;
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on our fd.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // Re-open read-only: exec refuses a file open for writing (ETXTBSY).
    let path = format!("/proc/self/fd/{}", f.as_raw_fd());
    let ro = open_at(libc::AT_FDCWD, std::ffi::OsStr::new(&path), libc::O_RDONLY)?;
    drop(f);
    Ok(ro)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contents(fd: &OwnedFd) -> Vec<u8> {
        use std::io::Read;
        let mut v = Vec::new();
        std::fs::File::from(fd.try_clone().unwrap())
            .read_to_end(&mut v)
            .unwrap();
        v
    }

    #[test]
    fn the_memfd_holds_the_image() {
        assert_eq!(contents(&memfd().unwrap()), INIT_IMAGE);
    }

    /// As root: a copy is made once, reused, refused when others could have written it,
    /// and other builds' copies are removed.
    #[test]
    fn the_copy_on_disk_is_made_once_and_checked() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: the copy on disk is used as root only");
            return;
        }
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("cache");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(dir.join("init-0000-1"), b"old").unwrap();
        let first = cached(&dir).unwrap();
        assert_eq!(contents(&first), INIT_IMAGE);
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec![file_name()]);
        let path = dir.join(file_name());
        let ino = std::fs::metadata(&path).unwrap().ino();
        assert_eq!(contents(&cached(&dir).unwrap()), INIT_IMAGE);
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino, "made again");
        // Writable by others: refused, never used.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o522)).unwrap();
        assert!(cached(&dir).is_err());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o500)).unwrap();
        // A directory others can write to: refused.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(cached(&dir).is_err());
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        // A copy of another size (e.g. cut short): refused.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"short").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o500)).unwrap();
        assert!(cached(&dir).is_err());
    }
}
