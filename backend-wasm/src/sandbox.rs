//! [`WasmSandbox`]: one workspace plus, for Python and JavaScript, one live interpreter.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sandbox_core::{
    beneath, fsnap, pump_output, Command, DirEntry, Error, ExecEvent, ExecRequest, ExecResult,
    ExecStream, Language, Lifecycle, LimitKind, NetworkPolicy, OutputBuffer, Phase, PhaseTiming,
    Redactor, ResolvedSecrets, Result, Sandbox, SandboxSpec, SnapshotDraft, SnapshotId,
    SnapshotKind, SnapshotStore, StreamKind, StreamSink, Tier, Timeline, TimelineRecorder,
    Workspace, WorkspacePath, WORKSPACE_MOUNT,
};
use tokio::sync::mpsc;

use crate::admission::{Admission, Ticket};
use crate::engine::{self, Flavor};
use crate::host::{CallLimits, Preopen};
use crate::js::JsSession;
use crate::module::{self, ModuleRun};
use crate::python::{self, PythonSource, Session, SessionSetup};
use crate::scratch::Scratch;
use crate::stream::{self, Taps};
use crate::tools::{HostTools, ToolBox};
use crate::ENGINE_NAME;

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

/// A call's outcome before redaction.
struct Raw {
    exit_code: Option<i32>,
    limit: Option<LimitKind>,
    out: OutputBuffer,
    err: OutputBuffer,
    note: Option<String>,
    value: Option<String>,
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
/// In every language, [`Command::Argv`] runs a WASI preview-1 command module from the
/// workspace: `argv[0]` names a `.wasm` file (`app.wasm`, `/workspace/bin/app.wasm`), the
/// whole argv is passed to the module, and the module sees `/workspace` (and its working
/// directory as `.`), nothing else.
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
        let t = m.target.trim_end_matches('/');
        let reserved = ["/usr/local/lib", "/tmp", WORKSPACE_MOUNT];
        if reserved
            .iter()
            .any(|r| t == *r || t.starts_with(&format!("{r}/")) || r.starts_with(&format!("{t}/")))
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

    fn limits(&self, req: &ExecRequest) -> CallLimits {
        let left = self
            .spec
            .limits
            .lifetime()
            .saturating_sub(self.born.elapsed());
        CallLimits {
            wall: req
                .effective_timeout(self.spec.limits.wall_time())
                .min(left)
                .max(Duration::from_millis(1)),
            cpu: Duration::from_millis(self.spec.limits.cpu_time_ms),
            fuel: self.spec.limits.fuel,
        }
    }

    fn host_path(&self, path: &str) -> Result<PathBuf> {
        WorkspacePath::parse(path)?.resolve_under(self.workspace()?)
    }

    /// The call's result. With `taps` (a streamed call) the output was already forwarded as
    /// written: only the host's note goes out here, and dropping the taps ends the streams.
    fn finish(&self, raw: Raw, t: TimelineRecorder, taps: Option<Taps>) -> ExecResult {
        let Raw {
            exit_code,
            limit,
            out,
            err,
            note,
            value,
        } = raw;
        let truncated = out.truncated() || err.truncated();
        let mut stderr = err.finish(&self.redactor);
        if let Some(n) = note {
            let line = format!("[agent-sandbox] {n}\n");
            if let Some(t) = &taps {
                t.err.note(line.as_bytes());
            }
            stderr.extend_from_slice(line.as_bytes());
        }
        drop(taps);
        let value = value.map(|v| {
            if self.redactor.is_empty() {
                v
            } else {
                String::from_utf8_lossy(&self.redactor.redact(v.as_bytes())).into_owned()
            }
        });
        // A call the host stopped for a limit ends as a killed process does in every tier:
        // 137 (128 + SIGKILL), not without an exit code.
        let exit_code = match (exit_code, limit) {
            (None, Some(_)) => Some(137),
            (code, _) => code,
        };
        let mut r = ExecResult::new(exit_code, out.finish(&self.redactor), stderr);
        r.limit = limit;
        r.truncated = truncated;
        r.value = value;
        r.timeline = t.finish();
        r
    }

    async fn exec_module(
        &self,
        argv: Vec<String>,
        req: &ExecRequest,
        mut t: TimelineRecorder,
        taps: Option<Taps>,
    ) -> Result<ExecResult> {
        let cap = self.spec.limits.output_bytes;
        let program = &argv[0];
        // Only `.wasm` modules of the workspace run here: any other program is not found
        // (exit 127, as in every tier), whatever its name.
        let found = if program.ends_with(".wasm") {
            // Beneath a workspace handle, capped: code may have swapped the module for a
            // link out, or made it a 1 TiB sparse file.
            let ws = self.workspace_fd()?;
            let (p, max) = (program.clone(), self.spec.limits.disk_bytes);
            let read = tokio::task::spawn_blocking(move || beneath::read_file(ws.as_fd(), &p, max))
                .await
                .map_err(|e| Error::backend_caused(TIER, "reading the module", e))?;
            match read {
                Ok(b) => Ok(b),
                Err(Error::NotFound { .. }) => {
                    Err(format!("{program}: no such module in the workspace\n"))
                }
                Err(e) => return Err(e),
            }
        } else {
            Err(format!(
                "{program}: command not found (the wasm tier runs only .wasm modules of the \
                 workspace)\n"
            ))
        };
        let bytes = match found {
            Ok(b) => b,
            Err(msg) => {
                let mut err = OutputBuffer::new(cap);
                err.push(msg.as_bytes());
                if let Some(t) = &taps {
                    t.err.push(msg.as_bytes());
                }
                return Ok(self.finish(
                    Raw {
                        exit_code: Some(127),
                        limit: None,
                        out: OutputBuffer::new(cap),
                        err,
                        note: None,
                        value: None,
                    },
                    t,
                    taps,
                ));
            }
        };
        t.mark(Phase::Filesystem);
        self.run_module(bytes, argv, req, t, taps).await
    }

    async fn run_module(
        &self,
        bytes: Vec<u8>,
        argv: Vec<String>,
        req: &ExecRequest,
        mut t: TimelineRecorder,
        taps: Option<Taps>,
    ) -> Result<ExecResult> {
        if module::is_component(&bytes) {
            return Err(Error::unsupported(
                TIER,
                "WebAssembly components (the component model, WASI 0.2): this tier runs WASI \
                 preview-1 command modules; build for `wasm32-wasip1`",
            ));
        }
        let (cwd, opened) = match &req.cwd {
            Some(c) => {
                let host = self.host_path(c)?;
                // Opened beneath the workspace's handle, and preopened from that handle: code
                // inside that swaps the folder for a link after the check does not get the
                // link's target.
                let ws = beneath::open_dir(self.workspace()?)?;
                let rel = WorkspacePath::parse(c)?.relative();
                let fd =
                    beneath::open_beneath(ws.as_fd(), &rel, libc::O_RDONLY | libc::O_DIRECTORY, 0)
                        .map_err(|e| beneath::map_err(e, c, "open the working directory"))?;
                (host, Some(Arc::new(fd)))
            }
            None => (self.workspace()?.to_path_buf(), None),
        };
        let mut preopens = self.grants()?;
        preopens.push(Preopen {
            host: cwd,
            guest: ".".into(),
            writable: self.workspace_writable,
            opened,
        });
        let mut env = self.env.clone();
        env.extend(req.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        // The limits are computed (and armed, on the guest thread) after admission: a
        // queued call is not charged for its wait.
        let ticket = self.cfg.admission.admit().await?;
        t.mark(Phase::Queue);
        let run = ModuleRun {
            flavor: self.flavor,
            bytes,
            argv,
            env: env.into_iter().collect(),
            preopens,
            stdin: req.stdin.clone().unwrap_or_default(),
            output_cap: self.spec.limits.output_bytes,
            memory_cap: self.spec.limits.memory_bytes,
            open_files: self.spec.limits.open_files,
            tools: self.tools.clone(),
            limits: self.limits(req),
            scratch: Arc::clone(self.scratch()?),
            disk_cap: self.spec.limits.disk_bytes,
            taps: taps.clone(),
        };
        let o = engine::on_guest_thread(move || {
            let _slot = ticket;
            module::run(run)
        })
        .await??;
        t.mark(Phase::Command);
        Ok(self.finish(
            Raw {
                exit_code: o.exit_code,
                limit: o.limit,
                out: o.stdout,
                err: o.stderr,
                note: o.note,
                value: None,
            },
            t,
            taps,
        ))
    }

    async fn exec_python(
        &self,
        code: String,
        req: &ExecRequest,
        mut t: TimelineRecorder,
        taps: Option<Taps>,
    ) -> Result<ExecResult> {
        let cwd = match &req.cwd {
            Some(c) => WorkspacePath::parse(c)?.in_sandbox(),
            None => WORKSPACE_MOUNT.to_string(),
        };
        let mut guard = self.state.lock().await;
        let LangState::Python(slot) = &mut *guard else {
            return Err(Error::backend(TIER, "not a Python sandbox"));
        };
        let ticket = self.cfg.admission.admit().await?;
        t.mark(Phase::Queue);
        let sess = match slot.take() {
            Some(s) => s,
            None => {
                let (s, _) = self.start_python(Arc::clone(&ticket)).await?;
                t.mark(Phase::Runtime);
                s
            }
        };
        let limits = self.limits(req);
        let cap = self.spec.limits.output_bytes;
        let env = req.env.clone();
        let stdin = req.stdin.clone().unwrap_or_default();
        let guest_taps = taps.clone();
        let (sess, r, out, err) = engine::on_guest_thread(move || {
            let _slot = ticket;
            let mut sess = sess;
            // Every turn of this call streams (the host's own turns print nothing unless
            // they fail, and then their output is the call's output).
            sess.set_taps(guest_taps.as_ref());
            let untap = |sess: Session| {
                sess.set_taps(None);
                sess
            };
            let pre = |sess: &mut Session,
                       code: String|
             -> Option<(python::TurnResult, OutputBuffer, OutputBuffer)> {
                let r = sess.turn(&code, &[], limits, cap);
                let (o, e) = sess.take_output(cap);
                if r.exit_code == Some(0) && r.alive {
                    None
                } else {
                    Some((r, o, e))
                }
            };
            if sess.cwd != cwd {
                if let Some(fail) = pre(&mut sess, python::chdir(&cwd)) {
                    let sess = untap(sess);
                    return (Some(sess).filter(|_| fail.0.alive), fail.0, fail.1, fail.2);
                }
                sess.cwd = cwd.clone();
            }
            if !env.is_empty() {
                if let Some(fail) = pre(&mut sess, python::env_apply(&env)) {
                    let sess = untap(sess);
                    return (Some(sess).filter(|_| fail.0.alive), fail.0, fail.1, fail.2);
                }
            }
            let r = sess.turn(&code, &stdin, limits, cap);
            let (o, e) = sess.take_output(cap);
            let mut sess = untap(sess);
            if r.alive && !env.is_empty() {
                let restore = python::env_restore(&env, &sess.base_env);
                let _ = sess.turn(&restore, &[], limits, cap);
                let _ = sess.take_output(cap);
            }
            let alive = r.alive;
            (Some(sess).filter(|_| alive), r, o, e)
        })
        .await?;
        *slot = sess;
        drop(guard);
        t.mark(Phase::Command);
        Ok(self.finish(
            Raw {
                exit_code: r.exit_code,
                limit: r.limit,
                out,
                err,
                note: r.note,
                value: r.value,
            },
            t,
            taps,
        ))
    }

    async fn exec_js(
        &self,
        code: String,
        req: &ExecRequest,
        mut t: TimelineRecorder,
        taps: Option<Taps>,
    ) -> Result<ExecResult> {
        let mut guard = self.state.lock().await;
        let LangState::Js(slot) = &mut *guard else {
            return Err(Error::backend(TIER, "not a JavaScript sandbox"));
        };
        let ticket = self.cfg.admission.admit().await?;
        t.mark(Phase::Queue);
        let sess = match slot.take() {
            Some(s) => s,
            None => {
                let s = JsSession::new(
                    self.spec.limits.memory_bytes,
                    self.spec.limits.output_bytes,
                    self.tools.clone(),
                )?;
                t.mark(Phase::Runtime);
                s
            }
        };
        let limits = self.limits(req);
        let cap = self.spec.limits.output_bytes;
        let guest_taps = taps.clone();
        let (sess, o) = engine::on_guest_thread(move || {
            let _slot = ticket;
            let mut sess = sess;
            let o = sess.eval(&code, limits.wall, limits.cpu, cap, guest_taps);
            (sess, o)
        })
        .await?;
        if !o.reset {
            *slot = Some(sess);
        }
        drop(guard);
        t.mark(Phase::Command);
        Ok(self.finish(
            Raw {
                exit_code: o.exit_code,
                limit: o.limit,
                out: o.stdout,
                err: o.stderr,
                note: o.note,
                value: o.value,
            },
            t,
            taps,
        ))
    }

    /// One exec; with `stream`, its output is streamed as written (see
    /// [`WasmSandbox`]'s `exec_stream`).
    async fn run(
        &self,
        req: ExecRequest,
        stream: Option<mpsc::Sender<Result<ExecEvent>>>,
    ) -> Result<ExecResult> {
        self.alive()?;
        req.validate()?;
        req.refuse_tty(TIER)?;
        let Some(tx) = stream else {
            return self.dispatch(&req, None).await;
        };
        let cap = self.spec.limits.output_bytes;
        let (out, out_rx) = stream::tap(cap);
        let (err, err_rx) = stream::tap(cap);
        let sink = |kind| Some(StreamSink::new(tx.clone(), &self.redactor, kind));
        // The call owns the taps: when it ends (or fails), they drop and the pumps finish.
        let (res, _, _) = tokio::join!(
            self.dispatch(&req, Some(Taps { out, err })),
            pump_output(Some(out_rx), cap, sink(StreamKind::Stdout)),
            pump_output(Some(err_rx), cap, sink(StreamKind::Stderr)),
        );
        res
    }

    async fn dispatch(&self, req: &ExecRequest, taps: Option<Taps>) -> Result<ExecResult> {
        let t = TimelineRecorder::start();
        match req.command.clone() {
            Command::Argv(argv) => self.exec_module(argv, req, t, taps).await,
            Command::Code(code) => match self.spec.language {
                Language::Python => self.exec_python(code, req, t, taps).await,
                Language::Javascript => self.exec_js(code, req, t, taps).await,
                _ => {
                    self.run_module(code.into_bytes(), vec!["main.wasm".into()], req, t, taps)
                        .await
                }
            },
            other => Err(Error::unsupported(TIER, format!("the command {other:?}"))),
        }
    }

    /// Packs the workspace into a snapshot draft.
    fn snapshot_draft(&self) -> Result<SnapshotDraft> {
        // Streamed beneath a handle (a link swapped in is kept as a link), sparse files kept
        // sparse, and at most `limits.disk_bytes` of data for the sandbox's own workspace
        // (a host folder is the caller's, not capped).
        let cap = match self.host_workspace {
            None => self.spec.limits.disk_bytes,
            Some(_) => u64::MAX,
        };
        let tar = fsnap::pack_dir_limited(self.workspace()?, cap)?;
        Ok(SnapshotDraft::new(
            TIER,
            ENGINE_NAME,
            vec![SnapshotKind::Filesystem],
            self.spec.clone(),
        )
        .artifact("workspace.tar", tar)
        .meta("format", SNAPSHOT_FORMAT)
        .meta("sandbox_id", self.id.clone())
        .meta(
            "state",
            "workspace files only; interpreter state (Python/JavaScript variables) is not captured",
        ))
    }
}

impl Inner {
    /// A handle on the workspace folder: the file API works beneath it (see
    /// `sandbox_core::beneath`), since code inside can swap any name for a symlink leading
    /// out (a relative one: `../../..`) at any moment.
    fn workspace_fd(&self) -> Result<OwnedFd> {
        beneath::open_dir(self.workspace()?)
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        self.alive()?;
        let ws = self.workspace_fd()?;
        // The sandbox's own workspace is capped for the file API too (see `disk`).
        if self.host_workspace.is_none() {
            let (old, new) = match beneath::size_of(ws.as_fd(), path) {
                Some(len) => (len, 0),
                None => (0, 1),
            };
            let extra = u64::try_from(data.len())
                .unwrap_or(u64::MAX)
                .saturating_sub(old);
            if !crate::disk::fits(
                self.scratch()?.root(),
                self.spec.limits.disk_bytes,
                extra,
                new,
            ) {
                return Err(Error::io(
                    format!("write {}", WorkspacePath::parse(path)?.in_sandbox()),
                    std::io::Error::from_raw_os_error(28 /* ENOSPC */),
                ));
            }
        }
        let (data, path) = (data.to_vec(), path.to_string());
        tokio::task::spawn_blocking(move || beneath::write_file(ws.as_fd(), &path, &data, None))
            .await
            .map_err(|e| Error::backend_caused(TIER, "the file API's task", e))?
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.alive()?;
        let ws = self.workspace_fd()?;
        // One read returns at most what the sandbox's disk holds (`limits.disk_bytes`).
        let max = self.spec.limits.disk_bytes;
        let path = path.to_string();
        tokio::task::spawn_blocking(move || beneath::read_file(ws.as_fd(), &path, max))
            .await
            .map_err(|e| Error::backend_caused(TIER, "the file API's task", e))?
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.alive()?;
        beneath::list(self.workspace_fd()?.as_fd(), path)
    }

    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.alive()?;
        let draft = self.snapshot_draft()?;
        Ok(store.put(draft).await?)
    }

    async fn health_check(&self) -> Result<()> {
        self.alive()?;
        if self.workspace()?.is_dir() {
            Ok(())
        } else {
            Err(Error::SandboxGone {
                id: self.id.clone(),
                reason: "workspace vanished".into(),
            })
        }
    }

    async fn destroy(&self) -> Result<()> {
        let _held = self.life.hold().await;
        self.life.release("destroyed", || {
            if let Ok(mut g) = self.state.try_lock() {
                engine::drop_later(std::mem::replace(&mut *g, LangState::Wasm));
            }
            // Only our private folders are emptied; a host workspace folder is the caller's.
            let mut dirs = Vec::new();
            if let Some(s) = self.scratch.get() {
                dirs.push(s.tmp());
                if self.host_workspace.is_none() {
                    dirs.push(s.workspace());
                }
            }
            for d in dirs {
                if let Ok(rd) = std::fs::read_dir(d) {
                    for e in rd.flatten() {
                        let p = e.path();
                        let _ = if p.is_dir() && !p.is_symlink() {
                            std::fs::remove_dir_all(&p)
                        } else {
                            std::fs::remove_file(&p)
                        };
                    }
                }
            }
        });
        Ok(())
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

    async fn health_check(&self) -> Result<()> {
        self.inner.health_check().await
    }

    async fn network_events(&self) -> Result<Vec<sandbox_core::NetworkEvent>> {
        // Deny-all only: nothing is ever asked. Gone answers as every other call.
        self.inner.life.check_not_gone()?;
        Ok(Vec::new())
    }

    async fn destroy(&self) -> Result<()> {
        self.inner.destroy().await
    }
}
