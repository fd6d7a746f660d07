//! Test support shared by the cgroup tests that need this host's real unified hierarchy.

use std::fs;
use std::path::PathBuf;

use super::detect::cgroup_mounts;

/// The unified hierarchy's mount point, if this process sits at its root and we are
/// root, with one controller its root offers (enabled for its children by the caller
/// if needed): what [`super::delegation::delegate_v2`]'s tests need. `None` says why not.
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
pub(super) fn unified_or_skip(what: &str) -> Option<(PathBuf, String)> {
    unified_root()
        .map_err(|why| eprintln!("SKIP: {what} on a real cgroup2 hierarchy: {why}"))
        .ok()
}

/// Test cgroups under the unified root, removed (children first) on drop, with the
/// root's controller switched back off if the test switched it on.
pub(super) struct Scratch {
    pub(super) mnt: PathBuf,
    pub(super) dirs: Vec<PathBuf>,
    pub(super) enabled: Option<String>,
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
