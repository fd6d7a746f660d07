//! Sandboxes from OCI images: the image pulled (or found) in the image store, its layers
//! made into a read-only ext4 disk once per image ([`ImageStore::rootfs_image`]), served by
//! the VM's virtio-blk device; the guest agent mounts it under a writable overlay in guest
//! RAM and makes it the root (`agent.root=/dev/vda` on the kernel command line).
//!
//! [`ImageStore::rootfs_image`]: sandbox_image::ImageStore::rootfs_image

use sandbox_core::ImageRef;

use super::*;

/// Snapshot metadata: the filesystem image's length in bytes.
pub(crate) const META_DISK_SIZE: &str = "image_disk_size";
/// Snapshot metadata: the filesystem image's modification time (ns since the epoch): a disk
/// rebuilt since the snapshot (pruned, then made again) has another.
pub(crate) const META_DISK_MTIME: &str = "image_disk_mtime_ns";

/// An image made ready to be a guest's root.
#[derive(Debug, Clone)]
pub(crate) struct ImageRoot {
    /// The image (its config: `Env`, `WorkingDir`, `User`; its digest).
    pub image: sandbox_image::Image,
    /// Its read-only ext4 filesystem image: the virtio-blk device's backing file. Held for
    /// the sandbox's life, so `prune` leaves it alone.
    pub disk: sandbox_image::FsImage,
    /// The uid and gid its `User` means (`(0, 0)`: root).
    pub user: (u32, u32),
}

impl ImageRoot {
    /// Finds or pulls the image and builds (once per image) its filesystem image.
    pub(crate) async fn prepare(
        backend: &MicrovmBackend,
        r: &ImageRef,
        language: Language,
    ) -> Result<ImageRoot> {
        let store = backend.image_store()?;
        let image = store.ensure(r).await.map_err(|e| e.into_core(TIER))?;
        let user = image.user_ids().map_err(|e| e.into_core(TIER))?;
        // Code strings need the image's interpreter: said before a VM is booted.
        if language != Language::Shell {
            image
                .require_interpreter(language)
                .map_err(|e| e.into_core(TIER))?;
        }
        let img = image.clone();
        let disk = tokio::task::spawn_blocking(move || store.rootfs_image(&img))
            .await
            .map_err(join_err)?
            .map_err(|e| e.into_core(TIER))?;
        Ok(ImageRoot { image, disk, user })
    }

    /// The disk's identity, recorded in snapshots: its length and modification time.
    pub(crate) fn disk_identity(&self) -> Result<(u64, u128)> {
        disk_identity(self.disk.path())
    }
}

/// A file's length and modification time in nanoseconds.
pub(crate) fn disk_identity(path: &std::path::Path) -> Result<(u64, u128)> {
    let m = std::fs::metadata(path).map_err(|e| Error::io_path("inspect", path, e))?;
    let mtime = m
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok((m.len(), mtime))
}

/// What a booted (or restored) VM is: its size, its kernel, its image.
pub(super) struct Boot {
    pub id: String,
    pub mem_size: u64,
    pub vcpus: u8,
    pub kernel_version: Option<String>,
    pub image: Option<ImageRoot>,
    /// The guest's network (policies other than deny-all).
    pub net: Option<crate::network::GuestNetwork>,
}
