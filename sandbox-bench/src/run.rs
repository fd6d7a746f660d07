//! The harness: N concurrent sessions per target, K turns each with seeded think time, and
//! the density test.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::metrics::{self, Latency, Percentiles};
use crate::mix::{self, TurnKind};
use crate::target::{DynTarget, Plan, Session, TargetError, TargetKind, TURN_GUARD};

/// What to run.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Config {
    /// Concurrent sessions, one run per value (default 1, 10, 50, 200).
    pub sessions: Vec<usize>,
    /// Turns per session, the dependency turn included.
    pub turns: u32,
    /// Mean think time between turns, ms (exponential; 0: none).
    pub think_ms: f64,
    /// Seed of the schedules.
    pub seed: u64,
    /// Where the report, plots and JSON go.
    pub out: PathBuf,
    /// Run the density test.
    pub density: bool,
    /// Safety cap of the density test: at most this many live sandboxes per target.
    pub density_cap: usize,
    /// Time budget of the density test per target, seconds.
    pub density_seconds: u64,
    /// Memory kept free: density stops, and a scale is skipped, when `MemAvailable` would
    /// fall below this (MiB).
    pub reserve_mib: u64,
    /// Sessions opened at once (the create phase's concurrency).
    pub open_concurrency: usize,
    /// Largest N the reference engines run (`None`: every N), to keep a run's wall time
    /// in bounds; larger N are reported as not run with this reason.
    pub reference_max_sessions: Option<usize>,
    /// Largest N per target name (`wasm`, `ref:runsc`, ...), to keep a run's wall time in
    /// bounds; larger N are reported as not run with this reason.
    pub max_sessions: BTreeMap<String, usize>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            sessions: vec![1, 10, 50, 200],
            turns: 10,
            think_ms: 500.0,
            seed: 1,
            out: PathBuf::from("workload-report"),
            density: false,
            density_cap: 500,
            density_seconds: 90,
            reserve_mib: 2048,
            open_concurrency: 8,
            reference_max_sessions: None,
            max_sessions: BTreeMap::new(),
        }
    }
}

impl Config {
    /// CI scale: 1 and 2 sessions, 3 turns, no think time, density capped at 8.
    pub fn quick() -> Self {
        Config {
            sessions: vec![1, 2],
            turns: 3,
            think_ms: 0.0,
            density_cap: 8,
            density_seconds: 20,
            ..Config::default()
        }
    }
}

/// One target at one concurrency.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct ScaleResult {
    /// Concurrent sessions asked for.
    pub sessions: usize,
    /// Sessions that opened.
    pub opened: usize,
    /// Turns run (successful or not).
    pub turns_run: u64,
    /// Turns the target skipped (kinds it cannot run).
    pub turns_skipped: u64,
    /// Failed turns, opens and closes.
    pub errors: u64,
    /// Turn latency over all kinds, ms.
    pub latency: Percentiles,
    /// Turn latency per kind, ms.
    pub by_kind: BTreeMap<String, Percentiles>,
    /// Turns completed per second of the turn phase (think time included).
    pub turns_per_s: f64,
    /// Length of the turn phase, s.
    pub turn_phase_s: f64,
    /// Host CPU of the process tree per turn, ms (turn phase).
    pub cpu_ms_per_turn: f64,
    /// Host CPU of the process tree per session opened, ms (open phase).
    pub cpu_ms_per_open: f64,
    /// Session open (sandbox create) latency, ms.
    pub open_ms: Percentiles,
    /// Open + dependency turn + first useful turn, per session, ms.
    pub first_useful_ms: Percentiles,
    /// PSS of the tree per live idle session (after open, before any turn), MiB.
    pub idle_mib_per_session: f64,
    /// Drop of the host's `MemAvailable` per live idle session over the open phase, MiB:
    /// includes kernel memory (namespaces, cgroups, page tables, tmpfs, page cache) that PSS
    /// leaves out, and whatever other tenants of the machine did meanwhile.
    pub idle_host_mib_per_session: f64,
    /// Peak PSS of the tree per live session during the turn phase, MiB.
    pub busy_mib_per_session: f64,
    /// Most processes in the tree seen during the turn phase.
    pub peak_processes: usize,
    /// Every turn latency, µs (the CDF's input).
    pub latency_samples_us: Vec<u64>,
}

/// One failure, reported as it happened.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct ErrorRecord {
    /// The target.
    pub target: String,
    /// The concurrency of the run (0: density test).
    pub sessions: usize,
    /// The session index.
    pub session: usize,
    /// Where: a turn kind, `open` or `close`.
    pub what: String,
    /// The message.
    pub message: String,
}

/// The density test of one target.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Density {
    /// Live idle sandboxes held at the end.
    pub held: usize,
    /// What stopped it.
    pub limit: String,
    /// PSS of the tree per live sandbox, MiB.
    pub mib_per_sandbox: f64,
    /// Drop of the host's `MemAvailable` per live sandbox, MiB (kernel memory included;
    /// other tenants' activity too).
    pub host_mib_per_sandbox: f64,
    /// Growth of the host's kernel memory per live sandbox, MiB (slab, kernel stacks, page
    /// tables, per-CPU: see [`metrics::kernel_kib`]); part of `host_mib_per_sandbox`.
    pub kernel_mib_per_sandbox: f64,
    /// Host threads per live sandbox.
    pub threads_per_sandbox: f64,
    /// Open files of this process per live sandbox.
    pub fds_per_sandbox: f64,
    /// Where the measured resources would stop the test if the limit had not: the first of
    /// memory (down to the reserve), open files and threads (or pids) to run out at the
    /// per-sandbox rates above, as `(sandboxes, resource)`; `None` when nothing grew.
    pub projected: Option<(usize, String)>,
    /// Create latency, ms.
    pub open_ms: Percentiles,
    /// `MemAvailable` at the end, MiB.
    pub mem_available_mib: u64,
    /// How long the test ran, s.
    pub seconds: f64,
    /// Sandboxes whose destroy failed afterwards.
    pub close_errors: usize,
}

/// Everything measured for one target.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct TargetReport {
    /// Its name.
    pub name: String,
    /// Ours or a reference.
    pub kind: TargetKind,
    /// What it is.
    pub describe: String,
    /// What it ran and skipped.
    pub plan: Plan,
    /// One result per concurrency run.
    pub scales: Vec<ScaleResult>,
    /// Concurrencies not run, with the reason.
    pub skipped_scales: Vec<(usize, String)>,
    /// The density test, when asked and applicable.
    pub density: Option<Result<Density, String>>,
}

/// An open session: its index, the session, how long it took to open.
type Live = (usize, Arc<Box<dyn Session>>, Duration);

/// Drives one target at concurrency `n`.
async fn run_scale(
    name: &str,
    target: &DynTarget,
    plan: &Arc<Plan>,
    n: usize,
    cfg: &Config,
    errors: &mut Vec<ErrorRecord>,
) -> ScaleResult {
    let mut err = |session: usize, what: &str, message: String| {
        errors.push(ErrorRecord {
            target: name.to_string(),
            sessions: n,
            session,
            what: what.to_string(),
            message,
        })
    };
    let base_pss = metrics::settled_pss_kib(Duration::from_secs(15)).await;
    let cpu0 = metrics::tree_cpu_ms();
    let avail0 = metrics::meminfo_kib("MemAvailable").unwrap_or(0);

    // Open phase: every session created, `open_concurrency` at a time.
    let sem = Arc::new(Semaphore::new(cfg.open_concurrency.max(1)));
    let mut opens = JoinSet::new();
    for i in 0..n {
        let (t, p, sem) = (target.clone(), plan.clone(), sem.clone());
        opens.spawn(async move {
            let _permit = sem.acquire_owned().await;
            let start = Instant::now();
            let r = tokio::time::timeout(TURN_GUARD, t.open(&p)).await;
            let r = r.unwrap_or_else(|_| Err(TargetError::TimedOut("open")));
            (i, r, start.elapsed())
        });
    }
    let mut sessions: Vec<Live> = Vec::new();
    let mut open_lat = Latency::new();
    while let Some(j) = opens.join_next().await {
        match j {
            Ok((i, Ok(s), d)) => {
                open_lat.record(d);
                sessions.push((i, Arc::new(s), d));
            }
            Ok((i, Err(e), _)) => err(i, "open", e.to_string()),
            Err(e) => err(usize::MAX, "open", format!("task: {e}")),
        }
    }
    sessions.sort_by_key(|s| s.0);
    let opened = sessions.len();
    let cpu1 = metrics::tree_cpu_ms();
    let idle_pss = tokio::task::spawn_blocking(metrics::tree_pss_kib)
        .await
        .unwrap_or(0);
    let avail1 = metrics::meminfo_kib("MemAvailable").unwrap_or(0);

    // Turn phase, with a PSS sampler once a second.
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let sampler = tokio::spawn(async move {
        let mut peak = (0u64, 0usize);
        loop {
            let (p, procs) = tokio::task::spawn_blocking(|| {
                (metrics::tree_pss_kib(), metrics::tree_processes())
            })
            .await
            .unwrap_or((0, 0));
            peak = (peak.0.max(p), peak.1.max(procs));
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop_rx.changed() => break,
            }
        }
        peak
    });
    let phase = Instant::now();
    let mut runs = JoinSet::new();
    for (i, s, open_d) in &sessions {
        let (s, plan, i, open_d) = (s.clone(), plan.clone(), *i, *open_d);
        let sched = mix::schedule(cfg.seed, i, cfg.turns, cfg.think_ms);
        runs.spawn(async move { drive(i, s, &plan, sched, open_d).await });
    }
    let mut all = Latency::new();
    let mut by_kind: BTreeMap<TurnKind, Latency> = BTreeMap::new();
    let mut first_useful = Latency::new();
    let (mut turns_run, mut skipped) = (0u64, 0u64);
    while let Some(j) = runs.join_next().await {
        match j {
            Ok(o) => {
                for (k, d) in &o.turns {
                    all.record(*d);
                    by_kind.entry(*k).or_default().record(*d);
                }
                turns_run += o.turns.len() as u64;
                skipped += o.skipped;
                if let Some(d) = o.first_useful {
                    first_useful.record(d);
                }
                for (k, m) in o.errors {
                    err(o.session, k.name(), m);
                }
            }
            Err(e) => err(usize::MAX, "turns", format!("task: {e}")),
        }
    }
    let turn_phase = phase.elapsed();
    let cpu2 = metrics::tree_cpu_ms();
    let _ = stop_tx.send(true);
    let (peak_pss, peak_procs) = sampler.await.unwrap_or((0, 0));

    // Close phase.
    let mut closes = JoinSet::new();
    for (i, s, _) in sessions {
        let sem = sem.clone();
        closes.spawn(async move {
            let _permit = sem.acquire_owned().await;
            let r = match Arc::try_unwrap(s) {
                Ok(s) => s.close().await,
                Err(_) => Err(TargetError::Failed("session still shared at close".into())),
            };
            (i, r)
        });
    }
    while let Some(j) = closes.join_next().await {
        if let Ok((i, Err(e))) = j {
            err(i, "close", e.to_string());
        }
    }

    let per = |kib: u64| {
        if opened == 0 {
            0.0
        } else {
            kib.saturating_sub(base_pss) as f64 / 1024.0 / opened as f64
        }
    };
    let errors_here = errors
        .iter()
        .filter(|e| e.target == name && e.sessions == n)
        .count() as u64;
    ScaleResult {
        sessions: n,
        opened,
        turns_run,
        turns_skipped: skipped,
        errors: errors_here,
        latency: all.percentiles(),
        by_kind: by_kind
            .iter()
            .map(|(k, l)| (k.name().to_string(), l.percentiles()))
            .collect(),
        turns_per_s: turns_run as f64 / turn_phase.as_secs_f64().max(1e-9),
        turn_phase_s: turn_phase.as_secs_f64(),
        cpu_ms_per_turn: if turns_run == 0 {
            0.0
        } else {
            (cpu2 - cpu1) / turns_run as f64
        },
        cpu_ms_per_open: if opened == 0 {
            0.0
        } else {
            (cpu1 - cpu0) / opened as f64
        },
        open_ms: open_lat.percentiles(),
        first_useful_ms: first_useful.percentiles(),
        idle_mib_per_session: per(idle_pss),
        idle_host_mib_per_session: if opened == 0 {
            0.0
        } else {
            avail0.saturating_sub(avail1) as f64 / 1024.0 / opened as f64
        },
        busy_mib_per_session: per(peak_pss.max(idle_pss)),
        peak_processes: peak_procs,
        latency_samples_us: all.samples().to_vec(),
    }
}

/// What one session did.
struct Outcome {
    session: usize,
    turns: Vec<(TurnKind, Duration)>,
    skipped: u64,
    errors: Vec<(TurnKind, String)>,
    first_useful: Option<Duration>,
}

/// Runs a session's schedule: think, turn, check, repeat.
async fn drive(
    session: usize,
    s: Arc<Box<dyn Session>>,
    plan: &Plan,
    sched: mix::Schedule,
    open: Duration,
) -> Outcome {
    let mut o = Outcome {
        session,
        turns: Vec::new(),
        skipped: 0,
        errors: Vec::new(),
        first_useful: None,
    };
    let mut deps: Option<Duration> = None;
    for (idx, (kind, think)) in sched.kinds.iter().zip(&sched.think_ms).enumerate() {
        if *think > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(think / 1000.0)).await;
        }
        if !plan.runs(*kind) {
            o.skipped += 1;
            continue;
        }
        let t = mix::turn(*kind, idx as u32, plan.userland);
        let start = Instant::now();
        let r = tokio::time::timeout(TURN_GUARD, s.run(&t.op)).await;
        let d = start.elapsed();
        o.turns.push((*kind, d));
        let r = r.unwrap_or_else(|_| Err(TargetError::TimedOut("turn")));
        match r {
            Ok(out) if out.contains(&t.expect) => {
                if *kind == TurnKind::Deps {
                    deps.get_or_insert(d);
                } else if o.first_useful.is_none() {
                    if let Some(dep) = deps {
                        o.first_useful = Some(open + dep + d);
                    }
                }
            }
            Ok(out) => o.errors.push((
                *kind,
                format!("output lacks `{}`: {}", t.expect, crate::target::tail(&out)),
            )),
            Err(e) => o.errors.push((*kind, e.to_string())),
        }
    }
    o
}

/// Opens idle sandboxes one at a time until a limit.
async fn density(target: &DynTarget, cfg: &Config, nofile: u64) -> Result<Density, String> {
    let base = metrics::settled_pss_kib(Duration::from_secs(15)).await;
    let avail0 = metrics::meminfo_kib("MemAvailable").unwrap_or(0);
    let kernel0 = metrics::kernel_kib();
    let threads0 = metrics::host_threads();
    let fds0 = metrics::open_fds() as u64;
    // Descriptors when last counted, and how many sandboxes were held then.
    let mut fd_seen = (fds0, 0usize);
    let (_, pids0) = metrics::pids_headroom();
    // The host's task limit and use now, and the tasks each held sandbox has cost so far.
    let tasks = |held: usize| {
        let (pmax, pcur) = metrics::pids_headroom();
        (
            pmax,
            pcur,
            pcur.saturating_sub(pids0) / (held as u64).max(1),
        )
    };
    let start = Instant::now();
    let mut held: Vec<Box<dyn Session>> = Vec::new();
    let mut lat = Latency::new();
    let reserve = cfg.reserve_mib * 1024;
    let limit = loop {
        if held.len() >= cfg.density_cap {
            break format!("safety cap ({} sandboxes, --density-cap)", cfg.density_cap);
        }
        if start.elapsed().as_secs() >= cfg.density_seconds {
            break format!("time budget ({} s, --density-seconds)", cfg.density_seconds);
        }
        let avail = metrics::meminfo_kib("MemAvailable").unwrap_or(0);
        if avail < reserve {
            break format!(
                "memory headroom: MemAvailable {} MiB < reserve {} MiB",
                avail / 1024,
                cfg.reserve_mib
            );
        }
        // Counting descriptors reads `/proc/self/fd`, whose cost grows with them (before,
        // counting at every create was a quarter of the machine's CPU near 5,000 container
        // sandboxes): counted every 64 creates, and at once when the count projected at
        // the rate so far (rounded up) comes near the limit.
        let since = (held.len() - fd_seen.1) as u64;
        let rate = match fd_seen.1 {
            0 => 16,
            at => fd_seen.0.saturating_sub(fds0) / at as u64 + 1,
        };
        if since >= 64 || fd_seen.0 + since * rate + 64 > nofile {
            let fds = metrics::open_fds() as u64;
            fd_seen = (fds, held.len());
            if fds + 64 > nofile {
                break format!("open files: {fds} of RLIMIT_NOFILE {nofile}");
            }
        }
        // Room for the next create at the rate so far, with its transient tasks (a gVisor
        // sandbox keeps ~49 host tasks and briefly needs more while runsc starts it).
        let (pmax, pcur, per) = tasks(held.len());
        if pcur + (3 * per).max(64) > pmax {
            break format!("pids: {pcur} tasks of {pmax} (pids.max, threads-max or pid_max)");
        }
        let t = Instant::now();
        match tokio::time::timeout(TURN_GUARD, target.open_idle()).await {
            Ok(Ok(Some(s))) => {
                lat.record(t.elapsed());
                held.push(s);
            }
            Ok(Ok(None)) => {
                return Err(
                    "not applicable: one process per turn, nothing lives between turns".into(),
                )
            }
            Ok(Err(e)) => {
                // A create that fails with the host's tasks nearly used up failed on them
                // (runsc then only says its sandbox died).
                let (pmax, pcur, per) = tasks(held.len());
                if held.len() > 1 && pcur + 4 * per > pmax {
                    break format!(
                        "pids: {pcur} tasks of {pmax} (pids.max, threads-max or pid_max); the \
                         next create failed: {e}"
                    );
                }
                break format!("error: {e}");
            }
            Err(_) => break "error: create timed out".into(),
        }
    };
    let seconds = start.elapsed().as_secs_f64();
    let pss = tokio::task::spawn_blocking(metrics::tree_pss_kib)
        .await
        .unwrap_or(0);
    let n = held.len();
    let avail_kib = metrics::meminfo_kib("MemAvailable").unwrap_or(0);
    let avail = avail_kib / 1024;
    let per = |grew: u64| if n == 0 { 0.0 } else { grew as f64 / n as f64 };
    let host_mib = per(avail0.saturating_sub(avail_kib)) / 1024.0;
    let kernel_mib = per(metrics::kernel_kib().saturating_sub(kernel0)) / 1024.0;
    let (pmax, pcur) = metrics::pids_headroom();
    let threads = per(metrics::host_threads().saturating_sub(threads0));
    let fds_now = metrics::open_fds() as u64;
    let fds = per(fds_now.saturating_sub(fds0));
    let projected = project(
        n,
        &[
            (
                avail_kib.saturating_sub(reserve) as f64 / 1024.0,
                host_mib,
                "memory (MemAvailable down to the reserve)",
            ),
            (
                nofile.saturating_sub(fds_now) as f64,
                fds,
                "open files (RLIMIT_NOFILE)",
            ),
            (
                pmax.saturating_sub(pcur) as f64,
                threads,
                "threads (pids.max, threads-max or pid_max)",
            ),
        ],
    );
    let sem = Arc::new(Semaphore::new(cfg.open_concurrency.max(1)));
    let mut closes = JoinSet::new();
    for s in held {
        let sem = sem.clone();
        closes.spawn(async move {
            let _p = sem.acquire_owned().await;
            s.close().await
        });
    }
    let mut close_errors = 0;
    while let Some(j) = closes.join_next().await {
        if !matches!(j, Ok(Ok(()))) {
            close_errors += 1;
        }
    }
    Ok(Density {
        close_errors,
        host_mib_per_sandbox: host_mib,
        kernel_mib_per_sandbox: kernel_mib,
        threads_per_sandbox: threads,
        fds_per_sandbox: fds,
        projected,
        held: n,
        limit,
        mib_per_sandbox: if n == 0 {
            0.0
        } else {
            pss.saturating_sub(base) as f64 / 1024.0 / n as f64
        },
        open_ms: lat.percentiles(),
        mem_available_mib: avail,
        seconds,
    })
}

/// The first resource to run out beyond `n` live sandboxes: each entry is (room left, use
/// per sandbox, what); entries that did not grow are ignored.
fn project(n: usize, rows: &[(f64, f64, &str)]) -> Option<(usize, String)> {
    rows.iter()
        .filter(|(_, per, _)| *per > 0.0)
        .map(|(room, per, what)| (n + (room / per).floor() as usize, what.to_string()))
        .min_by_key(|(at, _)| *at)
}

/// Runs the workload on every target, one after the other, and the density test when asked.
/// `progress` gets a line per step. Failures are recorded in `errors`, never hidden.
pub async fn run_all(
    targets: &[DynTarget],
    cfg: &Config,
    progress: &(dyn Fn(&str) + Sync),
    errors: &mut Vec<ErrorRecord>,
) -> Vec<TargetReport> {
    let nofile = metrics::raise_nofile();
    let mut out = Vec::new();
    for t in targets {
        let name = t.name();
        progress(&format!("{name}: planning"));
        let plan = Arc::new(t.plan().await);
        let mut rep = TargetReport {
            name: name.clone(),
            kind: t.kind(),
            describe: t.describe(),
            plan: (*plan).clone(),
            scales: Vec::new(),
            skipped_scales: Vec::new(),
            density: None,
        };
        if let Err(reason) = &plan.available {
            progress(&format!("SKIP {name}: {reason}"));
            out.push(rep);
            continue;
        }
        let mut per_session_mib: Option<f64> = None;
        for &n in &cfg.sessions {
            if let (TargetKind::Reference, Some(max)) = (rep.kind, cfg.reference_max_sessions) {
                if n > max {
                    let why = format!("references run up to N={max} (--reference-max-sessions)");
                    progress(&format!("SKIP {name} N={n}: {why}"));
                    rep.skipped_scales.push((n, why));
                    continue;
                }
            }
            if let Some(max) = cfg.max_sessions.get(&name).filter(|m| n > **m) {
                let why = format!("{name} runs up to N={max} in this run (--max-sessions)");
                progress(&format!("SKIP {name} N={n}: {why}"));
                rep.skipped_scales.push((n, why));
                continue;
            }
            let avail_mib = metrics::meminfo_kib("MemAvailable").unwrap_or(0) / 1024;
            if let Some(m) = per_session_mib {
                let need = m * n as f64;
                if need > avail_mib.saturating_sub(cfg.reserve_mib) as f64 {
                    let why = format!(
                        "would need ~{need:.0} MiB ({m:.1} MiB per session measured at a lower N), {avail_mib} MiB available, {} MiB kept free",
                        cfg.reserve_mib
                    );
                    progress(&format!("SKIP {name} N={n}: {why}"));
                    rep.skipped_scales.push((n, why));
                    continue;
                }
            }
            progress(&format!("{name}: N={n}, {} turns each", cfg.turns));
            let r = run_scale(&name, t, &plan, n, cfg, errors).await;
            progress(&format!(
                "{name}: N={n}: {} turns, {} errors, p50 {:.2} ms, p95 {:.2} ms, {:.1} turns/s, idle {:.1} MiB, busy {:.1} MiB per session",
                r.turns_run, r.errors, r.latency.p50, r.latency.p95, r.turns_per_s, r.idle_mib_per_session, r.busy_mib_per_session
            ));
            if r.opened > 0 {
                per_session_mib = Some(r.busy_mib_per_session.max(r.idle_mib_per_session));
            }
            rep.scales.push(r);
        }
        if cfg.density {
            progress(&format!("{name}: density (cap {})", cfg.density_cap));
            let d = density(t, cfg, nofile).await;
            match &d {
                Ok(d) => progress(&format!(
                    "{name}: density: {} held, limit: {}",
                    d.held, d.limit
                )),
                Err(e) => progress(&format!("{name}: density: {e}")),
            }
            rep.density = Some(d);
        }
        out.push(rep);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::project;

    #[test]
    fn the_projection_names_the_first_resource_to_run_out() {
        // 100 held; 1000 MiB left at 2 MiB each (600), 900 files at 3 each (400), threads
        // did not grow.
        let p = project(
            100,
            &[
                (1000.0, 2.0, "memory"),
                (900.0, 3.0, "files"),
                (50.0, 0.0, "threads"),
            ],
        );
        assert_eq!(p, Some((400, "files".to_string())));
        assert_eq!(project(5, &[(10.0, 0.0, "memory")]), None);
    }
}
