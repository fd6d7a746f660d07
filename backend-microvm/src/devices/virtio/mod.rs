//! Virtio: the MMIO transport, split virtqueues and the console device.

pub mod console;
pub mod mmio;
pub mod queue;
