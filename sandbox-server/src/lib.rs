//! agent-sandbox as a service: a long-lived process that owns sandboxes of every tier and
//! serves a versioned JSON API over HTTP, so agents in other processes (Python, TypeScript, an
//! orchestrator handing a sandbox from one worker to the next) create, use, find and destroy
//! them. The CLI runs it as `agent-sandbox serve`; `docs/server.md` is the user's guide.
//!
//! - **Transport.** TCP (loopback unless the caller names another address) with a bearer
//!   token on every request ([`auth`]), or a Unix socket whose file permissions are the
//!   check. HTTP/1.1 through `axum` (on `hyper`): the well-kept stack, not a hand-written one.
//! - **API v1** ([`Server::router`], documented by [`openapi::document`] at `GET /v1/openapi.json`):
//!   create (a spec, a tier or the selector's choice, labels, a lifetime), list (by label),
//!   get, exec, streaming exec (server-sent events), files (write, read, list), snapshot,
//!   restore and fork (N sandboxes from one snapshot), pause/resume, network policy and
//!   events, destroy.
//! - **Lifetimes**: a TTL, and an idle timeout that pauses or destroys; a paused sandbox
//!   resumes on the next request that uses it.
//! - **Bad input** gets a 4xx with a JSON body whose `kind` and `message` say what and why
//!   ([`error::ApiError`]): malformed JSON, unknown fields, a body over the limit, an escaping
//!   path, an unknown id. The server goes on serving.
//! - **Shutdown** ([`Server::serve`] with a shutdown future): stop accepting, let in-flight
//!   requests finish, then destroy every sandbox this server made.
//!
//! - **MCP** ([`mcp`]): the same sandboxes as tools for agents, over stdio
//!   (`agent-sandbox mcp`) and streamable HTTP (`/mcp` on [`Server::serve`]), on `rmcp`, the
//!   official Rust MCP SDK.
//!
//! The server takes its sandboxes from a [`Provider`] (the facade's `Runtime` is one), so it
//! has no engine of its own.

pub mod api;
pub mod auth;
pub mod error;
mod lifetime;
pub mod mcp;
pub mod openapi;
mod routes;
pub mod upload;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sandbox_core::{
    Capabilities, Sandbox, SandboxSpec, SnapshotId, SnapshotStore, Tier, TierStatus,
};

pub use auth::Token;
pub use error::ApiError;

/// Where sandboxes come from: creates one for a spec, on a tier or the selector's choice,
/// and restores snapshots.
#[async_trait]
pub trait Provider: Send + Sync + 'static {
    /// Creates a sandbox of `spec` on `tier` (`None`: the best tier for the spec's language
    /// that this host can run).
    async fn create(
        &self,
        spec: &SandboxSpec,
        tier: Option<Tier>,
    ) -> sandbox_core::Result<Box<dyn Sandbox>>;

    /// Restores snapshot `id` from `store` on the tier that took it.
    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
    ) -> sandbox_core::Result<Box<dyn Sandbox>>;

    /// What `tier` can do here, if this provider has it (used to refuse a lifetime the tier
    /// cannot honour, such as pausing when idle on a tier without pause).
    fn capabilities(&self, tier: Tier) -> Option<Capabilities>;

    /// Which tiers this host can run, with the reason and the fix for those it cannot
    /// (`GET /v1/tiers`). May answer from a cache of tiers found available before.
    async fn probe(&self) -> Vec<TierStatus>;
}

/// A [`Provider`] of one backend: every sandbox on its tier, whatever tier a client names.
/// For serving a single engine (and for tests); the facade's `Runtime` serves every tier.
pub struct OneBackend(pub Arc<dyn sandbox_core::Backend>);

impl std::fmt::Debug for OneBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OneBackend").field(&self.0.tier()).finish()
    }
}

#[async_trait]
impl Provider for OneBackend {
    async fn create(
        &self,
        spec: &SandboxSpec,
        tier: Option<Tier>,
    ) -> sandbox_core::Result<Box<dyn Sandbox>> {
        if let Some(t) = tier.filter(|t| *t != self.0.tier()) {
            return Err(sandbox_core::Error::Unavailable {
                tier: t,
                reason: format!("this server runs only the {} tier", self.0.tier()),
                fix: format!("ask for the {} tier, or for none", self.0.tier()),
            });
        }
        self.0
            .create(spec, sandbox_core::ResolvedSecrets::none())
            .await
    }

    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
    ) -> sandbox_core::Result<Box<dyn Sandbox>> {
        self.0
            .restore(store, id, sandbox_core::ResolvedSecrets::none())
            .await
    }

    fn capabilities(&self, tier: Tier) -> Option<Capabilities> {
        (tier == self.0.tier()).then(|| self.0.capabilities())
    }

    async fn probe(&self) -> Vec<TierStatus> {
        vec![self.0.probe().await]
    }
}

/// Limits of a [`Server`]. `#[non_exhaustive]`: build it with [`ServerConfig::default`] and
/// the setters.
#[derive(Clone)]
#[non_exhaustive]
pub struct ServerConfig {
    /// Largest request body (a file upload, an exec's stdin). Default 64 MiB.
    pub body_limit: usize,
    /// Longest a request may take (a long exec included). Default 15 minutes.
    pub request_timeout: Duration,
    /// Most live sandboxes. Default 1000.
    pub max_sandboxes: usize,
    /// Whether clients may give specs that reach into the server's host: a `rootfs` or host
    /// `mounts`, a host-directory workspace, `pass_env`, `secrets` (resolved from the
    /// server's secret source), or an image from a local path (`oci:`, `docker-archive:`).
    /// Default `false`: such a spec is refused (403, `forbidden`), so a token grants
    /// sandboxes, not the server's files or environment.
    pub allow_host_access: bool,
    /// Where snapshots go (`POST /v1/sandboxes/{id}/snapshot`) and come from (restore,
    /// fork). `None` (the default): the snapshot endpoints answer `501 unsupported`.
    pub snapshot_store: Option<Arc<dyn SnapshotStore>>,
    /// How often lifetimes (TTL, idle timeouts) are checked. Default 1 s.
    pub reap_interval: Duration,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("body_limit", &self.body_limit)
            .field("request_timeout", &self.request_timeout)
            .field("max_sandboxes", &self.max_sandboxes)
            .field("allow_host_access", &self.allow_host_access)
            .field("snapshot_store", &self.snapshot_store.is_some())
            .field("reap_interval", &self.reap_interval)
            .finish()
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            body_limit: 64 << 20,
            request_timeout: Duration::from_secs(15 * 60),
            max_sandboxes: 1000,
            allow_host_access: false,
            snapshot_store: None,
            reap_interval: Duration::from_secs(1),
        }
    }
}

impl ServerConfig {
    /// Sets [`body_limit`](Self::body_limit).
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.body_limit = bytes;
        self
    }

    /// Sets [`request_timeout`](Self::request_timeout).
    pub fn request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout = d;
        self
    }

    /// Sets [`allow_host_access`](Self::allow_host_access).
    pub fn allow_host_access(mut self, allow: bool) -> Self {
        self.allow_host_access = allow;
        self
    }

    /// Sets [`max_sandboxes`](Self::max_sandboxes).
    pub fn max_sandboxes(mut self, n: usize) -> Self {
        self.max_sandboxes = n;
        self
    }

    /// Sets [`snapshot_store`](Self::snapshot_store).
    pub fn snapshot_store(mut self, store: Arc<dyn SnapshotStore>) -> Self {
        self.snapshot_store = Some(store);
        self
    }

    /// Sets [`reap_interval`](Self::reap_interval).
    pub fn reap_interval(mut self, every: Duration) -> Self {
        self.reap_interval = every;
        self
    }
}

/// What in `spec` reaches into the server's host (see
/// [`ServerConfig::allow_host_access`]), named; `None` when nothing does.
pub fn host_access(spec: &SandboxSpec) -> Option<&'static str> {
    if spec.rootfs.is_some() {
        return Some("`rootfs` (a directory of the server's host)");
    }
    if !spec.mounts.is_empty() {
        return Some("`mounts` (paths of the server's host)");
    }
    if !matches!(spec.workspace, sandbox_core::Workspace::Empty) {
        return Some("a host-directory `workspace`");
    }
    if !spec.pass_env.is_empty() {
        return Some("`pass_env` (the server's environment)");
    }
    if !spec.secrets.is_empty() {
        return Some("`secrets` (resolved from the server's secret source)");
    }
    if matches!(
        spec.image,
        Some(
            sandbox_core::ImageRef::OciLayout { .. } | sandbox_core::ImageRef::DockerArchive { .. }
        )
    ) {
        return Some("an image from a local path (`oci:` or `docker-archive:`)");
    }
    None
}

/// One sandbox the server owns.
struct Entry {
    sandbox: Arc<dyn Sandbox>,
    info: api::SandboxInfo,
    life: lifetime::Lifetime,
}

impl Entry {
    /// Its info, with its state now.
    fn info(&self) -> api::SandboxInfo {
        api::SandboxInfo {
            state: self.life.state(),
            ..self.info.clone()
        }
    }
}

/// What every request handler shares.
struct Shared {
    provider: Arc<dyn Provider>,
    config: ServerConfig,
    sandboxes: Mutex<HashMap<String, Arc<Entry>>>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Entry>>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The entry of sandbox `id`, without using it (its info).
    fn get(&self, id: &str) -> Result<Arc<Entry>, ApiError> {
        self.lock()
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::no_sandbox(id))
    }

    /// Sandbox `id` for a request that uses it: resumed first if its idle timeout paused it,
    /// and not paused or reaped for idleness while the returned guard lives.
    async fn enter(&self, id: &str) -> Result<lifetime::InUse, ApiError> {
        let e = self.get(id)?;
        lifetime::InUse::enter(e).await
    }

    /// Takes sandbox `id` out of the table (it is the caller's to destroy).
    fn take(&self, id: &str) -> Option<Arc<Entry>> {
        self.lock().remove(id)
    }
}

/// The service: its sandboxes and its API. Cheap to clone (clones share everything).
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
    /// The sessions of the MCP endpoint on `serve` (one principal: whoever holds the token).
    mcp: mcp::SandboxMcp,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("config", &self.shared.config)
            .field("sandboxes", &self.shared.lock().len())
            .finish()
    }
}

/// Where a [`Server`] listens.
#[derive(Debug)]
#[non_exhaustive]
pub enum Listener {
    /// TCP; every request must carry the token.
    Tcp(tokio::net::TcpListener, Token),
    /// A Unix socket (make its file `0600`: its permissions are the only check).
    Unix(tokio::net::UnixListener),
}

impl Server {
    /// A server whose sandboxes come from `provider`.
    pub fn new(provider: Arc<dyn Provider>, config: ServerConfig) -> Server {
        let mcp = mcp::SandboxMcp::new(Arc::clone(&provider))
            .with_snapshot_store(config.snapshot_store.clone());
        Server {
            shared: Arc::new(Shared {
                provider,
                config,
                sandboxes: Mutex::new(HashMap::new()),
            }),
            mcp,
        }
    }

    /// The API as an `axum` router (for embedding in another server; [`serve`](Self::serve)
    /// uses it). `token`: required on every request (`None`: no check, for a Unix socket).
    pub fn router(&self, token: Option<Token>) -> axum::Router {
        routes::router(Arc::clone(&self.shared), token)
    }

    /// The ids of the live sandboxes.
    pub fn sandbox_ids(&self) -> Vec<String> {
        self.shared.lock().keys().cloned().collect()
    }

    /// Serves on `listener` until `shutdown` completes; then stops accepting, lets in-flight
    /// requests finish, and destroys every sandbox it made. Lifetimes (TTL, idle timeouts)
    /// are enforced while it serves.
    pub async fn serve(
        &self,
        listener: Listener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let reaper = tokio::spawn(lifetime::reap(Arc::clone(&self.shared)));
        let stop = tokio_util::sync::CancellationToken::new();
        let stopping = stop.clone();
        let shutdown = async move {
            shutdown.await;
            // Ends the MCP endpoint's open event streams, which would hold the graceful
            // shutdown open.
            stopping.cancel();
        };
        let served = match listener {
            Listener::Tcp(l, token) => {
                let local = l.local_addr().ok();
                let app = self.router(Some(token.clone())).merge(self.mcp_router(
                    Some(token),
                    local,
                    &stop,
                ));
                axum::serve(l, app).with_graceful_shutdown(shutdown).await
            }
            Listener::Unix(l) => {
                let app = self.router(None).merge(self.mcp_router(None, None, &stop));
                axum::serve(l, app).with_graceful_shutdown(shutdown).await
            }
        };
        reaper.abort();
        self.destroy_all().await;
        served
    }

    /// The MCP endpoint (`/mcp`, streamable HTTP), behind the same token as the API.
    /// `local`: the TCP address served (a loopback one keeps `rmcp`'s `Host` checks against
    /// DNS rebinding; elsewhere the token is the check). Its sessions end when `stop` is
    /// cancelled.
    pub fn mcp_router(
        &self,
        token: Option<Token>,
        local: Option<std::net::SocketAddr>,
        stop: &tokio_util::sync::CancellationToken,
    ) -> axum::Router {
        mcp::http_router(
            self.mcp.clone(),
            local.is_some_and(|a| a.ip().is_loopback()),
            self.shared.config.body_limit,
            stop.child_token(),
        )
        .layer(axum::middleware::from_fn_with_state(
            token,
            auth::require_token,
        ))
    }

    /// Destroys every sandbox this server holds (the MCP endpoint's too).
    pub async fn destroy_all(&self) {
        let all: Vec<Arc<Entry>> = self.shared.lock().drain().map(|(_, e)| e).collect();
        for e in all {
            if let Err(err) = e.sandbox.destroy().await {
                tracing::warn!(sandbox = %e.info.id, error = %err, "destroy at shutdown");
            }
        }
        self.mcp.destroy_all().await;
    }
}
