//! Background processes, terminals and published ports over the API: the routes under
//! `/v1/sandboxes/{id}/processes` and `/v1/sandboxes/{id}/ports`.
//!
//! A spawned process stays in its sandbox's table here until a client has seen it end: its
//! `exit` event on the output stream, or the answer of `wait`. Its output waits in the
//! library's bounded queue while no client reads it (the process blocks on a full pipe, as
//! in the library); one request reads it at a time (another gets `409 busy`). A client that
//! goes away mid-stream loses at most the event in flight; the next reader goes on from
//! there. Input (stdin, signals, resizes) goes through the process's handle, so a client
//! types while another request streams the output.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::Json;
use base64::Engine;
use futures::{Stream, StreamExt};
use sandbox_core::{ExecEvent, ExecResult, Process, ProcessHandle, ProcessId, PublishedPort};

use crate::api::{
    ExecBody, PortList, ProcessList, ProcessRef, PublishBody, ResizeBody, SignalBody, WaitBody,
};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::lifetime::InUse;
use crate::routes::body::{bytes_rejection, json_event, optional_json, JsonBody};
use crate::Shared;

/// Most processes a sandbox's table holds (running, or ended but not yet seen ending).
pub const MAX_PROCESSES: usize = 256;

/// One spawned process: its input side, and its output for one reader at a time.
struct Slot {
    handle: ProcessHandle,
    output: Arc<tokio::sync::Mutex<Process>>,
}

/// A sandbox's processes that a client has not yet seen end.
#[derive(Default)]
pub(crate) struct Table(Mutex<HashMap<ProcessId, Slot>>);

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ProcessId, Slot>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn handle(&self, sandbox: &str, pid: ProcessId) -> Result<ProcessHandle, ApiError> {
        self.lock()
            .get(&pid)
            .map(|s| s.handle.clone())
            .ok_or_else(|| no_process(sandbox, pid))
    }

    /// The process's output, for this request alone.
    fn take_output(
        &self,
        sandbox: &str,
        pid: ProcessId,
    ) -> Result<tokio::sync::OwnedMutexGuard<Process>, ApiError> {
        let out = self
            .lock()
            .get(&pid)
            .map(|s| Arc::clone(&s.output))
            .ok_or_else(|| no_process(sandbox, pid))?;
        out.try_lock_owned().map_err(|_| {
            ApiError::new(
                StatusCode::CONFLICT,
                "busy",
                format!(
                    "process {pid}'s output is being read by another request (one reader at \
                     a time; its input still works)"
                ),
            )
        })
    }

    /// Forgets a process a client has seen end.
    fn forget(&self, pid: ProcessId) {
        self.lock().remove(&pid);
    }
}

fn no_process(sandbox: &str, pid: ProcessId) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!(
            "no process {pid} in sandbox {sandbox} to talk to (never spawned through this \
             API, or it ended and its exit was delivered; GET .../processes lists them all)"
        ),
    )
}

pub(crate) async fn spawn(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ExecBody>,
) -> Result<(StatusCode, Json<ProcessRef>), ApiError> {
    let e = s.enter(&id, &caller).await?;
    let req = body.into_request()?;
    if e.procs.lock().len() >= MAX_PROCESSES {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "resource_exhausted",
            format!(
                "sandbox {id} has {MAX_PROCESSES} processes whose end no client has seen; \
                 wait for some (POST .../processes/{{pid}}/wait) first"
            ),
        ));
    }
    let p = e.sandbox.spawn(req).await?;
    let pid = p.id();
    e.procs.lock().insert(
        pid,
        Slot {
            handle: p.handle(),
            output: Arc::new(tokio::sync::Mutex::new(p)),
        },
    );
    Ok((StatusCode::CREATED, Json(ProcessRef::new(pid))))
}

pub(crate) async fn list(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<ProcessList>, ApiError> {
    let e = s.enter(&id, &caller).await?;
    Ok(Json(ProcessList::new(e.sandbox.processes().await?)))
}

/// A chunk of output: `{"text": ...}` when it is UTF-8, else `{"b64": ...}` (a terminal's
/// chunk may end inside a character), so clients get the bytes exactly.
fn bytes_event(name: &str, b: &[u8]) -> Event {
    match std::str::from_utf8(b) {
        Ok(t) => json_event(name, &serde_json::json!({ "text": t })),
        Err(_) => json_event(
            name,
            &serde_json::json!({ "b64": base64::engine::general_purpose::STANDARD.encode(b) }),
        ),
    }
}

fn error_event(e: ApiError) -> Event {
    let body = crate::error::ErrorBody::new(e.kind, e.message);
    json_event("error", &body)
}

/// Server-sent events: `stdout` and `stderr` chunks as they come, then `exit` (its
/// `ExecResult`, the output already sent) or `error`.
pub(crate) async fn output(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path((id, pid)): Path<(String, ProcessId)>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let e = s.enter(&id, &caller).await?;
    let p = e.procs.take_output(&id, pid)?;
    // The sandbox stays in use (not idle) while a client watches one of its processes.
    // A first comment sends the answer's head at once: the client knows it is attached
    // (a silent process would otherwise hold it until the first keep-alive).
    let attached = futures::stream::once(async move {
        Ok::<_, Infallible>(Event::default().comment(format!("process {pid}")))
    });
    let events = futures::stream::unfold(Some((p, e)), move |state| async move {
        let (mut p, e): (_, InUse) = state?;
        let (event, more) = match p.next().await {
            Some(Ok(ExecEvent::Stdout(b))) => (bytes_event("stdout", &b), true),
            Some(Ok(ExecEvent::Stderr(b))) => (bytes_event("stderr", &b), true),
            Some(Ok(ExecEvent::Exit(r))) => {
                e.procs.forget(pid);
                (json_event("exit", &r), false)
            }
            // Events of later versions: skipped.
            Some(Ok(_)) => (Event::default().comment("event"), true),
            Some(Err(err)) => {
                e.procs.forget(pid);
                (error_event(ApiError::from(err)), false)
            }
            // Nothing more will come (its end was delivered, which also forgets it, so only a
            // reader that raced that forgetting gets here): its exit again.
            None => {
                e.procs.forget(pid);
                let r = p
                    .exit()
                    .cloned()
                    .unwrap_or_else(|| ExecResult::new(None, vec![], vec![]));
                (json_event("exit", &r), false)
            }
        };
        Some((Ok(event), more.then_some((p, e))))
    });
    Ok(Sse::new(attached.chain(events)).keep_alive(KeepAlive::default()))
}

pub(crate) async fn wait(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path((id, pid)): Path<(String, ProcessId)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<ExecResult>, ApiError> {
    let b: WaitBody = optional_json(body)?;
    let e = s.enter(&id, &caller).await?;
    let mut p = e.procs.take_output(&id, pid)?;
    let r = p
        .wait(b.timeout_ms.map(std::time::Duration::from_millis))
        .await?;
    e.procs.forget(pid);
    Ok(Json(r))
}

pub(crate) async fn write_stdin(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path((id, pid)): Path<(String, ProcessId)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let data = body.map_err(bytes_rejection)?;
    let e = s.enter(&id, &caller).await?;
    let h = e.procs.handle(&id, pid)?;
    h.write_stdin(data).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn close_stdin(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path((id, pid)): Path<(String, ProcessId)>,
) -> Result<StatusCode, ApiError> {
    let e = s.enter(&id, &caller).await?;
    e.procs.handle(&id, pid)?.close_stdin().await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn signal(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path((id, pid)): Path<(String, ProcessId)>,
    JsonBody(body): JsonBody<SignalBody>,
) -> Result<StatusCode, ApiError> {
    let sig: sandbox_core::Signal = body.signal.parse()?;
    let e = s.enter(&id, &caller).await?;
    e.sandbox.signal(pid, sig).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn resize(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path((id, pid)): Path<(String, ProcessId)>,
    JsonBody(body): JsonBody<ResizeBody>,
) -> Result<StatusCode, ApiError> {
    let e = s.enter(&id, &caller).await?;
    e.procs
        .handle(&id, pid)?
        .resize(body.rows, body.cols)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn publish(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<PublishBody>,
) -> Result<(StatusCode, Json<PublishedPort>), ApiError> {
    let host = body
        .host
        .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0));
    if !host.ip().is_loopback() && !s.config.allow_host_access {
        return Err(crate::access::forbidden(
            "publishing a port on an address other than loopback",
        ));
    }
    let e = s.enter(&id, &caller).await?;
    let at = e.sandbox.publish(body.sandbox_port, host).await?;
    let port = e
        .sandbox
        .published()
        .await?
        .into_iter()
        .find(|p| p.host == at)
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                format!("port {at} was published but is not listed"),
            )
        })?;
    Ok((StatusCode::CREATED, Json(port)))
}

pub(crate) async fn ports(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<PortList>, ApiError> {
    let e = s.enter(&id, &caller).await?;
    Ok(Json(PortList::new(e.sandbox.published().await?)))
}

pub(crate) async fn unpublish(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path((id, host)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let addr: SocketAddr = host.parse().map_err(|_| {
        ApiError::bad_request(format!(
            "`{host}` is not a socket address (`127.0.0.1:8080`, `[::1]:8080`: the `host` \
             that publishing answered)"
        ))
    })?;
    let e = s.enter(&id, &caller).await?;
    e.sandbox.unpublish(addr).await?;
    Ok(StatusCode::NO_CONTENT)
}
