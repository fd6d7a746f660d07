//! A strict loader for static x86-64 ELF executables (tiny guests). Every header field is
//! checked before use; segments must fit in guest RAM above `layout::HIMEM_START` (so they
//! cannot overwrite the GDT or page tables).

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout;
use crate::vmm::error::{Result, VmmError};

const PT_LOAD: u32 = 1;

fn bad(m: impl Into<String>) -> VmmError {
    VmmError::InvalidImage(m.into())
}

fn rd<const N: usize>(b: &[u8], off: usize) -> Result<[u8; N]> {
    b.get(off..off.checked_add(N).ok_or_else(|| bad("offset overflow"))?)
        .and_then(|s| <[u8; N]>::try_from(s).ok())
        .ok_or_else(|| bad(format!("truncated ELF at offset {off}")))
}
fn u16_at(b: &[u8], off: usize) -> Result<u16> {
    Ok(u16::from_le_bytes(rd::<2>(b, off)?))
}
fn u32_at(b: &[u8], off: usize) -> Result<u32> {
    Ok(u32::from_le_bytes(rd::<4>(b, off)?))
}
fn u64_at(b: &[u8], off: usize) -> Result<u64> {
    Ok(u64::from_le_bytes(rd::<8>(b, off)?))
}

/// Loads `image` into `mem` (RAM of `ram_size` bytes) and returns the entry point.
pub fn load_elf(mem: &GuestMemoryMmap, ram_size: u64, image: &[u8]) -> Result<u64> {
    if image.get(0..4) != Some(b"\x7fELF".as_slice()) {
        return Err(bad("not an ELF file"));
    }
    if image.get(4) != Some(&2) || image.get(5) != Some(&1) {
        return Err(bad("not a 64-bit little-endian ELF"));
    }
    if u16_at(image, 18)? != 0x3e {
        return Err(bad("not an x86-64 ELF"));
    }
    let entry = u64_at(image, 24)?;
    let phoff = usize::try_from(u64_at(image, 32)?).map_err(|_| bad("phoff"))?;
    let phentsize = usize::from(u16_at(image, 54)?);
    let phnum = usize::from(u16_at(image, 56)?);
    if phentsize < 56 {
        return Err(bad("program header entries too small"));
    }
    let low_top = ram_size.min(layout::MMIO_GAP_START);
    let mut entry_ok = false;
    let mut loaded = 0;
    for i in 0..phnum {
        let ph = phoff
            .checked_add(i.checked_mul(phentsize).ok_or_else(|| bad("phnum"))?)
            .ok_or_else(|| bad("program header offset overflow"))?;
        if u32_at(image, ph)? != PT_LOAD {
            continue;
        }
        let offset = u64_at(image, ph + 8)?;
        let paddr = u64_at(image, ph + 24)?;
        let filesz = u64_at(image, ph + 32)?;
        let memsz = u64_at(image, ph + 40)?;
        if filesz > memsz {
            return Err(bad("segment file size exceeds its memory size"));
        }
        let end = paddr
            .checked_add(memsz)
            .ok_or_else(|| bad("segment wraps the address space"))?;
        if paddr < layout::HIMEM_START || end > low_top {
            return Err(bad(format!(
                "segment [{paddr:#x}, {end:#x}) outside RAM [{:#x}, {low_top:#x})",
                layout::HIMEM_START
            )));
        }
        let fstart = usize::try_from(offset).map_err(|_| bad("offset"))?;
        let fend = fstart
            .checked_add(usize::try_from(filesz).map_err(|_| bad("filesz"))?)
            .ok_or_else(|| bad("segment offset overflow"))?;
        let data = image
            .get(fstart..fend)
            .ok_or_else(|| bad("segment data beyond the end of the file"))?;
        mem.write_slice(data, GuestAddress(paddr))
            .map_err(|e| VmmError::memory(format!("loading a segment: {e}")))?;
        let zeros = usize::try_from(memsz - filesz).map_err(|_| bad("memsz"))?;
        if zeros > 0 {
            let z = vec![0u8; zeros];
            mem.write_slice(&z, GuestAddress(paddr + filesz))
                .map_err(|e| VmmError::memory(format!("zeroing bss: {e}")))?;
        }
        if (paddr..end).contains(&entry) {
            entry_ok = true;
        }
        loaded += 1;
    }
    if loaded == 0 {
        return Err(bad("no loadable segments"));
    }
    if !entry_ok {
        return Err(bad(format!(
            "entry point {entry:#x} is not in a loaded segment"
        )));
    }
    Ok(entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elf(paddr: u64, code: &[u8]) -> Vec<u8> {
        let mut v = vec![0u8; 64 + 56];
        v[0..4].copy_from_slice(b"\x7fELF");
        v[4] = 2;
        v[5] = 1;
        v[18..20].copy_from_slice(&0x3eu16.to_le_bytes());
        v[24..32].copy_from_slice(&paddr.to_le_bytes());
        v[32..40].copy_from_slice(&64u64.to_le_bytes());
        v[54..56].copy_from_slice(&56u16.to_le_bytes());
        v[56..58].copy_from_slice(&1u16.to_le_bytes());
        let ph = 64;
        v[ph..ph + 4].copy_from_slice(&PT_LOAD.to_le_bytes());
        v[ph + 8..ph + 16].copy_from_slice(&120u64.to_le_bytes());
        v[ph + 24..ph + 32].copy_from_slice(&paddr.to_le_bytes());
        v[ph + 32..ph + 40].copy_from_slice(&(code.len() as u64).to_le_bytes());
        v[ph + 40..ph + 48].copy_from_slice(&(code.len() as u64 + 16).to_le_bytes());
        v.extend_from_slice(code);
        v
    }

    #[test]
    fn loads_and_rejects() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        let img = elf(0x20_0000, &[0x90, 0xf4]);
        assert_eq!(load_elf(&mem, 4 << 20, &img).unwrap(), 0x20_0000);
        assert!(load_elf(&mem, 4 << 20, &elf(0x1000, &[0x90])).is_err());
        assert!(load_elf(&mem, 4 << 20, &elf(0x3f_fff8, &[0x90; 4])).is_err());
        assert!(load_elf(&mem, 4 << 20, &img[..100]).is_err());
        assert!(load_elf(&mem, 4 << 20, b"garbage").is_err());
        let mut huge = img.clone();
        huge[64 + 40..64 + 48].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(load_elf(&mem, 4 << 20, &huge).is_err());
    }
}
