//! # sandbox-core
//!
//! The backend-agnostic heart of agent-sandbox: the [`Backend`] and [`Sandbox`] traits that
//! every isolation tier implements, the [`SandboxSpec`] callers describe sandboxes with, the
//! [`NetworkPolicy`] and its shared [`decide`](NetworkPolicy::decide) function, [`Capabilities`],
//! the phase [`Timeline`], [`SnapshotStore`]s, [`WarmPool`]s and the tier [`Selector`].
//!
//! Nothing here knows about a particular engine: backends live in their own crates.

#![forbid(unsafe_op_in_unsafe_fn)]

pub mod beneath;
pub mod capabilities;
pub mod egress;
pub mod error;
pub mod exec;
pub mod fsnap;
pub mod image;
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

pub use capabilities::{Capabilities, NetworkMode, SnapshotKind};
pub use egress::{EgressEnforcer, EgressPlan, NetworkEvent, SecretPlan, SecretUse};
pub use error::{Error, Result};
pub use exec::{
    flood_threshold, pump_output, stream_output, Command, ExecEvent, ExecRequest, ExecResult,
    ExecStream, FloodReader, LimitKind, OutputBuffer, StreamKind, StreamSink, Tty,
};
pub use image::ImageRef;
pub use lifecycle::{Lifecycle, State as LifecycleState, Transition};
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
