//! Container tier, side by side with bubblewrap, crun and runc, same commands, one run.
//!
//! `cargo bench -p agent-sandbox --bench container` (Linux; root for crun/runc). Each
//! iteration starts real sandboxes, so sample counts are small; see docs/benchmarks.md.
//!
//! For each command (`/bin/true`, `/usr/bin/python3 -c pass`):
//! - `ours: create + first command`: `Backend::create` then `exec` (destroy not timed);
//! - `bwrap`: `bwrap --ro-bind / / --unshare-all --die-with-parent CMD`;
//! - `crun run` / `runc run`: an OCI bundle with the same host-tools view and limits (the
//!   gVisor tier's bundle writer: read-only `/usr` and `/etc` files, tmpfs `/tmp`, memory,
//!   pids and CPU cgroups, pid/net/ipc/uts/mount namespaces, no capabilities). crun refuses
//!   this hybrid cgroup host ("cgroups in hybrid mode not supported") unless the cgroup2
//!   mount `/sys/fs/cgroup/unified` is hidden: the runtimes run from a thread that has its own
//!   mount namespace with that mount detached (never the host's);
//! - `ours: exec`: into a running sandbox;
//! - `ours: pool checkout + first command`: a `WarmPool` checkout then `exec`; again with a
//!   warm-up (`PoolConfig::warm_up`) of the same program, and of another (`sh -c :`);
//! - `host: posix_spawn + wait`: no sandbox, the host running `/bin/true` itself, back to
//!   back and after a 12 ms pause (what a pause costs a plain process start on this machine).
//!
//! Then the idle sandbox's memory: the init's RSS and PSS.

// A benchmark that cannot set itself up should stop loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "shared/mod.rs"]
mod shared;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_sandbox::{Backend, ExecRequest, Language, ResolvedSecrets, Sandbox, SandboxSpec};
use backend_container::ContainerBackend;
use criterion::{criterion_group, Criterion};

const COMMANDS: &[(&str, &[&str])] = &[
    ("/bin/true", &["/bin/true"]),
    ("python3 -c pass", &["/usr/bin/python3", "-c", "pass"]),
];

/// Set (to the runtime's path) when this binary runs as the OCI runtime driver.
const RUNNER_ENV: &str = "ASB_BENCH_OCI_RUNNER";

/// Runs `runtime run` of `bundle` `iters` times and returns the total time. The runs happen
/// in a child of this binary (see [`runner`]) started by `unshare -m` (a private mount
/// namespace) after the cgroup2 mount of this hybrid host is unmounted there: crun refuses
/// hybrid hosts otherwise. The host's mounts are untouched; the set-up is not timed.
fn timed_runs(
    runtime: &Path,
    state: &Path,
    bundle: &Path,
    tag: &str,
    iters: u64,
) -> Option<Duration> {
    let me = std::env::current_exe().unwrap();
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg("umount /sys/fs/cgroup/unified 2>/dev/null; exec \"$0\" \"$@\"")
        .arg(me)
        .arg(state)
        .arg(bundle)
        .arg(tag)
        .arg(iters.to_string())
        .env(RUNNER_ENV, runtime)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let nanos: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    out.status.success().then(|| Duration::from_nanos(nanos))
}

/// The driver side of [`timed_runs`]: `<state> <bundle> <tag> <iters>`; prints the total
/// nanoseconds of the runs, fails if one fails.
fn runner(runtime: &str) {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let iters: u64 = a[3].parse().unwrap();
    let mut total = Duration::ZERO;
    for i in 0..iters {
        let t = Instant::now();
        let ok = quiet(
            Command::new(runtime)
                .arg("--root")
                .arg(&a[0])
                .args(["run", "--bundle"])
                .arg(&a[1])
                .arg(format!("{}-{i}", a[2])),
        );
        total += t.elapsed();
        if !ok {
            std::process::exit(1);
        }
    }
    println!("{}", total.as_nanos());
}

fn installed(bin: &str) -> Option<PathBuf> {
    ["/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin"]
        .iter()
        .map(|d| Path::new(d).join(bin))
        .find(|p| p.exists())
}

fn quiet(c: &mut Command) -> bool {
    c.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn pss_rss_kib(pid: i32) -> (u64, u64) {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name: &str| {
        rollup
            .lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0)
    };
    (field("Rss:"), field("Pss:"))
}

fn container(c: &mut Criterion) {
    let backend = ContainerBackend::builder().build().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let status = rt.block_on(backend.probe());
    if !status.available {
        eprintln!(
            "SKIP container benches: {} (fix: {})",
            status.reason,
            status.fix.unwrap_or_default()
        );
        return;
    }
    let root = nix_is_root();
    let tmp = tempfile::tempdir().unwrap();
    let spec = SandboxSpec::new(Language::Shell);
    let bwrap = installed("bwrap");
    let crun = installed("crun");
    let runc = installed("runc");
    for (name, bin) in [("bwrap", &bwrap), ("crun", &crun), ("runc", &runc)] {
        if bin.is_none() {
            eprintln!("SKIP {name}: not installed (apt-get install {name})");
        }
    }
    if !root && (crun.is_some() || runc.is_some()) {
        eprintln!("SKIP crun/runc: the bundles need root (cgroups, no user namespace)");
    }

    let mut g = c.benchmark_group("container");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_millis(500));

    for (label, argv) in COMMANDS {
        let req = || ExecRequest::argv(argv.iter().copied());
        g.bench_function(format!("ours: create + first command ({label})"), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let t = Instant::now();
                        let sb = backend
                            .create(&spec, ResolvedSecrets::none())
                            .await
                            .unwrap();
                        assert!(sb.exec(req()).await.unwrap().success());
                        total += t.elapsed();
                        sb.destroy().await.unwrap();
                    }
                    total
                })
            })
        });

        if let Some(bwrap) = &bwrap {
            g.bench_function(
                format!("bwrap --ro-bind / / --unshare-all --die-with-parent ({label})"),
                |b| {
                    b.iter(|| {
                        assert!(quiet(
                            Command::new(bwrap)
                                .args(["--ro-bind", "/", "/", "--unshare-all", "--die-with-parent"])
                                .args(*argv)
                        ))
                    })
                },
            );
        }

        for (rt_name, bin) in [("crun", &crun), ("runc", &runc)] {
            let Some(bin) = bin.as_ref().filter(|_| root) else {
                continue;
            };
            let name = format!("{rt_name}-{}", label.len());
            let bundle = shared::oci_bundle(tmp.path(), &name, argv, &format!("asb-bench-{name}"));
            let state = tmp.path().join(format!("{rt_name}-state"));
            std::fs::create_dir_all(&state).unwrap();
            // One try first: a runtime that cannot run here is skipped, not fatal.
            let probe = format!("asb-bench-{rt_name}-probe");
            if timed_runs(bin, &state, &bundle, &probe, 1).is_none() {
                eprintln!("SKIP {rt_name} ({label}): `{rt_name} run` of the bundle failed");
                continue;
            }
            let mut n = 0u64;
            g.bench_function(
                format!("{rt_name} run (same view and limits, {label})"),
                |b| {
                    b.iter_custom(|iters| {
                        n += 1;
                        let tag = format!("asb-bench-{rt_name}-{n}");
                        timed_runs(bin, &state, &bundle, &tag, iters)
                            .unwrap_or_else(|| panic!("{rt_name} run failed"))
                    })
                },
            );
        }
    }

    let live = rt
        .block_on(backend.create(&spec, ResolvedSecrets::none()))
        .unwrap();
    for (label, argv) in COMMANDS {
        g.bench_function(format!("ours: exec ({label})"), |b| {
            b.iter(|| {
                rt.block_on(async {
                    let r = live
                        .exec(ExecRequest::argv(argv.iter().copied()))
                        .await
                        .unwrap();
                    assert!(r.success());
                })
            })
        });
    }

    let pool = shared::ready_pool(&rt, Arc::new(backend.clone()), &spec, None);
    shared::bench_checkout_and_first_command(
        &mut g,
        "ours: pool checkout + first command (/bin/true)",
        &rt,
        pool,
        2,
        ExecRequest::argv(["/bin/true"]),
    );
    // The same with a warm-up (`PoolConfig::warm_up`): each pooled sandbox ran a no-op once,
    // so the supervisor that serves the first command has run before.
    let warm = ExecRequest::argv(["/bin/true"]);
    let pool = shared::ready_pool(&rt, Arc::new(backend.clone()), &spec, Some(warm));
    shared::bench_checkout_and_first_command(
        &mut g,
        "ours: pool (warm-up: /bin/true) checkout + first command (/bin/true)",
        &rt,
        pool,
        2,
        ExecRequest::argv(["/bin/true"]),
    );
    // A warm-up with another program than the one timed (the shell's no-op), so that what
    // it warms is the sandbox's exec path, not the timed binary.
    let warm = ExecRequest::argv(["/bin/sh", "-c", ":"]);
    let pool = shared::ready_pool(&rt, Arc::new(backend.clone()), &spec, Some(warm));
    shared::bench_checkout_and_first_command(
        &mut g,
        "ours: pool (warm-up: sh -c :) checkout + first command (/bin/true)",
        &rt,
        pool,
        2,
        ExecRequest::argv(["/bin/true"]),
    );
    // The command's own cost, without any sandbox: the host starting `/bin/true` with
    // `posix_spawn` (the leanest start it has; glibc's vfork-style clone) and waiting for it,
    // back to back and after a pause like the one before each pool iteration (the refill's
    // delay and creation). What a pause costs the host itself is the part of the pool rows
    // that no sandbox design removes.
    g.bench_function("host: posix_spawn + wait (/bin/true), back to back", |b| {
        b.iter(host_true)
    });
    g.bench_function(
        "host: posix_spawn + wait (/bin/true) after a 12 ms pause",
        |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    std::thread::sleep(HOST_PAUSE);
                    let t = Instant::now();
                    host_true();
                    total += t.elapsed();
                }
                total
            })
        },
    );
    g.finish();

    // Idle footprint: the init (pid 1 of the sandbox) and its spare supervisor after a
    // command ran. PSS counts the pages they share with each other and the zygote once.
    let idle = rt.block_on(backend.create_container(&spec)).unwrap();
    rt.block_on(idle.exec(ExecRequest::argv(["/bin/true"])))
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let (rss, pss) = pss_rss_kib(idle.init_pid());
    eprintln!("idle sandbox init: RSS {rss} KiB, PSS {pss} KiB");
    let children =
        std::fs::read_to_string(format!("/proc/{p}/task/{p}/children", p = idle.init_pid()))
            .unwrap_or_default();
    for child in children.split_whitespace() {
        let (rss, pss) = pss_rss_kib(child.parse().unwrap());
        eprintln!("  its spare supervisor (pid {child}): RSS {rss} KiB, PSS {pss} KiB");
    }
    rt.block_on(async {
        idle.destroy().await.unwrap();
        live.destroy().await.unwrap();
    });
}

/// Runs `/bin/true` on the host (no sandbox) with `posix_spawn` and an empty environment,
/// and waits for it.
fn host_true() {
    let path = c"/bin/true";
    let argv = [path.as_ptr().cast_mut(), std::ptr::null_mut()];
    let envp = [std::ptr::null_mut()];
    let mut pid: libc::pid_t = 0;
    // SAFETY: NUL-terminated argv/envp arrays of NUL-terminated strings that outlive the
    // call; no file actions or attributes.
    let rc = unsafe {
        libc::posix_spawn(
            &mut pid,
            path.as_ptr(),
            std::ptr::null(),
            std::ptr::null(),
            argv.as_ptr(),
            envp.as_ptr(),
        )
    };
    assert_eq!(rc, 0, "posix_spawn /bin/true");
    let mut status = 0;
    // SAFETY: waits for our own child with a valid status pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert_eq!(status, 0, "/bin/true failed");
}

/// The pause before each `host: ... after a pause` iteration: about what separates two pool
/// iterations (the refill waits 10 ms after a checkout, then creates the replacement).
const HOST_PAUSE: Duration = Duration::from_millis(12);

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        .unwrap_or(false)
}

criterion_group!(benches, container);

fn main() {
    if let Ok(runtime) = std::env::var(RUNNER_ENV) {
        runner(&runtime);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
