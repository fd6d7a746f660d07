//! Interpreter contexts (`sandbox_core::interpreter`) on every tier with background
//! processes this host runs: state kept across cells, the last expression's value and
//! `display`ed bundles, structured errors, per-cell environment, stdin kept from the cells,
//! an interrupt at the timeout, an interpreter that exits or ignores the interrupt, and a
//! cell that finds the driver's frame mark and forges frames. A tier the probe reports
//! unavailable is skipped with its reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use agent_sandbox::core::interpreter::{CellEvent, CellOptions, ContextSpec, Interpreter};
use agent_sandbox::{
    Language, LimitKind, OutputKind, Runtime, Sandbox, SandboxSpec, Tier, TierChoice,
};

/// Python sandboxes on each available tier that runs background processes.
async fn sandboxes() -> Vec<Arc<dyn Sandbox>> {
    let spec = SandboxSpec::builder(Language::Python)
        .output_bytes(256 << 10)
        .build()
        .unwrap();
    sandboxes_of(&Runtime::new(), &spec).await
}

/// Sandboxes of `spec` from `rt` on each available tier that runs background processes.
async fn sandboxes_of(rt: &Runtime, spec: &SandboxSpec) -> Vec<Arc<dyn Sandbox>> {
    let mut out = Vec::new();
    for status in rt.probe().await {
        let tier = status.tier;
        if matches!(tier, Tier::Wasm) {
            continue;
        }
        if !status.available {
            eprintln!("SKIP {tier}: {}", status.reason);
            continue;
        }
        let caps = rt.backend(tier).unwrap().capabilities();
        if !caps.processes {
            eprintln!("SKIP {tier}: no background processes");
            continue;
        }
        let sb = rt.create(spec, TierChoice::Tier(tier)).await.unwrap();
        let sb: Arc<dyn Sandbox> = Arc::from(sb);
        // The host's own python3 is what these sandboxes run.
        let probe = sb
            .exec(agent_sandbox::ExecRequest::argv(["python3", "-c", "pass"]))
            .await;
        if !probe.as_ref().is_ok_and(|r| r.success()) {
            eprintln!("SKIP {tier}: no python3 in its sandboxes: {probe:?}");
            let _ = sb.destroy().await;
            continue;
        }
        out.push(sb);
    }
    out
}

/// A Python context in `sb`, started.
async fn python(sb: &Arc<dyn Sandbox>) -> Interpreter {
    Interpreter::start(Arc::clone(sb), ContextSpec::python())
        .await
        .unwrap()
}

fn text(r: &agent_sandbox::ExecResult) -> Vec<(OutputKind, String)> {
    r.outputs
        .iter()
        .map(|o| (o.kind, o.text().unwrap_or_default().to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cells_keep_state_and_report_values_displays_and_errors() {
    for sb in sandboxes().await {
        let tier = sb.tier();
        let mut py = Interpreter::start(Arc::clone(&sb), ContextSpec::python().cwd("/tmp"))
            .await
            .unwrap();
        let opts = CellOptions::new();
        let r = py.run("x = 20\nprint('hi')", &opts).await.unwrap();
        assert!(r.success(), "{tier}: {r:?}");
        assert_eq!(r.stdout_str(), "hi\n", "{tier}");
        assert!(r.outputs.is_empty(), "{tier}: {r:?}");

        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let code = "class T:\n    def _repr_html_(self): return '<b>t</b>'\n\
                    display(T())\nimport os\nprint(os.getcwd())\nx * 2 + 2";
        let collect = tokio::spawn(async move {
            let mut events = Vec::new();
            while let Some(e) = rx.recv().await {
                events.push(e);
            }
            events
        });
        let r = py.run_streaming(code, &opts, Some(&tx)).await.unwrap();
        drop(tx);
        let events = collect.await.unwrap();
        assert!(r.success(), "{tier}: {r:?}");
        assert_eq!(r.stdout_str(), "/tmp\n", "{tier}");
        assert_eq!(r.outputs.len(), 2, "{tier}: {r:?}");
        assert_eq!(r.outputs[0].kind, OutputKind::DisplayData);
        assert_eq!(r.outputs[0].get("text/html"), Some("<b>t</b>"), "{tier}");
        assert_eq!(r.outputs[1].kind, OutputKind::ExecuteResult);
        assert_eq!(r.outputs[1].text(), Some("42"), "{tier}");
        assert_eq!(r.value.as_deref(), Some("42"), "{tier}");
        assert_eq!(py.execution_count(), 2);
        // The same, as it happened (stdout chunks joined).
        let mut seen: Vec<CellEvent> = Vec::new();
        for e in events {
            match (seen.last_mut(), e) {
                (Some(CellEvent::Stdout(a)), CellEvent::Stdout(b)) => {
                    *a = [a.as_ref(), b.as_ref()].concat().into();
                }
                (_, e) => seen.push(e),
            }
        }
        assert!(
            matches!(&seen[..], [CellEvent::Output(a), CellEvent::Stdout(s), CellEvent::Output(b)]
                if a.kind == OutputKind::DisplayData && &s[..] == b"/tmp\n" && b.text() == Some("42")),
            "{tier}: {seen:?}"
        );

        // An exception: structured, on stderr too, and the state survives it.
        let r = py.run("y = 1\n1 / 0", &opts).await.unwrap();
        assert_eq!(r.exit_code, Some(1), "{tier}: {r:?}");
        let e = r.error.as_ref().expect("an error");
        assert_eq!(
            (e.name.as_str(), e.value.as_str()),
            ("ZeroDivisionError", "division by zero")
        );
        assert!(
            e.traceback.iter().any(|l| l.contains("<cell-3>")),
            "{tier}: {e:?}"
        );
        assert!(
            !e.traceback.iter().any(|l| l.contains("agent_sandbox")),
            "{tier}: {e:?}"
        );
        assert!(r.stderr_str().contains("ZeroDivisionError"), "{tier}");
        let r = py.run("x + y", &opts).await.unwrap();
        assert_eq!(
            text(&r),
            [(OutputKind::ExecuteResult, "21".to_string())],
            "{tier}"
        );

        // The environment of one cell is that cell's only.
        let r = py
            .run(
                "import os; os.environ.get('ONLY_NOW')",
                &CellOptions::new().env("ONLY_NOW", "yes"),
            )
            .await
            .unwrap();
        assert_eq!(r.value.as_deref(), Some("\"yes\""), "{tier}: {r:?}");
        let r = py.run("os.environ.get('ONLY_NOW')", &opts).await.unwrap();
        assert!(r.outputs.is_empty(), "{tier}: {r:?}");

        // Cells never read the driver's requests: their stdin is empty.
        let r = py.run("input()", &opts).await.unwrap();
        assert_eq!(
            r.error.as_ref().map(|e| e.name.as_str()),
            Some("EOFError"),
            "{tier}"
        );
        let r = py.run("import sys; sys.stdin.read()", &opts).await.unwrap();
        assert_eq!(
            text(&r),
            [(OutputKind::ExecuteResult, "''".to_string())],
            "{tier}"
        );

        // A restart forgets everything.
        py.restart().await.unwrap();
        let r = py.run("x", &opts).await.unwrap();
        assert_eq!(
            r.error.as_ref().map(|e| e.name.as_str()),
            Some("NameError"),
            "{tier}"
        );
        assert_eq!(py.execution_count(), 1);
        py.close().await;
        sb.destroy().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cell_is_interrupted_at_its_timeout_and_a_dead_interpreter_restarts() {
    for sb in sandboxes().await {
        let tier = sb.tier();
        let mut py = python(&sb).await;
        let opts = CellOptions::new();
        py.run("kept = 7", &opts).await.unwrap();
        let r = py
            .run(
                "import time\ntime.sleep(120)",
                &CellOptions::new().timeout(Duration::from_secs(1)),
            )
            .await
            .unwrap();
        assert_eq!(r.limit, Some(LimitKind::WallTime), "{tier}: {r:?}");
        assert_eq!(
            r.error.as_ref().map(|e| e.name.as_str()),
            Some("KeyboardInterrupt"),
            "{tier}"
        );
        let r = py.run("kept", &opts).await.unwrap();
        assert_eq!(
            r.value.as_deref(),
            Some("7"),
            "{tier}: the interrupt kept the state"
        );

        // A caller that goes away (a client's stream closed) interrupts the same way.
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let leave = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(rx);
        });
        let r = py
            .run_streaming("import time\ntime.sleep(120)", &opts, Some(&tx))
            .await
            .unwrap();
        leave.await.unwrap();
        assert_eq!(
            r.error.as_ref().map(|e| e.name.as_str()),
            Some("KeyboardInterrupt"),
            "{tier}"
        );
        assert_eq!(r.limit, None, "{tier}");

        // A cell that ignores the interrupt loses its interpreter.
        let r = py
            .run(
                "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(120)",
                &CellOptions::new().timeout(Duration::from_millis(500)),
            )
            .await
            .unwrap();
        assert_eq!(
            r.error.as_ref().map(|e| e.name.as_str()),
            Some("InterpreterKilled"),
            "{tier}: {r:?}"
        );
        let r = py.run("kept", &opts).await.unwrap();
        assert_eq!(
            r.error.as_ref().map(|e| e.name.as_str()),
            Some("NameError"),
            "{tier}: fresh"
        );

        // So does one that exits.
        let r = py.run("import os\nos._exit(3)", &opts).await.unwrap();
        assert_eq!(r.exit_code, Some(3), "{tier}: {r:?}");
        assert_eq!(
            r.error.as_ref().map(|e| e.name.as_str()),
            Some("InterpreterExited"),
            "{tier}"
        );
        let r = py.run("1 + 1", &opts).await.unwrap();
        assert_eq!(r.value.as_deref(), Some("2"), "{tier}: {r:?}");
        py.close().await;
        sb.destroy().await.unwrap();
    }
}

/// What a hostile cell does first: finds the driver's frame mark (`M`) and the cell's count
/// (`n`) in the driver's own frame, beneath the cell's.
const FIND_MARK: &str = r#"
import json, os, sys
f = sys._getframe()
while f is not None and "MARK" not in f.f_locals:
    f = f.f_back
M, n = f.f_locals["MARK"], f.f_locals["count"]
"#;

/// The attacker is the cell: it finds the driver's frame mark in the driver's own frame and
/// forges frames on stdout: a `done` for another cell, a frame far over the output cap, a
/// thousand displays, malformed JSON, an image that is not base64. The host keeps what
/// fits, bounded, says it dropped the rest, and the interpreter runs the next cell.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cell_that_forges_the_drivers_frames_gets_only_what_fits() {
    let forger = format!(
        "{FIND_MARK}{}",
        r#"
def fr(obj):
    os.write(1, M + json.dumps(obj).encode() + b"\n")
fr({"t": "done", "n": 999})
os.write(1, M + b'{"t":"display","data":{"text/plain":"' + b"x" * (400 << 10) + b'"}}\n')
for i in range(1000):
    fr({"t": "display", "data": {"text/plain": str(i)}})
os.write(1, M + b"not json\n")
fr({"t": "display", "data": {"text/plain": "p", "image/png": "!!"}})
print("still here")
"#
    );
    for sb in sandboxes().await {
        let tier = sb.tier();
        let mut py = python(&sb).await;
        let r = py.run(&forger, &CellOptions::new()).await.unwrap();
        assert_eq!(r.exit_code, Some(0), "{tier}: {:?}", r.stderr_str());
        assert!(
            r.stdout_str().ends_with("still here\n"),
            "{tier}: {:?}",
            r.stdout_str()
        );
        assert!(
            !r.stdout_str().contains("xxxx"),
            "{tier}: the big frame is not text either"
        );
        assert!(r.truncated, "{tier}");
        assert_eq!(
            r.outputs.len(),
            agent_sandbox::core::cell::MAX_OUTPUTS,
            "{tier}"
        );
        assert!(
            r.outputs
                .iter()
                .all(|o| o.text().is_some_and(|t| t.len() < 5)),
            "{tier}"
        );
        let r = py.run("6 * 7", &CellOptions::new()).await.unwrap();
        assert_eq!(r.value.as_deref(), Some("42"), "{tier}: {r:?}");
        assert!(!r.truncated, "{tier}");
        py.close().await;
        sb.destroy().await.unwrap();
    }
}

/// A secret the sandbox holds (as an environment variable) is hidden in what its cells
/// return, as in their output: in values, displayed bundles and errors, even where JSON
/// escapes the secret's quotes and non-ASCII characters on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cells_values_and_errors_hide_the_sandboxes_secrets() {
    const SECRET: &str = "p\u{e4}ss\"w0rd-123";
    let rt = Runtime::builder()
        .with_default_tiers()
        .secret_source(Arc::new(
            agent_sandbox::MapSecretSource::new().with("TOKEN", SECRET),
        ))
        .build();
    let spec = SandboxSpec::builder(Language::Python)
        .secret_env("TOKEN", "T")
        .build()
        .unwrap();
    for sb in sandboxes_of(&rt, &spec).await {
        let tier = sb.tier();
        let mut py = python(&sb).await;
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let code = "import os\nt = os.environ['T']\nprint(t)\ndisplay({'k': [t]})\nt";
        let r = py
            .run_streaming(code, &CellOptions::new(), Some(&tx))
            .await
            .unwrap();
        drop(tx);
        let mut streamed = String::new();
        while let Some(e) = rx.recv().await {
            streamed.push_str(&format!("{e:?}"));
        }
        let all = format!("{r:?} {streamed}");
        assert!(!all.contains("w0rd"), "{tier}: {all}");
        assert_eq!(
            r.value.as_deref(),
            Some("\"[REDACTED:TOKEN]\""),
            "{tier}: {r:?}"
        );
        assert_eq!(r.outputs[1].text(), Some("'[REDACTED:TOKEN]'"), "{tier}");
        let r = py
            .run("raise ValueError(t)", &CellOptions::new())
            .await
            .unwrap();
        let e = r.error.as_ref().unwrap();
        assert_eq!(e.value, "[REDACTED:TOKEN]", "{tier}: {e:?}");
        assert!(!format!("{r:?}").contains("w0rd"), "{tier}: {r:?}");
        py.close().await;
        sb.destroy().await.unwrap();
    }
}

/// An interpreter dropped without `close` (its owner gone, a start cancelled) does not
/// leave its `python3` behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_interpreter_leaves_no_process() {
    for sb in sandboxes().await {
        let tier = sb.tier();
        let py = python(&sb).await;
        drop(py);
        // A start cut short.
        let cut = tokio::time::timeout(
            Duration::from_millis(30),
            Interpreter::start(Arc::clone(&sb), ContextSpec::python()),
        )
        .await;
        drop(cut);
        let mut left = Vec::new();
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            left = sb
                .processes()
                .await
                .unwrap()
                .into_iter()
                .filter(|p| p.state == agent_sandbox::ProcessState::Running)
                .collect();
            if left.is_empty() {
                break;
            }
        }
        assert!(left.is_empty(), "{tier}: still running: {left:?}");
        sb.destroy().await.unwrap();
    }
}

/// A cell that forges its own `done` and goes on, leaving the driver deaf to requests, can
/// not hold the context: the next cell's request (larger than a pipe holds) gives up at its
/// timeout, the interpreter is killed, and the one after runs in a fresh interpreter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cell_that_stops_the_driver_reading_does_not_wedge_the_context() {
    let deaf = format!(
        "{FIND_MARK}{}",
        r#"
import time
for fd in (2, 1):
    os.write(fd, M + json.dumps({"t": "done", "n": n}).encode() + b"\n")
time.sleep(3600)
"#
    );
    for sb in sandboxes().await {
        let tier = sb.tier();
        let mut py = python(&sb).await;
        let r = py.run(&deaf, &CellOptions::new()).await.unwrap();
        assert_eq!(
            r.exit_code,
            Some(0),
            "{tier}: the forged done ended it: {r:?}"
        );
        let big = format!("x = '{}'\nlen(x)", "a".repeat(256 << 10));
        let r = py
            .run(&big, &CellOptions::new().timeout(Duration::from_secs(2)))
            .await
            .unwrap();
        assert_eq!(
            r.error.as_ref().map(|e| e.name.as_str()),
            Some("InterpreterKilled"),
            "{tier}: {r:?}"
        );
        let r = py.run("1 + 2", &CellOptions::new()).await.unwrap();
        assert_eq!(r.value.as_deref(), Some("3"), "{tier}: {r:?}");
        py.close().await;
        sb.destroy().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bash_cells_keep_the_shell_and_report_status_and_environment() {
    for sb in sandboxes().await {
        let tier = sb.tier();
        let mut sh = Interpreter::start(
            Arc::clone(&sb),
            ContextSpec::bash().cwd("/tmp").env("CTX", "ctx"),
        )
        .await
        .unwrap();
        assert!(
            sh.version().is_some_and(|v| v.starts_with('5')),
            "{tier}: {:?}",
            sh.version()
        );
        let none = CellOptions::new();
        // Variables, functions and the working directory carry over; the cells' stdin is
        // not the driver's requests.
        let r = sh
            .run(
                "x=41; f() { echo $(( $1 + 1 )); }; mkdir -p d && cd d",
                &none,
            )
            .await
            .unwrap();
        assert_eq!(
            (r.exit_code, r.error.as_ref()),
            (Some(0), None),
            "{tier}: {r:?}"
        );
        let r = sh
            .run("f $x; pwd; echo $CTX; cat; echo read=$?", &none)
            .await
            .unwrap();
        assert_eq!(r.stdout_str(), "42\n/tmp/d\nctx\nread=0\n", "{tier}: {r:?}");
        // A failing last command: its status, and an `ExitStatus` error.
        let r = sh
            .run("echo out; echo err >&2; (exit 3)", &none)
            .await
            .unwrap();
        assert_eq!(r.exit_code, Some(3), "{tier}: {r:?}");
        assert_eq!(
            (r.stdout_str(), r.stderr_str()),
            ("out\n".into(), "err\n".into())
        );
        let e = r.error.unwrap();
        assert_eq!((e.name.as_str(), e.value.as_str()), ("ExitStatus", "3"));
        // Per-cell environment, set for the cell and put back after it, whatever its
        // value holds; names that are not shell names are refused, not run.
        let odd = "it's $HOME `id` \"q\" é\nline";
        let r = sh
            .run(
                "printf '%s|%s|' \"$NEW\" \"$CTX\"",
                &CellOptions::new().env("NEW", odd).env("CTX", "cell"),
            )
            .await
            .unwrap();
        assert_eq!(r.stdout_str(), format!("{odd}|cell|"), "{tier}");
        let r = sh.run("echo ${NEW-unset} $CTX", &none).await.unwrap();
        assert_eq!(r.stdout_str(), "unset ctx\n", "{tier}");
        let bad = CellOptions::new().env("A;touch /tmp/pwned", "1");
        assert!(sh.run("true", &bad).await.is_err(), "{tier}");
        assert!(sh.run("echo \0", &none).await.is_err(), "{tier}");
        // A cell's `break` and `continue`, or one that redirects or closes its streams or
        // the driver's request descriptor number, still ends, in the same shell.
        for cell in [
            "echo a; break",
            "echo a; continue",
            "exec 3>/dev/null 2>&-; echo a",
        ] {
            let r = sh.run(cell, &none).await.unwrap();
            assert_eq!(
                (r.stdout_str(), r.exit_code),
                ("a\n".into(), Some(0)),
                "{tier}: {cell}"
            );
        }
        let r = sh.run("f $x", &none).await.unwrap();
        assert_eq!(r.stdout_str(), "42\n", "{tier}: the same shell");
        // Bytes as written: a multi-byte cell is read by its length in bytes.
        let r = sh.run("echo 'é€ ✓'", &none).await.unwrap();
        assert_eq!(r.stdout_str(), "é€ ✓\n", "{tier}");
        // `exit` ends the shell: said, and the next cell starts a fresh one.
        let r = sh.run("exit 7", &none).await.unwrap();
        assert_eq!(r.error.unwrap().name, "InterpreterExited", "{tier}");
        let r = sh.run("echo ${x-gone}", &none).await.unwrap();
        assert_eq!(r.stdout_str(), "gone\n", "{tier}: {r:?}");
        // A cell that sends its stdout away for good still ends (the frames do not go there).
        let r = sh
            .run("exec >/dev/null; echo gone; false", &none)
            .await
            .unwrap();
        assert_eq!(
            (r.stdout_str(), r.exit_code),
            (String::new(), Some(1)),
            "{tier}: {r:?}"
        );
        // A cell that never ends is stopped at its timeout; the next cell gets a shell.
        let r = sh
            .run(
                "sleep 600",
                &CellOptions::new().timeout(Duration::from_millis(500)),
            )
            .await
            .unwrap();
        assert_eq!(r.limit, Some(LimitKind::WallTime), "{tier}: {r:?}");
        let r = sh.run("echo again", &none).await.unwrap();
        assert_eq!(r.stdout_str(), "again\n", "{tier}: {r:?}");
        sh.close().await;
        sb.destroy().await.unwrap();
    }
}
