//! One identity model for host-directory workspaces (see "Identity" in `docs/container.md`):
//! commands run as the sandbox's unprivileged user, which owns the workspace through an
//! idmapped mount; what it writes there belongs to the directory's owner on the host. Tested
//! as a user would: `git init && git commit`, `mkdir`, `touch` and the file API in a
//! directory owned by uid 1234, in every setup path (template, classic, an image's root),
//! a read-only one refusing writes with `EROFS`, and the fallback on a filesystem that
//! cannot be idmapped (ramfs).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{backend, sh, sh_ok};
use sandbox_core::{Backend, Error, Language, ResolvedSecrets, Sandbox, SandboxSpec};

/// The owner of the test directories: an unprivileged uid/gid with no name on this host.
const OWNER: u32 = 1234;

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Skips the test unless the host runs containers and we are root (the tests chown
/// directories; rootless, the caller's own directories are what a sandbox writes, tested in
/// `rootless.rs`).
macro_rules! require_root_host {
    () => {
        require_host!();
        if !is_root() {
            eprintln!("SKIP: needs root (directories of another owner)");
            return;
        }
    };
}

/// A fresh directory owned by `uid:gid`, with `in.txt` (mode 0600, the owner's) in it.
fn owned_dir(uid: u32, gid: u32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("in.txt");
    std::fs::write(&f, "from the owner\n").unwrap();
    std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    for p in [dir.path(), f.as_path()] {
        std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
    }
    dir
}

/// Every entry under `dir` (itself included) with its owner, depth first.
fn owners(dir: &Path) -> Vec<(PathBuf, u32, u32)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(p) = todo.pop() {
        let md = std::fs::symlink_metadata(&p).unwrap();
        if md.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                todo.push(e.unwrap().path());
            }
        }
        out.push((p, md.uid(), md.gid()));
    }
    out
}

/// Asserts that everything under `dir` belongs to `uid:gid` on the host; returns how many
/// entries there are.
fn assert_all_owned_by(dir: &Path, uid: u32, gid: u32) -> usize {
    let all = owners(dir);
    let foreign: Vec<_> = all
        .iter()
        .filter(|(_, u, g)| (*u, *g) != (uid, gid))
        .collect();
    assert!(
        foreign.is_empty(),
        "entries not owned by {uid}:{gid}: {foreign:?}"
    );
    all.len()
}

fn spec_for(dir: &Path, read_only: bool) -> sandbox_core::SpecBuilder {
    SandboxSpec::builder(Language::Shell)
        .workspace_dir(dir, read_only)
        .wall_time(Duration::from_secs(60))
}

/// Debian's git (`scripts/test.sh` installs it), which reads the sandbox's generated
/// `/etc/gitconfig` (its commit identity); a git built with another prefix, such as one in
/// `/usr/local`, reads its system configuration elsewhere.
const GIT: &str = "/usr/bin/git";

/// What an agent does in its workspace: a git repository with a commit, directories, files,
/// and a file written through the file API. Returns what `id -u` and the workspace's owner
/// say inside.
async fn work_in(sb: &dyn Sandbox) -> (String, String) {
    assert!(Path::new(GIT).exists(), "no {GIT}: apt-get install git");
    let out = sh_ok(
        sb,
        &format!(
            "id -u; stat -c %u:%g /workspace; cat in.txt >/dev/null && {GIT} init -q && \
             echo hello > a.txt && {GIT} add a.txt && {GIT} commit -qm first && \
             mkdir -p d/e && touch d/e/f && {GIT} log --oneline | wc -l"
        ),
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert_eq!(lines[2].trim(), "1", "one commit: {out}");
    sb.write_file("api.txt", b"through the file API")
        .await
        .unwrap();
    assert_eq!(
        sh_ok(sb, "cat api.txt && echo more >> api.txt && echo ok").await,
        "through the file APIok\n"
    );
    (lines[0].to_string(), lines[1].to_string())
}

#[tokio::test]
async fn git_in_a_user_s_directory_writes_files_the_user_owns() {
    require_root_host!();
    let dir = owned_dir(OWNER, OWNER);
    let sb = backend()
        .create(
            &spec_for(dir.path(), false).build().unwrap(),
            ResolvedSecrets::none(),
        )
        .await
        .unwrap();
    // The sandbox user owns its workspace inside; the host sees the directory's owner.
    assert_eq!(
        work_in(sb.as_ref()).await,
        ("1000".into(), "1000:1000".into())
    );
    sb.destroy().await.unwrap();
    let n = assert_all_owned_by(dir.path(), OWNER, OWNER);
    assert!(n > 10, "git wrote its repository ({n} entries)");
    assert!(dir.path().join(".git/HEAD").is_file());
}

#[tokio::test]
async fn the_classic_setup_idmaps_the_workspace_too() {
    require_root_host!();
    // A spec mount keeps the sandbox off the shared template: the classic setup.
    let dir = owned_dir(OWNER, OWNER);
    let data = tempfile::tempdir().unwrap();
    std::fs::write(data.path().join("d.txt"), "data").unwrap();
    let spec = spec_for(dir.path(), false)
        .mount_ro(data.path(), "/data")
        .build()
        .unwrap();
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(
        work_in(sb.as_ref()).await,
        ("1000".into(), "1000:1000".into())
    );
    assert_eq!(sh_ok(sb.as_ref(), "cat /data/d.txt").await, "data");
    // The host path stays hidden.
    let mounts = sh_ok(sb.as_ref(), "cat /proc/mounts").await;
    assert!(!mounts.contains(&*dir.path().to_string_lossy()), "{mounts}");
    sb.destroy().await.unwrap();
    assert_all_owned_by(dir.path(), OWNER, OWNER);
}

#[tokio::test]
async fn a_root_owned_directory_is_written_as_its_owner_root() {
    require_root_host!();
    // What a new user running as root gives: a directory of their own (root's). The sandbox
    // user (never host root) owns it inside; its files are the owner's outside.
    let dir = owned_dir(0, 0);
    let sb = backend()
        .create(
            &spec_for(dir.path(), false).build().unwrap(),
            ResolvedSecrets::none(),
        )
        .await
        .unwrap();
    assert_eq!(
        work_in(sb.as_ref()).await,
        ("1000".into(), "1000:1000".into())
    );
    // Only the workspace is the owner's: host root's other files stay out of reach.
    let r = sh(sb.as_ref(), "touch /etc/x").await;
    assert_ne!(r.exit_code, Some(0));
    // No set-id program can be planted for the host: setting the bits is refused, whichever
    // call tries (plain modes still work).
    sh_ok(
        sb.as_ref(),
        "touch s && chmod 0755 s && mkdir sd && chmod 1777 sd",
    )
    .await;
    for cmd in [
        "chmod u+s s",
        "chmod g+s s",
        "chmod 2775 sd",
        "/usr/bin/python3 -c \"import os; os.open('t', os.O_CREAT | os.O_WRONLY, 0o4755)\"",
        "/usr/bin/python3 -c \"import os; os.mknod('u', 0o104755)\"",
    ] {
        let r = sh(sb.as_ref(), cmd).await;
        assert_ne!(r.exit_code, Some(0), "`{cmd}` set a set-id bit");
        assert!(
            r.stderr_str().contains("Operation not permitted"),
            "`{cmd}`: {}",
            r.stderr_str()
        );
    }
    sb.destroy().await.unwrap();
    assert_all_owned_by(dir.path(), 0, 0);
    let setid: Vec<_> = owners(dir.path())
        .into_iter()
        .filter(|(p, _, _)| std::fs::symlink_metadata(p).unwrap().mode() & 0o6000 != 0)
        .collect();
    assert!(setid.is_empty(), "set-id entries on the host: {setid:?}");
    assert!(!dir.path().join("t").exists() && !dir.path().join("u").exists());
}

#[tokio::test]
async fn a_read_only_host_dir_refuses_writes_with_erofs() {
    require_root_host!();
    let dir = owned_dir(OWNER, OWNER);
    let before = owners(dir.path());
    let sb = backend()
        .create(
            &spec_for(dir.path(), true).build().unwrap(),
            ResolvedSecrets::none(),
        )
        .await
        .unwrap();
    // Readable as its owner (in.txt is 0600), shown as the sandbox user's.
    assert_eq!(
        sh_ok(sb.as_ref(), "stat -c %u:%g /workspace; cat in.txt").await,
        "1000:1000\nfrom the owner\n"
    );
    for cmd in [
        "touch new",
        "mkdir d",
        "echo x >> in.txt",
        "/usr/bin/git init -q",
    ] {
        let r = sh(sb.as_ref(), cmd).await;
        assert_ne!(r.exit_code, Some(0), "`{cmd}` wrote a read-only workspace");
        assert!(
            r.stderr_str().contains("Read-only file system"),
            "`{cmd}`: {}",
            r.stderr_str()
        );
    }
    assert!(sb.write_file("api.txt", b"x").await.is_err());
    sb.destroy().await.unwrap();
    assert_eq!(owners(dir.path()), before);
}

#[tokio::test]
async fn an_image_s_root_writes_a_user_s_directory_as_its_owner() {
    if let Some(why) = common::rootfs_skip_reason().await {
        eprintln!("SKIP: {why}");
        return;
    }
    if !is_root() {
        eprintln!("SKIP: needs root (directories of another owner)");
        return;
    }
    // A rootfs directory runs commands as its root (uid 0 inside, no capabilities): that
    // user owns the workspace through the idmapping, and its files are the owner's outside.
    let root = tempfile::tempdir().unwrap();
    common::make_rootfs(root.path());
    let dir = owned_dir(OWNER, OWNER);
    let spec = spec_for(dir.path(), false)
        .rootfs(root.path())
        .build()
        .unwrap();
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(
        sh_ok(
            sb.as_ref(),
            "id -u; stat -c %u:%g /workspace; cat in.txt; mkdir -p d/e && touch d/e/f x && echo ok"
        )
        .await,
        "0\n0:0\nfrom the owner\nok\n"
    );
    sb.write_file("api.txt", b"x").await.unwrap();
    sb.destroy().await.unwrap();
    assert_eq!(assert_all_owned_by(dir.path(), OWNER, OWNER), 7);
}

/// A ramfs mounted on a fresh directory (ramfs has no idmapped mounts), unmounted on drop.
struct Ramfs(tempfile::TempDir);

impl Ramfs {
    fn new() -> Ramfs {
        let d = tempfile::tempdir().unwrap();
        nix::mount::mount(
            Some("ramfs"),
            d.path(),
            Some("ramfs"),
            nix::mount::MsFlags::empty(),
            Some("mode=0755"),
        )
        .unwrap();
        Ramfs(d)
    }
}

impl Drop for Ramfs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.0.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

#[tokio::test]
async fn without_idmapped_mounts_a_user_s_dir_falls_back_and_a_root_dir_is_refused() {
    require_root_host!();
    let fs = Ramfs::new();
    let dir = fs.0.path();
    // An unprivileged owner: the sandbox user is mapped to it (the fallback), so its files
    // are still the owner's.
    std::os::unix::fs::chown(dir, Some(OWNER), Some(OWNER)).unwrap();
    let sb = backend()
        .create(
            &spec_for(dir, false).build().unwrap(),
            ResolvedSecrets::none(),
        )
        .await
        .unwrap();
    assert_eq!(
        sh_ok(sb.as_ref(), "id -u; mkdir d && touch d/f x && echo ok").await,
        "1000\nok\n"
    );
    sb.destroy().await.unwrap();
    assert_eq!(assert_all_owned_by(dir, OWNER, OWNER), 4);
    // Owned by root: no identity could write it without writing as host root or as a
    // foreign uid: refused, with the reason.
    std::os::unix::fs::chown(dir, Some(0), Some(0)).unwrap();
    match backend()
        .create(
            &spec_for(dir, false).build().unwrap(),
            ResolvedSecrets::none(),
        )
        .await
    {
        Err(Error::Unsupported { what, .. }) => {
            assert!(what.contains("cannot be idmapped"), "{what}")
        }
        other => panic!("expected Unsupported, got {:?}", other.map(|_| ())),
    }
    // Read-only, it is mounted as it is and refuses writes.
    let sb = backend()
        .create(
            &spec_for(dir, true).build().unwrap(),
            ResolvedSecrets::none(),
        )
        .await
        .unwrap();
    let r = sh(sb.as_ref(), "ls d && touch y").await;
    assert!(r.stdout_str().contains('f'), "{}", r.stdout_str());
    assert!(
        r.stderr_str().contains("Read-only file system"),
        "{}",
        r.stderr_str()
    );
    sb.destroy().await.unwrap();
    assert!(!dir.join("y").exists());
}

/// Every live sandbox has a host uid range of its own, whichever backend (or process: the
/// lease is a lock on a file, see `slots.rs`) made it: sandboxes of two backends with the
/// same `uid_base`, alive together, map uid 0 inside to six different host uids; a range
/// is leased again once its sandbox is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_sandboxes_of_two_backends_never_share_a_uid_range() {
    require_root_host!();
    let host_root = |pid: i32| -> u32 {
        let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).unwrap();
        let f: Vec<u32> = map.split_whitespace().map(|w| w.parse().unwrap()).collect();
        assert_eq!((f[0], f[2]), (0, 65536), "{map}");
        f[1]
    };
    let a = backend_container::ContainerBackend::builder()
        .build()
        .unwrap();
    let b = backend_container::ContainerBackend::builder()
        .build()
        .unwrap();
    let spec = SandboxSpec::new(Language::Shell);
    let mut live = Vec::new();
    for backend in [&a, &b, &a, &b, &a, &b] {
        live.push(backend.create_container(&spec).await.unwrap());
    }
    let mut roots: Vec<u32> = live.iter().map(|s| host_root(s.init_pid())).collect();
    let base = a.config().uid_base;
    for r in &roots {
        assert!(
            *r >= base && (r - base).is_multiple_of(65536),
            "{r} is not a slot of {base}"
        );
    }
    roots.sort_unstable();
    roots.dedup();
    assert_eq!(roots.len(), 6, "{roots:?}");
    // Commands still run as the sandbox user, inside.
    assert_eq!(sh_ok(&live[0], "id -u").await, "1000\n");
    // Each range is held by a lock on its lease file while its sandbox lives, and free
    // once it is gone (the kernel drops the lock with the sandbox's state).
    let lease_file = |root: u32| {
        std::fs::File::open(format!(
            "/run/agent-sandbox-slots/{base}-{}",
            (root - base) / 65536
        ))
        .unwrap()
    };
    let lockable = |f: &std::fs::File| {
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor we own; closing it (drop) releases a lock we got.
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
    };
    for r in &roots {
        assert!(!lockable(&lease_file(*r)), "slot of {r} not held");
    }
    for s in live {
        s.destroy().await.unwrap();
    }
    // Free again. Polled (a check, never a timing): the slot is released when destroy
    // returns, but another sandbox may lease it meanwhile (a test running beside this one
    // picks slots too) and let it go a moment later.
    for r in &roots {
        let free = (0..200).any(|_| {
            lockable(&lease_file(*r)) || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                false
            }
        });
        assert!(
            free,
            "slot of {r} still held 10 s after its sandbox was destroyed"
        );
    }
}
