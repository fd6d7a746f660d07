//! Host measurements: CPU and memory (PSS) of this process and every process descending from
//! it, host headroom, and latency histograms.
//!
//! **Process tree.** Our tiers' sandboxes are this process's threads (wasm) or descendants
//! (the container tier's inits and their commands; gVisor's `runsc` sandbox and gofer, which
//! the gVisor backend adopts as a child subreaper while it starts them). The reference
//! engines' processes are our children too. So "the tree" (this process plus every process
//! whose parent chain reaches it, from `/proc/*/stat`) holds ours and the engines' processes
//! together and nothing of the other tenants of a shared machine, which a whole-host figure
//! would include.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

/// CPU time of the process tree, in clock ticks converted to milliseconds: this process's
/// user + system time, its reaped children's (`cutime` + `cstime`, which include everything
/// they reaped), and every live descendant's own user + system + reaped-children time.
/// A process that left the tree (re-parented to pid 1) before exiting is not counted.
pub fn tree_cpu_ms() -> f64 {
    let me = std::process::id() as i32;
    let procs = processes();
    let tick = ticks_per_second();
    let mut total = 0u64;
    for p in descendants(me, &procs) {
        if let Some(s) = procs.get(&p) {
            total += s.utime + s.stime + s.cutime + s.cstime;
        }
    }
    total as f64 * 1000.0 / tick
}

/// Proportional set size of the process tree, KiB (from each `/proc/PID/smaps_rollup`).
pub fn tree_pss_kib() -> u64 {
    let me = std::process::id() as i32;
    let procs = processes();
    descendants(me, &procs).into_iter().map(pss_kib).sum()
}

/// Waits (at most `max`) until the tree's PSS stops falling: memory that the previous phase
/// freed is handed back lazily (background janitors, the allocator), and a baseline taken
/// before that would make the next phase's growth look smaller. Returns the settled PSS.
pub async fn settled_pss_kib(max: std::time::Duration) -> u64 {
    let start = std::time::Instant::now();
    let mut last = u64::MAX;
    loop {
        trim_allocator();
        let now = tokio::task::spawn_blocking(tree_pss_kib).await.unwrap_or(0);
        // Settled: changed by less than 2 MiB in half a second.
        if last.abs_diff(now) < 2048 || start.elapsed() >= max {
            return now;
        }
        last = now;
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Hands this process's free heap back to the kernel (glibc), so PSS counts live memory.
fn trim_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator; no pointer is touched.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Number of processes in the tree (this one included).
pub fn tree_processes() -> usize {
    let me = std::process::id() as i32;
    descendants(me, &processes()).len()
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions; it only reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

#[derive(Debug, Clone, Copy)]
struct Stat {
    ppid: i32,
    utime: u64,
    stime: u64,
    cutime: u64,
    cstime: u64,
}

fn processes() -> HashMap<i32, Stat> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if let Some(s) = stat(pid) {
            out.insert(pid, s);
        }
    }
    out
}

fn stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state): ppid is field 4, utime..cstime fields 14..17.
    let n = |i: usize| f.get(i - 3).and_then(|v| v.parse::<u64>().ok());
    Some(Stat {
        ppid: f.get(1)?.parse().ok()?,
        utime: n(14)?,
        stime: n(15)?,
        cutime: n(16)?,
        cstime: n(17)?,
    })
}

fn descendants(root: i32, procs: &HashMap<i32, Stat>) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for (pid, s) in procs {
        children.entry(s.ppid).or_default().push(*pid);
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        if let Some(c) = children.get(&out[i]) {
            out.extend(c.iter().copied());
        }
        i += 1;
    }
    out
}

fn pss_kib(pid: i32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    text.lines()
        .find_map(|l| {
            l.strip_prefix("Pss:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// A field of `/proc/meminfo`, KiB.
pub fn meminfo_kib(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find_map(|l| {
        let v = l.strip_prefix(field)?.strip_prefix(':')?;
        v.trim().strip_suffix("kB")?.trim().parse().ok()
    })
}

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// The soft `RLIMIT_NOFILE`, after raising it as `agent-sandbox serve` does (see
/// [`sandbox_core::host_limits::raise_open_files_limit`]); 1024 when it cannot be read.
pub fn raise_nofile() -> u64 {
    sandbox_core::host_limits::raise_open_files_limit().unwrap_or(1024)
}

/// The pids limit that applies to this process: its v1 `pids` cgroup's `pids.max` (if a
/// number), the kernel's `threads-max` and `pid_max`, whichever is lowest; with the current
/// count.
pub fn pids_headroom() -> (u64, u64) {
    // Every thread takes an id below `pid_max` too (32,768 by default: often the lower).
    let sysctl = |name: &str| {
        std::fs::read_to_string(format!("/proc/sys/kernel/{name}"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(u64::MAX)
    };
    // Past the first wrap the kernel hands out ids from 300 on (`RESERVED_PIDS`): about 300
    // fewer tasks fit than `pid_max` says.
    let kernel = sysctl("threads-max").min(sysctl("pid_max").saturating_sub(300));
    let cg = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.split_once(":pids:").map(|(_, p)| p.to_string()))
        })
        .and_then(|p| {
            let dir = format!("/sys/fs/cgroup/pids{p}");
            let max = std::fs::read_to_string(format!("{dir}/pids.max")).ok()?;
            let cur = std::fs::read_to_string(format!("{dir}/pids.current")).ok()?;
            Some((
                max.trim().parse::<u64>().ok()?,
                cur.trim().parse::<u64>().ok()?,
            ))
        });
    let threads = host_threads();
    match cg {
        Some((max, cur)) if max < kernel => (max, cur),
        _ => (kernel, threads),
    }
}

/// Kernel memory the host holds for everything, KiB: slab (reclaimable or not), kernel
/// stacks, page tables and per-CPU allocations, from `/proc/meminfo`. Its growth per
/// sandbox is the kernel's share that PSS never shows (namespaces, mounts, cgroups,
/// sockets, the stacks of every thread).
pub fn kernel_kib() -> u64 {
    ["Slab", "KernelStack", "PageTables", "Percpu"]
        .iter()
        .filter_map(|f| meminfo_kib(f))
        .sum()
}

/// Threads on the host (every task the scheduler knows), from `/proc/loadavg`.
pub fn host_threads() -> u64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(3)?
                .split_once('/')
                .and_then(|(_, t)| t.parse::<u64>().ok())
        })
        .unwrap_or(0)
}

/// The load averages, from `/proc/loadavg`.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Latency percentiles, milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

/// Latency samples in microseconds; percentiles are exact (nearest rank over the sorted
/// samples: a run holds at most some tens of thousands of turns).
#[derive(Debug, Clone, Default)]
pub struct Latency(Vec<u64>);

impl Latency {
    /// An empty set.
    pub fn new() -> Self {
        Latency(Vec::new())
    }

    /// Records one sample.
    pub fn record(&mut self, d: std::time::Duration) {
        self.0
            .push(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    /// Adds another set's samples.
    pub fn merge(&mut self, other: &Latency) {
        self.0.extend_from_slice(&other.0);
    }

    /// Samples recorded.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn sorted(&self) -> Vec<u64> {
        let mut v = self.0.clone();
        v.sort_unstable();
        v
    }

    /// The percentiles, ms.
    pub fn percentiles(&self) -> Percentiles {
        let v = self.sorted();
        if v.is_empty() {
            return Percentiles::default();
        }
        let ms = |q: f64| {
            let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
            v[rank - 1] as f64 / 1000.0
        };
        Percentiles {
            count: v.len() as u64,
            p50: ms(0.50),
            p95: ms(0.95),
            p99: ms(0.99),
            max: v[v.len() - 1] as f64 / 1000.0,
            mean: v.iter().sum::<u64>() as f64 / v.len() as f64 / 1000.0,
        }
    }

    /// The CDF as `(latency ms, fraction at or below)` points, one per sample.
    pub fn cdf(&self) -> Vec<(f64, f64)> {
        let v = self.sorted();
        let n = v.len() as f64;
        v.iter()
            .enumerate()
            .map(|(i, us)| (*us as f64 / 1000.0, (i + 1) as f64 / n))
            .collect()
    }

    /// The raw samples, µs.
    pub fn samples(&self) -> &[u64] {
        &self.0
    }
}

/// Latency histograms by a key (turn kind name), merged into one overall.
pub type ByKind = BTreeMap<String, Latency>;
