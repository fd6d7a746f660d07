//! The cgroup v2 path end to end on this hybrid host, whose memory and pids controllers are
//! bound to v1 hierarchies: a child process in a mount namespace of its own where the only
//! cgroup mount is the unified hierarchy (the v1 ones are unmounted there),
//! which offers no memory or pids controller. What it shows: detection, the refusal with
//! `require_cgroups` (the default) and its message, and with `require_cgroups(false)` real
//! sandboxes in v2 cgroups: the init joins its own cgroup, the cgroup namespace is rooted
//! there, pause/resume through `cgroup.freeze`, and destroy removes the cgroup with
//! everything in it. What it cannot show here: v2 memory and pids limits.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::path::Path;
use std::process::Command;

use backend_container::{CgroupVersion, ContainerBackend};
use sandbox_core::{Backend, Error, ExecRequest, Language, Sandbox, SandboxSpec};

/// Where the helper mounts the unified hierarchy.
const UNIFIED: &str = "/sys/fs/cgroup/unified";

async fn sh(sb: &dyn Sandbox, script: &str) -> String {
    let r = sb
        .exec(ExecRequest::argv(["/bin/sh", "-c", script]))
        .await
        .unwrap();
    assert!(r.success(), "{script}: {r:?}");
    r.stdout_str().to_string()
}

fn mount(args: &[&str]) {
    let st = Command::new("mount").args(args).status().unwrap();
    assert!(st.success(), "mount {args:?}: {st}");
}

#[tokio::test]
async fn a_host_with_only_cgroup_v2() {
    require_host!();
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP: hiding the v1 hierarchies takes root (mounts)");
        return;
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    if !mounts.contains(" - cgroup2 ") {
        eprintln!("SKIP: this host has no cgroup2 hierarchy");
        return;
    }
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "v2_only_helper", "--ignored", "--nocapture"])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success() && text.contains("V2 OK"), "{text}");
}

/// Run by `a_host_with_only_cgroup_v2` in a mount namespace of its own.
#[tokio::test]
#[ignore = "helper: run in its own mount namespace by a_host_with_only_cgroup_v2"]
async fn v2_only_helper() {
    // Detach every cgroup mount (v1 and v2) of this namespace, then mount the unified
    // hierarchy alone.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for l in mountinfo.lines() {
        let Some((pre, post)) = l.split_once(" - ") else {
            continue;
        };
        if post.starts_with("cgroup ") || post.starts_with("cgroup2 ") {
            let at = pre.split(' ').nth(4).unwrap();
            let st = Command::new("umount").args(["-l", at]).status().unwrap();
            assert!(st.success(), "umount {at}");
        }
    }
    std::fs::create_dir_all(UNIFIED).unwrap();
    mount(&["-t", "cgroup2", "none", UNIFIED]);
    let offered = std::fs::read_to_string(Path::new(UNIFIED).join("cgroup.controllers")).unwrap();
    assert!(
        !offered.contains("memory") && !offered.contains("pids"),
        "this test expects a v2 hierarchy without memory and pids here: {offered}"
    );
    let spec = SandboxSpec::new(Language::Shell);

    // 1. By default a sandbox without memory and pids limits is refused, saying why.
    let strict = ContainerBackend::builder().build().unwrap();
    assert_eq!(strict.cgroup_version(), None);
    let status = strict.probe().await;
    assert!(!status.available);
    assert!(
        status.reason.contains("cgroup v2 offers") && status.reason.contains("memory and pids"),
        "{}",
        status.reason
    );
    match strict.create_container(&spec).await {
        Err(Error::Unavailable { reason, .. }) => assert!(reason.contains("cgroup v2"), "{reason}"),
        other => panic!("expected Unavailable, got {:?}", other.map(|_| "a sandbox")),
    }

    // 2. Without required cgroups: a v2 cgroup without those limits, and the probe says so.
    let b = ContainerBackend::builder()
        .require_cgroups(false)
        .build()
        .unwrap();
    assert_eq!(b.cgroup_version(), Some(CgroupVersion::V2));
    let status = b.probe().await;
    assert!(status.available, "{status:?}");
    let detail = &status.details["cgroup"];
    assert!(
        detail.starts_with("v2") && detail.contains("not enforced"),
        "{detail}"
    );

    let sb = b.create_container(&spec).await.unwrap();
    let id = sb.id().to_string();
    let name = format!("asb-{}-{id}", std::process::id());
    let dir = Path::new(UNIFIED).join(&name);
    assert!(dir.is_dir(), "no cgroup {}", dir.display());
    // The init sits in it (as the host sees it), and inside, the cgroup namespace is rooted
    // there.
    let host_view = std::fs::read_to_string(format!("/proc/{}/cgroup", sb.init_pid())).unwrap();
    assert!(
        host_view.lines().any(|l| l == format!("0::/{name}")),
        "{host_view}"
    );
    assert_eq!(sh(&sb, "grep '^0::' /proc/self/cgroup").await, "0::/\n");
    // Every process of the sandbox is in it: the init, a background one, an exec's.
    sh(&sb, "sleep 1000 >/dev/null 2>&1 &").await;
    let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap();
    assert!(procs.lines().count() >= 2, "{procs}");

    // Pause freezes the whole cgroup; resume thaws it.
    sb.pause().await.unwrap();
    let events = std::fs::read_to_string(dir.join("cgroup.events")).unwrap();
    assert!(events.contains("frozen 1"), "{events}");
    sb.resume().await.unwrap();
    assert_eq!(sh(&sb, "echo thawed").await, "thawed\n");

    // Destroy takes the processes and the cgroup.
    let pids: Vec<String> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    sb.destroy().await.unwrap();
    assert!(!dir.exists(), "cgroup left: {}", dir.display());
    for p in pids {
        assert!(
            !Path::new(&format!("/proc/{p}")).exists(),
            "process {p} left"
        );
    }
    println!("V2 OK");
}
