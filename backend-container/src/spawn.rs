//! Starting a sandbox's init: the embedded init binary in a sealed memfd, forked by the
//! process's zygote (itself started once with `posix_spawn`), and brought into its
//! namespaces by a short bootstrap over its socket.
//!
//! This file has the bootstrap (`start_init`, `spawn_init`) and the uid/gid maps; `zygote`
//! the fork server, its spares and templates; `idmap` the detached and idmapped mounts.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use crate::ctl::Ctl;
use crate::proto;
use std::sync::OnceLock;

pub(crate) use crate::init_image::InitImage;

mod idmap;
#[cfg(test)]
mod tests;
mod zygote;

use idmap::idmapped_tree;
pub(crate) use idmap::{detached_tree, workspace_tree, WorkspaceIds};
use zygote::fork_init;
pub(crate) use zygote::{
    hand_off_teardown, one_shot, prefork, set_one_shot, set_spares, template_root,
};

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
/// The library never forks itself: the process's zygote (see [`zygote`](mod@zygote)) clones the
/// init with new user and pid namespaces and `CLONE_PARENT`, so it is our child, with the control
/// socket as its stdin. [`start_init`] wrote its id maps and sent `START` and `MAPS`; it says
/// `REP_BOOT`, makes the other namespaces and becomes root inside while the cgroup job makes the
/// cgroups; it joins those itself (writing `0` to the files the job opened) before it starts
/// anything, so all it starts inherits them.
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
