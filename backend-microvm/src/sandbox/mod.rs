//! One microVM sandbox: a KVM VM running the Linux guest, and the connection to its agent.
//!
//! Every agent call is blocking ([`AgentClient`]) and runs on tokio's blocking pool. Execs and
//! file calls hold the sandbox's lifecycle lock shared; a snapshot holds it exclusively, so no
//! request is in flight on the console channel when the VM is saved.
//!
//! This module holds the sandbox's state, its lifecycle and the [`Sandbox`] impl; [`create`]
//! boots sandboxes, [`exec`] runs their commands, [`snapshot`] snapshots and restores them
//! ([`memfile`] packs their memory).

mod create;
mod exec;
mod image;
pub(crate) mod memfile;
mod ports;
mod process;
mod snapshot;
pub(crate) mod warm;
mod watch;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sandbox_core::{
    Command, DirEntry, EntryKind, Error, ExecEvent, ExecRequest, ExecResult, ExecStream, Language,
    Lifecycle, LimitKind, NetworkPolicy, OutputBuffer, Phase, Redactor, ResolvedSecrets, Result,
    Sandbox, SandboxSpec, SnapshotDraft, SnapshotError, SnapshotId, SnapshotKind, SnapshotStore,
    StreamRedactor, Tier, Timeline, TimelineRecorder, Transition, Workspace, WorkspacePath,
};
use tokio::sync::{mpsc, RwLock};

use crate::acpi::VirtioMmioDesc;
use crate::agent_client::{self, AgentClient, AgentError, ErrorKind, ExitInfo, SOURCE_HASH};
use crate::boot::{self, BootConfig};
use crate::network::GuestNetwork;
use crate::vmm::{BlockConfig, Entry, Vm, VmConfig, VmExit, VmmError};
use crate::{GuestFiles, MicrovmBackend, MIN_GUEST_MEMORY, TIER};
use image::{Boot, ImageRoot};

/// How long one file call (or one chunk of it) may take.
const FILE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a ping may take (health checks, restore).
const PING_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `destroy` waits for the guest to power off before killing the VM.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(2);

/// What runs the guest: a VM, or (unit tests only) the agent as a host process.
#[derive(Clone)]
enum Machine {
    Vm(Arc<Vm>),
    #[cfg(test)]
    Process(Arc<Mutex<std::process::Child>>),
}

impl Machine {
    /// Why the machine ended, if it has.
    fn ended(&self) -> Option<String> {
        match self {
            Machine::Vm(vm) => vm.exit().map(|e| match e {
                VmExit::DeadlineExceeded => "lifetime limit reached (the VM was stopped)".into(),
                other => format!("the VM ended: {other}"),
            }),
            #[cfg(test)]
            Machine::Process(c) => match lock(c).try_wait() {
                Ok(Some(s)) => Some(format!("the agent process ended: {s}")),
                _ => None,
            },
        }
    }

    fn kill(&self) {
        match self {
            Machine::Vm(vm) => vm.kill(),
            #[cfg(test)]
            Machine::Process(c) => {
                let mut c = lock(c);
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Waits up to `d` for the machine to end on its own.
    fn wait_end(&self, d: Duration) {
        match self {
            Machine::Vm(vm) => {
                let _ = vm.wait_timeout(d);
            }
            #[cfg(test)]
            Machine::Process(_) => {
                let end = Instant::now() + d;
                while self.ended().is_none() && Instant::now() < end {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    #[cfg_attr(not(test), allow(unused_variables))]
    fn vm(&self, what: &str) -> Result<&Arc<Vm>> {
        match self {
            Machine::Vm(vm) => Ok(vm),
            #[cfg(test)]
            Machine::Process(_) => Err(Error::unsupported(
                TIER,
                format!("{what} of a host-process test agent"),
            )),
        }
    }
}

/// The live parts; taken out (and dropped: VM threads joined) by destroy.
struct Live {
    // The agent first: dropping it closes our end of the channel and joins its reader.
    agent: AgentClient,
    machine: Machine,
}

/// A running microVM sandbox.
pub struct MicrovmSandbox {
    inner: Arc<Inner>,
    timeline: Timeline,
}

struct Inner {
    id: String,
    spec: SandboxSpec,
    env: BTreeMap<String, String>,
    redactor: Redactor,
    mem_size: u64,
    vcpus: u8,
    kernel_version: Option<String>,
    /// The image the guest's root comes from, if any.
    image: Option<ImageRoot>,
    live: Mutex<Option<Live>>,
    /// Live, paused, or gone with the reason (destroyed, lifetime, the VM died).
    life: Lifecycle,
    born: Instant,
    /// Agent calls hold it shared; a snapshot holds it exclusively.
    lifecycle: Arc<RwLock<()>>,
    /// Background processes.
    procs: sandbox_core::ProcessTable,
    /// The enforcer this sandbox is attached to (policies other than deny-all).
    egress: Option<Arc<dyn sandbox_core::egress::EgressEnforcer>>,
    /// The guest's network, detached from the enforcer by destroy (or when dropped).
    net: Mutex<Option<GuestNetwork>>,
    /// Published ports (through the agent), closed when the sandbox ends.
    ports: sandbox_core::Ports,
    /// The request ids of their open connections.
    connections: Arc<Mutex<std::collections::BTreeSet<u32>>>,
    /// Running background processes by spawn request id: command line, terminal (what a
    /// snapshot records, for the restored copy to adopt them).
    background: Mutex<BTreeMap<u32, (String, bool)>>,
    /// File watches (relayed from the guest), counted and ended with the sandbox.
    watches: sandbox_core::watch::Watches,
}

impl std::fmt::Debug for MicrovmSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MicrovmSandbox")
            .field("id", &self.inner.id)
            .field("mem_size", &self.inner.mem_size)
            .field("vcpus", &self.inner.vcpus)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn join_err(e: tokio::task::JoinError) -> Error {
    Error::backend_caused(TIER, "a blocking task", e)
}

/// How an agent error reads for the caller, for an operation on `path` (if any).
fn map_agent_error(e: AgentError, path: Option<&str>) -> Error {
    let p = || path.unwrap_or_default().to_string();
    match e {
        AgentError::Remote { kind, message } => match kind {
            ErrorKind::NotFound if path.is_some() => Error::NotFound { path: p() },
            ErrorKind::PathEscape => Error::PathEscape { path: p() },
            ErrorKind::TooLarge => {
                Error::invalid(if path.is_some() { "path" } else { "request" }, message)
            }
            ErrorKind::Invalid | ErrorKind::NotFound => {
                Error::invalid(if path.is_some() { "path" } else { "command" }, message)
            }
            ErrorKind::Io => Error::io(
                format!(
                    "in the guest{}",
                    path.map(|p| format!(" ({p})")).unwrap_or_default()
                ),
                std::io::Error::other(message),
            ),
            ErrorKind::Protocol => Error::backend(TIER, format!("guest agent: {message}")),
        },
        AgentError::TooLarge(m) => Error::invalid("request", m),
        AgentError::VersionMismatch { .. } => Error::Unavailable {
            tier: TIER,
            reason: e.to_string(),
            fix: format!("{} (rebuilds the initramfs)", crate::INSTALL_FIX),
        },
        other => Error::backend_caused(TIER, "talking to the guest agent", other),
    }
}

impl Inner {
    fn gone_error(&self, reason: String) -> Error {
        Error::SandboxGone {
            id: self.id.clone(),
            reason,
        }
    }

    /// Ends the sandbox for `reason` (the first reason sticks), kills the VM and drops its
    /// live parts (which joins the VM's threads and the agent client's reader). Once: a call
    /// made meanwhile waits for it (see [`Lifecycle::release`]).
    fn teardown(&self, reason: &str) {
        self.life.release(reason, || {
            self.ports.clear();
            self.watches.close_all();
            let live = lock(&self.live).take();
            if let Some(l) = &live {
                l.machine.kill();
            }
            drop(live);
        });
    }

    /// The agent and machine of a running sandbox (the agent cannot answer while the VM is
    /// paused), or why there are none.
    fn handles(&self) -> Result<(AgentClient, Machine)> {
        self.life.check_running()?;
        self.machine_handles()
    }

    /// The agent and machine of a sandbox that exists, paused or not.
    fn machine_handles(&self) -> Result<(AgentClient, Machine)> {
        self.life.check_not_gone()?;
        let (agent, machine) = match lock(&self.live).as_ref() {
            Some(l) => (l.agent.clone(), l.machine.clone()),
            None => return Err(self.gone_error("destroyed".into())),
        };
        if let Some(why) = machine.ended() {
            self.teardown(&why);
            return Err(self.gone_error(why));
        }
        if self.life.lapse(self.born, self.spec.limits.lifetime()) {
            self.teardown(sandbox_core::LIFETIME_REACHED);
            return Err(self.life.gone_error());
        }
        Ok((agent, machine))
    }

    /// An agent failure: typed for the caller; a dead guest makes the sandbox gone, a broken
    /// channel ends it.
    fn fail(&self, e: AgentError, path: Option<&str>) -> Error {
        if let Some(r) = self.life.gone_reason() {
            return self.gone_error(r);
        }
        let ended = lock(&self.live).as_ref().and_then(|l| l.machine.ended());
        if let Some(why) = ended {
            self.teardown(&why);
            return self.gone_error(why);
        }
        if let AgentError::Protocol(m) = &e {
            let why = format!("the guest agent broke the protocol ({m})");
            self.teardown(&why);
            return self.gone_error(why);
        }
        map_agent_error(e, path)
    }

    /// Runs a blocking agent call under the shared lifecycle lock.
    async fn call<T, F>(self: &Arc<Self>, path: Option<&str>, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&AgentClient) -> std::result::Result<T, AgentError> + Send + 'static,
    {
        let shared = Arc::clone(&self.lifecycle).read_owned().await;
        let (agent, _) = self.handles()?;
        let r = tokio::task::spawn_blocking(move || {
            let _shared = shared;
            f(&agent)
        })
        .await
        .map_err(join_err)?;
        r.map_err(|e| self.fail(e, path))
    }

    async fn pause_resume(self: &Arc<Self>, pause: bool) -> Result<()> {
        let (_agent, machine) = self.machine_handles()?;
        let vm = Arc::clone(machine.vm("pause/resume")?);
        let step = if pause {
            Transition::Pause
        } else {
            Transition::Resume
        };
        // Held across the VM's pause or resume: a concurrent one waits for it.
        let Some(step) = self.life.begin(step).await? else {
            return Ok(());
        };
        let r = tokio::task::spawn_blocking(move || if pause { vm.pause() } else { vm.resume() })
            .await
            .map_err(join_err)?;
        r.map_err(|e| match machine.ended() {
            Some(why) => {
                self.teardown(&why);
                self.gone_error(why)
            }
            None => e.into(),
        })?;
        step.complete();
        Ok(())
    }
}

fn entry_kind(k: crate::agent_client::EntryKind) -> EntryKind {
    use crate::agent_client::EntryKind as A;
    match k {
        A::File => EntryKind::File,
        A::Dir => EntryKind::Dir,
        A::Symlink => EntryKind::Symlink,
        A::Other => EntryKind::Other,
    }
}

/// The agent's form of a workspace path (relative to `/workspace`; `""` for the root).
fn guest_path(path: &str) -> Result<(WorkspacePath, String)> {
    let wp = WorkspacePath::parse(path)?;
    let rel = wp.relative().to_string_lossy().into_owned();
    Ok((wp, rel))
}

#[async_trait]
impl Sandbox for MicrovmSandbox {
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
        req.validate()?;
        req.refuse_tty(TIER)?;
        self.inner.handles()?;
        let inner = Arc::clone(&self.inner);
        Ok(ExecStream::spawn(move |tx| async move {
            inner.run(req, Some(tx)).await
        }))
    }

    async fn spawn(&self, req: ExecRequest) -> Result<sandbox_core::Process> {
        self.inner.spawn(req).await
    }

    async fn processes(&self) -> Result<Vec<sandbox_core::ProcessInfo>> {
        self.inner.life.check_not_gone()?;
        Ok(self.inner.procs.list())
    }

    async fn signal(
        &self,
        id: sandbox_core::ProcessId,
        signal: sandbox_core::Signal,
    ) -> Result<()> {
        self.inner.handles()?;
        self.inner.procs.signal(id, signal).await
    }

    async fn publish(
        &self,
        sandbox_port: u16,
        host: std::net::SocketAddr,
    ) -> Result<std::net::SocketAddr> {
        let dialer = self.inner.dialer()?;
        self.inner.ports.publish(sandbox_port, host, dialer).await
    }

    async fn unpublish(&self, host: std::net::SocketAddr) -> Result<()> {
        self.inner.life.check_not_gone()?;
        self.inner.ports.unpublish(host)
    }

    async fn published(&self) -> Result<Vec<sandbox_core::PublishedPort>> {
        self.inner.life.check_not_gone()?;
        Ok(self.inner.ports.list())
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        let (wp, rel) = guest_path(path)?;
        if wp.is_root() {
            return Err(Error::invalid("path", "the workspace root is a directory"));
        }
        let data = data.to_vec();
        let shown = path.to_string();
        self.inner
            .call(Some(&shown), move |a| {
                a.write_file(&rel, &data, 0, FILE_TIMEOUT)
            })
            .await
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        let (_, rel) = guest_path(path)?;
        let max = self.inner.spec.limits.disk_bytes;
        self.inner
            .call(Some(path), move |a| a.read_file(&rel, max, FILE_TIMEOUT))
            .await
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        let (_, rel) = guest_path(path)?;
        let entries = self
            .inner
            .call(Some(path), move |a| a.list(&rel, FILE_TIMEOUT))
            .await?;
        Ok(entries
            .into_iter()
            .map(|e| DirEntry::new(e.name, entry_kind(e.kind), e.size))
            .collect())
    }

    async fn watch(&self, path: &str, recursive: bool) -> Result<sandbox_core::Watch> {
        self.inner.watch(path, recursive).await
    }

    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.inner.snapshot(store).await
    }

    async fn pause(&self) -> Result<()> {
        self.inner.pause_resume(true).await
    }

    async fn resume(&self) -> Result<()> {
        self.inner.pause_resume(false).await
    }

    fn redactor(&self) -> sandbox_core::secrets::Redactor {
        self.inner.redactor.clone()
    }

    async fn health_check(&self) -> Result<()> {
        self.inner
            .call(None, |a| a.ping(PING_TIMEOUT).map(|_| ()))
            .await
    }

    async fn set_network_policy(&self, policy: NetworkPolicy) -> Result<()> {
        self.inner.life.check_not_gone()?;
        sandbox_core::egress::update_policy(
            TIER,
            self.inner.egress.as_deref(),
            &self.inner.id,
            &policy,
        )
    }

    async fn network_events(&self) -> Result<Vec<sandbox_core::NetworkEvent>> {
        // Deny-all: nothing is ever asked. Gone answers as every other call.
        self.inner.life.check_not_gone()?;
        match &self.inner.egress {
            Some(e) => e.events(&self.inner.id),
            None => Ok(Vec::new()),
        }
    }

    async fn destroy(&self) -> Result<()> {
        // No pause or resume overlaps it: one under way finishes first, none starts after.
        let _held = self.inner.life.hold().await;
        // Ask the guest to power off, briefly; then kill the VM whatever it did. Dropping the
        // live parts joins the VM's threads and the agent client's reader.
        let inner = Arc::clone(&self.inner);
        let r = tokio::task::spawn_blocking(move || {
            inner.life.release("destroyed", || {
                inner.ports.clear();
                if let Some(live) = lock(&inner.live).take() {
                    if live.machine.ended().is_none() {
                        let _ = live.agent.shutdown(SHUTDOWN_WAIT);
                        live.machine.wait_end(SHUTDOWN_WAIT);
                    }
                    live.machine.kill();
                    drop(live);
                }
            });
        })
        .await
        .map_err(join_err);
        let net = lock(&self.inner.net).take();
        // The VM is gone: its link to the enforcer goes too.
        if let Some(mut n) = net {
            n.detach().await;
        }
        r
    }
}

impl Drop for MicrovmSandbox {
    fn drop(&mut self) {
        self.inner.teardown("dropped");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// The sandbox logic against the real agent binary run on the host in its test mode
    /// (channel on an inherited socketpair fd, workspace in a temp dir): exec, env, secrets,
    /// streaming, limits, files and teardown, without a VM. Not isolation: a unit test of
    /// this module's plumbing, which runs on any host.
    pub(super) mod over_a_host_agent {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::net::UnixStream;
        use std::os::unix::process::CommandExt;

        use sandbox_core::{MapSecretSource, Sandbox};

        use super::*;
        use crate::guest::AGENT_BINARY;

        pub(in crate::sandbox) const SECRET: &str = "s3cr3t-value-xyz";

        fn agent_path() -> std::path::PathBuf {
            static P: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
            P.get_or_init(|| {
                let dir = std::env::temp_dir()
                    .join(format!("microvm-sandbox-unit-{}", std::process::id()));
                std::fs::create_dir_all(&dir).unwrap();
                // A static is never dropped: the directory goes when the process exits.
                static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
                extern "C" fn remove_dir() {
                    if let Some(d) = DIR.get() {
                        let _ = std::fs::remove_dir_all(d);
                    }
                }
                if DIR.set(dir.clone()).is_ok() {
                    // SAFETY: registers a plain `extern "C"` function with atexit(3).
                    unsafe { libc::atexit(remove_dir) };
                }
                let p = dir.join("agent");
                let tmp = dir.join("agent.tmp");
                std::fs::write(&tmp, AGENT_BINARY).unwrap();
                std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
                std::fs::rename(&tmp, &p).unwrap();
                p
            })
            .clone()
        }

        pub(in crate::sandbox) fn sandbox(
            spec: SandboxSpec,
        ) -> (MicrovmSandbox, tempfile::TempDir) {
            let ws = tempfile::tempdir().unwrap();
            let (ours, theirs) = UnixStream::pair().unwrap();
            let fd = theirs.as_raw_fd();
            let mut cmd = std::process::Command::new(agent_path());
            cmd.env_clear()
                .env("AGENT_CHANNEL_FD", "3")
                .env("AGENT_WORKSPACE", ws.path())
                .stdin(std::process::Stdio::null());
            // SAFETY: dup2 is async-signal-safe; it puts the channel at fd 3 (no CLOEXEC).
            unsafe {
                cmd.pre_exec(move || {
                    if libc::dup2(fd, 3) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let child = cmd.spawn().unwrap();
            drop(theirs);
            let agent = AgentClient::new(ours).unwrap();
            agent.wait_ready(Duration::from_secs(30)).unwrap();
            let secrets = ResolvedSecrets::resolve(
                &spec.secrets,
                &MapSecretSource::new().with("TOKEN", SECRET),
            )
            .unwrap();
            let s = MicrovmSandbox::assemble(
                spec,
                &secrets,
                Boot {
                    id: super::super::create::new_id(),
                    mem_size: 64 << 20,
                    vcpus: 1,
                    kernel_version: None,
                    image: None,
                    net: None,
                },
                agent,
                Machine::Process(Arc::new(Mutex::new(child))),
                TimelineRecorder::start(),
            );
            (s, ws)
        }

        /// After half a second of a stream nobody reads, an exec is still served: one
        /// unread stream holds itself, never the channel every request shares.
        pub(in crate::sandbox) async fn assert_still_served(s: &MicrovmSandbox) {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let r = s
                .exec(ExecRequest::code("echo still-served"))
                .await
                .unwrap();
            assert_eq!(r.stdout_str(), "still-served\n");
        }

        pub(in crate::sandbox) fn spec() -> SandboxSpec {
            SandboxSpec::builder(Language::Shell)
                .env("ONLY", "this")
                .secret_env("TOKEN", "API_TOKEN")
                .output_bytes(1000)
                .build()
                .unwrap()
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn exec_env_secrets_and_limits() {
            let (s, _ws) = sandbox(spec());
            let r = s
                .exec(ExecRequest::code("echo out; echo err >&2; exit 3"))
                .await
                .unwrap();
            assert_eq!(
                (r.stdout_str(), r.stderr_str(), r.exit_code),
                ("out\n".into(), "err\n".into(), Some(3))
            );
            let r = s
                .exec(ExecRequest::argv(["env"]).env("CALL", "1"))
                .await
                .unwrap();
            let text = r.stdout_str();
            let mut names: Vec<&str> = text
                .lines()
                .filter_map(|l| l.split_once('=').map(|(k, _)| k))
                .map(|k| match k {
                    "API_TOKEN" | "CALL" | "HOME" | "LANG" | "ONLY" | "PATH" => k,
                    _ => "unexpected",
                })
                .collect();
            names.sort();
            assert_eq!(
                names,
                ["API_TOKEN", "CALL", "HOME", "LANG", "ONLY", "PATH"],
                "{r:?}"
            );
            assert!(!r.stdout_str().contains(SECRET));
            assert!(r.stdout_str().contains("API_TOKEN=[REDACTED:TOKEN]"));
            let r = s
                .exec(ExecRequest::argv(["cat"]).stdin(b"in".to_vec()))
                .await
                .unwrap();
            assert_eq!(r.stdout, b"in");
            let r = s
                .exec(ExecRequest::argv(["sleep", "30"]).timeout(Duration::from_millis(300)))
                .await
                .unwrap();
            assert_eq!(r.limit, Some(LimitKind::WallTime));
            assert_eq!(r.exit_code, Some(137));
            let r = s
                .exec(ExecRequest::code("yes | head -c 5000000; echo tail >&2"))
                .await
                .unwrap();
            assert!(r.truncated);
            assert_eq!(r.stdout.len(), 1000);
            // Streaming: chunks come redacted (also across chunk boundaries) and capped.
            let mut st = s
                .exec_stream(ExecRequest::code(
                    "printf 's3cr3t'; sleep 0.2; printf -- '-value-xyz\\n'; echo e >&2",
                ))
                .await
                .unwrap();
            let (mut out, mut err, mut exit) = (Vec::new(), Vec::new(), None);
            while let Some(ev) = st.next().await {
                match ev.unwrap() {
                    ExecEvent::Stdout(b) => out.extend_from_slice(&b),
                    ExecEvent::Stderr(b) => err.extend_from_slice(&b),
                    ExecEvent::Exit(r) => exit = Some(r),
                    other => panic!("unexpected event: {other:?}"),
                }
            }
            assert_eq!(String::from_utf8(out).unwrap(), "[REDACTED:TOKEN]\n");
            assert_eq!(err, b"e\n");
            let exit = exit.unwrap();
            assert_eq!(exit.exit_code, Some(0));
            assert!(exit.stdout.is_empty());
            let st = s
                .exec_stream(ExecRequest::code("yes | head -c 100000"))
                .await
                .unwrap();
            let r = st.collect().await.unwrap();
            assert_eq!(r.stdout.len(), 1000);
            assert!(r.truncated);
            s.destroy().await.unwrap();
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn files_escapes_and_teardown() {
            let (s, ws) = sandbox(spec());
            s.write_file("d/a.txt", b"hello").await.unwrap();
            assert_eq!(std::fs::read(ws.path().join("d/a.txt")).unwrap(), b"hello");
            assert_eq!(s.read_file("/workspace/d/a.txt").await.unwrap(), b"hello");
            let r = s
                .exec(ExecRequest::argv(["cat", "a.txt"]).cwd("d"))
                .await
                .unwrap();
            assert_eq!(r.stdout, b"hello");
            let l = s.list("").await.unwrap();
            assert_eq!(l.len(), 1);
            assert_eq!((l[0].name.as_str(), l[0].kind), ("d", EntryKind::Dir));
            assert!(matches!(
                s.read_file("nope").await,
                Err(Error::NotFound { .. })
            ));
            assert!(matches!(s.list("nope").await, Err(Error::NotFound { .. })));
            for bad in ["../x", "/etc/passwd", "/workspace/../x"] {
                assert!(
                    matches!(s.read_file(bad).await, Err(Error::PathEscape { .. })),
                    "{bad}"
                );
                assert!(matches!(
                    s.write_file(bad, b"x").await,
                    Err(Error::PathEscape { .. })
                ));
            }
            std::os::unix::fs::symlink("/etc", ws.path().join("out")).unwrap();
            assert!(matches!(
                s.read_file("out/passwd").await,
                Err(Error::PathEscape { .. })
            ));
            assert!(matches!(
                s.write_file("", b"x").await,
                Err(Error::InvalidSpec { .. })
            ));
            // Pause and snapshots need a VM.
            assert!(matches!(s.pause().await, Err(Error::Unsupported { .. })));
            s.health_check().await.unwrap();
            s.destroy().await.unwrap();
            s.destroy().await.unwrap();
            assert!(matches!(
                s.health_check().await,
                Err(Error::SandboxGone { .. })
            ));
            assert!(matches!(
                s.exec(ExecRequest::code("true")).await,
                Err(Error::SandboxGone { .. })
            ));
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn destroy_ends_a_running_exec() {
            let (s, _ws) = sandbox(spec());
            let s = Arc::new(s);
            let s2 = Arc::clone(&s);
            let running =
                tokio::spawn(async move { s2.exec(ExecRequest::argv(["sleep", "25"])).await });
            tokio::time::sleep(Duration::from_millis(300)).await;
            s.destroy().await.unwrap();
            // Either the channel closed first (SandboxGone) or the agent's shutdown killed the
            // command first (137); never the 25 s sleep running to its end (the guard is far
            // below it, a hang guard rather than a timing assertion).
            let done = tokio::time::timeout(Duration::from_secs(20), running)
                .await
                .expect("the running exec was not ended by destroy")
                .unwrap();
            match done {
                Err(Error::SandboxGone { reason, .. }) => assert_eq!(reason, "destroyed"),
                Ok(r) => assert_eq!(r.exit_code, Some(137), "{r:?}"),
                other => panic!("{other:?}"),
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_dead_guest_makes_the_sandbox_gone() {
            let (s, _ws) = sandbox(spec());
            if let Some(l) = lock(&s.inner.live).as_ref() {
                l.machine.kill();
            }
            match s.exec(ExecRequest::code("true")).await {
                Err(Error::SandboxGone { reason, .. }) => {
                    assert!(reason.contains("agent process ended"), "{reason}")
                }
                other => panic!("{other:?}"),
            }
            s.destroy().await.unwrap();
        }
    }
}
