//! The VMM's error type.

use sandbox_core::{Error as CoreError, Tier};

/// Result alias for the VMM.
pub type Result<T, E = VmmError> = std::result::Result<T, E>;

/// Everything that can go wrong while creating, running, snapshotting or restoring a VM.
///
/// A guest's own misbehaviour (triple fault, spinning, flooding, garbage in a virtqueue) is
/// never an error of this type: it ends as a [`crate::vmm::VmExit`] or a device marked broken.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VmmError {
    /// `/dev/kvm` could not be opened or used.
    #[error("KVM is unavailable: {reason}; fix: {fix}")]
    KvmUnavailable {
        /// What failed.
        reason: String,
        /// What the user can do about it.
        fix: String,
    },
    /// A KVM ioctl failed.
    #[error("KVM {op} failed: {source}")]
    Kvm {
        /// The operation (ioctl) that failed.
        op: &'static str,
        /// The errno.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The VM configuration is invalid.
    #[error("invalid VM configuration: {0}")]
    InvalidConfig(String),
    /// Guest memory could not be created, mapped or accessed.
    #[error("guest memory: {0}")]
    Memory(String),
    /// A guest image (ELF) is malformed or does not fit guest memory.
    #[error("invalid guest image: {0}")]
    InvalidImage(String),
    /// A host I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The operation does not fit the VM's current state (e.g. starting a VM twice).
    #[error("VM is in the wrong state: {0}")]
    State(String),
    /// The VM has ended; the operation needs a live VM.
    #[error("VM has exited ({0})")]
    Exited(String),
    /// A snapshot is malformed.
    #[error("snapshot is corrupt: {0}")]
    SnapshotCorrupt(String),
    /// A snapshot was taken by another format version or for a differently sized VM.
    #[error("snapshot is incompatible: {0}")]
    SnapshotIncompatible(String),
    /// The seccomp filter could not be built or installed.
    #[error("seccomp: {0}")]
    Seccomp(String),
    /// A VMM thread could not be created.
    #[error("could not start a VMM thread: {0}")]
    Thread(std::io::Error),
}

impl VmmError {
    /// Wraps a KVM ioctl error.
    pub(crate) fn kvm(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmmError {
        move |source| VmmError::Kvm { op, source }
    }

    /// Wraps a host I/O error with context.
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmmError {
        let context = context.into();
        move |source| VmmError::Io { context, source }
    }
}

impl From<VmmError> for CoreError {
    fn from(e: VmmError) -> Self {
        match e {
            VmmError::KvmUnavailable { reason, fix } => CoreError::Unavailable {
                tier: Tier::Microvm,
                reason,
                fix,
            },
            VmmError::InvalidConfig(reason) => CoreError::InvalidSpec {
                field: "microvm".into(),
                reason,
            },
            VmmError::Io { context, source } => CoreError::Io { context, source },
            VmmError::Memory(ref m) if m.contains("Cannot allocate memory") => {
                CoreError::ResourceExhausted {
                    what: format!("guest memory: {m}"),
                }
            }
            other => CoreError::Backend {
                tier: Tier::Microvm,
                message: other.to_string(),
            },
        }
    }
}
