//! cgroup v2: one directory per sandbox in the unified hierarchy, its limits and
//! `cgroup.freeze`. (Whether the caller's cgroup may have sandbox children at all is
//! [`super::delegation`]'s concern.)

use std::fs;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use sandbox_core::Limits;

use super::{mkdir, pids_max, write, DirFd, SandboxCgroup};

/// Makes sandbox cgroup `cg`'s directory `name` under the caller's cgroup `parent` and
/// writes limits `l` (the memory and pids ones required when `mem_pids`: see
/// [`limit_v2`]).
pub(super) fn create(
    cg: &mut SandboxCgroup,
    parent: &Path,
    name: &str,
    l: &Limits,
    mem_pids: bool,
) -> io::Result<()> {
    let dir = parent.join(name);
    mkdir(&dir)?;
    cg.dirs.push(("unified".into(), dir.clone()));
    limit_v2(&dir, l, mem_pids)
}

/// Writes `l` to a v2 sandbox cgroup `dir`: `memory.max`, `pids.max` (required when
/// `mem_pids`: a missing file means the controller is not enabled for it, see
/// [`super::delegation::delegate_v2`]; else written where present), and where the host has them,
/// `memory.swap.max` = 0 and the `cpu.max` quota.
fn limit_v2(dir: &Path, l: &Limits, mem_pids: bool) -> io::Result<()> {
    let d = DirFd::open(dir)?;
    let optional = |r: io::Result<()>| match r {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    };
    let required = |r: io::Result<()>| if mem_pids { r } else { optional(r) };
    required(d.write("memory.max", &l.memory_bytes.to_string()))?;
    required(d.write("pids.max", &pids_max(l).to_string()))?;
    // No swap controller (no swap accounting): nothing to keep out of swap through it.
    optional(d.write("memory.swap.max", "0"))?;
    let period = 100_000u64;
    let quota = (u64::from(l.cpu_millis) * period / 1000).max(1000);
    optional(d.write("cpu.max", &format!("{quota} {period}")))
}

/// Freezes (or thaws) every process of cgroup `d` and waits until it is done.
pub(super) fn freeze(d: &Path, frozen: bool) -> io::Result<()> {
    write(&d.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
    let deadline = Instant::now() + Duration::from_secs(5);
    let want = if frozen { "frozen 1" } else { "frozen 0" };
    loop {
        let ev = fs::read_to_string(d.join("cgroup.events"))?;
        if ev.lines().any(|l| l.trim() == want) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("cgroup.events still not `{want}` after 5 s"),
            ));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::super::testing::{unified_or_skip, Scratch};
    use super::super::{kill_procs, CgroupVersion};
    use super::*;

    #[test]
    fn v2_limits_are_written_and_a_missing_controller_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let mut l = Limits::default();
        (l.memory_bytes, l.pids, l.cpu_millis) = (64 << 20, 30, 500);
        // A cgroup with memory and pids but no cpu controller and no swap accounting.
        for f in ["memory.max", "pids.max"] {
            fs::write(d.path().join(f), "").unwrap();
        }
        limit_v2(d.path(), &l, true).unwrap();
        let read = |f: &str| fs::read_to_string(d.path().join(f)).unwrap();
        assert_eq!(read("memory.max"), (64u64 << 20).to_string());
        assert_eq!(
            read("pids.max"),
            "32",
            "the init and its spare supervisor count too"
        );
        assert!(!d.path().join("cpu.max").exists(), "never created");
        // With cpu and swap.
        for f in ["cpu.max", "memory.swap.max"] {
            fs::write(d.path().join(f), "").unwrap();
        }
        limit_v2(d.path(), &l, true).unwrap();
        assert_eq!(read("cpu.max"), "50000 100000");
        assert_eq!(read("memory.swap.max"), "0");
        // No pids controller enabled for it: the error names the file.
        fs::remove_file(d.path().join("pids.max")).unwrap();
        let e = limit_v2(d.path(), &l, true).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains("pids.max"), "{e}");
        // Without limits (`allow_v2_without_limits`): what is there is still written.
        fs::write(d.path().join("memory.max"), "").unwrap();
        l.memory_bytes = 1 << 30;
        limit_v2(d.path(), &l, false).unwrap();
        assert_eq!(read("memory.max"), (1u64 << 30).to_string());
        assert!(!d.path().join("pids.max").exists());
    }

    /// The unified hierarchy's mount point, if this process sits at its root and we are
    /// root, with one controller its root offers (enabled for its children by the caller

    #[test]
    fn v2_freeze_thaw_kill_and_remove_on_the_real_unified_hierarchy() {
        let Some((mnt, _)) = unified_or_skip("v2 freeze and kill") else {
            return;
        };
        let dir = mnt.join(format!("asb-test-{}-freeze", std::process::id()));
        fs::create_dir(&dir).unwrap();
        let _scratch = Scratch {
            mnt,
            dirs: vec![dir.clone()],
            enabled: None,
        };
        let mut child = std::process::Command::new("sh")
            .args(["-c", "while :; do sleep 0.01; done"])
            .spawn()
            .unwrap();
        fs::write(dir.join("cgroup.procs"), child.id().to_string()).unwrap();
        let cg = SandboxCgroup {
            version: CgroupVersion::V2,
            dirs: vec![("unified".into(), dir.clone())],
            recycle: None,
        };
        assert!(cg.can_freeze());
        let events = || fs::read_to_string(dir.join("cgroup.events")).unwrap();
        cg.freeze(true).unwrap();
        assert!(events().contains("frozen 1"), "{}", events());
        cg.freeze(false).unwrap();
        assert!(events().contains("frozen 0"), "{}", events());
        // The shell and whatever `sleep` it has running go at once.
        assert!(kill_procs(&dir));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert_eq!(fs::read_to_string(dir.join("cgroup.procs")).unwrap(), "");
        assert_eq!(cg.remove(Duration::from_secs(2)), Vec::<PathBuf>::new());
        assert!(!dir.exists());
    }
}
