//! Snapshots: a manifest plus named artifacts, stored content-addressed in any
//! [`object_store`] (a local directory by default; S3/GCS/Azure are configuration).
//!
//! Layout under the store's prefix:
//! - `blobs/<sha256>`: artifact bytes, addressed by their SHA-256 (deduplicated);
//! - `manifests/<id>.json`: the manifest; `id` is the SHA-256 of the manifest bytes.
//!
//! Writes are atomic per object (the local store writes a staged file and renames it; cloud
//! stores commit a PUT whole) and the manifest is written **last**, so a crash leaves at most
//! unreferenced blobs, never a half snapshot. Every read re-checks sizes and hashes: a corrupt,
//! truncated or foreign snapshot is refused with a [`SnapshotError`] before a backend uses it.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use time::OffsetDateTime;

use crate::capabilities::SnapshotKind;
use crate::spec::SandboxSpec;
use crate::tier::Tier;

/// The manifest format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Everything that can go wrong with a snapshot.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// No snapshot with this id in the store.
    #[error("snapshot {0} not found in the store")]
    NotFound(SnapshotId),
    /// Bytes do not match their recorded hash or size.
    #[error("snapshot {id} is corrupt: {what}; it was not restored (take a new snapshot)")]
    Corrupt {
        /// The snapshot.
        id: SnapshotId,
        /// What did not match.
        what: String,
    },
    /// The snapshot was taken by another tier.
    #[error("snapshot {id} belongs to the {found} tier, not {expected}: restore it with a {found} backend")]
    Foreign {
        /// The snapshot.
        id: SnapshotId,
        /// The tier asked to restore it.
        expected: Tier,
        /// The tier that wrote it.
        found: Tier,
    },
    /// Written by an incompatible engine or format version.
    #[error("snapshot {id} is incompatible: {reason}")]
    Incompatible {
        /// The snapshot.
        id: SnapshotId,
        /// What differs (format version, engine version, memory size...).
        reason: String,
    },
    /// The id is not a SHA-256 hex string.
    #[error("`{0}` is not a snapshot id (64 hex digits)")]
    BadId(String),
    /// The manifest lacks an artifact the backend needs.
    #[error("snapshot {id} has no artifact `{name}`")]
    MissingArtifact {
        /// The snapshot.
        id: SnapshotId,
        /// The artifact name.
        name: String,
    },
    /// The object store failed.
    #[error("snapshot store: {0}")]
    Store(String),
    /// Nobody this store trusts made the snapshot, and restoring it would trust its contents
    /// (a server's store refuses clients' memory snapshots).
    #[error("snapshot {id} cannot be restored here: {reason}")]
    Untrusted {
        /// The snapshot.
        id: SnapshotId,
        /// Why, and what would allow it.
        reason: String,
    },
}

/// A snapshot's id: the SHA-256 of its manifest, as 64 lower-case hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SnapshotId(String);

impl SnapshotId {
    /// The hex string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for SnapshotId {
    type Err = SnapshotError;

    fn from_str(s: &str) -> Result<Self, SnapshotError> {
        if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
            Ok(SnapshotId(s.to_ascii_lowercase()))
        } else {
            Err(SnapshotError::BadId(s.chars().take(80).collect()))
        }
    }
}

impl TryFrom<String> for SnapshotId {
    type Error = SnapshotError;

    fn try_from(s: String) -> Result<Self, SnapshotError> {
        s.parse()
    }
}

impl From<SnapshotId> for String {
    fn from(id: SnapshotId) -> String {
        id.0
    }
}

/// One stored artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ArtifactEntry {
    /// SHA-256 of the bytes, hex.
    pub sha256: String,
    /// Size in bytes.
    pub size: u64,
}

/// What a snapshot is and holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SnapshotManifest {
    /// Manifest format version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// The tier that wrote it.
    pub tier: Tier,
    /// The engine and its version (e.g. `wasmtime 48.0.8`), checked by the backend on restore.
    pub engine: String,
    /// What it captures.
    pub kinds: Vec<SnapshotKind>,
    /// The spec of the snapshotted sandbox (names only: never secret values).
    pub spec: SandboxSpec,
    /// When it was taken.
    #[serde(with = "time::serde::rfc3339")]
    pub created: OffsetDateTime,
    /// Artifacts by name.
    pub artifacts: BTreeMap<String, ArtifactEntry>,
    /// Backend-specific metadata (memory size, vCPU count, sandbox id...).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

impl ArtifactEntry {
    /// An artifact of `size` bytes whose SHA-256 is `sha256` (hex).
    pub fn new(sha256: impl Into<String>, size: u64) -> Self {
        ArtifactEntry {
            sha256: sha256.into(),
            size,
        }
    }
}

impl SnapshotManifest {
    /// A manifest in the current [`FORMAT_VERSION`] of a snapshot `tier` took with `engine`
    /// at `created`, capturing `kinds` of a sandbox made from `spec`; no metadata
    /// (set [`SnapshotManifest::metadata`] to add some).
    pub fn new(
        tier: Tier,
        engine: impl Into<String>,
        kinds: Vec<SnapshotKind>,
        spec: SandboxSpec,
        created: OffsetDateTime,
        artifacts: BTreeMap<String, ArtifactEntry>,
    ) -> Self {
        SnapshotManifest {
            format_version: FORMAT_VERSION,
            tier,
            engine: engine.into(),
            kinds,
            spec,
            created,
            artifacts,
            metadata: BTreeMap::new(),
        }
    }

    /// Sum of artifact sizes.
    pub fn total_bytes(&self) -> u64 {
        self.artifacts.values().map(|a| a.size).sum()
    }
}

/// A snapshot being written: backends fill it, the store commits it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SnapshotDraft {
    /// The tier writing it.
    pub tier: Tier,
    /// Engine and version.
    pub engine: String,
    /// What it captures.
    pub kinds: Vec<SnapshotKind>,
    /// The sandbox's spec.
    pub spec: SandboxSpec,
    /// Backend metadata.
    pub metadata: BTreeMap<String, String>,
    /// Named artifacts.
    pub artifacts: BTreeMap<String, Bytes>,
}

impl SnapshotDraft {
    /// An empty draft.
    pub fn new(
        tier: Tier,
        engine: impl Into<String>,
        kinds: Vec<SnapshotKind>,
        spec: SandboxSpec,
    ) -> Self {
        SnapshotDraft {
            tier,
            engine: engine.into(),
            kinds,
            spec,
            metadata: BTreeMap::new(),
            artifacts: BTreeMap::new(),
        }
    }

    /// Adds an artifact.
    pub fn artifact(mut self, name: impl Into<String>, data: impl Into<Bytes>) -> Self {
        self.artifacts.insert(name.into(), data.into());
        self
    }

    /// Adds a metadata entry.
    pub fn meta(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }
}

/// Stores and loads snapshots.
#[async_trait]
pub trait SnapshotStore: Send + Sync {
    /// Commits a snapshot and returns its id.
    async fn put(&self, draft: SnapshotDraft) -> Result<SnapshotId, SnapshotError>;

    /// Loads and verifies a manifest.
    async fn manifest(&self, id: &SnapshotId) -> Result<SnapshotManifest, SnapshotError>;

    /// Loads one artifact, verifying its size and hash.
    async fn artifact(&self, id: &SnapshotId, name: &str) -> Result<Bytes, SnapshotError>;

    /// Lists stored snapshot ids.
    async fn list(&self) -> Result<Vec<SnapshotId>, SnapshotError>;

    /// Deletes a snapshot's manifest (blobs may be shared and are kept).
    async fn delete(&self, id: &SnapshotId) -> Result<(), SnapshotError>;

    /// Loads a manifest and checks it was written by `tier` in this format.
    async fn manifest_for(
        &self,
        id: &SnapshotId,
        tier: Tier,
    ) -> Result<SnapshotManifest, SnapshotError> {
        let m = self.manifest(id).await?;
        if m.tier != tier {
            return Err(SnapshotError::Foreign {
                id: id.clone(),
                expected: tier,
                found: m.tier,
            });
        }
        Ok(m)
    }
}

/// A [`SnapshotStore`] over any [`ObjectStore`].
#[derive(Debug, Clone)]
pub struct ObjectSnapshotStore {
    store: Arc<dyn ObjectStore>,
    prefix: ObjPath,
}

fn hex_sha256(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

fn store_err(e: object_store::Error) -> SnapshotError {
    SnapshotError::Store(e.to_string())
}

impl ObjectSnapshotStore {
    /// Over an object store, under `prefix` (e.g. `snapshots`).
    pub fn new(store: Arc<dyn ObjectStore>, prefix: &str) -> Self {
        ObjectSnapshotStore {
            store,
            prefix: ObjPath::from(prefix),
        }
    }

    /// A local directory (created if missing).
    pub fn local(dir: impl AsRef<Path>) -> Result<Self, SnapshotError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir)
            .map_err(|e| SnapshotError::Store(format!("create {}: {e}", dir.display())))?;
        let fs = LocalFileSystem::new_with_prefix(dir).map_err(store_err)?;
        Ok(Self::new(Arc::new(fs), ""))
    }

    fn blob_path(&self, sha: &str) -> ObjPath {
        self.prefix.clone().join("blobs").join(sha)
    }

    fn manifest_path(&self, id: &SnapshotId) -> ObjPath {
        self.prefix
            .clone()
            .join("manifests")
            .join(format!("{id}.json"))
    }

    async fn get_bytes(&self, path: &ObjPath) -> Result<Option<Bytes>, SnapshotError> {
        match self.store.get(path).await {
            Ok(r) => Ok(Some(r.bytes().await.map_err(store_err)?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(store_err(e)),
        }
    }
}

#[async_trait]
impl SnapshotStore for ObjectSnapshotStore {
    async fn put(&self, draft: SnapshotDraft) -> Result<SnapshotId, SnapshotError> {
        let mut artifacts = BTreeMap::new();
        for (name, data) in &draft.artifacts {
            let sha = hex_sha256(data);
            let path = self.blob_path(&sha);
            // Content-addressed: an existing blob with this hash is already right.
            let exists = match self.store.head(&path).await {
                Ok(meta) => meta.size == data.len() as u64,
                Err(object_store::Error::NotFound { .. }) => false,
                Err(e) => return Err(store_err(e)),
            };
            if !exists {
                self.store
                    .put(&path, PutPayload::from(data.clone()))
                    .await
                    .map_err(store_err)?;
            }
            artifacts.insert(
                name.clone(),
                ArtifactEntry {
                    sha256: sha,
                    size: data.len() as u64,
                },
            );
        }
        let manifest = SnapshotManifest {
            format_version: FORMAT_VERSION,
            tier: draft.tier,
            engine: draft.engine,
            kinds: draft.kinds,
            spec: draft.spec,
            created: OffsetDateTime::now_utc(),
            artifacts,
            metadata: draft.metadata,
        };
        let bytes = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| SnapshotError::Store(format!("encode manifest: {e}")))?;
        let id = SnapshotId(hex_sha256(&bytes));
        self.store
            .put(&self.manifest_path(&id), PutPayload::from(bytes))
            .await
            .map_err(store_err)?;
        tracing::debug!(snapshot = %id, tier = %manifest.tier, bytes = manifest.total_bytes(), "snapshot stored");
        Ok(id)
    }

    async fn manifest(&self, id: &SnapshotId) -> Result<SnapshotManifest, SnapshotError> {
        let bytes = self
            .get_bytes(&self.manifest_path(id))
            .await?
            .ok_or_else(|| SnapshotError::NotFound(id.clone()))?;
        if hex_sha256(&bytes) != id.as_str() {
            return Err(SnapshotError::Corrupt {
                id: id.clone(),
                what: "manifest does not match its id".into(),
            });
        }
        #[derive(Deserialize)]
        struct Version {
            format_version: u32,
        }
        let v: Version = serde_json::from_slice(&bytes).map_err(|e| SnapshotError::Corrupt {
            id: id.clone(),
            what: format!("manifest is not valid JSON: {e}"),
        })?;
        if v.format_version != FORMAT_VERSION {
            return Err(SnapshotError::Incompatible {
                id: id.clone(),
                reason: format!(
                    "format version {} (this build reads {FORMAT_VERSION})",
                    v.format_version
                ),
            });
        }
        serde_json::from_slice(&bytes).map_err(|e| SnapshotError::Corrupt {
            id: id.clone(),
            what: format!("manifest does not parse: {e}"),
        })
    }

    async fn artifact(&self, id: &SnapshotId, name: &str) -> Result<Bytes, SnapshotError> {
        let m = self.manifest(id).await?;
        let entry = m
            .artifacts
            .get(name)
            .ok_or_else(|| SnapshotError::MissingArtifact {
                id: id.clone(),
                name: name.into(),
            })?;
        let data = self
            .get_bytes(&self.blob_path(&entry.sha256))
            .await?
            .ok_or_else(|| SnapshotError::Corrupt {
                id: id.clone(),
                what: format!("artifact `{name}` is missing"),
            })?;
        if data.len() as u64 != entry.size {
            return Err(SnapshotError::Corrupt {
                id: id.clone(),
                what: format!(
                    "artifact `{name}` is truncated or padded: {} bytes, expected {}",
                    data.len(),
                    entry.size
                ),
            });
        }
        if hex_sha256(&data) != entry.sha256 {
            return Err(SnapshotError::Corrupt {
                id: id.clone(),
                what: format!("artifact `{name}` fails its checksum"),
            });
        }
        Ok(data)
    }

    async fn list(&self) -> Result<Vec<SnapshotId>, SnapshotError> {
        let prefix = self.prefix.clone().join("manifests");
        let metas: Vec<_> = self
            .store
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(store_err)?;
        let mut ids: Vec<SnapshotId> = metas
            .iter()
            .filter_map(|m| m.location.filename()?.strip_suffix(".json")?.parse().ok())
            .collect();
        ids.sort();
        Ok(ids)
    }

    async fn delete(&self, id: &SnapshotId) -> Result<(), SnapshotError> {
        match self.store.delete(&self.manifest_path(id)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(store_err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::Language;

    fn draft() -> SnapshotDraft {
        SnapshotDraft::new(
            Tier::Unisolated,
            "test 1",
            vec![SnapshotKind::Filesystem],
            SandboxSpec::new(Language::Shell),
        )
        .artifact("fs.tar", Bytes::from_static(b"hello world"))
        .artifact("memory", Bytes::from(vec![7u8; 4096]))
        .meta("k", "v")
    }

    async fn corrupt_blob(dir: &Path, sha: &str, data: &[u8]) {
        tokio::fs::write(dir.join("blobs").join(sha), data)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let store = ObjectSnapshotStore::local(dir.path()).unwrap();
        let id = store.put(draft()).await.unwrap();
        let m = store.manifest_for(&id, Tier::Unisolated).await.unwrap();
        assert_eq!(m.total_bytes(), 11 + 4096);
        assert_eq!(m.metadata["k"], "v");
        assert_eq!(
            &store.artifact(&id, "fs.tar").await.unwrap()[..],
            b"hello world"
        );
        assert_eq!(store.list().await.unwrap(), vec![id.clone()]);
        // no temp files left beside the objects
        let mut names = vec![];
        for sub in ["blobs", "manifests"] {
            for e in std::fs::read_dir(dir.path().join(sub)).unwrap() {
                names.push(e.unwrap().file_name().into_string().unwrap());
            }
        }
        assert!(names.iter().all(|n| !n.contains('#')), "{names:?}");
        // content-addressed: the same draft twice shares blobs
        let id2 = store.put(draft()).await.unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path().join("blobs")).unwrap().count(),
            2
        );
        assert_ne!(id, id2, "created time differs, so the manifest id differs");
        store.delete(&id).await.unwrap();
        store.delete(&id).await.unwrap();
        assert!(matches!(
            store.manifest(&id).await,
            Err(SnapshotError::NotFound(_))
        ));
    }

    #[tokio::test]
    async fn corruption_truncation_and_foreign_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = ObjectSnapshotStore::local(dir.path()).unwrap();
        let id = store.put(draft()).await.unwrap();
        let m = store.manifest(&id).await.unwrap();
        let sha = m.artifacts["memory"].sha256.clone();

        assert!(matches!(
            store.manifest_for(&id, Tier::Gvisor).await,
            Err(SnapshotError::Foreign {
                found: Tier::Unisolated,
                ..
            })
        ));

        corrupt_blob(dir.path(), &sha, &[7u8; 100]).await;
        let e = store.artifact(&id, "memory").await.unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");

        let mut flipped = vec![7u8; 4096];
        flipped[100] = 8;
        corrupt_blob(dir.path(), &sha, &flipped).await;
        let e = store.artifact(&id, "memory").await.unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");

        assert!(matches!(
            store.artifact(&id, "nope").await,
            Err(SnapshotError::MissingArtifact { .. })
        ));

        // A tampered manifest no longer matches its id.
        let mpath = dir.path().join("manifests").join(format!("{id}.json"));
        let text = std::fs::read_to_string(&mpath)
            .unwrap()
            .replace("unisolated", "wasm");
        std::fs::write(&mpath, text).unwrap();
        assert!(matches!(
            store.manifest(&id).await,
            Err(SnapshotError::Corrupt { .. })
        ));

        // A manifest from another format version is refused as incompatible.
        let mut future = serde_json::to_value(&m).unwrap();
        future["format_version"] = 99.into();
        let bytes = serde_json::to_vec(&future).unwrap();
        let fid: SnapshotId = hex_sha256(&bytes).parse().unwrap();
        std::fs::write(
            dir.path().join("manifests").join(format!("{fid}.json")),
            bytes,
        )
        .unwrap();
        assert!(matches!(
            store.manifest(&fid).await,
            Err(SnapshotError::Incompatible { .. })
        ));

        // garbage ids
        assert!("../../etc/passwd".parse::<SnapshotId>().is_err());
    }
}
