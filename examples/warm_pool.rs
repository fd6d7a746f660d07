//! A warm pool of container sandboxes (tier 2) serving an agent's sessions: each session
//! checks out a ready sandbox, runs its first command at once, and destroys it; the pool
//! refills in the background. Each pooled sandbox runs a warm-up command before it is handed
//! out (here a no-op; a real agent might import its heavy modules). Prints every session's
//! checkout + first-command time and the pool's statistics.
//!
//! `cargo run --release -p agent-sandbox --example warm_pool` (Linux, root or rootless with
//! user namespaces; see `agent-sandbox probe`).

use std::time::{Duration, Instant};

use agent_sandbox::{
    ExecRequest, Language, PoolConfig, ResolvedSecrets, Runtime, SandboxSpec, Tier, WarmPool,
};

#[tokio::main]
async fn main() -> agent_sandbox::Result<()> {
    let rt = Runtime::new();
    let Some(backend) = rt.backend(Tier::Container).cloned() else {
        eprintln!("this build has no container tier (feature `container`)");
        return Ok(());
    };
    let status = backend.probe().await;
    if !status.available {
        eprintln!("the container tier cannot run here: {}", status.reason);
        return Ok(());
    }

    let spec = SandboxSpec::builder(Language::Shell)
        .memory_mib(256)
        .build()?;
    let config = PoolConfig::default()
        .size(2)
        .warm_up(ExecRequest::argv(["/bin/true"]));
    let pool = WarmPool::start(backend, spec, ResolvedSecrets::none(), config)?;
    if !pool.wait_ready(2, Duration::from_secs(30)).await {
        eprintln!("the pool did not fill: {:?}", pool.stats());
    }

    for session in 1..=5 {
        let t = Instant::now();
        let sandbox = pool.checkout().await?;
        let out = sandbox
            .exec(ExecRequest::code(format!(
                "echo session {session} in $(hostname)"
            )))
            .await?;
        let took = t.elapsed();
        print!("{}", out.stdout_str());
        println!(
            "  checkout + first command: {:.2} ms (exit {:?})",
            took.as_secs_f64() * 1e3,
            out.exit_code
        );
        sandbox.destroy().await?;
        if !out.success() {
            eprintln!("session {session}'s command failed: {}", out.stderr_str());
            std::process::exit(1);
        }
        // The agent thinks; meanwhile the pool refills.
        pool.wait_ready(2, Duration::from_secs(30)).await;
    }
    println!("{:?}", pool.stats());
    pool.shutdown().await;
    Ok(())
}
