//! Quickstart: probe the host, let the selector pick a tier for a Python snippet, run it.
//!
//! `cargo run --release -p agent-sandbox --example quickstart`

use agent_sandbox::{ExecRequest, Language, Question, Runtime, SandboxSpec, TierChoice};

#[tokio::main]
async fn main() -> agent_sandbox::Result<()> {
    let rt = Runtime::new();
    for s in rt.probe().await {
        println!(
            "{:<10} available={} {}",
            s.tier.name(),
            s.available,
            s.reason
        );
    }
    let spec = SandboxSpec::builder(Language::Python)
        .memory_mib(256)
        .build()?;
    let question = Question::new(Language::Python);
    let sandbox = match rt.create(&spec, TierChoice::Auto(question)).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("no sandbox: {e}");
            return Ok(());
        }
    };
    let out = sandbox.exec(ExecRequest::code("print(2 + 2)")).await?;
    println!("{} said: {}", sandbox.tier(), out.stdout_str().trim());
    sandbox.destroy().await
}
