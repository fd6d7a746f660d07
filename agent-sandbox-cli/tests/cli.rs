//! The CLI contract: `probe` and `select` answer with real data, argument errors exit 2 with a
//! clear message, sandbox failures exit 125.

// In tests a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

use serde_json::Value;

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(args)
        .env_remove("AGENT_SANDBOX_LOG")
        .output()
        .expect("run the agent-sandbox binary")
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn probe_lists_every_tier_with_reason_and_fix() {
    let out = cli(&["probe", "--json"]);
    assert!(out.status.success());
    let v = json(&out);
    let tiers = v["tiers"].as_array().unwrap();
    let names: Vec<&str> = tiers.iter().map(|t| t["tier"].as_str().unwrap()).collect();
    assert_eq!(names, ["wasm", "container", "gvisor", "microvm"]);
    for t in tiers {
        assert!(t["available"].is_boolean());
        assert!(!t["reason"].as_str().unwrap().is_empty());
        if t["available"] == false {
            assert!(!t["fix"].as_str().unwrap().is_empty(), "{t}");
        }
    }
    let text = cli(&["probe"]);
    assert!(text.status.success());
    assert!(String::from_utf8_lossy(&text.stdout).contains("microvm"));
}

#[test]
fn probe_says_which_limits_each_tier_enforces() {
    let v = json(&cli(&["probe", "--json"]));
    let limits = |tier: &str| -> Vec<String> {
        let t = v["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tier"] == tier)
            .unwrap();
        t["capabilities"]["limits"]
            .as_array()
            .unwrap_or_else(|| panic!("{tier}: no capabilities.limits in {t}"))
            .iter()
            .map(|l| l.as_str().unwrap().to_string())
            .collect()
    };
    // Fuel is an instruction budget: only WebAssembly has one; processes only exist outside it.
    assert!(limits("wasm").contains(&"fuel".to_string()));
    assert!(!limits("wasm").contains(&"pids".to_string()));
    for tier in ["container", "gvisor", "microvm"] {
        let l = limits(tier);
        assert!(!l.contains(&"fuel".to_string()), "{tier}: {l:?}");
        assert!(l.contains(&"wall-time".to_string()), "{tier}: {l:?}");
    }
    let text = String::from_utf8_lossy(&cli(&["probe"]).stdout).into_owned();
    assert!(text.contains("enforces: wall-time"), "{text}");
}

fn select(lang: &str, trust: &str, io: &str, kernel: &str) -> Value {
    let out = cli(&[
        "select", "--lang", lang, "--trust", trust, "--io", io, "--kernel", kernel, "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    json(&out)
}

fn ranking(v: &Value) -> Vec<String> {
    v["ranking"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn select_answers_the_seed_cases() {
    let cases: &[(&str, &str, &str, &str, &[&str])] = &[
        (
            "javascript",
            "untrusted",
            "compute",
            "none",
            &["wasm", "gvisor", "microvm"],
        ),
        (
            "python",
            "untrusted",
            "compute",
            "none",
            &["wasm", "gvisor", "microvm"],
        ),
        (
            "c",
            "untrusted",
            "syscall-heavy",
            "none",
            &["microvm", "gvisor"],
        ),
        (
            "shell",
            "untrusted",
            "syscall-heavy",
            "none",
            &["microvm", "gvisor"],
        ),
        (
            "node",
            "untrusted",
            "syscall-heavy",
            "none",
            &["microvm", "gvisor"],
        ),
        (
            "shell",
            "trusted",
            "syscall-heavy",
            "none",
            &["container", "gvisor", "microvm"],
        ),
        ("shell", "trusted", "syscall-heavy", "custom", &["microvm"]),
        ("wasm", "untrusted", "compute", "none", &["wasm"]),
    ];
    for (lang, trust, io, kernel, want) in cases {
        let v = select(lang, trust, io, kernel);
        assert_eq!(ranking(&v), *want, "{lang} {trust} {io} {kernel}");
        let reasons = v["reasons"].as_object().unwrap();
        for t in *want {
            assert!(!reasons[*t].as_str().unwrap().is_empty());
        }
        // `chosen` is the first available tier of the ranking, or null.
        let statuses = v["statuses"].as_array().unwrap();
        let first_available = statuses
            .iter()
            .find(|s| s["available"] == true)
            .map(|s| s["tier"].clone());
        assert_eq!(v["chosen"], first_available.unwrap_or(Value::Null));
    }
}

#[test]
fn argument_errors_exit_2_with_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["run", "--tier", "docker", "-c", "x"], "docker"),
        (&["run", "--tier", "unisolated", "-c", "x"], "test-only"),
        (&["run", "--env", "NOEQUALS", "-c", "x"], "KEY=VALUE"),
        (&["run", "--mount", "relative-only", "-c", "x"], "SRC:DST"),
        (
            &["run", "--allow-host", "bad host", "-c", "x"],
            "not a valid host name",
        ),
        (
            &[
                "run",
                "--allow-host",
                "a.test",
                "--allow-internet",
                "-c",
                "x",
            ],
            "cannot be used with",
        ),
        (&["run", "--timeout", "0", "-c", "x"], "seconds"),
        (&["run", "--timeout", "soon", "-c", "x"], "seconds"),
        (&["run", "--memory", "1", "-c", "x"], "1"),
        (&["run", "--lang", "cobol", "-c", "x"], "unknown language"),
        (&["run"], "nothing to run"),
        (
            &["run", "--mount", "/nonexistent-xyz:/data", "-c", "x"],
            "does not exist",
        ),
        (&["select", "--trust", "trusted"], "--lang"),
        (
            &["select", "--lang", "python", "--io", "sometimes"],
            "sometimes",
        ),
        (&["frobnicate"], "frobnicate"),
        (&["run", "-p", "0", "-c", "x"], "sandbox port 0"),
        (&["run", "-p", "70000", "-c", "x"], "70000"),
        (
            &["run", "-p", "nothere:1:80", "-c", "x"],
            "not an IP address",
        ),
    ];
    for (args, needle) in cases {
        let out = cli(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn run_without_an_available_tier_exits_125_and_says_why() {
    // The microvm tier is built in; where the probe says it cannot run (no hardware KVM for
    // Linux guests, or no guest installed), `run --tier microvm` fails with the probe's reason
    // and fix, and `auto` never picks it.
    let probe = json(&cli(&["probe", "--json"]));
    let microvm = probe["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "microvm")
        .unwrap()
        .clone();
    if microvm["available"] == true {
        eprintln!("SKIP: the microvm tier is available on this host");
        return;
    }
    let out = cli(&["run", "--tier", "microvm", "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("microvm") && err.contains("fix"), "{err}");
    assert!(err.contains(microvm["reason"].as_str().unwrap()), "{err}");
    assert!(err.contains(microvm["fix"].as_str().unwrap()), "{err}");
    let v = select("shell", "untrusted", "syscall-heavy", "custom");
    assert_ne!(v["chosen"], "microvm", "{v}");
}

#[test]
fn install_microvm_guest_reports_bad_input_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-vmlinux");
    let out = cli(&[
        "install",
        "microvm-guest",
        "--kernel",
        missing.to_str().unwrap(),
        "--dir",
        dir.path().join("cache").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("installing the microVM guest failed") && err.contains("no-such-vmlinux"),
        "{err}"
    );
    // Not a kernel at all.
    let junk = dir.path().join("junk");
    std::fs::write(&junk, b"not a kernel").unwrap();
    let out = cli(&[
        "install",
        "microvm-guest",
        "--kernel",
        junk.to_str().unwrap(),
        "--dir",
        dir.path().join("cache").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("kernel"), "{err}");
    // The microvm options belong to microvm-guest.
    let out = cli(&["install", "python-wasm", "--dir", "/tmp"]);
    assert_eq!(out.status.code(), Some(2));
}

fn tier_available(tier: &str) -> bool {
    let v = json(&cli(&["probe", "--json"]));
    v["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["tier"] == tier && t["available"] == true)
}

#[test]
fn run_on_gvisor_prints_output_and_passes_exit_codes() {
    if !tier_available("gvisor") {
        eprintln!("SKIP: the gvisor tier is unavailable on this host (see `agent-sandbox probe`)");
        return;
    }
    let out = cli(&[
        "run",
        "--tier",
        "gvisor",
        "--",
        "/bin/sh",
        "-c",
        "echo out; echo err >&2; exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("err"));
    let out = cli(&[
        "run",
        "--tier",
        "gvisor",
        "--lang",
        "python",
        "--env",
        "A=1",
        "--json",
        "-c",
        "import os; print(os.environ['A'])",
    ]);
    assert!(out.status.success());
    let v = json(&out);
    assert_eq!(v["tier"], "gvisor");
    assert_eq!(v["stdout"], "1\n");
    assert_eq!(v["exit_code"], 0);
    assert_eq!(v["truncated"], false);
    assert!(v["limit"].is_null());
    let phases: Vec<&str> = v["timeline"]["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(phases.last(), Some(&"first-command"));
    let out = cli(&[
        "run",
        "--tier",
        "gvisor",
        "--timeout",
        "1",
        "--lang",
        "shell",
        "-c",
        "sleep 30",
    ]);
    assert_eq!(out.status.code(), Some(137));
    assert!(String::from_utf8_lossy(&out.stderr).contains("wall-time"));
}

/// A one-request HTTP server on loopback answering `hello`; returns its port.
fn loopback_http_server() -> u16 {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
            );
        }
    });
    port
}

/// The sandboxed side: one absolute-URI request through `$HTTP_PROXY`, printing the status
/// line and body (raw sockets: no client library decides anything for us).
const PROXY_GET: &str = r#"
import os, socket, sys
host, port = os.environ["HTTP_PROXY"].split("//", 1)[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=20)
url = "URL"
s.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (url, url.split("/")[2])).encode())
data = b""
while True:
    b = s.recv(65536)
    if not b:
        break
    data += b
head, _, body = data.partition(b"\r\n\r\n")
print(head.split(b"\r\n")[0].decode(), body.decode(errors="replace")[:40])
"#;

#[test]
fn run_with_allow_host_reaches_only_what_it_allows() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !tier_available("container") {
        eprintln!("SKIP: needs root and the container tier (see `agent-sandbox probe`)");
        return;
    }
    // `localhost` resolves from /etc/hosts on the host side; loopback is allowed only because
    // the command lists it (`--allow-cidr`), as the policy requires for any local range.
    let port = loopback_http_server();
    let url = format!("http://localhost:{port}/");
    let ok = PROXY_GET.replace("URL", &url);
    let refused = PROXY_GET.replace("URL", "http://not-listed.invalid/");
    let base = [
        "run",
        "--tier",
        "container",
        "--allow-host",
        "localhost",
        "--allow-cidr",
        "127.0.0.1/32",
        "--allow-cidr",
        "::1/128",
        "--lang",
        "python",
        "-c",
    ];
    let mut args = base.to_vec();
    args.push(&ok);
    let out = cli(&args);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout.trim(), "HTTP/1.1 200 OK hello", "{stderr}");
    // A name the flags do not list: refused by the proxy, reported on stderr, never resolved.
    let mut args = base.to_vec();
    args.push(&refused);
    let out = cli(&args);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(stdout.starts_with("HTTP/1.1 403"), "{stdout}{stderr}");
    assert!(
        stderr.contains("network: denied not-listed.invalid"),
        "{stderr}"
    );
    // --allow-internet still refuses the metadata endpoint (decided before any dial).
    let out = cli(&[
        "run",
        "--tier",
        "container",
        "--allow-internet",
        "--json",
        "--lang",
        "python",
        "-c",
        &PROXY_GET.replace("URL", "http://169.254.169.254/latest/meta-data/"),
    ]);
    let v = json(&out);
    assert!(
        v["stdout"].as_str().unwrap().starts_with("HTTP/1.1 403"),
        "{v}"
    );
    let net = v["network"].as_array().unwrap();
    assert!(
        net.iter()
            .any(|e| e["ip"] == "169.254.169.254" && e["allowed"] == false),
        "{v}"
    );
}

/// The processes whose parent is `parent`, with their command lines.
fn children_of(parent: u32) -> Vec<(i32, String)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse::<u32>()
                .ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            (ppid == parent).then(|| (pid, String::from_utf8_lossy(&cmd).replace('\0', " ")))
        })
        .collect()
}

#[test]
fn cleanup_removes_the_gvisor_sandbox_of_a_killed_run() {
    let probe = json(&cli(&["probe", "--json"]));
    let gvisor = probe["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "gvisor")
        .unwrap()
        .clone();
    if gvisor["available"] != true {
        eprintln!("SKIP: gvisor tier unavailable: {}", gvisor["reason"]);
        return;
    }
    let mut run = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args([
            "run", "--tier", "gvisor", "--lang", "shell", "--", "sleep", "60",
        ])
        .env_remove("AGENT_SANDBOX_LOG")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The run's sandbox (runsc processes it adopted) and its watchdog, once it is running.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let (root, watchdog) = loop {
        let kids = children_of(run.id());
        // The sandbox process (`runsc-sandbox ... boot`), adopted once `runsc run` is done.
        let root = kids.iter().find_map(|(_, c)| {
            let mut args = c.split_whitespace();
            let r = args.clone().find(|a| a.starts_with("--root="))?;
            args.any(|a| a == "boot")
                .then(|| r.trim_start_matches("--root=").to_string())
        });
        let watchdog = kids
            .iter()
            .find(|(_, c)| c.contains("asb-gvisor-watchdog"))
            .map(|(p, _)| *p);
        if let (Some(r), Some(w)) = (root, watchdog) {
            break (r, w);
        }
        if std::time::Instant::now() > deadline {
            let _ = run.kill();
            panic!("no running gVisor sandbox after 60 s ({:?})", run.wait());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    // The run and its watchdog are killed (as when a whole process tree goes down).
    // SAFETY: kills the watchdog process found above (a child of our child).
    unsafe { libc::kill(watchdog, libc::SIGKILL) };
    run.kill().unwrap();
    run.wait().unwrap();
    let named = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|e| {
                std::fs::read(e.path().join("cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&root))
            })
            .count()
    };
    assert!(named() > 0, "the sandbox did not outlive its run");
    let out = cli(&["cleanup", "--json"]);
    assert!(out.status.success());
    let v = json(&out);
    let removed = v["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "gvisor")
        .and_then(|t| t["removed"].as_u64())
        .unwrap();
    assert!(removed >= 1, "{v}");
    assert_eq!(named(), 0, "runsc processes of {root} left");
    let dir = std::path::Path::new(&root).parent().unwrap();
    assert!(!dir.exists(), "{} left", dir.display());
}

/// The cgroup directories (any hierarchy, nested up to a few levels) whose name contains one
/// of `needles`.
fn cgroups_named(needles: &[String]) -> Vec<std::path::PathBuf> {
    fn walk(
        dir: &std::path::Path,
        depth: usize,
        needles: &[String],
        out: &mut Vec<std::path::PathBuf>,
    ) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = e.file_name().to_string_lossy().into_owned();
            if needles.iter().any(|n| name.contains(n.as_str())) {
                out.push(e.path());
            } else if depth > 0 {
                walk(&e.path(), depth - 1, needles, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(std::path::Path::new("/sys/fs/cgroup"), 6, needles, &mut out);
    out
}

/// The mounts of this process's namespace whose mount point or source contains `needle`.
fn mounts_naming(needle: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

/// What one `agent-sandbox run --tier TIER -- /bin/true` leaves behind once it has exited:
/// processes (its orphans, adopted by this process, a child subreaper), cgroup directories
/// and mounts. Runs in a process of its own (this test binary again, see
/// `one_shot_run_leaves_nothing_behind`) so that adopting orphans touches no other test.
fn leftovers_of_one_shot(tier: &str) -> Vec<String> {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) has no memory effects.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(rc, 0);
    // A state directory of this run's own (gVisor keeps its sandboxes under $TMPDIR).
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("agent-sandbox-gvisor");
    let mut child = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["run", "--tier", tier, "--", "/bin/true"])
        .env_remove("AGENT_SANDBOX_LOG")
        .env("TMPDIR", tmp.path())
        .spawn()
        .unwrap();
    let cli_pid = child.id();
    // The gVisor sandbox ids, seen while it runs (its cgroups are named after them).
    let mut ids = std::collections::BTreeSet::new();
    let status = loop {
        if let Ok(rd) = std::fs::read_dir(&state) {
            ids.extend(
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("as-")),
            );
        }
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    assert!(status.success(), "{tier}: run failed: {status}");
    let mut left = Vec::new();
    // Processes: whatever the run started is now ours; each must exit on its own (the
    // container zygote on its socket's end, the gVisor watchdog once nothing is left to
    // sweep). Reaped as they go; no timing is asserted, only that they all end.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        // SAFETY: waitpid(-1, WNOHANG) on our own children, with no status pointer.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
        let kids = children_of(std::process::id());
        if kids.is_empty() {
            break;
        }
        if std::time::Instant::now() > deadline {
            left.extend(kids.iter().map(|(p, c)| format!("process {p}: {c}")));
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Cgroups: the container tier names its cgroups `asb-<pid>-...`; gVisor's are named after
    // the sandbox id.
    let mut needles = vec![format!("asb-{cli_pid}-")];
    needles.extend(ids.iter().cloned());
    left.extend(
        cgroups_named(&needles)
            .into_iter()
            .map(|p| format!("cgroup {}", p.display())),
    );
    // Mounts: nothing under this run's state directory, nor of a sandbox (the container
    // tier's templates live in its zygote's mount namespace only).
    left.extend(
        mounts_naming(&tmp.path().to_string_lossy())
            .into_iter()
            .map(|m| format!("mount {m}")),
    );
    left.extend(
        mounts_naming("agent-sandbox-templates")
            .into_iter()
            .filter(|m| m.contains("tmpfs") && !m.contains(" shared:"))
            .map(|m| format!("mount {m}")),
    );
    // State: no sandbox directory left.
    if let Ok(rd) = std::fs::read_dir(&state) {
        left.extend(
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("as-"))
                .map(|e| format!("state {}", e.path().display())),
        );
    }
    left
}

#[test]
fn one_shot_run_leaves_nothing_behind() {
    // The child role: report leftovers as lines on stdout.
    if let Ok(tier) = std::env::var("AGENT_SANDBOX_TEST_LEAK_CHILD") {
        for l in leftovers_of_one_shot(&tier) {
            // Own lines: the test harness prints the test's name before its output.
            println!("\nLEFT {l}");
        }
        println!("\nCHECKED {tier}");
        return;
    }
    let mut checked = 0;
    for tier in ["container", "gvisor"] {
        if !tier_available(tier) {
            eprintln!("SKIP {tier}: unavailable on this host (see `agent-sandbox probe`)");
            continue;
        }
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "one_shot_run_leaves_nothing_behind",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("AGENT_SANDBOX_TEST_LEAK_CHILD", tier)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{tier}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.lines().any(|l| l == format!("CHECKED {tier}")),
            "{tier}: the check did not run: {text}"
        );
        let left: Vec<&str> = text.lines().filter(|l| l.starts_with("LEFT ")).collect();
        assert!(left.is_empty(), "{tier}: a one-shot run left {left:#?}");
        checked += 1;
    }
    if checked == 0 {
        eprintln!("SKIP: neither the container nor the gvisor tier is available here");
    }
}

#[test]
fn install_python_wasm_speaks_in_sentences() {
    // Only where Python is installed already (else this would download ~98 MB): the install
    // then checks what is there and says so, progress lines included, without Rust syntax.
    let v = json(&cli(&["probe", "--json"]));
    let installed = v["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["tier"] == "wasm" && t["details"]["python_installed"] == "true");
    if !installed {
        eprintln!("SKIP: Python is not installed for the wasm tier here");
        return;
    }
    let out = cli(&["install", "python-wasm"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.starts_with("python-wasm installed: "), "{stdout}");
    for line in stdout.lines().chain(stderr.lines()) {
        assert!(
            !line.contains('{') && !line.contains("Some(") && !line.contains("file:"),
            "not a sentence: {line}"
        );
        assert!(line.trim_end().ends_with('.'), "not a sentence: {line}");
    }
}

/// A final expression is printed the same way in Python and JavaScript on the wasm tier
/// (Python's displayhook; the JavaScript completion value echoed alike).
#[test]
fn final_values_print_alike_in_python_and_javascript() {
    let v = json(&cli(&["probe", "--json"]));
    let wasm_ok = v["tiers"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["tier"] == "wasm" && t["available"] == true);
    if !wasm_ok {
        eprintln!("SKIP: the wasm tier is unavailable here");
        return;
    }
    for (lang, code) in [
        ("javascript", r#""abc".toUpperCase()"#),
        ("python", "'abc'.upper()"),
    ] {
        let out = cli(&["run", "--tier", "wasm", "--lang", lang, "-c", code]);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "'ABC'\n",
            "{lang}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(0), "{lang}");
    }
    let out = cli(&["run", "--tier", "wasm", "--lang", "javascript", "-c", "2+2"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "4\n");
}

/// `run --workspace DIR` in a directory owned by an unprivileged user (uid 1234), and in one
/// of root's own, on every tier that runs shell commands here: the command writes it, and
/// what it writes belongs to the directory's owner on the host (see "Identity" in
/// docs/container.md). As root only (it chowns).
#[test]
fn run_with_a_workspace_writes_files_its_owner_owns() {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: needs root (a directory of another owner)");
        return;
    }
    let mut ran = 0;
    for tier in ["container", "gvisor"] {
        if !tier_available(tier) {
            eprintln!("SKIP {tier}: unavailable on this host (see `agent-sandbox probe`)");
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::chown(dir.path(), Some(1234), Some(1234)).unwrap();
        let ws = dir.path().to_str().unwrap();
        let out = cli(&[
            "run",
            "--tier",
            tier,
            "--workspace",
            ws,
            "--",
            "sh",
            "-c",
            "touch x && mkdir d && echo hi > d/y && cat d/y",
        ]);
        assert!(
            out.status.success(),
            "{tier}: {:?} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n", "{tier}");
        for f in ["x", "d", "d/y"] {
            let md = std::fs::symlink_metadata(dir.path().join(f)).unwrap();
            assert_eq!((md.uid(), md.gid()), (1234, 1234), "{tier}: {f}");
        }
        // A new user's case: root runs the CLI on a directory of its own. The command
        // writes it (as the sandbox's user), and the files are root's, the owner's.
        let mine = tempfile::tempdir().unwrap();
        let out = cli(&[
            "run",
            "--tier",
            tier,
            "--workspace",
            mine.path().to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "mkdir -p src && echo 'print(1)' > src/main.py && cat src/main.py",
        ]);
        assert!(
            out.status.success(),
            "{tier}: {:?} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "print(1)\n", "{tier}");
        let md = std::fs::symlink_metadata(mine.path().join("src/main.py")).unwrap();
        assert_eq!((md.uid(), md.gid()), (0, 0), "{tier}");
        ran += 1;
    }
    if ran == 0 {
        eprintln!("SKIP: neither the container nor the gvisor tier is available");
    }
}

/// `run --secret NAME=VAR@HOST`: the value comes from the host's environment (or
/// `--secret-file`), never from an argument, and the sandbox's VAR holds a placeholder of the
/// same length, never the value; a bound host the policy does not allow, or a missing value,
/// is a usage error naming the fix. Nothing is sent anywhere.
#[test]
fn run_secret_puts_a_placeholder_inside() {
    let v = json(&cli(&["probe", "--json"]));
    let container = v["tiers"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["tier"] == "container" && t["available"] == true);
    // SAFETY: geteuid has no preconditions.
    if !container || unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: needs the container tier and root (the egress enforcer)");
        return;
    }
    const VALUE: &str = "cli-secret-value-0123456789";
    let run = |extra: &[&str], env_value: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"));
        c.args(["run", "--tier", "container"])
            .args(extra)
            .args(["--", "sh", "-c", "printf %s \"$TOKEN\""])
            .env_remove("AGENT_SANDBOX_LOG")
            .env_remove("CLI_TEST_TOKEN");
        if let Some(v) = env_value {
            c.env("CLI_TEST_TOKEN", v);
        }
        c.output().unwrap()
    };
    let allowed = ["--allow-host", "api.example.com"];
    let secret = ["--secret", "CLI_TEST_TOKEN=TOKEN@api.example.com"];
    let out = run(&[&allowed[..], &secret[..]].concat(), Some(VALUE));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let inside = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(inside.len(), VALUE.len(), "{inside}");
    assert_ne!(inside, VALUE);
    // From a file instead of the environment.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, format!("{VALUE}\n")).unwrap();
    let from_file = format!("CLI_TEST_TOKEN={}", file.display());
    let out = run(
        &[
            &allowed[..],
            &secret[..],
            &["--secret-file", &from_file][..],
        ]
        .concat(),
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout.len(), VALUE.len());
    assert_ne!(String::from_utf8_lossy(&out.stdout), VALUE);
    // No value: a usage error with the fix.
    let out = run(&[&allowed[..], &secret[..]].concat(), None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--secret-file"));
    // A bound host the policy does not allow.
    let out = run(&secret, Some(VALUE));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not allow"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn run_publish_serves_the_host_while_the_command_runs() {
    if !tier_available("container") {
        eprintln!("SKIP: the container tier is not available here (see `agent-sandbox probe`)");
        return;
    }
    use std::io::{BufRead, BufReader, Read, Write};
    // A server inside that answers one request, then exits: the run ends with it.
    let server = r#"import http.server as h
class H(h.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'published-ok')
h.HTTPServer(('127.0.0.1', 8123), H).handle_request()
print('served')"#;
    let mut child = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["run", "--tier", "container", "-p", "8123", "-c", server])
        .env_remove("AGENT_SANDBOX_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let at: std::net::SocketAddr = line
        .trim()
        .rsplit(' ')
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no published address in {line:?}"));
    assert!(
        line.contains("sandbox port 8123 published on 127.0.0.1:"),
        "{line}"
    );
    // The server needs a moment to listen: retry until it answers.
    let mut answer = String::new();
    for _ in 0..200 {
        if let Ok(mut c) = std::net::TcpStream::connect(at) {
            c.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
            answer.clear();
            let _ = c.read_to_string(&mut answer);
            if answer.contains("published-ok") {
                break;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "served\n");
    assert!(
        std::net::TcpStream::connect(at).is_err(),
        "{at} still accepts after the run ended"
    );
}

/// A cell's chart and table: their text printed, the files written by `--outputs`, and every
/// bundle in `--json`.
#[test]
fn run_writes_a_cells_chart_and_table() {
    let v = json(&cli(&["probe", "--json"]));
    let installed = v["tiers"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["tier"] == "wasm" && t["details"]["python_installed"] == "true");
    if !installed {
        eprintln!("SKIP: Python is not installed for the wasm tier here");
        return;
    }
    let code = "import matplotlib.pyplot as plt\nimport pandas as pd\nplt.plot([1, 4, 9])\ndisplay(pd.DataFrame({'n': [1, 2]}))\n1 / 0";
    let dir = tempfile::tempdir().unwrap();
    let outs = dir.path().join("outs");
    let out = cli(&[
        "run",
        "--tier",
        "wasm",
        "--outputs",
        outs.to_str().unwrap(),
        "-c",
        code,
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stdout.contains("   n\n0  1\n1  2\n<Figure size"),
        "{stdout}"
    );
    assert!(stderr.contains("ZeroDivisionError"), "{stderr}");
    let png = std::fs::read(outs.join("output-2.png")).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 5_000);
    let html = std::fs::read_to_string(outs.join("output-1.html")).unwrap();
    assert!(html.contains("<table"), "{html}");

    let v = json(&cli(&["run", "--tier", "wasm", "--json", "-c", code]));
    let outputs = v["outputs"].as_array().unwrap();
    assert_eq!(outputs.len(), 2, "{v}");
    assert_eq!(outputs[0]["kind"], "display_data");
    assert!(outputs[1]["data"]["image/png"]
        .as_str()
        .unwrap()
        .starts_with("iVBORw0KGgo"));
    assert_eq!(v["error"]["name"], "ZeroDivisionError", "{v}");
}
