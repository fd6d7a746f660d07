//! Published ports ([`Sandbox::publish`](sandbox_core::Sandbox::publish)) through a relay
//! inside the sandbox.
//!
//! gVisor's network stack lives in its Sentry, not in a network namespace we could make a
//! socket in (and under deny-all there is none at all: `--network=none`), and this runsc has
//! no port-forwarding call. So each connection to a published port starts the relay
//! ([`bundle::RELAY_PATH`], embedded in this crate) with `runsc exec`: it connects to the
//! port on the sandbox's loopback, answers one status byte, then relays its stdin and
//! stdout, which are our pipes. Inbound only: the relay is a process of the sandbox, with
//! its limits, and nothing outside is reachable through it.

use std::sync::Weak;

use sandbox_core::{Connection, Dialer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

use super::exec::{RunscExec, Stdin};
use super::*;

/// How long the relay may take to start and connect before the client is turned away.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// The gVisor tier's way into a sandbox's network (see the module docs).
pub(super) struct RelayDialer(pub Weak<Inner>);

#[async_trait]
impl Dialer for RelayDialer {
    async fn dial(&self, port: u16) -> std::io::Result<Box<dyn Connection>> {
        use std::io::{Error as IoError, ErrorKind};
        let gone = || IoError::new(ErrorKind::NotConnected, "the sandbox is gone");
        let inner = self.0.upgrade().ok_or_else(gone)?;
        // Shared with execs: a snapshot does not start while the relay does.
        let shared = inner.lifecycle.read().await;
        inner.alive().map_err(|_| gone())?;
        let argv = vec![bundle::RELAY_PATH.to_string(), port.to_string()];
        let RunscExec {
            mut child,
            pfile,
            pidfile,
            ..
        } = inner
            .runsc_exec_on("relay", argv, Vec::new(), "/", Stdin::Pipe)
            .map_err(|e| IoError::other(e.to_string()))?;
        drop(shared);
        let files = Files(vec![pfile, pidfile]);
        let (Some(mut out), Some(input), Some(mut err)) =
            (child.stdout.take(), child.stdin.take(), child.stderr.take())
        else {
            return Err(IoError::other("runsc exec without its pipes"));
        };
        // runsc's own messages: read so it never blocks on them, kept for a refusal.
        let errors = tokio::spawn(async move {
            let mut text = Vec::new();
            let _ = (&mut err).take(4096).read_to_end(&mut text).await;
            let _ = tokio::io::copy(&mut err, &mut tokio::io::sink()).await;
            String::from_utf8_lossy(&text).trim().to_string()
        });
        let mut status = [0u8; 1];
        match tokio::time::timeout(CONNECT_TIMEOUT, out.read_exact(&mut status)).await {
            Ok(Ok(_)) if status[0] == b'0' => {}
            Ok(Ok(_)) => {
                // `1` and the reason, from the relay.
                let mut why = String::new();
                let _ = (&mut out).take(1024).read_to_string(&mut why).await;
                return Err(IoError::new(
                    ErrorKind::ConnectionRefused,
                    format!("port {port} inside the sandbox: {}", why.trim()),
                ));
            }
            Ok(Err(_)) => {
                // The relay did not start: runsc says why.
                let _ = child.wait().await;
                let why = errors.await.unwrap_or_default();
                return Err(IoError::other(format!(
                    "the port relay did not start in the sandbox: {why}"
                )));
            }
            Err(_) => {
                return Err(IoError::new(
                    ErrorKind::TimedOut,
                    "the port relay did not connect in time",
                ))
            }
        }
        inner.relays.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(Relay {
            out,
            input: Some(input),
            _child: child,
            _files: files,
            inner: Arc::downgrade(&inner),
        }))
    }
}

/// The relay's process files, removed when its connection ends.
struct Files(Vec<PathBuf>);

impl Drop for Files {
    fn drop(&mut self) {
        for f in &self.0 {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// One relayed connection: the relay's stdout to read, its stdin to write. Dropping it
/// kills the relay (`kill_on_drop`), which closes its connection inside.
struct Relay {
    out: tokio::process::ChildStdout,
    /// `None` once the client's input ended (closing the pipe is the relay's EOF).
    input: Option<tokio::process::ChildStdin>,
    _child: tokio::process::Child,
    _files: Files,
    inner: Weak<Inner>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.relays.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl AsyncRead for Relay {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.out).poll_read(cx, buf)
    }
}

impl AsyncWrite for Relay {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.input.as_mut() {
            Some(w) => std::pin::Pin::new(w).poll_write(cx, buf),
            None => std::task::Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.input.as_mut() {
            Some(w) => std::pin::Pin::new(w).poll_flush(cx),
            None => std::task::Poll::Ready(Ok(())),
        }
    }

    /// The client's end of input: closing the pipe makes the relay half-close its
    /// connection inside.
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.input = None;
        std::task::Poll::Ready(Ok(()))
    }
}

impl Inner {
    /// Publishes `sandbox_port` on `host` (see the module docs).
    pub(super) async fn publish(
        self: &Arc<Self>,
        sandbox_port: u16,
        host: std::net::SocketAddr,
    ) -> Result<std::net::SocketAddr> {
        self.alive()?;
        if !self.relay.load(Ordering::SeqCst) {
            return Err(Error::unsupported(
                TIER,
                "published ports for this sandbox: the port relay could not be put into its \
                 root (see the log)",
            ));
        }
        let dialer = Arc::new(RelayDialer(Arc::downgrade(self)));
        self.ports.publish(sandbox_port, host, dialer).await
    }
}
