//! The root filesystem plan: a list of [`Op`]s the init runs in its new mount namespace.
//!
//! Layout (see `docs/container.md`): a fresh tmpfs root, read-only binds of `/usr` and the
//! `bin`/`lib*`/`sbin` links, a handful of `/etc` files, fresh `/proc`, minimal `/dev`,
//! tmpfs `/tmp`, the workspace, the spec's mounts, then `pivot_root` and the old root detached.
//!
//! Bind sources are reached through `/oldroot`: the init first pivots into a scratch tmpfs
//! (keeping the host root at `/oldroot`), so no host path is hidden by our own mounts
//! (bubblewrap does the same).
//!
//! This file has the plan itself (the skeleton, the sandbox's mounts, the finish, the seal);
//! `host` the host's part of a host-tools root and its fingerprint, `etc` the generated
//! `/etc` files, `template` the root-filesystem templates.

use std::path::{Path, PathBuf};

use sandbox_core::{Error, Result, SandboxSpec, TmpfsCap, TmpfsCaps, Workspace};

use crate::landlock;
use crate::proto::Op;

mod etc;
mod host;
mod template;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod wire_tests;

pub(crate) use etc::etc_files;
use etc::{write_etc, CA_BUNDLE_NAME};
pub(crate) use host::{host_fingerprint, host_ops};
pub(crate) use template::{template_fits, template_ops, template_plan};

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
        // The mount point of a workspace alias's tmpfs (see `alias_mounts`).
        ops.push(dir("/home", 0o755));
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
    alias_mounts(ops, r, p);
    Ok(())
}

/// The workspace at its alias too (`/home/NAME`, see [`SandboxSpec::workspace_alias`]): a
/// bind of the workspace mount, with its attributes. A host-tools root is read-only (and
/// shared, as a template), so its `/home` becomes a small tmpfs holding the mount point,
/// made read-only when the layout freezes ([`freeze_home`]); an own root's overlay is
/// writable and gets the mount point made in it (beneath the root: an image's links are
/// not followed out of it).
fn alias_mounts(ops: &mut Vec<Op>, r: Roots<'_>, p: &Plan<'_>) {
    let Some(alias) = &p.spec.workspace_alias else {
        return;
    };
    if !crate::own_root(p.spec) {
        ops.push(tmpfs(
            r.at("/home"),
            MS_NOSUID | MS_NODEV | MS_NOEXEC,
            "mode=0755,size=16k,nr_inodes=16",
        ));
    }
    ops.push(Op::Mkdir {
        path: r.at(alias),
        mode: 0o755,
    });
    ops.push(Op::Bind {
        src: r.at("/workspace"),
        dst: r.at(alias),
    });
    let ro = match p.spec.workspace {
        Workspace::HostDir {
            read_only: true, ..
        } => ATTR_RDONLY,
        _ => 0,
    };
    ops.push(Op::SetAttr {
        path: r.at(alias),
        set: ro | ATTR_NOSUID | ATTR_NODEV,
        clear: 0,
        recursive: true,
    });
}

/// Makes a host-tools root's `/home` tmpfs (see [`alias_mounts`]) read-only, once every
/// mount point in it is made.
fn freeze_home(ops: &mut Vec<Op>, r: Roots<'_>, spec: &SandboxSpec) {
    if spec.workspace_alias.is_some() && !crate::own_root(spec) {
        ops.push(Op::SetAttr {
            path: r.at("/home"),
            set: ATTR_RDONLY,
            clear: 0,
            recursive: false,
        });
    }
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
        let mut own: Vec<_> = etc_files(
            p.user,
            p.spec.user_name_and_home(),
            p.hostname,
            p.resolv_conf,
        )
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
        let mut files = etc_files(
            p.user,
            p.spec.user_name_and_home(),
            p.hostname,
            p.resolv_conf,
        );
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
    freeze_home(&mut ops, r, spec);
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
        v.extend(spec.workspace_alias.iter().map(|a| (a.clone(), true)));
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
