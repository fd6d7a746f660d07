//! Snapshot and restore: the versioned state file (vCPUs, irqchip, PIT, clock, devices) and
//! the memory file beside it, and a running VM brought back from them.

use super::*;

#[derive(Debug, Serialize, Deserialize)]
struct IrqchipState {
    pic_master: kvm_irqchip,
    pic_slave: kvm_irqchip,
    ioapic: kvm_irqchip,
    pit: kvm_pit_state2,
    clock: Option<kvm_clock_data>,
}

/// The serialised state of a VM (besides memory).
#[derive(Debug, Serialize, Deserialize)]
struct VmState {
    format_version: u32,
    vmm_version: String,
    mem_size: u64,
    vcpu_count: u8,
    irqchip: Option<IrqchipState>,
    vcpus: Vec<VcpuState>,
    serial: SerialSnapshot,
    virtio: Vec<TransportState>,
    unhandled_io: u64,
}

impl Vm {
    /// Snapshots the VM into `dir` (created if needed): `vm-state.json` (versioned) and
    /// `memory.bin` (sparse). The VM is paused meanwhile and left as it was (running or
    /// paused).
    pub fn snapshot(&self, dir: &Path) -> Result<SnapshotInfo> {
        self.check_live()?;
        std::fs::create_dir_all(dir).map_err(VmmError::io(format!(
            "creating snapshot dir {}",
            dir.display()
        )))?;
        // Pause, with every vCPU saving its own state.
        let was_paused;
        let states = {
            let mut c = self.shared.lock();
            was_paused = c.pause_requested;
            c.pause_requested = true;
            c.want_state = true;
            for s in c.states.iter_mut() {
                *s = None;
            }
            self.shared.attention.store(true, Ordering::SeqCst);
            drop(c);
            self.shared.cv.notify_all();
            self.shared.kick_all();
            let mut c = self.shared.lock();
            while !c.stop && c.states.iter().any(Option::is_none) {
                c = self
                    .shared
                    .cv
                    .wait_timeout(c, Duration::from_millis(5))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
                self.shared.kick_all();
            }
            c.want_state = false;
            if c.stop {
                return Err(VmmError::Exited(
                    c.exit.as_ref().map(|e| e.to_string()).unwrap_or_default(),
                ));
            }
            let states: Vec<_> = c.states.iter_mut().filter_map(Option::take).collect();
            states
        };
        let result = self.write_snapshot(dir, states);
        if !was_paused {
            let _ = self.resume();
        }
        result
    }

    fn write_snapshot(&self, dir: &Path, states: Vec<Result<VcpuState>>) -> Result<SnapshotInfo> {
        let mut vcpus = Vec::new();
        for s in states {
            vcpus.push(s.map_err(|e| VmmError::SaveVcpu(Box::new(e)))?);
        }
        let irqchip = if self.has_irqchip {
            let chip = |id: u32| -> Result<kvm_irqchip> {
                let mut c = kvm_irqchip {
                    chip_id: id,
                    ..Default::default()
                };
                self.vm_fd
                    .get_irqchip(&mut c)
                    .map_err(VmmError::kvm("get irqchip"))?;
                Ok(c)
            };
            Some(IrqchipState {
                pic_master: chip(KVM_IRQCHIP_PIC_MASTER)?,
                pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE)?,
                ioapic: chip(KVM_IRQCHIP_IOAPIC)?,
                pit: self.vm_fd.get_pit2().map_err(VmmError::kvm("get pit"))?,
                clock: self.vm_fd.get_clock().ok(),
            })
        } else {
            None
        };
        // Hold the device locks while saving device state and memory so the I/O thread
        // cannot change either in between.
        let serial = self.serial.lock().unwrap_or_else(|p| p.into_inner());
        let transports: Vec<_> = self
            .virtio
            .iter()
            .map(|t| t.lock().unwrap_or_else(|p| p.into_inner()))
            .collect();
        let state = VmState {
            format_version: SNAPSHOT_FORMAT_VERSION,
            vmm_version: env!("CARGO_PKG_VERSION").to_string(),
            mem_size: self.ram.size(),
            vcpu_count: self.cfg.vcpus,
            irqchip,
            vcpus,
            serial: serial.snapshot(),
            virtio: transports.iter().map(|t| t.save()).collect(),
            unhandled_io: self.unhandled_io_count(),
        };
        let memory_file = dir.join(SNAPSHOT_MEMORY_FILE);
        let written = self.ram.save_to_file(&memory_file)?;
        drop(transports);
        drop(serial);
        let state_file = dir.join(SNAPSHOT_STATE_FILE);
        let json = serde_json::to_vec(&state)
            .map_err(|e| VmmError::State(format!("serialising the VM state: {e}")))?;
        std::fs::write(&state_file, json).map_err(VmmError::io("writing the VM state"))?;
        Ok(SnapshotInfo {
            state_file,
            memory_file,
            memory_bytes_written: written,
        })
    }

    /// Restores a snapshot directory written by [`Vm::snapshot`] into a new, running VM.
    /// Memory is mapped copy-on-write from the snapshot's memory file, which must stay in
    /// place while the VM lives. `cfg.mem_size` and `cfg.vcpus` must match the snapshot
    /// (else [`VmmError::SnapshotIncompatible`]); `cfg.virtio_console` is taken from the
    /// snapshot; the deadline, serial cap/callback and seccomp come from `cfg`. The block
    /// device's backing file comes from `cfg.block`, which must be set exactly when the
    /// snapshot has a block device, to a file of the same capacity (else
    /// [`VmmError::SnapshotIncompatible`]); the device is read-only, so the guest's view
    /// stays consistent only if the file's contents are the same too (not checked).
    pub fn restore(dir: &Path, cfg: VmConfig) -> Result<Vm> {
        Self::restore_from(dir, cfg, None)
    }

    /// As [`Vm::restore`], into a VM of `pool` (made ahead of time, see [`VmPool`]) when it
    /// has one for the snapshot's memory size, vCPU count and irqchip choice; else as
    /// `restore`. The snapshot's memory is mapped copy-on-write over the pooled VM's RAM.
    pub fn restore_pooled(dir: &Path, cfg: VmConfig, pool: &VmPool) -> Result<Vm> {
        Self::restore_from(dir, cfg, Some(pool))
    }

    fn restore_from(dir: &Path, cfg: VmConfig, pool: Option<&VmPool>) -> Result<Vm> {
        let raw = std::fs::read(dir.join(SNAPSHOT_STATE_FILE))
            .map_err(VmmError::io(format!("reading {}", dir.display())))?;
        let st = parse_state(&raw)?;
        if st.mem_size != cfg.mem_size {
            return Err(VmmError::SnapshotIncompatible(format!(
                "snapshot has {} bytes of memory, the VM is configured for {}",
                st.mem_size, cfg.mem_size
            )));
        }
        if st.vcpu_count != cfg.vcpus || st.vcpus.len() != usize::from(cfg.vcpus) {
            return Err(VmmError::SnapshotIncompatible(format!(
                "snapshot has {} vCPUs, the VM is configured for {}",
                st.vcpu_count, cfg.vcpus
            )));
        }
        let mut cfg = cfg;
        cfg.virtio_console = st
            .virtio
            .iter()
            .any(|t| t.device_type == crate::devices::virtio::console::DEVICE_ID_CONSOLE);
        let saved: Vec<u32> = st.virtio.iter().map(|t| t.device_type).collect();
        let configured = cfg.virtio_device_types();
        if saved != configured {
            return Err(VmmError::SnapshotIncompatible(format!(
                "the snapshot has virtio devices of types {saved:?}, the VM is configured for \
                 {configured:?} (are the block and network devices set as when it was taken?)"
            )));
        }
        let restoring = Restoring {
            irqchip: st.irqchip.is_some(),
            serial: &st.serial,
        };
        let memory = dir.join(SNAPSHOT_MEMORY_FILE);
        let pooled = pool.and_then(|p| p.take(st.mem_size, cfg.vcpus, restoring.irqchip));
        let mut vm = match pooled {
            Some(shell) => {
                create::check_vcpus(cfg.vcpus)?;
                let (tids, threads) = Self::threads(&cfg)?;
                let shell = shell.with_snapshot_memory(&memory)?;
                Self::assemble(cfg, shell, threads, tids, Some(restoring))?
            }
            None => {
                let ram = GuestRam::open_private(&memory, st.mem_size)?;
                Self::build(cfg, ram, Some(restoring))?
            }
        };
        if vm.virtio.len() != st.virtio.len() {
            return Err(VmmError::SnapshotIncompatible(
                "virtio device set differs".into(),
            ));
        }
        for (t, s) in vm.virtio.iter().zip(&st.virtio) {
            match t.lock().unwrap_or_else(|p| p.into_inner()).restore(s) {
                Ok(()) => {}
                Err(e @ crate::devices::StateError::Incompatible { .. }) => {
                    return Err(VmmError::SnapshotIncompatible(e.to_string()))
                }
                Err(e) => return Err(e.into()),
            }
        }
        for (v, s) in vm.pending_vcpus.iter().zip(&st.vcpus) {
            vcpu::restore_state(v, s, vm.has_irqchip)?;
        }
        if let Some(ic) = &st.irqchip {
            for c in [&ic.pic_master, &ic.pic_slave, &ic.ioapic] {
                vm.vm_fd
                    .set_irqchip(c)
                    .map_err(VmmError::kvm("set irqchip"))?;
            }
            vm.vm_fd
                .set_pit2(&ic.pit)
                .map_err(VmmError::kvm("set pit"))?;
            if let Some(clock) = &ic.clock {
                let mut c = *clock;
                c.flags = 0;
                vm.vm_fd.set_clock(&c).map_err(VmmError::kvm("set clock"))?;
            }
        }
        vm.shared
            .unhandled_io
            .store(st.unhandled_io, Ordering::Relaxed);
        vm.spawn_threads()?;
        Ok(vm)
    }
}

/// Just the version of a state file (any other fields are skipped).
#[derive(Deserialize)]
struct StateVersion {
    format_version: Option<u64>,
}

/// Parses a state file in one pass; only when that fails is it parsed again for its version,
/// to tell another format version ([`VmmError::SnapshotIncompatible`]) from a corrupt file.
fn parse_state(raw: &[u8]) -> Result<VmState> {
    let incompatible = |version: Option<u64>| {
        VmmError::SnapshotIncompatible(format!(
            "format version {version:?}, this VMM reads {SNAPSHOT_FORMAT_VERSION}"
        ))
    };
    match serde_json::from_slice::<VmState>(raw) {
        Ok(st) if st.format_version == SNAPSHOT_FORMAT_VERSION => Ok(st),
        Ok(st) => Err(incompatible(Some(u64::from(st.format_version)))),
        Err(e) => match serde_json::from_slice::<StateVersion>(raw) {
            Ok(v) if v.format_version != Some(u64::from(SNAPSHOT_FORMAT_VERSION)) => {
                Err(incompatible(v.format_version))
            }
            _ => Err(VmmError::SnapshotCorrupt(format!("state file: {e}"))),
        },
    }
}
