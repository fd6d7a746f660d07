//! The bodies of the v1 API: what clients send and get back. Requests refuse unknown fields
//! (a misspelt option is an error, not silently ignored); answers may gain fields.

use std::collections::BTreeMap;

use sandbox_core::{Command, ExecRequest, SandboxSpec, Tier};
use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// The sandbox's spec, as the library takes it (`SandboxSpec`'s JSON form).
    pub spec: SandboxSpec,
    /// Exactly this tier; absent: the selector's choice for the spec's language.
    #[serde(default)]
    pub tier: Option<Tier>,
    /// Labels to find it by (`GET /v1/sandboxes?label=k=v`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxInfo {
    /// Its id (the path segment of every call on it).
    pub id: String,
    /// The tier it runs on.
    pub tier: Tier,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// When it was created (RFC 3339, UTC).
    pub created_at: String,
}

/// `GET /v1/sandboxes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxList {
    /// The sandboxes, oldest first.
    pub sandboxes: Vec<SandboxInfo>,
}

/// `POST /v1/sandboxes/{id}/exec` (and `/exec/stream`): exactly one of `argv` and `code`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    /// A program and its arguments.
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    /// Code in the sandbox's language.
    #[serde(default)]
    pub code: Option<String>,
    /// Text fed to standard input.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Extra environment for this call.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory (default: the workspace, or the image's).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Wall timeout in milliseconds (capped by the spec's).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

impl ExecBody {
    /// The library's request.
    pub fn into_request(self) -> Result<ExecRequest, ApiError> {
        let mut req = match (self.argv, self.code) {
            (Some(a), None) => ExecRequest::argv(a),
            (None, Some(c)) => ExecRequest::code(c),
            _ => {
                return Err(ApiError::bad_request(
                    "give exactly one of `argv` (a program and its arguments) and `code`",
                ))
            }
        };
        if let Some(s) = self.stdin {
            req = req.stdin(s.into_bytes());
        }
        for (k, v) in self.env {
            req = req.env(k, v);
        }
        if let Some(c) = self.cwd {
            req = req.cwd(c);
        }
        if let Some(ms) = self.timeout_ms {
            req = req.timeout(std::time::Duration::from_millis(ms));
        }
        Ok(req)
    }

    /// A request for `cmd`, for clients.
    pub fn from_command(cmd: &Command) -> Self {
        match cmd {
            Command::Argv(a) => ExecBody {
                argv: Some(a.clone()),
                ..Self::default()
            },
            Command::Code(c) => ExecBody {
                code: Some(c.clone()),
                ..Self::default()
            },
            _ => ExecBody::default(),
        }
    }
}

/// `GET /v1/sandboxes/{id}/list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listing {
    /// The directory's entries.
    pub entries: Vec<sandbox_core::DirEntry>,
}
