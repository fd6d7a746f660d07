//! Proxy-held secrets: the sandbox holds a placeholder, the proxy swaps in the real value on
//! the way to the hosts the secret is bound to, and swaps it back out of their answers.
//!
//! This module is the substitution engine, independent of transport: a [`SecretSet`] per
//! sandbox, built from [`ProxySecret`]s, rewrites a request's head and (bounded) body for one
//! destination, refuses a request that carries a placeholder to a host it is not bound to
//! ([`LeakAttempt`]), and gives a [`ResponseMasker`] that replaces the real value with the
//! placeholder in a response stream, matches split across reads included.
//!
//! # Where a placeholder is replaced
//! - the request target (path and query string) of the request line;
//! - every header value (`Authorization: Bearer …`, `Cookie`, custom headers), including
//!   `Authorization`/`Proxy-Authorization: Basic` credentials, which are base64-decoded,
//!   substituted (`user:placeholder` → `user:value`) and encoded again;
//! - bodies given to [`SecretSet::rewrite_body`] (the caller bounds what it buffers and
//!   streams larger bodies unchanged).
//!
//! Header names are never rewritten. What is replaced is reported as [`Substitution`]s (the
//! secret's name and where, never a value) for the audit log.
//!
//! # Placeholders
//! A placeholder is **as long as the value** it stands for, so that replacing one by the other
//! never changes a length: `Content-Length`, chunk sizes and Basic credentials' base64 stay
//! valid, and a response can be masked as it streams. It is `AGSB_` followed by random
//! letters and digits (62 symbols, from the operating system's random source) when the value
//! has at least 16 bytes, and random letters and digits only for shorter values: unguessable,
//! unique per sandbox and per secret, made only of characters every header, URL and shell
//! accepts unquoted. Values shorter than [`MIN_VALUE_LEN`] bytes are refused: masking them in
//! responses would mangle ordinary text, and their placeholders would be guessable.

use std::fmt;

use base64::Engine as _;
use sandbox_core::{HostRule, Secret};

/// The prefix of the placeholders of values of at least 16 bytes.
pub const PLACEHOLDER_PREFIX: &str = "AGSB_";
/// The shortest secret value the proxy holds (shorter ones would be masked inside unrelated
/// text of responses).
pub const MIN_VALUE_LEN: usize = 8;

/// Why a secret cannot be held by the proxy.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    /// The value is too short to mask reliably.
    #[error("secret `{name}`: its value is {len} bytes; a proxy-held secret needs at least {MIN_VALUE_LEN}")]
    TooShort {
        /// The secret's name.
        name: String,
        /// Its length.
        len: usize,
    },
    /// The value cannot travel in an HTTP header (a CR, LF or NUL byte).
    #[error("secret `{name}`: its value holds a CR, LF or NUL byte, which no header may carry")]
    BadByte {
        /// The secret's name.
        name: String,
    },
    /// No host is bound: the value could never be used.
    #[error("secret `{name}`: no host is bound to it")]
    NoHosts {
        /// The secret's name.
        name: String,
    },
    /// The operating system's random source failed.
    #[error("no random bytes for a placeholder: {0}")]
    Random(String),
}

/// One secret held by the proxy for one sandbox.
#[derive(Clone)]
pub struct ProxySecret {
    name: String,
    placeholder: String,
    value: Secret,
    hosts: Vec<HostRule>,
}

impl fmt::Debug for ProxySecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the value; the placeholder is what the sandbox sees anyway.
        f.debug_struct("ProxySecret")
            .field("name", &self.name)
            .field("placeholder", &self.placeholder)
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

impl ProxySecret {
    /// Holds `value` for the hosts `hosts`, with a fresh random placeholder.
    ///
    /// # Errors
    /// [`SecretError`] for a value that is too short or cannot be a header, no hosts, or no
    /// randomness.
    pub fn new(
        name: impl Into<String>,
        value: Secret,
        hosts: Vec<HostRule>,
    ) -> Result<Self, SecretError> {
        let name = name.into();
        let v = value.expose();
        if v.len() < MIN_VALUE_LEN {
            return Err(SecretError::TooShort { name, len: v.len() });
        }
        if v.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
            return Err(SecretError::BadByte { name });
        }
        if hosts.is_empty() {
            return Err(SecretError::NoHosts { name });
        }
        let placeholder = placeholder_for(v.len())?;
        Ok(ProxySecret {
            name,
            placeholder,
            value,
            hosts,
        })
    }

    /// The secret's name (for the audit log).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the sandbox holds instead of the value.
    pub fn placeholder(&self) -> &str {
        &self.placeholder
    }

    /// The hosts the value goes to.
    pub fn hosts(&self) -> &[HostRule] {
        &self.hosts
    }

    /// Whether the value goes to `host:port`.
    pub fn binds(&self, host: &str, port: u16) -> bool {
        self.hosts.iter().any(|h| h.matches(host, port))
    }
}

/// A random placeholder of `len` bytes (see the module docs).
fn placeholder_for(len: usize) -> Result<String, SecretError> {
    const ALPHABET: &[u8; 62] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let prefix = if len >= 16 { PLACEHOLDER_PREFIX } else { "" };
    let mut out = String::with_capacity(len);
    out.push_str(prefix);
    let mut random = [0u8; 64];
    while out.len() < len {
        getrandom::fill(&mut random).map_err(|e| SecretError::Random(e.to_string()))?;
        // Rejection sampling: 248 = 4 × 62, so every symbol is equally likely.
        for b in random.iter().filter(|b| **b < 248) {
            if out.len() == len {
                break;
            }
            out.push(char::from(ALPHABET[usize::from(*b % 62)]));
        }
    }
    Ok(out)
}

/// Where in a request a placeholder was replaced (or found).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Place {
    /// The request target (path or query string).
    Target,
    /// A header's value, by the header's name as sent (lowercased).
    Header(String),
    /// A header's Basic credentials (`Authorization: Basic …`), by the header's name.
    BasicCredentials(String),
    /// The body.
    Body,
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Place::Target => f.write_str("request target"),
            Place::Header(h) => write!(f, "header {h}"),
            Place::BasicCredentials(h) => write!(f, "header {h} (basic credentials)"),
            Place::Body => f.write_str("body"),
        }
    }
}

/// One replacement, for the audit log: which secret, where. Never the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Substitution {
    /// The secret's name.
    pub secret: String,
    /// Where it was replaced.
    pub place: Place,
}

/// A placeholder on its way to a host it is not bound to: the request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the placeholder of secret `{secret}` in the {place}, sent to {host}:{port}, which it is \
     not bound to"
)]
pub struct LeakAttempt {
    /// The secret's name.
    pub secret: String,
    /// Where the placeholder was.
    pub place: Place,
    /// The destination's name (or address).
    pub host: String,
    /// The destination's port.
    pub port: u16,
}

/// A request head rewritten for one destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewritten {
    /// The head, with every placeholder bound to the destination replaced by its value.
    pub head: Vec<u8>,
    /// What was replaced.
    pub substitutions: Vec<Substitution>,
}

/// The secrets the proxy holds for one sandbox.
#[derive(Debug, Clone, Default)]
pub struct SecretSet {
    secrets: Vec<ProxySecret>,
}

impl SecretSet {
    /// A set of these secrets.
    pub fn new(secrets: Vec<ProxySecret>) -> Self {
        SecretSet { secrets }
    }

    /// The secrets.
    pub fn secrets(&self) -> &[ProxySecret] {
        &self.secrets
    }

    /// Whether the set holds nothing.
    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    /// Whether any secret is bound to `host:port` (the proxy terminates TLS only for those).
    pub fn binds_any(&self, host: &str, port: u16) -> bool {
        self.secrets.iter().any(|s| s.binds(host, port))
    }

    /// The first placeholder found in `data`, if any (by the secret's name).
    pub fn find_placeholder(&self, data: &[u8]) -> Option<&str> {
        self.secrets
            .iter()
            .find(|s| find(data, s.placeholder.as_bytes()).is_some())
            .map(|s| s.name.as_str())
    }

    /// Where a request carries a placeholder, whatever its destination: the first one found
    /// in `head` (the request line, then each header, Basic credentials decoded), then in
    /// `body`. By the secret's name. For requests that no secret may travel in at all (a
    /// `CONNECT` is addressed to the proxy itself) and for unbound destinations.
    pub fn locate(&self, head: &[u8], body: &[u8]) -> Option<(&str, Place)> {
        if self.secrets.is_empty() {
            return None;
        }
        let mut lines = split_lines(head).into_iter();
        if let Some((line, _)) = lines.next() {
            if let Some(name) = self.find_placeholder(line) {
                return Some((name, Place::Target));
            }
        }
        for (line, _) in lines {
            let Some(colon) = line.iter().position(|b| *b == b':') else {
                continue;
            };
            let lname = String::from_utf8_lossy(&line[..colon])
                .trim()
                .to_ascii_lowercase();
            let value = value_or(line, colon);
            if let Some(name) = self.find_placeholder(value) {
                return Some((name, Place::Header(lname)));
            }
            if let Some((_, decoded)) = basic_credentials(value) {
                if let Some(name) = self.find_placeholder(&decoded) {
                    return Some((name, Place::BasicCredentials(lname)));
                }
            }
        }
        self.find_placeholder(body).map(|name| (name, Place::Body))
    }

    /// [`locate`](Self::locate) as the [`LeakAttempt`] of sending the request to
    /// `host:port`.
    pub fn leak_attempt(
        &self,
        head: &[u8],
        body: &[u8],
        host: &str,
        port: u16,
    ) -> Option<LeakAttempt> {
        self.locate(head, body).map(|(secret, place)| LeakAttempt {
            secret: secret.to_owned(),
            place,
            host: host.to_owned(),
            port,
        })
    }

    /// Rewrites a request head (`METHOD target VERSION\r\n` and header lines, the blank line
    /// included or not) for a request to `host:port`: every placeholder of a secret bound
    /// there is replaced by its value.
    ///
    /// # Errors
    /// [`LeakAttempt`] when the head carries a placeholder of a secret that is **not** bound to
    /// `host:port` (nothing is sent then).
    pub fn rewrite_head(
        &self,
        host: &str,
        port: u16,
        head: &[u8],
    ) -> Result<Rewritten, LeakAttempt> {
        let mut out = Vec::with_capacity(head.len() + 64);
        let mut subs = Vec::new();
        let mut lines = split_lines(head).into_iter();
        if let Some((line, eol)) = lines.next() {
            out.extend_from_slice(&self.rewrite_field(
                host,
                port,
                line,
                Place::Target,
                &mut subs,
            )?);
            out.extend_from_slice(eol);
        }
        for (line, eol) in lines {
            let Some(colon) = line.iter().position(|b| *b == b':') else {
                out.extend_from_slice(line);
                out.extend_from_slice(eol);
                continue;
            };
            let (name, value) = (&line[..colon], &line[colon + 1..]);
            let lname = String::from_utf8_lossy(name).trim().to_ascii_lowercase();
            let value = if matches!(lname.as_str(), "authorization" | "proxy-authorization") {
                self.rewrite_basic(host, port, &lname, value, &mut subs)?
            } else {
                None
            };
            let value = match value {
                Some(v) => v,
                None => self.rewrite_field(
                    host,
                    port,
                    value_or(line, colon),
                    Place::Header(lname),
                    &mut subs,
                )?,
            };
            out.extend_from_slice(name);
            out.push(b':');
            out.extend_from_slice(&value);
            out.extend_from_slice(eol);
        }
        Ok(Rewritten {
            head: out,
            substitutions: subs,
        })
    }

    /// Rewrites a (whole, buffered) request body for `host:port`, as
    /// [`rewrite_head`](Self::rewrite_head) does the head.
    ///
    /// # Errors
    /// [`LeakAttempt`] as for the head.
    pub fn rewrite_body(
        &self,
        host: &str,
        port: u16,
        body: &[u8],
    ) -> Result<(Vec<u8>, Vec<Substitution>), LeakAttempt> {
        let mut subs = Vec::new();
        let out = self.rewrite_field(host, port, body, Place::Body, &mut subs)?;
        Ok((out, subs))
    }

    /// A masker for responses from `host:port`: the values of the secrets bound there are
    /// replaced by their placeholders.
    pub fn masker(&self, host: &str, port: u16) -> ResponseMasker {
        ResponseMasker::new(
            self.secrets
                .iter()
                .filter(|s| s.binds(host, port))
                .map(|s| {
                    (
                        s.value.expose().as_bytes().to_vec(),
                        s.placeholder.as_bytes().to_vec(),
                    )
                })
                .collect(),
        )
    }

    fn rewrite_field(
        &self,
        host: &str,
        port: u16,
        field: &[u8],
        place: Place,
        subs: &mut Vec<Substitution>,
    ) -> Result<Vec<u8>, LeakAttempt> {
        let mut out = field.to_vec();
        for s in &self.secrets {
            if find(&out, s.placeholder.as_bytes()).is_none() {
                continue;
            }
            if !s.binds(host, port) {
                return Err(LeakAttempt {
                    secret: s.name.clone(),
                    place,
                    host: host.to_owned(),
                    port,
                });
            }
            out = replace_all(&out, s.placeholder.as_bytes(), s.value.expose().as_bytes());
            subs.push(Substitution {
                secret: s.name.clone(),
                place: place.clone(),
            });
        }
        Ok(out)
    }

    /// `Basic <base64(user:password)>` with a placeholder inside: decoded, rewritten and
    /// encoded again. `None` when the value is not Basic credentials holding a placeholder.
    fn rewrite_basic(
        &self,
        host: &str,
        port: u16,
        header: &str,
        value: &[u8],
        subs: &mut Vec<Substitution>,
    ) -> Result<Option<Vec<u8>>, LeakAttempt> {
        let Some((scheme, decoded)) = basic_credentials(value) else {
            return Ok(None);
        };
        if self.find_placeholder(&decoded).is_none() {
            return Ok(None);
        }
        let plain = self.rewrite_field(
            host,
            port,
            &decoded,
            Place::BasicCredentials(header.to_owned()),
            subs,
        )?;
        let encoded = base64::engine::general_purpose::STANDARD.encode(plain);
        Ok(Some(format!(" {scheme} {encoded}").into_bytes()))
    }
}

/// Replaces each secret's value by its placeholder in a response, chunk by chunk; a value
/// split across chunks is still found. Only a chunk's tail that could still become a value
/// (a proper prefix of one) is held back, until the next chunk, [`flush`](Self::flush) or
/// [`finish`](Self::finish); everything else is passed on at once.
///
/// It masks whole values only: a server that echoes part of a value reveals that part.
///
/// On the hot path of every intercepted download: values are searched with prebuilt
/// `memmem` finders (SIMD where the CPU has it), and [`push_into`](Self::push_into) appends
/// to the caller's buffer, so a chunk without a value costs one search per secret and one
/// copy.
pub struct ResponseMasker {
    pairs: Vec<Pair>,
    carry: Vec<u8>,
    hold: usize,
    masked: u64,
}

/// One value and the placeholder it becomes.
struct Pair {
    value: memchr::memmem::Finder<'static>,
    placeholder: Vec<u8>,
}

impl Pair {
    fn value(&self) -> &[u8] {
        self.value.needle()
    }
}

impl fmt::Debug for ResponseMasker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the values.
        f.debug_struct("ResponseMasker")
            .field("secrets", &self.pairs.len())
            .field("holding", &self.carry.len())
            .field("masked", &self.masked)
            .finish()
    }
}

impl ResponseMasker {
    fn new(pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        let pairs: Vec<Pair> = pairs
            .into_iter()
            .filter(|(v, _)| !v.is_empty())
            .map(|(v, p)| Pair {
                value: memchr::memmem::Finder::new(&v).into_owned(),
                placeholder: p,
            })
            .collect();
        let hold = pairs
            .iter()
            .map(|p| p.value().len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        ResponseMasker {
            pairs,
            carry: Vec::new(),
            hold,
            masked: 0,
        }
    }

    /// Whether it masks anything (no bound secret: bytes pass through as they are).
    pub fn is_active(&self) -> bool {
        !self.pairs.is_empty()
    }

    /// How many values it replaced so far.
    pub fn masked(&self) -> u64 {
        self.masked
    }

    /// The next chunk: what may be sent on now (possibly less than was pushed).
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(chunk.len() + self.carry.len());
        self.push_into(chunk, &mut out);
        out
    }

    /// [`push`](Self::push), appending what may be sent on now to `out`.
    pub fn push_into(&mut self, chunk: &[u8], out: &mut Vec<u8>) {
        if self.pairs.is_empty() {
            out.extend_from_slice(chunk);
            return;
        }
        if self.carry.is_empty() {
            let kept = self.mask(chunk, out);
            self.carry.extend_from_slice(&chunk[chunk.len() - kept..]);
        } else {
            // A held tail: searched together with the new bytes (it is shorter than a value,
            // so this copy is small unless the chunks are).
            let mut buf = std::mem::take(&mut self.carry);
            buf.extend_from_slice(chunk);
            let kept = self.mask(&buf, out);
            buf.drain(..buf.len() - kept);
            self.carry = buf;
        }
    }

    /// Appends `buf` to `out` with every value replaced, except a tail that could still
    /// become a value; returns that tail's length.
    fn mask(&mut self, buf: &[u8], out: &mut Vec<u8>) -> usize {
        let mut i = 0;
        // Each value's next match at or after `i` (`None`: no more in `buf`).
        let mut next: Vec<Option<usize>> = self.pairs.iter().map(|p| p.value.find(buf)).collect();
        loop {
            // The earliest match; the longest value where two start together.
            let best = next
                .iter()
                .enumerate()
                .filter_map(|(k, at)| at.map(|at| (at, k)))
                .min_by_key(|(at, k)| (*at, usize::MAX - self.pairs[*k].value().len()));
            let Some((at, k)) = best else {
                break;
            };
            out.extend_from_slice(&buf[i..at]);
            out.extend_from_slice(&self.pairs[k].placeholder);
            self.masked += 1;
            i = at + self.pairs[k].value().len();
            for (p, n) in self.pairs.iter().zip(next.iter_mut()) {
                if n.is_some_and(|n| n < i) {
                    *n = p.value.find(&buf[i..]).map(|x| x + i);
                }
            }
        }
        // Held back: only a tail that could still become a value (a proper prefix of one).
        let rest = &buf[i..];
        let keep = (1..=self.hold.min(rest.len()))
            .rev()
            .find(|k| {
                let tail = &rest[rest.len() - k..];
                self.pairs.iter().any(|p| p.value().starts_with(tail))
            })
            .unwrap_or(0);
        out.extend_from_slice(&rest[..rest.len() - keep]);
        keep
    }

    /// The end of the response: what was held back.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.carry)
    }

    /// Whether bytes are held back, waiting to see if a value follows.
    pub fn holding(&self) -> bool {
        !self.carry.is_empty()
    }

    /// Gives up waiting (no more bytes came for a while): what was held back, as it is. It
    /// is a proper prefix of a value at most, never a whole one.
    pub fn flush(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.carry)
    }
}

/// `Basic <base64>` credentials, decoded, with the scheme as written.
fn basic_credentials(value: &[u8]) -> Option<(String, Vec<u8>)> {
    let text = String::from_utf8_lossy(value);
    let (scheme, cred) = text.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(cred.trim())
        .ok()?;
    Some((scheme.to_owned(), decoded))
}

fn value_or(line: &[u8], colon: usize) -> &[u8] {
    line.get(colon + 1..).unwrap_or_default()
}

/// Lines with their terminators (`\r\n`, `\n`, or empty for the last unterminated one).
fn split_lines(data: &[u8]) -> Vec<(&[u8], &[u8])> {
    let mut v = Vec::new();
    let mut start = 0;
    while start < data.len() {
        match data[start..].iter().position(|b| *b == b'\n') {
            Some(nl) => {
                let end = start + nl;
                let (line, eol) = if end > start && data[end - 1] == b'\r' {
                    (&data[start..end - 1], &data[end - 1..=end])
                } else {
                    (&data[start..end], &data[end..=end])
                };
                v.push((line, eol));
                start = end + 1;
            }
            None => {
                v.push((&data[start..], &data[data.len()..]));
                break;
            }
        }
    }
    v
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    memchr::memmem::find(hay, needle)
}

fn replace_all(hay: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len());
    let mut i = 0;
    while let Some(at) = find(&hay[i..], from) {
        out.extend_from_slice(&hay[i..i + at]);
        out.extend_from_slice(to);
        i += at + from.len();
    }
    out.extend_from_slice(&hay[i..]);
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const VALUE: &str = "ghp_realTOKENvalue0123456789";

    fn set() -> (SecretSet, String) {
        let s = ProxySecret::new(
            "GITHUB_TOKEN",
            Secret::new(VALUE),
            vec![
                "api.github.com".parse().unwrap(),
                "*.githubusercontent.com".parse().unwrap(),
            ],
        )
        .unwrap();
        let p = s.placeholder().to_string();
        (SecretSet::new(vec![s]), p)
    }

    #[test]
    fn placeholders_are_random_plain_and_as_long_as_the_value() {
        let (a, pa) = set();
        let (_, pb) = set();
        assert_ne!(pa, pb);
        assert!(pa.starts_with(PLACEHOLDER_PREFIX));
        assert_eq!(pa.len(), VALUE.len());
        assert!(pa.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
        // Short values: all random, same length.
        let short = ProxySecret::new(
            "P",
            Secret::new("hunter22"),
            vec!["example.com".parse().unwrap()],
        )
        .unwrap();
        assert_eq!(short.placeholder().len(), 8);
        assert!(short
            .placeholder()
            .bytes()
            .all(|b| b.is_ascii_alphanumeric()));
        // Debug never shows the value.
        assert!(!format!("{a:?}").contains(VALUE));
    }

    #[test]
    fn bad_secrets_are_refused() {
        let h = || vec!["example.com".parse().unwrap()];
        assert!(matches!(
            ProxySecret::new("S", Secret::new("short"), h()),
            Err(SecretError::TooShort { len: 5, .. })
        ));
        assert!(matches!(
            ProxySecret::new("S", Secret::new("long enough\r\nX-Evil: 1"), h()),
            Err(SecretError::BadByte { .. })
        ));
        assert!(matches!(
            ProxySecret::new("S", Secret::new("long enough"), vec![]),
            Err(SecretError::NoHosts { .. })
        ));
    }

    #[test]
    fn headers_query_and_cookies_are_substituted_for_a_bound_host() {
        let (s, p) = set();
        let head = format!(
            "GET /repos?access_token={p}&x=1 HTTP/1.1\r\nHost: api.github.com\r\n\
             Authorization: Bearer {p}\r\nCookie: a=1; tok={p}\r\nX-Other: plain\r\n\r\n"
        );
        let r = s
            .rewrite_head("api.github.com", 443, head.as_bytes())
            .unwrap();
        let out = String::from_utf8(r.head).unwrap();
        assert_eq!(
            out,
            format!(
                "GET /repos?access_token={VALUE}&x=1 HTTP/1.1\r\nHost: api.github.com\r\n\
                 Authorization: Bearer {VALUE}\r\nCookie: a=1; tok={VALUE}\r\nX-Other: plain\r\n\r\n"
            )
        );
        let places: Vec<String> = r
            .substitutions
            .iter()
            .map(|s| s.place.to_string())
            .collect();
        assert_eq!(
            places,
            ["request target", "header authorization", "header cookie"]
        );
        assert!(r.substitutions.iter().all(|x| x.secret == "GITHUB_TOKEN"));
        // A wildcard binding.
        assert!(s
            .rewrite_head("raw.githubusercontent.com", 443, head.as_bytes())
            .is_ok());
    }

    #[test]
    fn basic_credentials_are_decoded_substituted_and_encoded() {
        let (s, p) = set();
        let b64 = base64::engine::general_purpose::STANDARD;
        let head = format!(
            "GET /repo.git/info/refs HTTP/1.1\r\nAuthorization: Basic {}\r\n\r\n",
            b64.encode(format!("x-access-token:{p}"))
        );
        let r = s
            .rewrite_head("api.github.com", 443, head.as_bytes())
            .unwrap();
        let out = String::from_utf8(r.head).unwrap();
        let cred = out
            .lines()
            .find_map(|l| l.strip_prefix("Authorization: Basic "))
            .unwrap();
        assert_eq!(
            b64.decode(cred).unwrap(),
            format!("x-access-token:{VALUE}").into_bytes()
        );
        assert_eq!(
            r.substitutions[0].place,
            Place::BasicCredentials("authorization".into())
        );
        // To another host, the hidden placeholder is still found.
        let e = s
            .rewrite_head("attacker.example", 443, head.as_bytes())
            .unwrap_err();
        assert_eq!(e.place, Place::BasicCredentials("authorization".into()));
    }

    #[test]
    fn a_placeholder_to_an_unbound_host_is_a_leak_attempt() {
        let (s, p) = set();
        for head in [
            format!("GET /?t={p} HTTP/1.1\r\nHost: evil.example\r\n\r\n"),
            format!("POST / HTTP/1.1\r\nX-Exfil: {p}\r\n\r\n"),
        ] {
            let e = s
                .rewrite_head("evil.example", 80, head.as_bytes())
                .unwrap_err();
            assert_eq!(e.secret, "GITHUB_TOKEN");
            assert!(e.to_string().contains("evil.example:80"), "{e}");
            assert!(!e.to_string().contains(VALUE));
        }
        // The right name on the wrong port is another destination.
        let bound_port: SecretSet = SecretSet::new(vec![ProxySecret::new(
            "T",
            Secret::new(VALUE),
            vec!["api.example:443".parse().unwrap()],
        )
        .unwrap()]);
        let p2 = bound_port.secrets()[0].placeholder().to_string();
        let head = format!("GET /?t={p2} HTTP/1.1\r\n\r\n");
        assert!(bound_port
            .rewrite_head("api.example", 8443, head.as_bytes())
            .is_err());
        assert!(bound_port
            .rewrite_head("api.example", 443, head.as_bytes())
            .is_ok());
        // A body too.
        let e = s
            .rewrite_body("evil.example", 443, format!("{{\"k\":\"{p}\"}}").as_bytes())
            .unwrap_err();
        assert_eq!(e.place, Place::Body);
        // Nothing to see: unchanged, no substitutions.
        let plain = b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n";
        let r = s.rewrite_head("evil.example", 80, plain).unwrap();
        assert_eq!(r.head, plain);
        assert!(r.substitutions.is_empty());
    }

    #[test]
    fn a_placeholder_is_located_precisely_whatever_the_destination() {
        let (s, p) = set();
        let b64 = base64::engine::general_purpose::STANDARD;
        let cases = [
            (
                format!("CONNECT {p}.evil.example:443 HTTP/1.1\r\n\r\n"),
                "",
                Place::Target,
            ),
            (
                format!("GET / HTTP/1.1\r\nHost: x\r\nX-Exfil: a{p}b\r\n\r\n"),
                "",
                Place::Header("x-exfil".into()),
            ),
            (
                format!(
                    "GET / HTTP/1.1\r\nProxy-Authorization: Basic {}\r\n\r\n",
                    b64.encode(format!("u:{p}"))
                ),
                "",
                Place::BasicCredentials("proxy-authorization".into()),
            ),
            (
                "POST / HTTP/1.1\r\n\r\n".to_string(),
                p.as_str(),
                Place::Body,
            ),
        ];
        for (head, body, want) in cases {
            let (name, place) = s.locate(head.as_bytes(), body.as_bytes()).unwrap();
            assert_eq!((name, &place), ("GITHUB_TOKEN", &want), "{head}");
            // Even to a bound host: what `locate` reports does not depend on one.
            let l = s
                .leak_attempt(head.as_bytes(), body.as_bytes(), "api.github.com", 443)
                .unwrap();
            assert_eq!(
                (l.host.as_str(), l.port, l.place),
                ("api.github.com", 443, want)
            );
        }
        assert!(s
            .locate(b"GET / HTTP/1.1\r\nAuthorization: Basic !!\r\n\r\n", b"x")
            .is_none());
    }

    #[test]
    fn values_are_masked_with_several_secrets_overlapping_and_repeated() {
        let a = ProxySecret::new(
            "A",
            Secret::new("abcdefgh12345678"),
            vec!["h.example".parse().unwrap()],
        )
        .unwrap();
        // B's value starts inside A's.
        let b = ProxySecret::new(
            "B",
            Secret::new("12345678zzzzzzzz"),
            vec!["h.example".parse().unwrap()],
        )
        .unwrap();
        let (pa, pb) = (a.placeholder().to_owned(), b.placeholder().to_owned());
        let set = SecretSet::new(vec![a, b]);
        let text = "x abcdefgh12345678zzzzzzzz 12345678zzzzzzzz abcdefgh12345678abcdefgh12345678";
        // A wins where it starts first; B's own occurrences are still found after it.
        let want = format!("x {pa}zzzzzzzz {pb} {pa}{pa}");
        for split in 0..text.len() {
            let mut m = set.masker("h.example", 443);
            let mut out = Vec::new();
            m.push_into(&text.as_bytes()[..split], &mut out);
            m.push_into(&text.as_bytes()[split..], &mut out);
            out.extend(m.finish());
            assert_eq!(String::from_utf8(out).unwrap(), want, "split at {split}");
            assert_eq!(m.masked(), 4);
        }
    }

    #[test]
    fn bodies_are_substituted_and_keep_their_length() {
        let (s, p) = set();
        let body = format!("{{\"token\":\"{p}\",\"again\":\"{p}\"}}");
        let (out, subs) = s
            .rewrite_body("api.github.com", 443, body.as_bytes())
            .unwrap();
        assert_eq!(
            String::from_utf8(out.clone()).unwrap(),
            format!("{{\"token\":\"{VALUE}\",\"again\":\"{VALUE}\"}}")
        );
        assert_eq!(subs.len(), 1);
        // Same length: the request's framing stays valid.
        assert_eq!(out.len(), body.len());
    }

    #[test]
    fn echoed_values_are_masked_even_split_across_reads() {
        let (s, p) = set();
        let response = format!("{{\"echo\":\"Bearer {VALUE}\",\"twice\":\"{VALUE}{VALUE}\"}}");
        let want = format!("{{\"echo\":\"Bearer {p}\",\"twice\":\"{p}{p}\"}}");
        // Every split into up to three chunks.
        let bytes = response.as_bytes();
        for a in 0..bytes.len() {
            for b in [a, (a + 7).min(bytes.len()), bytes.len()] {
                let mut m = s.masker("api.github.com", 443);
                let mut out = m.push(&bytes[..a]);
                out.extend(m.push(&bytes[a..b]));
                out.extend(m.push(&bytes[b..]));
                out.extend(m.finish());
                assert_eq!(String::from_utf8(out).unwrap(), want, "split at {a},{b}");
                assert_eq!(m.masked(), 3);
            }
        }
        // One byte at a time.
        let mut m = s.masker("api.github.com", 443);
        let mut out = Vec::new();
        for b in bytes {
            out.extend(m.push(std::slice::from_ref(b)));
        }
        out.extend(m.finish());
        assert_eq!(String::from_utf8(out).unwrap(), want);
        // Text that cannot begin a value is never held back.
        let mut m = s.masker("api.github.com", 443);
        assert_eq!(m.push(b"plain text, ends here"), b"plain text, ends here");
        assert!(!m.holding());
        // A tail that could: held, then given up on.
        assert_eq!(m.push(b"then ghp_re"), b"then ");
        assert!(m.holding());
        assert_eq!(m.flush(), b"ghp_re");
        // Another host's response is not touched (its secrets are not bound there).
        let mut m = s.masker("other.example", 443);
        assert!(!m.is_active());
        assert_eq!(m.push(bytes), bytes);
    }
}
