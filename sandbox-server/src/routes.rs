//! The v1 routes and their handlers (see [`crate::openapi`] for the document clients read).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, JsonRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Query, Request, State};
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use futures::Stream;
use sandbox_core::ExecEvent;

use crate::api::{CreateSandbox, ExecBody, Listing, SandboxInfo, SandboxList};
use crate::auth::{require_token, Token};
use crate::error::ApiError;
use crate::{Entry, Shared};

pub(crate) fn router(shared: Arc<Shared>, token: Option<Token>) -> Router {
    let limit = shared.config.body_limit;
    let timeout = shared.config.request_timeout;
    Router::new()
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/sandboxes/{id}", get(get_one).delete(destroy))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/exec/stream", post(exec_stream))
        .route(
            "/v1/sandboxes/{id}/files/{*path}",
            put(write_file).get(read_file),
        )
        .route("/v1/sandboxes/{id}/list", get(list_dir))
        .fallback(no_route)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(
            move |req: Request, next: Next| async move {
                match tokio::time::timeout(timeout, next.run(req)).await {
                    Ok(r) => r,
                    Err(_) => ApiError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "timeout",
                        format!("the request took longer than the server's limit of {timeout:?}"),
                    )
                    .into_response(),
                }
            },
        ))
        .layer(middleware::from_fn_with_state(token, require_token))
        .with_state(shared)
}

/// A JSON body whose rejections are API errors: malformed JSON, unknown fields and wrong
/// types are 400 with serde's reason, a body over the limit 413.
pub(crate) struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(JsonBody(v)),
            Err(e) => Err(json_rejection(e)),
        }
    }
}

fn json_rejection(e: JsonRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large();
    }
    ApiError::new(e.status(), "bad_request", e.body_text())
}

fn bytes_rejection(e: BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large();
    }
    ApiError::new(e.status(), "bad_request", e.body_text())
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        "the request body is over the server's limit (`agent-sandbox serve --body-limit`)",
    )
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no endpoint {method} {uri} (the API: GET /v1/openapi.json)"),
    )
}

async fn openapi() -> Json<serde_json::Value> {
    Json(crate::openapi::document())
}

async fn create(
    State(s): State<Arc<Shared>>,
    JsonBody(body): JsonBody<CreateSandbox>,
) -> Result<(StatusCode, Json<SandboxInfo>), ApiError> {
    if let (false, Some(what)) = (s.config.allow_host_access, crate::host_access(&body.spec)) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "{what} is not granted to API clients: a token grants sandboxes, not the \
                 server's host (start the server with --allow-host-access to grant it)"
            ),
        ));
    }
    if s.lock().len() >= s.config.max_sandboxes {
        return Err(full(s.config.max_sandboxes));
    }
    let sandbox: Arc<dyn sandbox_core::Sandbox> =
        Arc::from(s.provider.create(&body.spec, body.tier).await?);
    let created_at = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    let info = SandboxInfo {
        id: sandbox.id().to_string(),
        tier: sandbox.tier(),
        labels: body.labels,
        created_at,
    };
    let admitted = {
        let mut all = s.lock();
        // Checked again: creates that raced past the first check may have filled it.
        let room = all.len() < s.config.max_sandboxes;
        if room {
            all.insert(
                info.id.clone(),
                Arc::new(Entry {
                    sandbox: Arc::clone(&sandbox),
                    info: info.clone(),
                }),
            );
        }
        room
    };
    if !admitted {
        let _ = sandbox.destroy().await;
        return Err(full(s.config.max_sandboxes));
    }
    Ok((StatusCode::CREATED, Json(info)))
}

/// The server holds `max` sandboxes already.
fn full(max: usize) -> ApiError {
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "resource_exhausted",
        format!("this server holds its limit of {max} sandboxes; destroy one first"),
    )
}

async fn list(
    State(s): State<Arc<Shared>>,
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
        .filter(|e| {
            want.iter()
                .all(|(k, v)| e.info.labels.get(k).is_some_and(|x| x == v))
        })
        .map(|e| e.info.clone())
        .collect();
    sandboxes.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
    Ok(Json(SandboxList { sandboxes }))
}

async fn get_one(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(s.get(&id)?.info.clone()))
}

async fn destroy(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let e = s
        .lock()
        .remove(&id)
        .ok_or_else(|| ApiError::no_sandbox(&id))?;
    e.sandbox.destroy().await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn exec(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ExecBody>,
) -> Result<Json<sandbox_core::ExecResult>, ApiError> {
    let e = s.get(&id)?;
    let req = body.into_request()?;
    Ok(Json(e.sandbox.exec(req).await?))
}

/// Server-sent events: `stdout` and `stderr` (`{"text": "..."}`), then `exit` (the
/// `ExecResult`, its output already sent) or `error` (an API error body).
async fn exec_stream(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ExecBody>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let e = s.get(&id)?;
    let req = body.into_request()?;
    let st = e.sandbox.exec_stream(req).await?;
    let events = futures::stream::unfold(Some(st), |st| async move {
        let mut st = st?;
        let ev = st.next().await?;
        let (event, more) = match ev {
            Ok(ExecEvent::Stdout(b)) => (text_event("stdout", &b), true),
            Ok(ExecEvent::Stderr(b)) => (text_event("stderr", &b), true),
            Ok(ExecEvent::Exit(r)) => (json_event("exit", &r), false),
            // Events of later versions: skipped.
            Ok(_) => (Event::default().comment("event"), true),
            Err(e) => {
                let ApiError { kind, message, .. } = ApiError::from(e);
                let body = crate::error::ErrorBody {
                    error: crate::error::ErrorDetail {
                        kind: kind.to_string(),
                        message,
                    },
                };
                (json_event("error", &body), false)
            }
        };
        Some((Ok(event), more.then_some(st)))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

fn text_event(name: &str, bytes: &[u8]) -> Event {
    json_event(
        name,
        &serde_json::json!({ "text": String::from_utf8_lossy(bytes) }),
    )
}

fn json_event<T: serde::Serialize>(name: &str, v: &T) -> Event {
    Event::default()
        .event(name)
        .json_data(v)
        .unwrap_or_else(|_| Event::default().event(name))
}

async fn write_file(
    State(s): State<Arc<Shared>>,
    Path((id, path)): Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let e = s.get(&id)?;
    let data = body.map_err(bytes_rejection)?;
    e.sandbox.write_file(&path, &data).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn read_file(
    State(s): State<Arc<Shared>>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let e = s.get(&id)?;
    let data = e.sandbox.read_file(&path).await?;
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
        data,
    )
        .into_response())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    #[serde(default)]
    path: String,
}

async fn list_dir(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Listing>, ApiError> {
    let e = s.get(&id)?;
    let path = if q.path.is_empty() { "." } else { &q.path };
    Ok(Json(Listing {
        entries: e.sandbox.list(path).await?,
    }))
}
