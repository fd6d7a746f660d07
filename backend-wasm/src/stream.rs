//! Streaming exec: taps that copy a guest's output to the async side as it is written.
//!
//! A guest writes on its (synchronous) guest thread; a [`Tap`] forwards the bytes over an
//! unbounded channel to a [`TapReader`], which `sandbox_core::pump_output` reads like any
//! pipe: it caps, redacts across chunk boundaries (`StreamRedactor`) and emits the chunks.
//! The channel stays bounded in practice: a tap forwards at most `cap + 1` bytes (the extra
//! byte tells the pump that the output was cut, so a secret cut by the cap is redacted
//! rather than half-shown); the rest is only counted by the guest-side `OutputBuffer`.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// The sending end of one stream's tap. Clones share the budget; the reader sees the end
/// of the stream when every clone is dropped.
#[derive(Clone)]
pub(crate) struct Tap {
    tx: UnboundedSender<Bytes>,
    left: Arc<AtomicU64>,
}

impl Tap {
    /// Forwards as much of `b` as the budget allows.
    pub(crate) fn push(&self, b: &[u8]) {
        if b.is_empty() {
            return;
        }
        let want = b.len() as u64;
        let Ok(prev) = self
            .left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                (left > 0).then(|| left.saturating_sub(want))
            })
        else {
            return;
        };
        let take = usize::try_from(prev.min(want)).unwrap_or(b.len());
        // A dropped reader only means nobody listens any more.
        let _ = self.tx.send(Bytes::copy_from_slice(&b[..take]));
    }

    /// Forwards `b` regardless of the budget (the host's own notes; the pump still caps).
    pub(crate) fn note(&self, b: &[u8]) {
        let _ = self.tx.send(Bytes::copy_from_slice(b));
    }
}

/// The reading end of a tap (an `AsyncRead` for `pump_output`).
pub(crate) struct TapReader {
    rx: UnboundedReceiver<Bytes>,
    cur: Bytes,
}

impl AsyncRead for TapReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        while self.cur.is_empty() {
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(b)) => self.cur = b,
                // Every tap dropped: end of stream (nothing filled).
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
        let n = buf.remaining().min(self.cur.len());
        let chunk = self.cur.split_to(n);
        buf.put_slice(&chunk);
        Poll::Ready(Ok(()))
    }
}

/// A tap for a stream capped at `cap` bytes, and its reader.
pub(crate) fn tap(cap: u64) -> (Tap, TapReader) {
    let (tx, rx) = unbounded_channel();
    (
        Tap {
            tx,
            left: Arc::new(AtomicU64::new(cap.saturating_add(1))),
        },
        TapReader {
            rx,
            cur: Bytes::new(),
        },
    )
}

/// The taps of one streamed call.
#[derive(Clone)]
pub(crate) struct Taps {
    pub(crate) out: Tap,
    pub(crate) err: Tap,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn tap_forwards_up_to_cap_plus_one_then_ends() {
        let (t, mut r) = tap(4);
        t.push(b"ab");
        t.clone().push(b"cdef");
        t.push(b"gh");
        t.note(b"!");
        drop(t);
        let mut got = Vec::new();
        r.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"abcde!");
    }
}
