//! The setup ops ([`Op`]) that build a sandbox's root filesystem and environment (mounts,
//! the overlay's lower layer, files, `pivot_root`, hostname, `lo`, rlimits, the seal), the
//! `SETUP` request that runs them, and the zygote's root-filesystem templates.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::channel::send_err;
use crate::harden::{drop_bounding_set, landlock, seccomp};
use crate::proto::*;
use crate::sys::*;

/// Runs one setup op; `fds` are the request's remaining file descriptors ([`Op::Lower`]
/// takes the first).
pub(crate) fn run_op(op: &Op, fds: &mut Vec<OwnedFd>) -> io::Result<()> {
    match op {
        Op::Mount {
            src,
            dst,
            fstype,
            flags,
            data,
        } => {
            let nz = |s: &String| {
                if s.is_empty() {
                    Ok(None)
                } else {
                    cstr(s).map(Some)
                }
            };
            let (src, fstype, data) = (nz(src)?, nz(fstype)?, nz(data)?);
            let dst = cstr(dst)?;
            // SAFETY: all pointers are NUL-terminated strings or NULL, alive for the call.
            check(unsafe {
                mount(
                    opt_ptr(&src),
                    dst.as_ptr(),
                    opt_ptr(&fstype),
                    *flags,
                    opt_ptr(&data) as *const c_void,
                )
            })
        }
        Op::Bind { src, dst } => check(bind(&cstr(src)?, &cstr(dst)?, MS_BIND | MS_REC)),
        Op::SetAttr {
            path,
            set,
            clear,
            recursive,
        } => {
            let p = cstr(path)?;
            let attr = MountAttr {
                set: *set,
                clr: *clear,
                propagation: 0,
                userns_fd: 0,
            };
            let flags = if *recursive { AT_RECURSIVE } else { 0 };
            // SAFETY: mount_setattr(dirfd, path, flags, &attr, size) with a valid struct.
            let r = unsafe {
                syscall(
                    NR_MOUNT_SETATTR,
                    AT_FDCWD,
                    p.as_ptr(),
                    flags,
                    &attr as *const MountAttr,
                    std::mem::size_of::<MountAttr>(),
                )
            };
            check(r as c_int)
        }
        Op::Mkdir { path, mode } => mkdir_all(path, *mode),
        Op::WriteFile { path, mode, data } => in_new_root(path, |name| {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            // Ours replaces whatever the image had there, a symbolic link included.
            unlink_symlink(name)?;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(*mode)
                .custom_flags(O_NOFOLLOW)
                .open(name)?;
            f.write_all(data)
        }),
        Op::Touch { path } => in_new_root(path, |name| {
            use std::os::unix::fs::OpenOptionsExt;
            unlink_symlink(name)?;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o644)
                .custom_flags(O_NOFOLLOW)
                .open(name)
                .map(|_| ())
        }),
        Op::Symlink { target, path } => {
            in_new_root(path, |name| std::os::unix::fs::symlink(target, name))
        }
        Op::Chown { path, uid, gid } => in_new_root(path, |name| {
            std::os::unix::fs::lchown(name, Some(*uid), Some(*gid))
        }),
        Op::Pivot { newroot } => {
            let nr_ = cstr(newroot)?;
            let dot = cstr(".")?;
            let slash = cstr("/")?;
            // SAFETY: plain syscalls with valid NUL-terminated paths.
            unsafe {
                check(chdir(nr_.as_ptr()))?;
                check(syscall(nr::PIVOT_ROOT, dot.as_ptr(), dot.as_ptr()) as c_int)?;
                check(umount2(dot.as_ptr(), MNT_DETACH))?;
                check(chdir(slash.as_ptr()))
            }
        }
        Op::PivotOld { newroot, put_old } => {
            let (n, o, slash) = (cstr(newroot)?, cstr(put_old)?, cstr("/")?);
            // SAFETY: plain syscalls with valid NUL-terminated paths.
            unsafe {
                check(syscall(nr::PIVOT_ROOT, n.as_ptr(), o.as_ptr()) as c_int)?;
                check(chdir(slash.as_ptr()))
            }
        }
        Op::Landlock { handled, rules } => landlock(*handled, rules),
        Op::DropBoundingSet => drop_bounding_set(),
        Op::Seccomp { bpf } => seccomp(bpf),
        Op::Lower { src, dst } => lower(src, dst, fds),
        Op::KeepDir { path, fd } => {
            let p = cstr(path)?;
            // SAFETY: open(2) of a NUL-terminated path, then dup3/close on our own fds.
            unsafe {
                let f = libc_open(p.as_ptr(), O_DIRECTORY | O_CLOEXEC);
                if f < 0 {
                    return Err(io::Error::last_os_error());
                }
                if f != *fd as c_int {
                    let r = dup3(f, *fd as c_int, O_CLOEXEC);
                    close(f);
                    check(r)?;
                }
            }
            Ok(())
        }
        Op::Hostname { name } => {
            // SAFETY: pointer and length of a live byte slice.
            check(unsafe { sethostname(name.as_ptr() as *const c_char, name.len()) })
        }
        Op::LoopbackUp => {
            // SAFETY: socket + two ioctls on a zeroed, correctly sized `struct ifreq`.
            unsafe {
                let fd = socket(2, 2 | 0o2000000, 0);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let fd = OwnedFd::from_raw_fd(fd);
                let mut ifr = IfReq {
                    name: [0; 16],
                    flags: 0,
                    pad: [0; 22],
                };
                ifr.name[..2].copy_from_slice(b"lo");
                check(ioctl(fd.as_raw_fd(), SIOCGIFFLAGS, &mut ifr as *mut IfReq))?;
                ifr.flags |= IFF_UP;
                check(ioctl(fd.as_raw_fd(), SIOCSIFFLAGS, &mut ifr as *mut IfReq))
            }
        }
        Op::Unshare { flags, optional } => {
            // SAFETY: unshare with namespace flags only.
            let r = unsafe { unshare(*flags as c_int) };
            if r < 0 && *optional && errno() == 22 {
                return Ok(());
            }
            check(r)
        }
        Op::Chdir { path } => std::env::set_current_dir(path),
        Op::Rlimit {
            resource,
            soft,
            hard,
        } => {
            let l = Rlimit {
                cur: *soft,
                max: *hard,
            };
            // SAFETY: valid struct pointer.
            check(unsafe { setrlimit(*resource as c_int, &l) })
        }
    }
}

/// `mount(src, dst, NULL, flags, NULL)`: a bind mount (`flags` has `MS_BIND`).
fn bind(src: &CString, dst: &CString, flags: u64) -> c_int {
    // SAFETY: NUL-terminated paths; NULL fstype/data are allowed for bind mounts.
    unsafe {
        mount(
            src.as_ptr(),
            dst.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    }
}

/// The overlay's lower layer: the detached mount the library passed (idmapped), else a
/// read-only bind of `src` (not recursive: submounts of a rootfs are not part of it).
fn lower(src: &str, dst: &str, fds: &mut Vec<OwnedFd>) -> io::Result<()> {
    let d = cstr(dst)?;
    if !fds.is_empty() {
        let tree = fds.remove(0);
        let empty = cstr("")?;
        // SAFETY: move_mount(fd, "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH) with valid strings.
        return check(unsafe {
            syscall(
                NR_MOVE_MOUNT,
                tree.as_raw_fd(),
                empty.as_ptr(),
                AT_FDCWD,
                d.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            )
        } as c_int);
    }
    let s = cstr(src)?;
    let mut r = bind(&s, &d, MS_BIND);
    if r < 0 && errno() == 22 {
        // Locked submounts beneath `src` (user namespace): only a recursive bind is allowed.
        r = bind(&s, &d, MS_BIND | MS_REC);
    }
    check(r)?;
    let attr = MountAttr {
        set: 0x1 | 0x2 | 0x4, // MOUNT_ATTR_RDONLY | NOSUID | NODEV
        clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr(AT_FDCWD, dst, AT_RECURSIVE, &attr, size) with a valid struct.
    check(unsafe {
        syscall(
            NR_MOUNT_SETATTR,
            AT_FDCWD,
            d.as_ptr(),
            AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    } as c_int)
}

/// What an op does, for the error report of a failed setup.
fn describe(op: &Op) -> String {
    match op {
        Op::Mount { dst, fstype, .. } => format!("mount {fstype} on {dst}"),
        Op::Bind { src, dst } => format!("bind {src} on {dst}"),
        Op::SetAttr { path, .. } => format!("set mount attributes of {path}"),
        Op::Mkdir { path, .. } => format!("mkdir {path}"),
        Op::WriteFile { path, .. } => format!("write {path}"),
        Op::Touch { path } => format!("create {path}"),
        Op::Symlink { path, .. } => format!("symlink {path}"),
        Op::Chown { path, .. } => format!("chown {path}"),
        Op::Pivot { .. } | Op::PivotOld { .. } => "pivot_root".to_string(),
        Op::Landlock { .. } => "landlock".to_string(),
        Op::Seccomp { .. } => "seccomp".to_string(),
        Op::Hostname { .. } => "sethostname".to_string(),
        Op::LoopbackUp => "bring up lo".to_string(),
        Op::Unshare { flags, .. } => format!("unshare({flags:#x})"),
        Op::Chdir { path } => format!("chdir {path}"),
        Op::Rlimit { .. } => "setrlimit".to_string(),
        Op::Lower { src, .. } => format!("mount the root filesystem layer {src}"),
        Op::KeepDir { path, .. } => format!("open {path}"),
        Op::DropBoundingSet => "drop the capability bounding set".to_string(),
    }
}

/// Runs a setup request. On failure it reports the error and returns `None`; on success it
/// returns whether the request sealed the sandbox (its ops included
/// [`Op::DropBoundingSet`]) and leaves the `REP_OK` to the caller.
pub(crate) fn setup(id: u64, payload: &[u8], mut fds: Vec<OwnedFd>) -> Option<bool> {
    let ops = match Dec::new(payload).ops() {
        Ok(o) => o,
        Err(_) => {
            send_err(
                id,
                u32::MAX,
                &io::Error::from_raw_os_error(22),
                "malformed setup",
            );
            return None;
        }
    };
    for (i, op) in ops.iter().enumerate() {
        if let Err(e) = run_op(op, &mut fds) {
            send_err(id, i as u32, &e, &describe(op));
            return None;
        }
    }
    Some(ops.iter().any(|op| matches!(op, Op::DropBoundingSet)))
}

/// Runs a template's ops (encoded in the memfd `fds[0]`), stopping at the first failure.
pub(crate) fn build_template(tmpl_err: i32, mut fds: Vec<OwnedFd>) -> io::Result<()> {
    if tmpl_err != 0 {
        return Err(io::Error::from_raw_os_error(tmpl_err));
    }
    let Some(fd) = fds.pop() else {
        return Err(io::Error::from_raw_os_error(22));
    };
    let mut payload = Vec::new();
    File::from(fd).read_to_end(&mut payload)?;
    let ops = Dec::new(&payload)
        .ops()
        .map_err(|_| io::Error::from_raw_os_error(22))?;
    let mut none = Vec::new();
    for op in &ops {
        // We run these as host root in the host's UTS and network namespaces: only what
        // builds a tree of files and mounts.
        let fs_only = matches!(
            op,
            Op::Mount { .. }
                | Op::Bind { .. }
                | Op::SetAttr { .. }
                | Op::Mkdir { .. }
                | Op::WriteFile { .. }
                | Op::Touch { .. }
                | Op::Symlink { .. }
        );
        if !fs_only {
            return Err(io::Error::from_raw_os_error(1 /* EPERM */));
        }
        run_op(op, &mut none)?;
    }
    Ok(())
}

/// Where the plan builds the new root before `pivot_root` (the library's `rootfs::NEW`).
const NEW_ROOT: &str = "/newroot";

/// Runs `f` on the last component of `path` with the working directory at its parent. A
/// path in the new root (`/newroot/...`) has its parent resolved *inside* it, as if it were
/// `/` (`openat2` with `RESOLVE_IN_ROOT`): an image's symbolic links (`/etc/hostname ->
/// /oldroot/tmp/x`, `/etc -> /oldroot/etc`) lead nowhere outside, so a setup write never
/// lands on the host. Other paths (the scratch root's, a template's: ours alone) are used
/// as they are. The working directory is `/` again afterwards.
fn in_new_root<T>(path: &str, f: impl FnOnce(&str) -> io::Result<T>) -> io::Result<T> {
    let Some(rel) = path
        .strip_prefix(NEW_ROOT)
        .and_then(|r| r.strip_prefix('/'))
    else {
        return f(path);
    };
    let rel = rel.trim_end_matches('/');
    let (parent, name) = match rel.rsplit_once('/') {
        Some((p, n)) => (p, n),
        None => ("", rel),
    };
    if name.is_empty() || name == "." || name == ".." {
        return Err(io::Error::from_raw_os_error(22));
    }
    let dir = open_in_root(parent)?;
    // SAFETY: fchdir on a directory fd we own; the init runs one op at a time, one thread.
    check(unsafe { fchdir(dir.as_raw_fd()) })?;
    let r = f(name);
    let slash = cstr("/")?;
    // SAFETY: chdir with a NUL-terminated path.
    check(unsafe { chdir(slash.as_ptr()) })?;
    r
}

/// The directory `rel` of the new root, resolved inside it (see [`in_new_root`]).
fn open_in_root(rel: &str) -> io::Result<OwnedFd> {
    let root = cstr(NEW_ROOT)?;
    // SAFETY: open of a NUL-terminated path; the fd is owned below.
    let rfd = unsafe { libc_open(root.as_ptr(), O_PATH | O_DIRECTORY | O_CLOEXEC) };
    check(rfd)?;
    // SAFETY: a fresh fd we own.
    let rootfd = unsafe { OwnedFd::from_raw_fd(rfd) };
    let at = cstr(if rel.is_empty() { "." } else { rel })?;
    let how = OpenHow {
        flags: (O_PATH | O_DIRECTORY | O_CLOEXEC) as u64,
        mode: 0,
        resolve: RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: openat2(dirfd, path, &how, size) with a valid struct and NUL-terminated path.
    let fd = unsafe {
        syscall(
            NR_OPENAT2,
            rootfd.as_raw_fd(),
            at.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    check(fd as c_int)?;
    // SAFETY: a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as c_int) })
}

/// Removes `name` (in the working directory) if it is a symbolic link.
fn unlink_symlink(name: &str) -> io::Result<()> {
    match std::fs::symlink_metadata(name) {
        Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(name),
        _ => Ok(()),
    }
}

/// Whether `rel` of the new root is a directory inside it that a plain lookup from the scratch
/// root (as `mount(2)` makes) reaches too: not so when a chain of links leaves it further on
/// (`a -> b`, `b -> /oldroot/tmp`).
fn same_either_way(rel: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(inside) = open_in_root(rel).and_then(|fd| File::from(fd).metadata()) else {
        return false;
    };
    std::fs::metadata(format!("{NEW_ROOT}/{rel}"))
        .is_ok_and(|plain| (plain.dev(), plain.ino()) == (inside.dev(), inside.ino()))
}

/// `mkdir -p`. In the new root each component is made in its parent as resolved inside the
/// new root, and a component that is an image's symbolic link stays one only if it is
/// relative, has no `..` and leads to the same directory inside the root and from the scratch
/// root, where mounts onto the path resolve it (merged-`/usr` links such as
/// `lib -> usr/lib` stay). Any other link (absolute, climbing, dangling, or out of the root:
/// `tmp -> /oldroot/tmp`) is replaced by a directory, so neither a write nor a mount of the
/// setup follows it.
fn mkdir_all(path: &str, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let mkdir = |p: &str| match std::fs::DirBuilder::new().mode(mode).create(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    };
    let Some(rel) = path
        .strip_prefix(NEW_ROOT)
        .and_then(|r| r.strip_prefix('/'))
    else {
        if path == NEW_ROOT {
            return mkdir(path);
        }
        return match std::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(path)
        {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(e),
        };
    };
    let mut prefix = String::new();
    for comp in rel.split('/').filter(|c| !c.is_empty() && *c != ".") {
        if comp == ".." {
            return Err(io::Error::from_raw_os_error(22));
        }
        if !prefix.is_empty() {
            prefix.push('/');
        }
        prefix.push_str(comp);
        in_new_root(
            &format!("{NEW_ROOT}/{prefix}"),
            |name| match std::fs::read_link(name) {
                Ok(target) => {
                    let plain = target.is_relative()
                        && !target
                            .components()
                            .any(|c| matches!(c, std::path::Component::ParentDir));
                    if plain && same_either_way(&prefix) {
                        return Ok(());
                    }
                    std::fs::remove_file(name)?;
                    mkdir(name)
                }
                Err(_) => mkdir(name),
            },
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::TempDir;
    use std::fs;
    use std::path::Path;

    /// A file holding `bytes`, open for reading (as the library's memfd).
    fn payload_fd(dir: &TempDir, bytes: &[u8]) -> OwnedFd {
        let p = dir.join("payload");
        fs::write(&p, bytes).unwrap();
        File::open(&p).unwrap().into()
    }

    fn encoded(ops: &[Op]) -> Vec<u8> {
        let mut e = Enc::default();
        e.ops(ops);
        e.0
    }

    #[test]
    fn templates_run_file_ops_only() {
        let dir = TempDir::new("template");
        let errno = |r: io::Result<()>| r.unwrap_err().raw_os_error();
        // The zygote's set-up failed: every template is refused with its errno.
        assert_eq!(errno(build_template(95, Vec::new())), Some(95));
        // No payload, or a malformed one.
        assert_eq!(errno(build_template(0, Vec::new())), Some(22));
        let junk = payload_fd(&dir, b"\x05\0\0\0\xff");
        assert_eq!(errno(build_template(0, vec![junk])), Some(22));
        // Ops that are not about files are refused, after the file ops before them ran.
        let ops = [
            Op::Mkdir {
                path: dir.at("before"),
                mode: 0o755,
            },
            Op::Hostname { name: "x".into() },
            Op::Mkdir {
                path: dir.at("after"),
                mode: 0o755,
            },
        ];
        let fd = payload_fd(&dir, &encoded(&ops));
        assert_eq!(errno(build_template(0, vec![fd])), Some(1));
        assert!(dir.join("before").is_dir());
        assert!(!dir.join("after").exists());
        for op in [
            Op::LoopbackUp,
            Op::Chdir { path: "/".into() },
            Op::Landlock {
                handled: 2,
                rules: Vec::new(),
            },
            Op::DropBoundingSet,
        ] {
            let fd = payload_fd(&dir, &encoded(&[op]));
            assert_eq!(errno(build_template(0, vec![fd])), Some(1));
        }
    }

    #[test]
    fn file_ops_build_a_tree() {
        let dir = TempDir::new("ops");
        fs::create_dir(dir.join("t")).unwrap();
        fs::write(dir.join("t/kept"), "old").unwrap();
        let ops = [
            Op::Mkdir {
                path: dir.at("t/a/b/c"),
                mode: 0o700,
            },
            // Existing directories are fine.
            Op::Mkdir {
                path: dir.at("t/a/b"),
                mode: 0o755,
            },
            Op::WriteFile {
                path: dir.at("t/a/f"),
                mode: 0o600,
                data: b"first, longer".to_vec(),
            },
            // Rewriting truncates.
            Op::WriteFile {
                path: dir.at("t/a/f"),
                mode: 0o600,
                data: b"second".to_vec(),
            },
            // Touch creates a missing file and leaves an existing one as it is.
            Op::Touch {
                path: dir.at("t/new"),
            },
            Op::Touch {
                path: dir.at("t/kept"),
            },
            Op::Symlink {
                target: "a/f".into(),
                path: dir.at("t/link"),
            },
        ];
        let fd = payload_fd(&dir, &encoded(&ops));
        build_template(0, vec![fd]).unwrap();
        assert!(dir.join("t/a/b/c").is_dir());
        assert_eq!(fs::read_to_string(dir.join("t/a/f")).unwrap(), "second");
        assert_eq!(fs::read(dir.join("t/new")).unwrap(), b"");
        assert_eq!(fs::read_to_string(dir.join("t/kept")).unwrap(), "old");
        assert_eq!(fs::read_link(dir.join("t/link")).unwrap(), Path::new("a/f"));
        assert_eq!(fs::read_to_string(dir.join("t/link")).unwrap(), "second");
        // A symlink over an existing path fails, and names the op.
        let op = Op::Symlink {
            target: "x".into(),
            path: dir.at("t/link"),
        };
        assert_eq!(
            run_op(&op, &mut Vec::new()).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        assert!(describe(&op).contains("t/link"));
        // A NUL byte in a path is EINVAL, not a panic.
        let op = Op::Bind {
            src: "a\0b".into(),
            dst: dir.at("t"),
        };
        assert_eq!(
            run_op(&op, &mut Vec::new()).unwrap_err().raw_os_error(),
            Some(22)
        );
    }
}
