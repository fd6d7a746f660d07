//! `agent-sandbox serve` as users run it: the CLI binary on loopback with a token file,
//! driven by `curl`, on a real tier (the container tier; skipped, saying why, where the probe
//! says it cannot run). Its OpenAPI document is checked by `openapi-spec-validator` from PyPI
//! (`scripts/test.sh` installs it and sets `AGENT_SANDBOX_TEST_PYTHON`). SIGTERM destroys
//! what the server made.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod served;

use std::process::Command;
use std::time::Duration;

use served::{container_available, curl, serve};

#[test]
fn the_cli_serves_container_sandboxes_to_curl_and_cleans_up_on_sigterm() {
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let mut s = serve();
    let (code, info) = curl(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(r#"{"spec": {"language": "python"}, "tier": "container", "labels": {"agent": "a1"}}"#),
    );
    assert_eq!(code, 201, "{info}");
    assert_eq!(info["tier"], "container");
    let id = info["id"].as_str().unwrap().to_string();
    let (code, out) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"code": "import os; print(os.getuid() != 0, 6*7)"}"#),
    );
    assert_eq!(code, 200, "{out}");
    assert_eq!(out["stdout"], "True 42\n");
    // The sandbox's network is closed (deny-all), whatever the server can reach.
    let (_, out) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(
            r#"{"code": "import socket\ntry:\n socket.create_connection(('127.0.0.1', 1), timeout=2)\nexcept OSError as e:\n print(type(e).__name__)"}"#,
        ),
    );
    assert!(out["stdout"].as_str().unwrap().contains("Error"), "{out}");

    // SIGTERM: the server stops and destroys what it made.
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let mut status = None;
    for _ in 0..300 {
        if let Some(st) = s.child.try_wait().unwrap() {
            status = Some(st);
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(status.is_some_and(|st| st.success()), "{status:?}");
    let left = Command::new("sh")
        .args([
            "-c",
            &format!("grep -l {id} /proc/[0-9]*/cgroup 2>/dev/null | wc -l"),
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&left.stdout).trim(), "0");
}

#[test]
fn the_openapi_document_is_valid() {
    let Some(python) = std::env::var_os("AGENT_SANDBOX_TEST_PYTHON") else {
        eprintln!(
            "SKIP: AGENT_SANDBOX_TEST_PYTHON is not set (scripts/test.sh sets it to a venv \
             with openapi-spec-validator)"
        );
        return;
    };
    let s = serve();
    let (code, doc) = curl(&s, "GET", "/v1/openapi.json", None);
    assert_eq!(code, 200);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("openapi.json");
    std::fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
    let out = Command::new(python)
        .args(["-m", "openapi_spec_validator"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn container_sandboxes_pause_when_idle_resume_on_use_and_fork_from_a_snapshot() {
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let s = serve();
    let (code, info) = curl(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(
            r#"{"spec": {"language": "shell"}, "tier": "container",
                "lifetime": {"idle_timeout_s": 1, "on_idle": "pause"}}"#,
        ),
    );
    assert_eq!(code, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    let (code, out) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"code": "echo kept > state.txt; echo ok"}"#),
    );
    assert_eq!((code, &out["stdout"]), (200, &"ok\n".into()), "{out}");
    // Idle: paused by the server (polled, 20 s at most).
    let mut state = serde_json::Value::Null;
    for _ in 0..200 {
        state = curl(&s, "GET", &format!("/v1/sandboxes/{id}"), None).1["state"].clone();
        if state == "paused" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(state, "paused");
    // The next request resumes it.
    let (code, out) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"code": "cat state.txt"}"#),
    );
    assert_eq!((code, &out["stdout"]), (200, &"kept\n".into()), "{out}");
    // Paused by a client, it stays paused until a client resumes it.
    let (code, _) = curl(&s, "POST", &format!("/v1/sandboxes/{id}/pause"), None);
    assert_eq!(code, 204);
    let (code, e) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"argv": ["true"]}"#),
    );
    assert_eq!(
        (code, &e["error"]["kind"]),
        (409, &"sandbox_paused".into()),
        "{e}"
    );
    let (code, _) = curl(&s, "POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(code, 204);

    // Snapshot it and fork two: each has the file, in a container of its own.
    let (code, snap) = curl(&s, "POST", &format!("/v1/sandboxes/{id}/snapshot"), None);
    assert_eq!((code, &snap["tier"]), (201, &"container".into()), "{snap}");
    let sid = snap["id"].as_str().unwrap();
    let (code, forked) = curl(
        &s,
        "POST",
        &format!("/v1/snapshots/{sid}/fork"),
        Some(r#"{"count": 2}"#),
    );
    assert_eq!(code, 201, "{forked}");
    for f in forked["sandboxes"].as_array().unwrap() {
        assert_eq!(f["tier"], "container");
        let (code, out) = curl(
            &s,
            "POST",
            &format!("/v1/sandboxes/{}/exec", f["id"].as_str().unwrap()),
            Some(r#"{"code": "cat state.txt"}"#),
        );
        assert_eq!((code, &out["stdout"]), (200, &"kept\n".into()), "{out}");
    }
    // The snapshot lives in the server's state directory.
    assert!(s
        .dir
        .path()
        .join("snapshots")
        .read_dir()
        .unwrap()
        .next()
        .is_some());
}

#[test]
fn run_with_server_runs_in_the_servers_sandbox() {
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let s = serve();
    let token_file = s.dir.path().join("token");
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
            .args(["run", "--server", &s.base, "--token-file"])
            .arg(&token_file)
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&[
        "--tier",
        "container",
        "--",
        "sh",
        "-c",
        "echo from-$(id -u); exit 3",
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-1000\n");
    // The server made it (labelled by nobody: a plain create) and it is gone again.
    let (_, list) = curl(&s, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sandboxes"], serde_json::json!([]), "{list}");
    // What a token does not grant is refused, saying so; nothing is left behind.
    // (An invalid spec, as the CLI says of every spec it cannot run: exit 2.)
    let out = run(&["--tier", "container", "--workspace", "/tmp", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refused by the server") && err.contains("--allow-host-access"),
        "{err}"
    );
    // A wrong token and a dead address: said plainly.
    let bad = s.dir.path().join("bad-token");
    std::fs::write(&bad, "w".repeat(40)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["run", "--server", &s.base, "--token-file"])
        .arg(&bad)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("refused the token"),
        "{out:?}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["run", "--server", "http://127.0.0.1:1", "--token-file"])
        .arg(&token_file)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unreachable"),
        "{out:?}"
    );
}
