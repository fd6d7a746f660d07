//! Safe layer unpacking: a layer tar into a fresh directory that overlayfs can use as a lower
//! layer, verifying both the blob's digest and the layer's diff-id on the way.
//!
//! # The rules (see `docs/images.md`)
//! - **Nothing lands outside the layer directory.** Entry paths and hard-link targets are
//!   made relative (a leading `/` or `./` is dropped, as `tar` does) and any `..` component
//!   refuses the layer. No path is ever resolved through a symlink: every parent directory is
//!   checked with `lstat` before use and one that is a symlink (or not a directory) refuses
//!   the layer; the last component is created with `O_NOFOLLOW`/`O_EXCL` after removing what
//!   was there. Symlink *targets* are written as they are: they are resolved inside the
//!   sandbox, never by us.
//! - **Whiteouts** become overlayfs whiteouts: `.wh.NAME` a `0/0` character device (as root;
//!   otherwise an empty file with `user.overlay.whiteout`, the kernel's "xwhiteout"), and
//!   `.wh..wh..opq` the `overlay.opaque` xattr (both `trusted.` and `user.` forms, for a root
//!   host mount and for a sandbox's user-namespace mount). A whiteout naming `.`, `..` or
//!   nothing refuses the layer.
//! - **Hard links** must point at a non-directory already unpacked in the same layer.
//! - **Device nodes are skipped** (a sandbox gets its own `/dev`); FIFOs are kept.
//! - **set-uid/set-gid bits are cleared**: sandboxes run with `no_new_privs`, where they would
//!   do nothing, and a set-uid-root file in the host's cache is a liability. The sticky bit
//!   stays (`/tmp`).
//! - **Ownership** is kept when we run as root (the tiers idmap the layers); otherwise files
//!   belong to the caller, which is who the sandbox's root maps to in rootless mode.
//! - Extended attributes other than overlay's are dropped (file capabilities would do nothing
//!   in a sandbox without capabilities).

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::beneath;
use crate::digest::HashingReader;
use crate::error::{ImageError, Result};

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compression {
    /// A plain tar.
    None,
    /// gzip (one or more members).
    Gzip,
    /// zstd.
    Zstd,
}

impl Compression {
    /// From a layer descriptor's media type (OCI or Docker schema 2).
    ///
    /// # Errors
    /// [`ImageError::Unsupported`] for a media type that is not a layer we can unpack.
    pub(crate) fn from_media_type(mt: &str) -> Result<Self> {
        Ok(match mt {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Compression::None,
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip" => Compression::Gzip,
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.docker.image.rootfs.diff.tar.zstd" => Compression::Zstd,
            other => {
                return Err(ImageError::Unsupported(format!(
                    "layer media type `{other}` (gzip, zstd and plain tar layers are supported)"
                )))
            }
        })
    }

    /// From a blob's first bytes (sources that do not say, like `docker save`).
    pub(crate) fn sniff(head: &[u8]) -> Self {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }
}

/// What to expect of a layer.
#[derive(Debug, Clone)]
pub(crate) struct LayerSpec<'a> {
    /// The blob's digest, when the source states one (verified over the compressed bytes).
    pub blob_digest: Option<&'a str>,
    /// The layer's diff-id (verified over the uncompressed tar).
    pub diff_id: &'a str,
    /// How the blob is compressed.
    pub compression: Compression,
}

/// What an unpack produced.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Unpacked {
    /// Bytes the layer takes in the cache, approximately (file contents plus 512 bytes per
    /// entry).
    pub bytes: u64,
    /// Entries written.
    pub entries: u64,
    /// Device nodes skipped.
    pub skipped_devices: u64,
}

/// Bytes counted per entry on top of its contents (an inode, a directory slot).
const ENTRY_COST: u64 = 512;

/// Largest body of an extension header (a GNU long name or link, a PAX record set) accepted.
/// Linux paths stop at 4 KiB; a larger one is an attack on the unpacker's memory.
pub(crate) const MAX_EXTENSION: u64 = 64 << 10;

/// What the extension headers before an entry said about it.
#[derive(Debug, Default)]
struct Extensions {
    /// A GNU long name (`L`).
    long_name: Option<Vec<u8>>,
    /// A GNU long link target (`K`).
    long_link: Option<Vec<u8>>,
    /// PAX records (`x`).
    pax: Option<Vec<u8>>,
}

impl Extensions {
    fn is_empty(&self) -> bool {
        self.long_name.is_none() && self.long_link.is_none() && self.pax.is_none()
    }

    /// A PAX record's value.
    fn pax(&self, key: &str) -> Option<&[u8]> {
        let pax = self.pax.as_deref()?;
        tar::PaxExtensions::new(pax)
            .filter_map(|r| r.ok())
            .find(|r| r.key_bytes() == key.as_bytes())
            .map(|r| r.value_bytes())
    }

    /// A PAX record's value as a number (its integer part: `mtime` may have a fraction).
    fn pax_number(&self, key: &str) -> Option<u64> {
        let v = self.pax(key)?;
        let whole = v.split(|b| *b == b'.').next().unwrap_or(v);
        std::str::from_utf8(whole).ok()?.parse().ok()
    }

    /// The entry's name: a long name, a PAX `path`, else the header's.
    fn path<R: Read>(&self, entry: &tar::Entry<'_, R>) -> Vec<u8> {
        if let Some(n) = &self.long_name {
            return strip_nul(n).to_vec();
        }
        self.pax("path")
            .map(<[u8]>::to_vec)
            .unwrap_or_else(|| entry.header().path_bytes().into_owned())
    }

    /// The entry's link target: a long link, a PAX `linkpath`, else the header's.
    fn link<R: Read>(&self, entry: &tar::Entry<'_, R>) -> Option<Vec<u8>> {
        if let Some(n) = &self.long_link {
            return Some(strip_nul(n).to_vec());
        }
        self.pax("linkpath")
            .map(<[u8]>::to_vec)
            .or_else(|| entry.header().link_name_bytes().map(|c| c.into_owned()))
    }
}

/// `b` without its trailing NULs (GNU long names end with one).
fn strip_nul(b: &[u8]) -> &[u8] {
    let end = b.iter().rposition(|c| *c != 0).map_or(0, |i| i + 1);
    &b[..end]
}

/// Unpacks `blob` into `dest` (an existing, empty directory), refusing it if it would take
/// more than `budget` bytes, and verifying the digests of `layer` before returning.
///
/// On error `dest` holds a partial layer: the caller discards it (it lives in the store's
/// `tmp/`).
pub(crate) fn unpack(
    blob: &Path,
    layer: &LayerSpec<'_>,
    dest: &Path,
    budget: u64,
) -> Result<Unpacked> {
    let file = fs::File::open(blob).map_err(|e| ImageError::io("open the layer blob", blob, e))?;
    unpack_from(
        io::BufReader::with_capacity(1 << 20, file),
        blob,
        layer,
        dest,
        budget,
    )
}

/// [`unpack`] of a blob read from `input` (`blob` names it in errors), e.g. as it is
/// downloaded. Reads `input` to its end, also past the end of the archive.
pub(crate) fn unpack_from(
    input: impl Read + Send,
    blob: &Path,
    layer: &LayerSpec<'_>,
    dest: &Path,
    budget: u64,
) -> Result<Unpacked> {
    let mut u = Unpacker {
        dest,
        layer: layer.diff_id,
        budget,
        stats: Unpacked::default(),
        dirs: BTreeMap::new(),
        root: nix::unistd::geteuid().is_root(),
    };
    let (diff_id, blob_digest) = match layer.compression {
        Compression::None => {
            let mut compressed = HashingReader::new(input);
            let diff_id = u.untar(&mut compressed)?;
            compressed
                .drain()
                .map_err(|e| ImageError::io("read the layer blob", blob, e))?;
            (diff_id, compressed.finish())
        }
        c => inflate_beside(input, c, blob, |tar| u.untar(tar))?,
    };
    if let Some(expected) = layer.blob_digest {
        if blob_digest != expected {
            return Err(ImageError::DigestMismatch {
                what: format!("layer blob {expected}"),
                expected: expected.to_owned(),
                actual: blob_digest,
            });
        }
    }
    if diff_id != layer.diff_id {
        return Err(ImageError::DigestMismatch {
            what: format!("uncompressed layer (diff-id) {}", layer.diff_id),
            expected: layer.diff_id.to_owned(),
            actual: diff_id,
        });
    }
    u.finish_dirs()?;
    Ok(u.stats)
}

/// Decompressed bytes in flight from the decompression thread to the archive's reader: at
/// most this many chunks of [`INFLATED_CHUNK`] bytes.
const INFLATED_CHUNKS: usize = 4;
const INFLATED_CHUNK: usize = 256 << 10;

/// How the decompression thread ended, other than with the blob's digest.
enum Inflate {
    /// The decoder could not start (e.g. not zstd at all).
    Start(io::Error),
    /// Reading the blob past the end of its compressed stream failed.
    Read(io::Error),
    /// A decoding error, already handed to the reader in the stream.
    Sent,
    /// The reader stopped reading (it failed, with an error of its own).
    Stopped,
}

/// Runs `untar` over the decompressed blob while a thread of its own decompresses it (the
/// two halves of an unpack take about as long each: decompression against the diff-id's
/// hash and the files), and returns `untar`'s result with the blob's digest.
fn inflate_beside(
    input: impl Read + Send,
    compression: Compression,
    blob: &Path,
    untar: impl FnOnce(&mut dyn Read) -> Result<String>,
) -> Result<(String, String)> {
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel(INFLATED_CHUNKS);
        let worker = std::thread::Builder::new()
            .name("layer-inflate".into())
            .spawn_scoped(s, move || inflate(input, compression, tx))
            .map_err(|e| ImageError::io("start decompressing", blob, e))?;
        let mut reader = Inflated {
            rx,
            chunk: Vec::new(),
            pos: 0,
        };
        let untarred = untar(&mut reader);
        // A thread still sending now stops.
        drop(reader);
        let inflated = worker.join().map_err(|_| {
            ImageError::io(
                "decompress",
                blob,
                io::Error::other("the decompression thread panicked"),
            )
        })?;
        match (inflated, untarred) {
            (Err(Inflate::Start(e)), _) => Err(ImageError::io("start decoding", blob, e)),
            (_, Err(e)) => Err(e),
            (Ok(digest), Ok(diff_id)) => Ok((diff_id, digest)),
            (Err(Inflate::Read(e)), Ok(_)) => Err(ImageError::io("read the layer blob", blob, e)),
            (Err(Inflate::Sent | Inflate::Stopped), Ok(_)) => Err(ImageError::io(
                "decompress",
                blob,
                io::Error::other("the decompression ended before its reader"),
            )),
        }
    })
}

/// The decompression thread: decodes `input` into chunks for the reader, then reads
/// `input` to its end; returns the digest of all of it.
fn inflate(
    input: impl Read,
    compression: Compression,
    tx: std::sync::mpsc::SyncSender<io::Result<Vec<u8>>>,
) -> std::result::Result<String, Inflate> {
    let mut compressed = HashingReader::new(input);
    {
        let mut decoder: Box<dyn Read + '_> = match compression {
            Compression::None => Box::new(&mut compressed),
            Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(&mut compressed)),
            Compression::Zstd => {
                Box::new(zstd::stream::read::Decoder::new(&mut compressed).map_err(Inflate::Start)?)
            }
        };
        loop {
            let mut buf = vec![0u8; INFLATED_CHUNK];
            let n = match fill(&mut decoder, &mut buf) {
                Ok(n) => n,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return Err(Inflate::Sent);
                }
            };
            if n == 0 {
                break;
            }
            buf.truncate(n);
            if tx.send(Ok(buf)).is_err() {
                return Err(Inflate::Stopped);
            }
        }
    }
    drop(tx);
    compressed.drain().map_err(Inflate::Read)?;
    Ok(compressed.finish())
}

/// Reads into `buf` until it is full or `r` ends; the bytes read.
fn fill(r: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The reader's end of the decompression thread's chunks; their end is the stream's end.
struct Inflated {
    rx: std::sync::mpsc::Receiver<io::Result<Vec<u8>>>,
    chunk: Vec<u8>,
    pos: usize,
}

impl Read for Inflated {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.chunk.len() {
            match self.rx.recv() {
                Ok(Ok(c)) => {
                    self.chunk = c;
                    self.pos = 0;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len() - self.pos);
        buf[..n].copy_from_slice(&self.chunk[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// A new file at `path` (mode 0600 until the entry's mode is set): never an existing one,
/// never through a symlink.
fn create_new(path: &Path) -> io::Result<fs::File> {
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

struct Unpacker<'a> {
    dest: &'a Path,
    layer: &'a str,
    budget: u64,
    stats: Unpacked,
    /// Directories (relative to `dest`) whose mode and times are set last (writing into a
    /// directory changes its mtime; a read-only mode would stop a non-root unpack). The last
    /// entry for a name wins, as with `tar`.
    dirs: BTreeMap<PathBuf, (u32, u64)>,
    root: bool,
}

/// Which side of [`copy_apart`] failed.
pub(crate) enum CopyFailure {
    Read(io::Error),
    Write(io::Error),
}

/// Copies `r` to its end into `w`, keeping apart a failure to read from one to write (which
/// `io::copy` returns alike); the bytes copied.
pub(crate) fn copy_apart(
    r: &mut dyn Read,
    w: &mut fs::File,
) -> std::result::Result<u64, CopyFailure> {
    use io::Write as _;
    let mut buf = [0u8; 32 << 10];
    let mut n = 0u64;
    loop {
        let got = match r.read(&mut buf) {
            Ok(0) => return Ok(n),
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(CopyFailure::Read(e)),
        };
        w.write_all(&buf[..got]).map_err(CopyFailure::Write)?;
        n += got as u64;
    }
}

/// A relative path made of plain components.
struct Rel(Vec<OsString>);

impl Rel {
    fn join(&self, base: &Path) -> PathBuf {
        let mut p = base.to_path_buf();
        p.extend(&self.0);
        p
    }
}

impl Unpacker<'_> {
    fn bad(&self, entry: &[u8], why: impl Into<String>) -> ImageError {
        ImageError::MaliciousLayer {
            layer: self.layer.to_owned(),
            entry: String::from_utf8_lossy(entry).into_owned(),
            why: why.into(),
        }
    }

    fn read_error(&self, e: io::Error) -> ImageError {
        ImageError::malformed(
            format!("layer {}", self.layer),
            format!("the layer is not a readable tar stream: {e}"),
        )
    }

    fn io(&self, action: &'static str, path: &Path, e: io::Error) -> ImageError {
        ImageError::io(action, path, e)
    }

    /// Applies every entry of the tar stream `input` (to its end, past the archive's end
    /// too); returns the digest of the whole stream (the layer's diff-id, checked by the
    /// caller).
    fn untar(&mut self, input: &mut dyn Read) -> Result<String> {
        let mut tar_stream = HashingReader::new(input);
        {
            let mut archive = tar::Archive::new(&mut tar_stream);
            // Raw entries: extension headers (GNU long names and links, PAX records) come to us
            // as entries of their own, so their bodies are read with a bound (tar-rs would read
            // a 16 GiB long name into memory before we saw it).
            let entries = archive.entries().map_err(|e| self.read_error(e))?.raw(true);
            let mut ext = Extensions::default();
            for entry in entries {
                let mut entry = entry.map_err(|e| self.read_error(e))?;
                if self.extension(&mut entry, &mut ext)? {
                    continue;
                }
                self.apply(entry, &std::mem::take(&mut ext))?;
            }
            if !ext.is_empty() {
                return Err(self.read_error(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "an extension header describes no entry (the layer ends after it)",
                )));
            }
        }
        tar_stream.drain().map_err(|e| self.read_error(e))?;
        Ok(tar_stream.finish())
    }

    /// `raw` as a relative path of plain components; `..` anywhere refuses the layer.
    fn clean(&self, raw: &[u8]) -> Result<Rel> {
        let mut parts = Vec::new();
        for c in raw.split(|b| *b == b'/') {
            match c {
                b"" | b"." => {}
                b".." => {
                    return Err(self.bad(raw, "has a `..` component (it would leave the layer)"))
                }
                c => parts.push(OsStr::from_bytes(c).to_os_string()),
            }
        }
        Ok(Rel(parts))
    }

    fn charge(&mut self, raw: &[u8], bytes: u64) -> Result<()> {
        self.stats.bytes = self
            .stats
            .bytes
            .saturating_add(bytes.saturating_add(ENTRY_COST));
        if self.stats.bytes > self.budget {
            tracing::debug!(entry = %String::from_utf8_lossy(raw), "layer over budget");
            return Err(ImageError::CacheFull {
                needed: self.stats.bytes,
                cap: self.budget,
                used: 0,
            });
        }
        Ok(())
    }

    /// Makes the parents of `rel` (mode 0755 where missing) without following any symlink.
    fn parents(&self, raw: &[u8], rel: &Rel) -> Result<PathBuf> {
        let mut p = self.dest.to_path_buf();
        let n = rel.0.len().saturating_sub(1);
        for c in &rel.0[..n] {
            p.push(c);
            match fs::symlink_metadata(&p) {
                Ok(m) if m.file_type().is_dir() => {}
                Ok(m) if m.file_type().is_symlink() => {
                    return Err(self.bad(
                        raw,
                        format!(
                            "goes through the symlink `{}` (unpacking never follows links)",
                            p.strip_prefix(self.dest).unwrap_or(&p).display()
                        ),
                    ))
                }
                Ok(_) => {
                    return Err(self.bad(
                        raw,
                        format!(
                            "goes through `{}`, which is not a directory",
                            p.strip_prefix(self.dest).unwrap_or(&p).display()
                        ),
                    ))
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    fs::DirBuilder::new()
                        .mode(0o755)
                        .create(&p)
                        .map_err(|e| self.io("create directory", &p, e))?;
                }
                Err(e) => return Err(self.io("inspect", &p, e)),
            }
        }
        Ok(rel.join(self.dest))
    }

    /// Removes whatever is at `path` (never following it), except a directory when `keep_dir`.
    fn clear(&self, path: &Path, keep_dir: bool) -> Result<bool> {
        match fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_dir() => {
                if keep_dir {
                    return Ok(true);
                }
                fs::remove_dir_all(path).map_err(|e| self.io("replace directory", path, e))?;
            }
            Ok(_) => fs::remove_file(path).map_err(|e| self.io("replace", path, e))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(self.io("inspect", path, e)),
        }
        Ok(false)
    }

    fn owner(&self, path: &Path, (uid, gid): (u64, u64)) -> Result<()> {
        if !self.root {
            return Ok(());
        }
        let id = |v: u64| u32::try_from(v).unwrap_or(0);
        std::os::unix::fs::lchown(path, Some(id(uid)), Some(id(gid)))
            .map_err(|e| self.io("set the owner of", path, e))
    }

    fn times(&self, path: &Path, mtime: u64) -> Result<()> {
        let t = filetime::FileTime::from_unix_time(i64::try_from(mtime).unwrap_or(0), 0);
        filetime::set_symlink_file_times(path, t, t)
            .map_err(|e| self.io("set the times of", path, e))
    }

    /// Takes an extension header (GNU long name or link, PAX records) into `ext`, reading
    /// its body with a bound and charging it to the budget; `false` for any other entry.
    fn extension<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        ext: &mut Extensions,
    ) -> Result<bool> {
        let kind = entry.header().entry_type();
        let (slot, what) = match kind {
            tar::EntryType::GNULongName => (Some(&mut ext.long_name), "GNU long name"),
            tar::EntryType::GNULongLink => (Some(&mut ext.long_link), "GNU long link"),
            tar::EntryType::XHeader => (Some(&mut ext.pax), "PAX header"),
            tar::EntryType::XGlobalHeader => (None, "PAX global header"),
            _ => return Ok(false),
        };
        let raw = entry.header().path_bytes().into_owned();
        let size = entry.header().size().map_err(|e| self.read_error(e))?;
        if size > MAX_EXTENSION {
            return Err(self.bad(
                &raw,
                format!(
                    "is a {what} of {size} bytes (at most {MAX_EXTENSION} are accepted: \
                     no path is that long)"
                ),
            ));
        }
        self.charge(&raw, size)?;
        let mut body = Vec::new();
        Read::take(&mut *entry, size)
            .read_to_end(&mut body)
            .map_err(|e| self.read_error(e))?;
        if let Some(slot) = slot {
            if slot.replace(body).is_some() {
                return Err(self.bad(&raw, format!("is a second {what} for one entry")));
            }
        }
        Ok(true)
    }

    fn apply<R: Read>(&mut self, mut entry: tar::Entry<'_, R>, ext: &Extensions) -> Result<()> {
        let raw = ext.path(&entry);
        let rel = self.clean(&raw)?;
        let kind = entry.header().entry_type();
        if kind == tar::EntryType::GNUSparse {
            return Err(ImageError::Unsupported(format!(
                "layer {}: `{}` is a GNU sparse file (layers from docker, buildkit and \
                 podman never hold one)",
                self.layer,
                String::from_utf8_lossy(&raw)
            )));
        }
        if let Some(size) = ext.pax_number("size") {
            if entry.header().size().ok() != Some(size) {
                return Err(ImageError::Unsupported(format!(
                    "layer {}: `{}` has a PAX size of {size} bytes (a file over 8 GiB)",
                    self.layer,
                    String::from_utf8_lossy(&raw)
                )));
            }
        }
        let Some(name) = rel.0.last().cloned() else {
            // The layer's root itself (`./`): nothing to make.
            return Ok(());
        };
        let mode = entry.header().mode().unwrap_or(0o644);
        let mtime = ext
            .pax_number("mtime")
            .unwrap_or_else(|| entry.header().mtime().unwrap_or(0));
        let ids = (
            ext.pax_number("uid")
                .or_else(|| entry.header().uid().ok())
                .unwrap_or(0),
            ext.pax_number("gid")
                .or_else(|| entry.header().gid().ok())
                .unwrap_or(0),
        );
        self.charge(&raw, 0)?;

        if let Some(target) = name.as_bytes().strip_prefix(b".wh.") {
            return self.whiteout(&raw, &rel, target);
        }
        let path = self.parents(&raw, &rel)?;
        match kind {
            tar::EntryType::Directory => {
                self.clear(&path, true)?;
                match fs::DirBuilder::new().mode(0o755).create(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(self.io("create directory", &path, e)),
                }
                self.owner(&path, ids)?;
                self.dirs
                    .insert(rel.0.iter().collect(), (mode & 0o1777, mtime));
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry.header().size().unwrap_or(0);
                self.charge(&raw, size)?;
                self.clear(&path, false)?;
                let mut f = create_new(&path).map_err(|e| self.io("create", &path, e))?;
                // A failure to read is the layer's; one to write is the disk's (a full cache
                // disk says so, never "malformed").
                let copied = match copy_apart(&mut (&mut entry).take(size), &mut f) {
                    Ok(n) => n,
                    Err(CopyFailure::Read(e)) => return Err(self.read_error(e)),
                    Err(CopyFailure::Write(e)) => return Err(self.io("write", &path, e)),
                };
                if copied != size {
                    return Err(self.read_error(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("`{}` is truncated", String::from_utf8_lossy(&raw)),
                    )));
                }
                f.flush().map_err(|e| self.io("write", &path, e))?;
                f.set_permissions(fs::Permissions::from_mode(mode & 0o1777))
                    .map_err(|e| self.io("set the mode of", &path, e))?;
                drop(f);
                self.owner(&path, ids)?;
                self.times(&path, mtime)?;
            }
            tar::EntryType::Symlink => {
                let Some(target) = ext.link(&entry) else {
                    return Err(self.bad(&raw, "is a symlink without a target"));
                };
                if target.is_empty() || target.contains(&0) {
                    return Err(self.bad(&raw, "is a symlink with an empty target"));
                }
                self.clear(&path, false)?;
                std::os::unix::fs::symlink(OsStr::from_bytes(&target), &path)
                    .map_err(|e| self.io("create symlink", &path, e))?;
                self.owner(&path, ids)?;
                self.times(&path, mtime)?;
            }
            tar::EntryType::Link => {
                let Some(target) = ext.link(&entry) else {
                    return Err(self.bad(&raw, "is a hard link without a target"));
                };
                let trel = self.clean(&target).map_err(|_| {
                    self.bad(
                        &raw,
                        format!(
                            "is a hard link to `{}`, outside the layer",
                            String::from_utf8_lossy(&target)
                        ),
                    )
                })?;
                if trel.0.is_empty() {
                    return Err(self.bad(&raw, "is a hard link to the layer's root"));
                }
                // The target must already be in this layer, reached without any symlink.
                self.parents_exist(&raw, &trel, &target)?;
                let tpath = trel.join(self.dest);
                match fs::symlink_metadata(&tpath) {
                    Ok(m) if !m.file_type().is_dir() => {}
                    _ => {
                        return Err(self.bad(
                            &raw,
                            format!(
                                "is a hard link to `{}`, which is not a file earlier in this layer",
                                String::from_utf8_lossy(&target)
                            ),
                        ))
                    }
                }
                if tpath == path {
                    return Ok(());
                }
                self.clear(&path, false)?;
                fs::hard_link(&tpath, &path).map_err(|e| self.io("create hard link", &path, e))?;
            }
            tar::EntryType::Fifo => {
                self.clear(&path, false)?;
                nix::unistd::mkfifo(
                    &path,
                    nix::sys::stat::Mode::from_bits_truncate(mode & 0o777),
                )
                .map_err(|e| self.io("create fifo", &path, io::Error::from(e)))?;
                self.owner(&path, ids)?;
            }
            tar::EntryType::Char | tar::EntryType::Block => {
                self.stats.skipped_devices += 1;
                tracing::debug!(entry = %String::from_utf8_lossy(&raw), "device node skipped");
                return Ok(());
            }
            other => {
                tracing::debug!(entry = %String::from_utf8_lossy(&raw), kind = ?other, "entry type skipped");
                return Ok(());
            }
        }
        self.stats.entries += 1;
        Ok(())
    }

    /// Checks that every parent of `rel` exists as a real directory (no symlink).
    fn parents_exist(&self, raw: &[u8], rel: &Rel, target: &[u8]) -> Result<()> {
        let mut p = self.dest.to_path_buf();
        for c in &rel.0[..rel.0.len().saturating_sub(1)] {
            p.push(c);
            match fs::symlink_metadata(&p) {
                Ok(m) if m.file_type().is_dir() => {}
                Ok(m) if m.file_type().is_symlink() => {
                    return Err(self.bad(
                        raw,
                        "is a hard link through a symlink (its target must be reached without a symlink)",
                    ))
                }
                _ => {
                    return Err(self.bad(
                        raw,
                        format!(
                            "is a hard link to `{}`, which is not a file earlier in this layer",
                            String::from_utf8_lossy(target)
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    fn whiteout(&mut self, raw: &[u8], rel: &Rel, target: &[u8]) -> Result<()> {
        if target == b".wh..opq" {
            // An opaque directory: its parent hides everything below it in lower layers.
            // (`.wh..wh..opq` at the layer's root means nothing for a lower layer: ignored,
            // as Docker does.)
            if rel.0.len() < 2 {
                return Ok(());
            }
            self.parents(raw, rel)?;
            let dir = Rel(rel.0[..rel.0.len() - 1].to_vec()).join(self.dest);
            self.set_xattr(&dir, "overlay.opaque", b"y")?;
            self.stats.entries += 1;
            return Ok(());
        }
        if target.is_empty() || target == b"." || target == b".." || target.starts_with(b".wh.") {
            return Err(self.bad(raw, "is a whiteout that names no file of the directory"));
        }
        let mut hidden = rel.0[..rel.0.len() - 1].to_vec();
        hidden.push(OsStr::from_bytes(target).to_os_string());
        let hidden = Rel(hidden);
        let path = self.parents(raw, &hidden)?;
        self.clear(&path, false)?;
        if self.root {
            nix::sys::stat::mknod(
                &path,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::empty(),
                0,
            )
            .map_err(|e| self.io("create whiteout", &path, io::Error::from(e)))?;
        } else {
            // No mknod without privilege: the kernel's xattr whiteout (Linux 6.7+), an empty
            // file marked so, in a directory marked as holding such files.
            create_new(&path).map_err(|e| self.io("create whiteout", &path, e))?;
            xattr::set(&path, "user.overlay.whiteout", b"y")
                .map_err(|e| self.io("mark whiteout", &path, e))?;
            if let Some(parent) = path.parent() {
                xattr::set(parent, "user.overlay.opaque", b"x")
                    .map_err(|e| self.io("mark whiteout directory", parent, e))?;
            }
        }
        self.stats.entries += 1;
        Ok(())
    }

    fn set_xattr(&self, path: &Path, name: &str, value: &[u8]) -> Result<()> {
        if self.root {
            xattr::set(path, format!("trusted.{name}"), value)
                .map_err(|e| self.io("set an overlay attribute on", path, e))?;
        }
        xattr::set(path, format!("user.{name}"), value)
            .map_err(|e| self.io("set an overlay attribute on", path, e))
    }

    /// Sets the recorded directories' modes and times, deepest first (so setting a parent's
    /// times is not undone by its children), through handles reached without following a
    /// symlink: a later entry may have replaced the directory or a parent with a link to the
    /// host, and a directory no longer there is skipped.
    fn finish_dirs(&mut self) -> Result<()> {
        let mut dirs: Vec<_> = std::mem::take(&mut self.dirs).into_iter().collect();
        dirs.sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        for (rel, (mode, mtime)) in dirs {
            let t = filetime::FileTime::from_unix_time(i64::try_from(mtime).unwrap_or(0), 0);
            let attrs = beneath::DirAttrs {
                mode,
                owner: None,
                mtime: t,
            };
            let changed = beneath::set_dir_attrs(self.dest, &rel, attrs)
                .map_err(|e| self.io("set the mode of", &self.dest.join(&rel), e))?;
            if !changed {
                tracing::debug!(dir = %rel.display(), "directory replaced by a later entry");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
