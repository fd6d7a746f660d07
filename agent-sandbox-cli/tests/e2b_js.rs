//! `agent-sandbox serve`'s E2B-compatible API driven by the official E2B JavaScript SDK (`e2b`
//! from npm, the version `scripts/test.sh` pins) under Node, pointed at the server the way
//! E2B's users point it at a self-hosted E2B: `E2B_API_URL` and `E2B_SANDBOX_URL` the server's
//! URL, `E2B_API_KEY` `e2b_` and its bearer token. Through the SDK's public API only,
//! `tests/e2b/scenario.mjs` proves on the container tier what `tests/e2b/scenario.py` proves
//! with the Python SDK (see `tests/e2b.rs`): commands (their environment and working directory,
//! stdout and stderr apart, a failure's exit code), files in and out, background commands
//! listed, killed, fed stdin and reconnected to, a PTY sized and resized, a workspace
//! directory watched through the SDK's stream, an allow list refusing a denied host (and the
//! sandbox's log saying so), a sandbox's port
//! reached through the sandbox URL, a snapshot restored and forked twice, sandboxes listed and
//! filtered by metadata, their timeout set, paused and resumed, killed, and another API key
//! refused. The two SDKs are separate code: they send their own requests and read the answers
//! their own way (the JavaScript one creates and connects through E2B's v2 endpoints,
//! `POST /v2/sandboxes` and `POST /v2/sandboxes/{id}/connect`, and tells a missing sandbox by
//! the error body's `code`).
//! `scripts/test.sh` installs the SDK into a node_modules directory outside the clone and sets
//! `AGENT_SANDBOX_TEST_NODE_MODULES`; without it, without `node`, or without the container
//! tier, the test says so and skips.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod served;

use std::path::PathBuf;
use std::process::Command;

/// The server's bearer token: the SDK's API keys are `e2b_` + lowercase hex.
const TOKEN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// How long the whole scenario may take before `timeout` stops it (exit status 124).
const SCENARIO_LIMIT_S: &str = "300";

/// A time zone far from UTC (and not a whole number of hours off it) for Node: an `endAt`
/// without a zone would be read as local time there and be hours off.
const TZ: &str = "Asia/Kathmandu";

/// `AGENT_SANDBOX_TEST_NODE_MODULES`, if it has the SDK, and `node` from `PATH`.
fn sdk_and_node() -> Option<(PathBuf, PathBuf)> {
    let Some(modules) = std::env::var_os("AGENT_SANDBOX_TEST_NODE_MODULES") else {
        eprintln!(
            "SKIP: AGENT_SANDBOX_TEST_NODE_MODULES is not set (scripts/test.sh sets it to a \
             node_modules with the `e2b` SDK)"
        );
        return None;
    };
    let modules = PathBuf::from(modules);
    let package = modules.join("e2b/package.json");
    if !package.is_file() {
        eprintln!(
            "SKIP: {} has no `e2b` SDK (no {}; scripts/test.sh installs it)",
            modules.display(),
            package.display()
        );
        return None;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let Some(node) = std::env::split_paths(&path)
        .map(|dir| dir.join("node"))
        .find(|node| node.is_file())
    else {
        eprintln!("SKIP: no `node` on PATH (the E2B JavaScript SDK runs under Node)");
        return None;
    };
    Some((modules, node))
}

/// A server whose `base` template is on the container tier (the selector's pick may be
/// another), and its URL; `None` (said) where the tier is not available.
fn serve_on_containers() -> Option<(served::Serve, String)> {
    if let Some(why) = served::container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return None;
    }
    let (s, _) = served::serve_with_token(
        tempfile::tempdir().unwrap(),
        TOKEN,
        &["--template", "base=-,tier=container"],
        &[],
    );
    let url = s.base.trim_end_matches('/').to_string();
    Some((s, url))
}

/// `node script` under `timeout`, in a clean environment (no E2B_DOMAIN or E2B_DEBUG of the
/// caller's to redirect the SDK, no proxy between it and the loopback server, no
/// NODE_OPTIONS), with the SDK in `modules` pointed at the server at `url`.
fn node_command(node: &PathBuf, modules: &PathBuf, url: &str, script: &str) -> Command {
    let mut c = Command::new("timeout");
    c.args(["--kill-after=10", SCENARIO_LIMIT_S])
        .arg(node)
        .arg(script)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("AGENT_SANDBOX_TEST_NODE_MODULES", modules)
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .env("E2B_API_KEY", format!("e2b_{TOKEN}"));
    c
}

#[test]
fn the_official_e2b_javascript_sdk_drives_container_sandboxes() {
    let Some((modules, node)) = sdk_and_node() else {
        return;
    };
    let Some((mut s, url)) = serve_on_containers() else {
        return;
    };
    let scenario = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b/scenario.mjs");
    let out = node_command(&node, &modules, &url, scenario)
        .env("TZ", TZ)
        .output()
        .unwrap();

    // The server destroys what a failed scenario left behind.
    s.terminate();

    served::assert_all_ok(
        &format!("scenario.mjs ({})", node.display()),
        &out,
        SCENARIO_LIMIT_S,
    );
}

/// E2B's code interpreter on the server's container sandboxes, driven by the official
/// `@e2b/code-interpreter` JavaScript SDK (`tests/e2b/interpreter.mjs`).
#[test]
fn the_official_code_interpreter_javascript_sdk_runs_cells() {
    let Some((modules, node)) = sdk_and_node() else {
        return;
    };
    if !modules.join("@e2b/code-interpreter/package.json").is_file() {
        eprintln!(
            "SKIP: {} has no `@e2b/code-interpreter` (scripts/test.sh installs it)",
            modules.display()
        );
        return;
    }
    let Some((mut s, url)) = serve_on_containers() else {
        return;
    };
    let out = node_command(
        &node,
        &modules,
        &url,
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b/interpreter.mjs"),
    )
    .output()
    .unwrap();
    s.terminate();
    served::assert_all_ok("interpreter.mjs", &out, SCENARIO_LIMIT_S);
}
