//! What can go wrong getting an image, each variant saying what to do about it.

use std::path::PathBuf;

/// A result with [`ImageError`].
pub type Result<T, E = ImageError> = std::result::Result<T, E>;

/// Why an image could not be pulled, verified, cached or unpacked.
///
/// Every failure leaves the cache as it was: partial downloads and unpacks live under the
/// store's `tmp/` and are never used (they are removed by the next operation that takes the
/// lock, or by [`ImageStore::prune`](crate::ImageStore::prune)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// The registry has no such repository, tag or digest (HTTP 404 / `MANIFEST_UNKNOWN`).
    #[error("image `{reference}` not found: {detail}; check the repository name and tag")]
    NotFound {
        /// The reference as normalised.
        reference: String,
        /// What the registry said.
        detail: String,
    },

    /// The registry refused our credentials, or wants some (HTTP 401/403).
    #[error(
        "registry refused access to `{reference}`: {detail}; log in with `docker login` (read from \
         ~/.docker/config.json or $DOCKER_CONFIG) or pass credentials to ImageStore's builder"
    )]
    Unauthorized {
        /// The reference as normalised.
        reference: String,
        /// What the registry said.
        detail: String,
    },

    /// The registry could not be reached, stalled past the timeout, or answered nonsense.
    #[error("registry error for `{reference}`: {detail}")]
    Registry {
        /// The reference as normalised.
        reference: String,
        /// What happened.
        detail: String,
    },

    /// Content did not match its digest (a corrupt, truncated or substituted blob). Nothing
    /// of it was kept.
    #[error("{what} does not match its digest: expected {expected}, got {actual}")]
    DigestMismatch {
        /// Which content (a layer, the config, a manifest).
        what: String,
        /// The digest the manifest (or reference) promised.
        expected: String,
        /// The digest of what arrived.
        actual: String,
    },

    /// A layer tries to write outside itself or holds something we refuse to unpack. The
    /// layer was discarded; the host was not written outside the cache.
    #[error("refusing layer {layer}: entry `{entry}` {why}")]
    MaliciousLayer {
        /// The layer's digest.
        layer: String,
        /// The offending tar entry's path.
        entry: String,
        /// What is wrong with it.
        why: String,
    },

    /// The image, manifest or layer format is one we do not handle.
    #[error("unsupported image content: {0}")]
    Unsupported(String),

    /// The image source (an OCI layout, a `docker save` tarball) is malformed.
    #[error("malformed image source {source_name}: {detail}")]
    Malformed {
        /// The source.
        source_name: String,
        /// What is wrong.
        detail: String,
    },

    /// Storing this would take the cache past its size cap.
    #[error(
        "image cache full: {needed} more bytes would pass the cap of {cap} bytes ({used} used); \
         run `agent-sandbox image prune`, remove images with `agent-sandbox image rm`, or raise \
         the cap (ImageStore builder `max_bytes`, or AGENT_SANDBOX_IMAGE_CACHE_MAX)"
    )]
    CacheFull {
        /// Bytes the operation needed at least.
        needed: u64,
        /// The cap.
        cap: u64,
        /// Bytes in use before it.
        used: u64,
    },

    /// Code in a language was asked of an image without its interpreter.
    #[error(
        "image `{image}` has no `{program}` on its PATH ({path}): code strings run the image's \
         own interpreter; use an image that has it, or run commands as argv"
    )]
    MissingProgram {
        /// The image reference.
        image: String,
        /// The interpreter looked for.
        program: String,
        /// The `PATH` searched.
        path: String,
    },

    /// `mkfs.ext4` (e2fsprogs), which builds filesystem images for the microVM tier
    /// ([`ImageStore::rootfs_image`](crate::ImageStore::rootfs_image)), is not installed.
    #[error(
        "cannot build a filesystem image: `{program}` was not found; install e2fsprogs \
         (`apt install e2fsprogs`, `dnf install e2fsprogs`) or name it with StoreBuilder::mkfs_ext4"
    )]
    MissingMkfs {
        /// What was looked for (a path, or `mkfs.ext4` searched in `/usr/sbin`, `/sbin` and
        /// `PATH`).
        program: String,
    },

    /// `mkfs.ext4` failed to build an image's filesystem image (or could not be run).
    /// Nothing was kept.
    #[error(
        "building the filesystem image of {image} failed: {detail}{}",
        stderr_tail(stderr)
    )]
    FsImage {
        /// The image's manifest digest.
        image: String,
        /// What failed.
        detail: String,
        /// What `mkfs.ext4` wrote on its standard error (empty when it did not run).
        stderr: String,
    },

    /// The image is not in the cache (for operations that never pull).
    #[error(
        "image `{0}` is not in the cache (`agent-sandbox image ls` lists what is; \
         `agent-sandbox image pull {0}` fetches it)"
    )]
    NotCached(String),

    /// A file-system operation on the cache (or a source file) failed.
    #[error("{action} {}: {source}{}", path.display(), disk_hint(source))]
    Io {
        /// What we were doing.
        action: &'static str,
        /// On which path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

fn stderr_tail(stderr: &str) -> String {
    let s = stderr.trim();
    if s.is_empty() {
        String::new()
    } else {
        format!(": {s}")
    }
}

fn disk_hint(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
            "; the disk holding the image cache is full: free space or run `agent-sandbox image prune`"
        }
        _ => "",
    }
}

impl ImageError {
    /// An I/O error while `action` on `path`.
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        ImageError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// A malformed-source error.
    pub(crate) fn malformed(source: impl std::fmt::Display, detail: impl Into<String>) -> Self {
        ImageError::Malformed {
            source_name: source.to_string(),
            detail: detail.into(),
        }
    }
}

impl ImageError {
    /// Into the shared error type, for `tier`: a reference that does not exist, cannot be
    /// read or is refused is an invalid spec (`image`); everything else is a backend error
    /// carrying this one as its source.
    pub fn into_core(self, tier: sandbox_core::Tier) -> sandbox_core::Error {
        match &self {
            ImageError::NotFound { .. }
            | ImageError::Unauthorized { .. }
            | ImageError::Malformed { .. }
            | ImageError::MaliciousLayer { .. }
            | ImageError::DigestMismatch { .. }
            | ImageError::NotCached(_)
            | ImageError::MissingProgram { .. }
            | ImageError::Unsupported(_) => sandbox_core::Error::invalid("image", self.to_string()),
            _ => sandbox_core::Error::backend_caused(tier, "preparing the image", self),
        }
    }
}
