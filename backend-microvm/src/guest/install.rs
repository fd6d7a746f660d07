//! Prepares the guest artifacts (kernel `vmlinux` + initramfs) in a cache directory,
//! `$XDG_CACHE_HOME/agent-sandbox/microvm/` (else `~/.cache/agent-sandbox/microvm/`).
//!
//! Sources: Debian's `linux-image-amd64` package (fetched with `apt-get download`, following
//! its dependency to the versioned `linux-image-<version>-amd64` package, unpacked in Rust: `ar`
//! members, `data.tar.xz`), or a kernel file the user gives (a `vmlinux` ELF or an xz bzImage),
//! optionally with a modules directory. Busybox comes from the host's static busybox
//! (Debian's `busybox-static`, `/bin/busybox`).
//!
//! Everything is written to a temporary name and renamed into place, and a `manifest.json`
//! (written last) records each artifact's size and SHA-256: [`load`] refuses missing, partial
//! or corrupt artifacts with a typed error. The initramfs file is named after the agent's
//! source hash, so a library with another agent rebuilds it (from the cached modules and
//! busybox) instead of booting a stale one.
//!
//! Format 2 of the manifest added the image-root modules ([`ROOT_MODULES`]: virtio-blk,
//! ext4, overlayfs), kept apart from the boot modules ([`ModuleRecord::root`]). A cache of an
//! older format lacks them: [`load`] refuses it ([`GuestError::Corrupt`], saying to install
//! again) rather than boot a guest that cannot mount an image root. Format 3 added the
//! network modules ([`NET_MODULES`]: virtio-net; [`ModuleRecord::net`]), refused the same
//! way when missing.
//!
//! (The `ar` reader, [`ar_members`], is hand-written: a `.deb` needs 25 lines of it, where the
//! `ar` crate would add a dependency for one loop; `archive_fuzz.rs` fuzzes it.)

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::initramfs::{
    self, InitramfsContents, KernelModule, GUEST_MODULES, NET_MODULES, ROOT_MODULES,
};
use super::{kernel, GuestError, AGENT_BINARY};
use crate::agent_client::SOURCE_HASH;

mod deb;

use deb::module_name_of;
pub use deb::{
    apt_download, ar_members, deb_depends, download_debian_kernel, scan_kernel_deb, KernelPackage,
};

/// The Debian meta-package whose dependency is the current kernel package.
pub const DEBIAN_KERNEL_PACKAGE: &str = "linux-image-amd64";
/// Version of the manifest format (2: the image-root modules).
const MANIFEST_FORMAT: u32 = 3;
const MANIFEST: &str = "manifest.json";

/// The default cache directory: `$XDG_CACHE_HOME/agent-sandbox/microvm`, else
/// `$HOME/.cache/agent-sandbox/microvm`, else a directory under the system temp dir.
pub fn default_cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })
        .unwrap_or_else(|| std::env::temp_dir().join("agent-sandbox-cache"));
    base.join("agent-sandbox").join("microvm")
}

/// Where the kernel comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelSource {
    /// Debian's `linux-image-amd64` (downloaded with `apt-get download`).
    Debian,
    /// A local Debian kernel package (`linux-image-*.deb`).
    DebFile(PathBuf),
    /// A kernel file (uncompressed `vmlinux` ELF, or a bzImage with an xz payload), with an
    /// optional modules directory (`/lib/modules/<version>`) to take the virtio modules from;
    /// without one the kernel must have virtio-mmio and virtio-console built in.
    Kernel {
        /// The kernel image.
        image: PathBuf,
        /// Its modules directory.
        modules: Option<PathBuf>,
    },
}

/// What to install and where.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct InstallOptions {
    /// The cache directory (see [`default_cache_dir`]).
    pub dir: PathBuf,
    /// The kernel.
    pub kernel: KernelSource,
    /// The static busybox to include (default: `/bin/busybox`, else `/usr/bin/busybox`);
    /// `Some(None)`-like opt-out is [`InstallOptions::no_busybox`].
    pub busybox: Option<PathBuf>,
    /// Build an initramfs without busybox (only the agent; commands must exist otherwise).
    pub no_busybox: bool,
}

impl InstallOptions {
    /// Debian's kernel into the default cache directory.
    pub fn debian() -> Self {
        InstallOptions {
            dir: default_cache_dir(),
            kernel: KernelSource::Debian,
            busybox: None,
            no_busybox: false,
        }
    }

    /// Sets [`InstallOptions::dir`].
    pub fn dir(mut self, dir: PathBuf) -> Self {
        self.dir = dir;
        self
    }

    /// Sets [`InstallOptions::kernel`].
    pub fn kernel(mut self, kernel: KernelSource) -> Self {
        self.kernel = kernel;
        self
    }

    /// Sets [`InstallOptions::busybox`].
    pub fn busybox(mut self, busybox: Option<PathBuf>) -> Self {
        self.busybox = busybox;
        self
    }

    /// Sets [`InstallOptions::no_busybox`].
    pub fn no_busybox(mut self, no_busybox: bool) -> Self {
        self.no_busybox = no_busybox;
        self
    }
}

/// One recorded file of the cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct FileRecord {
    /// File name relative to the cache directory.
    pub file: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256, hex.
    pub sha256: String,
}

/// A cached kernel module.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ModuleRecord {
    /// Module name.
    pub name: String,
    /// Path relative to the modules directory (as in `modules.dep`).
    pub path: String,
    /// Names of the modules it needs.
    pub depends: Vec<String>,
    /// Loaded only for an image root ([`ROOT_MODULES`] and the dependencies they do not share
    /// with the boot modules), not at every boot.
    #[serde(default)]
    pub root: bool,
    /// Loaded only for a network ([`NET_MODULES`] and the dependencies they share with
    /// neither the boot nor the image-root modules).
    #[serde(default)]
    pub net: bool,
    /// The cached `.ko`.
    pub record: FileRecord,
}

/// The cache's `manifest.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Manifest {
    /// Format version.
    pub format: u32,
    /// Where the kernel came from (package name and version, or the file given).
    pub source: String,
    /// Kernel release (`6.1.0-48-amd64`) when known.
    pub kernel_version: Option<String>,
    /// The uncompressed kernel.
    pub vmlinux: FileRecord,
    /// The cached static busybox, if any.
    pub busybox: Option<FileRecord>,
    /// Busybox applets to link.
    pub applets: Vec<String>,
    /// The cached modules.
    pub modules: Vec<ModuleRecord>,
    /// The initramfs built for the agent whose source hash is `agent_hash`.
    pub initramfs: FileRecord,
    /// The agent's source hash (hex) in that initramfs.
    pub agent_hash: String,
}

/// Paths of ready-to-boot guest artifacts.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GuestArtifacts {
    /// The cache directory.
    pub dir: PathBuf,
    /// The uncompressed kernel ELF.
    pub vmlinux: PathBuf,
    /// The initramfs (cpio newc) with this library's agent.
    pub initramfs: PathBuf,
    /// The manifest they were checked against.
    pub manifest: Manifest,
}

/// How much [`load`] checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verify {
    /// Existence and sizes only (fast; for every VM start).
    Sizes,
    /// Sizes and SHA-256 of every file.
    Full,
}

fn sha256_hex(data: &[u8]) -> String {
    let d = Sha256::digest(data);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256_file(path: &Path) -> Result<(u64, String), GuestError> {
    let mut f = std::fs::File::open(path).map_err(|e| GuestError::io("open", path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f
            .read(&mut buf)
            .map_err(|e| GuestError::io("read", path, e))?;
        if k == 0 {
            break;
        }
        n += k as u64;
        h.update(buf.get(..k).unwrap_or_default());
    }
    Ok((n, h.finalize().iter().map(|b| format!("{b:02x}")).collect()))
}

/// Writes `data` to `dir/name` atomically (temporary file, fsync, rename) and returns its
/// record.
fn write_atomic(dir: &Path, name: &str, data: &[u8]) -> Result<FileRecord, GuestError> {
    let dst = dir.join(name);
    if let Some(p) = dst.parent() {
        std::fs::create_dir_all(p).map_err(|e| GuestError::io("create", p, e))?;
    }
    let tmp = dst.with_file_name(format!(
        ".{}.tmp-{}",
        dst.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    let r = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(|e| GuestError::io("create", &tmp, e))?;
        f.write_all(data)
            .map_err(|e| GuestError::io("write", &tmp, e))?;
        f.sync_all().map_err(|e| GuestError::io("sync", &tmp, e))?;
        std::fs::rename(&tmp, &dst).map_err(|e| GuestError::io("rename", &dst, e))
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r?;
    Ok(FileRecord {
        file: name.to_string(),
        size: data.len() as u64,
        sha256: sha256_hex(data),
    })
}

fn check_record(dir: &Path, r: &FileRecord, verify: Verify) -> Result<PathBuf, GuestError> {
    if r.file.contains("..") || r.file.starts_with('/') {
        return Err(GuestError::Corrupt {
            path: dir.join(MANIFEST),
            reason: format!("bad file name {}", r.file),
        });
    }
    let p = dir.join(&r.file);
    let meta = std::fs::metadata(&p).map_err(|e| GuestError::Corrupt {
        path: p.clone(),
        reason: format!("missing: {e}"),
    })?;
    if meta.len() != r.size {
        return Err(GuestError::Corrupt {
            path: p,
            reason: format!("{} bytes, the manifest records {}", meta.len(), r.size),
        });
    }
    if verify == Verify::Full {
        let (_, sum) = sha256_file(&p)?;
        if sum != r.sha256 {
            return Err(GuestError::Corrupt {
                path: p,
                reason: "SHA-256 mismatch".into(),
            });
        }
    }
    Ok(p)
}

fn read_manifest(dir: &Path) -> Result<Manifest, GuestError> {
    let path = dir.join(MANIFEST);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(GuestError::NotInstalled {
                dir: dir.to_path_buf(),
            })
        }
        Err(e) => return Err(GuestError::io("read", &path, e)),
    };
    // The format first, so that an older manifest is named as such whatever its fields.
    #[derive(Deserialize)]
    struct Format {
        format: u32,
    }
    let corrupt = |e: serde_json::Error| GuestError::Corrupt {
        path: path.clone(),
        reason: e.to_string(),
    };
    let f: Format = serde_json::from_slice(&text).map_err(corrupt)?;
    if f.format < MANIFEST_FORMAT {
        return Err(GuestError::Corrupt {
            path,
            reason: format!(
                "manifest format {} (expected {MANIFEST_FORMAT}): installed by an older version, \
                 without the kernel modules for an image root (virtio-blk, ext4, overlay) or a \
                 network (virtio-net); install the guest again",
                f.format
            ),
        });
    }
    if f.format != MANIFEST_FORMAT {
        return Err(GuestError::Corrupt {
            path,
            reason: format!(
                "manifest format {} (expected {MANIFEST_FORMAT}): installed by a newer version",
                f.format
            ),
        });
    }
    serde_json::from_slice(&text).map_err(corrupt)
}

fn agent_hash_hex() -> String {
    format!("{SOURCE_HASH:016x}")
}

/// Builds the initramfs for this library's agent from the cached busybox and modules,
/// writes it atomically, and returns its record.
fn build_initramfs(dir: &Path, m: &Manifest, verify: Verify) -> Result<FileRecord, GuestError> {
    let busybox = match &m.busybox {
        Some(r) => {
            let p = check_record(dir, r, verify)?;
            Some(std::fs::read(&p).map_err(|e| GuestError::io("read", &p, e))?)
        }
        None => None,
    };
    let mut modules = Vec::new();
    let mut root_modules = Vec::new();
    let mut net_modules = Vec::new();
    for mr in &m.modules {
        let p = check_record(dir, &mr.record, verify)?;
        let km = KernelModule {
            name: mr.name.clone(),
            path: mr.path.clone(),
            depends: mr.depends.clone(),
            data: std::fs::read(&p).map_err(|e| GuestError::io("read", &p, e))?,
        };
        if mr.net {
            net_modules.push(km);
        } else if mr.root {
            root_modules.push(km);
        } else {
            modules.push(km);
        }
    }
    let cpio = initramfs::build(&InitramfsContents {
        agent: AGENT_BINARY,
        busybox: busybox.as_deref(),
        applets: m.applets.clone(),
        modules,
        root_modules,
        net_modules,
    })?;
    write_atomic(dir, &format!("initramfs-{}.cpio", agent_hash_hex()), &cpio)
}

/// Checks the cached artifacts in `dir` and returns their paths. If the initramfs was built
/// for another agent (another version of this library), it is rebuilt from the cached parts.
pub fn load(dir: &Path, verify: Verify) -> Result<GuestArtifacts, GuestError> {
    let mut m = read_manifest(dir)?;
    let vmlinux = check_record(dir, &m.vmlinux, verify)?;
    if m.agent_hash != agent_hash_hex() {
        let rec = build_initramfs(dir, &m, verify)?;
        m.initramfs = rec;
        m.agent_hash = agent_hash_hex();
        let json = serde_json::to_vec_pretty(&m).map_err(|e| GuestError::Corrupt {
            path: dir.join(MANIFEST),
            reason: e.to_string(),
        })?;
        write_atomic(dir, MANIFEST, &json)?;
    }
    let initramfs = check_record(dir, &m.initramfs, verify)?;
    Ok(GuestArtifacts {
        dir: dir.to_path_buf(),
        vmlinux,
        initramfs,
        manifest: m,
    })
}

fn find_busybox(opts: &InstallOptions) -> Result<Option<PathBuf>, GuestError> {
    if opts.no_busybox {
        return Ok(None);
    }
    if let Some(p) = &opts.busybox {
        return Ok(Some(p.clone()));
    }
    for p in ["/bin/busybox", "/usr/bin/busybox"] {
        if Path::new(p).is_file() {
            return Ok(Some(PathBuf::from(p)));
        }
    }
    Err(GuestError::Command {
        command: "busybox".into(),
        reason: "no static busybox found: install Debian's `busybox-static` package".into(),
    })
}

/// Whether an ELF has a `PT_INTERP` (needs a dynamic loader the guest does not have).
fn elf_is_dynamic(elf: &[u8]) -> bool {
    let le16 = |at: usize| {
        elf.get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let phoff = elf
        .get(32..40)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .and_then(|v| usize::try_from(v).ok());
    let (Some(phoff), Some(56), Some(n)) = (phoff, le16(54), le16(56)) else {
        return true;
    };
    (0..usize::from(n))
        .any(|i| elf.get(phoff + i * 56..phoff + i * 56 + 4) == Some(&3u32.to_le_bytes()[..]))
}

fn busybox_applets(path: &Path) -> Vec<String> {
    Command::new(path)
        .arg("--list")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// Names of the modules loaded at every boot: [`GUEST_MODULES`] and their dependencies among
/// `modules`. The others are the image-root and network modules.
pub fn boot_module_names(modules: &[KernelModule]) -> BTreeSet<String> {
    closure_of(modules, GUEST_MODULES)
}

/// `roots` and their dependencies, among `modules`.
fn closure_of(modules: &[KernelModule], roots: &[&str]) -> BTreeSet<String> {
    let by_name: BTreeMap<&str, &KernelModule> =
        modules.iter().map(|m| (m.name.as_str(), m)).collect();
    let mut queue: Vec<&str> = roots.to_vec();
    let mut out = BTreeSet::new();
    while let Some(n) = queue.pop() {
        if let Some(m) = by_name.get(n) {
            if out.insert(n.to_string()) {
                queue.extend(m.depends.iter().map(String::as_str));
            }
        }
    }
    out
}

fn wanted_modules() -> Vec<&'static str> {
    GUEST_MODULES
        .iter()
        .chain(ROOT_MODULES)
        .chain(NET_MODULES)
        .copied()
        .collect()
}

fn modules_from_dir(dir: &Path) -> Result<Vec<KernelModule>, GuestError> {
    // Index every .ko under dir by name, then take the closure of the wanted modules.
    let mut index: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let rd = std::fs::read_dir(&d).map_err(|e| GuestError::io("list", &d, e))?;
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(p);
            } else if let Some(n) = p.to_str().and_then(module_name_of) {
                index.insert(n, p);
            }
        }
    }
    let mut out: BTreeMap<String, KernelModule> = BTreeMap::new();
    let mut queue: Vec<String> = wanted_modules().iter().map(|s| s.to_string()).collect();
    while let Some(n) = queue.pop() {
        if out.contains_key(&n) {
            continue;
        }
        let Some(p) = index.get(&n) else {
            // Built into the kernel (or absent): nothing to load.
            continue;
        };
        let data = std::fs::read(p).map_err(|e| GuestError::io("read", p, e))?;
        let info = initramfs::module_info(&data)?;
        queue.extend(info.depends.iter().cloned());
        let rel = p
            .strip_prefix(dir)
            .map(|r| r.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("kernel/{n}.ko"));
        out.insert(
            n.clone(),
            KernelModule {
                name: n,
                path: rel,
                depends: info.depends,
                data,
            },
        );
    }
    // Dependencies that are built in are dropped from the lists.
    let names: BTreeSet<String> = out.keys().cloned().collect();
    Ok(out
        .into_values()
        .map(|mut m| {
            m.depends.retain(|d| names.contains(d));
            m
        })
        .collect())
}

/// Prepares kernel + initramfs in `opts.dir` and returns them (checked). Idempotent: an
/// existing, intact installation from the same source is replaced atomically.
pub fn install(opts: &InstallOptions) -> Result<GuestArtifacts, GuestError> {
    let dir = &opts.dir;
    std::fs::create_dir_all(dir).map_err(|e| GuestError::io("create", dir, e))?;
    let work = tempfile::Builder::new()
        .prefix(".install-")
        .tempdir_in(dir)
        .map_err(|e| GuestError::io("create a temporary directory in", dir, e))?;

    let (source, version, vmlinuz, modules) = match &opts.kernel {
        KernelSource::Debian | KernelSource::DebFile(_) => {
            let deb_path = match &opts.kernel {
                KernelSource::DebFile(p) => p.clone(),
                _ => download_debian_kernel(work.path())?,
            };
            let deb = std::fs::read(&deb_path).map_err(|e| GuestError::io("read", &deb_path, e))?;
            let pkg = scan_kernel_deb(&deb, &deb_path, &wanted_modules())?;
            let source = deb_path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            (source, Some(pkg.version), pkg.vmlinuz, pkg.modules)
        }
        KernelSource::Kernel { image, modules } => {
            let data = std::fs::read(image).map_err(|e| GuestError::io("read", image, e))?;
            let mods = match modules {
                Some(m) => modules_from_dir(m)?,
                None => Vec::new(),
            };
            (image.display().to_string(), None, data, mods)
        }
    };

    // Kernel.
    let tmp_vmlinux = work.path().join("vmlinux");
    kernel::extract_vmlinux_file_from_bytes(&vmlinuz, &tmp_vmlinux)?;
    drop(vmlinuz);
    let (size, sum) = sha256_file(&tmp_vmlinux)?;
    let vmlinux_name = match &version {
        Some(v) => format!("vmlinux-{v}"),
        None => format!("vmlinux-{}", &sum[..16]),
    };
    std::fs::rename(&tmp_vmlinux, dir.join(&vmlinux_name))
        .map_err(|e| GuestError::io("rename", dir.join(&vmlinux_name), e))?;
    let vmlinux = FileRecord {
        file: vmlinux_name,
        size,
        sha256: sum,
    };

    // Busybox.
    let (busybox, applets) = match find_busybox(opts)? {
        Some(p) => {
            let data = std::fs::read(&p).map_err(|e| GuestError::io("read", &p, e))?;
            if !data.starts_with(b"\x7fELF") || elf_is_dynamic(&data) {
                return Err(GuestError::Command {
                    command: p.display().to_string(),
                    reason: "busybox is not a static ELF binary: install Debian's `busybox-static`"
                        .into(),
                });
            }
            let applets = busybox_applets(&p);
            (Some(write_atomic(dir, "busybox", &data)?), applets)
        }
        None => (None, Vec::new()),
    };

    // Modules: those the boot needs, those of an image root, and the rest (for a network).
    let boot = boot_module_names(&modules);
    let root = closure_of(&modules, ROOT_MODULES);
    let mut records = Vec::new();
    for m in &modules {
        let file = format!("modules/{}", m.path);
        if m.path.contains("..") || m.path.starts_with('/') {
            return Err(GuestError::BadInitramfs(format!(
                "bad module path {}",
                m.path
            )));
        }
        records.push(ModuleRecord {
            name: m.name.clone(),
            path: m.path.clone(),
            depends: m.depends.clone(),
            root: !boot.contains(&m.name) && root.contains(&m.name),
            net: !boot.contains(&m.name) && !root.contains(&m.name),
            record: write_atomic(dir, &file, &m.data)?,
        });
    }

    let mut manifest = Manifest {
        format: MANIFEST_FORMAT,
        source,
        kernel_version: version,
        vmlinux,
        busybox,
        applets,
        modules: records,
        initramfs: FileRecord {
            file: String::new(),
            size: 0,
            sha256: String::new(),
        },
        agent_hash: agent_hash_hex(),
    };
    manifest.initramfs = build_initramfs(dir, &manifest, Verify::Sizes)?;
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| GuestError::Corrupt {
        path: dir.join(MANIFEST),
        reason: e.to_string(),
    })?;
    write_atomic(dir, MANIFEST, &json)?;
    drop(work);
    load(dir, Verify::Full)
}

#[cfg(test)]
mod tests;
