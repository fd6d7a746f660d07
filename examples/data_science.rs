//! Python data work in WebAssembly: pandas on a CSV in the workspace, the seed's
//! `describe()`, then a follow-up turn that reuses the loaded DataFrame.
//!
//! `cargo run --release -p agent-sandbox --example data_science`
//! (the first run downloads and precompiles CPython-in-WebAssembly into the user cache).

use std::sync::Arc;

use agent_sandbox::wasm::{InstallEvent, WasmBackend};
use agent_sandbox::{ExecRequest, Language, Runtime, SandboxSpec, Tier, TierChoice};

const CSV: &str = "region,month,revenue\nnorth,1,120.5\nnorth,2,98.0\nsouth,1,143.25\nsouth,2,151.0\neast,1,87.75\neast,2,110.0\n";

#[tokio::main]
async fn main() -> agent_sandbox::Result<()> {
    // The wasm tier installs Python on first use, reporting progress.
    let wasm = WasmBackend::builder()
        .auto_install_python(true)
        .progress(Arc::new(|ev: &InstallEvent| eprintln!("install: {ev}")))
        .build()?;
    let rt = Runtime::builder()
        .with_default_tiers()
        .backend(Arc::new(wasm))
        .build();

    let spec = SandboxSpec::builder(Language::Python)
        .memory_mib(512)
        .build()?;
    let sandbox = rt.create(&spec, TierChoice::Tier(Tier::Wasm)).await?;
    sandbox.write_file("sales.csv", CSV.as_bytes()).await?;

    let out = sandbox
        .exec(ExecRequest::code(
            "import pandas as pd\ndf = pd.read_csv('/workspace/sales.csv')\nprint(df.describe())",
        ))
        .await?;
    println!(
        "turn 1 ({} ms):\n{}{}",
        out.timeline.total().as_millis(),
        out.stdout_str(),
        out.stderr_str()
    );

    // The interpreter persists: `df` is still there, and the last expression comes back.
    let out = sandbox
        .exec(ExecRequest::code(
            "df.groupby('region')['revenue'].sum().round(2).to_dict()",
        ))
        .await?;
    println!(
        "turn 2 ({} ms): {}",
        out.timeline.total().as_millis(),
        out.value.unwrap_or_default()
    );
    sandbox.destroy().await
}
