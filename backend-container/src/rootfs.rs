//! The root filesystem plan: a list of [`Op`]s the init runs in its new mount namespace.
//!
//! Layout (see `docs/container.md`): a fresh tmpfs root, read-only binds of `/usr` and the
//! `bin`/`lib*`/`sbin` links, a handful of `/etc` files, fresh `/proc`, minimal `/dev`,
//! tmpfs `/tmp`, the workspace, the spec's mounts, then `pivot_root` and the old root detached.
//!
//! Bind sources are reached through `/oldroot`: the init first pivots into a scratch tmpfs
//! (keeping the host root at `/oldroot`), so no host path is hidden by our own mounts
//! (bubblewrap does the same).

use std::path::{Path, PathBuf};

use sandbox_core::{Error, Result, SandboxSpec, TmpfsCap, TmpfsCaps, Workspace};

use crate::landlock;
use crate::proto::Op;

const MS_NOSUID: u64 = libc::MS_NOSUID;
const MS_NODEV: u64 = libc::MS_NODEV;
const MS_NOEXEC: u64 = libc::MS_NOEXEC;
const MS_REC: u64 = libc::MS_REC;
const MS_PRIVATE: u64 = libc::MS_PRIVATE;

/// `MOUNT_ATTR_*` for `mount_setattr`.
pub(crate) const ATTR_RDONLY: u64 = 0x1;
pub(crate) const ATTR_NOSUID: u64 = 0x2;
pub(crate) const ATTR_NODEV: u64 = 0x4;

const NEW: &str = "/newroot";
const OLD: &str = "/oldroot";

/// Directories under which a spec mount may not be placed (they are host binds or kernel
/// filesystems: creating a mount point there would write to the host or be meaningless).
const RESERVED: &[&str] = &[
    "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "sys",
    "oldroot", "newroot",
];

/// Host `/etc` entries made visible read-only (when present).
const ETC_FROM_HOST: &[&str] = &[
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "alternatives",
    "localtime",
    "timezone",
    "protocols",
    "services",
    "mime.types",
    "host.conf",
    "gai.conf",
    "os-release",
    "debian_version",
    "bash.bashrc",
    "profile",
    "inputrc",
    "magic",
    "python3",
    "python3.11",
    "perl",
];

/// Caps of the sandbox's writable tmpfs mounts: [`Limits::tmpfs_caps`] with two scratch
/// mounts (`/tmp`, `/dev/shm`) and up to two disk mounts (`/workspace` unless it is a host
/// directory, and in rootfs-directory mode the overlay's upper layer).
///
/// [`Limits::tmpfs_caps`]: sandbox_core::Limits::tmpfs_caps
pub(crate) fn tmpfs_caps(spec: &SandboxSpec) -> TmpfsCaps {
    let disks =
        u64::from(matches!(spec.workspace, Workspace::Empty)) + u64::from(crate::own_root(spec));
    spec.limits.tmpfs_caps(2, disks)
}

/// tmpfs options for `cap`.
fn cap_options(cap: TmpfsCap) -> String {
    format!("size={},nr_inodes={}", cap.bytes, cap.inodes)
}

/// Inputs of the plan.
#[derive(Debug, Clone)]
pub(crate) struct Plan<'a> {
    pub spec: &'a SandboxSpec,
    /// uid/gid inside that runs commands.
    pub user: u32,
    pub hostname: &'a str,
    pub resolv_conf: &'a str,
    /// The certificates the sandbox's programs trust when proxy-held secrets are bound (the
    /// system bundle plus the egress proxy's interception CA), written to
    /// `/etc/agent-sandbox-ca.crt`.
    pub ca_bundle: Option<&'a str>,
    /// Caps of the writable tmpfs mounts (see [`tmpfs_caps`]).
    pub caps: TmpfsCaps,
    /// Landlock ABI to confine writes with (`None`: no Landlock).
    pub landlock: Option<u32>,
    /// [`host_ops`], cached by the backend.
    pub host: &'a [Op],
    /// Whether the init brings `lo` up (else the library does, see
    /// [`crate::network::loopback_up`]).
    pub loopback: bool,
    /// The root's lower layers, lowest first, canonical: the spec's `rootfs` directory, or
    /// its image's unpacked layers. Empty: the host-tools root.
    pub layers: &'a [PathBuf],
    /// A host-directory workspace arrives as a detached (idmapped) mount, the setup
    /// message's first fd (see `Op::Lower`), instead of being bound from its host path.
    pub workspace_fd: bool,
}

/// Where the classic setup puts a host-directory workspace that arrives as a detached
/// mount, in the scratch root (detached with it after `pivot_root`), before anything else
/// takes an fd: it is then bound to `/workspace` (binds keep the idmapping).
const WS_MOUNT: &str = "/ws";

/// A tmpfs mounted at `dst` with these flags and options.
fn tmpfs(dst: impl Into<String>, flags: u64, data: impl Into<String>) -> Op {
    Op::Mount {
        src: "tmpfs".into(),
        dst: dst.into(),
        fstype: "tmpfs".into(),
        flags,
        data: data.into(),
    }
}

fn canonical(p: &Path, what: &str) -> Result<PathBuf> {
    p.canonicalize()
        .map_err(|e| Error::invalid(what, format!("{}: {e}", p.display())))
}

/// Checks the spec's mounts against our layout.
pub(crate) fn check_mounts(spec: &SandboxSpec) -> Result<()> {
    for m in &spec.mounts {
        let first = m
            .target
            .trim_start_matches('/')
            .split('/')
            .next()
            .unwrap_or("");
        if first.is_empty() || RESERVED.contains(&first) {
            return Err(Error::invalid(
                "mounts",
                format!(
                    "target `{}` is inside a system directory; use e.g. /data or /mnt/...",
                    m.target
                ),
            ));
        }
        if first == "workspace" && !matches!(spec.workspace, Workspace::Empty) {
            return Err(Error::invalid(
                "mounts",
                format!(
                    "target `{}` would create a directory in the host workspace directory",
                    m.target
                ),
            ));
        }
    }
    Ok(())
}

/// Where a plan builds the new root, and how it reaches the host's files.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Roots<'a> {
    /// The new root's path while it is built.
    pub new: &'a str,
    /// The prefix of host paths: the old root's mount point, or `""` where the host's root
    /// is still `/` (a template built by the zygote; a template-based setup).
    pub old: &'a str,
}

/// The classic layout: the new root at `/newroot` of a scratch root, the host's at `/oldroot`.
const CLASSIC: Roots<'static> = Roots { new: NEW, old: OLD };

impl Roots<'_> {
    /// `p` (absolute) in the new root.
    fn at(&self, p: &str) -> String {
        format!("{}{p}", self.new)
    }

    /// Host path `p` as the plan reaches it.
    fn old(&self, p: &Path) -> String {
        format!("{}{}", self.old, p.display())
    }
}

fn bind_ro(ops: &mut Vec<Op>, r: Roots<'_>, src: &Path, dst: &str, dir: bool) {
    if dir {
        ops.push(Op::Mkdir {
            path: r.at(dst),
            mode: 0o755,
        });
    } else {
        ops.push(Op::Touch { path: r.at(dst) });
    }
    ops.push(Op::Bind {
        src: r.old(src),
        dst: r.at(dst),
    });
    ops.push(Op::SetAttr {
        path: r.at(dst),
        set: ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV,
        clear: 0,
        recursive: true,
    });
}

/// Adds a host path (directory, file or symlink) at the same place, read-only. Small regular
/// files (≤ 4 KiB) are copied into the (read-only) root instead: cheaper than a bind, and
/// the setup message stays small.
fn host_entry(ops: &mut Vec<Op>, r: Roots<'_>, host: &str) {
    let p = Path::new(host);
    let Ok(md) = p.symlink_metadata() else { return };
    if md.is_file() && md.len() <= 4 << 10 {
        if let Ok(data) = std::fs::read(p) {
            use std::os::unix::fs::PermissionsExt;
            let mode = md.permissions().mode() & 0o755;
            ops.push(Op::WriteFile {
                path: r.at(host),
                mode,
                data,
            });
            return;
        }
    }
    if md.file_type().is_symlink() {
        if let Ok(t) = std::fs::read_link(p) {
            ops.push(Op::Symlink {
                target: t.to_string_lossy().into_owned(),
                path: r.at(host),
            });
        }
    } else if md.is_dir() {
        bind_ro(ops, r, p, host, true);
    } else if md.is_file() {
        bind_ro(ops, r, p, host, false);
    }
}

/// The file under `/etc` holding [`Plan::ca_bundle`]
/// ([`CA_BUNDLE_PATH`](sandbox_core::egress::CA_BUNDLE_PATH)).
pub(crate) const CA_BUNDLE_NAME: &str = "agent-sandbox-ca.crt";

/// The generated `/etc` files of a host-tools root (name, content): they depend only on the
/// command user, the hostname and `resolv.conf`, which makes them a template's key.
pub(crate) fn etc_files(
    user: u32,
    hostname: &str,
    resolv_conf: &str,
) -> Vec<(&'static str, String)> {
    let u = user;
    let passwd = if u == 0 {
        "root:x:0:0:sandbox:/workspace:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
            .to_string()
    } else {
        format!(
            "root:x:0:0:root:/root:/bin/sh\nsandbox:x:{u}:{u}:sandbox:/workspace:/bin/sh\n\
             nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
    };
    let group = if u == 0 {
        "root:x:0:\nnogroup:x:65534:\n".to_string()
    } else {
        format!("root:x:0:\nsandbox:x:{u}:\nnogroup:x:65534:\n")
    };
    let h = hostname;
    vec![
        ("passwd", passwd),
        ("group", group),
        ("hostname", format!("{h}\n")),
        (
            "hosts",
            format!(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{h}\n"
            ),
        ),
        ("resolv.conf", resolv_conf.to_string()),
        (
            "nsswitch.conf",
            "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n\
             protocols: files\nservices: files\nethers: files\nrpc: files\n"
                .to_string(),
        ),
        (
            "gitconfig",
            "[user]\n\tname = sandbox\n\temail = sandbox@localhost\n[safe]\n\tdirectory = *\n\
             [init]\n\tdefaultBranch = main\n"
                .to_string(),
        ),
    ]
}

/// The host-dependent, spec-independent part of the classic plan: `/usr` and the
/// `bin`/`lib*` links, `/etc` with the listed host entries (generated files are added per
/// sandbox).
pub(crate) fn host_ops() -> Vec<Op> {
    host_ops_at(CLASSIC)
}

fn host_ops_at(r: Roots<'_>) -> Vec<Op> {
    let mut ops = Vec::new();
    bind_ro(&mut ops, r, Path::new("/usr"), "/usr", true);
    for d in ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"] {
        host_entry(&mut ops, r, d);
    }
    ops.push(Op::Mkdir {
        path: r.at("/etc"),
        mode: 0o755,
    });
    for name in ETC_FROM_HOST {
        host_entry(&mut ops, r, &format!("/etc/{name}"));
    }
    ops
}

/// A fingerprint of the host entries a template takes a snapshot of (the small `/etc` files
/// it copies, the single files it binds, the merged-`/usr` links): device, inode, size, mode
/// and mtime of each. A template built under another fingerprint is not used (a new one is
/// built): e.g. `ldconfig` replaces `/etc/ld.so.cache` by a rename, and a bind keeps the old
/// file. Directories (`/usr`, `/etc/ssl`...) are bound live anyway.
pub(crate) fn host_fingerprint() -> u64 {
    let links = ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"].map(String::from);
    fingerprint(
        links
            .into_iter()
            .chain(ETC_FROM_HOST.iter().map(|n| format!("/etc/{n}"))),
    )
}

/// [`host_fingerprint`] of any paths.
fn fingerprint(paths: impl Iterator<Item = String>) -> u64 {
    use std::hash::{Hash, Hasher};
    use std::os::unix::fs::MetadataExt;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in paths {
        p.hash(&mut h);
        match std::fs::symlink_metadata(&p) {
            Ok(m) => (
                m.dev(),
                m.ino(),
                m.size(),
                m.mode(),
                m.mtime(),
                m.mtime_nsec(),
            )
                .hash(&mut h),
            Err(_) => 0u8.hash(&mut h),
        }
    }
    h.finish()
}

/// The generated `/etc` files, written.
fn write_etc(ops: &mut Vec<Op>, r: Roots<'_>, files: Vec<(&'static str, String)>) {
    for (name, content) in files {
        ops.push(Op::WriteFile {
            path: r.at(&format!("/etc/{name}")),
            mode: 0o644,
            data: content.into_bytes(),
        });
    }
}

/// The mount points and fixed entries every root has: `/proc`, a small `/dev` tmpfs with the
/// device nodes (bound: no `mknod` in a user namespace) and links, read-only afterwards,
/// `/tmp`, `/workspace`, and (`var`) `/var/tmp` pointing at `/tmp`.
fn skeleton(ops: &mut Vec<Op>, r: Roots<'_>, var: bool) {
    ops.push(Op::Mkdir {
        path: r.at("/proc"),
        mode: 0o555,
    });
    ops.push(Op::Mkdir {
        path: r.at("/dev"),
        mode: 0o755,
    });
    ops.push(tmpfs(
        r.at("/dev"),
        MS_NOSUID | MS_NOEXEC,
        "mode=0755,size=64k,nr_inodes=256",
    ));
    for n in ["null", "zero", "full", "random", "urandom", "tty"] {
        let host = format!("/dev/{n}");
        if Path::new(&host).exists() {
            ops.push(Op::Touch { path: r.at(&host) });
            ops.push(Op::Bind {
                src: r.old(Path::new(&host)),
                dst: r.at(&host),
            });
        }
    }
    let dir = |path: &str, mode: u32| Op::Mkdir {
        path: r.at(path),
        mode,
    };
    let link = |target: &str, path: &str| Op::Symlink {
        target: target.into(),
        path: r.at(path),
    };
    ops.push(dir("/dev/pts", 0o755));
    ops.push(link("pts/ptmx", "/dev/ptmx"));
    ops.push(dir("/dev/shm", 0o1777));
    for (l, t) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        ops.push(link(t, &format!("/dev/{l}")));
    }
    ops.push(Op::SetAttr {
        path: r.at("/dev"),
        set: ATTR_RDONLY,
        clear: 0,
        recursive: false,
    });
    ops.push(dir("/tmp", 0o1777));
    if var {
        ops.push(dir("/var", 0o755));
        ops.push(link("/tmp", "/var/tmp"));
    }
    ops.push(dir("/workspace", 0o755));
}

/// What each sandbox mounts on its skeleton: a fresh `/proc` (this pid namespace only) with
/// `/proc/sys` read-only, `/dev/pts` (a new instance), `/dev/shm` and `/tmp`, and the
/// workspace (a tmpfs, or the host directory); the tmpfs mounts capped by `p.caps`.
/// `detached`: a host-directory workspace arrives as a detached mount (the setup message's
/// first fd, see `Op::Lower`) instead of being bound from its host path; `staged`: the
/// classic setup moved it to [`WS_MOUNT`] already (see [`plan`]).
fn sandbox_mounts(
    ops: &mut Vec<Op>,
    r: Roots<'_>,
    p: &Plan<'_>,
    detached: bool,
    staged: bool,
) -> Result<()> {
    ops.push(Op::Mount {
        src: "proc".into(),
        dst: r.at("/proc"),
        fstype: "proc".into(),
        flags: MS_NOSUID | MS_NODEV | MS_NOEXEC,
        data: String::new(),
    });
    ops.push(Op::Bind {
        src: r.at("/proc/sys"),
        dst: r.at("/proc/sys"),
    });
    ops.push(Op::SetAttr {
        path: r.at("/proc/sys"),
        set: ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV,
        clear: 0,
        recursive: true,
    });
    ops.push(Op::Mount {
        src: "devpts".into(),
        dst: r.at("/dev/pts"),
        fstype: "devpts".into(),
        flags: MS_NOSUID | MS_NOEXEC,
        data: "newinstance,ptmxmode=0666,mode=0620".into(),
    });
    let tmp = format!("mode=1777,{}", cap_options(p.caps.scratch));
    ops.push(tmpfs(r.at("/dev/shm"), MS_NOSUID | MS_NODEV, tmp.clone()));
    ops.push(tmpfs(r.at("/tmp"), MS_NOSUID | MS_NODEV, tmp));
    match &p.spec.workspace {
        Workspace::Empty => ops.push(tmpfs(
            r.at("/workspace"),
            MS_NOSUID | MS_NODEV,
            format!(
                "mode=0755,{},uid={u},gid={u}",
                cap_options(p.caps.disk),
                u = p.user
            ),
        )),
        Workspace::HostDir { path, read_only } => {
            let src = canonical(path, "workspace")?;
            ops.push(if staged {
                Op::Bind {
                    src: WS_MOUNT.into(),
                    dst: r.at("/workspace"),
                }
            } else if detached {
                Op::Lower {
                    src: r.old(&src),
                    dst: r.at("/workspace"),
                }
            } else {
                Op::Bind {
                    src: r.old(&src),
                    dst: r.at("/workspace"),
                }
            });
            let ro = if *read_only { ATTR_RDONLY } else { 0 };
            ops.push(Op::SetAttr {
                path: r.at("/workspace"),
                set: ro | ATTR_NOSUID | ATTR_NODEV,
                clear: 0,
                recursive: true,
            });
        }
        other => {
            return Err(Error::unsupported(
                crate::sandbox::TIER,
                format!("the workspace {other:?}"),
            ))
        }
    }
    Ok(())
}

/// The last steps of every plan: the hostname, loopback up, `pivot_root` into `newroot`,
/// the workspace as working directory, no core dumps, and Landlock (`layers`: the lower
/// layers, whose top-level directories are writable too).
fn finish(ops: &mut Vec<Op>, p: &Plan<'_>, newroot: &str, layers: &[PathBuf]) {
    ops.push(Op::Hostname {
        name: p.hostname.to_string(),
    });
    if p.loopback {
        ops.push(Op::LoopbackUp);
    }
    ops.push(Op::Pivot {
        newroot: newroot.into(),
    });
    ops.push(Op::Chdir {
        path: "/workspace".into(),
    });
    #[allow(clippy::unnecessary_cast)] // RLIMIT_* types differ between libcs
    ops.push(Op::Rlimit {
        resource: libc::RLIMIT_CORE as u32,
        soft: 0,
        hard: 0,
    });
    // Lock the init down; every exec inherits both.
    if let Some(abi) = p.landlock {
        let mut paths = writable_paths(p.spec);
        paths.extend(rootfs_writable_dirs(layers).into_iter().map(|d| (d, true)));
        let rules = paths
            .into_iter()
            .map(|(path, dir)| {
                let r = if dir {
                    landlock::tree_rights(abi)
                } else {
                    landlock::file_rights(abi)
                };
                (path, r)
            })
            .collect();
        ops.push(Op::Landlock {
            handled: landlock::handled(abi),
            rules,
        });
    }
}

/// The setup, in two parts: `prep` (rootfs-directory mode only: the scratch root, the
/// overlay's upper tmpfs and lower layer, before the overlay is mounted; a restore fills the
/// upper layer in between) and `main` (everything else).
#[derive(Debug, Clone, Default)]
pub(crate) struct Setup {
    pub prep: Vec<Op>,
    pub main: Vec<Op>,
}

impl Setup {
    /// Both parts, in order.
    pub(crate) fn all(self) -> Vec<Op> {
        let mut v = self.prep;
        v.extend(self.main);
        v
    }
}

/// The lower layers' top-level directories that commands may write beneath (Landlock): their
/// real directories except the kernel and sandbox-managed ones.
fn rootfs_writable_dirs(layers: &[PathBuf]) -> Vec<String> {
    let mut v = std::collections::BTreeSet::new();
    for root in layers {
        if let Ok(rd) = std::fs::read_dir(root) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if ["proc", "dev", "sys", "tmp", "workspace"].contains(&name.as_str()) {
                    continue;
                }
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    v.insert(format!("/{name}"));
                }
            }
        }
    }
    v.into_iter().collect()
}

/// The mount options of the overlay root over `n` lower layers (`lower/0` the lowest):
/// paths relative to the scratch root (the init's working directory when it mounts it), so
/// `/proc/mounts` shows no host path.
pub(crate) fn overlay_data(n: usize) -> String {
    let lower: Vec<String> = (0..n).rev().map(|i| format!("lower/{i}")).collect();
    format!(
        "lowerdir={},upperdir=ovl/upper,workdir=ovl/work,userxattr",
        lower.join(":")
    )
}

/// The options of a host-tools root's tmpfs (small: it holds directories, links and the
/// generated `/etc` files).
const ROOT_TMPFS: &str = "mode=0755,size=4m,nr_inodes=4096";

/// Whether a sandbox of this spec can start from a root-filesystem template: a host-tools
/// root with no spec mounts (their mount points would have to be made in the shared,
/// read-only root). Template-mode inits live in the zygote's own mount namespace, a copy of
/// the host's that may lag behind it, so a host-directory workspace must reach them as a
/// detached mount the library made from its current view ([`template_plan`] expects it as
/// the setup message's first fd).
pub(crate) fn template_fits(spec: &SandboxSpec) -> bool {
    !crate::own_root(spec) && spec.mounts.is_empty()
}

/// A root-filesystem template at `root` (built once by the zygote, as root, in its own mount
/// namespace, where the host's root is `/`): a read-only tmpfs holding everything of the
/// host-tools root that is the same for every sandbox with these `/etc` files — `/usr` and
/// the `bin`/`lib*` links, `/etc`, `/dev` with its nodes, and the mount points. A sandbox
/// clones it with one recursive bind ([`template_plan`]) instead of ~100 operations.
pub(crate) fn template_ops(root: &str, etc: Vec<(&'static str, String)>) -> Vec<Op> {
    let r = Roots { new: root, old: "" };
    let mut ops = vec![
        Op::Mkdir {
            path: root.into(),
            mode: 0o755,
        },
        tmpfs(root, MS_NOSUID | MS_NODEV, ROOT_TMPFS),
    ];
    ops.extend(host_ops_at(r));
    write_etc(&mut ops, r, etc);
    skeleton(&mut ops, r, true);
    ops.push(Op::SetAttr {
        path: root.into(),
        set: ATTR_RDONLY,
        clear: 0,
        recursive: false,
    });
    ops
}

/// How every setup starts: children get their own clocks (`CLONE_NEWTIME`; absent on old
/// kernels), and no mount event crosses between the sandbox and the host any more.
fn first_ops() -> Vec<Op> {
    vec![
        Op::Unshare {
            flags: 0x80,
            optional: true,
        },
        Op::Mount {
            src: String::new(),
            dst: "/".into(),
            fstype: String::new(),
            flags: MS_REC | MS_PRIVATE,
            data: String::new(),
        },
    ]
}

/// The setup of a sandbox whose root is the template at `root` (see [`template_fits`]): its
/// own clone of the template (the template's mounts arrive locked, so they stay read-only),
/// its own mounts on it, then the usual finish. The host's root stays `/` until the pivot.
pub(crate) fn template_plan(p: &Plan<'_>, root: &str) -> Result<Setup> {
    check_mounts(p.spec)?;
    let r = Roots { new: root, old: "" };
    let mut ops = first_ops();
    ops.push(Op::Bind {
        src: root.into(),
        dst: root.into(),
    });
    sandbox_mounts(&mut ops, r, p, true, false)?;
    finish(&mut ops, p, root, &[]);
    Ok(Setup {
        prep: Vec::new(),
        main: ops,
    })
}

/// The whole setup, in order.
pub(crate) fn plan(p: &Plan<'_>) -> Result<Setup> {
    let spec = p.spec;
    check_mounts(spec)?;
    let layers = p.layers;
    let r = CLASSIC;
    let mut ops = first_ops();
    ops.extend([
        tmpfs("/tmp", MS_NOSUID | MS_NODEV, "mode=0755,size=64k"),
        Op::Mkdir {
            path: format!("/tmp{OLD}"),
            mode: 0o755,
        },
        Op::Mkdir {
            path: format!("/tmp{NEW}"),
            mode: 0o755,
        },
        Op::PivotOld {
            newroot: "/tmp".into(),
            put_old: format!("/tmp{OLD}"),
        },
    ]);
    // A host-directory workspace that arrives as a detached mount takes the message's first
    // fd: it is staged in the scratch root before the layers take theirs.
    let staged = p.workspace_fd && matches!(spec.workspace, Workspace::HostDir { .. });
    if let (true, Workspace::HostDir { path, .. }) = (staged, &spec.workspace) {
        let src = canonical(path, "workspace")?;
        ops.push(Op::Mkdir {
            path: WS_MOUNT.into(),
            mode: 0o755,
        });
        ops.push(Op::Lower {
            src: r.old(&src),
            dst: WS_MOUNT.into(),
        });
    }
    let mut prep = Vec::new();
    if !layers.is_empty() {
        // Own-root mode (a rootfs directory or an image): an overlay whose lower layers are
        // the directory or the image's layers (idmapped when the library could, see
        // `Op::Lower`) and whose upper layer lives on a tmpfs capped by `p.caps.disk`, so no
        // layer is ever written. All sit in the scratch root and are detached with it after
        // `pivot_root`; the init keeps the upper directory open for snapshots.
        ops.push(Op::Mkdir {
            path: "/lower".into(),
            mode: 0o755,
        });
        ops.push(Op::Mkdir {
            path: "/ovl".into(),
            mode: 0o755,
        });
        ops.push(tmpfs(
            "/ovl",
            MS_NOSUID | MS_NODEV,
            format!("mode=0755,{}", cap_options(p.caps.disk)),
        ));
        ops.push(Op::Mkdir {
            path: "/ovl/upper".into(),
            mode: 0o755,
        });
        ops.push(Op::Mkdir {
            path: "/ovl/work".into(),
            mode: 0o700,
        });
        ops.push(Op::KeepDir {
            path: "/ovl/upper".into(),
            fd: crate::proto::UPPER_FD,
        });
        for (i, layer) in layers.iter().enumerate() {
            ops.push(Op::Mkdir {
                path: format!("/lower/{i}"),
                mode: 0o755,
            });
            ops.push(Op::Lower {
                src: r.old(layer),
                dst: format!("/lower/{i}"),
            });
        }
        prep = std::mem::take(&mut ops);
        ops.push(Op::Mount {
            src: "overlay".into(),
            dst: NEW.into(),
            fstype: "overlay".into(),
            flags: MS_NOSUID | MS_NODEV,
            data: overlay_data(layers.len()),
        });
        // The image keeps its own /etc, except the files that describe this sandbox.
        ops.push(Op::Mkdir {
            path: r.at("/etc"),
            mode: 0o755,
        });
        let mut own: Vec<_> = etc_files(p.user, p.hostname, p.resolv_conf)
            .into_iter()
            .filter(|(name, _)| matches!(*name, "hostname" | "hosts" | "resolv.conf"))
            .collect();
        own.extend(p.ca_bundle.map(|b| (CA_BUNDLE_NAME, b.to_owned())));
        write_etc(&mut ops, r, own);
        if let Some(bundle) = p.ca_bundle {
            // The image's system bundle too (in the sandbox's upper layer), for programs
            // that read it without looking at the variables.
            ops.push(Op::Mkdir {
                path: r.at("/etc/ssl/certs"),
                mode: 0o755,
            });
            ops.push(Op::WriteFile {
                path: r.at(&format!("/{}", sandbox_core::egress::SYSTEM_CA_BUNDLE)),
                mode: 0o644,
                data: bundle.as_bytes().to_vec(),
            });
        }
    } else {
        ops.push(tmpfs(NEW, MS_NOSUID | MS_NODEV, ROOT_TMPFS));
        // /usr, the merged-/usr links and the host's /etc files: the same for every sandbox
        // of this host, computed once per backend.
        ops.extend_from_slice(p.host);
        let mut files = etc_files(p.user, p.hostname, p.resolv_conf);
        files.extend(p.ca_bundle.map(|b| (CA_BUNDLE_NAME, b.to_owned())));
        write_etc(&mut ops, r, files);
        // The host's system bundle (bound read-only with `/etc/ssl`) is covered by ours, for
        // programs that read it without looking at the variables: a file bind over it, where
        // the host has it as a plain file.
        let host_bundle = Path::new("/")
            .join(sandbox_core::egress::SYSTEM_CA_BUNDLE)
            .symlink_metadata()
            .is_ok_and(|m| m.is_file());
        if p.ca_bundle.is_some() && host_bundle {
            ops.push(Op::Bind {
                src: r.at(&format!("/etc/{CA_BUNDLE_NAME}")),
                dst: r.at(&format!("/{}", sandbox_core::egress::SYSTEM_CA_BUNDLE)),
            });
            ops.push(Op::SetAttr {
                path: r.at(&format!("/{}", sandbox_core::egress::SYSTEM_CA_BUNDLE)),
                set: ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV,
                clear: 0,
                recursive: false,
            });
        }
    }
    skeleton(&mut ops, r, layers.is_empty());
    sandbox_mounts(&mut ops, r, p, staged, staged)?;

    // The spec's mounts (read-only unless asked otherwise).
    for m in &spec.mounts {
        let src = canonical(&m.source, "mounts")?;
        let target = m.target.trim_end_matches('/');
        if let Some(parent) = Path::new(target).parent() {
            ops.push(Op::Mkdir {
                path: r.at(&parent.to_string_lossy()),
                mode: 0o755,
            });
        }
        if src.is_dir() {
            ops.push(Op::Mkdir {
                path: r.at(target),
                mode: 0o755,
            });
        } else {
            ops.push(Op::Touch { path: r.at(target) });
        }
        ops.push(Op::Bind {
            src: r.old(&src),
            dst: r.at(target),
        });
        let ro = if m.read_only { ATTR_RDONLY } else { 0 };
        ops.push(Op::SetAttr {
            path: r.at(target),
            set: ro | ATTR_NOSUID | ATTR_NODEV,
            clear: 0,
            recursive: true,
        });
    }

    // Freeze the layout: the root tmpfs itself becomes read-only (its submounts keep theirs).
    // A rootfs directory's overlay stays writable: writes land in its upper layer.
    if layers.is_empty() {
        ops.push(Op::SetAttr {
            path: NEW.into(),
            set: ATTR_RDONLY,
            clear: 0,
            recursive: false,
        });
    }
    finish(&mut ops, p, NEW, layers);
    Ok(Setup { prep, main: ops })
}

/// The last steps, once the init sits in the sandbox's cgroups: a cgroup namespace rooted
/// there, then the seccomp filter (which forbids any further `unshare`).
pub(crate) fn seal_ops(seccomp: Option<&[u8]>) -> Vec<Op> {
    let mut ops = vec![
        Op::Unshare {
            flags: libc::CLONE_NEWCGROUP as u64,
            optional: true,
        },
        Op::DropBoundingSet,
    ];
    if let Some(bpf) = seccomp {
        ops.push(Op::Seccomp { bpf: bpf.to_vec() });
    }
    ops
}

/// Writable paths inside the sandbox (for Landlock), as (path, is_dir).
pub(crate) fn writable_paths(spec: &SandboxSpec) -> Vec<(String, bool)> {
    let mut v = vec![
        ("/tmp".to_string(), true),
        ("/dev/shm".to_string(), true),
        ("/dev/pts".to_string(), true),
        ("/dev/null".to_string(), false),
        ("/dev/zero".to_string(), false),
        ("/dev/full".to_string(), false),
        ("/dev/tty".to_string(), false),
    ];
    let ws_ro = matches!(
        spec.workspace,
        Workspace::HostDir {
            read_only: true,
            ..
        }
    );
    if !ws_ro {
        v.push(("/workspace".to_string(), true));
    }
    for m in &spec.mounts {
        if !m.read_only {
            v.push((
                m.target.trim_end_matches('/').to_string(),
                m.source.is_dir(),
            ));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_core::Language;

    fn plan_for(spec: &SandboxSpec) -> Result<Vec<Op>> {
        plan(&Plan {
            spec,
            landlock: Some(3),
            host: &host_ops(),
            user: 1000,
            hostname: "sandbox",
            resolv_conf: "",
            ca_bundle: None,
            caps: tmpfs_caps(spec),
            loopback: true,
            layers: &[],
            workspace_fd: false,
        })
        .map(Setup::all)
    }

    #[test]
    fn plan_ends_with_pivot_and_has_no_host_etc_secrets() {
        let spec = SandboxSpec::new(Language::Shell);
        let ops = plan_for(&spec).unwrap();
        assert!(ops.iter().any(|o| matches!(o, Op::Pivot { .. })));
        for o in &ops {
            if let Op::Bind { src, .. } = o {
                assert!(
                    !src.contains("shadow") && !src.contains("/root") && !src.contains("/home"),
                    "{src}"
                );
            }
        }
    }

    #[test]
    fn rootfs_plan_mounts_an_overlay_with_relative_layers() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        std::fs::create_dir_all(dir.path().join("proc")).unwrap();
        std::os::unix::fs::symlink("usr/bin", dir.path().join("bin")).unwrap();
        let spec = SandboxSpec::builder(Language::Shell)
            .rootfs(dir.path())
            .build()
            .unwrap();
        // Two layers, as an image has them (the directory twice will do).
        let layers = vec![
            dir.path().canonicalize().unwrap(),
            dir.path().canonicalize().unwrap(),
        ];
        let setup = plan(&Plan {
            spec: &spec,
            landlock: Some(3),
            host: &[],
            user: 0,
            hostname: "sandbox",
            resolv_conf: "",
            ca_bundle: None,
            caps: tmpfs_caps(&spec),
            loopback: true,
            layers: &layers,
            workspace_fd: false,
        })
        .unwrap();
        // The preparation ends with the layers in place; the overlay comes first after it.
        assert!(matches!(setup.prep.last(), Some(Op::Lower { .. })));
        assert!(setup
            .prep
            .iter()
            .any(|o| matches!(o, Op::KeepDir { fd, .. } if *fd == crate::proto::UPPER_FD)));
        match setup.main.first() {
            Some(Op::Mount {
                fstype, data, dst, ..
            }) => {
                assert_eq!((fstype.as_str(), dst.as_str()), ("overlay", NEW));
                // The topmost layer first, as overlayfs wants them.
                assert_eq!(
                    data,
                    "lowerdir=lower/1:lower/0,upperdir=ovl/upper,workdir=ovl/work,userxattr"
                );
                assert!(!data.contains("=/"), "{data}");
            }
            other => panic!("{other:?}"),
        }
        let host = dir.path().canonicalize().unwrap();
        let host = host.to_string_lossy();
        for o in &setup.main {
            assert!(!format!("{o:?}").contains(&*host), "{o:?}");
            // The root stays writable (the upper layer takes the writes).
            assert!(
                !matches!(o, Op::SetAttr { path, .. } if path == NEW),
                "{o:?}"
            );
        }
        let Some(Op::Landlock { rules, .. }) = setup.main.last() else {
            panic!("no landlock")
        };
        let paths: Vec<&str> = rules.iter().map(|(p, _)| p.as_str()).collect();
        assert!(
            paths.contains(&"/etc") && paths.contains(&"/workspace"),
            "{paths:?}"
        );
        assert!(
            !paths.contains(&"/proc") && !paths.contains(&"/bin"),
            "{paths:?}"
        );
    }

    #[test]
    fn template_holds_the_shared_root_and_the_plan_only_the_sandbox_s_own_mounts() {
        let root = "/run/t/0";
        let ops = template_ops(root, etc_files(1000, "box", "nameserver 1.2.3.4\n"));
        assert!(
            matches!(&ops[1], Op::Mount { fstype, dst, .. } if fstype == "tmpfs" && dst == root)
        );
        // Ends read-only; sources are host paths as the zygote sees them (no /oldroot).
        assert!(
            matches!(ops.last(), Some(Op::SetAttr { path, set, .. }) if path == root && *set == ATTR_RDONLY)
        );
        for o in &ops {
            match o {
                Op::Bind { src, dst } => {
                    assert!(!src.starts_with(OLD) && dst.starts_with(root), "{o:?}");
                    assert!(!src.contains("shadow") && !src.contains("/root"), "{src}");
                }
                Op::WriteFile { path, .. } | Op::Mkdir { path, .. } | Op::Touch { path } => {
                    assert!(path.starts_with(root), "{o:?}")
                }
                _ => {}
            }
        }
        let file = |name: &str| {
            ops.iter().find_map(|o| match o {
                Op::WriteFile { path, data, .. } if path == &format!("{root}/etc/{name}") => {
                    Some(String::from_utf8_lossy(data).into_owned())
                }
                _ => None,
            })
        };
        assert_eq!(file("hostname").as_deref(), Some("box\n"));
        assert!(file("passwd").unwrap().contains("sandbox:x:1000:1000"));

        let spec = SandboxSpec::new(Language::Shell);
        assert!(template_fits(&spec));
        let p = Plan {
            spec: &spec,
            landlock: Some(3),
            host: &[],
            user: 1000,
            hostname: "box",
            resolv_conf: "",
            ca_bundle: None,
            caps: tmpfs_caps(&spec),
            loopback: true,
            layers: &[],
            workspace_fd: false,
        };
        let setup = template_plan(&p, root).unwrap();
        assert!(setup.prep.is_empty());
        let ops = setup.main;
        assert!(ops
            .iter()
            .any(|o| matches!(o, Op::Bind { src, dst } if src == root && dst == root)));
        assert!(ops
            .iter()
            .any(|o| matches!(o, Op::Pivot { newroot } if newroot == root)));
        // Nothing is created in the shared root: only mounts on its mount points.
        assert!(!ops.iter().any(|o| matches!(
            o,
            Op::WriteFile { .. } | Op::Mkdir { .. } | Op::Touch { .. } | Op::Symlink { .. }
        )));
        // Specs with mounts (mount points to make) or a rootfs directory keep the classic plan.
        let with_mount = SandboxSpec::builder(Language::Shell)
            .mount_ro("/usr/share", "/data/share")
            .build()
            .unwrap();
        assert!(!template_fits(&with_mount));
        let with_dir = SandboxSpec::builder(Language::Shell)
            .workspace_dir("/tmp", false)
            .build()
            .unwrap();
        // A host-directory workspace fits, as a detached mount (the setup's first fd).
        assert!(template_fits(&with_dir));
        let p = Plan {
            spec: &with_dir,
            ..p
        };
        let ops = template_plan(&p, root).unwrap().main;
        assert!(ops
            .iter()
            .any(|o| matches!(o, Op::Lower { dst, .. } if dst == &format!("{root}/workspace"))));
        assert!(!ops
            .iter()
            .any(|o| matches!(o, Op::Bind { src, .. } if src == "/tmp")));
    }

    #[test]
    fn the_fingerprint_sees_a_file_replaced_by_a_rename() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ld.so.cache");
        std::fs::write(&f, "old").unwrap();
        let paths = || [f.to_string_lossy().into_owned(), "/nonexistent/x".into()].into_iter();
        let before = fingerprint(paths());
        assert_eq!(fingerprint(paths()), before);
        // What ldconfig does: a new file renamed over the old one (same size, maybe same
        // mtime second): the inode differs.
        let tmp = dir.path().join("ld.so.cache~");
        std::fs::write(&tmp, "new").unwrap();
        std::fs::rename(&tmp, &f).unwrap();
        assert_ne!(fingerprint(paths()), before);
        // The host's, unchanged from one call to the next.
        assert_eq!(host_fingerprint(), host_fingerprint());
    }

    #[test]
    fn reserved_mount_targets_are_refused() {
        let spec = SandboxSpec::builder(Language::Shell)
            .mount_ro("/usr", "/usr/x")
            .build()
            .unwrap();
        assert!(matches!(plan_for(&spec), Err(Error::InvalidSpec { .. })));
        let spec = SandboxSpec::builder(Language::Shell)
            .mount_ro("/usr/share", "/data/share")
            .build()
            .unwrap();
        assert!(plan_for(&spec).is_ok());
    }
}

#[cfg(test)]
mod wire_tests {
    use super::*;
    use crate::proto::{Dec, DecodeInit, Enc, EncodeInit};
    use sandbox_core::Language;

    #[test]
    fn plan_round_trips_through_the_wire_format() {
        let spec = SandboxSpec::new(Language::Shell);
        let bpf = crate::seccomp::program_bytes();
        let mut ops = plan(&Plan {
            spec: &spec,
            landlock: Some(3),
            host: &host_ops(),
            user: 1000,
            hostname: "sandbox",
            resolv_conf: "",
            ca_bundle: None,
            caps: tmpfs_caps(&spec),
            loopback: true,
            layers: &[],
            workspace_fd: false,
        })
        .unwrap()
        .all();
        ops.extend(seal_ops(Some(&bpf)));
        let mut e = Enc::default();
        e.ops(&ops);
        assert_eq!(Dec::new(&e.0).ops().unwrap(), ops);
    }
}
