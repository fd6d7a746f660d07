//! The QEMU harness of the guest-side tests: Debian's kernel and our initramfs booted by
//! QEMU's software emulator as a `microvm` machine, our [`AgentClient`] on its console
//! socket. Included by the test files that boot such a guest (`#[path]`).
#![allow(dead_code)]

use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use backend_microvm::agent_client::proto::ExecRequest;
use backend_microvm::agent_client::{AgentClient, AgentError};
use backend_microvm::guest::install::{self, InstallOptions, KernelSource};

pub(crate) const QEMU: &str = "qemu-system-x86_64";
/// Generous: TCG boots the kernel in seconds here, but CI machines are shared.
pub(crate) const BOOT: Duration = Duration::from_secs(120);
pub(crate) const CALL: Duration = Duration::from_secs(60);

pub(crate) fn qemu_missing() -> Option<String> {
    let found = Command::new(QEMU)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    (!found).then(|| {
        format!(
            "`{QEMU}` is not installed (apt-get install --no-install-recommends qemu-system-x86)"
        )
    })
}

/// Kills QEMU when the test ends, whatever happens.
pub(crate) struct Qemu(pub(crate) Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn guest_files(dir: &Path) -> (PathBuf, PathBuf) {
    let deb = match std::env::var_os("MICROVM_TEST_KERNEL_DEB") {
        Some(p) => PathBuf::from(p),
        None => {
            let dl = dir.join("debs");
            std::fs::create_dir_all(&dl).unwrap();
            install::download_debian_kernel(&dl).unwrap()
        }
    };
    let a = install::install(
        &InstallOptions::debian()
            .dir(dir.join("cache"))
            .kernel(KernelSource::DebFile(deb)),
    )
    .unwrap();
    (a.vmlinux, a.initramfs)
}

/// Whether the serial log shows a kernel whose clock never ticked: every line stamped
/// `0.000000`. Under TCG the emulated timer sometimes never reaches the guest in early boot
/// (always right after the mount-cache lines, before the initramfs is unpacked), and the
/// kernel waits forever; our agent never runs. Since the kernel is told the TSC frequency
/// ([`host_tsc_khz`]) this has not been seen; the retry stays as a safety net.
pub(crate) fn stalled_before_the_clock_ticked(log: &str) -> bool {
    let stamps: Vec<&str> = log
        .lines()
        .filter_map(|l| l.strip_prefix('[')?.split_once(']').map(|(t, _)| t.trim()))
        .collect();
    !stamps.is_empty() && stamps.iter().all(|t| *t == "0.000000")
}

/// The host's TSC frequency in kHz, measured against the monotonic clock over 100 ms.
///
/// Under TCG the guest's TSC is the host's, and the kernel is told its frequency
/// (`tsc_early_khz=`) instead of calibrating it against the emulated PIT. That calibration
/// failed in about half the boots here, idle machine or not ("tsc: Unable to calibrate
/// against PIT"): the kernel then has no TSC frequency, calibrates the local APIC timer by
/// waiting for PIT ticks that never reach it, and hangs with its clock at 0 (2 of 4 boots
/// stalled without this parameter, 0 of 8 with it, in back-to-back runs).
pub(crate) fn host_tsc_khz() -> u64 {
    let t0 = Instant::now();
    // SAFETY: `rdtsc` only reads the time-stamp counter (every x86-64 CPU has one).
    let c0 = unsafe { std::arch::x86_64::_rdtsc() };
    std::thread::sleep(Duration::from_millis(100));
    // SAFETY: as above.
    let c1 = unsafe { std::arch::x86_64::_rdtsc() };
    (c1.wrapping_sub(c0) as f64 / t0.elapsed().as_secs_f64() / 1000.0) as u64
}

/// What a boot adds to the default machine: kernel parameters and QEMU arguments.
#[derive(Default)]
pub(crate) struct Extra {
    pub(crate) append: String,
    pub(crate) args: Vec<String>,
    /// A TAP device's descriptor, handed to QEMU as its fd 10 (`-netdev tap,fd=10`).
    pub(crate) tap: Option<RawFd>,
}

/// Boots the guest; a boot that stalled before the kernel's clock ever ticked (see
/// [`stalled_before_the_clock_ticked`]: the emulator's fault, not the guest's) is killed
/// and tried once more, saying so. Any other failure fails the test.
pub(crate) fn boot(dir: &Path, extra: &Extra) -> (Qemu, AgentClient) {
    let first = Duration::from_secs(60);
    match boot_once(dir, first, extra) {
        Ok(booted) => booted,
        Err(f) if stalled_before_the_clock_ticked(&f.log) => {
            eprintln!(
                "QEMU's guest stalled in early boot with its clock stopped at 0 \
                 (an emulator timer flake under load); booting it once more"
            );
            boot_once(dir, BOOT, extra).unwrap_or_else(|f| {
                panic!(
                    "the agent did not come up (second boot): {}\n--- serial ---\n{}",
                    f.error, f.log
                )
            })
        }
        Err(f) => panic!(
            "the agent did not come up: {}\n--- serial ---\n{}",
            f.error, f.log
        ),
    }
}

/// A boot whose agent did not come up ready.
pub(crate) struct BootFailure {
    /// What `wait_ready` said.
    pub(crate) error: AgentError,
    /// The serial log.
    pub(crate) log: String,
    /// QEMU, still running, and the client, for a guest that serves after a set-up failure.
    pub(crate) guest: Option<(Qemu, AgentClient)>,
}

/// One boot: QEMU running and the agent ready within `wait`, or why not with the serial log
/// (QEMU killed, unless the agent announced a set-up failure and still serves).
pub(crate) fn boot_once(
    dir: &Path,
    wait: Duration,
    extra: &Extra,
) -> Result<(Qemu, AgentClient), BootFailure> {
    let (vmlinux, initramfs) = guest_files(dir);
    let sock = dir.join("agent.sock");
    let serial = dir.join("serial.log");
    let _ = std::fs::remove_file(&sock);
    let mut cmd = Command::new(QEMU);
    if let Some(fd) = extra.tap {
        // SAFETY: dup2 is async-signal-safe; it puts the TAP at fd 10 without CLOEXEC.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(fd, 10) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let child = cmd
        // A PIT and no timer checks: under TCG on a loaded host, timer calibration can
        // otherwise stall the boot ("tsc: Unable to calibrate against PIT").
        .args([
            "-M",
            "microvm,acpi=on,rtc=on,pit=on",
            "-cpu",
            "max",
            "-m",
            "256",
        ])
        .args(["-smp", "1", "-nodefaults", "-no-reboot", "-display", "none"])
        .arg("-kernel")
        .arg(&vmlinux)
        .arg("-initrd")
        .arg(&initramfs)
        .arg("-append")
        .arg(format!(
            "console=ttyS0 reboot=k panic=1 pci=off rdinit=/init no_timer_check tsc=unstable \
             lpj=2000000 tsc_early_khz={} {}",
            host_tsc_khz(),
            extra.append
        ))
        .arg("-serial")
        .arg(format!("file:{}", serial.display()))
        .args(["-device", "virtio-serial-device"])
        .arg("-chardev")
        // `wait=on`: the guest does not start before we are connected (no lost `Ready`).
        .arg(format!(
            "socket,id=agent,path={},server=on,wait=on",
            sock.display()
        ))
        .args(["-device", "virtconsole,chardev=agent"])
        .args(&extra.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let qemu = Qemu(child);
    let start = Instant::now();
    let stream = loop {
        match UnixStream::connect(&sock) {
            Ok(s) => break s,
            Err(_) if start.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("QEMU's agent socket never appeared: {e}"),
        }
    };
    let client = AgentClient::new(stream).unwrap();
    if let Err(error) = client.wait_ready(wait) {
        let guest = if matches!(error, AgentError::GuestSetup(_)) {
            Some((qemu, client))
        } else {
            drop(qemu);
            None
        };
        let log = std::fs::read_to_string(&serial).unwrap_or_default();
        return Err(BootFailure { error, log, guest });
    }
    Ok((qemu, client))
}

pub(crate) fn exec(
    c: &AgentClient,
    argv: &[&str],
    env: &[(&str, &str)],
) -> (Option<i32>, String, String) {
    let out = c
        .exec(&ExecRequest {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            cwd: String::new(),
            stdin: Vec::new(),
            timeout_ms: 60_000,
            max_output: 0,
        })
        .unwrap();
    (
        out.exit.code,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub(crate) fn shut_down(qemu: &mut Qemu, c: &AgentClient) {
    c.shutdown(CALL).unwrap();
    let start = Instant::now();
    loop {
        if let Some(status) = qemu.0.try_wait().unwrap() {
            eprintln!("QEMU exited: {status}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the guest did not power off after shutdown"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The Debian 13 image (python3 3.13, numpy) that `scripts/test-image.sh` builds, as an OCI
/// layout, or why there is none.
pub(crate) fn test_image() -> Result<PathBuf, String> {
    let dir = std::env::var_os("AGENT_SANDBOX_TEST_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/agent-sandbox-images"))
        .join("trixie-numpy");
    if dir.join("index.json").is_file() {
        Ok(dir)
    } else {
        Err(format!(
            "no test image at {} (scripts/test-image.sh builds it; scripts/test.sh runs that)",
            dir.display()
        ))
    }
}

/// [`test_image`] as the backend boots it: pulled into an image store under `dir`, made into
/// its read-only ext4 disk by `ImageStore::rootfs_image`; with the image's `PATH`.
pub(crate) async fn test_image_disk(
    dir: &Path,
) -> Result<(sandbox_image::FsImage, String), String> {
    let layout = test_image()?;
    let store = backend_microvm::ImageStore::builder(dir.join("images"))
        .build()
        .unwrap();
    let r = sandbox_core::ImageRef::parse(&format!("oci:{}:python3", layout.display())).unwrap();
    let image = store.ensure(&r).await.unwrap();
    let i2 = image.clone();
    let disk = tokio::task::spawn_blocking(move || store.rootfs_image(&i2))
        .await
        .unwrap()
        .unwrap();
    let path = image.config().path().unwrap_or("/usr/bin:/bin").to_string();
    Ok((disk, path))
}

/// QEMU's arguments for `disk` as a read-only virtio-blk device (the guest's `/dev/vda`).
pub(crate) fn disk_args(disk: &Path) -> Vec<String> {
    vec![
        "-drive".into(),
        format!(
            "file={},if=none,id=d0,format=raw,readonly=on",
            disk.display()
        ),
        "-device".into(),
        "virtio-blk-device,drive=d0".into(),
    ]
}
