//! Emptied v1 cgroups are kept and reused by the next sandbox, with the new sandbox's limits,
//! and the limit reports stay right across the reuse. Its own test binary: it needs to know
//! which sandbox takes the kept directories.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::os::unix::fs::MetadataExt;

use common::backend;
use sandbox_core::{ExecRequest, Language, LimitKind, Sandbox, SandboxSpec};

fn read(dir: &std::path::Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file))
        .unwrap_or_default()
        .trim()
        .to_string()
}

#[tokio::test]
async fn destroyed_cgroups_serve_the_next_sandbox_with_its_own_limits() {
    require_host!();
    let b = backend();
    if b.cgroup_version() != Some(backend_container::CgroupVersion::V1) {
        eprintln!("SKIP: cgroup directories are reused on v1 only (v2 cannot rename them)");
        return;
    }
    let mib = |n: u64| n << 20;
    let small = SandboxSpec::builder(Language::Shell)
        .memory_mib(64)
        .build()
        .unwrap();
    let sb = b.create_container(&small).await.unwrap();
    let id = sb.id().to_string();
    // A memory exhaustion (a shell holding 200 MB; no new files read, so little memory stays
    // charged once it is gone): the OOM-kill count of this cgroup rises.
    let r = sb
        .exec(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo survived",
        ]))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::Memory), "{r:?}");
    let own = common::cgroups_of(&id);
    assert!(!own.is_empty());
    let inodes: Vec<u64> = own
        .iter()
        .map(|d| std::fs::metadata(d).unwrap().ino())
        .collect();
    sb.destroy().await.unwrap();
    // Its directories are gone by their name, kept under a free one (the same directories:
    // a rename keeps the inode). The probe's sandbox (`require_host!`) may have left a set.
    assert!(common::cgroups_of(&id).is_empty());
    let free: Vec<u64> = common::free_cgroup_dirs()
        .iter()
        .map(|d| std::fs::metadata(d).unwrap().ino())
        .collect();
    assert!(
        inodes.iter().all(|i| free.contains(i)),
        "not kept: {free:?} {inodes:?}"
    );
    common::assert_free_cgroups_are_empty_and_few();

    // The next sandbox takes them (the same directories, renamed) with its own limits.
    let big = SandboxSpec::builder(Language::Python)
        .memory_mib(96)
        .build()
        .unwrap();
    let next = b.create_container(&big).await.unwrap();
    let dirs = common::cgroups_of(next.id());
    assert_eq!(dirs.len(), own.len());
    for d in &dirs {
        assert!(
            inodes.contains(&std::fs::metadata(d).unwrap().ino()),
            "{} is a new directory, not a kept one",
            d.display()
        );
    }
    let memory = dirs
        .iter()
        .find(|d| d.join("memory.limit_in_bytes").exists())
        .unwrap();
    assert_eq!(read(memory, "memory.limit_in_bytes"), mib(96).to_string());
    if memory.join("memory.memsw.limit_in_bytes").exists() {
        assert_eq!(
            read(memory, "memory.memsw.limit_in_bytes"),
            mib(96).to_string()
        );
    }
    // The OOM kill counted before the reuse is not this sandbox's: a plain failure is not
    // reported as a memory limit; its own exhaustion is.
    let r = next
        .exec(ExecRequest::code("import sys; sys.exit(3)"))
        .await
        .unwrap();
    assert_eq!((r.exit_code, r.limit), (Some(3), None), "{r:?}");
    let r = next
        .exec(ExecRequest::code(
            "x = bytearray(400 << 20); x[::4096] = b'1' * len(x[::4096])",
        ))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::Memory), "{r:?}");
    assert_eq!(
        next.exec(ExecRequest::code("print('alive')"))
            .await
            .unwrap()
            .stdout_str(),
        "alive\n"
    );
    next.destroy().await.unwrap();
    common::assert_free_cgroups_are_empty_and_few();
}
