//! The sandbox spec: what the caller asks for. Typed, flat, serde, with a builder.
//!
//! Everything is denied unless granted here: no network ([`NetworkPolicy::DenyAll`]), no host
//! environment variable unless named in [`SandboxSpec::pass_env`], no host file unless mounted.

mod builder;
mod limits;
mod validate;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::image::ImageRef;
use crate::policy::NetworkPolicy;
use crate::secrets::{SecretBinding, SecretExposure};
use crate::tier::Language;

pub(crate) use builder::millis;
pub use builder::SpecBuilder;
pub use limits::{Limits, TmpfsCap, TmpfsCaps};

/// Everything a backend needs to create a sandbox.
///
/// Build one with [`SandboxSpec::builder`] (validated) or [`SandboxSpec::new`] and field
/// assignment, or deserialize one. The struct is `#[non_exhaustive]`: later versions add
/// fields (with defaults), so it cannot be written as a struct literal outside this crate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct SandboxSpec {
    /// The language code strings are written in (`exec` with [`Command::Code`](crate::Command::Code)).
    pub language: Language,
    /// A root filesystem directory (a `debootstrap` tree, an unpacked OCI image) to use
    /// instead of the default "host tools" view (the host's `/usr` and a few `/etc` files,
    /// read-only). It is never written: writes go to an overlay the sandbox owns. Backends
    /// without a Linux userland refuse it with `Unsupported`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<PathBuf>,
    /// An OCI image to start from (pulled, verified and cached by the `sandbox-image`
    /// crate), instead of the host-tools view: its layers are the root filesystem, its
    /// config's `Env`, `WorkingDir` and `User` apply. Exclusive with `rootfs`. Never written:
    /// writes go to an overlay the sandbox owns. Tiers without a Linux userland refuse it
    /// with `Unsupported`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageRef>,
    /// The sandbox's working directory, seen inside as `/workspace`.
    #[serde(default)]
    pub workspace: Workspace,
    /// A second path at which the workspace is visible inside: `/home/NAME` (one directory
    /// under `/home`), for programs that expect their files in a home directory (E2B's
    /// `/home/user`). The same directory, not a copy: the file API, snapshots and watches
    /// still name it `/workspace`. Tiers that cannot show it refuse the spec with
    /// `Unsupported` ([`Capabilities::workspace_alias`](crate::Capabilities::workspace_alias)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_alias: Option<String>,
    /// Extra host paths made visible inside. Read-only unless `read_only` is `false`.
    #[serde(default)]
    pub mounts: Vec<Mount>,
    /// Environment variables set for every command. Nothing of the host's passes by default.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Host environment variables passed through **by name** (copied at create time).
    #[serde(default)]
    pub pass_env: Vec<String>,
    /// Secrets, by name; values come from a [`SecretSource`](crate::SecretSource).
    #[serde(default)]
    pub secrets: Vec<SecretBinding>,
    /// Resource limits.
    #[serde(default)]
    pub limits: Limits,
    /// Network egress policy.
    #[serde(default)]
    pub network: NetworkPolicy,
}

/// Where `/workspace` comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Workspace {
    /// A fresh, empty workspace owned by the sandbox (capped by `limits.disk_bytes`).
    #[default]
    Empty,
    /// A host directory, read-write unless `read_only`.
    ///
    /// **Identity** (one model for every tier; see "Host-directory workspaces: identity" in
    /// `docs/container.md`): commands run unprivileged (no capabilities) as the sandbox's
    /// command user, which owns the workspace inside; what they create there belongs to the
    /// directory's owner on the host, never to another uid.
    /// - container, as root: commands run as `sandbox` (uid 1000; an image's `User` or root
    ///   in image sandboxes) and the directory is an idmapped mount mapping its owner to that
    ///   user. Where the filesystem cannot be idmapped, a directory of an unprivileged owner
    ///   maps the sandbox user to the owner instead, a read-only one is mounted as it is, and
    ///   anything else is refused with [`Error::Unsupported`]. A
    ///   root-owned writable directory refuses setting setuid/setgid bits (`EPERM`).
    ///   Rootless: commands run as the caller.
    /// - gvisor: commands run as the directory owner's uid and gid.
    /// - wasm: files are written by the library's own process (the caller).
    /// - microvm: not supported.
    ///
    /// Read-only, every write fails with `EROFS`.
    HostDir {
        /// The host path (must exist and be a directory).
        path: PathBuf,
        /// Whether the sandbox may only read it (writes fail with `EROFS`).
        #[serde(default)]
        read_only: bool,
    },
}

/// An extra host path made visible inside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Mount {
    /// Host path.
    pub source: PathBuf,
    /// Absolute path inside the sandbox.
    pub target: String,
    /// Read-only (the default).
    #[serde(default = "yes")]
    pub read_only: bool,
}

fn yes() -> bool {
    true
}

impl Mount {
    /// `source` on the host, visible read-only at the absolute path `target` inside.
    pub fn read_only(source: impl Into<PathBuf>, target: impl Into<String>) -> Self {
        Mount {
            source: source.into(),
            target: target.into(),
            read_only: true,
        }
    }

    /// `source` on the host, visible read-write at the absolute path `target` inside.
    pub fn read_write(source: impl Into<PathBuf>, target: impl Into<String>) -> Self {
        Mount {
            source: source.into(),
            target: target.into(),
            read_only: false,
        }
    }
}

impl SandboxSpec {
    /// A spec with safe defaults for `language`.
    pub fn new(language: Language) -> Self {
        SandboxSpec {
            language,
            rootfs: None,
            image: None,
            workspace: Workspace::Empty,
            workspace_alias: None,
            mounts: Vec::new(),
            env: BTreeMap::new(),
            pass_env: Vec::new(),
            secrets: Vec::new(),
            limits: Limits::default(),
            network: NetworkPolicy::DenyAll,
        }
    }

    /// Whether a secret of the spec is held by the egress proxy
    /// ([`SecretExposure::Proxy`]) rather than given to the
    /// sandbox.
    pub fn holds_proxied_secrets(&self) -> bool {
        self.secrets
            .iter()
            .any(|s| matches!(s.exposure, crate::SecretExposure::Proxy { .. }))
    }

    /// The sandbox user's name and home on a tier's own userland (the generated
    /// `/etc/passwd` of the host-tools view): `sandbox` at `/workspace`, or, with a
    /// [`workspace_alias`](Self::workspace_alias) `/home/NAME`, NAME at the alias (unless
    /// NAME is no portable user name or one the file has already: `root`, `nobody`).
    /// An image's own `/etc/passwd` is its own.
    pub fn user_name_and_home(&self) -> (&str, &str) {
        let named = self.workspace_alias.as_deref().and_then(|a| {
            let name = a.strip_prefix("/home/")?;
            let portable = name.len() <= 32
                && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-".contains(&b));
            (portable && !matches!(name, "root" | "nobody" | "nogroup")).then_some((name, a))
        });
        named.unwrap_or(("sandbox", crate::WORKSPACE_MOUNT))
    }

    /// The environment every command starts with: the spec's `env`, then the named host
    /// variables that exist. Secrets are added by the backend from
    /// [`ResolvedSecrets`](crate::ResolvedSecrets).
    pub fn base_env(&self) -> BTreeMap<String, String> {
        let mut env = self.env.clone();
        for k in &self.pass_env {
            if let Ok(v) = std::env::var(k) {
                env.insert(k.clone(), v);
            }
        }
        env
    }
}

#[cfg(test)]
mod tests;
