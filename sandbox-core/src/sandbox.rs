//! The two traits every backend implements.

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;

use crate::capabilities::Capabilities;
use crate::egress::NetworkEvent;
use crate::error::{Error, Result};
use crate::exec::{ExecRequest, ExecResult, ExecStream};
use crate::path::DirEntry;
use crate::policy::NetworkPolicy;
use crate::probe::TierStatus;
use crate::process::{Process, ProcessId, ProcessInfo, Signal};
use crate::publish::PublishedPort;
use crate::secrets::ResolvedSecrets;
use crate::snapshot::{SnapshotId, SnapshotStore};
use crate::spec::SandboxSpec;
use crate::tier::Tier;
use crate::timeline::Timeline;

/// A sandbox engine: one per tier.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The tier this backend implements.
    fn tier(&self) -> Tier;

    /// What it can do. Operations not listed return [`Error::Unsupported`].
    fn capabilities(&self) -> Capabilities;

    /// Whether this host can run the backend, with the reason and the fix when not.
    /// Must not hang: a probe that needs to measure does so with a bound.
    async fn probe(&self) -> TierStatus;

    /// The checks made before creating a sandbox on this tier when it was chosen by name
    /// (no selection): whether the host can run it, with the reason and the fix when not.
    /// By default the full [`probe`](Backend::probe). A backend whose probe also runs a
    /// smoke test (a whole sandbox) answers from its other checks here, and the create
    /// itself is the test: if that create then fails, the caller probes fully to say why.
    async fn preflight(&self) -> TierStatus {
        self.probe().await
    }

    /// Creates a sandbox. The spec is validated first; secrets are already resolved.
    async fn create(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>>;

    /// Restores a sandbox from a snapshot in `store`. A snapshot of another tier, engine
    /// version or format, or a corrupt one, is refused before anything is started.
    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        let _ = (store, id, secrets);
        Err(Error::unsupported(self.tier(), "restore"))
    }

    /// Removes what processes that died without destroying their sandboxes left on this
    /// host for this backend (sandbox processes, mounts, cgroups, state directories), never
    /// touching a live sandbox of any process. Returns how many leftovers were removed (what
    /// one is depends on the tier: a gVisor sandbox, a container cgroup directory).
    /// Backends whose sandboxes live inside the process leave nothing: the default is 0.
    async fn cleanup_stale(&self) -> Result<usize> {
        Ok(0)
    }

    /// [`cleanup_stale`](Backend::cleanup_stale), saying also which of the removed
    /// sandboxes were paused or frozen when their owner died and were thawed (or resumed) to
    /// be killed. A backend that can leave paused sandboxes behind overrides this one (and
    /// makes `cleanup_stale` return its `removed`); the default reports none thawed.
    async fn cleanup_stale_report(&self) -> Result<StaleCleanup> {
        Ok(StaleCleanup {
            removed: self.cleanup_stale().await?,
            thawed: Vec::new(),
        })
    }
}

/// What [`Backend::cleanup_stale_report`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct StaleCleanup {
    /// How many leftovers were removed (what one is depends on the tier, as for
    /// [`Backend::cleanup_stale`]).
    pub removed: usize,
    /// The leftovers among them that were paused or frozen (a cgroup freezer, a paused runsc
    /// sandbox) and were thawed so that they could be killed, by name (a container cgroup
    /// `asb-<owner pid>-<id>`, a gVisor sandbox id).
    pub thawed: Vec<String>,
}

impl StaleCleanup {
    /// Adds `other`'s counts and names to these.
    pub fn merge(&mut self, other: StaleCleanup) {
        self.removed += other.removed;
        self.thawed.extend(other.thawed);
    }
}

/// A live sandbox. All methods take `&self`; implementations serialize what must be.
///
/// Dropping a sandbox destroys it (best effort, synchronously); call [`Sandbox::destroy`]
/// to observe errors. `destroy` is idempotent (a second call returns `Ok`); every other
/// operation after it returns [`Error::SandboxGone`].
#[async_trait]
pub trait Sandbox: Send + Sync {
    /// A unique id.
    fn id(&self) -> &str;

    /// The tier it runs on.
    fn tier(&self) -> Tier;

    /// The spec it was created from.
    fn spec(&self) -> &SandboxSpec;

    /// The phases of its create (or restore).
    fn timeline(&self) -> &Timeline;

    /// Runs one command to completion and returns its captured output.
    ///
    /// # Errors
    /// [`Error::SandboxPaused`] while the sandbox is paused, [`Error::SandboxGone`] once it
    /// ended (see [`lifecycle`](crate::lifecycle)); a failing command is not an error (its
    /// exit code and the limit it hit are in the result).
    async fn exec(&self, req: ExecRequest) -> Result<ExecResult>;

    /// Runs one command, streaming output as it comes.
    async fn exec_stream(&self, req: ExecRequest) -> Result<ExecStream> {
        let _ = req;
        Err(Error::unsupported(self.tier(), "streaming exec"))
    }

    /// Starts a command in the background and returns at once (see [`process`](crate::process)):
    /// write to its stdin, read its output as it comes, signal it, wait for it. It keeps
    /// running across later calls, counts against the sandbox's limits and ends with the
    /// sandbox. `req.stdin` is written first (the pipe stays open); `req.timeout`, when set,
    /// bounds its wall time (the spec's `wall_time_ms` bounds each `exec`, not processes).
    ///
    /// # Errors
    /// [`Error::Unsupported`] on tiers without `processes` in their capabilities; as
    /// [`exec`](Self::exec) otherwise.
    async fn spawn(&self, req: ExecRequest) -> Result<Process> {
        let _ = req;
        Err(Error::unsupported(self.tier(), "background processes"))
    }

    /// The sandbox's background processes: those running and the last ones that ended.
    async fn processes(&self) -> Result<Vec<ProcessInfo>> {
        Err(Error::unsupported(self.tier(), "background processes"))
    }

    /// Sends `signal` to background process `id`'s process group.
    ///
    /// # Errors
    /// [`Error::NotFound`] for an id this sandbox never gave, [`Error::ProcessExited`] once
    /// it ended.
    async fn signal(&self, id: ProcessId, signal: Signal) -> Result<()> {
        let _ = (id, signal);
        Err(Error::unsupported(self.tier(), "background processes"))
    }

    /// Publishes TCP port `sandbox_port` of the sandbox on `host` (port 0: the OS picks
    /// one): connections there are forwarded inside. Inbound only: it works under `DenyAll`
    /// and opens no way out. Returns the address listened on. Published ports close on
    /// [`destroy`](Self::destroy).
    ///
    /// # Errors
    /// [`Error::InvalidSpec`] for port 0 or an address published already, [`Error::Io`] for
    /// an address in use or not this host's, [`Error::Unsupported`] on tiers without
    /// `publish` in their capabilities.
    async fn publish(&self, sandbox_port: u16, host: SocketAddr) -> Result<SocketAddr> {
        let _ = (sandbox_port, host);
        Err(Error::unsupported(self.tier(), "published ports"))
    }

    /// Stops publishing on `host` (the address [`publish`](Self::publish) returned) and
    /// closes its connections. [`Error::NotFound`] if nothing is published there.
    async fn unpublish(&self, host: SocketAddr) -> Result<()> {
        let _ = host;
        Err(Error::unsupported(self.tier(), "published ports"))
    }

    /// What is published from this sandbox.
    async fn published(&self) -> Result<Vec<PublishedPort>> {
        Err(Error::unsupported(self.tier(), "published ports"))
    }

    /// Writes a file in the workspace (creating parent directories).
    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()>;

    /// Reads a file from the workspace.
    ///
    /// One read returns at most the sandbox's [`limits.disk_bytes`](crate::Limits::disk_bytes):
    /// a bigger file (a sparse one included: `truncate -s 1T` makes one in an instant) is
    /// refused with [`Error::InvalidSpec`] on `path`, naming that limit, before its data are
    /// read; read such files in parts inside the sandbox. A symlink that leads out of the
    /// workspace is [`Error::PathEscape`].
    async fn read_file(&self, path: &str) -> Result<Vec<u8>>;

    /// Lists a directory of the workspace (`""` or `/workspace` for its root).
    async fn list(&self, path: &str) -> Result<Vec<DirEntry>>;

    /// Snapshots the sandbox into `store`.
    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        let _ = store;
        Err(Error::unsupported(self.tier(), "snapshots"))
    }

    /// Pauses every process of the sandbox. Pausing a paused sandbox does nothing.
    ///
    /// # Errors
    /// [`Error::Unsupported`] on tiers without `pause_resume` in their capabilities,
    /// [`Error::SandboxGone`] once the sandbox ended.
    async fn pause(&self) -> Result<()> {
        Err(Error::unsupported(self.tier(), "pause/resume"))
    }

    /// Resumes a paused sandbox. Resuming a running sandbox does nothing.
    ///
    /// # Errors
    /// As [`pause`](Self::pause).
    async fn resume(&self) -> Result<()> {
        Err(Error::unsupported(self.tier(), "pause/resume"))
    }

    /// Replaces the network policy of a running sandbox: the next connection is decided by
    /// the new one, open connections are left as they are. Works for sandboxes created with
    /// a policy other than `DenyAll` (those are attached to an egress enforcer); a sandbox
    /// created with `DenyAll` has no path out to open later.
    async fn set_network_policy(&self, policy: NetworkPolicy) -> Result<()> {
        let _ = policy;
        Err(Error::unsupported(
            self.tier(),
            "changing the network policy of a running sandbox",
        ))
    }

    /// The egress decisions about this sandbox's traffic so far, oldest first (bounded).
    /// Empty for a `DenyAll` sandbox: its packets have no route, nothing is asked.
    ///
    /// # Errors
    /// [`Error::SandboxGone`] once the sandbox ended, as every call (read them before
    /// `destroy`). Backends override this default, which cannot see their lifecycle.
    async fn network_events(&self) -> Result<Vec<NetworkEvent>> {
        Ok(Vec::new())
    }

    /// What the sandbox uses now (CPU time so far, memory held), from the tier's own
    /// accounting.
    ///
    /// # Errors
    /// [`Error::Unsupported`] on tiers without `usage` in their capabilities,
    /// [`Error::SandboxGone`] once it ended.
    async fn usage(&self) -> Result<crate::Usage> {
        Err(Error::unsupported(self.tier(), "resource usage"))
    }

    /// Watches workspace directory `path` (as [`list`](Self::list) takes it) for changes:
    /// entries created, written, removed, renamed, their mode changed; with `recursive`, in
    /// every directory beneath it too (directories made later included; symlinks are not
    /// followed). The watch ends when the directory goes or the sandbox ends.
    ///
    /// # Errors
    /// [`Error::Unsupported`] on tiers without `watch` in their capabilities;
    /// [`Error::PathEscape`], [`Error::NotFound`] as [`list`](Self::list).
    async fn watch(&self, path: &str, recursive: bool) -> Result<crate::Watch> {
        let _ = (path, recursive);
        Err(Error::unsupported(self.tier(), "watching files"))
    }

    /// What hides this sandbox's secret values in text it produces (its backend applies it
    /// to every command's output; code built on the trait that decodes output, such as
    /// [`crate::interpreter`], applies it to what it decoded). Empty by default: a backend
    /// that resolves no secrets itself (e.g. one that forwards to a server) has none.
    fn redactor(&self) -> crate::secrets::Redactor {
        crate::secrets::Redactor::default()
    }

    /// A cheap liveness check used by warm pools before handing a sandbox out.
    async fn health_check(&self) -> Result<()>;

    /// Destroys the sandbox and everything it holds on the host, paused or not. Idempotent:
    /// destroying it again (or after it died) does nothing and succeeds; every other call
    /// then fails with [`Error::SandboxGone`].
    async fn destroy(&self) -> Result<()>;
}

/// A shared backend handle.
pub type DynBackend = Arc<dyn Backend>;
