//! Hostile input: each ends with a clear result, the host is unharmed, and the next call on
//! the same sandbox is healthy.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "../../sandbox-core/test-support/host_canary.rs"]
mod host_canary;

use std::time::Duration;

use backend_wasm::WasmBackend;
use sandbox_core::{
    Backend, ExecResult, Language, LimitKind, ResolvedSecrets, Sandbox, SandboxSpec,
};

async fn healthy_py(sb: &dyn Sandbox) {
    let r = common::run(sb, "print(2 + 2)").await;
    assert_eq!(
        r.stdout_str(),
        "4\n",
        "sandbox unhealthy after the attack: {r:?}"
    );
}

async fn attack_py(sb: &dyn Sandbox, code: &str) -> ExecResult {
    let r = common::run(sb, code).await;
    eprintln!("--- {code}\n{r:?}\nstderr: {}", r.stderr_str());
    healthy_py(sb).await;
    r
}

fn py_spec() -> SandboxSpec {
    SandboxSpec::builder(Language::Python)
        .wall_time(Duration::from_secs(3))
        .build()
        .unwrap()
}

#[tokio::test]
async fn python_bad_input() {
    let b = python_or_skip!();
    let sb = b.create(&py_spec(), ResolvedSecrets::none()).await.unwrap();
    let sb = sb.as_ref();

    let r = attack_py(sb, "def broken(:").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(r.stderr_str().contains("SyntaxError"));

    let r = attack_py(sb, "raise RuntimeError('boom')").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(r.stderr_str().contains("RuntimeError: boom"));

    let r = attack_py(sb, "while True: pass").await;
    assert_eq!(
        (r.exit_code, r.limit),
        (Some(137), Some(LimitKind::WallTime))
    );

    let r = attack_py(sb, "bytearray(10**10)").await;
    assert_eq!(
        r.exit_code,
        Some(1),
        "refused inside the guest (wasm32 cannot even address it)"
    );
    assert!(r.stderr_str().contains("MemoryError") || r.stderr_str().contains("OverflowError"));

    // Filling 512 MiB takes a while on a loaded machine: give this one a generous wall
    // limit so that the memory limit is the one that stops it.
    let roomy = SandboxSpec::builder(Language::Python)
        .wall_time(Duration::from_secs(60))
        .build()
        .unwrap();
    let big = b.create(&roomy, ResolvedSecrets::none()).await.unwrap();
    let r = attack_py(big.as_ref(), "x = [bytearray(2**20) for _ in range(10**6)]").await;
    assert_eq!(r.limit, Some(LimitKind::Memory), "{r:?}");

    let r = attack_py(sb, "print('x' * 10**9)").await;
    assert!(r.limit == Some(LimitKind::Memory) || r.truncated, "{r:?}");
    assert!(r.stdout.len() as u64 <= py_spec().limits.output_bytes);

    let r = attack_py(sb, "print('x' * 10**8)").await;
    assert!(
        r.truncated && r.stdout.len() as u64 == py_spec().limits.output_bytes,
        "capped while written"
    );

    let r = attack_py(sb, "print(open('/etc/passwd').read())").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(!r.stdout_str().contains("root:"));

    let r = attack_py(sb, "open('/workspace/../x', 'w').write('escape')").await;
    assert_eq!(r.exit_code, Some(1));

    let r = attack_py(sb, "import os; os.listdir('/workspace/../..')").await;
    assert!(
        r.exit_code == Some(1) || !r.stdout_str().contains("etc"),
        "{r:?}"
    );

    let r = attack_py(
        sb,
        "import socket; s = socket.socket(); s.connect(('127.0.0.1', 9))",
    )
    .await;
    assert_eq!(r.exit_code, Some(1), "no sockets");

    let r = attack_py(sb, "import subprocess; subprocess.run(['ls'])").await;
    assert_eq!(r.exit_code, Some(1), "no processes");

    let r = attack_py(sb, "import os; os.system('ls')").await;
    assert_ne!(r.value.as_deref(), Some("0"), "no processes");

    let r = attack_py(
        sb,
        "import sys; sys.setrecursionlimit(10**6)\ndef f(n): return f(n + 1)\nf(0)",
    )
    .await;
    // An exception (1), a crash of the interpreter (no exit code) or, on a slow host, the
    // wall limit (137, as a killed process).
    assert!(
        r.exit_code.is_none()
            || r.exit_code == Some(1)
            || (r.exit_code == Some(137) && r.limit.is_some()),
        "{r:?}"
    );

    let r = attack_py(
        sb,
        "import os; os.environ.get('HOME'), os.environ.get('PATH')",
    )
    .await;
    assert!(!r.stdout_str().contains("/root"), "no host env");

    let r = attack_py(sb, "[open(f'/tmp/f{i}', 'w') for i in range(10000)]").await;
    assert_eq!(r.limit, Some(LimitKind::OpenFiles), "{r:?}");
}

#[tokio::test]
async fn python_symlinks_cannot_leave_the_workspace() {
    let b = python_or_skip!();
    let sb = b
        .create_sandbox(&py_spec(), ResolvedSecrets::none())
        .await
        .unwrap();
    std::os::unix::fs::symlink("/etc", sb.workspace_dir().join("etc-link")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", sb.workspace_dir().join("pw")).unwrap();
    let r = attack_py(&sb, "open('/workspace/etc-link/passwd').read()").await;
    assert_eq!(r.exit_code, Some(1), "{r:?}");
    let r = attack_py(&sb, "open('pw').read()").await;
    assert_eq!(r.exit_code, Some(1), "{r:?}");
    let r = attack_py(
        &sb,
        "import os; os.symlink('/etc/passwd', 'mine'); open('mine').read()",
    )
    .await;
    assert_eq!(r.exit_code, Some(1), "{r:?}");
    let r = attack_py(
        &sb,
        "import os; os.symlink('../../../../etc', 'up'); os.listdir('up')",
    )
    .await;
    assert_eq!(r.exit_code, Some(1), "{r:?}");
    // The host file API refuses escapes too.
    assert!(matches!(
        sb.read_file("../x").await,
        Err(sandbox_core::Error::PathEscape { .. })
    ));
    assert!(matches!(
        sb.read_file("etc-link/passwd").await,
        Err(sandbox_core::Error::PathEscape { .. })
    ));
    assert!(matches!(
        sb.write_file("/etc/x", b"").await,
        Err(sandbox_core::Error::PathEscape { .. })
    ));
}

#[tokio::test]
async fn javascript_bad_input() {
    let b = WasmBackend::builder().build().unwrap();
    let spec = SandboxSpec::builder(Language::Javascript)
        .wall_time(Duration::from_secs(1))
        .build()
        .unwrap();
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let cases: &[(&str, Option<LimitKind>)] = &[
        ("function (", None),
        ("throw new Error('boom')", None),
        ("while (true) {}", Some(LimitKind::WallTime)),
        ("new ArrayBuffer(1e10)", None),
        (
            "let a = []; for (;;) a.push('x'.repeat(1e6) + Math.random())",
            Some(LimitKind::Memory),
        ),
        ("console.log('x'.repeat(1e9))", Some(LimitKind::Memory)),
        // A flood is stopped as the output limit (past `flood_threshold`), as in every tier.
        (
            "for (;;) console.log('x'.repeat(1e5))",
            Some(LimitKind::Output),
        ),
        ("import('os')", None),
        ("new Function('return this')().process", None),
        ("(function f() { f() })()", None),
    ];
    for (code, limit) in cases {
        let r = common::run(sb.as_ref(), code).await;
        eprintln!("--- {code}\n{r:?}\nstderr: {}", r.stderr_str());
        if limit.is_some() {
            assert_eq!(r.limit, *limit, "{code}");
        }
        assert!(r.stdout.len() as u64 <= spec.limits.output_bytes);
        let ok = common::run(sb.as_ref(), "'ok'").await;
        assert_eq!(
            ok.value.as_deref(),
            Some(r#""ok""#),
            "unhealthy after {code}"
        );
    }
}

#[tokio::test]
async fn wasm_modules_cannot_escape() {
    let b = WasmBackend::builder().build().unwrap();
    let sb = b
        .create(&SandboxSpec::new(Language::Wasm), ResolvedSecrets::none())
        .await
        .unwrap();
    // Try to open ../etc/passwd and /etc/passwd relative to every preopen fd (3..8).
    for path in ["../etc/passwd", "/etc/passwd", "../../../../../etc/passwd"] {
        for fd in 3..8 {
            let m = format!(
                r#"(module
                  (import "wasi_snapshot_preview1" "path_open" (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
                  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
                  (memory (export "memory") 1)
                  (data (i32.const 64) "{path}")
                  (func (export "_start")
                    (call $exit (call $open (i32.const {fd}) (i32.const 1) (i32.const 64) (i32.const {len})
                      (i32.const 0) (i64.const -1) (i64.const -1) (i32.const 0) (i32.const 16)))))"#,
                len = path.len()
            );
            let r = common::run(sb.as_ref(), &m).await;
            assert_ne!(r.exit_code, Some(0), "{path} opened via fd {fd}");
        }
    }
    // Unknown imports (e.g. a socket API that is not WASI) fail to link: exit 126.
    let r = common::run(
        sb.as_ref(),
        r#"(module (import "env" "socket" (func)) (func (export "_start")))"#,
    )
    .await;
    assert_eq!(r.exit_code, Some(126));
}

#[tokio::test]
async fn filling_the_disk_is_enospc_and_the_sandbox_goes_on() {
    let b = python_or_skip!();
    let mut spec = py_spec();
    spec.limits.disk_bytes = 8 << 20;
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let sb = sb.as_ref();
    // Chunks into the workspace, then files into /tmp: both are the sandbox's own folders,
    // under one 8 MiB cap (and one entry per 8 KiB of it: 1,024).
    for code in [
        "f = open('/workspace/big', 'wb')\nwhile True: f.write(b'x' * (1 << 20))",
        "import os\nos.mkdir('/tmp/flood')\nfor i in range(100000): open(f'/tmp/flood/{i}', 'w').close()",
    ] {
        let r = attack_py(sb, code).await;
        assert_eq!(r.exit_code, Some(1), "{r:?}");
        assert!(
            r.stderr_str().contains("No space left on device"),
            "{}",
            r.stderr_str()
        );
        assert_eq!(r.limit, Some(LimitKind::Disk), "{r:?}");
    }
    let r = common::run(
        sb,
        "import os\nprint(os.path.getsize('/workspace/big') >> 20, len(os.listdir('/tmp/flood')) < 2000)",
    )
    .await;
    assert_eq!(r.stdout_str(), "7 True\n", "{r:?} {}", r.stderr_str());
    // Space freed is space again; rewriting a file is not growth.
    let r = common::run(
        sb,
        "import os, shutil\nos.remove('/workspace/big'); shutil.rmtree('/tmp/flood')\nfor _ in range(5):\n    with open('/workspace/f', 'wb') as f: f.write(b'y' * (6 << 20))\nprint('rewritten')",
    )
    .await;
    assert_eq!(r.stdout_str(), "rewritten\n", "{r:?} {}", r.stderr_str());
    // The file API is held to the same cap (6 MiB are there already).
    let e = sb
        .write_file("more", &vec![0u8; 4 << 20])
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("No space left"), "{e}");
    sb.write_file("f", &vec![1u8; 7 << 20]).await.unwrap();
}

#[tokio::test]
async fn a_host_folder_workspace_is_the_callers_and_not_capped() {
    let b = python_or_skip!();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = py_spec();
    spec.limits.disk_bytes = 1 << 20;
    spec.workspace = sandbox_core::Workspace::HostDir {
        path: dir.path().to_path_buf(),
        read_only: false,
    };
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let r = common::run(
        sb.as_ref(),
        "open('/workspace/f', 'wb').write(b'z' * (3 << 20))\nprint('ok')",
    )
    .await;
    assert_eq!(r.stdout_str(), "ok\n", "{r:?} {}", r.stderr_str());
    let md = std::fs::metadata(dir.path().join("f")).unwrap();
    assert_eq!(md.len(), 3 << 20);
    // Written by this process: the caller owns the file (see "Identity" in
    // docs/container.md), as it owns the folder here.
    {
        use std::os::unix::fs::MetadataExt;
        let dir_md = std::fs::metadata(dir.path()).unwrap();
        // SAFETY: geteuid/getegid have no preconditions.
        let me = unsafe { (libc::geteuid(), libc::getegid()) };
        assert_eq!((md.uid(), md.gid()), me);
        assert_eq!((dir_md.uid(), dir_md.gid()), me);
    }
    // Its own /tmp still is.
    let r = common::run(sb.as_ref(), "open('/tmp/f', 'wb').write(b'z' * (3 << 20))").await;
    assert_eq!(r.limit, Some(LimitKind::Disk), "{r:?}");
}

/// A WASI module that flips `out` in the workspace (fd 3) between a regular file and a
/// relative symlink to `target` (WASI refuses absolute link targets, not `../..` ones), each
/// swap an atomic rename, until `stop` exists (or many rounds pass).
fn flipper_module(target: &str) -> String {
    format!(
        r#"(module
  (import "wasi_snapshot_preview1" "path_open" (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_close" (func $close (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_rename" (func $rename (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_symlink" (func $symlink (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_unlink_file" (func $unlink (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_filestat_get" (func $stat (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "\80\00\00\00\07\00\00\00")
  (data (i32.const 64) "out.tmp")
  (data (i32.const 80) "out")
  (data (i32.const 96) "out.lnk")
  (data (i32.const 112) "stop")
  (data (i32.const 128) "inside\n")
  (data (i32.const 1024) "{target}")
  (func (export "_start")
    (local $i i32)
    (loop $l
      (if (i32.eqz (call $open (i32.const 3) (i32.const 0) (i32.const 64) (i32.const 7)
                     (i32.const 9) (i64.const 0x1fffffff) (i64.const 0x1fffffff) (i32.const 0) (i32.const 0)))
        (then
          (drop (call $write (i32.load (i32.const 0)) (i32.const 16) (i32.const 1) (i32.const 8)))
          (drop (call $close (i32.load (i32.const 0))))))
      (drop (call $rename (i32.const 3) (i32.const 64) (i32.const 7) (i32.const 3) (i32.const 80) (i32.const 3)))
      (drop (call $unlink (i32.const 3) (i32.const 96) (i32.const 7)))
      (drop (call $symlink (i32.const 1024) (i32.const {len}) (i32.const 3) (i32.const 96) (i32.const 7)))
      (drop (call $rename (i32.const 3) (i32.const 96) (i32.const 7) (i32.const 3) (i32.const 80) (i32.const 3)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.and
        (i32.lt_u (local.get $i) (i32.const 100000000))
        (i32.ne (call $stat (i32.const 3) (i32.const 0) (i32.const 112) (i32.const 4) (i32.const 512))
                (i32.const 0)))))))"#,
        len = target.len()
    )
}

/// Issue 32, item 1: a guest flips `/workspace/out` between a file and a relative symlink
/// to a host file while the host-side file API reads and writes it. Checking the path and
/// then opening it again by name lost that race (the read returned the host file, the
/// write replaced it); beneath a workspace handle, the link is refused whenever it is met.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_api_never_follows_a_symlink_swapped_in_during_the_call() {
    let canary = host_canary::Canary::new();
    let mut spec = SandboxSpec::new(Language::Wasm);
    spec.limits.wall_time_ms = 60_000;
    let sb = std::sync::Arc::new(
        WasmBackend::builder()
            .build()
            .unwrap()
            .create_sandbox(&spec, ResolvedSecrets::none())
            .await
            .unwrap(),
    );
    let target = canary.relative_from(sb.workspace_dir());
    let flipper = {
        let sb = std::sync::Arc::clone(&sb);
        let m = flipper_module(&target);
        tokio::spawn(async move { sb.exec(sandbox_core::ExecRequest::code(m)).await })
    };
    host_canary::wait_for_flipper(sb.as_ref(), "out", Duration::from_secs(30)).await;
    let h = host_canary::hammer(
        sb.as_ref(),
        "/workspace/out",
        &canary,
        1000,
        Duration::from_secs(20),
    )
    .await;
    sb.write_file("stop", b"").await.unwrap();
    let r = flipper.await.unwrap().unwrap();
    eprintln!("{h:?}; flipper: {r:?}");
    assert_eq!(r.exit_code, Some(0), "{r:?} {}", r.stderr_str());
    assert!(h.reads_ok > 0 && h.escapes > 0, "{h:?}");
    canary.assert_unchanged("at the end");
}

/// Issue 32, item 4: a guest makes a 1 TiB sparse file (`fd_filestat_set_size`, in an
/// instant). `read_file` refuses it naming the limit instead of allocating its size, running
/// it as a module is refused the same way, and a snapshot keeps it sparse and restores it.
#[tokio::test]
async fn a_sparse_terabyte_file_is_refused_by_read_file_and_kept_sparse_by_snapshots() {
    let b = WasmBackend::builder().build().unwrap();
    let sb = b
        .create(&SandboxSpec::new(Language::Wasm), ResolvedSecrets::none())
        .await
        .unwrap();
    // The small file first: the sandbox's disk meter counts a file with no blocks at its
    // size, so later writes would not fit.
    sb.write_file("small", b"hi").await.unwrap();
    let m = r#"(module
      (import "wasi_snapshot_preview1" "path_open" (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "fd_filestat_set_size" (func $size (param i32 i64) (result i32)))
      (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
      (memory (export "memory") 1)
      (data (i32.const 64) "big")
      (data (i32.const 80) "big.wasm")
      (func (export "_start")
        (if (call $open (i32.const 3) (i32.const 0) (i32.const 64) (i32.const 3)
              (i32.const 1) (i64.const 0x1fffffff) (i64.const 0x1fffffff) (i32.const 0) (i32.const 0))
          (then (call $exit (i32.const 2))))
        (if (call $open (i32.const 3) (i32.const 0) (i32.const 80) (i32.const 8)
              (i32.const 1) (i64.const 0x1fffffff) (i64.const 0x1fffffff) (i32.const 0) (i32.const 4))
          (then (call $exit (i32.const 3))))
        (if (call $size (i32.load (i32.const 0)) (i64.const 1099511627776))
          (then (call $exit (i32.const 4))))
        (call $exit (call $size (i32.load (i32.const 4)) (i64.const 1099511627776)))))"#;
    let r = common::run(sb.as_ref(), m).await;
    assert_eq!(r.exit_code, Some(0), "{r:?} {}", r.stderr_str());
    let listed = sb.list("").await.unwrap();
    assert!(
        listed.iter().any(|e| e.name == "big" && e.size == 1 << 40),
        "{listed:?}"
    );
    let rss = host_canary::rss();
    let limit = |e: &sandbox_core::Error| matches!(e, sandbox_core::Error::InvalidSpec { field, reason } if field == "path" && reason.contains("limits.disk_bytes"));
    let t = std::time::Instant::now();
    let e = sb.read_file("big").await.unwrap_err();
    assert!(limit(&e), "{e}");
    let e = sb
        .exec(sandbox_core::ExecRequest::argv(["big.wasm"]))
        .await
        .unwrap_err();
    assert!(limit(&e), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(sb.read_file("small").await.unwrap(), b"hi");
    let dir = tempfile::tempdir().unwrap();
    let store = sandbox_core::ObjectSnapshotStore::local(dir.path()).unwrap();
    let id = sb.snapshot(&store).await.unwrap();
    let m = sandbox_core::SnapshotStore::manifest(&store, &id)
        .await
        .unwrap();
    assert!(
        m.artifacts["workspace.tar"].size < 1 << 20,
        "{:?}",
        m.artifacts["workspace.tar"]
    );
    let grew = host_canary::rss().saturating_sub(rss);
    assert!(grew < 512 << 20, "the test process grew by {grew} bytes");
    let restored = b
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    let listed = restored.list("").await.unwrap();
    assert!(
        listed.iter().any(|e| e.name == "big" && e.size == 1 << 40),
        "{listed:?}"
    );
    assert_eq!(restored.read_file("small").await.unwrap(), b"hi");
}

/// A WASI module that flips `d` in the workspace (fd 3) between a directory and a relative
/// symlink to `target`, each state held for `hold` `stat`s, until `stop` exists.
fn dir_flipper_module(target: &str, hold: u32) -> String {
    format!(
        r#"(module
  (import "wasi_snapshot_preview1" "path_create_directory" (func $mkdir (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_remove_directory" (func $rmdir (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_symlink" (func $symlink (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_unlink_file" (func $unlink (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_filestat_get" (func $stat (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "d")
  (data (i32.const 80) "d/pwned")
  (data (i32.const 112) "stop")
  (data (i32.const 1024) "{target}")
  (func $hold (result i32)
    (local $j i32)
    (local $r i32)
    (loop $w
      (local.set $r (call $stat (i32.const 3) (i32.const 0) (i32.const 112) (i32.const 4) (i32.const 512)))
      (local.set $j (i32.add (local.get $j) (i32.const 1)))
      (br_if $w (i32.and (i32.lt_u (local.get $j) (i32.const {hold})) (i32.ne (local.get $r) (i32.const 0)))))
    (local.get $r))
  (func (export "_start")
    (local $i i32)
    (loop $l
      (drop (call $mkdir (i32.const 3) (i32.const 64) (i32.const 1)))
      (drop (call $hold))
      (drop (call $unlink (i32.const 3) (i32.const 80) (i32.const 7)))
      (drop (call $rmdir (i32.const 3) (i32.const 64) (i32.const 1)))
      (drop (call $symlink (i32.const 1024) (i32.const {len}) (i32.const 3) (i32.const 64) (i32.const 1)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (if (i32.eqz (call $hold)) (then (return)))
      (drop (call $unlink (i32.const 3) (i32.const 64) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 100000000)))))
)"#,
        len = target.len()
    )
}

/// A WASI module that creates `pwned` in its working directory (the `.` preopen, fd 4 when
/// the workspace is the only other one).
const WRITE_IN_CWD: &str = r#"(module
  (import "wasi_snapshot_preview1" "path_open" (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "pwned")
  (func (export "_start")
    (drop (call $open (i32.const 4) (i32.const 0) (i32.const 64) (i32.const 5)
                (i32.const 1) (i64.const 0x1fffffff) (i64.const 0x1fffffff) (i32.const 0) (i32.const 0)))))"#;

/// A caller-given `cwd` is checked and then preopened for the module: a guest that swaps the
/// folder for a link to a host folder in between must not hand the module the host folder
/// (the check was by path, and the preopen looked the path up again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cwd_swapped_for_a_link_during_the_call_is_not_followed() {
    let canary = tempfile::tempdir().unwrap();
    let mut spec = SandboxSpec::new(Language::Wasm);
    spec.limits.wall_time_ms = 60_000;
    let sb = std::sync::Arc::new(
        WasmBackend::builder()
            .build()
            .unwrap()
            .create_sandbox(&spec, ResolvedSecrets::none())
            .await
            .unwrap(),
    );
    let target = format!(
        "{}{}",
        "../".repeat(24),
        canary.path().display().to_string().trim_start_matches('/')
    );
    let hold: u32 = std::env::var("FLIP_HOLD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let flipper = {
        let sb = std::sync::Arc::clone(&sb);
        let m = dir_flipper_module(&target, hold);
        tokio::spawn(async move { sb.exec(sandbox_core::ExecRequest::code(m)).await })
    };
    let (mut ran, mut refused, mut escaped) = (0, 0, 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < deadline && ran + refused < 4000 {
        let req = sandbox_core::ExecRequest::code(WRITE_IN_CWD).cwd("/workspace/d");
        match sb.exec(req).await {
            Ok(r) if r.exit_code == Some(0) => ran += 1,
            // Refused when the check meets the link (PathEscape) or nothing (NotFound).
            _ => refused += 1,
        }
        if std::fs::read_dir(canary.path()).unwrap().next().is_some() {
            escaped += 1;
            let _ = std::fs::remove_file(canary.path().join("pwned"));
        }
    }
    sb.write_file("stop", b"").await.unwrap();
    let r = flipper.await.unwrap().unwrap();
    eprintln!("{ran} ran, {refused} refused, {escaped} wrote into the host folder");
    assert_eq!(r.exit_code, Some(0), "{r:?} {}", r.stderr_str());
    assert_eq!(
        escaped, 0,
        "a module wrote into the host folder {escaped} times"
    );
    assert!(ran + refused > 100, "{ran} ran, {refused} refused");
}

/// The cell-output frames and the figure flush, driven by a hostile cell: forged flushes,
/// secrets in what they print, a flush that never ends, errors past the cap.
#[tokio::test]
async fn a_cell_that_turns_the_output_driver_against_the_host() {
    let b = python_or_skip!();
    let spec = SandboxSpec::builder(Language::Python)
        .wall_time(Duration::from_secs(2))
        .secret_env("TOKEN", "API_TOKEN")
        .output_bytes(4096)
        .build()
        .unwrap();
    let secrets = ResolvedSecrets::resolve(
        &spec.secrets,
        &sandbox_core::MapSecretSource::new().with("TOKEN", "s3cr3t-value"),
    )
    .unwrap();
    let sb = b.create(&spec, secrets).await.unwrap();
    let forge = "import _host, sys, os\n_host.call(b'\\0agent-sandbox/pyplot\\0')\n";

    // A flush that prints the secret: redacted in the note as in stderr.
    let r = attack_py(
        sb.as_ref(),
        &format!("{forge}sys.modules['_agent_sandbox'].flush = lambda: sys.stderr.write(os.environ['API_TOKEN'])"),
    )
    .await;
    assert!(!r.stderr_str().contains("s3cr3t"), "{r:?}");
    // A flush that returns a value: not a second result.
    let r = attack_py(
        sb.as_ref(),
        &format!("{forge}sys.modules['_agent_sandbox'].flush = lambda: 'from flush'\n41"),
    )
    .await;
    let texts: Vec<_> = r.outputs.iter().map(|o| o.text()).collect();
    assert_eq!(texts, [Some("41")], "{r:?}");
    // A flush that never ends: stopped by the call's own wall limit, as the cell would be.
    let r = attack_py(
        sb.as_ref(),
        &format!("{forge}sys.modules['_agent_sandbox'].flush = lambda: [0 for _ in iter(int, 1)]"),
    )
    .await;
    assert_eq!(
        (r.exit_code, r.limit),
        (Some(137), Some(LimitKind::WallTime)),
        "{r:?}"
    );
    // A flush module deleted: one note, then the host stops flushing.
    let r = attack_py(
        sb.as_ref(),
        &format!("{forge}del sys.modules['_agent_sandbox']"),
    )
    .await;
    assert!(r.stderr_str().contains("ModuleNotFoundError"), "{r:?}");
    let r = common::run(sb.as_ref(), "1").await;
    assert!(r.stderr.is_empty(), "the flush stopped: {r:?}");
    // An exception larger than the cap: the structured error is bounded by the cap.
    let r = attack_py(sb.as_ref(), "raise ValueError('v' * 30000)").await;
    let e_size = r.error.as_ref().map_or(0, |e| {
        e.value.len() + e.traceback.iter().map(String::len).sum::<usize>()
    });
    assert!(e_size <= 4096, "{e_size}");
    // A forged frame of a size the cell states (64 MiB): refused unread, the call goes on.
    let r = attack_py(
        sb.as_ref(),
        "import _host\nr = _host.call(b'\\0agent-sandbox/display\\0' + bytes(64 << 20))\nprint(r)",
    )
    .await;
    assert!(r.truncated && r.outputs.is_empty(), "{r:?}");
}
