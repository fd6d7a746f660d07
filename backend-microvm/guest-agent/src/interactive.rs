//! Background processes (`Spawn`): their input, kept open for `Input` frames; their output
//! window, refilled by the host's `Grant`s; and their terminal, when they have one. And
//! connections to the guest's loopback for published ports (`Connect`), driven the same way:
//! the server's bytes are the output, the host's are the input.
//!
//! Flow control: an exec's output is always read by the host, but a background process's
//! may not be (an agent that starts a server and never looks at its log). The agent sends
//! at most the granted window of a process's output, then stops reading its pipe or
//! terminal, so the process blocks on its next write as on any full pipe, and neither the
//! channel (shared by every request) nor either side's memory fills up.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use crate::proto::{ErrorKind, ExitInfo, Response, FRAME_COST};
use crate::{c_int, lock, Chan, State};

extern "C" {
    pub(crate) fn ioctl(fd: c_int, req: u64, ...) -> c_int;
    fn poll(fds: *mut PollFd, n: u64, timeout: c_int) -> c_int;
}

/// `struct pollfd`.
#[repr(C)]
struct PollFd {
    fd: c_int,
    events: i16,
    revents: i16,
}

const POLLIN: i16 = 1;

/// Waits until `f` has something to read (or its end, or an error to report).
fn wait_readable(f: &File) {
    wait_readable_for(f, -1);
}

/// Waits until `f` has something to read, at most `ms` milliseconds (-1: no limit; an
/// interrupted wait is over early, which its callers' loops allow).
pub(crate) fn wait_readable_for(f: &File, ms: c_int) {
    let mut p = PollFd {
        fd: f.as_raw_fd(),
        events: POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call. EINTR without a limit: poll
    // again.
    while unsafe { poll(&mut p, 1, ms) } < 0
        && ms < 0
        && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
    {}
}

/// `TIOCSCTTY`, for the child (see `main.rs`).
pub(crate) const TIOCSCTTY: u64 = 0x540E;
/// The end-of-file character a terminal in canonical mode takes as end of input (Ctrl-D).
const VEOF_CHAR: u8 = 0x04;

/// A new terminal of `rows` x `cols`: (master, slave), both close-on-exec.
pub(crate) fn open_pty(rows: u16, cols: u16) -> io::Result<(File, File)> {
    let pty = sandbox_agent_proto::pty::open(rows, cols)?;
    Ok((File::from(pty.master), File::from(pty.slave)))
}

/// Sets a terminal's size (its foreground group gets `SIGWINCH`).
pub(crate) fn resize(tty: &File, rows: u16, cols: u16) -> io::Result<()> {
    sandbox_agent_proto::pty::set_size(tty.as_fd(), rows, cols)
}

/// How many output bytes the agent may still send for one process.
#[derive(Default)]
pub(crate) struct Window {
    /// (bytes left, closed).
    left: Mutex<(u64, bool)>,
    cv: Condvar,
}

impl Window {
    pub(crate) fn new(bytes: u32) -> Window {
        Window {
            left: Mutex::new((u64::from(bytes), false)),
            cv: Condvar::new(),
        }
    }

    /// Waits until a frame's worth of window is left (or it is closed: then `None`), and
    /// takes up to `want` bytes of it (at least [`FRAME_COST`] when `want` is that large).
    pub(crate) fn take(&self, want: usize) -> Option<usize> {
        let mut g = lock(&self.left);
        loop {
            if g.1 {
                return None;
            }
            if g.0 >= u64::from(FRAME_COST) {
                let n = g.0.min(want as u64);
                g.0 -= n;
                return usize::try_from(n).ok();
            }
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Adds `n` bytes (a grant, or the unused part of a take).
    pub(crate) fn give(&self, n: u64) {
        let mut g = lock(&self.left);
        g.0 = g.0.saturating_add(n);
        self.cv.notify_all();
    }

    /// Ends the waits: the output is no longer wanted (the agent is shutting down).
    pub(crate) fn close(&self) {
        lock(&self.left).1 = true;
        self.cv.notify_all();
    }
}

/// What the input thread of a process is asked to do; the `u32` is the request to answer.
pub(crate) enum Input {
    Data(Vec<u8>, u32),
    Close(u32),
}

/// A running background process's controls.
pub(crate) struct Spawned {
    /// To its input thread; `None` once its input is closed (a pipe).
    pub input: Mutex<Option<mpsc::Sender<Input>>>,
    /// Its terminal's master (a copy), for resizes.
    pub tty: Option<File>,
    pub window: Arc<Window>,
}

/// Background processes by spawn request id.
pub(crate) type Table = Arc<Mutex<HashMap<u32, Arc<Spawned>>>>;

/// Where a process's (or connection's) input goes.
pub(crate) enum Sink {
    /// A pipe: closing the input drops it.
    Pipe(File),
    /// A terminal: closing the input types Ctrl-D; the terminal stays open for output.
    Tty(File),
    /// A connection: closing the input half-closes it (the server reads its end).
    Socket(TcpStream),
}

impl Sink {
    fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        match self {
            Sink::Pipe(f) | Sink::Tty(f) => f.write_all(data),
            Sink::Socket(s) => s.write_all(data),
        }
    }
}

/// The input thread of a process: `first` (the request's stdin), then every `Input` frame
/// in order, each answered once written.
pub(crate) fn input_thread(mut w: Sink, first: Vec<u8>, rx: mpsc::Receiver<Input>, chan: Chan) {
    let mut open = w.write_all(&first).is_ok();
    while let Ok(msg) = rx.recv() {
        match msg {
            Input::Data(data, reply) => {
                if !open {
                    chan.error(reply, ErrorKind::NotFound, "the process's input is closed");
                    continue;
                }
                match w.write_all(&data) {
                    Ok(()) => chan.send(reply, &Response::Ok),
                    Err(e) => {
                        // The process closed its input (or ended): nothing reads any more.
                        open = false;
                        chan.error(reply, ErrorKind::NotFound, format!("input: {e}"));
                    }
                }
            }
            Input::Close(reply) => match &mut w {
                Sink::Tty(_) => {
                    let _ = w.write_all(&[VEOF_CHAR]);
                    chan.send(reply, &Response::Ok);
                }
                Sink::Socket(s) => {
                    let _ = s.shutdown(Shutdown::Write);
                    chan.send(reply, &Response::Ok);
                    return;
                }
                Sink::Pipe(_) => {
                    chan.send(reply, &Response::Ok);
                    // Dropping the pipe is the end of input; nothing more can be written.
                    return;
                }
            },
        }
    }
}

/// Open connections (`Connect`): request id -> the stream, for `Kill` to abort.
pub(crate) type Conns = Arc<Mutex<HashMap<u32, TcpStream>>>;

/// Serves `Connect` request `id`: connects to `port` on the loopback, registers the
/// connection like a background process (input, window), forwards what the server sends
/// within the window, and reports `Exit` once the server has closed its side.
pub(crate) fn connect(st: &State, id: u32, port: u16, window: u32) {
    let chan = &st.chan;
    // Bounded: a server whose backlog is full would otherwise hold this thread for the
    // kernel's SYN retries (minutes), past the host's wait for the answer.
    let within = std::time::Duration::from_secs(5);
    let stream = TcpStream::connect_timeout(&(Ipv4Addr::LOCALHOST, port).into(), within)
        .or_else(|_| TcpStream::connect_timeout(&(Ipv6Addr::LOCALHOST, port).into(), within));
    let stream = match stream {
        Ok(s) => s,
        Err(e) => {
            return chan.error(
                id,
                ErrorKind::NotFound,
                format!("connect to port {port} in the guest: {e}"),
            )
        }
    };
    let _ = stream.set_nodelay(true);
    let clones = (stream.try_clone(), stream.try_clone());
    let (Ok(writer), Ok(abort)) = clones else {
        return chan.error(id, ErrorKind::Io, "duplicate the connection's socket");
    };
    let (tx, rx) = mpsc::channel();
    let p = Arc::new(Spawned {
        input: Mutex::new(Some(tx)),
        tty: None,
        window: Arc::new(Window::new(window)),
    });
    lock(&st.spawned).insert(id, Arc::clone(&p));
    lock(&st.conns).insert(id, abort);
    chan.send(id, &Response::Ok);
    let c = chan.clone();
    let input = std::thread::Builder::new()
        .spawn(move || input_thread(Sink::Socket(writer), Vec::new(), rx, c));
    if input.is_err() {
        // No input thread: the connection carries the server's side only.
        lock(&st.spawned).remove(&id);
    }
    let read_side = File::from(OwnedFd::from(stream));
    pump_windowed(read_side, chan.clone(), id, false, Arc::clone(&p.window));
    // The server closed its side (or the connection was aborted): the input thread ends
    // once its queue is gone; its last write, if any, fails or completes on its own.
    lock(&st.spawned).remove(&id);
    if let Some(s) = lock(&st.conns).remove(&id) {
        let _ = s.shutdown(Shutdown::Both);
    }
    drop(p);
    chan.send(
        id,
        &Response::Exit(ExitInfo {
            code: Some(0),
            ..ExitInfo::default()
        }),
    );
}

/// Aborts connection `id`, if it is open.
pub(crate) fn abort_connection(conns: &Conns, id: u32) -> bool {
    match lock(conns).get(&id) {
        Some(s) => {
            let _ = s.shutdown(Shutdown::Both);
            true
        }
        None => false,
    }
}

/// Sends a process's output: `Stdout` frames (or `Stderr`), never more than the window
/// allows; waits for grants in between. Ends at the end of the output (`EIO` from a
/// terminal whose every slave is closed counts as that) or when the window is closed.
pub(crate) fn pump_windowed(mut r: File, chan: Chan, id: u32, stderr: bool, window: Arc<Window>) {
    use std::io::Read;
    let mut buf = vec![0u8; crate::proto::CHUNK];
    loop {
        // Window is taken only once there is something to read: a stream that is quiet
        // never holds window that the process's other stream needs.
        wait_readable(&r);
        let Some(allowed) = window.take(buf.len()) else {
            return;
        };
        let n = loop {
            match r.read(buf.get_mut(..allowed).unwrap_or_default()) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        let n = match n {
            Ok(0) | Err(_) => {
                // The end: the window goes back to the other stream of the process.
                window.give(allowed as u64);
                return;
            }
            Ok(n) => n,
        };
        // The frame costs its length, at least FRAME_COST; the rest goes back.
        let cost = n.max(FRAME_COST as usize).min(allowed);
        window.give((allowed - cost) as u64);
        let data = buf.get(..n).unwrap_or_default().to_vec();
        chan.send(id, &Response::output(stderr, data));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_hands_out_what_was_granted_and_wakes_on_grants() {
        let w = Arc::new(Window::new(3000));
        assert_eq!(w.take(1500), Some(1500));
        // 1500 left: a frame's worth.
        assert_eq!(w.take(100_000), Some(1500));
        let w2 = Arc::clone(&w);
        let t = std::thread::spawn(move || w2.take(5000));
        std::thread::sleep(std::time::Duration::from_millis(20));
        // Less than a frame's worth does not wake it; more does.
        w.give(500);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!t.is_finished());
        w.give(1000);
        assert_eq!(t.join().unwrap(), Some(1500));
        let w2 = Arc::clone(&w);
        let t = std::thread::spawn(move || w2.take(5));
        w.close();
        assert_eq!(t.join().unwrap(), None);
    }
}
