//! Linux boot: loads the kernel into guest memory with `linux-loader` (a `vmlinux` ELF, or a
//! bzImage whose protected-mode part goes at 1 MiB and is entered at `startup_64`), writes the
//! kernel command line, the initrd and the `boot_params` "zero page" (setup header fields and
//! the e820 memory map), and the ACPI tables ([`crate::acpi`]). The VMM then starts the boot
//! vCPU in 64-bit mode at [`LinuxBoot::entry`] with `rsi` = [`LinuxBoot::boot_params`]
//! (the Linux 64-bit boot protocol).
//!
//! Guest RAM convention (shared with the VMM): `mem_size` bytes of RAM are mapped at
//! `[0, min(mem_size, MMIO_GAP_START))` and, for what does not fit below the MMIO gap, at
//! `[4 GiB, 4 GiB + rest)`. The e820 map says: RAM `[0, EBDA_START)`, reserved
//! `[EBDA_START, 1 MiB)` (legacy BIOS area, where the ACPI tables live), RAM from 1 MiB to the
//! end of low RAM, and RAM above 4 GiB if any. The initrd goes at the top of low RAM,
//! page-aligned.

use std::io::{Read, Seek};

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::elf::Elf;
use linux_loader::loader::KernelLoader;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, ReadVolatile};

use crate::acpi::{self, AcpiError, VirtioMmioDesc};
use crate::layout;

/// The kernel command line for our guest: serial console, reboot through the keyboard
/// controller (the VMM catches the reset), reboot 1 s after a panic, no PCI probing, our
/// agent as init, quiet.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off rdinit=/init quiet";

/// e820 entry types.
pub const E820_RAM: u32 = 1;
/// e820 reserved.
pub const E820_RESERVED: u32 = 2;

const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
/// `xloadflags` bit: the kernel has a 64-bit entry point at the load address + 0x200.
const XLF_KERNEL_64: u16 = 1;
/// Offset of `startup_64` from a bzImage's protected-mode load address.
const STARTUP_64_OFFSET: u64 = 0x200;
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x100_0000;
const FIRST_ADDR_PAST_32BITS: u64 = 1 << 32;
const PAGE: u64 = 4096;

/// Errors of the Linux boot set-up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootError {
    /// The kernel could not be loaded (not a valid x86-64 ELF, or it does not fit).
    #[error("loading the kernel: {0}")]
    Kernel(#[source] KernelError),
    /// The command line is too long or contains a NUL byte.
    #[error("kernel command line: {0}")]
    Cmdline(String),
    /// The guest memory is too small or does not match `mem_size`.
    #[error("guest memory: {0}")]
    Memory(String),
    /// The ACPI tables could not be built or written.
    #[error(transparent)]
    Acpi(#[from] AcpiError),
}

/// Why the kernel could not be loaded: [`BootError::Kernel`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The kernel file could not be read (its first bytes, or a seek back).
    #[error("reading the kernel: {0}")]
    Read(#[source] std::io::Error),
    /// It starts like an ELF vmlinux but could not be loaded as one (truncated, not
    /// x86-64, a segment outside guest memory...).
    #[error("{0}")]
    Elf(#[source] linux_loader::loader::Error),
    /// It is neither an ELF vmlinux nor a bzImage (or a bzImage that does not fit).
    #[error("neither an ELF vmlinux nor a bzImage: {0}")]
    NotAKernel(#[source] linux_loader::loader::Error),
    /// A bzImage whose setup header is missing.
    #[error("bzImage without a setup header")]
    NoSetupHeader,
    /// A bzImage without a 64-bit entry point (`xloadflags`).
    #[error("this bzImage has no 64-bit entry point (xloadflags)")]
    No64BitEntry,
    /// The entry point computed from the load address overflows.
    #[error("entry point overflows")]
    EntryOverflow,
}

/// What the VMM needs to start the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LinuxBoot {
    /// The 64-bit entry point (`startup_64`): the boot vCPU's `rip`.
    pub entry: GuestAddress,
    /// The `boot_params` page: the boot vCPU's `rsi`.
    pub boot_params: GuestAddress,
    /// End of the loaded kernel image (highest `p_paddr + p_memsz`).
    pub kernel_end: u64,
    /// Where the initrd was placed and its size (`None` if empty).
    pub initrd: Option<(GuestAddress, u64)>,
    /// The ACPI RSDP.
    pub rsdp: GuestAddress,
}

/// Everything [`load_linux`] needs besides memory and the kernel.
#[derive(Debug, Clone, Copy)]
pub struct BootConfig<'a> {
    /// Kernel command line (see [`DEFAULT_CMDLINE`]).
    pub cmdline: &'a str,
    /// The initramfs (may be empty).
    pub initrd: &'a [u8],
    /// Guest RAM size in bytes, mapped per the module's convention.
    pub mem_size: u64,
    /// Number of vCPUs (for the MADT).
    pub vcpus: u8,
    /// The virtio-mmio devices to describe in the DSDT.
    pub devices: &'a [VirtioMmioDesc],
}

/// End (exclusive) of RAM below the MMIO gap.
pub fn low_ram_end(mem_size: u64) -> u64 {
    mem_size.min(layout::MMIO_GAP_START)
}

/// The e820 map for `mem_size` bytes of RAM.
pub fn e820_map(mem_size: u64) -> Vec<boot_e820_entry> {
    let low_end = low_ram_end(mem_size);
    let mut v = vec![
        boot_e820_entry {
            addr: layout::RAM_START,
            size: layout::EBDA_START - layout::RAM_START,
            r#type: E820_RAM,
        },
        boot_e820_entry {
            addr: layout::EBDA_START,
            size: layout::HIMEM_START - layout::EBDA_START,
            r#type: E820_RESERVED,
        },
    ];
    if low_end > layout::HIMEM_START {
        v.push(boot_e820_entry {
            addr: layout::HIMEM_START,
            size: low_end - layout::HIMEM_START,
            r#type: E820_RAM,
        });
    }
    if mem_size > layout::MMIO_GAP_START {
        v.push(boot_e820_entry {
            addr: FIRST_ADDR_PAST_32BITS,
            size: mem_size - layout::MMIO_GAP_START,
            r#type: E820_RAM,
        });
    }
    v
}

fn check_memory<M: GuestMemoryBackend>(mem: &M, mem_size: u64) -> Result<(), BootError> {
    if mem_size < 32 << 20 {
        return Err(BootError::Memory(format!(
            "{mem_size} bytes of RAM; at least 32 MiB are needed to boot Linux"
        )));
    }
    let low_end = low_ram_end(mem_size);
    let mut need = vec![(0u64, low_end)];
    if mem_size > layout::MMIO_GAP_START {
        need.push((FIRST_ADDR_PAST_32BITS, mem_size - layout::MMIO_GAP_START));
    }
    for (start, len) in need {
        let last = start + len - 1;
        if !mem.address_in_range(GuestAddress(start)) || !mem.address_in_range(GuestAddress(last)) {
            return Err(BootError::Memory(format!(
                "RAM {start:#x}..{:#x} is not mapped (mem_size {mem_size:#x})",
                last + 1
            )));
        }
    }
    Ok(())
}

/// Loads Linux into `mem`: the ELF kernel read from `kernel`, the command line, the initrd,
/// `boot_params` and the ACPI tables. Returns where to start.
pub fn load_linux<M, F>(
    mem: &M,
    kernel: &mut F,
    cfg: &BootConfig<'_>,
) -> Result<LinuxBoot, BootError>
where
    M: GuestMemoryBackend,
    F: Read + ReadVolatile + Seek,
{
    check_memory(mem, cfg.mem_size)?;

    // Command line.
    let cmdline = cfg.cmdline.as_bytes();
    if cmdline.contains(&0) {
        return Err(BootError::Cmdline("contains a NUL byte".into()));
    }
    if cmdline.len() + 1 > layout::CMDLINE_MAX {
        return Err(BootError::Cmdline(format!(
            "{} bytes; at most {}",
            cmdline.len(),
            layout::CMDLINE_MAX - 1
        )));
    }

    // Kernel: an uncompressed vmlinux (ELF, entered at its 64-bit entry) or a bzImage (its
    // protected-mode part loaded at 1 MiB, entered at `startup_64`, 0x200 further; it
    // decompresses itself in place, so `init_size` bytes from the load address stay free).
    let mut magic = [0u8; 4];
    kernel
        .read_exact(&mut magic)
        .and_then(|_| kernel.seek(std::io::SeekFrom::Start(0)))
        .map_err(|e| BootError::Kernel(KernelError::Read(e)))?;
    let himem = Some(GuestAddress(layout::HIMEM_START));
    let (entry, kernel_end, image_hdr) = if magic == *b"\x7fELF" {
        let loaded = Elf::load(mem, None, kernel, himem)
            .map_err(|e| BootError::Kernel(KernelError::Elf(e)))?;
        (loaded.kernel_load, loaded.kernel_end, None)
    } else {
        let loaded = BzImage::load(mem, None, kernel, himem)
            .map_err(|e| BootError::Kernel(KernelError::NotAKernel(e)))?;
        let hdr = loaded
            .setup_header
            .ok_or(BootError::Kernel(KernelError::NoSetupHeader))?;
        if hdr.xloadflags & XLF_KERNEL_64 == 0 {
            return Err(BootError::Kernel(KernelError::No64BitEntry));
        }
        let entry = loaded
            .kernel_load
            .0
            .checked_add(STARTUP_64_OFFSET)
            .map(GuestAddress)
            .ok_or(BootError::Kernel(KernelError::EntryOverflow))?;

        let end = loaded.kernel_end.max(
            loaded
                .kernel_load
                .0
                .saturating_add(u64::from(hdr.init_size)),
        );
        (entry, end, Some(hdr))
    };
    let low_end = low_ram_end(cfg.mem_size);
    if kernel_end > low_end {
        return Err(BootError::Memory(format!(
            "the kernel ends at {kernel_end:#x}, past the end of low RAM {low_end:#x}"
        )));
    }

    let mut cl = cmdline.to_vec();
    cl.push(0);
    mem.write_slice(&cl, GuestAddress(layout::CMDLINE_ADDR))
        .map_err(|e| BootError::Memory(format!("writing the command line: {e}")))?;

    // Initrd at the top of low RAM, page-aligned, above the kernel.
    let initrd = if cfg.initrd.is_empty() {
        None
    } else {
        let len = cfg.initrd.len() as u64;
        let addr = low_end
            .checked_sub(len)
            .map(|a| a & !(PAGE - 1))
            .filter(|a| *a >= kernel_end.next_multiple_of(PAGE))
            .ok_or_else(|| {
                BootError::Memory(format!(
                    "an initrd of {len} bytes does not fit between the kernel (ends {kernel_end:#x}) \
                     and the end of low RAM ({low_end:#x})"
                ))
            })?;
        mem.write_slice(cfg.initrd, GuestAddress(addr))
            .map_err(|e| BootError::Memory(format!("writing the initrd: {e}")))?;
        Some((GuestAddress(addr), len))
    };

    // ACPI.
    let tables = acpi::build(cfg.vcpus, cfg.devices)?;
    acpi::write(mem, &tables)?;

    // boot_params.
    let mut params = boot_params::default();
    if let Some(hdr) = image_hdr {
        // A bzImage's own header (setup_sects, version, init_size, ...) goes in first; the
        // loader's fields below are ours.
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    params.hdr.cmd_line_ptr = u32::try_from(layout::CMDLINE_ADDR)
        .map_err(|_| BootError::Cmdline("command line above 4 GiB".into()))?;
    params.hdr.cmdline_size =
        u32::try_from(cmdline.len()).map_err(|_| BootError::Cmdline("too long".into()))?;
    if let Some((addr, len)) = initrd {
        params.hdr.ramdisk_image =
            u32::try_from(addr.0).map_err(|_| BootError::Memory("initrd above 4 GiB".into()))?;
        params.hdr.ramdisk_size =
            u32::try_from(len).map_err(|_| BootError::Memory("initrd over 4 GiB".into()))?;
    }
    params.acpi_rsdp_addr = tables.rsdp_addr.0;
    let map = e820_map(cfg.mem_size);
    for (slot, e) in params.e820_table.iter_mut().zip(map.iter()) {
        *slot = *e;
    }
    params.e820_entries = u8::try_from(map.len()).unwrap_or(u8::MAX);
    mem.write_obj(params, GuestAddress(layout::BOOT_PARAMS_ADDR))
        .map_err(|e| BootError::Memory(format!("writing boot_params: {e}")))?;

    Ok(LinuxBoot {
        entry,
        boot_params: GuestAddress(layout::BOOT_PARAMS_ADDR),
        kernel_end,
        initrd,
        rsdp: tables.rsdp_addr,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::io::Cursor;

    use vm_memory::GuestMemoryMmap;

    use super::*;

    /// A small ELF: one PT_LOAD segment of `code` at physical 16 MiB, entry there.
    fn elf(code: &[u8], memsz: u64) -> Vec<u8> {
        crate::guest::kernel::tests_support::elf_with(code, memsz, 0xffff_ffff_8100_0000)
    }

    fn memory(size: u64) -> GuestMemoryMmap<()> {
        let low = low_ram_end(size);
        let mut ranges = vec![(GuestAddress(0), low as usize)];
        if size > layout::MMIO_GAP_START {
            ranges.push((
                GuestAddress(1 << 32),
                (size - layout::MMIO_GAP_START) as usize,
            ));
        }
        GuestMemoryMmap::from_ranges(&ranges).unwrap()
    }

    fn read_params(mem: &GuestMemoryMmap<()>) -> boot_params {
        mem.read_obj(GuestAddress(layout::BOOT_PARAMS_ADDR))
            .unwrap()
    }

    #[test]
    fn loads_kernel_cmdline_initrd_and_boot_params() {
        let size = 64 << 20;
        let mem = memory(size);
        let code = [0xf4u8; 100];
        let initrd = vec![0x5a; 3 * 4096 + 5];
        let devs = [VirtioMmioDesc::nth(0)];
        let boot = load_linux(
            &mem,
            &mut Cursor::new(elf(&code, 0x20_0000)),
            &BootConfig {
                cmdline: DEFAULT_CMDLINE,
                initrd: &initrd,
                mem_size: size,
                vcpus: 1,
                devices: &devs,
            },
        )
        .unwrap();
        assert_eq!(boot.entry, GuestAddress(0x100_0000));
        assert_eq!(boot.kernel_end, 0x120_0000);
        assert_eq!(boot.boot_params, GuestAddress(layout::BOOT_PARAMS_ADDR));
        let mut got = [0u8; 100];
        mem.read_slice(&mut got, GuestAddress(0x100_0000)).unwrap();
        assert_eq!(got, code);

        // Command line, NUL-terminated.
        let mut cl = vec![0u8; DEFAULT_CMDLINE.len() + 1];
        mem.read_slice(&mut cl, GuestAddress(layout::CMDLINE_ADDR))
            .unwrap();
        assert_eq!(&cl[..cl.len() - 1], DEFAULT_CMDLINE.as_bytes());
        assert_eq!(cl[cl.len() - 1], 0);

        // Initrd at the top of RAM, page-aligned.
        let (addr, len) = boot.initrd.unwrap();
        assert_eq!(len, initrd.len() as u64);
        assert_eq!(addr.0 % 4096, 0);
        assert!(addr.0 + len <= size && addr.0 + len > size - 4096);
        let mut back = vec![0u8; initrd.len()];
        mem.read_slice(&mut back, addr).unwrap();
        assert_eq!(back, initrd);

        // Header fields.
        let p = read_params(&mem);
        let h = p.hdr;
        assert_eq!({ h.boot_flag }, 0xaa55);
        assert_eq!({ h.header }, 0x5372_6448);
        assert_eq!({ h.type_of_loader }, 0xff);
        assert_eq!({ h.cmd_line_ptr }, layout::CMDLINE_ADDR as u32);
        assert_eq!({ h.cmdline_size }, DEFAULT_CMDLINE.len() as u32);
        assert_eq!({ h.ramdisk_image }, addr.0 as u32);
        assert_eq!({ h.ramdisk_size }, initrd.len() as u32);
        assert_eq!({ p.acpi_rsdp_addr }, layout::RSDP_ADDR);
        assert_eq!(boot.rsdp, GuestAddress(layout::RSDP_ADDR));

        // e820 in the zero page.
        let n = p.e820_entries as usize;
        let table: Vec<(u64, u64, u32)> = p.e820_table[..n]
            .iter()
            .map(|e| ({ e.addr }, { e.size }, { e.r#type }))
            .collect();
        assert_eq!(
            table,
            [
                (0, 0x9fc00, E820_RAM),
                (0x9fc00, 0x100000 - 0x9fc00, E820_RESERVED),
                (0x100000, size - 0x100000, E820_RAM)
            ]
        );

        // The RSDP is in guest memory where Linux scans for it, with a valid checksum.
        let mut rsdp = [0u8; 36];
        mem.read_slice(&mut rsdp, GuestAddress(layout::RSDP_ADDR))
            .unwrap();
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(acpi::checksum(&rsdp), 0);
    }

    /// A synthetic bzImage: 3 setup sectors, protocol 2.15, loaded high, 64-bit entry,
    /// `init_size` 8 MiB, then `payload` as the protected-mode part.
    fn bzimage(payload: &[u8], xloadflags: u16) -> Vec<u8> {
        let setup_sects = 3u8;
        let pm = (usize::from(setup_sects) + 1) * 512;
        let mut img = vec![0u8; pm + payload.len()];
        img[0x1f1] = setup_sects;
        img[0x202..0x206].copy_from_slice(b"HdrS");
        img[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        img[0x211] = 1; // loadflags: LOADED_HIGH
        img[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
        img[0x236..0x238].copy_from_slice(&xloadflags.to_le_bytes());
        img[0x260..0x264].copy_from_slice(&(8u32 << 20).to_le_bytes()); // init_size
        img[pm..].copy_from_slice(payload);
        img
    }

    #[test]
    fn loads_a_bzimage_at_1_mib_with_its_64_bit_entry() {
        let size = 64 << 20;
        let mem = memory(size);
        let payload = vec![0x90u8; 0x3000];
        let initrd = vec![0x5a; 4096];
        let cfg = BootConfig {
            cmdline: DEFAULT_CMDLINE,
            initrd: &initrd,
            mem_size: size,
            vcpus: 1,
            devices: &[],
        };
        let boot = load_linux(&mem, &mut Cursor::new(bzimage(&payload, 1)), &cfg).unwrap();
        assert_eq!(boot.entry, GuestAddress(0x10_0200));
        // The in-place decompression's room (init_size) is kept free of the initrd.
        assert_eq!(boot.kernel_end, 0x10_0000 + (8 << 20));
        let (initrd_at, _) = boot.initrd.unwrap();
        assert!(initrd_at.0 >= boot.kernel_end);
        let mut got = vec![0u8; payload.len()];
        mem.read_slice(&mut got, GuestAddress(0x10_0000)).unwrap();
        assert_eq!(got, payload);
        // The image's own header is in boot_params, with our loader fields over it.
        let params: boot_params = mem
            .read_obj(GuestAddress(layout::BOOT_PARAMS_ADDR))
            .unwrap();
        let (version, init_size, loader) = (
            params.hdr.version,
            params.hdr.init_size,
            params.hdr.type_of_loader,
        );
        assert_eq!((version, init_size, loader), (0x020f, 8 << 20, 0xff));
        // Without a 64-bit entry point it is refused, as is something that is neither format.
        assert!(matches!(
            load_linux(&mem, &mut Cursor::new(bzimage(&payload, 0)), &cfg),
            Err(BootError::Kernel(KernelError::No64BitEntry))
        ));
        assert!(matches!(
            load_linux(&mem, &mut Cursor::new(vec![7u8; 4096]), &cfg),
            Err(BootError::Kernel(KernelError::NotAKernel(_)))
        ));
    }

    #[test]
    fn e820_with_memory_above_the_gap() {
        let size = layout::MMIO_GAP_START + (256 << 20);
        let m = e820_map(size);
        let t: Vec<(u64, u64, u32)> = m
            .iter()
            .map(|e| ({ e.addr }, { e.size }, { e.r#type }))
            .collect();
        assert_eq!(
            t,
            [
                (0, 0x9fc00, E820_RAM),
                (0x9fc00, 0x60400, E820_RESERVED),
                (0x100000, layout::MMIO_GAP_START - 0x100000, E820_RAM),
                (1 << 32, 256 << 20, E820_RAM)
            ]
        );
        // RAM never overlaps the MMIO gap.
        for e in &m {
            let (a, s) = ({ e.addr }, { e.size });
            assert!(a + s <= layout::MMIO_GAP_START || a >= 1 << 32);
        }
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let size = 64 << 20;
        let mem = memory(size);
        let good = elf(&[0xf4], 0x1000);
        let cfg = |cmdline: &'static str, initrd: &'static [u8]| BootConfig {
            cmdline,
            initrd,
            mem_size: size,
            vcpus: 1,
            devices: &[],
        };
        // Garbage kernel, truncated kernel.
        let r = load_linux(&mem, &mut Cursor::new(vec![0u8; 4096]), &cfg("", b""));
        assert!(
            matches!(r, Err(BootError::Kernel(KernelError::NotAKernel(_)))),
            "{r:?}"
        );
        let r = load_linux(
            &mem,
            &mut Cursor::new(good[..good.len() - 1].to_vec()),
            &cfg("", b""),
        );
        assert!(
            matches!(r, Err(BootError::Kernel(KernelError::Elf(_)))),
            "{r:?}"
        );
        let r = load_linux(&mem, &mut Cursor::new(good[..100].to_vec()), &cfg("", b""));
        assert!(
            matches!(r, Err(BootError::Kernel(KernelError::Elf(_)))),
            "{r:?}"
        );
        // Too short to hold even the magic: the read fails, with the I/O error kept.
        let r = load_linux(&mem, &mut Cursor::new(vec![0x7fu8, b'E']), &cfg("", b""));
        assert!(
            matches!(r, Err(BootError::Kernel(KernelError::Read(_)))),
            "{r:?}"
        );
        // A kernel segment outside guest memory.
        let mut far = good.clone();
        far[64 + 24..64 + 32].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(load_linux(&mem, &mut Cursor::new(far), &cfg("", b"")).is_err());
        // Command line with NUL, too long.
        assert!(matches!(
            load_linux(&mem, &mut Cursor::new(good.clone()), &cfg("a\0b", b"")),
            Err(BootError::Cmdline(_))
        ));
        let long: &'static str = Box::leak("x".repeat(layout::CMDLINE_MAX).into_boxed_str());
        assert!(matches!(
            load_linux(&mem, &mut Cursor::new(good.clone()), &cfg(long, b"")),
            Err(BootError::Cmdline(_))
        ));
        // An initrd that does not fit.
        let huge: &'static [u8] = Box::leak(vec![0u8; 60 << 20].into_boxed_slice());
        assert!(matches!(
            load_linux(&mem, &mut Cursor::new(good.clone()), &cfg("", huge)),
            Err(BootError::Memory(_))
        ));
        // mem_size larger than the memory actually mapped; too little memory.
        let r = load_linux(
            &mem,
            &mut Cursor::new(good.clone()),
            &BootConfig {
                mem_size: 128 << 20,
                ..cfg("", b"")
            },
        );
        assert!(matches!(r, Err(BootError::Memory(_))), "{r:?}");
        let small = memory(16 << 20);
        let r = load_linux(
            &small,
            &mut Cursor::new(good),
            &BootConfig {
                mem_size: 16 << 20,
                ..cfg("", b"")
            },
        );
        assert!(matches!(r, Err(BootError::Memory(_))), "{r:?}");
    }
}
