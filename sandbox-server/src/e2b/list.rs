//! Listing sandboxes as E2B's API does (`GET /sandboxes`, `GET /v2/sandboxes`): the
//! caller's only, filtered by metadata (its v1 labels), state, template and start time,
//! newest first unless asked otherwise, in pages.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use time::OffsetDateTime;

use super::control::{bad, Answer, MAX_TIMEOUT_S};
use super::{meta, rfc3339, Meta, ENVD_VERSION};
use crate::api::SandboxState;
use crate::auth::Caller;
use crate::{Entry, Shared};

/// When the sandbox ends, as a time of day (a day from now when nothing ends it).
pub(super) fn end_at(e: &Entry) -> OffsetDateTime {
    match e.life.deadline_at() {
        Some(at) => OffsetDateTime::from(at),
        None => OffsetDateTime::now_utc() + Duration::from_secs(MAX_TIMEOUT_S),
    }
}

pub(super) fn state_name(e: &Entry) -> &'static str {
    match e.life.state() {
        SandboxState::Paused => "paused",
        _ => "running",
    }
}

/// E2B's `ListedSandbox`.
pub(super) fn listed_json(e: &Entry, m: &Meta) -> serde_json::Value {
    serde_json::json!({
        "templateID": m.template,
        "alias": m.template,
        "sandboxID": e.info.id,
        "clientID": "agent-sandbox",
        "startedAt": e.info.created_at,
        "endAt": rfc3339(end_at(e)),
        "cpuCount": m.cpus,
        "memoryMB": m.memory_mib,
        "diskSizeMB": m.disk_mib,
        "metadata": e.info.labels,
        "state": state_name(e),
        "envdVersion": ENVD_VERSION,
    })
}

/// E2B's metadata filter: `k=v&k2=v2`, URL-encoded as one query value.
fn metadata_filter(q: Option<&str>) -> Answer<Vec<(String, String)>> {
    let Some(q) = q else { return Ok(Vec::new()) };
    let mut want = Vec::new();
    for pair in q.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| bad(format!("metadata filter `{pair}` is not key=value")))?;
        want.push((decode(k)?, decode(v)?));
    }
    Ok(want)
}

fn decode(s: &str) -> Answer<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| bad(format!("`{s}` has a bad %-escape")))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| bad(format!("`{s}` is not UTF-8")))
}

/// The caller's sandboxes that match, newest first unless `asc`.
fn listing(
    s: &Shared,
    caller: &Caller,
    want: &[(String, String)],
    states: &[String],
    asc: bool,
) -> Vec<(Arc<Entry>, Arc<Meta>)> {
    let mut all: Vec<Arc<Entry>> = s
        .lock()
        .values()
        .filter(|e| &e.owner == caller)
        .filter(|e| {
            want.iter()
                .all(|(k, v)| e.info.labels.get(k).is_some_and(|x| x == v))
        })
        .filter(|e| states.is_empty() || states.iter().any(|st| st == state_name(e)))
        .cloned()
        .collect();
    all.sort_by(|a, b| {
        let o = a
            .info
            .created_at
            .cmp(&b.info.created_at)
            .then(a.info.id.cmp(&b.info.id));
        if asc {
            o
        } else {
            o.reverse()
        }
    });
    all.into_iter()
        .map(|e| {
            let m = meta(&e);
            (e, m)
        })
        .collect()
}

pub(super) async fn list_v1(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Answer<Json<Vec<serde_json::Value>>> {
    let want = metadata_filter(q.get("metadata").map(String::as_str))?;
    let running = ["running".to_string()];
    Ok(Json(
        listing(&s, &caller, &want, &running, false)
            .iter()
            .map(|(e, m)| listed_json(e, m))
            .collect(),
    ))
}

/// Most sandboxes one page of `GET /v2/sandboxes` holds.
const MAX_PAGE: usize = 100;

pub(super) async fn list_v2(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<Vec<(String, String)>>,
) -> Answer<Response> {
    let (mut metadata, mut states, mut asc, mut limit, mut next, mut template) =
        (None, Vec::new(), false, MAX_PAGE, None, None);
    let mut started_after: Option<OffsetDateTime> = None;
    for (k, v) in q {
        match k.as_str() {
            "metadata" => metadata = Some(v),
            "state" => states.extend(v.split(',').map(str::to_string)),
            "order" => {
                asc = match v.as_str() {
                    "asc" => true,
                    "desc" => false,
                    o => return Err(bad(format!("order `{o}`: asc or desc"))),
                }
            }
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=MAX_PAGE).contains(l))
                    .ok_or_else(|| bad(format!("limit `{v}`: 1 to {MAX_PAGE}")))?
            }
            "nextToken" => next = Some(v),
            "template" => template = Some(v),
            "startedAfter" => {
                let t = OffsetDateTime::parse(&v, &time::format_description::well_known::Rfc3339)
                    .map_err(|_| bad(format!("startedAfter `{v}` is not an RFC 3339 time")))?;
                started_after = Some(t);
            }
            other => return Err(bad(format!("unknown query parameter `{other}`"))),
        }
    }
    for st in &states {
        if st != "running" && st != "paused" {
            return Err(bad(format!("state `{st}`: running or paused")));
        }
    }
    let want = metadata_filter(metadata.as_deref())?;
    let mut all = listing(&s, &caller, &want, &states, asc);
    if let Some(t) = &template {
        all.retain(|(_, m)| &m.template == t);
    }
    if let Some(after) = started_after {
        all.retain(|(e, _)| {
            OffsetDateTime::parse(
                &e.info.created_at,
                &time::format_description::well_known::Rfc3339,
            )
            .is_ok_and(|c| c >= after)
        });
    }
    // The token is the last id of the page before; what follows it in this order.
    let start = match &next {
        Some(t) => all
            .iter()
            .position(|(e, _)| &e.info.id == t)
            .map(|i| i + 1)
            .ok_or_else(|| {
                bad("`nextToken` is not one this server gave (or that sandbox ended)")
            })?,
        None => 0,
    };
    let page: Vec<_> = all.iter().skip(start).take(limit).collect();
    let more = start + page.len() < all.len();
    let body: Vec<_> = page.iter().map(|(e, m)| listed_json(e, m)).collect();
    let mut headers = HeaderMap::new();
    if more {
        if let Some(last) = page.last() {
            if let Ok(v) = HeaderValue::from_str(&last.0.info.id) {
                headers.insert("x-next-token", v);
            }
        }
    }
    Ok((headers, Json(body)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filters_are_decoded() {
        assert_eq!(
            metadata_filter(Some("a=b%20c&d=e+f")).unwrap(),
            [("a".into(), "b c".into()), ("d".into(), "e f".into())]
        );
        assert!(metadata_filter(Some("a")).is_err());
        assert!(metadata_filter(Some("a=%zz")).is_err());
        assert!(metadata_filter(Some("a=%c3")).is_err());
    }
}
