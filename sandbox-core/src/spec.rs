//! The sandbox spec: what the caller asks for. Typed, flat, serde, with a builder.
//!
//! Everything is denied unless granted here: no network ([`NetworkPolicy::DenyAll`]), no host
//! environment variable unless named in [`SandboxSpec::pass_env`], no host file unless mounted.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::image::ImageRef;
use crate::policy::NetworkPolicy;
use crate::secrets::{SecretBinding, SecretExposure};
use crate::tier::Language;

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

/// Resource limits. Every field has a safe default; `None` where a limit can be absent means
/// "the backend's own cap", never "unlimited host resources".
///
/// Which of them a tier enforces is listed in [`Capabilities::limits`](crate::Capabilities);
/// set them through [`SpecBuilder`]'s setters (one per limit) or by assignment on
/// [`Limits::default`]. `#[non_exhaustive]`: later versions add limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Limits {
    /// Memory for the whole sandbox, bytes.
    pub memory_bytes: u64,
    /// CPU time per exec, milliseconds.
    pub cpu_time_ms: u64,
    /// Wall time per exec, milliseconds (a call's own timeout may lower it).
    pub wall_time_ms: u64,
    /// Wall time for the sandbox's whole life, milliseconds; then it is destroyed.
    pub lifetime_ms: u64,
    /// Processes/threads at once.
    pub pids: u32,
    /// Captured output per stream per exec, bytes; the rest is dropped and `truncated` set.
    pub output_bytes: u64,
    /// Writable disk (workspace + temp), bytes. A tier whose disk is memory (tmpfs in the
    /// container tier) may hold it to a part of `memory_bytes`, so that files cannot fill the
    /// memory limit; its docs say how.
    pub disk_bytes: u64,
    /// Open file descriptors per process.
    pub open_files: u32,
    /// Optional instruction budget (wasm fuel) per exec.
    pub fuel: Option<u64>,
    /// CPU share as a scheduler quota, in thousandths of a CPU (500 = half a CPU).
    pub cpu_millis: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_bytes: 512 << 20,
            cpu_time_ms: 60_000,
            wall_time_ms: 30_000,
            lifetime_ms: 3_600_000,
            pids: 256,
            output_bytes: 1 << 20,
            disk_bytes: 1 << 30,
            open_files: 256,
            fuel: None,
            cpu_millis: 1000,
        }
    }
}

/// Size and inode caps of one memory-backed (tmpfs) mount; see [`Limits::tmpfs_caps`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TmpfsCap {
    /// Data, bytes (tmpfs `size=`).
    pub bytes: u64,
    /// Files and directories (tmpfs `nr_inodes=`).
    pub inodes: u64,
}

/// Caps of a sandbox's memory-backed mounts; see [`Limits::tmpfs_caps`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TmpfsCaps {
    /// Each scratch mount (`/tmp`, `/dev/shm`).
    pub scratch: TmpfsCap,
    /// Each disk mount (the workspace, an overlay's upper layer).
    pub disk: TmpfsCap,
}

impl Limits {
    /// Kernel memory one tmpfs file costs, inode and dentry together (measured: 100,000
    /// empty files in a container sandbox's workspace raised its memory cgroup's usage by
    /// 91 MiB).
    pub const TMPFS_INODE_BYTES: u64 = 1024;

    /// Caps for a sandbox's memory-backed mounts: `scratch` mounts like `/tmp` (each asking
    /// a quarter of [`disk_bytes`](Self::disk_bytes)) and `disk` mounts like a tmpfs
    /// workspace (each asking `disk_bytes`).
    ///
    /// Files there are charged to the sandbox's memory limit, pages and inodes alike, and
    /// nothing can reclaim them (there is no swap to push them to). Sized by `disk_bytes`
    /// alone, they could fill the limit, and every later command, then the sandbox's own
    /// processes, would meet the OOM killer: the sandbox would be lost with its files.
    /// Together the mounts therefore hold at most **5/8 of [`memory_bytes`](Self::memory_bytes)
    /// in data and one inode per 8 KiB of it** (≈ 1/8 of the limit at
    /// [`TMPFS_INODE_BYTES`](Self::TMPFS_INODE_BYTES) each), which always leaves processes a
    /// quarter of the limit; a full mount fails writes with `ENOSPC`. Each scratch mount gets
    /// up to an eighth of the data and of the inodes; the disk mounts share the rest, each at
    /// most `disk_bytes`. Every mount keeps at least 1 MiB and 256 inodes.
    pub fn tmpfs_caps(&self, scratch: u64, disk: u64) -> TmpfsCaps {
        const MIN_BYTES: u64 = 1 << 20;
        const MIN_INODES: u64 = 256;
        let data = self.memory_bytes / 8 * 5;
        let inodes = self.memory_bytes / (8 * Self::TMPFS_INODE_BYTES);
        let small = TmpfsCap {
            bytes: (self.disk_bytes / 4).min(data / 8).max(MIN_BYTES),
            inodes: (inodes / 8).max(MIN_INODES),
        };
        let share = |total: u64, taken: u64| total.saturating_sub(scratch * taken) / disk.max(1);
        TmpfsCaps {
            scratch: small,
            disk: TmpfsCap {
                bytes: share(data, small.bytes).min(self.disk_bytes).max(MIN_BYTES),
                inodes: share(inodes, small.inodes).max(MIN_INODES),
            },
        }
    }

    /// The per-exec wall limit as a duration.
    pub fn wall_time(&self) -> Duration {
        Duration::from_millis(self.wall_time_ms)
    }

    /// The sandbox lifetime as a duration.
    pub fn lifetime(&self) -> Duration {
        Duration::from_millis(self.lifetime_ms)
    }

    /// Checks that every limit is possible.
    pub fn validate(&self) -> Result<()> {
        let check = |ok: bool, field: &str, why: &str| {
            if ok {
                Ok(())
            } else {
                Err(Error::invalid(format!("limits.{field}"), why))
            }
        };
        check(
            self.memory_bytes >= 4 << 20,
            "memory_bytes",
            "must be at least 4 MiB",
        )?;
        check(
            self.memory_bytes <= 1 << 40,
            "memory_bytes",
            "must be at most 1 TiB",
        )?;
        check(self.cpu_time_ms > 0, "cpu_time_ms", "must be positive")?;
        check(self.wall_time_ms > 0, "wall_time_ms", "must be positive")?;
        check(
            self.lifetime_ms >= self.wall_time_ms,
            "lifetime_ms",
            "must be at least wall_time_ms",
        )?;
        check(self.pids >= 1, "pids", "must be at least 1")?;
        check(self.output_bytes >= 1, "output_bytes", "must be at least 1")?;
        check(self.open_files >= 16, "open_files", "must be at least 16")?;
        check(
            (10..=1_024_000).contains(&self.cpu_millis),
            "cpu_millis",
            "must be between 10 (1% of a CPU) and 1024000",
        )?;
        check(self.fuel != Some(0), "fuel", "must be positive when set")?;
        Ok(())
    }
}

fn valid_env_name(k: &str) -> bool {
    !k.is_empty()
        && !k.as_bytes()[0].is_ascii_digit()
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

impl SandboxSpec {
    /// A spec with safe defaults for `language`.
    pub fn new(language: Language) -> Self {
        SandboxSpec {
            language,
            rootfs: None,
            image: None,
            workspace: Workspace::Empty,
            mounts: Vec::new(),
            env: BTreeMap::new(),
            pass_env: Vec::new(),
            secrets: Vec::new(),
            limits: Limits::default(),
            network: NetworkPolicy::DenyAll,
        }
    }

    /// Starts a builder.
    pub fn builder(language: Language) -> SpecBuilder {
        SpecBuilder {
            spec: SandboxSpec::new(language),
            image_error: None,
            secret_error: None,
        }
    }

    /// Checks the whole spec; the error names the field and says what is accepted.
    pub fn validate(&self) -> Result<()> {
        self.limits.validate()?;
        self.network.validate()?;
        for k in self.env.keys().chain(self.pass_env.iter()) {
            if !valid_env_name(k) {
                return Err(Error::invalid(
                    "env",
                    format!("`{k}` is not a valid variable name"),
                ));
            }
        }
        for v in self.env.values() {
            if v.contains('\0') {
                return Err(Error::invalid("env", "values cannot contain NUL"));
            }
        }
        for s in &self.secrets {
            if s.name.is_empty() {
                return Err(Error::invalid("secrets", "a secret needs a name"));
            }
            match &s.exposure {
                SecretExposure::Env { var } | SecretExposure::Proxy { var, .. }
                    if !valid_env_name(var) =>
                {
                    return Err(Error::invalid(
                        "secrets",
                        format!("`{var}` is not a variable name"),
                    ));
                }
                SecretExposure::Proxy { hosts, .. } => {
                    if hosts.is_empty() {
                        return Err(Error::invalid(
                            "secrets",
                            format!("the proxy-held secret `{}` is bound to no host", s.name),
                        ));
                    }
                    if let Some(h) = hosts.iter().find(|h| !self.network.allows_host_rule(h)) {
                        return Err(Error::invalid(
                            "secrets",
                            format!(
                                "the proxy-held secret `{}` is bound to {}, which the network \
                                 policy does not allow (allow the host too)",
                                s.name, h.pattern
                            ),
                        ));
                    }
                }
                _ => {}
            }
        }
        if self.image.is_some() && self.rootfs.is_some() {
            return Err(Error::invalid(
                "image",
                "`image` and `rootfs` are exclusive: a sandbox starts from one root filesystem",
            ));
        }
        match &self.image {
            Some(ImageRef::OciLayout { path, .. }) if !path.is_absolute() => {
                return Err(Error::invalid(
                    "image",
                    format!(
                        "{} is not an absolute path (an OCI image layout's directory)",
                        path.display()
                    ),
                ));
            }
            Some(ImageRef::DockerArchive { path }) if !path.is_absolute() => {
                return Err(Error::invalid(
                    "image",
                    format!(
                        "{} is not an absolute path (a `docker save` tarball)",
                        path.display()
                    ),
                ));
            }
            _ => {}
        }
        if let Some(root) = &self.rootfs {
            if !root.is_absolute() {
                return Err(Error::invalid(
                    "rootfs",
                    format!("{} is not an absolute path", root.display()),
                ));
            }
        }
        for m in &self.mounts {
            if !m.target.starts_with('/') || m.target.split('/').any(|c| c == "..") {
                return Err(Error::invalid(
                    "mounts",
                    format!("target `{}` must be absolute and without `..`", m.target),
                ));
            }
            if m.target == "/" || m.target == "/workspace" {
                return Err(Error::invalid(
                    "mounts",
                    format!("cannot mount over `{}`", m.target),
                ));
            }
        }
        Ok(())
    }

    /// [`validate`](Self::validate), then what only the host that creates the sandbox can
    /// check: that the host paths the spec names exist (an OCI layout's or a rootfs's
    /// directory, a `docker save` tarball, a host-directory workspace, mount sources).
    /// Backends call this when they create a sandbox; a spec built on one machine and sent to
    /// a server is checked there, not where it was built.
    pub fn validate_on_host(&self) -> Result<()> {
        self.validate()?;
        match &self.image {
            Some(ImageRef::OciLayout { path, .. }) if !path.is_dir() => {
                return Err(Error::invalid(
                    "image",
                    format!(
                        "{} is not an existing directory (an OCI image layout)",
                        path.display()
                    ),
                ));
            }
            Some(ImageRef::DockerArchive { path }) if !path.is_file() => {
                return Err(Error::invalid(
                    "image",
                    format!(
                        "{} is not an existing file (a `docker save` tarball)",
                        path.display()
                    ),
                ));
            }
            _ => {}
        }
        if let Some(root) = &self.rootfs {
            if !root.is_dir() {
                return Err(Error::invalid(
                    "rootfs",
                    format!("{} is not an existing directory", root.display()),
                ));
            }
        }
        if let Workspace::HostDir { path, .. } = &self.workspace {
            if !path.is_dir() {
                return Err(Error::invalid(
                    "workspace",
                    format!("{} is not an existing directory", path.display()),
                ));
            }
        }
        if let Some(m) = self.mounts.iter().find(|m| !m.source.exists()) {
            return Err(Error::invalid(
                "mounts",
                format!("source {} does not exist", m.source.display()),
            ));
        }
        Ok(())
    }

    /// Whether a secret of the spec is held by the egress proxy
    /// ([`SecretExposure::Proxy`]) rather than given to the
    /// sandbox.
    pub fn holds_proxied_secrets(&self) -> bool {
        self.secrets
            .iter()
            .any(|s| matches!(s.exposure, crate::SecretExposure::Proxy { .. }))
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

/// Builder for [`SandboxSpec`], in the style of a configuration builder: every setter takes
/// `self` and returns it, says its default, and nothing is checked until
/// [`build`](Self::build), which validates the whole spec at once.
///
/// ```
/// use std::time::Duration;
/// use sandbox_core::{Language, SandboxSpec};
///
/// let spec = SandboxSpec::builder(Language::Python)
///     .memory_mib(256)
///     .wall_time(Duration::from_secs(10))
///     .pids(64)
///     .env("MODE", "test")
///     .build()?;
/// assert_eq!(spec.limits.pids, 64);
/// # Ok::<(), sandbox_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct SpecBuilder {
    spec: SandboxSpec,
    /// Why the last [`image`](Self::image) did not parse (reported by `build`).
    image_error: Option<(String, String)>,
    /// Why a secret's host did not parse (reported by `build`).
    secret_error: Option<(String, String)>,
}

/// `d` in whole milliseconds, saturating at `u64::MAX` (what every millisecond field of this
/// crate, in specs and on the wire, holds).
pub(crate) fn millis(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

impl SpecBuilder {
    /// Sets the language code strings are written in (the one given to
    /// [`SandboxSpec::builder`]).
    pub fn language(mut self, language: Language) -> Self {
        self.spec.language = language;
        self
    }

    /// Uses a host directory as `/workspace`. Default: an empty workspace the sandbox owns.
    /// Who writes it, and as whom: see [`Workspace::HostDir`].
    ///
    /// # Errors
    /// Creating the sandbox fails with [`Error::InvalidSpec`] (`workspace`) when `path` is
    /// not an existing directory there ([`SandboxSpec::validate_on_host`]).
    pub fn workspace_dir(mut self, path: impl Into<PathBuf>, read_only: bool) -> Self {
        self.spec.workspace = Workspace::HostDir {
            path: path.into(),
            read_only,
        };
        self
    }

    /// Sets where `/workspace` comes from. Default: [`Workspace::Empty`].
    ///
    /// # Errors
    /// As [`workspace_dir`](Self::workspace_dir).
    pub fn workspace(mut self, workspace: Workspace) -> Self {
        self.spec.workspace = workspace;
        self
    }

    /// Uses a root filesystem directory instead of the host-tools view. Default: none.
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`rootfs`) when `dir` is not
    /// absolute; creating the sandbox, when it is not an existing directory there
    /// ([`SandboxSpec::validate_on_host`]).
    pub fn rootfs(mut self, dir: impl Into<PathBuf>) -> Self {
        self.spec.rootfs = Some(dir.into());
        self
    }

    /// Starts from an OCI image, written as users write it: `python:3.12-slim`,
    /// `ghcr.io/org/img:tag`, `name@sha256:...`, `oci:/dir[:tag]`,
    /// `docker-archive:/file.tar` (see [`ImageRef`]). Default: none (the host-tools view).
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`image`) when the reference
    /// does not parse, when a `rootfs` is set too, or when an offline source's path does not
    /// exist.
    pub fn image(mut self, reference: impl AsRef<str>) -> Self {
        match ImageRef::parse(reference.as_ref()) {
            Ok(r) => {
                self.spec.image = Some(r);
                self.image_error = None;
            }
            Err(Error::InvalidSpec { field, reason }) => self.image_error = Some((field, reason)),
            Err(e) => self.image_error = Some(("image".into(), e.to_string())),
        }
        self
    }

    /// Mounts a host path read-only at `target`. Default: no mounts.
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`mounts`) when `target` is
    /// not absolute, contains `..`, or is `/` or `/workspace`; creating the sandbox, when
    /// `source` does not exist there ([`SandboxSpec::validate_on_host`]).
    pub fn mount_ro(self, source: impl Into<PathBuf>, target: impl Into<String>) -> Self {
        self.mount(Mount::read_only(source, target))
    }

    /// Mounts a host path read-write at `target`. Default: no mounts.
    ///
    /// # Errors
    /// As [`mount_ro`](Self::mount_ro).
    pub fn mount_rw(self, source: impl Into<PathBuf>, target: impl Into<String>) -> Self {
        self.mount(Mount::read_write(source, target))
    }

    /// Adds a mount. Default: no mounts.
    ///
    /// # Errors
    /// As [`mount_ro`](Self::mount_ro).
    pub fn mount(mut self, mount: Mount) -> Self {
        self.spec.mounts.push(mount);
        self
    }

    /// Sets an environment variable for every command. Default: an empty environment.
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`env`) when `key` is not a
    /// variable name (`[A-Za-z_][A-Za-z0-9_]*`) or `value` contains NUL.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.spec.env.insert(key.into(), value.into());
        self
    }

    /// Passes a host environment variable through by name (copied at create time; absent
    /// variables are skipped). Default: none of the host's variables pass.
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`env`) when `key` is not a
    /// variable name.
    pub fn pass_env(mut self, key: impl Into<String>) -> Self {
        self.spec.pass_env.push(key.into());
        self
    }

    /// Exposes a secret as the environment variable `var`. Default: no secrets.
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`secrets`) when `name` is
    /// empty or `var` is not a variable name; resolving the secret happens at create time.
    pub fn secret_env(mut self, name: impl Into<String>, var: impl Into<String>) -> Self {
        self.spec.secrets.push(SecretBinding {
            name: name.into(),
            exposure: SecretExposure::Env { var: var.into() },
        });
        self
    }

    /// Has the egress proxy hold a secret: the sandbox's variable `var` gets a placeholder,
    /// which the proxy replaces by the value in requests to `hosts` only
    /// ([`SecretExposure::Proxy`]). Default: no secrets.
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`secrets`) when `name` is
    /// empty, `var` is not a variable name, a host does not parse, there is no host, or the
    /// network policy does not allow a host.
    pub fn secret_via_proxy<I, S>(
        self,
        name: impl Into<String>,
        var: impl Into<String>,
        hosts: I,
    ) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.secret_via_proxy_in(name, var, hosts, crate::SecretPlaces::default())
    }

    /// [`secret_via_proxy`](Self::secret_via_proxy), replacing the placeholder in the parts
    /// of a request that `places` names (headers only by default; the request target and
    /// bodies are opt-in, see [`SecretPlaces`](crate::SecretPlaces)).
    ///
    /// # Errors
    /// As [`secret_via_proxy`](Self::secret_via_proxy).
    pub fn secret_via_proxy_in<I, S>(
        mut self,
        name: impl Into<String>,
        var: impl Into<String>,
        hosts: I,
        places: crate::SecretPlaces,
    ) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let name = name.into();
        let mut rules = Vec::new();
        for h in hosts {
            match h.as_ref().parse::<crate::HostRule>() {
                Ok(r) => rules.push(r),
                Err(e) => {
                    self.secret_error.get_or_insert((
                        "secrets".into(),
                        format!("the proxy-held secret `{name}`: {e}"),
                    ));
                }
            }
        }
        self.spec.secrets.push(SecretBinding {
            name,
            exposure: SecretExposure::Proxy {
                var: var.into(),
                hosts: rules,
                substitute_in: places,
            },
        });
        self
    }

    /// Makes a secret available to host-side tools only. Default: no secrets.
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`secrets`) when `name` is
    /// empty.
    pub fn secret_host_only(mut self, name: impl Into<String>) -> Self {
        self.spec.secrets.push(SecretBinding {
            name: name.into(),
            exposure: SecretExposure::HostOnly,
        });
        self
    }

    /// Memory for the whole sandbox, in MiB. Default: 512 MiB
    /// ([`Limits::memory_bytes`]).
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`limits.memory_bytes`)
    /// below 4 MiB or above 1 TiB.
    pub fn memory_mib(self, mib: u64) -> Self {
        self.memory_bytes(mib.saturating_mul(1 << 20))
    }

    /// Memory for the whole sandbox, in bytes. Default: 512 MiB.
    ///
    /// # Errors
    /// As [`memory_mib`](Self::memory_mib).
    pub fn memory_bytes(mut self, bytes: u64) -> Self {
        self.spec.limits.memory_bytes = bytes;
        self
    }

    /// CPU time per exec. Default: 60 s ([`Limits::cpu_time_ms`]), counted in whole
    /// milliseconds.
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`limits.cpu_time_ms`) when
    /// it is under a millisecond.
    pub fn cpu_time(mut self, d: Duration) -> Self {
        self.spec.limits.cpu_time_ms = millis(d);
        self
    }

    /// Wall time per exec (a call's own timeout may lower it). Default: 30 s
    /// ([`Limits::wall_time_ms`]). Raises the sandbox's lifetime to at least this.
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`limits.wall_time_ms`) when
    /// it is under a millisecond.
    pub fn wall_time(mut self, d: Duration) -> Self {
        self.spec.limits.wall_time_ms = millis(d);
        self.spec.limits.lifetime_ms = self
            .spec
            .limits
            .lifetime_ms
            .max(self.spec.limits.wall_time_ms);
        self
    }

    /// Wall time for the sandbox's whole life; then it is destroyed. Default: one hour
    /// ([`Limits::lifetime_ms`]).
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`limits.lifetime_ms`) when
    /// it is shorter than the per-exec wall time.
    pub fn lifetime(mut self, d: Duration) -> Self {
        self.spec.limits.lifetime_ms = millis(d);
        self
    }

    /// Processes and threads at once. Default: 256 ([`Limits::pids`]).
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`limits.pids`) at 0.
    pub fn pids(mut self, pids: u32) -> Self {
        self.spec.limits.pids = pids;
        self
    }

    /// Captured output per stream per exec, bytes; the rest is dropped and
    /// [`ExecResult::truncated`](crate::ExecResult) set. Default: 1 MiB
    /// ([`Limits::output_bytes`]).
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`limits.output_bytes`) at 0.
    pub fn output_bytes(mut self, bytes: u64) -> Self {
        self.spec.limits.output_bytes = bytes;
        self
    }

    /// Writable disk (workspace and temporary files), bytes. Default: 1 GiB
    /// ([`Limits::disk_bytes`]; memory-backed tiers may hold it lower, see there).
    ///
    /// # Errors
    /// None of its own: every value is accepted.
    pub fn disk_bytes(mut self, bytes: u64) -> Self {
        self.spec.limits.disk_bytes = bytes;
        self
    }

    /// Open file descriptors per process. Default: 256 ([`Limits::open_files`]).
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`limits.open_files`) below
    /// 16.
    pub fn open_files(mut self, n: u32) -> Self {
        self.spec.limits.open_files = n;
        self
    }

    /// An instruction budget per exec (wasm fuel), or `None` for the tier's own cap.
    /// Default: `None` ([`Limits::fuel`]).
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`limits.fuel`) for
    /// `Some(0)`.
    pub fn fuel(mut self, fuel: Option<u64>) -> Self {
        self.spec.limits.fuel = fuel;
        self
    }

    /// CPU share as a scheduler quota, in thousandths of a CPU (500 = half a CPU).
    /// Default: 1000, one CPU ([`Limits::cpu_millis`]).
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`limits.cpu_millis`)
    /// outside 10..=1024000.
    pub fn cpu_millis(mut self, millis: u32) -> Self {
        self.spec.limits.cpu_millis = millis;
        self
    }

    /// Replaces all limits at once. Default: [`Limits::default`].
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] naming the first impossible
    /// limit (see [`Limits::validate`]).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.spec.limits = limits;
        self
    }

    /// Sets the network egress policy. Default: [`NetworkPolicy::DenyAll`].
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] when the policy is malformed
    /// (see [`NetworkPolicy::validate`]). Whether a tier can enforce it is checked at create
    /// time ([`Error::Unsupported`]).
    pub fn network(mut self, policy: NetworkPolicy) -> Self {
        self.spec.network = policy;
        self
    }

    /// Validates and returns the spec.
    ///
    /// # Errors
    /// [`Error::InvalidSpec`] naming the first bad field and what is accepted; see each
    /// setter.
    pub fn build(self) -> Result<SandboxSpec> {
        if let Some((field, reason)) = self.image_error.or(self.secret_error) {
            return Err(Error::InvalidSpec { field, reason });
        }
        self.spec.validate()?;
        Ok(self.spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::LimitKind;

    #[test]
    fn proxy_held_secrets_must_be_bound_to_allowed_hosts() {
        let ok = SandboxSpec::builder(Language::Shell)
            .network(NetworkPolicy::allow_hosts(["api.github.com", "*.example.com"]).unwrap())
            .secret_via_proxy(
                "GH",
                "GITHUB_TOKEN",
                ["api.github.com", "a.example.com:443"],
            )
            .build()
            .unwrap();
        match &ok.secrets[0].exposure {
            SecretExposure::Proxy { var, hosts, .. } => {
                assert_eq!(var, "GITHUB_TOKEN");
                assert_eq!(hosts.len(), 2);
            }
            other => panic!("{other:?}"),
        }
        // Round trip through JSON, as the CLI and a server carry specs.
        let json = serde_json::to_string(&ok).unwrap();
        assert!(json.contains(r#""kind":"proxy""#), "{json}");
        assert_eq!(serde_json::from_str::<SandboxSpec>(&json).unwrap(), ok);
        let err = |b: SpecBuilder| match b.build() {
            Err(Error::InvalidSpec { field, reason }) => {
                assert_eq!(field, "secrets");
                reason
            }
            other => panic!("{other:?}"),
        };
        // Deny-all allows no host; a host outside the allowlist; a wildcard wider than it.
        let r = err(SandboxSpec::builder(Language::Shell).secret_via_proxy("GH", "T", ["x.com"]));
        assert!(r.contains("does not allow"), "{r}");
        let allow = || NetworkPolicy::allow_hosts(["api.github.com", "*.example.com"]).unwrap();
        let r = err(SandboxSpec::builder(Language::Shell)
            .network(allow())
            .secret_via_proxy("GH", "T", ["github.com"]));
        assert!(r.contains("github.com"), "{r}");
        err(SandboxSpec::builder(Language::Shell)
            .network(allow())
            .secret_via_proxy("GH", "T", ["*.github.com"]));
        err(SandboxSpec::builder(Language::Shell)
            .network(allow())
            .secret_via_proxy("GH", "T", Vec::<String>::new()));
        err(SandboxSpec::builder(Language::Shell)
            .network(allow())
            .secret_via_proxy("GH", "NOT A VAR", ["api.github.com"]));
        err(SandboxSpec::builder(Language::Shell)
            .network(allow())
            .secret_via_proxy("GH", "T", ["bad host!"]));
        // The internet policy allows any name its deny list does not name.
        SandboxSpec::builder(Language::Shell)
            .network(NetworkPolicy::AllowInternet {
                deny: vec![],
                private: vec![],
            })
            .secret_via_proxy("GH", "T", ["api.github.com"])
            .build()
            .unwrap();
    }

    #[test]
    fn image_is_parsed_by_the_builder_and_exclusive_with_rootfs() {
        let spec = SandboxSpec::builder(Language::Python)
            .image("python:3.12-slim")
            .build();
        assert_eq!(
            spec.ok().and_then(|s| s.image).map(|r| r.to_string()),
            Some("docker.io/library/python:3.12-slim".into())
        );
        let field = |r: Result<SandboxSpec>| match r {
            Err(Error::InvalidSpec { field, reason }) => format!("{field}: {reason}"),
            other => format!("{other:?}"),
        };
        let bad = SandboxSpec::builder(Language::Python)
            .image("Bad Ref")
            .build();
        assert!(field(bad).starts_with("image: `Bad Ref`"));
        let dir = std::env::temp_dir();
        let both = SandboxSpec::builder(Language::Python)
            .image("alpine")
            .rootfs(&dir)
            .build();
        assert!(field(both).contains("exclusive"));
        let missing = SandboxSpec::builder(Language::Shell)
            .image("oci:/nonexistent/layout")
            .build()
            .and_then(|s| s.validate_on_host().map(|()| s));
        assert!(field(missing).contains("OCI image layout"));
        // A spec without an image serialises as before; with one, as its reference string.
        let plain = serde_json::to_value(SandboxSpec::new(Language::Shell)).ok();
        assert!(plain.is_some_and(|v| v.get("image").is_none()));
        let json = r#"{"language":"shell","image":"ghcr.io/o/i:1"}"#;
        let s: Option<SandboxSpec> = serde_json::from_str(json).ok();
        assert_eq!(
            s.and_then(|s| s.image).map(|r| r.to_string()),
            Some("ghcr.io/o/i:1".into())
        );
    }

    #[test]
    fn tmpfs_caps_of_the_default_limits() {
        // 512 MiB of memory: 320 MiB of data, 65,536 inodes; each scratch mount an eighth.
        let c = Limits::default().tmpfs_caps(2, 1);
        assert_eq!(
            c.scratch,
            TmpfsCap {
                bytes: 40 << 20,
                inodes: 8192
            }
        );
        assert_eq!(
            c.disk,
            TmpfsCap {
                bytes: 240 << 20,
                inodes: 49_152
            }
        );
        // A small disk is what it asks for.
        let l = Limits {
            disk_bytes: 100 << 20,
            ..Limits::default()
        };
        let c = l.tmpfs_caps(2, 1);
        assert_eq!((c.disk.bytes, c.scratch.bytes), (100 << 20, 25 << 20));
    }

    #[test]
    fn tmpfs_caps_never_fill_the_memory_limit() {
        for mem_mib in [4u64, 16, 64, 100, 512, 4096, 65_536] {
            for disk_mib in [1u64, 10, 256, 1024, 1 << 20] {
                for (scratch, disk) in [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2)] {
                    let l = Limits {
                        memory_bytes: mem_mib << 20,
                        disk_bytes: disk_mib << 20,
                        ..Limits::default()
                    };
                    let c = l.tmpfs_caps(scratch, disk);
                    let bytes = scratch * c.scratch.bytes + disk * c.disk.bytes;
                    let inodes = scratch * c.scratch.inodes + disk * c.disk.inodes;
                    let worst = bytes + inodes * Limits::TMPFS_INODE_BYTES;
                    // At most 3/4 of the limit, but for the floors (1 MiB and 256 inodes a
                    // mount) that the smallest limits reach.
                    let floors = (scratch + disk) * ((1 << 20) + 256 * Limits::TMPFS_INODE_BYTES);
                    assert!(
                        worst <= (l.memory_bytes / 4 * 3).max(floors),
                        "{mem_mib} MiB / {disk_mib} MiB / {scratch}+{disk}: {c:?}"
                    );
                    assert!(c.disk.bytes <= l.disk_bytes.max(1 << 20));
                    assert!(c.scratch.bytes >= 1 << 20 && c.scratch.inodes >= 256);
                }
            }
        }
    }

    #[test]
    fn defaults_deny_everything() {
        let s = SandboxSpec::new(Language::Python);
        assert_eq!(s.network, NetworkPolicy::DenyAll);
        assert!(s.env.is_empty() && s.pass_env.is_empty() && s.mounts.is_empty());
        assert_eq!(s.workspace, Workspace::Empty);
        s.validate().unwrap();
        // no host variable leaks into the base env
        assert!(s.base_env().is_empty());
    }

    #[test]
    fn pass_env_only_named() {
        let s = SandboxSpec::builder(Language::Shell)
            .pass_env("PATH")
            .build()
            .unwrap();
        let env = s.base_env();
        assert_eq!(env.len(), usize::from(std::env::var("PATH").is_ok()));
    }

    #[test]
    fn bad_specs_name_the_field() {
        let cases: Vec<(SandboxSpec, &str)> = vec![
            (
                SandboxSpec::builder(Language::C).memory_mib(1).spec,
                "limits.memory_bytes",
            ),
            (
                SandboxSpec::builder(Language::C).env("1BAD", "x").spec,
                "env",
            ),
            (
                SandboxSpec::builder(Language::C).env("A", "x\0y").spec,
                "env",
            ),
            (
                SandboxSpec::builder(Language::C)
                    .mount_ro("/", "relative")
                    .spec,
                "mounts",
            ),
            (
                SandboxSpec::builder(Language::C)
                    .mount_ro("/", "/a/../etc")
                    .spec,
                "mounts",
            ),
            (
                SandboxSpec::builder(Language::C)
                    .mount_ro("/nonexistent-xyz", "/x")
                    .spec,
                "mounts",
            ),
            (
                SandboxSpec::builder(Language::C)
                    .workspace_dir("/nonexistent-xyz", false)
                    .spec,
                "workspace",
            ),
            (
                SandboxSpec::builder(Language::C).output_bytes(0).spec,
                "limits.output_bytes",
            ),
            (
                SandboxSpec::builder(Language::C)
                    .secret_env("K", "bad var")
                    .spec,
                "secrets",
            ),
        ];
        for (spec, field) in cases {
            match spec.validate_on_host() {
                Err(Error::InvalidSpec { field: f, .. }) => assert_eq!(f, field),
                other => panic!("expected InvalidSpec({field}), got {other:?}"),
            }
        }
    }

    #[test]
    fn a_spec_is_valid_without_the_host_paths_it_names() {
        // Built on a client, created on a server: only the server has the paths.
        let spec = SandboxSpec::builder(Language::C)
            .mount_ro("/nonexistent-xyz", "/x")
            .workspace_dir("/nonexistent-xyz", false)
            .rootfs("/nonexistent-xyz")
            .build()
            .unwrap();
        assert!(spec.validate().is_ok());
        match spec.validate_on_host() {
            Err(Error::InvalidSpec { field, .. }) => assert_eq!(field, "rootfs"),
            other => panic!("expected the host check to refuse it, got {other:?}"),
        }
    }

    #[test]
    fn every_limit_has_a_setter() {
        let s = SandboxSpec::builder(Language::Shell)
            .memory_bytes(64 << 20)
            .cpu_time(Duration::from_secs(5))
            .wall_time(Duration::from_secs(2))
            .lifetime(Duration::from_secs(60))
            .pids(32)
            .output_bytes(4096)
            .disk_bytes(8 << 20)
            .open_files(64)
            .fuel(Some(1_000_000))
            .cpu_millis(250)
            .build()
            .unwrap();
        let l = &s.limits;
        assert_eq!(
            (l.memory_bytes, l.cpu_time_ms, l.wall_time_ms, l.lifetime_ms),
            (64 << 20, 5000, 2000, 60_000)
        );
        assert_eq!((l.pids, l.output_bytes, l.disk_bytes), (32, 4096, 8 << 20));
        assert_eq!(
            (l.open_files, l.fuel, l.cpu_millis),
            (64, Some(1_000_000), 250)
        );
        // Each setter's impossible value is refused by `build`, naming its field.
        let b = || SandboxSpec::builder(Language::Shell);
        let bad = [
            (b().memory_bytes(1), LimitKind::Memory),
            (b().cpu_time(Duration::ZERO), LimitKind::CpuTime),
            (b().wall_time(Duration::ZERO), LimitKind::WallTime),
            (b().lifetime(Duration::from_millis(1)), LimitKind::Lifetime),
            (b().pids(0), LimitKind::Pids),
            (b().output_bytes(0), LimitKind::Output),
            (b().open_files(1), LimitKind::OpenFiles),
            (b().fuel(Some(0)), LimitKind::Fuel),
            (b().cpu_millis(1), LimitKind::CpuShare),
        ];
        for (builder, kind) in bad {
            match builder.build() {
                Err(Error::InvalidSpec { field, .. }) => assert_eq!(field, kind.field()),
                other => panic!("{kind}: expected InvalidSpec, got {other:?}"),
            }
        }
    }

    #[test]
    fn limit_kinds_display_their_json_names() {
        for k in LimitKind::ALL {
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
        }
        assert_eq!(LimitKind::OpenFiles.to_string(), "open-files");
    }

    #[test]
    fn serde_round_trip_and_unknown_fields_refused() {
        let s = SandboxSpec::builder(Language::Python)
            .env("A", "1")
            .secret_env("TOKEN", "API_TOKEN")
            .memory_mib(256)
            .build()
            .unwrap();
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<SandboxSpec>(&j).unwrap(), s);
        let minimal: SandboxSpec = serde_json::from_str(r#"{"language":"python"}"#).unwrap();
        assert_eq!(minimal, SandboxSpec::new(Language::Python));
        assert!(
            serde_json::from_str::<SandboxSpec>(r#"{"language":"python","netwrk":{}}"#).is_err()
        );
    }
}
