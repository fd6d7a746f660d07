//! The seam between backends and an egress enforcer.
//!
//! A sandbox whose [`NetworkPolicy`] is anything but [`NetworkPolicy::DenyAll`] needs a path
//! out that only the enforcer controls. Backends know how to make a network namespace for a
//! sandbox; an [`EgressEnforcer`] (the `sandbox-egress` crate provides one) knows how to give
//! that namespace its single route to a policy-checking proxy. The two meet here, so neither
//! depends on the other:
//!
//! 1. [`EgressEnforcer::prepare`] before the sandbox starts: reserves its addresses and says
//!    what the sandbox must be given ([`EgressPlan`]: proxy variables for every command's
//!    environment, the content of its `/etc/resolv.conf`).
//! 2. [`EgressEnforcer::attach`] once the sandbox's network namespace exists and before any
//!    sandboxed code runs (the namespace of a given host pid).
//! 3. [`EgressEnforcer::update`] changes the policy of a running sandbox (next connection);
//!    [`EgressEnforcer::events`] reads its audit log.
//! 4. [`EgressEnforcer::detach`] when the sandbox is destroyed (also after a failed create).

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::policy::NetworkPolicy;
use crate::tier::Tier;

/// What a sandbox needs from its enforcer before it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EgressPlan {
    /// The sandbox id the plan was made for.
    pub sandbox_id: String,
    /// Variables added to every command's environment (`HTTP_PROXY`, `HTTPS_PROXY`,
    /// `ALL_PROXY`, `NO_PROXY` and their lowercase forms).
    pub env: Vec<(String, String)>,
    /// The sandbox's `/etc/resolv.conf`.
    pub resolv_conf: String,
}

impl EgressPlan {
    /// The plan made for `sandbox_id`: `env` added to every command, `resolv_conf` as its
    /// `/etc/resolv.conf`.
    pub fn new(
        sandbox_id: impl Into<String>,
        env: Vec<(String, String)>,
        resolv_conf: impl Into<String>,
    ) -> Self {
        EgressPlan {
            sandbox_id: sandbox_id.into(),
            env,
            resolv_conf: resolv_conf.into(),
        }
    }
}

/// What an enforcer set up for a sandbox's proxy-held secrets
/// ([`EgressEnforcer::bind_secrets`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SecretPlan {
    /// `(variable, placeholder)` pairs for the sandbox's environment.
    pub env: Vec<(String, String)>,
    /// The certificate (PEM) of the CA the proxy intercepts TLS with: what the sandbox's
    /// programs must trust for the bound hosts.
    pub ca_pem: String,
}

impl SecretPlan {
    fn default_empty() -> Self {
        SecretPlan {
            env: Vec::new(),
            ca_pem: String::new(),
        }
    }

    /// A plan of these parts.
    pub fn new(env: Vec<(String, String)>, ca_pem: String) -> Self {
        SecretPlan { env, ca_pem }
    }

    /// The certificates a sandbox whose root is made of `layers` (lowest first; empty: the
    /// host-tools root) trusts with this plan: its root's system bundle
    /// ([`root_ca_bundle`]) with [`ca_pem`](Self::ca_pem) appended. What the backend puts at
    /// [`CA_BUNDLE_PATH`] (and over the system bundle, where the root has one).
    pub fn ca_bundle(&self, layers: &[PathBuf]) -> String {
        let mut out = root_ca_bundle(layers).unwrap_or_default();
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str("# agent-sandbox: the egress proxy's interception CA (proxy-held secrets)\n");
        out.push_str(&self.ca_pem);
        out
    }
}

/// Where a sandbox with proxy-held secrets finds the certificates it trusts (its root's
/// system bundle plus the proxy's interception CA); [`CA_BUNDLE_VARS`] name it.
pub const CA_BUNDLE_PATH: &str = "/etc/agent-sandbox-ca.crt";

/// The system bundle of Debian-family roots (and the host's), relative to the root: OpenSSL's,
/// and so Python's and curl's, default `CAfile` there.
pub const SYSTEM_CA_BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";

/// The variables that point TLS clients at [`CA_BUNDLE_PATH`] when proxy-held secrets are
/// bound: OpenSSL (and Python's `ssl`), `requests`, curl, pip, git, Node.
pub const CA_BUNDLE_VARS: [&str; 6] = [
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "PIP_CERT",
    "GIT_SSL_CAINFO",
    "NODE_EXTRA_CA_CERTS",
];

/// The system bundle ([`SYSTEM_CA_BUNDLE`]) of a root made of `layers` (lowest first): the
/// topmost layer's that has it as a regular file; the host's for a host-tools root (empty
/// `layers`). A layer where the path meets a symbolic link or something other than a
/// directory (a whiteout) hides the layers below: `None`, as for a root without one. Links
/// are never followed (in a layer, they could name any file of the host); bundles of 16 MiB
/// or more are not read.
pub fn root_ca_bundle(layers: &[PathBuf]) -> Option<String> {
    let read = |p: &Path| match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_file() && m.len() < (16 << 20) => std::fs::read_to_string(p).ok(),
        _ => None,
    };
    if layers.is_empty() {
        return read(&Path::new("/").join(SYSTEM_CA_BUNDLE));
    }
    for layer in layers.iter().rev() {
        let mut p = layer.clone();
        let mut parts = SYSTEM_CA_BUNDLE.split('/').peekable();
        while let Some(part) = parts.next() {
            p.push(part);
            match std::fs::symlink_metadata(&p) {
                // Not in this layer: the ones below may have it.
                Err(_) => break,
                Ok(m) if parts.peek().is_none() => return read(&p).filter(|_| m.is_file()),
                Ok(m) if m.is_dir() => continue,
                // A link or a whiteout hides what lies below.
                Ok(_) => return None,
            }
        }
    }
    None
}

/// What a [`NetworkEvent`] had to do with a proxy-held secret
/// ([`SecretExposure::Proxy`](crate::SecretExposure::Proxy)). Names and places only, never a
/// value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum SecretUse {
    /// The placeholder was replaced by the value on the way to a host the secret is bound to.
    Substituted {
        /// The secret's name.
        secret: String,
        /// Where in the request (`header authorization`, `request target`, `body`, ...).
        place: String,
    },
    /// The placeholder was on its way to a host the secret is not bound to: the request was
    /// refused, and something in the sandbox tried to send the credential elsewhere.
    LeakAttempt {
        /// The secret's name.
        secret: String,
        /// Where in the request.
        place: String,
    },
}

/// One decision of an egress enforcer, as a sandbox's caller sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NetworkEvent {
    /// When it was decided.
    pub time: SystemTime,
    /// How the sandbox asked (`http`, `connect`, `transparent-tls`, `dns`, ...).
    pub via: String,
    /// The name asked for (`None` for a bare address).
    pub host: Option<String>,
    /// The address decided on, if any.
    pub ip: Option<IpAddr>,
    /// The destination port (0 for DNS).
    pub port: u16,
    /// Whether the policy allowed it.
    pub allowed: bool,
    /// The rule that decided, in words.
    pub rule: String,
    /// For an allowed destination that could not be reached: why.
    pub error: Option<String>,
    /// A proxy-held secret substituted in the request, or a leak attempt refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<SecretUse>,
}

impl NetworkEvent {
    /// An event with no host, address, error or secret (set those fields as they apply).
    pub fn new(
        time: SystemTime,
        via: impl Into<String>,
        port: u16,
        allowed: bool,
        rule: impl Into<String>,
    ) -> Self {
        NetworkEvent {
            time,
            via: via.into(),
            host: None,
            ip: None,
            port,
            allowed,
            rule: rule.into(),
            error: None,
            secret: None,
        }
    }

    /// Whether the sandbox tried to send a proxy-held secret's placeholder to a host the
    /// secret is not bound to.
    pub fn is_leak_attempt(&self) -> bool {
        matches!(self.secret, Some(SecretUse::LeakAttempt { .. }))
    }
}

impl fmt::Display for NetworkEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dest = match (&self.host, self.ip) {
            (Some(h), Some(ip)) => format!("{h} ({ip})"),
            (Some(h), None) => h.clone(),
            (None, Some(ip)) => ip.to_string(),
            (None, None) => "?".into(),
        };
        let verdict = if self.allowed { "allowed" } else { "denied" };
        write!(
            f,
            "{verdict} {dest}:{} via {}: {}",
            self.port, self.via, self.rule
        )?;
        if let Some(e) = &self.error {
            write!(f, " ({e})")?;
        }
        Ok(())
    }
}

/// Gives sandboxes a policy-checked path out (see the module docs for the protocol).
#[async_trait]
pub trait EgressEnforcer: Send + Sync + fmt::Debug {
    /// Whether `policy` can be enforced here; `Err` says why not and what to do.
    fn check(&self, policy: &NetworkPolicy) -> Result<()>;

    /// Reserves what sandbox `sandbox_id` needs; nothing is set up on the host yet.
    fn prepare(&self, sandbox_id: &str, policy: &NetworkPolicy) -> Result<EgressPlan>;

    /// Connects the network namespace of host process `netns_pid` (which has only `lo`) to
    /// the enforcer, once per prepared sandbox. On error nothing of it is left behind.
    async fn attach(&self, plan: &EgressPlan, netns_pid: i32) -> Result<()>;

    /// Replaces the policy of an attached sandbox; the next connection is decided by it.
    fn update(&self, sandbox_id: &str, policy: &NetworkPolicy) -> Result<()>;

    /// Has the proxy hold `secrets` for a prepared (or attached) sandbox, replacing any it
    /// held before: each gets a fresh placeholder, substituted on the way to its hosts only
    /// ([`SecretExposure::Proxy`](crate::SecretExposure::Proxy)). An empty list revokes
    /// them all. The default refuses: an enforcer without a proxy cannot hold secrets.
    fn bind_secrets(
        &self,
        sandbox_id: &str,
        secrets: &[crate::secrets::ProxiedSecret<'_>],
    ) -> Result<SecretPlan> {
        let _ = sandbox_id;
        match secrets.first() {
            None => Ok(SecretPlan::default_empty()),
            Some(s) => Err(Error::Secret {
                name: s.name.to_owned(),
                reason: "this egress enforcer cannot hold secrets for the sandbox (it has no \
                         proxy that substitutes them)"
                    .into(),
            }),
        }
    }

    /// The latest decisions about an attached sandbox's traffic, oldest first.
    fn events(&self, sandbox_id: &str) -> Result<Vec<NetworkEvent>>;

    /// Removes everything of the sandbox (also a prepared-only one). Idempotent.
    async fn detach(&self, sandbox_id: &str);

    /// Starts [`detach`](Self::detach) without waiting (for synchronous teardown paths such
    /// as `Drop`).
    fn detach_in_background(&self, sandbox_id: &str);
}

/// The enforcer a new sandbox with `policy` needs, for a backend with `plugged` (if any):
/// `None` under deny-all (an empty network namespace is enough), the plugged-in enforcer once
/// it accepts `policy`, else [`Error::Unsupported`] on `tier`.
pub fn enforcer_for(
    tier: Tier,
    plugged: Option<&Arc<dyn EgressEnforcer>>,
    policy: &NetworkPolicy,
) -> Result<Option<Arc<dyn EgressEnforcer>>> {
    if *policy == NetworkPolicy::DenyAll {
        return Ok(None);
    }
    let e = plugged.ok_or_else(|| {
        Error::unsupported(
            tier,
            "network policies other than deny-all (no egress enforcer is plugged in)",
        )
    })?;
    e.check(policy)?;
    Ok(Some(Arc::clone(e)))
}

/// [`Sandbox::set_network_policy`](crate::Sandbox::set_network_policy) for a sandbox on `tier`
/// that is attached to `attached`, or was created with deny-all (`None`: nothing to open).
pub fn update_policy(
    tier: Tier,
    attached: Option<&dyn EgressEnforcer>,
    sandbox_id: &str,
    policy: &NetworkPolicy,
) -> Result<()> {
    match attached {
        Some(e) => e.update(sandbox_id, policy),
        None => Err(Error::unsupported(
            tier,
            "changing the network policy of a sandbox created with deny-all (it has no path \
             out to open; create it with an allowlist, even an empty one)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(root: &Path, name: &str, bundle: Option<&str>) -> PathBuf {
        let l = root.join(name);
        let certs = l.join("etc/ssl/certs");
        std::fs::create_dir_all(&certs).unwrap();
        if let Some(b) = bundle {
            std::fs::write(certs.join("ca-certificates.crt"), b).unwrap();
        }
        l
    }

    #[test]
    fn the_topmost_layer_with_a_bundle_gives_it_and_the_ca_follows() {
        let d = tempfile::tempdir().unwrap();
        let low = layer(d.path(), "0", Some("LOW"));
        let mid = layer(d.path(), "1", Some("MID"));
        let top = layer(d.path(), "2", None);
        assert_eq!(
            root_ca_bundle(&[low.clone(), mid.clone(), top.clone()]).as_deref(),
            Some("MID")
        );
        let plan = SecretPlan::new(Vec::new(), "CA PEM\n".into());
        let b = plan.ca_bundle(&[low, mid, top]);
        assert!(b.starts_with("MID\n# agent-sandbox"), "{b}");
        assert!(b.ends_with("CA PEM\n"), "{b}");
        // No bundle anywhere: the CA alone.
        let bare = d.path().join("bare");
        std::fs::create_dir_all(&bare).unwrap();
        assert_eq!(root_ca_bundle(std::slice::from_ref(&bare)), None);
        assert!(plan.ca_bundle(&[bare]).starts_with("# agent-sandbox"));
    }

    #[test]
    fn links_in_a_layer_are_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("host/ssl/certs");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("ca-certificates.crt"), "HOST FILE").unwrap();
        let low = layer(d.path(), "0", Some("LOW"));
        // The top layer's `etc` points outside: it hides the lower layer and is not read.
        let top = d.path().join("1");
        std::fs::create_dir_all(&top).unwrap();
        std::os::unix::fs::symlink(d.path().join("host"), top.join("etc")).unwrap();
        assert_eq!(root_ca_bundle(&[low.clone(), top]), None);
        // A linked bundle file is not read either.
        let top2 = d.path().join("2");
        std::fs::create_dir_all(top2.join("etc/ssl/certs")).unwrap();
        std::os::unix::fs::symlink(
            outside.join("ca-certificates.crt"),
            top2.join("etc/ssl/certs/ca-certificates.crt"),
        )
        .unwrap();
        assert_eq!(root_ca_bundle(&[low, top2]), None);
    }
}
