//! The `ar` reader, module names, boot and image-root modules told apart, the cache
//! directory, and typed errors for missing, corrupt, old and stale caches.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

#[test]
fn ar_parsing() {
    let mut a = b"!<arch>\n".to_vec();
    for (name, body) in [("debian-binary", &b"2.0\n"[..]), ("odd", &b"abc"[..])] {
        a.extend_from_slice(
            format!(
                "{name:<16}{:<12}{:<6}{:<6}{:<8}{:<10}`\n",
                0,
                0,
                0,
                100644,
                body.len()
            )
            .as_bytes(),
        );
        a.extend_from_slice(body);
        if body.len() % 2 == 1 {
            a.push(b'\n');
        }
    }
    let m = ar_members(&a).unwrap();
    assert_eq!(
        m,
        [
            ("debian-binary".to_string(), &b"2.0\n"[..]),
            ("odd".to_string(), &b"abc"[..])
        ]
    );
    assert!(ar_members(b"junk").is_err());
    assert!(ar_members(&a[..a.len() - 2]).is_err());
    let mut forged = a.clone();
    forged[8 + 48..8 + 58].copy_from_slice(b"9999999999");
    assert!(ar_members(&forged).is_err());
}

#[test]
fn boot_and_image_root_modules_are_told_apart() {
    let m = |name: &str, deps: &[&str]| KernelModule {
        name: name.into(),
        path: format!("kernel/{name}.ko"),
        depends: deps.iter().map(|s| s.to_string()).collect(),
        data: Vec::new(),
    };
    let mods = [
        m("virtio_mmio", &["virtio", "virtio_ring"]),
        m("virtio_console", &["virtio", "virtio_ring"]),
        m("virtio", &[]),
        m("virtio_ring", &[]),
        m("virtio_blk", &["virtio", "virtio_ring"]),
        m("ext4", &["jbd2"]),
        m("jbd2", &[]),
    ];
    let boot: Vec<String> = boot_module_names(&mods).into_iter().collect();
    assert_eq!(
        boot,
        ["virtio", "virtio_console", "virtio_mmio", "virtio_ring"]
    );
    // Everything an image root needs is asked for up front (one pass over the package).
    for n in ["virtio_blk", "ext4", "jbd2", "mbcache", "crc16", "overlay"] {
        assert!(wanted_modules().contains(&n), "{n}");
    }
}

#[test]
fn module_names() {
    assert_eq!(
        module_name_of("kernel/drivers/virtio/virtio_mmio.ko").as_deref(),
        Some("virtio_mmio")
    );
    assert_eq!(
        module_name_of("kernel/x/virtio-rng.ko").as_deref(),
        Some("virtio_rng")
    );
    assert_eq!(module_name_of("modules.dep"), None);
}

#[test]
fn cache_dir_follows_xdg() {
    // Only reads the environment of this process; does not change it.
    let d = default_cache_dir();
    assert!(d.ends_with("agent-sandbox/microvm"));
}

#[test]
fn missing_and_corrupt_caches_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        load(dir.path(), Verify::Sizes),
        Err(GuestError::NotInstalled { .. })
    ));
    std::fs::write(dir.path().join(MANIFEST), b"{not json").unwrap();
    assert!(matches!(
        load(dir.path(), Verify::Sizes),
        Err(GuestError::Corrupt { .. })
    ));

    // A small but complete installation from a raw "kernel" ELF without modules.
    let elf = kernel::tests_support::tiny_elf();
    let k = dir.path().join("vmlinux-in");
    std::fs::write(&k, &elf).unwrap();
    let opts = InstallOptions {
        dir: dir.path().join("cache"),
        kernel: KernelSource::Kernel {
            image: k,
            modules: None,
        },
        busybox: None,
        no_busybox: true,
    };
    let a = install(&opts).unwrap();
    assert_eq!(std::fs::read(&a.vmlinux).unwrap(), elf);
    let entries = initramfs::check(&std::fs::read(&a.initramfs).unwrap()).unwrap();
    assert!(entries
        .iter()
        .any(|e| e.name == "init" && e.data == AGENT_BINARY));
    // No temporary files left behind.
    let names: Vec<String> = std::fs::read_dir(&opts.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");

    // Truncate the kernel: a size mismatch. Same size, other bytes: a checksum mismatch
    // (only with full verification).
    let v = a.vmlinux.clone();
    std::fs::write(&v, &elf[..10]).unwrap();
    let err = load(&opts.dir, Verify::Sizes).unwrap_err();
    assert!(matches!(err, GuestError::Corrupt { .. }), "{err}");
    let mut other = elf.clone();
    other[100] ^= 1;
    std::fs::write(&v, &other).unwrap();
    load(&opts.dir, Verify::Sizes).unwrap();
    let err = load(&opts.dir, Verify::Full).unwrap_err();
    assert!(err.to_string().contains("SHA-256"), "{err}");
    // Missing initramfs.
    std::fs::write(&v, &elf).unwrap();
    std::fs::remove_file(&a.initramfs).unwrap();
    assert!(matches!(
        load(&opts.dir, Verify::Sizes),
        Err(GuestError::Corrupt { .. })
    ));
    // A cache of the first format (no image-root modules) is refused, saying why.
    let good = std::fs::read(opts.dir.join(MANIFEST)).unwrap();
    let mut old: serde_json::Value = serde_json::from_slice(&good).unwrap();
    old["format"] = 1.into();
    old.as_object_mut().unwrap().remove("agent_hash");
    std::fs::write(opts.dir.join(MANIFEST), serde_json::to_vec(&old).unwrap()).unwrap();
    let err = load(&opts.dir, Verify::Sizes).unwrap_err().to_string();
    assert!(
        err.contains("older version") && err.contains("install the guest again"),
        "{err}"
    );
    std::fs::write(opts.dir.join(MANIFEST), &good).unwrap();
    // A stale initramfs (another agent) is rebuilt.
    let mut m = read_manifest(&opts.dir).unwrap();
    m.agent_hash = "0".into();
    std::fs::write(opts.dir.join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();
    let again = load(&opts.dir, Verify::Full).unwrap();
    assert_eq!(again.manifest.agent_hash, agent_hash_hex());
    assert!(again.initramfs.exists());
}
