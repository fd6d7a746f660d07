//! Starting an exec's command, in its supervisor: the `PATH` search, then a vfork-style
//! clone whose child sets up its stdio, process group, rlimits and privileges, and execs.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::channel::{raw_write, send_err, send_with_fds, REPLY_FD};
use crate::harden::drop_privileges;
use crate::proto::*;
use crate::supervise::exited;
use crate::sys::*;

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
    /// The terminal's slave side (`EXEC_TTY`), else -1: then stdin, stdout and stderr.
    tty: RawFd,
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

/// The command's child (see [`Child`]): stdio, process group, rlimits, privileges, working
/// directory, then `execve` of each candidate path in turn.
extern "C" fn child_main(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the supervisor's `Child`, alive and not touched by the supervisor
    // until we exec or exit (CLONE_VFORK). Only system calls below, no allocation.
    unsafe {
        let c = &mut *(arg as *mut Child);
        // The supervisor blocks the signals it reads through its signalfd: none of that
        // reaches the command. (Dispositions are all at their defaults already: `main`
        // reset them when the zygote started, and nothing since changed one.)
        let empty = SigSet([0; 16]);
        sigprocmask(SIG_SETMASK, &empty, std::ptr::null_mut());
        if c.tty >= 0 {
            // A terminal's command leads its own session, the terminal its controlling one.
            setsid();
            ioctl(c.tty, TIOCSCTTY, 0u64);
            dup2(c.tty, 0);
            dup2(c.tty, 1);
            dup2(c.tty, 2);
        } else {
            if c.stdin >= 0 {
                dup2(c.stdin, 0);
            }
            dup2(c.out, 1);
            dup2(c.err, 2);
            // A process group of its own, in the sandbox's session (the init's, made by
            // `bootstrap`: no controlling terminal). Not a session per exec: `setsid` makes
            // a scheduler autogroup each time, freed through RCU after the command exits.
            setpgid(0, 0);
        }
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

/// A new pseudo-terminal of the sandbox's `devpts` of `(rows, cols)`: (master, slave), the
/// slave owned by the command's user (`ttyname`, `mesg` and the like look at it).
fn open_pty(size: (u16, u16), uid: u32, gid: u32) -> io::Result<(OwnedFd, OwnedFd)> {
    let pty = sandbox_agent_proto::pty::open(size.0, size.1)?;
    // SAFETY: fchown of our own fd; failing (no CAP_CHOWN) leaves it usable through the fd.
    unsafe { fchown(pty.slave.as_raw_fd(), uid, gid) };
    Ok((pty.master, pty.slave))
}

/// Where to look for `cmd`: itself if it has a `/`, else each directory of the command's own
/// `PATH` (like `execvp`; an empty entry is the working directory).
fn candidates(cmd: &str, env: &[String]) -> Vec<String> {
    let path = env
        .iter()
        .find_map(|kv| kv.strip_prefix("PATH="))
        .unwrap_or("/usr/local/bin:/usr/bin:/bin");
    sandbox_agent_proto::path::candidates(cmd, path)
}

/// Starts the command (in the supervisor) with a vfork-style clone: no copy of our page
/// tables, no copy-on-write faults, and we resume once it has exec'd (or failed). Returns the
/// leader's pid and when it was started (see [`Child::started`]), or `None` after reporting why it
/// could not start.
pub(crate) fn spawn(
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
    let (master, slave) = if spec.flags & EXEC_TTY != 0 {
        match open_pty(spec.tty, spec.uid, spec.gid) {
            Ok(p) => (Some(p.0), Some(p.1)),
            Err(e) => return fail(126, format!("agent-sandbox: cannot open a terminal: {e}\n")),
        }
    } else {
        (None, None)
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
        tty: slave.as_ref().map_or(-1, |f| f.as_raw_fd()),
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
        drop(slave);
        if let Some(m) = master {
            // The library reads and writes the terminal from here on (before `EXITED`).
            let fd = REPLY_FD.load(std::sync::atomic::Ordering::Relaxed);
            let _ = send_with_fds(fd, &Enc::header(REP_PTY, id).0, &[m]);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
