//! The `agent-sandbox` command line: `probe`, `select`, `run`, `install`.

use std::io::Write;
use std::process::ExitCode;

use agent_sandbox::Runtime;
use clap::Parser;

mod args;
mod bench_cmd;
mod daemon;
mod image_cmd;
mod install_cmd;
mod outputs;
mod run_cmd;
mod serve_cmd;
mod shell_cmd;
mod tiers_cmd;

use args::{Cli, Cmd};

/// Exit status when the sandbox itself failed (as `docker run` and `env` do).
const EXIT_SANDBOX_FAILED: u8 = 125;
/// Exit status for bad arguments (as clap uses).
const EXIT_USAGE: u8 = 2;

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

/// The runtime the CLI uses: every built-in tier; the wasm tier installs Python on first use
/// with progress on stderr (the library's defaults).
fn cli_runtime() -> Runtime {
    Runtime::new()
}

async fn async_main(cli: Cli) -> ExitCode {
    match cli.command {
        Cmd::Install {
            what,
            kernel,
            modules,
            dir,
        } => install_cmd::run(what, kernel, modules, dir).await,
        Cmd::Cleanup { json } => tiers_cmd::cleanup(json).await,
        Cmd::Probe { json } => tiers_cmd::probe(json).await,
        Cmd::Select { q, json } => tiers_cmd::select(q, json).await,
        Cmd::Run(args) => run_cmd::run(args).await,
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
