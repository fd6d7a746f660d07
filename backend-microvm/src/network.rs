//! A microVM sandbox's network: the guest's virtio-net device on a TAP in a network namespace
//! of the sandbox's own, joined to the egress enforcer's link.
//!
//! For a policy other than deny-all, [`GuestNetwork::attach`]:
//! 1. makes a network namespace for the sandbox (a short-lived thread `unshare`s one; the
//!    namespace lives on through a descriptor held here and the TAP);
//! 2. asks the [`EgressEnforcer`] to attach it, exactly as for a container: the enforcer puts
//!    its veth end in the namespace with the sandbox's address and a default route to the
//!    proxy's address, and polices everything that arrives on the other end (see
//!    `sandbox_egress::netns`);
//! 3. creates a TAP device there and bridges it with the veth end, moving the sandbox's address
//!    to the guest: the namespace itself keeps no address, and the guest's `eth0` (configured by
//!    the agent from `agent.net=`, see [`GuestNetwork::agent_param`]) is the sandbox end of the
//!    link. Its gateway is the proxy's address, which also answers DNS.
//!
//! So the guest meets the same enforcing side as a container's namespace does: its frames leave
//! the namespace only on the enforcer's veth, where the host-side rules redirect TCP to the
//! proxy, UDP 53 to the policy's resolver, and drop the rest. A guest that changes its own
//! address or routes changes nothing there (the host side matches the link, not the address).
//! Deny-all sandboxes get none of this: no namespace, no TAP, no device in the VM.
//!
//! Needs `ip` (iproute2) and `CAP_NET_ADMIN`, as the enforcer does.

use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};
use std::sync::Arc;

use sandbox_core::egress::{EgressEnforcer, EgressPlan};
use sandbox_core::{Error, NetworkPolicy, Result};

use crate::devices::virtio::net::{in_netns, open_tap};
use crate::vmm::NetConfig;
use crate::TIER;

/// The TAP device's name inside the sandbox's namespace.
const TAP: &str = "as-tap0";
/// The bridge joining the TAP and the enforcer's veth end.
const BRIDGE: &str = "as-br0";

/// The guest's IPv4 settings, as the enforcer's link gave them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct GuestAddress {
    /// The guest's address (the sandbox end of the enforcer's link).
    pub addr: Ipv4Addr,
    /// The link's prefix length.
    pub prefix: u8,
    /// The gateway: the proxy's address on the link (also the DNS server).
    pub gateway: Ipv4Addr,
}

/// One sandbox's network: attached to the enforcer until [`detach`](Self::detach) (or drop,
/// which detaches in the background).
pub struct GuestNetwork {
    sandbox_id: String,
    enforcer: Arc<dyn EgressEnforcer>,
    /// Keeps the namespace alive (with the TAP) until the sandbox is gone.
    _netns: File,
    tap: Arc<OwnedFd>,
    mac: [u8; 6],
    address: GuestAddress,
    /// The enforcer's variables for every command (`HTTP_PROXY`, ...).
    env: Vec<(String, String)>,
    detached: bool,
}

impl std::fmt::Debug for GuestNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestNetwork")
            .field("sandbox_id", &self.sandbox_id)
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl GuestNetwork {
    /// Prepares `sandbox_id` with `enforcer` under `policy`, makes the sandbox's namespace,
    /// attaches it and puts a bridged TAP in it for the guest. On error nothing is left: a
    /// sandbox the enforcer prepared is detached again, and the namespace is gone.
    pub async fn attach(
        enforcer: Arc<dyn EgressEnforcer>,
        sandbox_id: &str,
        policy: &NetworkPolicy,
    ) -> Result<Self> {
        let plan = enforcer.prepare(sandbox_id, policy)?;
        match Self::attach_inner(&enforcer, &plan).await {
            Ok((netns, tap, address)) => Ok(GuestNetwork {
                sandbox_id: sandbox_id.to_owned(),
                enforcer,
                _netns: netns,
                tap: Arc::new(tap),
                mac: guest_mac(),
                address,
                env: plan.env,
                detached: false,
            }),
            Err(e) => {
                enforcer.detach(sandbox_id).await;
                Err(e)
            }
        }
    }

    async fn attach_inner(
        enforcer: &Arc<dyn EgressEnforcer>,
        plan: &EgressPlan,
    ) -> Result<(File, OwnedFd, GuestAddress)> {
        // The enforcer moves its link into a namespace by the pid of a task in it: a thread
        // that stays there until the link is in.
        let holder = NetnsThread::new()
            .map_err(|e| Error::io("create the microVM sandbox's network namespace", e))?;
        enforcer.attach(plan, holder.tid).await?;
        let netns = holder.release();
        let ns = netns
            .try_clone()
            .map_err(|e| Error::io("hold the sandbox's network namespace", e))?;
        let (tap, address) = tokio::task::spawn_blocking(move || in_netns(&ns, plumb))
            .await
            .map_err(|e| Error::backend_caused(TIER, "the network set-up task", e))?
            .map_err(|e| Error::io("enter the sandbox's network namespace", e))??;
        Ok((netns, tap, address))
    }

    /// The variables the enforcer gives every command (the proxy's address as `HTTP_PROXY`,
    /// `HTTPS_PROXY`, `ALL_PROXY`, and `NO_PROXY`), and after
    /// [`bind_secrets`](Self::bind_secrets) each proxy-held secret's placeholder and the
    /// variables naming the trusted certificates.
    pub fn env(&self) -> &[(String, String)] {
        &self.env
    }

    /// Hands the proxy-held secrets to the enforcer's proxy (which substitutes them in
    /// requests to their hosts): their variables get placeholders and
    /// [`CA_BUNDLE_VARS`](sandbox_core::egress::CA_BUNDLE_VARS) name
    /// [`CA_BUNDLE_PATH`](sandbox_core::egress::CA_BUNDLE_PATH), all added to
    /// [`env`](Self::env). Returns the proxy's interception CA (PEM), which the guest's TLS
    /// clients must trust: the backend sends it to the agent
    /// ([`AgentClient::trust`](crate::agent_client::AgentClient::trust)), which puts it in the
    /// guest's own bundles (the host cannot read an image's bundle inside its disk).
    pub fn bind_secrets(&mut self, secrets: &[sandbox_core::ProxiedSecret<'_>]) -> Result<String> {
        let plan = self.enforcer.bind_secrets(&self.sandbox_id, secrets)?;
        self.env.extend(plan.env.iter().cloned());
        for var in sandbox_core::egress::CA_BUNDLE_VARS {
            self.env
                .push((var.into(), sandbox_core::egress::CA_BUNDLE_PATH.into()));
        }
        Ok(plan.ca_pem)
    }

    /// The guest's address, prefix and gateway.
    pub fn address(&self) -> GuestAddress {
        self.address
    }

    /// The kernel command-line parameter the guest agent configures `eth0` from
    /// (`agent.net=<addr>/<prefix>,<gateway>`).
    pub fn agent_param(&self) -> String {
        format!("agent.net={}", self.agent_net())
    }

    /// `<addr>/<prefix>,<gateway>`: what `agent.net=` and the agent's `Network` request take.
    pub fn agent_net(&self) -> String {
        let a = self.address;
        format!("{}/{},{}", a.addr, a.prefix, a.gateway)
    }

    /// The same network with the guest's MAC set to `mac`: a guest restored from a snapshot
    /// keeps the MAC its driver read at boot (the VMM refuses another one), while its link,
    /// address and TAP are this network's.
    pub fn with_mac(mut self, mac: [u8; 6]) -> Self {
        self.mac = mac;
        self
    }

    /// The VM's virtio-net device: the TAP and the guest's MAC.
    pub fn device(&self) -> NetConfig {
        NetConfig {
            mac: self.mac,
            fd: Arc::clone(&self.tap),
        }
    }

    /// The TAP's descriptor (for a VMM other than ours, e.g. QEMU in tests).
    pub fn tap(&self) -> &Arc<OwnedFd> {
        &self.tap
    }

    /// The enforcer this sandbox is attached to.
    pub fn enforcer(&self) -> &Arc<dyn EgressEnforcer> {
        &self.enforcer
    }

    /// The sandbox id the enforcer knows this network by.
    pub fn sandbox_id(&self) -> &str {
        &self.sandbox_id
    }

    /// Detaches the sandbox from the enforcer (its link goes; the namespace goes when the VM
    /// has closed the TAP). Idempotent.
    pub async fn detach(&mut self) {
        if !std::mem::replace(&mut self.detached, true) {
            self.enforcer.detach(&self.sandbox_id).await;
        }
    }
}

impl Drop for GuestNetwork {
    fn drop(&mut self) {
        if !self.detached {
            self.enforcer.detach_in_background(&self.sandbox_id);
        }
    }
}

/// A locally administered unicast MAC, random in its other 46 bits.
fn guest_mac() -> [u8; 6] {
    let r = uuid::Uuid::new_v4();
    let b = r.as_bytes();
    [(b[0] & 0xfc) | 0x02, b[1], b[2], b[3], b[4], b[5]]
}

/// A thread parked in a new network namespace until [`release`](Self::release)d.
struct NetnsThread {
    tid: i32,
    ns: File,
    stop: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl NetnsThread {
    fn new() -> io::Result<Self> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("microvm-netns".into())
            .spawn(move || {
                // SAFETY: unshare(CLONE_NEWNET) moves only this thread, which does nothing
                // else and ends when released.
                let r = if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                    Err(io::Error::last_os_error())
                } else {
                    // SAFETY: gettid has no preconditions.
                    let tid = unsafe { libc::gettid() };
                    File::open("/proc/thread-self/ns/net").map(|f| (tid, f))
                };
                let ok = r.is_ok();
                let _ = ready_tx.send(r);
                if ok {
                    // Until released (or the holder is dropped).
                    let _ = stop_rx.recv();
                }
            })?;
        let (tid, ns) = ready_rx
            .recv()
            .map_err(|_| io::Error::other("the namespace thread ended early"))??;
        Ok(NetnsThread {
            tid,
            ns,
            stop,
            thread,
        })
    }

    /// Ends the thread; the namespace lives on through the returned descriptor.
    fn release(self) -> File {
        let _ = self.stop.send(());
        let _ = self.thread.join();
        self.ns
    }
}

/// In the sandbox's namespace: reads the link the enforcer made, creates the TAP and bridges
/// the two, the address moving to the guest.
fn plumb() -> Result<(OwnedFd, GuestAddress)> {
    let addrs = ip(&["-o", "-4", "addr", "show", "scope", "global"], None)?;
    let routes = ip(&["-4", "route", "show", "default"], None)?;
    let (link, address) = parse_link(&addrs, &routes).ok_or_else(|| {
        Error::backend(
            TIER,
            format!(
                "the egress enforcer's link was not found in the sandbox's namespace \
                 (addresses: {:?}, routes: {:?})",
                addrs.trim(),
                routes.trim()
            ),
        )
    })?;
    let (tap, name) = open_tap(TAP).map_err(|e| Error::io("create the guest's TAP device", e))?;
    let script = format!(
        "link add {BRIDGE} type bridge forward_delay 0\n\
         addr flush dev {link}\n\
         link set {link} master {BRIDGE}\n\
         link set {name} master {BRIDGE}\n\
         link set {name} up\n\
         link set {BRIDGE} up\n"
    );
    ip(&["-batch", "-"], Some(&script))?;
    Ok((tap, address))
}

/// Runs `ip args` (with `stdin`) in the current thread's namespace; its stdout.
fn ip(args: &[&str], stdin: Option<&str>) -> Result<String> {
    use std::io::Write;
    let what = || format!("ip {}", args.join(" "));
    let mut child = Command::new("ip")
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("run `{}` (is iproute2 installed?)", what()), e))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .map_err(|e| Error::io(format!("write to `{}`", what()), e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::io(format!("wait for `{}`", what()), e))?;
    if !out.status.success() {
        return Err(Error::backend(
            TIER,
            format!(
                "network set-up: `{}` failed ({}): {}",
                what(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The link (its name) and addresses from `ip -o -4 addr show scope global` and
/// `ip -4 route show default`: the one interface with a global IPv4 address, and the default
/// route's gateway through it.
fn parse_link(addrs: &str, routes: &str) -> Option<(String, GuestAddress)> {
    let mut found = None;
    for line in addrs.lines() {
        let mut w = line.split_whitespace();
        let name = w.nth(1)?.trim_end_matches(':');
        let name = name.split('@').next()?.to_string();
        let cidr = w.skip_while(|t| *t != "inet").nth(1)?;
        let (a, p) = cidr.split_once('/')?;
        if found.is_some() {
            // More than one: not the namespace the enforcer made.
            return None;
        }
        found = Some((name, a.parse::<Ipv4Addr>().ok()?, p.parse::<u8>().ok()?));
    }
    let (name, addr, prefix) = found?;
    let gateway = routes.lines().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        let via = w.iter().position(|t| *t == "via")?;
        let dev = w.iter().position(|t| *t == "dev")?;
        (w.get(dev + 1) == Some(&name.as_str()))
            .then(|| w.get(via + 1)?.parse::<Ipv4Addr>().ok())
            .flatten()
    })?;
    Some((
        name,
        GuestAddress {
            addr,
            prefix,
            gateway,
        },
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// The guest agent (std only) keeps its own copies of the bundle paths and the line
    /// before the CA; they must be the other tiers', which the variables name.
    #[test]
    fn the_agents_bundle_paths_and_mark_are_the_other_tiers() {
        use crate::agent_client::proto::{CA_BUNDLE, CA_MARK, SYSTEM_BUNDLE};
        use sandbox_core::egress::{SecretPlan, CA_BUNDLE_PATH, SYSTEM_CA_BUNDLE};
        assert_eq!(format!("/{CA_BUNDLE}"), CA_BUNDLE_PATH);
        assert_eq!(SYSTEM_BUNDLE, SYSTEM_CA_BUNDLE);
        let bundle = SecretPlan::new(Vec::new(), "PEM\n".into()).ca_bundle(&[]);
        assert!(bundle.contains(&format!("{CA_MARK}PEM\n")), "{bundle}");
    }

    #[test]
    fn the_enforcers_link_is_read_from_ip() {
        let addrs = "2: as-s3@if4    inet 10.200.0.14/30 scope global as-s3\\       valid_lft forever preferred_lft forever\n";
        let routes = "default via 10.200.0.13 dev as-s3 \n";
        let (name, a) = parse_link(addrs, routes).unwrap();
        assert_eq!(name, "as-s3");
        assert_eq!(
            a,
            GuestAddress {
                addr: "10.200.0.14".parse().unwrap(),
                prefix: 30,
                gateway: "10.200.0.13".parse().unwrap(),
            }
        );
        // No link, two links, a route through another device: not the enforcer's namespace.
        assert!(parse_link("", routes).is_none());
        let two = format!("{addrs}3: x    inet 10.9.0.1/24 scope global x\n");
        assert!(parse_link(&two, routes).is_none());
        assert!(parse_link(addrs, "default via 10.200.0.13 dev other\n").is_none());
        assert!(parse_link(addrs, "").is_none());
    }

    #[test]
    fn guest_macs_are_local_unicast_and_differ() {
        let (a, b) = (guest_mac(), guest_mac());
        assert_eq!(a[0] & 0x03, 0x02, "{a:02x?}");
        assert_ne!(a, b);
    }
}
