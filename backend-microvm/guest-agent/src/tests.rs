//! The agent's kernel command line parameters, deleting the initramfs, workspace paths,
//! wait statuses, and the source hash covering every source of the agent.

#![allow(clippy::unwrap_used)]

use super::*;

#[test]
fn user_parameter() {
    assert_eq!(user_config("console=ttyS0 quiet").unwrap(), None);
    assert_eq!(
        user_config("agent.root=/dev/vda agent.user=1000:100").unwrap(),
        Some((1000, 100))
    );
    // Root is no user switch at all.
    assert_eq!(user_config("agent.user=0:0").unwrap(), None);
    for bad in [
        "agent.user=1000",
        "agent.user=me:me",
        "agent.user=-1:0",
        "agent.user=",
    ] {
        assert!(user_config(bad).is_err(), "{bad}");
    }
}

#[test]
fn image_root_parameters() {
    let plain = "console=ttyS0 reboot=k panic=1 rdinit=/init";
    assert_eq!(root_config(plain).unwrap(), None);
    let c = root_config("console=ttyS0 agent.root=/dev/vda quiet")
        .unwrap()
        .unwrap();
    assert_eq!(c.device, "/dev/vda");
    assert_eq!(c.size, None);
    assert_eq!(c.wait, Duration::from_secs(DEFAULT_ROOT_WAIT_S));
    let c = root_config("agent.root=/dev/vdb agent.root_size=64m agent.root_wait=3")
        .unwrap()
        .unwrap();
    assert_eq!(
        (c.device.as_str(), c.size.as_deref(), c.wait),
        ("/dev/vdb", Some("64m"), Duration::from_secs(3))
    );
    assert_eq!(
        root_config("agent.root=/dev/vda agent.root_size=25%")
            .unwrap()
            .unwrap()
            .size
            .as_deref(),
        Some("25%")
    );
    for bad in [
        "agent.root=vda",
        "agent.root=/dev/",
        "agent.root=/dev/../etc/x",
        "agent.root=/tmp/img",
        "agent.root=/dev/vda agent.root_size=lots",
        "agent.root=/dev/vda agent.root_size=64mm",
        "agent.root=/dev/vda agent.root_size=1,nr_inodes=1",
        "agent.root=/dev/vda agent.root_wait=0",
        "agent.root=/dev/vda agent.root_wait=1h",
        "agent.root_size=64m",
    ] {
        let e = root_config(bad).unwrap_err();
        assert!(matches!(e, RootError::Config(_)), "{bad}: {e}");
        assert!(e.to_string().starts_with("bad kernel command line"), "{e}");
    }
}

#[test]
fn an_initramfs_without_image_root_modules_is_named_as_such() {
    let dir = std::env::temp_dir().join(format!("agent-root-mods-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let e = root_modules_list(&dir).unwrap_err().to_string();
    assert!(
        e.contains("no image-root modules") && e.contains("install the guest again"),
        "{e}"
    );
    fs::write(
        dir.join(ROOT_MODULES_DEP),
        "kernel/ext4.ko: kernel/jbd2.ko\n",
    )
    .unwrap();
    assert_eq!(
        root_modules_list(&dir).unwrap(),
        "kernel/ext4.ko: kernel/jbd2.ko\n"
    );
    // Missing module files are reported, dependencies first, and nothing panics.
    let failed = load_modules(&dir, "kernel/ext4.ko: kernel/jbd2.ko\n");
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(failed[0].contains("jbd2.ko"), "{failed:?}");
    let e = RootError::Modules(failed).to_string();
    assert!(e.contains("ext4.ko"), "{e}");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn deleting_the_initramfs_keeps_to_its_filesystem() {
    let dir = std::env::temp_dir().join(format!("agent-delete-{}", std::process::id()));
    fs::create_dir_all(dir.join("a/b")).unwrap();
    fs::write(dir.join("a/b/f"), [0u8; 100]).unwrap();
    fs::write(dir.join("top"), [0u8; 10]).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", dir.join("a/link")).unwrap();
    assert_eq!(delete_on_device(&dir), 110);
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
    // Symlinks are deleted, never followed. (Mounts under it are left alone: the QEMU
    // test's image root, whose mounts sit under the deleted initramfs, shows that.)
    assert!(fs::metadata("/etc/passwd").is_ok());
    assert_eq!(delete_on_device(Path::new("/nonexistent")), 0);
    fs::remove_dir(&dir).unwrap();
}

#[test]
fn workspace_paths_are_confined() {
    let ws = Path::new("/w");
    assert_eq!(ws_path(ws, "a/b").unwrap(), Path::new("/w/a/b"));
    assert_eq!(ws_path(ws, "./a/../b").unwrap(), Path::new("/w/b"));
    assert_eq!(ws_path(ws, "/workspace/a").unwrap(), Path::new("/w/a"));
    assert_eq!(ws_path(ws, "/workspace").unwrap(), Path::new("/w"));
    assert_eq!(ws_path(ws, "").unwrap(), Path::new("/w"));
    for bad in [
        "../x",
        "/etc/passwd",
        "/workspace/../x",
        "/workspacex/a",
        "a/../../b",
    ] {
        assert_eq!(
            ws_path(ws, bad).unwrap_err().0,
            ErrorKind::PathEscape,
            "{bad}"
        );
    }
    assert_eq!(ws_path(ws, "a\0b").unwrap_err().0, ErrorKind::Invalid);
}

#[test]
fn cwd_mapping() {
    let ws = Path::new("/w");
    assert_eq!(resolve_cwd(ws, ""), Path::new("/w"));
    assert_eq!(resolve_cwd(ws, "/workspace/x"), Path::new("/w/x"));
    assert_eq!(resolve_cwd(ws, "sub"), Path::new("/w/sub"));
    assert_eq!(resolve_cwd(ws, "/tmp"), Path::new("/tmp"));
}

/// Every source of the agent is part of [`SOURCE_HASH`], with `sandbox-agent-proto`'s (a
/// module missing from its list would let a stale initramfs pass the host's check).
/// Here, not in `proto.rs`, which the host's crate compiles too (from its own directory).
#[test]
fn the_source_hash_covers_every_agent_source() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (hash, names) = sandbox_agent_proto::hash_sources_in(&dir).unwrap();
    assert_eq!(
        hash ^ sandbox_agent_proto::SOURCE_HASH,
        SOURCE_HASH,
        "agent sources: {names:?}"
    );
}

#[test]
fn wait_status_decoding() {
    assert_eq!(exit_info(3 << 8).code, Some(3));
    assert_eq!(exit_info(9).signal, Some(9));
    assert_eq!(exit_info(9).code, None);
}
