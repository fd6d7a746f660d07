//! Connect-RPC's wire format with its JSON codec, as envd's clients speak it: unary calls
//! (`application/json` both ways) and server streams (`application/connect+json`: each
//! message one envelope, a flag byte and a big-endian `u32` length before its JSON; the last
//! envelope, flag `0x02`, carries the end of the stream and its error, if any).
//! Hand-written: the protocol is these two framings; the Rust Connect crates bring a
//! protobuf toolchain and their own server stack for what is 150 lines over axum.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// The largest request message accepted, in bytes (envd's requests are small JSON objects;
/// file contents travel over `/files`, which has the server's body limit).
pub(crate) const MAX_MESSAGE: usize = 1 << 20;

/// Connect's error codes (a subset of gRPC's, spelled as Connect spells them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Code {
    Canceled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    fn name(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (Connect's table).
    fn status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::InvalidArgument => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A Connect error: a code and a message for people.
#[derive(Debug, Clone)]
pub(crate) struct RpcError {
    pub(crate) code: Code,
    pub(crate) message: String,
}

impl RpcError {
    pub(crate) fn new(code: Code, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.name(), "message": self.message })
    }
}

impl From<ApiError> for RpcError {
    fn from(e: ApiError) -> Self {
        let code = match e.status.as_u16() {
            400 | 413 | 422 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            409 => Code::FailedPrecondition,
            429 => Code::ResourceExhausted,
            501 => Code::Unimplemented,
            503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Internal,
        };
        RpcError::new(code, e.message)
    }
}

impl From<sandbox_core::Error> for RpcError {
    fn from(e: sandbox_core::Error) -> Self {
        RpcError::from(ApiError::from(e))
    }
}

impl IntoResponse for RpcError {
    /// A unary call's error: its status and the JSON error body.
    fn into_response(self) -> Response {
        (
            self.code.status(),
            [(header::CONTENT_TYPE, "application/json")],
            self.json().to_string(),
        )
            .into_response()
    }
}

/// A unary answer: its message as JSON.
pub(crate) fn unary(v: serde_json::Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// A unary request's message: `application/json` (Connect's protocol also allows a GET with
/// the message in the query, which envd's clients do not use).
pub(crate) struct Unary<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Unary<T> {
    type Rejection = RpcError;

    async fn from_request(req: Request, state: &S) -> Result<Self, RpcError> {
        let ct = content_type(req.headers());
        if ct != "application/json" {
            return Err(RpcError::invalid(format!(
                "a unary call takes `application/json` (this server speaks Connect's JSON \
                 codec), not `{ct}`"
            )));
        }
        let body = read_body(req, state).await?;
        parse(&body).map(Unary)
    }
}

/// A server-streaming request's one message: `application/connect+json`, one envelope.
pub(crate) struct StreamRequest<T> {
    pub msg: T,
    /// How often the client asked for keep-alive messages (`Keepalive-Ping-Interval`,
    /// seconds), if it did.
    pub keepalive: Option<Duration>,
    /// How long the client gives the call (`Connect-Timeout-Ms`), if it said.
    pub deadline: Option<Duration>,
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for StreamRequest<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let ct = content_type(req.headers());
        if ct != "application/connect+json" {
            return Err(RpcError::invalid(format!(
                "a streaming call takes `application/connect+json` (Connect's JSON codec), \
                 not `{ct}`"
            ))
            .into_response());
        }
        let keepalive = req
            .headers()
            .get("keepalive-ping-interval")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|s| *s > 0)
            .map(Duration::from_secs);
        let deadline = req
            .headers()
            .get("connect-timeout-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_millis);
        let stream_error = |e: RpcError| stream_error(e);
        let body = read_body(req, state).await.map_err(stream_error)?;
        let mut frames = Frames::new(&body);
        let msg = match frames.next() {
            Some(Ok(Frame { flags: 0, data })) => parse(data).map_err(stream_error)?,
            Some(Ok(Frame { flags, .. })) => {
                return Err(stream_error(RpcError::new(
                    Code::Unimplemented,
                    format!(
                        "envelope flags {flags:#04x}: compressed messages are not accepted \
                         (send them uncompressed)"
                    ),
                )))
            }
            Some(Err(e)) => return Err(stream_error(e)),
            None => {
                return Err(stream_error(RpcError::invalid(
                    "the request has no message",
                )))
            }
        };
        if frames.next().is_some() {
            return Err(stream_error(RpcError::invalid(
                "a server-streaming call takes exactly one request message",
            )));
        }
        Ok(StreamRequest {
            msg,
            keepalive,
            deadline,
        })
    }
}

fn content_type(h: &HeaderMap) -> String {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

async fn read_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, RpcError> {
    // The stated length is not trusted: the body is read under the limit as it comes.
    let req = req.map(|b| Body::new(http_body_util::Limited::new(b, MAX_MESSAGE + 5)));
    Bytes::from_request(req, state).await.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            too_large()
        } else {
            RpcError::invalid(format!("reading the request: {}", e.body_text()))
        }
    })
}

fn too_large() -> RpcError {
    RpcError::new(
        Code::ResourceExhausted,
        format!("the message is over this server's limit of {MAX_MESSAGE} bytes"),
    )
}

fn parse<T: DeserializeOwned>(data: &[u8]) -> Result<T, RpcError> {
    serde_json::from_slice(data)
        .map_err(|e| RpcError::invalid(format!("the request message is not valid: {e}")))
}

/// One envelope of a streaming body.
pub(crate) struct Frame<'a> {
    pub flags: u8,
    pub data: &'a [u8],
}

/// The envelopes of a streaming body, in order; a truncated or oversized one is an error.
pub(crate) struct Frames<'a> {
    rest: &'a [u8],
}

impl<'a> Frames<'a> {
    pub(crate) fn new(body: &'a [u8]) -> Self {
        Frames { rest: body }
    }
}

impl<'a> Iterator for Frames<'a> {
    type Item = Result<Frame<'a>, RpcError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let Some((head, rest)) = self.rest.split_first_chunk::<5>() else {
            self.rest = &[];
            return Some(Err(RpcError::invalid(
                "a truncated envelope (fewer than its 5 header bytes)",
            )));
        };
        let flags = head[0];
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if len > MAX_MESSAGE {
            self.rest = &[];
            return Some(Err(too_large()));
        }
        let Some((data, rest)) = rest.split_at_checked(len) else {
            self.rest = &[];
            return Some(Err(RpcError::invalid(format!(
                "a truncated envelope: it states {len} bytes, {} follow",
                rest.len()
            ))));
        };
        self.rest = rest;
        Some(Ok(Frame { flags, data }))
    }
}

fn envelope(flags: u8, v: &serde_json::Value) -> Bytes {
    let data = v.to_string().into_bytes();
    let mut out = Vec::with_capacity(5 + data.len());
    out.push(flags);
    out.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&data);
    Bytes::from(out)
}

/// The head of every streaming answer.
fn stream_head() -> [(header::HeaderName, &'static str); 1] {
    [(header::CONTENT_TYPE, "application/connect+json")]
}

/// A streaming call that fails before its first message: the error as its end of stream.
pub(crate) fn stream_error(e: RpcError) -> Response {
    let end = envelope(0x02, &serde_json::json!({ "error": e.json() }));
    (stream_head(), end).into_response()
}

/// What a streaming answer sends next.
pub(crate) enum Item {
    /// A message.
    Msg(serde_json::Value),
    /// No end: the connection is cut, as when the machine behind a stream goes away (E2B's
    /// SDKs then ask whether the sandbox still runs, and say it was killed if not).
    Abort,
    /// The end of the stream, with this error.
    Fail(RpcError),
}

/// A streaming answer: each message of `messages` as it comes, then the end of the stream
/// (with the error that ended it, if one did). `keepalive`: a message sent whenever the
/// stream has been quiet this long, so idle proxies and clients keep it open.
///
/// When `stop` is cancelled (the server stops), the stream is cut; past `deadline` (the
/// client's `Connect-Timeout-Ms`) it ends with `deadline_exceeded`.
pub(crate) fn stream<S>(
    messages: S,
    keepalive: Option<(Duration, serde_json::Value)>,
    stop: tokio_util::sync::CancellationToken,
    deadline: Option<Duration>,
) -> Response
where
    S: Stream<Item = Item> + Send + 'static,
{
    let messages = Box::pin(messages);
    let until = deadline.map(|d| tokio::time::Instant::now() + d);
    let state = (messages, keepalive, stop, until);
    let body = futures::stream::unfold(Some(state), |state| async move {
        let (mut messages, keepalive, stop, until) = state?;
        let next = async {
            match &keepalive {
                Some((every, ka)) => match tokio::time::timeout(*every, messages.next()).await {
                    Ok(n) => n,
                    Err(_) => Some(Item::Msg(ka.clone())),
                },
                None => messages.next().await,
            }
        };
        let late = async {
            match until {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let next = tokio::select! {
            n = next => n,
            () = stop.cancelled() => Some(Item::Abort),
            () = late => {
                let e = RpcError::new(Code::DeadlineExceeded, "the call ran past its deadline (`Connect-Timeout-Ms`)");
                let end = envelope(0x02, &serde_json::json!({ "error": e.json() }));
                return Some((Ok(end), None));
            }
        };
        let (frame, more) = match next {
            Some(Item::Msg(m)) => (envelope(0, &m), true),
            Some(Item::Abort) => {
                return Some((Err(std::io::Error::other("the sandbox went away")), None))
            }
            Some(Item::Fail(e)) => (
                envelope(0x02, &serde_json::json!({ "error": e.json() })),
                false,
            ),
            None => (envelope(0x02, &serde_json::json!({})), false),
        };
        Some((
            Ok(frame),
            more.then_some((messages, keepalive, stop, until)),
        ))
    });
    (stream_head(), Body::from_stream(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(flags: u8, data: &[u8]) -> Vec<u8> {
        let mut v = vec![flags];
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn envelopes_are_read_in_order_and_bad_ones_are_errors() {
        let mut body = frame(0, b"{\"a\":1}");
        body.extend(frame(2, b"{}"));
        let got: Vec<_> = Frames::new(&body).collect();
        assert_eq!(got.len(), 2);
        let first = got[0].as_ref().unwrap();
        assert_eq!((first.flags, first.data), (0, &b"{\"a\":1}"[..]));
        assert_eq!(got[1].as_ref().unwrap().flags, 2);

        // Fewer bytes than stated, a cut header, a stated size over the limit: errors, and
        // nothing is allocated from the stated size.
        let cut = &frame(0, b"{\"a\":1}")[..8];
        let e = Frames::new(cut).next().unwrap().err().unwrap();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(
            e.message.contains("states 7 bytes, 3 follow"),
            "{}",
            e.message
        );
        let e = Frames::new(&[0, 0, 0]).next().unwrap().err().unwrap();
        assert_eq!(e.code, Code::InvalidArgument);
        let huge = [0, 0xff, 0xff, 0xff, 0xff];
        let e = Frames::new(&huge).next().unwrap().err().unwrap();
        assert_eq!(e.code, Code::ResourceExhausted);
    }

    #[test]
    fn an_envelope_states_its_length_big_endian() {
        let e = envelope(2, &serde_json::json!({}));
        assert_eq!(&e[..], &[2, 0, 0, 0, 2, b'{', b'}']);
    }

    #[tokio::test]
    async fn a_stream_ends_at_its_deadline_and_is_cut_when_the_server_stops() {
        let quiet = || futures::stream::pending::<Item>();
        let stop = tokio_util::sync::CancellationToken::new();
        let r = stream(quiet(), None, stop.clone(), Some(Duration::from_millis(20)));
        let body = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        let end = Frames::new(&body).next().unwrap().unwrap();
        assert_eq!(end.flags, 2);
        let v: serde_json::Value = serde_json::from_slice(end.data).unwrap();
        assert_eq!(v["error"]["code"], "deadline_exceeded");

        let r = stream(quiet(), None, stop.clone(), None);
        stop.cancel();
        assert!(axum::body::to_bytes(r.into_body(), 1 << 20).await.is_err());
    }

    #[test]
    fn api_errors_keep_their_meaning() {
        let e = RpcError::from(ApiError::no_sandbox("x"));
        assert_eq!(e.code, Code::NotFound);
        assert_eq!(e.json()["code"], "not_found");
        assert_eq!(e.code.status(), StatusCode::NOT_FOUND);
    }
}
