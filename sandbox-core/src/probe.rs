//! Host probe results: can this host run a tier, and if not, why and how to fix it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::tier::Tier;

/// Whether one tier can run on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TierStatus {
    /// The tier.
    pub tier: Tier,
    /// `true` when the backend can create sandboxes here.
    pub available: bool,
    /// What was found (for an available tier: the engine and version; otherwise why not).
    pub reason: String,
    /// What to do to make the tier available, when it is not.
    pub fix: Option<String>,
    /// Measured facts (engine versions, cgroup version, KVM kind...), for `probe --json`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub details: BTreeMap<String, String>,
}

impl TierStatus {
    /// An available tier.
    pub fn available(tier: Tier, reason: impl Into<String>) -> Self {
        TierStatus {
            tier,
            available: true,
            reason: reason.into(),
            fix: None,
            details: BTreeMap::new(),
        }
    }

    /// An unavailable tier, with the fix.
    pub fn unavailable(tier: Tier, reason: impl Into<String>, fix: impl Into<String>) -> Self {
        TierStatus {
            tier,
            available: false,
            reason: reason.into(),
            fix: Some(fix.into()),
            details: BTreeMap::new(),
        }
    }

    /// Adds a measured fact.
    pub fn with_detail(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.details.insert(key.into(), value.into());
        self
    }
}
