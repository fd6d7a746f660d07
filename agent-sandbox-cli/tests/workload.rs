//! The agent-workload benchmark at tiny scale on every tier this host runs (skipped only on
//! the probe's word): no turn may fail, and the report must hold every table, the JSON and
//! four valid SVG plots. Nothing here asserts on time.

use std::sync::Arc;

use agent_sandbox::{Language, Runtime, Tier};
use sandbox_bench::{workload_spec, Config, DynTarget, SandboxTarget, TurnKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_workload_on_every_available_tier() {
    let rt = Runtime::new();
    let mut targets: Vec<DynTarget> = Vec::new();
    for tier in Tier::PRODUCT {
        let Some(backend) = rt.backend(tier) else {
            println!("SKIP: {tier}: not built into this test binary");
            continue;
        };
        let st = backend.probe().await;
        if !st.available {
            println!("SKIP: {tier}: {}", st.reason);
            continue;
        }
        let spec = workload_spec(Language::Python, None).unwrap();
        targets.push(Arc::new(SandboxTarget::new(
            tier.name(),
            backend.clone(),
            spec,
            "",
        )));
    }
    if targets.is_empty() {
        println!("SKIP: no tier available on this host");
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let mut cfg = Config::quick();
    cfg.sessions = vec![2];
    cfg.turns = 3;
    cfg.think_ms = 0.0;
    cfg.seed = 7;
    cfg.out = out.path().to_path_buf();
    cfg.density = true;
    cfg.density_cap = 3;
    cfg.density_seconds = 60;
    let report = sandbox_bench::run_workload(&targets, cfg, &|l| println!("{l}")).await;
    report.write(out.path()).unwrap();

    assert_eq!(report.total_errors(), 0, "failures: {:#?}", report.errors);
    for t in &report.targets {
        assert!(
            t.plan.available.is_ok(),
            "{}: available by its probe but not runnable: {:?}",
            t.name,
            t.plan.available
        );
        // Every tier runs Python, so the dependency turn.
        assert!(t.plan.runs(TurnKind::Deps), "{}", t.name);
        assert_eq!(t.scales.len(), 1, "{}", t.name);
        let s = &t.scales[0];
        assert_eq!((s.sessions, s.opened, s.errors), (2, 2, 0), "{}", t.name);
        assert_eq!(
            s.turns_run + s.turns_skipped,
            6,
            "{}: every scheduled turn is run or skipped",
            t.name
        );
        assert!(s.by_kind.contains_key("deps"), "{}", t.name);
        assert_eq!(s.latency_samples_us.len() as u64, s.turns_run);
        assert_eq!(
            s.first_useful_ms.count, 2,
            "{}: both sessions got a useful result",
            t.name
        );
        let d = t.density.as_ref().unwrap().as_ref().unwrap();
        assert_eq!(d.held, 3, "{}: density stopped early: {}", t.name, d.limit);
        assert!(d.limit.contains("safety cap"), "{}", d.limit);
        assert_eq!(d.close_errors, 0);
        // The wasm tier has no shell: its plan says so rather than failing the turn.
        if t.name == "wasm" {
            let why = t.plan.kinds[&TurnKind::Shell].as_ref().unwrap_err();
            assert!(why.contains("no shell"), "{why}");
        }
    }

    let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    for heading in [
        "### Targets",
        "### The turn mix",
        "### Latency, throughput, CPU and memory per target × N",
        "### Turn latency per kind",
        "### Density",
        "### Errors",
        "### Plots",
    ] {
        assert!(md.contains(heading), "report.md lacks `{heading}`:\n{md}");
    }
    for t in &report.targets {
        assert!(
            md.contains(&format!("| {} | 2 | 2 |", t.name)),
            "no row for {}",
            t.name
        );
    }
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("results.json")).unwrap()).unwrap();
    assert_eq!(
        json["targets"].as_array().unwrap().len(),
        report.targets.len()
    );
    for (file, _) in sandbox_bench::plot::PLOTS {
        let svg = std::fs::read_to_string(out.path().join(file)).unwrap();
        assert!(svg.trim_start().starts_with("<svg"), "{file}: not an SVG");
        assert!(svg.trim_end().ends_with("</svg>"), "{file}: truncated");
        assert!(
            svg.contains("<polyline") || svg.contains("<rect") || svg.contains("<path"),
            "{file}: nothing drawn"
        );
        assert!(
            md.contains(&format!("]({file})")),
            "report.md does not link {file}"
        );
    }
}
