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
#![no_std]

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

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}
