//! Egress fixtures of the microVM network tests: the real enforcer with a resolver and a
//! dialer that keep traffic on this machine, and an upstream HTTP server on loopback.
#![allow(dead_code)]

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use async_trait::async_trait;
use sandbox_core::NetworkPolicy;
use sandbox_egress::{
    Dialer, ProxyConfig, StaticResolver, TcpDialer, UpstreamStream, VethEnforcer,
};

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
    sandbox_egress::testing::hello_server().await.unwrap()
}

/// The real enforcer: `allowed.test` and `other.test` resolve to 127.0.0.1, `meta.test` to
/// 169.254.169.254; only loopback is ever dialled.
pub(crate) fn enforcer() -> VethEnforcer {
    enforcer_with(ProxyConfig::default())
}

/// [`enforcer`], or `None` (after printing why) where it cannot run here: a test skips on
/// the enforcer's own word (it needs root for network namespaces).
pub(crate) fn try_enforcer() -> Option<VethEnforcer> {
    sandbox_egress::testing::enforcer_or_skip(build(ProxyConfig::default()))
}

/// [`enforcer`] whose proxy trusts `upstream_ca` for the TLS it intercepts (proxy-held
/// secrets) on its way to the upstream servers.
pub(crate) fn enforcer_trusting(upstream_ca: &sandbox_egress::testing::TestCa) -> VethEnforcer {
    enforcer_with(ProxyConfig::default().upstream_roots(vec![upstream_ca.der()]))
}

fn enforcer_with(config: ProxyConfig) -> VethEnforcer {
    build(config).unwrap()
}

fn build(config: ProxyConfig) -> sandbox_core::Result<VethEnforcer> {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let resolver = StaticResolver::new()
        .with("allowed.test", &[ip("127.0.0.1")])
        .with("other.test", &[ip("127.0.0.1")])
        .with("meta.test", &[ip("169.254.169.254")]);
    VethEnforcer::builder()
        .config(config)
        .resolver(Arc::new(resolver))
        .dialer(Arc::new(LoopbackOnly))
        .build()
}
