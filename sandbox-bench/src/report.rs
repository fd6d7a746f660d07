//! The report: `report.md` (tables per target × N), `results.json` (every number, every
//! latency sample) and the SVG plots.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::metrics;
use crate::mix::{TurnKind, MIX};
use crate::plot::PLOTS;
use crate::run::{Config, ErrorRecord, TargetReport};
use crate::target::TargetKind;
use crate::BenchError;

/// The machine a run happened on.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Machine {
    /// CPU model.
    pub cpu: String,
    /// Logical CPUs.
    pub cpus: usize,
    /// `MemTotal`, MiB.
    pub mem_total_mib: u64,
    /// Kernel release.
    pub kernel: String,
    /// Load averages when the run started.
    pub load_start: String,
    /// Load averages when it ended.
    pub load_end: String,
    /// Start, UTC (RFC 3339).
    pub started: String,
    /// End, UTC.
    pub finished: String,
}

impl Machine {
    /// Reads the machine's description now (`load_end`/`finished` are filled by
    /// [`Machine::finish`]).
    pub fn now() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")?
                    .split_once(':')
                    .map(|x| x.1.trim().to_string())
            })
            .unwrap_or_default();
        Machine {
            cpu,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            mem_total_mib: metrics::meminfo_kib("MemTotal").unwrap_or(0) / 1024,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            load_start: metrics::loadavg(),
            load_end: String::new(),
            started: now_utc(),
            finished: String::new(),
        }
    }

    /// Records the end of the run.
    pub fn finish(&mut self) {
        self.load_end = metrics::loadavg();
        self.finished = now_utc();
    }
}

fn now_utc() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// Everything a run produced.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Report {
    /// The machine.
    pub machine: Machine,
    /// The configuration.
    pub config: Config,
    /// One entry per target, in run order.
    pub targets: Vec<TargetReport>,
    /// Every failure.
    pub errors: Vec<ErrorRecord>,
}

impl Report {
    /// Failures in total (turns, opens, closes).
    pub fn total_errors(&self) -> usize {
        self.errors.len()
    }

    /// Writes `report.md`, `results.json` and the plots into `dir` (created if missing).
    ///
    /// # Errors
    /// A file that cannot be written, a plot that cannot be drawn.
    pub fn write(&self, dir: &Path) -> Result<(), BenchError> {
        std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
        crate::plot::write_all(dir, &self.targets)?;
        let json = serde_json::to_string_pretty(self)?;
        let p = dir.join("results.json");
        std::fs::write(&p, json).map_err(|e| BenchError::io(&p, e))?;
        let p = dir.join("report.md");
        std::fs::write(&p, self.markdown("")).map_err(|e| BenchError::io(&p, e))?;
        Ok(())
    }

    /// The report as Markdown; plots are linked as `{plot_prefix}{file}`.
    pub fn markdown(&self, plot_prefix: &str) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let c = &self.config;
        let _ = writeln!(s, "## Agent workload: results\n");
        let _ = writeln!(
            s,
            "Run {} → {} on {} × {} ({} MiB, kernel {}). Load average at start {}, at end {}.\n",
            m.started,
            m.finished,
            m.cpus,
            m.cpu,
            m.mem_total_mib,
            m.kernel,
            m.load_start,
            m.load_end
        );
        let _ = writeln!(
            s,
            "Sessions {:?}, {} turns per session (the first is the dependency turn), think time exponential with mean {} ms, seed {}, sessions opened {} at a time. Errors: **{}**.\n",
            c.sessions, c.turns, c.think_ms, c.seed, c.open_concurrency, self.total_errors()
        );

        let _ = writeln!(s, "### Targets\n");
        let _ = writeln!(
            s,
            "| target | kind | what | session | Python data library | status |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for t in &self.targets {
            let status = match &t.plan.available {
                Ok(()) => "ran".to_string(),
                Err(e) => format!("skipped: {}", cell(e)),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                t.name,
                kind(t.kind),
                cell(&t.describe),
                cell(&t.plan.session_shape),
                if t.plan.available.is_ok() {
                    t.plan.userland.data_lib.name()
                } else {
                    ""
                },
                status
            );
        }

        let _ = writeln!(s, "\n### The turn mix: which turns each target ran\n");
        let _ = writeln!(s, "| turn | weight | what |");
        let _ = writeln!(s, "|---|---|---|");
        for k in TurnKind::ALL {
            let w = MIX
                .iter()
                .find(|(m, _)| *m == k)
                .map_or("first turn".to_string(), |(_, w)| format!("{w} %"));
            let _ = writeln!(s, "| {} | {} | {} |", k.name(), w, cell(k.describe()));
        }
        let _ = writeln!(s);
        let ran: Vec<&TargetReport> = self
            .targets
            .iter()
            .filter(|t| t.plan.available.is_ok())
            .collect();
        let _ = write!(s, "| target |");
        for k in TurnKind::ALL {
            let _ = write!(s, " {} |", k.name());
        }
        let _ = writeln!(s, "\n|---|{}", "---|".repeat(TurnKind::ALL.len()));
        let mut reasons: Vec<String> = Vec::new();
        for t in &ran {
            let _ = write!(s, "| {} |", t.name);
            for k in TurnKind::ALL {
                match t.plan.kinds.get(&k) {
                    Some(Ok(())) => {
                        let _ = write!(s, " ran |");
                    }
                    Some(Err(r)) => {
                        let i = reasons.iter().position(|x| x == r).unwrap_or_else(|| {
                            reasons.push(r.clone());
                            reasons.len() - 1
                        });
                        let _ = write!(s, " skipped [{}] |", i + 1);
                    }
                    None => {
                        let _ = write!(s, " ? |");
                    }
                }
            }
            let _ = writeln!(s);
        }
        for (i, r) in reasons.iter().enumerate() {
            let _ = writeln!(s, "\n[{}] {}", i + 1, cell(r));
        }

        let _ = writeln!(
            s,
            "\n### Latency, throughput, CPU and memory per target × N\n"
        );
        let _ = writeln!(s, "| target | N | opened | turns | skipped | errors | p50 ms | p95 ms | p99 ms | max ms | turns/s | CPU ms/turn | create p50 ms | CPU ms/create | first useful p50 / p95 ms | idle PSS MiB/session | busy PSS MiB/session | idle host MiB/session |");
        let _ = writeln!(
            s,
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for t in &ran {
            for r in &t.scales {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} / {} | {:.1} | {:.1} | {:.1} |",
                    t.name, r.sessions, r.opened, r.turns_run, r.turns_skipped, r.errors,
                    ms(r.latency.p50), ms(r.latency.p95), ms(r.latency.p99), ms(r.latency.max),
                    r.turns_per_s, ms(r.cpu_ms_per_turn), ms(r.open_ms.p50), ms(r.cpu_ms_per_open),
                    ms(r.first_useful_ms.p50), ms(r.first_useful_ms.p95),
                    r.idle_mib_per_session, r.busy_mib_per_session, r.idle_host_mib_per_session
                );
            }
            for (n, why) in &t.skipped_scales {
                let _ = writeln!(
                    s,
                    "| {} | {} | not run: {} ||||||||||||||||",
                    t.name,
                    n,
                    cell(why)
                );
            }
        }

        let _ = writeln!(
            s,
            "\n### Turn latency per kind (p50 / p95 ms, the largest N run per target)\n"
        );
        let _ = write!(s, "| target | N |");
        for k in TurnKind::ALL {
            let _ = write!(s, " {} |", k.name());
        }
        let _ = writeln!(s, "\n|---|---|{}", "---|".repeat(TurnKind::ALL.len()));
        for t in &ran {
            let Some(r) = t.scales.iter().rev().find(|r| r.turns_run > 0) else {
                continue;
            };
            let _ = write!(s, "| {} | {} |", t.name, r.sessions);
            for k in TurnKind::ALL {
                match r.by_kind.get(k.name()) {
                    Some(p) => {
                        let _ = write!(s, " {} / {} |", ms(p.p50), ms(p.p95));
                    }
                    None => {
                        let _ = write!(s, " – |");
                    }
                }
            }
            let _ = writeln!(s);
        }

        let _ = writeln!(s, "\n### Density: live idle sandboxes before a limit\n");
        if self.targets.iter().all(|t| t.density.is_none()) {
            let _ = writeln!(s, "Not run (`--density`).");
        } else {
            let _ = writeln!(s, "| target | held | limit | next limit (projected) | PSS MiB/sandbox | host MiB/sandbox | kernel MiB/sandbox | threads/sandbox | fds/sandbox | create p50 / p95 ms | MemAvailable after, MiB | seconds | destroy errors |");
            let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
            for t in &ran {
                match &t.density {
                    Some(Ok(d)) => {
                        let _ = writeln!(
                            s,
                            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {} / {} | {} | {:.0} | {} |",
                            t.name,
                            d.held,
                            cell(&d.limit),
                            d.projected
                                .as_ref()
                                .map_or("–".to_string(), |(at, what)| format!("~{at}: {what}")),
                            d.mib_per_sandbox,
                            d.host_mib_per_sandbox,
                            d.kernel_mib_per_sandbox,
                            d.threads_per_sandbox,
                            d.fds_per_sandbox,
                            ms(d.open_ms.p50),
                            ms(d.open_ms.p95),
                            d.mem_available_mib,
                            d.seconds,
                            d.close_errors
                        );
                    }
                    Some(Err(e)) => {
                        let _ = writeln!(s, "| {} | – | {} |||||||||||", t.name, cell(e));
                    }
                    None => {}
                }
            }
        }

        let _ = writeln!(s, "\n### Errors\n");
        if self.errors.is_empty() {
            let _ = writeln!(
                s,
                "None: every turn, create and destroy succeeded and printed what it should."
            );
        } else {
            let _ = writeln!(s, "{} failures (the first 30):\n", self.errors.len());
            let _ = writeln!(s, "| target | N | session | where | message |");
            let _ = writeln!(s, "|---|---|---|---|---|");
            for e in self.errors.iter().take(30) {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} |",
                    e.target,
                    e.sessions,
                    e.session,
                    e.what,
                    cell(&e.message)
                );
            }
        }

        let _ = writeln!(s, "\n### Plots\n");
        for (file, title) in PLOTS {
            let _ = writeln!(s, "- [{title}]({plot_prefix}{file})");
        }
        s
    }
}

fn kind(k: TargetKind) -> &'static str {
    match k {
        TargetKind::Ours => "ours",
        TargetKind::Reference => "reference",
    }
}

/// A table cell: no pipes or newlines.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// Milliseconds with a precision that suits their size.
fn ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}
