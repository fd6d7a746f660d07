//! The server's side of an intercepted connection: responses read message by message, their
//! framing followed, relayed to the sandbox masked.

use tokio::io::{ReadHalf, WriteHalf};
use tokio::sync::mpsc::UnboundedReceiver;

use super::*;
use crate::secrets::ResponseMasker;

/// The largest response head (status line, headers) or trailer block read from a server.
const MAX_RESPONSE_HEAD: usize = 256 * 1024;
/// Headers parsed in one response head.
const MAX_RESPONSE_HEADERS: usize = 256;

/// How a response's body is delimited.
pub(super) enum Body {
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
pub(super) async fn downstream<U, C>(
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
pub(super) fn response_body(
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
