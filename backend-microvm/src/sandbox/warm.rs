//! Warm starts: boot once, then start from a snapshot.
//!
//! **Boot snapshots.** The first sandbox of a kind (the same kernel and initramfs files, kernel
//! command line, guest memory, vCPUs and image disk: a [`TemplateKey`]) boots as usual; the
//! moment its agent is ready, before it is given its identity and before any command of
//! its own, its VM is snapshotted into a directory on the host ([`Template`]). Every later
//! sandbox of that kind restores that snapshot instead of booting a kernel: the vCPUs, devices
//! and the agent continue from "ready", and the agent's `Refresh` gives the copy its own
//! hostname, random state and clock (a copy with a network also gets its own link, the
//! snapshot's MAC on its own TAP, and `eth0` moved to its address). The snapshot's memory
//! file is mapped copy-on-write
//! (`MAP_PRIVATE`) by every copy, so the pages the copies only read (the kernel, the agent,
//! the page cache of the initramfs) are one set of host pages; a page a copy writes becomes
//! its own. What copies share, and why that is safe: `docs/microvm-snapshots.md`.
//!
//! **Unpacked snapshots.** A snapshot from a [`SnapshotStore`](sandbox_core::SnapshotStore)
//! is unpacked into a memory file once and kept (the few most recent): restoring it again
//! maps the same file, so its copies share their unwritten memory the same way, and skip the
//! unpacking.
//!
//! **A pool of VMs made ahead.** Restores take a VM whose KVM part (memory slots, in-kernel
//! irqchip and PIT, vCPUs) was made ahead of time from a [`VmPool`] per memory size and
//! vCPU count, refilled on a thread of its own after each take.
//!
//! Everything here lives as long as the backend (its clones share it): the directories are
//! deleted when it is dropped (running copies keep the memory they mapped).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use super::create::boot_failure;
use super::image::disk_identity;
use super::*;
use crate::vmm::VmPool;

/// Boot snapshots kept at most; the oldest goes first (its running copies keep their memory).
const MAX_TEMPLATES: usize = 8;
/// Unpacked store snapshots kept at most.
const MAX_UNPACKED: usize = 4;

/// What a boot snapshot was made from; a sandbox starts from it only if all of it is the
/// same. Files are named by path, length and modification time: a kernel, initramfs or
/// image disk made again is another key. Sandboxes with a network share one key whatever
/// their address: the command line is taken without `agent.net=` (a copy's agent moves
/// `eth0` to its own link, see [`Frozen::mac`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TemplateKey {
    files: Vec<(PathBuf, u64, u128)>,
    cmdline: String,
    mem_size: u64,
    vcpus: u8,
    irqchip: bool,
    net: bool,
}

impl TemplateKey {
    /// The key of a sandbox booting `guest` with `cmdline` in a VM made from `vcfg`.
    pub(crate) fn new(guest: &GuestFiles, cmdline: &str, vcfg: &VmConfig) -> Result<Self> {
        let net = vcfg.net.is_some();
        let cmdline = if net {
            cmdline
                .split_whitespace()
                .filter(|w| !w.starts_with("agent.net="))
                .collect::<Vec<_>>()
                .join(" ")
        } else {
            cmdline.to_string()
        };
        let mut files = Vec::new();
        let disk = vcfg.block.as_ref().map(|b| b.path.as_path());
        for p in [
            Some(guest.kernel.as_path()),
            Some(guest.initramfs.as_path()),
            disk,
        ]
        .into_iter()
        .flatten()
        {
            let (len, mtime) = disk_identity(p)?;
            files.push((p.to_path_buf(), len, mtime));
        }
        Ok(TemplateKey {
            files,
            cmdline,
            mem_size: vcfg.mem_size,
            vcpus: vcfg.vcpus,
            irqchip: vcfg.irqchip,
            net,
        })
    }
}

/// A VM snapshotted on the host: its state file and memory file, in a directory deleted
/// when the last holder drops it.
pub(crate) struct Frozen {
    dir: tempfile::TempDir,
    /// The first request id a client of a restored copy may use.
    next_id: u32,
    /// The MAC of the snapshotted VM's network device, if it had one.
    mac: Option<[u8; 6]>,
}

impl Frozen {
    /// Snapshots a booted guest whose agent is ready and idle; `mac`: its network device's.
    pub(crate) fn capture(vm: &Vm, agent: &AgentClient, mac: Option<[u8; 6]>) -> Result<Frozen> {
        let dir = crate::stale::tempdir("boot-")
            .map_err(|e| Error::io("create a boot snapshot directory", e))?;
        vm.snapshot(dir.path())?;
        Ok(Frozen {
            dir,
            next_id: agent.next_id(),
            mac,
        })
    }

    /// An unpacked store snapshot in `dir`, whose client's ids start at `next_id`.
    pub(crate) fn unpacked(dir: tempfile::TempDir, next_id: u32) -> Frozen {
        Frozen {
            dir,
            next_id,
            mac: None,
        }
    }

    /// The MAC of the snapshotted VM's network device: a copy's device must have it (the
    /// guest's driver read it at boot; the VMM refuses another), on the copy's own link.
    pub(crate) fn mac(&self) -> Option<[u8; 6]> {
        self.mac
    }

    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }

    pub(crate) fn next_id(&self) -> u32 {
        self.next_id
    }
}

/// A pool and whether a thread is filling it.
struct PoolEntry {
    key: (u64, u8, bool),
    pool: Arc<VmPool>,
    filling: Arc<AtomicBool>,
}

/// The backend's warm-start state (see the module docs).
pub(crate) struct WarmStarts {
    templates_on: bool,
    pool_size: usize,
    templates: Mutex<VecDeque<(TemplateKey, Arc<Frozen>)>>,
    unpacked: Mutex<VecDeque<(String, Arc<Frozen>)>>,
    pools: Mutex<Vec<PoolEntry>>,
}

impl std::fmt::Debug for WarmStarts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WarmStarts")
            .field("templates_on", &self.templates_on)
            .field("pool_size", &self.pool_size)
            .field("templates", &lock(&self.templates).len())
            .field("unpacked", &lock(&self.unpacked).len())
            .finish_non_exhaustive()
    }
}

impl WarmStarts {
    /// Boot snapshots on or off; `pool_size` VMs made ahead per memory size and vCPU count
    /// (0: none).
    pub(crate) fn new(templates_on: bool, pool_size: usize) -> Self {
        WarmStarts {
            templates_on,
            pool_size,
            templates: Mutex::new(VecDeque::new()),
            unpacked: Mutex::new(VecDeque::new()),
            pools: Mutex::new(Vec::new()),
        }
    }

    /// Whether sandboxes start from boot snapshots.
    pub(crate) fn templates_on(&self) -> bool {
        self.templates_on
    }

    /// The boot snapshot for `key`, if one was made.
    pub(crate) fn template(&self, key: &TemplateKey) -> Option<Arc<Frozen>> {
        lock(&self.templates)
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, f)| Arc::clone(f))
    }

    /// Keeps `frozen` as the boot snapshot for `key` (a concurrent first boot may have made
    /// one already: the first stays).
    pub(crate) fn keep_template(&self, key: TemplateKey, frozen: Frozen) {
        let mut all = lock(&self.templates);
        if all.iter().any(|(k, _)| *k == key) {
            return;
        }
        if all.len() >= MAX_TEMPLATES {
            all.pop_front();
        }
        all.push_back((key, Arc::new(frozen)));
    }

    /// Drops the boot snapshot for `key` (it could not be restored: the next sandbox boots).
    pub(crate) fn forget_template(&self, key: &TemplateKey) {
        lock(&self.templates).retain(|(k, _)| k != key);
    }

    /// The unpacked store snapshot named `key` (its id and state file digest), if kept.
    pub(crate) fn unpacked(&self, key: &str) -> Option<Arc<Frozen>> {
        lock(&self.unpacked)
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, f)| Arc::clone(f))
    }

    /// Keeps an unpacked store snapshot (the oldest goes past [`MAX_UNPACKED`]).
    pub(crate) fn keep_unpacked(&self, key: String, frozen: Arc<Frozen>) {
        let mut all = lock(&self.unpacked);
        all.retain(|(k, _)| *k != key);
        if all.len() >= MAX_UNPACKED {
            all.pop_front();
        }
        all.push_back((key, frozen));
    }

    /// The pool for VMs like `vcfg`'s, made on first use (`None` when pools are off).
    fn pool(&self, vcfg: &VmConfig) -> Option<(Arc<VmPool>, Arc<AtomicBool>)> {
        if self.pool_size == 0 {
            return None;
        }
        let key = (vcfg.mem_size, vcfg.vcpus, vcfg.irqchip);
        let mut all = lock(&self.pools);
        if let Some(e) = all.iter().find(|e| e.key == key) {
            return Some((Arc::clone(&e.pool), Arc::clone(&e.filling)));
        }
        let pool = match VmPool::new(key.0, key.1, key.2, self.pool_size) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                tracing::debug!("no VM pool for {key:?}: {e}");
                return None;
            }
        };
        let filling = Arc::new(AtomicBool::new(false));
        all.push(PoolEntry {
            key,
            pool: Arc::clone(&pool),
            filling: Arc::clone(&filling),
        });
        Some((pool, filling))
    }

    /// Fills the pool for VMs like `vcfg`'s on a thread of its own (unless one is at it).
    pub(crate) fn refill(&self, vcfg: &VmConfig) {
        let Some((pool, filling)) = self.pool(vcfg) else {
            return;
        };
        if filling.swap(true, Ordering::AcqRel) {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("microvm-pool-fill".into())
            .spawn({
                let filling = Arc::clone(&filling);
                move || {
                    if let Err(e) = pool.fill() {
                        tracing::debug!("filling the VM pool: {e}");
                    }
                    filling.store(false, Ordering::Release);
                }
            });
        if spawned.is_err() {
            filling.store(false, Ordering::Release);
        }
    }

    /// Restores the VM in `frozen` as configured by `vcfg` (from the pool when it has one),
    /// and refills the pool behind it. Blocking.
    pub(crate) fn restore(&self, frozen: &Frozen, vcfg: VmConfig) -> crate::vmm::Result<Vm> {
        match self.pool(&vcfg) {
            Some((pool, _)) => {
                let again = vcfg.clone();
                let vm = Vm::restore_pooled(frozen.path(), vcfg, &pool);
                self.refill(&again);
                vm
            }
            None => Vm::restore(frozen.path(), vcfg),
        }
    }
}

/// Starts a sandbox's VM from a boot snapshot: restore, a client whose ids start after the
/// snapshotted one's, a ping, and the copy's own identity (`name`). Blocking.
pub(crate) fn start_from(
    warm: &WarmStarts,
    frozen: &Frozen,
    vcfg: VmConfig,
    name: &str,
) -> Result<(Vm, AgentClient)> {
    let mut vm = warm.restore(frozen, vcfg)?;
    let agent = restored_agent(&mut vm, frozen)?;
    wake(&vm, &agent, name)?;
    Ok((vm, agent))
}

/// The agent client of a VM restored from `frozen`: on its console, its request ids after
/// the snapshotted client's.
pub(crate) fn restored_agent(vm: &mut Vm, frozen: &Frozen) -> Result<AgentClient> {
    let console = vm
        .take_console()
        .ok_or_else(|| Error::backend(TIER, "the restored VM has no virtio console"))?;
    let agent =
        AgentClient::new(console).map_err(|e| boot_failure(vm, "starting the agent client", e))?;
    agent.skip_ids_below(frozen.next_id());
    Ok(agent)
}

/// Checks that a restored guest's agent answers, then gives the copy its own identity
/// (`name`): its own name, random state and clock, not the snapshot's (which every other
/// copy also has).
pub(crate) fn wake(vm: &Vm, agent: &AgentClient, name: &str) -> Result<()> {
    agent
        .ping(PING_TIMEOUT)
        .map_err(|e| boot_failure(vm, "the restored guest's agent", e))?;
    agent
        .refresh(name, PING_TIMEOUT)
        .map_err(|e| boot_failure(vm, "giving the restored guest its identity", e))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn guest(dir: &Path) -> GuestFiles {
        let kernel = dir.join("vmlinux");
        let initramfs = dir.join("initrd");
        std::fs::write(&kernel, b"kernel").unwrap();
        std::fs::write(&initramfs, b"initrd").unwrap();
        GuestFiles {
            kernel,
            initramfs,
            kernel_version: None,
            installed: false,
        }
    }

    fn frozen() -> Frozen {
        Frozen::unpacked(tempfile::tempdir().unwrap(), 7)
    }

    #[test]
    fn a_key_names_every_input_of_the_boot() {
        let dir = tempfile::tempdir().unwrap();
        let g = guest(dir.path());
        let vcfg = VmConfig {
            mem_size: 64 << 20,
            ..VmConfig::default()
        };
        let k = TemplateKey::new(&g, "console=ttyS0", &vcfg).unwrap();
        assert_eq!(
            TemplateKey::new(&g, "console=ttyS0", &vcfg).unwrap(),
            k.clone()
        );
        // Another command line, memory size, vCPU count: another key.
        assert_ne!(TemplateKey::new(&g, "quiet", &vcfg).unwrap(), k.clone());
        for other in [
            VmConfig {
                mem_size: 128 << 20,
                ..vcfg.clone()
            },
            VmConfig {
                vcpus: 2,
                ..vcfg.clone()
            },
        ] {
            assert_ne!(
                TemplateKey::new(&g, "console=ttyS0", &other).unwrap(),
                k.clone()
            );
        }
        // An image disk is part of it.
        let disk = dir.path().join("disk.ext4");
        std::fs::write(&disk, [0u8; 512]).unwrap();
        let with_disk = VmConfig {
            block: Some(BlockConfig {
                path: disk.clone(),
                id: "root".into(),
            }),
            ..vcfg.clone()
        };
        let kd = TemplateKey::new(&g, "console=ttyS0", &with_disk).unwrap();
        assert_ne!(kd, k);
        // A kernel made again (another length) is another key.
        std::fs::write(&g.kernel, b"another kernel").unwrap();
        assert_ne!(TemplateKey::new(&g, "console=ttyS0", &vcfg).unwrap(), k);
        // VMs with a network device share a key whatever their address and MAC, and not
        // with VMs without one; a missing file is an error.
        let net = |mac: u8| {
            let (a, _b) = std::os::unix::net::UnixDatagram::pair().unwrap();
            VmConfig {
                net: Some(crate::vmm::NetConfig {
                    mac: [2, 0, 0, 0, 0, mac],
                    fd: Arc::new(std::os::fd::OwnedFd::from(a)),
                }),
                ..vcfg.clone()
            }
        };
        let n1 =
            TemplateKey::new(&g, "console=ttyS0 agent.net=10.0.0.2/30,10.0.0.1", &net(1)).unwrap();
        let n2 =
            TemplateKey::new(&g, "console=ttyS0 agent.net=10.0.0.6/30,10.0.0.5", &net(2)).unwrap();
        assert_eq!(n1, n2);
        let plain = TemplateKey::new(&g, "console=ttyS0", &vcfg).unwrap();
        assert_ne!(n1, plain);
        std::fs::remove_file(&disk).unwrap();
        assert!(TemplateKey::new(&g, "console=ttyS0", &with_disk).is_err());
    }

    #[test]
    fn templates_are_kept_found_bounded_and_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let g = guest(dir.path());
        let warm = WarmStarts::new(true, 0);
        let key = |mem: u64| {
            let vcfg = VmConfig {
                mem_size: mem << 20,
                ..VmConfig::default()
            };
            TemplateKey::new(&g, "x", &vcfg).unwrap()
        };
        assert!(warm.template(&key(32)).is_none());
        warm.keep_template(key(32), frozen());
        let first = warm.template(&key(32)).unwrap();
        assert_eq!(first.next_id(), 7);
        // A second one for the same key does not replace the first.
        warm.keep_template(key(32), Frozen::unpacked(tempfile::tempdir().unwrap(), 9));
        assert_eq!(warm.template(&key(32)).unwrap().next_id(), 7);
        // At most MAX_TEMPLATES: the oldest goes, and its directory with its last holder.
        let path = first.path().to_path_buf();
        drop(first);
        for m in 33..33 + MAX_TEMPLATES as u64 {
            warm.keep_template(key(m), frozen());
        }
        assert!(warm.template(&key(32)).is_none());
        assert!(
            !path.exists(),
            "the evicted snapshot's directory is deleted"
        );
        assert!(warm.template(&key(33)).is_some());
        warm.forget_template(&key(33));
        assert!(warm.template(&key(33)).is_none());
        assert!(warm.template(&key(34)).is_some());
    }

    #[test]
    fn unpacked_snapshots_are_kept_by_key_and_bounded() {
        let warm = WarmStarts::new(true, 0);
        for i in 0..MAX_UNPACKED + 1 {
            warm.keep_unpacked(format!("snap-{i}"), Arc::new(frozen()));
        }
        assert!(warm.unpacked("snap-0").is_none());
        for i in 1..=MAX_UNPACKED {
            assert!(warm.unpacked(&format!("snap-{i}")).is_some(), "{i}");
        }
        // Kept again: not twice.
        warm.keep_unpacked("snap-2".into(), Arc::new(frozen()));
        assert_eq!(lock(&warm.unpacked).len(), MAX_UNPACKED);
    }

    #[test]
    fn without_pools_nothing_is_made_ahead() {
        let warm = WarmStarts::new(true, 0);
        assert!(warm.pool(&VmConfig::default()).is_none());
        warm.refill(&VmConfig::default());
        assert!(lock(&warm.pools).is_empty());
    }
}
