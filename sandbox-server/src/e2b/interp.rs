//! E2B's code interpreter on a sandbox's port 49999, as `e2b-code-interpreter`'s
//! `Sandbox.run_code` and its contexts call it: `POST /execute` (the cell's output streamed
//! as one JSON object a line), `/contexts` (create, list, remove, restart) and `/health`.
//! Each context is a [`sandbox_core::interpreter::Interpreter`]: one `python3` (or `bash`
//! for `language="bash"`) in the sandbox, started on first use, its cells one at a time
//! (others queue, as E2B's do).
//! A client that goes away mid-cell interrupts it (`KeyboardInterrupt`), as E2B's does.
//!
//! `/execute` takes the sandbox's envd access token (`X-Access-Token`, which the SDKs send
//! there); the context calls, for which the SDKs send none, take what the sandbox's other
//! ports take (its traffic token when it has one), and a token that is sent must be right.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use sandbox_core::cell::{mime, OutputKind};
use sandbox_core::interpreter::{CellEvent, CellOptions, ContextSpec, Interpreter, Killer};
use serde::Deserialize;
use serde_json::{json, Value};

use super::Envd;

/// The port E2B's code interpreter listens on; the SDKs address it in `E2b-Sandbox-Port`.
pub const JUPYTER_PORT: u16 = 49999;

/// Contexts clients may create in one sandbox (each is a process in it, and state here);
/// the default context of each language is made besides.
const MAX_CONTEXTS: usize = 32;

/// Cells that may wait for one context while another runs in it (each holds its code).
const MAX_WAITING: usize = 8;

/// The largest `/execute` or `/contexts` body taken (a cell's code), whatever the server's
/// body limit.
const CODE_LIMIT: usize = 16 << 20;

/// How long a cell may run: as long as its sandbox lives (E2B's SDKs bound it on their
/// side, then close the stream, which interrupts it).
const CELL_LIMIT: Duration = Duration::from_secs(24 * 3600);

/// After this long without output a stream says it is alive (`keepalive`, as E2B's does).
const KEEPALIVE: Duration = Duration::from_secs(5);

/// Events of one cell in flight between the interpreter and the client's stream.
const IN_FLIGHT: usize = 64;

/// A sandbox's interpreter contexts, in the order they were made.
#[derive(Default)]
pub(crate) struct Contexts(tokio::sync::Mutex<Vec<Arc<Context>>>);

/// One context: what E2B's API shows of it, and its interpreter.
pub(crate) struct Context {
    id: String,
    language: String,
    cwd: String,
    /// Made for a language's default (`language` in `/execute`), not by a client's create.
    default: bool,
    interpreter: tokio::sync::Mutex<Option<Interpreter>>,
    /// Kills the running interpreter while a cell holds `interpreter` (set at its start).
    killer: std::sync::OnceLock<Killer>,
    /// Places for cells waiting for `interpreter`.
    waiting: Arc<tokio::sync::Semaphore>,
}

impl Context {
    fn new(language: String, cwd: String, default: bool) -> Arc<Self> {
        Arc::new(Context {
            id: uuid::Uuid::new_v4().to_string(),
            language,
            cwd,
            default,
            interpreter: tokio::sync::Mutex::new(None),
            killer: std::sync::OnceLock::new(),
            waiting: Arc::new(tokio::sync::Semaphore::new(MAX_WAITING)),
        })
    }

    fn json(&self) -> Value {
        json!({ "id": self.id, "language": self.language, "cwd": self.cwd })
    }

    /// Its interpreter, started if it is not running.
    async fn ready<'a>(
        &self,
        e: &Envd,
        slot: &'a mut Option<Interpreter>,
    ) -> sandbox_core::Result<&'a mut Interpreter> {
        if slot.is_none() {
            let spec = match self.language.as_str() {
                "bash" => ContextSpec::bash(),
                _ => ContextSpec::python(),
            }
            .cwd(self.cwd.clone());
            let started = Interpreter::start(Arc::clone(&e.entry.sandbox), spec).await?;
            *slot = Some(started);
        }
        let Some(i) = slot.as_mut() else {
            return Err(sandbox_core::Error::backend(
                e.entry.sandbox.tier(),
                "no interpreter",
            ));
        };
        let _ = self.killer.set(i.killer());
        Ok(i)
    }

    /// Kills its running interpreter (a cell running in it ends).
    async fn kill(&self) {
        if let Some(k) = self.killer.get() {
            k.kill().await;
        }
    }
}

/// The interpreter's routes (reached through the dispatch for port [`JUPYTER_PORT`]).
pub(crate) fn routes(limit: usize) -> Router {
    Router::new()
        .route("/health", get(|| async { axum::Json("OK") }))
        .route("/execute", post(execute))
        .route("/contexts", get(list).post(create))
        .route("/contexts/{id}", delete(remove))
        .route("/contexts/{id}/restart", post(restart))
        .fallback(|uri: axum::http::Uri| async move {
            text(
                StatusCode::NOT_FOUND,
                format!("the code interpreter has no endpoint {uri}"),
            )
        })
        .layer(axum::extract::DefaultBodyLimit::max(limit.min(CODE_LIMIT)))
}

/// An error as E2B's interpreter answers: a status and a plain-text body.
fn text(status: StatusCode, body: impl Into<String>) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body.into(),
    )
        .into_response()
}

/// A language's name as E2B's server takes it: trimmed, lower-case, `js` and `ts` spelled
/// out.
fn normalize(language: &str) -> String {
    match language.trim().to_ascii_lowercase().as_str() {
        "js" => "javascript".into(),
        "ts" => "typescript".into(),
        other => other.into(),
    }
}

/// Python and bash have drivers: other languages are refused by name (`None`: supported).
fn unsupported(language: &str) -> Option<Response> {
    if matches!(language, "python" | "bash") {
        return None;
    }
    Some(text(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!(
            "this server's code interpreter runs Python and bash: contexts in `{language}` \
             are not supported (run other languages through commands)"
        ),
    ))
}

async fn find(e: &Envd, id: &str) -> Option<Arc<Context>> {
    let list = e.meta.contexts.0.lock().await;
    list.iter().find(|c| c.id == id).cloned()
}

#[derive(Deserialize)]
struct CreateBody {
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    cwd: Option<String>,
}

/// `POST /contexts`: a new context (its interpreter started now, so that a failure shows).
async fn create(e: Envd, body: Bytes) -> Response {
    let req: CreateBody = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(err) => return text(StatusCode::BAD_REQUEST, format!("invalid body: {err}")),
    };
    let language = normalize(req.language.as_deref().unwrap_or("python"));
    if let Some(r) = unsupported(&language) {
        return r;
    }
    let full = |list: &[Arc<Context>]| list.iter().filter(|c| !c.default).count() >= MAX_CONTEXTS;
    if full(&e.meta.contexts.0.lock().await) {
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("this sandbox has {MAX_CONTEXTS} contexts, the most it may have: remove one"),
        );
    }
    let cwd = req.cwd.unwrap_or_else(|| e.meta.home.clone());
    let ctx = Context::new(language, cwd, false);
    {
        let mut slot = ctx.interpreter.lock().await;
        if let Err(err) = ctx.ready(&e, &mut slot).await {
            return text(StatusCode::INTERNAL_SERVER_ERROR, err.to_string());
        }
    }
    let mut list = e.meta.contexts.0.lock().await;
    if full(&list) {
        drop(list);
        close(ctx);
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("this sandbox has {MAX_CONTEXTS} contexts, the most it may have: remove one"),
        );
    }
    list.push(Arc::clone(&ctx));
    axum::Json(ctx.json()).into_response()
}

/// `GET /contexts`, oldest first.
async fn list(e: Envd) -> Response {
    let list = e.meta.contexts.0.lock().await;
    axum::Json(list.iter().map(|c| c.json()).collect::<Vec<_>>()).into_response()
}

/// `DELETE /contexts/{id}`: its interpreter ends (a cell running in it too).
async fn remove(e: Envd, Path(id): Path<String>) -> Response {
    let ctx = {
        let mut list = e.meta.contexts.0.lock().await;
        let Some(at) = list.iter().position(|c| c.id == id) else {
            return text(StatusCode::NOT_FOUND, format!("Context {id} not found"));
        };
        list.remove(at)
    };
    close(ctx);
    axum::Json(Value::Null).into_response()
}

/// Kills a context's interpreter and lets it go (in the background: a cell may still hold
/// it until the kill ends that cell).
fn close(ctx: Arc<Context>) {
    tokio::spawn(async move {
        ctx.kill().await;
        if let Some(i) = ctx.interpreter.lock().await.take() {
            i.close().await;
        }
    });
}

/// `POST /contexts/{id}/restart`: the same id, a fresh interpreter (a cell running in the
/// old one ends).
async fn restart(e: Envd, Path(id): Path<String>) -> Response {
    let Some(ctx) = find(&e, &id).await else {
        return text(StatusCode::NOT_FOUND, format!("Context {id} not found"));
    };
    ctx.kill().await;
    let mut slot = ctx.interpreter.lock().await;
    let started = match slot.as_mut() {
        Some(i) => i.restart().await,
        None => ctx.ready(&e, &mut slot).await.map(|_| ()),
    };
    match started {
        Ok(()) => axum::Json(Value::Null).into_response(),
        Err(err) => {
            *slot = None;
            text(StatusCode::INTERNAL_SERVER_ERROR, err.to_string())
        }
    }
}

#[derive(Deserialize)]
struct ExecuteBody {
    code: String,
    #[serde(default)]
    context_id: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

/// `POST /execute`: the cell's output as it happens, one JSON object a line, ending with
/// `end_of_execution`.
async fn execute(e: Envd, body: Bytes) -> Response {
    let req: ExecuteBody = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(err) => return text(StatusCode::BAD_REQUEST, format!("invalid body: {err}")),
    };
    let ctx = match (&req.context_id, &req.language) {
        (Some(_), Some(_)) => {
            return text(
                StatusCode::BAD_REQUEST,
                "Only one of context_id or language can be provided",
            )
        }
        (Some(id), None) => match find(&e, id).await {
            Some(c) => c,
            None => return text(StatusCode::NOT_FOUND, format!("Context {id} not found")),
        },
        (None, language) => {
            let language = normalize(language.as_deref().unwrap_or("python"));
            if let Some(r) = unsupported(&language) {
                return r;
            }
            let mut list = e.meta.contexts.0.lock().await;
            match list.iter().find(|c| c.default && c.language == language) {
                Some(c) => Arc::clone(c),
                None => {
                    let c = Context::new(language, e.meta.home.clone(), true);
                    list.push(Arc::clone(&c));
                    c
                }
            }
        }
    };
    let mut opts = CellOptions::new().timeout(CELL_LIMIT);
    opts.env = req.env_vars.unwrap_or_default();
    // A place in the context's queue, or a 429: each waiting cell holds its code.
    let Ok(place) = Arc::clone(&ctx.waiting).try_acquire_owned() else {
        return text(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "{MAX_WAITING} cells already wait for context {}: wait for them to finish",
                ctx.id
            ),
        );
    };
    let (lines, rx) = tokio::sync::mpsc::channel::<Bytes>(IN_FLIGHT);
    let stop = e.stop.clone();
    tokio::spawn(async move {
        // Waits its turn, unless the client leaves or the server stops first.
        let mut slot = tokio::select! {
            slot = ctx.interpreter.lock() => slot,
            () = lines.closed() => return,
            () = stop.cancelled() => return,
        };
        drop(place);
        let interp = match ctx.ready(&e, &mut slot).await {
            Ok(i) => i,
            Err(err) => {
                let _ = lines
                    .send(error_line("ContextStartFailed", &err.to_string(), ""))
                    .await;
                let _ = lines.send(line(&json!({"type": "end_of_execution"}))).await;
                return;
            }
        };
        let count = interp.next_count();
        if lines
            .send(line(
                &json!({"type": "number_of_executions", "execution_count": count}),
            ))
            .await
            .is_err()
        {
            return;
        }
        let (events, mut rx_events) = tokio::sync::mpsc::channel::<CellEvent>(IN_FLIGHT);
        let forward = {
            let lines = lines.clone();
            async move {
                let mut out = Utf8::default();
                let mut err = Utf8::default();
                loop {
                    // A client that left closes `lines`: dropping `rx_events` then
                    // interrupts the cell, even one that prints nothing.
                    let ev = tokio::select! {
                        ev = rx_events.recv() => ev,
                        () = lines.closed() => return,
                    };
                    let Some(ev) = ev else { break };
                    let l = match ev {
                        CellEvent::Stdout(b) => stream_line("stdout", out.push(&b)),
                        CellEvent::Stderr(b) => stream_line("stderr", err.push(&b)),
                        CellEvent::Output(o) => Some(result_line(&o)),
                        CellEvent::Error(x) => {
                            Some(error_line(&x.name, &x.value, &x.traceback.join("\n")))
                        }
                        _ => None,
                    };
                    if let Some(l) = l {
                        if lines.send(l).await.is_err() {
                            // The client left: dropping the receiver interrupts the cell.
                            return;
                        }
                    }
                }
                for l in [
                    stream_line("stdout", out.finish()),
                    stream_line("stderr", err.finish()),
                ]
                .into_iter()
                .flatten()
                {
                    let _ = lines.send(l).await;
                }
            }
        };
        let run = async {
            let r = interp.run_streaming(&req.code, &opts, Some(&events)).await;
            drop(events);
            r
        };
        let (r, ()) = tokio::select! {
            both = async { tokio::join!(run, forward) } => both,
            () = stop.cancelled() => return,
        };
        // A sandbox killed under the cell: the stream breaks off, as E2B's does (the SDKs
        // then ask whether the sandbox runs, and say it was killed).
        let lost = match &r {
            Err(_) => true,
            Ok(x) => x
                .error
                .as_ref()
                .is_some_and(|e| e.name.starts_with("Interpreter")),
        };
        if lost && e.entry.sandbox.health_check().await.is_err() {
            let _ = lines.send(Bytes::new()).await;
            return;
        }
        if let Err(err) = r {
            let _ = lines
                .send(error_line("ExecutionFailed", &err.to_string(), ""))
                .await;
        }
        let _ = lines.send(line(&json!({"type": "end_of_execution"}))).await;
    });
    // An empty line is the task's word that the sandbox is gone: the stream fails there.
    let body = futures::stream::unfold(rx, |mut rx| async move {
        match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
            Ok(Some(l)) if l.is_empty() => Some((Err(std::io::Error::other("sandbox gone")), rx)),
            Ok(Some(l)) => Some((Ok::<_, std::io::Error>(l), rx)),
            Ok(None) => None,
            Err(_) => Some((Ok(line(&json!({"type": "keepalive"}))), rx)),
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(body),
    )
        .into_response()
}

/// One line of the stream.
fn line(v: &Value) -> Bytes {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    Bytes::from(b)
}

/// An `error` line: E2B's traceback is one string.
fn error_line(name: &str, value: &str, traceback: &str) -> Bytes {
    line(&json!({"type": "error", "name": name, "value": value, "traceback": traceback}))
}

fn stream_line(kind: &str, text: String) -> Option<Bytes> {
    (!text.is_empty()).then(|| {
        let now = time::OffsetDateTime::now_utc();
        line(&json!({"type": kind, "text": text, "timestamp": super::rfc3339(now)}))
    })
}

/// A rich output as E2B's `result` line: its MIME types as E2B's field names, the rest in
/// `extra`.
fn result_line(o: &sandbox_core::Output) -> Bytes {
    let mut m = serde_json::Map::new();
    m.insert("type".into(), json!("result"));
    let mut extra = serde_json::Map::new();
    for (k, v) in &o.data {
        let field = match k.as_str() {
            mime::TEXT_PLAIN => "text",
            mime::TEXT_HTML => "html",
            mime::TEXT_MARKDOWN => "markdown",
            mime::IMAGE_SVG => "svg",
            mime::IMAGE_PNG => "png",
            mime::IMAGE_JPEG => "jpeg",
            "application/pdf" => "pdf",
            mime::TEXT_LATEX => "latex",
            mime::APPLICATION_JSON => "json",
            "application/javascript" => "javascript",
            other => {
                extra.insert(other.to_string(), json!(v));
                continue;
            }
        };
        let value = match field {
            "json" => serde_json::from_str(v).unwrap_or_else(|_| json!(v)),
            "text" => json!(unquote(v)),
            _ => json!(v),
        };
        m.insert(field.into(), value);
    }
    m.insert("extra".into(), Value::Object(extra));
    m.insert(
        "is_main_result".into(),
        json!(o.kind == OutputKind::ExecuteResult),
    );
    line(&Value::Object(m))
}

/// A `repr` of a string without its quotes, as E2B's server gives `text`.
fn unquote(s: &str) -> &str {
    let b = s.as_bytes();
    if b.len() >= 2 && b[0] == b[b.len() - 1] && (b[0] == b'\'' || b[0] == b'"') {
        &s[1..s.len() - 1]
    } else {
        s
    }
}

/// Bytes to text across chunk boundaries: a character split between two chunks is held
/// until the rest comes; bytes that are not UTF-8 become U+FFFD.
#[derive(Default)]
struct Utf8 {
    held: Vec<u8>,
}

impl Utf8 {
    fn push(&mut self, chunk: &[u8]) -> String {
        self.held.extend_from_slice(chunk);
        let cut = match std::str::from_utf8(&self.held) {
            Ok(_) => self.held.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => {
                // Invalid bytes before the end: hold back only an unfinished last character.
                let len = self.held.len();
                (len.saturating_sub(3)..len)
                    .find(|&i| {
                        matches!(std::str::from_utf8(&self.held[i..]),
                            Err(e) if e.error_len().is_none() && e.valid_up_to() == 0)
                    })
                    .unwrap_or(len)
            }
        };
        let rest = self.held.split_off(cut);
        let done = std::mem::replace(&mut self.held, rest);
        String::from_utf8_lossy(&done).into_owned()
    }

    fn finish(&mut self) -> String {
        String::from_utf8_lossy(&std::mem::take(&mut self.held)).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_across_chunks_stays_whole() {
        let mut u = Utf8::default();
        let s = "é€😀".as_bytes();
        let mut got = String::new();
        for b in s {
            got.push_str(&u.push(&[*b]));
        }
        got.push_str(&u.finish());
        assert_eq!(got, "é€😀");
        let mut u = Utf8::default();
        assert_eq!(u.push(b"a\xffb"), "a\u{fffd}b");
        assert_eq!(u.push(b"\xff\xe2\x82"), "\u{fffd}");
        assert_eq!(u.push(b"\xac"), "\u{20ac}");
    }

    #[test]
    fn results_as_e2b_names_them() {
        let o = sandbox_core::Output::new(
            OutputKind::ExecuteResult,
            [
                (mime::TEXT_PLAIN, "'/home/user'"),
                (mime::APPLICATION_JSON, r#"{"a":[1,2]}"#),
                ("application/vnd.x+json", "x"),
            ],
        );
        let v: Value = serde_json::from_slice(&result_line(&o)).unwrap();
        assert_eq!(v["text"], "/home/user");
        assert_eq!(v["json"]["a"][1], 2);
        assert_eq!(v["extra"]["application/vnd.x+json"], "x");
        assert_eq!(v["is_main_result"], true);
        assert_eq!(unquote("'"), "'");
        assert_eq!(normalize(" JS "), "javascript");
    }
}
