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
use sandbox_egress::secrets::{ProxySecret, SecretPlaces, SecretSet};
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

/// The secret substituted in headers and the request target (what the first tests use).
async fn setup(upstream_ca: &TestCa) -> Setup {
    setup_in(upstream_ca, "header,query".parse().unwrap()).await
}

async fn setup_in(upstream_ca: &TestCa, places: SecretPlaces) -> Setup {
    let resolver = StaticResolver::new()
        .with("api.test", &[ip("127.0.0.1")])
        .with("other.test", &[ip("127.0.0.1")])
        .with("bad.test", &[ip("127.0.0.1")]);
    let cfg = ProxyConfig::default().upstream_roots(vec![upstream_ca.der()]);
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
    .unwrap()
    .substitute_in(places);
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
    let slow = ProxyConfig::default()
        .upstream_roots(vec![ca.der()])
        .head_timeout(std::time::Duration::from_millis(300))
        .max_connections_per_sandbox(4);
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

// --- Attacks on masking and on the reading of requests inside intercepted connections ---

/// What a scripted server sends for one request: pieces, each after a pause (ms).
type Pieces = Vec<(u64, Vec<u8>)>;

/// An HTTPS server for `api.test` (behind `ca`) that records every request it receives
/// (head and `Content-Length` body, as received) and answers what `script` says, keeping the
/// connection open until a request says `Connection: close`.
struct Scripted {
    port: u16,
    received: std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
}

impl Scripted {
    async fn start<F>(ca: &TestCa, script: F) -> Scripted
    where
        F: Fn(&str) -> Pieces + Send + Sync + 'static,
    {
        let acceptor = tokio_rustls::TlsAcceptor::from(ca.server_config(&["api.test"]).unwrap());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let script = std::sync::Arc::new(script);
        let rec = received.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = l.accept().await.unwrap();
                let (acceptor, rec, script) = (acceptor.clone(), rec.clone(), script.clone());
                tokio::spawn(async move {
                    let Ok(mut t) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut buf = Vec::new();
                    loop {
                        let end = loop {
                            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break i + 4;
                            }
                            let mut c = [0u8; 4096];
                            match t.read(&mut c).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&c[..n]),
                            }
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                        let len: usize = head
                            .lines()
                            .filter_map(|l| l.strip_prefix("content-length:"))
                            .filter_map(|v| v.trim().parse().ok())
                            .next_back()
                            .unwrap_or(0);
                        let deadline = std::time::Duration::from_secs(2);
                        while buf.len() < end + len {
                            let mut c = [0u8; 4096];
                            match tokio::time::timeout(deadline, t.read(&mut c)).await {
                                Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&c[..n]),
                                _ => break,
                            }
                        }
                        let req: Vec<u8> = buf.drain(..(end + len).min(buf.len())).collect();
                        rec.lock().unwrap().push(req.clone());
                        for (pause, bytes) in script(&String::from_utf8_lossy(&req)) {
                            tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
                            if t.write_all(&bytes).await.is_err() || t.flush().await.is_err() {
                                return;
                            }
                        }
                        if head.contains("connection: close") {
                            let _ = t.shutdown().await;
                            return;
                        }
                    }
                });
            }
        });
        Scripted { port, received }
    }

    fn received(&self) -> Vec<String> {
        self.received
            .lock()
            .unwrap()
            .iter()
            .map(|r| String::from_utf8_lossy(r).into_owned())
            .collect()
    }
}

/// The value of header `name` in a request as the server received it.
fn header<'a>(req: &'a str, name: &str) -> &'a str {
    req.split("\r\n")
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then_some(v.trim())
        })
        .unwrap_or("")
}

/// The path of a request line.
fn path_of(req: &str) -> &str {
    req.split(' ').nth(1).unwrap_or("")
}

/// One response (of several on a connection): its head and its body, de-chunked. `None`
/// when `raw` holds no whole response.
fn next_response(raw: &mut Vec<u8>, to_head: bool) -> Option<(String, Vec<u8>)> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let chunked = header(&head, "transfer-encoding").eq_ignore_ascii_case("chunked");
    let length: Option<usize> = header(&head, "content-length").parse().ok();
    let code = head.split(' ').nth(1).unwrap_or("");
    let mut body = Vec::new();
    let mut at = end;
    if to_head || code.starts_with('1') || code == "204" || code == "304" {
    } else if chunked {
        loop {
            let nl = raw[at..].windows(2).position(|w| w == b"\r\n")? + at;
            let size = usize::from_str_radix(std::str::from_utf8(&raw[at..nl]).ok()?, 16).ok()?;
            at = nl + 2;
            if size == 0 {
                // No trailers in these tests: the blank line.
                (raw.get(at..at + 2)? == b"\r\n").then_some(())?;
                at += 2;
                break;
            }
            body.extend_from_slice(raw.get(at..at + size)?);
            at += size;
            (raw.get(at..at + 2)? == b"\r\n").then_some(())?;
            at += 2;
        }
    } else if let Some(n) = length {
        body.extend_from_slice(raw.get(at..at + n)?);
        at += n;
    } else {
        body.extend_from_slice(&raw[at..]);
        at = raw.len();
    }
    raw.drain(..at);
    Some((head, body))
}

fn chunked_head() -> Vec<u8> {
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec()
}

/// `data` in chunks of `size` bytes, with the last chunk.
fn chunks(data: &[u8], size: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for c in data.chunks(size) {
        out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// A server that echoes the (substituted) bearer token of the request back, split the way
/// the request's path says.
fn echo_token_split(req: &str) -> Pieces {
    let token = header(req, "authorization")
        .strip_prefix("Bearer ")
        .unwrap_or("")
        .to_owned();
    let body = format!("echo: {token} end");
    let half = "echo: ".len() + token.len() / 2;
    let (a, b) = body.as_bytes().split_at(half);
    match path_of(req) {
        // Chunk framing between the halves (and, below, around every 3 bytes), in one write.
        "/chunked" => {
            let mut all = chunked_head();
            all.extend_from_slice(format!("{:x}\r\n", a.len()).as_bytes());
            all.extend_from_slice(a);
            all.extend_from_slice(b"\r\n");
            all.extend(chunks(b, b.len()));
            vec![(0, all)]
        }
        "/tiny-chunks" => {
            let mut all = chunked_head();
            all.extend(chunks(body.as_bytes(), 3));
            vec![(0, all)]
        }
        // Half, a pause longer than any hold timer, the rest.
        "/pause" => {
            let mut first = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )
            .into_bytes();
            first.extend_from_slice(a);
            vec![(0, first), (500, b.to_vec())]
        }
        "/chunked-pause" => {
            let mut first = chunked_head();
            first.extend_from_slice(format!("{:x}\r\n", a.len()).as_bytes());
            first.extend_from_slice(a);
            first.extend_from_slice(b"\r\n");
            vec![(0, first), (500, chunks(b, b.len()))]
        }
        // Until the server closes, paused in the middle.
        _ => {
            let mut first = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n".to_vec();
            first.extend_from_slice(a);
            vec![(0, first), (500, b.to_vec())]
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_split_by_chunk_framing_or_a_pause_is_still_masked() {
    let ca = TestCa::new("test upstream CA").unwrap();
    let server = Scripted::start(&ca, echo_token_split).await;
    let s = setup_in(&ca, SecretPlaces::default()).await;
    let ph = s.placeholder.clone();
    let api = format!("api.test:{}", server.port);
    let mut failures = Vec::new();
    guard(async {
        for path in [
            "/chunked",
            "/tiny-chunks",
            "/pause",
            "/chunked-pause",
            "/close",
        ] {
            let mut t = intercepted(&s, &api).await;
            t.write_all(
                format!(
                    "GET {path} HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer {ph}\r\n\
                     Connection: close\r\n\r\n"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
            let mut raw = Vec::new();
            let _ = t.read_to_end(&mut raw).await;
            let text = String::from_utf8_lossy(&raw).into_owned();
            // What the sandbox reads, framing removed: the placeholder, whole.
            let body = next_response(&mut raw, false)
                .filter(|(head, _)| head.starts_with("HTTP/1.1 200"))
                .map(|(_, body)| String::from_utf8_lossy(&body).into_owned());
            if text.contains(VALUE) || body.as_deref() != Some(&format!("echo: {ph} end")) {
                failures.push(format!("{path}: {text:?}"));
            }
        }
    })
    .await;
    // Every case is tried; all that failed are named.
    assert!(failures.is_empty(), "{failures:#?}");
    // The server did get the value each time.
    let got = server.received();
    assert_eq!(got.len(), 5);
    assert!(got.iter().all(|r| r.contains(&format!("Bearer {VALUE}"))));
}

/// A server that stores what it is sent and gives it back encoded: the body, and the bearer
/// token, in base64 (standard, URL-safe, behind 1 and 2 bytes), hex and percent-encoding.
fn echo_encoded(req: &str) -> Pieces {
    use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
    use base64::Engine as _;
    let body = req.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let token = header(req, "authorization");
    let mut lines = Vec::new();
    for (what, data) in [("body", body), ("auth", token)] {
        let data = data.as_bytes();
        let with = |pre: &[u8]| [pre, data].concat();
        lines.push(format!("{what} b64 {}", STANDARD.encode(data)));
        lines.push(format!("{what} b64url {}", URL_SAFE_NO_PAD.encode(data)));
        lines.push(format!("{what} b64+1 {}", STANDARD.encode(with(b"x"))));
        lines.push(format!("{what} b64+2 {}", STANDARD.encode(with(b"xy"))));
        lines.push(format!(
            "{what} hex {}",
            data.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ));
        lines.push(format!(
            "{what} HEX {}",
            data.iter().map(|b| format!("{b:02X}")).collect::<String>()
        ));
        lines.push(format!(
            "{what} pct {}",
            data.iter()
                .map(|b| {
                    if b.is_ascii_alphanumeric() || b"-._~".contains(b) {
                        char::from(*b).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect::<String>()
        ));
        lines.push(format!(
            "{what} pct-all {}",
            data.iter().map(|b| format!("%{b:02x}")).collect::<String>()
        ));
    }
    let text = lines.join("\n") + "\n";
    vec![(
        0,
        format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        )
        .into_bytes(),
    )]
}

/// Decodes one line of [`echo_encoded`]'s answer.
fn decode_line(line: &str) -> (String, Vec<u8>) {
    use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
    use base64::Engine as _;
    let mut parts = line.splitn(3, ' ');
    let (what, form, data) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap_or(""),
    );
    let unhex = |x: &str| -> Vec<u8> {
        (0..x.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&x[i..i + 2], 16).unwrap())
            .collect()
    };
    let unpct = |x: &str| -> Vec<u8> {
        let b = x.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                out.push(u8::from_str_radix(&x[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                out.push(b[i]);
                i += 1;
            }
        }
        out
    };
    let decoded = match form {
        "b64" | "b64+1" | "b64+2" => STANDARD.decode(data).unwrap(),
        "b64url" => URL_SAFE_NO_PAD.decode(data).unwrap(),
        "hex" | "HEX" => unhex(data),
        _ => unpct(data),
    };
    (format!("{what} {form}"), decoded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_value_read_back_encoded_is_masked() {
    let ca = TestCa::new("test upstream CA").unwrap();
    let server = Scripted::start(&ca, echo_encoded).await;
    // The body granted: the server stores the real value, then gives it back encoded.
    let s = setup_in(&ca, "header,body".parse().unwrap()).await;
    let ph = s.placeholder.clone();
    let api = format!("api.test:{}", server.port);
    let body = format!("{{\"secret\": \"{ph}\", \"note\": \"kept?\"}}");
    let reply = guard(async {
        let mut t = intercepted(&s, &api).await;
        t.write_all(
            format!(
                "POST /store HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer {ph}\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        until_closed(&mut t).await
    })
    .await;
    let got = server.received();
    assert!(got[0].ends_with(&body.replace(&ph, VALUE)), "{}", got[0]);
    let (_, text) = reply.split_once("\r\n\r\n").expect(&reply);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 16, "{text}");
    for line in lines {
        let (form, decoded) = decode_line(line);
        let decoded = String::from_utf8_lossy(&decoded).into_owned();
        // Decoded, never the value: the placeholder (all but a few bits at its ends when
        // the encoding's groups straddle it).
        assert!(!decoded.contains(VALUE), "{form}: {decoded}");
        assert!(
            decoded.contains(&ph[1..ph.len() - 1]),
            "{form}: {decoded} (placeholder {ph})"
        );
    }
    assert!(!reply.contains(VALUE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_and_query_placeholders_are_substituted_only_where_granted() {
    let ca = TestCa::new("test upstream CA").unwrap();
    let ok = |_: &str| -> Pieces {
        vec![(
            0,
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok".to_vec(),
        )]
    };
    for (places, query, body) in [
        ("header", false, false),
        ("header,body", false, true),
        ("header,query", true, false),
        ("header,query,body", true, true),
    ] {
        let server = Scripted::start(&ca, ok).await;
        let s = setup_in(&ca, places.parse().unwrap()).await;
        let ph = s.placeholder.clone();
        let api = format!("api.test:{}", server.port);
        let payload = format!("token={ph}");
        guard(async {
            let mut t = intercepted(&s, &api).await;
            t.write_all(
                format!(
                    "POST /q?t={ph} HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer {ph}\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{payload}",
                    payload.len()
                )
                .as_bytes(),
            )
            .await
            .unwrap();
            let reply = until_closed(&mut t).await;
            assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        })
        .await;
        let got = server.received();
        let req = &got[0];
        assert_eq!(header(req, "authorization"), format!("Bearer {VALUE}"));
        let want = |granted: bool| if granted { VALUE } else { ph.as_str() };
        assert_eq!(path_of(req), format!("/q?t={}", want(query)), "{places}");
        assert!(
            req.ends_with(&format!("\r\n\r\ntoken={}", want(body))),
            "{places}: {req}"
        );
        // The audit names what was substituted, and only that.
        let places_audited: Vec<String> =
            s.h.proxy
                .audit("sb")
                .unwrap()
                .iter()
                .filter_map(|e| match &e.rule {
                    AuditRule::SecretSubstituted { place, .. } => Some(place.clone()),
                    _ => None,
                })
                .collect();
        assert_eq!(
            places_audited.len(),
            1 + usize::from(query) + usize::from(body),
            "{places}: {places_audited:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_requests_are_refused_before_anything_is_substituted() {
    let ca = TestCa::new("test upstream CA").unwrap();
    let server = Scripted::start(&ca, |req: &str| -> Pieces {
        let body = format!("got {}", path_of(req));
        vec![(
            0,
            format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes(),
        )]
    })
    .await;
    let s = setup_in(&ca, SecretPlaces::ALL).await;
    let ph = s.placeholder.clone();
    let port = server.port;
    let api = format!("api.test:{port}");
    let auth = format!("Authorization: Bearer {ph}\r\n");
    let cases = [
        // The last Host would be ours, the first another's.
        format!("GET / HTTP/1.1\r\nHost: other.test\r\nHost: api.test\r\n{auth}\r\n"),
        format!("GET / HTTP/1.1\r\nHost: api.test\r\nHost: api.test\r\n{auth}\r\n"),
        // Two lengths: which one ends the request decides where the next one starts.
        format!(
            "POST / HTTP/1.1\r\nHost: api.test\r\nContent-Length: 0\r\nContent-Length: 5\r\n\
             {auth}\r\nhello"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: api.test\r\nContent-Length: 5\r\nContent-Length: 5\r\n\
             {auth}\r\nhello"
        ),
        format!("POST / HTTP/1.1\r\nHost: api.test\r\nContent-Length: +5\r\n{auth}\r\nhello"),
        // Transfer codings other than exactly chunked, or with a length.
        format!(
            "POST / HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: gzip, chunked\r\n{auth}\r\n\
             0\r\n\r\n"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunkedx\r\n{auth}\r\n\
             0\r\n\r\n"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\
             Transfer-Encoding: chunked\r\n{auth}\r\n0\r\n\r\n"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\
             Content-Length: 5\r\n{auth}\r\n0\r\n\r\n"
        ),
        // A target naming another host than Host and the connection.
        format!("GET https://other.test/ HTTP/1.1\r\nHost: api.test\r\n{auth}\r\n"),
        format!("GET http://other.test:{port}/ HTTP/1.1\r\nHost: api.test\r\n{auth}\r\n"),
        format!("GET https://api.test@other.test/ HTTP/1.1\r\nHost: api.test\r\n{auth}\r\n"),
        format!("GET https://api.test:1/ HTTP/1.1\r\nHost: api.test\r\n{auth}\r\n"),
        format!("GET other.test:443 HTTP/1.1\r\nHost: api.test\r\n{auth}\r\n"),
    ];
    // Every case is tried (each bounded in time); all that failed are named.
    let mut failures = Vec::new();
    for req in &cases {
        let reply = tokio::time::timeout(std::time::Duration::from_secs(3), async {
            let mut t = intercepted(&s, &api).await;
            let _ = t.write_all(req.as_bytes()).await;
            until_closed(&mut t).await
        })
        .await
        .unwrap_or_else(|_| "(no reply in 3 s)".into());
        // Nothing was sent upstream: not a request, not the value.
        let upstream = server.received.lock().unwrap().drain(..).count();
        if !reply.starts_with("HTTP/1.1 400") || reply.contains(VALUE) || upstream > 0 {
            failures.push(format!(
                "{req:?}\n  => {reply:?}, {upstream} request(s) upstream"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    let malformed =
        s.h.proxy
            .audit("sb")
            .unwrap()
            .iter()
            .filter(|e| matches!(e.rule, AuditRule::Malformed(_)))
            .count();
    assert_eq!(malformed, cases.len());
    // An absolute target naming this very host and port is fine: sent on in origin form.
    guard(async {
        let mut t = intercepted(&s, &api).await;
        t.write_all(
            format!(
                "GET https://API.test:{port}/ok?x=1 HTTP/1.1\r\nHost: api.test\r\n{auth}\
                 Connection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let reply = until_closed(&mut t).await;
        assert!(reply.ends_with("got /ok?x=1"), "{reply}");
    })
    .await;
    let got = server.received();
    assert_eq!(got.len(), 1);
    assert!(got[0].starts_with("GET /ok?x=1 HTTP/1.1\r\n"), "{}", got[0]);
    assert!(got[0].contains(&format!("Bearer {VALUE}")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_alive_responses_keep_their_framing_through_the_masker() {
    let ca = TestCa::new("test upstream CA").unwrap();
    let server = Scripted::start(&ca, |req: &str| -> Pieces {
        let token = header(req, "authorization")
            .strip_prefix("Bearer ")
            .unwrap_or("")
            .to_owned();
        let close = if header(req, "connection") == "close" {
            "Connection: close\r\n"
        } else {
            ""
        };
        let p = path_of(req);
        let resp = match p {
            // HEAD: a length, no body.
            "/head" => "HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n".to_owned(),
            "/early" => format!(
                "HTTP/1.1 103 Early Hints\r\nLink: </{token}>\r\n\r\n\
                 HTTP/1.1 204 No Content\r\n{close}\r\n"
            ),
            "/chunked" => {
                let body = format!("a{token}b");
                let mut s = format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n{close}\r\n");
                s.push_str(&String::from_utf8(chunks(body.as_bytes(), 5)).unwrap());
                s
            }
            // A value that ends the body exactly where a next response begins.
            _ => {
                let body = format!("x{}", &token[..token.len() / 2]);
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Echo: {token}\r\n{close}\r\n{body}",
                    body.len()
                )
            }
        };
        vec![(0, resp.into_bytes())]
    })
    .await;
    let s = setup_in(&ca, SecretPlaces::default()).await;
    let ph = s.placeholder.clone();
    let api = format!("api.test:{}", server.port);
    guard(async {
        let mut t = intercepted(&s, &api).await;
        let mut raw = Vec::new();
        let reqs = ["/half", "/head", "/chunked", "/early", "/half"];
        for (i, p) in reqs.iter().enumerate() {
            let method = if *p == "/head" { "HEAD" } else { "GET" };
            let close = if i + 1 == reqs.len() {
                "Connection: close\r\n"
            } else {
                ""
            };
            t.write_all(
                format!(
                    "{method} {p} HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer {ph}\r\n\
                     {close}\r\n"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
            // Each answer arrives whole before the next request is sent: nothing waits
            // on held bytes, a HEAD's length or a chunked body's end.
            let (head, body) = loop {
                if let Some(r) = next_response(&mut raw, *p == "/head") {
                    if r.0.starts_with("HTTP/1.1 103") {
                        assert!(r.0.contains(&format!("Link: </{ph}>")), "{}", r.0);
                        continue;
                    }
                    break r;
                }
                let mut c = [0u8; 4096];
                let n = t.read(&mut c).await.unwrap();
                assert!(
                    n > 0,
                    "{p}: closed early: {}",
                    String::from_utf8_lossy(&raw)
                );
                raw.extend_from_slice(&c[..n]);
            };
            let body = String::from_utf8(body).unwrap();
            match *p {
                "/head" => assert!(body.is_empty()),
                "/early" => assert!(head.starts_with("HTTP/1.1 204"), "{head}"),
                "/chunked" => assert_eq!(body, format!("a{ph}b")),
                _ => {
                    assert!(head.contains(&format!("X-Echo: {ph}\r\n")), "{head}");
                    assert_eq!(body, format!("x{}", &VALUE[..VALUE.len() / 2]));
                }
            }
        }
        let mut rest = Vec::new();
        let _ = t.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    })
    .await;
    assert_eq!(server.received().len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_in_a_transfer_coding_the_masker_cannot_read_is_refused() {
    let ca = TestCa::new("test upstream CA").unwrap();
    let server = Scripted::start(&ca, |_: &str| -> Pieces {
        vec![(
            0,
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n\
              5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
        )]
    })
    .await;
    let s = setup_in(&ca, SecretPlaces::default()).await;
    let ph = s.placeholder.clone();
    let api = format!("api.test:{}", server.port);
    let reply = guard(async {
        let mut t = intercepted(&s, &api).await;
        // A TE asking for gzip is not passed on either.
        t.write_all(
            format!(
                "GET / HTTP/1.1\r\nHost: api.test\r\nTE: gzip\r\nAuthorization: Bearer {ph}\r\n\
                 Connection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        until_closed(&mut t).await
    })
    .await;
    assert!(reply.starts_with("HTTP/1.1 502"), "{reply}");
    assert!(reply.contains("transfer coding"), "{reply}");
    let got = server.received();
    assert!(!got[0].to_lowercase().contains("\r\nte:"), "{}", got[0]);
}
