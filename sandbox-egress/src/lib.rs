//! Host-side egress proxy for agent-sandbox: the only way out of a sandbox whose
//! [`NetworkPolicy`](sandbox_core::NetworkPolicy) is an allowlist.
//!
//! # What it does
//!
//! One [`EgressProxy`] (tokio) serves many sandboxes. [`EgressProxy::register`] gives each
//! sandbox its own listeners — the listener that accepted a connection *is* the sandbox's
//! identity — its own policy ([`EgressProxy::update_policy`] takes effect on the next
//! connection) and its own audit ring ([`EgressProxy::audit`]);
//! [`EgressProxy::unregister`] closes every listener, DNS responder and open tunnel of it.
//!
//! A connection is understood in one of three ways:
//! - **HTTP/1.1 forward proxy**: `GET http://host[:port]/path` is decided by its host (the
//!   `Host` header must agree with the URI), sent upstream in origin form with
//!   `Connection: close` and proxy headers removed;
//! - **`CONNECT host:port`**: decided by the CONNECT target, then a blind byte tunnel (no TLS
//!   interception: HTTPS keeps end-to-end certificates), except to a host that a proxy-held
//!   secret is bound to (below);
//! - **transparent** (redirected TCP, [`ListenOptions::transparent_port`] or
//!   [`EgressProxy::serve_stream`] with [`StreamMode::Transparent`]): the first bytes are
//!   sniffed — an HTTP request's `Host`, or a TLS ClientHello's SNI ([`tls`], a bounded
//!   parser) — else the connection is decided by the original destination's address and port.
//!   With a name, the proxy resolves the name itself and connects to that, never to the
//!   address the sandbox dialed, so a forged SNI cannot steer bytes to another address.
//!
//! Names are resolved **on the host** through a [`Resolver`] ([`SystemResolver`] in
//! production, [`StaticResolver`] in tests). A name is looked up only if a host rule of the
//! policy could allow it (so a refused `secret.attacker.example` is never sent to any
//! resolver), then [`NetworkPolicy::decide`](sandbox_core::NetworkPolicy::decide) judges
//! **every** resolved address: if any is refused (the metadata endpoint, loopback, a private
//! range the policy does not list, ...), the whole name is refused and nothing is dialed.
//! Literal addresses go through the same `decide`. Only allowed addresses reach the
//! [`Dialer`].
//!
//! A tiny [`dns`] responder (UDP, [`ListenOptions::dns_port`]) answers A/AAAA only for names
//! the policy could allow, with only the allowed addresses; NXDOMAIN otherwise (REFUSED under
//! deny-all).
//!
//! **Proxy-held secrets** ([`secrets`], [`EgressProxy::set_secrets`]): the sandbox holds a
//! random placeholder instead of a credential; for requests to the hosts the secret is bound
//! to, the proxy puts the real value in (headers and Basic credentials by default; the
//! request target and bodies up to [`ProxyConfig::max_substituted_body`] where the secret is
//! granted them, [`secrets::SecretPlaces`]) and puts the placeholder back over the value, and
//! over its base64, hex and percent-encoded forms, in responses. TLS to those hosts only is terminated with a leaf minted by a per-process CA
//! ([`intercept`]; the sandbox trusts [`EgressProxy::interception_ca_pem`]) and re-opened to
//! the real server with full verification; HTTP/1.1 with keep-alive. A placeholder on its way
//! to any other host is refused (403) and audited as a leak attempt.
//!
//! Every decision becomes an [`AuditEntry`]: a structured `tracing` event (target
//! `sandbox_egress::audit`; `info` allowed, `warn` denied) and an entry in the sandbox's
//! bounded ring.
//!
//! # Design: getting the sandbox's traffic here
//!
//! The sandbox's network namespace must have **no route anywhere except to this proxy**;
//! otherwise code that ignores `HTTP_PROXY` would simply connect directly. Two transports:
//!
//! 1. **veth + nftables** (container tier, gVisor with `--network=host` inside our namespace):
//!    a veth pair, the host end holding e.g. `10.200.N.1/30`, the sandbox end `10.200.N.2/30`,
//!    the default route via the host end. Inside the sandbox namespace an nftables table
//!    (installed before any sandbox code runs, owned by our init, not changeable by the
//!    sandbox because it lacks `CAP_NET_ADMIN` in its user namespace):
//!    `output`: accept `lo`; accept to the proxy's address+ports; TCP to anything else is
//!    `redirect`ed/`dnat`ed to the transparent listener; UDP 53 to the DNS responder; drop all
//!    else (IPv6 too, ICMP too). On the host side the veth end accepts only the proxy's ports
//!    (an `input` rule on the host end) and has **no forwarding** (`ip_forward` stays off for
//!    that interface, or a `forward` drop rule), so the host is never a router for the
//!    sandbox. Both explicit (`HTTP(S)_PROXY`/`ALL_PROXY` set in the env) and transparent
//!    capture work; explicit is preferred by well-behaved clients, transparent catches
//!    the rest. [`netns::VethConfig`] sets this up (the redirect happens in the host-side
//!    namespace, so [`netns::SoOriginalDst`] can read the original destination) and
//!    [`EgressProxy::register_with_sockets`] adopts listeners bound on the host end.
//! 2. **A Unix socket carried into the sandbox**: the namespace keeps only `lo`; the host
//!    binds a Unix socket per sandbox and bind-mounts it in; a small forwarder in our init
//!    listens on `127.0.0.1:3128` inside and copies each connection to the socket, where the
//!    host calls [`EgressProxy::serve_stream`] with [`StreamMode::Explicit`]. No route exists
//!    at all, so the kernel enforces "only the proxy"; but only explicit-proxy clients work
//!    (what sandbox-runtime does with socat). This is the transport of choice for gVisor
//!    `--network=none` and microVMs (vsock instead of the Unix socket).
//!
//! # Threat model
//!
//! The sandboxed code is hostile and wants to send data anywhere or reach the cloud metadata
//! endpoint. It controls every byte it sends, the names it asks for, the SNI and `Host` it
//! writes, the timing, and may run its own DNS server on an allowed host. We rely on: the
//! namespace having no other route (kernel), the policy evaluation in `sandbox-core`, and
//! host-side resolution. Covered: direct connections ignoring the proxy (no route),
//! DNS rebinding to link-local/loopback/private addresses (decided after resolution),
//! literal IPs (decided by address only), `Host`/URI mismatch, DNS tunnels through refused
//! names (never resolved), mixed answers, forged SNI (we resolve the name ourselves),
//! ECH (refused by default), floods (bounded heads, timeouts, per-sandbox connection caps,
//! bounded audit ring).
//!
//! # Not covered
//!
//! - **Domain fronting**: a ClientHello with `SNI=allowed-cdn.example` and an inner HTTP
//!   `Host: attacker.example` reaches the attacker through the CDN. Without TLS interception
//!   the proxy cannot see the inner `Host`. Allow CDN-fronted names with care.
//! - **Exfiltration to allowed destinations** (an allowed API that stores data, a public
//!   paste on an allowed host) and covert channels in timing or in allowed DNS answers.
//! - After `CONNECT`, the tunnel carries whatever the sandbox sends to the allowed address;
//!   after one forward-proxy request, further pipelined bytes on that connection go only to
//!   the same allowed upstream.
//! - A resolver that lies to the host (we trust the host's resolver).
//! - UDP other than DNS (QUIC/HTTP3) is not proxied: it is dropped by the namespace rules.

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
