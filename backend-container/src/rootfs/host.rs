//! The host's part of a host-tools root: `/usr`, the merged-`/usr` links and the listed
//! `/etc` entries, read-only (small files copied), and the fingerprint of what a template
//! takes a snapshot of.

use std::path::Path;

use super::{Roots, ATTR_NODEV, ATTR_NOSUID, ATTR_RDONLY, CLASSIC};
use crate::proto::Op;

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

/// The host-dependent, spec-independent part of the classic plan: `/usr` and the
/// `bin`/`lib*` links, `/etc` with the listed host entries (generated files are added per
/// sandbox).
pub(crate) fn host_ops() -> Vec<Op> {
    host_ops_at(CLASSIC)
}

pub(super) fn host_ops_at(r: Roots<'_>) -> Vec<Op> {
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
pub(super) fn fingerprint(paths: impl Iterator<Item = String>) -> u64 {
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
