//! Snapshots and restore: the VM's state file and its memory (packed by [`memfile`]) as
//! artifacts of a [`SnapshotStore`], and a sandbox brought back from them.

use super::create::{boot_failure, check_spec, vm_config};
use super::*;

/// Snapshot artifact: the VMM's versioned state file.
pub(crate) const STATE_ARTIFACT: &str = "vm-state.json";
/// Snapshot artifact: the non-zero pages of guest memory ([`memfile`]).
pub(crate) const MEMORY_ARTIFACT: &str = "memory.extents";

impl MicrovmSandbox {
    pub(crate) async fn restore(
        _backend: &MicrovmBackend,
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
        let mut t = TimelineRecorder::start();
        tokio::task::spawn_blocking(MicrovmBackend::check_kvm)
            .await
            .map_err(join_err)??;
        let state = store.artifact(id, STATE_ARTIFACT).await?;
        let memory = store.artifact(id, MEMORY_ARTIFACT).await?;
        let snap_id = id.clone();
        let dir = tokio::task::spawn_blocking(move || -> Result<tempfile::TempDir> {
            let dir = tempfile::Builder::new()
                .prefix("agent-sandbox-microvm-restore-")
                .tempdir()
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
        t.mark(Phase::Filesystem);
        let vcfg = vm_config(mem_size, vcpus, m.spec.limits.lifetime());
        let snap_id = id.clone();
        let (vm, agent) = tokio::task::spawn_blocking(move || -> Result<(Vm, AgentClient)> {
            let restored = Vm::restore(dir.path(), vcfg);
            // The memory file is mapped copy-on-write: the mapping keeps its pages, the
            // directory is not needed any more.
            drop(dir);
            let mut vm = restored.map_err(|e| match e {
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
            let console = vm
                .take_console()
                .ok_or_else(|| Error::backend(TIER, "the restored VM has no virtio console"))?;
            let agent = AgentClient::new(console)
                .map_err(|e| boot_failure(&vm, "starting the agent client", &e.to_string()))?;
            agent
                .ping(PING_TIMEOUT)
                .map_err(|e| boot_failure(&vm, "the restored guest's agent", &e.to_string()))?;
            Ok((vm, agent))
        })
        .await
        .map_err(join_err)??;
        t.mark(Phase::Restore);
        Ok(Self::assemble(
            m.spec.clone(),
            &secrets,
            mem_size,
            vcpus,
            m.metadata.get("kernel_version").cloned(),
            agent,
            Machine::Vm(Arc::new(vm)),
            t,
        ))
    }
}

impl Inner {
    pub(super) async fn snapshot(
        self: &Arc<Self>,
        store: &dyn SnapshotStore,
    ) -> Result<SnapshotId> {
        let exclusive = Arc::clone(&self.lifecycle).write_owned().await;
        let (_agent, machine) = self.machine_handles()?;
        let vm = Arc::clone(machine.vm("snapshots")?);
        let saved = tokio::task::spawn_blocking(move || -> Result<(Vec<u8>, Vec<u8>)> {
            let _exclusive = exclusive;
            let dir = tempfile::Builder::new()
                .prefix("agent-sandbox-microvm-snap-")
                .tempdir()
                .map_err(|e| Error::io("create a snapshot directory", e))?;
            let info = vm.snapshot(dir.path())?;
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
                    drop(self.teardown(&why));
                    return Err(self.gone_error(why));
                }
                return Err(e);
            }
        };
        let mut draft = SnapshotDraft::new(
            TIER,
            MicrovmBackend::engine(),
            vec![SnapshotKind::FullMemory, SnapshotKind::Filesystem],
            self.spec.clone(),
        )
        .artifact(STATE_ARTIFACT, state)
        .artifact(MEMORY_ARTIFACT, memory)
        .meta("mem_size", self.mem_size.to_string())
        .meta("vcpus", self.vcpus.to_string())
        .meta("agent_hash", format!("{SOURCE_HASH:016x}"))
        .meta("sandbox_id", self.id.clone());
        if let Some(v) = &self.kernel_version {
            draft = draft.meta("kernel_version", v.clone());
        }
        Ok(store.put(draft).await?)
    }
}
