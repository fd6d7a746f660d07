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

/// A backend on `tier` that probes available and then either cannot create a sandbox
/// (`Error::Unavailable`, like a wasm tier that could not install Python) or hands the
/// request to the unisolated test backend.
struct Standin {
    tier: Tier,
    works: bool,
}

#[async_trait::async_trait]
impl agent_sandbox::Backend for Standin {
    fn tier(&self) -> Tier {
        self.tier
    }

    fn capabilities(&self) -> agent_sandbox::Capabilities {
        let mut c = UnisolatedBackend::new_without_isolation().capabilities();
        c.tier = self.tier;
        c
    }

    async fn probe(&self) -> agent_sandbox::TierStatus {
        agent_sandbox::TierStatus::available(self.tier, "a test stand-in")
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        secrets: agent_sandbox::ResolvedSecrets,
    ) -> agent_sandbox::Result<Box<dyn agent_sandbox::Sandbox>> {
        if self.works {
            UnisolatedBackend::new_without_isolation()
                .create(spec, secrets)
                .await
        } else {
            Err(agent_sandbox::Error::Unavailable {
                tier: self.tier,
                reason: format!("the {} stand-in cannot create sandboxes", self.tier),
                fix: "nothing to do: a test".into(),
            })
        }
    }
}

fn standins(gvisor_works: bool, microvm_works: bool) -> Runtime {
    Runtime::builder()
        .backend(Arc::new(Standin {
            tier: Tier::Gvisor,
            works: gvisor_works,
        }))
        .backend(Arc::new(Standin {
            tier: Tier::Microvm,
            works: microvm_works,
        }))
        .build()
}

#[tokio::test]
async fn auto_moves_on_when_the_chosen_tier_cannot_create() {
    // Untrusted compute-bound shell ranks gVisor, then the microVM.
    let spec = SandboxSpec::new(Language::Shell);
    let q = Question::new(Language::Shell);
    let sb = standins(false, true)
        .create(&spec, TierChoice::Auto(q))
        .await
        .unwrap();
    let out = sb.exec(ExecRequest::code("echo moved on")).await.unwrap();
    assert_eq!(out.stdout_str(), "moved on\n");
    sb.destroy().await.unwrap();

    // Every tier fails: the first (preferred) tier's error, with its fix.
    let Err(err) = standins(false, false)
        .create(&spec, TierChoice::Auto(q))
        .await
    else {
        panic!("created a sandbox on a stand-in that cannot");
    };
    match err {
        agent_sandbox::Error::Unavailable { tier, .. } => assert_eq!(tier, Tier::Gvisor),
        other => panic!("{other}"),
    }

    // An explicit tier never falls back.
    let Err(err) = standins(false, true)
        .create(&spec, TierChoice::Tier(Tier::Gvisor))
        .await
    else {
        panic!("an explicit tier fell back");
    };
    assert!(
        matches!(err, agent_sandbox::Error::Unavailable { .. }),
        "{err}"
    );
}
