//! The [`SecretSet`] of one sandbox: where a request carries placeholders, its head and body
//! rewritten for one destination, and the [`ResponseMasker`]s for the answers.

use std::sync::{Arc, Mutex};

use base64::Engine as _;

use super::mask::{masked_forms, Masks};
use super::*;

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
