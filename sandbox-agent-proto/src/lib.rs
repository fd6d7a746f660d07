//! Hand-written rather than serde/bincode/nix: the in-sandbox agents are std-only static
//! binaries compiled with plain `rustc` by build scripts, so this crate has no dependencies.
//!
//! What the three in-sandbox agents and their host sides share:
//!
//! - [`codec`]: the message codec primitives, [`Enc`] and [`Dec`] (little endian: `u8`,
//!   `u16`, `u32`, `i32`, `u64`, byte strings and UTF-8 strings as `u32` length + bytes,
//!   lists as `u32` count + items), with [`DecodeError`]s that say what was wrong where;
//!   decoding never panics and never reserves memory from a count the peer states beyond
//!   the bytes it actually sent.
//! - [`frame`]: frames on a byte stream, `[u32 payload length][u8 kind][u32 id][payload]`
//!   (little endian), read with a bound on the payload checked before anything is
//!   allocated.
//! - [`fnv1a`]: FNV-1a 64, computed at compile time over an agent's sources so that a host
//!   can tell an embedded agent built from other sources (a stale build output) from its own.
//! - [`pty`]: a new pseudo-terminal (`posix_openpt`, `grantpt`, `unlockpt`, the slave
//!   through `TIOCGPTPEER` or its name) and its window size.
//! - [`path`]: the `PATH` search of `execvp`.
//! - [`signals`]: every signal back at its default and an empty mask before a command's
//!   `execve` (the host's launchers use it too, through `sandbox_core::process`).
//!
//! Each agent keeps its own transport (a `SOCK_SEQPACKET` socket, a virtio console, a
//! process's pipes or a Unix socket) and its own message types on top of these.
//!
//! The crate is compiled twice: by cargo, for the host sides and the agents' workspace
//! packages (lints, tests), and by the agents' build scripts with plain `rustc` as an rlib
//! linked into the static agent binaries. Keep it std-only and dependency-free.

pub mod codec;
pub mod frame;
pub mod path;
pub mod pty;
pub mod signals;

pub use codec::{Dec, DecodeError, Enc};
pub use frame::{read_frame, write_frame, Header, ReadError, HEADER_LEN};

/// FNV-1a 64 of `b` (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`); a `const
/// fn`, so an agent's source hash is computed at compile time.
pub const fn fnv1a(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < b.len() {
        h ^= b[i] as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    h
}

/// FNV-1a of this crate's sources, XORed: part of every agent's own source hash, since a
/// change here changes what the agents speak.
pub const SOURCE_HASH: u64 = fnv1a(include_bytes!("lib.rs"))
    ^ fnv1a(include_bytes!("codec.rs"))
    ^ fnv1a(include_bytes!("frame.rs"))
    ^ fnv1a(include_bytes!("path.rs"))
    ^ fnv1a(include_bytes!("pty.rs"))
    ^ fnv1a(include_bytes!("signals.rs"));

/// FNV-1a of every `.rs` file directly in `dir`, XORed, and their names (sorted): for each
/// agent's test that its `SOURCE_HASH` lists every source file (a module left out of the
/// list would let a stale embedded agent pass the host's check).
pub fn hash_sources_in(dir: &std::path::Path) -> std::io::Result<(u64, Vec<String>)> {
    let mut hash = 0;
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|x| x == "rs") {
            hash ^= fnv1a(&std::fs::read(&path)?);
            names.push(
                path.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    names.sort();
    Ok((hash, names))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn fnv1a_matches_reference_values() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    /// Every source file of the crate is part of [`SOURCE_HASH`].
    #[test]
    fn the_source_hash_covers_every_source() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let (hash, names) = hash_sources_in(&dir).unwrap();
        assert_eq!(hash, SOURCE_HASH, "sources: {names:?}");
    }
}
