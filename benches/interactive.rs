//! Published ports, background processes and terminals, container and gVisor tiers.
//!
//! `cargo bench -p agent-sandbox --features server,remote --bench interactive` (Linux, root or rootless with user
//! namespaces).
//!
//! A small Python TCP server runs, the same program, in a sandbox of each tier (a background
//! process, its port published on the host's loopback; default `DenyAll` policy) and, as
//! the reference, directly on the host's loopback (no sandbox, no forwarder). Each set:
//! - `connect + 1-byte echo`: a new connection and one round trip (what a client's first
//!   request pays);
//! - `echo round trip`: one byte there and back on an open connection;
//! - `download 32 MiB`: the server sends 32 MiB and closes (throughput).
//!
//! Then `spawn + first output`: `Sandbox::spawn` of `echo ready` until its output arrives;
//! the interpreter rows: a Python cell `x + 1` in an interpreter context against the same
//! code as a plain `exec` (a fresh `python3 -c`), and a context's start; and the keystroke
//! round trip through a terminal: one byte written to a terminal whose `cat` (after `stty
//! raw -echo`) writes it back, read back: ours (`ExecRequest::tty`, through the sandbox's
//! pseudo-terminal and the library), against the same `sh -c 'stty raw -echo; exec cat'`
//! on a pseudo-terminal of the host (no sandbox, `openpty` + a blocking read).
//!
//! The container rows run twice: in-process, and through `agent-sandbox serve` (a server in
//! this process, `RemoteBackend` over loopback TCP): published ports then listen on the
//! server's host (the same one here), output streams as server-sent events and each
//! keystroke is a request.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_sandbox::remote::{RemoteConfig, RemoteServer};
use agent_sandbox::server::{Listener, Server, ServerConfig, Token};
use agent_sandbox::{
    Backend, ExecEvent, ExecRequest, Language, ResolvedSecrets, Runtime, Sandbox, SandboxSpec, Tier,
};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bytes a `download` sends.
const DOWNLOAD: u64 = 32 << 20;

/// The server: `e` echoes until EOF, `d` sends [`DOWNLOAD`] bytes and closes.
const SERVER: &str = r#"
import socket, sys, threading
N = 32 << 20
BUF = b'x' * (1 << 16)
def handle(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mode = c.recv(1)
    if mode == b'e':
        while True:
            d = c.recv(65536)
            if not d:
                break
            c.sendall(d)
    elif mode == b'd':
        left = N
        while left > 0:
            k = min(left, len(BUF))
            c.sendall(BUF[:k])
            left -= k
    c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', int(sys.argv[1])))
s.listen(128)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
"#;

async fn connect(at: SocketAddr) -> TcpStream {
    // A forwarder accepts before the server inside is up: retry until the echo works.
    for _ in 0..200 {
        if let Ok(mut c) = TcpStream::connect(at).await {
            c.set_nodelay(true).unwrap();
            let mut b = [0u8; 1];
            if c.write_all(b"ex").await.is_ok() && c.read_exact(&mut b).await.is_ok() {
                return c;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no echo server at {at}");
}

async fn download(at: SocketAddr) -> u64 {
    let mut c = TcpStream::connect(at).await.unwrap();
    c.write_all(b"d").await.unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        match c.read(&mut buf).await.unwrap() {
            0 => break,
            k => n += k as u64,
        }
    }
    assert_eq!(n, DOWNLOAD, "a whole download");
    n
}

fn pair(c: &mut Criterion, rt: &tokio::runtime::Runtime, name: &str, at: SocketAddr) {
    let mut g = c.benchmark_group("published port");
    g.sample_size(30).measurement_time(Duration::from_secs(5));
    g.bench_function(format!("{name}: connect + 1-byte echo"), |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    drop(connect(at).await);
                }
                t.elapsed()
            })
        })
    });
    let mut conn = rt.block_on(connect(at));
    g.bench_function(format!("{name}: echo round trip"), |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut one = [0u8; 1];
                let t = Instant::now();
                for _ in 0..iters {
                    conn.write_all(b"x").await.unwrap();
                    conn.read_exact(&mut one).await.unwrap();
                }
                t.elapsed()
            })
        })
    });
    drop(conn);
    g.throughput(Throughput::Bytes(DOWNLOAD));
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    g.bench_function(format!("{name}: download 32 MiB"), |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    download(at).await;
                }
                t.elapsed()
            })
        })
    });
    g.finish();
}

fn interactive(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let backends: Vec<(&str, Box<dyn Backend>)> = vec![
        (
            "container",
            Box::new(
                backend_container::ContainerBackend::builder()
                    .build()
                    .unwrap(),
            ),
        ),
        (
            "gvisor",
            Box::new(backend_gvisor::GvisorBackend::builder().build().unwrap()),
        ),
    ];
    for (name, backend) in &backends {
        let status = rt.block_on(backend.probe());
        if !status.available {
            eprintln!(
                "SKIP {name} interactive benches: {} (fix: {})",
                status.reason,
                status.fix.unwrap_or_default()
            );
            continue;
        }
        let sb: Arc<dyn Sandbox> = rt
            .block_on(backend.create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none()))
            .unwrap()
            .into();
        tier_rows(c, &rt, name, sb.as_ref());
        interpreter_rows(c, &rt, name, Arc::clone(&sb));
        rt.block_on(sb.destroy()).unwrap();
        if *name == "container" {
            // The same rows through `agent-sandbox serve` (in this process, loopback TCP):
            // what a remote agent pays on top of the sandbox's own.
            let sb: Arc<dyn Sandbox> = rt.block_on(through_a_server(Tier::Container)).into();
            tier_rows(c, &rt, "container via server", sb.as_ref());
            interpreter_rows(c, &rt, "container via server", Arc::clone(&sb));
            rt.block_on(sb.destroy()).unwrap();
        }
    }

    // The references: the same server on the host's loopback, `cat` on a host terminal.
    let mut host = std::process::Command::new("python3")
        .args(["-c", SERVER, "0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(host.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let direct: SocketAddr = ([127, 0, 0, 1], line.trim().parse::<u16>().unwrap()).into();
    pair(c, &rt, "host loopback (no sandbox)", direct);
    let _ = host.kill();
    let _ = host.wait();

    let mut g = c.benchmark_group("terminal");
    g.sample_size(30);
    let (mut master, mut child) = host_terminal_cat();
    g.bench_function("host pty: keystroke round trip (no sandbox)", |b| {
        b.iter_custom(|iters| {
            use std::io::{Read, Write};
            let mut one = [0u8; 1];
            let t = Instant::now();
            for _ in 0..iters {
                master.write_all(b"k").unwrap();
                master.read_exact(&mut one).unwrap();
            }
            t.elapsed()
        })
    });
    g.finish();
    let _ = child.kill();
    let _ = child.wait();
}

/// A shell sandbox of `tier` made through `RemoteBackend` and a server of this process on
/// loopback TCP (bearer token), as a remote agent makes one.
async fn through_a_server(tier: Tier) -> Box<dyn Sandbox> {
    let runtime = Arc::new(Runtime::builder().with_tiers(&[tier]).build());
    let server = Server::new(runtime, ServerConfig::default());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let token = Token::generate();
    let t = token.clone();
    tokio::spawn(async move {
        server
            .serve(Listener::Tcp(l, t), std::future::pending())
            .await
    });
    let remote = RemoteServer::connect(RemoteConfig::new(&url).unwrap().token(token.reveal()))
        .await
        .unwrap();
    remote
        .backend(tier)
        .unwrap()
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap()
}

/// A tier's rows: its published port, spawn, and keystroke round trip.
fn tier_rows(c: &mut Criterion, rt: &tokio::runtime::Runtime, name: &str, sb: &dyn Sandbox) {
    let server = rt
        .block_on(sb.spawn(ExecRequest::argv(["python3", "-c", SERVER, "9000"])))
        .unwrap();
    let published = rt
        .block_on(sb.publish(9000, ([127, 0, 0, 1], 0).into()))
        .unwrap();
    pair(c, rt, &format!("{name} (published)"), published);

    let mut g = c.benchmark_group("background process");
    g.sample_size(30);
    g.bench_function(format!("{name}: spawn + first output"), |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let mut p = sb
                        .spawn(ExecRequest::argv(["echo", "ready"]))
                        .await
                        .unwrap();
                    match p.next().await {
                        Some(Ok(ExecEvent::Stdout(_))) => {}
                        other => panic!("{other:?}"),
                    }
                    total += t.elapsed();
                    p.wait(None).await.unwrap();
                }
                total
            })
        })
    });
    g.finish();

    let mut g = c.benchmark_group("terminal");
    g.sample_size(30);
    let mut cat = rt
        .block_on(
            sb.spawn(
                ExecRequest::argv(["/bin/sh", "-c", "stty raw -echo; echo ready; exec cat"])
                    .tty(24, 80),
            ),
        )
        .unwrap();
    rt.block_on(async {
        let mut seen = Vec::new();
        while !String::from_utf8_lossy(&seen).contains("ready") {
            match cat.next().await {
                Some(Ok(ExecEvent::Stdout(b))) => seen.extend_from_slice(&b),
                other => panic!("{other:?}"),
            }
        }
    });
    g.bench_function(
        format!("{name}: keystroke round trip (sandbox terminal)"),
        |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let t = Instant::now();
                    for _ in 0..iters {
                        cat.write_stdin(&b"k"[..]).await.unwrap();
                        match cat.next().await {
                            Some(Ok(ExecEvent::Stdout(b))) => assert_eq!(&b[..], b"k"),
                            other => panic!("{other:?}"),
                        }
                    }
                    t.elapsed()
                })
            })
        },
    );
    g.finish();
    drop(cat);
    drop(server);
}

/// A Python cell `x + 1` in an interpreter context (`sandbox_core::interpreter`: one
/// `python3` kept running, its value back as a rich output) against the same code as a
/// plain `exec` (a fresh `python3 -c` each call: the tier's Python before contexts).
fn interpreter_rows(
    c: &mut Criterion,
    rt: &tokio::runtime::Runtime,
    name: &str,
    sb: Arc<dyn Sandbox>,
) {
    use agent_sandbox::core::interpreter::{CellOptions, ContextSpec, Interpreter};
    let mut g = c.benchmark_group("interpreter");
    g.sample_size(30);
    g.bench_function(
        format!("{name}: exec python3 -c 'x = 1; print(x + 1)'"),
        |b| {
            b.iter(|| {
                let r = rt
                    .block_on(sb.exec(ExecRequest::argv(["python3", "-c", "x = 1; print(x + 1)"])))
                    .unwrap();
                assert_eq!(r.stdout_str(), "2\n");
            })
        },
    );
    let mut py = rt
        .block_on(Interpreter::start(Arc::clone(&sb), ContextSpec::python()))
        .unwrap();
    rt.block_on(py.run("x = 1", &CellOptions::new())).unwrap();
    g.bench_function(format!("{name}: interpreter cell x + 1"), |b| {
        b.iter(|| {
            let r = rt.block_on(py.run("x + 1", &CellOptions::new())).unwrap();
            assert_eq!(r.value.as_deref(), Some("2"));
        })
    });
    g.bench_function(
        format!("{name}: interpreter start (python3 + driver ready)"),
        |b| {
            b.iter(|| {
                let p = rt
                    .block_on(Interpreter::start(Arc::clone(&sb), ContextSpec::python()))
                    .unwrap();
                rt.block_on(p.close());
            })
        },
    );
    g.finish();
    rt.block_on(py.close());
}

/// `sh -c 'stty raw -echo; echo ready; exec cat'` on a new pseudo-terminal of the host
/// (its session's controlling terminal); the master, read past `ready`.
fn host_terminal_cat() -> (std::fs::File, std::process::Child) {
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    let (mut m, mut s) = (0, 0);
    // SAFETY: openpty fills two fds we then own.
    let r = unsafe {
        libc::openpty(
            &mut m,
            &mut s,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(r, 0, "openpty");
    // SAFETY: fresh fds from openpty.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", "stty raw -echo; echo ready; exec cat"])
        .stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave);
    // SAFETY: setsid and TIOCSCTTY in the child before exec (async-signal-safe calls).
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            libc::ioctl(0, libc::TIOCSCTTY, 0);
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    let mut master = std::fs::File::from(master);
    let mut seen = Vec::new();
    let mut b = [0u8; 64];
    while !String::from_utf8_lossy(&seen).contains("ready\n") {
        let n = master.read(&mut b).unwrap();
        seen.extend_from_slice(&b[..n]);
    }
    (master, child)
}

criterion_group!(benches, interactive);
criterion_main!(benches);
