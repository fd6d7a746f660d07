//! E2B's sandbox logs (`GET /sandboxes/{id}/logs`, `GET /v2/sandboxes/{id}/logs`): what
//! happened to a sandbox as the server saw it: its lifecycle through E2B's API (created,
//! paused, resumed, its timeout and network changed), the commands envd started and how they
//! ended, and every egress decision its policy made (a connection allowed, or refused with the
//! rule that refused it: [`Sandbox::network_events`](sandbox_core::Sandbox::network_events)).
//! The last [`KEPT`] lines are kept per sandbox, each message and field cut at [`MAX_TEXT`]
//! bytes; nothing a command prints is logged (its command line is: the owner's own input,
//! seen only by the owner).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use time::OffsetDateTime;

use super::control::{entry, Answer};
use super::{failure, meta, rfc3339, whole_param};
use crate::auth::Caller;
use crate::Shared;

/// Lines kept per sandbox (E2B's largest page).
pub(crate) const KEPT: usize = 1000;

/// Longest message or field value kept, in bytes (a command line can be megabytes long: the
/// log keeps its start, marked cut).
pub(crate) const MAX_TEXT: usize = 1024;

/// `s` cut to at most [`MAX_TEXT`] bytes (at a character boundary), `…` marking a cut.
fn clip(s: &str) -> String {
    if s.len() <= MAX_TEXT {
        return s.to_string();
    }
    let mut end = MAX_TEXT - '…'.len_utf8();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// How much a line matters (E2B's `LogLevel`, in order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
        }
    }

    fn parse(s: &str) -> Option<Level> {
        [Level::Debug, Level::Info, Level::Warn, Level::Error]
            .into_iter()
            .find(|l| l.name() == s)
    }
}

/// One line.
#[derive(Clone, Debug)]
struct Line {
    at: OffsetDateTime,
    level: Level,
    message: String,
    fields: BTreeMap<String, String>,
}

impl Line {
    fn text(&self) -> String {
        let mut t = self.message.clone();
        for (k, v) in &self.fields {
            t.push_str(&format!(" {k}={v}"));
        }
        t
    }

    fn entry_json(&self) -> serde_json::Value {
        serde_json::json!({
            "timestamp": rfc3339(self.at),
            "level": self.level.name(),
            "message": self.message,
            "fields": self.fields,
        })
    }

    fn ms(&self) -> i128 {
        self.at.unix_timestamp_nanos() / 1_000_000
    }
}

/// A sandbox's log, oldest first.
#[derive(Default)]
pub(crate) struct Log(Mutex<VecDeque<Line>>);

impl Log {
    /// Adds a line (the oldest goes past [`KEPT`]).
    pub(crate) fn push(&self, level: Level, message: &str, fields: &[(&str, String)]) {
        let line = Line {
            at: OffsetDateTime::now_utc(),
            level,
            message: clip(message),
            fields: fields
                .iter()
                .map(|(k, v)| ((*k).to_string(), clip(v)))
                .collect(),
        };
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if all.len() >= KEPT {
            all.pop_front();
        }
        all.push_back(line);
    }

    fn lines(&self) -> Vec<Line> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

/// Everything known about `e`'s sandbox, oldest first: its log and its egress decisions.
async fn gather(e: &crate::Entry) -> Vec<Line> {
    let mut all = meta(e).log.lines();
    // A sandbox that ended has no events to give; its own log stands.
    if let Ok(events) = e.sandbox.network_events().await {
        for ev in events {
            let mut fields = BTreeMap::new();
            let mut put = |k: &str, v: String| {
                fields.insert(k.to_string(), clip(&v));
            };
            put("via", ev.via.clone());
            if let Some(h) = &ev.host {
                put("host", h.clone());
            }
            if let Some(ip) = ev.ip {
                put("ip", ip.to_string());
            }
            put("port", ev.port.to_string());
            put("rule", ev.rule.clone());
            if let Some(err) = &ev.error {
                put("error", err.clone());
            }
            all.push(Line {
                at: OffsetDateTime::from(ev.time),
                level: if ev.allowed { Level::Info } else { Level::Warn },
                message: if ev.allowed {
                    "egress allowed".into()
                } else {
                    "egress refused".into()
                },
                fields,
            });
        }
    }
    all.sort_by_key(|l| l.at);
    let skip = all.len().saturating_sub(2 * KEPT);
    all.drain(..skip);
    all
}

/// `GET /sandboxes/{id}/logs[?start=MS][&limit=N]`: lines from `start` on (milliseconds),
/// oldest first, as text (`logs`) and structured (`logEntries`).
pub(crate) async fn v1(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Answer<Json<serde_json::Value>> {
    let count = "a whole number from 0";
    let start = whole_param(&q, "start", i64::MAX, count)?.unwrap_or(0);
    let limit = whole_param(&q, "limit", i64::MAX, count)?.unwrap_or(KEPT as i64);
    let e = entry(&s, &caller, &id)?;
    let lines: Vec<Line> = gather(&e)
        .await
        .into_iter()
        .filter(|l| l.ms() >= i128::from(start))
        .take(usize::try_from(limit).unwrap_or(usize::MAX))
        .collect();
    Ok(Json(serde_json::json!({
        "logs": lines
            .iter()
            .map(|l| serde_json::json!({ "timestamp": rfc3339(l.at), "line": l.text() }))
            .collect::<Vec<_>>(),
        "logEntries": lines.iter().map(Line::entry_json).collect::<Vec<_>>(),
    })))
}

/// `GET /v2/sandboxes/{id}/logs[?cursor=MS][&limit=N][&direction=forward|backward]
/// [&level=L][&search=TEXT]`: forward, the lines from `cursor` on, oldest first; backward,
/// those up to `cursor` (default: now), newest first; at or above `level`, containing
/// `search` in the message or a field.
pub(crate) async fn v2(
    State(s): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Answer<Json<serde_json::Value>> {
    let cursor = whole_param(&q, "cursor", i64::MAX, "a whole number from 0")?;
    let most = format!("a whole number from 0 to {KEPT}");
    let limit = whole_param(&q, "limit", KEPT as i64, &most)?.unwrap_or(KEPT as i64);
    let backward = match q.get("direction").map(String::as_str) {
        None | Some("forward") => false,
        Some("backward") => true,
        Some(other) => {
            return Err(failure(
                StatusCode::BAD_REQUEST,
                format!("`direction` is `forward` or `backward`, not `{other}`"),
            ))
        }
    };
    let level = match q.get("level") {
        None => Level::Debug,
        Some(l) => Level::parse(l).ok_or_else(|| {
            failure(
                StatusCode::BAD_REQUEST,
                format!("`level` is debug, info, warn or error, not `{l}`"),
            )
        })?,
    };
    let search = q.get("search").cloned().unwrap_or_default();
    let e = entry(&s, &caller, &id)?;
    let mut lines: Vec<Line> = gather(&e)
        .await
        .into_iter()
        .filter(|l| l.level >= level)
        .filter(|l| {
            search.is_empty()
                || l.message.contains(&search)
                || l.fields
                    .iter()
                    .any(|(k, v)| k.contains(&search) || v.contains(&search))
        })
        .filter(|l| match (cursor, backward) {
            (None, _) => true,
            (Some(c), false) => l.ms() >= i128::from(c),
            (Some(c), true) => l.ms() <= i128::from(c),
        })
        .collect();
    if backward {
        lines.reverse();
    }
    lines.truncate(usize::try_from(limit).unwrap_or(KEPT));
    Ok(Json(serde_json::json!({
        "logs": lines.iter().map(Line::entry_json).collect::<Vec<_>>(),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_its_last_lines_in_order() {
        let log = Log::default();
        for i in 0..(KEPT + 5) {
            log.push(Level::Info, "line", &[("n", i.to_string())]);
        }
        let lines = log.lines();
        assert_eq!(lines.len(), KEPT);
        assert_eq!(lines[0].fields["n"], "5");
        assert_eq!(lines[KEPT - 1].text(), format!("line n={}", KEPT + 4));
        assert!(Level::Warn > Level::Info && Level::parse("error") == Some(Level::Error));
        assert_eq!(Level::parse("loud"), None);
        // A long command line is kept cut, at a character boundary.
        log.push(
            Level::Info,
            "process started",
            &[("cmd", "é".repeat(10_000))],
        );
        let cmd = &log.lines()[KEPT - 1].fields["cmd"];
        assert!(cmd.len() <= MAX_TEXT && cmd.ends_with('…'), "{}", cmd.len());
    }
}
