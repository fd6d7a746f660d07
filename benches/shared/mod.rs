//! Pieces the side-by-side benches share.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_sandbox::{Backend, ExecRequest, PoolConfig, ResolvedSecrets, SandboxSpec, WarmPool};
use criterion::measurement::WallTime;
use criterion::BenchmarkGroup;

/// A warm pool of 2 sandboxes of `spec` (health checks off: they would be timed), filled;
/// each pooled sandbox runs `warm_up` first, if given (see `PoolConfig::warm_up`).
pub fn ready_pool(
    rt: &tokio::runtime::Runtime,
    backend: Arc<dyn Backend>,
    spec: &SandboxSpec,
    warm_up: Option<ExecRequest>,
) -> WarmPool {
    rt.block_on(async {
        let p = WarmPool::start(backend, spec.clone(), ResolvedSecrets::none(), {
            let mut config = PoolConfig::default()
                .size(2)
                .max_idle(Duration::from_secs(600))
                .health_check(false);
            config.warm_up = warm_up;
            config
        })?;
        p.wait_ready(2, Duration::from_secs(30)).await;
        Ok::<_, agent_sandbox::Error>(p)
    })
    .expect("warm pool")
}

/// Times `checkout` + `cmd` on `pool` (the destroy after it is not timed), waiting before
/// each iteration until `ready` sandboxes are back in the pool: the refill's creation is not
/// what is measured. Prints the pool's stats and shuts it down afterwards.
pub fn bench_checkout_and_first_command(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    rt: &tokio::runtime::Runtime,
    pool: WarmPool,
    ready: usize,
    cmd: ExecRequest,
) {
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    pool.wait_ready(ready, Duration::from_secs(30)).await;
                    let t = Instant::now();
                    let sb = pool.checkout().await.expect("checkout");
                    assert!(sb.exec(cmd.clone()).await.expect("exec").success());
                    total += t.elapsed();
                    sb.destroy().await.expect("destroy");
                }
                total
            })
        })
    });
    eprintln!("pool stats: {:?}", pool.stats());
    rt.block_on(pool.shutdown());
}

/// An OCI bundle `dir/name` running `argv` with the gVisor tier's host-tools view and limits
/// (read-only `/usr` and `/etc` files, tmpfs `/tmp` and `/dev/shm` of the runtime's own,
/// memory, pids and CPU cgroups under `cgroup`), for runtimes driven directly.
pub fn oci_bundle(dir: &Path, name: &str, argv: &[&str], cgroup: &str) -> PathBuf {
    use backend_gvisor::bundle::{self, Identity};
    let b = dir.join(name);
    std::fs::create_dir_all(&b).unwrap();
    let who = Identity::new(1000, 1000);
    let spec = SandboxSpec::new(agent_sandbox::Language::Shell);
    bundle::write_rootfs(&b, who, spec.user_name_and_home()).unwrap();
    let ws = dir.join(format!("{name}-ws"));
    std::fs::create_dir_all(&ws).unwrap();
    let platform = backend_gvisor::RunscInfo::discover(None)
        .map(|i| i.default_platform())
        .unwrap_or(backend_gvisor::Platform::Ptrace);
    let mut cfg = bundle::config(&spec, platform, who, &ws, false, None, cgroup, &[]).unwrap();
    // The tools as mounts of the spec (the tier binds them into the root before runsc runs).
    let mut mounts = bundle::host_tool_mounts().unwrap();
    mounts.extend(cfg.mounts().clone().unwrap_or_default());
    cfg.set_mounts(Some(mounts));
    let mut p = cfg.process().clone().unwrap();
    p.set_args(Some(argv.iter().map(|s| s.to_string()).collect()));
    cfg.set_process(Some(p));
    bundle::save(&cfg, &b).unwrap();
    b
}
