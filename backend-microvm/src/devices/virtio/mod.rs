//! Virtio: the MMIO transport, split virtqueues, the console and the read-only block device.

pub mod blk;
pub mod console;
pub mod mmio;
pub mod queue;
