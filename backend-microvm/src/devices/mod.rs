//! Device models: the serial console and virtio over MMIO.

pub mod serial;
pub mod virtio;

/// A device's saved state that cannot be restored (a snapshot from elsewhere, or damaged).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// The serial port refused its registers (e.g. an input buffer longer than its FIFO).
    #[error("serial state: {0}")]
    Serial(#[source] vm_superio::serial::Error<std::io::Error>),
    /// A device's state does not parse.
    #[error("{device} state: {source}")]
    Malformed {
        /// The device.
        device: &'static str,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
    /// The saved state is well-formed but does not fit the device it is restored into (another
    /// device type, or a block device of another capacity).
    #[error("{device} state does not fit the device: {what}")]
    Incompatible {
        /// The device.
        device: &'static str,
        /// What differs.
        what: String,
    },
    /// The snapshot has another number of queues than the device.
    #[error("virtio device has {device} queues, the snapshot {snapshot}")]
    QueueCount {
        /// Queues of the device.
        device: usize,
        /// Queues in the snapshot.
        snapshot: usize,
    },
}
