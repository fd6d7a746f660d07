//! A create that fails after its init was told to start (the setup cannot be planned: here
//! the workspace directory vanished after the spec was built) gives everything back. Its own
//! test binary: it counts this process's children and cgroups.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{backend, sh_ok, spec};
use sandbox_core::{Backend, Error, Language, ResolvedSecrets, Sandbox, SandboxSpec};

#[tokio::test]
async fn a_create_failing_after_its_init_started_leaves_nothing_behind() {
    require_host!();
    let b = backend();
    // Warm up: the zygote (and a spare init) exist from here on.
    let sb = b.create_container(&spec(Language::Shell)).await.unwrap();
    assert_eq!(sh_ok(&sb, "echo ok").await, "ok\n");
    sb.destroy().await.unwrap();
    let (children, cgroups) = (common::count_children(), common::count_sandbox_cgroups());
    for _ in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        let gone = SandboxSpec::builder(Language::Shell)
            .workspace_dir(dir.path(), false)
            .build()
            .unwrap();
        drop(dir);
        let r = b.create(&gone, ResolvedSecrets::none()).await;
        match r {
            Err(Error::InvalidSpec { .. }) => {}
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("created with a vanished workspace"),
        }
    }
    assert_eq!(common::count_sandbox_cgroups(), cgroups, "cgroups left");
    common::assert_free_cgroups_are_empty_and_few();
    assert_eq!(common::count_children(), children, "processes left");
    // And the backend still works.
    let sb = b.create_container(&spec(Language::Shell)).await.unwrap();
    assert_eq!(sh_ok(&sb, "echo again").await, "again\n");
    sb.destroy().await.unwrap();
}
