#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Proxy-held secrets through the real proxy, with `curl` as the client (through the explicit
//! proxy, trusting the interception CA as a sandbox would) and HTTPS servers on loopback
//! behind a test CA: the server receives the real value, the client only ever sees the
//! placeholder, placeholders to other hosts are refused, bad upstream certificates and
//! pinning clients fail closed, and revoking a secret takes effect on the next request.

mod common;

use std::net::SocketAddr;
use std::process::Command;

use common::*;
use rustls::pki_types::CertificateDer;
use sandbox_core::Secret;
use sandbox_egress::secrets::{ProxySecret, SecretSet};
use sandbox_egress::testing::{EchoServer, TestCa};
use sandbox_egress::{AuditRule, ProxyConfig, StaticResolver};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const VALUE: &str = "sk-live-REALVALUE-0123456789abcdef";

struct Setup {
    h: Harness,
    proxy: SocketAddr,
    placeholder: String,
    dir: tempfile::TempDir,
}

impl Setup {
    /// The interception CA's certificate, as a sandbox gets it.
    fn ca_file(&self) -> String {
        let p = self.dir.path().join("intercept-ca.pem");
        std::fs::write(&p, self.h.proxy.interception_ca_pem().unwrap()).unwrap();
        p.display().to_string()
    }

    fn file(&self, name: &str, pem: &str) -> String {
        let p = self.dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p.display().to_string()
    }
}

async fn setup(upstream_ca: &TestCa) -> Setup {
    let resolver = StaticResolver::new()
        .with("api.test", &[ip("127.0.0.1")])
        .with("other.test", &[ip("127.0.0.1")])
        .with("bad.test", &[ip("127.0.0.1")]);
    let cfg = ProxyConfig {
        upstream_roots: vec![upstream_ca.der()],
        ..ProxyConfig::default()
    };
    let h = Harness::with_config_and_resolver(cfg, resolver);
    let reg = h
        .proxy
        .register("sb", policy(&["api.test", "other.test", "bad.test"]))
        .await
        .unwrap();
    let secret = ProxySecret::new(
        "API_TOKEN",
        Secret::new(VALUE),
        vec!["api.test".parse().unwrap(), "bad.test".parse().unwrap()],
    )
    .unwrap();
    let placeholder = secret.placeholder().to_string();
    h.proxy
        .set_secrets("sb", SecretSet::new(vec![secret]))
        .unwrap();
    Setup {
        h,
        proxy: reg.proxy_addr,
        placeholder,
        dir: tempfile::tempdir().unwrap(),
    }
}

/// Runs curl (blocking, off the runtime): exit code, stdout, stderr.
async fn curl(args: Vec<String>) -> (i32, String, String) {
    let out = guard(tokio::task::spawn_blocking(move || {
        Command::new("curl")
            .args(["-sS", "--max-time", "20"])
            .args(&args)
            .env_remove("http_proxy")
            .env_remove("https_proxy")
            .env_remove("HTTPS_PROXY")
            .env_remove("ALL_PROXY")
            .output()
            .unwrap()
    }))
    .await
    .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn curl_missing() -> bool {
    let missing = Command::new("curl").arg("--version").output().is_err();
    if missing {
        eprintln!("SKIP: curl is not installed");
    }
    missing
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_gets_the_value_and_the_client_only_the_placeholder() {
    if curl_missing() {
        return;
    }
    let ca = TestCa::new("test upstream CA").unwrap();
    let server = EchoServer::start(&ca, &["api.test"]).await.unwrap();
    let s = setup(&ca).await;
    let ph = s.placeholder.clone();
    assert_eq!(ph.len(), VALUE.len());
    let url = |q: &str| format!("https://api.test:{}/echo?{q}", server.port);
    // Two requests on one kept-alive connection, a bearer header, a query string, Basic
    // credentials and a cookie.
    let (code, out, err) = curl(vec![
        "--proxy".into(),
        format!("http://{}", s.proxy),
        "--cacert".into(),
        s.ca_file(),
        "-H".into(),
        format!("Authorization: Bearer {ph}"),
        "-H".into(),
        format!("Cookie: session={ph}"),
        url(&format!("token={ph}")),
        url("second=1"),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    let heads = server.heads();
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(
        heads[0].contains(&format!("GET /echo?token={VALUE} ")),
        "{}",
        heads[0]
    );
    assert!(
        heads[0].contains(&format!("Authorization: Bearer {VALUE}\r\n")),
        "{}",
        heads[0]
    );
    assert!(
        heads[0].contains(&format!("Cookie: session={VALUE}\r\n")),
        "{}",
        heads[0]
    );
    assert!(
        heads[0].contains("Accept-Encoding: identity\r\n"),
        "{}",
        heads[0]
    );
    assert!(
        heads[1].contains(&format!("Authorization: Bearer {VALUE}\r\n")),
        "{}",
        heads[1]
    );
    assert!(!heads.iter().any(|h| h.contains(&ph)), "{heads:?}");
    // The echo came back with the placeholder, never the value.
    assert!(!out.contains(VALUE), "{out}");
    assert_eq!(out.matches(&ph).count(), 5, "{out}");
    // Audited by secret name and place.
    let audit = s.h.proxy.audit("sb").unwrap();
    let places: Vec<String> = audit
        .iter()
        .filter_map(|e| match &e.rule {
            AuditRule::SecretSubstituted { secret, place } => {
                assert_eq!(secret, "API_TOKEN");
                Some(place.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        places,
        [
            "request target",
            "header authorization",
            "header cookie",
            "header authorization",
            "header cookie"
        ]
    );
    assert!(!format!("{audit:?}").contains(VALUE));

    // Basic credentials, as `git clone https://x-access-token:$TOKEN@host/...` sends them.
    let (code, _, err) = curl(vec![
        "--proxy".into(),
        format!("http://{}", s.proxy),
        "--cacert".into(),
        s.ca_file(),
        "-u".into(),
        format!("x-access-token:{ph}"),
        url("basic=1"),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    use base64::Engine as _;
    let want = base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{VALUE}"));
    let last = server.heads().last().cloned().unwrap();
    assert!(
        last.contains(&format!("Authorization: Basic {want}\r\n")),
        "{last}"
    );

    // Revoked: the next request is not intercepted any more (spliced to the real server,
    // which the client now must trust itself), and the placeholder arrives as it is.
    s.h.proxy.set_secrets("sb", SecretSet::default()).unwrap();
    let (code, _, err) = curl(vec![
        "--proxy".into(),
        format!("http://{}", s.proxy),
        "--cacert".into(),
        s.file("upstream-ca.pem", &ca.pem()),
        "-H".into(),
        format!("Authorization: Bearer {ph}"),
        url("revoked=1"),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    let last = server.heads().last().cloned().unwrap();
    assert!(
        last.contains(&format!("Authorization: Bearer {ph}\r\n")),
        "{last}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placeholders_to_other_hosts_and_bad_certificates_fail_closed() {
    if curl_missing() {
        return;
    }
    let ca = TestCa::new("test upstream CA").unwrap();
    let s = setup(&ca).await;
    let ph = s.placeholder.clone();
    // Plain HTTP to an allowed host the secret is not bound to: refused, audited.
    let port = http_server().await;
    let (code, out, err) = curl(vec![
        "-i".into(),
        "--proxy".into(),
        format!("http://{}", s.proxy),
        "-H".into(),
        format!("X-Exfil: {ph}"),
        format!("http://other.test:{port}/"),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("HTTP/1.1 403"), "{out}");
    assert!(out.contains("secret-leak-refused"), "{out}");
    let leak =
        s.h.proxy
            .audit("sb")
            .unwrap()
            .into_iter()
            .find(|e| matches!(e.rule, AuditRule::SecretLeakAttempt { .. }))
            .expect("a leak attempt in the audit log");
    assert!(!leak.allowed);
    assert_eq!(leak.host.as_deref(), Some("other.test"));

    // A bound host whose certificate does not verify (self-signed, not a trusted root):
    // nothing is sent to it, the client gets a 502.
    let rogue = TestCa::new("test upstream CA").unwrap();
    let bad = EchoServer::start(&rogue, &["bad.test"]).await.unwrap();
    let (code, out, err) = curl(vec![
        "-i".into(),
        "--proxy".into(),
        format!("http://{}", s.proxy),
        "--cacert".into(),
        s.ca_file(),
        "-H".into(),
        format!("Authorization: Bearer {ph}"),
        format!("https://bad.test:{}/", bad.port),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    // (curl -i shows the proxy's answer to CONNECT first.)
    assert!(out.contains("\r\n\r\nHTTP/1.1 502"), "{out}");
    assert!(bad.heads().is_empty());
    assert!(s
        .h
        .proxy
        .audit("sb")
        .unwrap()
        .iter()
        .any(|e| e.rule.to_string().contains("did not verify")));

    // A client that trusts only its own roots (pinning, in effect) refuses the leaf.
    let server = EchoServer::start(&ca, &["api.test"]).await.unwrap();
    let (code, _, _) = curl(vec![
        "--proxy".into(),
        format!("http://{}", s.proxy),
        "--cacert".into(),
        s.file("upstream-ca.pem", &ca.pem()),
        format!("https://api.test:{}/", server.port),
    ])
    .await;
    assert_eq!(code, 60, "curl's certificate-verification failure");
    assert!(server.heads().is_empty());

    // The inner Host must be the host the connection was decided for.
    let (code, out, err) = curl(vec![
        "-i".into(),
        "--proxy".into(),
        format!("http://{}", s.proxy),
        "--cacert".into(),
        s.ca_file(),
        "-H".into(),
        "Host: other.test".into(),
        format!("https://api.test:{}/", server.port),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\r\n\r\nHTTP/1.1 421"), "{out}");
    assert!(server.heads().is_empty());
}

/// A TLS client of the proxy's interception, through a CONNECT tunnel to `target`, trusting
/// the interception CA as a sandbox does.
async fn intercepted(
    s: &Setup,
    target: &str,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    use rustls::pki_types::pem::PemObject;
    let (head, tcp) = connect(s.proxy, target).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let pem = s.h.proxy.interception_ca_pem().unwrap();
    let cfg = sandbox_egress::testing::client_config_trusting(
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap(),
    )
    .unwrap();
    let name =
        rustls::pki_types::ServerName::try_from(target.rsplit_once(':').unwrap().0.to_string())
            .unwrap();
    tokio_rustls::TlsConnector::from(cfg)
        .connect(name, tcp)
        .await
        .unwrap()
}

/// Reads until the peer closes (or fails): what it sent.
async fn until_closed<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> String {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_are_refused_and_hold_nothing() {
    let ca = TestCa::new("test upstream CA").unwrap();
    let server = EchoServer::start(&ca, &["api.test"]).await.unwrap();
    let mut s = setup(&ca).await;
    let ph = s.placeholder.clone();
    let api = format!("api.test:{}", server.port);
    guard(async {
        // A placeholder inside a CONNECT, to an unbound host (in the target's name, where
        // only a resolver would see it, and in a header), and even to a bound one: the
        // CONNECT is addressed to the proxy, so no secret may travel in it.
        for (target, extra, place) in [
            (
                format!("{ph}.other.test:443"),
                String::new(),
                "request target",
            ),
            (
                "other.test:443".to_string(),
                format!("X-Exfil: {ph}\r\n"),
                "header x-exfil",
            ),
            (api.clone(), format!("X-Exfil: {ph}\r\n"), "header x-exfil"),
        ] {
            let mut c = tokio::net::TcpStream::connect(s.proxy).await.unwrap();
            c.write_all(format!("CONNECT {target} HTTP/1.1\r\n{extra}\r\n").as_bytes())
                .await
                .unwrap();
            let reply = until_closed(&mut c).await;
            assert!(reply.starts_with("HTTP/1.1 403"), "{target}: {reply}");
            assert!(reply.contains("secret-leak-refused"), "{reply}");
            assert!(!reply.contains(VALUE));
            let audit = s.h.proxy.audit("sb").unwrap();
            let last = audit.last().unwrap();
            assert!(
                matches!(&last.rule, AuditRule::SecretLeakAttempt { place: p, .. } if p == place),
                "{target}: {:?}",
                last.rule
            );
        }
        // Through an intercepted connection: an oversized head, a header flood, garbage. Each
        // gets a clear status, and nothing reaches the server.
        let huge = format!(
            "GET / HTTP/1.1\r\nHost: api.test\r\nX-Big: {}\r\n\r\n",
            "a".repeat(200 * 1024)
        );
        let flood = format!(
            "GET / HTTP/1.1\r\nHost: api.test\r\n{}\r\n",
            (0..500)
                .map(|i| format!("X-H{i}: v\r\n"))
                .collect::<String>()
        );
        for (req, status) in [
            (huge, "431"),
            (flood, "400"),
            ("\x16\x03\x01 not http\r\n\r\n".to_string(), "400"),
        ] {
            let mut t = intercepted(&s, &api).await;
            let _ = t.write_all(req.as_bytes()).await;
            let reply = until_closed(&mut t).await;
            assert!(
                reply.starts_with(&format!("HTTP/1.1 {status}")),
                "want {status}: {reply}"
            );
        }
        assert!(server.heads().is_empty());
    })
    .await;

    // Slow clients (half a head, then nothing) are cut off by the head timeout and free
    // their connection slots: with 4 slots, 4 stalled clients, then a real request works.
    let slow = ProxyConfig {
        upstream_roots: vec![ca.der()],
        head_timeout: std::time::Duration::from_millis(300),
        max_connections_per_sandbox: 4,
        ..ProxyConfig::default()
    };
    s.h = Harness::with_config_and_resolver(
        slow,
        StaticResolver::new().with("api.test", &[ip("127.0.0.1")]),
    );
    let reg =
        s.h.proxy
            .register("sb", policy(&["api.test"]))
            .await
            .unwrap();
    s.proxy = reg.proxy_addr;
    let secret = ProxySecret::new(
        "API_TOKEN",
        Secret::new(VALUE),
        vec!["api.test".parse().unwrap()],
    )
    .unwrap();
    let ph = secret.placeholder().to_string();
    s.h.proxy
        .set_secrets("sb", SecretSet::new(vec![secret]))
        .unwrap();
    guard(async {
        let mut stalled = Vec::new();
        for _ in 0..4 {
            let mut t = intercepted(&s, &api).await;
            t.write_all(b"GET / HTTP/1.1\r\nHost: api.te")
                .await
                .unwrap();
            stalled.push(t);
        }
        for t in &mut stalled {
            // Closed by the proxy, without a request having been sent upstream.
            until_closed(t).await;
        }
        let mut t = intercepted(&s, &api).await;
        t.write_all(
            format!(
                "GET /after HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer {ph}\r\n\
                 Connection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let reply = until_closed(&mut t).await;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        // The echo shows what the server got, masked on the way back.
        assert!(reply.contains(&format!("Bearer {ph}")), "{reply}");
        assert!(!reply.contains(VALUE));
    })
    .await;
    let heads = server.heads();
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(heads[0].contains(&format!("Bearer {VALUE}")));
}
