//! An image ready to use ([`Image`]): its unpacked layers and config, and what its userland
//! defines (users and groups, programs on its `PATH`).

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;

use nix::fcntl::Flock;

use crate::config::ImageConfig;
use crate::error::{ImageError, Result};

/// An image ready to use: its layers unpacked in the cache, lowest first. While a value (or
/// a clone) lives, `rm` and `prune` leave the image alone.
#[derive(Debug, Clone)]
pub struct Image {
    pub(super) reference: String,
    pub(super) digest: String,
    pub(super) config: ImageConfig,
    pub(super) layers: Vec<PathBuf>,
    pub(super) bytes: u64,
    /// The image's record, locked shared: `rm`/`prune` spare it while a clone lives.
    pub(crate) lease: Arc<Flock<fs::File>>,
}

impl Image {
    /// The reference it was asked for, normalised.
    pub fn reference(&self) -> &str {
        &self.reference
    }

    /// The manifest digest: the image's identity.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// Its config (env, working directory, user, entrypoint and command).
    pub fn config(&self) -> &ImageConfig {
        &self.config
    }

    /// The unpacked layer directories, lowest first. Read-only: they are shared by every
    /// sandbox of every image that has them (use them as overlay lower layers).
    pub fn layers(&self) -> &[PathBuf] {
        &self.layers
    }

    /// Bytes its unpacked layers take in the cache.
    pub fn unpacked_bytes(&self) -> u64 {
        self.bytes
    }

    /// The uid and gid its config's `User` means (`uid`, `uid:gid`, `name`, `name:group`),
    /// names looked up in the image's own `/etc/passwd` and `/etc/group`; `(0, 0)` when it
    /// names none. A numeric uid without a `passwd` entry gets gid 0, as runc does.
    ///
    /// # Errors
    /// [`ImageError::Unsupported`] naming a user or group the image does not define.
    pub fn user_ids(&self) -> Result<(u32, u32)> {
        let Some(user) = self.config.user.as_deref() else {
            return Ok((0, 0));
        };
        let (u, g) = match user.split_once(':') {
            Some((u, g)) => (u, Some(g)),
            None => (user, None),
        };
        let passwd = self.etc_file("passwd");
        // name:x:uid:gid:...
        let entry = passwd
            .lines()
            .map(|l| l.split(':').collect::<Vec<_>>())
            .find(|f| f.len() >= 4 && (f[0] == u || (u.parse::<u32>().is_ok() && f[2] == u)));
        let uid = match (u.parse::<u32>(), &entry) {
            (Ok(n), _) => n,
            (Err(_), Some(f)) => f[2].parse().unwrap_or(0),
            (Err(_), None) => {
                return Err(ImageError::Unsupported(format!(
                    "the image's user `{u}`, which its /etc/passwd does not define"
                )))
            }
        };
        let gid = match g {
            Some(g) => match g.parse::<u32>() {
                Ok(n) => n,
                Err(_) => self
                    .etc_file("group")
                    .lines()
                    .map(|l| l.split(':').collect::<Vec<_>>())
                    .find(|f| f.len() >= 3 && f[0] == g)
                    .and_then(|f| f[2].parse().ok())
                    .ok_or_else(|| {
                        ImageError::Unsupported(format!(
                            "the image's group `{g}`, which its /etc/group does not define"
                        ))
                    })?,
            },
            None => entry.and_then(|f| f[3].parse().ok()).unwrap_or(0),
        };
        Ok((uid, gid))
    }

    /// Where `program` is on the image's `PATH` (its config's, else the usual one), as the
    /// sandbox will see it: the topmost layer holding an entry at a `PATH` directory decides
    /// (a whiteout hides lower ones). `None`: the image has no such program, so code strings
    /// needing that interpreter cannot run (tiers say so before trying).
    pub fn find_program(&self, program: &str) -> Option<String> {
        let path = self
            .config
            .path()
            .unwrap_or("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        path.split(':')
            .filter(|d| d.starts_with('/'))
            .find_map(|dir| {
                let inside = format!("{}/{program}", dir.trim_end_matches('/'));
                let rel = inside.trim_start_matches('/');
                for layer in self.layers.iter().rev() {
                    if let Ok(m) = fs::symlink_metadata(layer.join(rel)) {
                        use std::os::unix::fs::FileTypeExt;
                        let whiteout = m.file_type().is_char_device() && m.len() == 0;
                        return (!whiteout).then(|| inside.clone());
                    }
                }
                None
            })
    }

    /// [`find_program`](Self::find_program), or an error naming the image, the program and
    /// the `PATH` searched.
    ///
    /// # Errors
    /// [`ImageError::MissingProgram`].
    pub fn require_program(&self, program: &str) -> Result<String> {
        self.find_program(program)
            .ok_or_else(|| ImageError::MissingProgram {
                image: self.reference.clone(),
                program: program.to_owned(),
                path: self.config.path().unwrap_or("the default PATH").to_owned(),
            })
    }

    /// The interpreter code strings in `language` run with in a Linux userland (`python3`,
    /// `node`, `sh` for shell and C), found on the image's `PATH` as
    /// [`require_program`](Self::require_program) finds it.
    ///
    /// # Errors
    /// [`ImageError::MissingProgram`].
    pub fn require_interpreter(&self, language: sandbox_core::Language) -> Result<String> {
        use sandbox_core::Language;
        self.require_program(match language {
            Language::Python => "python3",
            Language::Node | Language::Javascript => "node",
            _ => "sh",
        })
    }

    /// `/etc/NAME` as the image's topmost layer holding it has it (a regular file, never
    /// followed through a link); empty when none does.
    fn etc_file(&self, name: &str) -> String {
        for layer in self.layers.iter().rev() {
            let p = layer.join("etc").join(name);
            match fs::symlink_metadata(&p) {
                Ok(m) if m.is_file() && m.len() < (1 << 20) => {
                    return fs::read_to_string(&p).unwrap_or_default()
                }
                // A whiteout or anything else hides lower layers' copies.
                Ok(_) => return String::new(),
                Err(_) => {}
            }
        }
        String::new()
    }
}
