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

mod mask;
mod set;

use std::fmt;

pub use sandbox_core::SecretPlaces;
use sandbox_core::{HostRule, Secret};

pub use mask::ResponseMasker;
pub use set::SecretSet;

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

#[cfg(test)]
mod tests;
