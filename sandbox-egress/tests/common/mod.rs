//! Shared helpers: loopback servers, a test resolver, a dialer that records and only ever
//! dials loopback, and a test CA.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sandbox_core::NetworkPolicy;
use sandbox_egress::{
    Dialer, EgressProxy, ProxyConfig, Resolver, StaticResolver, TcpDialer, UpstreamStream,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Guards every await that could hang on a bug (not a timing assertion).
pub const HANG_GUARD: Duration = Duration::from_secs(30);

pub async fn guard<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(HANG_GUARD, f)
        .await
        .expect("test hung")
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Names used by the tests. Nothing here ever leaves loopback: the dialer refuses others.
pub fn test_resolver() -> StaticResolver {
    StaticResolver::new()
        .with("allowed.test", &[ip("127.0.0.1")])
        .with("other.test", &[ip("127.0.0.1")])
        .with("meta.test", &[ip("169.254.169.254")])
        .with("mixed.test", &[ip("127.0.0.1"), ip("169.254.169.254")])
        .with("private.test", &[ip("10.201.0.5")])
        .with("v6.test", &[ip("::1")])
}

/// Records every name looked up.
#[derive(Debug)]
pub struct CountingResolver {
    pub inner: StaticResolver,
    pub lookups: Mutex<Vec<String>>,
}

#[async_trait]
impl Resolver for CountingResolver {
    async fn resolve(&self, host: &str) -> io::Result<Vec<IpAddr>> {
        self.lookups.lock().unwrap().push(host.to_string());
        self.inner.resolve(host).await
    }
}

/// Records every dial and refuses (without sending anything) any non-loopback address, so a
/// bug can never send test traffic off this machine.
#[derive(Debug, Default)]
pub struct GuardDialer {
    pub dials: Mutex<Vec<SocketAddr>>,
}

#[async_trait]
impl Dialer for GuardDialer {
    async fn dial(&self, addr: SocketAddr) -> io::Result<Box<dyn UpstreamStream>> {
        self.dials.lock().unwrap().push(addr);
        if !addr.ip().is_loopback() {
            return Err(io::Error::other(format!(
                "test dialer refuses non-loopback {addr}"
            )));
        }
        TcpDialer.dial(addr).await
    }
}

pub struct Harness {
    pub proxy: EgressProxy,
    pub dialer: Arc<GuardDialer>,
    pub resolver: Arc<CountingResolver>,
}

impl Harness {
    pub fn new() -> Self {
        Self::with_config(ProxyConfig::default())
    }

    pub fn with_config(config: ProxyConfig) -> Self {
        Self::with_config_and_resolver(config, test_resolver())
    }

    pub fn with_config_and_resolver(config: ProxyConfig, names: StaticResolver) -> Self {
        let dialer = Arc::new(GuardDialer::default());
        let resolver = Arc::new(CountingResolver {
            inner: names,
            lookups: Mutex::new(Vec::new()),
        });
        let proxy = EgressProxy::builder()
            .config(config)
            .resolver(resolver.clone())
            .dialer(dialer.clone())
            .build();
        Harness {
            proxy,
            dialer,
            resolver,
        }
    }

    pub fn dials(&self) -> Vec<SocketAddr> {
        self.dialer.dials.lock().unwrap().clone()
    }

    pub fn lookups(&self) -> Vec<String> {
        self.resolver.lookups.lock().unwrap().clone()
    }
}

/// `Allow` with these hosts and loopback listed explicitly (loopback is refused otherwise).
pub fn policy(hosts: &[&str]) -> NetworkPolicy {
    NetworkPolicy::Allow {
        hosts: hosts.iter().map(|h| h.parse().unwrap()).collect(),
        cidrs: vec!["127.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()],
        ports: vec![],
    }
}

/// A loopback HTTP server answering `host=<Host> path=<path>` and closing.
pub async fn http_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = s.read(&mut chunk).await.unwrap();
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                let head = String::from_utf8_lossy(&buf).to_string();
                let path = head.split(' ').nth(1).unwrap_or("").to_string();
                let host = head
                    .lines()
                    .find_map(|l| l.strip_prefix("Host: "))
                    .unwrap_or("")
                    .to_string();
                let body = format!(
                    "host={host} path={path} proxyauth={}",
                    head.contains("Proxy-Authorization")
                );
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                s.write_all(resp.as_bytes()).await.unwrap();
                let _ = s.shutdown().await;
            });
        }
    });
    port
}

/// A loopback TCP echo server.
pub async fn echo_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    port
}

/// Reads everything until EOF (a reset counts as EOF: a dropped connection).
pub async fn read_all<S: AsyncRead + Unpin>(s: &mut S) -> String {
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match guard(s.read(&mut chunk)).await {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8_lossy(&out).to_string()
}

/// Reads a response head (up to and including the blank line), byte by byte.
pub async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> String {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    while !out.ends_with(b"\r\n\r\n") {
        let n = guard(s.read(&mut b)).await.unwrap();
        if n == 0 {
            break;
        }
        out.push(b[0]);
    }
    String::from_utf8_lossy(&out).to_string()
}

/// Sends one request to the explicit proxy and returns the whole response.
pub async fn proxy_request(proxy: SocketAddr, req: &str) -> String {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    read_all(&mut s).await
}

/// Opens a CONNECT tunnel; returns the response head and the stream.
pub async fn connect(proxy: SocketAddr, target: &str) -> (String, TcpStream) {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut s).await;
    (head, s)
}

pub mod tls {
    use super::*;
    use tokio_rustls::rustls::pki_types::ServerName;
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    /// A test CA and a loopback TLS server for `allowed.test` that answers `tls-ok:<line>`.
    pub struct TlsServer {
        pub port: u16,
        pub connector: TlsConnector,
    }

    pub async fn server() -> TlsServer {
        let ca = sandbox_egress::testing::TestCa::new("test CA").unwrap();
        let acceptor = TlsAcceptor::from(ca.server_config(&["allowed.test"]).unwrap());
        let client = ca.client_config().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            loop {
                let (s, _) = l.accept().await.unwrap();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(s).await else {
                        return;
                    };
                    let mut buf = [0u8; 256];
                    let n = tls.read(&mut buf).await.unwrap_or(0);
                    let mut reply = b"tls-ok:".to_vec();
                    reply.extend_from_slice(&buf[..n]);
                    let _ = tls.write_all(&reply).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        TlsServer {
            port,
            connector: TlsConnector::from(client),
        }
    }

    /// TLS to `allowed.test` over `stream`, sends `msg`, returns the server's reply.
    pub async fn talk<S: AsyncRead + AsyncWrite + Unpin>(
        connector: &TlsConnector,
        stream: S,
        msg: &str,
    ) -> String {
        let name = ServerName::try_from("allowed.test").unwrap();
        let mut tls = guard(connector.connect(name, stream)).await.unwrap();
        tls.write_all(msg.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let _ = guard(tls.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).to_string()
    }
}

/// A hand-built TLS ClientHello record with an SNI and, optionally, an ECH extension.
pub fn client_hello(sni: &str, ech: bool) -> Vec<u8> {
    let mut exts = Vec::new();
    let mut entry = vec![0u8];
    entry.extend_from_slice(&(sni.len() as u16).to_be_bytes());
    entry.extend_from_slice(sni.as_bytes());
    let mut sni_data = (entry.len() as u16).to_be_bytes().to_vec();
    sni_data.extend_from_slice(&entry);
    exts.extend_from_slice(&0u16.to_be_bytes());
    exts.extend_from_slice(&(sni_data.len() as u16).to_be_bytes());
    exts.extend_from_slice(&sni_data);
    if ech {
        exts.extend_from_slice(&[0xfe, 0x0d, 0, 3, 1, 2, 3]);
    }
    let mut body = vec![3, 3];
    body.extend_from_slice(&[9u8; 32]);
    body.push(0);
    body.extend_from_slice(&[0, 2, 0x13, 0x01, 1, 0]);
    body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
    body.extend_from_slice(&exts);
    let mut hs = vec![1];
    hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&body);
    let mut rec = vec![0x16, 3, 1];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}
