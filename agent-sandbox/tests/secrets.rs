#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Proxy-held secrets end to end in the container and gVisor tiers, with real clients inside
//! the sandbox (`curl`, Python's `urllib`) and an HTTPS server on loopback behind a test CA,
//! through the real egress enforcer (`VethEnforcer`): the server receives the real value, the
//! sandbox only ever holds the placeholder (its environment, its files, its processes'
//! environments), an echo comes back masked, and the placeholder sent to another allowed host
//! is refused and recorded as a leak attempt. An image's Python trusts the interception CA in
//! the container, gVisor and microVM tiers (the last where the probe says a Linux guest
//! boots; its guest side runs under QEMU in `backend-microvm/tests/qemu_network.rs`). Tiers
//! that cannot hold such secrets refuse the spec (gVisor and microVM without an egress
//! enforcer too). More clients (`requests`, git, pip) and a scan of the sandbox's memory:
//! `secret_clients.rs`.
//!
//! Traffic stays on this machine: the test resolver maps `allowed.test` and `other.test` to
//! 127.0.0.1 and the dialer refuses every other address.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandbox_core::{
    DynBackend, Error, ExecRequest, Language, MapSecretSource, NetworkPolicy, ResolvedSecrets,
    SandboxSpec, SecretUse,
};
use sandbox_egress::testing::{EchoServer, TestCa};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const VALUE: &str = "ghp_REALVALUEofTheToken0123456789abcdefgh";

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
        // The test sends the token in the query too: granted (headers only by default).
        .secret_via_proxy_in(
            "API_TOKEN",
            "API_TOKEN",
            [bound],
            "header,query".parse().unwrap(),
        )
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
        Arc::new(
            backend_gvisor::GvisorBackend::builder()
                .egress(e)
                .build()
                .unwrap(),
        )
    })
    .await;
}

/// The checks, on the backend `make` builds around the enforcer.
async fn clients_use_a_secret_they_never_hold(
    make: impl FnOnce(Arc<dyn sandbox_core::EgressEnforcer>) -> DynBackend,
) {
    let upstream_ca = TestCa::new("agent-sandbox test upstream CA").unwrap();
    let server = EchoServer::start(&upstream_ca, &["allowed.test"])
        .await
        .unwrap();
    let port = server.port;
    let (plain_port, plain_got) = http_server().await;
    let Some(e) = common::enforcer(upstream_ca.der(), &["allowed.test", "other.test"]) else {
        return;
    };
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
    let got = server.heads();
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
    let leak = events
        .iter()
        .find(|e| e.is_leak_attempt())
        .unwrap_or_else(|| panic!("no leak attempt in {events:?}"));
    assert!(!leak.allowed);
    assert_eq!(leak.host.as_deref(), Some("other.test"));
    assert!(
        matches!(&leak.secret, Some(SecretUse::LeakAttempt { secret, place })
            if secret == "API_TOKEN" && place == "request target"),
        "{leak:?}"
    );
    // And the substitutions before it, by name and place.
    assert!(events.iter().any(|e| matches!(&e.secret,
        Some(SecretUse::Substituted { place, .. }) if place == "header authorization")));
    assert!(!format!("{events:?}").contains(VALUE));

    // Programs that ignore the variables trust the system bundle, which holds the CA too.
    let r = run(format!(
        "env -u SSL_CERT_FILE -u CURL_CA_BUNDLE curl -sS -o /dev/null -w '%{{http_code}}' \
         https://allowed.test:{port}/system-bundle"
    ))
    .await;
    assert_eq!(r.stdout_str(), "200", "{r:?}");

    // A policy update applies to the next request: without the bound host, the credential
    // goes nowhere; with it again, it is substituted again.
    let bound_request = format!(
        "curl -sS -o /dev/null -w '%{{http_code}}' -H \"Authorization: Bearer $API_TOKEN\" \
         https://allowed.test:{port}/after-update"
    );
    let seen = server.heads().len();
    sb.set_network_policy(NetworkPolicy::Allow {
        hosts: vec!["other.test".parse().unwrap()],
        cidrs: vec![],
        ports: vec![],
    })
    .await
    .unwrap();
    let r = run(bound_request.clone()).await;
    assert_ne!(r.stdout_str(), "200", "{r:?}");
    assert_eq!(server.heads().len(), seen, "nothing reached the bound host");
    sb.set_network_policy(spec.network.clone()).await.unwrap();
    let r = run(bound_request).await;
    assert_eq!(r.stdout_str(), "200", "{r:?}");
    let got = server.heads().last().cloned().unwrap_or_default();
    assert!(got.contains(&format!("Bearer {VALUE}")), "{got}");
    sb.destroy().await.unwrap();
}

/// Tiers that cannot hold proxy secrets refuse such a spec, naming the feature; under
/// deny-all the spec itself is invalid (the bound host must be allowed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_tiers_refuse_proxy_held_secrets() {
    let spec = spec("allowed.test");
    for b in [Arc::new(backend_wasm::WasmBackend::builder().build().unwrap()) as DynBackend] {
        assert!(!b.capabilities().proxy_secrets, "{}", b.tier());
        match b.create(&spec, secrets(&spec)).await {
            Err(Error::Unsupported { what, .. }) => {
                assert!(what.contains("proxy-held secrets"), "{}: {what}", b.tier())
            }
            Err(e) => panic!("{}: expected Unsupported, got {e}", b.tier()),
            Ok(_) => panic!("{}: accepted a proxy-held secret", b.tier()),
        }
    }
    // gVisor and microVM hold them only through an egress enforcer, and say how to plug one
    // in.
    for (b, setting) in [
        (
            Arc::new(backend_gvisor::GvisorBackend::builder().build().unwrap()) as DynBackend,
            "GvisorBackendBuilder::egress",
        ),
        (
            Arc::new(backend_microvm::MicrovmBackend::builder().build().unwrap()),
            "MicrovmBackendBuilder::egress",
        ),
    ] {
        assert!(!b.capabilities().proxy_secrets, "{}", b.tier());
        match b.create(&spec, secrets(&spec)).await {
            Err(Error::Unsupported { what, tier }) => {
                assert_eq!(tier, b.tier());
                assert!(
                    what.contains("proxy-held secrets") && what.contains(setting),
                    "{what}"
                );
            }
            Err(e) => panic!("{}: expected Unsupported, got {e}", b.tier()),
            Ok(_) => panic!(
                "{}: accepted a proxy-held secret without an enforcer",
                b.tier()
            ),
        }
    }
    let denied = SandboxSpec::builder(Language::Shell)
        .secret_via_proxy("API_TOKEN", "API_TOKEN", ["allowed.test"])
        .build();
    assert!(
        matches!(denied, Err(Error::InvalidSpec { .. })),
        "{denied:?}"
    );
}

/// A sandbox from an OCI image (the Debian 13 test image that `scripts/test-image.sh`
/// builds) gets the CA in the image's own trust: its Python 3.13 reaches the bound host, and
/// the image's system bundle path holds the CA. Container tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_image_trusts_the_interception_ca() {
    an_image_trusts_the_interception_ca(|e, images| {
        Arc::new(
            backend_container::ContainerBackend::builder()
                .egress(e)
                .image_store(images)
                .build()
                .unwrap(),
        )
    })
    .await;
}

/// The same in the gVisor tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gvisor_image_trusts_the_interception_ca() {
    an_image_trusts_the_interception_ca(|e, images| {
        Arc::new(
            backend_gvisor::GvisorBackend::builder()
                .egress(e)
                .image_store(images)
                .build()
                .unwrap(),
        )
    })
    .await;
}

/// The same in the microVM tier, where the guest agent writes the bundles inside the guest
/// (needs a Linux guest: skips where the probe says it cannot boot one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_microvm_image_trusts_the_interception_ca() {
    an_image_trusts_the_interception_ca(|e, images| {
        Arc::new(
            backend_microvm::MicrovmBackend::builder()
                .egress(e)
                .image_store(images)
                .build()
                .unwrap(),
        )
    })
    .await;
}

async fn an_image_trusts_the_interception_ca(
    make: impl FnOnce(
        Arc<dyn sandbox_core::EgressEnforcer>,
        backend_container::ImageStore,
    ) -> DynBackend,
) {
    let layout = std::env::var_os("AGENT_SANDBOX_TEST_IMAGES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/var/tmp/agent-sandbox-images"))
        .join("trixie-numpy");
    if !layout.join("index.json").is_file() {
        eprintln!(
            "SKIP: no test image at {} (scripts/test-image.sh builds it)",
            layout.display()
        );
        return;
    }
    let upstream_ca = TestCa::new("agent-sandbox test upstream CA").unwrap();
    let server = EchoServer::start(&upstream_ca, &["allowed.test"])
        .await
        .unwrap();
    let Some(e) = common::enforcer(upstream_ca.der(), &["allowed.test"]) else {
        return;
    };
    let e_pem = e.proxy().interception_ca_pem().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let images = backend_container::ImageStore::builder(cache.path())
        .build()
        .unwrap();
    let b = make(Arc::new(e), images);
    let status = b.probe().await;
    if !status.available {
        eprintln!("SKIP: {} tier unavailable: {}", b.tier(), status.reason);
        return;
    }
    let spec = SandboxSpec::builder(Language::Shell)
        .image(format!("oci:{}:python3", layout.display()))
        .network(NetworkPolicy::Allow {
            hosts: vec!["allowed.test".parse().unwrap()],
            // The test server is on loopback, which an allowlist reaches only when named.
            cidrs: vec!["127.0.0.1/32".parse().unwrap()],
            ports: vec![],
        })
        .secret_via_proxy("API_TOKEN", "API_TOKEN", ["allowed.test"])
        .build()
        .unwrap();
    let sb = b.create(&spec, secrets(&spec)).await.unwrap();
    let port = server.port;
    let mut r = ExecRequest::code(format!(
        "python3 -c \"import os, sys, urllib.request as u; \
         q = u.Request('https://allowed.test:{port}/image', \
         headers={{'Authorization': 'Bearer ' + os.environ['API_TOKEN']}}); \
         print('%d.%d' % sys.version_info[:2], u.urlopen(q, timeout=30).status)\""
    ));
    r.timeout = Some(Duration::from_secs(60));
    let r = sb.exec(r).await.unwrap();
    assert_eq!(r.stdout_str(), "3.13 200\n", "{r:?}");
    let got = server.heads().last().cloned().unwrap_or_default();
    assert!(got.contains("GET /image "), "{got}");
    assert!(got.contains(&format!("Bearer {VALUE}\r\n")), "{got}");
    // The image's system bundle path holds the CA as well (this image has no
    // ca-certificates, so that is all it trusts), and the image's own layer is untouched.
    let ca = e_pem.trim().lines().nth(1).unwrap().to_string();
    let r = sb
        .exec(ExecRequest::code(
            "cat /etc/ssl/certs/ca-certificates.crt".to_string(),
        ))
        .await
        .unwrap();
    assert!(r.stdout_str().contains(&ca), "{r:?}");
    sb.destroy().await.unwrap();
}
