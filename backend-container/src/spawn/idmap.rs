//! Detached and idmapped mount trees: a host-directory workspace's (its owner mapped to the
//! command user) and the root's layers (mapped through the init's user namespace).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::zygote::hold_userns;
use super::{reap, SpawnError};

/// How a host-directory workspace's owner appears inside: the idmapping of its mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkspaceIds {
    /// The directory's owner on the host (uid, gid): the ids on disk.
    pub owner: (u32, u32),
    /// The host ids (uid, gid) of the sandbox's command user (its slot in the sandbox's
    /// range): what the owner appears as through the mount, so the command user owns it.
    pub user: (u32, u32),
}

impl WorkspaceIds {
    /// The `uid_map` and `gid_map` texts of the mount's user namespace: one id each, the
    /// owner's (on disk) to the command user's (host id). Every other id on disk is unmapped
    /// (it shows as `nobody` and cannot be written as).
    fn maps(&self) -> (String, String) {
        (
            format!("{} {} 1\n", self.owner.0, self.user.0),
            format!("{} {} 1\n", self.owner.1, self.user.1),
        )
    }
}

/// A detached, recursive clone of the mount tree at `dir` (a host-directory workspace),
/// idmapped (every mount in it) so that its owner's files appear as the sandbox's command
/// user's and what that user creates is stored as the owner's (see [`WorkspaceIds`]);
/// `nosuid`, `nodev`, and read-only if asked. Needs root and filesystems that support
/// idmapped mounts; the caller falls back (or refuses) otherwise.
pub(crate) fn workspace_tree(
    dir: &std::path::Path,
    ids: WorkspaceIds,
    read_only: bool,
) -> Result<OwnedFd, SpawnError> {
    const AT_RECURSIVE: libc::c_uint = 0x8000;
    let tree = open_tree_clone(dir, AT_RECURSIVE).map_err(SpawnError::IdmapMount)?;
    let (pid, hold) = hold_userns()?;
    let (uid_map, gid_map) = ids.maps();
    let ns = std::fs::write(format!("/proc/{pid}/uid_map"), uid_map)
        .and_then(|()| std::fs::write(format!("/proc/{pid}/gid_map"), gid_map))
        .and_then(|()| std::fs::File::open(format!("/proc/{pid}/ns/user")));
    drop(hold);
    reap(pid, true);
    let ns = ns.map_err(SpawnError::IdmapNamespace)?;
    let attr = MountAttr {
        set: MOUNT_ATTR_IDMAP
            | MOUNT_ATTR_NOSUID
            | MOUNT_ATTR_NODEV
            | if read_only { MOUNT_ATTR_RDONLY } else { 0 },
        clr: 0,
        propagation: 0,
        userns_fd: ns.as_raw_fd() as u64,
    };
    // SAFETY: mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, size) with a valid
    // struct.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint | AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(SpawnError::IdmapMount(io::Error::last_os_error()));
    }
    Ok(tree)
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// `struct mount_attr` of `mount_setattr(2)`.
#[repr(C)]
struct MountAttr {
    set: u64,
    clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `open_tree(AT_FDCWD, dir, OPEN_TREE_CLONE | O_CLOEXEC | extra)`: a detached clone of the
/// mount at `dir` (of the tree under it with `AT_RECURSIVE`), made in our current mount
/// namespace.
fn open_tree_clone(dir: &std::path::Path, extra: libc::c_uint) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: open_tree(AT_FDCWD, path, flags) with a NUL-terminated path.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c.as_ptr(),
            OPEN_TREE_CLONE | extra | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: we own the new fd.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A detached, recursive clone of the mount tree at `dir`, made in our own (current) mount
/// namespace: how a host-directory workspace reaches a template-mode init, whose namespace
/// descends from the zygote's copy (see [`fork_init`](super::fork_init)).
pub(crate) fn detached_tree(dir: &std::path::Path) -> io::Result<OwnedFd> {
    const AT_RECURSIVE: libc::c_uint = 0x8000;
    open_tree_clone(dir, AT_RECURSIVE)
}

/// A detached, read-only clone of the mount at `dir` (not recursive: a rootfs directory's
/// submounts are not part of it), idmapped through the user namespace of `pid`: a file the
/// host sees as owned by uid N appears inside that namespace as owned by N (host root's
/// files belong to the sandbox's root), without changing anything on disk. Needs root (the
/// host filesystem belongs to the initial user namespace) and a filesystem that supports
/// idmapped mounts (ext4, xfs, btrfs, tmpfs, overlayfs...).
pub(super) fn idmapped_tree(dir: &std::path::Path, pid: libc::pid_t) -> io::Result<OwnedFd> {
    let tree = open_tree_clone(dir, 0)?;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/user"))?;
    let attr = MountAttr {
        set: MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        clr: 0,
        propagation: 0,
        userns_fd: ns.as_raw_fd() as u64,
    };
    // SAFETY: mount_setattr(fd, "", AT_EMPTY_PATH, &attr, size) with a valid struct.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tree)
}
