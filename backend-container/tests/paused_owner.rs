//! A sandbox that is paused, or frozen for a snapshot, when the process that owns it is
//! killed: a frozen process acts on no signal (its owner's death included) until it is
//! thawed, so it would stay forever, with its cgroups, unless the sweeps judge it by its
//! owner and thaw it. Each test starts the owner as a child process (this binary's ignored
//! helper test), `SIGKILL`s it, checks that the sandbox is still there and frozen, runs one
//! of the sweeps, and checks that the host is as it was before the sandbox existed.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;
#[path = "../../sandbox-core/test-support/ready_child.rs"]
mod ready_child;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use backend_container::ContainerBackend;
use common::{sh_ok, spec};
use sandbox_core::{Backend, Language, Sandbox};

/// The tests of this file one at a time: each builds backends, whose sweeps would otherwise
/// take (and report) another test's leftovers.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The command line of the background command the owner's sandbox runs.
const MARKER: &[u8] = b"sleep\x00876.54321\x00";

/// Run in a child process: creates a sandbox (state records in `AS_TEST_STATE`) with a
/// background command, then, by `AS_TEST_HOW`, pauses it (`pause`) or starts a snapshot of a
/// large workspace and waits until the snapshot has frozen it (`snapshot`); prints
/// `READY <cgroup name>` and waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: run in a child process by the tests of this file"]
async fn paused_owner_child() {
    let state = std::env::var_os("AS_TEST_STATE").expect("AS_TEST_STATE");
    let how = std::env::var("AS_TEST_HOW").expect("AS_TEST_HOW");
    let b = ContainerBackend::builder()
        .state_dir(state)
        .build()
        .unwrap();
    let sb = b.create_container(&spec(Language::Shell)).await.unwrap();
    sh_ok(&sb, "sleep 876.54321 >/dev/null 2>&1 &").await;
    let name = format!("asb-{}-{}", std::process::id(), sb.id());
    match how.as_str() {
        "pause" => sb.pause().await.unwrap(),
        "snapshot" => {
            // Enough to pack that the snapshot keeps the sandbox frozen for a while.
            sh_ok(
                &sb,
                "for i in $(seq 1 400); do head -c 262144 /dev/urandom > f$i; done",
            )
            .await;
            let sb = std::sync::Arc::new(sb);
            let store_dir = tempfile::tempdir().unwrap();
            let store = sandbox_core::ObjectSnapshotStore::local(store_dir.path()).unwrap();
            let s = sb.clone();
            tokio::spawn(async move {
                let _ = s.snapshot(&store).await;
                drop(store_dir);
            });
            let deadline = Instant::now() + Duration::from_secs(20);
            while !frozen(&name) {
                assert!(Instant::now() < deadline, "the snapshot never froze {name}");
                std::thread::sleep(Duration::from_micros(100));
            }
            std::mem::forget(sb);
        }
        other => panic!("AS_TEST_HOW={other}?"),
    }
    println!("READY {name}");
    std::future::pending::<()>().await;
}

/// Cgroup directories (any hierarchy, a few levels deep) whose name starts with `prefix`.
fn cgroups_named(prefix: &str) -> Vec<PathBuf> {
    fn walk(dir: &Path, prefix: &str, depth: usize, out: &mut Vec<PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if e.file_name().to_string_lossy().starts_with(prefix) {
                out.push(e.path());
            } else if depth < 5 {
                walk(&e.path(), prefix, depth + 1, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(Path::new("/sys/fs/cgroup"), prefix, 0, &mut out);
    out
}

/// Whether sandbox cgroup `name` is frozen (v1 freezer `FROZEN`, v2 `cgroup.freeze` 1).
fn frozen(name: &str) -> bool {
    cgroups_named(name).iter().any(|d| {
        std::fs::read_to_string(d.join("freezer.state")).is_ok_and(|s| s.trim() == "FROZEN")
            || std::fs::read_to_string(d.join("cgroup.freeze")).is_ok_and(|s| s.trim() == "1")
    })
}

/// What of owner `owner`'s sandboxes is on this host: processes in their cgroups, the
/// marker command, their cgroups, host mounts naming them, files in the state directory.
fn left_of(owner: u32, state: &Path) -> Vec<String> {
    let tag = format!("asb-{owner}-");
    let mut left = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let cg = std::fs::read_to_string(e.path().join("cgroup")).unwrap_or_default();
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if cg.contains(&tag) || cmd == MARKER {
            left.push(format!(
                "process {pid}: {}",
                String::from_utf8_lossy(&cmd).replace('\0', " ")
            ));
        }
    }
    left.extend(
        cgroups_named(&tag)
            .into_iter()
            .map(|d| format!("cgroup {}", d.display())),
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    left.extend(
        mounts
            .lines()
            .filter(|l| l.contains(&tag))
            .map(|l| format!("mount {l}")),
    );
    left.extend(
        std::fs::read_dir(state)
            .unwrap()
            .flatten()
            .map(|e| format!("state {}", e.path().display())),
    );
    left
}

/// [`left_of`] polled until it is empty or `limit` passed; what is left then.
fn left_after(owner: u32, state: &Path, limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = left_of(owner, state);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts the owner (`how`: see [`paused_owner_child`]) with state directory `state`, kills
/// it once its sandbox is frozen, and checks that the sandbox outlived it, frozen. Returns
/// the owner's pid and the sandbox's cgroup name.
fn kill_a_frozen_owner(how: &str, state: &Path) -> (u32, String) {
    let (mut child, name) = ready_child::start(
        "paused_owner_child",
        &[("AS_TEST_STATE", state), ("AS_TEST_HOW", Path::new(how))],
    );
    let owner = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    // What the owner's death leaves: a frozen sandbox (its processes wait for a thaw that no
    // one will do), its cgroups and its state record.
    assert!(
        frozen(&name),
        "{how}: {name} was not frozen when its owner died"
    );
    let left = left_of(owner, state);
    for what in ["process", "cgroup", "state"] {
        assert!(
            left.iter().any(|l| l.starts_with(what)),
            "{how}: no {what} of the dead owner's frozen sandbox: {left:#?}"
        );
    }
    (owner, name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_thaws_and_removes_a_paused_sandbox_of_a_killed_owner() {
    require_host!();
    let _one = SERIAL.lock().await;
    let state = tempfile::tempdir().unwrap();
    let (owner, name) = kill_a_frozen_owner("pause", state.path());
    // `cleanup` (what `agent-sandbox cleanup` calls): a backend's report, which includes what
    // building it swept.
    let b = ContainerBackend::builder()
        .state_dir(state.path())
        .build()
        .unwrap();
    let report = b.cleanup_stale_report().await.unwrap();
    assert!(report.thawed.contains(&name), "{report:?}");
    assert!(report.removed >= 1, "{report:?}");
    let left = left_after(owner, state.path(), Duration::from_secs(10));
    assert!(left.is_empty(), "left after cleanup: {left:#?}");
    // Nothing more to do, and nothing thawed twice.
    let again = b.cleanup_stale_report().await.unwrap();
    assert!(!again.thawed.contains(&name), "{again:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_backend_thaws_and_removes_a_paused_sandbox_of_a_killed_owner() {
    require_host!();
    let _one = SERIAL.lock().await;
    let state = tempfile::tempdir().unwrap();
    let (owner, _) = kill_a_frozen_owner("pause", state.path());
    // The library's start-up sweep: building a backend (on the same state directory).
    let _b = ContainerBackend::builder()
        .state_dir(state.path())
        .build()
        .unwrap();
    let left = left_after(owner, state.path(), Duration::from_secs(10));
    assert!(left.is_empty(), "left after the start-up sweep: {left:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_frozen_for_a_snapshot_when_its_owner_is_killed_is_removed() {
    require_host!();
    let _one = SERIAL.lock().await;
    let state = tempfile::tempdir().unwrap();
    let (owner, name) = kill_a_frozen_owner("snapshot", state.path());
    let report = ContainerBackend::builder()
        .state_dir(state.path())
        .build()
        .unwrap()
        .cleanup_stale_report()
        .await
        .unwrap();
    assert!(report.thawed.contains(&name), "{report:?}");
    let left = left_after(owner, state.path(), Duration::from_secs(10));
    assert!(left.is_empty(), "left after cleanup: {left:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_of_a_live_owner_is_never_touched() {
    require_host!();
    let _one = SERIAL.lock().await;
    let b = common::backend();
    let sb = b.create_container(&spec(Language::Shell)).await.unwrap();
    sb.pause().await.unwrap();
    let name = format!("asb-{}-{}", std::process::id(), sb.id());
    let report = common::backend().cleanup_stale_report().await.unwrap();
    assert!(!report.thawed.contains(&name), "{report:?}");
    assert!(frozen(&name), "our own paused sandbox was thawed");
    sb.resume().await.unwrap();
    assert_eq!(sh_ok(&sb, "echo ok").await, "ok\n");
    sb.destroy().await.unwrap();
}
