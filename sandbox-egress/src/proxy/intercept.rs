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

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{ReadBuf, ReadHalf, WriteHalf};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::Mutex as AsyncMutex;

use super::decide::refuse;
use super::*;
use crate::secrets::{LeakAttempt, ResponseMasker};

/// Idle time allowed between two requests on a kept-alive connection.
const KEEP_ALIVE_IDLE: Duration = Duration::from_secs(60);
/// The largest response head (status line, headers) or trailer block read from a server.
const MAX_RESPONSE_HEAD: usize = 256 * 1024;
/// Headers parsed in one response head.
const MAX_RESPONSE_HEADERS: usize = 256;

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

/// How a response's body is delimited.
enum Body {
    None,
    Length(u64),
    Chunked,
    /// Until the server closes (also what follows a `101 Switching Protocols`).
    UntilClose,
}

/// The server's side of an intercepted connection, read message by message.
struct Upstream<R> {
    r: R,
    /// Read but not yet used: `pending[pos..]`.
    pending: Vec<u8>,
    pos: usize,
    scratch: Vec<u8>,
}

impl<R: AsyncRead + Unpin> Upstream<R> {
    fn buffered(&self) -> &[u8] {
        &self.pending[self.pos..]
    }

    /// Reads more into `pending`; `false` at the end of the stream (or an error).
    async fn fill(&mut self) -> bool {
        if self.pos > 0 {
            self.pending.drain(..self.pos);
            self.pos = 0;
        }
        match self.r.read(&mut self.scratch).await {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.pending.extend_from_slice(&self.scratch[..n]);
                true
            }
        }
    }

    /// Up to `max` bytes: what is buffered first, else one read. Empty at the end.
    async fn some(&mut self, max: usize) -> &[u8] {
        if self.pos < self.pending.len() {
            let at = self.pos;
            let n = max.min(self.pending.len() - at);
            self.pos += n;
            return &self.pending[at..at + n];
        }
        self.pending.clear();
        self.pos = 0;
        let want = max.min(self.scratch.len());
        match self.r.read(&mut self.scratch[..want]).await {
            Ok(0) | Err(_) => &[],
            Ok(n) => &self.scratch[..n],
        }
    }

    /// Everything up to and including `end` (`\r\n` for a line, `\r\n\r\n` for a head),
    /// at most `max` bytes. `Ok(None)`: the stream ended before any byte; `Err(bytes)`: it
    /// ended (or overflowed) after these.
    async fn until(&mut self, end: &[u8], max: usize) -> Result<Option<Vec<u8>>, Vec<u8>> {
        let mut searched: usize = 0;
        loop {
            let b = self.buffered();
            let from = searched.saturating_sub(end.len());
            if let Some(i) = b[from..].windows(end.len()).position(|w| w == end) {
                let n = from + i + end.len();
                let out = b[..n].to_vec();
                self.pos += n;
                return Ok(Some(out));
            }
            searched = b.len();
            if b.len() > max {
                return Err(self.take_all());
            }
            if !self.fill().await {
                let rest = self.take_all();
                return if rest.is_empty() { Ok(None) } else { Err(rest) };
            }
        }
    }

    fn take_all(&mut self) -> Vec<u8> {
        let out = self.pending[self.pos..].to_vec();
        self.pending.clear();
        self.pos = 0;
        out
    }
}

/// Copies the server's responses to the sandbox, message by message, through the masker.
async fn downstream<U, C>(
    ur: ReadHalf<U>,
    cw: Arc<AsyncMutex<WriteHalf<C>>>,
    mut sent: UnboundedReceiver<Sent>,
    secrets: Arc<SecretSet>,
    host: String,
    port: u16,
) where
    U: AsyncRead + Unpin,
    C: AsyncWrite + Unpin,
{
    let mut up = Upstream {
        r: ur,
        pending: Vec::new(),
        pos: 0,
        scratch: vec![0u8; 64 * 1024],
    };
    let mut masks = secrets;
    let mut masker = masks.masker(&host, port);
    let mut out = Vec::with_capacity(64 * 1024 + 4096);
    let _ = relay_responses(
        &mut up,
        &cw,
        &mut sent,
        &mut masks,
        &mut masker,
        &host,
        port,
        &mut out,
    )
    .await;
    // Whatever was held back is the end of a body the server cut short: masked, sent.
    let rest = masker.finish();
    let mut w = cw.lock().await;
    let _ = w.write_all(&rest).await;
    let _ = w.shutdown().await;
}

/// The responses of one connection until it ends (`Err(())`: the sandbox went away or the
/// server broke the framing).
#[allow(clippy::too_many_arguments)]
async fn relay_responses<R, C>(
    up: &mut Upstream<R>,
    cw: &AsyncMutex<WriteHalf<C>>,
    sent: &mut UnboundedReceiver<Sent>,
    masks: &mut Arc<SecretSet>,
    masker: &mut ResponseMasker,
    host: &str,
    port: u16,
    out: &mut Vec<u8>,
) -> Result<(), ()>
where
    R: AsyncRead + Unpin,
    C: AsyncWrite + Unpin,
{
    async fn send<C: AsyncWrite + Unpin>(
        cw: &AsyncMutex<WriteHalf<C>>,
        bytes: &[u8],
    ) -> Result<(), ()> {
        if bytes.is_empty() {
            return Ok(());
        }
        cw.lock().await.write_all(bytes).await.map_err(|_| ())
    }
    loop {
        let head = match up.until(b"\r\n\r\n", MAX_RESPONSE_HEAD).await {
            Ok(Some(h)) => h,
            Ok(None) => return Ok(()),
            Err(partial) => {
                // Not a head (too large, or cut short): masked as it is, and the end.
                let mut m = masker.push(&partial);
                m.extend(masker.finish());
                return send(cw, &m).await;
            }
        };
        let mut headers = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
        let mut resp = httparse::Response::new(&mut headers);
        let parsed = matches!(resp.parse(&head), Ok(httparse::Status::Complete(_)));
        let code = resp.code.unwrap_or(0);
        if !parsed {
            // Not HTTP: the rest of the connection is relayed raw, masked.
            send(cw, &masker.push(&head)).await?;
            return relay_raw(up, cw, masker, out).await;
        }
        let informational = (100..200).contains(&code) && code != 101;
        let request = if informational {
            None
        } else {
            sent.try_recv().ok()
        };
        if let Some(r) = &request {
            if !Arc::ptr_eq(&r.secrets, masks) {
                // The secrets changed since the last request: mask for the new set.
                *masks = r.secrets.clone();
                *masker = masks.masker(host, port);
            }
        }
        let body = match response_body(resp.headers, code, request.as_ref().is_some_and(|r| r.head))
        {
            Ok(b) => b,
            Err(why) => {
                let reply = http::response(
                    502,
                    "Bad Gateway",
                    &format!("agent-sandbox egress: {host}: {why}\n"),
                    &[],
                );
                let _ = send(cw, &reply).await;
                return Err(());
            }
        };
        // The head, masked whole (a value in a `Location` or `Set-Cookie`).
        let mut m = masker.push(&head);
        m.extend(masker.finish());
        send(cw, &m).await?;
        match body {
            Body::None => {}
            Body::Length(n) => {
                let mut left = n;
                while left > 0 {
                    let want = usize::try_from(left).unwrap_or(usize::MAX);
                    let data = up.some(want).await;
                    if data.is_empty() {
                        return Err(());
                    }
                    left -= data.len() as u64;
                    out.clear();
                    masker.push_into(data, out);
                    send(cw, out).await?;
                }
                send(cw, &masker.finish()).await?;
            }
            Body::Chunked => relay_chunked(up, cw, masker, out).await?,
            Body::UntilClose => return relay_raw(up, cw, masker, out).await,
        }
    }
}

/// How the body of a response with status `code` is delimited (RFC 9112, 6.3), or why it
/// cannot be relayed masked.
fn response_body(
    headers: &[httparse::Header<'_>],
    code: u16,
    to_head: bool,
) -> Result<Body, &'static str> {
    if code == 101 {
        return Ok(Body::UntilClose);
    }
    if to_head || (100..200).contains(&code) || code == 204 || code == 304 {
        return Ok(Body::None);
    }
    let mut codings = Vec::new();
    let mut length: Option<u64> = None;
    for h in headers {
        let v = std::str::from_utf8(h.value).map_err(|_| "a framing header is not ASCII")?;
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            codings.extend(
                v.split(',')
                    .map(|c| c.trim().to_ascii_lowercase())
                    .filter(|c| !c.is_empty()),
            );
        } else if h.name.eq_ignore_ascii_case("content-length") {
            let n = digits(v.trim()).ok_or("the response's Content-Length is not a number")?;
            if length.is_some_and(|l| l != n) {
                return Err("the response has conflicting Content-Length headers");
            }
            length = Some(n);
        }
    }
    if !codings.is_empty() {
        // A transfer coding (gzip) would hide an echoed value from the masker.
        if codings != ["chunked"] {
            return Err(
                "the response uses a transfer coding other than chunked, which the \
                        proxy cannot mask",
            );
        }
        return Ok(Body::Chunked);
    }
    Ok(length.map_or(Body::UntilClose, Body::Length))
}

/// A chunked body: de-chunked, masked, chunked again (chunk sizes change, the content
/// length does not), the trailers masked as a block.
async fn relay_chunked<R, C>(
    up: &mut Upstream<R>,
    cw: &AsyncMutex<WriteHalf<C>>,
    masker: &mut ResponseMasker,
    out: &mut Vec<u8>,
) -> Result<(), ()>
where
    R: AsyncRead + Unpin,
    C: AsyncWrite + Unpin,
{
    /// `out` (masked data) framed as one chunk, written.
    async fn chunk<C: AsyncWrite + Unpin>(
        cw: &AsyncMutex<WriteHalf<C>>,
        data: &[u8],
    ) -> Result<(), ()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut framed = Vec::with_capacity(data.len() + 12);
        framed.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
        framed.extend_from_slice(data);
        framed.extend_from_slice(b"\r\n");
        cw.lock().await.write_all(&framed).await.map_err(|_| ())
    }
    loop {
        let line = up.until(b"\r\n", 4096).await.ok().flatten().ok_or(())?;
        let size = chunk_size(&line).ok_or(())?;
        if size == 0 {
            break;
        }
        let mut left = size;
        while left > 0 {
            let data = up.some(usize::try_from(left).unwrap_or(usize::MAX)).await;
            if data.is_empty() {
                return Err(());
            }
            left -= data.len() as u64;
            out.clear();
            masker.push_into(data, out);
            chunk(cw, out).await?;
        }
        if up.until(b"\r\n", 2).await.ok().flatten().as_deref() != Some(b"\r\n") {
            return Err(());
        }
    }
    // The end of the body: what was held back, masked, then the last chunk and trailers.
    chunk(cw, &masker.finish()).await?;
    let mut trailers = Vec::new();
    loop {
        let line = up
            .until(b"\r\n", MAX_RESPONSE_HEAD)
            .await
            .ok()
            .flatten()
            .ok_or(())?;
        trailers.extend_from_slice(&line);
        if line == b"\r\n" || trailers.len() > MAX_RESPONSE_HEAD {
            break;
        }
    }
    let mut m = b"0\r\n".to_vec();
    let masked = masker.push(&trailers);
    m.extend(masked);
    m.extend(masker.finish());
    cw.lock().await.write_all(&m).await.map_err(|_| ())
}

/// The rest of the connection as it comes (a body delimited by the close, an upgraded
/// protocol, or something that is not HTTP), masked; the masker finishes at the end.
async fn relay_raw<R, C>(
    up: &mut Upstream<R>,
    cw: &AsyncMutex<WriteHalf<C>>,
    masker: &mut ResponseMasker,
    out: &mut Vec<u8>,
) -> Result<(), ()>
where
    R: AsyncRead + Unpin,
    C: AsyncWrite + Unpin,
{
    loop {
        let data = up.some(usize::MAX).await;
        if data.is_empty() {
            return Ok(());
        }
        out.clear();
        masker.push_into(data, out);
        if !out.is_empty() {
            cw.lock().await.write_all(out).await.map_err(|_| ())?;
        }
    }
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
    sent: &UnboundedSender<Sent>,
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
    let method = req.method.unwrap_or("").to_owned();
    let path = req.path.unwrap_or("").to_owned();
    let version = req.version.unwrap_or(1);
    // One reading of the framing and the destination, or none: a front end that reads a
    // second `Host`, a second `Content-Length` or an unknown transfer coding differently
    // from us could route the request (and the secrets substituted in it) elsewhere, or
    // smuggle a second request past our checks.
    let bad = |why: &str| {
        malformed(sb, via, host, port, why);
        Err(Some(http::response(
            400,
            "Bad Request",
            &format!("agent-sandbox egress: {why}\n"),
            &[],
        )))
    };
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut upgrade = false;
    let mut host_ok = false;
    let (mut hosts, mut lengths, mut codings) = (0, 0, 0);
    for h in req.headers.iter() {
        let v = String::from_utf8_lossy(h.value);
        if h.name.eq_ignore_ascii_case("host") {
            hosts += 1;
            let named = v.trim().rsplit_once(':').map_or(v.trim(), |(n, p)| {
                if p.parse::<u16>().is_ok() {
                    n
                } else {
                    v.trim()
                }
            });
            host_ok = named.trim_matches(['[', ']']).eq_ignore_ascii_case(host);
        } else if h.name.eq_ignore_ascii_case("content-length") {
            lengths += 1;
            length = digits(v.trim());
            if length.is_none() {
                return bad("bad Content-Length");
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            codings += 1;
            chunked = v.trim().eq_ignore_ascii_case("chunked");
            if !chunked {
                return bad("a Transfer-Encoding other than chunked");
            }
        } else if h.name.eq_ignore_ascii_case("upgrade") {
            upgrade = true;
        }
    }
    if hosts > 1 {
        return bad("more than one Host header");
    }
    if lengths > 1 {
        return bad("more than one Content-Length header");
    }
    if codings > 1 {
        return bad("more than one Transfer-Encoding header");
    }
    if codings > 0 && lengths > 0 {
        return bad("both Transfer-Encoding and Content-Length");
    }
    let target = match origin_target(&method, &path, host, port) {
        Ok(t) => t,
        Err(why) => return bad(why),
    };
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
    let head = match target {
        Some(t) => with_target(&head, &method, &t, version),
        None => head,
    };
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
    // The answer to this request is read (and masked) knowing what was asked.
    let _ = sent.send(Sent {
        head: method.eq_ignore_ascii_case("HEAD"),
        secrets: secrets.clone(),
    });
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

/// Where a request inside an intercepted connection goes: `Ok(None)` for origin form
/// (`/path`) and `OPTIONS *`, `Ok(Some(path))` for an absolute URI naming this connection's
/// host and port (sent on as `path`, so no front end reads another destination from it),
/// `Err` for anything else (another authority, authority form, userinfo, garbage).
fn origin_target(
    method: &str,
    target: &str,
    host: &str,
    port: u16,
) -> Result<Option<String>, &'static str> {
    if target.starts_with('/') {
        return Ok(None);
    }
    if target == "*" && method.eq_ignore_ascii_case("OPTIONS") {
        return Ok(None);
    }
    let lower = target
        .get(..8)
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    let (rest, default_port) = if lower.starts_with("https://") {
        (&target[8..], 443)
    } else if lower.starts_with("http://") {
        (&target[7..], 80)
    } else {
        return Err("a request target that is neither a path nor an absolute http(s) URI");
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    let same = match http::parse_authority(authority, Some(default_port)) {
        Some((http::Dest::Name(n), p)) => n.eq_ignore_ascii_case(host) && p == port,
        Some((http::Dest::Ip(ip), p)) => ip.to_string() == host && p == port,
        None => false,
    };
    if !same {
        return Err("an absolute request target naming another host than the connection's");
    }
    Ok(Some(match path {
        "" => "/".to_owned(),
        p if p.starts_with('/') => p.to_owned(),
        p => format!("/{p}"),
    }))
}

/// `head` with its request line's target replaced.
fn with_target(head: &[u8], method: &str, target: &str, version: u8) -> Vec<u8> {
    let rest = head
        .iter()
        .position(|b| *b == b'\n')
        .map_or(&head[head.len()..], |i| &head[i + 1..]);
    let mut out = format!("{method} {target} HTTP/1.{version}\r\n").into_bytes();
    out.extend_from_slice(rest);
    out
}

/// The head with `Accept-Encoding: identity` and no `TE` (compressed responses would hide
/// echoed values from the masker).
fn identity_encoding(head: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut out = String::with_capacity(text.len() + 32);
    for line in text.split_inclusive("\r\n") {
        if line.split_once(':').is_some_and(|(n, _)| {
            let n = n.trim();
            n.eq_ignore_ascii_case("accept-encoding") || n.eq_ignore_ascii_case("te")
        }) {
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
        let size = chunk_size(&size_line).ok_or(None)?;
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
        copy_exact(cr, uw, buf, size).await?;
        // The data's end: exactly CRLF, or the framing is not what we forwarded.
        let end = line(cr, buf, timeout).await?;
        if end != b"\r\n" {
            return Err(None);
        }
        uw.write_all(&end).await.map_err(|_| None)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_targets_must_name_this_connection() {
        let t = |target: &str| origin_target("GET", target, "api.test", 443);
        assert_eq!(t("/a?b"), Ok(None));
        assert_eq!(origin_target("OPTIONS", "*", "api.test", 443), Ok(None));
        assert_eq!(t("https://api.test/x?y"), Ok(Some("/x?y".into())));
        assert_eq!(t("HTTPS://API.TEST:443"), Ok(Some("/".into())));
        assert_eq!(t("https://api.test?q"), Ok(Some("/?q".into())));
        assert_eq!(
            origin_target("GET", "http://api.test:8080/p", "api.test", 8080),
            Ok(Some("/p".into()))
        );
        for bad in [
            "*",
            "https://other.test/",
            "https://api.test.other.test/",
            "https://api.test@other.test/",
            "https://api.test:444/",
            "http://api.test/",
            "api.test:443",
            "ftp://api.test/",
            "https:///x",
        ] {
            assert!(t(bad).is_err(), "{bad}");
        }
        assert_eq!(
            with_target(
                b"GET https://api.test/x HTTP/1.1\r\nHost: a\r\n\r\n",
                "GET",
                "/x",
                1
            ),
            b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"
        );
    }

    #[test]
    fn response_framing() {
        let h = |pairs: &[(&'static str, &'static str)]| -> Vec<httparse::Header<'static>> {
            pairs
                .iter()
                .map(|(n, v)| httparse::Header {
                    name: n,
                    value: v.as_bytes(),
                })
                .collect()
        };
        let body = |pairs: &[(&'static str, &'static str)], code, head| {
            response_body(&h(pairs), code, head)
        };
        assert!(matches!(
            body(&[("Content-Length", "5")], 200, false),
            Ok(Body::Length(5))
        ));
        assert!(matches!(
            body(&[("Content-Length", "5")], 200, true),
            Ok(Body::None)
        ));
        assert!(matches!(
            body(&[("Content-Length", "5")], 204, false),
            Ok(Body::None)
        ));
        assert!(matches!(
            body(&[("Content-Length", "5")], 304, false),
            Ok(Body::None)
        ));
        assert!(matches!(body(&[], 101, false), Ok(Body::UntilClose)));
        assert!(matches!(body(&[], 200, false), Ok(Body::UntilClose)));
        assert!(matches!(
            body(
                &[("Transfer-Encoding", "Chunked"), ("Content-Length", "5")],
                200,
                false
            ),
            Ok(Body::Chunked)
        ));
        assert!(matches!(
            body(
                &[("Content-Length", "5"), ("Content-Length", "5")],
                200,
                false
            ),
            Ok(Body::Length(5))
        ));
        for bad in [
            &[("Transfer-Encoding", "gzip, chunked")][..],
            &[("Transfer-Encoding", "gzip")],
            &[
                ("Transfer-Encoding", "chunked"),
                ("Transfer-Encoding", "chunked"),
            ],
            &[("Content-Length", "5"), ("Content-Length", "6")],
            &[("Content-Length", "+5")],
            &[("Content-Length", "5, 5")],
        ] {
            assert!(body(bad, 200, false).is_err(), "{bad:?}");
        }
        assert_eq!(chunk_size(b"1a;ext=1\r\n"), Some(26));
        assert_eq!(chunk_size(b"0\r\n"), Some(0));
        for bad in [&b"+1\r\n"[..], b"\r\n", b"x\r\n", b"ffffffffffffffff\r\n"] {
            assert_eq!(chunk_size(bad), None);
        }
        assert_eq!(digits("42"), Some(42));
        assert_eq!(digits("+42"), None);
        assert_eq!(digits(""), None);
    }
}
