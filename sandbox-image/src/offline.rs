//! Offline sources: an OCI image-layout directory and a `docker save` tarball.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde::Deserialize;

use crate::digest::{self, HashingReader};
use crate::error::{ImageError, Result};
use crate::source::{self, LayerDesc, ManifestOrIndex, Resolved, Source};

/// Largest manifest, index or config we read (they are JSON of a few KiB).
const MAX_JSON: u64 = 4 << 20;

fn read_json_file(path: &Path, source: &str) -> Result<Vec<u8>> {
    let f = fs::File::open(path).map_err(|e| ImageError::io("open", path, e))?;
    let mut v = Vec::new();
    f.take(MAX_JSON + 1)
        .read_to_end(&mut v)
        .map_err(|e| ImageError::io("read", path, e))?;
    if v.len() as u64 > MAX_JSON {
        return Err(ImageError::malformed(
            source,
            format!("{} is too large", path.display()),
        ));
    }
    Ok(v)
}

/// An OCI image-layout directory (`oci-layout`, `index.json`, `blobs/sha256/`).
pub(crate) struct OciLayout {
    pub dir: PathBuf,
    pub tag: Option<String>,
}

impl OciLayout {
    fn blob_path(&self, d: &str) -> Result<PathBuf> {
        Ok(self.dir.join("blobs/sha256").join(digest::sha256_hex(d)?))
    }

    fn blob(&self, d: &str) -> Result<Vec<u8>> {
        let bytes = read_json_file(&self.blob_path(d)?, &self.describe())?;
        digest::verify(&format!("blob {d}"), &bytes, d)?;
        Ok(bytes)
    }

    /// The manifest the reference names (an index resolved to linux/amd64), verified, with
    /// its digest: a few small reads, so a cached image is found without reading more.
    pub(crate) fn manifest(&self) -> Result<(String, ManifestOrIndex)> {
        let name = self.describe();
        if !self.dir.join("oci-layout").is_file() {
            return Err(ImageError::malformed(
                &name,
                "no `oci-layout` file: not an OCI image layout",
            ));
        }
        let index = self.parse(
            &read_json_file(&self.dir.join("index.json"), &name)?,
            "index.json",
        )?;
        let entries = index.manifests.unwrap_or_default();
        let entry = match &self.tag {
            Some(tag) => entries.iter().find(|d| {
                d.annotations
                    .as_ref()
                    .and_then(|a| a.get("org.opencontainers.image.ref.name"))
                    .is_some_and(|n| n == tag)
            }),
            None if entries.len() == 1 => entries.first(),
            None => {
                return Err(ImageError::malformed(
                    &name,
                    format!(
                        "the layout holds {} images: name one as `oci:DIR:TAG`",
                        entries.len()
                    ),
                ))
            }
        }
        .ok_or_else(|| ImageError::NotFound {
            reference: name.clone(),
            detail: "no image with that tag in the layout's index.json".into(),
        })?
        .clone();
        let mut desc = entry;
        // An index (multi-platform) resolves to its linux/amd64 manifest.
        for _ in 0..4 {
            let bytes = self.blob(&desc.digest)?;
            let m = self.parse(&bytes, &desc.digest)?;
            match &m.manifests {
                Some(list) => desc = source::pick_platform(list, &name)?.clone(),
                None => return Ok((desc.digest, m)),
            }
        }
        Err(ImageError::malformed(&name, "indexes nested too deeply"))
    }

    fn parse(&self, bytes: &[u8], what: &str) -> Result<ManifestOrIndex> {
        serde_json::from_slice(bytes)
            .map_err(|e| ImageError::malformed(self.describe(), format!("{what}: {e}")))
    }
}

#[async_trait]
impl Source for OciLayout {
    fn describe(&self) -> String {
        match &self.tag {
            Some(t) => format!("oci:{}:{t}", self.dir.display()),
            None => format!("oci:{}", self.dir.display()),
        }
    }

    async fn resolve(&self) -> Result<Resolved> {
        let name = self.describe();
        let (digest, m) = self.manifest()?;
        let (Some(config), Some(layers)) = (m.config, m.layers) else {
            return Err(ImageError::malformed(
                &name,
                format!("{digest} is not an image manifest"),
            ));
        };
        let config_bytes = self.blob(&config.digest)?;
        let (_, diff_ids) = crate::config::parse(&config_bytes, &name)?;
        Ok(Resolved {
            manifest_digest: digest,
            config: config_bytes,
            layers: source::layers_of(&layers, &diff_ids, &name)?,
        })
    }

    async fn fetch(&self, layer: &LayerDesc, dest: &Path, max_bytes: u64) -> Result<()> {
        let src = self.blob_path(&layer.digest)?;
        let (digest_str, dest) = (layer.digest.clone(), dest.to_path_buf());
        tokio::task::spawn_blocking(move || copy_verified(&src, &dest, &digest_str, max_bytes))
            .await
            .map_err(|e| ImageError::io("copy a blob", PathBuf::new(), io::Error::other(e)))?
    }
}

/// Copies `src` to a new file `dest`, checking its digest and size on the way.
fn copy_verified(src: &Path, dest: &Path, expected: &str, max_bytes: u64) -> Result<()> {
    let f = fs::File::open(src).map_err(|e| ImageError::io("open the blob", src, e))?;
    let mut r = HashingReader::new(f.take(max_bytes.saturating_add(1)));
    let mut out = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dest)
        .map_err(|e| ImageError::io("create", dest, e))?;
    io::copy(&mut r, &mut out).map_err(|e| ImageError::io("copy the blob to", dest, e))?;
    if r.count() > max_bytes {
        return Err(ImageError::CacheFull {
            needed: r.count(),
            cap: max_bytes,
            used: 0,
        });
    }
    let actual = r.finish();
    if actual != expected {
        return Err(ImageError::DigestMismatch {
            what: format!("blob {}", src.display()),
            expected: expected.to_owned(),
            actual,
        });
    }
    Ok(())
}

/// A `docker save` tarball: `manifest.json` naming the config and the layer files inside.
/// The first image of the archive is used.
#[derive(Clone)]
pub(crate) struct DockerArchive {
    pub path: PathBuf,
    /// Where extracted layers wait (the store's `tmp/`).
    pub scratch: PathBuf,
    /// Layer blobs extracted by `resolve`, by their computed digest.
    extracted: Arc<Extracted>,
}

/// Extracted layer files not yet moved into the cache; removed when the source goes.
struct Extracted(Mutex<HashMap<String, PathBuf>>);

impl Drop for Extracted {
    fn drop(&mut self) {
        if let Ok(map) = self.0.lock() {
            for p in map.values() {
                let _ = fs::remove_file(p);
            }
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ArchiveEntry {
    config: String,
    layers: Vec<String>,
}

impl DockerArchive {
    pub(crate) fn new(path: PathBuf, scratch: PathBuf) -> Self {
        DockerArchive {
            path,
            scratch,
            extracted: Arc::new(Extracted(Mutex::new(HashMap::new()))),
        }
    }

    fn open(&self) -> Result<tar::Archive<io::BufReader<fs::File>>> {
        let f = fs::File::open(&self.path).map_err(|e| ImageError::io("open", &self.path, e))?;
        Ok(tar::Archive::new(io::BufReader::new(f)))
    }

    fn bad_tar(&self, e: io::Error) -> ImageError {
        ImageError::malformed(self.describe(), format!("not a readable tar: {e}"))
    }

    /// Reads the named small members (manifest, config) in one pass.
    fn members(&self, names: &[&str]) -> Result<HashMap<String, Vec<u8>>> {
        let mut found = HashMap::new();
        let mut a = self.open()?;
        for e in a.entries().map_err(|e| self.bad_tar(e))? {
            let mut e = e.map_err(|e| self.bad_tar(e))?;
            let p = String::from_utf8_lossy(&e.path_bytes()).into_owned();
            let p = p.trim_start_matches("./").to_owned();
            if names.contains(&p.as_str()) {
                if e.size() > MAX_JSON {
                    return Err(ImageError::malformed(
                        self.describe(),
                        format!("{p} is too large"),
                    ));
                }
                let mut v = Vec::new();
                e.read_to_end(&mut v).map_err(|e| self.bad_tar(e))?;
                found.insert(p, v);
            }
        }
        Ok(found)
    }

    fn resolve_blocking(&self) -> Result<Resolved> {
        let name = self.describe();
        let manifest = self.members(&["manifest.json"])?;
        let manifest = manifest.get("manifest.json").ok_or_else(|| {
            ImageError::malformed(&name, "no manifest.json: not a `docker save` archive")
        })?;
        let entries: Vec<ArchiveEntry> = serde_json::from_slice(manifest)
            .map_err(|e| ImageError::malformed(&name, format!("manifest.json: {e}")))?;
        let entry = entries
            .into_iter()
            .next()
            .ok_or_else(|| ImageError::malformed(&name, "manifest.json lists no image"))?;
        let config = self.members(&[entry.config.as_str()])?;
        let config = config
            .get(&entry.config)
            .ok_or_else(|| ImageError::malformed(&name, format!("{} is missing", entry.config)))?
            .clone();
        let (_, diff_ids) = crate::config::parse(&config, &name)?;
        if diff_ids.len() != entry.layers.len() {
            return Err(ImageError::malformed(
                &name,
                "manifest.json and the config disagree on the layers",
            ));
        }
        // Extract every layer once, addressed by the digest of its bytes.
        let mut by_path: HashMap<String, (String, u64)> = HashMap::new();
        let mut a = self.open()?;
        for e in a.entries().map_err(|e| self.bad_tar(e))? {
            let e = e.map_err(|e| self.bad_tar(e))?;
            let p = String::from_utf8_lossy(&e.path_bytes())
                .trim_start_matches("./")
                .to_owned();
            if !entry.layers.contains(&p) || by_path.contains_key(&p) {
                continue;
            }
            let tmp = self
                .scratch
                .join(format!("archive-{}", uuid::Uuid::new_v4().simple()));
            let mut out = fs::File::create(&tmp).map_err(|e| ImageError::io("create", &tmp, e))?;
            let mut r = HashingReader::new(e);
            // The archive's failure is a bad archive; the disk's is the disk's.
            if let Err(f) = crate::unpack::copy_apart(&mut r, &mut out) {
                let _ = fs::remove_file(&tmp);
                return Err(match f {
                    crate::unpack::CopyFailure::Read(e) => self.bad_tar(e),
                    crate::unpack::CopyFailure::Write(e) => ImageError::io("write", &tmp, e),
                });
            }
            let size = r.count();
            let d = r.finish();
            if let Ok(mut map) = self.extracted.0.lock() {
                map.insert(d.clone(), tmp);
            }
            by_path.insert(p, (d, size));
        }
        let mut layers = Vec::new();
        for (p, diff_id) in entry.layers.iter().zip(diff_ids) {
            let (d, size) = by_path
                .get(p)
                .ok_or_else(|| ImageError::malformed(&name, format!("layer {p} is missing")))?;
            let head = self
                .extracted
                .0
                .lock()
                .ok()
                .and_then(|m| m.get(d).cloned())
                .and_then(|path| {
                    let mut b = [0u8; 4];
                    fs::File::open(path)
                        .and_then(|mut f| f.read(&mut b).map(|n| b[..n].to_vec()))
                        .ok()
                })
                .unwrap_or_default();
            let media_type = match crate::unpack::Compression::sniff(&head) {
                crate::unpack::Compression::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
                crate::unpack::Compression::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
                crate::unpack::Compression::None => "application/vnd.oci.image.layer.v1.tar",
            };
            layers.push(LayerDesc {
                digest: d.clone(),
                media_type: media_type.into(),
                size: Some(*size),
                diff_id,
            });
        }
        // The archive has no manifest of its own: its identity is the digest of a canonical
        // description (config digest + layers), as `docker load` would produce one.
        let config_digest = digest::of(&config);
        let ident = serde_json::json!({
            "config": config_digest,
            "layers": layers.iter().map(|l| l.digest.clone()).collect::<Vec<_>>(),
        });
        Ok(Resolved {
            manifest_digest: digest::of(ident.to_string().as_bytes()),
            config,
            layers,
        })
    }
}

#[async_trait]
impl Source for DockerArchive {
    fn describe(&self) -> String {
        format!("docker-archive:{}", self.path.display())
    }

    async fn resolve(&self) -> Result<Resolved> {
        // Reading and hashing the whole archive: off the async threads (which may be a
        // single-threaded runtime's only one).
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.resolve_blocking())
            .await
            .map_err(|e| ImageError::io("read", self.path.clone(), io::Error::other(e)))?
    }

    async fn fetch(&self, layer: &LayerDesc, dest: &Path, max_bytes: u64) -> Result<()> {
        let src = self
            .extracted
            .0
            .lock()
            .ok()
            .and_then(|mut m| m.remove(&layer.digest))
            .ok_or_else(|| {
                ImageError::malformed(
                    self.describe(),
                    format!("layer {} was not extracted", layer.digest),
                )
            })?;
        let size = fs::metadata(&src).map(|m| m.len()).unwrap_or(0);
        if size > max_bytes {
            let _ = fs::remove_file(&src);
            return Err(ImageError::CacheFull {
                needed: size,
                cap: max_bytes,
                used: 0,
            });
        }
        fs::rename(&src, dest).map_err(|e| ImageError::io("move the layer to", dest, e))
    }
}
