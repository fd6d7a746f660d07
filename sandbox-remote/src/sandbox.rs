//! A sandbox that lives in a server: every trait call is one request of the v1 API.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use futures::StreamExt;
use reqwest::Method;
use sandbox_core::{
    Command, DirEntry, Error, ExecEvent, ExecRequest, ExecResult, ExecStream, NetworkEvent,
    NetworkPolicy, Result, Sandbox, SandboxSpec, SnapshotId, SnapshotStore, Tier, Timeline,
};
use sandbox_server::api::{ExecBody, Listing, NetworkEvents};

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
        }
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
        if req.tty.is_some() {
            return Err(Error::unsupported(
                self.tier,
                "terminals through a remote server (not in the v1 API yet)",
            ));
        }
        let mut body = match &req.command {
            Command::Argv(_) | Command::Code(_) => ExecBody::from_command(&req.command),
            other => {
                return Err(Error::unsupported(
                    self.tier,
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
        body.timeout_ms = req
            .timeout
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Ok(body)
    }

    /// Sends `req`, whose answer has no body (about workspace path `path`, if any).
    async fn unit(&self, req: reqwest::RequestBuilder, path: Option<&str>) -> Result<()> {
        self.client
            .send(req)
            .await
            .map(drop)
            .map_err(|f| self.err(f, path))
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
        let (tier, id, server) = (self.tier, self.id.clone(), self.client.shown.clone());
        tokio::spawn(async move {
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
                        let text = serde_json::from_str::<serde_json::Value>(&data)
                            .ok()
                            .and_then(|v| v["text"].as_str().map(str::to_string))
                            .unwrap_or_default();
                        let b = bytes::Bytes::from(text.into_bytes());
                        Ok(if name == "stdout" {
                            ExecEvent::Stdout(b)
                        } else {
                            ExecEvent::Stderr(b)
                        })
                    }
                    Some("exit") => match serde_json::from_str::<ExecResult>(&data) {
                        Ok(r) => Ok(ExecEvent::Exit(r)),
                        Err(e) => Err(Failure::protocol(&server, format!("exit event: {e}"))
                            .into_core(tier, Some(&id), None)),
                    },
                    Some("error") => {
                        let v: serde_json::Value = serde_json::from_str(&data).unwrap_or_default();
                        let f = Failure {
                            server: server.clone(),
                            status: 200,
                            kind: v["error"]["kind"].as_str().unwrap_or("internal").into(),
                            message: v["error"]["message"].as_str().unwrap_or(&data).into(),
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
        });
        Ok(stream)
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
            .map_err(|e| self.err(Failure::transport(&self.client.shown, &e), Some(path)))?;
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
        let req = self.client.request(Method::DELETE, &self.path(""));
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
