//! Cgroups for one sandbox: v1 (one directory per controller) or v2 (one directory).
//!
//! The sandbox's cgroup is created **under the caller's own cgroup** (from
//! `/proc/self/cgroup`), uniquely named `asb-<id>`, and removed on destroy.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sandbox_core::Limits;

/// Which cgroup layout the host has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// Legacy hierarchies, one per controller.
    V1,
    /// The unified hierarchy.
    V2,
}

/// Where the caller's cgroups are, per controller.
#[derive(Debug, Clone, Default)]
pub(crate) struct CgroupHost {
    /// v1: controller name -> the caller's cgroup directory in that hierarchy.
    pub v1: Vec<(String, PathBuf)>,
    /// v2: the caller's cgroup directory, when the unified hierarchy has memory+pids.
    pub v2: Option<PathBuf>,
}

fn parse_self_cgroup() -> Vec<(String, String)> {
    let Ok(s) = fs::read_to_string("/proc/self/cgroup") else {
        return vec![];
    };
    s.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let _id = it.next()?;
            let ctrls = it.next()?;
            let path = it.next()?;
            Some((ctrls.to_string(), path.to_string()))
        })
        .collect()
}

/// (mount point, fstype, super options) of every cgroup mount.
fn cgroup_mounts() -> Vec<(PathBuf, String, String)> {
    let Ok(s) = fs::read_to_string("/proc/self/mountinfo") else {
        return vec![];
    };
    let mut out = Vec::new();
    for l in s.lines() {
        let Some((pre, post)) = l.split_once(" - ") else {
            continue;
        };
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        if pre.len() < 5 || post.len() < 3 {
            continue;
        }
        // Only mounts of a hierarchy's root (field 4 == "/") are usable paths.
        if pre[3] != "/" {
            continue;
        }
        if post[0] == "cgroup" || post[0] == "cgroup2" {
            out.push((
                PathBuf::from(unescape(pre[4])),
                post[0].to_string(),
                post[2].to_string(),
            ));
        }
    }
    out
}

fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

fn join_rel(mount: &Path, rel: &str) -> PathBuf {
    mount.join(rel.trim_start_matches('/'))
}

impl CgroupHost {
    /// Finds the caller's cgroups. v1 controllers we use: memory, pids, cpu, freezer.
    pub fn detect() -> CgroupHost {
        let me = parse_self_cgroup();
        let mounts = cgroup_mounts();
        let mut host = CgroupHost::default();
        for want in ["memory", "pids", "cpu", "freezer"] {
            let Some((_, rel)) = me
                .iter()
                .find(|(c, _)| !c.is_empty() && c.split(',').any(|x| x == want))
            else {
                continue;
            };
            let Some((mnt, _, _)) = mounts
                .iter()
                .find(|(_, t, o)| t == "cgroup" && o.split(',').any(|x| x == want))
            else {
                continue;
            };
            host.v1.push((want.to_string(), join_rel(mnt, rel)));
        }
        if host.v1.iter().all(|(c, _)| c != "memory" && c != "pids") {
            host.v1.clear();
        }
        if let (Some((_, rel)), Some((mnt, _, _))) = (
            me.iter().find(|(c, _)| c.is_empty()),
            mounts.iter().find(|(_, t, _)| t == "cgroup2"),
        ) {
            let dir = join_rel(mnt, rel);
            let ctrls = fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
            let has = |c: &str| ctrls.split_whitespace().any(|x| x == c);
            if has("memory") && has("pids") {
                host.v2 = Some(dir);
            }
        }
        host
    }

    /// The version we use: v1 when its memory or pids controller exists, else v2.
    pub fn version(&self) -> Option<CgroupVersion> {
        if !self.v1.is_empty() {
            Some(CgroupVersion::V1)
        } else if self.v2.is_some() {
            Some(CgroupVersion::V2)
        } else {
            None
        }
    }

    /// Whether we may create child cgroups (the caller's directories are writable).
    pub fn writable(&self) -> Result<(), String> {
        let dirs: Vec<&PathBuf> = match self.version() {
            Some(CgroupVersion::V1) => self.v1.iter().map(|(_, p)| p).collect(),
            Some(CgroupVersion::V2) => self.v2.iter().collect(),
            None => return Err("no usable cgroup hierarchy (memory and pids controllers)".into()),
        };
        for d in dirs {
            let c = std::ffi::CString::new(d.as_os_str().as_encoded_bytes())
                .map_err(|e| e.to_string())?;
            // SAFETY: access(2) on a NUL-terminated path.
            if unsafe { libc::access(c.as_ptr(), libc::W_OK) } != 0 {
                return Err(format!(
                    "cgroup directory {} is not writable by uid {}",
                    d.display(),
                    nix::unistd::geteuid()
                ));
            }
        }
        Ok(())
    }

    /// Removes `asb-<pid>-*` cgroups left by processes that died without destroying their
    /// sandboxes (their inits died with them). Returns how many directories were removed.
    pub fn sweep_orphans(&self) -> usize {
        let dirs: Vec<&PathBuf> = self
            .v1
            .iter()
            .map(|(_, p)| p)
            .chain(self.v2.iter())
            .collect();
        let mut n = 0;
        for d in dirs {
            let Ok(rd) = fs::read_dir(d) else { continue };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(pid) = name
                    .strip_prefix("asb-")
                    .and_then(|r| r.split_once('-'))
                    .and_then(|(p, _)| p.parse::<u32>().ok())
                else {
                    continue;
                };
                if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
                    continue;
                }
                let dir = e.path();
                if let Ok(sub) = fs::read_dir(&dir) {
                    for s in sub.flatten() {
                        if s.file_type().is_ok_and(|t| t.is_dir()) {
                            kill_procs(&s.path());
                            let _ = fs::remove_dir(s.path());
                        }
                    }
                }
                kill_procs(&dir);
                if fs::remove_dir(&dir).is_ok() {
                    n += 1;
                }
            }
        }
        n
    }

    /// Creates the sandbox's cgroup(s) with `limits`.
    pub fn create(&self, name: &str, limits: &Limits) -> io::Result<SandboxCgroup> {
        let mut cg = SandboxCgroup {
            version: CgroupVersion::V1,
            dirs: Vec::new(),
            events: [None, None],
        };
        let r = match self.version() {
            Some(CgroupVersion::V1) => self.create_v1(&mut cg, name, limits),
            Some(CgroupVersion::V2) => {
                cg.version = CgroupVersion::V2;
                self.create_v2(&mut cg, name, limits)
            }
            None => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "no cgroup hierarchy",
            )),
        };
        if let Err(e) = r {
            cg.remove(Duration::from_millis(200));
            return Err(e);
        }
        let (oom, pids) = cg.event_files();
        cg.events = [oom, pids].map(|p| p.and_then(|p| fs::File::open(p).ok()));
        Ok(cg)
    }

    fn create_v1(&self, cg: &mut SandboxCgroup, name: &str, l: &Limits) -> io::Result<()> {
        // Each write to a cgroup file is an open/write/close (~15 µs here): the files are
        // opened relative to their directory, and none is written that keeps its default
        // (a new cgroup's CFS period is the kernel's 100 ms).
        for (ctrl, parent) in &self.v1 {
            let dir = parent.join(name);
            mkdir(&dir)?;
            cg.dirs.push((ctrl.clone(), dir.clone()));
            let at = || DirFd::open(&dir);
            match ctrl.as_str() {
                "memory" => {
                    let d = at()?;
                    let mem = l.memory_bytes.to_string();
                    d.write("memory.limit_in_bytes", &mem)?;
                    match d.write("memory.memsw.limit_in_bytes", &mem) {
                        Ok(()) => {}
                        // No swap accounting: keep the sandbox's memory out of swap, if the
                        // host has any.
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {
                            if host_has_swap() {
                                let _ = d.write("memory.swappiness", "0");
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
                "pids" => at()?.write("pids.max", &pids_max(l).to_string())?,
                "cpu" => {
                    let period = 100_000u64;
                    let quota = u64::from(l.cpu_millis) * period / 1000;
                    at()?.write("cpu.cfs_quota_us", &quota.max(1000).to_string())?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn create_v2(&self, cg: &mut SandboxCgroup, name: &str, l: &Limits) -> io::Result<()> {
        let parent = self
            .v2
            .as_ref()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        // Controllers must be enabled for the parent's children; this fails when the caller's
        // cgroup holds processes and is not the root ("no internal processes").
        let _ = write(&parent.join("cgroup.subtree_control"), "+memory +pids +cpu");
        let dir = parent.join(name);
        mkdir(&dir)?;
        cg.dirs.push(("unified".into(), dir.clone()));
        write(&dir.join("memory.max"), &l.memory_bytes.to_string())?;
        let _ = write(&dir.join("memory.swap.max"), "0");
        write(&dir.join("pids.max"), &pids_max(l).to_string())?;
        let period = 100_000u64;
        let quota = (u64::from(l.cpu_millis) * period / 1000).max(1000);
        let _ = write(&dir.join("cpu.max"), &format!("{quota} {period}"));
        Ok(())
    }
}

/// A cgroup directory, open for `openat`.
struct DirFd {
    fd: std::os::fd::OwnedFd,
    path: PathBuf,
}

impl DirFd {
    fn open(dir: &Path) -> io::Result<DirFd> {
        use nix::fcntl::OFlag;
        let fd = nix::fcntl::open(
            dir,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!("open {}: {e}", dir.display()),
            )
        })?;
        Ok(DirFd {
            fd,
            path: dir.to_path_buf(),
        })
    }

    /// Writes `v` to file `name` of the directory (which must exist: no `O_CREAT`).
    fn write(&self, name: &str, v: &str) -> io::Result<()> {
        use nix::fcntl::OFlag;
        use std::io::Write;
        let err = |e: io::Error| {
            io::Error::new(
                e.kind(),
                format!(
                    "write {} to {}: {e}",
                    v.trim(),
                    self.path.join(name).display()
                ),
            )
        };
        let fd = nix::fcntl::openat(
            &self.fd,
            name,
            OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| err(e.into()))?;
        fs::File::from(fd).write_all(v.as_bytes()).map_err(err)
    }
}

/// Whether the host has any swap space (`/proc/swaps` lists a device), read once.
fn host_has_swap() -> bool {
    static SWAP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SWAP.get_or_init(|| fs::read_to_string("/proc/swaps").map_or(true, |s| s.lines().count() > 1))
}

fn mkdir(p: &Path) -> io::Result<()> {
    fs::create_dir(p).map_err(|e| io::Error::new(e.kind(), format!("mkdir {}: {e}", p.display())))
}

fn write(p: &Path, v: &str) -> io::Result<()> {
    fs::write(p, v).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("write {} to {}: {e}", v.trim(), p.display()),
        )
    })
}

/// One sandbox's cgroup directories.
#[derive(Debug)]
pub(crate) struct SandboxCgroup {
    pub version: CgroupVersion,
    /// (controller or "unified", directory).
    dirs: Vec<(String, PathBuf)>,
    /// The OOM-kill and `pids.max` event files, kept open: every exec reads them, and a
    /// `pread` on an open cgroup file is several times cheaper than opening it again.
    events: [Option<fs::File>; 2],
}

impl SandboxCgroup {
    fn dir(&self, ctrl: &str) -> Option<&PathBuf> {
        self.dirs.iter().find(|(c, _)| c == ctrl).map(|(_, p)| p)
    }

    /// The directories, for bookkeeping.
    pub fn dirs(&self) -> impl Iterator<Item = &PathBuf> {
        self.dirs.iter().map(|(_, d)| d)
    }

    /// The files the (single-threaded) init writes `0` to in order to join the sandbox's
    /// cgroups itself (v1: `tasks`, v2: `cgroup.procs`). We open them, so our credentials
    /// authorize the write (cgroup checks the opener's).
    pub fn join_files(&self) -> Vec<PathBuf> {
        let f = match self.version {
            CgroupVersion::V1 => "tasks",
            CgroupVersion::V2 => "cgroup.procs",
        };
        self.dirs.iter().map(|(_, d)| d.join(f)).collect()
    }

    /// `oom_kill` events so far (memory exhaustion kills).
    pub fn oom_kills(&self) -> u64 {
        self.events[0]
            .as_ref()
            .map_or(0, |f| read_key_at(f, "oom_kill"))
    }

    /// Times a fork failed on `pids.max`.
    pub fn pids_max_events(&self) -> u64 {
        self.events[1].as_ref().map_or(0, |f| read_key_at(f, "max"))
    }

    /// Paths of the OOM-kill and `pids.max` event files.
    fn event_files(&self) -> (Option<PathBuf>, Option<PathBuf>) {
        match self.version {
            CgroupVersion::V1 => (
                self.dir("memory").map(|d| d.join("memory.oom_control")),
                self.dir("pids").map(|d| d.join("pids.events")),
            ),
            CgroupVersion::V2 => (
                self.dir("unified").map(|d| d.join("memory.events")),
                self.dir("unified").map(|d| d.join("pids.events")),
            ),
        }
    }

    /// Whether pause/resume works (v1 freezer or v2 `cgroup.freeze`).
    pub fn can_freeze(&self) -> bool {
        match self.version {
            CgroupVersion::V1 => self.dir("freezer").is_some(),
            CgroupVersion::V2 => self
                .dir("unified")
                .is_some_and(|d| d.join("cgroup.freeze").exists()),
        }
    }

    /// Freezes (or thaws) every process of the sandbox and waits until it is done.
    pub fn freeze(&self, frozen: bool) -> io::Result<()> {
        match self.version {
            CgroupVersion::V1 => {
                let d = self
                    .dir("freezer")
                    .ok_or_else(|| io::Error::from(io::ErrorKind::Unsupported))?;
                let want = if frozen { "FROZEN" } else { "THAWED" };
                write(&d.join("freezer.state"), want)?;
                let deadline = Instant::now() + Duration::from_secs(5);
                loop {
                    let s = fs::read_to_string(d.join("freezer.state"))?;
                    if s.trim() == want {
                        return Ok(());
                    }
                    if Instant::now() > deadline {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("freezer stuck in {}", s.trim()),
                        ));
                    }
                    // FREEZING: ask again (the write is what retries in v1).
                    let _ = write(&d.join("freezer.state"), want);
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            CgroupVersion::V2 => {
                let d = self
                    .dir("unified")
                    .ok_or_else(|| io::Error::from(io::ErrorKind::Unsupported))?;
                write(&d.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
                let deadline = Instant::now() + Duration::from_secs(5);
                let want = if frozen { "frozen 1" } else { "frozen 0" };
                loop {
                    let ev = fs::read_to_string(d.join("cgroup.events")).unwrap_or_default();
                    if ev.lines().any(|l| l.trim() == want) || Instant::now() > deadline {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
    }

    /// Removes the sandbox's directories (leaves first), retrying while they drain.
    /// Returns the directories that could not be removed.
    pub fn remove(&self, patience: Duration) -> Vec<PathBuf> {
        let deadline = Instant::now() + patience;
        let mut left = Vec::new();
        for (_, dir) in &self.dirs {
            if let Ok(rd) = fs::read_dir(dir) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        if let Err(p) = rmdir_patiently(&e.path(), deadline) {
                            left.push(p);
                        }
                    }
                }
            }
            if let Err(p) = rmdir_patiently(dir, deadline) {
                left.push(p);
            }
        }
        left
    }
}

fn rmdir_patiently(dir: &Path, deadline: Instant) -> Result<(), PathBuf> {
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(_) if Instant::now() < deadline => {
                // Tasks still leaving: kill stragglers, then retry.
                kill_procs(dir);
                std::thread::sleep(Duration::from_micros(500));
            }
            Err(_) => return Err(dir.to_path_buf()),
        }
    }
}

/// SIGKILLs every process listed in `dir/cgroup.procs` until it is empty (bounded).
pub(crate) fn kill_procs(dir: &Path) -> bool {
    for _ in 0..200 {
        let Ok(s) = fs::read_to_string(dir.join("cgroup.procs")) else {
            return true;
        };
        let pids: Vec<i32> = s.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if pids.is_empty() {
            return true;
        }
        for p in pids {
            // SAFETY: kill(2) with a pid read from the cgroup; a stale pid is harmless
            // within this loop's microseconds (pids are not reused that fast).
            unsafe {
                libc::kill(p, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    false
}

/// `pids.max` for `limits.pids`: the init and its spare supervisor count too, so the
/// sandbox's own processes (each exec's supervisor included) get the spec's number.
fn pids_max(l: &Limits) -> u64 {
    u64::from(l.pids) + 2
}

/// The value of `key` in a flat-keyed cgroup file (`key value` lines), 0 if absent.
fn parse_key(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok()).flatten()
        })
        .unwrap_or(0)
}

/// [`parse_key`] of an open cgroup file, read from its start.
fn read_key_at(f: &fs::File, key: &str) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 512];
    let n = f.read_at(&mut buf, 0).unwrap_or(0);
    std::str::from_utf8(&buf[..n]).map_or(0, |t| parse_key(t, key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_something_or_nothing_without_panicking() {
        let h = CgroupHost::detect();
        let _ = h.version();
        let _ = h.writable();
    }

    #[test]
    fn read_key_parses_flat_keyed_files() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        fs::write(&p, "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n").unwrap();
        let f = fs::File::open(&p).unwrap();
        assert_eq!(read_key_at(&f, "oom_kill"), 3);
        assert_eq!(read_key_at(&f, "missing"), 0);
        // Read again from the start, not from where the last read stopped.
        assert_eq!(read_key_at(&f, "oom_kill"), 3);
    }
}
