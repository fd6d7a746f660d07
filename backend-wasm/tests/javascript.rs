//! JavaScript (QuickJS) through the public API.

mod common;

use std::time::Duration;

use backend_wasm::{ToolError, WasmBackend};
use sandbox_core::{Backend, ExecRequest, Language, LimitKind, ResolvedSecrets, SandboxSpec};
use serde_json::json;

#[tokio::test]
async fn console_value_and_session() {
    let b = WasmBackend::builder().build().unwrap();
    let sb = common::js(&b).await;
    let r = common::run(sb.as_ref(), r#""abc".toUpperCase()"#).await;
    assert_eq!(r.value.as_deref(), Some(r#""ABC""#), "{r:?}");
    assert!(r.success());
    // The final value is echoed on stdout, as Python's is: a string quoted as Python's
    // `repr` shows one, anything else as JSON.
    assert_eq!(r.stdout_str(), "'ABC'\n");
    let r = common::run(sb.as_ref(), r#"["it's", 2]; 'a\'b\n'"#).await;
    assert_eq!(r.stdout_str(), "'a\\'b\\n'\n", "{r:?}");
    let r = common::run(sb.as_ref(), "({a: [1, 2]})").await;
    assert_eq!(r.stdout_str(), "{\"a\":[1,2]}\n");
    let r = common::run(
        sb.as_ref(),
        "console.log('hi', 1, {a: [1, 2]}, null, undefined); console.error('oops'); var x = 41;",
    )
    .await;
    assert_eq!(r.stdout_str(), "hi 1 {\"a\":[1,2]} null undefined\n");
    assert_eq!(r.stderr_str(), "oops\n");
    assert_eq!(r.value, None);
    let r = common::run(sb.as_ref(), "x + 1").await;
    assert_eq!(
        r.value.as_deref(),
        Some("42"),
        "globals persist in a session"
    );
    let r = common::run(sb.as_ref(), "({n: x, list: [true, 'a']})").await;
    assert_eq!(r.value.as_deref(), Some(r#"{"n":41,"list":[true,"a"]}"#));
    let r = common::run(sb.as_ref(), "Promise.resolve(5).then(v => v * 2)").await;
    assert_eq!(r.value.as_deref(), Some("10"), "{r:?}");
}

#[tokio::test]
async fn errors_are_results() {
    let b = WasmBackend::builder().build().unwrap();
    let sb = common::js(&b).await;
    let r = common::run(sb.as_ref(), "throw new TypeError('bad thing')").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(
        r.stderr_str().contains("TypeError: bad thing"),
        "{}",
        r.stderr_str()
    );
    let r = common::run(sb.as_ref(), "function (").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(r.stderr_str().contains("SyntaxError"), "{}", r.stderr_str());
    let r = common::run(sb.as_ref(), "throw 42").await;
    assert!(r.stderr_str().contains("42"));
    let r = common::run(sb.as_ref(), "1 + 1").await;
    assert_eq!(r.value.as_deref(), Some("2"));
}

#[tokio::test]
async fn no_host_objects() {
    let b = WasmBackend::builder().build().unwrap();
    let sb = common::js(&b).await;
    let r = common::run(
        sb.as_ref(),
        "[typeof require, typeof process, typeof std, typeof os, typeof fetch, typeof tools, typeof XMLHttpRequest, typeof Deno]",
    )
    .await;
    assert_eq!(
        r.value.as_deref(),
        Some(
            r#"["undefined","undefined","undefined","undefined","undefined","undefined","undefined","undefined"]"#
        )
    );
}

#[tokio::test]
async fn host_tools() {
    let b = WasmBackend::builder()
        .tool("price", &["item", "qty?"], |c| {
            let qty = c.arg("qty").and_then(|v| v.as_f64()).unwrap_or(1.0);
            match c.arg("item").and_then(|v| v.as_str()) {
                Some("apple") => Ok(json!(0.5 * qty)),
                Some(other) => Err(ToolError::new(format!("no price for {other}"))),
                None => Err(ToolError::invalid_arguments("item must be a string")),
            }
        })
        .build()
        .unwrap();
    let sb = common::js(&b).await;
    let r = common::run(
        sb.as_ref(),
        "price('apple') + tools.price('apple', 4) + tools.price({item: 'apple'})",
    )
    .await;
    assert_eq!(r.value.as_deref(), Some("3"), "{r:?}");
    let r = common::run(sb.as_ref(), "try { price('pear') } catch (e) { e.message }").await;
    assert_eq!(
        r.value.as_deref(),
        Some(r#""price: no price for pear (tool_error)""#)
    );
    let r = common::run(sb.as_ref(), "price()").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(
        r.stderr_str().contains("missing a required argument"),
        "{}",
        r.stderr_str()
    );
}

#[tokio::test]
async fn limits() {
    let b = WasmBackend::builder().build().unwrap();
    let spec = SandboxSpec::builder(Language::Javascript)
        .wall_time(Duration::from_millis(300))
        .memory_mib(32)
        .output_bytes(100)
        .build()
        .unwrap();
    let sb = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let r = common::run(sb.as_ref(), "var keep = 1; while (true) {}").await;
    assert_eq!(
        (r.exit_code, r.limit),
        (Some(137), Some(LimitKind::WallTime)),
        "{r:?}"
    );
    assert!(r.stderr_str().contains("reset"));
    let r = common::run(sb.as_ref(), "typeof keep").await;
    assert_eq!(
        r.value.as_deref(),
        Some(r#""undefined""#),
        "the context was reset"
    );
    let r = common::run(
        sb.as_ref(),
        "let a = []; while (true) a.push(new Array(100000).fill(1.5));",
    )
    .await;
    assert_eq!(r.limit, Some(LimitKind::Memory), "{r:?}");
    let r = common::run(sb.as_ref(), "'x'.repeat(1e9).length").await;
    assert_eq!(r.limit, Some(LimitKind::Memory), "{r:?}");
    let r = common::run(
        sb.as_ref(),
        "for (let i = 0; i < 1000; i++) console.log('line ' + i); 7",
    )
    .await;
    assert!(r.truncated && r.stdout.len() == 100 && r.success(), "{r:?}");
    // A flood (past `sandbox_core::flood_threshold`) is stopped: the output limit.
    let r = common::run(sb.as_ref(), "for (;;) console.log('y'.repeat(1000))").await;
    assert_eq!(
        (r.exit_code, r.limit, r.stdout.len()),
        (Some(137), Some(LimitKind::Output), 100),
        "{r:?}"
    );
    let r = common::run(sb.as_ref(), "function f(n) { return f(n + 1) } f(0)").await;
    assert_eq!(r.exit_code, Some(1));
    assert!(r.stderr_str().contains("stack"), "{}", r.stderr_str());
    let r = sb
        .exec(ExecRequest::code("while (true) {}").timeout(Duration::from_millis(50)))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime));
    assert_eq!(
        common::run(sb.as_ref(), "6 * 7").await.value.as_deref(),
        Some("42")
    );
    let mut fuel = SandboxSpec::new(Language::Javascript);
    fuel.limits.fuel = Some(10);
    assert!(matches!(
        b.create(&fuel, ResolvedSecrets::none()).await,
        Err(sandbox_core::Error::Unsupported { .. })
    ));
}

#[tokio::test]
async fn every_sandbox_starts_from_a_pristine_context() {
    // Contexts are built ahead of time (on the janitor thread); each must be unused when a
    // sandbox gets it, and the stack limit must hold on the thread that runs it.
    let b = WasmBackend::builder().build().unwrap();
    for round in 0..8 {
        let sb = common::js(&b).await;
        let r = common::run(
            sb.as_ref(),
            "[typeof leaked, typeof Object.prototype.poisoned, [1,2,3].map(x => x * 2).join()]",
        )
        .await;
        assert_eq!(
            r.value.as_deref(),
            Some(r#"["undefined","undefined","2,4,6"]"#),
            "round {round}: {r:?}"
        );
        let r = common::run(
            sb.as_ref(),
            "globalThis.leaked = 1; Object.prototype.poisoned = 1; (function f() { f() })()",
        )
        .await;
        assert_eq!(r.exit_code, Some(1), "round {round}: {r:?}");
        assert!(r.stderr_str().contains("stack"), "{}", r.stderr_str());
        sb.destroy().await.unwrap();
    }
}
