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
    // Ask for a tier that no build of this revision has yet: the error names it and the fix.
    let out = cli(&["run", "--tier", "microvm", "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("microvm") && err.contains("fix"), "{err}");
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
