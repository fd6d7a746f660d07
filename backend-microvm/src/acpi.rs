//! ACPI tables describing the microVM to a Linux guest: RSDP → XSDT → FADT (hardware-reduced:
//! no PM blocks, no 8042, no VGA) → DSDT, and MADT (one local APIC per vCPU and the IOAPIC).
//!
//! Debian's kernel has no virtio-mmio command-line devices, so each virtio-mmio device is a
//! DSDT device with `_HID "LNRO0005"` (the ID Linux's `virtio_mmio` driver matches through
//! ACPI), `_UID`, and `_CRS` = `Memory32Fixed(ReadWrite, base, size)` + an extended
//! `Interrupt(ResourceConsumer, Edge, ActiveHigh, Exclusive)`: edge-triggered because the VMM
//! raises device interrupts through `irqfd` without a resample fd, like Firecracker. COM1 is
//! described as `PNP0501` with its I/O ports and IRQ 4.
//!
//! The RSDP sits at [`layout::RSDP_ADDR`] (inside the BIOS area Linux scans; its address also
//! goes into `boot_params.acpi_rsdp_addr`), the other tables from [`layout::ACPI_TABLES_ADDR`]
//! up, all below 1 MiB in the e820-reserved range.

use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{aml, Aml, AmlSink};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::layout;

const OEM_ID: [u8; 6] = *b"AGSBX ";
const OEM_TABLE_ID: [u8; 8] = *b"MICROVM ";
const OEM_REVISION: u32 = 1;
/// End (exclusive) of the area the tables may use.
const ACPI_AREA_END: u64 = 0x10_0000;
/// Most virtio-mmio devices described (device names are `V000`..`V03F`).
pub const MAX_DEVICES: usize = 64;
/// Most vCPUs described in the MADT (APIC ids are 8-bit; 254 is the IOAPIC's id).
pub const MAX_VCPUS: u8 = 254;

/// One virtio-mmio device window and its interrupt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioMmioDesc {
    /// Guest-physical base of the register window (must be below 4 GiB).
    pub base: u64,
    /// Size of the window.
    pub size: u64,
    /// GSI (IOAPIC pin) of its interrupt.
    pub irq: u32,
}

impl VirtioMmioDesc {
    /// Device `n` of the standard layout: window `VIRTIO_MMIO_BASE + n * VIRTIO_MMIO_SIZE`,
    /// IRQ `VIRTIO_IRQ_BASE + n`.
    pub fn nth(n: u32) -> Self {
        VirtioMmioDesc {
            base: layout::VIRTIO_MMIO_BASE + u64::from(n) * layout::VIRTIO_MMIO_SIZE,
            size: layout::VIRTIO_MMIO_SIZE,
            irq: layout::VIRTIO_IRQ_BASE + n,
        }
    }

    /// The kernel command-line form (`virtio_mmio.device=4K@0xd0000000:5`), for kernels that
    /// have `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES` (Debian's does not; ACPI is used instead).
    pub fn cmdline_form(&self) -> String {
        format!(
            "virtio_mmio.device={}K@{:#x}:{}",
            self.size / 1024,
            self.base,
            self.irq
        )
    }
}

/// Errors while building or writing ACPI tables.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AcpiError {
    /// The configuration cannot be described.
    #[error("invalid ACPI configuration: {0}")]
    Invalid(String),
    /// The tables do not fit in the reserved area.
    #[error("ACPI tables need {needed} bytes, {available} are reserved")]
    TooBig {
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// Writing into guest memory failed (memory too small?).
    #[error("writing ACPI tables into guest memory at {addr:#x}: {reason}")]
    Memory {
        /// Guest address.
        addr: u64,
        /// Why.
        reason: String,
    },
}

/// The tables, ready to be written at their guest addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcpiTables {
    /// Where the RSDP goes.
    pub rsdp_addr: GuestAddress,
    /// `(address, signature, bytes)` of every table, the RSDP first.
    pub tables: Vec<(GuestAddress, [u8; 4], Vec<u8>)>,
}

impl AcpiTables {
    /// The bytes of the table with this signature (`b"DSDT"`, `b"RSD "` for the RSDP).
    pub fn get(&self, sig: &[u8; 4]) -> Option<&[u8]> {
        self.tables
            .iter()
            .find(|(_, s, _)| s == sig)
            .map(|(_, _, b)| b.as_slice())
    }
}

fn aml_bytes(a: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    a.to_aml_bytes(&mut v);
    v
}

/// The DSDT's AML body: `\_SB_` with COM1 and every virtio-mmio device.
fn dsdt_body(devices: &[VirtioMmioDesc]) -> Result<Vec<u8>, AcpiError> {
    let mut body = Vec::new();
    // COM1 (the 8250 the VMM emulates): legacy ports 0x3f8-0x3ff, IRQ 4.
    let com_io = aml::IO::new(layout::SERIAL_PORT, layout::SERIAL_PORT, 1, 8);
    let com_irq = aml::Interrupt::new(true, true, false, false, layout::SERIAL_IRQ);
    let com_crs = aml::ResourceTemplate::new(vec![&com_io, &com_irq]);
    let com_hid = aml::EISAName::new("PNP0501");
    let com_uid = 0u8;
    let com_hid_n = aml::Name::new("_HID".into(), &com_hid);
    let com_uid_n = aml::Name::new("_UID".into(), &com_uid);
    let com_crs_n = aml::Name::new("_CRS".into(), &com_crs);
    let com = aml::Device::new("COM1".into(), vec![&com_hid_n, &com_uid_n, &com_crs_n]);
    let mut devs: Vec<Vec<u8>> = vec![aml_bytes(&com)];
    for (i, d) in devices.iter().enumerate() {
        let base = u32::try_from(d.base)
            .ok()
            .filter(|_| d.base.checked_add(d.size).is_some_and(|e| e <= 1 << 32))
            .ok_or_else(|| {
                AcpiError::Invalid(format!(
                    "virtio-mmio window {:#x} is not below 4 GiB",
                    d.base
                ))
            })?;
        let size = u32::try_from(d.size)
            .ok()
            .filter(|s| *s > 0)
            .ok_or_else(|| AcpiError::Invalid(format!("virtio-mmio window size {:#x}", d.size)))?;
        let hid: String = "LNRO0005".into();
        let uid = u32::try_from(i).unwrap_or(u32::MAX);
        let mem = aml::Memory32Fixed::new(true, base, size);
        let irq = aml::Interrupt::new(true, true, false, false, d.irq);
        let crs = aml::ResourceTemplate::new(vec![&mem, &irq]);
        let hid_n = aml::Name::new("_HID".into(), &hid);
        let uid_n = aml::Name::new("_UID".into(), &uid);
        let crs_n = aml::Name::new("_CRS".into(), &crs);
        let name = format!("V{i:03X}");
        let dev = aml::Device::new(name.as_str().into(), vec![&hid_n, &uid_n, &crs_n]);
        devs.push(aml_bytes(&dev));
    }
    struct Raw(Vec<u8>);
    impl Aml for Raw {
        fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
            sink.vec(&self.0);
        }
    }
    let raws: Vec<Raw> = devs.into_iter().map(Raw).collect();
    let children: Vec<&dyn Aml> = raws.iter().map(|r| r as &dyn Aml).collect();
    let sb = aml::Scope::new("\\_SB_".into(), children);
    sb.to_aml_bytes(&mut body);
    Ok(body)
}

/// Builds the tables for `vcpus` vCPUs and the given virtio-mmio devices.
pub fn build(vcpus: u8, devices: &[VirtioMmioDesc]) -> Result<AcpiTables, AcpiError> {
    if vcpus == 0 || vcpus > MAX_VCPUS {
        return Err(AcpiError::Invalid(format!(
            "{vcpus} vCPUs (1 to {MAX_VCPUS})"
        )));
    }
    if devices.len() > MAX_DEVICES {
        return Err(AcpiError::Invalid(format!(
            "{} virtio-mmio devices (at most {MAX_DEVICES})",
            devices.len()
        )));
    }
    let mut at = layout::ACPI_TABLES_ADDR;
    let mut tables = Vec::new();
    let mut place = |sig: [u8; 4], bytes: Vec<u8>| -> Result<u64, AcpiError> {
        let addr = at;
        let end = addr.saturating_add(bytes.len() as u64);
        if end > ACPI_AREA_END {
            return Err(AcpiError::TooBig {
                needed: end - layout::ACPI_TABLES_ADDR,
                available: ACPI_AREA_END - layout::ACPI_TABLES_ADDR,
            });
        }
        at = end.next_multiple_of(16);
        tables.push((GuestAddress(addr), sig, bytes));
        Ok(addr)
    };

    // DSDT.
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    dsdt.append_slice(&dsdt_body(devices)?);
    dsdt.update_checksum();
    let dsdt_addr = place(*b"DSDT", dsdt.as_slice().to_vec())?;

    // FADT: hardware-reduced ACPI; IA-PC boot flags: no VGA (bit 2), no MSI (bit 3), no
    // ASPM control (bit 4); no 8042 (bit 1 clear) so Linux does not probe a keyboard
    // controller (reboot=k still resets through port 0x64, which the VMM catches).
    let mut fadt = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    fadt.iapc_boot_arch = ((1u16 << 2) | (1 << 3) | (1 << 4)).into();
    fadt.hypervisor_vendor_identity = u64::from_le_bytes(*b"AGSANDBX").into();
    let fadt = fadt.finalize();
    let fadt_addr = place(*b"FACP", aml_bytes(&fadt))?;

    // MADT: LAPIC per vCPU (uid = APIC id = index), the IOAPIC (id = vcpus, GSI base 0).
    let lapic = u32::try_from(layout::LAPIC_ADDR)
        .map_err(|_| AcpiError::Invalid("LAPIC above 4 GiB".into()))?;
    let ioapic = u32::try_from(layout::IOAPIC_ADDR)
        .map_err(|_| AcpiError::Invalid("IOAPIC above 4 GiB".into()))?;
    let mut madt = MADT::new(
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
        LocalInterruptController::Address(lapic),
    );
    for cpu in 0..vcpus {
        madt.add_structure(ProcessorLocalApic::new(cpu, cpu, EnabledStatus::Enabled));
    }
    madt.add_structure(IoApic::new(vcpus, ioapic, 0));
    let madt_addr = place(*b"APIC", aml_bytes(&madt))?;

    // XSDT.
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    for a in [fadt_addr, madt_addr] {
        xsdt.add_entry(a);
    }
    let xsdt_addr = place(*b"XSDT", aml_bytes(&xsdt))?;

    let rsdp = Rsdp::new(OEM_ID, xsdt_addr);
    tables.insert(
        0,
        (GuestAddress(layout::RSDP_ADDR), *b"RSD ", aml_bytes(&rsdp)),
    );
    if layout::RSDP_ADDR + 36 > layout::ACPI_TABLES_ADDR {
        return Err(AcpiError::Invalid("RSDP overlaps the tables".into()));
    }
    Ok(AcpiTables {
        rsdp_addr: GuestAddress(layout::RSDP_ADDR),
        tables,
    })
}

/// Writes the tables into guest memory.
pub fn write<M: GuestMemoryBackend>(mem: &M, t: &AcpiTables) -> Result<(), AcpiError> {
    for (addr, _, bytes) in &t.tables {
        mem.write_slice(bytes, *addr)
            .map_err(|e| AcpiError::Memory {
                addr: addr.0,
                reason: e.to_string(),
            })?;
    }
    Ok(())
}

/// Sums bytes mod 256 (a valid ACPI table sums to 0).
pub fn checksum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn le32(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }
    fn le64(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    fn two_devices() -> Vec<VirtioMmioDesc> {
        vec![VirtioMmioDesc::nth(0), VirtioMmioDesc::nth(1)]
    }

    #[test]
    fn tables_have_valid_checksums_lengths_and_links() {
        let t = build(2, &two_devices()).unwrap();
        let rsdp = t.get(b"RSD ").unwrap();
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(rsdp.len(), 36);
        assert_eq!(checksum(&rsdp[..20]), 0);
        assert_eq!(checksum(rsdp), 0);
        assert_eq!(rsdp[15], 2, "revision 2 (XSDT)");
        for sig in [b"DSDT", b"FACP", b"APIC", b"XSDT"] {
            let b = t.get(sig).unwrap();
            assert_eq!(&b[..4], sig);
            assert_eq!(le32(b, 4) as usize, b.len(), "{sig:?} length");
            assert_eq!(checksum(b), 0, "{sig:?} checksum");
        }
        // RSDP -> XSDT -> FACP, APIC; FACP -> DSDT.
        let addr_of = |sig: &[u8; 4]| t.tables.iter().find(|x| &x.1 == sig).unwrap().0 .0;
        assert_eq!(le64(rsdp, 24), addr_of(b"XSDT"));
        let xsdt = t.get(b"XSDT").unwrap();
        assert_eq!(
            [le64(xsdt, 36), le64(xsdt, 44)],
            [addr_of(b"FACP"), addr_of(b"APIC")]
        );
        let fadt = t.get(b"FACP").unwrap();
        assert_eq!(le64(fadt, 140), addr_of(b"DSDT"), "X_DSDT");
        assert_ne!(le32(fadt, 112) & (1 << 20), 0, "HW_REDUCED_ACPI");
        // All tables in the reserved BIOS area, not overlapping.
        let mut spans: Vec<(u64, u64)> = t
            .tables
            .iter()
            .map(|(a, _, b)| (a.0, a.0 + b.len() as u64))
            .collect();
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0);
        }
        assert!(spans
            .iter()
            .all(|s| s.0 >= layout::RSDP_ADDR && s.1 <= 0x10_0000));
    }

    #[test]
    fn madt_lists_each_vcpu_and_the_ioapic() {
        let t = build(3, &[]).unwrap();
        let m = t.get(b"APIC").unwrap();
        assert_eq!(le32(m, 36) as u64, layout::LAPIC_ADDR);
        let mut at = 44;
        let mut lapics = Vec::new();
        let mut ioapics = Vec::new();
        while at < m.len() {
            let (ty, len) = (m[at], m[at + 1] as usize);
            match ty {
                0 => lapics.push((m[at + 2], m[at + 3], le32(m, at + 4))),
                1 => ioapics.push((m[at + 2], le32(m, at + 4), le32(m, at + 8))),
                other => panic!("unexpected MADT entry {other}"),
            }
            at += len;
        }
        assert_eq!(lapics, [(0, 0, 1), (1, 1, 1), (2, 2, 1)]);
        assert_eq!(ioapics, [(3, layout::IOAPIC_ADDR as u32, 0)]);
    }

    #[test]
    fn dsdt_describes_each_virtio_device() {
        let devs = two_devices();
        let t = build(1, &devs).unwrap();
        let d = t.get(b"DSDT").unwrap();
        let find = |pat: &[u8]| d.windows(pat.len()).position(|w| w == pat);
        assert!(find(b"LNRO0005\0").is_some());
        assert!(find(b"V000").is_some() && find(b"V001").is_some());
        assert!(find(b"COM1").is_some());
        for dev in &devs {
            // Memory32Fixed descriptor: 0x86, len 9, RW, base, size.
            let mut m = vec![0x86, 9, 0, 1];
            m.extend_from_slice(&(dev.base as u32).to_le_bytes());
            m.extend_from_slice(&(dev.size as u32).to_le_bytes());
            assert!(find(&m).is_some(), "{dev:?}");
            // Extended interrupt: 0x89, len 6, consumer+edge, one IRQ.
            let mut i = vec![0x89, 6, 0, 0b11, 1];
            i.extend_from_slice(&dev.irq.to_le_bytes());
            assert!(find(&i).is_some(), "{dev:?}");
        }
    }

    #[test]
    fn bad_configurations_are_errors() {
        assert!(build(0, &[]).is_err());
        assert!(build(255, &[]).is_err());
        let high = VirtioMmioDesc {
            base: 1 << 32,
            size: 0x1000,
            irq: 5,
        };
        assert!(build(1, &[high]).is_err());
        let devs: Vec<_> = (0..65).map(VirtioMmioDesc::nth).collect();
        assert!(build(1, &devs).is_err());
        assert!(build(254, &(0..64).map(VirtioMmioDesc::nth).collect::<Vec<_>>()).is_ok());
    }

    #[test]
    fn iasl_decompiles_the_dsdt_when_installed() {
        // acpica-tools is installed by scripts/test.sh in CI; skip quietly elsewhere.
        if std::process::Command::new("iasl")
            .arg("-v")
            .output()
            .is_err()
        {
            eprintln!("SKIP: iasl (acpica-tools) not installed");
            return;
        }
        let t = build(1, &two_devices()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dsdt.dat");
        std::fs::write(&p, t.get(b"DSDT").unwrap()).unwrap();
        let out = std::process::Command::new("iasl")
            .arg("-d")
            .arg(&p)
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dsl = std::fs::read_to_string(dir.path().join("dsdt.dsl")).unwrap();
        assert!(dsl.contains("\"LNRO0005\""), "{dsl}");
        assert!(dsl.contains("Memory32Fixed (ReadWrite,"), "{dsl}");
        assert!(dsl.contains("0xD0000000"), "{dsl}");
        assert!(dsl.contains("0xD0001000"), "{dsl}");
        assert!(
            dsl.contains("Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive"),
            "{dsl}"
        );
        assert!(dsl.contains("EisaId (\"PNP0501\")"), "{dsl}");
    }
}
