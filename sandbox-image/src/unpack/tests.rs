//! Unpacking well-formed and hostile layers. Hostile tars are written header by header, since
//! `tar::Builder` itself refuses `..` paths.

use std::os::unix::fs::{FileTypeExt, MetadataExt};

use super::*;

/// One tar entry: (type, path, link target, contents, mode).
struct E<'a>(tar::EntryType, &'a [u8], &'a [u8], &'a [u8], u32);

fn tar_of(entries: &[E<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    for E(kind, path, link, data, mode) in entries {
        let mut h = tar::Header::new_old();
        {
            let old = h.as_old_mut();
            old.name[..path.len()].copy_from_slice(path);
            old.linkname[..link.len()].copy_from_slice(link);
        }
        h.set_entry_type(*kind);
        h.set_mode(*mode);
        h.set_size(data.len() as u64);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

struct Fixture {
    _tmp: tempfile::TempDir,
    blob: PathBuf,
    dest: PathBuf,
    diff_id: String,
    blob_digest: String,
}

fn fixture(tar: &[u8], gzip: bool) -> Fixture {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let blob = tmp.path().join("blob");
    let bytes = if gzip {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let _ = enc.write_all(tar);
        enc.finish().unwrap_or_default()
    } else {
        tar.to_vec()
    };
    let _ = fs::write(&blob, &bytes);
    let dest = tmp.path().join("layer");
    let _ = fs::create_dir(&dest);
    Fixture {
        blob_digest: crate::digest::of(&bytes),
        diff_id: crate::digest::of(tar),
        _tmp: tmp,
        blob,
        dest,
    }
}

fn run(f: &Fixture, gzip: bool) -> Result<Unpacked> {
    unpack(
        &f.blob,
        &LayerSpec {
            blob_digest: Some(&f.blob_digest),
            diff_id: &f.diff_id,
            compression: if gzip {
                Compression::Gzip
            } else {
                Compression::None
            },
        },
        &f.dest,
        1 << 30,
    )
}

use tar::EntryType as T;

#[test]
fn a_normal_layer_unpacks_with_modes_links_and_whiteouts() {
    let tar = tar_of(&[
        E(T::Directory, b"./usr/", b"", b"", 0o755),
        E(T::Directory, b"usr/bin", b"", b"", 0o755),
        E(
            T::Regular,
            b"usr/bin/tool",
            b"",
            b"#!/bin/sh\necho hi\n",
            0o4755,
        ),
        E(T::Symlink, b"usr/bin/alias", b"/usr/bin/tool", b"", 0o777),
        E(T::Link, b"usr/bin/hard", b"usr/bin/tool", b"", 0o755),
        E(T::Regular, b"/etc/.wh.removed", b"", b"", 0o644),
        E(T::Regular, b"var/cache/.wh..wh..opq", b"", b"", 0o644),
        E(T::Char, b"dev/null", b"", b"", 0o666),
        E(T::Directory, b"tmp", b"", b"", 0o1777),
    ]);
    for gzip in [false, true] {
        let f = fixture(&tar, gzip);
        let stats = run(&f, gzip).unwrap_or_else(|e| panic!("unpack: {e}"));
        assert_eq!(stats.skipped_devices, 1);
        let tool = f.dest.join("usr/bin/tool");
        let m = fs::metadata(&tool).unwrap_or_else(|e| panic!("{e}"));
        // The set-uid bit is cleared; the rest of the mode and the mtime are kept.
        assert_eq!(m.mode() & 0o7777, 0o755);
        assert_eq!(m.mtime(), 1_700_000_000);
        assert_eq!(
            fs::read_link(f.dest.join("usr/bin/alias")).ok(),
            Some(PathBuf::from("/usr/bin/tool"))
        );
        assert_eq!(
            fs::metadata(f.dest.join("usr/bin/hard"))
                .map(|m| m.ino())
                .ok(),
            Some(m.ino())
        );
        assert!(!f.dest.join("dev/null").exists());
        assert_eq!(
            fs::metadata(f.dest.join("tmp"))
                .map(|m| m.mode() & 0o7777)
                .ok(),
            Some(0o1777)
        );
        let wh = f.dest.join("etc/removed");
        if nix::unistd::geteuid().is_root() {
            let m = fs::symlink_metadata(&wh).unwrap_or_else(|e| panic!("{e}"));
            assert!(m.file_type().is_char_device());
            assert_eq!(m.rdev(), 0);
            assert_eq!(
                xattr::get(f.dest.join("var/cache"), "trusted.overlay.opaque")
                    .ok()
                    .flatten(),
                Some(b"y".to_vec())
            );
        }
        assert_eq!(
            xattr::get(f.dest.join("var/cache"), "user.overlay.opaque")
                .ok()
                .flatten(),
            Some(b"y".to_vec())
        );
    }
}

/// Unpacks `entries` and expects a refusal naming `entry` and containing `why`.
fn refused(entries: &[E<'_>], entry: &str, why: &str) {
    let tar = tar_of(entries);
    let f = fixture(&tar, false);
    match run(&f, false) {
        Err(ImageError::MaliciousLayer {
            entry: e, why: w, ..
        }) => {
            assert_eq!(e, entry);
            assert!(w.contains(why), "{w}");
        }
        other => panic!("expected a refusal of {entry}: {other:?}"),
    }
    // Nothing was written outside the layer directory.
    let outside: Vec<_> = fs::read_dir(f.dest.parent().unwrap_or(&f.dest))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    let mut outside: Vec<_> = outside
        .iter()
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    outside.sort();
    assert_eq!(outside, vec!["blob".to_owned(), "layer".to_owned()]);
}

#[test]
fn dot_dot_entries_are_refused() {
    refused(
        &[E(T::Regular, b"../escape", b"", b"x", 0o644)],
        "../escape",
        "`..`",
    );
    refused(
        &[E(T::Regular, b"a/../../escape", b"", b"x", 0o644)],
        "a/../../escape",
        "`..`",
    );
}

#[test]
fn writes_through_a_symlink_are_refused() {
    // An absolute symlink, then a file "inside" it: unpacking must not follow it to the host.
    refused(
        &[
            E(T::Symlink, b"etc", b"/etc", b"", 0o777),
            E(T::Regular, b"etc/agent-sandbox-pwned", b"", b"x", 0o644),
        ],
        "etc/agent-sandbox-pwned",
        "symlink",
    );
    assert!(!Path::new("/etc/agent-sandbox-pwned").exists());
    // The same through a relative symlink that climbs out.
    refused(
        &[
            E(T::Symlink, b"up", b"../../../../..", b"", 0o777),
            E(T::Directory, b"up/tmp", b"", b"", 0o755),
        ],
        "up/tmp",
        "symlink",
    );
}

#[test]
fn hard_links_out_of_the_layer_are_refused() {
    refused(
        &[E(T::Link, b"shadow", b"/etc/shadow", b"", 0o644)],
        "shadow",
        "not a file earlier in this layer",
    );
    refused(
        &[E(T::Link, b"shadow", b"../../etc/shadow", b"", 0o644)],
        "shadow",
        "outside the layer",
    );
    refused(
        &[
            E(T::Symlink, b"l", b"/etc", b"", 0o777),
            E(T::Link, b"shadow", b"l/shadow", b"", 0o644),
        ],
        "shadow",
        "without a symlink",
    );
}

#[test]
fn whiteouts_naming_dot_dot_are_refused() {
    refused(
        &[E(T::Regular, b"dir/.wh...", b"", b"", 0o644)],
        "dir/.wh...",
        "whiteout",
    );
}

#[test]
fn a_tampered_blob_or_layer_is_refused_and_a_budget_holds() {
    let tar = tar_of(&[E(T::Regular, b"f", b"", b"content", 0o644)]);
    let f = fixture(&tar, true);
    let wrong = "sha256:0000000000000000000000000000000000000000000000000000000000000000";
    let r = unpack(
        &f.blob,
        &LayerSpec {
            blob_digest: Some(wrong),
            diff_id: &f.diff_id,
            compression: Compression::Gzip,
        },
        &f.dest,
        1 << 20,
    );
    assert!(matches!(r, Err(ImageError::DigestMismatch { .. })), "{r:?}");
    let r = unpack(
        &f.blob,
        &LayerSpec {
            blob_digest: None,
            diff_id: wrong,
            compression: Compression::Gzip,
        },
        &f.dest,
        1 << 20,
    );
    assert!(matches!(r, Err(ImageError::DigestMismatch { .. })), "{r:?}");
    let big = vec![7u8; 100_000];
    let tar = tar_of(&[E(T::Regular, b"big", b"", &big, 0o644)]);
    let f = fixture(&tar, false);
    let r = unpack(
        &f.blob,
        &LayerSpec {
            blob_digest: None,
            diff_id: &f.diff_id,
            compression: Compression::None,
        },
        &f.dest,
        50_000,
    );
    assert!(matches!(r, Err(ImageError::CacheFull { .. })), "{r:?}");
    // A truncated blob is an unreadable tar, not a panic.
    let g = fixture(&tar[..1500], false);
    let r = unpack(
        &g.blob,
        &LayerSpec {
            blob_digest: None,
            diff_id: &g.diff_id,
            compression: Compression::None,
        },
        &g.dest,
        1 << 20,
    );
    assert!(r.is_err());
}

#[test]
fn compression_is_known_by_media_type_or_magic() {
    assert_eq!(
        Compression::from_media_type("application/vnd.docker.image.rootfs.diff.tar.gzip").ok(),
        Some(Compression::Gzip)
    );
    assert_eq!(
        Compression::from_media_type("application/vnd.oci.image.layer.v1.tar+zstd").ok(),
        Some(Compression::Zstd)
    );
    assert!(Compression::from_media_type("application/x-foreign").is_err());
    assert_eq!(Compression::sniff(&[0x1f, 0x8b, 8]), Compression::Gzip);
    assert_eq!(
        Compression::sniff(&[0x28, 0xb5, 0x2f, 0xfd]),
        Compression::Zstd
    );
    assert_eq!(Compression::sniff(b"usr/"), Compression::None);
}

/// A directory entry followed by a symlink of the same name (or at one of its parents): the
/// deferred mode pass must change nothing the link points at (it once `chmod`ed the host's
/// file to the directory's 0777, as root).
#[test]
fn a_directory_replaced_by_a_symlink_leaves_the_link_target_alone() {
    let host = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let file = host.path().join("secret");
    let dir = host.path().join("sub");
    fs::write(&file, "secret").unwrap_or_else(|e| panic!("{e}"));
    fs::create_dir(&dir).unwrap_or_else(|e| panic!("{e}"));
    fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).unwrap_or_else(|e| panic!("{e}"));
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap_or_else(|e| panic!("{e}"));
    let (file_b, host_b) = (
        file.as_os_str().as_bytes().to_vec(),
        host.path().as_os_str().as_bytes().to_vec(),
    );
    let layers = [
        // The name itself becomes a link to a host file.
        tar_of(&[
            E(T::Directory, b"x/", b"", b"", 0o777),
            E(T::Symlink, b"x", &file_b, b"", 0o777),
        ]),
        // A parent becomes a link to a host directory holding a directory of the same name.
        tar_of(&[
            E(T::Directory, b"p/", b"", b"", 0o755),
            E(T::Directory, b"p/sub/", b"", b"", 0o777),
            E(T::Symlink, b"p", &host_b, b"", 0o777),
        ]),
    ];
    for tar in layers {
        let f = fixture(&tar, false);
        // Refused or unpacked, either is fine; the host's modes are not.
        let _ = run(&f, false);
        let mode = |p: &Path| fs::metadata(p).map(|m| m.mode() & 0o7777).ok();
        assert_eq!(mode(&file), Some(0o600), "the host file's mode changed");
        assert_eq!(mode(&dir), Some(0o700), "the host directory's mode changed");
    }
}

#[test]
fn a_full_disk_while_copying_is_the_disks_error_not_the_layers() {
    // `/dev/full` fails every write with ENOSPC, as a full cache disk does.
    let mut full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let mut data: &[u8] = &[7u8; 100_000];
    match copy_apart(&mut data, &mut full) {
        Err(CopyFailure::Write(e)) => assert_eq!(e.raw_os_error(), Some(libc::ENOSPC)),
        Err(CopyFailure::Read(e)) => panic!("a write failure taken for a read failure: {e}"),
        Ok(n) => panic!("copied {n} bytes into /dev/full"),
    }
    // A stream that fails is the layer's.
    struct Broken;
    impl std::io::Read for Broken {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("cut"))
        }
    }
    let mut sink = tempfile::tempfile().unwrap();
    assert!(matches!(
        copy_apart(&mut Broken, &mut sink),
        Err(CopyFailure::Read(_))
    ));
    let mut some: &[u8] = b"abc";
    assert!(matches!(copy_apart(&mut some, &mut sink), Ok(3)));
}
