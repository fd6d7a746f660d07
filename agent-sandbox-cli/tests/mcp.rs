//! agent-sandbox's MCP server driven by the official MCP Python SDK (`mcp` from PyPI), over
//! stdio (`agent-sandbox mcp`) and over streamable HTTP (`agent-sandbox serve`'s `/mcp`): the
//! tools are listed, Python run twice in one session keeps its variable, a file goes in and
//! out, a snapshot restores into a new session with the file, an escaping path, a bad
//! snapshot id and an unknown session are tool errors, a timeout says so, and a destroyed
//! session is gone; also `agent-sandbox mcp --server`, whose sandboxes live in a server.
//! `scripts/test.sh` installs the SDK in a venv and sets
//! `AGENT_SANDBOX_TEST_PYTHON`; without it the tests say so and skip.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod served;

use std::ffi::OsString;
use std::process::Command;

fn python() -> Option<OsString> {
    let p = std::env::var_os("AGENT_SANDBOX_TEST_PYTHON");
    if p.is_none() {
        eprintln!(
            "SKIP: AGENT_SANDBOX_TEST_PYTHON is not set (scripts/test.sh sets it to a venv with \
             the `mcp` SDK)"
        );
    }
    p
}

#[test]
fn the_official_python_sdk_runs_code_in_a_session_over_stdio() {
    let Some(python) = python() else { return };
    check(over_stdio(python, &[]));
}

/// The client over stdio: it starts `agent-sandbox mcp` with a state directory of its own
/// and `extra` arguments.
fn over_stdio(python: OsString, extra: &[&std::ffi::OsStr]) -> std::process::Output {
    let state = tempfile::tempdir().unwrap();
    Command::new(python)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp/client.py"))
        .arg("stdio")
        .arg(env!("CARGO_BIN_EXE_agent-sandbox"))
        .arg(state.path())
        .args(extra)
        .output()
        .unwrap()
}

/// `agent-sandbox mcp --server`: the same stdio tools, their sandboxes in a server.
#[test]
fn the_official_python_sdk_runs_code_over_stdio_in_a_servers_sandboxes() {
    let Some(python) = python() else { return };
    let s = served::serve();
    let token = s.dir.path().join("token");
    check(over_stdio(
        python,
        &[
            "--server".as_ref(),
            s.base.as_ref(),
            "--token-file".as_ref(),
            token.as_ref(),
        ],
    ));
    // Its sandboxes were the server's, and the session's end destroyed them there.
    let (code, v) = served::curl(&s, "GET", "/v1/sandboxes", None);
    assert_eq!(code, 200);
    assert_eq!(v["sandboxes"], serde_json::json!([]), "{v}");
}

#[test]
fn the_official_python_sdk_runs_code_in_a_session_over_streamable_http() {
    let Some(python) = python() else { return };
    let s = served::serve();
    let out = Command::new(python)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp/client.py"))
        .arg("http")
        .arg(format!("{}/mcp", s.base))
        .arg(&s.token)
        .output()
        .unwrap();
    check(out);
    // Without the token: refused, like the rest of the API.
    let (code, _) = served::curl(&s, "GET", "/v1/openapi.json", None);
    assert_eq!(code, 200);
    let refused = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST"])
        .args(["-H", "Content-Type: application/json"])
        .args(["-H", "Accept: application/json, text/event-stream"])
        .args([
            "--data-binary",
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
        ])
        .arg(format!("{}/mcp", s.base))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&refused.stdout), "401");
}

/// What the client saw, checked.
fn check(out: std::process::Output) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let text = |k: &str| seen[k]["text"].as_str().unwrap().to_string();
    let error = |k: &str| seen[k]["error"].as_bool().unwrap();
    assert_eq!(
        seen["tools"],
        serde_json::json!([
            "create_sandbox",
            "destroy_sandbox",
            "exec",
            "list_files",
            "read_file",
            "restore",
            "run_code",
            "snapshot",
            "write_file"
        ])
    );
    assert!(text("first").contains("exit code: 0") && text("first").ends_with("set\n"));
    // The variable persists: the selector put Python on a tier with interpreter sessions.
    assert!(
        text("second").ends_with("--- stdout ---\n42\n"),
        "{}",
        text("second")
    );
    // The chart: text first (naming the output), then the figure as a PNG image.
    let chart = &seen["chart"];
    assert_eq!(
        (
            chart["error"].as_bool(),
            &chart["types"],
            &chart["mimes"],
            &chart["png"]
        ),
        (
            Some(false),
            &serde_json::json!(["text", "image"]),
            &serde_json::json!(["image/png"]),
            &serde_json::json!([true])
        ),
        "{chart}"
    );
    assert!(chart["bytes"][0].as_u64().unwrap() > 5_000, "{chart}");
    assert!(
        text("chart").contains("output 1: <Figure size")
            && text("chart").contains("(an image follows)")
            && text("chart").ends_with("drawn\n"),
        "{}",
        text("chart")
    );
    assert!(!error("write"));
    assert_eq!(text("read"), "hello");
    assert!(text("list").contains("b.txt"), "{}", text("list"));
    assert!(
        text("snapshot").starts_with("snapshot: "),
        "{}",
        text("snapshot")
    );
    assert!(!error("restore"), "{}", text("restore"));
    assert_eq!(text("restored_read"), "hello");
    assert!(error("bad_restore") && text("bad_restore").contains("not a snapshot id"));
    assert!(error("escape"), "{}", text("escape"));
    assert!(
        text("timeout").contains("stopped by a limit: wall-time"),
        "{}",
        text("timeout")
    );
    assert!(error("unknown") && text("unknown").contains("no session"));
    assert!(!error("destroy"));
    assert!(error("after"), "{}", text("after"));
}
