//! Keeping sandboxes across a restart (`ServerConfig::keep_on_exit`): when the server stops,
//! each sandbox is snapshotted into its client's store and recorded in a file; the next server
//! started with the same file restores them, under the same ids, labels and owners, before it
//! accepts a request. What a tier cannot snapshot (or a snapshot that fails) is destroyed and
//! said, never left running.

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::api::SandboxInfo;
use crate::{auth, Entry, Shared};

/// One kept sandbox.
#[derive(Debug, Serialize, Deserialize)]
struct Kept {
    info: SandboxInfo,
    owner: String,
    snapshot: sandbox_core::SnapshotId,
}

/// Snapshots and destroys every sandbox; records those snapshotted in `file` (written
/// whole, then renamed, `0600`). Returns how many were kept.
pub(crate) async fn keep_all(shared: &Shared, file: &Path) -> usize {
    let all: Vec<Arc<Entry>> = shared.lock().drain().map(|(_, e)| e).collect();
    let mut kept = Vec::new();
    for e in all {
        let store = shared.config.snapshot_store_for(&e.owner.0);
        let snap = match &store {
            Some(st) => e.sandbox.snapshot(st.as_ref()).await,
            None => Err(sandbox_core::Error::unsupported(
                e.info.tier,
                "keeping sandboxes without a snapshot store",
            )),
        };
        match snap {
            Ok(snapshot) => kept.push(Kept {
                info: e.info(),
                owner: e.owner.0.to_string(),
                snapshot,
            }),
            Err(err) => {
                tracing::warn!(sandbox = %e.info.id, error = %err, "not kept: destroyed")
            }
        }
        if let Err(err) = e.sandbox.destroy().await {
            tracing::warn!(sandbox = %e.info.id, error = %err, "destroy at shutdown");
        }
    }
    if let Err(err) = write_private(file, &kept) {
        tracing::error!(file = %file.display(), error = %err, "the kept sandboxes' record");
        return 0;
    }
    kept.len()
}

fn write_private(file: &Path, kept: &[Kept]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let json = serde_json::to_vec_pretty(kept).map_err(std::io::Error::other)?;
    let tmp = file.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&json)?;
    f.sync_all()?;
    std::fs::rename(&tmp, file)
}

/// Restores what `file` records (then removes it, and each snapshot used); returns how many
/// came back and what did not, with why.
pub(crate) async fn restore_kept(shared: &Shared, file: &Path) -> (usize, Vec<String>) {
    let Ok(bytes) = std::fs::read(file) else {
        return (0, Vec::new());
    };
    let kept: Vec<Kept> = match serde_json::from_slice(&bytes) {
        Ok(k) => k,
        Err(e) => return (0, vec![format!("{}: {e}", file.display())]),
    };
    let (mut back, mut lost) = (0, Vec::new());
    for k in kept {
        let Some(store) = shared.config.snapshot_store_for(&k.owner) else {
            lost.push(format!("{}: no snapshot store for its client", k.info.id));
            continue;
        };
        match shared.provider.restore(store.as_ref(), &k.snapshot).await {
            Ok(sb) => {
                let life = crate::lifetime::Lifetime::new(k.info.lifetime);
                let mut info = k.info;
                info.state = crate::api::SandboxState::Running;
                let entry = Entry {
                    sandbox: Arc::from(sb),
                    info,
                    life,
                    owner: auth::Caller(k.owner.into()),
                    procs: Default::default(),
                    e2b: Default::default(),
                };
                shared.lock().insert(entry.info.id.clone(), Arc::new(entry));
                let _ = store.delete(&k.snapshot).await;
                back += 1;
            }
            Err(e) => lost.push(format!("{}: {e}", k.info.id)),
        }
    }
    let _ = std::fs::remove_file(file);
    (back, lost)
}
