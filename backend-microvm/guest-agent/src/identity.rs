//! A fresh identity for a guest just booted or restored from a snapshot (`Refresh`): its
//! hostname, its random state and its clock. Copies restored from one snapshot would
//! otherwise share the snapshot's random generator state (and so produce the same "random"
//! keys, ids and nonces), its wall clock and its name.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;

use crate::{c_char, c_int};

extern "C" {
    fn sethostname(name: *const c_char, len: usize) -> c_int;
    fn clock_settime(clock: c_int, tp: *const Timespec) -> c_int;
}

/// `struct timespec`.
#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}

const CLOCK_REALTIME: c_int = 0;
/// `_IOW('R', 0x03, int[2])`: mix bytes into the input pool, crediting them.
const RNDADDENTROPY: u64 = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the random generator from the pool now.
const RNDRESEEDCRNG: u64 = 0x5207;
/// The most entropy bytes one refresh takes.
pub(crate) const MAX_ENTROPY: usize = 512;

/// 1-64 of `[A-Za-z0-9-]`, not starting or ending with `-`.
pub(crate) fn valid_hostname(h: &str) -> bool {
    (1..=64).contains(&h.len())
        && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !h.starts_with('-')
        && !h.ends_with('-')
}

/// Sets the hostname, mixes `entropy` in and reseeds, sets the wall clock; the error names
/// the step.
pub(crate) fn refresh(hostname: &str, entropy: &[u8], unix_nanos: u64) -> Result<(), String> {
    if !valid_hostname(hostname) {
        return Err(format!("hostname {hostname:?}: 1-64 of [A-Za-z0-9-]"));
    }
    if entropy.is_empty() || entropy.len() > MAX_ENTROPY {
        return Err(format!(
            "entropy: 1-{MAX_ENTROPY} bytes, got {}",
            entropy.len()
        ));
    }
    // SAFETY: a pointer and length into a live &str.
    if unsafe { sethostname(hostname.as_ptr().cast(), hostname.len()) } != 0 {
        return Err(format!("sethostname: {}", io::Error::last_os_error()));
    }
    reseed(entropy).map_err(|e| format!("reseeding the random generator: {e}"))?;
    let ts = Timespec {
        sec: i64::try_from(unix_nanos / 1_000_000_000).unwrap_or(i64::MAX),
        nsec: i64::try_from(unix_nanos % 1_000_000_000).unwrap_or(0),
    };
    // SAFETY: a pointer to a live, initialised timespec.
    if unsafe { clock_settime(CLOCK_REALTIME, &ts) } != 0 {
        return Err(format!("setting the clock: {}", io::Error::last_os_error()));
    }
    Ok(())
}

fn reseed(entropy: &[u8]) -> io::Result<()> {
    let f = OpenOptions::new().write(true).open("/dev/urandom")?;
    // `struct rand_pool_info`: entropy_count (bits), buf_size (bytes), then the bytes.
    let n = i32::try_from(entropy.len()).map_err(|_| io::ErrorKind::InvalidInput)?;
    let mut info = Vec::with_capacity(8 + entropy.len() + 3);
    info.extend_from_slice(&(n * 8).to_ne_bytes());
    info.extend_from_slice(&n.to_ne_bytes());
    info.extend_from_slice(entropy);
    while info.len() % 4 != 0 {
        info.push(0);
    }
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of `buf_size` bytes after its header,
    // which `info` holds; RNDRESEEDCRNG takes no argument.
    unsafe {
        if crate::interactive::ioctl(f.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) != 0 {
            return Err(io::Error::last_os_error());
        }
        if crate::interactive::ioctl(f.as_raw_fd(), RNDRESEEDCRNG, 0) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames_and_entropy_are_checked_before_anything_changes() {
        for ok in ["mvm-0123abcd", "a", &"x".repeat(64)] {
            assert!(valid_hostname(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "a.b", "a b", &"x".repeat(65), "ü"] {
            assert!(!valid_hostname(bad), "{bad}");
        }
        // Refused before any system call: safe to run on a host.
        assert!(refresh("bad name", &[1], 0)
            .unwrap_err()
            .contains("hostname"));
        assert!(refresh("ok", &[], 0).unwrap_err().contains("entropy"));
        assert!(refresh("ok", &[0; MAX_ENTROPY + 1], 0)
            .unwrap_err()
            .contains("entropy"));
    }
}
