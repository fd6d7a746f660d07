//! Published ports ([`Sandbox::publish`](sandbox_core::Sandbox::publish)) through the guest
//! agent's `Connect` request: the host-side listener is [`sandbox_core::Ports`]'s; each
//! connection it accepts is a connection the agent opens to the port on the guest's loopback,
//! carried over the agent channel.
//!
//! Inbound only and independent of the guest's network device: it works under deny-all (no
//! device at all) and opens no way out. Flow control is the background processes' (see
//! [`process`](super::process)): the agent sends at most a window of the server's bytes, and
//! we grant it back only once the bytes were written towards the client, so a client that
//! does not read stalls its own connection, not the channel. The client's bytes go to the
//! agent one write at a time, each answered once the server's socket took it.

use std::io;

use sandbox_core::{Connection, Dialer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::process::frame_cost;
use super::*;

/// The server's bytes in flight to us per connection before we give them back.
const WINDOW: u32 = 256 * 1024;
/// Bytes buffered between the client's side and ours, each way.
const PIPE: usize = 64 * 1024;
/// How long the agent may take to write one chunk to the server.
const INPUT_TIMEOUT: Duration = Duration::from_secs(60);

/// Opens connections into the guest through its agent.
pub(super) struct AgentDialer {
    pub(super) agent: AgentClient,
    /// The open connections' request ids (a snapshot is refused while there are any).
    pub(super) open: Arc<Mutex<std::collections::BTreeSet<u32>>>,
}

#[async_trait]
impl Dialer for AgentDialer {
    async fn dial(&self, port: u16) -> io::Result<Box<dyn Connection>> {
        let agent = self.agent.clone();
        let handle = tokio::task::spawn_blocking(move || agent.start_connect(port, WINDOW))
            .await
            .map_err(io::Error::other)?
            .map_err(|e| match e {
                AgentError::Remote {
                    kind: ErrorKind::NotFound,
                    message,
                } => io::Error::new(io::ErrorKind::ConnectionRefused, message),
                other => io::Error::other(other.to_string()),
            })?;
        let target = handle.id();
        lock(&self.open).insert(target);
        let (ours, theirs) = tokio::io::duplex(PIPE);
        let (mut from_client, to_client) = tokio::io::split(theirs);
        // The server's bytes, towards the client: a thread, as the agent client blocks.
        let rt = tokio::runtime::Handle::current();
        let agent = self.agent.clone();
        let open = Arc::clone(&self.open);
        let started = std::thread::Builder::new()
            .name(format!("microvm-port-{port}"))
            .spawn(move || {
                server_to_client(&rt, &agent, handle, to_client);
                lock(&open).remove(&target);
            });
        if let Err(e) = started {
            lock(&self.open).remove(&target);
            return Err(e);
        }
        // The client's bytes, towards the server.
        let agent = self.agent.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 32 * 1024];
            loop {
                let n = match from_client.read(&mut buf).await {
                    Ok(0) | Err(_) => 0,
                    Ok(n) => n,
                };
                let a = agent.clone();
                if n == 0 {
                    // The client is done sending: the server reads its end.
                    let _ =
                        tokio::task::spawn_blocking(move || a.close_input(target, INPUT_TIMEOUT))
                            .await;
                    return;
                }
                let data = buf.get(..n).unwrap_or_default().to_vec();
                let sent =
                    tokio::task::spawn_blocking(move || a.input(target, &data, INPUT_TIMEOUT))
                        .await;
                if !matches!(sent, Ok(Ok(()))) {
                    // The server closed its input, or the connection ended.
                    return;
                }
            }
        });
        Ok(Box::new(ours))
    }
}

/// Forwards what the server sends until it closes (then the client's side is shut down for
/// writing) or the client goes (then the connection is aborted in the guest).
fn server_to_client(
    rt: &tokio::runtime::Handle,
    agent: &AgentClient,
    mut handle: agent_client::ExecHandle,
    mut to_client: tokio::io::WriteHalf<tokio::io::DuplexStream>,
) {
    let target = handle.id();
    loop {
        match handle.next_event() {
            Ok(agent_client::ExecEvent::Stdout(data)) => {
                if rt.block_on(to_client.write_all(&data)).is_err() {
                    // Nobody reads any more: end it in the guest too.
                    let _ = handle.kill();
                    return;
                }
                if agent.grant(target, frame_cost(data.len())).is_err() {
                    return;
                }
            }
            Ok(agent_client::ExecEvent::Stderr(_)) => {}
            Ok(agent_client::ExecEvent::Exit(_)) | Err(_) => {
                let _ = rt.block_on(to_client.shutdown());
                return;
            }
        }
    }
}

impl Inner {
    /// A dialer into this sandbox, while it runs.
    pub(super) fn dialer(&self) -> Result<Arc<dyn Dialer>> {
        let (agent, _) = self.handles()?;
        Ok(Arc::new(AgentDialer {
            agent,
            open: Arc::clone(&self.connections),
        }))
    }

    /// The open published-port connections, for a snapshot's refusal.
    pub(super) fn open_connections(&self) -> usize {
        lock(&self.connections).len()
    }
}

#[cfg(test)]
mod tests {
    //! Against the real agent binary as a host process (see the sandbox module's tests): the
    //! guest's loopback is then the host's, so the servers here are the test's own.
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::super::tests::over_a_host_agent::{assert_still_served, sandbox, spec};
    use super::*;
    use sandbox_core::Sandbox;
    use tokio::net::{TcpListener, TcpStream};

    const ANY: &str = "127.0.0.1:0";

    /// A server that reads until the client half-closes, then answers `got:<n bytes>:` and
    /// what it read, and closes.
    async fn echo_after_eof() -> u16 {
        let l = TcpListener::bind(ANY).await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut all = Vec::new();
                    s.read_to_end(&mut all).await.unwrap();
                    s.write_all(format!("got:{}:", all.len()).as_bytes())
                        .await
                        .unwrap();
                    s.write_all(&all).await.unwrap();
                    s.shutdown().await.unwrap();
                });
            }
        });
        port
    }

    /// Whether `at` stops accepting within 5 s (the listener's task is cancelled, and so
    /// closed, on the runtime's next turn).
    async fn closes(at: std::net::SocketAddr) -> bool {
        for _ in 0..250 {
            if TcpStream::connect(at).await.is_err() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    async fn roundtrip(at: std::net::SocketAddr, data: &[u8]) -> Vec<u8> {
        let mut c = TcpStream::connect(at).await.unwrap();
        let (mut r, mut w) = c.split();
        let (_, got) = tokio::join!(
            async {
                w.write_all(data).await.unwrap();
                w.shutdown().await.unwrap();
            },
            async {
                let mut got = Vec::new();
                tokio::time::timeout(Duration::from_secs(60), r.read_to_end(&mut got))
                    .await
                    .unwrap()
                    .unwrap();
                got
            }
        );
        got
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_published_port_carries_both_ways_and_half_closes() {
        let (s, _ws) = sandbox(spec());
        let port = echo_after_eof().await;
        let at = s.publish(port, ANY.parse().unwrap()).await.unwrap();
        assert_ne!(at.port(), 0);
        let listed = s.published().await.unwrap();
        assert_eq!((listed[0].sandbox_port, listed[0].host), (port, at));
        assert_eq!(roundtrip(at, b"hello").await, b"got:5:hello");
        // Several MiB each way, through the windows and the chunking.
        let big: Vec<u8> = (0..6 << 20).map(|i: u32| (i % 251) as u8).collect();
        let got = roundtrip(at, &big).await;
        let head = format!("got:{}:", big.len());
        assert_eq!(&got[..head.len()], head.as_bytes());
        assert!(got[head.len()..] == big[..], "the bytes came back changed");
        // Bad input: the same address twice, port 0 inside.
        let e = s.publish(port, at).await.unwrap_err();
        assert!(matches!(e, Error::InvalidSpec { .. }), "{e}");
        let e = s.publish(0, ANY.parse().unwrap()).await.unwrap_err();
        assert!(matches!(e, Error::InvalidSpec { .. }), "{e}");
        s.unpublish(at).await.unwrap();
        assert!(closes(at).await, "still listening");
        let e = s.unpublish(at).await.unwrap_err();
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
        s.destroy().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nothing_listening_inside_closes_the_client() {
        let (s, _ws) = sandbox(spec());
        // A port nothing listens on: bind one, then free it.
        let free = TcpListener::bind(ANY).await.unwrap();
        let port = free.local_addr().unwrap().port();
        drop(free);
        let at = s.publish(port, ANY.parse().unwrap()).await.unwrap();
        let mut c = TcpStream::connect(at).await.unwrap();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(30), c.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        assert_eq!(n, 0, "the client's connection is closed");
        s.destroy().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_does_not_read_holds_its_connection_not_the_channel() {
        const N: usize = 16 << 20;
        let l = TcpListener::bind(ANY).await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let chunk = vec![7u8; 1 << 20];
            for _ in 0..N >> 20 {
                if s.write_all(&chunk).await.is_err() {
                    return;
                }
            }
            let _ = s.shutdown().await;
        });
        let (s, _ws) = sandbox(spec());
        let at = s.publish(port, ANY.parse().unwrap()).await.unwrap();
        let mut c = TcpStream::connect(at).await.unwrap();
        // The client reads nothing: the server is held back, the channel still serves.
        assert_still_served(&s).await;
        // Then it reads: every byte arrives.
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.len(), N);
        assert!(got.iter().all(|b| *b == 7));
        s.destroy().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snapshot_is_refused_while_a_connection_is_open() {
        let (s, _ws) = sandbox(spec());
        let dir = tempfile::tempdir().unwrap();
        let store = sandbox_core::ObjectSnapshotStore::local(dir.path()).unwrap();
        let port = echo_after_eof().await;
        let at = s.publish(port, ANY.parse().unwrap()).await.unwrap();
        let mut c = TcpStream::connect(at).await.unwrap();
        c.write_all(b"x").await.unwrap();
        // Open (the server waits for our end): refused, naming why.
        let mut why = String::new();
        for _ in 0..100 {
            match s.snapshot(&store).await.unwrap_err() {
                Error::Unsupported { what, .. } if what.contains("published port") => {
                    why = what;
                    break;
                }
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        assert!(why.contains("open connections (1"), "{why}");
        // Closed: the snapshot goes past that check (to this test agent's own refusal).
        c.shutdown().await.unwrap();
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"got:1:x");
        let mut last = String::new();
        for _ in 0..250 {
            match s.snapshot(&store).await.unwrap_err() {
                Error::Unsupported { what, .. } if what.contains("published port") => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                e => {
                    last = e.to_string();
                    break;
                }
            }
        }
        assert!(last.contains("host-process test agent"), "{last}");
        s.destroy().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn destroy_closes_the_ports_and_later_calls_are_gone() {
        let (s, _ws) = sandbox(spec());
        let port = echo_after_eof().await;
        let at = s.publish(port, ANY.parse().unwrap()).await.unwrap();
        s.destroy().await.unwrap();
        assert!(closes(at).await, "still listening");
        for e in [
            s.publish(port, ANY.parse().unwrap()).await.unwrap_err(),
            s.published().await.unwrap_err(),
        ] {
            assert!(matches!(e, Error::SandboxGone { .. }), "{e}");
        }
    }
}
