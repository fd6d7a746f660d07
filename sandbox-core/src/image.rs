//! Image references: which OCI image a sandbox starts from ([`SandboxSpec::image`]).
//!
//! A reference is written the way users write them for Docker, plus two offline sources
//! named as `skopeo` names them:
//!
//! | written                                  | means                                          |
//! |------------------------------------------|------------------------------------------------|
//! | `python:3.12-slim`                       | `docker.io/library/python:3.12-slim`           |
//! | `ghcr.io/org/img:tag`                    | that registry, repository and tag              |
//! | `127.0.0.1:5000/repo` (no tag)           | tag `latest`                                   |
//! | `name@sha256:<64 hex>`                   | exactly that manifest (a tag may precede `@`)  |
//! | `oci:/path/to/layout[:tag]`              | an OCI image-layout directory                  |
//! | `docker-archive:/path/to/image.tar`      | a `docker save` tarball                        |
//!
//! This module only parses and normalises; pulling, verifying, caching and unpacking are the
//! `sandbox-image` crate's job.
//!
//! [`SandboxSpec::image`]: crate::SandboxSpec::image

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The registry a reference without one means (Docker Hub's canonical name).
pub const DEFAULT_REGISTRY: &str = "docker.io";

/// A parsed, normalised image reference. Serialises as its [`Display`](fmt::Display) form.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ImageRef {
    /// An image in an OCI distribution registry.
    Registry {
        /// Host and optional port, e.g. `docker.io`, `ghcr.io`, `127.0.0.1:5000`.
        registry: String,
        /// Repository path, e.g. `library/python`.
        repository: String,
        /// Tag; `latest` when neither a tag nor a digest was written.
        tag: Option<String>,
        /// Manifest digest (`sha256:<hex>`); when present it decides, the tag is a label.
        digest: Option<String>,
    },
    /// An OCI image-layout directory (`oci-layout`, `index.json`, `blobs/`).
    OciLayout {
        /// The directory.
        path: PathBuf,
        /// Which image of the index (its `org.opencontainers.image.ref.name`); the only one
        /// when absent.
        tag: Option<String>,
    },
    /// A `docker save` tarball.
    DockerArchive {
        /// The tar file.
        path: PathBuf,
    },
}

impl ImageRef {
    /// Parses a reference as users write it (see the [module docs](self)).
    ///
    /// # Errors
    /// [`Error::InvalidSpec`] (`image`) saying which part is malformed.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = |why: String| Error::invalid("image", format!("`{s}`: {why}"));
        if s.is_empty() {
            return Err(bad("an image reference cannot be empty".into()));
        }
        if s.contains(char::is_whitespace) || s.contains('\0') {
            return Err(bad("an image reference cannot contain spaces".into()));
        }
        if let Some(rest) = s.strip_prefix("oci:") {
            // `oci:PATH[:TAG]`: the tag is after the last `:` when that follows the last `/`.
            let (path, tag) = match rest.rfind(':') {
                Some(i) if !rest[i..].contains('/') => (&rest[..i], Some(&rest[i + 1..])),
                _ => (rest, None),
            };
            if path.is_empty() {
                return Err(bad(
                    "`oci:` needs a directory, e.g. `oci:/images/app:v1`".into()
                ));
            }
            if let Some(t) = tag {
                check_tag(t).map_err(bad)?;
            }
            return Ok(ImageRef::OciLayout {
                path: PathBuf::from(path),
                tag: tag.map(str::to_owned),
            });
        }
        if let Some(path) = s.strip_prefix("docker-archive:") {
            if path.is_empty() {
                return Err(bad(
                    "`docker-archive:` needs a file, e.g. `docker-archive:/tmp/app.tar`".into(),
                ));
            }
            return Ok(ImageRef::DockerArchive {
                path: PathBuf::from(path),
            });
        }

        let (name, digest) = match s.split_once('@') {
            Some((n, d)) => {
                check_digest(d).map_err(bad)?;
                (n, Some(d.to_owned()))
            }
            None => (s, None),
        };
        let (name, tag) = match name.rfind(':') {
            Some(i) if !name[i..].contains('/') => (&name[..i], Some(&name[i + 1..])),
            _ => (name, None),
        };
        if let Some(t) = tag {
            check_tag(t).map_err(bad)?;
        }
        let (registry, repository) = match name.split_once('/') {
            Some((first, rest))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (first.to_owned(), rest.to_owned())
            }
            Some(_) => (DEFAULT_REGISTRY.to_owned(), name.to_owned()),
            None => (DEFAULT_REGISTRY.to_owned(), format!("library/{name}")),
        };
        check_registry(&registry).map_err(bad)?;
        check_repository(&repository).map_err(bad)?;
        let tag = match (tag, &digest) {
            (Some(t), _) => Some(t.to_owned()),
            (None, Some(_)) => None,
            (None, None) => Some("latest".to_owned()),
        };
        Ok(ImageRef::Registry {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// This reference pinned to the manifest `digest` it resolved to (a registry reference
    /// keeps its tag as a label); offline sources are returned as they are. Snapshots store
    /// pinned references, so a restore gets the very image the sandbox had.
    pub fn pinned(&self, digest: &str) -> ImageRef {
        match self {
            ImageRef::Registry {
                registry,
                repository,
                tag,
                ..
            } => ImageRef::Registry {
                registry: registry.clone(),
                repository: repository.clone(),
                tag: tag.clone(),
                digest: Some(digest.to_owned()),
            },
            other => other.clone(),
        }
    }

    /// Whether this image comes from a registry (so pulling it needs the network).
    pub fn is_registry(&self) -> bool {
        matches!(self, ImageRef::Registry { .. })
    }

    /// The registry's host when it is a loopback address (`localhost`, `127.0.0.0/8`, `[::1]`):
    /// like Docker, such registries may be reached over plain HTTP without being listed as
    /// insecure.
    pub fn is_loopback_registry(&self) -> bool {
        let ImageRef::Registry { registry, .. } = self else {
            return false;
        };
        let host = match registry.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or(""),
            None => registry.split(':').next().unwrap_or(""),
        };
        host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    }
}

fn check_digest(d: &str) -> std::result::Result<(), String> {
    match d.split_once(':') {
        Some(("sha256", hex))
            if hex.len() == 64
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
        {
            Ok(())
        }
        Some(("sha512", hex))
            if hex.len() == 128
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
        {
            Ok(())
        }
        _ => Err(format!(
            "digest `{d}` is not `sha256:` followed by 64 lowercase hex digits"
        )),
    }
}

fn check_tag(t: &str) -> std::result::Result<(), String> {
    let ok = !t.is_empty()
        && t.len() <= 128
        && !t.starts_with(['.', '-'])
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "tag `{t}` must be 1-128 of letters, digits, `_`, `.` and `-`, not starting with `.` or `-`"
        ))
    }
}

fn check_registry(r: &str) -> std::result::Result<(), String> {
    let ok = !r.is_empty()
        && r.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "registry `{r}` is not a host name with an optional port"
        ))
    }
}

fn check_repository(repo: &str) -> std::result::Result<(), String> {
    let component_ok = |c: &str| {
        !c.is_empty()
            && c.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
            })
            && c.as_bytes()
                .first()
                .is_some_and(|b| b.is_ascii_alphanumeric())
            && c.as_bytes()
                .last()
                .is_some_and(|b| b.is_ascii_alphanumeric())
    };
    if repo.len() <= 255 && repo.split('/').all(component_ok) {
        Ok(())
    } else {
        Err(format!(
            "repository `{repo}` must be lowercase letters, digits and `._-` separators, in `/`-separated parts"
        ))
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageRef::Registry {
                registry,
                repository,
                tag,
                digest,
            } => {
                write!(f, "{registry}/{repository}")?;
                if let Some(t) = tag {
                    write!(f, ":{t}")?;
                }
                if let Some(d) = digest {
                    write!(f, "@{d}")?;
                }
                Ok(())
            }
            ImageRef::OciLayout { path, tag } => {
                write!(f, "oci:{}", path.display())?;
                if let Some(t) = tag {
                    write!(f, ":{t}")?;
                }
                Ok(())
            }
            ImageRef::DockerArchive { path } => write!(f, "docker-archive:{}", path.display()),
        }
    }
}

impl FromStr for ImageRef {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        ImageRef::parse(s)
    }
}

impl Serialize for ImageRef {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ImageRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ImageRef::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(s: &str) -> (String, String, Option<String>, Option<String>) {
        match ImageRef::parse(s) {
            Ok(ImageRef::Registry {
                registry,
                repository,
                tag,
                digest,
            }) => (registry, repository, tag, digest),
            other => panic!("{s}: {other:?}"),
        }
    }

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn docker_hub_short_names_are_normalised() {
        assert_eq!(
            reg("python:3.12-slim"),
            (
                "docker.io".into(),
                "library/python".into(),
                Some("3.12-slim".into()),
                None
            )
        );
        assert_eq!(reg("alpine").2.as_deref(), Some("latest"));
        assert_eq!(reg("org/app:1").1, "org/app");
        assert_eq!(
            ImageRef::parse("python:3.12-slim")
                .map(|r| r.to_string())
                .ok(),
            Some("docker.io/library/python:3.12-slim".into())
        );
    }

    #[test]
    fn registries_ports_and_digests() {
        assert_eq!(reg("ghcr.io/org/img:tag").0, "ghcr.io");
        let (r, repo, tag, digest) = reg("127.0.0.1:5000/repo");
        assert_eq!((r.as_str(), repo.as_str()), ("127.0.0.1:5000", "repo"));
        assert_eq!(tag.as_deref(), Some("latest"));
        assert_eq!(digest, None);
        let (_, _, tag, digest) = reg(&format!("localhost/a/b@{D}"));
        assert_eq!((tag, digest.as_deref()), (None, Some(D)));
        let (_, _, tag, _) = reg(&format!("a:v1@{D}"));
        assert_eq!(tag.as_deref(), Some("v1"));
        for s in ["localhost:5000/x", "127.0.0.1:1/x", "[::1]:5000/x"] {
            assert!(
                ImageRef::parse(s).is_ok_and(|r| r.is_loopback_registry()),
                "{s}"
            );
        }
        assert!(ImageRef::parse("ghcr.io/x").is_ok_and(|r| !r.is_loopback_registry()));
        assert!(ImageRef::parse("python").is_ok_and(|r| !r.is_loopback_registry()));
    }

    #[test]
    fn offline_sources() {
        assert_eq!(
            ImageRef::parse("oci:/imgs/app:v1").ok(),
            Some(ImageRef::OciLayout {
                path: "/imgs/app".into(),
                tag: Some("v1".into())
            })
        );
        assert_eq!(
            ImageRef::parse("oci:/imgs/app").ok(),
            Some(ImageRef::OciLayout {
                path: "/imgs/app".into(),
                tag: None
            })
        );
        assert_eq!(
            ImageRef::parse("docker-archive:/tmp/a.tar").ok(),
            Some(ImageRef::DockerArchive {
                path: "/tmp/a.tar".into()
            })
        );
    }

    #[test]
    fn malformed_references_name_the_part() {
        for (s, part) in [
            ("", "empty"),
            ("Python:3", "repository"),
            ("a b", "spaces"),
            ("a:-x", "tag"),
            ("a@sha256:abc", "digest"),
            ("a/../b", "repository"),
            ("a//b", "repository"),
            ("oci:", "directory"),
            ("docker-archive:", "file"),
        ] {
            match ImageRef::parse(s) {
                Err(Error::InvalidSpec { field, reason }) => {
                    assert_eq!(field, "image");
                    assert!(reason.contains(part), "{s}: {reason}");
                }
                other => panic!("{s}: {other:?}"),
            }
        }
    }

    #[test]
    fn serde_round_trips_through_the_display_form() {
        for s in ["ghcr.io/o/i:t", "oci:/x:y", "docker-archive:/a.tar"] {
            let r = ImageRef::parse(s).ok();
            let json = serde_json::to_string(&r).unwrap_or_default();
            assert_eq!(json, format!("\"{s}\""));
            let back: Option<ImageRef> = serde_json::from_str(&json).ok();
            assert_eq!(back, r);
        }
        assert!(serde_json::from_str::<ImageRef>("\"UPPER\"").is_err());
    }
}
