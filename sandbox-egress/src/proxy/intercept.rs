//! Connections to hosts a proxy-held secret is bound to ([`crate::secrets`]): TLS terminated
//! with a minted leaf ([`crate::intercept`]), the real server verified, and HTTP/1.1 requests
//! rewritten one by one (keep-alive included) while responses stream back masked.
//!
//! Requests are parsed for their framing only (head, then a `Content-Length` or chunked
//! body): each head is rewritten with the secrets bound to the destination as they are
//! *now* (a policy or secret update applies to the next request), bodies up to
//! [`ProxyConfig::max_substituted_body`] are buffered and rewritten, larger and chunked
//! bodies stream through unchanged. The inner `Host` must name the host the connection was
//! decided for (no domain fronting through an intercepted connection). Compressed responses
//! could hide an echoed value from the masker, so requests ask for `identity` encoding.
//! Responses are not parsed: placeholders are as long as their values, so the masker works
//! on the raw byte stream and never changes a length. After an `Upgrade` (WebSocket) the
//! rest of the connection is relayed as it is (still masked downstream).

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{ReadBuf, ReadHalf, WriteHalf};
use tokio::sync::Mutex as AsyncMutex;

use super::decide::refuse;
use super::*;
use crate::secrets::LeakAttempt;

/// How long bytes the masker holds back (a possible start of a value) wait for the rest.
const HOLD_WAIT: Duration = Duration::from_millis(200);
/// Idle time allowed between two requests on a kept-alive connection.
const KEEP_ALIVE_IDLE: Duration = Duration::from_secs(60);

/// A stream that first yields bytes already read from it (a sniffed ClientHello).
pub(super) struct Prefixed<S> {
    pub(super) prefix: Vec<u8>,
    pub(super) at: usize,
    pub(super) inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.at);
            let at = self.at;
            buf.put_slice(&self.prefix[at..at + n]);
            self.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Refuses an intercepted connection for a reason of its own (audited as malformed).
fn malformed(sb: &SandboxState, via: Via, host: &str, port: u16, why: &str) {
    refuse(
        sb,
        via,
        Some(host),
        None,
        port,
        AuditRule::Malformed(why.to_owned()),
    );
}

/// Records a substitution or a leak attempt in the sandbox's audit ring (names and places,
/// never values).
fn audit(sb: &SandboxState, via: Via, host: &str, port: u16, allowed: bool, rule: AuditRule) {
    sb.audit.push(AuditEntry {
        time: SystemTime::now(),
        sandbox_id: sb.id.clone(),
        via,
        host: Some(host.to_owned()),
        ip: None,
        port,
        allowed,
        rule,
        error: None,
    });
}

/// A placeholder on its way to a host it is not bound to: audited as a leak attempt.
pub(super) fn leak(sb: &SandboxState, via: Via, l: &LeakAttempt) -> Vec<u8> {
    audit(
        sb,
        via,
        &l.host,
        l.port,
        false,
        AuditRule::SecretLeakAttempt {
            secret: l.secret.clone(),
            place: l.place.to_string(),
        },
    );
    http::response(
        403,
        "Forbidden",
        &format!("agent-sandbox egress: {l}\n"),
        &[("X-Agent-Sandbox-Egress", "secret-leak-refused")],
    )
}

/// Terminates the sandbox's TLS with a leaf for `host`, opens TLS to the real server over
/// `upstream` (verified), and serves HTTP/1.1 between them.
pub(super) async fn serve_tls<C>(
    inner: &Arc<Inner>,
    sb: &Arc<SandboxState>,
    client: C,
    upstream: Box<dyn UpstreamStream>,
    via: Via,
    host: &str,
    port: u16,
) where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let configs = match inner.tls_configs(host) {
        Ok(c) => c,
        Err(e) => {
            malformed(sb, via, host, port, &format!("interception: {e}"));
            return;
        }
    };
    let (server_cfg, client_cfg) = configs;
    let accepted = tokio::time::timeout(
        inner.config.head_timeout,
        tokio_rustls::TlsAcceptor::from(server_cfg).accept(client),
    )
    .await;
    let client = match accepted {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            // A client that pins its own certificates ends here: it refused our leaf.
            malformed(
                sb,
                via,
                host,
                port,
                &format!("the sandbox's TLS client refused the interception certificate: {e}"),
            );
            return;
        }
        Err(_) => return,
    };
    let Ok(name) = rustls::pki_types::ServerName::try_from(host.to_owned()) else {
        return;
    };
    let connected = tokio::time::timeout(
        inner.config.connect_timeout,
        tokio_rustls::TlsConnector::from(client_cfg).connect(name, upstream),
    )
    .await;
    let upstream = match connected {
        Ok(Ok(u)) => u,
        Ok(Err(e)) => {
            // The real server did not verify: nothing is sent to it.
            malformed(
                sb,
                via,
                host,
                port,
                &format!("the upstream server's certificate did not verify: {e}"),
            );
            let mut client = client;
            let body = format!(
                "agent-sandbox egress: {host}: the server's certificate did not verify: {e}\n"
            );
            let _ = client
                .write_all(&http::response(502, "Bad Gateway", &body, &[]))
                .await;
            let _ = client.shutdown().await;
            return;
        }
        Err(_) => return,
    };
    serve_http(inner, sb, client, upstream, via, host, port).await;
}

/// HTTP/1.1 between the sandbox and a bound host: requests rewritten, responses masked.
pub(super) async fn serve_http<C, U>(
    inner: &Arc<Inner>,
    sb: &Arc<SandboxState>,
    client: C,
    upstream: U,
    via: Via,
    host: &str,
    port: u16,
) where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut cr, cw) = tokio::io::split(client);
    let (ur, mut uw) = tokio::io::split(upstream);
    let cw = Arc::new(AsyncMutex::new(cw));
    let masker = sb.secrets().masker(host, port);
    let down = tokio::spawn(downstream(ur, cw.clone(), masker));
    let mut buf: Vec<u8> = Vec::new();
    loop {
        match request(inner, sb, &mut cr, &mut uw, &mut buf, via, host, port).await {
            Ok(Next::More) => continue,
            Ok(Next::Raw) => {
                // An upgraded connection: the rest goes through unchanged.
                if !buf.is_empty() && uw.write_all(&buf).await.is_err() {
                    break;
                }
                let _ = tokio::io::copy(&mut cr, &mut uw).await;
                break;
            }
            Ok(Next::Done) => break,
            Err(reply) => {
                down.abort();
                if let Some(reply) = reply {
                    let mut w = cw.lock().await;
                    let _ = w.write_all(&reply).await;
                    let _ = w.shutdown().await;
                    drop(w);
                    // What the client still sends is read and dropped (bounded in bytes and
                    // time), so that closing with unread bytes does not reset the connection
                    // and destroy the reply before the client has read it.
                    let drain = async {
                        let mut sink = vec![0u8; 16 * 1024];
                        let mut left: usize = 1 << 20;
                        while left > 0 {
                            match cr.read(&mut sink).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => left = left.saturating_sub(n),
                            }
                        }
                    };
                    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
                }
                return;
            }
        }
    }
    let _ = uw.shutdown().await;
    let _ = down.await;
}

/// Copies the server's bytes to the sandbox through the masker.
async fn downstream<U, C>(
    mut ur: ReadHalf<U>,
    cw: Arc<AsyncMutex<WriteHalf<C>>>,
    mut masker: crate::secrets::ResponseMasker,
) where
    U: AsyncRead + Unpin,
    C: AsyncWrite + Unpin,
{
    let mut chunk = vec![0u8; 64 * 1024];
    let mut out = Vec::with_capacity(chunk.len() + 4096);
    loop {
        // Bytes held back (a possible start of a value) wait for more only briefly: a
        // kept-alive response must not stall on them.
        let read = if masker.holding() {
            match tokio::time::timeout(HOLD_WAIT, ur.read(&mut chunk)).await {
                Ok(r) => r,
                Err(_) => {
                    let out = masker.flush();
                    if cw.lock().await.write_all(&out).await.is_err() {
                        return;
                    }
                    continue;
                }
            }
        } else {
            ur.read(&mut chunk).await
        };
        let n = match read {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        out.clear();
        masker.push_into(&chunk[..n], &mut out);
        if cw.lock().await.write_all(&out).await.is_err() {
            return;
        }
    }
    let rest = masker.finish();
    let mut w = cw.lock().await;
    let _ = w.write_all(&rest).await;
    let _ = w.shutdown().await;
}

enum Next {
    More,
    Raw,
    Done,
}

/// One request: its head read, checked and rewritten, its body forwarded. `Err(Some(reply))`
/// ends the connection with that reply; `Err(None)` ends it silently.
#[allow(clippy::too_many_arguments)]
async fn request<R, W>(
    inner: &Arc<Inner>,
    sb: &Arc<SandboxState>,
    cr: &mut R,
    uw: &mut W,
    buf: &mut Vec<u8>,
    via: Via,
    host: &str,
    port: u16,
) -> Result<Next, Option<Vec<u8>>>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let cfg = &inner.config;
    // The head: until the blank line, bounded, within the idle and head timeouts.
    let end = loop {
        if let Some(i) = find_head_end(buf) {
            break i;
        }
        if buf.len() > cfg.max_head_bytes {
            return Err(Some(http::response(
                431,
                "Request Header Fields Too Large",
                "agent-sandbox egress: request head too large\n",
                &[],
            )));
        }
        let wait = if buf.is_empty() {
            KEEP_ALIVE_IDLE
        } else {
            cfg.head_timeout
        };
        let mut chunk = [0u8; 8192];
        match tokio::time::timeout(wait, cr.read(&mut chunk)).await {
            Ok(Ok(0)) if buf.is_empty() => return Ok(Next::Done),
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Err(None),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head: Vec<u8> = buf.drain(..end).collect();
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut headers);
    if !matches!(req.parse(&head), Ok(httparse::Status::Complete(_))) {
        malformed(
            sb,
            via,
            host,
            port,
            "unparsable request inside an intercepted connection",
        );
        return Err(Some(http::response(
            400,
            "Bad Request",
            "agent-sandbox egress: bad request\n",
            &[],
        )));
    }
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut upgrade = false;
    let mut host_ok = false;
    for h in req.headers.iter() {
        let v = String::from_utf8_lossy(h.value);
        if h.name.eq_ignore_ascii_case("host") {
            let named = v.trim().rsplit_once(':').map_or(v.trim(), |(n, p)| {
                if p.parse::<u16>().is_ok() {
                    n
                } else {
                    v.trim()
                }
            });
            host_ok = named.trim_matches(['[', ']']).eq_ignore_ascii_case(host);
        } else if h.name.eq_ignore_ascii_case("content-length") {
            length = v.trim().parse().ok();
            if length.is_none() {
                return Err(Some(http::response(
                    400,
                    "Bad Request",
                    "agent-sandbox egress: bad Content-Length\n",
                    &[],
                )));
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v.to_ascii_lowercase().contains("chunked");
        } else if h.name.eq_ignore_ascii_case("upgrade") {
            upgrade = true;
        }
    }
    if !host_ok {
        malformed(
            sb,
            via,
            host,
            port,
            "the request's Host does not name the host this connection was decided for",
        );
        return Err(Some(http::response(
            421,
            "Misdirected Request",
            "agent-sandbox egress: Host does not match the connection's destination\n",
            &[],
        )));
    }
    let secrets = sb.secrets();
    let rewritten = match secrets.rewrite_head(host, port, &identity_encoding(&head)) {
        Ok(r) => r,
        Err(l) => return Err(Some(leak(sb, via, &l))),
    };
    for s in &rewritten.substitutions {
        audit(
            sb,
            via,
            host,
            port,
            true,
            AuditRule::SecretSubstituted {
                secret: s.secret.clone(),
                place: s.place.to_string(),
            },
        );
    }
    let small = length.filter(|n| !chunked && *n <= cfg.max_substituted_body as u64);
    let mut out = rewritten.head;
    if let Some(n) = small {
        // The whole body, then rewritten (same length: the head's framing stays right).
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        while buf.len() < n {
            let mut chunk = vec![0u8; (n - buf.len()).min(64 * 1024)];
            match tokio::time::timeout(cfg.head_timeout, cr.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Err(None),
                Ok(Ok(k)) => buf.extend_from_slice(&chunk[..k]),
            }
        }
        let body: Vec<u8> = buf.drain(..n).collect();
        let (body, subs) = match secrets.rewrite_body(host, port, &body) {
            Ok(b) => b,
            Err(l) => return Err(Some(leak(sb, via, &l))),
        };
        for s in subs {
            audit(
                sb,
                via,
                host,
                port,
                true,
                AuditRule::SecretSubstituted {
                    secret: s.secret,
                    place: s.place.to_string(),
                },
            );
        }
        out.extend_from_slice(&body);
        uw.write_all(&out).await.map_err(|_| None)?;
    } else if let Some(n) = length.filter(|_| !chunked) {
        // A large body: streamed as it is.
        uw.write_all(&out).await.map_err(|_| None)?;
        copy_exact(cr, uw, buf, n).await?;
    } else if chunked {
        uw.write_all(&out).await.map_err(|_| None)?;
        copy_chunked(cr, uw, buf, cfg.head_timeout).await?;
    } else {
        uw.write_all(&out).await.map_err(|_| None)?;
    }
    if upgrade {
        return Ok(Next::Raw);
    }
    Ok(Next::More)
}

/// The head with `Accept-Encoding: identity` (compressed responses would hide echoed values
/// from the masker).
fn identity_encoding(head: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut out = String::with_capacity(text.len() + 32);
    for line in text.split_inclusive("\r\n") {
        if line
            .split_once(':')
            .is_some_and(|(n, _)| n.trim().eq_ignore_ascii_case("accept-encoding"))
        {
            continue;
        }
        if line == "\r\n" {
            out.push_str("Accept-Encoding: identity\r\n");
        }
        out.push_str(line);
    }
    out.into_bytes()
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

/// Forwards exactly `n` body bytes (what is buffered first).
async fn copy_exact<R, W>(
    cr: &mut R,
    uw: &mut W,
    buf: &mut Vec<u8>,
    n: u64,
) -> Result<(), Option<Vec<u8>>>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut left = n;
    let take = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
    uw.write_all(&buf[..take]).await.map_err(|_| None)?;
    buf.drain(..take);
    left -= take as u64;
    let mut chunk = vec![0u8; 64 * 1024];
    while left > 0 {
        let want = usize::try_from(left).unwrap_or(usize::MAX).min(chunk.len());
        let k = match cr.read(&mut chunk[..want]).await {
            Ok(0) | Err(_) => return Err(None),
            Ok(k) => k,
        };
        uw.write_all(&chunk[..k]).await.map_err(|_| None)?;
        left -= k as u64;
    }
    Ok(())
}

/// Forwards a chunked body as it is, following its framing to find where it ends.
async fn copy_chunked<R, W>(
    cr: &mut R,
    uw: &mut W,
    buf: &mut Vec<u8>,
    timeout: Duration,
) -> Result<(), Option<Vec<u8>>>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    async fn line<R: AsyncRead + Unpin>(
        cr: &mut R,
        buf: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, Option<Vec<u8>>> {
        loop {
            if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
                return Ok(buf.drain(..i + 2).collect());
            }
            if buf.len() > 8192 {
                return Err(None);
            }
            let mut chunk = [0u8; 4096];
            match tokio::time::timeout(timeout, cr.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Err(None),
                Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
    loop {
        let size_line = line(cr, buf, timeout).await?;
        let text = String::from_utf8_lossy(&size_line);
        let hex = text
            .trim()
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_owned();
        let size = u64::from_str_radix(&hex, 16).map_err(|_| None)?;
        uw.write_all(&size_line).await.map_err(|_| None)?;
        if size == 0 {
            // Trailers, up to the blank line.
            loop {
                let l = line(cr, buf, timeout).await?;
                uw.write_all(&l).await.map_err(|_| None)?;
                if l == b"\r\n" {
                    return Ok(());
                }
            }
        }
        copy_exact(cr, uw, buf, size + 2).await?;
    }
}
