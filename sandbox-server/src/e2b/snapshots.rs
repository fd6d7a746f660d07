//! E2B's snapshots and forks on our snapshot stores: `create_snapshot()` takes one of the
//! tier's own snapshots into the client's store (what the tier captures: files on the
//! container and wasm tiers, memory too on gVisor and the microVM); a snapshot's id (or its
//! name) is a template `Sandbox.create(...)` restores from; `fork` snapshots once and
//! restores N sandboxes from it. Names and sources live in the server's memory: after a
//! restart a snapshot is still reachable by its id.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use sandbox_core::{SnapshotId, SnapshotStore};
use serde::Deserialize;

use super::control::{body, e2b, entry, sandbox_json, timeout_of, Answer};
use super::{failure, Meta};
use crate::api::LifetimeSpec;
use crate::auth::Caller;
use crate::{Entry, Shared};

/// One E2B snapshot: the store's id, whose it is, where it came from, its name.
#[derive(Clone)]
pub(crate) struct Snap {
    sid: SnapshotId,
    owner: Caller,
    sandbox: String,
    name: Option<String>,
    /// Its sandbox's home (a template's `home`), which its restored sandboxes keep.
    home: Option<String>,
}

impl Snap {
    /// E2B's id: the name with its tag when it has one, else the store's id.
    fn e2b_id(&self) -> String {
        match &self.name {
            Some(n) => format!("{n}:default"),
            None => self.sid.to_string(),
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "snapshotID": self.e2b_id(), "names": [self.e2b_id()] })
    }

    /// Whether `name` (an id, a name, either with a `:tag`) is this snapshot.
    fn is(&self, name: &str) -> bool {
        let bare = name.split_once(':').map_or(name, |(n, _)| n);
        bare == self.sid.to_string() || Some(bare) == self.name.as_deref()
    }
}

/// The server's E2B snapshots.
#[derive(Default)]
pub(crate) struct Snaps(Mutex<Vec<Snap>>);

impl Snaps {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Snap>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `caller`'s snapshot named `name`, if it has one.
    pub(crate) fn find(&self, caller: &Caller, name: &str) -> Option<Snap> {
        self.lock()
            .iter()
            .find(|s| &s.owner == caller && s.is(name))
            .cloned()
            .or_else(|| {
                // A bare store id, from before a restart.
                let sid: SnapshotId = name.split(':').next()?.parse().ok()?;
                Some(Snap {
                    sid,
                    owner: caller.clone(),
                    sandbox: String::new(),
                    name: None,
                    home: None,
                })
            })
    }
}

fn store(s: &Shared, caller: &Caller) -> Answer<Arc<dyn SnapshotStore>> {
    s.config.snapshot_store_for(&caller.0).ok_or_else(|| {
        failure(
            StatusCode::NOT_IMPLEMENTED,
            "this server keeps no snapshots: start it with a snapshot store \
             (`agent-sandbox serve --state-dir DIR`)",
        )
    })
}

/// Takes a snapshot of `e` into `caller`'s store.
async fn take(s: &Shared, caller: &Caller, e: &Arc<Entry>) -> Answer<SnapshotId> {
    let store = store(s, caller)?;
    let used = crate::lifetime::InUse::enter(Arc::clone(e))
        .await
        .map_err(e2b)?;
    let sid = used
        .sandbox
        .snapshot(store.as_ref())
        .await
        .map_err(|err| e2b(err.into()))?;
    Ok(sid)
}

#[derive(Deserialize, Default)]
struct SnapshotRequest {
    name: Option<String>,
}

/// `POST /sandboxes/{id}/snapshots`.
pub(crate) async fn create(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    b: Result<Bytes, BytesRejection>,
) -> Answer<(StatusCode, Json<serde_json::Value>)> {
    let r: SnapshotRequest = body(b)?;
    if let Some(n) = &r.name {
        if n.is_empty()
            || !n
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
        {
            return Err(failure(
                StatusCode::BAD_REQUEST,
                format!("snapshot name `{n}`: letters, digits and `-_.`"),
            ));
        }
    }
    let e = entry(&s, &caller, &id)?;
    let sid = take(&s, &caller, &e).await?;
    let snap = Snap {
        sid,
        owner: caller.clone(),
        sandbox: id,
        name: r.name,
        home: Some(super::meta(&e).home.clone()),
    };
    {
        let mut all = s.e2b_snapshots.lock();
        // A name taken again moves to the new snapshot, as E2B's names do.
        if snap.name.is_some() {
            all.retain(|x| !(x.owner == caller && x.name == snap.name));
        }
        all.push(snap.clone());
    }
    Ok((StatusCode::CREATED, Json(snap.json())))
}

/// `GET /snapshots[?sandboxID=...][&name=...]`.
pub(crate) async fn list(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Answer<Json<Vec<serde_json::Value>>> {
    let all = s.e2b_snapshots.lock().clone();
    Ok(Json(
        all.iter()
            .filter(|x| x.owner == caller)
            .filter(|x| q.get("sandboxID").is_none_or(|id| &x.sandbox == id))
            .filter(|x| q.get("name").is_none_or(|n| x.is(n)))
            .map(Snap::json)
            .collect(),
    ))
}

/// `DELETE /templates/{id}`: a snapshot (the operator's templates are not the API's).
pub(crate) async fn delete(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Answer<StatusCode> {
    let Some(snap) = s.e2b_snapshots.find(&caller, &id) else {
        return Err(failure(
            StatusCode::NOT_FOUND,
            format!("no snapshot `{id}`"),
        ));
    };
    let store = store(&s, &caller)?;
    if store.manifest(&snap.sid).await.is_err() {
        return Err(failure(
            StatusCode::NOT_FOUND,
            format!("no snapshot `{id}`"),
        ));
    }
    store
        .delete(&snap.sid)
        .await
        .map_err(|err| e2b(err.into()))?;
    s.e2b_snapshots
        .lock()
        .retain(|x| !(x.owner == caller && x.sid == snap.sid));
    Ok(StatusCode::NO_CONTENT)
}

/// How a sandbox restored from a snapshot starts (a create naming a snapshot, or a fork).
pub(crate) struct Restore {
    /// Seconds until its timeout.
    pub(crate) timeout: u64,
    /// Its metadata (its v1 labels).
    pub(crate) metadata: BTreeMap<String, String>,
    /// The egress policy asked for, if one was: applied unless the snapshot's is deny-all
    /// (then it stays so: a restored sandbox never gets more network than its snapshot had,
    /// nor more than asked).
    pub(crate) network: Option<sandbox_core::NetworkPolicy>,
    /// Whether its other ports are open to whoever knows its id (else a traffic token).
    pub(crate) public_ports: bool,
    pub(crate) auto_pause: bool,
    pub(crate) auto_resume: bool,
}

/// A new sandbox restored from `snap`, admitted as `opts` say.
pub(crate) async fn restore(
    s: &Shared,
    caller: &Caller,
    snap: &Snap,
    opts: Restore,
) -> Answer<(Arc<Entry>, Arc<Meta>)> {
    let store = store(s, caller)?;
    let m = store
        .manifest(&snap.sid)
        .await
        .map_err(|err| e2b(err.into()))?;
    // A sandbox of an operator's template may start from an image on the server's host
    // (`oci:`): its snapshot may too. Any other host access is the client's, and refused.
    let mut spec = m.spec.clone();
    if s.config
        .templates
        .iter()
        .any(|t| t.image.is_some() && t.image == spec.image)
    {
        spec.image = None;
    }
    crate::access::check_spec(&s.config, &spec, true).map_err(e2b)?;
    crate::routes::admit::room(s, 1).map_err(e2b)?;
    let sandbox = s
        .provider
        .restore(store.as_ref(), &snap.sid)
        .await
        .map_err(|err| e2b(err.into()))?;
    if let Some(policy) = opts.network {
        if spec.network.allows_any_network() && policy != spec.network {
            if let Err(err) = sandbox.set_network_policy(policy).await {
                let _ = sandbox.destroy().await;
                return Err(e2b(err.into()));
            }
        }
    }
    let mut meta = Meta::new(snap.e2b_id(), sandbox.spec());
    if let Some(home) = &snap.home {
        meta.home = home.clone();
    }
    meta.timeout_s = opts.timeout;
    meta.auto_pause = opts.auto_pause;
    meta.auto_resume = opts.auto_resume;
    if !opts.public_ports {
        meta.traffic_token = Some(crate::Token::generate());
    }
    let mut lifetime = LifetimeSpec::default();
    lifetime.ttl_s = Some(opts.timeout);
    let info = crate::routes::admit::admit(
        s,
        caller,
        sandbox,
        opts.metadata,
        lifetime,
        Some(snap.sid.clone()),
        Some(meta),
    )
    .await
    .map_err(e2b)?;
    let entry = s.get(&info.id, caller).map_err(e2b)?;
    entry.life.pause_at_deadline(opts.auto_pause);
    let meta = super::meta(&entry);
    Ok((entry, meta))
}

#[derive(Deserialize, Default)]
struct ForkRequest {
    timeout: Option<u64>,
    count: Option<usize>,
}

/// Most forks one request makes (E2B's limit).
const MAX_FORKS: usize = 100;

/// `POST /sandboxes/{id}/fork`: one snapshot, `count` sandboxes from it; each entry of the
/// answer is a sandbox or the error that kept it from starting.
pub(crate) async fn fork(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    b: Result<Bytes, BytesRejection>,
) -> Answer<(StatusCode, Json<Vec<serde_json::Value>>)> {
    let r: ForkRequest = body(b)?;
    let count = r.count.unwrap_or(1);
    if count == 0 || count > MAX_FORKS {
        return Err(failure(
            StatusCode::BAD_REQUEST,
            format!("count {count}: 1 to {MAX_FORKS}"),
        ));
    }
    let timeout = timeout_of(r.timeout, 15)?;
    let e = entry(&s, &caller, &id)?;
    crate::routes::admit::room(&s, count).map_err(e2b)?;
    let sid = take(&s, &caller, &e).await?;
    let snap = Snap {
        sid: sid.clone(),
        owner: caller.clone(),
        sandbox: id,
        name: None,
        home: Some(super::meta(&e).home.clone()),
    };
    let metadata = e.info.labels.clone();
    // Forks are as private as their source: its traffic token's need, its lifecycle.
    let source = super::meta(&e);
    let mut out = Vec::new();
    for _ in 0..count {
        let opts = Restore {
            timeout,
            metadata: metadata.clone(),
            network: None,
            public_ports: source.traffic_token.is_none(),
            auto_pause: source.auto_pause,
            auto_resume: source.auto_resume,
        };
        out.push(match restore(&s, &caller, &snap, opts).await {
            Ok((entry, m)) => {
                let v = sandbox_json(&s, &entry, &m);
                serde_json::json!({ "sandbox": v })
            }
            Err(f) => {
                serde_json::json!({ "error": { "code": f.status.as_u16(), "message": f.message } })
            }
        });
    }
    // The forks have what they need of it (the tiers copy a snapshot's files at restore).
    if let Ok(store) = store(&s, &caller) {
        let _ = store.delete(&sid).await;
    }
    Ok((StatusCode::CREATED, Json(out)))
}
