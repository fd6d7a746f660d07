//! Filesystem snapshots shared by backends: a directory tree packed as a tar archive, and
//! unpacked only into a fresh directory, refusing entries that would leave it.
//!
//! Packing walks the tree one name at a time relative to a directory handle, with
//! `O_NOFOLLOW` ([`pack_fd`]): a symlink swapped in by code in the sandbox while the walk runs
//! is recorded as a link, never followed (a path-based walk would read, as root, whatever
//! it points to on the host). A file's size is never used to allocate memory: its data are
//! streamed into the archive, sparse files stay sparse (only their data are stored, as GNU
//! sparse entries, which [`unpack_into`] and [`write_entry_data`] restore as holes), and the
//! data of the whole tree are capped ([`PackOptions::max_bytes`]).

use std::ffi::{CStr, OsStr};
use std::fs::File;
use std::io::{Cursor, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::beneath::{lstat_at, names, open_beneath, open_dir};
use crate::error::{Error, Result};

/// The xattr overlayfs (mounted with `userxattr`) marks an opaque upper directory with.
const OPAQUE_XATTR: &CStr = c"user.overlay.opaque";
/// The same, as a PAX record of the archive.
pub const OPAQUE_PAX: &str = "SCHILY.xattr.user.overlay.opaque";

/// The mtime of every entry of a [deterministic](PackOptions::deterministic) archive (tar's
/// own choice for `HeaderMode::Deterministic`: Jul 23, 2006).
const DETERMINISTIC_MTIME: u64 = 1153704088;

/// Directory levels [`pack_fd`] walks before refusing the tree.
const MAX_DEPTH: u32 = 256;

/// How [`pack_fd`] packs a tree. `#[non_exhaustive]`: start from [`PackOptions::default`]
/// (no overlay records, modes and times kept, no cap) and use the setters.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct PackOptions {
    /// Also record what an overlayfs upper layer holds besides files: whiteouts (0/0
    /// character devices: names deleted from the lower layers) and opaque directories
    /// (`user.overlay.opaque`, as the PAX record [`OPAQUE_PAX`]).
    pub overlay: bool,
    /// Headers as tar's `HeaderMode::Deterministic`: one fixed mtime, modes 0755 (directories
    /// and files with the owner's execute bit) or 0644, owner 0. Identical trees give
    /// identical archives. Otherwise entries keep their permission bits and mtime (owner 0).
    pub deterministic: bool,
    /// Most bytes of file data the archive may hold (a sparse file counts its data, not its
    /// holes); a tree holding more is refused with [`Error::ResourceExhausted`] naming the
    /// file that did not fit, before its data are read.
    pub max_bytes: u64,
}

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions {
            overlay: false,
            deterministic: false,
            max_bytes: u64::MAX,
        }
    }
}

impl PackOptions {
    /// Sets [`overlay`](Self::overlay).
    pub fn overlay(mut self, on: bool) -> Self {
        self.overlay = on;
        self
    }

    /// Sets [`deterministic`](Self::deterministic).
    pub fn deterministic(mut self, on: bool) -> Self {
        self.deterministic = on;
        self
    }

    /// Sets [`max_bytes`](Self::max_bytes).
    pub fn max_bytes(mut self, max: u64) -> Self {
        self.max_bytes = max;
        self
    }
}

/// Packs `dir` (recursively, symlinks kept as links, not followed; sockets, FIFOs and
/// devices left out) into a tar archive with [deterministic](PackOptions::deterministic)
/// headers and no cap. For a tree that code in a sandbox writes, cap it:
/// [`pack_dir_limited`].
pub fn pack_dir(dir: &Path) -> Result<Vec<u8>> {
    pack_dir_limited(dir, u64::MAX)
}

/// [`pack_dir`], refusing a tree holding more than `max_bytes` of file data (the sandbox's
/// `limits.disk_bytes` for its workspace) with [`Error::ResourceExhausted`].
pub fn pack_dir_limited(dir: &Path, max_bytes: u64) -> Result<Vec<u8>> {
    let fd = open_dir(dir)?;
    pack_fd(
        fd.as_fd(),
        PackOptions::default()
            .deterministic(true)
            .max_bytes(max_bytes),
    )
    .map_err(|e| match e {
        Error::Io { context, source } => Error::Io {
            context: format!("pack {}: {context}", dir.display()),
            source,
        },
        e => e,
    })
}

/// Packs the tree beneath the directory handle `dir` into a tar archive, one `O_NOFOLLOW`
/// name at a time (see the [module docs](self)); names in the archive are relative to
/// `dir` (no root entry), sorted.
pub fn pack_fd(dir: BorrowedFd<'_>, opts: PackOptions) -> Result<Vec<u8>> {
    let root = open_beneath(dir, Path::new("."), libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .map_err(|e| Error::io("open the folder to snapshot", e))?;
    let mut b = tar::Builder::new(Vec::new());
    let mut left = opts.max_bytes;
    pack_tree(&mut b, root.as_fd(), Path::new(""), 0, &opts, &mut left)?;
    b.into_inner()
        .map_err(|e| Error::io("finish snapshot archive", e))
}

fn header(st: &libc::stat, kind: tar::EntryType, size: u64, opts: &PackOptions) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    if opts.deterministic {
        let dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
        h.set_mode(if dir || st.st_mode & 0o100 != 0 {
            0o755
        } else {
            0o644
        });
        h.set_mtime(DETERMINISTIC_MTIME);
    } else {
        h.set_mode(st.st_mode & 0o7777);
        h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    }
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h
}

fn is_opaque(dir: BorrowedFd<'_>) -> bool {
    let mut v = [0u8; 4];
    // SAFETY: fgetxattr into a local buffer of the stated size.
    let n = unsafe {
        libc::fgetxattr(
            dir.as_raw_fd(),
            OPAQUE_XATTR.as_ptr(),
            v.as_mut_ptr().cast(),
            v.len(),
        )
    };
    n == 1 && v[0] == b'y'
}

/// `openat(dir, name, flags | O_NOFOLLOW | O_CLOEXEC)`: one name, never a symlink.
fn open_name(dir: BorrowedFd<'_>, name: &CStr, flags: i32) -> Option<OwnedFd> {
    // SAFETY: openat of one name relative to a directory fd, refusing symlinks.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    // SAFETY: a new fd, ours alone.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

fn pack_tree(
    b: &mut tar::Builder<Vec<u8>>,
    dir: BorrowedFd<'_>,
    prefix: &Path,
    depth: u32,
    opts: &PackOptions,
    left: &mut u64,
) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(Error::invalid(
            "workspace",
            format!("directory tree deeper than {MAX_DEPTH} levels"),
        ));
    }
    let shown = || format!("/{}", prefix.display());
    let mut entries = names(dir).map_err(|e| Error::io(format!("list {}", shown()), e))?;
    entries.sort();
    for n in entries {
        let Ok(st) = lstat_at(dir, &n) else {
            continue; // removed meanwhile
        };
        let rel = prefix.join(OsStr::from_bytes(n.to_bytes()));
        let io = |e| Error::io(format!("snapshot {}", rel.display()), e);
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                let Some(sub) = open_name(dir, &n, libc::O_RDONLY | libc::O_DIRECTORY) else {
                    continue; // replaced meanwhile
                };
                if opts.overlay && is_opaque(sub.as_fd()) {
                    b.append_pax_extensions([(OPAQUE_PAX, &b"y"[..])])
                        .map_err(io)?;
                }
                let mut h = header(&st, tar::EntryType::Directory, 0, opts);
                b.append_data(&mut h, &rel, std::io::empty()).map_err(io)?;
                pack_tree(b, sub.as_fd(), &rel, depth + 1, opts, left)?;
            }
            libc::S_IFCHR if opts.overlay && st.st_rdev == 0 => {
                // A whiteout: the name was deleted from the lower layer.
                let mut h = header(&st, tar::EntryType::Char, 0, opts);
                h.set_device_major(0).map_err(io)?;
                h.set_device_minor(0).map_err(io)?;
                b.append_data(&mut h, &rel, std::io::empty()).map_err(io)?;
            }
            libc::S_IFREG => {
                // O_NONBLOCK: a FIFO swapped in meanwhile cannot hang us (skipped below).
                let Some(fd) = open_name(dir, &n, libc::O_RDONLY | libc::O_NONBLOCK) else {
                    continue;
                };
                let f = File::from(fd);
                let md = f.metadata().map_err(io)?;
                if !md.is_file() {
                    continue;
                }
                append_file(b, &st, &rel, &f, md.len(), opts, left)?;
            }
            libc::S_IFLNK => {
                let mut buf = vec![0u8; libc::PATH_MAX as usize];
                // SAFETY: readlinkat into our buffer of the stated size.
                let len = unsafe {
                    libc::readlinkat(
                        dir.as_raw_fd(),
                        n.as_ptr(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                    )
                };
                let Ok(len) = usize::try_from(len) else {
                    continue;
                };
                buf.truncate(len);
                let mut h = header(&st, tar::EntryType::Symlink, 0, opts);
                b.append_link(&mut h, &rel, Path::new(OsStr::from_bytes(&buf)))
                    .map_err(io)?;
            }
            _ => {} // sockets, FIFOs, devices: not snapshotted
        }
    }
    Ok(())
}

/// The data extents of `f` (`size` bytes), as `(offset, length)`, from `SEEK_DATA` /
/// `SEEK_HOLE`, widened to 512-byte boundaries (what GNU sparse entries need) and merged.
/// One extent covering the file where the filesystem cannot tell holes. Stops (returning
/// what it found, already over `left`) once the data pass `left`.
fn data_extents(f: &File, size: u64, left: u64) -> Vec<(u64, u64)> {
    let whole = || if size == 0 { vec![] } else { vec![(0, size)] };
    let seek = |off: u64, whence: i32| -> std::result::Result<u64, i32> {
        let off = i64::try_from(off).map_err(|_| libc::EOVERFLOW)?;
        // SAFETY: lseek on a live fd; only its offset changes (we read with pread).
        let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
        u64::try_from(r).map_err(|_| std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    };
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut total = 0u64;
    let mut off = 0u64;
    while off < size {
        let start = match seek(off, libc::SEEK_DATA) {
            Ok(s) => s,
            Err(libc::ENXIO) => break, // only a hole is left
            Err(_) => return whole(),
        };
        if start >= size {
            break;
        }
        let end = match seek(start, libc::SEEK_HOLE) {
            Ok(e) if e > start => e.min(size),
            _ => return whole(),
        };
        let s = start & !511;
        let e = if end >= size {
            size
        } else {
            (end.saturating_add(511) & !511).min(size)
        };
        match out.last_mut() {
            Some(last) if s <= last.0 + last.1 => {
                let new_end = e.max(last.0 + last.1);
                total += new_end - (last.0 + last.1);
                last.1 = new_end - last.0;
            }
            _ => {
                total += e - s;
                out.push((s, e - s));
            }
        }
        if total > left {
            break;
        }
        off = end;
    }
    out
}

/// Reads the given extents of a file, in order, each exactly its length: past the file's
/// end (it shrank meanwhile) the rest reads as zeros, so the archive stays consistent.
struct Extents<'a> {
    file: &'a File,
    extents: Vec<(u64, u64)>,
    at: usize,
    done: u64,
}

impl Read for Extents<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let Some(&(off, len)) = self.extents.get(self.at) else {
                return Ok(0);
            };
            if self.done >= len {
                self.at += 1;
                self.done = 0;
                continue;
            }
            let want = usize::try_from(len - self.done)
                .unwrap_or(usize::MAX)
                .min(buf.len());
            let Some(dst) = buf.get_mut(..want) else {
                return Ok(0);
            };
            let n = match self.file.read_at(dst, off + self.done)? {
                0 => {
                    dst.fill(0);
                    want
                }
                n => n,
            };
            self.done += n as u64;
            return Ok(n);
        }
    }
}

/// Appends a regular file: its data streamed from the handle, as a GNU sparse entry when
/// it has holes, charged to `left`.
fn append_file(
    b: &mut tar::Builder<Vec<u8>>,
    st: &libc::stat,
    rel: &Path,
    f: &File,
    size: u64,
    opts: &PackOptions,
    left: &mut u64,
) -> Result<()> {
    let io = |e| Error::io(format!("snapshot {}", rel.display()), e);
    let extents = data_extents(f, size, *left);
    let data: u64 = extents.iter().map(|e| e.1).sum();
    if data > *left {
        return Err(Error::ResourceExhausted {
            what: format!(
                "snapshot space: the files hold more than {} bytes of data, the limit of one \
                 snapshot (the sandbox's limits.disk_bytes), and {} does not fit (sparse files \
                 count their data, not their holes)",
                opts.max_bytes,
                rel.display()
            ),
        });
    }
    *left -= data;
    let sparse = !(extents.is_empty() && size == 0) && extents != [(0, size)];
    if !sparse {
        let mut h = header(st, tar::EntryType::Regular, size, opts);
        let r = Extents {
            file: f,
            extents,
            at: 0,
            done: 0,
        };
        return b.append_data(&mut h, rel, r).map_err(io);
    }
    // Old GNU sparse format: the map in the header (4 slots) and in extension blocks of 21
    // slots each, written right after the header, then the data of each extent in order.
    let mut map = extents.clone();
    if map.last().is_none_or(|&(o, l)| o + l < size) {
        map.push((size, 0)); // the trailing hole, so that the real size is reached
    }
    let mut h = header(st, tar::EntryType::GNUSparse, data, opts);
    let gnu = h
        .as_gnu_mut()
        .ok_or_else(|| io(std::io::Error::other("not a GNU header")))?;
    gnu.set_real_size(size);
    for (slot, &(o, l)) in gnu.sparse.iter_mut().zip(&map) {
        slot.set_offset(o);
        slot.set_length(l);
    }
    let head = gnu.sparse.len();
    gnu.set_is_extended(map.len() > head);
    let mut ext_bytes = Vec::new();
    let rest = map.get(head..).unwrap_or_default();
    let chunks: Vec<&[(u64, u64)]> = rest.chunks(21).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let mut ext = tar::GnuExtSparseHeader::new();
        for (slot, &(o, l)) in ext.sparse_mut().iter_mut().zip(chunk.iter()) {
            slot.set_offset(o);
            slot.set_length(l);
        }
        ext.set_is_extended(i + 1 < chunks.len());
        ext_bytes.extend_from_slice(ext.as_bytes());
    }
    let r = Cursor::new(ext_bytes).chain(Extents {
        file: f,
        extents,
        at: 0,
        done: 0,
    });
    b.append_data(&mut h, rel, r).map_err(io)
}

/// Writes the data of the regular or GNU sparse `entry` of `archive` (the bytes the
/// entry's `tar::Archive` reads, whole) into `file`, which is new and empty: holes of a
/// sparse entry stay holes (the file is extended with `ftruncate`), so a 1 TiB sparse file
/// costs no more than its data. Returns whether the entry was one of those kinds.
pub fn write_entry_data<R: Read>(
    archive: &[u8],
    entry: &mut tar::Entry<'_, R>,
    file: &mut File,
) -> std::io::Result<bool> {
    let kind = entry.header().entry_type();
    if kind.is_file() {
        std::io::copy(entry, file)?;
        return Ok(true);
    }
    if !kind.is_gnu_sparse() {
        return Ok(false);
    }
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let gnu = entry
        .header()
        .as_gnu()
        .ok_or_else(|| bad("a sparse entry without a GNU header"))?;
    let real = gnu.real_size()?;
    // The map: in the header, then in extension blocks right after it; the data follow.
    let mut pos = usize::try_from(entry.raw_file_position()).map_err(|_| bad("offset"))?;
    let mut map: Vec<(u64, u64)> = Vec::new();
    let mut push = |s: &tar::GnuSparseHeader| -> std::io::Result<()> {
        if !s.is_empty() {
            map.push((s.offset()?, s.length()?));
        }
        Ok(())
    };
    for s in &gnu.sparse {
        push(s)?;
    }
    let mut more = gnu.is_extended();
    while more {
        let block = archive
            .get(pos..pos + 512)
            .ok_or_else(|| bad("a sparse map past the archive's end"))?;
        let mut ext = tar::GnuExtSparseHeader::new();
        ext.as_mut_bytes().copy_from_slice(block);
        for s in ext.sparse() {
            push(s)?;
        }
        more = ext.is_extended();
        pos += 512;
    }
    let mut end = 0u64;
    for (off, len) in map {
        if off < end || off.checked_add(len).is_none_or(|e| e > real) {
            return Err(bad("a sparse map out of order or past the file's size"));
        }
        let n = usize::try_from(len).map_err(|_| bad("a sparse block too large"))?;
        let data = archive
            .get(pos..pos.saturating_add(n))
            .ok_or_else(|| bad("sparse data past the archive's end"))?;
        file.write_all_at(data, off)?;
        pos += n;
        end = off + len;
    }
    file.set_len(real)?;
    Ok(true)
}

/// Unpacks an archive made by [`pack_dir`] into `dir`, which must exist and be empty.
/// Entries with absolute paths or `..` are refused (the `tar` crate never writes outside
/// the destination); device nodes are refused too.
pub fn unpack_into(archive: &[u8], dir: &Path) -> Result<()> {
    let mut a = tar::Archive::new(archive);
    a.set_preserve_permissions(true);
    a.set_overwrite(false);
    let entries = a
        .entries()
        .map_err(|e| Error::io_path("read archive for", dir, e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| Error::io_path("read archive for", dir, e))?;
        let kind = entry.header().entry_type();
        if !(kind.is_file() || kind.is_gnu_sparse() || kind.is_dir() || kind.is_symlink()) {
            return Err(Error::invalid(
                "snapshot",
                format!("archive holds a {kind:?} entry"),
            ));
        }
        let ok = entry
            .unpack_in(dir)
            .map_err(|e| Error::io_path("unpack into", dir, e))?;
        if !ok {
            let p = entry
                .path()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            return Err(Error::PathEscape { path: p });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_files_and_links() {
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("a/b")).unwrap();
        std::fs::write(src.path().join("a/b/f.txt"), "hello").unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink("b/f.txt", src.path().join("a/link")).unwrap();
        let tar = pack_dir(src.path()).unwrap();
        let dst = tempfile::tempdir().unwrap();
        unpack_into(&tar, dst.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(dst.path().join("a/b/f.txt")).unwrap(),
            "hello"
        );
        #[cfg(unix)]
        assert_eq!(
            std::fs::read_to_string(dst.path().join("a/link")).unwrap(),
            "hello"
        );
    }

    #[test]
    fn sparse_files_stay_sparse_and_data_are_capped() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let src = tempfile::tempdir().unwrap();
        // 1 TiB with a few bytes in the middle, one with data at both ends, one of nothing,
        // and a dense one.
        let f = File::create(src.path().join("big")).unwrap();
        f.set_len(1 << 40).unwrap();
        f.write_all_at(b"middle", (1 << 30) + 3).unwrap();
        let g = File::create(src.path().join("ends")).unwrap();
        g.write_all_at(b"head", 0).unwrap();
        g.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        File::create(src.path().join("hole"))
            .unwrap()
            .set_len(5000)
            .unwrap();
        std::fs::write(src.path().join("dense"), vec![7u8; 10_000]).unwrap();
        // Many extents: the map needs extension blocks.
        let h = File::create(src.path().join("striped")).unwrap();
        for i in 0..100u64 {
            h.write_all_at(&[i as u8 + 1; 10], i * (1 << 20)).unwrap();
        }
        let t = std::time::Instant::now();
        let tar = pack_dir_limited(src.path(), 16 << 20).unwrap();
        assert!(t.elapsed() < std::time::Duration::from_secs(10));
        assert!(tar.len() < 4 << 20, "{} bytes", tar.len());
        let dst = tempfile::tempdir().unwrap();
        unpack_into(&tar, dst.path()).unwrap();
        let md = std::fs::metadata(dst.path().join("big")).unwrap();
        assert_eq!(md.len(), 1 << 40);
        assert!(md.blocks() < 1 << 12, "{} blocks", md.blocks());
        let read_at = |name: &str, off: u64, n: usize| {
            let mut b = vec![0u8; n];
            File::open(dst.path().join(name))
                .unwrap()
                .read_exact_at(&mut b, off)
                .unwrap();
            b
        };
        assert_eq!(read_at("big", (1 << 30) + 3, 6), b"middle");
        assert_eq!(read_at("big", 1 << 29, 4), [0; 4]);
        assert_eq!(read_at("ends", 0, 4), b"head");
        assert_eq!(read_at("ends", (64 << 20) - 4, 4), b"tail");
        assert_eq!(
            std::fs::metadata(dst.path().join("hole")).unwrap().len(),
            5000
        );
        assert_eq!(
            std::fs::read(dst.path().join("dense")).unwrap(),
            vec![7u8; 10_000]
        );
        for i in 0..100u64 {
            assert_eq!(read_at("striped", i * (1 << 20), 10), [i as u8 + 1; 10]);
        }
        // The container tier's unpacker writes the same data, holes kept.
        let mut a = tar::Archive::new(tar.as_slice());
        for entry in a.entries().unwrap() {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().into_owned();
            let out = dst.path().join(format!("copy-{}", name.display()));
            let mut file = File::create(&out).unwrap();
            assert!(write_entry_data(tar.as_slice(), &mut entry, &mut file).unwrap());
            let (a, b) = (
                std::fs::metadata(&out).unwrap(),
                std::fs::metadata(dst.path().join(&name)).unwrap(),
            );
            assert_eq!(a.len(), b.len(), "{}", name.display());
            assert!(a.blocks() <= b.blocks() + 64, "{}", name.display());
        }
        let mut c = vec![0u8; 10];
        File::open(dst.path().join("copy-striped"))
            .unwrap()
            .read_exact_at(&mut c, 99 << 20)
            .unwrap();
        assert_eq!(c, [100u8; 10]);
        // Over the cap: refused (the dense file alone is 10,000 bytes), naming the limit.
        let e = pack_dir_limited(src.path(), 9_000).unwrap_err();
        assert!(
            matches!(&e, Error::ResourceExhausted { what } if what.contains("limits.disk_bytes")),
            "{e}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn links_are_packed_as_links_never_followed() {
        let src = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "host secret").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), src.path().join("f")).unwrap();
        std::os::unix::fs::symlink(outside.path(), src.path().join("d")).unwrap();
        let tar = pack_dir(src.path()).unwrap();
        assert!(!String::from_utf8_lossy(&tar).contains("host secret"));
        let mut a = tar::Archive::new(tar.as_slice());
        let kinds: Vec<_> = a
            .entries()
            .unwrap()
            .map(|e| e.unwrap().header().entry_type())
            .collect();
        assert_eq!(kinds, [tar::EntryType::Symlink, tar::EntryType::Symlink]);
    }

    #[test]
    fn hostile_archive_is_refused() {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_entry_type(tar::EntryType::Regular);
        // Write the raw name bytes: the builder would refuse `..` itself.
        h.as_old_mut().name[..9].copy_from_slice(b"../escape");
        h.set_cksum();
        b.append(&h, &b"x"[..]).unwrap();
        let bytes = b.into_inner().unwrap();
        let dst = tempfile::tempdir().unwrap();
        assert!(unpack_into(&bytes, dst.path()).is_err());
        assert!(!dst.path().parent().unwrap().join("escape").exists());
    }
}
