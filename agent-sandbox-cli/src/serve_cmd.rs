//! `agent-sandbox serve`: sandboxes as a service (see `docs/server.md`).
//!
//! TCP on loopback by default, every request with the bearer token; or a Unix socket (made
//! `0600`). Without `--token-file`, a new token is written to a file only the caller can
//! read, whose path is printed (never the token). `SIGTERM` or Ctrl-C: stop accepting,
//! finish what is in flight, destroy every sandbox, exit 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use agent_sandbox::server::{Listener, Server, ServerConfig, Token};

use crate::{EXIT_SANDBOX_FAILED, EXIT_USAGE};

/// `agent-sandbox serve`.
#[derive(clap::Args, Debug)]
pub(crate) struct ServeArgs {
    /// Listen on TCP at this address (default 127.0.0.1:7878). Every request must carry the
    /// token; name a non-loopback address only on purpose.
    #[arg(long, value_name = "ADDR:PORT")]
    listen: Option<SocketAddr>,
    /// Listen on this Unix socket instead (made 0600: its permissions are the check).
    #[arg(long, value_name = "PATH", conflicts_with = "listen")]
    unix: Option<PathBuf>,
    /// Be this user's local daemon: listen on its private socket (`/run/agent-sandbox/
    /// daemon.sock` as root, else in `$XDG_RUNTIME_DIR/agent-sandbox/`), grant host access
    /// (only this user reaches the socket), keep warm pools (`--warm`, default 2), and let
    /// `run` use it: a `run` of the same build then takes a ready sandbox and leaves its
    /// teardown here (`run --no-daemon` or AGENT_SANDBOX_NO_DAEMON=1: in-process).
    #[arg(long, conflicts_with_all = ["listen", "unix", "token_file"])]
    local: bool,
    /// Ready sandboxes kept for each spec created recently, so its next create takes one
    /// (specs with host paths, secrets or an image by tag are never pooled). Default 2 with
    /// --local, else 0.
    #[arg(long, value_name = "N")]
    warm: Option<usize>,
    /// Stop (as on SIGTERM) once idle this long: no request in flight and no sandbox held
    /// (its warm pools do not count). For a daemon started with an agent session.
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    idle_exit: Option<u64>,
    /// The bearer token, in a file only its owner can read (at least 32 characters). Without
    /// it, a new token is written to `$XDG_RUNTIME_DIR/agent-sandbox/token` (or
    /// `/tmp/agent-sandbox-$UID/token`) and that path is printed. Repeat it for several
    /// clients, each named by its file's name without extension (`alice.token`: `alice`):
    /// a client sees and uses only the sandboxes and snapshots it made.
    #[arg(long, value_name = "FILE")]
    token_file: Vec<PathBuf>,
    /// Most requests one client may have in flight; more are refused (429).
    #[arg(long, value_name = "N", default_value_t = 64)]
    max_requests_per_client: usize,
    /// Largest request body, MiB.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    body_limit: usize,
    /// Most live sandboxes.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    max_sandboxes: usize,
    /// Let clients' specs reach into this host: `rootfs`, host `mounts`, a host-directory
    /// workspace, `pass_env`, `secrets`, images from local paths. Off: such specs are
    /// refused (403).
    #[arg(long)]
    allow_host_access: bool,
    /// Let clients' sandboxes reach this host's loopback, its private networks (RFC 1918,
    /// CGNAT, ULA) and its own addresses, when their network policies list them. Off: a
    /// policy listing such a range is refused (403) and the egress proxy refuses them
    /// whatever a name resolves to. On for `--local` (one user's own daemon).
    #[arg(long)]
    allow_private_networks: bool,
    /// A registry (`host[:port]`, `docker.io` for Docker Hub) whose credentials (from the
    /// Docker config) clients' image pulls may use; repeat for several. Pulls from any other
    /// registry are anonymous, so a client naming its own registry never receives the
    /// operator's credentials. Default none (all with `--local`).
    #[arg(long, value_name = "REGISTRY")]
    registry_credentials: Vec<String>,
    /// Where the server keeps its state: snapshots go to `DIR/snapshots`. Default
    /// `$XDG_STATE_HOME/agent-sandbox` (else `~/.local/state/agent-sandbox`).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Keep snapshots in an object store instead of the state directory, so a snapshot taken
    /// by one server restores on another: `s3://BUCKET[/PREFIX]` (credentials, region and
    /// endpoint from the standard `AWS_*` variables; `AWS_ENDPOINT_URL` and
    /// `AWS_ALLOW_HTTP=true` for an S3-compatible server) or `file:///DIR`.
    #[arg(long, value_name = "URL")]
    snapshot_store: Option<String>,
    /// Keep sandboxes across a restart: on SIGTERM each is snapshotted into the store (what a
    /// tier cannot snapshot is destroyed) and recorded in `DIR/kept.json`; the next `serve
    /// --keep` with the same state directory restores them under the same ids.
    #[arg(long)]
    keep: bool,
    /// An E2B template (E2B's SDKs: `Sandbox.create("NAME")`): NAME=IMAGE[,tier=T]
    /// [,memory=MIB][,cpus=N], IMAGE `-` for the tier's own userland. Repeat for several.
    /// `base`, the SDKs' default, is built in (the tier's own userland) unless named here.
    /// See docs/e2b.md.
    #[arg(long, value_name = "NAME=IMAGE[,...]")]
    template: Vec<agent_sandbox::server::e2b::Template>,
    /// The domain E2B clients reach sandboxes under by host name (`PORT-ID.DOMAIN`, their
    /// `E2B_DOMAIN`), when names under it resolve to this server. Without it, clients
    /// address sandboxes by header (`E2B_SANDBOX_URL`).
    #[arg(long, value_name = "DOMAIN")]
    e2b_domain: Option<String>,
}

/// `agent-sandbox mcp`.
#[derive(clap::Args, Debug)]
pub(crate) struct McpArgs {
    /// Where the `snapshot` and `restore` tools keep snapshots: `DIR/snapshots`. Default
    /// `$XDG_STATE_HOME/agent-sandbox` (else `~/.local/state/agent-sandbox`).
    #[arg(long, value_name = "DIR")]
    pub(crate) state_dir: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) remote: ServerArgs,
}

/// `--server URL [--token-file FILE]`, for the commands that can use a server's sandboxes
/// instead of this host's (`run`, `shell`, `mcp`).
#[derive(clap::Args, Debug)]
pub(crate) struct ServerArgs {
    /// Use sandboxes of the server at URL (`agent-sandbox serve`: http://HOST:PORT or
    /// unix:/PATH) instead of this host's; ports published then listen on the server's
    /// host. Its token: --token-file, else the file `serve` writes by default.
    #[arg(long, value_name = "URL")]
    pub(crate) server: Option<String>,
    /// The server's bearer token, in a file (with --server).
    #[arg(long, value_name = "FILE", requires = "server")]
    pub(crate) token_file: Option<PathBuf>,
}

/// The state directory: `dir`, else `$XDG_STATE_HOME/agent-sandbox`, else
/// `~/.local/state/agent-sandbox`.
fn state_dir(dir: Option<&std::path::Path>) -> Result<PathBuf, String> {
    if let Some(d) = dir {
        return Ok(d.to_path_buf());
    }
    if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d).join("agent-sandbox"));
    }
    match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(h) => Ok(PathBuf::from(h).join(".local/state/agent-sandbox")),
        None => Err("no state directory: set HOME or XDG_STATE_HOME, or give --state-dir".into()),
    }
}

/// The snapshot store in the state directory (made `0700` if new).
pub(crate) fn snapshot_store(
    dir: Option<&std::path::Path>,
) -> Result<Arc<dyn agent_sandbox::SnapshotStore>, String> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = state_dir(dir)?.join("snapshots");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| format!("make the snapshot directory {}: {e}", dir.display()))?;
    let store = agent_sandbox::ObjectSnapshotStore::local(&dir)
        .map_err(|e| format!("open the snapshot store in {}: {e}", dir.display()))?;
    Ok(Arc::new(store))
}

/// A runtime whose backends are the tiers of the server `--server` names: the token from
/// `--token-file`, else from where `serve` writes a generated one (over TCP).
pub(crate) async fn remote_runtime(args: &ServerArgs) -> Result<agent_sandbox::Runtime, String> {
    use agent_sandbox::remote::{RemoteConfig, RemoteServer};
    let url = args.server.as_deref().unwrap_or_default();
    let token_file = args.token_file.as_deref();
    let mut config = RemoteConfig::new(url).map_err(|e| e.to_string())?;
    if !url.starts_with("unix:") {
        let file = token_file.map_or_else(token_path, std::path::Path::to_path_buf);
        config = config
            .token_file(&file)
            .map_err(|e| format!("{e} (give the server's token with --token-file)"))?;
    }
    let server = RemoteServer::connect(config)
        .await
        .map_err(|e| e.to_string())?;
    let mut b = agent_sandbox::Runtime::builder();
    for backend in server.backends() {
        b = b.backend(Arc::new(backend));
    }
    Ok(b.build())
}

/// Removes what earlier runs (a server killed with `kill -9`, a crash) left on this host,
/// before serving: their sandboxes cannot be re-attached (every tier ties a sandbox's life to
/// the process that made it, so none outlives it as an orphan: a container's init dies with
/// it, a gVisor sandbox's watchdog tears it down), and what the kernel keeps (cgroups, state
/// records, and the sandboxes that were paused or frozen when their server died: a frozen
/// process acts on no signal until it is thawed) goes here, judged by whether their owner
/// still runs. Live sandboxes of other processes are never touched.
async fn sweep(runtime: &agent_sandbox::Runtime) {
    let mut removed = Vec::new();
    for tier in agent_sandbox::Tier::PRODUCT {
        let Some(b) = runtime.backend(tier) else {
            continue;
        };
        match b.cleanup_stale_report().await {
            Ok(r) if r.removed == 0 => {}
            Ok(r) if r.thawed.is_empty() => removed.push(format!("{tier} {}", r.removed)),
            Ok(r) => removed.push(format!(
                "{tier} {}, thawed first: {}",
                r.removed,
                r.thawed.join(" ")
            )),
            Err(e) => eprintln!("agent-sandbox serve: {tier}: leftovers not checked: {e}"),
        }
    }
    if !removed.is_empty() {
        eprintln!(
            "agent-sandbox serve: removed leftovers of earlier runs ({})",
            removed.join(", ")
        );
    }
}

/// Where a generated token goes.
fn token_path() -> PathBuf {
    crate::daemon::user_runtime_dir().join("token")
}

/// A new token in a new private file at `path` (its directory made 0700).
fn write_token(path: &std::path::Path) -> std::io::Result<Token> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    let token = Token::generate();
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    writeln!(f, "{}", token.reveal())?;
    Ok(token)
}

/// The snapshot store at `url` (`s3://BUCKET[/PREFIX]` or `file:///DIR`).
pub(crate) fn object_snapshot_store(
    url: &str,
) -> Result<Arc<dyn agent_sandbox::SnapshotStore>, String> {
    if let Some(dir) = url.strip_prefix("file://") {
        return snapshot_store(Some(std::path::Path::new(dir)));
    }
    #[cfg(feature = "s3")]
    if let Some(rest) = url.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(format!("`{url}` names no bucket: s3://BUCKET[/PREFIX]"));
        }
        // rustls without a built-in provider: ring, as the rest of the workspace uses.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let s3 = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .build()
            .map_err(|e| format!("the snapshot store {url}: {e}"))?;
        let prefix = prefix.trim_matches('/');
        let prefix = if prefix.is_empty() {
            "snapshots"
        } else {
            prefix
        };
        return Ok(Arc::new(agent_sandbox::ObjectSnapshotStore::new(
            Arc::new(s3),
            prefix,
        )));
    }
    Err(format!(
        "`{url}` is not a snapshot store this binary knows: use s3://BUCKET[/PREFIX] or \
         file:///DIR"
    ))
}

pub(crate) async fn run(args: ServeArgs) -> ExitCode {
    let store = match &args.snapshot_store {
        Some(url) => object_snapshot_store(url),
        None => snapshot_store(args.state_dir.as_deref()),
    };
    let store = match store {
        Ok(s) => s,
        Err(e) => {
            eprintln!("agent-sandbox serve: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    // Several clients: each a name, a token and a snapshot store of its own.
    let mut clients = Vec::new();
    let mut config = ServerConfig::default();
    // The key the server signs its snapshots with, kept so they verify after a restart.
    match state_dir(args.state_dir.as_deref()).map(|d| d.join("snapshot.key")) {
        Ok(path) => match agent_sandbox::server::signing::SnapshotKey::load_or_create(&path) {
            Ok(k) => config = config.snapshot_key(k),
            Err(e) => {
                eprintln!(
                    "agent-sandbox serve: the snapshot key {}: {e}",
                    path.display()
                );
                return ExitCode::from(EXIT_USAGE);
            }
        },
        Err(e) => eprintln!(
            "agent-sandbox serve: {e}; snapshots are signed with a key of this process only"
        ),
    }
    if args.token_file.len() > 1 && args.unix.is_none() {
        for f in &args.token_file {
            let name = f
                .file_stem()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let token = match Token::from_file(f) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("agent-sandbox serve: {e}");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            let store = if name.is_empty() {
                Err(format!("{}: no client name in the file name", f.display()))
            } else if let Some(url) = &args.snapshot_store {
                object_snapshot_store(&format!("{}/clients/{name}", url.trim_end_matches('/')))
            } else {
                state_dir(args.state_dir.as_deref())
                    .and_then(|d| snapshot_store(Some(&d.join("clients").join(&name))))
            };
            match store {
                Ok(st) => config = config.client_snapshot_store(name.clone(), st),
                Err(e) => {
                    eprintln!("agent-sandbox serve: {e}");
                    return ExitCode::from(EXIT_USAGE);
                }
            }
            clients.push((name, token));
        }
    }
    let mut config = config;
    let keep_file = match (args.keep, state_dir(args.state_dir.as_deref())) {
        (false, _) => None,
        (true, Ok(d)) => Some(d.join("kept.json")),
        (true, Err(e)) => {
            eprintln!("agent-sandbox serve: --keep: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if let Some(f) = &keep_file {
        config = config.keep_on_exit(f.clone());
    }
    for t in &args.template {
        config = config.template(t.clone());
    }
    if let Some(d) = &args.e2b_domain {
        config = config.e2b_domain(d.clone());
    }
    if !args.local {
        agent_sandbox::image::ImageStore::credentials_only_for_in_this_process(
            args.registry_credentials.clone(),
        );
    }
    let config = config
        .snapshot_store(store)
        .max_requests_per_client(args.max_requests_per_client)
        .body_limit(args.body_limit.saturating_mul(1 << 20))
        .max_sandboxes(args.max_sandboxes)
        .allow_host_access(args.allow_host_access || args.local)
        .allow_private_networks(args.allow_private_networks || args.local)
        .warm(args.warm.unwrap_or(if args.local { 2 } else { 0 }))
        .build(crate::daemon::build_id());
    // Each live sandbox holds descriptors here: a server's limit, not a shell's.
    match agent_sandbox::core::host_limits::raise_open_files_limit() {
        Ok(n) => tracing::debug!("open-files limit: {n}"),
        Err(e) => eprintln!("agent-sandbox serve: cannot raise the open-files limit: {e}"),
    }
    // Held until this function returns, after the socket is gone.
    let mut daemon_lock = None;
    let unix = if args.local {
        let path = crate::daemon::socket_path();
        if let Err(e) = crate::daemon::prepare_dir(&path) {
            eprintln!("agent-sandbox serve: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
        // One daemon per socket: a second would take the socket from the first. The lock
        // decides between two that start at the same moment (`AGENT_SANDBOX_DAEMON=auto`).
        match crate::daemon::lock(&path) {
            Ok(l) => daemon_lock = Some(l),
            Err(e) => {
                eprintln!("agent-sandbox serve: {e}");
                return ExitCode::from(EXIT_USAGE);
            }
        }
        // A server on the socket that holds no lock (one started by hand with `--unix`).
        if std::os::unix::net::UnixStream::connect(&path).is_ok() {
            eprintln!(
                "agent-sandbox serve: a server already listens on {}",
                path.display()
            );
            return ExitCode::from(EXIT_USAGE);
        }
        Some(path)
    } else {
        args.unix.clone()
    };
    let runtime = Arc::new(crate::cli_runtime());
    sweep(&runtime).await;
    let server = Server::new(runtime, config);
    let (back, lost) = server.restore_kept().await;
    if back > 0 {
        eprintln!("agent-sandbox serve: restored {back} sandboxes kept by the last run");
    }
    for l in lost {
        eprintln!("agent-sandbox serve: a kept sandbox did not come back: {l}");
    }
    let (listener, shown) = match (&unix, args.listen) {
        (Some(path), _) => {
            // A socket left by an earlier server goes; any other file there is the user's and
            // stays (the bind then fails, saying so).
            use std::os::unix::fs::FileTypeExt;
            if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                let _ = std::fs::remove_file(path);
            }
            let l = match tokio::net::UnixListener::bind(path) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("agent-sandbox serve: listen on {}: {e}", path.display());
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            use std::os::unix::fs::PermissionsExt;
            if let Err(e) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
                eprintln!("agent-sandbox serve: chmod 600 {}: {e}", path.display());
                return ExitCode::from(EXIT_SANDBOX_FAILED);
            }
            (Listener::Unix(l), format!("unix:{}", path.display()))
        }
        (None, listen) => {
            let addr = listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 7878)));
            let l = match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("agent-sandbox serve: listen on {addr}: {e}");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            let at = l.local_addr().map_or(addr, |a| a);
            if !clients.is_empty() {
                let names: Vec<String> = clients.iter().map(|(n, _)| n.clone()).collect();
                match agent_sandbox::server::Clients::new(clients) {
                    Ok(c) => (
                        Listener::TcpClients(l, c),
                        format!("http://{at} (clients: {})", names.join(", ")),
                    ),
                    Err(e) => {
                        eprintln!("agent-sandbox serve: {e}");
                        return ExitCode::from(EXIT_USAGE);
                    }
                }
            } else {
                let (token, from) = match args.token_file.first() {
                    Some(f) => match Token::from_file(f) {
                        Ok(t) => (t, f.clone()),
                        Err(e) => {
                            eprintln!("agent-sandbox serve: {e}");
                            return ExitCode::from(EXIT_USAGE);
                        }
                    },
                    None => {
                        let p = token_path();
                        match write_token(&p) {
                            Ok(t) => (t, p),
                            Err(e) => {
                                eprintln!(
                                    "agent-sandbox serve: write a token to {}: {e}",
                                    p.display()
                                );
                                return ExitCode::from(EXIT_SANDBOX_FAILED);
                            }
                        }
                    }
                };
                (
                    Listener::Tcp(l, token),
                    format!("http://{at} (bearer token in {})", from.display()),
                )
            }
        }
    };
    eprintln!("agent-sandbox serve: listening on {shown}; the API: GET /v1/openapi.json");
    let idle_exit = args.idle_exit.map(std::time::Duration::from_secs);
    let watched = server.clone();
    let idle = async move {
        let Some(limit) = idle_exit else {
            return std::future::pending().await;
        };
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            if watched.idle_for().is_some_and(|d| d >= limit) {
                eprintln!("agent-sandbox serve: idle for {}s", limit.as_secs());
                return;
            }
        }
    };
    let shutdown = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                    _ = idle => {}
                }
            }
            Err(_) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = idle => {}
                }
            }
        }
        eprintln!("agent-sandbox serve: stopping (finishing requests, destroying sandboxes)");
    };
    let r = server.serve(listener, shutdown).await;
    if let Some(f) = &keep_file {
        let n = server.kept();
        eprintln!(
            "agent-sandbox serve: kept {n} sandboxes in {} for the next `serve --keep`",
            f.display()
        );
    }
    if let Some(p) = &unix {
        let _ = std::fs::remove_file(p);
    }
    drop(daemon_lock);
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agent-sandbox serve: {e}");
            ExitCode::from(EXIT_SANDBOX_FAILED)
        }
    }
}
