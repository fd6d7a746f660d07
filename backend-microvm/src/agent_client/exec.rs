//! Commands in the guest: execs run to completion, background processes (spawned, or
//! adopted from a snapshot's client) with their input, signals, terminal and output window,
//! connections to the guest's loopback, and the [`ExecHandle`] that follows each.

use super::*;

/// [`AgentError::TooLarge`] for a request whose stdin cannot be framed.
fn check_stdin(req: &ExecRequest) -> Result<(), AgentError> {
    if req.stdin.len() > proto::MAX_STDIN {
        return Err(AgentError::TooLarge(format!(
            "stdin of {} bytes (at most {})",
            req.stdin.len(),
            proto::MAX_STDIN
        )));
    }
    Ok(())
}

impl AgentClient {
    /// Starts a command; read its output and exit with [`ExecHandle::next_event`].
    pub fn start_exec(&self, req: &ExecRequest) -> Result<ExecHandle, AgentError> {
        check_stdin(req)?;
        let call = self.start(&Request::Exec(req.clone()))?;
        let wait = (req.timeout_ms > 0)
            .then(|| Duration::from_millis(req.timeout_ms).saturating_add(EXEC_GRACE));
        Ok(ExecHandle {
            call,
            deadline: wait.map(|w| Instant::now() + w),
            done: false,
        })
    }

    /// Runs a command to completion, calling `on_chunk` with every output chunk as it
    /// arrives (before the cap is applied) and returning the collected output, capped at the
    /// request's `max_output` (or [`DEFAULT_OUTPUT_CAP`]) for stdout and stderr together.
    pub fn exec_with(
        &self,
        req: &ExecRequest,
        mut on_chunk: impl FnMut(&ExecEvent),
    ) -> Result<ExecOutput, AgentError> {
        let cap = if req.max_output == 0 {
            DEFAULT_OUTPUT_CAP
        } else {
            req.max_output
        };
        let cap = usize::try_from(cap).unwrap_or(usize::MAX);
        let mut h = self.start_exec(req)?;
        let mut out = ExecOutput::default();
        loop {
            let ev = h.next_event()?;
            on_chunk(&ev);
            let room = cap.saturating_sub(out.stdout.len() + out.stderr.len());
            let (buf, data) = match ev {
                ExecEvent::Stdout(d) => (&mut out.stdout, d),
                ExecEvent::Stderr(d) => (&mut out.stderr, d),
                ExecEvent::Exit(x) => {
                    out.truncated |= x.truncated;
                    out.exit = x;
                    return Ok(out);
                }
            };
            if data.len() > room {
                out.truncated = true;
            }
            buf.extend_from_slice(data.get(..room.min(data.len())).unwrap_or_default());
        }
    }

    /// Runs a command to completion and returns its collected output (see
    /// [`exec_with`](Self::exec_with)).
    pub fn exec(&self, req: &ExecRequest) -> Result<ExecOutput, AgentError> {
        self.exec_with(req, |_| {})
    }

    /// Starts a background process (see [`proto::Request::Spawn`]): read its output and
    /// exit with [`ExecHandle::next_event`], and give back what was consumed with
    /// [`grant`](Self::grant) ([`proto::FRAME_COST`] at least per frame), or its output
    /// stops after `window` bytes. `tty`: a terminal of (rows, cols).
    pub fn start_spawn(
        &self,
        req: &ExecRequest,
        tty: Option<(u16, u16)>,
        window: u32,
    ) -> Result<ExecHandle, AgentError> {
        check_stdin(req)?;
        let call = self.start(&Request::Spawn {
            exec: req.clone(),
            tty,
            window,
        })?;
        // `Ok` once it runs (registered for `input`, `signal`...), before any output.
        match call.recv(Some(SPAWN_TIMEOUT))? {
            Response::Ok => {}
            r => return Err(unexpected(&r)),
        }
        let wait = (req.timeout_ms > 0)
            .then(|| Duration::from_millis(req.timeout_ms).saturating_add(EXEC_GRACE));
        Ok(ExecHandle {
            call,
            deadline: wait.map(|w| Instant::now() + w),
            done: false,
        })
    }

    /// Opens a connection to `port` on the guest's loopback (see [`proto::Request::Connect`]):
    /// what the guest's server sends comes as [`ExecEvent::Stdout`] from
    /// [`ExecHandle::next_event`] (give it back with [`grant`](Self::grant), or it stops
    /// after `window` bytes), [`input`](Self::input) sends to it,
    /// [`close_input`](Self::close_input) half-closes, [`ExecHandle::kill`] aborts; the
    /// [`ExecEvent::Exit`] comes once the server closed its side. [`ErrorKind::NotFound`]:
    /// nothing accepts on that port.
    pub fn start_connect(&self, port: u16, window: u32) -> Result<ExecHandle, AgentError> {
        let call = self.start(&Request::Connect { port, window })?;
        match call.recv(Some(SPAWN_TIMEOUT))? {
            Response::Ok => {}
            r => return Err(unexpected(&r)),
        }
        Ok(ExecHandle {
            call,
            deadline: None,
            done: false,
        })
    }

    /// Takes over request `target` that another client (of a snapshot this guest was
    /// restored from) started: its further frames come to the returned handle. Use
    /// [`skip_ids_below`](Self::skip_ids_below) first, so no new request shares the id.
    pub fn adopt(&self, target: u32) -> Result<ExecHandle, AgentError> {
        let shared = &self.inner.shared;
        if lock(&shared.broken).is_some() {
            return Err(shared.broken());
        }
        if target == 0 || target >= self.next_id() {
            return Err(AgentError::Protocol(format!(
                "cannot adopt request {target}: not below this client's next id {}",
                self.next_id()
            )));
        }
        let (tx, rx) = mpsc::sync_channel(QUEUE_FRAMES);
        {
            let mut pending = lock(&shared.pending);
            if pending.contains_key(&target) {
                return Err(AgentError::Protocol(format!(
                    "request {target} is already followed"
                )));
            }
            pending.insert(target, tx);
        }
        Ok(ExecHandle {
            call: Call {
                client: self.clone(),
                id: target,
                rx,
            },
            deadline: None,
            done: false,
        })
    }

    /// Writes `data` to the input of background process `target` (in frames of at most
    /// [`proto::WRITE_CHUNK`]); returns once the agent has written it.
    /// [`ErrorKind::NotFound`]: the process ended or its input is closed.
    pub fn input(&self, target: u32, data: &[u8], timeout: Duration) -> Result<(), AgentError> {
        for chunk in data.chunks(proto::WRITE_CHUNK) {
            self.answered(
                &Request::Input {
                    target,
                    data: chunk.to_vec(),
                },
                timeout,
            )?;
        }
        Ok(())
    }

    /// Closes the input of background process `target` (a terminal gets Ctrl-D).
    pub fn close_input(&self, target: u32, timeout: Duration) -> Result<(), AgentError> {
        self.answered(&Request::CloseInput { target }, timeout)
    }

    /// Sends signal `signo` to the process group of exec or background process `target`.
    pub fn signal(&self, target: u32, signo: i32, timeout: Duration) -> Result<(), AgentError> {
        self.answered(&Request::Signal { target, signo }, timeout)
    }

    /// Resizes the terminal of background process `target`.
    pub fn resize(
        &self,
        target: u32,
        rows: u16,
        cols: u16,
        timeout: Duration,
    ) -> Result<(), AgentError> {
        self.answered(&Request::Resize { target, rows, cols }, timeout)
    }

    /// Lets the agent send `bytes` more output of background process `target` (no answer).
    pub fn grant(&self, target: u32, bytes: u32) -> Result<(), AgentError> {
        // Registered and dropped at once: the agent does not answer a grant.
        self.start(&Request::Grant { target, bytes }).map(drop)
    }

    /// Kills the process group of a running exec (by its request id).
    pub fn kill(&self, exec_id: u32, timeout: Duration) -> Result<(), AgentError> {
        let call = self.start(&Request::Kill { target: exec_id })?;
        match call.recv(Some(timeout))? {
            Response::Ok => Ok(()),
            r => Err(unexpected(&r)),
        }
    }
}

/// A running exec started by [`AgentClient::start_exec`]. Dropping it before the exit kills
/// the command.
pub struct ExecHandle {
    call: Call,
    deadline: Option<Instant>,
    done: bool,
}

impl std::fmt::Debug for ExecHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecHandle")
            .field("id", &self.call.id)
            .field("done", &self.done)
            .finish()
    }
}

impl ExecHandle {
    /// The request id (for [`AgentClient::kill`]).
    pub fn id(&self) -> u32 {
        self.call.id
    }

    /// The next output chunk or the exit. After the exit, further calls fail with
    /// [`AgentError::Closed`]. If the request had a timeout and the agent has not reported the
    /// exit [`EXEC_GRACE`] after it, the command is killed and [`AgentError::Timeout`] returned.
    pub fn next_event(&mut self) -> Result<ExecEvent, AgentError> {
        if self.done {
            return Err(AgentError::Closed("the exec already ended".into()));
        }
        let wait = self
            .deadline
            .map(|d| d.saturating_duration_since(Instant::now()));
        let r = match self.call.recv(wait) {
            Ok(r) => r,
            Err(e) => {
                if matches!(e, AgentError::Timeout(_)) {
                    let _ = self.kill();
                }
                self.done = true;
                return Err(e);
            }
        };
        match r {
            Response::Stdout(d) => Ok(ExecEvent::Stdout(d)),
            Response::Stderr(d) => Ok(ExecEvent::Stderr(d)),
            Response::Exit(x) => {
                self.done = true;
                Ok(ExecEvent::Exit(x))
            }
            r => {
                self.done = true;
                Err(unexpected(&r))
            }
        }
    }

    /// Stops following the request without ending it (dropping the handle kills the
    /// command): its further frames are dropped here, and the command goes on in the guest.
    pub fn detach(mut self) {
        self.done = true;
    }

    /// Kills the command's process group.
    pub fn kill(&self) -> Result<(), AgentError> {
        // Fire and forget: the answer (Ok, or NotFound if it just ended) does not matter.
        self.call.client.start(&Request::Kill {
            target: self.call.id,
        })?;
        Ok(())
    }
}

impl Drop for ExecHandle {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.kill();
        }
    }
}
