//! The sandbox's side of an intercepted connection: each request read, held to one reading of
//! its framing and destination, rewritten with the bound secrets, and forwarded.

use tokio::sync::mpsc::UnboundedSender;

use super::*;

/// Idle time allowed between two requests on a kept-alive connection.
const KEEP_ALIVE_IDLE: Duration = Duration::from_secs(60);

pub(super) enum Next {
    More,
    Raw,
    Done,
}

/// One request: its head read, checked and rewritten, its body forwarded. `Err(Some(reply))`
/// ends the connection with that reply; `Err(None)` ends it silently.
#[allow(clippy::too_many_arguments)]
pub(super) async fn request<R, W>(
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
pub(super) fn origin_target(
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
pub(super) fn with_target(head: &[u8], method: &str, target: &str, version: u8) -> Vec<u8> {
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
