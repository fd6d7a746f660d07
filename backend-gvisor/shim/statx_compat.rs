//! `statx` without `AT_NO_AUTOMOUNT`: a tiny shared object (no std, no dependency; built by
//! `build.rs` with the same `rustc`) that gVisor sandboxes preload through
//! `/etc/ld.so.preload` in the host-tools view.
//!
//! Why: the `runsc` of Debian 12 (release 2022-12-19) refuses `statx` with any flag but
//! `AT_EMPTY_PATH`, `AT_SYMLINK_NOFOLLOW` and the sync types (`EINVAL`), and coreutils'
//! `ls` and `stat` always pass `AT_NO_AUTOMOUNT`: `ls -l`, `ls DIR` and `stat` all failed
//! with "Invalid argument". gVisor has no automount points, so the flag means nothing there
//! and this `statx` drops it before making the system call. (An OCI seccomp rule cannot
//! help: this runsc returns `EPERM` whatever `errnoRet` says, and glibc falls back to
//! `fstatat` only on `ENOSYS`.)
//!
//! It also carries the rule for untrusted code that the container tier applies: no new
//! namespaces. runsc applies the bundle's OCI seccomp profile to the container's init only,
//! not to the commands the backend starts with `runsc exec` or the control socket; this
//! shim's constructor installs the same filter in every dynamically linked program it is
//! loaded into (inherited by what they start). Static programs started directly are not
//! covered.
//!
//! Also the workspace package `gvisor-statx-shim` (lints; its test build links std, so `no_std`,
//! the panic handler and the constructor are for the real build only).
#![cfg_attr(not(test), no_std)]

use core::arch::asm;

/// `__NR_statx` on x86-64.
const SYS_STATX: isize = 332;
/// Do not trigger automounts (`<fcntl.h>`).
const AT_NO_AUTOMOUNT: i32 = 0x800;

extern "C" {
    /// glibc's per-thread `errno`.
    fn __errno_location() -> *mut i32;
}

/// `statx(2)` with `AT_NO_AUTOMOUNT` cleared; the C library's contract otherwise (`-1` and
/// `errno` on failure).
///
/// # Safety
/// The caller's, as for the C library's `statx`: `path` a NUL-terminated string (or null
/// with `AT_EMPTY_PATH`), `buf` writable for a `struct statx`.
#[no_mangle]
pub unsafe extern "C" fn statx(
    dirfd: i32,
    path: *const u8,
    flags: i32,
    mask: u32,
    buf: *mut u8,
) -> i32 {
    let r: isize;
    // SAFETY: the statx system call with the caller's arguments; the kernel (here gVisor's
    // Sentry) validates the pointers. `syscall` clobbers rcx and r11.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_STATX => r,
            in("rdi") dirfd as isize,
            in("rsi") path,
            in("rdx") (flags & !AT_NO_AUTOMOUNT) as isize,
            in("r10") mask as isize,
            in("r8") buf,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if r < 0 {
        // SAFETY: glibc's errno location is valid for the calling thread.
        unsafe { *__errno_location() = -r as i32 };
        return -1;
    }
    r as i32
}

/// A classic BPF instruction (`struct sock_filter`).
#[repr(C)]
struct SockFilter {
    code: u16,
    jt: u8,
    jf: u8,
    k: u32,
}

/// `struct sock_fprog`.
#[repr(C)]
struct SockFprog {
    len: u16,
    filter: *const SockFilter,
}

const fn insn(code: u16, jt: u8, jf: u8, k: u32) -> SockFilter {
    SockFilter { code, jt, jf, k }
}

/// `BPF_LD|BPF_W|BPF_ABS`, `BPF_JMP|BPF_JEQ|BPF_K`, `BPF_JMP|BPF_JSET|BPF_K`, `BPF_RET|BPF_K`.
const LD: u16 = 0x20;
const JEQ: u16 = 0x15;
const JSET: u16 = 0x45;
const RET: u16 = 0x06;
const ALLOW: u32 = 0x7fff_0000;
/// `SECCOMP_RET_ERRNO | EPERM`.
const DENY: u32 = 0x0005_0001;
/// Every `CLONE_NEW*` flag (user, mount, pid, net, uts, ipc, cgroup, time).
const NS_FLAGS: u32 = 0x1000_0000
    | 0x0002_0000
    | 0x2000_0000
    | 0x4000_0000
    | 0x0400_0000
    | 0x0800_0000
    | 0x0200_0000
    | 0x80;

/// The container tier's rule for untrusted code: no new namespaces. `clone` and `unshare`
/// with any `CLONE_NEW*` flag, and `setns`, fail with `EPERM`; everything else is allowed.
/// (`seccomp_data`: `nr` at 0, `arch` at 4, `args[0]`'s low half at 16.)
static FILTER: [SockFilter; 11] = [
    insn(LD, 0, 0, 4),
    insn(JEQ, 0, 4, 0xc000_003e), // not x86-64: allow
    insn(LD, 0, 0, 0),
    insn(JEQ, 3, 0, 56),  // clone: check the flags
    insn(JEQ, 2, 0, 272), // unshare: check the flags
    insn(JEQ, 4, 0, 308), // setns: deny
    insn(RET, 0, 0, ALLOW),
    insn(LD, 0, 0, 16),
    insn(JSET, 1, 0, NS_FLAGS),
    insn(RET, 0, 0, ALLOW),
    insn(RET, 0, 0, DENY),
];

/// A raw system call with up to three arguments.
///
/// # Safety
/// The system call's own contract for `nr` and its arguments.
unsafe fn syscall3(nr: isize, a: isize, b: isize, c: isize) -> isize {
    let r: isize;
    // SAFETY: the caller's; `syscall` clobbers rcx and r11.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") nr => r,
            in("rdi") a,
            in("rsi") b,
            in("rdx") c,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    r
}

/// Runs when the shim is loaded, before the program's `main`: installs [`FILTER`] unless
/// the process already runs under a filter (inherited from the parent that loaded the shim),
/// so that commands started in the sandbox by `runsc exec`, which runsc's OCI seccomp profile
/// does not reach, cannot create namespaces, nor can anything they start.
#[cfg_attr(test, allow(dead_code))]
extern "C" fn no_new_namespaces() {
    const PR_GET_SECCOMP: isize = 21;
    const PR_SET_NO_NEW_PRIVS: isize = 38;
    const SYS_PRCTL: isize = 157;
    const SYS_SECCOMP: isize = 317;
    const SECCOMP_SET_MODE_FILTER: isize = 1;
    let prog = SockFprog {
        len: FILTER.len() as u16,
        filter: FILTER.as_ptr(),
    };
    // SAFETY: prctl and seccomp with valid arguments; `prog` points at a static program and
    // lives across the call. Failures leave the process as it was (best effort: the OCI
    // profile still covers the container's init).
    unsafe {
        if syscall3(SYS_PRCTL, PR_GET_SECCOMP, 0, 0) == 2 {
            return;
        }
        let _ = syscall3(SYS_PRCTL, PR_SET_NO_NEW_PRIVS, 1, 0);
        let _ = syscall3(
            SYS_SECCOMP,
            SECCOMP_SET_MODE_FILTER,
            0,
            &prog as *const SockFprog as isize,
        );
    }
}

#[cfg(not(test))]
#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = no_new_namespaces;

#[cfg(not(test))]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs [`FILTER`] on a `seccomp_data` of `arch`, `nr` and a first argument `arg0` with
    /// the four instructions it uses (load word, jump if equal, jump if set, return).
    fn decide(arch: u32, nr: u32, arg0: u32) -> u32 {
        let word = |off: u32| match off {
            0 => nr,
            4 => arch,
            16 => arg0,
            _ => 0,
        };
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = &FILTER[pc];
            pc += 1;
            match i.code {
                LD => acc = word(i.k),
                JEQ => pc += usize::from(if acc == i.k { i.jt } else { i.jf }),
                JSET => pc += usize::from(if acc & i.k != 0 { i.jt } else { i.jf }),
                RET => return i.k,
                other => unreachable!("instruction {other:#x}"),
            }
        }
    }

    #[test]
    fn the_filter_refuses_new_namespaces_only() {
        const X86_64: u32 = 0xc000_003e;
        const CLONE_NEWUSER: u32 = 0x1000_0000;
        const CLONE_NEWNET: u32 = 0x4000_0000;
        const CLONE_THREAD_VM: u32 = 0x0001_0100;
        assert_eq!(decide(X86_64, 56, CLONE_NEWUSER), DENY);
        assert_eq!(decide(X86_64, 56, CLONE_THREAD_VM), ALLOW);
        assert_eq!(decide(X86_64, 272, CLONE_NEWNET), DENY);
        assert_eq!(decide(X86_64, 272, 0x200), ALLOW); // CLONE_FS
        assert_eq!(decide(X86_64, 308, 0), DENY);
        assert_eq!(decide(X86_64, 0, CLONE_NEWUSER), ALLOW); // read
        assert_eq!(decide(0x4000_00b7, 56, CLONE_NEWUSER), ALLOW); // not x86-64
    }
}
