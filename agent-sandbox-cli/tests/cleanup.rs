//! `agent-sandbox cleanup` and a restarted `serve` after a server was `kill -9`ed while its
//! sandboxes were paused (a client's `pause`, an idle `on_idle: pause`): a frozen sandbox
//! acts on no signal, its owner's death included, until it is thawed, so only a cleanup
//! that judges sandboxes by their owner (and thaws them) removes it. Each test checks that
//! the host is then as it was before the sandbox existed: no process, cgroup or mount of it,
//! no gVisor state directory. On the container tier (and gVisor where it runs here).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod served;

use std::process::Command;
use std::time::{Duration, Instant};

use served::{container_available, curl, serve, serve_in, Serve};

/// The tests of this file one at a time: every `cleanup` and every `serve` start sweeps
/// the whole host, and would take (and report) another test's leftovers.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The command line of the background command each sandbox runs.
const MARKER: &str = "sleep\u{0}765.4321\u{0}";

/// Creates a sandbox on `tier` (with `lifetime`, a JSON object, if any) running the marker
/// command in the background; returns its id.
fn sandbox_with_marker(s: &Serve, tier: &str, lifetime: Option<&str>) -> String {
    let body = match lifetime {
        Some(l) => {
            format!(r#"{{"spec": {{"language": "shell"}}, "tier": "{tier}", "lifetime": {l}}}"#)
        }
        None => format!(r#"{{"spec": {{"language": "shell"}}, "tier": "{tier}"}}"#),
    };
    let (code, info) = curl(s, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(code, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    let (code, out) = curl(
        s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"code": "sleep 765.4321 >/dev/null 2>&1 & echo ok"}"#),
    );
    assert_eq!((code, &out["stdout"]), (200, &"ok\n".into()), "{out}");
    id
}

/// Kills the server with `SIGKILL` (its gVisor watchdog first, when it has one and
/// `watchdog_too`: a whole process tree going down) and reaps it.
fn kill_server(s: &mut Serve, watchdog_too: bool) -> u32 {
    let pid = s.child.id();
    if watchdog_too {
        for w in children_of(pid)
            .into_iter()
            .filter(|(_, c)| c.contains("asb-gvisor-watchdog"))
        {
            // SAFETY: kill(2) of the server's watchdog, a child of our child.
            unsafe { libc::kill(w.0, libc::SIGKILL) };
        }
    }
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let _ = s.child.wait();
    pid
}

/// (pid, command line) of the children of `parent`.
fn children_of(parent: u32) -> Vec<(i32, String)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let ppid: u32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            (ppid == parent).then(|| (pid, String::from_utf8_lossy(&cmd).replace('\0', " ")))
        })
        .collect()
}

/// What of the server `pid`'s sandboxes (container ones tagged `asb-<pid>-`, gVisor ones
/// by id) is on this host: processes in their cgroups, naming them or running the marker
/// command, their cgroups, mounts naming them, gVisor state directories.
fn left_of(pid: u32, gvisor_ids: &[String]) -> Vec<String> {
    let tag = format!("asb-{pid}-");
    let mut left = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let cg = std::fs::read_to_string(e.path().join("cgroup")).unwrap_or_default();
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).into_owned();
        if cg.contains(&tag) || cmd == MARKER || gvisor_ids.iter().any(|id| cmd.contains(id)) {
            left.push(format!("process {p}: {}", cmd.replace('\0', " ")));
        }
    }
    let mut names = vec![tag.clone()];
    names.extend(
        gvisor_ids
            .iter()
            .map(|id| format!("agent-sandbox-gvisor-{id}")),
    );
    for n in &names {
        let find = Command::new("find")
            .args(["/sys/fs/cgroup", "-maxdepth", "6", "-type", "d", "-name"])
            .arg(format!("{n}*"))
            .output()
            .unwrap();
        left.extend(
            String::from_utf8_lossy(&find.stdout)
                .lines()
                .map(|l| format!("cgroup {l}")),
        );
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for l in mounts.lines() {
        if l.contains(&tag) || gvisor_ids.iter().any(|id| l.contains(id.as_str())) {
            left.push(format!("mount {l}"));
        }
    }
    for id in gvisor_ids {
        let d = std::env::temp_dir().join("agent-sandbox-gvisor").join(id);
        if d.exists() {
            left.push(format!("state {}", d.display()));
        }
    }
    left
}

/// [`left_of`] polled until it is empty or `limit` passed.
fn left_after(pid: u32, gvisor_ids: &[String], limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = left_of(pid, gvisor_ids);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether container sandbox cgroup `name` is frozen (v1 freezer or v2 `cgroup.freeze`).
fn frozen(name: &str) -> bool {
    let find = Command::new("find")
        .args([
            "/sys/fs/cgroup",
            "-maxdepth",
            "6",
            "-type",
            "d",
            "-name",
            name,
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&find.stdout).lines().any(|d| {
        let read = |f: &str| std::fs::read_to_string(format!("{d}/{f}")).unwrap_or_default();
        read("freezer.state").trim() == "FROZEN" || read("cgroup.freeze").trim() == "1"
    })
}

/// `agent-sandbox cleanup --json`: the row of each tier.
fn cleanup_json() -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["cleanup", "--json"])
        .env_remove("AGENT_SANDBOX_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["tiers"].as_array().unwrap().clone()
}

/// The row of `tier` in `rows`.
fn row<'a>(rows: &'a [serde_json::Value], tier: &str) -> &'a serde_json::Value {
    rows.iter()
        .find(|r| r["tier"] == tier)
        .unwrap_or_else(|| panic!("no {tier} row: {rows:?}"))
}

/// The names in a row's `thawed` list.
fn thawed(row: &serde_json::Value) -> Vec<String> {
    row["thawed"]
        .as_array()
        .unwrap_or_else(|| panic!("no thawed list: {row}"))
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn cleanup_thaws_and_removes_the_paused_sandboxes_of_a_killed_server() {
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let _one = serial();
    let mut s = serve();
    let container = sandbox_with_marker(&s, "container", None);
    let (code, out) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{container}/pause"),
        None,
    );
    assert_eq!(code, 204, "{out}");
    let mut gvisor_ids = Vec::new();
    if served::unavailable("gvisor").is_none() {
        let g = sandbox_with_marker(&s, "gvisor", None);
        let (code, out) = curl(&s, "POST", &format!("/v1/sandboxes/{g}/pause"), None);
        assert_eq!(code, 204, "{out}");
        gvisor_ids.push(g);
    } else {
        eprintln!("(gVisor is not available here: containers only)");
    }
    // The server and its gVisor watchdog die at once (a whole process tree killed): only
    // `cleanup` is left to remove what they had.
    let pid = kill_server(&mut s, true);
    let name = format!("asb-{pid}-{container}");
    assert!(frozen(&name), "{name} is not frozen");
    let before = left_of(pid, &gvisor_ids);
    assert!(
        before.iter().any(|l| l.starts_with("process"))
            && before.iter().any(|l| l.starts_with("cgroup")),
        "the paused sandboxes did not outlive their server: {before:?}"
    );
    let rows = cleanup_json();
    let c = row(&rows, "container");
    assert!(thawed(c).contains(&name), "{c}");
    assert!(c["removed"].as_u64().unwrap() >= 1, "{c}");
    if let Some(g) = gvisor_ids.first() {
        let r = row(&rows, "gvisor");
        assert_eq!(thawed(r), vec![g.clone()], "{r}");
        assert_eq!(r["removed"], 1, "{r}");
    }
    let left = left_after(pid, &gvisor_ids, Duration::from_secs(20));
    assert!(left.is_empty(), "left after cleanup:\n{}", left.join("\n"));
    // Nothing left to do.
    let rows = cleanup_json();
    assert!(!thawed(row(&rows, "container")).contains(&name));
}

#[test]
fn a_restarted_server_removes_a_sandbox_its_killed_predecessor_paused_when_idle() {
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let _one = serial();
    let mut s = serve();
    let id = sandbox_with_marker(
        &s,
        "container",
        Some(r#"{"idle_timeout_s": 1, "on_idle": "pause"}"#),
    );
    // Idle: paused by the server (polled, 20 s at most).
    let deadline = Instant::now() + Duration::from_secs(20);
    while curl(&s, "GET", &format!("/v1/sandboxes/{id}"), None).1["state"] != "paused" {
        assert!(Instant::now() < deadline, "{id} was never paused when idle");
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = kill_server(&mut s, true);
    let name = format!("asb-{pid}-{id}");
    assert!(frozen(&name), "{name} is not frozen");
    // A new server on the same state directory: its start-up sweep.
    let dir = std::mem::replace(&mut s.dir, tempfile::tempdir().unwrap());
    let (s2, said) = serve_in(dir);
    assert!(
        said.contains("thawed first") && said.contains(&name),
        "the restart did not say what it thawed: {said}"
    );
    let left = left_after(pid, &[], Duration::from_secs(20));
    assert!(
        left.is_empty(),
        "left after the restart ({said}):\n{}",
        left.join("\n")
    );
    let (code, list) = curl(&s2, "GET", "/v1/sandboxes", None);
    assert_eq!((code, &list["sandboxes"]), (200, &serde_json::json!([])));
}
