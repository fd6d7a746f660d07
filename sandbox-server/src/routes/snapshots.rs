//! `/v1/snapshots`, and taking one (`POST /v1/sandboxes/{id}/snapshot`): list, get and
//! delete snapshots, read their manifests and artifacts, upload one, restore and fork.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use sandbox_core::{SnapshotId, SnapshotManifest, SnapshotStore};

use super::admit::{admit, check_lifetime, room};
use super::body::{bytes_rejection, optional_json, JsonBody};
use crate::access::check_spec;
use crate::api::{
    ForkBody, RestoreBody, SandboxInfo, SandboxList, SnapshotInfo, SnapshotList, MAX_FORK,
};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::Shared;

/// The server's snapshot store, or `501` naming how to give it one.
fn store(s: &Shared, caller: &Caller) -> Result<Arc<dyn SnapshotStore>, ApiError> {
    s.config.snapshot_store_for(&caller.0).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unsupported",
            "this server keeps no snapshots: start it with a snapshot store \
             (`agent-sandbox serve --state-dir DIR`)",
        )
    })
}

fn parse_snapshot_id(sid: &str) -> Result<SnapshotId, ApiError> {
    sid.parse().map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no snapshot `{sid}` (an id is 64 hex digits; GET /v1/snapshots lists them)"),
        )
    })
}

fn snapshot_info(id: SnapshotId, m: &SnapshotManifest) -> SnapshotInfo {
    SnapshotInfo::new(
        id,
        m.tier,
        m.created
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
        m.total_bytes(),
    )
}

pub(super) async fn snapshot(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<SnapshotInfo>), ApiError> {
    let store = store(&s, &caller)?;
    let e = s.enter(&id, &caller).await?;
    let sid = e.sandbox.snapshot(store.as_ref()).await?;
    let m = store.manifest(&sid).await?;
    Ok((StatusCode::CREATED, Json(snapshot_info(sid, &m))))
}

pub(super) async fn list_snapshots(
    State(s): State<Arc<Shared>>,
    caller: Caller,
) -> Result<Json<SnapshotList>, ApiError> {
    let store = store(&s, &caller)?;
    let mut snapshots = Vec::new();
    for id in store.list().await? {
        // A snapshot deleted or unreadable meanwhile is left out, not an error of the list.
        if let Ok(m) = store.manifest(&id).await {
            snapshots.push(snapshot_info(id, &m));
        }
    }
    snapshots.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
    Ok(Json(SnapshotList::new(snapshots)))
}

pub(super) async fn get_snapshot(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(sid): Path<String>,
) -> Result<Json<SnapshotInfo>, ApiError> {
    let store = store(&s, &caller)?;
    let id = parse_snapshot_id(&sid)?;
    let m = store.manifest(&id).await?;
    Ok(Json(snapshot_info(id, &m)))
}

pub(super) async fn delete_snapshot(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(sid): Path<String>,
) -> Result<StatusCode, ApiError> {
    let store = store(&s, &caller)?;
    let id = parse_snapshot_id(&sid)?;
    store.manifest(&id).await?;
    store.delete(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The store and the manifest of snapshot `sid`, checked as a create's spec would be (a
/// snapshot in a shared store may come from a server that granted host access).
async fn restorable(
    s: &Shared,
    caller: &Caller,
    sid: &str,
) -> Result<(Arc<dyn SnapshotStore>, SnapshotId), ApiError> {
    let store = store(s, caller)?;
    let id = parse_snapshot_id(sid)?;
    let m = store.manifest(&id).await?;
    check_spec(&s.config, &m.spec, true)?;
    Ok((store, id))
}

pub(super) async fn restore(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(sid): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<SandboxInfo>), ApiError> {
    let RestoreBody {
        labels, lifetime, ..
    } = optional_json(body)?;
    check_lifetime(&lifetime)?;
    let (store, id) = restorable(&s, &caller, &sid).await?;
    room(&s, 1)?;
    let sandbox = s.provider.restore(store.as_ref(), &id).await?;
    let info = admit(&s, &caller, sandbox, labels, lifetime, Some(id), None).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// `count` sandboxes from one snapshot, restored concurrently; all or none (should one
/// fail, those made are destroyed and its error is the answer).
pub(super) async fn fork(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(sid): Path<String>,
    JsonBody(body): JsonBody<ForkBody>,
) -> Result<(StatusCode, Json<SandboxList>), ApiError> {
    if body.count == 0 || body.count > MAX_FORK {
        return Err(ApiError::bad_request(format!(
            "`count` is 1 to {MAX_FORK} (asked: {})",
            body.count
        )));
    }
    check_lifetime(&body.lifetime)?;
    let (store, id) = restorable(&s, &caller, &sid).await?;
    room(&s, body.count)?;
    let made =
        futures::future::join_all((0..body.count).map(|_| s.provider.restore(store.as_ref(), &id)))
            .await;
    let (sandboxes, failed): (Vec<_>, Vec<_>) = made.into_iter().partition(Result::is_ok);
    let mut sandboxes = sandboxes.into_iter().flatten();
    if let Some(Err(e)) = failed.into_iter().next() {
        for sb in sandboxes {
            let _ = sb.destroy().await;
        }
        return Err(e.into());
    }
    let mut infos = Vec::new();
    while let Some(sb) = sandboxes.next() {
        match admit(
            &s,
            &caller,
            sb,
            body.labels.clone(),
            body.lifetime,
            Some(id.clone()),
            None,
        )
        .await
        {
            Ok(info) => infos.push(info),
            Err(e) => {
                for sb in sandboxes {
                    let _ = sb.destroy().await;
                }
                for info in &infos {
                    if let Some(e) = s.take(&info.id, &caller) {
                        let _ = e.sandbox.destroy().await;
                    }
                }
                return Err(e);
            }
        }
    }
    Ok((StatusCode::CREATED, Json(SandboxList::new(infos))))
}

pub(super) async fn snapshot_manifest(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(sid): Path<String>,
) -> Result<Json<SnapshotManifest>, ApiError> {
    let store = store(&s, &caller)?;
    let id = parse_snapshot_id(&sid)?;
    Ok(Json(store.manifest(&id).await?))
}

pub(super) async fn snapshot_artifact(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path((sid, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let store = store(&s, &caller)?;
    let id = parse_snapshot_id(&sid)?;
    let data = store.artifact(&id, &name).await?;
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
        data,
    )
        .into_response())
}

/// A snapshot sent by a client (`RemoteBackend::restore` of a snapshot in the client's own
/// store): a tar of `manifest.json` (the manifest as the client's store has it) and
/// `artifacts/NAME` for each artifact it lists, each checked against the manifest's size
/// and SHA-256. Stored as a new snapshot of the server's; the answer is its info.
pub(super) async fn upload_snapshot(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<SnapshotInfo>), ApiError> {
    let store = store(&s, &caller)?;
    let body = body.map_err(bytes_rejection)?;
    let mut draft = sandbox_api::read_snapshot_tar(&body)?;
    check_spec(&s.config, &draft.spec, true)?;
    // Stored unsigned: it restores only where a client's snapshot cannot attack the host.
    draft
        .metadata
        .insert(crate::signing::ORIGIN_KEY.to_string(), "upload".to_string());
    let id = store.put(draft).await?;
    let m = store.manifest(&id).await?;
    Ok((StatusCode::CREATED, Json(snapshot_info(id, &m))))
}
