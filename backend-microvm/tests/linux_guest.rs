#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The Linux guest below the `Sandbox` API: Debian's kernel + our initramfs booted in our VMM,
//! the agent ready on the virtio-console, the guest's mounts, and a guest shutdown ending the
//! VM (a `VmExit` the sandbox API does not show). Exec, env, secrets, files, limits, streaming,
//! snapshot/restore and teardown of a booted guest are tested once, through the backend, in
//! `tests/backend.rs`.
//!
//! Runs only where the probe reports hardware-speed guest kernel mode; elsewhere (e.g. nested
//! PVM hosts, where kernel mode is emulated and Linux cannot boot) every test prints the
//! probe's reason and returns.
//!
//! The guest artifacts come from `MICROVM_GUEST_DIR` if set (a cache prepared by
//! `agent-sandbox install microvm-guest`), else they are prepared once (Debian's package via
//! `apt-get download`) in a directory under the system temp dir and reused.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use backend_microvm::acpi::VirtioMmioDesc;
use backend_microvm::agent_client::{AgentClient, ExecRequest};
use backend_microvm::boot::{self, BootConfig};
use backend_microvm::guest::install::{self, GuestArtifacts, InstallOptions, Verify};
use backend_microvm::probe::probe_kvm;
use backend_microvm::vmm::{Entry, Vm, VmConfig, VmExit};

const MEM: u64 = 256 << 20;
const T: Duration = Duration::from_secs(30);
const BOOT_WAIT: Duration = Duration::from_secs(60);

fn skip_reason() -> Option<String> {
    let p = probe_kvm();
    if p.linux_guests_supported() {
        None
    } else {
        Some(p.reason)
    }
}

fn artifacts() -> &'static GuestArtifacts {
    static A: OnceLock<GuestArtifacts> = OnceLock::new();
    A.get_or_init(|| {
        let dir = std::env::var_os("MICROVM_GUEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("agent-sandbox-linux-guest-test"));
        match install::load(&dir, Verify::Sizes) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("preparing guest artifacts in {} ({e})", dir.display());
                install::install(&InstallOptions::debian().dir(dir)).unwrap()
            }
        }
    })
}

fn config() -> VmConfig {
    VmConfig::default()
        .mem_size(MEM)
        .vcpus(1)
        .virtio_console(true)
        .deadline(Some(Duration::from_secs(300)))
}

struct Guest {
    vm: Vm,
    agent: AgentClient,
}

fn fail_with_console(vm: &Vm, what: &str, e: impl std::fmt::Debug) -> ! {
    panic!(
        "{what}: {e:?}\nVM exit: {:?}\n--- serial console ---\n{}",
        vm.exit(),
        String::from_utf8_lossy(&vm.serial_output())
    );
}

fn boot_guest() -> Guest {
    let a = artifacts();
    let mut vm = Vm::new(config()).unwrap();
    let devices: Vec<VirtioMmioDesc> = vm
        .virtio_devices()
        .iter()
        .map(|d| VirtioMmioDesc {
            base: d.base,
            size: d.size,
            irq: d.irq,
        })
        .collect();
    assert_eq!(devices.len(), 1, "one virtio-console");
    let initrd = std::fs::read(&a.initramfs).unwrap();
    let mut kernel = std::fs::File::open(&a.vmlinux).unwrap();
    let boot = boot::load_linux(
        vm.memory(),
        &mut kernel,
        &BootConfig {
            cmdline: boot::DEFAULT_CMDLINE,
            initrd: &initrd,
            mem_size: vm.mem_size(),
            vcpus: 1,
            devices: &devices,
        },
    )
    .unwrap();
    let console = vm.take_console().unwrap();
    vm.start(Entry::kernel(boot.entry.0)).unwrap();
    let agent = AgentClient::new(console).unwrap();
    if let Err(e) = agent.wait_ready(BOOT_WAIT) {
        fail_with_console(&vm, "the agent did not come up", e);
    }
    Guest { vm, agent }
}

fn req(argv: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..ExecRequest::default()
    }
}

#[test]
fn linux_boots_and_the_agent_serves() {
    if let Some(why) = skip_reason() {
        eprintln!("SKIP: {why}");
        return;
    }
    let g = boot_guest();
    let c = &g.agent;
    c.ping(T).unwrap();

    // The guest runs Debian's kernel, with our mounts.
    let out = c.exec(&req(&["uname", "-r"])).unwrap();
    let release = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(
        Some(release.as_str()),
        artifacts().manifest.kernel_version.as_deref()
    );
    let mounts = c.exec(&req(&["cat", "/proc/mounts"])).unwrap();
    let mounts = String::from_utf8_lossy(&mounts.stdout).into_owned();
    for m in [
        " /proc proc",
        " /sys sysfs",
        " /dev devtmpfs",
        " /tmp tmpfs",
        " /workspace tmpfs",
    ] {
        assert!(mounts.contains(m), "{m} not in {mounts}");
    }

    let out = c.exec(&req(&["sh", "-c", "echo out; exit 7"])).unwrap();
    assert_eq!(
        (out.stdout.as_slice(), out.exit.code),
        (&b"out\n"[..], Some(7))
    );

    // Shutdown: the guest reboots (reboot=k: through the i8042), the VMM ends the VM.
    c.shutdown(T).unwrap();
    match g.vm.wait_timeout(T) {
        Some(VmExit::Reset) | Some(VmExit::PowerOff) => {}
        other => fail_with_console(&g.vm, "after shutdown", other),
    }
}

#[test]
fn a_missing_or_agentless_initramfs_is_a_typed_error() {
    // No KVM needed: this is about the artifacts, checked before a VM is made.
    let dir = tempfile::tempdir().unwrap();
    let mut w = backend_microvm::guest::initramfs::CpioWriter::new();
    w.file("bin/sh", 0o755, b"\x7fELF").unwrap();
    let p = dir.path().join("bad.cpio");
    std::fs::write(&p, w.finish()).unwrap();
    let err = backend_microvm::guest::initramfs::check(&std::fs::read(&p).unwrap()).unwrap_err();
    assert!(err.to_string().contains("/init"), "{err}");
    assert!(matches!(
        install::load(dir.path(), Verify::Sizes),
        Err(backend_microvm::guest::GuestError::NotInstalled { .. })
    ));
}
