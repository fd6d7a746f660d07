//! Process hygiene for runsc.
//!
//! `runsc create`/`run --detach` exit and leave the sandbox (`runsc-sandbox`) and gofer
//! (`runsc-gofer`) processes behind, re-parented to the nearest *child subreaper* or to pid 1.
//! `runsc delete` then waits until the sandbox process is gone, and a zombie still counts: on
//! hosts whose pid 1 reaps slowly that takes 1.3-2 s. So the driver has its own process
//! **adopt** them: it is a child subreaper only while a `runsc run`/`restore --detach` runs
//! ([`adopt`], a window shared by concurrent creates), then records their pids (children of
//! ours whose command line names the sandbox's state root) and, while `delete` runs,
//! `waitpid`s those pids only. It never calls `waitpid(-1)`, which would steal the exit
//! status of the embedding program's own children; and it is no subreaper between creates,
//! so the orphans of the embedding program's other children (a daemon a script left behind)
//! are not adopted by a process that would never reap them. A process that was a subreaper
//! before (or calls [`ensure_subreaper`]) stays one.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// The subreaper flag's owners: whether it is set for good (before us, or by
/// [`ensure_subreaper`]), and how many adoption windows are open.
struct Flag {
    permanent: bool,
    open: usize,
}

static FLAG: Mutex<Flag> = Mutex::new(Flag {
    permanent: false,
    open: 0,
});

static PRESET: OnceLock<bool> = OnceLock::new();

fn set_subreaper(on: bool) -> bool {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 0|1) only sets a flag on the calling process;
    // the extra arguments are ignored and passed as zero as the man page asks.
    unsafe {
        libc::prctl(
            libc::PR_SET_CHILD_SUBREAPER,
            libc::c_ulong::from(on),
            0,
            0,
            0,
        ) == 0
    }
}

/// Whether the process is a child subreaper now.
fn is_subreaper() -> bool {
    let mut v: libc::c_int = 0;
    // SAFETY: PR_GET_CHILD_SUBREAPER stores an int through the pointer, which is valid.
    let rc = unsafe { libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut v as *mut libc::c_int) };
    rc == 0 && v != 0
}

/// Whether the process was a subreaper before this module first looked.
fn preset() -> bool {
    *PRESET.get_or_init(is_subreaper)
}

/// Makes this process a child subreaper for good. Returns whether it is one.
pub fn ensure_subreaper() -> bool {
    let _ = preset();
    let Ok(mut f) = FLAG.lock() else {
        return false;
    };
    f.permanent = true;
    set_subreaper(true)
}

/// An open adoption window (see [`adopt`]); closing the last one clears the flag again.
#[derive(Debug)]
pub struct Adoption(());

/// Makes this process a child subreaper until the returned guard is dropped (and every
/// other open window is closed): processes orphaned meanwhile below us, such as the runsc
/// processes a `run --detach` leaves, become our children.
pub fn adopt() -> Adoption {
    let preset = preset();
    if let Ok(mut f) = FLAG.lock() {
        f.permanent |= preset;
        if f.open == 0 && !f.permanent {
            set_subreaper(true);
        }
        f.open += 1;
    }
    Adoption(())
}

impl Drop for Adoption {
    fn drop(&mut self) {
        if let Ok(mut f) = FLAG.lock() {
            f.open = f.open.saturating_sub(1);
            if f.open == 0 && !f.permanent {
                set_subreaper(false);
            }
        }
    }
}

/// Our children whose command line contains `needle` (e.g. `--root=/state/<id>`).
pub fn children_matching(needle: &str) -> Vec<i32> {
    matching(needle, Some(std::process::id()))
}

/// Every process (not only our children) whose command line contains `needle`.
pub fn processes_matching(needle: &str) -> Vec<i32> {
    matching(needle, None)
}

/// The processes whose command line contains `needle` and, with `Some`, whose parent is
/// `parent`.
fn matching(needle: &str, parent: Option<u32>) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if let Some(parent) = parent {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // Fields after the parenthesised comm: state, ppid, ...
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid != Some(parent) {
                continue;
            }
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            out.push(pid);
        }
    }
    out
}

/// Whether any of `pids` (children of this process, as [`children_matching`] finds them)
/// has ended: exited and not yet reaped (a zombie: only the teardown and a resume after a
/// checkpoint reap them, and forget them as they do, so the pid cannot have been reused), or
/// no longer our child at all. Reaps nothing (`WNOWAIT`).
///
/// runsc's own `state` cannot tell: it asks with `kill(pid, 0)`, which a zombie answers, so
/// a sandbox whose processes were killed, or whose Sentry died on its process limit, is
/// "running" to runsc releases from 2023 on until its processes are reaped.
pub fn any_ended(pids: &[i32]) -> bool {
    use nix::sys::wait::{waitid, Id};
    pids.iter().any(|&p| {
        p <= 0
            || !matches!(
                waitid(
                    Id::Pid(Pid::from_raw(p)),
                    WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
                ),
                Ok(WaitStatus::StillAlive)
            )
    })
}

/// Reaps any of `pids` that have exited; returns those still running.
pub fn reap(pids: &[i32]) -> Vec<i32> {
    pids.iter()
        .copied()
        .filter(
            |&p| match waitpid(Pid::from_raw(p), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => true,
                Ok(_) => false,
                // ECHILD: not our child (any more): nothing to reap.
                Err(_) => false,
            },
        )
        .collect()
}

/// SIGKILLs those of `pids` that are still unreaped children of this process and reaps them,
/// waiting at most `timeout`; returns the pids still not reaped. Each is signalled through a
/// pidfd after `waitid(P_PIDFD, .., WNOWAIT)` confirmed it is our child, so a pid that some
/// other reaper recycled is never signalled.
///
/// `runsc delete` kills the gofer and then polls for it every 100 ms (a zombie still counts
/// as alive): with the sandbox and gofer already dead and reaped, it finds them gone at once
/// and only removes the cgroups and state (~20 ms instead of ~120 ms here).
pub fn kill_children(pids: &[i32], timeout: Duration) -> Vec<i32> {
    let mut killed = Vec::new();
    for &pid in pids {
        // SAFETY: pidfd_open takes a pid and flags; it returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let Ok(fd) = i32::try_from(fd) else {
            continue;
        };
        if fd < 0 {
            continue;
        }
        // SAFETY: the kernel just gave us this fd; nothing else owns it.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our pidfd with a valid siginfo pointer; WNOWAIT reaps nothing.
        let ours = unsafe {
            libc::waitid(
                libc::P_PIDFD,
                raw as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        } == 0;
        if !ours {
            continue;
        }
        // SAFETY: pidfd_send_signal on our pidfd, no siginfo, no flags.
        let sent = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                raw,
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        // Sent, or already dead (a zombie of ours): either way it is ours to reap.
        let _ = sent;
        killed.push(pid);
    }
    let deadline = Instant::now() + timeout;
    loop {
        killed = reap(&killed);
        if killed.is_empty() || Instant::now() > deadline {
            return killed;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// Reaps `pids` until all are gone or `timeout` passes, while `done` says the command that
/// makes them exit is still running.
pub fn reap_while(pids: &[i32], timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    let mut left = pids.to_vec();
    loop {
        left = reap(&left);
        let finished = done();
        if (left.is_empty() && finished) || Instant::now() > deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the flag is process-wide.
    #[test]
    fn adoption_windows_set_the_flag_only_while_open_and_ensure_is_for_good() {
        let before = is_subreaper();
        let a = adopt();
        assert!(is_subreaper());
        let b = adopt();
        drop(a);
        assert!(is_subreaper(), "closed while another window is open");
        drop(b);
        assert_eq!(
            is_subreaper(),
            before,
            "the last window did not restore the flag"
        );
        assert!(ensure_subreaper());
        drop(adopt());
        assert!(is_subreaper(), "a window cleared a flag set for good");
    }

    #[test]
    fn a_killed_child_has_ended_before_it_is_reaped_and_is_still_ours_to_reap() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        assert!(!any_ended(&[pid]), "a running child counted as ended");
        child.kill().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !any_ended(&[pid]) {
            assert!(Instant::now() < deadline, "a killed child never ended");
            std::thread::sleep(Duration::from_millis(5));
        }
        // WNOWAIT: the zombie is still there for its owner.
        assert!(child.try_wait().unwrap().is_some());
        // Not our child (pid 1), or reaped already: ended.
        assert!(any_ended(&[1]));
        assert!(!any_ended(&[]));
    }
}
