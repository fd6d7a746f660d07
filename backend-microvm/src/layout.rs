//! Guest physical memory and I/O layout shared by the VMM, the Linux boot path and the
//! ACPI tables. One place so the parts cannot disagree.

/// Start of guest RAM.
pub const RAM_START: u64 = 0;
/// Where the GDT is written (boot-time, 64-bit segments).
pub const GDT_ADDR: u64 = 0x500;
/// Where an empty IDT is written.
pub const IDT_ADDR: u64 = 0x520;
/// Linux `boot_params` ("zero page").
pub const BOOT_PARAMS_ADDR: u64 = 0x7000;
/// First page of the identity-mapped page tables (PML4; PDPT and PDs follow).
pub const PAGE_TABLES_ADDR: u64 = 0x9000;
/// Kernel command line.
pub const CMDLINE_ADDR: u64 = 0x2_0000;
/// Maximum command-line length including the NUL.
pub const CMDLINE_MAX: usize = 4096;
/// Start of the legacy BIOS area where the ACPI RSDP is placed (Linux scans 0xe0000-0xfffff).
pub const RSDP_ADDR: u64 = 0x000e_0000;
/// Where the rest of the ACPI tables go (inside the 0xe0000-0xfffff area, after the RSDP).
pub const ACPI_TABLES_ADDR: u64 = 0x000e_1000;
/// End of the area reserved for legacy structures (e820 marks 0x9fc00-0x100000 reserved).
pub const EBDA_START: u64 = 0x0009_fc00;
/// Where kernels are loaded (the 1 MiB mark).
pub const HIMEM_START: u64 = 0x0010_0000;
/// Start of the 32-bit MMIO gap below 4 GiB: RAM never overlaps it.
pub const MMIO_GAP_START: u64 = 0xd000_0000;
/// Size of the MMIO gap (up to 4 GiB).
pub const MMIO_GAP_SIZE: u64 = 0x3000_0000;
/// Base of the first virtio-mmio device window.
pub const VIRTIO_MMIO_BASE: u64 = MMIO_GAP_START;
/// Size of each virtio-mmio device window.
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// First IRQ (GSI) for virtio-mmio devices; device `n` uses `VIRTIO_IRQ_BASE + n`.
pub const VIRTIO_IRQ_BASE: u32 = 5;
/// COM1, the serial console.
pub const SERIAL_PORT: u16 = 0x3f8;
/// COM1's IRQ.
pub const SERIAL_IRQ: u32 = 4;
/// The IOAPIC's MMIO address (KVM's in-kernel irqchip).
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
/// The local APIC's MMIO address.
pub const LAPIC_ADDR: u64 = 0xfee0_0000;
/// Three pages KVM needs for its real-mode TSS (`KVM_SET_TSS_ADDR`); inside the MMIO gap,
/// never RAM. (Added by the VMM helper.)
pub const KVM_TSS_ADDR: u64 = 0xfffb_d000;
/// One page KVM needs for its identity map (`KVM_SET_IDENTITY_MAP_ADDR`), just below
/// [`KVM_TSS_ADDR`]. (Added by the VMM helper.)
pub const KVM_IDENTITY_MAP_ADDR: u64 = 0xfffb_c000;
/// A debug-exit port: a 1-, 2- or 4-byte `out` here ends the VM with the written value as the
/// guest's exit code (tiny test guests use it; Linux never touches it). (Added by the VMM helper.)
pub const DEBUG_EXIT_PORT: u16 = 0x501;
/// The i8042 command port: writing 0xfe there (Linux `reboot=k`) resets the machine, which
/// the VMM turns into a "reset" exit. (Added by the VMM helper.)
pub const I8042_COMMAND_PORT: u16 = 0x64;
