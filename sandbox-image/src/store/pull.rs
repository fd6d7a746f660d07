//! Pulling: where an image reference is fetched from (a registry with its credentials and
//! client settings, an OCI layout, a local archive), and how its layers reach the store
//! verified and unpacked, each once however many processes ask.

use super::*;

impl ImageStore {
    fn source_for(&self, r: &ImageRef) -> Result<Box<dyn Source>> {
        Ok(match r {
            ImageRef::Registry {
                registry,
                repository,
                tag,
                digest,
            } => {
                let reference = match (tag, digest) {
                    (Some(t), Some(d)) => oci_client::Reference::with_tag_and_digest(
                        registry.clone(),
                        repository.clone(),
                        t.clone(),
                        d.clone(),
                    ),
                    (None, Some(d)) => oci_client::Reference::with_digest(
                        registry.clone(),
                        repository.clone(),
                        d.clone(),
                    ),
                    (t, None) => oci_client::Reference::with_tag(
                        registry.clone(),
                        repository.clone(),
                        t.clone().unwrap_or_else(|| "latest".into()),
                    ),
                };
                let listed = self.inner.cfg.insecure.iter().any(|i| i == registry);
                let http =
                    (listed || r.is_loopback_registry()).then(|| self.client(Some(registry)));
                Box::new(crate::registry::Registry::new(
                    reference,
                    r.to_string(),
                    self.auth_for(registry),
                    self.client(None),
                    http,
                    listed,
                ))
            }
            ImageRef::OciLayout { path, tag } => Box::new(crate::offline::OciLayout {
                dir: path.clone(),
                tag: tag.clone(),
            }),
            ImageRef::DockerArchive { path } => Box::new(crate::offline::DockerArchive::new(
                path.clone(),
                self.p("tmp"),
            )),
            other => return Err(ImageError::Unsupported(format!("image source `{other}`"))),
        })
    }

    fn auth_for(&self, registry: &str) -> RegistryAuth {
        if let Some(allowed) = super::CLIENT_CREDENTIAL_REGISTRIES.get() {
            if !allowed.iter().any(|r| r == registry) {
                tracing::debug!(
                    registry,
                    "no credentials: not a registry the operator lists for clients"
                );
                return RegistryAuth::Anonymous;
            }
        }
        let creds = self
            .inner
            .cfg
            .credentials
            .get(registry)
            .cloned()
            .or_else(|| {
                let path = self
                    .inner
                    .cfg
                    .docker_config
                    .clone()
                    .or_else(auth::docker_config_path)?;
                auth::from_docker_config(&path, registry)
            });
        match creds {
            Some(c) => RegistryAuth::Basic(c.username, c.password),
            None => RegistryAuth::Anonymous,
        }
    }

    /// The HTTPS client, or one that reaches `plain` over HTTP.
    fn client(&self, plain: Option<&str>) -> Arc<oci_client::Client> {
        let key = plain.unwrap_or("").to_owned();
        let mut clients = match self.inner.clients.lock() {
            Ok(c) => c,
            Err(p) => p.into_inner(),
        };
        if let Some(c) = clients.get(&key) {
            return c.clone();
        }
        // reqwest is built without a default crypto provider: ring, as the rest of the
        // workspace uses (an error only means one is installed already).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let cfg = &self.inner.cfg;
        let config = ClientConfig {
            protocol: match plain {
                Some(r) => ClientProtocol::HttpsExcept(vec![r.to_owned()]),
                None => ClientProtocol::Https,
            },
            extra_root_certificates: cfg
                .ca_pem
                .iter()
                .map(|pem| oci_client::client::Certificate {
                    encoding: oci_client::client::CertificateEncoding::Pem,
                    data: pem.clone(),
                })
                .collect(),
            platform_resolver: Some(Box::new(oci_client::client::linux_amd64_resolver)),
            connect_timeout: Some(cfg.connect_timeout),
            read_timeout: Some(cfg.read_timeout),
            ..Default::default()
        };
        let c = Arc::new(oci_client::Client::new(config));
        clients.insert(key, c.clone());
        c
    }

    /// Pulls the image from its source (always asking the source, as `docker pull` does),
    /// verifying every digest, unpacking what the cache lacks, and records it under its
    /// reference.
    ///
    /// # Errors
    /// [`ImageError::NotFound`], [`ImageError::Unauthorized`], [`ImageError::Registry`]
    /// (unreachable, stalled past the timeout), [`ImageError::DigestMismatch`],
    /// [`ImageError::MaliciousLayer`], [`ImageError::CacheFull`], [`ImageError::Io`]
    /// (a full disk says so). Nothing half-made is ever used.
    pub async fn pull(&self, r: &ImageRef) -> Result<Image> {
        let source = self.source_for(r)?;
        let _store = self.lock("store".into(), false).await?;
        let resolved = source.resolve().await?;
        let name = source.describe();
        let (config, _) = config::parse(&resolved.config, &name)?;

        // The cap, checked before anything is downloaded (blob sizes are known up front).
        let used = self.usage()?;
        let cap = self.inner.cfg.max_bytes;
        let missing: u64 = resolved
            .layers
            .iter()
            .filter(|l| hex_of(&l.diff_id).is_ok_and(|h| !self.p(format!("layers/{h}")).is_dir()))
            .map(|l| l.size.unwrap_or(0))
            .sum();
        if used.saturating_add(missing) > cap {
            return Err(ImageError::CacheFull {
                needed: missing,
                cap,
                used,
            });
        }

        let work = resolved
            .layers
            .iter()
            .map(|l| self.ensure_layer(source.as_ref(), l));
        futures::future::try_join_all(work).await?;

        let record = Record {
            digest: resolved.manifest_digest.clone(),
            source: name,
            config,
            layers: resolved
                .layers
                .iter()
                .map(|l| LayerRecord {
                    digest: l.digest.clone(),
                    diff_id: l.diff_id.clone(),
                    media_type: l.media_type.clone(),
                    size: l.size,
                })
                .collect(),
            source_stamp: match r {
                ImageRef::DockerArchive { path } => stamp_of(path),
                _ => None,
            },
        };
        let rec_path = self.p(format!("images/{}.json", hex_of(&record.digest)?));
        let bytes = serde_json::to_vec_pretty(&record).unwrap_or_default();
        self.write_atomic(&rec_path, &bytes)?;
        let key = r.to_string();
        let digest = record.digest.clone();
        self.update_refs(|refs| {
            refs.insert(key.clone(), digest);
        })?;
        self.image_of(&key, &record)?.ok_or_else(|| {
            ImageError::io(
                "find the unpacked layers of",
                rec_path,
                io::Error::new(io::ErrorKind::NotFound, "removed while pulling"),
            )
        })
    }

    /// Makes `layers/<diff-id>` if missing: the blob (downloaded once, under its lock) and
    /// the unpack into `tmp/`, renamed into place when complete and verified. A blob that
    /// streams from its source is unpacked while it arrives (see [`Incoming`]); one already
    /// in the cache, or copied from a local source, afterwards.
    async fn ensure_layer(&self, source: &dyn Source, l: &LayerDesc) -> Result<()> {
        let hex = hex_of(&l.diff_id)?.to_owned();
        let dir = self.p(format!("layers/{hex}"));
        if dir.is_dir() {
            return Ok(());
        }
        let _layer_lock = self.lock(format!("layer-{hex}"), true).await?;
        if dir.is_dir() {
            return Ok(());
        }
        let bhex = hex_of(&l.digest)?.to_owned();
        let blob = self.p(format!("blobs/sha256/{bhex}"));
        let cap = self.inner.cfg.max_bytes;
        let compression = Compression::from_media_type(&l.media_type)?;
        let tmp = self.p(format!("tmp/layer-{}", uuid::Uuid::new_v4().simple()));
        let _blob_lock;
        let stats = if blob.is_file() {
            self.unpack_cached(l, &blob, &tmp, compression).await?
        } else {
            _blob_lock = self.lock(format!("blob-{bhex}"), true).await?;
            if blob.is_file() {
                self.unpack_cached(l, &blob, &tmp, compression).await?
            } else if let (true, Some(size)) = (source.streams(), l.size) {
                // (A stated size bounds the blob, so the layer's budget can be what it
                // leaves; without one the blob lands first and the layer gets the rest.)
                let room = cap.saturating_sub(self.usage()?);
                self.fetch_and_unpack(source, l, size, &blob, &tmp, compression, room)
                    .await?
            } else {
                let room = cap.saturating_sub(self.usage()?);
                let part = self.p(format!("tmp/blob-{}", uuid::Uuid::new_v4().simple()));
                if let Err(e) = source.fetch(l, &part, room).await {
                    let _ = fs::remove_file(&part);
                    return Err(cache_full(cap, room)(e));
                }
                fs::rename(&part, &blob).map_err(|e| {
                    let _ = fs::remove_file(&part);
                    ImageError::io("store the blob", &blob, e)
                })?;
                self.unpack_cached(l, &blob, &tmp, compression).await?
            }
        };
        let size_path = self.p(format!("layers/{hex}.size"));
        fs::write(&size_path, stats.bytes.to_string())
            .map_err(|e| ImageError::io("write", &size_path, e))?;
        fs::rename(&tmp, &dir).map_err(|e| {
            let _ = fs::remove_dir_all(&tmp);
            ImageError::io("store the layer", &dir, e)
        })?;
        tracing::debug!(layer = %l.diff_id, bytes = stats.bytes, entries = stats.entries, "layer unpacked");
        Ok(())
    }

    /// Unpacks the cached `blob` of `l` into a new `tmp` (verifying both digests), durable
    /// once it returns; a blob that fails its digest check is dropped (the next pull fetches
    /// it again).
    async fn unpack_cached(
        &self,
        l: &LayerDesc,
        blob: &Path,
        tmp: &Path,
        compression: Compression,
    ) -> Result<unpack::Unpacked> {
        let cap = self.inner.cfg.max_bytes;
        let room = cap.saturating_sub(self.usage()?);
        fs::create_dir(tmp).map_err(|e| ImageError::io("create", tmp, e))?;
        let (digest, diff_id) = (l.digest.clone(), l.diff_id.clone());
        let (blob2, tmp2) = (blob.to_path_buf(), tmp.to_path_buf());
        let unpacked = tokio::task::spawn_blocking(move || {
            let spec = LayerSpec {
                blob_digest: Some(&digest),
                diff_id: &diff_id,
                compression,
            };
            let r = unpack::unpack(&blob2, &spec, &tmp2, room);
            if r.is_ok() {
                durable(&tmp2);
            }
            r
        })
        .await
        .map_err(|e| ImageError::io("unpack a layer into", tmp, io::Error::other(e)))?;
        unpacked.map_err(|e| {
            let _ = remove_tree(tmp);
            match e {
                e @ ImageError::DigestMismatch { .. } => {
                    let _ = fs::remove_file(blob);
                    e
                }
                e => cache_full(cap, room)(e),
            }
        })
    }

    /// Downloads the blob of `l` and unpacks it at once into a new `tmp`: the download (an
    /// async task: the network, the blob's digest) hands each chunk to the unpack (a blocking
    /// thread: decompression, the diff-id, the files), which also writes it to a new blob
    /// file. Both must succeed, the download's digest check included, before the blob is
    /// named; the caller names the layer. `size`: the blob's stated size; `room`: what the
    /// cache can still take, blob and layer together. On failure nothing of it is left.
    #[allow(clippy::too_many_arguments)]
    async fn fetch_and_unpack(
        &self,
        source: &dyn Source,
        l: &LayerDesc,
        size: u64,
        blob: &Path,
        tmp: &Path,
        compression: Compression,
        room: u64,
    ) -> Result<unpack::Unpacked> {
        let part = self.p(format!("tmp/blob-{}", uuid::Uuid::new_v4().simple()));
        let file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&part)
            .map_err(|e| ImageError::io("create", &part, e))?;
        if let Err(e) = fs::create_dir(tmp) {
            let _ = fs::remove_file(&part);
            return Err(ImageError::io("create", tmp, e));
        }
        // Bounded: a download faster than the unpack waits for it (at most this many chunks,
        // each as the connection delivered it, are in flight).
        let (tx, rx) = tokio::sync::mpsc::channel(INCOMING_CHUNKS);
        // The layer gets what the blob leaves (the blob is at most its stated size).
        let layer_room = room.saturating_sub(size);
        let cap = self.inner.cfg.max_bytes;
        let diff_id = l.diff_id.clone();
        let (part2, tmp2) = (part.clone(), tmp.to_path_buf());
        // Why the blob's file could not be written (the unpack only sees its input fail).
        let failed = Arc::new(Mutex::new(None));
        let failed2 = failed.clone();
        let unpacking = tokio::task::spawn_blocking(move || {
            // The download checks the blob's digest (over the very bytes handed over here).
            let spec = LayerSpec {
                blob_digest: None,
                diff_id: &diff_id,
                compression,
            };
            let input = Incoming {
                rx,
                chunk: bytes::Bytes::new(),
                file,
                failed: failed2,
            };
            unpack::unpack_from(input, &part2, &spec, &tmp2, layer_room)
        });
        // Each `CacheFull` against the whole cache: the download had `room`, the layer what
        // the blob leaves of it.
        let fetched = source
            .stream(l, room, tx)
            .await
            .map_err(cache_full(cap, room));
        let unpacked = unpacking
            .await
            .map_err(|e| ImageError::io("unpack a layer into", tmp, io::Error::other(e)))
            .map(|r| r.map_err(cache_full(cap, layer_room)));
        // The download's error comes first (a short or altered blob also fails its unpack),
        // except when it only says that the unpack stopped: then the unpack's says why.
        let unwritten = failed.lock().ok().and_then(|mut f| f.take());
        let r = match (unwritten, fetched, unpacked) {
            (Some(e), _, _) => Err(ImageError::io("write", &part, e)),
            (None, Ok(()), Ok(Ok(stats))) => {
                // Durable before anything is named (the blob's file is on the same
                // filesystem).
                let dir = tmp.to_path_buf();
                let _ = tokio::task::spawn_blocking(move || durable(&dir)).await;
                fs::rename(&part, blob)
                    .map(|()| stats)
                    .map_err(|e| ImageError::io("store the blob", blob, e))
            }
            (None, Err(e), Ok(Err(u)) | Err(u)) if handed_over_error(&e) => Err(u),
            (None, Err(e), _) => Err(e),
            (None, Ok(()), Ok(Err(u)) | Err(u)) => Err(u),
        };
        if r.is_err() {
            let _ = fs::remove_file(&part);
            // A layer unpacked in full has its directories' own modes (read-only ones too).
            let _ = remove_tree(tmp);
        }
        r
    }
}

/// `CacheFull` (as the download or unpack reports it, with its own share) stated against
/// the whole cache: `cap`, of which `room` was left to that work; other errors as they are.
fn cache_full(cap: u64, room: u64) -> impl Fn(ImageError) -> ImageError {
    move |e| match e {
        ImageError::CacheFull { needed, .. } => ImageError::CacheFull {
            needed,
            cap,
            used: cap - room,
        },
        e => e,
    }
}

/// Whether `e` is a download's "its unpack stopped" (see [`crate::registry`]).
fn handed_over_error(e: &ImageError) -> bool {
    matches!(e, ImageError::Io { action, .. } if *action == crate::source::HAND_OVER)
}

/// Chunks a download may have in flight towards its unpack.
const INCOMING_CHUNKS: usize = 64;

/// Makes what was written under `dir` durable before it is named (a crash never leaves a
/// half layer in place): its whole filesystem, in one call.
fn durable(dir: &Path) {
    if let Ok(d) = fs::File::open(dir) {
        let _ = nix::unistd::syncfs(&d);
    }
}

/// A blob as it arrives, read by the unpack: each chunk is written to the blob's file, then
/// handed to the reader. The end of the channel is the end of the blob (whether the download
/// completed and matched its digest is the download's answer, awaited separately). A failed
/// write fails the read and is kept in `failed`, the error to report.
struct Incoming {
    rx: tokio::sync::mpsc::Receiver<bytes::Bytes>,
    chunk: bytes::Bytes,
    file: fs::File,
    failed: Arc<Mutex<Option<io::Error>>>,
}

impl io::Read for Incoming {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use io::Write as _;
        while self.chunk.is_empty() {
            match self.rx.blocking_recv() {
                Some(c) => {
                    if let Err(e) = self.file.write_all(&c) {
                        let kind = e.kind();
                        if let Ok(mut f) = self.failed.lock() {
                            f.get_or_insert(e);
                        }
                        return Err(io::Error::new(kind, "the blob's file could not be written"));
                    }
                    self.chunk = c;
                }
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len());
        buf[..n].copy_from_slice(&self.chunk[..n]);
        bytes::Buf::advance(&mut self.chunk, n);
        Ok(n)
    }
}
