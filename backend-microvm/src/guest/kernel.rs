//! The guest kernel: from a bzImage (Debian's `vmlinuz`, whose payload is xz-compressed with
//! the x86 BCJ filter) to the uncompressed `vmlinux` ELF the VMM loads, or a raw `vmlinux`
//! given as is (e.g. Firecracker's CI kernels).
//!
//! The payload is found through the bzImage setup header (boot protocol 2.08+):
//! `setup_sects` at 0x1f1, the `HdrS` magic at 0x202, `payload_offset`/`payload_length` at
//! 0x248/0x24c, the offset counted from the start of the protected-mode code at
//! `(setup_sects + 1) * 512`. The kernel build appends the uncompressed size (u32 LE) after the
//! compressed stream; it bounds and checks the decompression.

use std::io::{self, Read, Write};
use std::path::Path;

use super::GuestError;

/// Largest `vmlinux` we accept (Debian's is ~66 MB).
pub const MAX_VMLINUX: u64 = 1 << 30;

const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
const XZ_MAGIC: &[u8; 6] = b"\xfd7zXZ\x00";

/// What a kernel image file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelFormat {
    /// An uncompressed x86-64 ELF `vmlinux`.
    Elf,
    /// A bzImage; `compression` names the payload format (only `xz` is extracted).
    BzImage {
        /// `xz`, `gzip`, `zstd`, `lz4`, `lzma`, `lzo`, `bzip2`, or `unknown`.
        compression: &'static str,
    },
}

/// Facts about a validated `vmlinux`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ElfInfo {
    /// The ELF entry point.
    pub entry: u64,
    /// Number of program headers.
    pub phnum: u16,
    /// Number of `PT_LOAD` segments.
    pub loadable: u16,
}

fn le16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn le64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn compression_of(p: &[u8]) -> &'static str {
    if p.starts_with(XZ_MAGIC) {
        "xz"
    } else if p.starts_with(&[0x1f, 0x8b]) {
        "gzip"
    } else if p.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        "zstd"
    } else if p.starts_with(&[0x02, 0x21, 0x4c, 0x18]) {
        "lz4"
    } else if p.starts_with(b"BZh") {
        "bzip2"
    } else if p.starts_with(&[0x89, b'L', b'Z', b'O']) {
        "lzo"
    } else if p.starts_with(&[0x5d, 0x00]) {
        "lzma"
    } else {
        "unknown"
    }
}

/// Returns the compressed payload of a bzImage (`None` if `image` is not a bzImage).
pub fn bzimage_payload(image: &[u8]) -> Result<Option<&[u8]>, GuestError> {
    if image.get(0x202..0x206) != Some(b"HdrS") {
        return Ok(None);
    }
    let bad = |m: &str| GuestError::BadKernel(m.to_string());
    let version = le16(image, 0x206).ok_or_else(|| bad("truncated setup header"))?;
    if version < 0x0208 {
        return Err(bad(&format!(
            "boot protocol {}.{:02} has no payload fields (need 2.08+)",
            version >> 8,
            version & 0xff
        )));
    }
    let setup_sects = match image.get(0x1f1).copied() {
        Some(0) => 4,
        Some(n) => usize::from(n),
        None => return Err(bad("truncated setup header")),
    };
    let pm_start = (setup_sects + 1) * 512;
    let off = le32(image, 0x248).ok_or_else(|| bad("truncated setup header"))? as usize;
    let len = le32(image, 0x24c).ok_or_else(|| bad("truncated setup header"))? as usize;
    let start = pm_start
        .checked_add(off)
        .ok_or_else(|| bad("payload offset overflows"))?;
    let end = start
        .checked_add(len)
        .ok_or_else(|| bad("payload length overflows"))?;
    image.get(start..end).map(Some).ok_or_else(|| {
        bad(&format!(
            "payload {start}..{end} lies outside the {}-byte image",
            image.len()
        ))
    })
}

/// Tells what `image` is (by content, not name).
pub fn detect(image: &[u8]) -> Result<KernelFormat, GuestError> {
    if image.starts_with(ELF_MAGIC) {
        return Ok(KernelFormat::Elf);
    }
    match bzimage_payload(image)? {
        Some(p) => Ok(KernelFormat::BzImage {
            compression: compression_of(p),
        }),
        None => Err(GuestError::BadKernel(
            "neither an ELF vmlinux nor a bzImage (no `HdrS` setup header)".into(),
        )),
    }
}

/// Checks that `elf` (at least its first 4 KiB) is a 64-bit little-endian x86-64 executable
/// ELF with loadable segments whose headers lie inside the data given.
pub fn validate_elf(elf: &[u8]) -> Result<ElfInfo, GuestError> {
    let bad = |m: &str| GuestError::BadKernel(format!("vmlinux: {m}"));
    if !elf.starts_with(ELF_MAGIC) {
        return Err(bad("no ELF magic"));
    }
    if elf.get(4) != Some(&2) {
        return Err(bad("not a 64-bit ELF"));
    }
    if elf.get(5) != Some(&1) {
        return Err(bad("not little-endian"));
    }
    if le16(elf, 18) != Some(62) {
        return Err(bad("not an x86-64 ELF (e_machine != EM_X86_64)"));
    }
    let ty = le16(elf, 16).ok_or_else(|| bad("truncated header"))?;
    if ty != 2 && ty != 3 {
        return Err(bad("not an executable"));
    }
    let entry = le64(elf, 24).ok_or_else(|| bad("truncated header"))?;
    let phoff = le64(elf, 32).ok_or_else(|| bad("truncated header"))?;
    let phentsize = le16(elf, 54).ok_or_else(|| bad("truncated header"))?;
    let phnum = le16(elf, 56).ok_or_else(|| bad("truncated header"))?;
    if phentsize != 56 || phnum == 0 {
        return Err(bad("no usable program headers"));
    }
    let mut loadable = 0u16;
    for i in 0..u64::from(phnum) {
        let at = phoff
            .checked_add(i * 56)
            .and_then(|a| usize::try_from(a).ok())
            .ok_or_else(|| bad("program header offset overflows"))?;
        let ty = le32(elf, at).ok_or_else(|| bad("program headers outside the file"))?;
        if ty == 1 {
            loadable += 1;
        }
    }
    if loadable == 0 {
        return Err(bad("no PT_LOAD segment"));
    }
    Ok(ElfInfo {
        entry,
        phnum,
        loadable,
    })
}

/// Writes the `vmlinux` ELF contained in `image` (a bzImage with an xz payload, or already an
/// ELF) to `out`, returning its size. The decompressed size is bounded by the size the kernel
/// build recorded (and by [`MAX_VMLINUX`]) and checked, and the result is validated.
pub fn extract_vmlinux(image: &[u8], out: &mut impl Write) -> Result<u64, GuestError> {
    let wr = |e: io::Error| GuestError::BadKernel(format!("writing vmlinux: {e}"));
    match detect(image)? {
        KernelFormat::Elf => {
            validate_elf(image)?;
            out.write_all(image).map_err(wr)?;
            Ok(image.len() as u64)
        }
        KernelFormat::BzImage { compression: "xz" } => {
            let payload = bzimage_payload(image)?.unwrap_or_default();
            let recorded = payload
                .len()
                .checked_sub(4)
                .and_then(|at| le32(payload, at))
                .map(u64::from)
                .filter(|n| *n > 0 && *n <= MAX_VMLINUX)
                .ok_or_else(|| {
                    GuestError::BadKernel("no plausible size after the xz payload".into())
                })?;
            let stream = &payload[..payload.len() - 4];
            let mut xz = lzma_rust2::XzReader::new(stream, false).take(recorded + 1);
            // Validate the ELF header before writing everything out.
            let mut head = vec![0u8; 4096.min(recorded as usize)];
            xz.read_exact(&mut head)
                .map_err(|e| GuestError::BadKernel(format!("xz payload: {e}")))?;
            validate_elf(&head)?;
            out.write_all(&head).map_err(wr)?;
            let rest = io::copy(&mut xz, out).map_err(|e| {
                GuestError::BadKernel(format!("xz payload (or writing vmlinux): {e}"))
            })?;
            let n = head.len() as u64 + rest;
            if n != recorded {
                return Err(GuestError::BadKernel(format!(
                    "xz payload decompressed to {n} bytes, the image records {recorded}"
                )));
            }
            Ok(n)
        }
        KernelFormat::BzImage { compression } => Err(GuestError::BadKernel(format!(
            "bzImage payload is {compression}-compressed; only xz is supported: give an \
                 uncompressed vmlinux instead"
        ))),
    }
}

/// Extracts (or copies) the kernel at `image_path` into a `vmlinux` file at `dst` (see
/// [`extract_vmlinux_file_from_bytes`]).
pub fn extract_vmlinux_file(image_path: &Path, dst: &Path) -> Result<u64, GuestError> {
    let image = std::fs::read(image_path).map_err(|e| GuestError::io("read", image_path, e))?;
    extract_vmlinux_file_from_bytes(&image, dst)
}

/// Extracts (or copies) the kernel `image` into a `vmlinux` file at `dst`, written to a
/// temporary file first and renamed into place (nothing is left behind on error).
pub fn extract_vmlinux_file_from_bytes(image: &[u8], dst: &Path) -> Result<u64, GuestError> {
    let tmp = dst.with_extension("tmp");
    let f = std::fs::File::create(&tmp).map_err(|e| GuestError::io("create", &tmp, e))?;
    let mut w = io::BufWriter::with_capacity(1 << 20, f);
    let r = extract_vmlinux(image, &mut w).and_then(|n| {
        let f = w
            .into_inner()
            .map_err(|e| GuestError::io("write", &tmp, e.into_error()))?;
        f.sync_all().map_err(|e| GuestError::io("sync", &tmp, e))?;
        Ok(n)
    });
    match r {
        Ok(n) => {
            std::fs::rename(&tmp, dst).map_err(|e| GuestError::io("rename", dst, e))?;
            Ok(n)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests_support {
    /// An x86-64 executable ELF header for entry 16 MiB with one program header right after
    /// it, in a zeroed buffer of `len` bytes.
    fn header(len: usize) -> Vec<u8> {
        let mut e = vec![0u8; len];
        e[..4].copy_from_slice(b"\x7fELF");
        e[4] = 2; // 64-bit
        e[5] = 1; // little-endian
        e[6] = 1;
        e[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        e[18..20].copy_from_slice(&62u16.to_le_bytes()); // x86-64
        e[20..24].copy_from_slice(&1u32.to_le_bytes());
        e[24..32].copy_from_slice(&0x100_0000u64.to_le_bytes()); // entry
        e[32..40].copy_from_slice(&64u64.to_le_bytes()); // phoff
        e[52..54].copy_from_slice(&64u16.to_le_bytes());
        e[54..56].copy_from_slice(&56u16.to_le_bytes());
        e[56..58].copy_from_slice(&1u16.to_le_bytes()); // phnum
        e[64..68].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
        e
    }

    /// A small loadable x86-64 ELF: one R+X `PT_LOAD` segment holding `code` at physical
    /// 16 MiB (virtual `vaddr`), `memsz` bytes in memory, entry at its start.
    pub(crate) fn elf_with(code: &[u8], memsz: u64, vaddr: u64) -> Vec<u8> {
        let mut e = header(0x1000);
        let ph = 64;
        e[ph + 4..ph + 8].copy_from_slice(&5u32.to_le_bytes()); // R+X
        e[ph + 8..ph + 16].copy_from_slice(&0x1000u64.to_le_bytes()); // offset
        e[ph + 16..ph + 24].copy_from_slice(&vaddr.to_le_bytes());
        e[ph + 24..ph + 32].copy_from_slice(&0x100_0000u64.to_le_bytes()); // paddr
        e[ph + 32..ph + 40].copy_from_slice(&(code.len() as u64).to_le_bytes());
        e[ph + 40..ph + 48].copy_from_slice(&memsz.to_le_bytes());
        e.extend_from_slice(code);
        e
    }

    /// A minimal valid x86-64 ELF header with one (empty) PT_LOAD program header.
    pub(crate) fn tiny_elf() -> Vec<u8> {
        header(64 + 56)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    use super::tests_support::tiny_elf;

    fn bzimage_with(payload: &[u8]) -> Vec<u8> {
        let setup_sects = 3u8;
        let pm = (usize::from(setup_sects) + 1) * 512;
        let mut img = vec![0u8; pm + 100 + payload.len()];
        img[0x1f1] = setup_sects;
        img[0x202..0x206].copy_from_slice(b"HdrS");
        img[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        img[0x248..0x24c].copy_from_slice(&100u32.to_le_bytes());
        img[0x24c..0x250].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        img[pm + 100..].copy_from_slice(payload);
        img
    }

    #[test]
    fn raw_elf_is_accepted_and_validated() {
        let e = tiny_elf();
        assert_eq!(detect(&e).unwrap(), KernelFormat::Elf);
        let info = validate_elf(&e).unwrap();
        assert_eq!((info.entry, info.phnum, info.loadable), (0x100_0000, 1, 1));
        let mut out = Vec::new();
        assert_eq!(extract_vmlinux(&e, &mut out).unwrap(), e.len() as u64);
        assert_eq!(out, e);
        for (i, v) in [(4usize, 1u8), (5, 2), (18, 3)] {
            let mut b = e.clone();
            b[i] = v;
            assert!(validate_elf(&b).is_err(), "byte {i}");
        }
        let mut b = e.clone();
        b[64] = 4; // PT_NOTE only
        assert!(validate_elf(&b).is_err());
        assert!(validate_elf(&e[..60]).is_err());
    }

    #[test]
    fn garbage_is_refused() {
        assert!(detect(b"").is_err());
        assert!(detect(&[0u8; 4096]).is_err());
        // A bzImage whose payload points past the end.
        let mut img = bzimage_with(b"\xfd7zXZ\x00");
        img[0x24c..0x250].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(detect(&img), Err(GuestError::BadKernel(_))));
        // Truncated xz, corrupt xz, other compressions.
        let img = bzimage_with(b"\xfd7zXZ\x00garbagegarbage\x10\x00\x00\x00");
        assert_eq!(
            detect(&img).unwrap(),
            KernelFormat::BzImage { compression: "xz" }
        );
        assert!(extract_vmlinux(&img, &mut Vec::new()).is_err());
        let img = bzimage_with(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0]);
        let err = extract_vmlinux(&img, &mut Vec::new())
            .unwrap_err()
            .to_string();
        assert!(err.contains("gzip"), "{err}");
        // Old boot protocol.
        let mut img = bzimage_with(b"x");
        img[0x206..0x208].copy_from_slice(&0x0206u16.to_le_bytes());
        assert!(detect(&img).is_err());
    }
}
