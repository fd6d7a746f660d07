//! The VMM's error type.

use std::io;

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
    #[error("guest memory: {what}{}", .source.as_ref().map(|e| format!(": {e}")).unwrap_or_default())]
    Memory {
        /// What was being done.
        what: String,
        /// The host's error, when a system call failed (`ENOMEM`: the host is out of memory).
        #[source]
        source: Option<std::io::Error>,
    },
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
    /// A device's saved state cannot be restored.
    #[error("snapshot is corrupt: {0}")]
    DeviceState(#[from] crate::devices::StateError),
    /// A snapshot was taken by another format version or for a differently sized VM.
    #[error("snapshot is incompatible: {0}")]
    SnapshotIncompatible(String),
    /// The seccomp filter could not be built or installed.
    #[error("seccomp: {0}")]
    Seccomp(String),
    /// A process-wide set-up (a seccomp filter, the kick signal) that failed earlier: the
    /// same error, shared by every caller.
    #[error(transparent)]
    Cached(std::sync::Arc<VmmError>),
    /// Saving a vCPU's state for a snapshot failed.
    #[error("VM is in the wrong state: saving a vCPU: {0}")]
    SaveVcpu(#[source] Box<VmmError>),
    /// A VMM thread could not be created.
    #[error("could not start a VMM thread: {0}")]
    Thread(std::io::Error),
}

impl VmmError {
    /// Wraps a KVM ioctl error.
    pub(crate) fn kvm(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmmError {
        move |source| VmmError::Kvm { op, source }
    }

    /// A guest-memory failure without a system call's error.
    pub(crate) fn memory(what: impl Into<String>) -> VmmError {
        VmmError::Memory {
            what: what.into(),
            source: None,
        }
    }

    /// A guest-memory failure caused by a system call.
    pub(crate) fn memory_io(what: impl Into<String>, source: std::io::Error) -> VmmError {
        VmmError::Memory {
            what: what.into(),
            source: Some(source),
        }
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
            VmmError::Memory { ref source, .. }
                if source.as_ref().and_then(io::Error::raw_os_error) == Some(libc::ENOMEM) =>
            {
                CoreError::ResourceExhausted {
                    what: e.to_string(),
                }
            }
            other => CoreError::backend_caused(Tier::Microvm, "VMM error", other),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn host_out_of_memory_is_resource_exhausted_by_errno() {
        let e = VmmError::memory_io(
            "mmap of 1 bytes",
            io::Error::from_raw_os_error(libc::ENOMEM),
        );
        assert!(matches!(
            CoreError::from(e),
            CoreError::ResourceExhausted { what } if what.contains("mmap of 1 bytes")
        ));
        // The same words without the errno are not mistaken for it.
        let e = VmmError::memory("mmap: Cannot allocate memory");
        let core = CoreError::from(e);
        assert!(matches!(core, CoreError::Backend { .. }), "{core:?}");
        // Other errors keep the VMM error as their cause.
        let e = VmmError::memory_io("mmap", io::Error::from_raw_os_error(libc::EINVAL));
        let core = CoreError::from(e);
        let cause = core.source().and_then(|s| s.downcast_ref::<VmmError>());
        assert!(matches!(cause, Some(VmmError::Memory { .. })), "{core:?}");
    }
}
