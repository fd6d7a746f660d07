//! The facade with a real (test-only, unisolated) backend registered by hand.

// In tests a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use agent_sandbox::{
    ExecRequest, Language, MapSecretSource, Phase, Question, Runtime, SandboxSpec, Tier, TierChoice,
};
use backend_unisolated::UnisolatedBackend;

fn runtime() -> Runtime {
    Runtime::builder()
        .backend(Arc::new(UnisolatedBackend::new_without_isolation()))
        .secret_source(Arc::new(
            MapSecretSource::new().with("TOKEN", "s3cr3t-value"),
        ))
        .build()
}

#[tokio::test]
async fn explicit_tier_runs_and_timeline_has_first_command() {
    let rt = runtime();
    let spec = SandboxSpec::builder(Language::Shell)
        .secret_env("TOKEN", "T")
        .build()
        .unwrap();
    let out = rt
        .run_once(
            &spec,
            TierChoice::Tier(Tier::Unisolated),
            ExecRequest::code("echo $T; echo hi"),
        )
        .await
        .unwrap();
    let (tier, r) = (out.tier, out.result);
    assert!(out.network.is_empty());
    assert_eq!(tier, Tier::Unisolated);
    assert_eq!(r.stdout_str(), "[REDACTED:TOKEN]\nhi\n");
    let phases: Vec<Phase> = r.timeline.phases.iter().map(|p| p.phase).collect();
    assert_eq!(phases.first(), Some(&Phase::Allocation));
    assert_eq!(phases.last(), Some(&Phase::FirstCommand));
}

#[tokio::test]
async fn auto_never_picks_the_unisolated_backend() {
    let rt = runtime();
    let probes = rt.probe().await;
    assert!(probes
        .iter()
        .any(|s| s.tier == Tier::Unisolated && s.available));
    for lang in [Language::Shell, Language::Python, Language::Javascript] {
        let mut q = Question::new(lang);
        q.allow_weaker_isolation = true;
        let sel = rt.select(&q).await;
        assert_ne!(sel.chosen, Some(Tier::Unisolated));
        let spec = SandboxSpec::new(lang);
        let err = rt
            .create(&spec, TierChoice::Auto(q))
            .await
            .err()
            .expect("no product tier here");
        assert!(err.to_string().contains("no acceptable tier"), "{err}");
    }
}

#[tokio::test]
async fn missing_secret_and_unsupported_language_are_typed_errors() {
    let rt = runtime();
    let spec = SandboxSpec::builder(Language::Shell)
        .secret_env("MISSING", "M")
        .build()
        .unwrap();
    let e = rt
        .create(&spec, TierChoice::Tier(Tier::Unisolated))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, agent_sandbox::Error::Secret { .. }), "{e}");
    let e = rt
        .create(
            &SandboxSpec::new(Language::C),
            TierChoice::Tier(Tier::Unisolated),
        )
        .await
        .err()
        .unwrap();
    assert!(matches!(e, agent_sandbox::Error::Unsupported { .. }), "{e}");
    // a network policy the backend cannot enforce is refused, not ignored
    let spec = SandboxSpec::builder(Language::Shell)
        .network(agent_sandbox::NetworkPolicy::allow_hosts(["example.com"]).unwrap())
        .build()
        .unwrap();
    let e = rt
        .create(&spec, TierChoice::Tier(Tier::Unisolated))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, agent_sandbox::Error::Unsupported { .. }), "{e}");
}
