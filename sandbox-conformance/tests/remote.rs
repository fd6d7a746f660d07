//! The behaviour contract through a server: every case of the table run against
//! `RemoteBackend` (the traits over `agent-sandbox serve`'s HTTP API, on loopback), for each
//! tier this host can run, must come out as it does locally (the committed column of
//! `docs/conformance.md`), except where the v1 API says otherwise, listed in `REMOTE` with
//! the reason. This is what "agent code written against the traits runs unchanged against a
//! server" means, checked case by case.

// In tests a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use agent_sandbox::remote::{RemoteConfig, RemoteServer};
use agent_sandbox::server::{Listener, Server, ServerConfig, Token};
use agent_sandbox::{Backend, Runtime, Tier};
use sandbox_conformance::table::{self, Table};
use sandbox_conformance::Outcome;

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

/// Cases whose outcome through a server differs from the local one by design, and why.
const REMOTE: &[(&str, &str)] = &[
    (
        "env.secret-redacted",
        "secrets are resolved where the sandbox runs; the v1 API does not send a client's \
         (RemoteBackend::create refuses them as Unsupported)",
    ),
    (
        "env.secret-redacted-stream",
        "the same, for a streamed exec",
    ),
];

/// The committed local column of `tier`: case id -> cell.
fn committed(tier: Tier) -> Vec<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/conformance.md");
    let t = Table::parse(&std::fs::read_to_string(path).unwrap()).unwrap();
    t.column(tier)
        .into_iter()
        .map(|(id, c)| (id.to_string(), c))
        .collect()
}

async fn through_a_server(tier: Tier) {
    let runtime = Arc::new(Runtime::builder().with_tiers(&[tier]).build());
    let local = runtime.backend(tier).unwrap().clone();
    let status = local.probe().await;
    if !status.available {
        eprintln!("SKIP: {tier}: {}", status.reason);
        return;
    }
    // Host access granted: server and client are the same host here, and some cases give
    // host directories. Snapshots in a store of the server's own.
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(agent_sandbox::ObjectSnapshotStore::local(dir.path()).unwrap());
    let config = ServerConfig::default()
        .allow_host_access(true)
        .snapshot_store(store);
    let server = Server::new(runtime, config);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", l.local_addr().unwrap());
    let token = Token::generate();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let t = token.clone();
    let s = server.clone();
    let served = tokio::spawn(async move {
        s.serve(Listener::Tcp(l, t), async {
            let _ = rx.await;
        })
        .await
    });
    let remote = RemoteServer::connect(RemoteConfig::new(&address).unwrap().token(token.reveal()))
        .await
        .unwrap()
        .backend(tier)
        .unwrap();
    let results = sandbox_conformance::run(&remote as &dyn Backend, |case, o| {
        eprintln!("remote {tier} {}: {o:?}", case.id);
    })
    .await;

    let local_cells = committed(tier);
    let mut problems = Vec::new();
    for (id, outcome) in &results {
        let remote_cell = table::cell(tier, id, outcome);
        let Some((_, local_cell)) = local_cells.iter().find(|(c, _)| c == id) else {
            continue;
        };
        if &remote_cell == local_cell {
            continue;
        }
        if REMOTE.iter().any(|(c, _)| c == id) && matches!(outcome, Outcome::Fail(_)) {
            continue;
        }
        problems.push(format!(
            "{id}: locally `{local_cell}`, through the server `{remote_cell}`"
        ));
    }
    // Every case destroyed (or dropped) its sandboxes: none is left on the server (a drop's
    // destroy is a request sent in the background: given a moment).
    for _ in 0..100 {
        if server.sandbox_ids().is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let left = server.sandbox_ids();
    let _ = stop.send(());
    served.await.unwrap().unwrap();
    assert!(left.is_empty(), "left on the server: {left:?}");
    assert!(problems.is_empty(), "{tier}:\n{}", problems.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasm_through_a_server() {
    through_a_server(Tier::Wasm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_through_a_server() {
    through_a_server(Tier::Container).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_through_a_server() {
    through_a_server(Tier::Gvisor).await;
}
