//! The image cache: content-addressed blobs, unpacked layers shared read-only by every
//! sandbox, image records and the references that name them.
//!
//! ```text
//! <root>/
//!   blobs/sha256/<hex>        layer blobs as downloaded (verified)
//!   layers/<diff-id hex>/     unpacked layers (overlay lower directories), never written again
//!   layers/<diff-id hex>.size their size in bytes
//!   images/<manifest hex>.json one record per image: config, layers
//!   fsimages/<manifest hex>.ext4 read-only ext4 image of the merged layers (microVM), on demand
//!   refs.json                 reference -> manifest digest
//!   locks/                    flock files (store, refs, one per blob, layer and fs image made)
//!   tmp/                      downloads and unpacks in progress; renamed into place when done
//! ```
//!
//! Concurrency: pulls hold the store lock shared, `rm`/`prune` exclusive; a blob or layer is
//! made under its own lock, so two processes pulling the same image do the work once. A
//! sandbox holds its image's record shared-locked (its [`Image`] value) for as long as it
//! lives, and `rm`/`prune` leave such images alone.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use sandbox_core::ImageRef;
use serde::{Deserialize, Serialize};

use crate::auth::{self, Credentials};
use crate::config::{self, ImageConfig};
use crate::error::{ImageError, Result};
use crate::source::{LayerDesc, Source};
use crate::unpack::{self, Compression, LayerSpec};

mod image;
mod prune;
mod pull;

pub use image::Image;
pub(crate) use prune::remove_tree;
pub use prune::{ImageInfo, PruneReport};

/// The default size cap of the cache (override with `AGENT_SANDBOX_IMAGE_CACHE_MAX`, in bytes
/// or with a `K`/`M`/`G` suffix, or [`StoreBuilder::max_bytes`]).
pub const DEFAULT_MAX_BYTES: u64 = 20 << 30;

/// Registries whose credentials this process may use (see
/// [`ImageStore::credentials_only_for_in_this_process`]); unset: all.
static CLIENT_CREDENTIAL_REGISTRIES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Settings of an [`ImageStore`]; build one with [`ImageStore::builder`].
#[derive(Debug, Clone)]
struct StoreConfig {
    max_bytes: u64,
    insecure: Vec<String>,
    ca_pem: Vec<Vec<u8>>,
    credentials: BTreeMap<String, Credentials>,
    docker_config: Option<PathBuf>,
    connect_timeout: Duration,
    read_timeout: Duration,
    mkfs_ext4: Option<PathBuf>,
}

/// Builds an [`ImageStore`].
#[derive(Debug, Clone)]
pub struct StoreBuilder {
    root: PathBuf,
    cfg: StoreConfig,
}

impl StoreBuilder {
    /// The cache's size cap in bytes (blobs plus unpacked layers). Default
    /// [`DEFAULT_MAX_BYTES`], or `AGENT_SANDBOX_IMAGE_CACHE_MAX`. A pull that would pass it
    /// fails with [`ImageError::CacheFull`] and keeps nothing.
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.cfg.max_bytes = bytes;
        self
    }

    /// Reaches `registry` (`host[:port]`) over plain HTTP, as Docker's `insecure-registries`.
    /// Loopback registries (`localhost`, `127.0.0.0/8`, `[::1]`) need no listing: they are
    /// tried over HTTPS first and then over HTTP, as Docker does. No other registry is ever
    /// reached without TLS.
    pub fn insecure_registry(mut self, registry: impl Into<String>) -> Self {
        self.cfg.insecure.push(registry.into());
        self
    }

    /// Trusts this PEM certificate authority too (a private registry's CA), on top of the
    /// system's roots.
    pub fn ca_certificate_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.cfg.ca_pem.push(pem.into());
        self
    }

    /// Uses these credentials for `registry` (`host[:port]`, `docker.io` for Docker Hub),
    /// before any in the Docker config.
    pub fn credentials(mut self, registry: impl Into<String>, credentials: Credentials) -> Self {
        self.cfg.credentials.insert(registry.into(), credentials);
        self
    }

    /// Reads `docker login` credentials from this file instead of `$DOCKER_CONFIG/config.json`
    /// or `~/.docker/config.json`.
    pub fn docker_config(mut self, path: impl Into<PathBuf>) -> Self {
        self.cfg.docker_config = Some(path.into());
        self
    }

    /// Gives up on a registry that does not accept the connection within `connect`, or that
    /// stalls for `read` in the middle of a response. Defaults: 15 s and 60 s.
    pub fn timeouts(mut self, connect: Duration, read: Duration) -> Self {
        self.cfg.connect_timeout = connect;
        self.cfg.read_timeout = read;
        self
    }

    /// Runs this `mkfs.ext4` to build filesystem images ([`ImageStore::rootfs_image`])
    /// instead of looking for it in `/usr/sbin`, `/sbin` and then `PATH`.
    pub fn mkfs_ext4(mut self, program: impl Into<PathBuf>) -> Self {
        self.cfg.mkfs_ext4 = Some(program.into());
        self
    }

    /// Opens (creating) the store.
    ///
    /// # Errors
    /// [`ImageError::Io`] when the directories cannot be made.
    pub fn build(self) -> Result<ImageStore> {
        for d in [
            "blobs/sha256",
            "layers",
            "images",
            "fsimages",
            "locks",
            "tmp",
        ] {
            let p = self.root.join(d);
            fs::create_dir_all(&p)
                .map_err(|e| ImageError::io("create the image cache directory", &p, e))?;
        }
        use std::os::unix::fs::PermissionsExt;
        // The cache holds other people's images: only we read it.
        let _ = fs::set_permissions(&self.root, fs::Permissions::from_mode(0o700));
        Ok(ImageStore {
            inner: Arc::new(Inner {
                root: self.root,
                cfg: self.cfg,
                clients: Mutex::new(BTreeMap::new()),
                leases: Mutex::new(BTreeMap::new()),
            }),
        })
    }
}

/// Parses `20G`, `512M`, `1024`.
fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'K' | 'k') => (&s[..i], 1u64 << 10),
        (i, 'M' | 'm') => (&s[..i], 1 << 20),
        (i, 'G' | 'g') => (&s[..i], 1 << 30),
        (i, 'T' | 't') => (&s[..i], 1 << 40),
        _ => (s, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

/// A cache of images. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct ImageStore {
    inner: Arc<Inner>,
}

struct Inner {
    root: PathBuf,
    cfg: StoreConfig,
    /// `oci-client` clients by the registry they may reach over plain HTTP (`""`: HTTPS only).
    clients: Mutex<BTreeMap<String, Arc<oci_client::Client>>>,
    /// The leases handed out and still held, by record path: every [`Image`] of one record
    /// shares one descriptor, so a thousand sandboxes of one image cost one (a host's
    /// open-files limit is what stops density first).
    leases: Mutex<BTreeMap<PathBuf, Weak<Flock<fs::File>>>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageStore")
            .field("root", &self.root)
            .field("max_bytes", &self.cfg.max_bytes)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    digest: String,
    source: String,
    config: ImageConfig,
    layers: Vec<LayerRecord>,
    /// For a `docker save` archive: its size and mtime when read (re-read when they change).
    #[serde(default)]
    source_stamp: Option<(u64, i64)>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct LayerRecord {
    digest: String,
    diff_id: String,
    media_type: String,
    size: Option<u64>,
}

pub(crate) fn hex_of(d: &str) -> Result<&str> {
    crate::digest::sha256_hex(d)
}

impl ImageStore {
    /// Where the cache lives by default: `$AGENT_SANDBOX_IMAGE_CACHE`, else
    /// `$XDG_CACHE_HOME/agent-sandbox/images`, else `~/.cache/agent-sandbox/images`.
    pub fn default_dir() -> PathBuf {
        if let Some(d) = std::env::var_os("AGENT_SANDBOX_IMAGE_CACHE") {
            return PathBuf::from(d);
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from("/var/tmp"));
        base.join("agent-sandbox/images")
    }

    /// A builder for a store at `root`.
    pub fn builder(root: impl Into<PathBuf>) -> StoreBuilder {
        let max_bytes = std::env::var("AGENT_SANDBOX_IMAGE_CACHE_MAX")
            .ok()
            .and_then(|s| parse_size(&s))
            .unwrap_or(DEFAULT_MAX_BYTES);
        StoreBuilder {
            root: root.into(),
            cfg: StoreConfig {
                max_bytes,
                insecure: Vec::new(),
                ca_pem: Vec::new(),
                credentials: BTreeMap::new(),
                docker_config: None,
                mkfs_ext4: None,
                connect_timeout: Duration::from_secs(15),
                read_timeout: Duration::from_secs(60),
            },
        }
    }

    /// The store at [`default_dir`](Self::default_dir), with default settings.
    ///
    /// # Errors
    /// As [`StoreBuilder::build`].
    pub fn open_default() -> Result<Self> {
        Self::builder(Self::default_dir()).build()
    }

    /// The process's one default store ([`open_default`](Self::open_default), opened on
    /// first use and shared after): what backends use when none is configured. A failure is
    /// not remembered; the next call tries again.
    ///
    /// # Errors
    /// As [`StoreBuilder::build`].
    pub fn shared_default() -> Result<Self> {
        static SHARED: std::sync::OnceLock<ImageStore> = std::sync::OnceLock::new();
        if let Some(s) = SHARED.get() {
            return Ok(s.clone());
        }
        let s = Self::open_default()?;
        Ok(SHARED.get_or_init(|| s).clone())
    }

    /// For a process that pulls on behalf of other parties (`agent-sandbox serve`): every
    /// store of this process uses its credentials (given or from the Docker config) only for
    /// these registries (`host[:port]`, `docker.io` for Docker Hub) and pulls from any other
    /// anonymously, so a client naming a registry of its own never receives, nor spends, the
    /// operator's credentials. The first call wins; later ones change nothing.
    pub fn credentials_only_for_in_this_process(registries: Vec<String>) {
        let _ = CLIENT_CREDENTIAL_REGISTRIES.set(registries);
    }

    /// The cache directory.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// The size cap in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.inner.cfg.max_bytes
    }

    pub(crate) fn p(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.inner.root.join(rel)
    }

    /// The image, from the cache when this reference was pulled before (no network), else
    /// pulled. What a sandbox's create calls.
    ///
    /// # Errors
    /// As [`pull`](Self::pull).
    pub async fn ensure(&self, r: &ImageRef) -> Result<Image> {
        if let Some(img) = self.cached(r)? {
            return Ok(img);
        }
        self.pull(r).await
    }

    /// The image if the cache has it; never pulls.
    ///
    /// # Errors
    /// [`ImageError::Io`] reading the cache.
    pub fn get(&self, r: &ImageRef) -> Result<Option<Image>> {
        self.cached(r)
    }

    fn cached(&self, r: &ImageRef) -> Result<Option<Image>> {
        // Shared with pulls, exclusive with `prune`: a record is never leased while a prune
        // decides to remove it.
        let _store = self.lock_blocking("store", false)?;
        let key = r.to_string();
        let digest = match r {
            ImageRef::Registry {
                digest: Some(d), ..
            } => Some(d.clone()),
            // A layout's content may change under its tag: its manifest decides (a few small
            // reads).
            ImageRef::OciLayout { path, tag } => crate::offline::OciLayout {
                dir: path.clone(),
                tag: tag.clone(),
            }
            .manifest()
            .ok()
            .map(|(d, _)| d),
            _ => self.refs()?.get(&key).cloned(),
        };
        let Some(digest) = digest else {
            return Ok(None);
        };
        let Some(rec) = self.record(&digest)? else {
            return Ok(None);
        };
        if let (ImageRef::DockerArchive { path }, Some(stamp)) = (r, rec.source_stamp) {
            if stamp_of(path) != Some(stamp) {
                return Ok(None);
            }
        }
        self.image_of(&key, &rec)
    }

    /// An [`Image`] for a record whose layers are all unpacked (else `None`).
    fn image_of(&self, reference: &str, rec: &Record) -> Result<Option<Image>> {
        let mut layers = Vec::new();
        let mut bytes = 0;
        for l in &rec.layers {
            let hex = hex_of(&l.diff_id)?;
            let dir = self.p(format!("layers/{hex}"));
            if !dir.is_dir() {
                return Ok(None);
            }
            bytes += read_size(&self.p(format!("layers/{hex}.size")));
            layers.push(dir);
        }
        let path = self.p(format!("images/{}.json", hex_of(&rec.digest)?));
        Ok(Some(Image {
            reference: reference.to_owned(),
            digest: rec.digest.clone(),
            config: rec.config.clone(),
            layers,
            bytes,
            lease: self.lease(&path)?,
        }))
    }

    /// A shared lock on the record at `path`: the one this process holds already when it is
    /// still that record (a record written again since is locked anew), else a new one.
    /// `rm` and `prune` lock a record exclusively before removing it, so while any lease
    /// lives the record stays.
    fn lease(&self, path: &Path) -> Result<Arc<Flock<fs::File>>> {
        use std::os::unix::fs::MetadataExt;
        let leases = || {
            self.inner
                .leases
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        let held = leases().get(path).and_then(Weak::upgrade);
        if let Some(l) = held {
            let same =
                |a: &fs::Metadata, b: &fs::Metadata| a.dev() == b.dev() && a.ino() == b.ino();
            if let (Ok(ours), Ok(now)) = (l.metadata(), fs::metadata(path)) {
                if same(&ours, &now) {
                    return Ok(l);
                }
            }
        }
        // Locked without the map's lock held: a prune holding the record blocks only us.
        let f = fs::File::open(path).map_err(|e| ImageError::io("open", path, e))?;
        let lease = Flock::lock(f, FlockArg::LockSharedNonblock)
            .or_else(|(f, _)| Flock::lock(f, FlockArg::LockShared))
            .map_err(|(_, e)| ImageError::io("lock", path, io::Error::from(e)))?;
        let lease = Arc::new(lease);
        let mut map = leases();
        map.retain(|_, w| w.strong_count() > 0);
        map.insert(path.to_owned(), Arc::downgrade(&lease));
        Ok(lease)
    }

    fn record(&self, digest: &str) -> Result<Option<Record>> {
        let path = self.p(format!("images/{}.json", hex_of(digest)?));
        match fs::read(&path) {
            Ok(b) => Ok(serde_json::from_slice(&b).ok()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ImageError::io("read", &path, e)),
        }
    }

    fn refs(&self) -> Result<BTreeMap<String, String>> {
        let path = self.p("refs.json");
        match fs::read(&path) {
            Ok(b) => Ok(serde_json::from_slice(&b).unwrap_or_default()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(BTreeMap::new()),
            Err(e) => Err(ImageError::io("read", &path, e)),
        }
    }

    /// Changes `refs.json` under its lock, atomically.
    fn update_refs(&self, f: impl FnOnce(&mut BTreeMap<String, String>)) -> Result<()> {
        let _l = self.lock_blocking("refs", true)?;
        let mut refs = self.refs()?;
        f(&mut refs);
        let bytes = serde_json::to_vec_pretty(&refs).unwrap_or_default();
        self.write_atomic(&self.p("refs.json"), &bytes)
    }

    fn write_atomic(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        let tmp = self.p(format!("tmp/w-{}", uuid::Uuid::new_v4().simple()));
        fs::write(&tmp, bytes).map_err(|e| ImageError::io("write", &tmp, e))?;
        fs::rename(&tmp, path).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            ImageError::io("write", path, e)
        })
    }

    fn lock_path(&self, name: &str) -> Result<fs::File> {
        let path = self.p(format!("locks/{name}"));
        fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| ImageError::io("open the lock", &path, e))
    }

    pub(crate) fn lock_blocking(&self, name: &str, exclusive: bool) -> Result<Flock<fs::File>> {
        let f = self.lock_path(name)?;
        let arg = if exclusive {
            FlockArg::LockExclusive
        } else {
            FlockArg::LockShared
        };
        Flock::lock(f, arg).map_err(|(_, e)| {
            ImageError::io("lock", self.p(format!("locks/{name}")), io::Error::from(e))
        })
    }

    async fn lock(&self, name: String, exclusive: bool) -> Result<Flock<fs::File>> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.lock_blocking(&name, exclusive))
            .await
            .map_err(|e| ImageError::io("lock", self.p("locks"), io::Error::other(e)))?
    }

    /// The `mkfs.ext4` set with [`StoreBuilder::mkfs_ext4`], if any.
    pub(crate) fn mkfs_ext4_setting(&self) -> Option<&Path> {
        self.inner.cfg.mkfs_ext4.as_deref()
    }
}

fn read_size(path: &Path) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn stamp_of(path: &Path) -> Option<(u64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(path).ok()?;
    Some((m.len(), m.mtime()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("1024"), Some(1024));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("512m"), Some(512 << 20));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
    }
}
