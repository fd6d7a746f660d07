//! cgroup v2 delegation: making the caller's cgroup able to have sandbox cgroups as
//! children, moving a process that is alone in it into a leaf of its own
//! (`asb-self-<pid>`) when the "no internal processes" rule requires it ([`delegate_v2`]).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::CgroupHost;

/// The v2 cgroup this process made ready for sandbox cgroups, and how ([`delegate_v2`]).
static DELEGATED: std::sync::Mutex<Option<(PathBuf, Delegation)>> = std::sync::Mutex::new(None);

/// Controllers a v2 sandbox cgroup must have.
pub(super) const V2_REQUIRED: &[&str] = &["memory", "pids"];
/// Controllers a v2 sandbox cgroup gets where the host offers them.
const V2_OPTIONAL: &[&str] = &["cpu"];
/// Name prefix of the leaf cgroup a process moves itself into on v2 ([`delegate_v2`]).
pub(super) const SELF_LEAF_PREFIX: &str = "asb-self-";

/// The leaf cgroup's name for process `pid` (see [`delegate_v2`]).
pub(super) fn self_leaf_name(pid: u32) -> String {
    format!("{SELF_LEAF_PREFIX}{pid}")
}

/// Readies the caller's v2 cgroup `dir` for sandbox cgroups, once per process and
/// directory ([`delegate_v2`]: this may move the process into a leaf cgroup of its own);
/// `limits`: the memory and pids controllers are required (else only enabled where
/// offered). Returns what was done.
pub(super) fn delegate_once(dir: &PathBuf, limits: bool) -> Result<Delegation, DelegationError> {
    let mut done = DELEGATED.lock().map_err(|_| DelegationError::Poisoned)?;
    if let Some((d, how)) = done.as_ref() {
        if d == dir {
            return Ok(how.clone());
        }
    }
    // Without limits, what is required elsewhere is only enabled where offered.
    let how = if !limits {
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
    Ok(how)
}

impl CgroupHost {
    /// What [`CgroupHost::usable`] did on v2 so far, without doing anything.
    pub fn delegation(&self) -> Option<Delegation> {
        let done = DELEGATED.lock().ok()?;
        done.as_ref()
            .filter(|(d, _)| Some(d) == self.v2())
            .map(|(_, how)| how.clone())
    }
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

/// Why [`delegate_v2`] could not ready a v2 cgroup for sandbox cgroups.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DelegationError {
    /// An earlier set-up panicked while holding the once-per-process record.
    #[error("cgroup v2 set-up panicked")]
    Poisoned,
    /// A cgroup file could not be read.
    #[error("read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The read's failure.
        #[source]
        source: io::Error,
    },
    /// The cgroup is not offered controllers that are required.
    #[error(
        "cgroup v2: {} is not offered the {} controller(s) (its cgroup.controllers: {offered:?}); \
         enable them in its parent's cgroup.subtree_control",
        dir.display(),
        missing.join(", ")
    )]
    NotOffered {
        /// The cgroup.
        dir: PathBuf,
        /// The required controllers it lacks.
        missing: Vec<String>,
        /// Its `cgroup.controllers`, space-separated.
        offered: String,
    },
    /// Writing `cgroup.subtree_control` failed (not because the cgroup holds processes).
    #[error("cgroup v2: enable {line} in {}: {source}", path.display())]
    Enable {
        /// What was written (`+memory +pids ...`).
        line: String,
        /// The `cgroup.subtree_control` file.
        path: PathBuf,
        /// The write's failure.
        #[source]
        source: io::Error,
    },
    /// The cgroup holds processes other than this one, so nothing was moved.
    #[error(
        "cgroup v2: {} holds {} other process(es) (pids {}), and a v2 cgroup that holds \
         processes cannot enable controllers for sandbox cgroups under it ({source}); start \
         this process in a cgroup of its own, e.g. `systemd-run --scope -p Delegate=yes \
         <command>` (rootless: `systemd-run --user --scope -p Delegate=yes <command>`)",
        dir.display(),
        others.len(),
        others.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
    )]
    Occupied {
        /// The cgroup.
        dir: PathBuf,
        /// The other processes' pids.
        others: Vec<String>,
        /// The `EBUSY` enabling the controllers got.
        #[source]
        source: io::Error,
    },
    /// The process's own leaf cgroup could not be made.
    #[error("cgroup v2: mkdir {}: {source}", leaf.display())]
    MakeLeaf {
        /// The leaf.
        leaf: PathBuf,
        /// The `mkdir` failure.
        #[source]
        source: io::Error,
    },
    /// The process could not move into its own leaf.
    #[error("cgroup v2: move this process into {}: {source}", leaf.display())]
    MoveInto {
        /// The leaf.
        leaf: PathBuf,
        /// The write's failure.
        #[source]
        source: io::Error,
    },
    /// Enabling the controllers failed after the process moved into its leaf.
    #[error(
        "cgroup v2: enable {line} in {} (this process now in {}): {source}",
        path.display(),
        leaf.display()
    )]
    EnableAfterMove {
        /// What was written.
        line: String,
        /// The `cgroup.subtree_control` file.
        path: PathBuf,
        /// The leaf the process is in now.
        leaf: PathBuf,
        /// The write's failure.
        #[source]
        source: io::Error,
    },
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
) -> Result<Delegation, DelegationError> {
    let read = |f: &str| {
        fs::read_to_string(dir.join(f)).map_err(|source| DelegationError::Read {
            path: dir.join(f),
            source,
        })
    };
    let offered = read("cgroup.controllers")?;
    let offered: Vec<&str> = offered.split_whitespace().collect();
    let missing: Vec<&str> = required
        .iter()
        .filter(|c| !offered.contains(c))
        .copied()
        .collect();
    if !missing.is_empty() {
        return Err(DelegationError::NotOffered {
            dir: dir.to_path_buf(),
            missing: missing.iter().map(|c| c.to_string()).collect(),
            offered: offered.join(" "),
        });
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
        Err(source) => {
            return Err(DelegationError::Enable {
                line,
                path: dir.join("cgroup.subtree_control"),
                source,
            })
        }
    };
    let procs = read("cgroup.procs")?;
    let others: Vec<&str> = procs
        .split_whitespace()
        .filter(|p| p.parse::<u32>().ok() != Some(me))
        .collect();
    if !others.is_empty() {
        return Err(DelegationError::Occupied {
            dir: dir.to_path_buf(),
            others: others.iter().map(|p| p.to_string()).collect(),
            source: busy,
        });
    }
    let leaf = dir.join(self_leaf_name(me));
    match fs::create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => return Err(DelegationError::MakeLeaf { leaf, source }),
    }
    if let Err(source) = fs::write(leaf.join("cgroup.procs"), me.to_string()) {
        let _ = fs::remove_dir(&leaf);
        return Err(DelegationError::MoveInto { leaf, source });
    }
    if let Err(source) = enable() {
        return Err(DelegationError::EnableAfterMove {
            path: dir.join("cgroup.subtree_control"),
            line,
            leaf,
            source,
        });
    }
    Ok(Delegation::MovedInto(leaf))
}

#[cfg(test)]
mod tests {
    use super::super::testing::{unified_or_skip, Scratch};
    use super::*;

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
                delegate_v2(&dir, &[&ctrl], &["no-such"], me).map_err(|e| e.to_string())
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
                "cgroup::delegation::tests::delegate_v2_helper",
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
            delegate_v2(&empty, &[&ctrl], &[], 1).map_err(|e| e.to_string()),
            Ok(Delegation::Enabled)
        );
        assert_eq!(
            delegate_v2(&empty, &[&ctrl], &[], 1).map_err(|e| e.to_string()),
            Ok(Delegation::Ready)
        );
        let e = delegate_v2(&empty, &["no-such"], &[], 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not offered the no-such controller"), "{e}");
    }
}
