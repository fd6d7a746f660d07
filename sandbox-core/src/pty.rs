//! A pseudo-terminal's master end as async I/O, for backends that give a process a terminal
//! (see [`ExecRequest::tty`](crate::ExecRequest::tty)).
//!
//! [`PtyMaster`] reads what the terminal shows and writes what a person would type. When
//! the last holder of the other end (the slave) is gone, a read ends (`Ok(0)`, where the
//! kernel says `EIO`): the process's session is over. (Writes then still succeed: the
//! kernel buffers them for nobody; a write that gets `EIO` fails with `BrokenPipe`.) [`PtyMaster::open`] makes a new terminal and returns its slave for a
//! child's stdio; a backend whose terminal is made elsewhere (inside its sandbox) wraps the
//! master it gets with [`PtyMaster::from_fd`].

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::{pty, unistd};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::Tty;

/// A terminal's master end, non-blocking and registered with the tokio reactor.
#[derive(Debug)]
pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
}

impl PtyMaster {
    /// A new terminal of `size` cells: its master, and its slave (for a child's stdin,
    /// stdout and stderr; drop every copy of it once the child has it, or reads never end).
    /// Both are close-on-exec; the slave is not anyone's controlling terminal yet (the
    /// child takes it with `setsid` + `TIOCSCTTY`).
    pub fn open(size: Tty) -> io::Result<(PtyMaster, OwnedFd)> {
        let flags = OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
        let master = pty::posix_openpt(flags)?;
        pty::grantpt(&master)?;
        pty::unlockpt(&master)?;
        // TIOCGPTPEER opens the slave through the master itself: no path lookup, so no
        // race with a /dev/pts entry being replaced (nix has no wrapper for it).
        // SAFETY: the ioctl returns a new fd (or -1) that we own from here on.
        let slave = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, flags.bits()) };
        if slave < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `slave` is a new, open fd nobody else owns.
        let slave = unsafe { OwnedFd::from_raw_fd(slave) };
        let master = OwnedFd::from(master);
        set_size(master.as_fd(), size)?;
        Ok((PtyMaster::from_fd(master)?, slave))
    }

    /// Wraps an open master (made non-blocking here). Needs a tokio runtime.
    pub fn from_fd(fd: OwnedFd) -> io::Result<PtyMaster> {
        let fl = OFlag::from_bits_retain(fcntl(&fd, FcntlArg::F_GETFL)?);
        fcntl(&fd, FcntlArg::F_SETFL(fl | OFlag::O_NONBLOCK))?;
        // SAFETY: the AsyncFd owns `fd` for as long as it is registered, and nobody closes
        // it behind its back.
        let fd = unsafe {
            AsyncFd::register_with_interest(fd, Interest::READABLE | Interest::WRITABLE)
        }?;
        Ok(PtyMaster { fd })
    }

    /// A second handle on the same terminal (one to read while another writes).
    pub fn try_clone(&self) -> io::Result<PtyMaster> {
        PtyMaster::from_fd(self.fd.get_ref().try_clone()?)
    }

    /// Sets the terminal's size; the kernel sends its foreground process group `SIGWINCH`.
    pub fn resize(&self, size: Tty) -> io::Result<()> {
        set_size(self.fd.get_ref().as_fd(), size)
    }
}

impl AsFd for PtyMaster {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.get_ref().as_fd()
    }
}

/// `TIOCSWINSZ` on a terminal.
fn set_size(fd: BorrowedFd<'_>, size: Tty) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from a pointer to a local.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl AsyncRead for PtyMaster {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut g = match self.fd.poll_read_ready(cx) {
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            let unfilled = buf.initialize_unfilled();
            match g.try_io(|fd| Ok(unistd::read(fd.get_ref(), unfilled)?)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // EIO: every slave is closed; the session is over.
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Poll::Ready(Ok(())),
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => {}
            }
        }
    }
}

impl AsyncWrite for PtyMaster {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut g = match self.fd.poll_write_ready(cx) {
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            match g.try_io(|fd| Ok(unistd::write(fd.get_ref(), buf)?)) {
                // EIO: the terminal's other side is closed (the session ended).
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => {
                    return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()))
                }
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => {}
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_terminal_echoes_reports_its_size_and_ends_when_the_slave_closes() {
        let (mut m, slave) = PtyMaster::open(Tty::new(24, 80)).unwrap();
        let mut ws = libc::winsize {
            ws_row: 0,
            ws_col: 0,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCGWINSZ into a local.
        let r = unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
        assert_eq!(r, 0);
        assert_eq!((ws.ws_row, ws.ws_col), (24, 80));
        m.resize(Tty::new(30, 100)).unwrap();
        // SAFETY: as above.
        unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
        assert_eq!((ws.ws_row, ws.ws_col), (30, 100));

        // Typed input is echoed by the line discipline and reaches the slave as a line.
        let mut reader = m.try_clone().unwrap();
        m.write_all(b"hi\n").await.unwrap();
        let mut echo = [0u8; 4];
        reader.read_exact(&mut echo).await.unwrap();
        assert_eq!(&echo, b"hi\r\n");
        let mut line = [0u8; 3];
        let mut s = std::fs::File::from(slave.try_clone().unwrap());
        std::io::Read::read_exact(&mut s, &mut line).unwrap();
        assert_eq!(&line, b"hi\n");

        // Every slave closed: reads end.
        drop((s, slave));
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{rest:?}");
    }
}
