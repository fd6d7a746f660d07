//! Host uid ranges as root: each live sandbox maps ids 0..65536 inside to
//! `uid_base + slot * 65536` on the host, and no two live sandboxes on this host share a
//! slot, whichever process (or backend) made them.
//!
//! A slot is leased by holding an exclusive `flock` on the file `<dir>/<uid_base>-<slot>`
//! (an empty file in a root-only directory, never removed): the kernel releases the lock
//! when the lease's descriptor closes, which is when the sandbox's state is dropped or its
//! process dies, however it dies, so a crashed process never keeps a slot. A lease starts its
//! search at a random slot, so concurrent processes rarely try the same files; a free slot
//! costs an `open` and a `flock` (a few microseconds).
//!
//! Why it matters: two sandboxes with the same host uids are still apart (user, pid, mount,
//! network and IPC namespaces of their own), but the kernel keeps some per-user state by host
//! uid across namespaces (e.g. the `RLIMIT_MSGQUEUE` and locked-memory accounting of a user),
//! and a uid range of its own is what `docs/container.md` promises each sandbox.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Host uid ranges per uid base, so live sandboxes per host as root (65536 ids each;
/// `uid_base` is checked to leave room for all): 2^30 host ids from the default base 2^30, so
/// every id stays below 2^31 (tools that keep ids in a signed 32-bit integer see no negative
/// ones). Two backends with different bases must be 2^30 or more apart: leases are per base.
pub const SLOTS: u32 = 16384;

/// Where the lease files live (root-only).
pub(crate) const DIR: &str = "/run/agent-sandbox-slots";

/// A leased slot; the lease ends when this is dropped.
#[derive(Debug)]
pub(crate) struct SlotLease {
    slot: u32,
    /// The locked file: `None` for a slot taken without a lease (no usable directory).
    _lock: Option<File>,
    /// Set once another process holds the lock too (see [`SlotLease::handed_off`]): dropping
    /// this then only closes our descriptor.
    handed: std::sync::atomic::AtomicBool,
}

impl SlotLease {
    /// The slot: the sandbox's range starts at `uid_base + slot * 65536`.
    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }

    /// The locked file's descriptor, to pass to a process that keeps the lease after this
    /// one (a one-shot process's zygote, finishing its sandbox's teardown).
    pub(crate) fn lock_fd(&self) -> Option<std::os::fd::RawFd> {
        self._lock.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Records that another process holds a copy of [`SlotLease::lock_fd`]: the lock is
    /// then released when the last copy closes, never unlocked explicitly from here (an
    /// unlock would release it for every copy).
    pub(crate) fn handed_off(&self) {
        self.handed
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        // Unlocked explicitly rather than by the close alone: a child this multi-threaded
        // process is forking at that moment (between its clone and its exec) holds a copy
        // of the descriptor, and with it the lock, until it execs.
        if self.handed.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if let Some(f) = &self._lock {
            // SAFETY: flock on a descriptor we own; no pointers.
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
        }
    }
}

/// Why no slot could be leased.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SlotError {
    /// Every slot is leased.
    #[error(
        "every one of the {SLOTS} host uid ranges is in use by a live sandbox on this host \
         (destroy some, or give another backend a uid_base 2^30 or more away)"
    )]
    Exhausted,
    /// A lease file could not be opened (e.g. no file descriptors left).
    #[error("open the uid-range lease {}: {source}", path.display())]
    Open {
        /// The lease file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Leases a free slot of `uid_base` in [`DIR`]. Where that directory cannot be used (no
/// writable `/run`, or something else owns the path), `fallback` is taken without a lease,
/// saying so once in the log: ranges are then unique within this process only.
pub(crate) fn lease(uid_base: u32, fallback: u32) -> Result<SlotLease, SlotError> {
    match ensure_dir(Path::new(DIR)) {
        Ok(()) => lease_in(Path::new(DIR), uid_base, random_start()),
        Err(e) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    "no uid-range leases ({DIR}: {e}): sandboxes of other processes may share \
                     a host uid range with this process's"
                );
            });
            Ok(SlotLease {
                slot: fallback % SLOTS,
                _lock: None,
                handed: Default::default(),
            })
        }
    }
}

/// [`lease`] in `dir` (existing), trying slots from `start` on.
pub(crate) fn lease_in(dir: &Path, uid_base: u32, start: u32) -> Result<SlotLease, SlotError> {
    for i in 0..SLOTS {
        let slot = (start.wrapping_add(i)) % SLOTS;
        let path: PathBuf = dir.join(format!("{uid_base}-{slot}"));
        // Only root writes in the directory, so every slot's file opens alike: a failure is
        // this process's (no descriptors left...), not a taken slot.
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|source| SlotError::Open { path, source })?;
        // SAFETY: flock on a descriptor we own; no pointers.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(SlotLease {
                slot,
                _lock: Some(f),
                handed: Default::default(),
            });
        }
    }
    Err(SlotError::Exhausted)
}

/// Makes `dir` (0700) if missing; refuses one that is not a root-owned directory others
/// cannot write (a link or someone else's directory there would let them hold slots).
fn ensure_dir(dir: &Path) -> io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let m = std::fs::symlink_metadata(dir)?;
    if !m.is_dir() || m.uid() != 0 || m.mode() & 0o022 != 0 {
        return Err(io::Error::other(
            "not a root-owned directory that only root can write",
        ));
    }
    Ok(())
}

fn random_start() -> u32 {
    let b = uuid::Uuid::new_v4().into_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]]) % SLOTS
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::os::unix::process::CommandExt;

    #[test]
    fn live_leases_never_share_a_slot_and_a_dropped_one_is_free_again() {
        let dir = tempfile::tempdir().unwrap();
        let a = lease_in(dir.path(), 1 << 30, 7).unwrap();
        let b = lease_in(dir.path(), 1 << 30, 7).unwrap();
        let c = lease_in(dir.path(), 1 << 30, 7).unwrap();
        assert_eq!((a.slot(), b.slot(), c.slot()), (7, 8, 9));
        // Another base has slots of its own.
        assert_eq!(lease_in(dir.path(), 2 << 30, 7).unwrap().slot(), 7);
        drop(b);
        assert_eq!(lease_in(dir.path(), 1 << 30, 7).unwrap().slot(), 8);
        // The search wraps around past the last slot.
        let last = lease_in(dir.path(), 1 << 30, SLOTS - 1).unwrap();
        assert_eq!(last.slot(), SLOTS - 1);
        assert_eq!(lease_in(dir.path(), 1 << 30, SLOTS - 1).unwrap().slot(), 0);
    }

    #[test]
    fn a_lease_held_by_another_process_is_respected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("{}-{}", 1 << 30, 3));
        // Another process holds slot 3 (flock is per open file, so `flock(1)` in a child
        // process holding it stands for another library process).
        // `-o`: only flock itself holds the lock (its `sleep` does not inherit the file), so
        // the lock is gone once flock is reaped.
        let mut holder = std::process::Command::new("flock")
            .arg("-o")
            .arg(&path)
            .args(["sleep", "30"])
            .process_group(0)
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let f = File::open(&path);
            // SAFETY: flock on a descriptor we own.
            let taken = f.as_ref().is_ok_and(
                |f| unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0,
            );
            if taken {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "flock never took it");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(lease_in(dir.path(), 1 << 30, 3).unwrap().slot(), 4);
        // End flock and its `sleep` (the whole group); reaping flock releases the lock.
        let pgid = i32::try_from(holder.id()).unwrap();
        // SAFETY: kill on the process group we just made; no pointers.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        holder.wait().unwrap();
        // Its death released it. (Polled: a child another test of this binary forks at the
        // wrong moment holds a copy of a probe's descriptor, and its lock, until it execs.)
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let slot = lease_in(dir.path(), 1 << 30, 3).unwrap().slot();
            if slot == 3 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "slot 3 stayed taken: {slot}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn a_lease_file_that_cannot_be_opened_is_said_not_taken_for_a_full_host() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("gone");
        match lease_in(&gone, 1 << 30, 0) {
            Err(SlotError::Open { path, .. }) => assert!(path.starts_with(&gone), "{path:?}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_directory_others_could_write_is_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        assert!(ensure_dir(&open).is_err());
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&open, &link).unwrap();
        assert!(ensure_dir(&link).is_err());
    }
}
