//! Making a sandbox, new or from a snapshot: its state directory, identity, environment and
//! egress plan, then the container's start (its bundle, then `runsc run` or `runsc restore`).

use super::*;

/// The default identity of the workload when the sandbox owns its workspace.
const SANDBOX_ID: Identity = Identity {
    uid: 1000,
    gid: 1000,
};

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
            watches: Default::default(),
            id: id.clone(),
            spec: spec.clone(),
            runsc: Runsc {
                bin: r.info.path.clone(),
                root: runsc_root,
                platform: r.platform,
                overlay_root: !lower.is_empty(),
                leave_running: r.info.checkpoint_leaves_running(),
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
            boot: Mutex::new(None),
            cgroup: Mutex::new((None, None)),
            cgroup_paths: Mutex::new(Vec::new()),
            usage_cgroup: Mutex::new(None),
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
        // A host-tools root taken while the tools were mounts of their own: runsc would not
        // find the mounts its image records.
        if m.spec.rootfs.is_none()
            && m.spec.image.is_none()
            && m.metadata.get(snapshot::META_ROOT).map(String::as_str)
                != Some(snapshot::TOOLS_IN_ROOT)
        {
            return Err(SnapshotError::Incompatible {
                id: id.clone(),
                reason: "taken before the host's tools became part of a gVisor sandbox's root \
                         (they were mounts of their own, which its checkpoint records)"
                    .into(),
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
            bundle::write_rootfs(&self.bundle, who, self.spec.user_name_and_home())?;
            if let Some(alias) = &self.spec.workspace_alias {
                // The alias's mount point in our read-only root (an own root's is made by
                // runsc in its in-memory overlay).
                let point = self
                    .bundle
                    .join("rootfs")
                    .join(alias.trim_start_matches('/'));
                std::fs::create_dir_all(&point).map_err(io("create", &point))?;
            }
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
        // `/etc/ssl/certs` is the host's, bound read-only); an image's or a caller's root gets
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
            self.runsc.platform,
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
        let mut cmd = self.starting_command()?;
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
}
