//! Background processes and published ports of the container tier, used as an agent would:
//! a long-running process across execs, stdin and output as they come, signals, a flood
//! nobody reads, a real web server reached from the host under `DenyAll`, and bad input.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::time::Duration;

use common::{backend, create, sh_ok};
use sandbox_core::{
    Backend, Error, ExecEvent, ExecRequest, Language, MapSecretSource, ProcessState,
    ResolvedSecrets, SandboxSpec, Signal,
};

/// This test binary starts the way a shell's background job under `nohup` does, whatever
/// started it: `SIGINT`, `SIGQUIT` and `SIGHUP` ignored, `SIGUSR1` and `SIGTERM` blocked. Set
/// before `main` (an `.init_array` constructor), so that every thread inherits the mask and
/// the sandbox zygote, whichever test starts it, the dispositions. A sandbox must start its
/// processes with every signal at its default and none blocked all the same (see
/// [`assert_default_signals`]).
#[used]
#[link_section = ".init_array"]
static LIKE_A_BACKGROUND_JOB: extern "C" fn() = like_a_background_job;

extern "C" fn like_a_background_job() {
    // SAFETY: runs before `main`, on the only thread: sets dispositions and its own mask.
    unsafe {
        for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP] {
            libc::signal(sig, libc::SIG_IGN);
        }
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGUSR1, libc::SIGTERM] {
            libc::sigaddset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// The value of the hexadecimal signal-set line `key` (`SigIgn`...) of a `/proc/.../status`
/// text.
fn sig_line(status: &str, key: &str) -> u64 {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {key} in {status:?}"));
    u64::from_str_radix(line.trim(), 16).unwrap()
}

/// The signals (numbers) of a signal set.
fn signals(set: u64) -> Vec<u32> {
    (1..=64).filter(|s| set & (1 << (s - 1)) != 0).collect()
}

/// Checks that this process is what [`LIKE_A_BACKGROUND_JOB`] made it (else the tests of
/// the sandbox's signals would prove nothing), then that the sandboxed process whose
/// `/proc/self/status` is `status` ignores and blocks nothing.
fn assert_default_signals(status: &str, what: &str) {
    let me = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let (ign, blk) = (sig_line(&me, "SigIgn"), sig_line(&me, "SigBlk"));
    for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP] {
        assert!(
            signals(ign).contains(&(sig as u32)),
            "the test ignores {sig}"
        );
    }
    for sig in [libc::SIGUSR1, libc::SIGTERM] {
        assert!(
            signals(blk).contains(&(sig as u32)),
            "the test blocks {sig}"
        );
    }
    let status = status.replace('\r', "");
    for key in ["SigIgn", "SigBlk"] {
        let set = sig_line(&status, key);
        assert_eq!(set, 0, "{what}: {key} has signals {:?}", signals(set));
    }
}

/// Host pids whose command line is exactly `argv`.
fn host_procs(argv: &[&str]) -> Vec<i32> {
    let want = argv.join("\0") + "\0";
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want.as_bytes())
        })
        .collect()
}

#[tokio::test]
async fn a_background_process_outlives_execs_and_dies_with_the_sandbox() {
    require_host!();
    let sb = create(Language::Shell).await;
    // A duration no other test uses, to find it on the host.
    let argv = ["sleep", "1000.0417"];
    let p = sb.spawn(ExecRequest::argv(argv)).await.unwrap();
    for i in 0..3 {
        assert_eq!(
            sh_ok(sb.as_ref(), &format!("echo {i}")).await,
            format!("{i}\n")
        );
    }
    let list = sb.processes().await.unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!((list[0].id, list[0].state), (p.id(), ProcessState::Running));
    assert_eq!(list[0].command, "sleep 1000.0417");
    assert_eq!(host_procs(&argv).len(), 1, "the sleep runs on the host");
    drop(p); // dropping the handle does not stop it
    assert_eq!(host_procs(&argv).len(), 1);
    sb.destroy().await.unwrap();
    let mut left = host_procs(&argv);
    for _ in 0..200 {
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        left = host_procs(&argv);
    }
    assert!(left.is_empty(), "left running after destroy: {left:?}");
    let e = sb.spawn(ExecRequest::argv(["true"])).await.unwrap_err();
    assert!(matches!(e, Error::SandboxGone { .. }), "{e}");
    assert!(matches!(
        sb.processes().await,
        Err(Error::SandboxGone { .. })
    ));
}

#[tokio::test]
async fn stdin_and_output_flow_while_it_runs() {
    require_host!();
    let sb = create(Language::Shell).await;
    let mut p = sb
        .spawn(
            ExecRequest::argv([
                "/bin/sh",
                "-c",
                "while read l; do echo got:$l; echo err:$l >&2; done; exit 4",
            ])
            .stdin(b"first\n".to_vec()),
        )
        .await
        .unwrap();
    let mut out = String::new();
    let mut err = String::new();
    p.write_stdin(&b"second\n"[..]).await.unwrap();
    while !(out.contains("got:second") && err.contains("err:second")) {
        match p.next().await.unwrap().unwrap() {
            ExecEvent::Stdout(b) => out.push_str(&String::from_utf8_lossy(&b)),
            ExecEvent::Stderr(b) => err.push_str(&String::from_utf8_lossy(&b)),
            ExecEvent::Exit(r) => panic!("exited early: {r:?}"),
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert_eq!(
        out, "got:first\ngot:second\n",
        "the request's stdin came first"
    );
    p.close_stdin().await.unwrap();
    let r = p.wait(Some(Duration::from_secs(30))).await.unwrap();
    assert_eq!(r.exit_code, Some(4), "{r:?}");
    let e = p.write_stdin(&b"late\n"[..]).await.unwrap_err();
    assert!(matches!(e, Error::ProcessExited { .. }), "{e}");
    let e = p.signal(Signal::Terminate).await.unwrap_err();
    assert!(matches!(e, Error::ProcessExited { .. }), "{e}");
    let e = sb.signal(p.id(), Signal::Kill).await.unwrap_err();
    assert!(matches!(e, Error::ProcessExited { .. }), "{e}");
    let e = sb.signal(999, Signal::Kill).await.unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
    let list = sb.processes().await.unwrap();
    assert_eq!(list[0].state, ProcessState::Exited { exit_code: Some(4) });
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn signals_reach_the_process_group() {
    require_host!();
    let sb = create(Language::Shell).await;
    // Though this process ignores SIGINT and SIGQUIT and blocks others (see
    // `LIKE_A_BACKGROUND_JOB`), an exec and a background process ignore and block nothing.
    let grep = ["grep", "^Sig", "/proc/self/status"];
    let r = sb.exec(ExecRequest::argv(grep)).await.unwrap();
    assert_default_signals(&r.stdout_str(), "an exec");
    let r = sb
        .spawn(ExecRequest::argv(grep))
        .await
        .unwrap()
        .wait(Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_default_signals(&r.stdout_str(), "a background process");
    // So a shell's trap of SIGINT is set (a signal ignored when a non-interactive shell
    // starts cannot be trapped) and SIGINT reaches it.
    let mut p = sb
        .spawn(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "trap 'echo caught; exit 7' INT; echo ready; while :; do sleep 0.05; done",
        ]))
        .await
        .unwrap();
    match p.next().await.unwrap().unwrap() {
        ExecEvent::Stdout(b) => assert_eq!(&b[..], b"ready\n"),
        other => panic!("expected ready, got {other:?}"),
    }
    let e = p.wait(Some(Duration::from_millis(50))).await.unwrap_err();
    assert!(
        matches!(e, Error::Timeout { .. }),
        "a running process times out: {e}"
    );
    sb.signal(p.id(), Signal::Interrupt).await.unwrap();
    let r = p.wait(Some(Duration::from_secs(30))).await.unwrap();
    assert_eq!(
        (r.exit_code, r.stdout_str().as_str()),
        (Some(7), "caught\n"),
        "{r:?}"
    );

    // KILL cannot be caught; the exit code says which signal.
    let mut q = sb
        .spawn(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "trap '' TERM INT; sleep 1000",
        ]))
        .await
        .unwrap();
    q.signal(Signal::Kill).await.unwrap();
    let r = q.wait(Some(Duration::from_secs(30))).await.unwrap();
    assert_eq!(r.exit_code, Some(128 + 9), "{r:?}");
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn a_flood_nobody_reads_is_held_back_not_buffered() {
    require_host!();
    let spec = SandboxSpec::builder(Language::Shell)
        .output_bytes(64 * 1024)
        .build()
        .unwrap();
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    // 256 MiB: far more than the queue (64 chunks) and the pipe hold.
    let mut p = sb
        .spawn(ExecRequest::argv([
            "dd",
            "if=/dev/zero",
            "bs=1M",
            "count=256",
            "status=none",
        ]))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let list = sb.processes().await.unwrap();
    assert_eq!(
        list[0].state,
        ProcessState::Running,
        "it waits for a reader"
    );
    // Waiting reads it all, keeping only the cap.
    let r = p.wait(Some(Duration::from_secs(120))).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert_eq!(r.stdout.len(), 64 * 1024);
    assert!(r.truncated);
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn secrets_are_redacted_in_process_output_and_streams() {
    require_host!();
    let source = MapSecretSource::new().with("tok", "s3cr3t-interactive-99");
    let spec = SandboxSpec::builder(Language::Shell)
        .secret_env("tok", "TOKEN")
        .build()
        .unwrap();
    let secrets = ResolvedSecrets::resolve(&spec.secrets, &source).unwrap();
    let sb = backend().create(&spec, secrets).await.unwrap();
    // Split across two writes, as a chunk boundary would.
    let script = "printf %s \"${TOKEN%??}\"; sleep 0.2; printf '%s\\n' \"${TOKEN#${TOKEN%??}}\"; echo \"$TOKEN\" >&2";
    let mut p = sb
        .spawn(ExecRequest::argv(["/bin/sh", "-c", script]))
        .await
        .unwrap();
    let r = p.wait(Some(Duration::from_secs(30))).await.unwrap();
    let (out, err) = (r.stdout_str(), r.stderr_str());
    assert!(
        !out.contains("s3cr3t") && !err.contains("s3cr3t"),
        "{out} {err}"
    );
    assert_eq!(out, "[REDACTED:tok]\n");
    assert_eq!(err, "[REDACTED:tok]\n");
    let mut s = sb
        .exec_stream(ExecRequest::argv(["/bin/sh", "-c", script]))
        .await
        .unwrap();
    let mut streamed = Vec::new();
    while let Some(ev) = s.next().await {
        match ev.unwrap() {
            ExecEvent::Stdout(b) | ExecEvent::Stderr(b) => streamed.extend_from_slice(&b),
            _ => {}
        }
    }
    let streamed = String::from_utf8_lossy(&streamed);
    assert!(!streamed.contains("s3cr3t"), "streamed: {streamed}");
    assert!(streamed.contains("[REDACTED:tok]"), "streamed: {streamed}");
    sb.destroy().await.unwrap();
}

/// The host's own global IPv4 addresses (`ip -o -4 addr show scope global`).
fn host_addrs() -> Vec<std::net::Ipv4Addr> {
    let out = std::process::Command::new("ip")
        .args(["-o", "-4", "addr", "show", "scope", "global"])
        .output()
        .unwrap();
    let addrs: Vec<std::net::Ipv4Addr> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            w.find(|t| *t == "inet")?;
            w.next()?.split('/').next()?.parse().ok()
        })
        .collect();
    assert!(
        !addrs.is_empty(),
        "this host has no global IPv4 address to test against"
    );
    addrs
}

// Multi-threaded: curl runs as a blocking child while the forwarder serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_web_server_answers_the_host_under_deny_all() {
    require_host!();
    let sb = create(Language::Shell).await; // DenyAll: the default
    sh_ok(
        sb.as_ref(),
        "mkdir -p /workspace/site && echo hello-from-inside > /workspace/site/index.html",
    )
    .await;
    let mut server = sb
        .spawn(ExecRequest::argv([
            "python3",
            "-m",
            "http.server",
            "8000",
            "--bind",
            "127.0.0.1",
            "--directory",
            "/workspace/site",
        ]))
        .await
        .unwrap();
    let at = sb
        .publish(8000, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    assert!(at.ip().is_loopback() && at.port() != 0, "{at}");
    assert_eq!(sb.published().await.unwrap()[0].sandbox_port, 8000);
    // The server needs a moment to listen: curl retries refused connections.
    let url = format!("http://{at}/index.html");
    let (mut body, mut why) = (String::new(), String::new());
    for _ in 0..20 {
        let out = std::process::Command::new("curl")
            .args(["-sS", "--max-time", "10", &url])
            .output()
            .unwrap();
        body = String::from_utf8_lossy(&out.stdout).into_owned();
        why = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.success() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(body, "hello-from-inside\n", "curl: {why}");

    // The sandbox itself still cannot connect out: no route to any host address.
    let host = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = host.local_addr().unwrap().port();
    for ip in host_addrs() {
        let r = sb
            .exec(ExecRequest::argv([
                "python3",
                "-c",
                &format!("import socket; socket.create_connection(('{ip}', {port}), timeout=3)"),
            ]))
            .await
            .unwrap();
        assert!(!r.success(), "the sandbox reached {ip}:{port}: {r:?}");
    }

    // Bad input: each a clear error.
    let twice = sb.publish(8000, at).await.unwrap_err();
    assert!(twice.to_string().contains("already published"), "{twice}");
    let zero = sb
        .publish(0, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap_err();
    assert!(matches!(zero, Error::InvalidSpec { .. }), "{zero}");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let in_use = sb
        .publish(8000, busy.local_addr().unwrap())
        .await
        .unwrap_err();
    assert!(
        in_use.to_string().contains("in use") || in_use.to_string().contains("listens"),
        "{in_use}"
    );

    sb.unpublish(at).await.unwrap();
    assert!(matches!(
        sb.unpublish(at).await,
        Err(Error::NotFound { .. })
    ));
    server.signal(Signal::Terminate).await.unwrap();
    let r = server.wait(Some(Duration::from_secs(30))).await.unwrap();
    assert!(!r.success(), "the server was stopped: {r:?}");

    // Published again, then destroy closes it.
    let again = sb
        .publish(8000, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    sb.destroy().await.unwrap();
    let mut closed = false;
    for _ in 0..100 {
        if std::net::TcpStream::connect(again).is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(closed, "{again} still accepts after destroy");
}

/// Reads `p`'s output until it contains `needle` (60 s at most); returns all of it.
async fn read_until(p: &mut sandbox_core::Process, needle: &str) -> String {
    let mut all = String::new();
    while !all.contains(needle) {
        match tokio::time::timeout(Duration::from_secs(60), p.next()).await {
            Ok(Some(Ok(ExecEvent::Stdout(b) | ExecEvent::Stderr(b)))) => {
                all.push_str(&String::from_utf8_lossy(&b))
            }
            other => panic!("waiting for {needle:?} after {all:?}: {other:?}"),
        }
    }
    all
}

#[tokio::test]
async fn a_terminal_session_resizes_interrupts_and_exits_with_its_code() {
    require_host!();
    let sb = create(Language::Shell).await;
    let mut sh = sb
        .spawn(ExecRequest::argv(["/bin/sh", "-i"]).tty(24, 80))
        .await
        .unwrap();
    sh.write_stdin(&b"stty size; tty\n"[..]).await.unwrap();
    let out = read_until(&mut sh, "/dev/pts/").await;
    assert!(out.contains("24 80"), "{out:?}");
    // Ctrl-C below needs a `sleep` that does not ignore SIGINT, though this process does (see
    // `LIKE_A_BACKGROUND_JOB`): a terminal's process, in its own session, starts with every
    // signal at its default and none blocked.
    let mut grep = sb
        .spawn(ExecRequest::argv(["grep", "^Sig", "/proc/self/status"]).tty(24, 80))
        .await
        .unwrap();
    let status = read_until(&mut grep, "SigCgt").await;
    assert_default_signals(&status, "a terminal's process");
    assert_eq!(
        grep.wait(Some(Duration::from_secs(60)))
            .await
            .unwrap()
            .exit_code,
        Some(0)
    );
    sh.resize(30, 100).await.unwrap();
    sh.write_stdin(&b"stty size\n"[..]).await.unwrap();
    read_until(&mut sh, "30 100").await;
    // Ctrl-C reaches the foreground job through the terminal, not the shell.
    sh.write_stdin(&b"sleep 1000\n"[..]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    sh.write_stdin(&b"\x03echo after-$((6*7))\n"[..])
        .await
        .unwrap();
    read_until(&mut sh, "after-42").await;
    sh.write_stdin(&b"exit 3\n"[..]).await.unwrap();
    let r = sh.wait(Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(r.exit_code, Some(3), "{r:?}");
    let e = sh.resize(10, 10).await.unwrap_err();
    assert!(matches!(e, Error::ProcessExited { .. }), "{e}");

    // A REPL, ended by Ctrl-D.
    let mut py = sb
        .spawn(ExecRequest::argv(["python3", "-q"]).tty(24, 80))
        .await
        .unwrap();
    py.write_stdin(&b"print(6*7)\n"[..]).await.unwrap();
    let out = read_until(&mut py, "42").await;
    // Ctrl-D once the next prompt shows: readline resets the terminal before it prompts,
    // which may drop what was typed ahead (as it would a person's).
    if !out
        .rsplit("42")
        .next()
        .is_some_and(|after| after.contains(">>> "))
    {
        read_until(&mut py, ">>> ").await;
    }
    py.close_stdin().await.unwrap();
    let r = py.wait(Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");

    // Bad input: a terminal without cells, a resize without a terminal, a terminal for exec.
    let e = sb
        .spawn(ExecRequest::argv(["true"]).tty(0, 80))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidSpec { .. }), "{e}");
    let mut plain = sb.spawn(ExecRequest::argv(["sleep", "5"])).await.unwrap();
    let e = plain.resize(24, 80).await.unwrap_err();
    assert!(matches!(e, Error::InvalidSpec { .. }), "{e}");
    plain.signal(Signal::Kill).await.unwrap();
    plain.wait(None).await.unwrap();
    let e = sb
        .exec(ExecRequest::argv(["true"]).tty(24, 80))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    sb.destroy().await.unwrap();
}
