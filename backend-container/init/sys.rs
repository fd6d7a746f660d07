//! The C interface: libc's types and functions (std exposes no `libc`), the Linux system
//! call numbers and constants the init needs, and small helpers around them (`errno`, C
//! strings, result checks, the monotonic clock).

use std::ffi::CString;
use std::io;

#[allow(non_camel_case_types)]
pub(crate) type c_int = i32;
#[allow(non_camel_case_types)]
type c_long = i64;
#[allow(non_camel_case_types)]
pub(crate) type c_ulong = u64;
#[allow(non_camel_case_types)]
pub(crate) type c_char = std::ffi::c_char;
#[allow(non_camel_case_types)]
pub(crate) type c_void = u8;

#[repr(C)]
pub(crate) struct IoVec {
    pub(crate) base: *mut c_void,
    pub(crate) len: usize,
}

#[repr(C)]
pub(crate) struct MsgHdr {
    pub(crate) name: *mut c_void,
    pub(crate) namelen: u32,
    pub(crate) iov: *mut IoVec,
    pub(crate) iovlen: usize,
    pub(crate) control: *mut c_void,
    pub(crate) controllen: usize,
    pub(crate) flags: c_int,
}

#[repr(C)]
pub(crate) struct PollFd {
    pub(crate) fd: c_int,
    pub(crate) events: i16,
    pub(crate) revents: i16,
}

#[repr(C)]
pub(crate) struct Rlimit {
    pub(crate) cur: u64,
    pub(crate) max: u64,
}

#[repr(C)]
pub(crate) struct SockFprog {
    pub(crate) len: u16,
    pub(crate) filter: *const u64,
}

#[repr(C)]
pub(crate) struct MountAttr {
    pub(crate) set: u64,
    pub(crate) clr: u64,
    pub(crate) propagation: u64,
    pub(crate) userns_fd: u64,
}

#[repr(C)]
pub(crate) struct CapHeader {
    pub(crate) version: u32,
    pub(crate) pid: c_int,
}

#[repr(C)]
pub(crate) struct CapData {
    pub(crate) effective: u32,
    pub(crate) permitted: u32,
    pub(crate) inheritable: u32,
}

#[repr(C)]
pub(crate) struct IfReq {
    pub(crate) name: [u8; 16],
    pub(crate) flags: i16,
    pub(crate) pad: [u8; 22],
}

#[repr(C, align(8))]
pub(crate) struct SigSet(pub(crate) [u64; 16]);

extern "C" {
    pub(crate) fn syscall(n: c_long, ...) -> c_long;
    pub(crate) fn mount(
        src: *const c_char,
        dst: *const c_char,
        fstype: *const c_char,
        flags: c_ulong,
        data: *const c_void,
    ) -> c_int;
    pub(crate) fn umount2(target: *const c_char, flags: c_int) -> c_int;
    pub(crate) fn sethostname(name: *const c_char, len: usize) -> c_int;
    pub(crate) fn setgroups(n: usize, list: *const u32) -> c_int;
    pub(crate) fn setresuid(r: u32, e: u32, s: u32) -> c_int;
    pub(crate) fn setresgid(r: u32, e: u32, s: u32) -> c_int;
    pub(crate) fn setsid() -> c_int;
    pub(crate) fn setpgid(pid: c_int, pgid: c_int) -> c_int;
    pub(crate) fn setrlimit(res: c_int, lim: *const Rlimit) -> c_int;
    pub(crate) fn prctl(op: c_int, ...) -> c_int;
    pub(crate) fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int;
    pub(crate) fn ioctl(fd: c_int, req: c_ulong, ...) -> c_int;
    pub(crate) fn poll(fds: *mut PollFd, n: u64, timeout: c_int) -> c_int;
    pub(crate) fn sigemptyset(set: *mut SigSet) -> c_int;
    pub(crate) fn sigaddset(set: *mut SigSet, sig: c_int) -> c_int;
    pub(crate) fn sigprocmask(how: c_int, set: *const SigSet, old: *mut SigSet) -> c_int;
    pub(crate) fn signalfd(fd: c_int, mask: *const SigSet, flags: c_int) -> c_int;
    pub(crate) fn waitpid(pid: c_int, status: *mut c_int, options: c_int) -> c_int;
    pub(crate) fn kill(pid: c_int, sig: c_int) -> c_int;
    pub(crate) fn getppid() -> c_int;
    pub(crate) fn setns(fd: c_int, nstype: c_int) -> c_int;
    pub(crate) fn recvmsg(fd: c_int, msg: *mut MsgHdr, flags: c_int) -> isize;
    pub(crate) fn write(fd: c_int, buf: *const c_void, n: usize) -> isize;
    pub(crate) fn read(fd: c_int, buf: *mut c_void, n: usize) -> isize;
    pub(crate) fn close(fd: c_int) -> c_int;
    pub(crate) fn fcntl(fd: c_int, cmd: c_int, ...) -> c_int;
    pub(crate) fn unshare(flags: c_int) -> c_int;
    pub(crate) fn chdir(path: *const c_char) -> c_int;
    pub(crate) fn fchdir(fd: c_int) -> c_int;
    pub(crate) fn _exit(code: c_int) -> !;
    pub(crate) fn fork() -> c_int;
    pub(crate) fn clone(
        f: extern "C" fn(*mut c_void) -> c_int,
        stack: *mut c_void,
        flags: c_int,
        arg: *mut c_void,
        ...
    ) -> c_int;
    pub(crate) fn execve(
        path: *const c_char,
        argv: *const *const c_char,
        envp: *const *const c_char,
    ) -> c_int;
    pub(crate) fn dup2(old: c_int, new: c_int) -> c_int;
    pub(crate) fn fchown(fd: c_int, uid: u32, gid: u32) -> c_int;
    pub(crate) fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int;
    #[link_name = "open"]
    pub(crate) fn libc_open(path: *const c_char, flags: c_int, ...) -> c_int;
    pub(crate) fn getpid() -> c_int;
    pub(crate) fn socketpair(domain: c_int, ty: c_int, proto: c_int, sv: *mut c_int) -> c_int;
    pub(crate) fn sendmsg(fd: c_int, msg: *const MsgHdr, flags: c_int) -> isize;
    pub(crate) fn clock_gettime(clock: c_int, ts: *mut [i64; 2]) -> c_int;
}

#[cfg(target_arch = "x86_64")]
pub(crate) const NR_CLONE: i64 = 56;
#[cfg(target_arch = "aarch64")]
pub(crate) const NR_CLONE: i64 = 220;

#[cfg(target_arch = "x86_64")]
pub(crate) mod nr {
    pub const PIVOT_ROOT: i64 = 155;
    pub const SECCOMP: i64 = 317;
    pub const CAPSET: i64 = 126;
}
#[cfg(target_arch = "aarch64")]
pub(crate) mod nr {
    pub const PIVOT_ROOT: i64 = 41;
    pub const SECCOMP: i64 = 277;
    pub const CAPSET: i64 = 91;
}
pub(crate) const NR_CLOSE_RANGE: i64 = 436;
/// `openat2(2)` (the same number on every architecture).
pub(crate) const NR_OPENAT2: i64 = 437;
/// `openat2`'s `RESOLVE_NO_MAGICLINKS`.
pub(crate) const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
/// `openat2`'s `RESOLVE_IN_ROOT`: the directory fd is `/` for the whole lookup, `..` and
/// absolute symbolic links included.
pub(crate) const RESOLVE_IN_ROOT: u64 = 0x10;

/// `struct open_how` of `openat2(2)`.
#[repr(C)]
pub(crate) struct OpenHow {
    pub flags: u64,
    pub mode: u64,
    pub resolve: u64,
}
pub(crate) const CLONE_NEWUSER: c_int = 0x1000_0000;
pub(crate) const CLONE_NEWNS: c_int = 0x0002_0000;
pub(crate) const CLONE_NEWUTS: c_int = 0x0400_0000;
pub(crate) const CLONE_NEWIPC: c_int = 0x0800_0000;
pub(crate) const CLONE_NEWNET: c_int = 0x4000_0000;
pub(crate) const CLONE_NEWPID: c_int = 0x2000_0000;
pub(crate) const CLONE_PARENT: c_int = 0x0000_8000;
pub(crate) const NR_MOUNT_SETATTR: i64 = 442;
pub(crate) const NR_MOVE_MOUNT: i64 = 429;
pub(crate) const MOVE_MOUNT_F_EMPTY_PATH: u32 = 0x4;
#[cfg(target_arch = "x86_64")]
pub(crate) const O_DIRECTORY: c_int = 0o200000;
#[cfg(target_arch = "aarch64")]
pub(crate) const O_DIRECTORY: c_int = 0o40000;
pub(crate) const NR_LANDLOCK_CREATE_RULESET: i64 = 444;
pub(crate) const NR_LANDLOCK_ADD_RULE: i64 = 445;
pub(crate) const NR_LANDLOCK_RESTRICT_SELF: i64 = 446;
pub(crate) const O_PATH: c_int = 0o10000000;
pub(crate) const O_CLOEXEC: c_int = 0o2000000;
#[cfg(target_arch = "x86_64")]
pub(crate) const O_NOFOLLOW: c_int = 0o400000;
#[cfg(target_arch = "aarch64")]
pub(crate) const O_NOFOLLOW: c_int = 0o100000;

pub(crate) const AT_FDCWD: c_int = -100;
pub(crate) const AT_RECURSIVE: u32 = 0x8000;
pub(crate) const MS_BIND: u64 = 4096;
pub(crate) const MS_REC: u64 = 16384;
pub(crate) const MS_SLAVE: u64 = 1 << 19;
pub(crate) const MS_NOSUID: u64 = 2;
pub(crate) const MS_NODEV: u64 = 4;
pub(crate) const MNT_DETACH: c_int = 2;
// Terminal ioctl (the same on x86-64 and arm64); opening a terminal is
// `sandbox_agent_proto::pty`'s.
pub(crate) const TIOCSCTTY: c_ulong = 0x540E;
pub(crate) const SIGCHLD: c_int = 17;
pub(crate) const SIGKILL: c_int = 9;
pub(crate) const SIGTERM: c_int = 15;
pub(crate) const SIGUSR1: c_int = 10;
pub(crate) const PR_SET_CHILD_SUBREAPER: c_int = 36;
pub(crate) const SIG_BLOCK: c_int = 0;
pub(crate) const SFD_CLOEXEC: c_int = 0o2000000;
pub(crate) const SFD_NONBLOCK: c_int = 0o4000;
pub(crate) const WNOHANG: c_int = 1;
pub(crate) const POLLIN: i16 = 1;
pub(crate) const POLLERR: i16 = 8;
pub(crate) const POLLHUP: i16 = 16;
pub(crate) const MSG_CMSG_CLOEXEC: c_int = 0x40000000;
pub(crate) const MSG_TRUNC: c_int = 0x20;
pub(crate) const MSG_CTRUNC: c_int = 0x8;
pub(crate) const F_SETFD: c_int = 2;
pub(crate) const PR_SET_NO_NEW_PRIVS: c_int = 38;
pub(crate) const PR_SET_NAME: c_int = 15;
pub(crate) const PR_CAPBSET_DROP: c_int = 24;
pub(crate) const PR_CAP_AMBIENT: c_int = 47;
pub(crate) const PR_CAP_AMBIENT_CLEAR_ALL: c_int = 4;
pub(crate) const PR_SET_SECUREBITS: c_int = 28;
pub(crate) const SECBITS_LOCKED_NOROOT: c_int = 0x1 | 0x2 | 0x4 | 0x8 | 0x20;
pub(crate) const SECCOMP_SET_MODE_FILTER: c_int = 1;
pub(crate) const SIOCGIFFLAGS: u64 = 0x8913;
pub(crate) const SIOCSIFFLAGS: u64 = 0x8914;
pub(crate) const IFF_UP: i16 = 1;

/// `SIG_SETMASK` of `sigprocmask`.
pub(crate) const SIG_SETMASK: c_int = 2;

/// Every signal back at its default and an empty mask, whatever the process that started us
/// had (a shell's background job ignores `SIGINT` and `SIGQUIT`, `nohup` `SIGHUP`, and
/// `execve` keeps both): called first thing by the zygote, so no command inherits them.
pub(crate) use sandbox_agent_proto::signals::reset_signals;

/// The calling thread's `errno`.
pub(crate) fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// `s` as a C string; an interior NUL is `EINVAL`.
pub(crate) fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from_raw_os_error(22))
}

/// The string's pointer, or NULL for `None`.
pub(crate) fn opt_ptr(c: &Option<CString>) -> *const c_char {
    c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())
}

/// A C call's result: negative means failed, with `errno` set.
pub(crate) fn check(r: c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// CLOCK_MONOTONIC in nanoseconds (the sandbox's time namespace keeps the host's offsets).
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = [0i64; 2];
    // SAFETY: clock_gettime into a timespec-sized local.
    unsafe {
        clock_gettime(1 /* CLOCK_MONOTONIC */, &mut ts)
    };
    (ts[0] as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts[1] as u64)
}
