//! A sandbox that lives in a server: every trait call is one request of the v1 API.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use futures::StreamExt;
use reqwest::Method;
use std::net::SocketAddr;

use base64::Engine;
use sandbox_api::{
    ExecBody, Listing, NetworkEvents, PortList, ProcessList, ProcessRef, PublishBody, ResizeBody,
    SignalBody,
};
use sandbox_core::{
    Command, DirEntry, Error, ExecEvent, ExecRequest, ExecResult, ExecStream, NetworkEvent,
    NetworkPolicy, Process, ProcessControl, ProcessId, ProcessInfo, PublishedPort, Result, Sandbox,
    SandboxSpec, Signal, SnapshotId, SnapshotStore, Tier, Timeline, Tty,
};

use crate::client::{encode, encode_path, Client};
use crate::error::Failure;

/// A sandbox held by a server (see [`crate::RemoteBackend`]). Dropping it destroys it in the
/// background (when a Tokio runtime is there to send the request); call
/// [`Sandbox::destroy`] to see the outcome.
#[derive(Debug)]
pub struct RemoteSandbox {
    client: Arc<Client>,
    id: String,
    tier: Tier,
    spec: SandboxSpec,
    timeline: Timeline,
    /// Destroyed through this handle: every later call is `SandboxGone` without a request.
    gone: AtomicBool,
    /// `destroy` does not wait for the teardown (`DELETE ...?wait=false`).
    detach: bool,
}

impl RemoteSandbox {
    pub(crate) fn new(
        client: Arc<Client>,
        id: String,
        tier: Tier,
        spec: SandboxSpec,
        timeline: Timeline,
    ) -> Self {
        RemoteSandbox {
            client,
            id,
            tier,
            spec,
            timeline,
            gone: AtomicBool::new(false),
            detach: false,
        }
    }

    /// Sets whether `destroy` waits for the teardown (see
    /// [`RemoteConfig::destroy_without_waiting`](crate::RemoteConfig::destroy_without_waiting)).
    pub(crate) fn destroy_without_waiting(mut self, on: bool) -> Self {
        self.detach = on;
        self
    }

    /// The server's address, as given.
    pub fn server(&self) -> &str {
        &self.client.shown
    }

    fn check(&self) -> Result<()> {
        if self.gone.load(Ordering::SeqCst) {
            return Err(Error::SandboxGone {
                id: self.id.clone(),
                reason: "destroyed".into(),
            });
        }
        Ok(())
    }

    fn path(&self, rest: &str) -> String {
        format!("/v1/sandboxes/{}{rest}", encode(&self.id))
    }

    fn err(&self, f: Failure, path: Option<&str>) -> Error {
        f.into_core(self.tier, Some(&self.id), path)
    }

    /// The request body of `req`, or why the API cannot carry it.
    fn body(&self, req: ExecRequest) -> Result<ExecBody> {
        exec_body(self.tier, req)
    }

    /// Sends `req`, whose answer has no body (about workspace path `path`, if any).
    async fn unit(&self, req: reqwest::RequestBuilder, path: Option<&str>) -> Result<()> {
        self.client
            .send(req)
            .await
            .map(drop)
            .map_err(|f| self.err(f, path))
    }

    /// Reads the event stream of `resp` (an exec's or a process's) into `tx`, on a task.
    fn pump(&self, resp: reqwest::Response, tx: tokio::sync::mpsc::Sender<Result<ExecEvent>>) {
        tokio::spawn(pump(
            resp,
            tx,
            self.tier,
            self.id.clone(),
            self.client.shown.clone(),
        ));
    }

    /// Process `pid` of this sandbox, to send requests about.
    fn process(&self, pid: ProcessId) -> RemoteProcess {
        RemoteProcess {
            client: Arc::clone(&self.client),
            tier: self.tier,
            sandbox: self.id.clone(),
            pid,
        }
    }

    async fn post_empty(&self, rest: &str) -> Result<()> {
        self.check()?;
        let req = self.client.request(Method::POST, &self.path(rest));
        self.unit(req, None).await
    }
}

#[async_trait]
impl Sandbox for RemoteSandbox {
    fn id(&self) -> &str {
        &self.id
    }

    fn tier(&self) -> Tier {
        self.tier
    }

    fn spec(&self) -> &SandboxSpec {
        &self.spec
    }

    fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecResult> {
        self.check()?;
        let body = self.body(req)?;
        let req = self
            .client
            .request(Method::POST, &self.path("/exec"))
            .json(&body);
        self.client.json(req).await.map_err(|f| self.err(f, None))
    }

    async fn exec_stream(&self, req: ExecRequest) -> Result<ExecStream> {
        self.check()?;
        let body = self.body(req)?;
        let req = self
            .client
            .request(Method::POST, &self.path("/exec/stream"))
            .json(&body);
        let resp = self.client.send(req).await.map_err(|f| self.err(f, None))?;
        let (tx, stream) = ExecStream::channel(64);
        self.pump(resp, tx);
        Ok(stream)
    }

    async fn spawn(&self, req: ExecRequest) -> Result<Process> {
        self.check()?;
        let body = self.body(req)?;
        let req = self
            .client
            .request(Method::POST, &self.path("/processes"))
            .json(&body);
        let p: ProcessRef = self.client.json(req).await.map_err(|f| self.err(f, None))?;
        let ctl = self.process(p.id);
        // Its output, attached at once: the server holds it (and the process blocks on a
        // full pipe) while this end does not read.
        let req = self.client.request(Method::GET, &ctl.path("/output"));
        let resp = self.client.send(req).await.map_err(|f| ctl.err(f))?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        self.pump(resp, tx);
        Ok(Process::new(
            p.id,
            rx,
            Arc::new(ctl),
            self.spec.limits.output_bytes,
        ))
    }

    async fn processes(&self) -> Result<Vec<ProcessInfo>> {
        self.check()?;
        let req = self.client.request(Method::GET, &self.path("/processes"));
        let l: ProcessList = self.client.json(req).await.map_err(|f| self.err(f, None))?;
        Ok(l.processes)
    }

    async fn signal(&self, id: ProcessId, signal: Signal) -> Result<()> {
        self.check()?;
        self.process(id).signal(signal).await
    }

    async fn publish(&self, sandbox_port: u16, host: SocketAddr) -> Result<SocketAddr> {
        self.check()?;
        let req = self
            .client
            .request(Method::POST, &self.path("/ports"))
            .json(&PublishBody::new(sandbox_port, Some(host)));
        let p: PublishedPort = self.client.json(req).await.map_err(|f| self.err(f, None))?;
        Ok(p.host)
    }

    async fn unpublish(&self, host: SocketAddr) -> Result<()> {
        self.check()?;
        let req = self.client.request(
            Method::DELETE,
            &self.path(&format!("/ports/{}", encode(&host.to_string()))),
        );
        self.unit(req, None).await
    }

    async fn published(&self) -> Result<Vec<PublishedPort>> {
        self.check()?;
        let req = self.client.request(Method::GET, &self.path("/ports"));
        let l: PortList = self.client.json(req).await.map_err(|f| self.err(f, None))?;
        Ok(l.ports)
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        self.check()?;
        let req = self
            .client
            .request(
                Method::PUT,
                &self.path(&format!("/files/{}", encode_path(path))),
            )
            .body(data.to_vec());
        self.unit(req, Some(path)).await
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.check()?;
        let req = self.client.request(
            Method::GET,
            &self.path(&format!("/files/{}", encode_path(path))),
        );
        let resp = self
            .client
            .send(req)
            .await
            .map_err(|f| self.err(f, Some(path)))?;
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| self.err(Failure::transport(&self.client.shown, e), Some(path)))?;

        Ok(bytes.to_vec())
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.check()?;
        let req = self.client.request(
            Method::GET,
            &self.path(&format!("/list?path={}", encode(path))),
        );
        let l: Listing = self
            .client
            .json(req)
            .await
            .map_err(|f| self.err(f, Some(path)))?;
        Ok(l.entries)
    }

    async fn snapshot(&self, store: &dyn SnapshotStore) -> Result<SnapshotId> {
        self.check()?;
        crate::transfer::snapshot_into(&self.client, self.tier, &self.id, store).await
    }

    async fn pause(&self) -> Result<()> {
        self.post_empty("/pause").await
    }

    async fn resume(&self) -> Result<()> {
        self.post_empty("/resume").await
    }

    async fn set_network_policy(&self, policy: NetworkPolicy) -> Result<()> {
        self.check()?;
        let req = self
            .client
            .request(Method::PUT, &self.path("/network"))
            .json(&policy);
        self.unit(req, None).await
    }

    async fn network_events(&self) -> Result<Vec<NetworkEvent>> {
        self.check()?;
        let req = self
            .client
            .request(Method::GET, &self.path("/network/events"));
        let e: NetworkEvents = self.client.json(req).await.map_err(|f| self.err(f, None))?;
        Ok(e.events)
    }

    async fn health_check(&self) -> Result<()> {
        self.check()?;
        let req = self.client.request(Method::GET, &self.path(""));
        self.unit(req, None).await
    }

    async fn destroy(&self) -> Result<()> {
        if self.gone.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let path = if self.detach {
            self.path("?wait=false")
        } else {
            self.path("")
        };
        let req = self.client.request(Method::DELETE, &path);
        match self.client.send(req).await {
            Ok(_) => Ok(()),
            // Already gone there (expired, destroyed by another client): destroyed.
            Err(f) if f.status == 404 || f.status == 410 => Ok(()),
            Err(f) => {
                // Not destroyed: let a later call try again.
                self.gone.store(false, Ordering::SeqCst);
                Err(self.err(f, None))
            }
        }
    }
}

/// Reads the server-sent events of an exec or process output stream into `tx`: output
/// chunks (`{"text"}` or `{"b64"}`), then the exit or an error. Ends when the receiver goes
/// (the HTTP stream is dropped, so the server stops reading the process: backpressure).
async fn pump(
    resp: reqwest::Response,
    tx: tokio::sync::mpsc::Sender<Result<ExecEvent>>,
    tier: Tier,
    id: String,
    server: String,
) {
    let mut events = sse_stream::SseStream::from_bytes_stream(resp.bytes_stream());
    while let Some(ev) = events.next().await {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                let f = Failure::protocol(&server, format!("the event stream broke: {e}"));
                let _ = tx.send(Err(f.into_core(tier, Some(&id), None))).await;
                return;
            }
        };
        let data = ev.data.unwrap_or_default();
        let out = match ev.event.as_deref() {
            Some(name @ ("stdout" | "stderr")) => {
                let v = serde_json::from_str::<serde_json::Value>(&data).unwrap_or_default();
                let b = match (v["text"].as_str(), v["b64"].as_str()) {
                    (Some(t), _) => Ok(t.as_bytes().to_vec()),
                    (None, Some(b)) => base64::engine::general_purpose::STANDARD
                        .decode(b)
                        .map_err(|e| format!("a {name} chunk is not base64: {e}")),
                    (None, None) => Err(format!("a {name} event without text: {data}")),
                };
                match b {
                    Ok(b) => {
                        let b = bytes::Bytes::from(b);
                        Ok(if name == "stdout" {
                            ExecEvent::Stdout(b)
                        } else {
                            ExecEvent::Stderr(b)
                        })
                    }
                    Err(m) => Err(Failure::protocol(&server, m).into_core(tier, Some(&id), None)),
                }
            }
            Some("exit") => {
                match serde_json::from_str::<ExecResult>(&data) {
                    Ok(r) => Ok(ExecEvent::Exit(r)),
                    Err(e) => Err(Failure::protocol(&server, format!("exit event: {e}"))
                        .into_core(tier, Some(&id), None)),
                }
            }
            Some("error") => {
                let v: serde_json::Value = serde_json::from_str(&data).unwrap_or_default();
                let f = Failure {
                    server: server.clone(),
                    status: 200,
                    kind: v["error"]["kind"].as_str().unwrap_or("internal").into(),
                    message: v["error"]["message"].as_str().unwrap_or(&data).into(),
                    cause: None,
                };

                Err(f.into_core(tier, Some(&id), None))
            }
            // Comments (keep-alives) and events of later versions.
            _ => continue,
        };
        let last = !matches!(out, Ok(ExecEvent::Stdout(_) | ExecEvent::Stderr(_)));
        if tx.send(out).await.is_err() || last {
            return;
        }
    }
    let f = Failure::protocol(&server, "the event stream ended before the exit event");
    let _ = tx.send(Err(f.into_core(tier, Some(&id), None))).await;
}

/// A process of a remote sandbox: its input side, one request per call.
struct RemoteProcess {
    client: Arc<Client>,
    tier: Tier,
    sandbox: String,
    pid: ProcessId,
}

impl RemoteProcess {
    fn path(&self, rest: &str) -> String {
        format!(
            "/v1/sandboxes/{}/processes/{}{rest}",
            encode(&self.sandbox),
            self.pid
        )
    }

    /// The library's error: a process the server no longer talks to has exited.
    fn err(&self, f: Failure) -> Error {
        match f.kind.as_str() {
            "process_exited" => Error::ProcessExited { id: self.pid },
            "not_found" if f.message.starts_with("no process") => {
                Error::ProcessExited { id: self.pid }
            }
            _ => f.into_core(self.tier, Some(&self.sandbox), None),
        }
    }

    async fn post_json(&self, rest: &str, body: &impl serde::Serialize) -> Result<()> {
        let req = self
            .client
            .request(Method::POST, &self.path(rest))
            .json(body);
        self.send(req).await
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<()> {
        self.client
            .send(req)
            .await
            .map(drop)
            .map_err(|f| self.err(f))
    }
}

#[async_trait]
impl ProcessControl for RemoteProcess {
    async fn write_stdin(&self, data: bytes::Bytes) -> Result<()> {
        let req = self
            .client
            .request(Method::POST, &self.path("/stdin"))
            .body(data);
        self.send(req).await
    }

    async fn close_stdin(&self) -> Result<()> {
        let req = self.client.request(Method::DELETE, &self.path("/stdin"));
        self.send(req).await
    }

    async fn signal(&self, signal: Signal) -> Result<()> {
        let body = SignalBody::new(signal.name());
        self.post_json("/signal", &body).await
    }

    async fn resize(&self, tty: Tty) -> Result<()> {
        let body = ResizeBody::new(tty.rows, tty.cols);
        self.post_json("/resize", &body).await
    }
}

impl Drop for RemoteSandbox {
    fn drop(&mut self) {
        if self.gone.load(Ordering::SeqCst) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(sandbox = %self.id, "dropped outside a Tokio runtime: left on the server");
            return;
        };
        let req = self.client.request(Method::DELETE, &self.path(""));
        let client = Arc::clone(&self.client);
        rt.spawn(async move {
            let _ = client.send(req).await;
        });
    }
}

/// The request body of `req` for a sandbox of `tier`, or why the API cannot carry it.
pub(crate) fn exec_body(tier: Tier, req: ExecRequest) -> Result<ExecBody> {
    let mut body = match &req.command {
        Command::Argv(_) | Command::Code(_) => ExecBody::from_command(&req.command),
        other => {
            return Err(Error::unsupported(
                tier,
                format!("the command {other:?} through a remote server"),
            ))
        }
    };
    if let Some(stdin) = req.stdin {
        body.stdin = Some(String::from_utf8(stdin).map_err(|_| Error::InvalidSpec {
            field: "stdin".into(),
            reason: "a remote server takes standard input as UTF-8 text".into(),
        })?);
    }
    body.env = req.env;
    body.cwd = req.cwd;
    body.tty = req.tty;
    body.timeout_ms = req
        .timeout
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Ok(body)
}
