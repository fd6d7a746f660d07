//! `agent-sandbox serve` started as users start it (the CLI on loopback, a token file, a
//! state directory of its own), and `curl` against it: shared by the tests that drive it.

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Stdio};

/// `None` when the container tier can run here, else the probe's reason.
pub fn container_available() -> Option<String> {
    unavailable("container")
}

/// `None` when `tier` can run here, else the probe's reason.
pub fn unavailable(tier: &str) -> Option<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["probe", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let t = v["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == tier)
        .cloned()
        .unwrap_or_default();
    if t["available"] == true {
        None
    } else {
        Some(t["reason"].as_str().unwrap_or("not built in").to_string())
    }
}

/// The server: its process, base URL, token and state directory.
pub struct Serve {
    pub child: Child,
    pub base: String,
    pub token: String,
    pub dir: tempfile::TempDir,
}

impl Serve {
    /// SIGTERM, then waits for it to exit (30 s at most; past that, the drop kills it): the
    /// server destroys every sandbox it holds on the way out.
    pub fn terminate(&mut self) {
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        for _ in 0..300 {
            if self.child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn serve() -> Serve {
    serve_in(tempfile::tempdir().unwrap()).0
}

/// The server with `dir` as its state directory (and its token file's); also the stderr
/// lines before "listening".
pub fn serve_in(dir: tempfile::TempDir) -> (Serve, String) {
    serve_with(dir, &[], &[])
}

/// The server with `dir` as its state directory, extra arguments and environment.
pub fn serve_with(dir: tempfile::TempDir, args: &[&str], env: &[(&str, &str)]) -> (Serve, String) {
    serve_with_token(dir, &"t".repeat(40), args, env)
}

/// [`serve_with`], the bearer token `token` (in `dir`'s token file): for clients that
/// constrain its form, as the E2B SDK wants lowercase hex.
pub fn serve_with_token(
    dir: tempfile::TempDir,
    token: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Serve, String) {
    let token = token.to_string();
    let file = dir.path().join("token");
    std::fs::write(&file, &token).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["serve", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(&file)
        .arg("--state-dir")
        .arg(dir.path())
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // "listening on http://127.0.0.1:PORT (bearer token in FILE)", after any report of an
    // earlier run's leftovers.
    let (base, seen) = await_line(&mut child, "serve", |line| {
        line.split_whitespace()
            .find(|w| w.starts_with("http://"))
            .map(str::to_string)
    });
    (
        Serve {
            child,
            base,
            token,
            dir,
        },
        seen,
    )
}

pub fn curl(s: &Serve, method: &str, path: &str, body: Option<&str>) -> (u16, serde_json::Value) {
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

/// Reads `child`'s piped stderr until `found` makes something of a line, and returns it
/// with all that was printed up to it; its later output is not read but let go nowhere,
/// rather than fill the pipe. `what` exited before such a line: a panic with what it printed.
pub fn await_line<T>(
    child: &mut Child,
    what: &str,
    found: impl Fn(&str) -> Option<T>,
) -> (T, String) {
    let mut lines = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let mut seen = String::new();
    let t = loop {
        line.clear();
        if lines.read_line(&mut line).unwrap() == 0 {
            panic!("{what} exited before listening: {seen}");
        }
        seen.push_str(&line);
        if let Some(t) = found(&line) {
            break t;
        }
    };
    std::thread::spawn(move || std::io::copy(&mut lines, &mut std::io::sink()));
    (t, seen)
}

/// Asserts that a client script (run under `timeout` for at most `limit_s` seconds) exited 0
/// and printed `all ok` last; else fails with its exit status, stdout and stderr.
pub fn assert_all_ok(what: &str, out: &std::process::Output, limit_s: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("all ok"),
        "{what}: {} (124: it ran past {limit_s} s)\n--- stdout ---\n{stdout}--- stderr \
         ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
