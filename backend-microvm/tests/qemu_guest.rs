#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The guest side on a real Linux kernel, where KVM cannot boot one: Debian's kernel with
//! our initramfs (the agent as pid 1, busybox, the virtio modules) booted by QEMU's software
//! emulator (TCG) as a `microvm` machine whose virtio-mmio console is described by ACPI, the
//! same way our VMM describes its own. The host side is our [`AgentClient`] on QEMU's socket.
//!
//! What this shows on this host: the kernel finds the virtio-mmio device through ACPI, the
//! agent loads `virtio_mmio`/`virtio_console` from the initramfs, opens `/dev/hvc0` raw and
//! serves exec (env, cwd, stdin, exit codes, timeouts, streaming), files (and refuses escapes)
//! and shutdown; and, given a read-only ext4 disk and `agent.root=/dev/vda`, the agent mounts
//! it under a writable overlay and switches to it as the root (the guest side of sandboxes
//! from OCI images). What it does not show: our VMM's own devices and ACPI tables under a Linux
//! guest (that needs hardware KVM: `tests/linux_guest.rs`).
//!
//! Needs `qemu-system-x86_64` (`apt-get install --no-install-recommends qemu-system-x86`;
//! scripts/test.sh installs it) and the Debian mirror (or `MICROVM_TEST_KERNEL_DEB`).

#[path = "common/qemu.rs"]
mod qemu;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use backend_microvm::agent_client::proto::{EntryKind, ExecRequest};
use backend_microvm::agent_client::{AgentError, ExecEvent, FsKind};
use qemu::*;

#[test]
fn debian_kernel_boots_our_initramfs_and_the_agent_serves() {
    if let Some(why) = qemu_missing() {
        eprintln!("SKIP: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut qemu, c) = boot(dir.path(), &Extra::default());

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
    // A command starts with every signal at its default and none blocked (the agent, pid 1,
    // ignores SIGPIPE itself), and a shell can trap SIGINT.
    let (code, out, err) = exec(&c, &["grep", "^Sig[IB]", "/proc/self/status"], &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        out.split_whitespace().collect::<Vec<_>>(),
        ["SigBlk:", "0000000000000000", "SigIgn:", "0000000000000000"],
        "{out}"
    );
    let (code, out, err) = exec(
        &c,
        &[
            "sh",
            "-c",
            "trap 'echo caught' INT; kill -INT $$; echo after",
        ],
        &[],
    );
    assert_eq!((code, out.as_str()), (Some(0), "caught\nafter\n"), "{err}");
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

    // A watch of the guest's workspace (inotify of the guest's kernel, on its tmpfs): a
    // directory made and filled by a command is reported with what it holds.
    let mut w = c.start_watch("", true).unwrap();
    let (code, _, err) = exec(&c, &["sh", "-c", "mkdir -p w/in && echo x > w/in/f"], &[]);
    assert_eq!(code, Some(0), "{err}");
    let mut seen = Vec::new();
    while !seen.iter().any(|(_, p): &(FsKind, String)| p == "w/in/f") {
        let ev = w.next_event(CALL).unwrap().expect("the watch ended");
        seen.push((ev.kind, ev.path));
    }
    assert_eq!(seen[0], (FsKind::Create, "w".to_string()), "{seen:?}");
    w.stop().unwrap();
    // Stopped, the watch ends: what the guest sent before the stop (the file's `Write`
    // after its `Create`) may still come first, nothing else does.
    let mut after = 0;
    while let Some(ev) = w.next_event(CALL).unwrap() {
        assert_eq!(ev.path, "w/in/f", "an event after the stop: {ev:?}");
        after += 1;
        assert!(after <= 2, "the watch did not end after its stop: {ev:?}");
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
            other => panic!("unexpected event {other:?}"),
        }
    };
    assert_eq!(seen, "first\n");
    assert!(exit.timed_out, "{exit:?}");

    // A background process on a terminal of the guest's own devpts: its size, a resize,
    // typed input, Ctrl-C to the foreground job, and the session's exit code.
    let mut sh = c
        .start_spawn(
            &ExecRequest {
                argv: vec!["sh".into(), "-i".into()],
                env: vec![],
                cwd: String::new(),
                stdin: b"stty size; tty\n".to_vec(),
                timeout_ms: 0,
                max_output: 0,
            },
            Some((24, 80)),
            1 << 20,
        )
        .unwrap();
    let id = sh.id();
    // Reads until `needle` shows; returns what was read.
    let until = |sh: &mut backend_microvm::agent_client::ExecHandle, needle: &str| {
        let mut screen = String::new();
        while !screen.contains(needle) {
            match sh.next_event().unwrap() {
                ExecEvent::Stdout(b) | ExecEvent::Stderr(b) => {
                    screen.push_str(&String::from_utf8_lossy(&b));
                    c.grant(id, 1 << 16).unwrap();
                }
                ExecEvent::Exit(e) => panic!("exited {e:?} waiting for {needle:?}: {screen}"),
                other => panic!("unexpected event {other:?}"),
            }
        }
        screen
    };
    let screen = until(&mut sh, "/dev/pts/");
    assert!(screen.contains("24 80"), "{screen}");
    c.resize(id, 30, 100, CALL).unwrap();
    c.input(id, b"stty size\n", CALL).unwrap();
    until(&mut sh, "30 100");
    c.input(id, b"sleep 1000\n", CALL).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    c.input(id, b"\x03echo after-$((6*7))\n", CALL).unwrap();
    until(&mut sh, "after-42");
    c.input(id, b"exit 3\n", CALL).unwrap();
    let exit = loop {
        match sh.next_event().unwrap() {
            ExecEvent::Exit(e) => break e,
            _ => c.grant(id, 1 << 16).unwrap(),
        }
    };
    assert_eq!(exit.code, Some(3), "{exit:?}");

    // A fresh identity (what every booted or restored sandbox gets): hostname, random
    // state, clock. The clock first set to 2030, then to this host's.
    c.refresh_at("mvm-qemu-test", 1_893_456_000_000_000_000, CALL)
        .unwrap();
    let (code, out, err) = exec(&c, &["sh", "-c", "hostname; date -u +%Y"], &[]);
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "mvm-qemu-test\n2030\n"),
        "{err}"
    );
    c.refresh("mvm-qemu-test-2", CALL).unwrap();
    let (_, out, _) = exec(&c, &["date", "+%s"], &[]);
    let guest: u64 = out.trim().parse().unwrap();
    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(guest.abs_diff(host) < 30, "guest {guest}, host {host}");
    match c.refresh("bad name", CALL) {
        Err(AgentError::Remote { message, .. }) => assert!(message.contains("hostname")),
        other => panic!("{other:?}"),
    }

    // A published port's path: a server on the guest's loopback (busybox httpd serving the
    // workspace, no network device), reached through the agent's `Connect`.
    let _httpd = c
        .start_spawn(
            &ExecRequest {
                argv: ["httpd", "-f", "-p", "127.0.0.1:8080", "-h", "/workspace"]
                    .map(String::from)
                    .to_vec(),
                env: vec![],
                cwd: String::new(),
                stdin: vec![],
                timeout_ms: 0,
                max_output: 0,
            },
            None,
            1 << 20,
        )
        .unwrap();
    let start = Instant::now();
    let mut conn = loop {
        match c.start_connect(8080, 1 << 20) {
            Ok(h) => break h,
            Err(AgentError::Remote { .. }) if start.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => panic!("connect to the guest's httpd: {e}"),
        }
    };
    let target = conn.id();
    c.input(target, b"GET /sub/note.txt HTTP/1.0\r\n\r\n", CALL)
        .unwrap();
    // (The server may have answered and closed already: then there is nothing to close.)
    match c.close_input(target, CALL) {
        Ok(()) | Err(AgentError::Remote { .. }) => {}
        Err(e) => panic!("{e}"),
    }
    let mut page = String::new();
    loop {
        match conn.next_event().unwrap() {
            ExecEvent::Stdout(b) => {
                page.push_str(&String::from_utf8_lossy(&b));
                c.grant(target, 1 << 16).unwrap();
            }
            ExecEvent::Stderr(_) => {}
            ExecEvent::Exit(e) => {
                assert_eq!(e.code, Some(0), "{e:?}");
                break;
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert!(
        page.starts_with("HTTP/1.") && page.contains(" 200 "),
        "{page}"
    );
    assert!(page.ends_with("hello guest"), "{page}");
    // Nothing on a port: refused, typed.
    match c.start_connect(8081, 1 << 20) {
        Err(AgentError::Remote { kind, .. }) => {
            assert_eq!(kind, backend_microvm::agent_client::ErrorKind::NotFound)
        }
        other => panic!("{other:?}"),
    }

    // Shutdown powers the guest off: QEMU exits by itself.
    shut_down(&mut qemu, &c);
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

// ---------------------------------------------------------------------------------------------
// image root

const MARKER: &str = "from the image's ext4 filesystem\n";

/// Copies a host file to the same path under `tree` (following symlinks).
fn copy_host_file(tree: &Path, host: &Path) {
    let dst = tree.join(host.strip_prefix("/").unwrap());
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    std::fs::copy(host, &dst).unwrap();
}

/// Copies a host directory tree to the same path under `tree` (symlinks kept as such).
fn copy_host_dir(tree: &Path, host: &Path) {
    let dst = tree.join(host.strip_prefix("/").unwrap());
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(host).unwrap() {
        let e = e.unwrap();
        let (src, ty) = (e.path(), e.file_type().unwrap());
        if ty.is_dir() {
            copy_host_dir(tree, &src);
        } else if ty.is_symlink() {
            let target = std::fs::read_link(&src).unwrap();
            std::os::unix::fs::symlink(target, dst.join(e.file_name())).unwrap();
        } else if ty.is_file() {
            std::fs::copy(&src, dst.join(e.file_name())).unwrap();
        }
    }
}

/// The host's Python (`/usr/bin/python3` and its standard library, `/usr/lib/python3.X`) and
/// the shared libraries `ldd` names for it, if it has one: a dynamically linked program for
/// the image.
fn host_python() -> Option<(PathBuf, PathBuf, Vec<PathBuf>)> {
    let exe = std::fs::canonicalize("/usr/bin/python3").ok()?;
    let name = exe.file_name()?.to_str()?.to_string();
    let lib = Path::new("/usr/lib").join(&name);
    if !name.starts_with("python3.") || !lib.join("os.py").is_file() {
        return None;
    }
    let out = Command::new("ldd").arg(&exe).output().ok()?;
    let libs = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')))
        .map(PathBuf::from)
        .collect::<Vec<_>>();
    (out.status.success() && !libs.is_empty()).then_some((exe, lib, libs))
}

/// A small root filesystem tree: the host's static busybox with a few applet links, a marker
/// file, and the host's Python when there is one. Returns whether Python is in it.
fn image_tree(tree: &Path) -> bool {
    for d in ["bin", "etc", "usr/bin", "tmp", "workspace"] {
        std::fs::create_dir_all(tree.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", tree.join("bin/busybox")).expect(
        "the host's static busybox (/bin/busybox, Debian's busybox-static) for the test image",
    );
    for a in [
        "sh", "cat", "echo", "grep", "ls", "test", "mount", "touch", "rm",
    ] {
        std::os::unix::fs::symlink("busybox", tree.join("bin").join(a)).unwrap();
    }
    std::fs::write(tree.join("etc/image-marker"), MARKER).unwrap();
    match host_python() {
        Some((exe, lib, libs)) => {
            copy_host_file(tree, &exe);
            let name = exe.file_name().unwrap();
            std::os::unix::fs::symlink(name, tree.join("usr/bin/python3")).unwrap();
            for l in libs {
                copy_host_file(tree, &l);
            }
            copy_host_dir(tree, &lib);
            true
        }
        None => {
            eprintln!("no host Python (/usr/bin/python3): the image has only busybox");
            false
        }
    }
}

fn tree_bytes(p: &Path) -> u64 {
    let m = std::fs::symlink_metadata(p).unwrap();
    if m.is_dir() {
        std::fs::read_dir(p)
            .unwrap()
            .map(|e| tree_bytes(&e.unwrap().path()))
            .sum::<u64>()
            + 4096
    } else {
        m.len().next_multiple_of(4096)
    }
}

/// `mkfs.ext4 -d`: the tree as a filesystem image, as `sandbox_image` builds them (no journal,
/// no metadata checksums).
fn make_ext4(tree: &Path, image: &Path) {
    let mkfs = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .unwrap_or("mkfs.ext4");
    let kib = (tree_bytes(tree) / 1024) * 5 / 4 + 16 * 1024;
    let out = Command::new(mkfs)
        .args(["-q", "-F", "-d"])
        .arg(tree)
        .args(["-O", "^has_journal,^metadata_csum", "-m", "0", "-b", "4096"])
        .arg(image)
        .arg(format!("{kib}k"))
        .output()
        .expect("mkfs.ext4 (e2fsprogs) to build the test image");
    assert!(
        out.status.success(),
        "mkfs.ext4: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn sha256(path: &Path) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(std::fs::read(path).unwrap());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The guest side of a sandbox from an OCI image: a read-only ext4 disk becomes the root,
/// with a writable overlay in the guest's RAM; the agent serves from it as before.
#[test]
fn an_ext4_disk_becomes_the_root_under_a_writable_overlay() {
    if let Some(why) = qemu_missing() {
        eprintln!("SKIP: {why}");
        return;
    }
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("tree");
    let with_python = image_tree(&tree);
    let image = dir.path().join("rootfs.ext4");
    make_ext4(&tree, &image);
    std::fs::remove_dir_all(&tree).unwrap();
    let before = sha256(&image);
    let extra = Extra {
        append: "agent.root=/dev/vda".into(),
        args: vec![
            "-drive".into(),
            format!(
                "file={},if=none,id=d0,format=raw,readonly=on",
                image.display()
            ),
            "-device".into(),
            "virtio-blk-device,drive=d0".into(),
        ],
        ..Extra::default()
    };
    let (mut qemu, c) = boot(dir.path(), &extra);
    eprintln!("image built and guest booted in {:?}", t0.elapsed());

    // The image's file, through the image's own busybox.
    let (code, out, err) = exec(&c, &["cat", "/etc/image-marker"], &[]);
    assert_eq!((code, out.as_str()), (Some(0), MARKER), "{err}");
    // The root is the overlay (the image under a tmpfs layer), not the initramfs, and the
    // system mounts came along.
    let (code, out, err) = exec(
        &c,
        &[
            "sh",
            "-c",
            "cat /proc/mounts; test -e /init && echo initramfs-visible; ls /lib/modules 2>&1",
        ],
        &[],
    );
    assert_eq!(code, Some(1), "{out}{err}");
    let root = out
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("/"))
        .unwrap_or_else(|| panic!("no root in /proc/mounts:\n{out}"));
    assert!(root.starts_with("overlay / overlay rw"), "{root}");
    assert!(root.contains("lowerdir=/run/lower"), "{root}");
    for m in ["/proc", "/sys", "/dev", "/dev/pts", "/tmp", "/workspace"] {
        assert!(
            out.lines().any(|l| l.split_whitespace().nth(1) == Some(m)),
            "{m} not mounted:\n{out}"
        );
    }
    assert!(!out.contains("initramfs-visible"), "{out}");
    assert!(out.contains("No such file"), "{out}");

    // The root is writable (in the layer), the image's files can be replaced.
    let (code, out, err) = exec(
        &c,
        &[
            "sh",
            "-c",
            "echo written > /etc/new && cat /etc/new && echo changed > /etc/image-marker \
             && cat /etc/image-marker && rm /bin/ls && test ! -e /bin/ls && echo removed",
        ],
        &[],
    );
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "written\nchanged\nremoved\n"),
        "{err}"
    );
    // The workspace and the agent's file calls work as before.
    c.write_file("note.txt", b"in the workspace", 0o644, CALL)
        .unwrap();
    assert_eq!(
        c.read_file("/workspace/note.txt", 1 << 20, CALL).unwrap(),
        b"in the workspace"
    );
    let (code, out, err) = exec(&c, &["cat", "/workspace/note.txt"], &[]);
    assert_eq!((code, out.as_str()), (Some(0), "in the workspace"), "{err}");
    // A dynamically linked program of the image, with its own loader and libraries.
    if with_python {
        let (code, out, err) = exec(&c, &["python3", "-c", "print(6*7)"], &[]);
        assert_eq!((code, out.as_str()), (Some(0), "42\n"), "{err}");
    }

    shut_down(&mut qemu, &c);
    drop(qemu);
    // The disk was never written.
    assert_eq!(sha256(&image), before);
    // The initramfs's files were deleted before the switch (their RAM freed).
    let log = std::fs::read_to_string(dir.path().join("serial.log")).unwrap();
    let freed = log
        .lines()
        .find(|l| l.contains("agent: image root: freed"))
        .unwrap_or_else(|| panic!("no `freed` line on the console:\n{log}"));
    eprintln!("{freed}");
    assert!(!freed.contains("freed 0 KiB"), "{freed}");
    eprintln!("image-root test took {:?}", t0.elapsed());
}

/// Asked for an image root it cannot mount (no disk), the agent says why at once instead of
/// hanging, and still serves from the initramfs.
#[test]
fn an_image_root_without_its_disk_is_a_typed_error() {
    if let Some(why) = qemu_missing() {
        eprintln!("SKIP: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let extra = Extra {
        append: "agent.root=/dev/vda agent.root_wait=2".into(),
        args: vec![],
        ..Extra::default()
    };
    let mut failure = None;
    for attempt in 0..2 {
        match boot_once(dir.path(), BOOT, &extra) {
            Ok(_) => panic!("the agent came up with an image root and no disk"),
            Err(f) if attempt == 0 && stalled_before_the_clock_ticked(&f.log) => {
                eprintln!("QEMU's guest stalled in early boot; booting it once more");
            }
            Err(f) => {
                failure = Some(f);
                break;
            }
        }
    }
    let f = failure.unwrap();
    let msg = f.error.to_string();
    assert!(
        matches!(f.error, AgentError::GuestSetup(_)) && msg.contains("/dev/vda did not appear"),
        "{msg}\n--- serial ---\n{}",
        f.log
    );
    let (mut qemu, c) = f.guest.unwrap();
    let (code, out, err) = exec(&c, &["cat", "/proc/mounts"], &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains("overlay"), "{out}");
    shut_down(&mut qemu, &c);
}

/// The guest side of the microVM tier's images, end to end with the real parts: a Debian
/// image (not the host's files) pulled into an image store, made into its ext4 disk by
/// `ImageStore::rootfs_image` exactly as the backend does, attached read-only, and booted with
/// the command line the backend writes for an image whose `User` is 1000:1000. The image's
/// own Python runs (3.13, where the host has 3.11), with its numpy; commands run as that user,
/// who owns the workspace and the files the agent writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oci_image_from_the_store_is_the_root_and_its_python_runs() {
    if let Some(why) = qemu_missing() {
        eprintln!("SKIP: {why}");
        return;
    }
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let (disk, path) = match test_image_disk(dir.path()).await {
        Ok(d) => d,
        Err(why) => {
            eprintln!("SKIP: {why}");
            return;
        }
    };
    eprintln!(
        "image unpacked and its {} MiB disk built in {:?}",
        disk.size() >> 20,
        t0.elapsed()
    );
    let before = sha256(disk.path());
    let extra = Extra {
        append: "agent.root=/dev/vda agent.user=1000:1000".into(),
        args: disk_args(disk.path()),
        ..Extra::default()
    };
    let (mut qemu, c) = tokio::task::block_in_place(|| boot(dir.path(), &extra));
    eprintln!("guest booted from the image in {:?}", t0.elapsed());
    let env = [("PATH", path.as_str())];
    let (code, out, err) = exec(
        &c,
        &[
            "python3",
            "-c",
            "import sys, numpy; print(sys.version_info[:2], numpy.arange(4).sum())",
        ],
        &env,
    );
    assert_eq!((code, out.as_str()), (Some(0), "(3, 13) 6\n"), "{err}");
    // Debian 13's own userland, not the initramfs's busybox.
    let (code, out, err) = exec(&c, &["cat", "/etc/debian_version"], &env);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.starts_with("13"), "{out}");
    // The image's user runs commands and owns what is written in the workspace.
    let (code, out, err) = exec(
        &c,
        &[
            "sh",
            "-c",
            "id -u; id -g; touch /workspace/made && stat -c %u /workspace/made",
        ],
        &env,
    );
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "1000\n1000\n1000\n"),
        "{err}"
    );
    c.write_file("sub/note.txt", b"from the host", 0o644, CALL)
        .unwrap();
    let (code, out, err) = exec(
        &c,
        &[
            "sh",
            "-c",
            "stat -c %u:%g /workspace/sub /workspace/sub/note.txt && echo more >> /workspace/sub/note.txt",
        ],
        &env,
    );
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "1000:1000\n1000:1000\n"),
        "{err}"
    );
    // Not root: the image's root-owned files stay out of reach.
    let (code, _, _) = exec(&c, &["sh", "-c", "echo x > /etc/written-by-user"], &env);
    assert_ne!(code, Some(0));
    shut_down(&mut qemu, &c);
    drop(qemu);
    // The disk the store made was never written.
    assert_eq!(sha256(disk.path()), before);
    eprintln!("image test took {:?}", t0.elapsed());
}
