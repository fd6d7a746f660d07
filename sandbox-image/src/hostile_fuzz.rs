//! A seeded, bounded fuzz of the two passes that write hostile layers to disk: unpacking
//! (`unpack`) and merging layers into a filesystem image's stage (`fsimage::Merger`).
//!
//! Random sequences of entries of every type, with names holding `..`, absolute prefixes,
//! repeated names and type changes of one name across entries, symlinks and hard links into a
//! canary tree beside the unpack directory. After every layer the canary tree (contents, kinds,
//! modes, owners, times) is unchanged and nothing exists outside the directories written.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use fastrand::Rng;

use crate::fsimage::Merger;
use crate::unpack::{unpack, Compression, LayerSpec};

/// What the canary tree looks like: every entry's kind, mode, owner, times, size, contents
/// (or link target).
fn snapshot(root: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(p) = todo.pop() {
        let m = fs::symlink_metadata(&p).unwrap();
        let what = if m.is_file() {
            String::from_utf8_lossy(&fs::read(&p).unwrap()).into_owned()
        } else if m.file_type().is_symlink() {
            fs::read_link(&p).unwrap().display().to_string()
        } else {
            String::new()
        };
        out.insert(
            p.clone(),
            format!(
                "{:o} {}:{} {} {} {what}",
                m.mode(),
                m.uid(),
                m.gid(),
                m.mtime(),
                m.len()
            ),
        );
        if m.is_dir() {
            for e in fs::read_dir(&p).unwrap() {
                todo.push(e.unwrap().path());
            }
        }
    }
    out
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A random entry name: one to three components of a small alphabet (so names repeat and
/// change type), sometimes with `..`, `.`, a leading `/` or `./`, or a whiteout prefix.
fn name(rng: &mut Rng) -> Vec<u8> {
    const PARTS: &[&[u8]] = &[
        b"a",
        b"b",
        b"c",
        b"d",
        b"..",
        b".",
        b".wh.a",
        b".wh..wh..opq",
    ];
    let mut out = match rng.usize(..8) {
        0 => b"/".to_vec(),
        1 => b"./".to_vec(),
        _ => Vec::new(),
    };
    for i in 0..=rng.usize(..3) {
        if i > 0 {
            out.push(b'/');
        }
        // Mostly plain names: `..` and whiteouts refuse or reshape the layer.
        let part = if rng.usize(..30) > 0 {
            PARTS[rng.usize(..4)]
        } else {
            *rng.choice(PARTS).unwrap()
        };
        out.extend_from_slice(part);
    }
    if rng.usize(..6) == 0 {
        out.push(b'/');
    }
    out
}

/// A tar of `n` random entries; links point into the canary tree, at `..`, or inside.
fn layer(rng: &mut Rng, canary: &Path, n: usize) -> Vec<u8> {
    use tar::EntryType as T;
    let canary_b = canary.as_os_str().as_bytes();
    let mut out = Vec::new();
    for _ in 0..n {
        let kind = rng
            .choice([
                T::Directory,
                T::Directory,
                T::Regular,
                T::Regular,
                T::Symlink,
                T::Symlink,
                T::Link,
                T::Fifo,
                T::Char,
                T::Block,
            ])
            .unwrap();
        let path = name(rng);
        // Symlinks lead into the canary tree half the time; hard links mostly stay inside.
        let outside = if kind == T::Link {
            rng.usize(..8) == 0
        } else {
            rng.bool()
        };
        let link: Vec<u8> = match (outside, rng.usize(..4)) {
            (true, 0) => canary_b.to_vec(),
            (true, 1) => [canary_b, b"/file"].concat(),
            (true, 2) => [canary_b, b"/dir"].concat(),
            (true, _) => b"../../../../../..".to_vec(),
            (false, _) => name(rng),
        };
        let data: &[u8] = if kind == T::Regular { b"pwned" } else { b"" };
        let modes = [0o777, 0o7777, 0o1777, 0o000, 0o644, 0o4755];
        let mut h = tar::Header::new_old();
        {
            let old = h.as_old_mut();
            let (p, l) = (path.len().min(99), link.len().min(99));
            old.name[..p].copy_from_slice(&path[..p]);
            if matches!(kind, T::Symlink | T::Link) {
                old.linkname[..l].copy_from_slice(&link[..l]);
            }
        }
        h.set_entry_type(kind);
        h.set_mode(rng.choice(modes).unwrap());
        h.set_uid(rng.choice([0, 1000, 65534]).unwrap());
        h.set_gid(rng.choice([0, 1000, 65534]).unwrap());
        h.set_size(data.len() as u64);
        h.set_mtime(1_600_000_000);
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

#[test]
fn random_hostile_layers_never_touch_anything_outside_their_directory() {
    let seed: u64 = std::env::var("UNPACK_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_1a7e_u64);
    let rounds = 200;
    let mut rng = Rng::with_seed(seed);
    let t = tempfile::tempdir().unwrap();
    let canary = t.path().join("canary");
    fs::create_dir_all(canary.join("dir/a")).unwrap();
    fs::write(canary.join("file"), "canary").unwrap();
    fs::write(canary.join("dir/a/b"), "deep").unwrap();
    std::os::unix::fs::symlink("/nonexistent", canary.join("link")).unwrap();
    for (p, m) in [
        ("file", 0o600),
        ("dir", 0o700),
        ("dir/a", 0o750),
        ("dir/a/b", 0o640),
    ] {
        fs::set_permissions(canary.join(p), fs::Permissions::from_mode(m)).unwrap();
    }
    let before = snapshot(&canary);
    let (mut unpacked, mut refused) = (0, 0);
    for round in 0..rounds {
        let work = t.path().join("work");
        fs::create_dir(&work).unwrap();
        let mut layers = Vec::new();
        for i in 0..3 {
            let n = 3 + rng.usize(..10);
            let tar = layer(&mut rng, &canary, n);
            let blob = work.join(format!("blob{i}"));
            fs::write(&blob, &tar).unwrap();
            let dest = work.join(format!("layer{i}"));
            fs::create_dir(&dest).unwrap();
            let diff_id = crate::digest::of(&tar);
            let spec = LayerSpec {
                blob_digest: None,
                diff_id: &diff_id,
                compression: Compression::None,
            };
            match unpack(&blob, &spec, &dest, 1 << 24) {
                Ok(_) => {
                    unpacked += 1;
                    layers.push(dest);
                }
                Err(_) => refused += 1,
            }
            assert_eq!(
                snapshot(&canary),
                before,
                "seed {seed} round {round} layer {i} changed the canary tree"
            );
        }
        // The layers that unpacked, merged as a filesystem image's stage.
        let stage = work.join("stage");
        fs::create_dir(&stage).unwrap();
        let mut m = Merger::new(&stage, nix::unistd::geteuid().is_root());
        let merged = layers
            .iter()
            .try_for_each(|l| m.merge(l))
            .and_then(|()| m.finish());
        drop(merged);
        assert_eq!(
            snapshot(&canary),
            before,
            "seed {seed} round {round}: the merge changed the canary tree"
        );
        assert_eq!(
            names(t.path()),
            ["canary", "work"],
            "seed {seed} round {round}: something was made outside"
        );
        crate::store::remove_tree(&work).unwrap();
    }
    // The fuzz reaches both outcomes: hostile entries refused, the rest unpacked.
    assert!(
        unpacked > 20 && refused > 20,
        "{unpacked} unpacked, {refused} refused"
    );
}
