//! The conformance table, run for every tier this host can run.
//!
//! Each test probes its tier; an unavailable tier is skipped on its probe's word
//! (`SKIP: <reason>`). A tier that runs must pass every applicable case, except the ones in
//! `KNOWN_FAILURES` (which must still fail). Then its column of `docs/conformance.md` is
//! checked against the results, or written with `UPDATE_CONFORMANCE=1`.

// In tests a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Mutex;

use agent_sandbox::{Backend, Runtime, Tier};
use sandbox_conformance::table::{self, Table};
use sandbox_conformance::{known_failure, Outcome};

/// This test binary starts the way a shell's background job under `nohup` does, whatever
/// started it: `SIGINT`, `SIGQUIT` and `SIGHUP` ignored, `SIGUSR1` and `SIGTERM` blocked. Set
/// before `main` (an `.init_array` constructor), so that every thread inherits the mask and
/// every process-wide helper a tier starts (the container tier's zygote), the dispositions:
/// the case `process.signal-defaults` checks that sandboxed processes get none of it.
#[used]
#[link_section = ".init_array"]
static LIKE_A_BACKGROUND_JOB: extern "C" fn() = like_a_background_job;

extern "C" fn like_a_background_job() {
    // SAFETY: runs before `main`, on the only thread: sets dispositions and its own mask.
    unsafe {
        for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP] {
            libc::signal(sig, libc::SIG_IGN);
        }
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGUSR1, libc::SIGTERM] {
            libc::sigaddset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Serializes the read-modify-write of the document by the tests of this binary.
static DOC: Mutex<()> = Mutex::new(());

fn doc_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/conformance.md")
}

fn updating() -> bool {
    std::env::var_os("UPDATE_CONFORMANCE").is_some_and(|v| v == "1")
}

async fn check_tier(backend: &dyn Backend) {
    let tier = backend.tier();
    let status = backend.probe().await;
    if !status.available {
        eprintln!("SKIP: {tier}: {}", status.reason);
        if updating() {
            let col = table::untested_column(
                &backend.capabilities(),
                "unavailable where the table was made",
            );
            write_column(tier, &col, true);
        }
        return;
    }
    let results = sandbox_conformance::run(backend, |case, o| {
        eprintln!("{tier} {}: {o:?}", case.id);
    })
    .await;
    let mut problems = Vec::new();
    for (id, o) in &results {
        match (o, known_failure(tier, id)) {
            (Outcome::Fail(why), None) => problems.push(format!("{id}: FAIL: {why}")),
            (Outcome::Fail(_), Some(_)) | (Outcome::NotApplicable(_), None) | (Outcome::Pass, None) => {}
            (_, Some(k)) => problems.push(format!(
                "{id}: listed as a known failure ({}) but did not fail: remove it from KNOWN_FAILURES",
                k.why
            )),
            (other, None) => problems.push(format!("{id}: unexpected outcome {other:?}")),
        }
    }
    let col = table::column(tier, &results);
    if updating() {
        write_column(tier, &col, false);
    } else {
        let doc = std::fs::read_to_string(doc_path()).unwrap();
        let committed = Table::parse(&doc).unwrap();
        for (id, cell) in &col {
            let had = committed.cell(id, tier).unwrap_or("");
            if had != cell {
                problems.push(format!(
                    "docs/conformance.md is stale for {tier} {id}: has `{had}`, the run says `{cell}` \
                     (regenerate: UPDATE_CONFORMANCE=1 cargo test -p sandbox-conformance --test tiers)"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{tier}:\n{}", problems.join("\n"));
}

/// Writes `tier`'s column; an untested column never replaces one a run wrote.
fn write_column(tier: Tier, col: &[(&'static str, String)], untested: bool) {
    let _g = DOC.lock().unwrap_or_else(|p| p.into_inner());
    let doc = std::fs::read_to_string(doc_path()).unwrap();
    let mut t = Table::parse(&doc).unwrap();
    let ran_before = t
        .column(tier)
        .iter()
        .any(|(_, c)| c == "pass" || c.starts_with("**known fail**"));
    if untested && ran_before {
        return;
    }
    t.set_column(tier, col);
    std::fs::write(doc_path(), t.replace_in(&doc).unwrap()).unwrap();
}

fn product(tier: Tier) -> std::sync::Arc<dyn Backend> {
    Runtime::new()
        .backend(tier)
        .unwrap_or_else(|| panic!("{tier} is not built in"))
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasm() {
    check_tier(product(Tier::Wasm).as_ref()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container() {
    check_tier(product(Tier::Container).as_ref()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor() {
    check_tier(product(Tier::Gvisor).as_ref()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microvm() {
    check_tier(product(Tier::Microvm).as_ref()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unisolated() {
    check_tier(&backend_unisolated::UnisolatedBackend::new_without_isolation()).await;
}
