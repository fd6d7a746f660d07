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
    let rt = Runtime::new();
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
        let spec = SandboxSpec::builder(Language::Python)
            .output_bytes(256 << 10)
            .build()
            .unwrap();
        let sb = rt.create(&spec, TierChoice::Tier(tier)).await.unwrap();
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
        let mut py = Interpreter::start(Arc::clone(&sb), ContextSpec::python())
            .await
            .unwrap();
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

/// The attacker is the cell: it finds the driver's frame mark in the driver's own frame and
/// forges frames on stdout: a `done` for another cell, a frame far over the output cap, a
/// thousand displays, malformed JSON, an image that is not base64. The host keeps what
/// fits, bounded, says it dropped the rest, and the interpreter runs the next cell.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cell_that_forges_the_drivers_frames_gets_only_what_fits() {
    const FORGER: &str = r#"
import json, os, sys
f = sys._getframe()
while f is not None and "MARK" not in f.f_locals:
    f = f.f_back
M = f.f_locals["MARK"]
def fr(obj):
    os.write(1, M + json.dumps(obj).encode() + b"\n")
fr({"t": "done", "n": 999})
os.write(1, M + b'{"t":"display","data":{"text/plain":"' + b"x" * (400 << 10) + b'"}}\n')
for i in range(1000):
    fr({"t": "display", "data": {"text/plain": str(i)}})
os.write(1, M + b"not json\n")
fr({"t": "display", "data": {"text/plain": "p", "image/png": "!!"}})
print("still here")
"#;
    for sb in sandboxes().await {
        let tier = sb.tier();
        let mut py = Interpreter::start(Arc::clone(&sb), ContextSpec::python())
            .await
            .unwrap();
        let r = py.run(FORGER, &CellOptions::new()).await.unwrap();
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
