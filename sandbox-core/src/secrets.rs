//! Secrets: named in the spec, resolved from a [`SecretSource`] at create time, never logged,
//! and redacted from captured output.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A secret value. `Debug` and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value. Call only where it is handed to the sandbox or a host tool.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        // Overwrite the bytes (the whole allocation) before it is freed, with writes the
        // compiler may not optimise away.
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

/// How a secret reaches the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum SecretExposure {
    /// As this environment variable of every command.
    Env {
        /// The variable name.
        var: String,
    },
    /// Never inside the sandbox: only host-side tools (host functions, the egress proxy) see it.
    HostOnly,
    /// Held by the egress proxy: the environment variable `var` holds a random placeholder
    /// (unique per sandbox, as long as the value), which the proxy replaces by the value in
    /// requests to `hosts` only, in the parts of a request `substitute_in` names (by default
    /// header values, Basic credentials included; the request target and bodies up to a
    /// bound only when granted), and puts back over the value (and its base64, hex and
    /// percent-encoded forms) in their responses. TLS to those hosts is terminated by the
    /// proxy, whose per-process CA the sandbox trusts. `hosts` use the patterns of
    /// [`NetworkPolicy`](crate::NetworkPolicy) and must be allowed by the spec's policy. See
    /// `docs/network.md`, "Secrets the sandbox never holds".
    Proxy {
        /// The variable holding the placeholder.
        var: String,
        /// Where the value goes (names, `*.suffix` wildcards, optional `:port`).
        hosts: Vec<crate::HostRule>,
        /// Where in a request the placeholder is replaced. Absent in JSON (as written before
        /// this field existed): headers only ([`SecretPlaces::default`]).
        #[serde(default, skip_serializing_if = "SecretPlaces::is_default")]
        substitute_in: SecretPlaces,
    },
}

/// Where in a request to a bound host the egress proxy replaces a proxy-held secret's
/// placeholder by its value ([`SecretExposure::Proxy`]).
///
/// The default is **headers only** (every header value, `Authorization: Basic` credentials
/// decoded and encoded again). The request target and the body are opt-in: a value
/// substituted there is often *stored* by the server (a query parameter logged, a body
/// saved) and can then be read back transformed (base64, reversed, encrypted), which no
/// masking of responses can catch. Written as a comma-separated list (`header,query,body`),
/// and in JSON as a list of those words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct SecretPlaces {
    /// Header values, Basic credentials included.
    pub headers: bool,
    /// The request target: path and query string.
    pub query: bool,
    /// Bodies (with a `Content-Length`, up to the proxy's bound).
    pub body: bool,
}

impl Default for SecretPlaces {
    fn default() -> Self {
        SecretPlaces::HEADERS
    }
}

impl SecretPlaces {
    /// Headers only (the default).
    pub const HEADERS: SecretPlaces = SecretPlaces {
        headers: true,
        query: false,
        body: false,
    };
    /// Headers, the request target and bodies.
    pub const ALL: SecretPlaces = SecretPlaces {
        headers: true,
        query: true,
        body: true,
    };

    /// Whether this is the default (headers only).
    pub fn is_default(&self) -> bool {
        *self == SecretPlaces::HEADERS
    }

    /// Whether nothing is granted (the placeholder is then never replaced).
    pub fn is_empty(&self) -> bool {
        !(self.headers || self.query || self.body)
    }

    fn words(&self) -> Vec<&'static str> {
        [
            (self.headers, "header"),
            (self.query, "query"),
            (self.body, "body"),
        ]
        .into_iter()
        .filter_map(|(on, w)| on.then_some(w))
        .collect()
    }
}

impl fmt::Display for SecretPlaces {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.words().join(","))
    }
}

impl std::str::FromStr for SecretPlaces {
    type Err = Error;

    /// `header,query,body` (any of them, at least one; `headers` and `target` are accepted
    /// for `header` and `query`).
    fn from_str(s: &str) -> Result<Self> {
        let mut p = SecretPlaces {
            headers: false,
            query: false,
            body: false,
        };
        for w in s.split(',').map(str::trim) {
            match w.to_ascii_lowercase().as_str() {
                "header" | "headers" => p.headers = true,
                "query" | "target" => p.query = true,
                "body" => p.body = true,
                other => {
                    return Err(Error::invalid(
                        "secrets",
                        format!(
                            "`{other}` is not a place to substitute a secret in (header, \
                             query or body)"
                        ),
                    ))
                }
            }
        }
        Ok(p)
    }
}

impl Serialize for SecretPlaces {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.words().serialize(s)
    }
}

impl<'de> Deserialize<'de> for SecretPlaces {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let words = Vec::<String>::deserialize(d)?;
        if words.is_empty() {
            return Err(serde::de::Error::custom(
                "substitute_in needs at least one of header, query, body",
            ));
        }
        words.join(",").parse().map_err(serde::de::Error::custom)
    }
}

/// A secret named by the spec. Only the name is stored: the value is resolved at create time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SecretBinding {
    /// The name looked up in the [`SecretSource`].
    pub name: String,
    /// Where the value goes.
    pub exposure: SecretExposure,
}

/// Where secret values come from.
pub trait SecretSource: Send + Sync {
    /// Returns the value of the named secret.
    fn resolve(&self, name: &str) -> Result<Secret>;
}

/// Secrets from an in-memory map (tests, or a caller that fetched them from a vault).
#[derive(Default, Clone)]
pub struct MapSecretSource(BTreeMap<String, Secret>);

impl MapSecretSource {
    /// An empty source.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a secret.
    pub fn with(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.0.insert(name.into(), Secret::new(value));
        self
    }
}

impl SecretSource for MapSecretSource {
    fn resolve(&self, name: &str) -> Result<Secret> {
        self.0.get(name).cloned().ok_or_else(|| Error::Secret {
            name: name.into(),
            reason: "not present in the secret source".into(),
        })
    }
}

/// Secrets from host environment variables, each **named explicitly** by the caller.
#[derive(Debug, Default, Clone, Copy)]
pub struct EnvSecretSource;

impl SecretSource for EnvSecretSource {
    fn resolve(&self, name: &str) -> Result<Secret> {
        std::env::var(name)
            .map(Secret::new)
            .map_err(|e| Error::Secret {
                name: name.into(),
                reason: format!("host environment variable: {e}"),
            })
    }
}

/// Secrets resolved for one sandbox, plus the redactor built from them.
#[derive(Default, Clone)]
pub struct ResolvedSecrets {
    entries: Vec<(SecretBinding, Secret)>,
}

impl fmt::Debug for ResolvedSecrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|(b, _)| &b.name))
            .finish()
    }
}

impl ResolvedSecrets {
    /// No secrets.
    pub fn none() -> Self {
        Self::default()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Resolves every binding; fails on the first missing one, naming it.
    pub fn resolve(bindings: &[SecretBinding], source: &dyn SecretSource) -> Result<Self> {
        let mut entries = Vec::with_capacity(bindings.len());
        for b in bindings {
            let v = source.resolve(&b.name)?;
            if v.expose().is_empty() {
                return Err(Error::Secret {
                    name: b.name.clone(),
                    reason: "value is empty".into(),
                });
            }
            entries.push((b.clone(), v));
        }
        Ok(ResolvedSecrets { entries })
    }

    /// The `(var, value)` pairs to add to the sandbox environment.
    pub fn env(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().filter_map(|(b, v)| match &b.exposure {
            SecretExposure::Env { var } => Some((var.as_str(), v.expose())),
            SecretExposure::HostOnly | SecretExposure::Proxy { .. } => None,
        })
    }

    /// `Unsupported` on `tier` when any secret is to be held by the egress proxy: for tiers
    /// that cannot give the sandbox a placeholder and the proxy's CA (wasm, unisolated).
    pub fn refuse_proxied(&self, tier: crate::Tier) -> Result<()> {
        match self.proxied().first() {
            None => Ok(()),
            Some(s) => Err(Error::unsupported(
                tier,
                format!(
                    "proxy-held secrets (`{}`: SecretExposure::Proxy); the container, \
                     gVisor and microVM tiers hold them through an egress enforcer",
                    s.name
                ),
            )),
        }
    }

    /// The secrets the egress proxy holds ([`SecretExposure::Proxy`]): name, variable, hosts
    /// and value, for the tier to hand to its egress enforcer.
    pub fn proxied(&self) -> Vec<ProxiedSecret<'_>> {
        self.entries
            .iter()
            .filter_map(|(b, v)| match &b.exposure {
                SecretExposure::Proxy {
                    var,
                    hosts,
                    substitute_in,
                } => Some(ProxiedSecret {
                    name: &b.name,
                    var,
                    hosts,
                    substitute_in: *substitute_in,
                    value: v,
                }),
                _ => None,
            })
            .collect()
    }

    /// A host-only (or any) secret's value by name, for host-side tools.
    pub fn get(&self, name: &str) -> Option<&Secret> {
        self.entries
            .iter()
            .find(|(b, _)| b.name == name)
            .map(|(_, v)| v)
    }

    /// The redactor for this sandbox's output.
    pub fn redactor(&self) -> Redactor {
        Redactor::new(
            self.entries
                .iter()
                .map(|(b, v)| (b.name.clone(), v.expose().to_string())),
        )
    }
}

/// A secret the egress proxy holds for a sandbox ([`ResolvedSecrets::proxied`]).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ProxiedSecret<'a> {
    /// Its name.
    pub name: &'a str,
    /// The variable that gets the placeholder.
    pub var: &'a str,
    /// The hosts the value goes to.
    pub hosts: &'a [crate::HostRule],
    /// Where in a request the placeholder is replaced.
    pub substitute_in: SecretPlaces,
    /// The value.
    pub value: &'a Secret,
}

/// Replaces every occurrence of a secret value in captured output by `[REDACTED:name]`.
#[derive(Clone, Default)]
pub struct Redactor {
    // Longest first, so a secret containing another is replaced whole.
    needles: Vec<(String, Vec<u8>)>,
}

impl fmt::Debug for Redactor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Redactor({} secrets)", self.needles.len())
    }
}

impl Redactor {
    /// A redactor for `(name, value)` pairs.
    pub fn new(secrets: impl IntoIterator<Item = (String, String)>) -> Self {
        let mut needles: Vec<_> = secrets
            .into_iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(n, v)| (n, v.into_bytes()))
            .collect();
        needles.sort_by_key(|(_, v)| std::cmp::Reverse(v.len()));
        Redactor { needles }
    }

    /// `true` when there is nothing to redact.
    pub fn is_empty(&self) -> bool {
        self.needles.is_empty()
    }

    /// The longest secret, in bytes: a streaming caller keeps that much minus one back.
    pub fn max_len(&self) -> usize {
        self.needles.first().map_or(0, |(_, v)| v.len())
    }

    /// Like [`Redactor::redact`], for output that was cut at a cap: a tail that is the start
    /// of a secret is redacted too, so truncation never leaks a secret's first bytes.
    pub fn redact_truncated(&self, data: &[u8]) -> Vec<u8> {
        let mut out = self.redact(data);
        for (name, needle) in &self.needles {
            let longest = (1..needle.len().min(out.len() + 1))
                .rev()
                .find(|&n| out.ends_with(&needle[..n]));
            if let Some(n) = longest {
                out.truncate(out.len() - n);
                out.extend_from_slice(format!("[REDACTED:{name}]").as_bytes());
                break;
            }
        }
        out
    }

    /// Returns `data` with every secret replaced.
    pub fn redact(&self, data: &[u8]) -> Vec<u8> {
        if self.needles.is_empty() {
            return data.to_vec();
        }
        let mut out = Vec::with_capacity(data.len());
        let mut i = 0;
        'outer: while i < data.len() {
            for (name, needle) in &self.needles {
                if data[i..].starts_with(needle) {
                    out.extend_from_slice(b"[REDACTED:");
                    out.extend_from_slice(name.as_bytes());
                    out.push(b']');
                    i += needle.len();
                    continue 'outer;
                }
            }
            out.push(data[i]);
            i += 1;
        }
        out
    }
}

/// Redaction for streamed output: secrets split across chunk boundaries are still caught.
///
/// Bytes that might be the start of a secret are held back until the next chunk decides them;
/// [`StreamRedactor::finish`] flushes the rest.
#[derive(Debug, Clone)]
pub struct StreamRedactor {
    redactor: Redactor,
    pending: Vec<u8>,
}

impl StreamRedactor {
    /// Wraps a redactor.
    pub fn new(redactor: Redactor) -> Self {
        StreamRedactor {
            redactor,
            pending: Vec::new(),
        }
    }

    /// Feeds a chunk; returns what can be emitted now (possibly empty).
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        if self.redactor.is_empty() {
            return chunk.to_vec();
        }
        self.pending.extend_from_slice(chunk);
        let data = std::mem::take(&mut self.pending);
        let mut out = Vec::with_capacity(data.len());
        let mut i = 0;
        'outer: while i < data.len() {
            let rest = &data[i..];
            let mut undecided = false;
            for (name, needle) in &self.redactor.needles {
                if rest.starts_with(needle) {
                    out.extend_from_slice(b"[REDACTED:");
                    out.extend_from_slice(name.as_bytes());
                    out.push(b']');
                    i += needle.len();
                    continue 'outer;
                }
                if rest.len() < needle.len() && needle.starts_with(rest) {
                    undecided = true;
                }
            }
            if undecided {
                self.pending = rest.to_vec();
                return out;
            }
            out.push(data[i]);
            i += 1;
        }
        out
    }

    /// Flushes held-back bytes at the end of the stream. With `truncated`, a held-back start
    /// of a secret is redacted rather than emitted (see [`Redactor::redact_truncated`]).
    pub fn finish(&mut self, truncated: bool) -> Vec<u8> {
        let rest = std::mem::take(&mut self.pending);
        if truncated {
            self.redactor.redact_truncated(&rest)
        } else {
            self.redactor.redact(&rest)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_values() {
        let s = Secret::new("hunter2");
        assert!(!format!("{s:?}").contains("hunter2"));
        let src = MapSecretSource::new().with("API_KEY", "sk-123456");
        let r = ResolvedSecrets::resolve(
            &[SecretBinding {
                name: "API_KEY".into(),
                exposure: SecretExposure::HostOnly,
            }],
            &src,
        )
        .unwrap();
        assert!(!format!("{r:?}").contains("sk-123456"));
        assert_eq!(r.env().count(), 0, "host-only secrets never enter the env");
        assert_eq!(r.get("API_KEY").unwrap().expose(), "sk-123456");
    }

    #[test]
    fn missing_secret_names_it() {
        let err = ResolvedSecrets::resolve(
            &[SecretBinding {
                name: "NOPE".into(),
                exposure: SecretExposure::Env { var: "X".into() },
            }],
            &MapSecretSource::new(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("NOPE"));
    }

    #[test]
    fn stream_redaction_catches_secrets_split_across_chunks() {
        let r = Redactor::new([("K".into(), "sk-123456".into())]);
        let input = b"key=sk-123456 and again sk-123456 end sk-12";
        for split in 1..input.len() {
            let mut s = StreamRedactor::new(r.clone());
            let mut out = Vec::new();
            for chunk in input.chunks(split) {
                out.extend(s.push(chunk));
            }
            out.extend(s.finish(false));
            assert_eq!(
                String::from_utf8(out).unwrap(),
                "key=[REDACTED:K] and again [REDACTED:K] end sk-12",
                "chunk size {split}"
            );
        }
        let mut s = StreamRedactor::new(r.clone());
        let mut out = s.push(b"x sk-1234");
        out.extend(s.finish(true));
        assert_eq!(out, b"x [REDACTED:K]");
        assert_eq!(r.redact_truncated(b"abc sk-12345"), b"abc [REDACTED:K]");
        assert_eq!(r.redact_truncated(b"abc"), b"abc");
        let mut none = StreamRedactor::new(Redactor::default());
        assert_eq!(none.push(b"abc"), b"abc");
    }

    #[test]
    fn secret_places_default_to_headers_and_old_json_still_reads() {
        // Written before `substitute_in` existed: headers only.
        let old = r#"{"kind":"proxy","var":"T","hosts":["api.example.com"]}"#;
        let e: SecretExposure = serde_json::from_str(old).unwrap();
        match &e {
            SecretExposure::Proxy { substitute_in, .. } => {
                assert_eq!(*substitute_in, SecretPlaces::HEADERS);
            }
            other => panic!("{other:?}"),
        }
        // The default is not written, so old readers read new specs.
        assert_eq!(serde_json::to_string(&e).unwrap(), old);
        let granted = SecretExposure::Proxy {
            var: "T".into(),
            hosts: vec!["api.example.com".parse().unwrap()],
            substitute_in: "header,body".parse().unwrap(),
        };
        let json = serde_json::to_string(&granted).unwrap();
        assert!(
            json.contains(r#""substitute_in":["header","body"]"#),
            "{json}"
        );
        assert_eq!(
            serde_json::from_str::<SecretExposure>(&json).unwrap(),
            granted
        );
        let bad = r#"{"kind":"proxy","var":"T","hosts":["a.example"],"substitute_in":[]}"#;
        assert!(serde_json::from_str::<SecretExposure>(bad).is_err());
        let bad = r#"{"kind":"proxy","var":"T","hosts":["a.example"],"substitute_in":["cookie"]}"#;
        assert!(serde_json::from_str::<SecretExposure>(bad).is_err());
        // The words.
        let p: SecretPlaces = "query, Headers".parse().unwrap();
        assert_eq!(
            p,
            SecretPlaces {
                headers: true,
                query: true,
                body: false
            }
        );
        assert_eq!(p.to_string(), "header,query");
        assert_eq!("body".parse::<SecretPlaces>().unwrap().to_string(), "body");
        assert_eq!(SecretPlaces::ALL.to_string(), "header,query,body");
        assert!("".parse::<SecretPlaces>().is_err());
        assert!("header,everywhere".parse::<SecretPlaces>().is_err());
    }

    #[test]
    fn redacts_all_occurrences_longest_first() {
        let r = Redactor::new([("A".into(), "abc".into()), ("B".into(), "abcdef".into())]);
        assert_eq!(
            r.redact(b"x abcdef y abc z"),
            b"x [REDACTED:B] y [REDACTED:A] z".to_vec()
        );
        assert_eq!(r.redact(b"nothing"), b"nothing".to_vec());
        assert_eq!(r.max_len(), 6);
    }
}
