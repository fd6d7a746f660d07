//! Checking a spec: [`SandboxSpec::validate`] for what is possible anywhere, and
//! [`SandboxSpec::validate_on_host`] for what only the host creating the sandbox can see.

use super::*;

fn valid_env_name(k: &str) -> bool {
    !k.is_empty()
        && !k.as_bytes()[0].is_ascii_digit()
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

impl SandboxSpec {
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
        if let Some(alias) = &self.workspace_alias {
            check_alias(alias)?;
            if let Some(m) = self
                .mounts
                .iter()
                .find(|m| crate::path::paths_overlap(&m.target, alias))
            {
                return Err(Error::invalid(
                    "mounts",
                    format!(
                        "target `{}` overlaps the workspace alias `{alias}`",
                        m.target
                    ),
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
}

/// A workspace alias is `/home/NAME`: one directory under `/home`, NAME made of ASCII
/// letters, digits, `.`, `_` and `-` (not `.` or `..`), at most 64 bytes.
fn check_alias(alias: &str) -> Result<()> {
    let name = alias.strip_prefix("/home/").unwrap_or("");
    let ok = !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            "workspace_alias",
            format!("`{alias}` is not /home/NAME (NAME: letters, digits, `.`, `_`, `-`)"),
        ))
    }
}
