//! Snapshots between the client's store and the server's. The traits take the store a
//! snapshot goes to (`Sandbox::snapshot`) or comes from (`Backend::restore`); for a remote
//! sandbox that store is the caller's, on the caller's machine, so a snapshot taken on the
//! server is fetched into it (manifest, then each artifact, checked against the manifest's
//! SHA-256), and one restored from it is sent to the server first (a tar, see
//! `sandbox_api::snapshot_tar`).

use std::collections::BTreeMap;

use bytes::Bytes;
use reqwest::Method;
use sandbox_api::SnapshotInfo;
use sandbox_core::{
    Error, Result, SnapshotDraft, SnapshotId, SnapshotManifest, SnapshotStore, Tier,
};
use sha2::{Digest, Sha256};

use crate::client::{encode, Client};
use crate::error::Failure;

/// Has the server snapshot sandbox `id` into its store, then copies that snapshot into
/// `store`; returns its id there.
pub(crate) async fn snapshot_into(
    client: &Client,
    tier: Tier,
    id: &str,
    store: &dyn SnapshotStore,
) -> Result<SnapshotId> {
    let err = |f: Failure| f.into_core(tier, Some(id), None);
    let req = client.request(
        Method::POST,
        &format!("/v1/sandboxes/{}/snapshot", encode(id)),
    );
    let info: SnapshotInfo = client.json(req).await.map_err(err)?;
    let sid = info.id.to_string();
    let req = client.request(Method::GET, &format!("/v1/snapshots/{sid}/manifest"));
    let m: SnapshotManifest = client.json(req).await.map_err(err)?;
    let mut draft = SnapshotDraft::new(m.tier, m.engine, m.kinds, m.spec);
    draft.metadata = m.metadata;
    for (name, want) in &m.artifacts {
        let req = client.request(
            Method::GET,
            &format!("/v1/snapshots/{sid}/artifacts/{}", encode(name)),
        );
        let resp = client.send(req).await.map_err(err)?;
        let data = resp
            .bytes()
            .await
            .map_err(|e| err(Failure::transport(&client.shown, e)))?;
        if data.len() as u64 != want.size || hex::encode(Sha256::digest(&data)) != want.sha256 {
            return Err(err(Failure::protocol(
                &client.shown,
                format!("snapshot artifact `{name}` does not match its manifest"),
            )));
        }
        draft.artifacts.insert(name.clone(), data);
    }
    Ok(store.put(draft).await?)
}

/// Sends snapshot `id` of `store` to the server; returns its id there.
pub(crate) async fn send_snapshot(
    client: &Client,
    tier: Tier,
    store: &dyn SnapshotStore,
    id: &SnapshotId,
) -> Result<SnapshotId> {
    let m = store.manifest_for(id, tier).await?;
    let mut artifacts = BTreeMap::<String, Bytes>::new();
    for name in m.artifacts.keys() {
        artifacts.insert(name.clone(), store.artifact(id, name).await?);
    }
    let body = sandbox_api::write_snapshot_tar(&m, &artifacts).map_err(|e| Error::Io {
        context: "pack the snapshot for the server".into(),
        source: e,
    })?;
    let req = client
        .request(Method::POST, "/v1/snapshots")
        .header(reqwest::header::CONTENT_TYPE, "application/x-tar")
        .body(body);
    let info: SnapshotInfo = client
        .json(req)
        .await
        .map_err(|f| f.into_core(tier, None, None))?;
    Ok(info.id)
}
