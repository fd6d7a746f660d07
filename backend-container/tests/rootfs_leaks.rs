//! Rootfs-directory mode leaves nothing behind: fds, mounts, processes, cgroups (alone in its
//! own test binary, since it counts process-wide resources).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{backend, sh_ok};
use sandbox_core::{Backend, Language, ResolvedSecrets, SandboxSpec};

fn rootfs_spec(root: &std::path::Path) -> SandboxSpec {
    SandboxSpec::builder(Language::Shell)
        .rootfs(root)
        .build()
        .unwrap()
}

#[tokio::test]
async fn rootfs_create_destroy_cycles_leave_nothing_behind() {
    if let Some(why) = common::rootfs_skip_reason().await {
        eprintln!("SKIP: {why}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("rootfs");
    common::make_rootfs(&root);
    let b = backend();
    // Warm up (lazily created process-wide state: the init image, the runtime's threads;
    // after the first create has idmapped the layer, later ones take the zygote's spare
    // init).
    for _ in 0..2 {
        let sb = b
            .create(&rootfs_spec(&root), ResolvedSecrets::none())
            .await
            .unwrap();
        sb.destroy().await.unwrap();
    }
    let (fds, mounts, children, cgroups) = (
        common::count_fds(),
        common::count_mounts(),
        common::count_children(),
        common::count_sandbox_cgroups(),
    );
    for _ in 0..30 {
        let sb = b
            .create(&rootfs_spec(&root), ResolvedSecrets::none())
            .await
            .unwrap();
        sh_ok(sb.as_ref(), "echo x > /etc/x; sleep 100 >/dev/null 2>&1 &").await;
        sb.destroy().await.unwrap();
    }
    // The zygote's spare init (its control socket, received lazily) may or may not be held
    // at either count, so the count may end a couple lower; a leak of even one fd per cycle
    // would end it 30 higher.
    let left = common::fds_settled_at(fds).await;
    assert!(
        left <= fds,
        "fds leaked: {left} after 30 cycles, {fds} before"
    );
    assert_eq!(common::count_mounts(), mounts, "mounts leaked");
    assert_eq!(common::count_children(), children, "processes leaked");
    assert_eq!(common::count_sandbox_cgroups(), cgroups, "cgroups leaked");
    common::assert_free_cgroups_are_empty_and_few();
}
