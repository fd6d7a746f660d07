//! The test backend against the shared contract: clean env, limits it does enforce, the file
//! API's path rules, streaming, snapshots through a real store.

// In tests a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use backend_unisolated::UnisolatedBackend;
use sandbox_core::{
    Backend, Error, ExecEvent, ExecRequest, Language, LimitKind, MapSecretSource,
    ObjectSnapshotStore, ResolvedSecrets, SandboxSpec, SnapshotStore, Tier,
};

fn backend() -> Arc<dyn Backend> {
    Arc::new(UnisolatedBackend::new_without_isolation())
}

#[tokio::test]
async fn env_is_exactly_the_spec() {
    std::env::set_var("AGENT_SANDBOX_HOST_SECRET", "do-not-leak");
    let spec = SandboxSpec::builder(Language::Shell)
        .env("GREETING", "hi")
        .build()
        .unwrap();
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::code("env").env("PER_CALL", "1"))
        .await
        .unwrap();
    let out = r.stdout_str();
    assert!(r.success(), "{r:?}");
    assert!(
        out.contains("GREETING=hi") && out.contains("PER_CALL=1"),
        "{out}"
    );
    assert!(!out.contains("do-not-leak"), "host env leaked: {out}");
    let names: Vec<&str> = out.lines().filter_map(|l| l.split('=').next()).collect();
    for n in &names {
        assert!(
            ["GREETING", "PER_CALL", "PATH", "HOME", "LANG", "PWD", "SHLVL", "_"].contains(n),
            "unexpected {n}"
        );
    }
}

#[tokio::test]
async fn secrets_reach_env_and_are_redacted_from_output() {
    let spec = SandboxSpec::builder(Language::Shell)
        .secret_env("TOKEN", "API_TOKEN")
        .build()
        .unwrap();
    let src = MapSecretSource::new().with("TOKEN", "sk-live-0123456789");
    let secrets = ResolvedSecrets::resolve(&spec.secrets, &src).unwrap();
    let sb = backend().create(&spec, secrets).await.unwrap();
    let r = sb
        .exec(ExecRequest::code(
            "echo token=$API_TOKEN; echo $API_TOKEN >&2",
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "token=[REDACTED:TOKEN]\n");
    assert_eq!(r.stderr_str(), "[REDACTED:TOKEN]\n");
    // the value really was there: its length survives
    let r = sb
        .exec(ExecRequest::code("printf %s \"$API_TOKEN\" | wc -c"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str().trim(), "18");
}

#[tokio::test]
async fn wall_timeout_kills_the_whole_group() {
    let sb = backend()
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sb
        .exec(
            ExecRequest::code("sleep 30 & sleep 30; echo never")
                .timeout(Duration::from_millis(200)),
        )
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime));
    assert_eq!(r.exit_code, Some(137));
    assert!(!r.stdout_str().contains("never"));
    // the sandbox is still usable
    assert!(sb.exec(ExecRequest::code("true")).await.unwrap().success());
}

#[tokio::test]
async fn output_flood_is_capped_and_drained() {
    let spec = SandboxSpec::builder(Language::Shell)
        .output_bytes(1000)
        .build()
        .unwrap();
    let sb = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    // Past the cap but short of a flood: truncated, and the command runs to its end.
    let r = sb
        .exec(ExecRequest::code(
            "head -c 5000000 /dev/zero | tr '\\0' x; echo done >&2",
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout.len(), 1000);
    assert!(r.truncated);
    assert_eq!(r.stderr_str(), "done\n");
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(r.limit, None);
    // A flood (past `flood_threshold`) is stopped: the output limit, as in every tier.
    let r = sb
        .exec(ExecRequest::code(
            "head -c 50000000 /dev/zero | tr '\\0' x; echo done >&2",
        ))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(sandbox_core::LimitKind::Output), "{r:?}");
    assert_eq!(r.stdout.len(), 1000);
    assert!(r.truncated);
    assert_eq!(r.exit_code, Some(137));
}

#[tokio::test]
async fn missing_binary_is_127() {
    let sb = backend()
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::argv(["definitely-not-a-binary-xyz"]))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(127));
}

#[tokio::test]
async fn file_api_refuses_escapes() {
    let sb = backend()
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    sb.write_file("dir/a.txt", b"A").await.unwrap();
    assert_eq!(sb.read_file("/workspace/dir/a.txt").await.unwrap(), b"A");
    let names: Vec<_> = sb
        .list("dir")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["a.txt"]);
    for bad in ["../x", "/etc/passwd", "/workspace/../x", "dir/../../x"] {
        assert!(
            matches!(sb.read_file(bad).await, Err(Error::PathEscape { .. })),
            "{bad}"
        );
        assert!(
            matches!(
                sb.write_file(bad, b"x").await,
                Err(Error::PathEscape { .. })
            ),
            "{bad}"
        );
    }
    // A symlink planted by the code that points at the host is not followed by the file API.
    let r = sb
        .exec(ExecRequest::code(
            "ln -s /etc hostetc; ln -s /etc/passwd pw",
        ))
        .await
        .unwrap();
    assert!(r.success());
    assert!(matches!(
        sb.read_file("hostetc/passwd").await,
        Err(Error::PathEscape { .. })
    ));
    assert!(matches!(
        sb.read_file("pw").await,
        Err(Error::PathEscape { .. })
    ));
    assert!(matches!(
        sb.write_file("hostetc/evil", b"x").await,
        Err(Error::PathEscape { .. })
    ));
    assert!(matches!(
        sb.read_file("nope").await,
        Err(Error::NotFound { .. })
    ));
}

#[tokio::test]
async fn streaming_yields_chunks_then_exit() {
    let sb = backend()
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    let mut s = sb
        .exec_stream(ExecRequest::code(
            "echo one; sleep 0.2; echo two >&2; exit 3",
        ))
        .await
        .unwrap();
    let mut events = vec![];
    while let Some(ev) = s.next().await {
        events.push(ev.unwrap());
    }
    assert_eq!(events.first(), Some(&ExecEvent::Stdout("one\n".into())));
    assert!(events.contains(&ExecEvent::Stderr("two\n".into())));
    match events.last() {
        Some(ExecEvent::Exit(r)) => assert_eq!(r.exit_code, Some(3)),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn destroy_is_idempotent_and_final() {
    let sb = backend()
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    sb.destroy().await.unwrap();
    sb.destroy().await.unwrap();
    assert!(matches!(
        sb.exec(ExecRequest::code("true")).await,
        Err(Error::SandboxGone { .. })
    ));
    assert!(matches!(
        sb.read_file("x").await,
        Err(Error::SandboxGone { .. })
    ));
}

#[tokio::test]
async fn snapshot_restore_round_trip_and_foreign_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let b = backend();
    let sb = b
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    sb.write_file("state/counter", b"41").await.unwrap();
    let id = sb.snapshot(&store).await.unwrap();
    sb.destroy().await.unwrap();
    let restored = b
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(restored.tier(), Tier::Unisolated);
    let r = restored
        .exec(ExecRequest::code("cat state/counter"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "41");

    // Corrupt the workspace blob: restore refuses before creating anything.
    let m = store.manifest(&id).await.unwrap();
    let blob = dir
        .path()
        .join("blobs")
        .join(&m.artifacts["workspace.tar"].sha256);
    std::fs::write(&blob, b"garbage").unwrap();
    let e = b
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("corrupt"), "{e}");
}

#[tokio::test]
async fn invalid_spec_is_refused_before_anything_runs() {
    let mut spec = SandboxSpec::new(Language::Shell);
    spec.limits.memory_bytes = 1;
    let e = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .err()
        .unwrap();
    assert!(
        matches!(e, Error::InvalidSpec { ref field, .. } if field == "limits.memory_bytes"),
        "{e}"
    );
}

#[tokio::test]
async fn deny_all_network_has_only_a_down_loopback() {
    let sb = backend()
        .create(&SandboxSpec::new(Language::Shell), ResolvedSecrets::none())
        .await
        .unwrap();
    // The namespace has no interface but `lo`, and `lo` is down: nothing is routable.
    let r = sb
        .exec(ExecRequest::code(
            "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '",
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "lo\n", "{r:?}");
    // A listener on the host's loopback is unreachable from inside.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let code = format!(
        "import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)"
    );
    let spec = SandboxSpec::new(Language::Python);
    let py = backend()
        .create(&spec, ResolvedSecrets::none())
        .await
        .unwrap();
    let r = py.exec(ExecRequest::code(code)).await.unwrap();
    assert!(r.stdout_str().starts_with("refused"), "{r:?}");
    // and the same connection from the host works, so the check is meaningful
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
}

#[tokio::test]
async fn streamed_output_is_redacted_too() {
    let spec = SandboxSpec::builder(Language::Shell)
        .secret_env("TOKEN", "API_TOKEN")
        .build()
        .unwrap();
    let src = MapSecretSource::new().with("TOKEN", "sk-live-0123456789");
    let secrets = ResolvedSecrets::resolve(&spec.secrets, &src).unwrap();
    let sb = backend().create(&spec, secrets).await.unwrap();
    // Print the secret in two writes so it straddles chunk boundaries.
    let code = "printf 'a=%s' \"${API_TOKEN%%0123456789}\"; sleep 0.1; printf '0123456789\\n'";
    let r = sb
        .exec_stream(ExecRequest::code(code))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "a=[REDACTED:TOKEN]\n");
}

/// A command starts with every signal at its default, though this test process ignores
/// `SIGINT` and `SIGQUIT` as a background job does (`execve` keeps ignored dispositions).
#[tokio::test]
async fn commands_start_with_default_signal_dispositions() {
    for sig in [
        nix::sys::signal::Signal::SIGINT,
        nix::sys::signal::Signal::SIGQUIT,
    ] {
        // SAFETY: `SIG_IGN` is no handler; no code of this process runs on these signals.
        unsafe { nix::sys::signal::signal(sig, nix::sys::signal::SigHandler::SigIgn) }.unwrap();
    }
    let sb = backend()
        .create(
            &SandboxSpec::builder(Language::Shell).build().unwrap(),
            ResolvedSecrets::none(),
        )
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::argv(["grep", "^SigIgn:", "/proc/self/status"]))
        .await
        .unwrap();
    assert!(r.success(), "{r:?}");
    let mask = r.stdout_str();
    let mask = u64::from_str_radix(mask.trim_start_matches("SigIgn:").trim(), 16).unwrap();
    assert_eq!(mask, 0, "ignored signals passed on: {mask:#x}");
    sb.destroy().await.unwrap();
}
