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
//!    every descendant; on `SIGNAL` (the exec's own socket) signals the command's group.
//! 3. `SOCKET`: a TCP socket of the sandbox's network namespace for a published port.
//!
//! Between requests it reaps every zombie of the pid namespace. If the library goes away
//! (socket closed), the init exits and the kernel kills the whole pid namespace.
//!
//! The same sources are the `container-init` workspace package, so that cargo lints them with
//! the workspace's rules and runs their unit tests (`cargo test -p container-init`); the
//! binary cargo builds from it is not the one the library embeds.
//!
//! Modules, along the init's concerns:
//!
//! - `main.rs` (this file): the entry point (the zygote or an init), the bootstrap, and the
//!   init's loop serving the library.
//! - [`zygote`](mod@zygote): the fork server, spare inits, root-filesystem templates.
//! - [`setup`](mod@setup): the setup ops that build the root filesystem (mounts, `pivot_root`...).
//! - [`harden`]: the seal (bounding set, `no_new_privs`, Landlock, seccomp) and each
//!   command's privilege drop.
//! - [`supervise`]: the exec supervisors, spare and on demand, their process trees, kills
//!   and exit reports.
//! - [`spawn`]: a command's start (`PATH` search, vfork-style clone, exec).
//! - [`channel`]: replies and `SOCK_SEQPACKET` packets with file descriptors.
//! - [`sys`]: the C interface (libc declarations, system call numbers, constants).
//! - [`proto`]: the wire format, shared with the library.
//! - `test_util.rs`: helpers for the unit tests.

// Our own C `main`: skips std's runtime start-up (its main-thread stack guard parses
// /proc/self/maps, ~0.2 ms); std itself still works (args come from glibc's init_array).
// Unit tests (`cargo test -p container-init`) run under libtest's own `main` instead.
#![cfg_attr(not(test), no_main)]

#[path = "proto.rs"]
mod proto;

mod channel;
mod harden;
mod setup;
mod spawn;
mod supervise;
mod sys;
#[cfg(test)]
mod test_util;
mod zygote;

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;

use channel::{recv, send, send_err, send_with_fds, CTL};
use proto::*;
use setup::{run_op, setup};
use supervise::{exec, fork_spare, reap, Running};
use sys::*;
use zygote::{zygote, AHEAD};

/// Finishes the namespaces. The zygote cloned us as pid 1 of a new pid namespace, in a new
/// user namespace (one process, no extra `clone` for pid 1); the mount, UTS, IPC and network
/// namespaces are made here (a spare has them) while the library makes the cgroups. The
/// library wrote our id maps before `START`, and `MAPS` follows it at once.
/// `MSG_SOCKET`: a TCP socket of the sandbox's network namespace, for the library to connect
/// to a published port with (it cannot enter the namespace itself when rootless).
fn tcp_socket(id: u64, payload: &[u8]) {
    const AF_INET: c_int = 2;
    const AF_INET6: c_int = 10;
    const SOCK_STREAM_CLOEXEC: c_int = 1 | 0o2000000;
    let family = match payload.first() {
        Some(6) => AF_INET6,
        _ => AF_INET,
    };
    // SAFETY: socket(2) with constant arguments; the fd is owned right away.
    let fd = unsafe { socket(family, SOCK_STREAM_CLOEXEC, 0) };
    if fd < 0 {
        return send_err(id, 0, &io::Error::last_os_error(), "socket");
    }
    // SAFETY: a fresh fd nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let e = Enc::header(REP_OK, id);
    if let Err(err) = send_with_fds(CTL, &e.0, &[fd]) {
        send_err(id, 0, &err, "send socket");
    }
}

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

// Not the symbol `main` in unit tests: libtest's entry point is.
#[cfg_attr(not(test), no_mangle)]
extern "C" fn main(argc: c_int, argv: *const *const c_char) -> c_int {
    // Every signal at its default and none blocked, whatever the library's process had (a
    // background job's ignored SIGINT and SIGQUIT, say): the zygote starts clean, and so
    // does every init it clones, their supervisors and the commands they start, since none
    // of them changes a disposition afterwards (the init's own mask is cleared again in
    // each command's child, see `spawn`).
    reset_signals();
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
                        MSG_SOCKET => tcp_socket(id, payload),
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
    use super::*;

    /// Commands inherit no ignored signal because the zygote resets every disposition once
    /// (`reset_signals`, `sandbox-agent-proto`'s, first thing in `main`) and nothing in the
    /// init changes one after: no `signal`/`sigaction` of libc is declared, and no
    /// `rt_sigaction` is made.
    #[test]
    fn nothing_but_reset_signals_sets_a_disposition() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for e in std::fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            if path.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("mod tests {").next().unwrap();
            let name = path.file_name().unwrap().to_string_lossy();
            for decl in [
                "fn signal(",
                "fn sigaction(",
                "fn bsd_signal(",
                "fn sigset(",
            ] {
                assert!(!code.contains(decl), "{name} declares `{decl}`");
            }
            assert!(
                !code.contains("NR_RT_SIGACTION"),
                "{name} makes an rt_sigaction call"
            );
        }
    }

    /// Every source of the init is part of [`SOURCE_HASH`], with `sandbox-agent-proto`'s (a
    /// module missing from its list would let a stale embedded init pass the library's
    /// check).
    #[test]
    fn the_source_hash_covers_every_init_source() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let (hash, names) = sandbox_agent_proto::hash_sources_in(dir).unwrap();
        assert_eq!(
            hash ^ sandbox_agent_proto::SOURCE_HASH,
            SOURCE_HASH,
            "init sources: {names:?}"
        );
    }
}
