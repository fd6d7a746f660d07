//! A live container sandbox: its init, cgroups, control channel, exec and file API.
//!
//! This file has the sandbox's state, its lifecycle and the [`Sandbox`] API; `exec` runs a
//! command, `pump` reads its output.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sandbox_core::{
    DirEntry, EgressEnforcer, Error, ExecRequest, ExecResult, ExecStream, Lifecycle, NetworkEvent,
    NetworkPolicy, Ports, Process, ProcessId, ProcessInfo, PublishedPort, Redactor, Result,
    Sandbox, SandboxSpec, Signal, SnapshotDraft, SnapshotId, SnapshotKind, SnapshotStore, Tier,
    Timeline, Transition,
};

use crate::cgroup::SandboxCgroup;
use crate::ctl::{Ctl, Reply};
use crate::files::{self, Owner};
use crate::proto;
use crate::spawn::IdMap;

mod exec;
mod pump;

pub(crate) use exec::wait_status_code;
pub(crate) use pump::{pipe, pump, set_nonblocking, PumpSink};

pub(crate) const ENGINE: &str = "agent-sandbox-container 1";
pub(crate) const TIER: Tier = Tier::Container;

/// Everything a sandbox owns, shared with its streaming and timer tasks.
pub(crate) struct Inner {
    pub id: String,
    pub spec: SandboxSpec,
    pub env: BTreeMap<String, String>,
    pub redactor: Redactor,
    pub born: Instant,
    /// Live, paused, gone with the reason, releasing or released (`terminate` runs the
    /// teardown once through it; later calls wait for it).
    pub life: Lifecycle,
    /// Host pid of the init (our child until reaped in `terminate`).
    pub pid: libc::pid_t,
    pub ctl: Arc<Ctl>,
    pub cgroup: Option<SandboxCgroup>,
    pub ids: IdMap,
    /// The lease on `ids`' host uid range (as root): released with this state.
    pub _lease: Option<crate::slots::SlotLease>,
    /// uid inside that runs commands.
    pub user: u32,
    /// gid inside that runs commands.
    pub group: u32,
    /// The working directory of commands that name none: the image's `WorkingDir`, else
    /// `/workspace`.
    pub cwd: String,
    /// The sandbox's image, if any (held: the cache keeps it while the sandbox lives).
    pub image: Option<sandbox_image::Image>,
    /// Commands keep uid 0 inside (with no capabilities): rootless, or a rootfs directory.
    pub stay_root: bool,
    /// The egress enforcer this sandbox is attached to (policies other than deny-all).
    pub egress: Option<Arc<dyn EgressEnforcer>>,
    pub state_file: Option<PathBuf>,
    /// The lifetime timer, aborted on terminate.
    pub timer: Mutex<Option<tokio::task::AbortHandle>>,
    /// Background processes.
    pub procs: sandbox_core::ProcessTable,
    /// Published ports (closed on terminate).
    pub ports: Ports,
    /// File watches (ended on terminate).
    pub watches: sandbox_core::watch::Watches,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContainerSandbox")
            .field("id", &self.id)
            .field("init_pid", &self.pid)
            .finish()
    }
}

/// A sandbox of [`ContainerBackend`](crate::ContainerBackend).
#[derive(Debug)]
pub struct ContainerSandbox {
    pub(crate) inner: Arc<Inner>,
    pub(crate) timeline: Timeline,
}

impl ContainerSandbox {
    /// Host pid of the sandbox's init (pid 1 inside). For diagnostics and tests.
    pub fn init_pid(&self) -> i32 {
        self.inner.pid
    }
}

impl Inner {
    pub(crate) fn gone_err(&self) -> Error {
        self.life.gone_error()
    }

    pub(crate) fn alive(&self) -> Result<()> {
        self.life.check_not_gone()?;
        if self.life.lapse(self.born, self.spec.limits.lifetime()) {
            self.terminate(sandbox_core::LIFETIME_REACHED);
            return Err(self.gone_err());
        }
        if self.ctl.is_closed() {
            self.terminate("its init exited");
            return Err(self.gone_err());
        }
        Ok(())
    }

    /// Ends the sandbox for `reason` (unless it ended already), kills everything and removes
    /// every host-side trace. Idempotent, synchronous: the first call tears down, one made
    /// meanwhile waits for it (see [`Lifecycle::release`]).
    pub(crate) fn terminate(&self, reason: &str) {
        self.life.release(reason, || self.teardown());
    }

    fn teardown(&self) {
        self.ports.clear();
        self.watches.close_all();
        // A frozen sandbox must be thawed or its processes cannot die.
        if let Some(c) = &self.cgroup {
            if c.can_freeze() {
                let _ = c.freeze(false);
            }
        }
        // The next create's init is cloned meanwhile (see `spawn::prefork`).
        crate::spawn::prefork();
        if !self.hand_off_teardown() {
            // The kernel then kills the whole pid namespace.
            crate::spawn::reap(self.pid, true);
            if let Some(cg) = &self.cgroup {
                let left = cg.release(Duration::from_secs(2));
                if !left.is_empty() {
                    tracing::warn!(sandbox = %self.id, ?left, "cgroup directories could not be removed");
                }
            }
            if let Some(f) = &self.state_file {
                let _ = std::fs::remove_file(f);
            }
        }
        if let Some(e) = &self.egress {
            e.detach_in_background(&self.id);
        }
        let timer = self
            .timer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = timer {
            t.abort();
        }
    }

    /// In a one-shot process (see [`crate::one_shot_process`]), kills the init and hands
    /// the rest of the teardown to the zygote, which waits for the sandbox's end, removes its
    /// cgroups and state record and releases its uid range while this process exits (that
    /// wait and removal were ~3 ms of a one-shot `run`'s path). Not for a sandbox with an
    /// egress link (its detach is this process's). Returns `false` when nothing was handed
    /// over.
    fn hand_off_teardown(&self) -> bool {
        if !crate::spawn::one_shot() || self.egress.is_some() {
            return false;
        }
        // The zygote takes paths as UTF-8 (ours are; any other stays with us).
        let Some(dirs) = self
            .cgroup
            .iter()
            .flat_map(SandboxCgroup::dirs)
            .map(|d| d.to_str().map(str::to_owned))
            .collect::<Option<Vec<String>>>()
        else {
            return false;
        };
        let Some(files) = self
            .state_file
            .iter()
            .map(|f| f.to_str().map(str::to_owned))
            .collect::<Option<Vec<String>>>()
        else {
            return false;
        };
        let keep: Vec<_> = self
            ._lease
            .as_ref()
            .and_then(crate::slots::SlotLease::lock_fd)
            .into_iter()
            .collect();
        if !crate::spawn::hand_off_teardown(self.pid, &dirs, &files, &keep) {
            return false;
        }
        if let Some(l) = &self._lease {
            l.handed_off();
        }
        true
    }

    /// The workspace as seen by the init, as a directory fd.
    pub(crate) fn workspace_fd(&self) -> Result<OwnedFd> {
        let p = format!("/proc/{}/root/workspace", self.pid);
        let c = std::ffi::CString::new(p.clone())
            .map_err(|e| Error::backend_caused(TIER, "the workspace's /proc path", e))?;

        // SAFETY: open(2) with a NUL-terminated path.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            if self.ctl.is_closed() {
                self.terminate("its init exited");
                return Err(self.gone_err());
            }
            return Err(Error::io(format!("open {p}"), e));
        }
        // SAFETY: we own the new fd.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Whose ids the file API creates files with: the command user's, as commands do (on a
    /// host-directory workspace its idmapped mount stores them as the directory's owner),
    /// except rootless (we are that user already).
    pub(crate) fn owner(&self) -> Option<Owner> {
        if self.ids.rootless {
            None
        } else {
            Some(Owner {
                uid: self.ids.host_uid(self.user),
                gid: self.ids.host_gid(self.group),
            })
        }
    }

    /// The overlay's upper layer (rootfs-directory mode), as a directory fd.
    pub(crate) fn upper_fd(&self) -> Result<OwnedFd> {
        let p = format!("/proc/{}/fd/{}", self.pid, proto::UPPER_FD);
        std::fs::File::open(&p)
            .map(OwnedFd::from)
            .map_err(|e| Error::io(format!("open {p}"), e))
    }

    pub(crate) async fn ping(&self) -> Result<()> {
        let r = tokio::time::timeout(
            Duration::from_secs(5),
            self.ctl.call(proto::MSG_PING, &[], &[]),
        )
        .await;
        match r {
            Ok(Ok(Reply {
                kind: proto::REP_OK,
                ..
            })) => Ok(()),
            _ => {
                self.terminate("its init stopped answering");
                Err(self.gone_err())
            }
        }
    }
}

#[async_trait]
impl Sandbox for ContainerSandbox {
    fn id(&self) -> &str {
        &self.inner.id
    }

    fn tier(&self) -> Tier {
        TIER
    }

    fn spec(&self) -> &SandboxSpec {
        &self.inner.spec
    }

    fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecResult> {
        self.inner.run(req, None).await
    }

    async fn exec_stream(&self, req: ExecRequest) -> Result<ExecStream> {
        self.inner.alive()?;
        req.validate()?;
        req.refuse_tty(TIER)?;
        let inner = Arc::clone(&self.inner);
        Ok(ExecStream::spawn(move |tx| async move {
            inner.run(req, Some(tx)).await
        }))
    }

    async fn spawn(&self, req: ExecRequest) -> Result<Process> {
        self.inner.spawn(req).await
    }

    async fn processes(&self) -> Result<Vec<ProcessInfo>> {
        self.inner.alive()?;
        Ok(self.inner.procs.list())
    }

    async fn signal(&self, id: ProcessId, signal: Signal) -> Result<()> {
        self.inner.alive()?;
        self.inner.procs.signal(id, signal).await
    }

    async fn publish(
        &self,
        sandbox_port: u16,
        host: std::net::SocketAddr,
    ) -> Result<std::net::SocketAddr> {
        self.inner.alive()?;
        let dialer = Arc::new(crate::process::InitDialer(Arc::clone(&self.inner.ctl)));
        self.inner.ports.publish(sandbox_port, host, dialer).await
    }

    async fn unpublish(&self, host: std::net::SocketAddr) -> Result<()> {
        self.inner.alive()?;
        self.inner.ports.unpublish(host)
    }

    async fn published(&self) -> Result<Vec<PublishedPort>> {
        self.inner.alive()?;
        Ok(self.inner.ports.list())
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        self.inner.alive()?;
        let ws = self.inner.workspace_fd()?;
        let _ids = files::FsIds::switch(self.inner.owner());
        files::write_file(ws.as_fd(), path, data, self.inner.owner())
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.inner.alive()?;
        let ws = self.inner.workspace_fd()?;
        // One read returns at most what the sandbox's disk holds (`limits.disk_bytes`).
        files::read_file(ws.as_fd(), path, self.inner.spec.limits.disk_bytes)
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.inner.alive()?;
        let ws = self.inner.workspace_fd()?;
        files::list(ws.as_fd(), path)
    }

    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.inner.alive()?;
        let ws = self.inner.workspace_fd()?;
        // Freeze the sandbox while packing when we can, for a consistent copy.
        let frozen = self
            .inner
            .cgroup
            .as_ref()
            .is_some_and(|c| c.can_freeze() && c.freeze(true).is_ok());
        // The snapshot holds at most the sandbox's disk: its own workspace and upper layer
        // are tmpfs mounts capped by `limits.disk_bytes`; a host-directory workspace is the
        // caller's, not capped (sparse files count their data only, either way).
        let cap = self.inner.spec.limits.disk_bytes;
        let ws_cap = match self.inner.spec.workspace {
            sandbox_core::Workspace::Empty => cap,
            _ => u64::MAX,
        };
        let tar = files::pack(ws.as_fd(), ws_cap);
        // Rootfs-directory mode: the changes made to the root too (the overlay's upper layer).
        let upper = if crate::own_root(&self.inner.spec) {
            Some(
                self.inner
                    .upper_fd()
                    .and_then(|u| files::pack_upper(u.as_fd(), cap)),
            )
        } else {
            None
        };
        if frozen {
            if let Some(c) = &self.inner.cgroup {
                let _ = c.freeze(false);
            }
        }
        let tar = tar?;
        let mut draft = SnapshotDraft::new(TIER, ENGINE, vec![SnapshotKind::Filesystem], {
            // Pinned to the image's digest: the restore gets this very image, pulled
            // again if it left the cache.
            let mut spec = self.inner.spec.clone();
            if let (Some(r), Some(img)) = (&spec.image, &self.inner.image) {
                spec.image = Some(r.pinned(img.digest()));
            }
            spec
        })
        .artifact("workspace.tar", tar)
        .meta("sandbox_id", self.inner.id.clone());
        if let Some(u) = upper {
            draft = draft.artifact("upper.tar", u?);
        }
        Ok(store.put(draft).await?)
    }

    async fn pause(&self) -> Result<()> {
        self.inner.alive()?;
        match &self.inner.cgroup {
            Some(c) if c.can_freeze() => {
                // Held across the freeze: a concurrent resume waits for it, then thaws.
                if let Some(step) = self.inner.life.begin(Transition::Pause).await? {
                    c.freeze(true)
                        .map_err(|e| Error::io("freeze the sandbox", e))?;
                    step.complete();
                }
                Ok(())
            }
            _ => Err(Error::unsupported(
                TIER,
                "pause/resume (no freezer cgroup on this host)",
            )),
        }
    }

    async fn resume(&self) -> Result<()> {
        self.inner.alive()?;
        match &self.inner.cgroup {
            Some(c) if c.can_freeze() => {
                if let Some(step) = self.inner.life.begin(Transition::Resume).await? {
                    c.freeze(false)
                        .map_err(|e| Error::io("thaw the sandbox", e))?;
                    step.complete();
                }
                Ok(())
            }
            _ => Err(Error::unsupported(
                TIER,
                "pause/resume (no freezer cgroup on this host)",
            )),
        }
    }

    async fn usage(&self) -> Result<sandbox_core::Usage> {
        self.inner.alive()?;
        let cg = self.inner.cgroup.as_ref().ok_or_else(|| {
            Error::unsupported(
                TIER,
                "resource usage (no cgroup for this sandbox on this host)",
            )
        })?;
        let (cpu, mem) = (cg.cpu_time_us(), cg.memory_bytes());
        match (cpu, mem) {
            (Some(cpu), Some(mem)) => Ok(sandbox_core::Usage::new(
                std::time::Duration::from_micros(cpu),
                mem,
            )),
            _ => Err(Error::unsupported(
                TIER,
                "resource usage (its cgroup has no CPU or memory accounting here)",
            )),
        }
    }

    async fn watch(&self, path: &str, recursive: bool) -> Result<sandbox_core::Watch> {
        self.inner.alive()?;
        // From the host, beneath the workspace's handle (see `sandbox_core::watch`).
        let ws = self.inner.workspace_fd()?;
        self.inner.watches.watch_blocking(ws, path, recursive).await
    }

    async fn set_network_policy(&self, policy: NetworkPolicy) -> Result<()> {
        self.inner.alive()?;
        sandbox_core::egress::update_policy(
            TIER,
            self.inner.egress.as_deref(),
            &self.inner.id,
            &policy,
        )
    }

    async fn network_events(&self) -> Result<Vec<NetworkEvent>> {
        self.inner.life.check_not_gone()?;
        match &self.inner.egress {
            Some(e) => e.events(&self.inner.id),
            None => Ok(Vec::new()),
        }
    }

    fn redactor(&self) -> sandbox_core::secrets::Redactor {
        self.inner.redactor.clone()
    }

    async fn health_check(&self) -> Result<()> {
        self.inner.alive()?;
        self.inner.ping().await
    }

    async fn destroy(&self) -> Result<()> {
        let inner = Arc::clone(&self.inner);
        // No pause or resume overlaps it: one under way finishes first, none starts after.
        let _held = inner.life.hold().await;
        // Detach first and wait for it, so nothing of the link is left when this returns.
        if let Some(e) = &inner.egress {
            e.detach(&inner.id).await;
        }
        // A one-shot process has nothing else to run meanwhile: it tears down right here
        // rather than handing the work to a blocking-pool thread and waiting to be woken.
        if crate::spawn::one_shot() {
            inner.terminate("destroyed");
            return Ok(());
        }
        tokio::task::spawn_blocking(move || inner.terminate("destroyed"))
            .await
            .map_err(|e| Error::backend_caused(TIER, "the destroy task", e))?;

        Ok(())
    }
}

impl Drop for ContainerSandbox {
    fn drop(&mut self) {
        self.inner.terminate("dropped");
    }
}
