//! Starting a sandbox's init: the embedded init binary in a sealed memfd, forked by the
//! process's zygote (itself started once with `posix_spawn`), and brought into its
//! namespaces by a short bootstrap over its socket.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::ctl::Ctl;
use crate::proto::{self, EncodeInit};
use std::sync::OnceLock;

pub(crate) use crate::init_image::InitImage;

/// Why a sandbox's init could not be started ([`start_init`], [`spawn_init`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpawnError {
    /// The init image could not be put in a memfd (kept for the process: shared).
    #[error("load the sandbox init into a memfd: {0}")]
    Image(#[source] std::sync::Arc<io::Error>),
    /// A thread panicked holding the zygote.
    #[error("the sandbox zygote's lock is poisoned")]
    ZygotePoisoned,
    /// The zygote could not be started.
    #[error("start the sandbox zygote: {0}")]
    StartZygote(#[source] io::Error),
    /// A restarted zygote could not rebuild the root-filesystem templates.
    #[error("rebuild the root-filesystem templates: {0}")]
    RebuildTemplates(#[source] io::Error),
    /// The zygote failed to fork an init (it is restarted).
    #[error("{0}")]
    Zygote(#[source] io::Error),
    /// The zygote failed on both attempts; the last failure, if any.
    #[error(
        "the sandbox zygote failed twice: {}",
        .0.as_ref().map(ToString::to_string).unwrap_or_default()
    )]
    ZygoteFailedTwice(#[source] Option<Box<SpawnError>>),
    /// The control socket pair could not be made.
    #[error("socketpair: {0}")]
    Socketpair(#[source] io::Error),
    /// The kernel refused the init's fork (e.g. no pids left).
    #[error("fork the sandbox init: {0}")]
    Fork(#[source] io::Error),
    /// The init's uid/gid maps could not be written.
    #[error("write uid/gid maps: {0}")]
    WriteMaps(#[source] io::Error),
    /// The control socket could not be set up.
    #[error("control socket: {0}")]
    ControlSocket(#[source] io::Error),
    /// The start messages could not be sent.
    #[error("start the sandbox init: {0}")]
    Start(#[source] io::Error),
    /// [`spawn_init`] was given a [`Starting`] already used.
    #[error("the sandbox init was already taken")]
    AlreadyTaken,
    /// The init died before it was ready.
    #[error("the init exited during start-up")]
    InitExited,
    /// The init reported a failure (`REP_ERR`): its message and errno, if any.
    #[error("sandbox init start-up failed: {message}")]
    InitFailed {
        /// The init's message.
        message: String,
        /// The errno it reported, if not 0.
        #[source]
        errno: Option<io::Error>,
    },
    /// The embedded init was built from other sources than this library.
    #[error(
        "the embedded sandbox init was built from other sources than this \
         library (a stale build-script output, e.g. another checkout sharing the \
         target directory): `touch backend-container/init/main.rs` and rebuild"
    )]
    StaleInit,
    /// The cgroup job was already awaited.
    #[error("cgroup task already taken")]
    CgroupTaskTaken,
    /// The cgroup job panicked or was cancelled.
    #[error("cgroup task failed: {0}")]
    CgroupTask(#[source] tokio::task::JoinError),
    /// The sandbox's cgroup could not be made.
    #[error("create the sandbox cgroup: {0}")]
    CreateCgroup(#[source] io::Error),
    /// A cgroup file the init joins by could not be opened.
    #[error("open {}: {source}", path.display())]
    OpenCgroupFile {
        /// The file.
        path: std::path::PathBuf,
        /// The `open` failure.
        #[source]
        source: io::Error,
    },
    /// The init could not be moved into its cgroup (v2).
    #[error("move the sandbox init into its cgroup: {0}")]
    JoinCgroup(#[source] io::Error),
    /// The bootstrap messages could not be sent.
    #[error("bootstrap: {0}")]
    Bootstrap(#[source] io::Error),
    /// The setup requests could not be sent.
    #[error("send the setup: {0}")]
    SendSetup(#[source] io::Error),
    /// The user namespace of a workspace's idmapping could not be made.
    #[error("make the workspace's idmapping: {0}")]
    IdmapNamespace(#[source] io::Error),
    /// The kernel refused to idmap the workspace's mount (e.g. its filesystem does not
    /// support idmapped mounts).
    #[error("idmap the workspace's mount: {0}")]
    IdmapMount(#[source] io::Error),
}

static IMAGE: OnceLock<Result<InitImage, std::sync::Arc<io::Error>>> = OnceLock::new();

/// The init image, created on first use.
pub(crate) fn image() -> Result<&'static InitImage, SpawnError> {
    IMAGE
        .get_or_init(|| load_image().map_err(std::sync::Arc::new))
        .as_ref()
        .map_err(|e| SpawnError::Image(e.clone()))
}

fn load_image() -> io::Result<InitImage> {
    crate::init_image::load()
}

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
        let cmsg = [nix::sys::socket::ControlMessage::ScmRights(fds)];
        let iov = [io::IoSlice::new(msg)];
        nix::sys::socket::sendmsg::<()>(
            self.sock.as_raw_fd(),
            &iov,
            &cmsg,
            nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(|e| {
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
    let idx = match f
        .templates
        .iter()
        .position(|(k, p)| *k == key && *p == print)
    {
        Some(i) => i,
        None => {
            f.templates.push((key, print));
            f.templates.len() - 1
        }
    };
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
fn fork_init(
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
fn hold_userns() -> Result<(libc::pid_t, OwnedFd), SpawnError> {
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

/// How a host-directory workspace's owner appears inside: the idmapping of its mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkspaceIds {
    /// The directory's owner on the host (uid, gid): the ids on disk.
    pub owner: (u32, u32),
    /// The host ids (uid, gid) of the sandbox's command user (its slot in the sandbox's
    /// range): what the owner appears as through the mount, so the command user owns it.
    pub user: (u32, u32),
}

impl WorkspaceIds {
    /// The `uid_map` and `gid_map` texts of the mount's user namespace: one id each, the
    /// owner's (on disk) to the command user's (host id). Every other id on disk is unmapped
    /// (it shows as `nobody` and cannot be written as).
    fn maps(&self) -> (String, String) {
        (
            format!("{} {} 1\n", self.owner.0, self.user.0),
            format!("{} {} 1\n", self.owner.1, self.user.1),
        )
    }
}

/// A detached, recursive clone of the mount tree at `dir` (a host-directory workspace),
/// idmapped (every mount in it) so that its owner's files appear as the sandbox's command
/// user's and what that user creates is stored as the owner's (see [`WorkspaceIds`]);
/// `nosuid`, `nodev`, and read-only if asked. Needs root and filesystems that support
/// idmapped mounts; the caller falls back (or refuses) otherwise.
pub(crate) fn workspace_tree(
    dir: &std::path::Path,
    ids: WorkspaceIds,
    read_only: bool,
) -> Result<OwnedFd, SpawnError> {
    const AT_RECURSIVE: libc::c_uint = 0x8000;
    let tree = open_tree_clone(dir, AT_RECURSIVE).map_err(SpawnError::IdmapMount)?;
    let (pid, hold) = hold_userns()?;
    let (uid_map, gid_map) = ids.maps();
    let ns = std::fs::write(format!("/proc/{pid}/uid_map"), uid_map)
        .and_then(|()| std::fs::write(format!("/proc/{pid}/gid_map"), gid_map))
        .and_then(|()| std::fs::File::open(format!("/proc/{pid}/ns/user")));
    drop(hold);
    reap(pid, true);
    let ns = ns.map_err(SpawnError::IdmapNamespace)?;
    let attr = MountAttr {
        set: MOUNT_ATTR_IDMAP
            | MOUNT_ATTR_NOSUID
            | MOUNT_ATTR_NODEV
            | if read_only { MOUNT_ATTR_RDONLY } else { 0 },
        clr: 0,
        propagation: 0,
        userns_fd: ns.as_raw_fd() as u64,
    };
    // SAFETY: mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, size) with a valid
    // struct.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint | AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(SpawnError::IdmapMount(io::Error::last_os_error()));
    }
    Ok(tree)
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut sv = [0 as RawFd; 2];
    // SAFETY: socketpair with a valid out array.
    cvt(unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        )
    })?;
    // SAFETY: the kernel gave us these fds.
    Ok(unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) })
}

/// How the sandbox's ids map to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IdMap {
    /// Host uid of uid 0 inside.
    pub host_root: u32,
    /// Number of ids mapped (1 when rootless).
    pub count: u32,
    /// Host gid of gid 0 inside.
    pub host_root_gid: u32,
    /// Whether we are rootless (only our own uid is mapped, as root inside).
    pub rootless: bool,
    /// As root with a host-directory workspace: the host uid/gid the sandbox user
    /// ([`SANDBOX_USER`] inside) maps to instead of its slot in the range (the directory's
    /// owner), so it can write its workspace.
    pub user_override: Option<(u32, u32)>,
}

/// The uid/gid commands run as inside the sandbox (as root; rootless they run as 0).
pub(crate) const SANDBOX_USER: u32 = 1000;

impl IdMap {
    /// The host uid of an inside uid.
    pub fn host_uid(&self, inside: u32) -> u32 {
        match self.user_override {
            Some((u, _)) if inside == SANDBOX_USER => u,
            _ => self.host_root + inside,
        }
    }
    /// The host gid of an inside gid.
    pub fn host_gid(&self, inside: u32) -> u32 {
        match self.user_override {
            Some((_, g)) if inside == SANDBOX_USER => g,
            _ => self.host_root_gid + inside,
        }
    }

    /// The `uid_map` (or `gid_map`) text.
    fn map_text(&self, base: u32, over: Option<u32>) -> String {
        match over {
            Some(o) if self.count > SANDBOX_USER + 1 => format!(
                "0 {base} {u}\n{u} {o} 1\n{next} {} {}\n",
                base + SANDBOX_USER + 1,
                self.count - SANDBOX_USER - 1,
                u = SANDBOX_USER,
                next = SANDBOX_USER + 1
            ),
            _ => format!("0 {base} {}\n", self.count),
        }
    }
}

/// A started (but not yet set up) init.
#[derive(Debug)]
pub(crate) struct Spawned {
    /// Host pid of the sandbox's pid 1 (our direct child).
    pub pid: libc::pid_t,
    /// The control channel to it.
    pub ctl: std::sync::Arc<Ctl>,
    /// The setup requests queued behind the bootstrap: ids and reply channels, in order.
    pub queued: Vec<(u64, tokio::sync::mpsc::UnboundedReceiver<crate::ctl::Reply>)>,
    /// Whether the rootfs directory's lower layer went over as an idmapped mount.
    pub idmapped: bool,
    /// The sandbox's cgroups (pid 1 is in them).
    pub cgroup: Option<crate::cgroup::SandboxCgroup>,
    /// Whether the init brought its `lo` up itself (a spare, see `proto::BOOT_LO_UP`).
    pub lo_up: bool,
}

/// The job making the sandbox's cgroups: it returns them with their join files opened for
/// writing (`SandboxCgroup::join_files`); the init writes `0` to each to move itself in, our credentials (the opener's) authorizing the write.
///
/// Why the process moves itself rather than being moved: on cgroup v1, moving another process
/// takes the global `cgroup_threadgroup_rwsem` for writing, which waits for an RCU grace
/// period whenever no migration happened in the last few — ~10-20 ms on an idle host,
/// measured here, against ~0.1 ms in a tight loop. A single-threaded process writing `0`
/// (itself) to a v1 `tasks` file is the one case the kernel migrates without that lock. (On
/// v2, `cgroup.procs` always takes it, so there [`spawn_init`] writes the init's pid itself.)
pub(crate) type CgroupJob = tokio::task::JoinHandle<
    Result<Option<(crate::cgroup::SandboxCgroup, Vec<OwnedFd>)>, SpawnError>,
>;

/// An init told to start ([`start_init`]), not yet bootstrapped ([`spawn_init`]). Dropped
/// unused (e.g. a create future cancelled meanwhile), it kills and reaps the init.
#[derive(Debug)]
pub(crate) struct Starting {
    inner: Option<StartingInit>,
}

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(i) = self.inner.take() {
            reap(i.first, true);
        }
    }
}

/// What [`Starting`] holds.
#[derive(Debug)]
struct StartingInit {
    first: libc::pid_t,
    ctl: std::sync::Arc<Ctl>,
    rx: tokio::sync::mpsc::UnboundedReceiver<crate::ctl::Reply>,
    /// Whether it is the zygote's spare (which may have died unseen: see [`spawn_init`]).
    spare: bool,
    /// Whether it was cloned for a template-mode setup (see [`fork_init`]).
    template: bool,
}

/// Takes the spare init (`use_spare`, for a `template`-mode create; see [`fork_init`]) or has
/// the zygote clone one, writes its id maps (`ids`: its user namespace exists from its
/// `clone`) and tells it to start, with `MAPS` right behind `START`: it makes its namespaces
/// (a spare has them) and becomes root inside while the caller plans the sandbox, with no
/// round trip to us, then [`spawn_init`] carries on. (A root-filesystem template the setup
/// will use must exist before this: the init copies the zygote's mount namespace as it
/// starts.)
pub(crate) async fn start_init(
    use_spare: bool,
    template: bool,
    ids: &IdMap,
) -> Result<Starting, SpawnError> {
    let img = image()?;
    let mut use_spare = use_spare;
    let (first, ours, spare) = loop {
        let (first, ours, spare) = fork_init(img, use_spare, template)?;
        match write_maps(first, ids) {
            Ok(()) => break (first, ours, spare),
            // A spare that died unseen (its maps cannot be written): a fresh clone.
            Err(_) if spare => {
                reap(first, true);
                use_spare = false;
            }
            Err(e) => {
                reap(first, true);
                return Err(SpawnError::WriteMaps(e));
            }
        }
    };
    let ctl = match Ctl::new(ours) {
        Ok(c) => c,
        Err(e) => {
            reap(first, true);
            return Err(SpawnError::ControlSocket(e));
        }
    };
    let rx = ctl.register_fixed(0);
    ctl.start_reader();
    for msg in [proto::MSG_START, proto::MSG_MAPS] {
        if let Err(e) = ctl.send(msg, 0, &[], &[]).await {
            if !spare {
                reap(first, true);
                return Err(SpawnError::Start(e));
            }
            // A dead spare: `spawn_init` sees its socket closed and clones another.
            break;
        }
    }
    Ok(Starting {
        inner: Some(StartingInit {
            first,
            ctl,
            rx,
            spare,
            template,
        }),
    })
}

/// Gives up on a create before [`spawn_init`]: kills the started init.
pub(crate) fn abandon(starting: Starting) {
    drop(starting);
}

/// Brings a started init ([`start_init`]) to pid 1 of fresh user, pid, mount, UTS, IPC and
/// network namespaces (the cgroup and time namespaces come later, from inside). A spare
/// init has those from its `clone` and its `lo` up already ([`Spawned::lo_up`]).
///
/// The library never forks itself: the process's zygote (see [`Zygote`]) clones the init
/// with new user and pid namespaces and `CLONE_PARENT`, so it is our child, with the control
/// socket as its stdin. [`start_init`] wrote its id maps and sent `START` and `MAPS`; it says
/// `REP_BOOT`, makes the other namespaces and becomes root inside while the cgroup job makes
/// the cgroups; it joins those itself (writing `0` to the files the job opened) before it
/// starts anything, so all it starts inherits them.
///
/// `requests` (`MSG_SETUP` payloads) are queued right behind the bootstrap messages, so the
/// init finds them waiting. With `lower` (the root's layers, as root), the first one carries
/// a detached, idmapped mount of each, in order (see [`idmapped_tree`]); if any cannot be
/// idmapped, none (the init then binds the layers as they are).
pub(crate) async fn spawn_init(
    starting: Starting,
    ids: &IdMap,
    requests: &[&[u8]],
    lower: &[std::path::PathBuf],
    workspace: Option<OwnedFd>,
    cgroup_job: CgroupJob,
) -> Result<Spawned, SpawnError> {
    let mut starting = starting;
    let (first, ctl, mut rx, boot) = loop {
        let Some(StartingInit {
            first,
            ctl,
            mut rx,
            spare,
            template,
        }) = starting.inner.take()
        else {
            return Err(SpawnError::AlreadyTaken);
        };
        match rx.recv().await {
            Some(b) => break (first, ctl, rx, b),
            // A spare that died just before we took it (its death not yet visible then):
            // once more with a fresh clone.
            None if spare => {
                reap(first, true);
                match start_init(false, template, ids).await {
                    Ok(s) => starting = s,
                    Err(e) => {
                        if let Ok(Ok(Some((c, _)))) = cgroup_job.await {
                            c.remove(std::time::Duration::from_millis(500));
                        }
                        return Err(e);
                    }
                }
            }
            None => {
                reap(first, true);
                if let Ok(Ok(Some((c, _)))) = cgroup_job.await {
                    c.remove(std::time::Duration::from_millis(500));
                }
                return Err(SpawnError::InitExited);
            }
        }
    };
    let queued: Vec<_> = requests.iter().map(|_| ctl.register()).collect();
    let mut idmapped = false;
    let mut lo_up = false;
    let mut cgroup = None;
    let mut cgroup_job = Some(cgroup_job);
    let result = async {
        if boot.kind != proto::REP_BOOT {
            return Err(describe_err(&boot));
        }
        let mut dec = proto::Dec::new(&boot.payload);
        if dec.u64() != Ok(proto::SOURCE_HASH) {
            return Err(SpawnError::StaleInit);
        }
        lo_up = dec.u8().is_ok_and(|f| f & proto::BOOT_LO_UP != 0);
        // A template-mode setup's host-directory workspace, as a detached mount (`Op::Lower`).
        let mut lower_fd: Vec<OwnedFd> = workspace.into_iter().collect();
        // All or nothing: the init takes one tree per `Op::Lower`, in order.
        let trees: std::result::Result<Vec<OwnedFd>, _> = lower
            .iter()
            .map(|dir| idmapped_tree(dir, first).map_err(|e| (dir, e)))
            .collect();
        match trees {
            Ok(t) if !t.is_empty() => {
                lower_fd.extend(t);
                idmapped = true;
            }
            Ok(_) => {}
            Err((dir, e)) => tracing::warn!(
                dir = %dir.display(),
                "cannot idmap a root filesystem layer ({e}); its files keep their host owners \
                 (unmapped ones show as nobody)"
            ),
        }
        let Some(job) = cgroup_job.take() else {
            return Err(SpawnError::CgroupTaskTaken);
        };
        let joined = job.await.map_err(SpawnError::CgroupTask)??;
        let files = match joined {
            // cgroup v2: `cgroup.procs` takes the global lock either way, and kernels before
            // 5.16 check the writer's credentials rather than the opener's: we move the init
            // (its pid is final here, after any retry) instead of letting it move itself.
            Some((c, files)) if c.version == crate::cgroup::CgroupVersion::V2 => {
                let pid = first.to_string();
                for f in files {
                    use std::io::Write;
                    std::fs::File::from(f)
                        .write_all(pid.as_bytes())
                        .map_err(SpawnError::JoinCgroup)?;
                }
                cgroup = Some(c);
                Vec::new()
            }
            Some((c, files)) => {
                cgroup = Some(c);
                files
            }
            None => Vec::new(),
        };
        let fds: Vec<_> = files.iter().map(std::os::fd::AsFd::as_fd).collect();
        ctl.send(proto::MSG_CGROUPS, 0, &[], &fds)
            .await
            .map_err(SpawnError::Bootstrap)?;
        for (i, ((id, _), payload)) in queued.iter().zip(requests).enumerate() {
            let fds: Vec<_> = if i == 0 {
                lower_fd.iter().map(std::os::fd::AsFd::as_fd).collect()
            } else {
                Vec::new()
            };
            ctl.send(proto::MSG_SETUP, *id, payload, &fds)
                .await
                .map_err(SpawnError::SendSetup)?;
        }
        let init = rx.recv().await.ok_or(SpawnError::InitExited)?;
        if init.kind != proto::REP_INIT {
            return Err(describe_err(&init));
        }
        Ok(())
    }
    .await;
    ctl.unregister(0);
    match result {
        Ok(()) => Ok(Spawned {
            pid: first,
            ctl,
            queued,
            idmapped,
            cgroup,
            lo_up,
        }),
        Err(e) => {
            reap(first, true);
            // The job may not have been awaited yet (an early failure): its cgroups too.
            let pending = match cgroup_job {
                Some(job) => job
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .flatten()
                    .map(|(c, _)| c),
                None => None,
            };
            if let Some(c) = cgroup.or(pending) {
                c.remove(std::time::Duration::from_millis(500));
            }
            Err(e)
        }
    }
}

/// Waits for our child `pid` (killing it first if asked), retrying on EINTR.
pub(crate) fn reap(pid: libc::pid_t, kill: bool) {
    // SAFETY: kill/waitpid on our own child.
    unsafe {
        if kill {
            libc::kill(pid, libc::SIGKILL);
        }
        while libc::waitpid(pid, std::ptr::null_mut(), 0) < 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
        {}
    }
}

/// `struct mount_attr` of `mount_setattr(2)`.
#[repr(C)]
struct MountAttr {
    set: u64,
    clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `open_tree(AT_FDCWD, dir, OPEN_TREE_CLONE | O_CLOEXEC | extra)`: a detached clone of the
/// mount at `dir` (of the tree under it with `AT_RECURSIVE`), made in our current mount
/// namespace.
fn open_tree_clone(dir: &std::path::Path, extra: libc::c_uint) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: open_tree(AT_FDCWD, path, flags) with a NUL-terminated path.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c.as_ptr(),
            OPEN_TREE_CLONE | extra | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: we own the new fd.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A detached, recursive clone of the mount tree at `dir`, made in our own (current) mount
/// namespace: how a host-directory workspace reaches a template-mode init, whose namespace
/// descends from the zygote's copy (see [`fork_init`]).
pub(crate) fn detached_tree(dir: &std::path::Path) -> io::Result<OwnedFd> {
    const AT_RECURSIVE: libc::c_uint = 0x8000;
    open_tree_clone(dir, AT_RECURSIVE)
}

/// A detached, read-only clone of the mount at `dir` (not recursive: a rootfs directory's
/// submounts are not part of it), idmapped through the user namespace of `pid`: a file the
/// host sees as owned by uid N appears inside that namespace as owned by N (host root's
/// files belong to the sandbox's root), without changing anything on disk. Needs root (the
/// host filesystem belongs to the initial user namespace) and a filesystem that supports
/// idmapped mounts (ext4, xfs, btrfs, tmpfs, overlayfs...).
fn idmapped_tree(dir: &std::path::Path, pid: libc::pid_t) -> io::Result<OwnedFd> {
    let tree = open_tree_clone(dir, 0)?;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/user"))?;
    let attr = MountAttr {
        set: MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        clr: 0,
        propagation: 0,
        userns_fd: ns.as_raw_fd() as u64,
    };
    // SAFETY: mount_setattr(fd, "", AT_EMPTY_PATH, &attr, size) with a valid struct.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tree)
}

/// The init's `REP_ERR` (u32 op index, i32 errno or 0, message) as an error.
fn describe_err(r: &crate::ctl::Reply) -> SpawnError {
    let mut d = proto::Dec::new(&r.payload);
    let _ = d.u32();
    let errno = d.i32().ok().filter(|&e| e != 0);
    SpawnError::InitFailed {
        message: d.str().unwrap_or_default(),
        errno: errno.map(io::Error::from_raw_os_error),
    }
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn write_maps(pid: libc::pid_t, ids: &IdMap) -> io::Result<()> {
    if ids.rootless {
        std::fs::write(format!("/proc/{pid}/setgroups"), "deny")?;
    }
    std::fs::write(
        format!("/proc/{pid}/uid_map"),
        ids.map_text(ids.host_root, ids.user_override.map(|o| o.0)),
    )?;
    std::fs::write(
        format!("/proc/{pid}/gid_map"),
        ids.map_text(ids.host_root_gid, ids.user_override.map(|o| o.1)),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_with_and_without_an_owner_override() {
        let mut m = IdMap {
            host_root: 100_000,
            count: 65536,
            host_root_gid: 200_000,
            rootless: false,
            user_override: None,
        };
        assert_eq!(m.map_text(m.host_root, None), "0 100000 65536\n");
        assert_eq!(m.host_uid(SANDBOX_USER), 101_000);
        m.user_override = Some((4242, 4343));
        assert_eq!(
            m.map_text(m.host_root, Some(4242)),
            "0 100000 1000\n1000 4242 1\n1001 101001 64535\n"
        );
        assert_eq!(
            (m.host_uid(SANDBOX_USER), m.host_gid(SANDBOX_USER)),
            (4242, 4343)
        );
        assert_eq!(m.host_uid(0), 100_000);
    }
}
