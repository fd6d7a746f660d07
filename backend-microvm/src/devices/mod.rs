//! Device models: the serial console and virtio over MMIO.

pub mod serial;
pub mod virtio;
