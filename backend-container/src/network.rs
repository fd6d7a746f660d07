//! The sandbox's network namespace: the one place where its network is set up.
//!
//! Every sandbox gets a fresh network namespace (`CLONE_NEWNET` at clone time) in which the
//! init brings `lo` up, and nothing else: no interface, no route, so no packet can leave,
//! whatever the code does (TCP, UDP, ICMP, raw sockets, IPv6, DNS). That is
//! [`NetworkPolicy::DenyAll`], the only policy enforced without a hook.
//!
//! The egress enforcer (allowlists through a host-side proxy) plugs in with a [`NetnsHook`]:
//! it is called once per sandbox after the namespace exists and before the first command
//! runs, with the namespace's path, and again when the sandbox is destroyed.

use std::fmt;
use std::path::PathBuf;

use sandbox_core::NetworkPolicy;

/// What a hook is told about a new sandbox.
#[derive(Debug, Clone)]
pub struct NetnsContext {
    /// The sandbox id.
    pub sandbox_id: String,
    /// Host pid of the sandbox's init (its namespaces are under `/proc/<pid>/ns/`).
    pub init_pid: i32,
    /// `/proc/<pid>/ns/net`: open it and `setns` to configure the namespace.
    pub netns_path: PathBuf,
    /// The policy the sandbox was created with.
    pub policy: NetworkPolicy,
}

/// Extends a sandbox's network namespace (e.g. with a veth pair or a proxy socket).
pub trait NetnsHook: Send + Sync + fmt::Debug {
    /// Whether this hook can enforce `policy` (the backend refuses the spec otherwise).
    fn supports(&self, policy: &NetworkPolicy) -> bool;

    /// The content of the sandbox's `/etc/resolv.conf` for `policy` (`None`: our default,
    /// which names no resolver).
    fn resolv_conf(&self, policy: &NetworkPolicy) -> Option<String> {
        let _ = policy;
        None
    }

    /// Called once the namespace exists with `lo` up, before any command runs.
    fn setup(&self, ctx: &NetnsContext) -> Result<(), String>;

    /// Called when the sandbox is destroyed (its namespace dies with the init).
    fn teardown(&self, sandbox_id: &str) {
        let _ = sandbox_id;
    }
}

/// `/etc/resolv.conf` of a sandbox without a hook.
pub(crate) const DEFAULT_RESOLV_CONF: &str =
    "# agent-sandbox: no network (this namespace has only loopback)\noptions timeout:1 attempts:1\n";
