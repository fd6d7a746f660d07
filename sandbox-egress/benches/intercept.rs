//! What TLS interception for proxy-held secrets costs, side by side in one run: the same
//! HTTPS request through the proxy to the same loopback server, spliced (no secret bound to
//! the host: the sandbox's TLS goes end to end) and intercepted (a secret bound: the proxy
//! terminates TLS, substitutes, re-encrypts and masks the response).
//!
//! `cargo bench -p sandbox-egress --bench intercept`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rustls::pki_types::{CertificateDer, ServerName};
use sandbox_core::{NetworkPolicy, Secret};
use sandbox_egress::secrets::{ProxySecret, SecretSet};
use sandbox_egress::testing::TestCa;
use sandbox_egress::{EgressProxy, ProxyConfig, StaticResolver};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const VALUE: &str = "sk-live-REALVALUE-0123456789abcdef";
const BIG: u64 = 256 << 20;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A test CA, and an HTTPS server for `api.test` behind it: `GET /small` answers 2 bytes,
/// `GET /big` 256 MiB; one request per connection.
async fn server() -> (u16, CertificateDer<'static>) {
    let ca = TestCa::new("bench upstream CA").unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(ca.server_config(&["api.test"]).unwrap());
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        let block = vec![b'x'; 1 << 20];
        let block = Arc::new(block);
        loop {
            let (s, _) = l.accept().await.unwrap();
            let (acceptor, block) = (acceptor.clone(), block.clone());
            tokio::spawn(async move {
                let Ok(mut t) = acceptor.accept(s).await else {
                    return;
                };
                let mut buf = Vec::new();
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    let mut c = [0u8; 4096];
                    match t.read(&mut c).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&c[..n]),
                    }
                }
                let big = buf.starts_with(b"GET /big");
                let len = if big { BIG } else { 2 };
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
                );
                if t.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                if big {
                    for _ in 0..(BIG >> 20) {
                        if t.write_all(&block).await.is_err() {
                            return;
                        }
                    }
                } else if t.write_all(b"ok").await.is_err() {
                    return;
                }
                let _ = t.shutdown().await;
            });
        }
    });
    (port, ca.der())
}

struct Setup {
    spliced: SocketAddr,
    intercepted: SocketAddr,
    placeholder: String,
    client: tokio_rustls::TlsConnector,
    port: u16,
}

async fn setup() -> Setup {
    let (port, upstream_ca) = server().await;
    let proxy = EgressProxy::builder()
        .config(ProxyConfig::default().upstream_roots(vec![upstream_ca.clone()]))
        .resolver(Arc::new(
            StaticResolver::new().with("api.test", &["127.0.0.1".parse().unwrap()]),
        ))
        .build();
    let policy = NetworkPolicy::Allow {
        hosts: vec!["api.test".parse().unwrap()],
        cidrs: vec!["127.0.0.0/8".parse().unwrap()],
        ports: vec![],
    };
    let spliced = proxy.register("spliced", policy.clone()).await.unwrap();
    let intercepted = proxy.register("intercepted", policy).await.unwrap();
    let secret = ProxySecret::new(
        "API_TOKEN",
        Secret::new(VALUE),
        vec!["api.test".parse().unwrap()],
    )
    .unwrap();
    let placeholder = secret.placeholder().to_string();
    proxy
        .set_secrets("intercepted", SecretSet::new(vec![secret]))
        .unwrap();
    // The client trusts both: the real server's CA (spliced) and the proxy's (intercepted).
    let mut roots = rustls::RootCertStore::empty();
    roots.add(upstream_ca).unwrap();
    let pem = proxy.interception_ca_pem().unwrap();
    let der = pem
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect::<String>();
    use base64::Engine as _;
    let der = base64::engine::general_purpose::STANDARD
        .decode(der)
        .unwrap();
    roots.add(CertificateDer::from(der)).unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    // Keep the proxy alive for the whole bench.
    std::mem::forget(proxy);
    Setup {
        spliced: spliced.proxy_addr,
        intercepted: intercepted.proxy_addr,
        placeholder,
        client: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
        port,
    }
}

/// One HTTPS GET through the proxy (CONNECT, TLS, request, whole response); returns the
/// bytes read.
async fn get(s: &Setup, proxy: SocketAddr, path: &str) -> u64 {
    let mut tcp = TcpStream::connect(proxy).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let port = s.port;
    tcp.write_all(
        format!("CONNECT api.test:{port} HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut b = [0u8; 1];
        tcp.read_exact(&mut b).await.unwrap();
        head.push(b[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"));
    let name = ServerName::try_from("api.test".to_string()).unwrap();
    let mut t = s.client.connect(name, tcp).await.unwrap();
    t.write_all(
        format!(
            "GET {path} HTTP/1.1\r\nHost: api.test:{port}\r\nAuthorization: Bearer {}\r\n\r\n",
            s.placeholder
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        match t.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n as u64,
        }
    }
    total
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let s = rt.block_on(setup());
    let mut g = c.benchmark_group("egress-intercept");
    g.sample_size(30).measurement_time(Duration::from_secs(5));
    for (name, addr) in [("spliced", s.spliced), ("intercepted", s.intercepted)] {
        g.bench_function(format!("https GET, new connection: {name}"), |b| {
            b.iter_custom(|n| {
                rt.block_on(async {
                    let t = Instant::now();
                    for _ in 0..n {
                        assert!(get(&s, addr, "/small").await > 0);
                    }
                    t.elapsed()
                })
            })
        });
    }
    g.sample_size(10)
        .measurement_time(Duration::from_secs(20))
        .throughput(Throughput::Bytes(BIG));
    for (name, addr) in [("spliced", s.spliced), ("intercepted", s.intercepted)] {
        g.bench_function(format!("256 MiB download: {name}"), |b| {
            b.iter_custom(|n| {
                rt.block_on(async {
                    let t = Instant::now();
                    for _ in 0..n {
                        assert!(get(&s, addr, "/big").await > BIG);
                    }
                    t.elapsed()
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
