//! Errors as the API answers them: an HTTP status and a JSON body
//! `{"error": {"kind": "...", "message": "..."}}` whose `kind` names the library's error
//! variant (`invalid_spec`, `not_found`, `unsupported`...), so a client can branch on it and a
//! person can read the message, which says what to do as the library's does.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

/// The JSON body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// The error itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// A stable, snake_case name: `unauthorized`, `bad_request`, `invalid_spec`,
    /// `not_found`, `path_escape`, `unsupported`, `unavailable`, `sandbox_gone`,
    /// `sandbox_paused`, `timeout`, `resource_exhausted`, `too_large`, `internal`...
    pub kind: String,
    /// What happened and what to do, for a person.
    pub message: String,
}

/// An error answer.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {kind}: {message}")]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// See [`ErrorDetail::kind`].
    pub kind: &'static str,
    /// See [`ErrorDetail::message`].
    pub message: String,
}

impl ApiError {
    /// An error of `status` and `kind`.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
        }
    }

    /// 400: the request itself is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    /// 404: no such sandbox (for this client).
    pub fn no_sandbox(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no sandbox {id} (list them with GET /v1/sandboxes)"),
        )
    }
}

impl From<sandbox_core::Error> for ApiError {
    fn from(e: sandbox_core::Error) -> Self {
        use sandbox_core::Error as E;
        let (status, kind) = match &e {
            E::InvalidSpec { .. } => (StatusCode::BAD_REQUEST, "invalid_spec"),
            E::PathEscape { .. } => (StatusCode::BAD_REQUEST, "path_escape"),
            E::NotFound { .. } => (StatusCode::NOT_FOUND, "not_found"),
            E::Unsupported { .. } => (StatusCode::NOT_IMPLEMENTED, "unsupported"),
            E::Unavailable { .. } | E::NoTierAvailable { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
            }
            E::SandboxGone { .. } => (StatusCode::GONE, "sandbox_gone"),
            E::SandboxPaused { .. } => (StatusCode::CONFLICT, "sandbox_paused"),
            E::ProcessExited { .. } => (StatusCode::CONFLICT, "process_exited"),
            E::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
            E::ResourceExhausted { .. } => (StatusCode::INSUFFICIENT_STORAGE, "resource_exhausted"),
            E::Secret { .. } => (StatusCode::BAD_REQUEST, "secret"),
            E::Snapshot(sandbox_core::SnapshotError::NotFound(_)) => {
                (StatusCode::NOT_FOUND, "not_found")
            }
            E::Snapshot(sandbox_core::SnapshotError::Untrusted { .. }) => {
                (StatusCode::FORBIDDEN, "forbidden")
            }
            E::Snapshot(_) => (StatusCode::UNPROCESSABLE_ENTITY, "snapshot"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError::new(status, kind, e.to_string())
    }
}

impl From<sandbox_core::SnapshotError> for ApiError {
    fn from(e: sandbox_core::SnapshotError) -> Self {
        ApiError::from(sandbox_core::Error::from(e))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                kind: self.kind.to_string(),
                message: self.message,
            },
        };
        (self.status, Json(body)).into_response()
    }
}
