//! envd's `/files`: a file's content down (`GET`), and up (`POST`: one file as
//! `application/octet-stream`, or several in one `multipart/form-data` body, each part's
//! file name its path unless a `path` parameter names it). Paths in the workspace go through the library's file API (whole
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

/// The workspace-relative form of `path`, when it is a file's place in the workspace.
fn in_workspace<'a>(e: &Envd, path: &'a str) -> Option<&'a str> {
    e.in_workspace(path).filter(|r| !r.is_empty())
}

fn path_of(e: &Envd, q: &HashMap<String, String>) -> Result<String, RpcError> {
    let p = q
        .get("path")
        .ok_or_else(|| RpcError::invalid("no `path` query parameter"))?;
    super::resolve(&e.meta.home, p)
}

/// `GET /files?path=...`; gzipped when the client accepts it.
pub(crate) async fn read(
    e: Envd,
    headers: axum::http::HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let data = match read_file(&e, &q).await {
        Ok(d) => d,
        Err(err) => return http(err),
    };
    let gzip = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|c| c.trim().starts_with("gzip")));
    if gzip {
        // Compressing is CPU work: off the async workers, which serve everyone.
        let zipped = tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            z.write_all(&data)
                .and_then(|()| z.finish())
                .map_err(|_| data)
        })
        .await;
        if let Ok(Ok(zipped)) = zipped {
            return (
                [
                    (header::CONTENT_TYPE, "application/octet-stream"),
                    (header::CONTENT_ENCODING, "gzip"),
                ],
                zipped,
            )
                .into_response();
        }
        return http(RpcError::new(
            Code::Internal,
            "the file could not be gzipped",
        ));
    }
    ([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response()
}

/// A gzipped upload, unpacked to at most `limit` bytes (what it says it unpacks to is not
/// trusted: the output is counted as it comes).
fn gunzip(data: &[u8], limit: usize) -> Result<Bytes, RpcError> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data)
        .take((limit as u64).saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| RpcError::invalid(format!("the gzipped upload does not unpack: {e}")))?;
    if out.len() > limit {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("the upload unpacks to more than the server's body limit of {limit} bytes"),
        ));
    }
    Ok(Bytes::from(out))
}

async fn read_file(e: &Envd, q: &HashMap<String, String>) -> Result<Vec<u8>, RpcError> {
    let path = path_of(e, q)?;
    if let Some(rel) = in_workspace(e, &path) {
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
    let limit = e.body_limit;
    let gzip = match req.headers().get(header::CONTENT_ENCODING) {
        None => false,
        Some(v) if v.as_bytes().eq_ignore_ascii_case(b"gzip") => true,
        Some(v) if v.as_bytes().eq_ignore_ascii_case(b"identity") => false,
        Some(v) => {
            return Err(RpcError::invalid(format!(
                "`Content-Encoding: {}`: only gzip is accepted",
                String::from_utf8_lossy(v.as_bytes())
            )))
        }
    };
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let mut written = Vec::new();
    if ct.starts_with("multipart/form-data") {
        if gzip {
            return Err(RpcError::invalid(
                "a gzipped multipart body: gzip one file at a time (`application/octet-stream`)",
            ));
        }
        let mut parts = Multipart::from_request(req, &())
            .await
            .map_err(|err| RpcError::invalid(format!("the multipart body: {}", err.body_text())))?;
        while let Some(part) = parts
            .next_field()
            .await
            .map_err(|err| multipart_error(&err))?
        {
            // As envd: the `path` parameter, when given, is where every part goes (a URL
            // signed for one path writes that path only); else each part's file name.
            let name = match (q.get("path"), part.file_name()) {
                (Some(p), _) => p.clone(),
                (None, Some(n)) if !n.is_empty() => n.to_string(),
                (None, _) => {
                    return Err(RpcError::invalid(
                        "a part without a file name, and no `path` query parameter",
                    ))
                }
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
        let data = if gzip {
            tokio::task::spawn_blocking(move || gunzip(&data, limit))
                .await
                .map_err(|e| RpcError::new(Code::Internal, format!("unpacking: {e}")))??
        } else {
            data
        };
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
    if let Some(rel) = in_workspace(e, path) {
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
    fn gzipped_uploads_unpack_within_the_limit_only() {
        use std::io::Write;
        let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        z.write_all(&vec![0u8; 1 << 20]).unwrap();
        let bomb = z.finish().unwrap();
        assert!(bomb.len() < 4096);
        assert_eq!(gunzip(&bomb, 1 << 20).unwrap().len(), 1 << 20);
        let e = gunzip(&bomb, 1000).unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted);
        assert_eq!(
            gunzip(b"not gzip", 1000).unwrap_err().code,
            Code::InvalidArgument
        );
    }
}
