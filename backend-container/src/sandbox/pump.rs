//! Output pumps: pipes, and the task that reads one into a capped buffer while streaming it,
//! redacted.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use bytes::Bytes;
use sandbox_core::{ExecEvent, OutputBuffer, Redactor, Result, StreamRedactor};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{mpsc, watch, Notify};

pub(crate) fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut p = [0 as RawFd; 2];
    // SAFETY: pipe2 with a valid out array.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel gave us these fds.
    Ok(unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) })
}

pub(crate) fn set_nonblocking(fd: RawFd) {
    // SAFETY: fcntl on an fd we own.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
}

/// Where a pump streams its pipe's chunks: redacted (also a secret split across chunks),
/// the first `cap` bytes (an exec's output cap; a background process's output is not capped
/// here: its bounded channel holds the process back instead).
pub(crate) struct PumpSink {
    pub tx: mpsc::Sender<Result<ExecEvent>>,
    pub redactor: StreamRedactor,
    pub cap: u64,
}

impl PumpSink {
    pub(crate) fn new(tx: mpsc::Sender<Result<ExecEvent>>, redactor: &Redactor, cap: u64) -> Self {
        PumpSink {
            tx,
            redactor: StreamRedactor::new(redactor.clone()),
            cap,
        }
    }
}

/// Reads a pipe until EOF or until told to stop (then drains what is already there), keeping
/// the first `cap` bytes and streaming to `sink`; past `flood_at` bytes, `flood` is notified.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn pump(
    fd: OwnedFd,
    cap: u64,
    flood_at: u64,
    mut sink: Option<PumpSink>,
    stdout: bool,
    mut stop: watch::Receiver<bool>,
    flood: Arc<Notify>,
) -> OutputBuffer {
    let mut buf = OutputBuffer::new(cap);
    set_nonblocking(fd.as_raw_fd());
    // SAFETY: `fd` is an open pipe owned by the AsyncFd for its whole life.
    let Ok(afd) = (unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }) else {
        return buf;
    };
    let mut chunk = vec![0u8; 16 * 1024];
    let (mut seen, mut streamed) = (0u64, 0u64);
    let mut flooded = false;
    let event = move |b: Vec<u8>| {
        let b = Bytes::from(b);
        if stdout {
            ExecEvent::Stdout(b)
        } else {
            ExecEvent::Stderr(b)
        }
    };
    let raw_read = |fd: RawFd, chunk: &mut [u8]| {
        // SAFETY: read into a buffer we own.
        let n = unsafe { libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len()) };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    };
    macro_rules! take {
        ($n:expr) => {{
            let n = $n;
            seen += n as u64;
            buf.push(&chunk[..n]);
            if let Some(s) = &mut sink {
                let room = s.cap.saturating_sub(streamed);
                let take = usize::try_from(room).unwrap_or(usize::MAX).min(n);
                if take > 0 {
                    streamed += take as u64;
                    let out = s.redactor.push(&chunk[..take]);
                    if !out.is_empty() {
                        // A dropped receiver only means nobody listens any more.
                        let _ = s.tx.send(Ok(event(out))).await;
                    }
                }
            }
            if seen > flood_at && !flooded {
                flooded = true;
                flood.notify_one();
            }
        }};
    }
    loop {
        tokio::select! {
            g = afd.readable() => {
                let Ok(mut g) = g else { break };
                match g.try_io(|f| raw_read(f.as_raw_fd(), &mut chunk)) {
                    Ok(Ok(0)) => break,
                    Ok(Ok(n)) => take!(n),
                    Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Ok(Err(_)) => break,
                    Err(_would_block) => {}
                }
            }
            r = stop.changed() => {
                // The command exited: take what it wrote, not what a background child
                // keeps writing (bounded), then stop.
                let _ = r;
                let mut budget: u64 = 1 << 20;
                while budget > 0 {
                    match raw_read(afd.get_ref().as_raw_fd(), &mut chunk) {
                        Ok(0) => break,
                        Ok(n) => { budget = budget.saturating_sub(n as u64); take!(n) }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
                break;
            }
        }
    }
    if let Some(s) = &mut sink {
        let rest = s.redactor.finish(streamed >= s.cap && seen > streamed);
        if !rest.is_empty() {
            let _ = s.tx.send(Ok(event(rest))).await;
        }
    }
    buf
}
