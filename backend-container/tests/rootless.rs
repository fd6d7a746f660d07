//! The core of the suite, rootless: as root, this test delegates a cgroup to `nobody` and
//! re-runs itself as `nobody` inside it; as a non-root user it runs the suite directly.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::time::Duration;

use backend_container::ContainerBackend;
use sandbox_core::{
    Backend, Error, ExecRequest, Language, LimitKind, ResolvedSecrets, SandboxSpec,
};

const CHILD_ENV: &str = "ASB_ROOTLESS_CHILD";
const NOBODY: u32 = 65534;

async fn core_suite() {
    let b = ContainerBackend::builder().build().unwrap();
    assert!(b.rootless());
    let status = b.probe().await;
    assert!(status.available, "rootless probe: {status:?}");
    assert_eq!(
        status.details.get("mode").map(String::as_str),
        Some("rootless")
    );
    let spec = SandboxSpec::builder(Language::Python)
        .env("A", "1")
        .memory_mib(64)
        .build()
        .unwrap();
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let r = sb
        .exec(ExecRequest::code(
            "import os; print(os.getuid(), os.environ['A'], sorted(os.environ))",
        ))
        .await
        .unwrap();
    assert_eq!(
        r.stdout_str(),
        "0 1 ['A', 'HOME', 'LANG', 'PATH']\n",
        "{}",
        r.stderr_str()
    );
    sb.write_file("d/f.txt", b"api").await.unwrap();
    let r = sb
        .exec(ExecRequest::argv([
            "sh",
            "-c",
            "cat d/f.txt; echo inside > g.txt; sleep 1000 >/dev/null 2>&1 &",
        ]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "api");
    assert_eq!(sb.read_file("g.txt").await.unwrap(), b"inside\n");
    assert!(matches!(
        sb.read_file("../etc/passwd").await,
        Err(Error::PathEscape { .. })
    ));
    // uid 0 inside, yet no capability and no way to mount or make a user namespace.
    let r = sb.exec(ExecRequest::argv(["sh", "-c", "grep CapEff /proc/self/status; mount -t tmpfs x /tmp || echo mount-refused; unshare -U true || echo unshare-refused; echo x > /etc/x || echo etc-refused"])).await.unwrap();
    let out = r.stdout_str();
    assert!(out.contains("CapEff:\t0000000000000000"), "{out}");
    for w in ["mount-refused", "unshare-refused", "etc-refused"] {
        assert!(out.contains(w), "{out}");
    }
    let r = sb
        .exec(ExecRequest::code(
            "x = bytearray(300 << 20); x[::4096] = b'1' * len(x[::4096])",
        ))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::Memory), "{r:?}");
    let r = sb
        .exec(
            ExecRequest::argv(["sh", "-c", "setsid sleep 999 & sleep 998"])
                .timeout(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime));
    let r = sb
        .exec(ExecRequest::argv([
            "sh",
            "-c",
            "cat /proc/[0-9]*/cmdline | tr '\\0' ' '",
        ]))
        .await
        .unwrap();
    assert!(!r.stdout_str().contains("sleep 99"), "{}", r.stdout_str());
    let before = common::count_sandbox_cgroups();
    assert!(before >= 1);
    sb.destroy().await.unwrap();
    assert_eq!(
        common::count_sandbox_cgroups(),
        0,
        "cgroups left after destroy"
    );
    rootfs_rootless(&b).await;
    println!("rootless suite passed");
}

/// Rootfs-directory mode without privileges: the caller's own tree (no idmapping) is the
/// overlay's lower layer; its files look root-owned inside, writes go to the upper layer,
/// and a snapshot carries them (whiteouts included) into a restored sandbox.
async fn rootfs_rootless(b: &ContainerBackend) {
    if !std::path::Path::new("/bin/busybox").exists() {
        eprintln!("SKIP rootless rootfs part: no /bin/busybox (apt-get install busybox-static)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for a in ["sh", "cat", "echo", "id", "stat", "rm", "ls"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(a)).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0::/:/bin/sh\n").unwrap();
    let spec = SandboxSpec::builder(Language::Shell)
        .rootfs(&root)
        .build()
        .unwrap();
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let r = sb
        .exec(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "id -u; stat -c %u /etc/passwd; echo w > /etc/new && rm /bin/ls && cat /etc/new",
        ]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "0\n0\nw\n", "{}", r.stderr_str());
    assert!(!root.join("etc/new").exists() && root.join("bin/ls").exists());
    let store_dir = tempfile::tempdir().unwrap();
    let store = sandbox_core::ObjectSnapshotStore::local(store_dir.path()).unwrap();
    let snap = sb.snapshot(&store).await.unwrap();
    sb.destroy().await.unwrap();
    let back = b
        .restore(&store, &snap, ResolvedSecrets::none())
        .await
        .unwrap();
    let r = back
        .exec(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "cat /etc/new; /bin/ls 2>/dev/null || echo gone",
        ]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "w\ngone\n", "{}", r.stderr_str());
    back.destroy().await.unwrap();
    assert!(!root.join("etc/new").exists() && root.join("bin/ls").exists());
}

#[tokio::test]
async fn rootless_core_suite() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return core_suite().await;
    }
    if !nix::unistd::geteuid().is_root() {
        // We are already rootless: run the suite here if the host lets us.
        let s = ContainerBackend::builder().build().unwrap().probe().await;
        if !s.available {
            eprintln!(
                "SKIP: rootless containers unavailable: {} (fix: {})",
                s.reason,
                s.fix.unwrap_or_default()
            );
            return;
        }
        return core_suite().await;
    }
    require_host!();
    // Delegate one cgroup per controller to nobody, as a system administrator would.
    let name = format!("asb-rootless-test-{}", std::process::id());
    let dirs: Vec<_> = common::own_cgroup_dirs()
        .into_iter()
        .map(|d| d.join(&name))
        .collect();
    for d in &dirs {
        std::fs::create_dir(d).unwrap();
        for f in ["", "cgroup.procs", "tasks"] {
            let p = if f.is_empty() { d.clone() } else { d.join(f) };
            if p.exists() {
                std::os::unix::fs::chown(&p, Some(NOBODY), Some(NOBODY)).unwrap();
            }
        }
    }
    let procs: Vec<CString> = dirs
        .iter()
        .map(|d| CString::new(d.join("cgroup.procs").to_string_lossy().as_bytes()).unwrap())
        .collect();
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "rootless_core_suite",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, "1")
    .current_dir("/")
    .uid(NOBODY)
    .gid(NOBODY);
    // SAFETY: only open/write/close on prepared C strings between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            for p in &procs {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for d in &dirs {
        for _ in 0..100 {
            if std::fs::remove_dir(d).is_ok() || !d.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    assert!(
        out.status.success() && stdout.contains("rootless suite passed"),
        "rootless run failed:\n{stdout}\n{stderr}"
    );
    assert!(dirs.iter().all(|d| !d.exists()), "delegated cgroups left");
}
