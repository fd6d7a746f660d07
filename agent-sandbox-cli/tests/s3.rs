//! Snapshots in an object store shared by two servers (`serve --snapshot-store s3://...`):
//! a real S3 server (the `s3s-fs` crate's, on loopback, with SigV4 credentials), one
//! `agent-sandbox serve` taking a snapshot into it, then another server, with a state
//! directory of its own, listing and restoring it: a snapshot taken on one machine restores
//! on another.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod served;

use served::{container_available, curl, serve_with};

const KEY: &str = "AKIDAGENTSANDBOXTEST";
const SECRET: &str = "agent-sandbox-test-secret-key-0123456789";

/// An S3 server on loopback over `root` (a bucket is a directory in it), in a thread of its
/// own; its address.
fn s3_server(root: &std::path::Path) -> std::net::SocketAddr {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::server::conn::auto::Builder;
    let fs = s3s_fs::FileSystem::new(root).unwrap();
    let mut b = s3s::service::S3ServiceBuilder::new(fs);
    b.set_auth(s3s::auth::SimpleAuth::from_single(KEY, SECRET));
    let service = b.build();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(l).unwrap();
            loop {
                let (socket, _) = l.accept().await.unwrap();
                let service = service.clone();
                tokio::spawn(async move {
                    let _ = Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(socket), service)
                        .await;
                });
            }
        });
    });
    addr
}

#[test]
fn a_snapshot_taken_by_one_server_restores_on_another() {
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("snaps")).unwrap();
    let endpoint = format!("http://{}", s3_server(root.path()));
    let env = [
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
        ("AWS_ACCESS_KEY_ID", KEY),
        ("AWS_SECRET_ACCESS_KEY", SECRET),
        ("AWS_REGION", "us-east-1"),
    ];
    let store = ["--snapshot-store", "s3://snaps/team-a"];

    // Server one: a sandbox with a file, snapshotted into the bucket.
    let (one, _) = serve_with(tempfile::tempdir().unwrap(), &store, &env);
    let (code, info) = curl(
        &one,
        "POST",
        "/v1/sandboxes",
        Some(r#"{"spec": {"language": "shell"}, "tier": "container"}"#),
    );
    assert_eq!(code, 201, "{info}");
    let id = info["id"].as_str().unwrap();
    let (code, out) = curl(
        &one,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"code": "echo from-server-one > note.txt"}"#),
    );
    assert_eq!(code, 200, "{out}");
    let (code, snap) = curl(&one, "POST", &format!("/v1/sandboxes/{id}/snapshot"), None);
    assert_eq!(code, 201, "{snap}");
    let sid = snap["id"].as_str().unwrap().to_string();
    // It is in the bucket, under the prefix, not in the server's state directory.
    let in_bucket = walk(&root.path().join("snaps/team-a"));
    assert!(in_bucket.iter().any(|p| p.contains(&sid)), "{in_bucket:?}");
    assert!(walk(one.dir.path()).iter().all(|p| !p.contains(&sid)));
    drop(one);

    // Server two: another state directory, the same store.
    let (two, _) = serve_with(tempfile::tempdir().unwrap(), &store, &env);
    let (code, list) = curl(&two, "GET", "/v1/snapshots", None);
    assert_eq!(code, 200, "{list}");
    assert!(
        list["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["id"] == sid.as_str()),
        "{list}"
    );
    let (code, restored) = curl(&two, "POST", &format!("/v1/snapshots/{sid}/restore"), None);
    assert_eq!(code, 201, "{restored}");
    let rid = restored["id"].as_str().unwrap();
    let (code, out) = curl(
        &two,
        "POST",
        &format!("/v1/sandboxes/{rid}/exec"),
        Some(r#"{"code": "cat note.txt"}"#),
    );
    assert_eq!(
        (code, &out["stdout"]),
        (200, &"from-server-one\n".into()),
        "{out}"
    );

    // Wrong credentials: the snapshot fails with the store's reason; the server goes on.
    let bad = [
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
        ("AWS_ACCESS_KEY_ID", KEY),
        ("AWS_SECRET_ACCESS_KEY", "not-the-secret"),
        ("AWS_REGION", "us-east-1"),
    ];
    let (three, _) = serve_with(tempfile::tempdir().unwrap(), &store, &bad);
    let (code, e) = curl(&three, "GET", "/v1/snapshots", None);
    assert!(code >= 400, "{code} {e}");
    let (code, _) = curl(&three, "GET", "/v1/tiers", None);
    assert_eq!(code, 200);
}

/// Every file under `dir`, as paths.
fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.display().to_string());
            }
        }
    }
    out
}
