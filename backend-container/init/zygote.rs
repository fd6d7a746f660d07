//! The zygote (`--zygote`): the fork server that clones a new init (pid 1 of new user and
//! pid namespaces) for each control socket the library sends, spare inits ahead of time,
//! and the root-filesystem templates.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::channel::{raw_write, recv_on, send_with_fds, socket_pair};
use crate::proto::*;
use crate::setup::build_template;
use crate::sys::*;

/// The fork server (`--zygote [TEMPLATES]`): started once per library process, it forks a
/// new init for every control socket it receives on fd 0 — a fork of this small, idle
/// process costs a fraction of a `posix_spawn` + `execve` of the init (and its libc
/// start-up, whose CPUID probing is slow under virtualization). Each child is cloned with
/// `CLONE_PARENT`, so it is the library's child like a spawned init; its pid is the reply
/// (`u32`; `0` and an errno on failure). Exits when the library closes the socket.
///
/// With `TEMPLATES` (as root), it also builds root-filesystem templates: it makes a mount
/// namespace of its own (a slave of the library's: host mounts still arrive, ours never
/// leave), mounts a tmpfs on `TEMPLATES`, and for each `T` request (`u64` index, the setup
/// ops in a memfd) runs the ops there, which build a template at `TEMPLATES/<index>`; the
/// reply is `1` (or `0` and an errno). It keeps both namespaces and clones each init in the
/// one it needs: template-mode inits (`P` requests, and spares) in the template namespace,
/// where a template is one recursive bind away; the others (`F`) in the library's own, so
/// their bind sources (workspaces, spec mounts, rootfs directories) are the library's
/// current view, whatever was mounted since.
///
/// A `U` request (with one socket) clones a process that only holds a new user namespace
/// for an idmapped host-directory workspace (see [`hold_userns`]); the reply is its pid.
///
/// An `R` request (a one-shot process's teardown, see [`reap_detached`]) has no reply: the
/// zygote finishes a killed sandbox's teardown while the library process exits.
pub(crate) fn zygote(templates: Option<&std::ffi::CStr>) -> ! {
    // SAFETY: prctl/close_range on our own process.
    unsafe {
        prctl(PR_SET_NAME, c"asb-zygote".as_ptr() as u64, 0u64, 0u64, 0u64);
        syscall(NR_CLOSE_RANGE, 3u32, u32::MAX, 0u32);
    }
    // Errno of the template set-up (0: ready); templates are refused with it otherwise.
    let mut tmpl_err = 95 /* EOPNOTSUPP */;
    // The library's mount namespace and ours (templates), as fds to `setns` between; -1
    // without templates (everything happens in the library's).
    let (mut host_ns, mut tmpl_ns) = (-1, -1);
    if let Some(dir) = templates {
        let ns_fd = || {
            // SAFETY: open(2) of a NUL-terminated path.
            unsafe { libc_open(c"/proc/self/ns/mnt".as_ptr(), O_CLOEXEC) }
        };
        host_ns = ns_fd();
        // SAFETY: unshare/mount with NUL-terminated paths, on our own single-threaded process.
        tmpl_err = unsafe {
            let tmpfs = c"tmpfs".as_ptr();
            let opts = c"mode=0711,size=64k".as_ptr() as *const c_void;
            if host_ns < 0
                || unshare(CLONE_NEWNS) < 0
                || mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    MS_REC | MS_SLAVE,
                    std::ptr::null(),
                ) < 0
                || mount(tmpfs, dir.as_ptr(), tmpfs, MS_NOSUID | MS_NODEV, opts) < 0
            {
                errno()
            } else {
                0
            }
        };
        tmpl_ns = ns_fd();
        if tmpl_err == 0 && tmpl_ns < 0 {
            tmpl_err = errno();
        }
    }
    let templates_ok = tmpl_ns >= 0 && tmpl_err == 0;
    // Which namespace we are in: true for the templates'.
    let mut in_tmpl = templates_ok;
    let mut enter = |tmpl: bool| -> bool {
        if tmpl_ns < 0 || tmpl == in_tmpl {
            return true;
        }
        let fd = if tmpl { tmpl_ns } else { host_ns };
        // SAFETY: setns(2) to a mount namespace fd we opened, single-threaded.
        if unsafe { setns(fd, CLONE_NEWNS) } < 0 {
            return false;
        }
        in_tmpl = tmpl;
        true
    };
    let mut buf = [0u8; ZYGOTE_REQUEST_MAX];
    loop {
        let (n, fds) = match recv_on(0, &mut buf) {
            Ok(Some(m)) => m,
            Err(e) if e.raw_os_error() == Some(4) => continue,
            _ => std::process::exit(0),
        };
        if n == 1 && buf[0] == b'S' {
            // A spare init, cloned ahead of time on a socketpair of its own (in the template
            // namespace: spares serve template-mode creates); the reply carries our end.
            let (r, sent) = if !enter(templates_ok) {
                (Err(errno()), Vec::new())
            } else {
                match socket_pair() {
                    Ok((ours, theirs)) => match clone_init(theirs, true) {
                        pid if pid < 0 => (Err(errno()), Vec::new()),
                        pid => (Ok(pid as u32), vec![ours]),
                    },
                    Err(err) => (Err(err.raw_os_error().unwrap_or(5)), Vec::new()),
                }
            };
            if send_with_fds(0, &zygote_reply(r), &sent).is_err() {
                std::process::exit(0);
            }
            continue;
        }
        if n == 9 && buf[0] == b'T' {
            let r = if enter(true) {
                build_template(tmpl_err, fds).map(|()| 1)
            } else {
                Err(io::Error::last_os_error())
            };
            raw_write(
                0,
                &zygote_reply(r.map_err(|e| e.raw_os_error().unwrap_or(5))),
            );
            continue;
        }
        if n >= 1 && buf[0] == b'R' {
            reap_detached(&buf[1..n], fds);
            continue;
        }
        if n == 1 && buf[0] == b'U' {
            // A bare user namespace for an idmapped mount (see `hold_userns`).
            for fd in fds {
                let r = match hold_userns(fd) {
                    pid if pid < 0 => Err(errno()),
                    pid => Ok(pid as u32),
                };
                raw_write(0, &zygote_reply(r));
            }
            continue;
        }
        // `F`: an init in the library's namespace; `P`: one in the templates'.
        let tmpl = n >= 1 && buf[0] == b'P' && templates_ok;
        for fd in fds {
            let r = if !enter(tmpl) {
                Err(errno())
            } else {
                match clone_init(fd, false) {
                    pid if pid < 0 => Err(errno()),
                    pid => Ok(pid as u32),
                }
            };
            raw_write(0, &zygote_reply(r));
        }
    }
}

/// How long a detached teardown waits for the sandbox's init to end, and then for its
/// cgroup directories to drain.
const REAP_PATIENCE_MS: u64 = 10_000;
const RMDIR_PATIENCE_MS: u64 = 2_000;

/// The rest of a one-shot process's sandbox teardown (`R`: payload = cgroup directories,
/// then files, each a `strs` list; fds = a pidfd of the sandbox's init, which the library
/// has killed, then whatever must stay open until the end, e.g. the lease on its uid
/// range). Waits (bounded) for the init to end (with pid 1 of its pid namespace the kernel
/// has ended every process of the sandbox), removes the cgroup directories (leaves first,
/// retrying while they drain), then the files, then closes the fds. Nothing here is
/// sandbox input: the library sends it, about a sandbox it made.
fn reap_detached(payload: &[u8], fds: Vec<OwnedFd>) {
    let mut d = Dec::new(payload);
    let (dirs, files) = (d.strs().unwrap_or_default(), d.strs().unwrap_or_default());
    let pidfd = fds.first();
    let remove_cgroups = || {
        let until = std::time::Instant::now() + std::time::Duration::from_millis(RMDIR_PATIENCE_MS);
        for dir in &dirs {
            remove_cgroup(std::path::Path::new(dir), until);
        }
    };
    // The killed init ends in milliseconds; one that does not (a kernel stuck on its
    // memory) is waited for only so long.
    let ended = pidfd.is_none_or(|p| wait_for_end(p, Some(REAP_PATIENCE_MS)));
    remove_cgroups();
    for f in &files {
        let _ = std::fs::remove_file(f);
    }
    // An init still not gone keeps what `fds` hold (its uid range's lease: no other sandbox
    // gets those uids while one of its processes lives) until it is; its cgroups are then
    // tried once more.
    if let (false, Some(p)) = (ended, pidfd) {
        wait_for_end(p, None);
        remove_cgroups();
    }
    drop(fds);
}

/// Waits until the process of `pidfd` has ended, for at most `patience_ms` (`None`: as
/// long as it takes); whether it has.
fn wait_for_end(pidfd: &OwnedFd, patience_ms: Option<u64>) -> bool {
    let deadline = patience_ms.map(|ms| monotonic_ns().saturating_add(ms * 1_000_000));
    loop {
        let timeout = match deadline {
            Some(d) => (d.saturating_sub(monotonic_ns()) / 1_000_000).min(i32::MAX as u64) as i32,
            None => -1,
        };
        let mut p = PollFd {
            fd: pidfd.as_raw_fd(),
            events: POLLIN,
            revents: 0,
        };
        // SAFETY: poll of one valid pollfd.
        let r = unsafe { poll(&mut p, 1, timeout) };
        match r {
            r if r > 0 => return true,
            r if r < 0 && errno() == 4 /* EINTR */ => {}
            // Another error (none is expected of a valid pidfd): not known to have ended.
            r if r < 0 => return false,
            _ if timeout == 0 => return false,
            _ => {}
        }
    }
}

/// Removes cgroup directory `dir` and any below it (leaves first), retrying each while its
/// last tasks drain (`EBUSY`) until `until`.
fn remove_cgroup(dir: &std::path::Path, until: std::time::Instant) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&e.path(), until);
            }
        }
    }
    loop {
        match std::fs::remove_dir(dir) {
            Err(e)
                if e.raw_os_error() == Some(16 /* EBUSY */)
                    && std::time::Instant::now() < until =>
            {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            _ => return,
        }
    }
}

/// The zygote's 8-byte reply: a non-zero value (a pid, or 1), or 0 and an errno.
fn zygote_reply(r: Result<u32, i32>) -> Vec<u8> {
    let mut e = Enc::default();
    let (v, errno) = match r {
        Ok(v) => (v, 0),
        Err(errno) => (0, errno),
    };
    e.u32(v);
    e.i32(errno);
    e.0
}

/// Whether this init was cloned with all its namespaces (a spare, see [`clone_init`]).
pub(crate) static AHEAD: AtomicBool = AtomicBool::new(false);

/// Clones an init on control socket `ctl`: pid 1 of new user and pid namespaces (see
/// `bootstrap`), the library's child (`CLONE_PARENT`). Returns its pid (or -1, errno set).
///
/// A spare (`ahead`) gets its mount, UTS, IPC and network namespaces in the same `clone`
/// (all owned by its new user namespace, exactly as if it made them after `MSG_START`): a
/// spare waits for a create that has not come yet, so that work (~0.5 ms, mostly the network
/// namespace) is off the create's path. Other inits make them after `REP_BOOT`, in parallel
/// with the library's part of the bootstrap.
fn clone_init(ctl: OwnedFd, ahead: bool) -> i64 {
    let mut flags = CLONE_PARENT | CLONE_NEWUSER | CLONE_NEWPID;
    if ahead {
        flags |= CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET;
    }
    // SAFETY: single-threaded; the child only moves its fd into place and runs the init
    // from the top, like a freshly executed one.
    let pid = unsafe { syscall(NR_CLONE, flags as u64, 0u64, 0u64, 0u64, 0u64) };
    if pid == 0 {
        // SAFETY: fd plumbing on our own process: the socket becomes stdin, every other
        // inherited fd (e.g. our end of a spare's socketpair) goes.
        unsafe {
            dup2(ctl.as_raw_fd(), 0);
            syscall(NR_CLOSE_RANGE, 3u32, u32::MAX, 0u32);
        }
        std::mem::forget(ctl);
        AHEAD.store(ahead, Ordering::Relaxed);
        crate::init_main();
    }
    pid
}

/// Clones a process in a new user namespace (the library's child, `CLONE_PARENT`) that does
/// nothing but hold it: the library writes its id maps, opens `/proc/<pid>/ns/user` for
/// `mount_setattr(MOUNT_ATTR_IDMAP)` (an idmapped host-directory workspace), then kills and
/// reaps it. It keeps `hold` (the library's socket) as fd 0 and exits when the other end
/// hangs up, so it never outlives a library that died meanwhile. Returns its pid (or -1,
/// errno set).
fn hold_userns(hold: OwnedFd) -> i64 {
    // SAFETY: single-threaded; the child only moves its fd into place and waits.
    let pid = unsafe {
        syscall(
            NR_CLONE,
            (CLONE_PARENT | CLONE_NEWUSER) as u64,
            0u64,
            0u64,
            0u64,
            0u64,
        )
    };
    if pid == 0 {
        // SAFETY: fd plumbing and a poll on our own process.
        unsafe {
            dup2(hold.as_raw_fd(), 0);
            syscall(NR_CLOSE_RANGE, 3u32, u32::MAX, 0u32);
            loop {
                let mut p = PollFd {
                    fd: 0,
                    events: 0,
                    revents: 0,
                };
                if poll(&mut p, 1, -1) > 0 && p.revents != 0 {
                    _exit(0);
                }
            }
        }
    }
    pid
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_detached_teardown_waits_for_the_end_then_removes_leaves_first() {
        let t = crate::test_util::TempDir::new("reap");
        std::fs::create_dir_all(t.join("cg/sub/leaf")).unwrap();
        std::fs::create_dir_all(t.join("cg2")).unwrap();
        std::fs::write(t.join("state"), b"x").unwrap();
        std::fs::write(t.join("kept"), b"x").unwrap();
        // Stands in for the killed init: it ends on its own a moment later.
        let mut child = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        // SAFETY: pidfd_open(2) of our own unreaped child.
        let raw = unsafe {
            syscall(434 /* pidfd_open */, child.id() as u64, 0u64)
        };
        assert!(raw >= 0, "pidfd_open: {}", io::Error::last_os_error());
        // SAFETY: a new descriptor we own.
        let pidfd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw as i32) };
        let mut e = Enc::default();
        e.strs(&[t.at("cg"), t.at("cg2"), t.at("missing")]);
        e.strs(&[t.at("state")]);
        reap_detached(&e.0, vec![pidfd]);
        // It returned only once the process had ended (its exit status is there to take).
        assert!(
            child.try_wait().unwrap().is_some(),
            "returned before the end"
        );
        assert!(!t.join("cg").exists() && !t.join("cg2").exists());
        assert!(!t.join("state").exists());
        assert!(t.join("kept").exists());
    }

    #[test]
    fn zygote_replies_are_a_value_or_an_errno() {
        let reply = |r| {
            let b = zygote_reply(r);
            let mut d = Dec::new(&b);
            let v = (d.u32().unwrap(), d.i32().unwrap());
            assert!(d.rest().is_empty());
            v
        };
        assert_eq!(reply(Ok(4242)), (4242, 0));
        assert_eq!(reply(Ok(1)), (1, 0));
        assert_eq!(reply(Err(13)), (0, 13));
    }
}
