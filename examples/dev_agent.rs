//! A developer agent's six turns in a persistent container sandbox (tier 2): a tiny Python
//! project with a failing test is written into `/workspace`, then the agent
//! (1) reads the repository, (2) runs its tests (they fail), (3) fixes the bug,
//! (4) runs the tests again (they pass), (5) builds it, (6) commits it with git.
//! Every turn prints its output and timeline.
//!
//! `cargo run -p agent-sandbox --example dev_agent` (Linux, root or rootless with user
//! namespaces; see `agent-sandbox probe`).

use std::time::{Duration, Instant};

use agent_sandbox::{
    ExecRequest, ExecResult, Language, Runtime, Sandbox, SandboxSpec, Tier, TierChoice, Timeline,
};

const CALC: &str = r#""""A tiny calculator."""


def add(a, b):
    return a + b


def mean(values):
    """The arithmetic mean of a non-empty list."""
    return sum(values) / (len(values) - 1)  # BUG: off by one
"#;

const TEST_CALC: &str = r#"import unittest

from calc import add, mean


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)


if __name__ == "__main__":
    unittest.main()
"#;

const MAKEFILE: &str = "PY ?= /usr/bin/python3\n\n\
test:\n\t$(PY) -m unittest -v\n\n\
build:\n\t$(PY) -m py_compile calc.py test_calc.py\n\tmkdir -p dist && cp calc.py dist/\n\t@echo built dist/calc.py\n\n\
.PHONY: test build\n";

fn timeline(t: &Timeline) -> String {
    let phases: Vec<String> = t
        .phases
        .iter()
        .map(|p| format!("{} {:.2} ms", p.phase, p.micros as f64 / 1000.0))
        .collect();
    format!(
        "{} (total {:.2} ms)",
        phases.join(", "),
        t.total().as_secs_f64() * 1e3
    )
}

/// Runs one turn's shell command and prints what an agent would read.
async fn turn(
    sb: &dyn Sandbox,
    n: u32,
    title: &str,
    script: &str,
) -> agent_sandbox::Result<ExecResult> {
    println!("\n=== turn {n}: {title}\n$ {script}");
    let started = Instant::now();
    let r = sb
        .exec(ExecRequest::argv(["/bin/sh", "-c", script]))
        .await?;
    print!("{}", r.stdout_str());
    if !r.stderr.is_empty() {
        print!("{}", r.stderr_str());
    }
    println!(
        "--- exit {:?}{} in {:.1} ms; timeline: {}",
        r.exit_code,
        r.limit
            .map(|l| format!(", limit {l:?}"))
            .unwrap_or_default(),
        started.elapsed().as_secs_f64() * 1e3,
        timeline(&r.timeline)
    );
    Ok(r)
}

#[tokio::main]
async fn main() -> agent_sandbox::Result<()> {
    let rt = Runtime::new();
    let spec = SandboxSpec::builder(Language::Shell)
        .memory_mib(512)
        .wall_time(Duration::from_secs(60))
        .build()?;
    let started = Instant::now();
    let sb = match rt.create(&spec, TierChoice::Tier(Tier::Container)).await {
        Ok(sb) => sb,
        Err(e) => {
            eprintln!("cannot create a container sandbox here: {e}");
            eprintln!("(`cargo run -p agent-sandbox-cli -- probe` says why)");
            std::process::exit(2);
        }
    };
    println!(
        "sandbox {} on tier {} created in {:.1} ms; timeline: {}",
        sb.id(),
        sb.tier(),
        started.elapsed().as_secs_f64() * 1e3,
        timeline(sb.timeline())
    );

    // The repository the agent works on, written through the file API.
    sb.write_file("repo/calc.py", CALC.as_bytes()).await?;
    sb.write_file("repo/test_calc.py", TEST_CALC.as_bytes())
        .await?;
    sb.write_file("repo/Makefile", MAKEFILE.as_bytes()).await?;
    let listing = sb.list("repo").await?;
    println!(
        "workspace repo/: {}",
        listing
            .iter()
            .map(|e| format!("{} ({} B)", e.name, e.size))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let result = async {
        let r = turn(
            sb.as_ref(),
            1,
            "read the repository",
            "cd repo && ls -l && cat calc.py",
        )
        .await?;
        check(r.success(), "reading the repository failed")?;

        let r = turn(sb.as_ref(), 2, "run the tests", "cd repo && make test").await?;
        check(!r.success(), "the tests were expected to fail")?;

        // The agent's edit: read the file, fix the bug, write it back.
        println!("\n=== turn 3: fix the bug (file API)");
        let t = Instant::now();
        let src = String::from_utf8_lossy(&sb.read_file("repo/calc.py").await?).into_owned();
        let fixed = src.replace(
            "sum(values) / (len(values) - 1)  # BUG: off by one",
            "sum(values) / len(values)",
        );
        check(fixed != src, "the bug was not found")?;
        sb.write_file("repo/calc.py", fixed.as_bytes()).await?;
        println!(
            "--- rewrote repo/calc.py ({} B) in {:.2} ms",
            fixed.len(),
            t.elapsed().as_secs_f64() * 1e3
        );
        let r = turn(
            sb.as_ref(),
            3,
            "show the fix",
            "cd repo && grep -n 'return sum' calc.py",
        )
        .await?;
        check(r.success(), "the fix is not in place")?;

        let r = turn(
            sb.as_ref(),
            4,
            "run the tests again",
            "cd repo && make test",
        )
        .await?;
        check(r.success(), "the tests still fail")?;

        let r = turn(sb.as_ref(), 5, "build", "cd repo && make build && ls dist").await?;
        check(r.success(), "the build failed")?;

        let r = turn(
            sb.as_ref(),
            6,
            "commit",
            "cd repo && printf 'dist/\\n__pycache__/\\n' > .gitignore && git init -q && \
             git -c user.email=agent@example.invalid -c user.name='dev agent' add -A && \
             git -c user.email=agent@example.invalid -c user.name='dev agent' \
               commit -q -m 'Fix mean(): divide by the number of values' && \
             git log --stat --format='%h %an <%ae>: %s'",
        )
        .await?;
        check(r.success(), "the commit failed")
    }
    .await;

    sb.destroy().await?;
    match result {
        Ok(()) => {
            println!(
                "\nall six turns done in {:.1} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
            Ok(())
        }
        Err(e) => {
            eprintln!("\ndev agent failed: {e}");
            std::process::exit(1);
        }
    }
}

fn check(ok: bool, what: &str) -> agent_sandbox::Result<()> {
    if ok {
        Ok(())
    } else {
        Err(agent_sandbox::Error::backend(Tier::Container, what))
    }
}
