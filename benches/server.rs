//! `agent-sandbox serve`: the service hop, and the server under load.
//!
//! `cargo bench -p agent-sandbox-cli --bench server` (Linux, root or rootless with user
//! namespaces).
//!
//! 1. **The hop** (criterion, side by side in one run): the same exec on the same sandbox,
//!    in-process (`Sandbox::exec` of the tier's backend) and through `RemoteBackend` to a
//!    server in this process, over loopback TCP (bearer token) and over a Unix socket. Wasm
//!    (`pass`) and container (`/bin/true`) tiers; gVisor when the host runs it.
//! 2. **Load** (timed once, printed, not criterion): `agent-sandbox serve` as its own
//!    process; `LOAD_SANDBOXES` (200) container sandboxes live at once, created by 8
//!    concurrent clients, then `LOAD_EXECS` (10,000) execs of `/bin/true` from
//!    `LOAD_CLIENTS` (32) concurrent clients spread over them: each request's latency
//!    (p50/p90/p99/max), the rate, errors (must be 0), and the server's RSS before, with
//!    every sandbox live, and after they are destroyed. Set `ASB_BENCH_LOAD=0` to skip it,
//!    or `ASB_BENCH_LOAD=SANDBOXES,EXECS` to size it.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_sandbox::remote::{RemoteConfig, RemoteServer};
use agent_sandbox::server::{Listener, Server, ServerConfig, Token};
use agent_sandbox::{
    Backend, ExecRequest, Language, ResolvedSecrets, Runtime, Sandbox, SandboxSpec, Tier,
};
use criterion::Criterion;

/// A server of `runtime`'s tiers in this process, on loopback TCP and on a Unix socket;
/// returns (tcp address, token, unix address, the socket's directory).
async fn start(runtime: Arc<Runtime>) -> (String, Token, String, tempfile::TempDir) {
    let server = Server::new(runtime, ServerConfig::default());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp = format!("http://{}", l.local_addr().unwrap());
    let token = Token::generate();
    let (s, t) = (server.clone(), token.clone());
    tokio::spawn(async move { s.serve(Listener::Tcp(l, t), std::future::pending()).await });
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let u = tokio::net::UnixListener::bind(&sock).unwrap();
    tokio::spawn(async move {
        server
            .serve(Listener::Unix(u), std::future::pending())
            .await
    });
    (tcp, token, format!("unix:{}", sock.display()), dir)
}

fn hop(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    let runtime = Arc::new(Runtime::new());
    let (tcp, token, unix, _dir) = rt.block_on(start(Arc::clone(&runtime)));
    let remote_tcp = rt.block_on(async {
        RemoteServer::connect(RemoteConfig::new(&tcp).unwrap().token(token.reveal()))
            .await
            .unwrap()
    });
    let remote_unix = rt.block_on(async {
        RemoteServer::connect(RemoteConfig::new(&unix).unwrap())
            .await
            .unwrap()
    });
    let cases: [(Tier, Language, ExecRequest); 3] = [
        (Tier::Wasm, Language::Python, ExecRequest::code("pass")),
        (
            Tier::Container,
            Language::Shell,
            ExecRequest::argv(["/bin/true"]),
        ),
        (
            Tier::Gvisor,
            Language::Shell,
            ExecRequest::argv(["/bin/true"]),
        ),
    ];
    let mut g = c.benchmark_group("service hop");
    g.sample_size(50).measurement_time(Duration::from_secs(5));
    for (tier, lang, req) in cases {
        let Some(local) = runtime.backend(tier).cloned() else {
            continue;
        };
        let status = rt.block_on(local.probe());
        if !status.available {
            eprintln!("service hop: {tier} skipped: {}", status.reason);
            continue;
        }
        let spec = SandboxSpec::new(lang);
        let here = rt
            .block_on(local.create(&spec, ResolvedSecrets::none()))
            .unwrap();
        let over_tcp = rt
            .block_on(
                remote_tcp
                    .backend(tier)
                    .unwrap()
                    .create(&spec, ResolvedSecrets::none()),
            )
            .unwrap();
        let over_unix = rt
            .block_on(
                remote_unix
                    .backend(tier)
                    .unwrap()
                    .create(&spec, ResolvedSecrets::none()),
            )
            .unwrap();
        for (how, sb) in [
            ("in-process", &here),
            ("remote, loopback TCP", &over_tcp),
            ("remote, Unix socket", &over_unix),
        ] {
            let r = req.clone();
            g.bench_function(format!("{tier}: exec, {how}"), |b| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let t = Instant::now();
                        for _ in 0..iters {
                            let out = sb.exec(r.clone()).await.unwrap();
                            assert_eq!(out.exit_code, Some(0));
                        }
                        t.elapsed()
                    })
                })
            });
        }
        for sb in [here, over_tcp, over_unix] {
            rt.block_on(sb.destroy()).unwrap();
        }
    }
    g.finish();
}

/// The server process's resident set, KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn load(rt: &tokio::runtime::Runtime, sandboxes: usize, execs: usize, clients: usize) {
    use std::io::{BufRead, BufReader};
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let token = Token::generate();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, token.reveal()).unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--max-sandboxes",
            "10000",
        ])
        .arg("--token-file")
        .arg(&token_file)
        .arg("--state-dir")
        .arg(dir.path())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let base = loop {
        line.clear();
        assert!(lines.read_line(&mut line).unwrap() > 0, "serve exited");
        if let Some(w) = line.split_whitespace().find(|w| w.starts_with("http://")) {
            break w.to_string();
        }
    };
    std::thread::spawn(move || std::io::copy(&mut lines, &mut std::io::sink()));
    let pid = child.id();
    let rss_start = rss_kib(pid);
    let backend = rt.block_on(async {
        let server = RemoteServer::connect(RemoteConfig::new(&base).unwrap().token(token.reveal()))
            .await
            .unwrap();
        let backend = server.backend(Tier::Container)?;
        backend.probe().await.available.then_some(backend)
    });
    let Some(backend) = backend else {
        eprintln!("load: skipped (the container tier is not available here)");
        let _ = child.kill();
        let _ = child.wait();
        return;
    };
    let backend = Arc::new(backend);
    println!("load: server RSS {rss_start} KiB at start");
    // Three rounds on one server: RSS that keeps growing round after round is a leak; one
    // that settles is the allocator keeping what it had.
    for round in 1..=3 {
        let (create_time, rss_live, exec_time, lat, errors) =
            rt.block_on(one_round(&backend, pid, sandboxes, execs, clients));
        std::thread::sleep(Duration::from_secs(1));
        let rss_end = rss_kib(pid);
        println!(
            "load round {round}: {sandboxes} container sandboxes created in {create_time:.2?} \
             ({:.1}/s, 8 clients); {} execs of /bin/true from {clients} clients in \
             {exec_time:.2?}: {:.0}/s; p50 {:.2?} p90 {:.2?} p99 {:.2?} max {:.2?}; errors \
             {errors}; server RSS {rss_live} KiB with {sandboxes} live, {rss_end} KiB after \
             they were destroyed",
            sandboxes as f64 / create_time.as_secs_f64(),
            lat.len(),
            lat.len() as f64 / exec_time.as_secs_f64(),
            pct(&lat, 0.50),
            pct(&lat, 0.90),
            pct(&lat, 0.99),
            lat.last().copied().unwrap_or_default(),
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// One round: `sandboxes` created by 8 clients, `execs` execs from `clients` clients spread
/// over them, then every sandbox destroyed. (create time, server RSS with all live, exec
/// time, sorted latencies, errors).
async fn one_round(
    backend: &Arc<agent_sandbox::remote::RemoteBackend>,
    pid: u32,
    sandboxes: usize,
    execs: usize,
    clients: usize,
) -> (Duration, u64, Duration, Vec<Duration>, usize) {
    let spec = SandboxSpec::new(Language::Shell);
    let t0 = Instant::now();
    let made = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (b, spec, made, next) = (backend.clone(), spec.clone(), made.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < sandboxes {
                let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
                made.lock().await.push(Arc::<dyn Sandbox>::from(sb));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let create_time = t0.elapsed();
    let all: Arc<Vec<Arc<dyn Sandbox>>> = Arc::new(made.lock().await.clone());
    let rss_live = rss_kib(pid);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t1 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (all, next) = (all.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0usize;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= execs {
                    break;
                }
                let sb = &all[i % all.len()];
                let t = Instant::now();
                match sb.exec(ExecRequest::argv(["/bin/true"])).await {
                    Ok(r) if r.exit_code == Some(0) => lat.push(t.elapsed()),
                    _ => errors += 1,
                }
            }
            (lat, errors)
        }));
    }
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await.unwrap();
        lat.extend(l);
        errors += e;
    }
    let exec_time = t1.elapsed();
    for sb in all.iter() {
        sb.destroy().await.unwrap();
    }
    lat.sort();
    (create_time, rss_live, exec_time, lat, errors)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    match std::env::var("ASB_BENCH_LOAD").as_deref() {
        Ok("0") => {}
        Ok(v) => {
            let mut it = v.split(',').map(|n| n.trim().parse::<usize>().unwrap());
            load(
                &rt,
                it.next().unwrap_or(200),
                it.next().unwrap_or(10_000),
                32,
            );
        }
        Err(_) => load(&rt, 200, 10_000, 32),
    }
    let mut c = Criterion::default().configure_from_args();
    hop(&mut c, &rt);
    c.final_summary();
}
