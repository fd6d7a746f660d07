//! Snapshots and restore: the VM's state file and its memory (packed by [`memfile`]) as
//! artifacts of a [`SnapshotStore`], and a sandbox brought back from them.

use super::create::{
    bind_proxied, boot_failure, check_proxied, check_spec, settle_network, vm_config,
};
use super::image::{META_DISK_MTIME, META_DISK_SIZE};
use super::warm::{self, Frozen};
use super::*;

/// Snapshot metadata: the agent client's next request id. A restored client starts there:
/// requests that were in flight (answered by the restored agent) never share an id with
/// new ones.
const META_NEXT_ID: &str = "agent_next_id";

/// Snapshot metadata: the background processes running when it was taken, as JSON
/// `[[spawn request id, command line, terminal], ...]`; the agent's output was held while
/// the VM was saved, and a restored copy adopts them and releases it.
const META_PROCESSES: &str = "processes";

/// Snapshot metadata: the manifest digest of the image the guest's root came from.
const META_IMAGE_DIGEST: &str = "image_digest";

/// Snapshot metadata: the guest's MAC (`aa:bb:cc:dd:ee:ff`), for a sandbox with a network.
/// Its driver read it at boot: a restored copy's device keeps it, on a link of its own.
const META_NET_MAC: &str = "net_mac";

/// A restored guest's background processes, their requests taken over by the new client:
/// handle, command line, terminal.
type Adopted = Vec<(agent_client::ExecHandle, String, bool)>;

/// Snapshot artifact: the VMM's versioned state file.
pub(crate) const STATE_ARTIFACT: &str = "vm-state.json";
/// Snapshot artifact: the non-zero pages of guest memory ([`memfile`]).
pub(crate) const MEMORY_ARTIFACT: &str = "memory.extents";

impl MicrovmSandbox {
    pub(crate) async fn restore(
        backend: &MicrovmBackend,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Self> {
        let m = store.manifest_for(id, TIER).await?;
        let engine = MicrovmBackend::engine();
        if m.engine != engine {
            return Err(SnapshotError::Incompatible {
                id: id.clone(),
                reason: format!("taken with `{}`, this library is `{engine}`", m.engine),
            }
            .into());
        }
        // The guest's agent is in the snapshot's memory: one from another build would speak
        // to this library's client with another protocol.
        let agent = format!("{SOURCE_HASH:016x}");
        if let Some(theirs) = m.metadata.get("agent_hash").filter(|h| **h != agent) {
            return Err(SnapshotError::Incompatible {
                id: id.clone(),
                reason: format!(
                    "its guest runs agent build {theirs}, this library's agent is {agent}                      (snapshots do not carry over agent changes: start a new sandbox)"
                ),
            }
            .into());
        }
        let corrupt = |what: &str| -> Error {
            SnapshotError::Corrupt {
                id: id.clone(),
                what: what.into(),
            }
            .into()
        };
        let mem_size: u64 = m
            .metadata
            .get("mem_size")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| corrupt("metadata `mem_size` is missing or not a number"))?;
        let vcpus: u8 = m
            .metadata
            .get("vcpus")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| corrupt("metadata `vcpus` is missing or not a number"))?;
        check_spec(&m.spec)?;
        // A network: a link of the copy's own (its enforcer refuses here if there is none),
        // with the snapshot's MAC; the guest moves `eth0` to it once restored.
        let proxied = secrets.proxied();
        check_proxied(backend, &proxied)?;
        let enforcer =
            sandbox_core::egress::enforcer_for(TIER, backend.egress.as_ref(), &m.spec.network)?;
        let mac = match (&enforcer, m.metadata.get(META_NET_MAC)) {
            (None, _) => None,
            (Some(_), Some(v)) => Some(
                crate::devices::virtio::net::parse_mac(v)
                    .ok_or_else(|| corrupt(&format!("metadata `{META_NET_MAC}`: {v:?}")))?,
            ),
            (Some(_), None) => {
                return Err(corrupt(&format!(
                    "metadata `{META_NET_MAC}` is missing for a sandbox with a network"
                )))
            }
        };
        let mut t = TimelineRecorder::start();
        tokio::task::spawn_blocking(MicrovmBackend::check_kvm)
            .await
            .map_err(join_err)??;
        // The very disk the guest had: its kernel's page cache and ext4 state refer to it.
        let image = match &m.spec.image {
            Some(r) => {
                let root = ImageRoot::prepare(backend, r, m.spec.language).await?;
                let want = (
                    m.metadata.get(META_IMAGE_DIGEST),
                    m.metadata.get(META_DISK_SIZE),
                    m.metadata.get(META_DISK_MTIME),
                );
                let (size, mtime) = root.disk_identity()?;
                let (size, mtime) = (size.to_string(), mtime.to_string());
                let have = (
                    Some(&root.image.digest().to_string()),
                    Some(&size),
                    Some(&mtime),
                );
                if want != have {
                    return Err(SnapshotError::Incompatible {
                        id: id.clone(),
                        reason: format!(
                            "the guest's root disk changed since the snapshot (image {:?}, \
                             disk {:?} bytes, modified {:?} ns; now {} with {size} bytes, \
                             modified {mtime} ns): the filesystem image was rebuilt, or the \
                             image moved",
                            want.0,
                            want.1,
                            want.2,
                            root.image.digest()
                        ),
                    }
                    .into());
                }
                Some(root)
            }
            None => None,
        };
        let state = store.artifact(id, STATE_ARTIFACT).await?;
        // The restored client's first request id. Snapshots from before it was recorded had
        // nothing in flight but the requests of the snapshot itself: any id past a generous
        // margin is new.
        let next_id: u32 = m
            .metadata
            .get(META_NEXT_ID)
            .and_then(|v| v.parse().ok())
            .unwrap_or(1 << 20);
        // Unpacked once and kept: restores of one snapshot map one memory file, and share
        // the pages none of them wrote.
        let unpacked_key = {
            use sha2::Digest;
            format!("{id}:{:x}", sha2::Sha256::digest(&state))
        };
        let frozen = match backend.warm.unpacked(&unpacked_key) {
            Some(f) => f,
            None => {
                let memory = store.artifact(id, MEMORY_ARTIFACT).await?;
                let snap_id = id.clone();
                let dir = tokio::task::spawn_blocking(move || -> Result<tempfile::TempDir> {
                    let dir = crate::stale::tempdir("restore-")
                        .map_err(|e| Error::io("create a restore directory", e))?;
                    let p = dir.path().join(crate::vmm::vm::SNAPSHOT_STATE_FILE);
                    std::fs::write(&p, &state).map_err(|e| Error::io_path("write", &p, e))?;
                    let p = dir.path().join(crate::vmm::vm::SNAPSHOT_MEMORY_FILE);
                    memfile::unpack(&memory, mem_size, &p).map_err(|e| match e {
                        memfile::UnpackError::Io(e) => Error::io_path("write", &p, e),
                        memfile::UnpackError::Corrupt(what) => SnapshotError::Corrupt {
                            id: snap_id,
                            what: format!("{MEMORY_ARTIFACT}: {what}"),
                        }
                        .into(),
                    })?;
                    Ok(dir)
                })
                .await
                .map_err(join_err)??;
                Arc::new(Frozen::unpacked(dir, next_id))
            }
        };
        t.mark(Phase::Filesystem);
        let sandbox_id = super::create::new_id();
        let mut net = match (enforcer, mac) {
            (Some(e), Some(mac)) => {
                let n = GuestNetwork::attach(e, &sandbox_id, &m.spec.network).await?;
                Some(n.with_mac(mac))
            }
            _ => None,
        };
        let ca_pem = bind_proxied(&mut net, &proxied).await?;
        if net.is_some() {
            t.mark(Phase::Network);
        }
        let mut vcfg = vm_config(mem_size, vcpus, m.spec.limits.lifetime(), image.as_ref());
        vcfg.net = net.as_ref().map(GuestNetwork::device);
        let settings = net.as_ref().map(GuestNetwork::agent_net);
        let processes: Vec<(u32, String, bool)> = match m.metadata.get(META_PROCESSES) {
            Some(v) => serde_json::from_str(v)
                .map_err(|e| corrupt(&format!("metadata `{META_PROCESSES}`: {e}")))?,
            None => Vec::new(),
        };
        let snap_id = id.clone();
        let warm = Arc::clone(&backend.warm);
        let name = sandbox_id.clone();
        let restored =
            tokio::task::spawn_blocking(move || -> Result<(Vm, AgentClient, Adopted)> {
                let mut vm = warm.restore(&frozen, vcfg).map_err(|e| match e {
                    VmmError::SnapshotCorrupt(what) => SnapshotError::Corrupt {
                        id: snap_id.clone(),
                        what,
                    }
                    .into(),
                    VmmError::SnapshotIncompatible(reason) => SnapshotError::Incompatible {
                        id: snap_id.clone(),
                        reason,
                    }
                    .into(),
                    other => Error::from(other),
                })?;
                // It restored: kept for the next restore of this snapshot.
                warm.keep_unpacked(unpacked_key, Arc::clone(&frozen));
                let agent = warm::restored_agent(&mut vm, &frozen)?;
                // The snapshot's processes: followed before the held output is released.
                let mut adopted = Vec::new();
                for (target, command, tty) in &processes {
                    let h = agent
                        .adopt(*target)
                        .map_err(|e| boot_failure(&vm, "adopting the restored processes", e))?;
                    adopted.push((h, command.clone(), *tty));
                }
                if !processes.is_empty() {
                    agent
                        .release(PING_TIMEOUT)
                        .map_err(|e| boot_failure(&vm, "the restored guest's agent", e))?;
                }
                warm::wake(&vm, &agent, &name)?;
                // Its device reaches the copy's own link now: `eth0` moves to it (the old
                // gateway's MAC goes with the old neighbour entries), and its TLS clients
                // trust the copy's proxy.
                settle_network(&vm, &agent, settings.as_deref(), ca_pem.as_deref())?;
                Ok((vm, agent, adopted))
            })
            .await
            .map_err(join_err)
            .and_then(|r| r);
        let (vm, agent, adopted) = match restored {
            Ok(r) => r,
            Err(e) => {
                if let Some(mut n) = net {
                    n.detach().await;
                }
                return Err(e);
            }
        };
        t.mark(Phase::Restore);
        let follow = agent.clone();
        let sb = Self::assemble(
            m.spec.clone(),
            &secrets,
            Boot {
                id: sandbox_id,
                mem_size,
                vcpus,
                kernel_version: m.metadata.get("kernel_version").cloned(),
                image,
                net,
            },
            agent,
            Machine::Vm(Arc::new(vm)),
            t,
        );
        sb.inner.adopt_processes(&follow, adopted)?;
        Ok(sb)
    }
}

impl Inner {
    pub(super) async fn snapshot(
        self: &Arc<Self>,
        store: &dyn SnapshotStore,
    ) -> Result<SnapshotId> {
        let exclusive = Arc::clone(&self.lifecycle).write_owned().await;
        let (agent, machine) = self.machine_handles()?;
        // A network device is bound to this sandbox's link: the snapshot records its MAC,
        // and a restored copy gets a link, address and TAP of its own (see `restore`).
        let mac = lock(&self.net).as_ref().map(|n| n.device().mac);
        // Background processes keep running in the snapshot: their `Spawn`s stay in flight
        // on the agent channel. The agent holds its output while the VM is saved (no frame
        // is cut by the snapshot; the restored agent waits for its new host), and the
        // snapshot records them for the restored copy to adopt.
        let background = self.background_processes();
        // A published port's connection is a `Connect` in flight on the same channel.
        let open = self.open_connections();
        if open > 0 {
            return Err(Error::unsupported(
                TIER,
                format!(
                    "snapshots while a published port has open connections ({open}: they \
                     travel on the agent channel, which a restored VM cannot carry on); close \
                     them first"
                ),
            ));
        }
        let vm = Arc::clone(machine.vm("snapshots")?);
        let hold = !background.is_empty();
        let a = agent.clone();
        let saved = tokio::task::spawn_blocking(move || -> Result<(Vec<u8>, Vec<u8>)> {
            let _exclusive = exclusive;
            let dir = crate::stale::tempdir("snap-")
                .map_err(|e| Error::io("create a snapshot directory", e))?;
            if hold {
                if let Err(e) = a.hold(PING_TIMEOUT) {
                    // It may have been carried out late: never leave the agent held.
                    let _ = a.release(PING_TIMEOUT);
                    return Err(map_agent_error(e, None));
                }
            }
            let info = vm.snapshot(dir.path());
            // This sandbox goes on, whether the snapshot worked or not.
            if hold {
                a.release(PING_TIMEOUT)
                    .map_err(|e| map_agent_error(e, None))?;
            }
            let info = info?;
            let state = std::fs::read(&info.state_file)
                .map_err(|e| Error::io_path("read", &info.state_file, e))?;
            let memory = memfile::pack(&info.memory_file)
                .map_err(|e| Error::io_path("read", &info.memory_file, e))?;
            Ok((state, memory))
        })
        .await
        .map_err(join_err)?;
        let (state, memory) = match saved {
            Ok(s) => s,
            Err(e) => {
                if let Some(why) = machine.ended() {
                    self.teardown(&why);
                    return Err(self.gone_error(why));
                }
                return Err(e);
            }
        };
        // Pinned to the image's digest: the restore gets this very image.
        let mut spec = self.spec.clone();
        if let (Some(r), Some(i)) = (&spec.image, &self.image) {
            spec.image = Some(r.pinned(i.image.digest()));
        }
        let mut draft = SnapshotDraft::new(
            TIER,
            MicrovmBackend::engine(),
            vec![SnapshotKind::FullMemory, SnapshotKind::Filesystem],
            spec,
        )
        .artifact(STATE_ARTIFACT, state)
        .artifact(MEMORY_ARTIFACT, memory)
        .meta("mem_size", self.mem_size.to_string())
        .meta("vcpus", self.vcpus.to_string())
        .meta("agent_hash", format!("{SOURCE_HASH:016x}"))
        .meta(META_NEXT_ID, agent.next_id().to_string())
        .meta(
            META_PROCESSES,
            serde_json::to_string(&background)
                .map_err(|e| Error::backend_caused(TIER, "recording the processes", e))?,
        )
        .meta("sandbox_id", self.id.clone());
        if let Some(v) = &self.kernel_version {
            draft = draft.meta("kernel_version", v.clone());
        }
        if let Some(mac) = mac {
            draft = draft.meta(META_NET_MAC, crate::devices::virtio::net::format_mac(&mac));
        }
        if let Some(i) = &self.image {
            let (size, mtime) = i.disk_identity()?;
            draft = draft
                .meta(META_IMAGE_DIGEST, i.image.digest())
                .meta(META_DISK_SIZE, size.to_string())
                .meta(META_DISK_MTIME, mtime.to_string());
        }
        Ok(store.put(draft).await?)
    }
}
