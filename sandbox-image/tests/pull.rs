//! Pulling from the real CNCF registry on loopback and from offline sources: layers,
//! whiteouts, indexes, zstd, the cache's reuse and bookkeeping.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use common::{Comp, Entry, Layout, Registry};
use sandbox_image::{ImageError, ImageRef, ImageStore};

fn r(s: &str) -> ImageRef {
    s.parse().unwrap()
}

/// A two-layer image: the lower one has `/etc/os`, `/etc/gone`, `/data/{a,b}`; the upper one
/// deletes `/etc/gone`, makes `/data` opaque with only `c`, and adds `/bin/hello`.
fn two_layers(layout: &mut Layout, comp: Comp, tag: &str) -> String {
    let lower = common::layer(&[
        Entry::Dir("etc"),
        Entry::File("etc/os", b"test-os 1\n"),
        Entry::File("etc/gone", b"bye\n"),
        Entry::Dir("data"),
        Entry::File("data/a", b"a"),
        Entry::File("data/b", b"b"),
        Entry::Symlink("etc/alias", "/etc/os"),
    ]);
    let upper = common::layer(&[
        Entry::Whiteout("etc/.wh.gone"),
        Entry::Dir("data"),
        Entry::Opaque("data/.wh..wh..opq"),
        Entry::File("data/c", b"c"),
        Entry::Dir("bin"),
        Entry::File("bin/hello", b"#!/bin/sh\necho hello\n"),
    ]);
    let (desc, digest) = layout.image(
        &[lower, upper],
        comp,
        &["PATH=/bin", "GREETING=hi"],
        "amd64",
    );
    layout.tag(desc, tag);
    digest
}

/// Mounts the image's layers as a read-only overlay and returns what it shows (root only).
fn merged_view(layers: &[std::path::PathBuf]) -> Option<(tempfile::TempDir, Vec<String>)> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP merged view: mounting an overlay needs root");
        return None;
    }
    let mnt = tempfile::tempdir().unwrap();
    let lower: Vec<String> = layers
        .iter()
        .rev()
        .map(|p| p.display().to_string())
        .collect();
    let st = std::process::Command::new("mount")
        .args(["-t", "overlay", "overlay", "-o"])
        .arg(format!("ro,lowerdir={}", lower.join(":")))
        .arg(mnt.path())
        .status()
        .unwrap();
    assert!(st.success(), "overlay mount failed");
    let files = common::files_under(mnt.path());
    let _ = std::process::Command::new("umount")
        .arg(mnt.path())
        .status();
    Some((mnt, files))
}

#[tokio::test(flavor = "multi_thread")]
async fn pulls_over_plain_http_from_loopback_with_whiteouts_and_reuses_the_cache() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    let digest = two_layers(&mut layout, Comp::Gzip, "v1");
    let reg = Registry::start(None, None);
    reg.push(&layout.dir, "v1", "test/app", &[]);

    let store = ImageStore::builder(tmp.path().join("cache"))
        .build()
        .unwrap();
    let reference = r(&format!("{}/test/app:v1", reg.addr));
    let image = store.pull(&reference).await.unwrap();
    // skopeo may rewrite the manifest (it is the same image either way); the layers decide.
    assert!(image.digest().starts_with("sha256:"), "{}", image.digest());
    let _ = digest;
    assert_eq!(image.layers().len(), 2);
    assert_eq!(
        image.config().env,
        vec![
            ("PATH".to_owned(), "/bin".to_owned()),
            ("GREETING".to_owned(), "hi".to_owned())
        ]
    );
    assert_eq!(image.config().working_dir.as_deref(), Some("/work"));
    let upper = &image.layers()[1];
    if nix::unistd::geteuid().is_root() {
        let wh = std::fs::symlink_metadata(upper.join("etc/gone")).unwrap();
        assert!(
            wh.file_type().is_char_device(),
            "whiteout is a 0/0 char device"
        );
    }
    if let Some((_m, files)) = merged_view(image.layers()) {
        assert!(files.contains(&"etc/os".to_owned()));
        assert!(
            !files.contains(&"etc/gone".to_owned()),
            "whiteout hides it: {files:?}"
        );
        assert!(files.contains(&"data/c".to_owned()));
        assert!(
            !files.contains(&"data/a".to_owned()),
            "opaque dir hides lower: {files:?}"
        );
        assert!(files.contains(&"bin/hello".to_owned()));
    }

    // The registry goes away: the cached image is still there, without the network.
    drop(reg);
    let again = store.ensure(&reference).await.unwrap();
    assert_eq!(again.digest(), image.digest());
    assert_eq!(again.layers(), image.layers());
    assert!(matches!(
        store.pull(&reference).await,
        Err(ImageError::Registry { .. })
    ));

    let list = store.list().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].references, vec![reference.to_string()]);
    assert!(list[0].in_use, "our Image values hold it");
    // No leftovers of the work in tmp/.
    assert!(common::files_under(&store.root().join("tmp")).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_index_resolves_to_linux_amd64_and_zstd_layers_unpack() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    let arm = common::layer(&[Entry::File("which", b"arm64")]);
    let amd = common::layer(&[Entry::File("which", b"amd64")]);
    let (arm_desc, _) = layout.image(&[arm], Comp::Zstd, &[], "arm64");
    let (amd_desc, _) = layout.image(&[amd], Comp::Zstd, &[], "amd64");
    layout.tag_index(vec![arm_desc, amd_desc], "multi");
    let reg = Registry::start(None, None);
    reg.push(&layout.dir, "multi", "test/multi", &["--all"]);

    let store = ImageStore::builder(tmp.path().join("cache"))
        .build()
        .unwrap();
    let image = store
        .pull(&r(&format!(
            "localhost:{}/test/multi:multi",
            &reg.addr[10..]
        )))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(image.layers()[0].join("which")).unwrap(),
        b"amd64"
    );

    // The same layout read directly (no registry) gives the same layer.
    let offline = store
        .ensure(&r(&format!("oci:{}:multi", layout.dir.display())))
        .await
        .unwrap();
    assert_eq!(offline.layers(), image.layers());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_docker_save_archive_is_a_source() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    two_layers(&mut layout, Comp::Gzip, "v1");
    let archive = tmp.path().join("app.tar");
    let out = std::process::Command::new(common::SKOPEO)
        .args(["copy", "--quiet"])
        .arg(format!("oci:{}:v1", layout.dir.display()))
        .arg(format!("docker-archive:{}:test/app:v1", archive.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let store = ImageStore::builder(tmp.path().join("cache"))
        .build()
        .unwrap();
    let reference = r(&format!("docker-archive:{}", archive.display()));
    let image = store.ensure(&reference).await.unwrap();
    assert_eq!(image.layers().len(), 2);
    assert_eq!(
        std::fs::read(image.layers()[0].join("etc/os")).unwrap(),
        b"test-os 1\n"
    );
    // Cached: a second ensure does not extract again (same record, and tmp stays empty).
    let again = store.ensure(&reference).await.unwrap();
    assert_eq!(again.digest(), image.digest());
    assert!(common::files_under(&store.root().join("tmp")).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn rm_and_prune_free_what_no_image_needs_but_spare_images_in_use() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    two_layers(&mut layout, Comp::Gzip, "v1");
    let store = ImageStore::builder(tmp.path().join("cache"))
        .build()
        .unwrap();
    let reference = r(&format!("oci:{}:v1", layout.dir.display()));
    let image = store.ensure(&reference).await.unwrap();
    let layers = image.layers().to_vec();
    let used = store.usage().unwrap();
    assert!(used > 0);
    // Every image of one record shares one lease: one descriptor however many sandboxes
    // use it (a host's open-files limit is what stops density first).
    let more: Vec<_> = (0..3)
        .map(|_| store.get(&reference).unwrap().unwrap())
        .collect();
    assert_eq!(fds_under(&store.root().join("images")), 1);

    // A leftover of a pull killed halfway (a partial blob and a half-unpacked layer).
    std::fs::write(store.root().join("tmp/blob-deadbeef"), b"partial").unwrap();
    std::fs::create_dir_all(store.root().join("tmp/layer-deadbeef/usr")).unwrap();

    // In use: rm drops the name, but the files stay while any Image of it lives.
    drop(image);
    let report = store.remove(&reference.to_string()).unwrap();
    assert_eq!(report.layers, 0, "{report:?}");
    assert!(layers.iter().all(|l| l.is_dir()));
    let left = common::files_under(&store.root().join("tmp"));
    assert!(left.is_empty(), "prune clears tmp/: {left:?}");
    assert_eq!(store.prune().unwrap().layers, 0);
    assert!(layers.iter().all(|l| l.is_dir()));
    drop(more);
    assert_eq!(fds_under(&store.root().join("images")), 0);
    let report = store.prune().unwrap();
    assert_eq!(
        (report.images, report.layers, report.blobs),
        (1, 2, 2),
        "{report:?}"
    );
    assert!(layers.iter().all(|l| !l.exists()));
    assert_eq!(store.usage().unwrap(), 0);
    assert!(store.list().unwrap().is_empty());
    assert!(matches!(
        store.remove("nothing:here"),
        Err(ImageError::NotCached(_))
    ));
}

#[test]
fn unknown_schemes_and_paths_fail_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::builder(tmp.path().join("cache"))
        .build()
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let missing = r(&format!("oci:{}", tmp.path().join("nope").display()));
    let e = rt.block_on(store.ensure(&missing)).unwrap_err();
    assert!(e.to_string().contains("not an OCI image layout"), "{e}");
    let _ = Path::new("/");
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_schema_2_manifests_pull_like_oci_ones() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    two_layers(&mut layout, Comp::Gzip, "v1");
    let reg = Registry::start(None, None);
    // skopeo converts to Docker's schema 2 (manifest and layer media types) on the way.
    reg.push(&layout.dir, "v1", "test/docker", &["--format", "v2s2"]);
    let store = ImageStore::builder(tmp.path().join("cache"))
        .build()
        .unwrap();
    let image = store
        .pull(&r(&format!("{}/test/docker:v1", reg.addr)))
        .await
        .unwrap();
    assert_eq!(image.layers().len(), 2);
    assert_eq!(
        std::fs::read(image.layers()[0].join("etc/os")).unwrap(),
        b"test-os 1\n"
    );
    assert_eq!(image.config().working_dir.as_deref(), Some("/work"));
}

/// This process's descriptors open on files under `dir`.
fn fds_under(dir: &Path) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.starts_with(dir)))
        .count()
}
