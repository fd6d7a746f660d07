//! Connections to hosts a proxy-held secret is bound to ([`crate::secrets`]): TLS terminated
//! with a minted leaf ([`crate::intercept`]), the real server verified, and HTTP/1.1 requests
//! rewritten one by one (keep-alive included) while responses stream back masked.
//!
//! Requests are parsed for their framing (head, then a `Content-Length` or chunked body) and
//! held to one reading of it: a second `Host` or `Content-Length`, a `Transfer-Encoding`
//! other than exactly `chunked` (or with a `Content-Length`), or a request target that is not
//! origin-form or an absolute URI naming this connection's host and port is refused with 400
//! before anything is sent (a front end reading the request another way could route it, and
//! its substituted secrets, elsewhere). The inner `Host` must name the host the connection was
//! decided for (421; no domain fronting through an intercepted connection). Each head is
//! rewritten with the secrets bound to the destination as they are *now* (a policy or secret
//! update applies to the next request); an absolute target is sent on in origin form; bodies
//! up to [`ProxyConfig::max_substituted_body`] are buffered and rewritten (for secrets granted
//! the body), larger and chunked bodies stream through unchanged.
//!
//! Responses are parsed for their framing too, and masked as messages: a chunked body is
//! de-chunked, masked and chunked again (a value split by the chunk framing is found), and
//! bytes the masker holds back (a possible start of a value) wait for the rest of the body,
//! however long it takes, never for a timer; the masker is finished where a body ends.
//! Compressed responses could hide an echoed value from the masker, so requests ask for
//! `identity` encoding, a `TE` header is dropped, and a response with a transfer coding other
//! than `chunked` is refused (502). After an `Upgrade` (WebSocket) the rest of the connection
//! is relayed as it is, still masked downstream (finished at its end).

mod request;
mod response;

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::ReadBuf;
use tokio::sync::mpsc::unbounded_channel;
use tokio::sync::Mutex as AsyncMutex;

use super::decide::refuse;
use super::*;
use crate::secrets::LeakAttempt;

use self::request::{request, Next};
use self::response::downstream;

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
    let (sent, expected) = unbounded_channel();
    let down = tokio::spawn(downstream(
        ur,
        cw.clone(),
        expected,
        sb.secrets(),
        host.to_owned(),
        port,
    ));
    let mut buf: Vec<u8> = Vec::new();
    loop {
        match request(
            inner, sb, &mut cr, &mut uw, &mut buf, &sent, via, host, port,
        )
        .await
        {
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

/// What the sandbox asked for, in order: how to read the answer to each request sent.
struct Sent {
    /// A `HEAD` request: its answer has no body, whatever its head says.
    head: bool,
    /// The secrets the request was rewritten with: its answer is masked for them.
    secrets: Arc<SecretSet>,
}

/// A chunk-size line's size (hex digits only; extensions ignored).
fn chunk_size(line: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(line).ok()?;
    let hex = text.trim_end_matches("\r\n").split(';').next()?.trim();
    if hex.is_empty() || hex.len() > 15 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// A decimal length: digits only (no sign, no spaces, no list), at most 18 of them.
fn digits(v: &str) -> Option<u64> {
    if v.is_empty() || v.len() > 18 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

#[cfg(test)]
mod tests;
