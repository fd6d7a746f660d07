//! Exec requests and results, streaming events, and the bounded output buffer backends share.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::secrets::{Redactor, StreamRedactor};
use crate::timeline::Timeline;

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Command {
    /// A program and its arguments (`argv[0]` is looked up on the sandbox's `PATH`).
    Argv(Vec<String>),
    /// Source code in the sandbox spec's language.
    Code(String),
}

/// One command to run in a sandbox. Build it with [`ExecRequest::argv`] or
/// [`ExecRequest::code`] and the setters; `#[non_exhaustive]`: later versions add options.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ExecRequest {
    /// What to run.
    pub command: Command,
    /// Bytes fed to standard input (then closed). `None`: stdin is empty.
    #[serde(default)]
    pub stdin: Option<Vec<u8>>,
    /// Extra environment for this call only (on top of the spec's).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory inside the sandbox (default `/workspace`).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Wall timeout for this call; capped by the spec's `limits.wall_time_ms`.
    #[serde(default, with = "opt_millis")]
    pub timeout: Option<Duration>,
    /// Run on a pseudo-terminal of this size (only with
    /// [`Sandbox::spawn`](crate::Sandbox::spawn), on tiers with
    /// [`Capabilities::tty`](crate::Capabilities::tty)): raw bytes both ways through the
    /// [`Process`](crate::Process), stdout and stderr merged, resizable.
    #[serde(default)]
    pub tty: Option<Tty>,
}

/// A terminal's size, in character cells. `#[non_exhaustive]`: build it with [`Tty::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Tty {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

impl Tty {
    /// A terminal of `rows` x `cols` cells.
    pub fn new(rows: u16, cols: u16) -> Self {
        Tty { rows, cols }
    }

    /// Both sides at least 1.
    pub fn validate(self) -> crate::Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Err(crate::Error::invalid(
                "tty",
                format!("a {}x{} terminal has no cells", self.rows, self.cols),
            ));
        }
        Ok(())
    }
}

mod opt_millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&crate::spec::millis(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}

impl ExecRequest {
    /// Runs a program with arguments.
    pub fn argv<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::new(Command::Argv(argv.into_iter().map(Into::into).collect()))
    }

    /// Runs a code string in the spec's language.
    pub fn code(code: impl Into<String>) -> Self {
        Self::new(Command::Code(code.into()))
    }

    fn new(command: Command) -> Self {
        ExecRequest {
            command,
            stdin: None,
            env: BTreeMap::new(),
            cwd: None,
            timeout: None,
            tty: None,
        }
    }

    /// Runs on a pseudo-terminal of `rows` x `cols` (with [`Sandbox::spawn`](crate::Sandbox::spawn)).
    pub fn tty(mut self, rows: u16, cols: u16) -> Self {
        self.tty = Some(Tty::new(rows, cols));
        self
    }

    /// [`Error::Unsupported`](crate::Error::Unsupported) from `tier` when this request asks
    /// for a terminal: for backends (or calls) without one.
    pub fn refuse_tty(&self, tier: crate::Tier) -> crate::Result<()> {
        match self.tty {
            Some(_) => Err(crate::Error::unsupported(
                tier,
                "terminals (ExecRequest::tty)",
            )),
            None => Ok(()),
        }
    }

    /// Sets stdin.
    pub fn stdin(mut self, data: impl Into<Vec<u8>>) -> Self {
        self.stdin = Some(data.into());
        self
    }

    /// Adds an environment variable for this call.
    pub fn env(mut self, k: impl Into<String>, v: impl Into<String>) -> Self {
        self.env.insert(k.into(), v.into());
        self
    }

    /// Sets the working directory.
    pub fn cwd(mut self, cwd: impl Into<String>) -> Self {
        self.cwd = Some(cwd.into());
        self
    }

    /// Sets this call's timeout.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = Some(d);
        self
    }

    /// The effective wall limit: the call's timeout capped by the spec's.
    pub fn effective_timeout(&self, spec_wall: Duration) -> Duration {
        self.timeout.map_or(spec_wall, |t| t.min(spec_wall))
    }

    /// Validates what a backend cannot check for itself.
    pub fn validate(&self) -> crate::Result<()> {
        if let Command::Argv(a) = &self.command {
            if a.is_empty() {
                return Err(crate::Error::invalid("command", "argv is empty"));
            }
            if a.iter().any(|s| s.contains('\0')) {
                return Err(crate::Error::invalid(
                    "command",
                    "arguments cannot contain NUL",
                ));
            }
        }
        if self.timeout == Some(Duration::ZERO) {
            return Err(crate::Error::invalid("timeout", "must be positive"));
        }
        if let Some(t) = self.tty {
            t.validate()?;
        }
        Ok(())
    }
}

/// A kind of limit: one field of [`Limits`](crate::Limits).
///
/// [`ExecResult::limit`] names the one that stopped a command;
/// [`Capabilities::limits`](crate::Capabilities) lists the ones a tier enforces.
/// `#[non_exhaustive]`: later versions add limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum LimitKind {
    /// Per-exec wall time ([`Limits::wall_time_ms`](crate::Limits::wall_time_ms)).
    WallTime,
    /// CPU time per exec ([`Limits::cpu_time_ms`](crate::Limits::cpu_time_ms)).
    CpuTime,
    /// Memory of the whole sandbox ([`Limits::memory_bytes`](crate::Limits::memory_bytes)).
    Memory,
    /// Processes and threads at once ([`Limits::pids`](crate::Limits::pids)).
    Pids,
    /// Captured output ([`Limits::output_bytes`](crate::Limits::output_bytes)); as a stop
    /// reason: the command was stopped, not only truncated.
    Output,
    /// Writable disk ([`Limits::disk_bytes`](crate::Limits::disk_bytes)).
    Disk,
    /// Open files per process ([`Limits::open_files`](crate::Limits::open_files)).
    OpenFiles,
    /// Instruction budget per exec ([`Limits::fuel`](crate::Limits::fuel), wasm fuel).
    Fuel,
    /// The sandbox's lifetime ([`Limits::lifetime_ms`](crate::Limits::lifetime_ms)).
    Lifetime,
    /// CPU share ([`Limits::cpu_millis`](crate::Limits::cpu_millis)): a scheduler quota
    /// that slows a command down and never stops it, so it is never a stop reason.
    CpuShare,
}

impl LimitKind {
    /// Every kind, in declaration order.
    pub const ALL: [LimitKind; 10] = [
        LimitKind::WallTime,
        LimitKind::CpuTime,
        LimitKind::Memory,
        LimitKind::Pids,
        LimitKind::Output,
        LimitKind::Disk,
        LimitKind::OpenFiles,
        LimitKind::Fuel,
        LimitKind::Lifetime,
        LimitKind::CpuShare,
    ];

    /// The kind's name, as in JSON (`wall-time`, `memory`...).
    pub fn name(self) -> &'static str {
        match self {
            LimitKind::WallTime => "wall-time",
            LimitKind::CpuTime => "cpu-time",
            LimitKind::Memory => "memory",
            LimitKind::Pids => "pids",
            LimitKind::Output => "output",
            LimitKind::Disk => "disk",
            LimitKind::OpenFiles => "open-files",
            LimitKind::Fuel => "fuel",
            LimitKind::Lifetime => "lifetime",
            LimitKind::CpuShare => "cpu-share",
        }
    }

    /// The [`Limits`](crate::Limits) field it refers to, as named in
    /// [`Error::InvalidSpec`](crate::Error::InvalidSpec) (`limits.memory_bytes`...).
    pub fn field(self) -> &'static str {
        match self {
            LimitKind::WallTime => "limits.wall_time_ms",
            LimitKind::CpuTime => "limits.cpu_time_ms",
            LimitKind::Memory => "limits.memory_bytes",
            LimitKind::Pids => "limits.pids",
            LimitKind::Output => "limits.output_bytes",
            LimitKind::Disk => "limits.disk_bytes",
            LimitKind::OpenFiles => "limits.open_files",
            LimitKind::Fuel => "limits.fuel",
            LimitKind::Lifetime => "limits.lifetime_ms",
            LimitKind::CpuShare => "limits.cpu_millis",
        }
    }
}

impl std::fmt::Display for LimitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a finished command produced. Backends make one with [`ExecResult::new`] and set the
/// rest; `#[non_exhaustive]`: later versions add fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ExecResult {
    /// Exit status (`128 + signal` for a killed process); `None` if it never exited normally.
    pub exit_code: Option<i32>,
    /// Captured standard output (capped, secrets redacted).
    #[serde(with = "lossy_bytes")]
    pub stdout: Vec<u8>,
    /// Captured standard error (capped, secrets redacted).
    #[serde(with = "lossy_bytes")]
    pub stderr: Vec<u8>,
    /// The limit that stopped the command, if one did.
    pub limit: Option<LimitKind>,
    /// Whether output beyond the cap was dropped.
    pub truncated: bool,
    /// The final value of a code string, as JSON text, for languages that have one
    /// (a JavaScript snippet's completion value, a Python session's last expression).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// A code cell's rich outputs in order (its last expression's value and what it
    /// displayed, as MIME bundles), for interpreters that report them; capped by the spec's
    /// output limit (`truncated` says when some were dropped). See [`crate::cell`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<crate::cell::Output>,
    /// The exception that ended a code cell, for interpreters that report one (its
    /// traceback is on stderr as well).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<crate::cell::CellError>,
    /// Phases of this call.
    pub timeline: Timeline,
}

impl ExecResult {
    /// A result with this exit status and output, no limit hit, nothing truncated, no value
    /// and an empty timeline.
    pub fn new(exit_code: Option<i32>, stdout: Vec<u8>, stderr: Vec<u8>) -> Self {
        ExecResult {
            exit_code,
            stdout,
            stderr,
            limit: None,
            truncated: false,
            value: None,
            outputs: Vec::new(),
            error: None,
            timeline: Timeline::default(),
        }
    }

    /// A result from a command's two capture buffers: their output redacted with `redactor`,
    /// `truncated` when either dropped bytes; no limit hit and an empty timeline.
    pub fn from_output(
        exit_code: Option<i32>,
        stdout: OutputBuffer,
        stderr: OutputBuffer,
        redactor: &Redactor,
    ) -> Self {
        let mut r = ExecResult::new(exit_code, Vec::new(), Vec::new());
        r.truncated = stdout.truncated() || stderr.truncated();
        r.stdout = stdout.finish(redactor);
        r.stderr = stderr.finish(redactor);
        r
    }

    /// Sets the limit that stopped the command.
    pub fn with_limit(mut self, limit: Option<LimitKind>) -> Self {
        self.limit = limit;
        self
    }

    /// Sets the call's timeline.
    pub fn with_timeline(mut self, timeline: Timeline) -> Self {
        self.timeline = timeline;
        self
    }

    /// `true` when the command exited 0 and no limit stopped it.
    pub fn success(&self) -> bool {
        self.exit_code == Some(0) && self.limit.is_none()
    }

    /// Stdout as (lossy) UTF-8.
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Stderr as (lossy) UTF-8.
    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

mod lossy_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&String::from_utf8_lossy(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        Ok(String::deserialize(d)?.into_bytes())
    }
}

/// One event of a streaming exec. `#[non_exhaustive]`: later versions add events.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExecEvent {
    /// A chunk of standard output.
    Stdout(Bytes),
    /// A chunk of standard error.
    Stderr(Bytes),
    /// The command finished; `stdout`/`stderr` in the result are empty (already streamed).
    Exit(ExecResult),
}

/// The receiving end of a streaming exec. The last event is always [`ExecEvent::Exit`],
/// unless the sandbox failed, in which case the stream yields an error.
#[derive(Debug)]
pub struct ExecStream {
    rx: mpsc::Receiver<crate::Result<ExecEvent>>,
}

/// The events as a stream (what [`ExecStream::next`] returns), for `futures::StreamExt` and
/// friends.
impl futures::Stream for ExecStream {
    type Item = crate::Result<ExecEvent>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

impl ExecStream {
    /// A stream fed by `tx`. Backends create the pair with [`ExecStream::channel`].
    pub fn channel(capacity: usize) -> (mpsc::Sender<crate::Result<ExecEvent>>, ExecStream) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (tx, ExecStream { rx })
    }

    /// Runs an exec on its own task and streams it: `run` gets the sender for chunk events
    /// (see [`StreamSink`]); its result becomes the final [`ExecEvent::Exit`] (with `stdout`
    /// and `stderr` emptied, since they were streamed) or the stream's error.
    pub fn spawn<F, Fut>(run: F) -> ExecStream
    where
        F: FnOnce(mpsc::Sender<crate::Result<ExecEvent>>) -> Fut,
        Fut: std::future::Future<Output = crate::Result<ExecResult>> + Send + 'static,
    {
        let (tx, stream) = ExecStream::channel(64);
        let fut = run(tx.clone());
        tokio::spawn(async move {
            let last = match fut.await {
                Ok(mut res) => {
                    res.stdout.clear();
                    res.stderr.clear();
                    Ok(ExecEvent::Exit(res))
                }
                Err(e) => Err(e),
            };
            // A dropped receiver only means nobody is listening any more.
            let _ = tx.send(last).await;
        });
        stream
    }

    /// The next event, or `None` after the last one.
    pub async fn next(&mut self) -> Option<crate::Result<ExecEvent>> {
        self.rx.recv().await
    }

    /// Drains the stream into one [`ExecResult`] (stdout/stderr concatenated).
    pub async fn collect(mut self) -> crate::Result<ExecResult> {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        while let Some(ev) = self.next().await {
            match ev? {
                ExecEvent::Stdout(b) => out.extend_from_slice(&b),
                ExecEvent::Stderr(b) => err.extend_from_slice(&b),
                ExecEvent::Exit(mut r) => {
                    r.stdout = out;
                    r.stderr = err;
                    return Ok(r);
                }
            }
        }
        Err(crate::Error::Io {
            context: "exec stream ended without an exit event".into(),
            source: std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
        })
    }
}

/// Where a command's output becomes a flood that is stopped (the [`LimitKind::Output`]
/// stop reason) rather than only truncated: 4 times the cap, and at least 8 MiB past it.
pub fn flood_threshold(cap: u64) -> u64 {
    cap.saturating_mul(4).max(cap.saturating_add(8 << 20))
}

/// A reader that counts the bytes passing through it and wakes `flood` once when they pass
/// `at` (see [`flood_threshold`]); backends wrap a command's output pipes in it and stop the
/// command when woken. Several readers may share one `Notify`.
#[derive(Debug)]
pub struct FloodReader<R> {
    inner: R,
    seen: u64,
    at: u64,
    flood: std::sync::Arc<tokio::sync::Notify>,
}

impl<R> FloodReader<R> {
    /// Wraps `inner`; `flood` is notified (a permit kept if nobody waits yet) past `at` bytes.
    pub fn new(inner: R, at: u64, flood: std::sync::Arc<tokio::sync::Notify>) -> Self {
        FloodReader {
            inner,
            seen: 0,
            at,
            flood,
        }
    }
}

impl<R: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for FloodReader<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = u64::try_from(buf.filled().len().saturating_sub(before)).unwrap_or(u64::MAX);
        let was = self.seen;
        self.seen = was.saturating_add(n);
        if was <= self.at && self.seen > self.at {
            self.flood.notify_one();
        }
        r
    }
}

/// A capped output buffer that redacts secrets. Backends push raw bytes; the first `cap`
/// bytes are kept, the rest counted and dropped.
#[derive(Debug)]
pub struct OutputBuffer {
    data: Vec<u8>,
    cap: usize,
    dropped: u64,
}

impl OutputBuffer {
    /// A buffer keeping at most `cap` bytes.
    pub fn new(cap: u64) -> Self {
        let cap = usize::try_from(cap).unwrap_or(usize::MAX);
        OutputBuffer {
            data: Vec::new(),
            cap,
            dropped: 0,
        }
    }

    /// Appends; returns `false` once the cap is reached.
    pub fn push(&mut self, chunk: &[u8]) -> bool {
        let room = self.cap.saturating_sub(self.data.len());
        let take = room.min(chunk.len());
        self.data.extend_from_slice(&chunk[..take]);
        self.dropped += (chunk.len() - take) as u64;
        self.dropped == 0
    }

    /// Whether anything was dropped.
    pub fn truncated(&self) -> bool {
        self.dropped > 0
    }

    /// Every byte pushed so far, kept or dropped.
    pub fn seen(&self) -> u64 {
        (self.data.len() as u64).saturating_add(self.dropped)
    }

    /// Whether what was pushed is a flood to stop (past [`flood_threshold`] of the cap).
    pub fn flooded(&self) -> bool {
        self.seen() > flood_threshold(self.cap as u64)
    }

    /// The kept bytes as captured, **not redacted**: for a backend to inspect (e.g. an
    /// engine's own error message), never to hand to a caller (use [`OutputBuffer::finish`]).
    pub fn peek(&self) -> &[u8] {
        &self.data
    }

    /// The kept bytes, with secrets redacted (also a secret cut in half by the cap).
    pub fn finish(self, redactor: &Redactor) -> Vec<u8> {
        if redactor.is_empty() {
            self.data
        } else if self.truncated() {
            redactor.redact_truncated(&self.data)
        } else {
            redactor.redact(&self.data)
        }
    }
}

/// Which stream a chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Where a streaming exec's chunks go, redacted on the way (secrets split across chunks too).
#[derive(Debug)]
pub struct StreamSink {
    tx: mpsc::Sender<crate::Result<ExecEvent>>,
    redactor: StreamRedactor,
    kind: StreamKind,
}

impl StreamSink {
    /// A sink for one stream of an exec.
    pub fn new(
        tx: mpsc::Sender<crate::Result<ExecEvent>>,
        redactor: &Redactor,
        kind: StreamKind,
    ) -> Self {
        StreamSink {
            tx,
            redactor: StreamRedactor::new(redactor.clone()),
            kind,
        }
    }

    /// Streams one chunk, redacted (a secret split across chunks is caught at the next:
    /// what could be its beginning is held back until then).
    pub async fn push(&mut self, data: &[u8]) {
        let out = self.redactor.push(data);
        self.send(out).await;
    }

    /// Ends the stream: sends what the redactor held back.
    pub async fn finish(&mut self) {
        let rest = self.redactor.finish(false);
        self.send(rest).await;
    }

    async fn send(&self, data: Vec<u8>) {
        if data.is_empty() {
            return;
        }
        let b = Bytes::from(data);
        let ev = match self.kind {
            StreamKind::Stdout => ExecEvent::Stdout(b),
            StreamKind::Stderr => ExecEvent::Stderr(b),
        };
        // A dropped receiver only means nobody is listening any more.
        let _ = self.tx.send(Ok(ev)).await;
    }
}

/// Reads `src` to its end, keeping the first `cap` bytes in an [`OutputBuffer`] and, when a
/// sink is given, streaming the same (capped, redacted) bytes as they come. Output past the
/// cap is drained and dropped, so a flood neither blocks the writer nor grows host memory.
pub async fn pump_output<R>(src: Option<R>, cap: u64, mut sink: Option<StreamSink>) -> OutputBuffer
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let mut buf = OutputBuffer::new(cap);
    if let Some(mut src) = src {
        let mut chunk = vec![0u8; 16 * 1024];
        let mut streamed: u64 = 0;
        loop {
            match src.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    buf.push(&chunk[..n]);
                    if let Some(s) = &mut sink {
                        let room = cap.saturating_sub(streamed);
                        let take = usize::try_from(room).unwrap_or(usize::MAX).min(n);
                        if take > 0 {
                            streamed += take as u64;
                            let out = s.redactor.push(&chunk[..take]);
                            s.send(out).await;
                        }
                    }
                }
            }
        }
    }
    if let Some(s) = &mut sink {
        let rest = s.redactor.finish(buf.truncated());
        s.send(rest).await;
    }
    buf
}

/// Streams all of `src` to `sink`, redacted, keeping nothing: a background process's output
/// (see [`Process`](crate::Process)). A sink that is not read holds the reader back (the
/// channel is bounded), so the writer blocks instead of our memory growing.
pub async fn stream_output<R>(mut src: R, mut sink: StreamSink)
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        match src.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => sink.push(&chunk[..n]).await,
        }
    }
    sink.finish().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_flood_reader_wakes_once_past_its_threshold() {
        use tokio::io::AsyncReadExt;
        assert_eq!(flood_threshold(1000), 1000 + (8 << 20));
        assert_eq!(flood_threshold(64 << 20), 256 << 20);
        let flood = std::sync::Arc::new(tokio::sync::Notify::new());
        let data = [b'y'; 100];
        let mut r = FloodReader::new(&data[..], 60, std::sync::Arc::clone(&flood));
        let mut buf = [0u8; 50];
        assert_eq!(r.read(&mut buf).await.unwrap(), 50);
        // 50 bytes: not a flood yet (no permit stored).
        let early = tokio::time::timeout(Duration::ZERO, flood.notified()).await;
        assert!(early.is_err());
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest.len(), 50);
        // Past 60: the permit waits for whoever asks.
        flood.notified().await;
    }

    #[test]
    fn output_buffer_caps_and_redacts() {
        let mut b = OutputBuffer::new(10);
        assert!(b.push(b"token=abc"));
        assert!(!b.push(b"defghijk"));
        assert!(b.truncated());
        let r = Redactor::new([("T".into(), "abc".into())]);
        assert_eq!(b.finish(&r), b"token=[REDACTED:T]d".to_vec());
        // a secret cut by the cap does not leak its first bytes
        let mut b = OutputBuffer::new(8);
        b.push(b"token=abc");
        assert_eq!(b.finish(&r), b"token=[REDACTED:T]".to_vec());
    }

    #[test]
    fn timeout_is_capped_by_spec() {
        let r = ExecRequest::code("x").timeout(Duration::from_secs(100));
        assert_eq!(
            r.effective_timeout(Duration::from_secs(5)),
            Duration::from_secs(5)
        );
        let r = ExecRequest::code("x");
        assert_eq!(
            r.effective_timeout(Duration::from_secs(5)),
            Duration::from_secs(5)
        );
        assert!(ExecRequest::argv(Vec::<String>::new()).validate().is_err());
        assert!(ExecRequest::code("x")
            .timeout(Duration::ZERO)
            .validate()
            .is_err());
    }

    #[tokio::test]
    async fn an_exec_stream_is_a_futures_stream() {
        use futures::StreamExt;
        let (tx, s) = ExecStream::channel(4);
        tx.send(Ok(ExecEvent::Stdout(Bytes::from_static(b"x"))))
            .await
            .unwrap();
        tx.send(Ok(ExecEvent::Exit(ExecResult::new(
            Some(1),
            vec![],
            vec![],
        ))))
        .await
        .unwrap();
        drop(tx);
        let kinds: Vec<&str> = s
            .map(|e| match e.unwrap() {
                ExecEvent::Stdout(_) => "out",
                ExecEvent::Exit(_) => "exit",
                _ => "other",
            })
            .collect()
            .await;
        assert_eq!(kinds, ["out", "exit"]);
    }

    #[tokio::test]
    async fn stream_collects() {
        let (tx, s) = ExecStream::channel(4);
        tokio::spawn(async move {
            tx.send(Ok(ExecEvent::Stdout(Bytes::from_static(b"a"))))
                .await
                .unwrap();
            tx.send(Ok(ExecEvent::Stderr(Bytes::from_static(b"e"))))
                .await
                .unwrap();
            tx.send(Ok(ExecEvent::Stdout(Bytes::from_static(b"b"))))
                .await
                .unwrap();
            tx.send(Ok(ExecEvent::Exit(ExecResult {
                exit_code: Some(0),
                stdout: vec![],
                stderr: vec![],
                limit: None,
                truncated: false,
                value: None,
                outputs: vec![],
                error: None,
                timeline: Timeline::default(),
            })))
            .await
            .unwrap();
        });
        let r = s.collect().await.unwrap();
        assert_eq!(r.stdout, b"ab");
        assert_eq!(r.stderr, b"e");
        assert!(r.success());
    }
}
