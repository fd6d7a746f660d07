//! Debian packages: the `ar` reader for `.deb` files, a package's `Depends:`, the kernel
//! image and modules of a kernel package, and `apt-get download`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::DEBIAN_KERNEL_PACKAGE;
use crate::guest::initramfs::{self, KernelModule};
use crate::guest::GuestError;

/// Reads the members of an `ar` archive (a `.deb`): (name, data).
pub fn ar_members(data: &[u8]) -> Result<Vec<(String, &[u8])>, String> {
    let rest = data.strip_prefix(b"!<arch>\n").ok_or("not an ar archive")?;
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < rest.len() {
        let hdr = rest.get(at..at + 60).ok_or("truncated ar member header")?;
        if &hdr[58..60] != b"`\n" {
            return Err("bad ar member header".into());
        }
        let name = String::from_utf8_lossy(&hdr[..16])
            .trim_end()
            .trim_end_matches('/')
            .to_string();
        let size: usize = String::from_utf8_lossy(&hdr[48..58])
            .trim()
            .parse()
            .map_err(|_| "bad ar member size")?;
        let start = at + 60;
        let end = start.checked_add(size).ok_or("ar member size overflows")?;
        let body = rest.get(start..end).ok_or("truncated ar member")?;
        out.push((name, body));
        at = end + (end % 2);
    }
    Ok(out)
}

fn deb_member<'a>(deb: &'a [u8], prefix: &str, path: &Path) -> Result<&'a [u8], GuestError> {
    let bad = |reason: String| GuestError::BadPackage {
        path: path.to_path_buf(),
        reason,
    };
    let members = ar_members(deb).map_err(bad)?;
    let (name, body) = members
        .into_iter()
        .find(|(n, _)| n.starts_with(prefix))
        .ok_or_else(|| bad(format!("no {prefix}* member")))?;
    if !name.ends_with(".tar.xz") {
        return Err(bad(format!("{name}: only .tar.xz members are supported")));
    }
    Ok(body)
}

fn deb_tar<'a>(
    deb: &'a [u8],
    prefix: &str,
    path: &Path,
) -> Result<tar::Archive<lzma_rust2::XzReader<&'a [u8]>>, GuestError> {
    let body = deb_member(deb, prefix, path)?;
    Ok(tar::Archive::new(lzma_rust2::XzReader::new(body, true)))
}

/// The `Depends:` package names of a `.deb`'s control file.
pub fn deb_depends(deb: &[u8], path: &Path) -> Result<Vec<String>, GuestError> {
    let bad = |reason: String| GuestError::BadPackage {
        path: path.to_path_buf(),
        reason,
    };
    let mut ar = deb_tar(deb, "control.tar", path)?;
    let entries = ar.entries().map_err(|e| bad(e.to_string()))?;
    for e in entries {
        let mut e = e.map_err(|e| bad(e.to_string()))?;
        let p = e.path().map_err(|e| bad(e.to_string()))?.into_owned();
        if p.file_name().is_some_and(|n| n == "control") {
            let mut text = String::new();
            e.by_ref()
                .take(1 << 20)
                .read_to_string(&mut text)
                .map_err(|e| bad(e.to_string()))?;
            let deps = text
                .lines()
                .find_map(|l| l.strip_prefix("Depends:"))
                .unwrap_or_default();
            return Ok(deps
                .split(',')
                .filter_map(|d| d.split(['|', '(']).next())
                .map(|d| d.trim().to_string())
                .filter(|d| !d.is_empty())
                .collect());
        }
    }
    Err(bad("no control file".into()))
}

/// What [`scan_kernel_deb`] found.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct KernelPackage {
    /// Kernel release (`6.1.0-48-amd64`).
    pub version: String,
    /// The `vmlinuz` image.
    pub vmlinuz: Vec<u8>,
    /// The modules asked for plus their dependencies.
    pub modules: Vec<KernelModule>,
}

pub(super) fn module_name_of(path: &str) -> Option<String> {
    let file = path.rsplit('/').next()?;
    let stem = file.strip_suffix(".ko")?;
    Some(stem.replace('-', "_"))
}

/// Reads a Debian kernel package: its `boot/vmlinuz-*` and the modules named in `wanted`
/// with their dependencies (from each module's `.modinfo`), in one pass over `data.tar.xz`
/// when the dependencies share the `virtio` prefix (else a second pass).
pub fn scan_kernel_deb(
    deb: &[u8],
    path: &Path,
    wanted: &[&str],
) -> Result<KernelPackage, GuestError> {
    let bad = |reason: String| GuestError::BadPackage {
        path: path.to_path_buf(),
        reason,
    };
    let mut want: BTreeSet<String> = wanted.iter().map(|s| s.to_string()).collect();
    let mut found: BTreeMap<String, KernelModule> = BTreeMap::new();
    let mut pkg = KernelPackage::default();
    for _pass in 0..4 {
        let mut ar = deb_tar(deb, "data.tar", path)?;
        for e in ar.entries().map_err(|e| bad(e.to_string()))? {
            let mut e = e.map_err(|e| bad(e.to_string()))?;
            let p = e
                .path()
                .map_err(|e| bad(e.to_string()))?
                .to_string_lossy()
                .trim_start_matches("./")
                .to_string();
            if let Some(ver) = p.strip_prefix("boot/vmlinuz-") {
                if pkg.vmlinuz.is_empty() {
                    pkg.version = ver.to_string();
                    e.read_to_end(&mut pkg.vmlinuz)
                        .map_err(|e| bad(e.to_string()))?;
                }
                continue;
            }
            let Some(rest) = p
                .strip_prefix("lib/modules/")
                .or_else(|| p.strip_prefix("usr/lib/modules/"))
            else {
                continue;
            };
            let Some((_, rel)) = rest.split_once('/') else {
                continue;
            };
            let Some(name) = module_name_of(rel) else {
                continue;
            };
            if found.contains_key(&name) || !(want.contains(&name) || name.starts_with("virtio")) {
                continue;
            }
            let mut data = Vec::new();
            e.by_ref()
                .take(64 << 20)
                .read_to_end(&mut data)
                .map_err(|e| bad(e.to_string()))?;
            let info = initramfs::module_info(&data)?;
            found.insert(
                name.clone(),
                KernelModule {
                    name,
                    path: rel.to_string(),
                    depends: info.depends,
                    data,
                },
            );
        }
        if pkg.vmlinuz.is_empty() {
            return Err(bad("no boot/vmlinuz-* in the package".into()));
        }
        // Close `want` over dependencies; done when everything wanted was found.
        let mut queue: Vec<String> = want.iter().cloned().collect();
        let mut closure = BTreeSet::new();
        let mut missing = false;
        while let Some(n) = queue.pop() {
            if !closure.insert(n.clone()) {
                continue;
            }
            match found.get(&n) {
                Some(m) => queue.extend(m.depends.iter().cloned()),
                None => missing = true,
            }
        }
        if !missing {
            pkg.modules = closure
                .iter()
                .filter_map(|n| found.get(n).cloned())
                .collect();
            return Ok(pkg);
        }
        if closure == want {
            let gone: Vec<&String> = want.iter().filter(|n| !found.contains_key(*n)).collect();
            return Err(bad(format!("modules not in the package: {gone:?}")));
        }
        want = closure;
    }
    Err(bad("module dependencies did not settle".into()))
}

fn run(cmd: &mut Command) -> Result<std::process::Output, GuestError> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| GuestError::Command {
        command: shown.clone(),
        reason: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(GuestError::Command {
            command: shown,
            reason: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(out)
}

/// Downloads a package's `.deb` into `dir` with `apt-get download` and returns its path. If
/// the download fails and this process is root, the package lists are refreshed once
/// (`apt-get update`) and the download retried: stale lists name package versions the mirror
/// no longer has (Debian replaces kernel packages on point releases).
pub fn apt_download(package: &str, dir: &Path) -> Result<PathBuf, GuestError> {
    let download = || {
        run(Command::new("apt-get")
            .args(["download", "-q", package])
            .current_dir(dir))
    };
    if let Err(first) = download() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(first);
        }
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        download()?;
    }
    let prefix = format!("{package}_");
    let rd = std::fs::read_dir(dir).map_err(|e| GuestError::io("list", dir, e))?;
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with(&prefix) && n.ends_with(".deb") {
            return Ok(e.path());
        }
    }
    Err(GuestError::Command {
        command: format!("apt-get download {package}"),
        reason: format!("no {prefix}*.deb appeared in {}", dir.display()),
    })
}

/// Downloads Debian's current kernel package (following `linux-image-amd64` to the versioned
/// package it depends on) into `dir`.
pub fn download_debian_kernel(dir: &Path) -> Result<PathBuf, GuestError> {
    let meta = apt_download(DEBIAN_KERNEL_PACKAGE, dir)?;
    let data = std::fs::read(&meta).map_err(|e| GuestError::io("read", &meta, e))?;
    let deps = deb_depends(&data, &meta)?;
    let target = deps
        .iter()
        .find(|d| d.starts_with("linux-image-"))
        .ok_or_else(|| GuestError::BadPackage {
            path: meta.clone(),
            reason: format!("no linux-image-* dependency in {deps:?}"),
        })?;
    apt_download(target, dir)
}
