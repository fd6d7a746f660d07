//! Merging layers as overlayfs shows them, the image's size, and its UUID.

use super::*;

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Both whiteout forms, both opaque forms, `opaque=x` (not opaque), kind changes.
#[test]
fn merges_layers_as_overlayfs_shows_them() {
    let t = tempfile::tempdir().unwrap();
    let (l1, l2, stage) = (t.path().join("l1"), t.path().join("l2"), t.path().join("s"));
    for d in [&l1, &l2, &stage] {
        fs::create_dir(d).unwrap();
    }
    // Lower layer.
    for d in ["etc", "data/sub", "xw", "kind", "opq"] {
        fs::create_dir_all(l1.join(d)).unwrap();
    }
    fs::write(l1.join("etc/keep"), "keep").unwrap();
    fs::write(l1.join("etc/gone"), "gone").unwrap();
    fs::write(l1.join("data/sub/deep"), "deep").unwrap();
    fs::write(l1.join("data/a"), "a").unwrap();
    fs::write(l1.join("xw/gone"), "gone").unwrap();
    fs::write(l1.join("xw/stays"), "stays").unwrap();
    fs::write(l1.join("kind/f"), "f").unwrap();
    fs::write(l1.join("opq/old"), "old").unwrap();
    std::os::unix::fs::symlink("/etc/keep", l1.join("link")).unwrap();
    fs::write(l1.join("becomes-dir"), "x").unwrap();

    // Upper layer: an xattr whiteout in a directory marked `opaque=x` (not opaque), a
    // `user.overlay.opaque=y` directory, a file replacing a directory and the reverse.
    fs::create_dir_all(l2.join("xw")).unwrap();
    fs::write(l2.join("xw/gone"), "").unwrap();
    xattr::set(l2.join("xw/gone"), "user.overlay.whiteout", b"y").unwrap();
    xattr::set(l2.join("xw"), "user.overlay.opaque", b"x").unwrap();
    fs::create_dir_all(l2.join("opq")).unwrap();
    xattr::set(l2.join("opq"), "user.overlay.opaque", b"y").unwrap();
    fs::write(l2.join("opq/new"), "new").unwrap();
    fs::write(l2.join("kind"), "now a file").unwrap();
    fs::create_dir(l2.join("becomes-dir")).unwrap();
    fs::create_dir(l2.join("data")).unwrap();
    fs::write(l2.join("data/b"), "b").unwrap();
    let root = nix::unistd::geteuid().is_root();
    if root {
        // A char-device whiteout and a `trusted.` opaque directory (root only).
        fs::create_dir(l2.join("etc")).unwrap();
        nix::sys::stat::mknod(
            &l2.join("etc/gone"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::empty(),
            0,
        )
        .unwrap();
        fs::create_dir_all(l2.join("data/sub")).unwrap();
        xattr::set(l2.join("data/sub"), "trusted.overlay.opaque", b"y").unwrap();
    }
    fs::set_permissions(l2.join("opq"), fs::Permissions::from_mode(0o555)).unwrap();

    let mut m = Merger {
        stage: &stage,
        root,
        dirs: BTreeMap::new(),
    };
    m.merge(&l1).unwrap();
    m.merge(&l2).unwrap();
    m.finish().unwrap();

    assert_eq!(names(&stage.join("xw")), ["stays"]);
    assert_eq!(names(&stage.join("opq")), ["new"]);
    assert_eq!(
        fs::read_to_string(stage.join("kind")).unwrap(),
        "now a file"
    );
    assert!(stage.join("becomes-dir").is_dir());
    assert_eq!(names(&stage.join("data")), ["a", "b", "sub"]);
    assert_eq!(
        fs::read_link(stage.join("link")).unwrap(),
        Path::new("/etc/keep")
    );
    if root {
        assert_eq!(names(&stage.join("etc")), ["keep"]);
        assert!(names(&stage.join("data/sub")).is_empty());
    } else {
        assert_eq!(names(&stage.join("data/sub")), ["deep"]);
    }
    // Files are the layers' inodes; directories are fresh, with the upper layer's mode
    // and no overlay attributes.
    let (a, b) = (
        fs::metadata(l1.join("data/a")).unwrap(),
        fs::metadata(stage.join("data/a")).unwrap(),
    );
    assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()));
    let opq = fs::symlink_metadata(stage.join("opq")).unwrap();
    assert_eq!(opq.mode() & 0o7777, 0o555);
    assert!(xattr::get(stage.join("opq"), "user.overlay.opaque")
        .unwrap()
        .is_none());
    assert!(xattr::get(stage.join("xw"), "user.overlay.opaque")
        .unwrap()
        .is_none());

    let s = measure(&stage).unwrap();
    assert!(s.entries >= 12, "{s:?}");
    assert!(s.image_bytes() >= MIN_BYTES && s.image_bytes().is_multiple_of(1 << 20));
    fs::set_permissions(stage.join("opq"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(l2.join("opq"), fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn sizes_cover_content_inodes_and_a_minimum() {
    let small = Staged {
        entries: 10,
        data: 4096,
        dirs: 4096,
        newest: 0,
    };
    assert_eq!(small.image_bytes(), MIN_BYTES);
    let big = Staged {
        entries: 100_000,
        data: 1 << 30,
        dirs: 10 << 20,
        newest: 0,
    };
    assert!(big.image_bytes() > big.content_bytes() + big.content_bytes() / 5);
    let many = Staged {
        entries: 1_000_000,
        data: 0,
        dirs: 0,
        newest: 0,
    };
    assert!(many.image_bytes() >= many.inodes() * BLOCK);
    assert_eq!(grow(100), 150);
}

#[test]
fn uuids_come_from_the_digest() {
    let hex = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let u = uuid_of(hex).unwrap();
    assert_eq!(u, uuid_of(hex).unwrap());
    assert_eq!(u.len(), 36);
    assert!(u.starts_with("01234567-89ab-4"), "{u}");
}
