//! Sandboxes from OCI images: the image's layers are the overlay's lower layers (shared, never
//! written), its config's `Env`, `WorkingDir` and `User` apply under the spec, and snapshots
//! carry the upper layer and find the image again.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use backend_container::{ContainerBackend, ImageStore};
use common::sh_ok;
use sandbox_core::{Backend, Language, ObjectSnapshotStore, ResolvedSecrets, SandboxSpec};
use sha2::{Digest, Sha256};

fn sha(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

/// A tar of the tree at `dir` (links kept as links), with owners as given by `owner`.
fn tar_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}

/// The upper layer: `/opt/keep/data` deleted, `/etc/os` added, a user `app` (1000) with a
/// home it owns, and `/etc/passwd` replaced to define it.
fn upper_layer() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |path: &str, kind: tar::EntryType, mode: u32, uid: u64, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(uid);
        h.set_gid(uid);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, path, data).unwrap();
    };
    add("opt/keep/.wh.data", tar::EntryType::Regular, 0o644, 0, b"");
    add("etc/os", tar::EntryType::Regular, 0o644, 0, b"image-os 7\n");
    add(
        "etc/passwd",
        tar::EntryType::Regular,
        0o644,
        0,
        b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n",
    );
    add(
        "etc/group",
        tar::EntryType::Regular,
        0o644,
        0,
        b"root:x:0:\napp:x:1000:\n",
    );
    add("home/app", tar::EntryType::Directory, 0o755, 1000, b"");
    b.into_inner().unwrap()
}

/// Writes an OCI layout at `dir` with one image per `(tag, user)`.
fn write_layout(dir: &Path, tags: &[(&str, Option<&str>)]) {
    write_layout_with(dir, tags, upper_layer());
}

/// [`write_layout`] with another upper layer.
fn write_layout_with(dir: &Path, tags: &[(&str, Option<&str>)], upper: Vec<u8>) {
    let base = tempfile::tempdir().unwrap();
    common::make_rootfs(base.path());
    let layers = [tar_dir(base.path()), upper];
    std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let blob = |b: &[u8]| {
        let d = sha(b);
        std::fs::write(dir.join("blobs/sha256").join(&d[7..]), b).unwrap();
        d
    };
    let mut descs = Vec::new();
    for l in &layers {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(l).unwrap();
        let gz = e.finish().unwrap();
        descs.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": blob(&gz), "size": gz.len()
        }));
    }
    let mut index = Vec::new();
    for (tag, user) in tags {
        let mut cfg = serde_json::json!({
            "Env": ["PATH=/bin", "FROM_IMAGE=yes", "OVERRIDE=image"],
            "WorkingDir": "/home/app",
        });
        if let Some(u) = user {
            cfg["User"] = serde_json::json!(u);
        }
        let config = serde_json::json!({
            "architecture": "amd64", "os": "linux", "config": cfg,
            "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| sha(l)).collect::<Vec<_>>()},
        })
        .to_string();
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": blob(config.as_bytes()), "size": config.len()},
            "layers": descs,
        })
        .to_string();
        index.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": blob(manifest.as_bytes()), "size": manifest.len(),
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }));
    }
    std::fs::write(
        dir.join("index.json"),
        serde_json::json!({"schemaVersion": 2, "manifests": index}).to_string(),
    )
    .unwrap();
}

struct Fixture {
    tmp: tempfile::TempDir,
    store: ImageStore,
    backend: ContainerBackend,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    write_layout(
        &tmp.path().join("layout"),
        &[("v1", None), ("app", Some("app"))],
    );
    let store = ImageStore::builder(tmp.path().join("cache"))
        .build()
        .unwrap();
    let backend = ContainerBackend::builder()
        .image_store(store.clone())
        .build()
        .unwrap();
    Fixture {
        tmp,
        store,
        backend,
    }
}

impl Fixture {
    fn spec(&self, tag: &str) -> SandboxSpec {
        SandboxSpec::builder(Language::Shell)
            .image(format!(
                "oci:{}:{tag}",
                self.tmp.path().join("layout").display()
            ))
            .env("OVERRIDE", "spec")
            .wall_time(Duration::from_secs(20))
            .build()
            .unwrap()
    }
}

/// Every file under `dir` with its size and mtime (to show the layers are never written).
fn fingerprint(dir: &Path) -> Vec<(String, u64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let md = std::fs::symlink_metadata(e.path()).unwrap();
            if md.is_dir() {
                stack.push(e.path());
            }
            out.push((e.path().display().to_string(), md.len(), md.mtime()));
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn an_image_is_the_root_with_its_config_and_the_layers_stay_untouched() {
    if let Some(why) = common::rootfs_skip_reason().await {
        eprintln!("SKIP: {why}");
        return;
    }
    let f = fixture();
    let spec = f.spec("v1");
    let a = f
        .backend
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let layers = f.store.root().join("layers");
    let before = fingerprint(&layers);

    let out = sh_ok(
        a.as_ref(),
        "cat /etc/os; test -e /opt/keep/data && echo present || echo deleted; \
         echo $FROM_IMAGE $OVERRIDE; pwd; id -u; stat -c %u /bin/busybox",
    )
    .await;
    assert_eq!(out, "image-os 7\ndeleted\nyes spec\n/home/app\n0\n0\n");
    // Writes land in the sandbox's own upper layer.
    sh_ok(a.as_ref(), "echo mine > /etc/new && rm /etc/os && echo ok").await;
    let b = f
        .backend
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let out = sh_ok(
        b.as_ref(),
        "cat /etc/os; test -e /etc/new && echo leaked || echo clean",
    )
    .await;
    assert_eq!(out, "image-os 7\nclean\n");
    assert_eq!(
        fingerprint(&layers),
        before,
        "the shared layers were written"
    );
    // The image is in use while sandboxes hold it.
    assert!(f.store.list().unwrap().iter().all(|i| i.in_use));
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
}

#[tokio::test]
async fn the_image_user_runs_commands() {
    if let Some(why) = common::rootfs_skip_reason().await {
        eprintln!("SKIP: {why}");
        return;
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP: a non-root image user needs a mapped uid range (root)");
        return;
    }
    let f = fixture();
    let sb = f
        .backend
        .create(&f.spec("app"), ResolvedSecrets::none())
        .await
        .unwrap();
    let out = sh_ok(
        sb.as_ref(),
        "id -u; id -g; touch /home/app/x && echo wrote; touch /etc/x 2>/dev/null || echo denied",
    )
    .await;
    assert_eq!(out, "1000\n1000\nwrote\ndenied\n");
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn the_image_user_owns_a_host_directory_workspace() {
    if let Some(why) = common::rootfs_skip_reason().await {
        eprintln!("SKIP: {why}");
        return;
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP: a non-root image user needs a mapped uid range (root)");
        return;
    }
    use std::os::unix::fs::MetadataExt;
    // The image's `User` (app, 1000) runs commands; a workspace owned by uid 1234 on the
    // host is idmapped to it, and what it writes there is 1234's on the host.
    let f = fixture();
    let ws = tempfile::tempdir().unwrap();
    std::os::unix::fs::chown(ws.path(), Some(1234), Some(1234)).unwrap();
    let mut spec = f.spec("app");
    spec.workspace = sandbox_core::Workspace::HostDir {
        path: ws.path().to_path_buf(),
        read_only: false,
    };
    let sb = f
        .backend
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let out = sh_ok(
        sb.as_ref(),
        "id -u; stat -c %u:%g /workspace; mkdir /workspace/d && touch /workspace/d/x && echo ok",
    )
    .await;
    assert_eq!(out, "1000\n1000:1000\nok\n");
    sb.destroy().await.unwrap();
    for p in ["d", "d/x"] {
        let md = std::fs::symlink_metadata(ws.path().join(p)).unwrap();
        assert_eq!((md.uid(), md.gid()), (1234, 1234), "{p}");
    }
}

#[tokio::test]
async fn snapshots_carry_the_upper_layer_and_find_the_image_again() {
    if let Some(why) = common::rootfs_skip_reason().await {
        eprintln!("SKIP: {why}");
        return;
    }
    let f = fixture();
    let snaps = ObjectSnapshotStore::local(f.tmp.path().join("snaps")).unwrap();
    let sb = f
        .backend
        .create(&f.spec("v1"), ResolvedSecrets::none())
        .await
        .unwrap();
    sh_ok(
        sb.as_ref(),
        "echo kept > /etc/new; echo ws > /workspace/w; echo ok",
    )
    .await;
    let id = sb.snapshot(&snaps).await.unwrap();
    sb.destroy().await.unwrap();
    drop(sb);
    // The image leaves the cache entirely; restoring brings it back.
    for i in f.store.list().unwrap() {
        f.store.remove(&i.digest).unwrap();
    }
    assert_eq!(f.store.usage().unwrap(), 0);
    let back = f
        .backend
        .restore(&snaps, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    let out = sh_ok(back.as_ref(), "cat /etc/new /workspace/w /etc/os").await;
    assert_eq!(out, "kept\nws\nimage-os 7\n");
    back.destroy().await.unwrap();
}

#[tokio::test]
async fn code_in_a_language_the_image_lacks_is_a_clear_error() {
    if let Some(why) = common::rootfs_skip_reason().await {
        eprintln!("SKIP: {why}");
        return;
    }
    let f = fixture();
    // The busybox image has `sh` but no python3.
    let spec = SandboxSpec::builder(Language::Python)
        .image(format!("oci:{}:v1", f.tmp.path().join("layout").display()))
        .build()
        .unwrap();
    let sb = f
        .backend
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    match sb.exec(sandbox_core::ExecRequest::code("print(1)")).await {
        Err(sandbox_core::Error::InvalidSpec { field, reason }) => {
            assert_eq!(field, "image");
            assert!(
                reason.contains("no `python3` on its PATH (/bin)"),
                "{reason}"
            );
        }
        other => panic!("expected a clear refusal, got {other:?}"),
    }
    // Commands as argv still run.
    let r = sb
        .exec(sandbox_core::ExecRequest::argv(["echo", "argv works"]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "argv works\n");
    sb.destroy().await.unwrap();
}

/// A hostile image whose files the setup writes (`/etc/hostname`, `/etc/hosts`,
/// `/etc/resolv.conf`) and directories it mounts on (`/tmp`, the workspace alias
/// `/home/user`) are symbolic links to the host's paths (through the old root's mount point
/// and directly): the sandbox still gets its own files, a working `/tmp` and its workspace
/// at the alias, and nothing is created or changed on the host.
#[tokio::test]
async fn an_image_of_symbolic_links_cannot_lead_the_setup_out_of_its_root() {
    if let Some(why) = common::rootfs_skip_reason().await {
        eprintln!("SKIP: {why}");
        return;
    }
    let host = tempfile::tempdir_in("/tmp").unwrap();
    let victim = host.path().join("victim");
    std::fs::write(&victim, "host data\n").unwrap();
    // World-writable, as /tmp is: the sandbox's ids could write there if led to it.
    std::fs::set_permissions(
        host.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    std::fs::set_permissions(&victim, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let h = host.path().display().to_string();
    let mut b = tar::Builder::new(Vec::new());
    let mut link = |path: &str, target: &str| {
        let mut hd = tar::Header::new_gnu();
        hd.set_entry_type(tar::EntryType::Symlink);
        hd.set_mode(0o777);
        hd.set_size(0);
        b.append_link(&mut hd, path, target).unwrap();
    };
    link("etc/hostname", &format!("/oldroot{h}/victim"));
    link("etc/hosts", &format!("{h}/victim"));
    link("etc/resolv.conf", &format!("/oldroot{h}/created"));
    link("tmp", &format!("/oldroot{h}"));
    // A chain: the first link leads to a directory of the image, the second out of it from
    // the setup's own root (where `/oldroot` is the host's), which mounts would follow.
    link("home/user", "u");
    link("home/u", &format!("/oldroot{h}"));
    // The config's working directory, and the directory the chain's end names inside the
    // image.
    let mut dirs = vec!["home/app".to_string(), "oldroot".to_string()];
    let mut at = String::from("oldroot");
    for part in h.trim_start_matches('/').split('/') {
        at = format!("{at}/{part}");
        dirs.push(at.clone());
    }
    for d in dirs {
        let mut hd = tar::Header::new_gnu();
        hd.set_entry_type(tar::EntryType::Directory);
        hd.set_mode(0o755);
        hd.set_size(0);
        b.append_data(&mut hd, &d, std::io::empty()).unwrap();
    }
    let upper = b.into_inner().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write_layout_with(&tmp.path().join("layout"), &[("evil", None)], upper);
    let store = ImageStore::builder(tmp.path().join("cache"))
        .build()
        .unwrap();
    let backend = ContainerBackend::builder()
        .image_store(store)
        .hostname("inside")
        .build()
        .unwrap();
    let spec = SandboxSpec::builder(Language::Shell)
        .image(format!("oci:{}:evil", tmp.path().join("layout").display()))
        .workspace_alias("/home/user")
        .wall_time(Duration::from_secs(20))
        .build()
        .unwrap();
    match backend.create(&spec, ResolvedSecrets::none()).await {
        Ok(sb) => {
            // Its own files, in its own root.
            assert_eq!(sh_ok(sb.as_ref(), "cat /etc/hostname").await, "inside\n");
            assert!(sh_ok(sb.as_ref(), "cat /etc/hosts")
                .await
                .contains("inside"));
            sh_ok(sb.as_ref(), "echo x > /tmp/written-inside").await;
            sh_ok(sb.as_ref(), "echo alias > /home/user/written-inside").await;
            assert_eq!(sb.read_file("written-inside").await.unwrap(), b"alias\n");
            sb.destroy().await.unwrap();
        }
        Err(e) => panic!("the image's links are replaced, not followed: {e}"),
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "host data\n");
    let mut left: Vec<_> = std::fs::read_dir(host.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["victim"], "the setup wrote on the host");
}
