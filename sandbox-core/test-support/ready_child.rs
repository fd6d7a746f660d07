//! Shared by the backends' integration tests (`#[path]`-included, not part of the crate):
//! runs one of the test binary's own ignored tests in a child process and waits until it
//! says it is ready.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};

/// Starts this test binary's ignored test `name` in a child process (with `env` added) and
/// returns it once it printed a line `READY <value>`, with that value. Panics, killing the
/// child, if it ends its output without one.
pub fn start(name: &str, env: &[(&str, &std::path::Path)]) -> (Child, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--ignored", "--nocapture"])
        .stdout(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        if let Some(v) = line.unwrap().strip_prefix("READY ") {
            return (child, v.trim().to_string());
        }
    }
    let _ = child.kill();
    let status = child.wait();
    panic!("the child process {name} never got ready ({status:?})");
}
