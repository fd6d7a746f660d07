//! agent-sandbox as a service: a long-lived process that owns sandboxes of every tier and
//! serves a versioned JSON API over HTTP, so agents in other processes (Python, TypeScript, an
//! orchestrator handing a sandbox from one worker to the next) create, use, find and destroy
//! them. The CLI runs it as `agent-sandbox serve`; `docs/server.md` is the user's guide.
//!
//! - **Transport.** TCP (loopback unless the caller names another address) with a bearer
//!   token on every request ([`auth`]), or a Unix socket whose file permissions are the
//!   check. HTTP/1.1 through `axum` (on `hyper`): the well-kept stack, not a hand-written one.
//! - **API v1** ([`Server::router`], documented by [`openapi::document`] at `GET /v1/openapi.json`):
//!   create (a spec, a tier or the selector's choice, labels), list (by label), get, exec,
//!   streaming exec (server-sent events), files (write, read, list), destroy.
//! - **Bad input** gets a 4xx with a JSON body whose `kind` and `message` say what and why
//!   ([`error::ApiError`]): malformed JSON, unknown fields, a body over the limit, an escaping
//!   path, an unknown id. The server goes on serving.
//! - **Shutdown** ([`Server::serve`] with a shutdown future): stop accepting, let in-flight
//!   requests finish, then destroy every sandbox this server made.
//!
//! - **MCP** ([`mcp`]): the same sandboxes as tools for agents, over stdio
//!   (`agent-sandbox mcp`), on `rmcp`, the official Rust MCP SDK.
//!
//! The server takes its sandboxes from a [`Provider`] (the facade's `Runtime` is one), so it
//! has no engine of its own.

pub mod api;
pub mod auth;
pub mod error;
pub mod mcp;
pub mod openapi;
mod routes;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sandbox_core::{Sandbox, SandboxSpec, Tier};

pub use auth::Token;
pub use error::ApiError;

/// Where sandboxes come from: creates one for a spec, on a tier or the selector's choice.
#[async_trait]
pub trait Provider: Send + Sync + 'static {
    /// Creates a sandbox of `spec` on `tier` (`None`: the best tier for the spec's language
    /// that this host can run).
    async fn create(
        &self,
        spec: &SandboxSpec,
        tier: Option<Tier>,
    ) -> sandbox_core::Result<Box<dyn Sandbox>>;
}

/// Limits of a [`Server`]. `#[non_exhaustive]`: build it with [`ServerConfig::default`] and
/// the setters.
#[derive(Debug, Clone)]
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
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            body_limit: 64 << 20,
            request_timeout: Duration::from_secs(15 * 60),
            max_sandboxes: 1000,
            allow_host_access: false,
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

    fn get(&self, id: &str) -> Result<Arc<Entry>, ApiError> {
        self.lock()
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::no_sandbox(id))
    }
}

/// The service: its sandboxes and its API. Cheap to clone (clones share everything).
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
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
        Server {
            shared: Arc::new(Shared {
                provider,
                config,
                sandboxes: Mutex::new(HashMap::new()),
            }),
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
    /// requests finish, and destroys every sandbox it made.
    pub async fn serve(
        &self,
        listener: Listener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let served = match listener {
            Listener::Tcp(l, token) => {
                axum::serve(l, self.router(Some(token)))
                    .with_graceful_shutdown(shutdown)
                    .await
            }
            Listener::Unix(l) => {
                axum::serve(l, self.router(None))
                    .with_graceful_shutdown(shutdown)
                    .await
            }
        };
        self.destroy_all().await;
        served
    }

    /// Destroys every sandbox this server holds.
    pub async fn destroy_all(&self) {
        let all: Vec<Arc<Entry>> = self.shared.lock().drain().map(|(_, e)| e).collect();
        for e in all {
            if let Err(err) = e.sandbox.destroy().await {
                tracing::warn!(sandbox = %e.info.id, error = %err, "destroy at shutdown");
            }
        }
    }
}
