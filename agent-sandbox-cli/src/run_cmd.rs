//! `agent-sandbox run`: its arguments, where it runs (a `--server`, this user's local daemon,
//! or this process), and how its result is shown.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use agent_sandbox::{
    Cidr, DenyRule, Error, ExecRequest, HostRule, Language, Mount, NetworkPolicy, Runtime,
    SandboxSpec, Tier, TierChoice,
};
use serde_json::json;

use crate::args::{parse_env, parse_publish, parse_tier, QuestionArgs, TierArg};
use crate::{daemon, image_cmd, print_json, serve_cmd, EXIT_SANDBOX_FAILED, EXIT_USAGE};

#[derive(clap::Args, Debug)]
pub(crate) struct RunArgs {
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
    /// Print one JSON object instead of the raw output (with a code cell's rich outputs).
    #[arg(long)]
    json: bool,
    /// Write a code cell's images and HTML (charts, tables) into DIR as `output-N.EXT`.
    #[arg(long, value_name = "DIR")]
    outputs: Option<PathBuf>,
    /// Code to run, in the language given by --lang (default python).
    #[arg(short = 'c', value_name = "CODE", conflicts_with = "argv")]
    code: Option<String>,
    /// The command and its arguments (after `--`).
    #[arg(last = true, value_name = "CMD")]
    argv: Vec<String>,
}

fn parse_host_rule(s: &str) -> Result<HostRule, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

fn parse_cidr(s: &str) -> Result<Cidr, String> {
    s.parse().map_err(|e: Error| e.to_string())
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

/// `run`: through the `--server` if one is given, else through this user's local daemon when
/// one listens, else in this process.
pub(crate) async fn run(args: RunArgs) -> ExitCode {
    if args.remote.server.is_some() {
        return match serve_cmd::remote_runtime(&args.remote).await {
            Ok(rt) => run_via(Via::Runtime(&rt), args).await,
            Err(e) => {
                eprintln!("agent-sandbox: {e}");
                ExitCode::from(EXIT_SANDBOX_FAILED)
            }
        };
    }
    // This user's local daemon, when one of this build listens: secrets stay
    // in-process (their values come from this process's environment and files).
    if !args.no_daemon && args.secret.is_empty() && args.publish.is_empty() {
        return match daemon::connect(matches!(args.tier, TierArg::Tier(_))).await {
            Ok(server) => run_via(Via::Daemon(server), args).await,
            Err(daemon::Missing::NotListening) if daemon::auto_start() => {
                daemon::start_in_background();
                run_here(args).await
            }
            Err(_) => run_here(args).await,
        };
    }
    run_here(args).await
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

/// `run` in this process.
async fn run_here(args: RunArgs) -> ExitCode {
    match runtime_here(&args) {
        Ok(rt) => run_via(Via::Runtime(&rt), args).await,
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

async fn run_via(via: Via<'_>, args: RunArgs) -> ExitCode {
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
                    "outputs": r.outputs,
                    "error": r.error,
                    "timeline": r.timeline,
                }));
            } else {
                let _ = std::io::stdout().write_all(&r.stdout);
                let _ = crate::outputs::print_text(&r.outputs, &mut std::io::stdout());
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
            if let Some(dir) = &args.outputs {
                match crate::outputs::write_files(&r.outputs, dir) {
                    Ok(files) => {
                        for f in files {
                            eprintln!("agent-sandbox: wrote {}", f.display());
                        }
                    }
                    Err(e) => eprintln!("agent-sandbox: {e}"),
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
