//! The `PATH` search of `execvp`: a name with a `/` is used as it is, any other is looked
//! for in each directory of `PATH`, in order, an empty entry meaning the working directory.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Where to look for `prog`, in order: `prog` itself when it has a `/`, else `DIR/prog` for
/// each directory of `path` (trailing slashes dropped; an empty entry gives `prog` alone,
/// relative to the working directory). Nothing is checked on the file system.
pub fn candidates(prog: &str, path: &str) -> Vec<String> {
    if prog.contains('/') {
        return vec![prog.to_string()];
    }
    path.split(':')
        .map(|d| {
            if d.is_empty() {
                prog.to_string()
            } else {
                format!("{}/{prog}", d.trim_end_matches('/'))
            }
        })
        .collect()
}

/// The first of [`candidates`] that is an executable regular file, relative ones resolved
/// against `cwd`; `None` when there is none.
pub fn lookup(prog: &str, path: &str, cwd: &Path) -> Option<PathBuf> {
    candidates(prog, path)
        .into_iter()
        .map(|c| cwd.join(c))
        .find(|p| {
            std::fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn candidates_follow_execvp() {
        assert_eq!(candidates("./x", "/bin"), ["./x"]);
        assert_eq!(candidates("a/b", ""), ["a/b"]);
        assert_eq!(
            candidates("ls", "/a/::rel:/c//"),
            ["/a/ls", "ls", "rel/ls", "/c/ls"]
        );
        // An empty PATH is one empty entry: the working directory.
        assert_eq!(candidates("ls", ""), ["ls"]);
    }

    #[test]
    fn lookup_finds_executables_only() {
        let dir = std::env::temp_dir().join(format!("agent-proto-path-{}", std::process::id()));
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(a.join("tool"), b"").unwrap(); // not executable
        std::fs::write(b.join("tool"), b"").unwrap();
        std::fs::set_permissions(b.join("tool"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = format!("{}:{}", a.display(), b.display());
        assert_eq!(lookup("tool", &path, Path::new("/")), Some(b.join("tool")));
        assert_eq!(lookup("missing", &path, Path::new("/")), None);
        // Relative names and empty entries resolve against the working directory.
        assert_eq!(lookup("b/tool", "", &dir), Some(dir.join("b/tool")));
        assert_eq!(lookup("tool", ":/nowhere", &b), Some(b.join("tool")));
        // A directory is not an executable.
        assert_eq!(
            lookup("b", &dir.display().to_string(), Path::new("/")),
            None
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
