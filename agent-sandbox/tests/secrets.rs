#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Proxy-held secrets end to end in the container and gVisor tiers, with real clients inside
//! the sandbox (`curl`, Python's `urllib`) and an HTTPS server on loopback behind a test CA,
//! through the real egress enforcer (`VethEnforcer`): the server receives the real value, the
//! sandbox only ever holds the placeholder (its environment, its files, its processes'
//! environments), an echo comes back masked, and the placeholder sent to another allowed host
//! is refused and recorded as a leak attempt. Tiers that cannot hold such secrets refuse the
//! spec (gVisor without an egress enforcer too). More clients (`requests`, git, pip) and a
//! scan of the sandbox's memory: `secret_clients.rs`.
//!
//! Traffic stays on this machine: the test resolver maps `allowed.test` and `other.test` to
//! 127.0.0.1 and the dialer refuses every other address.

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sandbox_core::{
    DynBackend, Error, ExecRequest, Language, MapSecretSource, NetworkPolicy, ResolvedSecrets,
    SandboxSpec,
};
use sandbox_egress::{
    Dialer, ProxyConfig, StaticResolver, TcpDialer, UpstreamStream, VethEnforcer,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::rustls::{self, pki_types::CertificateDer};

const VALUE: &str = "ghp_REALVALUEofTheToken0123456789abcdefgh";

#[derive(Debug, Default)]
struct GuardDialer;

#[async_trait]
impl Dialer for GuardDialer {
    async fn dial(&self, addr: SocketAddr) -> io::Result<Box<dyn UpstreamStream>> {
        if !addr.ip().is_loopback() {
            return Err(io::Error::other(format!("test dialer refuses {addr}")));
        }
        TcpDialer.dial(addr).await
    }
}

/// An HTTPS server for `allowed.test` behind a fresh test CA, answering each request with the
/// head it received (and recording it); plus that CA.
async fn echo_server() -> (u16, CertificateDer<'static>, Arc<Mutex<Vec<String>>>) {
    use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "agent-sandbox test upstream CA");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut leaf = rcgen::CertificateParams::new(vec!["allowed.test".to_string()]).unwrap();
    leaf.distinguished_name
        .push(rcgen::DnType::CommonName, "allowed.test");
    let leaf = leaf.signed_by(&key, &ca).unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![leaf.der().clone()],
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let h = heads.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let (acceptor, h) = (acceptor.clone(), h.clone());
            tokio::spawn(async move {
                let Ok(mut t) = acceptor.accept(s).await else {
                    return;
                };
                let mut buf = Vec::new();
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    let mut c = [0u8; 4096];
                    match t.read(&mut c).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&c[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf).into_owned();
                h.lock().unwrap().push(head.clone());
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{head}",
                    head.len()
                );
                let _ = t.write_all(resp.as_bytes()).await;
                let _ = t.shutdown().await;
            });
        }
    });
    (port, ca.der().clone(), heads)
}

/// A plain HTTP server on loopback that records what it got.
async fn http_server() -> (u16, Arc<Mutex<Vec<String>>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = got.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let g = g.clone();
            tokio::spawn(async move {
                let mut b = [0u8; 4096];
                let n = s.read(&mut b).await.unwrap_or(0);
                g.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&b[..n]).into_owned());
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await;
            });
        }
    });
    (port, got)
}

fn spec(bound: &str) -> SandboxSpec {
    SandboxSpec::builder(Language::Shell)
        .network(NetworkPolicy::Allow {
            hosts: vec![
                "allowed.test".parse().unwrap(),
                "other.test".parse().unwrap(),
            ],
            cidrs: vec!["127.0.0.1/32".parse().unwrap()],
            ports: vec![],
        })
        .secret_via_proxy("API_TOKEN", "API_TOKEN", [bound])
        .build()
        .unwrap()
}

fn secrets(spec: &SandboxSpec) -> ResolvedSecrets {
    ResolvedSecrets::resolve(
        &spec.secrets,
        &MapSecretSource::new().with("API_TOKEN", VALUE),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_clients_use_a_secret_they_never_hold() {
    clients_use_a_secret_they_never_hold(|e| {
        Arc::new(
            backend_container::ContainerBackend::builder()
                .egress(e)
                .build()
                .unwrap(),
        )
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_clients_use_a_secret_they_never_hold() {
    clients_use_a_secret_they_never_hold(|e| {
        Arc::new(backend_gvisor::GvisorBackend::new(
            backend_gvisor::GvisorConfig::default().egress(e),
        ))
    })
    .await;
}

/// The checks, on the backend `make` builds around the enforcer.
async fn clients_use_a_secret_they_never_hold(
    make: impl FnOnce(Arc<dyn sandbox_core::EgressEnforcer>) -> DynBackend,
) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: the egress enforcer needs root");
        return;
    }
    let (port, upstream_ca, heads) = echo_server().await;
    let (plain_port, plain_got) = http_server().await;
    let e = VethEnforcer::builder()
        .config(ProxyConfig {
            upstream_roots: vec![upstream_ca],
            ..ProxyConfig::default()
        })
        .resolver(Arc::new(
            StaticResolver::new()
                .with("allowed.test", &["127.0.0.1".parse().unwrap()])
                .with("other.test", &["127.0.0.1".parse().unwrap()]),
        ))
        .dialer(Arc::new(GuardDialer))
        .build()
        .unwrap();
    let b = make(Arc::new(e.clone()));
    let status = b.probe().await;
    if !status.available {
        eprintln!("SKIP: {} tier unavailable: {}", b.tier(), status.reason);
        return;
    }
    assert!(b.capabilities().proxy_secrets);
    let spec = spec("allowed.test");
    let sb = b.create(&spec, secrets(&spec)).await.unwrap();
    let run = |code: String| {
        let sb = &sb;
        async move {
            let mut r = ExecRequest::code(code);
            r.timeout = Some(Duration::from_secs(60));
            sb.exec(r).await.unwrap()
        }
    };

    // The sandbox holds a placeholder of the value's length, never the value.
    let r = run("printf %s \"$API_TOKEN\"".into()).await;
    let placeholder = r.stdout_str();
    assert_eq!(placeholder.len(), VALUE.len(), "{r:?}");
    assert_ne!(placeholder, VALUE);

    // curl, with the token in a header and in the query string.
    let r = run(format!(
        "curl -sS -H \"Authorization: Bearer $API_TOKEN\" \
         \"https://allowed.test:{port}/curl?token=$API_TOKEN\""
    ))
    .await;
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    // Python's urllib, through HTTPS_PROXY and SSL_CERT_FILE.
    let r2 = run(format!(
        "python3 -c \"import os, urllib.request as u; \
         q = u.Request('https://allowed.test:{port}/python', \
         headers={{'Authorization': 'Bearer ' + os.environ['API_TOKEN']}}); \
         print(u.urlopen(q, timeout=30).read().decode())\""
    ))
    .await;
    assert_eq!(r2.exit_code, Some(0), "{r2:?}");
    let got = heads.lock().unwrap().clone();
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(
        got[0].contains(&format!("GET /curl?token={VALUE} ")),
        "{}",
        got[0]
    );
    assert!(
        got[0].contains(&format!("Bearer {VALUE}\r\n")),
        "{}",
        got[0]
    );
    assert!(
        got[1].contains(&format!("Bearer {VALUE}\r\n")),
        "{}",
        got[1]
    );
    // Their echoes came back masked.
    for out in [r.stdout_str(), r2.stdout_str()] {
        assert!(out.contains(&placeholder), "{out}");
        assert!(!out.contains(VALUE), "{out}");
    }

    // Nowhere inside: the environment of every process, files the sandbox can read.
    let r = run(format!(
        "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c -- '{VALUE}'; \
         grep -rs -l -- '{VALUE}' /workspace /tmp /etc /dev/shm; echo done"
    ))
    .await;
    assert_eq!(r.stdout_str(), "0\ndone\n", "{r:?}");

    // The placeholder to another allowed host: refused, recorded as a leak attempt.
    let r = run(format!(
        "curl -sS -i \"http://other.test:{plain_port}/?t=$API_TOKEN\""
    ))
    .await;
    assert!(r.stdout_str().starts_with("HTTP/1.1 403"), "{r:?}");
    assert!(plain_got.lock().unwrap().is_empty());
    let events = sb.network_events().await.unwrap();
    assert!(
        events
            .iter()
            .any(|e| !e.allowed && e.rule.contains("leak attempt")),
        "{events:?}"
    );
    assert!(!format!("{events:?}").contains(VALUE));
    sb.destroy().await.unwrap();
}

/// Tiers that cannot hold proxy secrets refuse such a spec, naming the feature; under
/// deny-all the spec itself is invalid (the bound host must be allowed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_tiers_refuse_proxy_held_secrets() {
    let spec = spec("allowed.test");
    for b in [
        Arc::new(backend_wasm::WasmBackend::new()) as DynBackend,
        Arc::new(backend_microvm::MicrovmBackend::new()),
    ] {
        assert!(!b.capabilities().proxy_secrets, "{}", b.tier());
        match b.create(&spec, secrets(&spec)).await {
            Err(Error::Unsupported { what, .. }) => {
                assert!(what.contains("proxy-held secrets"), "{}: {what}", b.tier())
            }
            Err(e) => panic!("{}: expected Unsupported, got {e}", b.tier()),
            Ok(_) => panic!("{}: accepted a proxy-held secret", b.tier()),
        }
    }
    // gVisor holds them only through an egress enforcer, and says how to plug one in.
    let g: DynBackend = Arc::new(backend_gvisor::GvisorBackend::default());
    assert!(!g.capabilities().proxy_secrets);
    match g.create(&spec, secrets(&spec)).await {
        Err(Error::Unsupported { what, tier }) => {
            assert_eq!(tier, sandbox_core::Tier::Gvisor);
            assert!(
                what.contains("proxy-held secrets") && what.contains("GvisorConfig::egress"),
                "{what}"
            );
        }
        Err(e) => panic!("gvisor: expected Unsupported, got {e}"),
        Ok(_) => panic!("gvisor: accepted a proxy-held secret without an enforcer"),
    }
    let denied = SandboxSpec::builder(Language::Shell)
        .secret_via_proxy("API_TOKEN", "API_TOKEN", ["allowed.test"])
        .build();
    assert!(
        matches!(denied, Err(Error::InvalidSpec { .. })),
        "{denied:?}"
    );
}
