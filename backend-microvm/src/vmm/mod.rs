//! The virtual machine monitor: KVM VM and vCPUs, guest memory, CPU setup, the I/O bus,
//! the run loop, snapshot/restore.
//!
//! Everything the guest controls (exit data, MMIO/PIO offsets and sizes, virtqueues) is
//! handled without panicking and with checked arithmetic; a misbehaving guest ends as a
//! [`VmExit`] for that VM only.

pub mod bus;
pub mod cpu;
pub mod error;
pub mod loader;
pub mod memory;
pub mod vcpu;
#[allow(clippy::module_inception)]
pub mod vm;

pub use cpu::CpuMode;
pub use error::{Result, VmmError};
pub use vcpu::{VcpuState, VmExit};
pub use vm::{BlockConfig, Entry, NetConfig, SnapshotInfo, VirtioMmioInfo, Vm, VmConfig, VmPool};
