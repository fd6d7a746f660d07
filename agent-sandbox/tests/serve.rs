//! `agent-sandbox serve` as users run it: the CLI binary on loopback with a token file,
//! driven by `curl`, on a real tier (the container tier; skipped, saying why, where the probe
//! says it cannot run). Its OpenAPI document is checked by `openapi-spec-validator` from PyPI
//! (`scripts/test.sh` installs it and sets `AGENT_SANDBOX_TEST_PYTHON`). SIGTERM destroys
//! what the server made.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn container_available() -> Option<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["probe", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let t = v["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "container")
        .cloned()
        .unwrap_or_default();
    if t["available"] == true {
        None
    } else {
        Some(t["reason"].as_str().unwrap_or("not built in").to_string())
    }
}

/// The server: its process, base URL and token.
struct Serve {
    child: Child,
    base: String,
    token: String,
    _dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve() -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let token = "t".repeat(40);
    let file = dir.path().join("token");
    std::fs::write(&file, &token).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["serve", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // "listening on http://127.0.0.1:PORT (bearer token in FILE)"
    let mut line = String::new();
    BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    Serve {
        child,
        base,
        token,
        _dir: dir,
    }
}

fn curl(s: &Serve, method: &str, path: &str, body: Option<&str>) -> (u16, serde_json::Value) {
    let mut c = Command::new("curl");
    c.args([
        "-sS",
        "--max-time",
        "120",
        "-w",
        "\n%{http_code}",
        "-X",
        method,
    ])
    .arg("-H")
    .arg(format!("Authorization: Bearer {}", s.token));
    if let Some(b) = body {
        c.args(["-H", "Content-Type: application/json", "--data-binary", b]);
    }
    let out = c.arg(format!("{}{path}", s.base)).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap();
    let v = serde_json::from_str(body).unwrap_or(serde_json::Value::String(body.into()));
    (code.trim().parse().unwrap(), v)
}

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
