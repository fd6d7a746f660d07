//! The host mounts of a sandbox: the tmpfs workspace, the scratch tmpfs behind `/tmp` and
//! `/dev/shm`, the overlay view of a caller's or an image's root, and the namespace in which
//! runsc starts a host-tools root.

use super::*;

/// Mounts a tmpfs (`nosuid`, `nodev`) named `source` on `target`, capped by `cap`, with the
/// extra mount options `opts`.
fn mount_tmpfs(source: &str, target: &Path, cap: sandbox_core::TmpfsCap, opts: &str) -> Result<()> {
    use nix::mount::{mount, MsFlags};
    let data = format!("size={},nr_inodes={},{opts}", cap.bytes, cap.inodes);
    mount(
        Some(source),
        target,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(data.as_str()),
    )
    .map_err(|e| Error::io_path("mount a tmpfs on", target, e.into()))
}

impl Inner {
    /// A `runsc` command that starts this sandbox (`run`, or `restore` after a checkpoint or
    /// from a snapshot): for the host-tools root (no caller's rootfs, no image layers), in a
    /// mount namespace of its own where the host's tools are bound into the bundle's root
    /// ([`crate::runsc::in_tools_view`]). Every start of the sandbox needs the same view: a
    /// restore finds the files its processes had open where they were.
    pub(super) fn starting_command(&self) -> Result<tokio::process::Command> {
        let mut cmd = self.runsc.async_command();
        if self.lower.is_empty() {
            crate::runsc::in_tools_view(
                &mut cmd,
                &self.bundle.join("rootfs"),
                &bundle::host_tools(),
            )?;
        }
        Ok(cmd)
    }

    /// For a caller's rootfs without a `tmp` or `dev/shm` directory, or with glibc's loader
    /// (whose programs need the `statx` shim, see [`bundle::STATX_SHIM_PATH`]): a host
    /// overlay of it (`view/root` of the state directory; upper and work directories beside
    /// it) with those directories made and the shim added to its `/etc/ld.so.preload`, so
    /// `/tmp` and `/dev/shm` can be bind mounts of the scratch tmpfs (runsc would create a
    /// bind mount's point in the directory itself, which is never written). runsc's
    /// in-memory overlay still takes every write of the sandbox. `None` (and gVisor's own
    /// tmpfs there, no shim) when no view is needed or it cannot be made.
    pub(super) fn rootfs_view(&self) -> Option<PathBuf> {
        // The topmost layer first, as overlayfs wants them; an image of several layers
        // always needs the view (it is what merges them).
        if self.lower.is_empty() {
            return None;
        }
        let points = bundle::SCRATCH_MOUNTS.map(|(dst, _)| dst.trim_start_matches('/'));
        let shim =
            bundle::statx_shim().filter(|_| self.lower.iter().any(|l| bundle::needs_statx_shim(l)));
        // Always a view: the published-port relay goes into it (as proxy-held secrets'
        // certificates do, see `start`).
        let layers: Option<Vec<&str>> = self.lower.iter().rev().map(|l| l.to_str()).collect();
        let lower_s = layers?.join(":");
        let view = self.dir.join("view");
        let (upper, work, root) = (view.join("upper"), view.join("work"), view.join("root"));
        let made = (|| -> std::io::Result<()> {
            for d in [&upper, &work, &root] {
                std::fs::create_dir_all(d)?;
            }
            // `lowerdir` cannot express these characters; the state directory's path is ours.
            if self
                .lower
                .iter()
                .any(|l| l.to_string_lossy().contains([',', ':', '\\']))
            {
                return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            }
            let data = format!(
                "lowerdir={lower_s},upperdir={},workdir={}",
                upper.display(),
                work.display()
            );
            nix::mount::mount(
                Some("agent-sandbox-rootfs"),
                &root,
                Some("overlay"),
                nix::mount::MsFlags::empty(),
                Some(data.as_str()),
            )?;
            for d in points {
                let p = root.join(d);
                if !p.is_dir() {
                    std::fs::create_dir_all(&p)?;
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o1777))?;
                }
            }
            // Without it no port can be published (`publish` says so); the view itself is
            // still good.
            match bundle::add_relay(&root) {
                Ok(()) => self.relay.store(true, Ordering::SeqCst),
                Err(e) => {
                    tracing::warn!(sandbox = %self.id, error = %e, "no port relay in the rootfs view")
                }
            }
            if let Some(shim) = shim {
                // Without it `ls -l` and `stat` fail as they always did here; the view
                // itself is still good.
                if let Err(e) = bundle::add_statx_shim(&root, shim) {
                    tracing::warn!(sandbox = %self.id, error = %e, "no statx shim in the rootfs view");
                }
            }
            Ok(())
        })();
        match made {
            Ok(()) => Some(root),
            Err(e) => {
                tracing::warn!(sandbox = %self.id, error = %e, "no overlay view of the rootfs: /tmp or /dev/shm stays gVisor's tmpfs (no file-count cap), no statx shim");
                let _ = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH);
                None
            }
        }
    }

    /// Mounts the scratch tmpfs and makes its `tmp/` and `shm/` (sticky, world-writable).
    pub(super) fn mount_scratch(&self) -> Result<()> {
        let cap = crate::bundle::tmpfs_caps(&self.spec).scratch;
        std::fs::create_dir_all(&self.scratch).map_err(io("create", &self.scratch))?;
        mount_tmpfs("agent-sandbox-scratch", &self.scratch, cap, "mode=0755")?;
        for (_, sub) in bundle::SCRATCH_MOUNTS {
            let d = self.scratch.join(sub);
            std::fs::create_dir(&d).map_err(io("create", &d))?;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777))
                .map_err(io("chmod", &d))?;
        }
        Ok(())
    }

    pub(super) fn mount_workspace(&self) -> Result<()> {
        let cap = crate::bundle::tmpfs_caps(&self.spec).disk;
        let owner = format!("mode=0755,uid={},gid={}", self.who.uid, self.who.gid);
        mount_tmpfs("agent-sandbox-ws", &self.workspace, cap, &owner)
    }
}
