//! The guest's standard streams: capped in-memory output pipes (which a streamed call taps)
//! and a standard input refilled between Python turns.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use sandbox_core::OutputBuffer;
use tokio::io::{AsyncRead, AsyncWrite};
use wasmtime_wasi::cli::{IsTerminal, StdinStream, StdoutStream};
use wasmtime_wasi::p2::{InputStream, OutputStream, Pollable, StreamError, StreamResult};

use crate::stream::Tap;

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

    pub(super) fn push(&self, b: &[u8]) {
        let mut g = self.state();
        g.buf.push(b);
        if let Some(t) = &g.tap {
            t.push(b);
        }
    }

    /// Whether the call's output is a flood to stop (the `output` limit).
    pub(super) fn flooded(&self) -> bool {
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
