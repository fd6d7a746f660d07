//! Execs: the init's bookkeeping of their supervisors, the spare supervisor forked ahead
//! of time, and the supervisor itself (a child subreaper that reports how the command ended
//! and kills the exec's whole tree on request).

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::channel::{
    raw_write, recv_on, send, send_err, send_with_fds, socket_pair, CTL, REPLY_FD,
};
use crate::proto::*;
use crate::spawn::spawn;
use crate::sys::*;

/// The init's view of the execs it runs.
pub(crate) struct Running {
    /// Supervisor pid -> exec id.
    pub(crate) sups: HashMap<i32, u64>,
    /// Exec id -> supervisor pid.
    pub(crate) by_id: HashMap<u64, i32>,
    /// Execs whose tree was asked to die (acknowledged when their supervisor is gone).
    pub(crate) kills: std::collections::HashSet<u64>,
    /// The pid of the supervisor forked ahead of time, until it served an exec (see
    /// [`fork_spare`]).
    pub(crate) spare: Option<i32>,
    /// Whether the sandbox is sealed (only then may a spare be forked: it must inherit the
    /// seal) and a spare should be made when the loop is next idle.
    pub(crate) sealed: bool,
    pub(crate) want_spare: bool,
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
pub(crate) fn fork_spare(run: &mut Running, sfd: RawFd) {
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
                            supervise(id, spec, fds, sfd, Some(&ours), true, &mut stack)
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

/// Reports how an exec ended; `started` is when the command was running (CLOCK_MONOTONIC
/// ns, 0 if it never started): carried here instead of in a message of its own, so the
/// library is not woken while the command runs.
pub(crate) fn exited(id: u64, status: i32, spawned: bool, started: u64) {
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
pub(crate) fn exec(id: u64, payload: &[u8], fds: Vec<OwnedFd>, run: &mut Running, sfd: RawFd) {
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
        let mut fds = fds;
        // The exec's own socket, if the library gave one (after the stdio fds).
        let job = (spec.flags & EXEC_JOB != 0).then(|| fds.pop()).flatten();
        supervise(id, spec, fds, sfd, job.as_ref(), false, &mut child_stack());
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
/// library (a spare's, or one given with `EXEC_JOB`), which then carries the replies and the
/// kill and signal requests; `spare`: whether we may serve another exec afterwards.
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
    spare: bool,
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
                    let mut d = Dec::new(&buf[..n]);
                    match (d.u32(), d.u64(), d.i32()) {
                        (Ok(MSG_KILL), _, _) => kill_tree = true,
                        // Only while the leader lives: its group id is then its own.
                        (Ok(MSG_SIGNAL), Ok(_), Ok(sig)) if !leader_done && sig > 0 && sig < 65 => {
                            // SAFETY: kill(2) of the command's process group.
                            unsafe { kill(-leader, sig) };
                        }
                        _ => {}
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
                if spare && job_fd >= 0 && alone && !killed {
                    exited_with(id, status, true, started, EXITED_REUSABLE);
                    return;
                }
                exited(id, status, true, started);
                drop(outputs.take());
                if spare {
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

/// Reaps every child that has exited: a spare that died, a supervisor whose exec is over
/// (acknowledging a pending kill; reporting one that was killed itself).
pub(crate) fn reap(run: &mut Running) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
