//! envd's directory watching, played by a hostile client and hostile code in the sandbox:
//! paths that leave the workspace (absolute, `..`, a symlink the sandbox planted), watchers
//! of another sandbox, too many watchers, a flood of events, a client that leaves a stream,
//! a sandbox killed under an open stream.

use super::*;

/// A unary call of envd's filesystem service on `sb`.
async fn fs(s: &E2b, sb: &Sb, method: &str, msg: &Value) -> Resp {
    s.rpc(sb, &format!("filesystem.Filesystem/{method}"), msg)
        .await
}

/// Runs `script` (bash, in the sandbox's workspace) to its end; it must succeed.
pub(super) async fn run(s: &E2b, sb: &Sb, script: &str) {
    let mut st = s.start(sb, script).await;
    loop {
        match st.next().await {
            Next::Envelope(0, v) if v["event"]["end"].is_object() => {
                assert_eq!(v["event"]["end"]["exitCode"], 0, "{script}: {v}");
            }
            Next::Envelope(0, _) => {}
            Next::Envelope(_, v) => {
                assert!(v.get("error").is_none(), "{script}: {v}");
                return;
            }
            Next::Closed => panic!("{script}: the stream was cut"),
        }
    }
}

/// A `WatchDir` request for `path` on `sb`.
fn watch_dir_request(sb: &Sb, path: &str) -> Vec<u8> {
    envd_request(
        &sb.id,
        Some(&sb.token),
        &[("Content-Type", "application/connect+json")],
        "POST",
        "/filesystem.Filesystem/WatchDir",
        &envelope(0, json!({ "path": path }).to_string().as_bytes()),
    )
}

/// A new polled watcher of `path`; its id.
async fn watcher(s: &E2b, sb: &Sb, path: &str, recursive: bool) -> String {
    let r = fs(
        s,
        sb,
        "CreateWatcher",
        &json!({ "path": path, "recursive": recursive }),
    )
    .await;
    assert_eq!(r.status, 200, "CreateWatcher {path}: {}", r.text());
    r.json()["watcherId"].as_str().unwrap().to_string()
}

/// `(type, name)` of each event `GetWatcherEvents` returned.
fn events(r: &Resp) -> Vec<(String, String)> {
    assert_eq!(r.status, 200, "GetWatcherEvents: {}", r.text());
    r.json()["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap().to_string(),
                e["name"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Paths out of the workspace (absolute, `..`, through a symlink the sandbox made to `/`),
/// a file, a missing directory, entries asked for: each refused with its own Connect code,
/// as a unary call and as a stream; another sandbox's watcher id is unknown there; what code
/// inside changes beneath a good watch is seen, new subdirectories included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_stay_in_the_workspace_and_in_their_sandbox() {
    let s = serve_spawning(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    run(
        &s,
        &sb,
        "mkdir -p d/sub && ln -s / d/escape && echo x > d/file",
    )
    .await;
    for (path, status, code) in [
        ("/etc", 400, "invalid_argument"),
        ("/", 400, "invalid_argument"),
        ("/workspace/../etc", 400, "invalid_argument"),
        ("../../etc", 400, "invalid_argument"),
        ("d/escape", 400, "invalid_argument"),
        ("d/escape/etc", 400, "invalid_argument"),
        ("d/file", 400, "invalid_argument"),
        ("d/missing", 404, "not_found"),
    ] {
        let r = fs(&s, &sb, "CreateWatcher", &json!({ "path": path })).await;
        assert_rpc_error(&r, status, code, &format!("CreateWatcher {path}"));
        let r = s.send(&watch_dir_request(&sb, path)).await;
        assert_stream_error(&r, code, &format!("WatchDir {path}"));
    }
    let r = fs(
        &s,
        &sb,
        "CreateWatcher",
        &json!({ "path": "d", "includeEntry": true }),
    )
    .await;
    assert_rpc_error(&r, 501, "unimplemented", "entries asked for");

    let id = watcher(&s, &sb, "d", true).await;
    let other = s.create(&s.a).await;
    for method in ["GetWatcherEvents", "RemoveWatcher"] {
        let r = fs(&s, &other, method, &json!({ "watcherId": id })).await;
        assert_rpc_error(
            &r,
            404,
            "not_found",
            &format!("{method} of another sandbox's"),
        );
        let r = fs(&s, &sb, method, &json!({ "watcherId": "nope" })).await;
        assert_rpc_error(&r, 404, "not_found", &format!("{method} of an unknown id"));
    }

    // Made and filled at once by code inside: the new directory's entries are seen too.
    run(
        &s,
        &sb,
        "mkdir d/new && echo hi > d/new/x && echo y >> d/sub/z",
    )
    .await;
    let got = events(&fs(&s, &sb, "GetWatcherEvents", &json!({ "watcherId": id })).await);
    for want in [
        ("EVENT_TYPE_CREATE", "new"),
        ("EVENT_TYPE_CREATE", "new/x"),
        ("EVENT_TYPE_CREATE", "sub/z"),
        ("EVENT_TYPE_WRITE", "sub/z"),
    ] {
        assert!(
            got.iter().any(|(t, n)| (t.as_str(), n.as_str()) == want),
            "{want:?} not among {got:?}"
        );
    }
    assert!(
        !got.iter().any(|(_, n)| n.starts_with("escape/")),
        "the watch followed the sandbox's symlink to /: {got:?}"
    );
    let r = fs(&s, &sb, "RemoveWatcher", &json!({ "watcherId": id })).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = fs(&s, &sb, "GetWatcherEvents", &json!({ "watcherId": id })).await;
    assert_rpc_error(&r, 404, "not_found", "a removed watcher");
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

/// A sandbox's watchers are capped (polled and streams together), a stream's place is
/// freed when its client leaves, a flood of events from code inside is held to the bound
/// and its loss reported, and a kill ends an open stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_are_capped_and_floods_bounded() {
    const CAP: usize = 32;
    const MAX_QUEUED: usize = 4096;
    // The client's budget of requests in flight (envd's count in) well above the race, so
    // the watchers' cap is what meets it.
    let mut config = ServerConfig::default();
    config.max_requests_per_client = 4 * CAP;
    let s = serve_spawning(config).await;
    let sb = s.create(&s.a).await;
    run(&s, &sb, "mkdir -p d").await;
    // Twice the cap at once, polled and streams mixed: exactly the cap succeed (each place
    // is taken before its watch is made, so racing requests cannot pass the count together).
    let mut racing = tokio::task::JoinSet::new();
    for i in 0..2 * CAP {
        let (addr, sb) = (s.addr, sb.clone());
        racing.spawn(async move {
            if i % 2 == 0 {
                let raw = envd_request(
                    &sb.id,
                    Some(&sb.token),
                    &[("Content-Type", "application/json")],
                    "POST",
                    "/filesystem.Filesystem/CreateWatcher",
                    json!({ "path": "d" }).to_string().as_bytes(),
                );
                let r = h1::exchange(addr, &raw).await.unwrap();
                if r.status == 200 {
                    (
                        Some(r.json()["watcherId"].as_str().unwrap().to_string()),
                        None,
                    )
                } else {
                    assert_rpc_error(&r, 429, "resource_exhausted", "a racing watcher");
                    (None, None)
                }
            } else {
                let mut st = h1::Stream::open(addr, &watch_dir_request(&sb, "d")).await;
                match st.next().await {
                    Next::Envelope(0, v) if v["start"].is_object() => (None, Some(st)),
                    Next::Envelope(2, v) => {
                        assert_eq!(v["error"]["code"], "resource_exhausted", "{v}");
                        (None, None)
                    }
                    other => panic!("a racing stream: {other:?}"),
                }
            }
        });
    }
    let (mut polled, mut open) = (Vec::new(), Vec::new());
    while let Some(r) = racing.join_next().await {
        let (id, st) = r.unwrap();
        polled.extend(id);
        open.extend(st);
    }
    assert_eq!(
        polled.len() + open.len(),
        CAP,
        "{} polled and {} streams got places",
        polled.len(),
        open.len()
    );
    for id in polled {
        let r = fs(&s, &sb, "RemoveWatcher", &json!({ "watcherId": id })).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // The streams' clients leave; their places come back at their next event.
    drop(open);
    eventually("the racing streams' places are freed", || {
        let (s, sb) = (&s, &sb);
        async move {
            run(s, sb, "touch d/race").await;
            let mut got = Vec::new();
            for _ in 0..CAP {
                let r = fs(s, sb, "CreateWatcher", &json!({ "path": "d" })).await;
                if r.status != 200 {
                    break;
                }
                got.push(r.json()["watcherId"].as_str().unwrap().to_string());
            }
            let all = got.len() == CAP;
            for id in got {
                fs(s, sb, "RemoveWatcher", &json!({ "watcherId": id })).await;
            }
            all
        }
    })
    .await;

    let mut ids = Vec::new();
    for _ in 0..CAP {
        ids.push(watcher(&s, &sb, "d", false).await);
    }
    let r = fs(&s, &sb, "CreateWatcher", &json!({ "path": "d" })).await;
    assert_rpc_error(&r, 429, "resource_exhausted", "one watcher too many");
    let r = s.send(&watch_dir_request(&sb, "d")).await;
    assert_stream_error(&r, "resource_exhausted", "one stream too many");

    // A stream takes a removed watcher's place...
    let last = ids.pop().unwrap();
    let r = fs(&s, &sb, "RemoveWatcher", &json!({ "watcherId": last })).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let mut st = h1::Stream::open(s.addr, &watch_dir_request(&sb, "d")).await;
    assert_eq!(st.status, 200);
    match st.next().await {
        Next::Envelope(0, v) => assert!(v["start"].is_object(), "{v}"),
        other => panic!("no start message: {other:?}"),
    }
    run(&s, &sb, "touch d/seen").await;
    match st.next().await {
        Next::Envelope(0, v) => assert_eq!(v["filesystem"]["name"], "seen", "{v}"),
        other => panic!("no event: {other:?}"),
    }
    let r = fs(&s, &sb, "CreateWatcher", &json!({ "path": "d" })).await;
    assert_rpc_error(&r, 429, "resource_exhausted", "the stream counts");
    // ...and gives it back when its client leaves (noticed at its next event).
    drop(st);
    eventually("a left stream's place is freed", || {
        let (s, sb) = (&s, &sb);
        async move {
            run(s, sb, "touch d/poke").await;
            let r = fs(s, sb, "CreateWatcher", &json!({ "path": "d" })).await;
            r.status == 200
        }
    })
    .await;

    // A flood from inside: more events than a watcher holds.
    let flood = MAX_QUEUED + 2000;
    run(
        &s,
        &sb,
        &format!("cd d && i=0; while [ $i -lt {flood} ]; do : > f$i; i=$((i+1)); done"),
    )
    .await;
    let (mut total, mut lost) = (0, false);
    for _ in 0..3 {
        let r = fs(&s, &sb, "GetWatcherEvents", &json!({ "watcherId": ids[0] })).await;
        if r.status == 200 {
            total += events(&r).len();
        } else {
            assert_rpc_error(&r, 429, "resource_exhausted", "the flood's loss");
            lost = true;
        }
    }
    assert!(lost, "{flood} files made, {total} events, no loss reported");
    assert!(total <= MAX_QUEUED, "{total} events held for one watcher");
    s.assert_serves(Some(&sb)).await;

    // A kill ends an open stream.
    let r = fs(&s, &sb, "RemoveWatcher", &json!({ "watcherId": ids[1] })).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let mut st = h1::Stream::open(s.addr, &watch_dir_request(&sb, "d")).await;
    assert!(matches!(st.next().await, Next::Envelope(0, _)));
    s.kill(&s.a, &sb).await;
    loop {
        match st.next().await {
            Next::Envelope(0, _) => continue,
            Next::Envelope(2, v) => {
                assert!(v.is_object(), "{v}");
                break;
            }
            Next::Closed => break,
            other => panic!("{other:?}"),
        }
    }
    s.assert_serves(None).await;
    s.stop().await;
}
