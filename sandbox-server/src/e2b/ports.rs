//! A sandbox's other ports over HTTP: what `sandbox.get_host(PORT)` names reaches a server
//! the sandbox runs on PORT. The port is published on this host's loopback once (the same
//! forwarding as `POST /v1/sandboxes/{id}/ports`, inbound only, under any network policy)
//! and each request is sent through it with `hyper`'s HTTP/1.1 client; the answer streams
//! back. Nothing listening there is a 502 that says so. The headers that routed the request
//! (the sandbox id and port, its access tokens) are not passed in.
//!
//! An HTTP/1.1 upgrade (a WebSocket's handshake, `Connection: upgrade`) goes through too:
//! when the sandbox's server answers `101 Switching Protocols`, the client's connection and
//! the sandbox's are joined byte for byte until either side closes, the sandbox is gone or
//! the server stops; at most [`MAX_TUNNELS`] such connections per sandbox at once (each
//! holds two sockets).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use super::{api_error, Meta};
use crate::{Entry, Shared};

/// How often an upgraded connection looks whether its sandbox is still there.
const GONE_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

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

/// Most upgraded connections (WebSockets) of one sandbox open at once.
pub(crate) const MAX_TUNNELS: usize = 64;

/// Whether `req` asks to switch protocols (`Connection: upgrade` and an `Upgrade` header).
fn wants_upgrade(req: &Request) -> bool {
    let h = req.headers();
    h.contains_key(axum::http::header::UPGRADE)
        && h.get_all(axum::http::header::CONNECTION).iter().any(|v| {
            v.to_str().is_ok_and(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
        })
}

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
    shared: &Arc<Shared>,
    entry: Arc<Entry>,
    meta: Arc<Meta>,
    port: u16,
    mut req: Request,
) -> Response {
    let id = entry.info.id.clone();
    // An upgrade holds its place among the sandbox's tunnels from now until it closes.
    let tunnel = if wants_upgrade(&req) {
        match Arc::clone(&meta.tunnels).try_acquire_owned() {
            Ok(permit) => Some((permit, hyper::upgrade::on(&mut req))),
            Err(_) => {
                return api_error(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!("sandbox {id} has {MAX_TUNNELS} upgraded connections open, its limit"),
                )
            }
        }
    } else {
        None
    };
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
        if let Err(e) = conn.with_upgrades().await {
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
    let mut resp = match send.send_request(Request::from_parts(parts, body)).await {
        Ok(resp) => resp,
        Err(e) => return unreachable(e.to_string()),
    };
    if let (Some((permit, client)), StatusCode::SWITCHING_PROTOCOLS) = (tunnel, resp.status()) {
        let upstream = hyper::upgrade::on(&mut resp);
        let stop = shared.stopping();
        let gone = gone(Arc::downgrade(shared), Arc::downgrade(&entry));
        tokio::spawn(async move {
            let _permit = permit;
            let tunnel = async {
                let (client, upstream) = match tokio::join!(client, upstream) {
                    (Ok(c), Ok(u)) => (c, u),
                    (Err(e), _) | (_, Err(e)) => {
                        tracing::debug!(error = %e, "an upgrade did not complete");
                        return;
                    }
                };
                let (mut c, mut u) = (TokioIo::new(client), TokioIo::new(upstream));
                if let Err(e) = tokio::io::copy_bidirectional(&mut c, &mut u).await {
                    tracing::debug!(error = %e, "an upgraded connection ended");
                }
            };
            // Dropping the sockets closes both sides.
            tokio::select! {
                () = tunnel => {}
                () = stop.cancelled() => {}
                () = gone => {}
            }
        });
    }
    resp.map(Body::new).into_response()
}

/// Ends once `entry` is no longer its server's sandbox (killed, timed out, the server gone).
async fn gone(shared: std::sync::Weak<Shared>, entry: std::sync::Weak<Entry>) {
    loop {
        tokio::time::sleep(GONE_CHECK).await;
        let (Some(s), Some(e)) = (shared.upgrade(), entry.upgrade()) else {
            return;
        };
        let here = s.lock().get(&e.info.id).is_some_and(|x| Arc::ptr_eq(x, &e));
        if !here {
            return;
        }
    }
}
