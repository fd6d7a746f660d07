//! Streaming exec: chunks arrive while the guest still runs, redacted across chunk
//! boundaries, capped like `exec`'s output, with the host's notes last.
//!
//! "While the guest still runs" is shown without timing: each guest prints, then waits for
//! a signal the test gives only after it received the first chunk (a host tool for
//! JavaScript, a file in the workspace for modules and Python), then prints again. Without
//! streaming the guest would give up waiting (after 20 s) and the test would fail.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use backend_wasm::{ToolError, WasmBackend};
use sandbox_core::{
    Backend, ExecEvent, ExecRequest, ExecStream, Language, LimitKind, MapSecretSource,
    ResolvedSecrets, SandboxSpec,
};

const SECRET: &str = "sk-live-0123456789";

/// Events up to and including the first stdout chunk.
async fn until_first_stdout(s: &mut ExecStream) -> Vec<ExecEvent> {
    let mut seen = Vec::new();
    while let Some(ev) = s.next().await {
        let ev = ev.expect("stream event");
        let done = matches!(ev, ExecEvent::Stdout(_));
        assert!(
            !matches!(ev, ExecEvent::Exit(_)),
            "the call ended before any output was streamed: {seen:?} {ev:?}"
        );
        seen.push(ev);
        if done {
            return seen;
        }
    }
    panic!("stream ended without output: {seen:?}");
}

/// Collects the rest into (stdout, stderr, exit event).
async fn rest(
    mut s: ExecStream,
    mut out: Vec<u8>,
    mut err: Vec<u8>,
) -> (String, String, sandbox_core::ExecResult) {
    while let Some(ev) = s.next().await {
        match ev.expect("stream event") {
            ExecEvent::Stdout(b) => out.extend_from_slice(&b),
            ExecEvent::Stderr(b) => err.extend_from_slice(&b),
            ExecEvent::Exit(r) => {
                assert!(r.stdout.is_empty() && r.stderr.is_empty(), "{r:?}");
                return (
                    String::from_utf8_lossy(&out).into_owned(),
                    String::from_utf8_lossy(&err).into_owned(),
                    r,
                );
            }
            other => panic!("unexpected event: {other:?}"),
        }
    }
    panic!("stream ended without an exit event");
}

fn split(events: Vec<ExecEvent>) -> (Vec<u8>, Vec<u8>) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    for ev in events {
        match ev {
            ExecEvent::Stdout(b) => out.extend_from_slice(&b),
            ExecEvent::Stderr(b) => err.extend_from_slice(&b),
            ExecEvent::Exit(_) => {}
            other => panic!("unexpected event: {other:?}"),
        }
    }
    (out, err)
}

fn secret_spec(lang: Language) -> (SandboxSpec, ResolvedSecrets) {
    let spec = SandboxSpec::builder(lang)
        .secret_env("TOKEN", "API_TOKEN")
        .build()
        .unwrap();
    let secrets =
        ResolvedSecrets::resolve(&spec.secrets, &MapSecretSource::new().with("TOKEN", SECRET))
            .unwrap();
    (spec, secrets)
}

#[tokio::test]
async fn javascript_console_lines_stream_as_they_come() {
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = Arc::new(Mutex::new(go_rx));
    let b = WasmBackend::builder()
        .tool("go", &[], move |_| {
            let rx = go_rx.lock().unwrap();
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(()) => Ok(serde_json::json!(true)),
                Err(_) => Err(ToolError::new("no signal: the first line was not streamed")),
            }
        })
        .build()
        .unwrap();
    let sb = common::js(&b).await;
    assert!(b.capabilities().streaming);
    let mut s = sb
        .exec_stream(ExecRequest::code(
            "console.log('one'); console.error('warn'); go(); console.log('two'); 42",
        ))
        .await
        .unwrap();
    let first = until_first_stdout(&mut s).await;
    assert_eq!(first.last(), Some(&ExecEvent::Stdout("one\n".into())));
    go_tx.send(()).unwrap();
    let (out, err) = split(first);
    let (out, err, r) = rest(s, out, err).await;
    // The final value is echoed on stdout, as Python's is.
    assert_eq!(out, "one\ntwo\n42\n");
    assert_eq!(err, "warn\n");
    assert_eq!((r.exit_code, r.value.as_deref()), (Some(0), Some("42")));
    // The session lives on, as after `exec`.
    let r = sb
        .exec_stream(ExecRequest::code("var kept = 5; kept * 2"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(r.value.as_deref(), Some("10"));
    assert_eq!(
        common::run(sb.as_ref(), "kept").await.value.as_deref(),
        Some("5")
    );
}

#[tokio::test]
async fn javascript_stream_is_capped_and_ends_with_the_note() {
    let b = WasmBackend::builder().build().unwrap();
    let spec = SandboxSpec::builder(Language::Javascript)
        .output_bytes(100)
        .wall_time(Duration::from_millis(300))
        .build()
        .unwrap();
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let r = sb
        .exec_stream(ExecRequest::code(
            "for (let i = 0; i < 1000; i++) console.log('line ' + i); 7",
        ))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(r.stdout.len(), 100, "{r:?}");
    assert!(r.stdout.starts_with(b"line 0\nline 1\n"));
    assert!(r.truncated && r.success(), "{r:?}");
    assert_eq!(r.value.as_deref(), Some("7"));
    let r = sb
        .exec_stream(ExecRequest::code("console.log('before'); while (true) {}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime), "{r:?}");
    assert_eq!(r.stdout_str(), "before\n");
    assert!(r.stderr_str().contains("[agent-sandbox]"), "{r:?}");
}

#[tokio::test]
async fn javascript_secrets_are_redacted_in_streams_and_values() {
    let b = WasmBackend::builder().build().unwrap();
    let (spec, secrets) = secret_spec(Language::Javascript);
    let sb = b.create(&spec, secrets).await.unwrap();
    let code = format!("console.log('a={SECRET}'); console.error('{SECRET}'); '{SECRET}'");
    let r = sb
        .exec_stream(ExecRequest::code(code))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    // The echoed final value is redacted too.
    assert_eq!(r.stdout_str(), "a=[REDACTED:TOKEN]\n'[REDACTED:TOKEN]'\n");
    assert_eq!(r.stderr_str(), "[REDACTED:TOKEN]\n");
    assert_eq!(r.value.as_deref(), Some("\"[REDACTED:TOKEN]\""));
}

/// Writes `a=<first 12 bytes of the secret>`, waits for `go` in the workspace, then writes
/// the rest of the secret and a newline: the secret straddles two chunks.
fn split_secret_module() -> String {
    let (head, tail) = SECRET.split_at(12);
    format!(
        r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_open" (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "a={head}")
  (data (i32.const 128) "{tail}\n")
  (data (i32.const 192) "go")
  (func $write (param $p i32) (param $n i32)
    (i32.store (i32.const 0) (local.get $p))
    (i32.store (i32.const 4) (local.get $n))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))))
  (func (export "_start")
    (call $write (i32.const 64) (i32.const {hl}))
    ;; fd 3 is /workspace; spin until `go` exists (the wall limit ends a test that fails)
    (loop $wait
      (br_if $wait (i32.ne (i32.const 0)
        (call $path_open (i32.const 3) (i32.const 1) (i32.const 192) (i32.const 2) (i32.const 0)
          (i64.const 0x1fffffff) (i64.const 0x1fffffff) (i32.const 0) (i32.const 12)))))
    (call $write (i32.const 128) (i32.const {tl}))))"#,
        hl = head.len() + 2,
        tl = tail.len() + 1,
    )
}

#[tokio::test]
async fn module_output_streams_and_a_split_secret_is_redacted() {
    let b = WasmBackend::builder().build().unwrap();
    let (mut spec, secrets) = secret_spec(Language::Wasm);
    spec.limits.wall_time_ms = 20_000;
    let sb = b.create(&spec, secrets).await.unwrap();
    let mut s = sb
        .exec_stream(ExecRequest::code(split_secret_module()))
        .await
        .unwrap();
    // The redactor holds back the possible start of the secret: only `a=` is out so far.
    let first = until_first_stdout(&mut s).await;
    assert_eq!(first.last(), Some(&ExecEvent::Stdout("a=".into())));
    sb.write_file("go", b"").await.unwrap();
    let (out, err) = split(first);
    let (out, err, r) = rest(s, out, err).await;
    assert_eq!(out, "a=[REDACTED:TOKEN]\n", "{err} {r:?}");
    assert_eq!(r.exit_code, Some(0), "{err} {r:?}");
    // A missing module is reported on the stream too.
    let r = sb
        .exec_stream(ExecRequest::argv(["missing.wasm"]))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(127));
    assert!(r.stderr_str().contains("no such module"), "{r:?}");
}

#[tokio::test]
async fn module_stream_is_capped() {
    let b = WasmBackend::builder().build().unwrap();
    let spec = SandboxSpec::builder(Language::Wasm)
        .output_bytes(1000)
        .build()
        .unwrap();
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    // 2000 writes of 64 KiB.
    let flood = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (func (export "_start") (local $i i32)
    (i32.store (i32.const 0) (i32.const 1024))
    (i32.store (i32.const 4) (i32.const 65536))
    (loop $l
      (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 2000))))))"#;
    let r = sb
        .exec_stream(ExecRequest::code(flood))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    // 128 MiB is a flood: stopped as the output limit (as in every tier), capped.
    assert_eq!(r.stdout.len(), 1000);
    assert!(r.truncated, "{r:?}");
    assert_eq!(
        (r.exit_code, r.limit),
        (Some(137), Some(LimitKind::Output)),
        "{r:?}"
    );
}

#[tokio::test]
async fn python_writes_stream_as_flushed() {
    let b = python_or_skip!();
    let (mut spec, secrets) = secret_spec(Language::Python);
    spec.limits.wall_time_ms = 30_000;
    let sb = b.create(&spec, secrets).await.unwrap();
    let (head, tail) = SECRET.split_at(12);
    let code = format!(
        r#"import os, sys, time
print("one", flush=True)
sys.stdout.write("a={head}"); sys.stdout.flush()
t = time.monotonic()
while not os.path.exists("/workspace/go") and time.monotonic() - t < 20:
    pass
print("{tail}")
print("two")
1 / 0"#
    );
    let mut s = sb.exec_stream(ExecRequest::code(code)).await.unwrap();
    let first = until_first_stdout(&mut s).await;
    assert_eq!(first.last(), Some(&ExecEvent::Stdout("one\n".into())));
    sb.write_file("go", b"").await.unwrap();
    let (out, err) = split(first);
    let (out, err, r) = rest(s, out, err).await;
    assert_eq!(out, "one\na=[REDACTED:TOKEN]\ntwo\n", "{err}");
    assert!(err.contains("ZeroDivisionError"), "{err}");
    assert_eq!(r.exit_code, Some(1));
    // The interpreter lives on: streamed and plain calls share it.
    sb.exec_stream(ExecRequest::code("x = 41"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let r = sb
        .exec_stream(ExecRequest::code("x + 1"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(
        (r.stdout_str().as_str(), r.value.as_deref()),
        ("42\n", Some("42"))
    );
    assert_eq!(
        common::run(sb.as_ref(), "x").await.value.as_deref(),
        Some("41")
    );
}
