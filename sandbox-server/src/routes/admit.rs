//! Admitting new sandboxes (create, restore, fork, and the runs of `POST /v1/run`): room for
//! them under the server's limit, their lifetime checked, their entries put in the table.

use std::sync::Arc;

use axum::http::StatusCode;
use sandbox_core::{Sandbox, SnapshotId};

use crate::api::{LifetimeSpec, SandboxInfo};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::lifetime::Lifetime;
use crate::{Entry, Shared};

/// Refuses a lifetime of zero seconds (a typo, not a wish).
pub(super) fn check_lifetime(l: &LifetimeSpec) -> Result<(), ApiError> {
    if l.ttl_s == Some(0) || l.idle_timeout_s == Some(0) {
        return Err(ApiError::bad_request(
            "`ttl_s` and `idle_timeout_s` are whole seconds, at least 1 (omit them for none)",
        ));
    }
    const MAX_S: u64 = 10 * 365 * 24 * 3600;
    if l.ttl_s.is_some_and(|t| t > MAX_S) || l.idle_timeout_s.is_some_and(|t| t > MAX_S) {
        return Err(ApiError::bad_request(format!(
            "`ttl_s` and `idle_timeout_s` are at most {MAX_S} seconds (ten years; omit them for none)"
        )));
    }
    Ok(())
}

/// Refuses a request for `n` more sandboxes than the server has room for (the runs of
/// `POST /v1/run` count).
pub(crate) fn room(s: &Shared, n: usize) -> Result<(), ApiError> {
    let running = s.running.load(std::sync::atomic::Ordering::SeqCst);
    if s.lock().len() + running + n > s.config.max_sandboxes {
        return Err(full(s.config.max_sandboxes));
    }
    Ok(())
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// Puts a new sandbox in the table, or destroys it: when its tier cannot honour the
/// lifetime (pausing without pause), or when creates that raced past [`room`] filled the
/// server meanwhile. `e2b`: the E2B side the entry starts with (E2B's creates: set before
/// any other request can see the entry; API v1's pass `None`).
pub(crate) async fn admit(
    s: &Shared,
    caller: &Caller,
    sandbox: Box<dyn Sandbox>,
    labels: std::collections::BTreeMap<String, String>,
    lifetime: LifetimeSpec,
    from_snapshot: Option<SnapshotId>,
    e2b: Option<crate::e2b::Meta>,
) -> Result<SandboxInfo, ApiError> {
    let sandbox: Arc<dyn Sandbox> = Arc::from(sandbox);
    let tier = sandbox.tier();
    let pauses =
        lifetime.idle_timeout_s.is_some() && lifetime.on_idle == crate::api::IdleAction::Pause;
    if pauses
        && !s
            .provider
            .capabilities(tier)
            .is_some_and(|c| c.pause_resume)
    {
        let _ = sandbox.destroy().await;
        return Err(ApiError::from(sandbox_core::Error::unsupported(
            tier,
            "pausing an idle sandbox (this tier has no pause/resume: use `\"on_idle\": \"destroy\"`)",
        )));
    }
    let mut info = SandboxInfo::new(sandbox.id(), tier, now_rfc3339());
    info.labels = labels;
    info.lifetime = lifetime;
    info.from_snapshot = from_snapshot;
    let admitted = {
        let mut all = s.lock();
        let room = all.len() < s.config.max_sandboxes;
        if room {
            all.insert(
                info.id.clone(),
                Arc::new(Entry {
                    sandbox: Arc::clone(&sandbox),
                    info: info.clone(),
                    life: Lifetime::new(lifetime),
                    owner: caller.clone(),
                    procs: Default::default(),
                    e2b: e2b
                        .map(|m| std::sync::OnceLock::from(Arc::new(m)))
                        .unwrap_or_default(),
                }),
            );
        }
        room
    };
    if !admitted {
        let _ = sandbox.destroy().await;
        return Err(full(s.config.max_sandboxes));
    }
    Ok(info)
}

/// The server holds `max` sandboxes already.
fn full(max: usize) -> ApiError {
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "resource_exhausted",
        format!("this server holds its limit of {max} sandboxes; destroy one first"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifetimes_are_whole_seconds_up_to_ten_years() {
        let mut l = LifetimeSpec::default();
        assert!(check_lifetime(&l).is_ok());
        l.ttl_s = Some(0);
        assert!(check_lifetime(&l).is_err());
        l.ttl_s = Some(10 * 365 * 24 * 3600);
        assert!(check_lifetime(&l).is_ok());
        // Past that a deadline would overflow what a clock holds (it once panicked).
        l.ttl_s = Some(u64::MAX);
        assert!(check_lifetime(&l).is_err());
        l.ttl_s = None;
        l.idle_timeout_s = Some(1 << 63);
        assert!(check_lifetime(&l).is_err());
    }
}
