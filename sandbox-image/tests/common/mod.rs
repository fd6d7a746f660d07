//! Test helpers: OCI image layouts written by hand (so every byte is ours to break), the real
//! CNCF registry (`docker-registry`, Debian) on a loopback port, and `skopeo` to push.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub const SKOPEO: &str = sandbox_image::testing::SKOPEO_BIN;

/// Whether the real parts are installed (`scripts/test.sh` installs them); prints why not.
pub fn have_tools() -> bool {
    match sandbox_image::testing::LocalRegistry::unavailable() {
        Some(why) => {
            eprintln!("SKIP: {why}");
            false
        }
        None => true,
    }
}

pub fn sha(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

/// A tar entry for [`layer`].
pub enum Entry<'a> {
    File(&'a str, &'a [u8]),
    Dir(&'a str),
    Symlink(&'a str, &'a str),
    /// A whiteout of `name` in `dir` (`dir/.wh.name`).
    Whiteout(&'a str),
    /// An opaque marker for a directory (`dir/.wh..wh..opq`).
    Opaque(&'a str),
}

/// A layer tar (uncompressed) of `entries`.
pub fn layer(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(1_700_000_000);
        match e {
            Entry::File(p, data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o755);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, p, *data).unwrap();
            }
            Entry::Dir(p) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                b.append_data(&mut h, p, &[][..]).unwrap();
            }
            Entry::Symlink(p, t) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                b.append_link(&mut h, p, t).unwrap();
            }
            Entry::Whiteout(p) | Entry::Opaque(p) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(0);
                b.append_data(&mut h, p, &[][..]).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

pub fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

pub fn zstd(b: &[u8]) -> Vec<u8> {
    zstd::encode_all(b, 3).unwrap()
}

#[derive(Clone, Copy)]
pub enum Comp {
    Gzip,
    Zstd,
}

/// An OCI image layout under construction.
pub struct Layout {
    pub dir: PathBuf,
    index: Vec<serde_json::Value>,
}

impl Layout {
    pub fn new(dir: &Path) -> Self {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Layout {
            dir: dir.to_path_buf(),
            index: Vec::new(),
        }
    }

    pub fn blob(&self, b: &[u8]) -> String {
        let d = sha(b);
        std::fs::write(self.dir.join("blobs/sha256").join(&d[7..]), b).unwrap();
        d
    }

    /// Writes an image manifest for `layers` (uncompressed tars, lowest first) and returns
    /// (manifest descriptor json, manifest digest).
    pub fn image(
        &self,
        layers: &[Vec<u8>],
        comp: Comp,
        env: &[&str],
        arch: &str,
    ) -> (serde_json::Value, String) {
        let mut descs = Vec::new();
        let mut diff_ids = Vec::new();
        for l in layers {
            let (bytes, mt) = match comp {
                Comp::Gzip => (gzip(l), "application/vnd.oci.image.layer.v1.tar+gzip"),
                Comp::Zstd => (zstd(l), "application/vnd.oci.image.layer.v1.tar+zstd"),
            };
            let d = self.blob(&bytes);
            descs.push(serde_json::json!({"mediaType": mt, "digest": d, "size": bytes.len()}));
            diff_ids.push(sha(l));
        }
        let config = serde_json::json!({
            "architecture": arch, "os": "linux",
            "config": {"Env": env, "Cmd": ["/bin/sh"], "WorkingDir": "/work"},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        })
        .to_string();
        let cd = self.blob(config.as_bytes());
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": config.len()},
            "layers": descs,
        })
        .to_string();
        let md = self.blob(manifest.as_bytes());
        (
            serde_json::json!({
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": md, "size": manifest.len(),
                "platform": {"architecture": arch, "os": "linux"},
            }),
            md,
        )
    }

    /// Adds `desc` to the index under `tag`.
    pub fn tag(&mut self, mut desc: serde_json::Value, tag: &str) {
        desc["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": tag});
        self.index.push(desc);
        self.write_index();
    }

    /// Adds an image index of `manifests` under `tag`.
    pub fn tag_index(&mut self, manifests: Vec<serde_json::Value>, tag: &str) -> String {
        let idx = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": manifests,
        })
        .to_string();
        let d = self.blob(idx.as_bytes());
        self.tag(
            serde_json::json!({"mediaType": "application/vnd.oci.image.index.v1+json", "digest": d, "size": idx.len()}),
            tag,
        );
        d
    }

    fn write_index(&self) {
        let idx = serde_json::json!({"schemaVersion": 2, "manifests": self.index});
        std::fs::write(self.dir.join("index.json"), idx.to_string()).unwrap();
    }
}

/// A running `docker-registry` on 127.0.0.1 (see `sandbox_image::testing`), in a temporary
/// directory, killed on drop.
pub struct Registry {
    inner: sandbox_image::testing::LocalRegistry,
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl Registry {
    /// Starts one, with TLS and/or htpasswd auth when given.
    pub fn start(tls: Option<(&Path, &Path)>, htpasswd: Option<&Path>) -> Registry {
        let auth = htpasswd.map(|h| {
            format!(
                "auth:\n  htpasswd:\n    realm: test\n    path: {}\n",
                h.display()
            )
        });
        Self::start_with_auth(tls, auth.as_deref())
    }

    /// Starts one with this top-level `auth:` YAML section.
    pub fn start_with_auth(tls: Option<(&Path, &Path)>, auth: Option<&str>) -> Registry {
        let dir = tempfile::tempdir().unwrap();
        let inner =
            sandbox_image::testing::LocalRegistry::start_with(dir.path(), tls, auth).unwrap();
        Registry {
            addr: inner.addr().to_owned(),
            inner,
            _dir: dir,
        }
    }

    /// Pushes `oci:LAYOUT:TAG` to `REPO:TAG` here with skopeo.
    pub fn push(&self, layout: &Path, tag: &str, repo: &str, extra: &[&str]) {
        self.inner.push(layout, tag, repo, extra).unwrap();
    }

    /// The file holding blob `digest` in the registry's storage.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        self.inner.blob_file(digest)
    }
}

/// Every file under `dir`, relative, sorted (to check that nothing stayed behind).
pub fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(p.clone());
            }
            out.push(p.strip_prefix(dir).unwrap().display().to_string());
        }
    }
    out.sort();
    out
}

/// A layer tar written header by header, so paths `tar::Builder` refuses (`..`) can be made:
/// (type, path, link target, contents).
pub fn raw_layer(entries: &[(tar::EntryType, &str, &str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (kind, path, link, data) in entries {
        let mut h = tar::Header::new_old();
        {
            let old = h.as_old_mut();
            old.name[..path.len()].copy_from_slice(path.as_bytes());
            old.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        h.set_entry_type(*kind);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// A test CA and a certificate for 127.0.0.1 signed by it, written as PEM files:
/// (ca.pem, cert.pem, key.pem).
pub fn test_tls(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params
        .subject_alt_names
        .push(rcgen::SanType::IpAddress(std::net::IpAddr::from([
            127, 0, 0, 1,
        ])));
    let cert = params.signed_by(&key, &ca).unwrap();
    let paths = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}
