//! The service: [`Server`] (its sandboxes, its API as a router, serving it on a [`Listener`]
//! until shutdown with the MCP endpoint beside it, keeping sandboxes across a restart) and
//! what it reports (idleness, the warm pools' counters).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandbox_core::SnapshotStore;

use crate::access::own_addresses;
use crate::{
    auth, keep, lifetime, mcp, routes, signing, warm, ApiError, Clients, Entry, InFlight, Provider,
    ServerConfig, Shared, Token, WarmStats,
};

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
                stopping: Mutex::new(tokio_util::sync::CancellationToken::new()),
                e2b_snapshots: Default::default(),
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
                        crate::access::check_spec(&config, spec, true)
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
        *self
            .shared
            .stopping
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = stop.clone();
        let stopping = stop.clone();
        let shutdown = async move {
            shutdown.await;
            // Ends the MCP endpoint's open event streams and E2B's envd streams, which would
            // hold the graceful shutdown open.
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
