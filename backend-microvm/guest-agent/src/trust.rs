//! The certificates a guest with proxy-held secrets trusts (`Trust`): the egress proxy
//! intercepts TLS to the hosts a secret is bound to, so the guest's TLS clients must trust its
//! interception CA. The agent writes its root's system bundle with that CA appended to
//! [`CA_BUNDLE`] (which the host's `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`... variables name)
//! and over the system bundle itself ([`SYSTEM_BUNDLE`]), for programs that read only that
//! path, as the container and gVisor tiers do.
//!
//! The root is the image's (or the initramfs's) and may be hostile: a directory on the way
//! that is a symbolic link is refused rather than followed, an existing bundle is read only
//! if it is a regular file of bounded size (a FIFO or a device there cannot block or flood
//! the agent), and each file is replaced (unlinked, then created anew) instead of written
//! through, so a link planted at either path is never followed. Nothing of the sandbox runs
//! yet when the host sends `Trust` (it comes right after the boot), so nothing races these
//! checks. Sent again after a restore (the copy's proxy may hold another CA), it replaces
//! the CA it wrote before instead of adding to it.

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

pub(crate) use crate::proto::{CA_BUNDLE, CA_MARK as MARK, SYSTEM_BUNDLE};

/// The largest CA the host may send.
pub(crate) const MAX_CA: usize = 64 << 10;
/// The largest system bundle taken over (Debian's is ~220 KiB).
const MAX_SYSTEM_BUNDLE: u64 = 8 << 20;
/// `O_NONBLOCK`: opening a FIFO for reading must not wait for a writer.
const O_NONBLOCK: i32 = 0o4000;

/// Installs `ca_pem` under `root` (`/` in a guest; a temporary directory in the tests).
pub(crate) fn install(root: &Path, ca_pem: &[u8]) -> Result<(), String> {
    let pem = std::str::from_utf8(ca_pem).map_err(|_| "the CA is not text".to_string())?;
    if pem.len() > MAX_CA || !pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(format!(
            "the CA must be PEM certificates of at most {MAX_CA} bytes"
        ));
    }
    let system = root.join(SYSTEM_BUNDLE);
    let certs = system
        .parent()
        .ok_or_else(|| format!("{SYSTEM_BUNDLE}: no parent"))?;
    real_dirs(root, certs)?;
    let mut bundle = read_bundle(&system).map_err(|e| format!("{}: {e}", system.display()))?;
    // A guest restored from a snapshot trusts the proxy of the sandbox it was: that CA goes,
    // this one takes its place.
    if let Some(at) = bundle.find(MARK) {
        bundle.truncate(at);
    }
    if !bundle.is_empty() && !bundle.ends_with('\n') {
        bundle.push('\n');
    }
    bundle.push_str(MARK);
    bundle.push_str(pem);
    for path in [root.join(CA_BUNDLE), system] {
        replace(&path, bundle.as_bytes()).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// Makes every directory from `root` down to `dir` (mode 0755), refusing one that is a
/// symbolic link or not a directory.
fn real_dirs(root: &Path, dir: &Path) -> Result<(), String> {
    let rel = dir
        .strip_prefix(root)
        .map_err(|_| format!("{} is outside {}", dir.display(), root.display()))?;
    let mut at = PathBuf::from(root);
    for c in rel.components() {
        at.push(c);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                return Err(format!(
                    "{} is a symbolic link: the CA is not written through it",
                    at.display()
                ))
            }
            Ok(_) => return Err(format!("{} is not a directory", at.display())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => fs::DirBuilder::new()
                .mode(0o755)
                .create(&at)
                .map_err(|e| format!("mkdir {}: {e}", at.display()))?,
            Err(e) => return Err(format!("{}: {e}", at.display())),
        }
    }
    Ok(())
}

/// The root's system bundle: its text if it is a regular file (a link to one is followed,
/// as a TLS client would) of at most [`MAX_SYSTEM_BUNDLE`] bytes; empty if there is none or
/// it is anything else.
fn read_bundle(path: &Path) -> io::Result<String> {
    let f = match OpenOptions::new()
        .read(true)
        .custom_flags(O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(String::new()),
        Err(e) => return Err(e),
    };
    let m = f.metadata()?;
    if !m.is_file() || m.len() > MAX_SYSTEM_BUNDLE {
        return Ok(String::new());
    }
    let mut text = String::new();
    match f.take(MAX_SYSTEM_BUNDLE).read_to_string(&mut text) {
        Ok(_) => Ok(text),
        // Not text: not a bundle a TLS client could use either.
        Err(e) if e.kind() == io::ErrorKind::InvalidData => Ok(String::new()),
        Err(e) => Err(e),
    }
}

/// Writes `data` as a new regular file at `path` (0644), removing what was there first.
fn replace(path: &Path, data: &[u8]) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path)?,
        Ok(_) => fs::remove_file(path)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(path)?;
    f.write_all(data)?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const CA: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    fn root() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "agent-trust-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn read(p: PathBuf) -> String {
        fs::read_to_string(p).unwrap()
    }

    #[test]
    fn an_empty_root_gets_both_files_with_the_ca() {
        let r = root();
        install(&r, CA.as_bytes()).unwrap();
        for p in [CA_BUNDLE, SYSTEM_BUNDLE] {
            assert_eq!(read(r.join(p)), format!("{MARK}{CA}"), "{p}");
        }
        fs::remove_dir_all(&r).unwrap();
    }

    #[test]
    fn the_system_bundle_is_kept_and_the_ca_appended() {
        let r = root();
        fs::create_dir_all(r.join("etc/ssl/certs")).unwrap();
        fs::write(r.join(SYSTEM_BUNDLE), "SYSTEM CERTS").unwrap();
        install(&r, CA.as_bytes()).unwrap();
        let want = format!("SYSTEM CERTS\n{MARK}{CA}");
        assert_eq!(read(r.join(SYSTEM_BUNDLE)), want);
        assert_eq!(read(r.join(CA_BUNDLE)), want);
        fs::remove_dir_all(&r).unwrap();
    }

    #[test]
    fn a_second_trust_replaces_the_first_ca() {
        let r = root();
        fs::create_dir_all(r.join("etc/ssl/certs")).unwrap();
        fs::write(r.join(SYSTEM_BUNDLE), "SYSTEM CERTS\n").unwrap();
        install(&r, CA.as_bytes()).unwrap();
        let other = CA.replace("MIIB", "MIIC");
        install(&r, other.as_bytes()).unwrap();
        let want = format!("SYSTEM CERTS\n{MARK}{other}");
        assert_eq!(read(r.join(SYSTEM_BUNDLE)), want);
        assert_eq!(read(r.join(CA_BUNDLE)), want);
        fs::remove_dir_all(&r).unwrap();
    }

    #[test]
    fn links_planted_by_the_image_are_never_written_through() {
        let r = root();
        let outside = root();
        // The bundle a link to a file elsewhere: read, then replaced, the target untouched.
        fs::create_dir_all(r.join("etc/ssl/certs")).unwrap();
        fs::write(outside.join("target"), "OTHER").unwrap();
        std::os::unix::fs::symlink(outside.join("target"), r.join(SYSTEM_BUNDLE)).unwrap();
        std::os::unix::fs::symlink(outside.join("target2"), r.join(CA_BUNDLE)).unwrap();
        install(&r, CA.as_bytes()).unwrap();
        assert_eq!(read(outside.join("target")), "OTHER");
        assert!(!outside.join("target2").exists());
        assert!(!fs::symlink_metadata(r.join(SYSTEM_BUNDLE))
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(read(r.join(SYSTEM_BUNDLE)), format!("OTHER\n{MARK}{CA}"));
        // A directory on the way that is a link: refused, nothing written.
        let r2 = root();
        fs::create_dir_all(r2.join("etc")).unwrap();
        std::os::unix::fs::symlink(&outside, r2.join("etc/ssl")).unwrap();
        let e = install(&r2, CA.as_bytes()).unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");
        assert!(!outside.join("certs").exists());
        for d in [r, r2, outside] {
            fs::remove_dir_all(d).unwrap();
        }
    }

    #[test]
    fn a_fifo_at_the_bundle_does_not_block_and_bad_cas_are_refused() {
        let r = root();
        fs::create_dir_all(r.join("etc/ssl/certs")).unwrap();
        let c = std::ffi::CString::new(r.join(SYSTEM_BUNDLE).to_str().unwrap()).unwrap();
        extern "C" {
            fn mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
        }
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { mkfifo(c.as_ptr(), 0o644) }, 0);
        install(&r, CA.as_bytes()).unwrap();
        assert_eq!(read(r.join(SYSTEM_BUNDLE)), format!("{MARK}{CA}"));
        for bad in [&b"not a certificate"[..], &[0xff, 0xfe][..]] {
            assert!(install(&r, bad).is_err());
        }
        let big = format!("-----BEGIN CERTIFICATE-----\n{}", "A".repeat(MAX_CA));
        assert!(install(&r, big.as_bytes()).is_err());
        fs::remove_dir_all(&r).unwrap();
    }
}
