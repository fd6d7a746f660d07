//! virtio-console with one port. The host side is one end of a Unix socketpair: bytes the
//! guest transmits are written to it, bytes read from it are delivered into the guest's
//! receive buffers. The socket is non-blocking; host-side back-pressure leaves buffers in
//! the guest's ring (bounded host buffering), it never blocks a VMM thread.

use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;

use super::mmio::VirtioDevice;
use super::queue::{Queue, QueueError};
use crate::devices::StateError;

/// Virtio device ID of a console.
pub const DEVICE_ID_CONSOLE: u32 = 3;
/// Queue size offered to the driver.
pub const QUEUE_SIZE: u16 = 256;
/// At most this many guest-transmitted bytes are buffered on the host side.
const TX_BUFFER: usize = 256 * 1024;
/// At most this many host bytes are read ahead of the guest's receive buffers.
const RX_BUFFER: usize = 64 * 1024;

const RXQ: usize = 0;
const TXQ: usize = 1;

/// Saved console state: bytes in flight on the host side.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct ConsoleState {
    tx_pending: Vec<u8>,
    rx_pending: Vec<u8>,
}

/// The console device model.
#[derive(Debug)]
pub struct Console {
    sock: UnixStream,
    tx_pending: Vec<u8>,
    rx_pending: Vec<u8>,
    host_eof: bool,
    host_gone: bool,
}

impl Console {
    /// A console whose host side is `sock` (set non-blocking here).
    pub fn new(sock: UnixStream) -> std::io::Result<Self> {
        sock.set_nonblocking(true)?;
        Ok(Console {
            sock,
            tx_pending: Vec::new(),
            rx_pending: Vec::new(),
            host_eof: false,
            host_gone: false,
        })
    }

    fn flush_tx(&mut self) {
        while !self.tx_pending.is_empty() && !self.host_gone {
            // SAFETY: send on a socket we own, from a live buffer of the given length;
            // MSG_NOSIGNAL so a closed peer is EPIPE, not SIGPIPE.
            let n = unsafe {
                libc::send(
                    self.sock.as_raw_fd(),
                    self.tx_pending.as_ptr().cast(),
                    self.tx_pending.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    std::io::ErrorKind::WouldBlock => return,
                    std::io::ErrorKind::Interrupted => continue,
                    _ => {
                        // Nobody listens: drop what the guest sends from now on.
                        self.host_gone = true;
                        self.tx_pending.clear();
                        return;
                    }
                }
            }
            self.tx_pending.drain(..n as usize);
        }
        if self.host_gone {
            self.tx_pending.clear();
        }
    }

    fn fill_rx(&mut self) {
        if !self.rx_pending.is_empty() || self.host_eof {
            return;
        }
        let mut buf = vec![0u8; RX_BUFFER];
        loop {
            match self.sock.read(&mut buf) {
                Ok(0) => {
                    self.host_eof = true;
                    return;
                }
                Ok(n) => {
                    self.rx_pending.extend_from_slice(&buf[..n]);
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(_) => {
                    self.host_eof = true;
                    return;
                }
            }
        }
    }
}

impl VirtioDevice for Console {
    fn device_type(&self) -> u32 {
        DEVICE_ID_CONSOLE
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE, QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        0
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // cols: u16, rows: u16, max_nr_ports: u32, emerg_wr: u32.
        let mut cfg = [0u8; 12];
        cfg[4..8].copy_from_slice(&1u32.to_le_bytes());
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| cfg.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    fn reset(&mut self) {
        self.tx_pending.clear();
        self.rx_pending.clear();
    }

    fn process(&mut self, queues: &mut [Queue], mem: &GuestMemoryMmap) -> Result<bool, QueueError> {
        let mut used = false;
        // Guest -> host.
        if let Some(txq) = queues.get_mut(TXQ) {
            self.flush_tx();
            while self.tx_pending.len() < TX_BUFFER {
                let Some(chain) = txq.pop(mem)? else { break };
                let data = txq.read_chain(mem, &chain, TX_BUFFER)?;
                if !self.host_gone {
                    self.tx_pending.extend_from_slice(&data);
                }
                txq.add_used(mem, chain.head, 0)?;
                used = true;
                self.flush_tx();
            }
        }
        // Host -> guest.
        if let Some(rxq) = queues.get_mut(RXQ) {
            loop {
                self.fill_rx();
                if self.rx_pending.is_empty() {
                    break;
                }
                let Some(chain) = rxq.pop(mem)? else { break };
                if Queue::writable_len(&chain) == 0 {
                    return Err(QueueError {
                        queue: RXQ as u16,
                        what: "receive buffer has no writable space".into(),
                    });
                }
                let n = rxq.write_chain(mem, &chain, &self.rx_pending)?;
                self.rx_pending.drain(..n);
                rxq.add_used(mem, chain.head, n as u32)?;
                used = true;
            }
        }
        Ok(used)
    }

    fn host_interest(&self) -> Option<(RawFd, bool, bool)> {
        let read = self.rx_pending.is_empty() && !self.host_eof;
        let write = !self.tx_pending.is_empty() && !self.host_gone;
        Some((self.sock.as_raw_fd(), read, write))
    }

    fn save(&self) -> serde_json::Value {
        serde_json::to_value(ConsoleState {
            tx_pending: self.tx_pending.clone(),
            rx_pending: self.rx_pending.clone(),
        })
        .unwrap_or(serde_json::Value::Null)
    }

    fn restore(&mut self, v: &serde_json::Value) -> Result<(), StateError> {
        if v.is_null() {
            return Ok(());
        }
        let s: ConsoleState =
            serde_json::from_value(v.clone()).map_err(|source| StateError::Malformed {
                device: "console",
                source,
            })?;
        self.tx_pending = s.tx_pending;
        self.rx_pending = s.rx_pending;
        Ok(())
    }
}
