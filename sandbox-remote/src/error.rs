//! Errors of the connection, and the server's error answers turned back into the library's
//! [`sandbox_core::Error`], so code written against the traits sees the same variants from a
//! remote sandbox as from a local one.

use std::time::Duration;

use sandbox_core::{Error, Tier};

/// Why a server could not be reached or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// The address is neither `http(s)://HOST:PORT` nor `unix:PATH`.
    #[error(
        "`{0}` is not a server address: use http://HOST:PORT, https://HOST:PORT or unix:/PATH"
    )]
    BadAddress(String),
    /// The token file could not be read.
    #[error("read the token file {path}: {source}")]
    TokenFile {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP client could not be built (its TLS set-up).
    #[error("build the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// Nothing answered at the address.
    #[error(
        "the server at {server} is unreachable: {source} (is `agent-sandbox serve` running there?)"
    )]
    Unreachable {
        /// The address.
        server: String,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// The server refused the token (or none was given).
    #[error(
        "the server at {server} refused the token: {message} (give the one in its token file)"
    )]
    Unauthorized {
        /// The address.
        server: String,
        /// Its message.
        message: String,
    },
    /// The server answered with an error.
    #[error("the server at {server} answered {status} {kind}: {message}")]
    Answer {
        /// The address.
        server: String,
        /// The HTTP status.
        status: u16,
        /// The error's kind (`not_found`, `unsupported`...).
        kind: String,
        /// Its message.
        message: String,
    },
    /// The answer was not what the API documents.
    #[error("the server at {server} sent an answer this client cannot read: {reason}")]
    Protocol {
        /// The address.
        server: String,
        /// What was wrong.
        reason: String,
    },
}

/// A failed call: the server's error answer (status, kind, message) or a transport failure
/// (status 0).
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) server: String,
    pub(crate) status: u16,
    pub(crate) kind: String,
    pub(crate) message: String,
    /// The client-side error behind a transport or protocol failure, kept as the source of
    /// the library error made from it.
    pub(crate) cause: Option<sandbox_core::error::BoxError>,
}

/// The hint a transport failure gives.
const STILL_RUNNING: &str = "(is `agent-sandbox serve` still running there?)";

impl Failure {
    pub(crate) fn transport(server: &str, e: reqwest::Error) -> Self {
        Failure {
            server: server.to_string(),
            status: 0,
            kind: "unreachable".into(),
            message: format!("{e} {STILL_RUNNING}"),
            cause: Some(Box::new(e)),
        }
    }

    pub(crate) fn protocol(server: &str, reason: impl Into<String>) -> Self {
        Failure {
            server: server.to_string(),
            status: 0,
            kind: "protocol".into(),
            message: reason.into(),
            cause: None,
        }
    }

    /// [`Failure::protocol`] for an answer that `e` could not decode.
    pub(crate) fn undecodable(server: &str, e: serde_json::Error) -> Self {
        let mut f = Failure::protocol(server, e.to_string());
        f.cause = Some(Box::new(e));
        f
    }

    pub(crate) fn into_remote(self) -> RemoteError {
        match (self.status, self.kind.as_str()) {
            (401, _) => RemoteError::Unauthorized {
                server: self.server,
                message: self.message,
            },
            (0, "protocol") => RemoteError::Protocol {
                server: self.server,
                reason: self.message,
            },
            _ => RemoteError::Answer {
                server: self.server,
                status: self.status,
                kind: self.kind,
                message: self.message,
            },
        }
    }

    /// The library's error for this failure of an operation on `tier`, about sandbox
    /// `sandbox` and workspace path `path` where the call had them.
    pub(crate) fn into_core(self, tier: Tier, sandbox: Option<&str>, path: Option<&str>) -> Error {
        let m = self.message.clone();
        match self.kind.as_str() {
            "sandbox_gone" => Error::SandboxGone {
                id: sandbox.unwrap_or_default().to_string(),
                reason: m,
            },
            "sandbox_paused" => Error::SandboxPaused {
                id: sandbox.unwrap_or_default().to_string(),
            },
            // The server's two 404s: a file the sandbox does not have (the library's
            // `NotFound`, whose message it forwards), and a sandbox it does not have.
            "not_found" if m.starts_with("no such file") => Error::NotFound {
                path: path.unwrap_or_default().to_string(),
            },
            "not_found" if m.starts_with("no sandbox") => Error::SandboxGone {
                id: sandbox.unwrap_or_default().to_string(),
                reason: format!(
                    "the server at {} does not hold it (destroyed, expired, or made elsewhere)",
                    self.server
                ),
            },
            "path_escape" => Error::PathEscape {
                path: path.map_or(m, str::to_string),
            },
            "unsupported" => Error::Unsupported {
                what: between(&m, "does not support ", "; pick a tier").to_string(),
                tier,
            },
            "invalid_spec" => {
                let (field, reason) = m
                    .strip_prefix("invalid ")
                    .and_then(|r| r.split_once(": "))
                    .map_or(("spec", m.as_str()), |(f, r)| (f, r));
                Error::InvalidSpec {
                    field: field.to_string(),
                    reason: reason.to_string(),
                }
            }
            "unavailable" => Error::Unavailable {
                tier,
                reason: format!("on the server at {}: {m}", self.server),
                fix: "see `agent-sandbox probe` on the server's host".into(),
            },
            // A spec the server does not grant (host access): the spec is what to change.
            "forbidden" => Error::InvalidSpec {
                field: "spec".into(),
                reason: format!("refused by the server at {}: {m}", self.server),
            },
            "resource_exhausted" => Error::ResourceExhausted {
                what: format!("on the server at {}: {m}", self.server),
            },
            "timeout" => Error::Timeout {
                what: format!("the request to the server at {} ({m})", self.server),
                after: Duration::ZERO,
            },
            _ => match self.cause {
                // The message repeats the cause's text: the cause says it once.
                Some(cause) if self.status == 0 => {
                    let hint = if self.kind == "unreachable" {
                        format!(" {STILL_RUNNING}")
                    } else {
                        String::new()
                    };
                    Error::backend_caused(
                        tier,
                        format!("the server at {}{hint}", self.server),
                        cause,
                    )
                }
                _ => Error::backend(
                    tier,
                    if self.status == 0 {
                        format!("the server at {}: {m}", self.server)
                    } else {
                        format!(
                            "the server at {} answered {} {}: {m}",
                            self.server, self.status, self.kind
                        )
                    },
                ),
            },
        }
    }
}

/// The part of `s` between `start` and `end` (each optional: what is missing is not cut).
fn between<'a>(s: &'a str, start: &str, end: &str) -> &'a str {
    let s = s.split_once(start).map_or(s, |(_, r)| r);
    s.split_once(end).map_or(s, |(l, _)| l)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(status: u16, kind: &str, message: &str) -> Failure {
        Failure {
            server: "http://127.0.0.1:1".into(),
            status,
            kind: kind.into(),
            message: message.into(),
            cause: None,
        }
    }

    #[test]
    fn server_errors_come_back_as_the_librarys_variants() {
        let t = Tier::Container;
        let e = f(501, "unsupported", "container tier does not support pause/resume; pick a tier whose capabilities() list it")
            .into_core(t, Some("c-1"), None);
        assert!(
            matches!(&e, Error::Unsupported { what, tier } if what == "pause/resume" && *tier == t),
            "{e:?}"
        );
        let e = f(404, "not_found", "no such file in the sandbox: a.txt").into_core(
            t,
            Some("c-1"),
            Some("a.txt"),
        );
        assert!(
            matches!(&e, Error::NotFound { path } if path == "a.txt"),
            "{e:?}"
        );
        let e = f(
            404,
            "not_found",
            "no sandbox c-1 (list them with GET /v1/sandboxes)",
        )
        .into_core(t, Some("c-1"), None);
        assert!(
            matches!(&e, Error::SandboxGone { id, .. } if id == "c-1"),
            "{e:?}"
        );
        let e = f(
            400,
            "invalid_spec",
            "invalid limits.memory: must be at least 1 MiB",
        )
        .into_core(t, None, None);
        assert!(
            matches!(&e, Error::InvalidSpec { field, reason } if field == "limits.memory" && reason == "must be at least 1 MiB"),
            "{e:?}"
        );
        let e = f(400, "path_escape", "x").into_core(t, Some("c-1"), Some("../etc"));
        assert!(
            matches!(&e, Error::PathEscape { path } if path == "../etc"),
            "{e:?}"
        );
        let e = f(0, "unreachable", "connection refused").into_core(t, Some("c-1"), None);
        assert!(matches!(&e, Error::Backend { .. }), "{e:?}");
        assert!(e.to_string().contains("connection refused"));
        assert!(matches!(
            f(401, "unauthorized", "no").into_remote(),
            RemoteError::Unauthorized { .. }
        ));
    }
}
