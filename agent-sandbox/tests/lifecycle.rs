//! One lifecycle, every tier: pause while paused, exec while paused, resume while live,
//! destroy twice and any call after destroy answer the same way on each tier this host can
//! run (the table in `sandbox_core::lifecycle`). A tier the probe reports unavailable is
//! skipped with its reason.

use agent_sandbox::{Error, ExecRequest, Language, Runtime, SandboxSpec, Tier, TierChoice};

/// A language each tier runs code strings in.
fn language(tier: Tier) -> Language {
    match tier {
        Tier::Wasm => Language::Javascript,
        _ => Language::Shell,
    }
}

fn code(tier: Tier) -> &'static str {
    match tier {
        Tier::Wasm => "console.log('ok')",
        _ => "echo ok",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_available_tier_follows_the_same_lifecycle() {
    let rt = Runtime::new();
    let mut ran = 0;
    for status in rt.probe().await {
        let tier = status.tier;
        if !status.available {
            eprintln!("SKIP {tier}: {}", status.reason);
            continue;
        }
        let spec = SandboxSpec::builder(language(tier)).build().unwrap();
        let sb = rt.create(&spec, TierChoice::Tier(tier)).await.unwrap();
        let caps = rt.backend(tier).unwrap().capabilities();
        let ok = |r: &agent_sandbox::ExecResult| {
            assert!(r.success(), "{tier}: {r:?}");
            assert_eq!(r.stdout_str(), "ok\n", "{tier}");
        };
        ok(&sb.exec(ExecRequest::code(code(tier))).await.unwrap());

        if caps.pause_resume {
            // Resuming a live sandbox and pausing a paused one change nothing.
            sb.resume().await.unwrap();
            sb.pause().await.unwrap();
            sb.pause().await.unwrap();
            match sb.exec(ExecRequest::code(code(tier))).await {
                Err(Error::SandboxPaused { id }) => assert_eq!(id, sb.id(), "{tier}"),
                other => panic!("{tier}: exec while paused gave {other:?}"),
            }
            sb.resume().await.unwrap();
            sb.resume().await.unwrap();
            ok(&sb.exec(ExecRequest::code(code(tier))).await.unwrap());
        } else {
            assert!(
                matches!(sb.pause().await, Err(Error::Unsupported { .. })),
                "{tier}: pause without the capability"
            );
        }

        sb.destroy().await.unwrap();
        sb.destroy().await.unwrap();
        match sb.exec(ExecRequest::code(code(tier))).await {
            Err(Error::SandboxGone { id, reason }) => {
                assert_eq!(id, sb.id(), "{tier}");
                assert_eq!(reason, "destroyed", "{tier}");
            }
            other => panic!("{tier}: exec after destroy gave {other:?}"),
        }
        if caps.pause_resume {
            assert!(
                matches!(sb.pause().await, Err(Error::SandboxGone { .. })),
                "{tier}: pause after destroy"
            );
        }
        ran += 1;
    }
    eprintln!("{ran} tier(s) checked");
}
