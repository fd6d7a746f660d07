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
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::policy::NetworkPolicy;
use crate::tier::Tier;

/// What a sandbox needs from its enforcer before it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressPlan {
    /// The sandbox id the plan was made for.
    pub sandbox_id: String,
    /// Variables added to every command's environment (`HTTP_PROXY`, `HTTPS_PROXY`,
    /// `ALL_PROXY`, `NO_PROXY` and their lowercase forms).
    pub env: Vec<(String, String)>,
    /// The sandbox's `/etc/resolv.conf`.
    pub resolv_conf: String,
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
