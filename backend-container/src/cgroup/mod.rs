//! Cgroups for sandboxes: v1 (one directory per controller) or v2 (one directory).
//!
//! The sandbox's cgroup is created **under the caller's own cgroup** (from
//! `/proc/self/cgroup`), uniquely named `asb-<pid>-<id>`, and removed on destroy (on v1,
//! kept for the next sandbox when it can be: see [`v1::Recycled`]). By concern:
//!
//! - [`detect`]: the host's cgroup [`Layout`], parsed from `/proc` texts;
//! - [`v1`]: one directory per controller, their limits, the freezer, recycled sets;
//! - [`v2`]: one directory, its limits, `cgroup.freeze`;
//! - [`delegation`]: readying the caller's v2 cgroup for sandbox children (its
//!   `asb-self-<pid>` leaf);
//! - [`group`]: one sandbox's cgroup, [`SandboxCgroup`]: joining it, its event counters,
//!   freezing, release;
//! - [`stale`]: the cgroups of sandboxes whose process died without destroying them
//!   (judged by their owner, frozen ones thawed), and their removal.
//!
//! This module holds [`CgroupHost`] (the layout, and what is done with it: the usability
//! check, the sweep of dead processes' cgroups, creating a sandbox's cgroup) and the file
//! helpers the others share.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sandbox_core::sandbox::StaleCleanup;
use sandbox_core::Limits;

mod delegation;
mod detect;
mod group;
pub(crate) mod stale;
#[cfg(test)]
mod testing;
mod v1;
mod v2;

pub(crate) use delegation::{Delegation, DelegationError};
pub(crate) use detect::Layout;
pub(crate) use group::{LimitCounters, SandboxCgroup};

/// Why sandboxes cannot have cgroups on this host ([`CgroupHost::usable`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CgroupError {
    /// cgroup v2 is mounted, but the caller's cgroup is not offered memory and pids.
    #[error(
        "no usable cgroup hierarchy: cgroup v2 offers {} only [{offered}], and sandboxes \
         need memory and pids (enable them in its parent's cgroup.subtree_control)",
        dir.display()
    )]
    V2Lacking {
        /// The caller's v2 cgroup.
        dir: PathBuf,
        /// The controllers it is offered.
        offered: String,
    },
    /// No cgroup hierarchy with the memory and pids controllers.
    #[error("no usable cgroup hierarchy (memory and pids controllers)")]
    NoHierarchy,
    /// A cgroup directory's path holds a NUL byte.
    #[error(transparent)]
    BadPath(#[from] std::ffi::NulError),
    /// The caller cannot create cgroups in one of its cgroup directories.
    #[error("cgroup directory {} is not writable by uid {uid}", dir.display())]
    NotWritable {
        /// The directory.
        dir: PathBuf,
        /// The effective uid.
        uid: nix::unistd::Uid,
        /// The `access(2)` failure (its errno).
        #[source]
        source: io::Error,
    },
    /// Readying the caller's v2 cgroup failed.
    #[error(transparent)]
    Delegation(#[from] DelegationError),
}

/// Which cgroup layout the host has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CgroupVersion {
    /// Legacy hierarchies, one per controller.
    V1,
    /// The unified hierarchy.
    V2,
}

/// Where the caller's cgroups are: the host's [`Layout`], detected once
/// ([`CgroupHost::detect`]).
#[derive(Debug, Clone)]
pub(crate) struct CgroupHost {
    layout: Layout,
}

impl CgroupHost {
    /// Whether we may create child cgroups: the caller's directories are writable and, on
    /// v2, its cgroup can have children with the controllers we need
    /// ([`delegation::delegate_v2`], done once per process; this may move the process into
    /// a leaf cgroup of its own). Returns what was done on v2.
    pub fn usable(&self) -> Result<Option<Delegation>, CgroupError> {
        let dirs: Vec<&PathBuf> = match &self.layout {
            Layout::V1 { controllers, .. } => controllers.iter().map(|(_, p)| p).collect(),
            Layout::V2 { dir, .. } => vec![dir],
            Layout::None { v2_lacking } => {
                return Err(match v2_lacking {
                    Some((dir, offered)) => CgroupError::V2Lacking {
                        dir: dir.clone(),
                        offered: offered.clone(),
                    },
                    None => CgroupError::NoHierarchy,
                })
            }
        };
        for d in &dirs {
            let c = std::ffi::CString::new(d.as_os_str().as_encoded_bytes())?;
            // SAFETY: access(2) on a NUL-terminated path.
            if unsafe { libc::access(c.as_ptr(), libc::W_OK) } != 0 {
                return Err(CgroupError::NotWritable {
                    source: io::Error::last_os_error(),
                    dir: d.to_path_buf(),
                    uid: nix::unistd::geteuid(),
                });
            }
        }
        match &self.layout {
            Layout::V2 { dir, limits } => Ok(Some(delegation::delegate_once(dir, *limits)?)),
            _ => Ok(None),
        }
    }

    /// Removes `asb-<pid>-*` cgroups left by processes that died without destroying their
    /// sandboxes, judged by their owner (see [`stale`]): frozen ones (paused, or frozen for
    /// a snapshot, when their owner died) are thawed so that their processes can be killed.
    /// Returns how many directories were removed and which sandbox cgroups were thawed.
    pub fn sweep_orphans(&self) -> StaleCleanup {
        stale::sweep(
            self.v1()
                .iter()
                .map(|(c, p)| (c.as_str(), p.as_path()))
                .chain(self.v2().map(|p| ("unified", p.as_path()))),
        )
    }

    /// Creates the sandbox's cgroup(s) with `limits` (on v1, from an emptied set of a
    /// destroyed sandbox when there is one: see [`v1::Recycled`]).
    pub fn create(&self, name: &str, limits: &Limits) -> io::Result<SandboxCgroup> {
        let mut cg = SandboxCgroup {
            version: CgroupVersion::V1,
            dirs: Vec::new(),
            recycle: None,
        };
        let r = match &self.layout {
            Layout::V1 { controllers, .. } => v1::create(&mut cg, controllers, name, limits),
            Layout::V2 {
                dir,
                limits: mem_pids,
            } => {
                cg.version = CgroupVersion::V2;
                v2::create(&mut cg, dir, name, limits, *mem_pids)
            }
            Layout::None { .. } => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "no cgroup hierarchy",
            )),
        };
        if let Err(e) = r {
            cg.remove(Duration::from_millis(200));
            return Err(e);
        }
        Ok(cg)
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

#[cfg(test)]
mod tests {
    use super::delegation::self_leaf_name;
    use super::*;

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
            layout: Layout::V2 {
                dir: d.path().to_path_buf(),
                limits: true,
            },
        };
        assert_eq!(host.sweep_orphans().removed, 1);
        assert!(!leaf(dead_pid).exists());
        assert!(leaf(me).exists(), "our own leaf was swept");
        assert!(leaf(busy_pid).exists(), "a populated leaf was swept");
    }
}
