//! Running a call: a workspace module, a Python turn or a JavaScript evaluation, admitted,
//! under the call's limits, streamed through taps when asked, and its result (capped,
//! redacted).

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sandbox_core::{
    beneath, pump_output, Command, Error, ExecEvent, ExecRequest, ExecResult, Language, LimitKind,
    OutputBuffer, Phase, Result, StreamKind, StreamSink, TimelineRecorder, WorkspacePath,
    WORKSPACE_MOUNT,
};
use tokio::sync::mpsc;

use super::{Inner, LangState, TIER};
use crate::engine;
use crate::host::{CallLimits, Preopen};
use crate::js::JsSession;
use crate::module::{self, ModuleRun};
use crate::python::{self, Session};
use crate::stream::{self, Taps};

/// A call's outcome before redaction.
struct Raw {
    exit_code: Option<i32>,
    limit: Option<LimitKind>,
    out: OutputBuffer,
    err: OutputBuffer,
    note: Option<String>,
    value: Option<String>,
    /// A Python cell's rich outputs, its exception, and whether outputs were dropped.
    cell: Option<CellReport>,
}

/// What a Python cell reported besides its output.
struct CellReport {
    outputs: Vec<sandbox_core::Output>,
    error: Option<sandbox_core::CellError>,
    truncated: bool,
}

impl Inner {
    fn limits(&self, req: &ExecRequest) -> CallLimits {
        let left = self
            .spec
            .limits
            .lifetime()
            .saturating_sub(self.born.elapsed());
        CallLimits {
            wall: req
                .effective_timeout(self.spec.limits.wall_time())
                .min(left)
                .max(Duration::from_millis(1)),
            cpu: Duration::from_millis(self.spec.limits.cpu_time_ms),
            fuel: self.spec.limits.fuel,
        }
    }

    fn host_path(&self, path: &str) -> Result<PathBuf> {
        WorkspacePath::parse(path)?.resolve_under(self.workspace()?)
    }

    /// The call's result. With `taps` (a streamed call) the output was already forwarded as
    /// written: only the host's note goes out here, and dropping the taps ends the streams.
    fn finish(&self, raw: Raw, t: TimelineRecorder, taps: Option<Taps>) -> ExecResult {
        let Raw {
            exit_code,
            limit,
            out,
            err,
            note,
            value,
            cell,
        } = raw;
        let truncated =
            out.truncated() || err.truncated() || cell.as_ref().is_some_and(|c| c.truncated);
        let mut stderr = err.finish(&self.redactor);
        if let Some(n) = note {
            // Notes can quote guest output (a failed figure flush): redacted like it.
            let line =
                sandbox_core::cell::redact_text(&self.redactor, format!("[agent-sandbox] {n}\n"));
            if let Some(t) = &taps {
                t.err.note(line.as_bytes());
            }
            stderr.extend_from_slice(line.as_bytes());
        }
        drop(taps);
        let value = value.map(|v| sandbox_core::cell::redact_json(&self.redactor, v));
        // A call the host stopped for a limit ends as a killed process does in every tier:
        // 137 (128 + SIGKILL), not without an exit code.
        let exit_code = match (exit_code, limit) {
            (None, Some(_)) => Some(137),
            (code, _) => code,
        };
        let mut r = ExecResult::new(exit_code, out.finish(&self.redactor), stderr);
        r.limit = limit;
        r.truncated = truncated;
        r.value = value;
        if let Some(c) = cell {
            r.outputs = c
                .outputs
                .into_iter()
                .map(|o| o.redacted(&self.redactor))
                .collect();
            r.error = c.error.map(|e| e.redacted(&self.redactor));
        }
        r.timeline = t.finish();
        r
    }

    async fn exec_module(
        &self,
        argv: Vec<String>,
        req: &ExecRequest,
        mut t: TimelineRecorder,
        taps: Option<Taps>,
    ) -> Result<ExecResult> {
        let cap = self.spec.limits.output_bytes;
        let program = &argv[0];
        // Only `.wasm` modules of the workspace run here: any other program is not found
        // (exit 127, as in every tier), whatever its name.
        let found = if program.ends_with(".wasm") {
            // Beneath a workspace handle, capped: code may have swapped the module for a
            // link out, or made it a 1 TiB sparse file.
            let ws = self.workspace_fd()?;
            let (p, max) = (program.clone(), self.spec.limits.disk_bytes);
            let read = tokio::task::spawn_blocking(move || beneath::read_file(ws.as_fd(), &p, max))
                .await
                .map_err(|e| Error::backend_caused(TIER, "reading the module", e))?;
            match read {
                Ok(b) => Ok(b),
                Err(Error::NotFound { .. }) => {
                    Err(format!("{program}: no such module in the workspace\n"))
                }
                Err(e) => return Err(e),
            }
        } else {
            Err(format!(
                "{program}: command not found (the wasm tier runs only .wasm modules of the \
                 workspace)\n"
            ))
        };
        let bytes = match found {
            Ok(b) => b,
            Err(msg) => {
                let mut err = OutputBuffer::new(cap);
                err.push(msg.as_bytes());
                if let Some(t) = &taps {
                    t.err.push(msg.as_bytes());
                }
                return Ok(self.finish(
                    Raw {
                        exit_code: Some(127),
                        limit: None,
                        out: OutputBuffer::new(cap),
                        err,
                        note: None,
                        value: None,
                        cell: None,
                    },
                    t,
                    taps,
                ));
            }
        };
        t.mark(Phase::Filesystem);
        self.run_module(bytes, argv, req, t, taps).await
    }

    async fn run_module(
        &self,
        bytes: Vec<u8>,
        argv: Vec<String>,
        req: &ExecRequest,
        mut t: TimelineRecorder,
        taps: Option<Taps>,
    ) -> Result<ExecResult> {
        if module::is_component(&bytes) {
            return Err(Error::unsupported(
                TIER,
                "WebAssembly components (the component model, WASI 0.2): this tier runs WASI \
                 preview-1 command modules; build for `wasm32-wasip1`",
            ));
        }
        let (cwd, opened) = match &req.cwd {
            Some(c) => {
                let host = self.host_path(c)?;
                // Opened beneath the workspace's handle, and preopened from that handle: code
                // inside that swaps the folder for a link after the check does not get the
                // link's target.
                let ws = beneath::open_dir(self.workspace()?)?;
                let rel = WorkspacePath::parse(c)?.relative();
                let fd =
                    beneath::open_beneath(ws.as_fd(), &rel, libc::O_RDONLY | libc::O_DIRECTORY, 0)
                        .map_err(|e| beneath::map_err(e, c, "open the working directory"))?;
                (host, Some(Arc::new(fd)))
            }
            None => (self.workspace()?.to_path_buf(), None),
        };
        let mut preopens = self.grants()?;
        preopens.push(Preopen {
            host: cwd,
            guest: ".".into(),
            writable: self.workspace_writable,
            opened,
        });
        let mut env = self.env.clone();
        env.extend(req.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        // The limits are computed (and armed, on the guest thread) after admission: a
        // queued call is not charged for its wait.
        let ticket = self.cfg.admission.admit().await?;
        t.mark(Phase::Queue);
        let run = ModuleRun {
            flavor: self.flavor,
            bytes,
            argv,
            env: env.into_iter().collect(),
            preopens,
            stdin: req.stdin.clone().unwrap_or_default(),
            output_cap: self.spec.limits.output_bytes,
            memory_cap: self.spec.limits.memory_bytes,
            open_files: self.spec.limits.open_files,
            tools: self.tools.clone(),
            limits: self.limits(req),
            scratch: Arc::clone(self.scratch()?),
            disk_cap: self.spec.limits.disk_bytes,
            taps: taps.clone(),
        };
        let o = engine::on_guest_thread(move || {
            let _slot = ticket;
            module::run(run)
        })
        .await??;
        t.mark(Phase::Command);
        Ok(self.finish(
            Raw {
                exit_code: o.exit_code,
                limit: o.limit,
                out: o.stdout,
                err: o.stderr,
                note: o.note,
                value: None,
                cell: None,
            },
            t,
            taps,
        ))
    }

    async fn exec_python(
        &self,
        code: String,
        req: &ExecRequest,
        mut t: TimelineRecorder,
        taps: Option<Taps>,
    ) -> Result<ExecResult> {
        let cwd = match &req.cwd {
            Some(c) => WorkspacePath::parse(c)?.in_sandbox(),
            None => WORKSPACE_MOUNT.to_string(),
        };
        let mut guard = self.state.lock().await;
        let LangState::Python(slot) = &mut *guard else {
            return Err(Error::backend(TIER, "not a Python sandbox"));
        };
        let ticket = self.cfg.admission.admit().await?;
        t.mark(Phase::Queue);
        let sess = match slot.take() {
            Some(s) => s,
            None => {
                let (s, _) = self.start_python(Arc::clone(&ticket)).await?;
                t.mark(Phase::Runtime);
                s
            }
        };
        let limits = self.limits(req);
        let cap = self.spec.limits.output_bytes;
        let env = req.env.clone();
        let stdin = req.stdin.clone().unwrap_or_default();
        let guest_taps = taps.clone();
        let (sess, r, out, err) = engine::on_guest_thread(move || {
            let _slot = ticket;
            let mut sess = sess;
            // Every turn of this call streams (the host's own turns print nothing unless
            // they fail, and then their output is the call's output).
            sess.set_taps(guest_taps.as_ref());
            let untap = |sess: Session| {
                sess.set_taps(None);
                sess
            };
            let pre = |sess: &mut Session,
                       code: String|
             -> Option<(python::TurnResult, OutputBuffer, OutputBuffer)> {
                let r = sess.turn(&code, &[], limits, cap);
                let (o, e) = sess.take_output(cap);
                if r.exit_code == Some(0) && r.alive {
                    None
                } else {
                    Some((r, o, e))
                }
            };
            if sess.cwd != cwd {
                if let Some(fail) = pre(&mut sess, python::chdir(&cwd)) {
                    let sess = untap(sess);
                    return (Some(sess).filter(|_| fail.0.alive), fail.0, fail.1, fail.2);
                }
                sess.cwd = cwd.clone();
            }
            if !env.is_empty() {
                if let Some(fail) = pre(&mut sess, python::env_apply(&env)) {
                    let sess = untap(sess);
                    return (Some(sess).filter(|_| fail.0.alive), fail.0, fail.1, fail.2);
                }
            }
            let mut r = sess.turn(&code, &stdin, limits, cap);
            let (o, e) = sess.take_output(cap);
            // Untapped first: the flush's own stderr is reported once, in the note.
            let mut sess = untap(sess);
            if r.alive && sess.draws(&r) {
                sess.flush_figures(&mut r, limits, cap);
            }
            if r.alive && !env.is_empty() {
                let restore = python::env_restore(&env, &sess.base_env);
                let _ = sess.turn(&restore, &[], limits, cap);
                let _ = sess.take_output(cap);
            }
            let alive = r.alive;
            (Some(sess).filter(|_| alive), r, o, e)
        })
        .await?;
        *slot = sess;
        drop(guard);
        t.mark(Phase::Command);
        Ok(self.finish(
            Raw {
                exit_code: r.exit_code,
                limit: r.limit,
                out,
                err,
                note: r.note,
                value: r.value,
                cell: Some(CellReport {
                    outputs: r.outputs,
                    error: r.error,
                    truncated: r.outputs_truncated,
                }),
            },
            t,
            taps,
        ))
    }

    async fn exec_js(
        &self,
        code: String,
        req: &ExecRequest,
        mut t: TimelineRecorder,
        taps: Option<Taps>,
    ) -> Result<ExecResult> {
        let mut guard = self.state.lock().await;
        let LangState::Js(slot) = &mut *guard else {
            return Err(Error::backend(TIER, "not a JavaScript sandbox"));
        };
        let ticket = self.cfg.admission.admit().await?;
        t.mark(Phase::Queue);
        let sess = match slot.take() {
            Some(s) => s,
            None => {
                let s = JsSession::new(
                    self.spec.limits.memory_bytes,
                    self.spec.limits.output_bytes,
                    self.tools.clone(),
                )?;
                t.mark(Phase::Runtime);
                s
            }
        };
        let limits = self.limits(req);
        let cap = self.spec.limits.output_bytes;
        let guest_taps = taps.clone();
        let (sess, o) = engine::on_guest_thread(move || {
            let _slot = ticket;
            let mut sess = sess;
            let o = sess.eval(&code, limits.wall, limits.cpu, cap, guest_taps);
            (sess, o)
        })
        .await?;
        if !o.reset {
            *slot = Some(sess);
        }
        drop(guard);
        t.mark(Phase::Command);
        Ok(self.finish(
            Raw {
                exit_code: o.exit_code,
                limit: o.limit,
                out: o.stdout,
                err: o.stderr,
                note: o.note,
                cell: o.value.as_deref().map(|v| CellReport {
                    // The completion value as a cell's result: its echo and its JSON.
                    outputs: vec![sandbox_core::Output::new(
                        sandbox_core::OutputKind::ExecuteResult,
                        [
                            ("text/plain", crate::js::echo(v).trim_end_matches('\n')),
                            ("application/json", v),
                        ],
                    )],
                    error: None,
                    truncated: false,
                }),
                value: o.value,
            },
            t,
            taps,
        ))
    }

    /// One exec; with `stream`, its output is streamed as written (see
    /// [`WasmSandbox`]'s `exec_stream`).
    pub(super) async fn run(
        &self,
        req: ExecRequest,
        stream: Option<mpsc::Sender<Result<ExecEvent>>>,
    ) -> Result<ExecResult> {
        self.alive()?;
        req.validate()?;
        req.refuse_tty(TIER)?;
        let Some(tx) = stream else {
            return self.dispatch(&req, None).await;
        };
        let cap = self.spec.limits.output_bytes;
        let (out, out_rx) = stream::tap(cap);
        let (err, err_rx) = stream::tap(cap);
        let sink = |kind| Some(StreamSink::new(tx.clone(), &self.redactor, kind));
        // The call owns the taps: when it ends (or fails), they drop and the pumps finish.
        let (res, _, _) = tokio::join!(
            self.dispatch(&req, Some(Taps { out, err })),
            pump_output(Some(out_rx), cap, sink(StreamKind::Stdout)),
            pump_output(Some(err_rx), cap, sink(StreamKind::Stderr)),
        );
        res
    }

    async fn dispatch(&self, req: &ExecRequest, taps: Option<Taps>) -> Result<ExecResult> {
        let t = TimelineRecorder::start();
        match req.command.clone() {
            Command::Argv(argv) => self.exec_module(argv, req, t, taps).await,
            Command::Code(code) => match self.spec.language {
                Language::Python => self.exec_python(code, req, t, taps).await,
                Language::Javascript => self.exec_js(code, req, t, taps).await,
                _ => {
                    self.run_module(code.into_bytes(), vec!["main.wasm".into()], req, t, taps)
                        .await
                }
            },
            other => Err(Error::unsupported(TIER, format!("the command {other:?}"))),
        }
    }
}
