//! What a backend can do. Anything not listed returns [`Error::Unsupported`](crate::Error).

use serde::{Deserialize, Serialize};

use crate::tier::{IsolationBoundary, Language, Tier};

/// What a snapshot captures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SnapshotKind {
    /// Workspace (and writable layer) files.
    Filesystem,
    /// Full process / VM memory: running state resumes where it was.
    FullMemory,
}

/// Network modes a backend can enforce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NetworkMode {
    /// No network at all.
    DenyAll,
    /// Allowlisted destinations only.
    Allowlist,
    /// The internet minus refused ranges.
    Internet,
}

/// A backend's honest list of what it does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// The tier.
    pub tier: Tier,
    /// Languages `exec` accepts as code strings (argv commands need a userland: see `argv`).
    pub languages: Vec<Language>,
    /// Whether `exec` accepts [`Command::Argv`](crate::Command::Argv).
    pub argv: bool,
    /// The isolation boundary.
    pub boundary: IsolationBoundary,
    /// Snapshot kinds (empty: `snapshot` is unsupported).
    pub snapshots: Vec<SnapshotKind>,
    /// Enforceable network modes.
    pub network: Vec<NetworkMode>,
    /// Pause/resume of a running sandbox.
    pub pause_resume: bool,
    /// Streaming exec.
    pub streaming: bool,
    /// State (variables, processes, files) persists across `exec` calls.
    pub persistent_state: bool,
}

impl Capabilities {
    /// Whether code strings in `lang` run here.
    pub fn supports_language(&self, lang: Language) -> bool {
        self.languages.contains(&lang)
    }

    /// Whether this snapshot kind is available.
    pub fn supports_snapshot(&self, kind: SnapshotKind) -> bool {
        self.snapshots.contains(&kind)
    }

    /// Whether `policy` can be enforced.
    pub fn supports_network(&self, policy: &crate::NetworkPolicy) -> bool {
        let mode = match policy {
            crate::NetworkPolicy::DenyAll => NetworkMode::DenyAll,
            crate::NetworkPolicy::Allow { .. } => NetworkMode::Allowlist,
            crate::NetworkPolicy::AllowInternet { .. } => NetworkMode::Internet,
        };
        self.network.contains(&mode)
    }
}
