//! The virtio-mmio transport, version 2 ("modern"), one 4 KiB register window per device.
//!
//! Register accesses come from a vCPU thread; queue processing happens on the VM's I/O
//! thread (see [`MmioTransport::process`]). Both hold the transport's mutex, so the I/O
//! thread only touches guest memory while the lock is held (a snapshot takes the lock).

use std::os::fd::RawFd;

use crate::devices::StateError;
use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::queue::{Queue, QueueError};
use crate::vmm::bus::BusDevice;

/// `virt` in little endian.
const MAGIC: u32 = 0x7472_6976;
const VENDOR_ID: u32 = 0x554d_4551; // "QEMU"-style vendor id, widely accepted

/// VIRTIO_F_VERSION_1.
pub const F_VERSION_1: u64 = 1 << 32;

/// Device status bits.
pub mod status {
    /// ACKNOWLEDGE.
    pub const ACKNOWLEDGE: u32 = 1;
    /// DRIVER.
    pub const DRIVER: u32 = 2;
    /// DRIVER_OK.
    pub const DRIVER_OK: u32 = 4;
    /// FEATURES_OK.
    pub const FEATURES_OK: u32 = 8;
    /// DEVICE_NEEDS_RESET.
    pub const NEEDS_RESET: u32 = 64;
    /// FAILED.
    pub const FAILED: u32 = 128;
}

/// InterruptStatus bits.
const INT_USED: u32 = 1;
const INT_CONFIG: u32 = 2;

/// What a device model implements behind the transport.
pub trait VirtioDevice: Send {
    /// The virtio device ID (2 = block, 3 = console).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue (the queue count is this slice's length).
    fn queue_max_sizes(&self) -> Vec<u16>;
    /// Offered feature bits (the transport adds VIRTIO_F_VERSION_1).
    fn features(&self) -> u64;
    /// Reads device config space.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// The driver reset the device: drop in-flight state.
    fn reset(&mut self);
    /// Does all the work possible right now without blocking. Returns true when used
    /// buffers were added (the driver should be interrupted).
    fn process(&mut self, queues: &mut [Queue], mem: &GuestMemoryMmap) -> Result<bool, QueueError>;
    /// A host descriptor the I/O thread should poll, with read/write interest.
    fn host_interest(&self) -> Option<(RawFd, bool, bool)>;
    /// Device-specific state for a snapshot.
    fn save(&self) -> serde_json::Value;
    /// Restores device-specific state.
    fn restore(&mut self, v: &serde_json::Value) -> Result<(), StateError>;
}

/// Transport registers and queues, as saved in a snapshot.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportState {
    /// Device status register.
    pub status: u32,
    /// DeviceFeaturesSel.
    pub device_features_sel: u32,
    /// DriverFeaturesSel.
    pub driver_features_sel: u32,
    /// Features the driver accepted.
    pub driver_features: u64,
    /// QueueSel.
    pub queue_sel: u32,
    /// InterruptStatus.
    pub interrupt_status: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// The queues.
    pub queues: Vec<Queue>,
    /// Why the device is broken (NEEDS_RESET), if it is.
    pub broken: Option<String>,
    /// Device-specific state.
    pub device: serde_json::Value,
    /// The virtio device type (set by [`MmioTransport::save`]; a restore into another type
    /// of device is refused). Snapshots from before it was recorded held only consoles.
    #[serde(default = "legacy_device_type")]
    pub device_type: u32,
}

/// The device type of a snapshot that does not record one: the console, the only virtio
/// device there was.
fn legacy_device_type() -> u32 {
    super::console::DEVICE_ID_CONSOLE
}

/// A virtio-mmio device: registers + queues + a device model.
pub struct MmioTransport {
    st: TransportState,
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    irq: Option<EventFd>,
    notify: EventFd,
    errors: u64,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device_type", &self.device.device_type())
            .field("state", &self.st.status)
            .field("broken", &self.st.broken)
            .finish()
    }
}

impl MmioTransport {
    /// Wraps `device`. `irq` is the irqfd (if the VM has an irqchip); `notify` is signalled
    /// when the driver kicks a queue (the I/O thread polls it).
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
        irq: Option<EventFd>,
        notify: EventFd,
    ) -> Self {
        let queues = device
            .queue_max_sizes()
            .iter()
            .enumerate()
            .map(|(i, m)| Queue::new(i as u16, *m))
            .collect();
        MmioTransport {
            st: TransportState {
                queues,
                ..Default::default()
            },
            device,
            mem,
            irq,
            notify,
            errors: 0,
        }
    }

    /// The notify eventfd the I/O thread polls.
    pub fn notify_fd(&self) -> &EventFd {
        &self.notify
    }

    /// The device's host descriptor interest (see [`VirtioDevice::host_interest`]).
    pub fn host_interest(&self) -> Option<(RawFd, bool, bool)> {
        if self.st.broken.is_some() || self.st.status & status::DRIVER_OK == 0 {
            return None;
        }
        self.device.host_interest()
    }

    /// Why the device is broken, if it is.
    pub fn broken(&self) -> Option<&str> {
        self.st.broken.as_deref()
    }

    /// How many times the guest broke the device.
    pub fn error_count(&self) -> u64 {
        self.errors
    }

    /// The status register.
    pub fn status(&self) -> u32 {
        self.st.status
    }

    fn interrupt(&mut self, bits: u32) {
        self.st.interrupt_status |= bits;
        if let Some(e) = &self.irq {
            if let Err(err) = e.write(1) {
                tracing::debug!("virtio irq: {err}");
            }
        }
    }

    fn mark_broken(&mut self, why: String) {
        tracing::debug!("virtio device broken by the guest: {why}");
        self.errors += 1;
        self.st.broken = Some(why);
        self.st.status |= status::NEEDS_RESET;
        self.interrupt(INT_CONFIG);
    }

    fn reset(&mut self) {
        let queues = self
            .st
            .queues
            .iter()
            .map(|q| Queue::new(q.index, q.max_size))
            .collect();
        self.st = TransportState {
            queues,
            config_generation: self.st.config_generation,
            ..Default::default()
        };
        self.device.reset();
    }

    /// Runs the device's queue processing (I/O thread). Guest violations break the device.
    pub fn process(&mut self) {
        if self.st.broken.is_some() || self.st.status & status::DRIVER_OK == 0 {
            return;
        }
        let mut queues = std::mem::take(&mut self.st.queues);
        let r = self.device.process(&mut queues, &self.mem);
        self.st.queues = queues;
        match r {
            Ok(true) => self.interrupt(INT_USED),
            Ok(false) => {}
            Err(e) => self.mark_broken(e.to_string()),
        }
    }

    /// The state for a snapshot.
    pub fn save(&self) -> TransportState {
        let mut s = self.st.clone();
        s.device = self.device.save();
        s.device_type = self.device.device_type();
        s
    }

    /// Restores registers, queues and device state. The state must come from a device of
    /// the same type.
    pub fn restore(&mut self, s: &TransportState) -> Result<(), StateError> {
        if s.device_type != self.device.device_type() {
            return Err(StateError::Incompatible {
                device: "virtio",
                what: format!(
                    "saved from device type {}, restored into type {}",
                    s.device_type,
                    self.device.device_type()
                ),
            });
        }
        if s.queues.len() != self.st.queues.len() {
            return Err(StateError::QueueCount {
                device: self.st.queues.len(),
                snapshot: s.queues.len(),
            });
        }
        self.device.restore(&s.device)?;
        self.st = s.clone();
        self.st.device = serde_json::Value::Null;
        self.st.device_type = 0;
        Ok(())
    }

    fn selected(&mut self) -> Option<&mut Queue> {
        let i = usize::try_from(self.st.queue_sel).ok()?;
        self.st.queues.get_mut(i)
    }

    fn read_reg(&mut self, offset: u64) -> u32 {
        let features = self.device.features() | F_VERSION_1;
        match offset {
            0x000 => MAGIC,
            0x004 => 2,
            0x008 => self.device.device_type(),
            0x00c => VENDOR_ID,
            0x010 => match self.st.device_features_sel {
                0 => features as u32,
                1 => (features >> 32) as u32,
                _ => 0,
            },
            0x034 => self.selected().map_or(0, |q| u32::from(q.max_size)),
            0x044 => self.selected().map_or(0, |q| u32::from(q.ready)),
            0x060 => self.st.interrupt_status,
            0x070 => self.st.status,
            0x0fc => self.st.config_generation,
            _ => 0,
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
        match offset {
            0x014 => self.st.device_features_sel = v,
            0x020 => match self.st.driver_features_sel {
                0 => {
                    self.st.driver_features =
                        (self.st.driver_features & !0xffff_ffff) | u64::from(v)
                }
                1 => {
                    self.st.driver_features =
                        (self.st.driver_features & 0xffff_ffff) | (u64::from(v) << 32)
                }
                _ => {}
            },
            0x024 => self.st.driver_features_sel = v,
            0x030 => self.st.queue_sel = v,
            0x038 => {
                if let Some(q) = self.selected() {
                    q.size = v.min(u32::from(u16::MAX)) as u16;
                }
            }
            0x044 => {
                let mem = self.mem.clone();
                let res = match self.selected() {
                    Some(q) if v == 1 => q.validate(&mem).map(|()| q.ready = true),
                    Some(q) => {
                        q.ready = false;
                        Ok(())
                    }
                    None => Ok(()),
                };
                if let Err(e) = res {
                    self.mark_broken(e.to_string());
                }
            }
            0x050 => {
                if let Err(e) = self.notify.write(1) {
                    tracing::debug!("virtio notify: {e}");
                }
            }
            0x064 => self.st.interrupt_status &= !v,
            0x070 => self.write_status(v),
            0x080 => set_lo(self.selected().map(|q| &mut q.desc_table), v),
            0x084 => set_hi(self.selected().map(|q| &mut q.desc_table), v),
            0x090 => set_lo(self.selected().map(|q| &mut q.avail_ring), v),
            0x094 => set_hi(self.selected().map(|q| &mut q.avail_ring), v),
            0x0a0 => set_lo(self.selected().map(|q| &mut q.used_ring), v),
            0x0a4 => set_hi(self.selected().map(|q| &mut q.used_ring), v),
            _ => {}
        }
    }

    fn write_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        let mut v = v;
        // FEATURES_OK only sticks for an acceptable feature set.
        if v & status::FEATURES_OK != 0 && self.st.status & status::FEATURES_OK == 0 {
            let offered = self.device.features() | F_VERSION_1;
            let f = self.st.driver_features;
            if f & !offered != 0 || f & F_VERSION_1 == 0 {
                v &= !status::FEATURES_OK;
            }
        }
        let newly_ok = v & status::DRIVER_OK != 0 && self.st.status & status::DRIVER_OK == 0;
        // NEEDS_RESET is the device's bit: the driver cannot set or clear it.
        self.st.status = (v & !status::NEEDS_RESET) | (self.st.status & status::NEEDS_RESET);
        if newly_ok {
            let mem = self.mem.clone();
            let bad = self
                .st
                .queues
                .iter()
                .filter(|q| q.ready)
                .find_map(|q| q.validate(&mem).err());
            if let Some(e) = bad {
                self.mark_broken(e.to_string());
            } else if let Err(e) = self.notify.write(1) {
                tracing::debug!("virtio notify: {e}");
            }
        }
    }
}

fn set_lo(field: Option<&mut u64>, v: u32) {
    if let Some(f) = field {
        *f = (*f & !0xffff_ffff) | u64::from(v);
    }
}

fn set_hi(field: Option<&mut u64>, v: u32) {
    if let Some(f) = field {
        *f = (*f & 0xffff_ffff) | (u64::from(v) << 32);
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset >= 0x100 {
            self.device.read_config(offset - 0x100, data);
            return;
        }
        // Registers are 32-bit; other widths read as zero.
        if data.len() == 4 && offset.is_multiple_of(4) {
            data.copy_from_slice(&self.read_reg(offset).to_le_bytes());
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= 0x100 {
            return; // config space is read-only for the console and the block device
        }
        if let (Ok(b), true) = (<[u8; 4]>::try_from(data), offset.is_multiple_of(4)) {
            self.write_reg(offset, u32::from_le_bytes(b));
        }
    }
}
