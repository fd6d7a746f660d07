//! The sandbox's network namespace: the one place where its network is set up.
//!
//! Every sandbox gets a fresh network namespace (`CLONE_NEWNET` at clone time) in which the
//! init brings `lo` up, and nothing else: no interface, no route, so no packet can leave,
//! whatever the code does (TCP, UDP, ICMP, raw sockets, IPv6, DNS). That is
//! [`NetworkPolicy::DenyAll`](sandbox_core::NetworkPolicy), enforced by the kernel alone.
//!
//! Any other policy needs an [`EgressEnforcer`](sandbox_core::EgressEnforcer) plugged in with
//! [`ContainerBuilder::egress`](crate::ContainerBuilder::egress) (`sandbox-egress`'s
//! `VethEnforcer` is the one the facade uses). The backend then:
//! 1. asks the enforcer to `prepare` the sandbox before its init starts: the plan's
//!    `/etc/resolv.conf` goes into the rootfs plan, its proxy variables into every command's
//!    environment;
//! 2. `attach`es the new namespace (by the init's pid) before any command runs: the enforcer
//!    gives it one veth link whose only destination is the egress proxy (everything else is
//!    redirected to the proxy or dropped on the far side, out of the sandbox's reach);
//! 3. forwards [`Sandbox::set_network_policy`](sandbox_core::Sandbox::set_network_policy) and
//!    [`Sandbox::network_events`](sandbox_core::Sandbox::network_events) to it;
//! 4. `detach`es on destroy (and in the background when a sandbox is dropped).

/// `/etc/resolv.conf` of a sandbox without network.
pub(crate) const DEFAULT_RESOLV_CONF: &str =
    "# agent-sandbox: no network (this namespace has only loopback)\noptions timeout:1 attempts:1\n";
