//! The per-store host state shared by WASI modules and Python: the WASI context, capped
//! output pipes, the resource limiter, the deadline/fuel control, the open-file counter and
//! the `host.call` door. Also the linker (WASI preview 1 with a few shadowed functions).
//!
//! By concern: `pipes` (standard streams), `linker` (the linker and its file shadows),
//! `poll` (sleeps), `door` (`host.call`), `cell` (a Python cell's rich outputs, reported
//! through the door) and `guest` (guest memory, wasmtime-wasi's calls).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_core::{LimitKind, Result};
use wasmtime::{ResourceLimiter, Store, Trap, UpdateDeadline};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::{FsPerms, HostMonotonicClock, I32Exit, WasiCtxBuilder};

use crate::engine::{self, Flavor, TickerGuard};
use crate::stream::Taps;
use crate::tools::ToolBox;

pub(crate) mod cell;
mod door;
mod guest;
mod linker;
mod pipes;
mod poll;

pub(crate) use guest::{call_p1, memory};
pub(crate) use linker::linker;
use pipes::{CappedPipe, SharedInput};

pub(crate) const P1: &str = "wasi_snapshot_preview1";
const ERRNO_FAULT: i32 = 21;
const ERRNO_INVAL: i32 = 28;
const ERRNO_MFILE: i32 = 33;
const ERRNO_NOSPC: i32 = 51;
/// `oflags::creat` of `path_open`.
const OFLAGS_CREAT: i32 = 1;
const ERRNO_NOTSUP: i32 = 58;

/// A monotonic clock whose base we know, so absolute sleeps can be converted.
struct MonoClock(Instant);

impl HostMonotonicClock for MonoClock {
    fn resolution(&self) -> u64 {
        1
    }
    fn now(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

// ---------------------------------------------------------------------------------------
// Limits.

/// Memory and table caps; remembers whether a growth was refused.
pub(crate) struct GuestLimiter {
    memory_cap: usize,
    pub(crate) memory_denied: bool,
}

impl ResourceLimiter for GuestLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_cap {
            self.memory_denied = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 10_000_000)
    }

    fn instances(&self) -> usize {
        4
    }
    fn tables(&self) -> usize {
        64
    }
    fn memories(&self) -> usize {
        4
    }
}

/// Per-call limits: wall deadline, CPU budget, fuel; and which one stopped the call.
pub(crate) struct RunCtl {
    deadline: Instant,
    cpu_deadline: Option<Duration>,
    pub(crate) hit: Option<LimitKind>,
}

impl RunCtl {
    fn idle() -> Self {
        RunCtl {
            deadline: Instant::now() + Duration::from_secs(3600),
            cpu_deadline: None,
            hit: None,
        }
    }

    /// Whether a limit has passed; records which.
    fn check(&mut self) -> bool {
        if Instant::now() >= self.deadline {
            self.hit = Some(LimitKind::WallTime);
            return true;
        }
        if let Some(cpu) = self.cpu_deadline {
            if engine::thread_cpu_time() >= cpu {
                self.hit = Some(LimitKind::CpuTime);
                return true;
            }
        }
        false
    }
}

/// The limits of one call (a module run or a Python turn).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallLimits {
    pub(crate) wall: Duration,
    pub(crate) cpu: Duration,
    pub(crate) fuel: Option<u64>,
}

// ---------------------------------------------------------------------------------------
// Store data.

/// One preopened directory.
#[derive(Debug, Clone)]
pub(crate) struct Preopen {
    pub(crate) host: PathBuf,
    pub(crate) guest: String,
    pub(crate) writable: bool,
    /// `host` opened already, beneath the workspace's handle (a caller-given `cwd`): the
    /// preopen is made from this handle (`/proc/self/fd/N`), not by looking `host` up again,
    /// so a folder swapped for a link after the check is not what the guest gets. `host`
    /// still names it for the disk meter and messages.
    pub(crate) opened: Option<Arc<std::os::fd::OwnedFd>>,
}

/// How to build a store.
pub(crate) struct StoreSetup {
    pub(crate) flavor: Flavor,
    pub(crate) args: Vec<String>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) preopens: Vec<Preopen>,
    pub(crate) output_cap: u64,
    pub(crate) memory_cap: u64,
    pub(crate) open_files: u32,
    pub(crate) tools: Option<Arc<ToolBox>>,
    /// The sandbox's private folders and their cap (`limits.disk_bytes`).
    pub(crate) disk: crate::disk::DiskQuota,
}

/// The data of every guest store.
pub struct Host {
    wasi: WasiP1Ctx,
    pub(crate) limiter: GuestLimiter,
    pub(crate) ctl: RunCtl,
    pub(crate) stdout: CappedPipe,
    pub(crate) stderr: CappedPipe,
    pub(crate) stdin: SharedInput,
    tools: Option<Arc<ToolBox>>,
    /// What a Python cell reported for this call: its echoed value and rich outputs.
    pub(crate) cell: cell::CellSink,
    open_files: u32,
    max_open_files: u32,
    pub(crate) open_files_hit: bool,
    /// fd 1 or 2 was closed or renumbered: stop writing them straight to the pipes.
    stdio_moved: bool,
    /// Writes and creates under the sandbox's private folders are admitted here.
    pub(crate) disk: crate::disk::DiskQuota,
    /// Descriptors of the virtual `/dev` files.
    pub(crate) devices: crate::devices::Devices,
    mono_base: Instant,
    flavor: Flavor,
}

impl Host {
    /// Sets (or removes) the taps of a streamed call on stdout and stderr.
    pub(crate) fn set_taps(&self, taps: Option<&Taps>) {
        self.stdout.set_tap(taps.map(|t| t.out.clone()));
        self.stderr.set_tap(taps.map(|t| t.err.clone()));
    }

    /// Resets the per-call state.
    pub(crate) fn begin_call(&mut self, output_cap: u64) {
        self.ctl.hit = None;
        self.cell.begin(output_cap);
        self.limiter.memory_denied = false;
        self.open_files_hit = false;
        self.disk.hit = false;
        self.stdout.take(output_cap);
        self.stderr.take(output_cap);
    }
}

/// Builds a store for `setup` (no instance yet).
pub(crate) fn new_store(setup: StoreSetup) -> Result<Store<Host>> {
    let engine = engine::engine(setup.flavor)?;
    let stdout = CappedPipe::new(setup.output_cap);
    let stderr = CappedPipe::new(setup.output_cap);
    let stdin = SharedInput::default();
    let mono_base = Instant::now();
    let mut b = WasiCtxBuilder::new();
    b.args(&setup.args)
        .envs(&setup.env)
        .stdin(stdin.clone())
        .stdout(stdout.clone())
        .stderr(stderr.clone())
        .allow_blocking_current_thread(true)
        .monotonic_clock(MonoClock(mono_base))
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false);
    for p in &setup.preopens {
        let perms = if p.writable {
            FsPerms::ReadWrite
        } else {
            FsPerms::ReadOnly
        };
        let from = match &p.opened {
            Some(fd) => PathBuf::from(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(fd.as_ref())
            )),
            None => p.host.clone(),
        };
        b.preopened_dir(&from, &p.guest, perms)
            .map_err(|e| preopen_error(&p.host, &e))?;
    }
    // `/dev/null`, `/dev/zero`, `/dev/urandom`: virtual files (see `devices`).
    let devices = crate::devices::preopen(&mut b, &setup.preopens)?;
    let open = 3
        + u32::try_from(setup.preopens.len()).unwrap_or(u32::MAX)
        + u32::from(devices.dir_fd.is_some());
    // Preopened folders are descriptors 3, 4, ... in order.
    let mut disk = setup.disk;
    for (fd, p) in (3u32..).zip(&setup.preopens) {
        let metered = p.writable && disk.covers(&p.host);
        disk.track(fd, metered);
    }
    let host = Host {
        wasi: b.build_p1(),
        limiter: GuestLimiter {
            memory_cap: usize::try_from(setup.memory_cap).unwrap_or(usize::MAX),
            memory_denied: false,
        },
        ctl: RunCtl::idle(),
        stdout,
        stderr,
        stdin,
        tools: setup.tools,
        devices,
        cell: cell::CellSink::default(),
        open_files: open,
        max_open_files: setup.open_files.max(open),
        open_files_hit: false,
        stdio_moved: false,
        disk,
        mono_base,
        flavor: setup.flavor,
    };
    let mut store = Store::new(engine, host);
    store.limiter(|h| &mut h.limiter);
    store.epoch_deadline_callback(|mut cx| {
        if cx.data_mut().ctl.check() {
            Ok(UpdateDeadline::Interrupt)
        } else {
            Ok(UpdateDeadline::Continue(1))
        }
    });
    store.set_epoch_deadline(1);
    if setup.flavor == Flavor::Fuel {
        store
            .set_fuel(u64::MAX)
            .map_err(|e| wt_err("setting the store's fuel", e))?;
    }
    Ok(store)
}

/// Arms the limits of one call. Keep the returned guard alive while the guest runs: it
/// keeps the epoch ticker going.
pub(crate) fn arm(store: &mut Store<Host>, limits: CallLimits) -> Result<TickerGuard> {
    let guard = TickerGuard::new();
    let now = Instant::now();
    let h = store.data_mut();
    h.ctl.deadline = now + limits.wall;
    h.ctl.cpu_deadline = Some(engine::thread_cpu_time() + limits.cpu);
    h.ctl.hit = None;
    let flavor = h.flavor;
    store.set_epoch_deadline(1);
    if flavor == Flavor::Fuel {
        store
            .set_fuel(limits.fuel.unwrap_or(u64::MAX))
            .map_err(|e| wt_err("setting the call's fuel", e))?;
    }
    Ok(guard)
}

/// Lifts the limits after a call (instantiation and shutdown run without a deadline).
pub(crate) fn disarm(store: &mut Store<Host>) {
    store.data_mut().ctl = RunCtl::idle();
    if store.data().flavor == Flavor::Fuel {
        let _ = store.set_fuel(u64::MAX);
    }
}

/// Why a folder could not be preopened. Out of file descriptors is
/// [`sandbox_core::Error::ResourceExhausted`] with the fix: every live sandbox holds its
/// preopened folders open, so many sandboxes at once can reach `RLIMIT_NOFILE`.
fn preopen_error(host: &std::path::Path, e: &wasmtime::Error) -> sandbox_core::Error {
    let out_of_fds = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error)
            .is_some_and(|n| n == libc::EMFILE || n == libc::ENFILE)
    });
    if out_of_fds {
        return sandbox_core::Error::ResourceExhausted {
            what: format!(
                "file descriptors (preopening {}: {e:#}); each live wasm sandbox holds its \
                 preopened folders open: raise the process's open-file limit (`ulimit -n`) or \
                 destroy idle sandboxes",
                host.display()
            ),
        };
    }
    sandbox_core::Error::io_path("preopen", host, std::io::Error::other(format!("{e:#}")))
}

/// A wasmtime failure while `doing` something, kept as the cause.
pub(crate) fn wt_err(doing: &str, e: wasmtime::Error) -> sandbox_core::Error {
    sandbox_core::Error::backend_caused(sandbox_core::Tier::Wasm, doing, e)
}

// ---------------------------------------------------------------------------------------
// How a guest call ended.

/// The end of a guest call that did not return normally.
#[derive(Debug)]
pub(crate) enum Stop {
    /// `proc_exit(code)`.
    Exit(i32),
    /// A limit stopped it.
    Limit(LimitKind, String),
    /// Any other trap (a crash of the guest).
    Crash(String),
}

/// Classifies a guest call's error.
pub(crate) fn classify(err: &wasmtime::Error, host: &Host) -> Stop {
    if let Some(exit) = err.downcast_ref::<I32Exit>() {
        return Stop::Exit(exit.0);
    }
    if let Some(trap) = err.downcast_ref::<Trap>() {
        match trap {
            Trap::Interrupt => {
                let kind = host.ctl.hit.unwrap_or(LimitKind::WallTime);
                let what = match kind {
                    LimitKind::CpuTime => "CPU time limit reached",
                    _ => "wall time limit reached",
                };
                return Stop::Limit(kind, what.into());
            }
            Trap::OutOfFuel => return Stop::Limit(LimitKind::Fuel, "fuel exhausted".into()),
            _ => {}
        }
        if host.limiter.memory_denied {
            return Stop::Limit(LimitKind::Memory, format!("memory limit reached ({trap})"));
        }
        return Stop::Crash(format!("wasm trap: {trap}"));
    }
    if let Some(kind) = host.ctl.hit {
        return Stop::Limit(kind, format!("{kind} limit reached"));
    }
    if host.limiter.memory_denied {
        return Stop::Limit(LimitKind::Memory, "memory limit reached".into());
    }
    Stop::Crash(format!("{err:#}"))
}
