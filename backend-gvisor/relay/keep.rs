//! Background processes that survive a checkpoint: `relay keep NAME -- ARGV...` and
//! `relay attach NAME`.
//!
//! `runsc checkpoint` saves every process of a sandbox, but a process whose stdio are the
//! host's pipes (what `runsc exec` gives it) cannot be restored. So a background process is
//! started by a keeper inside the sandbox that holds nothing of the host:
//!
//! - `keep` starts `serve` (this program again) with `/dev/null` as its stdio and returns
//!   once `serve` has started the command: it prints `0 PID` (or `1 REASON`) and exits.
//! - `serve` runs the command in a process group of its own, on pipes it holds, and listens
//!   on the abstract Unix socket `@agent-sandbox/proc/NAME`. It forwards the command's output
//!   to the client that attached, its input from that client, and its exit status; with no
//!   client attached it reads nothing, so a command that writes more than its pipe holds
//!   waits (nothing is buffered here but one chunk per stream). It ends once a client has
//!   taken the exit status.
//! - `attach` connects to that socket and copies bytes both ways between it and its own
//!   stdio (the host's pipes); it is killed before a checkpoint and started again after.
//!
//! Frames, both ways: one type byte, a 4-byte big-endian length, the payload.
//! From `serve`: `H` hello (the command's pid, decimal), `O`/`E` output, `X` exit (the code,
//! decimal; 128+N for signal N), `D` detached, `F` the command could not start (why).
//! To `serve`: `A` attach (start forwarding to me), `I` input, `C` close input, `D` detach
//! (stop forwarding; answered by `D`, after which nothing more is sent on this connection).

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Longest frame payload accepted from a client.
const MAX_FRAME: usize = 1 << 20;

fn socket_addr(name: &str) -> std::io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(format!("agent-sandbox/proc/{name}").as_bytes())
}

fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(payload.len())
        .map_err(|_| std::io::Error::other("frame too long"))?
        .to_be_bytes();
    let mut head = [kind, 0, 0, 0, 0];
    head[1..].copy_from_slice(&len);
    w.write_all(&head)?;
    w.write_all(payload)?;
    w.flush()
}

fn read_frame(r: &mut impl Read) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head)?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other("frame too long"));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `relay keep NAME -- ARGV...`
pub fn keep(args: &[String]) -> i32 {
    let mut out = std::io::stdout().lock();
    let (Some(name), Some("--")) = (args.first(), args.get(1).map(String::as_str)) else {
        let _ = out.write_all(b"1 usage: relay keep NAME -- ARGV...\n");
        return 2;
    };
    let Ok(me) = std::env::current_exe() else {
        let _ = out.write_all(b"1 cannot find the relay itself\n");
        return 1;
    };
    let spawned = Command::new(me)
        .arg("serve")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    if let Err(e) = spawned {
        let _ = writeln!(out, "1 cannot start the keeper: {e}");
        return 1;
    }
    // The keeper says how the command started to whoever connects first.
    let end = Instant::now() + Duration::from_secs(10);
    let reply = loop {
        match socket_addr(name).and_then(|a| UnixStream::connect_addr(&a)) {
            Ok(mut s) => break read_frame(&mut s),
            Err(e) if Instant::now() > end => break Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    match reply {
        Ok((b'H', pid)) => {
            let _ = writeln!(out, "0 {}", String::from_utf8_lossy(&pid));
            0
        }
        Ok((b'F', why)) => {
            let _ = writeln!(out, "1 {}", String::from_utf8_lossy(&why));
            1
        }
        Ok((k, _)) => {
            let _ = writeln!(out, "1 unexpected frame {k} from the keeper");
            1
        }
        Err(e) => {
            let _ = writeln!(out, "1 the keeper did not answer: {e}");
            1
        }
    }
}

/// The keeper's shared state.
struct Shared {
    /// The attached client, if any, and a generation count bumped on every change.
    client: Mutex<(Option<UnixStream>, u64)>,
    changed: Condvar,
    stdin: Mutex<Option<ChildStdin>>,
}

impl Shared {
    /// Waits for an attached client; returns a copy of it and its generation.
    fn attached(&self) -> (UnixStream, u64) {
        let mut g = lock(&self.client);
        loop {
            if let Some(s) = g.0.as_ref().and_then(|s| s.try_clone().ok()) {
                return (s, g.1);
            }
            g = self.changed.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Sends a frame to the attached client (waiting for one); a client that fails is
    /// dropped and the frame goes to the next.
    fn send(&self, kind: u8, payload: &[u8]) {
        loop {
            let (_, generation) = self.attached();
            let mut g = lock(&self.client);
            if g.1 != generation {
                continue;
            }
            let Some(s) = g.0.as_mut() else { continue };
            if write_frame(s, kind, payload).is_ok() {
                return;
            }
            g.0 = None;
            g.1 += 1;
            self.changed.notify_all();
        }
    }

    fn set_client(&self, s: Option<UnixStream>) {
        let mut g = lock(&self.client);
        g.0 = s;
        g.1 += 1;
        self.changed.notify_all();
    }
}

/// One connection: hello, then its requests.
fn serve_client(shared: &Shared, mut conn: UnixStream, pid: u32) {
    if write_frame(&mut conn, b'H', pid.to_string().as_bytes()).is_err() {
        return;
    }
    let Ok(mut reader) = conn.try_clone() else {
        return;
    };
    let mut mine = None;
    while let Ok((kind, payload)) = read_frame(&mut reader) {
        match kind {
            b'A' => {
                if let Ok(c) = conn.try_clone() {
                    shared.set_client(Some(c));
                    mine = Some(lock(&shared.client).1);
                }
            }
            b'I' => {
                let mut g = lock(&shared.stdin);
                if let Some(w) = g.as_mut() {
                    if w.write_all(&payload).is_err() {
                        *g = None;
                    }
                }
            }
            b'C' => {
                lock(&shared.stdin).take();
            }
            b'D' => {
                // Under the client lock: no output frame follows the answer.
                let mut g = lock(&shared.client);
                if mine == Some(g.1) {
                    g.0 = None;
                    g.1 += 1;
                    shared.changed.notify_all();
                }
                mine = None;
                let _ = write_frame(&mut conn, b'D', b"");
                drop(g);
                return;
            }
            _ => {}
        }
    }
    // Gone without detaching: stop forwarding to it.
    let mut g = lock(&shared.client);
    if mine.is_some() && mine == Some(g.1) {
        g.0 = None;
        g.1 += 1;
        shared.changed.notify_all();
    }
}

/// Forwards one output stream, a chunk at a time, only while a client is attached.
fn pump(shared: Arc<Shared>, mut from: impl Read, kind: u8) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Read nothing while nobody listens: the command waits, nothing piles up here.
        drop(shared.attached());
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => shared.send(kind, &buf[..n]),
        }
    }
}

/// `relay serve NAME -- ARGV...` (started by `keep`).
pub fn serve(args: &[String]) -> i32 {
    let (Some(name), Some(argv)) = (args.first(), args.get(2..)) else {
        return 2;
    };
    let Ok(listener) = socket_addr(name).and_then(|a| UnixListener::bind_addr(&a)) else {
        return 1;
    };
    let started = match argv.split_first() {
        Some((prog, rest)) => Command::new(prog)
            .args(rest)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn(),
        None => Err(std::io::Error::other("no command")),
    };
    let mut child: Child = match started {
        Ok(c) => c,
        Err(e) => {
            if let Ok((mut c, _)) = listener.accept() {
                let _ = write_frame(&mut c, b'F', format!("{}: {e}", argv.join(" ")).as_bytes());
            }
            return 1;
        }
    };
    let pid = child.id();
    let shared = Arc::new(Shared {
        client: Mutex::new((None, 0)),
        changed: Condvar::new(),
        stdin: Mutex::new(child.stdin.take()),
    });
    {
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let shared = Arc::clone(&shared);
                std::thread::spawn(move || serve_client(&shared, conn, pid));
            }
        });
    }
    let pumps: Vec<_> = [
        child.stdout.take().map(|o| (Box::new(o) as Box<dyn Read + Send>, b'O')),
        child.stderr.take().map(|e| (Box::new(e) as Box<dyn Read + Send>, b'E')),
    ]
    .into_iter()
    .flatten()
    .map(|(r, k)| {
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || pump(shared, r, k))
    })
    .collect();
    let status = child.wait();
    for p in pumps {
        let _ = p.join();
    }
    let code = match status {
        Ok(s) => s.code().or_else(|| s.signal().map(|n| 128 + n)).unwrap_or(255),
        Err(_) => 255,
    };
    shared.send(b'X', code.to_string().as_bytes());
    0
}

/// `relay attach NAME`: this program's stdio to the keeper's socket, both ways.
pub fn attach(args: &[String]) -> i32 {
    let Some(name) = args.first() else {
        return 2;
    };
    let conn = match socket_addr(name).and_then(|a| UnixStream::connect_addr(&a)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("relay attach {name}: {e}");
            return 1;
        }
    };
    let Ok(mut up) = conn.try_clone() else {
        return 1;
    };
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = stdin.read(&mut buf) {
            if n == 0 || up.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = up.shutdown(std::net::Shutdown::Write);
    });
    let mut down = conn;
    let mut stdout = std::io::stdout().lock();
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = down.read(&mut buf) {
        if n == 0 || stdout.write_all(&buf[..n]).and_then(|()| stdout.flush()).is_err() {
            break;
        }
    }
    0
}
