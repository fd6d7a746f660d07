//! Virtio: the MMIO transport, split virtqueues, the console, the read-only block device and
//! the network card.

pub mod blk;
pub mod console;
pub mod mmio;
pub mod net;
pub mod queue;
