//! Guest memory: a memfd mapped `MAP_SHARED` for a fresh VM, or a snapshot's memory file
//! mapped `MAP_PRIVATE` (copy-on-write) for a restored one.
//!
//! RAM is split around the 32-bit MMIO gap: `[0, min(size, MMIO_GAP_START))` and, when the
//! VM is larger than that, the rest from 4 GiB up. The backing file holds the regions back to
//! back, so the file offset of the second region is the size of the first.

use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap, MmapRegion,
};

use crate::layout;
use crate::vmm::error::{Result, VmmError};

/// Page size used for zero-page skipping.
const PAGE: usize = 4096;
/// Smallest guest memory we accept (page tables, GDT and a tiny guest need a few MiB).
pub const MIN_MEM_SIZE: u64 = 2 << 20;
/// Largest guest memory we accept (a sanity bound, well above any sandbox limit).
pub const MAX_MEM_SIZE: u64 = 64 << 30;

/// How guest memory is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backing {
    /// A fresh anonymous memfd, mapped shared.
    Memfd,
    /// A snapshot's memory file, mapped private (copy-on-write).
    SnapshotPrivate,
}

/// The guest's RAM.
#[derive(Debug)]
pub struct GuestRam {
    mem: GuestMemoryMmap,
    size: u64,
    file: Arc<File>,
    backing: Backing,
}

/// The guest-physical layout of `size` bytes of RAM: `(guest address, length, file offset)`.
pub fn ram_ranges(size: u64) -> Vec<(u64, u64, u64)> {
    let low = size.min(layout::MMIO_GAP_START);
    let mut v = vec![(layout::RAM_START, low, 0)];
    if size > low {
        v.push((
            layout::MMIO_GAP_START + layout::MMIO_GAP_SIZE,
            size - low,
            low,
        ));
    }
    v
}

/// Opens a snapshot's memory file, which must be exactly `size` bytes.
fn open_snapshot_memory(path: &Path, size: u64) -> Result<File> {
    let file = File::open(path).map_err(VmmError::io(format!(
        "opening snapshot memory {}",
        path.display()
    )))?;
    let len = file
        .metadata()
        .map_err(VmmError::io("stat snapshot memory"))?
        .len();
    if len != size {
        return Err(VmmError::SnapshotCorrupt(format!(
            "memory file is {len} bytes, the state says {size}"
        )));
    }
    Ok(file)
}

/// Checks a memory size from a configuration or a snapshot.
pub fn check_mem_size(size: u64) -> Result<()> {
    if !(MIN_MEM_SIZE..=MAX_MEM_SIZE).contains(&size) || !size.is_multiple_of(PAGE as u64) {
        return Err(VmmError::InvalidConfig(format!(
            "memory size {size} must be a multiple of 4 KiB between {MIN_MEM_SIZE} and {MAX_MEM_SIZE}"
        )));
    }
    Ok(())
}

impl GuestRam {
    /// Creates `size` bytes of zeroed RAM backed by a new memfd (mapped shared).
    pub fn new_memfd(size: u64) -> Result<Self> {
        check_mem_size(size)?;
        // SAFETY: memfd_create takes a NUL-terminated name and flags; the returned fd is
        // checked and then owned by the File.
        let fd = unsafe { libc::memfd_create(c"microvm-ram".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(VmmError::memory_io(
                "memfd_create",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size)
            .map_err(|e| VmmError::memory_io(format!("sizing the memfd to {size} bytes"), e))?;
        Self::map(Arc::new(file), size, libc::MAP_SHARED, Backing::Memfd)
    }

    /// Maps a snapshot's memory file copy-on-write. The file must be exactly `size` bytes.
    pub fn open_private(path: &Path, size: u64) -> Result<Self> {
        check_mem_size(size)?;
        let file = open_snapshot_memory(path, size)?;
        Self::map(
            Arc::new(file),
            size,
            libc::MAP_PRIVATE,
            Backing::SnapshotPrivate,
        )
    }

    /// Puts a snapshot's memory file, copy-on-write, in place of this RAM's pages, at the
    /// same host addresses: what a VM whose memory slots are registered already (a pooled
    /// one, see [`crate::vmm::vm::VmPool`]) restores into. KVM's slots name host addresses,
    /// and its MMU notifier drops the old pages' mappings when they are replaced. The file
    /// must be exactly this RAM's size. On an error the RAM is unusable (drop it).
    pub(crate) fn remap_private(mut self, path: &Path) -> Result<Self> {
        let file = open_snapshot_memory(path, self.size)?;
        for ((gpa, len, off), region) in ram_ranges(self.size).into_iter().zip(self.mem.iter()) {
            let host = self
                .mem
                .get_host_address(GuestAddress(gpa))
                .map_err(|e| VmmError::memory(format!("host address of a region: {e}")))?;
            let (len_usize, off) = match (usize::try_from(len), libc::off_t::try_from(off)) {
                (Ok(l), Ok(o)) if l == region.len() as usize => (l, o),
                _ => return Err(VmmError::memory("region does not match the layout")),
            };
            // SAFETY: `host..host+len` is exactly one region's live mapping, owned by
            // `self.mem` (which unmaps that range when dropped); MAP_FIXED replaces its pages
            // with the file's, and nothing holds a reference into the old ones (the VM has
            // not run). The result is checked.
            let p = unsafe {
                libc::mmap(
                    host.cast(),
                    len_usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    file.as_raw_fd(),
                    off,
                )
            };
            if p == libc::MAP_FAILED || p != host.cast() {
                return Err(VmmError::memory_io(
                    format!("mapping snapshot memory over {len} bytes of RAM"),
                    std::io::Error::last_os_error(),
                ));
            }
        }
        self.file = Arc::new(file);
        self.backing = Backing::SnapshotPrivate;
        Ok(self)
    }

    fn map(file: Arc<File>, size: u64, share: i32, backing: Backing) -> Result<Self> {
        let mut regions = Vec::new();
        for (gpa, len, off) in ram_ranges(size) {
            let len_usize = usize::try_from(len)
                .map_err(|_| VmmError::memory("region too large for this host"))?;
            let region = MmapRegion::build(
                Some(FileOffset::from_arc(file.clone(), off)),
                len_usize,
                libc::PROT_READ | libc::PROT_WRITE,
                share | libc::MAP_NORESERVE,
            )
            .map_err(|e| match e {
                vm_memory::mmap::MmapRegionError::Mmap(io) => {
                    VmmError::memory_io(format!("mmap of {len} bytes"), io)
                }
                other => VmmError::memory(format!("mmap of {len} bytes: {other}")),
            })?;
            let r = GuestRegionMmap::new(region, GuestAddress(gpa))
                .ok_or_else(|| VmmError::memory("region wraps the address space"))?;
            regions.push(r);
        }
        let mem = GuestMemoryMmap::from_regions(regions)
            .map_err(|e| VmmError::memory(format!("building guest memory: {e}")))?;
        Ok(GuestRam {
            mem,
            size,
            file,
            backing,
        })
    }

    /// The vm-memory view (bounds-checked accessors).
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// RAM size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// How the RAM is backed.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Registers every region with KVM as memory slots `0..n`.
    pub(crate) fn register(&self, vm: &VmFd) -> Result<()> {
        for (slot, region) in self.mem.iter().enumerate() {
            let host = self
                .mem
                .get_host_address(region.start_addr())
                .map_err(|e| VmmError::memory(format!("host address of a region: {e}")))?;
            let r = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: the region is a live mapping owned by `self.mem` of exactly
            // `memory_size` bytes; the VmFd is dropped (and with it the slot) before the
            // mapping, because `Vm` declares its KVM handles before its memory.
            unsafe { vm.set_user_memory_region(r) }.map_err(VmmError::kvm("set memory region"))?;
        }
        Ok(())
    }

    /// Writes all of RAM to `path` as a sparse file: pages that are all zero (and ranges the
    /// memfd has never touched) are left as holes. Returns the number of bytes written.
    pub fn save_to_file(&self, path: &Path) -> Result<u64> {
        let out = File::create(path).map_err(VmmError::io(format!(
            "creating snapshot memory {}",
            path.display()
        )))?;
        out.set_len(self.size)
            .map_err(VmmError::io("sizing snapshot memory"))?;
        let mut written = 0u64;
        let mut buf = vec![0u8; 1 << 20];
        for (gpa, len, off) in ram_ranges(self.size) {
            for (start, end) in self.data_ranges(off, len)? {
                // `start`/`end` are file offsets inside this region.
                let mut pos = start;
                while pos < end {
                    let n = ((end - pos) as usize).min(buf.len());
                    let chunk = &mut buf[..n];
                    self.mem
                        .read_slice(chunk, GuestAddress(gpa + (pos - off)))
                        .map_err(|e| VmmError::memory(format!("reading guest RAM: {e}")))?;
                    written += write_nonzero_pages(&out, chunk, pos)?;
                    pos += n as u64;
                }
            }
        }
        Ok(written)
    }

    /// File ranges `[start, end)` inside `[off, off+len)` that may hold data. For a memfd the
    /// kernel knows which pages were ever touched (SEEK_DATA/SEEK_HOLE); a private mapping can
    /// differ from its file anywhere, so all of it is scanned.
    fn data_ranges(&self, off: u64, len: u64) -> Result<Vec<(u64, u64)>> {
        let end = off + len;
        if self.backing != Backing::Memfd {
            return Ok(vec![(off, end)]);
        }
        let mut v = Vec::new();
        let mut pos = off;
        let fd = self.file.as_raw_fd();
        while pos < end {
            // SAFETY: lseek on a descriptor we own; the result is checked.
            let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::ENXIO) {
                    break; // no data after pos
                }
                // SEEK_DATA unsupported: scan everything.
                return Ok(vec![(off, end)]);
            }
            let data = data as u64;
            if data >= end {
                break;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
            let hole = if hole < 0 {
                end
            } else {
                (hole as u64).min(end)
            };
            v.push((data, hole));
            pos = hole;
        }
        // The fd's offset is not used by the mappings, but keep it tidy.
        let mut f: &File = &self.file;
        let _ = f.seek(SeekFrom::Start(0));
        Ok(v)
    }
}

/// Writes the non-zero pages of `chunk` (which belongs at file offset `pos`), coalescing runs.
fn write_nonzero_pages(out: &File, chunk: &[u8], pos: u64) -> Result<u64> {
    let mut written = 0u64;
    let mut run_start: Option<usize> = None;
    let mut i = 0;
    while i < chunk.len() {
        let end = (i + PAGE).min(chunk.len());
        let zero = chunk[i..end].iter().all(|b| *b == 0);
        match (zero, run_start) {
            (false, None) => run_start = Some(i),
            (true, Some(s)) => {
                out.write_all_at(&chunk[s..i], pos + s as u64)
                    .map_err(VmmError::io("writing snapshot memory"))?;
                written += (i - s) as u64;
                run_start = None;
            }
            _ => {}
        }
        i = end;
    }
    if let Some(s) = run_start {
        out.write_all_at(&chunk[s..], pos + s as u64)
            .map_err(VmmError::io("writing snapshot memory"))?;
        written += (chunk.len() - s) as u64;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_split_around_the_gap() {
        assert_eq!(ram_ranges(16 << 20), vec![(0, 16 << 20, 0)]);
        let big = layout::MMIO_GAP_START + (1 << 30);
        assert_eq!(
            ram_ranges(big),
            vec![
                (0, layout::MMIO_GAP_START, 0),
                (1 << 32, 1 << 30, layout::MMIO_GAP_START)
            ]
        );
    }

    #[test]
    fn sizes_are_checked() {
        assert!(check_mem_size(16 << 20).is_ok());
        assert!(check_mem_size(1 << 20).is_err());
        assert!(check_mem_size((16 << 20) + 1).is_err());
    }

    #[test]
    fn save_is_sparse_and_roundtrips() {
        let ram = GuestRam::new_memfd(8 << 20).unwrap();
        ram.memory()
            .write_slice(b"hello", GuestAddress(0x3000))
            .unwrap();
        ram.memory()
            .write_slice(b"world", GuestAddress(0x70_0000))
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("mem");
        let n = ram.save_to_file(&p).unwrap();
        assert_eq!(n, 2 * PAGE as u64);
        let back = GuestRam::open_private(&p, 8 << 20).unwrap();
        let mut b = [0u8; 5];
        back.memory()
            .read_slice(&mut b, GuestAddress(0x70_0000))
            .unwrap();
        assert_eq!(&b, b"world");
        // Copy-on-write: writing the restored RAM leaves the file alone.
        back.memory()
            .write_slice(b"xxxxx", GuestAddress(0x3000))
            .unwrap();
        let again = GuestRam::open_private(&p, 8 << 20).unwrap();
        again
            .memory()
            .read_slice(&mut b, GuestAddress(0x3000))
            .unwrap();
        assert_eq!(&b, b"hello");
        assert!(GuestRam::open_private(&p, 16 << 20).is_err());
    }
}
