//! The local daemon as users run it: `agent-sandbox serve --local` in the background, and
//! `agent-sandbox run` beside it, on the container tier (skipped, saying why, where the
//! probe says it cannot run). Each test's daemon listens on a socket of its own
//! (`AGENT_SANDBOX_DAEMON_SOCKET`), never on the user's.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod served;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use served::container_available;

const BIN: &str = env!("CARGO_BIN_EXE_agent-sandbox");

/// A `serve --local` process.
struct Daemon {
    child: Child,
    sock: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `serve --local` with its socket at `sock` and its state in `state`, once it listens.
fn daemon(sock: &Path, state: &Path) -> Daemon {
    daemon_with(sock, state, &[])
}

/// The same, with extra arguments.
fn daemon_with(sock: &Path, state: &Path, args: &[&str]) -> Daemon {
    let mut child = Command::new(BIN)
        .args(["serve", "--local", "--state-dir"])
        .arg(state)
        .args(args)
        .env("AGENT_SANDBOX_DAEMON_SOCKET", sock)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    served::await_line(&mut child, "serve --local", |line| {
        line.contains("listening on unix:").then_some(())
    });
    Daemon {
        child,
        sock: sock.to_path_buf(),
    }
}

/// `bin run --json ARGS` with the daemon's socket at `sock`, in `cwd`: (exit code, output).
fn run_with(
    bin: &str,
    sock: &Path,
    cwd: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (i32, serde_json::Value) {
    let out = Command::new(bin)
        .args(["run", "--json"])
        .args(args)
        .env("AGENT_SANDBOX_DAEMON_SOCKET", sock)
        .envs(env.iter().copied())
        .current_dir(cwd)
        .output()
        .unwrap();
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "run {args:?}: no JSON: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), v)
}

/// Polls `cond` for up to 30 s (a check, never a timing).
fn wait_until(mut cond: impl FnMut() -> bool, what: &str) {
    for _ in 0..300 {
        if cond() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("waited 30 s for {what}");
}

/// Runs `true` with `bin` beside the daemon socket `sock` and checks that it ran in-process.
fn runs_in_process(bin: &str, sock: &Path, cwd: &Path) {
    let (code, v) = run_with(bin, sock, cwd, &["--tier", "container", "--", "true"], &[]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["via"], "in-process", "{v}");
}

/// Whether the container tier cannot run here (the probe's word): the test is skipped,
/// saying why.
fn skipped() -> bool {
    match container_available() {
        Some(why) => {
            eprintln!("SKIP: the container tier is not available here: {why}");
            true
        }
        None => false,
    }
}

fn run(d: &Daemon, cwd: &Path, args: &[&str]) -> (i32, serde_json::Value) {
    run_with(BIN, &d.sock, cwd, args, &[])
}

/// A run whose output, exit code and identity are compared through the daemon and without.
const HI: &[&str] = &[
    "--tier",
    "container",
    "--",
    "sh",
    "-c",
    "echo hi; id -u; exit 3",
];

#[test]
fn run_goes_through_the_daemon_and_works_in_process_without_it() {
    if skipped() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let d = daemon(
        &t.path().join("d").join("daemon.sock"),
        &t.path().join("state"),
    );
    let mode = std::fs::metadata(t.path().join("d")).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o700, "the socket's directory is open to others");

    // Through the daemon, several times (the later ones from its warm pool): the same
    // results as in-process.
    for round in 0..4 {
        let (code, v) = run(&d, t.path(), HI);
        assert_eq!(code, 3, "round {round}: {v}");
        assert_eq!(v["via"], "daemon", "round {round}: {v}");
        assert_eq!(v["stdout"], "hi\n1000\n", "round {round}: {v}");
        assert_eq!(v["tier"], "container");
    }
    let (code, here) = run(&d, t.path(), &[&["--no-daemon"], HI].concat());
    assert_eq!(
        (code, &here["via"]),
        (3, &serde_json::json!("in-process")),
        "{here}"
    );
    assert_eq!(here["stdout"], "hi\n1000\n");
    let (_, v) = run_with(
        BIN,
        &d.sock,
        t.path(),
        &["--tier", "container", "--", "true"],
        &[("AGENT_SANDBOX_NO_DAEMON", "1")],
    );
    assert_eq!(v["via"], "in-process", "{v}");

    // The selector's choice is the same through the daemon as in-process.
    let (_, auto) = run(&d, t.path(), &["--", "sh", "-c", "echo auto"]);
    let (_, auto_here) = run(
        &d,
        t.path(),
        &["--no-daemon", "--", "sh", "-c", "echo auto"],
    );
    assert_eq!(auto["via"], "daemon", "{auto}");
    assert_eq!(auto["tier"], auto_here["tier"], "{auto} / {auto_here}");
    assert_eq!(auto["stdout"], "auto\n");

    // A relative workspace is the caller's directory, not the daemon's; what the command
    // writes belongs to the caller.
    std::fs::create_dir(t.path().join("ws")).unwrap();
    let (code, v) = run(
        &d,
        t.path(),
        &[
            "--tier",
            "container",
            "--workspace",
            "ws",
            "--",
            "sh",
            "-c",
            "echo x > /workspace/f",
        ],
    );
    assert_eq!((code, &v["via"]), (0, &serde_json::json!("daemon")), "{v}");
    let f = t.path().join("ws/f");
    assert_eq!(std::fs::read_to_string(&f).unwrap(), "x\n");
    // SAFETY: geteuid has no preconditions.
    assert_eq!(std::fs::metadata(&f).unwrap().uid(), unsafe {
        libc::geteuid()
    });

    // Another build of the CLI (a copy: another executable) does not use this daemon.
    let copy = t.path().join("agent-sandbox-copy");
    std::fs::copy(BIN, &copy).unwrap();
    runs_in_process(copy.to_str().unwrap(), &d.sock, t.path());

    // One daemon per socket: a second one refuses and leaves the first serving.
    let second = Command::new(BIN)
        .args(["serve", "--local", "--state-dir"])
        .arg(t.path().join("state2"))
        .env("AGENT_SANDBOX_DAEMON_SOCKET", &d.sock)
        .output()
        .unwrap();
    assert_eq!(second.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("already listens"),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let (_, v) = run(&d, t.path(), &["--tier", "container", "--", "true"]);
    assert_eq!(v["via"], "daemon", "{v}");

    // A run killed while its command runs takes the command with it.
    // The command's name is made inside, so that only the sandbox's process bears it.
    let pid = std::process::id();
    let marker = format!("zz{pid}x");
    let mut client = Command::new(BIN)
        .args(["run", "--tier", "container", "--", "sh", "-c"])
        .arg(format!(
            "cp /bin/sleep /tmp/zz$(({pid}+0))x && exec /tmp/zz$(({pid}+0))x 1000"
        ))
        .env("AGENT_SANDBOX_DAEMON_SOCKET", &d.sock)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let running = |m: &str| {
        let out = Command::new("pgrep").args(["-f", m]).output().unwrap();
        !out.stdout.is_empty()
    };
    wait_until(|| running(&marker), "the command to start");
    client.kill().unwrap();
    client.wait().unwrap();
    wait_until(|| !running(&marker), "the killed run's command to go");

    // A daemon killed outright leaves its socket behind: runs work in-process.
    let sock = d.sock.clone();
    drop(d);
    assert!(
        sock.exists(),
        "SIGKILL removed the socket (the case is not tested)"
    );
    runs_in_process(BIN, &sock, t.path());
}

#[test]
fn a_socket_others_may_reach_is_neither_served_nor_used() {
    if skipped() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let open = t.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--local", "--state-dir"])
        .arg(t.path().join("state"))
        .env("AGENT_SANDBOX_DAEMON_SOCKET", open.join("daemon.sock"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("0700"), "{err}");
    assert!(!open.join("daemon.sock").exists(), "it listened anyway");

    // A daemon whose directory was opened afterwards is not used.
    let d = daemon(
        &t.path().join("d").join("daemon.sock"),
        &t.path().join("state"),
    );
    std::fs::set_permissions(t.path().join("d"), std::fs::Permissions::from_mode(0o755)).unwrap();
    runs_in_process(BIN, &d.sock, t.path());
}

/// `curl` on the daemon's socket: (HTTP status, body).
fn curl(sock: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, serde_json::Value) {
    let mut c = Command::new("curl");
    c.args([
        "-sS",
        "--max-time",
        "60",
        "-w",
        "\n%{http_code}",
        "-X",
        method,
    ])
    .arg("--unix-socket")
    .arg(sock);
    if let Some(b) = body {
        c.args(["-H", "Content-Type: application/json", "--data-binary", b]);
    }
    let out = c.arg(format!("http://localhost{path}")).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap();
    let v = serde_json::from_str(body).unwrap_or(serde_json::Value::String(body.into()));
    (code.trim().parse().unwrap(), v)
}

#[test]
fn an_idle_exit_waits_for_the_sandboxes_it_holds() {
    if skipped() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let mut d = daemon_with(
        &t.path().join("d").join("daemon.sock"),
        &t.path().join("state"),
        &["--idle-exit", "1"],
    );
    let (code, v) = run(&d, t.path(), &["--tier", "container", "--", "true"]);
    assert_eq!((code, &v["via"]), (0, &serde_json::json!("daemon")), "{v}");
    // A sandbox held through the API keeps it serving, however long it idles.
    let (code, info) = curl(
        &d.sock,
        "POST",
        "/v1/sandboxes",
        Some(r#"{"spec": {"language": "shell"}, "tier": "container"}"#),
    );
    assert_eq!(code, 201, "{info}");
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert!(
        d.child.try_wait().unwrap().is_none(),
        "it stopped while holding a sandbox"
    );
    let id = info["id"].as_str().unwrap();
    let (code, _) = curl(&d.sock, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(code, 204);
    // Then, idle, it stops as on SIGTERM: exit 0, its socket gone.
    wait_until(
        || d.child.try_wait().unwrap().is_some(),
        "the idle daemon to stop",
    );
    assert!(d.child.wait().unwrap().success());
    assert!(!d.sock.exists(), "the socket outlived the daemon");
}

/// The daemons (`serve --local`) whose socket is `sock`: their pids, from the environment
/// each was started with.
fn daemons_on(sock: &Path) -> Vec<u32> {
    let want = format!("AGENT_SANDBOX_DAEMON_SOCKET={}", sock.display());
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let environ = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let has = |hay: &[u8], needle: &[u8]| hay.split(|b| *b == 0).any(|w| w == needle);
        if has(&cmdline, b"serve") && has(&cmdline, b"--local") && has(&environ, want.as_bytes()) {
            pids.push(pid);
        }
    }
    pids
}

/// Stops the daemons on a socket when dropped (the test's own, whatever happened).
struct StopDaemons(PathBuf);

impl Drop for StopDaemons {
    fn drop(&mut self) {
        for pid in daemons_on(&self.0) {
            // SAFETY: kill has no memory preconditions; the pid is a daemon of this test's.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
    }
}

#[test]
fn run_starts_the_daemon_when_asked_and_exactly_one() {
    if skipped() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let sock = t.path().join("d").join("daemon.sock");
    let _stop = StopDaemons(sock.clone());
    let state = t.path().join("state");
    let env: &[(&str, &str)] = &[
        ("AGENT_SANDBOX_DAEMON", "auto"),
        ("XDG_STATE_HOME", state.to_str().unwrap()),
    ];
    let true_ = &["--tier", "container", "--", "true"];
    let live = |s: &Path| std::os::unix::net::UnixStream::connect(s).is_ok();

    // Without the variable, nothing is started.
    runs_in_process(BIN, &sock, t.path());
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(daemons_on(&sock).is_empty(), "a daemon started unasked");

    // With it: this run in-process, the daemon started beside it; the next runs use it.
    // The run inherits a pipe of its caller's as descriptor 100 (as an agent CLI's capture
    // may be passed): the pipe must close when the run exits, not when the daemon does.
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors were just made and belong to nothing else.
    let (r, w) = unsafe {
        use std::os::fd::FromRawFd;
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        )
    };
    let mut first = Command::new(BIN);
    first
        .args(["run", "--json"])
        .args(true_)
        .env("AGENT_SANDBOX_DAEMON_SOCKET", &sock)
        .envs(env.iter().copied())
        .current_dir(t.path());
    let w_fd = std::os::fd::AsRawFd::as_raw_fd(&w);
    // SAFETY: dup2, signal and sigprocmask are async-signal-safe; the child gets the pipe as
    // 100, not close-on-exec, and starts as a background job under `nohup` would: SIGINT,
    // SIGQUIT and SIGHUP ignored, SIGUSR1 and SIGTERM blocked. The daemon must not inherit
    // that (checked below).
    unsafe {
        use std::os::unix::process::CommandExt;
        first.pre_exec(move || {
            if libc::dup2(w_fd, 100) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_IGN);
            }
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for sig in [libc::SIGUSR1, libc::SIGTERM] {
                libc::sigaddset(&mut set, sig);
            }
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    let out = first.output().unwrap();
    drop(w);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (out.status.code(), &v["via"]),
        (Some(0), &serde_json::json!("in-process")),
        "{v}"
    );
    wait_until(|| live(&sock), "the started daemon to listen");
    let (eof_tx, eof) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut r = r;
        let _ = std::io::Read::read_to_end(&mut r, &mut Vec::new());
        let _ = eof_tx.send(());
    });
    assert!(
        eof.recv_timeout(std::time::Duration::from_secs(30)).is_ok(),
        "the daemon holds the run's caller's pipe open"
    );
    assert!(live(&sock), "the daemon stopped");
    let pids = daemons_on(&sock);
    assert_eq!(pids.len(), 1, "{pids:?}");
    // The daemon starts with every signal at its default and none blocked, though its
    // starter ignored and blocked some: it ignores only the SIGPIPE that the Rust runtime
    // ignores in every program (and catches what it handles).
    let status = std::fs::read_to_string(format!("/proc/{}/status", pids[0])).unwrap();
    let set = |key: &str| -> Vec<u32> {
        let v = status
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or_else(|| panic!("no {key} in {status}"));
        (1..=64).filter(|s| v & (1 << (s - 1)) != 0).collect()
    };
    assert_eq!(
        set("SigIgn"),
        [libc::SIGPIPE as u32],
        "the daemon ignores these"
    );
    assert_eq!(set("SigBlk"), Vec::<u32>::new(), "the daemon blocks these");
    let lock = std::fs::read_to_string(sock.with_extension("lock")).unwrap();
    assert_eq!(
        lock.trim(),
        pids[0].to_string(),
        "the lock names another pid"
    );
    for _ in 0..2 {
        let (code, v) = run_with(BIN, &sock, t.path(), HI, env);
        assert_eq!((code, &v["via"]), (3, &serde_json::json!("daemon")), "{v}");
        assert_eq!(v["stdout"], "hi\n1000\n");
    }
    let log = sock.with_file_name("daemon.log");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("listening on unix:"), "{text}");
    assert_eq!(std::fs::metadata(&log).unwrap().mode() & 0o777, 0o600);

    // Stopped, it leaves nothing to be mistaken for a live one.
    // SAFETY: kill has no memory preconditions; the pid is this test's daemon.
    unsafe { libc::kill(pids[0] as i32, libc::SIGTERM) };
    wait_until(
        || !sock.exists(),
        "the daemon to stop and remove its socket",
    );
    wait_until(|| daemons_on(&sock).is_empty(), "the daemon to exit");

    // Four runs at once that find none: each in-process, and one daemon serves afterwards
    // (the others that started beside it saw its lock and left).
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let sock = sock.clone();
            let cwd = t.path().to_path_buf();
            let env: Vec<(String, String)> = env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            std::thread::spawn(move || {
                let env: Vec<(&str, &str)> =
                    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                run_with(
                    BIN,
                    &sock,
                    &cwd,
                    &["--tier", "container", "--", "true"],
                    &env,
                )
            })
        })
        .collect();
    for r in runs {
        let (code, v) = r.join().unwrap();
        assert_eq!(code, 0, "{v}");
    }
    wait_until(|| live(&sock), "a started daemon to listen");
    wait_until(
        || daemons_on(&sock).len() == 1,
        "exactly one daemon to stay",
    );
    let (code, v) = run_with(BIN, &sock, t.path(), true_, env);
    assert_eq!((code, &v["via"]), (0, &serde_json::json!("daemon")), "{v}");
}
