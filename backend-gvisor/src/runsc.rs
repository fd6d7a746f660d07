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

/// The first runsc release this backend is not validated with. Under Debian 13's
/// 0.0~20240729 its adversarial suite passes (a dead sandbox is known by its own process, not
/// runsc's `state`; process limits cost systrap's host tasks; a dead owner's sandbox goes even
/// where runsc's `delete` waits for a zombie), but a copy restored from a snapshot does not
/// see host writes to files its processes looked up before the snapshot, nor keep its
/// background processes.
/// [`RunscInfo::check_version`] refuses such a build unless [`UNVALIDATED_ENV`] is `1`.
pub const UNVALIDATED_RELEASE: u32 = 20230101;

/// Set to `1` by an operator who accepts a runsc from [`UNVALIDATED_RELEASE`] on as it is
/// (for one, to measure its systrap platform: docs/benchmarks.md).
pub const UNVALIDATED_ENV: &str = "AGENT_SANDBOX_RUNSC_UNVALIDATED";

/// The platform gVisor uses to intercept the sandbox's syscalls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
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
#[non_exhaustive]
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
        Self::interrogate(find(explicit)?)
    }

    /// [`RunscInfo::discover`], remembered in the file `cache` across processes: asking runsc
    /// takes two runs of it (~50 ms), a look-up one `stat`. An entry holds for the binary
    /// it was made from: same path, device, inode, size, modification and change times (the
    /// change time moves with any replacement or `chmod`, and cannot be set back by anyone).
    /// The file is used only when this user owns it and nobody else can write it; it is
    /// written (atomically, mode 0600) only into a directory this user owns that others
    /// cannot write. Any failure of the cache falls back to asking runsc.
    pub fn discover_cached(explicit: Option<&Path>, cache: &Path) -> Result<Self> {
        let path = find(explicit)?;
        let Some(key) = cache_key(&path) else {
            return Self::interrogate(path);
        };
        if let Some(info) = read_cache(cache, &key, &path) {
            return Ok(info);
        }
        let info = Self::interrogate(path)?;
        write_cache(cache, &key, &info);
        Ok(info)
    }

    /// Runs `path --version` and `path help platforms`.
    fn interrogate(path: PathBuf) -> Result<Self> {
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

    /// Refuses builds older than [`MIN_RELEASE`], and builds from [`UNVALIDATED_RELEASE`] on
    /// unless the operator set [`UNVALIDATED_ENV`] (see [`RunscInfo::check_version_with`]).
    pub fn check_version(&self) -> Result<()> {
        self.check_version_with(std::env::var_os(UNVALIDATED_ENV).is_some_and(|v| v == "1"))
    }

    /// [`check_version`](Self::check_version) with the operator's answer given:
    /// `allow_unvalidated` lets a release from [`UNVALIDATED_RELEASE`] on through.
    pub fn check_version_with(&self, allow_unvalidated: bool) -> Result<()> {
        match self.release {
            Some(r) if r < MIN_RELEASE => Err(unavailable(
                format!(
                    "{} is too old (need a release from {MIN_RELEASE} or later)",
                    self.version
                ),
                "install a newer runsc (apt-get install runsc from a current Debian)",
            )),
            Some(r) if r >= UNVALIDATED_RELEASE && !allow_unvalidated => Err(unavailable(
                format!(
                    "{} is newer than the releases this backend is validated with (before \
                     {UNVALIDATED_RELEASE}): under it a copy restored from a snapshot misses \
                     host writes and background processes",
                    self.version
                ),
                format!(
                    "install Debian 12's runsc (0.0~20221219), or set {UNVALIDATED_ENV}=1 to \
                     run this one anyway, without those guarantees (docs/gvisor.md)"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Whether `checkpoint --leave-running` works in this build: from 2023 on (validated with
    /// 0.0~20240729); Debian 12's 20221219 hangs in it, so a snapshot there stops the
    /// sandbox and brings it back from its image.
    pub fn checkpoint_leaves_running(&self) -> bool {
        self.release.is_some_and(|r| r >= UNVALIDATED_RELEASE)
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

/// The runsc binary: `explicit`, else the first `runsc` on `PATH`.
fn find(explicit: Option<&Path>) -> Result<PathBuf> {
    match explicit {
        Some(p) => Ok(p.to_path_buf()),
        None => which("runsc").ok_or_else(|| {
            unavailable(
                "runsc not found on PATH",
                "apt-get install runsc (or give its path with GvisorBackendBuilder::runsc)",
            )
        }),
    }
}

/// The first line of a discovery cache entry: the binary's path and identity.
fn cache_key(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(path).ok()?;
    let path = path.to_str()?;
    if path.contains('\n') {
        return None;
    }
    Some(format!(
        "{path}\t{}:{}:{}:{}.{}:{}.{}",
        md.dev(),
        md.ino(),
        md.size(),
        md.mtime(),
        md.mtime_nsec(),
        md.ctime(),
        md.ctime_nsec()
    ))
}

/// Whether `md` is ours (this effective uid) and writable by nobody else.
fn private(md: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    md.uid() == nix::unistd::geteuid().as_raw() && md.mode() & 0o022 == 0
}

/// The cached facts for the binary `key` names, if `cache` holds them and may be trusted.
/// Format: the key, the version line, the platforms (comma-separated names).
fn read_cache(cache: &Path, key: &str, path: &Path) -> Option<RunscInfo> {
    use std::io::Read;
    let f = std::fs::File::open(cache).ok()?;
    if !private(&f.metadata().ok()?) {
        return None;
    }
    let mut text = String::new();
    f.take(4096).read_to_string(&mut text).ok()?;
    let mut lines = text.lines();
    if lines.next()? != key {
        return None;
    }
    let version = lines.next()?.to_string();
    if !version.starts_with("runsc version") {
        return None;
    }
    let mut platforms = Vec::new();
    for name in lines.next()?.split(',').filter(|n| !n.is_empty()) {
        platforms.push(
            [Platform::Systrap, Platform::Ptrace, Platform::Kvm]
                .into_iter()
                .find(|p| p.name() == name)?,
        );
    }
    Some(RunscInfo {
        path: path.to_path_buf(),
        release: parse_release(&version),
        version,
        platforms,
    })
}

/// Writes the cache entry (best effort: a failure only costs the next process ~50 ms).
fn write_cache(cache: &Path, key: &str, info: &RunscInfo) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let Some(dir) = cache.parent() else {
        return;
    };
    if !std::fs::metadata(dir).is_ok_and(|m| m.is_dir() && private(&m)) {
        return;
    }
    let platforms: Vec<&str> = info.platforms.iter().map(|p| p.name()).collect();
    let text = format!("{key}\n{}\n{}\n", info.version, platforms.join(","));
    let tmp = cache.with_extension(format!("tmp-{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(text.as_bytes()));
    if written.and_then(|()| std::fs::rename(&tmp, cache)).is_err() {
        let _ = std::fs::remove_file(&tmp);
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
#[non_exhaustive]
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
    /// Snapshots checkpoint with `--leave-running` (see
    /// [`RunscInfo::checkpoint_leaves_running`]) instead of stopping the sandbox and
    /// restoring it in place.
    pub leave_running: bool,
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
        // Every runsc we start (and with it the sandbox's processes on the host: its Sentry,
        // its gofer, `runsc exec` forwarding a terminal's `SIGINT`) begins with default
        // dispositions and no blocked signal, whatever this process inherited (a background
        // job's ignored `SIGINT`/`SIGQUIT`, `nohup`'s `SIGHUP`). The processes inside are the
        // Sentry's, which starts them clean.
        // SAFETY: the closure runs in the forked child before exec and makes only the
        // async-signal-safe `rt_sigaction` and `rt_sigprocmask` system calls.
        unsafe {
            c.pre_exec(|| {
                sandbox_core::process::reset_signals();
                Ok(())
            });
        }
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

/// Makes `cmd` (the `runsc run` or `restore` of a host-tools sandbox) start in a mount
/// namespace of its own, where each of `tools` (host paths: [`bundle::host_tools`]) is bound
/// read-only, `nosuid` and `nodev` at the same path under `rootfs`. runsc's gofer and
/// Sentry inherit that namespace, so the gofer serves the tools as part of the root; the
/// host's mount table never sees the binds, and they end with the sandbox's last process.
/// Host mounts propagate into the namespace (it is a slave of the host's), never out.
///
/// [`bundle::host_tools`]: crate::bundle::host_tools
pub fn in_tools_view(
    cmd: &mut tokio::process::Command,
    rootfs: &Path,
    tools: &[PathBuf],
) -> Result<()> {
    let cstr = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
            .map_err(|e| Error::backend_caused(Tier::Gvisor, "a host-tools path", e))
    };
    let mut binds = Vec::with_capacity(tools.len());
    for src in tools {
        let inside = src.strip_prefix("/").unwrap_or(src);
        // Only onto the points the root was written with: an entry the host gained (or
        // turned from a file into a folder) since, say before a resume after a checkpoint,
        // is left out rather than failing the start.
        let point = rootfs.join(inside);
        if !point.exists() || point.is_dir() != src.is_dir() {
            continue;
        }
        // A source's own `noexec` is kept (the remount would clear it).
        let noexec = nix::sys::statvfs::statvfs(src)
            .is_ok_and(|v| v.flags().contains(nix::sys::statvfs::FsFlags::ST_NOEXEC));
        let flags = libc::MS_BIND
            | libc::MS_REMOUNT
            | libc::MS_RDONLY
            | libc::MS_NOSUID
            | libc::MS_NODEV
            | if noexec { libc::MS_NOEXEC } else { 0 };
        binds.push((cstr(src)?, cstr(&point)?, flags));
    }
    // SAFETY: the closure runs in the forked child before exec and makes only the
    // async-signal-safe `unshare` and `mount` system calls, on C strings made before the
    // fork (nothing is allocated in the child).
    unsafe {
        cmd.pre_exec(move || {
            let fail = || Err(std::io::Error::last_os_error());
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return fail();
            }
            let none = std::ptr::null::<libc::c_char>();
            if libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_SLAVE,
                std::ptr::null(),
            ) != 0
            {
                return fail();
            }
            for (src, dst, flags) in &binds {
                let (src, dst) = (src.as_ptr(), dst.as_ptr());
                if libc::mount(
                    src,
                    dst,
                    none,
                    libc::MS_BIND | libc::MS_REC,
                    std::ptr::null(),
                ) != 0
                    || libc::mount(none, dst, none, *flags, std::ptr::null()) != 0
                {
                    return fail();
                }
            }
            Ok(())
        });
    }
    Ok(())
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

    #[test]
    fn releases_outside_the_validated_range_are_refused_with_the_way_out() {
        let info = |version: &str| RunscInfo {
            path: PathBuf::from("/usr/bin/runsc"),
            version: version.to_string(),
            release: parse_release(version),
            platforms: vec![Platform::Ptrace],
        };
        // Debian 12's: the one validated.
        assert!(info("runsc version 0.0~20221219.0")
            .check_version_with(false)
            .is_ok());
        // Too old, whatever the operator says.
        let old = info("runsc version 0.0~20211129.0");
        assert!(old.check_version_with(true).is_err());
        // Debian 13's: refused, naming why and the opt-in; taken when the operator opts in.
        let new = info("runsc version 0.0~20240729.0");
        match new.check_version_with(false) {
            Err(Error::Unavailable { reason, fix, .. }) => {
                assert!(reason.contains("restored from a snapshot"), "{reason}");
                assert!(fix.contains(UNVALIDATED_ENV), "{fix}");
            }
            other => panic!("{other:?}"),
        }
        assert!(new.check_version_with(true).is_ok());
        // Only from 2023 on does a checkpoint leave the sandbox running.
        assert!(new.checkpoint_leaves_running());
        assert!(!info("runsc version 0.0~20221219.0").checkpoint_leaves_running());
        assert!(!info("runsc version google-123").checkpoint_leaves_running());
        // No date in the version: not refused (nothing to judge it by).
        assert!(info("runsc version google-123")
            .check_version_with(false)
            .is_ok());
    }

    /// A fake runsc: a script answering `--version` and `help platforms`, counting its runs.
    fn fake_runsc(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let bin = dir.join("runsc");
        let count = dir.join("runs");
        std::fs::write(
            &bin,
            format!(
                "#!/bin/sh\necho x >> '{}'\nif [ \"$1\" = --version ]; then echo 'runsc version 0.0~20221219.0'; \
                 else printf 'ptrace\\nkvm\\n'; fi\n",
                count.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        bin
    }

    fn runs(dir: &Path) -> usize {
        std::fs::read_to_string(dir.join("runs"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    #[test]
    fn discovery_is_cached_for_the_same_binary_only() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let bin = fake_runsc(d.path());
        let cache = d.path().join("runsc-info");
        let first = RunscInfo::discover_cached(Some(&bin), &cache).unwrap();
        assert_eq!(runs(d.path()), 2, "asked runsc twice");
        assert_eq!(first.platforms, vec![Platform::Ptrace, Platform::Kvm]);
        assert_eq!(first.release, Some(20221219));
        let second = RunscInfo::discover_cached(Some(&bin), &cache).unwrap();
        assert_eq!(second, first);
        assert_eq!(runs(d.path()), 2, "the cache answered");
        // Any change to the binary (here its mode: the change time moves) asks again.
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o700)).unwrap();
        let third = RunscInfo::discover_cached(Some(&bin), &cache).unwrap();
        assert_eq!(third, first);
        assert_eq!(runs(d.path()), 4, "a changed binary is asked again");
        // A cache others can write is not trusted.
        std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o666)).unwrap();
        RunscInfo::discover_cached(Some(&bin), &cache).unwrap();
        assert_eq!(runs(d.path()), 6, "a group/world-writable cache is ignored");
    }
}
