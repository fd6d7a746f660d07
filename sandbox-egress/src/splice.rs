//! Zero-copy relaying between two TCP sockets with `splice(2)` through a pipe per direction:
//! the bytes of a tunnel never enter user space. Used when both ends of a relayed connection
//! are plain TCP sockets (the common case); anything else is copied through buffers.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use tokio::io::Interest;
use tokio::net::TcpStream;

/// Most bytes moved per `splice` call (and the pipe's capacity, where the kernel allows it).
const CHUNK: usize = 1 << 20;

/// A non-blocking pipe: (read end, write end).
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded: both descriptors are open and owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // A bigger pipe means fewer round trips; failure (e.g. above pipe-max-size) is harmless.
    // SAFETY: F_SETPIPE_SZ on a pipe we own.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, CHUNK as libc::c_int) };
    Ok((r, w))
}

fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: both descriptors are open for the duration of the call; null offsets mean
    // "current position" as splice requires for pipes and sockets.
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Moves bytes from `from` to `to` until `from` reaches end of stream, then shuts down the
/// write side of `to`. Returns the bytes moved.
async fn one_way(from: &TcpStream, to: &TcpStream) -> io::Result<u64> {
    let (pr, pw) = pipe()?;
    let mut total = 0u64;
    loop {
        // The pipe is empty here: EAGAIN can only mean `from` has nothing to read.
        let n = from
            .async_io(Interest::READABLE, || {
                splice(from.as_raw_fd(), pw.as_raw_fd(), CHUNK)
            })
            .await?;
        if n == 0 {
            // SAFETY: shutdown on a socket `to` owns.
            unsafe { libc::shutdown(to.as_raw_fd(), libc::SHUT_WR) };
            return Ok(total);
        }
        let mut left = n;
        while left > 0 {
            // The pipe holds data: EAGAIN can only mean `to` cannot take more yet.
            let m = to
                .async_io(Interest::WRITABLE, || {
                    splice(pr.as_raw_fd(), to.as_raw_fd(), left)
                })
                .await?;
            if m == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "peer stopped reading",
                ));
            }
            left -= m;
        }
        total += n as u64;
    }
}

/// Relays both ways between two TCP sockets until both directions are done (like
/// `tokio::io::copy_bidirectional`, without copying through user space).
pub(crate) async fn relay(a: &TcpStream, b: &TcpStream) -> io::Result<(u64, u64)> {
    let (ab, ba) = tokio::join!(one_way(a, b), one_way(b, a));
    Ok((ab?, ba?))
}
