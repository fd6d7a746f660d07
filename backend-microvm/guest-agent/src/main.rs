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

mod interactive;
#[path = "proto.rs"]
mod proto;
mod root;

use root::*;

use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
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
    fn signal(sig: c_int, handler: usize) -> usize;
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
const SIGPIPE: c_int = 13;
const SIG_DFL: usize = 0;
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
        // After the console: a failure is then told to the host too.
        if let Err(e) = root.and_then(|r| r.map_or(Ok(()), |r| image_root(&r))) {
            let msg = format!("image root: {e}");
            log(&msg);
            setup_error = Some(msg);
        }
        let cmdline = fs::read_to_string("/proc/cmdline").unwrap_or_default();
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
// pid 1 set-up

fn cstr(s: &str) -> CString {
    CString::new(s).unwrap_or_default()
}

fn mount_fs(fstype: &str, dst: &str, flags: u64, data: &str) {
    let _ = fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dst);
    let (src, dst_c, ty, data_c) = (cstr(fstype), cstr(dst), cstr(fstype), cstr(data));
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
    let r = unsafe {
        mount(
            src.as_ptr(),
            dst_c.as_ptr(),
            ty.as_ptr(),
            flags,
            data_c.as_ptr().cast(),
        )
    };
    if r != 0 {
        log(&format!(
            "mount {fstype} on {dst}: {}",
            io::Error::last_os_error()
        ));
    }
}

/// `MemAvailable` of `/proc/meminfo`, KiB (0 when unreadable).
fn mem_available_kib() -> u64 {
    fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Caps of the guest's tmpfs mounts. Their files live in the guest's RAM and nothing can
/// reclaim them: uncapped (each tmpfs defaults to half the RAM), files could fill it and
/// leave every command, then this agent, to the guest's OOM killer, losing the sandbox. The
/// same policy as `sandbox_core::Limits::tmpfs_caps` (this binary is std-only), taken from
/// the RAM left after the kernel and the initramfs: together at most 5/8 of it in data and
/// one inode per 8 KiB of it; `/tmp` and `/dev/shm` an eighth each, the workspace the rest.
/// A full mount is `ENOSPC`.
///
/// With an image root, its writable layer (`/run/rw`) is a third tmpfs of the scratch size,
/// taken from the workspace's share, so the total stays the same.
struct TmpfsCaps {
    scratch: (u64, u64),
    workspace: (u64, u64),
}

impl TmpfsCaps {
    #[cfg(test)]
    fn of_ram(avail_kib: u64) -> TmpfsCaps {
        Self::of_ram_with(avail_kib, false)
    }

    fn of_ram_with(avail_kib: u64, image_root: bool) -> TmpfsCaps {
        let ram = avail_kib.saturating_mul(1024);
        let (data, inodes) = (ram / 8 * 5, ram / 8192);
        let scratch = ((data / 8).max(1 << 20), (inodes / 8).max(256));
        let n = if image_root { 3 } else { 2 };
        let workspace = (
            data.saturating_sub(n * scratch.0).max(1 << 20),
            inodes.saturating_sub(n * scratch.1).max(256),
        );
        TmpfsCaps { scratch, workspace }
    }

    fn scratch(&self, mode: &str) -> String {
        format!(
            "{mode},size={},nr_inodes={}",
            self.scratch.0, self.scratch.1
        )
    }

    fn workspace(&self, mode: &str) -> String {
        format!(
            "{mode},size={},nr_inodes={}",
            self.workspace.0, self.workspace.1
        )
    }
}

/// Mounts the system filesystems and loads the boot modules; returns what the kernel command
/// line asks for an image root (read once `/proc` is there), sized from the same budget.
fn system_setup() -> Result<Option<RootConfig>, RootError> {
    mount_fs("proc", "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "");
    mount_fs("sysfs", "/sys", MS_NOSUID | MS_NODEV | MS_NOEXEC, "");
    let root = fs::read_to_string("/proc/cmdline")
        .map_err(|e| RootError::Config(format!("/proc/cmdline: {e}")))
        .and_then(|c| root_config(&c));
    mount_fs("devtmpfs", "/dev", MS_NOSUID, "mode=0755");
    mount_fs(
        "devpts",
        "/dev/pts",
        MS_NOSUID | MS_NOEXEC,
        "mode=0620,ptmxmode=0666",
    );
    let caps = TmpfsCaps::of_ram_with(mem_available_kib(), matches!(root, Ok(Some(_))));
    let root = root.map(|r| {
        r.map(|mut r| {
            let size = r.size.clone().unwrap_or_else(|| caps.scratch.0.to_string());
            r.layer_opts = format!("mode=0755,size={size},nr_inodes={}", caps.scratch.1);
            r
        })
    });
    mount_fs(
        "tmpfs",
        "/dev/shm",
        MS_NOSUID | MS_NODEV,
        &caps.scratch("mode=1777"),
    );
    mount_fs(
        "tmpfs",
        "/tmp",
        MS_NOSUID | MS_NODEV,
        &caps.scratch("mode=1777"),
    );
    mount_fs(
        "tmpfs",
        WORKSPACE,
        MS_NOSUID | MS_NODEV,
        &caps.workspace("mode=0755"),
    );
    // SAFETY: plain syscall wrapper with no pointers.
    unsafe { setpgid(0, 0) };
    if let Ok(text) = fs::read_to_string(Path::new(MODULES).join("modules.dep")) {
        for e in load_modules(Path::new(MODULES), &text) {
            log(&e);
        }
    }
    root
}

const MODULES: &str = "/lib/modules";

/// Loads every module of a `modules.dep`-format list (`path: dep dep...`, paths relative to
/// `dir`), each after its dependencies; returns the failures (an already loaded module is
/// not one).
fn load_modules(dir: &Path, text: &str) -> Vec<String> {
    let mut deps: HashMap<String, Vec<String>> = HashMap::new();
    let mut order = Vec::new();
    for line in text.lines() {
        let Some((m, d)) = line.split_once(':') else {
            continue;
        };
        let m = m.trim().to_string();
        order.push(m.clone());
        deps.insert(m, d.split_whitespace().map(str::to_string).collect());
    }
    let mut done = HashSet::new();
    let mut failed = Vec::new();
    for m in order {
        load_module(dir, &m, &deps, &mut done, 0, &mut failed);
    }
    failed
}

fn load_module(
    dir: &Path,
    m: &str,
    deps: &HashMap<String, Vec<String>>,
    done: &mut HashSet<String>,
    depth: usize,
    failed: &mut Vec<String>,
) {
    if depth > 32 || !done.insert(m.to_string()) {
        return;
    }
    // modules.dep lists the deepest dependency last: load from the end.
    if let Some(ds) = deps.get(m) {
        for d in ds.iter().rev() {
            load_module(dir, d, deps, done, depth + 1, failed);
        }
    }
    let path = dir.join(m);
    let f = match File::open(&path) {
        Ok(f) => f,
        Err(e) => {
            failed.push(format!("module {}: {e}", path.display()));
            return;
        }
    };
    let empty = cstr("");
    // SAFETY: finit_module(fd, params, flags) with a valid open fd and a NUL-terminated string.
    let r = unsafe { syscall(NR_FINIT_MODULE, f.as_raw_fd(), empty.as_ptr(), 0) };
    if r != 0 && errno() != EEXIST {
        failed.push(format!(
            "load {}: {}",
            path.display(),
            io::Error::last_os_error()
        ));
    }
}

/// Waits for `/dev/hvc0` (the virtio-console driver registers it asynchronously) and opens it
/// in raw mode.
fn open_console() -> io::Result<File> {
    let path = Path::new("/dev/hvc0");
    let mut waited = 0u32;
    let f = loop {
        match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(0o400 /* O_NOCTTY */)
            .open(path)
        {
            Ok(f) => break f,
            // ENODEV/ENXIO until the port is ready; ENOENT until devtmpfs has the node.
            Err(e) if waited < 60_000 => {
                if waited.is_multiple_of(5000) && waited > 0 {
                    log(&format!("waiting for /dev/hvc0: {e}"));
                }
                thread::sleep(Duration::from_millis(2));
                waited += 2;
            }
            Err(e) => return Err(e),
        }
    };
    let mut t = Termios([0; 128]);
    // SAFETY: `t` is a writable buffer larger than glibc's struct termios; fd is open.
    if unsafe { tcgetattr(f.as_raw_fd(), &mut t) } == 0 {
        // SAFETY: as above; cfmakeraw only edits the struct, tcsetattr reads it.
        unsafe {
            cfmakeraw(&mut t);
            tcsetattr(f.as_raw_fd(), 0 /* TCSANOW */, &t);
        }
    }
    Ok(f)
}

fn power_off() -> ! {
    // SAFETY: kill(-1) signals every process but us; sync and reboot take no pointers.
    unsafe {
        kill(-1, SIGKILL);
        sync();
        reboot(RB_AUTOBOOT);
    }
    // Not reached as pid 1 (reboot does not return); elsewhere just stop.
    std::process::exit(0);
}

// ---------------------------------------------------------------------------------------------
// the protocol loop

/// Writes whole frames to the channel, one at a time.
#[derive(Clone)]
struct Chan(Arc<Mutex<File>>);

impl Chan {
    fn send(&self, id: u32, r: &Response) {
        let frame = r.encode(id);
        let mut f = lock(&self.0);
        let _ = f.write_all(&frame);
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
    /// Background processes: request id -> their input, terminal and output window.
    spawned: interactive::Table,
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
        chan: Chan(Arc::new(Mutex::new(chan))),
        workspace,
        user,
        procs: Arc::new((Mutex::new(Procs::default()), Condvar::new())),
        running: Arc::new(Mutex::new(HashMap::new())),
        spawned: Arc::new(Mutex::new(HashMap::new())),
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
                let st2 = st.clone();
                let spawned = thread::Builder::new().spawn(move || exec(&st2, id, x, None));
                if let Err(e) = spawned {
                    st.chan.error(id, ErrorKind::Io, format!("thread: {e}"));
                }
            }
            Request::Spawn {
                exec: x,
                tty,
                window,
            } => {
                let st2 = st.clone();
                let spawned =
                    thread::Builder::new().spawn(move || exec(&st2, id, x, Some((tty, window))));
                if let Err(e) = spawned {
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
                let pg = lock(&st.running).get(&target).copied();
                match pg {
                    Some(pg) if (1..65).contains(&signo) => {
                        // SAFETY: kill on a process group we created; no pointers.
                        unsafe { kill(-pg, signo) };
                        st.chan.send(id, &Response::Ok);
                    }
                    Some(_) => st
                        .chan
                        .error(id, ErrorKind::Invalid, format!("signal {signo}")),
                    None => st.chan.error(id, ErrorKind::NotFound, "no such process"),
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
                }
            }
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
            Request::Kill { target } => {
                let pg = lock(&st.running).get(&target).copied();
                match pg {
                    Some(pg) => {
                        // SAFETY: kill on a process group we created; no pointers.
                        unsafe { kill(-pg, SIGKILL) };
                        st.chan.send(id, &Response::Ok);
                    }
                    None => st.chan.error(id, ErrorKind::NotFound, "no such exec"),
                }
            }
            Request::Shutdown => {
                for p in lock(&st.spawned).values() {
                    p.window.close();
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

// ---------------------------------------------------------------------------------------------
// exec

fn pipe() -> io::Result<(File, File)> {
    let mut fds = [0 as c_int; 2];
    // SAFETY: fds is a writable array of two ints.
    if unsafe { pipe2(fds.as_mut_ptr(), O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two new descriptors that we now own.
    Ok(unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) })
}

/// Finds `prog` in `path` like execvp does.
fn lookup(prog: &str, path: &str, cwd: &Path) -> Option<PathBuf> {
    if prog.contains('/') {
        let p = Path::new(prog);
        return Some(if p.is_absolute() {
            p.to_path_buf()
        } else {
            cwd.join(p)
        });
    }
    path.split(':')
        .map(|d| {
            if d.is_empty() {
                cwd.to_path_buf()
            } else {
                PathBuf::from(d)
            }
            .join(prog)
        })
        .find(|p| {
            fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

fn exit_info(status: i32) -> ExitInfo {
    let sig = status & 0x7f;
    if sig == 0 {
        ExitInfo {
            code: Some((status >> 8) & 0xff),
            ..ExitInfo::default()
        }
    } else {
        ExitInfo {
            signal: Some(sig),
            ..ExitInfo::default()
        }
    }
}

/// Pumps one output pipe to the channel, within the shared output budget.
fn pump(
    mut r: File,
    chan: Chan,
    id: u32,
    stderr: bool,
    sent: Arc<AtomicU64>,
    max: u64,
    truncated: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; proto::CHUNK];
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        let mut take = n;
        if max > 0 {
            let before = sent.fetch_add(n as u64, Ordering::SeqCst);
            let left = max.saturating_sub(before);
            take = usize::try_from(left.min(n as u64)).unwrap_or(n);
            if take < n {
                truncated.store(true, Ordering::SeqCst);
            }
        }
        if take > 0 {
            let data = buf.get(..take).unwrap_or_default().to_vec();
            chan.send(
                id,
                &if stderr {
                    Response::Stderr(data)
                } else {
                    Response::Stdout(data)
                },
            );
        }
    }
}

fn resolve_cwd(ws: &Path, cwd: &str) -> PathBuf {
    if cwd.is_empty() {
        return ws.to_path_buf();
    }
    if let Some(rest) = cwd.strip_prefix(WORKSPACE) {
        if rest.is_empty() || rest.starts_with('/') {
            return ws.join(rest.trim_start_matches('/'));
        }
    }
    let p = Path::new(cwd);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        ws.join(p)
    }
}

/// Runs `x` for request `id`: an exec, or with `spawn` (its terminal, if any, and its
/// initial output window) a background process (see [`interactive`]).
fn exec(st: &State, id: u32, x: ExecRequest, spawn: Option<(Option<(u16, u16)>, u32)>) {
    let chan = &st.chan;
    let Some(prog) = x.argv.first() else {
        return chan.error(id, ErrorKind::Invalid, "empty argv");
    };
    let cwd = resolve_cwd(&st.workspace, &x.cwd);
    let path_var = x
        .env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone());
    let mut env: Vec<String> = x.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if path_var.is_none() {
        env.push(format!("PATH={DEFAULT_PATH}"));
    }
    let path_var = path_var.unwrap_or_else(|| DEFAULT_PATH.to_string());
    let Some(exe) = lookup(prog, &path_var, &cwd) else {
        if spawn.is_some() {
            // A background process is answered `Ok` when it starts, before its output.
            chan.send(id, &Response::Ok);
        }
        chan.send(
            id,
            &Response::Stderr(format!("agent: {prog}: command not found\n").into_bytes()),
        );
        return chan.send(
            id,
            &Response::Exit(ExitInfo {
                code: Some(127),
                ..ExitInfo::default()
            }),
        );
    };
    // Everything the child needs, prepared before fork: it may not allocate afterwards.
    let to_c = |s: &[u8]| CString::new(s).ok();
    let exe_c = to_c(exe.as_os_str().as_bytes());
    let cwd_c = to_c(cwd.as_os_str().as_bytes());
    let argv_c: Option<Vec<CString>> = x.argv.iter().map(|a| to_c(a.as_bytes())).collect();
    let env_c: Option<Vec<CString>> = env.iter().map(|a| to_c(a.as_bytes())).collect();
    let (Some(exe_c), Some(cwd_c), Some(argv_c), Some(env_c)) = (exe_c, cwd_c, argv_c, env_c)
    else {
        return chan.error(id, ErrorKind::Invalid, "NUL byte in argv, env or cwd");
    };
    let mut argv_p: Vec<*const c_char> = argv_c.iter().map(|c| c.as_ptr()).collect();
    argv_p.push(std::ptr::null());
    let mut env_p: Vec<*const c_char> = env_c.iter().map(|c| c.as_ptr()).collect();
    env_p.push(std::ptr::null());

    let pipes = (|| Ok::<_, io::Error>((pipe()?, pipe()?, pipe()?, pipe()?)))();
    let ((in_r, in_w), (out_r, out_w), (err_r, err_w), (fail_r, fail_w)) = match pipes {
        Ok(p) => p,
        Err(e) => return chan.error(id, ErrorKind::Io, format!("pipe: {e}")),
    };
    // A terminal instead of the pipes: the child's stdin, stdout, stderr and controlling
    // terminal (of a session of its own).
    let pty = match spawn.and_then(|(tty, _)| tty) {
        Some((rows, cols)) => match interactive::open_pty(rows, cols) {
            Ok(p) => Some(p),
            Err(e) => return chan.error(id, ErrorKind::Io, format!("terminal: {e}")),
        },
        None => None,
    };
    let slave_fd = pty.as_ref().map_or(-1, |(_, slave)| slave.as_raw_fd());
    let user = st.user;
    let (tx, rx) = mpsc::channel();
    let (m, cv) = &*st.procs;
    let pid = {
        // Hold the table while forking so the reaper cannot see the child's exit before the
        // child is registered.
        let mut g = lock(m);
        // SAFETY: fork; the child below only makes async-signal-safe calls on data prepared
        // before the fork, then execs or exits.
        let pid = unsafe { fork() };
        if pid == 0 {
            // SAFETY: child side, async-signal-safe calls only; all pointers were prepared
            // before fork and stay valid until execve or _exit.
            unsafe {
                if slave_fd >= 0 {
                    setsid();
                    interactive::ioctl(slave_fd, interactive::TIOCSCTTY, 0);
                    dup2(slave_fd, 0);
                    dup2(slave_fd, 1);
                    dup2(slave_fd, 2);
                } else {
                    setpgid(0, 0);
                    dup2(in_r.as_raw_fd(), 0);
                    dup2(out_w.as_raw_fd(), 1);
                    dup2(err_w.as_raw_fd(), 2);
                }
                signal(SIGPIPE, SIG_DFL);
                // The image's user: groups, then gid, then uid (after which none can change).
                let dropped = match user {
                    None => true,
                    Some((uid, gid)) => {
                        setgroups(0, std::ptr::null()) == 0 && setgid(gid) == 0 && setuid(uid) == 0
                    }
                };
                if dropped && chdir(cwd_c.as_ptr()) == 0 {
                    execve(exe_c.as_ptr(), argv_p.as_ptr(), env_p.as_ptr());
                }
                let e = (*__errno_location()).to_le_bytes();
                write(fail_w.as_raw_fd(), e.as_ptr(), e.len());
                _exit(127);
            }
        }
        if pid > 0 {
            g.waiters.insert(pid, tx);
            g.generation = g.generation.wrapping_add(1);
            cv.notify_all();
        }
        pid
    };
    if pid < 0 {
        return chan.error(
            id,
            ErrorKind::Io,
            format!("fork: {}", io::Error::last_os_error()),
        );
    }
    // Also set the group from the parent side (whichever runs first wins; same result). Not
    // for a terminal's session leader: `setsid` fails in a process that leads a group.
    if pty.is_none() {
        // SAFETY: no pointers.
        unsafe { setpgid(pid, pid) };
    }
    lock(&st.running).insert(id, pid);
    drop((in_r, out_w, err_w, fail_w));
    // Our copy of the terminal's slave goes: its reads end when the process's copies do.
    let master = pty.map(|(m, _slave)| m);

    // A background process is registered before anything can fail, so its `Input`s find it.
    let mut input = None;
    if let Some((_, window)) = spawn {
        let (tx, rx) = mpsc::channel();
        let tty = master.as_ref().and_then(|m| m.try_clone().ok());
        let w = match &master {
            Some(m) => m.try_clone().ok(),
            None => Some(in_w.try_clone().ok()).flatten(),
        };
        let p = Arc::new(interactive::Spawned {
            input: Mutex::new(Some(tx)),
            tty,
            window: Arc::new(interactive::Window::new(window)),
        });
        lock(&st.spawned).insert(id, Arc::clone(&p));
        input = Some((p, rx, w));
        // Started and registered: the host's `Input`s and `Signal`s find it from here on.
        chan.send(id, &Response::Ok);
    }

    let mut fail = [0u8; 4];
    let mut fail_r = fail_r;
    let exec_failed = matches!(fail_r.read(&mut fail), Ok(4));
    let stdin = x.stdin;
    let sent = Arc::new(AtomicU64::new(0));
    let truncated = Arc::new(AtomicBool::new(false));
    let (writer, readers): (_, Vec<_>) = match input {
        // A background process: its input thread, and its output within the window (a
        // terminal's output, stdout and stderr merged, is stdout).
        Some((p, rx, w)) => {
            let (c, tty) = (chan.clone(), master.is_some());
            let writer = thread::spawn(move || {
                if let Some(w) = w {
                    interactive::input_thread(w, tty, stdin, rx, c);
                }
            });
            drop(in_w);
            let outputs: Vec<(File, bool)> = match master {
                Some(m) => vec![(m, false)],
                None => vec![(out_r, false), (err_r, true)],
            };
            let readers = outputs
                .into_iter()
                .map(|(r, is_err)| {
                    let (c, win) = (chan.clone(), Arc::clone(&p.window));
                    thread::spawn(move || interactive::pump_windowed(r, c, id, is_err, win))
                })
                .collect();
            (writer, readers)
        }
        None => {
            let writer = thread::spawn(move || {
                let mut w = in_w;
                let _ = w.write_all(&stdin);
            });
            let readers = [(out_r, false), (err_r, true)]
                .into_iter()
                .map(|(r, is_err)| {
                    let (c, s, t) = (chan.clone(), sent.clone(), truncated.clone());
                    let max = x.max_output;
                    thread::spawn(move || pump(r, c, id, is_err, s, max, t))
                })
                .collect();
            (writer, readers)
        }
    };

    let mut timed_out = false;
    let status = if x.timeout_ms > 0 {
        match rx.recv_timeout(Duration::from_millis(x.timeout_ms)) {
            Ok(s) => Some(s),
            Err(RecvTimeoutError::Timeout) => {
                timed_out = true;
                // SAFETY: kill on the child's own process group; no pointers.
                unsafe { kill(-pid, SIGKILL) };
                rx.recv().ok()
            }
            Err(RecvTimeoutError::Disconnected) => None,
        }
    } else {
        rx.recv().ok()
    };
    // Whatever the command left behind in its group goes too (it would hold the pipes open).
    // SAFETY: as above.
    unsafe { kill(-pid, SIGKILL) };
    for r in readers {
        let _ = r.join();
    }
    // A background process's input thread ends with the last sender of its queue.
    lock(&st.spawned).remove(&id);
    let _ = writer.join();
    lock(&st.running).remove(&id);
    if exec_failed {
        let e = io::Error::from_raw_os_error(i32::from_le_bytes(fail));
        chan.send(
            id,
            &Response::Stderr(format!("agent: {prog}: {e}\n").into_bytes()),
        );
    }
    let mut info = status.map(exit_info).unwrap_or_default();
    info.timed_out = timed_out;
    info.truncated = truncated.load(Ordering::SeqCst);
    if exec_failed {
        info = ExitInfo {
            code: Some(if fail_errno_is_noent(&fail) { 127 } else { 126 }),
            ..info
        };
    }
    chan.send(id, &Response::Exit(info));
}

fn fail_errno_is_noent(fail: &[u8; 4]) -> bool {
    i32::from_le_bytes(*fail) == 2
}

// ---------------------------------------------------------------------------------------------
// files

type FileError = (ErrorKind, String);

fn io_err(what: &str, path: &str, e: &io::Error) -> FileError {
    let kind = match e.kind() {
        io::ErrorKind::NotFound => ErrorKind::NotFound,
        _ => ErrorKind::Io,
    };
    (kind, format!("{what} {path}: {e}"))
}

/// Maps a protocol path (relative to the workspace, or absolute under `/workspace`) to a path
/// under `ws`, lexically normalised; refuses anything that leaves the workspace.
fn ws_path(ws: &Path, path: &str) -> Result<PathBuf, FileError> {
    if path.contains('\0') {
        return Err((ErrorKind::Invalid, "NUL byte in path".into()));
    }
    let rel = if path.starts_with('/') {
        match path.strip_prefix(WORKSPACE) {
            Some(r) if r.is_empty() || r.starts_with('/') => r,
            _ => return Err((ErrorKind::PathEscape, format!("{path}: outside /workspace"))),
        }
    } else {
        path
    };
    let mut parts: Vec<&OsStr> = Vec::new();
    for c in Path::new(rel).components() {
        match c {
            Component::Normal(p) => parts.push(p),
            Component::ParentDir => {
                if parts.pop().is_none() {
                    return Err((ErrorKind::PathEscape, format!("{path}: outside /workspace")));
                }
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    let mut full = ws.to_path_buf();
    full.extend(parts);
    Ok(full)
}

/// Refuses a path whose existing part resolves (through symlinks) outside the workspace.
fn check_inside(ws: &Path, full: &Path, shown: &str) -> Result<(), FileError> {
    let root = fs::canonicalize(ws).map_err(|e| io_err("workspace", shown, &e))?;
    let mut p = full.to_path_buf();
    loop {
        match fs::canonicalize(&p) {
            Ok(c) if c.starts_with(&root) => return Ok(()),
            Ok(_) => break,
            Err(_) => {
                if fs::symlink_metadata(&p).is_ok() {
                    // A dangling symlink: where it would lead is unknown; refuse.
                    break;
                }
                if !p.pop() {
                    break;
                }
            }
        }
    }
    Err((
        ErrorKind::PathEscape,
        format!("{shown}: outside /workspace"),
    ))
}

fn write_file(
    ws: &Path,
    user: Option<(u32, u32)>,
    path: &str,
    mode: u32,
    append: bool,
    data: &[u8],
) -> Result<(), FileError> {
    let full = ws_path(ws, path)?;
    if full == ws {
        return Err((ErrorKind::Invalid, format!("{path}: is the workspace")));
    }
    check_inside(ws, &full, path)?;
    if let Some(parent) = full.parent() {
        fs::create_dir_all(parent).map_err(|e| io_err("create", path, &e))?;
        check_inside(ws, &full, path)?;
        // The directories between the workspace and the file belong to the commands' user.
        if let (Some((uid, gid)), Ok(rel)) = (user, parent.strip_prefix(ws)) {
            let mut d = ws.to_path_buf();
            for c in rel.components() {
                d.push(c);
                std::os::unix::fs::lchown(&d, Some(uid), Some(gid))
                    .map_err(|e| io_err("chown", path, &e))?;
            }
        }
    }
    let mode = if mode & 0o7777 == 0 {
        0o644
    } else {
        mode & 0o7777
    };
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .append(append)
        .truncate(!append)
        .mode(mode)
        .custom_flags(0o400000 /* O_NOFOLLOW */)
        .open(&full)
        .map_err(|e| io_err("write", path, &e))?;
    if let Some((uid, gid)) = user {
        std::os::unix::fs::fchown(&f, Some(uid), Some(gid))
            .map_err(|e| io_err("chown", path, &e))?;
    }
    f.write_all(data).map_err(|e| io_err("write", path, &e))
}

fn read_file(st: &State, id: u32, path: &str, max: u64) -> Result<(), FileError> {
    let ws = &st.workspace;
    let full = ws_path(ws, path)?;
    check_inside(ws, &full, path)?;
    let mut f = File::open(&full).map_err(|e| io_err("read", path, &e))?;
    let meta = f.metadata().map_err(|e| io_err("read", path, &e))?;
    if meta.is_dir() {
        return Err((ErrorKind::Invalid, format!("{path}: is a directory")));
    }
    if meta.len() > max {
        return Err((
            ErrorKind::TooLarge,
            format!("{path}: {} bytes, over the limit of {max}", meta.len()),
        ));
    }
    let mut buf = vec![0u8; proto::CHUNK];
    let mut total: u64 = 0;
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("read", path, &e)),
        };
        total = total.saturating_add(n as u64);
        if total > max {
            return Err((
                ErrorKind::TooLarge,
                format!("{path}: grew over {max} bytes"),
            ));
        }
        st.chan.send(
            id,
            &Response::Data(buf.get(..n).unwrap_or_default().to_vec()),
        );
    }
    st.chan.send(id, &Response::Ok);
    Ok(())
}

fn list(ws: &Path, path: &str) -> Result<Vec<Entry>, FileError> {
    let full = ws_path(ws, path)?;
    check_inside(ws, &full, path)?;
    let rd = fs::read_dir(&full).map_err(|e| io_err("list", path, &e))?;
    let mut v = Vec::new();
    for e in rd {
        let e = e.map_err(|e| io_err("list", path, &e))?;
        let Ok(meta) = fs::symlink_metadata(e.path()) else {
            continue;
        };
        let ft = meta.file_type();
        let kind = if ft.is_symlink() {
            EntryKind::Symlink
        } else if ft.is_dir() {
            EntryKind::Dir
        } else if ft.is_file() {
            EntryKind::File
        } else {
            EntryKind::Other
        };
        v.push(Entry {
            name: e.file_name().to_string_lossy().into_owned(),
            kind,
            size: meta.len(),
        });
    }
    v.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(v)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn tmpfs_caps_leave_processes_a_quarter_of_the_ram() {
        // 200 MiB available: 125 MiB of data, 25,600 inodes; /tmp and /dev/shm an eighth.
        let c = TmpfsCaps::of_ram(200 << 10);
        assert_eq!(c.scratch, ((125 << 20) / 8, 3200));
        assert_eq!(c.workspace, ((125 << 20) / 8 * 6, 19_200));
        assert_eq!(
            c.scratch("mode=1777"),
            "mode=1777,size=16384000,nr_inodes=3200"
        );
        // Data plus ~1 KiB of kernel memory per inode stays within 3/4 of the RAM.
        for mib in [16u64, 200, 4096] {
            let c = TmpfsCaps::of_ram(mib << 10);
            let worst = 2 * c.scratch.0 + c.workspace.0 + (2 * c.scratch.1 + c.workspace.1) * 1024;
            assert!(worst <= (mib << 20) / 4 * 3, "{mib} MiB");
        }
    }

    #[test]
    fn an_image_root_layer_comes_out_of_the_workspace_share() {
        let plain = TmpfsCaps::of_ram_with(200 << 10, false);
        let root = TmpfsCaps::of_ram_with(200 << 10, true);
        assert_eq!(root.scratch, plain.scratch);
        assert_eq!(root.workspace.0, plain.workspace.0 - plain.scratch.0);
        assert_eq!(root.workspace.1, plain.workspace.1 - plain.scratch.1);
        // Three scratch-sized mounts and the workspace: still 5/8 of the RAM at most.
        assert!(3 * root.scratch.0 + root.workspace.0 <= (200 << 20) / 8 * 5);
    }

    #[test]
    fn user_parameter() {
        assert_eq!(user_config("console=ttyS0 quiet").unwrap(), None);
        assert_eq!(
            user_config("agent.root=/dev/vda agent.user=1000:100").unwrap(),
            Some((1000, 100))
        );
        // Root is no user switch at all.
        assert_eq!(user_config("agent.user=0:0").unwrap(), None);
        for bad in [
            "agent.user=1000",
            "agent.user=me:me",
            "agent.user=-1:0",
            "agent.user=",
        ] {
            assert!(user_config(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn image_root_parameters() {
        let plain = "console=ttyS0 reboot=k panic=1 rdinit=/init";
        assert_eq!(root_config(plain).unwrap(), None);
        let c = root_config("console=ttyS0 agent.root=/dev/vda quiet")
            .unwrap()
            .unwrap();
        assert_eq!(c.device, "/dev/vda");
        assert_eq!(c.size, None);
        assert_eq!(c.wait, Duration::from_secs(DEFAULT_ROOT_WAIT_S));
        let c = root_config("agent.root=/dev/vdb agent.root_size=64m agent.root_wait=3")
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.device.as_str(), c.size.as_deref(), c.wait),
            ("/dev/vdb", Some("64m"), Duration::from_secs(3))
        );
        assert_eq!(
            root_config("agent.root=/dev/vda agent.root_size=25%")
                .unwrap()
                .unwrap()
                .size
                .as_deref(),
            Some("25%")
        );
        for bad in [
            "agent.root=vda",
            "agent.root=/dev/",
            "agent.root=/dev/../etc/x",
            "agent.root=/tmp/img",
            "agent.root=/dev/vda agent.root_size=lots",
            "agent.root=/dev/vda agent.root_size=64mm",
            "agent.root=/dev/vda agent.root_size=1,nr_inodes=1",
            "agent.root=/dev/vda agent.root_wait=0",
            "agent.root=/dev/vda agent.root_wait=1h",
            "agent.root_size=64m",
        ] {
            let e = root_config(bad).unwrap_err();
            assert!(matches!(e, RootError::Config(_)), "{bad}: {e}");
            assert!(e.to_string().starts_with("bad kernel command line"), "{e}");
        }
    }

    #[test]
    fn an_initramfs_without_image_root_modules_is_named_as_such() {
        let dir = std::env::temp_dir().join(format!("agent-root-mods-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let e = root_modules_list(&dir).unwrap_err().to_string();
        assert!(
            e.contains("no image-root modules") && e.contains("install the guest again"),
            "{e}"
        );
        fs::write(
            dir.join(ROOT_MODULES_DEP),
            "kernel/ext4.ko: kernel/jbd2.ko\n",
        )
        .unwrap();
        assert_eq!(
            root_modules_list(&dir).unwrap(),
            "kernel/ext4.ko: kernel/jbd2.ko\n"
        );
        // Missing module files are reported, dependencies first, and nothing panics.
        let failed = load_modules(&dir, "kernel/ext4.ko: kernel/jbd2.ko\n");
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert!(failed[0].contains("jbd2.ko"), "{failed:?}");
        let e = RootError::Modules(failed).to_string();
        assert!(e.contains("ext4.ko"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn deleting_the_initramfs_keeps_to_its_filesystem() {
        let dir = std::env::temp_dir().join(format!("agent-delete-{}", std::process::id()));
        fs::create_dir_all(dir.join("a/b")).unwrap();
        fs::write(dir.join("a/b/f"), [0u8; 100]).unwrap();
        fs::write(dir.join("top"), [0u8; 10]).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("a/link")).unwrap();
        assert_eq!(delete_on_device(&dir), 110);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        // Symlinks are deleted, never followed. (Mounts under it are left alone: the QEMU
        // test's image root, whose mounts sit under the deleted initramfs, shows that.)
        assert!(fs::metadata("/etc/passwd").is_ok());
        assert_eq!(delete_on_device(Path::new("/nonexistent")), 0);
        fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn workspace_paths_are_confined() {
        let ws = Path::new("/w");
        assert_eq!(ws_path(ws, "a/b").unwrap(), Path::new("/w/a/b"));
        assert_eq!(ws_path(ws, "./a/../b").unwrap(), Path::new("/w/b"));
        assert_eq!(ws_path(ws, "/workspace/a").unwrap(), Path::new("/w/a"));
        assert_eq!(ws_path(ws, "/workspace").unwrap(), Path::new("/w"));
        assert_eq!(ws_path(ws, "").unwrap(), Path::new("/w"));
        for bad in [
            "../x",
            "/etc/passwd",
            "/workspace/../x",
            "/workspacex/a",
            "a/../../b",
        ] {
            assert_eq!(
                ws_path(ws, bad).unwrap_err().0,
                ErrorKind::PathEscape,
                "{bad}"
            );
        }
        assert_eq!(ws_path(ws, "a\0b").unwrap_err().0, ErrorKind::Invalid);
    }

    #[test]
    fn cwd_mapping() {
        let ws = Path::new("/w");
        assert_eq!(resolve_cwd(ws, ""), Path::new("/w"));
        assert_eq!(resolve_cwd(ws, "/workspace/x"), Path::new("/w/x"));
        assert_eq!(resolve_cwd(ws, "sub"), Path::new("/w/sub"));
        assert_eq!(resolve_cwd(ws, "/tmp"), Path::new("/tmp"));
    }

    #[test]
    fn wait_status_decoding() {
        assert_eq!(exit_info(3 << 8).code, Some(3));
        assert_eq!(exit_info(9).signal, Some(9));
        assert_eq!(exit_info(9).code, None);
    }
}
