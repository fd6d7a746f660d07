//! Functional tests of the container backend: exec, env, files, persistence, streaming,
//! limits, snapshots. Each test skips (saying why) only when the backend's probe says the
//! host cannot run containers.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::time::Duration;

use backend_container::ContainerBackend;
use common::{backend, create, sh, sh_ok, spec};
use sandbox_core::{
    Backend, Command, Error, ExecEvent, ExecRequest, Language, LimitKind, MapSecretSource,
    NetworkPolicy, ObjectSnapshotStore, ResolvedSecrets, SandboxSpec,
};

#[tokio::test]
async fn runs_code_in_each_language() {
    require_host!();
    let b = backend();
    let cases = [
        (
            Language::Python,
            "import sys; print(2 + 2, sys.version_info[0])",
            "4 3\n",
        ),
        (Language::Shell, "echo $((6 * 7))", "42\n"),
        (
            Language::Node,
            "console.log([1,2,3].map(x => x * 2).join(','))",
            "2,4,6\n",
        ),
        (
            Language::Javascript,
            "console.log(typeof process)",
            "object\n",
        ),
        (
            Language::C,
            "#include <stdio.h>\nint main(void){printf(\"c=%d\\n\", 7*6);return 0;}",
            "c=42\n",
        ),
    ];
    for (lang, code, want) in cases {
        let sb = b
            .create(&spec(lang), ResolvedSecrets::none())
            .await
            .unwrap();
        let r = sb.exec(ExecRequest::code(code)).await.unwrap();
        assert!(r.success(), "{lang}: {r:?} {}", r.stderr_str());
        assert_eq!(r.stdout_str(), want, "{lang}");
        sb.destroy().await.unwrap();
    }
    // C that does not compile reports the compiler's error, not a sandbox error.
    let sb = b
        .create(&spec(Language::C), ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sb.exec(ExecRequest::code("int main( {")).await.unwrap();
    assert_ne!(r.exit_code, Some(0));
    assert!(r.stderr_str().contains("error"), "{}", r.stderr_str());
}

#[tokio::test]
async fn argv_exit_codes_stdin_and_cwd() {
    require_host!();
    let sb = create(Language::Shell).await;
    let r = sh(sb.as_ref(), "exit 3").await;
    assert_eq!(r.exit_code, Some(3));
    assert_eq!(r.limit, None);
    let r = sh(sb.as_ref(), "kill -9 $$").await;
    assert_eq!(r.exit_code, Some(137));
    let r = sb
        .exec(ExecRequest::argv(["cat"]).stdin("hello stdin"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "hello stdin");
    // Large stdin is streamed, not buffered in a pipe.
    let big = vec![b'x'; 1 << 20];
    let r = sb
        .exec(ExecRequest::argv(["wc", "-c"]).stdin(big))
        .await
        .unwrap();
    assert_eq!(r.stdout_str().trim(), "1048576");
    sh_ok(sb.as_ref(), "mkdir -p sub/dir").await;
    let r = sb
        .exec(ExecRequest::argv(["pwd"]).cwd("sub/dir"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "/workspace/sub/dir\n");
    let r = sb
        .exec(ExecRequest::argv(["pwd"]).cwd("/tmp"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "/tmp\n");
    let r = sb
        .exec(ExecRequest::argv(["pwd"]).cwd("missing"))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(126));
    assert!(
        r.stderr_str().contains("working directory"),
        "{}",
        r.stderr_str()
    );
    assert_eq!(
        sh_ok(sb.as_ref(), "id -un; hostname").await,
        "sandbox\nsandbox\n"
    );
}

#[tokio::test]
async fn commands_are_found_on_their_path_and_start_without_privileges() {
    require_host!();
    let sb = create(Language::Shell).await;
    // The command's own PATH decides, like execvp: a directory of the workspace first.
    sh_ok(
        sb.as_ref(),
        "mkdir -p bin && printf '#!/bin/sh\\necho mine \"$@\"\\n' > bin/true && chmod +x bin/true",
    )
    .await;
    let r = sb
        .exec(ExecRequest::argv(["true", "a", "b"]).env("PATH", "/workspace/bin:/usr/bin:/bin"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "mine a b\n");
    // A file without `#!` runs through /bin/sh, with its arguments.
    sh_ok(
        sb.as_ref(),
        "printf 'echo plain \"$1\"\\n' > plain && chmod +x plain",
    )
    .await;
    let r = sb
        .exec(ExecRequest::argv(["./plain", "arg"]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "plain arg\n", "{}", r.stderr_str());
    // Found but not executable: 126, not "not found".
    sh_ok(sb.as_ref(), "echo x > noexec && chmod 644 noexec").await;
    let r = sb
        .exec(ExecRequest::argv(["/workspace/noexec"]))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(126), "{}", r.stderr_str());
    assert!(
        r.stderr_str().contains("permission denied"),
        "{}",
        r.stderr_str()
    );
    // No capability of any kind survives into the command, and none can come back.
    let caps = sh_ok(
        sb.as_ref(),
        "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status",
    )
    .await;
    for line in caps.lines() {
        assert!(line.ends_with("0000000000000000"), "{caps}");
    }
    // Signals are not blocked in the command (the init blocks SIGCHLD/SIGTERM for itself).
    let blocked = sh_ok(sb.as_ref(), "grep SigBlk /proc/self/status").await;
    assert!(blocked.trim().ends_with("0000000000000000"), "{blocked}");
    let r = sh(sb.as_ref(), "sleep 30 & kill -TERM $!; wait $!; echo $?").await;
    assert_eq!(r.stdout_str(), "143\n");
}

#[tokio::test]
async fn environment_is_exactly_the_specs() {
    require_host!();
    let spec = SandboxSpec::builder(Language::Shell)
        .env("GREETING", "hi")
        .secret_env("TOKEN", "API_TOKEN")
        .build()
        .unwrap();
    let secrets = ResolvedSecrets::resolve(
        &spec.secrets,
        &MapSecretSource::new().with("TOKEN", "s3cr3t-value"),
    )
    .unwrap();
    let sb = backend().create(&spec, secrets).await.unwrap();
    let r = sb
        .exec(ExecRequest::argv(["env"]).env("PER_CALL", "1"))
        .await
        .unwrap();
    let mut names: Vec<String> = r
        .stdout_str()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, _)| k.to_string())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["API_TOKEN", "GREETING", "HOME", "LANG", "PATH", "PER_CALL"],
        "{}",
        r.stdout_str()
    );
    // The secret reaches the code but is redacted from captured output.
    assert!(!r.stdout_str().contains("s3cr3t-value"));
    assert!(
        r.stdout_str().contains("API_TOKEN=[REDACTED:TOKEN]"),
        "{}",
        r.stdout_str()
    );
    // The host's environment (cargo sets plenty) is nowhere, not even in pid 1's environ.
    let r = sh(
        sb.as_ref(),
        "cat /proc/1/environ; echo; tr '\\0' '\\n' < /proc/self/environ",
    )
    .await;
    assert!(!r.stdout_str().contains("CARGO"), "{}", r.stdout_str());
    assert!(!r.stdout_str().contains("RUST"), "{}", r.stdout_str());
}

#[tokio::test]
async fn files_persist_across_execs_and_the_file_api() {
    require_host!();
    let sb = create(Language::Python).await;
    sb.write_file("src/main.py", b"print('from file')\n")
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::argv(["python3", "src/main.py"]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "from file\n", "{}", r.stderr_str());
    // Files written by the code are readable through the API and by later execs.
    sh_ok(
        sb.as_ref(),
        "echo made-inside > out.txt && mkdir -p d/e && touch d/e/f",
    )
    .await;
    assert_eq!(sb.read_file("out.txt").await.unwrap(), b"made-inside\n");
    assert_eq!(
        sb.read_file("/workspace/out.txt").await.unwrap(),
        b"made-inside\n"
    );
    assert_eq!(sh_ok(sb.as_ref(), "cat out.txt").await, "made-inside\n");
    // The API can overwrite what the code made (ownership stays the sandbox user's).
    sb.write_file("out.txt", b"overwritten").await.unwrap();
    sh_ok(
        sb.as_ref(),
        "echo appended >> src/main.py && test -w out.txt",
    )
    .await;
    let names: Vec<String> = sb
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["d", "out.txt", "src"]);
    let e = sb.list("d/e").await.unwrap();
    assert_eq!(e.len(), 1);
    assert!(matches!(
        sb.read_file("nope.txt").await,
        Err(Error::NotFound { .. })
    ));
    // Python state does not persist (a new process per exec) but files do.
    sb.exec(ExecRequest::code("open('counter','w').write('1')"))
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::code("print(open('counter').read())"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "1\n");
}

#[tokio::test]
async fn background_processes_persist_and_do_not_block_exec() {
    require_host!();
    let sb = create(Language::Shell).await;
    // The background child keeps stdout open: the exec still returns when `sh` exits.
    let r = sh(sb.as_ref(), "sleep 1000 & echo $!").await;
    assert!(r.success(), "{r:?}");
    assert_eq!(r.limit, None);
    let pid = r.stdout_str().trim().to_string();
    assert!(!pid.is_empty());
    sh_ok(sb.as_ref(), &format!("kill -0 {pid}")).await;
    // A server started in one exec answers in the next.
    sb.write_file(
        "srv.py",
        b"import socket\ns=socket.socket(); s.bind(('127.0.0.1', 8765)); s.listen()\nopen('ready','w').close()\nwhile True:\n  c,_=s.accept(); c.sendall(b'pong'); c.close()\n",
    )
    .await
    .unwrap();
    sh_ok(
        sb.as_ref(),
        "python3 srv.py >/dev/null 2>&1 & while [ ! -e ready ]; do sleep 0.01; done",
    )
    .await;
    let r = sb
        .exec(ExecRequest::argv([
            "python3",
            "-c",
            "import socket; c=socket.create_connection(('127.0.0.1', 8765)); print(c.recv(9).decode())",
        ]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "pong\n", "{}", r.stderr_str());
}

#[tokio::test]
async fn streaming_output_arrives_in_order_and_ends_with_exit() {
    require_host!();
    let sb = create(Language::Shell).await;
    let mut s = sb
        .exec_stream(ExecRequest::code(
            "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.02; done; exit 5",
        ))
        .await
        .unwrap();
    let (mut out, mut err, mut exit) = (Vec::new(), Vec::new(), None);
    let mut events = 0;
    while let Some(ev) = s.next().await {
        events += 1;
        match ev.unwrap() {
            ExecEvent::Stdout(b) => out.extend_from_slice(&b),
            ExecEvent::Stderr(b) => err.extend_from_slice(&b),
            ExecEvent::Exit(r) => {
                assert!(exit.is_none(), "two exit events");
                assert!(r.stdout.is_empty());
                exit = Some(r);
            }
            other => panic!("unexpected event: {other:?}"),
        }
    }
    assert!(events >= 3);
    assert_eq!(String::from_utf8(out).unwrap(), "out1\nout2\nout3\n");
    assert_eq!(String::from_utf8(err).unwrap(), "err1\nerr2\nerr3\n");
    assert_eq!(exit.unwrap().exit_code, Some(5));
    // collect() gives the same as exec().
    let r = sb
        .exec_stream(ExecRequest::code("printf abc"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(r.stdout, b"abc");
}

#[tokio::test]
async fn memory_exhaustion_is_reported_and_contained() {
    require_host!();
    let spec = SandboxSpec::builder(Language::Python)
        .memory_mib(64)
        .build()
        .unwrap();
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::code(
            "x = bytearray(400 << 20); x[::4096] = b'1' * len(x[::4096]); print('survived')",
        ))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::Memory), "{r:?} {}", r.stderr_str());
    assert_eq!(r.exit_code, Some(137));
    assert!(!r.stdout_str().contains("survived"));
    // The sandbox (and its init) survive the OOM kill.
    assert_eq!(
        sb.exec(ExecRequest::code("print('alive')"))
            .await
            .unwrap()
            .stdout_str(),
        "alive\n"
    );
    // Commands (and the init they are forked from) keep the default OOM score: a negative
    // one, inherited, would leave the OOM killer nothing to kill (on hosts where the
    // library may set one; this CI host's root lacks CAP_SYS_RESOURCE).
    let r = sb
        .exec(ExecRequest::code(
            "print(open('/proc/self/oom_score_adj').read().strip(), open('/proc/1/oom_score_adj').read().strip())",
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "0 0\n", "{}", r.stderr_str());
}

#[tokio::test]
async fn fork_bomb_hits_the_pids_limit() {
    require_host!();
    let mut spec = SandboxSpec::builder(Language::Shell).build().unwrap();
    spec.limits.pids = 32;
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sb
        .exec(
            ExecRequest::code("f() { f | f & }; f; sleep 2; exit 1")
                .timeout(Duration::from_secs(3)),
        )
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::Pids), "{r:?}");
    // The bomb is gone after the call; the sandbox works.
    let left = sh_ok(sb.as_ref(), "ls /proc | grep -c '^[0-9]'").await;
    assert!(
        left.trim().parse::<u32>().unwrap() < 8,
        "processes left: {left}"
    );
}

#[tokio::test]
async fn wall_timeout_kills_the_whole_tree() {
    require_host!();
    let sb = create(Language::Shell).await;
    // Children in their own session, a double fork, and a process ignoring SIGTERM.
    let script = "setsid sleep 1001 & (sleep 1002 &) ; trap '' TERM; sleep 1003";
    let r = sb
        .exec(ExecRequest::code(script).timeout(Duration::from_millis(500)))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime));
    assert_eq!(r.exit_code, Some(137));
    let ps = sh_ok(sb.as_ref(), "cat /proc/[0-9]*/cmdline | tr '\\0' ' '").await;
    for n in ["1001", "1002", "1003"] {
        assert!(
            !ps.contains(&format!("sleep {n}")),
            "sleep {n} survived: {ps}"
        );
    }
}

#[tokio::test]
async fn output_is_capped_and_a_flood_is_stopped() {
    require_host!();
    let spec = SandboxSpec::builder(Language::Shell)
        .output_bytes(1000)
        .build()
        .unwrap();
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::code("head -c 5000 /dev/zero; echo done >&2"))
        .await
        .unwrap();
    assert_eq!(r.stdout.len(), 1000);
    assert!(r.truncated);
    assert_eq!(r.limit, None);
    assert_eq!(r.stderr_str(), "done\n");
    let r = sb
        .exec(ExecRequest::argv(["yes"]).timeout(Duration::from_secs(20)))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::Output), "{r:?}");
    assert!(r.truncated);
    assert_eq!(r.stdout.len(), 1000);
}

#[tokio::test]
async fn cpu_time_and_open_files_limits() {
    require_host!();
    let mut spec = SandboxSpec::builder(Language::Python).build().unwrap();
    spec.limits.cpu_time_ms = 1000;
    spec.limits.open_files = 32;
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::code("while True: pass").timeout(Duration::from_secs(20)))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::CpuTime), "{r:?}");
    let r = sb.exec(ExecRequest::code("import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], resource.getrlimit(resource.RLIMIT_CORE)[0])")).await.unwrap();
    assert_eq!(r.stdout_str(), "32 0\n");
}

#[tokio::test]
async fn full_workspace_is_reported_as_disk() {
    require_host!();
    let mut spec = SandboxSpec::builder(Language::Shell).build().unwrap();
    spec.limits.disk_bytes = 8 << 20;
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sh(sb.as_ref(), "head -c 20000000 /dev/zero > big").await;
    assert_ne!(r.exit_code, Some(0));
    assert_eq!(r.limit, Some(LimitKind::Disk), "{r:?}");
    assert!(matches!(
        sb.write_file("more", &vec![0u8; 1 << 20]).await,
        Err(Error::ResourceExhausted { .. })
    ));
}

#[tokio::test]
async fn network_is_loopback_only() {
    require_host!();
    let sb = create(Language::Shell).await;
    // Only `lo`, and it is up; no route at all.
    let dev = sh_ok(
        sb.as_ref(),
        "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '",
    )
    .await;
    assert_eq!(dev, "lo\n");
    let routes = sh_ok(sb.as_ref(), "tail -n +2 /proc/net/route | wc -l; tail -n +1 /proc/net/ipv6_route | grep -vc ' lo$' || true").await;
    assert_eq!(routes.lines().next(), Some("0"), "{routes}");
    let r = sb.exec(ExecRequest::argv(["python3", "-c", "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); c=socket.create_connection(s.getsockname()); print('lo ok')"])).await.unwrap();
    assert_eq!(r.stdout_str(), "lo ok\n", "{}", r.stderr_str());
    // Other policies need the egress enforcer, which is not plugged in.
    let spec = SandboxSpec::builder(Language::Shell)
        .network(NetworkPolicy::allow_hosts(["example.com"]).unwrap())
        .build()
        .unwrap();
    assert!(matches!(
        backend().create(&spec, ResolvedSecrets::none()).await,
        Err(Error::Unsupported { .. })
    ));
}

#[tokio::test]
async fn host_dir_workspace_and_mounts_hide_host_paths() {
    require_host!();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("input.txt"), "from host").unwrap();
    let data = tempfile::tempdir().unwrap();
    std::fs::write(data.path().join("d.txt"), "data").unwrap();
    let spec = SandboxSpec::builder(Language::Shell)
        .workspace_dir(dir.path(), true)
        .mount_ro(data.path(), "/data")
        .build()
        .unwrap();
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(
        sh_ok(sb.as_ref(), "cat input.txt /data/d.txt").await,
        "from hostdata"
    );
    let r = sh(sb.as_ref(), "touch /workspace/new").await;
    assert_ne!(r.exit_code, Some(0), "read-only workspace was writable");
    let r = sh(sb.as_ref(), "touch /data/new").await;
    assert_ne!(r.exit_code, Some(0), "read-only mount was writable");
    let mounts = sh_ok(sb.as_ref(), "cat /proc/mounts").await;
    let host = dir.path().to_string_lossy().to_string();
    assert!(
        !mounts.contains(&host),
        "/proc/mounts reveals {host}:\n{mounts}"
    );
    assert!(
        !mounts.contains("oldroot") && !mounts.contains("newroot"),
        "{mounts}"
    );
    assert!(!dir.path().join("new").exists());
}

#[tokio::test]
async fn root_template_is_shared_read_only_per_hostname_and_never_on_the_host() {
    require_host!();
    // Two configurations (two sets of generated /etc files), one of them with a writable
    // host-directory workspace (it reaches the template-mode init as a detached mount).
    let dir = tempfile::tempdir().unwrap();
    if nix::unistd::geteuid().is_root() {
        // An unprivileged owner: the sandbox user maps to it (host root never is).
        std::os::unix::fs::chown(dir.path(), Some(4242), Some(4242)).unwrap();
    }
    let other = ContainerBackend::builder()
        .hostname("other")
        .build()
        .unwrap();
    let spec_dir = SandboxSpec::builder(Language::Shell)
        .workspace_dir(dir.path(), false)
        .build()
        .unwrap();
    let a = create(Language::Shell).await;
    let b = other
        .create(&spec_dir, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(
        sh_ok(a.as_ref(), "cat /etc/hostname; hostname").await,
        "sandbox\nsandbox\n"
    );
    assert_eq!(
        sh_ok(b.as_ref(), "cat /etc/hostname; hostname").await,
        "other\nother\n"
    );
    if nix::unistd::geteuid().is_root() {
        // The template is in use: its files belong to host root, unmapped inside (the classic
        // setup's root is written by the sandbox's own root, uid 0).
        for sb in [&a, &b] {
            assert_eq!(
                sh_ok(sb.as_ref(), "stat -c %u /etc/passwd /").await,
                "65534\n65534\n"
            );
        }
    }
    // The shared root cannot be written, nor remounted, from inside.
    for path in ["/x", "/etc/passwd", "/etc/hosts", "/dev/x", "/var/x"] {
        let r = sh(a.as_ref(), &format!("echo x > {path}")).await;
        assert_ne!(r.exit_code, Some(0), "{path} was writable");
    }
    let r = sh(
        a.as_ref(),
        "mount -o remount,rw / 2>&1; umount /etc/ssl 2>&1",
    )
    .await;
    assert_ne!(r.exit_code, Some(0));
    // Each sandbox's own mounts stay its own.
    sh_ok(a.as_ref(), "echo a > /tmp/t && echo a > /dev/shm/s").await;
    assert_eq!(
        sh(b.as_ref(), "cat /tmp/t /dev/shm/s").await.exit_code,
        Some(1)
    );
    sh_ok(b.as_ref(), "echo from-b > /workspace/out").await;
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out")).unwrap(),
        "from-b\n"
    );
    let mounts = sh_ok(a.as_ref(), "cat /proc/self/mountinfo").await;
    assert!(
        !mounts.contains("agent-sandbox") && !mounts.contains("oldroot"),
        "{mounts}"
    );
    // The templates live in the zygote's mount namespace only.
    let host = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!host.contains("/run/agent-sandbox-templates"), "{host}");
    if let Ok(rd) = std::fs::read_dir("/run/agent-sandbox-templates") {
        assert_eq!(rd.count(), 0, "template files on the host");
    }
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_execs_each_get_their_own_output_and_status() {
    require_host!();
    // One exec takes the spare supervisor (straight from the library), the others go through
    // the init (a supervisor forked on demand); a timeout kills only its own tree.
    let sb: std::sync::Arc<dyn sandbox_core::Sandbox> =
        std::sync::Arc::from(create(Language::Shell).await);
    let mut tasks = Vec::new();
    for i in 0..6u32 {
        let sb = sb.clone();
        tasks.push(tokio::spawn(async move {
            let req = if i == 5 {
                ExecRequest::argv(["/bin/sh", "-c", "sleep 30"]).timeout(Duration::from_millis(300))
            } else {
                ExecRequest::argv([
                    "/bin/sh",
                    "-c",
                    &format!("sleep 0.0{i}; echo out{i}; echo err{i} >&2; exit {i}"),
                ])
            };
            (i, sb.exec(req).await.unwrap())
        }));
    }
    for t in tasks {
        let (i, r) = t.await.unwrap();
        if i == 5 {
            assert_eq!(r.limit, Some(LimitKind::WallTime), "{r:?}");
        } else {
            assert_eq!(r.exit_code, Some(i as i32), "{r:?}");
            assert_eq!(r.stdout_str(), format!("out{i}\n"));
            assert_eq!(String::from_utf8_lossy(&r.stderr), format!("err{i}\n"));
        }
    }
    // Both paths keep working afterwards.
    for _ in 0..3 {
        assert_eq!(sh_ok(sb.as_ref(), "echo after").await, "after\n");
    }
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn snapshot_restores_files_into_a_new_sandbox() {
    require_host!();
    let b = backend();
    let store_dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(store_dir.path()).unwrap();
    let sb = b
        .create(&spec(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    sh_ok(
        sb.as_ref(),
        "mkdir -p a/b && echo one > a/b/f && ln -s /etc/passwd a/link && chmod 700 a/b",
    )
    .await;
    let id = sb.snapshot(&store).await.unwrap();
    sb.destroy().await.unwrap();
    let restored = b
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(
        sh_ok(
            restored.as_ref(),
            "cat a/b/f; readlink a/link; stat -c %a a/b; id -un; stat -c %U a/b/f"
        )
        .await,
        "one\n/etc/passwd\n700\nsandbox\nsandbox\n"
    );
    assert!(restored
        .timeline()
        .get(sandbox_core::Phase::Restore)
        .is_some());
    // The restored sandbox can modify what it got back.
    sh_ok(restored.as_ref(), "echo two >> a/b/f && rm a/link").await;
}

#[tokio::test]
async fn pause_and_resume() {
    require_host!();
    let b = backend();
    if !b.capabilities().pause_resume {
        eprintln!("SKIP: no freezer cgroup on this host");
        return;
    }
    let sb = b
        .create(&spec(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    sh_ok(
        sb.as_ref(),
        "i=0; (while true; do i=$((i+1)); echo $i > count; sleep 0.01; done) >/dev/null 2>&1 & while [ ! -s count ]; do sleep 0.01; done",
    )
    .await;
    sb.pause().await.unwrap();
    let a = sb.read_file("count").await.unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let b2 = sb.read_file("count").await.unwrap();
    assert_eq!(a, b2, "a frozen sandbox kept running");
    // A command cannot start in a frozen sandbox: a clear error at once.
    let e = sb.exec(ExecRequest::argv(["true"])).await.unwrap_err();
    assert!(e.to_string().contains("paused"), "{e}");
    sb.resume().await.unwrap();
    sh_ok(sb.as_ref(), "true").await;
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn destroy_is_idempotent_and_final() {
    require_host!();
    let sb = create(Language::Shell).await;
    sb.health_check().await.unwrap();
    sb.destroy().await.unwrap();
    sb.destroy().await.unwrap();
    assert!(matches!(
        sb.exec(ExecRequest::argv(["true"])).await,
        Err(Error::SandboxGone { .. })
    ));
    assert!(matches!(
        sb.read_file("x").await,
        Err(Error::SandboxGone { .. })
    ));
    assert!(matches!(
        sb.health_check().await,
        Err(Error::SandboxGone { .. })
    ));
}

#[tokio::test]
async fn capabilities_and_probe_are_honest() {
    let b = ContainerBackend::builder().build().unwrap();
    let c = b.capabilities();
    assert_eq!(c.network, vec![sandbox_core::NetworkMode::DenyAll]);
    assert_eq!(c.snapshots, vec![sandbox_core::SnapshotKind::Filesystem]);
    assert!(c.argv && c.streaming && c.persistent_state);
    assert!(!c.supports_language(Language::Wasm));
    let s = b.probe().await;
    for k in ["mode", "cgroup", "seccomp", "landlock_abi"] {
        assert!(s.details.contains_key(k), "probe lacks {k}: {s:?}");
    }
    if !s.available {
        assert!(s.fix.is_some());
    }
    let _ = Command::Argv(vec![]);
}

/// Records the backend's calls to its egress enforcer (the real one is tested in
/// agent-sandbox/tests/egress.rs).
#[derive(Debug, Default)]
struct RecordingEnforcer {
    calls: std::sync::Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl sandbox_core::EgressEnforcer for RecordingEnforcer {
    fn check(&self, policy: &NetworkPolicy) -> sandbox_core::Result<()> {
        match policy {
            NetworkPolicy::AllowInternet { .. } => Err(Error::unsupported(
                sandbox_core::Tier::Container,
                "internet (test enforcer)",
            )),
            _ => Ok(()),
        }
    }

    fn prepare(
        &self,
        sandbox_id: &str,
        _policy: &NetworkPolicy,
    ) -> sandbox_core::Result<sandbox_core::EgressPlan> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("prepare {sandbox_id}"));
        Ok(sandbox_core::EgressPlan::new(
            sandbox_id,
            vec![("HTTP_PROXY".into(), "http://10.200.0.1:3128".into())],
            "nameserver 10.200.0.1\n",
        ))
    }

    async fn attach(
        &self,
        plan: &sandbox_core::EgressPlan,
        netns_pid: i32,
    ) -> sandbox_core::Result<()> {
        // The namespace exists and is not ours.
        let theirs = std::fs::read_link(format!("/proc/{netns_pid}/ns/net")).unwrap();
        let ours = std::fs::read_link("/proc/self/ns/net").unwrap();
        assert_ne!(theirs, ours);
        self.calls
            .lock()
            .unwrap()
            .push(format!("attach {}", plan.sandbox_id));
        Ok(())
    }

    fn update(&self, sandbox_id: &str, _policy: &NetworkPolicy) -> sandbox_core::Result<()> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("update {sandbox_id}"));
        Ok(())
    }

    fn events(&self, _sandbox_id: &str) -> sandbox_core::Result<Vec<sandbox_core::NetworkEvent>> {
        Ok(Vec::new())
    }

    async fn detach(&self, sandbox_id: &str) {
        self.calls
            .lock()
            .unwrap()
            .push(format!("detach {sandbox_id}"));
    }

    fn detach_in_background(&self, sandbox_id: &str) {
        self.calls
            .lock()
            .unwrap()
            .push(format!("detach-bg {sandbox_id}"));
    }
}

#[tokio::test]
async fn egress_enforcer_is_driven_through_the_sandbox_lifecycle() {
    require_host!();
    let enforcer = std::sync::Arc::new(RecordingEnforcer::default());
    let b = ContainerBackend::builder()
        .egress(enforcer.clone())
        .build()
        .unwrap();
    assert!(b
        .capabilities()
        .network
        .contains(&sandbox_core::NetworkMode::Allowlist));
    let spec = SandboxSpec::builder(Language::Shell)
        .network(NetworkPolicy::allow_hosts(["example.com"]).unwrap())
        .build()
        .unwrap();
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    assert!(sb.timeline().get(sandbox_core::Phase::Network).is_some());
    assert_eq!(
        sh_ok(sb.as_ref(), "cat /etc/resolv.conf").await,
        "nameserver 10.200.0.1\n"
    );
    assert_eq!(
        sh_ok(sb.as_ref(), "echo $HTTP_PROXY").await,
        "http://10.200.0.1:3128\n"
    );
    sb.set_network_policy(NetworkPolicy::DenyAll).await.unwrap();
    let id = sb.id().to_string();
    sb.destroy().await.unwrap();
    let calls = enforcer.calls.lock().unwrap().clone();
    assert_eq!(
        calls[..4],
        [
            format!("prepare {id}"),
            format!("attach {id}"),
            format!("update {id}"),
            format!("detach {id}")
        ]
    );
    // A policy the enforcer refuses is refused at create; a deny-all sandbox never asks it.
    let spec = SandboxSpec::builder(Language::Shell)
        .network(NetworkPolicy::AllowInternet {
            deny: vec![],
            private: vec![],
        })
        .build()
        .unwrap();
    assert!(matches!(
        b.create(&spec, ResolvedSecrets::none()).await,
        Err(Error::Unsupported { .. })
    ));
    let before = enforcer.calls.lock().unwrap().len();
    let sb = b
        .create(
            &SandboxSpec::builder(Language::Shell).build().unwrap(),
            ResolvedSecrets::none(),
        )
        .await
        .unwrap();
    assert!(matches!(
        sb.set_network_policy(NetworkPolicy::allow_hosts(["a.test"]).unwrap())
            .await,
        Err(Error::Unsupported { .. })
    ));
    sb.destroy().await.unwrap();
    assert_eq!(enforcer.calls.lock().unwrap().len(), before);
}

#[tokio::test]
async fn state_dir_records_live_sandboxes_and_cleans_stale_ones() {
    require_host!();
    let state = tempfile::tempdir().unwrap();
    let b = ContainerBackend::builder()
        .state_dir(state.path())
        .build()
        .unwrap();
    let sb = b
        .create(&spec(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    let rec = state
        .path()
        .join(format!("asb-{}-{}", std::process::id(), sb.id()));
    assert!(rec.exists());
    assert_eq!(b.cleanup_stale(), 0, "a live sandbox was cleaned");
    sb.destroy().await.unwrap();
    assert!(!rec.exists());
    // A record whose owner is gone (a crashed process, here one that ran and was reaped):
    // its cgroups are removed.
    let dead_owner = {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        c.wait().unwrap();
        c.id()
    };
    let name = format!("asb-{dead_owner}-stale-test");
    let dirs: Vec<_> = common::own_cgroup_dirs()
        .into_iter()
        .map(|d| d.join(&name))
        .collect();
    let mut body = String::from("999999999\n");
    for d in &dirs {
        std::fs::create_dir(d).unwrap();
        body.push_str(&format!("{}\n", d.display()));
    }
    std::fs::write(state.path().join(&name), body).unwrap();
    assert_eq!(b.cleanup_stale(), 1);
    assert!(dirs.iter().all(|d| !d.exists()));
}

#[tokio::test]
async fn large_code_and_env_travel_out_of_band() {
    require_host!();
    let sb = create(Language::Python).await;
    // ~100 KiB of code (over the inline packet size, under the kernel's per-argument limit).
    let code = format!(
        "x = 1\n{}print('big ok')\n",
        "# padding padding padding padding\n".repeat(3000)
    );
    let r = sb.exec(ExecRequest::code(code)).await.unwrap();
    assert_eq!(r.stdout_str(), "big ok\n", "{}", r.stderr_str());
    // Over the per-argument limit: a clear failure, not a hang.
    let r = sb
        .exec(ExecRequest::code("#".repeat(200_000)))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(126));
    assert!(
        r.stderr_str().contains("agent-sandbox"),
        "{}",
        r.stderr_str()
    );
}

#[tokio::test]
async fn lifetime_ends_the_sandbox() {
    require_host!();
    let mut spec = SandboxSpec::new(Language::Shell);
    spec.limits.wall_time_ms = 200;
    spec.limits.lifetime_ms = 300;
    let sb = ContainerBackend::builder()
        .build()
        .unwrap()
        .create_container(&spec)
        .await
        .unwrap();
    let pid = sb.init_pid();
    sh_ok(&sb, "sleep 1000 >/dev/null 2>&1 &").await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    match sandbox_core::Sandbox::exec(&sb, ExecRequest::argv(["true"])).await {
        Err(Error::SandboxGone { reason, .. }) => assert!(reason.contains("lifetime"), "{reason}"),
        other => panic!("expected SandboxGone, got {other:?}"),
    }
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
}

#[tokio::test]
async fn host_dir_workspace_owned_by_a_user_is_writable() {
    require_host!();
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("in.txt"), "host").unwrap();
    let (uid, gid) = if nix::unistd::geteuid().is_root() {
        // As root: a directory of an unprivileged user (an arbitrary uid).
        std::os::unix::fs::chown(dir.path(), Some(4242), Some(4242)).unwrap();
        std::os::unix::fs::chown(dir.path().join("in.txt"), Some(4242), Some(4242)).unwrap();
        (4242, 4242)
    } else {
        (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        )
    };
    let spec = SandboxSpec::builder(Language::Shell)
        .workspace_dir(dir.path(), false)
        .build()
        .unwrap();
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    sh_ok(
        sb.as_ref(),
        "cat in.txt > copy.txt && echo more >> in.txt && mkdir sub && touch sub/f",
    )
    .await;
    sb.write_file("api.txt", b"api").await.unwrap();
    assert_eq!(
        sh_ok(sb.as_ref(), "cat api.txt && echo x >> api.txt && echo ok").await,
        "apiok\n"
    );
    for f in ["copy.txt", "sub/f", "api.txt"] {
        let md = std::fs::metadata(dir.path().join(f)).unwrap();
        assert_eq!((md.uid(), md.gid()), (uid, gid), "{f}");
    }
    assert_eq!(
        std::fs::read_to_string(dir.path().join("in.txt")).unwrap(),
        "hostmore\n"
    );
}

#[tokio::test]
async fn a_spare_supervisor_serves_execs_that_leave_nothing_behind() {
    require_host!();
    let sb = create(Language::Shell).await;
    let parent = |s: String| s.trim().parse::<u32>().unwrap();
    // Consecutive execs that leave nothing behind are served by the same supervisor (the
    // command's parent), each with its own environment, working directory and output.
    let first = parent(sh_ok(sb.as_ref(), "echo $PPID").await);
    let mut req = ExecRequest::argv(["/bin/sh", "-c", "echo $PPID $ONLY_HERE; pwd"]);
    req.env.insert("ONLY_HERE".into(), "x".into());
    req.cwd = Some("/tmp".into());
    let r = sb.exec(req).await.unwrap();
    assert_eq!(r.stdout_str(), format!("{first} x\n/tmp\n"));
    assert_eq!(
        sh_ok(sb.as_ref(), "echo $PPID ${ONLY_HERE:-unset}; pwd").await,
        format!("{first} unset\n/workspace\n")
    );
    // A command that fails to start: its supervisor leaves, the sandbox goes on.
    let r = sb
        .exec(ExecRequest::argv(["/no/such/binary"]))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(127));
    assert_eq!(sh_ok(sb.as_ref(), "echo ok").await, "ok\n");
    // An exec that leaves a process running gets a supervisor of its own, which stays with
    // that process; the next exec has another.
    let bg = sh_ok(sb.as_ref(), "sleep 30 >/dev/null 2>&1 & echo $PPID").await;
    let bg_sup = parent(bg);
    let next = parent(sh_ok(sb.as_ref(), "echo $PPID").await);
    assert_ne!(
        next, bg_sup,
        "a supervisor with a live tree served another exec"
    );
    // So does one whose exec timed out (its tree is being killed).
    let mut slow = ExecRequest::argv(["/bin/sh", "-c", "echo $PPID; sleep 30"]);
    slow.timeout = Some(Duration::from_millis(300));
    let r = sb.exec(slow).await.unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime));
    let slow_sup = parent(r.stdout_str());
    let again = parent(sh_ok(sb.as_ref(), "echo $PPID").await);
    assert_ne!(
        again, slow_sup,
        "a supervisor that was told to kill served another exec"
    );
    // The init's next spare (forked once the killed one is done) is reused again.
    let mut pairs = Vec::new();
    for _ in 0..20 {
        let (a, b) = (
            parent(sh_ok(sb.as_ref(), "echo $PPID").await),
            parent(sh_ok(sb.as_ref(), "echo $PPID").await),
        );
        pairs.push((a, b));
        if a == b {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(pairs.iter().any(|(a, b)| a == b), "never reused: {pairs:?}");
    sb.destroy().await.unwrap();
}
