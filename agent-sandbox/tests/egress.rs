#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Network egress policies enforced end to end, in the container, gVisor and microVM tiers,
//! with the real enforcer (`sandbox_egress::VethEnforcer`: a private egress namespace, veth links,
//! nftables, the proxy).
//!
//! Traffic stays on this machine: upstream servers listen on loopback; the test resolver maps
//! `allowed.test`/`other.test` to 127.0.0.1, `meta.test` to 169.254.169.254 and `private.test`
//! to 10.201.0.5; the test dialer refuses (without sending anything) every non-loopback
//! address. Inside the sandboxes, addresses such as 10.201.0.9 exist only as destinations the
//! sandbox's namespace routes into the egress namespace, where they are redirected to the
//! proxy: nothing is forwarded anywhere.
//!
//! The microVM rows run where the probe says Linux guests boot (hardware KVM; they skip here
//! with its reason). Their guest is the installed one (`MICROVM_GUEST_DIR`, else the default
//! cache) started from the Python image `scripts/test-image.sh` builds (the default guest has
//! busybox only, and the client is Python); `scripts/kvm-proof.sh` runs them.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sandbox_core::{
    Backend, DynBackend, ExecRequest, Language, NetworkEvent, NetworkPolicy, ResolvedSecrets,
    Sandbox, SandboxSpec,
};
use sandbox_egress::{Dialer, StaticResolver, TcpDialer, UpstreamStream, VethEnforcer};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Refuses (without sending anything) every address but loopback.
#[derive(Debug, Default)]
struct GuardDialer {
    dials: Mutex<Vec<SocketAddr>>,
}

#[async_trait]
impl Dialer for GuardDialer {
    async fn dial(&self, addr: SocketAddr) -> io::Result<Box<dyn UpstreamStream>> {
        self.dials.lock().unwrap().push(addr);
        if !addr.ip().is_loopback() {
            return Err(io::Error::other(format!("test dialer refuses {addr}")));
        }
        TcpDialer.dial(addr).await
    }
}

/// The enforcer the tests share, or `None` (after printing why) where it cannot run here:
/// skipped on its own word (it needs root to make network namespaces).
fn enforcer() -> Option<(VethEnforcer, Arc<GuardDialer>)> {
    let dialer = Arc::new(GuardDialer::default());
    let resolver = StaticResolver::new()
        .with("allowed.test", &[ip("127.0.0.1")])
        .with("other.test", &[ip("127.0.0.1")])
        .with("meta.test", &[ip("169.254.169.254")])
        .with("private.test", &[ip("10.201.0.5")]);
    let built = VethEnforcer::builder()
        .resolver(Arc::new(resolver))
        .dialer(dialer.clone())
        .build();
    Some((sandbox_egress::testing::enforcer_or_skip(built)?, dialer))
}

/// Why this host cannot run the suite for `tier`, if it cannot.
async fn skip_reason(b: &dyn Backend) -> Option<String> {
    let s = b.probe().await;
    (!s.available).then(|| format!("{} tier unavailable: {}", s.tier, s.reason))
}

fn container(e: &VethEnforcer) -> DynBackend {
    Arc::new(
        backend_container::ContainerBackend::builder()
            .egress(Arc::new(e.clone()))
            .build()
            .unwrap(),
    )
}

fn gvisor(e: &VethEnforcer) -> DynBackend {
    Arc::new(
        backend_gvisor::GvisorBackend::builder()
            .egress(Arc::new(e.clone()))
            .build()
            .unwrap(),
    )
}

#[cfg(feature = "microvm")]
fn microvm(e: &VethEnforcer) -> DynBackend {
    let mut b = backend_microvm::MicrovmBackend::builder().egress(Arc::new(e.clone()));
    if let Some(dir) = std::env::var_os("MICROVM_GUEST_DIR") {
        b = b.guest_dir(dir);
    }
    Arc::new(b.build().unwrap())
}

/// The image the microVM rows start from: the Python one `scripts/test-image.sh` builds.
fn python_image() -> String {
    let dir = std::env::var_os("AGENT_SANDBOX_TEST_IMAGES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/var/tmp/agent-sandbox-images"))
        .join("trixie-numpy");
    assert!(
        dir.join("index.json").is_file(),
        "no test image in {}: run scripts/test-image.sh",
        dir.display()
    );
    format!("oci:{}:python3", dir.display())
}

/// An HTTP server on loopback answering `hello <Host header>`.
async fn http_server() -> u16 {
    sandbox_egress::testing::hello_server().await.unwrap()
}

/// A TLS server on loopback for `allowed.test` (certificate from a test CA) answering
/// `tls-ok:<first bytes>`; returns its port and the CA certificate (PEM).
async fn tls_server() -> (u16, String) {
    use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    use tokio_rustls::rustls::{self, ServerConfig};
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    // Distinct names: a leaf whose issuer equals its subject looks self-signed to OpenSSL.
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "agent-sandbox test CA");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let mut leaf = rcgen::CertificateParams::new(vec!["allowed.test".to_string()]).unwrap();
    leaf.distinguished_name
        .push(rcgen::DnType::CommonName, "allowed.test");
    let leaf = leaf.signed_by(&leaf_key, &ca).unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
    let server =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![leaf.der().clone(), ca.der().clone()], key)
            .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(s).await else {
                    return;
                };
                let mut buf = [0u8; 256];
                let n = tls.read(&mut buf).await.unwrap_or(0);
                let mut reply = b"tls-ok:".to_vec();
                reply.extend_from_slice(&buf[..n]);
                let _ = tls.write_all(&reply).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    (port, ca.pem())
}

/// The client inside the sandbox: each argument is one probe, the output one JSON object
/// mapping the probe to its outcome.
const CLIENT: &str = r#"
import json, os, socket, ssl, sys, urllib.request, urllib.error

def proxy_addr():
    p = os.environ["HTTPS_PROXY"].split("//", 1)[1]
    h, port = p.rsplit(":", 1)
    return h, int(port)

def read_all(s):
    out = b""
    while True:
        try:
            b = s.recv(65536)
        except (ConnectionResetError, socket.timeout) as e:
            return out, type(e).__name__
        if not b:
            return out, None
        out += b

def probe(kind, arg):
    try:
        if kind == "http":  # through HTTP_PROXY (urllib honours it)
            with urllib.request.urlopen(arg, timeout=10) as r:
                return "ok:" + r.read().decode()
        if kind == "connect":  # CONNECT + TLS with the test CA
            host, port = arg.split(":")
            s = socket.create_connection(proxy_addr(), timeout=10)
            s.sendall(("CONNECT %s:%s HTTP/1.1\r\nHost: %s:%s\r\n\r\n" % (host, port, host, port)).encode())
            head = b""
            while b"\r\n\r\n" not in head:
                b = s.recv(1)
                if not b:
                    return "closed"
                head += b
            status = head.split(b" ")[1].decode()
            if status != "200":
                return "refused:" + status
            ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
            t = ctx.wrap_socket(s, server_hostname=host)
            t.sendall(b"ping")
            return "ok:" + read_all(t)[0].decode()
        if kind == "direct-http":  # ignores the proxy: raw HTTP to an address, Host: a name
            addr, port, host = arg.split(":")
            s = socket.create_connection((addr, int(port)), timeout=10)
            s.sendall(("GET / HTTP/1.1\r\nHost: %s:%s\r\nConnection: close\r\n\r\n" % (host, port)).encode())
            body, err = read_all(s)
            if not body:
                return "closed" if err is None else "reset"
            return "ok:" + body.decode().split("\r\n\r\n", 1)[-1] if b" 200 " in body.split(b"\r\n")[0] else "refused:" + body.split(b"\r\n")[0].decode()
        if kind == "direct-tls":  # ignores the proxy: TLS straight to an address, SNI a name
            addr, port, host = arg.split(":")
            s = socket.create_connection((addr, int(port)), timeout=10)
            ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
            t = ctx.wrap_socket(s, server_hostname=host)
            t.sendall(b"ping")
            return "ok:" + read_all(t)[0].decode()
        if kind == "direct-tcp":  # bytes to a literal address
            addr, port = arg.rsplit(":", 1)
            s = socket.create_connection((addr, int(port)), timeout=10)
            s.sendall(b"hello\r\n")
            body, err = read_all(s)
            return ("data:" + body.decode(errors="replace")) if body else ("closed" if err is None else "reset")
        if kind == "dns":
            return "ok:" + ",".join(sorted({a[4][0] for a in socket.getaddrinfo(arg, 80, socket.AF_INET)}))
        if kind == "udp":
            addr, port = arg.rsplit(":", 1)
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.settimeout(2)
            u.sendto(b"x", (addr, int(port)))
            return "sent"
        if kind == "icmp":
            i = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
            i.sendto(b"\x08\x00\xf7\xff\x00\x00\x00\x00", (arg, 0))
            return "sent"
        if kind == "udp6":
            u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
            u.sendto(b"x", (arg, 53))
            return "sent"
    except urllib.error.HTTPError as e:
        return "refused:%d" % e.code
    except ssl.SSLError as e:
        return "error:%s:%s" % (type(e).__name__, e)
    except Exception as e:
        return "error:" + type(e).__name__
    return "unknown probe"

out = {}
for a in sys.argv[1:]:
    kind, arg = a.split("=", 1)
    out[a] = probe(kind, arg)
print(json.dumps(out))
"#;

async fn sandbox(b: &DynBackend, policy: NetworkPolicy) -> Box<dyn Sandbox> {
    let mut spec = SandboxSpec::builder(Language::Shell).network(policy);
    // The microVM's default guest has no Python: its image's.
    if b.tier() == sandbox_core::Tier::Microvm {
        spec = spec.image(python_image()).memory_mib(512);
    }
    let spec = spec.build().unwrap();
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    sb.write_file("client.py", CLIENT.as_bytes()).await.unwrap();
    sb
}

/// Runs the client with `probes`; returns probe -> outcome.
async fn probes(sb: &dyn Sandbox, probes: &[String]) -> serde_json::Map<String, Value> {
    let mut argv = vec!["python3".to_string(), "/workspace/client.py".to_string()];
    argv.extend(probes.iter().cloned());
    let mut req = ExecRequest::argv(argv);
    req.timeout = Some(Duration::from_secs(60));
    let r = sb.exec(req).await.unwrap();
    assert_eq!(
        r.exit_code,
        Some(0),
        "client failed: {}{}",
        r.stdout_str(),
        r.stderr_str()
    );
    let v: Value = serde_json::from_str(r.stdout_str().trim()).unwrap();
    v.as_object().unwrap().clone()
}

fn outcome<'a>(m: &'a serde_json::Map<String, Value>, probe: &str) -> &'a str {
    m.get(probe).and_then(Value::as_str).unwrap_or("missing")
}

fn allow_policy(hosts: &[&str]) -> NetworkPolicy {
    NetworkPolicy::Allow {
        hosts: hosts.iter().map(|h| h.parse().unwrap()).collect(),
        cidrs: vec!["127.0.0.1/32".parse().unwrap()],
        ports: vec![],
    }
}

fn has_event(ev: &[NetworkEvent], host: &str, allowed: bool) -> bool {
    ev.iter()
        .any(|e| e.host.as_deref() == Some(host) && e.allowed == allowed)
}

async fn deny_all_has_no_route(b: DynBackend) {
    if let Some(why) = skip_reason(b.as_ref()).await {
        eprintln!("SKIP: {why}");
        return;
    }
    let sb = sandbox(&b, NetworkPolicy::DenyAll).await;
    let p: Vec<String> = [
        "direct-tcp=10.201.0.9:80",
        "udp=10.201.0.9:9999",
        "dns=allowed.test",
        "icmp=10.201.0.9",
        "udp6=fd00::9",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let m = probes(sb.as_ref(), &p).await;
    for probe in &p {
        assert!(
            outcome(&m, probe).starts_with("error:"),
            "{}: {probe} -> {}",
            b.tier(),
            outcome(&m, probe)
        );
    }
    assert!(sb.network_events().await.unwrap().is_empty());
    sb.destroy().await.unwrap();
}

async fn allowlist_end_to_end(b: DynBackend, e: &VethEnforcer, dialer: &GuardDialer) {
    if let Some(why) = skip_reason(b.as_ref()).await {
        eprintln!("SKIP: {why}");
        return;
    }
    let http = http_server().await;
    let (tls, ca) = tls_server().await;
    let sb = sandbox(&b, allow_policy(&["allowed.test"])).await;
    sb.write_file("ca.pem", ca.as_bytes()).await.unwrap();
    let tier = b.tier();
    let p = |s: &str| s.to_string();
    let probes_list = vec![
        p(&format!("http=http://allowed.test:{http}/")),
        p(&format!("http=http://other.test:{http}/")),
        p(&format!("http=http://meta.test:{http}/")),
        p("http=http://169.254.169.254/latest/meta-data/"),
        p(&format!("connect=allowed.test:{tls}")),
        p(&format!("connect=other.test:{tls}")),
        p(&format!("direct-http=10.201.0.9:{http}:allowed.test")),
        p(&format!("direct-http=10.201.0.9:{http}:other.test")),
        p(&format!("direct-tls=10.201.0.9:{tls}:allowed.test")),
        p("direct-tcp=10.201.0.5:80"),
        p("direct-tcp=169.254.169.254:80"),
        p("dns=allowed.test"),
        p("dns=other.test"),
        p("dns=meta.test"),
        p("udp=10.201.0.9:9999"),
        p("udp6=fd00::9"),
    ];
    let m = probes(sb.as_ref(), &probes_list).await;
    let o = |i: usize| outcome(&m, &probes_list[i]).to_string();
    assert_eq!(
        o(0),
        format!("ok:hello allowed.test:{http}"),
        "{tier}: {m:?}"
    );
    assert_eq!(o(1), "refused:403", "{tier}: non-listed name: {m:?}");
    assert_eq!(o(2), "refused:403", "{tier}: name -> metadata: {m:?}");
    assert_eq!(o(3), "refused:403", "{tier}: metadata literal: {m:?}");
    assert_eq!(o(4), "ok:tls-ok:ping", "{tier}: HTTPS via CONNECT: {m:?}");
    assert_eq!(o(5), "refused:403", "{tier}: CONNECT non-listed: {m:?}");
    assert_eq!(
        o(6),
        "ok:hello allowed.test:".to_string() + &http.to_string(),
        "{tier}: transparent HTTP by Host: {m:?}"
    );
    assert!(
        o(7).starts_with("refused:"),
        "{tier}: transparent other: {m:?}"
    );
    assert_eq!(
        o(8),
        "ok:tls-ok:ping",
        "{tier}: transparent TLS by SNI: {m:?}"
    );
    assert!(
        ["closed", "reset"].contains(&o(9).as_str()),
        "{tier}: private literal: {m:?}"
    );
    assert!(
        ["closed", "reset"].contains(&o(10).as_str()),
        "{tier}: metadata literal: {m:?}"
    );
    assert_eq!(o(11), "ok:127.0.0.1", "{tier}: DNS allowed: {m:?}");
    assert!(o(12).starts_with("error:"), "{tier}: DNS other: {m:?}");
    assert!(o(13).starts_with("error:"), "{tier}: DNS metadata: {m:?}");
    assert!(o(14).starts_with("error:"), "{tier}: UDP: {m:?}");
    assert!(o(15).starts_with("error:"), "{tier}: IPv6: {m:?}");

    // Every decision is in the sandbox's audit log.
    let ev = sb.network_events().await.unwrap();
    assert!(has_event(&ev, "allowed.test", true), "{ev:#?}");
    assert!(has_event(&ev, "other.test", false), "{ev:#?}");
    assert!(has_event(&ev, "meta.test", false), "{ev:#?}");
    let by_ip = |a: &str| {
        ev.iter()
            .any(|e| e.ip == Some(ip(a)) && e.host.is_none() && !e.allowed)
    };
    assert!(by_ip("10.201.0.5"), "{ev:#?}");
    assert!(by_ip("169.254.169.254"), "{ev:#?}");
    assert!(ev.iter().any(|e| e.via == "dns" && e.allowed));
    assert!(ev.iter().any(|e| e.via == "transparent-tls" && e.allowed));
    // The proxy only ever dialed loopback.
    assert!(dialer
        .dials
        .lock()
        .unwrap()
        .iter()
        .all(|a| a.ip().is_loopback()));

    // A policy update takes effect on the next connection, both ways.
    let other = format!("http=http://other.test:{http}/");
    sb.set_network_policy(allow_policy(&["allowed.test", "other.test"]))
        .await
        .unwrap();
    let m = probes(sb.as_ref(), std::slice::from_ref(&other)).await;
    assert_eq!(
        outcome(&m, &other),
        format!("ok:hello other.test:{http}"),
        "{tier}"
    );
    sb.set_network_policy(NetworkPolicy::DenyAll).await.unwrap();
    let allowed = format!("http=http://allowed.test:{http}/");
    let m = probes(sb.as_ref(), std::slice::from_ref(&allowed)).await;
    assert_eq!(outcome(&m, &allowed), "refused:403", "{tier}");

    let links = e.links().await.unwrap();
    assert_eq!(links.len(), 1, "{links:?}");
    sb.destroy().await.unwrap();
    assert!(e.links().await.unwrap().is_empty());
    assert_eq!(
        e.tables().await.unwrap(),
        ["table inet agent_sandbox_egress"]
    );
}

async fn internet_still_refuses_link_local_and_private(b: DynBackend) {
    if let Some(why) = skip_reason(b.as_ref()).await {
        eprintln!("SKIP: {why}");
        return;
    }
    let http = http_server().await;
    let sb = sandbox(
        &b,
        NetworkPolicy::AllowInternet {
            deny: vec![],
            private: vec![],
        },
    )
    .await;
    let list: Vec<String> = vec![
        format!("http=http://meta.test:{http}/"),
        "http=http://169.254.169.254/latest/meta-data/".into(),
        format!("http=http://private.test:{http}/"),
        format!("http=http://allowed.test:{http}/"),
        "direct-tcp=169.254.169.254:80".into(),
        "direct-tcp=10.201.0.5:80".into(),
    ];
    let m = probes(sb.as_ref(), &list).await;
    for probe in &list[..4] {
        assert_eq!(outcome(&m, probe), "refused:403", "{}: {m:?}", b.tier());
    }
    for probe in &list[4..] {
        assert!(
            ["closed", "reset"].contains(&outcome(&m, probe)),
            "{}: {m:?}",
            b.tier()
        );
    }
    let ev = sb.network_events().await.unwrap();
    assert!(ev.len() >= 6 && ev.iter().all(|e| !e.allowed), "{ev:#?}");
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_deny_all_has_no_route() {
    let Some((e, _)) = enforcer() else {
        return;
    };
    deny_all_has_no_route(container(&e)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_deny_all_has_no_route() {
    let Some((e, _)) = enforcer() else {
        return;
    };
    deny_all_has_no_route(gvisor(&e)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_allowlist_end_to_end() {
    let Some((e, d)) = enforcer() else {
        return;
    };
    allowlist_end_to_end(container(&e), &e, &d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_allowlist_end_to_end() {
    let Some((e, d)) = enforcer() else {
        return;
    };
    allowlist_end_to_end(gvisor(&e), &e, &d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_internet_still_refuses_link_local_and_private() {
    let Some((e, _)) = enforcer() else {
        return;
    };
    internet_still_refuses_link_local_and_private(container(&e)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_internet_still_refuses_link_local_and_private() {
    let Some((e, _)) = enforcer() else {
        return;
    };
    internet_still_refuses_link_local_and_private(gvisor(&e)).await;
}

#[cfg(feature = "microvm")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microvm_deny_all_has_no_route() {
    let Some((e, _)) = enforcer() else {
        return;
    };
    deny_all_has_no_route(microvm(&e)).await;
}

#[cfg(feature = "microvm")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microvm_allowlist_end_to_end() {
    let Some((e, d)) = enforcer() else {
        return;
    };
    allowlist_end_to_end(microvm(&e), &e, &d).await;
}

#[cfg(feature = "microvm")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microvm_internet_still_refuses_link_local_and_private() {
    let Some((e, _)) = enforcer() else {
        return;
    };
    internet_still_refuses_link_local_and_private(microvm(&e)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_sandboxes_with_policies_leave_nothing_behind() {
    let Some((e, _)) = enforcer() else {
        return;
    };
    let b = container(&e);
    if let Some(why) = skip_reason(b.as_ref()).await {
        eprintln!("SKIP: {why}");
        return;
    }
    let http = http_server().await;
    let spec = SandboxSpec::builder(Language::Shell)
        .network(allow_policy(&["allowed.test"]))
        .build()
        .unwrap();
    let mut sandboxes = Vec::new();
    for chunk in 0..20 {
        let made =
            futures::future::join_all((0..10).map(|_| b.create(&spec, ResolvedSecrets::none())))
                .await;
        for (i, sb) in made.into_iter().enumerate() {
            sandboxes
                .push(sb.unwrap_or_else(|err| panic!("sandbox {} failed: {err}", chunk * 10 + i)));
        }
    }
    assert_eq!(e.links().await.unwrap().len(), 200);
    assert_eq!(e.proxy().sandboxes().len(), 200);
    // Every one of them has its own working path (spot-check a few, first and last).
    for sb in [&sandboxes[0], &sandboxes[107], &sandboxes[199]] {
        let probe = format!("http=http://allowed.test:{http}/");
        sb.write_file("client.py", CLIENT.as_bytes()).await.unwrap();
        let m = probes(sb.as_ref(), std::slice::from_ref(&probe)).await;
        assert_eq!(outcome(&m, &probe), format!("ok:hello allowed.test:{http}"));
    }
    // Half destroyed explicitly, half dropped (teardown in the background).
    let dropped = sandboxes.split_off(100);
    futures::future::join_all(sandboxes.iter().map(|s| s.destroy())).await;
    drop(dropped);
    let mut left = (usize::MAX, usize::MAX);
    for _ in 0..400 {
        left = (e.links().await.unwrap().len(), e.proxy().sandboxes().len());
        if left == (0, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(left, (0, 0), "links, proxy registrations left");
    // The egress namespace holds only its one shared table.
    assert_eq!(
        e.tables().await.unwrap(),
        ["table inet agent_sandbox_egress"]
    );
    // Nothing of ours ever appeared in the host's own namespace.
    let host_links = std::process::Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&host_links.stdout);
    assert!(!text.contains(": eg"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_snapshot_with_network_is_refused_and_loses_nothing() {
    let Some((e, _)) = enforcer() else {
        return;
    };
    let b = gvisor(&e);
    if let Some(why) = skip_reason(b.as_ref()).await {
        eprintln!("SKIP: {why}");
        return;
    }
    let http = http_server().await;
    let sb = sandbox(&b, allow_policy(&["allowed.test"])).await;
    let dir = tempfile::tempdir().unwrap();
    let store = sandbox_core::ObjectSnapshotStore::local(dir.path()).unwrap();
    // runsc cannot checkpoint host networking: a typed refusal, and the sandbox carries on.
    let err = sb.snapshot(&store).await.unwrap_err();
    assert!(
        matches!(&err, sandbox_core::Error::Unsupported { what, .. } if what.contains("network")),
        "{err}"
    );
    let probe = format!("http=http://allowed.test:{http}/");
    let m = probes(sb.as_ref(), std::slice::from_ref(&probe)).await;
    assert_eq!(outcome(&m, &probe), format!("ok:hello allowed.test:{http}"));
    sb.destroy().await.unwrap();
    assert!(e.links().await.unwrap().is_empty());
}
