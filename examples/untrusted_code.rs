//! Untrusted, LLM-written Python under gVisor: no network, a secret the sandbox never sees,
//! a full-memory snapshot after a turn, then restore and continue.
//!
//! `cargo run -p agent-sandbox --example untrusted_code` (root, `apt-get install runsc`)

use std::sync::Arc;

use agent_sandbox::{
    ExecRequest, Language, MapSecretSource, ObjectSnapshotStore, Runtime, SandboxSpec, Tier,
    TierChoice,
};

/// What an LLM might have written: it keeps state in a file and looks for a way out. (The
/// sandbox has only its own loopback, so nothing it tries leaves the sandbox.)
const TURN_1: &str = r#"
import os, json, socket
totals = {"apples": 3, "pears": 5}
json.dump(totals, open("totals.json", "w"))
print("env keys:", sorted(os.environ))
print("interfaces:", [name for _, name in socket.if_nameindex()])
try:
    socket.getaddrinfo("api.example.com", 443)
    print("dns: resolved")
except OSError as e:
    print("dns: blocked,", e)
"#;

const TURN_2: &str = r#"
import json
totals = json.load(open("totals.json"))
totals["plums"] = 7
print("turn 2 sees", totals)
"#;

#[tokio::main]
async fn main() -> agent_sandbox::Result<()> {
    // The API key stays on the host: host-side tools may use it, the sandbox never gets it.
    let secrets = MapSecretSource::new().with("OPENAI_API_KEY", "sk-example-not-real");
    let rt = Runtime::builder()
        .with_default_tiers()
        .secret_source(Arc::new(secrets))
        .build();
    let status = rt
        .probe()
        .await
        .into_iter()
        .find(|s| s.tier == Tier::Gvisor);
    if let Some(s) = status.filter(|s| !s.available) {
        eprintln!(
            "gvisor tier unavailable: {} (fix: {})",
            s.reason,
            s.fix.unwrap_or_default()
        );
        return Ok(());
    }

    let spec = SandboxSpec::builder(Language::Python)
        .secret_host_only("OPENAI_API_KEY")
        .memory_mib(256)
        .build()?; // network: deny-all by default
    let sandbox = rt.create(&spec, TierChoice::Tier(Tier::Gvisor)).await?;
    let out = sandbox.exec(ExecRequest::code(TURN_1)).await?;
    print!(
        "turn 1 ({} ms):\n{}",
        out.timeline.total().as_millis(),
        out.stdout_str()
    );

    let dir = tempfile::tempdir().map_err(|e| agent_sandbox::Error::io("temp dir", e))?;
    let store = ObjectSnapshotStore::local(dir.path())?;
    let snapshot = sandbox.snapshot(&store).await?;
    println!("snapshot {snapshot}");
    sandbox.destroy().await?;

    let restored = rt.restore(&store, &snapshot).await?;
    let out = restored.exec(ExecRequest::code(TURN_2)).await?;
    print!("after restore:\n{}", out.stdout_str());
    restored.destroy().await
}
