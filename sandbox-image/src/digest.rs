//! Content digests (`sha256:<hex>`): parsing, and readers that hash what passes through.

use std::io::{self, Read};

use sha2::{Digest as _, Sha256};

use crate::error::{ImageError, Result};

/// The hex part of a `sha256:<64 hex>` digest, checked (it names files in the cache, so it
/// must be exactly that).
///
/// # Errors
/// [`ImageError::Unsupported`] for another algorithm or a malformed digest.
pub(crate) fn sha256_hex(digest: &str) -> Result<&str> {
    match digest.split_once(':') {
        Some(("sha256", hex))
            if hex.len() == 64
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
        {
            Ok(hex)
        }
        _ => Err(ImageError::Unsupported(format!(
            "digest `{digest}` (only sha256 digests are supported)"
        ))),
    }
}

/// `sha256:<hex>` of `bytes`.
pub(crate) fn of(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Checks that `bytes` have digest `expected`.
///
/// # Errors
/// [`ImageError::DigestMismatch`] naming `what`.
pub(crate) fn verify(what: &str, bytes: &[u8], expected: &str) -> Result<()> {
    let actual = of(bytes);
    if actual == expected {
        Ok(())
    } else {
        Err(ImageError::DigestMismatch {
            what: what.to_owned(),
            expected: expected.to_owned(),
            actual,
        })
    }
}

/// A reader that hashes and counts every byte read through it.
pub(crate) struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
    count: u64,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }

    /// Reads the rest of the input (a tar reader stops at the end-of-archive marker and a
    /// decompressor at the end of its stream: what follows must be hashed too).
    pub(crate) fn drain(&mut self) -> io::Result<()> {
        io::copy(self, &mut io::sink()).map(drop)
    }

    /// Bytes read so far.
    pub(crate) fn count(&self) -> u64 {
        self.count
    }

    /// `sha256:<hex>` of everything read.
    pub(crate) fn finish(self) -> String {
        format!("sha256:{}", hex::encode(self.hasher.finalize()))
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_checked_and_computed() {
        let empty = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(of(b""), empty);
        assert!(sha256_hex(empty).is_ok());
        for bad in ["sha256:abc", "md5:00", "sha256:../../etc/passwd", "nope"] {
            assert!(sha256_hex(bad).is_err(), "{bad}");
        }
        assert!(verify("x", b"", empty).is_ok());
        assert!(matches!(
            verify("layer", b"a", empty),
            Err(ImageError::DigestMismatch { .. })
        ));
        let mut r = HashingReader::new(&b"hello"[..]);
        let mut first = [0u8; 2];
        assert!(r.read_exact(&mut first).is_ok());
        assert!(r.drain().is_ok());
        assert_eq!(r.count(), 5);
        assert_eq!(r.finish(), of(b"hello"));
    }
}
