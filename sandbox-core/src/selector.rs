//! The tier selector: four questions in, a ranked list of tiers (each with its reason) out,
//! then the first tier the host can actually run.
//!
//! Ideal ranking rules (before looking at the host):
//! - a custom kernel, kernel modules or a hardware boundary: `microvm` only;
//! - JavaScript or a WebAssembly module: `wasm` first, whatever the trust;
//! - compute-bound Python: `wasm` first (CPython in WebAssembly), then by trust;
//! - trusted code: `container` first, then the stronger tiers;
//! - untrusted, syscall-heavy: `microvm`, then `gvisor`;
//! - untrusted, compute-bound (not JS/wasm/Python): `gvisor`, then `microvm`.
//!
//! Untrusted code never falls back to `container` unless the caller sets
//! [`Question::allow_weaker_isolation`]. The wasm tier only runs Python, JavaScript and wasm
//! modules, so it is never ranked for other languages; a wasm module only runs there.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::probe::TierStatus;
use crate::tier::{Language, Tier};

/// Who wrote the code, and who else shares the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Trust {
    /// Internal agents, trusted prompts: isolation against accidents.
    Trusted,
    /// Public, multi-tenant, or LLM-written code from untrusted input.
    Untrusted,
}

/// What the code mostly does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum IoProfile {
    /// Computation on data in memory.
    Compute,
    /// fork/exec, many files, network: compilers, package managers, git.
    SyscallHeavy,
}

/// Whether the code needs a kernel of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum KernelNeed {
    /// Any kernel will do.
    None,
    /// A custom kernel, kernel modules, or a hardware isolation boundary.
    Custom,
}

/// The selector's four questions (plus the opt-in for weaker isolation). Start from
/// [`Question::new`] and use the setters; `#[non_exhaustive]`: later versions may ask more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Question {
    /// The language.
    pub language: Language,
    /// Trust.
    pub trust: Trust,
    /// I/O profile.
    pub io: IoProfile,
    /// Kernel need.
    pub kernel: KernelNeed,
    /// Lets untrusted code fall back to the container tier (shared kernel).
    #[serde(default)]
    pub allow_weaker_isolation: bool,
}

impl Question {
    /// A question with the defaults: untrusted, compute-bound, no kernel need.
    pub fn new(language: Language) -> Self {
        Question {
            language,
            trust: Trust::Untrusted,
            io: IoProfile::Compute,
            kernel: KernelNeed::None,
            allow_weaker_isolation: false,
        }
    }

    /// Who wrote the code. Default: [`Trust::Untrusted`].
    pub fn trust(mut self, trust: Trust) -> Self {
        self.trust = trust;
        self
    }

    /// What the code mostly does. Default: [`IoProfile::Compute`].
    pub fn io(mut self, io: IoProfile) -> Self {
        self.io = io;
        self
    }

    /// Whether it needs a kernel of its own. Default: [`KernelNeed::None`].
    pub fn kernel(mut self, kernel: KernelNeed) -> Self {
        self.kernel = kernel;
        self
    }

    /// Lets untrusted code fall back to the container tier (shared kernel). Default: `false`.
    pub fn allow_weaker_isolation(mut self, allow: bool) -> Self {
        self.allow_weaker_isolation = allow;
        self
    }
}

/// A ranked tier and why it is there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Ranked {
    /// The tier.
    pub tier: Tier,
    /// Why it has this place.
    pub reason: String,
}

/// The selector's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Selection {
    /// Ideal ranking, best first.
    pub ranking: Vec<Ranked>,
    /// The first ranked tier the host can run, if any.
    pub chosen: Option<Tier>,
    /// The host status of every ranked tier, in ranking order.
    pub statuses: Vec<TierStatus>,
}

impl Selection {
    /// The chosen tier, or [`Error::NoTierAvailable`] listing every tier and its fix.
    pub fn require(&self) -> Result<Tier> {
        self.chosen.ok_or_else(|| Error::NoTierAvailable {
            statuses: self.statuses.clone(),
        })
    }
}

/// Picks tiers. Stateless; see the module docs for the rules.
#[derive(Debug, Default, Clone, Copy)]
pub struct Selector;

impl Selector {
    /// The ideal ranking for a question, ignoring the host.
    pub fn rank(&self, q: &Question) -> Vec<Ranked> {
        let mut out: Vec<Ranked> = Vec::new();
        let mut push = |tier: Tier, reason: &str| {
            if !out.iter().any(|r| r.tier == tier) {
                out.push(Ranked {
                    tier,
                    reason: reason.to_string(),
                });
            }
        };
        if q.kernel == KernelNeed::Custom {
            push(
                Tier::Microvm,
                "needs its own kernel: only a microVM has a guest kernel",
            );
            return out;
        }
        if q.language == Language::Wasm {
            push(
                Tier::Wasm,
                "a WebAssembly module runs natively on the wasm tier",
            );
            return out;
        }
        if q.language == Language::Javascript {
            push(
                Tier::Wasm,
                "JavaScript snippets run in a QuickJS isolate: fastest start, no syscalls",
            );
        }
        if q.language == Language::Python && q.io == IoProfile::Compute {
            push(
                Tier::Wasm,
                "compute-bound Python runs in CPython-in-WebAssembly with numpy/pandas",
            );
        }
        match (q.trust, q.io) {
            (Trust::Trusted, _) => {
                push(
                    Tier::Container,
                    "trusted code: a hardened container gives real tools at native speed",
                );
                push(
                    Tier::Gvisor,
                    "stronger boundary: gVisor's user-space kernel",
                );
                push(
                    Tier::Microvm,
                    "strongest boundary: a guest kernel under KVM",
                );
            }
            (Trust::Untrusted, IoProfile::SyscallHeavy) => {
                push(
                    Tier::Microvm,
                    "untrusted and syscall-heavy: a guest kernel absorbs the syscalls behind KVM",
                );
                push(
                    Tier::Gvisor,
                    "untrusted: gVisor intercepts syscalls (slower for fork/exec and I/O)",
                );
            }
            (Trust::Untrusted, IoProfile::Compute) => {
                push(
                    Tier::Gvisor,
                    "untrusted and syscall-light: gVisor's user-space kernel costs little",
                );
                push(Tier::Microvm, "untrusted: a guest kernel behind KVM");
            }
        }
        if q.trust == Trust::Untrusted && q.allow_weaker_isolation {
            push(
                Tier::Container,
                "weaker isolation explicitly allowed: shared kernel, hardened",
            );
        }
        out
    }

    /// Ranks, then picks the first tier whose status (from the host probe) is available.
    /// Tiers missing from `statuses` are treated as unavailable ("not built in").
    pub fn select(&self, q: &Question, statuses: &[TierStatus]) -> Selection {
        let ranking = self.rank(q);
        let statuses: Vec<TierStatus> = ranking
            .iter()
            .map(|r| {
                statuses
                    .iter()
                    .find(|s| s.tier == r.tier)
                    .cloned()
                    .unwrap_or_else(|| {
                        TierStatus::unavailable(
                            r.tier,
                            "backend not built into this binary",
                            format!("rebuild agent-sandbox with the `{}` feature", r.tier),
                        )
                    })
            })
            .collect();
        let chosen = statuses.iter().find(|s| s.available).map(|s| s.tier);
        Selection {
            ranking,
            chosen,
            statuses,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(lang: Language, trust: Trust, io: IoProfile, kernel: KernelNeed) -> Question {
        Question {
            language: lang,
            trust,
            io,
            kernel,
            allow_weaker_isolation: false,
        }
    }

    fn tiers(q: &Question) -> Vec<Tier> {
        Selector.rank(q).into_iter().map(|r| r.tier).collect()
    }

    use IoProfile::*;
    use KernelNeed::None as NoKernel;
    use Language::*;
    use Tier::{Container as Ctr, Gvisor as Gv, Microvm as Vm, Wasm as W};
    use Trust::*;

    #[test]
    fn seed_cases() {
        // A JS `toUpperCase` snippet from anyone.
        assert_eq!(
            tiers(&q(Javascript, Untrusted, Compute, NoKernel)),
            [W, Gv, Vm]
        );
        assert_eq!(
            tiers(&q(Javascript, Trusted, Compute, NoKernel)),
            [W, Ctr, Gv, Vm]
        );
        // `python analysis.py` with pandas.
        assert_eq!(tiers(&q(Python, Untrusted, Compute, NoKernel)), [W, Gv, Vm]);
        assert_eq!(
            tiers(&q(Python, Trusted, Compute, NoKernel)),
            [W, Ctr, Gv, Vm]
        );
        // `gcc main.c`, `git clone`, `npm install` from an untrusted user.
        for lang in [C, Shell, Node] {
            assert_eq!(
                tiers(&q(lang, Untrusted, SyscallHeavy, NoKernel)),
                [Vm, Gv],
                "{lang}"
            );
        }
        // An internal developer agent.
        for lang in [Shell, Python, Node, C] {
            assert_eq!(
                tiers(&q(lang, Trusted, SyscallHeavy, NoKernel)),
                [Ctr, Gv, Vm],
                "{lang}"
            );
        }
        // Custom kernel modules.
        for trust in [Trusted, Untrusted] {
            assert_eq!(
                tiers(&q(Shell, trust, SyscallHeavy, KernelNeed::Custom)),
                [Vm]
            );
            assert_eq!(
                tiers(&q(Javascript, trust, Compute, KernelNeed::Custom)),
                [Vm]
            );
        }
        // Untrusted compute-bound C.
        assert_eq!(tiers(&q(C, Untrusted, Compute, NoKernel)), [Gv, Vm]);
        // A wasm module.
        assert_eq!(
            tiers(&q(Language::Wasm, Untrusted, SyscallHeavy, NoKernel)),
            [W]
        );
        // Syscall-heavy python is not sent to wasm first.
        assert_eq!(
            tiers(&q(Python, Untrusted, SyscallHeavy, NoKernel)),
            [Vm, Gv]
        );
    }

    #[test]
    fn untrusted_never_gets_container_without_opt_in() {
        for lang in Language::ALL {
            for io in [Compute, SyscallHeavy] {
                let mut question = q(lang, Untrusted, io, NoKernel);
                assert!(!tiers(&question).contains(&Ctr), "{lang} {io:?}");
                question.allow_weaker_isolation = true;
                let t = tiers(&question);
                if lang != Language::Wasm {
                    assert_eq!(
                        t.last(),
                        Some(&Ctr),
                        "{lang} {io:?}: container is last resort"
                    );
                }
            }
        }
    }

    #[test]
    fn every_rank_has_a_reason_and_no_duplicates() {
        for lang in Language::ALL {
            for trust in [Trusted, Untrusted] {
                for io in [Compute, SyscallHeavy] {
                    for k in [NoKernel, KernelNeed::Custom] {
                        let r = Selector.rank(&q(lang, trust, io, k));
                        assert!(!r.is_empty());
                        assert!(r.iter().all(|x| !x.reason.is_empty()));
                        let mut t: Vec<_> = r.iter().map(|x| x.tier).collect();
                        t.sort();
                        t.dedup();
                        assert_eq!(t.len(), r.len());
                        assert!(!t.contains(&Tier::Unisolated));
                    }
                }
            }
        }
    }

    #[test]
    fn select_picks_first_available_and_explains_failure() {
        let question = q(Python, Untrusted, Compute, NoKernel);
        let statuses = vec![
            TierStatus::unavailable(
                W,
                "python.wasm not installed",
                "agent-sandbox install python-wasm",
            ),
            TierStatus::available(Gv, "runsc 2022"),
            TierStatus::available(Ctr, "namespaces ok"),
        ];
        let s = Selector.select(&question, &statuses);
        assert_eq!(s.chosen, Some(Gv));
        assert_eq!(s.require().unwrap(), Gv);

        let none = vec![TierStatus::available(Ctr, "namespaces ok")];
        let s = Selector.select(&question, &none);
        assert_eq!(
            s.chosen, None,
            "untrusted code must not fall back to container"
        );
        let msg = s.require().unwrap_err().to_string();
        for t in [
            "wasm",
            "gvisor",
            "microvm",
            "not built into this binary",
            "fix:",
        ] {
            assert!(msg.contains(t), "{msg}");
        }
        let mut opt_in = question;
        opt_in.allow_weaker_isolation = true;
        assert_eq!(Selector.select(&opt_in, &none).chosen, Some(Ctr));
    }
}
