//! Process hygiene for runsc.
//!
//! `runsc create`/`run --detach` exit and leave the sandbox (`runsc-sandbox`) and gofer
//! (`runsc-gofer`) processes behind, re-parented to the nearest *child subreaper* or to pid 1.
//! `runsc delete` then waits until the sandbox process is gone, and a zombie still counts: on
//! hosts whose pid 1 reaps slowly that takes 1.3-2 s. So the driver makes its own process a
//! child subreaper and reaps **exactly** the runsc processes of its sandboxes: it records
//! their pids (children of ours whose command line names the sandbox's state root) and, while
//! `delete` runs, `waitpid`s those pids only. It never calls `waitpid(-1)`, which would steal
//! the exit status of the embedding program's own children.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

static SUBREAPER: OnceLock<bool> = OnceLock::new();

/// Makes this process a child subreaper (once). Returns whether it is one.
pub fn ensure_subreaper() -> bool {
    *SUBREAPER.get_or_init(|| {
        // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) only sets a flag on the calling process;
        // the extra arguments are ignored and passed as zero as the man page asks.
        let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        rc == 0
    })
}

/// Our children whose command line contains `needle` (e.g. `--root=/state/<id>`).
pub fn children_matching(needle: &str) -> Vec<i32> {
    let me = std::process::id();
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the parenthesised comm: state, ppid, ...
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let ppid = rest
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if ppid != Some(me) {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            out.push(pid);
        }
    }
    out
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
