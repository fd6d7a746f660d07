//! A client with a valid token plays the attacker against a real server on loopback, driven
//! by `curl`: a snapshot upload whose manifest states a size to allocate, network policies
//! that would open the server's own loopback and private networks. Each attack is refused with
//! a clear error and the server goes on serving.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::{curl, kind, start, Running};
use sandbox_server::ServerConfig;

fn store_config(dir: &std::path::Path) -> ServerConfig {
    let store = sandbox_core::ObjectSnapshotStore::local(dir).unwrap();
    ServerConfig::default().snapshot_store(Arc::new(store))
}

/// `POST` of raw bytes (a tar) to `path`.
async fn post_bytes(r: &Running, path: &str, body: &[u8]) -> (u16, String) {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), body).unwrap();
    curl(vec![
        "-X".into(),
        "POST".into(),
        "-H".into(),
        r.auth(),
        "-H".into(),
        "Content-Type: application/x-tar".into(),
        "--data-binary".into(),
        format!("@{}", file.path().display()),
        format!("{}{path}", r.base),
    ])
    .await
}

/// A snapshot upload of 2.5 KB whose manifest says its artifact is 16 TiB (and whose tar
/// header agrees): the server once allocated that before reading a byte, and aborted with
/// every client's sandboxes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_upload_stating_a_huge_size_is_refused_and_the_server_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let r = start(store_config(dir.path())).await;
    let huge: u64 = 1 << 44;
    let manifest = serde_json::json!({
        "format_version": 1,
        "tier": "unisolated",
        "engine": "test",
        "kinds": [],
        "spec": {"language": "shell"},
        "created": "2026-01-01T00:00:00Z",
        "artifacts": {"fs.tar": {"sha256": "00".repeat(32), "size": huge}},
    });
    let json = serde_json::to_vec(&manifest).unwrap();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(json.len() as u64);
    h.set_mode(0o600);
    h.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut h, "manifest.json", &json[..]).unwrap();
    let mut h = tar::Header::new_gnu();
    h.set_path("artifacts/fs.tar").unwrap();
    h.set_size(huge);
    h.set_mode(0o600);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    b.get_mut().extend_from_slice(h.as_bytes());
    b.get_mut().extend_from_slice(&[0u8; 1024]);
    let body = b.into_inner().unwrap();
    assert!(body.len() < 4096, "{}", body.len());

    let (code, text) = post_bytes(&r, "/v1/snapshots", &body).await;
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("more than the whole upload"), "{text}");
    // Still serving.
    let (code, v) = r
        .json(
            "POST",
            "/v1/sandboxes",
            Some(r#"{"spec": {"language": "shell"}}"#),
        )
        .await;
    assert_eq!(code, 201, "{v}");
    r.stop().await;
}

/// A client's network policy that lists the server's loopback or private space is refused
/// wherever a policy enters (create, run, a policy change), naming the operator's flag; with
/// the flag it is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_policy_cannot_open_the_servers_own_networks() {
    let r = start(ServerConfig::default()).await;
    let policies = [
        r#"{"mode": "allow", "cidrs": ["127.0.0.0/8"]}"#,
        r#"{"mode": "allow", "cidrs": ["10.0.0.0/8"]}"#,
        r#"{"mode": "allow", "hosts": ["example.com"], "cidrs": ["::ffff:127.0.0.1/128"]}"#,
        r#"{"mode": "allow-internet", "private": ["192.168.0.0/16"]}"#,
        r#"{"mode": "allow-internet", "private": ["fd00::/8"]}"#,
    ];
    for p in policies {
        let spec = format!(r#"{{"spec": {{"language": "shell", "network": {p}}}}}"#);
        let (code, v) = r.json("POST", "/v1/sandboxes", Some(&spec)).await;
        assert_eq!((code, kind(&v)), (403, "forbidden"), "{p}: {v}");
        assert!(v.to_string().contains("--allow-private-networks"), "{v}");
        let run = format!(
            r#"{{"spec": {{"language": "shell", "network": {p}}}, "command": {{"argv": ["true"]}}}}"#
        );
        let (code, v) = r.json("POST", "/v1/run", Some(&run)).await;
        assert_eq!((code, kind(&v)), (403, "forbidden"), "run {p}: {v}");
    }
    // A policy change on a live sandbox.
    let (code, info) = r
        .json(
            "POST",
            "/v1/sandboxes",
            Some(r#"{"spec": {"language": "shell"}}"#),
        )
        .await;
    assert_eq!(code, 201, "{info}");
    let id = info["id"].as_str().unwrap();
    let (code, v) = r
        .json(
            "PUT",
            &format!("/v1/sandboxes/{id}/network"),
            Some(policies[0]),
        )
        .await;
    assert_eq!((code, kind(&v)), (403, "forbidden"), "{v}");
    // Public ranges and names are the client's to allow.
    let (code, v) = r
        .call(
            "PUT",
            &format!("/v1/sandboxes/{id}/network"),
            Some(r#"{"mode": "allow", "hosts": ["example.com"], "cidrs": ["0.0.0.0/0"]}"#),
        )
        .await;
    assert!(code == 204 || code == 501, "{code} {v}");
    r.stop().await;

    // The operator's grant.
    let r = start(ServerConfig::default().allow_private_networks(true)).await;
    let spec = format!(
        r#"{{"spec": {{"language": "shell", "network": {}}}}}"#,
        policies[0]
    );
    let (code, v) = r.json("POST", "/v1/sandboxes", Some(&spec)).await;
    assert_ne!(kind(&v), "forbidden", "{code} {v}");
    // The metadata endpoint as a registry stays refused even then.
    let spec = r#"{"spec": {"language": "python", "image": "169.254.169.254/x/y:1"}}"#;
    let (code, v) = r.json("POST", "/v1/sandboxes", Some(spec)).await;
    assert_eq!((code, kind(&v)), (403, "forbidden"), "{v}");
    r.stop().await;
}

/// A client naming an image on the server's loopback (a plain-HTTP request to any loopback
/// port: server-side request forgery) or private network is refused, naming the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_make_the_server_pull_from_its_own_networks() {
    let r = start(ServerConfig::default()).await;
    for image in [
        "127.0.0.1:2375/v2/x:1",
        "localhost:5000/app:v1",
        "[::1]:5000/app:v1",
        "10.0.0.7:443/team/app:v1",
        "169.254.169.254/latest/meta:1",
        // Other spellings of loopback a resolver or HTTP client accepts.
        "127.1:5000/app:v1",
        "2130706433:443/app:v1",
        "0x7f.0.0.1/app:v1",
        "127.0.0.1./app:v1",
        "localhost./app:v1",
    ] {
        let spec = format!(r#"{{"spec": {{"language": "python", "image": "{image}"}}}}"#);
        let (code, v) = r.json("POST", "/v1/sandboxes", Some(&spec)).await;
        assert_eq!((code, kind(&v)), (403, "forbidden"), "{image}: {v}");
        assert!(v.to_string().contains("registry"), "{v}");
    }
    r.stop().await;
}

/// At connect time the process-wide guard a server installs refuses loopback, private space
/// and the host's own addresses whatever a policy says (names resolve there too: this is what
/// the egress proxy consults for every resolved address).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_process_refuses_its_networks_at_connect_time() {
    let r = start(ServerConfig::default()).await;
    let guard = sandbox_core::ServerNetworks::current().expect("the server installed its guard");
    let open: sandbox_core::NetworkPolicy =
        serde_json::from_str(r#"{"mode": "allow", "cidrs": ["127.0.0.0/8", "0.0.0.0/0"]}"#)
            .unwrap();
    for ip in ["127.0.0.1", "::1", "10.0.0.1", "64:ff9b::7f00:1"] {
        let d = open.decide(None, ip.parse().unwrap(), 80);
        assert!(!d.allowed, "{ip}: {d:?}");
    }
    assert!(guard.refuses("127.0.0.53".parse().unwrap()).is_some());
    r.stop().await;
}

/// A client's own snapshot, sent back as an upload, restores as files (the unisolated tier's
/// restore takes files alone); the same claiming memory state, which a memory tier's restore
/// would trust, is refused naming the operator's grant, even with the server's MAC copied in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploaded_snapshot_never_feeds_a_restore_that_would_trust_it() {
    let dir = tempfile::tempdir().unwrap();
    let r = start(store_config(dir.path())).await;
    let (code, info) = r
        .json(
            "POST",
            "/v1/sandboxes",
            Some(r#"{"spec": {"language": "shell"}}"#),
        )
        .await;
    assert_eq!(code, 201, "{info}");
    let id = info["id"].as_str().unwrap();
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
    let sid = snap["id"].as_str().unwrap();
    let (_, m) = r
        .call("GET", &format!("/v1/snapshots/{sid}/manifest"), None)
        .await;
    let mut manifest: sandbox_core::SnapshotManifest = serde_json::from_str(&m).unwrap();
    assert!(
        manifest
            .metadata
            .contains_key(sandbox_server::signing::MAC_KEY),
        "the server signs its own: {m}"
    );
    let mut artifacts = std::collections::BTreeMap::new();
    for name in manifest.artifacts.keys() {
        let out = tempfile::NamedTempFile::new().unwrap();
        let (code, _) = curl(vec![
            "-H".into(),
            r.auth(),
            "-o".into(),
            out.path().display().to_string(),
            format!("{}/v1/snapshots/{sid}/artifacts/{name}", r.base),
        ])
        .await;
        assert_eq!(code, 200);
        artifacts.insert(
            name.clone(),
            bytes::Bytes::from(std::fs::read(out.path()).unwrap()),
        );
    }

    // As it was: files only, restorable.
    let tar = sandbox_server::api::write_snapshot_tar(&manifest, &artifacts).unwrap();
    let (code, up) = post_bytes(&r, "/v1/snapshots", &tar).await;
    assert_eq!(code, 201, "{up}");
    let up: serde_json::Value = serde_json::from_str(&up).unwrap();
    let (code, v) = r
        .json(
            "POST",
            &format!("/v1/snapshots/{}/restore", up["id"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!(code, 201, "{v}");

    // Claiming memory state, the server's MAC still in its metadata: refused.
    manifest.kinds.push(sandbox_core::SnapshotKind::FullMemory);
    let tar = sandbox_server::api::write_snapshot_tar(&manifest, &artifacts).unwrap();
    let (code, up) = post_bytes(&r, "/v1/snapshots", &tar).await;
    assert_eq!(code, 201, "{up}");
    let up: serde_json::Value = serde_json::from_str(&up).unwrap();
    let uid = up["id"].as_str().unwrap();
    for how in ["restore", "fork"] {
        let body = (how == "fork").then_some(r#"{"count": 1}"#);
        let (code, v) = r
            .json("POST", &format!("/v1/snapshots/{uid}/{how}"), body)
            .await;
        assert_eq!((code, kind(&v)), (403, "forbidden"), "{how}: {v}");
        assert!(v.to_string().contains("--allow-host-access"), "{v}");
    }
    r.stop().await;
}

/// One JSON-RPC message to `/mcp` (streamable HTTP): (response headers, body).
async fn mcp_post(r: &Running, session: Option<&str>, body: &str) -> (String, String) {
    let headers = tempfile::NamedTempFile::new().unwrap();
    let mut a = vec![
        "-X".into(),
        "POST".into(),
        "-H".into(),
        r.auth(),
        "-H".into(),
        "Content-Type: application/json".into(),
        "-H".into(),
        "Accept: application/json, text/event-stream".into(),
        "-D".into(),
        headers.path().display().to_string(),
        "--data-binary".into(),
        body.to_string(),
    ];
    if let Some(s) = session {
        a.extend(["-H".into(), format!("Mcp-Session-Id: {s}")]);
    }
    a.push(format!("{}/mcp", r.base));
    let (_, text) = curl(a).await;
    (std::fs::read_to_string(headers.path()).unwrap(), text)
}

/// A snapshot a client wrote into its own store (files only, so any tier restores it), whose
/// spec carries what a create would be refused (the server's environment): the MCP `restore`
/// tool checks it as the API's restore does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_restore_checks_the_snapshots_spec_as_a_create_would() {
    let dir = tempfile::tempdir().unwrap();
    let r = start(store_config(dir.path())).await;
    // The client writes into the store directly.
    let store = sandbox_core::ObjectSnapshotStore::local(dir.path()).unwrap();
    let spec: sandbox_core::SandboxSpec =
        serde_json::from_str(r#"{"language": "shell", "pass_env": ["HOME"]}"#).unwrap();
    let draft = sandbox_core::SnapshotDraft::new(
        sandbox_core::Tier::Unisolated,
        "test",
        vec![sandbox_core::SnapshotKind::Filesystem],
        spec,
    );
    let sid = sandbox_core::SnapshotStore::put(&store, draft)
        .await
        .unwrap();

    let init = r#"{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "attacker", "version": "1"}}}"#;
    let (headers, body) = mcp_post(&r, None, init).await;
    assert!(body.contains("serverInfo"), "{headers}\n{body}");
    let session = headers
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("mcp-session-id")
                .then(|| v.trim().to_string())
        })
        .expect("a session id");
    mcp_post(
        &r,
        Some(&session),
        r#"{"jsonrpc": "2.0", "method": "notifications/initialized"}"#,
    )
    .await;
    let call = format!(
        r#"{{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {{"name": "restore", "arguments": {{"snapshot": "{sid}"}}}}}}"#
    );
    let (_, body) = mcp_post(&r, Some(&session), &call).await;
    assert!(body.contains("pass_env"), "{body}");
    assert!(body.contains("--allow-host-access"), "{body}");
    assert!(!body.contains("session: "), "restored: {body}");
    r.stop().await;
}
