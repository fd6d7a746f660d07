//! # sandbox-core
//!
//! The backend-agnostic heart of agent-sandbox: the [`Backend`] and [`Sandbox`] traits that
//! every isolation tier implements, the [`SandboxSpec`] callers describe sandboxes with, the
//! [`NetworkPolicy`] and its shared [`decide`](NetworkPolicy::decide) function, [`Capabilities`],
//! the phase [`Timeline`], [`SnapshotStore`]s, [`WarmPool`]s and the tier [`Selector`].
//!
//! Nothing here knows about a particular engine: backends live in their own crates.
//!
//! In the repository, `ARCHITECTURE.md` maps the modules and crates, `docs/threat-model.md`
//! says which defence lives where (the network decision and the server's guard in
//! [`policy`], the fd-relative file access in [`beneath`]), and `docs/unsafe.md` says where
//! `unsafe` is allowed and what its `// SAFETY:` comments must say.

#![forbid(unsafe_op_in_unsafe_fn)]

pub mod beneath;
pub mod capabilities;
pub mod cell;
pub mod egress;
pub mod error;
pub mod exec;
pub mod fsnap;
pub mod host_limits;
pub mod image;
pub mod interpreter;
pub mod lifecycle;
pub mod path;
pub mod policy;
pub mod pool;
pub mod probe;
pub mod process;
pub mod pty;
pub mod publish;
pub mod sandbox;
pub mod secrets;
pub mod selector;
pub mod snapshot;
pub mod spec;
pub mod tier;
pub mod timeline;
pub mod usage;
pub mod watch;

/// For backend authors: the machinery every tier shares, in one place. An agent developer
/// reaches sandboxes through the trait and spec types at this crate's root (and through
/// `agent-sandbox`'s `Runtime`); a backend author implements [`Backend`] and [`Sandbox`] with
/// these.
///
/// | need | items |
/// |---|---|
/// | output: bounded buffers, flood detection, streaming | [`pump_output`], [`stream_output`], [`FloodReader`], [`OutputBuffer`], [`StreamSink`], [`flood_threshold`] |
/// | the state machine every tier answers the same way | [`Lifecycle`], [`Transition`], [`Step`], [`Held`], [`LIFETIME_REACHED`] |
/// | processes and their table | [`ProcessTable`], [`ProcessControl`], [`ProcessHandle`] |
/// | published ports | [`Dialer`] |
/// | egress and proxy-held secrets | [`EgressEnforcer`], [`EgressPlan`], [`SecretPlan`], [`SecretUse`], [`ProxiedSecret`], [`StreamRedactor`] |
/// | scratch space | [`TmpfsCaps`] |
/// | timing the first command | [`TimelineRecorder`] |
pub mod backend_kit {
    pub use crate::egress::{EgressEnforcer, EgressPlan, SecretPlan, SecretUse};
    pub use crate::exec::{
        flood_threshold, pump_output, stream_output, FloodReader, OutputBuffer, StreamSink,
    };
    pub use crate::lifecycle::{Held, Lifecycle, Step, Transition, LIFETIME_REACHED};
    pub use crate::path::paths_overlap;
    pub use crate::process::{ProcessControl, ProcessHandle, ProcessTable};
    pub use crate::publish::Dialer;
    pub use crate::secrets::{ProxiedSecret, StreamRedactor};
    pub use crate::spec::TmpfsCaps;
    pub use crate::timeline::TimelineRecorder;
}

pub use capabilities::{Capabilities, NetworkMode, SnapshotKind};
pub use cell::{CellError, Output, OutputKind};
pub use egress::{EgressEnforcer, EgressPlan, NetworkEvent, SecretPlan, SecretUse};
pub use error::{Error, Result};
pub use exec::{
    flood_threshold, pump_output, stream_output, Command, ExecEvent, ExecRequest, ExecResult,
    ExecStream, FloodReader, LimitKind, OutputBuffer, StreamKind, StreamSink, Tty,
};
pub use image::ImageRef;
pub use lifecycle::{Held, Lifecycle, State as LifecycleState, Step, Transition, LIFETIME_REACHED};
pub use path::{DirEntry, EntryKind, WorkspacePath, WORKSPACE_MOUNT};
pub use policy::{
    Cidr, Decision, DecisionRule, DenyRule, HostPattern, HostRule, NetworkPolicy, ServerNetworks,
};
pub use pool::{PoolConfig, PoolStats, WarmPool};
pub use probe::TierStatus;
pub use process::{
    Process, ProcessControl, ProcessHandle, ProcessId, ProcessInfo, ProcessState, ProcessTable,
    Signal,
};
pub use pty::PtyMaster;
pub use publish::{Connection, Dialer, Ports, PublishedPort};
pub use sandbox::{Backend, DynBackend, Sandbox};
pub use secrets::{
    EnvSecretSource, MapSecretSource, ProxiedSecret, Redactor, ResolvedSecrets, Secret,
    SecretBinding, SecretExposure, SecretPlaces, SecretSource, StreamRedactor,
};
pub use selector::{IoProfile, KernelNeed, Question, Ranked, Selection, Selector, Trust};
pub use snapshot::{
    ObjectSnapshotStore, SnapshotDraft, SnapshotError, SnapshotId, SnapshotManifest, SnapshotStore,
};
pub use spec::{Limits, Mount, SandboxSpec, SpecBuilder, TmpfsCap, TmpfsCaps, Workspace};
pub use tier::{IsolationBoundary, Language, Tier};
pub use timeline::{Phase, PhaseTiming, Timeline, TimelineRecorder};
pub use usage::Usage;
pub use watch::{FsEvent, FsEventKind, Watch, WatchFeed};
