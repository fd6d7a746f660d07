//! Rootfs-directory mode: a small busybox root filesystem built by the test is the lower
//! layer of an overlay; writes go to the sandbox's upper layer, never to the directory, and
//! snapshots carry them.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{backend, sh, sh_ok};
use sandbox_core::{Backend, Language, ObjectSnapshotStore, ResolvedSecrets, SandboxSpec};

/// Everything about a tree that a write could change: path -> (kind, mode, uid, content).
fn fingerprint(dir: &Path) -> BTreeMap<PathBuf, (u32, u32, u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let md = std::fs::symlink_metadata(&p).unwrap();
            let content = if md.is_file() {
                std::fs::read(&p).unwrap()
            } else if md.file_type().is_symlink() {
                std::fs::read_link(&p)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
                    .into_bytes()
            } else {
                stack.push(p.clone());
                Vec::new()
            };
            out.insert(
                p.strip_prefix(dir).unwrap().to_path_buf(),
                (
                    md.mode() & libc::S_IFMT,
                    md.mode() & 0o7777,
                    md.uid(),
                    content,
                ),
            );
        }
    }
    out
}

fn spec(root: &Path) -> SandboxSpec {
    SandboxSpec::builder(Language::Shell)
        .rootfs(root)
        .wall_time(Duration::from_secs(20))
        .build()
        .unwrap()
}

#[tokio::test]
async fn rootfs_directory_is_an_overlay_that_is_never_written() {
    if let Some(why) = common::rootfs_skip_reason().await {
        eprintln!("SKIP: {why}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("rootfs");
    common::make_rootfs(&root);
    let before = fingerprint(&root);
    let b = backend();
    let sb = b
        .create(&spec(&root), ResolvedSecrets::none())
        .await
        .unwrap();

    // Commands come from the directory; the sandbox's root owns its files.
    let out = sh_ok(
        sb.as_ref(),
        "echo hi; id -u; stat -c %u /bin/busybox /etc/passwd",
    )
    .await;
    assert_eq!(out, "hi\n0\n0\n0\n", "files must not look like nobody's");
    // Only the image's tools: no host /usr.
    let r = sh(sb.as_ref(), "ls /usr/bin/python3").await;
    assert_ne!(r.exit_code, Some(0));
    // The same /proc, /dev, /tmp and /workspace as the host-tools view.
    let out = sh_ok(
        sb.as_ref(),
        "pwd; echo t > /tmp/t && cat /tmp/t; echo z > /dev/null && echo dev; ls /proc/1/status",
    )
    .await;
    assert_eq!(out, "/workspace\nt\ndev\n/proc/1/status\n");
    sb.write_file("w.txt", b"ws").await.unwrap();
    assert_eq!(sh_ok(sb.as_ref(), "cat /workspace/w.txt").await, "ws");

    // /proc/mounts shows no host path (overlay layers are relative to the sandbox's scratch).
    let mounts = sh_ok(sb.as_ref(), "cat /proc/mounts").await;
    let host = root.to_string_lossy().into_owned();
    assert!(!mounts.contains(&host), "{mounts}");
    assert!(!mounts.contains(&*tmp.path().to_string_lossy()), "{mounts}");
    let overlay = mounts
        .lines()
        .find(|l| l.starts_with("overlay / "))
        .unwrap_or_else(|| panic!("no overlay root in {mounts}"));
    assert!(
        overlay.contains("lowerdir=lower") && overlay.contains("upperdir=ovl/upper"),
        "{overlay}"
    );

    // Writes to the root go to the upper layer.
    sh_ok(
        sb.as_ref(),
        "echo new > /etc/newfile && echo 'extra:x:5:5::/:/bin/sh' >> /etc/passwd && \
         rm /bin/wc && mkdir -p /opt/made && echo m > /opt/made/f && rm -r /opt/keep && \
         mkdir /opt/keep && echo again > /opt/keep/other",
    )
    .await;
    let out = sh_ok(
        sb.as_ref(),
        "cat /etc/newfile; grep -c . /etc/passwd; ls /bin/wc 2>/dev/null || echo gone; ls /opt/keep",
    )
    .await;
    assert_eq!(out, "new\n2\ngone\nother\n");
    assert_eq!(fingerprint(&root), before, "the base directory was written");
    // A write outside the writable tree still fails (/proc/sys is read-only).
    let r = sh(sb.as_ref(), "echo 1 > /proc/sys/kernel/hostname").await;
    assert_ne!(r.exit_code, Some(0));

    // Snapshot (workspace + upper layer) and restore into a new sandbox.
    let store_dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(store_dir.path()).unwrap();
    let snap = sb.snapshot(&store).await.unwrap();
    sb.destroy().await.unwrap();
    let back = b
        .restore(&store, &snap, ResolvedSecrets::none())
        .await
        .unwrap();
    let out = sh_ok(
        back.as_ref(),
        "cat /etc/newfile; grep -c . /etc/passwd; ls /bin/wc 2>/dev/null || echo gone; \
         ls /opt/keep; cat /opt/made/f; cat /workspace/w.txt; echo; cat /etc/hostname",
    )
    .await;
    assert_eq!(out, "new\n2\ngone\nother\nm\nws\nsandbox\n");
    // The restored sandbox writes on: still never into the base.
    sh_ok(back.as_ref(), "echo more >> /etc/newfile").await;
    back.destroy().await.unwrap();
    assert_eq!(fingerprint(&root), before, "the base directory was written");

    // Two sandboxes on the same base do not see each other's changes.
    let a = b
        .create(&spec(&root), ResolvedSecrets::none())
        .await
        .unwrap();
    let c = b
        .create(&spec(&root), ResolvedSecrets::none())
        .await
        .unwrap();
    sh_ok(a.as_ref(), "echo a > /etc/only-a").await;
    let r = sh(c.as_ref(), "cat /etc/only-a").await;
    assert_ne!(r.exit_code, Some(0));
    a.destroy().await.unwrap();
    c.destroy().await.unwrap();
    assert_eq!(fingerprint(&root), before, "the base directory was written");
}

#[tokio::test]
async fn rootfs_upper_layer_is_capped_by_disk_bytes() {
    if let Some(why) = common::rootfs_skip_reason().await {
        eprintln!("SKIP: {why}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("rootfs");
    common::make_rootfs(&root);
    let spec = SandboxSpec::builder(Language::Shell)
        .rootfs(&root)
        .disk_bytes(4 << 20)
        .build()
        .unwrap();
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sh(
        sb.as_ref(),
        "i=0; while [ $i -lt 64 ]; do cat /bin/busybox >> /etc/big || exit 1; i=$((i+1)); done",
    )
    .await;
    assert_ne!(r.exit_code, Some(0));
    assert_eq!(r.limit, Some(sandbox_core::LimitKind::Disk), "{r:?}");
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn a_missing_rootfs_is_an_invalid_spec() {
    // The spec alone is valid (it may be created on another host); creating it here checks
    // the directory.
    let spec = SandboxSpec::builder(Language::Shell)
        .rootfs("/nonexistent/rootfs")
        .build()
        .unwrap();
    let r = backend().create(&spec, ResolvedSecrets::none()).await;
    match r {
        Err(sandbox_core::Error::InvalidSpec { field, .. }) => assert_eq!(field, "rootfs"),
        Err(e) => panic!("expected InvalidSpec(rootfs), got {e}"),
        Ok(_) => panic!("a sandbox was created on a missing rootfs"),
    }
}
