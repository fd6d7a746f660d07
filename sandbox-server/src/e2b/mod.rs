//! E2B's API on `agent-sandbox serve`, so programs written against E2B's SDKs (Python,
//! JavaScript, and the agent frameworks built on them) run on our tiers unchanged: point
//! `E2B_API_URL` and `E2B_SANDBOX_URL` at the server and set `E2B_API_KEY` to `e2b_` and
//! the server's token. `docs/e2b.md` is the user's guide and the compatibility table.
//!
//! - **Control plane** (`control.rs`): E2B's `spec/openapi.yml` (create, list, get, kill,
//!   timeouts, pause, connect, network...) on the same sandboxes, clients and tokens as API
//!   v1 (`X-API-Key: e2b_<token>`): a sandbox made through one is seen by the other.
//! - **envd** (`process.rs`, `fs.rs`, `files.rs`): the in-sandbox API the SDKs talk to once a
//!   sandbox exists (Connect-RPC with JSON, `connect.rs`), answered by the server from our
//!   `Sandbox` trait. Its requests carry the sandbox's id (the `E2b-Sandbox-Id` header, or a
//!   `PORT-ID.DOMAIN` host name) and its envd access token (`X-Access-Token`), which every
//!   sandbox gets, whatever `secure` says.
//! - **Templates** (`templates.rs`): names the operator maps to images and tiers; `base` is
//!   built in.

mod connect;
mod control;
mod files;
mod fs;
mod interp;
mod list;
mod logs;
mod metrics;
mod ports;
mod process;
mod signed;
mod snapshots;
mod templates;
mod watch;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

pub use interp::JUPYTER_PORT;
pub use templates::{Template, TemplateError};

pub(crate) use control::routes as control_routes;
pub(crate) use snapshots::Snaps;
pub(crate) use templates::Templates;

use crate::{Entry, Shared};

/// The port envd listens on in an E2B sandbox; the SDKs address it in `E2b-Sandbox-Port`.
pub const ENVD_PORT: u16 = 49983;

/// The envd version this server reports. The SDKs gate features on it: from 0.5.7 they
/// upload one file per request as `application/octet-stream`; features of later versions
/// that this server does not have (file metadata, 0.6.2; watch events with entries, 0.6.3)
/// are then refused by the SDK itself with a clear message instead of silently dropped.
pub const ENVD_VERSION: &str = "0.5.7";

/// What E2B's API says about a sandbox beyond our own info: its template, its envd access
/// token, its metadata and environment, and the processes started through envd.
pub(crate) struct Meta {
    pub(crate) template: String,
    pub(crate) access_token: crate::Token,
    pub(crate) env_vars: BTreeMap<String, String>,
    /// The directory relative paths and commands start from: the template's home
    /// (`/home/user`, E2B's, unless the operator said otherwise; see [`templates`]).
    pub(crate) home: String,
    pub(crate) allow_internet: Option<bool>,
    pub(crate) network: std::sync::Mutex<serde_json::Value>,
    pub(crate) auto_pause: bool,
    /// Whether envd's requests resume it when it is paused (E2B's `autoResume`).
    pub(crate) auto_resume: bool,
    /// Its timeout, seconds: what a resume on traffic gives it again.
    pub(crate) timeout_s: u64,
    pub(crate) cpus: u32,
    pub(crate) memory_mib: u64,
    pub(crate) disk_mib: u64,
    pub(crate) procs: process::Procs,
    /// Places for its upgraded connections (WebSockets) through [`ports`].
    pub(crate) tunnels: Arc<tokio::sync::Semaphore>,
    /// Its ports published for [`ports`] so far: the sandbox's port, where on this host.
    pub(crate) ports: tokio::sync::Mutex<std::collections::HashMap<u16, std::net::SocketAddr>>,
    /// The token its other ports require (`network.allowPublicTraffic: false`), sent as
    /// `e2b-traffic-access-token`; `None`: they are open to whoever knows the sandbox's id.
    pub(crate) traffic_token: Option<crate::Token>,
    /// Its last metrics samples ([`metrics`]).
    pub(crate) samples: metrics::Samples,
    /// Its directory watches ([`watch`]).
    pub(crate) watchers: watch::Watchers,
    /// What happened to it ([`logs`]).
    pub(crate) log: logs::Log,
    /// Its code interpreter's contexts ([`interp`]).
    pub(crate) contexts: interp::Contexts,
}

impl Meta {
    fn new(template: String, spec: &sandbox_core::SandboxSpec) -> Self {
        Meta {
            template,
            access_token: crate::Token::generate(),
            env_vars: spec.env.clone(),
            home: spec
                .workspace_alias
                .clone()
                .unwrap_or_else(|| sandbox_core::WORKSPACE_MOUNT.to_string()),
            allow_internet: None,
            network: std::sync::Mutex::new(serde_json::Value::Null),
            auto_pause: false,
            auto_resume: false,
            timeout_s: 300,
            cpus: spec.limits.cpu_millis.div_ceil(1000).max(1),
            memory_mib: spec.limits.memory_bytes >> 20,
            disk_mib: spec.limits.disk_bytes >> 20,
            procs: process::Procs::default(),
            tunnels: Arc::new(tokio::sync::Semaphore::new(ports::MAX_TUNNELS)),
            ports: Default::default(),
            traffic_token: None,
            samples: Default::default(),
            watchers: Default::default(),
            log: Default::default(),
            contexts: Default::default(),
        }
    }
}

/// The E2B side of `entry`: what its E2B create recorded, or (a sandbox made through API
/// v1) one made now, with a fresh access token.
pub(crate) fn meta(entry: &Entry) -> Arc<Meta> {
    Arc::clone(entry.e2b.get_or_init(|| {
        let mut m = Meta::new("v1".into(), entry.sandbox.spec());
        // Made through API v1, whose clients never opted into E2B's open ports: its
        // ports take a traffic token, which E2B's connect answer carries.
        m.traffic_token = Some(crate::Token::generate());
        Arc::new(m)
    }))
}

/// The E2B state every entry carries (empty until E2B's API first touches it).
pub(crate) type Slot = OnceLock<Arc<Meta>>;

/// The sandbox and port a request addresses: the SDKs' `E2b-Sandbox-Id` and
/// `E2b-Sandbox-Port` headers (with `E2B_SANDBOX_URL`), or a `PORT-ID.DOMAIN` host name
/// (with `E2B_DOMAIN`, when the operator gave the server that domain). `None`: a request
/// for the server's own APIs.
fn target(h: &HeaderMap, domain: Option<&str>) -> Option<Result<(String, u16), connect::RpcError>> {
    if let Some(id) = h.get("e2b-sandbox-id") {
        let port = match h.get("e2b-sandbox-port") {
            None => ENVD_PORT,
            Some(p) => match p.to_str().ok().and_then(|p| p.parse::<u16>().ok()) {
                Some(p) => p,
                None => return Some(Err(bad_target("`E2b-Sandbox-Port` is not a port number"))),
            },
        };
        return Some(match id.to_str() {
            Ok(id) if !id.is_empty() => Ok((id.to_string(), port)),
            _ => Err(bad_target("`E2b-Sandbox-Id` is not a sandbox id")),
        });
    }
    let domain = domain?;
    let host = h.get(header::HOST)?.to_str().ok()?;
    let host = host.rsplit_once(':').map_or(host, |(h, p)| {
        if p.bytes().all(|b| b.is_ascii_digit()) {
            h
        } else {
            host
        }
    });
    let sub = host.strip_suffix(domain)?.strip_suffix('.')?;
    let (port, id) = sub.split_once('-')?;
    let port = port.parse::<u16>().ok()?;
    (!id.is_empty() && !id.contains('.')).then(|| Ok((id.to_string(), port)))
}

fn bad_target(why: &str) -> connect::RpcError {
    connect::RpcError::invalid(why)
}

/// A request envd's routes serve: the sandbox it addressed (its access token checked).
#[derive(Clone)]
pub(crate) struct Envd {
    pub(crate) entry: Arc<Entry>,
    pub(crate) meta: Arc<Meta>,
    /// The server's body limit (what an upload may unpack to).
    pub(crate) body_limit: usize,
    /// Cancelled when the server stops: its streams end then.
    pub(crate) stop: tokio_util::sync::CancellationToken,
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Envd {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Response> {
        parts.extensions.get::<Envd>().cloned().ok_or_else(|| {
            connect::RpcError::new(connect::Code::Internal, "no sandbox for this request")
                .into_response()
        })
    }
}

/// Middleware over the whole server: a request addressed to a sandbox (see [`target`]) goes
/// to envd's routes, with its access token checked, or (another port) to that port of the
/// sandbox ([`ports`]); any other request goes on to the server's own APIs.
pub(crate) async fn dispatch(
    State((s, routes, gate)): State<(Arc<Shared>, SandboxRoutes, crate::auth::Gate)>,
    mut req: Request,
    next: Next,
) -> Response {
    use tower::ServiceExt;
    let signed = signed::Signed::of(&req);
    let (entry, id, port) = match target(req.headers(), s.config.e2b_domain.as_deref()) {
        Some(Ok((id, port))) => {
            // As E2B's edge answers: a sandbox that is not running (gone, or paused and not
            // resumed by traffic) is a 502, which the SDKs read as "not running".
            let entry = s.lock().get(&id).cloned();
            let Some(entry) = entry else {
                return api_error(
                    StatusCode::BAD_GATEWAY,
                    format!(
                        "sandbox {id} is not running: it was killed, timed out, or never existed"
                    ),
                );
            };
            (entry, id, port)
        }
        Some(Err(e)) => return e.into_response(),
        // A signed file URL made under `E2B_SANDBOX_URL` names no sandbox: its signature
        // does (see `signed`).
        None => {
            let Some(sig) = signed.clone() else {
                return next.run(req).await;
            };
            let shared = Arc::clone(&s);
            let found = tokio::task::spawn_blocking(move || signed::find(&shared, &sig))
                .await
                .ok()
                .flatten();
            let Some(entry) = found else {
                return signed::invalid();
            };
            let id = entry.info.id.clone();
            (entry, id, ENVD_PORT)
        }
    };
    let meta = meta(&entry);
    // The envd port takes the sandbox's access token (or, on `/files`, a URL it signed); its
    // other ports are open to whoever knows its id (E2B's default), or take its traffic token.
    // `/execute` on the code interpreter's port runs code: it takes the envd token too.
    let interpreter = port == interp::JUPYTER_PORT;
    let runs_code = interpreter && req.uri().path() == "/execute";
    let denied = if port == ENVD_PORT && !req.headers().contains_key("x-access-token") {
        match &signed {
            Some(sig) => sig.check(&meta.access_token),
            None => check_token(
                &req,
                "x-access-token",
                Some(&meta.access_token),
                "send the sandbox's envd access token in `X-Access-Token` (E2B's create and \
                 connect answers carry it as `envdAccessToken`), or sign the file URL with it",
            ),
        }
    } else if port == ENVD_PORT || runs_code {
        check_token(
            &req,
            "x-access-token",
            Some(&meta.access_token),
            "send the sandbox's envd access token in `X-Access-Token` (E2B's create and \
             connect answers carry it as `envdAccessToken`)",
        )
        .or_else(|| traffic(&req, &meta).filter(|_| runs_code))
    } else if interpreter && req.headers().contains_key("x-access-token") {
        check_token(&req, "x-access-token", Some(&meta.access_token), "")
            .or_else(|| traffic(&req, &meta))
    } else {
        traffic(&req, &meta)
    };
    if let Some(why) = denied {
        return why;
    }
    // One of its owner's requests in flight until the answer's head is made.
    let _permit = match gate.admit(&entry.owner.0) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    // A paused sandbox answers nothing unless it resumes on traffic (E2B's `autoResume`).
    if entry.life.state() == crate::api::SandboxState::Paused {
        if !meta.auto_resume {
            return api_error(
                StatusCode::BAD_GATEWAY,
                format!("sandbox {id} is paused: connect to it to resume it"),
            );
        }
        if let Err(e) = crate::lifetime::resume(Arc::clone(&entry)).await {
            return connect::RpcError::from(e).into_response();
        }
        // Resumed with its timeout again, as E2B's auto-resume does.
        entry.life.set_deadline(Some(
            std::time::Instant::now() + std::time::Duration::from_secs(meta.timeout_s),
        ));
    }
    // Marks it in use (not idle) while the answer's head is made.
    let in_use = match crate::lifetime::InUse::enter(Arc::clone(&entry)).await {
        Ok(g) => g,
        Err(e) => return connect::RpcError::from(e).into_response(),
    };
    if port != ENVD_PORT && !interpreter {
        let r = ports::forward(&s, entry, meta, port, req).await;
        drop(in_use);
        return r;
    }
    req.extensions_mut().insert(Envd {
        entry,
        meta,
        body_limit: s.config.body_limit,
        stop: s.stopping(),
    });
    let router = if interpreter {
        routes.interpreter
    } else {
        routes.envd
    };
    let r = match router.oneshot(req).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    drop(in_use);
    r
}

/// The check of a sandbox's ports other than envd's: its traffic token, when it has one.
fn traffic(req: &Request, meta: &Meta) -> Option<Response> {
    check_token(
        req,
        "e2b-traffic-access-token",
        meta.traffic_token.as_ref(),
        "this sandbox was created with `allowPublicTraffic: false`: send its \
         `trafficAccessToken` in `e2b-traffic-access-token`",
    )
}

/// What requests addressed to a sandbox reach: envd's routes, and its code interpreter's.
#[derive(Clone)]
pub(crate) struct SandboxRoutes {
    envd: Router,
    interpreter: Router,
}

/// `None` when `req` carries `token` in `header` (or no token is wanted), else the 401.
fn check_token(
    req: &Request,
    header: &str,
    token: Option<&crate::Token>,
    hint: &str,
) -> Option<Response> {
    let token = token?;
    let presented = req.headers().get(header).map(|v| v.as_bytes());
    let why = match presented {
        Some(p) if token.matches(p) => return None,
        Some(_) => format!("the `{header}` is not this sandbox's"),
        None => hint.to_string(),
    };
    Some(connect::RpcError::new(connect::Code::Unauthenticated, why).into_response())
}

/// The routes of requests addressed to a sandbox (reached through [`dispatch`] only):
/// envd's, and the code interpreter's ([`interp`]); bodies up to `limit` bytes, each
/// answer's head within `timeout` (a stream then flows on).
pub(crate) fn sandbox_routes(limit: usize, timeout: std::time::Duration) -> SandboxRoutes {
    SandboxRoutes {
        envd: envd_routes(limit, timeout),
        interpreter: interp::routes(limit).layer(axum::middleware::from_fn(
            move |req: Request, next: Next| async move {
                match tokio::time::timeout(timeout, next.run(req)).await {
                    Ok(r) => r,
                    Err(_) => (
                        StatusCode::GATEWAY_TIMEOUT,
                        format!("the request took longer than the server's limit of {timeout:?}"),
                    )
                        .into_response(),
                }
            },
        )),
    }
}

fn envd_routes(limit: usize, timeout: std::time::Duration) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/envs", get(envs))
        .route("/files", get(files::read).post(files::write))
        .route("/process.Process/{method}", post(process::call))
        .route("/filesystem.Filesystem/{method}", post(fs::call))
        .fallback(|uri: axum::http::Uri| async move {
            connect::RpcError::new(
                connect::Code::NotFound,
                format!("envd has no endpoint {uri} here"),
            )
            .into_response()
        })
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(
            move |req: Request, next: Next| async move {
                match tokio::time::timeout(timeout, next.run(req)).await {
                    Ok(r) => r,
                    Err(_) => connect::RpcError::new(
                        connect::Code::DeadlineExceeded,
                        format!("the request took longer than the server's limit of {timeout:?}"),
                    )
                    .into_response(),
                }
            },
        ))
}

async fn health(e: Envd) -> StatusCode {
    match e.entry.sandbox.health_check().await {
        Ok(()) => StatusCode::NO_CONTENT,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

async fn envs(e: Envd) -> axum::Json<BTreeMap<String, String>> {
    axum::Json(e.meta.env_vars.clone())
}

/// A time as E2B's API writes it (RFC 3339, UTC).
pub(crate) fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// An error as E2B's control plane answers: its status and `{"code", "message"}`.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "code": self.status.as_u16(), "message": self.message });
        (self.status, axum::Json(body)).into_response()
    }
}

/// A [`Failure`], answered.
pub(crate) fn api_error(status: StatusCode, message: impl Into<String>) -> Response {
    failure(status, message).into_response()
}

/// A [`Failure`].
pub(crate) fn failure(status: StatusCode, message: impl Into<String>) -> Failure {
    Failure {
        status,
        message: message.into(),
    }
}

/// Query parameter `k`, when given, as a whole number from 0 to `max`; else the 400 that
/// says it is to be `what` (e.g. "a Unix time in seconds").
pub(crate) fn whole_param(
    q: &BTreeMap<String, String>,
    k: &str,
    max: i64,
    what: &str,
) -> Result<Option<i64>, Failure> {
    q.get(k)
        .map(|v| {
            v.parse::<i64>()
                .ok()
                .filter(|n| (0..=max).contains(n))
                .ok_or_else(|| {
                    failure(
                        StatusCode::BAD_REQUEST,
                        format!("`{k}` is {what}, not `{v}`"),
                    )
                })
        })
        .transpose()
}

/// A path as envd takes it (absolute, `~/...`, or relative to the home), made absolute and
/// lexically clean. No host path is ever formed from it: file operations run inside the
/// sandbox, as its user ([`fs`]).
pub(crate) fn resolve(home: &str, path: &str) -> Result<String, connect::RpcError> {
    if path.contains('\0') {
        return Err(connect::RpcError::invalid("a path with a NUL byte"));
    }
    let joined = if let Some(rest) = path.strip_prefix("~/") {
        format!("{home}/{rest}")
    } else if path == "~" || path.is_empty() {
        home.to_string()
    } else if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{home}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for p in joined.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

impl Envd {
    /// The workspace-relative form of `abs` in this sandbox (see [`in_workspace`]).
    pub(crate) fn in_workspace<'a>(&self, abs: &'a str) -> Option<&'a str> {
        in_workspace(self.entry.sandbox.spec().workspace_alias.as_deref(), abs)
    }
}

/// The workspace-relative form of `abs` (a path [`resolve`] made), `""` for the workspace
/// itself, when it lies in the workspace: beneath `/workspace` or beneath `alias`, the
/// sandbox's alias of it.
fn in_workspace<'a>(alias: Option<&str>, abs: &'a str) -> Option<&'a str> {
    let beneath = |root: &str| {
        abs.strip_prefix(root)
            .filter(|r| r.is_empty() || r.starts_with('/'))
            .map(|r| r.trim_start_matches('/'))
    };
    beneath(sandbox_core::WORKSPACE_MOUNT).or_else(|| alias.and_then(beneath))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_is_found_by_its_mount_and_its_alias() {
        let m = |abs| in_workspace(Some("/home/user"), abs);
        assert_eq!(m("/workspace/a/b"), Some("a/b"));
        assert_eq!(m("/workspace"), Some(""));
        assert_eq!(m("/home/user/x"), Some("x"));
        assert_eq!(m("/home/user"), Some(""));
        assert_eq!(m("/home/username/x"), None);
        assert_eq!(m("/workspaces/a"), None);
        assert_eq!(m("/tmp/a"), None);
        assert_eq!(in_workspace(None, "/home/user/x"), None);
    }

    #[test]
    fn paths_resolve_against_the_home_and_stay_absolute() {
        let h = "/workspace";
        assert_eq!(resolve(h, "a/b.txt").unwrap(), "/workspace/a/b.txt");
        assert_eq!(resolve(h, "~/x").unwrap(), "/workspace/x");
        assert_eq!(resolve(h, "").unwrap(), "/workspace");
        assert_eq!(resolve(h, "/tmp/./y/../z").unwrap(), "/tmp/z");
        assert_eq!(resolve(h, "../../../etc").unwrap(), "/etc");
        assert_eq!(resolve(h, "/").unwrap(), "/");
        assert!(resolve(h, "a\0b").is_err());
    }

    #[test]
    fn requests_name_their_sandbox_by_header_or_host() {
        let mut h = HeaderMap::new();
        assert!(target(&h, Some("sb.test")).is_none());
        h.insert(header::HOST, "8000-abc.sb.test:3000".parse().unwrap());
        assert_eq!(
            target(&h, Some("sb.test")).unwrap().ok().unwrap(),
            ("abc".to_string(), 8000)
        );
        assert!(target(&h, None).is_none());
        h.insert(header::HOST, "8000-abc.other.test".parse().unwrap());
        assert!(target(&h, Some("sb.test")).is_none());
        h.insert("e2b-sandbox-id", "xyz".parse().unwrap());
        assert_eq!(
            target(&h, None).unwrap().ok().unwrap(),
            ("xyz".to_string(), ENVD_PORT)
        );
        h.insert("e2b-sandbox-port", "nope".parse().unwrap());
        assert!(target(&h, None).unwrap().is_err());
    }
}
