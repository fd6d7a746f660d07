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
//! 3. **E2B's API vs API v1** (criterion, side by side in one run): `agent-sandbox serve` as
//!    its own process, with an E2B template pinned to each tier; per tier (container, gVisor),
//!    a sandbox's whole life (create, `true`, destroy) and one command's round trip on a
//!    sandbox that exists, through `RemoteBackend` (API v1) and through E2B's official Python
//!    SDK (`Sandbox.create` + `commands.run("true")` + `kill`). The SDK runs in one
//!    long-lived worker (`benches/shared/e2b_worker.py`, one command a line), so the
//!    interpreter's start is not timed: each iteration is the bench's round trip to it. Needs
//!    a Python with `e2b` (2.45.1, as `scripts/test.sh` installs): `AGENT_SANDBOX_TEST_PYTHON`,
//!    else `/var/tmp/agent-sandbox-pyenv/bin/python`; without one it says so and skips. E2B's
//!    commands are `/bin/bash -l -c`, a shell the wasm tier does not run: it is tried once and
//!    what the server answers is printed.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::{Child, Command, Stdio};
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

/// `agent-sandbox serve` as its own process on loopback, its state in `dir`, `token` its
/// bearer token, `extra` more arguments; returns it and its base URL.
fn serve_process(dir: &std::path::Path, token: &Token, extra: &[&str]) -> (Child, String) {
    use std::io::{BufRead, BufReader};
    use std::os::unix::fs::PermissionsExt;
    let token_file = dir.join("token");
    std::fs::write(&token_file, token.reveal()).unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(extra)
        .arg("--token-file")
        .arg(&token_file)
        .arg("--state-dir")
        .arg(dir)
        .stderr(Stdio::piped())
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
    (child, base)
}

fn load(rt: &tokio::runtime::Runtime, sandboxes: usize, execs: usize, clients: usize) {
    let dir = tempfile::tempdir().unwrap();
    let token = Token::generate();
    let (mut child, base) = serve_process(dir.path(), &token, &["--max-sandboxes", "10000"]);
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

/// The Python that runs the E2B worker: `AGENT_SANDBOX_TEST_PYTHON` (the venv
/// `scripts/test.sh` makes), else that venv's usual place; `None`, saying why, when it
/// cannot import the `e2b` SDK.
fn e2b_python() -> Option<String> {
    let py = std::env::var("AGENT_SANDBOX_TEST_PYTHON")
        .unwrap_or_else(|_| "/var/tmp/agent-sandbox-pyenv/bin/python".into());
    match Command::new(&py)
        .args([
            "-c",
            "import e2b, importlib.metadata as m; print(m.version('e2b'))",
        ])
        .output()
    {
        Ok(o) if o.status.success() => {
            let v = String::from_utf8_lossy(&o.stdout).trim().to_string();
            eprintln!("E2B vs v1: the official E2B Python SDK {v}, in {py}");
            Some(py)
        }
        Ok(o) => {
            eprintln!(
                "E2B vs v1: skipped: {py} cannot import the `e2b` SDK (set \
                 AGENT_SANDBOX_TEST_PYTHON to a Python with e2b==2.45.1; scripts/test.sh makes \
                 one): {}",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
            None
        }
        Err(e) => {
            eprintln!(
                "E2B vs v1: skipped: no Python at {py} ({e}; set AGENT_SANDBOX_TEST_PYTHON to \
                 a Python with e2b==2.45.1)"
            );
            None
        }
    }
}

/// `benches/shared/e2b_worker.py`: one Python process with the E2B SDK, pointed at the
/// server, answering one line per command.
struct E2bWorker {
    child: Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl E2bWorker {
    fn start(python: &str, base: &str, token: &Token) -> Self {
        let key = token.reveal();
        assert!(
            key.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "the SDK takes only API keys of lowercase hex"
        );
        // A clean environment, as the E2B test's: no E2B_DOMAIN or E2B_DEBUG of the caller's
        // to redirect the SDK, no proxy between it and the loopback server.
        let mut child = Command::new(python)
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../benches/shared/e2b_worker.py"
            ))
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("E2B_API_URL", base)
            .env("E2B_SANDBOX_URL", base)
            .env("E2B_API_KEY", format!("e2b_{key}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut w = E2bWorker {
            stdin: child.stdin.take().unwrap(),
            stdout: std::io::BufReader::new(child.stdout.take().unwrap()),
            child,
        };
        assert_eq!(w.line(), "ready", "the E2B worker did not start");
        w
    }

    fn line(&mut self) -> String {
        use std::io::BufRead;
        let mut l = String::new();
        assert!(
            self.stdout.read_line(&mut l).unwrap() > 0,
            "the E2B worker exited"
        );
        l.trim_end().to_string()
    }

    /// One command's answer: the words after `ok`, or what failed.
    fn ask(&mut self, cmd: &str) -> Result<Vec<String>, String> {
        use std::io::Write;
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let l = self.line();
        match l.strip_prefix("ok") {
            Some(rest) => Ok(rest.split_whitespace().map(str::to_string).collect()),
            None => Err(l.strip_prefix("err ").unwrap_or(&l).to_string()),
        }
    }

    /// [`ask`](Self::ask), which must succeed; the numbers it answers (microseconds).
    fn must(&mut self, cmd: &str) -> Vec<u64> {
        let words = self
            .ask(cmd)
            .unwrap_or_else(|e| panic!("E2B worker, `{cmd}`: {e}"));
        words.iter().filter_map(|w| w.parse().ok()).collect()
    }
}

impl Drop for E2bWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Prints the median of each phase `what` names over `seen` (one row per iteration).
fn phases(label: &str, what: &[&str], seen: &[Vec<Duration>]) {
    let mut parts = Vec::new();
    for (i, name) in what.iter().enumerate() {
        let mut v: Vec<Duration> = seen.iter().filter_map(|r| r.get(i).copied()).collect();
        if v.is_empty() {
            continue;
        }
        v.sort();
        parts.push(format!("{name} {:.2?}", pct(&v, 0.5)));
    }
    eprintln!(
        "  {label} (medians of {} iterations): {}",
        seen.len(),
        parts.join(", ")
    );
}

fn e2b_vs_v1(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    use criterion::SamplingMode;
    let Some(python) = e2b_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    // The SDK's API key is `e2b_` + the token, lowercase hex: what `Token::generate` makes.
    let token = Token::generate();
    let (server, base) = serve_process(
        dir.path(),
        &token,
        &[
            "--template",
            "container=-,tier=container",
            "--template",
            "gvisor=-,tier=gvisor",
            "--template",
            "wasm=-,tier=wasm",
        ],
    );
    // Stopped however this ends, a panic included: it holds sandboxes.
    let _server = Stop(server);
    let remote = rt.block_on(async {
        RemoteServer::connect(RemoteConfig::new(&base).unwrap().token(token.reveal()))
            .await
            .unwrap()
    });
    let mut worker = E2bWorker::start(&python, &base, &token);
    // The pipe to the worker and back, which every SDK row below includes once.
    let mut pings: Vec<Duration> = (0..200)
        .map(|_| {
            let t = Instant::now();
            worker.must("ping");
            t.elapsed()
        })
        .collect();
    pings.sort();
    eprintln!(
        "E2B vs v1: the round trip to the worker and back (`ping`): median {:.1?}",
        pct(&pings, 0.5)
    );
    let available = |tier: Tier| {
        let backend = remote.backend(tier)?;
        let status = rt.block_on(backend.probe());
        if status.available {
            Some(backend)
        } else {
            eprintln!("E2B vs v1: {tier} skipped: {}", status.reason);
            None
        }
    };
    if available(Tier::Wasm).is_some() {
        match worker.ask("create wasm nointernet") {
            Ok(_) => {
                let run = worker.ask("run");
                worker.must("kill");
                eprintln!("E2B vs v1: wasm: a sandbox was made; commands.run(\"true\"): {run:?}");
            }
            Err(e) => eprintln!(
                "E2B vs v1: wasm skipped: E2B runs every command as `/bin/bash -l -c`, a shell \
                 sandbox, which the wasm tier does not make; Sandbox.create(\"wasm\") answers: {e}"
            ),
        }
    }
    let tiers: Vec<_> = [Tier::Container, Tier::Gvisor]
        .into_iter()
        .filter_map(|t| Some((t, available(t)?)))
        .collect();
    let spec = SandboxSpec::new(Language::Shell);
    let us = Duration::from_micros;

    // A sandbox's whole life: create, the first command, destroy.
    let mut g = c.benchmark_group("E2B vs v1: lifecycle");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for (tier, backend) in &tiers {
        let mut seen = Vec::new();
        g.bench_function(
            format!("{tier}: create + exec true + destroy, API v1"),
            |b| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let t0 = Instant::now();
                            let sb = backend
                                .create(&spec, ResolvedSecrets::none())
                                .await
                                .unwrap();
                            let t1 = Instant::now();
                            let out = sb.exec(ExecRequest::argv(["true"])).await.unwrap();
                            assert_eq!(out.exit_code, Some(0));
                            let t2 = Instant::now();
                            sb.destroy().await.unwrap();
                            let t3 = Instant::now();
                            total += t3 - t0;
                            seen.push(vec![t1 - t0, t2 - t1, t3 - t2]);
                        }
                        total
                    })
                })
            },
        );
        phases("API v1", &["create", "exec", "destroy"], &seen);
        // E2B's default is the internet on (here: a network namespace and the egress
        // proxy); v1's spec above has no network, as `allow_internet_access=False` asks.
        for (internet, how) in [("nointernet", "no network"), ("internet", "internet on")] {
            let mut seen = Vec::new();
            let cmd = format!("lifecycle {tier} {internet}");
            g.bench_function(
                format!("{tier}: create + run true + kill, E2B SDK, {how}"),
                |b| {
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let t = Instant::now();
                            let p = worker.must(&cmd);
                            total += t.elapsed();
                            seen.push(p.into_iter().map(us).collect::<Vec<_>>());
                        }
                        total
                    })
                },
            );
            phases(
                "E2B SDK, inside Python",
                &["Sandbox.create", "commands.run", "kill", "its CPU"],
                &seen,
            );
        }
    }
    g.finish();

    // One command on a sandbox that exists.
    let mut g = c.benchmark_group("E2B vs v1: command round trip");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    // What `commands.run("true")` asks envd for: a login shell running the command.
    let login = ["/bin/bash", "-l", "-c", "true"];
    // What our envd spawns for it: `sh` printing its pid first, then `exec`ing the command
    // (`PID_WRAPPER` in sandbox-server/src/e2b/process.rs).
    let wrapped = [
        "/bin/sh",
        "-c",
        r#"printf '\000E2B-PID %s\n' "$$" >&2; exec "$@""#,
        "envd",
        "/bin/bash",
        "-l",
        "-c",
        "true",
    ];
    let local = Runtime::new();
    for (tier, backend) in &tiers {
        // When a command ends, our envd checks the sandbox's health (was it the sandbox that
        // went?) before it sends the end to the client: what one check costs, in-process.
        if let Some(b) = local.backend(*tier).cloned() {
            let sb = rt
                .block_on(b.create(&spec, ResolvedSecrets::none()))
                .unwrap();
            let mut v: Vec<Duration> = (0..20)
                .map(|_| {
                    let t = Instant::now();
                    rt.block_on(sb.health_check()).unwrap();
                    t.elapsed()
                })
                .collect();
            v.sort();
            eprintln!(
                "E2B vs v1: {tier}: health_check, in-process: median {:.2?} of 20",
                pct(&v, 0.5)
            );
            rt.block_on(sb.destroy()).unwrap();
        }
        let sb = rt
            .block_on(backend.create(&spec, ResolvedSecrets::none()))
            .unwrap();
        let v1: [(&str, ExecRequest, bool); 4] = [
            ("exec `true`", ExecRequest::argv(["true"]), false),
            ("exec `bash -l -c true`", ExecRequest::argv(login), false),
            (
                "spawn `bash -l -c true` + wait",
                ExecRequest::argv(login),
                true,
            ),
            (
                "spawn envd's `sh` + `bash -l -c true` + wait",
                ExecRequest::argv(wrapped),
                true,
            ),
        ];
        for (what, req, spawn) in v1 {
            g.bench_function(format!("{tier}: {what}, API v1"), |b| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let t = Instant::now();
                        for _ in 0..iters {
                            let out = if spawn {
                                let mut p = sb.spawn(req.clone()).await.unwrap();
                                p.wait(None).await.unwrap()
                            } else {
                                sb.exec(req.clone()).await.unwrap()
                            };
                            assert_eq!(out.exit_code, Some(0));
                        }
                        t.elapsed()
                    })
                })
            });
        }
        rt.block_on(sb.destroy()).unwrap();
        worker.must(&format!("create {tier} nointernet"));
        let mut seen = Vec::new();
        g.bench_function(format!("{tier}: commands.run(\"true\"), E2B SDK"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let p = worker.must("run");
                    total += t.elapsed();
                    seen.push(p.into_iter().map(us).collect::<Vec<_>>());
                }
                total
            })
        });
        phases(
            "E2B SDK, inside Python",
            &["commands.run", "its CPU"],
            &seen,
        );
        worker.must("kill");
    }
    g.finish();
}

/// `serve`, stopped when this goes: SIGTERM, on which it destroys the sandboxes it still
/// holds; killed if it has not exited 30 s later.
struct Stop(Child);

impl Drop for Stop {
    fn drop(&mut self) {
        // SAFETY: kill(2) of our own child, not yet reaped.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        for _ in 0..300 {
            if !matches!(self.0.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
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
    e2b_vs_v1(&mut c, &rt);
    c.final_summary();
}
