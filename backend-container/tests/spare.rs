//! The init cloned ahead of time (the spare): used by the next create, replaced when it
//! died. Its own test binary: it counts this process's children.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::time::{Duration, Instant};

use common::{backend, sh_ok, spec};
use sandbox_core::{Language, Sandbox};

/// Our children named `asb-init` that are not `except`, waited for (bounded) until there
/// are `n`.
fn spares(n: usize, except: &[i32]) -> Vec<i32> {
    let t = Instant::now();
    loop {
        let v: Vec<i32> = common::children_named("asb-init")
            .into_iter()
            .filter(|p| !except.contains(p))
            .collect();
        if v.len() == n || t.elapsed() > Duration::from_secs(5) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[tokio::test]
async fn a_spare_init_serves_the_next_create_and_a_dead_one_is_skipped() {
    require_host!();
    let b = backend();
    // The first create clones its init on demand; its first command asks for a spare.
    let sb = b.create_container(&spec(Language::Shell)).await.unwrap();
    assert_eq!(sh_ok(&sb, "echo 1").await, "1\n");
    let live = sb.init_pid();
    let spare = spares(1, &[live]);
    assert_eq!(spare.len(), 1, "one spare init: {spare:?}");
    // The next create takes it: its init is that very process.
    let next = b.create_container(&spec(Language::Shell)).await.unwrap();
    assert_eq!(next.init_pid(), spare[0]);
    assert_eq!(sh_ok(&next, "echo 2").await, "2\n");
    // It was cloned with its namespaces: its own, not ours, nor another sandbox's.
    let ns = |pid: i32, kind: &str| std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap();
    for kind in ["net", "mnt", "uts", "ipc", "user", "pid"] {
        let own = std::process::id() as i32;
        assert_ne!(ns(next.init_pid(), kind), ns(own, kind), "{kind}");
        assert_ne!(ns(next.init_pid(), kind), ns(live, kind), "{kind}");
    }
    // Its `lo` is up (it brought it up itself while it waited), as in an init cloned on
    // demand (whose `lo` the library brings up).
    let up = "python3 -c \"import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); \
              socket.create_connection(s.getsockname()); print('lo up')\"";
    assert_eq!(sh_ok(&next, up).await, "lo up\n");
    assert_eq!(sh_ok(&sb, up).await, "lo up\n");
    // A spare that died is noticed, reaped and replaced by an on-demand clone.
    let spare = spares(1, &[live, next.init_pid()]);
    assert_eq!(spare.len(), 1, "{spare:?}");
    // SAFETY: kills our own child.
    unsafe {
        libc::kill(spare[0], libc::SIGKILL);
    }
    let third = b.create_container(&spec(Language::Shell)).await.unwrap();
    assert_ne!(third.init_pid(), spare[0]);
    assert_eq!(sh_ok(&third, "echo 3").await, "3\n");
    assert!(
        !common::children().iter().any(|(p, _)| *p == spare[0]),
        "the dead spare was not reaped"
    );
    // A spare copies the zygote's mount namespace as it is cloned, so it lacks templates
    // built after that: a create needing such a template must not use it.
    let spare = spares(1, &[live, next.init_pid(), third.init_pid()]);
    assert_eq!(spare.len(), 1, "{spare:?}");
    let late = backend_container::ContainerBackend::builder()
        .hostname("late-template")
        .build()
        .unwrap();
    let fourth = late.create_container(&spec(Language::Shell)).await.unwrap();
    assert_eq!(sh_ok(&fourth, "hostname").await, "late-template\n");
    if nix::unistd::geteuid().is_root() {
        // As root it set up from the new template, in an init cloned after it was built.
        assert_ne!(fourth.init_pid(), spare[0]);
    }
    for s in [
        sb.destroy().await,
        next.destroy().await,
        third.destroy().await,
        fourth.destroy().await,
    ] {
        s.unwrap();
    }
}
