//! Egress proxy overhead: one connection + a small HTTP request/response, and one large
//! download, **direct** (a client in this process's namespace, over a veth pair to the server's
//! test namespace) versus **through the enforcer** (a client inside a sandbox-like network
//! namespace attached by `VethEnforcer`: its veth link, nftables, the proxy, then the same
//! veth pair to the same server).
//!
//! Everything stays on this machine: the server listens on 10.201.77.2 inside a namespace the
//! bench creates, the test resolver maps `bench.test` to it, and the policy allows only that
//! name and `10.201.77.2/32`.
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

/// An HTTP/1.1 server on `l`: `/small` answers 2 bytes, `/big` answers [`BIG`] bytes.
fn serve(l: TcpListener) {
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
}

/// A process in a new network namespace (the anchor of a test namespace); killed on drop.
struct NsAnchor(Child);

impl NsAnchor {
    fn new() -> Self {
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
        NsAnchor(cmd.spawn().unwrap())
    }

    fn pid(&self) -> i32 {
        self.0.id() as i32
    }

    /// Runs `f` on a new thread inside the namespace (sockets it makes stay there).
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let ns = std::fs::File::open(format!("/proc/{}/ns/net", self.pid())).unwrap();
        std::thread::spawn(move || {
            // SAFETY: setns on this dedicated thread only; `ns` is an open netns file.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0);
            f()
        })
        .join()
        .unwrap()
    }
}

impl Drop for NsAnchor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sh(cmd: &str) {
    let ok = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .status()
        .unwrap()
        .success();
    assert!(ok, "{cmd}");
}

/// The upstream: a test namespace holding the server at 10.201.77.2, linked to this
/// process's namespace (10.201.77.1) by a veth pair. Returns the anchor and the port.
fn upstream() -> (NsAnchor, u16) {
    let ns = NsAnchor::new();
    let pid = ns.pid();
    sh(&format!(
        "ip link add egb-up type veth peer name egb-srv netns {pid} && \
         ip addr add 10.201.77.1/30 dev egb-up && ip link set egb-up up && \
         nsenter --net=/proc/{pid}/ns/net sh -c 'ip addr add 10.201.77.2/30 dev egb-srv && \
         ip link set egb-srv up && ip link set lo up'"
    ));
    let l = ns.run(|| TcpListener::bind("10.201.77.2:0").unwrap());
    let port = l.local_addr().unwrap().port();
    serve(l);
    (ns, port)
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
    _anchor: NsAnchor,
    jobs: mpsc::Sender<Box<dyn FnOnce() + Send>>,
    proxy: SocketAddr,
}

impl Attached {
    fn new(rt: &tokio::runtime::Runtime, e: &VethEnforcer, policy: &NetworkPolicy) -> Self {
        let anchor = NsAnchor::new();
        let plan = e.prepare("bench", policy).unwrap();
        rt.block_on(e.attach(&plan, anchor.pid())).unwrap();
        let proxy = plan
            .env
            .iter()
            .find(|(k, _)| k == "HTTP_PROXY")
            .map(|(_, v)| v.trim_start_matches("http://").parse().unwrap())
            .unwrap();
        // One long-lived client thread inside the namespace runs the measured jobs.
        let (tx, rx) = mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let ns = std::fs::File::open(format!("/proc/{}/ns/net", anchor.pid())).unwrap();
        std::thread::spawn(move || {
            // SAFETY: setns on this dedicated thread only; `ns` is an open netns file.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0);
            for job in rx {
                job();
            }
        });
        Attached {
            _anchor: anchor,
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

fn egress(c: &mut Criterion) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP egress benches: they need root (network namespaces)");
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server_ip: IpAddr = "10.201.77.2".parse().unwrap();
    let (upstream_ns, port) = upstream();
    let e = VethEnforcer::builder()
        .resolver(Arc::new(
            StaticResolver::new().with("bench.test", &[server_ip]),
        ))
        .build()
        .unwrap();
    let policy = NetworkPolicy::Allow {
        hosts: vec!["bench.test".parse().unwrap()],
        cidrs: vec!["10.201.77.2/32".parse().unwrap()],
        ports: vec![],
    };
    let sb = Attached::new(&rt, &e, &policy);
    let direct: SocketAddr = (server_ip, port).into();
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
        g.bench_function("direct (over a veth to the server namespace)", |b| {
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
        g.bench_function("direct (over a veth to the server namespace)", |b| {
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
    drop(upstream_ns);
    let _ = Command::new("ip").args(["link", "del", "egb-up"]).status();
}

criterion_group!(benches, egress);
criterion_main!(benches);
