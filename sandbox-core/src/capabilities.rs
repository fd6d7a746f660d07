//! What a backend can do. Anything not listed returns [`Error::Unsupported`](crate::Error).

use serde::{Deserialize, Serialize};

use crate::exec::LimitKind;
use crate::tier::{IsolationBoundary, Language, Tier};

/// What a snapshot captures. `#[non_exhaustive]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum SnapshotKind {
    /// Workspace (and writable layer) files.
    Filesystem,
    /// Full process / VM memory: running state resumes where it was.
    FullMemory,
}

/// Network modes a backend can enforce. `#[non_exhaustive]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum NetworkMode {
    /// No network at all.
    DenyAll,
    /// Allowlisted destinations only.
    Allowlist,
    /// The internet minus refused ranges.
    Internet,
}

/// A backend's honest list of what it does.
///
/// Backends start from [`Capabilities::new`] (nothing supported) and list what they do;
/// `#[non_exhaustive]`: later versions add capabilities, which start out unsupported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
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
    /// Sandboxes start from OCI images ([`SandboxSpec::image`](crate::SandboxSpec::image)).
    pub images: bool,
    /// Languages `exec` accepts as code strings in a sandbox started from an image, run with
    /// the image's own interpreter (`python3`, `node`, `sh`; an image without it gets a clear
    /// error). A tier whose own userland has fewer interpreters than an image can bring
    /// lists more here than in [`languages`](Self::languages).
    pub image_languages: Vec<Language>,
    /// Secrets held by the egress proxy
    /// ([`SecretExposure::Proxy`](crate::SecretExposure::Proxy)): the sandbox gets a
    /// placeholder and trusts the proxy's CA.
    pub proxy_secrets: bool,
    /// The [`Limits`](crate::Limits) this tier enforces, in [`LimitKind`] order. A limit
    /// not listed is accepted in a spec but not enforced by this tier (the tier's
    /// documentation says what bounds the resource instead).
    pub limits: Vec<LimitKind>,
    /// Background processes: [`Sandbox::spawn`](crate::Sandbox::spawn),
    /// [`processes`](crate::Sandbox::processes) and [`signal`](crate::Sandbox::signal).
    pub processes: bool,
    /// Published ports: [`Sandbox::publish`](crate::Sandbox::publish) and
    /// [`unpublish`](crate::Sandbox::unpublish).
    pub publish: bool,
    /// Terminals: a [`spawn`](crate::Sandbox::spawn) with
    /// [`ExecRequest::tty`](crate::ExecRequest::tty), resizable.
    pub tty: bool,
    /// Resource use from the tier's own accounting: [`Sandbox::usage`](crate::Sandbox::usage).
    #[serde(default)]
    pub usage: bool,
    /// Watching a workspace directory for changes: [`Sandbox::watch`](crate::Sandbox::watch).
    #[serde(default)]
    pub watch: bool,
    /// The workspace shown at a second path too:
    /// [`SandboxSpec::workspace_alias`](crate::SandboxSpec::workspace_alias).
    #[serde(default)]
    pub workspace_alias: bool,
}

impl Capabilities {
    /// A tier that supports nothing: no language, no argv, no snapshot, no network mode, no
    /// pause/resume, no streaming, no persistent state, no images, no limit enforced, no
    /// background processes, no published ports, no usage, no watch, no workspace alias; the
    /// boundary is the tier's own ([`Tier::boundary`]). Backends set what they do on top of
    /// it.
    pub fn new(tier: Tier) -> Self {
        Capabilities {
            tier,
            languages: Vec::new(),
            argv: false,
            boundary: tier.boundary(),
            snapshots: Vec::new(),
            network: Vec::new(),
            pause_resume: false,
            streaming: false,
            persistent_state: false,
            images: false,
            image_languages: Vec::new(),
            proxy_secrets: false,
            limits: Vec::new(),
            processes: false,
            publish: false,
            tty: false,
            usage: false,
            watch: false,
            workspace_alias: false,
        }
    }

    /// Whether this tier enforces the limit `kind`.
    pub fn enforces(&self, kind: LimitKind) -> bool {
        self.limits.contains(&kind)
    }

    /// Whether code strings in `lang` run here.
    pub fn supports_language(&self, lang: Language) -> bool {
        self.languages.contains(&lang)
    }

    /// Whether code strings in `lang` run here in a sandbox started from an image
    /// (`from_image`) or not: [`image_languages`](Self::image_languages) or
    /// [`languages`](Self::languages).
    pub fn runs_language(&self, lang: Language, from_image: bool) -> bool {
        if from_image {
            self.images && self.image_languages.contains(&lang)
        } else {
            self.supports_language(lang)
        }
    }

    /// Why choosing a tier automatically passes this one over for `spec` before trying to
    /// create it (it cannot start the spec's image, hold its proxy-held secrets, or show its
    /// workspace alias), or `None`. The facade's `Runtime::create` asks it, and so does the
    /// CLI choosing among a daemon's tiers, so both pass over the same tiers.
    pub fn passes_over(&self, spec: &crate::SandboxSpec) -> Option<&'static str> {
        if spec.image.is_some() && !self.images {
            // An image needs a Linux userland.
            return Some("this tier does not start images");
        }
        if spec.holds_proxied_secrets() && !self.proxy_secrets {
            return Some("this tier cannot hold proxy secrets");
        }
        if spec.workspace_alias.is_some() && !self.workspace_alias {
            return Some("this tier cannot show the workspace at a second path");
        }
        None
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_supports_nothing() {
        for tier in Tier::PRODUCT {
            let c = Capabilities::new(tier);
            assert_eq!(c.boundary, tier.boundary());
            assert!(c.languages.is_empty() && !c.argv && c.snapshots.is_empty());
            assert!(!c.pause_resume && !c.streaming && !c.persistent_state);
            assert!(!c.processes && !c.publish && !c.tty);
            assert!(!c.supports_network(&crate::NetworkPolicy::DenyAll));
            assert!(LimitKind::ALL.iter().all(|k| !c.enforces(*k)));
        }
    }
}
