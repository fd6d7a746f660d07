//! One gVisor sandbox: its state directory, bundle, workspace and runsc container.
//!
//! This module creates, restores and tears sandboxes down; [`exec`] runs their commands and
//! [`snapshot`] checkpoints them.

mod exec;
mod kept;
mod ports;
mod process;
mod snapshot;

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

/// The default identity of the workload when the sandbox owns its workspace.
const SANDBOX_ID: Identity = Identity {
    uid: 1000,
    gid: 1000,
};

/// A running gVisor sandbox.
pub struct GvisorSandbox {
    inner: Arc<Inner>,
    timeline: Timeline,
}

struct Inner {
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
    /// The sandbox's cgroup paths (v1 memory and pids hierarchies), to read OOM kills and
    /// pids-limit hits from.
    cgroup: Mutex<(Option<String>, Option<String>)>,
    /// The sandbox process's cgroup paths in every hierarchy (`/proc/PID/cgroup`), read
    /// while it runs: its teardown removes those named after the sandbox itself.
    cgroup_paths: Mutex<Vec<String>>,
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

impl GvisorSandbox {
    pub(crate) async fn create(
        backend: &GvisorBackend,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
        restore: Option<Restore>,
    ) -> Result<Self> {
        spec.validate_on_host()?;
        // Proxy-held secrets: placeholders and the interception CA, from the egress proxy.
        let proxied = secrets.proxied();
        if !proxied.is_empty() && backend.config.egress.is_none() {
            return Err(Error::unsupported(
                TIER,
                "proxy-held secrets without an egress enforcer (plug one in with \
                 GvisorBackendBuilder::egress; the facade's Runtime does)",
            ));
        }
        let enforcer = sandbox_core::egress::enforcer_for(
            TIER,
            backend.config.egress.as_ref(),
            &spec.network,
        )?;
        if spec.language == Language::Wasm {
            return Err(Error::unsupported(
                TIER,
                "WebAssembly modules (use the wasm tier)",
            ));
        }
        // Called directly (not through the facade), the backend still refuses a language
        // its capabilities do not list (JavaScript snippets: the wasm tier's QuickJS).
        if !sandbox_core::Backend::capabilities(backend).supports_language(spec.language) {
            return Err(Error::unsupported(
                TIER,
                format!("the {} language", spec.language),
            ));
        }
        let mut t = TimelineRecorder::start();
        // The image (found in the cache, or pulled): its layers are the root's lower layers.
        let image = match &spec.image {
            Some(r) => {
                let image = backend
                    .image_store()?
                    .ensure(r)
                    .await
                    .map_err(|e| e.into_core(TIER))?;
                t.mark(Phase::Image);
                Some(image)
            }
            None => None,
        };
        let image_user = match &image {
            Some(i) => Some(i.user_ids().map_err(|e| e.into_core(TIER))?),
            None => None,
        };
        let lower: Vec<PathBuf> = match (&spec.rootfs, &image) {
            (Some(dir), _) => vec![dir.clone()],
            (None, Some(i)) => i.layers().to_vec(),
            (None, None) => Vec::new(),
        };
        let b = backend.clone();
        let r = tokio::task::spawn_blocking(move || b.resolve())
            .await
            .map_err(|e| Error::backend_caused(TIER, "the probe task", e))??;
        // What crashed processes left in this state directory, and a watchdog for what
        // this one might leave (once per process).
        stale::guard_state_dir(&r.state_dir, &r.info.path);
        let id = format!("as-{}", &uuid::Uuid::new_v4().simple().to_string()[..20]);
        let dir = r.state_dir.join(&id);
        let bundle_dir = dir.join("bundle");
        let runsc_root = dir.join("runsc");
        let scratch_dir = dir.join("scratch");
        std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        // Held until the sandbox is gone: if this process dies first, a later sweep knows
        // the directory (and the runsc processes it names) have no owner left.
        let owner = stale::Owner::claim(&dir).map_err(io("lock", &dir.join("owner")))?;
        std::fs::create_dir_all(&bundle_dir).map_err(io("create", &bundle_dir))?;
        std::fs::create_dir_all(&runsc_root).map_err(io("create", &runsc_root))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))
            .map_err(io("chmod", &dir))?;
        let (workspace, who, tmpfs) = match &spec.workspace {
            Workspace::Empty => {
                let ws = dir.join("workspace");
                std::fs::create_dir_all(&ws).map_err(io("create", &ws))?;
                // An image runs as its own user (root unless its config names one).
                let fresh = image_user
                    .map(|(uid, gid)| Identity { uid, gid })
                    .unwrap_or(SANDBOX_ID);
                (ws, restore.as_ref().map_or(fresh, |r| r.who), true)
            }
            Workspace::HostDir { path, .. } => {
                use std::os::unix::fs::MetadataExt;
                let md = std::fs::metadata(path).map_err(io("stat", path))?;
                (
                    path.clone(),
                    Identity {
                        uid: md.uid(),
                        gid: md.gid(),
                    },
                    false,
                )
            }
            other => return Err(Error::unsupported(TIER, format!("the workspace {other:?}"))),
        };
        // The image's `Env` first: the spec's own variables override it.
        let mut env = match &image {
            Some(i) => i.config().environment(spec.base_env()),
            None => spec.base_env(),
        };
        for (k, v) in secrets.env() {
            env.insert(k.to_string(), v.to_string());
        }
        env.entry("PATH".into())
            .or_insert_with(|| "/usr/local/bin:/usr/bin:/bin".into());
        env.entry("HOME".into())
            .or_insert_with(|| "/workspace".into());
        env.entry("LANG".into()).or_insert_with(|| "C.UTF-8".into());
        let netns = match enforcer {
            Some(_) => Some(Runsc::new_netns()?),
            None => None,
        };
        let egress = match enforcer {
            Some(e) => {
                let plan = e.prepare(&id, &spec.network)?;
                for (k, v) in &plan.env {
                    env.insert(k.clone(), v.clone());
                }
                Some((e, plan))
            }
            None => None,
        };
        // The placeholders in the environment, and the certificates the sandbox trusts (put
        // in place by `start`).
        let ca_bundle = match (&egress, proxied.is_empty()) {
            (_, true) => None,
            (Some((e, _)), false) => {
                let plan = match e.bind_secrets(&id, &proxied) {
                    Ok(p) => p,
                    Err(err) => {
                        e.detach(&id).await;
                        return Err(err);
                    }
                };
                for (var, placeholder) in &plan.env {
                    env.insert(var.clone(), placeholder.clone());
                }
                for var in sandbox_core::egress::CA_BUNDLE_VARS {
                    env.insert(var.into(), sandbox_core::egress::CA_BUNDLE_PATH.into());
                }
                Some(plan.ca_bundle(&lower))
            }
            // `validate` refuses proxy-held secrets under deny-all, the only policy without
            // an enforcer.
            (None, false) => {
                return Err(Error::unsupported(
                    TIER,
                    "proxy-held secrets under a deny-all policy (allow the bound hosts)",
                ))
            }
        };
        let inner = Arc::new(Inner {
            id: id.clone(),
            spec: spec.clone(),
            runsc: Runsc {
                bin: r.info.path.clone(),
                root: runsc_root,
                platform: r.platform,
                overlay_root: !lower.is_empty(),
                netns,
            },
            engine: r.info.version.clone(),
            dir,
            bundle: bundle_dir,
            workspace,
            workspace_tmpfs: tmpfs,
            scratch: scratch_dir,
            who,
            env,
            cwd: image
                .as_ref()
                .and_then(|i| i.config().default_cwd())
                .unwrap_or("/workspace")
                .to_owned(),
            lower,
            image,
            redactor: secrets.redactor(),
            pids: Mutex::new(Vec::new()),
            cgroup: Mutex::new((None, None)),
            cgroup_paths: Mutex::new(Vec::new()),
            life: Lifecycle::new(id.clone()),
            born: Instant::now(),
            seq: AtomicU64::new(0),
            direct: AtomicBool::new(!backend.config.runsc_exec),
            lifecycle: Arc::new(RwLock::new(())),
            egress,
            ca_bundle,
            _owner: owner,
            procs: Default::default(),
            kept: Default::default(),
            ports: sandbox_core::Ports::new(),
            relay: AtomicBool::new(false),
            relays: Default::default(),
        });
        t.mark(Phase::Allocation);
        // From here on, a failure tears down whatever was made.
        match inner.start(restore, &mut t).await {
            Ok(()) => Ok(GvisorSandbox {
                inner,
                timeline: t.finish(),
            }),
            Err(e) => {
                if let Some((enf, _)) = &inner.egress {
                    enf.detach(&inner.id).await;
                }
                let i = Arc::clone(&inner);
                let _ = tokio::task::spawn_blocking(move || i.teardown("its start failed")).await;
                Err(e)
            }
        }
    }

    pub(crate) async fn restore(
        backend: &GvisorBackend,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Self> {
        let m = store.manifest_for(id, TIER).await?;
        let b = backend.clone();
        let r = tokio::task::spawn_blocking(move || b.resolve())
            .await
            .map_err(|e| Error::backend_caused(TIER, "the probe task", e))??;
        if m.engine != r.info.version {
            return Err(SnapshotError::Incompatible {
                id: id.clone(),
                reason: format!(
                    "taken with `{}`, this host has `{}`",
                    m.engine, r.info.version
                ),
            }
            .into());
        }
        let who = Identity {
            uid: meta_u32(&m.metadata, "uid").unwrap_or(SANDBOX_ID.uid),
            gid: meta_u32(&m.metadata, "gid").unwrap_or(SANDBOX_ID.gid),
        };
        // Fetch (and verify) everything before anything is started.
        let image = store.artifact(id, "checkpoint.tar").await?;
        let workspace = match m.spec.workspace {
            Workspace::Empty => Some(store.artifact(id, "workspace.tar").await?),
            _ => None,
        };
        let scratch = match m.artifacts.contains_key(SCRATCH_TAR) {
            true => Some(store.artifact(id, SCRATCH_TAR).await?),
            false => None,
        };
        let processes: Vec<kept::Recorded> = match m.metadata.get(snapshot::META_PROCESSES) {
            Some(v) => serde_json::from_str(v).map_err(|e| SnapshotError::Corrupt {
                id: id.clone(),
                what: format!("metadata `{}`: {e}", snapshot::META_PROCESSES),
            })?,
            None => Vec::new(),
        };
        let sb = Self::create(
            backend,
            &m.spec,
            secrets,
            Some(Restore {
                image: image.to_vec(),
                workspace,
                scratch,
                who,
            }),
        )
        .await?;
        // The snapshot's background processes run on in the copy: attach to them.
        sb.inner.adopt_kept(processes).await;
        Ok(sb)
    }
}

/// Mounts a tmpfs (`nosuid`, `nodev`) named `source` on `target`, capped by `cap`, with the
/// extra mount options `opts`.
fn mount_tmpfs(source: &str, target: &Path, cap: sandbox_core::TmpfsCap, opts: &str) -> Result<()> {
    use nix::mount::{mount, MsFlags};
    let data = format!("size={},nr_inodes={},{opts}", cap.bytes, cap.inodes);
    mount(
        Some(source),
        target,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(data.as_str()),
    )
    .map_err(|e| Error::io_path("mount a tmpfs on", target, e.into()))
}

/// The snapshot artifact holding `/tmp` and `/dev/shm` (the scratch tmpfs).
const SCRATCH_TAR: &str = "scratch.tar";

/// What a restore brings into `create`.
pub(crate) struct Restore {
    image: Vec<u8>,
    workspace: Option<bytes::Bytes>,
    /// `/tmp` and `/dev/shm` (absent from snapshots older than host-backed scratch mounts).
    scratch: Option<bytes::Bytes>,
    who: Identity,
}

fn meta_u32(m: &BTreeMap<String, String>, k: &str) -> Option<u32> {
    m.get(k)?.parse().ok()
}

impl Inner {
    async fn start(&self, restore: Option<Restore>, t: &mut TimelineRecorder) -> Result<()> {
        if self.workspace_tmpfs {
            self.mount_workspace()?;
        }
        self.mount_scratch()?;
        let who = self.who;
        if self.lower.is_empty() {
            // With the published-port relay in it.
            bundle::write_rootfs(&self.bundle, who)?;
            self.relay.store(true, Ordering::SeqCst);
        }
        let cgroup = stale::cgroup_name(&self.id);
        let resolv = match &self.egress {
            Some((_, plan)) => {
                let p = self.dir.join("resolv.conf");
                std::fs::write(&p, &plan.resolv_conf).map_err(io("write", &p))?;
                Some(p)
            }
            None => None,
        };
        // A caller's rootfs lacking the scratch mount points is seen through an overlay
        // that has them (see `rootfs_view`).
        let view = self.rootfs_view();
        if view.is_none() && self.lower.len() > 1 {
            return Err(Error::backend(
                TIER,
                "could not merge the image's layers into an overlay view (see the log line \
                 before this one)",
            ));
        }
        let mut files: Vec<(&str, &Path)> = Vec::new();
        if let Some(p) = &resolv {
            files.push(("/etc/resolv.conf", p));
        }
        // Proxy-held secrets: the certificates the sandbox trusts, at our path and over the
        // root's system bundle. The host-tools root binds one file of ours at both (its
        // `/etc/ssl` is the host's, bound read-only); an image's or a caller's root gets
        // them written into its overlay view (never into a layer).
        let ca_file = self.dir.join("ca-bundle.crt");
        if let Some(text) = &self.ca_bundle {
            match (&view, self.lower.is_empty()) {
                (_, true) => {
                    std::fs::write(&ca_file, text).map_err(io("write", &ca_file))?;
                    std::fs::set_permissions(&ca_file, std::fs::Permissions::from_mode(0o644))
                        .map_err(io("chmod", &ca_file))?;
                    let point = self
                        .bundle
                        .join("rootfs")
                        .join(sandbox_core::egress::CA_BUNDLE_PATH.trim_start_matches('/'));
                    std::fs::write(&point, b"").map_err(io("create", &point))?;
                    files.push((sandbox_core::egress::CA_BUNDLE_PATH, &ca_file));
                    let system = Path::new("/").join(sandbox_core::egress::SYSTEM_CA_BUNDLE);
                    if std::fs::symlink_metadata(&system).is_ok_and(|m| m.is_file()) {
                        files.push(("/etc/ssl/certs/ca-certificates.crt", &ca_file));
                    }
                }
                (Some(root), false) => bundle::write_ca_bundle(root, text)
                    .map_err(|e| Error::io_path("put the CA bundle into", root, e))?,
                (None, false) => {
                    return Err(Error::backend(
                        TIER,
                        "could not make the overlay view of the root that the certificates \
                         of proxy-held secrets go into (see the log line before this one)",
                    ))
                }
            }
        }
        let spec = match &view {
            Some(root) => std::borrow::Cow::Owned({
                let mut spec = self.spec.clone();
                spec.rootfs = Some(root.clone());
                spec.image = None;
                spec
            }),
            None if self.spec.image.is_some() => std::borrow::Cow::Owned({
                // A one-layer image whose layer needs no view: that layer is the root.
                let mut spec = self.spec.clone();
                spec.rootfs = self.lower.first().cloned();
                spec.image = None;
                spec
            }),
            None => std::borrow::Cow::Borrowed(&self.spec),
        };
        let cfg = bundle::config(
            &spec,
            who,
            &self.workspace,
            self.read_only(),
            Some(&self.scratch),
            &cgroup,
            &files,
        )?;
        bundle::save(&cfg, &self.bundle)?;
        let image_dir = self.dir.join("restore-image");
        if let Some(r) = &restore {
            if let Some(ws) = &r.workspace {
                fsnap::unpack_into(ws, &self.workspace)?;
            }
            if let Some(sc) = &r.scratch {
                fsnap::unpack_into(sc, &self.scratch)?;
            }
            std::fs::create_dir_all(&image_dir).map_err(io("create", &image_dir))?;
            fsnap::unpack_into(&r.image, &image_dir)?;
        }
        t.mark(Phase::Filesystem);
        let mut cmd = self.runsc.async_command();
        match &restore {
            None => cmd
                .args(["run", "--detach", "--bundle"])
                .arg(&self.bundle)
                .arg(&self.id),
            Some(_) => cmd
                .args(["restore", "--detach", "--bundle"])
                .arg(&self.bundle)
                .arg("--image-path")
                .arg(&image_dir)
                .arg(&self.id),
        };
        let what = if restore.is_some() { "restore" } else { "run" };
        run_detached(cmd, &self.dir.join("runsc.log"), what).await?;
        let boot = self.track_processes().await;
        self.attach_network(boot).await?;
        if self.egress.is_some() {
            t.mark(Phase::Network);
        }
        if restore.is_some() {
            let _ = std::fs::remove_dir_all(&image_dir);
            t.mark(Phase::Restore);
        } else {
            t.mark(Phase::Runtime);
        }
        Ok(())
    }

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

    /// For a caller's rootfs without a `tmp` or `dev/shm` directory, or with glibc's loader
    /// (whose programs need the `statx` shim, see [`bundle::STATX_SHIM_PATH`]): a host
    /// overlay of it (`view/root` of the state directory; upper and work directories beside
    /// it) with those directories made and the shim added to its `/etc/ld.so.preload`, so
    /// `/tmp` and `/dev/shm` can be bind mounts of the scratch tmpfs (runsc would create a
    /// bind mount's point in the directory itself, which is never written). runsc's
    /// in-memory overlay still takes every write of the sandbox. `None` (and gVisor's own
    /// tmpfs there, no shim) when no view is needed or it cannot be made.
    fn rootfs_view(&self) -> Option<PathBuf> {
        // The topmost layer first, as overlayfs wants them; an image of several layers
        // always needs the view (it is what merges them).
        if self.lower.is_empty() {
            return None;
        }
        let points = bundle::SCRATCH_MOUNTS.map(|(dst, _)| dst.trim_start_matches('/'));
        let shim =
            bundle::statx_shim().filter(|_| self.lower.iter().any(|l| bundle::needs_statx_shim(l)));
        // Always a view: the published-port relay goes into it (as proxy-held secrets'
        // certificates do, see `start`).
        let layers: Option<Vec<&str>> = self.lower.iter().rev().map(|l| l.to_str()).collect();
        let lower_s = layers?.join(":");
        let view = self.dir.join("view");
        let (upper, work, root) = (view.join("upper"), view.join("work"), view.join("root"));
        let made = (|| -> std::io::Result<()> {
            for d in [&upper, &work, &root] {
                std::fs::create_dir_all(d)?;
            }
            // `lowerdir` cannot express these characters; the state directory's path is ours.
            if self
                .lower
                .iter()
                .any(|l| l.to_string_lossy().contains([',', ':', '\\']))
            {
                return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            }
            let data = format!(
                "lowerdir={lower_s},upperdir={},workdir={}",
                upper.display(),
                work.display()
            );
            nix::mount::mount(
                Some("agent-sandbox-rootfs"),
                &root,
                Some("overlay"),
                nix::mount::MsFlags::empty(),
                Some(data.as_str()),
            )?;
            for d in points {
                let p = root.join(d);
                if !p.is_dir() {
                    std::fs::create_dir_all(&p)?;
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o1777))?;
                }
            }
            // Without it no port can be published (`publish` says so); the view itself is
            // still good.
            match bundle::add_relay(&root) {
                Ok(()) => self.relay.store(true, Ordering::SeqCst),
                Err(e) => {
                    tracing::warn!(sandbox = %self.id, error = %e, "no port relay in the rootfs view")
                }
            }
            if let Some(shim) = shim {
                // Without it `ls -l` and `stat` fail as they always did here; the view
                // itself is still good.
                if let Err(e) = bundle::add_statx_shim(&root, shim) {
                    tracing::warn!(sandbox = %self.id, error = %e, "no statx shim in the rootfs view");
                }
            }
            Ok(())
        })();
        match made {
            Ok(()) => Some(root),
            Err(e) => {
                tracing::warn!(sandbox = %self.id, error = %e, "no overlay view of the rootfs: /tmp or /dev/shm stays gVisor's tmpfs (no file-count cap), no statx shim");
                let _ = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH);
                None
            }
        }
    }

    /// Mounts the scratch tmpfs and makes its `tmp/` and `shm/` (sticky, world-writable).
    fn mount_scratch(&self) -> Result<()> {
        let cap = crate::bundle::tmpfs_caps(&self.spec).scratch;
        std::fs::create_dir_all(&self.scratch).map_err(io("create", &self.scratch))?;
        mount_tmpfs("agent-sandbox-scratch", &self.scratch, cap, "mode=0755")?;
        for (_, sub) in bundle::SCRATCH_MOUNTS {
            let d = self.scratch.join(sub);
            std::fs::create_dir(&d).map_err(io("create", &d))?;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777))
                .map_err(io("chmod", &d))?;
        }
        Ok(())
    }

    fn mount_workspace(&self) -> Result<()> {
        let cap = crate::bundle::tmpfs_caps(&self.spec).disk;
        let owner = format!("mode=0755,uid={},gid={}", self.who.uid, self.who.gid);
        mount_tmpfs("agent-sandbox-ws", &self.workspace, cap, &owner)
    }

    /// Connects the sandbox's namespace (that of its `boot` process) to the egress enforcer.
    async fn attach_network(&self, boot: Option<i32>) -> Result<()> {
        let Some((e, plan)) = &self.egress else {
            return Ok(());
        };
        let Some(pid) = boot else {
            return Err(Error::backend(
                TIER,
                "the gVisor sandbox process was not found: cannot attach its network",
            ));
        };
        e.attach(plan, pid).await
    }

    /// Finds the runsc processes of this sandbox; returns the sandbox (`boot`) process.
    async fn track_processes(&self) -> Option<i32> {
        let needle = format!("--root={}", self.runsc.root.display());
        let pids = reaper::children_matching(&needle);
        // The sandbox process (`runsc-sandbox ... boot`) carries the container's cgroups.
        let boot = pids.iter().copied().find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| c.split(|b| *b == 0).any(|a| a == b"boot"))
                .unwrap_or(false)
        });
        let cg = match boot {
            Some(pid) => (
                cgroup_of(i64::from(pid), "memory"),
                cgroup_of(i64::from(pid), "pids"),
            ),
            None => (None, None),
        };
        // Recorded whatever panicked before: the teardown needs them.
        *lock(&self.pids) = pids;
        *lock(&self.cgroup) = cg;
        if let Some(pid) = boot {
            *lock(&self.cgroup_paths) = cgroup_paths(pid);
        }
        boot
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

    /// Ends the sandbox for `reason` (unless it ended already), deletes the container, reaps
    /// its processes, unmounts and removes the state. Idempotent: the first call tears down,
    /// one made meanwhile waits for it (see [`Lifecycle::release`]).
    fn teardown(&self, reason: &str) {
        self.life.release(reason, || {
            self.ports.clear();
            self.cleanup();
        });
    }

    /// Deletes the container and removes the host state. Safe to repeat.
    fn cleanup(&self) {
        if let Some((e, _)) = &self.egress {
            e.detach_in_background(&self.id);
        }
        self.delete_container();
        stale::unmount_all(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    fn delete_container(&self) {
        self.delete_container_with(true)
    }

    /// [`delete_container`](Self::delete_container) for a container that comes back under
    /// the same id (resume after a checkpoint): runsc's own state for the id must go, so
    /// `runsc delete` always runs (the fast path leaves that state to the removal of the
    /// sandbox's directory, which a resume keeps).
    pub(super) fn delete_container_for_resume(&self) {
        self.delete_container_with(false)
    }

    fn delete_container_with(&self, fast: bool) {
        let pids = lock(&self.pids).clone();
        // The sandbox and gofer processes go first, killed and reaped here: `delete` then
        // finds them gone instead of polling for them every 100 ms (see
        // `reaper::kill_children`); it still removes the cgroups and runsc's state. Bounded:
        // whatever is left is `delete`'s to kill, as before.
        let pids = reaper::kill_children(&pids, Duration::from_secs(2));
        // With them gone, what `delete` would still do is remove the sandbox's cgroups and
        // runsc's state (under `self.dir`, removed with it): done here when every cgroup
        // directory named after the sandbox goes at once (~20 ms of a runsc start saved);
        // anything else (a process left, a directory that will not go) is `delete`'s.
        if fast && pids.is_empty() && self.remove_cgroups() {
            return;
        }
        let mut cmd = self.runsc.command();
        cmd.args(["delete", "--force", &self.id])
            .stderr(Stdio::null());
        match cmd.spawn() {
            Ok(mut child) => {
                reaper::reap_while(&pids, Duration::from_secs(20), || {
                    matches!(child.try_wait(), Ok(Some(_)) | Err(_))
                });
                let _ = child.wait();
            }
            Err(e) => {
                tracing::warn!(sandbox = %self.id, error = %e, "runsc delete could not start")
            }
        }
    }
}

/// A mutex's guard, also after a panic elsewhere (every write here is one assignment): the
/// teardown never skips what they record.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Inner {
    /// Removes the sandbox's cgroup directories (those of the recorded paths, in every
    /// hierarchy under `/sys/fs/cgroup`, whose name is the sandbox's cgroup name: nothing
    /// else is ever removed). `true` when at least one was found and all of them went.
    fn remove_cgroups(&self) -> bool {
        let paths = lock(&self.cgroup_paths).clone();
        let name = stale::cgroup_name(&self.id);
        let ours: Vec<&String> = paths
            .iter()
            .filter(|p| Path::new(p).file_name().is_some_and(|f| *f == *name))
            .collect();
        if ours.is_empty() {
            return false;
        }
        let base = Path::new("/sys/fs/cgroup");
        let Ok(entries) = std::fs::read_dir(base) else {
            return false;
        };
        // The v2 root itself (a pure v2 host), and each hierarchy's mount under it (v1, and
        // hybrid's `unified`). Co-mounted controllers appear twice (`cpu` -> `cpu,cpuacct`):
        // real directories only.
        let roots = std::iter::once(base.to_path_buf()).chain(
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path()),
        );
        let mut removed = 0;
        for root in roots {
            for p in &ours {
                let dir = root.join(p.trim_start_matches('/'));
                match std::fs::remove_dir(&dir) {
                    Ok(()) => removed += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::debug!(sandbox = %self.id, dir = %dir.display(), error = %e, "cgroup not removed here; runsc delete will");
                        return false;
                    }
                }
            }
        }
        removed > 0
    }
}

/// Every cgroup path of `pid` (one per hierarchy), from `/proc/PID/cgroup`.
fn cgroup_paths(pid: i32) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return Vec::new();
    };
    let mut out: Vec<String> = text
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .map(str::to_string)
        .collect();
    out.sort();
    out.dedup();
    out
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

/// The cgroup path of `pid` in the v1 hierarchy that has `controller`.
fn cgroup_of(pid: i64, controller: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        ctrls
            .split(',')
            .any(|c| c == controller)
            .then(|| path.to_string())
    })
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

    async fn pause(&self) -> Result<()> {
        self.inner.alive()?;
        // Held across `runsc pause`: a concurrent resume waits for it, then resumes.
        let Some(step) = self.inner.life.begin(Transition::Pause).await? else {
            return Ok(());
        };
        let mut cmd = self.inner.runsc.async_command();
        cmd.args(["pause", &self.inner.id]);
        run_checked_async(cmd, "pause").await?;
        step.complete();
        Ok(())
    }

    async fn resume(&self) -> Result<()> {
        self.inner.alive()?;
        let Some(step) = self.inner.life.begin(Transition::Resume).await? else {
            return Ok(());
        };
        let mut cmd = self.inner.runsc.async_command();
        cmd.args(["resume", &self.inner.id]);
        run_checked_async(cmd, "resume").await?;
        step.complete();
        Ok(())
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
