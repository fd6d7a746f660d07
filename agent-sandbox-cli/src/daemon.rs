//! The local daemon: `agent-sandbox serve --local` on a private Unix socket, and `run`'s use
//! of it (see `docs/server.md`, "The local daemon").
//!
//! A one-shot `run` process cannot keep anything between runs: each pays for its sandbox's
//! creation and teardown. When the daemon of the same user and the same build listens, `run`
//! asks it instead: the daemon keeps warm pools (a ready sandbox of the spec `run` sends
//! every time), and its teardown goes on after `run` has exited. When there is no daemon (no
//! socket, nothing listening, another build), `run` works in-process as before.
//!
//! Trust: the socket is in a directory only its user can enter (made `0700`, checked before
//! binding and before connecting), so only that user (and root) reaches it; the daemon grants
//! them host access (host-directory workspaces, mounts, local images) because they have it
//! already.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The environment variable that keeps `run` in-process even when a daemon listens.
pub(crate) const NO_DAEMON_ENV: &str = "AGENT_SANDBOX_NO_DAEMON";

/// The environment variable that puts the daemon's socket elsewhere (for `serve --local`
/// and `run` alike; its directory must still be private).
pub(crate) const SOCKET_ENV: &str = "AGENT_SANDBOX_DAEMON_SOCKET";

/// The daemon's socket: `$AGENT_SANDBOX_DAEMON_SOCKET` if set, else
/// `/run/agent-sandbox/daemon.sock` for root, else
/// `$XDG_RUNTIME_DIR/agent-sandbox/daemon.sock`, else `/tmp/agent-sandbox-$UID/daemon.sock`.
pub(crate) fn socket_path() -> PathBuf {
    if let Some(p) = std::env::var_os(SOCKET_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    // SAFETY: geteuid has no preconditions.
    let dir = if unsafe { libc::geteuid() } == 0 {
        PathBuf::from("/run/agent-sandbox")
    } else {
        user_runtime_dir()
    };
    dir.join("daemon.sock")
}

/// This user's directory for the CLI's runtime files (the daemon's socket, a generated
/// token): `$XDG_RUNTIME_DIR/agent-sandbox`, else `/tmp/agent-sandbox-$UID`.
pub(crate) fn user_runtime_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("agent-sandbox"),
        // SAFETY: geteuid has no preconditions.
        None => PathBuf::from(format!("/tmp/agent-sandbox-{}", unsafe { libc::geteuid() })),
    }
}

/// Whether `dir` is a directory (not a link) of this user that nobody else may enter.
fn private_dir(dir: &Path) -> bool {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    std::fs::symlink_metadata(dir)
        .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.mode() & 0o077 == 0)
}

/// Makes the socket's directory (`0700`) if it is missing, and checks it: one that someone
/// else owns or may enter is refused, with what to do.
pub(crate) fn prepare_dir(socket: &Path) -> Result<(), String> {
    let Some(dir) = socket.parent() else {
        return Err(format!("{}: no directory", socket.display()));
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {
            // The umask may have taken bits away, never added: set it exactly.
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| format!("chmod 700 {}: {e}", dir.display()))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("make {}: {e}", dir.display())),
    }
    if !private_dir(dir) {
        return Err(format!(
            "{} is not a directory of this user that only it may enter (mode 0700): \
             remove it, or fix its owner and mode",
            dir.display()
        ));
    }
    Ok(())
}

/// Which build this binary is: its version and its executable's identity (device, inode,
/// modification time), so a daemon started from another build (an upgrade, a rebuild) is
/// never used in its place. Worked out once per process.
pub(crate) fn build_id() -> &'static str {
    static BUILD: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BUILD.get_or_init(exe_build_id)
}

fn exe_build_id() -> String {
    let exe = std::env::current_exe()
        .and_then(std::fs::metadata)
        .map(|m| {
            format!(
                "{:x}:{:x}:{}.{}",
                m.dev(),
                m.ino(),
                m.mtime(),
                m.mtime_nsec()
            )
        })
        .unwrap_or_else(|_| "unknown".into());
    format!("{} {exe}", env!("CARGO_PKG_VERSION"))
}

/// Why `run` found no daemon to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Missing {
    /// `AGENT_SANDBOX_NO_DAEMON` keeps this run in-process.
    Off,
    /// Nothing listens: no socket, or one a dead daemon left behind.
    NotListening,
    /// Something listens but this run may not or cannot use it: another build, a directory
    /// others may enter, a server that does not answer as ours does.
    Unusable,
}

/// The daemon, when one of this user and build listens on [`socket_path`]; otherwise why
/// not (then `run` works in-process). `named_tier`: the run names its tier, so the
/// daemon's tiers are not asked for (its build is checked by the run itself, which answers
/// `Unavailable` for another build: `run` then works in-process).
pub(crate) async fn connect(
    named_tier: bool,
) -> Result<agent_sandbox::remote::RemoteServer, Missing> {
    use agent_sandbox::remote::{RemoteConfig, RemoteServer};
    if std::env::var_os(NO_DAEMON_ENV).is_some_and(|v| !v.is_empty() && v != "0") {
        return Err(Missing::Off);
    }
    let path = socket_path();
    // Cheap checks first: with no daemon, `run` pays one failed `lstat`.
    let is_socket = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_socket());
    if !is_socket {
        return Err(Missing::NotListening);
    }
    if !path.parent().is_some_and(private_dir) {
        return Err(Missing::Unusable);
    }
    // Nothing listening (a daemon that died and left its socket): in-process. Checked here,
    // before anything is sent, so that a failure later is never retried here (the command
    // may have run).
    if let Err(e) = std::os::unix::net::UnixStream::connect(&path) {
        tracing::debug!(error = %e, "no local daemon; running in-process");
        return Err(Missing::NotListening);
    }
    let config = RemoteConfig::new(&format!("unix:{}", path.display()))
        .map_err(|_| Missing::Unusable)?
        // A one-shot run need not wait for its sandbox's teardown.
        .destroy_without_waiting(true)
        .ask_tiers(!named_tier);
    let server = match RemoteServer::connect(config).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, "the local daemon did not answer; running in-process");
            return Err(Missing::Unusable);
        }
    };
    if !named_tier && server.build() != Some(build_id()) {
        tracing::debug!(
            daemon = ?server.build(),
            "the local daemon is another build; running in-process"
        );
        return Err(Missing::Unusable);
    }
    Ok(server)
}

/// The environment variable that lets `run` start the daemon itself: `auto` starts
/// `serve --local --idle-exit 600` in the background when none listens (this run still
/// works in-process; the next ones use the daemon until it has idled ten minutes).
pub(crate) const START_ENV: &str = "AGENT_SANDBOX_DAEMON";

/// How long a daemon that `run` started stays idle before it stops, in seconds.
pub(crate) const AUTO_IDLE_EXIT_SECS: u64 = 600;

/// Whether this run should start the daemon ([`START_ENV`] is `auto`).
pub(crate) fn auto_start() -> bool {
    std::env::var_os(START_ENV).is_some_and(|v| v == "auto")
}

/// Starts this build's daemon in the background (`serve --local --idle-exit 600`, in a
/// session of its own, in `/`, holding none of this process's descriptors but its stdio,
/// its messages appended to `daemon.log` beside its socket) and returns at once, without
/// waiting for it to listen. Two runs that start one at the same moment are safe: the
/// daemon's lock lets one of them serve and the other exit. Failing to start it is not
/// this run's failure: it is logged and the run goes on.
pub(crate) fn start_in_background() {
    use std::os::unix::fs::OpenOptionsExt;
    let socket = socket_path();
    if let Err(e) = prepare_dir(&socket) {
        tracing::warn!("{START_ENV}=auto: the daemon was not started: {e}");
        return;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!("{START_ENV}=auto: the daemon was not started: this executable: {e}");
            return;
        }
    };
    let log = socket.with_file_name("daemon.log");
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&log)
        .map_or_else(|_| std::process::Stdio::null(), std::process::Stdio::from);
    let started = std::process::Command::new(exe)
        .args(["serve", "--local", "--idle-exit"])
        .arg(AUTO_IDLE_EXIT_SECS.to_string())
        .env_remove(START_ENV)
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn_detached();
    match started {
        // Not waited for: it outlives this run (and is reaped by whoever adopts it).
        Ok(child) => tracing::debug!(pid = child.id(), "started the local daemon"),
        Err(e) => tracing::warn!("{START_ENV}=auto: the daemon was not started: {e}"),
    }
}

/// Spawning a process that outlives its caller's session and descriptors.
trait SpawnDetached {
    /// Spawns it in a session of its own (no controlling terminal: neither a Ctrl-C meant
    /// for the caller's job nor the terminal's hangup reaches it), with every descriptor
    /// the caller inherited besides stdio closed at its exec: a pipe that the caller's own
    /// parent waits on (its end of an agent CLI's capture) must not stay open for the
    /// daemon's lifetime. It starts with every signal at its default and none blocked
    /// ([`sandbox_core::process::reset_signals`]): a run started from a background job (`SIGINT` and `SIGQUIT`
    /// ignored) or under `nohup` (`SIGHUP` ignored) must not hand that on to the daemon and
    /// from it to every sandbox it makes.
    fn spawn_detached(&mut self) -> std::io::Result<std::process::Child>;
}

impl SpawnDetached for std::process::Command {
    fn spawn_detached(&mut self) -> std::io::Result<std::process::Child> {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs in the forked child before exec and makes only
        // async-signal-safe system calls (rt_sigaction, rt_sigprocmask, setsid,
        // close_range); it allocates nothing and takes no lock.
        unsafe {
            self.pre_exec(|| {
                sandbox_core::process::reset_signals();
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Marked close-on-exec rather than closed, so the standard library's own
                // exec-error pipe still works. Kernels before 5.11 lack the flag: the
                // descriptors then stay as they were.
                let _ = libc::syscall(
                    libc::SYS_close_range,
                    3u32,
                    u32::MAX,
                    libc::CLOSE_RANGE_CLOEXEC,
                );
                Ok(())
            })
        }
        .spawn()
    }
}

/// The lock a daemon holds on its socket's directory for its whole life (`daemon.lock`
/// beside the socket, holding its pid), so that exactly one serves a socket even when two
/// start at once.
pub(crate) struct DaemonLock {
    _file: std::fs::File,
}

/// Takes the daemon lock for `socket`, or says which daemon holds it.
pub(crate) fn lock(socket: &Path) -> Result<DaemonLock, String> {
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let path = socket.with_extension("lock");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns; no memory is involved.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(format!("lock {}: {e}", path.display()));
        }
        let mut pid = String::new();
        let _ = file.read_to_string(&mut pid);
        return Err(format!(
            "a daemon already listens on {} (pid {})",
            socket.display(),
            pid.trim()
        ));
    }
    let wrote = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()));
    if let Err(e) = wrote {
        return Err(format!("write {}: {e}", path.display()));
    }
    Ok(DaemonLock { _file: file })
}

/// The pid of the daemon that holds the lock for `socket`, if one does.
#[cfg(test)]
fn holder(socket: &Path) -> Option<u32> {
    let path = socket.with_extension("lock");
    let file = std::fs::File::open(&path).ok()?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this function owns; no memory is involved.
    let free = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0;
    if free {
        return None;
    }
    std::fs::read_to_string(&path).ok()?.trim().parse().ok()
}

/// The tier the daemon should run `spec` on for `choice`: the tier named, or the
/// selector's first tier that the daemon's host runs and that automatic selection does not
/// pass over for this spec ([`Capabilities::passes_over`](agent_sandbox::Capabilities::passes_over)),
/// as `Runtime::create` picks in-process. `None`: none qualifies, and the run is left to
/// this process (whose full probe says why).
pub(crate) fn tier_for(
    server: &agent_sandbox::remote::RemoteServer,
    choice: agent_sandbox::TierChoice,
    spec: &agent_sandbox::SandboxSpec,
) -> Option<agent_sandbox::Tier> {
    let question = match choice {
        agent_sandbox::TierChoice::Tier(t) => return Some(t),
        agent_sandbox::TierChoice::Auto(q) => q,
        _ => return None,
    };
    let mut q = question;
    q.language = spec.language;
    agent_sandbox::Selector.rank(&q).into_iter().find_map(|r| {
        let info = server.tiers().iter().find(|t| t.status.tier == r.tier)?;
        let caps = info.capabilities.as_ref()?;
        (info.status.available && caps.passes_over(spec).is_none()).then_some(r.tier)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_directory_must_be_private() {
        let t = tempfile::tempdir().expect("tempdir");
        let sock = t.path().join("d").join("daemon.sock");
        prepare_dir(&sock).expect("a new directory");
        let dir = sock.parent().expect("parent");
        let mode = std::fs::metadata(dir).expect("stat").mode() & 0o777;
        assert_eq!(mode, 0o700);
        // Opened to others: refused, and left as it is (it is not ours to fix).
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let e = prepare_dir(&sock).expect_err("a directory others may enter");
        assert!(e.contains("0700"), "{e}");
        // A link to a private directory is not that directory.
        let real = t.path().join("real");
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&real)
            .expect("mkdir");
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&real, &link).expect("symlink");
        assert!(
            prepare_dir(&link.join("daemon.sock")).is_err(),
            "a link was taken"
        );
    }

    #[test]
    fn the_build_names_this_executable() {
        let a = build_id();
        assert!(a.starts_with(env!("CARGO_PKG_VERSION")), "{a}");
        assert!(!a.ends_with("unknown"), "{a}");
        assert_eq!(a, exe_build_id(), "the build id is not stable");
    }

    #[test]
    fn one_daemon_holds_the_lock_and_names_itself() {
        let t = tempfile::tempdir().expect("tempdir");
        let sock = t.path().join("daemon.sock");
        assert_eq!(holder(&sock), None);
        let held = lock(&sock).expect("the first lock");
        assert_eq!(holder(&sock), Some(std::process::id()));
        let e = lock(&sock)
            .err()
            .expect("a second lock while the first is held");
        assert!(
            e.contains("already listens") && e.contains(&std::process::id().to_string()),
            "{e}"
        );
        drop(held);
        assert_eq!(holder(&sock), None);
        let again = lock(&sock).expect("the lock after its holder let go");
        drop(again);
        // A planted link in the lock's place is not followed.
        std::fs::remove_file(sock.with_extension("lock")).expect("rm");
        std::os::unix::fs::symlink(t.path().join("elsewhere"), sock.with_extension("lock"))
            .expect("symlink");
        assert!(lock(&sock).is_err(), "a link was followed");
        assert!(!t.path().join("elsewhere").exists());
    }
}
