//! Creating a container sandbox, one function per phase of the timeline it records:
//! **image** (for a spec with an image: found in the cache, or pulled and unpacked),
//! **allocation** (ids, the egress link prepared, the init started with its setup queued,
//! its cgroups made and joined), **filesystem** (the init's setup done: root filesystem,
//! workspace, loopback; then the sandbox's handle and state record), **network** (the
//! egress link attached, when the policy needs one) and **runtime** (the init is the
//! runtime, ready once its setup is: recorded last, nearly empty). The container tier
//! records no dependencies or first-command phase at create. The lifetime timer is armed
//! after the phases.
//!
//! `workspace`: how a host-directory workspace reaches the init (its idmapped mount, or a
//! fallback).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use sandbox_core::egress::EgressPlan;
use sandbox_core::{
    EgressEnforcer, Error, Language, Lifecycle, Phase, ResolvedSecrets, Result, SandboxSpec,
    TimelineRecorder, Workspace,
};

use crate::cgroup::SandboxCgroup;
use crate::ctl::{self, Ctl};
use crate::proto::EncodeInit;
use crate::sandbox::{Inner, TIER};
use crate::spawn::{self, IdMap};
use crate::{
    cgroup_name, files, is_root, network, proto, rootfs, ContainerBackend, ContainerSandbox,
};

mod workspace;

use workspace::WorkspaceMount;

/// The egress enforcer of a sandbox whose policy needs one, with the link it prepared.
type Egress = Option<(Arc<dyn EgressEnforcer>, EgressPlan)>;

/// The root filesystem a spec asks for, resolved before anything is allocated.
#[derive(Debug, Default)]
pub(crate) struct Root {
    /// Lower layers, lowest first, canonical: the `rootfs` directory, or the image's
    /// unpacked layers. Empty: the host-tools root.
    pub layers: Vec<PathBuf>,
    /// The image (its value keeps it from being pruned while the sandbox lives).
    pub image: Option<sandbox_image::Image>,
    /// The uid and gid the image's `User` names (else 0).
    pub user: Option<(u32, u32)>,
}

/// What the allocation phase hands on: the sandbox's id and identities, its prepared egress
/// link, and its init, started with its setup queued, in the sandbox's cgroups.
struct Allocation {
    id: String,
    ids: IdMap,
    /// The lease on the host uid range of `ids` (as root).
    lease: Option<crate::slots::SlotLease>,
    /// The uid inside that runs commands.
    user: u32,
    /// Commands keep uid 0 inside (with no capabilities): rootless, or a rootfs directory.
    stay_root: bool,
    /// The gid inside that runs commands.
    group: u32,
    /// The image, if the spec names one.
    image: Option<sandbox_image::Image>,
    egress: Egress,
    /// Placeholders and the interception CA of the spec's proxy-held secrets, if any.
    secret_plan: Option<sandbox_core::SecretPlan>,
    /// Gives the prepared egress link back if the create fails before the sandbox owns it.
    release: EgressRelease,
    /// Host pid of the init.
    pid: libc::pid_t,
    ctl: Arc<Ctl>,
    cgroup: Option<SandboxCgroup>,
    /// The setup requests queued behind the bootstrap: ids and reply channels, in order.
    queued: Vec<(u64, tokio::sync::mpsc::UnboundedReceiver<ctl::Reply>)>,
    /// The setup requests sent once a snapshot's upper layer is restored (encoded).
    later: Vec<Vec<u8>>,
    /// As root, `lo` being brought up meanwhile (unless the init, a spare, did so).
    lo: Option<tokio::sync::oneshot::Receiver<std::io::Result<()>>>,
}

impl ContainerBackend {
    /// Checks `spec` against this backend; returns the egress enforcer its network needs and
    /// whether sandboxes get cgroups (see `cgroups_usable`).
    fn check_spec(&self, spec: &SandboxSpec) -> Result<(Option<Arc<dyn EgressEnforcer>>, bool)> {
        spec.validate_on_host()?;
        if spec.language == Language::Wasm {
            return Err(Error::unsupported(
                TIER,
                "the wasm language (use the wasm tier)",
            ));
        }
        let enforcer =
            sandbox_core::egress::enforcer_for(TIER, self.cfg.egress.as_ref(), &spec.network)?;
        rootfs::check_mounts(spec)?;
        // Always asked, and before the first create starts this process's zygote: on v2
        // it may move this process into a leaf cgroup, which must hold all of ours.
        let cgroups = self.cgroups_usable();
        if self.cfg.require_cgroups {
            cgroups.as_ref().map_err(|reason| Error::Unavailable {
                tier: TIER,
                reason: reason.to_string(),
                fix: "run as root, or delegate a cgroup to this user (chown its directory and cgroup.procs \
                      in each controller and start the process inside it), or build the backend with \
                      require_cgroups(false) to run without memory/pids limits"
                    .into(),
            })?;
        }
        Ok((enforcer, cgroups.is_ok()))
    }

    /// Creates a sandbox and returns the concrete type (for [`ContainerSandbox::init_pid`]).
    pub async fn create_container(&self, spec: &SandboxSpec) -> Result<ContainerSandbox> {
        self.create_sandbox(spec, ResolvedSecrets::none()).await
    }

    /// Creates a sandbox (the [`sandbox_core::Backend::create`] of this backend).
    pub(crate) async fn create_sandbox(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<ContainerSandbox> {
        self.create_inner(spec, secrets, None).await
    }

    /// Creates a sandbox, phase by phase (see the module docs); `upper` (a snapshot's
    /// `upper.tar`, rootfs-directory mode) is unpacked into the overlay's upper layer before
    /// the overlay is mounted.
    pub(crate) async fn create_inner(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
        upper: Option<&[u8]>,
    ) -> Result<ContainerSandbox> {
        let (enforcer, with_cgroups) = self.check_spec(spec)?;
        let mut t = TimelineRecorder::start();
        let root = self.root_of(spec).await?;
        if root.image.is_some() {
            t.mark(Phase::Image);
        }
        let a = self
            .allocate(spec, enforcer, with_cgroups, upper, root, &secrets)
            .await?;
        t.mark(Phase::Allocation);
        let (mut sb, egress, release) = self.filesystem(spec, secrets, upper, a).await?;
        t.mark(Phase::Filesystem);
        // The sandbox owns the link now: its teardown detaches it.
        release.disarm();
        if Self::network(&sb, &egress).await? {
            t.mark(Phase::Network);
        }
        t.mark(Phase::Runtime);
        sb.timeline = t.finish();
        Self::arm_lifetime(&sb, spec);
        Ok(sb)
    }

    /// The image store: the configured one, else the default, opened once.
    pub(crate) fn image_store(&self) -> Result<sandbox_image::ImageStore> {
        match &self.cfg.images {
            Some(s) => Ok(s.clone()),
            None => sandbox_image::ImageStore::shared_default().map_err(|e| e.into_core(TIER)),
        }
    }

    /// Image phase: the spec's root resolved — its `rootfs` directory, or its image found in
    /// the cache or pulled (with the user its config names).
    async fn root_of(&self, spec: &SandboxSpec) -> Result<Root> {
        if let Some(dir) = &spec.rootfs {
            let dir = dir
                .canonicalize()
                .map_err(|e| Error::io_path("resolve the rootfs directory", dir, e))?;
            return Ok(Root {
                layers: vec![dir],
                ..Root::default()
            });
        }
        let Some(r) = &spec.image else {
            return Ok(Root::default());
        };
        let image = self
            .image_store()?
            .ensure(r)
            .await
            .map_err(|e| e.into_core(TIER))?;
        let user = image.user_ids().map_err(|e| e.into_core(TIER))?;
        if user != (0, 0) && !is_root() {
            return Err(Error::unsupported(
                TIER,
                format!(
                    "running the image's user `{}` rootless (only uid 0 is mapped into a \
                     rootless sandbox; run as root, or use an image without `User`)",
                    image.config().user.as_deref().unwrap_or("")
                ),
            ));
        }
        Ok(Root {
            layers: image.layers().to_vec(),
            user: Some(user),
            image: Some(image),
        })
    }

    /// Allocation phase: the sandbox's id and uid/gid mapping, its egress link prepared,
    /// its init started (a spare, or cloned by the zygote) with its setup planned and
    /// queued, and its cgroups made (in parallel) and joined.
    async fn allocate(
        &self,
        spec: &SandboxSpec,
        enforcer: Option<Arc<dyn EgressEnforcer>>,
        with_cgroups: bool,
        upper: Option<&[u8]>,
        root: Root,
        secrets: &ResolvedSecrets,
    ) -> Result<Allocation> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let rootless = !is_root();
        let one_shot = spawn::one_shot();
        // A rootfs directory is an image: commands run as its root (uid 0 inside, with no
        // capabilities, like rootless mode), which owns its files through the idmapping.
        // An image's `User` (a non-root one) runs commands as that user instead.
        let (image_uid, image_gid) = root.user.unwrap_or((0, 0));
        let stay_root = rootless || (crate::own_root(spec) && image_uid == 0);
        let (user, group) = if stay_root {
            (0, 0)
        } else if crate::own_root(spec) {
            (image_uid, image_gid)
        } else {
            (spawn::SANDBOX_USER, spawn::SANDBOX_USER)
        };
        // As root, a host uid range no other live sandbox on this host has (see `slots`).
        let lease = if rootless {
            None
        } else {
            let fallback = u32::try_from(
                self.slot.fetch_add(1, Ordering::Relaxed) % u64::from(crate::slots::SLOTS),
            )
            .unwrap_or(0);
            Some(
                crate::slots::lease(self.cfg.uid_base, fallback)
                    .map_err(|e| Error::backend_caused(TIER, "leasing a host uid range", e))?,
            )
        };
        let mut ids = match &lease {
            None => IdMap {
                host_root: nix::unistd::geteuid().as_raw(),
                host_root_gid: nix::unistd::getegid().as_raw(),
                count: 1,
                rootless: true,
                user_override: None,
            },
            Some(l) => {
                let base = self.cfg.uid_base + l.slot() * 65536;
                IdMap {
                    host_root: base,
                    host_root_gid: base,
                    count: 65536,
                    rootless: false,
                    user_override: None,
                }
            }
        };
        // A host-directory workspace: an idmapped mount owned by the command user (or a
        // fallback, see `workspace_mount`), made before the init starts (a fallback may
        // change its maps).
        let WorkspaceMount {
            tree: ws_tree,
            user_override,
            setid_guard,
        } = self.workspace_mount(spec, &ids, (user, group))?;
        ids.user_override = user_override;
        let bpf = if setid_guard {
            &self.bpf_setid_guard
        } else {
            &self.bpf
        };
        // The plan and the seal are ready before the init starts: both are queued behind the
        // bootstrap, and the init runs them in order, stopping at the first failure.
        let egress = match enforcer {
            Some(e) => {
                let plan = e.prepare(&id, &spec.network)?;
                Some((e, plan))
            }
            None => None,
        };
        // From here on, a failed create must give the prepared link back.
        let release = EgressRelease(egress.as_ref().map(|(e, _)| (e.clone(), id.clone())));
        // Proxy-held secrets: placeholders for the environment, and the interception CA
        // added to the certificates the sandbox trusts (`/etc/agent-sandbox-ca.crt`).
        let proxied = secrets.proxied();
        let secret_plan = match (&egress, proxied.is_empty()) {
            (_, true) => None,
            (Some((e, _)), false) => Some(e.bind_secrets(&id, &proxied)?),
            (None, false) => {
                return Err(Error::unsupported(
                    TIER,
                    "proxy-held secrets without an egress enforcer (plug one in with \
                     ContainerBackendBuilder::egress)",
                ))
            }
        };
        let ca_bundle = secret_plan.as_ref().map(|p| p.ca_bundle(&root.layers));
        let resolv = egress
            .as_ref()
            .map(|(_, plan)| plan.resolv_conf.clone())
            .unwrap_or_else(|| network::DEFAULT_RESOLV_CONF.to_string());
        // As root, a host-tools root without spec mounts or an egress link (whose
        // `resolv.conf` is the sandbox's own) starts from a template (see
        // `rootfs::template_ops`), built once per process for each set of `/etc` files.
        // A host-directory workspace reaches a template-mode init as the detached mount
        // made above, from our current view (see `rootfs::template_fits`); without one, the
        // classic setup binds the directory instead.
        let fits = !rootless
            && egress.is_none()
            && rootfs::template_fits(spec)
            && (ws_tree.is_some() || matches!(spec.workspace, Workspace::Empty));
        let template = if fits {
            spawn::template_root(rootfs::etc_files(
                user,
                spec.user_name_and_home(),
                &self.cfg.hostname,
                &resolv,
            ))
        } else {
            None
        };
        let workspace_fd = ws_tree.is_some();
        // An own root whose layers go over as idmapped mounts (fds: see `spawn::spawn_init`)
        // needs no view of the host's paths beyond `/dev`: such a create may take the
        // zygote's spare init (cloned in its template namespace) as host-tools creates do,
        // once this backend has seen layers idmapped here. Spec mounts and host-directory
        // workspaces keep the library's own namespace.
        let spare_ns = !rootless
            && egress.is_none()
            && !root.layers.is_empty()
            && spec.mounts.is_empty()
            && matches!(spec.workspace, Workspace::Empty)
            && self.layers_idmap.load(Ordering::Relaxed);
        // The init makes its namespaces (~0.5 ms; a spare has them already) while we plan
        // its setup.
        let starting = spawn::start_init(true, template.is_some() || spare_ns, &ids)
            .await
            .map_err(|e| Error::backend_caused(TIER, "starting the sandbox init", e))?;
        let planned = (|| {
            let plan = rootfs::Plan {
                spec,
                user,
                hostname: &self.cfg.hostname,
                resolv_conf: &resolv,
                ca_bundle: ca_bundle.as_deref(),
                caps: rootfs::tmpfs_caps(spec),
                landlock: if self.cfg.landlock {
                    self.landlock_abi
                } else {
                    None
                },
                host: if crate::own_root(spec) {
                    &[]
                } else {
                    self.host_ops.get_or_init(rootfs::host_ops)
                },
                // As root the library brings `lo` up meanwhile (see `network::loopback_up`),
                // unless the init (a spare) did so while it waited. A one-shot process
                // leaves it to the init's setup: a thread of its own for one sandbox costs
                // more (its start, `setns`, a wake-up) than it overlaps.
                loopback: rootless || one_shot,
                layers: &root.layers,
                workspace_fd,
            };
            let ops = match &template {
                Some(root) => rootfs::template_plan(&plan, root)?,
                None => rootfs::plan(&plan)?,
            };
            let enc = |ops: &[proto::Op]| {
                let mut e = proto::Enc::default();
                e.ops(ops);
                e.0
            };
            let seal = enc(&rootfs::seal_ops(
                self.cfg.seccomp.then_some(bpf.as_slice()),
            ));
            // Queued behind the bootstrap: everything, or (restoring an upper layer) only the
            // preparation; the rest follows once the upper layer is filled.
            let (queued, later): (Vec<Vec<u8>>, Vec<Vec<u8>>) = match upper {
                Some(_) if crate::own_root(spec) => {
                    (vec![enc(&ops.prep)], vec![enc(&ops.main), seal])
                }
                _ => (vec![enc(&ops.all()), seal], Vec::new()),
            };
            // As root the layers go over idmapped (see `spawn::spawn_init`).
            let lower: Vec<PathBuf> = if rootless {
                Vec::new()
            } else {
                root.layers.clone()
            };
            Ok((queued, later, lower))
        })();
        let (queued, later, lower): (Vec<Vec<u8>>, Vec<Vec<u8>>, Vec<PathBuf>) = match planned {
            Ok(p) => p,
            Err(e) => {
                spawn::abandon(starting);
                return Err(e);
            }
        };
        // The cgroups are made in parallel with the init's start-up (the job is ~0.3 ms),
        // started once the setup is planned so the init gets a CPU first (on 2 CPUs a third
        // busy thread delayed its start). The init joins them itself (see `spawn::CgroupJob`
        // for why) before it starts anything.
        let cg_job = {
            let host = self.host.clone();
            let (name, limits) = (cgroup_name(&id), spec.limits.clone());
            let job = move || {
                if !with_cgroups {
                    return Ok(None);
                }
                let c = host
                    .create(&name, &limits)
                    .map_err(spawn::SpawnError::CreateCgroup)?;
                let mut files = Vec::new();
                for p in c.join_files() {
                    match std::fs::OpenOptions::new().write(true).open(&p) {
                        Ok(f) => files.push(std::os::fd::OwnedFd::from(f)),
                        Err(source) => {
                            c.remove(std::time::Duration::from_millis(500));
                            return Err(spawn::SpawnError::OpenCgroupFile { path: p, source });
                        }
                    }
                }
                Ok(Some((c, files)))
            };
            // A one-shot process makes them right here (the init starts up meanwhile in a
            // process of its own): a blocking-pool thread for one job costs its start and
            // two wake-ups, which on a busy host each wait for a CPU.
            if one_shot {
                let r = job();
                tokio::spawn(async move { r })
            } else {
                tokio::task::spawn_blocking(job)
            }
        };
        let requests: Vec<&[u8]> = queued.iter().map(Vec::as_slice).collect();
        let spawned = spawn::spawn_init(starting, &ids, &requests, &lower, ws_tree, cg_job)
            .await
            .map_err(|e| Error::backend_caused(TIER, "bootstrapping the sandbox init", e))?;
        let pid = spawned.pid;
        let lo = (!rootless && !one_shot && !spawned.lo_up).then(|| network::loopback_up(pid));
        if !lower.is_empty() {
            if spawned.idmapped {
                self.layers_idmap.store(true, Ordering::Relaxed);
            } else {
                // Layers then go over as paths: the library's own namespace sees them best.
                self.layers_idmap.store(false, Ordering::Relaxed);
                tracing::warn!(sandbox = %id, "root filesystem layers used without idmapping");
            }
        }
        Ok(Allocation {
            id,
            ids,
            lease,
            user,
            stay_root,
            group,
            image: root.image,
            egress,
            secret_plan,
            release,
            pid,
            ctl: spawned.ctl,
            cgroup: spawned.cgroup,
            queued: spawned.queued,
            later,
            lo,
        })
    }

    /// Filesystem phase: the init's setup done (root filesystem and workspace, a
    /// snapshot's upper layer restored in between, loopback up), then the sandbox's handle
    /// and state record. Returns the sandbox with its egress link and the link's release.
    async fn filesystem(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
        upper: Option<&[u8]>,
        mut a: Allocation,
    ) -> Result<(ContainerSandbox, Egress, EgressRelease)> {
        Self::finish_setup(&mut a, upper).await?;
        self.handle(spec, secrets, a)
    }

    /// Waits for the init's queued setup, sends the rest once a snapshot's upper layer is
    /// unpacked, and waits for `lo`; on failure, kills the init and removes its cgroups.
    async fn finish_setup(a: &mut Allocation, upper: Option<&[u8]>) -> Result<()> {
        let (pid, ctl, ids, user, later) = (a.pid, &a.ctl, &a.ids, a.user, &a.later);
        let gone = || std::io::Error::new(std::io::ErrorKind::BrokenPipe, "sandbox init is gone");
        let queued = std::mem::take(&mut a.queued);
        let mut ids_used: Vec<u64> = queued.iter().map(|(i, _)| *i).collect();
        let done = async {
            let wait = |mut rx: tokio::sync::mpsc::UnboundedReceiver<ctl::Reply>| async move {
                let r = rx
                    .recv()
                    .await
                    .ok_or_else(gone)
                    .map_err(|e| Error::io("set up the sandbox", e))?;
                check_reply(&r, "set up the sandbox")
            };
            for (_, rx) in queued {
                wait(rx).await?;
            }
            if !later.is_empty() {
                if let Some(tar) = upper {
                    restore_upper(pid, tar, ids, user)?;
                }
                for next in later {
                    let (rid, rx) = ctl.register();
                    ids_used.push(rid);
                    ctl.send(proto::MSG_SETUP, rid, next, &[])
                        .await
                        .map_err(|e| Error::io("set up the sandbox", e))?;
                    wait(rx).await?;
                }
            }
            Ok::<(), Error>(())
        };
        let mut done = done.await;
        if let (Ok(()), Some(lo)) = (&done, a.lo.take()) {
            done = match lo.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(Error::io("bring up the sandbox's loopback interface", e)),
                Err(e) => Err(Error::backend_caused(
                    TIER,
                    "the loopback thread vanished",
                    e,
                )),
            };
        }
        for rid in ids_used {
            ctl.unregister(rid);
        }
        if let Err(e) = done {
            spawn::reap(pid, true);
            if let Some(c) = &a.cgroup {
                c.remove(std::time::Duration::from_millis(500));
            }
            return Err(e);
        }
        Ok(())
    }

    /// The sandbox's handle (its environment, every resource it owns; dropping it tears
    /// them down) and its state record.
    fn handle(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
        a: Allocation,
    ) -> Result<(ContainerSandbox, Egress, EgressRelease)> {
        let Allocation {
            id,
            ids,
            lease,
            user,
            stay_root,
            group,
            image,
            egress,
            secret_plan,
            release,
            pid,
            ctl,
            cgroup,
            ..
        } = a;
        // The image's `Env` first: the spec's own variables override it.
        let mut env = match &image {
            Some(i) => i.config().environment(spec.base_env()),
            None => spec.base_env(),
        };
        let cwd = image
            .as_ref()
            .and_then(|i| i.config().default_cwd())
            .unwrap_or("/workspace")
            .to_owned();
        for (k, v) in secrets.env() {
            env.insert(k.to_string(), v.to_string());
        }
        env.entry("PATH".into()).or_insert_with(|| {
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()
        });
        env.insert("HOME".into(), "/workspace".into());
        env.entry("LANG".into()).or_insert_with(|| "C.UTF-8".into());
        if let Some((_, plan)) = &egress {
            for (k, v) in &plan.env {
                env.insert(k.clone(), v.clone());
            }
        }
        if let Some(p) = &secret_plan {
            for (var, placeholder) in &p.env {
                env.insert(var.clone(), placeholder.clone());
            }
            for var in sandbox_core::egress::CA_BUNDLE_VARS {
                env.insert(var.to_string(), sandbox_core::egress::CA_BUNDLE_PATH.into());
            }
        }
        let state_file = self
            .cfg
            .state_dir
            .as_ref()
            .map(|d| d.join(cgroup_name(&id)));
        let inner = Arc::new(Inner {
            watches: Default::default(),
            id: id.clone(),
            spec: spec.clone(),
            env,
            redactor: secrets.redactor(),
            born: Instant::now(),
            life: Lifecycle::new(id.clone()),
            pid,
            ctl,
            cgroup,
            ids,
            _lease: lease,
            user,
            group,
            stay_root,
            cwd,
            image,
            egress: egress.as_ref().map(|(e, _)| e.clone()),
            state_file,
            timer: Mutex::new(None),
            procs: Default::default(),
            ports: Default::default(),
        });
        // From here on, dropping `sb` tears everything down.
        let sb = ContainerSandbox {
            inner,
            timeline: Default::default(),
        };
        if let Some(f) = &sb.inner.state_file {
            let dirs = sb.inner.cgroup.iter().flat_map(|c| c.dirs()).cloned();
            let rec = crate::StateRecord::new(pid, dirs.collect()).render();
            std::fs::write(f, rec).map_err(|e| Error::io_path("write state record", f, e))?;
        }
        Ok((sb, egress, release))
    }

    /// Network phase: attaches the sandbox's network namespace to its egress link, when
    /// its policy needs one. Returns whether it did.
    async fn network(sb: &ContainerSandbox, egress: &Egress) -> Result<bool> {
        match egress {
            Some((e, plan)) => {
                e.attach(plan, sb.inner.pid).await?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// After the phases: destroys the sandbox when its lifetime runs out, even if nobody
    /// calls it.
    fn arm_lifetime(sb: &ContainerSandbox, spec: &SandboxSpec) {
        let weak = Arc::downgrade(&sb.inner);
        let life = spec.limits.lifetime();
        let timer = tokio::spawn(async move {
            tokio::time::sleep(life).await;
            if let Some(inner) = weak.upgrade() {
                let _ = tokio::task::spawn_blocking(move || {
                    inner.terminate(sandbox_core::LIFETIME_REACHED)
                })
                .await;
            }
        });
        *sb.inner
            .timer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(timer.abort_handle());
    }
}

/// Checks a setup reply: `REP_OK`, or the init's error (`ENOSPC`/`ENOMEM` as
/// [`Error::ResourceExhausted`]).
fn check_reply(r: &ctl::Reply, what: &str) -> Result<()> {
    match r.kind {
        proto::REP_OK => Ok(()),
        proto::REP_ERR => {
            let mut d = proto::Dec::new(&r.payload);
            let _ = d.u32();
            let errno = d.i32().unwrap_or(0);
            let msg = d.str().unwrap_or_default();
            if errno == libc::ENOSPC || errno == libc::ENOMEM {
                return Err(Error::ResourceExhausted {
                    what: format!("{what}: {msg}"),
                });
            }
            Err(Error::backend(TIER, format!("{what}: {msg}")))
        }
        k => Err(Error::backend(
            TIER,
            format!("{what}: unexpected reply {k}"),
        )),
    }
}

/// Unpacks a snapshot's `upper.tar` into the overlay upper layer the init keeps open (before
/// the overlay is mounted), as the sandbox's root.
fn restore_upper(pid: libc::pid_t, tar: &[u8], ids: &IdMap, user: u32) -> Result<()> {
    use std::os::fd::AsFd;
    let p = format!("/proc/{pid}/fd/{}", proto::UPPER_FD);
    let dir = std::fs::File::open(&p).map_err(|e| Error::io(format!("open {p}"), e))?;
    let owner = (!ids.rootless).then(|| files::Owner {
        uid: ids.host_uid(user),
        gid: ids.host_gid(user),
    });
    let _ids = files::FsIds::switch(owner);
    files::unpack_upper(dir.as_fd(), tar, owner)
}

/// Gives a prepared egress link back if a create fails before the sandbox owns it.
struct EgressRelease(Option<(Arc<dyn EgressEnforcer>, String)>);

impl EgressRelease {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for EgressRelease {
    fn drop(&mut self) {
        if let Some((e, id)) = self.0.take() {
            e.detach_in_background(&id);
        }
    }
}
