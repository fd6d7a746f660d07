//! The identity model for host-directory workspaces in the gVisor tier (see "Identity" in
//! `docs/container.md`): commands run with no capabilities as the directory owner's uid and
//! gid (runsc's gofer creates files with the ids of the process inside), so the workspace is
//! theirs inside and what they write there belongs to the owner on the host. Tested as a
//! user would, in a directory owned by uid 1234: `git init && git commit`, `mkdir`, `touch`
//! and the file API, then every entry is 1234's on the host; a read-only one refuses writes
//! with `EROFS`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sandbox_core::{ExecRequest, ExecResult, Language, Sandbox, SandboxSpec};

/// The owner of the test directories: an unprivileged uid/gid with no name on this host.
const OWNER: u32 = 1234;

/// Debian's git (`scripts/test.sh` installs it): it reads the generated `/etc/gitconfig`.
const GIT: &str = "/usr/bin/git";

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

/// Every entry under `dir` (itself included) with its owner.
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
    out.sort();
    out
}

async fn sh(sb: &dyn Sandbox, script: &str) -> ExecResult {
    sb.exec(ExecRequest::argv(["/bin/sh", "-c", script]))
        .await
        .unwrap()
}

fn spec_for(dir: &Path, read_only: bool) -> SandboxSpec {
    SandboxSpec::builder(Language::Shell)
        .workspace_dir(dir, read_only)
        .wall_time(Duration::from_secs(60))
        .build()
        .unwrap()
}

#[tokio::test]
async fn git_in_a_user_s_directory_writes_files_the_user_owns() {
    require_gvisor!();
    assert!(Path::new(GIT).exists(), "no {GIT}: apt-get install git");
    let dir = owned_dir(OWNER, OWNER);
    let sb = common::sandbox(&spec_for(dir.path(), false)).await;
    let r = sh(
        sb.as_ref(),
        &format!(
            "id -u; id -g; cat in.txt >/dev/null && {GIT} init -q && echo hello > a.txt && \
             {GIT} add a.txt && {GIT} commit -qm first && mkdir -p d/e && touch d/e/f && \
             {GIT} log --oneline | wc -l"
        ),
    )
    .await;
    assert!(r.success(), "{r:?} {}", r.stderr_str());
    assert_eq!(r.stdout_str(), "1234\n1234\n1\n");
    sb.write_file("api.txt", b"through the file API")
        .await
        .unwrap();
    sb.destroy().await.unwrap();
    let all = owners(dir.path());
    assert!(all.len() > 10, "git wrote its repository: {all:?}");
    let foreign: Vec<_> = all
        .iter()
        .filter(|(_, u, g)| (*u, *g) != (OWNER, OWNER))
        .collect();
    assert!(foreign.is_empty(), "not the owner's: {foreign:?}");
}

#[tokio::test]
async fn a_read_only_host_dir_refuses_writes_with_erofs() {
    require_gvisor!();
    let dir = owned_dir(OWNER, OWNER);
    let before = owners(dir.path());
    let sb = common::sandbox(&spec_for(dir.path(), true)).await;
    let r = sh(sb.as_ref(), "cat in.txt").await;
    assert_eq!(r.stdout_str(), "from the owner\n", "{r:?}");
    for cmd in ["touch new", "mkdir d", "echo x >> in.txt"] {
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
