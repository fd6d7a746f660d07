//! The egress proxy: per-sandbox listeners, policies and audit logs.
//!
//! This module holds the proxy's configuration, its builder and the per-sandbox registry;
//! [`conn`] serves connections, [`decide`] decides their destinations and opens them
//! upstream, [`dns_responder`] answers DNS queries.

mod conn;
mod decide;
mod dns_responder;
mod intercept;

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, SystemTime};

use sandbox_core::{DecisionRule, Error, NetworkPolicy};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use crate::audit::{AuditEntry, AuditRing, AuditRule, Via};
use crate::dns::{self, Rcode};
use crate::http::{self, Dest, HeadParse};
use crate::intercept::{InterceptCa, InterceptError};
use crate::net::{Dialer, Resolver, SystemResolver, TcpDialer, UpstreamStream};
use crate::secrets::SecretSet;
use crate::tls::{self, ClientHelloSniff};

use conn::{accept_loop, guarded};
use dns_responder::dns_loop;

/// Tunables of an [`EgressProxy`]. The defaults suit a host serving a few hundred sandboxes.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ProxyConfig {
    /// Address the per-sandbox listeners bind to unless [`ListenOptions::ip`] says otherwise.
    pub listen_ip: IpAddr,
    /// Largest HTTP request head (and sniffed prefix) read before deciding.
    pub max_head_bytes: usize,
    /// How long a client may take to send its request head / CONNECT line.
    pub head_timeout: Duration,
    /// Transparent mode: how long to wait for client-first bytes (HTTP or TLS) before deciding
    /// by address (server-speaks-first protocols such as SSH or SMTP).
    pub sniff_timeout: Duration,
    /// Host-side resolution timeout.
    pub resolve_timeout: Duration,
    /// Upstream connect timeout (per address).
    pub connect_timeout: Duration,
    /// Entries kept per sandbox in the audit ring.
    pub audit_capacity: usize,
    /// Concurrent connections (and DNS queries in flight) per sandbox; more are dropped.
    pub max_connections_per_sandbox: usize,
    /// Refuse TLS ClientHellos that offer Encrypted Client Hello (the SNI is then only the
    /// front's public name). Default `true`.
    pub refuse_ech: bool,
    /// TTL of the DNS responder's answers, in seconds.
    pub dns_ttl: u32,
    /// Request bodies up to this size, to a host with a proxy-held secret, are buffered and
    /// have placeholders replaced; larger ones stream through unchanged. Default 1 MiB.
    pub max_substituted_body: usize,
    /// Roots trusted for the real servers of intercepted connections, besides the host's
    /// store (a private CA; tests' CAs).
    pub upstream_roots: Vec<rustls::pki_types::CertificateDer<'static>>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            listen_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            max_head_bytes: 64 * 1024,
            head_timeout: Duration::from_secs(10),
            sniff_timeout: Duration::from_secs(2),
            resolve_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            audit_capacity: 1024,
            max_connections_per_sandbox: 256,
            refuse_ech: true,
            dns_ttl: 5,
            max_substituted_body: 1 << 20,
            upstream_roots: Vec::new(),
        }
    }
}

impl ProxyConfig {
    /// Sets [`ProxyConfig::listen_ip`].
    pub fn listen_ip(mut self, listen_ip: IpAddr) -> Self {
        self.listen_ip = listen_ip;
        self
    }

    /// Sets [`ProxyConfig::max_head_bytes`].
    pub fn max_head_bytes(mut self, max_head_bytes: usize) -> Self {
        self.max_head_bytes = max_head_bytes;
        self
    }

    /// Sets [`ProxyConfig::head_timeout`].
    pub fn head_timeout(mut self, head_timeout: Duration) -> Self {
        self.head_timeout = head_timeout;
        self
    }

    /// Sets [`ProxyConfig::sniff_timeout`].
    pub fn sniff_timeout(mut self, sniff_timeout: Duration) -> Self {
        self.sniff_timeout = sniff_timeout;
        self
    }

    /// Sets [`ProxyConfig::resolve_timeout`].
    pub fn resolve_timeout(mut self, resolve_timeout: Duration) -> Self {
        self.resolve_timeout = resolve_timeout;
        self
    }

    /// Sets [`ProxyConfig::connect_timeout`].
    pub fn connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }

    /// Sets [`ProxyConfig::audit_capacity`].
    pub fn audit_capacity(mut self, audit_capacity: usize) -> Self {
        self.audit_capacity = audit_capacity;
        self
    }

    /// Sets [`ProxyConfig::max_connections_per_sandbox`].
    pub fn max_connections_per_sandbox(mut self, max_connections_per_sandbox: usize) -> Self {
        self.max_connections_per_sandbox = max_connections_per_sandbox;
        self
    }

    /// Sets [`ProxyConfig::refuse_ech`].
    pub fn refuse_ech(mut self, refuse_ech: bool) -> Self {
        self.refuse_ech = refuse_ech;
        self
    }

    /// Sets [`ProxyConfig::dns_ttl`].
    pub fn dns_ttl(mut self, dns_ttl: u32) -> Self {
        self.dns_ttl = dns_ttl;
        self
    }

    /// Sets [`ProxyConfig::max_substituted_body`].
    pub fn max_substituted_body(mut self, max_substituted_body: usize) -> Self {
        self.max_substituted_body = max_substituted_body;
        self
    }

    /// Sets [`ProxyConfig::upstream_roots`].
    pub fn upstream_roots(
        mut self,
        upstream_roots: Vec<rustls::pki_types::CertificateDer<'static>>,
    ) -> Self {
        self.upstream_roots = upstream_roots;
        self
    }
}

/// Where a sandbox's listeners go. Port 0 picks a free port.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ListenOptions {
    /// Address to bind (default: [`ProxyConfig::listen_ip`]), e.g. the host end of the
    /// sandbox's veth pair.
    pub ip: Option<IpAddr>,
    /// Port of the explicit HTTP/CONNECT proxy listener.
    pub proxy_port: u16,
    /// Port of a transparent listener (redirected TCP), if wanted.
    pub transparent_port: Option<u16>,
    /// UDP port of the DNS responder, if wanted.
    pub dns_port: Option<u16>,
}

impl ListenOptions {
    /// Sets [`ListenOptions::ip`].
    pub fn ip(mut self, ip: Option<IpAddr>) -> Self {
        self.ip = ip;
        self
    }

    /// Sets [`ListenOptions::proxy_port`].
    pub fn proxy_port(mut self, proxy_port: u16) -> Self {
        self.proxy_port = proxy_port;
        self
    }

    /// Sets [`ListenOptions::transparent_port`].
    pub fn transparent_port(mut self, transparent_port: Option<u16>) -> Self {
        self.transparent_port = transparent_port;
        self
    }

    /// Sets [`ListenOptions::dns_port`].
    pub fn dns_port(mut self, dns_port: Option<u16>) -> Self {
        self.dns_port = dns_port;
        self
    }
}

/// What [`EgressProxy::register`] set up for a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Registration {
    /// The sandbox id.
    pub sandbox_id: String,
    /// The explicit proxy (`HTTP_PROXY=http://ADDR`, `HTTPS_PROXY=http://ADDR`).
    pub proxy_addr: SocketAddr,
    /// The transparent listener (the target of an nftables `redirect`/`dnat`), if any.
    pub transparent_addr: Option<SocketAddr>,
    /// The DNS responder (the sandbox's `nameserver`), if any.
    pub dns_addr: Option<SocketAddr>,
}

/// Finds the original destination of a redirected TCP connection (e.g. `SO_ORIGINAL_DST`).
pub trait OriginalDst: Send + Sync + fmt::Debug {
    /// The address the sandbox dialed before the redirect, if known.
    fn original_dst(&self, stream: &TcpStream) -> Option<SocketAddr>;
}

/// No original destination is known: transparent connections are decided by name only.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoOriginalDst;

impl OriginalDst for NoOriginalDst {
    fn original_dst(&self, _stream: &TcpStream) -> Option<SocketAddr> {
        None
    }
}

/// Builds an [`EgressProxy`].
#[derive(Debug, Default)]
pub struct EgressProxyBuilder {
    config: ProxyConfig,
    resolver: Option<Arc<dyn Resolver>>,
    dialer: Option<Arc<dyn Dialer>>,
    original_dst: Option<Arc<dyn OriginalDst>>,
}

impl EgressProxyBuilder {
    /// Sets the tunables.
    pub fn config(mut self, config: ProxyConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets the resolver (default [`SystemResolver`]).
    pub fn resolver(mut self, r: Arc<dyn Resolver>) -> Self {
        self.resolver = Some(r);
        self
    }

    /// Sets the dialer (default [`TcpDialer`]).
    pub fn dialer(mut self, d: Arc<dyn Dialer>) -> Self {
        self.dialer = Some(d);
        self
    }

    /// Sets how transparent listeners learn the original destination (default none).
    pub fn original_dst(mut self, o: Arc<dyn OriginalDst>) -> Self {
        self.original_dst = Some(o);
        self
    }

    /// Builds the proxy (no socket is opened until [`EgressProxy::register`]).
    pub fn build(self) -> EgressProxy {
        EgressProxy {
            inner: Arc::new(Inner {
                config: self.config,
                resolver: self.resolver.unwrap_or_else(|| Arc::new(SystemResolver)),
                dialer: self.dialer.unwrap_or_else(|| Arc::new(TcpDialer)),
                original_dst: self.original_dst.unwrap_or_else(|| Arc::new(NoOriginalDst)),
                sandboxes: Mutex::new(HashMap::new()),
                ca: OnceLock::new(),
                upstream_tls: OnceLock::new(),
            }),
        }
    }
}

/// One host-side egress proxy serving many sandboxes, each with its own listeners (its
/// identity: a connection is judged by the policy of the sandbox whose listener accepted it),
/// policy and audit log. Cheap to clone.
#[derive(Debug, Clone)]
pub struct EgressProxy {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: ProxyConfig,
    resolver: Arc<dyn Resolver>,
    dialer: Arc<dyn Dialer>,
    original_dst: Arc<dyn OriginalDst>,
    sandboxes: Mutex<HashMap<String, Arc<SandboxState>>>,
    /// The interception CA, made the first time a sandbox has proxy-held secrets.
    ca: OnceLock<Arc<InterceptCa>>,
    /// The TLS client configuration for intercepted connections' real servers.
    upstream_tls: OnceLock<Arc<rustls::ClientConfig>>,
}

impl Inner {
    fn ca(&self) -> Result<Arc<InterceptCa>, InterceptError> {
        if let Some(ca) = self.ca.get() {
            return Ok(ca.clone());
        }
        let ca = Arc::new(InterceptCa::new()?);
        Ok(self.ca.get_or_init(|| ca).clone())
    }

    /// The server configuration presented to the sandbox and the client configuration for the
    /// real server, for an intercepted connection to `host`.
    fn tls_configs(
        &self,
        host: &str,
    ) -> Result<(Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>), InterceptError> {
        let server = self.ca()?.server_config(host)?;
        let client = match self.upstream_tls.get() {
            Some(c) => c.clone(),
            None => {
                let c = crate::intercept::upstream_client_config(&self.config.upstream_roots)?;
                self.upstream_tls.get_or_init(|| c).clone()
            }
        };
        Ok((server, client))
    }
}

#[derive(Debug)]
struct SandboxState {
    id: String,
    policy: RwLock<Arc<NetworkPolicy>>,
    /// Proxy-held secrets ([`EgressProxy::set_secrets`]).
    secrets: RwLock<Arc<SecretSet>>,
    audit: AuditRing,
    shutdown: watch::Sender<bool>,
    slots: Arc<Semaphore>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl SandboxState {
    fn policy(&self) -> Arc<NetworkPolicy> {
        self.policy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn secrets(&self) -> Arc<SecretSet> {
        self.secrets
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Sockets bound by the caller, for [`EgressProxy::register_with_sockets`].
#[derive(Debug)]
#[non_exhaustive]
pub struct Sockets {
    /// The explicit HTTP/CONNECT proxy listener.
    pub proxy: std::net::TcpListener,
    /// The transparent listener, if any.
    pub transparent: Option<std::net::TcpListener>,
    /// The DNS responder's socket, if any.
    pub dns: Option<std::net::UdpSocket>,
}

impl Sockets {
    /// The caller's `proxy` listener, with a `transparent` listener and a `dns` socket if
    /// wanted.
    pub fn new(
        proxy: std::net::TcpListener,
        transparent: Option<std::net::TcpListener>,
        dns: Option<std::net::UdpSocket>,
    ) -> Self {
        Sockets {
            proxy,
            transparent,
            dns,
        }
    }
}

/// How a connection handed to [`EgressProxy::serve_stream`] speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamMode {
    /// An explicit HTTP proxy client (absolute-URI requests or `CONNECT`).
    Explicit,
    /// Redirected TCP: sniff HTTP `Host` / TLS SNI, else decide by `original_dst`.
    Transparent {
        /// Where the sandbox was connecting to, if known.
        original_dst: Option<SocketAddr>,
    },
}

impl EgressProxy {
    /// A builder with the defaults (system resolver, TCP dialer).
    pub fn builder() -> EgressProxyBuilder {
        EgressProxyBuilder::default()
    }

    /// A proxy with the default configuration, system resolver and TCP dialer.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.inner.config
    }

    /// Registers a sandbox with an explicit-proxy listener on [`ProxyConfig::listen_ip`] and a
    /// free port. Must be called inside a tokio runtime.
    pub async fn register(
        &self,
        sandbox_id: &str,
        policy: NetworkPolicy,
    ) -> Result<Registration, Error> {
        self.register_with(sandbox_id, policy, ListenOptions::default())
            .await
    }

    /// Registers a sandbox with the listeners `opts` asks for.
    pub async fn register_with(
        &self,
        sandbox_id: &str,
        policy: NetworkPolicy,
        opts: ListenOptions,
    ) -> Result<Registration, Error> {
        policy.validate()?;
        if sandbox_id.is_empty() || sandbox_id.len() > 128 {
            return Err(Error::invalid("sandbox_id", "must be 1-128 bytes"));
        }
        if self.sandbox(sandbox_id).is_some() {
            return Err(Error::invalid(
                "sandbox_id",
                format!("{sandbox_id} is already registered with the egress proxy"),
            ));
        }
        let ip = opts.ip.unwrap_or(self.inner.config.listen_ip);
        let bind_err = |what: &str, e| Error::io(format!("egress proxy: bind {what} on {ip}"), e);
        let proxy = TcpListener::bind((ip, opts.proxy_port))
            .await
            .map_err(|e| bind_err("proxy listener", e))?;
        let transparent = match opts.transparent_port {
            Some(p) => Some(
                TcpListener::bind((ip, p))
                    .await
                    .map_err(|e| bind_err("transparent listener", e))?,
            ),
            None => None,
        };
        let dns = match opts.dns_port {
            Some(p) => Some(
                UdpSocket::bind((ip, p))
                    .await
                    .map_err(|e| bind_err("DNS responder", e))?,
            ),
            None => None,
        };
        self.start(sandbox_id, policy, proxy, transparent, dns)
    }

    /// Registers a sandbox on sockets the caller bound (e.g. inside another network
    /// namespace, or handed over by a supervisor). Must be called inside a tokio runtime.
    pub async fn register_with_sockets(
        &self,
        sandbox_id: &str,
        policy: NetworkPolicy,
        sockets: Sockets,
    ) -> Result<Registration, Error> {
        policy.validate()?;
        let conv = |e| Error::io("egress proxy: adopt a socket", e);
        let tcp = |l: std::net::TcpListener| {
            l.set_nonblocking(true)?;
            TcpListener::from_std(l)
        };
        let proxy = tcp(sockets.proxy).map_err(conv)?;
        let transparent = match sockets.transparent {
            Some(l) => Some(tcp(l).map_err(conv)?),
            None => None,
        };
        let dns = match sockets.dns {
            Some(u) => {
                u.set_nonblocking(true).map_err(conv)?;
                Some(UdpSocket::from_std(u).map_err(conv)?)
            }
            None => None,
        };
        self.start(sandbox_id, policy, proxy, transparent, dns)
    }

    fn start(
        &self,
        sandbox_id: &str,
        policy: NetworkPolicy,
        proxy: TcpListener,
        transparent: Option<TcpListener>,
        dns: Option<UdpSocket>,
    ) -> Result<Registration, Error> {
        if sandbox_id.is_empty() || sandbox_id.len() > 128 {
            return Err(Error::invalid("sandbox_id", "must be 1-128 bytes"));
        }
        let local = |r: std::io::Result<SocketAddr>| {
            r.map_err(|e| Error::io("egress proxy: listener address", e))
        };
        let reg = Registration {
            sandbox_id: sandbox_id.to_string(),
            proxy_addr: local(proxy.local_addr())?,
            transparent_addr: match &transparent {
                Some(l) => Some(local(l.local_addr())?),
                None => None,
            },
            dns_addr: match &dns {
                Some(s) => Some(local(s.local_addr())?),
                None => None,
            },
        };
        let (shutdown, _) = watch::channel(false);
        let state = Arc::new(SandboxState {
            id: sandbox_id.to_string(),
            policy: RwLock::new(Arc::new(policy)),
            secrets: RwLock::new(Arc::new(SecretSet::default())),
            audit: AuditRing::new(self.inner.config.audit_capacity),
            shutdown,
            slots: Arc::new(Semaphore::new(
                self.inner.config.max_connections_per_sandbox.max(1),
            )),
            tasks: Mutex::new(Vec::new()),
        });
        {
            let mut map = self
                .inner
                .sandboxes
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if map.contains_key(sandbox_id) {
                return Err(Error::invalid(
                    "sandbox_id",
                    format!("{sandbox_id} is already registered with the egress proxy"),
                ));
            }
            map.insert(sandbox_id.to_string(), state.clone());
        }
        let mut tasks = vec![tokio::spawn(accept_loop(
            self.inner.clone(),
            state.clone(),
            proxy,
            false,
        ))];
        if let Some(l) = transparent {
            tasks.push(tokio::spawn(accept_loop(
                self.inner.clone(),
                state.clone(),
                l,
                true,
            )));
        }
        if let Some(s) = dns {
            tasks.push(tokio::spawn(dns_loop(self.inner.clone(), state.clone(), s)));
        }
        state
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(tasks);
        tracing::info!(target: "sandbox_egress", sandbox = sandbox_id, proxy = %reg.proxy_addr,
            transparent = ?reg.transparent_addr, dns = ?reg.dns_addr, "egress registered");
        Ok(reg)
    }

    /// Replaces a sandbox's proxy-held secrets ([`crate::secrets`]). The next request uses
    /// them: a binding removed here is no longer substituted (its placeholder is then refused
    /// as a leak attempt), a binding added is. TLS to a host with a bound secret is
    /// terminated by the proxy (the sandbox must trust [`interception_ca_pem`]); every other
    /// TLS connection stays spliced end to end.
    ///
    /// [`interception_ca_pem`]: Self::interception_ca_pem
    pub fn set_secrets(&self, sandbox_id: &str, secrets: SecretSet) -> Result<(), Error> {
        let sb = self.sandbox(sandbox_id).ok_or_else(|| gone(sandbox_id))?;
        *sb.secrets.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(secrets);
        Ok(())
    }

    /// The certificate (PEM) of this proxy's interception CA, made on first use: what a
    /// sandbox with proxy-held secrets must trust. Its key never leaves this process.
    pub fn interception_ca_pem(&self) -> Result<String, Error> {
        self.inner
            .ca()
            .map(|ca| ca.certificate_pem().to_owned())
            .map_err(|e| {
                Error::io(
                    "egress proxy: interception CA",
                    std::io::Error::other(e.to_string()),
                )
            })
    }

    /// Replaces a sandbox's policy. Connections (and DNS queries) decided after this call use
    /// the new policy; tunnels already open are left as they are.
    pub fn update_policy(&self, sandbox_id: &str, policy: NetworkPolicy) -> Result<(), Error> {
        policy.validate()?;
        let sb = self.sandbox_or_gone(sandbox_id)?;
        *sb.policy.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(policy);
        tracing::info!(target: "sandbox_egress", sandbox = sandbox_id, "egress policy updated");
        Ok(())
    }

    /// The current policy of a sandbox.
    pub fn policy(&self, sandbox_id: &str) -> Result<NetworkPolicy, Error> {
        Ok((*self.sandbox_or_gone(sandbox_id)?.policy()).clone())
    }

    /// The latest audit entries of a sandbox, oldest first (bounded by
    /// [`ProxyConfig::audit_capacity`]).
    pub fn audit(&self, sandbox_id: &str) -> Result<Vec<AuditEntry>, Error> {
        Ok(self.sandbox_or_gone(sandbox_id)?.audit.snapshot())
    }

    /// How many audit entries of a sandbox were pushed out of its ring.
    pub fn audit_dropped(&self, sandbox_id: &str) -> Result<u64, Error> {
        Ok(self.sandbox_or_gone(sandbox_id)?.audit.dropped())
    }

    /// The ids of the registered sandboxes.
    pub fn sandboxes(&self) -> Vec<String> {
        let map = self
            .inner
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        map.keys().cloned().collect()
    }

    /// Closes everything of a sandbox (listeners, DNS responder, open connections and
    /// tunnels) and returns its final audit log.
    pub async fn unregister(&self, sandbox_id: &str) -> Result<Vec<AuditEntry>, Error> {
        let sb = {
            let mut map = self
                .inner
                .sandboxes
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            map.remove(sandbox_id)
        }
        .ok_or_else(|| gone(sandbox_id))?;
        sb.shutdown.send_replace(true);
        let tasks: Vec<JoinHandle<()>> =
            std::mem::take(&mut *sb.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await; // the listener sockets are closed once their task is dropped
        }
        tracing::info!(target: "sandbox_egress", sandbox = sandbox_id, "egress unregistered");
        Ok(sb.audit.snapshot())
    }

    /// Serves one already-accepted connection for a sandbox (e.g. one that arrived over a Unix
    /// socket forwarded out of the sandbox). Returns when the connection is done or the
    /// sandbox is unregistered.
    pub async fn serve_stream<S>(
        &self,
        sandbox_id: &str,
        stream: S,
        mode: StreamMode,
    ) -> Result<(), Error>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let sb = self.sandbox_or_gone(sandbox_id)?;
        let Ok(_permit) = sb.slots.clone().try_acquire_owned() else {
            return Err(Error::ResourceExhausted {
                what: format!("egress connections of sandbox {sandbox_id}"),
            });
        };
        guarded(&self.inner, &sb, stream, mode).await;
        Ok(())
    }

    fn sandbox(&self, id: &str) -> Option<Arc<SandboxState>> {
        let map = self
            .inner
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        map.get(id).cloned()
    }

    fn sandbox_or_gone(&self, id: &str) -> Result<Arc<SandboxState>, Error> {
        self.sandbox(id).ok_or_else(|| gone(id))
    }
}

impl Default for EgressProxy {
    fn default() -> Self {
        Self::new()
    }
}

fn gone(id: &str) -> Error {
    Error::SandboxGone {
        id: id.to_string(),
        reason: "not registered with the egress proxy".into(),
    }
}

/// Resolves once the sandbox is unregistered (or its state dropped).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}
