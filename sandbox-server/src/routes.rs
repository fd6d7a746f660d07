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

use sandbox_core::{NetworkPolicy, Sandbox, SnapshotId, SnapshotManifest, SnapshotStore};

use crate::api::{
    CreateSandbox, ExecBody, ForkBody, LifetimeSpec, Listing, NetworkEvents, RestoreBody,
    SandboxInfo, SandboxList, SnapshotInfo, SnapshotList, TierInfo, TierList, MAX_FORK,
};
use crate::auth::{gate, Caller, Gate};
use crate::error::ApiError;
use crate::lifetime::{self, Lifetime};
use crate::{processes, Entry, Shared};

pub(crate) fn router(shared: Arc<Shared>, gate_state: Gate) -> Router {
    let limit = shared.config.body_limit;
    let timeout = shared.config.request_timeout;
    Router::new()
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/tiers", get(tiers))
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/run", post(crate::run::run))
        .route("/v1/sandboxes/{id}", get(get_one).delete(destroy))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/exec/stream", post(exec_stream))
        .route(
            "/v1/sandboxes/{id}/files/{*path}",
            put(write_file).get(read_file),
        )
        .route("/v1/sandboxes/{id}/list", get(list_dir))
        .route("/v1/sandboxes/{id}/snapshot", post(snapshot))
        .route("/v1/sandboxes/{id}/pause", post(pause))
        .route("/v1/sandboxes/{id}/resume", post(resume))
        .route("/v1/sandboxes/{id}/network", put(set_network))
        .route("/v1/sandboxes/{id}/network/events", get(network_events))
        .route(
            "/v1/sandboxes/{id}/processes",
            post(processes::spawn).get(processes::list),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/output",
            get(processes::output),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/stdin",
            post(processes::write_stdin).delete(processes::close_stdin),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/signal",
            post(processes::signal),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/resize",
            post(processes::resize),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/wait",
            post(processes::wait),
        )
        .route(
            "/v1/sandboxes/{id}/ports",
            post(processes::publish).get(processes::ports),
        )
        .route(
            "/v1/sandboxes/{id}/ports/{host}",
            axum::routing::delete(processes::unpublish),
        )
        .route("/v1/snapshots", get(list_snapshots).post(upload_snapshot))
        .route("/v1/snapshots/{sid}/manifest", get(snapshot_manifest))
        .route(
            "/v1/snapshots/{sid}/artifacts/{name}",
            get(snapshot_artifact),
        )
        .route(
            "/v1/snapshots/{sid}",
            get(get_snapshot).delete(delete_snapshot),
        )
        .route("/v1/snapshots/{sid}/restore", post(restore))
        .route("/v1/snapshots/{sid}/fork", post(fork))
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
        .layer(middleware::from_fn_with_state(gate_state, gate))
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

pub(crate) fn bytes_rejection(e: BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large();
    }
    ApiError::new(e.status(), "bad_request", e.body_text())
}

/// A JSON body that may be left out (then `T::default()`), rejected as [`JsonBody`] is.
pub(crate) fn optional_json<T: Default + serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(bytes_rejection)?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        let status = if e.is_data() {
            StatusCode::UNPROCESSABLE_ENTITY
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(
            status,
            "bad_request",
            format!("Failed to deserialize the JSON body into the target type: {e}"),
        )
    })
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

async fn tiers(State(s): State<Arc<Shared>>) -> Json<TierList> {
    // (Every client may see what the server can run.)
    let cached = s
        .tiers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .filter(|(at, _)| at.elapsed() < crate::TIERS_FRESH)
        .map(|(_, list)| list.clone());
    if let Some(list) = cached {
        return Json(list);
    }
    let tiers = s
        .provider
        .probe()
        .await
        .into_iter()
        .map(|status| {
            let capabilities = s.provider.capabilities(status.tier);
            TierInfo::new(status, capabilities)
        })
        .collect();
    let list = TierList::new(tiers, s.config.build.clone());
    *s.tiers.lock().unwrap_or_else(|p| p.into_inner()) =
        Some((std::time::Instant::now(), list.clone()));
    Json(list)
}

async fn create(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    JsonBody(body): JsonBody<CreateSandbox>,
) -> Result<(StatusCode, Json<SandboxInfo>), ApiError> {
    check_spec(&s.config, &body.spec, false)?;
    check_lifetime(&body.lifetime)?;
    room(&s, 1)?;
    let (sandbox, _) = s.create_pooled(&body.spec, body.tier).await?;
    let info = admit(&s, &caller, sandbox, body.labels, body.lifetime, None).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// Refuses a client's spec that reaches into the server's host (unless
/// [`allow_host_access`](crate::ServerConfig::allow_host_access)) or its loopback and private
/// networks (unless [`allow_private_networks`](crate::ServerConfig::allow_private_networks)):
/// 403, naming what and the flag that grants it. `snapshot`: the spec is a snapshot's.
pub(crate) fn check_spec(
    config: &crate::ServerConfig,
    spec: &sandbox_core::SandboxSpec,
    snapshot: bool,
) -> Result<(), ApiError> {
    if let (false, Some(what)) = (config.allow_host_access, crate::host_access(spec)) {
        return Err(if snapshot {
            forbidden(&format!("this snapshot's spec has {what}, which"))
        } else {
            forbidden(what)
        });
    }
    check_network(config, &spec.network)?;
    if let Some(sandbox_core::ImageRef::Registry { registry, .. }) = &spec.image {
        check_registry(config, registry)?;
    }
    Ok(())
}

/// Refuses a registry a client names on the server's own networks: a link-local one always
/// (the metadata endpoint), a loopback or private one unless the operator granted private
/// networks (else any client could make the server send requests to its loopback services).
/// Names are judged as written: a name that resolves into private space is not caught here.
fn check_registry(config: &crate::ServerConfig, registry: &str) -> Result<(), ApiError> {
    let host = match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => registry.rsplit_once(':').map_or(registry, |(h, _)| h),
    };
    let refusal = |why: String| {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("the image's registry `{registry}` is {why}"),
        )
    };
    // `localhost.` and `127.0.0.1.` are the same hosts to a resolver.
    let host = host.strip_suffix('.').unwrap_or(host);
    let local_name =
        host.eq_ignore_ascii_case("localhost") || host.to_ascii_lowercase().ends_with(".localhost");
    // A name whose last label is a number is an address in another spelling (`127.1`,
    // `2130706433`, `0x7f.0.0.1`): HTTP clients dial it as one. No registry is named so.
    let last = host.rsplit('.').next().unwrap_or(host);
    let numeric = !last.is_empty()
        && (last.bytes().all(|b| b.is_ascii_digit())
            || last
                .strip_prefix("0x")
                .or_else(|| last.strip_prefix("0X"))
                .is_some_and(|h| h.bytes().all(|b| b.is_ascii_hexdigit())));
    if numeric && host.parse::<std::net::IpAddr>().is_err() {
        return Err(refusal(
            "an address in a non-canonical spelling: name a registry by its host name or \
             its address written as a.b.c.d"
                .into(),
        ));
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        if let Some(rule) = sandbox_core::policy::always_refused(ip) {
            return Err(refusal(format!("refused: {rule}")));
        }
        if !config.allow_private_networks {
            if let Some(what) = sandbox_core::ServerNetworks::default().refuses(ip) {
                return Err(refusal(format!(
                    "{what}: the server's loopback and private networks are not granted to \
                     API clients (start the server with --allow-private-networks to grant them)"
                )));
            }
        }
    } else if local_name && !config.allow_private_networks {
        return Err(refusal(
            "the server's loopback: not granted to API clients (start the server with \
             --allow-private-networks to grant it)"
                .into(),
        ));
    }
    Ok(())
}

/// Refuses a network policy that lists a range inside loopback or private space, unless the
/// operator granted them ([`allow_private_networks`](crate::ServerConfig::allow_private_networks)).
/// (What a policy cannot list, the host's own addresses and names resolving into those
/// ranges, the egress proxy refuses at connect time: [`sandbox_core::ServerNetworks`].)
pub(crate) fn check_network(
    config: &crate::ServerConfig,
    policy: &sandbox_core::NetworkPolicy,
) -> Result<(), ApiError> {
    if config.allow_private_networks {
        return Ok(());
    }
    match policy.private_ranges_listed() {
        Some(range) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "the network policy lists {range}: the server's loopback and private networks \
                 are not granted to API clients (start the server with \
                 --allow-private-networks to grant them)"
            ),
        )),
        None => Ok(()),
    }
}

pub(crate) fn forbidden(what: &str) -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        format!(
            "{what} is not granted to API clients: a token grants sandboxes, not the \
             server's host (start the server with --allow-host-access to grant it)"
        ),
    )
}

/// Refuses a lifetime of zero seconds (a typo, not a wish).
fn check_lifetime(l: &LifetimeSpec) -> Result<(), ApiError> {
    if l.ttl_s == Some(0) || l.idle_timeout_s == Some(0) {
        return Err(ApiError::bad_request(
            "`ttl_s` and `idle_timeout_s` are whole seconds, at least 1 (omit them for none)",
        ));
    }
    Ok(())
}

/// Refuses a request for `n` more sandboxes than the server has room for (the runs of
/// `POST /v1/run` count).
pub(crate) fn room(s: &Shared, n: usize) -> Result<(), ApiError> {
    let running = s.running.load(std::sync::atomic::Ordering::SeqCst);
    if s.lock().len() + running + n > s.config.max_sandboxes {
        return Err(full(s.config.max_sandboxes));
    }
    Ok(())
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// Puts a new sandbox in the table, or destroys it: when its tier cannot honour the
/// lifetime (pausing without pause), or when creates that raced past [`room`] filled the
/// server meanwhile.
async fn admit(
    s: &Shared,
    caller: &Caller,
    sandbox: Box<dyn Sandbox>,
    labels: std::collections::BTreeMap<String, String>,
    lifetime: LifetimeSpec,
    from_snapshot: Option<SnapshotId>,
) -> Result<SandboxInfo, ApiError> {
    let sandbox: Arc<dyn Sandbox> = Arc::from(sandbox);
    let tier = sandbox.tier();
    let pauses =
        lifetime.idle_timeout_s.is_some() && lifetime.on_idle == crate::api::IdleAction::Pause;
    if pauses
        && !s
            .provider
            .capabilities(tier)
            .is_some_and(|c| c.pause_resume)
    {
        let _ = sandbox.destroy().await;
        return Err(ApiError::from(sandbox_core::Error::unsupported(
            tier,
            "pausing an idle sandbox (this tier has no pause/resume: use `\"on_idle\": \"destroy\"`)",
        )));
    }
    let mut info = SandboxInfo::new(sandbox.id(), tier, now_rfc3339());
    info.labels = labels;
    info.lifetime = lifetime;
    info.from_snapshot = from_snapshot;
    let admitted = {
        let mut all = s.lock();
        let room = all.len() < s.config.max_sandboxes;
        if room {
            all.insert(
                info.id.clone(),
                Arc::new(Entry {
                    sandbox: Arc::clone(&sandbox),
                    info: info.clone(),
                    life: Lifetime::new(lifetime),
                    owner: caller.clone(),
                    procs: Default::default(),
                }),
            );
        }
        room
    };
    if !admitted {
        let _ = sandbox.destroy().await;
        return Err(full(s.config.max_sandboxes));
    }
    Ok(info)
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

async fn get_one(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(s.get(&id, &caller)?.info()))
}

/// `DELETE /v1/sandboxes/{id}`; with `?wait=false` the answer comes as soon as the sandbox
/// is out of the table (no request reaches it any more) and its teardown goes on in the
/// background (a failure there is logged, not answered).
async fn destroy(
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

async fn exec(
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
async fn exec_stream(
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

pub(crate) fn json_event<T: serde::Serialize>(name: &str, v: &T) -> Event {
    Event::default()
        .event(name)
        .json_data(v)
        .unwrap_or_else(|_| Event::default().event(name))
}

async fn write_file(
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

async fn read_file(
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
struct ListQuery {
    #[serde(default)]
    path: String,
}

async fn list_dir(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Listing>, ApiError> {
    let e = s.enter(&id, &caller).await?;
    let path = if q.path.is_empty() { "." } else { &q.path };
    Ok(Json(Listing::new(e.sandbox.list(path).await?)))
}

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

async fn snapshot(
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

async fn list_snapshots(
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

async fn get_snapshot(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(sid): Path<String>,
) -> Result<Json<SnapshotInfo>, ApiError> {
    let store = store(&s, &caller)?;
    let id = parse_snapshot_id(&sid)?;
    let m = store.manifest(&id).await?;
    Ok(Json(snapshot_info(id, &m)))
}

async fn delete_snapshot(
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

async fn restore(
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
    let info = admit(&s, &caller, sandbox, labels, lifetime, Some(id)).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// `count` sandboxes from one snapshot, restored concurrently; all or none (should one
/// fail, those made are destroyed and its error is the answer).
async fn fork(
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

async fn pause(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    lifetime::pause(s.get(&id, &caller)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn resume(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    lifetime::resume(s.get(&id, &caller)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn set_network(
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

async fn network_events(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<NetworkEvents>, ApiError> {
    let e = s.enter(&id, &caller).await?;
    Ok(Json(NetworkEvents::new(e.sandbox.network_events().await?)))
}

async fn snapshot_manifest(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(sid): Path<String>,
) -> Result<Json<SnapshotManifest>, ApiError> {
    let store = store(&s, &caller)?;
    let id = parse_snapshot_id(&sid)?;
    Ok(Json(store.manifest(&id).await?))
}

async fn snapshot_artifact(
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
async fn upload_snapshot(
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
