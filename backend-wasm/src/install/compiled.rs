//! Compiled modules: CPython precompiled once per cache for this engine's settings, keyed
//! so that another wasmtime or another setting never loads a stale one.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_core::{Error, Result};
use sha2::{Digest, Sha256};

use super::{
    cache_root, hash_file, hex, io_err, private_dir, unavailable, InstallEvent, Progress, PINNED,
    SLOW_COMPILER, SNAPSHOT, TIER,
};
use crate::engine::{self, Flavor};

/// The cache key of the compiled module for `flavor`.
fn compiled_key(flavor: Flavor, module_sha: &str) -> String {
    let mut h = Sha256::new();
    h.update(engine::settings_fingerprint(flavor).as_bytes());
    h.update(b"|");
    h.update(module_sha.as_bytes());
    hex(h.finalize())[..32].to_string()
}

fn compiled_file(cache_dir: Option<&Path>, flavor: Flavor) -> Result<PathBuf> {
    let key = compiled_key(flavor, PINNED[0].2);
    Ok(cache_root(cache_dir)?
        .join("compiled")
        .join(format!("python-{key}-{}.cwasm", flavor.name())))
}

pub(super) fn precompiled_path(
    cache_dir: Option<&Path>,
    _install: &Path,
    flavor: Flavor,
) -> Option<PathBuf> {
    let p = compiled_file(cache_dir, flavor).ok()?;
    let side = sidecar(&p);
    (p.is_file() && side.is_file()).then_some(p)
}

fn sidecar(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".sha256");
    PathBuf::from(s)
}

/// Whether `p` is a compiled module whose SHA-256 matches its sidecar.
fn compiled_ok(p: &Path) -> bool {
    if !p.is_file() {
        return false;
    }
    let ok = fs::read_to_string(sidecar(p))
        .ok()
        .zip(hash_file(p).ok())
        .is_some_and(|(want, (sha, _))| sha == want.trim());
    if !ok {
        tracing::warn!(
            "compiled Python module {} is damaged; compiling it again",
            p.display()
        );
    }
    ok
}

/// Returns the verified compiled module file for `flavor`, compiling it first if missing
/// or damaged.
pub(crate) fn ensure_compiled(
    cache_dir: Option<&Path>,
    install: &Path,
    flavor: Flavor,
    progress: &dyn Progress,
) -> Result<PathBuf> {
    let p = compiled_file(cache_dir, flavor)?;
    if compiled_ok(&p) {
        return Ok(p);
    }
    if engine::compiler_is_unoptimised() {
        tracing::warn!("{SLOW_COMPILER}");
    }
    compile(install, &p, flavor, progress)?;
    Ok(p)
}

fn compile(install: &Path, dst: &Path, flavor: Flavor, progress: &dyn Progress) -> Result<()> {
    let src = install.join(SNAPSHOT);
    let bytes =
        fs::read(&src).map_err(|e| unavailable(format!("cannot read {}: {e}", src.display())))?;
    if hex(Sha256::digest(&bytes)) != PINNED[0].2 {
        return Err(unavailable(format!(
            "{} fails its pinned SHA-256",
            src.display()
        )));
    }
    let engine = engine::engine(flavor)?;
    tracing::info!(
        "compiling python-snapshot.wasm ({} flavour) into {}",
        flavor.name(),
        dst.display()
    );
    let done = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let compiled = std::thread::scope(|s| {
        let d = Arc::clone(&done);
        s.spawn(move || {
            while !d.load(Ordering::SeqCst) {
                progress.event(&InstallEvent::Compiling {
                    elapsed: started.elapsed(),
                });
                let t = Instant::now();
                while t.elapsed() < Duration::from_secs(1) && !d.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        });
        let r = engine.precompile_module(&bytes);
        done.store(true, Ordering::SeqCst);
        r
    })
    .map_err(|e| Error::backend_caused(TIER, "compiling python-snapshot.wasm", e))?;

    drop(bytes);
    let dir = dst
        .parent()
        .ok_or_else(|| Error::invalid("cache_dir", "no parent"))?;
    if let Some(root) = dir.parent() {
        private_dir(root)?;
    }
    private_dir(dir)?;
    let sha = hex(Sha256::digest(&compiled));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(|e| io_err("temp file", e))?;
    tmp.write_all(&compiled)
        .map_err(|e| io_err("write compiled module", e))?;
    tmp.as_file()
        .sync_all()
        .map_err(|e| io_err("sync compiled module", e))?;
    // The sidecar first: a module without a matching sidecar is recompiled, never used.
    fs::write(sidecar(dst), &sha).map_err(|e| io_err("write compiled module hash", e))?;
    tmp.persist(dst)
        .map_err(|e| io_err(format!("rename to {}", dst.display()), e.error))?;
    tracing::info!(
        "compiled python-snapshot.wasm in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_changes_with_flavor() {
        assert_ne!(
            compiled_key(Flavor::Plain, "x"),
            compiled_key(Flavor::Fuel, "x")
        );
        assert_ne!(
            compiled_key(Flavor::Plain, "x"),
            compiled_key(Flavor::Plain, "y")
        );
    }
}
