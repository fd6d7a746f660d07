//! The egress proxy: per-sandbox listeners, policies and audit logs.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use sandbox_core::{DecisionRule, Error, NetworkPolicy};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use crate::audit::{AuditEntry, AuditRing, AuditRule, Via};
use crate::dns::{self, Rcode};
use crate::http::{self, Dest, HeadParse};
use crate::net::{Dialer, Resolver, SystemResolver, TcpDialer, UpstreamStream};
use crate::tls::{self, ClientHelloSniff};

/// Most addresses of one name that are decided on and tried.
const MAX_ADDRS: usize = 16;

/// Tunables of an [`EgressProxy`]. The defaults suit a host serving a few hundred sandboxes.
#[derive(Debug, Clone)]
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
        }
    }
}

/// Where a sandbox's listeners go. Port 0 picks a free port.
#[derive(Debug, Clone, Default)]
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

/// What [`EgressProxy::register`] set up for a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

#[derive(Debug)]
struct SandboxState {
    id: String,
    policy: RwLock<Arc<NetworkPolicy>>,
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
}

/// Sockets bound by the caller, for [`EgressProxy::register_with_sockets`].
#[derive(Debug)]
pub struct Sockets {
    /// The explicit HTTP/CONNECT proxy listener.
    pub proxy: std::net::TcpListener,
    /// The transparent listener, if any.
    pub transparent: Option<std::net::TcpListener>,
    /// The DNS responder's socket, if any.
    pub dns: Option<std::net::UdpSocket>,
}

/// How a connection handed to [`EgressProxy::serve_stream`] speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamMode {
    /// An explicit HTTP proxy client (absolute-URI requests or `CONNECT`).
    Explicit,
    /// Redirected TCP: sniff HTTP `Host` / TLS SNI, else decide by `original_dst`.
    Transparent {
        /// Where the sandbox was connecting to, if known.
        original_dst: Option<SocketAddr>,
    },
}

/// A refusal, already audited.
struct Refused {
    status: u16,
    reason: &'static str,
    text: String,
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

async fn accept_loop(
    inner: Arc<Inner>,
    sb: Arc<SandboxState>,
    listener: TcpListener,
    transparent: bool,
) {
    loop {
        let (stream, _peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(target: "sandbox_egress", sandbox = %sb.id, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = sb.slots.clone().try_acquire_owned() else {
            tracing::warn!(target: "sandbox_egress", sandbox = %sb.id,
                "too many egress connections: dropping one");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mode = if transparent {
            StreamMode::Transparent {
                original_dst: inner.original_dst.original_dst(&stream),
            }
        } else {
            StreamMode::Explicit
        };
        let (inner, sb) = (inner.clone(), sb.clone());
        tokio::spawn(async move {
            guarded(&inner, &sb, stream, mode).await;
            drop(permit);
        });
    }
}

/// Resolves once the sandbox is unregistered (or its state dropped).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Runs a connection until it ends or the sandbox is unregistered.
async fn guarded<S>(inner: &Arc<Inner>, sb: &Arc<SandboxState>, stream: S, mode: StreamMode)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut stop = sb.shutdown.subscribe();
    if *stop.borrow() {
        return;
    }
    tokio::select! {
        _ = handle(inner, sb, stream, mode) => {}
        _ = stopped(&mut stop) => {}
    }
}

async fn handle<S>(inner: &Arc<Inner>, sb: &Arc<SandboxState>, stream: S, mode: StreamMode)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    match mode {
        StreamMode::Explicit => handle_explicit(inner, sb, stream).await,
        StreamMode::Transparent { original_dst } => {
            handle_transparent(inner, sb, stream, original_dst).await
        }
    }
}

/// Reads until a full request head is buffered.
async fn read_head<S: AsyncRead + Unpin>(
    inner: &Inner,
    s: &mut S,
    buf: &mut Vec<u8>,
) -> Result<http::RequestHead, (u16, &'static str, &'static str)> {
    let cfg = &inner.config;
    let deadline = tokio::time::Instant::now() + cfg.head_timeout;
    loop {
        match http::parse_head(buf) {
            HeadParse::Complete(h) => return Ok(h),
            HeadParse::Invalid(why) => return Err((400, "Bad Request", why)),
            HeadParse::Partial => {}
        }
        if buf.len() >= cfg.max_head_bytes {
            return Err((
                431,
                "Request Header Fields Too Large",
                "request head too large",
            ));
        }
        let mut chunk = [0u8; 4096];
        let want = chunk.len().min(cfg.max_head_bytes - buf.len());
        match tokio::time::timeout_at(deadline, s.read(&mut chunk[..want])).await {
            Err(_) => return Err((408, "Request Timeout", "request head timed out")),
            Ok(Err(_)) | Ok(Ok(0)) => return Err((400, "Bad Request", "connection closed")),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

async fn handle_explicit<S>(inner: &Arc<Inner>, sb: &Arc<SandboxState>, mut client: S)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut buf = Vec::new();
    let head = match read_head(inner, &mut client, &mut buf).await {
        Ok(h) => h,
        Err((status, reason, why)) => {
            let resp = http::response(status, reason, &format!("{why}\n"), &[]);
            reply_and_close(&mut client, &resp).await;
            return;
        }
    };
    let body_start = buf.get(head.len..).unwrap_or_default().to_vec();
    if head.method.eq_ignore_ascii_case("CONNECT") {
        let Some((dest, port)) = http::parse_authority(&head.target, None) else {
            let r = refuse_malformed(
                sb,
                Via::Connect,
                None,
                0,
                "CONNECT target must be host:port",
            );
            reply_and_close(&mut client, &refusal_response(&r)).await;
            return;
        };
        match open(inner, sb, Via::Connect, &dest, port).await {
            Ok(mut up) => {
                if client
                    .write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                    .await
                    .is_err()
                {
                    return;
                }
                if !body_start.is_empty() && up.write_all(&body_start).await.is_err() {
                    return;
                }
                let _ = relay(&mut client, &mut up).await;
            }
            Err(r) => {
                reply_and_close(&mut client, &refusal_response(&r)).await;
            }
        }
        return;
    }
    let (dest, port, path) = match head.destination(80) {
        Ok(d) => d,
        Err(why) => {
            let r = refuse_malformed(sb, Via::Http, None, 0, why);
            reply_and_close(&mut client, &refusal_response(&r)).await;
            return;
        }
    };
    if !head
        .target
        .get(..7)
        .is_some_and(|t| t.eq_ignore_ascii_case("http://"))
    {
        let r = refuse_malformed(
            sb,
            Via::Http,
            Some(&dest),
            port,
            "a forward proxy request needs an absolute http:// URI",
        );
        reply_and_close(&mut client, &refusal_response(&r)).await;
        return;
    }
    match open(inner, sb, Via::Http, &dest, port).await {
        Ok(mut up) => {
            let mut first = head.upstream_head(&path, &dest, port);
            first.extend_from_slice(&body_start);
            if up.write_all(&first).await.is_err() {
                return;
            }
            let _ = relay(&mut client, &mut up).await;
        }
        Err(r) => {
            reply_and_close(&mut client, &refusal_response(&r)).await;
        }
    }
}

/// What the first bytes of a redirected connection said.
enum Sniffed {
    Http(Dest, u16),
    Tls(String),
    TlsEch,
    Opaque,
    BadHttp(&'static str),
}

async fn sniff<S: AsyncRead + Unpin>(inner: &Inner, s: &mut S, buf: &mut Vec<u8>) -> Sniffed {
    let cfg = &inner.config;
    let deadline = tokio::time::Instant::now() + cfg.sniff_timeout;
    let mut http_head_deadline = None;
    loop {
        if !buf.is_empty() {
            match tls::parse_client_hello(buf) {
                ClientHelloSniff::ClientHello(h) => {
                    if h.ech && cfg.refuse_ech {
                        return Sniffed::TlsEch;
                    }
                    return match h.server_name {
                        Some(n) => Sniffed::Tls(n),
                        None => Sniffed::Opaque,
                    };
                }
                ClientHelloSniff::Malformed(_) => return Sniffed::Opaque,
                ClientHelloSniff::NeedMore => {}
                ClientHelloSniff::NotTls => {
                    if !http::looks_like_http(buf) {
                        return Sniffed::Opaque;
                    }
                    match http::parse_head(buf) {
                        HeadParse::Complete(h) => {
                            return match h.destination(0) {
                                Ok((d, p, _)) => Sniffed::Http(d, p),
                                Err(why) => Sniffed::BadHttp(why),
                            }
                        }
                        HeadParse::Invalid(why) => return Sniffed::BadHttp(why),
                        HeadParse::Partial => {
                            // An HTTP client gets the full head timeout to finish its head.
                            http_head_deadline
                                .get_or_insert(tokio::time::Instant::now() + cfg.head_timeout);
                        }
                    }
                }
            }
        }
        if buf.len() >= cfg.max_head_bytes.max(tls::MAX_HANDSHAKE + 64) {
            return Sniffed::Opaque;
        }
        let until = http_head_deadline.unwrap_or(deadline);
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout_at(until, s.read(&mut chunk)).await {
            Err(_) if http_head_deadline.is_some() => {
                return Sniffed::BadHttp("request head timed out")
            }
            Err(_) | Ok(Err(_)) | Ok(Ok(0)) => return Sniffed::Opaque,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

async fn handle_transparent<S>(
    inner: &Arc<Inner>,
    sb: &Arc<SandboxState>,
    mut client: S,
    original_dst: Option<SocketAddr>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut buf = Vec::new();
    let orig_port = original_dst.map(|a| a.port());
    let (via, dest, port) = match sniff(inner, &mut client, &mut buf).await {
        Sniffed::Http(d, p) => {
            // `Host` without a port means the port the sandbox dialed.
            let port = if p == 0 { orig_port.unwrap_or(80) } else { p };
            (Via::TransparentHttp, d, port)
        }
        Sniffed::Tls(name) => (
            Via::TransparentTls,
            Dest::Name(name),
            orig_port.unwrap_or(443),
        ),
        Sniffed::TlsEch => {
            refuse(
                sb,
                Via::TransparentTls,
                None,
                None,
                orig_port.unwrap_or(443),
                AuditRule::EchRefused,
            );
            return;
        }
        Sniffed::BadHttp(why) => {
            let r = refuse_malformed(sb, Via::TransparentHttp, None, orig_port.unwrap_or(0), why);
            reply_and_close(&mut client, &refusal_response(&r)).await;
            return;
        }
        Sniffed::Opaque => match original_dst {
            Some(a) => (Via::TransparentTcp, Dest::Ip(a.ip()), a.port()),
            None => {
                refuse_malformed(
                    sb,
                    Via::TransparentTcp,
                    None,
                    0,
                    "no HTTP Host or TLS SNI, and the original destination is unknown",
                );
                return;
            }
        },
    };
    match open(inner, sb, via, &dest, port).await {
        Ok(mut up) => {
            if up.write_all(&buf).await.is_err() {
                return;
            }
            let _ = relay(&mut client, &mut up).await;
        }
        Err(r) => {
            if via == Via::TransparentHttp {
                reply_and_close(&mut client, &refusal_response(&r)).await;
            }
        }
    }
}

/// Sends a final response, then half-closes and discards (bounded in bytes and time) what the
/// client still sends, so the kernel does not reset the connection and destroy the response.
async fn reply_and_close<S: AsyncRead + AsyncWrite + Unpin>(client: &mut S, resp: &[u8]) {
    if client.write_all(resp).await.is_err() {
        return;
    }
    let _ = client.shutdown().await;
    let drain = async {
        let mut sink = [0u8; 4096];
        let mut left: usize = 256 * 1024;
        while left > 0 {
            match client.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

fn refusal_response(r: &Refused) -> Vec<u8> {
    http::response(
        r.status,
        r.reason,
        &format!("agent-sandbox egress: {}\n", r.text),
        &[("X-Agent-Sandbox-Egress", "denied")],
    )
}

fn refuse(
    sb: &SandboxState,
    via: Via,
    host: Option<&str>,
    ip: Option<IpAddr>,
    port: u16,
    rule: AuditRule,
) -> Refused {
    let (status, reason) = match &rule {
        AuditRule::Policy(_) | AuditRule::EchRefused => (403, "Forbidden"),
        AuditRule::Malformed(_) => (400, "Bad Request"),
        AuditRule::Unresolvable(_) => (502, "Bad Gateway"),
    };
    let text = match (host, ip) {
        (Some(h), _) => format!("{h}:{port} refused: {rule}"),
        (None, Some(ip)) => format!("{ip}:{port} refused: {rule}"),
        (None, None) => format!("refused: {rule}"),
    };
    sb.audit.push(AuditEntry {
        time: SystemTime::now(),
        sandbox_id: sb.id.clone(),
        via,
        host: host.map(str::to_string),
        ip,
        port,
        allowed: false,
        rule,
        error: None,
    });
    Refused {
        status,
        reason,
        text,
    }
}

fn refuse_malformed(
    sb: &SandboxState,
    via: Via,
    dest: Option<&Dest>,
    port: u16,
    why: &str,
) -> Refused {
    let ip = match dest {
        Some(Dest::Ip(ip)) => Some(*ip),
        _ => None,
    };
    refuse(
        sb,
        via,
        dest.and_then(Dest::name),
        ip,
        port,
        AuditRule::Malformed(why.to_string()),
    )
}

/// Whether a name may be looked up at all under `policy`, before resolution. Names no host
/// rule could allow are never resolved: a lookup of `<secret>.attacker.example` would leak the
/// secret to the attacker's name server even though the connection is refused.
pub(crate) fn precheck_name(
    policy: &NetworkPolicy,
    name: &str,
    port: Option<u16>,
) -> Result<(), DecisionRule> {
    match policy {
        NetworkPolicy::DenyAll => Err(DecisionRule::DenyAll),
        NetworkPolicy::Allow { hosts, ports, .. } => {
            if let Some(p) = port {
                if !ports.is_empty() && !ports.contains(&p) {
                    return Err(DecisionRule::Port(p));
                }
            }
            let hit = hosts.iter().any(|r| match port {
                Some(p) => r.matches(name, p),
                None => r.pattern.matches(name),
            });
            if hit {
                Ok(())
            } else {
                Err(DecisionRule::NotListed)
            }
        }
        NetworkPolicy::AllowInternet { deny, .. } => {
            for r in deny {
                if let sandbox_core::DenyRule::Host(p) = r {
                    if p.matches(name) {
                        return Err(DecisionRule::Denied(r.to_string()));
                    }
                }
            }
            Ok(())
        }
        // A policy this version does not know: nothing is allowed.
        _ => Err(DecisionRule::DenyAll),
    }
}

/// Resolves `name` on the host, with the timeout and the address bound.
async fn resolve(inner: &Inner, name: &str) -> Result<Vec<IpAddr>, String> {
    match tokio::time::timeout(inner.config.resolve_timeout, inner.resolver.resolve(name)).await {
        Err(_) => Err("resolution timed out".into()),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(v)) if v.is_empty() => Err("no addresses".into()),
        Ok(Ok(mut v)) => {
            v.truncate(MAX_ADDRS);
            Ok(v)
        }
    }
}

/// Decides and opens one upstream connection. Every address is decided by
/// `NetworkPolicy::decide` after resolution; if any address of a name is refused, the whole
/// name is refused (an answer mixing a public address with the metadata endpoint is a
/// rebinding attempt); only allowed addresses are dialed.
async fn open(
    inner: &Inner,
    sb: &SandboxState,
    via: Via,
    dest: &Dest,
    port: u16,
) -> Result<Box<dyn UpstreamStream>, Refused> {
    let policy = sb.policy();
    let name = dest.name();
    let addrs = match dest {
        Dest::Ip(ip) => vec![*ip],
        Dest::Name(n) => {
            if let Err(rule) = precheck_name(&policy, n, Some(port)) {
                return Err(refuse(sb, via, name, None, port, AuditRule::Policy(rule)));
            }
            match resolve(inner, n).await {
                Ok(a) => a,
                Err(why) => {
                    return Err(refuse(
                        sb,
                        via,
                        name,
                        None,
                        port,
                        AuditRule::Unresolvable(why),
                    ))
                }
            }
        }
    };
    let mut allowed = Vec::with_capacity(addrs.len());
    for ip in addrs {
        let d = policy.decide(name, ip, port);
        if !d.allowed {
            return Err(refuse(
                sb,
                via,
                name,
                Some(ip),
                port,
                AuditRule::Policy(d.rule),
            ));
        }
        allowed.push((ip, d.rule));
    }
    let mut last_err = String::from("no address");
    let mut last = None;
    for (ip, rule) in allowed {
        let addr = SocketAddr::new(ip, port);
        let res = tokio::time::timeout(inner.config.connect_timeout, inner.dialer.dial(addr)).await;
        match res {
            Ok(Ok(stream)) => {
                sb.audit.push(AuditEntry {
                    time: SystemTime::now(),
                    sandbox_id: sb.id.clone(),
                    via,
                    host: name.map(str::to_string),
                    ip: Some(ip),
                    port,
                    allowed: true,
                    rule: AuditRule::Policy(rule),
                    error: None,
                });
                return Ok(stream);
            }
            Ok(Err(e)) => last_err = e.to_string(),
            Err(_) => last_err = "connect timed out".into(),
        }
        last = Some((ip, rule));
    }
    let (ip, rule) = last.map_or((None, DecisionRule::NotListed), |(i, r)| (Some(i), r));
    sb.audit.push(AuditEntry {
        time: SystemTime::now(),
        sandbox_id: sb.id.clone(),
        via,
        host: name.map(str::to_string),
        ip,
        port,
        allowed: true,
        rule: AuditRule::Policy(rule),
        error: Some(last_err.clone()),
    });
    Err(Refused {
        status: 502,
        reason: "Bad Gateway",
        text: format!("{dest}:{port}: {last_err}"),
    })
}

/// The ports a DNS answer is judged for: a name is answered if some port the policy allows
/// for it would be allowed.
fn candidate_ports(policy: &NetworkPolicy, name: &str) -> Vec<u16> {
    let mut out = Vec::new();
    if let NetworkPolicy::Allow { hosts, ports, .. } = policy {
        out.extend(ports.iter().copied());
        out.extend(
            hosts
                .iter()
                .filter(|r| r.pattern.matches(name))
                .filter_map(|r| r.port),
        );
    }
    if out.is_empty() {
        out.extend([443, 80]);
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Answers one DNS query under the sandbox's current policy.
async fn answer_dns(inner: &Inner, sb: &SandboxState, msg: &[u8]) -> Option<Vec<u8>> {
    let ttl = inner.config.dns_ttl;
    let q = match dns::parse_query(msg) {
        Ok(q) => q,
        Err(dns::QueryError::Drop) => return None,
        Err(dns::QueryError::Reply { id, flags, rcode }) => {
            return Some(dns::build_error(id, flags, rcode))
        }
    };
    let policy = sb.policy();
    let audit = |host: Option<&str>, ip, allowed, rule| {
        sb.audit.push(AuditEntry {
            time: SystemTime::now(),
            sandbox_id: sb.id.clone(),
            via: Via::Dns,
            host: host.map(str::to_string),
            ip,
            port: 0,
            allowed,
            rule,
            error: None,
        })
    };
    if !dns::is_class_in(&q) {
        return Some(dns::build_response(&q, Rcode::Refused, &[], ttl));
    }
    let Some(name) = q.name.clone() else {
        audit(
            None,
            None,
            false,
            AuditRule::Malformed("query name is not a host name".into()),
        );
        return Some(dns::build_response(&q, Rcode::NxDomain, &[], ttl));
    };
    if let Err(rule) = precheck_name(&policy, &name, None) {
        let code = if rule == DecisionRule::DenyAll {
            Rcode::Refused
        } else {
            Rcode::NxDomain
        };
        audit(Some(&name), None, false, AuditRule::Policy(rule));
        return Some(dns::build_response(&q, code, &[], ttl));
    }
    if q.qtype != dns::TYPE_A && q.qtype != dns::TYPE_AAAA {
        return Some(dns::build_response(&q, Rcode::NoError, &[], ttl));
    }
    let addrs = match resolve(inner, &name).await {
        Ok(a) => a,
        Err(why) => {
            audit(Some(&name), None, false, AuditRule::Unresolvable(why));
            return Some(dns::build_response(&q, Rcode::NxDomain, &[], ttl));
        }
    };
    let ports = candidate_ports(&policy, &name);
    let mut ok = Vec::new();
    for ip in addrs {
        let wanted = match ip {
            IpAddr::V4(_) => q.qtype == dns::TYPE_A,
            IpAddr::V6(_) => q.qtype == dns::TYPE_AAAA,
        };
        if !wanted {
            continue;
        }
        let mut last = None;
        for p in &ports {
            let d = policy.decide(Some(&name), ip, *p);
            if d.allowed {
                last = Some(d);
                break;
            }
            last = Some(d);
        }
        if let Some(d) = last {
            audit(
                Some(&name),
                Some(ip),
                d.allowed,
                AuditRule::Policy(d.rule.clone()),
            );
            if d.allowed {
                ok.push(ip);
            }
        }
    }
    Some(dns::build_response(&q, Rcode::NoError, &ok, ttl))
}

async fn dns_loop(inner: Arc<Inner>, sb: Arc<SandboxState>, sock: UdpSocket) {
    let sock = Arc::new(sock);
    let mut buf = vec![0u8; 1500];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(target: "sandbox_egress", sandbox = %sb.id, error = %e, "dns recv");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = sb.slots.clone().try_acquire_owned() else {
            continue;
        };
        let msg = buf[..n.min(buf.len())].to_vec();
        let (inner, sb, sock) = (inner.clone(), sb.clone(), sock.clone());
        let mut stop = sb.shutdown.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                resp = answer_dns(&inner, &sb, &msg) => {
                    if let Some(r) = resp {
                        let _ = sock.send_to(&r, peer).await;
                    }
                }
                _ = stopped(&mut stop) => {}
            }
            drop(permit);
        });
    }
}

/// Buffer per direction of a relayed connection: large enough that a bulk transfer costs a
/// few syscalls per megabyte (tokio's default of 8 KiB costs 128).
const RELAY_BUFFER: usize = 256 * 1024;

/// Copies both ways until both sides are done: with `splice(2)` when both ends are TCP
/// sockets (no copy through user space), else through buffers.
async fn relay<A>(a: &mut A, b: &mut Box<dyn UpstreamStream>) -> std::io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + 'static,
{
    #[cfg(target_os = "linux")]
    {
        let a_any: &dyn std::any::Any = &*a;
        let b_any: &dyn std::any::Any = &**b;
        if let (Some(x), Some(y)) = (
            a_any.downcast_ref::<TcpStream>(),
            b_any.downcast_ref::<TcpStream>(),
        ) {
            return crate::splice::relay(x, y).await;
        }
    }
    tokio::io::copy_bidirectional_with_sizes(a, b, RELAY_BUFFER, RELAY_BUFFER).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allow(hosts: &[&str], cidrs: &[&str], ports: &[u16]) -> NetworkPolicy {
        NetworkPolicy::Allow {
            hosts: hosts.iter().map(|h| h.parse().unwrap()).collect(),
            cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            ports: ports.to_vec(),
        }
    }

    #[test]
    fn precheck_only_resolves_names_a_host_rule_could_allow() {
        let p = allow(
            &["allowed.test", "*.wild.test:443"],
            &["10.201.0.0/16"],
            &[],
        );
        assert!(precheck_name(&p, "allowed.test", Some(80)).is_ok());
        assert!(precheck_name(&p, "a.wild.test", Some(443)).is_ok());
        assert!(precheck_name(&p, "a.wild.test", Some(80)).is_err());
        assert!(precheck_name(&p, "a.wild.test", None).is_ok());
        assert_eq!(
            precheck_name(&p, "secret.attacker.test", Some(443)),
            Err(DecisionRule::NotListed)
        );
        assert_eq!(
            precheck_name(&NetworkPolicy::DenyAll, "allowed.test", None),
            Err(DecisionRule::DenyAll)
        );
        let p = allow(&["allowed.test"], &[], &[443]);
        assert_eq!(
            precheck_name(&p, "allowed.test", Some(80)),
            Err(DecisionRule::Port(80))
        );
        let inet = NetworkPolicy::AllowInternet {
            deny: vec!["*.evil.test".parse().unwrap()],
            private: vec![],
        };
        assert!(precheck_name(&inet, "ok.test", Some(443)).is_ok());
        assert!(precheck_name(&inet, "x.evil.test", Some(443)).is_err());
    }

    #[test]
    fn dns_candidate_ports() {
        let p = allow(&["a.test:8443", "b.test"], &[], &[]);
        assert_eq!(candidate_ports(&p, "a.test"), vec![8443]);
        assert_eq!(candidate_ports(&p, "b.test"), vec![80, 443]);
        let p = allow(&["a.test"], &[], &[22]);
        assert_eq!(candidate_ports(&p, "a.test"), vec![22]);
    }
}
