//! Request bodies and streamed events that every route family shares: JSON bodies whose
//! rejections are API errors (400, 413, 422), bodies that may be left out, and server-sent
//! events carrying JSON.

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, JsonRejection};
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::sse::Event;
use axum::Json;

use crate::error::ApiError;

/// A JSON body whose rejections are API errors: malformed JSON, unknown fields and wrong
/// types are 400 with serde's reason, a body over the limit 413.
pub(crate) struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(JsonBody(v)),
            Err(e) => Err(json_rejection(e)),
        }
    }
}

fn json_rejection(e: JsonRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large();
    }
    ApiError::new(e.status(), "bad_request", e.body_text())
}

pub(crate) fn bytes_rejection(e: BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large();
    }
    ApiError::new(e.status(), "bad_request", e.body_text())
}

/// A JSON body that may be left out (then `T::default()`), rejected as [`JsonBody`] is.
pub(crate) fn optional_json<T: Default + serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(bytes_rejection)?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        let status = if e.is_data() {
            StatusCode::UNPROCESSABLE_ENTITY
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(
            status,
            "bad_request",
            format!("Failed to deserialize the JSON body into the target type: {e}"),
        )
    })
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        "the request body is over the server's limit (`agent-sandbox serve --body-limit`)",
    )
}

pub(crate) fn json_event<T: serde::Serialize>(name: &str, v: &T) -> Event {
    Event::default()
        .event(name)
        .json_data(v)
        .unwrap_or_else(|_| Event::default().event(name))
}
