//! Errors as the API answers them: an HTTP status and a JSON body
//! `{"error": {"kind": "...", "message": "..."}}` whose `kind` names the library's error
//! variant (`invalid_spec`, `not_found`, `unsupported`...), so a client can branch on it and a
//! person can read the message, which says what to do as the library's does.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

pub use sandbox_api::{ErrorBody, ErrorDetail};

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
        let (status, kind) = sandbox_api::error::kind_of(&e);
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        ApiError::new(status, kind, e.to_string())
    }
}

impl From<sandbox_api::BadRequest> for ApiError {
    fn from(e: sandbox_api::BadRequest) -> Self {
        ApiError::bad_request(e.0)
    }
}

impl From<sandbox_core::SnapshotError> for ApiError {
    fn from(e: sandbox_core::SnapshotError) -> Self {
        ApiError::from(sandbox_core::Error::from(e))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody::new(self.kind, self.message);
        (self.status, Json(body)).into_response()
    }
}
