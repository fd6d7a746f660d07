//! JavaScript in QuickJS (rquickjs): one runtime and context per session, `console`
//! captured into capped buffers, registered host tools, a memory limit and an interrupt
//! handler enforcing the wall deadline and CPU budget.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rquickjs::function::Rest;
use rquickjs::{CaughtError, Context, Ctx, Function, Object, Runtime, Value};
use sandbox_core::{Error, LimitKind, OutputBuffer, Result, Tier};

use crate::engine;
use crate::stream::Taps;
use crate::tools::ToolBox;

const TIER: Tier = Tier::Wasm;
/// QuickJS's own stack cap (the guest thread has 16 MiB).
const JS_STACK: usize = 4 << 20;

/// Deadline and CPU budget shared with the interrupt handler.
struct Ctl {
    base: Instant,
    /// Deadline in nanoseconds since `base`; `u64::MAX` when idle.
    deadline_ns: AtomicU64,
    /// Thread-CPU deadline in nanoseconds; `u64::MAX` when none.
    cpu_deadline_ns: AtomicU64,
    /// 0: none, 1: wall, 2: cpu, 3: output (a flood, flagged by `console`).
    hit: AtomicU32,
    calls: AtomicU32,
}

impl Ctl {
    fn interrupt(&self) -> bool {
        if self.hit.load(Ordering::Relaxed) == 3 {
            return true;
        }
        let now = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if now >= self.deadline_ns.load(Ordering::Relaxed) {
            self.hit.store(1, Ordering::Relaxed);
            return true;
        }
        // Thread CPU time is a syscall: check it every 64th call.
        if self
            .calls
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(64)
        {
            let cpu = u64::try_from(engine::thread_cpu_time().as_nanos()).unwrap_or(u64::MAX);
            if cpu >= self.cpu_deadline_ns.load(Ordering::Relaxed) {
                self.hit.store(2, Ordering::Relaxed);
                return true;
            }
        }
        false
    }
}

struct Io {
    out: OutputBuffer,
    err: OutputBuffer,
    /// Where console output also goes as written (a streamed call).
    taps: Option<Taps>,
}

/// One JavaScript session.
pub(crate) struct JsSession {
    rt: Runtime,
    ctx: Context,
    io: Arc<Mutex<Io>>,
    ctl: Arc<Ctl>,
}

/// What an evaluation produced.
pub(crate) struct JsOutcome {
    pub(crate) exit_code: Option<i32>,
    pub(crate) limit: Option<LimitKind>,
    pub(crate) stdout: OutputBuffer,
    pub(crate) stderr: OutputBuffer,
    pub(crate) value: Option<String>,
    /// The session must be discarded (after a limit).
    pub(crate) reset: bool,
    pub(crate) note: Option<String>,
}

fn js_err(e: rquickjs::Error) -> Error {
    Error::backend_caused(TIER, "QuickJS", e)
}

/// Formats one console argument: strings as they are, others as JSON, else `String(v)`.
fn show<'js>(ctx: &Ctx<'js>, v: Value<'js>) -> String {
    if let Some(s) = v.as_string() {
        return s.to_string().unwrap_or_default();
    }
    if v.is_undefined() {
        return "undefined".into();
    }
    if v.is_function() {
        return "[Function]".into();
    }
    if v.is_object() && !v.is_array() {
        if let Some(e) = v.as_exception() {
            return format!("{}", e);
        }
    }
    if let Ok(Some(s)) = ctx.json_stringify(v.clone()) {
        if let Ok(s) = s.to_string() {
            return s;
        }
    }
    ctx.globals()
        .get::<_, Function>("String")
        .and_then(|f| f.call::<_, String>((v,)))
        .unwrap_or_else(|_| "[value]".into())
}

/// How a final value is echoed on stdout: a string in single quotes (as Python's `repr`
/// and Node's REPL show one), anything else as its JSON text; one line.
pub(crate) fn echo(json: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::String(s)) => {
            let mut line = String::with_capacity(s.len() + 3);
            line.push('\'');
            for c in s.chars() {
                match c {
                    '\\' => line.push_str("\\\\"),
                    '\'' => line.push_str("\\'"),
                    '\n' => line.push_str("\\n"),
                    '\r' => line.push_str("\\r"),
                    '\t' => line.push_str("\\t"),
                    c => line.push(c),
                }
            }
            line.push_str("'\n");
            line
        }
        _ => format!("{json}\n"),
    }
}

fn js_to_json<'js>(ctx: &Ctx<'js>, v: Value<'js>) -> serde_json::Value {
    if v.is_undefined() {
        return serde_json::Value::Null;
    }
    match ctx.json_stringify(v) {
        Ok(Some(s)) => s
            .to_string()
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(serde_json::Value::Null),
        _ => serde_json::Value::Null,
    }
}

/// Pristine runtimes with a full context (the standard built-ins), made ahead of time: building
/// the context is the largest part of a JavaScript sandbox's creation. Each is handed out once,
/// before any code ran in it, then configured (memory limit, interrupt handler, `console`, tools)
/// for its sandbox; nothing is ever returned to this list.
static SPARES: Mutex<Vec<(Runtime, Context)>> = Mutex::new(Vec::new());

/// How many pristine contexts are kept ready (each is a few hundred KiB).
const SPARE_CONTEXTS: usize = 2;

fn fresh_context() -> Result<(Runtime, Context)> {
    let rt = Runtime::new().map_err(js_err)?;
    rt.set_max_stack_size(JS_STACK);
    let ctx = Context::full(&rt).map_err(js_err)?;
    Ok((rt, ctx))
}

fn spare_context() -> Option<(Runtime, Context)> {
    SPARES.lock().ok()?.pop()
}

/// Tops the spare list up when dropped (on the janitor thread, see `engine::drop_later`).
struct RefillSpare;

impl Drop for RefillSpare {
    fn drop(&mut self) {
        let missing = SPARES
            .lock()
            .map(|g| SPARE_CONTEXTS.saturating_sub(g.len()))
            .unwrap_or(0);
        for _ in 0..missing {
            match fresh_context() {
                Ok(pair) => match SPARES.lock() {
                    Ok(mut g) if g.len() < SPARE_CONTEXTS => g.push(pair),
                    _ => return,
                },
                Err(_) => return,
            }
        }
    }
}

impl JsSession {
    /// A runtime and context (pristine, from the spares when one is ready) with `console` and
    /// the tools.
    pub(crate) fn new(
        memory_limit: u64,
        output_cap: u64,
        tools: Option<Arc<ToolBox>>,
    ) -> Result<JsSession> {
        let (rt, ctx) = match spare_context() {
            Some(pair) => pair,
            None => fresh_context()?,
        };
        // Replace what was taken, off the caller's path.
        engine::drop_later(RefillSpare);
        rt.set_memory_limit(usize::try_from(memory_limit).unwrap_or(usize::MAX));
        let ctl = Arc::new(Ctl {
            base: Instant::now(),
            deadline_ns: AtomicU64::new(u64::MAX),
            cpu_deadline_ns: AtomicU64::new(u64::MAX),
            hit: AtomicU32::new(0),
            calls: AtomicU32::new(0),
        });
        let c2 = Arc::clone(&ctl);
        rt.set_interrupt_handler(Some(Box::new(move || c2.interrupt())));
        let io = Arc::new(Mutex::new(Io {
            out: OutputBuffer::new(output_cap),
            err: OutputBuffer::new(output_cap),
            taps: None,
        }));
        ctx.with(|ctx| install_globals(&ctx, &io, &ctl, tools))
            .map_err(js_err)?;
        Ok(JsSession { rt, ctx, io, ctl })
    }

    /// Evaluates `code` as a global script. Blocking; run on a guest thread. With `taps`,
    /// console output is also forwarded as it is written.
    pub(crate) fn eval(
        &mut self,
        code: &str,
        wall: Duration,
        cpu: Duration,
        output_cap: u64,
        taps: Option<Taps>,
    ) -> JsOutcome {
        if let Ok(mut g) = self.io.lock() {
            g.out = OutputBuffer::new(output_cap);
            g.err = OutputBuffer::new(output_cap);
            g.taps = taps;
        }
        let now = u64::try_from(self.ctl.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let wall_ns = u64::try_from(wall.as_nanos()).unwrap_or(u64::MAX);
        self.ctl
            .deadline_ns
            .store(now.saturating_add(wall_ns), Ordering::Relaxed);
        let cpu_now = u64::try_from(engine::thread_cpu_time().as_nanos()).unwrap_or(u64::MAX);
        let cpu_ns = u64::try_from(cpu.as_nanos()).unwrap_or(u64::MAX);
        self.ctl
            .cpu_deadline_ns
            .store(cpu_now.saturating_add(cpu_ns), Ordering::Relaxed);
        self.ctl.hit.store(0, Ordering::Relaxed);

        let (mut exit_code, mut value, mut failure) = (Some(0), None, None::<(Uncaught, String)>);
        self.ctx.with(|ctx| {
            let mut opts = rquickjs::context::EvalOptions::default();
            opts.global = true;
            opts.strict = false;
            opts.backtrace_barrier = true;
            opts.filename = Some("<exec>".into());
            let r: rquickjs::Result<Value<'_>> = ctx.eval_with_options(code, opts);
            let r = r.and_then(settle);
            match CaughtError::catch(&ctx, r) {
                Ok(v) => {
                    if !v.is_undefined() && !v.is_function() {
                        if let Ok(Some(s)) = ctx.json_stringify(v) {
                            value = s.to_string().ok();
                        }
                    }
                }
                Err(e) => {
                    exit_code = Some(1);
                    failure = Some(describe(&e));
                }
            }
        });
        // Drain promise jobs left behind, under the same deadline.
        while self.rt.is_job_pending() {
            if self.rt.execute_pending_job().is_err() || self.ctl.hit.load(Ordering::Relaxed) != 0 {
                break;
            }
        }
        self.ctl.deadline_ns.store(u64::MAX, Ordering::Relaxed);
        self.ctl.cpu_deadline_ns.store(u64::MAX, Ordering::Relaxed);
        let (mut out, mut err) = match self.io.lock() {
            Ok(mut g) => (
                {
                    // The final value is echoed to stdout, as Python's is (its
                    // displayhook); one larger than the cap is dropped below instead.
                    if let Some(v) = value.as_deref().filter(|v| v.len() as u64 <= output_cap) {
                        let line = echo(v);
                        g.out.push(line.as_bytes());
                        if let Some(t) = &g.taps {
                            t.out.push(line.as_bytes());
                        }
                    }
                    // The streams end with the call.
                    drop(g.taps.take());
                    std::mem::replace(&mut g.out, OutputBuffer::new(0))
                },
                std::mem::replace(&mut g.err, OutputBuffer::new(0)),
            ),
            Err(_) => (OutputBuffer::new(0), OutputBuffer::new(0)),
        };
        let mut limit = None;
        let mut note = None;
        let mut reset = false;
        if let Some((kind, text)) = failure {
            let hit = self.ctl.hit.load(Ordering::Relaxed);
            let usage = self.rt.memory_usage();
            let near_cap = kind == Uncaught::OutOfMemory;
            if (1..=3).contains(&hit) {
                let (kind, what) = match hit {
                    1 => (LimitKind::WallTime, "wall time"),
                    2 => (LimitKind::CpuTime, "CPU time"),
                    _ => (LimitKind::Output, "output (a flood)"),
                };
                limit = Some(kind);
                exit_code = None;
                reset = true;
                note = Some(format!(
                    "{what} limit reached; the JavaScript context was reset (its globals are lost)"
                ));
            } else if near_cap {
                limit = Some(LimitKind::Memory);
                exit_code = None;
                reset = true;
                note = Some(format!(
                    "memory limit reached ({} bytes in use); the JavaScript context was reset",
                    usage.malloc_size
                ));
            } else {
                err.push(text.as_bytes());
                err.push(b"\n");
            }
        }
        if let Some(v) = &value {
            if v.len() as u64 > output_cap {
                value = None;
                out.push(&[]);
                note = Some("the final value is larger than the output cap and was dropped".into());
            }
        }
        JsOutcome {
            exit_code,
            limit,
            stdout: out,
            stderr: err,
            value,
            reset,
            note,
        }
    }
}

fn install_globals<'js>(
    ctx: &Ctx<'js>,
    io: &Arc<Mutex<Io>>,
    ctl: &Arc<Ctl>,
    tools: Option<Arc<ToolBox>>,
) -> rquickjs::Result<()> {
    let console = Object::new(ctx.clone())?;
    for (name, to_err) in [
        ("log", false),
        ("info", false),
        ("debug", false),
        ("warn", true),
        ("error", true),
    ] {
        let io = Arc::clone(io);
        let ctl = Arc::clone(ctl);
        let f = Function::new(ctx.clone(), move |ctx: Ctx<'js>, args: Rest<Value<'js>>| {
            let mut line = args
                .0
                .into_iter()
                .map(|v| show(&ctx, v))
                .collect::<Vec<_>>()
                .join(" ");
            line.push('\n');
            if let Ok(mut g) = io.lock() {
                let g = &mut *g;
                let (b, tap) = if to_err {
                    (&mut g.err, g.taps.as_ref().map(|t| &t.err))
                } else {
                    (&mut g.out, g.taps.as_ref().map(|t| &t.out))
                };
                b.push(line.as_bytes());
                if let Some(t) = tap {
                    t.push(line.as_bytes());
                }
                if b.flooded() {
                    // Far past the cap: the interrupt handler stops the script (the output
                    // limit), as every tier stops a flood.
                    ctl.hit.store(3, Ordering::Relaxed);
                }
            }
        })?;
        console.set(name, f)?;
    }
    ctx.globals().set("console", console)?;
    if let Some(tb) = tools.filter(|t| !t.tools.is_empty()) {
        let obj = Object::new(ctx.clone())?;
        for name in tb.tools.names() {
            let tb = Arc::clone(&tb);
            let tool = name.clone();
            let f = Function::new(
                ctx.clone(),
                move |ctx: Ctx<'js>, args: Rest<Value<'js>>| -> rquickjs::Result<Value<'js>> {
                    let vals: Vec<serde_json::Value> =
                        args.0.into_iter().map(|v| js_to_json(&ctx, v)).collect();
                    match tb.positional(&tool, vals).and_then(|m| tb.call(&tool, &m)) {
                        Ok(v) => ctx.json_parse(v.to_string()),
                        Err(e) => Err(rquickjs::Exception::throw_message(
                            &ctx,
                            &format!("{tool}: {} ({})", e.message, e.kind),
                        )),
                    }
                },
            )?
            .with_name(name.as_str())?;
            obj.set(name.as_str(), f.clone())?;
            if !ctx.globals().contains_key(name.as_str())? {
                ctx.globals().set(name.as_str(), f)?;
            }
        }
        ctx.globals().set("tools", obj)?;
    }
    Ok(())
}

/// If `v` is a promise, runs jobs until it settles and returns its result.
fn settle(v: Value<'_>) -> rquickjs::Result<Value<'_>> {
    let Some(p) = v.as_promise().cloned() else {
        return Ok(v);
    };
    match p.finish::<Value<'_>>() {
        Err(rquickjs::Error::WouldBlock) => Ok(v),
        r => r,
    }
}

/// What an uncaught error was, as far as the memory limit is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Uncaught {
    /// QuickJS ran out of memory (the runtime's limit was hit).
    OutOfMemory,
    /// Anything else the code threw.
    Other,
}

/// The uncaught error as text, and whether it is QuickJS running out of memory.
///
/// QuickJS gives no typed out-of-memory signal: `JS_ThrowOutOfMemory` throws a plain
/// `InternalError` whose message is "out of memory" (or "out of memory in regexp
/// execution"; a regexp that runs out while compiling is a `SyntaxError` "out of memory"),
/// and when even that cannot be allocated, a bare `null`. So the exception's
/// class name and the start of its message are the only signal; they are read from the
/// exception object itself (not from the formatted text, which user code controls through
/// the stack or a custom message). rquickjs's own allocation failures are typed
/// ([`rquickjs::Error::Allocation`]).
fn describe(e: &CaughtError<'_>) -> (Uncaught, String) {
    match e {
        CaughtError::Exception(ex) => {
            let name = ex
                .get::<_, String>("name")
                .unwrap_or_else(|_| "Error".into());
            let message = ex.message().unwrap_or_default();
            let kind = if matches!(name.as_str(), "InternalError" | "SyntaxError")
                && message.starts_with("out of memory")
            {
                Uncaught::OutOfMemory
            } else {
                Uncaught::Other
            };
            let mut s = format!("Uncaught {name}: {message}");
            if let Some(stack) = ex.stack().filter(|s| !s.is_empty()) {
                if !s.contains(stack.trim()) {
                    s.push('\n');
                    s.push_str(stack.trim_end());
                }
            }
            (kind, s)
        }
        CaughtError::Value(v) => {
            if v.is_null() {
                return (Uncaught::OutOfMemory, "Uncaught null".into());
            }
            let ctx = v.ctx().clone();
            (
                Uncaught::Other,
                format!("Uncaught {}", show(&ctx, v.clone())),
            )
        }
        CaughtError::Error(rquickjs::Error::Allocation) => (
            Uncaught::OutOfMemory,
            format!("Uncaught {}", rquickjs::Error::Allocation),
        ),
        CaughtError::Error(e) => (Uncaught::Other, format!("Uncaught {e}")),
    }
}
