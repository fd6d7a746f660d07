//! Test support for code that uses images: the real CNCF distribution registry
//! (`docker-registry`, a Debian package) on a loopback port, and `skopeo` to push OCI
//! layouts to it. Our own tests, benches and examples use it; so can yours, to test an agent
//! against images without reaching the internet.
//!
//! ```no_run
//! # fn demo() -> std::io::Result<()> {
//! use sandbox_image::testing::LocalRegistry;
//! let dir = std::env::temp_dir().join("my-registry");
//! let registry = LocalRegistry::start(&dir)?;
//! registry.push(std::path::Path::new("/images/app"), "v1", "team/app", &[])?;
//! // Pull `{registry.addr()}/team/app:v1`: plain HTTP on loopback needs no flag.
//! # Ok(()) }
//! ```

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian installs the registry server.
pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";
/// Where Debian installs skopeo.
pub const SKOPEO_BIN: &str = "/usr/bin/skopeo";

/// A running registry on `127.0.0.1`, storing under its directory; killed on drop.
#[derive(Debug)]
pub struct LocalRegistry {
    child: Child,
    addr: String,
    storage: PathBuf,
}

impl LocalRegistry {
    /// Why the registry cannot run here (its packages missing), if it cannot.
    pub fn unavailable() -> Option<String> {
        [REGISTRY_BIN, SKOPEO_BIN]
            .iter()
            .find(|p| !Path::new(p).exists())
            .map(|p| format!("{p} is not installed (apt-get install docker-registry skopeo)"))
    }

    /// Starts one over plain HTTP, storing in `dir` (created).
    ///
    /// # Errors
    /// When the server cannot be started or does not listen within 30 s.
    pub fn start(dir: &Path) -> io::Result<Self> {
        Self::start_with(dir, None, None)
    }

    /// Starts one with TLS (`(certificate, key)` PEM files) and/or a top-level `auth:` YAML
    /// section (htpasswd or token auth, as the distribution server's configuration takes it).
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_with(
        dir: &Path,
        tls: Option<(&Path, &Path)>,
        auth: Option<&str>,
    ) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let storage = dir.join("storage");
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = format!("127.0.0.1:{port}");
        let mut yaml = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
            storage.display()
        );
        if let Some((cert, key)) = tls {
            yaml.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                cert.display(),
                key.display()
            ));
        }
        if let Some(a) = auth {
            yaml.push_str(a);
        }
        let cfg = dir.join("config.yml");
        std::fs::write(&cfg, yaml)?;
        let mut child = Command::new(REGISTRY_BIN)
            .arg("serve")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let start = Instant::now();
        while std::net::TcpStream::connect(&addr).is_err() {
            if start.elapsed() > Duration::from_secs(30) || child.try_wait()?.is_some() {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::other("the registry did not start listening"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(LocalRegistry {
            child,
            addr,
            storage,
        })
    }

    /// `127.0.0.1:PORT`: the registry part of references to its images.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Pushes the image tagged `tag` in the OCI layout `layout` as `REPO:TAG` with skopeo;
    /// `extra` are more skopeo arguments (`--all` for an index, `--dest-creds U:P`).
    ///
    /// # Errors
    /// When skopeo fails (its stderr is in the error).
    pub fn push(&self, layout: &Path, tag: &str, repo: &str, extra: &[&str]) -> io::Result<()> {
        let out = Command::new(SKOPEO_BIN)
            .args(["copy", "--quiet", "--dest-tls-verify=false"])
            .args(extra)
            .arg(format!("oci:{}:{tag}", layout.display()))
            .arg(format!("docker://{}/{repo}:{tag}", self.addr))
            .output()?;
        if out.status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "skopeo push failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    }

    /// The file holding blob `digest` (`sha256:<hex>`) in the registry's storage (to corrupt
    /// it in a test).
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        self.storage
            .join("docker/registry/v2/blobs/sha256")
            .join(hex.get(..2).unwrap_or(""))
            .join(hex)
            .join("data")
    }
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
