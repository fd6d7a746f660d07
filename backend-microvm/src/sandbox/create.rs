//! Creating a sandbox: what this tier refuses in a spec, the guest's memory and environment,
//! building and booting the VM, and waiting for its agent.

use super::warm::{self, Frozen, TemplateKey, WarmStarts};
use super::*;

/// Default `PATH` in the guest (busybox applets live in `/bin`).
const GUEST_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Serial output kept per VM (kernel log; its tail goes into boot errors).
const SERIAL_CAP: usize = 256 << 10;
/// Serial bytes quoted in a boot error.
const SERIAL_TAIL: usize = 3000;

/// A new sandbox id.
pub(super) fn new_id() -> String {
    format!("mvm-{}", &uuid::Uuid::new_v4().simple().to_string()[..20])
}

/// Refuses what this tier cannot do, before anything is started.
pub(crate) fn check_spec(spec: &SandboxSpec) -> Result<()> {
    spec.validate_on_host()?;
    if spec.rootfs.is_some() {
        return Err(Error::unsupported(
            TIER,
            "a custom rootfs directory (the guest cannot mount host directories; start from an \
             OCI image instead: it becomes the guest's root disk)",
        ));
    }
    if let Workspace::HostDir { .. } = spec.workspace {
        return Err(Error::unsupported(
            TIER,
            "a host directory as the workspace (the guest's /workspace is a tmpfs in guest \
             memory; copy files in with write_file)",
        ));
    }
    if spec.workspace_alias.is_some() {
        return Err(Error::unsupported(
            TIER,
            "a workspace alias (the guest agent mounts the workspace at /workspace only)",
        ));
    }
    if !spec.mounts.is_empty() {
        return Err(Error::unsupported(
            TIER,
            "host mounts (no host files are shared into the guest)",
        ));
    }
    match (spec.language, spec.image.is_some()) {
        (Language::Shell, _) => {}
        (Language::Python | Language::Node | Language::Javascript, true) => {}
        (other, true) => {
            return Err(Error::unsupported(
                TIER,
                format!(
                    "the {other} language (from an image, this tier runs Python, JavaScript \
                     and shell code with the image's own interpreter, and any argv command)"
                ),
            ))
        }
        (other, false) => {
            return Err(Error::unsupported(
                TIER,
                format!(
                    "the {other} language without an image (the default guest has busybox \
                     only: use shell code or argv commands, or start from an image that has \
                     the interpreter)"
                ),
            ))
        }
    }
    Ok(())
}

/// The kernel command line of a sandbox: the backend's, plus, for a sandbox from an image
/// (`image_user`: the uid and gid its `User` means), the image root (the disk the VM's
/// virtio-blk device serves) and that user.
pub(crate) fn sandbox_cmdline(base: &str, image_user: Option<(u32, u32)>) -> String {
    match image_user {
        None => base.to_string(),
        Some((0, 0)) => format!("{base} agent.root=/dev/vda"),
        Some((uid, gid)) => format!("{base} agent.root=/dev/vda agent.user={uid}:{gid}"),
    }
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

pub(super) fn vm_config(
    mem_size: u64,
    vcpus: u8,
    lifetime: Duration,
    image: Option<&ImageRoot>,
) -> VmConfig {
    VmConfig {
        mem_size,
        vcpus,
        serial_cap: SERIAL_CAP,
        virtio_console: true,
        deadline: Some(lifetime),
        block: image.map(|i| BlockConfig {
            path: i.disk.path().to_path_buf(),
            id: "agent-sandbox-root".into(),
        }),
        ..VmConfig::default()
    }
}

/// The environment every command gets: the image's `Env` under exactly the spec's, its
/// secrets, and defaults.
fn sandbox_env(
    spec: &SandboxSpec,
    secrets: &ResolvedSecrets,
    image: Option<&ImageRoot>,
) -> BTreeMap<String, String> {
    let mut env = match image {
        Some(i) => i.image.config().environment(spec.base_env()),
        None => spec.base_env(),
    };
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

/// What stopped a guest that did not come up, then the tail of its serial console: the
/// cause that [`boot_failure`] gives its [`Error::Backend`].
#[derive(Debug, thiserror::Error)]
#[error("{cause}\n--- guest serial console (last lines) ---\n{tail}")]
pub(crate) struct ConsoleTail {
    /// What went wrong (an [`AgentError`], or the guest's own words).
    #[source]
    cause: sandbox_core::error::BoxError,
    /// The last lines the guest wrote to its serial console.
    tail: String,
}

/// A boot or restore failure while `what` was being done: the VM is killed, the error keeps
/// `cause` as its source, with the console's tail.
pub(super) fn boot_failure(
    vm: &Vm,
    what: &str,
    cause: impl Into<sandbox_core::error::BoxError>,
) -> Error {
    vm.kill();
    let tail = serial_tail(vm);
    let tail = if tail.trim().is_empty() {
        "(no serial output)".to_string()
    } else {
        tail
    };
    let cause = cause.into();
    Error::backend_caused(TIER, what, ConsoleTail { cause, tail })
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
        other => Error::backend_caused(TIER, "loading the guest", other),
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
    let agent =
        AgentClient::new(console).map_err(|e| boot_failure(&vm, "starting the agent client", e))?;
    match wait_agent(&vm, &agent, boot_timeout) {
        Ok(()) => Ok((vm, agent, t)),
        Err(e @ AgentError::VersionMismatch { .. }) => {
            vm.kill();
            Err(map_agent_error(e, None))
        }
        // The image root would not come up (the agent said why before `Ready`).
        Err(AgentError::GuestSetup(m)) if m.contains("install the guest again") => {
            vm.kill();
            Err(Error::Unavailable {
                tier: TIER,
                reason: format!("the installed guest cannot start from images: {m}"),
                fix: format!("{} (rebuilds the initramfs)", crate::INSTALL_FIX),
            })
        }
        Err(AgentError::GuestSetup(m)) => Err(boot_failure(
            &vm,
            "starting the guest from the image",
            AgentError::GuestSetup(m),
        )),
        Err(e) => Err(boot_failure(&vm, "booting the guest", e)),
    }
}

/// Proxy-held secrets ride on the network, whose enforcer's proxy holds them: without an
/// enforcer such a spec is `Unsupported`, naming the setting.
pub(super) fn check_proxied(
    backend: &MicrovmBackend,
    proxied: &[sandbox_core::ProxiedSecret<'_>],
) -> Result<()> {
    if !proxied.is_empty() && backend.egress.is_none() {
        return Err(Error::unsupported(
            TIER,
            "proxy-held secrets without an egress enforcer (plug one in with \
             MicrovmBackendBuilder::egress; the facade's Runtime does)",
        ));
    }
    Ok(())
}

/// Binds the proxy-held secrets to the sandbox's network (placeholders in its environment,
/// see [`GuestNetwork::bind_secrets`]); returns the CA the guest must trust. A failure
/// detaches the network.
pub(super) async fn bind_proxied(
    net: &mut Option<GuestNetwork>,
    proxied: &[sandbox_core::ProxiedSecret<'_>],
) -> Result<Option<String>> {
    match (net, proxied.is_empty()) {
        (_, true) => Ok(None),
        (Some(n), false) => match n.bind_secrets(proxied) {
            Ok(pem) => Ok(Some(pem)),
            Err(e) => {
                n.detach().await;
                Err(e)
            }
        },
        // `validate` refuses proxy-held secrets under deny-all, the only policy without a
        // network.
        (None, false) => Err(Error::unsupported(
            TIER,
            "proxy-held secrets under a deny-all policy (allow the bound hosts)",
        )),
    }
}

/// A guest that came from a snapshot onto a network of its own: `eth0` moves to its link's
/// `settings` (`agent.net=` form); then, with proxy-held secrets, its TLS clients trust the
/// copy's proxy (`ca_pem`). Blocking.
pub(super) fn settle_network(
    vm: &Vm,
    agent: &AgentClient,
    settings: Option<&str>,
    ca_pem: Option<&str>,
) -> Result<()> {
    if let Some(s) = settings {
        agent
            .network(s, PING_TIMEOUT)
            .map_err(|e| boot_failure(vm, "moving the guest to its network", e))?;
    }
    if let Some(pem) = ca_pem {
        agent
            .trust(pem, PING_TIMEOUT)
            .map_err(|e| boot_failure(vm, "trusting the egress proxy's CA", e))?;
    }
    Ok(())
}

/// Starts the VM of a new sandbox: from `frozen`, the boot snapshot of its kind
/// (`template`), when there is one (with a network, `eth0` is then moved to this sandbox's
/// link `settings`), else by booting, keeping that boot's snapshot for the next ones; then
/// gives it its identity. Blocking.
#[allow(clippy::too_many_arguments)]
fn start_vm(
    warm: &Arc<WarmStarts>,
    template: Option<TemplateKey>,
    frozen: Option<Arc<Frozen>>,
    g: &GuestFiles,
    cmdline: &str,
    cfg: &crate::MicrovmConfig,
    vcfg: VmConfig,
    settings: Option<&str>,
    mut t: TimelineRecorder,
    name: &str,
) -> Result<(Vm, AgentClient, TimelineRecorder)> {
    if let (Some(key), Some(frozen)) = (&template, frozen) {
        let started =
            warm::start_from(warm, &frozen, vcfg.clone(), name).and_then(|(vm, agent)| {
                settle_network(&vm, &agent, settings, None)?;
                Ok((vm, agent))
            });
        match started {
            Ok((vm, agent)) => {
                t.mark(Phase::Restore);
                return Ok((vm, agent, t));
            }
            // Never worse than a boot: forget it, boot, and make a new one.
            Err(e) => {
                tracing::warn!("starting from the boot snapshot failed, booting: {e}");
                warm.forget_template(key);
            }
        }
    }
    let (vm, agent, mut t) = boot_guest(g, cmdline, cfg.boot_timeout, vcfg.clone(), t)?;
    t.mark(Phase::Runtime);
    if let Some(key) = template {
        // Ready and idle, no identity yet, nothing of the sandbox's own: the state every
        // later sandbox of this kind starts from.
        match Frozen::capture(&vm, &agent, vcfg.net.as_ref().map(|n| n.mac)) {
            Ok(frozen) => {
                warm.keep_template(key, frozen);
                warm.refill(&vcfg);
            }
            Err(e) => tracing::warn!("no boot snapshot (every sandbox boots): {e}"),
        }
    }
    // Its own name, and host entropy from the start (a fresh guest has little).
    agent
        .refresh(name, PING_TIMEOUT)
        .map_err(|e| boot_failure(&vm, "giving the guest its identity", e))?;
    Ok((vm, agent, t))
}

impl MicrovmSandbox {
    pub(crate) async fn create(
        backend: &MicrovmBackend,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Self> {
        check_spec(spec)?;
        let proxied = secrets.proxied();
        check_proxied(backend, &proxied)?;
        let enforcer =
            sandbox_core::egress::enforcer_for(TIER, backend.egress.as_ref(), &spec.network)?;
        let mem_size = guest_memory(spec)?;
        let mut t = TimelineRecorder::start();
        let be = backend.clone();
        // KVM and the guest first: a host that cannot run the tier says so before any pull.
        let guest = tokio::task::spawn_blocking(move || {
            MicrovmBackend::check_kvm()?;
            be.guest_files()
        })
        .await
        .map_err(join_err)??;
        let image = match &spec.image {
            Some(r) => {
                let root = ImageRoot::prepare(backend, r, spec.language).await?;
                t.mark(Phase::Image);
                Some(root)
            }
            None => None,
        };
        let id = new_id();
        // The network before the VM: its device is part of the machine.
        let mut net = match enforcer {
            Some(e) => Some(GuestNetwork::attach(e, &id, &spec.network).await?),
            None => None,
        };
        // The placeholders in every command's environment; the CA the guest must trust.
        let ca_pem = bind_proxied(&mut net, &proxied).await?;
        if net.is_some() {
            t.mark(Phase::Network);
        }
        let cfg = backend.config.clone();
        let mut vcfg = vm_config(mem_size, cfg.vcpus, spec.limits.lifetime(), image.as_ref());
        let mut cmdline = sandbox_cmdline(&cfg.cmdline, image.as_ref().map(|i| i.user));
        if let Some(n) = &net {
            vcfg.net = Some(n.device());
            cmdline = format!("{cmdline} {}", n.agent_param());
        }
        // Boot once, then start from that boot's snapshot (sandboxes with a network from a
        // snapshot of a booted sandbox with a network, moved to their own link).
        let template = if backend.warm.templates_on() {
            match TemplateKey::new(&guest, &cmdline, &vcfg) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::debug!("no boot snapshot for this sandbox: {e}");
                    None
                }
            }
        } else {
            None
        };
        let frozen = template.as_ref().and_then(|k| backend.warm.template(k));
        // A boot snapshot's network device keeps its MAC (the guest's driver read it at
        // boot; the VMM refuses another): this sandbox's device, on its own TAP, takes it.
        if let Some(mac) = frozen.as_ref().and_then(|f| f.mac()) {
            net = net.map(|n| n.with_mac(mac));
            vcfg.net = net.as_ref().map(GuestNetwork::device);
        }
        let g = guest.clone();
        let name = id.clone();
        let warm = Arc::clone(&backend.warm);
        let settings = net.as_ref().map(GuestNetwork::agent_net);
        let booted = tokio::task::spawn_blocking(move || {
            // Started from a snapshot of another sandbox's boot, `eth0` was moved to this
            // one's link (its device is on it with the snapshot's MAC); booted, it has this
            // link's settings from its command line.
            let (vm, agent, t) = start_vm(
                &warm,
                template,
                frozen,
                &g,
                &cmdline,
                &cfg,
                vcfg,
                settings.as_deref(),
                t,
                &name,
            )?;
            settle_network(&vm, &agent, None, ca_pem.as_deref())?;
            Ok((vm, agent, t))
        })
        .await
        .map_err(join_err)
        .and_then(|r| r);
        let (vm, agent, t) = match booted {
            Ok(b) => b,
            Err(e) => {
                if let Some(mut n) = net {
                    n.detach().await;
                }
                return Err(e);
            }
        };
        Ok(Self::assemble(
            spec.clone(),
            &secrets,
            Boot {
                id,
                mem_size,
                vcpus: backend.config.vcpus,
                kernel_version: guest.kernel_version,
                image,
                net,
            },
            agent,
            Machine::Vm(Arc::new(vm)),
            t,
        ))
    }

    pub(super) fn assemble(
        spec: SandboxSpec,
        secrets: &ResolvedSecrets,
        boot: Boot,
        agent: AgentClient,
        machine: Machine,
        t: TimelineRecorder,
    ) -> Self {
        let Boot {
            id,
            mem_size,
            vcpus,
            kernel_version,
            image,
            net,
        } = boot;
        let mut env = sandbox_env(&spec, secrets, image.as_ref());
        if let Some(n) = &net {
            env.extend(n.env().iter().cloned());
        }
        MicrovmSandbox {
            inner: Arc::new(Inner {
                id: id.clone(),
                env,
                egress: net.as_ref().map(|n| Arc::clone(n.enforcer())),
                net: Mutex::new(net),
                ports: sandbox_core::Ports::new(),
                connections: Default::default(),
                background: Default::default(),
                watches: Default::default(),
                redactor: secrets.redactor(),
                spec,
                mem_size,
                vcpus,
                kernel_version,
                image,
                live: Mutex::new(Some(Live { agent, machine })),
                life: Lifecycle::new(id.clone()),
                born: Instant::now(),
                lifecycle: Arc::new(RwLock::new(())),
                procs: Default::default(),
            }),
            timeline: t.finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

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
        // From an image, its interpreters run code; C is still refused.
        let image = || Some(sandbox_core::ImageRef::parse("python:3.12-slim").unwrap());
        for (lang, ok) in [
            (Language::Python, true),
            (Language::Javascript, true),
            (Language::Node, true),
            (Language::Shell, true),
            (Language::C, false),
            (Language::Wasm, false),
        ] {
            let mut s = SandboxSpec::new(lang);
            s.image = image();
            assert_eq!(check_spec(&s).is_ok(), ok, "{lang}: {:?}", check_spec(&s));
        }
        // A rootfs directory cannot reach the guest: the error points at images.
        let mut dir = ok.clone();
        dir.rootfs = Some(std::env::temp_dir());
        match check_spec(&dir) {
            Err(Error::Unsupported { what, .. }) => assert!(what.contains("OCI image"), "{what}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_image_adds_its_root_disk_and_user_to_the_command_line() {
        let base = crate::boot::DEFAULT_CMDLINE;
        assert_eq!(sandbox_cmdline(base, None), base);
        assert_eq!(
            sandbox_cmdline(base, Some((0, 0))),
            format!("{base} agent.root=/dev/vda")
        );
        assert_eq!(
            sandbox_cmdline(base, Some((1000, 100))),
            format!("{base} agent.root=/dev/vda agent.user=1000:100")
        );
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
            root_modules: vec![],
            net_modules: vec![],
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
            vm_config(64 << 20, 1, Duration::from_secs(60), None),
            TimelineRecorder::start(),
        );
        match r {
            Err(e @ Error::Backend { .. }) => {
                let text = e.to_string();
                assert!(text.contains("booting the guest"), "{text}");
                assert!(text.contains("serial console"), "{text}");
                assert!(text.contains("hi"), "{text}");
                let cause = std::error::Error::source(&e);
                assert!(
                    cause.is_some_and(|c| c.downcast_ref::<ConsoleTail>().is_some()),
                    "{e:?}"
                );
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
            vm_config(64 << 20, 1, Duration::from_secs(60), None),
            TimelineRecorder::start(),
        );
        assert!(matches!(r, Err(Error::Unavailable { .. })), "{:?}", r.err());
    }
}
