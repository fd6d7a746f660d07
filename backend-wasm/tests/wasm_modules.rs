//! WASI preview-1 command modules (written in WAT here) through the public API.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use backend_wasm::WasmBackend;
use sandbox_core::{
    Backend, ExecRequest, Language, LimitKind, ResolvedSecrets, Sandbox, SandboxSpec,
};

const PRELUDE: &str = r#"
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_read" (func $fd_read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $args_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "environ_sizes_get" (func $environ_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_open" (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll_oneoff (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  ;; write(fd, ptr, len)
  (func $write (param $fd i32) (param $p i32) (param $n i32)
    (i32.store (i32.const 0) (local.get $p))
    (i32.store (i32.const 4) (local.get $n))
    (drop (call $fd_write (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 8))))
  ;; open(dirfd, path_ptr, path_len) -> errno, fd at [12]
  (func $open (param $dir i32) (param $p i32) (param $n i32) (result i32)
    (call $path_open (local.get $dir) (i32.const 1) (local.get $p) (local.get $n) (i32.const 0)
      (i64.const 0x1fffffff) (i64.const 0x1fffffff) (i32.const 0) (i32.const 12)))
"#;

fn module(body: &str) -> String {
    format!("(module {PRELUDE} {body})")
}

fn hello() -> String {
    module(
        r#"(data (i32.const 64) "hello wasm\n")
       (func (export "_start") (call $write (i32.const 1) (i32.const 64) (i32.const 11)))"#,
    )
}

async fn wasm_sandbox(b: &WasmBackend, spec: SandboxSpec) -> Box<dyn Sandbox> {
    b.create(&spec, ResolvedSecrets::none())
        .await
        .expect("create")
}

#[tokio::test]
async fn hello_from_code_and_from_workspace_file() {
    let b = WasmBackend::builder().build().unwrap();
    let sb = wasm_sandbox(&b, SandboxSpec::new(Language::Wasm)).await;
    let r = common::run(sb.as_ref(), &hello()).await;
    assert_eq!(r.stdout_str(), "hello wasm\n", "{r:?}");
    assert!(r.success());
    sb.write_file("bin/hello.wasm", &common::wasm(&hello()))
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::argv(["/workspace/bin/hello.wasm"]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "hello wasm\n");
    let r = sb
        .exec(ExecRequest::argv(["bin/hello.wasm", "a", "b"]))
        .await
        .unwrap();
    assert!(r.success());
    // A missing module is exit 127, and so is any other program (as in every tier).
    let r = sb.exec(ExecRequest::argv(["nope.wasm"])).await.unwrap();
    assert_eq!(r.exit_code, Some(127));
    let r = sb.exec(ExecRequest::argv(["ls", "-l"])).await.unwrap();
    assert_eq!(r.exit_code, Some(127), "{r:?}");
    assert!(r.stderr_str().contains("command not found"), "{r:?}");
    // Any sandbox can run modules, e.g. a JavaScript one.
    let jsb = wasm_sandbox(&b, SandboxSpec::new(Language::Javascript)).await;
    jsb.write_file("hello.wasm", &common::wasm(&hello()))
        .await
        .unwrap();
    let r = jsb.exec(ExecRequest::argv(["hello.wasm"])).await.unwrap();
    assert_eq!(r.stdout_str(), "hello wasm\n");
}

#[tokio::test]
async fn exit_codes_args_env_stdin() {
    let b = WasmBackend::builder().build().unwrap();
    let spec = SandboxSpec::builder(Language::Wasm)
        .env("A", "1")
        .env("B", "2")
        .build()
        .unwrap();
    let sb = wasm_sandbox(&b, spec).await;
    let exit7 = module(r#"(func (export "_start") (call $proc_exit (i32.const 7)))"#);
    assert_eq!(common::run(sb.as_ref(), &exit7).await.exit_code, Some(7));
    let argc = module(
        r#"(func (export "_start")
        (drop (call $args_sizes_get (i32.const 100) (i32.const 104)))
        (call $proc_exit (i32.load (i32.const 100))))"#,
    );
    sb.write_file("argc.wasm", &common::wasm(&argc))
        .await
        .unwrap();
    let r = sb
        .exec(ExecRequest::argv(["argc.wasm", "x", "y"]))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(3));
    let envc = module(
        r#"(func (export "_start")
        (drop (call $environ_sizes_get (i32.const 100) (i32.const 104)))
        (call $proc_exit (i32.load (i32.const 100))))"#,
    );
    // Exactly the spec's variables (and the call's own), nothing of the host's.
    assert_eq!(common::run(sb.as_ref(), &envc).await.exit_code, Some(2));
    let r = sb
        .exec(ExecRequest::code(envc.clone()).env("C", "3"))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(3));
    let cat = module(
        r#"(func (export "_start")
        (i32.store (i32.const 200) (i32.const 1024))
        (i32.store (i32.const 204) (i32.const 1000))
        (drop (call $fd_read (i32.const 0) (i32.const 200) (i32.const 1) (i32.const 208)))
        (call $write (i32.const 1) (i32.const 1024) (i32.load (i32.const 208))))"#,
    );
    let r = sb
        .exec(ExecRequest::code(cat).stdin(b"piped".to_vec()))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "piped");
    // Once fd 1 is closed, writes to it fail like any closed descriptor.
    let closed = r#"(module
      (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "fd_close" (func $close (param i32) (result i32)))
      (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
      (memory (export "memory") 1)
      (func (export "_start")
        (drop (call $close (i32.const 1)))
        (call $exit (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#;
    assert_eq!(
        common::run(sb.as_ref(), closed).await.exit_code,
        Some(8),
        "EBADF"
    );
    // A module without _start, and garbage.
    let r = common::run(sb.as_ref(), "(module)").await;
    assert_eq!(r.exit_code, Some(126));
    let r = common::run(sb.as_ref(), "not a module").await;
    assert_eq!(r.exit_code, Some(126));
    assert!(
        r.stderr_str().contains("not a valid WebAssembly module"),
        "{}",
        r.stderr_str()
    );
    let trap = module(r#"(func (export "_start") unreachable)"#);
    let r = common::run(sb.as_ref(), &trap).await;
    assert_eq!(r.exit_code, None);
    assert!(r.stderr_str().contains("unreachable"), "{}", r.stderr_str());
}

#[tokio::test]
async fn workspace_files_relative_and_absolute() {
    let b = WasmBackend::builder().build().unwrap();
    let sb = wasm_sandbox(&b, SandboxSpec::new(Language::Wasm)).await;
    sb.write_file("sub/data.txt", b"file data").await.unwrap();
    // fd 3 is /workspace, fd 4 is the working directory ".".
    let cat = |dir: i32, path: &str| {
        module(&format!(
            r#"(data (i32.const 64) "{path}")
            (func (export "_start") (local $e i32)
              (local.set $e (call $open (i32.const {dir}) (i32.const 64) (i32.const {len})))
              (if (local.get $e) (then (call $proc_exit (local.get $e))))
              (i32.store (i32.const 200) (i32.const 1024))
              (i32.store (i32.const 204) (i32.const 1000))
              (drop (call $fd_read (i32.load (i32.const 12)) (i32.const 200) (i32.const 1) (i32.const 208)))
              (call $write (i32.const 1) (i32.const 1024) (i32.load (i32.const 208))))"#,
            len = path.len()
        ))
    };
    let r = common::run(sb.as_ref(), &cat(3, "sub/data.txt")).await;
    assert_eq!(r.stdout_str(), "file data", "{r:?}");
    let r = sb
        .exec(ExecRequest::code(cat(4, "data.txt")).cwd("/workspace/sub"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "file data", "{r:?}");
}

#[tokio::test]
async fn limits_wall_fuel_memory_output_files() {
    let b = WasmBackend::builder().build().unwrap();
    let spec = SandboxSpec::builder(Language::Wasm)
        .wall_time(Duration::from_millis(300))
        .output_bytes(1000)
        .build()
        .unwrap();
    let sb = wasm_sandbox(&b, spec.clone()).await;
    let spin = module(r#"(func (export "_start") (loop $l (br $l)))"#);
    let r = common::run(sb.as_ref(), &spin).await;
    assert_eq!(r.limit, Some(LimitKind::WallTime), "{r:?}");
    // Stopped by the host: 137, as a killed process in every tier.
    assert_eq!(r.exit_code, Some(137));
    // A long sleep is cut at the deadline too (poll_oneoff is the host's).
    let sleep = module(
        r#"(func (export "_start")
        (i64.store (i32.const 100) (i64.const 1))     ;; userdata
        (i32.store8 (i32.const 108) (i32.const 0))    ;; clock
        (i32.store (i32.const 116) (i32.const 1))     ;; monotonic
        (i64.store (i32.const 124) (i64.const 100000000000)) ;; 100 s
        (i64.store (i32.const 132) (i64.const 0))
        (i32.store16 (i32.const 140) (i32.const 0))
        (drop (call $poll_oneoff (i32.const 100) (i32.const 200) (i32.const 1) (i32.const 240))))"#,
    );
    let r = common::run(sb.as_ref(), &sleep).await;
    assert_eq!(r.limit, Some(LimitKind::WallTime), "{r:?}");
    let nap = sleep.replace("100000000000", "1000000");
    assert!(common::run(sb.as_ref(), &nap).await.success());
    // Output: capped while written, flagged truncated (100 writes of 64 KiB)...
    let many = module(
        r#"(func (export "_start") (local $i i32)
        (loop $l
          (call $write (i32.const 1) (i32.const 1024) (i32.const 65536))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $l (i32.lt_u (local.get $i) (i32.const 100)))))"#,
    );
    let r = common::run(sb.as_ref(), &many).await;
    assert!(
        r.truncated && r.stdout.len() == 1000 && r.success(),
        "{:?}",
        (r.truncated, r.stdout.len(), r.exit_code)
    );
    // ... and a flood (2000 of them, past `flood_threshold`) is stopped: the output limit.
    let r = common::run(
        sb.as_ref(),
        &many.replace("(i32.const 100)", "(i32.const 2000)"),
    )
    .await;
    assert_eq!(
        (r.exit_code, r.limit, r.stdout.len()),
        (Some(137), Some(LimitKind::Output), 1000),
        "{r:?}"
    );
    // Memory: growth past the cap is refused.
    let grow = module(
        r#"(func (export "_start")
        (loop $l (br_if $l (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))
        (call $proc_exit (i32.const 99)))"#,
    );
    let r = common::run(sb.as_ref(), &grow).await;
    assert_eq!(
        (r.exit_code, r.limit),
        (Some(99), Some(LimitKind::Memory)),
        "{r:?}"
    );
    // Open files: EMFILE (33) past limits.open_files.
    sb.write_file("f", b"x").await.unwrap();
    let files = module(
        r#"(data (i32.const 64) "f")
        (func (export "_start") (local $e i32)
          (loop $l
            (local.set $e (call $open (i32.const 3) (i32.const 64) (i32.const 1)))
            (br_if $l (i32.eqz (local.get $e))))
          (call $proc_exit (local.get $e)))"#,
    );
    let r = common::run(sb.as_ref(), &files).await;
    assert_eq!(
        (r.exit_code, r.limit),
        (Some(33), Some(LimitKind::OpenFiles)),
        "{r:?}"
    );
    // Fuel.
    let mut fueled = spec.clone();
    fueled.limits.fuel = Some(1_000_000);
    fueled.limits.wall_time_ms = 30_000;
    let fb = wasm_sandbox(&b, fueled).await;
    let r = common::run(fb.as_ref(), &spin).await;
    assert_eq!(r.limit, Some(LimitKind::Fuel), "{r:?}");
    assert!(common::run(fb.as_ref(), &hello()).await.success());
    // CPU time, when it is the tighter limit.
    let mut cpu = spec.clone();
    cpu.limits.cpu_time_ms = 200;
    cpu.limits.wall_time_ms = 20_000;
    let cb = wasm_sandbox(&b, cpu).await;
    let r = common::run(cb.as_ref(), &spin).await;
    assert_eq!(r.limit, Some(LimitKind::CpuTime), "{r:?}");
    // Healthy afterwards.
    assert_eq!(
        common::run(sb.as_ref(), &hello()).await.stdout_str(),
        "hello wasm\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_slots_are_clean_and_overflow_to_the_plain_engine() {
    let b = WasmBackend::builder().build().unwrap();
    let spec = SandboxSpec::builder(Language::Wasm)
        .wall_time(Duration::from_millis(400))
        .build()
        .unwrap();
    // A reused slot starts from zero: each run reads a cell the previous run wrote.
    let dirty = module(
        r#"(data (i32.const 64) "clean\n") (data (i32.const 80) "dirty\n")
        (func (export "_start")
          (if (i32.load (i32.const 4096))
            (then (call $write (i32.const 1) (i32.const 80) (i32.const 6)))
            (else (call $write (i32.const 1) (i32.const 64) (i32.const 6))))
          (i32.store (i32.const 4096) (i32.const 1)))"#,
    );
    let sb = wasm_sandbox(&b, spec.clone()).await;
    for _ in 0..20 {
        let r = common::run(sb.as_ref(), &dirty).await;
        assert_eq!(r.stdout_str(), "clean\n", "{r:?}");
    }
    // A module the pool's slots cannot hold (two memories) runs on the plain engine.
    let two = r#"(module
      (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
      (memory (export "memory") 1) (memory $second 1)
      (data (i32.const 16) "two memories\n")
      (func (export "_start")
        (i32.store (i32.const 0) (i32.const 16)) (i32.store (i32.const 4) (i32.const 13))
        (i32.store $second (i32.const 0) (i32.const 7))
        (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#;
    let r = common::run(sb.as_ref(), two).await;
    assert_eq!(r.stdout_str(), "two memories\n", "{r:?}");
    // More concurrent runs than pool slots (128): the extra ones take the plain engine,
    // and every run ends the same way (its wall deadline).
    let spin = module(r#"(func (export "_start") (loop $l (br $l)))"#);
    let runs = (0..140).map(|_| {
        let (b, spec, spin) = (b.clone(), spec.clone(), spin.clone());
        tokio::spawn(async move {
            let sb = wasm_sandbox(&b, spec).await;
            common::run(sb.as_ref(), &spin).await
        })
    });
    for r in futures_join(runs).await {
        assert_eq!(r.limit, Some(LimitKind::WallTime), "{r:?}");
    }
    // Afterwards the pool serves again.
    let r = common::run(sb.as_ref(), &hello()).await;
    assert_eq!(r.stdout_str(), "hello wasm\n");
}

async fn futures_join(
    handles: impl Iterator<Item = tokio::task::JoinHandle<sandbox_core::ExecResult>>,
) -> Vec<sandbox_core::ExecResult> {
    let mut out = Vec::new();
    for h in handles.collect::<Vec<_>>() {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test]
async fn components_are_refused_as_unsupported_by_name() {
    let b = WasmBackend::builder().build().unwrap();
    let sb = wasm_sandbox(&b, SandboxSpec::new(Language::Wasm)).await;
    let err = sb
        .exec(ExecRequest::code("(component)"))
        .await
        .expect_err("a component is not a preview-1 command");
    match err {
        sandbox_core::Error::Unsupported { what, .. } => {
            assert!(what.contains("components"), "{what}")
        }
        other => panic!("{other:?}"),
    }
    // The sandbox is unharmed.
    let r = common::run(sb.as_ref(), &hello()).await;
    assert_eq!(r.stdout_str(), "hello wasm\n");
}

#[tokio::test]
async fn a_module_filling_the_workspace_gets_enospc() {
    let b = WasmBackend::builder().build().unwrap();
    let mut spec = SandboxSpec::new(Language::Wasm);
    spec.limits.disk_bytes = 1 << 20;
    let sb = wasm_sandbox(&b, spec).await;
    // Creates /workspace/big, writes 64 KiB chunks until a write fails, exits with its errno.
    let fill = module(
        r#"(data (i32.const 64) "big")
       (func (export "_start") (local $e i32)
         (local.set $e (call $path_open (i32.const 3) (i32.const 1) (i32.const 64) (i32.const 3)
           (i32.const 1) (i64.const 0x1fffffff) (i64.const 0x1fffffff) (i32.const 0) (i32.const 12)))
         (if (local.get $e) (then (call $proc_exit (i32.const 200))))
         (i32.store (i32.const 0) (i32.const 1024))
         (i32.store (i32.const 4) (i32.const 65536))
         (loop $l
           (local.set $e (call $fd_write (i32.load (i32.const 12)) (i32.const 0) (i32.const 1) (i32.const 8)))
           (br_if $l (i32.eqz (local.get $e))))
         (call $proc_exit (local.get $e)))"#,
    );
    let r = common::run(sb.as_ref(), &fill).await;
    assert_eq!(r.exit_code, Some(51), "WASI's ENOSPC: {r:?}");
    assert_eq!(r.limit, Some(LimitKind::Disk), "{r:?}");
    let size = sb.read_file("big").await.unwrap().len();
    assert!((512 << 10..=1 << 20).contains(&size), "{size}");
    let r = common::run(sb.as_ref(), &hello()).await;
    assert_eq!(r.stdout_str(), "hello wasm\n", "{r:?}");
}
