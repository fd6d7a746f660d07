//! The control socket and its kin: replies to the library (on the control socket, or on the
//! socket of an exec a spare supervisor serves), and `SOCK_SEQPACKET` packets carrying file
//! descriptors (`SCM_RIGHTS`) both ways.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::proto::*;
use crate::sys::*;

/// The control socket: the library hands it to the init as stdin, which moves it here.
pub(crate) const CTL: RawFd = 3;

/// Where this process's replies go: the control socket, or (a supervisor serving an exec the
/// library handed it directly, see [`fork_spare`](crate::supervise::fork_spare)) that exec's
/// own socket.
pub(crate) static REPLY_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(CTL);

/// Sends a reply (`kind`, `id`, `payload`) to the library; failures are ignored (the
/// library is gone).
pub(crate) fn send(kind: u32, id: u64, payload: &[u8]) {
    let mut e = Enc::header(kind, id);
    e.0.extend_from_slice(payload);
    let fd = REPLY_FD.load(std::sync::atomic::Ordering::Relaxed);
    if fd == CTL {
        // SAFETY: writes a buffer we own to our control socket.
        unsafe {
            write(CTL, e.0.as_ptr(), e.0.len());
        }
    } else {
        // The library may have hung up its end: no SIGPIPE.
        let _ = send_with_fds(fd, &e.0, &[]);
    }
}

/// Reports that request `id` failed at op `index` (`u32::MAX`: the request itself).
pub(crate) fn send_err(id: u64, index: u32, err: &io::Error, what: &str) {
    send(REP_ERR, id, &err_payload(index, err, what));
}

/// A `REP_ERR` payload: u32 op index, i32 errno (0 if none), message (`what: err`).
fn err_payload(index: u32, err: &io::Error, what: &str) -> Vec<u8> {
    let mut e = Enc::default();
    e.u32(index);
    e.i32(err.raw_os_error().unwrap_or(0));
    e.str(&format!("{what}: {err}"));
    e.0
}

/// Writes `msg` to `fd` (best effort: a message for a reader that may be gone).
pub(crate) fn raw_write(fd: RawFd, msg: &[u8]) {
    // SAFETY: writes a live buffer to an fd.
    unsafe {
        write(fd, msg.as_ptr(), msg.len());
    }
}

/// Sends `data` with `fds` (at most 4) on a `SOCK_SEQPACKET` socket.
pub(crate) fn send_with_fds(sock: RawFd, data: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
    if fds.len() > 4 {
        return Err(io::Error::from_raw_os_error(7 /* E2BIG */));
    }
    let mut iov = IoVec {
        base: data.as_ptr() as *mut c_void,
        len: data.len(),
    };
    // struct cmsghdr { size_t len; int level; int type; } + up to 4 fds.
    let mut ctl = [0u64; 4];
    let c = ctl.as_mut_ptr() as *mut u8;
    let len = 16 + 4 * fds.len();
    // SAFETY: writes within `ctl` (32 bytes: a 16-byte header and 4 fds).
    unsafe {
        std::ptr::write_unaligned(c as *mut usize, len);
        std::ptr::write_unaligned(c.add(8) as *mut i32, 1 /* SOL_SOCKET */);
        std::ptr::write_unaligned(c.add(12) as *mut i32, 1 /* SCM_RIGHTS */);
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(c.add(16 + 4 * i) as *mut i32, fd.as_raw_fd());
        }
    }
    let msg = MsgHdr {
        name: std::ptr::null_mut(),
        namelen: 0,
        iov: &mut iov,
        iovlen: 1,
        control: if fds.is_empty() {
            std::ptr::null_mut()
        } else {
            c as *mut c_void
        },
        controllen: if fds.is_empty() { 0 } else { (len + 7) & !7 },
        flags: 0,
    };
    // SAFETY: the message points at live buffers of the stated sizes.
    if unsafe {
        sendmsg(sock, &msg, 0x4000 /* MSG_NOSIGNAL */)
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives one packet; `Ok(None)` when the library is gone.
pub(crate) fn recv(buf: &mut [u8]) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    recv_on(CTL, buf)
}

/// [`recv`] on another socket.
pub(crate) fn recv_on(sock: RawFd, buf: &mut [u8]) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut ctl = [0u64; 32];
    let mut iov = IoVec {
        base: buf.as_mut_ptr(),
        len: buf.len(),
    };
    let mut msg = MsgHdr {
        name: std::ptr::null_mut(),
        namelen: 0,
        iov: &mut iov,
        iovlen: 1,
        control: ctl.as_mut_ptr() as *mut c_void,
        controllen: std::mem::size_of_val(&ctl),
        flags: 0,
    };
    // SAFETY: msghdr points at live buffers of the stated sizes.
    let n = unsafe { recvmsg(sock, &mut msg, MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    let ctl_bytes = ctl.as_ptr() as *const u8;
    let mut off = 0usize;
    while off + 16 <= msg.controllen {
        // SAFETY: reads a cmsghdr within the control buffer the kernel filled.
        let (len, level, ty) = unsafe {
            let p = ctl_bytes.add(off);
            (
                std::ptr::read_unaligned(p as *const usize),
                std::ptr::read_unaligned(p.add(8) as *const i32),
                std::ptr::read_unaligned(p.add(12) as *const i32),
            )
        };
        if len < 16 || off + len > msg.controllen {
            break;
        }
        if level == 1 && ty == 1 {
            for k in 0..(len - 16) / 4 {
                // SAFETY: SCM_RIGHTS data is an array of fds now owned by us.
                let fd = unsafe {
                    std::ptr::read_unaligned(ctl_bytes.add(off + 16 + 4 * k) as *const i32)
                };
                // SAFETY: the kernel installed this fd for us.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        off += (len + 7) & !7;
    }
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    if msg.flags & (MSG_TRUNC | MSG_CTRUNC) != 0 {
        return Err(io::Error::from_raw_os_error(90));
    }
    Ok(Some((n as usize, fds)))
}

/// A close-on-exec `SOCK_SEQPACKET` socketpair.
pub(crate) fn socket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut sv = [0 as c_int; 2];
    // SAFETY: socketpair into a valid array; the fds are ours.
    unsafe {
        if socketpair(
            1, /* AF_UNIX */
            5 /* SOCK_SEQPACKET */ | O_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        ) < 0
        {
            return Err(io::Error::last_os_error());
        }
        Ok((OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    #[test]
    fn error_replies_carry_the_op_the_errno_and_a_message() {
        let b = err_payload(3, &io::Error::from_raw_os_error(2), "mkdir /x");
        let mut d = Dec::new(&b);
        assert_eq!(d.u32(), Ok(3));
        assert_eq!(d.i32(), Ok(2));
        let msg = d.str().unwrap();
        assert!(msg.starts_with("mkdir /x: "), "{msg}");
        assert!(msg.contains("os error 2"), "{msg}");
        assert!(d.rest().is_empty());
        // An error without an errno reports 0.
        let b = err_payload(u32::MAX, &io::Error::other("bad"), "setup");
        let mut d = Dec::new(&b);
        assert_eq!((d.u32(), d.i32()), (Ok(u32::MAX), Ok(0)));
        assert_eq!(d.str(), Ok("setup: bad".to_string()));
    }

    #[test]
    fn packets_and_fds_travel_over_a_socketpair() {
        let (a, b) = socket_pair().unwrap();
        let (p, q) = socket_pair().unwrap();
        let null: OwnedFd = File::open("/dev/null").unwrap().into();
        send_with_fds(a.as_raw_fd(), b"hello", &[null, q]).unwrap();
        let mut buf = [0u8; 64];
        let (n, fds) = recv_on(b.as_raw_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 2);
        // Received close-on-exec (F_GETFD = 1, FD_CLOEXEC = 1).
        for fd in &fds {
            // SAFETY: fcntl(F_GETFD) on a descriptor we own.
            assert_eq!(unsafe { fcntl(fd.as_raw_fd(), 1) } & 1, 1);
        }
        // The second is `q`: what goes into `p` comes out of it.
        send_with_fds(p.as_raw_fd(), b"through", &[]).unwrap();
        let (n, none) = recv_on(fds[1].as_raw_fd(), &mut buf).unwrap().unwrap();
        assert_eq!((&buf[..n], none.len()), (&b"through"[..], 0));
        // At most four descriptors per packet.
        let five: Vec<OwnedFd> = (0..5)
            .map(|_| File::open("/dev/null").unwrap().into())
            .collect();
        let e = send_with_fds(a.as_raw_fd(), b"x", &five).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(7));
        // A packet larger than the buffer is an error, not a silent truncation.
        send_with_fds(a.as_raw_fd(), &[1; 100], &[]).unwrap();
        let e = recv_on(b.as_raw_fd(), &mut buf[..10]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(90));
        // The peer hung up.
        drop(a);
        assert!(recv_on(b.as_raw_fd(), &mut buf).unwrap().is_none());
    }
}
