//! virtio-net with one receive/transmit queue pair, no offloads. The host side is a
//! descriptor that carries one Ethernet frame per `read`/`write`: a TAP device (see
//! [`open_tap`], [`open_tap_in`]; opened with `IFF_NO_PI` and without `IFF_VNET_HDR`, so the
//! device adds and strips the virtio header itself) or, in tests, one end of a
//! `SOCK_SEQPACKET` socketpair.
//!
//! Everything the guest hands us is bounded and never blocks the I/O thread:
//!
//! - **Transmit**: a chain shorter than the virtio header, or whose frame is longer than
//!   [`MAX_FRAME`], is dropped and counted (its buffers are returned, so a driver that sends
//!   garbage cannot stall its own queue). A frame the host side cannot take yet (`EAGAIN`)
//!   is kept — at most one — and the queue is not read further until the descriptor is
//!   writable again: back-pressure to the guest, no host buffering.
//! - **Receive**: at most one frame is read ahead of the guest's buffers; while the guest
//!   has none posted the host descriptor is not read, so a flood waits in the TAP's own
//!   bounded queue (which drops when full), not in our memory. A frame larger than the
//!   buffer the guest posted is dropped, counted, and the buffer returned with length 0 (a
//!   "short packet" to the driver). At most [`RX_BUDGET`] frames are moved per pass so one
//!   busy device cannot starve the others.
//! - **A host side that disappears** (the TAP deleted, the socket's peer closed): frames
//!   the guest sends are dropped and counted, nothing is read any more, and the VM keeps
//!   running; one warning is logged.
//!
//! Frames in flight are not part of a snapshot (a restored guest sees them as lost, as a
//! network may lose any frame).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vm_memory::GuestMemoryMmap;

use super::mmio::VirtioDevice;
use super::queue::{Queue, QueueError};
use crate::devices::StateError;

/// Virtio device ID of a network card.
pub const DEVICE_ID_NET: u32 = 1;
/// Queue size offered to the driver.
pub const QUEUE_SIZE: u16 = 256;
/// `VIRTIO_NET_F_MAC`: the device has a MAC address in its config space.
pub const F_MAC: u64 = 1 << 5;
/// Size of `struct virtio_net_hdr_v1` (with `num_buffers`, always present in virtio 1.0).
pub const HEADER_LEN: usize = 12;
/// The longest frame (without the virtio header) either side may pass: no offloads are
/// negotiated, so anything past a jumbo frame is a driver or host bug.
pub const MAX_FRAME: usize = 65_550;
/// Frames moved to the guest per pass of the I/O thread.
pub const RX_BUDGET: usize = 64;

const RXQ: usize = 0;
const TXQ: usize = 1;

/// Frame counters of one device, shared with whoever holds [`Net::counters`].
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct NetCounters {
    /// Frames delivered into the guest.
    pub rx_frames: AtomicU64,
    /// Frames from the host dropped: larger than the guest's buffer.
    pub rx_dropped: AtomicU64,
    /// Frames the guest sent that reached the host side.
    pub tx_frames: AtomicU64,
    /// Frames the guest sent that were dropped: malformed, too long, refused by the host
    /// side, or sent after it disappeared.
    pub tx_dropped: AtomicU64,
}

impl NetCounters {
    /// A plain copy of the counters: `(rx_frames, rx_dropped, tx_frames, tx_dropped)`.
    pub fn snapshot(&self) -> (u64, u64, u64, u64) {
        (
            self.rx_frames.load(Ordering::Relaxed),
            self.rx_dropped.load(Ordering::Relaxed),
            self.tx_frames.load(Ordering::Relaxed),
            self.tx_dropped.load(Ordering::Relaxed),
        )
    }
}

/// The network device model.
#[derive(Debug)]
pub struct Net {
    fd: OwnedFd,
    mac: [u8; 6],
    /// A frame the guest sent that the host side could not take yet.
    tx_pending: Option<Vec<u8>>,
    /// A frame read from the host side, waiting for a guest buffer (header space in front).
    rx_pending: Option<Vec<u8>>,
    /// The host side is gone: nothing is read from or written to it any more.
    host_gone: bool,
    counters: Arc<NetCounters>,
}

impl Net {
    /// A device with MAC `mac` whose host side is `fd` (set non-blocking here).
    pub fn new(fd: OwnedFd, mac: [u8; 6]) -> io::Result<Self> {
        set_nonblocking(fd.as_raw_fd())?;
        Ok(Net {
            fd,
            mac,
            tx_pending: None,
            rx_pending: None,
            host_gone: false,
            counters: Arc::default(),
        })
    }

    /// The device's frame counters (live).
    pub fn counters(&self) -> Arc<NetCounters> {
        Arc::clone(&self.counters)
    }

    fn gone(&mut self, why: &io::Error) {
        if !self.host_gone {
            tracing::warn!(error = %why, "the network device's host side is gone; frames are dropped from now on");
        }
        self.host_gone = true;
        if self.tx_pending.take().is_some() {
            self.counters.tx_dropped.fetch_add(1, Ordering::Relaxed);
        }
        self.rx_pending = None;
    }

    /// Writes the pending transmit frame. `false`: the host side cannot take it yet.
    fn flush_tx(&mut self) -> bool {
        let Some(frame) = self.tx_pending.as_ref() else {
            return true;
        };
        if self.host_gone {
            self.tx_pending = None;
            self.counters.tx_dropped.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        loop {
            // SAFETY: write from a live buffer of the given length to a descriptor we own.
            let n = unsafe { libc::write(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
            if n >= 0 {
                self.tx_pending = None;
                self.counters.tx_frames.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) => return false,
                // The TAP is down or the frame was refused: this frame is lost.
                Some(libc::EIO) | Some(libc::EINVAL) | Some(libc::EMSGSIZE) => {
                    self.tx_pending = None;
                    self.counters.tx_dropped.fetch_add(1, Ordering::Relaxed);
                    return true;
                }
                _ => {
                    self.gone(&e);
                    return true;
                }
            }
        }
    }

    /// Reads one frame from the host side into `rx_pending` (if none is waiting).
    fn fill_rx(&mut self) {
        if self.rx_pending.is_some() || self.host_gone {
            return;
        }
        let mut buf = vec![0u8; HEADER_LEN + MAX_FRAME];
        loop {
            // SAFETY: read into a live buffer, past the header space, of the stated length.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    buf[HEADER_LEN..].as_mut_ptr().cast(),
                    MAX_FRAME,
                )
            };
            if n > 0 {
                buf.truncate(HEADER_LEN + n as usize);
                self.rx_pending = Some(buf);
                return;
            }
            let e = if n == 0 {
                io::Error::new(io::ErrorKind::UnexpectedEof, "the host side closed")
            } else {
                io::Error::last_os_error()
            };
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => return,
                _ => {
                    self.gone(&e);
                    return;
                }
            }
        }
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        DEVICE_ID_NET
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE, QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        F_MAC
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // mac[6], then status (not offered, reads as 0).
        let mut cfg = [0u8; 8];
        cfg[..6].copy_from_slice(&self.mac);
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
        self.tx_pending = None;
        self.rx_pending = None;
    }

    fn process(&mut self, queues: &mut [Queue], mem: &GuestMemoryMmap) -> Result<bool, QueueError> {
        let mut used = false;
        // Guest -> host.
        if let Some(txq) = queues.get_mut(TXQ) {
            while self.flush_tx() {
                let Some(chain) = txq.pop(mem)? else { break };
                let total: usize = chain
                    .buffers
                    .iter()
                    .filter(|b| !b.writable)
                    .map(|b| b.len as usize)
                    .sum();
                if total < HEADER_LEN || total - HEADER_LEN > MAX_FRAME {
                    self.counters.tx_dropped.fetch_add(1, Ordering::Relaxed);
                } else {
                    let mut frame = txq.read_chain(mem, &chain, total)?;
                    frame.drain(..HEADER_LEN);
                    self.tx_pending = Some(frame);
                }
                txq.add_used(mem, chain.head, 0)?;
                used = true;
            }
        }
        // Host -> guest.
        if let Some(rxq) = queues.get_mut(RXQ) {
            for _ in 0..RX_BUDGET {
                self.fill_rx();
                let Some(frame) = self.rx_pending.as_mut() else {
                    break;
                };
                let Some(chain) = rxq.pop(mem)? else { break };
                if Queue::writable_len(&chain) < frame.len() {
                    self.rx_pending = None;
                    self.counters.rx_dropped.fetch_add(1, Ordering::Relaxed);
                    rxq.add_used(mem, chain.head, 0)?;
                    used = true;
                    continue;
                }
                // virtio_net_hdr_v1: no flags, no GSO, num_buffers = 1.
                frame[..HEADER_LEN].fill(0);
                frame[10] = 1;
                let n = rxq.write_chain(mem, &chain, frame)?;
                self.rx_pending = None;
                self.counters.rx_frames.fetch_add(1, Ordering::Relaxed);
                rxq.add_used(mem, chain.head, n as u32)?;
                used = true;
            }
        }
        Ok(used)
    }

    fn host_interest(&self) -> Option<(RawFd, bool, bool)> {
        if self.host_gone {
            return None;
        }
        let read = self.rx_pending.is_none();
        let write = self.tx_pending.is_some();
        Some((self.fd.as_raw_fd(), read, write))
    }

    fn save(&self) -> serde_json::Value {
        serde_json::json!({ "mac": self.mac })
    }

    fn restore(&mut self, v: &serde_json::Value) -> Result<(), StateError> {
        let saved: Option<[u8; 6]> = v
            .get("mac")
            .and_then(|m| serde_json::from_value(m.clone()).ok());
        match saved {
            Some(mac) if mac == self.mac => Ok(()),
            Some(mac) => Err(StateError::Incompatible {
                device: "net",
                what: format!(
                    "the snapshot's network device has MAC {}, the VM is configured with {}",
                    format_mac(&mac),
                    format_mac(&self.mac)
                ),
            }),
            None => Ok(()),
        }
    }
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The MAC [`format_mac`] wrote (`aa:bb:cc:dd:ee:ff`); `None` for anything else.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `TUNSETIFF`: `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// Opens (creating it if needed) the TAP device `name` in the calling thread's network
/// namespace: one frame per `read`/`write`, no packet-information prefix, no virtio
/// header. Returns the descriptor (close-on-exec, non-blocking) and the name the kernel
/// gave the device.
pub fn open_tap(name: &str) -> io::Result<(OwnedFd, String)> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['/', ' ', '\0']) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a valid interface name (1-15 characters, no '/' or spaces)"),
        ));
    }
    // SAFETY: open(2) of a NUL-terminated path.
    let raw = unsafe {
        libc::open(
            c"/dev/net/tun".as_ptr(),
            libc::O_RDWR | libc::O_CLOEXEC | libc::O_NONBLOCK,
        )
    };
    if raw < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("open /dev/net/tun: {e}")));
    }
    // SAFETY: `raw` was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // struct ifreq: the name (IFNAMSIZ bytes), then a union whose first member here is
    // `short ifr_flags`; 40 bytes in all.
    let mut ifr = [0u8; 40];
    ifr[..name.len()].copy_from_slice(name.as_bytes());
    let flags = (libc::IFF_TAP | libc::IFF_NO_PI) as u16;
    ifr[16..18].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: TUNSETIFF reads and writes a struct ifreq, which `ifr` is laid out as and
    // sized for.
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) } < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("TUNSETIFF {name}: {e}")));
    }
    let end = ifr[..libc::IFNAMSIZ]
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(libc::IFNAMSIZ);
    let actual = String::from_utf8_lossy(&ifr[..end]).into_owned();
    Ok((fd, actual))
}

/// [`open_tap`] inside the network namespace `netns` (a `/proc/PID/ns/net` or a bind mount
/// of one, as `ip netns` makes): a short-lived thread enters it, opens the device and
/// leaves. The device stays in that namespace; the descriptor works from anywhere.
pub fn open_tap_in(netns: &Path, name: &str) -> io::Result<(OwnedFd, String)> {
    let ns = std::fs::File::open(netns)
        .map_err(|e| io::Error::new(e.kind(), format!("open {}: {e}", netns.display())))?;
    let name = name.to_owned();
    in_netns(&ns, move || open_tap(&name))?
}

/// Runs `f` on a short-lived thread that joined the network namespace `ns` (`setns` changes
/// only that thread; devices it creates and programs it starts are born there) and returns
/// what `f` returned, or why the thread could not join.
pub fn in_netns<T: Send + 'static>(
    ns: &std::fs::File,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<T> {
    let ns = ns.try_clone()?;
    std::thread::Builder::new()
        .name("microvm-netns".into())
        .spawn(move || {
            // SAFETY: setns on this thread only (it exits right after), with a descriptor we
            // hold open.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
                let e = io::Error::last_os_error();
                return Err(io::Error::new(
                    e.kind(),
                    format!("enter the network namespace: {e}"),
                ));
            }
            Ok(f())
        })?
        .join()
        .map_err(|_| io::Error::other("the network namespace thread panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_space_holds_the_mac() {
        let (a, _b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let net = Net::new(a.into(), [2, 0, 0, 0, 0, 9]).unwrap();
        let mut mac = [0u8; 6];
        net.read_config(0, &mut mac);
        assert_eq!(mac, [2, 0, 0, 0, 0, 9]);
        let mut past = [0xffu8; 4];
        net.read_config(6, &mut past);
        assert_eq!(
            past,
            [0, 0, 0, 0],
            "status is not offered; past the end reads 0"
        );
        assert_eq!(net.features(), F_MAC);
    }

    #[test]
    fn bad_interface_names_are_refused() {
        for bad in ["", "a/b", "sixteen-chars-xx", "a b"] {
            let e = open_tap(bad).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad:?}");
        }
    }

    #[test]
    fn a_snapshot_of_another_mac_is_refused() {
        let (a, _b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let mut net = Net::new(a.into(), [2, 0, 0, 0, 0, 1]).unwrap();
        let saved = serde_json::json!({ "mac": [2, 0, 0, 0, 0, 2] });
        assert!(matches!(
            net.restore(&saved),
            Err(StateError::Incompatible { .. })
        ));
        assert!(net.restore(&net.save()).is_ok());
    }

    #[test]
    fn a_formatted_mac_parses_back_and_bad_ones_are_refused() {
        let mac = [0x02, 0xa5, 0x00, 0x1f, 0xfe, 0x09];
        assert_eq!(parse_mac(&format_mac(&mac)), Some(mac));
        for bad in [
            "",
            "02:a5:00:1f:fe",
            "02:a5:00:1f:fe:09:01",
            "02:a5:00:1f:fe:zz",
            "2:a5:0:1f:fe:9",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }
}
