//! envd's `/files`: a file's content down (`GET`), and up (`POST`: one file as
//! `application/octet-stream`, or several in one `multipart/form-data` body, each part's
//! file name its path). Paths in the workspace go through the library's file API (whole
//! files, up to the sandbox's disk limit); others through the in-sandbox helper of [`fs`]
//! (reads up to the sandbox's output limit).

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{FromRequest, Multipart, Query, Request};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::connect::{Code, RpcError};
use super::{api_error, fs, Envd};

/// An envd error as `/files` answers it: the status its code means, `{"code","message"}`.
fn http(e: RpcError) -> Response {
    let status = match e.code {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument => StatusCode::BAD_REQUEST,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::AlreadyExists => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::PAYLOAD_TOO_LARGE,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::FailedPrecondition => StatusCode::CONFLICT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    api_error(status, e.message)
}

/// The workspace-relative form of `path`, when it is in the workspace.
fn in_workspace(path: &str) -> Option<&str> {
    path.strip_prefix(sandbox_core::WORKSPACE_MOUNT)
        .and_then(|r| r.strip_prefix('/'))
        .filter(|r| !r.is_empty())
}

fn path_of(e: &Envd, q: &HashMap<String, String>) -> Result<String, RpcError> {
    let p = q
        .get("path")
        .ok_or_else(|| RpcError::invalid("no `path` query parameter"))?;
    super::resolve(&e.meta.home, p)
}

/// `GET /files?path=...`.
pub(crate) async fn read(e: Envd, Query(q): Query<HashMap<String, String>>) -> Response {
    match read_file(&e, &q).await {
        Ok(data) => ([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response(),
        Err(err) => http(err),
    }
}

async fn read_file(e: &Envd, q: &HashMap<String, String>) -> Result<Vec<u8>, RpcError> {
    let path = path_of(e, q)?;
    if let Some(rel) = in_workspace(&path) {
        match e.entry.sandbox.read_file(rel).await {
            Ok(d) => return Ok(d),
            Err(sandbox_core::Error::NotFound { .. }) => {
                return Err(RpcError::new(
                    Code::NotFound,
                    format!("path '{path}' does not exist"),
                ))
            }
            // A symlink out of the workspace, a directory: the sandbox's own view decides.
            Err(_) => {}
        }
    }
    fs::helper(e, "read", &[&path], None).await
}

/// `POST /files[?path=...]`.
pub(crate) async fn write(
    e: Envd,
    Query(q): Query<HashMap<String, String>>,
    req: Request,
) -> Response {
    match write_files(&e, &q, req).await {
        Ok(written) => axum::Json(written).into_response(),
        Err(err) => http(err),
    }
}

async fn write_files(
    e: &Envd,
    q: &HashMap<String, String>,
    req: Request,
) -> Result<Vec<serde_json::Value>, RpcError> {
    if req.headers().get(header::CONTENT_ENCODING).is_some() {
        return Err(RpcError::invalid(
            "compressed uploads (`Content-Encoding`) are not accepted: send the file as it is",
        ));
    }
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let mut written = Vec::new();
    if ct.starts_with("multipart/form-data") {
        let mut parts = Multipart::from_request(req, &())
            .await
            .map_err(|err| RpcError::invalid(format!("the multipart body: {}", err.body_text())))?;
        while let Some(part) = parts
            .next_field()
            .await
            .map_err(|err| multipart_error(&err))?
        {
            let name = match part.file_name() {
                Some(n) if !n.is_empty() => n.to_string(),
                _ => q.get("path").cloned().ok_or_else(|| {
                    RpcError::invalid("a part without a file name, and no `path` query parameter")
                })?,
            };
            let data = part.bytes().await.map_err(|err| multipart_error(&err))?;
            let path = super::resolve(&e.meta.home, &name)?;
            written.push(write_one(e, &path, data).await?);
        }
        if written.is_empty() {
            return Err(RpcError::invalid("the multipart body has no file"));
        }
    } else {
        let path = path_of(e, q)?;
        let data = Bytes::from_request(req, &()).await.map_err(|err| {
            if err.status() == StatusCode::PAYLOAD_TOO_LARGE {
                RpcError::new(
                    Code::ResourceExhausted,
                    "the file is over the server's body limit (`serve --body-limit`)",
                )
            } else {
                RpcError::invalid(err.body_text())
            }
        })?;
        written.push(write_one(e, &path, data).await?);
    }
    Ok(written)
}

fn multipart_error(err: &axum::extract::multipart::MultipartError) -> RpcError {
    if err.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return RpcError::new(
            Code::ResourceExhausted,
            "the upload is over the server's body limit (`serve --body-limit`)",
        );
    }
    RpcError::invalid(format!("the multipart body: {}", err.body_text()))
}

/// Writes one file; envd's `WriteInfo` for it.
async fn write_one(e: &Envd, path: &str, data: Bytes) -> Result<serde_json::Value, RpcError> {
    let mut done = false;
    if let Some(rel) = in_workspace(path) {
        done = e.entry.sandbox.write_file(rel, &data).await.is_ok();
    }
    if !done {
        fs::helper(e, "write", &[path], Some(data.to_vec())).await?;
    }
    let name = path.rsplit('/').next().unwrap_or(path);
    Ok(serde_json::json!({ "name": name, "type": "file", "path": path }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_paths_are_recognised() {
        assert_eq!(in_workspace("/workspace/a/b"), Some("a/b"));
        assert_eq!(in_workspace("/workspace"), None);
        assert_eq!(in_workspace("/workspaces/a"), None);
        assert_eq!(in_workspace("/tmp/a"), None);
    }
}
