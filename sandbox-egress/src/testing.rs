//! Parts for tests of code that goes through the proxy (ours and our users'): a throwaway
//! certificate authority and an HTTPS echo server behind it, and a plain HTTP server, on
//! loopback.
//!
//! A test gives the CA to the proxy as an upstream root
//! ([`ProxyConfig::upstream_roots`](crate::ProxyConfig::upstream_roots)), so intercepted
//! connections to the server verify as a real one would, and reads what the server received
//! ([`EchoServer::heads`]) to check what left the sandbox. Keys are made in memory per
//! process and never written anywhere; nothing here is meant for production use.

use std::io;
use std::sync::{Arc, Mutex};

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// The enforcer a test built, or `None` (after printing `SKIP:` and its reason) where it
/// cannot run on this host: the test skips on the enforcer's own word (it needs root for
/// network namespaces). Any other error is a failed test.
#[cfg(target_os = "linux")]
pub fn enforcer_or_skip(
    built: sandbox_core::Result<crate::VethEnforcer>,
) -> Option<crate::VethEnforcer> {
    match built {
        Ok(e) => Some(e),
        Err(e @ sandbox_core::Error::Unavailable { .. }) => {
            eprintln!("SKIP: {e}");
            None
        }
        Err(e) => panic!("egress enforcer: {e}"),
    }
}

/// A self-signed CA that signs leaves for test servers.
pub struct TestCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    /// A new CA named `common_name` (ECDSA P-256).
    ///
    /// # Errors
    /// When the key or certificate cannot be made.
    pub fn new(common_name: &str) -> io::Result<Self> {
        let key = rcgen::KeyPair::generate().map_err(other)?;
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(other)?;
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        // A subject of its own: OpenSSL takes a leaf whose subject equals its issuer's for a
        // self-signed certificate.
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        Ok(TestCa {
            issuer: rcgen::CertifiedIssuer::self_signed(p, key).map_err(other)?,
        })
    }

    /// The CA's certificate (DER), e.g. for [`ProxyConfig::upstream_roots`](crate::ProxyConfig::upstream_roots).
    pub fn der(&self) -> CertificateDer<'static> {
        self.issuer.der().clone()
    }

    /// The CA's certificate (PEM), e.g. for a client's `--cacert`.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A TLS server configuration with a fresh leaf for `names` (DNS names or IP addresses;
    /// the first is also its common name), signed by this CA.
    ///
    /// # Errors
    /// When `names` is empty or holds something that is not a name, or signing fails.
    pub fn server_config(&self, names: &[&str]) -> io::Result<Arc<rustls::ServerConfig>> {
        let first = names
            .first()
            .ok_or_else(|| other("a test server needs a name"))?;
        let key = rcgen::KeyPair::generate().map_err(other)?;
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .map_err(other)?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, *first);
        let cert = params.signed_by(&key, &self.issuer).map_err(other)?;
        let der_key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(other)?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], der_key)
            .map_err(other)?;
        Ok(Arc::new(cfg))
    }

    /// A TLS client configuration that trusts this CA only.
    ///
    /// # Errors
    /// When the certificate is refused as a root.
    pub fn client_config(&self) -> io::Result<Arc<rustls::ClientConfig>> {
        client_config_trusting(self.der())
    }
}

/// A TLS client configuration that trusts `root` only (a [`TestCa`]'s, or the proxy's
/// interception CA as a sandbox gets it).
///
/// # Errors
/// When the certificate is refused as a root.
pub fn client_config_trusting(
    root: CertificateDer<'static>,
) -> io::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root).map_err(other)?;
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// An HTTPS server on loopback that answers every request with the head it received (as a
/// `text/plain` body, `200 OK`) and records each head. It keeps connections alive, and
/// closes one after answering a request that says `Connection: close`. Request bodies are
/// not read.
#[derive(Debug, Clone)]
pub struct EchoServer {
    /// Its port on `127.0.0.1`.
    pub port: u16,
    heads: Arc<Mutex<Vec<String>>>,
}

impl EchoServer {
    /// Starts one for `names`, with a leaf signed by `ca`, on the current tokio runtime (it
    /// runs until the runtime ends).
    ///
    /// # Errors
    /// When the leaf cannot be made or the port cannot be bound.
    pub async fn start(ca: &TestCa, names: &[&str]) -> io::Result<Self> {
        let acceptor = tokio_rustls::TlsAcceptor::from(ca.server_config(names)?);
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let port = l.local_addr()?.port();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let h = heads.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (acceptor, h) = (acceptor.clone(), h.clone());
                tokio::spawn(async move {
                    if let Ok(t) = acceptor.accept(s).await {
                        echo(t, &h).await;
                    }
                });
            }
        });
        Ok(EchoServer { port, heads })
    }

    /// The request heads received so far, oldest first.
    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

async fn echo<S>(mut t: S, heads: &Mutex<Vec<String>>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut buf = Vec::new();
    loop {
        let end = loop {
            if let Some(i) = memchr::memmem::find(&buf, b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match t.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end);
        heads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(head.clone());
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{head}",
            head.len()
        );
        if t.write_all(resp.as_bytes()).await.is_err() {
            return;
        }
        if head
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n")
        {
            let _ = t.shutdown().await;
            return;
        }
    }
}

/// Starts a plain-HTTP server on `127.0.0.1` that answers each connection's request with
/// `hello <its Host header>` and closes, on the current tokio runtime (it runs until the
/// runtime ends); returns its port. What a test behind the proxy fetches to see which name
/// reached the upstream.
///
/// # Errors
/// When the port cannot be bound.
pub async fn hello_server() -> io::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let port = l.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut n = 0;
                while memchr::memmem::find(&buf[..n], b"\r\n\r\n").is_none() && n < buf.len() {
                    match s.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => n += k,
                    }
                }
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let host = head
                    .lines()
                    .find_map(|l| l.strip_prefix("Host: ").or(l.strip_prefix("host: ")))
                    .unwrap_or("?")
                    .trim()
                    .to_string();
                let body = format!("hello {host}");
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(reply.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    Ok(port)
}
