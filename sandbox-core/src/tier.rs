//! Isolation tiers and the languages a sandbox can run.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// An isolation tier: one backend family on the isolation spectrum.
///
/// The four product tiers are ordered from the lightest to the strongest boundary.
/// [`Tier::Unisolated`] exists only for tests of the shared machinery: it runs
/// host processes with **no isolation at all**, and the [`Selector`](crate::Selector)
/// never ranks it.
///
/// `#[non_exhaustive]`: a later version may add a tier; match with a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Tier {
    /// Tier 1: WebAssembly (wasmtime) and JavaScript isolates, in-process.
    Wasm,
    /// Tier 2: our own Linux containers (namespaces, cgroups, seccomp, Landlock).
    Container,
    /// Tier 3: gVisor's user-space kernel (`runsc`).
    Gvisor,
    /// Tier 4: our own KVM microVM monitor with a Linux guest.
    Microvm,
    /// Test-only: host processes without any isolation. Never selected automatically.
    Unisolated,
}

impl Tier {
    /// The four product tiers, lightest first.
    pub const PRODUCT: [Tier; 4] = [Tier::Wasm, Tier::Container, Tier::Gvisor, Tier::Microvm];

    /// The tier's name as used on the CLI and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Wasm => "wasm",
            Tier::Container => "container",
            Tier::Gvisor => "gvisor",
            Tier::Microvm => "microvm",
            Tier::Unisolated => "unisolated",
        }
    }

    /// The isolation boundary this tier puts between the code and the host.
    pub fn boundary(self) -> IsolationBoundary {
        match self {
            Tier::Wasm => IsolationBoundary::InProcessVm,
            Tier::Container => IsolationBoundary::SharedKernel,
            Tier::Gvisor => IsolationBoundary::UserSpaceKernel,
            Tier::Microvm => IsolationBoundary::GuestKernel,
            Tier::Unisolated => IsolationBoundary::None,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Tier {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "wasm" => Ok(Tier::Wasm),
            "container" => Ok(Tier::Container),
            "gvisor" => Ok(Tier::Gvisor),
            "microvm" => Ok(Tier::Microvm),
            "unisolated" => Ok(Tier::Unisolated),
            other => Err(Error::InvalidSpec {
                field: "tier".into(),
                reason: format!(
                    "unknown tier `{other}`: expected one of wasm, container, gvisor, microvm"
                ),
            }),
        }
    }
}

/// What separates sandboxed code from the host. `#[non_exhaustive]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum IsolationBoundary {
    /// A language VM inside the host process (WebAssembly, a JS isolate).
    InProcessVm,
    /// Namespaces, cgroups and seccomp on the host's kernel.
    SharedKernel,
    /// A user-space kernel (gVisor) between the code and the host kernel.
    UserSpaceKernel,
    /// A guest kernel behind hardware virtualization.
    GuestKernel,
    /// Nothing: host processes. Test-only.
    None,
}

/// The language or runtime a sandbox runs code in. `#[non_exhaustive]`: later versions add
/// languages; match with a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Language {
    /// Python 3 (CPython in WebAssembly on the wasm tier, the system `python3` elsewhere).
    Python,
    /// A JavaScript snippet (QuickJS on the wasm tier).
    Javascript,
    /// A WebAssembly module (WASI preview 1 command).
    Wasm,
    /// A POSIX shell script (`/bin/sh -c`).
    Shell,
    /// Node.js programs and tooling (`node`, `npm`).
    Node,
    /// C compiled with the system compiler.
    C,
}

impl Language {
    /// Every language, for help texts.
    pub const ALL: [Language; 6] = [
        Language::Python,
        Language::Javascript,
        Language::Wasm,
        Language::Shell,
        Language::Node,
        Language::C,
    ];

    /// The language's name as used on the CLI and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Javascript => "javascript",
            Language::Wasm => "wasm",
            Language::Shell => "shell",
            Language::Node => "node",
            Language::C => "c",
        }
    }
}

impl fmt::Display for Language {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Language {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "python" | "python3" | "py" => Ok(Language::Python),
            "javascript" | "js" => Ok(Language::Javascript),
            "wasm" | "webassembly" => Ok(Language::Wasm),
            "shell" | "sh" | "bash" => Ok(Language::Shell),
            "node" | "nodejs" => Ok(Language::Node),
            "c" | "gcc" => Ok(Language::C),
            other => Err(Error::InvalidSpec {
                field: "language".into(),
                reason: format!(
                    "unknown language `{other}`: expected one of python, javascript, wasm, shell, node, c"
                ),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for t in Tier::PRODUCT {
            assert_eq!(t.name().parse::<Tier>().unwrap(), t);
        }
        for l in Language::ALL {
            assert_eq!(l.name().parse::<Language>().unwrap(), l);
        }
        assert!("docker".parse::<Tier>().is_err());
        assert!("cobol".parse::<Language>().is_err());
    }

    #[test]
    fn serde_names_match_cli_names() {
        for t in Tier::PRODUCT {
            assert_eq!(
                serde_json::to_string(&t).unwrap(),
                format!("\"{}\"", t.name())
            );
        }
        for l in Language::ALL {
            assert_eq!(
                serde_json::to_string(&l).unwrap(),
                format!("\"{}\"", l.name())
            );
        }
    }
}
