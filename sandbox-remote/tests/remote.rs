//! `RemoteBackend` against a real server on loopback (and on a Unix socket): every trait
//! call a remote sandbox makes, the library's errors coming back as the library's variants,
//! snapshots into and out of the caller's own store, and connection failures said plainly.
//! (The server's sandboxes come from the test-only unisolated backend: these test the client
//! and the API, not isolation; `sandbox-conformance/tests/remote.rs` runs the behaviour
//! contract through a server on the real tiers.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use backend_unisolated::UnisolatedBackend;
use sandbox_core::{
    Backend, Error, ExecEvent, ExecRequest, Language, ObjectSnapshotStore, ResolvedSecrets,
    SandboxSpec, SnapshotStore, Tier,
};
use sandbox_remote::{RemoteConfig, RemoteError, RemoteServer};
use sandbox_server::{Listener, OneBackend, Server, ServerConfig, Token};

struct Running {
    address: String,
    token: Token,
    server: Server,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn start() -> Running {
    start_with(|c| c).await
}

/// A server whose configuration `f` makes from the default one (with a snapshot store).
async fn start_with(f: impl FnOnce(ServerConfig) -> ServerConfig) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let server = Server::new(
        Arc::new(OneBackend(Arc::new(
            UnisolatedBackend::new_without_isolation(),
        ))),
        f(ServerConfig::default().snapshot_store(Arc::new(store))),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", l.local_addr().unwrap());
    let token = Token::generate();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let (s, t) = (server.clone(), token.clone());
    tokio::spawn(async move {
        s.serve(Listener::Tcp(l, t), async {
            let _ = rx.await;
        })
        .await
    });
    Running {
        address,
        token,
        server,
        stop: Some(stop),
        _dir: dir,
    }
}

async fn connect(r: &Running) -> RemoteServer {
    let config = RemoteConfig::new(&r.address)
        .unwrap()
        .token(r.token.reveal())
        .label("client", "test");
    RemoteServer::connect(config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_sandbox_does_what_a_local_one_does() {
    let r = start().await;
    let server = connect(&r).await;
    assert_eq!(server.tiers().len(), 1);
    let backend = server.backend(Tier::Unisolated).unwrap();
    assert!(backend.probe().await.available);
    // What the API does not carry is not claimed.
    let caps = backend.capabilities();
    assert!(!caps.processes && !caps.tty && !caps.publish);
    assert!(server.backend(Tier::Gvisor).is_none());

    let sb = backend
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(sb.tier(), Tier::Unisolated);
    assert_eq!(r.server.sandbox_ids(), vec![sb.id().to_string()]);

    let out = sb
        .exec(
            ExecRequest::code("echo hi; echo err >&2; cat; echo \"$X\"; exit 3")
                .stdin(b"in\n".to_vec())
                .env("X", "from-env"),
        )
        .await
        .unwrap();
    assert_eq!(
        (
            out.exit_code,
            out.stdout_str().as_ref(),
            out.stderr_str().as_ref()
        ),
        (Some(3), "hi\nin\nfrom-env\n", "err\n")
    );

    // Streaming: chunks in order, then the exit.
    let mut st = sb
        .exec_stream(ExecRequest::code(
            "for i in 1 2 3; do echo $i; done; exit 4",
        ))
        .await
        .unwrap();
    let (mut text, mut code) = (String::new(), None);
    while let Some(ev) = st.next().await {
        match ev.unwrap() {
            ExecEvent::Stdout(b) => text.push_str(&String::from_utf8_lossy(&b)),
            ExecEvent::Exit(res) => code = res.exit_code,
            _ => {}
        }
    }
    assert_eq!((text.as_str(), code), ("1\n2\n3\n", Some(4)));

    // Files, names that need encoding included; errors as the library's variants.
    sb.write_file("dir/a b%.txt", b"hello").await.unwrap();
    assert_eq!(sb.read_file("dir/a b%.txt").await.unwrap(), b"hello");
    assert_eq!(
        sb.read_file("/workspace/dir/a b%.txt").await.unwrap(),
        b"hello"
    );
    let names: Vec<String> = sb
        .list("dir")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, vec!["a b%.txt".to_string()]);
    let e = sb.read_file("../../etc/passwd").await.unwrap_err();
    assert!(matches!(e, Error::PathEscape { .. }), "{e:?}");
    let e = sb.read_file("missing.txt").await.unwrap_err();
    assert!(
        matches!(e, Error::NotFound { ref path } if path == "missing.txt"),
        "{e:?}"
    );
    let e = sb.pause().await.unwrap_err();
    assert!(
        matches!(e, Error::Unsupported { ref what, .. } if what == "pause/resume"),
        "{e:?}"
    );
    let e = sb
        .exec(ExecRequest::argv(["sh"]).tty(24, 80))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
    sb.health_check().await.unwrap();

    // Snapshot into the caller's own store; restore from it (sent to the server once).
    let dir = tempfile::tempdir().unwrap();
    let mine = ObjectSnapshotStore::local(dir.path()).unwrap();
    let sid = sb.snapshot(&mine).await.unwrap();
    assert_eq!(mine.list().await.unwrap(), vec![sid.clone()]);
    let copy = backend
        .restore(&mine, &sid, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(copy.read_file("dir/a b%.txt").await.unwrap(), b"hello");
    let again = backend
        .restore(&mine, &sid, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(again.read_file("dir/a b%.txt").await.unwrap(), b"hello");
    // Deleted on the server since (by another client, say): sent again.
    let auth = format!("Authorization: Bearer {}", r.token.reveal());
    let out = std::process::Command::new("curl")
        .args(["-s", "-H", &auth])
        .arg(format!("{}/v1/snapshots", r.address))
        .output()
        .unwrap();
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let on_server = list["snapshots"].as_array().unwrap();
    assert!(!on_server.is_empty(), "{list}");
    for snap in on_server {
        let del = std::process::Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-X",
                "DELETE",
                "-H",
                &auth,
            ])
            .arg(format!(
                "{}/v1/snapshots/{}",
                r.address,
                snap["id"].as_str().unwrap()
            ))
            .output()
            .unwrap();
        assert_eq!(del.stdout, b"204");
    }
    let third = backend
        .restore(&mine, &sid, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(third.read_file("dir/a b%.txt").await.unwrap(), b"hello");
    third.destroy().await.unwrap();
    assert_eq!(r.server.sandbox_ids().len(), 3);

    // Destroy: idempotent, then every call is SandboxGone; dropping destroys too.
    sb.destroy().await.unwrap();
    sb.destroy().await.unwrap();
    let e = sb.exec(ExecRequest::argv(["true"])).await.unwrap_err();
    assert!(matches!(e, Error::SandboxGone { .. }), "{e:?}");
    copy.destroy().await.unwrap();
    drop(again);
    for _ in 0..100 {
        if r.server.sandbox_ids().is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(r.server.sandbox_ids(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_destroyed_elsewhere_is_gone_here() {
    let r = start().await;
    let backend = connect(&r).await.backend(Tier::Unisolated).unwrap();
    let sb = backend
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    r.server.destroy_all().await;
    let e = sb.exec(ExecRequest::argv(["true"])).await.unwrap_err();
    assert!(matches!(e, Error::SandboxGone { .. }), "{e:?}");
    assert!(matches!(
        sb.health_check().await,
        Err(Error::SandboxGone { .. })
    ));
    // Its destroy succeeds: it is gone.
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_addresses_tokens_and_dead_servers_are_said() {
    assert!(matches!(
        RemoteConfig::new("127.0.0.1:7878"),
        Err(RemoteError::BadAddress(_))
    ));
    let r = start().await;
    let wrong = RemoteConfig::new(&r.address).unwrap().token("w".repeat(40));
    let e = RemoteServer::connect(wrong).await.unwrap_err();
    assert!(matches!(e, RemoteError::Unauthorized { .. }), "{e:?}");
    let none = RemoteConfig::new(&r.address).unwrap();
    assert!(matches!(
        RemoteServer::connect(none).await,
        Err(RemoteError::Unauthorized { .. })
    ));

    // A server that goes away: the probe and the calls say so.
    let backend = connect(&r).await.backend(Tier::Unisolated).unwrap();
    let sb = backend
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    let address = r.address.clone();
    drop(r);
    let mut status = backend.probe().await;
    for _ in 0..100 {
        if !status.available {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        status = backend.probe().await;
    }
    assert!(
        !status.available && status.reason.contains(&address),
        "{status:?}"
    );
    let e = sb.exec(ExecRequest::argv(["true"])).await.unwrap_err();
    assert!(
        matches!(e, Error::Backend { .. }) && e.to_string().contains(&address),
        "{e}"
    );
    // The transport's error is kept as the cause.
    assert!(
        std::error::Error::source(&e).is_some_and(|c| c.is::<reqwest::Error>()),
        "{e:?}"
    );
    let e = RemoteServer::connect(RemoteConfig::new(&address).unwrap())
        .await
        .unwrap_err();
    assert!(matches!(e, RemoteError::Unreachable { .. }), "{e:?}");
}

/// A preflight right after connecting answers from what the server reported then (no round
/// trip: a one-shot `run --server` creates at once); once that is older than
/// `preflight_fresh`, it asks the server, as the probe always does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preflight_answers_from_the_connect_while_fresh() {
    let r = start().await;
    let config = |fresh| {
        RemoteConfig::new(&r.address)
            .unwrap()
            .token(r.token.reveal())
            .preflight_fresh(fresh)
    };
    let long = RemoteServer::connect(config(std::time::Duration::from_secs(3600)))
        .await
        .unwrap()
        .backend(Tier::Unisolated)
        .unwrap();
    let zero = RemoteServer::connect(config(std::time::Duration::ZERO))
        .await
        .unwrap()
        .backend(Tier::Unisolated)
        .unwrap();
    assert!(long.preflight().await.available);
    assert!(zero.preflight().await.available);
    // The server goes away: the reported status still answers within its window; the
    // probe, and a preflight past its window, ask and are told.
    drop(r);
    let asked = until_unavailable(|| zero.preflight()).await;
    assert!(!asked.available, "{asked:?}");
    assert!(long.preflight().await.available);
    // The probe asks: told once the server's last connections are gone too (a connection
    // the client kept alive can outlive the listener by a moment).
    let probed = until_unavailable(|| long.probe()).await;
    assert!(!probed.available, "{probed:?}");
    assert!(long.preflight().await.available, "still within its window");
}

/// What `ask` answers once it says unavailable, asked every 50 ms (at most 100 times: then
/// its last answer).
async fn until_unavailable<F, Fut>(ask: F) -> sandbox_core::TierStatus
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = sandbox_core::TierStatus>,
{
    let mut status = ask().await;
    for _ in 0..100 {
        if !status.available {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        status = ask().await;
    }
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_server_needs_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let server = Server::new(
        Arc::new(OneBackend(Arc::new(
            UnisolatedBackend::new_without_isolation(),
        ))),
        ServerConfig::default(),
    );
    let l = tokio::net::UnixListener::bind(&sock).unwrap();
    let s = server.clone();
    tokio::spawn(async move { s.serve(Listener::Unix(l), std::future::pending()).await });
    let config = RemoteConfig::new(&format!("unix:{}", sock.display())).unwrap();
    let backend = RemoteServer::connect(config)
        .await
        .unwrap()
        .backend(Tier::Unisolated)
        .unwrap();
    let sb = backend
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    let out = sb.exec(ExecRequest::code("echo over-unix")).await.unwrap();
    assert_eq!(out.stdout_str(), "over-unix\n");
    // This server keeps no snapshots: said as the library's error.
    let dir2 = tempfile::tempdir().unwrap();
    let mine = ObjectSnapshotStore::local(dir2.path()).unwrap();
    let e = sb.snapshot(&mine).await.unwrap_err();
    assert!(e.to_string().contains("--state-dir"), "{e}");
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_once_is_one_request_and_checks_the_build() {
    let r = start_with(|c| c.warm(1).build("build-1")).await;
    // Without asking for the tiers: no backends here, and a run still goes.
    let config = RemoteConfig::new(&r.address)
        .unwrap()
        .token(r.token.reveal())
        .ask_tiers(false);
    let server = RemoteServer::connect(config).await.unwrap();
    assert!(server.tiers().is_empty());
    assert_eq!(server.build(), None);
    let spec = SandboxSpec::new(Language::Shell);
    for _ in 0..3 {
        let out = server
            .run_once(
                &spec,
                Some(Tier::Unisolated),
                ExecRequest::argv(["sh", "-c", "echo hi; exit 4"]),
                Some("build-1"),
            )
            .await
            .unwrap();
        assert_eq!(out.tier, Tier::Unisolated);
        assert_eq!(
            (out.result.exit_code, &out.result.stdout[..]),
            (Some(4), &b"hi\n"[..])
        );
        assert!(
            r.server.sandbox_ids().is_empty(),
            "a run's sandbox stayed listed"
        );
    }
    // Another build: Unavailable, naming the server's, and nothing ran.
    let e = server
        .run_once(
            &spec,
            Some(Tier::Unisolated),
            ExecRequest::argv(["sh", "-c", "exit 9"]),
            Some("build-2"),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Unavailable { reason, .. } if reason.contains("build-1")),
        "{e:?}"
    );
    // The library's errors come back as its variants.
    let mut bad = SandboxSpec::new(Language::Shell);
    bad.limits.wall_time_ms = 0;
    let e = server
        .run_once(
            &bad,
            Some(Tier::Unisolated),
            ExecRequest::argv(["true"]),
            None,
        )
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidSpec { .. }), "{e:?}");
    // Asking for the tiers gets the build too.
    assert_eq!(connect(&r).await.build(), Some("build-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destroy_need_not_wait_for_the_teardown() {
    let r = start().await;
    let config = RemoteConfig::new(&r.address)
        .unwrap()
        .token(r.token.reveal())
        .destroy_without_waiting(true);
    let server = RemoteServer::connect(config).await.unwrap();
    let backend = server.backend(Tier::Unisolated).unwrap();
    let sb = backend
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(r.server.sandbox_ids().len(), 1);
    sb.destroy().await.unwrap();
    assert!(
        r.server.sandbox_ids().is_empty(),
        "still listed after destroy"
    );
    assert!(matches!(
        sb.exec(ExecRequest::argv(["true"])).await,
        Err(Error::SandboxGone { .. })
    ));
    // Idempotent, as a waiting destroy.
    sb.destroy().await.unwrap();
}
