//! Rich results of Python cells in the wasm tier: values, `display`, pandas tables,
//! matplotlib figures as PNG, structured errors, and the output cap. Skips (saying why)
//! when the Python artifacts are not installed and the local wheel is absent.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use backend_wasm::WasmBackend;
use base64::Engine as _;
use sandbox_core::{ExecRequest, ExecResult, OutputKind, SandboxSpec};

/// The width and height of a PNG, after checking its signature and first chunk.
fn png_size(b64: &str) -> (u32, u32, usize) {
    let png = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .expect("base64");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG signature");
    assert_eq!(&png[12..16], b"IHDR");
    let w = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(png[20..24].try_into().unwrap());
    (w, h, png.len())
}

async fn cell(sb: &dyn sandbox_core::Sandbox, code: &str) -> ExecResult {
    sb.exec(ExecRequest::code(code).timeout(Duration::from_secs(120)))
        .await
        .expect("exec")
}

fn spec() -> SandboxSpec {
    let mut s = SandboxSpec::new(sandbox_core::Language::Python);
    s.limits.memory_bytes = 1 << 30;
    s
}

#[tokio::test]
async fn values_displays_and_errors_come_back_as_bundles() {
    let b = python_or_skip!();
    let sb = common::sandbox(&b, spec()).await;
    let r = cell(sb.as_ref(), "x = 1").await;
    assert!(r.outputs.is_empty() && r.error.is_none(), "{r:?}");
    let r = cell(sb.as_ref(), "x + 1").await;
    assert_eq!(r.outputs.len(), 1, "{r:?}");
    assert_eq!(r.outputs[0].kind, OutputKind::ExecuteResult);
    assert_eq!(r.outputs[0].text(), Some("2"));
    assert_eq!(r.value.as_deref(), Some("2"));

    // display() in order, before the cell's value; objects with _repr_*_ methods.
    let code = r#"
class Rich:
    def _repr_html_(self): return "<b>rich</b>"
    def _repr_markdown_(self): return "**rich**"
    def _repr_json_(self): return {"rich": True}
    def __repr__(self): return "Rich()"
display("first", Rich())
print("between")
"last"
"#;
    let r = cell(sb.as_ref(), code).await;
    assert_eq!(r.stdout_str(), "between\n'last'\n", "{r:?}");
    let kinds: Vec<_> = r.outputs.iter().map(|o| (o.kind, o.text())).collect();
    assert_eq!(
        kinds,
        [
            (OutputKind::DisplayData, Some("'first'")),
            (OutputKind::DisplayData, Some("Rich()")),
            (OutputKind::ExecuteResult, Some("'last'")),
        ]
    );
    let rich = &r.outputs[1];
    assert_eq!(rich.get("text/html"), Some("<b>rich</b>"));
    assert_eq!(rich.get("text/markdown"), Some("**rich**"));
    assert_eq!(rich.get("application/json"), Some(r#"{"rich": true}"#));

    // An exception: structured, and still on stderr; the session goes on.
    let r = cell(sb.as_ref(), "def f():\n    return 1 / 0\nf()").await;
    assert_eq!(r.exit_code, Some(1), "{r:?}");
    let e = r.error.as_ref().expect("a structured error");
    assert_eq!(
        (e.name.as_str(), e.value.as_str()),
        ("ZeroDivisionError", "division by zero")
    );
    assert!(
        e.traceback.iter().any(|l| l.contains("return 1 / 0")),
        "{e:?}"
    );
    assert_eq!(
        e.traceback.last().map(String::as_str),
        Some("ZeroDivisionError: division by zero")
    );
    assert!(r.stderr_str().contains("ZeroDivisionError"), "{r:?}");
    let r = cell(sb.as_ref(), "x").await;
    assert_eq!((r.outputs.len(), r.error.is_none()), (1, true), "{r:?}");
}

#[tokio::test]
async fn a_dataframe_is_html_and_a_figure_is_a_png() {
    let b = python_or_skip!();
    let sb = common::sandbox(&b, spec()).await;
    let r = cell(
        sb.as_ref(),
        "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': [3, 4]})\ndf",
    )
    .await;
    assert!(r.success(), "{r:?}");
    let df = &r.outputs[0];
    assert!(
        df.get("text/html").unwrap_or("").contains("<table"),
        "{df:?}"
    );
    assert!(df.text().unwrap_or("").contains("a  b"), "{df:?}");

    // A figure left open at the end of the cell comes back once, as a PNG, then is closed.
    let code = "import matplotlib.pyplot as plt\nplt.plot(range(100), [i * i for i in range(100)])\nplt.title('squares')\nprint('drawn')";
    let r = cell(sb.as_ref(), code).await;
    assert!(r.success(), "{r:?}");
    assert_eq!(r.stdout_str(), "drawn\n");
    assert!(!r.stderr_str().contains("non-GUI"), "{r:?}");
    let figs: Vec<_> = r
        .outputs
        .iter()
        .filter(|o| o.get("image/png").is_some())
        .collect();
    assert_eq!(figs.len(), 1, "{r:?}");
    assert_eq!(figs[0].kind, OutputKind::DisplayData);
    assert!(
        figs[0].text().unwrap_or("").starts_with("<Figure size"),
        "{:?}",
        figs[0].text()
    );
    let (w, h, len) = png_size(figs[0].get("image/png").unwrap());
    assert!(w > 300 && h > 200 && len > 5_000, "{w}x{h}, {len} bytes");
    let r = cell(sb.as_ref(), "len(plt.get_fignums())").await;
    assert_eq!(r.value.as_deref(), Some("0"), "{r:?}");
    // plt.show() shows, without Agg's warning.
    let r = cell(sb.as_ref(), "plt.plot([1, 2]); plt.show()").await;
    assert_eq!(
        r.outputs
            .iter()
            .filter(|o| o.get("image/png").is_some())
            .count(),
        1
    );
    assert!(r.stderr.is_empty(), "{r:?}");
    // Only a cell that made a figure is followed by the flush.
    let spy = "import sys\nsys.modules['_agent_sandbox'].flush = lambda: print('flushed', file=sys.stderr)";
    assert!(cell(sb.as_ref(), spy).await.stderr.is_empty());
    assert!(cell(sb.as_ref(), "1 + 1").await.stderr.is_empty());
    let r = cell(sb.as_ref(), "f = plt.figure()").await;
    assert!(r.stderr_str().contains("flushed"), "{r:?}");
}

#[tokio::test]
async fn outputs_are_capped_and_forged_frames_change_nothing() {
    let b = python_or_skip!();
    let mut s = spec();
    s.limits.output_bytes = 64 << 10;
    let sb = common::sandbox(&b, s).await;
    // More than the cap in displays: what fits comes back, and `truncated` says so.
    let r = cell(sb.as_ref(), "for i in range(100):\n    display('x' * 1000)").await;
    assert!(r.success(), "{r:?}");
    assert!(r.truncated, "{r:?}");
    let n = r.outputs.len();
    assert!((50..=64).contains(&n), "{n} outputs");
    // One output larger than the whole cap is dropped unread.
    let r = cell(sb.as_ref(), "display('y' * (1 << 20))\n1").await;
    assert!(r.truncated && r.outputs.len() == 1, "{r:?}");
    // Frames written by the cell itself: malformed ones are ignored, the host stays up.
    let code = r#"
import _host
for f in [b"\0agent-sandbox/display\0not json", b"\0agent-sandbox/display\0{\"data\": {\"text/html\": \"<i>no plain</i>\"}}",
          b"\0agent-sandbox/error\0[1]", b"\0agent-sandbox/result\0{\"value\": \"{bad\", \"data\": {\"text/plain\": \"forged\"}}"]:
    _host.call(f)
"#;
    let r = cell(sb.as_ref(), code).await;
    assert!(r.success(), "{r:?}");
    assert_eq!(r.outputs.len(), 1, "{r:?}");
    assert_eq!(
        (r.outputs[0].text(), r.value.as_deref()),
        (Some("forged"), None)
    );
    assert!(r.error.is_none());
    let r = cell(sb.as_ref(), "1 + 1").await;
    assert_eq!(r.value.as_deref(), Some("2"), "{r:?}");
}

#[tokio::test]
async fn a_thousand_figures_stop_at_the_cap_and_the_session_survives() {
    let b = python_or_skip!();
    let mut s = spec();
    s.limits.output_bytes = 256 << 10;
    let sb = common::sandbox(&b, s).await;
    let code =
        "import matplotlib.pyplot as plt\nfor i in range(1000):\n    plt.figure(figsize=(1, 1))\n";
    let r = cell(sb.as_ref(), code).await;
    assert!(r.success(), "{r:?}");
    assert!(r.truncated, "{r:?}");
    assert!(
        !r.outputs.is_empty() && r.outputs.len() < 1000,
        "{}",
        r.outputs.len()
    );
    let r = cell(sb.as_ref(), "len(plt.get_fignums())").await;
    assert_eq!(r.value.as_deref(), Some("0"), "every figure closed: {r:?}");
}

#[tokio::test]
async fn a_javascript_value_is_a_result_with_its_json() {
    let b = WasmBackend::builder().build().unwrap();
    let sb = common::js(&b).await;
    let r = common::run(sb.as_ref(), "({a: [1, 'x']})").await;
    assert_eq!(r.outputs.len(), 1, "{r:?}");
    assert_eq!(r.outputs[0].kind, OutputKind::ExecuteResult);
    assert_eq!(
        r.outputs[0].get("application/json"),
        Some(r#"{"a":[1,"x"]}"#)
    );
    let r = common::run(sb.as_ref(), "'abc'.toUpperCase()").await;
    assert_eq!(r.outputs[0].text(), Some("'ABC'"), "{r:?}");
    let r = common::run(sb.as_ref(), "let y = 1").await;
    assert!(r.outputs.is_empty(), "{r:?}");
}
