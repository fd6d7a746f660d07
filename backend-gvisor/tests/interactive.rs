//! Background processes in the gVisor tier: a snapshot is refused while one runs (nothing
//! lost), and destroy leaves nothing of it. (Stdin, output, signals and listing are the conformance
//! cases `caps.processes` and `process.io-signals`.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use sandbox_core::{
    Error, ExecEvent, ExecRequest, Language, ObjectSnapshotStore, ProcessState, SandboxSpec, Signal,
};

/// Counts processes inside whose argv is exactly `sleep 777`.
const COUNT: &str = "n=0; for p in /proc/[0-9]*; do [ \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" = 'sleep 777 ' ] && n=$((n+1)); done; echo $n";

async fn count(sb: &dyn sandbox_core::Sandbox) -> String {
    let r = sb.exec(ExecRequest::code(COUNT)).await.unwrap();
    r.stdout_str().trim().to_string()
}

#[tokio::test]
async fn a_background_process_across_a_snapshot_and_destroy() {
    require_gvisor!();
    let sb = common::sandbox(&SandboxSpec::new(Language::Shell)).await;
    let id = sb.id().to_string();
    let mut p = sb.spawn(ExecRequest::argv(["sleep", "777"])).await.unwrap();
    // It shows inside once runsc has started it.
    let mut n = String::new();
    for _ in 0..100 {
        n = count(sb.as_ref()).await;
        if n == "1" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(n, "1", "the sleep runs inside");
    // A snapshot would checkpoint its host pipes, which runsc cannot restore: refused,
    // and the sandbox and the process go on.
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let e = sb.snapshot(&store).await.unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("sleep 777"), "{e}");
    assert_eq!(count(sb.as_ref()).await, "1");
    let list = sb.processes().await.unwrap();
    assert_eq!((list[0].id, list[0].state), (p.id(), ProcessState::Running));
    sb.signal(p.id(), Signal::Terminate).await.unwrap();
    let r = p.wait(Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(r.exit_code, Some(128 + 15), "{r:?}");
    // With it stopped, the snapshot is taken and the sandbox goes on.
    sb.snapshot(&store).await.unwrap();
    assert_eq!(count(sb.as_ref()).await, "0");

    let mut q = sb.spawn(ExecRequest::argv(["sleep", "777"])).await.unwrap();
    sb.destroy().await.unwrap();
    // Whatever it (or runsc) wrote, then the end: the sandbox is gone.
    loop {
        match q.next().await {
            Some(Ok(ExecEvent::Stdout(_) | ExecEvent::Stderr(_))) => {}
            Some(Err(Error::SandboxGone { .. })) | Some(Ok(ExecEvent::Exit(_))) => break,
            other => panic!("after destroy: {other:?}"),
        }
    }
    assert!(q.next().await.is_none(), "nothing after the end");
    assert_eq!(common::host_processes_of(&id), 0);
    let e = sb.spawn(ExecRequest::argv(["true"])).await.unwrap_err();
    assert!(matches!(e, Error::SandboxGone { .. }), "{e}");
}
