//! The OCI bundle: a read-only root of our own holding only mount points, the host's `/usr`
//! and the few `/etc` files tools need (the "host tools" view), a tmpfs `/tmp`, and the
//! workspace. Nothing of `/root`, `/home`, `/var`, host sockets or the host's `/proc`.

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::runsc::Platform;
use oci_spec::runtime::{
    Capabilities, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxMemoryBuilder,
    LinuxNamespaceBuilder, LinuxNamespaceType, LinuxPidsBuilder, LinuxResourcesBuilder,
    LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder, LinuxSeccompBuilder,
    LinuxSeccompOperator, LinuxSyscall, LinuxSyscallBuilder, Mount, MountBuilder,
    PosixRlimitBuilder, PosixRlimitType, Process, ProcessBuilder, RootBuilder, Spec, SpecBuilder,
    UserBuilder,
};
use sandbox_core::{Error, Result, SandboxSpec, Tier, TmpfsCaps, Workspace};

/// `/etc` entries bind-mounted read-only from the host when they exist.
const HOST_ETC: &[&str] = &[
    "ld.so.cache",
    "nsswitch.conf",
    // Not the whole of `/etc/ssl`: its `private/` holds host keys (root and `ssl-cert`), which
    // commands running as uid 0 over a root-owned host workspace could read.
    "ssl/certs",
    "ssl/openssl.cnf",
    "ca-certificates",
    "ca-certificates.conf",
    "alternatives",
    "localtime",
    "mime.types",
];

/// The `statx` compatibility shim (`shim/statx_compat.rs`): a shared object every dynamically
/// linked program of a host-tools sandbox preloads (`/etc/ld.so.preload`), so that
/// coreutils' `ls` and `stat` work under this runsc (which refuses `AT_NO_AUTOMOUNT`).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
const STATX_SHIM: Option<&[u8]> = Some(include_bytes!(env!("AGENT_SANDBOX_STATX_SHIM")));
/// No shim off x86-64 Linux.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
const STATX_SHIM: Option<&[u8]> = None;

/// Where the `statx` shim is inside a host-tools sandbox.
pub const STATX_SHIM_PATH: &str = "/etc/agent-sandbox/statx-compat.so";

/// The `statx` shim of this build, if any.
pub(crate) fn statx_shim() -> Option<&'static [u8]> {
    STATX_SHIM
}

/// The published-port relay (`relay/main.rs`): run inside a sandbox once per connection to a
/// published port, it connects to the port on the sandbox's loopback and relays its stdio.
const RELAY: &[u8] = include_bytes!(env!("AGENT_SANDBOX_RELAY"));

/// Where the relay is inside a sandbox.
pub const RELAY_PATH: &str = "/etc/agent-sandbox/relay";

/// Where glibc's x86-64 dynamic loader sits in a root filesystem (any of them).
const GLIBC_LOADERS: &[&str] = &[
    "lib64/ld-linux-x86-64.so.2",
    "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    "usr/lib64/ld-linux-x86-64.so.2",
    "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
];

/// Whether a caller's root filesystem has programs the `statx` shim is for: glibc's loader
/// is there (looked up without following links, which may point anywhere on the host).
pub(crate) fn needs_statx_shim(rootfs: &Path) -> bool {
    GLIBC_LOADERS.iter().any(|l| {
        // The loader itself may be a link (it usually is), its directory not: a linked
        // directory (`lib64 -> usr/lib64` in a merged-/usr tree) is covered by its target's
        // entry in the list.
        let p = rootfs.join(l);
        let parent_real = p
            .parent()
            .is_some_and(|d| fs::symlink_metadata(d).is_ok_and(|m| m.is_dir()));
        parent_real && fs::symlink_metadata(&p).is_ok()
    })
}

/// Puts the `statx` shim at [`STATX_SHIM_PATH`] under `root` and names it in
/// `root/etc/ld.so.preload` (kept, if there is one, with ours appended). Refuses (an error)
/// when `etc`, `etc/agent-sandbox` or `etc/ld.so.preload` is a symbolic link: in a
/// caller's tree it could lead anywhere on the host.
pub(crate) fn add_statx_shim(root: &Path, shim: &[u8]) -> std::io::Result<()> {
    use std::io::ErrorKind;
    let no_link = refuse_link;
    let etc = root.join("etc");
    no_link(&etc)?;
    fs::create_dir_all(&etc)?;
    let at = root.join(STATX_SHIM_PATH.trim_start_matches('/'));
    if let Some(dir) = at.parent() {
        no_link(dir)?;
        fs::create_dir_all(dir)?;
    }
    no_link(&at)?;
    fs::write(&at, shim)?;
    let preload = etc.join("ld.so.preload");
    no_link(&preload)?;
    let mut text = match fs::read_to_string(&preload) {
        Ok(t) => t,
        Err(e) if e.kind() == ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    if !text.split_whitespace().any(|w| w == STATX_SHIM_PATH) {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(STATX_SHIM_PATH);
        text.push('\n');
        fs::write(&preload, text)?;
    }
    Ok(())
}

/// Puts the relay at [`RELAY_PATH`] under `root` (mode 0755). Refuses (an error) when
/// `etc`, `etc/agent-sandbox` or the file itself is a symbolic link: in a caller's tree it
/// could lead anywhere on the host.
pub(crate) fn add_relay(root: &Path) -> std::io::Result<()> {
    let at = root.join(RELAY_PATH.trim_start_matches('/'));
    for p in [root.join("etc"), root.join("etc/agent-sandbox")] {
        refuse_link(&p)?;
        fs::create_dir_all(&p)?;
    }
    refuse_link(&at)?;
    fs::write(&at, RELAY)?;
    fs::set_permissions(&at, fs::Permissions::from_mode(0o755))
}

/// An error when `p` is a symbolic link.
fn refuse_link(p: &Path) -> std::io::Result<()> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.file_type().is_symlink() => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is a symbolic link", p.display()),
        )),
        _ => Ok(()),
    }
}

/// Top-level links of a merged-`/usr` system.
const USR_LINKS: &[&str] = &["bin", "lib", "lib32", "lib64", "libx32", "sbin"];

/// The init process of every sandbox: pid 1 stays up so files and background processes persist
/// across execs, and reaps the orphans re-parented to it (dash's `wait` collects any child).
pub const INIT_SCRIPT: &str = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait; done";

/// Host tasks an idle sandbox uses (sentry threads, gofer): measured ~37 on ptrace, ~25 on
/// systrap.
pub const HOST_TASKS_BASE: i64 = 64;
/// Host tasks per guest process on the ptrace platform (a stub process and its threads for
/// each guest thread): measured ~9.
pub const HOST_TASKS_PER_PROCESS: i64 = 10;
/// Host tasks per guest process on the systrap platform (one stub process per address
/// space, its threads shared): measured 2-3.4 (runsc 20240729).
pub const HOST_TASKS_PER_PROCESS_SYSTRAP: i64 = 3;

/// What an idle Sentry takes of the sandbox's memory limit (measured: 14 MiB).
const SENTRY_BYTES: u64 = 16 << 20;

/// Kernel and Sentry memory per file on a host tmpfs the sandbox reaches through its gofer
/// (the workspace, `/tmp`, `/dev/shm`; measured: 3,000 empty files took 14 MiB), against
/// [`Limits::TMPFS_INODE_BYTES`] on a plain tmpfs.
///
/// [`Limits::TMPFS_INODE_BYTES`]: sandbox_core::Limits::TMPFS_INODE_BYTES
const HOST_TMPFS_FILE_BYTES: u64 = 6 << 10;

/// Caps of the sandbox's memory-backed mounts, all host tmpfs mounts the Sentry reaches
/// through its gofer: the workspace of an `Empty` spec, and one scratch tmpfs whose `tmp/`
/// and `shm/` are the sandbox's `/tmp` and `/dev/shm` (`scratch` below: the caps of both
/// together). gVisor's own tmpfs ignores `nr_inodes`: there, a flood of empty files grew the
/// Sentry (~2.5 KiB each) until it was OOM-killed and the sandbox lost; a host tmpfs says
/// `ENOSPC` instead. Unchecked, 100 MB written to either killed a 64 MiB sandbox the same
/// way. [`Limits::tmpfs_caps`](sandbox_core::Limits::tmpfs_caps) of the memory the Sentry
/// leaves, with files counted at their measured cost.
pub fn tmpfs_caps(spec: &SandboxSpec) -> TmpfsCaps {
    let mut limits = spec.limits.clone();
    limits.memory_bytes = limits
        .memory_bytes
        .saturating_sub(SENTRY_BYTES)
        .max(4 << 20);
    let mut caps = limits.tmpfs_caps(2, u64::from(matches!(spec.workspace, Workspace::Empty)));
    let per = sandbox_core::Limits::TMPFS_INODE_BYTES;
    caps.disk.inodes = (caps.disk.inodes * per / HOST_TMPFS_FILE_BYTES).max(256);
    // `/tmp` and `/dev/shm` share one mount: twice one scratch mount's share.
    caps.scratch.bytes *= 2;
    caps.scratch.inodes = (2 * caps.scratch.inodes * per / HOST_TMPFS_FILE_BYTES).max(256);
    caps
}

/// The sandbox's scratch mounts: where each is seen inside, and the folder of the scratch
/// tmpfs behind it (see [`tmpfs_caps`]).
pub(crate) const SCRATCH_MOUNTS: [(&str, &str); 2] = [("/tmp", "tmp"), ("/dev/shm", "shm")];

/// The host pids-cgroup limit for a spec on `platform`. gVisor's guest processes are not host
/// processes, so the workload's `pids` limit is applied to the host tasks they cost, which
/// differ by platform. (`RLIMIT_NPROC` is not used: runsc also applies it to the sentry's own
/// stub processes, which then panics.)
pub fn host_pids_limit(spec: &SandboxSpec, platform: Platform) -> i64 {
    let per = match platform {
        Platform::Systrap => HOST_TASKS_PER_PROCESS_SYSTRAP,
        _ => HOST_TASKS_PER_PROCESS,
    };
    HOST_TASKS_BASE + per * i64::from(spec.limits.pids)
}

/// Who the workload runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct Identity {
    /// uid inside the sandbox.
    pub uid: u32,
    /// gid inside the sandbox.
    pub gid: u32,
}

impl Identity {
    /// Run as `uid`:`gid` inside the sandbox.
    pub const fn new(uid: u32, gid: u32) -> Self {
        Identity { uid, gid }
    }
}

fn ctx(op: &str, p: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let (op, p) = (op.to_string(), p.to_path_buf());
    move |e| Error::io_path(&op, p, e)
}

fn oci(e: oci_spec::OciSpecError) -> Error {
    Error::backend_caused(Tier::Gvisor, "building the OCI spec", e)
}

/// Puts the certificate bundle `text` of a sandbox with proxy-held secrets into `root` (the
/// overlay view of an image or a caller's rootfs, never a layer itself) at
/// [`CA_BUNDLE_PATH`](sandbox_core::egress::CA_BUNDLE_PATH), and over the root's system
/// bundle ([`SYSTEM_CA_BUNDLE`](sandbox_core::egress::SYSTEM_CA_BUNDLE)), made (with its
/// directories) where the root has none. Links are never followed (in a caller's tree they could lead
/// anywhere on the host): a linked `etc` or a linked bundle file is an error, a link on the
/// way to the system bundle leaves that path alone.
pub(crate) fn write_ca_bundle(root: &Path, text: &str) -> std::io::Result<()> {
    use std::io::{Error as IoError, ErrorKind, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let write = |p: &Path| -> std::io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(p)
            .map_err(|e| IoError::new(e.kind(), format!("{}: {e}", p.display())))?;
        f.write_all(text.as_bytes())?;
        fs::set_permissions(p, fs::Permissions::from_mode(0o644))
    };
    let etc = root.join("etc");
    match fs::symlink_metadata(&etc) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(IoError::new(
                ErrorKind::InvalidInput,
                format!("{} is not a directory", etc.display()),
            ))
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            fs::create_dir(&etc)?;
            fs::set_permissions(&etc, fs::Permissions::from_mode(0o755))?;
        }
        Err(e) => return Err(e),
    }
    let ours = sandbox_core::egress::CA_BUNDLE_PATH.trim_start_matches('/');
    write(&root.join(ours))?;
    let mut p = root.to_path_buf();
    let mut parts = sandbox_core::egress::SYSTEM_CA_BUNDLE.split('/').peekable();
    while let Some(part) = parts.next() {
        p.push(part);
        let last = parts.peek().is_none();
        match fs::symlink_metadata(&p) {
            Ok(m) if last && m.is_file() => return write(&p),
            Ok(m) if !last && m.is_dir() => continue,
            // A root without a system bundle (an image without ca-certificates) gets ours
            // there too, as the container tier does: programs that only read that path trust
            // the proxy's CA.
            Err(e) if e.kind() == ErrorKind::NotFound && last => return write(&p),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                fs::create_dir(&p)?;
                fs::set_permissions(&p, fs::Permissions::from_mode(0o755))?;
            }
            _ => break,
        }
    }
    Ok(())
}

/// Writes `rootfs/` (mount points, links, generated `/etc` files) under `bundle`.
/// `user`: the sandbox user's name and home ([`SandboxSpec::user_name_and_home`]).
pub fn write_rootfs(bundle: &Path, who: Identity, user: (&str, &str)) -> Result<PathBuf> {
    let rootfs = bundle.join("rootfs");
    for d in ["usr", "etc", "tmp", "workspace", "proc", "dev", "sys"] {
        fs::create_dir_all(rootfs.join(d)).map_err(ctx("create", &rootfs))?;
    }
    for l in USR_LINKS {
        if Path::new("/usr").join(l).exists() {
            symlink(format!("usr/{l}"), rootfs.join(l)).map_err(ctx("link", &rootfs))?;
        }
    }
    let etc = rootfs.join("etc");
    let (uid, gid) = (who.uid, who.gid);
    let (name, home) = user;
    let passwd = format!(
        "root:x:0:0:root:/root:/bin/sh\n{name}:x:{uid}:{gid}:{name}:{home}:/bin/sh\n\
         nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    );
    let group = format!("root:x:0:\n{name}:x:{gid}:\nnogroup:x:65534:\n");
    let files: [(&str, &str); 6] = [
        ("passwd", &passwd),
        ("group", &group),
        (
            "hosts",
            "127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost ip6-loopback\n",
        ),
        ("hostname", "sandbox\n"),
        (
            "resolv.conf",
            "# no network unless the egress policy allows it\nnameserver 127.0.0.1\n",
        ),
        // A commit identity, so git works in the workspace (as in the container tier).
        (
            "gitconfig",
            "[user]\n\tname = sandbox\n\temail = sandbox@localhost\n[safe]\n\tdirectory = *\n\
             [init]\n\tdefaultBranch = main\n",
        ),
    ];
    for (name, text) in files {
        fs::write(etc.join(name), text).map_err(ctx("write", &etc))?;
    }
    add_relay(&rootfs).map_err(ctx("add the port relay to", &rootfs))?;
    if let Some(shim) = STATX_SHIM {
        add_statx_shim(&rootfs, shim).map_err(ctx("add the statx shim to", &rootfs))?;
    }
    for name in HOST_ETC {
        let host = Path::new("/etc").join(name);
        if host.is_dir() {
            fs::create_dir_all(etc.join(name)).map_err(ctx("create", &etc))?;
        } else if host.is_file() {
            let at = etc.join(name);
            if let Some(parent) = at.parent() {
                fs::create_dir_all(parent).map_err(ctx("create", parent))?;
            }
            fs::write(at, b"").map_err(ctx("create", &etc))?;
        }
    }
    Ok(rootfs)
}

fn bind(dst: &str, src: &Path, read_only: bool) -> Result<Mount> {
    MountBuilder::default()
        .destination(dst)
        .typ("bind")
        .source(src)
        .options(vec![
            "rbind".to_string(),
            if read_only { "ro" } else { "rw" }.to_string(),
        ])
        .build()
        .map_err(oci)
}

/// The process of an exec (also used for the init).
pub fn process(
    args: Vec<String>,
    env: Vec<String>,
    cwd: &str,
    who: Identity,
    spec: &SandboxSpec,
) -> Result<Process> {
    let none = || Capabilities::new();
    let caps = LinuxCapabilitiesBuilder::default()
        .bounding(none())
        .effective(none())
        .permitted(none())
        .inheritable(none())
        .ambient(none())
        .build()
        .map_err(oci)?;
    let nofile = u64::from(spec.limits.open_files);
    let rlimits = vec![
        PosixRlimitBuilder::default()
            .typ(PosixRlimitType::RlimitNofile)
            .hard(nofile)
            .soft(nofile)
            .build()
            .map_err(oci)?,
        PosixRlimitBuilder::default()
            .typ(PosixRlimitType::RlimitCore)
            .hard(0u64)
            .soft(0u64)
            .build()
            .map_err(oci)?,
        PosixRlimitBuilder::default()
            .typ(PosixRlimitType::RlimitCpu)
            .hard(spec.limits.cpu_time_ms.div_ceil(1000) + 1)
            .soft(spec.limits.cpu_time_ms.div_ceil(1000))
            .build()
            .map_err(oci)?,
    ];
    ProcessBuilder::default()
        .terminal(false)
        .user(
            UserBuilder::default()
                .uid(who.uid)
                .gid(who.gid)
                .build()
                .map_err(oci)?,
        )
        .args(args)
        .env(env)
        .cwd(cwd)
        .capabilities(caps)
        .no_new_privileges(true)
        .rlimits(rlimits)
        .build()
        .map_err(oci)
}

/// Every `CLONE_NEW*` flag: the namespaces sandboxed code may not create.
const NS_FLAGS: [u64; 8] = [
    0x1000_0000, // CLONE_NEWUSER
    0x0002_0000, // CLONE_NEWNS
    0x2000_0000, // CLONE_NEWPID
    0x4000_0000, // CLONE_NEWNET
    0x0400_0000, // CLONE_NEWUTS
    0x0800_0000, // CLONE_NEWIPC
    0x0200_0000, // CLONE_NEWCGROUP
    0x0000_0080, // CLONE_NEWTIME
];

/// The sandbox's seccomp profile (applied by runsc's `--oci-seccomp`), the container tier's
/// rule for untrusted code: no new namespaces. `clone` and `unshare` with any `CLONE_NEW*`
/// flag, and `setns`, fail with `EPERM`; everything else is gVisor's to decide. (A user
/// namespace would give the code a root of its own to attack gVisor's kernel with.)
///
/// This runsc (2022-12-19) applies the profile to the container's init and what it starts
/// only, not to processes started by `runsc exec` or the control socket, which is how this
/// backend runs every command. The statx shim (preloaded in every dynamically linked
/// program of a host-tools sandbox, `shim/statx_compat.rs`) therefore installs the same
/// filter in its constructor; a static program started directly as argv, or a rootfs
/// without glibc's loader, is not covered (the conformance case `isolation.no-userns`
/// checks the shell, Python and argv paths).
pub fn seccomp() -> Result<LinuxSeccomp> {
    let deny = |names: &[&str], args: Option<Vec<oci_spec::runtime::LinuxSeccompArg>>| {
        let mut b = LinuxSyscallBuilder::default()
            .names(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(libc::EPERM as u32);
        if let Some(a) = args {
            b = b.args(a);
        }
        b.build().map_err(oci)
    };
    let mut rules: Vec<LinuxSyscall> = vec![deny(&["setns"], None)?];
    for flag in NS_FLAGS {
        let arg = LinuxSeccompArgBuilder::default()
            .index(0usize)
            .value(flag)
            .value_two(flag)
            .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
            .build()
            .map_err(oci)?;
        rules.push(deny(&["clone", "unshare"], Some(vec![arg]))?);
    }
    LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActAllow)
        .syscalls(rules)
        .build()
        .map_err(oci)
}

/// The whole `config.json` for runsc's `platform`. `scratch`: a host directory whose `tmp/` and `shm/` become
/// `/tmp` and `/dev/shm` (see [`tmpfs_caps`]); `None` for tmpfs mounts of the runtime's own.
/// `files`: host files bound read-only over the root's (destination, source), after the
/// root's own mounts (so `/etc/resolv.conf`, or `/etc/ssl/certs/ca-certificates.crt` inside
/// the host's bound `/etc/ssl/certs`); each destination must exist in the root. Without a caller's
/// rootfs the root is `rootfs/` with the host's tools bound into it before runsc starts
/// ([`host_tools`]), not mounts of the spec.
#[allow(clippy::too_many_arguments)]
pub fn config(
    spec: &SandboxSpec,
    platform: Platform,
    who: Identity,
    workspace: &Path,
    workspace_read_only: bool,
    scratch: Option<&Path>,
    cgroup: &str,
    files: &[(&str, &Path)],
) -> Result<Spec> {
    let mut mounts = vec![MountBuilder::default()
        .destination("/proc")
        .typ("proc")
        .source("proc")
        .build()
        .map_err(oci)?];
    // `/tmp` and `/dev/shm`: `scratch/tmp` and `scratch/shm` of a host tmpfs (see
    // `tmpfs_caps`), or, without one (runtimes on the host's kernel, whose tmpfs enforces
    // `nr_inodes`), tmpfs mounts with the same caps. A caller's rootfs without the mount
    // point gets the tmpfs too (the sandbox passes an overlay view that has it where it
    // can): runsc would create a bind mount's point in that directory, which is never
    // written (gVisor's tmpfs ignores `nr_inodes` though: see `tmpfs_caps`).
    let caps = tmpfs_caps(spec);
    for (dst, sub) in SCRATCH_MOUNTS {
        let has_point = spec
            .rootfs
            .as_ref()
            .is_none_or(|r| r.join(dst.trim_start_matches('/')).is_dir());
        let m = match scratch.filter(|_| has_point) {
            Some(dir) => bind(dst, &dir.join(sub), false)?,
            None => MountBuilder::default()
                .destination(dst)
                .typ("tmpfs")
                .source("tmpfs")
                .options(vec![
                    "nosuid".to_string(),
                    "nodev".to_string(),
                    "mode=1777".to_string(),
                    format!("size={}", caps.scratch.bytes / 2),
                    format!("nr_inodes={}", caps.scratch.inodes / 2),
                ])
                .build()
                .map_err(oci)?,
        };
        mounts.push(m);
    }
    mounts.push(bind("/workspace", workspace, workspace_read_only)?);
    if let Some(alias) = &spec.workspace_alias {
        mounts.push(bind(alias, workspace, workspace_read_only)?);
    }
    for (dst, src) in files {
        mounts.push(bind(dst, src, true)?);
    }
    for m in &spec.mounts {
        mounts.push(bind(&m.target, &m.source, m.read_only)?);
    }
    let ns = |t| LinuxNamespaceBuilder::default().typ(t).build().map_err(oci);
    let namespaces = vec![
        ns(LinuxNamespaceType::Pid)?,
        ns(LinuxNamespaceType::Network)?,
        ns(LinuxNamespaceType::Ipc)?,
        ns(LinuxNamespaceType::Uts)?,
        ns(LinuxNamespaceType::Mount)?,
    ];
    let mem = i64::try_from(spec.limits.memory_bytes).unwrap_or(i64::MAX);
    let period: u64 = 100_000;
    let quota = i64::from(spec.limits.cpu_millis) * 100;
    let resources = LinuxResourcesBuilder::default()
        .memory(
            LinuxMemoryBuilder::default()
                .limit(mem)
                .swap(mem)
                .build()
                .map_err(oci)?,
        )
        .pids(
            LinuxPidsBuilder::default()
                .limit(host_pids_limit(spec, platform))
                .build()
                .map_err(oci)?,
        )
        .cpu(
            LinuxCpuBuilder::default()
                .quota(quota)
                .period(period)
                .build()
                .map_err(oci)?,
        )
        .build()
        .map_err(oci)?;
    let linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .resources(resources)
        .seccomp(seccomp()?)
        .cgroups_path(PathBuf::from(cgroup))
        .build()
        .map_err(oci)?;
    let init = process(
        vec!["/bin/sh".into(), "-c".into(), INIT_SCRIPT.into()],
        vec!["PATH=/usr/local/bin:/usr/bin:/bin".into()],
        "/",
        who,
        spec,
    )?;
    // A caller's rootfs is the root itself, wrapped by runsc in an in-memory overlay
    // (`--overlay2=root:memory`) so writes never reach the directory.
    let root = match &spec.rootfs {
        Some(dir) => RootBuilder::default().path(dir).readonly(false).build(),
        None => RootBuilder::default().path("rootfs").readonly(true).build(),
    }
    .map_err(oci)?;
    SpecBuilder::default()
        .version("1.0.2")
        .root(root)
        .hostname("sandbox")
        .process(init)
        .mounts(mounts)
        .linux(linux)
        .build()
        .map_err(oci)
}

/// The host-tools view: the host's `/usr` and the few `/etc` entries tools need, bound
/// read-only at the same paths inside `rootfs/` (whose [`write_rootfs`] made their mount
/// points) in a mount namespace of runsc's own ([`crate::runsc::in_tools_view`]), so the
/// gofer serves them as part of the root: one gofer mount instead of one per entry. Each
/// gofer mount costs the host ~4.4 threads (a gofer connection, the Sentry's client, idle Go
/// threads) and ~0.14 MiB of kernel memory per sandbox; an idle host-tools sandbox kept 84
/// host tasks with them as mounts of the spec, 48 as part of the root (docs/benchmarks.md,
/// "Density ceilings"). The root is runsc's exclusive mount, so the Sentry caches the tools'
/// names, attributes and pages as it caches the rest of the root, instead of asking the
/// gofer on every lookup. The binds live only in that namespace: nothing is mounted on the
/// host, and they go with the sandbox's last process.
pub fn host_tools() -> Vec<PathBuf> {
    let mut tools = vec![PathBuf::from("/usr")];
    for name in HOST_ETC {
        let host = Path::new("/etc").join(name);
        if host.is_dir() || host.is_file() {
            tools.push(host);
        }
    }
    tools
}

/// The host-tools view as read-only bind mounts of a spec, for a runtime driven directly
/// with this module's bundle (crun, or `runsc run`, as the benchmarks' references): the
/// tier itself binds them before runsc starts ([`host_tools`]).
pub fn host_tool_mounts() -> Result<Vec<Mount>> {
    host_tools()
        .iter()
        .map(|src| bind(&src.to_string_lossy(), src, true))
        .collect()
}

/// Writes the spec as `config.json`.
pub fn save(spec: &Spec, bundle: &Path) -> Result<()> {
    spec.save(bundle.join("config.json"))
        .map_err(|e| Error::backend_caused(Tier::Gvisor, "writing config.json", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_bundle_goes_to_our_path_and_the_system_path_never_through_links() {
        let ours = sandbox_core::egress::CA_BUNDLE_PATH.trim_start_matches('/');
        let system = sandbox_core::egress::SYSTEM_CA_BUNDLE;
        // A root without /etc (an image without ca-certificates): both made.
        let bare = tempfile::tempdir().unwrap();
        write_ca_bundle(bare.path(), "PEM").unwrap();
        assert_eq!(fs::read_to_string(bare.path().join(ours)).unwrap(), "PEM");
        assert_eq!(fs::read_to_string(bare.path().join(system)).unwrap(), "PEM");
        // An existing bundle is replaced.
        write_ca_bundle(bare.path(), "NEW").unwrap();
        assert_eq!(fs::read_to_string(bare.path().join(system)).unwrap(), "NEW");
        // A linked directory on the way: that path is left alone, ours is written.
        let linked = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        fs::create_dir(linked.path().join("etc")).unwrap();
        symlink(outside.path(), linked.path().join("etc/ssl")).unwrap();
        write_ca_bundle(linked.path(), "PEM").unwrap();
        assert_eq!(fs::read_to_string(linked.path().join(ours)).unwrap(), "PEM");
        assert_eq!(
            fs::read_dir(outside.path()).unwrap().count(),
            0,
            "nothing written through the link"
        );
        // A linked /etc is refused.
        let bad = tempfile::tempdir().unwrap();
        symlink(outside.path(), bad.path().join("etc")).unwrap();
        assert!(write_ca_bundle(bad.path(), "PEM").is_err());
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 0);
    }

    #[test]
    fn the_host_tools_are_no_mounts_of_the_spec_and_each_has_its_point() {
        let spec = SandboxSpec::new(sandbox_core::Language::Shell);
        let who = Identity::new(1000, 1000);
        let ws = tempfile::tempdir().unwrap();
        let cfg = config(
            &spec,
            Platform::Ptrace,
            who,
            ws.path(),
            false,
            None,
            "cg",
            &[],
        )
        .unwrap();
        let mounts = cfg.mounts().as_ref().unwrap();
        for m in mounts {
            let dst = m.destination();
            assert!(
                !dst.starts_with("/usr")
                    && !HOST_ETC.iter().any(|e| *dst == Path::new("/etc").join(e)),
                "{} is a mount of the spec",
                dst.display()
            );
        }
        assert!(cfg.annotations().as_ref().is_none_or(|a| a.is_empty()));
        // Every tool the view binds has its mount point in the root, of its kind.
        let bundle = tempfile::tempdir().unwrap();
        let root = write_rootfs(bundle.path(), who, ("sandbox", "/workspace")).unwrap();
        let tools = host_tools();
        assert_eq!(tools[0], Path::new("/usr"));
        for t in &tools {
            let point = root.join(t.strip_prefix("/").unwrap());
            assert_eq!(point.is_dir(), t.is_dir(), "{}", point.display());
            assert!(point.exists(), "{}", point.display());
        }
    }

    #[test]
    fn the_rootfs_preloads_the_statx_shim_where_there_is_one() {
        let d = tempfile::tempdir().unwrap();
        let root = write_rootfs(
            d.path(),
            Identity {
                uid: 1000,
                gid: 1000,
            },
            ("sandbox", "/workspace"),
        )
        .unwrap();
        let preload = fs::read_to_string(root.join("etc/ld.so.preload"));
        let Some(shim) = STATX_SHIM else {
            assert!(preload.is_err(), "a preload without a shim");
            return;
        };
        assert_eq!(preload.unwrap(), format!("{STATX_SHIM_PATH}\n"));
        let file = fs::read(root.join(STATX_SHIM_PATH.trim_start_matches('/'))).unwrap();
        assert_eq!(file, shim);
        // A shared object that exports `statx` (ELF magic, type ET_DYN).
        assert_eq!(&file[..4], b"\x7fELF");
        assert_eq!(u16::from_le_bytes([file[16], file[17]]), 3);
        assert!(file.windows(6).any(|w| w == b"statx\0"), "no statx symbol");
    }

    #[test]
    fn a_caller_rootfs_needs_the_shim_when_it_has_glibcs_loader() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        assert!(!needs_statx_shim(r), "an empty tree");
        // Merged /usr, as Debian has it: `lib64` a link, the loader a link in usr/lib64.
        fs::create_dir_all(r.join("usr/lib64")).unwrap();
        symlink("usr/lib64", r.join("lib64")).unwrap();
        assert!(!needs_statx_shim(r));
        symlink(
            "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
            r.join("usr/lib64/ld-linux-x86-64.so.2"),
        )
        .unwrap();
        assert!(needs_statx_shim(r));
        // A loader reached only through a linked directory (which could point anywhere on
        // the host) does not count.
        let e = tempfile::tempdir().unwrap();
        fs::create_dir_all(e.path().join("x")).unwrap();
        fs::write(e.path().join("x/ld-linux-x86-64.so.2"), b"").unwrap();
        symlink(e.path().join("x"), e.path().join("lib64")).unwrap();
        assert!(!needs_statx_shim(e.path()));
    }

    #[test]
    fn the_shim_joins_an_existing_preload_once_and_never_follows_links() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        fs::create_dir_all(r.join("etc")).unwrap();
        fs::write(r.join("etc/ld.so.preload"), "/usr/lib/libtheirs.so").unwrap();
        add_statx_shim(r, b"shim").unwrap();
        add_statx_shim(r, b"shim").unwrap();
        assert_eq!(
            fs::read_to_string(r.join("etc/ld.so.preload")).unwrap(),
            format!("/usr/lib/libtheirs.so\n{STATX_SHIM_PATH}\n")
        );
        assert_eq!(
            fs::read(r.join(STATX_SHIM_PATH.trim_start_matches('/'))).unwrap(),
            b"shim"
        );
        // `etc` a link (to a directory of the "host"): refused, nothing written there.
        let host = tempfile::tempdir().unwrap();
        let t = tempfile::tempdir().unwrap();
        symlink(host.path(), t.path().join("etc")).unwrap();
        assert!(add_statx_shim(t.path(), b"shim").is_err());
        assert_eq!(fs::read_dir(host.path()).unwrap().count(), 0);
        // `etc/ld.so.preload` a link: refused, the link's target untouched.
        let u = tempfile::tempdir().unwrap();
        fs::create_dir_all(u.path().join("etc")).unwrap();
        let target = host.path().join("preload");
        fs::write(&target, "theirs\n").unwrap();
        symlink(&target, u.path().join("etc/ld.so.preload")).unwrap();
        assert!(add_statx_shim(u.path(), b"shim").is_err());
        assert_eq!(fs::read_to_string(&target).unwrap(), "theirs\n");
    }
}
