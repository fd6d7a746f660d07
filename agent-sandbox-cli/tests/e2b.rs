//! `agent-sandbox serve`'s E2B-compatible API driven by the official E2B Python SDK (`e2b`
//! from PyPI, the version `scripts/test.sh` pins), pointed at the server the way E2B's users
//! point it at a self-hosted E2B: `E2B_API_URL` and `E2B_SANDBOX_URL` the server's URL,
//! `E2B_API_KEY` `e2b_` and its bearer token. Through the SDK's public sync API only,
//! `tests/e2b/scenario.py` proves on the container and gVisor tiers (each where the host
//! has it; the `base` template pinned to it) that a sandbox created with metadata and
//! environment variables runs commands (its environment, a command's own environment and
//! working directory, stdout and stderr apart, a failure's exit code); that files go in and
//! out (text, bytes, a multi-file upload, listing, entry info, directories, renaming,
//! removing, a missing file, a signed download URL fetched with no token), the same files the
//! commands see; that a workspace directory is watched (polled, recursive); that an allow
//! list refuses a denied host and the sandbox's log says so; that a background command is
//! listed, killed, fed stdin, and outlives a disconnected stream to be reconnected to; that a
//! PTY has the size asked for and is resized; that a server the sandbox runs is reached on
//! its port through the sandbox URL (and a port nothing listens on is a 502); that a
//! snapshot restores as a template and forks twice, each copy on its own; that sandboxes are
//! listed and filtered by
//! metadata, have their timeout set, are paused and resumed by connecting with their files
//! kept, are killed and then not found; and that another API key is refused.
//! `scripts/test.sh` installs the SDK in a venv and sets `AGENT_SANDBOX_TEST_PYTHON`; without
//! it, or without the container tier, the test says so and skips.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod served;

use std::ffi::OsString;
use std::process::Command;

/// The server's bearer token: the SDK accepts only API keys of the form `e2b_` + lowercase hex.
const TOKEN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// The domain sandboxes' host names are under (`serve --e2b-domain`, the SDK's E2B_DOMAIN).
const DOMAIN: &str = "sandboxes.test";

/// How long the whole scenario may take before `timeout` stops it (exit status 124).
const SCENARIO_LIMIT_S: &str = "300";

/// The Python to run the scenario with: `AGENT_SANDBOX_TEST_PYTHON`, if it has the SDK.
fn python() -> Option<OsString> {
    python_with("e2b")
}

/// The Python to run a script with: `AGENT_SANDBOX_TEST_PYTHON`, if it can import `module`.
fn python_with(module: &str) -> Option<OsString> {
    let Some(python) = std::env::var_os("AGENT_SANDBOX_TEST_PYTHON") else {
        eprintln!(
            "SKIP: AGENT_SANDBOX_TEST_PYTHON is not set (scripts/test.sh sets it to a venv with \
             the `e2b` SDK)"
        );
        return None;
    };
    let probe = Command::new(&python)
        .args(["-c", &format!("import {module}")])
        .output()
        .unwrap();
    if !probe.status.success() {
        eprintln!(
            "SKIP: {} cannot import `{module}` (scripts/test.sh installs it): {}",
            python.to_string_lossy(),
            String::from_utf8_lossy(&probe.stderr).trim()
        );
        return None;
    }
    Some(python)
}

#[test]
fn the_official_e2b_sdk_drives_container_sandboxes() {
    scenario_on("container");
}

#[test]
fn the_official_e2b_sdk_drives_gvisor_sandboxes() {
    scenario_on("gvisor");
}

/// An image's template with E2B's own home, `/home/user`, as programs written for E2B name
/// it: the Debian image `scripts/test-image.sh` builds.
#[test]
fn the_official_e2b_sdk_drives_an_image_template_with_e2bs_home() {
    let dir = std::env::var_os("AGENT_SANDBOX_TEST_IMAGES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/var/tmp/agent-sandbox-images"))
        .join("trixie-numpy");
    if !dir.join("index.json").is_file() {
        eprintln!(
            "SKIP: no test image in {} (scripts/test-image.sh builds it)",
            dir.display()
        );
        return;
    }
    scenario_with(
        "container",
        &format!("base=oci:{},tier=container,home=/home/user", dir.display()),
    );
}

/// A server started with `args` (and the test's token), and its URL; `None` (said) where
/// `tier` is not available.
fn serve_on(tier: &str, args: &[&str]) -> Option<(served::Serve, String)> {
    if let Some(why) = served::unavailable(tier) {
        eprintln!("SKIP: the {tier} tier is not available here: {why}");
        return None;
    }
    let (s, _) = served::serve_with_token(tempfile::tempdir().unwrap(), TOKEN, args, &[]);
    let url = s.base.trim_end_matches('/').to_string();
    Some((s, url))
}

/// `python script` under `timeout`, in a clean environment (no E2B_DOMAIN or E2B_DEBUG of
/// the caller's to redirect the SDK, no proxy between it and the loopback server), with the
/// SDK pointed at the server at `url`.
fn sdk_command(python: &OsString, url: &str, script: &str) -> Command {
    let mut c = Command::new("timeout");
    c.args(["--kill-after=10", SCENARIO_LIMIT_S])
        .arg(python)
        .arg(script)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .env("E2B_API_KEY", format!("e2b_{TOKEN}"));
    c
}

/// The scenario (and the quick start example) with the `base` template on `tier`.
fn scenario_on(tier: &str) {
    scenario_with(tier, &format!("base=-,tier={tier}"));
}

/// The scenario (and the quick start example) with `base` the template `base` says, on
/// `tier`.
fn scenario_with(tier: &str, base: &str) {
    let Some(python) = python() else { return };
    let Some((mut s, url)) = serve_on(tier, &["--e2b-domain", DOMAIN, "--template", base]) else {
        return;
    };
    // Metrics where the server says the tier counts usage (its probe's word, not the tier's
    // name): the container tier from its cgroup, gVisor from its sandbox process's.
    let (code, tiers) = served::curl(&s, "GET", "/v1/tiers", None);
    assert_eq!(code, 200, "{tiers}");
    let usage = tiers["tiers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["capabilities"]["tier"] == tier)
        .is_some_and(|t| t["capabilities"]["usage"] == true);
    let scenario = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b/scenario.py");
    let sdk = |script: &str| {
        sdk_command(&python, &url, script)
            .env("E2B_DOMAIN", DOMAIN)
            .env("E2B_EXPECT_METRICS", if usage { "1" } else { "0" })
            .env("E2B_SERVER_PID", s.child.id().to_string())
            .env(
                "E2B_EXPECT_HOME",
                base.split_once(",home=").map_or("/home/user", |(_, h)| h),
            )
            .output()
            .unwrap()
    };
    let out = sdk(scenario);
    // The example users copy: E2B's own quick start, unchanged.
    let example = sdk(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/e2b_quickstart.py"
    ));

    // The server destroys what a failed scenario left behind.
    s.terminate();

    served::assert_all_ok(&format!("scenario.py on {tier}"), &out, SCENARIO_LIMIT_S);
    assert_eq!(
        String::from_utf8_lossy(&example.stdout),
        "Hello from E2B!\n\n",
        "examples/e2b_quickstart.py: {}\n{}",
        example.status,
        String::from_utf8_lossy(&example.stderr)
    );
}

/// E2B's code interpreter on the server's sandboxes, driven by the official
/// `e2b-code-interpreter` SDK (`tests/e2b/interpreter.py`): `Sandbox.create()` with its
/// default template, `run_code` (values, displays, errors, callbacks, a shell line),
/// contexts, per-call environment, a timeout that interrupts the cell, reconnecting, a
/// killed sandbox, a sandbox without public traffic, and the tokens the port takes.
#[test]
fn the_official_code_interpreter_sdk_runs_cells_on_container_sandboxes() {
    interpreter_on("container");
}

#[test]
fn the_official_code_interpreter_sdk_runs_cells_on_gvisor_sandboxes() {
    interpreter_on("gvisor");
}

fn interpreter_on(tier: &str) {
    let Some(python) = python_with("e2b_code_interpreter") else {
        return;
    };
    let Some((mut s, url)) = serve_on(tier, &["--template", &format!("base=-,tier={tier}")]) else {
        return;
    };
    let sdk = |script: &str| sdk_command(&python, &url, script).output().unwrap();
    let out = sdk(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/e2b/interpreter.py"
    ));
    // The example users copy.
    let example = sdk(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/e2b_interpreter_quickstart.py"
    ));
    s.terminate();
    assert_eq!(
        String::from_utf8_lossy(&example.stdout),
        "2\nNameError\n",
        "examples/e2b_interpreter_quickstart.py: {}\n{}",
        example.status,
        String::from_utf8_lossy(&example.stderr)
    );
    served::assert_all_ok(&format!("interpreter.py on {tier}"), &out, SCENARIO_LIMIT_S);
}
