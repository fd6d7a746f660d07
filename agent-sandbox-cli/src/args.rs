//! The command line's grammar: the commands (`Cli`, `Cmd`), and the argument types and
//! parsers that more than one command takes (the workload's question, `--tier`, `--publish`,
//! `--env`).

use std::path::PathBuf;

use agent_sandbox::{Error, IoProfile, KernelNeed, Language, Question, Tier, Trust};
use clap::{Parser, Subcommand, ValueEnum};

use crate::install_cmd::InstallWhat;
use crate::run_cmd::RunArgs;
use crate::{bench_cmd, image_cmd, serve_cmd, shell_cmd};

#[derive(Parser, Debug)]
#[command(
    name = "agent-sandbox",
    version,
    about = "Run AI-agent code in the right sandbox tier"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Cmd,
}

// Parsed once per process; the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub(crate) enum Cmd {
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

#[derive(clap::Args, Debug)]
pub(crate) struct QuestionArgs {
    /// Language: python, javascript, wasm, shell, node, c.
    #[arg(long = "lang", value_parser = parse_lang)]
    pub(crate) lang: Option<Language>,
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
pub(crate) enum TierArg {
    Auto,
    Tier(Tier),
}

pub(crate) fn parse_tier(s: &str) -> Result<TierArg, String> {
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

/// `SPORT`, `HPORT:SPORT` or `ADDR:HPORT:SPORT` (an IPv6 address in brackets).
pub(crate) fn parse_publish(s: &str) -> Result<(u16, std::net::SocketAddr), String> {
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

pub(crate) fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("`{s}`: expected KEY=VALUE")),
    }
}

impl QuestionArgs {
    pub(crate) fn question(&self, default_lang: Language) -> Question {
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
