//! Bearer-token auth as the big public registries do it (Docker Hub, GHCR): the registry
//! answers 401 with a `WWW-Authenticate: Bearer realm=...` challenge, the client asks the
//! token server (anonymously, or with basic credentials) and retries with the token. The
//! registry is the real CNCF one configured for token auth; the token server is ours (a few
//! lines of HTTP issuing ES256 JWTs with an `x5c` certificate the registry trusts): anonymous
//! pulls of `public/*`, credentials needed for `private/*`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use common::{Comp, Entry, Layout, Registry};
use sandbox_image::{Credentials, ImageError, ImageRef, ImageStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ISSUER: &str = "test-issuer";
const SERVICE: &str = "test-registry";

fn b64url(b: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

/// The token server's signing identity: a self-signed P-256 certificate (also the registry's
/// `rootcertbundle`) and its key.
struct Signer {
    cert_der: Vec<u8>,
    cert_pem: String,
    key: ring::signature::EcdsaKeyPair,
}

fn signer() -> Signer {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["token-server".to_string()]).unwrap();
    let cert = params.self_signed(&key).unwrap();
    let rng = ring::rand::SystemRandom::new();
    let pair = ring::signature::EcdsaKeyPair::from_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        &key.serialize_der(),
        &rng,
    )
    .unwrap();
    Signer {
        cert_der: cert.der().to_vec(),
        cert_pem: cert.pem(),
        key: pair,
    }
}

impl Signer {
    /// A registry token granting `actions` on `repo` to `sub`.
    fn token(&self, sub: &str, repo: &str, actions: &[&str]) -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let header = serde_json::json!({
            "typ": "JWT", "alg": "ES256",
            "x5c": [base64::engine::general_purpose::STANDARD.encode(&self.cert_der)],
        });
        let claims = serde_json::json!({
            "iss": ISSUER, "sub": sub, "aud": SERVICE,
            "exp": now + 300, "nbf": now - 10, "iat": now, "jti": format!("{now}-{sub}"),
            "access": if actions.is_empty() { serde_json::json!([]) } else {
                serde_json::json!([{"type": "repository", "name": repo, "actions": actions}])
            },
        });
        let input = format!(
            "{}.{}",
            b64url(header.to_string().as_bytes()),
            b64url(claims.to_string().as_bytes())
        );
        let sig = self
            .key
            .sign(&ring::rand::SystemRandom::new(), input.as_bytes())
            .unwrap();
        format!("{input}.{}", b64url(sig.as_ref()))
    }
}

/// Serves `GET /token?...scope=repository:NAME:ACTIONS`: anyone may pull `public/*`; only
/// alice (basic auth) may pull or push anything. Returns the server's address.
async fn token_server(signer: std::sync::Arc<Signer>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let signer = signer.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16384];
                let mut n = 0;
                while !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") && n < buf.len() {
                    match conn.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => n += k,
                    }
                }
                let req = String::from_utf8_lossy(&buf[..n]).into_owned();
                let path = req.split_whitespace().nth(1).unwrap_or("").to_owned();
                let alice = req.lines().any(|l| {
                    l.to_ascii_lowercase().starts_with("authorization: basic ")
                        && base64::engine::general_purpose::STANDARD
                            .decode(l[21..].trim())
                            .is_ok_and(|d| d == b"alice:s3cret")
                });
                let scope = path
                    .split(['?', '&'])
                    .find_map(|kv| kv.strip_prefix("scope="))
                    .map(|s| {
                        s.replace("%3A", ":")
                            .replace("%2F", "/")
                            .replace("%2C", ",")
                    })
                    .unwrap_or_default();
                let mut parts = scope.splitn(3, ':');
                let (_, repo) = (parts.next(), parts.next().unwrap_or("").to_owned());
                let asked: Vec<String> = parts
                    .next()
                    .unwrap_or("")
                    .split(',')
                    .map(str::to_owned)
                    .collect();
                let granted: Vec<&str> = asked
                    .iter()
                    .map(String::as_str)
                    .filter(|a| alice || (repo.starts_with("public/") && *a == "pull"))
                    .collect();
                let sub = if alice { "alice" } else { "" };
                let token = signer.token(sub, &repo, &granted);
                let body =
                    serde_json::json!({"token": token, "access_token": token, "expires_in": 300})
                        .to_string();
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread")]
async fn anonymous_and_credentialed_bearer_tokens() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let signer = std::sync::Arc::new(signer());
    let bundle = tmp.path().join("token-ca.pem");
    std::fs::write(&bundle, &signer.cert_pem).unwrap();
    let token_addr = token_server(signer.clone()).await;
    let auth = format!(
        "auth:\n  token:\n    realm: http://{token_addr}/token\n    service: {SERVICE}\n    issuer: {ISSUER}\n    rootcertbundle: {}\n",
        bundle.display()
    );
    let reg = Registry::start_with_auth(None, Some(&auth));
    let mut layout = Layout::new(&tmp.path().join("layout"));
    let (desc, _) = layout.image(
        &[common::layer(&[Entry::File("f", b"tok")])],
        Comp::Gzip,
        &[],
        "amd64",
    );
    layout.tag(desc, "v1");
    for repo in ["public/app", "private/app"] {
        reg.push(&layout.dir, "v1", repo, &["--dest-creds", "alice:s3cret"]);
    }
    let no_docker = tmp.path().join("none.json");
    let r = |repo: &str| -> ImageRef { format!("{}/{repo}:v1", reg.addr).parse().unwrap() };

    // Anonymous: a public repository, as `docker pull` of a Docker Hub image.
    let anon = ImageStore::builder(tmp.path().join("c1"))
        .docker_config(&no_docker)
        .build()
        .unwrap();
    let image = anon.pull(&r("public/app")).await.unwrap();
    assert_eq!(std::fs::read(image.layers()[0].join("f")).unwrap(), b"tok");
    let e = anon.pull(&r("private/app")).await.unwrap_err();
    assert!(matches!(e, ImageError::Unauthorized { .. }), "{e}");

    // With credentials the token server knows.
    let alice = ImageStore::builder(tmp.path().join("c2"))
        .docker_config(&no_docker)
        .credentials(reg.addr.clone(), Credentials::new("alice", "s3cret"))
        .build()
        .unwrap();
    assert!(alice.pull(&r("private/app")).await.is_ok());
}
