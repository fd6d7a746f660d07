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
//!
//! What a client with a valid token can and cannot reach (no host access, none of the
//! server's loopback or private networks unless the operator grants them, signed snapshots)
//! and the tests that play such a client: `docs/threat-model.md` in the repository.

#![forbid(unsafe_code)]

/// The API's bodies (the `sandbox-api` crate, shared with the remote client).
pub use sandbox_api as api;
pub mod auth;
pub mod error;
mod keep;
mod lifetime;
pub mod mcp;
pub mod openapi;
mod processes;
mod routes;
mod run;
pub mod signing;
mod warm;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sandbox_core::{
    Capabilities, Sandbox, SandboxSpec, SnapshotId, SnapshotStore, Tier, TierStatus,
};

pub use auth::{Clients, ClientsError, Token};

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

    /// The backend of `tier`, if this provider has it, for the server's warm pools
    /// ([`ServerConfig::warm`]); `None` (the default): specs are never pooled.
    fn backend(&self, tier: Tier) -> Option<sandbox_core::DynBackend> {
        let _ = tier;
        None
    }
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

    fn backend(&self, tier: Tier) -> Option<sandbox_core::DynBackend> {
        (tier == self.0.tier()).then(|| Arc::clone(&self.0))
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
    /// Whether clients' sandboxes may reach the server's loopback, its private networks
    /// (RFC 1918, CGNAT, ULA) and its host's own addresses. Default `false`: a policy listing
    /// such a range is refused (403, `forbidden`), and the egress proxy refuses them at
    /// connect time whatever a name resolves to ([`sandbox_core::ServerNetworks`], installed
    /// for the whole process by [`Server::new`]). `true` for a local daemon serving its own
    /// user.
    pub allow_private_networks: bool,
    /// The key the server signs its snapshots with ([`signing`]): a snapshot it did not sign
    /// (a client's upload, or one written to a client's own store) restores only on tiers
    /// whose restore takes files alone, unless [`allow_host_access`](Self::allow_host_access).
    /// `None` (the default): a key made for this process (so its snapshots verify only until
    /// it exits); `serve` keeps one in its state directory.
    pub snapshot_key: Option<Arc<signing::SnapshotKey>>,
    /// Where snapshots go (`POST /v1/sandboxes/{id}/snapshot`) and come from (restore,
    /// fork). `None` (the default): the snapshot endpoints answer `501 unsupported`.
    pub snapshot_store: Option<Arc<dyn SnapshotStore>>,
    /// How often lifetimes (TTL, idle timeouts) are checked. Default 1 s.
    pub reap_interval: Duration,
    /// Each named client's own snapshot store (with [`Clients`]); a client without one uses
    /// [`snapshot_store`](Self::snapshot_store).
    pub client_snapshot_stores: HashMap<String, Arc<dyn SnapshotStore>>,
    /// Most requests one client may have in flight (more are refused with 429). Default 64.
    pub max_requests_per_client: usize,
    /// Keep sandboxes across a restart: when [`Server::serve`] stops, every sandbox is
    /// snapshotted into its client's store and recorded in this file (what cannot be
    /// snapshotted is destroyed); the next server with the same file restores them under the
    /// same ids with [`Server::restore_kept`], before it serves. `None` (the default): they
    /// are destroyed.
    pub keep_file: Option<std::path::PathBuf>,
    /// Ready sandboxes kept for each spec clients created recently (see `docs/server.md`,
    /// "Warm pools"): the next create of the same spec takes one instead of waiting for a
    /// creation. Specs that reach into the host, hold secrets or name an image by a tag are
    /// never pooled. Default 0: no pools.
    pub warm: usize,
    /// How long a spec's pool lives without a create of that spec (and the oldest a pooled
    /// sandbox may be). Default 5 minutes.
    pub warm_idle: Duration,
    /// Which build this server is, reported by `GET /v1/tiers` (e.g. the CLI's version and
    /// its executable's identity). Default `None`.
    pub build: Option<String>,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("body_limit", &self.body_limit)
            .field("request_timeout", &self.request_timeout)
            .field("max_sandboxes", &self.max_sandboxes)
            .field("allow_host_access", &self.allow_host_access)
            .field("allow_private_networks", &self.allow_private_networks)
            .field("snapshot_key", &self.snapshot_key.is_some())
            .field("snapshot_store", &self.snapshot_store.is_some())
            .field("reap_interval", &self.reap_interval)
            .field(
                "client_snapshot_stores",
                &self.client_snapshot_stores.keys().collect::<Vec<_>>(),
            )
            .field("max_requests_per_client", &self.max_requests_per_client)
            .field("keep_file", &self.keep_file)
            .field("warm", &self.warm)
            .field("warm_idle", &self.warm_idle)
            .field("build", &self.build)
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
            allow_private_networks: false,
            snapshot_key: None,
            snapshot_store: None,
            reap_interval: Duration::from_secs(1),
            client_snapshot_stores: HashMap::new(),
            max_requests_per_client: 64,
            keep_file: None,
            warm: 0,
            warm_idle: Duration::from_secs(300),
            build: None,
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

    /// Sets [`snapshot_key`](Self::snapshot_key).
    pub fn snapshot_key(mut self, key: signing::SnapshotKey) -> Self {
        self.snapshot_key = Some(Arc::new(key));
        self
    }

    /// Sets [`allow_private_networks`](Self::allow_private_networks).
    pub fn allow_private_networks(mut self, allow: bool) -> Self {
        self.allow_private_networks = allow;
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

    /// Gives client `name` a snapshot store of its own.
    pub fn client_snapshot_store(
        mut self,
        name: impl Into<String>,
        store: Arc<dyn SnapshotStore>,
    ) -> Self {
        self.client_snapshot_stores.insert(name.into(), store);
        self
    }

    /// Sets [`keep_file`](Self::keep_file).
    pub fn keep_on_exit(mut self, file: impl Into<std::path::PathBuf>) -> Self {
        self.keep_file = Some(file.into());
        self
    }

    /// Sets [`warm`](Self::warm): ready sandboxes kept per recently created spec.
    pub fn warm(mut self, per_spec: usize) -> Self {
        self.warm = per_spec;
        self
    }

    /// Sets [`warm_idle`](Self::warm_idle).
    pub fn warm_idle(mut self, d: Duration) -> Self {
        self.warm_idle = d;
        self
    }

    /// Sets [`build`](Self::build).
    pub fn build(mut self, build: impl Into<String>) -> Self {
        self.build = Some(build.into());
        self
    }

    /// Sets [`max_requests_per_client`](Self::max_requests_per_client).
    pub fn max_requests_per_client(mut self, n: usize) -> Self {
        self.max_requests_per_client = n;
        self
    }

    /// The snapshot store of client `name`.
    fn snapshot_store_for(&self, name: &str) -> Option<Arc<dyn SnapshotStore>> {
        self.client_snapshot_stores
            .get(name)
            .cloned()
            .or_else(|| self.snapshot_store.clone())
    }
}

/// The addresses of this host's interfaces (what a client must not reach through a public
/// address of the server itself). Empty if they cannot be listed.
fn own_addresses() -> Vec<std::net::IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        tracing::warn!("cannot list this host's addresses; only loopback and private ranges are refused to clients");
        return Vec::new();
    };
    addrs
        .filter_map(|a| {
            let sa = a.address?;
            if let Some(v4) = sa.as_sockaddr_in() {
                return Some(std::net::IpAddr::V4(v4.ip()));
            }
            sa.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip()))
        })
        .collect()
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
    /// The client that made it: the only one that sees it.
    owner: auth::Caller,
    /// Its processes spawned through the API.
    procs: processes::Table,
}

impl Entry {
    /// Its info, with its state now.
    fn info(&self) -> api::SandboxInfo {
        let mut info = self.info.clone();
        info.state = self.life.state();
        info
    }
}

/// What every request handler shares.
struct Shared {
    provider: Arc<dyn Provider>,
    config: ServerConfig,
    sandboxes: Mutex<HashMap<String, Arc<Entry>>>,
    /// How many sandboxes the last [`Server::serve`] kept for the next run (`keep_file`).
    kept: std::sync::atomic::AtomicUsize,
    /// The warm pools ([`ServerConfig::warm`]).
    warm: warm::Warm,
    /// Teardowns running in the background (a destroy that did not wait, a reaped sandbox):
    /// [`Server::destroy_all`] waits for them.
    teardowns: tokio_util::task::TaskTracker,
    /// Sandboxes of `POST /v1/run` running now (outside the table, counted against
    /// `max_sandboxes`).
    running: std::sync::atomic::AtomicUsize,
    /// The last answer of `GET /v1/tiers` and when it was made (see [`TIERS_FRESH`]).
    tiers: Mutex<Option<(std::time::Instant, api::TierList)>>,
    /// Requests in flight, and when the last one ended ([`Server::idle_for`]).
    in_flight: std::sync::atomic::AtomicUsize,
    last_request: Mutex<std::time::Instant>,
}

/// Counts a request in flight while it lives (until its answer's head is made).
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: Arc<Shared>) -> Self {
        shared
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight(shared)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        *self
            .0
            .last_request
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = std::time::Instant::now();
        self.0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// How long an answer of `GET /v1/tiers` is given again before the provider is asked anew
/// (a tier that is unavailable is probed again on every ask, which can take a while).
pub const TIERS_FRESH: Duration = Duration::from_secs(1);

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Entry>>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The entry of sandbox `id`, without using it (its info). Another client's sandbox is
    /// not found, as one that does not exist.
    fn get(&self, id: &str, caller: &auth::Caller) -> Result<Arc<Entry>, ApiError> {
        self.lock()
            .get(id)
            .filter(|e| &e.owner == caller)
            .cloned()
            .ok_or_else(|| ApiError::no_sandbox(id))
    }

    /// Sandbox `id` for a request that uses it: resumed first if its idle timeout paused it,
    /// and not paused or reaped for idleness while the returned guard lives.
    async fn enter(&self, id: &str, caller: &auth::Caller) -> Result<lifetime::InUse, ApiError> {
        let e = self.get(id, caller)?;
        lifetime::InUse::enter(e).await
    }

    /// Takes sandbox `id` out of the table (it is the caller's to destroy).
    fn take(&self, id: &str, caller: &auth::Caller) -> Option<Arc<Entry>> {
        let mut all = self.lock();
        if all.get(id).is_some_and(|e| &e.owner == caller) {
            all.remove(id)
        } else {
            None
        }
    }

    /// Destroys `sandbox` in the background (tracked: shutdown waits for it); `why`, when
    /// the server decided it, is logged.
    fn destroy_later(&self, id: String, sandbox: Arc<dyn Sandbox>, why: Option<&'static str>) {
        self.teardowns.spawn(async move {
            if let Some(why) = why {
                tracing::info!(sandbox = %id, "destroyed: {why}");
            }
            if let Err(err) = sandbox.destroy().await {
                tracing::warn!(sandbox = %id, error = %err, "destroy failed");
            }
        });
    }
}

/// The warm pools' counters ([`Server::warm_stats`]), summed over the specs pooled now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WarmStats {
    /// Specs with a pool.
    pub pools: usize,
    /// Sandboxes ready in them.
    pub ready: usize,
    /// Creates served by a ready sandbox.
    pub hits: u64,
    /// Creates of a pooled spec that found its pool empty (and created at once).
    pub misses: u64,
}

/// A listener without its token.
enum Either {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

/// The service: its sandboxes and its API. Cheap to clone (clones share everything).
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
    /// The sessions of the MCP endpoint on `serve`, per client.
    mcp: Arc<Mutex<HashMap<String, mcp::SandboxMcp>>>,
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
    /// TCP with several clients; every request carries one client's token, and each client
    /// sees only its own sandboxes and snapshots.
    TcpClients(tokio::net::TcpListener, Clients),
    /// A Unix socket (make its file `0600`: its permissions are the only check).
    Unix(tokio::net::UnixListener),
}

impl Server {
    /// A server whose sandboxes come from `provider`.
    ///
    /// Unless [`ServerConfig::allow_private_networks`], this makes the whole process refuse
    /// its host's loopback, private networks and own addresses to every sandbox's egress
    /// ([`sandbox_core::ServerNetworks::refuse_in_this_process`]).
    ///
    /// Its snapshot stores sign what the server writes and refuse to feed a snapshot it did
    /// not sign to a tier whose restore would trust it ([`signing`]).
    pub fn new(provider: Arc<dyn Provider>, mut config: ServerConfig) -> Server {
        if !config.allow_private_networks {
            sandbox_core::ServerNetworks::new(own_addresses()).refuse_in_this_process();
        }
        let key = match config.snapshot_key.clone() {
            Some(k) => Some(k),
            None => match signing::SnapshotKey::generate() {
                Ok(k) => Some(Arc::new(k)),
                Err(e) => {
                    tracing::warn!(error = %e, "no snapshot key: every snapshot is treated as a client's");
                    None
                }
            },
        };
        let trust_all = config.allow_host_access;
        let wrap =
            |s: Arc<dyn SnapshotStore>| signing::SigningStore::wrap(s, key.clone(), trust_all);
        config.snapshot_store = config.snapshot_store.take().map(&wrap);
        config.client_snapshot_stores = std::mem::take(&mut config.client_snapshot_stores)
            .into_iter()
            .map(|(n, s)| (n, wrap(s)))
            .collect();
        Server {
            shared: Arc::new(Shared {
                provider,
                warm: warm::Warm::new(config.warm, config.warm_idle),
                config,
                sandboxes: Mutex::new(HashMap::new()),
                kept: std::sync::atomic::AtomicUsize::new(0),
                teardowns: tokio_util::task::TaskTracker::new(),
                running: std::sync::atomic::AtomicUsize::new(0),
                tiers: Mutex::new(None),
                in_flight: std::sync::atomic::AtomicUsize::new(0),
                last_request: Mutex::new(std::time::Instant::now()),
            }),
            mcp: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// The API as an `axum` router (for embedding in another server; [`serve`](Self::serve)
    /// uses it). `token`: required on every request (`None`: no check, for a Unix socket).
    pub fn router(&self, token: Option<Token>) -> axum::Router {
        self.router_for(token.map(Clients::one))
    }

    /// The API for several clients, each seeing only its own sandboxes and snapshots
    /// (`None`: no check, one principal, for a Unix socket).
    pub fn router_for(&self, clients: Option<Clients>) -> axum::Router {
        routes::router(Arc::clone(&self.shared), self.gate(clients))
    }

    fn gate(&self, clients: Option<Clients>) -> auth::Gate {
        auth::Gate::new(clients, self.shared.config.max_requests_per_client)
    }

    /// The MCP service of client `name` (made on first use, with the client's store).
    fn mcp_for(&self, name: &str) -> mcp::SandboxMcp {
        let mut all = self.mcp.lock().unwrap_or_else(|p| p.into_inner());
        all.entry(name.to_string())
            .or_insert_with(|| {
                let config = self.shared.config.clone();
                mcp::SandboxMcp::new(Arc::clone(&self.shared.provider))
                    .with_snapshot_store(self.shared.config.snapshot_store_for(name))
                    .with_spec_check(Arc::new(move |spec| {
                        routes::check_spec(&config, spec, true)
                    }))
            })
            .clone()
    }

    /// Restores the sandboxes the last server with this [`keep_file`](ServerConfig::keep_file)
    /// kept, under their ids, labels and clients (their lifetimes start again); returns how
    /// many came back and, for each that did not, why. Call it before [`serve`](Self::serve).
    pub async fn restore_kept(&self) -> (usize, Vec<String>) {
        match &self.shared.config.keep_file {
            Some(file) => keep::restore_kept(&self.shared, file).await,
            None => (0, Vec::new()),
        }
    }

    /// How many sandboxes [`serve`](Self::serve) snapshotted into the keep file when it
    /// stopped (with [`ServerConfig::keep_on_exit`]; 0 before it has stopped).
    pub fn kept(&self) -> usize {
        self.shared.kept.load(std::sync::atomic::Ordering::SeqCst)
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
        let (clients, served) = match listener {
            Listener::Tcp(l, token) => (Some(Clients::one(token)), Either::Tcp(l)),
            Listener::TcpClients(l, clients) => (Some(clients), Either::Tcp(l)),
            Listener::Unix(l) => (None, Either::Unix(l)),
        };
        let gate = self.gate(clients);
        let names: Vec<String> = gate.names().map(str::to_string).collect();
        let app = routes::router(Arc::clone(&self.shared), gate.clone());
        // Every request, the API's and MCP's, counts as activity (`idle_for`).
        let counted = Arc::clone(&self.shared);
        let count = axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let guard = InFlight::new(Arc::clone(&counted));
                async move {
                    let r = next.run(req).await;
                    drop(guard);
                    r
                }
            },
        );
        let served = match served {
            Either::Tcp(l) => {
                use axum::serve::ListenerExt;
                let local = l.local_addr().ok();
                let app = app
                    .merge(self.mcp_router(&names, gate, local, &stop))
                    .layer(count);
                // No Nagle: an event stream's small writes (a terminal's echo, a process's
                // first line) would otherwise wait for the client's delayed ACK (~40 ms).
                let l = l.tap_io(|tcp| {
                    if let Err(e) = tcp.set_nodelay(true) {
                        tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection");
                    }
                });
                axum::serve(l, app).with_graceful_shutdown(shutdown).await
            }
            Either::Unix(l) => {
                let app = app
                    .merge(self.mcp_router(&names, gate, None, &stop))
                    .layer(count);
                axum::serve(l, app).with_graceful_shutdown(shutdown).await
            }
        };
        reaper.abort();
        if let Some(file) = &self.shared.config.keep_file {
            let n = keep::keep_all(&self.shared, file).await;
            self.shared
                .kept
                .store(n, std::sync::atomic::Ordering::SeqCst);
            tracing::info!("kept {n} sandboxes for the next run");
        }
        self.destroy_all().await;
        served
    }

    /// The MCP endpoint (`/mcp`, streamable HTTP), behind the same gate as the API: each
    /// client of `names` has MCP sessions of its own. `local`: the TCP address served (a
    /// loopback one keeps `rmcp`'s `Host` checks against DNS rebinding; elsewhere the token
    /// is the check). Its sessions end when `stop` is cancelled.
    fn mcp_router(
        &self,
        names: &[String],
        gate: auth::Gate,
        local: Option<std::net::SocketAddr>,
        stop: &tokio_util::sync::CancellationToken,
    ) -> axum::Router {
        use tower::ServiceExt;
        let loopback = local.is_some_and(|a| a.ip().is_loopback());
        let per_client: HashMap<String, axum::Router> = names
            .iter()
            .map(|n| {
                let r = mcp::http_router(
                    self.mcp_for(n),
                    loopback,
                    self.shared.config.body_limit,
                    stop.child_token(),
                );
                (n.clone(), r)
            })
            .collect();
        let per_client = Arc::new(per_client);
        let dispatch = tower::service_fn(move |req: axum::extract::Request| {
            let caller = req
                .extensions()
                .get::<auth::Caller>()
                .cloned()
                .unwrap_or_default();
            let router = per_client.get(&*caller.0).cloned();
            async move {
                match router {
                    Some(r) => r.oneshot(req).await,
                    None => Ok(axum::response::IntoResponse::into_response(
                        ApiError::no_sandbox("mcp"),
                    )),
                }
            }
        });
        axum::Router::new()
            .route_service("/mcp", dispatch)
            .layer(axum::middleware::from_fn_with_state(gate, auth::gate))
    }

    /// How long the server has been idle: no request in flight (an answer's head made ends
    /// one; a stream that flows on is held by its sandbox), no sandbox held (the API's, a
    /// `POST /v1/run`'s, an MCP session's), for this long since the last request ended or
    /// since it was made. `None` while it is not idle. Its warm pools do not count. For an
    /// exit when idle (`serve --idle-exit`).
    pub fn idle_for(&self) -> Option<Duration> {
        use std::sync::atomic::Ordering;
        let s = &self.shared;
        let mcp_live: usize = self
            .mcp
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(mcp::SandboxMcp::live)
            .sum();
        if s.in_flight.load(Ordering::SeqCst) > 0
            || s.running.load(Ordering::SeqCst) > 0
            || !s.lock().is_empty()
            || mcp_live > 0
        {
            return None;
        }
        Some(
            s.last_request
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .elapsed(),
        )
    }

    /// The warm pools' counters ([`ServerConfig::warm`]).
    pub fn warm_stats(&self) -> WarmStats {
        self.shared.warm.stats()
    }

    /// Destroys every sandbox this server holds (the MCP endpoint's too) and those its warm
    /// pools hold ready, and waits for the teardowns running in the background.
    pub async fn destroy_all(&self) {
        self.shared.warm.shutdown_all().await;
        let all: Vec<Arc<Entry>> = self.shared.lock().drain().map(|(_, e)| e).collect();
        for e in all {
            if let Err(err) = e.sandbox.destroy().await {
                tracing::warn!(sandbox = %e.info.id, error = %err, "destroy at shutdown");
            }
        }
        let sessions: Vec<mcp::SandboxMcp> = self
            .mcp
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for m in sessions {
            m.destroy_all().await;
        }
        self.shared.teardowns.close();
        self.shared.teardowns.wait().await;
        self.shared.teardowns.reopen();
    }
}
