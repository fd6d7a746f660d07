//! Published ports: a host-side TCP listener whose connections are forwarded to a port
//! inside a sandbox.
//!
//! Inbound only: the backend's [`Dialer`] opens each connection *into* the sandbox's network
//! (the container tier has its init create the socket in the sandbox's network namespace),
//! so publishing works under [`NetworkPolicy::DenyAll`](crate::NetworkPolicy::DenyAll) and
//! opens no way out. A [`Ports`] table closes every listener and connection when it is
//! cleared (on destroy) or dropped.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::{Error, Result};

/// One published port. `#[non_exhaustive]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PublishedPort {
    /// The TCP port inside the sandbox.
    pub sandbox_port: u16,
    /// Where the host listens (the port the OS chose when the caller asked for port 0).
    pub host: SocketAddr,
}

/// A connection into a sandbox: a byte stream both ways (a TCP stream made in the
/// sandbox's network namespace, or the stdio of a relay running inside it).
pub trait Connection: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Connection for T {}

/// A backend's way into a sandbox's network: a connection to `port` on the sandbox's
/// loopback (or its address).
#[async_trait]
pub trait Dialer: Send + Sync + 'static {
    /// Connects to `port` inside the sandbox. An error (nothing listens there, say) closes
    /// the client's connection.
    async fn dial(&self, port: u16) -> std::io::Result<Box<dyn Connection>>;
}

/// A running forwarder: the listener's task and its connections end when it is dropped.
#[derive(Debug)]
struct Forwarder {
    port: PublishedPort,
    task: tokio::task::JoinHandle<()>,
    /// A second descriptor of the listening socket, to stop it listening at once on drop
    /// (the task's own is closed only when the runtime next drops the aborted task).
    listening: Option<OwnedFd>,
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        if let Some(fd) = self.listening.take() {
            // `shutdown` on a listening socket takes it out of the listening state now: a
            // client connecting after `unpublish` returned is refused. std has no listener
            // shutdown; a TcpStream over the same descriptor calls the same shutdown(2).
            let _ = std::net::TcpStream::from(fd).shutdown(std::net::Shutdown::Both);
        }
        // Dropping the task's JoinSet aborts every connection it forwards.
        self.task.abort();
    }
}

/// A sandbox's published ports, for backends. Cloning shares the table.
#[derive(Debug, Clone, Default)]
pub struct Ports {
    inner: Arc<Mutex<BTreeMap<SocketAddr, Forwarder>>>,
}

impl Ports {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Listens on `host` and forwards each connection to `sandbox_port` through `dialer`.
    /// Returns the address listened on (port 0 in `host`: the OS picks one).
    ///
    /// Errors: port 0 inside, a host address already published or in use (the OS's error,
    /// named), a host address that is not this machine's.
    pub async fn publish(
        &self,
        sandbox_port: u16,
        host: SocketAddr,
        dialer: Arc<dyn Dialer>,
    ) -> Result<SocketAddr> {
        if sandbox_port == 0 {
            return Err(Error::invalid(
                "port",
                "sandbox port 0 is not a port; name the port the server inside listens on",
            ));
        }
        if host.port() != 0 && self.lock().contains_key(&host) {
            return Err(Error::invalid(
                "port",
                format!("{host} is already published from this sandbox; unpublish it first"),
            ));
        }
        let listener = TcpListener::bind(host).await.map_err(|e| {
            let hint = match e.kind() {
                std::io::ErrorKind::AddrInUse => {
                    " (another program listens there; pick another port or 0)"
                }
                std::io::ErrorKind::AddrNotAvailable => " (not an address of this host)",
                std::io::ErrorKind::PermissionDenied => " (ports below 1024 need privileges)",
                _ => "",
            };
            Error::io(
                format!("publish sandbox port {sandbox_port} on {host}{hint}"),
                e,
            )
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("read the published listener's address", e))?;
        let listening = listener.as_fd().try_clone_to_owned().ok();
        let task = tokio::spawn(forward(listener, sandbox_port, dialer));
        let fwd = Forwarder {
            port: PublishedPort {
                sandbox_port,
                host: local,
            },
            task,
            listening,
        };
        self.lock().insert(local, fwd);
        Ok(local)
    }

    /// Stops listening on `host` and closes its connections. [`Error::NotFound`] when
    /// nothing is published there.
    pub fn unpublish(&self, host: SocketAddr) -> Result<()> {
        match self.lock().remove(&host) {
            Some(_) => Ok(()),
            None => Err(Error::NotFound {
                path: format!("published port {host}"),
            }),
        }
    }

    /// What is published, by host address.
    pub fn list(&self) -> Vec<PublishedPort> {
        self.lock().values().map(|f| f.port).collect()
    }

    /// Closes every listener and connection (the sandbox ends).
    pub fn clear(&self) {
        let all = std::mem::take(&mut *self.lock());
        drop(all);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<SocketAddr, Forwarder>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

async fn forward(listener: TcpListener, port: u16, dialer: Arc<dyn Dialer>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            a = listener.accept() => {
                let Ok((mut outside, _)) = a else {
                    // Out of fds or similar: back off a little instead of spinning.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                let dialer = Arc::clone(&dialer);
                conns.spawn(async move {
                    let _ = outside.set_nodelay(true);
                    // Nothing listens inside (yet): the client sees the connection close.
                    if let Ok(mut inside) = dialer.dial(port).await {
                        let _ = tokio::io::copy_bidirectional(&mut outside, &mut inside).await;
                    }
                });
            }
            // Reap finished connections so the set does not grow.
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// "Inside" is a loopback listener here: the forwarding itself is what is tested.
    struct Loopback(u16);

    #[async_trait]
    impl Dialer for Loopback {
        async fn dial(&self, port: u16) -> std::io::Result<Box<dyn Connection>> {
            assert_eq!(port, 4242);
            Ok(Box::new(TcpStream::connect(("127.0.0.1", self.0)).await?))
        }
    }

    #[tokio::test]
    async fn connections_are_forwarded_until_unpublished() {
        let inside = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let inside_port = inside.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = inside.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 5];
                    if s.read_exact(&mut b).await.is_ok() {
                        let _ = s.write_all(&b.to_ascii_uppercase()).await;
                    }
                });
            }
        });
        let ports = Ports::new();
        let d: Arc<dyn Dialer> = Arc::new(Loopback(inside_port));
        let at = ports
            .publish(4242, "127.0.0.1:0".parse().unwrap(), Arc::clone(&d))
            .await
            .unwrap();
        assert_ne!(at.port(), 0);
        let mut c = TcpStream::connect(at).await.unwrap();
        c.write_all(b"hello").await.unwrap();
        let mut b = [0u8; 5];
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"HELLO");
        assert_eq!(ports.list()[0].sandbox_port, 4242);

        let twice = ports.publish(4242, at, Arc::clone(&d)).await.unwrap_err();
        assert!(twice.to_string().contains("already published"), "{twice}");
        let zero = ports
            .publish(0, "127.0.0.1:0".parse().unwrap(), Arc::clone(&d))
            .await
            .unwrap_err();
        assert!(zero.to_string().contains("port 0"), "{zero}");
        let busy = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let taken = ports
            .publish(4242, busy.local_addr().unwrap(), Arc::clone(&d))
            .await
            .unwrap_err();
        assert!(
            taken.to_string().contains("another program listens"),
            "{taken}"
        );

        ports.unpublish(at).unwrap();
        assert!(
            ports.unpublish(at).is_err(),
            "unpublishing twice is NotFound"
        );
        // The listener stopped listening when unpublish returned.
        assert!(
            TcpStream::connect(at).await.is_err(),
            "{at} still accepts after unpublish"
        );
    }
}
