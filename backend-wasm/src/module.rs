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
    /// The cap of those folders (`limits.disk_bytes`).
    pub(crate) disk_cap: u64,
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

/// Whether `bytes` is a WebAssembly component (binary: the `\0asm` magic with the
/// component layer; text: a `(component` form) rather than a core module. Components are
/// not run: our limits (output caps, open files, preopen rules) are enforced by our own
/// preview-1 functions, which WASI 0.2's resource-based streams would each need again.
pub(crate) fn is_component(bytes: &[u8]) -> bool {
    if bytes.starts_with(b"\0asm") {
        return bytes.get(6..8) == Some(&[0x01, 0x00]);
    }
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(4096)]);
    let mut rest = text.trim_start();
    // Skip leading `;;` line comments and `(; ;)` block comments.
    loop {
        if let Some(r) = rest.strip_prefix(";;") {
            rest = r.split_once('\n').map_or("", |(_, r)| r).trim_start();
        } else if let Some(r) = rest.strip_prefix("(;") {
            rest = r.split_once(";)").map_or("", |(_, r)| r).trim_start();
        } else {
            break;
        }
    }
    rest.strip_prefix('(')
        .is_some_and(|r| r.trim_start().starts_with("component"))
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
    // Unmetered modules run from the pool when they fit it and a slot is free.
    let mut flavor = match r.flavor {
        Flavor::Plain => Flavor::Pooled,
        f => f,
    };
    let (mut store, instance, guard) = loop {
        let pre = match engine::user_module(flavor, &r.bytes) {
            Ok(Ok(p)) => p,
            // The pooled engine also refuses modules its slots cannot hold (e.g. two
            // memories: wasmtime checks that when it compiles), and may not exist (a host
            // that refuses its address-space reservation, e.g. under RLIMIT_AS): the plain
            // engine then decides.
            Ok(Err(_)) | Err(_) if flavor == Flavor::Pooled => {
                flavor = Flavor::Plain;
                continue;
            }
            Ok(Err(msg)) => return Ok(refused(r.output_cap, 126, msg)),
            Err(e) => return Err(e),
        };
        let mut store = host::new_store(StoreSetup {
            flavor,
            args: r.argv.clone(),
            env: r.env.clone(),
            preopens: r.preopens.clone(),
            output_cap: r.output_cap,
            memory_cap: r.memory_cap,
            open_files: r.open_files,
            tools: r.tools.clone(),
            disk: crate::disk::DiskQuota::new(r.scratch.root().to_path_buf(), r.disk_cap),
        })?;
        store.data().stdin.set(r.stdin.clone());
        store.data().set_taps(r.taps.as_ref());
        let guard = host::arm(&mut store, r.limits)?;
        let instance = pre.instantiate(&mut store);
        if flavor == Flavor::Pooled && instance.as_ref().is_err_and(engine::pool_exhausted) {
            // Every pool slot is busy: this one runs on the plain engine.
            drop(guard);
            engine::drop_after_reply(store);
            flavor = Flavor::Plain;
            continue;
        }
        break (store, instance, guard);
    };
    let result = (|| -> wasmtime::Result<Option<i32>> {
        let instance = instance?;
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
        } else if h.disk.hit {
            limit = Some(LimitKind::Disk);
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
    // The folders stay held (never recycled) until the store's handles are closed. A pooled
    // store is cheap to drop (its slot is reset in place): right after the reply; a plain
    // one unmaps its memory: on the janitor.
    if flavor == Flavor::Pooled {
        engine::drop_after_reply((store, r.scratch));
    } else {
        engine::drop_later((store, r.scratch));
    }
    Ok(outcome)
}

#[cfg(test)]
mod component_tests {
    use super::is_component;

    #[test]
    fn components_are_told_apart_from_core_modules() {
        // Core module: version 1, layer 0. Component: version 0x0d, layer 1.
        assert!(!is_component(b"\0asm\x01\x00\x00\x00"));
        assert!(is_component(b"\0asm\x0d\x00\x01\x00"));
        assert!(!is_component(b"(module)"));
        assert!(is_component(b"  ;; a comment\n (; block ;) ( component)"));
        assert!(!is_component(b""));
    }
}
