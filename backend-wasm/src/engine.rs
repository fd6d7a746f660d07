//! The process-wide wasmtime engines, the epoch ticker, the compiled-module cache and the
//! guest threads every guest (wasm or JavaScript) runs on.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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

/// The two engine flavours: fuel metering changes the generated code, so a metered run
/// needs its own engine (and its own compiled modules).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Flavor {
    /// No fuel metering (the fast path).
    Plain,
    /// Fuel metering on (`limits.fuel` set).
    Fuel,
}

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
    c
}

struct Engines {
    plain: Engine,
    fuel: OnceLock<std::result::Result<Engine, String>>,
}

static ENGINES: OnceLock<std::result::Result<Engines, String>> = OnceLock::new();

fn engines() -> Result<&'static Engines> {
    let e = ENGINES.get_or_init(|| {
        let plain = Engine::new(&config(Flavor::Plain)).map_err(|e| format!("{e:#}"))?;
        start_ticker();
        Ok(Engines {
            plain,
            fuel: OnceLock::new(),
        })
    });
    e.as_ref().map_err(|msg| Error::Unavailable {
        tier: TIER,
        reason: format!("wasmtime engine could not be created: {msg}"),
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
            .get_or_init(|| Engine::new(&config(Flavor::Fuel)).map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|msg| Error::backend(TIER, format!("fuel engine: {msg}"))),
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
                    if let Some(Ok(f)) = es.fuel.get() {
                        f.increment_epoch();
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

type Job = Box<dyn FnOnce() + Send + 'static>;

struct GuestPool {
    tx: Mutex<mpsc::Sender<Job>>,
    rx: Arc<Mutex<mpsc::Receiver<Job>>>,
    /// Idle threads not yet claimed by a submitter.
    idle: AtomicUsize,
}

static POOL: OnceLock<GuestPool> = OnceLock::new();
const IDLE_EXIT: Duration = Duration::from_secs(30);

fn pool() -> &'static GuestPool {
    POOL.get_or_init(|| {
        let (tx, rx) = mpsc::channel();
        GuestPool {
            tx: Mutex::new(tx),
            rx: Arc::new(Mutex::new(rx)),
            idle: AtomicUsize::new(0),
        }
    })
}

fn claim_idle(idle: &AtomicUsize) -> bool {
    idle.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

fn worker_loop(first: Option<Job>) {
    if let Some(job) = first {
        run_job(job);
    }
    let p = pool();
    loop {
        p.idle.fetch_add(1, Ordering::SeqCst);
        loop {
            let next = {
                let rx = match p.rx.lock() {
                    Ok(g) => g,
                    Err(e) => e.into_inner(),
                };
                rx.recv_timeout(IDLE_EXIT)
            };
            match next {
                Ok(job) => {
                    run_job(job);
                    break;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    // Leave only if no submitter has counted on this thread.
                    if claim_idle(&p.idle) {
                        return;
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
    }
}

fn run_job(job: Job) {
    // A panic in a guest job must not kill the thread silently: the job's result channel
    // is dropped, which the submitter reports as an error.
    let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
}

/// The channel to the thread that drops stores (`None` if it could not start).
type Dropper = Option<Mutex<mpsc::Sender<Box<dyn Send>>>>;

static DROPPER: OnceLock<Dropper> = OnceLock::new();

/// Drops `v` on a background thread (a store's teardown unmaps its memory: no need to
/// make the caller wait for it). Drops inline if the thread cannot be started.
pub(crate) fn drop_later<T: Send + 'static>(v: T) {
    let tx = DROPPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Box<dyn Send>>();
        std::thread::Builder::new()
            .name("agent-sandbox-drop".into())
            .spawn(move || {
                for v in rx {
                    drop(v);
                }
            })
            .ok()
            .map(|_| Mutex::new(tx))
    });
    if let Some(tx) = tx {
        if let Ok(tx) = tx.lock() {
            let _ = tx.send(Box::new(v));
        }
    }
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
    let p = pool();
    if claim_idle(&p.idle) {
        let tx = match p.tx.lock() {
            Ok(g) => g,
            Err(e) => e.into_inner(),
        };
        return tx
            .send(job)
            .map_err(|_| Error::backend(TIER, "guest thread pool is closed"));
    }
    std::thread::Builder::new()
        .name("agent-sandbox-guest".into())
        .stack_size(GUEST_THREAD_STACK)
        .spawn(move || worker_loop(Some(job)))
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

type LinkerCell = OnceLock<std::result::Result<Linker<Host>, String>>;

fn linker_cell(
    cell: &'static LinkerCell,
    flavor: Flavor,
    build: fn(&Engine) -> wasmtime::Result<Linker<Host>>,
) -> Result<&'static Linker<Host>> {
    let engine = engine(flavor)?;
    cell.get_or_init(|| build(engine).map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(|m| Error::backend(TIER, format!("linker: {m}")))
}

/// The shared (shadowed) linker per flavour, built by `build` once.
pub(crate) fn shared_linker(
    flavor: Flavor,
    build: fn(&Engine) -> wasmtime::Result<Linker<Host>>,
) -> Result<&'static Linker<Host>> {
    static PLAIN: LinkerCell = OnceLock::new();
    static FUEL: LinkerCell = OnceLock::new();
    linker_cell(
        if flavor == Flavor::Plain {
            &PLAIN
        } else {
            &FUEL
        },
        flavor,
        build,
    )
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
}
