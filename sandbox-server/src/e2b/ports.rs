//! A sandbox's other ports over HTTP: what `sandbox.get_host(PORT)` names reaches a server
//! the sandbox runs on PORT. The port is published on this host's loopback once (the same
//! forwarding as `POST /v1/sandboxes/{id}/ports`, inbound only, under any network policy)
//! and each request is sent through it with `hyper`'s HTTP/1.1 client; the answer streams
//! back. Nothing listening there is a 502 that says so. The headers that routed the request
//! (the sandbox id and port, its access tokens) are not passed in.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use super::{api_error, Meta};
use crate::Entry;

/// The headers that address the sandbox or carry this server's secrets; never sent into it.
const ROUTING: [&str; 5] = [
    "e2b-sandbox-id",
    "e2b-sandbox-port",
    "x-access-token",
    "e2b-traffic-access-token",
    "x-api-key",
];

/// Most ports of one sandbox published for forwarding (each is a listener on this host:
/// a client naming port after port must not exhaust the server's descriptors).
const MAX_PORTS: usize = 32;

/// Where `port` of the sandbox is published on this host, publishing it on first use.
async fn published(entry: &Entry, meta: &Meta, port: u16) -> Result<SocketAddr, Response> {
    let mut ports = meta.ports.lock().await;
    if let Some(a) = ports.get(&port) {
        return Ok(*a);
    }
    if ports.len() >= MAX_PORTS {
        return Err(api_error(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "sandbox {} has {MAX_PORTS} ports forwarded already, its limit",
                entry.info.id
            ),
        ));
    }
    let at = entry
        .sandbox
        .publish(port, SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .await
        .map_err(|e| {
            api_error(
                StatusCode::BAD_GATEWAY,
                format!(
                    "port {port} of sandbox {} cannot be reached: {e}",
                    entry.info.id
                ),
            )
        })?;
    ports.insert(port, at);
    Ok(at)
}

/// Sends `req` to `port` of the sandbox and answers what its server answers.
pub(crate) async fn forward(
    entry: Arc<Entry>,
    meta: Arc<Meta>,
    port: u16,
    req: Request,
) -> Response {
    let id = entry.info.id.clone();
    let at = match published(&entry, &meta, port).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let unreachable = |why: String| {
        api_error(
            StatusCode::BAD_GATEWAY,
            format!("nothing answered on port {port} of sandbox {id}: {why}"),
        )
    };
    let tcp = match tokio::net::TcpStream::connect(at).await {
        Ok(t) => t,
        Err(e) => return unreachable(e.to_string()),
    };
    let (mut send, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await {
        Ok(h) => h,
        Err(e) => return unreachable(e.to_string()),
    };
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "a forwarded connection ended");
        }
    });
    let (mut parts, body) = req.into_parts();
    for h in ROUTING {
        parts.headers.remove(h);
    }
    // Origin form: the path and query only.
    if let Some(pq) = parts.uri.path_and_query().cloned() {
        parts.uri = pq.as_str().parse().unwrap_or_default();
    }
    match send.send_request(Request::from_parts(parts, body)).await {
        Ok(resp) => resp.map(Body::new).into_response(),
        Err(e) => unreachable(e.to_string()),
    }
}
