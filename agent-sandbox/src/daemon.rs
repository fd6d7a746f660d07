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
    let uid = unsafe { libc::geteuid() };
    let dir = if uid == 0 {
        PathBuf::from("/run/agent-sandbox")
    } else {
        match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
            Some(d) => PathBuf::from(d).join("agent-sandbox"),
            None => PathBuf::from(format!("/tmp/agent-sandbox-{uid}")),
        }
    };
    dir.join("daemon.sock")
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

/// The daemon, when one of this user and build listens on [`socket_path`]; `None`
/// otherwise (then `run` works in-process). `named_tier`: the run names its tier, so the
/// daemon's tiers are not asked for (its build is checked by the run itself, which answers
/// `Unavailable` for another build: `run` then works in-process).
pub(crate) async fn connect(named_tier: bool) -> Option<agent_sandbox::remote::RemoteServer> {
    use agent_sandbox::remote::{RemoteConfig, RemoteServer};
    if std::env::var_os(NO_DAEMON_ENV).is_some_and(|v| !v.is_empty() && v != "0") {
        return None;
    }
    let path = socket_path();
    // Cheap checks first: with no daemon, `run` pays one failed `lstat`.
    let is_socket = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_socket());
    if !is_socket || !path.parent().is_some_and(private_dir) {
        return None;
    }
    let config = RemoteConfig::new(&format!("unix:{}", path.display()))
        .ok()?
        // A one-shot run need not wait for its sandbox's teardown.
        .destroy_without_waiting(true)
        .ask_tiers(!named_tier);
    if named_tier {
        // Nothing listening (a daemon that died and left its socket): in-process. Checked
        // here, before anything is sent, so that a failure later is never retried here (the
        // command may have run).
        if let Err(e) = std::os::unix::net::UnixStream::connect(&path) {
            tracing::debug!(error = %e, "no local daemon; running in-process");
            return None;
        }
        return RemoteServer::connect(config).await.ok();
    }
    let server = match RemoteServer::connect(config).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, "no local daemon; running in-process");
            return None;
        }
    };
    if server.build() != Some(build_id()) {
        tracing::debug!(
            daemon = ?server.build(),
            "the local daemon is another build; running in-process"
        );
        return None;
    }
    Some(server)
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
}
