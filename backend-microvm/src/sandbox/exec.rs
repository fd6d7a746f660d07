//! Running commands: the argv of a code string, the exec call on the agent, and collecting
//! (and streaming) its capped, redacted output.

use super::*;

type Sender = mpsc::Sender<Result<ExecEvent>>;

impl Inner {
    fn argv(&self, cmd: &Command) -> Result<Vec<String>> {
        match cmd {
            Command::Argv(a) => Ok(a.clone()),
            Command::Code(code) => {
                // From an image, code runs the image's own interpreter (found on its `PATH`);
                // say so if it has none.
                if let Some(i) = &self.image {
                    i.image
                        .require_interpreter(self.spec.language)
                        .map_err(|e| e.into_core(TIER))?;
                }
                let with = |p: &[&str]| {
                    p.iter()
                        .map(|s| s.to_string())
                        .chain([code.clone()])
                        .collect::<Vec<_>>()
                };
                match (self.spec.language, self.image.is_some()) {
                    (Language::Shell, _) => Ok(with(&["/bin/sh", "-c"])),
                    (Language::Python, true) => Ok(with(&["python3", "-c"])),
                    (Language::Node | Language::Javascript, true) => Ok(with(&["node", "-e"])),
                    (other, _) => Err(Error::unsupported(
                        TIER,
                        format!(
                            "{other} code (the default guest has busybox only; start from an \
                             image with the interpreter)"
                        ),
                    )),
                }
            }
            other => Err(Error::unsupported(TIER, format!("the command {other:?}"))),
        }
    }

    /// The agent's form of `req`: argv, environment, working directory and stdin (no
    /// timeout, no output cap: the caller sets them).
    pub(super) fn agent_request(&self, req: &ExecRequest) -> Result<agent_client::ExecRequest> {
        let argv = self.argv(&req.command)?;
        let cwd = match &req.cwd {
            // The image's `WorkingDir`, else the workspace.
            None => self
                .image
                .as_ref()
                .and_then(|i| i.image.config().default_cwd())
                .unwrap_or_default()
                .to_string(),
            Some(c) if c.starts_with('/') => c.clone(),
            Some(c) => WorkspacePath::parse(c)?.in_sandbox(),
        };
        let mut env = self.env.clone();
        env.extend(req.env.clone());
        Ok(agent_client::ExecRequest {
            argv,
            env: env.into_iter().collect(),
            cwd,
            stdin: req.stdin.clone().unwrap_or_default(),
            timeout_ms: 0,
            max_output: 0,
        })
    }

    pub(super) async fn run(
        self: &Arc<Self>,
        req: ExecRequest,
        tx: Option<Sender>,
    ) -> Result<ExecResult> {
        req.validate()?;
        req.refuse_tty(TIER)?;
        let shared = Arc::clone(&self.lifecycle).read_owned().await;
        // Only the agent is held during the call: destroy drops the VM, which closes the
        // channel and wakes the call at once.
        let (agent, _) = self.handles()?;
        let mut t = TimelineRecorder::start();
        let timeout = req.effective_timeout(self.spec.limits.wall_time());
        let cap = self.spec.limits.output_bytes;
        let mut areq = self.agent_request(&req)?;
        areq.timeout_ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        // Both streams together: the agent drops what the host would drop anyway.
        areq.max_output = cap.saturating_mul(2);
        let redactor = self.redactor.clone();
        let collected = tokio::task::spawn_blocking(move || {
            let _shared = shared;
            collect(&agent, &areq, cap, &redactor, tx)
        })
        .await
        .map_err(join_err)?;
        let (exit, out, err) = collected.map_err(|e| self.fail(e, None))?;
        t.mark(Phase::Command);
        let limit = exit.timed_out.then_some(LimitKind::WallTime);
        let exit_code = exit
            .code
            .or(exit.signal.map(|s| 128 + s))
            .or(exit.timed_out.then_some(137));
        let mut r = ExecResult::from_output(exit_code, out, err, &self.redactor)
            .with_limit(limit)
            .with_timeline(t.finish());
        // The agent's own caps may have dropped output before it reached us.
        r.truncated |= exit.truncated;
        Ok(r)
    }
}

/// Runs one exec to its end on the agent: caps each stream, streams (redacted) chunks to
/// `tx` as they come.
fn collect(
    agent: &AgentClient,
    req: &agent_client::ExecRequest,
    cap: u64,
    redactor: &Redactor,
    tx: Option<Sender>,
) -> std::result::Result<(ExitInfo, OutputBuffer, OutputBuffer), AgentError> {
    struct Stream {
        redactor: StreamRedactor,
        sent: u64,
    }
    let mut out = OutputBuffer::new(cap);
    let mut err = OutputBuffer::new(cap);
    let mut streams = tx.as_ref().map(|_| {
        [
            Stream {
                redactor: StreamRedactor::new(redactor.clone()),
                sent: 0,
            },
            Stream {
                redactor: StreamRedactor::new(redactor.clone()),
                sent: 0,
            },
        ]
    });
    let send = |i: usize, data: Vec<u8>| {
        if let (Some(tx), false) = (&tx, data.is_empty()) {
            let ev = if i == 0 {
                ExecEvent::Stdout(data.into())
            } else {
                ExecEvent::Stderr(data.into())
            };
            // A consumer that went away does not stop the command: it still gets collected.
            let _ = tx.blocking_send(Ok(ev));
        }
    };
    let mut h = agent.start_exec(req)?;
    loop {
        let (i, data) = match h.next_event()? {
            agent_client::ExecEvent::Stdout(d) => (0, d),
            agent_client::ExecEvent::Stderr(d) => (1, d),
            agent_client::ExecEvent::Exit(x) => {
                if let Some(s) = &mut streams {
                    let truncated = [out.truncated(), err.truncated()];
                    for (i, st) in s.iter_mut().enumerate() {
                        let t = truncated.get(i).copied().unwrap_or(false) || x.truncated;
                        send(i, st.redactor.finish(t));
                    }
                }
                return Ok((x, out, err));
            }
        };
        if i == 0 {
            out.push(&data);
        } else {
            err.push(&data);
        }
        if let Some(st) = streams.as_mut().and_then(|s| s.get_mut(i)) {
            let room = usize::try_from(cap.saturating_sub(st.sent)).unwrap_or(usize::MAX);
            let take = room.min(data.len());
            if take > 0 {
                st.sent += take as u64;
                let chunk = st.redactor.push(data.get(..take).unwrap_or_default());
                send(i, chunk);
            }
        }
    }
}
