//! Egress proxy overhead: one connection + a small HTTP request/response, and one large
//! download, **direct** (a client in this process's namespace, straight to the loopback
//! server) versus **through the enforcer** (a client inside a sandbox-like network namespace
//! attached by `VethEnforcer`: veth link, nftables, proxy, then the same loopback server).
//!
//! Everything stays on this machine: the server listens on 127.0.0.1, the test resolver maps
//! `bench.test` to it, and the policy allows only that name and `127.0.0.1/32`.
//!
//! `cargo bench -p agent-sandbox --bench egress` (root: it creates network namespaces)

// A benchmark that cannot set itself up should stop loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sandbox_core::{EgressEnforcer, NetworkPolicy};
use sandbox_egress::{StaticResolver, VethEnforcer};

/// Bytes of the large download.
const BIG: usize = 256 << 20;

/// An HTTP/1.1 server on loopback: `/small` answers 2 bytes, `/big` answers [`BIG`] bytes.
fn server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let _ = s.set_nodelay(true);
                let mut buf = [0u8; 4096];
                let mut n = 0;
                while !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf[n..]) {
                        Ok(0) | Err(_) => return,
                        Ok(k) => n += k,
                    }
                }
                let big = buf[..n].windows(4).any(|w| w == b"/big");
                let len = if big { BIG } else { 2 };
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
                );
                if s.write_all(head.as_bytes()).is_err() {
                    return;
                }
                if big {
                    let chunk = vec![7u8; 1 << 20];
                    for _ in 0..(BIG >> 20) {
                        if s.write_all(&chunk).is_err() {
                            return;
                        }
                    }
                } else {
                    let _ = s.write_all(b"ok");
                }
            });
        }
    });
    port
}

/// Sends `req` on a fresh connection to `to` and reads the whole reply; returns its size.
fn fetch(to: SocketAddr, req: &str) -> usize {
    let mut s = TcpStream::connect(to).unwrap();
    s.set_nodelay(true).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0;
    loop {
        match s.read(&mut buf) {
            Ok(0) => return total,
            Ok(n) => total += n,
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// `CONNECT` through the proxy at `proxy`, then `req` inside the tunnel; returns bytes read.
fn fetch_tunnel(proxy: SocketAddr, target: &str, req: &str) -> usize {
    let mut s = TcpStream::connect(proxy).unwrap();
    s.set_nodelay(true).unwrap();
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut b).unwrap(), 1, "proxy closed the tunnel");
        head.push(b[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0;
    loop {
        match s.read(&mut buf) {
            Ok(0) => return total,
            Ok(n) => total += n,
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// A "sandbox": a process in a new network namespace, attached to the enforcer; plus a
/// thread inside that namespace that runs client jobs.
struct Attached {
    child: Child,
    jobs: mpsc::Sender<Box<dyn FnOnce() + Send>>,
    proxy: SocketAddr,
}

impl Attached {
    fn new(rt: &tokio::runtime::Runtime, e: &VethEnforcer, policy: &NetworkPolicy) -> Self {
        let mut cmd = Command::new("sleep");
        cmd.arg("3600").stdin(Stdio::null());
        // SAFETY: only the async-signal-safe unshare runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::unshare(libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        let pid = child.id() as i32;
        let plan = e.prepare("bench", policy).unwrap();
        rt.block_on(e.attach(&plan, pid)).unwrap();
        let proxy = plan
            .env
            .iter()
            .find(|(k, _)| k == "HTTP_PROXY")
            .map(|(_, v)| v.trim_start_matches("http://").parse().unwrap())
            .unwrap();
        let (tx, rx) = mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
        std::thread::spawn(move || {
            // SAFETY: setns on this dedicated thread only; `ns` is an open netns file.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0);
            for job in rx {
                job();
            }
        });
        Attached {
            child,
            jobs: tx,
            proxy,
        }
    }

    /// Runs `f` inside the namespace and waits for its result.
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        self.jobs
            .send(Box::new(move || {
                let _ = tx.send(f());
            }))
            .unwrap();
        rx.recv().unwrap()
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn egress(c: &mut Criterion) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP egress benches: they need root (network namespaces)");
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let loopback: IpAddr = "127.0.0.1".parse().unwrap();
    let e = VethEnforcer::builder()
        .resolver(Arc::new(
            StaticResolver::new().with("bench.test", &[loopback]),
        ))
        .build()
        .unwrap();
    let policy = NetworkPolicy::Allow {
        hosts: vec!["bench.test".parse().unwrap()],
        cidrs: vec!["127.0.0.1/32".parse().unwrap()],
        ports: vec![],
    };
    let sb = Attached::new(&rt, &e, &policy);
    let port = server();
    let direct: SocketAddr = (loopback, port).into();
    let proxy = sb.proxy;
    // Any address outside the link: redirected to the transparent listener.
    let redirected: SocketAddr = ("10.201.0.9".parse::<IpAddr>().unwrap(), port).into();
    let small =
        format!("GET /small HTTP/1.1\r\nHost: bench.test:{port}\r\nConnection: close\r\n\r\n");
    let small_abs = format!(
        "GET http://bench.test:{port}/small HTTP/1.1\r\nHost: bench.test:{port}\r\nConnection: close\r\n\r\n"
    );
    let big = format!("GET /big HTTP/1.1\r\nHost: bench.test:{port}\r\nConnection: close\r\n\r\n");

    let mut g = c.benchmark_group("egress/connection + small GET");
    g.measurement_time(Duration::from_secs(5));
    {
        let req = small.clone();
        g.bench_function("direct (host namespace, loopback)", |b| {
            b.iter(|| fetch(direct, &req))
        });
    }
    for (name, to, req) in [
        ("explicit proxy (HTTP_PROXY)", proxy, small_abs.clone()),
        (
            "transparent (redirected, by Host)",
            redirected,
            small.clone(),
        ),
    ] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let req = req.clone();
                sb.run(move || {
                    let t = Instant::now();
                    for _ in 0..iters {
                        fetch(to, &req);
                    }
                    t.elapsed()
                })
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("egress/download 256 MiB");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(10));
    g.throughput(Throughput::Bytes(BIG as u64));
    {
        let req = big.clone();
        g.bench_function("direct (host namespace, loopback)", |b| {
            b.iter(|| assert!(fetch(direct, &req) > BIG))
        });
    }
    {
        let target = format!("bench.test:{port}");
        g.bench_function("CONNECT tunnel through the proxy", |b| {
            b.iter_custom(|iters| {
                let (req, target) = (big.clone(), target.clone());
                sb.run(move || {
                    let t = Instant::now();
                    for _ in 0..iters {
                        assert!(fetch_tunnel(proxy, &target, &req) > BIG);
                    }
                    t.elapsed()
                })
            })
        });
    }
    g.finish();
    drop(sb);
    rt.block_on(e.detach("bench"));
}

criterion_group!(benches, egress);
criterion_main!(benches);
