//! Bad input, each with a clear error and nothing half-cached: unknown names, wrong
//! credentials, corrupt and truncated blobs, a stalling registry, a hostile layer, a layer over
//! the cap. Plus the sources that need setting up: basic auth and TLS with a private CA.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Comp, Entry, Layout, Registry};
use sandbox_image::{Credentials, ImageError, ImageRef, ImageStore};

fn r(s: &str) -> ImageRef {
    s.parse().unwrap()
}

/// Nothing of a failed pull is in the cache: no blob, no layer, no leftover in `tmp/`.
fn nothing_cached(store: &ImageStore) {
    for d in ["blobs/sha256", "layers", "images", "tmp"] {
        let left = common::files_under(&store.root().join(d));
        assert!(left.is_empty(), "{d} holds {left:?}");
    }
}

/// A one-layer image pushed to a fresh registry; returns (registry, layer blob digest).
fn one_image(tmp: &Path, layer: Vec<u8>) -> (Registry, String) {
    let mut layout = Layout::new(&tmp.join("layout"));
    let (desc, _) = layout.image(std::slice::from_ref(&layer), Comp::Gzip, &[], "amd64");
    layout.tag(desc, "v1");
    let reg = Registry::start(None, None);
    reg.push(&layout.dir, "v1", "test/app", &[]);
    (reg, common::sha(&common::gzip(&layer)))
}

fn store(tmp: &Path) -> ImageStore {
    ImageStore::builder(tmp.join("cache")).build().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_repositories_and_tags_are_not_found() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (reg, _) = one_image(tmp.path(), common::layer(&[Entry::File("f", b"x")]));
    let s = store(tmp.path());
    for name in ["test/app:v2", "test/nothing:v1"] {
        let e = s
            .pull(&r(&format!("{}/{name}", reg.addr)))
            .await
            .unwrap_err();
        assert!(matches!(e, ImageError::NotFound { .. }), "{name}: {e}");
        assert!(e.to_string().contains("not found"), "{e}");
    }
    nothing_cached(&s);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_or_truncated_blob_is_refused_and_not_kept() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let big: Vec<u8> = (0..200_000u32).flat_map(|i| i.to_le_bytes()).collect();
    let (reg, blob) = one_image(tmp.path(), common::layer(&[Entry::File("big", &big)]));
    let file = reg.blob_file(&blob);
    let good = std::fs::read(&file).unwrap();
    let s = store(tmp.path());
    let reference = r(&format!("{}/test/app:v1", reg.addr));

    // Same length, one byte changed.
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0xff;
    std::fs::write(&file, &bad).unwrap();
    let e = s.pull(&reference).await.unwrap_err();
    assert!(matches!(e, ImageError::DigestMismatch { .. }), "{e}");
    nothing_cached(&s);

    // Cut short.
    std::fs::write(&file, &good[..good.len() / 3]).unwrap();
    let e = s.pull(&reference).await.unwrap_err();
    assert!(
        matches!(
            e,
            ImageError::DigestMismatch { .. } | ImageError::Registry { .. }
        ),
        "{e}"
    );
    nothing_cached(&s);

    // Repaired: the same store pulls it fine.
    std::fs::write(&file, &good).unwrap();
    let image = s.pull(&reference).await.unwrap();
    assert_eq!(std::fs::read(image.layers()[0].join("big")).unwrap(), big);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stalling_registry_times_out() {
    // Accepts connections and never answers.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let held = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for c in listener.incoming().take(4) {
            conns.push(c);
        }
        std::thread::sleep(Duration::from_secs(10));
    });
    let tmp = tempfile::tempdir().unwrap();
    let s = ImageStore::builder(tmp.path().join("cache"))
        .timeouts(Duration::from_secs(1), Duration::from_secs(1))
        .build()
        .unwrap();
    let e = s
        .pull(&r(&format!("{addr}/stall/app:v1")))
        .await
        .unwrap_err();
    assert!(matches!(e, ImageError::Registry { .. }), "{e}");
    nothing_cached(&s);
    drop(held);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_layer_from_a_registry_is_refused_and_the_host_untouched() {
    if !common::have_tools() {
        return;
    }
    let target = std::env::temp_dir().join(format!("agent-sandbox-escape-{}", std::process::id()));
    let escape = format!("../../../../../../../..{}", target.display());
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            common::raw_layer(&[(tar::EntryType::Regular, &escape, "", b"pwned")]),
            "`..`",
        ),
        (
            common::raw_layer(&[
                (
                    tar::EntryType::Symlink,
                    "tmpdir",
                    std::env::temp_dir().to_str().unwrap(),
                    b"",
                ),
                (
                    tar::EntryType::Regular,
                    &format!("tmpdir/{}", target.file_name().unwrap().to_str().unwrap()),
                    "",
                    b"pwned",
                ),
            ]),
            "symlink",
        ),
        (
            common::raw_layer(&[(tar::EntryType::Link, "shadow", "/etc/shadow", b"")]),
            "hard link",
        ),
        (
            common::raw_layer(&[(tar::EntryType::Regular, "etc/.wh...", "", b"")]),
            "whiteout",
        ),
    ];
    for (layer, why) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let (_reg, _) = {
            let (reg, blob) = one_image(tmp.path(), layer);
            let s = store(tmp.path());
            let e = s
                .pull(&r(&format!("{}/test/app:v1", reg.addr)))
                .await
                .unwrap_err();
            match &e {
                ImageError::MaliciousLayer { why: w, .. } => assert!(w.contains(why), "{e}"),
                other => panic!("expected a refusal ({why}): {other}"),
            }
            // The blob downloaded fine (it is what it claims to be) and may stay for a later
            // prune; no layer, image or leftover does.
            for d in ["layers", "images", "tmp"] {
                let left = common::files_under(&s.root().join(d));
                assert!(left.is_empty(), "{d} holds {left:?}");
            }
            (reg, blob)
        };
        assert!(
            !target.exists(),
            "the host was written: {}",
            target.display()
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_over_the_cap_is_refused_and_nothing_kept() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..100_000u32)
        .flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes())
        .collect();
    let (reg, _) = one_image(tmp.path(), common::layer(&[Entry::File("data", &data)]));
    let s = ImageStore::builder(tmp.path().join("cache"))
        .max_bytes(50_000)
        .build()
        .unwrap();
    let e = s
        .pull(&r(&format!("{}/test/app:v1", reg.addr)))
        .await
        .unwrap_err();
    assert!(
        matches!(e, ImageError::CacheFull { cap: 50_000, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("image prune"), "{e}");
    nothing_cached(&s);
}

#[tokio::test(flavor = "multi_thread")]
async fn basic_auth_with_api_or_docker_config_credentials() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let htpasswd = tmp.path().join("htpasswd");
    let hash = bcrypt::hash("s3cret", 5).unwrap();
    std::fs::write(&htpasswd, format!("alice:{hash}\n")).unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    let (desc, _) = layout.image(
        &[common::layer(&[Entry::File("f", b"x")])],
        Comp::Gzip,
        &[],
        "amd64",
    );
    layout.tag(desc, "v1");
    let reg = Registry::start(None, Some(&htpasswd));
    reg.push(
        &layout.dir,
        "v1",
        "private/app",
        &["--dest-creds", "alice:s3cret"],
    );
    let reference = r(&format!("{}/private/app:v1", reg.addr));
    let no_docker = tmp.path().join("no-docker-config.json");

    let anon = ImageStore::builder(tmp.path().join("c1"))
        .docker_config(&no_docker)
        .build()
        .unwrap();
    let e = anon.pull(&reference).await.unwrap_err();
    assert!(matches!(e, ImageError::Unauthorized { .. }), "{e}");
    assert!(e.to_string().contains("docker login"), "{e}");

    let wrong = ImageStore::builder(tmp.path().join("c2"))
        .docker_config(&no_docker)
        .credentials(reg.addr.clone(), Credentials::new("alice", "nope"))
        .build()
        .unwrap();
    let e = wrong.pull(&reference).await.unwrap_err();
    assert!(matches!(e, ImageError::Unauthorized { .. }), "{e}");
    nothing_cached(&wrong);

    let right = ImageStore::builder(tmp.path().join("c3"))
        .docker_config(&no_docker)
        .credentials(reg.addr.clone(), Credentials::new("alice", "s3cret"))
        .build()
        .unwrap();
    assert!(right.pull(&reference).await.is_ok());

    // As `docker login` leaves them.
    let cfg = tmp.path().join("config.json");
    let auth = {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode("alice:s3cret")
    };
    std::fs::write(
        &cfg,
        format!(r#"{{"auths":{{"{}":{{"auth":"{auth}"}}}}}}"#, reg.addr),
    )
    .unwrap();
    let from_file = ImageStore::builder(tmp.path().join("c4"))
        .docker_config(&cfg)
        .build()
        .unwrap();
    assert!(from_file.pull(&reference).await.is_ok());
}

#[tokio::test(flavor = "multi_thread")]
async fn tls_with_a_private_ca() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (ca, cert, key) = common::test_tls(tmp.path());
    let mut layout = Layout::new(&tmp.path().join("layout"));
    let (desc, _) = layout.image(
        &[common::layer(&[Entry::File("f", b"tls")])],
        Comp::Gzip,
        &[],
        "amd64",
    );
    layout.tag(desc, "v1");
    let reg = Registry::start(Some((&cert, &key)), None);
    reg.push(&layout.dir, "v1", "test/app", &[]);
    let reference = r(&format!("{}/test/app:v1", reg.addr));

    // An unknown CA is refused (and plain HTTP to a TLS server gets nowhere either).
    let untrusting = store(tmp.path());
    let e = untrusting.pull(&reference).await.unwrap_err();
    assert!(matches!(e, ImageError::Registry { .. }), "{e}");
    nothing_cached(&untrusting);

    let trusting = ImageStore::builder(tmp.path().join("c2"))
        .ca_certificate_pem(std::fs::read(&ca).unwrap())
        .build()
        .unwrap();
    let image = trusting.pull(&reference).await.unwrap();
    assert_eq!(std::fs::read(image.layers()[0].join("f")).unwrap(), b"tls");
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_pulls_of_one_image_do_the_work_once() {
    if !common::have_tools() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (reg, _) = one_image(
        tmp.path(),
        common::layer(&[Entry::File("f", &[9u8; 300_000])]),
    );
    let reference = r(&format!("{}/test/app:v1", reg.addr));
    // Two stores on one directory behave as two processes would (separate lock files).
    let a = store(tmp.path());
    let b = store(tmp.path());
    let (x, y) = tokio::join!(a.pull(&reference), b.pull(&reference));
    let (x, y) = (x.unwrap(), y.unwrap());
    assert_eq!(x.layers(), y.layers());
    assert_eq!(
        common::files_under(&a.root().join("layers")).len(),
        1 + 1 + 1,
        "one layer dir, its file, its size"
    );
    assert!(common::files_under(&a.root().join("tmp")).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_cache_disk_is_a_clear_error_and_leaves_nothing_half_made() {
    if !common::have_tools() {
        return;
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP: mounting a small tmpfs as the cache disk needs root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // 3 MB of incompressible data: the blob fits a 2 MB disk, its unpacked layer does not.
    let data: Vec<u8> = (0..750_000u32)
        .flat_map(|i| (i.wrapping_mul(2_654_435_761) ^ (i >> 3)).to_le_bytes())
        .collect();
    let (reg, _) = one_image(tmp.path(), common::layer(&[Entry::File("data", &data)]));
    let disk = tmp.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
        .arg(&disk)
        .status()
        .unwrap();
    assert!(st.success());
    let s = ImageStore::builder(disk.join("cache")).build().unwrap();
    let e = s
        .pull(&r(&format!("{}/test/app:v1", reg.addr)))
        .await
        .unwrap_err();
    let msg = e.to_string();
    for d in ["layers", "images", "tmp"] {
        let left = common::files_under(&s.root().join(d));
        assert!(left.is_empty(), "{d} holds {left:?}");
    }
    let _ = std::process::Command::new("umount").arg(&disk).status();
    assert!(matches!(e, ImageError::Io { .. }), "{e}");
    assert!(
        msg.contains("disk holding the image cache is full"),
        "{msg}"
    );
}

/// A layer tar of (type, path, link target, mode), written header by header.
fn layer_with_modes(entries: &[(tar::EntryType, &str, &str, u32)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (kind, path, link, mode) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_path(path).unwrap();
        if !link.is_empty() {
            h.set_link_name(link).unwrap();
        }
        h.set_mode(*mode);
        h.set_size(0);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// The attack found by trying it: a layer holding a directory `x/` (mode 0777) and then a
/// symlink `x` to a host file. The unpacker's deferred `chmod` followed the link and made the
/// host file 0777, as root. The same with a parent replaced by a link, and across two layers
/// merged into the microVM tier's filesystem image (which also `chown`s).
#[tokio::test(flavor = "multi_thread")]
async fn a_layer_cannot_change_a_host_files_mode_through_a_link_it_swaps_in() {
    if !common::have_tools() {
        return;
    }
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use tar::EntryType as T;
    let host = tempfile::tempdir().unwrap();
    let (file, dir) = (host.path().join("secret"), host.path().join("sub"));
    std::fs::write(&file, "secret").unwrap();
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let meta = |p: &Path| {
        let m = std::fs::metadata(p).unwrap();
        (m.mode() & 0o7777, m.uid(), m.gid(), m.mtime())
    };
    let before = (meta(&file), meta(&dir));
    let (file_s, host_s) = (file.to_str().unwrap(), host.path().to_str().unwrap());

    let one = layer_with_modes(&[
        (T::Directory, "x/", "", 0o777),
        (T::Symlink, "x", file_s, 0o777),
        (T::Directory, "p/", "", 0o755),
        (T::Directory, "p/sub/", "", 0o777),
        (T::Symlink, "p", host_s, 0o777),
    ]);
    let lower = layer_with_modes(&[
        (T::Directory, "q/", "", 0o755),
        (T::Directory, "q/sub/", "", 0o777),
    ]);
    let upper = layer_with_modes(&[(T::Symlink, "q", host_s, 0o777)]);

    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    let (d1, _) = layout.image(std::slice::from_ref(&one), Comp::Gzip, &[], "amd64");
    layout.tag(d1, "one");
    let (d2, _) = layout.image(&[lower, upper], Comp::Zstd, &[], "amd64");
    layout.tag(d2, "two");
    let reg = Registry::start(None, None);
    reg.push(&layout.dir, "one", "evil/app", &[]);
    reg.push(&layout.dir, "two", "evil/app", &[]);
    let s = store(tmp.path());

    // Refused or pulled, either is fine; the host's files are not.
    let _ = s.pull(&r(&format!("{}/evil/app:one", reg.addr))).await;
    assert_eq!(
        (meta(&file), meta(&dir)),
        before,
        "one layer changed the host"
    );
    let image = s
        .pull(&r(&format!("{}/evil/app:two", reg.addr)))
        .await
        .unwrap();
    assert_eq!(
        (meta(&file), meta(&dir)),
        before,
        "two layers changed the host"
    );
    let has_mkfs = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
        .iter()
        .any(|p| Path::new(p).is_file());
    if has_mkfs {
        let _ = s.rootfs_image(&image);
        assert_eq!(
            (meta(&file), meta(&dir)),
            before,
            "merging the layers into a filesystem image changed the host"
        );
    } else {
        eprintln!("SKIP (filesystem image part): mkfs.ext4 is not installed");
    }
}

/// A GNU long-name header whose body is 256 MiB (zstd makes it a few KiB on the wire; 16 GiB
/// would be under 1 MB): refused from its header, never read into memory.
#[tokio::test(flavor = "multi_thread")]
async fn an_extension_header_bomb_is_refused_before_it_is_read() {
    if !common::have_tools() {
        return;
    }
    let mut tar = Vec::new();
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::GNULongName);
    h.set_path("././@LongLink").unwrap();
    h.set_size(256 << 20);
    h.set_cksum();
    tar.extend_from_slice(h.as_bytes());
    tar.resize(tar.len() + (256 << 20), 0);
    let mut f = tar::Header::new_gnu();
    f.set_entry_type(tar::EntryType::Regular);
    f.set_path("short").unwrap();
    f.set_size(0);
    f.set_cksum();
    tar.extend_from_slice(f.as_bytes());
    tar.extend_from_slice(&[0u8; 1024]);

    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    let (d, _) = layout.image(&[tar], Comp::Zstd, &[], "amd64");
    layout.tag(d, "v1");
    let reg = Registry::start(None, None);
    reg.push(&layout.dir, "v1", "bomb/app", &[]);
    let s = store(tmp.path());
    let e = s
        .pull(&r(&format!("{}/bomb/app:v1", reg.addr)))
        .await
        .unwrap_err();
    match &e {
        ImageError::MaliciousLayer { why, .. } => assert!(why.contains("GNU long name"), "{e}"),
        other => panic!("expected a refusal of the long name: {other}"),
    }
    for d in ["layers", "images", "tmp"] {
        let left = common::files_under(&s.root().join(d));
        assert!(left.is_empty(), "{d} holds {left:?}");
    }
}
