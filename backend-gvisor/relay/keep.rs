//! Background processes that survive a checkpoint: `relay serve NAME [--tty ROWS COLS] --
//! ARGV...` and `relay attach NAME`.
//!
//! `runsc checkpoint` saves every process of a sandbox, but a process whose stdio are the
//! host's pipes (what an exec gives it) cannot be restored. So a background process is
//! started by a keeper inside the sandbox that holds nothing of the host once asked:
//!
//! - `serve` runs the command in a process group of its own, on pipes it holds (or, with
//!   `--tty`, on a terminal it opens inside the sandbox, under `session`), says `0 PID` (or
//!   `1 REASON`) on stdout, and listens on the abstract Unix socket
//!   `@agent-sandbox/proc/NAME`. Its own stdio (the host's pipes) are its first client;
//!   when that client detaches, they are replaced by `/dev/null`. It forwards the command's
//!   output to the client attached, its input from that client, and its exit status; with
//!   no client attached it reads nothing, so a command that writes more than its pipe holds
//!   waits (nothing is buffered here but one chunk per stream). It ends once a client has
//!   taken the exit status.
//! - `attach` connects to that socket and copies bytes both ways between it and its own
//!   stdio (the host's pipes): a later client (after a snapshot's resume, or in a restored
//!   copy); it ends when the keeper closes the connection (after a detach).
//!
//! Frames, both ways: `sandbox_agent_proto`'s (a 9-byte header: the payload's length, the
//! type byte, id 0), at most [`MAX_FRAME`] bytes of payload.
//! From `serve`: `H` hello to a socket client (the command's pid, decimal), `O`/`E` output,
//! `X` exit (the code, decimal; 128+N for signal N), `D` detached.
//! To `serve`: `A` attach (start forwarding to me), `I` input, `C` close input (a terminal's
//! end of file, `^D`), `R` resize a terminal (`ROWS COLS`), `D` detach (stop forwarding;
//! answered by `D`, after which nothing more is sent on this connection).
//!
//! **Terminals.** This runsc's `devpts` has no `ISIG`: a `^C` typed on a terminal inside the
//! sandbox reaches the program as a byte and signals nobody, and the master side cannot tell
//! the foreground process group (`TIOCGPGRP` there is `ENOTTY`). So the command runs under
//! `relay session`, the terminal's session leader and controlling process: `serve` takes the
//! `INTR` and `QUIT` characters out of the input while the terminal has `ISIG` set and sends
//! the session leader `SIGUSR1` / `SIGUSR2`; it asks its terminal for the foreground group
//! (`tcgetpgrp`, which works from inside the session) and sends it `SIGINT` / `SIGQUIT`, as
//! the kernel's line discipline would. It ends with the command, with its exit code.

use std::fs::File;
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sandbox_agent_proto::frame;

/// Longest frame payload accepted from a client.
const MAX_FRAME: usize = 1 << 20;

fn socket_addr(name: &str) -> std::io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(format!("agent-sandbox/proc/{name}").as_bytes())
}

/// Sends one frame of `kind` (id 0: the keeper's frames answer no request).
fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    frame::write_frame(w, kind, 0, payload)
}

/// Reads one frame: its kind and payload; the end of the stream is an error too.
fn read_frame(r: &mut impl Read) -> std::io::Result<(u8, Vec<u8>)> {
    match frame::read_frame(r, MAX_FRAME)? {
        Some((h, payload)) => Ok((h.kind, payload)),
        None => Err(std::io::ErrorKind::UnexpectedEof.into()),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The keeper's shared state.
struct Shared {
    /// The attached client (where frames go), if any, and a generation count bumped on
    /// every change.
    client: Mutex<(Option<Box<dyn Write + Send>>, u64)>,
    changed: Condvar,
    /// The command's input: its stdin pipe, or its terminal's master.
    stdin: Mutex<Option<Box<dyn Write + Send>>>,
    /// The terminal's master (a copy) and the session leader's pid, for resizes, `^D` and
    /// the signal characters.
    tty: Option<(File, u32)>,
}

impl Shared {
    fn new(stdin: Option<Box<dyn Write + Send>>, tty: Option<(File, u32)>) -> Arc<Shared> {
        Arc::new(Shared {
            client: Mutex::new((None, 0)),
            changed: Condvar::new(),
            stdin: Mutex::new(stdin),
            tty,
        })
    }

    /// Waits for an attached client; returns its generation.
    fn attached(&self) -> u64 {
        let mut g = lock(&self.client);
        loop {
            if g.0.is_some() {
                return g.1;
            }
            g = self.changed.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Sends a frame to the attached client (waiting for one); a client that fails is
    /// dropped and the frame goes to the next.
    fn send(&self, kind: u8, payload: &[u8]) {
        let mut g = lock(&self.client);
        loop {
            match g.0.as_mut().map(|s| write_frame(s, kind, payload).is_ok()) {
                Some(true) => return,
                Some(false) => self.forget(&mut g, None),
                None => g = self.changed.wait(g).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }

    fn set_client(&self, s: Option<Box<dyn Write + Send>>) {
        let mut g = lock(&self.client);
        g.0 = s;
        g.1 += 1;
        self.changed.notify_all();
    }

    /// Drops the attached client (only if it is generation `only`, when given).
    fn forget(&self, g: &mut (Option<Box<dyn Write + Send>>, u64), only: Option<u64>) {
        if only.is_none_or(|n| n == g.1) {
            g.0 = None;
            g.1 += 1;
            self.changed.notify_all();
        }
    }
}

/// Serves this program's stdio as a client: the first one. Once it has detached (or the
/// host's end is gone), they become `/dev/null`: a checkpoint must find no host pipe here.
fn serve_stdio(shared: &Arc<Shared>) {
    let shared = Arc::clone(shared);
    std::thread::spawn(move || {
        let writer = || Some(Box::new(std::io::stdout()) as Box<dyn Write + Send>);
        serve_client(&shared, std::io::stdin(), writer, stdio::to_null);
    });
}

/// One client's requests, read from `reader`; `writer` makes the handle its frames go to
/// (a socket client: a copy of its connection; the first client: this program's stdout).
/// `done` runs once the client is done: a detach answered (under the client lock), or its
/// input ended.
fn serve_client(
    shared: &Shared,
    mut reader: impl Read,
    writer: impl Fn() -> Option<Box<dyn Write + Send>>,
    done: impl FnOnce(),
) {
    let mut done = Some(done);
    let mut mine = None;
    while let Ok((kind, payload)) = read_frame(&mut reader) {
        match kind {
            b'A' => {
                if let Some(w) = writer() {
                    shared.set_client(Some(w));
                    mine = Some(lock(&shared.client).1);
                }
            }
            b'I' => {
                let mut g = lock(&shared.stdin);
                if let Some(w) = g.as_mut() {
                    let written = match &shared.tty {
                        Some((master, leader)) => pty::type_in(w, master, *leader, &payload),
                        None => w.write_all(&payload),
                    };
                    if written.is_err() {
                        *g = None;
                    }
                }
            }
            b'C' => {
                let mut g = lock(&shared.stdin);
                if shared.tty.is_some() {
                    if let Some(w) = g.as_mut() {
                        let _ = w.write_all(b"\x04");
                    }
                } else {
                    g.take();
                }
            }
            b'R' => {
                let size = String::from_utf8_lossy(&payload).into_owned();
                if let (Some((m, _)), Some((r, c))) = (&shared.tty, size.split_once(' ')) {
                    if let (Ok(r), Ok(c)) = (r.trim().parse(), c.trim().parse()) {
                        let _ = pty::resize(m, r, c);
                    }
                }
            }
            b'D' => {
                // Under the client lock: no output frame follows the answer.
                let mut g = lock(&shared.client);
                if let Some(n) = mine {
                    shared.forget(&mut g, Some(n));
                }
                if let Some(mut w) = writer() {
                    let _ = write_frame(&mut w, b'D', b"");
                }
                if let Some(f) = done.take() {
                    f();
                }
                drop(g);
                return;
            }
            _ => {}
        }
    }
    // Gone without detaching: stop forwarding to it.
    if let Some(n) = mine {
        shared.forget(&mut lock(&shared.client), Some(n));
    }
    if let Some(f) = done.take() {
        f();
    }
}

/// Forwards one output stream, a chunk at a time, only while a client is attached.
fn pump(shared: Arc<Shared>, mut from: impl Read, kind: u8) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Read nothing while nobody listens: the command waits, nothing piles up here.
        shared.attached();
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => shared.send(kind, &buf[..n]),
        }
    }
}

/// What `serve` is given: `NAME [--tty ROWS COLS] -- ARGV...`.
struct Spec<'a> {
    name: &'a String,
    tty: Option<(u16, u16)>,
    argv: &'a [String],
}

impl<'a> Spec<'a> {
    fn parse(args: &'a [String]) -> Option<Spec<'a>> {
        let (name, mut rest) = args.split_first()?;
        let mut tty = None;
        if rest.first().map(String::as_str) == Some("--tty") {
            let rows = rest.get(1)?.parse().ok()?;
            let cols = rest.get(2)?.parse().ok()?;
            tty = Some((rows, cols));
            rest = rest.get(3..)?;
        }
        let (dashes, argv) = rest.split_first()?;
        (dashes == "--").then_some(Spec { name, tty, argv })
    }
}

/// The started command: the child, its input, its output streams, its terminal's master.
type Started = (
    Child,
    Option<Box<dyn Write + Send>>,
    Vec<(Box<dyn Read + Send>, u8)>,
    Option<File>,
);

fn start(spec: &Spec) -> std::io::Result<Started> {
    let (prog, rest) = spec
        .argv
        .split_first()
        .ok_or_else(|| std::io::Error::other("no command"))?;
    match spec.tty {
        None => {
            let mut cmd = Command::new(prog);
            cmd.args(rest)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            // SAFETY: between fork and exec only system calls (rt_sigaction, rt_sigprocmask).
            unsafe {
                cmd.pre_exec(|| {
                    crate::reset_signals();
                    Ok(())
                });
            }
            let mut child = cmd.spawn()?;
            let input = child
                .stdin
                .take()
                .map(|w| Box::new(w) as Box<dyn Write + Send>);
            let outputs = [
                child
                    .stdout
                    .take()
                    .map(|o| (Box::new(o) as Box<dyn Read + Send>, b'O')),
                child
                    .stderr
                    .take()
                    .map(|e| (Box::new(e) as Box<dyn Read + Send>, b'E')),
            ]
            .into_iter()
            .flatten()
            .collect();
            Ok((child, input, outputs, None))
        }
        Some((rows, cols)) => {
            let (child, master) = pty::spawn(prog, rest, rows, cols)?;
            let input = Box::new(master.try_clone()?) as Box<dyn Write + Send>;
            // Stdout and stderr merged, as a terminal has them.
            let output = Box::new(master.try_clone()?) as Box<dyn Read + Send>;
            Ok((child, Some(input), vec![(output, b'O')], Some(master)))
        }
    }
}

/// `relay serve NAME [--tty ROWS COLS] -- ARGV...`: starts the command, says `0 PID` (or
/// `1 REASON` and ends) on stdout, and serves: its own stdio are the first client (frames
/// from the line on), then whoever attaches on the socket.
pub fn serve(args: &[String]) -> i32 {
    let mut out = std::io::stdout();
    let Some(spec) = Spec::parse(args) else {
        let _ = out.write_all(b"1 usage: relay serve NAME [--tty ROWS COLS] -- ARGV...\n");
        return 2;
    };
    let listener = match socket_addr(spec.name).and_then(|a| UnixListener::bind_addr(&a)) {
        Ok(l) => l,
        Err(e) => {
            let _ = writeln!(out, "1 cannot listen as {}: {e}", spec.name);
            return 1;
        }
    };
    let (mut child, input, outputs, master) = match start(&spec) {
        Ok(s) => s,
        // As a shell would: the reason on stderr, 127 (not found) or 126, to the client.
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            let prog = spec.argv.first().map_or("", String::as_str);
            return not_started(listener, &format!("{prog}: {e}\n"), code);
        }
    };
    let pid = child.id();
    if writeln!(out, "0 {pid}").and_then(|()| out.flush()).is_err() {
        let _ = child.kill();
        return 1;
    }
    let shared = Shared::new(input, master.map(|m| (m, pid)));
    {
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let shared = Arc::clone(&shared);
                std::thread::spawn(move || {
                    let mut hello = conn.try_clone();
                    if let Ok(h) = hello.as_mut() {
                        if write_frame(h, b'H', pid.to_string().as_bytes()).is_err() {
                            return;
                        }
                    }
                    let writer = move || {
                        conn.try_clone()
                            .ok()
                            .map(|c| Box::new(c) as Box<dyn Write + Send>)
                    };
                    if let Ok(reader) = hello {
                        serve_client(&shared, reader, writer, || {});
                    }
                });
            }
        });
    }
    serve_stdio(&shared);
    let pumps: Vec<_> = outputs
        .into_iter()
        .map(|(r, k)| {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || pump(shared, r, k))
        })
        .collect();
    let status = child.wait();
    if shared.tty.is_some() {
        // A terminal's master reads on until every copy of its slave is closed (a daemon
        // of the session may hold one): what is left is drained briefly, then dropped.
        let end = Instant::now() + Duration::from_secs(1);
        while pumps.iter().any(|p| !p.is_finished()) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
    } else {
        for p in pumps {
            let _ = p.join();
        }
    }
    let code = match status {
        Ok(s) => s
            .code()
            .or_else(|| s.signal().map(|n| 128 + n))
            .unwrap_or(255),
        Err(_) => 255,
    };
    shared.send(b'X', code.to_string().as_bytes());
    0
}

/// A command that could not start: pid 0, then, to the first client that attaches, `why`
/// on stderr and exit `code`.
fn not_started(listener: UnixListener, why: &str, code: i32) -> i32 {
    let mut out = std::io::stdout();
    if writeln!(out, "0 0").and_then(|()| out.flush()).is_err() {
        return 1;
    }
    drop(listener);
    let shared = Shared::new(None, None);
    serve_stdio(&shared);
    shared.send(b'E', why.as_bytes());
    shared.send(b'X', code.to_string().as_bytes());
    0
}

/// `relay attach NAME`: this program's stdio to the keeper's socket, both ways.
pub fn attach(args: &[String]) -> i32 {
    let Some(name) = args.first() else {
        return 2;
    };
    match socket_addr(name).and_then(|a| UnixStream::connect_addr(&a)) {
        Ok(c) => shuttle(c),
        Err(e) => {
            eprintln!("relay attach {name}: {e}");
            1
        }
    }
}

/// Copies this program's stdin to `conn` and `conn` to its stdout until `conn` ends.
fn shuttle(conn: UnixStream) -> i32 {
    let Ok(up) = conn.try_clone() else {
        return 1;
    };
    let mut down = conn;
    crate::copy_both(up, &mut down, |up| {
        let _ = up.shutdown(std::net::Shutdown::Write);
    });
    0
}

/// `relay session -- ARGV...`: the session leader of a terminal (its stdio), which runs the
/// command in its own process group and relays `SIGUSR1` / `SIGUSR2` from `serve` as
/// `SIGINT` / `SIGQUIT` to the terminal's foreground group (see the module docs).
pub fn session(args: &[String]) -> i32 {
    use std::sync::atomic::Ordering;
    let Some(("--", argv)) = args.split_first().map(|(d, a)| (d.as_str(), a)) else {
        return 2;
    };
    let Some((prog, rest)) = argv.split_first() else {
        return 2;
    };
    pty::catch_requests();
    let mut cmd = Command::new(prog);
    cmd.args(rest);
    // SAFETY: between fork and exec only system calls (rt_sigaction, rt_sigprocmask): the
    // command gets none of our caught or ignored signals.
    unsafe {
        cmd.pre_exec(|| {
            crate::reset_signals();
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{prog}: {e}");
            return if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
        }
    };
    loop {
        match child.try_wait() {
            Ok(Some(s)) => {
                return s
                    .code()
                    .or_else(|| s.signal().map(|n| 128 + n))
                    .unwrap_or(255)
            }
            Ok(None) => {}
            Err(_) => return 255,
        }
        for (flag, signo) in [(&pty::WANT_INT, 2), (&pty::WANT_QUIT, 3)] {
            if flag.swap(false, Ordering::SeqCst) {
                pty::signal_foreground(signo);
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The command's terminal, opened inside the sandbox (`/dev/ptmx`).
mod pty {
    use std::fs::File;
    use std::io::Write;
    use std::os::fd::{AsFd, AsRawFd};
    use std::os::raw::{c_int, c_ulong};
    use std::os::unix::process::CommandExt;
    use std::process::{Child, Command};
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Linux x86-64 `struct termios` (as `TCGETS` fills it).
    #[repr(C)]
    struct Termios {
        iflag: u32,
        oflag: u32,
        cflag: u32,
        lflag: u32,
        line: u8,
        cc: [u8; 19],
    }

    extern "C" {
        fn ioctl(fd: c_int, request: c_ulong, ...) -> c_int;
        fn setsid() -> c_int;
        fn kill(pid: c_int, sig: c_int) -> c_int;
        fn signal(sig: c_int, handler: usize) -> usize;
        fn tcgetpgrp(fd: c_int) -> c_int;
    }

    const TCGETS: c_ulong = 0x5401;
    const TIOCSCTTY: c_ulong = 0x540e;
    const ISIG: u32 = 0o1;
    const VINTR: usize = 0;
    const VQUIT: usize = 1;
    const SIGINT: c_int = 2;
    const SIGQUIT: c_int = 3;
    const SIGUSR1: c_int = 10;
    const SIGUSR2: c_int = 12;

    /// `serve` asked for a `SIGINT` / `SIGQUIT` to the foreground group.
    pub static WANT_INT: AtomicBool = AtomicBool::new(false);
    pub static WANT_QUIT: AtomicBool = AtomicBool::new(false);

    extern "C" fn on_usr1(_: c_int) {
        WANT_INT.store(true, Ordering::SeqCst);
    }
    extern "C" fn on_usr2(_: c_int) {
        WANT_QUIT.store(true, Ordering::SeqCst);
    }
    /// The session leader's own `SIGINT` / `SIGQUIT` (it is in the foreground group until
    /// the command makes one of its own): caught, so it does not die of them. A caught
    /// signal is reset to its default in the command it starts.
    extern "C" fn on_ignored(_: c_int) {}

    fn check(r: c_int) -> std::io::Result<()> {
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// The session leader's handlers (see `session`).
    pub fn catch_requests() {
        // SAFETY: the handlers only store to atomics (async-signal-safe).
        unsafe {
            signal(SIGUSR1, on_usr1 as extern "C" fn(c_int) as usize);
            signal(SIGUSR2, on_usr2 as extern "C" fn(c_int) as usize);
            signal(SIGINT, on_ignored as extern "C" fn(c_int) as usize);
            signal(SIGQUIT, on_ignored as extern "C" fn(c_int) as usize);
        }
    }

    /// Sends `signo` to the foreground group of the controlling terminal (stdin).
    pub fn signal_foreground(signo: c_int) {
        // SAFETY: plain calls; no pointers.
        unsafe {
            let pg = tcgetpgrp(0);
            if pg > 0 {
                kill(-pg, signo);
            }
        }
    }

    /// Sets the terminal's size.
    pub fn resize(master: &File, rows: u16, cols: u16) -> std::io::Result<()> {
        sandbox_agent_proto::pty::set_size(master.as_fd(), rows, cols)
    }

    /// Writes `data` to the terminal's input as typed: with `ISIG` set, its `INTR` and
    /// `QUIT` characters become requests to the session leader `leader` (see the module
    /// docs) instead of bytes.
    pub fn type_in(
        w: &mut Box<dyn Write + Send>,
        master: &File,
        leader: u32,
        data: &[u8],
    ) -> std::io::Result<()> {
        let mut t = Termios {
            iflag: 0,
            oflag: 0,
            cflag: 0,
            lflag: 0,
            line: 0,
            cc: [0; 19],
        };
        // SAFETY: TCGETS fills one `struct termios` at the pointer, which is valid.
        let got = unsafe { ioctl(master.as_raw_fd(), TCGETS, &mut t as *mut Termios) } == 0;
        if !got || t.lflag & ISIG == 0 {
            return w.write_all(data);
        }
        let (intr, quit) = (t.cc[VINTR], t.cc[VQUIT]);
        let mut rest = data;
        while let Some(i) = rest
            .iter()
            .position(|b| *b != 0 && (*b == intr || *b == quit))
        {
            w.write_all(&rest[..i])?;
            let sig = if rest[i] == intr { SIGUSR1 } else { SIGUSR2 };
            // SAFETY: plain call; no pointers.
            unsafe { kill(leader as c_int, sig) };
            rest = &rest[i + 1..];
        }
        w.write_all(rest)
    }

    /// Runs `relay session -- PROG ARGS` as the session leader of a new terminal of
    /// `rows` x `cols`; returns it and the terminal's master.
    pub fn spawn(
        prog: &str,
        args: &[String],
        rows: u16,
        cols: u16,
    ) -> std::io::Result<(Child, File)> {
        let pty = sandbox_agent_proto::pty::open(rows, cols)?;
        let (master, slave) = (File::from(pty.master), File::from(pty.slave));
        let me = std::env::current_exe()?;
        let mut cmd = Command::new(me);
        cmd.arg("session")
            .arg("--")
            .arg(prog)
            .args(args)
            .stdin(slave.try_clone()?)
            .stdout(slave.try_clone()?)
            .stderr(slave);
        // SAFETY: between fork and exec only async-signal-safe calls (rt_sigaction,
        // rt_sigprocmask, setsid, ioctl).
        unsafe {
            cmd.pre_exec(|| {
                crate::reset_signals();
                check(setsid())?;
                check(ioctl(0, TIOCSCTTY, 0 as c_int))
            });
        }
        let child = cmd.spawn()?;
        Ok((child, master))
    }
}

/// This program's own stdio.
mod stdio {
    use std::os::fd::AsRawFd;
    use std::os::raw::c_int;

    extern "C" {
        fn dup2(old: c_int, new: c_int) -> c_int;
    }

    /// Puts `/dev/null` in place of stdin, stdout and stderr (the host's pipes go).
    pub fn to_null() {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        if let Ok(null) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
        {
            for fd in 0..3 {
                // SAFETY: plain call on descriptors this process owns.
                unsafe { dup2(null.as_raw_fd(), fd) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn serve_arguments_parse() {
        let args = strings(&["job", "--tty", "24", "80", "--", "sh", "-i"]);
        let spec = Spec::parse(&args).unwrap();
        assert_eq!((spec.name.as_str(), spec.tty), ("job", Some((24, 80))));
        assert_eq!(spec.argv, ["sh", "-i"]);
        let args = strings(&["job", "--", "true"]);
        let spec = Spec::parse(&args).unwrap();
        assert_eq!((spec.tty, spec.argv), (None, &args[2..]));
        for bad in [
            &["job"][..],
            &["job", "true"],
            &["job", "--tty", "24", "--", "sh"],
            &["job", "--tty", "x", "80", "--", "sh"],
            &[],
        ] {
            assert!(Spec::parse(&strings(bad)).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn frames_round_trip_and_bounds_hold() {
        let mut w = Vec::new();
        write_frame(&mut w, b'O', b"out").unwrap();
        write_frame(&mut w, b'D', b"").unwrap();
        let mut r = &w[..];
        assert_eq!(read_frame(&mut r).unwrap(), (b'O', b"out".to_vec()));
        assert_eq!(read_frame(&mut r).unwrap(), (b'D', Vec::new()));
        // The end of the stream is an error: a client gone.
        assert!(read_frame(&mut r).is_err());
        // A frame over the bound is refused before its payload is read.
        let head = frame::Header::for_payload(b'I', 0, MAX_FRAME + 1).unwrap();
        assert!(read_frame(&mut &head.to_bytes()[..]).is_err());
    }

    /// A writer whose bytes the test reads back.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            lock(&self.0).extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_client_attaches_types_closes_and_detaches() {
        let input = Sink::default();
        let shared = Shared::new(Some(Box::new(input.clone())), None);
        let client = Sink::default();
        let mut requests = Vec::new();
        for (kind, payload) in [
            (b'A', &b""[..]),
            (b'I', b"hello "),
            (b'R', b"24 80"), // no terminal: ignored
            (b'I', b"world"),
            (b'C', b""),
            (b'I', b"dropped"), // after the input was closed
            (b'D', b""),
            (b'I', b"never read"), // after the detach
        ] {
            write_frame(&mut requests, kind, payload).unwrap();
        }
        let mut done = false;
        let c = client.clone();
        serve_client(
            &shared,
            &requests[..],
            move || Some(Box::new(c.clone()) as Box<dyn Write + Send>),
            || done = true,
        );
        assert!(done);
        assert_eq!(*lock(&input.0), b"hello world");
        assert!(lock(&shared.stdin).is_none());
        // Detached: the answer went out and the client is no longer attached.
        let answer = lock(&client.0).clone();
        assert_eq!(read_frame(&mut &answer[..]).unwrap(), (b'D', Vec::new()));
        assert!(lock(&shared.client).0.is_none());
    }

    #[test]
    fn output_goes_to_the_attached_client() {
        let shared = Shared::new(None, None);
        let client = Sink::default();
        shared.set_client(Some(Box::new(client.clone())));
        shared.send(b'O', b"chunk");
        shared.send(b'X', b"0");
        let sent = lock(&client.0).clone();
        let mut r = &sent[..];
        assert_eq!(read_frame(&mut r).unwrap(), (b'O', b"chunk".to_vec()));
        assert_eq!(read_frame(&mut r).unwrap(), (b'X', b"0".to_vec()));
    }
}
