//! [`VethEnforcer`]: the ready-made [`EgressEnforcer`] the container and gVisor tiers use.
//!
//! One enforcer per process holds:
//! - a private **egress network namespace**, created when the enforcer is built and held only
//!   by an open descriptor: nothing in it is visible from the host's namespace, and when the
//!   process exits (even by a crash) the kernel destroys it with every veth end and nftables
//!   table in it — nothing can be left behind on the host;
//! - one [`EgressProxy`] running on the enforcer's own tokio runtime (so sandboxes created
//!   from any runtime, or none, share it). Its per-sandbox listeners are bound inside the
//!   egress namespace; its upstream connections are made from the process's own namespace;
//! - a pool of `/30` links in `10.200.0.0/16` (16384 at once).
//!
//! [`attach`](EgressEnforcer::attach) gives a sandbox's namespace one veth link to the egress
//! namespace ([`VethConfig`]: the sandbox end is its only route; on the egress side every TCP
//! connection that is not for the explicit proxy is redirected to the transparent listener,
//! UDP 53 to the DNS responder, everything else dropped, nothing forwarded), then registers
//! the sandbox with the proxy on sockets bound to the link's host address:
//! `HOST:3128` explicit HTTP/CONNECT proxy, `HOST:3129` transparent, `HOST:5353` DNS.
//! Code that honours `HTTP_PROXY` uses the proxy; code that ignores it is captured
//! transparently; nothing else leaves.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use sandbox_core::{
    EgressEnforcer, EgressPlan, Error, NetworkEvent, NetworkPolicy, ProxiedSecret, Result,
    SecretPlan, SecretUse,
};
use tokio::runtime::Runtime;

use crate::net::{Dialer, Resolver};
use crate::netns::{shared_host_ruleset, Netns, SoOriginalDst, VethConfig};
use crate::proxy::{EgressProxy, ProxyConfig, Sockets};
use crate::{AuditEntry, AuditRule};

/// Port of the explicit HTTP/CONNECT proxy on each link's host address.
pub const PROXY_PORT: u16 = 3128;
/// Port of the transparent listener on each link's host address.
pub const TRANSPARENT_PORT: u16 = 3129;
/// Port of the DNS responder on each link's host address (UDP 53 is redirected to it).
pub const DNS_PORT: u16 = 5353;
/// How many links (sandboxes) one enforcer can hold at once: the `/30`s of a `/16`.
pub const MAX_LINKS: u32 = 16384;
/// The one nftables table of the egress namespace (see [`shared_host_ruleset`]).
pub const EGRESS_TABLE: &str = "agent_sandbox_egress";
/// Host ends are named `<prefix><slot>h`, sandbox ends `<prefix><slot>s`.
const LINK_PREFIX: &str = "eg";

/// Builds a [`VethEnforcer`].
#[derive(Debug)]
pub struct VethEnforcerBuilder {
    config: ProxyConfig,
    resolver: Option<Arc<dyn Resolver>>,
    dialer: Option<Arc<dyn Dialer>>,
    base: Ipv4Addr,
}

impl Default for VethEnforcerBuilder {
    fn default() -> Self {
        VethEnforcerBuilder {
            config: ProxyConfig::default(),
            resolver: None,
            dialer: None,
            base: Ipv4Addr::new(10, 200, 0, 0),
        }
    }
}

impl VethEnforcerBuilder {
    /// Proxy tunables (its `listen_ip` is ignored: listeners bind to each link's address).
    pub fn config(mut self, config: ProxyConfig) -> Self {
        self.config = config;
        self
    }

    /// The host-side resolver (default: the system's).
    pub fn resolver(mut self, r: Arc<dyn Resolver>) -> Self {
        self.resolver = Some(r);
        self
    }

    /// How the proxy connects upstream (default: plain TCP from this process's namespace).
    pub fn dialer(mut self, d: Arc<dyn Dialer>) -> Self {
        self.dialer = Some(d);
        self
    }

    /// The `/16` the links are carved from (default `10.200.0.0`; only the first two octets
    /// count). The addresses exist only inside the egress and sandbox namespaces.
    pub fn link_network(mut self, base: Ipv4Addr) -> Self {
        self.base = base;
        self
    }

    /// Creates the egress namespace and starts the proxy's runtime. Fails with
    /// [`Error::Unavailable`]-style reasons when the host cannot do it (not root, `ip`,
    /// `nft` or `nsenter` missing).
    pub fn build(self) -> Result<VethEnforcer> {
        host_ready().map_err(|(reason, fix)| Error::Unavailable {
            tier: sandbox_core::Tier::Container,
            reason: format!("egress enforcer: {reason}"),
            fix,
        })?;
        let ns = EgressNs::new()?;
        Netns::Path(ns.path.clone()).output_blocking(
            "nft",
            &["-f", "-"],
            Some(&shared_host_ruleset(
                EGRESS_TABLE,
                LINK_PREFIX,
                PROXY_PORT,
                TRANSPARENT_PORT,
                DNS_PORT,
            )),
        )?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("agent-sandbox-egress")
            .enable_all()
            .build()
            .map_err(|e| Error::io("egress enforcer: start its runtime", e))?;
        let mut b = EgressProxy::builder()
            .config(self.config)
            .original_dst(Arc::new(SoOriginalDst));
        if let Some(r) = self.resolver {
            b = b.resolver(r);
        }
        if let Some(d) = self.dialer {
            b = b.dialer(d);
        }
        // The proxy's tasks must live on the enforcer's runtime.
        let proxy = {
            let _guard = rt.enter();
            b.build()
        };
        let [a, b2, ..] = self.base.octets();
        Ok(VethEnforcer {
            inner: Arc::new(Inner {
                rt: Mutex::new(Some(rt)),
                proxy,
                ns,
                net: [a, b2],
                state: Mutex::new(State::default()),
            }),
        })
    }
}

/// Whether this host can run the enforcer: `Err((reason, fix))` if not.
fn host_ready() -> std::result::Result<(), (String, String)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err((
            "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces and veth links".into(),
            "run as root, or use NetworkPolicy::DenyAll".into(),
        ));
    }
    for tool in ["ip", "nft", "nsenter"] {
        if which(tool).is_none() {
            return Err((
                format!("`{tool}` is not installed"),
                "apt-get install iproute2 nftables util-linux".into(),
            ));
        }
    }
    Ok(())
}

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// The private egress namespace, alive as long as its descriptor is open.
struct EgressNs {
    file: File,
    /// `/proc/<our pid>/fd/<n>`: how `nsenter` (a child process) names it.
    path: PathBuf,
}

impl fmt::Debug for EgressNs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EgressNs")
            .field("path", &self.path)
            .finish()
    }
}

impl EgressNs {
    fn new() -> Result<Self> {
        let file = std::thread::spawn(|| -> std::io::Result<File> {
            // SAFETY: unshare(CLONE_NEWNET) moves only this short-lived thread into a new
            // namespace; no memory is involved.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            File::open("/proc/thread-self/ns/net")
        })
        .join()
        .map_err(|_| {
            Error::backend(
                sandbox_core::Tier::Container,
                "egress namespace thread panicked",
            )
        })?
        .map_err(|e| Error::io("egress enforcer: create its network namespace", e))?;
        let path = PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            file.as_raw_fd()
        ));
        Ok(EgressNs { file, path })
    }

    /// Binds the proxy's sockets on `ip` inside the egress namespace.
    fn bind(&self, ip: Ipv4Addr) -> Result<Sockets> {
        let ns = self
            .file
            .try_clone()
            .map_err(|e| Error::io("egress enforcer: duplicate the namespace descriptor", e))?;
        std::thread::spawn(move || -> std::io::Result<Sockets> {
            // SAFETY: setns on this short-lived thread only; `ns` is an open netns file.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let at = |p: u16| SocketAddr::new(IpAddr::V4(ip), p);
            Ok(Sockets {
                proxy: std::net::TcpListener::bind(at(PROXY_PORT))?,
                transparent: Some(std::net::TcpListener::bind(at(TRANSPARENT_PORT))?),
                dns: Some(std::net::UdpSocket::bind(at(DNS_PORT))?),
            })
        })
        .join()
        .map_err(|_| Error::backend(sandbox_core::Tier::Container, "egress bind thread panicked"))?
        .map_err(|e| Error::io(format!("egress enforcer: bind the proxy on {ip}"), e))
    }
}

#[derive(Debug, Default)]
struct State {
    /// Slots in use.
    used: BTreeSet<u32>,
    /// Prepared or attached sandboxes.
    sandboxes: HashMap<String, Entry>,
}

#[derive(Debug, Clone)]
struct Entry {
    veth: VethConfig,
    slot: u32,
    policy: NetworkPolicy,
    /// Proxy-held secrets ([`EgressEnforcer::bind_secrets`]), handed to the proxy once
    /// registered.
    secrets: crate::secrets::SecretSet,
    /// Registered with the proxy (its listeners are open).
    registered: bool,
}

struct Inner {
    rt: Mutex<Option<Runtime>>,
    proxy: EgressProxy,
    ns: EgressNs,
    net: [u8; 2],
    state: Mutex<State>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Dropping a runtime inside another runtime panics: let it wind down in the background.
        if let Some(rt) = self.rt.lock().unwrap_or_else(|p| p.into_inner()).take() {
            rt.shutdown_background();
        }
    }
}

/// The veth + nftables egress enforcer (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct VethEnforcer {
    inner: Arc<Inner>,
}

impl fmt::Debug for VethEnforcer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self
            .inner
            .state
            .lock()
            .map(|s| s.sandboxes.len())
            .unwrap_or(0);
        f.debug_struct("VethEnforcer")
            .field("egress_netns", &self.inner.ns)
            .field("sandboxes", &n)
            .finish()
    }
}

impl VethEnforcer {
    /// A builder (system resolver, TCP dialer, links in `10.200.0.0/16`).
    pub fn builder() -> VethEnforcerBuilder {
        VethEnforcerBuilder::default()
    }

    /// The proxy behind the enforcer (audit logs, policies by sandbox id).
    pub fn proxy(&self) -> &EgressProxy {
        &self.inner.proxy
    }

    /// The interfaces present in the egress namespace other than `lo` (for leak checks).
    pub async fn links(&self) -> Result<Vec<String>> {
        let out = self
            .inner
            .host()
            .output("ip", &["-o", "link", "show"], None)
            .await?;
        let text = String::from_utf8_lossy(&out);
        Ok(text
            .lines()
            .filter_map(|l| l.split(':').nth(1))
            .map(|n| n.trim().split('@').next().unwrap_or("").to_string())
            .filter(|n| !n.is_empty() && n != "lo")
            .collect())
    }

    /// The nftables tables present in the egress namespace (one, [`EGRESS_TABLE`], shared by
    /// every link; for leak checks).
    pub async fn tables(&self) -> Result<Vec<String>> {
        let out = self
            .inner
            .host()
            .output("nft", &["list", "tables"], None)
            .await?;
        Ok(String::from_utf8_lossy(&out)
            .lines()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect())
    }

    fn link(&self, slot: u32) -> VethConfig {
        let [a, b] = self.inner.net;
        let (c, d) = ((slot / 64) as u8, ((slot % 64) * 4) as u8);
        VethConfig {
            host_if: format!("{LINK_PREFIX}{slot}h"),
            sandbox_if: format!("{LINK_PREFIX}{slot}s"),
            host_ip: Ipv4Addr::new(a, b, c, d + 1),
            sandbox_ip: Ipv4Addr::new(a, b, c, d + 2),
            prefix: 30,
            proxy_port: PROXY_PORT,
            transparent_port: Some(TRANSPARENT_PORT),
            dns_port: Some(DNS_PORT),
        }
    }

    /// Runs `fut` on the enforcer's runtime and waits for it from any context.
    async fn on_runtime<T, F>(&self, fut: F) -> Result<T>
    where
        F: std::future::Future<Output = Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let handle = {
            let rt = self.inner.rt.lock().unwrap_or_else(|p| p.into_inner());
            match rt.as_ref() {
                Some(rt) => rt.handle().clone(),
                None => {
                    return Err(Error::backend(
                        sandbox_core::Tier::Container,
                        "the egress enforcer is shut down",
                    ))
                }
            }
        };
        handle.spawn(fut).await.map_err(|e| {
            Error::backend_caused(
                sandbox_core::Tier::Container,
                "running the egress enforcer's task",
                e,
            )
        })?
    }
}

/// An audit entry as the caller sees it.
pub fn network_event(e: &AuditEntry) -> NetworkEvent {
    let mut ev = NetworkEvent::new(e.time, e.via.name(), e.port, e.allowed, e.rule.to_string());
    ev.host = e.host.clone();
    ev.ip = e.ip;
    ev.error = e.error.clone();
    ev.secret = match &e.rule {
        AuditRule::SecretSubstituted { secret, place } => Some(SecretUse::Substituted {
            secret: secret.clone(),
            place: place.clone(),
        }),
        AuditRule::SecretLeakAttempt { secret, place } => Some(SecretUse::LeakAttempt {
            secret: secret.clone(),
            place: place.clone(),
        }),
        _ => None,
    };
    ev
}

#[async_trait]
impl EgressEnforcer for VethEnforcer {
    fn check(&self, policy: &NetworkPolicy) -> Result<()> {
        policy.validate()
    }

    fn prepare(&self, sandbox_id: &str, policy: &NetworkPolicy) -> Result<EgressPlan> {
        policy.validate()?;
        let veth = {
            let mut st = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
            if st.sandboxes.contains_key(sandbox_id) {
                return Err(Error::invalid(
                    "sandbox_id",
                    format!("{sandbox_id} is already attached to the egress enforcer"),
                ));
            }
            let slot = (0..MAX_LINKS)
                .find(|s| !st.used.contains(s))
                .ok_or_else(|| Error::ResourceExhausted {
                    what: format!("egress links ({MAX_LINKS} sandboxes with network at once)"),
                })?;
            st.used.insert(slot);
            let veth = self.link(slot);
            st.sandboxes.insert(
                sandbox_id.to_string(),
                Entry {
                    veth: veth.clone(),
                    slot,
                    policy: policy.clone(),
                    secrets: crate::secrets::SecretSet::default(),
                    registered: false,
                },
            );
            veth
        };
        let proxy = format!("http://{}:{PROXY_PORT}", veth.host_ip);
        let mut env = Vec::new();
        for k in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"] {
            env.push((k.to_string(), proxy.clone()));
            env.push((k.to_ascii_lowercase(), proxy.clone()));
        }
        let no = "localhost,127.0.0.1,::1".to_string();
        env.push(("NO_PROXY".into(), no.clone()));
        env.push(("no_proxy".into(), no));
        Ok(EgressPlan::new(
            sandbox_id,
            env,
            format!(
                "# agent-sandbox: names are resolved by the egress proxy (only allowed names answer)\nnameserver {}\noptions timeout:2 attempts:2\n",
                veth.host_ip
            ),
        ))
    }

    async fn attach(&self, plan: &EgressPlan, netns_pid: i32) -> Result<()> {
        let inner = self.inner.clone();
        let id = plan.sandbox_id.clone();
        self.on_runtime(attach(inner, id, netns_pid)).await
    }

    fn update(&self, sandbox_id: &str, policy: &NetworkPolicy) -> Result<()> {
        policy.validate()?;
        let mut st = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        let Some(e) = st.sandboxes.get_mut(sandbox_id) else {
            return Err(Error::SandboxGone {
                id: sandbox_id.to_string(),
                reason: "not attached to the egress enforcer".into(),
            });
        };
        e.policy = policy.clone();
        if e.registered {
            self.inner.proxy.update_policy(sandbox_id, policy.clone())?;
        }
        Ok(())
    }

    fn bind_secrets(&self, sandbox_id: &str, secrets: &[ProxiedSecret<'_>]) -> Result<SecretPlan> {
        let mut held = Vec::with_capacity(secrets.len());
        let mut env = Vec::with_capacity(secrets.len());
        for s in secrets {
            let p = crate::secrets::ProxySecret::new(s.name, s.value.clone(), s.hosts.to_vec())
                .map_err(|e| Error::Secret {
                    name: s.name.to_owned(),
                    reason: e.to_string(),
                })?
                .substitute_in(s.substitute_in);
            env.push((s.var.to_owned(), p.placeholder().to_owned()));
            held.push(p);
        }
        let ca_pem = if held.is_empty() {
            String::new()
        } else {
            self.inner.proxy.interception_ca_pem()?
        };
        let set = crate::secrets::SecretSet::new(held);
        let mut st = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        let Some(e) = st.sandboxes.get_mut(sandbox_id) else {
            return Err(Error::SandboxGone {
                id: sandbox_id.to_string(),
                reason: "not prepared with the egress enforcer".into(),
            });
        };
        e.secrets = set.clone();
        if e.registered {
            self.inner.proxy.set_secrets(sandbox_id, set)?;
        }
        Ok(SecretPlan::new(env, ca_pem))
    }

    fn events(&self, sandbox_id: &str) -> Result<Vec<NetworkEvent>> {
        let registered = self.inner.entry(sandbox_id).is_some_and(|e| e.registered);
        if !registered {
            return Ok(Vec::new());
        }
        Ok(self
            .inner
            .proxy
            .audit(sandbox_id)?
            .iter()
            .map(network_event)
            .collect())
    }

    async fn detach(&self, sandbox_id: &str) {
        let inner = self.inner.clone();
        let id = sandbox_id.to_string();
        let _ = self
            .on_runtime(async move {
                detach(inner, id).await;
                Ok(())
            })
            .await;
    }

    fn detach_in_background(&self, sandbox_id: &str) {
        let rt = self.inner.rt.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rt) = rt.as_ref() {
            rt.spawn(detach(self.inner.clone(), sandbox_id.to_string()));
        }
    }
}

impl Inner {
    fn entry(&self, id: &str) -> Option<Entry> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.sandboxes.get(id).cloned()
    }

    fn host(&self) -> Netns {
        Netns::Path(self.ns.path.clone())
    }
}

/// [`EgressEnforcer::attach`], on the enforcer's runtime.
async fn attach(inner: Arc<Inner>, id: String, netns_pid: i32) -> Result<()> {
    let entry = inner.entry(&id).ok_or_else(|| {
        Error::invalid(
            "sandbox_id",
            format!("{id} was not prepared with the egress enforcer"),
        )
    })?;
    let host = inner.host();
    if entry.registered {
        return Err(Error::invalid(
            "sandbox_id",
            format!("{id} is already attached to the egress enforcer"),
        ));
    }
    entry.veth.setup_link(&host, &Netns::Pid(netns_pid)).await?;
    let registered = match inner.ns.bind(entry.veth.host_ip) {
        Ok(sockets) => inner
            .proxy
            .register_with_sockets(&id, entry.policy.clone(), sockets)
            .await
            .map(|_| ()),
        Err(e) => Err(e),
    };
    if let Err(e) = registered {
        entry.veth.teardown_link(&host).await;
        return Err(e);
    }
    let still_there = {
        let mut st = inner.state.lock().unwrap_or_else(|p| p.into_inner());
        st.sandboxes
            .get_mut(&id)
            .map(|e| {
                e.registered = true;
                // Secrets bound before the listeners existed.
                if !e.secrets.is_empty() {
                    let _ = inner.proxy.set_secrets(&id, e.secrets.clone());
                }
            })
            .is_some()
    };
    if !still_there {
        // Detached while attaching: undo.
        let _ = inner.proxy.unregister(&id).await;
        entry.veth.teardown_link(&host).await;
        return Err(Error::SandboxGone {
            id,
            reason: "detached from the egress enforcer while attaching".into(),
        });
    }
    Ok(())
}

/// [`EgressEnforcer::detach`], on the enforcer's runtime.
async fn detach(inner: Arc<Inner>, id: String) {
    let entry = {
        let mut st = inner.state.lock().unwrap_or_else(|p| p.into_inner());
        st.sandboxes.remove(&id)
    };
    let Some(entry) = entry else { return };
    if entry.registered {
        let _ = inner.proxy.unregister(&id).await;
    }
    entry.veth.teardown_link(&inner.host()).await;
    let mut st = inner.state.lock().unwrap_or_else(|p| p.into_inner());
    st.used.remove(&entry.slot);
}

/// An enforcer built on first use (so a process that never asks for network pays nothing),
/// shared by every backend of the process: see [`shared`].
#[derive(Debug, Default)]
pub struct LazyEnforcer {
    /// The enforcer, or why it could not be built (kept typed and shared: every later
    /// caller gets the same cause).
    cell: std::sync::OnceLock<std::result::Result<VethEnforcer, Arc<Error>>>,
}

impl LazyEnforcer {
    fn get(&self) -> Result<&VethEnforcer> {
        let built = self
            .cell
            .get_or_init(|| VethEnforcer::builder().build().map_err(Arc::new));
        built.as_ref().map_err(|cause| {
            // `InvalidSpec` carries no source: the cause's text is part of the reason.
            let why = match &**cause {
                Error::Unavailable { reason, fix, .. } => format!("{reason} (fix: {fix})"),
                other => other.to_string(),
            };
            Error::invalid(
                "network",
                format!("this host cannot enforce network policies other than deny-all: {why}"),
            )
        })
    }
}

#[async_trait]
impl EgressEnforcer for LazyEnforcer {
    fn check(&self, policy: &NetworkPolicy) -> Result<()> {
        self.get()?.check(policy)
    }

    fn prepare(&self, sandbox_id: &str, policy: &NetworkPolicy) -> Result<EgressPlan> {
        self.get()?.prepare(sandbox_id, policy)
    }

    async fn attach(&self, plan: &EgressPlan, netns_pid: i32) -> Result<()> {
        self.get()?.attach(plan, netns_pid).await
    }

    fn update(&self, sandbox_id: &str, policy: &NetworkPolicy) -> Result<()> {
        self.get()?.update(sandbox_id, policy)
    }

    fn bind_secrets(&self, sandbox_id: &str, secrets: &[ProxiedSecret<'_>]) -> Result<SecretPlan> {
        self.get()?.bind_secrets(sandbox_id, secrets)
    }

    fn events(&self, sandbox_id: &str) -> Result<Vec<NetworkEvent>> {
        self.get()?.events(sandbox_id)
    }

    async fn detach(&self, sandbox_id: &str) {
        if let Some(Ok(e)) = self.cell.get() {
            e.detach(sandbox_id).await;
        }
    }

    fn detach_in_background(&self, sandbox_id: &str) {
        if let Some(Ok(e)) = self.cell.get() {
            e.detach_in_background(sandbox_id);
        }
    }
}

/// The process-wide enforcer (system resolver, TCP dialer, links in `10.200.0.0/16`), built
/// on first use. Backends made by the `agent-sandbox` facade share it.
pub fn shared() -> Arc<dyn EgressEnforcer> {
    static ONE: std::sync::OnceLock<Arc<LazyEnforcer>> = std::sync::OnceLock::new();
    ONE.get_or_init(|| Arc::new(LazyEnforcer::default()))
        .clone()
}
