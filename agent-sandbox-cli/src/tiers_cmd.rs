//! `probe`, `select` and `cleanup`: what each tier can do on this host, which one a workload
//! would get, and what processes that died left behind, per tier.

use std::collections::BTreeMap;
use std::process::ExitCode;

use agent_sandbox::{Tier, TierStatus};
use serde_json::json;

use crate::args::QuestionArgs;
use crate::{cli_runtime, print_json, EXIT_USAGE};

/// `probe`: every tier, available or not, why, and how to fix it.
pub(crate) async fn probe(json: bool) -> ExitCode {
    let runtime = cli_runtime();
    let statuses = runtime.probe().await;
    // What each built-in tier can do, including the limits it enforces.
    let caps = |t: Tier| runtime.backend(t).map(|b| b.capabilities());
    if json {
        let tiers: Vec<_> = statuses
            .iter()
            .map(|s| {
                let mut v = status_json(s);
                v["capabilities"] = json!(caps(s.tier));
                v
            })
            .collect();
        print_json(&json!({ "tiers": tiers }));
    } else {
        for s in &statuses {
            let mark = if s.available {
                "available  "
            } else {
                "unavailable"
            };
            println!("{:<10} {mark}  {}", s.tier.name(), s.reason);
            if let Some(fix) = &s.fix {
                println!("{:<10} {:<11}  fix: {fix}", "", "");
            }
            for (k, v) in &s.details {
                println!("{:<10} {:<11}  {k}: {v}", "", "");
            }
            if let Some(c) = caps(s.tier) {
                let limits: Vec<&str> = c.limits.iter().map(|l| l.name()).collect();
                println!("{:<10} {:<11}  enforces: {}", "", "", limits.join(", "));
            }
        }
    }
    ExitCode::SUCCESS
}

/// `select`: the tiers ranked for a workload, and the first this host can run.
pub(crate) async fn select(q: QuestionArgs, json: bool) -> ExitCode {
    let Some(lang) = q.lang else {
        eprintln!("agent-sandbox: select needs --lang (python, javascript, wasm, shell, node, c)");
        return ExitCode::from(EXIT_USAGE);
    };
    let sel = cli_runtime().select(&q.question(lang)).await;
    if json {
        let reasons: BTreeMap<&str, &str> = sel
            .ranking
            .iter()
            .map(|r| (r.tier.name(), r.reason.as_str()))
            .collect();
        print_json(&json!({
            "ranking": sel.ranking.iter().map(|r| r.tier.name()).collect::<Vec<_>>(),
            "chosen": sel.chosen.map(|t| t.name()),
            "reasons": reasons,
            "statuses": sel.statuses.iter().map(status_json).collect::<Vec<_>>(),
        }));
    } else {
        for (i, (r, s)) in sel.ranking.iter().zip(&sel.statuses).enumerate() {
            let avail = if s.available {
                "available"
            } else {
                "unavailable"
            };
            println!(
                "{}. {:<10} {}  [{avail}: {}]",
                i + 1,
                r.tier.name(),
                r.reason,
                s.reason
            );
        }
        match sel.chosen {
            Some(t) => println!("chosen: {t}"),
            None => println!("chosen: none (no acceptable tier is available on this host)"),
        }
    }
    ExitCode::SUCCESS
}

/// `cleanup`: what dead processes left, removed per tier.
pub(crate) async fn cleanup(json: bool) -> ExitCode {
    let runtime = cli_runtime();
    let mut rows = Vec::new();
    for tier in Tier::PRODUCT {
        if let Some(b) = runtime.backend(tier) {
            rows.push((tier, b.cleanup_stale_report().await));
        }
    }
    if json {
        let tiers: Vec<serde_json::Value> = rows
            .iter()
            .map(|(t, r)| match r {
                Ok(r) => json!({
                    "tier": t.name(),
                    "removed": r.removed,
                    "thawed": r.thawed,
                }),
                Err(e) => json!({ "tier": t.name(), "error": e.to_string() }),
            })
            .collect();
        print_json(&json!({ "tiers": tiers }));
    } else {
        for (t, r) in &rows {
            match r {
                Ok(r) if r.thawed.is_empty() => {
                    println!("{:<10} removed {}", t.name(), r.removed)
                }
                Ok(r) => println!(
                    "{:<10} removed {}, of which paused or frozen and thawed first: {}",
                    t.name(),
                    r.removed,
                    r.thawed.join(", ")
                ),
                Err(e) => println!("{:<10} not checked: {e}", t.name()),
            }
        }
    }
    ExitCode::SUCCESS
}

fn status_json(s: &TierStatus) -> serde_json::Value {
    json!({
        "tier": s.tier,
        "available": s.available,
        "reason": s.reason,
        "fix": s.fix,
        "details": s.details,
    })
}
