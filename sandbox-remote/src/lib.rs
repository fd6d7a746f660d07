//! `RemoteBackend`: the [`Backend`] and [`Sandbox`] traits over the v1 HTTP API of
//! `agent-sandbox serve` (the `sandbox-server` crate), so agent code written against the
//! traits runs unchanged against a server on this machine or another: register the remote
//! backends in a `Runtime` (or use them directly) and every create, exec, file, snapshot and
//! destroy is a request to the server.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use sandbox_core::{Backend, ExecRequest, Language, ResolvedSecrets, SandboxSpec, Tier};
//! use sandbox_remote::{RemoteConfig, RemoteServer};
//!
//! let server = RemoteServer::connect(
//!     RemoteConfig::new("http://127.0.0.1:7878")?.token_file("/run/user/1000/agent-sandbox/token")?,
//! )
//! .await?;
//! let backend = server.backend(Tier::Container).expect("the server runs containers");
//! let sb = backend.create(&SandboxSpec::new(Language::Python), ResolvedSecrets::none()).await?;
//! let out = sb.exec(ExecRequest::code("print(6*7)")).await?;
//! assert_eq!(out.stdout, b"42\n");
//! sb.destroy().await?;
//! # Ok(()) }
//! ```
//!
//! - **Addresses**: `http://HOST:PORT` (and `https://`, through a TLS front) with the server's
//!   bearer token, or `unix:/PATH` (`serve --unix`, no token).
//! - **Errors** come back as the library's variants (`SandboxGone`, `PathEscape`,
//!   `Unsupported`...), read from the server's error answers.
//! - **Capabilities** are the server's tier's (less proxy-held secrets, which are resolved
//!   where the sandbox runs). Background processes and terminals work as in the library
//!   ([`Process`](sandbox_core::Process): output streamed from the server, input sent
//!   per call); **published ports listen on the server's host** (loopback unless the
//!   server was started with `--allow-host-access`), so reach them there.
//! - **Snapshots** go into the caller's store: the server snapshots, the client copies the
//!   snapshot over (checked against its SHA-256s). `restore` sends a snapshot of the
//!   caller's store to the server first (once per snapshot and server).

#![forbid(unsafe_code)]

mod client;
mod error;
mod sandbox;
mod transfer;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use reqwest::Method;
use sandbox_api::{CreateSandbox, RestoreBody, SandboxInfo, TierInfo, TierList};
use sandbox_core::{
    Backend, Capabilities, Error, ResolvedSecrets, Result, Sandbox, SandboxSpec, SnapshotId,
    SnapshotStore, Tier, TierStatus, TimelineRecorder,
};

use client::Client;
use error::Failure;
pub use error::RemoteError;
pub use sandbox::RemoteSandbox;

/// Where a server is and how to talk to it. `#[non_exhaustive]`: build it with
/// [`RemoteConfig::new`] and the setters.
#[derive(Clone)]
#[non_exhaustive]
pub struct RemoteConfig {
    /// `http(s)://HOST:PORT` or `unix:/PATH`.
    pub address: String,
    /// The bearer token (TCP). Never printed by `Debug`.
    pub token: Option<String>,
    /// Labels given to every sandbox this client creates (`GET /v1/sandboxes?label=k=v`).
    pub labels: BTreeMap<String, String>,
    /// How long the tiers' statuses reported on connecting answer
    /// [`Backend::preflight`] (default [`PREFLIGHT_FRESH`]).
    pub preflight_fresh: std::time::Duration,
    /// Whether [`Sandbox::destroy`] returns as soon as the server has taken the sandbox out
    /// of use, its teardown going on there in the background (`DELETE ...?wait=false`): a
    /// one-shot client need not wait for it, but a failed teardown is then only in the
    /// server's log. Default `false`.
    pub destroy_without_waiting: bool,
    /// Whether [`RemoteServer::connect`] asks the server for its tiers (and so checks the
    /// address and the token at once). Without it the server has no backends here
    /// ([`RemoteServer::tiers`] is empty) and the first request is the first contact: for a
    /// client that only calls [`RemoteServer::run_once`] on a named tier. Default `true`.
    pub ask_tiers: bool,
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("address", &self.address)
            .field("token", &self.token.as_ref().map(|_| "<hidden>"))
            .field("labels", &self.labels)
            .field("preflight_fresh", &self.preflight_fresh)
            .field("destroy_without_waiting", &self.destroy_without_waiting)
            .field("ask_tiers", &self.ask_tiers)
            .finish()
    }
}

impl RemoteConfig {
    /// A server at `address`: `http://HOST:PORT`, `https://HOST:PORT` or `unix:/PATH`.
    pub fn new(address: &str) -> std::result::Result<Self, RemoteError> {
        let ok = address.starts_with("http://")
            || address.starts_with("https://")
            || address
                .strip_prefix("unix:")
                .is_some_and(|p| p.starts_with('/'));
        if !ok {
            return Err(RemoteError::BadAddress(address.to_string()));
        }
        Ok(RemoteConfig {
            address: address.trim_end_matches('/').to_string(),
            token: None,
            labels: BTreeMap::new(),
            preflight_fresh: PREFLIGHT_FRESH,
            destroy_without_waiting: false,
            ask_tiers: true,
        })
    }

    /// Sets [`ask_tiers`](Self::ask_tiers).
    pub fn ask_tiers(mut self, on: bool) -> Self {
        self.ask_tiers = on;
        self
    }

    /// Sets [`destroy_without_waiting`](Self::destroy_without_waiting).
    pub fn destroy_without_waiting(mut self, on: bool) -> Self {
        self.destroy_without_waiting = on;
        self
    }

    /// Sets how long the statuses reported on connecting answer
    /// [`Backend::preflight`] (zero: every preflight asks the server).
    pub fn preflight_fresh(mut self, fresh: std::time::Duration) -> Self {
        self.preflight_fresh = fresh;
        self
    }

    /// Sets the bearer token.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Reads the bearer token from a file (the first line, trimmed), as `serve` writes it.
    pub fn token_file(self, path: impl AsRef<Path>) -> std::result::Result<Self, RemoteError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| RemoteError::TokenFile {
            path: path.display().to_string(),
            source,
        })?;
        Ok(self.token(text.lines().next().unwrap_or_default().trim()))
    }

    /// Adds a label given to every sandbox this client creates.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }
}

/// A connected server: the tiers it has, and a [`RemoteBackend`] for each.
#[derive(Debug, Clone)]
pub struct RemoteServer {
    shared: Arc<Shared>,
    tiers: Vec<TierInfo>,
    /// The server's build, if it said.
    build: Option<String>,
    /// Until when the statuses in `tiers` answer preflights.
    fresh_until: std::time::Instant,
}

/// How long the tiers' statuses a server reported on connecting answer
/// [`Backend::preflight`] (a one-shot `run --server` connects, then creates at once); after
/// that, a preflight asks the server again.
pub const PREFLIGHT_FRESH: std::time::Duration = std::time::Duration::from_secs(2);

/// What every backend of one server shares.
#[derive(Debug)]
struct Shared {
    client: Arc<Client>,
    labels: BTreeMap<String, String>,
    /// [`RemoteConfig::destroy_without_waiting`].
    detach: bool,
    /// Snapshots of callers' stores already sent: (store's id) -> the server's id.
    sent: Mutex<HashMap<SnapshotId, SnapshotId>>,
}

impl RemoteServer {
    /// Connects: checks the address and the token by asking the server for its tiers.
    pub async fn connect(config: RemoteConfig) -> std::result::Result<Self, RemoteError> {
        // rustls without a built-in provider: ring, as the rest of the workspace uses.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut b = reqwest::Client::builder();
        let base = match config.address.strip_prefix("unix:") {
            Some(path) => {
                b = b.unix_socket(path);
                "http://localhost".to_string()
            }
            None => config.address.clone(),
        };
        // Plain HTTP (a Unix socket, `http://`) needs no certificates: not loading the
        // system's roots saves parsing the whole bundle (~2 ms of a one-shot `run --server`).
        if !base.starts_with("https://") {
            b = b.tls_certs_only(Vec::<reqwest::Certificate>::new());
        }
        let http = b.build().map_err(RemoteError::Client)?;
        let client = Arc::new(Client::new(
            http,
            base,
            config.token,
            config.address.clone(),
        ));
        let shared = Arc::new(Shared {
            client: Arc::clone(&client),
            labels: config.labels,
            detach: config.destroy_without_waiting,
            sent: Mutex::new(HashMap::new()),
        });
        let fresh_until = std::time::Instant::now() + config.preflight_fresh;
        if !config.ask_tiers {
            return Ok(RemoteServer {
                shared,
                tiers: Vec::new(),
                build: None,
                fresh_until,
            });
        }
        // The first request checks the address (its transport error is kept as the source)
        // and the token.
        let resp = client
            .request(Method::GET, "/v1/tiers")
            .send()
            .await
            .map_err(|source| RemoteError::Unreachable {
                server: config.address.clone(),
                source,
            })?;
        let list: TierList = async { client.read_json(client.check(resp).await?).await }
            .await
            .map_err(Failure::into_remote)?;
        Ok(RemoteServer {
            shared,
            tiers: list.tiers,
            build: list.build,
            fresh_until,
        })
    }

    /// The server's build as it reported it on connecting (`None`: it did not say).
    pub fn build(&self) -> Option<&str> {
        self.build.as_deref()
    }

    /// One command in a fresh sandbox of `spec` on `tier` (`None`: the server's choice for
    /// the spec's language), destroyed after it, in one request (`POST /v1/run`): the server
    /// takes a ready sandbox from its warm pools when it has one for this spec, and tears it
    /// down after answering. `build`: the server must be this build, else nothing runs
    /// ([`Error::Unavailable`] naming both). Errors are the library's, as for a create and
    /// an exec.
    pub async fn run_once(
        &self,
        spec: &SandboxSpec,
        tier: Option<Tier>,
        req: sandbox_core::ExecRequest,
        build: Option<&str>,
    ) -> Result<sandbox_api::RunReply> {
        // Errors before the server chose a tier name the one asked for (else the likeliest).
        let shown = tier.unwrap_or(Tier::Container);
        let mut body = sandbox_api::RunBody::new(spec.clone(), sandbox::exec_body(shown, req)?);
        body.tier = tier;
        body.build = build.map(str::to_string);
        let c = &self.shared.client;
        let req = c.request(Method::POST, "/v1/run").json(&body);
        c.json(req).await.map_err(|f| match f.kind.as_str() {
            "build_mismatch" => Error::Unavailable {
                tier: shown,
                reason: f.message,
                fix: "use a server of the build asked for, or run without one".into(),
            },
            _ => f.into_core(shown, None, None),
        })
    }

    /// The server's tiers as it reported them on connecting.
    pub fn tiers(&self) -> &[TierInfo] {
        &self.tiers
    }

    /// A backend for `tier`, if the server has it built in (available or not: its probe
    /// says).
    pub fn backend(&self, tier: Tier) -> Option<RemoteBackend> {
        let info = self.tiers.iter().find(|t| t.status.tier == tier)?;
        let caps = info.capabilities.clone()?;
        Some(RemoteBackend {
            shared: Arc::clone(&self.shared),
            tier,
            caps: carried(caps),
            reported: (info.status.clone(), self.fresh_until),
        })
    }

    /// A backend for every tier the server can run now.
    pub fn backends(&self) -> Vec<RemoteBackend> {
        self.tiers
            .iter()
            .filter(|t| t.status.available)
            .filter_map(|t| self.backend(t.status.tier))
            .collect()
    }
}

/// `caps` less what the v1 API does not carry.
fn carried(mut caps: Capabilities) -> Capabilities {
    // Secrets are resolved where the sandbox runs; a client's are not sent.
    caps.proxy_secrets = false;
    // API v1 has no usage endpoint yet: what the server's tier can count, the client
    // cannot ask for.
    caps.usage = false;
    // Nor a watch endpoint: a watch runs where the sandbox's workspace is.
    caps.watch = false;
    caps
}

/// One tier of a server, as a [`Backend`]: its sandboxes are [`RemoteSandbox`]es.
#[derive(Debug, Clone)]
pub struct RemoteBackend {
    shared: Arc<Shared>,
    tier: Tier,
    caps: Capabilities,
    /// The tier's status as the server reported it on connecting, and until when it answers
    /// preflights.
    reported: (TierStatus, std::time::Instant),
}

impl RemoteBackend {
    /// The server's address, as given.
    pub fn server(&self) -> &str {
        &self.shared.client.shown
    }

    fn sandbox(
        &self,
        info: SandboxInfo,
        spec: SandboxSpec,
        t: TimelineRecorder,
    ) -> Box<dyn Sandbox> {
        Box::new(
            RemoteSandbox::new(
                Arc::clone(&self.shared.client),
                info.id,
                info.tier,
                spec,
                t.finish(),
            )
            .destroy_without_waiting(self.shared.detach),
        )
    }

    /// Whether the server's store has snapshot `id`.
    async fn server_has(&self, id: &SnapshotId) -> bool {
        let c = &self.shared.client;
        let req = c.request(Method::GET, &format!("/v1/snapshots/{id}"));
        c.send(req).await.is_ok()
    }

    /// Restores snapshot `id` held by the server (its own id there) into a new sandbox.
    pub async fn restore_on_server(&self, id: &SnapshotId) -> Result<Box<dyn Sandbox>> {
        let t = TimelineRecorder::start();
        let c = &self.shared.client;
        let mut body = RestoreBody::default();
        body.labels = self.shared.labels.clone();
        let req = c
            .request(Method::POST, &format!("/v1/snapshots/{id}/restore"))
            .json(&body);
        let info: SandboxInfo = c
            .json(req)
            .await
            .map_err(|f| f.into_core(self.tier, None, None))?;
        // The spec as the server restored it.
        let req = c.request(Method::GET, &format!("/v1/snapshots/{id}/manifest"));
        let spec = match c.json::<sandbox_core::SnapshotManifest>(req).await {
            Ok(m) => m.spec,
            Err(f) => return Err(f.into_core(self.tier, None, None)),
        };
        Ok(self.sandbox(info, spec, t))
    }
}

#[async_trait]
impl Backend for RemoteBackend {
    fn tier(&self) -> Tier {
        self.tier
    }

    fn capabilities(&self) -> Capabilities {
        self.caps.clone()
    }

    /// The status the server reported on connecting, for
    /// [`RemoteConfig::preflight_fresh`] after it (a round trip saved for a create right
    /// after connecting; the create itself is then the check); a fresh
    /// [`probe`](Backend::probe) after that.
    async fn preflight(&self) -> TierStatus {
        let (status, until) = &self.reported;
        if std::time::Instant::now() < *until {
            return status.clone();
        }
        self.probe().await
    }

    async fn probe(&self) -> TierStatus {
        let c = &self.shared.client;
        let req = c.request(Method::GET, "/v1/tiers");
        match c.json::<TierList>(req).await {
            Ok(l) => match l.tiers.into_iter().find(|t| t.status.tier == self.tier) {
                Some(t) => t.status,
                None => TierStatus::unavailable(
                    self.tier,
                    format!("the server at {} no longer has this tier", c.shown),
                    "ask its operator, or use another tier",
                ),
            },
            Err(f) => TierStatus::unavailable(
                self.tier,
                format!("the server at {}: {}", c.shown, f.into_remote()),
                "start `agent-sandbox serve` there, or check the address and the token",
            ),
        }
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        spec.validate()?;
        if !secrets.is_empty() {
            return Err(Error::unsupported(
                self.tier,
                "secrets through a remote server (they are resolved where the sandbox runs; \
                 the v1 API does not send a client's)",
            ));
        }
        let t = TimelineRecorder::start();
        let c = &self.shared.client;
        let mut body = CreateSandbox::new(spec.clone());
        body.tier = Some(self.tier);
        body.labels = self.shared.labels.clone();
        let req = c.request(Method::POST, "/v1/sandboxes").json(&body);
        let info: SandboxInfo = c
            .json(req)
            .await
            .map_err(|f| f.into_core(self.tier, None, None))?;
        Ok(self.sandbox(info, spec.clone(), t))
    }

    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        if !secrets.is_empty() {
            return Err(Error::unsupported(
                self.tier,
                "secrets through a remote server",
            ));
        }
        let known = self
            .shared
            .sent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned();
        // Sent before and still there: restored from the server's copy. (Deleted there
        // since: sent again.)
        if let Some(remote) = known {
            if self.server_has(&remote).await {
                return self.restore_on_server(&remote).await;
            }
        }
        let remote = transfer::send_snapshot(&self.shared.client, self.tier, store, id).await?;
        self.shared
            .sent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), remote.clone());
        self.restore_on_server(&remote).await
    }
}
