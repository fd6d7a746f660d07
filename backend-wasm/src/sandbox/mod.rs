//! [`WasmSandbox`]: one workspace plus, for Python and JavaScript, one live interpreter.
//!
//! This module makes a sandbox and starts its interpreter; `exec` runs its calls and
//! `workspace` serves the file API, snapshots, the health check and `destroy`.

mod exec;
mod workspace;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sandbox_core::{
    fsnap, DirEntry, Error, ExecRequest, ExecResult, ExecStream, Language, Lifecycle,
    NetworkPolicy, Phase, PhaseTiming, Redactor, ResolvedSecrets, Result, Sandbox, SandboxSpec,
    SnapshotId, SnapshotStore, Tier, Timeline, TimelineRecorder, Workspace, WORKSPACE_MOUNT,
};

use crate::admission::{Admission, Ticket};
use crate::engine::{self, Flavor};
use crate::host::Preopen;
use crate::js::JsSession;
use crate::python::{self, PythonSource, Session, SessionSetup};
use crate::scratch::Scratch;
use crate::tools::{HostTools, ToolBox};

const TIER: Tier = Tier::Wasm;
/// Snapshot format written by this crate (workspace files only).
pub(crate) const SNAPSHOT_FORMAT: &str = "workspace-tar-v1";

/// What a sandbox needs from its backend.
#[derive(Clone)]
pub(crate) struct SandboxConfig {
    pub(crate) python: PythonSource,
    pub(crate) tools: HostTools,
    /// The backend's limit on guests running at once (shared by its sandboxes).
    pub(crate) admission: Admission,
}

enum LangState {
    Python(Option<Session>),
    Js(Option<JsSession>),
    Wasm,
}

/// A sandbox of the wasm tier.
///
/// - `Language::Python`: one CPython interpreter (a wasmtime instance) kept across `exec`
///   calls: variables and imports persist, and a final expression is echoed to stdout and
///   returned in [`ExecResult::value`] (as JSON, or the JSON string of its `repr`).
/// - `Language::Javascript`: one QuickJS context kept across calls; the completion value is
///   returned as JSON in `value`.
/// - `Language::Wasm`: a code string is a WebAssembly module in the text format (WAT).
///
/// In every language, [`Command::Argv`](sandbox_core::Command::Argv) runs a WASI preview-1
/// command module from the workspace: `argv[0]` names a `.wasm` file (`app.wasm`,
/// `/workspace/bin/app.wasm`), the whole argv is passed to the module, and the module sees
/// `/workspace` (and its working directory as `.`), nothing else.
///
/// After a limit, a trap, `os._exit()` or Python's `exit()`, the interpreter is **reset**:
/// that call's result says so on stderr, and the next call starts a fresh interpreter
/// (variables and imports are lost, workspace files remain). A call whose future is
/// dropped mid-run also loses the interpreter (the guest finishes or hits its deadline in
/// the background).
///
/// Per-call request fields:
/// - `timeout`: the call's wall deadline (capped by the spec and the remaining lifetime).
/// - `stdin`: Python (`sys.stdin`) and modules; JavaScript has no stdin.
/// - `env`: modules get it on top of the spec's; Python sets it in `os.environ` for the
///   call and restores the session's afterwards; JavaScript has no environment.
/// - `cwd` (inside `/workspace`, default `/workspace`): a module's `.`; Python `chdir`s
///   there before the call when it differs from the directory the host last set (a
///   `chdir` made by the code itself persists across calls, as in a REPL); JavaScript has
///   no filesystem.
///
/// [`Sandbox::exec_stream`] streams stdout and stderr as the guest writes them (JavaScript's
/// `console` lines, WASI `fd_write`s, Python's flushed writes), capped and redacted like
/// `exec`'s output; the host's own notes (why an interpreter was reset) come last on stderr.
pub struct WasmSandbox {
    inner: Arc<Inner>,
}

/// The sandbox's state, shared with streamed calls' tasks.
struct Inner {
    id: String,
    spec: SandboxSpec,
    timeline: Timeline,
    /// The private folder: `workspace/` (for an empty workspace) and `tmp/`. Made on first
    /// use: a JavaScript sandbox that never touches files never needs one.
    scratch: OnceLock<Arc<Scratch>>,
    /// The workspace when it is a host folder (else the scratch's `workspace/`).
    host_workspace: Option<PathBuf>,
    workspace_writable: bool,
    mounts: Vec<Preopen>,
    env: BTreeMap<String, String>,
    redactor: Redactor,
    tools: Option<Arc<ToolBox>>,
    cfg: SandboxConfig,
    flavor: Flavor,
    born: Instant,
    /// Live, gone, releasing or released: the first `destroy` releases the interpreter and
    /// the scratch folders (a sandbox whose lifetime ran out is gone but still holds them
    /// until then).
    life: Lifecycle,
    state: tokio::sync::Mutex<LangState>,
    /// File watches (ended by `destroy`).
    watches: sandbox_core::watch::Watches,
}

impl std::fmt::Debug for WasmSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmSandbox")
            .field("id", &self.inner.id)
            .field("language", &self.inner.spec.language)
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Freeing an interpreter (a QuickJS runtime, a wasmtime store) takes tens of
        // microseconds: do it off the caller's path.
        let state = std::mem::replace(self.state.get_mut(), LangState::Wasm);
        if !matches!(state, LangState::Wasm) {
            engine::drop_later(state);
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn check_spec(spec: &SandboxSpec) -> Result<()> {
    spec.validate_on_host()?;
    if spec.image.is_some() || spec.rootfs.is_some() {
        return Err(Error::unsupported(
            TIER,
            "an OCI image or rootfs directory (WebAssembly guests have no Linux userland to run \
             one: its binaries need a Linux kernel's system calls; use the container tier)",
        ));
    }
    if spec.network != NetworkPolicy::DenyAll {
        return Err(Error::unsupported(
            TIER,
            "network egress (the wasm tier has no network at all: use network: deny-all, or a container tier)",
        ));
    }
    match spec.language {
        Language::Python | Language::Javascript | Language::Wasm => {}
        other => return Err(Error::unsupported(TIER, format!("{other} code"))),
    }
    if spec.language == Language::Javascript && spec.limits.fuel.is_some() {
        return Err(Error::unsupported(
            TIER,
            "instruction fuel for JavaScript (QuickJS has no instruction counter; use wall_time_ms)",
        ));
    }
    if spec.language == Language::Python {
        python::check_memory(spec.limits.memory_bytes)?;
    }
    for m in &spec.mounts {
        if !m.source.is_dir() {
            return Err(Error::unsupported(
                TIER,
                "mounting a single file (mount a directory)",
            ));
        }
        let reserved = ["/usr/local/lib", "/tmp", WORKSPACE_MOUNT];
        if reserved
            .iter()
            .any(|r| sandbox_core::backend_kit::paths_overlap(&m.target, r))
        {
            return Err(Error::invalid(
                "mounts",
                format!("target `{}` overlaps a reserved path", m.target),
            ));
        }
    }
    Ok(())
}

impl WasmSandbox {
    pub(crate) async fn create(
        cfg: SandboxConfig,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<WasmSandbox> {
        Ok(WasmSandbox {
            inner: Arc::new(Inner::create(cfg, spec, secrets).await?),
        })
    }

    /// The workspace folder on the host (made on first use for a private workspace; empty
    /// if it could not be made).
    pub fn workspace_dir(&self) -> &Path {
        self.inner.workspace().unwrap_or(Path::new(""))
    }

    /// Unpacks a workspace archive into this (fresh, empty) sandbox.
    pub(crate) fn unpack(&self, tar: &[u8]) -> Result<()> {
        fsnap::unpack_into(tar, self.inner.workspace()?)
    }
}

impl Inner {
    async fn create(
        cfg: SandboxConfig,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Inner> {
        check_spec(spec)?;
        let mut t = TimelineRecorder::start();
        let id = uuid::Uuid::new_v4().simple().to_string();
        let flavor = Flavor::for_fuel(spec.limits.fuel);
        engine::engine(flavor)?;
        t.mark(Phase::Allocation);
        let scratch = OnceLock::new();
        if spec.language != Language::Javascript {
            // Python and modules always preopen it: make it now.
            let _ = scratch.set(Scratch::new()?);
        }
        let (host_workspace, workspace_writable) = match &spec.workspace {
            Workspace::Empty => (None, true),
            Workspace::HostDir { path, read_only } => (
                Some(
                    path.canonicalize()
                        .map_err(|e| Error::io_path("open workspace", path, e))?,
                ),
                !read_only,
            ),
            other => return Err(Error::unsupported(TIER, format!("the workspace {other:?}"))),
        };
        let mounts = spec
            .mounts
            .iter()
            .map(|m| python::grant(&m.source, &m.target, !m.read_only))
            .collect();
        let mut env = spec.base_env();
        for (k, v) in secrets.env() {
            env.insert(k.to_string(), v.to_string());
        }
        let tools = (!cfg.tools.is_empty()).then(|| {
            Arc::new(ToolBox {
                tools: cfg.tools.clone(),
                sandbox_id: id.clone(),
                secrets: secrets.clone(),
            })
        });
        t.mark(Phase::Filesystem);
        let mut sb = Inner {
            watches: Default::default(),
            id: id.clone(),
            spec: spec.clone(),
            timeline: Timeline::default(),
            scratch,
            host_workspace,
            workspace_writable,
            mounts,
            env,
            redactor: secrets.redactor(),
            tools,
            cfg,
            flavor,
            born: Instant::now(),
            life: Lifecycle::new(id.clone()),
            state: tokio::sync::Mutex::new(LangState::Wasm),
        };
        let mut extra = Vec::new();
        let state = match spec.language {
            Language::Python => {
                // Starting an interpreter runs Python (its setup turn): it is admitted
                // like any other guest call.
                let queued = Instant::now();
                let ticket = sb.cfg.admission.admit().await?;
                extra.push(PhaseTiming::new(Phase::Queue, micros(queued.elapsed())));
                let started = Instant::now();
                let (s, loaded) = sb.start_python(ticket).await?;
                extra.push(PhaseTiming::new(
                    Phase::Dependencies,
                    micros(loaded - started),
                ));
                extra.push(PhaseTiming::new(Phase::Runtime, micros(loaded.elapsed())));
                LangState::Python(Some(s))
            }
            Language::Javascript => {
                let s = JsSession::new(
                    spec.limits.memory_bytes,
                    spec.limits.output_bytes,
                    sb.tools.clone(),
                )?;
                t.mark(Phase::Runtime);
                LangState::Js(Some(s))
            }
            _ => LangState::Wasm,
        };
        sb.state = tokio::sync::Mutex::new(state);
        sb.timeline = t.finish();
        sb.timeline.phases.extend(extra);
        Ok(sb)
    }

    /// The private folder, made on first use.
    fn scratch(&self) -> Result<&Arc<Scratch>> {
        if let Some(s) = self.scratch.get() {
            return Ok(s);
        }
        // Two first uses at once: the loser's folder goes back to the spare list.
        let _ = self.scratch.set(Scratch::new()?);
        self.scratch
            .get()
            .ok_or_else(|| Error::backend(TIER, "sandbox folder vanished"))
    }

    /// The workspace folder on the host.
    fn workspace(&self) -> Result<&Path> {
        match &self.host_workspace {
            Some(p) => Ok(p),
            None => Ok(self.scratch()?.workspace()),
        }
    }

    fn grants(&self) -> Result<Vec<Preopen>> {
        let mut g = vec![python::grant(
            self.workspace()?,
            WORKSPACE_MOUNT,
            self.workspace_writable,
        )];
        if let Some(alias) = &self.spec.workspace_alias {
            g.push(python::grant(
                self.workspace()?,
                alias,
                self.workspace_writable,
            ));
        }
        g.extend(self.mounts.iter().cloned());
        Ok(g)
    }

    /// Starts an interpreter under an admitted call's `ticket`; also returns when the shared
    /// runtime was ready.
    async fn start_python(&self, ticket: Arc<Ticket>) -> Result<(Session, Instant)> {
        let src = self.cfg.python.clone();
        let flavor = self.flavor;
        let setup = SessionSetup {
            flavor,
            env: self.env.clone(),
            scratch: Arc::clone(self.scratch()?),
            home_name: format!(".home-{}", &self.id[..16]),
            grants: self.grants()?,
            memory_cap: self.spec.limits.memory_bytes,
            output_cap: self.spec.limits.output_bytes,
            open_files: self.spec.limits.open_files,
            tools: self.tools.clone(),
            disk_cap: self.spec.limits.disk_bytes,
        };
        engine::on_guest_thread(move || {
            let _slot = ticket;
            let rt = python::runtime(&src, flavor)?;
            let loaded = Instant::now();
            Session::start(&rt, setup).map(|s| (s, loaded))
        })
        .await?
    }

    fn alive(&self) -> Result<()> {
        self.life.lapse(self.born, self.spec.limits.lifetime());
        // No pause in this tier: running and existing are the same.
        self.life.check_running()
    }
}

#[async_trait]
impl Sandbox for WasmSandbox {
    fn id(&self) -> &str {
        &self.inner.id
    }

    fn tier(&self) -> Tier {
        TIER
    }

    fn spec(&self) -> &SandboxSpec {
        &self.inner.spec
    }

    fn timeline(&self) -> &Timeline {
        &self.inner.timeline
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecResult> {
        self.inner.run(req, None).await
    }

    async fn exec_stream(&self, req: ExecRequest) -> Result<ExecStream> {
        self.inner.alive()?;
        req.validate()?;
        req.refuse_tty(TIER)?;
        let inner = Arc::clone(&self.inner);
        Ok(ExecStream::spawn(move |tx| async move {
            inner.run(req, Some(tx)).await
        }))
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        self.inner.write_file(path, data).await
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.inner.read_file(path).await
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.inner.list(path).await
    }

    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.inner.snapshot(store).await
    }

    fn redactor(&self) -> sandbox_core::secrets::Redactor {
        self.inner.redactor.clone()
    }

    async fn health_check(&self) -> Result<()> {
        self.inner.health_check().await
    }

    async fn network_events(&self) -> Result<Vec<sandbox_core::NetworkEvent>> {
        // Deny-all only: nothing is ever asked. Gone answers as every other call.
        self.inner.life.check_not_gone()?;
        Ok(Vec::new())
    }

    async fn watch(&self, path: &str, recursive: bool) -> Result<sandbox_core::Watch> {
        self.inner.alive()?;
        // The workspace is a host folder the guest reaches through WASI: watched from the
        // host, beneath its handle (see `sandbox_core::watch`).
        let ws = self.inner.workspace_fd()?;
        self.inner.watches.watch_blocking(ws, path, recursive).await
    }

    async fn destroy(&self) -> Result<()> {
        self.inner.destroy().await
    }
}
