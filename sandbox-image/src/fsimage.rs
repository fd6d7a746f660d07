//! Read-only ext4 filesystem images of an image's merged layers, built once per image: what
//! a microVM's virtio-blk device serves as the guest's root (a guest cannot mount the host's
//! layer directories as an overlay).
//!
//! # How one is built (see `docs/images.md`)
//! 1. **Merge.** The layers are merged, lowest first, into a staging directory under the
//!    store's `tmp/`, as overlayfs shows them: a whiteout (a `0/0` character device, or an
//!    empty file marked `user.overlay.whiteout` in a rootless cache) removes what lower
//!    layers put at its path and is not itself copied; an opaque directory
//!    (`trusted.overlay.opaque=y` or `user.overlay.opaque=y`; `user.overlay.opaque=x` only
//!    marks a directory holding xattr whiteouts) drops everything lower layers put beneath
//!    it; an upper entry replaces a lower one of another kind. No path is ever followed
//!    through a symlink (`lstat` only; links are made again as links). Regular files are
//!    hard-linked from the layer (no data is copied; a copy only when the link fails, e.g.
//!    across filesystems); directories are made fresh with the topmost layer's mode, owner
//!    and times; symlinks and FIFOs are made again; no extended attribute is carried (the
//!    overlay marks stay behind).
//! 2. **mkfs.** `mkfs.ext4 -d STAGE` copies the staged tree into a sparse file in `tmp/`
//!    sized from the staged content (no journal, no metadata checksums, no reserved blocks,
//!    no resize inode, 4 KiB blocks, enough inodes), retried ×1.5 larger when the estimate
//!    was short. Its UUID and hash seed come from the manifest digest and its timestamps
//!    from the newest staged file (`E2FSPROGS_FAKE_TIME`).
//! 3. **In place.** The file is synced, made read-only and renamed to
//!    `fsimages/<manifest hex>.ext4` under the lock `locks/fs-<hex>` (two processes build it
//!    once); the staging directory is removed. A failure leaves nothing in `fsimages/`.
//!
//! # Ownership
//! Built as root, the staged files keep the layers' owners, which are the image's own (layers
//! are unpacked as root with their owners), so the filesystem image has the image's uids and
//! gids. A rootless cache cannot: its layers' files all belong to the user who pulled them
//! (an unprivileged unpack cannot `chown`), so every file in the filesystem image is owned by
//! that user's uid and gid (its root directory excepted: `0:0`). A guest running as root is
//! unaffected (root ignores ownership); a guest process running as the image's other users
//! sees files owned by a stranger and gets only their "other" permission bits. Files the
//! pulling user cannot read (mode `0000`, as `/etc/shadow` in some images) make `mkfs.ext4`
//! fail in a rootless cache.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use nix::fcntl::Flock;

use crate::beneath;
use crate::error::{ImageError, Result};
use crate::store::{hex_of, remove_tree, Image, ImageStore};

/// Bytes per block of the images made.
const BLOCK: u64 = 4096;
/// Bytes per inode.
const INODE_SIZE: u64 = 256;
/// The smallest image made, in bytes.
const MIN_BYTES: u64 = 16 << 20;
/// Times `mkfs.ext4` is run, each 1.5× larger than the last, when the estimate was short.
const ATTEMPTS: usize = 4;
/// Where `mkfs.ext4` is looked for before `PATH`.
const MKFS_PLACES: [&str; 2] = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"];

/// A read-only ext4 filesystem image of an image's merged layers, from
/// [`ImageStore::rootfs_image`]: the file a microVM's virtio-blk device serves (read-only)
/// as the guest's root filesystem. While this value (or a clone) lives, `rm` and `prune`
/// leave the image, and so this file, alone.
#[derive(Debug, Clone)]
pub struct FsImage {
    path: PathBuf,
    size: u64,
    digest: String,
    _lease: Arc<Flock<fs::File>>,
}

impl FsImage {
    /// The file: `<cache>/fsimages/<manifest hex>.ext4`. Never written again; open it
    /// read-only.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its length in bytes: the block device's size (a multiple of 1 MiB). The file is
    /// sparse and takes less disk space.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The manifest digest of the image it holds.
    pub fn digest(&self) -> &str {
        &self.digest
    }
}

impl ImageStore {
    /// The image's layers merged into a read-only ext4 filesystem image, built the first time
    /// it is asked for (see the module docs for how) and reused after that: what the microVM
    /// tier gives its guest as the root filesystem. Two processes asking at once build it
    /// once. It blocks for as long as building takes (seconds for a large image); call it
    /// from `spawn_blocking` in async code.
    ///
    /// The file counts in [`usage`](Self::usage) (as the disk space it takes) and towards the
    /// cache's cap; [`prune`](Self::prune) removes it with its image.
    ///
    /// In a cache pulled without root, every file in it is owned by the pulling user (see the
    /// module docs, "Ownership").
    ///
    /// # Errors
    /// [`ImageError::MissingMkfs`] without e2fsprogs; [`ImageError::FsImage`] when
    /// `mkfs.ext4` fails (with what it said); [`ImageError::CacheFull`] when the image would
    /// pass the cache's cap; [`ImageError::Io`] reading the layers or writing the cache.
    /// Nothing half-made is kept.
    pub fn rootfs_image(&self, image: &Image) -> Result<FsImage> {
        let hex = hex_of(image.digest())?.to_owned();
        let dir = self.p("fsimages");
        fs::create_dir_all(&dir).map_err(|e| ImageError::io("create", &dir, e))?;
        let dest = dir.join(format!("{hex}.ext4"));
        // Shared with pulls and other builds, exclusive with `prune` (which clears `tmp/`).
        let _store = self.lock_blocking("store", false)?;
        if let Some(done) = existing(&dest, image)? {
            return Ok(done);
        }
        let _building = self.lock_blocking(&format!("fs-{hex}"), true)?;
        if let Some(done) = existing(&dest, image)? {
            return Ok(done);
        }
        let mkfs = find_mkfs(self.mkfs_ext4_setting())?;
        let started = Instant::now();
        let id = uuid::Uuid::new_v4().simple();
        let mut scratch = Scratch::default();

        let stage = self.p(format!("tmp/fs-stage-{id}"));
        fs::create_dir(&stage).map_err(|e| ImageError::io("create", &stage, e))?;
        scratch.stage = Some(stage.clone());
        let root = nix::unistd::geteuid().is_root();
        if !root {
            tracing::warn!(
                image = image.digest(),
                "building a filesystem image without root: every file in it is owned by the \
                 current user, not by the image's users"
            );
        }
        let mut merger = Merger::new(&stage, root);
        for layer in image.layers() {
            merger.merge(layer)?;
        }
        merger.finish()?;
        let staged = measure(&stage)?;

        let cap = self.max_bytes();
        let used = self.usage()?;
        let needed = staged.content_bytes();
        if used.saturating_add(needed) > cap {
            return Err(ImageError::CacheFull { needed, cap, used });
        }

        let file = self.p(format!("tmp/fs-{id}.ext4"));
        scratch.file = Some(file.clone());
        let uuid = uuid_of(&hex)?;
        let mut size = staged.image_bytes();
        let mut inodes = staged.inodes();
        let mut attempt = 1;
        loop {
            let run = Mkfs {
                program: &mkfs,
                stage: &stage,
                file: &file,
                size,
                inodes,
                uuid: &uuid,
                time: staged.newest.max(1),
            };
            match run.run() {
                Ok(()) => break,
                Err(MkfsError::TooSmall(stderr)) if attempt < ATTEMPTS => {
                    tracing::debug!(image = image.digest(), size, inodes, %stderr, "filesystem image too small; growing it");
                    size = grow(size).div_ceil(1 << 20) << 20;
                    inodes = grow(inodes);
                    attempt += 1;
                }
                Err(MkfsError::TooSmall(stderr)) => {
                    return Err(ImageError::FsImage {
                        image: image.digest().to_owned(),
                        detail: format!(
                            "`{}` ran out of room {ATTEMPTS} times, the last at {size} bytes \
                             and {inodes} inodes (or the disk holding the cache is full)",
                            mkfs.display()
                        ),
                        stderr,
                    })
                }
                Err(MkfsError::Failed(status, stderr)) => {
                    return Err(ImageError::FsImage {
                        image: image.digest().to_owned(),
                        detail: format!("`{}` failed ({status})", mkfs.display()),
                        stderr,
                    })
                }
                Err(MkfsError::Spawn(e)) => {
                    return Err(ImageError::FsImage {
                        image: image.digest().to_owned(),
                        detail: format!("cannot run `{}`: {e}", mkfs.display()),
                        stderr: String::new(),
                    })
                }
                Err(MkfsError::Io(e)) => return Err(e),
            }
        }

        // Durable and read-only before it is named: a crash never leaves half an image.
        let f = fs::File::open(&file).map_err(|e| ImageError::io("open", &file, e))?;
        f.sync_all()
            .map_err(|e| ImageError::io("sync the filesystem image", &file, e))?;
        f.set_permissions(fs::Permissions::from_mode(0o444))
            .map_err(|e| ImageError::io("set the mode of", &file, e))?;
        drop(f);
        fs::rename(&file, &dest)
            .map_err(|e| ImageError::io("store the filesystem image", &dest, e))?;
        scratch.file = None;
        if let Ok(d) = fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        drop(scratch);
        tracing::info!(
            image = image.digest(),
            bytes = size,
            entries = staged.entries,
            attempts = attempt,
            secs = started.elapsed().as_secs_f32(),
            "filesystem image built"
        );
        existing(&dest, image)?.ok_or_else(|| {
            ImageError::io(
                "find the filesystem image",
                &dest,
                io::Error::new(io::ErrorKind::NotFound, "removed while building"),
            )
        })
    }
}

/// The built image at `dest`, if there is one.
fn existing(dest: &Path, image: &Image) -> Result<Option<FsImage>> {
    match fs::symlink_metadata(dest) {
        Ok(m) if m.is_file() => Ok(Some(FsImage {
            path: dest.to_path_buf(),
            size: m.len(),
            digest: image.digest().to_owned(),
            _lease: image.lease.clone(),
        })),
        Ok(_) => Err(ImageError::io(
            "use the filesystem image",
            dest,
            io::Error::new(io::ErrorKind::InvalidData, "not a regular file"),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ImageError::io("inspect", dest, e)),
    }
}

/// The `mkfs.ext4` to run: the one configured, else the first of [`MKFS_PLACES`] and `PATH`.
fn find_mkfs(configured: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = configured {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(ImageError::MissingMkfs {
                program: p.display().to_string(),
            })
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    MKFS_PLACES
        .iter()
        .map(PathBuf::from)
        .chain(std::env::split_paths(&path).map(|d| d.join("mkfs.ext4")))
        .find(|p| p.is_file())
        .ok_or_else(|| ImageError::MissingMkfs {
            program: "mkfs.ext4 (in /usr/sbin, /sbin and PATH)".into(),
        })
}

/// A UUID derived from the manifest digest: the same image gets the same filesystem UUID.
fn uuid_of(hex: &str) -> Result<String> {
    let bytes = hex::decode(hex)
        .map_err(|e| ImageError::Unsupported(format!("digest hex `{hex}`: {e}")))?;
    let mut b = [0u8; 16];
    for (d, s) in b.iter_mut().zip(&bytes) {
        *d = *s;
    }
    Ok(uuid::Builder::from_random_bytes(b)
        .into_uuid()
        .hyphenated()
        .to_string())
}

fn grow(n: u64) -> u64 {
    n.saturating_add(n / 2)
}

/// Work files removed when dropped (on every error path, and the stage on success).
#[derive(Default)]
struct Scratch {
    stage: Option<PathBuf>,
    file: Option<PathBuf>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(f) = &self.file {
            let _ = fs::remove_file(f);
        }
        if let Some(s) = &self.stage {
            if let Err(e) = remove_tree(s) {
                tracing::warn!(error = %e, "could not remove a filesystem image's staging directory");
            }
        }
    }
}

/// A directory's attributes, set once all layers are merged (adding entries changes its
/// times; a read-only mode would stop the merge without root).
#[derive(Debug, Clone, Copy)]
struct DirAttrs {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: filetime::FileTime,
}

/// Merges layers into the staging directory.
pub(crate) struct Merger<'a> {
    stage: &'a Path,
    root: bool,
    /// Staged directories (relative) and the topmost layer's attributes for each.
    dirs: BTreeMap<PathBuf, DirAttrs>,
}

impl<'a> Merger<'a> {
    /// A merger into `stage` (an empty directory); `root`: keep owners.
    pub(crate) fn new(stage: &'a Path, root: bool) -> Self {
        Merger {
            stage,
            root,
            dirs: BTreeMap::new(),
        }
    }

    /// Merges `layer` over what is staged.
    pub(crate) fn merge(&mut self, layer: &Path) -> Result<()> {
        let mut todo = vec![PathBuf::new()];
        while let Some(rel_dir) = todo.pop() {
            let src_dir = layer.join(&rel_dir);
            let rd = fs::read_dir(&src_dir).map_err(|e| ImageError::io("list", &src_dir, e))?;
            let mut names = Vec::new();
            for e in rd {
                names.push(
                    e.map_err(|e| ImageError::io("list", &src_dir, e))?
                        .file_name(),
                );
            }
            names.sort();
            for name in names {
                let rel = rel_dir.join(&name);
                let src = layer.join(&rel);
                let dst = self.stage.join(&rel);
                let m =
                    fs::symlink_metadata(&src).map_err(|e| ImageError::io("inspect", &src, e))?;
                let kind = m.file_type();
                if is_whiteout(&src, &m) {
                    remove_any(&dst)?;
                } else if kind.is_dir() {
                    match fs::symlink_metadata(&dst) {
                        Ok(d) if d.is_dir() => {
                            if is_opaque(&src) {
                                remove_any(&dst)?;
                                make_dir(&dst)?;
                            }
                        }
                        Ok(_) => {
                            remove_any(&dst)?;
                            make_dir(&dst)?;
                        }
                        Err(e) if e.kind() == io::ErrorKind::NotFound => make_dir(&dst)?,
                        Err(e) => return Err(ImageError::io("inspect", &dst, e)),
                    }
                    self.dirs.insert(
                        rel.clone(),
                        DirAttrs {
                            mode: m.mode() & 0o7777,
                            uid: m.uid(),
                            gid: m.gid(),
                            mtime: filetime::FileTime::from_last_modification_time(&m),
                        },
                    );
                    todo.push(rel);
                } else {
                    remove_any(&dst)?;
                    if kind.is_file() {
                        self.file(&src, &dst, &m)?;
                    } else if kind.is_symlink() {
                        let target = fs::read_link(&src)
                            .map_err(|e| ImageError::io("read the link", &src, e))?;
                        std::os::unix::fs::symlink(&target, &dst)
                            .map_err(|e| ImageError::io("create symlink", &dst, e))?;
                        self.attrs(&dst, &m, false)?;
                    } else if kind.is_fifo() {
                        nix::unistd::mkfifo(&dst, nix::sys::stat::Mode::from_bits_truncate(0o600))
                            .map_err(|e| ImageError::io("create fifo", &dst, io::Error::from(e)))?;
                        self.attrs(&dst, &m, true)?;
                    } else {
                        // Unpacking skips device nodes; anything else has no place in an image.
                        tracing::debug!(path = %src.display(), "special file left out of the filesystem image");
                    }
                }
            }
        }
        Ok(())
    }

    /// A regular file: hard-linked (same inode: owner, mode and times as the layer's), or
    /// copied with them when it cannot be.
    fn file(&self, src: &Path, dst: &Path, m: &fs::Metadata) -> Result<()> {
        match fs::hard_link(src, dst) {
            Ok(()) => return Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EXDEV | libc::EMLINK | libc::EPERM | libc::EACCES)
                ) =>
            {
                tracing::debug!(path = %src.display(), error = %e, "cannot hard-link; copying");
            }
            Err(e) => {
                return Err(ImageError::io(
                    "hard-link into the staging directory",
                    dst,
                    e,
                ))
            }
        }
        let mut from = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(src)
            .map_err(|e| ImageError::io("open", src, e))?;
        let mut to = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(dst)
            .map_err(|e| ImageError::io("create", dst, e))?;
        io::copy(&mut from, &mut to).map_err(|e| ImageError::io("copy into", dst, e))?;
        drop(to);
        self.attrs(dst, m, true)
    }

    /// Gives `path` (not followed) the owner (as root), mode (when `mode`) and times of `m`.
    fn attrs(&self, path: &Path, m: &fs::Metadata, mode: bool) -> Result<()> {
        if self.root {
            std::os::unix::fs::lchown(path, Some(m.uid()), Some(m.gid()))
                .map_err(|e| ImageError::io("set the owner of", path, e))?;
        }
        if mode {
            fs::set_permissions(path, fs::Permissions::from_mode(m.mode() & 0o7777))
                .map_err(|e| ImageError::io("set the mode of", path, e))?;
        }
        let t = filetime::FileTime::from_last_modification_time(m);
        filetime::set_symlink_file_times(path, t, t)
            .map_err(|e| ImageError::io("set the times of", path, e))
    }

    /// Sets the directories' attributes, deepest first (so a parent's times stay set),
    /// through handles reached without following a symlink: an upper layer may have replaced
    /// a directory, or one of its parents, with a link to the host. One removed by a later
    /// whiteout or replaced by a non-directory is skipped.
    pub(crate) fn finish(&mut self) -> Result<()> {
        let mut dirs: Vec<_> = std::mem::take(&mut self.dirs).into_iter().collect();
        dirs.sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        for (rel, a) in dirs {
            let attrs = beneath::DirAttrs {
                mode: a.mode,
                owner: self.root.then_some((a.uid, a.gid)),
                mtime: a.mtime,
            };
            beneath::set_dir_attrs(self.stage, &rel, attrs)
                .map_err(|e| ImageError::io("set the attributes of", self.stage.join(&rel), e))?;
        }
        fs::set_permissions(self.stage, fs::Permissions::from_mode(0o755))
            .map_err(|e| ImageError::io("set the mode of", self.stage, e))
    }
}

/// Whether a layer entry is an overlay whiteout: a `0/0` character device, or (rootless
/// caches) an empty regular file marked `user.overlay.whiteout`.
fn is_whiteout(path: &Path, m: &fs::Metadata) -> bool {
    let kind = m.file_type();
    (kind.is_char_device() && m.rdev() == 0)
        || (kind.is_file()
            && m.len() == 0
            && xattr::get(path, "user.overlay.whiteout").is_ok_and(|v| v.is_some()))
}

/// Whether a layer directory is opaque (`overlay.opaque` is `y`; `x` only marks a directory
/// holding xattr whiteouts).
fn is_opaque(dir: &Path) -> bool {
    ["trusted.overlay.opaque", "user.overlay.opaque"]
        .iter()
        .any(|name| xattr::get(dir, name).is_ok_and(|v| v.as_deref() == Some(b"y")))
}

/// Removes whatever is staged at `path`, never following it.
fn remove_any(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            fs::remove_dir_all(path).map_err(|e| ImageError::io("remove", path, e))
        }
        Ok(_) => fs::remove_file(path).map_err(|e| ImageError::io("remove", path, e)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ImageError::io("inspect", path, e)),
    }
}

fn make_dir(path: &Path) -> Result<()> {
    fs::DirBuilder::new()
        .mode(0o755)
        .create(path)
        .map_err(|e| ImageError::io("create directory", path, e))
}

/// What was staged, for sizing the filesystem.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Staged {
    /// Entries (names), the root excepted.
    entries: u64,
    /// Bytes of file contents (each inode once) and long symlink targets, in whole blocks.
    data: u64,
    /// Bytes of directory blocks.
    dirs: u64,
    /// The newest modification time (seconds since the epoch).
    newest: i64,
}

impl Staged {
    /// Inodes to ask for: every entry, a quarter more, and ext4's reserved ones.
    fn inodes(&self) -> u64 {
        self.entries + self.entries / 4 + 128
    }

    /// The bytes the content will take in the filesystem (its inode table included).
    fn content_bytes(&self) -> u64 {
        self.data + self.dirs + self.inodes() * INODE_SIZE
    }

    /// The filesystem's size: the content, a fifth more and 4 MiB for ext4's own
    /// structures; at least 16 MiB and a block per inode (ext4 holds at most one inode per
    /// block); a whole number of MiB.
    fn image_bytes(&self) -> u64 {
        let c = self.content_bytes();
        let padded = c + c / 5 + (4 << 20);
        padded
            .max(MIN_BYTES)
            .max(self.inodes() * BLOCK)
            .div_ceil(1 << 20)
            << 20
    }
}

fn blocks(bytes: u64) -> u64 {
    bytes.div_ceil(BLOCK) * BLOCK
}

/// Walks the staged tree (never following links).
fn measure(stage: &Path) -> Result<Staged> {
    let mut s = Staged::default();
    let mut seen = HashSet::new();
    let mut todo = vec![stage.to_path_buf()];
    while let Some(dir) = todo.pop() {
        let rd = fs::read_dir(&dir).map_err(|e| ImageError::io("list", &dir, e))?;
        // `.` and `..`, then 8 bytes plus the name (to 4) per entry.
        let mut dir_bytes = 24;
        for e in rd {
            let e = e.map_err(|e| ImageError::io("list", &dir, e))?;
            let path = e.path();
            let m = fs::symlink_metadata(&path).map_err(|e| ImageError::io("inspect", &path, e))?;
            s.entries += 1;
            s.newest = s.newest.max(m.mtime());
            dir_bytes += 8 + (e.file_name().len() as u64).div_ceil(4) * 4;
            let kind = m.file_type();
            if kind.is_dir() {
                todo.push(path);
            } else if kind.is_file() {
                if seen.insert((m.dev(), m.ino())) {
                    // Contents, plus an extent block for every 128 MiB past the first 512.
                    s.data += blocks(m.len()) + (m.len() >> 27) * BLOCK;
                }
            } else if kind.is_symlink() && m.len() >= 60 {
                s.data += blocks(m.len());
            }
        }
        s.dirs += blocks(dir_bytes);
    }
    Ok(s)
}

/// One run of `mkfs.ext4`.
struct Mkfs<'a> {
    program: &'a Path,
    stage: &'a Path,
    file: &'a Path,
    size: u64,
    inodes: u64,
    uuid: &'a str,
    time: i64,
}

enum MkfsError {
    /// The filesystem was too small (blocks or inodes ran out): stderr.
    TooSmall(String),
    /// Anything else: exit status and stderr.
    Failed(std::process::ExitStatus, String),
    /// Could not prepare the file.
    Io(ImageError),
    /// Could not start the program.
    Spawn(io::Error),
}

impl Mkfs<'_> {
    fn run(&self) -> Result<(), MkfsError> {
        let _ = fs::remove_file(self.file);
        let f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(self.file)
            .map_err(|e| MkfsError::Io(ImageError::io("create", self.file, e)))?;
        // Sparse: only what mkfs writes takes disk space.
        f.set_len(self.size)
            .map_err(|e| MkfsError::Io(ImageError::io("size", self.file, e)))?;
        drop(f);
        let out = Command::new(self.program)
            .args([
                "-q", "-F", "-b", "4096", "-I", "256", "-m", "0", "-L", "image",
            ])
            .args(["-O", "^has_journal,^metadata_csum,^resize_inode"])
            .arg("-N")
            .arg(self.inodes.to_string())
            .arg("-E")
            .arg(format!("root_owner=0:0,hash_seed={}", self.uuid))
            .arg("-U")
            .arg(self.uuid)
            .arg("-d")
            .arg(self.stage)
            .arg(self.file)
            .env("LC_ALL", "C")
            .env("E2FSPROGS_FAKE_TIME", self.time.to_string())
            .stdin(Stdio::null())
            .output()
            .map_err(MkfsError::Spawn)?;
        if out.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if ["Could not allocate", "No free space", "No space left"]
            .iter()
            .any(|s| stderr.contains(s))
        {
            Err(MkfsError::TooSmall(stderr))
        } else {
            Err(MkfsError::Failed(out.status, stderr))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
