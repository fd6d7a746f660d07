//! OCI images for agent-sandbox: one job — turn an [`ImageRef`] into unpacked, verified
//! layers on local disk that every sandbox of that image shares read-only.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use sandbox_image::{ImageRef, ImageStore};
//! let store = ImageStore::open_default()?;
//! let image = store.ensure(&ImageRef::parse("python:3.12-slim")?).await?;
//! println!("{} layers, lowest first: {:?}", image.layers().len(), image.layers());
//! println!("env: {:?}", image.config().env);
//! # Ok(()) }
//! ```
//!
//! - **Sources** ([`ImageRef`]): OCI distribution registries over HTTPS (anonymous, bearer
//!   token and basic auth, credentials from `~/.docker/config.json`/`$DOCKER_CONFIG` or
//!   [`StoreBuilder::credentials`]), plain HTTP only for loopback registries and ones listed
//!   with [`StoreBuilder::insecure_registry`]; OCI image-layout directories; `docker save`
//!   tarballs. Indexes resolve to linux/amd64; OCI and Docker schema-2 manifests; gzip, zstd
//!   and plain layers. The HTTP side is the `oci-client` crate (see `docs/images.md` for why).
//! - **Cache** ([`ImageStore`]): content-addressed blobs, layers unpacked once per diff-id,
//!   every digest checked on download and again while unpacking, work done in `tmp/` and
//!   renamed into place, file locks so concurrent pulls do the work once, a size cap, `rm`
//!   and `prune`.
//! - **Unpacking** (see the `unpack` module's rules): whiteouts as overlayfs expects them; no
//!   entry, link or hard link lands outside the layer; device nodes skipped; set-id bits
//!   cleared. A hostile layer is refused with the entry named.
//! - **Filesystem images** ([`ImageStore::rootfs_image`]): an image's layers merged into a
//!   read-only ext4 file (`mkfs.ext4 -d`), built once per image, for the microVM tier's
//!   virtio-blk root device.
//!
//! Backends ask [`ImageStore::ensure`] for an [`Image`] and mount its [`Image::layers`] as
//! overlay lower layers; none of them parses a registry.
//!
//! `docs/images.md` in the repository is the design (sources, the cache, the unpacking rules,
//! the microVM's filesystem image); `docs/threat-model.md` lists what a hostile layer is
//! stopped by and the tests that play one.

#![forbid(unsafe_code)]

mod auth;
mod beneath;
mod config;
mod digest;
mod error;
mod fsimage;
#[cfg(test)]
mod hostile_fuzz;
mod offline;
mod registry;
mod source;
mod store;
pub mod testing;
mod unpack;

pub use auth::{docker_config_path, from_docker_config, Credentials};
pub use config::ImageConfig;
pub use error::{ImageError, Result};
pub use fsimage::FsImage;
pub use sandbox_core::ImageRef;
pub use store::{Image, ImageInfo, ImageStore, PruneReport, StoreBuilder, DEFAULT_MAX_BYTES};
