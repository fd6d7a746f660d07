//! E2B's sandbox metrics (`GET /sandboxes/{id}/metrics`, `GET /sandboxes/metrics`) from the
//! tier's own accounting ([`Sandbox::usage`](sandbox_core::Sandbox::usage): the sandbox's
//! cgroup on the container tier): CPU use over the time since the previous sample, memory
//! held against the sandbox's limit, and disk used on the file system of its home (`df`
//! inside the sandbox, as its user sees it). A sample is taken when asked; the last ones are
//! kept, so a time range returns each of them that falls in it. A tier without usage is a
//! 501 that names it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use time::OffsetDateTime;

use super::control::{e2b, entry, Answer};
use super::{failure, meta, rfc3339, whole_param, Meta};
use crate::auth::Caller;
use crate::{Entry, Shared};

/// Samples kept per sandbox.
const KEPT: usize = 120;

/// Most sandboxes one batch request names.
const MAX_BATCH: usize = 100;

/// One sample of a sandbox's use.
#[derive(Clone)]
pub(crate) struct Sample {
    at: OffsetDateTime,
    cpu_us: u64,
    cpu_pct: f64,
    mem: u64,
    disk: (u64, u64),
}

/// A sandbox's samples, oldest first.
#[derive(Default)]
pub(crate) struct Samples(Mutex<VecDeque<Sample>>);

/// A new sample of `e`'s use, kept with the others.
async fn sample(e: &Entry, m: &Meta) -> Answer<Sample> {
    let u = e.sandbox.usage().await.map_err(|err| e2b(err.into()))?;
    // A paused sandbox runs nothing, `df` included: its last disk figures stand.
    let last_disk = m
        .samples
        .0
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .back()
        .map(|s| s.disk);
    let disk = match (e.life.state(), last_disk) {
        (crate::api::SandboxState::Paused, Some(d)) => d,
        (crate::api::SandboxState::Paused, None) => (0, e.sandbox.spec().limits.disk_bytes),
        _ => disk(e, m).await,
    };
    let now = OffsetDateTime::now_utc();
    let mut all = m.samples.0.lock().unwrap_or_else(|p| p.into_inner());
    // CPU use since the previous sample (or since the sandbox started), over its CPUs.
    let (since, cpu_before) = all.back().map_or_else(
        || {
            let started = OffsetDateTime::parse(
                &e.info.created_at,
                &time::format_description::well_known::Rfc3339,
            )
            .unwrap_or(now);
            (started, 0)
        },
        |s| (s.at, s.cpu_us),
    );
    let wall_us = (now - since).whole_microseconds().max(1) as f64;
    let used = u.cpu_time_us.saturating_sub(cpu_before) as f64;
    let cpu_pct = (100.0 * used / (wall_us * f64::from(m.cpus.max(1)))).clamp(0.0, 100.0);
    let s = Sample {
        at: now,
        cpu_us: u.cpu_time_us,
        cpu_pct,
        mem: u.memory_bytes,
        disk,
    };
    all.push_back(s.clone());
    while all.len() > KEPT {
        all.pop_front();
    }
    Ok(s)
}

/// Bytes used and in all on the file system of the sandbox's home, as `df` in it says;
/// `(0, limit)` when it cannot say (no `df`).
async fn disk(e: &Entry, m: &Meta) -> (u64, u64) {
    let req = sandbox_core::ExecRequest::argv(["df", "-P", "-k", m.home.as_str()]);
    let limit = e.sandbox.spec().limits.disk_bytes;
    let Ok(r) = e.sandbox.exec(req).await else {
        return (0, limit);
    };
    let out = String::from_utf8_lossy(&r.stdout);
    // Filesystem 1024-blocks Used Available Capacity Mounted-on
    let fields: Vec<&str> = out
        .lines()
        .nth(1)
        .unwrap_or("")
        .split_whitespace()
        .collect();
    match (
        fields.get(1).and_then(|v| v.parse::<u64>().ok()),
        fields.get(2).and_then(|v| v.parse::<u64>().ok()),
    ) {
        (Some(total), Some(used)) if r.exit_code == Some(0) => {
            (used.saturating_mul(1024), total.saturating_mul(1024))
        }
        _ => (0, limit),
    }
}

fn json(s: &Sample, e: &Entry, m: &Meta) -> serde_json::Value {
    serde_json::json!({
        "timestamp": rfc3339(s.at),
        "timestampUnix": s.at.unix_timestamp(),
        "cpuCount": m.cpus,
        "cpuUsedPct": (s.cpu_pct * 100.0).round() / 100.0,
        "memUsed": s.mem,
        "memTotal": e.sandbox.spec().limits.memory_bytes,
        "memCache": 0,
        "diskUsed": s.disk.0,
        "diskTotal": s.disk.1,
    })
}

/// `GET /sandboxes/{id}/metrics[?start=UNIX][&end=UNIX]`.
pub(crate) async fn one(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Answer<Json<Vec<serde_json::Value>>> {
    let unix = "a Unix time in seconds";
    let start = whole_param(&q, "start", i64::MAX, unix)?;
    let end = whole_param(&q, "end", i64::MAX, unix)?;
    let e = entry(&s, &caller, &id)?;
    let m = meta(&e);
    sample(&e, &m).await?;
    let all = m
        .samples
        .0
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(Json(
        all.iter()
            .filter(|x| start.is_none_or(|t| x.at.unix_timestamp() >= t))
            .filter(|x| end.is_none_or(|t| x.at.unix_timestamp() <= t))
            .map(|x| json(x, &e, &m))
            .collect(),
    ))
}

/// `GET /sandboxes/metrics?sandbox_ids=A,B`: each named sandbox of the caller's that runs,
/// with a sample of now.
pub(crate) async fn batch(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Answer<Json<serde_json::Value>> {
    let ids: Vec<&str> = q
        .get("sandbox_ids")
        .map(|v| v.split(',').filter(|i| !i.is_empty()).collect())
        .unwrap_or_default();
    if ids.is_empty() || ids.len() > MAX_BATCH {
        return Err(failure(
            StatusCode::BAD_REQUEST,
            format!("`sandbox_ids`: 1 to {MAX_BATCH} ids, comma-separated"),
        ));
    }
    let mut out = serde_json::Map::new();
    for id in ids {
        // Another client's or an ended sandbox is left out, as one that does not run.
        let Ok(e) = s.get(id, &caller) else { continue };
        let m = meta(&e);
        if let Ok(x) = sample(&e, &m).await {
            out.insert(id.to_string(), json(&x, &e, &m));
        }
    }
    Ok(Json(serde_json::json!({ "sandboxes": out })))
}
