//! A gVisor sandbox that is paused (`runsc pause`), or being checkpointed for a snapshot,
//! when the process that owns it is killed: the watchdog, `cleanup_stale` and the next
//! process's start-up sweep all remove it, leaving the host as it was before the sandbox
//! existed. runsc (20221219) does not `delete --force` a paused container cleanly (it
//! panics on the `paused => stopped` transition), so the sweeps resume it first.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "../../sandbox-core/test-support/ready_child.rs"]
mod ready_child;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use backend_gvisor::GvisorBackend;
use sandbox_core::{Backend, ExecRequest, Language, ResolvedSecrets, SandboxSpec};

/// The tests of this file one at a time (each kills owners and sweeps).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Run in a child process: creates a sandbox in state directory `AS_TEST_STATE` running a
/// background command, then, by `AS_TEST_HOW`, pauses it (`pause`) or starts a snapshot
/// and waits until its `runsc checkpoint` runs (`checkpoint`); prints `READY <id>` and
/// waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: run in a child process by the tests of this file"]
async fn paused_owner_child() {
    let state = std::env::var_os("AS_TEST_STATE").expect("AS_TEST_STATE");
    let how = std::env::var("AS_TEST_HOW").expect("AS_TEST_HOW");
    let b = GvisorBackend::builder().state_dir(state).build().unwrap();
    let sb = b
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "sleep 1000 >/dev/null 2>&1 &",
        ]))
        .await
        .unwrap();
    assert!(r.success(), "{}", r.stderr_str());
    let id = sb.id().to_string();
    match how.as_str() {
        "pause" => sb.pause().await.unwrap(),
        "checkpoint" => {
            // Memory for the checkpoint to write, so that it runs for a while: a process
            // holding 120 MB of random bytes (its own line once they are made).
            let mut p = sb
                .spawn(ExecRequest::argv([
                    "/usr/bin/python3",
                    "-c",
                    "import os, time; b = os.urandom(120 << 20); print('held', flush=True); time.sleep(1000)",
                ]))
                .await
                .unwrap();
            let mut out = Vec::new();
            while !out.ends_with(b"held\n") {
                match p.next().await {
                    Some(Ok(sandbox_core::ExecEvent::Stdout(b))) => out.extend_from_slice(&b),
                    Some(Ok(sandbox_core::ExecEvent::Stderr(_))) => {}
                    other => panic!("the memory holder ended: {other:?}"),
                }
            }
            // Kept running (dropping the handle does not stop it).
            std::mem::forget(p);
            let sb = std::sync::Arc::new(sb);
            let s = sb.clone();
            tokio::spawn(async move {
                let dir = tempfile::tempdir().unwrap();
                let store = sandbox_core::ObjectSnapshotStore::local(dir.path()).unwrap();
                let _ = s.snapshot(&store).await;
            });
            let deadline = Instant::now() + Duration::from_secs(30);
            while !runsc_running("checkpoint", &id) {
                assert!(Instant::now() < deadline, "no checkpoint of {id} started");
                std::thread::sleep(Duration::from_millis(1));
            }
            // Kept until the process is killed.
            std::mem::forget(sb);
        }
        other => panic!("AS_TEST_HOW={other}?"),
    }
    println!("READY {id}");
    std::future::pending::<()>().await;
}

/// Whether a `runsc ... <verb> ... <id>` process runs.
fn runsc_running(verb: &str, id: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        args.contains(&verb.as_bytes())
            && args.contains(&id.as_bytes())
            && args.first().is_some_and(|a| a.ends_with(b"runsc"))
    })
}

/// What of sandbox `id` (state directory `state`) is on the host: runsc processes, mounts,
/// cgroups, its directory. Empty: nothing.
fn left_of(state: &Path, id: &str) -> Vec<String> {
    let mut left = Vec::new();
    let n = common::host_processes_of(id);
    if n > 0 {
        left.push(format!("{n} processes"));
    }
    if common::mounts_mentioning(id) > 0 {
        left.push("mounts".into());
    }
    left.extend(
        common::cgroups_of(id)
            .into_iter()
            .map(|c| format!("cgroup {c}")),
    );
    if state.join(id).exists() {
        left.push(format!("directory {}", state.join(id).display()));
    }
    left
}

/// [`left_of`] polled until it is empty or `limit` passed.
fn left_after(state: &Path, id: &str, limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = left_of(state, id);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The owner's watchdog (a child of it tagged `asb-gvisor-watchdog`).
fn watchdog_of(owner: u32) -> i32 {
    let found: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok());
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            ppid == Some(owner) && String::from_utf8_lossy(&cmd).contains("asb-gvisor-watchdog")
        })
        .collect();
    assert_eq!(found.len(), 1, "the owner's watchdog: {found:?}");
    found[0]
}

/// A state directory as the tier wants it.
fn state_dir() -> tempfile::TempDir {
    let state = tempfile::tempdir().unwrap();
    std::fs::set_permissions(state.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    state
}

/// Starts the owner (`how`: see [`paused_owner_child`]) and kills it (its watchdog first
/// when `with_watchdog` is false). Returns the sandbox id.
fn kill_owner(how: &str, state: &Path, with_watchdog: bool) -> String {
    // The worst case, as in `adversarial.rs`: we are a child subreaper, so the dead owner's
    // runsc processes become ours, and we never reap what we did not start.
    assert!(backend_gvisor::reaper::ensure_subreaper());
    let (mut child, id) = ready_child::start(
        "paused_owner_child",
        &[("AS_TEST_STATE", state), ("AS_TEST_HOW", Path::new(how))],
    );
    assert!(!left_of(state, &id).is_empty());
    if !with_watchdog {
        let w = watchdog_of(child.id());
        // SAFETY: kills the watchdog found above (a child of our child).
        unsafe { libc::kill(w, libc::SIGKILL) };
    }
    child.kill().unwrap();
    child.wait().unwrap();
    id
}

#[tokio::test]
async fn the_watchdog_removes_a_paused_sandbox_of_a_killed_owner() {
    require_gvisor!();
    let _one = SERIAL.lock().await;
    let state = state_dir();
    let id = kill_owner("pause", state.path(), true);
    let left = left_after(state.path(), &id, Duration::from_secs(30));
    assert!(
        left.is_empty(),
        "30 s after its owner died, {id} left {left:?}"
    );
}

#[tokio::test]
async fn cleanup_resumes_and_removes_a_paused_sandbox_of_a_killed_owner() {
    require_gvisor!();
    let _one = SERIAL.lock().await;
    let state = state_dir();
    let id = kill_owner("pause", state.path(), false);
    // Without its watchdog, the paused sandbox outlives its owner.
    assert!(!left_of(state.path(), &id).is_empty());
    let b = GvisorBackend::builder()
        .state_dir(state.path())
        .build()
        .unwrap();
    let report = b.cleanup_stale_report().unwrap();
    assert_eq!(report.removed, 1, "{report:?}");
    assert_eq!(report.thawed, vec![id.clone()], "{report:?}");
    let left = left_after(state.path(), &id, Duration::from_secs(10));
    assert!(left.is_empty(), "left after cleanup: {left:?}");
}

#[tokio::test]
async fn the_next_process_removes_a_paused_sandbox_of_a_killed_owner() {
    require_gvisor!();
    let _one = SERIAL.lock().await;
    let state = state_dir();
    let id = kill_owner("pause", state.path(), false);
    // The start-up sweep: the first create of a process (here a backend of ours on that
    // state directory) sweeps it in the background.
    let b = GvisorBackend::builder()
        .state_dir(state.path())
        .build()
        .unwrap();
    let live = b
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    let left = left_after(state.path(), &id, Duration::from_secs(30));
    assert!(left.is_empty(), "left after the start-up sweep: {left:?}");
    // Our own sandbox is untouched.
    let r = live.exec(ExecRequest::argv(["/bin/true"])).await.unwrap();
    assert!(r.success());
    live.destroy().await.unwrap();
}

#[tokio::test]
async fn a_sandbox_being_checkpointed_when_its_owner_is_killed_is_removed() {
    require_gvisor!();
    let _one = SERIAL.lock().await;
    let state = state_dir();
    let id = kill_owner("checkpoint", state.path(), false);
    // The checkpoint (a runsc process of its own) may still be running: cleanup deletes the
    // sandbox whatever it does, and whatever it left (a restored copy under the same id
    // included) is gone after another sweep at most.
    let b = GvisorBackend::builder()
        .state_dir(state.path())
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        b.cleanup_stale_report().unwrap();
        let left = left_after(state.path(), &id, Duration::from_secs(5));
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left after cleanup during a checkpoint: {left:?}"
        );
    }
}
