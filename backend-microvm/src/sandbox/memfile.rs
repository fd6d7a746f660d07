//! The `memory.extents` artifact: guest memory as its non-zero pages.
//!
//! Layout: the magic `AGSBMEM1`, the memory size (u64 LE), then runs of
//! `[offset u64 LE][length u64 LE][bytes]` in increasing offset order. Everything not in a run
//! is zero.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

const MAGIC: &[u8; 8] = b"AGSBMEM1";
const PAGE: usize = 4096;

/// Why an artifact could not be written back.
#[derive(Debug)]
pub enum UnpackError {
    /// Writing the file failed.
    Io(std::io::Error),
    /// The artifact is malformed.
    Corrupt(String),
}

/// Data ranges of a (sparse) file; the whole file if the filesystem cannot tell.
fn data_ranges(f: &File, size: u64) -> Vec<(u64, u64)> {
    let fd = f.as_raw_fd();
    let mut v = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        let Ok(off) = libc::off_t::try_from(pos) else {
            return vec![(0, size)];
        };
        // SAFETY: lseek on a descriptor `f` owns; the result is checked.
        let data = unsafe { libc::lseek(fd, off, libc::SEEK_DATA) };
        if data < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return vec![(0, size)];
        }
        let data = data as u64;
        if data >= size {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
        let hole = if hole < 0 {
            size
        } else {
            (hole as u64).min(size)
        };
        if hole <= data {
            return vec![(0, size)];
        }
        v.push((data, hole));
        pos = hole;
    }
    v
}

/// Packs the non-zero pages of the file at `path`.
pub fn pack(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut f = File::open(path)?;
    let size = f.metadata()?.len();
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&size.to_le_bytes());
    let mut run: Option<(u64, Vec<u8>)> = None;
    let flush = |run: &mut Option<(u64, Vec<u8>)>, out: &mut Vec<u8>| {
        if let Some((off, data)) = run.take() {
            out.extend_from_slice(&off.to_le_bytes());
            out.extend_from_slice(&(data.len() as u64).to_le_bytes());
            out.extend_from_slice(&data);
        }
    };
    let mut buf = vec![0u8; 1 << 20];
    for (start, end) in data_ranges(&f, size) {
        // Runs never span a hole.
        flush(&mut run, &mut out);
        f.seek(SeekFrom::Start(start))?;
        let mut pos = start;
        while pos < end {
            let want = usize::try_from(end - pos)
                .unwrap_or(usize::MAX)
                .min(buf.len());
            let chunk = buf.get_mut(..want).unwrap_or_default();
            f.read_exact(chunk)?;
            for page in chunk.chunks(PAGE) {
                if page.iter().all(|b| *b == 0) {
                    flush(&mut run, &mut out);
                } else {
                    match &mut run {
                        Some((_, d)) => d.extend_from_slice(page),
                        None => run = Some((pos, page.to_vec())),
                    }
                }
                pos += page.len() as u64;
            }
        }
    }
    flush(&mut run, &mut out);
    Ok(out)
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// Writes a packed artifact back as a sparse file of `size` bytes at `dst`.
pub fn unpack(packed: &[u8], size: u64, dst: &Path) -> Result<(), UnpackError> {
    let bad = |m: &str| UnpackError::Corrupt(m.to_string());
    if packed.get(..8) != Some(&MAGIC[..]) {
        return Err(bad("not a memory artifact (bad magic)"));
    }
    let found = u64_at(packed, 8).ok_or_else(|| bad("truncated header"))?;
    if found != size {
        return Err(UnpackError::Corrupt(format!(
            "holds {found} bytes of memory, the snapshot says {size}"
        )));
    }
    let f = File::create(dst).map_err(UnpackError::Io)?;
    f.set_len(size).map_err(UnpackError::Io)?;
    let mut at = 16usize;
    let mut last_end = 0u64;
    while at < packed.len() {
        let off = u64_at(packed, at).ok_or_else(|| bad("truncated run header"))?;
        let len = u64_at(packed, at + 8).ok_or_else(|| bad("truncated run header"))?;
        let end = off
            .checked_add(len)
            .filter(|e| *e <= size && off >= last_end)
            .ok_or_else(|| bad("a run lies outside memory or out of order"))?;
        let start = at + 16;
        let data = usize::try_from(len)
            .ok()
            .and_then(|l| packed.get(start..start.checked_add(l)?))
            .ok_or_else(|| bad("truncated run"))?;
        f.write_all_at(data, off).map_err(UnpackError::Io)?;
        at = start + data.len();
        last_end = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use crate::sandbox::memfile;

    #[test]
    fn memfile_round_trips_and_skips_zero_pages() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("mem");
        let size = 64u64 << 20;
        {
            let f = std::fs::File::create(&src).unwrap();
            f.set_len(size).unwrap();
            use std::os::unix::fs::FileExt;
            f.write_all_at(b"hello", 4096 * 3 + 7).unwrap();
            f.write_all_at(&[0xab; 10000], 20 << 20).unwrap();
            f.write_all_at(&[1], size - 1).unwrap();
        }
        let packed = memfile::pack(&src).unwrap();
        assert!(packed.len() < 64 << 10, "{} bytes", packed.len());
        let dst = dir.path().join("back");
        memfile::unpack(&packed, size, &dst).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        // Wrong size, bad magic, truncation: typed errors, no panic.
        assert!(matches!(
            memfile::unpack(&packed, size / 2, &dst),
            Err(memfile::UnpackError::Corrupt(_))
        ));
        assert!(memfile::unpack(b"nonsense", size, &dst).is_err());
        for cut in [9, 20, 30, packed.len() - 1] {
            assert!(
                memfile::unpack(&packed[..cut], size, &dst).is_err(),
                "{cut}"
            );
        }
        let mut forged = packed.clone();
        forged[16..24].copy_from_slice(&(size - 2).to_le_bytes());
        assert!(memfile::unpack(&forged, size, &dst).is_err());
    }
}
