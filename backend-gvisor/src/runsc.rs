//! The `runsc` binary: discovery, version, platforms, and command lines.

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use sandbox_core::{Error, Result, Tier};

/// The oldest runsc build we drive (we need `exec --process`, `checkpoint`, `restore`,
/// `pause`/`resume` and `--network=none`), as a `YYYYMMDD` release date.
pub const MIN_RELEASE: u32 = 20220101;

/// The platform gVisor uses to intercept the sandbox's syscalls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Platform {
    /// Seccomp-trap based (newer runsc builds): the fastest without hardware virtualization.
    Systrap,
    /// ptrace based: works everywhere, slowest syscalls.
    Ptrace,
    /// KVM: only where `/dev/kvm` is hardware-backed (it hangs on nested PVM hosts).
    Kvm,
}

impl Platform {
    /// The name runsc uses.
    pub fn name(self) -> &'static str {
        match self {
            Platform::Systrap => "systrap",
            Platform::Ptrace => "ptrace",
            Platform::Kvm => "kvm",
        }
    }
}

/// What we learned about the installed runsc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunscInfo {
    /// The binary.
    pub path: PathBuf,
    /// `runsc --version`'s first line.
    pub version: String,
    /// The release date (`YYYYMMDD`), when the version carries one.
    pub release: Option<u32>,
    /// Platforms this build knows.
    pub platforms: Vec<Platform>,
}

impl RunscInfo {
    /// Finds and interrogates runsc (explicit path, else `PATH`).
    pub fn discover(explicit: Option<&Path>) -> Result<Self> {
        let path = match explicit {
            Some(p) => p.to_path_buf(),
            None => which("runsc").ok_or_else(|| {
                unavailable(
                    "runsc not found on PATH",
                    "apt-get install runsc (or set GvisorConfig::runsc to its path)",
                )
            })?,
        };
        let out = Command::new(&path)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| {
                unavailable(
                    format!("cannot run {}: {e}", path.display()),
                    "apt-get install runsc",
                )
            })?;
        let text = String::from_utf8_lossy(&out.stdout);
        let version = text.lines().next().unwrap_or("").trim().to_string();
        if !out.status.success() || !version.starts_with("runsc version") {
            return Err(unavailable(
                format!(
                    "{} is not a working runsc (`--version` said {version:?})",
                    path.display()
                ),
                "apt-get install --reinstall runsc",
            ));
        }
        let release = parse_release(&version);
        let help = Command::new(&path)
            .args(["help", "platforms"])
            .stdin(Stdio::null())
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout).into_owned()
                    + &String::from_utf8_lossy(&o.stderr)
            })
            .unwrap_or_default();
        let mut platforms = Vec::new();
        for p in [Platform::Systrap, Platform::Ptrace, Platform::Kvm] {
            if help.lines().any(|l| l.trim() == p.name()) {
                platforms.push(p);
            }
        }
        Ok(RunscInfo {
            path,
            version,
            release,
            platforms,
        })
    }

    /// Refuses builds older than [`MIN_RELEASE`].
    pub fn check_version(&self) -> Result<()> {
        match self.release {
            Some(r) if r < MIN_RELEASE => Err(unavailable(
                format!(
                    "{} is too old (need a release from {MIN_RELEASE} or later)",
                    self.version
                ),
                "install a newer runsc (apt-get install runsc from a current Debian)",
            )),
            _ => Ok(()),
        }
    }

    /// The default platform: systrap where this build has it, else ptrace. KVM is never chosen
    /// automatically (it hangs where `/dev/kvm` is nested); ask for it explicitly.
    pub fn default_platform(&self) -> Platform {
        if self.platforms.contains(&Platform::Systrap) {
            Platform::Systrap
        } else {
            Platform::Ptrace
        }
    }
}

fn unavailable(reason: impl Into<String>, fix: impl Into<String>) -> Error {
    Error::Unavailable {
        tier: Tier::Gvisor,
        reason: reason.into(),
        fix: fix.into(),
    }
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Extracts `YYYYMMDD` from `runsc version 0.0~20221219.0` or `runsc version release-20231009.0`.
pub fn parse_release(version: &str) -> Option<u32> {
    let bytes = version.as_bytes();
    (0..bytes.len().saturating_sub(7)).find_map(|i| {
        let w = &bytes[i..i + 8];
        let boundary_ok = (i == 0 || !bytes[i - 1].is_ascii_digit())
            && bytes.get(i + 8).is_none_or(|b| !b.is_ascii_digit());
        if boundary_ok && w.iter().all(u8::is_ascii_digit) && w.starts_with(b"20") {
            std::str::from_utf8(w).ok()?.parse().ok()
        } else {
            None
        }
    })
}

/// A runsc invocation bound to one state root and platform.
#[derive(Debug, Clone)]
pub struct Runsc {
    /// The binary.
    pub bin: PathBuf,
    /// `--root`: runsc's state directory for this sandbox.
    pub root: PathBuf,
    /// `--platform`.
    pub platform: Platform,
    /// Wrap the root mount in an in-memory overlay (`--overlay2=root:memory`): used for a
    /// caller's rootfs directory, which must never be written.
    pub overlay_root: bool,
    /// With `Some`, `--network=host` inside this network namespace (made for the sandbox and
    /// connected to the egress enforcer) instead of `--network=none`. Every runsc call of
    /// the sandbox runs in it: runsc reaches a running sandbox through an abstract Unix
    /// socket, and those are scoped by network namespace.
    pub netns: Option<Arc<std::fs::File>>,
}

impl Runsc {
    /// A command with the global flags every call needs. The network flag is always explicit
    /// (rootless `do` silently switches to host networking without one; the `sandbox` mode
    /// fails on current kernels): `none`, or `host` for a sandbox attached to the egress
    /// enforcer.
    pub fn command(&self) -> Command {
        let mut c = Command::new(&self.bin);
        let net = if self.netns.is_some() { "host" } else { "none" };
        c.arg(format!("--root={}", self.root.display()))
            .arg(format!("--network={net}"))
            .arg(format!("--platform={}", self.platform.name()))
            // The bundle's seccomp profile (no new namespaces: `bundle::seccomp`).
            .arg("--oci-seccomp");
        if self.overlay_root {
            c.arg("--overlay2=root:memory");
        }
        // Troubleshooting: `AGENT_SANDBOX_RUNSC_DEBUG=/some/dir` keeps runsc's debug logs there.
        if let Some(dir) = std::env::var_os("AGENT_SANDBOX_RUNSC_DEBUG") {
            let mut flag = std::ffi::OsString::from("--debug-log=");
            flag.push(&dir);
            flag.push("/");
            c.arg("--debug").arg(flag);
        }
        c.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(ns) = &self.netns {
            let fd = ns.as_raw_fd();
            // SAFETY: the closure runs in the forked child before exec and only calls the
            // async-signal-safe `setns` on a descriptor the child inherited (`ns` outlives
            // the command: it is owned by the sandbox).
            unsafe {
                c.pre_exec(move || {
                    if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        c
    }

    /// A new, empty network namespace for a sandbox attached to the egress enforcer (held
    /// open by the returned file: it lives as long as the sandbox keeps it).
    pub fn new_netns() -> Result<Arc<std::fs::File>> {
        let made = std::thread::spawn(|| -> std::io::Result<std::fs::File> {
            // SAFETY: unshare(CLONE_NEWNET) moves only this short-lived thread.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            std::fs::File::open("/proc/thread-self/ns/net")
        })
        .join()
        .map_err(|_| Error::backend(Tier::Gvisor, "network namespace thread panicked"))?;
        made.map(Arc::new)
            .map_err(|e| Error::io("create the sandbox's network namespace", e))
    }

    /// The same, for tokio.
    pub fn async_command(&self) -> tokio::process::Command {
        tokio::process::Command::from(self.command())
    }
}

/// Runs a runsc command to completion; a failure carries runsc's stderr.
pub fn run_checked(mut cmd: Command, what: &str) -> Result<()> {
    let out = cmd
        .output()
        .map_err(|e| Error::io(format!("runsc {what}"), e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::backend(
            Tier::Gvisor,
            format!(
                "runsc {what} failed ({}): {}",
                out.status,
                last_lines(&out.stderr)
            ),
        ))
    }
}

/// Async [`run_checked`].
pub async fn run_checked_async(mut cmd: tokio::process::Command, what: &str) -> Result<()> {
    let out = cmd
        .output()
        .await
        .map_err(|e| Error::io(format!("runsc {what}"), e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::backend(
            Tier::Gvisor,
            format!(
                "runsc {what} failed ({}): {}",
                out.status,
                last_lines(&out.stderr)
            ),
        ))
    }
}

/// How long a `run`/`restore --detach` may take before it is killed and reported (a start
/// takes ~0.2 s here, a restore of a few hundred MiB a few seconds).
pub const DETACHED_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Runs a runsc command that leaves the sandbox running (`run --detach`, `restore --detach`).
/// Its stdio goes to a log file of the sandbox's own: the sandbox inherits it and would hold a
/// pipe of ours open forever. The sandbox and gofer processes it leaves become ours while it
/// runs ([`crate::reaper::adopt`]). One that takes longer than [`DETACHED_TIMEOUT`] is killed
/// and reported.
pub async fn run_detached(mut cmd: tokio::process::Command, log: &Path, what: &str) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| Error::io_path("open", log, e))?;
    let file2 = file
        .try_clone()
        .map_err(|e| Error::io_path("open", log, e))?;
    cmd.stdout(file).stderr(file2).kill_on_drop(true);
    let adoption = crate::reaper::adopt();
    let ran = tokio::time::timeout(DETACHED_TIMEOUT, cmd.status()).await;
    drop(adoption);
    let status = match ran {
        Ok(s) => s.map_err(|e| Error::io(format!("runsc {what}"), e))?,
        Err(_) => {
            let text = std::fs::read(log).unwrap_or_default();
            return Err(Error::backend(
                Tier::Gvisor,
                format!(
                    "runsc {what} did not finish in {} s (killed): {}",
                    DETACHED_TIMEOUT.as_secs(),
                    last_lines(&text)
                ),
            ));
        }
    };
    if status.success() {
        Ok(())
    } else {
        let text = std::fs::read(log).unwrap_or_default();
        Err(Error::backend(
            Tier::Gvisor,
            format!("runsc {what} failed ({status}): {}", last_lines(&text)),
        ))
    }
}

/// The last few lines of runsc's stderr, for error messages.
pub fn last_lines(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(3)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_dates() {
        assert_eq!(
            parse_release("runsc version 0.0~20221219.0"),
            Some(20221219)
        );
        assert_eq!(
            parse_release("runsc version release-20231009.0"),
            Some(20231009)
        );
        assert_eq!(parse_release("runsc version 123456789"), None);
        assert_eq!(parse_release("runsc version"), None);
    }
}
