//! agent-sandbox microVM guest agent: pid 1 of the guest's initramfs.
//!
//! Built by backend-microvm's `build.rs` with plain `rustc` (std only, no crates) as a static
//! binary and stored as `/init` in the initramfs the library builds.
//!
//! As pid 1 it mounts `/proc`, `/sys`, `/dev` (devtmpfs), `/tmp` and `/workspace` (tmpfs),
//! loads the kernel modules listed in `/lib/modules/modules.dep` (dependencies first) with
//! `finit_module`, waits for `/dev/hvc0` (the virtio-console port that is the agent channel),
//! puts it in raw mode and serves the framed protocol of `proto.rs` on it: exec (a new process
//! group per command, the exact environment given, stdin, a timeout that kills the group,
//! stdout/stderr streamed in chunks, exit status), file write/read/list confined to the
//! workspace, ping, kill and shutdown (`reboot`: the VMM sees the reset and ends the VM);
//! background processes (`interactive.rs`: input kept open, signals, a terminal of the
//! guest's devpts, output within a window the host refills). A reaper thread collects every
//! child, including orphans re-parented to pid 1.
//!
//! Image root: when the kernel command line has `agent.root=<device>` (a block device under
//! `/dev`, normally `/dev/vda`: a read-only ext4 image of an OCI image's filesystem), the
//! agent loads the image-root modules (`/lib/modules/root-modules.dep`: virtio-blk, ext4,
//! overlayfs), waits for the device, mounts it read-only (ext4) on `/run/lower`, a tmpfs on
//! `/run/rw` (`upper/`, `work/`), their overlay on `/run/root`, moves `/proc`, `/sys`, `/dev`,
//! `/tmp` and `/workspace` into it and makes it the root the way `switch_root` does (the
//! initramfs cannot be `pivot_root`ed): the image's programs then run as commands, the image
//! is never written, and its changes live in the guest's RAM. Parameters:
//!
//! - `agent.root=/dev/vda`: the device (absent: no image root; the boot is unchanged).
//! - `agent.root_size=<n>[k|m|g|%]`: the writable layer's tmpfs size (default: an eighth of
//!   the tmpfs budget, like `/tmp`, taken from the workspace's share).
//! - `agent.root_wait=<seconds>`: how long to wait for the device to appear (default 10).
//!
//! - `agent.user=<uid>:<gid>`: run every command as this user (an image's `User`), with no
//!   supplementary groups; the workspace and the files written into it through the agent
//!   belong to it (absent: commands run as root, the guest's only user that matters).
//! - `agent.net=<addr>/<prefix>,<gateway>`: load the virtio-net driver (from the initramfs's
//!   own list, before an image root replaces it), give `eth0` that IPv4 address, a default
//!   route through the gateway, and `/etc/resolv.conf` naming the gateway (absent: no
//!   network driver, only `lo`). See `net.rs`.
//!
//! If that fails (a bad parameter, an initramfs without those modules, no device, a mount
//! refused), the agent says why on the console and, before `Ready`, in an `Error` frame with
//! request id 0 (the host's `AgentClient::wait_ready` returns it), then serves from the
//! initramfs for diagnosis.
//!
//! Test mode: started as an ordinary process (not pid 1) with `AGENT_CHANNEL_FD=<fd>`, it
//! skips the system set-up and serves on that inherited file descriptor, with the workspace
//! at `AGENT_WORKSPACE` (default `/workspace`); `Shutdown` then just ends the process. The
//! host-side tests drive the real binary this way over a socketpair.
//!
//! Nothing the host sends may crash it: malformed frames get an `Error` answer and the loop
//! goes on; there is no `unwrap` on input-derived values.
//!
//! Modules, along the agent's concerns:
//!
//! - `main.rs` (this file): the entry point, the C interface, and the protocol loop
//!   (`serve`) with the reaper.
//! - `setup`: the pid 1 set-up (filesystems and their tmpfs budget, kernel modules, the
//!   console channel, power-off).
//! - `root`: an image's disk as the overlay root, and `agent.user`.
//! - `net`: `agent.net=`, the guest's `eth0`, its route and `resolv.conf`.
//! - `exec`: a command's start, its output pumps and its exit.
//! - `identity`: a fresh hostname, random state and clock (`Refresh`).
//! - `trust`: the egress proxy's CA in the root's certificate bundles (`Trust`).
//! - `interactive`: background processes (input, signals, terminals, output windows) and
//!   connections to the guest's loopback (published ports).
//! - `files`: write, read and list, confined to the workspace.
//! - `watch`: file watches (inotify in the guest), their events within a window.
//! - `proto`: the wire format, shared with the host.
//! - `tests`: the unit tests (of this file's modules).

mod exec;
mod files;
mod identity;
mod interactive;
mod net;
#[path = "proto.rs"]
mod proto;
mod root;
mod setup;
mod trust;
mod watch;

use exec::*;
use files::*;
use net::*;
use root::*;
use setup::*;

use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use proto::{
    Entry, EntryKind, ErrorKind, ExecRequest, ExitInfo, ReadError, Request, Response, MAX_PAYLOAD,
    SOURCE_HASH,
};

#[allow(non_camel_case_types)]
type c_int = i32;
#[allow(non_camel_case_types)]
type c_char = std::ffi::c_char;

extern "C" {
    fn syscall(n: i64, ...) -> i64;
    fn mount(
        src: *const c_char,
        dst: *const c_char,
        fstype: *const c_char,
        flags: u64,
        data: *const std::ffi::c_void,
    ) -> c_int;
    fn fork() -> c_int;
    fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char)
        -> c_int;
    fn setpgid(pid: c_int, pgid: c_int) -> c_int;
    fn setsid() -> c_int;
    fn dup2(old: c_int, new: c_int) -> c_int;
    fn chdir(path: *const c_char) -> c_int;
    fn chroot(path: *const c_char) -> c_int;
    fn setgroups(n: usize, groups: *const u32) -> c_int;
    fn setgid(gid: u32) -> c_int;
    fn setuid(uid: u32) -> c_int;
    fn pipe2(fds: *mut c_int, flags: c_int) -> c_int;
    fn write(fd: c_int, buf: *const u8, n: usize) -> isize;
    fn _exit(code: c_int) -> !;
    fn waitpid(pid: c_int, status: *mut c_int, options: c_int) -> c_int;
    fn kill(pid: c_int, sig: c_int) -> c_int;
    fn getpid() -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, ...) -> c_int;
    fn tcgetattr(fd: c_int, t: *mut Termios) -> c_int;
    fn tcsetattr(fd: c_int, act: c_int, t: *const Termios) -> c_int;
    fn cfmakeraw(t: *mut Termios);
    fn sync();
    fn reboot(cmd: c_int) -> c_int;
    fn __errno_location() -> *mut c_int;
}

/// glibc's `struct termios` is 60 bytes; a larger, aligned buffer is enough for the calls
/// that only pass it around.
#[repr(C, align(8))]
struct Termios([u8; 128]);

const O_CLOEXEC: c_int = 0o2000000;
const F_SETFD: c_int = 2;
const FD_CLOEXEC: c_int = 1;
const SIGKILL: c_int = 9;
const ECHILD: i32 = 10;
const EINTR: i32 = 4;
const EEXIST: i32 = 17;
const MS_RDONLY: u64 = 1;
const MS_NOSUID: u64 = 2;
const MS_NODEV: u64 = 4;
const MS_NOEXEC: u64 = 8;
const MS_MOVE: u64 = 8192;
const RB_AUTOBOOT: c_int = 0x0123_4567;
#[cfg(target_arch = "x86_64")]
const NR_FINIT_MODULE: i64 = 313;
#[cfg(target_arch = "aarch64")]
const NR_FINIT_MODULE: i64 = 273;

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const WORKSPACE: &str = "/workspace";

fn log(msg: &str) {
    let _ = writeln!(io::stderr(), "agent: {msg}");
}

/// Every signal back at its default and an empty mask: what a command's child does before
/// `execve`, which keeps ignored dispositions and the mask (the agent itself ignores
/// `SIGPIPE`, the Rust runtime's, and in test mode inherits whatever its parent had).
use sandbox_agent_proto::signals::reset_signals;

fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn main() {
    // SAFETY: getpid has no preconditions.
    let pid1 = unsafe { getpid() } == 1;
    let mut setup_error = None;
    let mut user = None;
    let chan = if pid1 {
        let root = system_setup();
        let chan = match open_console() {
            Ok(f) => f,
            Err(e) => {
                log(&format!("no agent channel: {e}"));
                power_off();
            }
        };
        let cmdline = fs::read_to_string("/proc/cmdline").unwrap_or_default();
        if let Err(e) = loopback_up() {
            let msg = format!("network: {e}");
            log(&msg);
            setup_error = Some(msg);
        }
        // After the console: a failure is then told to the host too. The network driver is
        // loaded from the initramfs, so before an image root replaces it.
        let net = net_config(&cmdline).and_then(|n| match n {
            Some(n) => bring_up(&n).map(|()| Some(n)),
            None => Ok(None),
        });
        if let Err(e) = root.and_then(|r| r.map_or(Ok(()), |r| image_root(&r))) {
            let msg = format!("image root: {e}");
            log(&msg);
            setup_error = Some(msg);
        }
        if let Err(e) = net.and_then(|n| n.map_or(Ok(()), |n| write_resolv_conf(&n))) {
            let msg = format!("network: {e}");
            log(&msg);
            setup_error.get_or_insert(msg);
        }
        match user_config(&cmdline) {
            Ok(u) => user = u,
            Err(e) => {
                let msg = format!("user: {e}");
                log(&msg);
                setup_error.get_or_insert(msg);
            }
        }
        chan
    } else {
        let fd = std::env::var("AGENT_CHANNEL_FD")
            .ok()
            .and_then(|v| v.parse::<RawFd>().ok());
        let Some(fd) = fd.filter(|fd| *fd >= 0) else {
            log("not pid 1 and AGENT_CHANNEL_FD=<fd> not set: nothing to serve");
            std::process::exit(2);
        };
        // Keep the channel out of the commands we run.
        // SAFETY: fcntl on an fd number only changes that descriptor's flags (EBADF if bad).
        if unsafe { fcntl(fd, F_SETFD, FD_CLOEXEC) } != 0 {
            log(&format!(
                "AGENT_CHANNEL_FD={fd}: {}",
                io::Error::last_os_error()
            ));
            std::process::exit(2);
        }
        // Test mode's stand-in for `agent.user=`.
        if let Ok(u) = std::env::var("AGENT_USER") {
            match user_config(&format!("agent.user={u}")) {
                Ok(u) => user = u,
                Err(e) => {
                    log(&format!("AGENT_USER: {e}"));
                    std::process::exit(2);
                }
            }
        }
        // SAFETY: the fd is inherited from our parent for us to own (checked valid above).
        unsafe { File::from_raw_fd(fd) }
    };
    let workspace = if pid1 {
        PathBuf::from(WORKSPACE)
    } else {
        std::env::var_os("AGENT_WORKSPACE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(WORKSPACE))
    };
    // The commands' user owns the workspace (its root; what is made in it is theirs anyway).
    if let Some((uid, gid)) = user {
        if let Err(e) = std::os::unix::fs::chown(&workspace, Some(uid), Some(gid)) {
            let msg = format!("user: chown {} to {uid}:{gid}: {e}", workspace.display());
            log(&msg);
            setup_error.get_or_insert(msg);
        }
    }
    let code = serve(chan, workspace, user, pid1, setup_error);
    if pid1 {
        power_off();
    }
    std::process::exit(code);
}

// ---------------------------------------------------------------------------------------------
// the protocol loop

/// Writes whole frames to the channel, one at a time. `Hold` closes a gate behind its answer:
/// nothing more is written until `Release` opens it (the host snapshots the VM in between, so
/// no frame is cut at the snapshot, and a restored agent sends nothing before its new host
/// is ready for it).
#[derive(Clone)]
struct Chan(Arc<(Mutex<ChanState>, Condvar)>);

struct ChanState {
    file: File,
    held: bool,
}

impl Chan {
    fn new(file: File) -> Chan {
        Chan(Arc::new((
            Mutex::new(ChanState { file, held: false }),
            Condvar::new(),
        )))
    }

    /// Waits while the gate is closed, then writes the frame.
    fn open_state(&self) -> MutexGuard<'_, ChanState> {
        let (m, cv) = &*self.0;
        let mut g = lock(m);
        while g.held {
            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g
    }

    fn send(&self, id: u32, r: &Response) {
        let frame = r.encode(id);
        let mut g = self.open_state();
        let _ = g.file.write_all(&frame);
    }

    /// Sends `r` and closes the gate behind it.
    fn send_and_hold(&self, id: u32, r: &Response) {
        let frame = r.encode(id);
        let mut g = self.open_state();
        let _ = g.file.write_all(&frame);
        g.held = true;
    }

    /// Opens the gate.
    fn release(&self) {
        let (m, cv) = &*self.0;
        lock(m).held = false;
        cv.notify_all();
    }

    /// Opens the gate and sends `r` before anything that waited.
    fn release_and_send(&self, id: u32, r: &Response) {
        let frame = r.encode(id);
        let (m, cv) = &*self.0;
        let mut g = lock(m);
        g.held = false;
        let _ = g.file.write_all(&frame);
        cv.notify_all();
    }
    fn error(&self, id: u32, kind: ErrorKind, message: impl Into<String>) {
        self.send(
            id,
            &Response::Error {
                kind,
                message: message.into(),
            },
        );
    }
}

/// Children we wait for: pid -> where to send its wait status. The reaper thread collects
/// every child (also orphans re-parented to pid 1) and routes known ones here.
#[derive(Default)]
struct Procs {
    waiters: HashMap<i32, mpsc::Sender<i32>>,
    /// Bumped on every fork, so the reaper knows to look again after `ECHILD`.
    generation: u64,
}

struct State {
    chan: Chan,
    workspace: PathBuf,
    /// `agent.user=`: who commands run as and who owns what the agent writes (`None`: root).
    user: Option<(u32, u32)>,
    procs: Arc<(Mutex<Procs>, Condvar)>,
    /// Running execs and background processes: request id -> process group id.
    running: Arc<Mutex<HashMap<u32, i32>>>,
    /// Execs and processes requested but not forked yet: request id -> a signal to send as
    /// soon as they are (a `Kill` or `Signal` that arrived first). Locked inside `running`.
    starting: Arc<Mutex<HashMap<u32, Option<i32>>>>,
    /// Background processes (and connections): request id -> their input, terminal and
    /// output window.
    spawned: interactive::Table,
    /// Connections to the guest's loopback (`Connect`), for `Kill`.
    conns: interactive::Conns,
    /// File watches (`Watch`): request id -> their window and stop, for `Grant` and `Kill`.
    watches: watch::Table,
}

/// Where a signal for request `target` goes.
enum Target {
    /// Its process group.
    Running(i32),
    /// Not forked yet: the signal is recorded and sent as soon as it is.
    Starting,
    None,
}

/// Finds `target` among the running and the starting (recording `signo` for the latter), in
/// one step with the exec thread's move from one to the other.
fn signal_target(st: &State, target: u32, signo: i32) -> Target {
    let running = lock(&st.running);
    if let Some(pg) = running.get(&target) {
        return Target::Running(*pg);
    }
    match lock(&st.starting).get_mut(&target) {
        Some(pending) => {
            *pending = Some(signo);
            Target::Starting
        }
        None => Target::None,
    }
}

fn serve(
    chan: File,
    workspace: PathBuf,
    user: Option<(u32, u32)>,
    pid1: bool,
    setup_error: Option<String>,
) -> i32 {
    let mut reader = match chan.try_clone() {
        Ok(r) => r,
        Err(e) => {
            log(&format!("dup channel: {e}"));
            return 1;
        }
    };
    let st = Arc::new(State {
        chan: Chan::new(chan),
        workspace,
        user,
        procs: Arc::new((Mutex::new(Procs::default()), Condvar::new())),
        running: Arc::new(Mutex::new(HashMap::new())),
        starting: Arc::new(Mutex::new(HashMap::new())),
        spawned: Arc::new(Mutex::new(HashMap::new())),
        conns: Arc::new(Mutex::new(HashMap::new())),
        watches: Arc::new(Mutex::new(HashMap::new())),
    });
    let procs = st.procs.clone();
    thread::spawn(move || reaper(&procs));
    // A set-up failure goes first, unattributed (id 0): the host reads it as the reason the
    // guest is not as asked. The agent still serves (from the initramfs) for diagnosis.
    if let Some(message) = setup_error {
        st.chan.error(0, ErrorKind::Io, message);
    }
    st.chan.send(
        0,
        &Response::Ready {
            source_hash: SOURCE_HASH,
        },
    );
    loop {
        let (hdr, payload) = match proto::read_frame(&mut reader, MAX_PAYLOAD) {
            Ok(Some(f)) => f,
            Ok(None) => return 0,
            Err(ReadError::TooLarge(h)) => {
                st.chan.error(
                    h.id,
                    ErrorKind::Protocol,
                    format!("frame of {} bytes is over the limit", h.len),
                );
                if proto::skip_bytes(&mut reader, u64::from(h.len)).is_err() {
                    return 1;
                }
                continue;
            }
            Err(ReadError::Truncated) => return 1,
            Err(ReadError::Io(e)) => {
                log(&format!("channel read: {e}"));
                return 1;
            }
        };
        let req = match Request::decode(hdr.kind, &payload) {
            Ok(r) => r,
            Err(proto::Malformed) => {
                st.chan.error(
                    hdr.id,
                    ErrorKind::Protocol,
                    format!("malformed frame (kind {}, {} bytes)", hdr.kind, hdr.len),
                );
                continue;
            }
        };
        drop(payload);
        let id = hdr.id;
        match req {
            Request::Exec(x) => {
                // Known from now on: a `Kill` may come before the thread has forked.
                lock(&st.starting).insert(id, None);
                let st2 = st.clone();
                let spawned = thread::Builder::new().spawn(move || exec(&st2, id, x, None));
                if let Err(e) = spawned {
                    lock(&st.starting).remove(&id);
                    st.chan.error(id, ErrorKind::Io, format!("thread: {e}"));
                }
            }
            Request::Spawn {
                exec: x,
                tty,
                window,
            } => {
                lock(&st.starting).insert(id, None);
                let st2 = st.clone();
                let spawned =
                    thread::Builder::new().spawn(move || exec(&st2, id, x, Some((tty, window))));
                if let Err(e) = spawned {
                    lock(&st.starting).remove(&id);
                    st.chan.error(id, ErrorKind::Io, format!("thread: {e}"));
                }
            }
            Request::Input { target, data } => {
                let to = spawned_of(&st, target).and_then(|p| lock(&p.input).clone());
                let sent = to.is_some_and(|tx| tx.send(interactive::Input::Data(data, id)).is_ok());
                if !sent {
                    st.chan.error(
                        id,
                        ErrorKind::NotFound,
                        "no such process, or its input is closed",
                    );
                }
            }
            Request::CloseInput { target } => {
                let to = spawned_of(&st, target).and_then(|p| {
                    let mut g = lock(&p.input);
                    // A pipe is closed once; a terminal takes Ctrl-D any number of times.
                    if p.tty.is_some() {
                        g.clone()
                    } else {
                        g.take()
                    }
                });
                let sent = to.is_some_and(|tx| tx.send(interactive::Input::Close(id)).is_ok());
                if !sent {
                    st.chan.error(
                        id,
                        ErrorKind::NotFound,
                        "no such process, or its input is closed",
                    );
                }
            }
            Request::Signal { target, signo } => {
                if !(1..65).contains(&signo) {
                    st.chan
                        .error(id, ErrorKind::Invalid, format!("signal {signo}"));
                    continue;
                }
                match signal_target(&st, target, signo) {
                    Target::Running(pg) => {
                        // SAFETY: kill on a process group we created; no pointers.
                        unsafe { kill(-pg, signo) };
                        st.chan.send(id, &Response::Ok);
                    }
                    Target::Starting => st.chan.send(id, &Response::Ok),
                    Target::None => st.chan.error(id, ErrorKind::NotFound, "no such process"),
                }
            }
            Request::Resize { target, rows, cols } => match spawned_of(&st, target) {
                Some(p) => match &p.tty {
                    Some(t) => match interactive::resize(t, rows, cols) {
                        Ok(()) => st.chan.send(id, &Response::Ok),
                        Err(e) => st.chan.error(id, ErrorKind::Io, format!("resize: {e}")),
                    },
                    None => st
                        .chan
                        .error(id, ErrorKind::Invalid, "the process has no terminal"),
                },
                None => st.chan.error(id, ErrorKind::NotFound, "no such process"),
            },
            Request::Grant { target, bytes } => {
                if let Some(p) = spawned_of(&st, target) {
                    p.window.give(u64::from(bytes));
                } else if let Some(w) = lock(&st.watches).get(&target) {
                    w.give(u64::from(bytes));
                }
            }
            Request::Watch {
                path,
                recursive,
                window,
            } => watch::start(&st, id, &path, recursive, window),
            Request::WriteFile {
                path,
                mode,
                append,
                data,
            } => match write_file(&st.workspace, st.user, &path, mode, append, &data) {
                Ok(()) => st.chan.send(id, &Response::Ok),
                Err((k, m)) => st.chan.error(id, k, m),
            },
            Request::ReadFile { path, max } => {
                if let Err((k, m)) = read_file(&st, id, &path, max) {
                    st.chan.error(id, k, m);
                }
            }
            Request::List { path } => match list(&st.workspace, &path) {
                Ok(v) => st.chan.send(id, &Response::Entries(v)),
                Err((k, m)) => st.chan.error(id, k, m),
            },
            Request::Ping => st.chan.send(
                id,
                &Response::Pong {
                    source_hash: SOURCE_HASH,
                },
            ),
            Request::Kill { target } => match signal_target(&st, target, SIGKILL) {
                Target::Running(pg) => {
                    // SAFETY: kill on a process group we created; no pointers.
                    unsafe { kill(-pg, SIGKILL) };
                    st.chan.send(id, &Response::Ok);
                }
                Target::Starting => st.chan.send(id, &Response::Ok),
                Target::None if interactive::abort_connection(&st.conns, target) => {
                    st.chan.send(id, &Response::Ok);
                }
                // Its place is free at once (its thread ends within moments).
                Target::None
                    if lock(&st.watches)
                        .remove(&target)
                        .map(|w| w.stop())
                        .is_some() =>
                {
                    st.chan.send(id, &Response::Ok);
                }
                Target::None => st.chan.error(id, ErrorKind::NotFound, "no such exec"),
            },
            Request::Refresh {
                hostname,
                entropy,
                unix_nanos,
            } => {
                // A guest restored from a snapshot: its watches were the snapshot's host's,
                // whose requests the new host does not know; they end here.
                for (_, w) in lock(&st.watches).drain() {
                    w.stop();
                }
                system_change(
                    &st,
                    id,
                    pid1,
                    "refresh sets the hostname, RNG and clock",
                    || {
                        identity::refresh(&hostname, &entropy, unix_nanos)
                            .map_err(|m| (ErrorKind::Io, m))
                    },
                )
            }
            Request::Network { net } => system_change(
                &st,
                id,
                pid1,
                "network reconfigures eth0",
                || match net_config(&format!("agent.net={net}")) {
                    Ok(Some(c)) => reconfigure(&c).map_err(|m| (ErrorKind::Io, m)),
                    Ok(None) => Err((ErrorKind::Invalid, "no network given".into())),
                    Err(m) => Err((ErrorKind::Invalid, m)),
                },
            ),
            Request::Trust { ca_pem } => {
                system_change(&st, id, pid1, "trust writes the root's bundles", || {
                    trust::install(Path::new("/"), &ca_pem).map_err(|m| (ErrorKind::Io, m))
                })
            }
            Request::Connect { port, window } => {
                let st2 = st.clone();
                let spawned = thread::Builder::new()
                    .spawn(move || interactive::connect(&st2, id, port, window));
                if let Err(e) = spawned {
                    st.chan.error(id, ErrorKind::Io, format!("thread: {e}"));
                }
            }
            Request::Hold => st.chan.send_and_hold(id, &Response::Ok),
            Request::Release => st.chan.release_and_send(id, &Response::Ok),
            Request::Shutdown => {
                // A held channel is opened: the answer must reach the host.
                st.chan.release();
                for p in lock(&st.spawned).values() {
                    p.window.close();
                }
                for w in lock(&st.watches).values() {
                    w.stop();
                }
                let groups: Vec<i32> = lock(&st.running).values().copied().collect();
                for pg in groups {
                    // SAFETY: as above.
                    unsafe { kill(-pg, SIGKILL) };
                }
                st.chan.send(id, &Response::Ok);
                if pid1 {
                    power_off();
                }
                return 0;
            }
        }
    }
}

/// The controls of background process `id`, if it runs.
fn spawned_of(st: &State, id: u32) -> Option<Arc<interactive::Spawned>> {
    lock(&st.spawned).get(&id).cloned()
}

fn reaper(procs: &(Mutex<Procs>, Condvar)) {
    let (m, cv) = procs;
    loop {
        let gen = lock(m).generation;
        let mut status: c_int = 0;
        // SAFETY: status is a valid out-pointer.
        let pid = unsafe { waitpid(-1, &mut status, 0) };
        if pid > 0 {
            if let Some(tx) = lock(m).waiters.remove(&pid) {
                let _ = tx.send(status);
            }
            continue;
        }
        match errno() {
            EINTR => {}
            ECHILD => {
                // No children: sleep until the next fork.
                let mut g = lock(m);
                while g.generation == gen {
                    g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
                }
            }
            _ => thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Answers a request that changes the guest system itself (`Refresh`, `Network`, `Trust`):
/// `Ok` or the failure `change` reports; only as pid 1 in a guest, `Error(Invalid)`
/// otherwise (a test agent on a host must not change the host).
fn system_change(
    st: &State,
    id: u32,
    pid1: bool,
    what: &str,
    change: impl FnOnce() -> Result<(), (ErrorKind, String)>,
) {
    if !pid1 {
        st.chan.error(
            id,
            ErrorKind::Invalid,
            format!("{what}: only as pid 1 in a guest"),
        );
        return;
    }
    match change() {
        Ok(()) => st.chan.send(id, &Response::Ok),
        Err((kind, m)) => st.chan.error(id, kind, m),
    }
}

#[cfg(test)]
mod tests;
