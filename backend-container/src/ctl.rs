//! The library's end of the control socket to a sandbox's init.

use std::collections::HashMap;
use std::io::{self, IoSlice, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc;

use crate::proto::{
    Dec, Enc, EncodeInit, FLAG_BIG, INLINE_MAX, MSG_EXEC, MSG_KILL, MSG_SIGNAL, PACKET_MAX,
    REP_SPARE,
};

/// One reply from the init.
#[derive(Debug)]
pub(crate) struct Reply {
    pub kind: u32,
    pub payload: Vec<u8>,
    /// The fd attached, if any (`MSG_SOCKET`'s socket).
    pub fd: Option<OwnedFd>,
}

type Waiters = Mutex<HashMap<u64, mpsc::UnboundedSender<Reply>>>;

/// A request/reply channel; replies are routed by id by a reader task.
#[derive(Debug)]
pub(crate) struct Ctl {
    fd: AsyncFd<OwnedFd>,
    next: AtomicU64,
    waiters: Waiters,
    closed: AtomicBool,
    /// The socket to the init's spare supervisor, when it announced one (`REP_SPARE`).
    spare: Mutex<Option<OwnedFd>>,
    /// A spare that served an exec and waits for the next (see [`Ctl::give_back`]).
    idle: Mutex<Option<Job>>,
}

impl Ctl {
    /// Wraps our end of the socketpair; the reader task starts with [`Ctl::start_reader`],
    /// once the first waiters are registered (a reply for an unregistered id is dropped).
    pub fn new(fd: OwnedFd) -> io::Result<Arc<Ctl>> {
        set_nonblocking(fd.as_raw_fd())?;
        let ctl = Arc::new(Ctl {
            // SAFETY: `fd` is an open socket owned by the AsyncFd for its whole life.
            fd: unsafe {
                AsyncFd::register_with_interest(fd, Interest::READABLE | Interest::WRITABLE)
            }?,
            next: AtomicU64::new(1),
            waiters: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            spare: Mutex::new(None),
            idle: Mutex::new(None),
        });
        Ok(ctl)
    }

    /// Starts the task that routes replies to their waiters.
    pub fn start_reader(self: &Arc<Self>) {
        let reader = Arc::clone(self);
        tokio::spawn(async move { reader.read_loop().await });
    }

    /// Whether the init hung up.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    async fn read_loop(&self) {
        let mut buf = vec![0u8; 4096];
        loop {
            let r = match self.fd.readable().await {
                Ok(mut g) => g.try_io(|fd| recv_with_fd(fd.as_raw_fd(), &mut buf)),
                Err(_) => Ok(Ok((0, None))),
            };
            match r {
                Err(_would_block) => continue,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Ok((0, _))) | Ok(Err(_)) => break,
                Ok(Ok((n, fd))) => self.dispatch(&buf[..n], fd),
            }
        }
        self.closed.store(true, Ordering::SeqCst);
        // Dropping the senders wakes every waiter with "closed".
        if let Ok(mut w) = self.waiters.lock() {
            w.clear();
        }
    }

    fn dispatch(&self, msg: &[u8], fd: Option<OwnedFd>) {
        let mut d = Dec::new(msg);
        let (Ok(kind), Ok(id)) = (d.u32(), d.u64()) else {
            return;
        };
        if kind == REP_SPARE {
            if let (Some(fd), Ok(mut s)) = (fd, self.spare.lock()) {
                *s = Some(fd);
            }
            return;
        }
        let reply = Reply {
            kind,
            payload: d.rest().to_vec(),
            fd,
        };
        if let Ok(w) = self.waiters.lock() {
            if let Some(tx) = w.get(&id) {
                let _ = tx.send(reply);
            }
        }
    }

    /// The init's spare supervisor, if one is ready (see [`Job`]): one that served an exec
    /// before, else the one the init announced last.
    pub fn take_spare(&self) -> Option<Job> {
        if let Some(j) = self.idle.lock().ok()?.take() {
            return Some(j);
        }
        let sock = self.spare.lock().ok()?.take()?;
        Job::new(sock).ok()
    }

    /// Keeps a spare whose exec is over and that said it can take another
    /// (`EXITED_REUSABLE`) for the next exec. The init forks no other spare meanwhile (it
    /// does when a spare cannot be reused, or dies), so there is at most one.
    pub fn give_back(&self, job: Job) {
        if let Ok(mut idle) = self.idle.lock() {
            *idle = Some(job);
        }
    }

    /// A fresh request id without a waiter (for a [`Job`]).
    pub fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::SeqCst)
    }

    /// Registers a waiter for a new request id.
    pub fn register(&self) -> (u64, mpsc::UnboundedReceiver<Reply>) {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut w) = self.waiters.lock() {
            if !self.is_closed() {
                w.insert(id, tx);
            }
        }
        (id, rx)
    }

    /// Registers a waiter for a fixed id (0: the bootstrap).
    pub fn register_fixed(&self, id: u64) -> mpsc::UnboundedReceiver<Reply> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut w) = self.waiters.lock() {
            w.insert(id, tx);
        }
        rx
    }

    /// Forgets a waiter.
    pub fn unregister(&self, id: u64) {
        if let Ok(mut w) = self.waiters.lock() {
            w.remove(&id);
        }
    }

    /// Sends one message with fds; large payloads travel in a memfd.
    pub async fn send(
        &self,
        kind: u32,
        id: u64,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> io::Result<()> {
        let mut raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let mut kind = kind;
        let big;
        let inline: &[u8] = if payload.len() > INLINE_MAX {
            big = payload_memfd(payload)?;
            raw.push(big.as_raw_fd());
            kind |= FLAG_BIG;
            &[]
        } else {
            payload
        };
        let mut head = Enc::header(kind, id);
        head.0.extend_from_slice(inline);
        debug_assert!(head.0.len() <= PACKET_MAX);
        loop {
            let mut g = self.fd.writable().await?;
            let r = g.try_io(|fd| {
                let iov = [IoSlice::new(&head.0)];
                let cmsg = [ControlMessage::ScmRights(&raw)];
                let cm: &[ControlMessage] = if raw.is_empty() { &[] } else { &cmsg };
                sendmsg::<()>(fd.as_raw_fd(), &iov, cm, MsgFlags::MSG_NOSIGNAL, None)
                    .map_err(io::Error::from)
            });
            match r {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Sends a request and waits for its final reply (OK or ERR).
    pub async fn call(
        &self,
        kind: u32,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> io::Result<Reply> {
        let (id, mut rx) = self.register();
        let r = async {
            self.send(kind, id, payload, fds).await?;
            rx.recv()
                .await
                .ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "sandbox init is gone"))
        }
        .await;
        self.unregister(id);
        r
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on an fd we own.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// `data` in a fresh memfd, positioned at its start (a payload too big for one packet).
pub(crate) fn payload_memfd(data: &[u8]) -> io::Result<OwnedFd> {
    let fd = nix::sys::memfd::memfd_create(c"asb-payload", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .map_err(io::Error::from)?;
    let mut f = std::fs::File::from(fd);
    f.write_all(data)?;
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(0))?;
    Ok(OwnedFd::from(f))
}

/// `recv` of one message and at most one fd passed with it (`MSG_CMSG_CLOEXEC`).
fn recv_with_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned};
    let mut iov = [io::IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(sock, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(io::Error::from)?;
    let mut fd = None;
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::ScmRights(fds) = c {
                for raw in fds {
                    // SAFETY: the kernel installed this fd for us; we own it now.
                    let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
                    fd.get_or_insert(owned);
                }
            }
        }
    }
    Ok((msg.bytes, fd))
}

/// One exec handed straight to the init's spare supervisor (see the init's `fork_spare`):
/// the request, its replies and kill requests travel on the spare's own socket, skipping
/// the init (and the control socket's reader task) on the exec's critical path.
#[derive(Debug)]
pub(crate) struct Job {
    fd: AsyncFd<OwnedFd>,
}

impl Job {
    /// Wraps the socket to a spare supervisor.
    fn new(sock: OwnedFd) -> io::Result<Job> {
        set_nonblocking(sock.as_raw_fd())?;
        Ok(Job {
            // SAFETY: `sock` is an open socket owned by the AsyncFd for its whole life.
            fd: unsafe { AsyncFd::register_with_interest(sock, Interest::READABLE) }?,
        })
    }

    /// A socket pair for an exec started through the init with `EXEC_JOB`: the `Job` (our
    /// end) and the end to send along with the exec.
    pub fn pair() -> io::Result<(Job, OwnedFd)> {
        let (ours, theirs) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        Ok((Job::new(ours)?, theirs))
    }

    /// Sends exec `id` (`payload`, at most [`INLINE_MAX`] bytes, and its stdio `fds`) to the
    /// spare. Fails if the spare is gone: the exec is then not started.
    pub fn start(&self, id: u64, payload: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        if payload.len() > INLINE_MAX {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let mut head = Enc::header(MSG_EXEC, id);
        head.0.extend_from_slice(payload);
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let iov = [IoSlice::new(&head.0)];
        let cmsg = [ControlMessage::ScmRights(&raw)];
        // The spare reads nothing else and we send nothing else: an empty buffer, so the
        // send does not block.
        sendmsg::<()>(
            self.fd.get_ref().as_raw_fd(),
            &iov,
            &cmsg,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(io::Error::from)?;
        Ok(())
    }

    /// The next reply; `None` once the supervisor has hung up.
    pub async fn recv(&self) -> Option<Reply> {
        let mut buf = [0u8; 256];
        loop {
            let mut g = self.fd.readable().await.ok()?;
            // A terminal's master comes with `REP_PTY`: take fds too.
            let r = g.try_io(|fd| recv_with_fd(fd.as_raw_fd(), &mut buf));
            match r {
                Err(_would_block) => continue,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Ok((0, _))) | Ok(Err(_)) => return None,
                Ok(Ok((n, fd))) => {
                    let mut d = Dec::new(&buf[..n]);
                    let (Ok(kind), Ok(_id)) = (d.u32(), d.u64()) else {
                        continue;
                    };
                    return Some(Reply {
                        kind,
                        payload: d.rest().to_vec(),
                        fd,
                    });
                }
            }
        }
    }

    /// Asks the supervisor to signal the command's process group (while its leader lives).
    pub fn signal(&self, id: u64, signo: i32) {
        let mut head = Enc::header(MSG_SIGNAL, id);
        head.i32(signo);
        self.send_small(&head.0);
    }

    /// Asks the supervisor to kill the exec's whole tree (acknowledged with `REP_OK`).
    pub fn kill(&self, id: u64) {
        let head = Enc::header(MSG_KILL, id);
        self.send_small(&head.0);
    }

    fn send_small(&self, msg: &[u8]) {
        // SAFETY: send of a buffer we own; a hung-up peer is not an error here.
        unsafe {
            libc::send(
                self.fd.get_ref().as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            );
        }
    }
}
