//! The pid 1 set-up: filesystems, kernel modules, the console channel, power-off.

use super::*;

pub(crate) fn cstr(s: &str) -> CString {
    CString::new(s).unwrap_or_default()
}

pub(crate) fn mount_fs(fstype: &str, dst: &str, flags: u64, data: &str) {
    let _ = fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dst);
    let (src, dst_c, ty, data_c) = (cstr(fstype), cstr(dst), cstr(fstype), cstr(data));
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
    let r = unsafe {
        mount(
            src.as_ptr(),
            dst_c.as_ptr(),
            ty.as_ptr(),
            flags,
            data_c.as_ptr().cast(),
        )
    };
    if r != 0 {
        log(&format!(
            "mount {fstype} on {dst}: {}",
            io::Error::last_os_error()
        ));
    }
}

/// `MemAvailable` of `/proc/meminfo`, KiB (0 when unreadable).
pub(crate) fn mem_available_kib() -> u64 {
    fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Caps of the guest's tmpfs mounts. Their files live in the guest's RAM and nothing can
/// reclaim them: uncapped (each tmpfs defaults to half the RAM), files could fill it and
/// leave every command, then this agent, to the guest's OOM killer, losing the sandbox. The
/// same policy as `sandbox_core::Limits::tmpfs_caps` (this binary is std-only), taken from
/// the RAM left after the kernel and the initramfs: together at most 5/8 of it in data and
/// one inode per 8 KiB of it; `/tmp` and `/dev/shm` an eighth each, the workspace the rest.
/// A full mount is `ENOSPC`.
///
/// With an image root, its writable layer (`/run/rw`) is a third tmpfs of the scratch size,
/// taken from the workspace's share, so the total stays the same.
pub(crate) struct TmpfsCaps {
    scratch: (u64, u64),
    workspace: (u64, u64),
}

impl TmpfsCaps {
    #[cfg(test)]
    pub(crate) fn of_ram(avail_kib: u64) -> TmpfsCaps {
        Self::of_ram_with(avail_kib, false)
    }

    pub(crate) fn of_ram_with(avail_kib: u64, image_root: bool) -> TmpfsCaps {
        let ram = avail_kib.saturating_mul(1024);
        let (data, inodes) = (ram / 8 * 5, ram / 8192);
        let scratch = ((data / 8).max(1 << 20), (inodes / 8).max(256));
        let n = if image_root { 3 } else { 2 };
        let workspace = (
            data.saturating_sub(n * scratch.0).max(1 << 20),
            inodes.saturating_sub(n * scratch.1).max(256),
        );
        TmpfsCaps { scratch, workspace }
    }

    pub(crate) fn scratch(&self, mode: &str) -> String {
        format!(
            "{mode},size={},nr_inodes={}",
            self.scratch.0, self.scratch.1
        )
    }

    pub(crate) fn workspace(&self, mode: &str) -> String {
        format!(
            "{mode},size={},nr_inodes={}",
            self.workspace.0, self.workspace.1
        )
    }
}

/// Mounts the system filesystems and loads the boot modules; returns what the kernel command
/// line asks for an image root (read once `/proc` is there), sized from the same budget.
pub(crate) fn system_setup() -> Result<Option<RootConfig>, RootError> {
    mount_fs("proc", "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "");
    mount_fs("sysfs", "/sys", MS_NOSUID | MS_NODEV | MS_NOEXEC, "");
    let root = fs::read_to_string("/proc/cmdline")
        .map_err(|e| RootError::Config(format!("/proc/cmdline: {e}")))
        .and_then(|c| root_config(&c));
    mount_fs("devtmpfs", "/dev", MS_NOSUID, "mode=0755");
    mount_fs(
        "devpts",
        "/dev/pts",
        MS_NOSUID | MS_NOEXEC,
        "mode=0620,ptmxmode=0666",
    );
    let caps = TmpfsCaps::of_ram_with(mem_available_kib(), matches!(root, Ok(Some(_))));
    let root = root.map(|r| {
        r.map(|mut r| {
            let size = r.size.clone().unwrap_or_else(|| caps.scratch.0.to_string());
            r.layer_opts = format!("mode=0755,size={size},nr_inodes={}", caps.scratch.1);
            r
        })
    });
    mount_fs(
        "tmpfs",
        "/dev/shm",
        MS_NOSUID | MS_NODEV,
        &caps.scratch("mode=1777"),
    );
    mount_fs(
        "tmpfs",
        "/tmp",
        MS_NOSUID | MS_NODEV,
        &caps.scratch("mode=1777"),
    );
    mount_fs(
        "tmpfs",
        WORKSPACE,
        MS_NOSUID | MS_NODEV,
        &caps.workspace("mode=0755"),
    );
    // SAFETY: plain syscall wrapper with no pointers.
    unsafe { setpgid(0, 0) };
    if let Ok(text) = fs::read_to_string(Path::new(MODULES).join("modules.dep")) {
        for e in load_modules(Path::new(MODULES), &text) {
            log(&e);
        }
    }
    root
}

pub(crate) const MODULES: &str = "/lib/modules";

/// Loads every module of a `modules.dep`-format list (`path: dep dep...`, paths relative to
/// `dir`), each after its dependencies; returns the failures (an already loaded module is
/// not one).
pub(crate) fn load_modules(dir: &Path, text: &str) -> Vec<String> {
    let mut deps: HashMap<String, Vec<String>> = HashMap::new();
    let mut order = Vec::new();
    for line in text.lines() {
        let Some((m, d)) = line.split_once(':') else {
            continue;
        };
        let m = m.trim().to_string();
        order.push(m.clone());
        deps.insert(m, d.split_whitespace().map(str::to_string).collect());
    }
    let mut done = HashSet::new();
    let mut failed = Vec::new();
    for m in order {
        load_module(dir, &m, &deps, &mut done, 0, &mut failed);
    }
    failed
}

pub(crate) fn load_module(
    dir: &Path,
    m: &str,
    deps: &HashMap<String, Vec<String>>,
    done: &mut HashSet<String>,
    depth: usize,
    failed: &mut Vec<String>,
) {
    if depth > 32 || !done.insert(m.to_string()) {
        return;
    }
    // modules.dep lists the deepest dependency last: load from the end.
    if let Some(ds) = deps.get(m) {
        for d in ds.iter().rev() {
            load_module(dir, d, deps, done, depth + 1, failed);
        }
    }
    let path = dir.join(m);
    let f = match File::open(&path) {
        Ok(f) => f,
        Err(e) => {
            failed.push(format!("module {}: {e}", path.display()));
            return;
        }
    };
    let empty = cstr("");
    // SAFETY: finit_module(fd, params, flags) with a valid open fd and a NUL-terminated string.
    let r = unsafe { syscall(NR_FINIT_MODULE, f.as_raw_fd(), empty.as_ptr(), 0) };
    if r != 0 && errno() != EEXIST {
        failed.push(format!(
            "load {}: {}",
            path.display(),
            io::Error::last_os_error()
        ));
    }
}

/// Waits for `/dev/hvc0` (the virtio-console driver registers it asynchronously) and opens it
/// in raw mode.
pub(crate) fn open_console() -> io::Result<File> {
    let path = Path::new("/dev/hvc0");
    let mut waited = 0u32;
    let f = loop {
        match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(0o400 /* O_NOCTTY */)
            .open(path)
        {
            Ok(f) => break f,
            // ENODEV/ENXIO until the port is ready; ENOENT until devtmpfs has the node.
            Err(e) if waited < 60_000 => {
                if waited.is_multiple_of(5000) && waited > 0 {
                    log(&format!("waiting for /dev/hvc0: {e}"));
                }
                thread::sleep(Duration::from_millis(2));
                waited += 2;
            }
            Err(e) => return Err(e),
        }
    };
    let mut t = Termios([0; 128]);
    // SAFETY: `t` is a writable buffer larger than glibc's struct termios; fd is open.
    if unsafe { tcgetattr(f.as_raw_fd(), &mut t) } == 0 {
        // SAFETY: as above; cfmakeraw only edits the struct, tcsetattr reads it.
        unsafe {
            cfmakeraw(&mut t);
            tcsetattr(f.as_raw_fd(), 0 /* TCSANOW */, &t);
        }
    }
    Ok(f)
}

pub(crate) fn power_off() -> ! {
    // SAFETY: kill(-1) signals every process but us; sync and reboot take no pointers.
    unsafe {
        kill(-1, SIGKILL);
        sync();
        reboot(RB_AUTOBOOT);
    }
    // Not reached as pid 1 (reboot does not return); elsewhere just stop.
    std::process::exit(0);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn tmpfs_caps_leave_processes_a_quarter_of_the_ram() {
        // 200 MiB available: 125 MiB of data, 25,600 inodes; /tmp and /dev/shm an eighth.
        let c = TmpfsCaps::of_ram(200 << 10);
        assert_eq!(c.scratch, ((125 << 20) / 8, 3200));
        assert_eq!(c.workspace, ((125 << 20) / 8 * 6, 19_200));
        assert_eq!(
            c.scratch("mode=1777"),
            "mode=1777,size=16384000,nr_inodes=3200"
        );
        // Data plus ~1 KiB of kernel memory per inode stays within 3/4 of the RAM.
        for mib in [16u64, 200, 4096] {
            let c = TmpfsCaps::of_ram(mib << 10);
            let worst = 2 * c.scratch.0 + c.workspace.0 + (2 * c.scratch.1 + c.workspace.1) * 1024;
            assert!(worst <= (mib << 20) / 4 * 3, "{mib} MiB");
        }
    }

    #[test]
    fn an_image_root_layer_comes_out_of_the_workspace_share() {
        let plain = TmpfsCaps::of_ram_with(200 << 10, false);
        let root = TmpfsCaps::of_ram_with(200 << 10, true);
        assert_eq!(root.scratch, plain.scratch);
        assert_eq!(root.workspace.0, plain.workspace.0 - plain.scratch.0);
        assert_eq!(root.workspace.1, plain.workspace.1 - plain.scratch.1);
        // Three scratch-sized mounts and the workspace: still 5/8 of the RAM at most.
        assert!(3 * root.scratch.0 + root.workspace.0 <= (200 << 20) / 8 * 5);
    }
}
