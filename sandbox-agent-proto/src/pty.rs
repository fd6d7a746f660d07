//! A new pseudo-terminal: its master (`posix_openpt`, `grantpt`, `unlockpt`) and its slave,
//! opened through the master (`TIOCGPTPEER`, which needs no path into `devpts`) or, where
//! the kernel lacks that (gVisor), by its name (`ptsname_r`); and a terminal's window size.

use std::ffi::CStr;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::raw::{c_char, c_int, c_ulong};
use std::os::unix::fs::OpenOptionsExt;

extern "C" {
    fn posix_openpt(flags: c_int) -> c_int;
    fn grantpt(fd: c_int) -> c_int;
    fn unlockpt(fd: c_int) -> c_int;
    fn ptsname_r(fd: c_int, buf: *mut c_char, len: usize) -> c_int;
    fn ioctl(fd: c_int, request: c_ulong, ...) -> c_int;
}

const O_RDWR: c_int = 2;
const O_NOCTTY: c_int = 0o400;
const O_CLOEXEC: c_int = 0o2000000;
const TIOCSWINSZ: c_ulong = 0x5414;
const TIOCGPTPEER: c_ulong = 0x5441;

/// `struct winsize`.
#[repr(C)]
struct Winsize {
    rows: u16,
    cols: u16,
    xpixel: u16,
    ypixel: u16,
}

/// A new pseudo-terminal's two ends, both close-on-exec, neither the caller's controlling
/// terminal.
#[derive(Debug)]
pub struct Pty {
    /// The master: what the terminal's program writes is read here, and what is written
    /// here is its input.
    pub master: OwnedFd,
    /// The slave: the program's stdin, stdout and stderr (and controlling terminal, once
    /// its session leader takes it with `TIOCSCTTY`).
    pub slave: OwnedFd,
}

fn check(r: c_int) -> io::Result<c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Opens a new pseudo-terminal of `rows` x `cols` cells (in the `devpts` of this process's
/// `/dev/ptmx`).
pub fn open(rows: u16, cols: u16) -> io::Result<Pty> {
    // SAFETY: plain call; the descriptor it returns (checked) is owned at once below.
    let m = check(unsafe { posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC) })?;
    // SAFETY: `m` is a new descriptor nothing else owns.
    let master = unsafe { OwnedFd::from_raw_fd(m) };
    // SAFETY: plain call on the master's descriptor, which is open.
    check(unsafe { grantpt(m) })?;
    // SAFETY: as above.
    check(unsafe { unlockpt(m) })?;
    set_size(master.as_fd(), rows, cols)?;
    let slave = open_slave(&master)?;
    Ok(Pty { master, slave })
}

/// The slave of `master`: through `TIOCGPTPEER`, else by its name.
fn open_slave(master: &OwnedFd) -> io::Result<OwnedFd> {
    let m = master.as_raw_fd();
    // SAFETY: TIOCGPTPEER takes the open flags as its argument and returns a new
    // descriptor (or -1); no pointer is involved.
    let s = unsafe { ioctl(m, TIOCGPTPEER, (O_RDWR | O_NOCTTY | O_CLOEXEC) as c_ulong) };
    if s >= 0 {
        // SAFETY: `s` is a new descriptor nothing else owns.
        return Ok(unsafe { OwnedFd::from_raw_fd(s) });
    }
    open_slave_by_name(master)
}

/// The slave of `master`, opened by its name in `devpts`.
fn open_slave_by_name(master: &OwnedFd) -> io::Result<OwnedFd> {
    let m = master.as_raw_fd();
    let mut name = [0 as c_char; 128];
    // SAFETY: the buffer and its length are valid for the call, which NUL-terminates what
    // it writes on success.
    let r = unsafe { ptsname_r(m, name.as_mut_ptr(), name.len()) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    // SAFETY: ptsname_r succeeded: `name` holds a NUL-terminated string.
    let path = unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let slave = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(O_NOCTTY)
        .open(path)?;
    Ok(slave.into())
}

/// Sets the window size of the terminal `fd` (either end) to `rows` x `cols` cells; its
/// foreground process group gets `SIGWINCH`.
pub fn set_size(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> io::Result<()> {
    let ws = Winsize {
        rows,
        cols,
        xpixel: 0,
        ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `struct winsize` from the pointer, which points to a
    // local that outlives the call.
    check(unsafe { ioctl(fd.as_raw_fd(), TIOCSWINSZ, &ws as *const Winsize) })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::fs::File;
    use std::io::{Read, Write};

    /// `(rows, cols)` of the terminal `fd`.
    fn size(fd: BorrowedFd<'_>) -> (u16, u16) {
        const TIOCGWINSZ: c_ulong = 0x5413;
        let mut ws = Winsize {
            rows: 0,
            cols: 0,
            xpixel: 0,
            ypixel: 0,
        };
        // SAFETY: TIOCGWINSZ fills one `struct winsize` at the pointer, a local.
        let r = unsafe { ioctl(fd.as_raw_fd(), TIOCGWINSZ, &mut ws as *mut Winsize) };
        assert_eq!(r, 0, "{}", io::Error::last_os_error());
        (ws.rows, ws.cols)
    }

    #[test]
    fn a_new_terminal_has_its_size_and_carries_bytes() {
        let pty = open(24, 80).unwrap();
        assert_eq!(size(pty.master.as_fd()), (24, 80));
        assert_eq!(size(pty.slave.as_fd()), (24, 80));
        set_size(pty.master.as_fd(), 30, 100).unwrap();
        assert_eq!(size(pty.slave.as_fd()), (30, 100));
        // Written on the slave, read on the master (the line discipline turns `\n` into
        // `\r\n` on output).
        let mut slave = File::from(pty.slave);
        let mut master = File::from(pty.master);
        slave.write_all(b"hi\n").unwrap();
        let mut buf = [0u8; 4];
        master.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi\r\n");
    }

    #[test]
    fn the_slave_is_found_by_name_too() {
        let pty = open(5, 6).unwrap();
        let slave = open_slave_by_name(&pty.master).unwrap();
        assert_eq!(size(slave.as_fd()), (5, 6));
    }

    #[test]
    fn set_size_refuses_what_is_not_a_terminal() {
        let f = File::open("/dev/null").unwrap();
        assert!(set_size(f.as_fd(), 1, 1).is_err());
    }
}
