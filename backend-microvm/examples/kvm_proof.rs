//! The microVM tier's figures on a host whose KVM can boot Linux: boot to agent ready,
//! start from the boot snapshot to the first command's output, exec round trip, restore to
//! the first command's output, and memory per sandbox (booted, started from the boot
//! snapshot, restored from one snapshot), with Firecracker's published figures and this project's
//! targets beside them. Run by `scripts/kvm-proof.sh` after the Linux-guest test suites.
//!
//! ```text
//! cargo run --release -p backend-microvm --example kvm_proof [-- --guest-dir DIR] [--check]
//! ```
//!
//! `--check` only asks the probe: exit 0 where Linux guests can boot, else 2 with the
//! probe's reason (this host: nested KVM that emulates guest kernel mode). The guest is the
//! one in `--guest-dir` (default: the backend's cache), installed there first if missing.

// A proof that cannot set itself up should stop loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use backend_microvm::guest::install::{self, InstallOptions, Verify};
use backend_microvm::probe::probe_kvm;
use backend_microvm::MicrovmBackend;
use sandbox_core::{
    Backend, ExecRequest, Language, ObjectSnapshotStore, Phase, ResolvedSecrets, Sandbox,
    SandboxSpec,
};

/// Sandboxes created (and restored) one after another for the latency rows.
const ROUNDS: usize = 10;
/// Exec round trips measured in one sandbox.
const EXECS: usize = 50;
/// Live sandboxes for the memory rows.
const LIVE: usize = 20;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// This process's PSS (total, anonymous), in KiB, from `/proc/self/smaps_rollup`.
fn pss() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (field("Pss:"), field("Pss_Anon:"))
}

fn spec() -> SandboxSpec {
    SandboxSpec::builder(Language::Shell)
        .memory_mib(256)
        .build()
        .unwrap()
}

async fn output(s: &dyn Sandbox, code: &str) -> String {
    let r = s.exec(ExecRequest::code(code)).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{code}: {}", r.stderr_str());
    r.stdout_str()
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let probe = tokio::task::spawn_blocking(probe_kvm).await.unwrap();
    if !probe.linux_guests_supported() {
        eprintln!(
            "kvm-proof: this host cannot boot Linux guests: {}",
            probe.reason
        );
        std::process::exit(2);
    }
    if args.iter().any(|a| a == "--check") {
        println!("kvm-proof: Linux guests can boot here ({})", probe.reason);
        return;
    }
    let dir = args
        .iter()
        .position(|a| a == "--guest-dir")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from)
        .unwrap_or_else(install::default_cache_dir);
    let d = dir.clone();
    tokio::task::spawn_blocking(move || {
        if install::load(&d, Verify::Sizes).is_err() {
            eprintln!("kvm-proof: installing the guest in {}", d.display());
            install::install(&InstallOptions::debian().dir(d)).unwrap();
        }
    })
    .await
    .unwrap();
    // Every sandbox boots its kernel (for the boot rows), or (the default) the first of a
    // kind boots and the others start from its snapshot.
    let cold = MicrovmBackend::builder()
        .guest_dir(&dir)
        .boot_snapshots(false)
        .build()
        .unwrap();
    let b = MicrovmBackend::builder().guest_dir(&dir).build().unwrap();
    let none = ResolvedSecrets::none;

    // Boot to agent ready: create, which returns once the agent answered `Ready`.
    let mut boots = Vec::new();
    let mut runtime = Vec::new();
    for _ in 0..ROUNDS {
        let t0 = Instant::now();
        let s = cold.create(&spec(), none()).await.unwrap();
        boots.push(t0.elapsed());
        if let Some(p) = s
            .timeline()
            .phases
            .iter()
            .find(|p| p.phase == Phase::Runtime)
        {
            runtime.push(Duration::from_micros(p.micros));
        }
        s.destroy().await.unwrap();
    }

    // Start from the boot snapshot to the first command's output (the first create boots
    // and makes it).
    b.create(&spec(), none())
        .await
        .unwrap()
        .destroy()
        .await
        .unwrap();
    let mut warm_creates = Vec::new();
    let mut warm_outputs = Vec::new();
    for _ in 0..ROUNDS {
        let t0 = Instant::now();
        let s = b.create(&spec(), none()).await.unwrap();
        warm_creates.push(t0.elapsed());
        assert!(
            s.timeline()
                .phases
                .iter()
                .any(|p| p.phase == Phase::Restore),
            "started from the boot snapshot: {:?}",
            s.timeline()
        );
        assert_eq!(output(s.as_ref(), "echo hi").await, "hi\n");
        warm_outputs.push(t0.elapsed());
        s.destroy().await.unwrap();
    }

    // Exec round trip in a running sandbox.
    let s = b.create(&spec(), none()).await.unwrap();
    let mut execs = Vec::new();
    for _ in 0..EXECS {
        let t0 = Instant::now();
        s.exec(ExecRequest::argv(["true"])).await.unwrap();
        execs.push(t0.elapsed());
    }

    // Restore to the first command's output, from one snapshot.
    let store_dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(store_dir.path()).unwrap();
    s.write_file("state.txt", b"kept").await.unwrap();
    let snap = s.snapshot(&store).await.unwrap();
    s.destroy().await.unwrap();
    let mut restores = Vec::new();
    let mut first_outputs = Vec::new();
    for _ in 0..ROUNDS {
        let t0 = Instant::now();
        let r = b.restore(&store, &snap, none()).await.unwrap();
        restores.push(t0.elapsed());
        assert_eq!(output(r.as_ref(), "cat /workspace/state.txt").await, "kept");
        first_outputs.push(t0.elapsed());
        r.destroy().await.unwrap();
    }

    // Memory per live sandbox: fresh boots, starts from the boot snapshot, restores of one
    // snapshot (the last two map one memory file copy-on-write).
    let mut rows = Vec::new();
    for (what, from) in [
        ("booted", 0),
        ("started from the boot snapshot", 1),
        ("restored from one snapshot", 2),
    ] {
        let before = pss();
        let mut live = Vec::new();
        for _ in 0..LIVE {
            let s = match from {
                0 => cold.create(&spec(), none()).await.unwrap(),
                1 => b.create(&spec(), none()).await.unwrap(),
                _ => b.restore(&store, &snap, none()).await.unwrap(),
            };
            output(s.as_ref(), "true").await;
            live.push(s);
        }
        rows.push((what, before, pss()));
        for s in live.drain(..) {
            s.destroy().await.unwrap();
        }
    }
    let per = |after: u64, before: u64| after.saturating_sub(before) as f64 / LIVE as f64 / 1024.0;

    println!("\nmicroVM tier on this host ({}):", probe.reason);
    println!("| figure | measured | Firecracker (published) | target |");
    println!("|---|---|---|---|");
    println!(
        "| boot to agent ready (create, 256 MiB, median of {ROUNDS}) | {} (kernel + agent: {}) | ≤ 125 ms from InstanceStart to `/sbin/init` | ≤ 150 ms |",
        ms(median(boots)),
        if runtime.is_empty() {
            "n/a".to_string()
        } else {
            ms(median(runtime))
        }
    );
    println!(
        "| start from the boot snapshot (create, median of {ROUNDS}) / to the first command's output | {} / {} | | ≤ 10 ms to the output |",
        ms(median(warm_creates)),
        ms(median(warm_outputs))
    );
    println!(
        "| exec `true` round trip (median of {EXECS}) | {} | | |",
        ms(median(execs))
    );
    println!(
        "| restore (median of {ROUNDS}) / to the first command's output | {} / {} | | ≤ 10 ms to the output |",
        ms(median(restores)),
        ms(median(first_outputs))
    );
    for (what, before, after) in rows {
        println!(
            "| PSS per live sandbox, {LIVE} {what} | {:.1} MiB (anonymous: {:.1} MiB) | VMM overhead ≤ 5 MiB | VMM ≤ 5 MiB; guest memory shared copy-on-write from a snapshot |",
            per(after.0, before.0),
            per(after.1, before.1)
        );
    }
}
