//! Shared by the backends' adversarial tests (`#[path]`-included, not part of the crate): a
//! host file that code in a sandbox must never reach through the host-side file API, and
//! the loop that calls that API while the sandbox swaps a workspace name between a file and
//! a symlink to it (issue 32: check-then-open by path lost that race, as root).

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use sandbox_core::{Error, Sandbox};

/// A host file outside any workspace, with known content, mode 0600 and owner.
pub struct Canary {
    _dir: tempfile::TempDir,
    /// Where it is (absolute, canonical).
    pub path: PathBuf,
    /// What it holds.
    pub content: Vec<u8>,
    mode: u32,
    uid: u32,
    gid: u32,
}

impl Canary {
    /// Makes one in a fresh folder under `/var/tmp`.
    pub fn new() -> Canary {
        let dir = tempfile::Builder::new()
            .prefix("host-canary-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let path = dir.path().canonicalize().unwrap().join("canary");
        let content = format!(
            "HOST-CANARY {} {:?}\n",
            std::process::id(),
            std::time::SystemTime::now()
        )
        .into_bytes();
        std::fs::write(&path, &content).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let md = std::fs::metadata(&path).unwrap();
        Canary {
            _dir: dir,
            path,
            content,
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
        }
    }

    /// Panics if its content, mode or owner changed.
    pub fn assert_unchanged(&self, when: &str) {
        let md = std::fs::symlink_metadata(&self.path).unwrap();
        assert!(md.is_file(), "{when}: the host canary is no longer a file");
        assert_eq!(
            (md.mode() & 0o7777, md.uid(), md.gid()),
            (self.mode, self.uid, self.gid),
            "{when}: the host canary's mode or owner changed"
        );
        assert_eq!(
            std::fs::read(&self.path).unwrap(),
            self.content,
            "{when}: the host canary's content changed"
        );
    }

    /// Whether `data` is (or holds) the canary's content.
    pub fn seen_in(&self, data: &[u8]) -> bool {
        data.windows(self.content.len()).any(|w| w == self.content)
    }

    /// A relative symlink target leading from directory `from` (a host path) to the canary:
    /// `../` up to `/`, then the canary's path.
    pub fn relative_from(&self, from: &Path) -> String {
        let from = from.canonicalize().unwrap();
        let ups = from
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .count();
        let mut s = "../".repeat(ups);
        s.push_str(self.path.to_str().unwrap().trim_start_matches('/'));
        s
    }
}

/// What [`hammer`] saw.
#[derive(Debug, Default)]
pub struct Hammered {
    /// Rounds run (one read and one write each).
    pub rounds: usize,
    /// Reads that returned data (the sandbox's file).
    pub reads_ok: usize,
    /// Calls refused as leaving the workspace (they met the symlink).
    pub escapes: usize,
    /// Writes that went through (to the sandbox's file).
    pub writes_ok: usize,
    /// Times a read met the other state than the read before (file, then link, or back):
    /// how many flips the loop saw.
    pub changes: usize,
}

/// Calls `read_file(path)` and `write_file(path, ...)` in a loop while code in `sb` flips
/// `path` between a regular file and a symlink to `canary`, until the reads have seen
/// `changes` flips, or for `limit`, whichever ends first. Panics as soon as a read returns the
/// canary's content or the canary changes (mode, owner, content).
pub async fn hammer(
    sb: &dyn Sandbox,
    path: &str,
    canary: &Canary,
    changes: usize,
    limit: Duration,
) -> Hammered {
    let start = Instant::now();
    let mut h = Hammered::default();
    let mut last: Option<bool> = None;
    while h.changes < changes && start.elapsed() < limit {
        let link = match sb.read_file(path).await {
            Ok(d) => {
                assert!(
                    !canary.seen_in(&d),
                    "round {}: read_file returned the host canary's content",
                    h.rounds
                );
                h.reads_ok += 1;
                Some(false)
            }
            Err(Error::PathEscape { .. }) => {
                h.escapes += 1;
                Some(true)
            }
            Err(_) => None,
        };
        if link.is_some() {
            if last.is_some() && last != link {
                h.changes += 1;
            }
            last = link;
        }
        match sb.write_file(path, b"written by the host-side API\n").await {
            Ok(()) => h.writes_ok += 1,
            Err(Error::PathEscape { .. }) => h.escapes += 1,
            Err(_) => {}
        }
        canary.assert_unchanged(&format!("round {}", h.rounds));
        h.rounds += 1;
        tokio::task::yield_now().await;
    }
    canary.assert_unchanged("after the loop");
    h
}

/// Waits (bounded) until `path` exists in the sandbox's workspace: the flipper runs.
pub async fn wait_for_flipper(sb: &dyn Sandbox, name: &str, limit: Duration) {
    let start = Instant::now();
    loop {
        if sb
            .list("")
            .await
            .is_ok_and(|l| l.iter().any(|e| e.name == name))
        {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "the code flipping /workspace/{name} never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The peak resident memory of this process so far (`VmHWM`), in bytes.
pub fn peak_rss() -> u64 {
    rss_field("VmHWM:")
}

/// The resident memory of this process now (`VmRSS`), in bytes.
pub fn rss() -> u64 {
    rss_field("VmRSS:")
}

fn rss_field(key: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// The Python that flips `/workspace/out` between a regular file and a symlink to `target`
/// (each swap an atomic rename, so the name always exists), until `/workspace/stop` exists or
/// `secs` pass; prints the number of flips.
pub fn python_flipper(target: &str, secs: u32) -> String {
    format!(
        r#"import os, time
os.chdir('/workspace')
end = time.time() + {secs}
n = 0
while time.time() < end and not os.path.exists('stop'):
    with open('out.tmp', 'w') as f:
        f.write('inside\n')
    os.replace('out.tmp', 'out')
    try:
        os.unlink('out.lnk')
    except FileNotFoundError:
        pass
    os.symlink({target:?}, 'out.lnk')
    os.replace('out.lnk', 'out')
    n += 1
print(n)
"#
    )
}
