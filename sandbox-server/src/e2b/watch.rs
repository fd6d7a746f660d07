//! envd's directory watching over [`Sandbox::watch`](sandbox_core::Sandbox::watch):
//! `WatchDir` (a stream of events) and the polled watchers the Python SDK uses
//! (`CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`).
//!
//! Paths are the workspace's (`/workspace` and beneath, or relative to a home inside it):
//! the tiers watch their workspace from the host, and nothing else of a sandbox's file
//! system; a path elsewhere is `invalid_argument`, saying so. A sandbox holds at most
//! [`MAX_WATCHERS`] watches (streams and polled ones together); each is bounded by the
//! core's limits (`sandbox_core::watch`), and lost events are reported, never hidden.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::response::Response;
use futures::StreamExt;
use sandbox_core::{Error, FsEvent, FsEventKind, Watch};
use serde::Deserialize;

use super::connect::{self, Code, Item, RpcError, StreamRequest};
use super::Envd;

/// Most watches one sandbox holds at once through E2B's API.
pub(crate) const MAX_WATCHERS: usize = 32;

/// One sandbox's watches: the polled ones by id, and how many it holds (polled and streams).
#[derive(Default)]
pub(crate) struct Watchers {
    polled: Mutex<HashMap<String, Polled>>,
    used: Arc<AtomicUsize>,
}

/// A polled watcher: its watch, and the place it holds.
type Polled = (Arc<Mutex<Watch>>, Slot);

/// One of a sandbox's [`MAX_WATCHERS`] places, taken before its watch is made (so racing
/// requests cannot pass the count together) and given back when dropped.
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Watchers {
    /// A place for one more watch, or the error saying there is none.
    fn reserve(&self) -> Result<Slot, RpcError> {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_WATCHERS).then_some(n + 1)
            })
            .map(|_| Slot(Arc::clone(&self.used)))
            .map_err(|_| Self::full())
    }

    fn full() -> RpcError {
        RpcError::new(
            Code::ResourceExhausted,
            format!(
                "this sandbox has {MAX_WATCHERS} watches open already (stop one with \
                 `RemoveWatcher` or by closing its stream)"
            ),
        )
    }
}

/// `WatchDirRequest` and `CreateWatcherRequest`.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WatchReq {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default)]
    include_entry: bool,
}

/// `GetWatcherEventsRequest` and `RemoveWatcherRequest`.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WatcherReq {
    #[serde(default)]
    watcher_id: String,
}

/// The workspace path of envd path `path`, or why it cannot be watched.
fn workspace_path(e: &Envd, path: &str) -> Result<String, RpcError> {
    let abs = super::resolve(&e.meta.home, path)?;
    let ws = sandbox_core::WORKSPACE_MOUNT;
    match e.in_workspace(&abs) {
        Some(rel) => Ok(format!("{ws}/{rel}")),
        None => {
            let alias = e
                .entry
                .sandbox
                .spec()
                .workspace_alias
                .as_ref()
                .map(|a| format!(", or {a}, the same directory,"))
                .unwrap_or_default();
            Err(RpcError::invalid(format!(
                "path '{abs}' cannot be watched: this server watches the sandbox's workspace \
                 ({ws}{alias} and beneath) only"
            )))
        }
    }
}

/// Starts a watch of `req`'s directory.
async fn open(e: &Envd, req: &WatchReq) -> Result<Watch, RpcError> {
    if req.include_entry {
        // The SDKs ask for entries from envd 0.6.3 only; this server reports 0.5.7.
        return Err(RpcError::new(
            Code::Unimplemented,
            "watch events with entries (`include_entry`) are not served by this server",
        ));
    }
    let path = workspace_path(e, &req.path)?;
    e.entry
        .sandbox
        .watch(&path, req.recursive)
        .await
        .map_err(|err| match err {
            Error::NotFound { .. } => RpcError::new(
                Code::NotFound,
                format!("path '{}' does not exist", req.path),
            ),
            Error::InvalidSpec { .. } => {
                RpcError::invalid(format!("path '{}' is not a directory", req.path))
            }
            Error::PathEscape { .. } => RpcError::invalid(format!(
                "path '{}' leads out of the workspace (through `..` or a symlink)",
                req.path
            )),
            other => RpcError::from(other),
        })
}

/// envd's JSON for one event.
fn event_json(ev: &FsEvent) -> serde_json::Value {
    let kind = match ev.kind {
        FsEventKind::Create => "EVENT_TYPE_CREATE",
        FsEventKind::Write => "EVENT_TYPE_WRITE",
        FsEventKind::Remove => "EVENT_TYPE_REMOVE",
        FsEventKind::Rename => "EVENT_TYPE_RENAME",
        FsEventKind::Chmod => "EVENT_TYPE_CHMOD",
    };
    serde_json::json!({ "name": ev.path, "type": kind })
}

fn lost(err: Error) -> RpcError {
    RpcError::new(Code::ResourceExhausted, err.to_string())
}

/// `WatchDir`: a start event (`WatchDirResponse`'s `oneof event` is its top level in JSON:
/// `{"start": {}}`, `{"filesystem": ...}`, `{"keepalive": {}}`), then each event as it comes, until the directory goes, the
/// sandbox ends or the client leaves.
pub(crate) async fn watch_dir(e: Envd, r: StreamRequest<WatchReq>) -> Response {
    // Held while the stream lives (it goes with the stream).
    let guard = match e.meta.watchers.reserve() {
        Ok(slot) => slot,
        Err(err) => return connect::stream_error(err),
    };
    let watch = match open(&e, &r.msg).await {
        Ok(watch) => watch,
        Err(err) => return connect::stream_error(err),
    };
    let start = futures::stream::once(async { Item::Msg(serde_json::json!({ "start": {} })) });
    let events = futures::stream::unfold(Some((watch, guard)), |state| async move {
        let (mut watch, guard) = state?;
        loop {
            match watch.next().await {
                // The watched directory itself went: the end, as envd's does.
                Some(Ok(ev)) if ev.path.is_empty() => continue,
                Some(Ok(ev)) => {
                    let msg = serde_json::json!({ "filesystem": event_json(&ev) });
                    return Some((Item::Msg(msg), Some((watch, guard))));
                }
                Some(Err(err)) => return Some((Item::Fail(lost(err)), None)),
                None => return None,
            }
        }
    });
    let ka = r
        .keepalive
        .map(|every| (every, serde_json::json!({ "keepalive": {} })));
    connect::stream(start.chain(events), ka, e.stop.clone(), r.deadline)
}

/// `CreateWatcher`: a polled watch; its id.
pub(crate) async fn create(e: &Envd, req: WatchReq) -> Result<serde_json::Value, RpcError> {
    let slot = e.meta.watchers.reserve()?;
    let watch = open(e, &req).await?;
    let id = uuid::Uuid::new_v4().to_string();
    e.meta
        .watchers
        .polled
        .lock()
        .map_err(|_| RpcError::new(Code::Internal, "the watcher table is poisoned"))?
        .insert(id.clone(), (Arc::new(Mutex::new(watch)), slot));
    Ok(serde_json::json!({ "watcherId": id }))
}

fn find(e: &Envd, id: &str) -> Result<Arc<Mutex<Watch>>, RpcError> {
    e.meta
        .watchers
        .polled
        .lock()
        .ok()
        .and_then(|p| p.get(id).map(|(w, _)| Arc::clone(w)))
        .ok_or_else(|| RpcError::new(Code::NotFound, format!("watcher '{id}' not found")))
}

/// `GetWatcherEvents`: everything since the last call (changes made before this call
/// included).
pub(crate) async fn events(e: &Envd, req: WatcherReq) -> Result<serde_json::Value, RpcError> {
    let w = find(e, &req.watcher_id)?;
    // Reading the kernel's queue takes the process's watch lock: off the async workers.
    let evs = tokio::task::spawn_blocking(move || {
        w.lock()
            .map_err(|_| RpcError::new(Code::Internal, "the watcher is poisoned"))?
            .try_events()
            .map_err(lost)
    })
    .await
    .map_err(|err| RpcError::new(Code::Internal, format!("the watch task: {err}")))??;
    let evs: Vec<_> = evs
        .iter()
        .filter(|ev| !ev.path.is_empty())
        .map(event_json)
        .collect();
    Ok(serde_json::json!({ "events": evs }))
}

/// `RemoveWatcher`.
pub(crate) fn remove(e: &Envd, req: WatcherReq) -> Result<serde_json::Value, RpcError> {
    let gone = e
        .meta
        .watchers
        .polled
        .lock()
        .ok()
        .and_then(|mut p| p.remove(&req.watcher_id));
    match gone {
        Some(_) => Ok(serde_json::json!({})),
        None => Err(RpcError::new(
            Code::NotFound,
            format!("watcher '{}' not found", req.watcher_id),
        )),
    }
}
