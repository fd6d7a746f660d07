//! Creating a VM: the process's `/dev/kvm` handle, then the VM itself (memory slots, the
//! in-kernel irqchip and PIT, the serial port, the virtio-console, the read-only virtio-blk
//! device, the vCPUs).

use super::*;

fn open_kvm() -> Result<Kvm> {
    Kvm::new().map_err(|e| {
        let (reason, fix) = match e.errno() {
            libc::ENOENT => (
                "/dev/kvm does not exist".to_string(),
                "load the kvm module (kvm_intel or kvm_amd) or run on a host with hardware \
                 virtualization"
                    .to_string(),
            ),
            libc::EACCES | libc::EPERM => (
                "no permission to open /dev/kvm".to_string(),
                "add the user to the `kvm` group (or grant rw on /dev/kvm)".to_string(),
            ),
            _ => (
                format!("opening /dev/kvm: {e}"),
                "check the KVM setup".to_string(),
            ),
        };
        VmmError::KvmUnavailable { reason, fix }
    })
}

/// The process's `/dev/kvm` handle, opened once (system ioctls such as
/// `KVM_GET_SUPPORTED_CPUID` go through it; each VM has its own VM fd). A failed open is not
/// cached: the next VM tries again.
pub(super) fn kvm_handle() -> Result<Arc<Kvm>> {
    static KVM: OnceLock<Arc<Kvm>> = OnceLock::new();
    if let Some(k) = KVM.get() {
        return Ok(k.clone());
    }
    let k = Arc::new(open_kvm()?);
    Ok(KVM.get_or_init(|| k).clone())
}

impl Shell {
    /// Makes the KVM VM around `ram`: its memory slots, then (with `irqchip`, where KVM has
    /// one) the in-kernel irqchip and PIT, then the vCPUs. Slots go before the irqchip, as
    /// Firecracker does: adding a slot to a VM that has an irqchip costs 4-12 ms on this
    /// host, before it ~40 µs.
    pub(super) fn make(kvm: Arc<Kvm>, ram: GuestRam, vcpus: u8, irqchip: bool) -> Result<Shell> {
        let vm_fd = kvm.create_vm().map_err(VmmError::kvm("create vm"))?;
        vm_fd
            .set_tss_address(layout::KVM_TSS_ADDR as usize)
            .map_err(VmmError::kvm("set tss address"))?;
        vm_fd
            .set_identity_map_address(layout::KVM_IDENTITY_MAP_ADDR)
            .map_err(VmmError::kvm("set identity map address"))?;
        let has_irqchip = irqchip && vm_fd.check_extension(Cap::Irqchip);
        ram.register(&vm_fd)?;
        if has_irqchip {
            vm_fd
                .create_irq_chip()
                .map_err(VmmError::kvm("create irqchip"))?;
            let pit = kvm_pit_config {
                flags: KVM_PIT_SPEAKER_DUMMY,
                ..Default::default()
            };
            vm_fd
                .create_pit2(pit)
                .map_err(VmmError::kvm("create pit"))?;
        }
        let mut fds = Vec::new();
        for id in 0..vcpus {
            fds.push(
                vm_fd
                    .create_vcpu(u64::from(id))
                    .map_err(VmmError::kvm("create vcpu"))?,
            );
        }
        Ok(Shell {
            vcpus: fds,
            vm_fd,
            kvm,
            ram,
            has_irqchip,
        })
    }
}

/// Checks a vCPU count.
pub(super) fn check_vcpus(n: u8) -> Result<()> {
    if n == 0 || n > 32 {
        return Err(VmmError::InvalidConfig(format!(
            "vCPU count {n} must be 1-32"
        )));
    }
    Ok(())
}

impl Vm {
    /// Creates a VM with fresh (zeroed, memfd-backed) RAM and its devices, not yet running.
    pub fn new(cfg: VmConfig) -> Result<Vm> {
        let ram = GuestRam::new_memfd(cfg.mem_size)?;
        Self::build(cfg, ram, None)
    }

    /// As [`Vm::new`], from a VM `pool` made ahead of time when it has one of this size,
    /// vCPU count and irqchip choice (else as `new`).
    pub fn new_pooled(cfg: VmConfig, pool: &VmPool) -> Result<Vm> {
        check_vcpus(cfg.vcpus)?;
        match pool.take(cfg.mem_size, cfg.vcpus, cfg.irqchip) {
            Some(shell) => {
                let (tids, threads) = Self::threads(&cfg)?;
                Self::assemble(cfg, shell, threads, tids, None)
            }
            None => Self::new(cfg),
        }
    }

    /// The VM's threads, started before the rest is built (they install their seccomp
    /// filters meanwhile), and the slots for their thread ids.
    pub(super) fn threads(cfg: &VmConfig) -> Result<(Arc<Vec<AtomicI32>>, Threads)> {
        let tids: Arc<Vec<AtomicI32>> =
            Arc::new((0..cfg.vcpus).map(|_| AtomicI32::new(0)).collect());
        let threads = Threads::spawn(cfg, &tids)?;
        Ok((tids, threads))
    }

    /// Builds a VM around `ram`: fresh when `restoring` is `None`, else with the snapshot's
    /// irqchip choice and serial registers (the caller then loads the rest of the state).
    pub(super) fn build(
        cfg: VmConfig,
        ram: GuestRam,
        restoring: Option<Restoring<'_>>,
    ) -> Result<Vm> {
        check_vcpus(cfg.vcpus)?;
        let kvm = kvm_handle()?;
        let (tids, threads) = Self::threads(&cfg)?;
        let irqchip = restoring.as_ref().map_or(cfg.irqchip, |r| r.irqchip);
        let shell = Shell::make(kvm, ram, cfg.vcpus, irqchip)?;
        Self::assemble(cfg, shell, threads, tids, restoring)
    }

    /// Finishes a VM from its KVM part: the serial port, the virtio devices (with irqfds
    /// when there is an irqchip), each fresh vCPU's CPUID and LAPIC lines.
    pub(super) fn assemble(
        cfg: VmConfig,
        shell: Shell,
        threads: Threads,
        vcpu_tids: Arc<Vec<AtomicI32>>,
        restoring: Option<Restoring<'_>>,
    ) -> Result<Vm> {
        let serial_state = restoring.as_ref().map(|r| r.serial);
        if restoring.as_ref().is_some_and(|r| r.irqchip) && !shell.has_irqchip {
            return Err(VmmError::SnapshotIncompatible(
                "the snapshot has an in-kernel irqchip; this host's KVM has none".into(),
            ));
        }
        let sig = vcpu::kick_signal()?;
        let Shell {
            vcpus: pending_vcpus,
            vm_fd,
            kvm,
            ram,
            has_irqchip,
        } = shell;

        let irqfd = |gsi: u32| -> Result<Option<EventFd>> {
            if !has_irqchip {
                return Ok(None);
            }
            let e = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                .map_err(VmmError::io("eventfd"))?;
            vm_fd
                .register_irqfd(&e, gsi)
                .map_err(VmmError::kvm("register irqfd"))?;
            Ok(Some(e))
        };

        let mut pio = Bus::new();
        let mut mmio = Bus::new();
        let serial_out: SharedOutput = Arc::new(Mutex::new(SerialOutput::new(
            cfg.serial_cap,
            cfg.serial_callback.clone(),
        )));
        let serial_irq = irqfd(layout::SERIAL_IRQ)?;
        let serial = match serial_state {
            Some(s) => SerialDevice::from_snapshot(s, serial_irq, serial_out.clone())?,
            None => SerialDevice::new(serial_irq, serial_out.clone()),
        };
        let serial = Arc::new(Mutex::new(serial));
        let dev: SharedDevice = serial.clone();
        pio.insert(u64::from(layout::SERIAL_PORT), 8, dev);

        let mut virtio = Vec::new();
        let mut virtio_info = Vec::new();
        let mut console_host = None;
        if cfg.virtio_console {
            let (host, dev_end) =
                UnixStream::pair().map_err(VmmError::io("creating the console socketpair"))?;
            let console = Console::new(dev_end).map_err(VmmError::io("console socket"))?;
            let irq = layout::VIRTIO_IRQ_BASE;
            let notify = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                .map_err(VmmError::io("eventfd"))?;
            let t = Arc::new(Mutex::new(MmioTransport::new(
                Box::new(console),
                ram.memory().clone(),
                irqfd(irq)?,
                notify,
            )));
            let dev: SharedDevice = t.clone();
            mmio.insert(layout::VIRTIO_MMIO_BASE, layout::VIRTIO_MMIO_SIZE, dev);
            virtio.push(t);
            virtio_info.push(VirtioMmioInfo {
                base: layout::VIRTIO_MMIO_BASE,
                size: layout::VIRTIO_MMIO_SIZE,
                irq,
                device_type: crate::devices::virtio::console::DEVICE_ID_CONSOLE,
            });
            console_host = Some(host);
        }
        if let Some(b) = &cfg.block {
            let block = Block::open(&b.path, &b.id).map_err(|e| {
                if e.kind() == std::io::ErrorKind::InvalidInput {
                    VmmError::InvalidConfig(e.to_string())
                } else {
                    VmmError::Io {
                        context: format!("opening the block device file {}", b.path.display()),
                        source: e,
                    }
                }
            })?;
            // After the console, so that the console stays device 0.
            let n = u32::try_from(virtio.len())
                .map_err(|_| VmmError::InvalidConfig("too many virtio devices".into()))?;
            let base = layout::VIRTIO_MMIO_BASE + u64::from(n) * layout::VIRTIO_MMIO_SIZE;
            let irq = layout::VIRTIO_IRQ_BASE + n;
            let notify = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                .map_err(VmmError::io("eventfd"))?;
            let t = Arc::new(Mutex::new(MmioTransport::new(
                Box::new(block),
                ram.memory().clone(),
                irqfd(irq)?,
                notify,
            )));
            let dev: SharedDevice = t.clone();
            mmio.insert(base, layout::VIRTIO_MMIO_SIZE, dev);
            virtio.push(t);
            virtio_info.push(VirtioMmioInfo {
                base,
                size: layout::VIRTIO_MMIO_SIZE,
                irq,
                device_type: crate::devices::virtio::blk::DEVICE_ID_BLOCK,
            });
        }

        let mut net_counters = None;
        if let Some(n) = &cfg.net {
            let fd =
                n.fd.try_clone()
                    .map_err(VmmError::io("duplicating the network device's descriptor"))?;
            let net = Net::new(fd, n.mac).map_err(VmmError::io("network device descriptor"))?;
            net_counters = Some(net.counters());
            // After the console and the block device, which keep their slots.
            let n = u32::try_from(virtio.len())
                .map_err(|_| VmmError::InvalidConfig("too many virtio devices".into()))?;
            let base = layout::VIRTIO_MMIO_BASE + u64::from(n) * layout::VIRTIO_MMIO_SIZE;
            let irq = layout::VIRTIO_IRQ_BASE + n;
            let notify = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                .map_err(VmmError::io("eventfd"))?;
            let t = Arc::new(Mutex::new(MmioTransport::new(
                Box::new(net),
                ram.memory().clone(),
                irqfd(irq)?,
                notify,
            )));
            let dev: SharedDevice = t.clone();
            mmio.insert(base, layout::VIRTIO_MMIO_SIZE, dev);
            virtio.push(t);
            virtio_info.push(VirtioMmioInfo {
                base,
                size: layout::VIRTIO_MMIO_SIZE,
                irq,
                device_type: crate::devices::virtio::net::DEVICE_ID_NET,
            });
        }

        // A restored vCPU gets its CPUID and LAPIC from the snapshot instead.
        if restoring.is_none() {
            for (id, v) in (0u8..).zip(&pending_vcpus) {
                let cpuid = cpu::guest_cpuid(&kvm, id, cfg.vcpus)?;
                v.set_cpuid2(&cpuid).map_err(VmmError::kvm("set cpuid"))?;
                if has_irqchip {
                    cpu::set_lint(v)?;
                }
            }
        }
        let shared = Arc::new(Shared::new(usize::from(cfg.vcpus), sig)?);
        Ok(Vm {
            threads,
            shared,
            pending_vcpus,
            vcpu_tids,
            serial,
            serial_out,
            virtio,
            virtio_info,
            console_host,
            net_counters,
            pio,
            mmio,
            cfg,
            has_irqchip,
            started: false,
            vm_fd,
            kvm,
            ram,
        })
    }
}
