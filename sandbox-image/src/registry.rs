//! Pulling from OCI distribution registries, through the `oci-client` crate (the ORAS
//! project's client: the token dance of the big public registries, basic auth, Docker schema 2
//! and OCI manifests, image indexes, digest checks). We add what a sandbox needs around it:
//! bounded reads, our own digest check of what lands on disk, Docker's plain-HTTP rule for
//! loopback registries, and errors that say what to do.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use futures::StreamExt as _;
use oci_client::errors::{OciDistributionError as O, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt as _;

use crate::error::{ImageError, Result};
use crate::source::{self, Descriptor, LayerDesc, Resolved, Source};

/// Largest config blob accepted (configs are a few KiB; a hostile registry could stream GiB).
const MAX_CONFIG: u64 = 4 << 20;

/// An image in a registry.
pub(crate) struct Registry {
    pub(crate) reference: oci_client::Reference,
    pub(crate) display: String,
    pub(crate) auth: RegistryAuth,
    /// The HTTPS client.
    pub(crate) https: Arc<oci_client::Client>,
    /// The plain-HTTP client, where allowed (loopback or listed insecure registries).
    pub(crate) http: Option<Arc<oci_client::Client>>,
    /// Set once HTTPS failed and plain HTTP worked (Docker's rule for loopback registries).
    plain: AtomicBool,
}

impl Registry {
    pub(crate) fn new(
        reference: oci_client::Reference,
        display: String,
        auth: RegistryAuth,
        https: Arc<oci_client::Client>,
        http: Option<Arc<oci_client::Client>>,
        http_only: bool,
    ) -> Self {
        Registry {
            reference,
            display,
            auth,
            https,
            http,
            plain: AtomicBool::new(http_only),
        }
    }

    fn client(&self) -> &oci_client::Client {
        match (&self.http, self.plain.load(Ordering::Relaxed)) {
            (Some(h), true) => h,
            _ => &self.https,
        }
    }

    fn map(&self, e: O) -> ImageError {
        map_error(&self.display, e)
    }

    async fn resolve_with(&self) -> Result<Resolved> {
        let client = self.client();
        let (manifest, digest) = client
            .pull_image_manifest(&self.reference, &self.auth)
            .await
            .map_err(|e| self.map(e))?;
        crate::digest::sha256_hex(&digest)?;
        let config = self.read_small(&manifest.config).await?;
        let (_, diff_ids) = crate::config::parse(&config, &self.display)?;
        let layers: Vec<Descriptor> = manifest
            .layers
            .iter()
            .map(|l| Descriptor {
                media_type: l.media_type.clone(),
                digest: l.digest.clone(),
                size: u64::try_from(l.size).ok(),
                platform: None,
                annotations: None,
            })
            .collect();
        Ok(Resolved {
            manifest_digest: digest,
            config,
            layers: source::layers_of(&layers, &diff_ids, &self.display)?,
        })
    }

    /// A small blob (the config) into memory, bounded and verified.
    async fn read_small(&self, desc: &OciDescriptor) -> Result<Vec<u8>> {
        let mut s = self
            .client()
            .pull_blob_stream(&self.reference, desc)
            .await
            .map_err(|e| self.map(e))?;
        let mut v = Vec::new();
        while let Some(chunk) = s.next().await {
            let chunk = chunk.map_err(|e| self.stream_error(e))?;
            v.extend_from_slice(&chunk);
            if v.len() as u64 > MAX_CONFIG {
                return Err(ImageError::Registry {
                    reference: self.display.clone(),
                    detail: format!(
                        "the config blob {} is larger than {MAX_CONFIG} bytes",
                        desc.digest
                    ),
                });
            }
        }
        crate::digest::verify(&format!("config {}", desc.digest), &v, &desc.digest)?;
        Ok(v)
    }

    fn stream_error(&self, e: std::io::Error) -> ImageError {
        // The client checks digests itself at the end of a stream.
        if let Some(oci_client::errors::DigestError::VerificationError { expected, actual }) = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<oci_client::errors::DigestError>())
        {
            return ImageError::DigestMismatch {
                what: format!("blob {expected} of {}", self.display),
                expected: expected.clone(),
                actual: actual.clone(),
            };
        }
        ImageError::Registry {
            reference: self.display.clone(),
            detail: format!("the download broke off: {e}"),
        }
    }
}

#[async_trait]
impl Source for Registry {
    fn describe(&self) -> String {
        self.display.clone()
    }

    async fn resolve(&self) -> Result<Resolved> {
        match self.resolve_with().await {
            // Docker's rule: a loopback registry is tried over HTTPS, then over plain HTTP.
            Err(ImageError::Registry { .. })
                if self.http.is_some() && !self.plain.load(Ordering::Relaxed) =>
            {
                tracing::debug!(image = %self.display, "HTTPS failed; trying plain HTTP (loopback registry)");
                self.plain.store(true, Ordering::Relaxed);
                self.resolve_with().await
            }
            other => other,
        }
    }

    async fn fetch(&self, layer: &LayerDesc, dest: &Path, max_bytes: u64) -> Result<()> {
        let out = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(dest)
            .await
            .map_err(|e| ImageError::io("create", dest, e))?;
        self.download(layer, max_bytes, Sink::File(out, dest)).await
    }

    fn streams(&self) -> bool {
        true
    }

    async fn stream(
        &self,
        layer: &LayerDesc,
        max_bytes: u64,
        tx: tokio::sync::mpsc::Sender<bytes::Bytes>,
    ) -> Result<()> {
        self.download(layer, max_bytes, Sink::Channel(tx)).await
    }
}

/// Where a blob's bytes go as they arrive.
enum Sink<'a> {
    /// A new file.
    File(tokio::fs::File, &'a Path),
    /// A reader on another thread (the store's unpack), chunk by chunk.
    Channel(tokio::sync::mpsc::Sender<bytes::Bytes>),
}

impl Registry {
    /// Downloads the blob of `layer` into `sink`, refusing more than its stated size (or
    /// `max_bytes`), and checks its digest; the `Ok` comes only after that check.
    async fn download(&self, layer: &LayerDesc, max_bytes: u64, mut sink: Sink<'_>) -> Result<()> {
        let desc = OciDescriptor {
            media_type: layer.media_type.clone(),
            digest: layer.digest.clone(),
            size: layer.size.and_then(|s| i64::try_from(s).ok()).unwrap_or(0),
            ..Default::default()
        };
        let mut s = self
            .client()
            .pull_blob_stream(&self.reference, &desc)
            .await
            .map_err(|e| self.map(e))?;
        let limit = layer.size.unwrap_or(max_bytes).min(max_bytes);
        let mut hasher = Sha256::new();
        let mut n = 0u64;
        while let Some(chunk) = s.next().await {
            let chunk = chunk.map_err(|e| self.stream_error(e))?;
            n += chunk.len() as u64;
            if n > limit {
                return Err(if n > max_bytes {
                    ImageError::CacheFull {
                        needed: n,
                        cap: max_bytes,
                        used: 0,
                    }
                } else {
                    ImageError::Registry {
                        reference: self.display.clone(),
                        detail: format!(
                            "blob {} is larger than its manifest says ({limit} bytes)",
                            layer.digest
                        ),
                    }
                });
            }
            hasher.update(&chunk);
            match &mut sink {
                Sink::File(out, dest) => out
                    .write_all(&chunk)
                    .await
                    .map_err(|e| ImageError::io("write", *dest, e))?,
                Sink::Channel(tx) => tx.send(chunk).await.map_err(|_| {
                    ImageError::io(
                        source::HAND_OVER,
                        Path::new(&layer.digest),
                        std::io::Error::other("its unpack stopped"),
                    )
                })?,
            }
        }
        if let Sink::File(out, dest) = &mut sink {
            out.flush()
                .await
                .map_err(|e| ImageError::io("write", *dest, e))?;
        }
        let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
        if actual != layer.digest {
            return Err(ImageError::DigestMismatch {
                what: format!("layer blob {} of {}", layer.digest, self.display),
                expected: layer.digest.clone(),
                actual,
            });
        }
        Ok(())
    }
}

/// An `oci-client` error, as ours: not found, unauthorized, a digest mismatch, or a registry
/// error with the cause chain spelled out.
pub(crate) fn map_error(reference: &str, e: O) -> ImageError {
    let detail = chain(&e);
    let r = reference.to_owned();
    match &e {
        O::ImageManifestNotFoundError(_) => ImageError::NotFound {
            reference: r,
            detail,
        },
        O::AuthenticationFailure(_) | O::UnauthorizedError { .. } => ImageError::Unauthorized {
            reference: r,
            detail,
        },
        O::ServerError { code: 404, .. } => ImageError::NotFound {
            reference: r,
            detail,
        },
        O::ServerError {
            code: 401 | 403, ..
        } => ImageError::Unauthorized {
            reference: r,
            detail,
        },
        O::RegistryError { envelope, .. } => {
            let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|e| &e.code).collect();
            if codes.iter().any(|c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NotFound
                )
            }) {
                ImageError::NotFound {
                    reference: r,
                    detail,
                }
            } else if codes
                .iter()
                .any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied))
            {
                ImageError::Unauthorized {
                    reference: r,
                    detail,
                }
            } else {
                ImageError::Registry {
                    reference: r,
                    detail,
                }
            }
        }
        O::DigestError(oci_client::errors::DigestError::VerificationError { expected, actual }) => {
            ImageError::DigestMismatch {
                what: format!("content of {reference}"),
                expected: expected.clone(),
                actual: actual.clone(),
            }
        }
        _ => ImageError::Registry {
            reference: r,
            detail,
        },
    }
}

/// An error and its causes, `: `-joined.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}
