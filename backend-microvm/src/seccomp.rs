//! Seccomp filters for the VMM's own threads, installed on each thread only (after its
//! setup), never process-wide: the library user's other threads are unaffected.
//!
//! * vCPU threads: KVM ioctls only (ioctl type 0xAE), eventfd writes, futexes, memory
//!   management for the allocator, signals (the kick), thread exit.
//! * The I/O thread: poll, socket reads/writes on the console, eventfds, futexes, the same
//!   housekeeping.
//!
//! Anything else fails with `EPERM` instead of killing: a denied call inside the VMM becomes
//! an error for that VM, never a crash of the host process.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use crate::vmm::error::{Result, VmmError};

/// Syscalls every VMM thread needs (allocation, locks, signals, exit, time).
const COMMON: &[i64] = &[
    libc::SYS_futex,
    libc::SYS_write,
    libc::SYS_read,
    libc::SYS_close,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_mprotect,
    libc::SYS_brk,
    libc::SYS_rt_sigreturn,
    // A blocking call with a timeout (poll, futex, nanosleep) interrupted by a stop/continue
    // (SIGSTOP/SIGCONT, a debugger or strace attaching) is resumed through restart_syscall.
    libc::SYS_restart_syscall,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_tgkill,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_getrandom,
    libc::SYS_exit,
    libc::SYS_rseq,
];

/// KVM's ioctl type byte.
const KVMIO: u64 = 0xae;

fn build(extra: &[i64], kvm_ioctls: bool) -> Result<BpfProgram> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for s in COMMON.iter().chain(extra) {
        rules.insert(*s, vec![]);
    }
    if kvm_ioctls {
        let cond = SeccompCondition::new(
            1,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::MaskedEq(0xff00),
            KVMIO << 8,
        )
        .map_err(|e| VmmError::Seccomp(e.to_string()))?;
        let rule = SeccompRule::new(vec![cond]).map_err(|e| VmmError::Seccomp(e.to_string()))?;
        rules.insert(libc::SYS_ioctl, vec![rule]);
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| VmmError::Seccomp(e.to_string()))?;
    BpfProgram::try_from(filter).map_err(|e| VmmError::Seccomp(e.to_string()))
}

fn cached(
    cell: &'static OnceLock<Cached>,
    f: impl FnOnce() -> Result<BpfProgram>,
) -> Result<BpfProgram> {
    cell.get_or_init(|| f().map_err(std::sync::Arc::new))
        .clone()
        .map_err(VmmError::Cached)
}

/// A filter built once per process, or why it could not be (shared by every caller).
type Cached = std::result::Result<BpfProgram, std::sync::Arc<VmmError>>;

/// The filter for vCPU threads.
pub fn vcpu_filter() -> Result<BpfProgram> {
    static F: OnceLock<Cached> = OnceLock::new();
    cached(&F, || build(&[], true))
}

/// The filter for the I/O thread.
pub fn io_filter() -> Result<BpfProgram> {
    static F: OnceLock<Cached> = OnceLock::new();
    cached(&F, || {
        build(
            &[
                libc::SYS_poll,
                libc::SYS_ppoll,
                libc::SYS_sendto,
                libc::SYS_recvfrom,
                libc::SYS_sendmsg,
                libc::SYS_recvmsg,
                // The block device reads its backing file.
                libc::SYS_pread64,
            ],
            false,
        )
    })
}

/// The `Seccomp:` mode of a thread of this process (0 none, 1 strict, 2 filter), read from
/// `/proc/self/task/<tid>/status`.
pub fn thread_seccomp_mode(tid: i32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Seccomp:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_build() {
        assert!(!vcpu_filter().unwrap().is_empty());
        assert!(!io_filter().unwrap().is_empty());
    }

    #[test]
    fn filter_applies_to_one_thread_only() {
        let prog = io_filter().unwrap();
        let (tid, denied) = std::thread::spawn(move || {
            seccompiler::apply_filter(&prog).unwrap();
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            // `socket` is not on the list: EPERM.
            // SAFETY: plain syscall with constant arguments.
            let r = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
            let err = std::io::Error::last_os_error().raw_os_error();
            (tid, (r, err))
        })
        .join()
        .unwrap();
        assert_eq!(denied, (-1, Some(libc::EPERM)));
        // That thread is gone; this one has no filter.
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        assert_eq!(thread_seccomp_mode(me), Some(0));
        let _ = tid;
    }
}
