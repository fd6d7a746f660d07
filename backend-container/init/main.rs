//! agent-sandbox container init: pid 1 of every container sandbox.
//!
//! Built by `build.rs` with plain `rustc` (std only, no crates), embedded in the library and
//! executed from a sealed memfd, once per library process, as the **zygote** (`--zygote`):
//! a fork server that forks one init per control socket it receives (`SOCK_SEQPACKET`, see
//! `proto.rs`), as the new init's fd 0; the init moves it to fd 3.
//!
//! 0. Bootstrap: unshare a user namespace, then the other namespaces while the library writes
//!    its maps, wait for the maps and the cgroups, clone pid 1 (`CLONE_PARENT`: a child of the
//!    library); the first process exits. Everything below runs in pid 1.
//! 1. `SETUP`: run the op list: mounts, files, `pivot_root`, hostname, lo up, then lock
//!    itself down (bounding set, `no_new_privs`, Landlock, seccomp) so every exec inherits it.
//! 2. `EXEC`...: hand the exec to the spare supervisor forked ahead of time (or fork one:
//!    a child subreaper) that starts the command with a
//!    vfork-style clone; the command's child drops every capability, switches to the sandbox
//!    user, applies rlimits and execs; the supervisor reports EXITED and, on `KILL`, kills
//!    every descendant.
//!
//! Between requests it reaps every zombie of the pid namespace. If the library goes away
//! (socket closed), the init exits and the kernel kills the whole pid namespace.
//!
//! The same sources are the `container-init` workspace package, so that cargo lints them with
//! the workspace's rules and runs their unit tests (`cargo test -p container-init`); the
//! binary cargo builds from it is not the one the library embeds.

// Our own C `main`: skips std's runtime start-up (its main-thread stack guard parses
// /proc/self/maps, ~0.2 ms); std itself still works (args come from glibc's init_array).
// Unit tests (`cargo test -p container-init`) run under libtest's own `main` instead.
#![cfg_attr(not(test), no_main)]

#[path = "proto.rs"]
mod proto;

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use proto::*;

#[allow(non_camel_case_types)]
type c_int = i32;
#[allow(non_camel_case_types)]
type c_long = i64;
#[allow(non_camel_case_types)]
type c_ulong = u64;
#[allow(non_camel_case_types)]
type c_char = std::ffi::c_char;
#[allow(non_camel_case_types)]
type c_void = u8;

#[repr(C)]
struct IoVec {
    base: *mut c_void,
    len: usize,
}

#[repr(C)]
struct MsgHdr {
    name: *mut c_void,
    namelen: u32,
    iov: *mut IoVec,
    iovlen: usize,
    control: *mut c_void,
    controllen: usize,
    flags: c_int,
}

#[repr(C)]
struct PollFd {
    fd: c_int,
    events: i16,
    revents: i16,
}

#[repr(C)]
struct Rlimit {
    cur: u64,
    max: u64,
}

#[repr(C)]
struct SockFprog {
    len: u16,
    filter: *const u64,
}

#[repr(C)]
struct MountAttr {
    set: u64,
    clr: u64,
    propagation: u64,
    userns_fd: u64,
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: c_int,
}

#[repr(C)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: i16,
    pad: [u8; 22],
}

#[repr(C, align(8))]
struct SigSet([u64; 16]);

extern "C" {
    fn syscall(n: c_long, ...) -> c_long;
    fn mount(
        src: *const c_char,
        dst: *const c_char,
        fstype: *const c_char,
        flags: c_ulong,
        data: *const c_void,
    ) -> c_int;
    fn umount2(target: *const c_char, flags: c_int) -> c_int;
    fn sethostname(name: *const c_char, len: usize) -> c_int;
    fn setgroups(n: usize, list: *const u32) -> c_int;
    fn setresuid(r: u32, e: u32, s: u32) -> c_int;
    fn setresgid(r: u32, e: u32, s: u32) -> c_int;
    fn setsid() -> c_int;
    fn setpgid(pid: c_int, pgid: c_int) -> c_int;
    fn setrlimit(res: c_int, lim: *const Rlimit) -> c_int;
    fn prctl(op: c_int, ...) -> c_int;
    fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int;
    fn ioctl(fd: c_int, req: c_ulong, ...) -> c_int;
    fn poll(fds: *mut PollFd, n: u64, timeout: c_int) -> c_int;
    fn sigemptyset(set: *mut SigSet) -> c_int;
    fn sigaddset(set: *mut SigSet, sig: c_int) -> c_int;
    fn sigprocmask(how: c_int, set: *const SigSet, old: *mut SigSet) -> c_int;
    fn signalfd(fd: c_int, mask: *const SigSet, flags: c_int) -> c_int;
    fn waitpid(pid: c_int, status: *mut c_int, options: c_int) -> c_int;
    fn kill(pid: c_int, sig: c_int) -> c_int;
    fn getppid() -> c_int;
    fn setns(fd: c_int, nstype: c_int) -> c_int;
    fn recvmsg(fd: c_int, msg: *mut MsgHdr, flags: c_int) -> isize;
    fn write(fd: c_int, buf: *const c_void, n: usize) -> isize;
    fn read(fd: c_int, buf: *mut c_void, n: usize) -> isize;
    fn close(fd: c_int) -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, ...) -> c_int;
    fn unshare(flags: c_int) -> c_int;
    fn chdir(path: *const c_char) -> c_int;
    fn _exit(code: c_int) -> !;
    fn fork() -> c_int;
    fn clone(
        f: extern "C" fn(*mut c_void) -> c_int,
        stack: *mut c_void,
        flags: c_int,
        arg: *mut c_void,
        ...
    ) -> c_int;
    fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char)
        -> c_int;
    fn dup2(old: c_int, new: c_int) -> c_int;
    fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int;
    #[link_name = "open"]
    fn libc_open(path: *const c_char, flags: c_int, ...) -> c_int;
    fn getpid() -> c_int;
    fn socketpair(domain: c_int, ty: c_int, proto: c_int, sv: *mut c_int) -> c_int;
    fn sendmsg(fd: c_int, msg: *const MsgHdr, flags: c_int) -> isize;
    fn clock_gettime(clock: c_int, ts: *mut [i64; 2]) -> c_int;
}

#[cfg(target_arch = "x86_64")]
const NR_CLONE: i64 = 56;
#[cfg(target_arch = "aarch64")]
const NR_CLONE: i64 = 220;

#[cfg(target_arch = "x86_64")]
mod nr {
    pub const PIVOT_ROOT: i64 = 155;
    pub const SECCOMP: i64 = 317;
    pub const CAPSET: i64 = 126;
}
#[cfg(target_arch = "aarch64")]
mod nr {
    pub const PIVOT_ROOT: i64 = 41;
    pub const SECCOMP: i64 = 277;
    pub const CAPSET: i64 = 91;
}
const NR_CLOSE_RANGE: i64 = 436;
const CLONE_NEWUSER: c_int = 0x1000_0000;
const CLONE_NEWNS: c_int = 0x0002_0000;
const CLONE_NEWUTS: c_int = 0x0400_0000;
const CLONE_NEWIPC: c_int = 0x0800_0000;
const CLONE_NEWNET: c_int = 0x4000_0000;
const CLONE_NEWPID: c_int = 0x2000_0000;
const CLONE_PARENT: c_int = 0x0000_8000;
const NR_MOUNT_SETATTR: i64 = 442;
const NR_MOVE_MOUNT: i64 = 429;
const MOVE_MOUNT_F_EMPTY_PATH: u32 = 0x4;
#[cfg(target_arch = "x86_64")]
const O_DIRECTORY: c_int = 0o200000;
#[cfg(target_arch = "aarch64")]
const O_DIRECTORY: c_int = 0o40000;
const NR_LANDLOCK_CREATE_RULESET: i64 = 444;
const NR_LANDLOCK_ADD_RULE: i64 = 445;
const NR_LANDLOCK_RESTRICT_SELF: i64 = 446;
const O_PATH: c_int = 0o10000000;
const O_CLOEXEC: c_int = 0o2000000;
#[cfg(target_arch = "x86_64")]
const O_NOFOLLOW: c_int = 0o400000;
#[cfg(target_arch = "aarch64")]
const O_NOFOLLOW: c_int = 0o100000;

const AT_FDCWD: c_int = -100;
const AT_RECURSIVE: u32 = 0x8000;
const MS_BIND: u64 = 4096;
const MS_REC: u64 = 16384;
const MS_SLAVE: u64 = 1 << 19;
const MS_NOSUID: u64 = 2;
const MS_NODEV: u64 = 4;
const MNT_DETACH: c_int = 2;
const SIGCHLD: c_int = 17;
const SIGKILL: c_int = 9;
const SIGTERM: c_int = 15;
const SIGUSR1: c_int = 10;
const PR_SET_CHILD_SUBREAPER: c_int = 36;
const SIG_BLOCK: c_int = 0;
const SFD_CLOEXEC: c_int = 0o2000000;
const SFD_NONBLOCK: c_int = 0o4000;
const WNOHANG: c_int = 1;
const POLLIN: i16 = 1;
const POLLERR: i16 = 8;
const POLLHUP: i16 = 16;
const MSG_CMSG_CLOEXEC: c_int = 0x40000000;
const MSG_TRUNC: c_int = 0x20;
const MSG_CTRUNC: c_int = 0x8;
const F_SETFD: c_int = 2;
const PR_SET_NO_NEW_PRIVS: c_int = 38;
const PR_SET_NAME: c_int = 15;
const PR_CAPBSET_DROP: c_int = 24;
const PR_CAP_AMBIENT: c_int = 47;
const PR_CAP_AMBIENT_CLEAR_ALL: c_int = 4;
const PR_SET_SECUREBITS: c_int = 28;
const SECBITS_LOCKED_NOROOT: c_int = 0x1 | 0x2 | 0x4 | 0x8 | 0x20;
const SECCOMP_SET_MODE_FILTER: c_int = 1;
const SIOCGIFFLAGS: u64 = 0x8913;
const SIOCSIFFLAGS: u64 = 0x8914;
const IFF_UP: i16 = 1;

const CTL: RawFd = 3;

/// The calling thread's `errno`.
fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// `s` as a C string; an interior NUL is `EINVAL`.
fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from_raw_os_error(22))
}

/// The string's pointer, or NULL for `None`.
fn opt_ptr(c: &Option<CString>) -> *const c_char {
    c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())
}

/// A C call's result: negative means failed, with `errno` set.
fn check(r: c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Where this process's replies go: the control socket, or (a supervisor serving an exec the
/// library handed it directly, see [`fork_spare`]) that exec's own socket.
static REPLY_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(CTL);

/// Sends a reply (`kind`, `id`, `payload`) to the library; failures are ignored (the
/// library is gone).
fn send(kind: u32, id: u64, payload: &[u8]) {
    let mut e = Enc::header(kind, id);
    e.0.extend_from_slice(payload);
    let fd = REPLY_FD.load(std::sync::atomic::Ordering::Relaxed);
    if fd == CTL {
        // SAFETY: writes a buffer we own to our control socket.
        unsafe {
            write(CTL, e.0.as_ptr(), e.0.len());
        }
    } else {
        // The library may have hung up its end: no SIGPIPE.
        let _ = send_with_fds(fd, &e.0, &[]);
    }
}

/// Reports that request `id` failed at op `index` (`u32::MAX`: the request itself).
fn send_err(id: u64, index: u32, err: &io::Error, what: &str) {
    send(REP_ERR, id, &err_payload(index, err, what));
}

/// A `REP_ERR` payload: u32 op index, i32 errno (0 if none), message (`what: err`).
fn err_payload(index: u32, err: &io::Error, what: &str) -> Vec<u8> {
    let mut e = Enc::default();
    e.u32(index);
    e.i32(err.raw_os_error().unwrap_or(0));
    e.str(&format!("{what}: {err}"));
    e.0
}

/// Runs one setup op; `fds` are the request's remaining file descriptors ([`Op::Lower`]
/// takes the first).
fn run_op(op: &Op, fds: &mut Vec<OwnedFd>) -> io::Result<()> {
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
        Op::Mkdir { path, mode } => {
            use std::os::unix::fs::DirBuilderExt;
            match std::fs::DirBuilder::new()
                .recursive(true)
                .mode(*mode)
                .create(path)
            {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
                Err(e) => Err(e),
            }
        }
        Op::WriteFile { path, mode, data } => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(*mode)
                .open(path)?;
            f.write_all(data)
        }
        Op::Touch { path } => {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o644)
                .open(path)
                .map(|_| ())
        }
        Op::Symlink { target, path } => std::os::unix::fs::symlink(target, path),
        Op::Chown { path, uid, gid } => std::os::unix::fs::lchown(path, Some(*uid), Some(*gid)),
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

/// `prctl(PR_SET_NO_NEW_PRIVS)`: no exec may gain privileges (set-id bits, file
/// capabilities); required before an unprivileged Landlock or seccomp restriction.
fn no_new_privs() -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    check(unsafe { prctl(PR_SET_NO_NEW_PRIVS, 1u64, 0u64, 0u64, 0u64) })
}

#[repr(C)]
struct LlRulesetAttr {
    handled_access_fs: u64,
}

#[repr(C, packed)]
struct LlPathBeneath {
    allowed_access: u64,
    parent_fd: i32,
}

/// Restricts this process (and so every exec) to writing beneath the rules' paths.
fn landlock(handled: u64, rules: &[(String, u64)]) -> io::Result<()> {
    let attr = LlRulesetAttr {
        handled_access_fs: handled,
    };
    // SAFETY: landlock_create_ruleset with a valid attr of the stated size.
    let rs = unsafe {
        syscall(
            NR_LANDLOCK_CREATE_RULESET,
            &attr as *const LlRulesetAttr,
            8usize,
            0u32,
        )
    };
    if rs < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new fd that we now own.
    let rs = unsafe { OwnedFd::from_raw_fd(rs as RawFd) };
    for (path, rights) in rules {
        let c = cstr(path)?;
        // SAFETY: open(2) O_PATH of a NUL-terminated path.
        let fd = unsafe { libc_open(c.as_ptr(), O_PATH | O_CLOEXEC | O_NOFOLLOW) };
        if fd < 0 {
            if errno() == 2 {
                continue;
            }
            return Err(io::Error::last_os_error());
        }
        // SAFETY: we own the new fd.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let rule = LlPathBeneath {
            allowed_access: rights & handled,
            parent_fd: fd.as_raw_fd(),
        };
        // SAFETY: landlock_add_rule(PATH_BENEATH) with a valid packed attr.
        if unsafe {
            syscall(
                NR_LANDLOCK_ADD_RULE,
                rs.as_raw_fd(),
                1u32,
                &rule as *const LlPathBeneath,
                0u32,
            )
        } < 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    no_new_privs()?;
    // SAFETY: landlock_restrict_self(ruleset_fd, 0).
    check(unsafe { syscall(NR_LANDLOCK_RESTRICT_SELF, rs.as_raw_fd(), 0u32) } as c_int)
}

/// Installs the seccomp filter on this process (inherited by every exec).
fn seccomp(bpf: &[u8]) -> io::Result<()> {
    let prog = bpf_program(bpf)?;
    let fprog = SockFprog {
        len: prog.len() as u16,
        filter: prog.as_ptr(),
    };
    no_new_privs()?;
    // SAFETY: seccomp(SET_MODE_FILTER, 0, &fprog) with a program that outlives the call.
    check(unsafe {
        syscall(
            nr::SECCOMP,
            SECCOMP_SET_MODE_FILTER,
            0u32,
            &fprog as *const SockFprog,
        )
    } as c_int)
}

/// The largest classic BPF program the kernel takes (`BPF_MAXINSNS`).
const BPF_MAXINSNS: usize = 4096;

/// A seccomp filter's `struct sock_filter` array, as the library sent it (8 bytes per
/// instruction, native endian), in 8-byte-aligned memory: `EINVAL` unless it holds 1 to
/// [`BPF_MAXINSNS`] whole instructions.
fn bpf_program(bpf: &[u8]) -> io::Result<Vec<u64>> {
    if !bpf.len().is_multiple_of(8) || bpf.is_empty() || bpf.len() / 8 > BPF_MAXINSNS {
        return Err(io::Error::from_raw_os_error(22));
    }
    Ok(bpf
        .chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u64::from_ne_bytes(a)
        })
        .collect())
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
fn setup(id: u64, payload: &[u8], mut fds: Vec<OwnedFd>) -> Option<bool> {
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

/// Writes `msg` to `fd` (best effort: a message for a reader that may be gone).
fn raw_write(fd: RawFd, msg: &[u8]) {
    // SAFETY: writes a live buffer to an fd.
    unsafe {
        write(fd, msg.as_ptr(), msg.len());
    }
}

/// Empties the bounding set (the init keeps its own capabilities; what it starts cannot
/// regain any through `execve`).
fn drop_bounding_set() -> io::Result<()> {
    for cap in 0..64u64 {
        // SAFETY: prctl with integer arguments.
        if unsafe { prctl(PR_CAPBSET_DROP, cap, 0u64, 0u64, 0u64) } < 0 {
            // EINVAL: past the kernel's last capability, so all are gone.
            return match errno() {
                22 if cap > 0 => Ok(()),
                _ => Err(io::Error::last_os_error()),
            };
        }
    }
    Ok(())
}

/// Drops every capability and privilege in the command's child, between clone and exec
/// (the bounding set is already empty: see [`drop_bounding_set`]). Makes system calls only:
/// no allocation (the child shares the supervisor's memory).
fn drop_privileges(spec_flags: u32, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: prctl/setgroups/setres*id/capset with integer arguments and valid structs.
    unsafe {
        let stay_root = spec_flags & EXEC_STAY_ROOT != 0;
        if stay_root {
            // uid 0 must not regain capabilities on exec.
            check(prctl(
                PR_SET_SECUREBITS,
                SECBITS_LOCKED_NOROOT as u64,
                0u64,
                0u64,
                0u64,
            ))?;
        }
        prctl(
            PR_CAP_AMBIENT,
            PR_CAP_AMBIENT_CLEAR_ALL as u64,
            0u64,
            0u64,
            0u64,
        );
        if !stay_root {
            check(setgroups(0, std::ptr::null()))?;
            check(setresgid(gid, gid, gid))?;
            check(setresuid(uid, uid, uid))?;
        }
        let hdr = CapHeader {
            version: 0x2008_0522,
            pid: 0,
        };
        let data = [
            CapData {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
            CapData {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
        ];
        check(syscall(nr::CAPSET, &hdr as *const CapHeader, data.as_ptr()) as c_int)?;
    }
    Ok(())
}

/// The init's view of the execs it runs.
struct Running {
    /// Supervisor pid -> exec id.
    sups: HashMap<i32, u64>,
    /// Exec id -> supervisor pid.
    by_id: HashMap<u64, i32>,
    /// Execs whose tree was asked to die (acknowledged when their supervisor is gone).
    kills: std::collections::HashSet<u64>,
    /// The pid of the supervisor forked ahead of time, until it served an exec (see
    /// [`fork_spare`]).
    spare: Option<i32>,
    /// Whether the sandbox is sealed (only then may a spare be forked: it must inherit the
    /// seal) and a spare should be made when the loop is next idle.
    sealed: bool,
    want_spare: bool,
}

/// Forks a spare supervisor: a fork of the sealed init that waits for one exec on a socket
/// whose other end goes to the library (`REP_SPARE`, as an fd), which then hands it an exec
/// (`MSG_EXEC`, id, the exec payload, its fds) **directly**: no `fork` and no hop through
/// the init on the exec's critical path. The replies of that exec (`EXITED`, kill
/// acknowledgements) travel back on the same socket, and a `MSG_KILL` there kills its tree.
/// An exec that leaves nothing behind hands the spare back to the library for the next one
/// (see [`supervise`]); otherwise, once its command has exited (and the reply is out), the
/// spare signals us (`SIGUSR1`) and the next spare is forked. The first one is forked right
/// after the seal. Execs the library sends us instead (no spare at hand: concurrent execs, a
/// payload too big for one packet) get a supervisor forked on demand.
fn fork_spare(run: &mut Running, sfd: RawFd) {
    if run.spare.is_some() || !run.sealed {
        return;
    }
    let Ok((lib, ours)) = socket_pair() else {
        return;
    };
    // SAFETY: the init is single-threaded; the child only waits for its job, then
    // continues in `supervise`.
    let pid = unsafe { fork() };
    if pid < 0 {
        return;
    }
    if pid == 0 {
        drop(lib);
        let mut stack = child_stack();
        let mut buf = vec![0u8; PACKET_MAX];
        loop {
            match recv_on(ours.as_raw_fd(), &mut buf) {
                Ok(Some((n, fds))) => {
                    let mut d = Dec::new(&buf[..n]);
                    match (d.u32(), d.u64(), d.exec()) {
                        (Ok(MSG_EXEC), Ok(id), Ok(spec)) => {
                            supervise(id, spec, fds, sfd, Some(&ours), &mut stack)
                        }
                        // Anything else (a late kill request after a reusable `EXITED`): the
                        // library will not hand us another exec.
                        _ => std::process::exit(0),
                    }
                }
                Err(e) if e.raw_os_error() == Some(4) => {}
                _ => std::process::exit(0),
            }
        }
    }
    drop(ours);
    let e = Enc::header(REP_SPARE, 0);
    if send_with_fds(CTL, &e.0, &[lib]).is_ok() {
        run.spare = Some(pid);
    } else {
        // SAFETY: kills our own child (reaped by the SIGCHLD path).
        unsafe { kill(pid, SIGKILL) };
    }
}

/// Sends `data` with `fds` (at most 4) on a `SOCK_SEQPACKET` socket.
fn send_with_fds(sock: RawFd, data: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
    if fds.len() > 4 {
        return Err(io::Error::from_raw_os_error(7 /* E2BIG */));
    }
    let mut iov = IoVec {
        base: data.as_ptr() as *mut c_void,
        len: data.len(),
    };
    // struct cmsghdr { size_t len; int level; int type; } + up to 4 fds.
    let mut ctl = [0u64; 4];
    let c = ctl.as_mut_ptr() as *mut u8;
    let len = 16 + 4 * fds.len();
    // SAFETY: writes within `ctl` (32 bytes: a 16-byte header and 4 fds).
    unsafe {
        std::ptr::write_unaligned(c as *mut usize, len);
        std::ptr::write_unaligned(c.add(8) as *mut i32, 1 /* SOL_SOCKET */);
        std::ptr::write_unaligned(c.add(12) as *mut i32, 1 /* SCM_RIGHTS */);
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(c.add(16 + 4 * i) as *mut i32, fd.as_raw_fd());
        }
    }
    let msg = MsgHdr {
        name: std::ptr::null_mut(),
        namelen: 0,
        iov: &mut iov,
        iovlen: 1,
        control: if fds.is_empty() {
            std::ptr::null_mut()
        } else {
            c as *mut c_void
        },
        controllen: if fds.is_empty() { 0 } else { (len + 7) & !7 },
        flags: 0,
    };
    // SAFETY: the message points at live buffers of the stated sizes.
    if unsafe {
        sendmsg(sock, &msg, 0x4000 /* MSG_NOSIGNAL */)
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// CLOCK_MONOTONIC in nanoseconds (the sandbox's time namespace keeps the host's offsets).
fn monotonic_ns() -> u64 {
    let mut ts = [0i64; 2];
    // SAFETY: clock_gettime into a timespec-sized local.
    unsafe {
        clock_gettime(1 /* CLOCK_MONOTONIC */, &mut ts)
    };
    (ts[0] as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts[1] as u64)
}

/// Reports how an exec ended; `started` is when the command was running (CLOCK_MONOTONIC
/// ns, 0 if it never started): carried here instead of in a message of its own, so the
/// library is not woken while the command runs.
fn exited(id: u64, status: i32, spawned: bool, started: u64) {
    exited_with(id, status, spawned, started, 0);
}

/// [`exited`] with `flags` ([`EXITED_REUSABLE`]).
fn exited_with(id: u64, status: i32, spawned: bool, started: u64, flags: u8) {
    send(
        REP_EXITED,
        id,
        &exited_payload(status, spawned, started, flags),
    );
}

/// A `REP_EXITED` payload: i32 wait status, u8 spawned, u64 start time, u8 flags.
fn exited_payload(status: i32, spawned: bool, started: u64, flags: u8) -> Vec<u8> {
    let mut e = Enc::default();
    e.i32(status);
    e.u8(u8::from(spawned));
    e.u64(started);
    e.u8(flags);
    e.0
}

/// Starts exec `id`: forks a supervisor that is a child subreaper, so every process of the
/// exec's tree (even after `setsid` or a double fork) stays its descendant until the
/// command exits; the supervisor can then kill the whole tree on request (SIGTERM).
fn exec(id: u64, payload: &[u8], fds: Vec<OwnedFd>, run: &mut Running, sfd: RawFd) {
    let spec = match Dec::new(payload).exec() {
        Ok(s) => s,
        Err(_) => return send_err(id, 0, &io::Error::from_raw_os_error(22), "malformed exec"),
    };
    // SAFETY: the init is single-threaded; the child continues in `supervise`.
    let pid = unsafe { fork() };
    if pid < 0 {
        let e = io::Error::last_os_error();
        if let Some(fd) = fds.get(1) {
            raw_write(
                fd.as_raw_fd(),
                format!("agent-sandbox: fork: {e}\n").as_bytes(),
            );
        }
        return exited(id, 126 << 8, false, 0);
    }
    if pid == 0 {
        supervise(id, spec, fds, sfd, None, &mut child_stack());
        std::process::exit(0);
    }
    drop(fds);
    run.sups.insert(pid, id);
    run.by_id.insert(id, pid);
}

/// The stack a supervisor's vfork child runs on before it execs (see [`spawn`]).
const CHILD_STACK: usize = 64 * 1024;

/// A stack for [`spawn`], every page written once: a supervisor makes it while it waits
/// (a spare), so the copy-on-write faults are not taken on an exec's critical path.
fn child_stack() -> Vec<u8> {
    let mut stack = vec![0u8; CHILD_STACK];
    for i in (0..CHILD_STACK).step_by(4096) {
        // SAFETY: an in-bounds write; volatile so the touch is not optimized away.
        unsafe { std::ptr::write_volatile(stack.as_mut_ptr().add(i), 0) };
    }
    stack
}

/// Runs exec `id` as its supervisor (a child subreaper). `job`: the exec's own socket to the
/// library (a spare's), which then carries the replies and kill requests.
///
/// Returns (a spare's supervisor only) when the exec is over and left nothing behind: its
/// command exited, no descendant is left, no kill was asked for and the library still
/// listens. `EXITED` then says so ([`EXITED_REUSABLE`]) and the supervisor waits for the next
/// exec on the same socket: no fork, and no fresh process's page faults, per exec. Otherwise
/// it leaves once the last of the exec's tree is gone.
fn supervise(
    id: u64,
    spec: ExecSpec,
    fds: Vec<OwnedFd>,
    sfd: RawFd,
    job: Option<&OwnedFd>,
    stack: &mut [u8],
) {
    // SAFETY: prctl with integer arguments.
    unsafe { prctl(PR_SET_CHILD_SUBREAPER, 1u64, 0u64, 0u64, 0u64) };
    if let Some(j) = job {
        REPLY_FD.store(j.as_raw_fd(), std::sync::atomic::Ordering::Relaxed);
    }
    let mut job_fd = job.map_or(-1, |j| j.as_raw_fd());
    // We keep our copies of the command's stdout and stderr until `EXITED` is out: when
    // the command exits, its closing them then wakes no one (the library's readers would
    // otherwise be woken twice, each preempting the exiting command, before our report).
    // The library reads what is left when `EXITED` comes, without waiting for EOF.
    let Some((leader, started, outputs)) = spawn(id, spec, fds, stack) else {
        std::process::exit(0)
    };
    let mut outputs = Some(outputs);
    let mut leader_done = false;
    let mut killed = false;
    loop {
        let mut pfd = [
            PollFd {
                fd: sfd,
                events: POLLIN,
                revents: 0,
            },
            PollFd {
                // Negative: ignored by poll.
                fd: job_fd,
                events: POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        unsafe { poll(pfd.as_mut_ptr(), 2, -1) };
        let mut kill_tree = false;
        let mut info = [0u8; 128];
        // SAFETY: reads whole signalfd_siginfo records into a local buffer.
        while unsafe { read(sfd, info.as_mut_ptr(), info.len()) } == 128 {
            if u32::from_ne_bytes([info[0], info[1], info[2], info[3]]) == SIGTERM as u32 {
                kill_tree = true;
            }
        }
        if pfd[1].revents != 0 {
            let mut buf = [0u8; 64];
            match recv_on(job_fd, &mut buf) {
                Ok(Some((n, _))) => {
                    if Dec::new(&buf[..n]).u32() == Ok(MSG_KILL) {
                        kill_tree = true;
                    }
                }
                Err(e) if e.raw_os_error() == Some(4) => {}
                // The library hung up (the exec is over for it): stop listening.
                _ => job_fd = -1,
            }
        }
        if kill_tree {
            killed = true;
            kill_descendants();
            // Acknowledge: the tree is gone (the library may wait for this).
            send(REP_OK, id, &[]);
        }
        loop {
            let mut status: c_int = 0;
            // SAFETY: waitpid with a valid status pointer.
            let p = unsafe { waitpid(-1, &mut status, WNOHANG) };
            if p < 0 && leader_done {
                // No descendant left (ECHILD): this exec is over.
                std::process::exit(0);
            }
            if p <= 0 {
                break;
            }
            if p == leader {
                // Orphans of the tree were reparented to us before the leader's death was
                // reported: none now means none at all (ECHILD).
                // SAFETY: waitpid with a null status pointer, not blocking.
                let alone = unsafe { waitpid(-1, std::ptr::null_mut(), WNOHANG) } < 0;
                if job_fd >= 0 && alone && !killed {
                    exited_with(id, status, true, started, EXITED_REUSABLE);
                    return;
                }
                exited(id, status, true, started);
                drop(outputs.take());
                if job.is_some() {
                    // A spare served this exec and cannot take another: the init forks the
                    // next one now, after the reply (forking while the command ran competed
                    // with it for the CPUs).
                    // SAFETY: signals our parent, the init.
                    unsafe { kill(getppid(), SIGUSR1) };
                }
                // What the command left running stays our descendant (we are its subreaper),
                // so it can still be killed as this exec's tree; we leave with the last of it.
                leader_done = true;
            }
        }
    }
}

/// SIGKILLs every descendant of this process until none is left (bounded).
fn kill_descendants() {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { getpid() };
    for _ in 0..2000 {
        let mut parent: HashMap<i32, i32> = HashMap::new();
        if let Ok(rd) = std::fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                    continue;
                };
                let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                    continue;
                };
                if let Some(ppid) = live_parent(&stat) {
                    parent.insert(pid, ppid);
                }
            }
        }
        let victims = descendants(&parent, me);
        if victims.is_empty() {
            return;
        }
        for v in victims {
            // SAFETY: signals a process of our own subtree.
            unsafe { kill(v, SIGKILL) };
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// The parent pid in a `/proc/<pid>/stat` line, or `None` for a process that is gone (a
/// zombie or dead) or a line without the `(comm)` field. The command name may hold spaces
/// and parentheses: the fields that follow start after its *last* `)`.
fn live_parent(stat: &str) -> Option<i32> {
    let rest = stat.rfind(')').and_then(|i| stat.get(i + 1..))?;
    let mut f = rest.split_whitespace();
    let state = f.next().unwrap_or("");
    let ppid = f.next().and_then(|p| p.parse::<i32>().ok()).unwrap_or(0);
    (state != "Z" && state != "X").then_some(ppid)
}

/// The pids in `parent` (pid -> parent pid) that descend from `me`, following at most 4096
/// links up (a cycle, possible in a snapshot of a changing `/proc`, ends the walk).
fn descendants(parent: &HashMap<i32, i32>, me: i32) -> Vec<i32> {
    let mut victims = Vec::new();
    for &pid in parent.keys() {
        let mut p = pid;
        for _ in 0..4096 {
            match parent.get(&p) {
                Some(&pp) if pp == me => {
                    victims.push(pid);
                    break;
                }
                Some(&pp) if pp > 1 => p = pp,
                _ => break,
            }
        }
    }
    victims
}

/// Everything the command's child needs, prepared before the clone: the child shares the
/// supervisor's memory (`CLONE_VM | CLONE_VFORK`) and must not allocate, so it only reads
/// this and makes system calls. It reports a failure in `stage`/`errno`.
struct Child {
    /// Executables to try, in order (the `PATH` search is done here, not in the child).
    paths: Vec<CString>,
    /// NULL-terminated argv; `argv[0]` is the command as given.
    argv: Vec<*const c_char>,
    /// argv for running a file without a `#!` line through `/bin/sh` (like `execvp`); slot
    /// 1 is filled with the candidate path in the child.
    sh_argv: Vec<*const c_char>,
    /// NULL-terminated `K=V` pointers.
    envp: Vec<*const c_char>,
    cwd: CString,
    stdin: RawFd,
    out: RawFd,
    err: RawFd,
    rlimits: Vec<(c_int, Rlimit)>,
    flags: u32,
    uid: u32,
    gid: u32,
    /// 0: exec'd; 1: set-up (rlimits, privileges) failed; 2: chdir failed; 3: exec failed.
    stage: c_int,
    errno: c_int,
    /// CLOCK_MONOTONIC ns at the first `execve` (the command's start, as the library reports
    /// it; taken here because the supervisor may wait for a CPU once the command runs).
    started: u64,
}

const SH: &std::ffi::CStr = c"/bin/sh";
const ENOENT: c_int = 2;
const EACCES: c_int = 13;
const ENOEXEC: c_int = 8;
const ENOTDIR: c_int = 20;
const CLONE_VM: c_int = 0x100;
const CLONE_VFORK: c_int = 0x4000;
const SIG_SETMASK: c_int = 2;

/// The command's child (see [`Child`]): stdio, process group, rlimits, privileges, working
/// directory, then `execve` of each candidate path in turn.
extern "C" fn child_main(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the supervisor's `Child`, alive and not touched by the supervisor
    // until we exec or exit (CLONE_VFORK). Only system calls below, no allocation.
    unsafe {
        let c = &mut *(arg as *mut Child);
        let empty = SigSet([0; 16]);
        sigprocmask(SIG_SETMASK, &empty, std::ptr::null_mut());
        if c.stdin >= 0 {
            dup2(c.stdin, 0);
        }
        dup2(c.out, 1);
        dup2(c.err, 2);
        // A process group of its own, in the sandbox's session (the init's, made by
        // `bootstrap`: no controlling terminal). Not a session per exec: `setsid` makes a
        // scheduler autogroup each time, freed through RCU after the command exits.
        setpgid(0, 0);
        let mut failed = false;
        for (r, l) in &c.rlimits {
            if setrlimit(*r, l) < 0 {
                failed = true;
                break;
            }
        }
        if failed || drop_privileges(c.flags, c.uid, c.gid).is_err() {
            c.stage = 1;
            c.errno = errno();
            _exit(126);
        }
        if chdir(c.cwd.as_ptr()) < 0 {
            c.stage = 2;
            c.errno = errno();
            _exit(126);
        }
        let mut seen = ENOENT;
        c.started = monotonic_ns();
        for p in &c.paths {
            execve(p.as_ptr(), c.argv.as_ptr(), c.envp.as_ptr());
            match errno() {
                ENOEXEC => {
                    c.sh_argv[1] = p.as_ptr();
                    execve(SH.as_ptr(), c.sh_argv.as_ptr(), c.envp.as_ptr());
                    seen = errno();
                    break;
                }
                EACCES => seen = EACCES,
                ENOENT | ENOTDIR => {}
                e => {
                    seen = e;
                    break;
                }
            }
        }
        c.stage = 3;
        c.errno = seen;
        _exit(127)
    }
}

/// Where to look for `cmd`: itself if it has a `/`, else each directory of the command's own
/// `PATH` (like `execvp`; an empty entry is the working directory).
fn candidates(cmd: &str, env: &[String]) -> Vec<String> {
    if cmd.contains('/') {
        return vec![cmd.to_string()];
    }
    let path = env
        .iter()
        .find_map(|kv| kv.strip_prefix("PATH="))
        .unwrap_or("/usr/local/bin:/usr/bin:/bin");
    path.split(':')
        .map(|d| {
            if d.is_empty() {
                cmd.to_string()
            } else {
                format!("{}/{cmd}", d.trim_end_matches('/'))
            }
        })
        .collect()
}

/// Starts the command (in the supervisor) with a vfork-style clone: no copy of our page
/// tables, no copy-on-write faults, and we resume once it has exec'd (or failed). Returns the
/// leader's pid and when it was started (see [`Child::started`]), or `None` after reporting why it
/// could not start.
fn spawn(
    id: u64,
    spec: ExecSpec,
    fds: Vec<OwnedFd>,
    stack: &mut [u8],
) -> Option<(i32, u64, [OwnedFd; 2])> {
    let mut fds = fds.into_iter();
    let (Some(out), Some(err)) = (fds.next(), fds.next()) else {
        send_err(
            id,
            0,
            &io::Error::from_raw_os_error(9),
            "exec needs stdout and stderr",
        );
        return None;
    };
    let stdin = if spec.flags & EXEC_STDIN != 0 {
        fds.next()
    } else {
        None
    };
    let fail = |code: i32, msg: String| {
        raw_write(err.as_raw_fd(), msg.as_bytes());
        exited(id, code << 8, false, 0);
        None
    };
    if spec.argv.is_empty() || spec.argv[0].is_empty() {
        return fail(127, "agent-sandbox: empty command\n".into());
    }
    let a0 = spec.argv[0].clone();
    let cs = |v: &[String]| v.iter().map(|a| cstr(a)).collect::<io::Result<Vec<_>>>();
    let (Ok(argv), Ok(env), Ok(paths), Ok(cwd)) = (
        cs(&spec.argv),
        cs(&spec.env),
        cs(&candidates(&a0, &spec.env)),
        cstr(&spec.cwd),
    ) else {
        return fail(126, "agent-sandbox: NUL byte in the command\n".into());
    };
    let ptrs = |v: &[CString]| {
        v.iter()
            .map(|c| c.as_ptr())
            .chain([std::ptr::null()])
            .collect::<Vec<_>>()
    };
    let mut sh_argv = vec![SH.as_ptr(), std::ptr::null()];
    sh_argv.extend(argv.iter().skip(1).map(|c| c.as_ptr()));
    sh_argv.push(std::ptr::null());
    let mut job = Child {
        paths,
        argv: ptrs(&argv),
        sh_argv,
        envp: ptrs(&env),
        cwd,
        stdin: stdin.as_ref().map_or(-1, |f| f.as_raw_fd()),
        out: out.as_raw_fd(),
        err: err.as_raw_fd(),
        rlimits: spec
            .rlimits
            .iter()
            .map(|&(r, s, h)| (r as c_int, Rlimit { cur: s, max: h }))
            .collect(),
        flags: spec.flags,
        uid: spec.uid,
        gid: spec.gid,
        stage: 0,
        errno: 0,
        started: 0,
    };
    // SAFETY: the child runs `child_main` on its own stack (the top of `stack`, 16-byte
    // aligned) with `job`; CLONE_VFORK suspends us until it has exec'd or exited, so both
    // outlive its use of them.
    let pid = unsafe {
        let top = stack.as_mut_ptr().add(stack.len()) as usize & !15;
        clone(
            child_main,
            top as *mut c_void,
            CLONE_VM | CLONE_VFORK | SIGCHLD,
            &mut job as *mut Child as *mut c_void,
        )
    };
    if pid < 0 {
        let e = io::Error::last_os_error();
        return fail(126, format!("agent-sandbox: {a0}: {e}\n"));
    }
    if job.stage == 0 {
        return Some((pid, job.started, [out, err]));
    }
    // It exited without exec'ing: reap it and say why.
    let mut status: c_int = 0;
    // SAFETY: waitpid on our own child with a valid status pointer.
    unsafe { waitpid(pid, &mut status, 0) };
    let e = io::Error::from_raw_os_error(job.errno);
    match (job.stage, job.errno) {
        (2, _) => fail(
            126,
            format!("agent-sandbox: cannot enter working directory: {e}\n"),
        ),
        (3, ENOENT) => fail(127, format!("agent-sandbox: {a0}: command not found\n")),
        (3, EACCES) => fail(126, format!("agent-sandbox: {a0}: permission denied\n")),
        _ => fail(126, format!("agent-sandbox: {a0}: {e}\n")),
    }
}

/// Reaps every child that has exited: a spare that died, a supervisor whose exec is over
/// (acknowledging a pending kill; reporting one that was killed itself).
fn reap(run: &mut Running) {
    loop {
        let mut status: c_int = 0;
        // SAFETY: waitpid with a valid status pointer.
        let pid = unsafe { waitpid(-1, &mut status, WNOHANG) };
        if pid <= 0 {
            return;
        }
        if run.spare == Some(pid) {
            // The spare died idle (killed), or served an exec that is now over.
            run.spare = None;
            run.want_spare = true;
        }
        if let Some(id) = run.sups.remove(&pid) {
            run.by_id.remove(&id);
            // An exec is over: a good moment for the next spare.
            run.want_spare = true;
            if run.kills.remove(&id) {
                send(REP_OK, id, &[]);
            }
            // A supervisor exits 0 after reporting; anything else means it was killed.
            if status != 0 {
                exited(id, status, true, 0);
            }
        }
    }
}

/// Receives one packet; `Ok(None)` when the library is gone.
fn recv(buf: &mut [u8]) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    recv_on(CTL, buf)
}

/// [`recv`] on another socket.
fn recv_on(sock: RawFd, buf: &mut [u8]) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut ctl = [0u64; 32];
    let mut iov = IoVec {
        base: buf.as_mut_ptr(),
        len: buf.len(),
    };
    let mut msg = MsgHdr {
        name: std::ptr::null_mut(),
        namelen: 0,
        iov: &mut iov,
        iovlen: 1,
        control: ctl.as_mut_ptr() as *mut c_void,
        controllen: std::mem::size_of_val(&ctl),
        flags: 0,
    };
    // SAFETY: msghdr points at live buffers of the stated sizes.
    let n = unsafe { recvmsg(sock, &mut msg, MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    let ctl_bytes = ctl.as_ptr() as *const u8;
    let mut off = 0usize;
    while off + 16 <= msg.controllen {
        // SAFETY: reads a cmsghdr within the control buffer the kernel filled.
        let (len, level, ty) = unsafe {
            let p = ctl_bytes.add(off);
            (
                std::ptr::read_unaligned(p as *const usize),
                std::ptr::read_unaligned(p.add(8) as *const i32),
                std::ptr::read_unaligned(p.add(12) as *const i32),
            )
        };
        if len < 16 || off + len > msg.controllen {
            break;
        }
        if level == 1 && ty == 1 {
            for k in 0..(len - 16) / 4 {
                // SAFETY: SCM_RIGHTS data is an array of fds now owned by us.
                let fd = unsafe {
                    std::ptr::read_unaligned(ctl_bytes.add(off + 16 + 4 * k) as *const i32)
                };
                // SAFETY: the kernel installed this fd for us.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        off += (len + 7) & !7;
    }
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    if msg.flags & (MSG_TRUNC | MSG_CTRUNC) != 0 {
        return Err(io::Error::from_raw_os_error(90));
    }
    Ok(Some((n as usize, fds)))
}

/// Finishes the namespaces. The zygote cloned us as pid 1 of a new pid namespace, in a new
/// user namespace (one process, no extra `clone` for pid 1); the mount, UTS, IPC and network
/// namespaces are made here (a spare has them) while the library makes the cgroups. The
/// library wrote our id maps before `START`, and `MAPS` follows it at once.
fn bootstrap() {
    let die = |code: i32, what: &str| -> ! {
        send_err(0, 0, &io::Error::last_os_error(), what);
        std::process::exit(code)
    };
    // SAFETY: unshare/setres*id/write on our own, single-threaded process.
    unsafe {
        let mut buf = [0u8; 64];
        // A spare (cloned ahead of time, with all its namespaces) brings its `lo` up while
        // it waits; if that fails, the library does it and reports the error.
        let lo_up =
            AHEAD.load(Ordering::Relaxed) && run_op(&Op::LoopbackUp, &mut Vec::new()).is_ok();
        // Nothing happens before the library asks (we may have been cloned ahead of time).
        match recv(&mut buf) {
            Ok(Some((n, _))) if n >= 12 && Dec::new(&buf[..n]).u32() == Ok(MSG_START) => {}
            _ => std::process::exit(0),
        }
        let mut boot = Enc::default();
        boot.u64(SOURCE_HASH);
        boot.u8(if lo_up { BOOT_LO_UP } else { 0 });
        send(REP_BOOT, 0, &boot.0);
        // The sandbox's own session, with no controlling terminal: nothing inside can reach
        // the terminal of the library's session (`/dev/tty`, TIOCSTI). Every exec is a
        // process group of it.
        if setsid() < 0 {
            die(84, "setsid");
        }
        // Creating them needs only the capabilities we hold in the new user namespace, which
        // owns them (a new network namespace alone costs ~0.4 ms). A spare has them already.
        if !AHEAD.load(Ordering::Relaxed)
            && unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET) < 0
        {
            die(83, "unshare namespaces");
        }
        match recv(&mut buf) {
            Ok(Some((n, _))) if n >= 12 && Dec::new(&buf[..n]).u32() == Ok(MSG_MAPS) => {}
            _ => std::process::exit(81),
        }
        // Become root of the new namespace (our host ids may be unmapped there) and drop the
        // host's supplementary groups (refused rootless, where setgroups is denied).
        setgroups(0, std::ptr::null());
        if setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0 {
            die(82, "become root of the user namespace");
        }
        match recv(&mut buf) {
            Ok(Some((n, fds))) if n >= 12 && Dec::new(&buf[..n]).u32() == Ok(MSG_CGROUPS) => {
                // Join each cgroup by writing "0" (ourselves) to the file the library opened
                // (the kernel checks the opener's credentials). A single thread moving itself
                // through a v1 `tasks` file skips the global lock (and its RCU grace period)
                // that moving another process takes. Everything we start inherits them.
                for fd in fds {
                    if write(fd.as_raw_fd(), b"0".as_ptr(), 1) != 1 {
                        die(86, "join the sandbox's cgroups");
                    }
                }
            }
            _ => std::process::exit(85),
        }
        send(REP_INIT, 0, &[]);
    }
}

/// The fork server (`--zygote [TEMPLATES]`): started once per library process, it forks a
/// new init for every control socket it receives on fd 0 — a fork of this small, idle
/// process costs a fraction of a `posix_spawn` + `execve` of the init (and its libc
/// start-up, whose CPUID probing is slow under virtualization). Each child is cloned with
/// `CLONE_PARENT`, so it is the library's child like a spawned init; its pid is the reply
/// (`u32`; `0` and an errno on failure). Exits when the library closes the socket.
///
/// With `TEMPLATES` (as root), it also builds root-filesystem templates: it makes a mount
/// namespace of its own (a slave of the library's: host mounts still arrive, ours never
/// leave), mounts a tmpfs on `TEMPLATES`, and for each `T` request (`u64` index, the setup
/// ops in a memfd) runs the ops there, which build a template at `TEMPLATES/<index>`; the
/// reply is `1` (or `0` and an errno). It keeps both namespaces and clones each init in the
/// one it needs: template-mode inits (`P` requests, and spares) in the template namespace,
/// where a template is one recursive bind away; the others (`F`) in the library's own, so
/// their bind sources (workspaces, spec mounts, rootfs directories) are the library's
/// current view, whatever was mounted since.
fn zygote(templates: Option<&std::ffi::CStr>) -> ! {
    // SAFETY: prctl/close_range on our own process.
    unsafe {
        prctl(PR_SET_NAME, c"asb-zygote".as_ptr() as u64, 0u64, 0u64, 0u64);
        syscall(NR_CLOSE_RANGE, 3u32, u32::MAX, 0u32);
    }
    // Errno of the template set-up (0: ready); templates are refused with it otherwise.
    let mut tmpl_err = 95 /* EOPNOTSUPP */;
    // The library's mount namespace and ours (templates), as fds to `setns` between; -1
    // without templates (everything happens in the library's).
    let (mut host_ns, mut tmpl_ns) = (-1, -1);
    if let Some(dir) = templates {
        let ns_fd = || {
            // SAFETY: open(2) of a NUL-terminated path.
            unsafe { libc_open(c"/proc/self/ns/mnt".as_ptr(), O_CLOEXEC) }
        };
        host_ns = ns_fd();
        // SAFETY: unshare/mount with NUL-terminated paths, on our own single-threaded process.
        tmpl_err = unsafe {
            let tmpfs = c"tmpfs".as_ptr();
            let opts = c"mode=0711,size=64k".as_ptr() as *const c_void;
            if host_ns < 0
                || unshare(CLONE_NEWNS) < 0
                || mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    MS_REC | MS_SLAVE,
                    std::ptr::null(),
                ) < 0
                || mount(tmpfs, dir.as_ptr(), tmpfs, MS_NOSUID | MS_NODEV, opts) < 0
            {
                errno()
            } else {
                0
            }
        };
        tmpl_ns = ns_fd();
        if tmpl_err == 0 && tmpl_ns < 0 {
            tmpl_err = errno();
        }
    }
    let templates_ok = tmpl_ns >= 0 && tmpl_err == 0;
    // Which namespace we are in: true for the templates'.
    let mut in_tmpl = templates_ok;
    let mut enter = |tmpl: bool| -> bool {
        if tmpl_ns < 0 || tmpl == in_tmpl {
            return true;
        }
        let fd = if tmpl { tmpl_ns } else { host_ns };
        // SAFETY: setns(2) to a mount namespace fd we opened, single-threaded.
        if unsafe { setns(fd, CLONE_NEWNS) } < 0 {
            return false;
        }
        in_tmpl = tmpl;
        true
    };
    let mut buf = [0u8; 16];
    loop {
        let (n, fds) = match recv_on(0, &mut buf) {
            Ok(Some(m)) => m,
            Err(e) if e.raw_os_error() == Some(4) => continue,
            _ => std::process::exit(0),
        };
        if n == 1 && buf[0] == b'S' {
            // A spare init, cloned ahead of time on a socketpair of its own (in the template
            // namespace: spares serve template-mode creates); the reply carries our end.
            let (r, sent) = if !enter(templates_ok) {
                (Err(errno()), Vec::new())
            } else {
                match socket_pair() {
                    Ok((ours, theirs)) => match clone_init(theirs, true) {
                        pid if pid < 0 => (Err(errno()), Vec::new()),
                        pid => (Ok(pid as u32), vec![ours]),
                    },
                    Err(err) => (Err(err.raw_os_error().unwrap_or(5)), Vec::new()),
                }
            };
            if send_with_fds(0, &zygote_reply(r), &sent).is_err() {
                std::process::exit(0);
            }
            continue;
        }
        if n == 9 && buf[0] == b'T' {
            let r = if enter(true) {
                build_template(tmpl_err, fds).map(|()| 1)
            } else {
                Err(io::Error::last_os_error())
            };
            raw_write(
                0,
                &zygote_reply(r.map_err(|e| e.raw_os_error().unwrap_or(5))),
            );
            continue;
        }
        // `F`: an init in the library's namespace; `P`: one in the templates'.
        let tmpl = n >= 1 && buf[0] == b'P' && templates_ok;
        for fd in fds {
            let r = if !enter(tmpl) {
                Err(errno())
            } else {
                match clone_init(fd, false) {
                    pid if pid < 0 => Err(errno()),
                    pid => Ok(pid as u32),
                }
            };
            raw_write(0, &zygote_reply(r));
        }
    }
}

/// The zygote's 8-byte reply: a non-zero value (a pid, or 1), or 0 and an errno.
fn zygote_reply(r: Result<u32, i32>) -> Vec<u8> {
    let mut e = Enc::default();
    let (v, errno) = match r {
        Ok(v) => (v, 0),
        Err(errno) => (0, errno),
    };
    e.u32(v);
    e.i32(errno);
    e.0
}

/// Whether this init was cloned with all its namespaces (a spare, see [`clone_init`]).
static AHEAD: AtomicBool = AtomicBool::new(false);

/// Clones an init on control socket `ctl`: pid 1 of new user and pid namespaces (see
/// `bootstrap`), the library's child (`CLONE_PARENT`). Returns its pid (or -1, errno set).
///
/// A spare (`ahead`) gets its mount, UTS, IPC and network namespaces in the same `clone`
/// (all owned by its new user namespace, exactly as if it made them after `MSG_START`): a
/// spare waits for a create that has not come yet, so that work (~0.5 ms, mostly the network
/// namespace) is off the create's path. Other inits make them after `REP_BOOT`, in parallel
/// with the library's part of the bootstrap.
fn clone_init(ctl: OwnedFd, ahead: bool) -> i64 {
    let mut flags = CLONE_PARENT | CLONE_NEWUSER | CLONE_NEWPID;
    if ahead {
        flags |= CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET;
    }
    // SAFETY: single-threaded; the child only moves its fd into place and runs the init
    // from the top, like a freshly executed one.
    let pid = unsafe { syscall(NR_CLONE, flags as u64, 0u64, 0u64, 0u64, 0u64) };
    if pid == 0 {
        // SAFETY: fd plumbing on our own process: the socket becomes stdin, every other
        // inherited fd (e.g. our end of a spare's socketpair) goes.
        unsafe {
            dup2(ctl.as_raw_fd(), 0);
            syscall(NR_CLOSE_RANGE, 3u32, u32::MAX, 0u32);
        }
        std::mem::forget(ctl);
        AHEAD.store(ahead, Ordering::Relaxed);
        init_main();
    }
    pid
}

/// A close-on-exec `SOCK_SEQPACKET` socketpair.
fn socket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut sv = [0 as c_int; 2];
    // SAFETY: socketpair into a valid array; the fds are ours.
    unsafe {
        if socketpair(
            1, /* AF_UNIX */
            5 /* SOCK_SEQPACKET */ | O_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        ) < 0
        {
            return Err(io::Error::last_os_error());
        }
        Ok((OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])))
    }
}

/// Runs a template's ops (encoded in the memfd `fds[0]`), stopping at the first failure.
fn build_template(tmpl_err: i32, mut fds: Vec<OwnedFd>) -> io::Result<()> {
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

// Not the symbol `main` in unit tests: libtest's entry point is.
#[cfg_attr(not(test), no_mangle)]
extern "C" fn main(argc: c_int, argv: *const *const c_char) -> c_int {
    if argc > 1 {
        // SAFETY: glibc passes argc valid, NUL-terminated strings.
        let a1 = unsafe { std::ffi::CStr::from_ptr(*argv.add(1)) };
        if a1.to_bytes() == b"--zygote" {
            let templates = (argc > 2).then(|| {
                // SAFETY: as above.
                unsafe { std::ffi::CStr::from_ptr(*argv.add(2)) }
            });
            zygote(templates);
        }
    }
    init_main()
}

/// The init proper: bootstrap, then serve the library until it hangs up.
fn init_main() -> ! {
    // SAFETY: fd/signal plumbing on our own process at startup.
    let sfd = unsafe {
        prctl(PR_SET_NAME, c"asb-init".as_ptr() as u64, 0u64, 0u64, 0u64);
        // The library hands us the control socket as stdin: move it to fd 3.
        dup2(0, CTL);
        let null = libc_open(c"/dev/null".as_ptr(), 2 /* O_RDWR */);
        if null >= 0 {
            dup2(null, 0);
            dup2(null, 1);
            dup2(null, 2);
            if null > 3 {
                close(null);
            }
        }
        fcntl(CTL, F_SETFD, 1);
        syscall(NR_CLOSE_RANGE, 4u32, u32::MAX, 0u32);
        bootstrap();
        let mut set = SigSet([0; 16]);
        sigemptyset(&mut set);
        sigaddset(&mut set, SIGCHLD);
        sigaddset(&mut set, SIGTERM);
        sigaddset(&mut set, SIGUSR1);
        sigprocmask(SIG_BLOCK, &set, std::ptr::null_mut());
        signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK)
    };
    if sfd < 0 {
        std::process::exit(70);
    }
    let mut run = Running {
        sups: HashMap::new(),
        by_id: HashMap::new(),
        kills: Default::default(),
        spare: None,
        sealed: false,
        want_spare: false,
    };
    let mut buf = vec![0u8; PACKET_MAX];
    loop {
        if std::mem::take(&mut run.want_spare) {
            fork_spare(&mut run, sfd);
        }
        let mut pfd = [
            PollFd {
                fd: CTL,
                events: POLLIN,
                revents: 0,
            },
            PollFd {
                fd: sfd,
                events: POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfd structs.
        let r = unsafe { poll(pfd.as_mut_ptr(), 2, -1) };
        if r < 0 {
            if errno() == 4 {
                continue;
            }
            std::process::exit(71);
        }
        if pfd[1].revents != 0 {
            let mut info = [0u8; 128];
            // SAFETY: reads whole signalfd_siginfo records into a local buffer.
            while unsafe { read(sfd, info.as_mut_ptr(), info.len()) } == 128 {
                let field =
                    |o: usize| u32::from_ne_bytes([info[o], info[o + 1], info[o + 2], info[o + 3]]);
                // ssi_signo, ssi_code, ssi_pid: the spare's command is done (see
                // `fork_spare`). SI_USER (0): a kill(2), whose pid the kernel fills in (a
                // queued signal's pid is the sender's to choose).
                if field(0) == SIGUSR1 as u32
                    && field(8) == 0
                    && run.spare == Some(field(12) as i32)
                {
                    run.spare = None;
                    run.want_spare = true;
                }
            }
            reap(&mut run);
        }
        if pfd[0].revents & POLLIN != 0 {
            match recv(&mut buf) {
                Ok(None) => std::process::exit(0),
                Err(e) if e.raw_os_error() == Some(4) || e.raw_os_error() == Some(11) => continue,
                Err(_) => std::process::exit(72),
                Ok(Some((n, mut fds))) => {
                    let mut d = Dec::new(&buf[..n]);
                    let (Ok(kind), Ok(id)) = (d.u32(), d.u64()) else {
                        continue;
                    };
                    let mut big = Vec::new();
                    let payload: &[u8] = if kind & FLAG_BIG != 0 {
                        match fds.pop() {
                            Some(fd) => {
                                if File::from(fd).read_to_end(&mut big).is_err() {
                                    send_err(
                                        id,
                                        0,
                                        &io::Error::from_raw_os_error(5),
                                        "read payload",
                                    );
                                    continue;
                                }
                                &big
                            }
                            None => continue,
                        }
                    } else {
                        d.rest()
                    };
                    match kind & !FLAG_BIG {
                        MSG_SETUP => {
                            if let Some(sealed) = setup(id, payload, fds) {
                                if sealed {
                                    // The first spare goes out before the seal's reply, so
                                    // the first exec finds it (its fork would otherwise
                                    // delay that exec all the same).
                                    run.sealed = true;
                                    fork_spare(&mut run, sfd);
                                }
                                send(REP_OK, id, &[]);
                            }
                        }
                        MSG_EXEC => exec(id, payload, fds, &mut run, sfd),
                        MSG_KILL => {
                            reap(&mut run);
                            match run.by_id.get(&id) {
                                // SAFETY: asks the exec's supervisor to kill its tree; it
                                // acknowledges (or we do, if it exits first: see `reap`).
                                Some(sup) => unsafe {
                                    run.kills.insert(id);
                                    kill(*sup, SIGTERM);
                                },
                                None => send(REP_OK, id, &[]),
                            }
                        }
                        MSG_PING => send(REP_OK, id, &[]),
                        _ => send_err(id, 0, &io::Error::from_raw_os_error(22), "unknown request"),
                    }
                }
            }
        } else if pfd[0].revents & (POLLHUP | POLLERR) != 0 {
            std::process::exit(0);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::fs;
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::sync::atomic::AtomicU32;

    /// A fresh directory under the system's temporary directory, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            static N: AtomicU32 = AtomicU32::new(0);
            let p = std::env::temp_dir().join(format!(
                "container-init-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir(&p).unwrap();
            TempDir(p)
        }

        fn join(&self, p: &str) -> PathBuf {
            self.0.join(p)
        }

        fn at(&self, p: &str) -> String {
            self.join(p).to_str().unwrap().to_string()
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn commands_with_a_slash_are_run_as_given() {
        let path = vec!["PATH=/nowhere".to_string()];
        assert_eq!(candidates("/bin/sh", &path), ["/bin/sh"]);
        assert_eq!(candidates("./run.sh", &path), ["./run.sh"]);
        assert_eq!(candidates("a/b", &[]), ["a/b"]);
    }

    #[test]
    fn commands_are_looked_up_in_the_commands_own_path() {
        // No PATH: the default one.
        assert_eq!(
            candidates("ls", &["HOME=/x".to_string(), "PATHX=/y".to_string()]),
            ["/usr/local/bin/ls", "/usr/bin/ls", "/bin/ls"]
        );
        // Trailing slashes go; an empty entry is the working directory; the first PATH
        // of the environment counts.
        let env = [
            "A=1".to_string(),
            "PATH=/a/::rel:/c//".to_string(),
            "PATH=/other".to_string(),
        ];
        assert_eq!(candidates("ls", &env), ["/a/ls", "ls", "rel/ls", "/c/ls"]);
        assert_eq!(candidates("ls", &["PATH=".to_string()]), ["ls"]);
    }

    #[test]
    fn zygote_replies_are_a_value_or_an_errno() {
        let reply = |r| {
            let b = zygote_reply(r);
            let mut d = Dec::new(&b);
            let v = (d.u32().unwrap(), d.i32().unwrap());
            assert!(d.rest().is_empty());
            v
        };
        assert_eq!(reply(Ok(4242)), (4242, 0));
        assert_eq!(reply(Ok(1)), (1, 0));
        assert_eq!(reply(Err(13)), (0, 13));
    }

    #[test]
    fn error_replies_carry_the_op_the_errno_and_a_message() {
        let b = err_payload(3, &io::Error::from_raw_os_error(2), "mkdir /x");
        let mut d = Dec::new(&b);
        assert_eq!(d.u32(), Ok(3));
        assert_eq!(d.i32(), Ok(2));
        let msg = d.str().unwrap();
        assert!(msg.starts_with("mkdir /x: "), "{msg}");
        assert!(msg.contains("os error 2"), "{msg}");
        assert!(d.rest().is_empty());
        // An error without an errno reports 0.
        let b = err_payload(u32::MAX, &io::Error::other("bad"), "setup");
        let mut d = Dec::new(&b);
        assert_eq!((d.u32(), d.i32()), (Ok(u32::MAX), Ok(0)));
        assert_eq!(d.str(), Ok("setup: bad".to_string()));
    }

    #[test]
    fn exit_replies_have_the_documented_layout() {
        let b = exited_payload(-9, true, 1 << 40, EXITED_REUSABLE);
        let mut d = Dec::new(&b);
        assert_eq!(d.i32(), Ok(-9));
        assert_eq!(d.u8(), Ok(1));
        assert_eq!(d.u64(), Ok(1 << 40));
        assert_eq!(d.u8(), Ok(EXITED_REUSABLE));
        assert!(d.rest().is_empty());
        assert_eq!(exited_payload(127 << 8, false, 0, 0)[4], 0);
    }

    #[test]
    fn seccomp_programs_are_whole_instructions_within_the_kernels_limit() {
        let insn = 0x0102_0304_0506_0708u64.to_ne_bytes();
        assert_eq!(bpf_program(&insn).unwrap(), [0x0102_0304_0506_0708u64]);
        let full = insn.repeat(BPF_MAXINSNS);
        assert_eq!(bpf_program(&full).unwrap().len(), BPF_MAXINSNS);
        for bad in [
            Vec::new(),
            insn[..7].to_vec(),
            insn.repeat(2)[..9].to_vec(),
            insn.repeat(BPF_MAXINSNS + 1),
        ] {
            let e = bpf_program(&bad).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(22), "{} bytes", bad.len());
        }
    }

    #[test]
    fn stat_lines_give_the_parent_of_live_processes() {
        assert_eq!(live_parent("123 (sh) S 1 123 123 0 -1"), Some(1));
        // The command name may hold spaces and parentheses.
        assert_eq!(live_parent("5 (a) b) (c) R 42 5 5 0"), Some(42));
        assert_eq!(live_parent("7 (z) Z 3 7 7"), None);
        assert_eq!(live_parent("7 (z) X 3 7 7"), None);
        assert_eq!(live_parent("no command name"), None);
        assert_eq!(live_parent(""), None);
        // Missing or unparsable fields: a live process whose parent is unknown (0).
        assert_eq!(live_parent("8 (x)"), Some(0));
        assert_eq!(live_parent("8 (x) S ?"), Some(0));
    }

    #[test]
    fn descendants_are_found_through_any_depth_and_cycles_end() {
        let parent: HashMap<i32, i32> = [
            (101, 100),
            (102, 101),
            (103, 102),
            (104, 100),
            (200, 1),
            (201, 200),
            // A cycle (a stale snapshot of /proc) and a self-parent.
            (300, 301),
            (301, 300),
            (400, 400),
            (500, 0),
        ]
        .into_iter()
        .collect();
        let mut d = descendants(&parent, 100);
        d.sort_unstable();
        assert_eq!(d, [101, 102, 103, 104]);
        assert_eq!(descendants(&parent, 103), Vec::<i32>::new());
        let mut d = descendants(&parent, 200);
        d.sort_unstable();
        assert_eq!(d, [201]);
    }

    #[test]
    fn packets_and_fds_travel_over_a_socketpair() {
        let (a, b) = socket_pair().unwrap();
        let (p, q) = socket_pair().unwrap();
        let null: OwnedFd = File::open("/dev/null").unwrap().into();
        send_with_fds(a.as_raw_fd(), b"hello", &[null, q]).unwrap();
        let mut buf = [0u8; 64];
        let (n, fds) = recv_on(b.as_raw_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 2);
        // Received close-on-exec (F_GETFD = 1, FD_CLOEXEC = 1).
        for fd in &fds {
            // SAFETY: fcntl(F_GETFD) on a descriptor we own.
            assert_eq!(unsafe { fcntl(fd.as_raw_fd(), 1) } & 1, 1);
        }
        // The second is `q`: what goes into `p` comes out of it.
        send_with_fds(p.as_raw_fd(), b"through", &[]).unwrap();
        let (n, none) = recv_on(fds[1].as_raw_fd(), &mut buf).unwrap().unwrap();
        assert_eq!((&buf[..n], none.len()), (&b"through"[..], 0));
        // At most four descriptors per packet.
        let five: Vec<OwnedFd> = (0..5)
            .map(|_| File::open("/dev/null").unwrap().into())
            .collect();
        let e = send_with_fds(a.as_raw_fd(), b"x", &five).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(7));
        // A packet larger than the buffer is an error, not a silent truncation.
        send_with_fds(a.as_raw_fd(), &[1; 100], &[]).unwrap();
        let e = recv_on(b.as_raw_fd(), &mut buf[..10]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(90));
        // The peer hung up.
        drop(a);
        assert!(recv_on(b.as_raw_fd(), &mut buf).unwrap().is_none());
    }

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

    // Landlock, as the library asks for it on each ABI (see backend-container's
    // `src/landlock.rs`): every write-side filesystem right.
    const LL_WRITE_FILE: u64 = 1 << 1;
    const LL_ABI1_WRITES: u64 = LL_WRITE_FILE | 0x1ff0; // remove dir/file, make *
    const LL_REFER: u64 = 1 << 13;
    const LL_TRUNCATE: u64 = 1 << 14;

    /// The running kernel's Landlock ABI, if any.
    fn landlock_abi() -> Option<i64> {
        // SAFETY: landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION) only
        // returns a number.
        let v = unsafe {
            syscall(
                NR_LANDLOCK_CREATE_RULESET,
                std::ptr::null::<u8>(),
                0usize,
                1u32,
            )
        };
        (v > 0).then_some(v)
    }

    fn landlock_write_rights(abi: i64) -> u64 {
        let mut r = LL_ABI1_WRITES;
        if abi >= 2 {
            r |= LL_REFER;
        }
        if abi >= 3 {
            r |= LL_TRUNCATE;
        }
        r
    }

    const LANDLOCK_DIR: &str = "CONTAINER_INIT_LANDLOCK_TEST_DIR";

    #[test]
    fn landlock_refuses_bad_rules_before_restricting() {
        if landlock_abi().is_none() {
            eprintln!("Landlock is unavailable: skipped");
            return;
        }
        let rules = [("a\0b".to_string(), LL_WRITE_FILE)];
        let e = landlock(LL_WRITE_FILE, &rules).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(22));
        // Still unrestricted (this is the test process itself).
        let dir = TempDir::new("unrestricted");
        fs::write(dir.join("f"), "x").unwrap();
    }

    /// The init's `landlock` installs a domain that confines writes to the rules' paths
    /// (checked in a child process: a domain cannot be left).
    #[test]
    fn landlock_confines_writes_to_the_rules() {
        let Some(abi) = landlock_abi() else {
            eprintln!("Landlock is unavailable: skipped");
            return;
        };
        let dir = TempDir::new("landlock");
        fs::create_dir(dir.join("allowed")).unwrap();
        fs::create_dir(dir.join("denied")).unwrap();
        fs::write(dir.join("denied/existing"), "old").unwrap();
        fs::write(dir.join("file"), "old").unwrap();
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["tests::landlock_child", "--exact", "--ignored"])
            .args(["--nocapture", "--test-threads=1"])
            .env(LANDLOCK_DIR, &dir.0)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stdout.contains("landlock child: confined (ABI "),
            "ABI {abi}: {stdout}\n{stderr}"
        );
        assert_eq!(
            fs::read_to_string(dir.join("denied/existing")).unwrap(),
            "old"
        );
        assert_eq!(fs::read_to_string(dir.join("file")).unwrap(), "new");
        assert!(!dir.join("denied/new").exists());
    }

    #[test]
    #[ignore = "run in a child process by landlock_confines_writes_to_the_rules"]
    fn landlock_child() {
        extern "C" {
            fn truncate(path: *const c_char, len: i64) -> c_int;
        }
        let Some(dir) = std::env::var_os(LANDLOCK_DIR).map(PathBuf::from) else {
            return;
        };
        let abi = landlock_abi().expect("Landlock went away");
        let all = landlock_write_rights(abi);
        let at = |p: &str| dir.join(p).to_str().unwrap().to_string();
        landlock(
            all,
            &[
                (at("allowed"), all),
                (at("file"), all & (LL_WRITE_FILE | LL_TRUNCATE)),
                // Missing paths are skipped.
                (at("missing"), all),
            ],
        )
        .unwrap();
        let denied = |what: &str, r: io::Result<()>| match r {
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {}
            other => panic!("{what}: {other:?}"),
        };
        // Beneath a directory rule: every write.
        fs::write(dir.join("allowed/new"), "new").unwrap();
        fs::create_dir(dir.join("allowed/sub")).unwrap();
        std::os::unix::fs::symlink("new", dir.join("allowed/link")).unwrap();
        fs::rename(dir.join("allowed/new"), dir.join("allowed/sub/new")).unwrap();
        fs::remove_file(dir.join("allowed/link")).unwrap();
        fs::remove_file(dir.join("allowed/sub/new")).unwrap();
        fs::remove_dir(dir.join("allowed/sub")).unwrap();
        // A file rule: that file, written and truncated (`O_TRUNC`).
        fs::write(dir.join("file"), "new").unwrap();
        // Anywhere else: no write of any kind.
        denied("create", fs::write(dir.join("denied/new"), "x"));
        denied("mkdir", fs::create_dir(dir.join("denied/sub")));
        denied(
            "open for writing",
            fs::OpenOptions::new()
                .append(true)
                .open(dir.join("denied/existing"))
                .map(drop),
        );
        denied("unlink", fs::remove_file(dir.join("denied/existing")));
        denied(
            "symlink",
            std::os::unix::fs::symlink("x", dir.join("denied/link")),
        );
        denied(
            "create beside a file rule",
            fs::write(dir.join("file2"), "x"),
        );
        if abi >= 3 {
            let p = CString::new(at("denied/existing")).unwrap();
            // SAFETY: truncate(2) of a NUL-terminated path.
            let r = unsafe { truncate(p.as_ptr(), 0) };
            denied("truncate", check(r));
        }
        // Reads are not handled.
        assert_eq!(
            fs::read_to_string(dir.join("denied/existing")).unwrap(),
            "old"
        );
        println!("landlock child: confined (ABI {abi})");
    }
}
