use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use nix::sys::signal::{killpg, Signal as Nix};
use nix::unistd::Pid;
use sandbox_core::{
    Backend, Capabilities, Command, DirEntry, Error, ExecEvent, ExecRequest, ExecResult,
    ExecStream, NetworkEvent, Process, ProcessControl, ProcessId, ResolvedSecrets, Result, Sandbox,
    SandboxSpec, Signal, Tier, TierStatus, Timeline,
};

/// `inner` with background processes: each runs through `inner`'s own streaming exec
/// (in its workspace, environment and process-group bookkeeping, so `inner`'s destroy
/// kills it), its process group signalled directly.
pub struct Spawning(pub Arc<dyn Backend>);

#[async_trait]
impl Backend for Spawning {
    fn tier(&self) -> Tier {
        self.0.tier()
    }

    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }

    async fn probe(&self) -> TierStatus {
        self.0.probe().await
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(WithSpawn {
            inner: self.0.create(spec, secrets).await?,
            groups: Arc::new(Mutex::new(HashSet::new())),
        }))
    }
}

struct WithSpawn {
    inner: Box<dyn Sandbox>,
    /// The process groups of its running background processes (their pids).
    groups: Arc<Mutex<HashSet<i32>>>,
}

struct Group(i32);

fn kill(pg: i32, signal: Signal) -> Result<()> {
    let sig = match signal {
        Signal::Kill => Nix::SIGKILL,
        Signal::Terminate => Nix::SIGTERM,
        Signal::Interrupt => Nix::SIGINT,
        Signal::Hangup => Nix::SIGHUP,
        _ => Nix::SIGTERM,
    };
    killpg(Pid::from_raw(pg), sig)
        .map_err(|e| Error::io("signal", std::io::Error::from_raw_os_error(e as i32)))
}

#[async_trait]
impl ProcessControl for Group {
    async fn write_stdin(&self, _: Bytes) -> Result<()> {
        Err(Error::unsupported(
            Tier::Unisolated,
            "stdin of this test double's processes",
        ))
    }

    async fn close_stdin(&self) -> Result<()> {
        // Its stdin is empty already.
        Ok(())
    }

    async fn signal(&self, signal: Signal) -> Result<()> {
        kill(self.0, signal)
    }
}

#[async_trait]
impl Sandbox for WithSpawn {
    fn id(&self) -> &str {
        self.inner.id()
    }

    fn tier(&self) -> Tier {
        self.inner.tier()
    }

    fn spec(&self) -> &SandboxSpec {
        self.inner.spec()
    }

    fn timeline(&self) -> &Timeline {
        self.inner.timeline()
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecResult> {
        self.inner.exec(req).await
    }

    async fn exec_stream(&self, req: ExecRequest) -> Result<ExecStream> {
        self.inner.exec_stream(req).await
    }

    async fn spawn(&self, req: ExecRequest) -> Result<Process> {
        let Command::Argv(argv) = &req.command else {
            return Err(Error::unsupported(self.tier(), "code strings in spawn"));
        };
        // The shell says its pid (its process group: the backend starts each command
        // in a group of its own) on stderr, then becomes the command.
        let mut wrapped = req.clone();
        wrapped.command = Command::Argv(
            ["/bin/sh", "-c", r#"echo "$$" >&2; exec "$@""#, "sh"]
                .iter()
                .map(|s| s.to_string())
                .chain(argv.iter().cloned())
                .collect(),
        );
        wrapped.stdin = None;
        let mut stream = self.inner.exec_stream(wrapped).await?;
        let mut early = Vec::new();
        let mut said = Vec::new();
        let pid = loop {
            let ev = tokio::time::timeout(super::DEADLINE, stream.next())
                .await
                .map_err(|_| Error::backend(Tier::Unisolated, "no pid in time"))?;
            match ev {
                Some(Ok(ExecEvent::Stderr(b))) => {
                    said.extend_from_slice(&b);
                    if let Some(nl) = said.iter().position(|c| *c == b'\n') {
                        let pid: i32 = std::str::from_utf8(&said[..nl])
                            .ok()
                            .and_then(|s| s.trim().parse().ok())
                            .ok_or_else(|| Error::backend(Tier::Unisolated, "no pid"))?;
                        if said.len() > nl + 1 {
                            early.push(Ok(ExecEvent::Stderr(Bytes::copy_from_slice(
                                &said[nl + 1..],
                            ))));
                        }
                        break pid;
                    }
                }
                Some(Ok(ExecEvent::Exit(r))) => {
                    return Err(Error::backend(
                        Tier::Unisolated,
                        format!("the command ended before it started: {r:?}"),
                    ))
                }
                Some(other) => early.push(other),
                None => return Err(Error::backend(Tier::Unisolated, "no pid")),
            }
        };
        self.groups.lock().unwrap().insert(pid);
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let groups = Arc::clone(&self.groups);
        tokio::spawn(async move {
            for e in early {
                if tx.send(e).await.is_err() {
                    break;
                }
            }
            while let Some(e) = stream.next().await {
                let last = matches!(e, Ok(ExecEvent::Exit(_)) | Err(_));
                if last {
                    groups.lock().unwrap().remove(&pid);
                }
                if tx.send(e).await.is_err() || last {
                    break;
                }
            }
            groups.lock().unwrap().remove(&pid);
        });
        Ok(Process::new(
            ProcessId::from(pid as u32),
            rx,
            Arc::new(Group(pid)),
            1 << 20,
        ))
    }

    async fn signal(&self, id: ProcessId, signal: Signal) -> Result<()> {
        let pg = i32::try_from(id).map_err(|_| Error::invalid("id", "not a pid"))?;
        if !self.groups.lock().unwrap().contains(&pg) {
            return Err(Error::invalid("id", format!("no running process {id}")));
        }
        kill(pg, signal)
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        self.inner.write_file(path, data).await
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.inner.read_file(path).await
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.inner.list(path).await
    }

    async fn network_events(&self) -> Result<Vec<NetworkEvent>> {
        self.inner.network_events().await
    }

    async fn watch(&self, path: &str, recursive: bool) -> Result<sandbox_core::Watch> {
        self.inner.watch(path, recursive).await
    }

    async fn health_check(&self) -> Result<()> {
        self.inner.health_check().await
    }

    async fn destroy(&self) -> Result<()> {
        self.inner.destroy().await
    }
}
