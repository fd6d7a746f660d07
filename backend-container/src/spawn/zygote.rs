//! The process's zygote (the fork server): starting it, forking inits through it (or taking
//! its spare), the root-filesystem templates it builds, the user namespaces it holds for
//! idmappings, and the process-wide spare and one-shot switches.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use super::{image, reap, seqpacket_pair, InitImage, SpawnError};
use crate::proto::{self, EncodeInit};

/// The fork server: the init image started once with `--zygote`. It forks a fresh init for
/// each control socket sent to it (see the init's `zygote`) and replies with its pid; as
/// root it also builds root-filesystem templates.
#[derive(Debug)]
struct Zygote {
    sock: OwnedFd,
    child: std::process::Child,
    /// How many of [`Forks::templates`] this zygote has built.
    built: usize,
    /// An init cloned ahead of time (its pid and our end of its socket; it waits for
    /// `MSG_START`), so a create skips the zygote's wake-up and `clone` (~0.3 ms here).
    spare: Option<(libc::pid_t, OwnedFd)>,
    /// Whether a spare was asked for and its reply not read yet (replies come in order).
    spare_asked: bool,
    /// How many templates existed when the spare was asked for: a spare copies the
    /// zygote's mount namespace as it is cloned, so it lacks templates built after that.
    spare_built: usize,
}

/// Where templates live in the zygote's mount namespace (as root). The directory is made on
/// the host if missing (empty, mode 0755: the inits reach it as unprivileged host users) and
/// stays empty there; the zygote mounts a tmpfs on it that only its namespace and its inits'
/// copies see.
pub(crate) const TEMPLATE_BASE: &str = "/run/agent-sandbox-templates";

/// The generated `/etc` files a template was built with: its key (see
/// `rootfs::etc_files`).
pub(crate) type TemplateKey = Vec<(&'static str, String)>;

/// The process's zygote and the templates asked of it.
#[derive(Debug)]
struct Forks {
    zygote: Option<Zygote>,
    /// Template `i` is at `TEMPLATE_BASE/i` in every zygote's namespace: a restarted zygote
    /// builds them all again before forking. Each with the host fingerprint it was built
    /// under (see `rootfs::host_fingerprint`): a changed host gets a new template.
    templates: Vec<(TemplateKey, u64)>,
    /// Cleared when a template could not be built: the classic setup is used from then on.
    templates_ok: bool,
    /// The host fingerprint and when it was taken (at most once a second).
    fingerprint: Option<(std::time::Instant, u64)>,
}

static FORKS: std::sync::Mutex<Forks> = std::sync::Mutex::new(Forks {
    zygote: None,
    templates: Vec::new(),
    templates_ok: true,
    fingerprint: None,
});

/// The template directory to start from, if the host has one: as root, an existing
/// directory that others may traverse (never changed if it is there), or one we make. None
/// in a one-shot process (see [`set_one_shot`]): a template pays off from a process's second
/// sandbox on, and building one for a single sandbox costs more than the classic setup.
fn template_base() -> Option<&'static str> {
    if ONE_SHOT.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    static BASE: OnceLock<bool> = OnceLock::new();
    let ok = *BASE.get_or_init(|| {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return false;
        }
        let _ = std::fs::DirBuilder::new().mode(0o755).create(TEMPLATE_BASE);
        std::fs::symlink_metadata(TEMPLATE_BASE)
            .is_ok_and(|m| m.is_dir() && m.uid() == 0 && m.mode() & 0o001 != 0)
    });
    ok.then_some(TEMPLATE_BASE)
}

impl Zygote {
    fn start(img: &InitImage) -> io::Result<Zygote> {
        let (ours, theirs) = seqpacket_pair()?;
        let mut cmd = std::process::Command::new(format!("/proc/self/fd/{}", img.raw_fd()));
        cmd.arg("--zygote");
        if let Some(base) = template_base() {
            cmd.arg(base);
        }
        // A process group of its own: a signal to the caller's group (a terminal's ^C, a
        // harness killing the group after the process exited) does not cut short a teardown
        // handed to it (see `hand_off_teardown`); it ends when our socket does.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .env_clear()
            .stdin(std::process::Stdio::from(theirs))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        Ok(Zygote {
            sock: ours,
            child,
            built: 0,
            spare: None,
            spare_asked: false,
            spare_built: 0,
        })
    }

    /// Reads the reply to an outstanding spare request, if any.
    fn settle(&mut self) -> io::Result<()> {
        if !std::mem::take(&mut self.spare_asked) {
            return Ok(());
        }
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        let mut reply = [0u8; 8];
        let mut iov = [io::IoSliceMut::new(&mut reply)];
        let mut space = nix::cmsg_space!([RawFd; 1]);
        let msg = loop {
            match recvmsg::<()>(
                self.sock.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Err(nix::Error::EINTR) => continue,
                r => break r.map_err(io::Error::from)?,
            }
        };
        let n = msg.bytes;
        let mut fd = None;
        for c in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                for raw in fds {
                    // SAFETY: the kernel installed this fd for us.
                    let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                    fd.get_or_insert(owned);
                }
            }
        }
        if n != 8 {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the sandbox zygote hung up",
            ));
        }
        let pid = proto::Dec::new(&reply).u32().unwrap_or(0);
        if let (true, Some(fd)) = (pid != 0, fd) {
            self.spare = Some((pid as libc::pid_t, fd));
        }
        Ok(())
    }

    /// Asks for a spare init unless one is there or coming (the reply is read later).
    fn ask_spare(&mut self) {
        if self.spare.is_some() || self.spare_asked {
            return;
        }
        let iov = [io::IoSlice::new(b"S")];
        let sent = nix::sys::socket::sendmsg::<()>(
            self.sock.as_raw_fd(),
            &iov,
            &[],
            nix::sys::socket::MsgFlags::MSG_NOSIGNAL | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
            None,
        );
        self.spare_asked = sent.is_ok();
        self.spare_built = self.built;
    }

    /// The spare init, if there is a live one that has every template (a stale one is
    /// killed: the next is cloned with the templates as they are now).
    fn take_spare(&mut self) -> Option<(libc::pid_t, OwnedFd)> {
        self.settle().ok()?;
        let (pid, fd) = self.spare.take()?;
        if self.spare_built < self.built {
            reap(pid, true);
            return None;
        }
        // It only waits until we speak: any event on its socket means it is gone.
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll of one valid pollfd, no wait.
        if unsafe { libc::poll(&mut p, 1, 0) } != 0 {
            reap(pid, true);
            return None;
        }
        Some((pid, fd))
    }

    /// Kills the zygote and its spare (also one whose announcement is still unread), and
    /// reaps them.
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A reply queued before it died still arrives; then EOF.
        let _ = self.settle();
        if let Some((pid, _)) = self.spare.take() {
            reap(pid, true);
        }
    }

    /// Sends `msg` (with `fds`) and reads back the 8-byte reply: a `u32` (`0`: failed) and
    /// an errno. `Err((true, _))`: the zygote is gone and never got the message (safe to
    /// retry); `Err((false, _))`: anything else.
    fn ask(&mut self, msg: &[u8], fds: &[RawFd]) -> Result<u32, (bool, io::Error)> {
        self.settle().map_err(|e| (false, e))?;
        self.send(msg, fds).map_err(|e| {
            let gone = matches!(e, nix::Error::EPIPE | nix::Error::ECONNRESET);
            (gone, io::Error::from(e))
        })?;
        let mut reply = [0u8; 8];
        let n = loop {
            // SAFETY: recv into a local buffer of the stated size.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    reply.as_mut_ptr().cast(),
                    reply.len(),
                    0,
                )
            };
            if n >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break n;
            }
        };
        if n != 8 {
            return Err((
                false,
                io::Error::new(io::ErrorKind::BrokenPipe, "the sandbox zygote hung up"),
            ));
        }
        let mut d = proto::Dec::new(&reply);
        let (v, errno) = (d.u32().unwrap_or(0), d.i32().unwrap_or(0));
        match v {
            0 => Err((false, io::Error::from_raw_os_error(errno))),
            v => Ok(v),
        }
    }

    /// Sends one request, `msg` with `fds` (after [`Zygote::settle`]).
    fn send(&self, msg: &[u8], fds: &[RawFd]) -> nix::Result<usize> {
        let cmsg = [nix::sys::socket::ControlMessage::ScmRights(fds)];
        let iov = [io::IoSlice::new(msg)];
        nix::sys::socket::sendmsg::<()>(
            self.sock.as_raw_fd(),
            &iov,
            &cmsg,
            nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
            None,
        )
    }

    /// Sends `ctl` and reads back the new init's pid. Errors as [`Zygote::ask`]: on
    /// `Err((false, _))` it may have forked an init for `ctl` before failing.
    /// `template`: cloned in the template namespace (else in ours, see the init's `zygote`).
    fn fork(&mut self, ctl: &OwnedFd, template: bool) -> Result<libc::pid_t, (bool, io::Error)> {
        let msg: &[u8] = if template { b"P" } else { b"F" };
        self.ask(msg, &[ctl.as_raw_fd()])
            .map(|pid| pid as libc::pid_t)
    }

    /// Builds templates `self.built..` of `keys`.
    fn build(&mut self, keys: &[(TemplateKey, u64)]) -> io::Result<()> {
        while let Some((key, _)) = keys.get(self.built) {
            let root = format!("{TEMPLATE_BASE}/{}", self.built);
            let mut e = proto::Enc::default();
            e.ops(&crate::rootfs::template_ops(&root, key.clone()));
            let fd = crate::ctl::payload_memfd(&e.0)?;
            let mut msg = b"T".to_vec();
            msg.extend_from_slice(&(self.built as u64).to_le_bytes());
            self.ask(&msg, &[fd.as_raw_fd()]).map_err(|(_, e)| e)?;
            self.built += 1;
        }
        Ok(())
    }
}

/// The root of the template for sandboxes whose generated `/etc` files are `key`, built on
/// first use; `None` where templates are unavailable (rootless, or the zygote could not make
/// one: the classic setup serves then).
pub(crate) fn template_root(key: TemplateKey) -> Option<String> {
    template_base()?;
    let img = image().ok()?;
    let mut f = FORKS.lock().ok()?;
    if !f.templates_ok {
        return None;
    }
    let now = std::time::Instant::now();
    let print = match f.fingerprint {
        Some((at, p)) if now.duration_since(at) < std::time::Duration::from_secs(1) => p,
        _ => {
            let p = crate::rootfs::host_fingerprint();
            f.fingerprint = Some((now, p));
            p
        }
    };
    let idx = slot(&mut f.templates, key, print)?;
    for attempt in 0..2 {
        if f.zygote.is_none() {
            f.zygote = Some(Zygote::start(img).ok()?);
        }
        let Forks {
            zygote, templates, ..
        } = &mut *f;
        let z = zygote.as_mut()?;
        match z.build(templates) {
            Ok(()) => return Some(format!("{TEMPLATE_BASE}/{idx}")),
            // A zygote that died (it is restarted on the next fork anyway): once more with a
            // new one, which builds every template again. Its socket closes before its exit
            // status can be waited for, so a failure is not asked whether it has died yet:
            // the first one always gets a new zygote, and only a new one failing too gives
            // templates up.
            Err(_) if attempt == 0 => {
                if let Some(old) = f.zygote.take() {
                    old.kill();
                }
            }
            Err(e) => {
                tracing::warn!(
                    "cannot build a root-filesystem template ({e}); sandboxes are set up \
                     without one"
                );
                f.templates_ok = false;
                return None;
            }
        }
    }
    None
}

/// Most templates a zygote holds (each is a tmpfs root and its mounts, never taken down):
/// the generated `/etc` files vary with what callers choose (a workspace alias names the
/// sandbox's user), so a caller naming name after name must not grow them without end.
/// Sandboxes of a key beyond these are set up without a template.
const MAX_TEMPLATES: usize = 8;

/// The index of the template for `key` on a host of fingerprint `print`, added to
/// `templates` if there is room; `None` when there is none.
fn slot(templates: &mut Vec<(TemplateKey, u64)>, key: TemplateKey, print: u64) -> Option<usize> {
    if let Some(i) = templates.iter().position(|(k, p)| *k == key && *p == print) {
        return Some(i);
    }
    if templates.len() >= MAX_TEMPLATES {
        return None;
    }
    templates.push((key, print));
    Some(templates.len() - 1)
}

/// Whether [`prefork`] asks for spares (see [`crate::spare_inits`]).
static SPARES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns spare inits on or off for the process (see [`crate::spare_inits`]).
pub(crate) fn set_spares(on: bool) {
    SPARES.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the process declared that it creates one sandbox and exits (see
/// [`crate::one_shot_process`]).
static ONE_SHOT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the process declared itself one-shot (see [`set_one_shot`]).
pub(crate) fn one_shot() -> bool {
    ONE_SHOT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Declares the process one-shot (see [`crate::one_shot_process`]): no spare inits and no
/// root-filesystem templates from then on.
pub(crate) fn set_one_shot() {
    ONE_SHOT.store(true, std::sync::atomic::Ordering::Relaxed);
    set_spares(false);
}

/// Hands the rest of a sandbox's teardown to the zygote (a one-shot process, see
/// [`crate::one_shot_process`]): kills init `pid` (our child, not yet reaped: its pid is
/// still its own) and sends the zygote a pidfd of it, the cgroup directories and files to
/// remove once it has ended, and `keep` (e.g. the uid-range lease), which the zygote
/// closes last. The zygote does that work while this process exits (it reads its socket's
/// end only after the request). Returns `false` when it cannot (no zygote, no pidfds, a
/// request too large, the zygote gone): nothing was sent (the init may have been killed),
/// and the caller tears down itself.
pub(crate) fn hand_off_teardown(
    pid: libc::pid_t,
    dirs: &[String],
    files: &[String],
    keep: &[RawFd],
) -> bool {
    let mut msg = proto::Enc::default();
    msg.0.push(b'R');
    msg.strs(dirs);
    msg.strs(files);
    if msg.0.len() > proto::ZYGOTE_REQUEST_MAX || keep.len() > 3 {
        return false;
    }
    let Ok(mut f) = FORKS.lock() else {
        return false;
    };
    let Some(z) = f.zygote.as_mut() else {
        return false;
    };
    if z.settle().is_err() {
        return false;
    }
    // SAFETY: pidfd_open(2) of our own unreaped child; no pointers.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let Ok(raw) = RawFd::try_from(raw) else {
        return false;
    };
    if raw < 0 {
        return false;
    }
    // SAFETY: pidfd_open returned a new descriptor that we own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: kill(2) of our own unreaped child.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let mut fds = vec![pidfd.as_raw_fd()];
    fds.extend_from_slice(keep);
    z.send(&msg.0, &fds).is_ok()
}

/// Has the zygote clone the next init ahead of time (see [`Zygote::spare`]) unless one is
/// there or coming. Called when a command has finished and when a sandbox is torn down,
/// moments that usually precede idleness (an agent thinking) rather than a create: asking at
/// the end of a create made the clone compete with that sandbox's first command.
pub(crate) fn prefork() {
    if !SPARES.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    if let Ok(mut f) = FORKS.lock() {
        if let Some(z) = f.zygote.as_mut() {
            z.ask_spare();
        }
    }
}

/// Forks a new init through the process's zygote (started on first use, and again if it
/// died: a new one first builds the templates the old one had), or takes its spare
/// (`use_spare`). `template`: the init will set up from a root-filesystem template, so it is
/// cloned in the zygote's template namespace (spares live there too); other inits are cloned
/// in the library's own mount namespace, whose current view their bind sources need.
/// Returns the init's pid (our child), our end of its control socket and whether it was the
/// spare.
pub(super) fn fork_init(
    img: &InitImage,
    use_spare: bool,
    template: bool,
) -> Result<(libc::pid_t, OwnedFd, bool), SpawnError> {
    let mut f = FORKS.lock().map_err(|_| SpawnError::ZygotePoisoned)?;
    let f = &mut *f;
    let mut last = None;
    for _ in 0..2 {
        if let Some(e) = f.ensure_zygote(img)? {
            last = Some(e);
        }
        // Without templates (rootless) there is one namespace, and spares serve everyone.
        if use_spare && (template || template_base().is_none()) {
            if let Some((pid, fd)) = f.zygote.as_mut().and_then(Zygote::take_spare) {
                return Ok((pid, fd, true));
            }
        }
        // A fresh socket each attempt: should a dying zygote have forked an init for the
        // last one, that init finds its socket closed and exits.
        let (ours, theirs) = seqpacket_pair().map_err(SpawnError::Socketpair)?;
        match f.zygote.as_mut().map(|zy| zy.fork(&theirs, template)) {
            Some(Ok(pid)) => return Ok((pid, ours, false)),
            // A fork the kernel refused (e.g. no pids left) is not the zygote's fault.
            Some(Err((false, e))) if e.raw_os_error().is_some() => return Err(SpawnError::Fork(e)),
            Some(Err((_, e))) => {
                last = Some(Box::new(SpawnError::Zygote(e)));
                if let Some(old) = f.zygote.take() {
                    old.kill();
                }
            }
            None => {}
        }
    }
    Err(SpawnError::ZygoteFailedTwice(last))
}

impl Forks {
    /// Starts the zygote if there is none (a new one first builds the templates the old one
    /// had). Returns a template rebuild's failure, if any (templates are off from then on).
    fn ensure_zygote(&mut self, img: &InitImage) -> Result<Option<Box<SpawnError>>, SpawnError> {
        if self.zygote.is_some() {
            return Ok(None);
        }
        let mut z = Zygote::start(img).map_err(SpawnError::StartZygote)?;
        let mut failed = None;
        if self.templates_ok {
            if let Err(e) = z.build(&self.templates) {
                self.templates_ok = false;
                failed = Some(Box::new(SpawnError::RebuildTemplates(e)));
            }
        }
        self.zygote = Some(z);
        Ok(failed)
    }
}

/// A process (our child) holding a new user namespace whose maps are not written yet, from
/// the zygote (see the init's `hold_userns`), with our end of the socket it watches.
pub(super) fn hold_userns() -> Result<(libc::pid_t, OwnedFd), SpawnError> {
    let img = image()?;
    let mut f = FORKS.lock().map_err(|_| SpawnError::ZygotePoisoned)?;
    let f = &mut *f;
    let mut last = None;
    for _ in 0..2 {
        if let Some(e) = f.ensure_zygote(img)? {
            last = Some(e);
        }
        let (ours, theirs) = seqpacket_pair().map_err(SpawnError::Socketpair)?;
        match f
            .zygote
            .as_mut()
            .map(|z| z.ask(b"U", &[theirs.as_raw_fd()]))
        {
            Some(Ok(pid)) => return Ok((pid as libc::pid_t, ours)),
            Some(Err((false, e))) if e.raw_os_error().is_some() => {
                return Err(SpawnError::IdmapNamespace(e))
            }
            Some(Err((_, e))) => {
                last = Some(Box::new(SpawnError::Zygote(e)));
                if let Some(old) = f.zygote.take() {
                    old.kill();
                }
            }
            None => {}
        }
    }
    Err(SpawnError::ZygoteFailedTwice(last))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_are_found_again_and_capped() {
        let key = |n: usize| vec![("passwd", format!("user{n}"))];
        let mut t = Vec::new();
        for n in 0..MAX_TEMPLATES {
            assert_eq!(slot(&mut t, key(n), 7), Some(n));
        }
        // The same key again: its own; a host whose files changed: none left.
        assert_eq!(slot(&mut t, key(3), 7), Some(3));
        assert_eq!(slot(&mut t, key(3), 8), None);
        // A caller naming one more: set up without a template, nothing added.
        assert_eq!(slot(&mut t, key(MAX_TEMPLATES), 7), None);
        assert_eq!(t.len(), MAX_TEMPLATES);
    }
}
