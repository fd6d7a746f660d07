//! Tearing a sandbox down: the runsc processes and cgroups recorded once its container
//! runs, then killed, deleted and removed with its state directory.

use super::*;

impl Inner {
    /// Finds the runsc processes of this sandbox; returns the sandbox (`boot`) process.
    pub(super) async fn track_processes(&self) -> Option<i32> {
        let needle = format!("--root={}", self.runsc.root.display());
        let pids = reaper::children_matching(&needle);
        // The sandbox process (`runsc-sandbox ... boot`) carries the container's cgroups.
        let boot = pids.iter().copied().find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| c.split(|b| *b == 0).any(|a| a == b"boot"))
                .unwrap_or(false)
        });
        let cg = match boot {
            Some(pid) => (
                cgroup_of(i64::from(pid), "memory"),
                cgroup_of(i64::from(pid), "pids"),
            ),
            None => (None, None),
        };
        // Recorded whatever panicked before: the teardown needs them.
        *lock(&self.pids) = pids;
        *lock(&self.boot) = boot;
        *lock(&self.cgroup) = cg;
        if let Some(pid) = boot {
            *lock(&self.cgroup_paths) = cgroup_paths(pid);
            *lock(&self.usage_cgroup) =
                super::usage::UsageCgroup::of(pid, &stale::cgroup_name(&self.id));
        }
        boot
    }

    /// Ends the sandbox for `reason` (unless it ended already), deletes the container, reaps
    /// its processes, unmounts and removes the state. Idempotent: the first call tears down,
    /// one made meanwhile waits for it (see [`Lifecycle::release`]).
    pub(super) fn teardown(&self, reason: &str) {
        self.life.release(reason, || {
            self.ports.clear();
            self.watches.close_all();
            self.cleanup();
        });
    }

    /// Deletes the container and removes the host state. Safe to repeat.
    pub(super) fn cleanup(&self) {
        if let Some((e, _)) = &self.egress {
            e.detach_in_background(&self.id);
        }
        self.delete_container();
        stale::unmount_all(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    fn delete_container(&self) {
        self.delete_container_with(true)
    }

    /// [`delete_container`](Self::delete_container) for a container that comes back under
    /// the same id (resume after a checkpoint): runsc's own state for the id must go, so
    /// `runsc delete` always runs (the fast path leaves that state to the removal of the
    /// sandbox's directory, which a resume keeps).
    pub(super) fn delete_container_for_resume(&self) {
        self.delete_container_with(false)
    }

    fn delete_container_with(&self, fast: bool) {
        let pids = lock(&self.pids).clone();
        // The sandbox and gofer processes go first, killed and reaped here: `delete` then
        // finds them gone instead of polling for them every 100 ms (see
        // `reaper::kill_children`); it still removes the cgroups and runsc's state. Bounded:
        // whatever is left is `delete`'s to kill, as before.
        let pids = reaper::kill_children(&pids, Duration::from_secs(2));
        // Reaped: the pid is no longer ours to judge liveness by (a resume records anew).
        *lock(&self.boot) = None;
        // With them gone, what `delete` would still do is remove the sandbox's cgroups and
        // runsc's state (under `self.dir`, removed with it): done here when every cgroup
        // directory named after the sandbox goes at once (~20 ms of a runsc start saved);
        // anything else (a process left, a directory that will not go) is `delete`'s.
        if fast && pids.is_empty() && self.remove_cgroups() {
            return;
        }
        let mut cmd = self.runsc.command();
        cmd.args(["delete", "--force", &self.id])
            .stderr(Stdio::null());
        match cmd.spawn() {
            Ok(mut child) => {
                reaper::reap_while(&pids, Duration::from_secs(20), || {
                    matches!(child.try_wait(), Ok(Some(_)) | Err(_))
                });
                let _ = child.wait();
            }
            Err(e) => {
                tracing::warn!(sandbox = %self.id, error = %e, "runsc delete could not start")
            }
        }
    }

    /// Removes the sandbox's cgroup directories (those of the recorded paths, in every
    /// hierarchy under `/sys/fs/cgroup`, whose name is the sandbox's cgroup name: nothing
    /// else is ever removed). `true` when at least one was found and all of them went.
    fn remove_cgroups(&self) -> bool {
        let paths = lock(&self.cgroup_paths).clone();
        let name = stale::cgroup_name(&self.id);
        let ours: Vec<&String> = paths
            .iter()
            .filter(|p| Path::new(p).file_name().is_some_and(|f| *f == *name))
            .collect();
        if ours.is_empty() {
            return false;
        }
        let base = Path::new("/sys/fs/cgroup");
        let Ok(entries) = std::fs::read_dir(base) else {
            return false;
        };
        // The v2 root itself (a pure v2 host), and each hierarchy's mount under it (v1, and
        // hybrid's `unified`). Co-mounted controllers appear twice (`cpu` -> `cpu,cpuacct`):
        // real directories only.
        let roots = std::iter::once(base.to_path_buf()).chain(
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path()),
        );
        let mut removed = 0;
        for root in roots {
            for p in &ours {
                let dir = root.join(p.trim_start_matches('/'));
                match std::fs::remove_dir(&dir) {
                    Ok(()) => removed += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::debug!(sandbox = %self.id, dir = %dir.display(), error = %e, "cgroup not removed here; runsc delete will");
                        return false;
                    }
                }
            }
        }
        removed > 0
    }
}

/// Every cgroup path of `pid` (one per hierarchy), from `/proc/PID/cgroup`.
fn cgroup_paths(pid: i32) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return Vec::new();
    };
    let mut out: Vec<String> = text
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .map(str::to_string)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The cgroup path of `pid` in the v1 hierarchy that has `controller`.
fn cgroup_of(pid: i64, controller: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        ctrls
            .split(',')
            .any(|c| c == controller)
            .then(|| path.to_string())
    })
}
