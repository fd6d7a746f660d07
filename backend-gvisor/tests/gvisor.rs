//! The gVisor tier against the shared contract, on a real runsc.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use sandbox_core::{
    Backend, Error, ExecEvent, ExecRequest, Language, LimitKind, MapSecretSource,
    ObjectSnapshotStore, Phase, ResolvedSecrets, SandboxSpec, SnapshotStore,
};

/// Counts processes inside whose argv is exactly `sleep 300` / `sleep 100`.
const COUNT_SLEEP_300: &str = "import os; print(sum(1 for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/cmdline','rb').read() == b'sleep\\x00300\\x00'))";
const COUNT_SLEEP_100: &str = "import os; print(sum(1 for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/cmdline','rb').read() == b'sleep\\x00100\\x00'))";

#[tokio::test]
async fn python_runs_with_exactly_the_spec_env() {
    require_gvisor!();
    std::env::set_var("AGENT_SANDBOX_HOST_ONLY", "leak-me-not");
    let spec = SandboxSpec::builder(Language::Python)
        .env("GREETING", "hello")
        .build()
        .unwrap();
    let sb = common::sandbox(&spec).await;
    let phases: Vec<Phase> = sb.timeline().phases.iter().map(|p| p.phase).collect();
    assert_eq!(
        phases,
        [Phase::Allocation, Phase::Filesystem, Phase::Runtime]
    );
    let r = sb
        .exec(ExecRequest::code(
            "import os; print(sorted(os.environ)); print(os.getuid(), os.getcwd())",
        ))
        .await
        .unwrap();
    assert!(r.success(), "{r:?}");
    assert_eq!(
        r.stdout_str(),
        "['GREETING', 'HOME', 'LANG', 'PATH']\n1000 /workspace\n"
    );
    // Not through pid 1's environment either.
    let r = sb
        .exec(ExecRequest::code(
            "print(open('/proc/1/environ','rb').read())",
        ))
        .await
        .unwrap();
    assert!(
        !r.stdout_str().contains("leak-me-not") && r.success(),
        "{r:?}"
    );
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn gvisor_kernel_not_host_kernel() {
    require_gvisor!();
    let sb = common::python().await;
    let r = sb
        .exec(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "cat /proc/version; dmesg 2>/dev/null | head -1",
        ]))
        .await
        .unwrap();
    assert!(
        r.stdout_str().to_lowercase().contains("gvisor")
            || r.stdout_str().contains("Starting gVisor"),
        "{r:?}"
    );
}

#[tokio::test]
async fn coreutils_ls_and_stat_work() {
    require_gvisor!();
    let sb = common::sandbox(&SandboxSpec::new(Language::Shell)).await;
    // Without the statx shim each of these failed with "Invalid argument" under this runsc.
    let r = sb
        .exec(ExecRequest::code(
            "printf abc > f.txt && mkdir d && ls -la /workspace && ls d && ls -l f.txt \
             && stat -c '%s %a %F' f.txt && stat -c '%s %F' /etc/hostname",
        ))
        .await
        .unwrap();
    assert!(r.success(), "{r:?}");
    // No loader complaint on stderr either.
    assert_eq!(r.stderr_str(), "");
    let out = r.stdout_str();
    assert!(
        out.contains(" f.txt\n") && out.contains(" d\n") && out.contains(" ..\n"),
        "{out}"
    );
    assert!(
        out.ends_with("3 644 regular file\n8 regular file\n"),
        "{out}"
    );
    // Any program calling the C library's statx with AT_NO_AUTOMOUNT gets an answer.
    let r = sb
        .exec(ExecRequest::argv([
            "/usr/bin/python3",
            "-c",
            "import ctypes; c = ctypes.CDLL(None, use_errno=True); b = ctypes.create_string_buffer(256); \
             print(c.statx(-100, b'f.txt', 0x800, 0xfff, b), ctypes.get_errno())",
        ]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "0 0\n", "{r:?}");
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn files_and_background_processes_persist_across_execs() {
    require_gvisor!();
    let sb = common::python().await;
    sb.write_file("data/in.txt", b"from the host")
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::code(
            "print(open('data/in.txt').read()); open('out.txt','w').write('from inside')",
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "from the host\n", "{r:?}");
    assert_eq!(sb.read_file("out.txt").await.unwrap(), b"from inside");
    let names: Vec<String> = sb
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["data", "out.txt"]);
    // A background process started by one exec is still there for the next.
    let r = sb
        .exec(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "sleep 300 >/dev/null 2>&1 & echo started",
        ]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "started\n");
    let r = sb.exec(ExecRequest::code(COUNT_SLEEP_300)).await.unwrap();
    assert_eq!(r.stdout_str().trim(), "1", "{r:?}");
    // Writes outside /workspace and /tmp fail: the root is read-only.
    let r = sb
        .exec(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "echo x > /usr/evil; echo x > /etc/evil; echo ok > /tmp/fine && cat /tmp/fine",
        ]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "ok\n", "{r:?}");
    assert!(
        !std::path::Path::new("/usr/evil").exists() && !std::path::Path::new("/etc/evil").exists()
    );
}

#[tokio::test]
async fn stdin_exit_codes_cwd_and_c() {
    require_gvisor!();
    let sb = common::sandbox(&SandboxSpec::new(Language::Shell)).await;
    let r = sb
        .exec(ExecRequest::code("tr a-z A-Z; exit 3").stdin("shout\n"))
        .await
        .unwrap();
    assert_eq!((r.exit_code, r.stdout_str().as_str()), (Some(3), "SHOUT\n"));
    let r = sb.exec(ExecRequest::code("pwd").cwd("/tmp")).await.unwrap();
    assert_eq!(r.stdout_str(), "/tmp\n");
    let r = sb
        .exec(ExecRequest::argv(["no-such-binary-xyz"]))
        .await
        .unwrap();
    assert_ne!(r.exit_code, Some(0));
    assert!(!r.stderr.is_empty(), "a missing binary says so: {r:?}");
    let c = common::sandbox(&SandboxSpec::new(Language::C)).await;
    let r = c
        .exec(ExecRequest::code(
            "#include <stdio.h>\nint main(){printf(\"%d\\n\", 6*7);return 0;}",
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "42\n", "{r:?}");
}

#[tokio::test]
async fn commands_start_as_the_sandbox_user_with_its_limits_and_nothing_more() {
    require_gvisor!();
    // Through the control socket (the default), and through `runsc exec` processes.
    for runsc_exec in [false, true] {
        let b = backend_gvisor::GvisorBackend::builder()
            .runsc_exec(runsc_exec)
            .build()
            .unwrap();
        same_start_semantics(&b).await;
    }
}

async fn same_start_semantics(b: &backend_gvisor::GvisorBackend) {
    use sandbox_core::{Backend, ResolvedSecrets};
    let mut spec = SandboxSpec::new(Language::Shell);
    spec.limits.open_files = 77;
    spec.limits.wall_time_ms = 3_000;
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    // A name is looked up on the command's PATH; a signal ends it with 128 + n.
    let r = sb
        .exec(ExecRequest::argv(["sh", "-c", "echo found; kill -9 $$"]))
        .await
        .unwrap();
    assert_eq!(
        (r.exit_code, r.stdout_str().as_str()),
        (Some(137), "found\n")
    );
    // The spec's open-files limit, no core dumps, and no capability of any kind.
    let r = sb
        .exec(ExecRequest::code(
            "ulimit -n; ulimit -c; id -u; grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status",
        ))
        .await
        .unwrap();
    let out = r.stdout_str();
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("77"), "{out}");
    assert_eq!(lines.next(), Some("0"), "{out}");
    assert_eq!(lines.next(), Some("1000"), "{out}");
    let caps: Vec<&str> = lines.collect();
    // gVisor's /proc/self/status has no CapAmb line.
    assert_eq!(caps.len(), 4, "{out}");
    assert!(
        caps.iter().all(|l| l.ends_with("0000000000000000")),
        "{out}"
    );
    // A missing executable is a result with a message, not an error; the sandbox goes on.
    let r = sb
        .exec(ExecRequest::argv(["/no/such/program"]))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(127), "{r:?}");
    assert!(!r.stderr.is_empty(), "{r:?}");
    // stdin, and a wall timeout that kills the command's whole group.
    let r = sb
        .exec(ExecRequest::code("read x; echo got $x; sleep 100 & sleep 100").stdin("in\n"))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime), "{r:?}");
    assert_eq!(r.stdout_str(), "got in\n");
    let r = sb
        .exec(ExecRequest::code(COUNT_SLEEP_100_SH))
        .await
        .unwrap();
    assert_eq!(r.stdout_str().trim(), "0", "{r:?}");
    let r = sb.exec(ExecRequest::code("echo still here")).await.unwrap();
    assert_eq!(r.stdout_str(), "still here\n");
    sb.destroy().await.unwrap();
}

/// Counts processes inside whose argv is exactly `sleep 100`, in shell.
const COUNT_SLEEP_100_SH: &str =
    "n=0; for f in /proc/[0-9]*/cmdline; do [ \"$(tr '\\0' ' ' < $f 2>/dev/null)\" = 'sleep 100 ' ] && n=$((n+1)); done; echo $n";

#[tokio::test]
async fn wall_timeout_kills_the_exec_tree_and_the_sandbox_survives() {
    require_gvisor!();
    let sb = common::sandbox(&SandboxSpec::new(Language::Shell)).await;
    let r = sb
        .exec(
            ExecRequest::code("sleep 100 & sleep 100; echo never").timeout(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime), "{r:?}");
    assert!(!r.stdout_str().contains("never"));
    let r = sb
        .exec(ExecRequest::argv([
            "/usr/bin/python3",
            "-c",
            COUNT_SLEEP_100,
        ]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str().trim(), "0", "both sleeps died: {r:?}");
}

#[tokio::test]
async fn memory_limit_kills_inside_and_is_reported() {
    require_gvisor!();
    let spec = SandboxSpec::builder(Language::Python)
        .memory_mib(96)
        .build()
        .unwrap();
    let sb = common::sandbox(&spec).await;
    let r = sb.exec(ExecRequest::code("b = bytearray(400 * 1024 * 1024)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('survived')")).await.unwrap();
    assert!(!r.stdout_str().contains("survived"), "{r:?}");
    assert_eq!(
        (r.exit_code, r.limit),
        (Some(137), Some(LimitKind::Memory)),
        "{r:?}"
    );
    // The host OOM killer ends the whole gVisor sandbox: it says so from now on.
    let e = sb.exec(ExecRequest::code("print(1)")).await.err().unwrap();
    assert!(
        matches!(e, Error::SandboxGone { ref reason, .. } if reason.contains("memory")),
        "{e}"
    );
    let id = sb.id().to_string();
    sb.destroy().await.unwrap();
    assert_eq!(common::host_processes_of(&id), 0);
    // A new one works.
    let sb = common::python().await;
    assert!(sb
        .exec(ExecRequest::code("print(1)"))
        .await
        .unwrap()
        .success());
}

#[tokio::test]
async fn output_flood_is_capped() {
    require_gvisor!();
    let spec = SandboxSpec::builder(Language::Python)
        .output_bytes(4096)
        .build()
        .unwrap();
    let sb = common::sandbox(&spec).await;
    // Past the cap but short of a flood: truncated, and the command runs to its end.
    let r = sb
        .exec(ExecRequest::code(
            "import sys\nsys.stdout.write('x' * 5_000_000)\nprint('end', file=sys.stderr)",
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout.len(), 4096);
    assert!(r.truncated);
    assert_eq!(r.stderr_str(), "end\n");
    assert_eq!(r.limit, None);
    // A flood (past `sandbox_core::flood_threshold`) is stopped: the output limit.
    let r = sb
        .exec(ExecRequest::code(
            "import sys\nsys.stdout.write('x' * 50_000_000)\nprint('end', file=sys.stderr)",
        ))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(sandbox_core::LimitKind::Output), "{r:?}");
    assert_eq!(r.stdout.len(), 4096);
    assert!(r.truncated);
}

#[tokio::test]
async fn secrets_are_passed_and_redacted_and_host_only_ones_stay_out() {
    require_gvisor!();
    let spec = SandboxSpec::builder(Language::Python)
        .secret_env("API", "API_KEY")
        .secret_host_only("DB_PASSWORD")
        .build()
        .unwrap();
    let src = MapSecretSource::new()
        .with("API", "sk-abcdef123456")
        .with("DB_PASSWORD", "hunter2-very-secret");
    let secrets = ResolvedSecrets::resolve(&spec.secrets, &src).unwrap();
    let sb = common::backend().create(&spec, secrets).await.unwrap();
    let r = sb.exec(ExecRequest::code("import os; print(os.environ['API_KEY']); print(len(os.environ['API_KEY'])); print('DB_PASSWORD' in str(os.environ))")).await.unwrap();
    assert_eq!(r.stdout_str(), "[REDACTED:API]\n15\nFalse\n");
}

#[tokio::test]
async fn streaming_exec() {
    require_gvisor!();
    let sb = common::sandbox(&SandboxSpec::new(Language::Shell)).await;
    let mut s = sb
        .exec_stream(ExecRequest::code("echo a; sleep 0.3; echo b >&2; exit 4"))
        .await
        .unwrap();
    let mut evs = vec![];
    while let Some(e) = s.next().await {
        evs.push(e.unwrap());
    }
    assert_eq!(evs.first(), Some(&ExecEvent::Stdout("a\n".into())));
    assert!(evs.contains(&ExecEvent::Stderr("b\n".into())));
    assert!(matches!(evs.last(), Some(ExecEvent::Exit(r)) if r.exit_code == Some(4)));
}

const COUNTER: &str = r#"
import hashlib, os, random, time
random.seed(7)
buf = bytes(random.getrandbits(8) for _ in range(8 * 1024 * 1024))
digest = hashlib.sha256(buf).hexdigest()
counter = 0
open('/workspace/ready', 'w').write(digest)
while True:
    n = counter + 1
    if os.path.exists(f'/workspace/ping-{n}'):
        counter = n
        open(f'/workspace/pong-{n}', 'w').write(f'{counter} {hashlib.sha256(buf).hexdigest()}')
    time.sleep(0.01)
"#;

async fn wait_for(sb: &dyn sandbox_core::Sandbox, path: &str) -> Vec<u8> {
    for _ in 0..1000 {
        if let Ok(d) = sb.read_file(path).await {
            if !d.is_empty() {
                return d;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{path} never appeared");
}

#[tokio::test]
async fn checkpoint_restore_resumes_a_live_process_with_its_memory() {
    require_gvisor!();
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let sb = common::python().await;
    sb.write_file("counter.py", COUNTER.as_bytes())
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "python3 counter.py >/dev/null 2>&1 &",
        ]))
        .await
        .unwrap();
    assert!(r.success(), "{r:?}");
    let digest = String::from_utf8(wait_for(sb.as_ref(), "ready").await).unwrap();
    sb.write_file("ping-1", b"").await.unwrap();
    assert_eq!(
        String::from_utf8(wait_for(sb.as_ref(), "pong-1").await).unwrap(),
        format!("1 {digest}")
    );
    // `/tmp` and `/dev/shm` are host tmpfs directories, outside the checkpoint image.
    let r = sb
        .exec(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "echo t > /tmp/kept && echo s > /dev/shm/kept",
        ]))
        .await
        .unwrap();
    assert!(r.success(), "{r:?}");

    let id = sb.snapshot(&store).await.unwrap();
    let m = store.manifest(&id).await.unwrap();
    assert!(
        m.artifacts.contains_key("checkpoint.tar")
            && m.artifacts.contains_key("workspace.tar")
            && m.artifacts.contains_key("scratch.tar")
    );
    // The original keeps running after the snapshot.
    sb.write_file("ping-2", b"").await.unwrap();
    assert_eq!(
        String::from_utf8(wait_for(sb.as_ref(), "pong-2").await).unwrap(),
        format!("2 {digest}")
    );
    sb.destroy().await.unwrap();

    // A new sandbox from the snapshot resumes the process at counter 1 with the same buffer.
    let restored = common::backend()
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_ne!(restored.id(), sb.id());
    assert!(restored.timeline().get(Phase::Restore).is_some());
    assert!(
        restored.read_file("pong-2").await.is_err(),
        "workspace is the snapshot's, not the later one"
    );
    restored.write_file("ping-2", b"").await.unwrap();
    assert_eq!(
        String::from_utf8(wait_for(restored.as_ref(), "pong-2").await).unwrap(),
        format!("2 {digest}")
    );
    let r = restored
        .exec(ExecRequest::argv(["cat", "/tmp/kept", "/dev/shm/kept"]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "t\ns\n", "{r:?}");
    restored.destroy().await.unwrap();
}

#[tokio::test]
async fn pause_and_resume() {
    require_gvisor!();
    let sb = common::sandbox(&SandboxSpec::new(Language::Shell)).await;
    sb.pause().await.unwrap();
    // Paused is alive: health checks say so (they said "not running" before).
    sb.health_check().await.unwrap();
    // A command cannot start in a paused sandbox: a clear error at once, and the sandbox
    // is not taken for dead.
    let t = std::time::Instant::now();
    let e = sb
        .exec(ExecRequest::code("echo while paused"))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("paused"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    sb.resume().await.unwrap();
    assert!(sb
        .exec(ExecRequest::code("echo back"))
        .await
        .unwrap()
        .success());
}

#[tokio::test]
async fn destroy_leaves_nothing_behind_and_is_final() {
    require_gvisor!();
    let sb = common::python().await;
    let id = sb.id().to_string();
    assert!(common::host_processes_of(&id) >= 2, "sandbox and gofer run");
    assert!(
        common::mounts_mentioning(&id) >= 1,
        "the workspace tmpfs is mounted"
    );
    sb.destroy().await.unwrap();
    sb.destroy().await.unwrap();
    assert_eq!(common::host_processes_of(&id), 0);
    assert_eq!(common::mounts_mentioning(&id), 0);
    assert_eq!(common::cgroups_of(&id), Vec::<String>::new());
    let state = std::env::temp_dir().join("agent-sandbox-gvisor").join(&id);
    assert!(!state.exists());
    assert!(matches!(
        sb.exec(ExecRequest::code("1")).await,
        Err(Error::SandboxGone { .. })
    ));
}

/// A temporary directory and the `root` path in it for a root filesystem. gVisor's sandbox
/// process runs as an unprivileged host user: the path must be traversable.
fn rootfs_dir() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let root = dir.path().join("root");
    (dir, root)
}

/// A shell sandbox on the root filesystem `root`.
fn rootfs_spec(root: &std::path::Path) -> SandboxSpec {
    SandboxSpec::builder(Language::Shell)
        .rootfs(root)
        .build()
        .unwrap()
}

/// A minimal root filesystem: busybox and its applet links.
fn busybox_rootfs(dir: &std::path::Path) -> bool {
    let busybox = std::path::Path::new("/bin/busybox");
    if !busybox.exists() {
        return false;
    }
    for d in ["bin", "etc", "tmp", "workspace", "proc", "dev"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    std::fs::copy(busybox, dir.join("bin/busybox")).unwrap();
    for applet in [
        "sh", "cat", "echo", "ls", "id", "touch", "mkdir", "rm", "sleep",
    ] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet)).unwrap();
    }
    std::fs::write(
        dir.join("etc/passwd"),
        "root:x:0:0::/:/bin/sh\nsandbox:x:1000:1000::/workspace:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(dir.join("etc/os-release"), "NAME=tiny\n").unwrap();
    // A directory the sandbox user may write, to show writes land in the overlay.
    std::fs::create_dir_all(dir.join("srv")).unwrap();
    std::fs::write(dir.join("srv/data"), "original\n").unwrap();
    std::fs::set_permissions(
        dir.join("srv"),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    std::fs::set_permissions(
        dir.join("srv/data"),
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    true
}

#[tokio::test]
async fn a_rootfs_directory_is_used_and_never_written() {
    require_gvisor!();
    let (_dir, root) = rootfs_dir();
    if !busybox_rootfs(&root) {
        eprintln!("SKIP: /bin/busybox missing (apt-get install busybox-static)");
        return;
    }
    let before = sandbox_core::fsnap::pack_dir(&root).unwrap();
    // The flood below takes ~25 s under ptrace, more on a busy machine: the sandbox's own
    // wall-time limit (30 s by default) must not cut it before the disk does.
    let spec = SandboxSpec::builder(Language::Shell)
        .rootfs(&root)
        .wall_time(Duration::from_secs(240))
        .build()
        .unwrap();
    let sb = common::sandbox(&spec).await;
    let r = sb
        .exec(ExecRequest::code("cat /etc/os-release; [ -e /usr/bin/python3 ] && echo host-usr; echo changed > /srv/data; echo new > /srv/new; cat /srv/data /srv/new"))
        .await
        .unwrap();
    assert_eq!(
        r.stdout_str(),
        "NAME=tiny\nchanged\nnew\n",
        "its own root, not the host's; writes work: {r:?}"
    );
    let r = sb
        .exec(ExecRequest::code("echo x > /etc/os-release"))
        .await
        .unwrap();
    assert!(
        !r.success(),
        "root-owned files stay read-only for the sandbox user"
    );
    // This rootfs has no `dev/shm`: the sandbox still gets the capped scratch mount there
    // (through an overlay view of the directory), so a flood of files ends in ENOSPC.
    let r = sb
        .exec(
            ExecRequest::code(
                "i=0; while [ $i -lt 100000 ] && touch /dev/shm/f$i; do i=$((i+1)); done; echo $i",
            )
            // Thousands of `touch` processes under ptrace: ~25 s alone, more on a busy
            // machine; the point is where it stops, not how fast.
            .timeout(Duration::from_secs(240)),
        )
        .await
        .unwrap();
    let made: u32 = r
        .stdout_str()
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{r:?} {}", r.stderr_str()));
    assert!(made < 100_000, "{r:?}");
    assert!(
        r.stderr_str().contains("No space left"),
        "{}",
        r.stderr_str()
    );
    let r = sb.exec(ExecRequest::code("echo alive")).await.unwrap();
    assert_eq!(r.stdout_str(), "alive\n");
    sb.destroy().await.unwrap();
    assert_eq!(
        sandbox_core::fsnap::pack_dir(&root).unwrap(),
        before,
        "the rootfs directory is unchanged"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("srv/data")).unwrap(),
        "original\n"
    );
    assert!(!root.join("srv/new").exists());
}

/// A root filesystem of the host's own glibc programs (`sh`, `ls`, `stat`, `cat`) and the
/// libraries `ldd` names for them, with every directory the sandbox needs (so only the
/// `statx` shim calls for an overlay view of it).
fn glibc_rootfs(dir: &std::path::Path) {
    for d in ["bin", "etc", "tmp", "dev/shm", "workspace", "proc"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    for prog in ["/bin/sh", "/usr/bin/ls", "/usr/bin/stat", "/usr/bin/cat"] {
        let name = std::path::Path::new(prog).file_name().unwrap();
        std::fs::copy(prog, dir.join("bin").join(name)).unwrap();
        let ldd = std::process::Command::new("ldd")
            .arg(prog)
            .output()
            .unwrap();
        for lib in String::from_utf8_lossy(&ldd.stdout)
            .split_whitespace()
            .filter(|w| w.starts_with('/'))
        {
            let to = dir.join(lib.trim_start_matches('/'));
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(lib, &to).unwrap();
        }
    }
    std::fs::write(
        dir.join("etc/passwd"),
        "root:x:0:0::/:/bin/sh\nsandbox:x:1000:1000::/workspace:/bin/sh\n",
    )
    .unwrap();
}

#[tokio::test]
async fn coreutils_work_in_a_glibc_rootfs_directory_which_stays_unchanged() {
    require_gvisor!();
    let (_dir, root) = rootfs_dir();
    glibc_rootfs(&root);
    let before = sandbox_core::fsnap::pack_dir(&root).unwrap();
    let spec = rootfs_spec(&root);
    let sb = common::sandbox(&spec).await;
    let r = sb
        .exec(ExecRequest::code(
            "ls -l /etc/passwd && stat -c '%s %F' /etc/passwd && ls -la /bin",
        ))
        .await
        .unwrap();
    assert!(r.success(), "{r:?}");
    assert_eq!(r.stderr_str(), "");
    let out = r.stdout_str();
    let size = std::fs::metadata(root.join("etc/passwd")).unwrap().len();
    assert!(out.starts_with("-rw-r--r-- 1 root "), "{out}");
    assert!(
        out.contains(&format!("\n{size} regular file\n")) && out.contains(" stat\n"),
        "{out}"
    );
    sb.destroy().await.unwrap();
    assert_eq!(
        sandbox_core::fsnap::pack_dir(&root).unwrap(),
        before,
        "the rootfs directory is unchanged"
    );
}

/// Child half of `a_snapshot_restores_in_another_process`: run only when the parent asks.
#[tokio::test]
#[ignore = "run by a_snapshot_restores_in_another_process in a child process"]
async fn restore_child_process() {
    let (Ok(dir), Ok(id), Ok(digest)) = (
        std::env::var("AS_TEST_STORE"),
        std::env::var("AS_TEST_SNAPSHOT"),
        std::env::var("AS_TEST_DIGEST"),
    ) else {
        panic!("run by the parent test only");
    };
    let store = ObjectSnapshotStore::local(&dir).unwrap();
    let id: sandbox_core::SnapshotId = id.parse().unwrap();
    let sb = common::backend()
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    sb.write_file("ping-2", b"").await.unwrap();
    assert_eq!(
        String::from_utf8(wait_for(sb.as_ref(), "pong-2").await).unwrap(),
        format!("2 {digest}")
    );
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn a_snapshot_restores_in_another_process() {
    require_gvisor!();
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let sb = common::python().await;
    sb.write_file("counter.py", COUNTER.as_bytes())
        .await
        .unwrap();
    sb.exec(ExecRequest::argv([
        "/bin/sh",
        "-c",
        "python3 counter.py >/dev/null 2>&1 &",
    ]))
    .await
    .unwrap();
    let digest = String::from_utf8(wait_for(sb.as_ref(), "ready").await).unwrap();
    sb.write_file("ping-1", b"").await.unwrap();
    wait_for(sb.as_ref(), "pong-1").await;
    let id = sb.snapshot(&store).await.unwrap();
    // Destroyed while it resumes from its checkpoint: nothing is left once destroy returns.
    sb.destroy().await.unwrap();
    let state = std::env::temp_dir()
        .join("agent-sandbox-gvisor")
        .join(sb.id());
    assert!(!state.exists(), "{} left", state.display());
    assert_eq!(common::host_processes_of(sb.id()), 0);
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "restore_child_process",
            "--ignored",
            "--nocapture",
        ])
        .env("AS_TEST_STORE", dir.path())
        .env("AS_TEST_SNAPSHOT", id.as_str())
        .env("AS_TEST_DIGEST", &digest)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "child process: {text}"
    );
}
