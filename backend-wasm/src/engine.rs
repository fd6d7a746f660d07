//! The process-wide wasmtime engines, the epoch ticker, the compiled-module cache and the
//! guest threads every guest (wasm or JavaScript) runs on.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
#[cfg(test)]
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use sandbox_core::{Error, Result, Tier};
use sha2::{Digest, Sha256};
use wasmtime::{Config, Engine, InstancePre, Linker, Module};

use crate::host::Host;

/// The wasmtime version this crate is pinned to (see `Cargo.toml`).
pub const WASMTIME_VERSION: &str = "48.0.8";

/// Largest wasm stack a guest may use. `async_stack_size` is set to the same value first:
/// wasmtime refuses a `max_wasm_stack` above it.
pub(crate) const MAX_WASM_STACK: usize = 8 << 20;

/// Native stack of a guest thread: the wasm stack plus room for host frames (WASI calls,
/// host tools, QuickJS's own recursion).
pub(crate) const GUEST_THREAD_STACK: usize = 16 << 20;

/// How often the epoch ticker advances the engines while a guest runs.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Whether copy-on-write memory initialisation is on (it is part of the `.cwasm` key:
/// a serialized module records it).
pub(crate) const MEMORY_INIT_COW: bool = true;

const TIER: Tier = Tier::Wasm;

/// The engine flavours: fuel metering changes the generated code, so a metered run needs
/// its own engine (and its own compiled modules); user WASI modules get an engine with the
/// pooling allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Flavor {
    /// No fuel metering (Python, and modules the pool cannot hold).
    Plain,
    /// Fuel metering on (`limits.fuel` set).
    Fuel,
    /// No fuel metering, instances from wasmtime's pooling allocator: user WASI modules.
    /// A pooled instance reuses a reserved slot (no `mmap`/`mprotect` to create it, no
    /// `munmap` and TLB shootdown to drop it; the first [`POOL_KEEP_RESIDENT`] bytes of its
    /// memory are reset in place), which halves a small module's create-to-output time.
    Pooled,
}

/// Concurrent instances (and memories, tables, GC heaps) the pooled engine holds; one
/// more falls back to the plain engine.
pub(crate) const POOL_SLOTS: u32 = 128;
/// Largest memory a pooled instance may have (the wasm32 maximum).
pub(crate) const POOL_MAX_MEMORY: usize = 1 << 32;
/// Table elements a pooled instance may have.
pub(crate) const POOL_TABLE_ELEMENTS: usize = 64 * 1024;
/// Bytes of a pooled memory reset with `memset` (not decommitted) when its slot is reused.
pub(crate) const POOL_KEEP_RESIDENT: usize = 128 << 10;

impl Flavor {
    pub(crate) fn for_fuel(fuel: Option<u64>) -> Self {
        if fuel.is_some() {
            Flavor::Fuel
        } else {
            Flavor::Plain
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Flavor::Plain => "plain",
            Flavor::Fuel => "fuel",
            Flavor::Pooled => "pooled",
        }
    }
}

/// The settings that shape compiled code, as a stable string (part of cache keys).
pub(crate) fn settings_fingerprint(flavor: Flavor) -> String {
    format!(
        "wasmtime={WASMTIME_VERSION};exceptions=1;epoch=1;fuel={};max_wasm_stack={MAX_WASM_STACK};cow={};opt=speed;arch={}",
        u8::from(flavor == Flavor::Fuel),
        u8::from(MEMORY_INIT_COW),
        std::env::consts::ARCH,
    )
}

/// Whether this process's Cranelift is an unoptimised build (a debug build of the
/// program that links us, without an opt-level override for dependencies), which compiles
/// CPython about ten times slower. Measured once: the thread CPU time of compiling a small
/// generated module ([`calibration_cpu_time`]).
pub(crate) fn compiler_is_unoptimised() -> bool {
    static SLOW: OnceLock<bool> = OnceLock::new();
    *SLOW.get_or_init(|| {
        let cpu = calibration_cpu_time();
        let slow = cpu.is_some_and(|t| t > CALIBRATION_SLOW);
        tracing::debug!(?cpu, slow, "wasmtime compiler speed calibration");
        slow
    })
}

/// Calibration CPU time above which Cranelift counts as unoptimised. Measured on a 2-core
/// x86_64 host: ~20 ms with wasmtime at opt-level 2, ~250 ms at opt-level 0 (a debug
/// build); the threshold sits between them with room for slower and faster machines.
const CALIBRATION_SLOW: Duration = Duration::from_millis(70);

/// The module the calibration compiles: functions with loops, arithmetic, calls, memory
/// traffic and a branch table, like compiled C.
fn calibration_wat() -> String {
    let mut w = String::from("(module (memory 1)\n");
    for i in 0..CALIBRATION_FUNCS {
        w.push_str(&format!(
            "(func $f{i} (export \"f{i}\") (param i32 i32) (result i32) (local i32 i64)
  (loop $l
    (local.set 2 (i32.add (local.get 2) (i32.mul (local.get 0) (i32.const {i}))))
    (local.set 3 (i64.add (local.get 3) (i64.extend_i32_u (local.get 2))))
    (i32.store (i32.and (local.get 2) (i32.const 0xfffc)) (local.get 1))
    (local.set 1 (i32.xor (local.get 1) (i32.load offset=8 (i32.and (local.get 1) (i32.const 0xfff0)))))
    (block $a (block $b (block $c
      (br_table $a $b $c (i32.and (local.get 1) (i32.const 3))))
      (local.set 0 (i32.sub (local.get 0) (i32.const 1))))
      (local.set 0 (i32.shr_u (local.get 0) (i32.const 1))))
    (local.set 0 (i32.sub (local.get 0) (i32.const 1)))
    (br_if $l (i32.gt_s (local.get 0) (i32.const 0))))
  (i32.add (local.get 2) (i32.wrap_i64 (local.get 3)))
  {call})\n",
            call = if i > 0 {
                format!("(drop (call $f{} (local.get 1) (local.get 2)))", i - 1)
            } else {
                String::new()
            }
        ));
    }
    w.push(')');
    w
}

const CALIBRATION_FUNCS: usize = 64;

/// Thread CPU time of compiling a small generated module (64 functions of loops, arithmetic,
/// memory traffic and branch tables) serially with the optimising settings
/// (what tells an unoptimised wasmtime build apart; `None` if it could not be measured).
pub fn calibration_cpu_time() -> Option<Duration> {
    let wat = calibration_wat();
    let bytes = wat::parse_str(&wat).ok()?;
    let mut c = config(Flavor::Plain);
    c.parallel_compilation(false);
    let engine = Engine::new(&c).ok()?;
    let start = thread_cpu_time();
    engine.precompile_module(&bytes).ok()?;
    Some(thread_cpu_time().saturating_sub(start))
}

fn config(flavor: Flavor) -> Config {
    let mut c = Config::new();
    // python.wasm uses the exception-handling proposal (needs the `gc` cargo feature).
    c.wasm_exceptions(true);
    c.epoch_interruption(true);
    c.consume_fuel(flavor == Flavor::Fuel);
    // Order matters: wasmtime refuses max_wasm_stack > async_stack_size.
    c.async_stack_size(MAX_WASM_STACK);
    c.max_wasm_stack(MAX_WASM_STACK);
    c.memory_init_cow(MEMORY_INIT_COW);
    c.cranelift_opt_level(wasmtime::OptLevel::Speed);
    c.parallel_compilation(true);
    if flavor == Flavor::Pooled {
        let mut p = wasmtime::PoolingAllocationConfig::new();
        p.total_core_instances(POOL_SLOTS)
            .total_memories(POOL_SLOTS)
            .total_tables(POOL_SLOTS)
            .total_gc_heaps(POOL_SLOTS)
            .max_memory_size(POOL_MAX_MEMORY)
            .table_elements(POOL_TABLE_ELEMENTS)
            .linear_memory_keep_resident(POOL_KEEP_RESIDENT)
            .table_keep_resident(16 << 10);
        c.allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(p));
    }
    c
}

/// Whether instantiation failed because every pool slot is in use.
pub(crate) fn pool_exhausted(e: &wasmtime::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<wasmtime::PoolConcurrencyLimitError>()
            .is_some()
    })
}

/// A wasmtime failure kept by a process-wide cache (an engine or a linker that could not
/// be built): every later caller gets the same error, so it is shared.
///
/// Its message is the whole chain (`{:#}`), as before; its source is the wasmtime error,
/// so code that needs a cause's type can walk the chain.
#[derive(Debug, Clone)]
pub(crate) struct CachedError(Arc<wasmtime::Error>);

impl CachedError {
    fn new(e: wasmtime::Error) -> Self {
        CachedError(Arc::new(e))
    }
}

impl std::fmt::Display for CachedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for CachedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        let inner: &(dyn std::error::Error + 'static) = (*self.0).as_ref();
        inner.source()
    }
}

type Cached<T> = std::result::Result<T, CachedError>;

struct Engines {
    plain: Engine,
    fuel: OnceLock<Cached<Engine>>,
    pooled: OnceLock<Cached<Engine>>,
}

static ENGINES: OnceLock<Cached<Engines>> = OnceLock::new();

fn engines() -> Result<&'static Engines> {
    let e = ENGINES.get_or_init(|| {
        let plain = Engine::new(&config(Flavor::Plain)).map_err(CachedError::new)?;
        start_ticker();
        Ok(Engines {
            plain,
            fuel: OnceLock::new(),
            pooled: OnceLock::new(),
        })
    });
    // `Unavailable` has no source: the cause's text is its reason.
    e.as_ref().map_err(|cause| Error::Unavailable {
        tier: TIER,
        reason: format!("wasmtime engine could not be created: {cause}"),
        fix: "run on x86_64 or aarch64 Linux with virtual memory for wasm guard pages".into(),
    })
}

/// The shared engine of `flavor`, created on first use.
pub(crate) fn engine(flavor: Flavor) -> Result<&'static Engine> {
    let es = engines()?;
    match flavor {
        Flavor::Plain => Ok(&es.plain),
        Flavor::Fuel => es
            .fuel
            .get_or_init(|| Engine::new(&config(Flavor::Fuel)).map_err(CachedError::new))
            .as_ref()
            .map_err(|cause| Error::backend_caused(TIER, "fuel engine", cause.clone())),
        Flavor::Pooled => es
            .pooled
            .get_or_init(|| Engine::new(&config(Flavor::Pooled)).map_err(CachedError::new))
            .as_ref()
            .map_err(|cause| Error::backend_caused(TIER, "pooled engine", cause.clone())),
    }
}

// ---------------------------------------------------------------------------------------
// Epoch ticker: one thread per process, asleep while no guest runs.

static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Whether the ticker is asleep on `WAKE` (only then does a new guest notify it).
static PARKED: AtomicBool = AtomicBool::new(false);
static WAKE: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());
/// Ticks the ticker keeps going after the last guest finished, so back-to-back calls do
/// not pay a thread wake-up each.
const IDLE_TICKS: u32 = 100;

fn start_ticker() {
    let spawned = std::thread::Builder::new()
        .name("agent-sandbox-epoch".into())
        .spawn(|| {
            let mut idle = 0u32;
            loop {
                if ACTIVE.load(Ordering::SeqCst) == 0 {
                    idle += 1;
                } else {
                    idle = 0;
                }
                if idle > IDLE_TICKS {
                    let mut g = match WAKE.0.lock() {
                        Ok(g) => g,
                        Err(p) => p.into_inner(),
                    };
                    PARKED.store(true, Ordering::SeqCst);
                    while ACTIVE.load(Ordering::SeqCst) == 0 {
                        g = match WAKE.1.wait(g) {
                            Ok(g) => g,
                            Err(p) => p.into_inner(),
                        };
                    }
                    PARKED.store(false, Ordering::SeqCst);
                    idle = 0;
                }
                std::thread::sleep(EPOCH_TICK);
                if let Some(Ok(es)) = ENGINES.get() {
                    es.plain.increment_epoch();
                    for e in [&es.fuel, &es.pooled] {
                        if let Some(Ok(e)) = e.get() {
                            e.increment_epoch();
                        }
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the epoch ticker thread: {e}; wall limits rely on it");
    }
}

/// Keeps the epoch ticker running while alive (one per running guest call).
pub(crate) struct TickerGuard(());

impl TickerGuard {
    pub(crate) fn new() -> Self {
        ACTIVE.fetch_add(1, Ordering::SeqCst);
        if PARKED.load(Ordering::SeqCst) {
            let _g = WAKE.0.lock();
            WAKE.1.notify_all();
        }
        TickerGuard(())
    }
}

impl Drop for TickerGuard {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------------------------------
// Guest threads: a cached pool of threads with a large native stack.
//
// Each idle thread waits on its own slot; a submitter takes an idle thread off the stack
// and hands it the job directly (one lock, one wake-up), so there is no shared queue to
// contend on. (Spinning for the next job before sleeping was tried: on 2 cores it starved
// the caller and the janitor, and made calls slower.)

type Job = Box<dyn FnOnce() + Send + 'static>;

/// One guest thread's mailbox.
struct Slot {
    job: Mutex<Option<Job>>,
    cv: Condvar,
}

/// Idle guest threads, most recently used last (its stack and caches are warm).
static IDLE: Mutex<Vec<Arc<Slot>>> = Mutex::new(Vec::new());
const IDLE_EXIT: Duration = Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Slot {
    fn give(&self, job: Job) {
        let mut g = lock(&self.job);
        *g = Some(job);
        drop(g);
        self.cv.notify_one();
    }

    /// Waits for a job; `None` after `IDLE_EXIT` without one (and no submitter holds us).
    fn wait(self: &Arc<Self>) -> Option<Job> {
        let mut g = lock(&self.job);
        loop {
            if let Some(job) = g.take() {
                return Some(job);
            }
            let (next, timeout) = match self.cv.wait_timeout(g, IDLE_EXIT) {
                Ok(r) => r,
                Err(p) => p.into_inner(),
            };
            g = next;
            if timeout.timed_out() && g.is_none() {
                // Leave only if no submitter has taken this thread off the idle stack.
                let mut idle = lock(&IDLE);
                if let Some(i) = idle.iter().position(|s| Arc::ptr_eq(s, self)) {
                    idle.remove(i);
                    return None;
                }
            }
        }
    }
}

thread_local! {
    /// What the current guest job handed to [`drop_after_reply`]; `None` off guest threads.
    static AFTER_REPLY: std::cell::RefCell<Option<Vec<Box<dyn Send>>>> =
        const { std::cell::RefCell::new(None) };
}

/// Drops `v` on this guest thread once its job has sent its reply (a pooled store: cheap to
/// drop, but not on the caller's clock), or on the janitor off a guest thread.
pub(crate) fn drop_after_reply<T: Send + 'static>(v: T) {
    let mut v = Some(v);
    AFTER_REPLY.with(|a| {
        if let Some(list) = a.borrow_mut().as_mut() {
            if let Some(v) = v.take() {
                list.push(Box::new(v));
            }
        }
    });
    if let Some(v) = v {
        drop_later(v);
    }
}

fn worker_loop(first: Job) {
    AFTER_REPLY.with(|a| *a.borrow_mut() = Some(Vec::new()));
    run_job(first);
    let slot = Arc::new(Slot {
        job: Mutex::new(None),
        cv: Condvar::new(),
    });
    loop {
        lock(&IDLE).push(Arc::clone(&slot));
        match slot.wait() {
            Some(job) => run_job(job),
            None => return,
        }
    }
}

fn run_job(job: Job) {
    // A panic in a guest job must not kill the thread silently: the job's result channel
    // is dropped, which the submitter reports as an error.
    let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
    let later = AFTER_REPLY.with(|a| a.borrow_mut().as_mut().map(std::mem::take));
    for item in later.into_iter().flatten() {
        let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(item)));
    }
}

// ---------------------------------------------------------------------------------------
// The janitor: one background thread that drops what the hot path hands it (stores,
// interpreters, released sandbox folders) in batches. Handing something over is a push
// under a lock; the thread is woken only when it sleeps (after ~10 ms without work), so a
// burst of calls costs no wake-ups.

struct Janitor {
    items: Vec<Box<dyn Send>>,
    sleeping: bool,
}

static JANITOR: Mutex<Janitor> = Mutex::new(Janitor {
    items: Vec::new(),
    sleeping: false,
});
static JANITOR_WAKE: Condvar = Condvar::new();
static JANITOR_STARTED: OnceLock<bool> = OnceLock::new();
/// How often the janitor looks for work while busy.
const JANITOR_PERIOD: Duration = Duration::from_millis(1);
/// Empty rounds before it sleeps until woken.
const JANITOR_IDLE_ROUNDS: u32 = 10;

fn janitor_loop() {
    let mut idle = 0u32;
    loop {
        let batch = {
            let mut j = lock(&JANITOR);
            if j.items.is_empty() && idle >= JANITOR_IDLE_ROUNDS {
                j.sleeping = true;
                while j.items.is_empty() {
                    j = match JANITOR_WAKE.wait(j) {
                        Ok(g) => g,
                        Err(p) => p.into_inner(),
                    };
                }
                j.sleeping = false;
                idle = 0;
            }
            std::mem::take(&mut j.items)
        };
        if batch.is_empty() {
            idle += 1;
        } else {
            idle = 0;
        }
        // Dropped outside the lock: a drop may hand over more (a folder to recycle).
        for item in batch {
            let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(item)));
        }
        std::thread::sleep(JANITOR_PERIOD);
    }
}

/// Drops `v` on the janitor thread (a store's teardown unmaps its memory, a QuickJS
/// runtime's runs a GC: no need to make the caller wait). Drops inline if the thread
/// cannot be started or already has [`JANITOR_BACKLOG`] items waiting.
pub(crate) fn drop_later<T: Send + 'static>(v: T) {
    let started = *JANITOR_STARTED.get_or_init(|| {
        std::thread::Builder::new()
            .name("agent-sandbox-janitor".into())
            .spawn(janitor_loop)
            .is_ok()
    });
    if !started {
        drop(v);
        return;
    }
    let (wake, inline) = {
        let mut j = lock(&JANITOR);
        if j.items.len() >= JANITOR_BACKLOG {
            (true, Some(v))
        } else {
            j.items.push(Box::new(v));
            (j.sleeping, None)
        }
    };
    if wake {
        JANITOR_WAKE.notify_one();
    }
    // Backpressure: a caller that releases faster than the janitor keeps up pays for its own
    // drops, so the backlog (memory, folders left if the process exits) stays bounded.
    drop(inline);
}

/// Most items waiting for the janitor before callers drop inline.
const JANITOR_BACKLOG: usize = 256;

/// Waits until everything handed to [`drop_later`] so far has been dropped (tests).
#[cfg(test)]
pub(crate) fn flush_drops() {
    struct Marker(mpsc::Sender<()>);
    impl Drop for Marker {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }
    let (tx, rx) = mpsc::channel();
    drop_later(Marker(tx));
    let _ = rx.recv();
}

/// Runs `f` on a guest thread (16 MiB native stack) and awaits its result.
pub(crate) async fn on_guest_thread<R, F>(f: F) -> Result<R>
where
    R: Send + 'static,
    F: FnOnce() -> R + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        let _ = tx.send(f());
    });
    submit(job)?;
    rx.await
        .map_err(|_| Error::backend(TIER, "the guest thread panicked (a bug in backend-wasm)"))
}

/// Same as [`on_guest_thread`] but blocking the calling (non-async) thread.
#[cfg(test)]
pub(crate) fn on_guest_thread_blocking<R, F>(f: F) -> Result<R>
where
    R: Send + 'static,
    F: FnOnce() -> R + Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let job: Job = Box::new(move || {
        let _ = tx.send(f());
    });
    submit(job)?;
    rx.recv()
        .map_err(|_| Error::backend(TIER, "the guest thread panicked (a bug in backend-wasm)"))
}

fn submit(job: Job) -> Result<()> {
    let idle = lock(&IDLE).pop();
    if let Some(slot) = idle {
        slot.give(job);
        return Ok(());
    }
    std::thread::Builder::new()
        .name("agent-sandbox-guest".into())
        .stack_size(GUEST_THREAD_STACK)
        .spawn(move || worker_loop(job))
        .map(|_| ())
        .map_err(|e| Error::ResourceExhausted {
            what: format!("guest thread: {e}"),
        })
}

// ---------------------------------------------------------------------------------------
// Compiled user modules, shared process-wide, keyed by content hash and flavour.

const MODULE_CACHE_MAX: usize = 64;

type ModuleKey = (Flavor, [u8; 32]);

static MODULES: OnceLock<Mutex<HashMap<ModuleKey, InstancePre<Host>>>> = OnceLock::new();

/// The SHA-256 of `bytes`.
pub(crate) fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Compiles (or finds) a user module and pre-instantiates it against the WASI linker.
/// `Err(String)` is the guest's fault (bad module, unknown import): reported as exit 126.
pub(crate) fn user_module(
    flavor: Flavor,
    bytes: &[u8],
) -> Result<std::result::Result<InstancePre<Host>, String>> {
    let key = (flavor, sha256(bytes));
    let cache = MODULES.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(pre) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(Ok(pre));
    }
    let engine = engine(flavor)?;
    let module = match Module::new(engine, bytes) {
        Ok(m) => m,
        Err(e) => return Ok(Err(format!("not a valid WebAssembly module: {e:#}"))),
    };
    let linker = crate::host::linker(flavor)?;
    let pre = match linker.instantiate_pre(&module) {
        Ok(p) => p,
        Err(e) => return Ok(Err(format!("module cannot be linked: {e:#}"))),
    };
    if let Ok(mut c) = cache.lock() {
        if c.len() >= MODULE_CACHE_MAX {
            c.clear();
        }
        c.insert(key, pre.clone());
    }
    Ok(Ok(pre))
}

type LinkerCell = OnceLock<Cached<Linker<Host>>>;

fn linker_cell(
    cell: &'static LinkerCell,
    flavor: Flavor,
    build: fn(&Engine) -> wasmtime::Result<Linker<Host>>,
) -> Result<&'static Linker<Host>> {
    let engine = engine(flavor)?;
    cell.get_or_init(|| build(engine).map_err(CachedError::new))
        .as_ref()
        .map_err(|cause| Error::backend_caused(TIER, "linker", cause.clone()))
}

/// The shared (shadowed) linker per flavour, built by `build` once.
pub(crate) fn shared_linker(
    flavor: Flavor,
    build: fn(&Engine) -> wasmtime::Result<Linker<Host>>,
) -> Result<&'static Linker<Host>> {
    static PLAIN: LinkerCell = OnceLock::new();
    static FUEL: LinkerCell = OnceLock::new();
    static POOLED: LinkerCell = OnceLock::new();
    let cell = match flavor {
        Flavor::Plain => &PLAIN,
        Flavor::Fuel => &FUEL,
        Flavor::Pooled => &POOLED,
    };
    linker_cell(cell, flavor, build)
}

/// CPU time consumed by the calling thread.
pub(crate) fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID needs nothing else.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_build_and_threads_have_big_stacks() {
        engine(Flavor::Plain).unwrap();
        engine(Flavor::Fuel).unwrap();
        engine(Flavor::Pooled).unwrap();
        // Recursing over 3 MiB deep would overflow a default 2 MiB thread.
        let depth = on_guest_thread_blocking(|| {
            fn rec(n: usize) -> usize {
                let buf = [n as u8; 1024];
                if n == 0 {
                    usize::from(buf[0])
                } else {
                    rec(n - 1) + usize::from(std::hint::black_box(buf)[1] > 0)
                }
            }
            rec(3 * 1024)
        })
        .unwrap();
        assert!(depth > 0);
    }

    #[test]
    fn fingerprint_names_flavor_and_cow() {
        assert!(settings_fingerprint(Flavor::Fuel).contains("fuel=1"));
        assert!(settings_fingerprint(Flavor::Plain).contains("cow=1"));
    }

    #[test]
    fn calibration_compiles() {
        let t = calibration_cpu_time().unwrap();
        eprintln!(
            "calibration: {t:?}, unoptimised: {}",
            compiler_is_unoptimised()
        );
    }
}
