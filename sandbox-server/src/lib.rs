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
mod access;
pub mod auth;
mod config;
pub mod e2b;
pub mod error;
mod keep;
mod lifetime;
pub mod mcp;
pub mod openapi;
mod processes;
mod provider;
mod routes;
mod run;
mod server;
pub mod signing;
mod warm;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandbox_core::Sandbox;

pub use access::host_access;
pub use auth::{Clients, ClientsError, Token};
pub use config::ServerConfig;
pub use error::ApiError;
pub use provider::{OneBackend, Provider};
pub use server::{Listener, Server};

/// One sandbox the server owns.
struct Entry {
    sandbox: Arc<dyn Sandbox>,
    info: api::SandboxInfo,
    life: lifetime::Lifetime,
    /// The client that made it: the only one that sees it.
    owner: auth::Caller,
    /// Its processes spawned through the API.
    procs: processes::Table,
    /// What E2B's API knows of it (set at an E2B create, or when E2B's API first sees it).
    e2b: e2b::Slot,
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
    /// Cancelled when [`Server::serve`] begins to stop: long streams (E2B's envd streams)
    /// end, so the graceful shutdown is not held open by them.
    stopping: Mutex<tokio_util::sync::CancellationToken>,
    /// The snapshots taken through E2B's API, with their names.
    e2b_snapshots: e2b::Snaps,
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
    /// The token cancelled when the server begins to stop.
    fn stopping(&self) -> tokio_util::sync::CancellationToken {
        self.stopping
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

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
