//! 64-bit CPU setup done by the host: GDT, identity page tables, control registers,
//! segments, CPUID, boot MSRs and the local APIC.
//!
//! Two modes:
//! * [`CpuMode::User`]: the vCPU starts at CPL 3 (user code/data segments, user-accessible
//!   pages, RFLAGS.IOPL = 3 so `in`/`out` work). Used for tiny guests: on nested PVM-style
//!   KVM only user mode runs at native speed. There is no IDT: any exception triple-faults.
//! * [`CpuMode::Kernel`]: CPL 0 flat 64-bit segments as the Linux 64-bit boot protocol
//!   expects (`rip` = entry, `rsi` = boot_params).

use std::sync::OnceLock;

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, CpuId, Msrs};
use kvm_ioctls::{Kvm, VcpuFd};
use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout;
use crate::vmm::error::{Result, VmmError};

/// How a vCPU starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum CpuMode {
    /// CPL 3 with IOPL 3: tiny guests.
    User,
    /// CPL 0, the Linux 64-bit boot protocol.
    Kernel,
}

// GDT selectors.
const KERNEL_CS: u16 = 0x08;
const KERNEL_DS: u16 = 0x10;
/// Kernel-mode TSS (entry 3).
const KERNEL_TSS: u16 = 0x18;
const USER_DS: u16 = 0x18 | 3;
const USER_CS: u16 = 0x20 | 3;
/// User-mode TSS (entries 5-6).
const USER_TSS: u16 = 0x28;

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

const PTE_PRESENT: u64 = 1;
const PTE_RW: u64 = 1 << 1;
const PTE_USER: u64 = 1 << 2;
const PTE_PS: u64 = 1 << 7;

/// Encodes one GDT descriptor from access/flags bits, base and limit.
fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = u64::from(base);
    let limit = u64::from(limit);
    let flags = u64::from(flags);
    ((base & 0xff00_0000) << 32)
        | ((flags & 0xf0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
}

/// Decodes a descriptor into the segment KVM wants.
fn segment(entry: u64, selector: u16) -> kvm_segment {
    let base = ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000);
    let limit_raw = (entry & 0xffff) | ((entry >> 32) & 0x000f_0000);
    let g = ((entry >> 55) & 1) as u8;
    let limit = if g == 1 {
        ((limit_raw as u32) << 12) | 0xfff
    } else {
        limit_raw as u32
    };
    kvm_segment {
        base,
        limit,
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        unusable: u8::from(((entry >> 47) & 1) == 0),
        padding: 0,
    }
}

fn write_u64(mem: &GuestMemoryMmap, addr: u64, v: u64) -> Result<()> {
    mem.write_obj(v, GuestAddress(addr))
        .map_err(|e| VmmError::memory(format!("writing boot structures at {addr:#x}: {e}")))
}

/// Writes the GDT (and for kernel mode the empty IDT) and returns the segments to load.
struct Segments {
    cs: kvm_segment,
    ds: kvm_segment,
    tr: kvm_segment,
    gdt_limit: u16,
}

fn write_gdt(mem: &GuestMemoryMmap, mode: CpuMode) -> Result<Segments> {
    let kcode = gdt_entry(0xa09b, 0, 0xfffff);
    let kdata = gdt_entry(0xc093, 0, 0xfffff);
    match mode {
        CpuMode::Kernel => {
            let tss = gdt_entry(0x808b, 0, 0xfffff);
            let gdt = [0, kcode, kdata, tss];
            for (i, e) in gdt.iter().enumerate() {
                write_u64(mem, layout::GDT_ADDR + 8 * i as u64, *e)?;
            }
            write_u64(mem, layout::IDT_ADDR, 0)?;
            Ok(Segments {
                cs: segment(kcode, KERNEL_CS),
                ds: segment(kdata, KERNEL_DS),
                tr: segment(tss, KERNEL_TSS),
                gdt_limit: (gdt.len() * 8 - 1) as u16,
            })
        }
        CpuMode::User => {
            // The user-mode GDT is longer (it runs past IDT_ADDR); user mode loads an IDT
            // with limit 0, so nothing is ever read from IDT_ADDR.
            let udata = gdt_entry(0xc0f3, 0, 0xfffff);
            let ucode = gdt_entry(0xa0fb, 0, 0xfffff);
            // A 64-bit TSS descriptor takes two slots. The TSS carries an all-zero I/O
            // permission bitmap (every port allowed): IOPL = 3 already allows `in`/`out` at
            // CPL 3, but nested PVM-style KVM consults the bitmap.
            write_user_tss(mem)?;
            let tss = gdt_entry(0x008b, USER_TSS_ADDR as u32, USER_TSS_LIMIT);
            let gdt = [0, kcode, kdata, udata, ucode, tss, 0];
            for (i, e) in gdt.iter().enumerate() {
                write_u64(mem, layout::GDT_ADDR + 8 * i as u64, *e)?;
            }
            Ok(Segments {
                cs: segment(ucode, USER_CS),
                ds: segment(udata, USER_DS),
                tr: segment(tss, USER_TSS),
                gdt_limit: (gdt.len() * 8 - 1) as u16,
            })
        }
    }
}

/// Where the user-mode TSS (with its I/O bitmap) goes: free low memory in user mode.
const USER_TSS_ADDR: u64 = 0x1000;
/// TSS limit: 104-byte TSS + 8 KiB bitmap + the terminating 0xff byte.
const USER_TSS_LIMIT: u32 = 0x68 + 8192;

fn write_user_tss(mem: &GuestMemoryMmap) -> Result<()> {
    let mut tss = vec![0u8; USER_TSS_LIMIT as usize + 1];
    // I/O map base at offset 0x66: right after the 104-byte TSS.
    tss[0x66..0x68].copy_from_slice(&0x68u16.to_le_bytes());
    if let Some(last) = tss.last_mut() {
        *last = 0xff;
    }
    mem.write_slice(&tss, GuestAddress(USER_TSS_ADDR))
        .map_err(|e| VmmError::memory(format!("writing the TSS: {e}")))
}

/// Identity-maps the first 4 GiB with 2 MiB pages: PML4, one PDPT and four PDs at
/// `layout::PAGE_TABLES_ADDR`. Returns CR3.
fn write_page_tables(mem: &GuestMemoryMmap, user: bool) -> Result<u64> {
    let pml4 = layout::PAGE_TABLES_ADDR;
    let pdpt = pml4 + 0x1000;
    let pd0 = pml4 + 0x2000;
    let flags = PTE_PRESENT | PTE_RW | if user { PTE_USER } else { 0 };
    write_u64(mem, pml4, pdpt | flags)?;
    for i in 0..4u64 {
        let pd = pd0 + i * 0x1000;
        write_u64(mem, pdpt + i * 8, pd | flags)?;
        let mut page = [0u8; 4096];
        for j in 0..512u64 {
            let addr = ((i * 512 + j) << 21) | flags | PTE_PS;
            let o = (j * 8) as usize;
            page[o..o + 8].copy_from_slice(&addr.to_le_bytes());
        }
        mem.write_slice(&page, GuestAddress(pd))
            .map_err(|e| VmmError::memory(format!("writing page tables: {e}")))?;
    }
    Ok(pml4)
}

/// Writes the boot structures into guest memory (shared by all vCPUs) and returns the
/// special registers template for `mode`, derived from `base` (the vCPU's reset sregs).
pub fn boot_sregs(mem: &GuestMemoryMmap, mode: CpuMode, base: kvm_sregs) -> Result<kvm_sregs> {
    let segs = write_gdt(mem, mode)?;
    let cr3 = write_page_tables(mem, mode == CpuMode::User)?;
    let mut s = base;
    s.gdt.base = layout::GDT_ADDR;
    s.gdt.limit = segs.gdt_limit;
    s.idt.base = layout::IDT_ADDR;
    s.idt.limit = match mode {
        CpuMode::Kernel => 7,
        CpuMode::User => 0,
    };
    s.cs = segs.cs;
    s.ds = segs.ds;
    s.es = segs.ds;
    s.fs = segs.ds;
    s.gs = segs.ds;
    s.ss = segs.ds;
    s.tr = segs.tr;
    s.cr3 = cr3;
    s.efer |= EFER_LME | EFER_LMA;
    match mode {
        CpuMode::Kernel => {
            s.cr0 |= CR0_PE | CR0_PG;
            s.cr4 |= CR4_PAE;
        }
        CpuMode::User => {
            s.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
            s.cr4 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT;
        }
    }
    Ok(s)
}

/// General registers at start.
pub fn boot_regs(mode: CpuMode, entry: u64, stack_top: u64, arg0: u64, arg1: u64) -> kvm_regs {
    match mode {
        CpuMode::Kernel => kvm_regs {
            rflags: 0x2,
            rip: entry,
            rsp: stack_top,
            rbp: stack_top,
            rsi: layout::BOOT_PARAMS_ADDR,
            ..Default::default()
        },
        CpuMode::User => kvm_regs {
            // Bit 1 is reserved-set; IOPL = 3 lets CPL 3 code use in/out.
            rflags: 0x2 | 0x3000,
            rip: entry,
            rsp: stack_top,
            rdi: arg0,
            rsi: arg1,
            ..Default::default()
        },
    }
}

/// Initial FPU state (x87 control word and MXCSR defaults).
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// `KVM_GET_SUPPORTED_CPUID` (~0.3 ms here), asked once per process: the answer depends on
/// the host CPU and the KVM module, neither of which changes under a running process. A
/// failure is not cached.
fn supported_cpuid(kvm: &Kvm) -> Result<CpuId> {
    static SUPPORTED: OnceLock<CpuId> = OnceLock::new();
    if let Some(c) = SUPPORTED.get() {
        return Ok(c.clone());
    }
    let c = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(VmmError::kvm("get supported cpuid"))?;
    Ok(SUPPORTED.get_or_init(|| c).clone())
}

/// `KVM_GET_MSR_INDEX_LIST`, asked once per process (like [`supported_cpuid`]).
pub(crate) fn msr_index_list(kvm: &Kvm) -> Result<&'static [u32]> {
    static LIST: OnceLock<Vec<u32>> = OnceLock::new();
    if let Some(l) = LIST.get() {
        return Ok(l);
    }
    let l = kvm
        .get_msr_index_list()
        .map_err(VmmError::kvm("get msr index list"))?
        .as_slice()
        .to_vec();
    Ok(LIST.get_or_init(|| l))
}

/// The CPUID the guest sees: what KVM supports, with the APIC ID set per vCPU, the
/// hypervisor bit on and features this host's nested KVM refuses (the
/// `IA32_ARCH_CAPABILITIES` MSR) hidden.
pub fn guest_cpuid(kvm: &Kvm, vcpu_id: u8, vcpu_count: u8) -> Result<CpuId> {
    let mut cpuid = supported_cpuid(kvm)?;
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff)
                    | (u32::from(vcpu_id) << 24)
                    | (u32::from(vcpu_count.max(1)) << 16);
                e.ecx |= 1 << 31; // hypervisor
            }
            7 if e.index == 0 => {
                // ARCH_CAPABILITIES; AMX (keeps the XSAVE area within KVM_GET_XSAVE's
                // 4 KiB, which snapshots rely on).
                e.edx &= !((1 << 29) | (1 << 22) | (1 << 24) | (1 << 25));
            }
            0xd if e.index == 0 => {
                e.eax &= !((1 << 17) | (1 << 18)); // XTILECFG, XTILEDATA
            }
            0xb => {
                e.edx = u32::from(vcpu_id);
            }
            _ => {}
        }
    }
    Ok(cpuid)
}

// Boot MSRs (Linux expects sane values; the 64-bit entry does not set them).
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;

/// Sets the boot MSRs that KVM reports as settable on this host (kernel mode only).
pub fn set_boot_msrs(kvm: &Kvm, vcpu: &VcpuFd) -> Result<()> {
    let supported = msr_index_list(kvm)?;
    let wanted = [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, 1),          // fast strings
        (MSR_MTRR_DEF_TYPE, (1 << 11) | 6), // MTRRs on, default write-back
    ];
    let entries: Vec<kvm_msr_entry> = wanted
        .iter()
        .filter(|(i, _)| supported.contains(i))
        .map(|&(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    set_msrs_tolerant(vcpu, &entries)
}

/// Sets MSRs one batch at a time, skipping any single MSR the host refuses (nested KVM
/// refuses some that it lists). Never fails on a refused MSR.
pub fn set_msrs_tolerant(vcpu: &VcpuFd, entries: &[kvm_msr_entry]) -> Result<()> {
    let mut rest = entries;
    while !rest.is_empty() {
        let msrs = Msrs::from_entries(rest)
            .map_err(|e| VmmError::InvalidConfig(format!("MSR list: {e:?}")))?;
        let n = vcpu.set_msrs(&msrs).map_err(VmmError::kvm("set msrs"))?;
        if n >= rest.len() {
            break;
        }
        // Entry n was refused: skip it.
        tracing::debug!(msr = rest[n].index, "host refused an MSR; skipped");
        rest = &rest[n + 1..];
    }
    Ok(())
}

/// Reads the given MSRs, dropping any the host refuses to read. Returns the readable ones.
pub fn get_msrs_tolerant(vcpu: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let entries: Vec<kvm_msr_entry> = rest
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries)
            .map_err(|e| VmmError::InvalidConfig(format!("MSR list: {e:?}")))?;
        let n = vcpu
            .get_msrs(&mut msrs)
            .map_err(VmmError::kvm("get msrs"))?;
        out.extend_from_slice(&msrs.as_slice()[..n.min(rest.len())]);
        if n >= rest.len() {
            break;
        }
        rest = &rest[n + 1..];
    }
    Ok(out)
}

// Local APIC register offsets and delivery modes.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(regs: &[i8], off: usize) -> u32 {
    let mut b = [0u8; 4];
    for (i, x) in b.iter_mut().enumerate() {
        *x = regs.get(off + i).copied().unwrap_or(0) as u8;
    }
    u32::from_le_bytes(b)
}

fn set_lapic_reg(regs: &mut [i8], off: usize, v: u32) {
    for (i, x) in v.to_le_bytes().iter().enumerate() {
        if let Some(r) = regs.get_mut(off + i) {
            *r = *x as i8;
        }
    }
}

/// Configures LINT0 as ExtINT and LINT1 as NMI (needs the in-kernel irqchip).
pub fn set_lint(vcpu: &VcpuFd) -> Result<()> {
    let mut lapic = vcpu.get_lapic().map_err(VmmError::kvm("get lapic"))?;
    let lvt0 = lapic_reg(&lapic.regs, APIC_LVT0);
    set_lapic_reg(
        &mut lapic.regs,
        APIC_LVT0,
        (lvt0 & !0x700) | (APIC_MODE_EXTINT << 8),
    );
    let lvt1 = lapic_reg(&lapic.regs, APIC_LVT1);
    set_lapic_reg(
        &mut lapic.regs,
        APIC_LVT1,
        (lvt1 & !0x700) | (APIC_MODE_NMI << 8),
    );
    vcpu.set_lapic(&lapic).map_err(VmmError::kvm("set lapic"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_to_flat_64bit_segments() {
        let code = segment(gdt_entry(0xa09b, 0, 0xfffff), KERNEL_CS);
        assert_eq!(
            (code.l, code.db, code.dpl, code.type_, code.s),
            (1, 0, 0, 0xb, 1)
        );
        assert_eq!(code.limit, 0xffff_ffff);
        assert_eq!(code.present, 1);
        let udata = segment(gdt_entry(0xc0f3, 0, 0xfffff), USER_DS);
        assert_eq!((udata.dpl, udata.type_, udata.db), (3, 3, 1));
        let tss = segment(gdt_entry(0x008b, 0x1000, USER_TSS_LIMIT), USER_TSS);
        assert_eq!(
            (tss.type_, tss.s, tss.limit, tss.g, tss.base),
            (0xb, 0, USER_TSS_LIMIT, 0, 0x1000)
        );
    }

    #[test]
    fn lapic_reg_roundtrip() {
        let mut regs = [0i8; 1024];
        set_lapic_reg(&mut regs, APIC_LVT1, 0x0000_0400);
        assert_eq!(lapic_reg(&regs, APIC_LVT1), 0x400);
    }
}
