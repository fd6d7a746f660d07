//! The 8250 serial console (COM1) on vm-superio, with its output captured into a bounded
//! buffer (and optionally streamed to a callback). A guest that floods the port is capped:
//! bytes past the cap are counted and dropped, never stored.

use std::io::Write;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::vmm::bus::BusDevice;

/// A callback that sees every captured output chunk (before the cap drops anything).
pub type OutputCallback = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// The captured output of the serial port.
pub struct SerialOutput {
    data: Vec<u8>,
    cap: usize,
    dropped: u64,
    callback: Option<OutputCallback>,
}

impl std::fmt::Debug for SerialOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialOutput")
            .field("len", &self.data.len())
            .field("cap", &self.cap)
            .field("dropped", &self.dropped)
            .finish()
    }
}

impl SerialOutput {
    /// A buffer that keeps at most `cap` bytes.
    pub fn new(cap: usize, callback: Option<OutputCallback>) -> Self {
        SerialOutput {
            data: Vec::new(),
            cap,
            dropped: 0,
            callback,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        let room = self.cap.saturating_sub(self.data.len());
        let keep = bytes.len().min(room);
        if keep > 0 {
            self.data.extend_from_slice(&bytes[..keep]);
            if let Some(cb) = &self.callback {
                cb(&bytes[..keep]);
            }
        }
        self.dropped += (bytes.len() - keep) as u64;
    }

    /// The bytes kept so far.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Bytes dropped because the cap was reached.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Takes the kept bytes out (the cap then counts from zero again).
    pub fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.data)
    }
}

/// A shared handle to the captured output.
pub type SharedOutput = Arc<Mutex<SerialOutput>>;

/// `Write` adapter from vm-superio to the shared buffer.
pub struct OutputWriter(SharedOutput);

impl Write for OutputWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The serial interrupt: an irqfd when the VM has an in-kernel irqchip, nothing otherwise.
pub struct IrqTrigger(pub Option<EventFd>);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> Result<(), Self::E> {
        match &self.0 {
            Some(e) => e.write(1),
            None => Ok(()),
        }
    }
}

/// The serial registers, as saved in a snapshot.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[non_exhaustive]
pub struct SerialSnapshot {
    /// Divisor latch low.
    pub baud_divisor_low: u8,
    /// Divisor latch high.
    pub baud_divisor_high: u8,
    /// IER.
    pub interrupt_enable: u8,
    /// IIR.
    pub interrupt_identification: u8,
    /// LCR.
    pub line_control: u8,
    /// LSR.
    pub line_status: u8,
    /// MCR.
    pub modem_control: u8,
    /// MSR.
    pub modem_status: u8,
    /// Scratch register.
    pub scratch: u8,
    /// Pending input bytes.
    pub in_buffer: Vec<u8>,
}

/// The COM1 device.
pub struct SerialDevice {
    serial: Serial<IrqTrigger, NoEvents, OutputWriter>,
}

impl std::fmt::Debug for SerialDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialDevice").finish_non_exhaustive()
    }
}

impl SerialDevice {
    /// A fresh 8250 writing to `out`.
    pub fn new(irq: Option<EventFd>, out: SharedOutput) -> Self {
        SerialDevice {
            serial: Serial::new(IrqTrigger(irq), OutputWriter(out)),
        }
    }

    /// An 8250 with restored registers.
    pub fn from_snapshot(
        s: &SerialSnapshot,
        irq: Option<EventFd>,
        out: SharedOutput,
    ) -> Result<Self, super::StateError> {
        let state = SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        };
        let serial = Serial::from_state(&state, IrqTrigger(irq), NoEvents, OutputWriter(out))
            .map_err(super::StateError::Serial)?;
        Ok(SerialDevice { serial })
    }

    /// The registers for a snapshot.
    pub fn snapshot(&self) -> SerialSnapshot {
        let s = self.serial.state();
        SerialSnapshot {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    /// Queues input bytes for the guest (up to the FIFO size). Returns how many were taken.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        self.serial.enqueue_raw_bytes(bytes).unwrap_or(0)
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        // Only byte accesses are meaningful on an 8250; wider ones read the first register.
        if let (Ok(off), Some(first)) = (u8::try_from(offset), data.first_mut()) {
            if off < 8 {
                *first = self.serial.read(off);
            }
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Ok(off) = u8::try_from(offset) else {
            return;
        };
        if off >= 8 {
            return;
        }
        // `rep outsb` delivers many bytes at one offset: feed them one at a time.
        for b in data {
            if let Err(e) = self.serial.write(off, *b) {
                tracing::debug!("serial write: {e:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_capped_and_counted() {
        let out: SharedOutput = Arc::new(Mutex::new(SerialOutput::new(4, None)));
        let mut dev = SerialDevice::new(None, out.clone());
        for b in b"hello world" {
            dev.write(0, &[*b]);
        }
        let o = out.lock().unwrap();
        assert_eq!(o.data(), b"hell");
        assert_eq!(o.dropped(), 7);
    }

    #[test]
    fn snapshot_roundtrip() {
        let out: SharedOutput = Arc::new(Mutex::new(SerialOutput::new(4, None)));
        let mut dev = SerialDevice::new(None, out.clone());
        dev.write(7, &[0x42]); // scratch
        let s = dev.snapshot();
        let dev2 = SerialDevice::from_snapshot(&s, None, out).unwrap();
        assert_eq!(dev2.snapshot(), s);
    }
}
