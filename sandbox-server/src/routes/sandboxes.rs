//! `/v1/sandboxes`: create, list, get and destroy sandboxes, and use one: exec (whole or
//! streamed as server-sent events), files, pause and resume, network policy and events.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use sandbox_core::{ExecEvent, NetworkPolicy};

use super::admit::{admit, check_lifetime, room};
use super::body::{bytes_rejection, json_event, JsonBody};
use crate::access::{check_network, check_spec};
use crate::api::{CreateSandbox, ExecBody, Listing, NetworkEvents, SandboxInfo, SandboxList};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::lifetime;
use crate::Shared;

pub(super) async fn create(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    JsonBody(body): JsonBody<CreateSandbox>,
) -> Result<(StatusCode, Json<SandboxInfo>), ApiError> {
    check_spec(&s.config, &body.spec, false)?;
    check_lifetime(&body.lifetime)?;
    room(&s, 1)?;
    let (sandbox, _) = s.create_pooled(&body.spec, body.tier).await?;
    let info = admit(&s, &caller, sandbox, body.labels, body.lifetime, None, None).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

pub(super) async fn list(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<Vec<(String, String)>>,
) -> Result<Json<SandboxList>, ApiError> {
    // `label=k=v`, any number of times: all must match.
    let mut want = Vec::new();
    for (k, v) in q {
        match (k.as_str(), v.split_once('=')) {
            ("label", Some((lk, lv))) => want.push((lk.to_string(), lv.to_string())),
            ("label", None) => {
                return Err(ApiError::bad_request(format!(
                    "label filter `{v}` is not `key=value`"
                )))
            }
            _ => {
                return Err(ApiError::bad_request(format!(
                    "unknown query parameter `{k}`"
                )))
            }
        }
    }
    let mut sandboxes: Vec<SandboxInfo> = s
        .lock()
        .values()
        .filter(|e| e.owner == caller)
        .filter(|e| {
            want.iter()
                .all(|(k, v)| e.info.labels.get(k).is_some_and(|x| x == v))
        })
        .map(|e| e.info())
        .collect();
    sandboxes.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
    Ok(Json(SandboxList::new(sandboxes)))
}

pub(super) async fn get_one(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(s.get(&id, &caller)?.info()))
}

/// `DELETE /v1/sandboxes/{id}`; with `?wait=false` the answer comes as soon as the sandbox
/// is out of the table (no request reaches it any more) and its teardown goes on in the
/// background (a failure there is logged, not answered).
pub(super) async fn destroy(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<Vec<(String, String)>>,
) -> Result<StatusCode, ApiError> {
    let mut wait = true;
    for (k, v) in q {
        match (k.as_str(), v.as_str()) {
            ("wait", "true") => wait = true,
            ("wait", "false") => wait = false,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "unknown query `{k}={v}`: only `wait=true` or `wait=false`"
                )))
            }
        }
    }
    let e = s
        .take(&id, &caller)
        .ok_or_else(|| ApiError::no_sandbox(&id))?;
    if wait {
        e.sandbox.destroy().await?;
    } else {
        s.destroy_later(id, Arc::clone(&e.sandbox), None);
    }
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn exec(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ExecBody>,
) -> Result<Json<sandbox_core::ExecResult>, ApiError> {
    let e = s.enter(&id, &caller).await?;
    let req = body.into_request()?;
    Ok(Json(e.sandbox.exec(req).await?))
}

/// Server-sent events: `stdout` and `stderr` (`{"text": "..."}`), then `exit` (the
/// `ExecResult`, its output already sent) or `error` (an API error body).
pub(super) async fn exec_stream(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ExecBody>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let e = s.enter(&id, &caller).await?;
    let req = body.into_request()?;
    let st = e.sandbox.exec_stream(req).await?;
    // The sandbox stays in use (not idle) until the stream ends. A first comment sends
    // the answer's head at once (a silent command would otherwise hold the client until
    // its first output or keep-alive).
    let started =
        futures::stream::once(async { Ok::<_, Infallible>(Event::default().comment("started")) });
    let events = futures::stream::unfold(Some((st, e)), |state| async move {
        let (mut st, e) = state?;
        let ev = st.next().await?;
        let (event, more) = match ev {
            Ok(ExecEvent::Stdout(b)) => (text_event("stdout", &b), true),
            Ok(ExecEvent::Stderr(b)) => (text_event("stderr", &b), true),
            Ok(ExecEvent::Exit(r)) => (json_event("exit", &r), false),
            // Events of later versions: skipped.
            Ok(_) => (Event::default().comment("event"), true),
            Err(e) => {
                let ApiError { kind, message, .. } = ApiError::from(e);
                let body = crate::error::ErrorBody::new(kind, message);
                (json_event("error", &body), false)
            }
        };
        Some((Ok(event), more.then_some((st, e))))
    });
    Ok(Sse::new(futures::StreamExt::chain(started, events)).keep_alive(KeepAlive::default()))
}

fn text_event(name: &str, bytes: &[u8]) -> Event {
    json_event(
        name,
        &serde_json::json!({ "text": String::from_utf8_lossy(bytes) }),
    )
}

pub(super) async fn write_file(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let e = s.enter(&id, &caller).await?;
    let data = body.map_err(bytes_rejection)?;
    e.sandbox.write_file(&path, &data).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn read_file(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let e = s.enter(&id, &caller).await?;
    let data = e.sandbox.read_file(&path).await?;
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
        data,
    )
        .into_response())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListQuery {
    #[serde(default)]
    path: String,
}

pub(super) async fn list_dir(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Listing>, ApiError> {
    let e = s.enter(&id, &caller).await?;
    let path = if q.path.is_empty() { "." } else { &q.path };
    Ok(Json(Listing::new(e.sandbox.list(path).await?)))
}

pub(super) async fn pause(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    lifetime::pause(s.get(&id, &caller)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn resume(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    lifetime::resume(s.get(&id, &caller)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn set_network(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(policy): JsonBody<NetworkPolicy>,
) -> Result<StatusCode, ApiError> {
    check_network(&s.config, &policy)?;
    let e = s.enter(&id, &caller).await?;
    e.sandbox.set_network_policy(policy).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn network_events(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<NetworkEvents>, ApiError> {
    let e = s.enter(&id, &caller).await?;
    Ok(Json(NetworkEvents::new(e.sandbox.network_events().await?)))
}
