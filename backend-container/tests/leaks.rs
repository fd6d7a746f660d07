//! Create/destroy cycles leave no process, mount, cgroup, fd or namespace behind, and a
//! live sandbox holds few of this process's descriptors.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{sh_ok, spec};
use sandbox_core::{Backend, ExecRequest, Language, ResolvedSecrets};

const CYCLES: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_destroy_cycles_leave_nothing_behind() {
    require_host!();
    // A uid range of our own, so other processes' sandboxes on this host do not count.
    let b = backend_container::ContainerBackend::builder()
        .uid_base(0x5000_0000)
        .build()
        .unwrap();
    let uid_lo = b.config().uid_base;
    let uid_hi = uid_lo.saturating_add(backend_container::SLOTS * 65536);
    // Warm up (the init image memfd is created once per process and kept).
    let sb = b
        .create(&spec(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    sb.destroy().await.unwrap();
    let (children, fds, mounts, cgroups, procs) = (
        common::count_children(),
        common::count_fds(),
        common::count_mounts(),
        common::count_sandbox_cgroups(),
        common::count_procs_with_uid_in(uid_lo, uid_hi),
    );
    for i in 0..CYCLES {
        let sb = b
            .create(&spec(Language::Shell), ResolvedSecrets::none())
            .await
            .unwrap();
        match i % 4 {
            0 => {
                sb.exec(ExecRequest::argv(["true"])).await.unwrap();
            }
            1 => {
                // Background processes and files must go too.
                sh_ok(
                    sb.as_ref(),
                    "sleep 1000 >/dev/null 2>&1 & head -c 100000 /dev/zero > f",
                )
                .await;
            }
            2 => {
                sb.write_file("x", b"y").await.unwrap();
            }
            _ => {}
        }
        if i % 10 == 9 {
            drop(sb); // the Drop path
        } else {
            sb.destroy().await.unwrap();
        }
    }
    assert_eq!(common::count_children(), children, "child processes left");
    let left = common::fds_settled_at(fds).await;
    assert_eq!(left, fds, "fds left open");
    assert_eq!(
        common::count_mounts(),
        mounts,
        "mounts left in our namespace"
    );
    assert_eq!(
        common::count_sandbox_cgroups(),
        cgroups,
        "cgroup directories left"
    );
    common::assert_free_cgroups_are_empty_and_few();
    assert_eq!(
        common::count_procs_with_uid_in(uid_lo, uid_hi),
        procs,
        "sandbox processes left"
    );
    // Namespaces live as long as a process, fd or mount holds them: no sandbox init of ours
    // is left (our children named `asb-init` that run as a host uid of a sandbox range; the
    // library's spare runs as our own uid, see `common::count_children`). Other processes'
    // sandboxes on this host are not our children.
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let inits: Vec<_> = common::children()
        .into_iter()
        .filter(|(p, c)| c == "asb-init" && common::uid_of(*p) != Some(me))
        .collect();
    assert!(inits.is_empty(), "sandbox inits left: {inits:?}");

    // What a live sandbox holds of this process's descriptors, once it has run a command:
    // a host's open-files limit is what stops density first (docs/benchmarks.md, "Density
    // ceilings"). Its init's control socket, its spare supervisor's socket and its uid-range
    // lease; the limit counters' files only while a command runs.
    const LIVE: usize = 16;
    let before = common::fds_settled_at(fds).await;
    let mut live = Vec::new();
    for _ in 0..LIVE {
        let sb = b
            .create(&spec(Language::Shell), ResolvedSecrets::none())
            .await
            .unwrap();
        let r = sb.exec(ExecRequest::argv(["false"])).await.unwrap();
        assert_eq!(r.exit_code, Some(1), "{r:?}");
        live.push(sb);
    }
    let per_sandbox = common::count_fds().saturating_sub(before) as f64 / LIVE as f64;
    assert!(
        per_sandbox <= 3.0,
        "{per_sandbox} descriptors held per idle sandbox (3 expected)"
    );
    for sb in live {
        sb.destroy().await.unwrap();
    }
}
