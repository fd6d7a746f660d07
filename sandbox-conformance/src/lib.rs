//! # sandbox-conformance — one behaviour contract for every tier
//!
//! A table of cases ([`cases()`]), each written once against the public traits
//! ([`Backend`] and `Box<dyn Sandbox>`), each with an id, a description, the capabilities it
//! needs ([`Need`]) and a check. [`run`] runs the table against one backend and returns an
//! [`Outcome`] per case: [`Outcome::Pass`], [`Outcome::Fail`] with why, or
//! [`Outcome::NotApplicable`] with the reason taken from the backend's
//! [`capabilities()`](Backend::capabilities) (never from the tier's name).
//!
//! Code is written in one of two dialects ([`Dialect`]): POSIX shell for tiers that run shell
//! code strings, else Python (the wasm tier). Argv commands name programs on the `PATH` in
//! tiers with a Linux userland (they run shell code), and `.wasm` modules in the workspace
//! in tiers without one.
//!
//! [`table`] renders the cross-tier table of `docs/conformance.md` and reads it back; the
//! integration test `tests/tiers.rs` runs the table for every tier this host can run (a tier
//! is skipped only on its probe's word) and checks (or, with `UPDATE_CONFORMANCE=1`, writes)
//! that tier's column of the committed table. [`KNOWN_FAILURES`] lists the cases a tier is
//! known to fail, with why; they are shown as such in the table and a known failure that
//! passes fails the test (so the list stays true).
//!
//! The cases create sandboxes with the default spec plus what they test; they send network
//! traffic only to check that there is no route (see `net.deny-all`), and never from a
//! sandbox whose routing table shows a way out.

#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::Pin;

use sandbox_core::{
    Backend, Capabilities, Error, IsolationBoundary, Language, LimitKind, MapSecretSource,
    NetworkMode, ResolvedSecrets, Sandbox, SandboxSpec, SpecBuilder, Tier,
};

mod cases;
pub mod table;
pub mod transitions;

pub use cases::cases;

/// What a check returns: `Ok` when the tier behaves as the contract says, else why not.
pub type Checked = Result<(), String>;

/// The future of one check.
pub type CheckFuture<'a> = Pin<Box<dyn Future<Output = Checked> + Send + 'a>>;

/// One check: runs against the context's backend.
pub type CheckFn = for<'a> fn(&'a Ctx<'a>) -> CheckFuture<'a>;

/// A capability a case needs; a backend without it gets [`Outcome::NotApplicable`] with the
/// capability's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Need {
    /// Code strings in one of the dialects (shell or Python).
    Code,
    /// Shell code strings (processes, signals, `unshare`).
    Shell,
    /// Argv commands.
    Argv,
    /// Streaming exec.
    Streaming,
    /// Background processes.
    Processes,
    /// The tier enforces this limit.
    Limit(LimitKind),
    /// The tier enforces this network mode.
    Network(NetworkMode),
    /// Some kind of snapshot.
    Snapshot,
    /// An isolation boundary with processes of its own (not an in-process VM, not none).
    ProcessIsolation,
    /// The tier does *not* claim images (a claimed one is checked by
    /// `agent-sandbox-cli/tests/image.rs`, which needs an image to start).
    NoImages,
}

impl Need {
    /// `None` when `caps` has it, else the reason, quoting the capability.
    pub fn missing(self, caps: &Capabilities) -> Option<String> {
        match self {
            Need::Code => Dialect::for_caps(caps).is_none().then(|| {
                "runs neither shell nor Python code strings (capabilities().languages)".into()
            }),
            Need::Shell => (!caps.supports_language(Language::Shell))
                .then(|| "no shell code strings (capabilities().languages)".into()),
            Need::Argv => (!caps.argv).then(|| "no argv commands (capabilities().argv)".into()),
            Need::Processes => (!caps.processes)
                .then(|| "no background processes (capabilities().processes)".into()),
            Need::Streaming => {
                (!caps.streaming).then(|| "no streaming exec (capabilities().streaming)".into())
            }
            Need::Limit(k) => (!caps.enforces(k))
                .then(|| format!("does not enforce the {k} limit (capabilities().limits)")),
            Need::Network(m) => (!caps.network.contains(&m)).then(|| {
                format!("does not enforce the {m:?} network mode (capabilities().network)")
            }),
            Need::Snapshot => caps
                .snapshots
                .is_empty()
                .then(|| "no snapshots (capabilities().snapshots)".into()),
            Need::ProcessIsolation => match caps.boundary {
                IsolationBoundary::None => {
                    Some("no isolation boundary (capabilities().boundary: none)".into())
                }
                IsolationBoundary::InProcessVm => Some(
                    "an in-process VM without processes or namespaces \
                     (capabilities().boundary: in-process-vm)"
                        .into(),
                ),
                _ => None,
            },
            Need::NoImages => caps.images.then(|| {
                "claims images (capabilities().images): checked by agent-sandbox-cli/tests/image.rs"
                    .into()
            }),
        }
    }
}

/// One case of the contract.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub struct Case {
    /// A stable id (`group.name`), the row of the table.
    pub id: &'static str,
    /// What the contract says, in a sentence.
    pub description: &'static str,
    /// What the case needs from the tier.
    pub needs: &'static [Need],
    /// The check.
    pub check: CheckFn,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case")
            .field("id", &self.id)
            .field("needs", &self.needs)
            .finish()
    }
}

/// The result of one case on one tier.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The tier behaves as the contract says.
    Pass,
    /// It does not; why.
    Fail(String),
    /// The case needs a capability the tier does not claim; which.
    NotApplicable(String),
}

/// The language the cases write code in for a tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Dialect {
    /// POSIX shell (`/bin/sh -c`): tiers with a Linux userland.
    Shell,
    /// Python 3: tiers without a shell (the wasm tier's CPython).
    Python,
}

impl Dialect {
    /// Shell when the tier runs shell code strings, else Python when it runs Python.
    pub fn for_caps(caps: &Capabilities) -> Option<Dialect> {
        if caps.supports_language(Language::Shell) {
            Some(Dialect::Shell)
        } else if caps.supports_language(Language::Python) {
            Some(Dialect::Python)
        } else {
            None
        }
    }

    /// The spec language of the dialect.
    pub fn language(self) -> Language {
        match self {
            Dialect::Shell => Language::Shell,
            Dialect::Python => Language::Python,
        }
    }
}

/// The name of the secret every sandbox of the cases may bind (see `env.secret-redacted`).
pub const SECRET_NAME: &str = "conformance_token";
/// Its value: it must never appear in captured output.
pub const SECRET_VALUE: &str = "s3cr3t-conformance-6f1d";

/// What a check works with: the backend under test, its capabilities and dialect.
#[non_exhaustive]
pub struct Ctx<'a> {
    /// The backend under test.
    pub backend: &'a dyn Backend,
    /// Its capabilities, read once.
    pub caps: Capabilities,
    /// The dialect code is written in (`Shell` when no [`Need::Code`] applies).
    pub dialect: Dialect,
}

impl Ctx<'_> {
    /// The tier under test.
    pub fn tier(&self) -> Tier {
        self.backend.tier()
    }

    /// A spec builder in the dialect's language with default limits.
    pub fn spec(&self) -> SpecBuilder {
        SandboxSpec::builder(self.dialect.language())
    }

    /// Creates a sandbox from `spec`, resolving its secrets from the cases' source (which
    /// holds [`SECRET_NAME`]).
    pub async fn create(&self, spec: SpecBuilder) -> Result<Box<dyn Sandbox>, String> {
        let spec = spec.build().map_err(|e| format!("spec refused: {e}"))?;
        self.create_spec(&spec).await
    }

    /// As [`create`](Self::create) with a built spec.
    pub async fn create_spec(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>, String> {
        let source = MapSecretSource::new().with(SECRET_NAME, SECRET_VALUE);
        let secrets = ResolvedSecrets::resolve(&spec.secrets, &source)
            .map_err(|e| format!("secrets: {e}"))?;
        self.backend
            .create(spec, secrets)
            .await
            .map_err(|e| format!("create failed: {e}"))
    }

    /// Destroys `sb` and returns `result`, or the destroy's error when `result` is `Ok`.
    pub async fn finish(&self, sb: Box<dyn Sandbox>, result: Checked) -> Checked {
        let destroyed = sb.destroy().await;
        result?;
        destroyed.map_err(|e| format!("destroy failed: {e}"))
    }

    /// Picks the code of the dialect.
    pub fn code(&self, sh: &str, py: &str) -> String {
        match self.dialect {
            Dialect::Shell => sh.to_string(),
            Dialect::Python => py.to_string(),
        }
    }
}

/// A case a tier is known to fail: shown as such in the table; the test fails if it passes.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct KnownFailure {
    /// The tier.
    pub tier: Tier,
    /// The case id.
    pub case: &'static str,
    /// Why, and what would fix it.
    pub why: &'static str,
}

/// Cases tiers are known to fail (the table's "known fail" cells). Keep it short and true.
pub const KNOWN_FAILURES: &[KnownFailure] = &[
    KnownFailure {
        tier: Tier::Unisolated,
        case: "cwd.default",
        why: "host processes have no /workspace: commands start in the sandbox's host \
              directory (test-only tier, no mount namespace)",
    },
    KnownFailure {
        tier: Tier::Unisolated,
        case: "cwd.request",
        why: "host processes have no /workspace: a cwd under it is the host directory's \
              path (test-only tier, no mount namespace)",
    },
];

/// The known failure of `case` on `tier`, if listed.
pub fn known_failure(tier: Tier, case: &str) -> Option<&'static KnownFailure> {
    KNOWN_FAILURES
        .iter()
        .find(|k| k.tier == tier && k.case == case)
}

/// Runs one case against `backend`.
pub async fn run_case(backend: &dyn Backend, case: &Case) -> Outcome {
    let caps = backend.capabilities();
    if let Some(why) = case.needs.iter().find_map(|n| n.missing(&caps)) {
        return Outcome::NotApplicable(why);
    }
    let cx = Ctx {
        backend,
        dialect: Dialect::for_caps(&caps).unwrap_or(Dialect::Shell),
        caps,
    };
    match (case.check)(&cx).await {
        Ok(()) => Outcome::Pass,
        Err(why) => Outcome::Fail(why),
    }
}

/// Runs every case against `backend`, in table order; `progress` sees each result as it comes.
pub async fn run(
    backend: &dyn Backend,
    mut progress: impl FnMut(&Case, &Outcome),
) -> Vec<(&'static str, Outcome)> {
    let mut out = Vec::new();
    for case in cases() {
        let o = run_case(backend, case).await;
        progress(case, &o);
        out.push((case.id, o));
    }
    out
}

/// Whether `r` is the given error variant (by name, for messages).
pub(crate) fn variant(r: &Error) -> &'static str {
    match r {
        Error::Unsupported { .. } => "Unsupported",
        Error::InvalidSpec { .. } => "InvalidSpec",
        Error::Unavailable { .. } => "Unavailable",
        Error::NoTierAvailable { .. } => "NoTierAvailable",
        Error::PathEscape { .. } => "PathEscape",
        Error::NotFound { .. } => "NotFound",
        Error::SandboxGone { .. } => "SandboxGone",
        Error::SandboxPaused { .. } => "SandboxPaused",
        Error::Snapshot(_) => "Snapshot",
        Error::Secret { .. } => "Secret",
        Error::Io { .. } => "Io",
        Error::ResourceExhausted { .. } => "ResourceExhausted",
        Error::Backend { .. } => "Backend",
        _ => "another error",
    }
}
