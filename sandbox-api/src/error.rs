//! Errors as the API answers them: an HTTP status and a JSON body
//! `{"error": {"kind": "...", "message": "..."}}` whose `kind` names the library's error
//! variant (`invalid_spec`, `not_found`, `unsupported`...), so a client can branch on it and a
//! person can read the message, which says what to do as the library's does.

use serde::{Deserialize, Serialize};

/// The JSON body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// The error itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ErrorDetail {
    /// A stable, snake_case name: `unauthorized`, `bad_request`, `invalid_spec`,
    /// `not_found`, `path_escape`, `unsupported`, `unavailable`, `sandbox_gone`,
    /// `sandbox_paused`, `timeout`, `resource_exhausted`, `too_large`, `internal`...
    pub kind: String,
    /// What happened and what to do, for a person.
    pub message: String,
}

impl ErrorBody {
    /// The body of an error of `kind` (`invalid_spec`, `not_found`...) saying `message`.
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                kind: kind.into(),
                message: message.into(),
            },
        }
    }
}

/// A request body that parsed but asks for something malformed (HTTP 400, kind
/// `bad_request`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

/// The HTTP status and the stable kind the API answers a library error with.
pub fn kind_of(e: &sandbox_core::Error) -> (u16, &'static str) {
    use sandbox_core::Error as E;
    use sandbox_core::SnapshotError as S;
    match e {
        E::InvalidSpec { .. } => (400, "invalid_spec"),
        E::PathEscape { .. } => (400, "path_escape"),
        E::NotFound { .. } => (404, "not_found"),
        E::Unsupported { .. } => (501, "unsupported"),
        E::Unavailable { .. } | E::NoTierAvailable { .. } => (503, "unavailable"),
        E::SandboxGone { .. } => (410, "sandbox_gone"),
        E::SandboxPaused { .. } => (409, "sandbox_paused"),
        E::ProcessExited { .. } => (409, "process_exited"),
        E::Timeout { .. } => (504, "timeout"),
        E::ResourceExhausted { .. } => (507, "resource_exhausted"),
        E::Secret { .. } => (400, "secret"),
        E::Snapshot(S::NotFound(_)) => (404, "not_found"),
        E::Snapshot(S::Untrusted { .. }) => (403, "forbidden"),
        E::Snapshot(_) => (422, "snapshot"),
        _ => (500, "internal"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn library_errors_keep_their_kinds() {
        let e = sandbox_core::Error::SandboxGone {
            id: "x".into(),
            reason: "destroyed".into(),
        };
        assert_eq!(kind_of(&e), (410, "sandbox_gone"));
        let id: sandbox_core::SnapshotId = "0".repeat(64).parse().unwrap();
        let e = sandbox_core::Error::Snapshot(sandbox_core::SnapshotError::NotFound(id));
        assert_eq!(kind_of(&e), (404, "not_found"));
    }
}
