//! The image root: a read-only ext4 disk (an OCI image's filesystem) mounted under a
//! writable overlay and made the root the way `switch_root` does (see the crate docs for the
//! kernel command-line parameters).

use super::*;

/// The list of the image-root modules in the initramfs (see `initramfs::ROOT_MODULES_DEP`).
pub(crate) const ROOT_MODULES_DEP: &str = "root-modules.dep";
pub(crate) const ROOT_LOWER: &str = "/run/lower";
pub(crate) const ROOT_LAYER: &str = "/run/rw";
pub(crate) const NEW_ROOT: &str = "/run/root";
/// What [`system_setup`] mounted, moved into the new root (submounts go along).
pub(crate) const MOVED_MOUNTS: [&str; 5] = ["/proc", "/sys", "/dev", "/tmp", WORKSPACE];
pub(crate) const DEFAULT_ROOT_WAIT_S: u64 = 10;

/// An image root asked for on the kernel command line.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct RootConfig {
    /// `agent.root=`: the block device holding the image's ext4 filesystem.
    pub(crate) device: String,
    /// `agent.root_size=`: the writable layer's tmpfs `size=` (a number with an optional
    /// `k`/`m`/`g`/`%` suffix), `None` for the default.
    pub(crate) size: Option<String>,
    /// The writable layer's tmpfs options (set from `size` and the tmpfs budget).
    pub(crate) layer_opts: String,
    /// `agent.root_wait=`: how long to wait for the device.
    pub(crate) wait: Duration,
}

/// Why the image root could not be set up.
#[derive(Debug)]
pub(crate) enum RootError {
    /// A bad `agent.root*` parameter (or an unreadable command line).
    Config(String),
    /// The initramfs has no image-root modules (it predates image roots).
    NoModules(String),
    /// Modules that would not load.
    Modules(Vec<String>),
    /// The device did not appear in time.
    NoDevice { device: String, waited: Duration },
    /// A mount, mkdir or root switch failed.
    Step { what: String, err: io::Error },
}

impl std::fmt::Display for RootError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RootError::Config(m) => write!(f, "bad kernel command line: {m}"),
            RootError::NoModules(m) => write!(
                f,
                "this initramfs has no image-root modules ({m}): it was built by an older \
                 version; install the guest again"
            ),
            RootError::Modules(v) => write!(f, "kernel modules failed: {}", v.join("; ")),
            RootError::NoDevice { device, waited } => write!(
                f,
                "{device} did not appear within {}s (is the disk attached?)",
                waited.as_secs()
            ),
            RootError::Step { what, err } => write!(f, "{what}: {err}"),
        }
    }
}

/// Reads the `agent.root*` parameters of a kernel command line.
/// `agent.user=<uid>:<gid>` on the kernel command line: who commands run as (`None`: root).
pub(crate) fn user_config(cmdline: &str) -> Result<Option<(u32, u32)>, RootError> {
    let Some(v) = cmdline
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("agent.user="))
        .next_back()
    else {
        return Ok(None);
    };
    let parsed = v
        .split_once(':')
        .and_then(|(u, g)| Some((u.parse::<u32>().ok()?, g.parse::<u32>().ok()?)));
    match parsed {
        Some((0, 0)) => Ok(None),
        Some(ids) => Ok(Some(ids)),
        None => Err(RootError::Config(format!(
            "agent.user={v}: expected <uid>:<gid> (numbers)"
        ))),
    }
}

pub(crate) fn root_config(cmdline: &str) -> Result<Option<RootConfig>, RootError> {
    let (mut device, mut size, mut wait) = (None, None, None);
    for word in cmdline.split_whitespace() {
        let Some((k, v)) = word.split_once('=') else {
            continue;
        };
        match k {
            "agent.root" => device = Some(v),
            "agent.root_size" => size = Some(v),
            "agent.root_wait" => wait = Some(v),
            _ => {}
        }
    }
    let Some(device) = device else {
        if size.is_some() || wait.is_some() {
            return Err(RootError::Config(
                "agent.root_size/agent.root_wait without agent.root".into(),
            ));
        }
        return Ok(None);
    };
    let dev_ok = device.strip_prefix("/dev/").is_some_and(|n| {
        !n.is_empty()
            && Path::new(n)
                .components()
                .all(|c| matches!(c, Component::Normal(_)))
    });
    if !dev_ok {
        return Err(RootError::Config(format!(
            "agent.root={device}: not a device under /dev"
        )));
    }
    if let Some(s) = size {
        let digits = s.trim_end_matches(['k', 'K', 'm', 'M', 'g', 'G', '%']);
        let suffix = s.len() - digits.len();
        if digits.is_empty() || suffix > 1 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(RootError::Config(format!(
                "agent.root_size={s}: expected a number with an optional k, m, g or % suffix"
            )));
        }
    }
    let wait = match wait {
        None => DEFAULT_ROOT_WAIT_S,
        Some(w) => match w.parse::<u64>() {
            Ok(n) if (1..=600).contains(&n) => n,
            _ => {
                return Err(RootError::Config(format!(
                    "agent.root_wait={w}: expected whole seconds, 1 to 600"
                )))
            }
        },
    };
    Ok(Some(RootConfig {
        device: device.to_string(),
        size: size.map(str::to_string),
        layer_opts: String::new(),
        wait: Duration::from_secs(wait),
    }))
}

/// The image-root modules' list, or why there is none.
pub(crate) fn root_modules_list(dir: &Path) -> Result<String, RootError> {
    let path = dir.join(ROOT_MODULES_DEP);
    fs::read_to_string(&path).map_err(|e| RootError::NoModules(format!("{}: {e}", path.display())))
}

pub(crate) fn step(what: impl Into<String>) -> impl FnOnce(io::Error) -> RootError {
    let what = what.into();
    move |err| RootError::Step { what, err }
}

pub(crate) fn mkdir_p(path: &str) -> Result<(), RootError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(path)
        .map_err(step(format!("mkdir {path}")))
}

/// `mount(2)`, the error named after `what`.
pub(crate) fn mount_at(
    src: &str,
    dst: &str,
    fstype: Option<&str>,
    flags: u64,
    data: Option<&str>,
) -> Result<(), RootError> {
    let what = format!(
        "mount {src} on {dst}{}",
        fstype.map(|t| format!(" ({t})")).unwrap_or_default()
    );
    let (src_c, dst_c) = (cstr(src), cstr(dst));
    let ty = fstype.map(cstr);
    let data_c = data.map(cstr);
    // SAFETY: valid NUL-terminated strings (or null where mount(2) allows it) that outlive
    // the call.
    let r = unsafe {
        mount(
            src_c.as_ptr(),
            dst_c.as_ptr(),
            ty.as_ref().map_or(std::ptr::null(), |t| t.as_ptr()),
            flags,
            data_c
                .as_ref()
                .map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    if r != 0 {
        return Err(step(what)(io::Error::last_os_error()));
    }
    Ok(())
}

/// Whether `path` is a mount point (another device than its parent's).
pub(crate) fn is_mount_point(path: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let parent = Path::new(path).parent().unwrap_or(Path::new("/"));
    match (fs::metadata(path), fs::metadata(parent)) {
        (Ok(a), Ok(b)) => a.dev() != b.dev(),
        _ => false,
    }
}

/// Deletes what is under `dir` on `dir`'s own filesystem, never crossing into another mount
/// (a directory on another device is left alone, with its contents); `dir` itself stays.
/// Returns the bytes of the regular files deleted. Errors are skipped: this only frees memory.
pub(crate) fn delete_on_device(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(top) = fs::symlink_metadata(dir) else {
        return 0;
    };
    let mut freed = 0;
    let mut stack = vec![(dir.to_path_buf(), false)];
    // Depth first; a directory is visited again (`true`) once its contents are gone.
    while let Some((d, emptied)) = stack.pop() {
        if emptied {
            if d != dir {
                let _ = fs::remove_dir(&d);
            }
            continue;
        }
        stack.push((d.clone(), true));
        let Ok(rd) = fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let Ok(m) = fs::symlink_metadata(&p) else {
                continue;
            };
            if m.dev() != top.dev() {
                continue;
            }
            if m.is_dir() {
                stack.push((p, false));
            } else if fs::remove_file(&p).is_ok() && m.is_file() {
                freed += m.len();
            }
        }
    }
    freed
}

/// Mounts the image root and switches to it (see the module documentation).
pub(crate) fn image_root(cfg: &RootConfig) -> Result<(), RootError> {
    use std::os::unix::fs::FileTypeExt;
    let list = root_modules_list(Path::new(MODULES))?;
    let failed = load_modules(Path::new(MODULES), &list);
    if !failed.is_empty() {
        return Err(RootError::Modules(failed));
    }
    let start = std::time::Instant::now();
    loop {
        match fs::metadata(&cfg.device) {
            Ok(m) if m.file_type().is_block_device() => break,
            Ok(_) => {
                return Err(RootError::Config(format!(
                    "agent.root={}: not a block device",
                    cfg.device
                )))
            }
            Err(_) if start.elapsed() < cfg.wait => thread::sleep(Duration::from_millis(10)),
            Err(_) => {
                return Err(RootError::NoDevice {
                    device: cfg.device.clone(),
                    waited: cfg.wait,
                })
            }
        }
    }
    for d in [ROOT_LOWER, ROOT_LAYER, NEW_ROOT] {
        mkdir_p(d)?;
    }
    mount_at(&cfg.device, ROOT_LOWER, Some("ext4"), MS_RDONLY, None)?;
    mount_at("tmpfs", ROOT_LAYER, Some("tmpfs"), 0, Some(&cfg.layer_opts))?;
    let (upper, work) = (format!("{ROOT_LAYER}/upper"), format!("{ROOT_LAYER}/work"));
    mkdir_p(&upper)?;
    mkdir_p(&work)?;
    mount_at(
        "overlay",
        NEW_ROOT,
        Some("overlay"),
        0,
        Some(&format!(
            "lowerdir={ROOT_LOWER},upperdir={upper},workdir={work}"
        )),
    )?;
    for m in MOVED_MOUNTS {
        if !is_mount_point(m) {
            continue;
        }
        let dst = format!("{NEW_ROOT}{m}");
        // The image's own directory (made in the writable layer when it has none); never a
        // symlink, which would resolve in the initramfs.
        match fs::symlink_metadata(&dst) {
            Ok(md) if md.is_dir() => {}
            Ok(_) => {
                return Err(RootError::Config(format!(
                    "the image's {m} is not a directory"
                )))
            }
            Err(_) => mkdir_p(&dst)?,
        }
        mount_at(m, &dst, None, MS_MOVE, None)?;
    }
    // The initramfs's files stay in RAM until deleted, and nothing reaches them once the new
    // root is over them: delete them first, as switch_root does (not the mounts under /run).
    let freed = delete_on_device(Path::new("/"));
    log(&format!(
        "image root: freed {} KiB of initramfs",
        freed >> 10
    ));
    // switch_root: the new root over the initramfs's, then chroot into it.
    let (new_root, dot, slash) = (cstr(NEW_ROOT), cstr("."), cstr("/"));
    // SAFETY: NUL-terminated strings that outlive the calls.
    if unsafe { chdir(new_root.as_ptr()) } != 0 {
        return Err(step(format!("chdir {NEW_ROOT}"))(io::Error::last_os_error()));
    }
    mount_at(".", "/", None, MS_MOVE, None)?;
    // SAFETY: as above.
    if unsafe { chroot(dot.as_ptr()) } != 0 {
        return Err(step("chroot .")(io::Error::last_os_error()));
    }
    // SAFETY: as above.
    if unsafe { chdir(slash.as_ptr()) } != 0 {
        return Err(step("chdir /")(io::Error::last_os_error()));
    }
    Ok(())
}
