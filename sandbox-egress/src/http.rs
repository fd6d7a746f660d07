//! HTTP/1.1 request-head parsing for the forward proxy and the transparent sniffer.

use crate::tls::valid_host_name;
use std::net::IpAddr;

/// Most headers accepted in one request head.
const MAX_HEADERS: usize = 100;

/// A destination as the sandbox named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Dest {
    /// A validated, lower-case host name.
    Name(String),
    /// A literal address.
    Ip(IpAddr),
}

impl Dest {
    pub(crate) fn name(&self) -> Option<&str> {
        match self {
            Dest::Name(n) => Some(n),
            Dest::Ip(_) => None,
        }
    }
}

impl std::fmt::Display for Dest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dest::Name(n) => f.write_str(n),
            Dest::Ip(ip) => ip.fmt(f),
        }
    }
}

/// Parses `host`, `host:port`, `[v6]` or `[v6]:port`. `default_port` applies when none is given
/// (`None`: a port is required). No userinfo, no path.
pub(crate) fn parse_authority(s: &str, default_port: Option<u16>) -> Option<(Dest, u16)> {
    if s.is_empty() || s.len() > 300 || s.contains(['@', '/', '?', '#', ' ']) {
        return None;
    }
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']')?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?),
        };
        let ip: IpAddr = h.parse().ok().filter(IpAddr::is_ipv6)?;
        return Some((Dest::Ip(ip), port_or(port, default_port)?));
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    let port = port_or(port, default_port)?;
    if let Ok(ip) = host.parse::<std::net::Ipv4Addr>() {
        return Some((Dest::Ip(IpAddr::V4(ip)), port));
    }
    // Refuse numeric-looking names (`2130706433`, `0x7f.1`) that some stacks read as addresses.
    if host
        .rsplit('.')
        .next()
        .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()) || l.starts_with("0x"))
    {
        return None;
    }
    Some((Dest::Name(valid_host_name(host.as_bytes())?), port))
}

fn port_or(p: Option<&str>, default: Option<u16>) -> Option<u16> {
    match p {
        Some(p) if p.bytes().all(|b| b.is_ascii_digit()) => {
            p.parse::<u16>().ok().filter(|p| *p != 0)
        }
        Some(_) => None,
        None => default,
    }
}

/// A parsed request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestHead {
    pub method: String,
    pub target: String,
    pub headers: Vec<(String, Vec<u8>)>,
    /// Length of the head in the buffer (the body starts there).
    pub len: usize,
}

/// What a buffer holds so far.
#[derive(Debug)]
pub(crate) enum HeadParse {
    Partial,
    Complete(RequestHead),
    Invalid(&'static str),
}

pub(crate) fn parse_head(buf: &[u8]) -> HeadParse {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => HeadParse::Partial,
        Ok(httparse::Status::Complete(len)) => {
            if req.version != Some(1) && req.version != Some(0) {
                return HeadParse::Invalid("unsupported HTTP version");
            }
            let (Some(method), Some(target)) = (req.method, req.path) else {
                return HeadParse::Invalid("incomplete request line");
            };
            HeadParse::Complete(RequestHead {
                method: method.to_string(),
                target: target.to_string(),
                headers: req
                    .headers
                    .iter()
                    .map(|h| (h.name.to_string(), h.value.to_vec()))
                    .collect(),
                len,
            })
        }
        Err(httparse::Error::TooManyHeaders) => HeadParse::Invalid("too many headers"),
        Err(_) => HeadParse::Invalid("malformed HTTP request"),
    }
}

/// Whether the bytes so far could be the start of an HTTP/1 request line.
pub(crate) fn looks_like_http(buf: &[u8]) -> bool {
    let token: Vec<u8> = buf
        .iter()
        .take(8)
        .copied()
        .take_while(|b| *b != b' ')
        .collect();
    !token.is_empty()
        && token.iter().all(u8::is_ascii_uppercase)
        && (buf.len() < 8 || buf[..8].contains(&b' '))
}

impl RequestHead {
    fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// The single `Host` header, parsed.
    fn host(&self, default_port: u16) -> Result<Option<(Dest, u16)>, &'static str> {
        let mut it = self.header_values("host");
        let Some(v) = it.next() else {
            return Ok(None);
        };
        if it.next().is_some() {
            return Err("more than one Host header");
        }
        let v = std::str::from_utf8(v).map_err(|_| "Host header is not ASCII")?;
        parse_authority(v.trim(), Some(default_port))
            .map(Some)
            .ok_or("invalid Host header")
    }

    /// The destination of a request: the absolute URI's authority (which must agree with
    /// `Host` when both exist) or, in origin form, `Host`. Returns the destination, its port and
    /// the origin-form target to send upstream.
    pub(crate) fn destination(
        &self,
        default_port: u16,
    ) -> Result<(Dest, u16, String), &'static str> {
        let lower = self.target.get(..8).map(str::to_ascii_lowercase);
        if lower.as_deref().is_some_and(|l| l.starts_with("https://")) {
            return Err("https:// targets must use CONNECT (no TLS interception)");
        }
        if lower.as_deref().is_some_and(|l| l.starts_with("http://")) {
            let rest = &self.target[7..];
            let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let (auth, path) = rest.split_at(end);
            let (dest, port) = parse_authority(auth, Some(80)).ok_or("invalid request URI")?;
            if let Some((hd, hp)) = self.host(80)? {
                if hd != dest || hp != port {
                    return Err("Host header does not match the request URI");
                }
            }
            let path = match path {
                "" => "/".to_string(),
                p if p.starts_with('/') => p.to_string(),
                p => format!("/{p}"),
            };
            return Ok((dest, port, path));
        }
        if !self.target.starts_with('/') {
            return Err("expected an absolute http:// URI or an origin-form path");
        }
        let (dest, port) = self.host(default_port)?.ok_or("missing Host header")?;
        Ok((dest, port, self.target.clone()))
    }

    /// The head to send upstream: origin-form target, proxy headers stripped, a `Host` added
    /// from the URI when the client sent none, `Connection: close` (one request per upstream
    /// connection).
    pub(crate) fn upstream_head(&self, origin_target: &str, dest: &Dest, port: u16) -> Vec<u8> {
        const HOP: &[&str] = &[
            "connection",
            "proxy-connection",
            "proxy-authorization",
            "keep-alive",
        ];
        let mut out = Vec::with_capacity(self.len + 32);
        out.extend_from_slice(self.method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(origin_target.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        for (n, v) in &self.headers {
            if HOP.iter().any(|h| n.eq_ignore_ascii_case(h)) {
                continue;
            }
            out.extend_from_slice(n.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(v);
            out.extend_from_slice(b"\r\n");
        }
        if self.header_values("host").next().is_none() {
            let host = match (dest, port) {
                (Dest::Ip(std::net::IpAddr::V6(v6)), 80) => format!("[{v6}]"),
                (Dest::Ip(std::net::IpAddr::V6(v6)), p) => format!("[{v6}]:{p}"),
                (d, 80) => d.to_string(),
                (d, p) => format!("{d}:{p}"),
            };
            out.extend_from_slice(format!("Host: {host}\r\n").as_bytes());
        }
        out.extend_from_slice(b"Connection: close\r\n\r\n");
        out
    }
}

/// A minimal response the proxy itself sends.
pub(crate) fn response(status: u16, reason: &str, body: &str, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut s = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in extra {
        // Values come from our own rule texts; keep them on one line whatever they hold.
        let v: String = v.chars().filter(|c| !c.is_control()).collect();
        s.push_str(&format!("{k}: {v}\r\n"));
    }
    s.push_str("\r\n");
    s.push_str(body);
    s.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(s: &str) -> RequestHead {
        match parse_head(s.as_bytes()) {
            HeadParse::Complete(h) => h,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn authorities() {
        let n = |s: &str| Dest::Name(s.into());
        assert_eq!(
            parse_authority("Allowed.Test:8080", None),
            Some((n("allowed.test"), 8080))
        );
        assert_eq!(
            parse_authority("allowed.test", Some(80)),
            Some((n("allowed.test"), 80))
        );
        assert_eq!(parse_authority("allowed.test", None), None);
        assert_eq!(
            parse_authority("127.0.0.1:443", None),
            Some((Dest::Ip("127.0.0.1".parse().unwrap()), 443))
        );
        assert_eq!(
            parse_authority("[::1]:443", None),
            Some((Dest::Ip("::1".parse().unwrap()), 443))
        );
        for bad in [
            "user@allowed.test:80",
            "allowed.test:0",
            "allowed.test:65536",
            "allowed.test:",
            "[127.0.0.1]:80",
            "2130706433:80",
            "0x7f.1:80",
            "127.1:80",
            "a b:80",
            "::1:80",
            "",
        ] {
            assert_eq!(parse_authority(bad, Some(80)), None, "{bad}");
        }
    }

    #[test]
    fn absolute_uri_and_host_must_agree() {
        let h =
            head("GET http://allowed.test:8080/x?y HTTP/1.1\r\nHost: allowed.test:8080\r\n\r\n");
        let (d, p, path) = h.destination(80).unwrap();
        assert_eq!(
            (d, p, path.as_str()),
            (Dest::Name("allowed.test".into()), 8080, "/x?y")
        );
        let h = head("GET http://allowed.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n");
        assert!(h.destination(80).is_err());
        let h = head("GET http://allowed.test HTTP/1.1\r\n\r\n");
        assert_eq!(h.destination(80).unwrap().2, "/");
        let h = head("GET https://allowed.test/ HTTP/1.1\r\n\r\n");
        assert!(h.destination(80).is_err());
        let h = head("GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n");
        assert!(h.destination(80).is_err());
        let h = head("GET / HTTP/1.1\r\nHost: a.test\r\n\r\n");
        assert_eq!(h.destination(8000).unwrap().1, 8000);
        let h = head("GET / HTTP/1.1\r\n\r\n");
        assert!(h.destination(80).is_err());
    }

    #[test]
    fn upstream_head_strips_proxy_headers() {
        let raw = "POST http://a.test/p HTTP/1.1\r\nHost: a.test\r\nProxy-Authorization: x\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nhi";
        let h = head(raw);
        let out =
            String::from_utf8(h.upstream_head("/p", &Dest::Name("a.test".into()), 80)).unwrap();
        assert_eq!(
            out,
            "POST /p HTTP/1.1\r\nHost: a.test\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
        );
        assert_eq!(h.len, raw.len() - 2, "the body starts after the head");
        let h = head("GET http://a.test:8080/ HTTP/1.1\r\n\r\n");
        let out =
            String::from_utf8(h.upstream_head("/", &Dest::Name("a.test".into()), 8080)).unwrap();
        assert_eq!(
            out,
            "GET / HTTP/1.1\r\nHost: a.test:8080\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn sniffing_and_garbage() {
        assert!(looks_like_http(b"GET / HT"));
        assert!(looks_like_http(b"CONN"));
        assert!(!looks_like_http(b"\x16\x03\x01"));
        assert!(!looks_like_http(b"SSH-2.0-OpenSSH"));
        assert!(!looks_like_http(b""));
        assert!(matches!(
            parse_head(b"GET / HTTP/1.1\r\nHost"),
            HeadParse::Partial
        ));
        assert!(matches!(
            parse_head(b"\x00\x01 garbage\r\n\r\n"),
            HeadParse::Invalid(_)
        ));
    }
}
