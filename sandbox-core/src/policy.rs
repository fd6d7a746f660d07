//! Network egress policy and the one decision function every enforcer shares.
//!
//! [`NetworkPolicy::decide`] is pure: given the destination name (if any), the address it
//! resolved to and the port, it says allowed or denied and which rule decided. Enforcers call
//! it **after** resolving the name, so a name that resolves to the metadata endpoint, loopback
//! or a private range is refused like the literal address would be (no DNS-rebinding bypass).
//!
//! Invariants, in every mode:
//! - link-local (`169.254.0.0/16`, `fe80::/10`, hence the cloud metadata endpoint
//!   `169.254.169.254`), unspecified, broadcast and multicast addresses are always refused;
//! - loopback, RFC 1918, CGNAT (`100.64.0.0/10`), "this network" (`0.0.0.0/8`), the IETF
//!   protocol (`192.0.0.0/24`) and benchmarking (`198.18.0.0/15`) ranges, ULA (`fc00::/7`) and
//!   site-local (`fec0::/10`) are refused unless a CIDR **inside** that range is listed explicitly
//!   (`0.0.0.0/0` does not count as listing `127.0.0.1`);
//! - IPv6 forms that carry an IPv4 address (mapped, translated, compatible, NAT64, 6to4,
//!   Teredo) are judged as the IPv4 address they carry.

mod rules;

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

use crate::error::Error;

pub use rules::{Cidr, DenyRule, HostPattern, HostRule};

/// Which destinations a sandbox may reach. The default is [`NetworkPolicy::DenyAll`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(tag = "mode", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum NetworkPolicy {
    /// No network at all: the sandbox has only a loopback interface of its own.
    #[default]
    DenyAll,
    /// Only the listed destinations.
    Allow {
        /// Host names (`api.example.com`) or wildcard suffixes (`*.example.com`), each
        /// optionally with a port (`api.example.com:443`).
        #[serde(default)]
        hosts: Vec<HostRule>,
        /// Address ranges. A range inside loopback or a private range is what allows it.
        #[serde(default)]
        cidrs: Vec<Cidr>,
        /// When non-empty, only these ports, whatever the rule.
        #[serde(default)]
        ports: Vec<u16>,
    },
    /// Any public destination except the listed ones.
    AllowInternet {
        /// Hosts and ranges refused even though the internet is allowed.
        #[serde(default)]
        deny: Vec<DenyRule>,
        /// Ranges inside loopback / private space that are allowed as well.
        #[serde(default)]
        private: Vec<Cidr>,
    },
}

/// The outcome of [`NetworkPolicy::decide`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Decision {
    /// Whether the connection may proceed.
    pub allowed: bool,
    /// The rule that decided.
    pub rule: DecisionRule,
}

/// Why a connection was allowed or refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "detail", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum DecisionRule {
    /// Link-local (incl. the cloud metadata endpoint): refused in every mode.
    LinkLocal,
    /// Unspecified, broadcast or multicast: never a valid destination.
    NotUnicast,
    /// The policy is deny-all.
    DenyAll,
    /// Loopback/private/ULA range not explicitly listed. Carries the range.
    PrivateRange(String),
    /// Allowed by this host rule.
    Host(String),
    /// Allowed by this CIDR.
    Cidr(String),
    /// The port is not in the policy's port list.
    Port(u16),
    /// Nothing in the allowlist matches.
    NotListed,
    /// Refused by this deny rule (allow-internet mode).
    Denied(String),
    /// On a server: the server's loopback, private networks or own addresses, which only its
    /// operator can open to clients ([`ServerNetworks`]). Carries what it is.
    ServerNetwork(String),
    /// Allowed: public destination in allow-internet mode.
    Internet,
}

impl fmt::Display for DecisionRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecisionRule::LinkLocal => f.write_str("link-local/metadata range is always refused"),
            DecisionRule::NotUnicast => f.write_str("not a unicast destination"),
            DecisionRule::DenyAll => f.write_str("network policy is deny-all"),
            DecisionRule::PrivateRange(r) => write!(f, "{r} is refused unless listed explicitly"),
            DecisionRule::Host(h) => write!(f, "allowed by host rule {h}"),
            DecisionRule::Cidr(c) => write!(f, "allowed by cidr {c}"),
            DecisionRule::Port(p) => write!(f, "port {p} is not allowed"),
            DecisionRule::NotListed => f.write_str("destination is not in the allowlist"),
            DecisionRule::Denied(r) => write!(f, "refused by deny rule {r}"),
            DecisionRule::ServerNetwork(r) => write!(
                f,
                "{r} belongs to the server: clients reach it only if the operator starts \
                 `serve` with --allow-private-networks"
            ),
            DecisionRule::Internet => f.write_str("public destination, internet allowed"),
        }
    }
}

/// Ranges refused unless listed explicitly, with a name for messages.
const SPECIAL_V4: &[(&str, [u8; 4], u8)] = &[
    ("this-network 0.0.0.0/8", [0, 0, 0, 0], 8),
    ("private 10.0.0.0/8", [10, 0, 0, 0], 8),
    ("cgnat 100.64.0.0/10", [100, 64, 0, 0], 10),
    ("loopback 127.0.0.0/8", [127, 0, 0, 0], 8),
    ("private 172.16.0.0/12", [172, 16, 0, 0], 12),
    ("private 192.168.0.0/16", [192, 168, 0, 0], 16),
    ("ietf-protocol 192.0.0.0/24", [192, 0, 0, 0], 24),
    ("benchmarking 198.18.0.0/15", [198, 18, 0, 0], 15),
];

impl NetworkPolicy {
    /// Whether every destination `rule` names could be allowed by this policy's host rules:
    /// an allowlist must hold a rule covering it (the same name, or a wildcard over it, on
    /// its port or any port); the internet policy allows any name its deny list does not
    /// name; deny-all allows none. (Addresses are still decided one by one at connect time.)
    pub fn allows_host_rule(&self, rule: &HostRule) -> bool {
        let covers = |p: &HostPattern, q: &HostPattern| match (p, q) {
            (HostPattern::Exact(a), HostPattern::Exact(b)) => a == b,
            (HostPattern::Suffix(_), HostPattern::Exact(b)) => p.matches(b),
            (HostPattern::Suffix(a), HostPattern::Suffix(b)) => {
                b == a || b.ends_with(&format!(".{a}"))
            }
            (HostPattern::Exact(_), HostPattern::Suffix(_)) => false,
        };
        match self {
            NetworkPolicy::DenyAll => false,
            NetworkPolicy::Allow { hosts, .. } => hosts.iter().any(|h| {
                covers(&h.pattern, &rule.pattern) && (h.port.is_none() || h.port == rule.port)
            }),
            NetworkPolicy::AllowInternet { deny, .. } => !deny.iter().any(|d| match d {
                DenyRule::Host(h) => covers(h, &rule.pattern),
                DenyRule::Cidr(_) => false,
            }),
        }
    }

    /// The allowlist policy for exact hosts / patterns (any port).
    pub fn allow_hosts<I, S>(hosts: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let hosts = hosts
            .into_iter()
            .map(|h| h.as_ref().parse())
            .collect::<Result<_, _>>()?;
        Ok(NetworkPolicy::Allow {
            hosts,
            cidrs: Vec::new(),
            ports: Vec::new(),
        })
    }

    /// `true` unless the policy is deny-all.
    pub fn allows_any_network(&self) -> bool {
        !matches!(self, NetworkPolicy::DenyAll)
    }

    /// Decides one connection. `host` is the name the sandbox asked for (HTTP `Host`, TLS SNI,
    /// `CONNECT` target or DNS query), `None` for a bare address; `ip` is the address it
    /// resolved to (or the literal address); `port` the destination port.
    ///
    /// In a process that serves other parties ([`ServerNetworks::refuse_in_this_process`]),
    /// loopback, private space and the host's own addresses are refused before the policy is
    /// consulted.
    pub fn decide(&self, host: Option<&str>, ip: IpAddr, port: u16) -> Decision {
        self.decide_guarded(host, ip, port, SERVER_NETWORKS.get())
    }

    /// [`decide`](Self::decide) with an explicit server guard (`None`: none).
    pub fn decide_guarded(
        &self,
        host: Option<&str>,
        ip: IpAddr,
        port: u16,
        guard: Option<&ServerNetworks>,
    ) -> Decision {
        let ip = canonical_ip(ip);
        let deny = |rule| Decision {
            allowed: false,
            rule,
        };
        if is_link_local(ip) {
            return deny(DecisionRule::LinkLocal);
        }
        if !is_unicast(ip) {
            return deny(DecisionRule::NotUnicast);
        }
        if let Some(what) = guard.and_then(|g| g.refuses(ip)) {
            return deny(DecisionRule::ServerNetwork(what));
        }
        // Ranges that may open loopback/private space: the allowlist's CIDRs, or the
        // allow-internet mode's explicit private list.
        let private: &[Cidr] = match self {
            NetworkPolicy::DenyAll => return deny(DecisionRule::DenyAll),
            NetworkPolicy::Allow { cidrs, .. } => cidrs,
            NetworkPolicy::AllowInternet { private, .. } => private,
        };
        if let Some(range) = special_range(ip) {
            let explicit = private
                .iter()
                .any(|c| c.contains(ip) && c.effective().1 >= range.prefix);
            if !explicit {
                return deny(DecisionRule::PrivateRange(range.name.to_string()));
            }
        }
        let host = host
            .map(normalize_host)
            .filter(|h| h.parse::<IpAddr>().is_err());
        match self {
            NetworkPolicy::DenyAll => deny(DecisionRule::DenyAll),
            NetworkPolicy::Allow {
                hosts,
                cidrs,
                ports,
            } => {
                if !ports.is_empty() && !ports.contains(&port) {
                    return deny(DecisionRule::Port(port));
                }
                if let Some(h) = host.as_deref() {
                    if let Some(rule) = hosts.iter().find(|r| r.matches(h, port)) {
                        return Decision {
                            allowed: true,
                            rule: DecisionRule::Host(rule.to_string()),
                        };
                    }
                }
                if let Some(c) = cidrs.iter().find(|c| c.contains(ip)) {
                    return Decision {
                        allowed: true,
                        rule: DecisionRule::Cidr(c.to_string()),
                    };
                }
                deny(DecisionRule::NotListed)
            }
            NetworkPolicy::AllowInternet { deny: rules, .. } => {
                for r in rules {
                    let hit = match r {
                        DenyRule::Host(p) => host.as_deref().is_some_and(|h| p.matches(h)),
                        DenyRule::Cidr(c) => c.contains(ip),
                    };
                    if hit {
                        return deny(DecisionRule::Denied(r.to_string()));
                    }
                }
                Decision {
                    allowed: true,
                    rule: DecisionRule::Internet,
                }
            }
        }
    }

    /// Checks the policy for contradictions that would surprise the caller.
    pub fn validate(&self) -> Result<(), Error> {
        let cidrs: &[Cidr] = match self {
            NetworkPolicy::DenyAll => return Ok(()),
            NetworkPolicy::Allow { cidrs, ports, .. } => {
                if ports.contains(&0) {
                    return Err(Error::invalid(
                        "network.ports",
                        "port 0 is not a destination",
                    ));
                }
                cidrs
            }
            NetworkPolicy::AllowInternet { private, .. } => private,
        };
        for c in cidrs {
            if is_link_local(c.addr) {
                return Err(Error::invalid(
                    "network.cidrs",
                    format!("{c} is link-local: the metadata range can never be allowed"),
                ));
            }
        }
        Ok(())
    }
}

/// What a process that serves other parties (`agent-sandbox serve`, or any embedding server)
/// refuses to their sandboxes whatever their policies say: loopback, private space (RFC 1918,
/// CGNAT, ULA, "this network") and the addresses of the host's own interfaces. A client that
/// lists `127.0.0.0/8` must not reach the server's other clients' published ports or a
/// loopback-only service; one that lists `10.0.0.0/8` must not reach the server's VPC.
///
/// Process-wide (one egress proxy serves every sandbox of a process), and once set it stays
/// set: see [`refuse_in_this_process`](Self::refuse_in_this_process).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerNetworks {
    own: Vec<IpAddr>,
}

static SERVER_NETWORKS: std::sync::OnceLock<ServerNetworks> = std::sync::OnceLock::new();

impl ServerNetworks {
    /// A guard that also refuses `own` (the host's interface addresses).
    pub fn new(own: impl IntoIterator<Item = IpAddr>) -> Self {
        ServerNetworks {
            own: own.into_iter().map(canonical_ip).collect(),
        }
    }

    /// Makes every later [`NetworkPolicy::decide`] in this process refuse what this guard
    /// refuses. The first call wins; later ones change nothing (a process serving clients
    /// never goes back to trusting them).
    pub fn refuse_in_this_process(self) {
        let _ = SERVER_NETWORKS.set(self);
    }

    /// The guard of this process, if one was set.
    pub fn current() -> Option<&'static ServerNetworks> {
        SERVER_NETWORKS.get()
    }

    /// Why `ip` is refused, or `None`.
    pub fn refuses(&self, ip: IpAddr) -> Option<String> {
        let ip = canonical_ip(ip);
        if let Some(r) = special_range(ip) {
            return Some(format!("{ip} ({})", r.name));
        }
        self.own
            .contains(&ip)
            .then(|| format!("{ip} (an address of the server's host)"))
    }
}

/// Why `ip` is refused in every mode and by every policy (link-local, hence the metadata
/// endpoint; unspecified, broadcast, multicast), or `None`.
pub fn always_refused(ip: IpAddr) -> Option<DecisionRule> {
    let ip = canonical_ip(ip);
    if is_link_local(ip) {
        Some(DecisionRule::LinkLocal)
    } else if !is_unicast(ip) {
        Some(DecisionRule::NotUnicast)
    } else {
        None
    }
}

impl NetworkPolicy {
    /// The first range this policy lists inside loopback or private space (which, on a
    /// server, only the operator can open to clients), named; `None` when it lists none.
    pub fn private_ranges_listed(&self) -> Option<String> {
        let cidrs: &[Cidr] = match self {
            NetworkPolicy::DenyAll => return None,
            NetworkPolicy::Allow { cidrs, .. } => cidrs,
            NetworkPolicy::AllowInternet { private, .. } => private,
        };
        cidrs
            .iter()
            .find_map(|c| c.private_range().map(|r| format!("{c} (inside {r})")))
    }
}

struct SpecialRange {
    name: &'static str,
    prefix: u8,
}

fn special_range(ip: IpAddr) -> Option<SpecialRange> {
    match ip {
        IpAddr::V4(v4) => SPECIAL_V4.iter().find_map(|(name, net, prefix)| {
            let c = Cidr {
                addr: IpAddr::V4(Ipv4Addr::from(*net)),
                prefix: *prefix,
            };
            c.contains(IpAddr::V4(v4)).then_some(SpecialRange {
                name,
                prefix: *prefix,
            })
        }),
        IpAddr::V6(v6) => {
            if v6 == Ipv6Addr::LOCALHOST {
                Some(SpecialRange {
                    name: "loopback ::1/128",
                    prefix: 128,
                })
            } else if (v6.segments()[0] & 0xfe00) == 0xfc00 {
                Some(SpecialRange {
                    name: "unique-local fc00::/7",
                    prefix: 7,
                })
            } else if (v6.segments()[0] & 0xffc0) == 0xfec0 {
                Some(SpecialRange {
                    name: "site-local fec0::/10",
                    prefix: 10,
                })
            } else {
                None
            }
        }
    }
}

/// The address a connection to `ip` reaches, for judging: an IPv6 form that carries an IPv4
/// address is judged as that IPv4 address (see [`embedded_v4`]).
fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match embedded_v4(v6) {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// The IPv4 address an IPv6 address stands for, when it is a form that reaches an IPv4 host:
/// IPv4-mapped (`::ffff:a.b.c.d`), IPv4-translated (`::ffff:0:a.b.c.d`), IPv4-compatible
/// (`::a.b.c.d`, deprecated; `::` and `::1` excepted), NAT64 (`64:ff9b::/96` and the local-use `64:ff9b:1::/48`, address in the last
/// 32 bits), 6to4 (`2002:AABB:CCDD::/16`) and Teredo (`2001:0::/32`, the client's address
/// inverted in the last 32 bits). So `64:ff9b::a9fe:a9fe` is the metadata endpoint.
pub fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let bits = u128::from(v6);
    let low = Ipv4Addr::from((bits & 0xffff_ffff) as u32);
    let s = v6.segments();
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    // SIIT's IPv4-translated form `::ffff:0:a.b.c.d`.
    if bits >> 32 == 0xffff_0000 {
        return Some(low);
    }
    if bits >> 32 == 0 {
        // `::` and `::1` are IPv6's own unspecified and loopback addresses.
        return (bits > 1).then_some(low);
    }
    if bits >> 32 == 0x0064_ff9b_0000_0000_0000_0000 || (s[0], s[1], s[2]) == (0x64, 0xff9b, 1) {
        return Some(low);
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::from(((bits >> 80) & 0xffff_ffff) as u32));
    }
    if (s[0], s[1]) == (0x2001, 0) {
        return Some(Ipv4Addr::from(!((bits & 0xffff_ffff) as u32)));
    }
    None
}

fn is_link_local(ip: IpAddr) -> bool {
    match canonical_ip(ip) {
        IpAddr::V4(v4) => v4.octets()[0] == 169 && v4.octets()[1] == 254,
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

fn is_unicast(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !(v4.is_unspecified() || v4.is_broadcast() || v4.is_multicast()),
        IpAddr::V6(v6) => !(v6.is_unspecified() || v6.is_multicast()),
    }
}

fn normalize_host(h: &str) -> String {
    h.trim_end_matches('.').to_ascii_lowercase()
}

#[cfg(test)]
mod tests;
