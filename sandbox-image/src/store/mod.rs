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

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
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

mod pull;

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
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageStore")
            .field("root", &self.root)
            .field("max_bytes", &self.cfg.max_bytes)
            .finish_non_exhaustive()
    }
}

/// An image ready to use: its layers unpacked in the cache, lowest first. While a value (or
/// a clone) lives, `rm` and `prune` leave the image alone.
#[derive(Debug, Clone)]
pub struct Image {
    reference: String,
    digest: String,
    config: ImageConfig,
    layers: Vec<PathBuf>,
    bytes: u64,
    /// The image's record, locked shared: `rm`/`prune` spare it while a clone lives.
    pub(crate) lease: Arc<Flock<fs::File>>,
}

impl Image {
    /// The reference it was asked for, normalised.
    pub fn reference(&self) -> &str {
        &self.reference
    }

    /// The manifest digest: the image's identity.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// Its config (env, working directory, user, entrypoint and command).
    pub fn config(&self) -> &ImageConfig {
        &self.config
    }

    /// The unpacked layer directories, lowest first. Read-only: they are shared by every
    /// sandbox of every image that has them (use them as overlay lower layers).
    pub fn layers(&self) -> &[PathBuf] {
        &self.layers
    }

    /// Bytes its unpacked layers take in the cache.
    pub fn unpacked_bytes(&self) -> u64 {
        self.bytes
    }

    /// The uid and gid its config's `User` means (`uid`, `uid:gid`, `name`, `name:group`),
    /// names looked up in the image's own `/etc/passwd` and `/etc/group`; `(0, 0)` when it
    /// names none. A numeric uid without a `passwd` entry gets gid 0, as runc does.
    ///
    /// # Errors
    /// [`ImageError::Unsupported`] naming a user or group the image does not define.
    pub fn user_ids(&self) -> Result<(u32, u32)> {
        let Some(user) = self.config.user.as_deref() else {
            return Ok((0, 0));
        };
        let (u, g) = match user.split_once(':') {
            Some((u, g)) => (u, Some(g)),
            None => (user, None),
        };
        let passwd = self.etc_file("passwd");
        // name:x:uid:gid:...
        let entry = passwd
            .lines()
            .map(|l| l.split(':').collect::<Vec<_>>())
            .find(|f| f.len() >= 4 && (f[0] == u || (u.parse::<u32>().is_ok() && f[2] == u)));
        let uid = match (u.parse::<u32>(), &entry) {
            (Ok(n), _) => n,
            (Err(_), Some(f)) => f[2].parse().unwrap_or(0),
            (Err(_), None) => {
                return Err(ImageError::Unsupported(format!(
                    "the image's user `{u}`, which its /etc/passwd does not define"
                )))
            }
        };
        let gid = match g {
            Some(g) => match g.parse::<u32>() {
                Ok(n) => n,
                Err(_) => self
                    .etc_file("group")
                    .lines()
                    .map(|l| l.split(':').collect::<Vec<_>>())
                    .find(|f| f.len() >= 3 && f[0] == g)
                    .and_then(|f| f[2].parse().ok())
                    .ok_or_else(|| {
                        ImageError::Unsupported(format!(
                            "the image's group `{g}`, which its /etc/group does not define"
                        ))
                    })?,
            },
            None => entry.and_then(|f| f[3].parse().ok()).unwrap_or(0),
        };
        Ok((uid, gid))
    }

    /// Where `program` is on the image's `PATH` (its config's, else the usual one), as the
    /// sandbox will see it: the topmost layer holding an entry at a `PATH` directory decides
    /// (a whiteout hides lower ones). `None`: the image has no such program, so code strings
    /// needing that interpreter cannot run (tiers say so before trying).
    pub fn find_program(&self, program: &str) -> Option<String> {
        let path = self
            .config
            .path()
            .unwrap_or("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        path.split(':')
            .filter(|d| d.starts_with('/'))
            .find_map(|dir| {
                let inside = format!("{}/{program}", dir.trim_end_matches('/'));
                let rel = inside.trim_start_matches('/');
                for layer in self.layers.iter().rev() {
                    if let Ok(m) = fs::symlink_metadata(layer.join(rel)) {
                        use std::os::unix::fs::FileTypeExt;
                        let whiteout = m.file_type().is_char_device() && m.len() == 0;
                        return (!whiteout).then(|| inside.clone());
                    }
                }
                None
            })
    }

    /// [`find_program`](Self::find_program), or an error naming the image, the program and
    /// the `PATH` searched.
    ///
    /// # Errors
    /// [`ImageError::MissingProgram`].
    pub fn require_program(&self, program: &str) -> Result<String> {
        self.find_program(program)
            .ok_or_else(|| ImageError::MissingProgram {
                image: self.reference.clone(),
                program: program.to_owned(),
                path: self.config.path().unwrap_or("the default PATH").to_owned(),
            })
    }

    /// The interpreter code strings in `language` run with in a Linux userland (`python3`,
    /// `node`, `sh` for shell and C), found on the image's `PATH` as
    /// [`require_program`](Self::require_program) finds it.
    ///
    /// # Errors
    /// [`ImageError::MissingProgram`].
    pub fn require_interpreter(&self, language: sandbox_core::Language) -> Result<String> {
        use sandbox_core::Language;
        self.require_program(match language {
            Language::Python => "python3",
            Language::Node | Language::Javascript => "node",
            _ => "sh",
        })
    }

    /// `/etc/NAME` as the image's topmost layer holding it has it (a regular file, never
    /// followed through a link); empty when none does.
    fn etc_file(&self, name: &str) -> String {
        for layer in self.layers.iter().rev() {
            let p = layer.join("etc").join(name);
            match fs::symlink_metadata(&p) {
                Ok(m) if m.is_file() && m.len() < (1 << 20) => {
                    return fs::read_to_string(&p).unwrap_or_default()
                }
                // A whiteout or anything else hides lower layers' copies.
                Ok(_) => return String::new(),
                Err(_) => {}
            }
        }
        String::new()
    }
}

/// One image in the cache, as [`ImageStore::list`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ImageInfo {
    /// References naming it (none: only `prune` will remove it).
    pub references: Vec<String>,
    /// The manifest digest.
    pub digest: String,
    /// Number of layers.
    pub layers: usize,
    /// Bytes of its blobs plus its unpacked layers (layers shared with other images are
    /// counted in each), plus its filesystem image when one was built (the disk space it
    /// takes: the file is sparse).
    pub bytes: u64,
    /// Whether a sandbox uses it now.
    pub in_use: bool,
}

/// What [`ImageStore::prune`] or [`ImageStore::remove`] freed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PruneReport {
    /// Image records removed.
    pub images: usize,
    /// Blobs removed.
    pub blobs: usize,
    /// Unpacked layers removed.
    pub layers: usize,
    /// Filesystem images ([`ImageStore::rootfs_image`]) removed.
    pub fs_images: usize,
    /// Bytes freed.
    pub bytes: u64,
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
        let f = fs::File::open(&path).map_err(|e| ImageError::io("open", &path, e))?;
        let lease = Flock::lock(f, FlockArg::LockSharedNonblock)
            .or_else(|(f, _)| Flock::lock(f, FlockArg::LockShared))
            .map_err(|(_, e)| ImageError::io("lock", &path, io::Error::from(e)))?;
        Ok(Some(Image {
            reference: reference.to_owned(),
            digest: rec.digest.clone(),
            config: rec.config.clone(),
            layers,
            bytes,
            lease: Arc::new(lease),
        }))
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

    /// Bytes the cache holds: blobs, unpacked layers and filesystem images (the disk space
    /// they take: they are sparse).
    ///
    /// # Errors
    /// [`ImageError::Io`] listing the cache.
    pub fn usage(&self) -> Result<u64> {
        let fsimages = self.p("fsimages");
        let mut total = match fs::read_dir(&fsimages) {
            Ok(rd) => rd
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| disk_bytes(&m))
                .sum(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
            Err(e) => return Err(ImageError::io("list", &fsimages, e)),
        };
        for (dir, suffix) in [("blobs/sha256", None), ("layers", Some(".size"))] {
            let d = self.p(dir);
            let rd = fs::read_dir(&d).map_err(|e| ImageError::io("list", &d, e))?;
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                match suffix {
                    None => total += e.metadata().map(|m| m.len()).unwrap_or(0),
                    Some(s) if name.ends_with(s) => total += read_size(&e.path()),
                    Some(_) => {}
                }
            }
        }
        Ok(total)
    }

    /// Every image in the cache.
    ///
    /// # Errors
    /// [`ImageError::Io`] reading the cache.
    pub fn list(&self) -> Result<Vec<ImageInfo>> {
        let refs = self.refs()?;
        let mut by_digest: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (r, d) in refs {
            by_digest.entry(d).or_default().push(r);
        }
        let mut out = Vec::new();
        for rec in self.records()? {
            let mut bytes = 0;
            for l in &rec.layers {
                if let (Ok(b), Ok(d)) = (hex_of(&l.digest), hex_of(&l.diff_id)) {
                    bytes += fs::metadata(self.p(format!("blobs/sha256/{b}")))
                        .map(|m| m.len())
                        .unwrap_or(0);
                    bytes += read_size(&self.p(format!("layers/{d}.size")));
                }
            }
            if let Ok(h) = hex_of(&rec.digest) {
                bytes += fs::symlink_metadata(self.p(format!("fsimages/{h}.ext4")))
                    .map(|m| disk_bytes(&m))
                    .unwrap_or(0);
            }
            out.push(ImageInfo {
                references: by_digest.remove(&rec.digest).unwrap_or_default(),
                digest: rec.digest.clone(),
                layers: rec.layers.len(),
                bytes,
                in_use: self.in_use(&rec.digest),
            });
        }
        Ok(out)
    }

    fn records(&self) -> Result<Vec<Record>> {
        let d = self.p("images");
        let rd = fs::read_dir(&d).map_err(|e| ImageError::io("list", &d, e))?;
        let mut v = Vec::new();
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().ends_with(".json") {
                if let Ok(b) = fs::read(e.path()) {
                    if let Ok(r) = serde_json::from_slice::<Record>(&b) {
                        v.push(r);
                    }
                }
            }
        }
        Ok(v)
    }

    fn in_use(&self, digest: &str) -> bool {
        self.unused(digest).is_none()
    }

    /// The image's record locked exclusively, when no sandbox holds it.
    fn unused(&self, digest: &str) -> Option<Flock<fs::File>> {
        let hex = hex_of(digest).ok()?;
        let f = fs::File::open(self.p(format!("images/{hex}.json"))).ok()?;
        Flock::lock(f, FlockArg::LockExclusiveNonblock).ok()
    }

    /// Removes the reference `name` (as written to `pull`, or a manifest digest, which
    /// removes every reference to it), then everything no image needs any more. An image a
    /// sandbox uses keeps its files until the next `prune` after it ends.
    ///
    /// # Errors
    /// [`ImageError::NotCached`] when nothing has that name; [`ImageError::Io`].
    pub fn remove(&self, name: &str) -> Result<PruneReport> {
        let key = if name.starts_with("sha256:") {
            name.to_owned()
        } else {
            ImageRef::parse(name)
                .map(|r| r.to_string())
                .unwrap_or_else(|_| name.to_owned())
        };
        let mut found = false;
        self.update_refs(|refs| {
            let before = refs.len();
            refs.retain(|r, d| r != &key && d != &key);
            found = refs.len() != before;
        })?;
        if !found && self.record(&key).ok().flatten().is_none() {
            return Err(ImageError::NotCached(name.to_owned()));
        }
        self.prune()
    }

    /// Removes images no reference names (unless in use), then every blob, layer and
    /// filesystem image no image needs, and leftovers of interrupted pulls and builds.
    ///
    /// # Errors
    /// [`ImageError::Io`].
    pub fn prune(&self) -> Result<PruneReport> {
        let _store = self.lock_blocking("store", true)?;
        let mut report = PruneReport::default();
        let named: BTreeSet<String> = self.refs()?.into_values().collect();
        let mut keep_blobs = BTreeSet::new();
        let mut keep_layers = BTreeSet::new();
        let mut keep_fs = BTreeSet::new();
        for rec in self.records()? {
            if !named.contains(&rec.digest) {
                // Removed only while we hold it exclusively: no sandbox leases it.
                if let Some(_held) = self.unused(&rec.digest) {
                    let p = self.p(format!("images/{}.json", hex_of(&rec.digest)?));
                    report.bytes += fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
                    fs::remove_file(&p).map_err(|e| ImageError::io("remove", &p, e))?;
                    report.images += 1;
                    continue;
                }
            }
            keep_fs.insert(format!("{}.ext4", hex_of(&rec.digest)?));
            for l in &rec.layers {
                keep_blobs.insert(hex_of(&l.digest)?.to_owned());
                keep_layers.insert(hex_of(&l.diff_id)?.to_owned());
            }
        }
        let blobs = self.p("blobs/sha256");
        for e in fs::read_dir(&blobs)
            .map_err(|e| ImageError::io("list", &blobs, e))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if !keep_blobs.contains(&name) {
                report.bytes += e.metadata().map(|m| m.len()).unwrap_or(0);
                fs::remove_file(e.path()).map_err(|err| ImageError::io("remove", e.path(), err))?;
                report.blobs += 1;
            }
        }
        let layers = self.p("layers");
        for e in fs::read_dir(&layers)
            .map_err(|e| ImageError::io("list", &layers, e))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let hex = name.trim_end_matches(".size");
            if keep_layers.contains(hex) {
                continue;
            }
            if name.ends_with(".size") {
                report.bytes += read_size(&e.path());
                let _ = fs::remove_file(e.path());
            } else {
                remove_tree(&e.path())?;
                report.layers += 1;
            }
        }
        // Filesystem images of removed images, and anything else there (none is being
        // renamed into place now: builds hold the store lock shared).
        let fsimages = self.p("fsimages");
        match fs::read_dir(&fsimages) {
            Ok(rd) => {
                for e in rd.flatten() {
                    if keep_fs.contains(e.file_name().to_string_lossy().as_ref()) {
                        continue;
                    }
                    report.bytes += e.metadata().map(|m| disk_bytes(&m)).unwrap_or(0);
                    remove_tree(&e.path())?;
                    report.fs_images += 1;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(ImageError::io("list", &fsimages, e)),
        }
        // Leftovers of pulls and builds that were killed (none runs now: we hold the store
        // lock).
        let tmp = self.p("tmp");
        for e in fs::read_dir(&tmp)
            .map_err(|e| ImageError::io("list", &tmp, e))?
            .flatten()
        {
            let _ = remove_tree(&e.path());
        }
        Ok(report)
    }
}

/// The disk space a file takes (less than its length when it is sparse).
fn disk_bytes(m: &fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    m.len().min(m.blocks().saturating_mul(512))
}

/// Removes a tree that may hold read-only directories (an unpacked layer keeps its modes).
/// Only directories' modes are ever changed, never files' (a staged filesystem image
/// hard-links the layers' files).
pub(crate) fn remove_tree(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if fs::symlink_metadata(path).is_ok_and(|m| !m.is_dir()) {
        return fs::remove_file(path).map_err(|e| ImageError::io("remove", path, e));
    }
    if fs::remove_dir_all(path).is_ok() || !path.exists() {
        return Ok(());
    }
    for e in walk_dirs(path) {
        let _ = fs::set_permissions(&e, fs::Permissions::from_mode(0o700));
    }
    fs::remove_dir_all(path).map_err(|e| ImageError::io("remove", path, e))
}

fn walk_dirs(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.to_path_buf()];
    let mut i = 0;
    while i < out.len() {
        if let Ok(rd) = fs::read_dir(&out[i]) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    out.push(e.path());
                }
            }
        }
        i += 1;
    }
    out
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
