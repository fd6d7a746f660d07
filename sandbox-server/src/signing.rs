//! Snapshots this server made, told apart from ones a client sent.
//!
//! A client can upload a snapshot (`POST /v1/snapshots`) or, with a store of its own, write
//! one directly. Restoring a memory snapshot feeds its bytes to the engine as trusted state
//! (`runsc restore` does not treat a checkpoint image as hostile; a microVM's device and vCPU
//! state is parsed by our VMM), so a client-made one is an attack on the host. Every snapshot
//! this server writes carries an HMAC-SHA256 of its contents under a key only the server holds
//! (in its state directory, or made for the process); a snapshot without a valid one restores
//! only on tiers whose restore takes files alone, through the same checked unpacking as any
//! sandbox file, unless the operator granted host access.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use sandbox_core::{
    SandboxSpec, SnapshotDraft, SnapshotError, SnapshotId, SnapshotKind, SnapshotManifest,
    SnapshotStore, Tier,
};
use sha2::{Digest, Sha256};

/// Metadata key of a snapshot's server MAC (hex).
pub const MAC_KEY: &str = "agent-sandbox.server-mac";
/// Metadata key marking a snapshot a client uploaded (value `upload`).
pub const ORIGIN_KEY: &str = "agent-sandbox.origin";

/// Bytes of a key.
const KEY_LEN: usize = 32;

/// The key a server signs its snapshots with. Its value never leaves the process or its file.
pub struct SnapshotKey(ring::hmac::Key);

impl fmt::Debug for SnapshotKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SnapshotKey(..)")
    }
}

impl SnapshotKey {
    /// A fresh random key (snapshots signed with it verify only in this process).
    ///
    /// # Errors
    /// The system's random source failed.
    pub fn generate() -> io::Result<Self> {
        let mut b = [0u8; KEY_LEN];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
            .map_err(|_| io::Error::other("the system's random source failed"))?;
        Ok(Self::from_bytes(&b))
    }

    fn from_bytes(b: &[u8]) -> Self {
        SnapshotKey(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b))
    }

    /// The key in `path` (32 bytes), made there (mode `0600`, created exclusively) when the
    /// file does not exist.
    ///
    /// # Errors
    /// The file cannot be read or made, or is not 32 bytes.
    pub fn load_or_create(path: &Path) -> io::Result<Self> {
        match std::fs::read(path) {
            Ok(b) if b.len() == KEY_LEN => return Ok(Self::from_bytes(&b)),
            Ok(b) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{} holds {} bytes, not a {KEY_LEN}-byte snapshot key",
                        path.display(),
                        b.len()
                    ),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut b = [0u8; KEY_LEN];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
            .map_err(|_| io::Error::other("the system's random source failed"))?;
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
        {
            Ok(mut f) => {
                f.write_all(&b)?;
                f.sync_all()?;
                Ok(Self::from_bytes(&b))
            }
            // Another server made it first: use theirs.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Self::load_or_create(path),
            Err(e) => Err(e),
        }
    }

    /// What a snapshot's MAC covers, as bytes: tier, engine, kinds, spec, metadata (its MAC
    /// left out) and each artifact's name, SHA-256 and size.
    fn signed_bytes<'a>(
        &self,
        tier: Tier,
        engine: &str,
        kinds: &[SnapshotKind],
        spec: &SandboxSpec,
        metadata: &BTreeMap<String, String>,
        artifacts: impl Iterator<Item = (&'a String, String, u64)>,
    ) -> Vec<u8> {
        let mut metadata = metadata.clone();
        metadata.remove(MAC_KEY);
        let artifacts: BTreeMap<&String, serde_json::Value> = artifacts
            .map(|(n, sha, size)| (n, serde_json::json!({"sha256": sha, "size": size})))
            .collect();
        // serde_json's maps are ordered: the same contents give the same bytes.
        let canonical = serde_json::json!({
            "tier": tier,
            "engine": engine,
            "kinds": kinds,
            "spec": spec,
            "metadata": metadata,
            "artifacts": artifacts,
        });
        serde_json::to_vec(&canonical).unwrap_or_default()
    }

    /// Signs a draft (its metadata gets the MAC).
    pub fn sign(&self, draft: &mut SnapshotDraft) {
        let artifacts = draft
            .artifacts
            .iter()
            .map(|(n, b)| (n, hex::encode(Sha256::digest(b)), b.len() as u64));
        let bytes = self.signed_bytes(
            draft.tier,
            &draft.engine,
            &draft.kinds,
            &draft.spec,
            &draft.metadata,
            artifacts,
        );
        let mac = hex::encode(ring::hmac::sign(&self.0, &bytes).as_ref());
        draft.metadata.insert(MAC_KEY.to_string(), mac);
    }

    /// Whether this key signed the snapshot `m` describes (compared in constant time).
    pub fn verify(&self, m: &SnapshotManifest) -> bool {
        let Some(mac) = m.metadata.get(MAC_KEY).and_then(|h| hex::decode(h).ok()) else {
            return false;
        };
        let artifacts = m
            .artifacts
            .iter()
            .map(|(n, a)| (n, a.sha256.clone(), a.size));
        let bytes = self.signed_bytes(m.tier, &m.engine, &m.kinds, &m.spec, &m.metadata, artifacts);
        ring::hmac::verify(&self.0, &bytes, &mac).is_ok()
    }
}

/// Whether a tier's restore of a snapshot nobody vouches for is safe for the host: one that
/// takes files alone, unpacked like any sandbox file (the container tier: into the sandbox's
/// own upper layer and workspace, fd-relative; the wasm tier: its workspace; the test-only
/// unisolated tier). Memory
/// snapshots (gVisor checkpoints, microVM state) are not.
pub fn restores_untrusted(tier: Tier, kinds: &[SnapshotKind]) -> bool {
    matches!(tier, Tier::Container | Tier::Wasm | Tier::Unisolated)
        && kinds.iter().all(|k| *k == SnapshotKind::Filesystem)
}

/// A store that signs what the server writes and refuses to hand a snapshot nobody vouches
/// for to a tier whose restore would trust it.
pub(crate) struct SigningStore {
    inner: Arc<dyn SnapshotStore>,
    /// `None` (no random source for a key): nothing is signed, nothing verifies.
    key: Option<Arc<SnapshotKey>>,
    /// The operator granted host access: any snapshot restores.
    trust_all: bool,
}

impl SigningStore {
    pub(crate) fn wrap(
        inner: Arc<dyn SnapshotStore>,
        key: Option<Arc<SnapshotKey>>,
        trust_all: bool,
    ) -> Arc<dyn SnapshotStore> {
        Arc::new(SigningStore {
            inner,
            key,
            trust_all,
        })
    }
}

#[async_trait]
impl SnapshotStore for SigningStore {
    /// A draft marked as a client's upload ([`ORIGIN_KEY`]) is stored unsigned (any MAC it
    /// carries dropped); any other is signed.
    async fn put(&self, mut draft: SnapshotDraft) -> Result<SnapshotId, SnapshotError> {
        draft.metadata.remove(MAC_KEY);
        if draft.metadata.get(ORIGIN_KEY).map(String::as_str) != Some("upload") {
            draft.metadata.remove(ORIGIN_KEY);
            if let Some(k) = &self.key {
                k.sign(&mut draft);
            }
        }
        self.inner.put(draft).await
    }

    async fn manifest(&self, id: &SnapshotId) -> Result<SnapshotManifest, SnapshotError> {
        self.inner.manifest(id).await
    }

    /// Refused for a snapshot this server did not sign whose tier would restore it as trusted
    /// state (unless the operator granted host access).
    async fn artifact(&self, id: &SnapshotId, name: &str) -> Result<Bytes, SnapshotError> {
        if !self.trust_all {
            let m = self.inner.manifest(id).await?;
            // The bytes handed out are the ones the judged manifest names, whatever the
            // inner store checks itself.
            let Some(want) = m.artifacts.get(name).map(|a| a.sha256.clone()) else {
                return Err(SnapshotError::MissingArtifact {
                    id: id.clone(),
                    name: name.to_string(),
                });
            };
            let signed = self.key.as_ref().is_some_and(|k| k.verify(&m));
            if !restores_untrusted(m.tier, &m.kinds) && !signed {
                return Err(SnapshotError::Untrusted {
                    id: id.clone(),
                    reason: format!(
                        "it was not made by this server (no valid server signature), and the \
                         {} tier's restore would trust its {} state; the server restores such \
                         snapshots only when started with --allow-host-access",
                        m.tier,
                        if m.kinds.contains(&SnapshotKind::FullMemory) {
                            "memory"
                        } else {
                            "engine"
                        }
                    ),
                });
            }
            let bytes = self.inner.artifact(id, name).await?;
            if hex::encode(Sha256::digest(&bytes)) != want {
                return Err(SnapshotError::Corrupt {
                    id: id.clone(),
                    what: format!("artifact `{name}` is not the one its manifest names"),
                });
            }
            return Ok(bytes);
        }
        self.inner.artifact(id, name).await
    }

    async fn list(&self) -> Result<Vec<SnapshotId>, SnapshotError> {
        self.inner.list().await
    }

    async fn delete(&self, id: &SnapshotId) -> Result<(), SnapshotError> {
        self.inner.delete(id).await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use sandbox_core::Language;

    fn draft(tier: Tier, kinds: Vec<SnapshotKind>) -> SnapshotDraft {
        let mut d = SnapshotDraft::new(tier, "test 1", kinds, SandboxSpec::new(Language::Shell));
        d.artifacts
            .insert("state".into(), Bytes::from_static(b"memory of a process"));
        d.metadata.insert("uid".into(), "0".into());
        d
    }

    #[tokio::test]
    async fn server_snapshots_verify_and_client_ones_feed_only_file_tiers() {
        let dir = tempfile::tempdir().unwrap();
        let inner: Arc<dyn SnapshotStore> =
            Arc::new(sandbox_core::ObjectSnapshotStore::local(dir.path()).unwrap());
        let key = Arc::new(SnapshotKey::generate().unwrap());
        let store = SigningStore::wrap(Arc::clone(&inner), Some(Arc::clone(&key)), false);

        // Made by the server: signed, restorable.
        let own = store
            .put(draft(Tier::Gvisor, vec![SnapshotKind::FullMemory]))
            .await
            .unwrap();
        assert!(key.verify(&store.manifest(&own).await.unwrap()));
        assert!(store.artifact(&own, "state").await.is_ok());

        // Uploaded (or forged with a MAC of another key, or altered metadata): refused for a
        // memory tier.
        let mut up = draft(Tier::Gvisor, vec![SnapshotKind::FullMemory]);
        SnapshotKey::generate().unwrap().sign(&mut up);
        up.metadata.insert(ORIGIN_KEY.into(), "upload".into());
        let up = store.put(up).await.unwrap();
        let m = store.manifest(&up).await.unwrap();
        assert!(!m.metadata.contains_key(MAC_KEY) && !key.verify(&m));
        let e = store.artifact(&up, "state").await.unwrap_err();
        assert!(e.to_string().contains("--allow-host-access"), "{e}");

        let mut forged = draft(Tier::Microvm, vec![SnapshotKind::FullMemory]);
        key.sign(&mut forged);
        forged.metadata.insert("uid".into(), "1000".into());
        let forged = inner.put(forged).await.unwrap();
        assert!(store.artifact(&forged, "state").await.is_err());

        // Files for the container tier restore whoever made them; everything with the grant.
        let mut files = draft(Tier::Container, vec![SnapshotKind::Filesystem]);
        files.metadata.insert(ORIGIN_KEY.into(), "upload".into());
        let files = store.put(files).await.unwrap();
        assert!(store.artifact(&files, "state").await.is_ok());
        let granted = SigningStore::wrap(inner, Some(key), true);
        assert!(granted.artifact(&up, "state").await.is_ok());
    }

    #[test]
    fn a_key_file_is_made_once_and_kept_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("keys/snapshot.key");
        let a = SnapshotKey::load_or_create(&p).unwrap();
        let b = SnapshotKey::load_or_create(&p).unwrap();
        let mut d = draft(Tier::Gvisor, vec![]);
        a.sign(&mut d);
        let mac = d.metadata[MAC_KEY].clone();
        b.sign(&mut d);
        assert_eq!(d.metadata[MAC_KEY], mac);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        std::fs::write(&p, b"short").unwrap();
        assert!(SnapshotKey::load_or_create(&p).is_err());
    }
}
