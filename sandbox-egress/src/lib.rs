//! Host-side egress proxy for agent-sandbox: the only way out of a sandbox whose
//! [`NetworkPolicy`](sandbox_core::NetworkPolicy) is an allowlist.
//!
//! One [`EgressProxy`] (tokio) serves many sandboxes. [`EgressProxy::register`] gives each
//! sandbox its own listeners (the listener that accepted a connection *is* the sandbox's
//! identity), its own policy ([`EgressProxy::update_policy`] takes effect on the next
//! connection) and its own audit ring ([`EgressProxy::audit`]).
//!
//! - Connections are understood as an HTTP/1.1 forward proxy (decided by the host), as
//!   `CONNECT host:port` (a blind tunnel), or transparently (redirected TCP, decided by the
//!   HTTP `Host` or the TLS SNI, [`tls`], else by the original destination); with a name the
//!   proxy resolves it itself and dials that, so a forged SNI steers nothing.
//! - Names are resolved **on the host** ([`Resolver`]), only when a rule could allow them, and
//!   [`NetworkPolicy::decide`](sandbox_core::NetworkPolicy::decide) judges **every** resolved
//!   address before anything is dialed: the metadata endpoint, loopback and unlisted private
//!   ranges are refused whatever a name resolves to. A tiny [`dns`] responder answers only
//!   allowed names with allowed addresses.
//! - **Proxy-held secrets** ([`secrets`], [`EgressProxy::set_secrets`]): the sandbox holds a
//!   placeholder; the proxy puts the real value into requests to the hosts the secret is
//!   bound to (TLS to those hosts only is terminated with a per-process CA, [`intercept`])
//!   and masks it in what they answer.
//! - Every decision is an [`AuditEntry`]: a `tracing` event (target `sandbox_egress::audit`)
//!   and an entry in the sandbox's bounded ring.
//!
//! The sandbox's namespace has no route except to the proxy: [`VethEnforcer`] (veth +
//! nftables, [`netns`]) attaches container, gVisor and microVM sandboxes as an
//! [`EgressEnforcer`](sandbox_core::EgressEnforcer).
//!
//! `docs/egress.md` in the repository is the design: how each kind of connection is decided,
//! the transports, the threat model (covered: rebinding, literal IPs, forged SNI, ECH, DNS
//! tunnels, floods) and what is **not** covered (domain fronting through an allowed CDN,
//! exfiltration to allowed hosts, covert channels, QUIC). `docs/network.md` is the overview
//! and `docs/threat-model.md` places the proxy among the tiers.

pub mod audit;
pub mod dns;
#[cfg(target_os = "linux")]
pub mod enforcer;
mod http;
pub mod intercept;
pub mod net;
#[cfg(target_os = "linux")]
pub mod netns;
mod proxy;
pub mod secrets;
#[cfg(target_os = "linux")]
mod splice;
pub mod testing;
pub mod tls;

pub use audit::{AuditEntry, AuditRule, Via};
#[cfg(target_os = "linux")]
pub use enforcer::{shared as shared_enforcer, LazyEnforcer, VethEnforcer, VethEnforcerBuilder};
pub use net::{Dialer, Resolver, StaticResolver, SystemResolver, TcpDialer, UpstreamStream};
pub use proxy::{
    EgressProxy, EgressProxyBuilder, ListenOptions, NoOriginalDst, OriginalDst, ProxyConfig,
    Registration, Sockets, StreamMode,
};
