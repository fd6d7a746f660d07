//! Host side of the guest-agent protocol ([`proto`]), over a blocking Unix stream (one end of
//! the socketpair whose other end is the VMM's virtio-console device, or, in tests, the agent
//! process itself).
//!
//! [`AgentClient`] is cheap to clone and can be used from several threads at once: a reader
//! thread routes every response frame to the request that is waiting for it (by request id),
//! so execs may run concurrently and their output streams as it comes. The guest is not
//! trusted: every frame is size-checked before it is buffered, a malformed frame breaks the
//! channel with [`AgentError::Protocol`] (the caller should then end the VM), the per-request
//! queues are bounded, and retained output is capped on this side too.

use std::collections::HashMap;
use std::io;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[path = "../guest-agent/src/proto.rs"]
pub mod proto;

mod exec;
mod files;
mod watch;

pub use exec::ExecHandle;
pub use proto::{Entry, EntryKind, ErrorKind, ExecRequest, ExitInfo, SOURCE_HASH};
use proto::{ReadError, Request, Response};
pub use watch::{FsEvent, FsKind, WatchHandle, WATCH_WINDOW};

/// How long [`AgentClient::exec`] waits past the request's own timeout for the agent to report
/// the exit before it gives up (the agent kills the command at its timeout; this only covers a
/// guest that stopped answering).
pub const EXEC_GRACE: Duration = Duration::from_secs(10);
/// How long [`AgentClient::start_spawn`] waits for the agent to report the process started.
pub const SPAWN_TIMEOUT: Duration = Duration::from_secs(30);
/// Output retained by [`AgentClient::exec`] when the request sets no `max_output`.
pub const DEFAULT_OUTPUT_CAP: u64 = 64 << 20;
/// Frames queued per request before the reader thread waits for the consumer.
const QUEUE_FRAMES: usize = 256;

/// Errors of the agent channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The channel ended (the guest stopped, shut down, or the VM is gone).
    #[error("the guest agent channel is closed: {0}")]
    Closed(String),
    /// The guest sent something that is not valid protocol; the channel is unusable.
    #[error("guest agent protocol error: {0}")]
    Protocol(String),
    /// Writing to or reading from the channel failed.
    #[error("guest agent channel I/O: {0}")]
    Io(#[from] io::Error),
    /// No answer in time.
    #[error("no answer from the guest agent within {0:?}")]
    Timeout(Duration),
    /// The agent refused or failed the request.
    #[error("guest agent: {message}")]
    Remote {
        /// Category.
        kind: ErrorKind,
        /// Detail from the agent.
        message: String,
    },
    /// The agent in the guest was built from other sources than this library (a stale
    /// initramfs): rebuild the guest artifacts.
    #[error(
        "the guest agent was built from other sources (hash {found:#x}, expected {expected:#x}): \
         rebuild the guest initramfs"
    )]
    VersionMismatch {
        /// This library's [`SOURCE_HASH`].
        expected: u64,
        /// What the agent announced.
        found: u64,
    },
    /// The request cannot be framed (stdin or a path too large).
    #[error("request too large: {0}")]
    TooLarge(String),
    /// The guest could not set itself up as its kernel command line asked (an image root
    /// that would not mount: no such disk, an initramfs without the modules...). The agent
    /// announced this before `Ready`; it still serves, from its initramfs, for diagnosis.
    #[error("the guest failed to set up: {0}")]
    GuestSetup(String),
}

/// One event of a running exec.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExecEvent {
    /// A chunk of standard output.
    Stdout(Vec<u8>),
    /// A chunk of standard error.
    Stderr(Vec<u8>),
    /// The command ended; no event follows.
    Exit(ExitInfo),
}

/// The collected result of [`AgentClient::exec`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ExecOutput {
    /// How the command ended.
    pub exit: ExitInfo,
    /// Standard output (capped).
    pub stdout: Vec<u8>,
    /// Standard error (capped).
    pub stderr: Vec<u8>,
    /// Whether output was dropped, by the agent or by this side's cap.
    pub truncated: bool,
}

type Pending = HashMap<u32, SyncSender<Response>>;

struct Shared {
    pending: Mutex<Pending>,
    /// Why the channel stopped, once it has.
    broken: Mutex<Option<AgentError>>,
    /// The last `Ready` announcement (source hash), signalled on `ready_cv`.
    ready: Mutex<Option<u64>>,
    /// A set-up failure the agent announced before `Ready` (an unattributed `Error`).
    setup_error: Mutex<Option<String>>,
    ready_cv: Condvar,
}

struct Inner {
    shared: Arc<Shared>,
    writer: Mutex<UnixStream>,
    next_id: AtomicU32,
    reader: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = lock(&self.writer).shutdown(Shutdown::Both);
        if let Some(h) = lock(&self.reader).take() {
            let _ = h.join();
        }
    }
}

/// A connection to the guest agent. Clones share the connection.
#[derive(Clone)]
pub struct AgentClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient").finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn clone_err(e: &AgentError) -> AgentError {
    match e {
        AgentError::Closed(s) => AgentError::Closed(s.clone()),
        AgentError::Protocol(s) => AgentError::Protocol(s.clone()),
        other => AgentError::Closed(other.to_string()),
    }
}

impl Shared {
    fn broken(&self) -> AgentError {
        lock(&self.broken)
            .as_ref()
            .map(clone_err)
            .unwrap_or_else(|| AgentError::Closed("the request was dropped".into()))
    }

    fn stop(&self, why: AgentError) {
        {
            let mut b = lock(&self.broken);
            if b.is_none() {
                *b = Some(why);
            }
        }
        // Dropping the senders wakes every waiting request with a disconnect.
        lock(&self.pending).clear();
        let _g = lock(&self.ready);
        self.ready_cv.notify_all();
    }
}

fn reader_loop(mut stream: UnixStream, shared: Arc<Shared>) {
    loop {
        let (hdr, payload) = match proto::read_frame(&mut stream, proto::MAX_PAYLOAD) {
            Ok(Some(f)) => f,
            Ok(None) => return shared.stop(AgentError::Closed("end of stream".into())),
            Err(ReadError::Truncated) => {
                return shared.stop(AgentError::Closed("stream ended inside a frame".into()))
            }
            Err(ReadError::TooLarge(h)) => {
                return shared.stop(AgentError::Protocol(format!(
                    "frame of {} bytes (kind {}) is over the limit",
                    h.len, h.kind
                )))
            }
            Err(ReadError::Io(e)) => return shared.stop(AgentError::Closed(e.to_string())),
        };
        let resp = match Response::decode(hdr.kind, &payload) {
            Ok(r) => r,
            Err(proto::Malformed) => {
                return shared.stop(AgentError::Protocol(format!(
                    "malformed frame (kind {}, {} bytes)",
                    hdr.kind, hdr.len
                )))
            }
        };
        if let Response::Ready { source_hash } = resp {
            *lock(&shared.ready) = Some(source_hash);
            shared.ready_cv.notify_all();
            continue;
        }
        if hdr.id == 0 {
            if let Response::Error { message, .. } = &resp {
                let ready = lock(&shared.ready);
                if ready.is_none() {
                    // Before `Ready`: the agent's set-up failed (it sends nothing else then).
                    lock(&shared.setup_error).get_or_insert_with(|| message.clone());
                    shared.ready_cv.notify_all();
                    continue;
                }
            }
            // An error about a frame the agent could not attribute: nobody waits for it.
            tracing::warn!(?resp, "guest agent message without a request");
            continue;
        }
        let tx = lock(&shared.pending).get(&hdr.id).cloned();
        if let Some(tx) = tx {
            if tx.send(resp).is_err() {
                // The requester went away; forget it.
                lock(&shared.pending).remove(&hdr.id);
            }
        }
    }
}

/// Writes all of `buf` with `MSG_NOSIGNAL`: a guest end that went away gives `EPIPE`, never a
/// `SIGPIPE` that would kill the host process.
fn send_all(stream: &UnixStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: `buf` is a valid readable slice for its length; the fd is an open socket
        // owned by `stream` for the duration of the call.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        buf = buf.get(n.unsigned_abs()..).unwrap_or_default();
    }
    Ok(())
}

/// Fills `buf` from the kernel's random generator.
fn getrandom(buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = buf.get_mut(filled..).unwrap_or_default();
        // SAFETY: writes at most `rest.len()` bytes into a buffer we own.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += n.unsigned_abs();
    }
    Ok(())
}

/// A request in flight: receives its response frames.
struct Call {
    // First: dropped before `client`, whose last clone joins the reader thread, which may be
    // waiting to hand this very queue a frame.
    rx: Receiver<Response>,
    client: AgentClient,
    id: u32,
}

impl Call {
    fn recv(&self, timeout: Option<Duration>) -> Result<Response, AgentError> {
        let r = match timeout {
            Some(t) => self.rx.recv_timeout(t).map_err(|e| match e {
                RecvTimeoutError::Timeout => AgentError::Timeout(t),
                RecvTimeoutError::Disconnected => self.client.inner.shared.broken(),
            }),
            None => self
                .rx
                .recv()
                .map_err(|_| self.client.inner.shared.broken()),
        };
        if let Ok(Response::Error { kind, message }) = r {
            return Err(AgentError::Remote { kind, message });
        }
        r
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        lock(&self.client.inner.shared.pending).remove(&self.id);
    }
}

fn unexpected(r: &Response) -> AgentError {
    AgentError::Protocol(format!("unexpected answer {r:?}"))
}

impl AgentClient {
    /// Starts a client on `stream` (a reader thread is started; it ends when the stream does
    /// or the last clone of the client is dropped).
    pub fn new(stream: UnixStream) -> Result<AgentClient, AgentError> {
        let read_half = stream.try_clone()?;
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            broken: Mutex::new(None),
            ready: Mutex::new(None),
            setup_error: Mutex::new(None),
            ready_cv: Condvar::new(),
        });
        let s2 = shared.clone();
        let reader = std::thread::Builder::new()
            .name("microvm-agent-rx".into())
            .spawn(move || reader_loop(read_half, s2))?;
        Ok(AgentClient {
            inner: Arc::new(Inner {
                shared,
                writer: Mutex::new(stream),
                next_id: AtomicU32::new(1),
                reader: Mutex::new(Some(reader)),
            }),
        })
    }

    /// The id the next request will get.
    pub fn next_id(&self) -> u32 {
        self.inner.next_id.load(Ordering::Relaxed)
    }

    /// Makes this client's request ids start at `first` at least: for a client on a restored
    /// guest, whose agent may still answer requests of the snapshotted client (ids below
    /// `first`); their frames then find no request and are dropped, never taken for a new
    /// request's.
    pub fn skip_ids_below(&self, first: u32) {
        self.inner.next_id.fetch_max(first, Ordering::Relaxed);
    }

    fn check_hash(found: u64) -> Result<(), AgentError> {
        if found == SOURCE_HASH {
            Ok(())
        } else {
            Err(AgentError::VersionMismatch {
                expected: SOURCE_HASH,
                found,
            })
        }
    }

    /// Waits for the agent's `Ready` announcement (sent once when it starts serving) and
    /// checks that the agent was built from this library's sources.
    /// A set-up failure the agent announced first (an image root that would not mount) is
    /// [`AgentError::GuestSetup`].
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), AgentError> {
        let deadline = Instant::now() + timeout;
        let shared = &self.inner.shared;
        let mut g = lock(&shared.ready);
        loop {
            if let Some(m) = lock(&shared.setup_error).clone() {
                return Err(AgentError::GuestSetup(m));
            }
            if let Some(h) = *g {
                return Self::check_hash(h);
            }
            if lock(&shared.broken).is_some() {
                return Err(shared.broken());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(AgentError::Timeout(timeout));
            }
            g = shared
                .ready_cv
                .wait_timeout(g, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Sends one request and registers for its answers.
    fn start(&self, req: &Request) -> Result<Call, AgentError> {
        let shared = &self.inner.shared;
        if lock(&shared.broken).is_some() {
            return Err(shared.broken());
        }
        let mut id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        if id == 0 {
            id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        }
        let frame = req.encode(id);
        if frame.len().saturating_sub(proto::HEADER_LEN) > proto::MAX_PAYLOAD {
            return Err(AgentError::TooLarge(format!(
                "{} bytes over the {}-byte frame limit",
                frame.len(),
                proto::MAX_PAYLOAD
            )));
        }
        let (tx, rx) = mpsc::sync_channel(QUEUE_FRAMES);
        lock(&shared.pending).insert(id, tx);
        let call = Call {
            client: self.clone(),
            id,
            rx,
        };
        let w = lock(&self.inner.writer);
        if let Err(e) = send_all(&w, &frame) {
            drop(w);
            // The guest end is gone (or the stream broke): the channel is over for everyone.
            shared.stop(AgentError::Closed(format!("writing to the agent: {e}")));
            return Err(shared.broken());
        }
        Ok(call)
    }

    /// Liveness and version check: returns the agent's source hash (equal to
    /// [`SOURCE_HASH`], else [`AgentError::VersionMismatch`]).
    pub fn ping(&self, timeout: Duration) -> Result<u64, AgentError> {
        let call = self.start(&Request::Ping)?;
        match call.recv(Some(timeout))? {
            Response::Pong { source_hash } => Self::check_hash(source_hash).map(|()| source_hash),
            r => Err(unexpected(&r)),
        }
    }

    /// Holds every frame of the agent until [`release`](Self::release) (see
    /// [`proto::Request::Hold`]); returns once the agent's last frame before the hold (its
    /// `Ok`) is here.
    pub fn hold(&self, timeout: Duration) -> Result<(), AgentError> {
        self.answered(&Request::Hold, timeout)
    }

    /// Ends a [`hold`](Self::hold).
    pub fn release(&self, timeout: Duration) -> Result<(), AgentError> {
        self.answered(&Request::Release, timeout)
    }

    /// Gives the guest a fresh identity (see [`proto::Request::Refresh`]): `hostname`, 64
    /// bytes from this host's random generator mixed into the guest's and a reseed, and this
    /// host's wall clock.
    pub fn refresh(&self, hostname: &str, timeout: Duration) -> Result<(), AgentError> {
        let unix_nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        self.refresh_at(hostname, unix_nanos, timeout)
    }

    /// [`refresh`](Self::refresh) with the wall clock set to `unix_nanos` (nanoseconds since
    /// the Unix epoch) instead of this host's.
    pub fn refresh_at(
        &self,
        hostname: &str,
        unix_nanos: u64,
        timeout: Duration,
    ) -> Result<(), AgentError> {
        let mut entropy = vec![0u8; 64];
        getrandom(&mut entropy)?;
        self.answered(
            &Request::Refresh {
                hostname: hostname.to_owned(),
                entropy,
                unix_nanos,
            },
            timeout,
        )
    }

    /// Makes the guest's TLS clients trust `ca_pem` (the egress proxy's interception CA, for
    /// proxy-held secrets; see [`proto::Request::Trust`]): its root's system bundle with the
    /// CA appended, at [`proto::CA_BUNDLE`] and over [`proto::SYSTEM_BUNDLE`].
    pub fn trust(&self, ca_pem: &str, timeout: Duration) -> Result<(), AgentError> {
        self.answered(
            &Request::Trust {
                ca_pem: ca_pem.as_bytes().to_vec(),
            },
            timeout,
        )
    }

    /// Moves the guest's `eth0` to `net` (`<addr>/<prefix>,<gateway>`, as
    /// [`GuestNetwork::agent_net`](crate::network::GuestNetwork::agent_net) gives it): a guest
    /// restored onto a network of its own (see [`proto::Request::Network`]).
    pub fn network(&self, net: &str, timeout: Duration) -> Result<(), AgentError> {
        self.answered(
            &Request::Network {
                net: net.to_owned(),
            },
            timeout,
        )
    }

    /// Sends `req` and waits for its `Ok`.
    fn answered(&self, req: &Request, timeout: Duration) -> Result<(), AgentError> {
        let call = self.start(req)?;
        match call.recv(Some(timeout))? {
            Response::Ok => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    /// Asks the agent to kill everything and power the guest off. The channel closing before
    /// the acknowledgement also counts as success.
    pub fn shutdown(&self, timeout: Duration) -> Result<(), AgentError> {
        let call = match self.start(&Request::Shutdown) {
            Ok(c) => c,
            Err(AgentError::Closed(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        match call.recv(Some(timeout)) {
            Ok(Response::Ok) | Err(AgentError::Closed(_)) => Ok(()),
            Ok(r) => Err(unexpected(&r)),
            Err(e) => Err(e),
        }
    }

    /// Sends raw bytes on the channel (tests of the agent's handling of malformed frames).
    #[doc(hidden)]
    pub fn send_raw(&self, bytes: &[u8]) -> Result<(), AgentError> {
        send_all(&lock(&self.inner.writer), bytes)?;
        Ok(())
    }

    /// Why the channel stopped, if it has (`None` while it works).
    pub fn failure(&self) -> Option<String> {
        lock(&self.inner.shared.broken)
            .as_ref()
            .map(ToString::to_string)
    }
}
