//! Filesystem images for the microVM tier: an image's layers merged into a read-only ext4
//! file by the real `mkfs.ext4`, checked with `debugfs` (no mounting), built once, pruned
//! with its image, and nothing kept when building fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{Comp, Entry, Layout};
use sandbox_image::{Image, ImageError, ImageRef, ImageStore};

/// `debugfs`, or `None` (and a SKIP line) when e2fsprogs is missing.
fn e2fsprogs() -> Option<PathBuf> {
    let mkfs = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
        .iter()
        .any(|p| Path::new(p).is_file());
    let debugfs = ["/usr/sbin/debugfs", "/sbin/debugfs"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file());
    match (mkfs, debugfs) {
        (true, Some(d)) => Some(d),
        _ => {
            eprintln!("SKIP: e2fsprogs (mkfs.ext4, debugfs) is not installed");
            None
        }
    }
}

/// What `debugfs -R REQUEST IMG` prints.
fn debugfs(tool: &Path, img: &Path, request: &str) -> String {
    let out = Command::new(tool)
        .arg("-R")
        .arg(request)
        .arg(img)
        .output()
        .unwrap();
    assert!(out.status.success(), "debugfs -R '{request}' failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The names in a directory of the image (`.`, `..` and `lost+found` left out), sorted.
fn ls(tool: &Path, img: &Path, dir: &str) -> Vec<String> {
    let out = debugfs(tool, img, &format!("ls -l {dir}"));
    let mut names: Vec<String> = out
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .filter(|n| !matches!(*n, "." | ".." | "lost+found"))
        .map(str::to_owned)
        .collect();
    names.sort();
    names
}

/// The number after `field` (`User:`, `Group:`) in `debugfs stat` output.
fn stat_field(stat: &str, field: &str) -> String {
    let mut words = stat.split_whitespace();
    words.find(|w| *w == field);
    words.next().unwrap_or_default().to_owned()
}

/// An entry with an owner: (path, uid, gid, mode, contents; `None`: a directory).
type Owned<'a> = (&'a str, u64, u64, u32, Option<&'a [u8]>);

/// A layer whose entries have owners.
fn owned_layer(entries: &[Owned<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, uid, gid, mode, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(1_700_000_100);
        h.set_uid(*uid);
        h.set_gid(*gid);
        h.set_mode(*mode);
        match data {
            Some(d) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(d.len() as u64);
                b.append_data(&mut h, path, *d).unwrap();
            }
            None => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                b.append_data(&mut h, path, &[][..]).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

/// Three layers: the lowest has `/etc/{os,gone,alias -> /etc/os}`, `/data/{a,b,keep/x}` and
/// `/usr/lib/nested/file.txt`; the middle one deletes `/etc/gone`, makes `/data` opaque with
/// only `c` and adds `/bin/hello`; the top one replaces `/etc/os` and adds files owned by
/// 1234:5678 under `/home/user`.
fn three_layers(layout: &mut Layout, tag: &str) -> String {
    let lower = common::layer(&[
        Entry::Dir("etc"),
        Entry::File("etc/os", b"test-os 1\n"),
        Entry::File("etc/gone", b"bye\n"),
        Entry::Symlink("etc/alias", "/etc/os"),
        Entry::Dir("data"),
        Entry::File("data/a", b"a"),
        Entry::File("data/b", b"b"),
        Entry::Dir("data/keep"),
        Entry::File("data/keep/x", b"x"),
        Entry::Dir("usr"),
        Entry::Dir("usr/lib"),
        Entry::Dir("usr/lib/nested"),
        Entry::File("usr/lib/nested/file.txt", b"nested\n"),
    ]);
    let middle = common::layer(&[
        Entry::Whiteout("etc/.wh.gone"),
        Entry::Dir("data"),
        Entry::Opaque("data/.wh..wh..opq"),
        Entry::File("data/c", b"c"),
        Entry::Dir("bin"),
        Entry::File("bin/hello", b"#!/bin/sh\necho hello\n"),
    ]);
    let upper = owned_layer(&[
        ("etc/os", 0, 0, 0o644, Some(b"test-os 2\n")),
        ("home", 0, 0, 0o755, None),
        ("home/user", 1234, 5678, 0o700, None),
        ("home/user/owned", 1234, 5678, 0o640, Some(b"secret\n")),
    ]);
    let (desc, digest) = layout.image(&[lower, middle, upper], Comp::Gzip, &["PATH=/bin"], "amd64");
    layout.tag(desc, tag);
    digest
}

fn pull(store: &ImageStore, reference: &ImageRef) -> Image {
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(store.ensure(reference))
        .unwrap()
}

#[test]
fn the_ext4_image_shows_the_merged_layers_is_built_once_and_pruned_with_its_image() {
    let Some(dbg) = e2fsprogs() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    let digest = three_layers(&mut layout, "v1");
    let store = ImageStore::builder(tmp.path().join("cache"))
        .build()
        .unwrap();
    let reference: ImageRef = format!("oci:{}:v1", layout.dir.display()).parse().unwrap();
    let image = pull(&store, &reference);
    let before = store.usage().unwrap();

    // Two builders at once: one builds, the other waits for it and reuses the file.
    let (a, b) = std::thread::scope(|s| {
        let one = s.spawn(|| store.rootfs_image(&image).unwrap());
        let two = s.spawn(|| store.rootfs_image(&image).unwrap());
        (one.join().unwrap(), two.join().unwrap())
    });
    let img = a.path().to_path_buf();
    assert_eq!(
        img,
        store.root().join(format!("fsimages/{}.ext4", &digest[7..]))
    );
    assert_eq!(b.path(), img);
    assert_eq!(a.digest(), digest);
    let meta = std::fs::metadata(&img).unwrap();
    assert_eq!(meta.ino(), std::fs::metadata(b.path()).unwrap().ino());
    assert_eq!(a.size(), meta.len());
    assert_eq!(a.size() % (1 << 20), 0);
    assert_eq!(meta.permissions().mode() & 0o777, 0o444);
    assert!(
        common::files_under(&store.root().join("tmp")).is_empty(),
        "the staging directory is gone"
    );
    assert!(store.usage().unwrap() > before, "usage counts the image");

    // The merged view: whiteout-ed file absent, opaque directory holding only the upper
    // layer's entries, the upper layer's copy of a file, the symlink as it was.
    assert_eq!(ls(&dbg, &img, "/"), ["bin", "data", "etc", "home", "usr"]);
    assert_eq!(ls(&dbg, &img, "/etc"), ["alias", "os"]);
    assert_eq!(ls(&dbg, &img, "/data"), ["c"]);
    assert_eq!(debugfs(&dbg, &img, "cat /etc/os"), "test-os 2\n");
    assert_eq!(debugfs(&dbg, &img, "cat /data/c"), "c");
    assert_eq!(
        debugfs(&dbg, &img, "cat /usr/lib/nested/file.txt"),
        "nested\n"
    );
    assert_eq!(
        debugfs(&dbg, &img, "cat /bin/hello"),
        "#!/bin/sh\necho hello\n"
    );
    let alias = debugfs(&dbg, &img, "stat /etc/alias");
    assert!(alias.contains("Type: symlink"), "{alias}");
    assert!(alias.contains("Fast link dest: \"/etc/os\""), "{alias}");
    // No overlay attributes made it in.
    let ea = debugfs(&dbg, &img, "ea_list /data");
    assert!(!ea.contains("overlay"), "{ea}");
    let owned = debugfs(&dbg, &img, "stat /home/user/owned");
    assert!(owned.contains("Mode:  0640"), "{owned}");
    if nix::unistd::geteuid().is_root() {
        // The image's owners (a rootless cache has only the caller's).
        assert_eq!(stat_field(&owned, "User:"), "1234", "{owned}");
        assert_eq!(stat_field(&owned, "Group:"), "5678", "{owned}");
        let dir = debugfs(&dbg, &img, "stat /home/user");
        assert!(dir.contains("Mode:  0700"), "{dir}");
        assert_eq!(stat_field(&dir, "User:"), "1234", "{dir}");
    }
    let root = debugfs(&dbg, &img, "stat /");
    assert_eq!(stat_field(&root, "User:"), "0", "{root}");
    if let Some(fsck) = ["/usr/sbin/e2fsck", "/sbin/e2fsck"]
        .iter()
        .find(|p| Path::new(p).is_file())
    {
        let out = Command::new(fsck).arg("-fn").arg(&img).output().unwrap();
        assert!(
            out.status.success(),
            "e2fsck: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Asked again: the same file, not rebuilt.
    let again = store.rootfs_image(&image).unwrap();
    let meta2 = std::fs::metadata(again.path()).unwrap();
    assert_eq!(
        (meta2.ino(), meta2.mtime(), meta2.mtime_nsec()),
        (meta.ino(), meta.mtime(), meta.mtime_nsec())
    );
    let listed = store.list().unwrap();
    assert!(listed[0].bytes >= meta.blocks() * 512);

    // Removing the image removes its filesystem image (and any leftover there), but only
    // once nothing holds the image.
    std::fs::write(store.root().join("fsimages/leftover"), b"junk").unwrap();
    let report = store.remove(&reference.to_string()).unwrap();
    assert_eq!(report.fs_images, 1, "only the leftover: {report:?}");
    assert!(img.is_file(), "in use: kept");
    drop((a, b, again, image));
    let report = store.prune().unwrap();
    assert_eq!(report.fs_images, 1, "{report:?}");
    assert!(!img.exists());
    assert!(common::files_under(&store.root().join("fsimages")).is_empty());
    assert_eq!(store.usage().unwrap(), 0);
}

#[test]
fn a_failed_build_keeps_nothing_and_says_why() {
    if e2fsprogs().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    three_layers(&mut layout, "v1");
    let cache = tmp.path().join("cache");
    let reference: ImageRef = format!("oci:{}:v1", layout.dir.display()).parse().unwrap();
    let image = pull(&ImageStore::builder(&cache).build().unwrap(), &reference);
    let left = |store: &ImageStore| {
        let mut v = common::files_under(&store.root().join("fsimages"));
        v.extend(common::files_under(&store.root().join("tmp")));
        v
    };

    // No mkfs.ext4.
    let store = ImageStore::builder(&cache)
        .mkfs_ext4(tmp.path().join("nowhere/mkfs.ext4"))
        .build()
        .unwrap();
    let e = store.rootfs_image(&image).unwrap_err();
    assert!(matches!(e, ImageError::MissingMkfs { .. }), "{e}");
    assert!(e.to_string().contains("e2fsprogs"), "{e}");

    // One that fails: its stderr is in the error.
    let bin = tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let script = |name: &str, body: &str| {
        let p = bin.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    };
    let failing = script("failing", "echo 'mkfs.ext4: something broke' >&2; exit 1");
    let store = ImageStore::builder(&cache)
        .mkfs_ext4(&failing)
        .build()
        .unwrap();
    let e = store.rootfs_image(&image).unwrap_err();
    match &e {
        ImageError::FsImage { stderr, .. } => assert!(stderr.contains("something broke"), "{e}"),
        other => panic!("{other}"),
    }
    assert!(left(&store).is_empty(), "{:?}", left(&store));

    // One that always runs out of room: retried larger, then an error.
    let runs = tmp.path().join("runs");
    let full = script(
        "full",
        &format!(
            "echo run >> {}; echo 'mkfs.ext4: Could not allocate block in ext2 filesystem while populating file system' >&2; exit 1",
            runs.display()
        ),
    );
    let store = ImageStore::builder(&cache)
        .mkfs_ext4(&full)
        .build()
        .unwrap();
    let e = store.rootfs_image(&image).unwrap_err();
    assert!(e.to_string().contains("ran out of room"), "{e}");
    assert_eq!(std::fs::read_to_string(&runs).unwrap().lines().count(), 4);
    assert!(left(&store).is_empty(), "{:?}", left(&store));

    // The real one still builds it.
    let store = ImageStore::builder(&cache).build().unwrap();
    assert!(store.rootfs_image(&image).unwrap().path().is_file());
}
