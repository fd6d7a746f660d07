//! WASI preview-1 command modules: one fresh instance per run, from a process-wide cache of
//! compiled modules (keyed by content hash) pre-linked with `InstancePre`.

use std::sync::Arc;

use sandbox_core::{LimitKind, OutputBuffer, Result};

use crate::engine::{self, Flavor};
use crate::host::{self, CallLimits, Preopen, Stop, StoreSetup};
use crate::stream::Taps;
use crate::tools::ToolBox;

/// Largest module accepted, bytes.
pub(crate) const MAX_MODULE_BYTES: usize = 256 << 20;

/// One module run.
pub(crate) struct ModuleRun {
    pub(crate) flavor: Flavor,
    pub(crate) bytes: Vec<u8>,
    pub(crate) argv: Vec<String>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) preopens: Vec<Preopen>,
    pub(crate) stdin: Vec<u8>,
    pub(crate) output_cap: u64,
    pub(crate) memory_cap: u64,
    pub(crate) open_files: u32,
    pub(crate) tools: Option<Arc<ToolBox>>,
    pub(crate) limits: CallLimits,
    /// Keeps the sandbox folders alive (and unrecycled) while the run holds them.
    pub(crate) scratch: Arc<crate::scratch::Scratch>,
    /// Where stdout/stderr also go as written (a streamed call).
    pub(crate) taps: Option<Taps>,
}

/// What a run produced.
pub(crate) struct ModuleOutcome {
    pub(crate) exit_code: Option<i32>,
    pub(crate) limit: Option<LimitKind>,
    pub(crate) stdout: OutputBuffer,
    pub(crate) stderr: OutputBuffer,
    pub(crate) note: Option<String>,
}

fn refused(cap: u64, code: i32, msg: String) -> ModuleOutcome {
    ModuleOutcome {
        exit_code: Some(code),
        limit: None,
        stdout: OutputBuffer::new(cap),
        stderr: OutputBuffer::new(cap),
        note: Some(msg),
    }
}

/// Runs a module to completion. Blocking: call on a guest thread.
pub(crate) fn run(r: ModuleRun) -> Result<ModuleOutcome> {
    if r.bytes.len() > MAX_MODULE_BYTES {
        return Ok(refused(
            r.output_cap,
            126,
            format!("module is larger than {MAX_MODULE_BYTES} bytes"),
        ));
    }
    let pre = match engine::user_module(r.flavor, &r.bytes)? {
        Ok(p) => p,
        Err(msg) => return Ok(refused(r.output_cap, 126, msg)),
    };
    let mut store = host::new_store(StoreSetup {
        flavor: r.flavor,
        args: r.argv,
        env: r.env,
        preopens: r.preopens,
        output_cap: r.output_cap,
        memory_cap: r.memory_cap,
        open_files: r.open_files,
        tools: r.tools,
    })?;
    store.data().stdin.set(r.stdin);
    store.data().set_taps(r.taps.as_ref());
    let guard = host::arm(&mut store, r.limits)?;
    let result = (|| -> wasmtime::Result<Option<i32>> {
        let instance = pre.instantiate(&mut store)?;
        let Ok(start) = instance.get_typed_func::<(), ()>(&mut store, "_start") else {
            return Ok(None);
        };
        start.call(&mut store, ())?;
        Ok(Some(0))
    })();
    drop(guard);
    let h = store.data();
    let (mut exit_code, mut limit, mut note) = (None, None, None);
    match result {
        Ok(Some(code)) => exit_code = Some(code),
        Ok(None) => {
            exit_code = Some(126);
            note = Some("the module has no `_start` export: only WASI commands can run".into());
        }
        Err(e) => match host::classify(&e, h) {
            Stop::Exit(code) => exit_code = Some(code),
            Stop::Limit(kind, what) => {
                limit = Some(kind);
                note = Some(what);
            }
            Stop::Crash(what) => note = Some(what),
        },
    }
    if limit.is_none() && exit_code != Some(0) {
        if h.limiter.memory_denied {
            limit = Some(LimitKind::Memory);
        } else if h.open_files_hit {
            limit = Some(LimitKind::OpenFiles);
        }
    }
    // The streams end here, not when the store is finally dropped.
    h.set_taps(None);
    let outcome = ModuleOutcome {
        exit_code,
        limit,
        stdout: h.stdout.take(0),
        stderr: h.stderr.take(0),
        note,
    };
    // The folders stay held (never recycled) until the store's handles are closed.
    engine::drop_later((store, r.scratch));
    Ok(outcome)
}
