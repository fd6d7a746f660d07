//! The wire form of a snapshot sent to or fetched from a server as one body: a tar of
//! `manifest.json` and `artifacts/NAME` per artifact. Used by `POST /v1/snapshots` (a client
//! restoring a snapshot of its own store on the server) and written by clients with
//! [`write_snapshot_tar`].

use std::collections::BTreeMap;
use std::io::Read;

use bytes::Bytes;
use sandbox_core::{SnapshotDraft, SnapshotManifest};
use sha2::{Digest, Sha256};

use crate::error::BadRequest;

/// Largest manifest accepted (it holds a spec and a list of names).
const MAX_MANIFEST: u64 = 1 << 20;

/// A tar of `manifest` and its `artifacts` (each must be one the manifest lists).
pub fn write_snapshot_tar(
    manifest: &SnapshotManifest,
    artifacts: &BTreeMap<String, Bytes>,
) -> std::io::Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    let mut add = |path: &str, data: &[u8]| -> std::io::Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o600);
        h.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut h, path, data)
    };
    let json = serde_json::to_vec(manifest).map_err(std::io::Error::other)?;
    add("manifest.json", &json)?;
    for (name, data) in artifacts {
        add(&format!("artifacts/{name}"), data)?;
    }
    tar.into_inner()
}

fn bad(reason: impl std::fmt::Display) -> BadRequest {
    BadRequest(format!(
        "the snapshot upload is not a tar of manifest.json and artifacts/NAME: {reason}"
    ))
}

/// Reads a snapshot tar into a draft: the manifest first, then exactly the artifacts it
/// lists, each of its size and SHA-256. Anything else (another path, a link, a duplicate, a
/// missing or altered artifact) is refused.
pub fn read_snapshot_tar(body: &[u8]) -> Result<SnapshotDraft, BadRequest> {
    let mut archive = tar::Archive::new(body);
    let entries = archive.entries().map_err(bad)?;
    let mut manifest: Option<SnapshotManifest> = None;
    let mut artifacts: BTreeMap<String, Bytes> = BTreeMap::new();
    for entry in entries {
        let mut entry = entry.map_err(bad)?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            return Err(bad("only regular files may be in it"));
        }
        let path = entry.path().map_err(bad)?.to_string_lossy().into_owned();
        if path == "manifest.json" {
            if manifest.is_some() {
                return Err(bad("manifest.json twice"));
            }
            let mut json = Vec::new();
            entry
                .by_ref()
                .take(MAX_MANIFEST + 1)
                .read_to_end(&mut json)
                .map_err(bad)?;
            if json.len() as u64 > MAX_MANIFEST {
                return Err(bad("manifest.json is over 1 MiB"));
            }
            manifest = Some(serde_json::from_slice(&json).map_err(bad)?);
            continue;
        }
        let Some(m) = &manifest else {
            return Err(bad("manifest.json must come first"));
        };
        let Some(name) = path.strip_prefix("artifacts/") else {
            return Err(bad(format!("unexpected entry `{path}`")));
        };
        let Some(want) = m.artifacts.get(name) else {
            return Err(bad(format!("artifact `{name}` is not in the manifest")));
        };
        if artifacts.contains_key(name) {
            return Err(bad(format!("artifact `{name}` twice")));
        }
        if entry.header().size().map_err(bad)? != want.size {
            return Err(bad(format!("artifact `{name}` is not {} bytes", want.size)));
        }
        // The size is the client's word: never allocate from it (a manifest stating 2^44 once
        // aborted the server). What is read is bounded by the body, which is in memory.
        if want.size > body.len() as u64 {
            return Err(bad(format!(
                "artifact `{name}` claims {} bytes, more than the whole upload",
                want.size
            )));
        }
        let mut data = Vec::new();
        entry
            .by_ref()
            .take(want.size)
            .read_to_end(&mut data)
            .map_err(bad)?;
        if data.len() as u64 != want.size {
            return Err(bad(format!("artifact `{name}` is truncated")));
        }
        if hex::encode(Sha256::digest(&data)) != want.sha256 {
            return Err(bad(format!("artifact `{name}` does not match its SHA-256")));
        }
        artifacts.insert(name.to_string(), Bytes::from(data));
    }
    let m = manifest.ok_or_else(|| bad("no manifest.json"))?;
    if let Some(missing) = m.artifacts.keys().find(|n| !artifacts.contains_key(*n)) {
        return Err(bad(format!("artifact `{missing}` is missing")));
    }
    let mut draft = SnapshotDraft::new(m.tier, m.engine, m.kinds, m.spec);
    draft.metadata = m.metadata;
    draft.artifacts = artifacts;
    Ok(draft)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_core::snapshot::ArtifactEntry;
    use sandbox_core::{Language, SandboxSpec, Tier};

    fn manifest(data: &[u8]) -> SnapshotManifest {
        let mut m = SnapshotManifest::new(
            Tier::Container,
            "test",
            vec![],
            SandboxSpec::new(Language::Shell),
            time::OffsetDateTime::UNIX_EPOCH,
            BTreeMap::from([(
                "fs.tar".to_string(),
                ArtifactEntry::new(hex::encode(Sha256::digest(data)), data.len() as u64),
            )]),
        );
        m.metadata = BTreeMap::from([("k".to_string(), "v".to_string())]);
        m
    }

    #[test]
    fn a_snapshot_goes_through_and_alterations_are_refused() {
        let m = manifest(b"files");
        let good = BTreeMap::from([("fs.tar".to_string(), Bytes::from_static(b"files"))]);
        let draft = read_snapshot_tar(&write_snapshot_tar(&m, &good).unwrap()).unwrap();
        assert_eq!(draft.artifacts["fs.tar"], Bytes::from_static(b"files"));
        assert_eq!(
            (draft.tier, &draft.metadata["k"]),
            (Tier::Container, &"v".to_string())
        );

        let altered = BTreeMap::from([("fs.tar".to_string(), Bytes::from_static(b"filez"))]);
        let e = read_snapshot_tar(&write_snapshot_tar(&m, &altered).unwrap()).unwrap_err();
        assert!(e.0.contains("SHA-256"), "{}", e.0);
        let e = read_snapshot_tar(&write_snapshot_tar(&m, &BTreeMap::new()).unwrap()).unwrap_err();
        assert!(e.0.contains("missing"), "{}", e.0);
        let extra = BTreeMap::from([
            ("fs.tar".to_string(), Bytes::from_static(b"files")),
            ("other".to_string(), Bytes::from_static(b"x")),
        ]);
        let e = read_snapshot_tar(&write_snapshot_tar(&m, &extra).unwrap()).unwrap_err();
        assert!(e.0.contains("not in the manifest"), "{}", e.0);
        assert!(read_snapshot_tar(b"not a tar at all").is_err());
    }
}
