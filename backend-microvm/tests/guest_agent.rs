#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The real guest agent binary (the static one the library embeds as `/init`), run on the host
//! in its test mode (`AGENT_CHANNEL_FD`) over a socketpair, driven through
//! `backend_microvm::agent_client`. Also: a hostile "agent" against the client.

mod common;
#[path = "guest_agent/watch.rs"]
mod watch;

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use backend_microvm::agent_client::proto::{self, Request, Response};
use backend_microvm::agent_client::{
    AgentClient, AgentError, EntryKind, ErrorKind, ExecEvent, ExecRequest,
};
use backend_microvm::guest::AGENT_BINARY;

const T: Duration = Duration::from_secs(60);

fn agent_path() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("microvm-agent-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        common::remove_at_exit(dir.clone());
        let p = dir.join("agent");
        let tmp = dir.join("agent.tmp");
        std::fs::write(&tmp, AGENT_BINARY).unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
        p
    })
}

struct Agent {
    child: Child,
    client: AgentClient,
    ws: tempfile::TempDir,
}

fn spawn_raw() -> (Child, UnixStream, tempfile::TempDir) {
    spawn_raw_with(&[])
}

fn spawn_raw_with(env: &[(&str, &str)]) -> (Child, UnixStream, tempfile::TempDir) {
    let ws = tempfile::tempdir().unwrap();
    let (ours, theirs) = UnixStream::pair().unwrap();
    let fd = theirs.as_raw_fd();
    let mut cmd = Command::new(agent_path());
    cmd.env_clear()
        .env("AGENT_CHANNEL_FD", "3")
        .env("AGENT_WORKSPACE", ws.path())
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    // SAFETY: dup2, signal and sigprocmask are async-signal-safe: the channel goes to fd 3
    // without close-on-exec, and the agent starts as a background job under `nohup` would
    // (whatever started this test): `SIGINT`, `SIGQUIT` and `SIGHUP` ignored, `SIGUSR1` and
    // `SIGTERM` blocked. Its commands must start clean all the same (see
    // `commands_start_with_every_signal_at_its_default`).
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            for sig in HOSTILE_IGNORED {
                libc::signal(sig, libc::SIG_IGN);
            }
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for sig in HOSTILE_BLOCKED {
                libc::sigaddset(&mut set, sig);
            }
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop(theirs);
    (child, ours, ws)
}

/// The signals every test's agent starts with ignored (as a background job under `nohup`).
const HOSTILE_IGNORED: [i32; 3] = [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP];
/// And blocked.
const HOSTILE_BLOCKED: [i32; 2] = [libc::SIGUSR1, libc::SIGTERM];

fn spawn() -> Agent {
    let (child, ours, ws) = spawn_raw();
    let client = AgentClient::new(ours).unwrap();
    client.wait_ready(T).unwrap();
    Agent { child, client, ws }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn req(argv: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..ExecRequest::default()
    }
}

/// An image's `User` (`agent.user=` in the guest; `AGENT_USER` in test mode): commands run
/// as it with no supplementary groups, and it owns the workspace and what the agent writes.
#[test]
fn commands_run_as_the_configured_user() {
    use std::os::unix::fs::MetadataExt;
    if !nix_is_root() {
        eprintln!("SKIP: switching users needs root");
        return;
    }
    let (child, ours, ws) = spawn_raw_with(&[("AGENT_USER", "1234:2345")]);
    let client = AgentClient::new(ours).unwrap();
    client.wait_ready(T).unwrap();
    let a = Agent { child, client, ws };
    let c = &a.client;
    let out = c
        .exec(&req(&[
            "sh",
            "-c",
            "id -u; id -g; id -G; touch made-by-command",
        ]))
        .unwrap();
    assert_eq!(
        (out.exit.code, String::from_utf8_lossy(&out.stdout).as_ref()),
        (Some(0), "1234\n2345\n2345\n"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.write_file("sub/dir/note.txt", b"x", 0o644, T).unwrap();
    for p in ["", "made-by-command", "sub", "sub/dir", "sub/dir/note.txt"] {
        let m = std::fs::metadata(a.ws.path().join(p)).unwrap();
        assert_eq!((m.uid(), m.gid()), (1234, 2345), "{p:?}");
    }
    // The user cannot take root back.
    let out = c
        .exec(&req(&[
            "sh",
            "-c",
            "cat /proc/self/status | grep -i '^uid'",
        ]))
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1234\t1234\t1234\t1234"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

fn nix_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn exec_basics() {
    let a = spawn();
    let c = &a.client;
    assert_eq!(c.ping(T).unwrap(), proto::SOURCE_HASH);

    let out = c.exec(&req(&["echo", "hello", "world"])).unwrap();
    assert_eq!(out.stdout, b"hello world\n");
    assert_eq!(out.exit.code, Some(0));
    assert!(out.stderr.is_empty() && !out.truncated && !out.exit.timed_out);

    let out = c.exec(&req(&["false"])).unwrap();
    assert_eq!((out.exit.code, out.exit.signal), (Some(1), None));

    let out = c
        .exec(&req(&["sh", "-c", "echo out; echo err >&2; exit 3"]))
        .unwrap();
    assert_eq!(
        (out.stdout.as_slice(), out.stderr.as_slice(), out.exit.code),
        (&b"out\n"[..], &b"err\n"[..], Some(3))
    );

    let mut r = req(&["cat"]);
    r.stdin = b"from stdin\x00\xff".to_vec();
    let out = c.exec(&r).unwrap();
    assert_eq!(out.stdout, b"from stdin\x00\xff");

    // A command that exits without reading its stdin does not hang the agent.
    let mut r = req(&["true"]);
    r.stdin = vec![b'x'; 3 << 20];
    assert_eq!(c.exec(&r).unwrap().exit.code, Some(0));

    let out = c.exec(&req(&["no-such-command-xyz"])).unwrap();
    assert_eq!(out.exit.code, Some(127));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));

    let out = c.exec(&req(&["sh", "-c", "kill -9 $$"])).unwrap();
    assert_eq!((out.exit.code, out.exit.signal), (None, Some(9)));

    match c.exec(&req(&[])) {
        Err(AgentError::Remote { kind, .. }) => assert_eq!(kind, ErrorKind::Invalid),
        other => panic!("{other:?}"),
    }
}

/// The signals (numbers) of the hexadecimal signal-set line `key` (`SigIgn`...) of a
/// `/proc/.../status` text.
fn sig_line(status: &str, key: &str) -> Vec<i32> {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {key} in {status:?}"));
    let set = u64::from_str_radix(line.trim(), 16).unwrap();
    (1..=64).filter(|s| set & (1 << (s - 1)) != 0).collect()
}

/// Every command starts with every signal at its default and none blocked, though the agent
/// inherited ignored and blocked signals (see `spawn_raw_with`) and ignores `SIGPIPE` itself:
/// an exec, a background process and a terminal's (in a session of its own), as their
/// `/proc/self/status` shows; and a shell's trap of `SIGINT` (which a shell cannot set for a
/// signal ignored when it started) is reached by `Signal`.
#[test]
fn commands_start_with_every_signal_at_its_default() {
    let a = spawn();
    let c = &a.client;
    // The agent itself is as hostile as meant (else this test would prove nothing).
    let me = std::fs::read_to_string(format!("/proc/{}/status", a.child.id())).unwrap();
    let (ign, blk) = (sig_line(&me, "SigIgn"), sig_line(&me, "SigBlk"));
    assert!(
        HOSTILE_IGNORED.iter().all(|s| ign.contains(s)),
        "agent ignores {ign:?}"
    );
    assert!(
        HOSTILE_BLOCKED.iter().all(|s| blk.contains(s)),
        "agent blocks {blk:?}"
    );

    let clean = |what: &str, out: &[u8]| {
        let status = String::from_utf8_lossy(out).replace('\r', "");
        for key in ["SigIgn", "SigBlk"] {
            assert_eq!(sig_line(&status, key), Vec::<i32>::new(), "{what}: {key}");
        }
    };
    let grep = req(&["grep", "^Sig", "/proc/self/status"]);
    let out = c.exec(&grep).unwrap();
    assert_eq!(out.exit.code, Some(0), "{out:?}");
    clean("an exec", &out.stdout);
    for tty in [None, Some((24, 80))] {
        let mut h = c.start_spawn(&grep, tty, 1 << 20).unwrap();
        let mut out = Vec::new();
        loop {
            match h.next_event().unwrap() {
                ExecEvent::Stdout(d) | ExecEvent::Stderr(d) => out.extend_from_slice(&d),
                ExecEvent::Exit(x) => {
                    assert_eq!(x.code, Some(0), "{x:?}");
                    break;
                }
                other => panic!("unexpected event {other:?}"),
            }
        }
        clean(&format!("a background process, terminal {tty:?}"), &out);
    }

    let mut h = c
        .start_spawn(
            &req(&[
                "sh",
                "-c",
                "trap 'echo caught; exit 7' INT; echo ready; while :; do sleep 0.05; done",
            ]),
            None,
            1 << 20,
        )
        .unwrap();
    assert_eq!(
        h.next_event().unwrap(),
        ExecEvent::Stdout(b"ready\n".to_vec())
    );
    c.signal(h.id(), libc::SIGINT, T).unwrap();
    let mut out = Vec::new();
    let exit = loop {
        match h.next_event().unwrap() {
            ExecEvent::Stdout(d) | ExecEvent::Stderr(d) => out.extend_from_slice(&d),
            ExecEvent::Exit(x) => break x,
            other => panic!("unexpected event {other:?}"),
        }
    };
    assert_eq!(
        (exit.code, String::from_utf8_lossy(&out).as_ref()),
        (Some(7), "caught\n"),
        "{exit:?}"
    );
}

#[test]
fn exec_env_is_exactly_what_was_given() {
    let a = spawn();
    let mut r = req(&["env"]);
    r.env = vec![
        ("FOO".into(), "bar baz".into()),
        ("EMPTY".into(), String::new()),
    ];
    let out = a.client.exec(&r).unwrap();
    let mut lines: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "EMPTY=",
            "FOO=bar baz",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        ]
    );
    // A given PATH replaces the default one.
    r.env = vec![("PATH".into(), "/bin:/usr/bin".into())];
    let out = a.client.exec(&r).unwrap();
    assert_eq!(out.stdout, b"PATH=/bin:/usr/bin\n");
}

#[test]
fn exec_cwd_and_files() {
    let a = spawn();
    let c = &a.client;
    c.write_file("sub/dir/f.txt", b"content", 0, T).unwrap();
    let mut r = req(&["cat", "f.txt"]);
    r.cwd = "sub/dir".into();
    assert_eq!(c.exec(&r).unwrap().stdout, b"content");
    let mut r = req(&["pwd"]);
    r.cwd = "/workspace/sub".into();
    let pwd = String::from_utf8(c.exec(&r).unwrap().stdout).unwrap();
    assert_eq!(
        Path::new(pwd.trim()).canonicalize().unwrap(),
        a.ws.path().join("sub").canonicalize().unwrap()
    );
    // Default cwd: the workspace; commands' files are visible to the file API.
    c.exec(&req(&[
        "sh",
        "-c",
        "printf abc > made.txt; mkdir d; ln -s made.txt l",
    ]))
    .unwrap();
    assert_eq!(c.read_file("made.txt", 100, T).unwrap(), b"abc");
    assert_eq!(c.read_file("/workspace/made.txt", 100, T).unwrap(), b"abc");
    let names: Vec<(String, EntryKind, u64)> = c
        .list("", T)
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.kind, e.size))
        .collect();
    assert_eq!(
        names
            .iter()
            .map(|n| (n.0.as_str(), n.1))
            .collect::<Vec<_>>(),
        [
            ("d", EntryKind::Dir),
            ("l", EntryKind::Symlink),
            ("made.txt", EntryKind::File),
            ("sub", EntryKind::Dir)
        ]
    );
    assert_eq!(names[2].2, 3);

    // Modes, append via chunking (bigger than one frame), overwrite.
    let big: Vec<u8> = (0..(3 << 20) + 12345).map(|i| (i % 251) as u8).collect();
    c.write_file("big.bin", &big, 0o600, T).unwrap();
    assert_eq!(c.read_file("big.bin", 1 << 30, T).unwrap(), big);
    let meta = std::fs::metadata(a.ws.path().join("big.bin")).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    c.write_file("big.bin", b"small", 0, T).unwrap();
    assert_eq!(c.read_file("big.bin", 100, T).unwrap(), b"small");
    c.write_file("empty", b"", 0, T).unwrap();
    assert_eq!(c.read_file("empty", 0, T).unwrap(), b"");

    // Errors.
    match c.read_file("big.bin", 3, T) {
        Err(AgentError::Remote { kind, .. }) => assert_eq!(kind, ErrorKind::TooLarge),
        other => panic!("{other:?}"),
    }
    for (p, want) in [
        ("missing", ErrorKind::NotFound),
        ("d", ErrorKind::Invalid),
        ("../outside", ErrorKind::PathEscape),
        ("/etc/passwd", ErrorKind::PathEscape),
    ] {
        match c.read_file(p, 100, T) {
            Err(AgentError::Remote { kind, .. }) => assert_eq!(kind, want, "{p}"),
            other => panic!("{p}: {other:?}"),
        }
    }
    match c.list("missing", T) {
        Err(AgentError::Remote { kind, .. }) => assert_eq!(kind, ErrorKind::NotFound),
        other => panic!("{other:?}"),
    }
}

#[test]
fn file_escapes_are_refused() {
    let a = spawn();
    let c = &a.client;
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"host secret").unwrap();
    std::os::unix::fs::symlink(outside.path(), a.ws.path().join("link")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), a.ws.path().join("flink")).unwrap();
    std::os::unix::fs::symlink("/nonexistent/target", a.ws.path().join("dangling")).unwrap();
    for p in [
        "../x",
        "a/../../x",
        "/workspace/../etc/passwd",
        "/tmp/x",
        "link/secret",
        "flink",
        "link/new",
        "dangling",
    ] {
        for r in [
            c.read_file(p, 100, T).map(|_| ()),
            c.write_file(p, b"pwned", 0, T),
            c.list(p, T).map(|_| ()),
        ] {
            match r {
                Err(AgentError::Remote { kind, .. }) => {
                    assert_eq!(kind, ErrorKind::PathEscape, "{p}")
                }
                other => panic!("{p}: {other:?}"),
            }
        }
    }
    assert_eq!(
        std::fs::read(outside.path().join("secret")).unwrap(),
        b"host secret"
    );
    assert!(!outside.path().join("new").exists());
    assert!(!Path::new("/nonexistent/target").exists());
}

#[test]
fn exec_timeout_kills_the_process_group() {
    let a = spawn();
    let marker = a.ws.path().join("survivor");
    let mut r = req(&[
        "sh",
        "-c",
        // A background grandchild in the same group that would write the marker later.
        "(sleep 3; echo alive > survivor) & echo started; sleep 1000",
    ]);
    r.timeout_ms = 1500;
    let out = a.client.exec(&r).unwrap();
    assert!(out.exit.timed_out);
    assert_eq!((out.exit.code, out.exit.signal), (None, Some(9)));
    // (On a very loaded machine the shell may not have printed yet when killed.)
    assert!(
        out.stdout == b"started\n" || out.stdout.is_empty(),
        "{:?}",
        out.stdout
    );
    // The grandchild was killed with the group: after it would have written, nothing is
    // there. (Waiting on a command that outlives its deadline, not a timing assertion.)
    let out = a.client.exec(&req(&["sleep", "4"])).unwrap();
    assert_eq!(out.exit.code, Some(0));
    assert!(!marker.exists());
}

#[test]
fn large_output_streams_and_is_capped() {
    let a = spawn();
    let c = &a.client;
    let n = 5_000_000usize;
    let mut chunks = 0;
    let out = c
        .exec_with(&req(&["head", "-c", &n.to_string(), "/dev/zero"]), |ev| {
            if let ExecEvent::Stdout(d) = ev {
                assert!(d.len() <= proto::CHUNK);
                chunks += 1;
            }
        })
        .unwrap();
    assert_eq!(out.stdout.len(), n);
    assert!(out.stdout.iter().all(|b| *b == 0));
    assert!(chunks > 1);
    assert!(!out.truncated);

    let mut r = req(&[
        "sh",
        "-c",
        "head -c 100000 /dev/zero; head -c 100000 /dev/zero >&2",
    ]);
    r.max_output = 1000;
    let out = c.exec(&r).unwrap();
    assert_eq!(out.stdout.len() + out.stderr.len(), 1000);
    assert!(out.truncated && out.exit.truncated);
    assert_eq!(out.exit.code, Some(0));
}

#[test]
fn concurrent_execs_and_kill() {
    let a = spawn();
    let c = a.client.clone();
    let slow = std::thread::spawn(move || c.exec(&req(&["sh", "-c", "read line; echo got $line"])));
    // The slow one waits for stdin that never comes... until we kill it via a handle on a
    // second command, while other commands keep working.
    let mut h = a.client.start_exec(&req(&["sleep", "1000"])).unwrap();
    for i in 0..5 {
        let out = a.client.exec(&req(&["echo", &i.to_string()])).unwrap();
        assert_eq!(out.stdout, format!("{i}\n").as_bytes());
    }
    a.client.kill(h.id(), T).unwrap();
    match h.next_event().unwrap() {
        ExecEvent::Exit(x) => assert_eq!(x.signal, Some(9)),
        other => panic!("{other:?}"),
    }
    // The first exec got empty stdin (closed), so `read` failed and it printed "got ".
    let out = slow.join().unwrap().unwrap();
    assert_eq!(out.stdout, b"got\n");
}

/// A `Kill` (or `Signal`) that reaches the agent before the exec's thread has forked is
/// kept and delivered at the fork: never "no such exec" for a request it has.
#[test]
fn a_kill_right_after_the_start_always_lands() {
    let a = spawn();
    for _ in 0..30 {
        let mut h = a.client.start_exec(&req(&["sleep", "1000"])).unwrap();
        a.client.kill(h.id(), T).unwrap();
        match h.next_event().unwrap() {
            ExecEvent::Exit(x) => assert_eq!(x.signal, Some(9)),
            other => panic!("{other:?}"),
        }
    }
    // After its end, a kill is "no such exec" again.
    let mut h = a.client.start_exec(&req(&["true"])).unwrap();
    while !matches!(h.next_event().unwrap(), ExecEvent::Exit(_)) {}
    assert!(matches!(
        a.client.kill(h.id(), T),
        Err(AgentError::Remote { .. })
    ));
}

#[test]
fn malformed_frames_get_errors_and_the_agent_goes_on() {
    let (mut child, mut s, _ws) = spawn_raw();
    let read = |s: &mut UnixStream| {
        let (h, p) = proto::read_frame(s, proto::MAX_PAYLOAD).unwrap().unwrap();
        (h.id, Response::decode(h.kind, &p).unwrap())
    };
    assert!(matches!(read(&mut s), (0, Response::Ready { .. })));
    // Unknown kind.
    s.write_all(&[3, 0, 0, 0, 200, 5, 0, 0, 0, 1, 2, 3])
        .unwrap();
    match read(&mut s) {
        (5, Response::Error { kind, .. }) => assert_eq!(kind, ErrorKind::Protocol),
        other => panic!("{other:?}"),
    }
    // A list request whose string length points past the payload.
    s.write_all(&[4, 0, 0, 0, 4, 6, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f])
        .unwrap();
    assert!(matches!(
        read(&mut s),
        (
            6,
            Response::Error {
                kind: ErrorKind::Protocol,
                ..
            }
        )
    ));
    // An oversized frame: refused without buffering, its bytes skipped.
    let len = proto::MAX_PAYLOAD as u32 + 1;
    let mut f = len.to_le_bytes().to_vec();
    f.extend_from_slice(&[1, 7, 0, 0, 0]);
    s.write_all(&f).unwrap();
    match read(&mut s) {
        (7, Response::Error { kind, .. }) => assert_eq!(kind, ErrorKind::Protocol),
        other => panic!("{other:?}"),
    }
    let junk = vec![0xabu8; len as usize];
    s.write_all(&junk).unwrap();
    // Still in sync: a ping is answered.
    s.write_all(&Request::Ping.encode(8)).unwrap();
    assert!(matches!(read(&mut s), (8, Response::Pong { .. })));
    // Shutdown: acknowledged, then the agent exits 0.
    s.write_all(&Request::Shutdown.encode(9)).unwrap();
    assert!(matches!(read(&mut s), (9, Response::Ok)));
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(0), "{st:?} {:?}", st.signal());
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}

/// The host end of an agent's channel handed from one client to the next, as a restore
/// does (the restored VM's console gets a new host stream; the guest sees nothing change):
/// bytes from the agent go to the current client's stream, each client's bytes to the agent.
/// Bytes the agent sends before the first client is attached (its `Ready`, which it sends as
/// soon as it starts) wait for that client: the relay's reader may run before the test has
/// attached one, and a dropped `Ready` left the client waiting for it for a minute.
struct Relay {
    agent: UnixStream,
    current: std::sync::Arc<(std::sync::Mutex<Option<UnixStream>>, std::sync::Condvar)>,
}

impl Relay {
    fn new(agent: UnixStream) -> Relay {
        let current: std::sync::Arc<(std::sync::Mutex<Option<UnixStream>>, std::sync::Condvar)> =
            Default::default();
        let (mut from_agent, to) = (agent.try_clone().unwrap(), current.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 65536];
            while let Ok(n @ 1..) = from_agent.read(&mut buf) {
                let (m, attached) = &*to;
                let mut c = m.lock().unwrap();
                while c.is_none() {
                    c = attached.wait(c).unwrap();
                }
                if let Some(c) = c.as_mut() {
                    let _ = c.write_all(&buf[..n]);
                }
            }
        });
        Relay { agent, current }
    }

    /// A new client's stream; the previous client's is no longer written to.
    fn attach(&self) -> UnixStream {
        let (client, mut mine) = UnixStream::pair().unwrap();
        let (m, attached) = &*self.current;
        *m.lock().unwrap() = Some(mine.try_clone().unwrap());
        attached.notify_all();
        let mut to_agent = self.agent.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 65536];
            while let Ok(n @ 1..) = mine.read(&mut buf) {
                if to_agent.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        });
        client
    }
}

/// What a snapshot with a background process does to the channel (the VM snapshot aside):
/// the agent holds its output (`Hold`), the client goes, a new one (a restored sandbox's)
/// starts its ids after the old ones, adopts the running process and releases the hold; the
/// process's output comes to it, and a signal ends it.
#[test]
fn a_held_channel_is_taken_over_by_a_new_client() {
    let (mut child, ours, _ws) = spawn_raw();
    let relay = Relay::new(ours);
    let a = AgentClient::new(relay.attach()).unwrap();
    a.wait_ready(T).unwrap();
    let mut ticker = a
        .start_spawn(
            &req(&["sh", "-c", "while :; do echo tick; sleep 0.05; done"]),
            None,
            1 << 20,
        )
        .unwrap();
    assert!(matches!(ticker.next_event().unwrap(), ExecEvent::Stdout(_)));
    let target = ticker.id();
    a.hold(T).unwrap();
    let next = a.next_id();
    // Held: nothing comes any more, though the process runs on.
    std::thread::sleep(Duration::from_millis(300));
    ticker.detach();
    drop(a);

    let b = AgentClient::new(relay.attach()).unwrap();
    b.skip_ids_below(next);
    assert!(b.adopt(next).is_err(), "an id the old client never used");
    let mut adopted = b.adopt(target).unwrap();
    assert!(b.adopt(target).is_err(), "adopted twice");
    b.grant(target, 1 << 20).unwrap();
    // Still held: requests are carried out, their answers wait for the release.
    let (tx, rx) = std::sync::mpsc::channel();
    let b2 = b.clone();
    std::thread::spawn(move || {
        let _ = tx.send(b2.exec(&req(&["echo", "after-release"])));
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "an answer came through the hold"
    );
    b.release(T).unwrap();
    let out = rx.recv_timeout(T).unwrap().unwrap();
    assert_eq!(out.stdout, b"after-release\n");
    match adopted.next_event().unwrap() {
        ExecEvent::Stdout(d) => assert!(String::from_utf8_lossy(&d).contains("tick")),
        other => panic!("{other:?}"),
    }
    b.signal(target, 9, T).unwrap();
    let exit = loop {
        match adopted.next_event().unwrap() {
            ExecEvent::Exit(e) => break e,
            _ => b.grant(target, 1 << 16).unwrap(),
        }
    };
    assert_eq!(exit.signal, Some(9), "{exit:?}");
    b.ping(T).unwrap();
    b.shutdown(T).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

/// `Refresh` changes the system's hostname, random state and clock: an agent that is not
/// pid 1 (this test's, on the host) refuses it and changes nothing.
#[test]
fn refresh_is_refused_outside_a_guest() {
    let a = spawn();
    let before = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    match a.client.refresh("mvm-not-on-the-host", T) {
        Err(AgentError::Remote { kind, message }) => {
            assert_eq!(kind, ErrorKind::Invalid);
            assert!(message.contains("pid 1"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(),
        before
    );
    // The agent goes on.
    a.client.ping(T).unwrap();
}

#[test]
fn shutdown_ends_the_agent_and_the_client_sees_it() {
    let mut a = spawn();
    a.client.shutdown(T).unwrap();
    assert_eq!(a.child.wait().unwrap().code(), Some(0));
    match a.client.ping(T) {
        Err(AgentError::Closed(_)) => {}
        other => panic!("{other:?}"),
    }
    assert!(a.client.failure().is_some());
}

#[test]
fn agent_refuses_to_run_without_a_channel() {
    let st = Command::new(agent_path())
        .env_clear()
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(2));
}

/// A hostile guest: the client must turn garbage into a typed error, never hang or allocate
/// what the guest announces.
#[test]
fn client_survives_a_hostile_agent() {
    for garbage in [
        // Announces a 4 GiB frame.
        vec![0xff, 0xff, 0xff, 0xff, 64, 1, 0, 0, 0],
        // A stdout frame whose byte string overruns the payload.
        vec![4, 0, 0, 0, 64, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
        // Unknown kind.
        vec![0, 0, 0, 0, 3, 1, 0, 0, 0],
    ] {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let c = AgentClient::new(ours).unwrap();
        let c2 = c.clone();
        let t = std::thread::spawn(move || c2.exec(&req(&["echo"])));
        // Read the request, answer garbage.
        let _ = proto::read_frame(&mut theirs, proto::MAX_PAYLOAD).unwrap();
        theirs.write_all(&garbage).unwrap();
        match t.join().unwrap() {
            Err(AgentError::Protocol(_)) => {}
            other => panic!("{garbage:?}: {other:?}"),
        }
        assert!(matches!(c.ping(T), Err(AgentError::Protocol(_))));
    }
    // A guest that announces another version.
    let (ours, mut theirs) = UnixStream::pair().unwrap();
    let c = AgentClient::new(ours).unwrap();
    theirs
        .write_all(&Response::Ready { source_hash: 1 }.encode(0))
        .unwrap();
    assert!(matches!(
        c.wait_ready(T),
        Err(AgentError::VersionMismatch { found: 1, .. })
    ));
    // A guest that goes away mid-request.
    let c2 = c.clone();
    let t = std::thread::spawn(move || c2.list("", T));
    let _ = proto::read_frame(&mut theirs, proto::MAX_PAYLOAD).unwrap();
    drop(theirs);
    assert!(matches!(t.join().unwrap(), Err(AgentError::Closed(_))));
}

/// A guest whose set-up failed (an image root that would not mount) says so before `Ready`:
/// `wait_ready` returns it at once, typed, and the agent goes on serving.
#[test]
fn a_set_up_failure_before_ready_is_a_typed_error() {
    let (ours, mut theirs) = UnixStream::pair().unwrap();
    let c = AgentClient::new(ours).unwrap();
    let failure = Response::Error {
        kind: ErrorKind::Io,
        message: "image root: /dev/vda did not appear within 10s".into(),
    };
    theirs.write_all(&failure.encode(0)).unwrap();
    theirs
        .write_all(
            &Response::Ready {
                source_hash: backend_microvm::agent_client::SOURCE_HASH,
            }
            .encode(0),
        )
        .unwrap();
    match c.wait_ready(T) {
        Err(e @ AgentError::GuestSetup(_)) => {
            assert!(e.to_string().contains("/dev/vda did not appear"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    let c2 = c.clone();
    let t = std::thread::spawn(move || c2.ping(T));
    let (h, _) = proto::read_frame(&mut theirs, proto::MAX_PAYLOAD)
        .unwrap()
        .unwrap();
    theirs
        .write_all(
            &Response::Pong {
                source_hash: backend_microvm::agent_client::SOURCE_HASH,
            }
            .encode(h.id),
        )
        .unwrap();
    t.join().unwrap().unwrap();
}

#[test]
fn background_process_controls_refuse_bad_targets_and_the_agent_goes_on() {
    let a = spawn();
    let c = &a.client;
    let remote = |r: Result<(), AgentError>| match r {
        Err(AgentError::Remote { kind, .. }) => kind,
        other => panic!("expected a refusal, got {other:?}"),
    };
    // No such process: input, close, signal, resize.
    assert_eq!(remote(c.input(999, b"x", T)), ErrorKind::NotFound);
    assert_eq!(remote(c.close_input(999, T)), ErrorKind::NotFound);
    assert_eq!(remote(c.signal(999, 15, T)), ErrorKind::NotFound);
    assert_eq!(remote(c.resize(999, 24, 80, T)), ErrorKind::NotFound);
    // A grant for nobody is ignored (it is not answered at all).
    c.grant(999, 1 << 20).unwrap();

    // A running process: a signal number out of range, a resize without a terminal.
    let mut h = c
        .start_spawn(&req(&["sleep", "30"]), None, 1 << 16)
        .unwrap();
    assert_eq!(remote(c.signal(h.id(), 0, T)), ErrorKind::Invalid);
    assert_eq!(remote(c.signal(h.id(), 99, T)), ErrorKind::Invalid);
    assert_eq!(remote(c.resize(h.id(), 24, 80, T)), ErrorKind::Invalid);
    // Its input, once closed, takes no more.
    c.close_input(h.id(), T).unwrap();
    assert_eq!(remote(c.input(h.id(), b"late", T)), ErrorKind::NotFound);
    c.signal(h.id(), 9, T).unwrap();
    match h.next_event().unwrap() {
        ExecEvent::Exit(x) => assert_eq!(x.signal, Some(9), "{x:?}"),
        other => panic!("{other:?}"),
    }
    // A command that is not there: started, then 127, as for exec.
    let mut h = c
        .start_spawn(&req(&["no-such-program"]), None, 1 << 16)
        .unwrap();
    let mut exit = None;
    while exit.is_none() {
        if let ExecEvent::Exit(x) = h.next_event().unwrap() {
            exit = Some(x);
        }
    }
    assert_eq!(exit.and_then(|x| x.code), Some(127));
    // A window of nothing: no output until the host grants some.
    let mut h = c.start_spawn(&req(&["echo", "granted"]), None, 0).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    c.grant(h.id(), proto::FRAME_COST).unwrap();
    assert_eq!(
        h.next_event().unwrap(),
        ExecEvent::Stdout(b"granted\n".to_vec())
    );
    // The frame's cost given back (as the library does after each one): the end comes.
    c.grant(h.id(), proto::FRAME_COST).unwrap();
    assert!(matches!(h.next_event().unwrap(), ExecEvent::Exit(_)));
    c.ping(T).unwrap();
}

/// A small window, output on stderr only: the quiet stdout never holds the window stderr
/// needs, and every byte arrives as the host gives the window back.
#[test]
fn a_small_window_streams_either_stream_to_the_end() {
    let a = spawn();
    let c = &a.client;
    let mut h = c
        .start_spawn(
            &req(&["sh", "-c", "head -c 300000 /dev/zero >&2; echo out"]),
            None,
            2 * proto::FRAME_COST,
        )
        .unwrap();
    let (mut err, mut out) = (0, Vec::new());
    loop {
        let ev = h.next_event().unwrap();
        let n = match &ev {
            ExecEvent::Stderr(d) => {
                err += d.len();
                d.len()
            }
            ExecEvent::Stdout(d) => {
                out.extend_from_slice(d);
                d.len()
            }
            ExecEvent::Exit(x) => {
                assert_eq!(x.code, Some(0), "{x:?}");
                break;
            }
            other => panic!("unexpected event {other:?}"),
        };
        let cost = u32::try_from(n).unwrap().max(proto::FRAME_COST);
        c.grant(h.id(), cost).unwrap();
    }
    assert_eq!((err, out.as_slice()), (300_000, &b"out\n"[..]));
}
