//! Process limits of a host that keeps many sandboxes alive.
//!
//! Each live sandbox holds a few descriptors in the process that made it (the container
//! tier: 5, see docs/benchmarks.md's density table), so the common default soft limit of
//! 1,024 open files stops a server at about two hundred sandboxes. A process that serves
//! sandboxes raises the limit once at start, as container engines' service units do
//! (`LimitNOFILE=infinity`): `agent-sandbox serve` does.

use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// The hard limit a privileged process asks for (container engines' common value), when the
/// kernel's `fs.nr_open` allows it.
const WANTED: u64 = 1 << 20;

/// Raises this process's open-files limit as far as it may, up to 2^20: the soft limit to
/// the hard one (or 2^20 where the hard one is higher), and, where the process may raise the
/// hard limit (root, `CAP_SYS_RESOURCE`), both to 2^20 (or the kernel's `fs.nr_open`, if
/// lower). Never lowers it. Returns the soft limit in force after.
///
/// Child processes inherit the limit; the tiers set each sandboxed command's own
/// (`Limits::open_files`), so sandboxes do not.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    let ceiling = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(hard)
        .min(WANTED);
    if hard < ceiling && setrlimit(Resource::RLIMIT_NOFILE, ceiling, ceiling).is_ok() {
        return Ok(ceiling);
    }
    // Never past 2^20 (a hard limit of "infinity" would hand children a table programs
    // that close every possible descriptor walk through), never lowered.
    let want = hard.min(WANTED).max(soft);
    if soft < want {
        setrlimit(Resource::RLIMIT_NOFILE, want, hard)?;
    }
    Ok(want)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_soft_limit_ends_at_the_hard_one_up_to_2_to_the_20() {
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        let got = raise_open_files_limit().unwrap();
        let (soft, hard_after) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        assert_eq!(got, soft);
        assert_eq!(
            soft,
            hard_after.min(WANTED).max(soft),
            "the soft limit is raised to the hard one, up to 2^20"
        );
        assert!(hard_after >= hard, "never lowered: {hard_after} < {hard}");
        // Idempotent.
        assert_eq!(raise_open_files_limit().unwrap(), soft);
    }
}
