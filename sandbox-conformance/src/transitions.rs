//! The lifecycle's state table under concurrency: seeded random rounds of concurrent pause,
//! resume, exec and destroy against one backend, each round checked against a model of
//! [`sandbox_core::lifecycle`]'s table.
//!
//! The contract checked, beyond the table itself: pause, resume and destroy of one sandbox
//! never interleave, and take effect in the order they were issued (each started before the
//! next: a backend's transitions wait their turn on the lifecycle's lock, first come first
//! served). So the state after a round is the model's, with no guessing: a resume issued
//! while a pause is under way leaves the sandbox live, never paused by the pause it
//! overlapped. Commands overlapping a transition may see either side of it; a command a
//! pause froze mid-run finishes after the resume that follows; one under way when a destroy
//! lands may end as `SandboxGone` or as killed (the tier's choice). Every operation is bounded
//! by [`Plan::op_timeout`]: one that outlives it fails the check (a hang, not a slow run).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use fastrand::Rng;
use sandbox_core::{Backend, Error, ExecRequest, Sandbox};

use crate::{Ctx, Dialect};

/// How much to run: a few dozen sequences of a few rounds of a handful of concurrent ops.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Plan {
    /// The seed of the whole run (the failure message names it).
    pub seed: u64,
    /// Sandboxes, one sequence of rounds each.
    pub sequences: usize,
    /// Rounds per sequence at most (a destroy ends the sequence early).
    pub rounds: usize,
    /// Concurrent operations per round at most (at least two).
    pub ops: usize,
    /// The bound on each operation; outliving it fails the check.
    pub op_timeout: Duration,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            seed: 0x5eed_1c0d_e0f5_a7e5,
            sequences: 24,
            rounds: 4,
            ops: 5,
            op_timeout: Duration::from_secs(120),
        }
    }
}

impl Plan {
    /// Sets [`Plan::seed`].
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets [`Plan::sequences`].
    pub fn sequences(mut self, sequences: usize) -> Self {
        self.sequences = sequences;
        self
    }

    /// Sets [`Plan::rounds`].
    pub fn rounds(mut self, rounds: usize) -> Self {
        self.rounds = rounds;
        self
    }

    /// Sets [`Plan::ops`].
    pub fn ops(mut self, ops: usize) -> Self {
        self.ops = ops;
        self
    }

    /// Sets [`Plan::op_timeout`].
    pub fn op_timeout(mut self, op_timeout: Duration) -> Self {
        self.op_timeout = op_timeout;
        self
    }
}

/// What a run did: the calls checked, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Ran {
    /// Rounds checked.
    pub rounds: usize,
    /// Pauses issued in rounds.
    pub pauses: usize,
    /// Resumes issued in rounds.
    pub resumes: usize,
    /// Commands issued in rounds.
    pub execs: usize,
    /// Destroys issued in rounds.
    pub destroys: usize,
}

/// One operation of a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Pause,
    Resume,
    Exec,
    Destroy,
}

/// The model's state (the table's columns that answer differently).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Model {
    Live,
    Paused,
    Gone,
}

impl Model {
    /// The state after `op` (a transition) and whether the op answers `SandboxGone`.
    fn after(self, op: Op) -> (Model, bool) {
        match (self, op) {
            (Model::Gone, Op::Destroy) => (Model::Gone, false),
            (Model::Gone, _) => (Model::Gone, true),
            (_, Op::Destroy) => (Model::Gone, false),
            (_, Op::Pause) => (Model::Paused, false),
            (_, Op::Resume) => (Model::Live, false),
            (s, Op::Exec) => (s, false),
        }
    }
}

/// What an operation answered.
#[derive(Debug)]
enum Answer {
    Ok,
    Paused,
    Gone,
    Other(String),
}

type OpFuture = Pin<Box<dyn Future<Output = Answer> + Send>>;

fn answer<T>(r: Result<T, Error>, ok: impl FnOnce(T) -> Result<(), String>) -> Answer {
    match r {
        Ok(v) => match ok(v) {
            Ok(()) => Answer::Ok,
            Err(why) => Answer::Other(why),
        },
        Err(Error::SandboxPaused { .. }) => Answer::Paused,
        Err(Error::SandboxGone { .. }) => Answer::Gone,
        Err(e) => Answer::Other(e.to_string()),
    }
}

/// Runs `plan` against `backend`: what it checked when every round matched the model, else
/// what did not (with the seed, sequence and round, to replay it). A backend without code
/// strings is not checked (nothing ran); one without pause/resume gets rounds of execs and
/// destroys.
pub async fn check(backend: &dyn Backend, plan: &Plan) -> Result<Ran, String> {
    let mut ran = Ran::default();
    let caps = backend.capabilities();
    let Some(dialect) = Dialect::for_caps(&caps) else {
        return Ok(ran);
    };
    let ctx = Ctx {
        backend,
        caps,
        dialect,
    };
    let mut rng = Rng::with_seed(plan.seed);
    for seq in 0..plan.sequences {
        let sb: Arc<dyn Sandbox> = Arc::from(ctx.create(ctx.spec()).await?);
        let r = sequence(&ctx, &sb, plan, &mut rng, &mut ran).await;
        // Whatever happened, the sandbox goes (a no-op after a destroy in the sequence).
        let _ = bounded(plan, "the final destroy", sb.destroy()).await;
        r.map_err(|e| format!("{} (seed {:#x}, sequence {seq})", e, plan.seed))?;
    }
    Ok(ran)
}

async fn bounded<T>(plan: &Plan, what: &str, f: impl Future<Output = T>) -> Result<T, String> {
    tokio::time::timeout(plan.op_timeout, f)
        .await
        .map_err(|_| format!("{what} did not finish within {:?}", plan.op_timeout))
}

fn exec_future(ctx: &Ctx<'_>, sb: &Arc<dyn Sandbox>) -> OpFuture {
    let sb = Arc::clone(sb);
    let code = ctx.code("echo ok", "print('ok')");
    Box::pin(async move {
        answer(sb.exec(ExecRequest::code(code)).await, |r| {
            if r.exit_code == Some(0) && r.stdout_str().trim() == "ok" {
                Ok(())
            } else {
                Err(format!(
                    "exec answered exit {:?}, stdout {:?}, stderr {:?}",
                    r.exit_code,
                    r.stdout_str(),
                    String::from_utf8_lossy(&r.stderr)
                ))
            }
        })
    })
}

fn op_future(ctx: &Ctx<'_>, sb: &Arc<dyn Sandbox>, op: Op) -> OpFuture {
    let s = Arc::clone(sb);
    match op {
        Op::Exec => exec_future(ctx, sb),
        Op::Pause => Box::pin(async move { answer(s.pause().await, |()| Ok(())) }),
        Op::Resume => Box::pin(async move { answer(s.resume().await, |()| Ok(())) }),
        Op::Destroy => Box::pin(async move { answer(s.destroy().await, |()| Ok(())) }),
    }
}

/// The state a probe exec sees (it answers at once unless the sandbox is live).
async fn observe(ctx: &Ctx<'_>, sb: &Arc<dyn Sandbox>, plan: &Plan) -> Result<Model, String> {
    match bounded(plan, "a probe exec", exec_future(ctx, sb)).await? {
        Answer::Ok => Ok(Model::Live),
        Answer::Paused => Ok(Model::Paused),
        Answer::Gone => Ok(Model::Gone),
        Answer::Other(why) => Err(format!("a probe exec failed: {why}")),
    }
}

async fn sequence(
    ctx: &Ctx<'_>,
    sb: &Arc<dyn Sandbox>,
    plan: &Plan,
    rng: &mut Rng,
    ran: &mut Ran,
) -> Result<(), String> {
    let pausable = ctx.caps.pause_resume;
    let mut state = Model::Live;
    for round in 0..plan.rounds {
        let n = 2 + rng.usize(..plan.ops.max(2) - 1);
        let ops: Vec<Op> = (0..n)
            .map(|_| match rng.usize(..10) {
                0 => Op::Destroy,
                1..=3 if pausable => Op::Pause,
                4..=6 if pausable => Op::Resume,
                _ => Op::Exec,
            })
            .collect();
        ran.rounds += 1;
        for op in &ops {
            *match op {
                Op::Pause => &mut ran.pauses,
                Op::Resume => &mut ran.resumes,
                Op::Exec => &mut ran.execs,
                Op::Destroy => &mut ran.destroys,
            } += 1;
        }
        let from = state;
        let at = |e: String| format!("round {round} {ops:?} from {from:?}: {e}");
        state = self::round(ctx, sb, plan, from, &ops).await.map_err(at)?;
        if state == Model::Gone {
            break;
        }
    }
    if state != Model::Gone {
        // The end of the table: destroy, twice, then every call is gone.
        let d = bounded(plan, "destroy", sb.destroy()).await?;
        d.map_err(|e| format!("destroy failed: {e}"))?;
    }
    let again = bounded(plan, "a second destroy", sb.destroy()).await?;
    again.map_err(|e| format!("destroy is not idempotent: {e}"))?;
    let mut after: Vec<(&str, OpFuture)> = vec![("exec", exec_future(ctx, sb))];
    if pausable {
        after.push(("pause", op_future(ctx, sb, Op::Pause)));
        after.push(("resume", op_future(ctx, sb, Op::Resume)));
    }
    for (what, f) in after {
        match bounded(plan, what, f).await? {
            Answer::Gone => {}
            other => {
                return Err(format!(
                    "{what} after destroy answered {other:?}, not SandboxGone"
                ))
            }
        }
    }
    Ok(())
}

/// One round from `from`: the ops issued in order (each started before the next), run
/// concurrently, checked against the model; returns the state after it.
async fn round(
    ctx: &Ctx<'_>,
    sb: &Arc<dyn Sandbox>,
    plan: &Plan,
    from: Model,
    ops: &[Op],
) -> Result<Model, String> {
    // Issue in order: each op's first poll (which reaches the lifecycle's lock for a
    // transition) happens before the next op's.
    let mut transitions = Vec::new();
    let mut execs = Vec::new();
    for (i, &op) in ops.iter().enumerate() {
        let mut f = op_future(ctx, sb, op);
        let first = futures::poll!(f.as_mut());
        let task: tokio::task::JoinHandle<Answer> = match first {
            Poll::Ready(a) => tokio::spawn(async move { a }),
            Poll::Pending => tokio::spawn(f),
        };
        if op == Op::Exec {
            execs.push((i, task));
        } else {
            transitions.push((i, op, task));
        }
    }
    // The model, in issue order.
    let mut state = from;
    let mut passed_paused = from == Model::Paused;
    let mut passed_gone = from == Model::Gone;
    for (i, op, task) in transitions {
        let got = bounded(plan, &format!("{op:?} (op {i})"), task)
            .await?
            .map_err(|e| format!("{op:?} (op {i}) panicked: {e}"))?;
        let (next, gone) = state.after(op);
        match (&got, gone) {
            (Answer::Ok, false) | (Answer::Gone, true) => {}
            (got, _) => {
                return Err(format!(
                    "{op:?} (op {i}) from {state:?} answered {got:?}, the table says {}",
                    if gone { "SandboxGone" } else { "Ok" }
                ))
            }
        }
        state = next;
        passed_paused |= state == Model::Paused;
        passed_gone |= state == Model::Gone;
    }
    let seen = observe(ctx, sb, plan).await?;
    if seen != state {
        return Err(format!(
            "after the transitions the sandbox answers as {seen:?}, the table says {state:?}"
        ));
    }
    if state == Model::Paused {
        // Resume after pause makes commands work again (and lets frozen ones finish).
        match bounded(plan, "resume", sb.resume()).await? {
            Ok(()) => state = Model::Live,
            Err(e) => return Err(format!("resume of a paused sandbox failed: {e}")),
        }
        let seen = observe(ctx, sb, plan).await?;
        if seen != Model::Live {
            return Err(format!(
                "after a resume the sandbox answers as {seen:?}, not live"
            ));
        }
    }
    for (i, task) in execs {
        let got = bounded(plan, &format!("Exec (op {i})"), task)
            .await?
            .map_err(|e| format!("Exec (op {i}) panicked: {e}"))?;
        let fine = match &got {
            Answer::Ok => from != Model::Gone,
            Answer::Paused => passed_paused,
            Answer::Gone => passed_gone,
            // Killed with the sandbox: a tier may report the command's end (137, or the
            // runtime's error) rather than `SandboxGone`; the table covers calls made after
            // the end, not the fate of one under way.
            Answer::Other(_) => passed_gone,
        };
        if !fine {
            return Err(format!(
                "Exec (op {i}) answered {got:?} in a round that {}",
                match (passed_paused, passed_gone) {
                    (false, false) => "neither paused nor ended it",
                    (true, false) => "never ended it",
                    (false, true) => "never paused it",
                    (true, true) => "began with it gone",
                }
            ));
        }
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_follows_the_table() {
        use Model::*;
        assert_eq!(Live.after(Op::Pause), (Paused, false));
        assert_eq!(Paused.after(Op::Pause), (Paused, false));
        assert_eq!(Live.after(Op::Resume), (Live, false));
        assert_eq!(Paused.after(Op::Resume), (Live, false));
        assert_eq!(Paused.after(Op::Destroy), (Gone, false));
        assert_eq!(Gone.after(Op::Destroy), (Gone, false));
        assert_eq!(Gone.after(Op::Pause), (Gone, true));
        assert_eq!(Gone.after(Op::Resume), (Gone, true));
    }

    #[test]
    fn the_choices_are_seeded() {
        let a: Vec<u64> = {
            let mut r = Rng::with_seed(7);
            (0..8).map(|_| r.u64(..)).collect()
        };
        let mut r = Rng::with_seed(7);
        assert!(a.iter().all(|v| *v == r.u64(..)));
        assert!(a.windows(2).any(|w| w[0] != w[1]));
        assert!((0..100).all(|_| r.usize(..3) < 3));
    }
}
