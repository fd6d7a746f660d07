//! The lifecycle's state table under concurrency ([`sandbox_conformance::transitions`]), for
//! every tier this host can run: seeded random rounds of concurrent pause, resume, exec and
//! destroy. Each test probes its tier; an unavailable tier is skipped on its probe's word
//! (`SKIP: <reason>`).

// In tests a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use agent_sandbox::{Backend, Runtime, Tier};
use sandbox_conformance::transitions::{self, Plan};

async fn check_tier(backend: &dyn Backend, seed: u64) {
    let tier = backend.tier();
    let status = backend.probe().await;
    if !status.available {
        eprintln!("SKIP: {tier}: {}", status.reason);
        return;
    }
    let plan = Plan::default().seed(seed);
    let ran = match transitions::check(backend, &plan).await {
        Ok(ran) => ran,
        Err(e) => panic!("{tier}: {e}"),
    };
    eprintln!("{tier}: {ran:?}");
    assert!(
        ran.rounds >= plan.sequences,
        "{tier}: too few rounds: {ran:?}"
    );
    assert!(ran.execs > 0 && ran.destroys > 0, "{tier}: {ran:?}");
    if backend.capabilities().pause_resume {
        assert!(ran.pauses > 0 && ran.resumes > 0, "{tier}: {ran:?}");
    }
}

fn product(tier: Tier) -> Arc<dyn Backend> {
    Runtime::new()
        .backend(tier)
        .unwrap_or_else(|| panic!("{tier} is not built in"))
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasm() {
    check_tier(product(Tier::Wasm).as_ref(), 0x3a5e_0001).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container() {
    check_tier(product(Tier::Container).as_ref(), 0x3a5e_0002).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor() {
    check_tier(product(Tier::Gvisor).as_ref(), 0x3a5e_0003).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microvm() {
    check_tier(product(Tier::Microvm).as_ref(), 0x3a5e_0004).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unisolated() {
    check_tier(
        &backend_unisolated::UnisolatedBackend::new_without_isolation(),
        0x3a5e_0005,
    )
    .await;
}
