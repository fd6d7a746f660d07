//! Signal dispositions for the processes our agents (and the host's own launchers) start:
//! `execve` keeps ignored dispositions and the signal mask, so a process started by anything
//! that ignored `SIGINT` (a shell's background job), `SIGHUP` (`nohup`) or blocked signals
//! would hand that on to the sandbox's commands. [`reset_signals`] undoes it, between `fork`
//! and `execve`.
//!
//! Raw `rt_sigaction`/`rt_sigprocmask` system calls (x86-64 and arm64 numbers): glibc's
//! `sigaction` refuses signals 32 and 33, its own, and the static agents link no libc crate.
//! Every function here is async-signal-safe: system calls only.

use std::os::raw::c_long;

extern "C" {
    fn syscall(n: c_long, ...) -> c_long;
}

#[cfg(target_arch = "x86_64")]
const NR_RT_SIGACTION: c_long = 13;
#[cfg(target_arch = "aarch64")]
const NR_RT_SIGACTION: c_long = 134;
#[cfg(target_arch = "x86_64")]
const NR_RT_SIGPROCMASK: c_long = 14;
#[cfg(target_arch = "aarch64")]
const NR_RT_SIGPROCMASK: c_long = 135;
const SIG_SETMASK: c_long = 2;
const SIGKILL: c_long = 9;
const SIGSTOP: c_long = 19;
const SIG_DFL: usize = 0;
#[cfg(test)]
const SIG_IGN: usize = 1;

/// `struct sigaction` as the kernel's `rt_sigaction` takes it (x86-64 and arm64).
#[repr(C)]
struct KernelSigaction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

/// Sets `sig`'s disposition to `handler` (`SIG_DFL` or `SIG_IGN`); the kernel's answer.
fn set_disposition(sig: c_long, handler: usize) -> c_long {
    let action = KernelSigaction {
        handler,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    // SAFETY: rt_sigaction with a valid action, no old action, an 8-byte sigset.
    unsafe {
        syscall(
            NR_RT_SIGACTION,
            sig,
            &action as *const KernelSigaction,
            std::ptr::null_mut::<KernelSigaction>(),
            8 as c_long,
        )
    }
}

/// Sets the calling thread's signal mask to `mask` (bit `n - 1` blocks signal `n`).
fn set_mask(mask: u64) {
    // SAFETY: rt_sigprocmask with a valid 8-byte set and no old set.
    unsafe {
        syscall(
            NR_RT_SIGPROCMASK,
            SIG_SETMASK,
            &mask as *const u64,
            std::ptr::null_mut::<u64>(),
            8 as c_long,
        )
    };
}

/// Puts every signal's disposition back to its default (`SIG_DFL`) and empties the calling
/// thread's signal mask. Signals 1 to 64 but `SIGKILL` and `SIGSTOP` (which cannot be
/// changed). Call it in a child between `fork` and `execve`, or first thing in a process that
/// starts others (the container init's zygote).
pub fn reset_signals() {
    for sig in 1..=64 {
        if sig != SIGKILL && sig != SIGSTOP {
            set_disposition(sig, SIG_DFL);
        }
    }
    set_mask(0);
}

/// Ignores `ignored` and blocks `blocked` (signal numbers) in the calling process, as a
/// hostile starter would (a background job, `nohup`). For the test, in a forked child.
#[cfg(test)]
fn make_hostile(ignored: &[u32], blocked: &[u32]) {
    for &sig in ignored {
        set_disposition(c_long::from(sig), SIG_IGN);
    }
    set_mask(
        blocked
            .iter()
            .filter(|&&s| (1..=64).contains(&s))
            .map(|&s| 1u64 << (s - 1))
            .fold(0, |m, b| m | b),
    );
}

/// The first signal whose disposition is not `SIG_DFL`, or 65 plus the lowest blocked
/// signal's number minus one (65 for signal 1), or 0 when everything is at its default and
/// nothing is blocked. For the test.
#[cfg(test)]
fn first_non_default() -> u32 {
    let mut old = KernelSigaction {
        handler: 0,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    for sig in 1..=64u32 {
        // SAFETY: rt_sigaction that only reads the disposition into `old`.
        let r = unsafe {
            syscall(
                NR_RT_SIGACTION,
                c_long::from(sig),
                std::ptr::null::<KernelSigaction>(),
                &mut old as *mut KernelSigaction,
                8 as c_long,
            )
        };
        if r != 0 || old.handler != SIG_DFL {
            return sig;
        }
    }
    let mut mask: u64 = 0;
    // SAFETY: rt_sigprocmask that only reads the mask (no new set).
    unsafe {
        syscall(
            NR_RT_SIGPROCMASK,
            SIG_SETMASK,
            std::ptr::null::<u64>(),
            &mut mask as *mut u64,
            8 as c_long,
        )
    };
    if mask != 0 {
        return 65 + mask.trailing_zeros();
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    extern "C" {
        fn fork() -> i32;
        fn waitpid(pid: i32, status: *mut i32, options: i32) -> i32;
        fn _exit(code: i32) -> !;
    }

    /// What a background job, `nohup` and glibc leave (`SIGHUP`, `SIGINT`, `SIGQUIT`,
    /// `SIGPIPE`, `SIGTERM`, glibc's 32 and 33, real-time ones) and a blocked mask are all
    /// undone by [`reset_signals`].
    #[test]
    fn reset_signals_undoes_ignored_and_blocked_signals() {
        // SAFETY: the child makes system calls only, then `_exit`s.
        let pid = unsafe { fork() };
        if pid == 0 {
            make_hostile(&[1, 2, 3, 13, 15, 32, 33, 34, 64], &[2, 10, 15, 34]);
            // The hostile state took (else this test would prove nothing).
            let before = first_non_default();
            reset_signals();
            let after = first_non_default();
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { _exit(if before != 1 { 100 } else { after as i32 }) };
        }
        assert!(pid > 0);
        let mut status = 0;
        // SAFETY: waits for our own child with a valid status pointer.
        assert_eq!(unsafe { waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(status & 0x7f, 0, "the child died of a signal: {status:#x}");
        let code = (status >> 8) & 0xff;
        assert_ne!(code, 100, "the child's signals were never changed");
        assert_eq!(
            code, 0,
            "signal {code} still not at its default (over 64: blocked)"
        );
    }
}
