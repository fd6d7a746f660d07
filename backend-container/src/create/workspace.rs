//! How a host-directory workspace reaches the init: a detached mount of it, idmapped to the
//! command user, or a fallback where the kernel cannot idmap it.

use sandbox_core::{Error, Result, SandboxSpec, Workspace};

use crate::sandbox::TIER;
use crate::spawn::{self, IdMap};
use crate::ContainerBackend;

/// How a host-directory workspace reaches the init (see `ContainerBackend::workspace_mount`).
#[derive(Debug, Default)]
pub(super) struct WorkspaceMount {
    /// The detached mount handed over, if any.
    pub(super) tree: Option<std::os::fd::OwnedFd>,
    /// The host ids the sandbox user maps to instead of its own (the fallback where the
    /// mount cannot be idmapped).
    pub(super) user_override: Option<(u32, u32)>,
    /// The workspace is writable and belongs to host root (uid or gid 0) through its
    /// idmapping: the seccomp filter gets the set-id guard (`seccomp::program_with`).
    pub(super) setid_guard: bool,
}

impl ContainerBackend {
    /// As root, how a host-directory workspace reaches the init (see "Identity" in
    /// `docs/container.md`): a detached mount of it, **idmapped** so that its owner on the host
    /// appears inside as the command user (`user`/`group` inside, host ids from `ids`), which
    /// then owns it, and what that user creates there is stored as the owner's. Where the
    /// kernel cannot idmap it (a filesystem without idmapped mounts), the fallbacks: a
    /// read-only one is mounted as it is (its owner's files show as `nobody`); a writable one
    /// of an unprivileged owner (uid and gid not 0, outside our ranges) in the host-tools view
    /// is mounted as it is with the sandbox user mapped to that owner in the sandbox's own
    /// `uid_map` (the second value); anything else is refused (`Unsupported`) rather than
    /// leave the workspace unwritable or written by a foreign uid. Rootless: nothing (the
    /// caller, root inside, owns its own directories; the classic setup binds it).
    pub(super) fn workspace_mount(
        &self,
        spec: &SandboxSpec,
        ids: &IdMap,
        (user, group): (u32, u32),
    ) -> Result<WorkspaceMount> {
        use std::os::unix::fs::MetadataExt;
        let Workspace::HostDir { path, read_only } = &spec.workspace else {
            return Ok(WorkspaceMount::default());
        };
        if ids.rootless {
            return Ok(WorkspaceMount::default());
        }
        let dir = path
            .canonicalize()
            .map_err(|e| Error::io_path("resolve the workspace directory", path, e))?;
        let md =
            std::fs::metadata(&dir).map_err(|e| Error::io_path("stat the workspace", &dir, e))?;
        let owner = (md.uid(), md.gid());
        let mapped = spawn::WorkspaceIds {
            owner,
            user: (ids.host_uid(user), ids.host_gid(group)),
        };
        let why = match spawn::workspace_tree(&dir, mapped, *read_only) {
            Ok(tree) => {
                return Ok(WorkspaceMount {
                    tree: Some(tree),
                    user_override: None,
                    setid_guard: !*read_only && (owner.0 == 0 || owner.1 == 0),
                })
            }
            Err(e) => e,
        };
        // A plain detached clone still serves a template-mode init (else the classic setup
        // binds the directory from its path).
        let plain = || spawn::detached_tree(&dir).ok();
        if *read_only {
            tracing::warn!(
                dir = %dir.display(),
                "cannot idmap the read-only workspace ({why}); it is mounted as it is (its \
                 owner's files show as nobody inside)"
            );
            return Ok(WorkspaceMount {
                tree: plain(),
                ..WorkspaceMount::default()
            });
        }
        let (lo, hi) = (
            u64::from(self.cfg.uid_base),
            u64::from(self.cfg.uid_base) + u64::from(crate::slots::SLOTS) * 65536,
        );
        let ours = |id: u32| (lo..hi).contains(&u64::from(id));
        let unprivileged = owner.0 != 0 && owner.1 != 0 && !ours(owner.0) && !ours(owner.1);
        if unprivileged && user == spawn::SANDBOX_USER && !crate::own_root(spec) {
            tracing::warn!(
                dir = %dir.display(),
                "cannot idmap the workspace ({why}); the sandbox user is mapped to its owner \
                 {}:{} instead",
                owner.0,
                owner.1
            );
            return Ok(WorkspaceMount {
                tree: plain(),
                user_override: Some(owner),
                setid_guard: false,
            });
        }
        Err(Error::unsupported(
            TIER,
            format!(
                "a writable host-directory workspace whose mount cannot be idmapped ({}, \
                 owned by {}:{}: {why}); without an idmapped mount the sandbox's user could \
                 not write it, or would write it as a foreign uid. Use a directory on a \
                 filesystem with idmapped mounts (ext4, xfs, btrfs, tmpfs), or one owned by \
                 an unprivileged user (uid and gid not 0) in the host-tools view, or mount \
                 it read-only",
                dir.display(),
                owner.0,
                owner.1
            ),
        ))
    }
}
