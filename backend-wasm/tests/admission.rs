//! Admission control: a bounded number of guests run at once, the rest wait in a queue that
//! their limits do not count.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use backend_wasm::WasmBackend;
use sandbox_core::{ExecRequest, ExecResult, Phase, Sandbox};

/// How long each guest holds its slot (inside a host tool, on its guest thread).
const HOLD: Duration = Duration::from_millis(300);
/// Concurrent calls: together they hold a slot for `CALLS × HOLD` (1.8 s)...
const CALLS: usize = 6;
/// ...more than each call's own wall limit, so a queued call charged for its wait would be
/// stopped by the limit.
const WALL: Duration = Duration::from_millis(1000);

/// Counts the guests inside the `hold` tool at once, and the most seen. With `gated`, the
/// tool waits for [`Inside::open`] instead of sleeping [`HOLD`].
#[derive(Default)]
struct Inside {
    now: AtomicUsize,
    peak: AtomicUsize,
    gated: bool,
    open: Mutex<bool>,
    cv: Condvar,
}

impl Inside {
    fn gated() -> Arc<Inside> {
        Arc::new(Inside {
            gated: true,
            ..Inside::default()
        })
    }

    fn hold(&self) {
        if self.gated {
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.cv.wait(open).unwrap();
            }
        } else {
            std::thread::sleep(HOLD);
        }
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }
}

fn backend(limit: usize, inside: &Arc<Inside>) -> WasmBackend {
    let inside = Arc::clone(inside);
    WasmBackend::builder()
        .max_running_guests(limit)
        .tool("hold", &[], move |_| {
            let n = inside.now.fetch_add(1, Ordering::SeqCst) + 1;
            inside.peak.fetch_max(n, Ordering::SeqCst);
            inside.hold();
            inside.now.fetch_sub(1, Ordering::SeqCst);
            Ok(serde_json::json!("held"))
        })
        .build()
        .unwrap()
}

/// Runs `code` once in each of `sandboxes`, all at once.
async fn all_at_once(sandboxes: &[Arc<Box<dyn Sandbox>>], code: &str) -> Vec<ExecResult> {
    let mut set = tokio::task::JoinSet::new();
    for sb in sandboxes {
        let (sb, code) = (Arc::clone(sb), code.to_string());
        set.spawn(async move { sb.exec(ExecRequest::code(code).timeout(WALL)).await });
    }
    let mut out = Vec::new();
    while let Some(r) = set.join_next().await {
        out.push(r.unwrap().unwrap());
    }
    out
}

async fn js_sandboxes(b: &WasmBackend) -> Vec<Arc<Box<dyn Sandbox>>> {
    let mut v = Vec::new();
    for _ in 0..CALLS {
        v.push(Arc::new(common::js(b).await));
    }
    v
}

fn queue_wait(r: &ExecResult) -> Duration {
    r.timeline.get(Phase::Queue).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_one_runs_one_guest_at_a_time_and_charges_no_wait() {
    let inside = Arc::new(Inside::default());
    let b = backend(1, &inside);
    assert_eq!(b.max_running_guests(), Some(1));
    let sbs = js_sandboxes(&b).await;
    let results = all_at_once(&sbs, "tools.hold()").await;
    for r in &results {
        assert!(r.success(), "a queued call must not fail: {r:?}");
        assert_eq!(r.limit, None, "{r:?}");
        assert_eq!(r.value.as_deref(), Some("\"held\""), "{r:?}");
    }
    assert_eq!(
        inside.peak.load(Ordering::SeqCst),
        1,
        "two guests ran at once"
    );
    // Someone waited for the one slot, and it says so in its timeline.
    assert!(
        results.iter().any(|r| !queue_wait(r).is_zero()),
        "{results:?}"
    );
    let s = b.admission_stats();
    assert_eq!((s.running, s.queued, s.peak_running), (0, 0, 1), "{s:?}");
    assert!(s.waited >= 1, "{s:?}");
    // Clones share the slots.
    assert_eq!(b.clone().admission_stats().admitted, s.admitted);
}

/// The same load without a limit overlaps: what the test above detects is real.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_limit_the_same_guests_overlap() {
    let inside = Arc::new(Inside::default());
    let b = backend(0, &inside);
    assert_eq!(b.max_running_guests(), None);
    let sbs = js_sandboxes(&b).await;
    let results = all_at_once(&sbs, "tools.hold()").await;
    assert!(results.iter().all(ExecResult::success), "{results:?}");
    assert!(inside.peak.load(Ordering::SeqCst) > 1);
    assert!(b.admission_stats().peak_running > 1);
}

/// Python turns and interpreter starts go through the same queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_turns_queue_too() {
    let _ = python_or_skip!();
    let inside = Arc::new(Inside::default());
    let b = backend(1, &inside);
    let mut sbs = Vec::new();
    for _ in 0..3 {
        sbs.push(Arc::new(common::py(&b).await));
    }
    let results = all_at_once(&sbs, "from host import tools\ntools.hold()").await;
    for r in &results {
        assert!(r.success(), "{r:?}");
        assert_eq!(r.value.as_deref(), Some("\"held\""), "{r:?}");
    }
    assert_eq!(inside.peak.load(Ordering::SeqCst), 1);
    assert!(results.iter().any(|r| !queue_wait(r).is_zero()));
    assert_eq!(b.admission_stats().peak_running, 1);
}

/// A WASI module run is admitted as well: while the one slot is held by a guest, a module
/// waits in the queue, then runs to completion once the slot is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_runs_wait_for_a_slot() {
    let inside = Inside::gated();
    let b = backend(1, &inside);
    let js = Arc::new(common::js(&b).await);
    let holder = {
        let js = Arc::clone(&js);
        tokio::spawn(async move { js.exec(ExecRequest::code("tools.hold()")).await })
    };
    while inside.now.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let wat = r#"(module
        (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
        (memory (export "memory") 1)
        (func (export "_start") (call $exit (i32.const 7))))"#;
    let m = common::sandbox(
        &b,
        sandbox_core::SandboxSpec::new(sandbox_core::Language::Wasm),
    )
    .await;
    let module = tokio::spawn(async move { m.exec(ExecRequest::code(wat).timeout(WALL)).await });
    while b.admission_stats().queued == 0 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        b.admission_stats().running,
        1,
        "the holder runs, the module waits"
    );
    inside.open();
    let r = module.await.unwrap().unwrap();
    assert_eq!(r.exit_code, Some(7), "{r:?}");
    assert!(!queue_wait(&r).is_zero(), "{r:?}");
    assert!(holder.await.unwrap().unwrap().success());
    let s = b.admission_stats();
    assert_eq!((s.peak_running, s.waited), (1, 1), "{s:?}");
}
