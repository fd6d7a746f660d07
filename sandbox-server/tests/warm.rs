//! Warm pools, one-shot runs (`POST /v1/run`), destroys that do not wait and idleness,
//! driven by `curl` against a real server over the test-only unisolated backend (the
//! service, not isolation: `agent-sandbox-cli/tests/daemon.rs` runs them on the container tier).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{kind, start};
use sandbox_server::ServerConfig;

const SHELL: &str = r#"{"spec": {"language": "shell"}}"#;

/// Waits until the pools hold `n` ready sandboxes (they fill in the background).
async fn ready(r: &common::Running, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while r.server.warm_stats().ready < n {
        assert!(
            Instant::now() < deadline,
            "the pools never held {n} ready sandboxes: {:?}",
            r.server.warm_stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_created_again_comes_from_its_pool() {
    let r = start(ServerConfig::default().warm(2).allow_host_access(true)).await;
    assert_eq!(r.server.warm_stats().pools, 0, "a pool before any create");
    // The first create is a plain one; its spec gets a pool.
    let (code, first) = r.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    assert_eq!(code, 201, "{first}");
    assert_eq!(r.server.warm_stats().pools, 1);
    ready(&r, 2).await;
    let (code, second) = r.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    assert_eq!(code, 201, "{second}");
    let s = r.server.warm_stats();
    assert_eq!((s.hits, s.misses), (1, 0), "{s:?}");
    // A pooled sandbox is a sandbox like any other: listed, usable, destroyed.
    let id = second["id"].as_str().unwrap();
    let (code, out) = r
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(r#"{"argv": ["sh", "-c", "echo pooled"]}"#),
        )
        .await;
    assert_eq!(
        (code, out["stdout"].as_str()),
        (200, Some("pooled\n")),
        "{out}"
    );
    let (_, list) = r.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(list["sandboxes"].as_array().unwrap().len(), 2, "{list}");
    // Another tier asked for, and a spec reaching into the host, are not this pool's.
    let dir = tempfile::tempdir().unwrap();
    let host = format!(
        r#"{{"spec": {{"language": "shell", "workspace": {{"kind": "host-dir", "path": "{}", "read_only": false}}}}}}"#,
        dir.path().display()
    );
    let (code, v) = r.json("POST", "/v1/sandboxes", Some(&host)).await;
    assert_eq!(code, 201, "{v}");
    assert_eq!(
        r.server.warm_stats().pools,
        1,
        "a host directory got a pool"
    );
    // Shutdown destroys what the pools hold.
    let server = r.server.clone();
    r.stop().await;
    assert_eq!(server.warm_stats(), Default::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_runs_once_and_leaves_nothing() {
    let r = start(ServerConfig::default().warm(1).build("build-a")).await;
    let body = r#"{"spec": {"language": "shell"}, "command": {"argv": ["sh", "-c", "echo out; echo err >&2; exit 3"]}}"#;
    for round in 0..3 {
        let (code, v) = r.json("POST", "/v1/run", Some(body)).await;
        assert_eq!(code, 200, "round {round}: {v}");
        assert_eq!(v["result"]["exit_code"], 3, "{v}");
        assert_eq!(v["result"]["stdout"], "out\n", "{v}");
        assert_eq!(v["result"]["stderr"], "err\n", "{v}");
        assert_eq!(v["tier"], "unisolated", "{v}");
        assert!(v["network"].as_array().is_some(), "{v}");
        let phases: Vec<&str> = v["result"]["timeline"]["phases"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p["phase"].as_str())
            .collect();
        assert_eq!(phases.last(), Some(&"first-command"), "{v}");
        // The sandbox was never in the table and is gone.
        let (_, list) = r.json("GET", "/v1/sandboxes", None).await;
        assert_eq!(list["sandboxes"].as_array().unwrap().len(), 0, "{list}");
        if round == 0 {
            ready(&r, 1).await;
        }
    }
    assert!(
        r.server.warm_stats().hits >= 1,
        "{:?}",
        r.server.warm_stats()
    );
    // The same build runs; another is refused before anything runs.
    let same =
        r#"{"spec": {"language": "shell"}, "command": {"argv": ["true"]}, "build": "build-a"}"#;
    let (code, v) = r.json("POST", "/v1/run", Some(same)).await;
    assert_eq!(code, 200, "{v}");
    let other =
        r#"{"spec": {"language": "shell"}, "command": {"argv": ["true"]}, "build": "build-b"}"#;
    let (code, v) = r.json("POST", "/v1/run", Some(other)).await;
    assert_eq!((code, kind(&v)), (409, "build_mismatch"), "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("build-a"),
        "{v}"
    );
    // Bad input: a clear error (400, or 422 for JSON of the wrong shape), and the server
    // goes on.
    for (bad, want) in [
        (
            r#"{"spec": {"language": "shell"}, "command": {"argv": ["true"], "code": "x"}}"#,
            400,
        ),
        (r#"{"spec": {"language": "shell"}, "command": {}}"#, 400),
        (
            r#"{"spec": {"language": "shell"}, "command": {"argv": ["sh"], "tty": {"rows": 24, "cols": 80}}}"#,
            400,
        ),
        (r#"{"spec": {"language": "shell"}}"#, 422),
        (
            r#"{"spec": {"language": "shell"}, "command": {"argv": ["true"]}, "extra": 1}"#,
            422,
        ),
        (r#"{"spec": "#, 400),
    ] {
        let (code, v) = r.json("POST", "/v1/run", Some(bad)).await;
        assert_eq!((code, kind(&v)), (want, "bad_request"), "{bad}: {v}");
    }
    // Host access is refused as for a create.
    let dir = tempfile::tempdir().unwrap();
    let host = format!(
        r#"{{"spec": {{"language": "shell", "workspace": {{"kind": "host-dir", "path": "{}", "read_only": false}}}}, "command": {{"argv": ["true"]}}}}"#,
        dir.path().display()
    );
    let (code, v) = r.json("POST", "/v1/run", Some(&host)).await;
    assert_eq!((code, kind(&v)), (403, "forbidden"), "{v}");
    let (code, v) = r.json("POST", "/v1/run", Some(same)).await;
    assert_eq!(code, 200, "the server stopped serving runs: {v}");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_count_against_the_sandbox_limit() {
    let r = start(ServerConfig::default().max_sandboxes(1)).await;
    let (code, v) = r.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    assert_eq!(code, 201, "{v}");
    let run = r#"{"spec": {"language": "shell"}, "command": {"argv": ["true"]}}"#;
    let (code, v) = r.json("POST", "/v1/run", Some(run)).await;
    assert_eq!((code, kind(&v)), (429, "resource_exhausted"), "{v}");
    let (_, list) = r.json("GET", "/v1/sandboxes", None).await;
    let held = list["sandboxes"][0]["id"].as_str().unwrap().to_string();
    let (code, _) = r
        .call("DELETE", &format!("/v1/sandboxes/{held}"), None)
        .await;
    assert_eq!(code, 204);
    let (code, v) = r.json("POST", "/v1/run", Some(run)).await;
    assert_eq!(code, 200, "{v}");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destroy_that_does_not_wait() {
    let r = start(ServerConfig::default()).await;
    assert!(r.server.idle_for().is_some(), "busy before any request");
    let (_, v) = r.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(r.server.idle_for(), None, "idle while holding a sandbox");
    let (code, v) = r
        .json("DELETE", &format!("/v1/sandboxes/{id}?wait=maybe"), None)
        .await;
    assert_eq!((code, kind(&v)), (400, "bad_request"), "{v}");
    let (code, _) = r
        .call("DELETE", &format!("/v1/sandboxes/{id}?wait=false"), None)
        .await;
    assert_eq!(code, 204);
    // Out of use at once: no request reaches it.
    let (code, v) = r.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!((code, kind(&v)), (404, "not_found"), "{v}");
    let (code, _) = r
        .call("DELETE", &format!("/v1/sandboxes/{id}?wait=false"), None)
        .await;
    assert_eq!(code, 404, "a second destroy found it");
    let idle = r
        .server
        .idle_for()
        .expect("busy after the last sandbox went");
    assert!(
        idle < std::time::Duration::from_secs(60),
        "{idle:?}: not since the last request"
    );
    // Shutdown waits for the teardowns still running.
    r.stop().await;
}
