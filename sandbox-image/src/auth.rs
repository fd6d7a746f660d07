//! Registry credentials: given through the API, or read from Docker's `config.json`
//! (`$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`), as `docker login` writes it.
//!
//! Only inline `auths` entries are read; credential helpers (`credsStore`, `credHelpers`)
//! are not run (they are programs: running one is the user's call, not a library's).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::Deserialize;

/// A user name and password (or token) for one registry.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Credentials {
    /// User name.
    pub username: String,
    /// Password or access token.
    pub password: String,
}

impl Credentials {
    /// `username`'s credentials: its password or access token.
    pub fn new(username: impl Into<String>, password: impl Into<String>) -> Self {
        Credentials {
            username: username.into(),
            password: password.into(),
        }
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

#[derive(Deserialize, Default)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Deserialize, Default)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// Where Docker keeps its config: `$DOCKER_CONFIG/config.json`, else
/// `$HOME/.docker/config.json`.
pub fn docker_config_path() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DOCKER_CONFIG") {
        return Some(Path::new(&dir).join("config.json"));
    }
    std::env::var_os("HOME").map(|h| Path::new(&h).join(".docker/config.json"))
}

/// The keys Docker may have stored `registry`'s entry under.
fn keys_for(registry: &str) -> Vec<String> {
    let mut v = vec![
        registry.to_owned(),
        format!("https://{registry}"),
        format!("http://{registry}"),
        format!("https://{registry}/v1/"),
        format!("https://{registry}/v2/"),
    ];
    if registry == "docker.io"
        || registry == "index.docker.io"
        || registry == "registry-1.docker.io"
    {
        v.push("https://index.docker.io/v1/".into());
        v.push("index.docker.io".into());
        v.push("docker.io".into());
    }
    v
}

/// The credentials for `registry` in the Docker config file at `path`, if any.
pub fn from_docker_config(path: &Path, registry: &str) -> Option<Credentials> {
    let bytes = std::fs::read(path).ok()?;
    let cfg: DockerConfig = match serde_json::from_slice(&bytes) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(path = %path.display(), "ignoring an unreadable Docker config: {e}");
            return None;
        }
    };
    let entry = keys_for(registry).iter().find_map(|k| cfg.auths.get(k))?;
    if let (Some(u), Some(p)) = (&entry.username, &entry.password) {
        return Some(Credentials {
            username: u.clone(),
            password: p.clone(),
        });
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(entry.auth.as_deref()?.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (u, p) = text.split_once(':')?;
    Some(Credentials {
        username: u.to_owned(),
        password: p.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_login_entries_are_found_by_registry() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("config.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret");
        let json = format!(
            r#"{{"auths":{{"127.0.0.1:5000":{{"auth":"{auth}"}},
            "https://index.docker.io/v1/":{{"username":"bob","password":"pw"}}}},"credsStore":"desktop"}}"#
        );
        assert!(std::fs::write(&path, json).is_ok());
        let c = from_docker_config(&path, "127.0.0.1:5000");
        assert_eq!(c.as_ref().map(|c| c.username.as_str()), Some("alice"));
        assert_eq!(c.as_ref().map(|c| c.password.as_str()), Some("s3cret"));
        assert_eq!(
            from_docker_config(&path, "docker.io").map(|c| c.username),
            Some("bob".into())
        );
        assert!(from_docker_config(&path, "ghcr.io").is_none());
        assert!(!format!("{c:?}").contains("s3cret"));
    }
}
