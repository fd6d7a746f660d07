//! A read-only virtio-blk device backed by a host file.
//!
//! The backing file is opened `O_RDONLY` ([`Block::open`]), so the device cannot change it
//! whatever the guest asks. It offers `VIRTIO_BLK_F_RO` and `VIRTIO_BLK_F_SEG_MAX`; the
//! capacity is the file's size in whole 512-byte sectors (a partial last sector is not
//! visible to the guest).
//!
//! Requests (one queue): a 16-byte device-readable header (type, reserved, sector), data
//! buffers, and a final device-writable status byte (the last byte of the chain's writable
//! region).
//!
//! - `IN` (read): the writable data length must be a multiple of 512 and lie within the
//!   capacity; the data is read with `pread` through a fixed-size bounce buffer (no host
//!   allocation the guest can size, no `unsafe`). Used length: data + 1.
//! - `GET_ID`: up to [`ID_BYTES`] bytes of the configured id (NUL-padded if shorter).
//! - `OUT` (write) and every other type: status `UNSUPP` (the device does not support the
//!   operation; a read-only disk has no write path at all). Used length: 1.
//! - A request out of range, with an unaligned length, or whose `pread` fails or hits the
//!   end of the file: status `IOERR`. Used length: 1.
//!
//! A malformed chain (a header shorter than 16 bytes, no writable status byte, device-readable
//! data on a read or id request) is a virtqueue violation: the device is marked broken
//! (NEEDS_RESET), as for the console.

use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::mmio::VirtioDevice;
use super::queue::{Chain, Queue, QueueError};
use crate::devices::StateError;

/// Virtio device ID of a block device.
pub const DEVICE_ID_BLOCK: u32 = 2;
/// Queue size offered to the driver.
pub const QUEUE_SIZE: u16 = 256;
/// Sector size: capacity, offsets and lengths are in these units.
pub const SECTOR_SIZE: u64 = 512;
/// Most data segments per request the driver may use (`seg_max`): the queue size less the
/// header and status descriptors.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Length of a `GET_ID` answer (the id is NUL-padded to it).
pub const ID_BYTES: usize = 20;

/// VIRTIO_BLK_F_SEG_MAX: `seg_max` in config space is valid.
pub const F_SEG_MAX: u64 = 1 << 2;
/// VIRTIO_BLK_F_RO: the device is read-only.
pub const F_RO: u64 = 1 << 5;

/// Request types (`type` in the request header).
pub mod req {
    /// VIRTIO_BLK_T_IN: read sectors.
    pub const IN: u32 = 0;
    /// VIRTIO_BLK_T_OUT: write sectors (refused: the device is read-only).
    pub const OUT: u32 = 1;
    /// VIRTIO_BLK_T_GET_ID: the device id string.
    pub const GET_ID: u32 = 8;
}

/// Request status values (the final byte of a request).
pub mod status {
    /// VIRTIO_BLK_S_OK.
    pub const OK: u8 = 0;
    /// VIRTIO_BLK_S_IOERR.
    pub const IOERR: u8 = 1;
    /// VIRTIO_BLK_S_UNSUPP.
    pub const UNSUPP: u8 = 2;
}

/// Size of the request header.
const HEADER_LEN: usize = 16;
/// Bounce buffer for reads: file data goes through it into guest memory.
const BOUNCE_LEN: usize = 64 * 1024;

/// Saved block device state: what the guest was told, checked again on restore.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct BlockState {
    capacity: u64,
}

/// The read-only block device model.
#[derive(Debug)]
pub struct Block {
    file: File,
    /// Capacity in sectors.
    capacity: u64,
    id: [u8; ID_BYTES],
    bounce: Vec<u8>,
}

impl Block {
    /// Opens `path` read-only (`O_RDONLY | O_CLOEXEC`) as the backing file of a device whose
    /// `GET_ID` answer is `id`. Fails with [`std::io::ErrorKind::InvalidInput`] when `id` is
    /// longer than [`ID_BYTES`] bytes, and with the host's error when the file cannot be
    /// opened or sized.
    pub fn open(path: &Path, id: &str) -> std::io::Result<Self> {
        if id.len() > ID_BYTES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "block device id {id:?} is {} bytes, at most {ID_BYTES}",
                    id.len()
                ),
            ));
        }
        let mut file = File::open(path)?;
        // Seeking to the end sizes regular files and block devices alike (reads use pread,
        // which ignores the offset).
        let bytes = file.seek(SeekFrom::End(0))?;
        let mut idb = [0u8; ID_BYTES];
        idb[..id.len()].copy_from_slice(id.as_bytes());
        Ok(Block {
            file,
            capacity: bytes / SECTOR_SIZE,
            id: idb,
            bounce: Vec::new(),
        })
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Handles one request; returns the used length, or a queue violation.
    fn handle(
        &mut self,
        q: &Queue,
        mem: &GuestMemoryMmap,
        chain: &Chain,
    ) -> Result<u32, QueueError> {
        let err = |what: &str| QueueError {
            queue: q.index,
            what: format!("block request {}: {what}", chain.head),
        };
        let header = q.read_chain(mem, chain, HEADER_LEN)?;
        let header: [u8; HEADER_LEN] = header
            .try_into()
            .map_err(|_| err("header shorter than 16 bytes"))?;
        let (data, status_addr) =
            Queue::split_status(chain).ok_or_else(|| err("no writable status byte"))?;
        let rtype = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let sector = u64::from_le_bytes([
            header[8], header[9], header[10], header[11], header[12], header[13], header[14],
            header[15],
        ]);
        let readable: u64 = chain
            .buffers
            .iter()
            .filter(|b| !b.writable)
            .map(|b| u64::from(b.len))
            .sum();
        if matches!(rtype, req::IN | req::GET_ID) && readable != HEADER_LEN as u64 {
            return Err(err("device-readable data on a read request"));
        }
        let (st, len) = match rtype {
            req::IN => match self.read(q, mem, &data, sector)? {
                Some(n) => (status::OK, n),
                None => (status::IOERR, 0),
            },
            req::GET_ID => {
                let n = q.write_chain(mem, &data, &self.id)?;
                (status::OK, n as u64)
            }
            _ => (status::UNSUPP, 0),
        };
        mem.write_obj(st, status_addr)
            .map_err(|e| err(&format!("writing the status: {e}")))?;
        // The used length is a lower bound of what was written: a chain with more than
        // 4 GiB of writable buffers (the same buffer many times) reports u32::MAX.
        Ok(u32::try_from(len.saturating_add(1)).unwrap_or(u32::MAX))
    }

    /// Reads the sectors from `sector` on into `data`'s buffers. `Ok(None)`: the request is
    /// refused with IOERR (unaligned, out of range, or the host read failed).
    fn read(
        &mut self,
        q: &Queue,
        mem: &GuestMemoryMmap,
        data: &Chain,
        sector: u64,
    ) -> Result<Option<u64>, QueueError> {
        let len: u64 = data.buffers.iter().map(|b| u64::from(b.len)).sum();
        let end = sector
            .checked_mul(SECTOR_SIZE)
            .and_then(|start| start.checked_add(len).map(|end| (start, end)));
        let Some((start, end)) = end else {
            return Ok(None);
        };
        if !len.is_multiple_of(SECTOR_SIZE) || end > self.capacity * SECTOR_SIZE {
            return Ok(None);
        }
        if self.bounce.len() < BOUNCE_LEN {
            self.bounce.resize(BOUNCE_LEN, 0);
        }
        let mut off = start;
        for b in &data.buffers {
            let mut done = 0u64;
            while done < u64::from(b.len) {
                let take = (u64::from(b.len) - done).min(BOUNCE_LEN as u64) as usize;
                let buf = &mut self.bounce[..take];
                if self.file.read_exact_at(buf, off).is_err() {
                    return Ok(None);
                }
                mem.write_slice(buf, GuestAddress(b.addr.0 + done))
                    .map_err(|e| QueueError {
                        queue: q.index,
                        what: format!("writing read data: {e}"),
                    })?;
                done += take as u64;
                off += take as u64;
            }
        }
        Ok(Some(len))
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        DEVICE_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        F_RO | F_SEG_MAX
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // capacity: u64, size_max: u32 (not offered), seg_max: u32.
        let mut cfg = [0u8; 16];
        cfg[..8].copy_from_slice(&self.capacity.to_le_bytes());
        cfg[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| cfg.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    fn reset(&mut self) {}

    fn process(&mut self, queues: &mut [Queue], mem: &GuestMemoryMmap) -> Result<bool, QueueError> {
        let Some(q) = queues.first_mut() else {
            return Ok(false);
        };
        let mut used = false;
        while let Some(chain) = q.pop(mem)? {
            let len = self.handle(q, mem, &chain)?;
            q.add_used(mem, chain.head, len)?;
            used = true;
        }
        Ok(used)
    }

    fn host_interest(&self) -> Option<(RawFd, bool, bool)> {
        None
    }

    fn save(&self) -> serde_json::Value {
        serde_json::to_value(BlockState {
            capacity: self.capacity,
        })
        .unwrap_or(serde_json::Value::Null)
    }

    fn restore(&mut self, v: &serde_json::Value) -> Result<(), StateError> {
        if v.is_null() {
            return Ok(());
        }
        let s: BlockState =
            serde_json::from_value(v.clone()).map_err(|source| StateError::Malformed {
                device: "block",
                source,
            })?;
        if s.capacity != self.capacity {
            return Err(StateError::Incompatible {
                device: "block",
                what: format!(
                    "the guest was told {} sectors, the backing file has {}",
                    s.capacity, self.capacity
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::io::Write;

    const DESC_F_NEXT: u16 = 1;
    const DESC_F_WRITE: u16 = 2;
    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const HDR: u64 = 0x4000;
    const STATUS: u64 = 0x4100;
    const DATA: u64 = 0x8000;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap()
    }

    fn pattern(i: usize) -> u8 {
        (i.wrapping_mul(31) ^ (i >> 9).wrapping_mul(7)) as u8
    }

    /// A device over a temp file of `bytes` patterned bytes.
    fn device(bytes: usize, id: &str) -> (Block, tempfile::NamedTempFile) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..bytes).map(pattern).collect();
        f.write_all(&data).unwrap();
        f.flush().unwrap();
        let b = Block::open(f.path(), id).unwrap();
        (b, f)
    }

    fn queue() -> Queue {
        Queue {
            index: 0,
            max_size: QUEUE_SIZE,
            size: 16,
            ready: true,
            desc_table: DESC,
            avail_ring: AVAIL,
            used_ring: USED,
            next_avail: 0,
            next_used: 0,
        }
    }

    /// Writes a chain of (addr, len, writable) buffers at descriptor 0.. and publishes it.
    fn submit(m: &GuestMemoryMmap, bufs: &[(u64, u32, bool)]) {
        for (i, (addr, len, w)) in bufs.iter().enumerate() {
            let d = DESC + 16 * i as u64;
            let mut flags = if *w { DESC_F_WRITE } else { 0 };
            if i + 1 < bufs.len() {
                flags |= DESC_F_NEXT;
            }
            m.write_obj(*addr, GuestAddress(d)).unwrap();
            m.write_obj(*len, GuestAddress(d + 8)).unwrap();
            m.write_obj(flags, GuestAddress(d + 12)).unwrap();
            m.write_obj((i + 1) as u16, GuestAddress(d + 14)).unwrap();
        }
        m.write_obj(0u16, GuestAddress(AVAIL + 4)).unwrap();
        m.write_obj(1u16, GuestAddress(AVAIL + 2)).unwrap();
    }

    fn header(m: &GuestMemoryMmap, rtype: u32, sector: u64) {
        m.write_obj(rtype, GuestAddress(HDR)).unwrap();
        m.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
        m.write_obj(sector, GuestAddress(HDR + 8)).unwrap();
        m.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    /// Runs the device once; returns the status byte and the used length.
    fn run(b: &mut Block, m: &GuestMemoryMmap) -> (u8, u32) {
        let mut qs = vec![queue()];
        assert!(b.process(&mut qs, m).unwrap());
        assert_eq!(m.read_obj::<u16>(GuestAddress(USED + 2)).unwrap(), 1);
        let len = m.read_obj::<u32>(GuestAddress(USED + 8)).unwrap();
        (m.read_obj::<u8>(GuestAddress(STATUS)).unwrap(), len)
    }

    fn broken(b: &mut Block, m: &GuestMemoryMmap) -> QueueError {
        let mut qs = vec![queue()];
        b.process(&mut qs, m).unwrap_err()
    }

    #[test]
    fn config_space_and_features() {
        let (b, _f) = device(10 * 512 + 100, "disk");
        assert_eq!(b.capacity(), 10);
        assert_eq!(b.device_type(), 2);
        assert_eq!(b.queue_max_sizes(), vec![256]);
        assert_eq!(b.features(), (1 << 5) | (1 << 2));
        let mut cap = [0u8; 8];
        b.read_config(0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), 10);
        let mut seg = [0u8; 4];
        b.read_config(12, &mut seg);
        assert_eq!(u32::from_le_bytes(seg), 254);
        // Byte-wise, and past the end reads as zero.
        let mut one = [0xffu8; 1];
        b.read_config(0, &mut one);
        assert_eq!(one, [10]);
        b.read_config(u64::MAX, &mut one);
        assert_eq!(one, [0]);
    }

    #[test]
    fn long_id_is_refused() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let e = Block::open(f.path(), "an id longer than twenty bytes").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    }

    #[test]
    fn read_spanning_several_descriptors() {
        let m = mem();
        let (mut b, _f) = device(8 * 512, "disk");
        header(&m, req::IN, 3);
        // 2 sectors over three buffers of odd sizes, then the status byte on its own.
        submit(
            &m,
            &[
                (HDR, 16, false),
                (DATA, 100, true),
                (DATA + 0x1000, 700, true),
                (DATA + 0x2000, 224, true),
                (STATUS, 1, true),
            ],
        );
        assert_eq!(run(&mut b, &m), (status::OK, 1025));
        let mut got = vec![0u8; 1024];
        m.read_slice(&mut got[..100], GuestAddress(DATA)).unwrap();
        m.read_slice(&mut got[100..800], GuestAddress(DATA + 0x1000))
            .unwrap();
        m.read_slice(&mut got[800..], GuestAddress(DATA + 0x2000))
            .unwrap();
        let want: Vec<u8> = (3 * 512..5 * 512).map(pattern).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn status_byte_may_share_the_last_data_buffer() {
        let m = mem();
        let (mut b, _f) = device(4 * 512, "disk");
        header(&m, req::IN, 0);
        // One writable buffer of 513 bytes: 512 data + the status.
        submit(&m, &[(HDR, 16, false), (DATA, 513, true)]);
        let mut qs = vec![queue()];
        assert!(b.process(&mut qs, &m).unwrap());
        assert_eq!(m.read_obj::<u8>(GuestAddress(DATA + 512)).unwrap(), 0);
        let mut got = vec![0u8; 512];
        m.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert_eq!(got, (0..512).map(pattern).collect::<Vec<_>>());
    }

    #[test]
    fn get_id_writes_the_padded_id() {
        let m = mem();
        let (mut b, _f) = device(512, "rootfs");
        header(&m, req::GET_ID, 0);
        m.write_slice(&[0xaa; 20], GuestAddress(DATA)).unwrap();
        submit(&m, &[(HDR, 16, false), (DATA, 20, true), (STATUS, 1, true)]);
        assert_eq!(run(&mut b, &m), (status::OK, 21));
        let mut got = [0u8; 20];
        m.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert_eq!(&got[..6], b"rootfs");
        assert_eq!(got[6..], [0u8; 14]);

        // A shorter buffer gets a prefix.
        let m = mem();
        header(&m, req::GET_ID, 0);
        submit(&m, &[(HDR, 16, false), (DATA, 4, true), (STATUS, 1, true)]);
        assert_eq!(run(&mut b, &m), (status::OK, 5));
        let mut got = [0u8; 4];
        m.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert_eq!(&got, b"root");
    }

    #[test]
    fn write_and_unknown_types_are_unsupported() {
        let (mut b, f) = device(4 * 512, "disk");
        for rtype in [req::OUT, 4 /* FLUSH */, 11 /* DISCARD */, 0xdead] {
            let m = mem();
            header(&m, rtype, 0);
            m.write_slice(&[0x55; 512], GuestAddress(DATA)).unwrap();
            submit(
                &m,
                &[(HDR, 16, false), (DATA, 512, false), (STATUS, 1, true)],
            );
            assert_eq!(run(&mut b, &m), (status::UNSUPP, 1), "type {rtype}");
        }
        // The file is untouched.
        let data = std::fs::read(f.path()).unwrap();
        assert_eq!(data, (0..4 * 512).map(pattern).collect::<Vec<_>>());
    }

    #[test]
    fn out_of_range_reads_are_io_errors() {
        let (mut b, _f) = device(4 * 512 + 100, "disk");
        // (sector, data length): past the end, straddling the end, into the partial last
        // sector, sector * 512 overflowing, start + length overflowing, unaligned length.
        let cases: [(u64, u32); 6] = [
            (4, 512),
            (3, 1024),
            (4, 100),
            (u64::MAX / 256, 512),
            (u64::MAX / 512, 512),
            (0, 100),
        ];
        for (sector, len) in cases {
            let m = mem();
            header(&m, req::IN, sector);
            m.write_slice(&[0x55; 1024], GuestAddress(DATA)).unwrap();
            submit(
                &m,
                &[(HDR, 16, false), (DATA, len, true), (STATUS, 1, true)],
            );
            assert_eq!(
                run(&mut b, &m),
                (status::IOERR, 1),
                "sector {sector} len {len}"
            );
        }
        // The last whole sector reads fine.
        let m = mem();
        header(&m, req::IN, 3);
        submit(
            &m,
            &[(HDR, 16, false), (DATA, 512, true), (STATUS, 1, true)],
        );
        assert_eq!(run(&mut b, &m), (status::OK, 513));
    }

    #[test]
    fn file_shrunk_under_the_device_is_an_io_error() {
        let (mut b, f) = device(4 * 512, "disk");
        f.as_file().set_len(512).unwrap();
        let m = mem();
        header(&m, req::IN, 2);
        submit(
            &m,
            &[(HDR, 16, false), (DATA, 512, true), (STATUS, 1, true)],
        );
        assert_eq!(run(&mut b, &m), (status::IOERR, 1));
    }

    #[test]
    fn zero_length_read_is_ok() {
        let m = mem();
        let (mut b, _f) = device(512, "disk");
        header(&m, req::IN, 1);
        submit(&m, &[(HDR, 16, false), (STATUS, 1, true)]);
        assert_eq!(run(&mut b, &m), (status::OK, 1));
    }

    #[test]
    fn malformed_chains_break_the_device() {
        let (mut b, _f) = device(4 * 512, "disk");
        // No status byte: nothing device-writable.
        let m = mem();
        header(&m, req::IN, 0);
        submit(&m, &[(HDR, 16, false), (DATA, 512, false)]);
        assert!(broken(&mut b, &m).what.contains("status"));
        // A zero-length writable buffer is no status byte either.
        let m = mem();
        header(&m, req::IN, 0);
        submit(&m, &[(HDR, 16, false), (STATUS, 0, true)]);
        assert!(broken(&mut b, &m).what.contains("status"));
        // Header too short (and the rest writable).
        let m = mem();
        header(&m, req::IN, 0);
        submit(&m, &[(HDR, 8, false), (DATA, 512, true), (STATUS, 1, true)]);
        assert!(broken(&mut b, &m).what.contains("header"));
        // Header in a writable buffer.
        let m = mem();
        header(&m, req::IN, 0);
        submit(&m, &[(HDR, 16, true), (STATUS, 1, true)]);
        assert!(broken(&mut b, &m).what.contains("header"));
        // Read data in device-readable buffers.
        let m = mem();
        header(&m, req::IN, 0);
        submit(
            &m,
            &[(HDR, 16, false), (DATA, 512, false), (STATUS, 1, true)],
        );
        assert!(broken(&mut b, &m).what.contains("device-readable"));
        // Header split over two descriptors is fine.
        let m = mem();
        header(&m, req::IN, 1);
        submit(
            &m,
            &[
                (HDR, 4, false),
                (HDR + 4, 12, false),
                (DATA, 512, true),
                (STATUS, 1, true),
            ],
        );
        assert_eq!(run(&mut b, &m), (status::OK, 513));
    }

    #[test]
    fn transport_records_the_device_type_and_refuses_another() {
        use crate::devices::virtio::mmio::{MmioTransport, TransportState};
        use vmm_sys_util::eventfd::EventFd;
        let (b, _f) = device(4 * 512, "disk");
        let mut t = MmioTransport::new(Box::new(b), mem(), None, EventFd::new(0).unwrap());
        let s = t.save();
        assert_eq!(s.device_type, DEVICE_ID_BLOCK);
        t.restore(&s).unwrap();
        let console = TransportState {
            device_type: crate::devices::virtio::console::DEVICE_ID_CONSOLE,
            ..s.clone()
        };
        assert!(matches!(
            t.restore(&console),
            Err(StateError::Incompatible { .. })
        ));
        // A snapshot from before the type was recorded held a console.
        let mut old = serde_json::to_value(&s).unwrap();
        old.as_object_mut().unwrap().remove("device_type");
        let old: TransportState = serde_json::from_value(old).unwrap();
        assert_eq!(old.device_type, 3);
        assert!(t.restore(&old).is_err());
    }

    #[test]
    fn state_round_trip_checks_the_capacity() {
        let (mut b, _f) = device(4 * 512, "disk");
        let s = b.save();
        b.restore(&s).unwrap();
        b.restore(&serde_json::Value::Null).unwrap();
        let (mut other, _g) = device(8 * 512, "disk");
        assert!(matches!(
            other.restore(&s),
            Err(StateError::Incompatible { .. })
        ));
        assert!(matches!(
            other.restore(&serde_json::json!({"capacity": "x"})),
            Err(StateError::Malformed { .. })
        ));
    }
}
