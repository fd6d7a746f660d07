//! Unit tests of the root filesystem plans (classic and template) and their inputs.

use super::host::fingerprint;
use super::*;
use sandbox_core::Language;

fn plan_for(spec: &SandboxSpec) -> Result<Vec<Op>> {
    plan(&Plan {
        spec,
        landlock: Some(3),
        host: &host_ops(),
        user: 1000,
        hostname: "sandbox",
        resolv_conf: "",
        ca_bundle: None,
        caps: tmpfs_caps(spec),
        loopback: true,
        layers: &[],
        workspace_fd: false,
    })
    .map(Setup::all)
}

#[test]
fn plan_ends_with_pivot_and_has_no_host_etc_secrets() {
    let spec = SandboxSpec::new(Language::Shell);
    let ops = plan_for(&spec).unwrap();
    assert!(ops.iter().any(|o| matches!(o, Op::Pivot { .. })));
    for o in &ops {
        if let Op::Bind { src, .. } = o {
            assert!(
                !src.contains("shadow") && !src.contains("/root") && !src.contains("/home"),
                "{src}"
            );
        }
    }
}

#[test]
fn rootfs_plan_mounts_an_overlay_with_relative_layers() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("etc")).unwrap();
    std::fs::create_dir_all(dir.path().join("proc")).unwrap();
    std::os::unix::fs::symlink("usr/bin", dir.path().join("bin")).unwrap();
    let spec = SandboxSpec::builder(Language::Shell)
        .rootfs(dir.path())
        .build()
        .unwrap();
    // Two layers, as an image has them (the directory twice will do).
    let layers = vec![
        dir.path().canonicalize().unwrap(),
        dir.path().canonicalize().unwrap(),
    ];
    let setup = plan(&Plan {
        spec: &spec,
        landlock: Some(3),
        host: &[],
        user: 0,
        hostname: "sandbox",
        resolv_conf: "",
        ca_bundle: None,
        caps: tmpfs_caps(&spec),
        loopback: true,
        layers: &layers,
        workspace_fd: false,
    })
    .unwrap();
    // The preparation ends with the layers in place; the overlay comes first after it.
    assert!(matches!(setup.prep.last(), Some(Op::Lower { .. })));
    assert!(setup
        .prep
        .iter()
        .any(|o| matches!(o, Op::KeepDir { fd, .. } if *fd == crate::proto::UPPER_FD)));
    match setup.main.first() {
        Some(Op::Mount {
            fstype, data, dst, ..
        }) => {
            assert_eq!((fstype.as_str(), dst.as_str()), ("overlay", NEW));
            // The topmost layer first, as overlayfs wants them.
            assert_eq!(
                data,
                "lowerdir=lower/1:lower/0,upperdir=ovl/upper,workdir=ovl/work,userxattr"
            );
            assert!(!data.contains("=/"), "{data}");
        }
        other => panic!("{other:?}"),
    }
    let host = dir.path().canonicalize().unwrap();
    let host = host.to_string_lossy();
    for o in &setup.main {
        assert!(!format!("{o:?}").contains(&*host), "{o:?}");
        // The root stays writable (the upper layer takes the writes).
        assert!(
            !matches!(o, Op::SetAttr { path, .. } if path == NEW),
            "{o:?}"
        );
    }
    let Some(Op::Landlock { rules, .. }) = setup.main.last() else {
        panic!("no landlock")
    };
    let paths: Vec<&str> = rules.iter().map(|(p, _)| p.as_str()).collect();
    assert!(
        paths.contains(&"/etc") && paths.contains(&"/workspace"),
        "{paths:?}"
    );
    assert!(
        !paths.contains(&"/proc") && !paths.contains(&"/bin"),
        "{paths:?}"
    );
}

#[test]
fn template_holds_the_shared_root_and_the_plan_only_the_sandbox_s_own_mounts() {
    let root = "/run/t/0";
    let ops = template_ops(
        root,
        etc_files(
            1000,
            ("sandbox", "/workspace"),
            "box",
            "nameserver 1.2.3.4\n",
        ),
    );
    assert!(matches!(&ops[1], Op::Mount { fstype, dst, .. } if fstype == "tmpfs" && dst == root));
    // Ends read-only; sources are host paths as the zygote sees them (no /oldroot).
    assert!(
        matches!(ops.last(), Some(Op::SetAttr { path, set, .. }) if path == root && *set == ATTR_RDONLY)
    );
    for o in &ops {
        match o {
            Op::Bind { src, dst } => {
                assert!(!src.starts_with(OLD) && dst.starts_with(root), "{o:?}");
                assert!(!src.contains("shadow") && !src.contains("/root"), "{src}");
            }
            Op::WriteFile { path, .. } | Op::Mkdir { path, .. } | Op::Touch { path } => {
                assert!(path.starts_with(root), "{o:?}")
            }
            _ => {}
        }
    }
    let file = |name: &str| {
        ops.iter().find_map(|o| match o {
            Op::WriteFile { path, data, .. } if path == &format!("{root}/etc/{name}") => {
                Some(String::from_utf8_lossy(data).into_owned())
            }
            _ => None,
        })
    };
    assert_eq!(file("hostname").as_deref(), Some("box\n"));
    assert!(file("passwd").unwrap().contains("sandbox:x:1000:1000"));

    let spec = SandboxSpec::new(Language::Shell);
    assert!(template_fits(&spec));
    let p = Plan {
        spec: &spec,
        landlock: Some(3),
        host: &[],
        user: 1000,
        hostname: "box",
        resolv_conf: "",
        ca_bundle: None,
        caps: tmpfs_caps(&spec),
        loopback: true,
        layers: &[],
        workspace_fd: false,
    };
    let setup = template_plan(&p, root).unwrap();
    assert!(setup.prep.is_empty());
    let ops = setup.main;
    assert!(ops
        .iter()
        .any(|o| matches!(o, Op::Bind { src, dst } if src == root && dst == root)));
    assert!(ops
        .iter()
        .any(|o| matches!(o, Op::Pivot { newroot } if newroot == root)));
    // Nothing is created in the shared root: only mounts on its mount points.
    assert!(!ops.iter().any(|o| matches!(
        o,
        Op::WriteFile { .. } | Op::Mkdir { .. } | Op::Touch { .. } | Op::Symlink { .. }
    )));
    // Specs with mounts (mount points to make) or a rootfs directory keep the classic plan.
    let with_mount = SandboxSpec::builder(Language::Shell)
        .mount_ro("/usr/share", "/data/share")
        .build()
        .unwrap();
    assert!(!template_fits(&with_mount));
    let with_dir = SandboxSpec::builder(Language::Shell)
        .workspace_dir("/tmp", false)
        .build()
        .unwrap();
    // A host-directory workspace fits, as a detached mount (the setup's first fd).
    assert!(template_fits(&with_dir));
    let p = Plan {
        spec: &with_dir,
        ..p
    };
    let ops = template_plan(&p, root).unwrap().main;
    assert!(ops
        .iter()
        .any(|o| matches!(o, Op::Lower { dst, .. } if dst == &format!("{root}/workspace"))));
    assert!(!ops
        .iter()
        .any(|o| matches!(o, Op::Bind { src, .. } if src == "/tmp")));
}

#[test]
fn the_fingerprint_sees_a_file_replaced_by_a_rename() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("ld.so.cache");
    std::fs::write(&f, "old").unwrap();
    let paths = || [f.to_string_lossy().into_owned(), "/nonexistent/x".into()].into_iter();
    let before = fingerprint(paths());
    assert_eq!(fingerprint(paths()), before);
    // What ldconfig does: a new file renamed over the old one (same size, maybe same
    // mtime second): the inode differs.
    let tmp = dir.path().join("ld.so.cache~");
    std::fs::write(&tmp, "new").unwrap();
    std::fs::rename(&tmp, &f).unwrap();
    assert_ne!(fingerprint(paths()), before);
    // The host's, unchanged from one call to the next.
    assert_eq!(host_fingerprint(), host_fingerprint());
}

#[test]
fn reserved_mount_targets_are_refused() {
    let spec = SandboxSpec::builder(Language::Shell)
        .mount_ro("/usr", "/usr/x")
        .build()
        .unwrap();
    assert!(matches!(plan_for(&spec), Err(Error::InvalidSpec { .. })));
    let spec = SandboxSpec::builder(Language::Shell)
        .mount_ro("/usr/share", "/data/share")
        .build()
        .unwrap();
    assert!(plan_for(&spec).is_ok());
}
