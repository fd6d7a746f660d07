//! The server's limits and settings: [`ServerConfig`], its defaults and its setters.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sandbox_core::SnapshotStore;

use crate::signing;

/// Limits of a [`Server`](crate::Server). `#[non_exhaustive]`: build it with
/// [`ServerConfig::default`] and the setters.
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
    /// for the whole process by [`Server::new`](crate::Server::new)). `true` for a local daemon
    /// serving its own user.
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
    /// Each named client's own snapshot store (with [`Clients`](crate::Clients)); a client
    /// without one uses [`snapshot_store`](Self::snapshot_store).
    pub client_snapshot_stores: HashMap<String, Arc<dyn SnapshotStore>>,
    /// Most requests one client may have in flight (more are refused with 429). Default 64.
    pub max_requests_per_client: usize,
    /// Keep sandboxes across a restart: when [`Server::serve`](crate::Server::serve) stops,
    /// every sandbox is snapshotted into its client's store and recorded in this file (what
    /// cannot be snapshotted is destroyed); the next server with the same file restores them
    /// under the same ids with [`Server::restore_kept`](crate::Server::restore_kept), before it
    /// serves. `None` (the default): they are destroyed.
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
    /// The templates E2B clients create sandboxes from (see [`crate::e2b`]); `base` is built
    /// in unless one is named so. Default: `base` alone.
    pub templates: Vec<crate::e2b::Template>,
    /// The domain under which E2B clients reach sandboxes by host name (`PORT-ID.DOMAIN`,
    /// their `E2B_DOMAIN`), when names under it resolve to this server. `None` (the
    /// default): clients address sandboxes by header (`E2B_SANDBOX_URL`).
    pub e2b_domain: Option<String>,
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
            .field("templates", &self.templates)
            .field("e2b_domain", &self.e2b_domain)
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
            templates: Vec::new(),
            e2b_domain: None,
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

    /// Adds an E2B template ([`templates`](Self::templates)).
    pub fn template(mut self, t: crate::e2b::Template) -> Self {
        self.templates.push(t);
        self
    }

    /// Sets [`e2b_domain`](Self::e2b_domain).
    pub fn e2b_domain(mut self, domain: impl Into<String>) -> Self {
        self.e2b_domain = Some(domain.into());
        self
    }

    /// Sets [`max_requests_per_client`](Self::max_requests_per_client).
    pub fn max_requests_per_client(mut self, n: usize) -> Self {
        self.max_requests_per_client = n;
        self
    }

    /// The snapshot store of client `name`.
    pub(crate) fn snapshot_store_for(&self, name: &str) -> Option<Arc<dyn SnapshotStore>> {
        self.client_snapshot_stores
            .get(name)
            .cloned()
            .or_else(|| self.snapshot_store.clone())
    }
}
