//! The [`SpecBuilder`]: a [`SandboxSpec`] set one field at a time and validated once, by
//! [`SpecBuilder::build`].

use super::*;

impl SandboxSpec {
    /// Starts a builder.
    pub fn builder(language: Language) -> SpecBuilder {
        SpecBuilder {
            spec: SandboxSpec::new(language),
            image_error: None,
            secret_error: None,
        }
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
    pub(super) spec: SandboxSpec,
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

    /// Shows the workspace at `/home/NAME` too (see [`SandboxSpec::workspace_alias`]).
    /// Default: `/workspace` only.
    ///
    /// # Errors
    /// [`build`](Self::build) fails with [`Error::InvalidSpec`] (`workspace_alias`) when
    /// `path` is not one directory under `/home`; creating the sandbox fails with
    /// [`Error::Unsupported`] on a tier without
    /// [`Capabilities::workspace_alias`](crate::Capabilities::workspace_alias).
    pub fn workspace_alias(mut self, path: impl Into<String>) -> Self {
        self.spec.workspace_alias = Some(path.into());
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
