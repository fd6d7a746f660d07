//! Helpers shared by the integration tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use backend_container::ContainerBackend;
use sandbox_core::{
    Backend, ExecRequest, ExecResult, Language, ResolvedSecrets, Sandbox, SandboxSpec,
};

/// Why the suite cannot run here, per the backend's own probe.
pub async fn skip_reason() -> Option<String> {
    let b = match ContainerBackend::builder().build() {
        Ok(b) => b,
        Err(e) => return Some(format!("container backend cannot be built: {e}")),
    };
    let s = b.probe().await;
    if s.available {
        None
    } else {
        Some(format!("{} (fix: {})", s.reason, s.fix.unwrap_or_default()))
    }
}

/// Skips the test (with the reason on stderr) when the host cannot run containers.
#[macro_export]
macro_rules! require_host {
    () => {
        if let Some(why) = common::skip_reason().await {
            eprintln!("SKIP: {why}");
            return;
        }
    };
}

pub fn backend() -> ContainerBackend {
    ContainerBackend::builder().build().unwrap()
}

pub fn spec(lang: Language) -> SandboxSpec {
    SandboxSpec::builder(lang)
        .wall_time(Duration::from_secs(20))
        .build()
        .unwrap()
}

pub async fn create(lang: Language) -> Box<dyn Sandbox> {
    backend()
        .create(&spec(lang), ResolvedSecrets::none())
        .await
        .unwrap()
}

pub async fn sh(sb: &dyn Sandbox, script: &str) -> ExecResult {
    sb.exec(ExecRequest::argv(["/bin/sh", "-c", script]))
        .await
        .unwrap()
}

/// Runs `script` and asserts it succeeded; returns stdout.
pub async fn sh_ok(sb: &dyn Sandbox, script: &str) -> String {
    let r = sh(sb, script).await;
    assert!(
        r.success(),
        "`{script}` failed: {r:?} stderr={}",
        r.stderr_str()
    );
    r.stdout_str()
}

/// Our own cgroup directories (one per v1 controller we use, or the v2 one).
pub fn own_cgroup_dirs() -> Vec<std::path::PathBuf> {
    let me = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut out = Vec::new();
    for line in me.lines() {
        let mut it = line.splitn(3, ':');
        let (_, ctrls, path) = (it.next(), it.next().unwrap_or(""), it.next().unwrap_or(""));
        for c in ["memory", "pids", "cpu", "freezer"] {
            if ctrls.split(',').any(|x| x == c) {
                let base = if c == "cpu" && !std::path::Path::new("/sys/fs/cgroup/cpu").exists() {
                    "/sys/fs/cgroup/cpu,cpuacct".to_string()
                } else {
                    format!("/sys/fs/cgroup/{c}")
                };
                out.push(std::path::PathBuf::from(format!("{base}{path}")));
            }
        }
        if ctrls.is_empty() && out.is_empty() {
            out.push(std::path::PathBuf::from(format!("/sys/fs/cgroup{path}")));
        }
    }
    out
}

/// Number of sandboxes' `asb-*` cgroup directories under our own cgroups (not counting the
/// emptied ones kept for reuse: see [`free_cgroup_dirs`]).
pub fn count_sandbox_cgroups() -> usize {
    own_cgroup_dirs()
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flat_map(|rd| rd.flatten())
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("asb-") && !n.contains("-free-")
        })
        .count()
}

/// Our emptied cgroup directories kept for the next sandboxes (`asb-<our pid>-free-<n>`).
pub fn free_cgroup_dirs() -> Vec<std::path::PathBuf> {
    let prefix = format!("asb-{}-free-", std::process::id());
    own_cgroup_dirs()
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flat_map(|rd| rd.flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect()
}

/// Asserts that the kept cgroup directories hold no process and are at most two sets.
pub fn assert_free_cgroups_are_empty_and_few() {
    let free = free_cgroup_dirs();
    let controllers = own_cgroup_dirs().len().max(1);
    assert!(
        free.len() <= 2 * controllers,
        "too many kept cgroups: {free:?}"
    );
    for d in free {
        let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
        assert!(procs.trim().is_empty(), "{} holds {procs}", d.display());
    }
}

/// Our direct children (zombies included): (pid, command name).
pub fn children() -> Vec<(i32, String)> {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|s| {
            // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
            let (head, tail) = s.split_at(s.rfind(')')?);
            let (pid, comm) = head.split_once(" (")?;
            let ppid = tail[1..].split_whitespace().nth(1)?;
            (ppid == me).then(|| Some((pid.parse().ok()?, comm.to_string())))?
        })
        .collect()
}

/// How many [`children`] we have, not counting the library's spare init: an init still
/// running as our own uid (a sandbox's init runs as a host uid of its range) that the
/// zygote cloned ahead of time and that may or may not exist at a given moment (it is asked
/// for after commands and teardowns). At most one is allowed. In its first microseconds
/// a spare still has the zygote's name: it is told from the zygote by its user namespace.
pub fn count_children() -> usize {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let all = children();
    let spares = all
        .iter()
        .filter(|(p, c)| {
            (c == "asb-init" || (c == "asb-zygote" && !in_our_user_ns(*p)))
                && uid_of(*p) == Some(me)
        })
        .count();
    assert!(spares <= 1, "{spares} spare inits: {all:?}");
    all.len() - spares
}

/// Whether process `pid` is in our user namespace (the zygote is; every init, even one
/// just cloned and still bearing the zygote's name, has its own).
pub fn in_our_user_ns(pid: i32) -> bool {
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/user")).ok();
    let theirs = ns(&pid.to_string());
    theirs.is_some() && theirs == ns("self")
}

/// Our fork servers: children named `asb-zygote` in our user namespace (an init the zygote
/// just cloned bears that name until its first instructions rename it).
pub fn zygotes() -> Vec<i32> {
    children_named("asb-zygote")
        .into_iter()
        .filter(|p| in_our_user_ns(*p))
        .collect()
}

/// The real uid of process `pid` (as the host sees it).
pub fn uid_of(pid: i32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Our children named `comm` (their pids).
pub fn children_named(comm: &str) -> Vec<i32> {
    children()
        .into_iter()
        .filter(|(_, c)| c == comm)
        .map(|(p, _)| p)
        .collect()
}

/// Processes running as a host uid inside `[lo, hi)`.
pub fn count_procs_with_uid_in(lo: u32, hi: u32) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        .filter(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|u| u.parse::<u32>().ok())
                .is_some_and(|u| (lo..hi).contains(&u))
        })
        .count()
}

/// Open fds of this process.
pub fn count_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Our open fds once they are back at `expected` (or after ~2 s): the last sandbox's control
/// socket closes when its reader task sees the init's end close, asynchronously, on a
/// runtime thread.
pub async fn fds_settled_at(expected: usize) -> usize {
    let mut n = count_fds();
    for _ in 0..200 {
        if n == expected {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        n = count_fds();
    }
    n
}

/// Mounts in our mount namespace.
pub fn count_mounts() -> usize {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// Cgroup directories of the sandbox `id` that still exist.
pub fn cgroups_of(id: &str) -> Vec<std::path::PathBuf> {
    own_cgroup_dirs()
        .into_iter()
        .map(|d| d.join(format!("asb-{}-{id}", std::process::id())))
        .filter(|d| d.exists())
        .collect()
}

/// Mount lines of our namespace that mention sandbox internals.
pub fn sandbox_mounts() -> usize {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("newroot") || l.contains("oldroot") || l.contains("/asb-"))
        .count()
}

const APPLETS: &[&str] = &[
    "sh", "ls", "cat", "echo", "touch", "mkdir", "rm", "id", "stat", "grep", "wc", "sleep",
];

/// Why this file cannot run here: the backend's probe, or no static busybox to build a rootfs.
pub async fn rootfs_skip_reason() -> Option<String> {
    if let Some(why) = skip_reason().await {
        return Some(why);
    }
    if !std::path::Path::new("/bin/busybox").exists() {
        return Some("no /bin/busybox (apt-get install busybox-static)".into());
    }
    None
}

/// A tiny root filesystem: `/bin/busybox` and applet links, `/etc/passwd`, `/etc/group`.
pub fn make_rootfs(dir: &std::path::Path) {
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::fs::create_dir_all(dir.join("etc")).unwrap();
    std::fs::create_dir_all(dir.join("opt/keep")).unwrap();
    std::fs::copy("/bin/busybox", dir.join("bin/busybox")).unwrap();
    for a in APPLETS {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(a)).unwrap();
    }
    std::fs::write(dir.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(dir.join("etc/group"), "root:x:0:\n").unwrap();
    std::fs::write(dir.join("opt/keep/data"), "base data\n").unwrap();
}
