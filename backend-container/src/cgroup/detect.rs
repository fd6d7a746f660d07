//! Which cgroup layout the host has: parsed from the texts of `/proc/self/cgroup` and
//! `/proc/self/mountinfo` into one [`Layout`].

use std::fs;
use std::path::{Path, PathBuf};

use super::delegation::{self_leaf_name, V2_REQUIRED};
use super::{CgroupHost, CgroupVersion};

/// The host's cgroup layout as this process sees it: which hierarchy sandboxes use, and
/// where the caller's own cgroups are in it (sandbox cgroups are made under those).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Layout {
    /// No hierarchy with what sandboxes need.
    None {
        /// The caller's cgroup in the unified hierarchy and the controllers it is offered
        /// (space-separated), when there is a unified hierarchy: for the error.
        v2_lacking: Option<(PathBuf, String)>,
    },
    /// Legacy hierarchies, one per controller, with the `memory` or `pids` controller
    /// among them: used even when a unified hierarchy is mounted beside them (a hybrid
    /// host).
    V1 {
        /// Controller (`memory`, `pids`, `cpu`, `freezer`, in that order, those mounted) ->
        /// the caller's cgroup directory in that hierarchy.
        controllers: Vec<(String, PathBuf)>,
        /// The caller's cgroup in a unified hierarchy that offers `memory` and `pids` too:
        /// never used for sandboxes while v1 is, only swept for leftovers.
        unified: Option<PathBuf>,
    },
    /// The unified hierarchy.
    V2 {
        /// The caller's cgroup directory (the parent of its own `asb-self-<pid>` leaf when
        /// it already sits in one: see [`super::delegation`]).
        dir: PathBuf,
        /// Whether sandboxes get the memory and pids limits: `false` when the hierarchy
        /// does not offer them and is used anyway (see
        /// [`CgroupHost::allow_v2_without_limits`]).
        limits: bool,
    },
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
pub(super) fn cgroup_mounts(mountinfo: &str) -> Vec<(PathBuf, String, String)> {
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
        let mut v1 = Vec::new();
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
            v1.push((want.to_string(), join_rel(mnt, rel)));
        }
        if v1.iter().all(|(c, _)| c != "memory" && c != "pids") {
            v1.clear();
        }
        // The caller's unified cgroup: with what sandboxes need, or what it is offered.
        let mut v2 = None;
        if let (Some((_, rel)), Some((mnt, _, _))) = (
            me.iter().find(|(c, _)| c.is_empty()),
            mounts.iter().find(|(_, t, _)| t == "cgroup2"),
        ) {
            let mut dir = join_rel(mnt, rel);
            // Already moved into our own leaf (see [`super::delegation`]) by an earlier backend:
            // sandboxes go beside it, under the cgroup we came from.
            if dir.file_name() == Some(std::ffi::OsStr::new(&self_leaf_name(pid))) {
                if let Some(parent) = dir.parent() {
                    dir = parent.to_path_buf();
                }
            }
            let ctrls = controllers(&dir);
            let has = |c: &str| ctrls.split_whitespace().any(|x| x == c);
            v2 = Some(if V2_REQUIRED.iter().all(|c| has(c)) {
                Ok(dir)
            } else {
                Err((dir, ctrls.split_whitespace().collect::<Vec<_>>().join(" ")))
            });
        }
        let layout = match (v1.is_empty(), v2) {
            (false, v2) => Layout::V1 {
                controllers: v1,
                unified: v2.and_then(Result::ok),
            },
            (true, Some(Ok(dir))) => Layout::V2 { dir, limits: true },
            (true, v2) => Layout::None {
                v2_lacking: v2.and_then(Result::err),
            },
        };
        CgroupHost { layout }
    }

    /// With `require_cgroups(false)`, on a host whose only hierarchy is a v2 one that does
    /// not offer memory and pids: sandboxes still get a v2 cgroup (one group to freeze for
    /// pause/resume and to kill at once, `cpu.max` where offered), without memory or pids
    /// limits, rather than none at all.
    pub fn allow_v2_without_limits(&mut self) {
        if let Layout::None {
            v2_lacking: Some((dir, _)),
        } = &self.layout
        {
            self.layout = Layout::V2 {
                dir: dir.clone(),
                limits: false,
            };
        }
    }

    /// The version we use: v1 when its memory or pids controller exists, else v2.
    pub fn version(&self) -> Option<CgroupVersion> {
        match self.layout {
            Layout::V1 { .. } => Some(CgroupVersion::V1),
            Layout::V2 { .. } => Some(CgroupVersion::V2),
            Layout::None { .. } => None,
        }
    }

    /// v1: controller -> the caller's cgroup directory in its hierarchy (empty unless v1 is
    /// used).
    pub fn v1(&self) -> &[(String, PathBuf)] {
        match &self.layout {
            Layout::V1 { controllers, .. } => controllers,
            _ => &[],
        }
    }

    /// The caller's cgroup directory in a unified hierarchy that has what sandboxes need
    /// (or is used without limits): the one v2 uses, or beside v1 the one only swept.
    pub fn v2(&self) -> Option<&PathBuf> {
        match &self.layout {
            Layout::V1 { unified, .. } => unified.as_ref(),
            Layout::V2 { dir, .. } => Some(dir),
            Layout::None { .. } => None,
        }
    }

    /// Whether v2 is used without the memory and pids controllers (see
    /// [`CgroupHost::allow_v2_without_limits`]): no memory or pids limit is written.
    pub fn v2_without_limits(&self) -> bool {
        matches!(self.layout, Layout::V2 { limits: false, .. })
    }
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
        let v1: Vec<(&str, &Path)> = h
            .v1()
            .iter()
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
            h.v2(),
            None,
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
        assert_eq!(h.v2(), Some(&dir));
        assert_eq!(asked.into_inner(), std::slice::from_ref(&dir));
        // Without pids (or memory) there is nothing to limit a sandbox with; the error says
        // what the cgroup is offered.
        let h = CgroupHost::from_proc(me, &mi, 7, |_| "cpu io memory\n".into());
        assert_eq!((h.version(), h.v2()), (None, None));
        let e = h.usable().unwrap_err().to_string();
        assert!(
            e.contains("no usable cgroup hierarchy")
                && e.contains("/sys/fs/cgroup/system.slice/agent.service only [cpu io memory]"),
            "{e}"
        );
        // Already in our own leaf (an earlier backend moved us): sandboxes go beside it.
        let leaf = "0::/system.slice/agent.service/asb-self-4242\n";
        let h = CgroupHost::from_proc(leaf, &mi, 4242, |_| "memory pids\n".into());
        assert_eq!(h.v2(), Some(&dir));
        // Another process's leaf name is just a cgroup.
        let h = CgroupHost::from_proc(leaf, &mi, 99, |_| "memory pids\n".into());
        assert_eq!(h.v2(), Some(&dir.join("asb-self-4242")));
    }

    #[test]
    fn ignores_mounts_of_a_subtree_and_unescapes_mount_points() {
        let me = "4:memory:/a\n8:pids:/a\n";
        let mut mi = mountinfo(&[("/mnt/cg\\040memory", "cgroup", "rw,memory")]);
        // A bind mount of a sub-cgroup (root field not "/") cannot be joined with our path.
        mi.push_str("40 25 0:9 /sub /mnt/pids rw shared:9 - cgroup cgroup rw,pids\n");
        let h = CgroupHost::from_proc(me, &mi, 7, |_| String::new());
        let v1: Vec<(&str, &Path)> = h
            .v1()
            .iter()
            .map(|(c, p)| (c.as_str(), p.as_path()))
            .collect();
        assert_eq!(v1, [("memory", Path::new("/mnt/cg memory/a"))]);
        // Nothing at all: no version, and a reason.
        let h = CgroupHost::from_proc("", "", 7, |_| String::new());
        assert_eq!(h.version(), None);
        assert!(h.usable().is_err());
    }
}
