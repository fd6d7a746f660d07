//! `agent-sandbox serve` as users run it: the CLI binary on loopback with a token file,
//! driven by `curl`, on a real tier (the container tier; skipped, saying why, where the probe
//! says it cannot run). Its OpenAPI document is checked by `openapi-spec-validator` from PyPI
//! (`scripts/test.sh` installs it and sets `AGENT_SANDBOX_TEST_PYTHON`). SIGTERM destroys
//! what the server made.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod served;

use std::process::Command;
use std::time::Duration;

use served::{container_available, curl, serve, serve_in};

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

#[test]
fn container_sandboxes_pause_when_idle_resume_on_use_and_fork_from_a_snapshot() {
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let s = serve();
    let (code, info) = curl(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(
            r#"{"spec": {"language": "shell"}, "tier": "container",
                "lifetime": {"idle_timeout_s": 1, "on_idle": "pause"}}"#,
        ),
    );
    assert_eq!(code, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    let (code, out) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"code": "echo kept > state.txt; echo ok"}"#),
    );
    assert_eq!((code, &out["stdout"]), (200, &"ok\n".into()), "{out}");
    // Idle: paused by the server (polled, 20 s at most).
    let mut state = serde_json::Value::Null;
    for _ in 0..200 {
        state = curl(&s, "GET", &format!("/v1/sandboxes/{id}"), None).1["state"].clone();
        if state == "paused" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(state, "paused");
    // The next request resumes it.
    let (code, out) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"code": "cat state.txt"}"#),
    );
    assert_eq!((code, &out["stdout"]), (200, &"kept\n".into()), "{out}");
    // Paused by a client, it stays paused until a client resumes it.
    let (code, _) = curl(&s, "POST", &format!("/v1/sandboxes/{id}/pause"), None);
    assert_eq!(code, 204);
    let (code, e) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"argv": ["true"]}"#),
    );
    assert_eq!(
        (code, &e["error"]["kind"]),
        (409, &"sandbox_paused".into()),
        "{e}"
    );
    let (code, _) = curl(&s, "POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(code, 204);

    // Snapshot it and fork two: each has the file, in a container of its own.
    let (code, snap) = curl(&s, "POST", &format!("/v1/sandboxes/{id}/snapshot"), None);
    assert_eq!((code, &snap["tier"]), (201, &"container".into()), "{snap}");
    let sid = snap["id"].as_str().unwrap();
    let (code, forked) = curl(
        &s,
        "POST",
        &format!("/v1/snapshots/{sid}/fork"),
        Some(r#"{"count": 2}"#),
    );
    assert_eq!(code, 201, "{forked}");
    for f in forked["sandboxes"].as_array().unwrap() {
        assert_eq!(f["tier"], "container");
        let (code, out) = curl(
            &s,
            "POST",
            &format!("/v1/sandboxes/{}/exec", f["id"].as_str().unwrap()),
            Some(r#"{"code": "cat state.txt"}"#),
        );
        assert_eq!((code, &out["stdout"]), (200, &"kept\n".into()), "{out}");
    }
    // The snapshot lives in the server's state directory.
    assert!(s
        .dir
        .path()
        .join("snapshots")
        .read_dir()
        .unwrap()
        .next()
        .is_some());
}

#[test]
fn run_with_server_runs_in_the_servers_sandbox() {
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let s = serve();
    let token_file = s.dir.path().join("token");
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
            .args(["run", "--server", &s.base, "--token-file"])
            .arg(&token_file)
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&[
        "--tier",
        "container",
        "--",
        "sh",
        "-c",
        "echo from-$(id -u); exit 3",
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-1000\n");
    // The server made it (labelled by nobody: a plain create) and it is gone again.
    let (_, list) = curl(&s, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sandboxes"], serde_json::json!([]), "{list}");
    // What a token does not grant is refused, saying so; nothing is left behind.
    // (An invalid spec, as the CLI says of every spec it cannot run: exit 2.)
    let out = run(&["--tier", "container", "--workspace", "/tmp", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refused by the server") && err.contains("--allow-host-access"),
        "{err}"
    );
    // A wrong token and a dead address: said plainly.
    let bad = s.dir.path().join("bad-token");
    std::fs::write(&bad, "w".repeat(40)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["run", "--server", &s.base, "--token-file"])
        .arg(&bad)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("refused the token"),
        "{out:?}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["run", "--server", "http://127.0.0.1:1", "--token-file"])
        .arg(&token_file)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unreachable"),
        "{out:?}"
    );
}

/// What of the server `pid` (and of the gVisor sandboxes `ids`) is still on this host:
/// processes in its sandboxes' cgroups or naming a sandbox, cgroup directories, mounts,
/// gVisor state directories.
fn left_of(pid: u32, ids: &[String]) -> Vec<String> {
    let tag = format!("asb-{pid}-");
    let mut left = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let p = e.path();
        if !e
            .file_name()
            .to_string_lossy()
            .chars()
            .all(|c| c.is_ascii_digit())
        {
            continue;
        }
        let cg = std::fs::read_to_string(p.join("cgroup")).unwrap_or_default();
        let cmd = std::fs::read(p.join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cg.contains(&tag) || ids.iter().any(|id| cmd.contains(id.as_str())) {
            left.push(format!("process {}: {cmd}", p.display()));
        }
    }
    let find = Command::new("find")
        .args(["/sys/fs/cgroup", "-maxdepth", "6", "-type", "d", "-name"])
        .arg(format!("{tag}*"))
        .output()
        .unwrap();
    left.extend(
        String::from_utf8_lossy(&find.stdout)
            .lines()
            .map(|l| format!("cgroup {l}")),
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for l in mounts.lines() {
        if ids.iter().any(|id| l.contains(id.as_str())) || l.contains(&tag) {
            left.push(format!("mount {l}"));
        }
    }
    for id in ids {
        let d = std::env::temp_dir().join("agent-sandbox-gvisor").join(id);
        if d.exists() {
            left.push(format!("state {}", d.display()));
        }
    }
    left
}

#[test]
fn a_server_killed_under_load_leaves_nothing_after_its_restart() {
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let mut s = serve();
    let pid = s.child.id();
    let mut tiers = vec!["container", "container", "container"];
    if served::unavailable("gvisor").is_none() {
        tiers.push("gvisor");
    } else {
        eprintln!("(gVisor is not available here: containers only)");
    }
    let mut ids = Vec::new();
    let mut gvisor_ids = Vec::new();
    for tier in &tiers {
        let body = format!(r#"{{"spec": {{"language": "shell"}}, "tier": "{tier}"}}"#);
        let (code, info) = curl(&s, "POST", "/v1/sandboxes", Some(&body));
        assert_eq!(code, 201, "{info}");
        let id = info["id"].as_str().unwrap().to_string();
        if *tier == "gvisor" {
            gvisor_ids.push(id.clone());
        }
        ids.push(id);
    }
    // Load: a client per sandbox, each running a background sleep and execs in a loop.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (base, token) = (s.base.clone(), s.token.clone());
    let clients: Vec<_> = ids
        .iter()
        .map(|id| {
            let (id, base, token, stop) = (id.clone(), base.clone(), token.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut ok = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let out = Command::new("curl")
                        .args([
                            "-s",
                            "-o",
                            "/dev/null",
                            "-w",
                            "%{http_code}",
                            "--max-time",
                            "30",
                        ])
                        .args(["-H", &format!("Authorization: Bearer {token}")])
                        .args(["-H", "Content-Type: application/json"])
                        .args([
                            "--data-binary",
                            r#"{"code": "sleep 1000 & sleep 0.1; echo ok"}"#,
                        ])
                        .arg(format!("{base}/v1/sandboxes/{id}/exec"))
                        .output()
                        .unwrap();
                    if out.stdout == b"200" {
                        ok += 1;
                    }
                }
                ok
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    // What the check below looks for is there now (processes, cgroups, gVisor state).
    let before = left_of(pid, &gvisor_ids);
    assert!(
        before.iter().any(|l| l.starts_with("process"))
            && before.iter().any(|l| l.starts_with("cgroup")),
        "{before:?}"
    );
    if !gvisor_ids.is_empty() {
        assert!(before.iter().any(|l| l.starts_with("state")), "{before:?}");
    }
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let _ = s.child.wait();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let served: i32 = clients.into_iter().map(|c| c.join().unwrap()).sum();
    assert!(served > 0, "no exec was served before the kill");

    // A new server on the same state directory sweeps what the killed one left.
    let dir = std::mem::replace(&mut s.dir, tempfile::tempdir().unwrap());
    let (s2, said) = serve_in(dir);
    let mut left = left_of(pid, &gvisor_ids);
    for _ in 0..100 {
        if left.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        left = left_of(pid, &gvisor_ids);
    }
    assert!(
        left.is_empty(),
        "left after the restart ({said}):\n{}",
        left.join("\n")
    );
    // The new server serves; it holds none of the old sandboxes.
    let (code, list) = curl(&s2, "GET", "/v1/sandboxes", None);
    assert_eq!((code, &list["sandboxes"]), (200, &serde_json::json!([])));
}

#[test]
fn serve_keep_brings_sandboxes_back_under_their_ids_after_a_restart() {
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let (mut s, _) = served::serve_with(tempfile::tempdir().unwrap(), &["--keep"], &[]);
    let (code, info) = curl(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(r#"{"spec": {"language": "shell"}, "tier": "container", "labels": {"job": "k1"}}"#),
    );
    assert_eq!(code, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    let (code, _) = curl(
        &s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"code": "echo kept-across > state.txt"}"#),
    );
    assert_eq!(code, 200);
    // SIGTERM: snapshotted and recorded, then the server exits 0.
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let status = s.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(s.dir.path().join("kept.json").exists());

    let dir = std::mem::replace(&mut s.dir, tempfile::tempdir().unwrap());
    let (two, said) = served::serve_with(dir, &["--keep"], &[]);
    assert!(said.contains("restored 1 sandboxes"), "{said}");
    let (code, back) = curl(&two, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(code, 200, "{back}");
    assert_eq!(
        (&back["labels"]["job"], &back["tier"]),
        (&"k1".into(), &"container".into())
    );
    let (code, out) = curl(
        &two,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"code": "cat state.txt"}"#),
    );
    assert_eq!(
        (code, &out["stdout"]),
        (200, &"kept-across\n".into()),
        "{out}"
    );
    // The record is used up: a third start restores nothing twice.
    assert!(!two.dir.path().join("kept.json").exists());
}

/// The load run of `benches/server.rs`, at CI's size: 40 live container sandboxes and 1,000
/// execs from 16 concurrent clients through `RemoteBackend`; every exec succeeds and nothing
/// is left on the server or the host after the sandboxes are destroyed.
#[test]
fn concurrent_clients_load_the_server_without_errors_or_leftovers() {
    use agent_sandbox::remote::{RemoteConfig, RemoteServer};
    use agent_sandbox::{Backend, ExecRequest, Language, ResolvedSecrets, SandboxSpec, Tier};
    use std::sync::Arc;
    if let Some(why) = container_available() {
        eprintln!("SKIP: the container tier is not available here: {why}");
        return;
    }
    let s = serve();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (ok, errors) = rt.block_on(async {
        let backend = RemoteServer::connect(RemoteConfig::new(&s.base).unwrap().token(&s.token))
            .await
            .unwrap()
            .backend(Tier::Container)
            .unwrap();
        let spec = SandboxSpec::new(Language::Shell);
        let mut all = Vec::new();
        for _ in 0..40 {
            let sb = backend
                .create(&spec, ResolvedSecrets::none())
                .await
                .unwrap();
            all.push(Arc::<dyn agent_sandbox::Sandbox>::from(sb));
        }
        let all = Arc::new(all);
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let (all, next) = (all.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                let (mut ok, mut errors) = (0, Vec::new());
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if i >= 1000 {
                        break;
                    }
                    match all[i % all.len()]
                        .exec(ExecRequest::argv(["/bin/true"]))
                        .await
                    {
                        Ok(r) if r.exit_code == Some(0) => ok += 1,
                        other => errors.push(format!("{other:?}")),
                    }
                }
                (ok, errors)
            }));
        }
        let (mut ok, mut errors) = (0, Vec::new());
        for t in tasks {
            let (o, e) = t.await.unwrap();
            ok += o;
            errors.extend(e);
        }
        for sb in all.iter() {
            sb.destroy().await.unwrap();
        }
        (ok, errors)
    });
    assert!(
        errors.is_empty(),
        "{} errors, the first: {}",
        errors.len(),
        errors[0]
    );
    assert_eq!(ok, 1000);
    let (_, list) = curl(&s, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sandboxes"], serde_json::json!([]));
    // (A live server keeps a few empty cgroups ready for its next creates, `asb-PID-free-N`:
    // its pool, not a sandbox's leftovers.)
    let left: Vec<String> = left_of(s.child.id(), &[])
        .into_iter()
        .filter(|l| !l.contains("-free-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn http2_without_tls_is_served_beside_http1() {
    // E2B's SDKs and gRPC-style clients speak HTTP/2 with prior knowledge to a plain-HTTP
    // server; the same listener answers both.
    let s = serve();
    for (flag, version) in [("--http1.1", "1.1"), ("--http2-prior-knowledge", "2")] {
        let out = Command::new("curl")
            .args([
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_version} %{http_code}",
                flag,
            ])
            .arg("-H")
            .arg(format!("Authorization: Bearer {}", s.token))
            .arg(format!("{}/v1/tiers", s.base))
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("{version} 200"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
