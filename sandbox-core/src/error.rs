//! The error type shared by every backend. Each variant says what went wrong and what to do.

use std::path::PathBuf;

use crate::probe::TierStatus;
use crate::tier::Tier;

/// A result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in agent-sandbox.
///
/// Errors about the *sandboxed code* (a non-zero exit, an exception, a hit limit) are not
/// errors: they are reported in [`ExecResult`](crate::ExecResult). These are failures of the
/// sandbox itself or of the caller's input.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The backend cannot do this operation at all. Nothing was done.
    #[error("{tier} tier does not support {what}; pick a tier whose capabilities() list it")]
    Unsupported {
        /// The operation or feature that is not supported.
        what: String,
        /// The tier that refused it.
        tier: Tier,
    },

    /// The spec (or a request) is invalid. Nothing was created.
    #[error("invalid {field}: {reason}")]
    InvalidSpec {
        /// The offending field, e.g. `limits.memory_bytes`.
        field: String,
        /// Why it is invalid and what is accepted.
        reason: String,
    },

    /// The tier's engine is not usable on this host.
    #[error("{tier} tier is unavailable: {reason}; fix: {fix}")]
    Unavailable {
        /// The tier.
        tier: Tier,
        /// Why it cannot run here.
        reason: String,
        /// How to make it available.
        fix: String,
    },

    /// No acceptable tier is available; each candidate says why and how to fix it.
    #[error("no acceptable tier is available on this host:{}", format_statuses(.statuses))]
    NoTierAvailable {
        /// Every considered tier, in ranking order, with its status.
        statuses: Vec<TierStatus>,
    },

    /// A path given to the file API leaves the sandbox's workspace.
    #[error("path `{path}` escapes the workspace: use a relative path (or one under /workspace) without `..` leaving it")]
    PathEscape {
        /// The path as given.
        path: String,
    },

    /// A file the caller asked for does not exist in the sandbox.
    #[error("no such file in the sandbox: {path}")]
    NotFound {
        /// The path as given.
        path: String,
    },

    /// The sandbox was destroyed (or died); create a new one.
    #[error("sandbox {id} is gone ({reason}); create or restore a new one")]
    SandboxGone {
        /// The sandbox id.
        id: String,
        /// Destroyed by the caller, killed, exceeded its lifetime...
        reason: String,
    },

    /// The sandbox is paused: commands cannot run until it is resumed. Nothing was done.
    #[error("sandbox {id} is paused: resume() it before running commands")]
    SandboxPaused {
        /// The sandbox id.
        id: String,
    },

    /// A snapshot could not be written or read.
    #[error("snapshot error: {0}")]
    Snapshot(#[from] crate::snapshot::SnapshotError),

    /// A secret named by the spec could not be resolved.
    #[error("secret `{name}` could not be resolved: {reason}")]
    Secret {
        /// The secret's name (never its value).
        name: String,
        /// Why.
        reason: String,
    },

    /// An I/O failure on the host side.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// A wait ran out of time; what was waited for goes on (wait again, or stop it).
    #[error("{what} timed out after {after:?}; it goes on: wait again or signal it")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The bound that passed.
        after: std::time::Duration,
    },

    /// A background process has exited (or its stdin was closed): it cannot take input or
    /// signals any more. Its exit status is in [`Process::wait`](crate::Process::wait).
    #[error("process {id} has exited (or its stdin is closed); start a new one")]
    ProcessExited {
        /// The process's id in its sandbox.
        id: u64,
    },

    /// A host resource is exhausted (disk full, too many sandboxes...).
    #[error("host resource exhausted: {what}; free some or lower the limits")]
    ResourceExhausted {
        /// What ran out.
        what: String,
    },

    /// The backend's engine failed in a way not covered above.
    ///
    /// Like [`Error::Io`], its message includes the cause's text, so printing the error
    /// alone says everything; the cause itself is kept as the [`source`](std::error::Error::source)
    /// for code that needs its type (downcast it, e.g. to an `io::Error` for its errno).
    #[error("{tier} backend failed: {message}{}", cause_suffix(.source.as_deref()))]
    Backend {
        /// The tier.
        tier: Tier,
        /// What happened (or what was being done, when `source` says what failed), with the
        /// fix when known.
        message: String,
        /// The underlying error, when there is one.
        #[source]
        source: Option<BoxError>,
    },
}

/// A boxed error that can cross threads: the cause kept by [`Error::Backend`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The cause's text after the message. The alternate form, so that a cause that carries its
/// own chain (an `anyhow`/`wasmtime` error) prints all of it; the same text for the others.
fn cause_suffix(source: Option<&(dyn std::error::Error + Send + Sync + 'static)>) -> String {
    source.map(|s| format!(": {s:#}")).unwrap_or_default()
}

impl Error {
    /// Builds [`Error::Unsupported`].
    pub fn unsupported(tier: Tier, what: impl Into<String>) -> Self {
        Error::Unsupported {
            what: what.into(),
            tier,
        }
    }

    /// Builds [`Error::InvalidSpec`].
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidSpec {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// Builds [`Error::Io`] with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Builds [`Error::Io`] for an operation on a path.
    pub fn io_path(op: &str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            context: format!("{op} {}", path.into().display()),
            source,
        }
    }

    /// Builds [`Error::Backend`] without an underlying error.
    pub fn backend(tier: Tier, message: impl Into<String>) -> Self {
        Error::Backend {
            tier,
            message: message.into(),
            source: None,
        }
    }

    /// Builds [`Error::Backend`] from what was being done and the error that stopped it.
    pub fn backend_caused(
        tier: Tier,
        doing: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Error::Backend {
            tier,
            message: doing.into(),
            source: Some(source.into()),
        }
    }
}

fn format_statuses(statuses: &[TierStatus]) -> String {
    let mut out = String::new();
    for s in statuses {
        out.push_str("\n  - ");
        out.push_str(s.tier.name());
        out.push_str(": ");
        out.push_str(&s.reason);
        if let Some(fix) = &s.fix {
            out.push_str(" (fix: ");
            out.push_str(fix);
            out.push(')');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn backend_errors_keep_their_cause() {
        let e = Error::backend_caused(
            Tier::Microvm,
            "mapping guest memory",
            std::io::Error::from_raw_os_error(ENOMEM),
        );
        let text = e.to_string();
        assert!(
            text.starts_with("microvm backend failed: mapping guest memory: "),
            "{text}"
        );
        let cause = e.source().and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(cause.and_then(|c| c.raw_os_error()), Some(ENOMEM));
        let plain = Error::backend(Tier::Wasm, "engine broke");
        assert_eq!(plain.to_string(), "wasm backend failed: engine broke");
        assert!(plain.source().is_none());
    }

    /// `ENOMEM` on Linux.
    const ENOMEM: i32 = 12;
}
