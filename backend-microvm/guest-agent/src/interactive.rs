//! Background processes (`Spawn`): their input, kept open for `Input` frames; their output
//! window, refilled by the host's `Grant`s; and their terminal, when they have one.
//!
//! Flow control: an exec's output is always read by the host, but a background process's
//! may not be (an agent that starts a server and never looks at its log). The agent sends
//! at most the granted window of a process's output, then stops reading its pipe or
//! terminal, so the process blocks on its next write as on any full pipe, and neither the
//! channel (shared by every request) nor either side's memory fills up.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use crate::proto::{ErrorKind, Response, FRAME_COST};
use crate::{c_int, lock, Chan};

extern "C" {
    fn posix_openpt(flags: c_int) -> c_int;
    fn grantpt(fd: c_int) -> c_int;
    fn unlockpt(fd: c_int) -> c_int;
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
    let mut p = PollFd {
        fd: f.as_raw_fd(),
        events: POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call. EINTR: poll again.
    while unsafe { poll(&mut p, 1, -1) } < 0
        && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
    {}
}

const O_RDWR: c_int = 2;
const O_NOCTTY: c_int = 0o400;
const O_CLOEXEC: c_int = 0o2000000;
const TIOCSWINSZ: u64 = 0x5414;
const TIOCGPTPEER: u64 = 0x5441;
/// `TIOCSCTTY`, for the child (see `main.rs`).
pub(crate) const TIOCSCTTY: u64 = 0x540E;
/// The end-of-file character a terminal in canonical mode takes as end of input (Ctrl-D).
const VEOF_CHAR: u8 = 0x04;

/// `struct winsize`.
#[repr(C)]
struct Winsize {
    rows: u16,
    cols: u16,
    xpixel: u16,
    ypixel: u16,
}

/// A new terminal of `rows` x `cols`: (master, slave), both close-on-exec.
pub(crate) fn open_pty(rows: u16, cols: u16) -> io::Result<(File, File)> {
    // SAFETY: posix_openpt returns a new fd (or -1), owned by the File below.
    let m = unsafe { posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC) };
    if m < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `m` is a new fd nobody else owns.
    let master = unsafe { File::from_raw_fd(m) };
    // SAFETY: grantpt/unlockpt on our master.
    if unsafe { grantpt(m) } != 0 || unsafe { unlockpt(m) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the ioctl opens the slave through the master and returns a new fd (or -1).
    let s = unsafe { ioctl(m, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC) };
    if s < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `s` is a new fd nobody else owns.
    let slave = unsafe { File::from_raw_fd(s) };
    resize(&master, rows, cols)?;
    Ok((master, slave))
}

/// Sets a terminal's size (its foreground group gets `SIGWINCH`).
pub(crate) fn resize(tty: &File, rows: u16, cols: u16) -> io::Result<()> {
    let ws = Winsize {
        rows,
        cols,
        xpixel: 0,
        ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from a pointer to a local.
    if unsafe { ioctl(tty.as_raw_fd(), TIOCSWINSZ, &ws as *const Winsize) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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

/// The input thread of a process: `first` (the request's stdin), then every `Input` frame
/// in order, each answered once written. `tty`: the input is a terminal (closing it types
/// Ctrl-D; the terminal stays open for output).
pub(crate) fn input_thread(
    mut w: File,
    tty: bool,
    first: Vec<u8>,
    rx: mpsc::Receiver<Input>,
    chan: Chan,
) {
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
            Input::Close(reply) => {
                if tty {
                    let _ = w.write_all(&[VEOF_CHAR]);
                    chan.send(reply, &Response::Ok);
                    continue;
                }
                chan.send(reply, &Response::Ok);
                // Dropping the pipe is the end of input; nothing more can be written.
                return;
            }
        }
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
