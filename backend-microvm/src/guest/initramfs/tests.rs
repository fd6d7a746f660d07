//! The cpio writer and reader (also against GNU cpio), `modules.dep` order, the initramfs
//! layout and its check, and `.modinfo` of a forged object.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn module(name: &str, deps: &[&str]) -> KernelModule {
    KernelModule {
        name: name.into(),
        path: format!("kernel/{name}.ko"),
        depends: deps.iter().map(|s| s.to_string()).collect(),
        data: name.as_bytes().to_vec(),
    }
}

#[test]
fn cpio_round_trip() {
    let mut w = CpioWriter::new();
    w.file("/a/b/c.txt", 0o640, b"hello").unwrap();
    w.file("odd", 0o600, b"12345").unwrap();
    w.symlink("a/link", "b/c.txt").unwrap();
    w.char_dev("dev/console", 0o600, 5, 1).unwrap();
    w.dir("a", 0o755).unwrap();
    assert!(w.file("odd", 0o600, b"again").is_err());
    assert!(w.file("../x", 0o600, b"").is_err());
    let data = w.finish();
    assert_eq!(data.len() % 4, 0);
    let e = read_cpio(&data).unwrap();
    let names: Vec<&str> = e.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "a",
            "a/b",
            "a/b/c.txt",
            "odd",
            "a/link",
            "dev",
            "dev/console"
        ]
    );
    assert!(e[0].is_dir() && e[2].is_file() && e[4].is_symlink() && e[6].is_char_dev());
    assert_eq!(e[2].data, b"hello");
    assert_eq!(e[2].mode & 0o7777, 0o640);
    assert_eq!(e[4].data, b"b/c.txt");
    assert_eq!(e[6].rdev, (5, 1));
}

#[test]
fn cpio_matches_gnu_cpio_when_available() {
    // GNU cpio is optional on the host; our own reader is the main check.
    let mut w = CpioWriter::new();
    w.file("x/y", 0o644, b"data").unwrap();
    let data = w.finish();
    let Ok(mut child) = std::process::Command::new("cpio")
        .args(["-t", "--quiet"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
    else {
        return;
    };
    use std::io::Write;
    child.stdin.take().unwrap().write_all(&data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "x\nx/y\n");
}

#[test]
fn garbage_cpio_is_an_error() {
    assert!(read_cpio(b"").is_err());
    assert!(read_cpio(&[b'0'; 200]).is_err());
    let mut w = CpioWriter::new();
    w.file("f", 0o644, &[1; 100]).unwrap();
    let data = w.finish();
    for cut in [10, 115, 150, data.len() - 20] {
        assert!(read_cpio(&data[..cut]).is_err(), "cut {cut}");
    }
    let mut forged = data.clone();
    forged[6 + 6 * 8..6 + 7 * 8].copy_from_slice(b"ffffffff");
    assert!(read_cpio(&forged).is_err());
}

#[test]
fn modules_dep_orders_dependencies() {
    let mods = vec![
        module("virtio_console", &["virtio", "virtio_ring"]),
        module("virtio_mmio", &["virtio", "virtio_ring"]),
        module("virtio_ring", &[]),
        module("virtio", &[]),
        module("a", &["b"]),
        module("b", &["virtio_ring"]),
    ];
    let dep = modules_dep(&mods).unwrap();
    let lines: Vec<&str> = dep.lines().collect();
    assert_eq!(
        lines[0],
        "kernel/virtio_console.ko: kernel/virtio_ring.ko kernel/virtio.ko"
    );
    assert_eq!(lines[2], "kernel/virtio_ring.ko:");
    assert_eq!(lines[4], "kernel/a.ko: kernel/b.ko kernel/virtio_ring.ko");
    assert!(modules_dep(&[module("x", &["missing"])]).is_err());
    assert!(modules_dep(&[module("x", &["y"]), module("y", &["x"])]).is_err());
}

#[test]
fn initramfs_layout_and_check() {
    let agent = b"\x7fELFagent".to_vec();
    let bb = b"\x7fELFbusybox".to_vec();
    let data = build(&InitramfsContents {
        agent: &agent,
        busybox: Some(&bb),
        applets: vec![
            "sh".into(),
            "ls".into(),
            "env".into(),
            "busybox".into(),
            "sh".into(),
        ],
        modules: vec![module("virtio", &[]), module("virtio_mmio", &["virtio"])],
        root_modules: vec![
            module("virtio_blk", &["virtio"]),
            module("ext4", &["jbd2"]),
            module("jbd2", &[]),
        ],
        net_modules: vec![
            module("virtio_net", &["virtio", "net_failover"]),
            module("net_failover", &[]),
        ],
    })
    .unwrap();
    let e = check(&data).unwrap();
    let get = |n: &str| {
        e.iter()
            .find(|x| x.name == n)
            .unwrap_or_else(|| panic!("{n}"))
    };
    assert_eq!(get("init").data, agent);
    assert_eq!(get("init").mode & 0o777, 0o755);
    assert_eq!(get("bin/busybox").data, bb);
    assert_eq!(get("bin/sh").data, b"busybox");
    assert_eq!(get("usr/bin/env").data, b"../../bin/busybox");
    assert!(get("dev/console").is_char_dev());
    assert_eq!(get("tmp").mode & 0o7777, 0o1777);
    assert!(get("workspace").is_dir());
    assert_eq!(
        get("lib/modules/modules.dep").data,
        b"kernel/virtio.ko:\nkernel/virtio_mmio.ko: kernel/virtio.ko\n"
    );
    assert_eq!(
        get("lib/modules/kernel/virtio_mmio.ko").data,
        b"virtio_mmio"
    );
    assert_eq!(e.iter().filter(|x| x.name == "bin/sh").count(), 1);
    // The image-root modules are in their own list (their dependencies on boot modules
    // named there too), not loaded at boot.
    assert_eq!(
        get("lib/modules/root-modules.dep").data,
        b"kernel/virtio_blk.ko: kernel/virtio.ko\nkernel/ext4.ko: kernel/jbd2.ko\n\
          kernel/jbd2.ko:\n"
    );
    assert_eq!(get("lib/modules/kernel/ext4.ko").data, b"ext4");
    // So are the network modules.
    assert_eq!(
        get("lib/modules/net-modules.dep").data,
        b"kernel/virtio_net.ko: kernel/net_failover.ko kernel/virtio.ko\n\
          kernel/net_failover.ko:\n"
    );
    // Without image-root modules the list is there, empty.
    let data = build(&InitramfsContents {
        agent: &agent,
        ..Default::default()
    })
    .unwrap();
    let e = check(&data).unwrap();
    let dep = e
        .iter()
        .find(|x| x.name == "lib/modules/root-modules.dep")
        .unwrap();
    assert!(dep.data.is_empty());

    // An initramfs without the agent is refused.
    let mut w = CpioWriter::new();
    w.file("bin/sh", 0o755, b"\x7fELF").unwrap();
    let err = check(&w.finish()).unwrap_err().to_string();
    assert!(err.contains("/init"), "{err}");
    let mut w = CpioWriter::new();
    w.file("init", 0o644, b"\x7fELF").unwrap();
    assert!(check(&w.finish()).is_err());
    assert!(build(&InitramfsContents {
        agent: b"#!/bin/sh",
        ..Default::default()
    })
    .is_err());
}

#[test]
fn module_info_of_a_forged_object() {
    // A tiny ELF64 with a section string table and a .modinfo section.
    let strtab = b"\0.shstrtab\0.modinfo\0";
    let modinfo = b"license=GPL\0depends=virtio,virtio_ring\0name=virtio_mmio\0";
    let mut ko = vec![0u8; 64];
    ko[..4].copy_from_slice(b"\x7fELF");
    ko[4] = 2;
    ko[5] = 1;
    let strtab_off = ko.len();
    ko.extend_from_slice(strtab);
    let modinfo_off = ko.len();
    ko.extend_from_slice(modinfo);
    while !ko.len().is_multiple_of(8) {
        ko.push(0);
    }
    let shoff = ko.len();
    let mut sh = |name: u32, off: usize, size: usize| {
        let mut h = vec![0u8; 64];
        h[..4].copy_from_slice(&name.to_le_bytes());
        h[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
        h[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
        ko.extend_from_slice(&h);
    };
    sh(0, 0, 0);
    sh(1, strtab_off, strtab.len());
    sh(11, modinfo_off, modinfo.len());
    ko[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
    ko[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    ko[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
    ko[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
    let info = module_info(&ko).unwrap();
    assert_eq!(info.name, "virtio_mmio");
    assert_eq!(info.depends, ["virtio", "virtio_ring"]);
    // Corruptions: never a panic.
    for i in 0..ko.len() {
        let mut b = ko.clone();
        b[i] ^= 0xff;
        let _ = module_info(&b);
    }
    assert!(module_info(&ko[..100]).is_err());
    assert!(module_info(b"not elf").is_err());
}
