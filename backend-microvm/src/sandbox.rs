//! One microVM sandbox: a KVM VM running the Linux guest, and the connection to its agent.
//!
//! Every agent call is blocking ([`AgentClient`]) and runs on tokio's blocking pool. Execs and
//! file calls hold the sandbox's lifecycle lock shared; a snapshot holds it exclusively, so no
//! request is in flight on the console channel when the VM is saved.

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
use crate::vmm::{Entry, Vm, VmConfig, VmExit, VmmError};
use crate::{GuestFiles, MicrovmBackend, MIN_GUEST_MEMORY, TIER};

/// Snapshot artifact: the VMM's versioned state file.
pub(crate) const STATE_ARTIFACT: &str = "vm-state.json";
/// Snapshot artifact: the non-zero pages of guest memory ([`memfile`]).
pub(crate) const MEMORY_ARTIFACT: &str = "memory.extents";
/// Default `PATH` in the guest (busybox applets live in `/bin`).
const GUEST_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long one file call (or one chunk of it) may take.
const FILE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a ping may take (health checks, restore).
const PING_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `destroy` waits for the guest to power off before killing the VM.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(2);
/// Serial output kept per VM (kernel log; its tail goes into boot errors).
const SERIAL_CAP: usize = 256 << 10;
/// Serial bytes quoted in a boot error.
const SERIAL_TAIL: usize = 3000;

type Sender = mpsc::Sender<Result<ExecEvent>>;

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
    live: Mutex<Option<Live>>,
    /// Live, paused, or gone with the reason (destroyed, lifetime, the VM died).
    life: Lifecycle,
    born: Instant,
    /// Agent calls hold it shared; a snapshot holds it exclusively.
    lifecycle: Arc<RwLock<()>>,
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
    Error::backend(TIER, format!("a blocking task failed: {e}"))
}

/// Refuses what this tier cannot do, before anything is started.
pub(crate) fn check_spec(spec: &SandboxSpec) -> Result<()> {
    spec.validate()?;
    if !matches!(spec.network, NetworkPolicy::DenyAll) {
        return Err(Error::unsupported(
            TIER,
            "network access (the microVM has no network device; only the deny-all policy is \
             offered)",
        ));
    }
    if spec.rootfs.is_some() {
        return Err(Error::unsupported(
            TIER,
            "a custom rootfs (the guest's root filesystem is its initramfs)",
        ));
    }
    if let Workspace::HostDir { .. } = spec.workspace {
        return Err(Error::unsupported(
            TIER,
            "a host directory as the workspace (the guest's /workspace is a tmpfs in guest \
             memory; copy files in with write_file)",
        ));
    }
    if !spec.mounts.is_empty() {
        return Err(Error::unsupported(
            TIER,
            "host mounts (no host files are shared into the guest)",
        ));
    }
    if spec.language != Language::Shell {
        return Err(Error::unsupported(
            TIER,
            format!(
                "the {} language (the guest has busybox only: use shell code or argv commands)",
                spec.language
            ),
        ));
    }
    Ok(())
}

/// Guest RAM for a spec: `limits.memory_bytes`, rounded up to whole pages.
pub(crate) fn guest_memory(spec: &SandboxSpec) -> Result<u64> {
    let m = spec.limits.memory_bytes;
    if m < MIN_GUEST_MEMORY {
        return Err(Error::invalid(
            "limits.memory_bytes",
            format!(
                "the microvm tier needs at least {} MiB for the guest kernel",
                MIN_GUEST_MEMORY >> 20
            ),
        ));
    }
    m.checked_add(4095)
        .map(|v| v & !4095)
        .ok_or_else(|| Error::invalid("limits.memory_bytes", "too large"))
}

fn vm_config(mem_size: u64, vcpus: u8, lifetime: Duration) -> VmConfig {
    VmConfig {
        mem_size,
        vcpus,
        serial_cap: SERIAL_CAP,
        virtio_console: true,
        deadline: Some(lifetime),
        ..VmConfig::default()
    }
}

/// The environment every command gets: exactly the spec's, its secrets, and defaults.
fn sandbox_env(spec: &SandboxSpec, secrets: &ResolvedSecrets) -> BTreeMap<String, String> {
    let mut env = spec.base_env();
    for (k, v) in secrets.env() {
        env.insert(k.to_string(), v.to_string());
    }
    env.entry("PATH".into())
        .or_insert_with(|| GUEST_PATH.into());
    env.entry("HOME".into())
        .or_insert_with(|| "/workspace".into());
    env.entry("LANG".into()).or_insert_with(|| "C.UTF-8".into());
    env
}

fn serial_tail(vm: &Vm) -> String {
    let out = vm.serial_output();
    let start = out.len().saturating_sub(SERIAL_TAIL);
    String::from_utf8_lossy(out.get(start..).unwrap_or_default()).into_owned()
}

/// A boot or restore failure: the VM is killed, the error carries the console's tail.
fn boot_failure(vm: &Vm, what: &str, why: &str) -> Error {
    vm.kill();
    let tail = serial_tail(vm);
    let tail = if tail.trim().is_empty() {
        "(no serial output)".to_string()
    } else {
        tail
    };
    Error::backend(
        TIER,
        format!("{what}: {why}\n--- guest serial console (last lines) ---\n{tail}"),
    )
}

/// Waits for the agent's `Ready` while watching the VM (a guest that dies during boot is
/// reported at once, not after the whole timeout).
fn wait_agent(
    vm: &Vm,
    agent: &AgentClient,
    timeout: Duration,
) -> std::result::Result<(), AgentError> {
    let end = Instant::now() + timeout;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(AgentError::Timeout(timeout));
        }
        match agent.wait_ready(left.min(Duration::from_millis(100))) {
            Ok(()) => return Ok(()),
            Err(AgentError::Timeout(_)) => {
                if let Some(e) = vm.exit() {
                    return Err(AgentError::Closed(format!(
                        "the VM ended while booting: {e}"
                    )));
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Creates the VM and loads kernel, initramfs, boot params and ACPI tables into it.
fn build_vm(
    guest: &GuestFiles,
    cmdline: &str,
    cfg: VmConfig,
    t: &mut TimelineRecorder,
) -> Result<Vm> {
    let initrd =
        std::fs::read(&guest.initramfs).map_err(|e| Error::io_path("read", &guest.initramfs, e))?;
    if !guest.installed {
        // Explicit files (the installed ones are checked by the install manifest).
        crate::guest::initramfs::check(&initrd).map_err(|e| Error::Unavailable {
            tier: TIER,
            reason: format!("the initramfs {}: {e}", guest.initramfs.display()),
            fix: "build it with backend_microvm::guest::initramfs::build, or use the installed \
                  guest (backend_microvm::guest::install::install, or `agent-sandbox install \
                  microvm-guest` from a shell)"
                .into(),
        })?;
    }
    let mut kernel =
        std::fs::File::open(&guest.kernel).map_err(|e| Error::io_path("open", &guest.kernel, e))?;
    let vcpus = cfg.vcpus;
    let mut vm = Vm::new(cfg)?;
    t.mark(Phase::Allocation);
    let devices: Vec<VirtioMmioDesc> = vm
        .virtio_devices()
        .iter()
        .map(|d| VirtioMmioDesc {
            base: d.base,
            size: d.size,
            irq: d.irq,
        })
        .collect();
    let b = boot::load_linux(
        vm.memory(),
        &mut kernel,
        &BootConfig {
            cmdline,
            initrd: &initrd,
            mem_size: vm.mem_size(),
            vcpus,
            devices: &devices,
        },
    )
    .map_err(|e| match e {
        boot::BootError::Kernel(m) => Error::Unavailable {
            tier: TIER,
            reason: format!(
                "the guest kernel {} cannot be loaded: {m}",
                guest.kernel.display()
            ),
            fix: format!("{} (to prepare it again)", crate::INSTALL_FIX),
        },
        other => Error::backend(TIER, format!("loading the guest: {other}")),
    })?;
    t.mark(Phase::Filesystem);
    vm.start(Entry::kernel(b.entry.0))?;
    Ok(vm)
}

/// Boots a VM: build it, start the kernel, wait for the agent (bounded by `boot_timeout`; a
/// guest that does not come up is killed and the error quotes its serial console).
fn boot_guest(
    guest: &GuestFiles,
    cmdline: &str,
    boot_timeout: Duration,
    vcfg: VmConfig,
    mut t: TimelineRecorder,
) -> Result<(Vm, AgentClient, TimelineRecorder)> {
    let mut vm = build_vm(guest, cmdline, vcfg, &mut t)?;
    let console = vm
        .take_console()
        .ok_or_else(|| Error::backend(TIER, "the VM has no virtio console"))?;
    let agent = AgentClient::new(console)
        .map_err(|e| boot_failure(&vm, "starting the agent client", &e.to_string()))?;
    match wait_agent(&vm, &agent, boot_timeout) {
        Ok(()) => Ok((vm, agent, t)),
        Err(e @ AgentError::VersionMismatch { .. }) => {
            vm.kill();
            Err(map_agent_error(e, None))
        }
        Err(e) => Err(boot_failure(&vm, "booting the guest", &e.to_string())),
    }
}

impl MicrovmSandbox {
    pub(crate) async fn create(
        backend: &MicrovmBackend,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Self> {
        check_spec(spec)?;
        let mem_size = guest_memory(spec)?;
        let t = TimelineRecorder::start();
        let be = backend.clone();
        let guest = tokio::task::spawn_blocking(move || {
            MicrovmBackend::check_kvm()?;
            be.guest_files()
        })
        .await
        .map_err(join_err)??;
        let cfg = backend.config.clone();
        let vcfg = vm_config(mem_size, cfg.vcpus, spec.limits.lifetime());
        let g = guest.clone();
        let (vm, agent, mut t) = tokio::task::spawn_blocking(move || {
            boot_guest(&g, &cfg.cmdline, cfg.boot_timeout, vcfg, t)
        })
        .await
        .map_err(join_err)??;
        t.mark(Phase::Runtime);
        Ok(Self::assemble(
            spec.clone(),
            &secrets,
            mem_size,
            backend.config.vcpus,
            guest.kernel_version,
            agent,
            Machine::Vm(Arc::new(vm)),
            t,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        spec: SandboxSpec,
        secrets: &ResolvedSecrets,
        mem_size: u64,
        vcpus: u8,
        kernel_version: Option<String>,
        agent: AgentClient,
        machine: Machine,
        t: TimelineRecorder,
    ) -> Self {
        let id = format!("mvm-{}", &uuid::Uuid::new_v4().simple().to_string()[..20]);
        MicrovmSandbox {
            inner: Arc::new(Inner {
                id: id.clone(),
                env: sandbox_env(&spec, secrets),
                redactor: secrets.redactor(),
                spec,
                mem_size,
                vcpus,
                kernel_version,
                live: Mutex::new(Some(Live { agent, machine })),
                life: Lifecycle::new(id.clone()),
                born: Instant::now(),
                lifecycle: Arc::new(RwLock::new(())),
            }),
            timeline: t.finish(),
        }
    }

    pub(crate) async fn restore(
        _backend: &MicrovmBackend,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Self> {
        let m = store.manifest_for(id, TIER).await?;
        let engine = MicrovmBackend::engine();
        if m.engine != engine {
            return Err(SnapshotError::Incompatible {
                id: id.clone(),
                reason: format!("taken with `{}`, this library is `{engine}`", m.engine),
            }
            .into());
        }
        let corrupt = |what: &str| -> Error {
            SnapshotError::Corrupt {
                id: id.clone(),
                what: what.into(),
            }
            .into()
        };
        let mem_size: u64 = m
            .metadata
            .get("mem_size")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| corrupt("metadata `mem_size` is missing or not a number"))?;
        let vcpus: u8 = m
            .metadata
            .get("vcpus")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| corrupt("metadata `vcpus` is missing or not a number"))?;
        check_spec(&m.spec)?;
        let mut t = TimelineRecorder::start();
        tokio::task::spawn_blocking(MicrovmBackend::check_kvm)
            .await
            .map_err(join_err)??;
        let state = store.artifact(id, STATE_ARTIFACT).await?;
        let memory = store.artifact(id, MEMORY_ARTIFACT).await?;
        let snap_id = id.clone();
        let dir = tokio::task::spawn_blocking(move || -> Result<tempfile::TempDir> {
            let dir = tempfile::Builder::new()
                .prefix("agent-sandbox-microvm-restore-")
                .tempdir()
                .map_err(|e| Error::io("create a restore directory", e))?;
            let p = dir.path().join(crate::vmm::vm::SNAPSHOT_STATE_FILE);
            std::fs::write(&p, &state).map_err(|e| Error::io_path("write", &p, e))?;
            let p = dir.path().join(crate::vmm::vm::SNAPSHOT_MEMORY_FILE);
            memfile::unpack(&memory, mem_size, &p).map_err(|e| match e {
                memfile::UnpackError::Io(e) => Error::io_path("write", &p, e),
                memfile::UnpackError::Corrupt(what) => SnapshotError::Corrupt {
                    id: snap_id,
                    what: format!("{MEMORY_ARTIFACT}: {what}"),
                }
                .into(),
            })?;
            Ok(dir)
        })
        .await
        .map_err(join_err)??;
        t.mark(Phase::Filesystem);
        let vcfg = vm_config(mem_size, vcpus, m.spec.limits.lifetime());
        let snap_id = id.clone();
        let (vm, agent) = tokio::task::spawn_blocking(move || -> Result<(Vm, AgentClient)> {
            let restored = Vm::restore(dir.path(), vcfg);
            // The memory file is mapped copy-on-write: the mapping keeps its pages, the
            // directory is not needed any more.
            drop(dir);
            let mut vm = restored.map_err(|e| match e {
                VmmError::SnapshotCorrupt(what) => SnapshotError::Corrupt {
                    id: snap_id.clone(),
                    what,
                }
                .into(),
                VmmError::SnapshotIncompatible(reason) => SnapshotError::Incompatible {
                    id: snap_id.clone(),
                    reason,
                }
                .into(),
                other => Error::from(other),
            })?;
            let console = vm
                .take_console()
                .ok_or_else(|| Error::backend(TIER, "the restored VM has no virtio console"))?;
            let agent = AgentClient::new(console)
                .map_err(|e| boot_failure(&vm, "starting the agent client", &e.to_string()))?;
            agent
                .ping(PING_TIMEOUT)
                .map_err(|e| boot_failure(&vm, "the restored guest's agent", &e.to_string()))?;
            Ok((vm, agent))
        })
        .await
        .map_err(join_err)??;
        t.mark(Phase::Restore);
        Ok(Self::assemble(
            m.spec.clone(),
            &secrets,
            mem_size,
            vcpus,
            m.metadata.get("kernel_version").cloned(),
            agent,
            Machine::Vm(Arc::new(vm)),
            t,
        ))
    }
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
        other => Error::backend(TIER, other.to_string()),
    }
}

impl Inner {
    fn gone_error(&self, reason: String) -> Error {
        Error::SandboxGone {
            id: self.id.clone(),
            reason,
        }
    }

    /// Ends the sandbox for `reason` (the first reason sticks) and kills the VM.
    fn teardown(&self, reason: &str) -> Option<Live> {
        self.life.end(reason);
        let live = lock(&self.live).take();
        if let Some(l) = &live {
            l.machine.kill();
        }
        live
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
        let why = machine.ended().or_else(|| {
            (self.born.elapsed() > self.spec.limits.lifetime())
                .then(|| "lifetime limit reached".to_string())
        });
        if let Some(why) = why {
            drop(self.teardown(&why));
            return Err(self.gone_error(why));
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
            drop(self.teardown(&why));
            return self.gone_error(why);
        }
        if let AgentError::Protocol(m) = &e {
            let why = format!("the guest agent broke the protocol ({m})");
            drop(self.teardown(&why));
            return self.gone_error(why);
        }
        map_agent_error(e, path)
    }

    fn argv(&self, cmd: &Command) -> Result<Vec<String>> {
        match cmd {
            Command::Argv(a) => Ok(a.clone()),
            Command::Code(code) => match self.spec.language {
                Language::Shell => Ok(vec!["/bin/sh".into(), "-c".into(), code.clone()]),
                other => Err(Error::unsupported(
                    TIER,
                    format!("{other} code (the guest has busybox only)"),
                )),
            },
            other => Err(Error::unsupported(TIER, format!("the command {other:?}"))),
        }
    }

    async fn run(self: &Arc<Self>, req: ExecRequest, tx: Option<Sender>) -> Result<ExecResult> {
        req.validate()?;
        let shared = Arc::clone(&self.lifecycle).read_owned().await;
        // Only the agent is held during the call: destroy drops the VM, which closes the
        // channel and wakes the call at once.
        let (agent, _) = self.handles()?;
        let mut t = TimelineRecorder::start();
        let argv = self.argv(&req.command)?;
        let cwd = match &req.cwd {
            None => String::new(),
            Some(c) if c.starts_with('/') => c.clone(),
            Some(c) => WorkspacePath::parse(c)?.in_sandbox(),
        };
        let mut env = self.env.clone();
        env.extend(req.env.clone());
        let timeout = req.effective_timeout(self.spec.limits.wall_time());
        let cap = self.spec.limits.output_bytes;
        let areq = agent_client::ExecRequest {
            argv,
            env: env.into_iter().collect(),
            cwd,
            stdin: req.stdin.clone().unwrap_or_default(),
            timeout_ms: u64::try_from(timeout.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
            // Both streams together: the agent drops what the host would drop anyway.
            max_output: cap.saturating_mul(2),
        };
        let redactor = self.redactor.clone();
        let collected = tokio::task::spawn_blocking(move || {
            let _shared = shared;
            collect(&agent, &areq, cap, &redactor, tx)
        })
        .await
        .map_err(join_err)?;
        let (exit, out, err) = collected.map_err(|e| self.fail(e, None))?;
        t.mark(Phase::Command);
        let limit = exit.timed_out.then_some(LimitKind::WallTime);
        let exit_code = exit
            .code
            .or(exit.signal.map(|s| 128 + s))
            .or(exit.timed_out.then_some(137));
        let mut r = ExecResult::from_output(exit_code, out, err, &self.redactor)
            .with_limit(limit)
            .with_timeline(t.finish());
        // The agent's own caps may have dropped output before it reached us.
        r.truncated |= exit.truncated;
        Ok(r)
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

    async fn snapshot(self: &Arc<Self>, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        let exclusive = Arc::clone(&self.lifecycle).write_owned().await;
        let (_agent, machine) = self.machine_handles()?;
        let vm = Arc::clone(machine.vm("snapshots")?);
        let saved = tokio::task::spawn_blocking(move || -> Result<(Vec<u8>, Vec<u8>)> {
            let _exclusive = exclusive;
            let dir = tempfile::Builder::new()
                .prefix("agent-sandbox-microvm-snap-")
                .tempdir()
                .map_err(|e| Error::io("create a snapshot directory", e))?;
            let info = vm.snapshot(dir.path())?;
            let state = std::fs::read(&info.state_file)
                .map_err(|e| Error::io_path("read", &info.state_file, e))?;
            let memory = memfile::pack(&info.memory_file)
                .map_err(|e| Error::io_path("read", &info.memory_file, e))?;
            Ok((state, memory))
        })
        .await
        .map_err(join_err)?;
        let (state, memory) = match saved {
            Ok(s) => s,
            Err(e) => {
                if let Some(why) = machine.ended() {
                    drop(self.teardown(&why));
                    return Err(self.gone_error(why));
                }
                return Err(e);
            }
        };
        let mut draft = SnapshotDraft::new(
            TIER,
            MicrovmBackend::engine(),
            vec![SnapshotKind::FullMemory, SnapshotKind::Filesystem],
            self.spec.clone(),
        )
        .artifact(STATE_ARTIFACT, state)
        .artifact(MEMORY_ARTIFACT, memory)
        .meta("mem_size", self.mem_size.to_string())
        .meta("vcpus", self.vcpus.to_string())
        .meta("agent_hash", format!("{SOURCE_HASH:016x}"))
        .meta("sandbox_id", self.id.clone());
        if let Some(v) = &self.kernel_version {
            draft = draft.meta("kernel_version", v.clone());
        }
        Ok(store.put(draft).await?)
    }

    async fn pause_resume(self: &Arc<Self>, pause: bool) -> Result<()> {
        let (_agent, machine) = self.machine_handles()?;
        let vm = Arc::clone(machine.vm("pause/resume")?);
        let step = if pause {
            Transition::Pause
        } else {
            Transition::Resume
        };
        if !self.life.begin(step)? {
            return Ok(());
        }
        let r = tokio::task::spawn_blocking(move || if pause { vm.pause() } else { vm.resume() })
            .await
            .map_err(join_err)?;
        r.map_err(|e| match machine.ended() {
            Some(why) => {
                drop(self.teardown(&why));
                self.gone_error(why)
            }
            None => e.into(),
        })?;
        self.life.complete(step);
        Ok(())
    }
}

/// Runs one exec to its end on the agent: caps each stream, streams (redacted) chunks to
/// `tx` as they come.
fn collect(
    agent: &AgentClient,
    req: &agent_client::ExecRequest,
    cap: u64,
    redactor: &Redactor,
    tx: Option<Sender>,
) -> std::result::Result<(ExitInfo, OutputBuffer, OutputBuffer), AgentError> {
    struct Stream {
        redactor: StreamRedactor,
        sent: u64,
    }
    let mut out = OutputBuffer::new(cap);
    let mut err = OutputBuffer::new(cap);
    let mut streams = tx.as_ref().map(|_| {
        [
            Stream {
                redactor: StreamRedactor::new(redactor.clone()),
                sent: 0,
            },
            Stream {
                redactor: StreamRedactor::new(redactor.clone()),
                sent: 0,
            },
        ]
    });
    let send = |i: usize, data: Vec<u8>| {
        if let (Some(tx), false) = (&tx, data.is_empty()) {
            let ev = if i == 0 {
                ExecEvent::Stdout(data.into())
            } else {
                ExecEvent::Stderr(data.into())
            };
            // A consumer that went away does not stop the command: it still gets collected.
            let _ = tx.blocking_send(Ok(ev));
        }
    };
    let mut h = agent.start_exec(req)?;
    loop {
        let (i, data) = match h.next_event()? {
            agent_client::ExecEvent::Stdout(d) => (0, d),
            agent_client::ExecEvent::Stderr(d) => (1, d),
            agent_client::ExecEvent::Exit(x) => {
                if let Some(s) = &mut streams {
                    let truncated = [out.truncated(), err.truncated()];
                    for (i, st) in s.iter_mut().enumerate() {
                        let t = truncated.get(i).copied().unwrap_or(false) || x.truncated;
                        send(i, st.redactor.finish(t));
                    }
                }
                return Ok((x, out, err));
            }
        };
        if i == 0 {
            out.push(&data);
        } else {
            err.push(&data);
        }
        if let Some(st) = streams.as_mut().and_then(|s| s.get_mut(i)) {
            let room = usize::try_from(cap.saturating_sub(st.sent)).unwrap_or(usize::MAX);
            let take = room.min(data.len());
            if take > 0 {
                st.sent += take as u64;
                let chunk = st.redactor.push(data.get(..take).unwrap_or_default());
                send(i, chunk);
            }
        }
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
        self.inner.handles()?;
        let inner = Arc::clone(&self.inner);
        Ok(ExecStream::spawn(move |tx| async move {
            inner.run(req, Some(tx)).await
        }))
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

    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.inner.snapshot(store).await
    }

    async fn pause(&self) -> Result<()> {
        self.inner.pause_resume(true).await
    }

    async fn resume(&self) -> Result<()> {
        self.inner.pause_resume(false).await
    }

    async fn health_check(&self) -> Result<()> {
        self.inner
            .call(None, |a| a.ping(PING_TIMEOUT).map(|_| ()))
            .await
    }

    async fn destroy(&self) -> Result<()> {
        // Ask the guest to power off, briefly; then kill the VM whatever it did. Dropping the
        // live parts joins the VM's threads and the agent client's reader.
        let live = {
            self.inner.life.end("destroyed");
            lock(&self.inner.live).take()
        };
        let Some(live) = live else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || {
            if live.machine.ended().is_none() {
                let _ = live.agent.shutdown(SHUTDOWN_WAIT);
                live.machine.wait_end(SHUTDOWN_WAIT);
            }
            live.machine.kill();
            drop(live);
        })
        .await
        .map_err(join_err)
    }
}

impl Drop for MicrovmSandbox {
    fn drop(&mut self) {
        drop(self.inner.teardown("dropped"));
    }
}

/// The `memory.extents` artifact: guest memory as its non-zero pages.
///
/// Layout: the magic `AGSBMEM1`, the memory size (u64 LE), then runs of
/// `[offset u64 LE][length u64 LE][bytes]` in increasing offset order. Everything not in a run
/// is zero.
pub(crate) mod memfile {
    use std::fs::File;
    use std::io::{Read, Seek, SeekFrom};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    use std::path::Path;

    const MAGIC: &[u8; 8] = b"AGSBMEM1";
    const PAGE: usize = 4096;

    /// Why an artifact could not be written back.
    #[derive(Debug)]
    pub enum UnpackError {
        /// Writing the file failed.
        Io(std::io::Error),
        /// The artifact is malformed.
        Corrupt(String),
    }

    /// Data ranges of a (sparse) file; the whole file if the filesystem cannot tell.
    fn data_ranges(f: &File, size: u64) -> Vec<(u64, u64)> {
        let fd = f.as_raw_fd();
        let mut v = Vec::new();
        let mut pos = 0u64;
        while pos < size {
            let Ok(off) = libc::off_t::try_from(pos) else {
                return vec![(0, size)];
            };
            // SAFETY: lseek on a descriptor `f` owns; the result is checked.
            let data = unsafe { libc::lseek(fd, off, libc::SEEK_DATA) };
            if data < 0 {
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                    break;
                }
                return vec![(0, size)];
            }
            let data = data as u64;
            if data >= size {
                break;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
            let hole = if hole < 0 {
                size
            } else {
                (hole as u64).min(size)
            };
            if hole <= data {
                return vec![(0, size)];
            }
            v.push((data, hole));
            pos = hole;
        }
        v
    }

    /// Packs the non-zero pages of the file at `path`.
    pub fn pack(path: &Path) -> std::io::Result<Vec<u8>> {
        let mut f = File::open(path)?;
        let size = f.metadata()?.len();
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&size.to_le_bytes());
        let mut run: Option<(u64, Vec<u8>)> = None;
        let flush = |run: &mut Option<(u64, Vec<u8>)>, out: &mut Vec<u8>| {
            if let Some((off, data)) = run.take() {
                out.extend_from_slice(&off.to_le_bytes());
                out.extend_from_slice(&(data.len() as u64).to_le_bytes());
                out.extend_from_slice(&data);
            }
        };
        let mut buf = vec![0u8; 1 << 20];
        for (start, end) in data_ranges(&f, size) {
            // Runs never span a hole.
            flush(&mut run, &mut out);
            f.seek(SeekFrom::Start(start))?;
            let mut pos = start;
            while pos < end {
                let want = usize::try_from(end - pos)
                    .unwrap_or(usize::MAX)
                    .min(buf.len());
                let chunk = buf.get_mut(..want).unwrap_or_default();
                f.read_exact(chunk)?;
                for page in chunk.chunks(PAGE) {
                    if page.iter().all(|b| *b == 0) {
                        flush(&mut run, &mut out);
                    } else {
                        match &mut run {
                            Some((_, d)) => d.extend_from_slice(page),
                            None => run = Some((pos, page.to_vec())),
                        }
                    }
                    pos += page.len() as u64;
                }
            }
        }
        flush(&mut run, &mut out);
        Ok(out)
    }

    fn u64_at(b: &[u8], at: usize) -> Option<u64> {
        Some(u64::from_le_bytes(
            b.get(at..at.checked_add(8)?)?.try_into().ok()?,
        ))
    }

    /// Writes a packed artifact back as a sparse file of `size` bytes at `dst`.
    pub fn unpack(packed: &[u8], size: u64, dst: &Path) -> Result<(), UnpackError> {
        let bad = |m: &str| UnpackError::Corrupt(m.to_string());
        if packed.get(..8) != Some(&MAGIC[..]) {
            return Err(bad("not a memory artifact (bad magic)"));
        }
        let found = u64_at(packed, 8).ok_or_else(|| bad("truncated header"))?;
        if found != size {
            return Err(UnpackError::Corrupt(format!(
                "holds {found} bytes of memory, the snapshot says {size}"
            )));
        }
        let f = File::create(dst).map_err(UnpackError::Io)?;
        f.set_len(size).map_err(UnpackError::Io)?;
        let mut at = 16usize;
        let mut last_end = 0u64;
        while at < packed.len() {
            let off = u64_at(packed, at).ok_or_else(|| bad("truncated run header"))?;
            let len = u64_at(packed, at + 8).ok_or_else(|| bad("truncated run header"))?;
            let end = off
                .checked_add(len)
                .filter(|e| *e <= size && off >= last_end)
                .ok_or_else(|| bad("a run lies outside memory or out of order"))?;
            let start = at + 16;
            let data = usize::try_from(len)
                .ok()
                .and_then(|l| packed.get(start..start.checked_add(l)?))
                .ok_or_else(|| bad("truncated run"))?;
            f.write_all_at(data, off).map_err(UnpackError::Io)?;
            at = start + data.len();
            last_end = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn memfile_round_trips_and_skips_zero_pages() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("mem");
        let size = 64u64 << 20;
        {
            let f = std::fs::File::create(&src).unwrap();
            f.set_len(size).unwrap();
            use std::os::unix::fs::FileExt;
            f.write_all_at(b"hello", 4096 * 3 + 7).unwrap();
            f.write_all_at(&[0xab; 10000], 20 << 20).unwrap();
            f.write_all_at(&[1], size - 1).unwrap();
        }
        let packed = memfile::pack(&src).unwrap();
        assert!(packed.len() < 64 << 10, "{} bytes", packed.len());
        let dst = dir.path().join("back");
        memfile::unpack(&packed, size, &dst).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        // Wrong size, bad magic, truncation: typed errors, no panic.
        assert!(matches!(
            memfile::unpack(&packed, size / 2, &dst),
            Err(memfile::UnpackError::Corrupt(_))
        ));
        assert!(memfile::unpack(b"nonsense", size, &dst).is_err());
        for cut in [9, 20, 30, packed.len() - 1] {
            assert!(
                memfile::unpack(&packed[..cut], size, &dst).is_err(),
                "{cut}"
            );
        }
        let mut forged = packed.clone();
        forged[16..24].copy_from_slice(&(size - 2).to_le_bytes());
        assert!(memfile::unpack(&forged, size, &dst).is_err());
    }

    #[test]
    fn specs_this_tier_cannot_honour_are_refused() {
        let ok = SandboxSpec::new(Language::Shell);
        check_spec(&ok).unwrap();
        assert_eq!(guest_memory(&ok).unwrap(), 512 << 20);
        let mut small = ok.clone();
        small.limits.memory_bytes = 16 << 20;
        assert!(matches!(
            guest_memory(&small),
            Err(Error::InvalidSpec { .. })
        ));
        let py = SandboxSpec::new(Language::Python);
        assert!(matches!(check_spec(&py), Err(Error::Unsupported { .. })));
    }

    /// A "kernel" that prints to the serial port and spins: never an agent. Needs only
    /// `/dev/kvm` (kernel mode may be emulated: the guest runs a few instructions).
    #[test]
    fn a_guest_whose_agent_never_comes_is_killed_with_its_console_tail() {
        let kvm = crate::probe::probe_kvm();
        if !kvm.present {
            eprintln!("SKIP: {}", kvm.reason);
            return;
        }
        // mov dx, 0x3f8; mov al, 'h'; out dx, al; mov al, 'i'; out dx, al; jmp $
        let code = [
            0x66, 0xba, 0xf8, 0x03, 0xb0, b'h', 0xee, 0xb0, b'i', 0xee, 0xeb, 0xfe,
        ];
        let e = crate::guest::kernel::tests_support::elf_with(&code, code.len() as u64, 0x100_0000);
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, &e).unwrap();
        let initramfs = dir.path().join("initrd");
        let cpio = crate::guest::initramfs::build(&crate::guest::initramfs::InitramfsContents {
            agent: crate::guest::AGENT_BINARY,
            busybox: None,
            applets: vec![],
            modules: vec![],
        })
        .unwrap();
        std::fs::write(&initramfs, cpio).unwrap();
        let guest = GuestFiles {
            kernel,
            initramfs,
            kernel_version: None,
            installed: false,
        };
        let r = boot_guest(
            &guest,
            crate::boot::DEFAULT_CMDLINE,
            Duration::from_millis(1500),
            vm_config(64 << 20, 1, Duration::from_secs(60)),
            TimelineRecorder::start(),
        );
        match r {
            Err(Error::Backend { message, .. }) => {
                assert!(message.contains("booting the guest"), "{message}");
                assert!(message.contains("serial console"), "{message}");
                assert!(message.contains("hi"), "{message}");
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("an agent answered"),
        }
        // An initramfs without the agent is refused before a VM is made.
        let mut w = crate::guest::initramfs::CpioWriter::new();
        w.file("bin/sh", 0o755, b"\x7fELF").unwrap();
        std::fs::write(&guest.initramfs, w.finish()).unwrap();
        let r = boot_guest(
            &guest,
            crate::boot::DEFAULT_CMDLINE,
            Duration::from_millis(100),
            vm_config(64 << 20, 1, Duration::from_secs(60)),
            TimelineRecorder::start(),
        );
        assert!(matches!(r, Err(Error::Unavailable { .. })), "{:?}", r.err());
    }

    /// The sandbox logic against the real agent binary run on the host in its test mode
    /// (channel on an inherited socketpair fd, workspace in a temp dir): exec, env, secrets,
    /// streaming, limits, files and teardown, without a VM. Not isolation: a unit test of
    /// this module's plumbing, which runs on any host.
    mod over_a_host_agent {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::net::UnixStream;
        use std::os::unix::process::CommandExt;

        use sandbox_core::{MapSecretSource, Sandbox};

        use super::*;
        use crate::guest::AGENT_BINARY;

        const SECRET: &str = "s3cr3t-value-xyz";

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

        fn sandbox(spec: SandboxSpec) -> (MicrovmSandbox, tempfile::TempDir) {
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
                64 << 20,
                1,
                None,
                agent,
                Machine::Process(Arc::new(Mutex::new(child))),
                TimelineRecorder::start(),
            );
            (s, ws)
        }

        fn spec() -> SandboxSpec {
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
