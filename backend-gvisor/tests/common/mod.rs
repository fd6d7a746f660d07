//! Shared helpers for the gVisor suites.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use backend_gvisor::GvisorBackend;
use sandbox_core::{Backend, Language, ResolvedSecrets, Sandbox, SandboxSpec};

/// The backend with default settings.
pub fn backend() -> GvisorBackend {
    GvisorBackend::builder().build().unwrap()
}

/// `Some(reason)` when this host cannot run the tier (the test then skips, saying why).
pub async fn skip_reason() -> Option<String> {
    let s = backend().probe().await;
    (!s.available).then(|| {
        format!(
            "gvisor tier unavailable: {} (fix: {})",
            s.reason,
            s.fix.unwrap_or_default()
        )
    })
}

/// Returns early (printing why) when the host cannot run the gVisor tier.
#[macro_export]
macro_rules! require_gvisor {
    () => {
        if let Some(why) = common::skip_reason().await {
            eprintln!("SKIP: {why}");
            return;
        }
    };
}

/// A sandbox of `spec` (panics if creation fails).
pub async fn sandbox(spec: &SandboxSpec) -> Box<dyn Sandbox> {
    backend()
        .create(spec, ResolvedSecrets::none())
        .await
        .unwrap()
}

/// A default Python sandbox.
pub async fn python() -> Box<dyn Sandbox> {
    sandbox(&SandboxSpec::new(Language::Python)).await
}

/// Processes on the host whose command line mentions this sandbox's id.
pub fn host_processes_of(id: &str) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            if String::from_utf8_lossy(&c).contains(id) {
                n += 1;
            }
        }
    }
    n
}

/// cgroup directories (any v1 hierarchy) created for this sandbox.
pub fn cgroups_of(id: &str) -> Vec<String> {
    let mut out = vec![];
    let Ok(ctrls) = std::fs::read_dir("/sys/fs/cgroup") else {
        return out;
    };
    for c in ctrls.flatten() {
        walk(&c.path(), id, 0, &mut out);
    }
    out
}

fn walk(dir: &std::path::Path, id: &str, depth: usize, out: &mut Vec<String>) {
    if depth > 4 {
        return;
    }
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            let p = e.path();
            if p.to_string_lossy().contains(id) {
                out.push(p.display().to_string());
            }
            walk(&p, id, depth + 1, out);
        }
    }
}

/// Mounts of this process that mention `id`.
pub fn mounts_mentioning(id: &str) -> usize {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(id))
        .count()
}
