//! Landlock: the sandbox may write only under `/workspace`, `/tmp`, `/dev/shm`, writable spec
//! mounts, and to a few device files. Reads are confined by the mount namespace instead.
//!
//! The library decides the rules; the init creates the ruleset after `pivot_root` (so the
//! paths name the sandbox's own mounts) and restricts itself, so every exec inherits it.
//!
//! Every ABI level is used at its best for writes: the domain handles every write-side
//! filesystem right the kernel's ABI knows. What each level brought, and what we do with it:
//!
//! | ABI | adds | here |
//! |---|---|---|
//! | 1 | filesystem rights: execute, read file/dir, write file, remove file/dir, make char/dir/reg/sock/fifo/block/sym | the write rights are handled; execute and reads are left to the mount namespace (everything mounted may be read and run) |
//! | 2 | `REFER` (link or rename across directories) | handled |
//! | 3 | `TRUNCATE` | handled |
//! | 4 | TCP bind/connect rights (`handled_access_net`) | not used: the network namespace (and the egress enforcer) decide the network, and loopback servers inside must keep working |
//! | 5 | `IOCTL_DEV` (ioctls on device files) | not used: no write right; `/dev` holds only a few fixed nodes and seccomp refuses the dangerous terminal ioctls |
//! | 6 | scopes (abstract UNIX sockets, signals) | not used: the network and pid namespaces already scope both |
//! | 7 | audit logging flags of `landlock_restrict_self` | nothing to handle (default logging) |
//!
//! A kernel newer than [`LATEST_ABI`] is used as that ABI.

const NR_CREATE: libc::c_long = 444;
const CREATE_RULESET_VERSION: u32 = 1;

// The write-side filesystem rights (`LANDLOCK_ACCESS_FS_*`), by the ABI that introduced
// them (the others, which we do not handle, are in the tests).
// ABI 1.
/// Writing to a file (ABI 1).
pub(crate) const WRITE_FILE: u64 = 1 << 1;
const REMOVE_DIR: u64 = 1 << 4;
const REMOVE_FILE: u64 = 1 << 5;
const MAKE_CHAR: u64 = 1 << 6;
const MAKE_DIR: u64 = 1 << 7;
const MAKE_REG: u64 = 1 << 8;
const MAKE_SOCK: u64 = 1 << 9;
const MAKE_FIFO: u64 = 1 << 10;
const MAKE_BLOCK: u64 = 1 << 11;
const MAKE_SYM: u64 = 1 << 12;
// ABI 2.
const REFER: u64 = 1 << 13;
/// Truncation (ABI 3).
pub(crate) const TRUNCATE: u64 = 1 << 14;

/// The newest ABI whose additions this module knows (and has decided about, see the table
/// above).
pub(crate) const LATEST_ABI: u32 = 7;

/// The write-side filesystem rights each ABI introduced (index: ABI - 1).
const WRITE_RIGHTS_BY_ABI: [u64; LATEST_ABI as usize] = [
    WRITE_FILE
        | REMOVE_DIR
        | REMOVE_FILE
        | MAKE_CHAR
        | MAKE_DIR
        | MAKE_REG
        | MAKE_SOCK
        | MAKE_FIFO
        | MAKE_BLOCK
        | MAKE_SYM,
    REFER,
    TRUNCATE,
    0,
    0,
    0,
    0,
];

/// Everything that writes to a directory tree.
pub(crate) fn tree_rights(abi: u32) -> u64 {
    handled(abi)
}

/// Rights that apply to a single file.
pub(crate) fn file_rights(abi: u32) -> u64 {
    handled(abi) & (WRITE_FILE | TRUNCATE)
}

/// The rights we handle (i.e. deny unless a rule grants them) on this ABI: every write-side
/// filesystem right up to it.
pub(crate) fn handled(abi: u32) -> u64 {
    up_to(&WRITE_RIGHTS_BY_ABI, abi)
}

/// The union of `by_abi`'s entries for ABIs 1 to `abi` (at most [`LATEST_ABI`]).
fn up_to(by_abi: &[u64], abi: u32) -> u64 {
    let n = usize::try_from(abi).unwrap_or(usize::MAX);
    by_abi.iter().take(n).fold(0, |all, r| all | r)
}

/// The kernel's Landlock ABI version, or `None` when Landlock is unavailable.
pub(crate) fn abi() -> Option<u32> {
    // SAFETY: landlock_create_ruleset(NULL, 0, VERSION) only returns a number.
    let v = unsafe {
        libc::syscall(
            NR_CREATE,
            std::ptr::null::<u8>(),
            0usize,
            CREATE_RULESET_VERSION,
        )
    };
    (v > 0).then(|| u32::try_from(v).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{FromRawFd, OwnedFd};

    // The filesystem rights we do not handle.
    const EXECUTE: u64 = 1 << 0;
    const READ_FILE: u64 = 1 << 2;
    const READ_DIR: u64 = 1 << 3;
    const IOCTL_DEV: u64 = 1 << 15; // ABI 5

    /// The filesystem rights the kernel knows at each ABI that we leave unhandled (reads and
    /// execution: the mount namespace confines them; device ioctls: see the module's table).
    const UNHANDLED_FS_BY_ABI: [u64; LATEST_ABI as usize] =
        [EXECUTE | READ_FILE | READ_DIR, 0, 0, 0, IOCTL_DEV, 0, 0];

    /// Every filesystem right the kernel knows at `abi`, handled or not.
    fn fs_rights(abi: u32) -> u64 {
        handled(abi) | up_to(&UNHANDLED_FS_BY_ABI, abi)
    }

    /// Whether this kernel accepts a ruleset handling `fs` (`struct landlock_ruleset_attr`
    /// with `handled_access_fs` only, as the init makes it).
    fn kernel_accepts(fs: u64) -> bool {
        let attr = fs;
        // SAFETY: landlock_create_ruleset with a valid 8-byte attr; the fd it may return is
        // ours (closed below).
        let fd = unsafe {
            libc::syscall(
                NR_CREATE,
                &attr as *const u64,
                std::mem::size_of::<u64>(),
                0u32,
            )
        };
        if fd < 0 {
            return false;
        }
        if let Ok(fd) = i32::try_from(fd) {
            // SAFETY: the kernel returned a new fd that we own.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        true
    }

    #[test]
    fn each_abi_handles_the_write_rights_it_introduced() {
        assert_eq!(handled(0), 0);
        let abi1 = WRITE_FILE
            | REMOVE_DIR
            | REMOVE_FILE
            | MAKE_CHAR
            | MAKE_DIR
            | MAKE_REG
            | MAKE_SOCK
            | MAKE_FIFO
            | MAKE_BLOCK
            | MAKE_SYM;
        assert_eq!(handled(1), abi1);
        assert_eq!(handled(2), abi1 | REFER);
        assert_eq!(handled(3), abi1 | REFER | TRUNCATE);
        for abi in 1..=LATEST_ABI {
            let new = WRITE_RIGHTS_BY_ABI[abi as usize - 1];
            assert_eq!(handled(abi) & new, new, "ABI {abi}");
            assert_eq!(
                handled(abi) & handled(abi - 1),
                handled(abi - 1),
                "ABI {abi}"
            );
            // Reads, execution and device ioctls are never handled.
            assert_eq!(
                handled(abi) & (EXECUTE | READ_FILE | READ_DIR | IOCTL_DEV),
                0
            );
        }
        // ABIs 4 to 7 add no write right: the write side is complete from ABI 3 on, and a
        // newer kernel is used as the latest ABI we know.
        for abi in 4..=LATEST_ABI + 3 {
            assert_eq!(handled(abi), handled(3), "ABI {abi}");
        }
        assert_eq!(handled(u32::MAX), handled(LATEST_ABI));
    }

    #[test]
    fn file_rules_grant_only_writing_and_truncating() {
        assert_eq!(file_rights(1), WRITE_FILE);
        assert_eq!(file_rights(2), WRITE_FILE);
        for abi in 3..=LATEST_ABI {
            assert_eq!(file_rights(abi), WRITE_FILE | TRUNCATE);
            assert_eq!(tree_rights(abi), handled(abi));
        }
    }

    #[test]
    fn the_rights_tables_cover_each_bit_once() {
        let mut seen = 0u64;
        for (i, r) in WRITE_RIGHTS_BY_ABI
            .iter()
            .chain(&UNHANDLED_FS_BY_ABI)
            .enumerate()
        {
            assert_eq!(seen & r, 0, "entry {i} repeats a right");
            seen |= r;
        }
        // Bits 0 to 15: every filesystem right up to ABI 7.
        assert_eq!(seen, (1 << 16) - 1);
    }

    /// This host's kernel (ABI 7 on the development machines): the library asks for the
    /// handled set of the ABI it reports, and the kernel must accept exactly that set; every
    /// filesystem right the kernel knows is either handled or deliberately left unhandled
    /// (a right of a newer ABI fails this until it is classified above).
    #[test]
    fn this_kernels_abi_is_handled_in_full() {
        let Some(abi) = abi() else {
            eprintln!("Landlock is unavailable on this kernel: nothing to check");
            return;
        };
        eprintln!("Landlock ABI {abi}");
        assert!(
            kernel_accepts(handled(abi)),
            "ABI {abi} refuses the handled set {:#x}",
            handled(abi)
        );
        let known = (0..64)
            .map(|bit| 1u64 << bit)
            .filter(|&r| kernel_accepts(r))
            .fold(0, |all, r| all | r);
        assert_eq!(
            known & !fs_rights(abi),
            0,
            "ABI {abi} knows filesystem rights {:#x} this module has not classified",
            known & !fs_rights(abi)
        );
        assert_eq!(
            known & fs_rights(abi),
            fs_rights(abi),
            "ABI {abi} lacks rights we expect of it"
        );
        // The write side (truncate and refer included) is handled from ABI 3 on.
        if abi >= 3 {
            assert_eq!(handled(abi) & (REFER | TRUNCATE), REFER | TRUNCATE);
        }
    }
}
