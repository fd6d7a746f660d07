//! Hostile input: each ends with a clear result, the host is unharmed, and the next call on
//! the same sandbox is healthy.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

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
    let b = WasmBackend::new();
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
    let b = WasmBackend::new();
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
