//! Paths in the file API: relative to `/workspace`, never leaving it.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The mount point of the workspace inside every sandbox.
pub const WORKSPACE_MOUNT: &str = "/workspace";

/// A path inside the workspace, lexically normalized (no `.`, no `..`, no leading `/`).
///
/// Accepts `a/b`, `./a/../b`, `/workspace/a`; refuses `../x`, `/etc/passwd`,
/// `/workspace/../x` and NUL bytes with [`Error::PathEscape`] (or `InvalidSpec` for NUL).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkspacePath(Vec<String>);

impl WorkspacePath {
    /// Parses and normalizes a caller-supplied path.
    pub fn parse(path: &str) -> Result<Self> {
        if path.contains('\0') {
            return Err(Error::invalid("path", "paths cannot contain NUL"));
        }
        let escape = || Error::PathEscape {
            path: path.to_string(),
        };
        let rel = if let Some(rest) = path.strip_prefix(WORKSPACE_MOUNT) {
            if !(rest.is_empty() || rest.starts_with('/')) {
                return Err(escape());
            }
            rest
        } else if path.starts_with('/') {
            return Err(escape());
        } else {
            path
        };
        let mut parts: Vec<String> = Vec::new();
        for c in Path::new(rel).components() {
            match c {
                Component::Normal(s) => parts.push(s.to_string_lossy().into_owned()),
                Component::CurDir | Component::RootDir => {}
                Component::ParentDir => {
                    if parts.pop().is_none() {
                        return Err(escape());
                    }
                }
                Component::Prefix(_) => return Err(escape()),
            }
        }
        Ok(WorkspacePath(parts))
    }

    /// `true` for the workspace root itself.
    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    /// The normalized relative path (`""` for the root).
    pub fn relative(&self) -> PathBuf {
        self.0.iter().collect()
    }

    /// The absolute path inside the sandbox (`/workspace/...`).
    pub fn in_sandbox(&self) -> String {
        let mut s = String::from(WORKSPACE_MOUNT);
        for p in &self.0 {
            s.push('/');
            s.push_str(p);
        }
        s
    }

    /// Resolves against a host directory backing the workspace, refusing any existing
    /// symlink on the way that points outside `root`.
    ///
    /// Only a check at one instant: if code in a sandbox can change the tree, it can swap a
    /// name for a symlink between this check and the caller's open by path. Backends whose
    /// sandboxes can write the directory use [`crate::beneath`] instead (every lookup
    /// beneath a directory handle, `openat2(RESOLVE_BENEATH)`).
    pub fn resolve_under(&self, root: &Path) -> Result<PathBuf> {
        let root = root
            .canonicalize()
            .map_err(|e| Error::io_path("canonicalize", root, e))?;
        let full = root.join(self.relative());
        // Deepest existing ancestor (or the path itself) must stay under root.
        let mut probe = full.clone();
        loop {
            match probe.canonicalize() {
                Ok(real) => {
                    if !real.starts_with(&root) {
                        return Err(Error::PathEscape {
                            path: self.in_sandbox(),
                        });
                    }
                    break;
                }
                Err(_) => {
                    // A dangling symlink is refused: it may be made to point anywhere later.
                    if probe.symlink_metadata().is_ok() {
                        return Err(Error::PathEscape {
                            path: self.in_sandbox(),
                        });
                    }
                    if !probe.pop() {
                        break;
                    }
                }
            }
        }
        Ok(full)
    }
}

/// The kind of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum EntryKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link (not followed).
    Symlink,
    /// Anything else.
    Other,
}

/// One entry of [`Sandbox::list`](crate::Sandbox::list).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct DirEntry {
    /// File name.
    pub name: String,
    /// Kind.
    pub kind: EntryKind,
    /// Size in bytes (files).
    pub size: u64,
}

impl DirEntry {
    /// An entry named `name` of `kind` and `size` bytes.
    pub fn new(name: impl Into<String>, kind: EntryKind, size: u64) -> Self {
        DirEntry {
            name: name.into(),
            kind,
            size,
        }
    }
}

/// Whether absolute paths `a` and `b` (a trailing `/` ignored) name the same place or one
/// lies beneath the other: a mount at one would cover or be covered by the other.
pub fn paths_overlap(a: &str, b: &str) -> bool {
    let (a, b) = (a.trim_end_matches('/'), b.trim_end_matches('/'));
    a == b || a.starts_with(&format!("{b}/")) || b.starts_with(&format!("{a}/"))
}

/// Lists a host directory that backs (part of) a workspace, without following symlinks;
/// `shown` is the caller's path, used in errors. Entries are sorted by name.
pub fn list_host_dir(dir: &Path, shown: &str) -> Result<Vec<DirEntry>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::NotFound { path: shown.into() })
        }
        Err(e) => return Err(Error::io_path("list", dir, e)),
    };
    let mut out = Vec::new();
    for e in rd {
        let e = e.map_err(|e| Error::io_path("list", dir, e))?;
        let md = e
            .path()
            .symlink_metadata()
            .map_err(|err| Error::io_path("stat", e.path(), err))?;
        let ft = md.file_type();
        let kind = if ft.is_symlink() {
            EntryKind::Symlink
        } else if ft.is_dir() {
            EntryKind::Dir
        } else if ft.is_file() {
            EntryKind::File
        } else {
            EntryKind::Other
        };
        out.push(DirEntry {
            name: e.file_name().to_string_lossy().into_owned(),
            kind,
            size: md.len(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_overlap_when_one_holds_the_other() {
        assert!(paths_overlap("/home/user", "/home/user/"));
        assert!(paths_overlap("/home", "/home/user"));
        assert!(paths_overlap("/home/user/data", "/home/user"));
        assert!(paths_overlap("/", "/tmp"));
        assert!(!paths_overlap("/home/username", "/home/user"));
        assert!(!paths_overlap("/tmp", "/home/user"));
    }

    #[test]
    fn normalizes_and_refuses_escapes() {
        assert_eq!(
            WorkspacePath::parse("a/./b/../c").unwrap().relative(),
            PathBuf::from("a/c")
        );
        assert_eq!(
            WorkspacePath::parse("/workspace/x").unwrap().in_sandbox(),
            "/workspace/x"
        );
        assert!(WorkspacePath::parse("/workspace").unwrap().is_root());
        assert!(WorkspacePath::parse(".").unwrap().is_root());
        for bad in [
            "../x",
            "/etc/passwd",
            "/workspace/../x",
            "a/../../b",
            "/workspacex/a",
            "/",
        ] {
            assert!(
                matches!(WorkspacePath::parse(bad), Err(Error::PathEscape { .. })),
                "{bad} accepted"
            );
        }
        assert!(matches!(
            WorkspacePath::parse("a\0b"),
            Err(Error::InvalidSpec { .. })
        ));
    }

    #[cfg(unix)]
    #[test]
    fn symlinks_out_of_root_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "s").unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("out")).unwrap();
        std::os::unix::fs::symlink("/nonexistent/dangling", root.path().join("dangling")).unwrap();
        std::fs::create_dir(root.path().join("in")).unwrap();
        std::os::unix::fs::symlink(root.path().join("in"), root.path().join("alias")).unwrap();
        let r = |p: &str| WorkspacePath::parse(p).unwrap().resolve_under(root.path());
        assert!(matches!(r("out/secret"), Err(Error::PathEscape { .. })));
        assert!(matches!(r("out/new-file"), Err(Error::PathEscape { .. })));
        assert!(matches!(r("dangling"), Err(Error::PathEscape { .. })));
        assert!(r("alias/file").is_ok(), "a link that stays inside is fine");
        assert!(r("new/dir/file").is_ok());
    }
}
