//! `POST /v1/run`: one command in a fresh sandbox that is destroyed after it, in one
//! request. What a one-shot client (the CLI's `run` through the local daemon) needs, without
//! the four requests of create, exec, network events and destroy: the sandbox comes from a
//! warm pool when the server has one for the spec, and its teardown goes on after the answer.
//! The sandbox never enters the table (no other request can reach it); it counts against
//! `max_sandboxes` while it runs.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use sandbox_core::{Phase, Sandbox, TimelineRecorder};

use crate::api::{RunBody, RunReply};
use crate::error::ApiError;
use crate::routes::body::JsonBody;
use crate::Shared;

/// Counts a run in `Shared::running` while it lives.
struct Running<'a>(&'a Shared);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(crate) async fn run(
    State(s): State<Arc<Shared>>,
    JsonBody(body): JsonBody<RunBody>,
) -> Result<Json<RunReply>, ApiError> {
    if let (Some(want), Some(have)) = (&body.build, &s.config.build) {
        if want != have {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "build_mismatch",
                format!("this server is build `{have}`, not `{want}`"),
            ));
        }
    }
    crate::access::check_spec(&s.config, &body.spec, false)?;
    if body.command.tty.is_some() {
        return Err(ApiError::bad_request(
            "`tty` is for spawned processes (`POST /v1/sandboxes/{id}/processes`), not a run",
        ));
    }
    let req = body.command.into_request()?;
    s.running.fetch_add(1, Ordering::SeqCst);
    let _running = Running(&s);
    crate::routes::admit::room(&s, 0)?;
    let mut handing_out = TimelineRecorder::start();
    let (sandbox, from_pool) = s.create_pooled(&body.spec, body.tier).await?;
    handing_out.mark(Phase::Allocation);
    let sandbox: Arc<dyn Sandbox> = Arc::from(sandbox);
    let result = sandbox.exec(req).await;
    let network = sandbox.network_events().await.unwrap_or_default();
    // A pooled sandbox was made before the request: its handing out stands for its creation.
    let created = if from_pool {
        handing_out.finish()
    } else {
        sandbox.timeline().clone()
    };
    let tier = sandbox.tier();
    s.destroy_later(sandbox.id().to_string(), sandbox, None);
    let mut result = result?;
    result.timeline = created.then_first_command(&result.timeline);
    Ok(Json(RunReply::new(tier, result, network)))
}
