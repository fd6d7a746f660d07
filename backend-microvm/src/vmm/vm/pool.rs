//! VMs made ahead of time: [`VmPool`] keeps KVM VMs whose costly part is done (memory slots,
//! the in-kernel irqchip and PIT, the vCPUs), so that a restore (or a new VM) only maps its
//! memory, makes its devices and loads its state.

use super::*;

/// The KVM part of a VM: the VM, its memory slots over `ram`, its irqchip and PIT when it has
/// them, and its vCPUs (not yet set up). A pooled shell's RAM is a fresh memfd; a restore
/// maps the snapshot's memory over it (see [`GuestRam::remap_private`]).
pub(super) struct Shell {
    // vCPUs, then the VM, then memory: the slots go before the mappings they name.
    pub(super) vcpus: Vec<VcpuFd>,
    pub(super) vm_fd: VmFd,
    pub(super) kvm: Arc<Kvm>,
    pub(super) ram: GuestRam,
    pub(super) has_irqchip: bool,
}

impl Shell {
    /// The same shell with a snapshot's memory file mapped copy-on-write over its RAM.
    pub(super) fn with_snapshot_memory(self, path: &Path) -> Result<Shell> {
        let Shell {
            vcpus,
            vm_fd,
            kvm,
            ram,
            has_irqchip,
        } = self;
        let ram = ram.remap_private(path)?;
        Ok(Shell {
            vcpus,
            vm_fd,
            kvm,
            ram,
            has_irqchip,
        })
    }
}

/// VMs of one memory size, vCPU count and irqchip choice, made ahead of time by
/// [`fill`](Self::fill) (on a thread of the caller's: it blocks), taken by
/// [`Vm::restore_pooled`] and [`Vm::new_pooled`].
///
/// With KVM's in-kernel irqchip, making the irqchip and PIT waits on several kernel-side
/// synchronisations (0.1-5 ms here, depending on load): that is the part a pool moves out of
/// the restore. Each pooled VM holds its fresh RAM (untouched, so no memory until written),
/// its vCPU run areas and, with an irqchip, a `kvm-pit` kernel thread; dropping one with an
/// irqchip takes 10-50 ms here (the pool's drop pays it).
pub struct VmPool {
    mem_size: u64,
    vcpus: u8,
    irqchip: bool,
    size: usize,
    shells: Mutex<Vec<Shell>>,
}

impl std::fmt::Debug for VmPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmPool")
            .field("mem_size", &self.mem_size)
            .field("vcpus", &self.vcpus)
            .field("irqchip", &self.irqchip)
            .field("size", &self.size)
            .field("ready", &self.ready())
            .finish()
    }
}

impl VmPool {
    /// An empty pool for VMs of `mem_size` bytes and `vcpus` vCPUs, with KVM's irqchip and
    /// PIT when `irqchip` (and the host has them), holding up to `size` of them.
    pub fn new(mem_size: u64, vcpus: u8, irqchip: bool, size: usize) -> Result<VmPool> {
        crate::vmm::memory::check_mem_size(mem_size)?;
        create::check_vcpus(vcpus)?;
        Ok(VmPool {
            mem_size,
            vcpus,
            irqchip,
            size,
            shells: Mutex::new(Vec::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Shell>> {
        self.shells.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many VMs are ready.
    pub fn ready(&self) -> usize {
        self.lock().len()
    }

    /// Makes VMs until `size` are ready (blocking; run it off the latency path). Returns how
    /// many it made.
    pub fn fill(&self) -> Result<usize> {
        let mut made = 0;
        while self.ready() < self.size {
            let ram = GuestRam::new_memfd(self.mem_size)?;
            let shell = Shell::make(create::kvm_handle()?, ram, self.vcpus, self.irqchip)?;
            let mut all = self.lock();
            if all.len() >= self.size {
                break;
            }
            all.push(shell);
            made += 1;
        }
        Ok(made)
    }

    /// A ready VM for this size, vCPU count and irqchip choice, if the pool is for them and
    /// has one.
    pub(super) fn take(&self, mem_size: u64, vcpus: u8, irqchip: bool) -> Option<Shell> {
        if (mem_size, vcpus) != (self.mem_size, self.vcpus) {
            return None;
        }
        let mut all = self.lock();
        let i = all.iter().position(|s| s.has_irqchip == irqchip)?;
        Some(all.swap_remove(i))
    }
}
