//! Where an image comes from: a registry ([`crate::registry`]), an OCI image layout or a
//! `docker save` tarball ([`crate::offline`]). Each resolves a reference to one linux/amd64
//! image (manifest digest, verified config, layer list) and fetches layer blobs into files
//! the store then moves into place.

use std::path::Path;

use async_trait::async_trait;
use serde::Deserialize;

use crate::error::{ImageError, Result};

/// One layer of a resolved image.
#[derive(Debug, Clone)]
pub(crate) struct LayerDesc {
    /// The blob's digest (what is downloaded and cached under `blobs/`).
    pub digest: String,
    /// Its media type (decides the decompression).
    pub media_type: String,
    /// Its size in bytes, when the source states it.
    pub size: Option<u64>,
    /// The digest of its uncompressed tar, from the config.
    pub diff_id: String,
}

/// A reference resolved to one image.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    /// The manifest's digest: the image's identity in the cache.
    pub manifest_digest: String,
    /// The config blob, verified against its digest.
    pub config: Vec<u8>,
    /// The layers, lowest first.
    pub layers: Vec<LayerDesc>,
}

/// The action of the error a [`Source::stream`] returns when its receiver went away (the
/// unpack stopped, with an error of its own).
pub(crate) const HAND_OVER: &str = "hand over a chunk of";

/// A place images come from.
#[async_trait]
pub(crate) trait Source: Send + Sync {
    /// The source as users wrote it, for messages.
    fn describe(&self) -> String;

    /// Resolves the reference (an index to its linux/amd64 manifest), fetching and verifying
    /// the manifest and the config.
    async fn resolve(&self) -> Result<Resolved>;

    /// Writes the blob of `layer` to `dest` (a new file in the store's `tmp/`), verified
    /// against `layer.digest`, refusing more than `max_bytes`.
    async fn fetch(&self, layer: &LayerDesc, dest: &Path, max_bytes: u64) -> Result<()>;

    /// Whether [`Source::stream`] works: the store then unpacks a layer while it arrives
    /// (a download), rather than after (a local copy costs little).
    fn streams(&self) -> bool {
        false
    }

    /// Sends the blob of `layer` into `tx` as it arrives, refusing more than `max_bytes`; the
    /// `Ok` comes only once the whole blob matched `layer.digest` (what was sent before is
    /// unverified until then).
    async fn stream(
        &self,
        layer: &LayerDesc,
        _max_bytes: u64,
        _tx: tokio::sync::mpsc::Sender<bytes::Bytes>,
    ) -> Result<()> {
        Err(ImageError::io(
            "stream",
            Path::new(&layer.digest),
            std::io::Error::from(std::io::ErrorKind::Unsupported),
        ))
    }
}

/// A descriptor, as in manifests and indexes.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub platform: Option<Platform>,
    #[serde(default)]
    pub annotations: Option<std::collections::BTreeMap<String, String>>,
}

/// An index entry's platform.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
}

/// A manifest or an index (told apart by which list they have).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ManifestOrIndex {
    #[serde(default)]
    pub config: Option<Descriptor>,
    #[serde(default)]
    pub layers: Option<Vec<Descriptor>>,
    #[serde(default)]
    pub manifests: Option<Vec<Descriptor>>,
}

/// The linux/amd64 entry of an index.
pub(crate) fn pick_platform<'a>(
    manifests: &'a [Descriptor],
    source: &str,
) -> Result<&'a Descriptor> {
    manifests
        .iter()
        .find(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
        })
        .ok_or_else(|| {
            let have: Vec<String> = manifests
                .iter()
                .filter_map(|d| d.platform.as_ref())
                .map(|p| format!("{}/{}", p.os, p.architecture))
                .collect();
            ImageError::Unsupported(format!(
                "{source} has no linux/amd64 image (it has: {})",
                if have.is_empty() {
                    "none".into()
                } else {
                    have.join(", ")
                }
            ))
        })
}

/// Pairs a manifest's layer descriptors with the config's diff-ids.
pub(crate) fn layers_of(
    layers: &[Descriptor],
    diff_ids: &[String],
    source: &str,
) -> Result<Vec<LayerDesc>> {
    if layers.len() != diff_ids.len() {
        return Err(ImageError::malformed(
            source,
            format!(
                "the manifest lists {} layers but the config {} diff-ids",
                layers.len(),
                diff_ids.len()
            ),
        ));
    }
    layers
        .iter()
        .zip(diff_ids)
        .map(|(l, d)| {
            crate::digest::sha256_hex(&l.digest)?;
            crate::unpack::Compression::from_media_type(&l.media_type)?;
            Ok(LayerDesc {
                digest: l.digest.clone(),
                media_type: l.media_type.clone(),
                size: l.size,
                diff_id: d.clone(),
            })
        })
        .collect()
}
