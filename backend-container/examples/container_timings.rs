//! Rough timings of the container backend on this host (not a benchmark: see benches/).
//! `cargo run --release -p backend-container --example container_timings`
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Instant;

use backend_container::ContainerBackend;
use sandbox_core::{Backend, ExecRequest, Language, Phase, ResolvedSecrets, SandboxSpec};

fn median(mut v: Vec<u128>) -> u128 {
    v.sort_unstable();
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let flag = |k: &str| std::env::var(k).map_or(true, |v| v != "0");
    let b = ContainerBackend::builder()
        .seccomp(flag("ASB_SECCOMP"))
        .landlock(flag("ASB_LANDLOCK"))
        .build()
        .unwrap();
    let spec = SandboxSpec::new(Language::Shell);
    let n = 100;
    let (mut total, mut phases) = (Vec::new(), vec![Vec::new(); 5]);
    let mut bwrap = Vec::new();
    let has_bwrap = std::path::Path::new("/usr/bin/bwrap").exists();
    // Each timed run starts after the same pause, so neither side's background work (the
    // kernel freeing the previous run's network namespace, our next spare init being cloned)
    // lands in the other's time.
    let pause = || std::thread::sleep(std::time::Duration::from_millis(5));
    for _ in 0..n {
        if has_bwrap {
            // Side by side: the same command under bubblewrap, interleaved.
            pause();
            let t0 = Instant::now();
            let st = std::process::Command::new("bwrap")
                .args([
                    "--ro-bind",
                    "/",
                    "/",
                    "--unshare-all",
                    "--die-with-parent",
                    "/bin/true",
                ])
                .status()
                .unwrap();
            assert!(st.success());
            bwrap.push(t0.elapsed().as_micros());
        }
        pause();
        let t0 = Instant::now();
        let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
        let r = sb.exec(ExecRequest::argv(["/bin/true"])).await.unwrap();
        assert!(r.success());
        total.push(t0.elapsed().as_micros());
        for (i, p) in [Phase::Allocation, Phase::Filesystem, Phase::Runtime]
            .iter()
            .enumerate()
        {
            phases[i].push(sb.timeline().get(*p).map_or(0, |d| d.as_micros()));
        }
        let t1 = Instant::now();
        sb.destroy().await.unwrap();
        phases[3].push(t1.elapsed().as_micros());
    }
    println!("create + first /bin/true: median {} us", median(total));
    if has_bwrap {
        println!(
            "bwrap --ro-bind / / --unshare-all /bin/true: median {} us",
            median(bwrap)
        );
    }
    println!(
        "  allocation {} us, filesystem {} us, runtime {} us; destroy {} us",
        median(phases[0].clone()),
        median(phases[1].clone()),
        median(phases[2].clone()),
        median(phases[3].clone())
    );
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    for (name, req) in [
        ("/bin/true", ExecRequest::argv(["/bin/true"])),
        (
            "python3 -c pass",
            ExecRequest::argv(["/usr/bin/python3", "-c", "pass"]),
        ),
    ] {
        let (mut v, mut a, mut c) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..n {
            let t0 = Instant::now();
            let r = sb.exec(req.clone()).await.unwrap();
            assert!(r.success());
            v.push(t0.elapsed().as_micros());
            a.push(
                r.timeline
                    .get(Phase::Allocation)
                    .map_or(0, |d| d.as_micros()),
            );
            c.push(r.timeline.get(Phase::Command).map_or(0, |d| d.as_micros()));
        }
        println!(
            "exec {name}: median {} us (until started {} us, then {} us)",
            median(v),
            median(a),
            median(c)
        );
    }
    let mut v = Vec::new();
    for _ in 0..n {
        let t0 = Instant::now();
        assert!(std::process::Command::new("/bin/true")
            .status()
            .unwrap()
            .success());
        v.push(t0.elapsed().as_micros());
    }
    println!(
        "baseline: host fork+exec /bin/true (no sandbox): median {} us",
        median(v)
    );
    // What a warm pool's checkout meets: the first command of a fresh sandbox, right after
    // its create and after 12 ms of idleness, against a host spawn after the same pause.
    let spawn_true = || {
        let t0 = Instant::now();
        assert!(std::process::Command::new("/bin/true")
            .status()
            .unwrap()
            .success());
        t0.elapsed().as_micros()
    };
    for idle in [0u64, 12] {
        let pause = || std::thread::sleep(std::time::Duration::from_millis(idle));
        let (mut first, mut host) = (Vec::new(), Vec::new());
        for _ in 0..n / 2 {
            let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
            pause();
            let t0 = Instant::now();
            assert!(sb
                .exec(ExecRequest::argv(["/bin/true"]))
                .await
                .unwrap()
                .success());
            first.push(t0.elapsed().as_micros());
            sb.destroy().await.unwrap();
            pause();
            host.push(spawn_true());
        }
        println!(
            "first /bin/true in a fresh sandbox after {idle} ms idle: median {} us \
             (host spawn after the same pause: {} us)",
            median(first),
            median(host)
        );
    }
    let pid = b.create_container(&spec).await.unwrap();
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid.init_pid())).unwrap();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS"))
        .unwrap_or("");
    let pss = std::fs::read_to_string(format!("/proc/{}/smaps_rollup", pid.init_pid()))
        .unwrap_or_default();
    let pss = pss.lines().find(|l| l.starts_with("Pss:")).unwrap_or("");
    println!("idle init: {rss}; {pss}");
}
