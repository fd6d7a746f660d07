//! Snapshots: a checkpoint of every process's memory plus the workspace and scratch files,
//! and the background resume from the same image.

use super::*;

/// Snapshot metadata: the kept background processes running when it was taken, as JSON
/// `[[keeper name, pid inside, command line, terminal], ...]`; a restored copy attaches to them.
pub(super) const META_PROCESSES: &str = "processes";

/// Metadata: what the root was (`tools-in-root` for the host-tools root with the tools bound
/// into it; `own` for an image's or a caller's). A host-tools snapshot without it was taken
/// while the tools were mounts of their own, which its checkpoint records: not restorable.
pub(super) const META_ROOT: &str = "root";

/// [`META_ROOT`] of a host-tools root whose tools are part of it.
pub(super) const TOOLS_IN_ROOT: &str = "tools-in-root";

impl Inner {
    /// Checkpoints the whole sandbox (every process's memory) plus the workspace into `store`.
    ///
    /// With a runsc whose `checkpoint --leave-running` works, the sandbox is paused for the
    /// checkpoint and the packing of its files (one moment for both), then resumed. Else
    /// `runsc checkpoint` stops the container; it is brought back from the same image in the
    /// background (delete, then restore under the same id), holding the lifecycle lock so
    /// the next exec waits for it. The call returns once the snapshot is stored.
    pub(super) async fn snapshot(
        self: &Arc<Self>,
        store: &dyn SnapshotStore,
    ) -> Result<SnapshotId> {
        self.alive()?;
        if self.egress.is_some() {
            // runsc: "checkpoint not supported when using hostinet".
            return Err(Error::unsupported(
                TIER,
                "snapshots of a sandbox with network access (gVisor cannot checkpoint a sandbox \
                 using the host network stack, which the egress path needs); snapshot a \
                 deny-all sandbox instead",
            ));
        }
        // No pause, resume or destroy overlaps the checkpoint and the resume after it.
        let held = self.life.hold().await;
        let guard = Arc::clone(&self.lifecycle).write_owned().await;
        self.alive()?;
        // Kept processes are detached below and go on. Any other (in a root without the
        // keeper) has host pipes or a host terminal as its stdio: runsc checkpoints them but
        // cannot restore them, so the sandbox would not come back. Refuse, losing nothing.
        let kept = self.kept_running();
        let unkept: Vec<String> = self
            .procs
            .list()
            .into_iter()
            .filter(|p| p.state == sandbox_core::ProcessState::Running)
            .filter(|p| !kept.iter().any(|k| k.id() == p.id))
            .map(|p| format!("{} (`{}`)", p.id, p.command))
            .collect();
        let relays = self.relays.load(Ordering::SeqCst);
        if relays > 0 {
            // A published port's relay has our pipes as its stdio (see `ports`): the same.
            return Err(Error::unsupported(
                TIER,
                format!(
                    "snapshots while connections to published ports are open (gVisor cannot \
                     restore their relays' host pipes): {relays} open; close them first"
                ),
            ));
        }
        if !unkept.is_empty() {
            return Err(Error::unsupported(
                TIER,
                format!(
                    "snapshots while background processes run in a root without the process \
                     keeper (their stdio are host pipes or terminals, which gVisor cannot \
                     restore): stop process {} first",
                    unkept.join(", ")
                ),
            ));
        }
        // Every kept process stops talking to us; none holds a host pipe for the checkpoint.
        for (i, k) in kept.iter().enumerate() {
            if let Err(e) = k.detach().await {
                for k in &kept[..i] {
                    let _ = k.attach(self).await;
                }
                return Err(e);
            }
        }
        let recorded: Vec<kept::Recorded> = kept.iter().map(|k| k.record()).collect();
        let image = self.dir.join(format!(
            "checkpoint-{}",
            self.seq.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&image).map_err(io("create", &image))?;
        // Frozen from the checkpoint until its files are packed, so memory and files are of
        // one moment; resumed once they are (a sandbox its user paused stays as it is). Should
        // this call be dropped or panic meanwhile, the guard resumes it.
        let freeze = self.runsc.leave_running && !self.life.is_paused();
        let mut frozen = None;
        if freeze {
            if let Err(e) = self.runsc_call(&["pause"]).await {
                self.reattach_kept().await;
                let _ = std::fs::remove_dir_all(&image);
                return Err(e);
            }
            frozen = Some(Frozen::new(&self.runsc, &self.id));
        }
        let mut cmd = self.runsc.async_command();
        cmd.arg("checkpoint");
        if self.runsc.leave_running {
            cmd.arg("--leave-running");
        }
        cmd.arg("--image-path").arg(&image).arg(&self.id);
        if let Err(e) = run_checked_async(cmd, "checkpoint").await {
            let _ = std::fs::remove_dir_all(&image);
            // Left running (paused by us, or by its user): it goes on as it was, losing
            // nothing.
            if self.runsc.leave_running {
                let resumed = match frozen.take() {
                    Some(f) => {
                        f.disarm();
                        self.runsc_call(&["resume"]).await.is_ok()
                    }
                    None => true,
                };
                if resumed {
                    self.reattach_kept().await;
                    return Err(e);
                }
            }
            // Nothing consistent to resume from: the sandbox is gone.
            let me = Arc::clone(self);
            drop(guard);
            let why = format!("its checkpoint failed: {e}");
            let _ = tokio::task::spawn_blocking(move || me.teardown(&why)).await;
            return Err(e);
        }
        // runsc's own image: as large as the sandbox's memory, not capped here.
        let packed = fsnap::pack_dir(&image);
        // What code inside wrote is capped by the sandbox's disk (both are tmpfs mounts of
        // at most `limits.disk_bytes`); files are streamed, sparse ones kept sparse.
        let cap = self.spec.limits.disk_bytes;
        let ws = match self.spec.workspace {
            Workspace::Empty => Some(fsnap::pack_dir_limited(&self.workspace, cap)),
            _ => None,
        };
        // `/tmp` and `/dev/shm` live on the host too: not in the checkpoint image.
        let scratch = fsnap::pack_dir_limited(&self.scratch, cap);
        let me = Arc::clone(self);
        let resume_image = image.clone();
        let frozen = frozen.map(Frozen::disarm).is_some();
        tokio::spawn(async move {
            // Released once the sandbox is back: a destroy meanwhile waits for it.
            let _held = held;
            let _exclusive = guard;
            if me.runsc.leave_running {
                let _ = tokio::fs::remove_dir_all(&resume_image).await;
                let resumed = if frozen {
                    me.runsc_call(&["resume"]).await
                } else {
                    Ok(())
                };
                if let Err(e) = resumed {
                    tracing::warn!(sandbox = %me.id, error = %e, "could not resume after a checkpoint");
                    me.life
                        .end(format!("could not resume after its snapshot: {e}"));
                }
            } else {
                me.resume_from(&resume_image).await;
            }
            // The kept processes went on inside: attach to them again.
            me.reattach_kept().await;
        });
        let mut draft = SnapshotDraft::new(
            TIER,
            self.engine.clone(),
            vec![SnapshotKind::Filesystem, SnapshotKind::FullMemory],
            {
                // Pinned to the image's digest: the restore gets this very image.
                let mut spec = self.spec.clone();
                if let (Some(r), Some(img)) = (&spec.image, &self.image) {
                    spec.image = Some(r.pinned(img.digest()));
                }
                spec
            },
        )
        .artifact("checkpoint.tar", packed?)
        .meta("uid", self.who.uid.to_string())
        .meta("gid", self.who.gid.to_string())
        .meta("platform", self.runsc.platform.name())
        .meta("sandbox_id", self.id.clone())
        .meta(
            META_ROOT,
            if self.lower.is_empty() {
                TOOLS_IN_ROOT
            } else {
                "own"
            },
        )
        .meta(
            META_PROCESSES,
            serde_json::to_string(&recorded)
                .map_err(|e| Error::backend_caused(TIER, "recording the processes", e))?,
        );
        if let Some(ws) = ws {
            draft = draft.artifact("workspace.tar", ws?);
        }
        draft = draft.artifact(SCRATCH_TAR, scratch?);
        Ok(store.put(draft).await?)
    }

    /// Runs `runsc ARGS.. <id>` (pause, resume) and checks it succeeded.
    pub(super) async fn runsc_call(&self, args: &[&str]) -> Result<()> {
        let mut cmd = self.runsc.async_command();
        cmd.args(args).arg(&self.id);
        run_checked_async(cmd, args.first().copied().unwrap_or("runsc")).await
    }

    /// Brings a checkpointed (stopped) container back from its image under the same id.
    pub(super) async fn resume_from(self: &Arc<Self>, image: &Path) {
        let me = Arc::clone(self);
        let _ = tokio::task::spawn_blocking(move || me.delete_container_for_resume()).await;
        let resumed = match self.starting_command() {
            Ok(mut cmd) => {
                cmd.args(["restore", "--detach", "--bundle"])
                    .arg(&self.bundle)
                    .arg("--image-path")
                    .arg(image)
                    .arg(&self.id);
                run_detached(cmd, &self.dir.join("runsc.log"), "restore").await
            }
            Err(e) => Err(e),
        };
        self.track_processes().await;
        let _ = std::fs::remove_dir_all(image);
        if let Err(e) = resumed {
            tracing::warn!(sandbox = %self.id, error = %e, "could not resume after a checkpoint");
            self.life
                .end(format!("could not resume after its snapshot: {e}"));
        }
        if self.life.release_begun() {
            // Destroyed while resuming: remove what the restore brought back.
            let me = Arc::clone(self);
            let _ = tokio::task::spawn_blocking(move || me.cleanup()).await;
        }
    }
}

/// A sandbox a snapshot paused: resumed (`runsc resume`, on a thread of its own) if the
/// snapshot ends before handing it on, dropped or panicking between its pause and the
/// resume it would do.
struct Frozen {
    resume: Option<std::process::Command>,
}

impl Frozen {
    fn new(runsc: &crate::runsc::Runsc, id: &str) -> Self {
        let mut cmd = runsc.command();
        cmd.args(["resume", id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        Frozen { resume: Some(cmd) }
    }

    /// The caller resumes it from here on.
    fn disarm(mut self) {
        self.resume = None;
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if let Some(mut cmd) = self.resume.take() {
            let _ = std::thread::Builder::new()
                .name("gvisor-snapshot-resume".into())
                .spawn(move || {
                    let _ = cmd.status();
                });
        }
    }
}
