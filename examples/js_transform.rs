//! A JavaScript transform in a QuickJS isolate that calls a host tool.
//!
//! `cargo run --release -p agent-sandbox --example js_transform`

use std::sync::Arc;

use agent_sandbox::wasm::{ToolError, WasmBackend};
use agent_sandbox::{ExecRequest, Language, Runtime, SandboxSpec, Tier, TierChoice};
use serde_json::json;

#[tokio::main]
async fn main() -> agent_sandbox::Result<()> {
    // The only host object the code can reach is this tool.
    let wasm = WasmBackend::builder()
        .tool("price", &["item"], |call| {
            match call.arg("item").and_then(|v| v.as_str()) {
                Some("apple") => Ok(json!(0.5)),
                Some("pear") => Ok(json!(0.75)),
                Some(other) => Err(ToolError::new(format!("no price for {other}"))),
                None => Err(ToolError::new("item must be a string")),
            }
        })
        .build()?;
    let rt = Runtime::builder()
        .with_default_tiers()
        .backend(Arc::new(wasm))
        .build();
    let sandbox = rt
        .create(
            &SandboxSpec::new(Language::Javascript),
            TierChoice::Tier(Tier::Wasm),
        )
        .await?;

    let out = sandbox
        .exec(ExecRequest::code(r#""hello, agent".toUpperCase()"#))
        .await?;
    println!("value: {}", out.value.unwrap_or_default());

    let code = r#"
        const basket = ["apple", "pear", "apple"];
        const total = basket.map(item => tools.price(item)).reduce((a, b) => a + b, 0);
        console.log(`basket of ${basket.length} costs ${total}`);
        ({ total, items: basket.length })
    "#;
    let out = sandbox.exec(ExecRequest::code(code)).await?;
    print!("{}", out.stdout_str());
    println!(
        "value: {} ({} µs)",
        out.value.unwrap_or_default(),
        out.timeline.total().as_micros()
    );

    let out = sandbox
        .exec(ExecRequest::code("tools.price('durian')"))
        .await?;
    println!(
        "tool error surfaces as an exception: {}",
        out.stderr_str().trim()
    );
    sandbox.destroy().await
}
