#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The guest side on a real Linux kernel, where KVM cannot boot one: Debian's kernel with
//! our initramfs (the agent as pid 1, busybox, the virtio modules) booted by QEMU's software
//! emulator (TCG) as a `microvm` machine whose virtio-mmio console is described by ACPI, the
//! same way our VMM describes its own. The host side is our [`AgentClient`] on QEMU's socket.
//!
//! What this shows on this host: the kernel finds the virtio-mmio device through ACPI, the
//! agent loads `virtio_mmio`/`virtio_console` from the initramfs, opens `/dev/hvc0` raw and
//! serves exec (env, cwd, stdin, exit codes, timeouts, streaming), files (and refuses escapes)
//! and shutdown. What it does not show: our VMM's own devices and ACPI tables under a Linux
//! guest (that needs hardware KVM: `tests/linux_guest.rs`).
//!
//! Needs `qemu-system-x86_64` (`apt-get install --no-install-recommends qemu-system-x86`;
//! scripts/test.sh installs it) and the Debian mirror (or `MICROVM_TEST_KERNEL_DEB`).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use backend_microvm::agent_client::proto::{EntryKind, ExecRequest};
use backend_microvm::agent_client::{AgentClient, AgentError, ExecEvent};
use backend_microvm::guest::install::{self, InstallOptions, KernelSource};

const QEMU: &str = "qemu-system-x86_64";
/// Generous: TCG boots the kernel in seconds here, but CI machines are shared.
const BOOT: Duration = Duration::from_secs(120);
const CALL: Duration = Duration::from_secs(60);

fn qemu_missing() -> Option<String> {
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
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn guest_files(dir: &Path) -> (PathBuf, PathBuf) {
    let deb = match std::env::var_os("MICROVM_TEST_KERNEL_DEB") {
        Some(p) => PathBuf::from(p),
        None => {
            let dl = dir.join("debs");
            std::fs::create_dir_all(&dl).unwrap();
            install::download_debian_kernel(&dl).unwrap()
        }
    };
    let a = install::install(&InstallOptions {
        dir: dir.join("cache"),
        kernel: KernelSource::DebFile(deb),
        busybox: None,
        no_busybox: false,
    })
    .unwrap();
    (a.vmlinux, a.initramfs)
}

/// Whether the serial log shows a kernel whose clock never ticked: every line stamped
/// `0.000000`. Under TCG the emulated timer sometimes never reaches the guest in early boot
/// (always right after the mount-cache lines, before the initramfs is unpacked), and the
/// kernel waits forever; our agent never runs. Since the kernel is told the TSC frequency
/// ([`host_tsc_khz`]) this has not been seen; the retry stays as a safety net.
fn stalled_before_the_clock_ticked(log: &str) -> bool {
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
fn host_tsc_khz() -> u64 {
    let t0 = Instant::now();
    // SAFETY: `rdtsc` only reads the time-stamp counter (every x86-64 CPU has one).
    let c0 = unsafe { std::arch::x86_64::_rdtsc() };
    std::thread::sleep(Duration::from_millis(100));
    // SAFETY: as above.
    let c1 = unsafe { std::arch::x86_64::_rdtsc() };
    (c1.wrapping_sub(c0) as f64 / t0.elapsed().as_secs_f64() / 1000.0) as u64
}

/// Boots the guest; a boot that stalled before the kernel's clock ever ticked (see
/// [`stalled_before_the_clock_ticked`]: the emulator's fault, not the guest's) is killed
/// and tried once more, saying so. Any other failure fails the test.
fn boot(dir: &Path) -> (Qemu, AgentClient) {
    let first = Duration::from_secs(60);
    match boot_once(dir, first) {
        Ok(booted) => booted,
        Err(log) if stalled_before_the_clock_ticked(&log) => {
            eprintln!(
                "QEMU's guest stalled in early boot with its clock stopped at 0 \
                 (an emulator timer flake under load); booting it once more"
            );
            boot_once(dir, BOOT).unwrap_or_else(|log| {
                panic!("the agent did not come up (second boot)\n--- serial ---\n{log}")
            })
        }
        Err(log) => panic!("the agent did not come up\n--- serial ---\n{log}"),
    }
}

/// One boot: QEMU running and the agent ready within `wait`, or the serial log (prefixed
/// with the error) after killing QEMU.
fn boot_once(dir: &Path, wait: Duration) -> Result<(Qemu, AgentClient), String> {
    let (vmlinux, initramfs) = guest_files(dir);
    let sock = dir.join("agent.sock");
    let serial = dir.join("serial.log");
    let _ = std::fs::remove_file(&sock);
    let child = Command::new(QEMU)
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
             lpj=2000000 tsc_early_khz={}",
            host_tsc_khz()
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
    if let Err(e) = client.wait_ready(wait) {
        drop(qemu);
        let log = std::fs::read_to_string(&serial).unwrap_or_default();
        return Err(format!("{e}\n{log}"));
    }
    Ok((qemu, client))
}

fn exec(c: &AgentClient, argv: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
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

#[test]
fn debian_kernel_boots_our_initramfs_and_the_agent_serves() {
    if let Some(why) = qemu_missing() {
        eprintln!("SKIP: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut qemu, c) = boot(dir.path());

    // The guest is the kernel we installed, with our agent as pid 1.
    let (code, out, err) = exec(&c, &["sh", "-c", "uname -sm; cat /proc/1/comm"], &[]);
    assert_eq!(code, Some(0), "{err}");
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("Linux x86_64"), "{out}");
    assert!(lines.next().is_some_and(|l| !l.is_empty()), "{out}");
    // The virtio-console came from ACPI (no virtio_mmio.device= on the command line) and the
    // modules were loaded from the initramfs.
    let (_, out, _) = exec(
        &c,
        &["sh", "-c", "cat /proc/cmdline; cat /proc/modules"],
        &[],
    );
    assert!(!out.contains("virtio_mmio.device"), "{out}");
    assert!(out.contains("virtio_console"), "{out}");

    // Exactly the environment given (plus the default PATH), exit codes, stdin, cwd.
    let (code, out, _) = exec(&c, &["env"], &[("ONLY", "this")]);
    assert_eq!(code, Some(0));
    let mut keys: Vec<&str> = out.lines().filter_map(|l| l.split('=').next()).collect();
    keys.sort();
    assert_eq!(keys, ["ONLY", "PATH"], "{out}");
    let (code, _, _) = exec(&c, &["sh", "-c", "exit 7"], &[]);
    assert_eq!(code, Some(7));
    let out = c.exec(&ExecRequest {
        argv: vec!["sh".into(), "-c".into(), "pwd; cat".into()],
        env: vec![],
        cwd: "sub".into(),
        stdin: b"from stdin".to_vec(),
        timeout_ms: 60_000,
        max_output: 0,
    });
    // `sub` does not exist yet: a clear error or a failed start, never a hang.
    assert!(out.is_err() || out.as_ref().is_ok_and(|o| o.exit.code != Some(0)));
    c.write_file("sub/note.txt", b"hello guest", 0o644, CALL)
        .unwrap();
    let out = c
        .exec(&ExecRequest {
            argv: vec!["sh".into(), "-c".into(), "pwd; cat; cat note.txt".into()],
            env: vec![],
            cwd: "sub".into(),
            stdin: b"from stdin\n".to_vec(),
            timeout_ms: 60_000,
            max_output: 0,
        })
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "/workspace/sub\nfrom stdin\nhello guest"
    );

    // Files: read back, listed, escapes refused.
    assert_eq!(
        c.read_file("sub/note.txt", 1 << 20, CALL).unwrap(),
        b"hello guest"
    );
    let list = c.list("sub", CALL).unwrap();
    assert!(list
        .iter()
        .any(|e| e.name == "note.txt" && e.kind == EntryKind::File && e.size == 11));
    for bad in ["../etc/passwd", "/etc/passwd"] {
        assert!(
            matches!(
                c.read_file(bad, 1 << 20, CALL),
                Err(AgentError::Remote { .. })
            ),
            "{bad}"
        );
    }

    // The tmpfs mounts live in the guest's RAM: together they hold at most 5/8 of what the
    // kernel and initramfs left (~200 of 256 MiB), so filling the workspace is ENOSPC and the
    // guest and its agent go on.
    let (code, out, err) = exec(
        &c,
        &[
            "sh",
            "-c",
            "df -k /workspace /tmp /dev/shm | tail -n 3; dd if=/dev/zero of=/workspace/big bs=1M count=1024 2>&1; echo rc=$?",
        ],
        &[],
    );
    assert_eq!(code, Some(0), "{err}");
    let total_kib: u64 = out
        .lines()
        .take(3)
        .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
        .sum();
    assert!(total_kib > 0 && total_kib <= (256 << 10) / 8 * 5, "{out}");
    assert!(
        out.contains("No space left") && out.ends_with("rc=1\n"),
        "{out}"
    );
    let (code, out, err) = exec(&c, &["sh", "-c", "rm /workspace/big && echo alive"], &[]);
    assert_eq!((code, out.as_str()), (Some(0), "alive\n"), "{err}");

    // Streaming and timeouts.
    let mut h = c
        .start_exec(&ExecRequest {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "echo first; sleep 30; echo never".into(),
            ],
            env: vec![],
            cwd: String::new(),
            stdin: vec![],
            timeout_ms: 2_000,
            max_output: 0,
        })
        .unwrap();
    let mut seen = String::new();
    let exit = loop {
        match h.next_event().unwrap() {
            ExecEvent::Stdout(b) => seen.push_str(&String::from_utf8_lossy(&b)),
            ExecEvent::Stderr(_) => {}
            ExecEvent::Exit(e) => break e,
        }
    };
    assert_eq!(seen, "first\n");
    assert!(exit.timed_out, "{exit:?}");

    // Shutdown powers the guest off: QEMU exits by itself.
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

#[test]
fn a_stall_before_the_clock_ticked_is_told_apart() {
    let stalled = "no answer from the guest agent within 60s\n\
        [    0.000000] Linux version 6.1.0-57-amd64\n\
        [    0.000000] Mountpoint-cache hash table entries: 512 (order: 0, 4096 bytes, linear)\n";
    assert!(stalled_before_the_clock_ticked(stalled));
    let later = "no answer\n[    0.000000] Linux version\n[    0.412345] Unpacking initramfs...\n";
    assert!(!stalled_before_the_clock_ticked(later));
    assert!(!stalled_before_the_clock_ticked("no answer\n"));
}
