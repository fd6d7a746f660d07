//! Background processes in the gVisor tier: snapshots keep them (in the sandbox and in a
//! restored copy, with a terminal or not), destroy leaves nothing of them, and a terminal
//! session behaves as one. (Stdin, output, signals and listing are the conformance
//! cases `caps.processes` and `process.io-signals`.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use sandbox_core::{
    Backend, Error, ExecEvent, ExecRequest, Language, ObjectSnapshotStore, ProcessState,
    SandboxSpec, Signal, SnapshotStore,
};

/// This test binary starts the way a shell's background job under `nohup` does, whatever
/// started it: `SIGINT`, `SIGQUIT` and `SIGHUP` ignored, `SIGUSR1` and `SIGTERM` blocked. Set
/// before `main` (an `.init_array` constructor), so that every thread inherits the mask and
/// every runsc the tests start, the dispositions. A sandbox must start its processes clean
/// all the same (see `every_process_starts_with_default_signals`).
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
/// text, if it has one.
fn sig_line(status: &str, key: &str) -> Option<u64> {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?;
    u64::from_str_radix(line.trim(), 16).ok()
}

/// The signals (numbers) of a signal set.
fn signals(set: u64) -> Vec<u32> {
    (1..=64).filter(|s| set & (1 << (s - 1)) != 0).collect()
}

/// Though this process ignores `SIGINT`, `SIGQUIT` and `SIGHUP` (see
/// `LIKE_A_BACKGROUND_JOB`), none of the sandbox's processes on the host (runsc's sandbox,
/// its gofer, `runsc exec`: Go keeps an inherited ignored `SIGHUP` or `SIGINT` ignored) ignores
/// any signal, and a shell inside can trap `SIGINT` (the Sentry starts the processes inside
/// with every signal at its default, and its `/proc/self/status` has no signal lines), which
/// the API's `Interrupt` reaches.
#[tokio::test]
async fn every_process_starts_with_default_signals() {
    require_gvisor!();
    let me = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let ign = signals(sig_line(&me, "SigIgn").unwrap());
    assert!(
        [2, 3, 1].iter().all(|s| ign.contains(s)),
        "the test ignores SIGINT, SIGQUIT and SIGHUP: {ign:?}"
    );
    let sb = common::sandbox(&SandboxSpec::new(Language::Shell)).await;
    let mut p = sb
        .spawn(ExecRequest::argv([
            "/bin/sh",
            "-c",
            "trap 'echo caught; exit 7' INT; echo ready; while :; do sleep 0.05; done",
        ]))
        .await
        .unwrap();
    read_until(&mut p, "ready").await;
    let mut seen = 0;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains(sb.id()) {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
            continue; // gone meanwhile
        };
        let ign = sig_line(&status, "SigIgn").unwrap();
        assert_eq!(
            ign,
            0,
            "host process {:?} ignores signals {:?}",
            String::from_utf8_lossy(&cmdline).replace('\0', " "),
            signals(ign)
        );
        seen += 1;
    }
    assert!(seen >= 2, "the sandbox's runsc processes were not found");
    let r = sb
        .exec(ExecRequest::argv([
            "grep",
            "-c",
            "^Sig",
            "/proc/self/status",
        ]))
        .await
        .unwrap();
    assert_eq!(
        r.stdout_str().trim(),
        "0",
        "gVisor shows signal lines now: check them"
    );
    sb.signal(p.id(), Signal::Interrupt).await.unwrap();
    let r = p.wait(Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(
        (r.exit_code, r.stdout_str().as_str()),
        (Some(7), "caught\n"),
        "{r:?}"
    );
    sb.destroy().await.unwrap();
}

/// Counts processes inside whose argv is exactly `sleep 777`.
const COUNT: &str = "n=0; for p in /proc/[0-9]*; do [ \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" = 'sleep 777 ' ] && n=$((n+1)); done; echo $n";

async fn count(sb: &dyn sandbox_core::Sandbox) -> String {
    let r = sb.exec(ExecRequest::code(COUNT)).await.unwrap();
    r.stdout_str().trim().to_string()
}

#[tokio::test]
async fn a_background_process_across_a_snapshot_and_destroy() {
    require_gvisor!();
    let sb = common::sandbox(&SandboxSpec::new(Language::Shell)).await;
    let id = sb.id().to_string();
    // One that talks (numbers the lines it reads), one that sleeps.
    let mut talker = sb
        .spawn(ExecRequest::code(
            "i=0; while read line; do i=$((i+1)); echo \"$i:$line\"; done; echo done; exit 4",
        ))
        .await
        .unwrap();
    let sleeper = sb.spawn(ExecRequest::argv(["sleep", "777"])).await.unwrap();
    talker.write_stdin(&b"a\n"[..]).await.unwrap();
    read_until(&mut talker, "1:a").await;
    let mut n = String::new();
    for _ in 0..100 {
        n = count(sb.as_ref()).await;
        if n == "1" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(n, "1", "the sleep runs inside");

    // A snapshot keeps them: they go on in the sandbox, their handles work on.
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let snap = sb.snapshot(&store).await.unwrap();
    talker.write_stdin(&b"b\n"[..]).await.unwrap();
    let out = read_until(&mut talker, "2:b").await;
    assert!(!out.contains("1:a"), "nothing repeated: {out:?}");
    assert_eq!(count(sb.as_ref()).await, "1");
    let m = store.manifest(&snap).await.unwrap();
    assert!(m.metadata["processes"].contains("sleep 777"), "{m:?}");

    // A copy restored from the snapshot has them too: listed, running, signalable.
    let copy = common::backend()
        .restore(&store, &snap, sandbox_core::ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(count(copy.as_ref()).await, "1", "the copy's sleep");
    let listed = copy.processes().await.unwrap();
    let copied = listed
        .iter()
        .find(|p| p.command == "sleep 777")
        .unwrap_or_else(|| panic!("{listed:?}"));
    assert_eq!(copied.state, ProcessState::Running);
    copy.signal(copied.id, Signal::Terminate).await.unwrap();
    let mut ended = None;
    for _ in 0..200 {
        let l = copy.processes().await.unwrap();
        ended = l
            .iter()
            .find(|p| p.id == copied.id)
            .map(|p| p.state)
            .filter(|s| *s != ProcessState::Running);
        if ended.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        ended,
        Some(ProcessState::Exited {
            exit_code: Some(128 + 15)
        })
    );
    assert_eq!(count(copy.as_ref()).await, "0");
    copy.destroy().await.unwrap();
    // The original's are untouched by the copy's.
    assert_eq!(count(sb.as_ref()).await, "1");
    talker.close_stdin().await.unwrap();
    read_until(&mut talker, "done").await;
    let r = talker.wait(Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(r.exit_code, Some(4), "{r:?}");
    sb.signal(sleeper.id(), Signal::Terminate).await.unwrap();

    // A process with a terminal is kept too: its terminal is the keeper's, inside.
    let mut sh = sb
        .spawn(ExecRequest::argv(["/bin/sh"]).tty(24, 80))
        .await
        .unwrap();
    sh.write_stdin(&b"x=$((6*7))\n"[..]).await.unwrap();
    sb.snapshot(&store).await.unwrap();
    sh.resize(30, 100).await.unwrap();
    sh.write_stdin(&b"stty size; echo still-$x\n"[..])
        .await
        .unwrap();
    let out = read_until(&mut sh, "still-42").await;
    assert!(out.contains("30 100"), "{out:?}");
    sh.write_stdin(&b"exit 0\n"[..]).await.unwrap();
    let r = sh.wait(Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(count(sb.as_ref()).await, "0");

    let mut q = sb.spawn(ExecRequest::argv(["sleep", "777"])).await.unwrap();
    sb.destroy().await.unwrap();
    // Whatever it (or runsc) wrote, then the end: the sandbox is gone.
    loop {
        match q.next().await {
            Some(Ok(ExecEvent::Stdout(_) | ExecEvent::Stderr(_))) => {}
            Some(Err(Error::SandboxGone { .. })) | Some(Ok(ExecEvent::Exit(_))) => break,
            other => panic!("after destroy: {other:?}"),
        }
    }
    assert!(q.next().await.is_none(), "nothing after the end");
    assert_eq!(common::host_processes_of(&id), 0);
    let e = sb.spawn(ExecRequest::argv(["true"])).await.unwrap_err();
    assert!(matches!(e, Error::SandboxGone { .. }), "{e}");
}

/// Reads `p`'s output until it contains `needle` (60 s at most); returns all of it.
async fn read_until(p: &mut sandbox_core::Process, needle: &str) -> String {
    match read_within(p, needle, Duration::from_secs(60)).await {
        Ok(all) => all,
        Err(why) => panic!("{why}"),
    }
}

/// Reads `p`'s output until it contains `needle`, for at most `wait`: all of it, or why not.
async fn read_within(
    p: &mut sandbox_core::Process,
    needle: &str,
    wait: Duration,
) -> Result<String, String> {
    let mut all = String::new();
    let deadline = tokio::time::Instant::now() + wait;
    while !all.contains(needle) {
        match tokio::time::timeout_at(deadline, p.next()).await {
            Ok(Some(Ok(ExecEvent::Stdout(b) | ExecEvent::Stderr(b)))) => {
                all.push_str(&String::from_utf8_lossy(&b))
            }
            other => return Err(format!("waiting for {needle:?} after {all:?}: {other:?}")),
        }
    }
    Ok(all)
}

#[tokio::test]
async fn a_terminal_session_resizes_interrupts_and_exits_with_its_code() {
    require_gvisor!();
    let sb = common::sandbox(&SandboxSpec::new(Language::Shell)).await;
    let mut sh = sb
        .spawn(ExecRequest::argv(["/bin/sh", "-i"]).tty(24, 80))
        .await
        .unwrap();
    // A terminal of the sandbox's own (the keeper's, in /dev/pts): isatty, its name, its
    // size, its line discipline.
    sh.write_stdin(
        &b"stty size; tty; python3 -c 'import os; print(\"isatty\", os.isatty(0))'\n"[..],
    )
    .await
    .unwrap();
    let out = read_until(&mut sh, "isatty True").await;
    assert!(out.contains("24 80"), "{out:?}");
    assert!(out.contains("/dev/pts/"), "{out:?}");
    sh.resize(30, 100).await.unwrap();
    sh.write_stdin(&b"stty size\n"[..]).await.unwrap();
    read_until(&mut sh, "30 100").await;
    // Ctrl-C reaches the foreground job through the terminal, not the shell.
    sh.write_stdin(&b"sleep 1000\n"[..]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
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
    // Ctrl-C interrupts what runs in it (the REPL is its session's foreground group): typed
    // once the REPL waits for the rest of a statement (a Ctrl-C that lands while readline
    // sets the terminal up between prompts can be lost, as a person's would: pressed again
    // then, at most three times).
    read_until(&mut py, ">>> ").await;
    py.write_stdin(&b"while True: pass\n"[..]).await.unwrap();
    read_until(&mut py, "... ").await;
    let mut interrupted = Err(String::new());
    for _ in 0..3 {
        py.write_stdin(&b"\x03"[..]).await.unwrap();
        interrupted = read_within(&mut py, "KeyboardInterrupt", Duration::from_secs(10)).await;
        if interrupted.is_ok() {
            break;
        }
    }
    if let Err(why) = interrupted {
        panic!("Ctrl-C pressed three times: {why}");
    }
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

    // A program that does not exist: a process that says so and exits 127, as an exec.
    let mut missing = sb
        .spawn(ExecRequest::argv(["no-such-program-here"]))
        .await
        .unwrap();
    let r = missing.wait(Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(r.exit_code, Some(127), "{r:?}");
    assert!(
        r.stderr_str().contains("no-such-program-here"),
        "{:?}",
        r.stderr_str()
    );

    // A resize without a terminal is bad input; exec has no terminal.
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

/// `curl URL` until it answers (the server needs a moment to listen): its body, or why not.
async fn fetch(url: &str) -> Result<Vec<u8>, String> {
    let mut why = String::new();
    for _ in 0..50 {
        let out = std::process::Command::new("curl")
            .args(["-sS", "--max-time", "20", url])
            .output()
            .unwrap();
        if out.status.success() {
            return Ok(out.stdout);
        }
        why = String::from_utf8_lossy(&out.stderr).into_owned();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(why)
}

// Multi-threaded: curl runs as a blocking child while the forwarder serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_web_server_answers_the_host_under_deny_all() {
    require_gvisor!();
    let sb = common::sandbox(&SandboxSpec::new(Language::Shell)).await; // DenyAll
    let r = sb
        .exec(ExecRequest::code(
            "mkdir -p /workspace/site && echo hello-from-inside > /workspace/site/index.html \
             && head -c 1048576 /dev/urandom > /workspace/site/big && sha256sum /workspace/site/big",
        ))
        .await
        .unwrap();
    assert!(r.success(), "{r:?}");
    let big_sum = r
        .stdout_str()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    let at = sb
        .publish(8000, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    assert!(at.ip().is_loopback() && at.port() != 0, "{at}");
    assert_eq!(sb.published().await.unwrap()[0].sandbox_port, 8000);

    // Nothing listens inside yet: the connection is closed, nothing is sent.
    let mut early = tokio::net::TcpStream::connect(at).await.unwrap();
    let mut got = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut early, &mut got)
        .await
        .unwrap_or_default();
    assert!(got.is_empty(), "{got:?}");

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
    let body = fetch(&format!("http://{at}/index.html")).await.unwrap();
    assert_eq!(body, b"hello-from-inside\n");
    // A whole MiB through the relay, byte for byte.
    let big = fetch(&format!("http://{at}/big")).await.unwrap();
    use sha2::Digest;
    assert_eq!(hex::encode(sha2::Sha256::digest(&big)), big_sum);

    // The sandbox itself still cannot connect out: the host's loopback is not its own.
    let host = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = host.local_addr().unwrap().port();
    let r = sb
        .exec(ExecRequest::argv([
            "python3",
            "-c",
            &format!("import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)"),
        ]))
        .await
        .unwrap();
    assert!(!r.success(), "the sandbox reached the host: {r:?}");

    // An open connection holds its relay: a snapshot is refused until it closes.
    let mut open = tokio::net::TcpStream::connect(at).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut open, b"GET /index.html HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    tokio::io::AsyncReadExt::read_exact(&mut open, &mut head)
        .await
        .unwrap();
    assert_eq!(&head, b"HTTP/1.0 200");
    server.signal(Signal::Terminate).await.unwrap();
    server.wait(Some(Duration::from_secs(30))).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    drop(open);
    // Closed: the relay goes (asynchronously), then the snapshot is taken.
    let mut taken = None;
    for _ in 0..100 {
        match sb.snapshot(&store).await {
            Ok(id) => {
                taken = Some(id);
                break;
            }
            Err(Error::Unsupported { what, .. }) if what.contains("published ports") => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("snapshot: {e}"),
        }
    }
    assert!(taken.is_some(), "the relay outlived its connection");

    // Bad input: each a clear error.
    let twice = sb.publish(8000, at).await.unwrap_err();
    assert!(twice.to_string().contains("already published"), "{twice}");
    let zero = sb
        .publish(0, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap_err();
    assert!(matches!(zero, Error::InvalidSpec { .. }), "{zero}");
    sb.unpublish(at).await.unwrap();
    assert!(matches!(
        sb.unpublish(at).await,
        Err(Error::NotFound { .. })
    ));

    // Published again, then destroy closes it.
    let again = sb
        .publish(8000, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let id = sb.id().to_string();
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
    assert_eq!(common::host_processes_of(&id), 0);
}
