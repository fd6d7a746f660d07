//! Landlock: the sandbox may write only under `/workspace`, `/tmp`, `/dev/shm`, writable spec
//! mounts, and to a few device files. Reads are confined by the mount namespace instead.
//!
//! The library decides the rules; the init creates the ruleset after `pivot_root` (so the
//! paths name the sandbox's own mounts) and restricts itself, so every exec inherits it.

const NR_CREATE: libc::c_long = 444;
const CREATE_RULESET_VERSION: u32 = 1;

/// Write-side filesystem rights, by the ABI that introduced them.
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
const REFER: u64 = 1 << 13; // ABI 2
/// Truncation (ABI 3).
pub(crate) const TRUNCATE: u64 = 1 << 14;

/// Everything that writes to a directory tree.
pub(crate) fn tree_rights(abi: u32) -> u64 {
    handled(abi)
}

/// Rights that apply to a single file.
pub(crate) fn file_rights(abi: u32) -> u64 {
    handled(abi) & (WRITE_FILE | TRUNCATE)
}

/// The rights we handle (i.e. deny unless a rule grants them) on this ABI.
pub(crate) fn handled(abi: u32) -> u64 {
    let mut r = WRITE_FILE
        | REMOVE_DIR
        | REMOVE_FILE
        | MAKE_CHAR
        | MAKE_DIR
        | MAKE_REG
        | MAKE_SOCK
        | MAKE_FIFO
        | MAKE_BLOCK
        | MAKE_SYM;
    if abi >= 2 {
        r |= REFER;
    }
    if abi >= 3 {
        r |= TRUNCATE;
    }
    r
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
