//! Hostile input and escape attempts against the container backend.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;
#[path = "../../sandbox-core/test-support/host_canary.rs"]
mod host_canary;
#[path = "../../sandbox-core/test-support/ready_child.rs"]
mod ready_child;

use std::time::Duration;

use common::{backend, create, sh, sh_ok, spec};
use sandbox_core::{
    Backend, Error, ExecRequest, Language, LimitKind, ResolvedSecrets, Sandbox, SandboxSpec,
};

#[tokio::test]
async fn missing_binary_is_a_result_not_an_error() {
    require_host!();
    let sb = create(Language::Shell).await;
    let r = sb
        .exec(ExecRequest::argv(["definitely-not-a-binary-xyz"]))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(127));
    assert!(
        r.stderr_str().contains("command not found"),
        "{}",
        r.stderr_str()
    );
    let r = sb.exec(ExecRequest::argv(["/workspace"])).await.unwrap();
    assert_eq!(r.exit_code, Some(126));
    assert!(matches!(
        sb.exec(ExecRequest::argv(Vec::<String>::new())).await,
        Err(Error::InvalidSpec { .. })
    ));
    sh_ok(sb.as_ref(), "true").await;
}

#[tokio::test]
async fn writes_outside_workspace_and_tmp_fail() {
    require_host!();
    let sb = create(Language::Shell).await;
    for target in [
        "/x",
        "/etc/x",
        "/etc/passwd",
        "/usr/x",
        "/usr/bin/x",
        "/dev/x",
        "/proc/sys/kernel/hostname",
        "/var/x",
    ] {
        let r = sh(sb.as_ref(), &format!("echo pwned > {target}")).await;
        assert_ne!(r.exit_code, Some(0), "could write {target}");
    }
    sh_ok(
        sb.as_ref(),
        "echo ok > /workspace/a && echo ok > /tmp/b && echo ok > /dev/null && echo ok > /dev/shm/c",
    )
    .await;
    // Landlock also holds for processes that somehow gain write permission bits.
    let r = sh(
        sb.as_ref(),
        "ln -s /tmp/b /workspace/l && rm /workspace/l && mkfifo /tmp/f && rm /tmp/f",
    )
    .await;
    assert!(r.success(), "{}", r.stderr_str());
}

#[tokio::test]
async fn kill_all_inside_leaves_the_sandbox_working() {
    require_host!();
    let sb = create(Language::Shell).await;
    sh_ok(sb.as_ref(), "sleep 1000 >/dev/null 2>&1 &").await;
    let _ = sh(sb.as_ref(), "kill -9 -1; sleep 0.1").await;
    sb.health_check().await.unwrap();
    assert_eq!(sh_ok(sb.as_ref(), "echo still here").await, "still here\n");
    let _ = sh(sb.as_ref(), "kill -9 1; kill -TERM 1; kill -STOP 1").await;
    assert_eq!(
        sh_ok(sb.as_ref(), "echo init survives").await,
        "init survives\n"
    );
}

#[tokio::test]
async fn execs_are_process_groups_of_the_sandbox_session() {
    require_host!();
    let sb = create(Language::Shell).await;
    // Fields 5-7 of /proc/<pid>/stat: process group, session, controlling terminal.
    let script = "read -r _ _ _ _ pg sid tty _ < /proc/$$/stat; echo $$ $pg $sid $tty";
    let mut groups = Vec::new();
    for _ in 0..2 {
        let out = sh_ok(sb.as_ref(), script).await;
        let f: Vec<i64> = out.split_whitespace().map(|v| v.parse().unwrap()).collect();
        assert_eq!(f.len(), 4, "{out}");
        // The session is the sandbox's: its leader, the init, is pid 1 inside. (The
        // library's session would read 0 here, its leader being outside the namespace.)
        assert_eq!(f[2], 1, "session of an exec: {out}");
        // Each exec leads a process group of its own, with no controlling terminal.
        assert_eq!(f[1], f[0], "process group of an exec: {out}");
        assert_eq!(f[3], 0, "controlling terminal of an exec: {out}");
        groups.push(f[1]);
    }
    assert_ne!(groups[0], groups[1]);
    // A command may still make a session of its own.
    assert_eq!(
        sh_ok(
            sb.as_ref(),
            "setsid sh -c 'read -r _ _ _ _ _ sid _ < /proc/$$/stat; [ $sid = $$ ] && echo own'"
        )
        .await,
        "own\n"
    );
}

/// Files on the tmpfs mounts are charged to the sandbox's memory and cannot be reclaimed:
/// filling them must end in `ENOSPC` (`limit: disk`), never in the OOM killer taking the
/// sandbox down with its workspace.
#[tokio::test]
async fn full_disk_and_inodes_leave_the_sandbox_and_its_files() {
    require_host!();
    let mut spec = spec(Language::Shell);
    spec.limits.memory_bytes = 64 << 20;
    spec.limits.disk_bytes = 256 << 20;
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    // 64 MiB of memory: 40 MiB of data in all, /tmp and /dev/shm 5 MiB each.
    let df = sh_ok(sb.as_ref(), "df -k /workspace /tmp /dev/shm | tail -n 3").await;
    let sizes: Vec<u64> = df
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(sizes, vec![30 << 10, 5 << 10, 5 << 10], "{df}");
    for (what, script) in [
        ("workspace data", "head -c 200M /dev/zero > /workspace/big"),
        ("/tmp data", "head -c 200M /dev/zero > /tmp/big"),
        ("/dev/shm data", "head -c 200M /dev/zero > /dev/shm/big"),
        (
            "workspace inodes",
            "mkdir /workspace/many && cd /workspace/many && i=0; while [ $i -lt 20000 ]; do : > f$i || exit 1; i=$((i+1)); done",
        ),
    ] {
        let r = sh(sb.as_ref(), script).await;
        assert_ne!(r.exit_code, Some(0), "{what}: {r:?}");
        assert_eq!(r.limit, Some(LimitKind::Disk), "{what}: {r:?}");
        assert!(r.stderr_str().contains("No space left"), "{what}: {}", r.stderr_str());
    }
    // Everything is full, and commands still have their memory: python runs, allocates.
    let out = sh_ok(
        sb.as_ref(),
        "python3 -c 'x = bytearray(8 << 20); print(len(x))'; ls /workspace/many | wc -l; du -sk /workspace/big",
    )
    .await;
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("8388608"), "{out}");
    let files: u64 = lines.next().unwrap().trim().parse().unwrap();
    assert!(files > 1000, "{out}");
    let kib: u64 = lines
        .next()
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(kib > 10 << 10, "{out}");
    // Freeing space makes writes work again.
    sh_ok(
        sb.as_ref(),
        "rm -rf /workspace/many /workspace/big /tmp/big /dev/shm/big && head -c 1M /dev/zero > /workspace/ok",
    )
    .await;
    sb.health_check().await.unwrap();
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn closed_stdout_and_lingering_children() {
    require_host!();
    let sb = create(Language::Shell).await;
    // Closes its output but keeps running: the timeout ends it.
    let r = sb
        .exec(ExecRequest::code("exec >&- 2>&-; sleep 1000").timeout(Duration::from_millis(300)))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime));
    // Leaves a child holding stdout: the call returns when the command exits.
    let r = sb
        .exec(ExecRequest::code("sleep 1000 & echo parent done").timeout(Duration::from_secs(20)))
        .await
        .unwrap();
    assert_eq!(r.limit, None);
    assert_eq!(r.stdout_str(), "parent done\n");
}

#[tokio::test]
async fn zombie_storm_is_reaped() {
    require_host!();
    let sb = create(Language::Shell).await;
    sh_ok(sb.as_ref(), "for i in $(seq 300); do (sleep 0 &) ; done").await;
    // Orphans are reaped by the init; poll a bounded number of times.
    let mut zombies = String::new();
    for _ in 0..100 {
        zombies = sh_ok(
            sb.as_ref(),
            "grep -l '^State:.*Z' /proc/[0-9]*/status 2>/dev/null | wc -l",
        )
        .await;
        if zombies.trim() == "0" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(zombies.trim(), "0");
}

#[tokio::test]
async fn file_api_refuses_dot_dot_and_symlinks_out() {
    require_host!();
    let sb = create(Language::Shell).await;
    sh_ok(sb.as_ref(), "ln -s /etc/passwd passwd-link && ln -s / root-link && ln -s ../../.. up && mkdir d && ln -s ../.. d/up2").await;
    for p in [
        "../etc/passwd",
        "/etc/passwd",
        "/workspace/../etc/passwd",
        "passwd-link",
        "root-link/etc/shadow",
        "up/etc/passwd",
        "d/up2/x",
    ] {
        let r = sb.read_file(p).await;
        assert!(matches!(r, Err(Error::PathEscape { .. })), "{p}: {r:?}");
    }
    for p in ["root-link/tmp/pwned", "up/pwned", "../pwned", "d/up2/pwned"] {
        let r = sb.write_file(p, b"x").await;
        assert!(matches!(r, Err(Error::PathEscape { .. })), "{p}: {r:?}");
    }
    assert!(matches!(
        sb.list("root-link").await,
        Err(Error::PathEscape { .. })
    ));
    assert!(!std::path::Path::new("/tmp/pwned").exists());
    assert!(matches!(
        sb.read_file("a\0b").await,
        Err(Error::InvalidSpec { .. })
    ));
    // A FIFO cannot hang the API.
    sh_ok(sb.as_ref(), "mkfifo fifo").await;
    assert!(sb.read_file("fifo").await.is_err());
}

#[tokio::test]
async fn impossible_specs_are_refused_before_anything_starts() {
    require_host!();
    let b = backend();
    let mut s = SandboxSpec::new(Language::Shell);
    s.limits.memory_bytes = 1;
    assert!(matches!(
        b.create(&s, ResolvedSecrets::none()).await,
        Err(Error::InvalidSpec { .. })
    ));
    let mut s = SandboxSpec::new(Language::Shell);
    s.limits.pids = 0;
    assert!(matches!(
        b.create(&s, ResolvedSecrets::none()).await,
        Err(Error::InvalidSpec { .. })
    ));
    let s = SandboxSpec::builder(Language::Shell)
        .mount_ro("/usr/bin", "/usr/local/x")
        .build()
        .unwrap();
    assert!(matches!(
        b.create(&s, ResolvedSecrets::none()).await,
        Err(Error::InvalidSpec { .. })
    ));
    let s = SandboxSpec::builder(Language::Shell)
        .mount_ro("/etc", "/proc/x")
        .build()
        .unwrap();
    assert!(matches!(
        b.create(&s, ResolvedSecrets::none()).await,
        Err(Error::InvalidSpec { .. })
    ));
    let s = SandboxSpec::new(Language::Wasm);
    assert!(matches!(
        b.create(&s, ResolvedSecrets::none()).await,
        Err(Error::Unsupported { .. })
    ));
    let s = SandboxSpec::builder(Language::Shell)
        .workspace_dir("/tmp", false)
        .mount_rw("/tmp", "/workspace/x")
        .build()
        .unwrap();
    assert!(matches!(
        b.create(&s, ResolvedSecrets::none()).await,
        Err(Error::InvalidSpec { .. })
    ));
}

#[tokio::test]
async fn escape_attempts_fail() {
    require_host!();
    let sb = backend()
        .create(&spec(Language::Python), ResolvedSecrets::none())
        .await
        .unwrap();
    let attempts = [
        "mount -t tmpfs none /tmp",
        "mount --bind /workspace /tmp",
        "unshare -U true",
        "unshare -Ur true",
        "unshare -m true",
        "umount /proc",
        "chroot / true",
        "ls /root",
        "ls /home/*",
        "cat /etc/shadow",
        "ls /sys/kernel",
        "ls /oldroot",
        "cat /proc/1/environ",
        "cat /proc/1/mem",
        "ls /proc/1/root/",
        "ls -l /proc/1/fd/",
        "head -c1 /proc/kcore",
    ];
    for a in attempts {
        let r = sh(sb.as_ref(), a).await;
        assert_ne!(r.exit_code, Some(0), "`{a}` succeeded: {}", r.stdout_str());
    }
    let py = [
        // ptrace of the init
        "import ctypes; l=ctypes.CDLL(None, use_errno=True); assert l.ptrace(16, 1, 0, 0) == -1, 'ptrace attach worked'",
        // a new user namespace (clone/unshare with CLONE_NEWUSER)
        "import ctypes; l=ctypes.CDLL(None, use_errno=True); assert l.unshare(0x10000000) == -1 and ctypes.get_errno() == 1",
        // bpf, perf_event_open, keyctl, io_uring, userfaultfd, open_by_handle_at, kexec
        "import ctypes; l=ctypes.CDLL(None, use_errno=True)\nfor nr in (321, 298, 250, 425, 323, 304, 246):\n  assert l.syscall(nr, 0, 0, 0, 0, 0) == -1, nr",
    ];
    for code in py {
        let r = sb.exec(ExecRequest::code(code)).await.unwrap();
        assert!(r.success(), "{code}: {r:?} {}", r.stderr_str());
    }
    // No capabilities at all, no_new_privs, seccomp filter mode, running as the sandbox user.
    let st = sh_ok(
        sb.as_ref(),
        "grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp|Uid):' /proc/self/status",
    )
    .await;
    for l in st.lines() {
        if l.starts_with("Cap") {
            assert!(l.ends_with("0000000000000000"), "{l}");
        }
    }
    assert!(st.contains("NoNewPrivs:\t1"), "{st}");
    assert!(st.contains("Seccomp:\t2"), "{st}");
    assert!(st.contains("Uid:\t1000") || st.contains("Uid:\t0"), "{st}");
    // Only the sandbox's own processes are visible: the init, its spare supervisor, this
    // exec's supervisor, sh, ls and grep, and at most a supervisor or two of earlier execs
    // still on its way out (the host has dozens).
    let ps = sh_ok(sb.as_ref(), "ls /proc | grep -c '^[0-9]'").await;
    assert!(ps.trim().parse::<u32>().unwrap() <= 9, "{ps}");
    let comms = sh_ok(sb.as_ref(), "cat /proc/[0-9]*/comm | sort -u").await;
    for c in comms.lines() {
        assert!(
            ["asb-init", "sh", "cat", "sort"].contains(&c),
            "a process that is not the sandbox's: {c} in {comms}"
        );
    }
}

#[tokio::test]
async fn dropping_without_destroy_cleans_up() {
    require_host!();
    let sb = backend_container::ContainerBackend::builder()
        .build()
        .unwrap()
        .create_container(&spec(Language::Shell))
        .await
        .unwrap();
    let pid = sb.init_pid();
    let id = sandbox_core::Sandbox::id(&sb).to_string();
    assert!(!common::cgroups_of(&id).is_empty());
    sh_ok(&sb, "sleep 1000 >/dev/null 2>&1 &").await;
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    drop(sb);
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "init {pid} survived drop"
    );
    assert!(
        common::cgroups_of(&id).is_empty(),
        "cgroups left after drop"
    );
}

#[tokio::test]
async fn leftovers_of_a_dead_process_are_swept() {
    require_host!();
    // What a process killed without running destructors leaves: empty cgroups named after it.
    let dead_pid = 999_999_999u32;
    let dirs: Vec<_> = common::own_cgroup_dirs()
        .into_iter()
        .map(|d| d.join(format!("asb-{dead_pid}-0123abcd")))
        .collect();
    for d in &dirs {
        std::fs::create_dir(d).unwrap();
    }
    let _ = backend();
    assert!(dirs.iter().all(|d| !d.exists()), "not swept: {dirs:?}");
}

/// The command line of the background command `killed_owner_child_process` leaves running.
const ORPHAN_MARKER: &[u8] = b"sleep\x00987.654321\x00";

/// Run in a child process by `sandboxes_of_a_killed_process_are_torn_down`: creates a
/// sandbox with a background command, prints `READY <init pid>` and waits to be killed.
#[tokio::test]
#[ignore = "helper: run in a child process by sandboxes_of_a_killed_process_are_torn_down"]
async fn killed_owner_child_process() {
    let sb = backend_container::ContainerBackend::builder()
        .build()
        .unwrap()
        .create_container(&spec(Language::Shell))
        .await
        .unwrap();
    sh_ok(&sb, "sleep 987.654321 >/dev/null 2>&1 &").await;
    println!("READY {}", sb.init_pid());
    std::future::pending::<()>().await;
}

/// Host processes whose command line is exactly [`ORPHAN_MARKER`]'s.
fn orphan_markers() -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read(e.path().join("cmdline")).is_ok_and(|c| c == ORPHAN_MARKER))
        .count()
}

/// Whether `pid` is gone (or a zombie waiting for its new parent to reap it).
fn gone(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().next())
                .is_some_and(|st| st == "Z" || st == "X")
        })
        .unwrap_or(true)
}

#[tokio::test]
async fn sandboxes_of_a_killed_process_are_torn_down() {
    require_host!();
    let (mut child, init) = ready_child::start("killed_owner_child_process", &[]);
    let init: i32 = init.parse().unwrap();
    let owner = child.id();
    let cgroups = || -> Vec<std::path::PathBuf> {
        common::own_cgroup_dirs()
            .iter()
            .filter_map(|d| std::fs::read_dir(d).ok())
            .flat_map(|rd| rd.flatten())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("asb-{owner}-"))
            })
            .map(|e| e.path())
            .collect()
    };
    assert!(!gone(init));
    // `sh` returns once it has forked the background command, which may not have reached
    // its `execve` yet (its command line is still the shell's until then).
    let started = std::time::Instant::now();
    while orphan_markers() == 0 && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(orphan_markers(), 1, "the background command is not running");
    let had_cgroups = !cgroups().is_empty();
    eprintln!("the owner had cgroups: {had_cgroups}");
    // As root the host always lets us make them: the sweep below is then really tested.
    assert!(had_cgroups || !nix::unistd::geteuid().is_root());
    // The owner dies without destroying anything.
    child.kill().unwrap();
    child.wait().unwrap();
    let died = std::time::Instant::now();
    while !(gone(init) && orphan_markers() == 0) {
        assert!(
            died.elapsed() < Duration::from_secs(10),
            "10 s after its owner died: init gone {}, background commands {}",
            gone(init),
            orphan_markers()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "the sandbox's processes were gone {:?} after its owner died",
        died.elapsed()
    );
    // Its cgroups stay until the next backend of any process sweeps them (another test of
    // this binary may build one at any moment, so whether they are still there now is not
    // asserted).
    let _ = backend();
    assert_eq!(
        cgroups(),
        Vec::<std::path::PathBuf>::new(),
        "cgroups not swept"
    );
}

#[tokio::test]
async fn a_killed_zygote_is_replaced_on_the_next_create() {
    require_host!();
    let b = backend();
    let sb = create(Language::Shell).await;
    sb.destroy().await.unwrap();
    let zygotes = common::zygotes();
    assert_eq!(zygotes.len(), 1, "one fork server per process: {zygotes:?}");
    // SAFETY: kills and reaps our own child.
    unsafe {
        libc::kill(zygotes[0], libc::SIGKILL);
    }
    // Its socket is now dead: the next create notices, reaps it and starts a new one, also
    // when that create first needs a new root-filesystem template (a new hostname): the
    // template is built by the new zygote rather than given up on.
    let other = backend_container::ContainerBackend::builder()
        .hostname("after-the-zygote")
        .build()
        .unwrap();
    let sb = other
        .create_container(&spec(Language::Shell))
        .await
        .unwrap();
    assert_eq!(sh_ok(&sb, "hostname").await, "after-the-zygote\n");
    if nix::unistd::geteuid().is_root() {
        // Host root's files, unmapped inside: the template is in use.
        assert_eq!(sh_ok(&sb, "stat -c %u /etc/hostname").await, "65534\n");
    }
    sb.destroy().await.unwrap();
    for _ in 0..3 {
        let sb = b
            .create(&spec(Language::Shell), ResolvedSecrets::none())
            .await
            .unwrap();
        assert_eq!(sh_ok(sb.as_ref(), "echo ok").await, "ok\n");
        sb.destroy().await.unwrap();
    }
    let now = common::zygotes();
    assert_eq!(now.len(), 1, "{now:?}");
    assert_ne!(now[0], zygotes[0]);
}

/// Issue 32, item 1 (this tier was the model: regression guard): code inside flips
/// `/workspace/out` between a file and a symlink to a host file while the host-side file API
/// reads and writes it; the link is refused whenever it is met, never followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_api_never_follows_a_symlink_swapped_in_during_the_call() {
    require_host!();
    let canary = host_canary::Canary::new();
    let spec = SandboxSpec::builder(Language::Python)
        .wall_time(Duration::from_secs(90))
        .build()
        .unwrap();
    let sb: std::sync::Arc<dyn Sandbox> = std::sync::Arc::from(
        backend()
            .create(&spec, ResolvedSecrets::none())
            .await
            .unwrap(),
    );
    let flipper = {
        let sb = std::sync::Arc::clone(&sb);
        let code = host_canary::python_flipper(canary.path.to_str().unwrap(), 60);
        tokio::spawn(async move {
            sb.exec(ExecRequest::code(code).timeout(Duration::from_secs(80)))
                .await
        })
    };
    host_canary::wait_for_flipper(sb.as_ref(), "out", Duration::from_secs(30)).await;
    let h = host_canary::hammer(
        sb.as_ref(),
        "/workspace/out",
        &canary,
        1000,
        Duration::from_secs(20),
    )
    .await;
    sb.write_file("stop", b"").await.unwrap();
    let r = flipper.await.unwrap().unwrap();
    eprintln!("{h:?}; flips inside: {}", r.stdout_str().trim());
    assert!(r.success(), "{r:?} {}", r.stderr_str());
    assert!(h.reads_ok > 0 && h.escapes > 0, "{h:?}");
    canary.assert_unchanged("at the end");
    sb.destroy().await.unwrap();
}

/// Issue 32, item 4: a 1 TiB sparse file (made in an instant) made `read_file` read zeros
/// until the OOM killer came, and a snapshot abort on `Vec::with_capacity(1 TiB)`. Now the
/// read is refused naming the limit, and the snapshot keeps the file sparse.
#[tokio::test]
async fn a_sparse_terabyte_file_is_refused_by_read_file_and_kept_sparse_by_snapshots() {
    require_host!();
    let sb = create(Language::Shell).await;
    sh_ok(
        sb.as_ref(),
        "truncate -s 1T /workspace/big && echo hi > /workspace/small",
    )
    .await;
    let rss = host_canary::rss();
    let t = std::time::Instant::now();
    let e = sb.read_file("big").await.unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(
        matches!(&e, Error::InvalidSpec { field, reason } if field == "path" && reason.contains("limits.disk_bytes")),
        "{e}"
    );
    assert_eq!(sb.read_file("small").await.unwrap(), b"hi\n");
    let dir = tempfile::tempdir().unwrap();
    let store = sandbox_core::ObjectSnapshotStore::local(dir.path()).unwrap();
    let t = std::time::Instant::now();
    let id = sb.snapshot(&store).await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let m = sandbox_core::SnapshotStore::manifest(&store, &id)
        .await
        .unwrap();
    assert!(
        m.artifacts["workspace.tar"].size < 1 << 20,
        "{:?}",
        m.artifacts["workspace.tar"]
    );
    let grew = host_canary::rss().saturating_sub(rss);
    assert!(grew < 512 << 20, "the test process grew by {grew} bytes");
    sb.destroy().await.unwrap();
    let restored = backend()
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    let out = sh_ok(
        restored.as_ref(),
        "stat -c '%s %b' /workspace/big && cat /workspace/small",
    )
    .await;
    let mut f = out.split_whitespace();
    assert_eq!(f.next(), Some("1099511627776"), "{out}");
    let blocks: u64 = f.next().unwrap().parse().unwrap();
    assert!(blocks < 1024, "restored with {blocks} blocks: {out}");
    assert_eq!(f.next(), Some("hi"), "{out}");
    restored.destroy().await.unwrap();
}
