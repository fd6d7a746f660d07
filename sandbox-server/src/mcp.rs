//! The Model Context Protocol server: sandboxes as tools an agent calls (`agent-sandbox mcp`
//! over stdio). Built on `rmcp`, the official Rust MCP SDK; the tools' input schemas are
//! derived from the argument types below.
//!
//! Tools: `run_code` (a language and code; `session` to reuse a sandbox, else a new one, whose
//! id the answer gives), `create_sandbox`, `exec`, `write_file`, `read_file`, `list_files`,
//! `destroy_sandbox`. A session is one sandbox: its files persist across calls, and on tiers
//! with interpreter sessions (the wasm tier's Python and JavaScript) so do variables and
//! imports. Answers are plain text an LLM reads well: the exit code, the limit hit if any,
//! stdout and stderr. A failed call (an unknown session, a bad path) is a tool error whose
//! text says what to do; the server goes on.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::{schemars, tool, tool_handler, tool_router, ServerHandler, ServiceExt};
use sandbox_core::{
    ExecRequest, ExecResult, Language, Sandbox, SandboxSpec, SnapshotId, SnapshotStore, Tier,
};

use crate::Provider;

/// Most sandboxes one MCP connection may hold at once.
const MAX_SESSIONS: usize = 64;

/// `run_code`'s arguments.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
#[non_exhaustive]
pub struct RunCode {
    /// python, javascript, shell, node or c.
    pub language: String,
    /// The code to run.
    pub code: String,
    /// A session id from an earlier call, to run in the same sandbox (its files, and on tiers
    /// with interpreter sessions its variables, persist). Omit to start a new one.
    #[serde(default)]
    pub session: Option<String>,
    /// Wall time limit in milliseconds (default: the sandbox's, 30 s).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// `create_sandbox`'s arguments.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
#[non_exhaustive]
pub struct CreateSandbox {
    /// The language its code strings are in: python, javascript, shell, node or c.
    pub language: String,
    /// wasm, container, gvisor or microvm; omit for the best tier this host can run.
    #[serde(default)]
    pub tier: Option<String>,
}

/// `exec`'s arguments.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
#[non_exhaustive]
pub struct Exec {
    /// The session (sandbox) id.
    pub session: String,
    /// The program and its arguments.
    pub argv: Vec<String>,
    /// Wall time limit in milliseconds.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// `write_file`'s arguments.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
#[non_exhaustive]
pub struct WriteFile {
    /// The session (sandbox) id.
    pub session: String,
    /// A path under /workspace (relative, or absolute under /workspace).
    pub path: String,
    /// The file's text.
    pub content: String,
}

/// Arguments naming a path in a session.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
#[non_exhaustive]
pub struct SessionPath {
    /// The session (sandbox) id.
    pub session: String,
    /// A path under /workspace (relative, or absolute under /workspace).
    #[serde(default)]
    pub path: Option<String>,
}

/// Arguments naming a session.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
#[non_exhaustive]
pub struct Session {
    /// The session (sandbox) id.
    pub session: String,
}

/// `restore`'s arguments.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
#[non_exhaustive]
pub struct Restore {
    /// A snapshot id from an earlier `snapshot` answer.
    pub snapshot: String,
}

/// A check of a spec that may refuse it, saying why (the answer the HTTP API gives).
pub type SpecCheck = Arc<dyn Fn(&SandboxSpec) -> Result<(), crate::ApiError> + Send + Sync>;

/// The MCP service. Cheap to clone (clones share the sessions).
#[derive(Clone)]
pub struct SandboxMcp {
    provider: Arc<dyn Provider>,
    snapshots: Option<Arc<dyn SnapshotStore>>,
    /// What a restored snapshot's spec must pass (a server's checks for its clients).
    spec_check: Option<SpecCheck>,
    sessions: Arc<Mutex<HashMap<String, Arc<dyn Sandbox>>>>,
    tool_router: ToolRouter<SandboxMcp>,
}

impl std::fmt::Debug for SandboxMcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxMcp")
            .field("sessions", &self.lock().len())
            .finish_non_exhaustive()
    }
}

/// A tool error: the text says what went wrong and what to do.
fn tool_error(message: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message.into())])
}

fn text(t: impl Into<String>) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(t.into())])
}

/// An exec's answer: the text of [`describe`], then each output's image (PNG or JPEG) as
/// MCP image content, so that a client model sees the charts a cell drew.
fn answer(session: Option<(&str, Tier)>, r: &ExecResult) -> CallToolResult {
    let mut blocks = vec![ContentBlock::text(describe(session, r))];
    for o in &r.outputs {
        for mime in ["image/png", "image/jpeg"] {
            if let Some(data) = o.get(mime) {
                blocks.push(ContentBlock::image(data, mime));
            }
        }
    }
    CallToolResult::success(blocks)
}

/// An exec's result as an LLM reads it (`session`: the sandbox it ran in, named first).
fn describe(session: Option<(&str, Tier)>, r: &ExecResult) -> String {
    let mut s = String::new();
    if let Some((id, tier)) = session {
        s.push_str(&format!("session: {id}\ntier: {tier}\n"));
    }
    match r.exit_code {
        Some(c) => s.push_str(&format!("exit code: {c}\n")),
        None => s.push_str("exit code: none (it did not exit normally)\n"),
    }
    if let Some(l) = r.limit {
        let name = serde_json::to_value(l)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| format!("{l:?}"));
        s.push_str(&format!("stopped by a limit: {name}\n"));
    }
    if r.truncated {
        s.push_str("output truncated at the sandbox's cap\n");
    }
    if let Some(v) = &r.value {
        s.push_str(&format!("value: {v}\n"));
    }
    if let Some(e) = &r.error {
        s.push_str(&format!("error: {}: {}\n", e.name, e.value));
    }
    for (i, o) in r.outputs.iter().enumerate() {
        let images = o.data.keys().filter(|m| m.starts_with("image/")).count();
        let text = o.text().unwrap_or("");
        s.push_str(&format!("output {}: {text}", i + 1));
        if images > 0 {
            s.push_str(" (an image follows)");
        }
        s.push('\n');
    }
    s.push_str("--- stdout ---\n");
    s.push_str(&r.stdout_str());
    if !r.stderr.is_empty() {
        s.push_str("\n--- stderr ---\n");
        s.push_str(&r.stderr_str());
    }
    s
}

fn parse_language(l: &str) -> Result<Language, CallToolResult> {
    serde_json::from_value::<Language>(serde_json::Value::String(l.to_ascii_lowercase())).map_err(
        |_| {
            tool_error(format!(
                "unknown language `{l}`: use python, javascript, shell, node or c"
            ))
        },
    )
}

fn parse_tier(t: &str) -> Result<Tier, CallToolResult> {
    serde_json::from_value::<Tier>(serde_json::Value::String(t.to_ascii_lowercase())).map_err(
        |_| {
            tool_error(format!(
                "unknown tier `{t}`: use wasm, container, gvisor or microvm"
            ))
        },
    )
}

fn request(mut req: ExecRequest, timeout_ms: Option<u64>) -> ExecRequest {
    if let Some(ms) = timeout_ms {
        req = req.timeout(std::time::Duration::from_millis(ms));
    }
    req
}

#[tool_router]
impl SandboxMcp {
    /// A service whose sandboxes come from `provider`.
    pub fn new(provider: Arc<dyn Provider>) -> SandboxMcp {
        SandboxMcp {
            provider,
            snapshots: None,
            spec_check: None,
            sessions: Arc::new(Mutex::new(HashMap::new())),
            tool_router: Self::tool_router(),
        }
    }

    /// Where the `snapshot` and `restore` tools keep snapshots (`None`: those tools answer
    /// that this server keeps none).
    pub fn with_snapshot_store(mut self, store: Option<Arc<dyn SnapshotStore>>) -> SandboxMcp {
        self.snapshots = store;
        self
    }

    /// Checks every snapshot's spec before `restore` uses it (a server passes the checks it
    /// applies to its clients' specs: host access, private networks, registries), so a
    /// snapshot written into a client's store cannot carry what a create would be refused.
    pub fn with_spec_check(mut self, check: SpecCheck) -> SandboxMcp {
        self.spec_check = Some(check);
        self
    }

    fn store(&self) -> Result<Arc<dyn SnapshotStore>, CallToolResult> {
        self.snapshots.clone().ok_or_else(|| {
            tool_error(
                "this server keeps no snapshots (start it with a snapshot store: \
                 `agent-sandbox mcp --state-dir DIR` or `serve --state-dir DIR`)",
            )
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<dyn Sandbox>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn session(&self, id: &str) -> Result<Arc<dyn Sandbox>, CallToolResult> {
        self.lock().get(id).cloned().ok_or_else(|| {
            tool_error(format!(
                "no session `{id}` (start one with run_code without a session, or create_sandbox)"
            ))
        })
    }

    async fn create(
        &self,
        language: Language,
        tier: Option<Tier>,
    ) -> Result<(String, Arc<dyn Sandbox>), CallToolResult> {
        if self.lock().len() >= MAX_SESSIONS {
            return Err(tool_error(format!(
                "this server holds {MAX_SESSIONS} sessions already: destroy_sandbox one first"
            )));
        }
        let spec = SandboxSpec::new(language);
        let sb: Arc<dyn Sandbox> = match self.provider.create(&spec, tier).await {
            Ok(sb) => Arc::from(sb),
            Err(e) => return Err(tool_error(e.to_string())),
        };
        let id = sb.id().to_string();
        self.lock().insert(id.clone(), Arc::clone(&sb));
        Ok((id, sb))
    }

    /// How many sessions (each a sandbox) are live.
    pub(crate) fn live(&self) -> usize {
        self.lock().len()
    }

    /// Destroys every session's sandbox (when the client goes).
    pub async fn destroy_all(&self) {
        let all: Vec<Arc<dyn Sandbox>> = self.lock().drain().map(|(_, s)| s).collect();
        for sb in all {
            let _ = sb.destroy().await;
        }
    }

    #[tool(
        description = "Run code in a sandbox and return its exit code, stdout and stderr. Give `session` (from an earlier answer) to run in the same sandbox: files persist, and variables too where the tier keeps an interpreter session. Without it a new sandbox starts; the answer names its session."
    )]
    async fn run_code(&self, Parameters(a): Parameters<RunCode>) -> CallToolResult {
        let language = match parse_language(&a.language) {
            Ok(l) => l,
            Err(e) => return e,
        };
        let (id, sb) = match &a.session {
            Some(id) => match self.session(id) {
                Ok(sb) => (id.clone(), sb),
                Err(e) => return e,
            },
            None => match self.create(language, None).await {
                Ok(x) => x,
                Err(e) => return e,
            },
        };
        if sb.spec().language != language {
            return tool_error(format!(
                "session {id} runs {} code, not {language}; start another session for {language}",
                sb.spec().language
            ));
        }
        match sb
            .exec(request(ExecRequest::code(a.code), a.timeout_ms))
            .await
        {
            Ok(r) => answer(Some((&id, sb.tier())), &r),
            Err(e) => tool_error(e.to_string()),
        }
    }

    #[tool(description = "Create a sandbox for code in `language` and return its session id.")]
    async fn create_sandbox(&self, Parameters(a): Parameters<CreateSandbox>) -> CallToolResult {
        let language = match parse_language(&a.language) {
            Ok(l) => l,
            Err(e) => return e,
        };
        let tier = match a.tier.as_deref().map(parse_tier).transpose() {
            Ok(t) => t,
            Err(e) => return e,
        };
        match self.create(language, tier).await {
            Ok((id, sb)) => text(format!("session: {id}\ntier: {}", sb.tier())),
            Err(e) => e,
        }
    }

    #[tool(description = "Run a program with arguments in a session's sandbox.")]
    async fn exec(&self, Parameters(a): Parameters<Exec>) -> CallToolResult {
        let sb = match self.session(&a.session) {
            Ok(sb) => sb,
            Err(e) => return e,
        };
        match sb
            .exec(request(ExecRequest::argv(a.argv), a.timeout_ms))
            .await
        {
            Ok(r) => answer(None, &r),
            Err(e) => tool_error(e.to_string()),
        }
    }

    #[tool(
        description = "Write a text file in a session's workspace (parent directories are made)."
    )]
    async fn write_file(&self, Parameters(a): Parameters<WriteFile>) -> CallToolResult {
        let sb = match self.session(&a.session) {
            Ok(sb) => sb,
            Err(e) => return e,
        };
        match sb.write_file(&a.path, a.content.as_bytes()).await {
            Ok(()) => text(format!("wrote {} bytes to {}", a.content.len(), a.path)),
            Err(e) => tool_error(e.to_string()),
        }
    }

    #[tool(description = "Read a file from a session's workspace (as text).")]
    async fn read_file(&self, Parameters(a): Parameters<SessionPath>) -> CallToolResult {
        let sb = match self.session(&a.session) {
            Ok(sb) => sb,
            Err(e) => return e,
        };
        let Some(path) = a.path else {
            return tool_error("give `path`");
        };
        match sb.read_file(&path).await {
            Ok(b) => text(String::from_utf8_lossy(&b).into_owned()),
            Err(e) => tool_error(e.to_string()),
        }
    }

    #[tool(description = "List a directory of a session's workspace (default: the workspace).")]
    async fn list_files(&self, Parameters(a): Parameters<SessionPath>) -> CallToolResult {
        let sb = match self.session(&a.session) {
            Ok(sb) => sb,
            Err(e) => return e,
        };
        match sb.list(a.path.as_deref().unwrap_or(".")).await {
            Ok(entries) => {
                let lines: Vec<String> = entries
                    .iter()
                    .map(|e| format!("{:?}\t{}\t{}", e.kind, e.size, e.name))
                    .collect();
                text(lines.join("\n"))
            }
            Err(e) => tool_error(e.to_string()),
        }
    }

    #[tool(
        description = "Snapshot a session's sandbox (its files, and its interpreter state where the tier keeps one) and return the snapshot id; `restore` starts new sessions from it."
    )]
    async fn snapshot(&self, Parameters(a): Parameters<Session>) -> CallToolResult {
        let store = match self.store() {
            Ok(s) => s,
            Err(e) => return e,
        };
        let sb = match self.session(&a.session) {
            Ok(sb) => sb,
            Err(e) => return e,
        };
        match sb.snapshot(store.as_ref()).await {
            Ok(id) => text(format!("snapshot: {id}")),
            Err(e) => tool_error(e.to_string()),
        }
    }

    #[tool(description = "Start a new session from a snapshot id and return its session id.")]
    async fn restore(&self, Parameters(a): Parameters<Restore>) -> CallToolResult {
        let store = match self.store() {
            Ok(s) => s,
            Err(e) => return e,
        };
        let Ok(id) = a.snapshot.parse::<SnapshotId>() else {
            return tool_error(format!(
                "`{}` is not a snapshot id (64 hex digits, as `snapshot` answers)",
                a.snapshot
            ));
        };
        if self.lock().len() >= MAX_SESSIONS {
            return tool_error(format!(
                "this server holds {MAX_SESSIONS} sessions already: destroy_sandbox one first"
            ));
        }
        if let Some(check) = &self.spec_check {
            let spec = match store.manifest(&id).await {
                Ok(m) => m.spec,
                Err(e) => return tool_error(e.to_string()),
            };
            if let Err(why) = check(&spec) {
                return tool_error(why.message);
            }
        }
        let sb: Arc<dyn Sandbox> = match self.provider.restore(store.as_ref(), &id).await {
            Ok(sb) => Arc::from(sb),
            Err(e) => return tool_error(e.to_string()),
        };
        let session = sb.id().to_string();
        self.lock().insert(session.clone(), Arc::clone(&sb));
        text(format!("session: {session}\ntier: {}", sb.tier()))
    }

    #[tool(description = "Destroy a session's sandbox.")]
    async fn destroy_sandbox(&self, Parameters(a): Parameters<Session>) -> CallToolResult {
        let sb = self.lock().remove(&a.session);
        match sb {
            Some(sb) => match sb.destroy().await {
                Ok(()) => text(format!("destroyed {}", a.session)),
                Err(e) => tool_error(e.to_string()),
            },
            None => tool_error(format!("no session `{}`", a.session)),
        }
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for SandboxMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new(
                "agent-sandbox",
                env!("CARGO_PKG_VERSION"),
            ))
            .with_instructions(
                "Run code in isolated sandboxes. Call run_code with a language and code; keep \
                 the session id it answers to run more code in the same sandbox; \
                 destroy_sandbox when done.",
            )
    }
}

/// Serves MCP on this process's stdin and stdout until the client closes them; then
/// destroys every sandbox the client made.
/// `snapshots`: where the `snapshot` and `restore` tools keep snapshots.
pub async fn serve_stdio(
    provider: Arc<dyn Provider>,
    snapshots: Option<Arc<dyn SnapshotStore>>,
) -> std::io::Result<()> {
    let service = SandboxMcp::new(provider).with_snapshot_store(snapshots);
    let keep = service.clone();
    let running = service
        .serve(rmcp::transport::stdio())
        .await
        .map_err(std::io::Error::other)?;
    let r = running.waiting().await.map_err(std::io::Error::other);
    keep.destroy_all().await;
    r.map(|_| ())
}

/// The MCP endpoint over streamable HTTP (`/mcp`), serving `service`'s sessions to every
/// client (one principal: whoever passed the caller's token check). `loopback`: keep
/// `rmcp`'s `Host` header checks (the server listens on loopback; they stop DNS rebinding);
/// otherwise they are off and the token is the check. Streams end when `stop` is cancelled.
pub fn http_router(
    service: SandboxMcp,
    loopback: bool,
    body_limit: usize,
    stop: tokio_util::sync::CancellationToken,
) -> axum::Router {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let mut config = StreamableHttpServerConfig::default()
        .with_cancellation_token(stop)
        .with_max_request_body_bytes(body_limit);
    if !loopback {
        config = config.disable_allowed_hosts();
    }
    let http = StreamableHttpService::new(
        move || Ok(service.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    axum::Router::new().nest_service("/mcp", http)
}
