//! Serving a connection: the accept loop, explicit proxy requests (absolute-URI HTTP and
//! `CONNECT`), transparent connections sniffed for HTTP `Host` or TLS SNI, refusal replies and
//! the relay between the sandbox and upstream.

use super::decide::{open, refusal_response, refuse, refuse_malformed};
use super::intercept;
use super::*;
use crate::secrets::{LeakAttempt, SecretSet};

pub(super) async fn accept_loop(
    inner: Arc<Inner>,
    sb: Arc<SandboxState>,
    listener: TcpListener,
    transparent: bool,
) {
    loop {
        let (stream, _peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(target: "sandbox_egress", sandbox = %sb.id, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = sb.slots.clone().try_acquire_owned() else {
            tracing::warn!(target: "sandbox_egress", sandbox = %sb.id,
                "too many egress connections: dropping one");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mode = if transparent {
            StreamMode::Transparent {
                original_dst: inner.original_dst.original_dst(&stream),
            }
        } else {
            StreamMode::Explicit
        };
        let (inner, sb) = (inner.clone(), sb.clone());
        tokio::spawn(async move {
            guarded(&inner, &sb, stream, mode).await;
            drop(permit);
        });
    }
}

/// Runs a connection until it ends or the sandbox is unregistered.
pub(super) async fn guarded<S>(
    inner: &Arc<Inner>,
    sb: &Arc<SandboxState>,
    stream: S,
    mode: StreamMode,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut stop = sb.shutdown.subscribe();
    if *stop.borrow() {
        return;
    }
    tokio::select! {
        _ = handle(inner, sb, stream, mode) => {}
        _ = stopped(&mut stop) => {}
    }
}

async fn handle<S>(inner: &Arc<Inner>, sb: &Arc<SandboxState>, stream: S, mode: StreamMode)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    match mode {
        StreamMode::Explicit => handle_explicit(inner, sb, stream).await,
        StreamMode::Transparent { original_dst } => {
            handle_transparent(inner, sb, stream, original_dst).await
        }
    }
}

/// Reads until a full request head is buffered.
async fn read_head<S: AsyncRead + Unpin>(
    inner: &Inner,
    s: &mut S,
    buf: &mut Vec<u8>,
) -> Result<http::RequestHead, (u16, &'static str, &'static str)> {
    let cfg = &inner.config;
    let deadline = tokio::time::Instant::now() + cfg.head_timeout;
    loop {
        match http::parse_head(buf) {
            HeadParse::Complete(h) => return Ok(h),
            HeadParse::Invalid(why) => return Err((400, "Bad Request", why)),
            HeadParse::Partial => {}
        }
        if buf.len() >= cfg.max_head_bytes {
            return Err((
                431,
                "Request Header Fields Too Large",
                "request head too large",
            ));
        }
        let mut chunk = [0u8; 4096];
        let want = chunk.len().min(cfg.max_head_bytes - buf.len());
        match tokio::time::timeout_at(deadline, s.read(&mut chunk[..want])).await {
            Err(_) => return Err((408, "Request Timeout", "request head timed out")),
            Ok(Err(_)) | Ok(Ok(0)) => return Err((400, "Bad Request", "connection closed")),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

async fn handle_explicit<S>(inner: &Arc<Inner>, sb: &Arc<SandboxState>, mut client: S)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut buf = Vec::new();
    let head = match read_head(inner, &mut client, &mut buf).await {
        Ok(h) => h,
        Err((status, reason, why)) => {
            let resp = http::response(status, reason, &format!("{why}\n"), &[]);
            reply_and_close(&mut client, &resp).await;
            return;
        }
    };
    let body_start = buf.get(head.len..).unwrap_or_default().to_vec();
    if head.method.eq_ignore_ascii_case("CONNECT") {
        let Some((dest, port)) = http::parse_authority(&head.target, None) else {
            let r = refuse_malformed(
                sb,
                Via::Connect,
                None,
                0,
                "CONNECT target must be host:port",
            );
            reply_and_close(&mut client, &refusal_response(&r)).await;
            return;
        };
        let secrets = sb.secrets();
        // The CONNECT request goes to us, never upstream: a placeholder in it (its target or
        // a header) is a leak attempt whatever the target. What follows it is the tunnel's.
        let connect = &buf[..head.len.min(buf.len())];
        if let Some(l) = secrets.leak_attempt(connect, &[], &dest_name(&dest), port) {
            let resp = intercept::leak(sb, Via::Connect, &l);
            reply_and_close(&mut client, &resp).await;
            return;
        }
        let bound = bound_host(&secrets, &dest, port);
        match open(inner, sb, Via::Connect, &dest, port).await {
            Ok(up) if bound.is_some() => {
                if client
                    .write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                    .await
                    .is_err()
                {
                    return;
                }
                let host = bound.unwrap_or_default();
                let client = intercept::Prefixed {
                    prefix: body_start,
                    at: 0,
                    inner: client,
                };
                intercept::serve_tls(inner, sb, client, up, Via::Connect, &host, port).await;
            }
            Ok(mut up) => {
                if client
                    .write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                    .await
                    .is_err()
                {
                    return;
                }
                if !body_start.is_empty() && up.write_all(&body_start).await.is_err() {
                    return;
                }
                let _ = relay(&mut client, &mut up).await;
            }
            Err(r) => {
                reply_and_close(&mut client, &refusal_response(&r)).await;
            }
        }
        return;
    }
    let (dest, port, path) = match head.destination(80) {
        Ok(d) => d,
        Err(why) => {
            let r = refuse_malformed(sb, Via::Http, None, 0, why);
            reply_and_close(&mut client, &refusal_response(&r)).await;
            return;
        }
    };
    if !head
        .target
        .get(..7)
        .is_some_and(|t| t.eq_ignore_ascii_case("http://"))
    {
        let r = refuse_malformed(
            sb,
            Via::Http,
            Some(&dest),
            port,
            "a forward proxy request needs an absolute http:// URI",
        );
        reply_and_close(&mut client, &refusal_response(&r)).await;
        return;
    }
    let secrets = sb.secrets();
    let bound = bound_host(&secrets, &dest, port);
    if bound.is_none() {
        if let Some(l) = leak_in(&secrets, &buf, &dest, port) {
            let resp = intercept::leak(sb, Via::Http, &l);
            reply_and_close(&mut client, &resp).await;
            return;
        }
    }
    match open(inner, sb, Via::Http, &dest, port).await {
        Ok(up) if bound.is_some() => {
            // Plain HTTP to a bound host: its requests are rewritten like intercepted ones.
            let mut first = head.upstream_head(&path, &dest, port);
            first.extend_from_slice(&body_start);
            let client = intercept::Prefixed {
                prefix: first,
                at: 0,
                inner: client,
            };
            let host = bound.unwrap_or_default();
            intercept::serve_http(inner, sb, client, up, Via::Http, &host, port).await;
        }
        Ok(mut up) => {
            let mut first = head.upstream_head(&path, &dest, port);
            first.extend_from_slice(&body_start);
            if up.write_all(&first).await.is_err() {
                return;
            }
            let _ = relay(&mut client, &mut up).await;
        }
        Err(r) => {
            reply_and_close(&mut client, &refusal_response(&r)).await;
        }
    }
}

/// The host name whose bound secrets a connection to `dest:port` substitutes, if any (the
/// proxy intercepts only those; an address is never bound).
fn bound_host(secrets: &SecretSet, dest: &Dest, port: u16) -> Option<String> {
    dest.name()
        .filter(|n| secrets.binds_any(n, port))
        .map(str::to_owned)
}

/// How a destination is named in a leak attempt: its name, or its address.
fn dest_name(dest: &Dest) -> String {
    match dest {
        Dest::Name(n) => n.clone(),
        Dest::Ip(ip) => ip.to_string(),
    }
}

/// A placeholder in the cleartext bytes of a request to an unbound destination: `data` is
/// the request's head and whatever of its body was read with it.
fn leak_in(secrets: &SecretSet, data: &[u8], dest: &Dest, port: u16) -> Option<LeakAttempt> {
    let head_len = data
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(data.len(), |i| i + 4);
    let (head, body) = data.split_at(head_len);
    secrets.leak_attempt(head, body, &dest_name(dest), port)
}

/// What the first bytes of a redirected connection said.
enum Sniffed {
    Http(Dest, u16),
    Tls(String),
    TlsEch,
    Opaque,
    BadHttp(&'static str),
}

async fn sniff<S: AsyncRead + Unpin>(inner: &Inner, s: &mut S, buf: &mut Vec<u8>) -> Sniffed {
    let cfg = &inner.config;
    let deadline = tokio::time::Instant::now() + cfg.sniff_timeout;
    let mut http_head_deadline = None;
    loop {
        if !buf.is_empty() {
            match tls::parse_client_hello(buf) {
                ClientHelloSniff::ClientHello(h) => {
                    if h.ech && cfg.refuse_ech {
                        return Sniffed::TlsEch;
                    }
                    return match h.server_name {
                        Some(n) => Sniffed::Tls(n),
                        None => Sniffed::Opaque,
                    };
                }
                ClientHelloSniff::Malformed(_) => return Sniffed::Opaque,
                ClientHelloSniff::NeedMore => {}
                ClientHelloSniff::NotTls => {
                    if !http::looks_like_http(buf) {
                        return Sniffed::Opaque;
                    }
                    match http::parse_head(buf) {
                        HeadParse::Complete(h) => {
                            return match h.destination(0) {
                                Ok((d, p, _)) => Sniffed::Http(d, p),
                                Err(why) => Sniffed::BadHttp(why),
                            }
                        }
                        HeadParse::Invalid(why) => return Sniffed::BadHttp(why),
                        HeadParse::Partial => {
                            // An HTTP client gets the full head timeout to finish its head.
                            http_head_deadline
                                .get_or_insert(tokio::time::Instant::now() + cfg.head_timeout);
                        }
                    }
                }
            }
        }
        if buf.len() >= cfg.max_head_bytes.max(tls::MAX_HANDSHAKE + 64) {
            return Sniffed::Opaque;
        }
        let until = http_head_deadline.unwrap_or(deadline);
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout_at(until, s.read(&mut chunk)).await {
            Err(_) if http_head_deadline.is_some() => {
                return Sniffed::BadHttp("request head timed out")
            }
            Err(_) | Ok(Err(_)) | Ok(Ok(0)) => return Sniffed::Opaque,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

async fn handle_transparent<S>(
    inner: &Arc<Inner>,
    sb: &Arc<SandboxState>,
    mut client: S,
    original_dst: Option<SocketAddr>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut buf = Vec::new();
    let orig_port = original_dst.map(|a| a.port());
    let (via, dest, port) = match sniff(inner, &mut client, &mut buf).await {
        Sniffed::Http(d, p) => {
            // `Host` without a port means the port the sandbox dialed.
            let port = if p == 0 { orig_port.unwrap_or(80) } else { p };
            (Via::TransparentHttp, d, port)
        }
        Sniffed::Tls(name) => (
            Via::TransparentTls,
            Dest::Name(name),
            orig_port.unwrap_or(443),
        ),
        Sniffed::TlsEch => {
            refuse(
                sb,
                Via::TransparentTls,
                None,
                None,
                orig_port.unwrap_or(443),
                AuditRule::EchRefused,
            );
            return;
        }
        Sniffed::BadHttp(why) => {
            let r = refuse_malformed(sb, Via::TransparentHttp, None, orig_port.unwrap_or(0), why);
            reply_and_close(&mut client, &refusal_response(&r)).await;
            return;
        }
        Sniffed::Opaque => match original_dst {
            Some(a) => (Via::TransparentTcp, Dest::Ip(a.ip()), a.port()),
            None => {
                refuse_malformed(
                    sb,
                    Via::TransparentTcp,
                    None,
                    0,
                    "no HTTP Host or TLS SNI, and the original destination is unknown",
                );
                return;
            }
        },
    };
    let secrets = sb.secrets();
    let bound = bound_host(&secrets, &dest, port);
    if bound.is_none() && via == Via::TransparentHttp {
        if let Some(l) = leak_in(&secrets, &buf, &dest, port) {
            let resp = intercept::leak(sb, via, &l);
            reply_and_close(&mut client, &resp).await;
            return;
        }
    }
    match open(inner, sb, via, &dest, port).await {
        Ok(up) if bound.is_some() && matches!(via, Via::TransparentTls | Via::TransparentHttp) => {
            let host = bound.unwrap_or_default();
            let client = intercept::Prefixed {
                prefix: buf,
                at: 0,
                inner: client,
            };
            if via == Via::TransparentTls {
                intercept::serve_tls(inner, sb, client, up, via, &host, port).await;
            } else {
                intercept::serve_http(inner, sb, client, up, via, &host, port).await;
            }
        }
        Ok(mut up) => {
            if up.write_all(&buf).await.is_err() {
                return;
            }
            let _ = relay(&mut client, &mut up).await;
        }
        Err(r) => {
            if via == Via::TransparentHttp {
                reply_and_close(&mut client, &refusal_response(&r)).await;
            }
        }
    }
}

/// Sends a final response, then half-closes and discards (bounded in bytes and time) what the
/// client still sends, so the kernel does not reset the connection and destroy the response.
async fn reply_and_close<S: AsyncRead + AsyncWrite + Unpin>(client: &mut S, resp: &[u8]) {
    if client.write_all(resp).await.is_err() {
        return;
    }
    let _ = client.shutdown().await;
    let drain = async {
        let mut sink = [0u8; 4096];
        let mut left: usize = 256 * 1024;
        while left > 0 {
            match client.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// Buffer per direction of a relayed connection: large enough that a bulk transfer costs a
/// few syscalls per megabyte (tokio's default of 8 KiB costs 128).
const RELAY_BUFFER: usize = 256 * 1024;

/// Copies both ways until both sides are done: with `splice(2)` when both ends are TCP
/// sockets (no copy through user space), else through buffers.
async fn relay<A>(a: &mut A, b: &mut Box<dyn UpstreamStream>) -> std::io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + 'static,
{
    #[cfg(target_os = "linux")]
    {
        let a_any: &dyn std::any::Any = &*a;
        let b_any: &dyn std::any::Any = &**b;
        if let (Some(x), Some(y)) = (
            a_any.downcast_ref::<TcpStream>(),
            b_any.downcast_ref::<TcpStream>(),
        ) {
            return crate::splice::relay(x, y).await;
        }
    }
    tokio::io::copy_bidirectional_with_sizes(a, b, RELAY_BUFFER, RELAY_BUFFER).await
}
