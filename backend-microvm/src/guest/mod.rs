//! The Linux guest: the kernel (extracted from Debian's package or given by the user), the
//! initramfs our code builds (the guest agent as `/init`, busybox, the virtio modules), and
//! the cache where both are prepared.

pub mod initramfs;
pub mod install;
pub mod kernel;

/// The guest agent binary (static, built by build.rs from `guest-agent/src/main.rs`), which
/// becomes `/init` of the initramfs.
pub const AGENT_BINARY: &[u8] = include_bytes!(env!("MICROVM_GUEST_AGENT"));

/// Errors while preparing guest artifacts (kernel, initramfs, cache).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GuestError {
    /// A file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What we were doing.
        what: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel image is not one we can boot.
    #[error("invalid kernel image: {0}")]
    BadKernel(String),
    /// A Debian package is not what we expect.
    #[error("invalid package {path}: {reason}")]
    BadPackage {
        /// The package file.
        path: std::path::PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An initramfs (cpio) is malformed or lacks something required.
    #[error("invalid initramfs: {0}")]
    BadInitramfs(String),
    /// A cached artifact does not match its recorded checksum or size (partial or corrupt
    /// download/extraction).
    #[error("cached guest artifact {path} is corrupt ({reason}); install it again (backend_microvm::guest::install::install, or `agent-sandbox install microvm-guest`)")]
    Corrupt {
        /// The artifact.
        path: std::path::PathBuf,
        /// What did not match.
        reason: String,
    },
    /// The guest artifacts have not been prepared.
    #[error("guest artifacts not installed in {dir}: install them (backend_microvm::guest::install::install, or `agent-sandbox install microvm-guest`)")]
    NotInstalled {
        /// The cache directory that was looked at.
        dir: std::path::PathBuf,
    },
    /// An external command (`apt-get download`) failed.
    #[error("`{command}` failed: {reason}")]
    Command {
        /// The command line.
        command: String,
        /// Exit status and stderr.
        reason: String,
    },
}

impl GuestError {
    pub(crate) fn io(
        what: &'static str,
        path: impl Into<std::path::PathBuf>,
        source: std::io::Error,
    ) -> Self {
        GuestError::Io {
            what,
            path: path.into(),
            source,
        }
    }
}
