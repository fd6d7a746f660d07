//! Egress fixtures of the microVM network tests: the real enforcer with a resolver and a
//! dialer that keep traffic on this machine, and an upstream HTTP server on loopback.
#![allow(dead_code)]

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use async_trait::async_trait;
use sandbox_core::NetworkPolicy;
use sandbox_egress::{Dialer, StaticResolver, TcpDialer, UpstreamStream, VethEnforcer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Refuses (without sending anything) every address but loopback.
#[derive(Debug)]
pub(crate) struct LoopbackOnly;

#[async_trait]
impl Dialer for LoopbackOnly {
    async fn dial(&self, addr: SocketAddr) -> io::Result<Box<dyn UpstreamStream>> {
        if !addr.ip().is_loopback() {
            return Err(io::Error::other(format!("test dialer refuses {addr}")));
        }
        TcpDialer.dial(addr).await
    }
}

pub(crate) fn allow(hosts: &[&str]) -> NetworkPolicy {
    NetworkPolicy::Allow {
        hosts: hosts.iter().map(|h| h.parse().unwrap()).collect(),
        cidrs: vec!["127.0.0.1/32".parse().unwrap()],
        ports: vec![],
    }
}

/// An HTTP server on loopback answering `hello <Host header>`.
pub(crate) async fn http_server() -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut n = 0;
                while !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") && n < buf.len() {
                    match s.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => n += k,
                    }
                }
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let host = head
                    .lines()
                    .find_map(|l| l.strip_prefix("Host: ").or(l.strip_prefix("host: ")))
                    .unwrap_or("?")
                    .trim()
                    .to_string();
                let body = format!("hello {host}");
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(reply.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    port
}

/// The real enforcer: `allowed.test` and `other.test` resolve to 127.0.0.1, `meta.test` to
/// 169.254.169.254; only loopback is ever dialled.
pub(crate) fn enforcer() -> VethEnforcer {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let resolver = StaticResolver::new()
        .with("allowed.test", &[ip("127.0.0.1")])
        .with("other.test", &[ip("127.0.0.1")])
        .with("meta.test", &[ip("169.254.169.254")]);
    VethEnforcer::builder()
        .resolver(Arc::new(resolver))
        .dialer(Arc::new(LoopbackOnly))
        .build()
        .unwrap()
}
