//! Background processes, terminals and published ports of `agent-sandbox serve`, driven by
//! `curl` on a real tier (the container tier; skipped, saying why, where the probe says it
//! cannot run): a command fed through stdin and read as server-sent events, a terminal
//! resized, a web server inside reached through a published port, and the bad requests.

// In tests a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod served;

use std::process::{Command, Stdio};
use std::time::Duration;

use served::{curl, Serve};

/// `curl -N` on an event stream until it ends: its events as (name, data).
fn events(s: &Serve, path: &str) -> Vec<(String, serde_json::Value)> {
    let out = Command::new("curl")
        .args(["-sS", "-N", "--max-time", "60", "-H"])
        .arg(format!("Authorization: Bearer {}", s.token))
        .arg(format!("{}{path}", s.base))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut evs = Vec::new();
    let mut name = String::new();
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            evs.push((name.clone(), serde_json::from_str(d).unwrap()));
        }
    }
    evs
}

/// `curl --data-binary` of raw bytes (stdin).
fn post_bytes(s: &Serve, path: &str, data: &str) -> u16 {
    let out = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "POST",
            "-H",
        ])
        .arg(format!("Authorization: Bearer {}", s.token))
        .args(["--data-binary", data])
        .arg(format!("{}{path}", s.base))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// A live `curl -N` on an event stream: output text as it comes, then the exit.
struct Live {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    out: String,
}

impl Live {
    fn open(s: &Serve, path: &str) -> Live {
        let mut child = Command::new("curl")
            .args(["-sS", "-N", "--max-time", "60", "-H"])
            .arg(format!("Authorization: Bearer {}", s.token))
            .arg(format!("{}{path}", s.base))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
        Live {
            child,
            lines,
            out: String::new(),
        }
    }

    /// The next event (name, data); panics when the stream ends first.
    fn next(&mut self) -> (String, serde_json::Value) {
        let mut name = String::new();
        for line in self.lines.by_ref() {
            let line = line.unwrap();
            if let Some(n) = line.strip_prefix("event: ") {
                name = n.to_string();
            } else if let Some(d) = line.strip_prefix("data: ") {
                let v: serde_json::Value = serde_json::from_str(d).unwrap();
                if name == "stdout" || name == "stderr" {
                    self.out.push_str(v["text"].as_str().unwrap_or_default());
                }
                return (name, v);
            }
        }
        panic!("the stream ended; output so far: {:?}", self.out);
    }

    /// Reads until the output so far satisfies `done`.
    fn until(&mut self, done: impl Fn(&str) -> bool) {
        while !done(&self.out) {
            let (name, v) = self.next();
            assert!(name == "stdout" || name == "stderr", "{name}: {v}");
        }
    }

    /// Reads to the exit event; returns it.
    fn until_exit(&mut self) -> serde_json::Value {
        loop {
            let (name, v) = self.next();
            if name == "exit" {
                return v;
            }
            assert!(name == "stdout" || name == "stderr", "{name}: {v}");
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn kind(v: &serde_json::Value) -> &str {
    v["error"]["kind"].as_str().unwrap_or("(no error kind)")
}

fn spawn(s: &Serve, id: &str, body: &str) -> u64 {
    let (code, v) = curl(
        s,
        "POST",
        &format!("/v1/sandboxes/{id}/processes"),
        Some(body),
    );
    assert_eq!(code, 201, "{v}");
    v["id"].as_u64().unwrap()
}

#[test]
fn processes_terminals_and_ports_work_over_the_api() {
    if let Some(why) = served::container_available() {
        eprintln!("SKIP: the container tier cannot run here: {why}");
        return;
    }
    let s = served::serve();
    let (code, v) = curl(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(r#"{"spec": {"language": "shell"}, "tier": "container"}"#),
    );
    assert_eq!(code, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let p = |pid: u64, rest: &str| format!("/v1/sandboxes/{id}/processes/{pid}{rest}");

    // A process fed through stdin, its output as events: stdout and stderr apart, then
    // the exit.
    let pid = spawn(
        &s,
        &id,
        r#"{"argv": ["sh", "-c", "read x; echo got $x; echo oops >&2; exit 3"]}"#,
    );
    assert_eq!(post_bytes(&s, &p(pid, "/stdin"), "hello\n"), 204);
    let evs = events(&s, &p(pid, "/output"));
    let text = |name: &str| -> String {
        evs.iter()
            .filter(|(n, _)| n == name)
            .map(|(_, d)| d["text"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    assert_eq!(text("stdout"), "got hello\n", "{evs:?}");
    assert_eq!(text("stderr"), "oops\n", "{evs:?}");
    let (last, exit) = evs.last().unwrap();
    assert_eq!(last, "exit");
    assert_eq!(exit["exit_code"], 3);
    // Seen ending: no more input for it, but it is listed with its exit.
    assert_eq!(post_bytes(&s, &p(pid, "/stdin"), "more\n"), 404);
    let (_, v) = curl(&s, "GET", &format!("/v1/sandboxes/{id}/processes"), None);
    let listed = v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] == pid)
        .cloned()
        .unwrap();
    assert_eq!(listed["state"]["exit_code"], 3, "{v}");

    // A terminal: its size seen inside, then resized (read from the live stream: the
    // resize must come after the first `stty size`).
    let pid = spawn(
        &s,
        &id,
        r#"{"argv": ["sh", "-c", "stty size; read x; stty size; exit 4"], "tty": {"rows": 7, "cols": 33}}"#,
    );
    let mut live = Live::open(&s, &p(pid, "/output"));
    live.until(|out| out.contains("7 33"));
    let (code, v) = curl(
        &s,
        "POST",
        &p(pid, "/resize"),
        Some(r#"{"rows": 20, "cols": 50}"#),
    );
    assert_eq!(code, 204, "{v}");
    assert_eq!(post_bytes(&s, &p(pid, "/stdin"), "go\n"), 204);
    let exit = live.until_exit();
    assert_eq!(exit["exit_code"], 4, "{exit}");
    assert!(live.out.contains("20 50"), "{:?}", live.out);

    // A long-running one: a second reader is refused while one reads; bad input is named.
    let pid = spawn(&s, &id, r#"{"argv": ["sleep", "1000"]}"#);
    // The first reader holds the output once its answer's headers are back (`-i`).
    let mut reader = Command::new("curl")
        .args(["-sS", "-i", "-N", "--max-time", "60", "-H"])
        .arg(format!("Authorization: Bearer {}", s.token))
        .arg(format!("{}{}", s.base, p(pid, "/output")))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut status = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(reader.stdout.take().unwrap()),
        &mut status,
    )
    .unwrap();
    assert!(status.contains(" 200"), "{status}");
    let (code, busy) = curl(&s, "GET", &p(pid, "/output"), None);
    assert_eq!((code, kind(&busy)), (409, "busy"), "{busy}");
    let (code, v) = curl(
        &s,
        "POST",
        &p(pid, "/resize"),
        Some(r#"{"rows": 20, "cols": 50}"#),
    );
    assert_eq!((code, kind(&v)), (400, "invalid_spec"), "{v}");
    let (code, v) = curl(
        &s,
        "POST",
        &p(pid, "/signal"),
        Some(r#"{"signal": "SIGFOO"}"#),
    );
    assert_eq!((code, kind(&v)), (400, "invalid_spec"), "{v}");
    let (code, v) = curl(&s, "POST", &p(999, "/stdin"), Some("x"));
    assert_eq!((code, kind(&v)), (404, "not_found"), "{v}");
    let (code, v) = curl(&s, "POST", &p(pid, "/wait"), Some(r#"{"timeout_ms": 100}"#));
    assert_eq!((code, kind(&v)), (409, "busy"), "{v}");
    // The reader goes away mid-stream: the process stays, and a new reader gets it.
    let _ = reader.kill();
    let _ = reader.wait();
    // Once the server has seen it go, a wait is no longer busy (it times out instead).
    let mut freed = false;
    for _ in 0..100 {
        let (code, v) = curl(&s, "POST", &p(pid, "/wait"), Some(r#"{"timeout_ms": 1}"#));
        if code == 504 {
            assert_eq!(kind(&v), "timeout", "{v}");
            freed = true;
            break;
        }
        assert_eq!((code, kind(&v)), (409, "busy"), "{v}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(freed, "the output stayed held after its reader went away");
    let (code, v) = curl(
        &s,
        "POST",
        &p(pid, "/signal"),
        Some(r#"{"signal": "TERM"}"#),
    );
    assert_eq!(code, 204, "{v}");
    let evs = events(&s, &p(pid, "/output"));
    let (last, exit) = evs.last().unwrap();
    assert_eq!(last, "exit", "{evs:?}");
    assert_eq!(exit["exit_code"], 128 + 15, "{exit}");

    // A web server inside, reached from the host through a published port, while the
    // sandbox's own network stays denied.
    let web = spawn(
        &s,
        &id,
        r#"{"argv": ["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"], "cwd": "/workspace"}"#,
    );
    let (code, v) = curl(
        &s,
        "PUT",
        &format!("/v1/sandboxes/{id}/files/index.html"),
        Some("served-from-the-sandbox"),
    );
    assert_eq!(code, 204, "{v}");
    let (code, v) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/ports"),
        Some(r#"{"sandbox_port": 8000}"#),
    );
    assert_eq!(code, 201, "{v}");
    let host = v["host"].as_str().unwrap().to_string();
    assert!(host.starts_with("127.0.0.1:"), "{v}");
    let mut page = String::new();
    for _ in 0..100 {
        let out = Command::new("curl")
            .args(["-s", "--max-time", "5"])
            .arg(format!("http://{host}/index.html"))
            .output()
            .unwrap();
        page = String::from_utf8_lossy(&out.stdout).into_owned();
        if page.contains("served-from-the-sandbox") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(page, "served-from-the-sandbox");
    let (code, v) = curl(&s, "GET", &format!("/v1/sandboxes/{id}/ports"), None);
    assert_eq!(code, 200);
    assert_eq!(v["ports"][0]["host"], host.as_str(), "{v}");
    // Not beyond loopback without --allow-host-access; port 0 and a port twice refused.
    for (body, want) in [
        (
            r#"{"sandbox_port": 8000, "host": "0.0.0.0:0"}"#,
            (403, "forbidden"),
        ),
        (r#"{"sandbox_port": 0}"#, (400, "invalid_spec")),
        (r#"{"port": 8000}"#, (422, "bad_request")),
    ] {
        let (code, v) = curl(&s, "POST", &format!("/v1/sandboxes/{id}/ports"), Some(body));
        assert_eq!((code, kind(&v)), want, "{body}: {v}");
    }
    let again = format!(r#"{{"sandbox_port": 8000, "host": "{host}"}}"#);
    let (code, v) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/ports"),
        Some(&again),
    );
    assert_eq!((code, kind(&v)), (400, "invalid_spec"), "{v}");
    let (code, v) = curl(
        &s,
        "DELETE",
        &format!("/v1/sandboxes/{id}/ports/{host}"),
        None,
    );
    assert_eq!(code, 204, "{v}");
    let (code, v) = curl(
        &s,
        "DELETE",
        &format!("/v1/sandboxes/{id}/ports/{host}"),
        None,
    );
    assert_eq!((code, kind(&v)), (404, "not_found"), "{v}");
    let (code, v) = curl(
        &s,
        "DELETE",
        &format!("/v1/sandboxes/{id}/ports/nonsense"),
        None,
    );
    assert_eq!((code, kind(&v)), (400, "bad_request"), "{v}");
    let refused = Command::new("curl")
        .args(["-s", "--max-time", "5"])
        .arg(format!("http://{host}/"))
        .status()
        .unwrap();
    assert!(
        !refused.success(),
        "the port still answers after unpublishing"
    );

    // Ctrl-C for the web server; it ends, and destroying the sandbox ends the rest.
    let (code, v) = curl(&s, "POST", &p(web, "/signal"), Some(r#"{"signal": "INT"}"#));
    assert_eq!(code, 204, "{v}");
    let (code, v) = curl(
        &s,
        "POST",
        &p(web, "/wait"),
        Some(r#"{"timeout_ms": 30000}"#),
    );
    assert_eq!(code, 200, "{v}");
    assert!(v["exit_code"].is_i64(), "{v}");
    let (code, _) = curl(&s, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(code, 204);
    let (code, v) = curl(&s, "POST", &p(pid, "/stdin"), Some("x"));
    assert_eq!((code, kind(&v)), (404, "not_found"), "{v}");
}
