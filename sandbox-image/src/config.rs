//! The parts of an image's config (`application/vnd.oci.image.config.v1+json`, or Docker's
//! `container.image.v1+json`) a sandbox honours, and the layer list it pins.

use serde::{Deserialize, Serialize};

use crate::error::{ImageError, Result};

/// What an image says about how to run it: applied by the tiers under the spec (the spec's
/// `env` wins over the image's `Env`; the host's environment never enters).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ImageConfig {
    /// `Env`, in order, as `(name, value)`.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// `WorkingDir`: the default working directory of commands (else `/workspace`).
    #[serde(default)]
    pub working_dir: Option<String>,
    /// `User` as written (`uid`, `uid:gid`, `name`, `name:group`); none means root.
    #[serde(default)]
    pub user: Option<String>,
    /// `Entrypoint`: prefixed to the command when the caller gives none.
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// `Cmd`: the command when the caller gives none.
    #[serde(default)]
    pub cmd: Vec<String>,
    /// `architecture` (`amd64`, ...).
    #[serde(default)]
    pub architecture: String,
    /// `os` (`linux`).
    #[serde(default)]
    pub os: String,
}

impl ImageConfig {
    /// The value of `PATH` in the image's `Env`, if it sets one.
    pub fn path(&self) -> Option<&str> {
        self.env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.as_str())
    }

    /// The environment of a command: the image's `Env`, then `over` (the spec's own
    /// variables), which wins where both set one.
    pub fn environment(
        &self,
        over: impl IntoIterator<Item = (String, String)>,
    ) -> std::collections::BTreeMap<String, String> {
        let mut env: std::collections::BTreeMap<String, String> =
            self.env.iter().cloned().collect();
        env.extend(over);
        env
    }

    /// `WorkingDir` when it is an absolute path: the working directory of commands that name
    /// none.
    pub fn default_cwd(&self) -> Option<&str> {
        self.working_dir.as_deref().filter(|w| w.starts_with('/'))
    }

    /// The command the image runs when the caller names none: `Entrypoint` + `Cmd`.
    pub fn default_command(&self) -> Vec<String> {
        self.entrypoint
            .iter()
            .chain(self.cmd.iter())
            .cloned()
            .collect()
    }
}

#[derive(Deserialize)]
struct Raw {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
    #[serde(default)]
    config: Option<RawRun>,
    rootfs: RawRootfs,
}

#[derive(Deserialize, Default)]
struct RawRun {
    #[serde(rename = "Env", default)]
    env: Option<Vec<String>>,
    #[serde(rename = "Entrypoint", default)]
    entrypoint: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    cmd: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    working_dir: Option<String>,
    #[serde(rename = "User", default)]
    user: Option<String>,
}

#[derive(Deserialize)]
struct RawRootfs {
    #[serde(rename = "type")]
    kind: String,
    diff_ids: Vec<String>,
}

/// Parses a config blob: the runtime settings and the layers' diff-ids (digests of the
/// uncompressed layer tars, lowest first).
///
/// # Errors
/// [`ImageError::Malformed`] for JSON that is not an image config, [`ImageError::Unsupported`]
/// for an image that is not `linux/amd64` or whose rootfs is not `layers`.
pub(crate) fn parse(bytes: &[u8], source: &str) -> Result<(ImageConfig, Vec<String>)> {
    let raw: Raw = serde_json::from_slice(bytes)
        .map_err(|e| ImageError::malformed(source, format!("image config: {e}")))?;
    if raw.rootfs.kind != "layers" {
        return Err(ImageError::Unsupported(format!(
            "rootfs type `{}` (only `layers`)",
            raw.rootfs.kind
        )));
    }
    if !raw.os.is_empty() && raw.os != "linux" {
        return Err(ImageError::Unsupported(format!(
            "an image for os `{}` (sandboxes run linux/amd64 images)",
            raw.os
        )));
    }
    if !raw.architecture.is_empty() && raw.architecture != "amd64" {
        return Err(ImageError::Unsupported(format!(
            "an image for architecture `{}` (sandboxes run linux/amd64 images)",
            raw.architecture
        )));
    }
    for d in &raw.rootfs.diff_ids {
        crate::digest::sha256_hex(d)?;
    }
    let run = raw.config.unwrap_or_default();
    let env = run
        .env
        .unwrap_or_default()
        .into_iter()
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.to_owned(), v.to_owned()))
        })
        .collect();
    Ok((
        ImageConfig {
            env,
            working_dir: run.working_dir.filter(|w| !w.is_empty()),
            user: run.user.filter(|u| !u.is_empty()),
            entrypoint: run.entrypoint.unwrap_or_default(),
            cmd: run.cmd.unwrap_or_default(),
            architecture: raw.architecture,
            os: raw.os,
        },
        raw.rootfs.diff_ids,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn a_docker_style_config_is_read() {
        let json = format!(
            r#"{{"architecture":"amd64","os":"linux","config":{{"Env":["PATH=/usr/local/bin:/usr/bin","LANG=C.UTF-8"],
            "Cmd":["python3"],"WorkingDir":"/app","User":"1000:1000"}},"rootfs":{{"type":"layers","diff_ids":["{D}"]}}}}"#
        );
        let (c, ids) = parse(json.as_bytes(), "t").unwrap_or_default();
        assert_eq!(ids, vec![D.to_owned()]);
        assert_eq!(c.path(), Some("/usr/local/bin:/usr/bin"));
        assert_eq!(c.working_dir.as_deref(), Some("/app"));
        assert_eq!(c.user.as_deref(), Some("1000:1000"));
        assert_eq!(c.default_command(), vec!["python3".to_owned()]);
        assert_eq!(c.default_cwd(), Some("/app"));
        // The spec's variables win over the image's; the rest of the image's stay.
        let env = c.environment([("LANG".to_owned(), "spec".to_owned())]);
        assert_eq!(env.get("LANG").map(String::as_str), Some("spec"));
        assert_eq!(
            env.get("PATH").map(String::as_str),
            Some("/usr/local/bin:/usr/bin")
        );
        let relative = ImageConfig {
            working_dir: Some("app".into()),
            ..ImageConfig::default()
        };
        assert_eq!(relative.default_cwd(), None);
    }

    #[test]
    fn foreign_platforms_and_bad_digests_are_refused() {
        let arm =
            r#"{"architecture":"arm64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
        assert!(matches!(
            parse(arm.as_bytes(), "t"),
            Err(ImageError::Unsupported(m)) if m.contains("arm64")
        ));
        let bad = r#"{"rootfs":{"type":"layers","diff_ids":["sha256:../../x"]}}"#;
        assert!(parse(bad.as_bytes(), "t").is_err());
        assert!(matches!(
            parse(b"[]", "t"),
            Err(ImageError::Malformed { .. })
        ));
    }
}
