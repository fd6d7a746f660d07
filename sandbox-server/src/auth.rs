//! Who may call the API.
//!
//! On TCP every request carries `Authorization: Bearer <token>`; the token is compared in
//! constant time (its length is not secret: tokens we make are always 64 hex digits). On a
//! Unix socket the socket file's permissions are the check (it is made `0600`), as Docker's
//! is. A token file must not be readable by group or others.
//!
//! A server may have several clients ([`Clients`]), each a name and a token: a client sees
//! and uses only the sandboxes (and snapshots) it made, and has at most
//! `max_requests_per_client` requests in flight.

use std::path::Path;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The secret a TCP client must present. `Debug` never shows it.
#[derive(Clone)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

/// Why a token could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The file could not be read.
    #[error("read the token file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is readable by others than its owner.
    #[error(
        "the token file {path} is readable by group or others (mode {mode:o}): \
         `chmod 600 {path}`"
    )]
    Mode {
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// The token is too short to be a secret.
    #[error(
        "the token in {path} has {len} characters; use at least 32 (e.g. `openssl rand -hex 32`)"
    )]
    Short {
        /// The file.
        path: String,
        /// Its length.
        len: usize,
    },
}

/// Least length of a token we accept.
const MIN_LEN: usize = 32;

impl Token {
    /// A new random token (64 hex digits, from the OS's generator through UUID v4s).
    pub fn generate() -> Token {
        let a = uuid::Uuid::new_v4().simple().to_string();
        let b = uuid::Uuid::new_v4().simple().to_string();
        Token(format!("{a}{b}"))
    }

    /// The token in `path` (surrounding whitespace trimmed). The file must be the owner's
    /// alone (no group or other permission bits) and the token at least 32 characters.
    pub fn from_file(path: &Path) -> Result<Token, TokenError> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display().to_string();
        let read = |source| TokenError::Read {
            path: shown.clone(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(read)?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(TokenError::Mode { path: shown, mode });
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        let t = text.trim();
        if t.len() < MIN_LEN {
            return Err(TokenError::Short {
                path: shown,
                len: t.len(),
            });
        }
        Ok(Token(t.to_string()))
    }

    /// The token's text (to hand to a client).
    pub fn reveal(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time that does not depend on where they differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let ours = self.0.as_bytes();
        if ours.len() != presented.len() {
            return false;
        }
        ours.iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// Why a list of clients was refused by [`Clients::new`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientsError {
    /// Two clients have this name.
    #[error("two clients are named `{0}`")]
    SameName(String),
    /// Two clients (these names) have the same token.
    #[error("clients `{first}` and `{second}` have the same token")]
    SameToken {
        /// The client listed first.
        first: String,
        /// The client listed later.
        second: String,
    },
    /// The list is empty.
    #[error("no client")]
    Empty,
}

/// The clients a TCP server accepts, each a name and a token.
#[derive(Clone, Debug)]
pub struct Clients(Vec<(String, Token)>);

impl Clients {
    /// One client (named `""`), for a server with a single token.
    pub fn one(token: Token) -> Clients {
        Clients(vec![(String::new(), token)])
    }

    /// Several clients. Names and tokens must each be unique (a name is what separates their
    /// sandboxes; two clients with one token could not be told apart).
    pub fn new(list: Vec<(String, Token)>) -> Result<Clients, ClientsError> {
        for (i, (n, t)) in list.iter().enumerate() {
            for (m, u) in &list[..i] {
                if m == n {
                    return Err(ClientsError::SameName(n.clone()));
                }
                if u.matches(t.reveal().as_bytes()) {
                    return Err(ClientsError::SameToken {
                        first: m.clone(),
                        second: n.clone(),
                    });
                }
            }
        }
        if list.is_empty() {
            return Err(ClientsError::Empty);
        }
        Ok(Clients(list))
    }

    /// The client names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(n, _)| n.as_str())
    }

    /// The client whose token `presented` is; every token is compared (in constant time
    /// each), so the time does not say which matched.
    fn find(&self, presented: &[u8]) -> Option<&str> {
        let mut found = None;
        for (n, t) in &self.0 {
            if t.matches(presented) && found.is_none() {
                found = Some(n.as_str());
            }
        }
        found
    }
}

/// Who made a request: the client's name (`""` on a Unix socket or with a single token).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Caller(pub std::sync::Arc<str>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<Caller>()
            .cloned()
            .unwrap_or_default())
    }
}

/// What the auth middleware holds: the clients (`None`: no token needed, the Unix-socket
/// case) and each client's in-flight request budget.
#[derive(Clone, Debug)]
pub struct Gate {
    clients: Option<Clients>,
    budgets:
        std::sync::Arc<std::collections::HashMap<String, std::sync::Arc<tokio::sync::Semaphore>>>,
    max: usize,
}

impl Gate {
    /// A gate for `clients`, each with at most `max` requests in flight.
    pub fn new(clients: Option<Clients>, max: usize) -> Gate {
        let names: Vec<String> = match &clients {
            Some(c) => c.names().map(str::to_string).collect(),
            None => vec![String::new()],
        };
        let budgets = names
            .into_iter()
            .map(|n| {
                (
                    n,
                    std::sync::Arc::new(tokio::sync::Semaphore::new(max.max(1))),
                )
            })
            .collect();
        Gate {
            clients,
            budgets: std::sync::Arc::new(budgets),
            max,
        }
    }
}

impl Gate {
    /// The clients' names (`""` for the one principal of a Unix socket or a single token).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.budgets.keys().map(String::as_str)
    }

    /// A place among client `name`'s requests in flight, held until the permit drops; the
    /// 429 (or, for a name that is not a client's, the 401) when there is none. The API's
    /// requests take one here, and so do the requests addressed to a client's sandbox
    /// (E2B's envd and its ports), which carry the sandbox's token instead of the client's.
    pub(crate) fn admit(&self, name: &str) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
        let Some(budget) = self.budgets.get(name) else {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "unknown client",
            ));
        };
        std::sync::Arc::clone(budget)
            .try_acquire_owned()
            .map_err(|_| {
                ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too_many_requests",
                    format!(
                        "this client has {} requests in flight, its limit (`serve \
                         --max-requests-per-client`): wait for one to end",
                        self.max
                    ),
                )
            })
    }
}

/// Middleware: answers 401 unless the request carries a client's bearer token, 429 when that
/// client has its limit of requests in flight; marks the request with its [`Caller`].
pub async fn gate(State(gate): State<Gate>, mut req: Request, next: Next) -> Response {
    let name = match &gate.clients {
        None => String::new(),
        Some(clients) => {
            // E2B's SDKs send the token as their API key: `X-API-Key: e2b_<token>`.
            let e2b_key = req.headers().get("x-api-key").map(|v| {
                let k = v.as_bytes();
                k.strip_prefix(b"e2b_").unwrap_or(k)
            });
            let presented = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
                .or(e2b_key);
            match presented.map(|p| clients.find(p)) {
                Some(Some(n)) => n.to_string(),
                Some(None) if e2b_key.is_some() => {
                    return crate::e2b::api_error(
                        StatusCode::UNAUTHORIZED,
                        "the API key is not one of this server's (E2B_API_KEY is `e2b_` and \
                         the server's token)",
                    )
                }
                Some(None) => {
                    return ApiError::new(
                        StatusCode::UNAUTHORIZED,
                        "unauthorized",
                        "the bearer token is not this server's",
                    )
                    .into_response()
                }
                None => return ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "send `Authorization: Bearer <token>` (the token the server was started with)",
                )
                .into_response(),
            }
        }
    };
    let _permit = match gate.admit(&name) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    req.extensions_mut().insert(Caller(name.into()));
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn tokens_match_exactly_and_files_must_be_private() {
        let t = Token::generate();
        assert_eq!(t.reveal().len(), 64);
        assert!(t.matches(t.reveal().as_bytes()));
        assert!(!t.matches(b""));
        let mut other = t.reveal().as_bytes().to_vec();
        other[63] ^= 1;
        assert!(!t.matches(&other));
        assert_eq!(format!("{t:?}"), "Token(..)");

        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        std::fs::write(&p, format!("{}\n", t.reveal())).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(Token::from_file(&p), Err(TokenError::Mode { .. })));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Token::from_file(&p).unwrap().matches(t.reveal().as_bytes()));
        std::fs::write(&p, "short").unwrap();
        assert!(matches!(
            Token::from_file(&p),
            Err(TokenError::Short { .. })
        ));
        assert!(matches!(
            Token::from_file(&dir.path().join("none")),
            Err(TokenError::Read { .. })
        ));
    }
}
