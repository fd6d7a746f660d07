//! Seeded, bounded fuzzing of the hand-written archive code: the cpio "newc" writer and reader
//! ([`super::CpioWriter`], [`super::read_cpio`]) and the `ar` reader
//! ([`crate::guest::install::ar_members`]). Random, mutated and truncated inputs never make a
//! reader panic; whatever the writer accepts reads back as written. `ARCHIVE_FUZZ_SEED`
//! (decimal) replays another run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use fastrand::Rng;

use super::{read_cpio, CpioEntry, CpioWriter};
use crate::guest::install::ar_members;

/// The generator, seeded from `ARCHIVE_FUZZ_SEED` or a fixed seed, and the seed (printed on
/// failure).
fn seeded() -> (Rng, u64) {
    let seed = std::env::var("ARCHIVE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xa4c1_7e5e_ed00_0001_u64);
    (Rng::with_seed(seed), seed)
}

/// Up to `max` random bytes.
fn bytes(rng: &mut Rng, max: usize) -> Vec<u8> {
    let mut b = vec![0; rng.usize(..=max)];
    rng.fill(&mut b);
    b
}

/// A random archive path: components that are plain, empty, `.`, `..`, the trailer's name,
/// or hold a NUL.
fn path(rng: &mut Rng) -> String {
    const PARTS: [&str; 9] = [
        "a",
        "b",
        "bin",
        "x.ko",
        "",
        ".",
        "..",
        "TRAILER!!!",
        "n\0ul",
    ];
    let n = rng.usize(..4) + 1;
    let mut p: Vec<&str> = (0..n).map(|_| PARTS[rng.usize(..PARTS.len())]).collect();
    if rng.usize(..4) == 0 {
        p.insert(0, "");
    }
    p.join("/")
}

/// Every name in `entries` after its parent directory, no name twice, none unclean.
fn well_formed(entries: &[CpioEntry]) -> bool {
    let mut seen = std::collections::BTreeSet::new();
    entries.iter().all(|e| {
        let clean = !e.name.is_empty()
            && !e.name.contains('\0')
            && e.name != "TRAILER!!!"
            && e.name
                .split('/')
                .all(|c| !c.is_empty() && c != "." && c != "..");
        let parent_first = e
            .name
            .rsplit_once('/')
            .is_none_or(|(dir, _)| seen.contains(dir));
        clean && parent_first && seen.insert(e.name.clone())
    })
}

/// An entry the writer accepted: (name, mode, data, rdev).
type Expected = (String, u32, Vec<u8>, (u32, u32));

#[test]
fn random_cpio_archives_read_back_as_written() {
    let (mut rng, seed) = seeded();
    for round in 0..2_000 {
        let mut w = CpioWriter::new();
        // What each accepted call should leave, by name.
        let mut want: Vec<Expected> = Vec::new();
        for _ in 0..rng.usize(..8) {
            let p = path(&mut rng);
            let perm = rng.u32(..);
            let data = bytes(&mut rng, 40);
            let (r, mode, body, rdev) = match rng.usize(..4) {
                0 => (w.dir(&p, perm), 0o040000, Vec::new(), (0, 0)),
                1 => (w.file(&p, perm, &data), 0o100000, data, (0, 0)),
                2 => {
                    let target = String::from_utf8_lossy(&data).into_owned();
                    let r = w.symlink(&p, &target);
                    (r, 0o120000, target.into_bytes(), (0, 0))
                }
                _ => {
                    let (ma, mi) = (rng.u32(..), rng.u32(..));
                    (w.char_dev(&p, perm, ma, mi), 0o020000, Vec::new(), (ma, mi))
                }
            };
            if r.is_ok() {
                let perm = if mode == 0o120000 {
                    0o777
                } else {
                    perm & 0o7777
                };
                let name: Vec<&str> = p.split('/').filter(|c| !["", "."].contains(c)).collect();
                want.push((name.join("/"), mode | perm, body, rdev));
            }
        }
        let archive = w.finish();
        let got = read_cpio(&archive).unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
        assert!(well_formed(&got), "seed {seed} round {round}: {got:?}");
        for (name, mode, data, rdev) in &want {
            let e = got.iter().find(|e| e.name == *name);
            let e = e.unwrap_or_else(|| panic!("seed {seed} round {round}: {name} missing"));
            // A directory added again keeps its first entry.
            if mode & 0o170000 != 0o040000 {
                assert_eq!(
                    (e.mode, &e.data, e.rdev),
                    (*mode, data, *rdev),
                    "seed {seed} round {round}: {name}"
                );
            }
        }
        // Every prefix short of the trailer's name (the 3 bytes after it are padding) is
        // refused: the trailer comes last. Mutations never panic.
        let cut = rng.usize(..archive.len() - 3);
        assert!(
            read_cpio(&archive[..cut]).is_err(),
            "seed {seed} round {round}: cut {cut}"
        );
        let mut bad = archive.clone();
        for _ in 0..rng.usize(..4) + 1 {
            let i = rng.usize(..bad.len());
            bad[i] = match rng.usize(..3) {
                0 => b"0123456789abcdefx"[rng.usize(..17)],
                _ => rng.u8(..),
            };
        }
        bad.truncate(rng.usize(..=bad.len()));
        if let Ok(entries) = read_cpio(&bad) {
            let total: usize = entries.iter().map(|e| e.data.len()).sum();
            assert!(total <= bad.len(), "seed {seed} round {round}");
        }
    }
}

#[test]
fn random_bytes_never_panic_the_cpio_reader() {
    let (mut rng, seed) = seeded();
    for round in 0..5_000 {
        let mut b = bytes(&mut rng, 400);
        if b.len() >= 110 && rng.bool() {
            // A header of hex digits (random sizes) so the reader gets past the magic.
            b[..6].copy_from_slice(b"070701");
            for x in &mut b[6..110] {
                *x = b"0123456789abcdef"[rng.usize(..16)];
            }
        }
        if let Ok(entries) = read_cpio(&b) {
            assert!(entries.len() <= b.len() / 110, "seed {seed} round {round}");
        }
    }
}

/// An `ar` archive of these members, as `ar` writes it (GNU names end in `/`).
fn ar(members: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut a = b"!<arch>\n".to_vec();
    for (name, body) in members {
        let header = format!(
            "{:<16}{:<12}{:<6}{:<6}{:<8}{:<10}`\n",
            format!("{name}/"),
            0,
            0,
            0,
            100644,
            body.len()
        );
        a.extend_from_slice(header.as_bytes());
        a.extend_from_slice(body);
        if body.len() % 2 == 1 {
            a.push(b'\n');
        }
    }
    a
}

#[test]
fn random_ar_archives_read_back_and_broken_ones_never_panic() {
    let (mut rng, seed) = seeded();
    for round in 0..3_000 {
        let members: Vec<(String, Vec<u8>)> = (0..rng.usize(..5))
            .map(|_| {
                let n = rng.usize(..15) + 1;
                let name: String = (0..n)
                    .map(|_| char::from(b"abz09._-"[rng.usize(..8)]))
                    .collect();
                (name, bytes(&mut rng, 30))
            })
            .collect();
        let a = ar(&members);
        let got = ar_members(&a).unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
        let got: Vec<(String, Vec<u8>)> = got.into_iter().map(|(n, d)| (n, d.to_vec())).collect();
        assert_eq!(got, members, "seed {seed} round {round}");
        // A truncated archive reads as a prefix of its members, or is refused.
        let cut = rng.usize(..=a.len());
        if let Ok(part) = ar_members(&a[..cut]) {
            assert!(part.len() <= members.len(), "seed {seed} round {round}");
            for ((n, d), (wn, wd)) in part.iter().zip(&members) {
                assert_eq!(
                    (n, *d),
                    (wn, &wd[..]),
                    "seed {seed} round {round}: cut {cut}"
                );
            }
        }
        // Mutated and random inputs never panic; what parses lies inside the input.
        let mut bad = a.clone();
        for _ in 0..rng.usize(..4) + 1 {
            let i = rng.usize(..bad.len());
            bad[i] = match rng.usize(..3) {
                0 => b" 0123456789+-`\n"[rng.usize(..15)],
                _ => rng.u8(..),
            };
        }
        bad.truncate(rng.usize(..=bad.len()));
        for input in [
            bad,
            bytes(&mut rng, 200),
            [&b"!<arch>\n"[..], &bytes(&mut rng, 200)].concat(),
        ] {
            if let Ok(m) = ar_members(&input) {
                let total: usize = m.iter().map(|(_, d)| d.len()).sum();
                assert!(total <= input.len(), "seed {seed} round {round}");
            }
        }
    }
}
