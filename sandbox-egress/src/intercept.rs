//! TLS interception for hosts that have a proxy-held secret ([`crate::secrets`]): a
//! certificate authority made when the process starts, leaf certificates minted per server
//! name, and the upstream TLS client that verifies the real server.
//!
//! Only connections to a host a secret is bound to are terminated here; every other TLS
//! connection stays spliced end to end. The CA's private key lives in this process's memory
//! only: it is never written to disk and never given to a sandbox, which gets the CA's
//! certificate ([`InterceptCa::certificate_pem`]) to trust. A client that pins its own
//! certificates fails closed against the minted leaf.
//!
//! Leaves are ECDSA P-256, valid from an hour ago for 7 days, naming the host as their one
//! subject alternative name (a DNS name, or an IP address), cached per name. The server side
//! offers HTTP/1.1 only through ALPN (`http/1.1`): a client that asks for `h2` gets HTTP/1.1,
//! which every HTTP client falls back to.
//!
//! Upstream, the proxy is an ordinary TLS client: the host's trust store
//! (`rustls-native-certs`, i.e. `/etc/ssl/certs` on Debian) plus any roots the caller adds,
//! full certificate and name verification, no way to turn it off. A server that does not
//! verify is refused.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// The most leaf certificates kept (the cache is cleared when it would grow past this).
const MAX_LEAVES: usize = 1024;

/// Why interception cannot be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InterceptError {
    /// Making a key or a certificate failed.
    #[error("making the interception certificate for {what}: {detail}")]
    Certificate {
        /// The CA, or the host of a leaf.
        what: String,
        /// What failed.
        detail: String,
    },
    /// A TLS configuration could not be built.
    #[error("TLS configuration: {0}")]
    Tls(String),
    /// The name is neither a DNS name nor an IP address.
    #[error("`{0}` is not a host name a certificate can name")]
    BadName(String),
}

/// The per-process interception CA and its cache of leaf certificates.
pub struct InterceptCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pem: String,
    leaves: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

impl fmt::Debug for InterceptCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InterceptCa").finish_non_exhaustive()
    }
}

impl InterceptCa {
    /// A new CA with a fresh key (ECDSA P-256), held in memory only.
    ///
    /// # Errors
    /// [`InterceptError::Certificate`] when the key or certificate cannot be made.
    pub fn new() -> Result<Self, InterceptError> {
        let err = |e: rcgen::Error| InterceptError::Certificate {
            what: "the CA".into(),
            detail: e.to_string(),
        };
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            format!(
                "agent-sandbox egress interception CA (process {})",
                std::process::id()
            ),
        );
        dn.push(DnType::OrganizationName, "agent-sandbox");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(365);
        let key = KeyPair::generate().map_err(err)?;
        let issuer = CertifiedIssuer::self_signed(params, key).map_err(err)?;
        let pem = issuer.pem();
        Ok(InterceptCa {
            issuer,
            pem,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA's certificate (PEM): what sandboxes add to the certificates they trust.
    pub fn certificate_pem(&self) -> &str {
        &self.pem
    }

    /// The CA's certificate (DER).
    pub fn certificate_der(&self) -> CertificateDer<'static> {
        self.issuer.der().clone()
    }

    /// The leaf certificate and key for `host` (a DNS name or an IP address), minted on first
    /// use and cached.
    ///
    /// # Errors
    /// [`InterceptError::BadName`] for a name no certificate can carry;
    /// [`InterceptError::Certificate`] when minting fails.
    pub fn leaf(&self, host: &str) -> Result<Arc<CertifiedKey>, InterceptError> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        if let Some(k) = lock(&self.leaves).get(&host) {
            return Ok(k.clone());
        }
        let san = match host.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => {
                ServerName::try_from(host.clone())
                    .map_err(|_| InterceptError::BadName(host.clone()))?;
                SanType::DnsName(
                    host.clone()
                        .try_into()
                        .map_err(|_| InterceptError::BadName(host.clone()))?,
                )
            }
        };
        let err = |e: rcgen::Error| InterceptError::Certificate {
            what: host.clone(),
            detail: e.to_string(),
        };
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        params.subject_alt_names = vec![san];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host.clone());
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(7);
        let key = KeyPair::generate().map_err(err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(err)?;
        let der_key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = rustls::crypto::ring::sign::any_supported_type(&der_key)
            .map_err(|e| InterceptError::Tls(e.to_string()))?;
        let certified = Arc::new(CertifiedKey::new(vec![cert.der().clone()], signing));
        let mut leaves = lock(&self.leaves);
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(host, certified.clone());
        Ok(certified)
    }

    /// The TLS server configuration the proxy presents to sandboxes: a leaf per SNI (a
    /// ClientHello without SNI is served the leaf of `default_host`, the host the
    /// connection was decided for), HTTP/1.1 by ALPN.
    ///
    /// # Errors
    /// [`InterceptError::Tls`] when rustls refuses the configuration.
    pub fn server_config(
        self: &Arc<Self>,
        default_host: &str,
    ) -> Result<Arc<rustls::ServerConfig>, InterceptError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| InterceptError::Tls(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(LeafResolver {
                ca: self.clone(),
                default_host: default_host.to_owned(),
            }));
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }
}

/// Picks the leaf for the ClientHello's SNI.
struct LeafResolver {
    ca: Arc<InterceptCa>,
    default_host: String,
}

impl fmt::Debug for LeafResolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeafResolver")
            .field("default_host", &self.default_host)
            .finish_non_exhaustive()
    }
}

impl ResolvesServerCert for LeafResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let host = hello.server_name().unwrap_or(&self.default_host);
        match self.ca.leaf(host) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!(target: "sandbox_egress::audit", host, error = %e, "no interception certificate");
                None
            }
        }
    }
}

/// The TLS client configuration for the real servers: the host's trust store plus `extra`
/// roots, full verification, HTTP/1.1 by ALPN.
///
/// # Errors
/// [`InterceptError::Tls`] when no root can be loaded or rustls refuses the configuration.
pub fn upstream_client_config(
    extra: &[CertificateDer<'static>],
) -> Result<Arc<rustls::ClientConfig>, InterceptError> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for c in native.certs {
        // A malformed system certificate is skipped, as browsers do.
        let _ = roots.add(c);
    }
    for c in extra {
        roots
            .add(c.clone())
            .map_err(|e| InterceptError::Tls(format!("an extra root: {e}")))?;
    }
    if roots.is_empty() {
        return Err(InterceptError::Tls(
            "no trusted root certificates (the host's store is empty and none were given)".into(),
        ));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| InterceptError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn client_trusting(ca: &InterceptCa) -> tokio_rustls::TlsConnector {
        let der = ca.certificate_der();
        tokio_rustls::TlsConnector::from(crate::testing::client_config_trusting(der).unwrap())
    }

    /// A client trusting the CA reaches "api.example.test" (and an IP) through the minted
    /// leaves; one trusting only the host's store (a pinning client, in effect) is refused.
    #[tokio::test]
    async fn minted_leaves_verify_against_the_ca_only() {
        let ca = Arc::new(InterceptCa::new().unwrap());
        assert!(ca
            .certificate_pem()
            .starts_with("-----BEGIN CERTIFICATE-----"));
        let server = tokio_rustls::TlsAcceptor::from(ca.server_config("127.0.0.1").unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (s, _) = listener.accept().await.unwrap();
                let server = server.clone();
                tokio::spawn(async move {
                    if let Ok(mut t) = server.accept(s).await {
                        let mut b = [0u8; 4];
                        if t.read_exact(&mut b).await.is_ok() {
                            let _ = t.write_all(&b).await;
                            let _ = t.shutdown().await;
                        }
                    }
                });
            }
        });
        for name in ["api.example.test", "127.0.0.1"] {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let sn = ServerName::try_from(name.to_string()).unwrap();
            let mut t = client_trusting(&ca).connect(sn, tcp).await.unwrap();
            t.write_all(b"ping").await.unwrap();
            let mut b = [0u8; 4];
            t.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"ping", "{name}");
        }
        // The same leaf comes from the cache.
        assert!(Arc::ptr_eq(
            &ca.leaf("api.example.test").unwrap(),
            &ca.leaf("API.example.test.").unwrap()
        ));
        // Another CA's client (standing in for a client that pins its own roots) fails.
        let other = InterceptCa::new().unwrap();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let sn = ServerName::try_from("api.example.test".to_string()).unwrap();
        assert!(client_trusting(&other).connect(sn, tcp).await.is_err());
        // Names no certificate can carry.
        assert!(matches!(
            ca.leaf("bad name with spaces"),
            Err(InterceptError::BadName(_))
        ));
    }

    #[test]
    fn upstream_verification_uses_the_host_store_plus_extra_roots() {
        let ca = InterceptCa::new().unwrap();
        // Debian's store is there on this host (ca-certificates); with our extra root too.
        let cfg = upstream_client_config(&[ca.certificate_der()]).unwrap();
        assert_eq!(cfg.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }
}
