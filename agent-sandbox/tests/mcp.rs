//! `agent-sandbox mcp` driven by the official MCP Python SDK (`mcp` from PyPI) over stdio:
//! the tools are listed, Python run twice in one session keeps its variable, a file goes in
//! and out, an escaping path and an unknown session are tool errors, a timeout says so, and a
//! destroyed session is gone. `scripts/test.sh` installs the SDK in a venv and sets
//! `AGENT_SANDBOX_TEST_PYTHON`; without it the test says so and skips.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

#[test]
fn the_official_python_sdk_runs_code_in_a_session() {
    let Some(python) = std::env::var_os("AGENT_SANDBOX_TEST_PYTHON") else {
        eprintln!(
            "SKIP: AGENT_SANDBOX_TEST_PYTHON is not set (scripts/test.sh sets it to a venv with \
             the `mcp` SDK)"
        );
        return;
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp/client.py");
    let out = Command::new(python)
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_agent-sandbox"))
        .output()
        .unwrap();
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
            "run_code",
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
    assert!(!error("write"));
    assert_eq!(text("read"), "hello");
    assert!(text("list").contains("b.txt"), "{}", text("list"));
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
