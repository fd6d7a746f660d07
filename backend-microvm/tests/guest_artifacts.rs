#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Real guest artifacts: Debian's kernel package fetched with `apt-get download` (the Debian
//! mirror is reachable on these machines and in CI), unpacked in Rust, the `vmlinux` extracted
//! from the xz bzImage, and the initramfs built with the agent, busybox and the virtio modules.
//!
//! Set `MICROVM_TEST_KERNEL_DEB=/path/linux-image-<ver>-amd64_*.deb` to use a local package
//! instead of downloading one.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use backend_microvm::guest::initramfs::{self, CpioEntry};
use backend_microvm::guest::install::{self, GuestArtifacts, InstallOptions, KernelSource, Verify};
use backend_microvm::guest::kernel;
use backend_microvm::guest::{GuestError, AGENT_BINARY};

struct Fixture {
    deb: PathBuf,
    artifacts: GuestArtifacts,
}

/// One download and one installation for the whole file (they take seconds).
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        // Kept for the whole run, removed at exit (a static is never dropped).
        let dir = tempfile::tempdir().unwrap().keep();
        common::remove_at_exit(dir.clone());
        let deb = match std::env::var_os("MICROVM_TEST_KERNEL_DEB") {
            Some(p) => PathBuf::from(p),
            None => {
                let dl = dir.join("debs");
                std::fs::create_dir_all(&dl).unwrap();
                install::download_debian_kernel(&dl).unwrap()
            }
        };
        let opts = InstallOptions::debian()
            .dir(dir.join("cache"))
            .kernel(KernelSource::DebFile(deb.clone()));
        let artifacts = install::install(&opts).unwrap();
        Fixture { deb, artifacts }
    })
}

fn entries() -> Vec<CpioEntry> {
    let a = &fixture().artifacts;
    initramfs::check(&std::fs::read(&a.initramfs).unwrap()).unwrap()
}

#[test]
fn debian_package_resolves_to_a_versioned_kernel() {
    let f = fixture();
    let name = f.deb.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("linux-image-") && name.ends_with("_amd64.deb"),
        "{name}"
    );
    let m = &f.artifacts.manifest;
    let ver = m.kernel_version.as_deref().unwrap();
    assert!(ver.ends_with("-amd64"), "{ver}");
    assert!(name.contains(ver), "{name} vs {ver}");
}

#[test]
fn vmlinux_is_an_x86_64_elf_with_a_pvh_note() {
    let a = &fixture().artifacts;
    let elf = std::fs::read(&a.vmlinux).unwrap();
    // Debian's uncompressed kernel is tens of MB.
    assert!(elf.len() > 20 << 20, "{}", elf.len());
    let info = kernel::validate_elf(&elf).unwrap();
    assert!(info.loadable >= 1);
    assert_eq!(kernel::detect(&elf).unwrap(), kernel::KernelFormat::Elf);
    // The ELF loads with linux-loader into guest memory (the kernel's physical load address
    // is 16 MiB; give it 128 MiB) and announces a PVH entry (CONFIG_PVH=y).
    use linux_loader::loader::{elf::Elf, KernelLoader};
    use vm_memory::{GuestAddress, GuestMemoryMmap};
    let mem: GuestMemoryMmap<()> =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 128 << 20)]).unwrap();
    let mut f = std::fs::File::open(&a.vmlinux).unwrap();
    let r = Elf::load(&mem, None, &mut f, Some(GuestAddress(0x10_0000))).unwrap();
    assert!(r.kernel_end > 0x100_0000);
    assert!(matches!(
        r.pvh_boot_cap,
        linux_loader::loader::elf::PvhBootCapability::PvhEntryPresent(_)
    ));
}

#[test]
fn the_bzimage_extraction_matches_the_installed_vmlinux() {
    let f = fixture();
    // Extract again straight from the package's vmlinuz: same bytes as the cached one.
    let deb = std::fs::read(&f.deb).unwrap();
    let pkg = install::scan_kernel_deb(&deb, &f.deb, &[]).unwrap();
    assert!(matches!(
        kernel::detect(&pkg.vmlinuz).unwrap(),
        kernel::KernelFormat::BzImage { compression: "xz" }
    ));
    let mut out = Vec::new();
    let n = kernel::extract_vmlinux(&pkg.vmlinuz, &mut out).unwrap();
    assert_eq!(n as usize, out.len());
    assert_eq!(out, std::fs::read(&f.artifacts.vmlinux).unwrap());
    // A truncated image is a typed error, not a panic or a partial file.
    let dst = f.artifacts.dir.join("truncated-vmlinux");
    let cut = &pkg.vmlinuz[..pkg.vmlinuz.len() / 2];
    assert!(matches!(
        kernel::extract_vmlinux_file_from_bytes(cut, &dst),
        Err(GuestError::BadKernel(_))
    ));
    assert!(!dst.exists());
    // A corrupted payload byte fails the xz check.
    let mut bad = pkg.vmlinuz.clone();
    let mid = bad.len() * 3 / 4;
    bad[mid] ^= 0x55;
    assert!(kernel::extract_vmlinux(&bad, &mut std::io::sink()).is_err());
}

#[test]
fn initramfs_has_agent_busybox_and_virtio_modules() {
    let e = entries();
    let get = |n: &str| {
        e.iter()
            .find(|x| x.name == n)
            .unwrap_or_else(|| panic!("{n} missing"))
    };
    assert_eq!(get("init").data, AGENT_BINARY);
    assert_eq!(get("init").mode & 0o111, 0o111);
    let bb = get("bin/busybox");
    assert!(bb.is_file() && bb.data.starts_with(b"\x7fELF"));
    assert_eq!(get("bin/sh").data, b"busybox");
    assert!(get("bin/ls").is_symlink());
    assert!(get("dev/console").is_char_dev());
    for d in ["proc", "sys", "dev", "tmp", "workspace"] {
        assert!(get(d).is_dir(), "{d}");
    }
    let dep = String::from_utf8(get("lib/modules/modules.dep").data.clone()).unwrap();
    let mut names = Vec::new();
    for line in dep.lines() {
        let (path, deps) = line.split_once(':').unwrap();
        let ko = get(&format!("lib/modules/{path}"));
        let info = initramfs::module_info(&ko.data).unwrap();
        names.push(info.name.clone());
        // Every dependency a module declares is listed and present.
        for d in &info.depends {
            assert!(
                deps.split_whitespace()
                    .any(|p| p.ends_with(&format!("/{d}.ko"))),
                "{line}: {d}"
            );
        }
    }
    names.sort();
    assert_eq!(
        names,
        ["virtio", "virtio_console", "virtio_mmio", "virtio_ring"]
    );

    // The image-root modules, apart (loaded only for `agent.root=`), each dependency listed
    // either with them or among the boot modules.
    let root_dep = String::from_utf8(get("lib/modules/root-modules.dep").data.clone()).unwrap();
    let mut root_names = Vec::new();
    for line in root_dep.lines() {
        let (path, deps) = line.split_once(':').unwrap();
        let info = initramfs::module_info(&get(&format!("lib/modules/{path}")).data).unwrap();
        for d in &info.depends {
            assert!(
                deps.split_whitespace()
                    .any(|p| p.ends_with(&format!("/{d}.ko"))),
                "{line}: {d}"
            );
        }
        root_names.push(info.name);
    }
    root_names.sort();
    let mut expected = initramfs::ROOT_MODULES.to_vec();
    expected.sort();
    assert_eq!(root_names, expected);
    let m = &fixture().artifacts.manifest;
    assert!(m
        .modules
        .iter()
        .all(|r| r.root == initramfs::ROOT_MODULES.contains(&r.name.as_str())));

    // The network modules too (loaded only for `agent.net=`): the driver with its
    // dependencies, each listed with them or among the boot modules.
    let net_dep = String::from_utf8(get("lib/modules/net-modules.dep").data.clone()).unwrap();
    let mut net_names = Vec::new();
    for line in net_dep.lines() {
        let (path, deps) = line.split_once(':').unwrap();
        let info = initramfs::module_info(&get(&format!("lib/modules/{path}")).data).unwrap();
        for d in &info.depends {
            assert!(
                deps.split_whitespace()
                    .any(|p| p.ends_with(&format!("/{d}.ko"))),
                "{line}: {d}"
            );
        }
        net_names.push(info.name);
    }
    net_names.sort();
    let mut expected = initramfs::NET_MODULES.to_vec();
    expected.sort();
    assert_eq!(net_names, expected);
    assert!(m
        .modules
        .iter()
        .all(|r| r.net == initramfs::NET_MODULES.contains(&r.name.as_str())));
}

#[test]
fn cache_reloads_and_detects_corruption() {
    let a = &fixture().artifacts;
    let again = install::load(&a.dir, Verify::Full).unwrap();
    assert_eq!(again.vmlinux, a.vmlinux);
    assert_eq!(again.initramfs, a.initramfs);
    // Work on a copy of the cache (the fixture is shared between tests).
    let copy = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", a.dir.display()))
        .arg(copy.path())
        .status()
        .unwrap();
    assert!(status.success());
    install::load(copy.path(), Verify::Sizes).unwrap();
    let v = copy.path().join(a.vmlinux.file_name().unwrap());
    let len = std::fs::metadata(&v).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&v)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let err = install::load(copy.path(), Verify::Sizes).unwrap_err();
    assert!(matches!(err, GuestError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("install microvm-guest"), "{err}");
}

#[test]
fn a_package_the_mirror_does_not_have_is_a_typed_error() {
    // apt-get download fails; as root the lists are refreshed once and it fails again.
    let dir = tempfile::tempdir().unwrap();
    match install::apt_download("agent-sandbox-no-such-package", dir.path()) {
        Err(GuestError::Command { command, reason }) => {
            assert!(command.contains("apt-get"), "{command}");
            assert!(!reason.is_empty());
        }
        other => panic!("{other:?}"),
    }
}
