//! E2B's sandbox logs, asked for by a client with a valid key: only its own sandboxes',
//! garbage queries refused in E2B's shape, filters and directions as documented.

use super::*;

/// The messages of a logs answer's `key` list, in its order.
fn messages(r: &Resp, key: &str) -> Vec<String> {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["message"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_the_owners_bounded_and_filtered() {
    let s = serve_spawning(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    super::watch::run(&s, &sb, "echo hello-from-the-log-test").await;
    let (a, b) = (s.a.reveal(), s.b.reveal());
    let v1 = format!("/sandboxes/{}/logs", sb.id);
    let v2 = format!("/v2/sandboxes/{}/logs", sb.id);

    let all = messages(&s.api(Some(a), "GET", &v2, None).await, "logs");
    assert_eq!(
        all,
        ["sandbox created", "process started", "process ended"],
        "oldest first"
    );
    let r = s.api(Some(a), "GET", &v1, None).await;
    assert_eq!(messages(&r, "logEntries"), all);
    let lines = r.json()["logs"].clone();
    assert!(
        lines[1]["line"]
            .as_str()
            .unwrap()
            .contains("hello-from-the-log-test"),
        "{lines}"
    );
    let back = messages(
        &s.api(
            Some(a),
            "GET",
            &format!("{v2}?direction=backward&limit=2"),
            None,
        )
        .await,
        "logs",
    );
    assert_eq!(back, ["process ended", "process started"], "newest first");
    let found = messages(
        &s.api(Some(a), "GET", &format!("{v2}?search=hello-from"), None)
            .await,
        "logs",
    );
    assert_eq!(found, ["process started"]);
    let warn = messages(
        &s.api(Some(a), "GET", &format!("{v2}?level=warn"), None)
            .await,
        "logs",
    );
    assert!(warn.is_empty(), "{warn:?}");
    let future = messages(
        &s.api(Some(a), "GET", &format!("{v1}?start=99999999999999"), None)
            .await,
        "logEntries",
    );
    assert!(future.is_empty(), "{future:?}");

    for q in [
        "limit=1001",
        "limit=-1",
        "cursor=yesterday",
        "direction=sideways",
        "level=loud",
    ] {
        let r = s.api(Some(a), "GET", &format!("{v2}?{q}"), None).await;
        assert_e2b_error(&r, 400, q);
    }
    let r = s.api(Some(a), "GET", &format!("{v1}?start=-5"), None).await;
    assert_e2b_error(&r, 400, "a negative start");
    // Another client's sandbox is not found; no key is a 401.
    for path in [&v1, &v2] {
        let r = s.api(Some(b), "GET", path, None).await;
        assert_e2b_error(&r, 404, "another client's sandbox");
        let r = s.api(None, "GET", path, None).await;
        assert_eq!(r.status, 401, "{}", r.text());
    }
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}
