//! The API driven by `curl`, a client nobody here wrote, against a real server on loopback
//! (and on a Unix socket). The sandboxes come from the test-only unisolated backend: this
//! suite tests the service (routes, auth, errors, streaming, shutdown), not isolation; the
//! facade's `tests/serve.rs` runs the CLI's server on a real tier.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::{curl, kind, start, unisolated, Running};
use sandbox_server::{Listener, Server, ServerConfig, Token};

const SHELL: &str = r#"{"spec": {"language": "shell"}, "labels": {"team": "red"}}"#;

// Multi-threaded: curl runs on blocking threads while the server serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_exec_files_list_stream_and_destroy() {
    let r = start(ServerConfig::default()).await;
    let (code, info) = r.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    assert_eq!(code, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    assert_eq!(info["tier"], "unisolated");
    assert_eq!(info["labels"]["team"], "red");

    let (code, out) = r
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(r#"{"code": "echo hi; echo err >&2; cat; exit 3", "stdin": "in"}"#),
        )
        .await;
    assert_eq!(code, 200, "{out}");
    assert_eq!(
        (&out["stdout"], &out["stderr"], &out["exit_code"]),
        (&"hi\nin".into(), &"err\n".into(), &3.into())
    );

    // Files: in, out, listed; an escaping path refused.
    let (code, _) = r
        .call(
            "PUT",
            &format!("/v1/sandboxes/{id}/files/dir/note.txt"),
            Some("hello"),
        )
        .await;
    assert_eq!(code, 204);
    let (code, text) = r
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/files/dir/note.txt"),
            None,
        )
        .await;
    assert_eq!((code, text.as_str()), (200, "hello"));
    let (code, list) = r
        .json("GET", &format!("/v1/sandboxes/{id}/list?path=dir"), None)
        .await;
    assert_eq!(code, 200, "{list}");
    assert_eq!(list["entries"][0]["name"], "note.txt");
    let (code, e) = r
        .json(
            "GET",
            &format!("/v1/sandboxes/{id}/files/..%2F..%2Fetc%2Fpasswd"),
            None,
        )
        .await;
    assert_eq!((code, kind(&e)), (400, "path_escape"), "{e}");

    // Listing and finding by label.
    let (_, other) = r
        .json(
            "POST",
            "/v1/sandboxes",
            Some(r#"{"spec": {"language": "shell"}}"#),
        )
        .await;
    let (_, all) = r.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(all["sandboxes"].as_array().unwrap().len(), 2);
    let (_, red) = r.json("GET", "/v1/sandboxes?label=team=red", None).await;
    let red = red["sandboxes"].as_array().unwrap();
    assert_eq!((red.len(), &red[0]["id"]), (1, &id.clone().into()));

    // Streaming: events as they come, then the exit.
    let (code, sse) = r
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec/stream"),
            Some(r#"{"code": "echo one; sleep 0.2; echo two >&2; exit 4"}"#),
        )
        .await;
    assert_eq!(code, 200);
    let one = sse
        .find("event: stdout\ndata: {\"text\":\"one\\n\"}")
        .unwrap();
    let two = sse
        .find("event: stderr\ndata: {\"text\":\"two\\n\"}")
        .unwrap();
    let exit = sse.find("event: exit\ndata: {\"exit_code\":4").unwrap();
    assert!(one < two && two < exit, "{sse}");

    // Destroy: gone from the list, and then unknown.
    let (code, _) = r.call("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(code, 204);
    let (code, e) = r.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!((code, kind(&e)), (404, "not_found"));
    let (code, e) = r.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!((code, kind(&e)), (404, "not_found"));

    // Shutdown destroys what is left.
    assert_eq!(r.server.sandbox_ids(), [other["id"].as_str().unwrap()]);
    let server = r.server.clone();
    r.stop().await;
    assert!(server.sandbox_ids().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_the_server_goes_on() {
    let r = start(ServerConfig::default().body_limit(1 << 16)).await;
    // No token, a wrong token.
    let (code, e) = curl(vec![format!("{}/v1/sandboxes", r.base)]).await;
    let e: serde_json::Value = serde_json::from_str(&e).unwrap();
    assert_eq!((code, kind(&e)), (401, "unauthorized"));
    let (code, _) = curl(vec![
        "-H".into(),
        format!("Authorization: Bearer {}x", r.token.reveal()),
        format!("{}/v1/sandboxes", r.base),
    ])
    .await;
    assert_eq!(code, 401);
    // Malformed JSON, an unknown field, a bad spec, a body over the limit.
    let (code, e) = r.json("POST", "/v1/sandboxes", Some("{not json")).await;
    assert_eq!((code, kind(&e)), (400, "bad_request"), "{e}");
    let (code, e) = r
        .json(
            "POST",
            "/v1/sandboxes",
            Some(r#"{"spec": {"language": "shell"}, "tire": "wasm"}"#),
        )
        .await;
    assert_eq!((code, kind(&e)), (422, "bad_request"), "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("tire"),
        "{e}"
    );
    // A spec reaching into the server's host is refused, naming what.
    for (spec, what) in [
        (
            r#"{"language": "shell", "mounts": [{"source": "/etc", "target": "/h"}]}"#,
            "mounts",
        ),
        (r#"{"language": "shell", "pass_env": ["HOME"]}"#, "pass_env"),
        (r#"{"language": "shell", "rootfs": "/"}"#, "rootfs"),
        (
            r#"{"language": "shell", "image": "oci:/var/lib/x"}"#,
            "local path",
        ),
    ] {
        let body = format!(r#"{{"spec": {spec}}}"#);
        let (code, e) = r.json("POST", "/v1/sandboxes", Some(&body)).await;
        assert_eq!((code, kind(&e)), (403, "forbidden"), "{spec}: {e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(what),
            "{e}"
        );
    }
    let (code, e) = r
        .json(
            "POST",
            "/v1/sandboxes",
            Some(r#"{"spec": {"language": "klingon"}}"#),
        )
        .await;
    assert!((400..500).contains(&code), "{code} {e}");
    let big = format!(
        r#"{{"spec": {{"language": "shell"}}, "labels": {{"x": "{}"}}}}"#,
        "y".repeat(1 << 17)
    );
    let (code, e) = r.json("POST", "/v1/sandboxes", Some(&big)).await;
    assert_eq!((code, kind(&e)), (413, "too_large"), "{e}");
    // Unknown ids and routes; exec with both argv and code.
    let (code, e) = r.json("GET", "/v1/sandboxes/nope", None).await;
    assert_eq!((code, kind(&e)), (404, "not_found"));
    let (code, e) = r.json("GET", "/v1/nothing-here", None).await;
    assert_eq!((code, kind(&e)), (404, "not_found"));
    let (_, info) = r.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    let id = info["id"].as_str().unwrap();
    let (code, e) = r
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(r#"{"argv": ["true"], "code": "true"}"#),
        )
        .await;
    assert_eq!((code, kind(&e)), (400, "bad_request"), "{e}");
    // A client that leaves in the middle of a stream: the server goes on.
    let _ = curl(vec![
        "--max-time".into(),
        "1".into(),
        "-X".into(),
        "POST".into(),
        "-H".into(),
        r.auth(),
        "--data-binary".into(),
        r#"{"code": "echo start; sleep 5"}"#.into(),
        format!("{}/v1/sandboxes/{id}/exec/stream", r.base),
    ])
    .await;
    let (code, out) = r
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(r#"{"argv": ["echo", "alive"]}"#),
        )
        .await;
    assert_eq!((code, out["stdout"].as_str()), (200, Some("alive\n")));
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_limit_is_kept_and_said() {
    let r = start(ServerConfig::default().max_sandboxes(1)).await;
    let (code, _) = r.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    assert_eq!(code, 201);
    let (code, e) = r.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    assert_eq!((code, kind(&e)), (429, "resource_exhausted"), "{e}");
    assert_eq!(r.server.sandbox_ids().len(), 1);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_operation_is_routed_and_the_document_is_served() {
    let r = start(ServerConfig::default()).await;
    let (code, doc) = r.json("GET", "/v1/openapi.json", None).await;
    assert_eq!((code, &doc["openapi"]), (200, &"3.1.0".into()));
    for (method, path) in sandbox_server::openapi::OPERATIONS {
        let path = path
            .replace("{id}", "no-such-sandbox")
            .replace("{sid}", &"0".repeat(64))
            .replace("{name}", "fs.tar")
            .replace("{path}", "a/b");
        let (_, text) = r.call(&method.to_uppercase(), &path, Some("{}")).await;
        assert!(!text.contains("no endpoint"), "{method} {path}: {text}");
    }
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_needs_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let server = Server::new(unisolated(), ServerConfig::default());
    let l = tokio::net::UnixListener::bind(&sock).unwrap();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let s = server.clone();
    let task = tokio::spawn(async move {
        s.serve(Listener::Unix(l), async {
            let _ = rx.await;
        })
        .await
    });
    let (code, body) = curl(vec![
        "--unix-socket".into(),
        sock.display().to_string(),
        "-X".into(),
        "POST".into(),
        "--data-binary".into(),
        SHELL.into(),
        "-H".into(),
        "Content-Type: application/json".into(),
        "http://sandbox/v1/sandboxes".into(),
    ])
    .await;
    assert_eq!(code, 201, "{body}");
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    assert!(server.sandbox_ids().is_empty());
}

fn store_config(dir: &std::path::Path) -> ServerConfig {
    let store = sandbox_core::ObjectSnapshotStore::local(dir).unwrap();
    ServerConfig::default().snapshot_store(Arc::new(store))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_restore_fork_and_delete() {
    let dir = tempfile::tempdir().unwrap();
    let r = start(store_config(dir.path()).max_sandboxes(6)).await;
    let (_, info) = r.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    let id = info["id"].as_str().unwrap().to_string();
    let (code, _) = r
        .call(
            "PUT",
            &format!("/v1/sandboxes/{id}/files/state.txt"),
            Some("v1"),
        )
        .await;
    assert_eq!(code, 204);

    let (code, snap) = r
        .json("POST", &format!("/v1/sandboxes/{id}/snapshot"), None)
        .await;
    assert_eq!(code, 201, "{snap}");
    let sid = snap["id"].as_str().unwrap().to_string();
    assert_eq!((sid.len(), &snap["tier"]), (64, &"unisolated".into()));
    let (code, list) = r.json("GET", "/v1/snapshots", None).await;
    assert_eq!(code, 200);
    assert_eq!(list["snapshots"][0]["id"], sid.as_str(), "{list}");
    let (code, one) = r.json("GET", &format!("/v1/snapshots/{sid}"), None).await;
    assert_eq!((code, &one["id"]), (200, &sid.as_str().into()));

    // Restore (no body): a new sandbox with the file, naming where it came from.
    let (code, restored) = r
        .json("POST", &format!("/v1/snapshots/{sid}/restore"), None)
        .await;
    assert_eq!(code, 201, "{restored}");
    assert_eq!(restored["from_snapshot"], sid.as_str());
    let rid = restored["id"].as_str().unwrap();
    assert_ne!(rid, id);
    let (_, text) = r
        .call("GET", &format!("/v1/sandboxes/{rid}/files/state.txt"), None)
        .await;
    assert_eq!(text, "v1");

    // Fork: three at once, labelled, each with its own copy.
    let (code, forked) = r
        .json(
            "POST",
            &format!("/v1/snapshots/{sid}/fork"),
            Some(r#"{"count": 3, "labels": {"run": "fork"}}"#),
        )
        .await;
    assert_eq!(code, 201, "{forked}");
    let ids: Vec<String> = forked["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids.len(), 3);
    let (code, _) = r
        .call(
            "PUT",
            &format!("/v1/sandboxes/{}/files/state.txt", ids[0]),
            Some("v2"),
        )
        .await;
    assert_eq!(code, 204);
    for (i, f) in ids.iter().enumerate() {
        let (_, text) = r
            .call("GET", &format!("/v1/sandboxes/{f}/files/state.txt"), None)
            .await;
        assert_eq!(text, if i == 0 { "v2" } else { "v1" });
    }
    let (_, by_label) = r.json("GET", "/v1/sandboxes?label=run=fork", None).await;
    assert_eq!(by_label["sandboxes"].as_array().unwrap().len(), 3);

    // Bad forks: none made.
    for (body, want) in [
        (r#"{"count": 0}"#, 400),
        (r#"{"count": 65}"#, 400),
        (r#"{"count": 2, "colour": "red"}"#, 422),
        // 5 live, room for 6: two more do not fit.
        (r#"{"count": 2}"#, 429),
    ] {
        let (code, e) = r
            .json("POST", &format!("/v1/snapshots/{sid}/fork"), Some(body))
            .await;
        assert_eq!(code, want, "{body}: {e}");
    }
    let (_, all) = r.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(all["sandboxes"].as_array().unwrap().len(), 5);

    // Unknown and malformed snapshot ids; a deleted snapshot is gone.
    for bad in ["0".repeat(64), "not-an-id".to_string()] {
        let (code, e) = r
            .json("POST", &format!("/v1/snapshots/{bad}/restore"), None)
            .await;
        assert_eq!((code, kind(&e)), (404, "not_found"), "{e}");
    }
    let (code, _) = r
        .call("DELETE", &format!("/v1/snapshots/{sid}"), None)
        .await;
    assert_eq!(code, 204);
    let (code, e) = r
        .json("POST", &format!("/v1/snapshots/{sid}/restore"), None)
        .await;
    assert_eq!((code, kind(&e)), (404, "not_found"), "{e}");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_store_snapshots_are_unsupported_and_pause_is_named() {
    let r = start(ServerConfig::default()).await;
    let (_, info) = r.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    let id = info["id"].as_str().unwrap().to_string();
    let (code, e) = r
        .json("POST", &format!("/v1/sandboxes/{id}/snapshot"), None)
        .await;
    assert_eq!((code, kind(&e)), (501, "unsupported"), "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--state-dir"),
        "{e}"
    );
    let (code, e) = r.json("GET", "/v1/snapshots", None).await;
    assert_eq!((code, kind(&e)), (501, "unsupported"), "{e}");
    // This tier has no pause: said, and the sandbox goes on.
    let (code, e) = r
        .json("POST", &format!("/v1/sandboxes/{id}/pause"), None)
        .await;
    assert_eq!((code, kind(&e)), (501, "unsupported"), "{e}");
    let (code, _) = r
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(r#"{"argv": ["true"]}"#),
        )
        .await;
    assert_eq!(code, 200);
    r.stop().await;
}

/// Polls (10 s at most) until sandbox `id` is gone (404).
async fn gone(r: &Running, id: &str) -> bool {
    for _ in 0..100 {
        let (code, _) = r.call("GET", &format!("/v1/sandboxes/{id}"), None).await;
        if code == 404 {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_and_idle_timeouts_destroy_and_use_is_never_idle() {
    let r =
        start(ServerConfig::default().reap_interval(std::time::Duration::from_millis(50))).await;
    // A TTL ends it.
    let (code, info) = r
        .json(
            "POST",
            "/v1/sandboxes",
            Some(r#"{"spec": {"language": "shell"}, "lifetime": {"ttl_s": 1}}"#),
        )
        .await;
    assert_eq!(code, 201, "{info}");
    assert_eq!(info["lifetime"]["ttl_s"], 1);
    let ttl_id = info["id"].as_str().unwrap().to_string();

    // An idle timeout of 1 s does not end a sandbox running a 3 s command...
    let (_, info) = r
        .json(
            "POST",
            "/v1/sandboxes",
            Some(r#"{"spec": {"language": "shell"}, "lifetime": {"idle_timeout_s": 1}}"#),
        )
        .await;
    let id = info["id"].as_str().unwrap().to_string();
    let (code, out) = r
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(r#"{"code": "sleep 3; echo done"}"#),
        )
        .await;
    assert_eq!((code, &out["stdout"]), (200, &"done\n".into()), "{out}");
    // ...and ends it once it idles.
    assert!(gone(&r, &id).await, "the idle sandbox was not destroyed");
    assert!(gone(&r, &ttl_id).await, "the TTL did not end its sandbox");
    let (code, e) = r
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(r#"{"argv": ["true"]}"#),
        )
        .await;
    assert_eq!((code, kind(&e)), (404, "not_found"), "{e}");

    // Pausing when idle on a tier without pause is refused up front, nothing left behind.
    let (code, e) = r
        .json(
            "POST",
            "/v1/sandboxes",
            Some(r#"{"spec": {"language": "shell"}, "lifetime": {"idle_timeout_s": 5, "on_idle": "pause"}}"#),
        )
        .await;
    assert_eq!((code, kind(&e)), (501, "unsupported"), "{e}");
    for bad in [r#"{"ttl_s": 0}"#, r#"{"idle_timeout_s": 0}"#] {
        let body = format!(r#"{{"spec": {{"language": "shell"}}, "lifetime": {bad}}}"#);
        let (code, e) = r.json("POST", "/v1/sandboxes", Some(&body)).await;
        assert_eq!(code, 400, "{bad}: {e}");
    }
    let (code, e) = r
        .json(
            "POST",
            "/v1/sandboxes",
            Some(r#"{"spec": {"language": "shell"}, "lifetime": {"on_idle": "sleep"}}"#),
        )
        .await;
    assert_eq!(code, 422, "{e}");
    let (_, all) = r.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(all["sandboxes"], serde_json::json!([]));
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_see_only_their_own_sandboxes_and_snapshots() {
    use sandbox_server::{Clients, ClientsError};
    let (a, b) = (Token::generate(), Token::generate());
    let clients = Clients::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())]).unwrap();
    assert!(matches!(
        Clients::new(vec![("a".into(), a.clone()), ("a".into(), b.clone())]),
        Err(ClientsError::SameName(n)) if n == "a"
    ));
    assert!(matches!(
        Clients::new(vec![("a".into(), a.clone()), ("c".into(), a.clone())]),
        Err(ClientsError::SameToken { .. })
    ));
    assert!(matches!(Clients::new(Vec::new()), Err(ClientsError::Empty)));

    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let config = ServerConfig::default()
        .client_snapshot_store(
            "a",
            Arc::new(sandbox_core::ObjectSnapshotStore::local(da.path()).unwrap()),
        )
        .client_snapshot_store(
            "b",
            Arc::new(sandbox_core::ObjectSnapshotStore::local(db.path()).unwrap()),
        )
        .max_requests_per_client(1);
    let server = Server::new(unisolated(), config);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let s = server.clone();
    let task = tokio::spawn(async move {
        s.serve(Listener::TcpClients(l, clients), async {
            let _ = rx.await;
        })
        .await
    });
    let as_client = |t: &Token| Running {
        base: base.clone(),
        token: t.clone(),
        stop: None,
        task: tokio::spawn(async { Ok(()) }),
        server: server.clone(),
    };
    let (ra, rb) = (as_client(&a), as_client(&b));

    let (code, info) = ra.json("POST", "/v1/sandboxes", Some(SHELL)).await;
    assert_eq!(code, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    let (_, snap) = ra
        .json("POST", &format!("/v1/sandboxes/{id}/snapshot"), None)
        .await;
    let sid = snap["id"].as_str().unwrap().to_string();
    // B: A's sandbox and snapshot do not exist.
    for (m, p) in [
        ("GET", format!("/v1/sandboxes/{id}")),
        ("POST", format!("/v1/sandboxes/{id}/exec")),
        ("DELETE", format!("/v1/sandboxes/{id}")),
        ("POST", format!("/v1/snapshots/{sid}/restore")),
        ("GET", format!("/v1/snapshots/{sid}/manifest")),
    ] {
        let body = (m == "POST").then_some(r#"{"argv": ["true"]}"#);
        let body = if p.ends_with("restore") { None } else { body };
        let (code, e) = rb.json(m, &p, body).await;
        assert_eq!((code, kind(&e)), (404, "not_found"), "B {m} {p}: {e}");
    }
    let (_, list) = rb.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(list["sandboxes"], serde_json::json!([]));
    let (_, snaps) = rb.json("GET", "/v1/snapshots", None).await;
    assert_eq!(snaps["snapshots"], serde_json::json!([]));
    // A still has both.
    let (code, _) = ra
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(r#"{"argv": ["true"]}"#),
        )
        .await;
    assert_eq!(code, 200);
    let (_, snaps) = ra.json("GET", "/v1/snapshots", None).await;
    assert_eq!(snaps["snapshots"].as_array().unwrap().len(), 1);

    // One request in flight per client: A's second waits its turn as a 429; B is served.
    let slow = {
        let ra = as_client(&a);
        let id = id.clone();
        tokio::spawn(async move {
            ra.json(
                "POST",
                &format!("/v1/sandboxes/{id}/exec"),
                Some(r#"{"code": "sleep 5"}"#),
            )
            .await
        })
    };
    // Asked until the slow one is in flight (it is for 5 s).
    let mut refused = serde_json::Value::Null;
    for _ in 0..40 {
        let (code, e) = ra.json("GET", "/v1/sandboxes", None).await;
        if code == 429 {
            refused = e;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(kind(&refused), "too_many_requests", "{refused}");
    let (code, _) = rb.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(code, 200);
    assert_eq!(slow.await.unwrap().0, 200);
    let (code, _) = ra.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(code, 200);
    let _ = stop.send(());
    task.await.unwrap().unwrap();
}
