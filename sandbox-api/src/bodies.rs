//! The bodies of the v1 API: what clients send and get back. Requests refuse unknown fields
//! (a misspelt option is an error, not silently ignored); answers may gain fields.

use std::collections::BTreeMap;

use sandbox_core::{Command, ExecRequest, SandboxSpec, Tier};
use serde::{Deserialize, Serialize};

use crate::error::BadRequest;

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CreateSandbox {
    /// The sandbox's spec, as the library takes it (`SandboxSpec`'s JSON form).
    pub spec: SandboxSpec,
    /// Exactly this tier; absent: the selector's choice for the spec's language.
    #[serde(default)]
    pub tier: Option<Tier>,
    /// Labels to find it by (`GET /v1/sandboxes?label=k=v`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// How long it may live and what happens when it idles (default: until destroyed).
    #[serde(default)]
    pub lifetime: LifetimeSpec,
}

/// `POST /v1/run`: one command in a fresh sandbox, destroyed after it (see
/// [`RunReply`]). The server takes a ready sandbox from its warm pools when it has one for
/// this spec and tier (`sandbox_server::ServerConfig::warm`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RunBody {
    /// The sandbox's spec.
    pub spec: SandboxSpec,
    /// Exactly this tier; absent: the selector's choice for the spec's language.
    #[serde(default)]
    pub tier: Option<Tier>,
    /// The command, as `POST /v1/sandboxes/{id}/exec` takes it (no `tty`).
    pub command: ExecBody,
    /// When given, the server's build must be this one ([`TierList::build`]), else the
    /// answer is `409 build_mismatch` and nothing runs: for a client that must behave
    /// exactly as its own build would in-process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<String>,
}

/// The answer of `POST /v1/run`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RunReply {
    /// The tier it ran on.
    pub tier: Tier,
    /// The command's result. Its timeline: the sandbox's creation phases (for a sandbox from
    /// a warm pool, `allocation` is the time taken to hand it out), then `first-command`.
    pub result: sandbox_core::ExecResult,
    /// The sandbox's egress decisions, oldest first.
    pub network: Vec<sandbox_core::NetworkEvent>,
}

/// A sandbox's lifetime on the server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LifetimeSpec {
    /// Seconds after its creation at which it is destroyed, in use or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    /// Seconds without a request using it after which `on_idle` happens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    /// What idling does (default `destroy`).
    #[serde(default)]
    pub on_idle: IdleAction,
}

impl LifetimeSpec {
    /// Whether it is the default (no TTL, no idle timeout).
    pub fn is_unbounded(&self) -> bool {
        self.ttl_s.is_none() && self.idle_timeout_s.is_none()
    }
}

/// What an idle timeout does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum IdleAction {
    /// Pause it (tiers with pause/resume); the next request that uses it resumes it.
    Pause,
    /// Destroy it.
    #[default]
    Destroy,
}

/// Whether a sandbox runs or is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum SandboxState {
    /// Running (or idle, waiting for requests).
    Running,
    /// Paused by its idle timeout (or a client); the next request that uses it resumes it.
    Paused,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SandboxInfo {
    /// Its id (the path segment of every call on it).
    pub id: String,
    /// The tier it runs on.
    pub tier: Tier,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// When it was created (RFC 3339, UTC).
    pub created_at: String,
    /// Running or paused.
    pub state: SandboxState,
    /// Its lifetime, when it has one.
    #[serde(default, skip_serializing_if = "LifetimeSpec::is_unbounded")]
    pub lifetime: LifetimeSpec,
    /// The snapshot it was restored or forked from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<sandbox_core::SnapshotId>,
}

/// `GET /v1/sandboxes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SandboxList {
    /// The sandboxes, oldest first.
    pub sandboxes: Vec<SandboxInfo>,
}

/// `POST /v1/sandboxes/{id}/exec` (and `/exec/stream`): exactly one of `argv` and `code`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ExecBody {
    /// A program and its arguments.
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    /// Code in the sandbox's language.
    #[serde(default)]
    pub code: Option<String>,
    /// Text fed to standard input.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Extra environment for this call.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory (default: the workspace, or the image's).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Wall timeout in milliseconds (capped by the spec's).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Run on a pseudo-terminal of this size (`{"rows": 24, "cols": 80}`; spawn only, on
    /// tiers whose capabilities list `tty`): raw bytes both ways, stdout and stderr merged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tty: Option<sandbox_core::Tty>,
}

impl ExecBody {
    /// The library's request.
    pub fn into_request(self) -> Result<ExecRequest, BadRequest> {
        let mut req = match (self.argv, self.code) {
            (Some(a), None) => ExecRequest::argv(a),
            (None, Some(c)) => ExecRequest::code(c),
            _ => {
                return Err(BadRequest(
                    "give exactly one of `argv` (a program and its arguments) and `code`".into(),
                ))
            }
        };
        if let Some(s) = self.stdin {
            req = req.stdin(s.into_bytes());
        }
        for (k, v) in self.env {
            req = req.env(k, v);
        }
        if let Some(c) = self.cwd {
            req = req.cwd(c);
        }
        if let Some(ms) = self.timeout_ms {
            req = req.timeout(std::time::Duration::from_millis(ms));
        }
        if let Some(t) = self.tty {
            req = req.tty(t.rows, t.cols);
        }
        Ok(req)
    }

    /// A request for `cmd`, for clients.
    pub fn from_command(cmd: &Command) -> Self {
        match cmd {
            Command::Argv(a) => ExecBody {
                argv: Some(a.clone()),
                ..Self::default()
            },
            Command::Code(c) => ExecBody {
                code: Some(c.clone()),
                ..Self::default()
            },
            _ => ExecBody::default(),
        }
    }
}

/// `GET /v1/sandboxes/{id}/list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Listing {
    /// The directory's entries.
    pub entries: Vec<sandbox_core::DirEntry>,
}

/// `POST /v1/snapshots/{id}/restore`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RestoreBody {
    /// Labels of the new sandbox.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Its lifetime.
    #[serde(default)]
    pub lifetime: LifetimeSpec,
}

/// `POST /v1/snapshots/{id}/fork`: `count` sandboxes from one snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ForkBody {
    /// How many (1 to 64).
    pub count: usize,
    /// Labels of each new sandbox.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The lifetime of each.
    #[serde(default)]
    pub lifetime: LifetimeSpec,
}

/// Most sandboxes one fork request makes.
pub const MAX_FORK: usize = 64;

/// A snapshot as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SnapshotInfo {
    /// Its id (the SHA-256 of its manifest).
    pub id: sandbox_core::SnapshotId,
    /// The tier that took it (and restores it).
    pub tier: Tier,
    /// When it was taken (RFC 3339, UTC).
    pub created_at: String,
    /// The size of its artifacts in bytes.
    pub bytes: u64,
}

/// `GET /v1/snapshots`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SnapshotList {
    /// The snapshots in the server's store.
    pub snapshots: Vec<SnapshotInfo>,
}

/// `GET /v1/sandboxes/{id}/network/events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NetworkEvents {
    /// The egress decisions so far, oldest first.
    pub events: Vec<sandbox_core::NetworkEvent>,
}

/// One tier as `GET /v1/tiers` shows it: the probe's status and, for a tier the server has,
/// its capabilities.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TierInfo {
    /// Whether the server's host can run it, with the reason and the fix when not.
    pub status: sandbox_core::TierStatus,
    /// What it can do (absent for a tier not built into the server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<sandbox_core::Capabilities>,
}

/// `GET /v1/tiers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TierList {
    /// Every tier the server knows.
    pub tiers: Vec<TierInfo>,
    /// Which build of the server this is (`sandbox_server::ServerConfig::build`),
    /// when it says: a client that must behave exactly as itself in-process (the CLI's
    /// `run` through a local daemon) uses only a server of its own build.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<String>,
}

/// `POST /v1/sandboxes/{id}/processes`: the new process (its output:
/// `GET .../processes/{pid}/output`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ProcessRef {
    /// Its id in the sandbox.
    pub id: sandbox_core::ProcessId,
}

/// `GET /v1/sandboxes/{id}/processes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ProcessList {
    /// The sandbox's processes, running and exited.
    pub processes: Vec<sandbox_core::ProcessInfo>,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/signal`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct SignalBody {
    /// `INT`, `SIGTERM`, `kill`, `9`...: one of HUP, INT, QUIT, KILL, USR1, USR2, TERM.
    pub signal: String,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/resize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ResizeBody {
    /// Rows (at least 1).
    pub rows: u16,
    /// Columns (at least 1).
    pub cols: u16,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/wait` (the body is optional).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct WaitBody {
    /// How long to wait, in milliseconds (absent: until it exits, within the server's
    /// request timeout). On timeout: `504 timeout`, and the process keeps running.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// `POST /v1/sandboxes/{id}/ports`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PublishBody {
    /// The TCP port inside the sandbox.
    pub sandbox_port: u16,
    /// Where the server's host listens (default `127.0.0.1:0`: loopback, a port the OS
    /// picks). Other than loopback only on a server started with `--allow-host-access`.
    #[serde(default)]
    pub host: Option<std::net::SocketAddr>,
}

/// `GET /v1/sandboxes/{id}/ports`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PortList {
    /// The published ports (addresses on the server's host).
    pub ports: Vec<sandbox_core::PublishedPort>,
}

// Constructors: the bodies are `#[non_exhaustive]` (answers gain fields; requests may gain
// optional ones), so code outside this crate builds them here and sets optional fields after.

impl CreateSandbox {
    /// A sandbox made from `spec` on the best tier the server can run, with no labels and
    /// no lifetime bounds (set the public fields to change those).
    pub fn new(spec: SandboxSpec) -> Self {
        CreateSandbox {
            spec,
            tier: None,
            labels: BTreeMap::new(),
            lifetime: LifetimeSpec::default(),
        }
    }
}

impl RunBody {
    /// Run `command` once in a sandbox made from `spec` on the best tier the server can run.
    pub fn new(spec: SandboxSpec, command: ExecBody) -> Self {
        RunBody {
            spec,
            tier: None,
            command,
            build: None,
        }
    }
}

impl RunReply {
    /// The answer to a one-shot run on `tier`.
    pub fn new(
        tier: Tier,
        result: sandbox_core::ExecResult,
        network: Vec<sandbox_core::NetworkEvent>,
    ) -> Self {
        RunReply {
            tier,
            result,
            network,
        }
    }
}

impl LifetimeSpec {
    /// The same lifetime, with a time to live of `ttl_s` seconds.
    pub fn with_ttl_s(mut self, ttl_s: u64) -> Self {
        self.ttl_s = Some(ttl_s);
        self
    }

    /// The same lifetime, with an idle timeout of `idle_timeout_s` seconds after which
    /// `on_idle` happens.
    pub fn with_idle_timeout_s(mut self, idle_timeout_s: u64, on_idle: IdleAction) -> Self {
        self.idle_timeout_s = Some(idle_timeout_s);
        self.on_idle = on_idle;
        self
    }
}

impl SandboxInfo {
    /// A running sandbox `id` on `tier` created at `created_at` (RFC 3339), with no labels,
    /// no lifetime bounds and not restored from a snapshot (set the public fields to change
    /// those).
    pub fn new(id: impl Into<String>, tier: Tier, created_at: impl Into<String>) -> Self {
        SandboxInfo {
            id: id.into(),
            tier,
            labels: BTreeMap::new(),
            created_at: created_at.into(),
            state: SandboxState::Running,
            lifetime: LifetimeSpec::default(),
            from_snapshot: None,
        }
    }
}

impl SandboxList {
    /// A list of sandboxes.
    pub fn new(sandboxes: Vec<SandboxInfo>) -> Self {
        SandboxList { sandboxes }
    }
}

impl Listing {
    /// A directory listing.
    pub fn new(entries: Vec<sandbox_core::DirEntry>) -> Self {
        Listing { entries }
    }
}

impl ForkBody {
    /// `count` forks, without labels or lifetime bounds.
    pub fn new(count: usize) -> Self {
        ForkBody {
            count,
            labels: BTreeMap::new(),
            lifetime: LifetimeSpec::default(),
        }
    }
}

impl SnapshotInfo {
    /// Snapshot `id` of `bytes` bytes that `tier` took at `created_at` (RFC 3339).
    pub fn new(
        id: sandbox_core::SnapshotId,
        tier: Tier,
        created_at: impl Into<String>,
        bytes: u64,
    ) -> Self {
        SnapshotInfo {
            id,
            tier,
            created_at: created_at.into(),
            bytes,
        }
    }
}

impl SnapshotList {
    /// A list of snapshots.
    pub fn new(snapshots: Vec<SnapshotInfo>) -> Self {
        SnapshotList { snapshots }
    }
}

impl NetworkEvents {
    /// A sandbox's network events.
    pub fn new(events: Vec<sandbox_core::NetworkEvent>) -> Self {
        NetworkEvents { events }
    }
}

impl TierInfo {
    /// A tier's probe result and, when it is available, its capabilities.
    pub fn new(
        status: sandbox_core::TierStatus,
        capabilities: Option<sandbox_core::Capabilities>,
    ) -> Self {
        TierInfo {
            status,
            capabilities,
        }
    }
}

impl TierList {
    /// The tiers, from a server whose build is `build`.
    pub fn new(tiers: Vec<TierInfo>, build: Option<String>) -> Self {
        TierList { tiers, build }
    }
}

impl ProcessRef {
    /// A started background process.
    pub fn new(id: sandbox_core::ProcessId) -> Self {
        ProcessRef { id }
    }
}

impl ProcessList {
    /// A sandbox's background processes.
    pub fn new(processes: Vec<sandbox_core::ProcessInfo>) -> Self {
        ProcessList { processes }
    }
}

impl SignalBody {
    /// Send `signal` (a name such as `TERM` or `KILL`).
    pub fn new(signal: impl Into<String>) -> Self {
        SignalBody {
            signal: signal.into(),
        }
    }
}

impl ResizeBody {
    /// Resize a terminal to `rows` × `cols`.
    pub fn new(rows: u16, cols: u16) -> Self {
        ResizeBody { rows, cols }
    }
}

impl WaitBody {
    /// Wait at most `timeout_ms` milliseconds (`None`: the server's default).
    pub fn new(timeout_ms: Option<u64>) -> Self {
        WaitBody { timeout_ms }
    }
}

impl PublishBody {
    /// Publish `sandbox_port` on `host` (`None`: a loopback port the server picks).
    pub fn new(sandbox_port: u16, host: Option<std::net::SocketAddr>) -> Self {
        PublishBody { sandbox_port, host }
    }
}

impl PortList {
    /// A sandbox's published ports.
    pub fn new(ports: Vec<sandbox_core::PublishedPort>) -> Self {
        PortList { ports }
    }
}
