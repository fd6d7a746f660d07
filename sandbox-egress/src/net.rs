//! The two seams to the outside world: name resolution and dialing.
//!
//! Production uses [`SystemResolver`] and [`TcpDialer`]; tests plug in [`StaticResolver`] and a
//! dialer that records (or refuses) every dial, so they can prove the proxy never dialed a
//! refused address.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};

use async_trait::async_trait;
use tokio::io::{AsyncRead, AsyncWrite};

/// Resolves a host name to addresses, on the host side.
#[async_trait]
pub trait Resolver: Send + Sync + fmt::Debug {
    /// All addresses `host` (a validated, lower-case name, never an IP literal) resolves to.
    async fn resolve(&self, host: &str) -> io::Result<Vec<IpAddr>>;
}

/// The host's resolver (`getaddrinfo` through `tokio::net::lookup_host`).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemResolver;

#[async_trait]
impl Resolver for SystemResolver {
    async fn resolve(&self, host: &str) -> io::Result<Vec<IpAddr>> {
        let mut out: Vec<IpAddr> = Vec::new();
        for sa in tokio::net::lookup_host((host, 0)).await? {
            if !out.contains(&sa.ip()) {
                out.push(sa.ip());
            }
        }
        Ok(out)
    }
}

/// A fixed name → addresses map (tests, or a pinned deployment). Unknown names fail to resolve.
#[derive(Debug, Default, Clone)]
pub struct StaticResolver {
    map: HashMap<String, Vec<IpAddr>>,
}

impl StaticResolver {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) `name` → `addrs`. Names are matched case-insensitively.
    pub fn with(mut self, name: &str, addrs: &[IpAddr]) -> Self {
        self.insert(name, addrs);
        self
    }

    /// Adds (or replaces) `name` → `addrs`.
    pub fn insert(&mut self, name: &str, addrs: &[IpAddr]) {
        self.map.insert(
            name.trim_end_matches('.').to_ascii_lowercase(),
            addrs.to_vec(),
        );
    }
}

#[async_trait]
impl Resolver for StaticResolver {
    async fn resolve(&self, host: &str) -> io::Result<Vec<IpAddr>> {
        self.map
            .get(host)
            .cloned()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{host}: no such name")))
    }
}

/// A byte stream to an upstream destination.
pub trait UpstreamStream: AsyncRead + AsyncWrite + Unpin + Send + std::any::Any {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> UpstreamStream for T {}

/// Opens connections to destinations the policy allowed.
#[async_trait]
pub trait Dialer: Send + Sync + fmt::Debug {
    /// Connects to `addr`. Only ever called with an address `decide` allowed.
    async fn dial(&self, addr: SocketAddr) -> io::Result<Box<dyn UpstreamStream>>;
}

/// Plain TCP (with `TCP_NODELAY`).
#[derive(Debug, Default, Clone, Copy)]
pub struct TcpDialer;

#[async_trait]
impl Dialer for TcpDialer {
    async fn dial(&self, addr: SocketAddr) -> io::Result<Box<dyn UpstreamStream>> {
        let s = tokio::net::TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        Ok(Box::new(s))
    }
}
