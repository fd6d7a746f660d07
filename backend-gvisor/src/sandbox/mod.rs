//! One gVisor sandbox: its state directory, bundle, workspace and runsc container.
//!
//! This module holds the sandbox's state and its `Sandbox` calls; [`create`] makes and
//! restores sandboxes and starts their container, [`mounts`] makes their host mounts,
//! [`teardown`] tears them down, [`exec`] runs their commands and [`snapshot`] checkpoints
//! them.

mod create;
mod exec;
mod kept;
mod mounts;
mod ports;
mod process;
mod snapshot;
mod teardown;
mod usage;

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sandbox_core::{
    beneath, fsnap, pump_output, Command, DirEntry, EgressEnforcer, EgressPlan, Error, ExecEvent,
    ExecRequest, ExecResult, ExecStream, Language, Lifecycle, LimitKind, NetworkEvent,
    NetworkPolicy, Phase, Redactor, ResolvedSecrets, Result, Sandbox, SandboxSpec, SnapshotDraft,
    SnapshotError, SnapshotId, SnapshotKind, SnapshotStore, StreamKind, StreamSink, Tier, Timeline,
    TimelineRecorder, Transition, Workspace, WorkspacePath,
};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, RwLock};

use crate::bundle::{self, Identity};
use crate::runsc::{run_checked_async, run_detached, Runsc};
use crate::{reaper, stale};
use crate::{GvisorBackend, TIER};

/// A running gVisor sandbox.
pub struct GvisorSandbox {
    inner: Arc<Inner>,
    timeline: Timeline,
}

struct Inner {
    /// File watches (ended at teardown).
    watches: sandbox_core::watch::Watches,
    id: String,
    spec: SandboxSpec,
    runsc: Runsc,
    engine: String,
    dir: PathBuf,
    bundle: PathBuf,
    workspace: PathBuf,
    /// We mount a tmpfs on `workspace` (an `Empty` spec: `<dir>/workspace`).
    workspace_tmpfs: bool,
    /// The host tmpfs whose `tmp/` and `shm/` are the sandbox's `/tmp` and `/dev/shm`
    /// (see [`bundle::tmpfs_caps`]; `<dir>/scratch`); mounted by `start`, unmounted with the
    /// others by `cleanup` ([`stale::unmount_all`]).
    scratch: PathBuf,
    who: Identity,
    env: BTreeMap<String, String>,
    /// The working directory of commands that name none: the image's `WorkingDir`, else
    /// `/workspace`.
    cwd: String,
    /// The root's lower layers, lowest first: the spec's `rootfs` directory, or its image's
    /// layers. Empty: the host-tools root.
    lower: Vec<PathBuf>,
    /// The sandbox's image, if any (held: the cache keeps it while the sandbox lives).
    image: Option<sandbox_image::Image>,
    redactor: Redactor,
    /// runsc processes (sandbox, gofer) re-parented to us, to reap on delete.
    pids: Mutex<Vec<i32>>,
    /// The sandbox (`boot`) process among them, once found: while it lives, the sandbox does.
    boot: Mutex<Option<i32>>,
    /// The sandbox's cgroup paths (v1 memory and pids hierarchies), to read OOM kills and
    /// pids-limit hits from.
    cgroup: Mutex<(Option<String>, Option<String>)>,
    /// The sandbox process's cgroup paths in every hierarchy (`/proc/PID/cgroup`), read
    /// while it runs: its teardown removes those named after the sandbox itself.
    cgroup_paths: Mutex<Vec<String>>,
    /// Where the sandbox process's CPU time and memory are counted (its cgroup), for
    /// [`Sandbox::usage`]: read once its container runs.
    usage_cgroup: Mutex<Option<usage::UsageCgroup>>,
    /// Live, paused, gone with the reason (destroyed, lifetime, killed by a limit...),
    /// releasing or released: a sandbox can be gone (it died on its own) before its teardown
    /// (container deleted, state removed) begins. Pause, resume, destroy and a snapshot's
    /// background resume hold its transition lock.
    life: Lifecycle,
    born: Instant,
    seq: AtomicU64,
    /// Execs hold it shared; a snapshot holds it exclusively until the sandbox is resumed.
    lifecycle: Arc<RwLock<()>>,
    /// The egress enforcer and this sandbox's plan (policies other than deny-all).
    egress: Option<(Arc<dyn EgressEnforcer>, EgressPlan)>,
    /// With proxy-held secrets: the certificates the sandbox trusts
    /// ([`SecretPlan::ca_bundle`](sandbox_core::SecretPlan::ca_bundle)), put at
    /// `/etc/agent-sandbox-ca.crt` and over the root's system bundle by `start`.
    ca_bundle: Option<String>,
    /// Whether commands start through the sandbox's control socket ([`crate::urpc`]);
    /// cleared for good the first time that is not possible (then `runsc exec`).
    direct: AtomicBool,
    /// Our lock on the sandbox directory (see [`stale`]).
    _owner: stale::Owner,
    /// Background processes.
    procs: sandbox_core::ProcessTable,
    /// The background processes under a keeper, which snapshots keep ([`kept`]).
    kept: kept::KeptTable,
    /// Published ports (closed on destroy).
    ports: sandbox_core::Ports,
    /// Whether the root has the published-port relay ([`bundle::RELAY_PATH`]).
    relay: AtomicBool,
    /// Relays running for open connections to published ports.
    relays: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for GvisorSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GvisorSandbox")
            .field("id", &self.inner.id)
            .finish()
    }
}

fn io(op: &str, p: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let what = format!("{op} {}", p.display());
    move |e| {
        if e.raw_os_error() == Some(libc::ENOSPC) {
            Error::ResourceExhausted {
                what: format!("disk space ({what})"),
            }
        } else {
            Error::io(what, e)
        }
    }
}

/// The snapshot artifact holding `/tmp` and `/dev/shm` (the scratch tmpfs).
const SCRATCH_TAR: &str = "scratch.tar";

impl Inner {
    fn read_only(&self) -> bool {
        matches!(
            self.spec.workspace,
            Workspace::HostDir {
                read_only: true,
                ..
            }
        )
    }

    /// Whether our tmpfs workspace, or the scratch tmpfs behind `/tmp` and `/dev/shm`, is out
    /// of space or inodes.
    fn disk_full(&self) -> bool {
        let full = |p: &Path| {
            nix::sys::statvfs::statvfs(p)
                .is_ok_and(|s| s.blocks_available() == 0 || s.files_available() == 0)
        };
        (self.workspace_tmpfs && full(&self.workspace)) || full(&self.scratch)
    }

    fn alive(&self) -> Result<()> {
        if self.life.lapse(self.born, self.spec.limits.lifetime()) {
            self.teardown(sandbox_core::LIFETIME_REACHED);
        }
        self.life.check_not_gone()
    }

    /// Who the file API's new files belong to: the workload's user.
    fn owner(&self) -> beneath::Owner {
        beneath::Owner {
            uid: self.who.uid,
            gid: self.who.gid,
        }
    }
}

/// A mutex's guard, also after a panic elsewhere (every write here is one assignment): the
/// teardown never skips what they record.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io("create", path))?;
    f.write_all(data).map_err(io("write", path))
}

#[async_trait]
impl Sandbox for GvisorSandbox {
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

    async fn spawn(&self, req: ExecRequest) -> Result<sandbox_core::Process> {
        // Under a keeper inside (snapshots keep it), where the root has the relay that is
        // the keeper.
        if self.inner.relay.load(Ordering::SeqCst) {
            self.inner.spawn_kept(req).await
        } else {
            self.inner.spawn(req).await
        }
    }

    async fn processes(&self) -> Result<Vec<sandbox_core::ProcessInfo>> {
        self.inner.alive()?;
        Ok(self.inner.procs.list())
    }

    async fn signal(
        &self,
        id: sandbox_core::ProcessId,
        signal: sandbox_core::Signal,
    ) -> Result<()> {
        self.inner.alive()?;
        self.inner.procs.signal(id, signal).await
    }

    async fn publish(
        &self,
        sandbox_port: u16,
        host: std::net::SocketAddr,
    ) -> Result<std::net::SocketAddr> {
        self.inner.publish(sandbox_port, host).await
    }

    async fn unpublish(&self, host: std::net::SocketAddr) -> Result<()> {
        self.inner.alive()?;
        self.inner.ports.unpublish(host)
    }

    async fn published(&self) -> Result<Vec<sandbox_core::PublishedPort>> {
        self.inner.alive()?;
        Ok(self.inner.ports.list())
    }

    async fn exec_stream(&self, req: ExecRequest) -> Result<ExecStream> {
        self.inner.alive()?;
        let inner = Arc::clone(&self.inner);
        Ok(ExecStream::spawn(move |tx| async move {
            inner.run(req, Some(tx)).await
        }))
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        let s = &self.inner;
        s.alive()?;
        if s.read_only() {
            return Err(Error::invalid(
                "path",
                "the workspace is read-only in this sandbox's spec",
            ));
        }
        // Everything beneath a handle on the workspace (see `sandbox_core::beneath`): code
        // inside can swap any name for a symlink to the host at any moment, and this runs
        // as root. New parents and the file belong to the workload's user.
        let ws = beneath::open_dir(&s.workspace)?;
        beneath::write_file(ws.as_fd(), path, data, Some(s.owner()))
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.inner.alive()?;
        let ws = beneath::open_dir(&self.inner.workspace)?;
        // One read returns at most what the sandbox's disk holds (`limits.disk_bytes`).
        beneath::read_file(ws.as_fd(), path, self.inner.spec.limits.disk_bytes)
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.inner.alive()?;
        let ws = beneath::open_dir(&self.inner.workspace)?;
        beneath::list(ws.as_fd(), path)
    }

    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.inner.snapshot(store).await
    }

    async fn watch(&self, path: &str, recursive: bool) -> Result<sandbox_core::Watch> {
        self.inner.alive()?;
        // The workspace is a host folder the Gofer writes through: watched from the host,
        // beneath its handle (see `sandbox_core::watch`).
        let ws = beneath::open_dir(&self.inner.workspace)?;
        self.inner.watches.watch_blocking(ws, path, recursive).await
    }

    async fn usage(&self) -> Result<sandbox_core::Usage> {
        self.inner.alive()?;
        let cg = lock(&self.inner.usage_cgroup).clone().ok_or_else(|| {
            Error::unsupported(
                TIER,
                "resource usage (the sandbox's cgroup was not found on this host)",
            )
        })?;
        match cg.read() {
            Some(u) => Ok(u),
            None => {
                // Its cgroup went with it (ended meanwhile), or never counted.
                self.inner.alive()?;
                Err(Error::unsupported(
                    TIER,
                    "resource usage (its cgroup has no CPU or memory accounting here)",
                ))
            }
        }
    }

    async fn pause(&self) -> Result<()> {
        self.inner.alive()?;
        // Held across `runsc pause`: a concurrent resume waits for it, then resumes.
        let Some(step) = self.inner.life.begin(Transition::Pause).await? else {
            return Ok(());
        };
        self.inner.runsc_call(&["pause"]).await?;
        step.complete();
        Ok(())
    }

    async fn resume(&self) -> Result<()> {
        self.inner.alive()?;
        let Some(step) = self.inner.life.begin(Transition::Resume).await? else {
            return Ok(());
        };
        self.inner.runsc_call(&["resume"]).await?;
        step.complete();
        Ok(())
    }

    fn redactor(&self) -> sandbox_core::secrets::Redactor {
        self.inner.redactor.clone()
    }

    async fn health_check(&self) -> Result<()> {
        self.inner.alive()?;
        if self.inner.container_running().await {
            Ok(())
        } else {
            Err(Error::SandboxGone {
                id: self.inner.id.clone(),
                reason: "runsc reports the sandbox is not running".into(),
            })
        }
    }

    async fn destroy(&self) -> Result<()> {
        // Not waiting for execs: a running one is killed with the container. A pause, a
        // resume, or the resume in progress after a snapshot (~0.2 s) is waited for, so that
        // nothing it makes comes after the teardown (if it outlasts the wait, it sees the
        // release begun when it finishes and cleans up after itself).
        let inner = Arc::clone(&self.inner);
        let _held = tokio::time::timeout(Duration::from_secs(30), inner.life.hold())
            .await
            .ok();
        // Detach first and wait, so nothing of the link is left when this returns.
        if let Some((e, _)) = &inner.egress {
            if !inner.life.release_begun() {
                e.detach(&inner.id).await;
            }
        }
        tokio::task::spawn_blocking(move || inner.teardown("destroyed"))
            .await
            .map_err(|e| Error::backend_caused(TIER, "the teardown task", e))
    }

    async fn set_network_policy(&self, policy: NetworkPolicy) -> Result<()> {
        self.inner.alive()?;
        sandbox_core::egress::update_policy(
            TIER,
            self.inner.egress.as_ref().map(|(e, _)| e.as_ref()),
            &self.inner.id,
            &policy,
        )
    }

    async fn network_events(&self) -> Result<Vec<NetworkEvent>> {
        self.inner.life.check_not_gone()?;
        match &self.inner.egress {
            Some((e, _)) => e.events(&self.inner.id),
            None => Ok(Vec::new()),
        }
    }
}

impl Drop for GvisorSandbox {
    fn drop(&mut self) {
        self.inner.teardown("dropped");
    }
}
