//! A hostile client holding a valid key plays the attacker against E2B's surface of a real
//! server on loopback (in process, over the test-only unisolated backend, as
//! `adversarial.rs`): the control plane (`X-API-Key: e2b_<token>`, two clients who must not
//! see each other's sandboxes), envd's gate (`E2b-Sandbox-Id` + `X-Access-Token`), the
//! Connect-RPC wire (malformed envelopes, wrong content types, oversized and unknown calls),
//! envd's process service under disconnects and races, and `/files`. Requests are written
//! by hand over `tokio::net::TcpStream` (HTTP/1.1), so malformed input reaches the server as
//! sent. Every wait is bounded by a deadline; nothing asserts how fast anything is.
//!
//! The unisolated backend has no background processes (`Sandbox::spawn` is `unimplemented`
//! there, which [`on_the_plain_backend_start_is_a_clear_unimplemented`] checks). The cases
//! that need a running process (a disconnect mid-stream, a kill racing a stream) use
//! [`spawning::Spawning`]: the same backend, with `spawn` and `signal` added by running the
//! command through the backend's own streaming exec (so the backend's destroy kills it; its
//! per-command wall time, 30 s by default, is longer than any test keeps a process).
//!
//! The test binary's allocator records the largest single allocation it was ever asked for,
//! so "a stated 4 GiB is never allocated" is checked, not assumed. Cases that reveal server

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sandbox_server::{Clients, Listener, OneBackend, Provider, Server, ServerConfig, Token};
use serde_json::{json, Value};

/// The longest any one exchange or wait may take before the test fails (a bound against
/// hangs, never a claim about speed).
const DEADLINE: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------
// The largest single allocation this test process ever asked for: a request stating a 4 GiB
// message must never become a 4 GiB allocation.

struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to `System` unchanged; the wrapper only records a size.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: `ptr` came from `System` through this allocator, with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// No allocation of this process (every test in it) ever reached 1 GiB.
fn assert_no_huge_allocation() {
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        largest < 1 << 30,
        "an allocation of {largest} bytes was made"
    );
}

// ---------------------------------------------------------------------------------------
// HTTP/1.1 by hand.

#[path = "e2b_adversarial/h1.rs"]
mod h1;

use h1::{Next, Resp};

/// A Connect envelope.
fn envelope(flags: u8, data: &[u8]) -> Vec<u8> {
    let mut v = vec![flags];
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

/// The envelopes of a whole streaming body.
fn envelopes(body: &[u8]) -> Vec<(u8, Value)> {
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        assert!(rest.len() >= 5, "a cut envelope head in {body:?}");
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let data = &rest[5..5 + len];
        out.push((rest[0], serde_json::from_slice(data).unwrap()));
        rest = &rest[5 + len..];
    }
    out
}

/// A streaming call's answer that is an error at once: one end-of-stream envelope (flag
/// `0x02`) whose error has `code`.
fn assert_stream_error(r: &Resp, code: &str, what: &str) {
    assert_eq!(r.status, 200, "{what}: {} {}", r.status, r.text());
    assert_eq!(
        r.header("content-type"),
        Some("application/connect+json"),
        "{what}"
    );
    let all = envelopes(&r.body);
    assert_eq!(all.len(), 1, "{what}: {all:?}");
    let (flags, v) = &all[0];
    assert_eq!(*flags, 0x02, "{what}: {v}");
    assert_eq!(v["error"]["code"], code, "{what}: {v}");
    assert!(v["error"]["message"].is_string(), "{what}: {v}");
}

/// A unary Connect error: its status and `{"code", "message"}`.
fn assert_rpc_error(r: &Resp, status: u16, code: &str, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.text());
    let v = r.json();
    assert_eq!(v["code"], code, "{what}: {v}");
    assert!(
        !v["message"].as_str().unwrap_or("").is_empty(),
        "{what}: {v}"
    );
}

/// An error of E2B's control plane: its status and `{"code": status, "message"}`.
fn assert_e2b_error(r: &Resp, status: u16, what: &str) -> String {
    assert_eq!(r.status, status, "{what}: {}", r.text());
    let v = r.json();
    assert_eq!(v["code"], status, "{what}: {v}");
    let m = v["message"].as_str().unwrap_or("");
    assert!(!m.is_empty(), "{what}: {v}");
    m.to_string()
}

// ---------------------------------------------------------------------------------------
// The server: two clients, `a` and `b`.

struct E2b {
    addr: SocketAddr,
    a: Token,
    b: Token,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// A sandbox as its E2B create answered: its id and envd access token.
#[derive(Clone, Debug)]
struct Sb {
    id: String,
    token: String,
}

async fn serve_with(provider: Arc<dyn Provider>, config: ServerConfig) -> E2b {
    let server = Server::new(provider, config);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (a, b) = (Token::generate(), Token::generate());
    let clients = Clients::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())]).unwrap();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        server
            .serve(Listener::TcpClients(l, clients), async {
                let _ = rx.await;
            })
            .await
    });
    E2b {
        addr,
        a,
        b,
        stop: Some(stop),
        task,
    }
}

/// Over the unisolated backend, as `adversarial.rs`.
async fn serve(config: ServerConfig) -> E2b {
    serve_with(common::unisolated(), config).await
}

/// Over the unisolated backend with background processes ([`spawning`]).
async fn serve_spawning(config: ServerConfig) -> E2b {
    let backend = spawning::Spawning(Arc::new(
        backend_unisolated::UnisolatedBackend::new_without_isolation(),
    ));
    serve_with(Arc::new(OneBackend(Arc::new(backend))), config).await
}

impl E2b {
    async fn send(&self, raw: &[u8]) -> Resp {
        h1::exchange(self.addr, raw).await.unwrap()
    }

    /// A control-plane call with `X-API-Key: e2b_<key>` (`None`: no key).
    async fn api(&self, key: Option<&str>, method: &str, path: &str, body: Option<&str>) -> Resp {
        let k = key.map(|k| format!("e2b_{k}"));
        let mut h: Vec<(&str, &str)> = Vec::new();
        if let Some(k) = &k {
            h.push(("X-API-Key", k));
        }
        if body.is_some() {
            h.push(("Content-Type", "application/json"));
        }
        self.send(&h1::request(
            method,
            path,
            &h,
            body.unwrap_or("").as_bytes(),
        ))
        .await
    }

    /// A sandbox of `base` for the client with `key`, its network off (the unisolated
    /// backend has no other network).
    async fn create(&self, key: &Token) -> Sb {
        let r = self
            .api(
                Some(key.reveal()),
                "POST",
                "/sandboxes",
                Some(r#"{"templateID": "base", "allow_internet_access": false, "timeout": 300}"#),
            )
            .await;
        assert_eq!(r.status, 201, "{}", r.text());
        let v = r.json();
        Sb {
            id: v["sandboxID"].as_str().unwrap().to_string(),
            token: v["envdAccessToken"].as_str().unwrap().to_string(),
        }
    }

    /// Kills `sb` through the control plane with `key` (it must be answered 204).
    async fn kill(&self, key: &Token, sb: &Sb) {
        let r = self
            .api(
                Some(key.reveal()),
                "DELETE",
                &format!("/sandboxes/{}", sb.id),
                None,
            )
            .await;
        assert_eq!(r.status, 204, "kill {}: {}", sb.id, r.text());
    }

    /// An envd request: `E2b-Sandbox-Id: id`, `X-Access-Token: token` if given, `extra`.
    #[allow(clippy::too_many_arguments)]
    async fn envd(
        &self,
        id: &str,
        token: Option<&str>,
        extra: &[(&str, &str)],
        method: &str,
        path: &str,
        body: &[u8],
    ) -> Resp {
        self.send(&envd_request(id, token, extra, method, path, body))
            .await
    }

    /// A unary Connect call of envd's process service on `sb`.
    async fn unary(&self, sb: &Sb, method: &str, msg: &Value) -> Resp {
        self.rpc(sb, &format!("process.Process/{method}"), msg)
            .await
    }

    /// A unary Connect call `service_method` (`filesystem.Filesystem/Stat`...) on `sb`.
    async fn rpc(&self, sb: &Sb, service_method: &str, msg: &Value) -> Resp {
        self.envd(
            &sb.id,
            Some(&sb.token),
            &[("Content-Type", "application/json")],
            "POST",
            &format!("/{service_method}"),
            msg.to_string().as_bytes(),
        )
        .await
    }

    /// The pids envd's `List` shows on `sb`.
    async fn pids(&self, sb: &Sb) -> Vec<u64> {
        let r = self.unary(sb, "List", &json!({})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["processes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["pid"].as_u64().unwrap())
            .collect()
    }

    /// Opens a `Start` stream of `script` (bash) on `sb`.
    async fn start(&self, sb: &Sb, script: &str) -> h1::Stream {
        let msg = json!({"process": {"cmd": "/bin/bash", "args": ["-c", script]}});
        let raw = envd_request(
            &sb.id,
            Some(&sb.token),
            &[("Content-Type", "application/connect+json")],
            "POST",
            "/process.Process/Start",
            &envelope(0, msg.to_string().as_bytes()),
        );
        let s = h1::Stream::open(self.addr, &raw).await;
        assert_eq!(s.status, 200);
        assert_eq!(s.header("content-type"), Some("application/connect+json"));
        s
    }

    /// The server answers a good control-plane request, and (given one) a good envd request.
    async fn assert_serves(&self, sb: Option<&Sb>) {
        let r = self
            .api(Some(self.a.reveal()), "GET", "/sandboxes", None)
            .await;
        assert_eq!(r.status, 200, "still serving: {}", r.text());
        assert!(r.json().is_array());
        if let Some(sb) = sb {
            let r = self
                .envd(&sb.id, Some(&sb.token), &[], "GET", "/health", b"")
                .await;
            assert_eq!(r.status, 204, "envd still serving: {}", r.text());
        }
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(DEADLINE, &mut self.task)
            .await
            .expect("the server stops within the deadline")
            .unwrap()
            .unwrap();
    }
}

fn envd_request(
    id: &str,
    token: Option<&str>,
    extra: &[(&str, &str)],
    method: &str,
    path: &str,
    body: &[u8],
) -> Vec<u8> {
    let mut h: Vec<(&str, &str)> = vec![("E2b-Sandbox-Id", id)];
    if let Some(t) = token {
        h.push(("X-Access-Token", t));
    }
    h.extend_from_slice(extra);
    h1::request(method, path, &h, body)
}

/// A `Connect` request following process `pid` of `sb`, with its token.
fn follow_request(sb: &Sb, pid: u64) -> Vec<u8> {
    envd_request(
        &sb.id,
        Some(&sb.token),
        &[("Content-Type", "application/connect+json")],
        "POST",
        "/process.Process/Connect",
        &envelope(0, json!({"process": {"pid": pid}}).to_string().as_bytes()),
    )
}

/// The pid in a `Start` stream's first message (its `start` event).
async fn started_pid(st: &mut h1::Stream) -> u64 {
    match st.next().await {
        Next::Envelope(0, v) => v["event"]["start"]["pid"].as_u64().unwrap(),
        other => panic!("no start event: {other:?}"),
    }
}

/// Whether host process `pid` runs (not gone, not a zombie). The unisolated backend's
/// processes are the host's, so envd's pids are host pids here.
fn host_process_runs(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|st| {
            st.rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Polls `check` until it is true, failing past the deadline.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let give_up = tokio::time::Instant::now() + DEADLINE;
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "{what}: not within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------
// A backend with background processes: the unisolated backend, its `spawn` added.

#[path = "e2b_adversarial/spawning.rs"]
mod spawning;

// Directory watching (`WatchDir` and the polled watchers).
#[path = "e2b_adversarial/watch.rs"]
mod watch;

// Signed file URLs (`download_url`, `upload_url`).
#[path = "e2b_adversarial/signed.rs"]
mod signed;

// Sandbox logs.
#[path = "e2b_adversarial/logs.rs"]
mod logs;

// =======================================================================================
// 1. The control plane.

/// A sandbox's envd requests count among its owner's requests in flight, as the API's do
/// (they carry the sandbox's token, not the client's): with a budget of one, envd's
/// `/health` while the owner's exec runs is a 429, and is answered once the exec ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_requests_count_among_their_owners_requests_in_flight() {
    let mut config = ServerConfig::default();
    config.max_requests_per_client = 1;
    let s = serve(config).await;
    let sb = s.create(&s.a).await;
    let path = format!("/v1/sandboxes/{}/exec", sb.id);
    let exec = async {
        // Again if the probe below held the one place at that moment.
        loop {
            let r = s
                .api(
                    Some(s.a.reveal()),
                    "POST",
                    &path,
                    Some(r#"{"code": "sleep 3"}"#),
                )
                .await;
            if r.status != 429 {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let probe = async {
        // Until the exec holds the client's one place (then for as long as it does).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let r = s
                .envd(&sb.id, Some(&sb.token), &[], "GET", "/health", b"")
                .await;
            if r.status == 429 || tokio::time::Instant::now() > deadline {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (done, busy) = tokio::join!(exec, probe);
    assert_eq!(done.status, 200, "the exec: {}", done.text());
    assert_eq!(busy.status, 429, "envd beside the exec: {}", busy.text());
    assert!(
        busy.text().contains("requests in flight"),
        "{}",
        busy.text()
    );
    let r = s
        .envd(&sb.id, Some(&sb.token), &[], "GET", "/health", b"")
        .await;
    assert_ne!(r.status, 429, "envd after the exec: {}", r.text());
    s.kill(&s.a, &sb).await;
    s.stop().await;
}

/// No key, a wrong key, and a sandbox's envd token presented as a key: 401, in E2B's shape
/// for a wrong `X-API-Key`, naming no sandbox; nothing is created; the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_refuses_missing_and_wrong_keys() {
    let s = serve(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;

    for (method, path) in [
        ("GET", "/sandboxes"),
        ("GET", "/v2/sandboxes"),
        ("POST", "/sandboxes"),
        ("GET", &*format!("/sandboxes/{}", sb.id)),
        ("DELETE", &*format!("/sandboxes/{}", sb.id)),
    ] {
        let body = (method == "POST").then_some(r#"{"templateID": "base"}"#);
        let r = s.api(None, method, path, body).await;
        assert_eq!(r.status, 401, "no key, {method} {path}: {}", r.text());
        assert!(!r.text().contains(&sb.id), "{}", r.text());

        let mut wrong = s.a.reveal().to_string().into_bytes();
        wrong[10] ^= 1;
        let wrong = String::from_utf8(wrong).unwrap();
        for key in [wrong.as_str(), "", "x", sb.token.as_str()] {
            let r = s.api(Some(key), method, path, body).await;
            let m = assert_e2b_error(&r, 401, &format!("key {key:?}, {method} {path}"));
            assert!(!r.text().contains(&sb.id), "{m}");
            assert!(!r.text().contains(s.a.reveal()), "{m}");
        }
    }
    // The bearer form of a wrong token: 401 as well (API v1's shape).
    let r = s
        .send(&h1::request(
            "GET",
            "/sandboxes",
            &[("Authorization", "Bearer nope")],
            b"",
        ))
        .await;
    assert_eq!(r.status, 401, "{}", r.text());

    // Nothing was created or killed by the refused calls.
    let r = s.api(Some(s.a.reveal()), "GET", "/sandboxes", None).await;
    let ids: Vec<_> = r
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["sandboxID"].clone())
        .collect();
    assert_eq!(ids, [json!(sb.id)], "{}", r.text());
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

/// Client B, with its own valid key, on client A's sandbox: every call is a 404 (as for a
/// sandbox that does not exist), A's sandbox is untouched, and B's lists never show it (nor
/// accept its id as a page token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_client_can_neither_see_nor_touch_a_sandbox() {
    let s = serve(ServerConfig::default()).await;
    let a = s.create(&s.a).await;
    let b = s.create(&s.b).await;
    let bk = s.b.reveal();
    let id = &a.id;
    for (method, path, body) in [
        ("GET", format!("/sandboxes/{id}"), None),
        ("DELETE", format!("/sandboxes/{id}"), None),
        ("POST", format!("/sandboxes/{id}/pause"), None),
        (
            "POST",
            format!("/sandboxes/{id}/resume"),
            Some(r#"{"timeout": 60}"#),
        ),
        (
            "POST",
            format!("/sandboxes/{id}/timeout"),
            Some(r#"{"timeout": 1}"#),
        ),
        (
            "POST",
            format!("/sandboxes/{id}/refreshes"),
            Some(r#"{"duration": 60}"#),
        ),
        (
            "POST",
            format!("/sandboxes/{id}/connect"),
            Some(r#"{"timeout": 60}"#),
        ),
        (
            "PUT",
            format!("/sandboxes/{id}/network"),
            Some(r#"{"denyOut": []}"#),
        ),
    ] {
        let r = s.api(Some(bk), method, &path, body).await;
        let m = assert_e2b_error(&r, 404, &format!("B {method} {path}"));
        assert!(!r.text().contains(&a.token), "{m}");
    }
    for path in [
        "/sandboxes".to_string(),
        "/v2/sandboxes".to_string(),
        "/v2/sandboxes?state=running,paused".to_string(),
        "/v2/sandboxes?order=asc&limit=100".to_string(),
    ] {
        let r = s.api(Some(bk), "GET", &path, None).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        let ids: Vec<Value> = r
            .json()
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["sandboxID"].clone())
            .collect();
        assert_eq!(ids, [json!(b.id)], "B's {path}");
    }
    // A's id as B's page token is no token of B's.
    let r = s
        .api(
            Some(bk),
            "GET",
            &format!("/v2/sandboxes?nextToken={id}"),
            None,
        )
        .await;
    assert_e2b_error(&r, 400, "A's id as B's nextToken");

    // A's sandbox: still there, running, its timeout not B's.
    let r = s
        .api(Some(s.a.reveal()), "GET", &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["envdAccessToken"], json!(a.token));
    let end = time::OffsetDateTime::parse(
        v["endAt"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    assert!(
        end - time::OffsetDateTime::now_utc() > time::Duration::seconds(60),
        "B's timeout of 1 s reached A's sandbox: {v}"
    );
    s.assert_serves(Some(&a)).await;
    s.stop().await;
}

/// Creates that must be refused, each in E2B's shape, and none of them makes a sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_creates_are_refused_in_e2b_shape() {
    let s = serve(ServerConfig::default()).await;
    let k = Some(s.a.reveal());

    let r = s
        .api(
            k,
            "POST",
            "/sandboxes",
            Some(r#"{"templateID": "no-such-template"}"#),
        )
        .await;
    let m = assert_e2b_error(&r, 404, "unknown template");
    assert!(m.contains("no-such-template") && m.contains("base"), "{m}");

    // Not JSON: 400. JSON of the wrong shape: 422 (the server's rule for every body).
    for bad in [
        "{",
        "{\"templateID\": ",
        "\u{0}",
        "{\"templateID\": \"base\",}",
    ] {
        let r = s.api(k, "POST", "/sandboxes", Some(bad)).await;
        assert_e2b_error(&r, 400, &format!("body {bad:?}"));
    }
    for bad in [
        "[1, 2]",
        "\"base\"",
        "{\"templateID\": 7}",
        "{\"templateID\": \"base\", \"metadata\": [1]}",
    ] {
        let r = s.api(k, "POST", "/sandboxes", Some(bad)).await;
        assert_e2b_error(&r, 422, &format!("body {bad:?}"));
    }
    for (t, status) in [
        ("0", 400),
        ("1000000000", 400),
        ("86401", 400),
        ("-1", 422),
        ("1e30", 422),
        ("\"60\"", 422),
    ] {
        let body =
            format!(r#"{{"templateID": "base", "allow_internet_access": false, "timeout": {t}}}"#);
        let r = s.api(k, "POST", "/sandboxes", Some(&body)).await;
        assert_e2b_error(&r, status, &format!("timeout {t}"));
    }
    for (field, body) in [
        ("mcp", r#"{"templateID": "base", "mcp": {"github": {}}}"#),
        (
            "volumeMounts",
            r#"{"templateID": "base", "volumeMounts": [{"name": "v", "path": "/data"}]}"#,
        ),
    ] {
        let r = s.api(k, "POST", "/sandboxes", Some(body)).await;
        let m = assert_e2b_error(&r, 501, field);
        assert!(m.contains(field), "{m}");
    }
    // The timeout of a live sandbox: past a day refused too.
    let sb = s.create(&s.a).await;
    for t in ["1000000000", "86401"] {
        let r = s
            .api(
                k,
                "POST",
                &format!("/sandboxes/{}/timeout", sb.id),
                Some(&format!(r#"{{"timeout": {t}}}"#)),
            )
            .await;
        assert_e2b_error(&r, 400, &format!("set timeout {t}"));
    }
    let r = s.api(k, "GET", "/v2/sandboxes", None).await;
    assert_eq!(r.json().as_array().unwrap().len(), 1, "{}", r.text());
    s.assert_serves(Some(&sb)).await;
    // 0 is "now" (E2B's `set_timeout(0)`): the sandbox ends at the reaper's next round.
    let path = format!("/sandboxes/{}/timeout", sb.id);
    let r = s.api(k, "POST", &path, Some(r#"{"timeout": 0}"#)).await;
    assert_eq!(r.status, 204, "{}", r.text());
    let gone = tokio::time::timeout(DEADLINE, async {
        loop {
            let r = s
                .api(k, "GET", &format!("/sandboxes/{}", sb.id), None)
                .await;
            if r.status == 404 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(gone.is_ok(), "a timeout of 0 left the sandbox running");
    s.stop().await;
}

/// What belongs to E2B's cloud: 501 with a message saying so, for any method.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_only_endpoints_say_501() {
    let s = serve(ServerConfig::default()).await;
    let k = Some(s.a.reveal());
    for path in [
        "/teams",
        "/api-keys",
        "/volumes",
        "/teams/t1/metrics",
        "/volumes/v1",
    ] {
        for method in ["GET", "POST", "DELETE"] {
            let body = (method == "POST").then_some("{}");
            let r = s.api(k, method, path, body).await;
            let m = assert_e2b_error(&r, 501, &format!("{method} {path}"));
            assert!(m.contains(path), "{m}");
        }
    }
    s.assert_serves(None).await;
    s.stop().await;
}

/// `GET /v2/sandboxes` with query values that are not what they should be: 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_list_queries_are_400() {
    let s = serve(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let k = Some(s.a.reveal());
    for q in [
        "nextToken=garbage",
        "nextToken=%00%ff",
        "nextToken=",
        "limit=0",
        "limit=101",
        "limit=-1",
        "limit=abc",
        "order=sideways",
        "state=dead",
        "metadata=novalue",
        "metadata=a%3D%ZZ",
        "surprise=1",
    ] {
        let r = s.api(k, "GET", &format!("/v2/sandboxes?{q}"), None).await;
        assert_e2b_error(&r, 400, q);
    }
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

// =======================================================================================
// 2. envd's gate.

/// envd's requests need the addressed sandbox's own access token: none, a wrong one,
/// another sandbox's (of another client), the client's API token, the sandbox's traffic
/// token: 401 `unauthenticated`. A sandbox id the server does not have (never, or no
/// longer) is a 502 in E2B's shape (as E2B's edge answers for a sandbox not running); a
/// port that is no number is 400 `invalid_argument`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_needs_the_sandboxs_own_token() {
    let s = serve(ServerConfig::default()).await;
    let a = s.create(&s.a).await;
    let b = s.create(&s.b).await;
    let list = |id: &str, token: Option<&str>, extra: &[(&str, &str)]| {
        let mut h = vec![("Content-Type", "application/json")];
        h.extend_from_slice(extra);
        envd_request(id, token, &h, "POST", "/process.Process/List", b"{}")
    };

    let r = s.send(&list(&a.id, None, &[])).await;
    assert_rpc_error(&r, 401, "unauthenticated", "no token");
    let mut wrong = a.token.clone().into_bytes();
    wrong[0] ^= 1;
    let wrong = String::from_utf8(wrong).unwrap();
    for (what, id, token) in [
        ("a wrong token", &a.id, wrong.as_str()),
        ("an empty token", &a.id, ""),
        (
            "A's token and a byte more",
            &a.id,
            &*format!("{}0", a.token),
        ),
        (
            "B's sandbox's token on A's sandbox",
            &a.id,
            b.token.as_str(),
        ),
        (
            "A's sandbox's token on B's sandbox",
            &b.id,
            a.token.as_str(),
        ),
        ("A's API token as an envd token", &a.id, s.a.reveal()),
        (
            "A's E2B API key as an envd token",
            &a.id,
            &*format!("e2b_{}", s.a.reveal()),
        ),
    ] {
        for port in [None, Some("49983")] {
            let extra: Vec<(&str, &str)> =
                port.map(|p| ("E2b-Sandbox-Port", p)).into_iter().collect();
            let r = s.send(&list(id, Some(token), &extra)).await;
            assert_rpc_error(&r, 401, "unauthenticated", what);
            assert!(!r.text().contains(&a.token), "{what}: {}", r.text());
            assert!(!r.text().contains(&b.token), "{what}: {}", r.text());
        }
    }
    // The files, health and env endpoints are behind the same gate.
    for path in ["/files?path=/etc/hostname", "/health", "/envs"] {
        let r = s.envd(&a.id, Some(&b.token), &[], "GET", path, b"").await;
        assert_rpc_error(&r, 401, "unauthenticated", path);
    }

    for id in ["no-such-sandbox", "../../v1/sandboxes", &"f".repeat(4096)] {
        let r = s.send(&list(id, Some(&a.token), &[])).await;
        let m = assert_e2b_error(&r, 502, "an unknown sandbox");
        assert!(!m.contains(&a.id), "{m}");
    }
    let r = s.send(&list("", Some(&a.token), &[])).await;
    assert_rpc_error(&r, 400, "invalid_argument", "an empty sandbox id");

    for port in ["notaport", "70000", "-1", "", "0x1f4"] {
        let r = s
            .send(&list(&a.id, Some(&a.token), &[("E2b-Sandbox-Port", port)]))
            .await;
        assert_rpc_error(&r, 400, "invalid_argument", &format!("port {port:?}"));
    }
    let r = s
        .send(&list(
            &a.id,
            Some(&a.token),
            &[("E2b-Sandbox-Port", "49983")],
        ))
        .await;
    assert_eq!(r.status, 200, "envd's own port: {}", r.text());

    // An envd token reaches envd only, never the control plane or API v1: the same request
    // paths with the sandbox's headers are envd's (404), and the sandbox lives on.
    for (method, path) in [
        ("DELETE", format!("/sandboxes/{}", a.id)),
        ("GET", "/sandboxes".to_string()),
        ("GET", "/v1/sandboxes".to_string()),
        ("DELETE", format!("/v1/sandboxes/{}", a.id)),
    ] {
        let r = s.envd(&a.id, Some(&a.token), &[], method, &path, b"").await;
        assert_rpc_error(&r, 404, "not_found", &format!("envd {method} {path}"));
    }
    let r = s
        .api(
            Some(s.a.reveal()),
            "GET",
            &format!("/sandboxes/{}", a.id),
            None,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());

    // A killed sandbox's token opens nothing.
    s.kill(&s.b, &b).await;
    let r = s.send(&list(&b.id, Some(&b.token), &[])).await;
    assert_e2b_error(&r, 502, "a killed sandbox");

    s.assert_serves(Some(&a)).await;
    s.stop().await;
}

/// Another port than envd's: E2B's default leaves it open to whoever knows the sandbox's id
/// (the request goes on to the port: on the unisolated backend, which cannot publish ports,
/// a 502 naming the port); with `allowPublicTraffic: false` it takes the sandbox's traffic
/// token, and neither the envd token nor another sandbox's traffic token is that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_ports_take_the_traffic_token_when_asked_to() {
    let s = serve(ServerConfig::default()).await;
    let open = s.create(&s.a).await;
    let made = |allow: bool| {
        format!(
            r#"{{"templateID": "base", "allow_internet_access": false,
                 "network": {{"allowPublicTraffic": {allow}}}}}"#
        )
    };
    let r = s
        .api(Some(s.a.reveal()), "POST", "/sandboxes", Some(&made(false)))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    let closed = Sb {
        id: v["sandboxID"].as_str().unwrap().to_string(),
        token: v["envdAccessToken"].as_str().unwrap().to_string(),
    };
    let traffic = v["trafficAccessToken"].as_str().unwrap().to_string();
    let r = s
        .api(Some(s.b.reveal()), "POST", "/sandboxes", Some(&made(false)))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let others = r.json()["trafficAccessToken"].as_str().unwrap().to_string();

    let get = |id: &str, headers: &[(&str, &str)]| {
        let mut h = vec![("E2b-Sandbox-Id", id), ("E2b-Sandbox-Port", "8080")];
        h.extend_from_slice(headers);
        h1::request("GET", "/", &h, b"")
    };
    // Open: no token at all goes through to the port.
    let r = s.send(&get(&open.id, &[])).await;
    let m = assert_e2b_error(&r, 502, "the open sandbox's port 8080");
    assert!(m.contains("8080"), "{m}");

    for (what, h) in [
        ("no token", vec![]),
        (
            "the envd token",
            vec![("X-Access-Token", closed.token.as_str())],
        ),
        (
            "the envd token as traffic token",
            vec![("e2b-traffic-access-token", closed.token.as_str())],
        ),
        (
            "another sandbox's traffic token",
            vec![("e2b-traffic-access-token", others.as_str())],
        ),
    ] {
        let r = s.send(&get(&closed.id, &h)).await;
        assert_rpc_error(&r, 401, "unauthenticated", what);
    }
    let r = s
        .send(&get(&closed.id, &[("e2b-traffic-access-token", &traffic)]))
        .await;
    let m = assert_e2b_error(&r, 502, "the closed sandbox's port with its traffic token");
    assert!(m.contains("8080"), "{m}");
    // The traffic token is no envd token.
    let r = s
        .envd(&closed.id, Some(&traffic), &[], "GET", "/health", b"")
        .await;
    assert_rpc_error(&r, 401, "unauthenticated", "the traffic token on envd");
    s.assert_serves(Some(&closed)).await;
    s.stop().await;
}

// =======================================================================================
// 3. The Connect wire.

/// `Start` with bodies that are no valid single envelope: each answered by one end-of-stream
/// envelope with the right code, nothing started, no allocation of a stated size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_start_envelopes_end_the_stream_with_the_right_code() {
    let s = serve(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let good = json!({"process": {"cmd": "/bin/true"}}).to_string();

    let mut huge = vec![0u8, 0xff, 0xff, 0xff, 0xff];
    huge.extend_from_slice(&[b'{'; 10]);
    let mut two = envelope(0, good.as_bytes());
    two.extend(envelope(0, good.as_bytes()));
    let mut over = vec![0u8];
    over.extend_from_slice(&((1u32 << 20) + 1).to_be_bytes());
    over.extend(std::iter::repeat_n(b' ', (1 << 20) + 1));
    let mut cut = envelope(0, good.as_bytes());
    cut.truncate(cut.len() - 3);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("a truncated header", vec![0, 0, 0], "invalid_argument"),
        ("an empty body", vec![], "invalid_argument"),
        ("4 GiB stated, 10 bytes sent", huge, "resource_exhausted"),
        ("1 MiB + 1 stated and sent", over, "resource_exhausted"),
        ("fewer bytes than stated", cut, "invalid_argument"),
        (
            "a compressed message",
            envelope(0x01, good.as_bytes()),
            "unimplemented",
        ),
        (
            "an end-of-stream envelope as the message",
            envelope(0x02, good.as_bytes()),
            "unimplemented",
        ),
        ("two messages", two, "invalid_argument"),
        (
            "invalid JSON",
            envelope(0, b"{\"process\": "),
            "invalid_argument",
        ),
        ("not an object", envelope(0, b"[1,2,3]"), "invalid_argument"),
        (
            "a config of the wrong type",
            envelope(0, br#"{"process": {"cmd": 7}}"#),
            "invalid_argument",
        ),
        (
            "no command",
            envelope(0, br#"{"process": {"cmd": ""}}"#),
            "invalid_argument",
        ),
        (
            "a cwd with NUL",
            envelope(
                0,
                br#"{"process": {"cmd": "/bin/true", "cwd": "/tmp/\u0000"}}"#,
            ),
            "invalid_argument",
        ),
    ];
    for (what, body, code) in cases {
        let r = s
            .envd(
                &sb.id,
                Some(&sb.token),
                &[("Content-Type", "application/connect+json")],
                "POST",
                "/process.Process/Start",
                &body,
            )
            .await;
        assert_stream_error(&r, code, what);
        assert_no_huge_allocation();
        s.assert_serves(Some(&sb)).await;
    }
    assert_eq!(s.pids(&sb).await, Vec::<u64>::new(), "nothing was started");
    s.stop().await;
}

/// An HTTP body that states 4 GiB (`Content-Length`) and whose envelope states 4 GiB too:
/// the server reads no more than its message limit before it refuses (`resource_exhausted`,
/// without waiting for the rest), or, when the client stops sending early, ends the call;
/// nothing of the stated size is allocated, and the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_stating_a_4_gib_body_allocates_nothing_of_the_sort() {
    let s = serve(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let head = |body: &[u8]| {
        envd_request(
            &sb.id,
            Some(&sb.token),
            &[
                ("Content-Type", "application/connect+json"),
                ("Content-Length", "4294967296"),
            ],
            "POST",
            "/process.Process/Start",
            body,
        )
    };
    // Past the limit: refused as it comes.
    let mut body = vec![0u8, 0xff, 0xff, 0xff, 0xff];
    body.extend(std::iter::repeat_n(b' ', (1 << 20) + (64 << 10)));
    let r = s.send(&head(&body)).await;
    assert_stream_error(
        &r,
        "resource_exhausted",
        "4 GiB stated, 1 MiB + 64 KiB sent",
    );
    assert_no_huge_allocation();

    // 10 bytes, then the client stops sending: the call ends (its body is cut short).
    let mut body = vec![0u8, 0xff, 0xff, 0xff, 0xff];
    body.extend_from_slice(b"{\"a\": 1}\r\n");
    match h1::exchange_with(s.addr, &head(&body), true).await {
        Ok(r) => assert_stream_error(&r, "invalid_argument", "4 GiB stated, 10 bytes sent"),
        // Or the server closed the connection on the cut body: also an end.
        Err(e) => eprintln!("the connection was closed: {e}"),
    }
    assert_no_huge_allocation();
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

/// Unary calls: a wrong content type is `invalid_argument`, a message over 1 MiB
/// `resource_exhausted`, a method envd does not have `unimplemented`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_calls_refuse_wrong_types_oversize_and_unknown_methods() {
    let s = serve(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let msg = br#"{"process": {"pid": 1}, "signal": "SIGNAL_SIGKILL"}"#;
    for ct in [
        None,
        Some("text/plain"),
        Some("application/connect+json"),
        Some("application/proto"),
        Some("application/x-www-form-urlencoded"),
    ] {
        let h: Vec<(&str, &str)> = ct.map(|c| ("Content-Type", c)).into_iter().collect();
        let r = s
            .envd(
                &sb.id,
                Some(&sb.token),
                &h,
                "POST",
                "/process.Process/SendSignal",
                msg,
            )
            .await;
        assert_rpc_error(&r, 400, "invalid_argument", &format!("content type {ct:?}"));
    }
    // A streaming method called as unary is refused the same way.
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &[("Content-Type", "application/json")],
            "POST",
            "/process.Process/Start",
            br#"{"process": {"cmd": "/bin/true"}}"#,
        )
        .await;
    assert_rpc_error(&r, 400, "invalid_argument", "Start as unary");

    // Over 1 MiB: one JSON string of 1 MiB + 1 KiB.
    let big = format!(
        r#"{{"process": {{"pid": 1}}, "input": {{"stdin": "{}"}}}}"#,
        "A".repeat((1 << 20) + 1024)
    );
    let r = s
        .unary(&sb, "SendInput", &serde_json::from_str(&big).unwrap())
        .await;
    assert_rpc_error(&r, 429, "resource_exhausted", "a 1 MiB message");
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &[("Content-Type", "application/json")],
            "POST",
            "/filesystem.Filesystem/Stat",
            big.as_bytes(),
        )
        .await;
    assert_rpc_error(&r, 429, "resource_exhausted", "a 1 MiB Stat");

    for path in [
        "/process.Process/Bogus",
        "/process.Process/start",
        "/filesystem.Filesystem/Bogus",
    ] {
        let r = s
            .envd(
                &sb.id,
                Some(&sb.token),
                &[("Content-Type", "application/json")],
                "POST",
                path,
                b"{}",
            )
            .await;
        assert_rpc_error(&r, 501, "unimplemented", path);
    }
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &[("Content-Type", "application/json")],
            "POST",
            "/no.Such/Service",
            b"{}",
        )
        .await;
    assert_rpc_error(&r, 404, "not_found", "an unknown service");
    assert_no_huge_allocation();
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

/// The unisolated backend has no background processes: `Start` ends its stream with a clear
/// `unimplemented`, and the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_plain_backend_start_is_a_clear_unimplemented() {
    let s = serve(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let body = envelope(
        0,
        json!({"process": {"cmd": "/bin/true"}})
            .to_string()
            .as_bytes(),
    );
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &[("Content-Type", "application/connect+json")],
            "POST",
            "/process.Process/Start",
            &body,
        )
        .await;
    assert_stream_error(&r, "unimplemented", "Start on the unisolated backend");
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

// =======================================================================================
// 4. A client that goes away in the middle of a stream.

/// A `Start` stream of an endless command whose client disconnects: the process keeps
/// running (envd's `List` shows it and a `Connect` follows its new output: a disconnect is
/// no kill), `SendSignal` kills it, and then `List` no longer shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_mid_stream_leaves_the_process_running_until_killed() {
    let s = serve_spawning(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let mut st = s.start(&sb, "while :; do echo x; sleep 0.05; done").await;
    let pid = started_pid(&mut st).await;
    match st.next().await {
        Next::Envelope(0, v) => assert_eq!(v["event"]["data"]["stdout"], "eAo=", "{v}"),
        other => panic!("{other:?}"),
    }
    drop(st);

    // Running after the disconnect: listed, and a new follower gets fresh output.
    assert_eq!(s.pids(&sb).await, [pid]);
    let follow = follow_request(&sb, pid);
    let mut f = h1::Stream::open(s.addr, &follow).await;
    assert_eq!(f.status, 200);
    match f.next().await {
        Next::Envelope(0, v) => assert_eq!(v["event"]["start"]["pid"], pid, "{v}"),
        other => panic!("{other:?}"),
    }
    for _ in 0..3 {
        match f.next().await {
            Next::Envelope(0, v) => assert!(v["event"]["data"]["stdout"].is_string(), "{v}"),
            other => panic!("{other:?}"),
        }
    }
    drop(f);
    assert_eq!(
        s.pids(&sb).await,
        [pid],
        "still running after two disconnects"
    );

    let r = s
        .unary(
            &sb,
            "SendSignal",
            &json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    eventually("the killed process leaves envd's list", || async {
        s.pids(&sb).await.is_empty()
    })
    .await;
    eventually("the killed process is gone", || async {
        !host_process_runs(pid)
    })
    .await;
    // Gone for good: a second kill names it not found.
    let r = s
        .unary(
            &sb,
            "SendSignal",
            &json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_rpc_error(&r, 404, "not_found", "a second kill");
    // Only processes started through envd can be signalled: not the server, not pid 1.
    for other in [u64::from(std::process::id()), 1] {
        let r = s
            .unary(
                &sb,
                "SendSignal",
                &json!({"process": {"pid": other}, "signal": "SIGNAL_SIGKILL"}),
            )
            .await;
        assert_rpc_error(&r, 404, "not_found", &format!("pid {other}"));
    }
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

// =======================================================================================
// 5. `/files`.

/// `GET /files` reads a path as the *sandbox* sees it, and that is the trust boundary: envd
/// is the sandbox's own file API, so any path the sandbox's user can read is the client's to
/// read (`/etc/passwd` included, and `..` cannot climb above the sandbox's `/`). The server
/// never resolves a client's path on its host: a path outside the workspace is read by a
/// helper command run *inside* the sandbox (`fs::helper`), under its isolation. On the
/// unisolated test backend that isolation is only a new network namespace (its processes
/// see the host's files as the test's user), so `/etc/passwd` here is the host's; on the
/// container and gVisor tiers it is the image's. That the read ran inside the sandbox shows
/// in `/proc/self/net/dev`: the reader's network namespace has only `lo`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_are_read_from_the_sandboxs_own_view() {
    let s = serve(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let host = std::fs::read("/etc/passwd").unwrap();
    for path in [
        "/etc/passwd",
        "/workspace/../../../../etc/passwd",
        "../../etc/passwd",
    ] {
        let r = s
            .envd(
                &sb.id,
                Some(&sb.token),
                &[],
                "GET",
                &format!("/files?path={path}"),
                b"",
            )
            .await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert_eq!(r.body, host, "{path}");
    }
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &[],
            "GET",
            "/files?path=/proc/self/net/dev",
            b"",
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let ifaces: Vec<String> = r
        .text()
        .lines()
        .skip(2)
        .filter_map(|l| l.split_once(':').map(|(i, _)| i.trim().to_string()))
        .collect();
    assert_eq!(
        ifaces,
        ["lo"],
        "read in the sandbox's network namespace: {}",
        r.text()
    );
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

/// `/files` with a NUL in the path (400), a multipart body whose boundary is broken (400),
/// a body over the server's body limit (413); a good write and read afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_file_requests_are_refused_and_the_server_goes_on() {
    const LIMIT: usize = 64 << 10;
    let s = serve(ServerConfig::default().body_limit(LIMIT)).await;
    let sb = s.create(&s.a).await;
    let octet = [("Content-Type", "application/octet-stream")];

    for q in ["path=/tmp/a%00b", "path=%00", "path=/workspace/x%00/../y"] {
        let r = s
            .envd(
                &sb.id,
                Some(&sb.token),
                &[],
                "GET",
                &format!("/files?{q}"),
                b"",
            )
            .await;
        assert_e2b_error(&r, 400, &format!("GET {q}"));
        let r = s
            .envd(
                &sb.id,
                Some(&sb.token),
                &octet,
                "POST",
                &format!("/files?{q}"),
                b"x",
            )
            .await;
        assert_e2b_error(&r, 400, &format!("POST {q}"));
    }
    let r = s
        .envd(&sb.id, Some(&sb.token), &[], "GET", "/files", b"")
        .await;
    assert_e2b_error(&r, 400, "no path");

    let part = |boundary: &str| {
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; \
             filename=\"up.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n\
             --{boundary}--\r\n"
        )
    };
    let a_nul_name = "--B\r\nContent-Disposition: form-data; name=\"file\"; \
                      filename=\"a\u{0}b\"\r\n\r\nhello\r\n--B--\r\n"
        .to_string();
    for (what, ct, body) in [
        (
            "another boundary than stated",
            "multipart/form-data; boundary=XYZ",
            part("ABC"),
        ),
        ("no boundary stated", "multipart/form-data", part("ABC")),
        (
            "an empty boundary",
            "multipart/form-data; boundary=",
            part("ABC"),
        ),
        (
            "a body cut inside its part",
            "multipart/form-data; boundary=ABC",
            part("ABC")[..60].to_string(),
        ),
        (
            "no closing boundary",
            "multipart/form-data; boundary=ABC",
            {
                let p = part("ABC");
                p[..p.len() - 9].to_string()
            },
        ),
        (
            "a file name with NUL",
            "multipart/form-data; boundary=B",
            a_nul_name,
        ),
    ] {
        let r = s
            .envd(
                &sb.id,
                Some(&sb.token),
                &[("Content-Type", ct)],
                "POST",
                "/files?path=/workspace/up.txt",
                body.as_bytes(),
            )
            .await;
        assert_e2b_error(&r, 400, what);
    }

    // Over the body limit, stated truthfully: as one file, and as a multipart part.
    let big = vec![b'z'; LIMIT + 1];
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &octet,
            "POST",
            "/files?path=/workspace/big",
            &big,
        )
        .await;
    assert_e2b_error(&r, 413, "an octet-stream body over the limit");
    let mut mp =
        b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big\"\r\n\r\n".to_vec();
    mp.extend_from_slice(&big);
    mp.extend_from_slice(b"\r\n--B--\r\n");
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &[("Content-Type", "multipart/form-data; boundary=B")],
            "POST",
            "/files",
            &mp,
        )
        .await;
    assert_e2b_error(&r, 413, "a multipart body over the limit");
    // Over the limit without saying so (chunked): refused as it comes.
    let mut raw = envd_request(
        &sb.id,
        Some(&sb.token),
        &[
            ("Content-Type", "application/octet-stream"),
            ("Transfer-Encoding", "chunked"),
            ("Content-Length", "ignored"),
        ],
        "POST",
        "/files?path=/workspace/big",
        b"",
    );
    // `Content-Length: ignored` would be a malformed request: drop that header.
    let text = String::from_utf8(raw.clone()).unwrap();
    raw = text.replace("Content-Length: ignored\r\n", "").into_bytes();
    for _ in 0..3 {
        raw.extend_from_slice(format!("{:x}\r\n", LIMIT / 2).as_bytes());
        raw.extend(std::iter::repeat_n(b'z', LIMIT / 2));
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    let r = s.send(&raw).await;
    assert_e2b_error(&r, 413, "a chunked body over the limit");

    // Nothing of these was written; a good write and read still work.
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &[],
            "GET",
            "/files?path=/workspace/big",
            b"",
        )
        .await;
    assert_e2b_error(&r, 404, "the refused upload");
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &octet,
            "POST",
            "/files?path=/workspace/ok.txt",
            b"fine",
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &[],
            "GET",
            "/files?path=ok.txt",
            b"",
        )
        .await;
    assert_eq!((r.status, r.text().as_str()), (200, "fine"));
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

// =======================================================================================
// 6. Races.

/// A sandbox killed (`DELETE /sandboxes/{id}`) while a `Start` stream and a `Connect` stream
/// on its process are open: both streams end (an end-of-stream envelope, or the connection
/// closes) within the deadline; the sandbox's envd is gone; the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_sandbox_ends_its_open_streams() {
    let s = serve_spawning(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let other = s.create(&s.a).await;
    let mut st = s.start(&sb, "while :; do echo x; sleep 0.05; done").await;
    let pid = started_pid(&mut st).await;
    let follow = follow_request(&sb, pid);
    let mut f = h1::Stream::open(s.addr, &follow).await;
    assert!(matches!(f.next().await, Next::Envelope(0, _)));

    s.kill(&s.a, &sb).await;
    for (what, stream) in [("Start", &mut st), ("Connect", &mut f)] {
        // Data already on its way, then the end.
        let end = loop {
            match stream.next().await {
                Next::Envelope(0, v) if v["event"]["data"].is_object() => continue,
                Next::Envelope(0, v) if v["event"]["end"].is_object() => continue,
                end => break end,
            }
        };
        match end {
            Next::Closed => {}
            Next::Envelope(2, v) => assert!(v.is_object(), "{what}: {v}"),
            other => panic!("{what}: {other:?}"),
        }
    }
    eventually("the process is gone with its sandbox", || async {
        !host_process_runs(pid)
    })
    .await;
    let r = s
        .envd(&sb.id, Some(&sb.token), &[], "GET", "/health", b"")
        .await;
    assert_e2b_error(&r, 502, "the killed sandbox's envd");
    // Two kills of one sandbox at once: one is answered 204, the other 404.
    let twice = s.create(&s.a).await;
    let path = format!("/sandboxes/{}", twice.id);
    let key = s.a.reveal();
    let (x, y) = tokio::join!(
        s.api(Some(key), "DELETE", &path, None),
        s.api(Some(key), "DELETE", &path, None)
    );
    let mut got = [x.status, y.status];
    got.sort_unstable();
    assert_eq!(got, [204, 404], "{} / {}", x.text(), y.text());
    s.assert_serves(Some(&other)).await;
    s.stop().await;
}

/// A client holding a `Start` stream open (an endless command) while the server is told to
/// stop: the server stops within the deadline (the stream is ended, as the MCP endpoint's
/// streams are), and the process is gone with its sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_stops_while_a_start_stream_is_open() {
    let s = serve_spawning(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let mut st = s.start(&sb, "while :; do echo x; sleep 0.05; done").await;
    assert!(matches!(st.next().await, Next::Envelope(0, _)));
    // The client goes on reading, as an SDK's `commands.run(..., background=True)` does.
    let reader = tokio::spawn(async move { while let Next::Envelope(..) = st.next().await {} });
    s.stop().await;
    tokio::time::timeout(DEADLINE, reader)
        .await
        .expect("the stream ends with the server")
        .unwrap();
}

/// A client stream (`StreamInput`) with malformed envelopes: the right code, and the server
/// goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_stream_input_is_refused_with_the_right_code() {
    let s = serve(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let start = envelope(0, br#"{"start": {"process": {"pid": 4242}}}"#);
    let mut huge = vec![0u8, 0xff, 0xff, 0xff, 0xff];
    huge.extend_from_slice(&[b'{'; 10]);
    let mut data_first = envelope(0, br#"{"data": {"input": {"stdin": "eAo="}}}"#);
    data_first.extend(envelope(0, br#"{"start": {"process": {"pid": 4242}}}"#));
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("4 GiB stated, 10 bytes sent", huge, "resource_exhausted"),
        (
            "a compressed message",
            envelope(0x01, b"{}"),
            "unimplemented",
        ),
        (
            "invalid JSON",
            envelope(0, b"{\"start\": "),
            "invalid_argument",
        ),
        (
            "a cut envelope",
            vec![0, 0, 0, 0, 9, b'{'],
            "invalid_argument",
        ),
        ("data before start", data_first, "invalid_argument"),
        ("a process that is not there", start, "not_found"),
    ];
    for (what, body, code) in cases {
        let r = s
            .envd(
                &sb.id,
                Some(&sb.token),
                &[("Content-Type", "application/connect+json")],
                "POST",
                "/process.Process/StreamInput",
                &body,
            )
            .await;
        assert_stream_error(&r, code, what);
        assert_no_huge_allocation();
    }
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

/// A file over the sandbox's output limit (1 MiB by default) outside the workspace, read
/// through the in-sandbox helper: `413` (`resource_exhausted`), and the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_a_file_over_the_output_limit_is_413() {
    let s = serve(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("two-mib");
    std::fs::write(&big, vec![b'x'; 2 << 20]).unwrap();
    let r = s
        .envd(
            &sb.id,
            Some(&sb.token),
            &[],
            "GET",
            &format!("/files?path={}", big.display()),
            b"",
        )
        .await;
    let m = assert_e2b_error(&r, 413, "a 2 MiB file");
    assert!(m.contains("output limit"), "{m}");
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

/// The same for what floods the output limit (past the point where the backend stops the
/// reader instead of truncating: 4 times the cap and at least 8 MiB more): `/dev/zero`, a
/// 20 MiB file. Each should be `413` as the 2 MiB file is; the helper's exit 137 (stopped
/// by its output limit) is answered as a 500 `internal` instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_what_floods_the_output_limit_is_413() {
    let s = serve(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("twenty-mib");
    std::fs::write(&big, vec![b'x'; 20 << 20]).unwrap();
    for path in ["/dev/zero".to_string(), big.display().to_string()] {
        let r = s
            .envd(
                &sb.id,
                Some(&sb.token),
                &[],
                "GET",
                &format!("/files?path={path}"),
                b"",
            )
            .await;
        assert_e2b_error(&r, 413, &path);
    }
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}

/// A sandbox killed while the client of its `Start` stream has stopped reading (the
/// server's pipe to it full): the kill is answered, and once the client goes the server has
/// nothing left of the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_sandbox_under_a_stalled_stream_is_answered() {
    let s = serve_spawning(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let mut st = s
        .start(&sb, "yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx")
        .await;
    assert!(matches!(st.next().await, Next::Envelope(0, _)));
    // The client stops reading; `yes` fills every buffer between it and the process.
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.kill(&s.a, &sb).await;
    // Reading again: what was buffered, then the end.
    let mut n = 0u64;
    loop {
        match st.next().await {
            Next::Envelope(0, _) => n += 1,
            Next::Envelope(2, _) | Next::Closed => break,
            other => panic!("{other:?}"),
        }
        assert!(n < 1_000_000, "the stream does not end");
    }
    s.assert_serves(None).await;
    s.stop().await;
}

/// Many `Start`s at once on one sandbox: no more than envd's limit of processes (256) run;
/// the rest are refused with `resource_exhausted`. Then the sandbox is killed, which ends
/// every stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_starts_keep_the_process_limit() {
    const TRIES: usize = 300;
    const LIMIT: usize = 256;
    // Every start at once: the client's budget of requests in flight (which envd's count
    // in) above them, so the process limit is what meets the race.
    let mut config = ServerConfig::default();
    config.max_requests_per_client = 2 * TRIES;
    let s = Arc::new(serve_spawning(config).await);
    let sb = s.create(&s.a).await;
    let mut tasks = Vec::new();
    for _ in 0..TRIES {
        let (s, sb) = (Arc::clone(&s), sb.clone());
        tasks.push(tokio::spawn(async move {
            let mut st = s.start(&sb, "sleep 120").await;
            let first = st.next().await;
            (first, st)
        }));
    }
    let (mut started, mut refused, mut streams) = (0, 0, Vec::new());
    for t in tasks {
        let (first, st) = t.await.unwrap();
        match first {
            Next::Envelope(0, v) if v["event"]["start"].is_object() => started += 1,
            Next::Envelope(2, v) if v["error"]["code"] == "resource_exhausted" => refused += 1,
            other => panic!("{other:?}"),
        }
        streams.push(st);
    }
    let pids = s.pids(&sb).await;
    let listed = pids.len();
    s.kill(&s.a, &sb).await;
    for mut st in streams {
        while let Next::Envelope(0, _) = st.next().await {}
    }
    for pid in pids {
        eventually("every process is gone with its sandbox", || async {
            !host_process_runs(pid)
        })
        .await;
    }
    assert_eq!(started + refused, TRIES);
    assert!(
        started <= LIMIT && listed <= LIMIT,
        "{started} processes started and {listed} listed, over the limit of {LIMIT}"
    );
    let s = Arc::into_inner(s).unwrap();
    s.assert_serves(None).await;
    s.stop().await;
}

/// A client opening `Connect` stream after stream on one process (each would hold messages
/// for it): no more than 8 follow it at once (its `Start` counts); the next is refused with
/// `resource_exhausted`, and one that goes away makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_of_one_process_are_capped() {
    let s = serve_spawning(ServerConfig::default()).await;
    let sb = s.create(&s.a).await;
    let mut st = s.start(&sb, "while :; do echo x; sleep 0.05; done").await;
    let pid = started_pid(&mut st).await;
    let follow = follow_request(&sb, pid);
    let mut held = Vec::new();
    for _ in 0..7 {
        let mut f = h1::Stream::open(s.addr, &follow).await;
        assert!(matches!(f.next().await, Next::Envelope(0, _)));
        held.push(f);
    }
    let mut refused = h1::Stream::open(s.addr, &follow).await;
    match refused.next().await {
        Next::Envelope(2, v) => assert_eq!(v["error"]["code"], "resource_exhausted", "{v}"),
        other => panic!("the 9th follower: {other:?}"),
    }
    // One goes away: a new one is taken (the closed one is noticed when the next comes).
    drop(held.pop());
    let again = tokio::time::timeout(DEADLINE, async {
        loop {
            let mut f = h1::Stream::open(s.addr, &follow).await;
            if let Next::Envelope(0, _) = f.next().await {
                return f;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(again.is_ok(), "no room after a follower went away");
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}
