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

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;

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

/// A host name or `*.suffix` wildcard.
///
/// `*.example.com` matches `a.example.com` and `a.b.example.com` but not `example.com`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HostPattern {
    /// Exactly this name (lower-case, no trailing dot).
    Exact(String),
    /// Any name ending in `.suffix` (stored without the leading `*.`).
    Suffix(String),
}

impl HostPattern {
    /// Whether `host` (already normalized or not) matches.
    pub fn matches(&self, host: &str) -> bool {
        let host = normalize_host(host);
        match self {
            HostPattern::Exact(e) => host == *e,
            HostPattern::Suffix(s) => {
                host.len() > s.len() + 1
                    && host.ends_with(s.as_str())
                    && host.as_bytes()[host.len() - s.len() - 1] == b'.'
            }
        }
    }
}

fn valid_label_chars(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

impl FromStr for HostPattern {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let n = normalize_host(s);
        let bad = |why: &str| Error::invalid("network.hosts", format!("`{s}`: {why}"));
        if let Some(rest) = n.strip_prefix("*.") {
            if !valid_label_chars(rest) {
                return Err(bad("expected `*.domain.tld`"));
            }
            return Ok(HostPattern::Suffix(rest.to_string()));
        }
        if n.contains('*') {
            return Err(bad("`*` is only allowed as a leading `*.` label"));
        }
        if n.parse::<IpAddr>().is_ok() {
            return Err(bad("an address is not a host name: list it under cidrs"));
        }
        if !valid_label_chars(&n) {
            return Err(bad("not a valid host name"));
        }
        Ok(HostPattern::Exact(n))
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostPattern::Exact(e) => f.write_str(e),
            HostPattern::Suffix(s) => write!(f, "*.{s}"),
        }
    }
}

/// A host pattern with an optional port: `api.example.com`, `*.example.com:443`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct HostRule {
    /// The name or wildcard.
    pub pattern: HostPattern,
    /// Only this port, when set.
    pub port: Option<u16>,
}

impl HostRule {
    /// Whether a connection to `host:port` matches.
    pub fn matches(&self, host: &str, port: u16) -> bool {
        self.port.is_none_or(|p| p == port) && self.pattern.matches(host)
    }
}

impl FromStr for HostRule {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.rsplit_once(':') {
            Some((h, p)) => {
                let port: u16 = p.parse().ok().filter(|p| *p != 0).ok_or_else(|| {
                    Error::invalid("network.hosts", format!("`{s}`: port must be 1-65535"))
                })?;
                Ok(HostRule {
                    pattern: h.parse()?,
                    port: Some(port),
                })
            }
            None => Ok(HostRule {
                pattern: s.parse()?,
                port: None,
            }),
        }
    }
}

impl fmt::Display for HostRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.port {
            Some(p) => write!(f, "{}:{p}", self.pattern),
            None => write!(f, "{}", self.pattern),
        }
    }
}

/// An address range such as `10.201.0.0/16` or `2001:db8::/32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    /// The network address.
    pub addr: IpAddr,
    /// The prefix length.
    pub prefix: u8,
}

impl Cidr {
    /// Whether `ip` lies inside the range. A destination is matched as the address it reaches
    /// (an IPv6 form carrying an IPv4 address as that IPv4 address); an IPv4-mapped range
    /// (`::ffff:10.0.0.0/104`) is matched as the IPv4 range it maps.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let (net, prefix) = self.effective();
        let prefix = u32::from(prefix);
        match (net, canonical_ip(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) if prefix <= 32 => {
                let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
                (u32::from(net) & mask) == (u32::from(ip) & mask)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) if prefix <= 128 => {
                let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
                (u128::from(net) & mask) == (u128::from(ip) & mask)
            }
            _ => false,
        }
    }
}

impl Cidr {
    /// The range as matched: an IPv4-mapped range as the IPv4 range it maps.
    fn effective(&self) -> (IpAddr, u8) {
        match self.addr {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) if self.prefix >= 96 => (IpAddr::V4(v4), self.prefix - 96),
                _ => (self.addr, self.prefix),
            },
            v4 => (v4, self.prefix),
        }
    }

    /// Whether this range lies inside loopback or private space (what, on a server, only the
    /// operator may open): the range's name when it does.
    pub fn private_range(&self) -> Option<&'static str> {
        let (net, prefix) = self.effective();
        special_range(net)
            .filter(|r| prefix >= r.prefix)
            .map(|r| r.name)
    }
}

impl FromStr for Cidr {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::invalid("network.cidrs", format!("`{s}`: expected ADDR/PREFIX"));
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = a.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(bad)?,
            None => max,
        };
        Ok(Cidr { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// A deny rule in allow-internet mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DenyRule {
    /// A host name or wildcard.
    Host(HostPattern),
    /// An address range.
    Cidr(Cidr),
}

impl FromStr for DenyRule {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.parse::<Cidr>() {
            Ok(c) => Ok(DenyRule::Cidr(c)),
            Err(_) => Ok(DenyRule::Host(s.parse()?)),
        }
    }
}

impl fmt::Display for DenyRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DenyRule::Host(h) => h.fmt(f),
            DenyRule::Cidr(c) => c.fmt(f),
        }
    }
}

macro_rules! serde_via_str {
    ($($t:ty),*) => {$(
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    )*};
}
serde_via_str!(HostPattern, HostRule, Cidr, DenyRule);

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn allow(hosts: &[&str], cidrs: &[&str], ports: &[u16]) -> NetworkPolicy {
        NetworkPolicy::Allow {
            hosts: hosts.iter().map(|h| h.parse().unwrap()).collect(),
            cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            ports: ports.to_vec(),
        }
    }

    fn internet() -> NetworkPolicy {
        NetworkPolicy::AllowInternet {
            deny: vec![],
            private: vec![],
        }
    }

    const PUBLIC: &str = "93.184.216.34";

    #[test]
    fn default_is_deny_all() {
        let p = NetworkPolicy::default();
        assert_eq!(p, NetworkPolicy::DenyAll);
        let d = p.decide(Some("example.com"), ip(PUBLIC), 443);
        assert!(!d.allowed);
        assert_eq!(d.rule, DecisionRule::DenyAll);
    }

    #[test]
    fn metadata_refused_in_every_mode() {
        let everything = NetworkPolicy::Allow {
            hosts: vec![
                "*.internal".parse().unwrap(),
                "metadata.google.internal".parse().unwrap(),
            ],
            cidrs: vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()],
            ports: vec![],
        };
        let modes = [
            NetworkPolicy::DenyAll,
            everything,
            internet(),
            NetworkPolicy::AllowInternet {
                deny: vec![],
                private: vec!["10.0.0.0/8".parse().unwrap()],
            },
        ];
        let addrs = [
            "169.254.169.254",
            "169.254.0.1",
            "169.254.255.255",
            "fe80::1",
            "febf::1",
            "::ffff:169.254.169.254",
            "fd00:ec2::254",
        ];
        for p in &modes {
            for a in &addrs[..6] {
                for host in [
                    None,
                    Some("metadata.google.internal"),
                    Some("169.254.169.254"),
                ] {
                    let d = p.decide(host, ip(a), 80);
                    assert!(!d.allowed, "{p:?} allowed {a}");
                    if !matches!(p, NetworkPolicy::DenyAll) || *a != "fd00:ec2::254" {
                        assert_eq!(d.rule, DecisionRule::LinkLocal, "{p:?} {a}");
                    }
                }
            }
            // AWS's IPv6 metadata address is ULA: refused unless listed.
            assert!(!p.decide(None, ip(addrs[6]), 80).allowed);
        }
    }

    /// IPv6 forms that carry an IPv4 address are judged as that address: NAT64 of the
    /// metadata endpoint is link-local, 6to4 and IPv4-compatible forms of loopback are
    /// loopback, Teredo's inverted client address is decoded.
    #[test]
    fn ipv6_forms_embedding_ipv4_are_judged_as_the_ipv4_address() {
        let all = internet();
        for (v6, rule) in [
            ("64:ff9b::a9fe:a9fe", DecisionRule::LinkLocal),
            ("64:ff9b:1::a9fe:a9fe", DecisionRule::LinkLocal),
            ("2002:a9fe:a9fe::1", DecisionRule::LinkLocal),
            ("::169.254.169.254", DecisionRule::LinkLocal),
            (
                "2001:0:4136:e378:8000:63bf:5601:5601",
                DecisionRule::LinkLocal,
            ),
            ("::ffff:169.254.169.254", DecisionRule::LinkLocal),
            ("::ffff:0:a9fe:a9fe", DecisionRule::LinkLocal),
            (
                "64:ff9b::7f00:1",
                DecisionRule::PrivateRange("loopback 127.0.0.0/8".into()),
            ),
            (
                "2002:0a00:0001::",
                DecisionRule::PrivateRange("private 10.0.0.0/8".into()),
            ),
        ] {
            let d = all.decide(None, ip(v6), 80);
            assert_eq!((d.allowed, d.rule), (false, rule), "{v6}");
        }
        // IPv6's own loopback stays IPv6 loopback; a public NAT64 address stays public.
        assert_eq!(embedded_v4("::1".parse().unwrap()), None);
        assert!(all.decide(None, ip("64:ff9b::5db8:d822"), 80).allowed);
        assert!(all.decide(None, ip("2606:4700::1111"), 80).allowed);
    }

    /// An IPv4-mapped range is matched as the IPv4 range it maps, with its prefix less 96:
    /// `::ffff:0.0.0.0/96` is all of IPv4, which does not list loopback explicitly (its prefix
    /// once underflowed into a mask that matched everything).
    #[test]
    fn mapped_ranges_match_with_their_ipv4_prefix() {
        let all_v4 = allow(&[], &["::ffff:0.0.0.0/96"], &[]);
        assert!(!all_v4.decide(None, ip("127.0.0.1"), 80).allowed);
        assert!(all_v4.decide(None, ip(PUBLIC), 80).allowed);
        let lo = allow(&[], &["::ffff:127.0.0.0/104"], &[]);
        assert!(lo.decide(None, ip("127.0.0.1"), 80).allowed);
        assert!(!lo.decide(None, ip("10.0.0.1"), 80).allowed);
        let narrow = allow(&[], &["::ffff:10.1.2.0/120"], &[]);
        assert!(narrow.decide(None, ip("10.1.2.3"), 80).allowed);
        assert!(!narrow.decide(None, ip("10.1.3.3"), 80).allowed);
    }

    /// On a server, loopback, private space and the host's own addresses are refused whatever
    /// the client's policy lists, and the refusal names the operator's flag.
    #[test]
    fn a_server_guard_refuses_its_own_networks_whatever_the_policy() {
        let guard = ServerNetworks::new([ip("203.0.113.7")]);
        let open = allow(
            &["*.example.com"],
            &["127.0.0.0/8", "10.0.0.0/8", "203.0.113.0/24", "0.0.0.0/0"],
            &[],
        );
        for target in [
            "127.0.0.1",
            "10.1.2.3",
            "203.0.113.7",
            "::ffff:127.0.0.1",
            "::1",
        ] {
            let d = open.decide_guarded(Some("a.example.com"), ip(target), 443, Some(&guard));
            assert!(!d.allowed, "{target}");
            assert!(
                matches!(d.rule, DecisionRule::ServerNetwork(_)),
                "{target}: {:?}",
                d.rule
            );
            assert!(d.rule.to_string().contains("--allow-private-networks"));
        }
        // Another public address of the allowed range is still allowed, and without the guard
        // the policy alone decides.
        assert!(
            open.decide_guarded(None, ip("203.0.113.8"), 443, Some(&guard))
                .allowed
        );
        assert!(
            open.decide_guarded(None, ip("127.0.0.1"), 443, None)
                .allowed
        );
        assert_eq!(
            open.private_ranges_listed().as_deref(),
            Some("127.0.0.0/8 (inside loopback 127.0.0.0/8)")
        );
        assert_eq!(
            allow(&[], &["0.0.0.0/0"], &[]).private_ranges_listed(),
            None
        );
        assert_eq!(internet().private_ranges_listed(), None);
    }

    #[test]
    fn link_local_cidr_is_rejected_by_validate() {
        let p = allow(&[], &["169.254.169.254/32"], &[]);
        assert!(p.validate().is_err());
        // and even if someone skips validation, decide still refuses
        assert!(!p.decide(None, ip("169.254.169.254"), 80).allowed);
    }

    #[test]
    fn rebinding_allowed_name_to_private_or_loopback_is_refused() {
        let p = allow(&["allowed.test", "*.example.com"], &[], &[]);
        for target in [
            "127.0.0.1",
            "10.0.0.5",
            "172.16.3.4",
            "192.168.1.1",
            "100.64.0.1",
            "0.0.0.1",
            "::1",
            "fd12::1",
            "::ffff:127.0.0.1",
            "::ffff:10.1.2.3",
        ] {
            let d = p.decide(Some("allowed.test"), ip(target), 443);
            assert!(!d.allowed, "{target} should be refused");
            assert!(
                matches!(d.rule, DecisionRule::PrivateRange(_)),
                "{target}: {:?}",
                d.rule
            );
        }
        assert!(p.decide(Some("allowed.test"), ip(PUBLIC), 443).allowed);
        assert!(p.decide(Some("api.example.com"), ip(PUBLIC), 443).allowed);
    }

    #[test]
    fn explicit_private_cidr_allows_only_its_range() {
        let p = allow(&["allowed.test"], &["10.201.0.0/16"], &[]);
        let d = p.decide(Some("allowed.test"), ip("10.201.1.2"), 80);
        assert!(d.allowed);
        assert_eq!(d.rule, DecisionRule::Host("allowed.test".into()));
        // a different private address is still refused even for an allowed name
        assert!(!p.decide(Some("allowed.test"), ip("10.202.1.2"), 80).allowed);
        // a bare IP in the listed range is allowed by cidr
        assert_eq!(
            p.decide(None, ip("10.201.9.9"), 22).rule,
            DecisionRule::Cidr("10.201.0.0/16".into())
        );
        // a public address that no rule matches is refused
        assert_eq!(p.decide(None, ip(PUBLIC), 80).rule, DecisionRule::NotListed);
    }

    #[test]
    fn wide_cidr_does_not_count_as_explicit_private() {
        let p = allow(&[], &["0.0.0.0/0"], &[]);
        assert!(p.decide(None, ip(PUBLIC), 80).allowed);
        assert!(!p.decide(None, ip("127.0.0.1"), 80).allowed);
        assert!(!p.decide(None, ip("10.0.0.1"), 80).allowed);
        let p = allow(&[], &["127.0.0.0/8"], &[]);
        assert!(p.decide(None, ip("127.0.0.1"), 80).allowed);
        let p = allow(&[], &["::1/128"], &[]);
        assert!(p.decide(None, ip("::1"), 80).allowed);
    }

    #[test]
    fn wildcards() {
        let pat: HostPattern = "*.Example.COM.".parse().unwrap();
        assert!(pat.matches("a.example.com"));
        assert!(pat.matches("A.B.EXAMPLE.com."));
        assert!(!pat.matches("example.com"));
        assert!(!pat.matches("badexample.com"));
        assert!(!pat.matches("example.com.evil.net"));
        let exact: HostPattern = "example.com".parse().unwrap();
        assert!(exact.matches("EXAMPLE.com."));
        assert!(!exact.matches("a.example.com"));
        for bad in [
            "*",
            "*.",
            "a.*.com",
            "exa mple.com",
            "",
            "10.0.0.1",
            "*example.com",
        ] {
            assert!(bad.parse::<HostPattern>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn ports() {
        let p = allow(&["api.test:443", "any.test"], &[], &[]);
        assert!(p.decide(Some("api.test"), ip(PUBLIC), 443).allowed);
        assert!(!p.decide(Some("api.test"), ip(PUBLIC), 80).allowed);
        assert!(p.decide(Some("any.test"), ip(PUBLIC), 8080).allowed);
        let p = allow(&["any.test"], &[], &[443]);
        assert_eq!(
            p.decide(Some("any.test"), ip(PUBLIC), 80).rule,
            DecisionRule::Port(80)
        );
        assert!(p.decide(Some("any.test"), ip(PUBLIC), 443).allowed);
        assert!("a.test:0".parse::<HostRule>().is_err());
        assert!("a.test:99999".parse::<HostRule>().is_err());
        assert!(allow(&[], &[], &[0]).validate().is_err());
    }

    #[test]
    fn literal_ip_as_host_is_judged_by_address_only() {
        let p = allow(&["allowed.test"], &[], &[]);
        assert!(!p.decide(Some(PUBLIC), ip(PUBLIC), 80).allowed);
    }

    #[test]
    fn allow_internet_refuses_private_by_default_and_honours_deny() {
        let p = NetworkPolicy::AllowInternet {
            deny: vec![
                "*.evil.test".parse().unwrap(),
                "203.0.113.0/24".parse().unwrap(),
            ],
            private: vec!["10.201.0.0/16".parse().unwrap()],
        };
        assert_eq!(
            p.decide(Some("ok.test"), ip(PUBLIC), 443).rule,
            DecisionRule::Internet
        );
        assert!(!p.decide(Some("x.evil.test"), ip(PUBLIC), 443).allowed);
        assert!(!p.decide(None, ip("203.0.113.7"), 443).allowed);
        assert!(!p.decide(None, ip("192.168.0.1"), 443).allowed);
        assert!(!p.decide(None, ip("127.0.0.1"), 443).allowed);
        assert!(p.decide(None, ip("10.201.0.1"), 443).allowed);
        assert!(!internet().decide(None, ip("10.201.0.1"), 443).allowed);
        assert!(internet().decide(None, ip("2001:db8::1"), 443).allowed);
    }

    #[test]
    fn non_unicast_refused() {
        for a in ["0.0.0.0", "255.255.255.255", "224.0.0.1", "::", "ff02::1"] {
            let d = internet().decide(None, ip(a), 80);
            assert!(!d.allowed, "{a}");
        }
    }

    #[test]
    fn cidr_parsing_and_contains() {
        let c: Cidr = "10.201.0.0/16".parse().unwrap();
        assert!(c.contains(ip("10.201.255.1")));
        assert!(!c.contains(ip("10.202.0.1")));
        assert!(!c.contains(ip("::1")));
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("nonsense".parse::<Cidr>().is_err());
        assert_eq!("1.2.3.4".parse::<Cidr>().unwrap().prefix, 32);
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("8.8.8.8")));
        let v6: Cidr = "2001:db8::/32".parse().unwrap();
        assert!(v6.contains(ip("2001:db8:1::1")));
    }

    #[test]
    fn serde_round_trip() {
        let p = allow(
            &["*.example.com:443", "api.test"],
            &["10.201.0.0/16"],
            &[443],
        );
        let j = serde_json::to_string(&p).unwrap();
        assert!(j.contains("\"mode\":\"allow\""), "{j}");
        assert_eq!(serde_json::from_str::<NetworkPolicy>(&j).unwrap(), p);
        let bad = r#"{"mode":"allow","hosts":["a b"]}"#;
        assert!(serde_json::from_str::<NetworkPolicy>(bad).is_err());
        let d: NetworkPolicy = serde_json::from_str(r#"{"mode":"deny-all"}"#).unwrap();
        assert_eq!(d, NetworkPolicy::DenyAll);
    }
}
