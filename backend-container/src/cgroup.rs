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
    /// v2 without what we need: the caller's cgroup directory and the controllers it is
    /// offered (for the error).
    pub v2_lacking: Option<(PathBuf, String)>,
    /// v2 used without the memory and pids controllers (see
    /// [`CgroupHost::allow_v2_without_limits`]): no memory or pids limit is written.
    pub v2_without_limits: bool,
}

/// Emptied v1 cgroups of destroyed sandboxes, kept for the next ones: one list per process,
/// whichever backend made them.
static RECYCLED: std::sync::LazyLock<Recycled> = std::sync::LazyLock::new(Recycled::default);

/// How many emptied sets of v1 cgroup directories a process keeps for reuse.
const RECYCLE_MAX: usize = 2;
/// The most memory still charged to an emptied memory cgroup that may be reused (page cache
/// of host files a sandbox read first; kernel objects freed after a grace period).
const RECYCLE_MAX_CHARGE: u64 = 2 << 20;

/// Emptied v1 cgroup directory sets (`asb-<pid>-free-<n>`, one directory per controller)
/// that the next sandboxes take instead of making new ones.
///
/// Why: making a v1 cgroup and removing it costs far more than its two system calls. A
/// removed cgroup is taken down by the kernel in deferred work (each controller's state
/// killed, released and freed after RCU grace periods; the memory cgroup's per-CPU charge
/// caches drained on every CPU), and that work lands on whatever runs next. Measured here
/// (2 vCPUs, after a 5 ms pause, interleaved with bubblewrap): create + first `/bin/true`
/// 3.6-3.9 ms with cgroups made and removed per sandbox, 2.25-2.7 ms without cgroups at all;
/// a pooled sandbox's first command after 12 ms idle 2.03-2.07 ms against 1.62-1.67 ms.
/// Renaming an emptied directory set costs a few µs per directory and leaves no deferred
/// work. Only v1 renames cgroup directories (cgroup2 refuses `rename`), so v2 makes and
/// removes them.
#[derive(Debug, Default)]
struct Recycled {
    sets: std::sync::Mutex<Vec<Vec<(String, PathBuf)>>>,
    next: std::sync::atomic::AtomicU64,
}

/// (controllers, path) of each line of a `/proc/<pid>/cgroup` text; the unified
/// hierarchy's line has no controllers.
fn parse_self_cgroup(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let _id = it.next()?;
            let ctrls = it.next()?;
            let path = it.next()?;
            Some((ctrls.to_string(), path.to_string()))
        })
        .collect()
}

/// (mount point, fstype, super options) of every cgroup mount of a `mountinfo` text.
fn cgroup_mounts(mountinfo: &str) -> Vec<(PathBuf, String, String)> {
    let mut out = Vec::new();
    for l in mountinfo.lines() {
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
        Self::from_proc(
            &fs::read_to_string("/proc/self/cgroup").unwrap_or_default(),
            &fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
            std::process::id(),
            |dir| fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default(),
        )
    }

    /// [`CgroupHost::detect`] from the texts of `/proc/self/cgroup` and
    /// `/proc/self/mountinfo` of process `pid`; `controllers` reads a v2 directory's
    /// `cgroup.controllers`.
    fn from_proc(
        self_cgroup: &str,
        mountinfo: &str,
        pid: u32,
        controllers: impl Fn(&Path) -> String,
    ) -> CgroupHost {
        let me = parse_self_cgroup(self_cgroup);
        let mounts = cgroup_mounts(mountinfo);
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
            let mut dir = join_rel(mnt, rel);
            // Already moved into our own leaf (see [`delegate_v2`]) by an earlier backend:
            // sandboxes go beside it, under the cgroup we came from.
            if dir.file_name() == Some(std::ffi::OsStr::new(&self_leaf_name(pid))) {
                if let Some(parent) = dir.parent() {
                    dir = parent.to_path_buf();
                }
            }
            let ctrls = controllers(&dir);
            let has = |c: &str| ctrls.split_whitespace().any(|x| x == c);
            if V2_REQUIRED.iter().all(|c| has(c)) {
                host.v2 = Some(dir);
            } else {
                host.v2_lacking =
                    Some((dir, ctrls.split_whitespace().collect::<Vec<_>>().join(" ")));
            }
        }
        host
    }

    /// With `require_cgroups(false)`, on a host whose only hierarchy is a v2 one that does
    /// not offer memory and pids: sandboxes still get a v2 cgroup (one group to freeze for
    /// pause/resume and to kill at once, `cpu.max` where offered), without memory or pids
    /// limits, rather than none at all.
    pub fn allow_v2_without_limits(&mut self) {
        if self.v1.is_empty() && self.v2.is_none() {
            if let Some((dir, _)) = self.v2_lacking.take() {
                self.v2 = Some(dir);
                self.v2_without_limits = true;
            }
        }
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

    /// Whether we may create child cgroups: the caller's directories are writable and, on
    /// v2, its cgroup can have children with the controllers we need ([`delegate_v2`], done
    /// once per process; this may move the process into a leaf cgroup of its own). Returns
    /// what was done on v2.
    pub fn usable(&self) -> Result<Option<Delegation>, String> {
        let dirs: Vec<&PathBuf> = match self.version() {
            Some(CgroupVersion::V1) => self.v1.iter().map(|(_, p)| p).collect(),
            Some(CgroupVersion::V2) => self.v2.iter().collect(),
            None => {
                return Err(match &self.v2_lacking {
                    Some((dir, offered)) if self.v1.is_empty() => format!(
                        "no usable cgroup hierarchy: cgroup v2 offers {} only [{offered}], and \
                         sandboxes need memory and pids (enable them in its parent's \
                         cgroup.subtree_control)",
                        dir.display()
                    ),
                    _ => "no usable cgroup hierarchy (memory and pids controllers)".into(),
                })
            }
        };
        for d in &dirs {
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
        match (self.version(), &self.v2) {
            (Some(CgroupVersion::V2), Some(dir)) => {
                let mut done = DELEGATED.lock().map_err(|_| "cgroup v2 set-up panicked")?;
                if let Some((d, how)) = done.as_ref() {
                    if d == dir {
                        return Ok(Some(how.clone()));
                    }
                }
                // Without limits, what is required elsewhere is only enabled where offered.
                let how = if self.v2_without_limits {
                    let all = [V2_REQUIRED, V2_OPTIONAL].concat();
                    delegate_v2(dir, &[], &all, std::process::id())?
                } else {
                    delegate_v2(dir, V2_REQUIRED, V2_OPTIONAL, std::process::id())?
                };
                if let Delegation::MovedInto(leaf) = &how {
                    tracing::info!(
                        leaf = %leaf.display(),
                        "cgroup v2: moved this process into a leaf cgroup of its own, so \
                         that sandbox cgroups can be made beside it"
                    );
                }
                *done = Some((dir.clone(), how.clone()));
                Ok(Some(how))
            }
            _ => Ok(None),
        }
    }

    /// What [`CgroupHost::usable`] did on v2 so far, without doing anything.
    pub fn delegation(&self) -> Option<Delegation> {
        let done = DELEGATED.lock().ok()?;
        done.as_ref()
            .filter(|(d, _)| Some(d) == self.v2.as_ref())
            .map(|(_, how)| how.clone())
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
        // A process other than us that is gone.
        let dead =
            |pid: u32| pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists();
        let mut n = 0;
        for d in dirs {
            let Ok(rd) = fs::read_dir(d) else { continue };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                // A dead process's own leaf (v2, see [`delegate_v2`]): what is left in it
                // are that process's other children, not sandboxes; removed once empty.
                if let Some(pid) = name
                    .strip_prefix(SELF_LEAF_PREFIX)
                    .and_then(|p| p.parse::<u32>().ok())
                {
                    if dead(pid) && fs::remove_dir(e.path()).is_ok() {
                        n += 1;
                    }
                    continue;
                }
                let Some(pid) = name
                    .strip_prefix("asb-")
                    .and_then(|r| r.split_once('-'))
                    .and_then(|(p, _)| p.parse::<u32>().ok())
                else {
                    continue;
                };
                if !dead(pid) {
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

    /// Creates the sandbox's cgroup(s) with `limits` (on v1, from an emptied set of a
    /// destroyed sandbox when there is one: see [`Recycled`]).
    pub fn create(&self, name: &str, limits: &Limits) -> io::Result<SandboxCgroup> {
        let mut cg = SandboxCgroup {
            version: CgroupVersion::V1,
            dirs: Vec::new(),
            events: [None, None],
            recycle: None,
        };
        if self.version() == Some(CgroupVersion::V1) {
            cg.recycle = Some(&RECYCLED);
            // A set made under our cgroups (this process may have moved since).
            let set = RECYCLED.sets.lock().ok().and_then(|mut v| {
                let ours = |set: &Vec<(String, PathBuf)>| {
                    set.len() == self.v1.len()
                        && set
                            .iter()
                            .zip(&self.v1)
                            .all(|((c, d), (hc, hp))| c == hc && d.parent() == Some(hp.as_path()))
                };
                let i = v.iter().rposition(ours)?;
                Some(v.swap_remove(i))
            });
            if let Some(set) = set {
                match reuse_v1(&mut cg, set, name, limits) {
                    Ok(()) => {
                        cg.open_events();
                        return Ok(cg);
                    }
                    Err(_) => {
                        // Whatever went wrong, a fresh set (this one goes).
                        cg.remove(Duration::from_millis(200));
                        cg.dirs.clear();
                    }
                }
            }
        }
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
        cg.open_events();
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
            limit_v1(ctrl, &dir, l, false)?;
        }
        Ok(())
    }

    fn create_v2(&self, cg: &mut SandboxCgroup, name: &str, l: &Limits) -> io::Result<()> {
        let parent = self
            .v2
            .as_ref()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let dir = parent.join(name);
        mkdir(&dir)?;
        cg.dirs.push(("unified".into(), dir.clone()));
        limit_v2(&dir, l, !self.v2_without_limits)
    }
}

/// Writes `l` to a v2 sandbox cgroup `dir`: `memory.max`, `pids.max` (required when
/// `mem_pids`: a missing file means the controller is not enabled for it, see
/// [`delegate_v2`]; else written where present), and where the host has them,
/// `memory.swap.max` = 0 and the `cpu.max` quota.
fn limit_v2(dir: &Path, l: &Limits, mem_pids: bool) -> io::Result<()> {
    let d = DirFd::open(dir)?;
    let optional = |r: io::Result<()>| match r {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    };
    let required = |r: io::Result<()>| if mem_pids { r } else { optional(r) };
    required(d.write("memory.max", &l.memory_bytes.to_string()))?;
    required(d.write("pids.max", &pids_max(l).to_string()))?;
    // No swap controller (no swap accounting): nothing to keep out of swap through it.
    optional(d.write("memory.swap.max", "0"))?;
    let period = 100_000u64;
    let quota = (u64::from(l.cpu_millis) * period / 1000).max(1000);
    optional(d.write("cpu.max", &format!("{quota} {period}")))
}

/// The v2 cgroup this process made ready for sandbox cgroups, and how ([`delegate_v2`]).
static DELEGATED: std::sync::Mutex<Option<(PathBuf, Delegation)>> = std::sync::Mutex::new(None);

/// Controllers a v2 sandbox cgroup must have.
const V2_REQUIRED: &[&str] = &["memory", "pids"];
/// Controllers a v2 sandbox cgroup gets where the host offers them.
const V2_OPTIONAL: &[&str] = &["cpu"];
/// Name prefix of the leaf cgroup a process moves itself into on v2 ([`delegate_v2`]).
const SELF_LEAF_PREFIX: &str = "asb-self-";

/// The leaf cgroup's name for process `pid` (see [`delegate_v2`]).
fn self_leaf_name(pid: u32) -> String {
    format!("{SELF_LEAF_PREFIX}{pid}")
}

/// What [`delegate_v2`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Delegation {
    /// The controllers were already enabled for the cgroup's children.
    Ready,
    /// We enabled them (the cgroup is the hierarchy's root or held no process).
    Enabled,
    /// The cgroup held this process and nothing else: the process moved into this leaf
    /// of its own (`asb-self-<pid>`) first, then the controllers were enabled.
    MovedInto(PathBuf),
}

/// Makes v2 cgroup `dir` (process `me`'s own, or its parent when `me` already sits in its
/// `asb-self-<pid>` leaf) able to have children with the `required` controllers (and those
/// of `optional` that `dir` is offered), by writing them to its `cgroup.subtree_control`.
///
/// cgroup v2 lets a cgroup other than the root either hold processes or enable controllers
/// for its children, not both (the "no internal processes" rule). When `dir` holds `me`
/// alone, `me` moves into a leaf of its own, `dir/asb-self-<me>` (its limits still count,
/// the leaf being inside `dir`; the process's later children start there too), then the
/// controllers are enabled. When `dir` holds other processes too, nothing is moved (they
/// are not ours) and the error says how to start the process in a cgroup of its own.
pub(crate) fn delegate_v2(
    dir: &Path,
    required: &[&str],
    optional: &[&str],
    me: u32,
) -> Result<Delegation, String> {
    let read = |f: &str| {
        fs::read_to_string(dir.join(f)).map_err(|e| format!("read {}: {e}", dir.join(f).display()))
    };
    let offered = read("cgroup.controllers")?;
    let offered: Vec<&str> = offered.split_whitespace().collect();
    let missing: Vec<&str> = required
        .iter()
        .filter(|c| !offered.contains(c))
        .copied()
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "cgroup v2: {} is not offered the {} controller(s) (its cgroup.controllers: {:?}); \
             enable them in its parent's cgroup.subtree_control",
            dir.display(),
            missing.join(", "),
            offered.join(" ")
        ));
    }
    let want: Vec<&str> = required
        .iter()
        .chain(optional.iter().filter(|c| offered.contains(c)))
        .copied()
        .collect();
    let enabled = read("cgroup.subtree_control")?;
    if want
        .iter()
        .all(|c| enabled.split_whitespace().any(|x| x == *c))
    {
        return Ok(Delegation::Ready);
    }
    let line = want
        .iter()
        .map(|c| format!("+{c}"))
        .collect::<Vec<_>>()
        .join(" ");
    let enable = || fs::write(dir.join("cgroup.subtree_control"), &line);
    let busy = match enable() {
        Ok(()) => return Ok(Delegation::Enabled),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => e,
        Err(e) => {
            return Err(format!(
                "cgroup v2: enable {line} in {}: {e}",
                dir.join("cgroup.subtree_control").display()
            ))
        }
    };
    let procs = read("cgroup.procs")?;
    let others: Vec<&str> = procs
        .split_whitespace()
        .filter(|p| p.parse::<u32>().ok() != Some(me))
        .collect();
    if !others.is_empty() {
        return Err(format!(
            "cgroup v2: {} holds {} other process(es) (pids {}), and a v2 cgroup that holds \
             processes cannot enable controllers for sandbox cgroups under it ({busy}); start \
             this process in a cgroup of its own, e.g. `systemd-run --scope -p Delegate=yes \
             <command>` (rootless: `systemd-run --user --scope -p Delegate=yes <command>`)",
            dir.display(),
            others.len(),
            others
                .iter()
                .take(5)
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let leaf = dir.join(self_leaf_name(me));
    match fs::create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cgroup v2: mkdir {}: {e}", leaf.display())),
    }
    if let Err(e) = fs::write(leaf.join("cgroup.procs"), me.to_string()) {
        let _ = fs::remove_dir(&leaf);
        return Err(format!(
            "cgroup v2: move this process into {}: {e}",
            leaf.display()
        ));
    }
    enable().map_err(|e| {
        format!(
            "cgroup v2: enable {line} in {} (this process now in {}): {e}",
            dir.join("cgroup.subtree_control").display(),
            leaf.display()
        )
    })?;
    Ok(Delegation::MovedInto(leaf))
}

/// Removes the kept sets (see [`Recycled`]) as the process exits. Never blocks: a list
/// held by a thread still running then is left to the next backend's sweep.
extern "C" fn remove_kept_at_exit() {
    if let Ok(mut sets) = RECYCLED.sets.try_lock() {
        for set in sets.drain(..) {
            for (_, dir) in set {
                let _ = fs::remove_dir(dir);
            }
        }
    }
}

/// Writes `l` to the v1 controller `ctrl`'s directory `dir`. `reused`: the directory had
/// other limits (a recycled set), so the memory limits are raised out of the way first (v1
/// refuses a memory limit above the memory+swap one, and the reverse).
fn limit_v1(ctrl: &str, dir: &Path, l: &Limits, reused: bool) -> io::Result<()> {
    let at = || DirFd::open(dir);
    match ctrl {
        "memory" => {
            let d = at()?;
            let mem = l.memory_bytes.to_string();
            if reused {
                match d.write("memory.memsw.limit_in_bytes", "-1") {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
            d.write("memory.limit_in_bytes", &mem)?;
            match d.write("memory.memsw.limit_in_bytes", &mem) {
                Ok(()) => {}
                // No swap accounting: keep the sandbox's memory out of swap, if the host
                // has any.
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
    Ok(())
}

/// Takes over an emptied set (see [`Recycled`]): renames each directory to `name` and
/// writes the new limits (everything a new cgroup would have set; its counters, e.g. the
/// OOM-kill count, carry on, which is fine: execs compare them before and after).
fn reuse_v1(
    cg: &mut SandboxCgroup,
    set: Vec<(String, PathBuf)>,
    name: &str,
    l: &Limits,
) -> io::Result<()> {
    for (i, (ctrl, old)) in set.iter().enumerate() {
        let Some(parent) = old.parent() else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        let dir = parent.join(name);
        if let Err(e) = fs::rename(old, &dir) {
            // This one and the rest keep their free names: remove those too.
            cg.dirs.extend(set[i..].iter().cloned());
            return Err(e);
        }
        cg.dirs.push((ctrl.clone(), dir));
    }
    for (ctrl, dir) in &cg.dirs {
        limit_v1(ctrl, dir, l, true)?;
    }
    Ok(())
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
    /// Where [`SandboxCgroup::release`] may give the directories back (v1).
    recycle: Option<&'static Recycled>,
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
                    let ev = fs::read_to_string(d.join("cgroup.events"))?;
                    if ev.lines().any(|l| l.trim() == want) {
                        return Ok(());
                    }
                    if Instant::now() > deadline {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("cgroup.events still not `{want}` after 5 s"),
                        ));
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
    }

    fn open_events(&mut self) {
        let (oom, pids) = self.event_files();
        self.events = [oom, pids].map(|p| p.and_then(|p| fs::File::open(p).ok()));
    }

    /// At destroy, once the sandbox's processes are gone: gives the directories back for
    /// the next sandbox (see [`Recycled`]) when they are v1, empty (no process, no child
    /// cgroup), thawed, with at most [`RECYCLE_MAX_CHARGE`] of memory still charged, and
    /// fewer than [`RECYCLE_MAX`] sets are kept; else removes them ([`Self::remove`]).
    /// Returns the directories that could not be removed.
    pub fn release(&self, patience: Duration) -> Vec<PathBuf> {
        match &self.recycle {
            Some(pool) if self.reusable() => {
                let mut sets = match pool.sets.lock() {
                    Ok(s) => s,
                    Err(_) => return self.remove(patience),
                };
                if sets.len() >= RECYCLE_MAX {
                    drop(sets);
                    return self.remove(patience);
                }
                let n = pool.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let free = format!("asb-{}-free-{n}", std::process::id());
                let mut set = Vec::new();
                for (i, (ctrl, dir)) in self.dirs.iter().enumerate() {
                    let to = dir.with_file_name(&free);
                    if fs::rename(dir, &to).is_err() {
                        // Remove what was renamed, and the rest where it is.
                        drop(sets);
                        set.extend(self.dirs[i..].iter().cloned());
                        return SandboxCgroup {
                            version: self.version,
                            dirs: set,
                            events: [None, None],
                            recycle: None,
                        }
                        .remove(patience);
                    }
                    set.push((ctrl.clone(), to));
                }
                sets.push(set);
                // Kept sets go when the process exits normally (one that is killed leaves
                // them to the next backend's sweep, like its sandboxes' cgroups).
                static AT_EXIT: std::sync::Once = std::sync::Once::new();
                // SAFETY: registers a plain `extern "C"` function with atexit(3).
                AT_EXIT.call_once(|| unsafe {
                    libc::atexit(remove_kept_at_exit);
                });
                Vec::new()
            }
            _ => self.remove(patience),
        }
    }

    /// Whether the directories can serve another sandbox (see [`Self::release`]).
    fn reusable(&self) -> bool {
        if self.version != CgroupVersion::V1 {
            return false;
        }
        self.dirs.iter().all(|(ctrl, dir)| {
            let empty = fs::read_to_string(dir.join("cgroup.procs"))
                .is_ok_and(|s| s.trim().is_empty())
                && fs::read_dir(dir).is_ok_and(|rd| {
                    !rd.flatten()
                        .any(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                });
            empty
                && match ctrl.as_str() {
                    "memory" => fs::read_to_string(dir.join("memory.usage_in_bytes"))
                        .ok()
                        .and_then(|s| s.trim().parse::<u64>().ok())
                        .is_some_and(|u| u <= RECYCLE_MAX_CHARGE),
                    "freezer" => fs::read_to_string(dir.join("freezer.state"))
                        .is_ok_and(|s| s.trim() == "THAWED"),
                    _ => true,
                }
        })
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

/// SIGKILLs every process listed in `dir/cgroup.procs` until it is empty (bounded). On v2
/// (5.14+) `cgroup.kill` first kills the whole cgroup at once, forks in flight included.
pub(crate) fn kill_procs(dir: &Path) -> bool {
    if let Ok(mut f) = fs::OpenOptions::new()
        .write(true)
        .open(dir.join("cgroup.kill"))
    {
        use std::io::Write;
        let _ = f.write_all(b"1");
    }
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

    /// `mountinfo` lines of cgroup mounts: (mount point, fstype, super options).
    fn mountinfo(mounts: &[(&str, &str, &str)]) -> String {
        mounts
            .iter()
            .enumerate()
            .map(|(i, (at, t, o))| {
                format!(
                    "{} 25 0:{i} / {at} rw,nosuid,nodev shared:{i} - {t} {t} {o}\n",
                    30 + i
                )
            })
            .collect()
    }

    #[test]
    fn detects_a_hybrid_host_as_v1_under_the_callers_cgroups() {
        // This machine's layout: v1 controllers, and a unified hierarchy offering hugetlb.
        let me = "9:name=systemd:/\n8:pids:/\n6:freezer:/\n4:memory:/process_api/abc\n\
                  1:cpu,cpuacct:/\n0::/\n";
        let mi = mountinfo(&[
            ("/sys/fs/cgroup/unified", "cgroup2", "rw,nsdelegate"),
            ("/sys/fs/cgroup/pids", "cgroup", "rw,pids"),
            ("/sys/fs/cgroup/freezer", "cgroup", "rw,freezer"),
            ("/sys/fs/cgroup/memory", "cgroup", "rw,memory"),
            ("/sys/fs/cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct"),
        ]);
        let h = CgroupHost::from_proc(me, &mi, 7, |_| "hugetlb\n".into());
        assert_eq!(h.version(), Some(CgroupVersion::V1));
        let v1: Vec<(&str, &Path)> =
            h.v1.iter()
                .map(|(c, p)| (c.as_str(), p.as_path()))
                .collect();
        assert_eq!(
            v1,
            [
                ("memory", Path::new("/sys/fs/cgroup/memory/process_api/abc")),
                ("pids", Path::new("/sys/fs/cgroup/pids")),
                ("cpu", Path::new("/sys/fs/cgroup/cpu,cpuacct")),
                ("freezer", Path::new("/sys/fs/cgroup/freezer")),
            ]
        );
        assert_eq!(
            h.v2, None,
            "the unified hierarchy has no memory or pids here"
        );
    }

    #[test]
    fn detects_a_unified_host_as_v2_when_it_offers_memory_and_pids() {
        let me = "0::/system.slice/agent.service\n";
        let mi = mountinfo(&[("/sys/fs/cgroup", "cgroup2", "rw,nsdelegate")]);
        let asked = std::cell::RefCell::new(Vec::new());
        let h = CgroupHost::from_proc(me, &mi, 7, |d| {
            asked.borrow_mut().push(d.to_path_buf());
            "cpuset cpu io memory hugetlb pids rdma misc\n".into()
        });
        let dir = PathBuf::from("/sys/fs/cgroup/system.slice/agent.service");
        assert_eq!(h.version(), Some(CgroupVersion::V2));
        assert_eq!(h.v2.as_ref(), Some(&dir));
        assert_eq!(asked.into_inner(), std::slice::from_ref(&dir));
        // Without pids (or memory) there is nothing to limit a sandbox with; the error says
        // what the cgroup is offered.
        let h = CgroupHost::from_proc(me, &mi, 7, |_| "cpu io memory\n".into());
        assert_eq!((h.version(), &h.v2), (None, &None));
        let e = h.usable().unwrap_err();
        assert!(
            e.contains("no usable cgroup hierarchy")
                && e.contains("/sys/fs/cgroup/system.slice/agent.service only [cpu io memory]"),
            "{e}"
        );
        // Already in our own leaf (an earlier backend moved us): sandboxes go beside it.
        let leaf = "0::/system.slice/agent.service/asb-self-4242\n";
        let h = CgroupHost::from_proc(leaf, &mi, 4242, |_| "memory pids\n".into());
        assert_eq!(h.v2.as_ref(), Some(&dir));
        // Another process's leaf name is just a cgroup.
        let h = CgroupHost::from_proc(leaf, &mi, 99, |_| "memory pids\n".into());
        assert_eq!(h.v2, Some(dir.join("asb-self-4242")));
    }

    #[test]
    fn ignores_mounts_of_a_subtree_and_unescapes_mount_points() {
        let me = "4:memory:/a\n8:pids:/a\n";
        let mut mi = mountinfo(&[("/mnt/cg\\040memory", "cgroup", "rw,memory")]);
        // A bind mount of a sub-cgroup (root field not "/") cannot be joined with our path.
        mi.push_str("40 25 0:9 /sub /mnt/pids rw shared:9 - cgroup cgroup rw,pids\n");
        let h = CgroupHost::from_proc(me, &mi, 7, |_| String::new());
        let v1: Vec<(&str, &Path)> =
            h.v1.iter()
                .map(|(c, p)| (c.as_str(), p.as_path()))
                .collect();
        assert_eq!(v1, [("memory", Path::new("/mnt/cg memory/a"))]);
        // Nothing at all: no version, and a reason.
        let h = CgroupHost::from_proc("", "", 7, |_| String::new());
        assert_eq!(h.version(), None);
        assert!(h.usable().is_err());
    }

    #[test]
    fn the_sweep_removes_a_dead_processs_empty_leaf_and_nothing_else() {
        let d = tempfile::tempdir().unwrap();
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        dead.wait().unwrap();
        let me = std::process::id();
        let leaf = |pid: u32| d.path().join(self_leaf_name(pid));
        for pid in [dead_pid, me] {
            fs::create_dir(leaf(pid)).unwrap();
        }
        // A dead process's leaf that is not empty (its other children live on) stays.
        let busy_pid = dead_pid.wrapping_add(1_000_000);
        fs::create_dir(leaf(busy_pid)).unwrap();
        fs::write(leaf(busy_pid).join("cgroup.procs"), "12345\n").unwrap();
        let host = CgroupHost {
            v2: Some(d.path().to_path_buf()),
            ..CgroupHost::default()
        };
        assert_eq!(host.sweep_orphans(), 1);
        assert!(!leaf(dead_pid).exists());
        assert!(leaf(me).exists(), "our own leaf was swept");
        assert!(leaf(busy_pid).exists(), "a populated leaf was swept");
    }

    #[test]
    fn v2_limits_are_written_and_a_missing_controller_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let mut l = Limits::default();
        (l.memory_bytes, l.pids, l.cpu_millis) = (64 << 20, 30, 500);
        // A cgroup with memory and pids but no cpu controller and no swap accounting.
        for f in ["memory.max", "pids.max"] {
            fs::write(d.path().join(f), "").unwrap();
        }
        limit_v2(d.path(), &l, true).unwrap();
        let read = |f: &str| fs::read_to_string(d.path().join(f)).unwrap();
        assert_eq!(read("memory.max"), (64u64 << 20).to_string());
        assert_eq!(
            read("pids.max"),
            "32",
            "the init and its spare supervisor count too"
        );
        assert!(!d.path().join("cpu.max").exists(), "never created");
        // With cpu and swap.
        for f in ["cpu.max", "memory.swap.max"] {
            fs::write(d.path().join(f), "").unwrap();
        }
        limit_v2(d.path(), &l, true).unwrap();
        assert_eq!(read("cpu.max"), "50000 100000");
        assert_eq!(read("memory.swap.max"), "0");
        // No pids controller enabled for it: the error names the file.
        fs::remove_file(d.path().join("pids.max")).unwrap();
        let e = limit_v2(d.path(), &l, true).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains("pids.max"), "{e}");
        // Without limits (`allow_v2_without_limits`): what is there is still written.
        fs::write(d.path().join("memory.max"), "").unwrap();
        l.memory_bytes = 1 << 30;
        limit_v2(d.path(), &l, false).unwrap();
        assert_eq!(read("memory.max"), (1u64 << 30).to_string());
        assert!(!d.path().join("pids.max").exists());
    }

    /// The unified hierarchy's mount point, if this process sits at its root and we are
    /// root, with one controller its root offers (enabled for its children by the caller
    /// if needed): what [`delegate_v2`]'s tests need. `None` says why not.
    fn unified_root() -> Result<(PathBuf, String), String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("needs root".into());
        }
        let mi = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let Some((mnt, _, _)) = cgroup_mounts(&mi)
            .into_iter()
            .find(|(_, t, _)| t == "cgroup2")
        else {
            return Err("no cgroup2 mount".into());
        };
        let me = fs::read_to_string("/proc/self/cgroup").unwrap();
        if !me.lines().any(|l| l == "0::/") {
            return Err("this process is not at the unified hierarchy's root".into());
        }
        let offered = fs::read_to_string(mnt.join("cgroup.controllers")).unwrap();
        match offered.split_whitespace().next() {
            Some(c) => Ok((mnt, c.to_string())),
            None => Err(format!("{} offers no controller", mnt.display())),
        }
    }

    /// [`unified_root`], or `None` after printing why `what` is skipped.
    fn unified_or_skip(what: &str) -> Option<(PathBuf, String)> {
        unified_root()
            .map_err(|why| eprintln!("SKIP: {what} on a real cgroup2 hierarchy: {why}"))
            .ok()
    }

    /// Run in a child process by `delegate_v2_on_the_real_unified_hierarchy`:
    /// joins `AS_TEST_CG`, calls [`delegate_v2`] for controller `AS_TEST_CTRL` twice and
    /// prints both results and its unified cgroup.
    #[test]
    #[ignore = "helper: run in a child process by the delegate_v2 tests"]
    fn delegate_v2_helper() {
        let dir = PathBuf::from(std::env::var_os("AS_TEST_CG").unwrap());
        let ctrl = std::env::var("AS_TEST_CTRL").unwrap();
        let me = std::process::id();
        fs::write(dir.join("cgroup.procs"), me.to_string()).unwrap();
        for round in ["FIRST", "SECOND"] {
            println!(
                "{round} {:?}",
                delegate_v2(&dir, &[&ctrl], &["no-such"], me)
            );
        }
        let cg = fs::read_to_string("/proc/self/cgroup").unwrap();
        println!(
            "CGROUP {}",
            cg.lines().find(|l| l.starts_with("0::")).unwrap()
        );
    }

    /// Runs [`delegate_v2_helper`] in `dir`; returns its output lines by tag.
    fn run_helper(dir: &Path, ctrl: &str) -> std::collections::HashMap<String, String> {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "cgroup::tests::delegate_v2_helper",
                "--ignored",
                "--nocapture",
            ])
            .env("AS_TEST_CG", dir)
            .env("AS_TEST_CTRL", ctrl)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(k, _)| ["FIRST", "SECOND", "CGROUP"].contains(k))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Test cgroups under the unified root, removed (children first) on drop, with the
    /// root's controller switched back off if the test switched it on.
    struct Scratch {
        mnt: PathBuf,
        dirs: Vec<PathBuf>,
        enabled: Option<String>,
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            for d in self.dirs.iter().rev() {
                if let Ok(rd) = fs::read_dir(d) {
                    for e in rd
                        .flatten()
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    {
                        let _ = fs::remove_dir(e.path());
                    }
                }
                let _ = fs::remove_dir(d);
            }
            if let Some(c) = &self.enabled {
                let _ = fs::write(self.mnt.join("cgroup.subtree_control"), format!("-{c}"));
            }
        }
    }

    #[test]
    fn v2_freeze_thaw_kill_and_remove_on_the_real_unified_hierarchy() {
        let Some((mnt, _)) = unified_or_skip("v2 freeze and kill") else {
            return;
        };
        let dir = mnt.join(format!("asb-test-{}-freeze", std::process::id()));
        fs::create_dir(&dir).unwrap();
        let _scratch = Scratch {
            mnt,
            dirs: vec![dir.clone()],
            enabled: None,
        };
        let mut child = std::process::Command::new("sh")
            .args(["-c", "while :; do sleep 0.01; done"])
            .spawn()
            .unwrap();
        fs::write(dir.join("cgroup.procs"), child.id().to_string()).unwrap();
        let cg = SandboxCgroup {
            version: CgroupVersion::V2,
            dirs: vec![("unified".into(), dir.clone())],
            events: [None, None],
            recycle: None,
        };
        assert!(cg.can_freeze());
        let events = || fs::read_to_string(dir.join("cgroup.events")).unwrap();
        cg.freeze(true).unwrap();
        assert!(events().contains("frozen 1"), "{}", events());
        cg.freeze(false).unwrap();
        assert!(events().contains("frozen 0"), "{}", events());
        // The shell and whatever `sleep` it has running go at once.
        assert!(kill_procs(&dir));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert_eq!(fs::read_to_string(dir.join("cgroup.procs")).unwrap(), "");
        assert_eq!(cg.remove(Duration::from_secs(2)), Vec::<PathBuf>::new());
        assert!(!dir.exists());
    }

    #[test]
    fn delegate_v2_on_the_real_unified_hierarchy() {
        let Some((mnt, ctrl)) = unified_or_skip("delegate_v2") else {
            return;
        };
        let mut scratch = Scratch {
            mnt: mnt.clone(),
            dirs: Vec::new(),
            enabled: None,
        };
        let root_on = fs::read_to_string(mnt.join("cgroup.subtree_control")).unwrap();
        if !root_on.split_whitespace().any(|c| c == ctrl) {
            fs::write(mnt.join("cgroup.subtree_control"), format!("+{ctrl}")).unwrap();
            scratch.enabled = Some(ctrl.clone());
        }
        let mk = |scratch: &mut Scratch, tag: &str| {
            let d = mnt.join(format!("asb-test-{}-{tag}", std::process::id()));
            fs::create_dir(&d).unwrap();
            scratch.dirs.push(d.clone());
            d
        };
        let on = |d: &Path| fs::read_to_string(d.join("cgroup.subtree_control")).unwrap();

        // 1. A process alone in its cgroup moves into its own leaf; then the controller is
        //    enabled for the cgroup's children (a second call finds it so).
        let alone = mk(&mut scratch, "alone");
        let out = run_helper(&alone, &ctrl);
        let first = out["FIRST"].clone();
        assert!(
            first.starts_with("Ok(MovedInto(") && first.contains("asb-self-"),
            "{first}"
        );
        assert_eq!(out["SECOND"], "Ok(Ready)");
        let leaf_rel = out["CGROUP"].trim_start_matches("0::").to_string();
        assert!(
            leaf_rel.starts_with(&format!(
                "/{}/asb-self-",
                alone.file_name().unwrap().to_string_lossy()
            )),
            "{leaf_rel}"
        );
        assert!(
            on(&alone).split_whitespace().any(|c| c == ctrl),
            "{}",
            on(&alone)
        );
        // A sandbox cgroup made beside the leaf has the controller's files.
        let sandbox = alone.join("asb-1-sandbox");
        fs::create_dir(&sandbox).unwrap();
        let has_files = fs::read_dir(&sandbox).unwrap().flatten().any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("{ctrl}."))
        });
        assert!(
            has_files,
            "no {ctrl}.* files in a child of a delegated cgroup"
        );

        // 2. A cgroup holding another process too: nothing moves, and the error says why
        //    and what to do.
        let shared = mk(&mut scratch, "shared");
        let mut other = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        fs::write(shared.join("cgroup.procs"), other.id().to_string()).unwrap();
        let out = run_helper(&shared, &ctrl);
        let _ = other.kill();
        let _ = other.wait();
        let first = &out["FIRST"];
        assert!(first.starts_with("Err("), "{first}");
        for needle in [
            "1 other process",
            &other.id().to_string(),
            "systemd-run",
            "Delegate=yes",
        ] {
            assert!(first.contains(needle), "{needle:?} not in {first}");
        }
        assert_eq!(
            out["CGROUP"],
            format!("0::/{}", shared.file_name().unwrap().to_string_lossy()),
            "the helper was moved"
        );
        assert!(
            !on(&shared).contains(&ctrl),
            "enabled anyway: {}",
            on(&shared)
        );

        // 3. An empty cgroup: enabled in place. 4. A controller it is not offered: an error
        //    naming it, nothing written.
        let empty = mk(&mut scratch, "empty");
        assert_eq!(
            delegate_v2(&empty, &[&ctrl], &[], 1),
            Ok(Delegation::Enabled)
        );
        assert_eq!(delegate_v2(&empty, &[&ctrl], &[], 1), Ok(Delegation::Ready));
        let e = delegate_v2(&empty, &["no-such"], &[], 1).unwrap_err();
        assert!(e.contains("not offered the no-such controller"), "{e}");
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
