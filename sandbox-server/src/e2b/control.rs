//! E2B's control plane (`spec/openapi.yml` of e2b-dev/E2B): sandboxes created from
//! templates, listed, inspected, timed out, paused, resumed on connect, killed; what one
//! self-hosted server does not have (teams, billing, API keys, nodes, volumes, secrets,
//! template builds) answers 501 saying so. Behind the same gate as API v1: the SDKs' key
//! (`X-API-Key: e2b_<token>`) is a client's token, and a client sees only its sandboxes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{any, get, post, put};
use axum::{Json, Router};
use sandbox_core::policy::{Cidr, DenyRule, HostRule};
use sandbox_core::NetworkPolicy;
use serde::Deserialize;

use super::list::listed_json;
use super::logs::Level;
use super::{failure as api_error, meta, Failure, Meta, Templates, ENVD_VERSION};
use crate::api::{LifetimeSpec, SandboxState};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::{lifetime, Entry, Shared};

/// Longest timeout a sandbox may have, as E2B's (a day).
pub(super) const MAX_TIMEOUT_S: u64 = 24 * 3600;

/// The control plane's routes.
pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/sandboxes", post(create).get(super::list::list_v1))
        .route("/v2/sandboxes", get(super::list::list_v2).post(create_v2))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect_v2))
        .route("/sandboxes/{id}/network", put(network))
        .route("/sandboxes/{id}/metrics", get(super::metrics::one))
        .route("/sandboxes/metrics", get(super::metrics::batch))
        .route("/sandboxes/{id}/logs", get(super::logs::v1))
        .route("/v2/sandboxes/{id}/logs", get(super::logs::v2))
        .route("/sandboxes/{id}/snapshots", post(super::snapshots::create))
        .route("/sandboxes/{id}/fork", post(super::snapshots::fork))
        .route("/snapshots", get(super::snapshots::list))
        .route("/templates", get(templates).post(no_builds))
        .route(
            "/templates/{id}",
            axum::routing::delete(super::snapshots::delete).fallback(no_builds),
        )
        .route("/templates/{id}/{*rest}", any(no_builds))
        .route("/v2/templates", any(no_builds))
        .route("/v2/templates/{*rest}", any(no_builds))
        .route("/v3/templates", any(no_builds))
        .route("/teams", any(not_here))
        .route("/teams/{*rest}", any(not_here))
        .route("/nodes", any(not_here))
        .route("/nodes/{*rest}", any(not_here))
        .route("/admin/{*rest}", any(not_here))
        .route("/access-tokens", any(not_here))
        .route("/access-tokens/{*rest}", any(not_here))
        .route("/api-keys", any(not_here))
        .route("/api-keys/{*rest}", any(not_here))
        .route("/volumes", any(not_here))
        .route("/volumes/{*rest}", any(not_here))
        .route("/secrets", any(not_here))
        .route("/secrets/{*rest}", any(not_here))
        .route("/health", get(|| async { StatusCode::OK }))
}

/// An answer of the control plane: its errors in E2B's shape.
pub(super) type Answer<T> = Result<T, Failure>;

pub(super) fn e2b(e: ApiError) -> Failure {
    api_error(e.status, e.message)
}

pub(super) fn not_found(id: &str) -> Failure {
    api_error(StatusCode::NOT_FOUND, format!("sandbox {id} not found"))
}

pub(super) fn bad(message: impl Into<String>) -> Failure {
    api_error(StatusCode::BAD_REQUEST, message)
}

fn unsupported(what: &str) -> Failure {
    api_error(
        StatusCode::NOT_IMPLEMENTED,
        format!("{what} is not supported by this agent-sandbox server (see docs/e2b.md)"),
    )
}

/// A JSON body, which E2B's clients may leave out; bad JSON is a 400 in E2B's shape.
pub(super) fn body<T: Default + serde::de::DeserializeOwned>(
    b: Result<Bytes, BytesRejection>,
) -> Answer<T> {
    crate::routes::body::optional_json(b).map_err(e2b)
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    auto_pause: bool,
    auto_pause_memory: Option<bool>,
    auto_resume: Option<AutoResume>,
    secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<Network>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    env_vars: BTreeMap<String, String>,
    mcp: Option<serde_json::Value>,
    iam: Option<serde_json::Value>,
    #[serde(default)]
    volume_mounts: Vec<serde_json::Value>,
}

#[derive(Deserialize, Default, Clone)]
struct AutoResume {
    #[serde(default)]
    enabled: serde_json::Value,
}

#[derive(Deserialize, Default, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct Network {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    allow_public_traffic: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    allow_out: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    deny_out: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    egress_proxy: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mask_request_host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rules: Option<serde_json::Value>,
}

/// E2B's egress settings as our policy: the internet (E2B's default) minus `denyOut`; with
/// the internet off or all of it denied (`0.0.0.0/0`), only `allowOut`. Link-local and, on
/// a server, its loopback and private networks stay refused whatever they say.
fn policy(allow_internet: Option<bool>, net: &Network) -> Answer<NetworkPolicy> {
    if net.egress_proxy.is_some() {
        return Err(unsupported("`network.egressProxy`"));
    }
    if net.mask_request_host.is_some() {
        return Err(unsupported("`network.maskRequestHost`"));
    }
    if net.rules.as_ref().is_some_and(|r| !r.is_null()) {
        return Err(unsupported("`network.rules` (request transforms)"));
    }
    let invalid = |e: sandbox_core::Error| bad(e.to_string());
    let all = |d: &String| d == "0.0.0.0/0" || d == "::/0";
    let internet = allow_internet.unwrap_or(true) && !net.deny_out.iter().any(all);
    if internet {
        if !net.allow_out.is_empty() && !net.deny_out.is_empty() {
            return Err(unsupported(
                "`allowOut` beside a `denyOut` that is not all of `0.0.0.0/0` (exceptions \
                 inside denied ranges)",
            ));
        }
        let deny = net
            .deny_out
            .iter()
            .map(|d| d.parse::<DenyRule>())
            .collect::<Result<_, _>>()
            .map_err(invalid)?;
        return Ok(NetworkPolicy::AllowInternet {
            deny,
            private: Vec::new(),
        });
    }
    if net.allow_out.is_empty() {
        return Ok(NetworkPolicy::DenyAll);
    }
    let (mut hosts, mut cidrs) = (Vec::new(), Vec::new());
    for a in &net.allow_out {
        match a.parse::<Cidr>() {
            Ok(c) => cidrs.push(c),
            Err(_) => hosts.push(a.parse::<HostRule>().map_err(invalid)?),
        }
    }
    Ok(NetworkPolicy::Allow {
        hosts,
        cidrs,
        ports: Vec::new(),
    })
}

pub(super) fn timeout_of(t: Option<u64>, default: u64) -> Answer<u64> {
    let t = t.unwrap_or(default);
    if t == 0 || t > MAX_TIMEOUT_S {
        return Err(bad(format!(
            "timeout {t} s: give 1 to {MAX_TIMEOUT_S} seconds"
        )));
    }
    Ok(t)
}

/// `POST /sandboxes`: a sandbox of 15 s unless the body says otherwise.
async fn create(
    s: State<Arc<Shared>>,
    caller: Caller,
    b: Result<Bytes, BytesRejection>,
) -> Answer<(StatusCode, Json<serde_json::Value>)> {
    create_with(s, caller, b, 15).await
}

/// `POST /v2/sandboxes`: the same body (`secure` aside), 300 s unless it says otherwise.
async fn create_v2(
    s: State<Arc<Shared>>,
    caller: Caller,
    b: Result<Bytes, BytesRejection>,
) -> Answer<(StatusCode, Json<serde_json::Value>)> {
    create_with(s, caller, b, 300).await
}

async fn create_with(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    b: Result<Bytes, BytesRejection>,
    default_timeout: u64,
) -> Answer<(StatusCode, Json<serde_json::Value>)> {
    let req: NewSandbox = body(b)?;
    if req.mcp.as_ref().is_some_and(|m| !m.is_null()) {
        return Err(unsupported("`mcp` (E2B's MCP gateway)"));
    }
    if req.iam.as_ref().is_some_and(|m| !m.is_null()) {
        return Err(unsupported("`iam`"));
    }
    if !req.volume_mounts.is_empty() {
        return Err(unsupported("`volumeMounts` (E2B volumes)"));
    }
    if req.auto_pause && req.auto_pause_memory == Some(false) {
        return Err(unsupported("`autoPauseMemory: false`"));
    }
    let auto_resume = req
        .auto_resume
        .as_ref()
        .is_some_and(|a| a.enabled == serde_json::Value::Bool(true));
    let timeout = timeout_of(req.timeout, default_timeout)?;
    if let Some(snap) = s.e2b_snapshots.find(&caller, &req.template_id) {
        let net = req.network.clone().unwrap_or_default();
        let asked = policy(req.allow_internet_access, &net)?;
        crate::access::check_network(&s.config, &asked).map_err(e2b)?;
        let opts = super::snapshots::Restore {
            timeout,
            metadata: req.metadata,
            network: Some(asked),
            public_ports: net.allow_public_traffic != Some(false),
            auto_pause: req.auto_pause,
            auto_resume,
        };
        let (entry, m) = super::snapshots::restore(&s, &caller, &snap, opts).await?;
        return Ok((StatusCode::CREATED, Json(sandbox_json(&s, &entry, &m))));
    }
    let templates = Templates::new(s.config.templates.clone());
    let Some(template) = templates.find(&req.template_id).cloned() else {
        return Err(api_error(
            StatusCode::NOT_FOUND,
            format!(
                "template `{}` is not one of this server's: {} (the operator adds templates \
                 with `agent-sandbox serve --template NAME=IMAGE`)",
                req.template_id,
                templates.names().join(", ")
            ),
        ));
    };
    let net = req.network.clone().unwrap_or_default();
    let policy = policy(req.allow_internet_access, &net)?;
    crate::access::check_network(&s.config, &policy).map_err(e2b)?;
    // The home is the workspace's alias where the tier can show one: a template's tier is
    // asked; the selector's choice is tried with it, and without it when that fails as
    // `Unsupported` (a provider whose tiers cannot, as a test's may) or `Unavailable` (the
    // selector passed over every available tier for it: a host with the microVM tier only).
    let alias = template.tier.is_none_or(|t| {
        s.provider
            .capabilities(t)
            .is_some_and(|c| c.workspace_alias)
    });
    let spec = template
        .spec(&req.env_vars, policy.clone(), alias)
        .map_err(|e| e2b(e.into()))?;
    crate::routes::admit::room(&s, 1).map_err(e2b)?;
    let sandbox = match s.create_pooled(&spec, template.tier).await {
        Err(sandbox_core::Error::Unsupported { .. } | sandbox_core::Error::Unavailable { .. })
            if spec.workspace_alias.is_some() && template.tier.is_none() =>
        {
            let plain = template
                .spec(&req.env_vars, policy, false)
                .map_err(|e| e2b(e.into()))?;
            s.create_pooled(&plain, template.tier).await
        }
        other => other,
    }
    .map_err(|e| e2b(e.into()))?
    .0;
    let mut lifetime = LifetimeSpec::default();
    lifetime.ttl_s = Some(timeout);
    let mut m = Meta::new(template.name.clone(), sandbox.spec());
    m.allow_internet = req.allow_internet_access;
    m.auto_pause = req.auto_pause;
    m.auto_resume = auto_resume;
    m.timeout_s = timeout;
    *m.network.lock().unwrap_or_else(|p| p.into_inner()) =
        serde_json::to_value(&net).unwrap_or_default();
    if let Some(mib) = template.memory_mib {
        m.memory_mib = mib;
    }
    if net.allow_public_traffic == Some(false) {
        m.traffic_token = Some(crate::Token::generate());
    }
    // The home: the workspace's alias, or the workspace itself, or (a home the operator
    // named that the tier could not alias) a directory made in the sandbox.
    let home = match (&template.home, &sandbox.spec().workspace_alias) {
        (_, Some(alias)) => alias.clone(),
        (None, None) => sandbox_core::WORKSPACE_MOUNT.to_string(),
        (Some(home), None) => {
            if home != sandbox_core::WORKSPACE_MOUNT {
                if let Err(why) = make_home(sandbox.as_ref(), home).await {
                    let _ = sandbox.destroy().await;
                    return Err(api_error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!(
                            "template `{}`: its home {home} cannot be made in the sandbox: {why}",
                            template.name
                        ),
                    ));
                }
            }
            home.clone()
        }
    };
    m.home = home;
    // The E2B side is the entry's from its first moment: no request can see it without.
    let info =
        crate::routes::admit::admit(&s, &caller, sandbox, req.metadata, lifetime, None, Some(m))
            .await
            .map_err(e2b)?;
    let entry = s.get(&info.id, &caller).map_err(e2b)?;
    let m = meta(&entry);
    entry.life.pause_at_deadline(m.auto_pause);
    m.log.push(
        Level::Info,
        "sandbox created",
        &[
            ("template", m.template.clone()),
            ("tier", entry.sandbox.tier().to_string()),
            ("timeoutSeconds", timeout.to_string()),
        ],
    );
    let _ = req.secure;
    Ok((StatusCode::CREATED, Json(sandbox_json(&s, &entry, &m))))
}

/// Makes `home` in the sandbox, as its user.
async fn make_home(sb: &dyn sandbox_core::Sandbox, home: &str) -> Result<(), String> {
    let req = sandbox_core::ExecRequest::argv(["mkdir", "-p", "--", home]);
    match sb.exec(req).await {
        Ok(r) if r.exit_code == Some(0) => Ok(()),
        Ok(r) => Err(String::from_utf8_lossy(&r.stderr).trim().to_string()),
        Err(err) => Err(err.to_string()),
    }
}

/// E2B's `Sandbox`: what a client needs to reach one.
pub(super) fn sandbox_json(s: &Shared, e: &Entry, m: &Meta) -> serde_json::Value {
    serde_json::json!({
        "templateID": m.template,
        "sandboxID": e.info.id,
        "alias": m.template,
        "clientID": "agent-sandbox",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": m.access_token.reveal(),
        "trafficAccessToken": m.traffic_token.as_ref().map(|t| t.reveal()),
        "domain": s.config.e2b_domain,
    })
}

/// E2B's `SandboxDetail`.
fn detail_json(s: &Shared, e: &Entry, m: &Meta) -> serde_json::Value {
    let mut v = listed_json(e, m);
    let extra = serde_json::json!({
        "envdAccessToken": m.access_token.reveal(),
        "allowInternetAccess": m.allow_internet,
        "domain": s.config.e2b_domain,
        "network": m.network.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        "lifecycle": {
            "autoResume": m.auto_resume,
            "onTimeout": if m.auto_pause { "pause" } else { "kill" },
        },
    });
    if let (Some(v), serde_json::Value::Object(extra)) = (v.as_object_mut(), extra) {
        v.extend(extra);
    }
    v
}

/// The caller's sandbox `id`, or E2B's 404 (another client's is not found either).
pub(super) fn entry(s: &Shared, caller: &Caller, id: &str) -> Answer<Arc<Entry>> {
    s.get(id, caller).map_err(|_| not_found(id))
}

async fn detail(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Answer<Json<serde_json::Value>> {
    let e = entry(&s, &caller, &id)?;
    let m = meta(&e);
    Ok(Json(detail_json(&s, &e, &m)))
}

async fn kill(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Answer<StatusCode> {
    let e = s.take(&id, &caller).ok_or_else(|| not_found(&id))?;
    e.sandbox.destroy().await.map_err(|e| e2b(e.into()))?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
struct Timeout {
    timeout: Option<u64>,
}

async fn set_timeout(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    b: Result<Bytes, BytesRejection>,
) -> Answer<StatusCode> {
    let t: Timeout = body(b)?;
    // 0: the timeout is now (what a timeout does, kill or pause, happens at once).
    let t = match t.timeout {
        Some(0) => 0,
        t => timeout_of(t, 15)?,
    };
    let e = entry(&s, &caller, &id)?;
    e.life
        .set_deadline(Some(Instant::now() + Duration::from_secs(t)));
    meta(&e)
        .log
        .push(Level::Info, "timeout set", &[("seconds", t.to_string())]);
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
struct Refresh {
    duration: Option<u64>,
}

async fn refresh(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    b: Result<Bytes, BytesRejection>,
) -> Answer<StatusCode> {
    let r: Refresh = body(b)?;
    let t = timeout_of(r.duration, 60)?;
    let e = entry(&s, &caller, &id)?;
    extend(&e, t);
    Ok(StatusCode::NO_CONTENT)
}

/// Moves the deadline to `t` seconds from now unless it is later already.
fn extend(e: &Entry, t: u64) {
    let at = Instant::now() + Duration::from_secs(t);
    if e.life.deadline().is_some_and(|d| d < at) {
        e.life.set_deadline(Some(at));
    }
}

async fn pause(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Answer<StatusCode> {
    let e = entry(&s, &caller, &id)?;
    if e.life.state() == SandboxState::Paused {
        return Err(api_error(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    let m = meta(&e);
    lifetime::pause(e).await.map_err(e2b)?;
    m.log.push(Level::Info, "sandbox paused", &[]);
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Resume {
    timeout: Option<u64>,
    #[serde(default)]
    auto_pause: bool,
}

async fn resume(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    b: Result<Bytes, BytesRejection>,
) -> Answer<(StatusCode, Json<serde_json::Value>)> {
    let r: Resume = body(b)?;
    let t = timeout_of(r.timeout, 15)?;
    let e = entry(&s, &caller, &id)?;
    if e.life.state() != SandboxState::Paused {
        return Err(api_error(
            StatusCode::CONFLICT,
            format!("sandbox {id} is not paused"),
        ));
    }
    lifetime::resume(Arc::clone(&e)).await.map_err(e2b)?;
    e.life
        .set_deadline(Some(Instant::now() + Duration::from_secs(t)));
    e.life.pause_at_deadline(r.auto_pause);
    let m = meta(&e);
    m.log.push(
        Level::Info,
        "sandbox resumed",
        &[("timeoutSeconds", t.to_string())],
    );
    Ok((StatusCode::CREATED, Json(sandbox_json(&s, &e, &m))))
}

/// `POST /sandboxes/{id}/connect`: resumes a paused sandbox for the timeout given (15 s
/// unless said), or extends a running one's to at least that.
async fn connect(
    s: State<Arc<Shared>>,
    caller: Caller,
    id: Path<String>,
    b: Result<Bytes, BytesRejection>,
) -> Answer<(StatusCode, Json<serde_json::Value>)> {
    connect_with(s, caller, id, b, 15).await
}

/// `POST /v2/sandboxes/{id}/connect`: the same, 300 s unless said.
async fn connect_v2(
    s: State<Arc<Shared>>,
    caller: Caller,
    id: Path<String>,
    b: Result<Bytes, BytesRejection>,
) -> Answer<(StatusCode, Json<serde_json::Value>)> {
    connect_with(s, caller, id, b, 300).await
}

async fn connect_with(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    b: Result<Bytes, BytesRejection>,
    default_timeout: u64,
) -> Answer<(StatusCode, Json<serde_json::Value>)> {
    let t: Timeout = body(b)?;
    let t = timeout_of(t.timeout, default_timeout)?;
    let e = entry(&s, &caller, &id)?;
    let was_paused = e.life.state() == SandboxState::Paused;
    if was_paused {
        lifetime::resume(Arc::clone(&e)).await.map_err(e2b)?;
        e.life
            .set_deadline(Some(Instant::now() + Duration::from_secs(t)));
    } else {
        extend(&e, t);
    }
    let m = meta(&e);
    if was_paused {
        m.log.push(
            Level::Info,
            "sandbox resumed on connect",
            &[("timeoutSeconds", t.to_string())],
        );
    }
    let status = if was_paused {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(sandbox_json(&s, &e, &m))))
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct NetworkUpdate {
    #[serde(flatten)]
    network: Network,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

async fn network(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    b: Result<Bytes, BytesRejection>,
) -> Answer<StatusCode> {
    let u: NetworkUpdate = body(b)?;
    let e = entry(&s, &caller, &id)?;
    let m = meta(&e);
    let policy = policy(u.allow_internet_access.or(m.allow_internet), &u.network)?;
    crate::access::check_network(&s.config, &policy).map_err(e2b)?;
    let used = crate::lifetime::InUse::enter(Arc::clone(&e))
        .await
        .map_err(e2b)?;
    used.sandbox
        .set_network_policy(policy)
        .await
        .map_err(|e| e2b(e.into()))?;
    let net = serde_json::to_value(&u.network).unwrap_or_default();
    m.log.push(
        Level::Info,
        "network updated",
        &[("network", net.to_string())],
    );
    *m.network.lock().unwrap_or_else(|p| p.into_inner()) = net;
    Ok(StatusCode::NO_CONTENT)
}

async fn templates(State(s): State<Arc<Shared>>) -> Json<Vec<serde_json::Value>> {
    let t = Templates::new(s.config.templates.clone());
    Json(
        t.all()
            .iter()
            .map(|t| {
                serde_json::json!({
                    "templateID": t.name,
                    "aliases": [t.name],
                    "names": [t.name],
                    "public": false,
                    "cpuCount": t.cpus.unwrap_or(1),
                    "memoryMB": t.memory_mib.unwrap_or(512),
                    "envdVersion": ENVD_VERSION,
                    "buildStatus": "ready",
                })
            })
            .collect(),
    )
}

async fn no_builds() -> Failure {
    unsupported("building templates (the operator names templates: `serve --template NAME=IMAGE`)")
}

async fn not_here(uri: axum::http::Uri) -> Failure {
    api_error(
        StatusCode::NOT_IMPLEMENTED,
        format!(
            "{} belongs to E2B's cloud (teams, API keys, nodes, volumes, secrets): one \
             self-hosted agent-sandbox server has none (see docs/e2b.md)",
            uri.path()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(allow: &[&str], deny: &[&str]) -> Network {
        Network {
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
            ..Network::default()
        }
    }

    #[test]
    fn e2b_egress_maps_onto_our_policies() {
        assert!(matches!(
            policy(Some(false), &net(&[], &[])).unwrap(),
            NetworkPolicy::DenyAll
        ));
        assert!(matches!(
            policy(None, &net(&[], &["1.1.1.1"])).unwrap(),
            NetworkPolicy::AllowInternet { deny, .. } if deny.len() == 1
        ));
        match policy(
            Some(true),
            &net(&["example.com", "8.8.8.8"], &["0.0.0.0/0"]),
        )
        .unwrap()
        {
            NetworkPolicy::Allow { hosts, cidrs, .. } => {
                assert_eq!(hosts.len(), 1);
                assert_eq!(cidrs[0].to_string(), "8.8.8.8/32");
            }
            p => panic!("{p:?}"),
        }
        assert!(policy(None, &net(&["a.com"], &["1.0.0.0/8"])).is_err());
        assert!(policy(Some(false), &net(&["not a host!"], &[])).is_err());
        let mut proxied = net(&[], &[]);
        proxied.egress_proxy = Some(serde_json::json!({}));
        assert_eq!(
            policy(None, &proxied).unwrap_err().status,
            StatusCode::NOT_IMPLEMENTED
        );
    }
}
