//! The HTTP routes: the v1 table, E2B's API beside it ([`crate::e2b`]), the layers every route family shares (body limit, request
//! timeout, the client gate, a JSON 404 for a path without an endpoint) and the v1 handlers
//! about the server itself (its OpenAPI document, its tiers). The handlers of each family are
//! in a module of their own (see [`crate::openapi`] for the document clients read); a new
//! family is a new module whose routes `router` adds beside `v1`'s.

pub(crate) mod admit;
pub(crate) mod body;
mod sandboxes;
mod snapshots;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::IntoResponse;
use axum::routing::{get, post, put};
use axum::{Json, Router};

use crate::api::{TierInfo, TierList};
use crate::auth::{gate, Gate};
use crate::error::ApiError;
use crate::{processes, Shared};

pub(crate) fn router(shared: Arc<Shared>, gate_state: Gate) -> Router {
    let limit = shared.config.body_limit;
    let timeout = shared.config.request_timeout;
    let envd = crate::e2b::sandbox_routes(limit, timeout);
    v1().merge(crate::e2b::control_routes())
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
        .layer(middleware::from_fn_with_state(gate_state.clone(), gate))
        // Requests addressed to a sandbox (E2B's envd) are checked against its own token,
        // and count among its owner's requests in flight.
        .layer(middleware::from_fn_with_state(
            (Arc::clone(&shared), envd, gate_state),
            crate::e2b::dispatch,
        ))
        .with_state(shared)
}

/// The routes of API v1 (`/v1/...`), without the layers [`router`] puts around them.
fn v1() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/tiers", get(tiers))
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route("/v1/run", post(crate::run::run))
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get_one).delete(sandboxes::destroy),
        )
        .route("/v1/sandboxes/{id}/exec", post(sandboxes::exec))
        .route(
            "/v1/sandboxes/{id}/exec/stream",
            post(sandboxes::exec_stream),
        )
        .route(
            "/v1/sandboxes/{id}/files/{*path}",
            put(sandboxes::write_file).get(sandboxes::read_file),
        )
        .route("/v1/sandboxes/{id}/list", get(sandboxes::list_dir))
        .route("/v1/sandboxes/{id}/snapshot", post(snapshots::snapshot))
        .route("/v1/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/v1/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/v1/sandboxes/{id}/network", put(sandboxes::set_network))
        .route(
            "/v1/sandboxes/{id}/network/events",
            get(sandboxes::network_events),
        )
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
        .route(
            "/v1/snapshots",
            get(snapshots::list_snapshots).post(snapshots::upload_snapshot),
        )
        .route(
            "/v1/snapshots/{sid}/manifest",
            get(snapshots::snapshot_manifest),
        )
        .route(
            "/v1/snapshots/{sid}/artifacts/{name}",
            get(snapshots::snapshot_artifact),
        )
        .route(
            "/v1/snapshots/{sid}",
            get(snapshots::get_snapshot).delete(snapshots::delete_snapshot),
        )
        .route("/v1/snapshots/{sid}/restore", post(snapshots::restore))
        .route("/v1/snapshots/{sid}/fork", post(snapshots::fork))
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
