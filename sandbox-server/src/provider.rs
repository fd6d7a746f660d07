//! Where the server's sandboxes come from: the [`Provider`] trait, and [`OneBackend`], a
//! provider of one backend.

use std::sync::Arc;

use async_trait::async_trait;
use sandbox_core::{
    Capabilities, Sandbox, SandboxSpec, SnapshotId, SnapshotStore, Tier, TierStatus,
};

/// Where sandboxes come from: creates one for a spec, on a tier or the selector's choice,
/// and restores snapshots.
#[async_trait]
pub trait Provider: Send + Sync + 'static {
    /// Creates a sandbox of `spec` on `tier` (`None`: the best tier for the spec's language
    /// that this host can run).
    async fn create(
        &self,
        spec: &SandboxSpec,
        tier: Option<Tier>,
    ) -> sandbox_core::Result<Box<dyn Sandbox>>;

    /// Restores snapshot `id` from `store` on the tier that took it.
    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
    ) -> sandbox_core::Result<Box<dyn Sandbox>>;

    /// What `tier` can do here, if this provider has it (used to refuse a lifetime the tier
    /// cannot honour, such as pausing when idle on a tier without pause).
    fn capabilities(&self, tier: Tier) -> Option<Capabilities>;

    /// Which tiers this host can run, with the reason and the fix for those it cannot
    /// (`GET /v1/tiers`). May answer from a cache of tiers found available before.
    async fn probe(&self) -> Vec<TierStatus>;

    /// The backend of `tier`, if this provider has it, for the server's warm pools
    /// ([`ServerConfig::warm`](crate::ServerConfig::warm)); `None` (the default): specs are
    /// never pooled.
    fn backend(&self, tier: Tier) -> Option<sandbox_core::DynBackend> {
        let _ = tier;
        None
    }
}

/// A [`Provider`] of one backend: every sandbox on its tier, whatever tier a client names.
/// For serving a single engine (and for tests); the facade's `Runtime` serves every tier.
pub struct OneBackend(pub Arc<dyn sandbox_core::Backend>);

impl std::fmt::Debug for OneBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OneBackend").field(&self.0.tier()).finish()
    }
}

#[async_trait]
impl Provider for OneBackend {
    async fn create(
        &self,
        spec: &SandboxSpec,
        tier: Option<Tier>,
    ) -> sandbox_core::Result<Box<dyn Sandbox>> {
        if let Some(t) = tier.filter(|t| *t != self.0.tier()) {
            return Err(sandbox_core::Error::Unavailable {
                tier: t,
                reason: format!("this server runs only the {} tier", self.0.tier()),
                fix: format!("ask for the {} tier, or for none", self.0.tier()),
            });
        }
        self.0
            .create(spec, sandbox_core::ResolvedSecrets::none())
            .await
    }

    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
    ) -> sandbox_core::Result<Box<dyn Sandbox>> {
        self.0
            .restore(store, id, sandbox_core::ResolvedSecrets::none())
            .await
    }

    fn capabilities(&self, tier: Tier) -> Option<Capabilities> {
        (tier == self.0.tier()).then(|| self.0.capabilities())
    }

    async fn probe(&self) -> Vec<TierStatus> {
        vec![self.0.probe().await]
    }

    fn backend(&self, tier: Tier) -> Option<sandbox_core::DynBackend> {
        (tier == self.0.tier()).then(|| Arc::clone(&self.0))
    }
}
