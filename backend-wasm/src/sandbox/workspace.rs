//! The workspace from the host's side: the file API (beneath a handle on the folder, and
//! capped like the guest's own writes), snapshots of its files, the health check and
//! `destroy`.

use std::os::fd::{AsFd, OwnedFd};

use sandbox_core::{
    beneath, fsnap, DirEntry, Error, Result, SnapshotDraft, SnapshotId, SnapshotKind,
    SnapshotStore, WorkspacePath,
};

use super::{Inner, LangState, SNAPSHOT_FORMAT, TIER};
use crate::engine;
use crate::ENGINE_NAME;

impl Inner {
    /// Packs the workspace into a snapshot draft.
    fn snapshot_draft(&self) -> Result<SnapshotDraft> {
        // Streamed beneath a handle (a link swapped in is kept as a link), sparse files kept
        // sparse, and at most `limits.disk_bytes` of data for the sandbox's own workspace
        // (a host folder is the caller's, not capped).
        let cap = match self.host_workspace {
            None => self.spec.limits.disk_bytes,
            Some(_) => u64::MAX,
        };
        let tar = fsnap::pack_dir_limited(self.workspace()?, cap)?;
        Ok(SnapshotDraft::new(
            TIER,
            ENGINE_NAME,
            vec![SnapshotKind::Filesystem],
            self.spec.clone(),
        )
        .artifact("workspace.tar", tar)
        .meta("format", SNAPSHOT_FORMAT)
        .meta("sandbox_id", self.id.clone())
        .meta(
            "state",
            "workspace files only; interpreter state (Python/JavaScript variables) is not captured",
        ))
    }

    /// A handle on the workspace folder: the file API works beneath it (see
    /// `sandbox_core::beneath`), since code inside can swap any name for a symlink leading
    /// out (a relative one: `../../..`) at any moment.
    pub(super) fn workspace_fd(&self) -> Result<OwnedFd> {
        beneath::open_dir(self.workspace()?)
    }

    pub(super) async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        self.alive()?;
        let ws = self.workspace_fd()?;
        // The sandbox's own workspace is capped for the file API too (see `disk`).
        if self.host_workspace.is_none() {
            let (old, new) = match beneath::size_of(ws.as_fd(), path) {
                Some(len) => (len, 0),
                None => (0, 1),
            };
            let extra = u64::try_from(data.len())
                .unwrap_or(u64::MAX)
                .saturating_sub(old);
            if !crate::disk::fits(
                self.scratch()?.root(),
                self.spec.limits.disk_bytes,
                extra,
                new,
            ) {
                return Err(Error::io(
                    format!("write {}", WorkspacePath::parse(path)?.in_sandbox()),
                    std::io::Error::from_raw_os_error(28 /* ENOSPC */),
                ));
            }
        }
        let (data, path) = (data.to_vec(), path.to_string());
        tokio::task::spawn_blocking(move || beneath::write_file(ws.as_fd(), &path, &data, None))
            .await
            .map_err(|e| Error::backend_caused(TIER, "the file API's task", e))?
    }

    pub(super) async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.alive()?;
        let ws = self.workspace_fd()?;
        // One read returns at most what the sandbox's disk holds (`limits.disk_bytes`).
        let max = self.spec.limits.disk_bytes;
        let path = path.to_string();
        tokio::task::spawn_blocking(move || beneath::read_file(ws.as_fd(), &path, max))
            .await
            .map_err(|e| Error::backend_caused(TIER, "the file API's task", e))?
    }

    pub(super) async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.alive()?;
        beneath::list(self.workspace_fd()?.as_fd(), path)
    }

    pub(super) async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.alive()?;
        let draft = self.snapshot_draft()?;
        Ok(store.put(draft).await?)
    }

    pub(super) async fn health_check(&self) -> Result<()> {
        self.alive()?;
        if self.workspace()?.is_dir() {
            Ok(())
        } else {
            Err(Error::SandboxGone {
                id: self.id.clone(),
                reason: "workspace vanished".into(),
            })
        }
    }

    pub(super) async fn destroy(&self) -> Result<()> {
        let _held = self.life.hold().await;
        self.life.release("destroyed", || {
            self.watches.close_all();
            if let Ok(mut g) = self.state.try_lock() {
                engine::drop_later(std::mem::replace(&mut *g, LangState::Wasm));
            }
            // Only our private folders are emptied; a host workspace folder is the caller's.
            let mut dirs = Vec::new();
            if let Some(s) = self.scratch.get() {
                dirs.push(s.tmp());
                if self.host_workspace.is_none() {
                    dirs.push(s.workspace());
                }
            }
            for d in dirs {
                if let Ok(rd) = std::fs::read_dir(d) {
                    for e in rd.flatten() {
                        let p = e.path();
                        let _ = if p.is_dir() && !p.is_symlink() {
                            std::fs::remove_dir_all(&p)
                        } else {
                            std::fs::remove_file(&p)
                        };
                    }
                }
            }
        });
        Ok(())
    }
}
