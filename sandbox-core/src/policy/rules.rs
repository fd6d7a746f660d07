//! What a [`NetworkPolicy`] is written with: host patterns and rules, address ranges and
//! deny rules, parsed from and written as strings.

use std::str::FromStr;

use super::*;

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
    pub(super) fn effective(&self) -> (IpAddr, u8) {
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
