//! The HTTP plumbing: one `reqwest` client per server, the bearer token on every request,
//! and error answers read into [`Failure`]s.

use reqwest::{Method, RequestBuilder, Response};
use serde::de::DeserializeOwned;

use crate::error::Failure;

/// A connection to one server.
#[derive(Debug)]
pub(crate) struct Client {
    http: reqwest::Client,
    /// The URL every path is appended to (`http://localhost` on a Unix socket).
    base: String,
    token: Option<String>,
    /// The address as the user gave it, for messages.
    pub(crate) shown: String,
}

/// Characters a path segment keeps; everything else is percent-encoded.
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// A workspace path as one URL path segment (its slashes encoded; the server decodes it).
/// `.` and `..` alone would be dot segments, which URLs resolve away: they go as `./.` and
/// `./..`, which the library reads as the same paths.
pub(crate) fn encode_path(path: &str) -> String {
    match path {
        "." | ".." => encode(&format!("./{path}")),
        p => encode(p),
    }
}

/// `s` percent-encoded for a URL path segment or query value.
pub(crate) fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if unreserved(b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Client {
    pub(crate) fn new(
        http: reqwest::Client,
        base: String,
        token: Option<String>,
        shown: String,
    ) -> Client {
        Client {
            http,
            base,
            token,
            shown,
        }
    }

    pub(crate) fn request(&self, method: Method, path: &str) -> RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    /// Sends `req`; an error answer (or no answer) is a [`Failure`].
    pub(crate) async fn send(&self, req: RequestBuilder) -> Result<Response, Failure> {
        let resp = req
            .send()
            .await
            .map_err(|e| Failure::transport(&self.shown, e))?;
        self.check(resp).await
    }

    /// `resp` if it is a success, else the [`Failure`] its error body describes.
    pub(crate) async fn check(&self, resp: Response) -> Result<Response, Failure> {
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let body: serde_json::Value = resp.json().await.unwrap_or_default();
        let detail = &body["error"];
        Err(Failure {
            server: self.shown.clone(),
            status,
            kind: detail["kind"].as_str().unwrap_or("http").to_string(),
            message: detail["message"]
                .as_str()
                .map_or_else(|| format!("HTTP {status}"), str::to_string),
            cause: None,
        })
    }

    /// Sends `req` and reads a JSON answer.
    pub(crate) async fn json<T: DeserializeOwned>(
        &self,
        req: RequestBuilder,
    ) -> Result<T, Failure> {
        let resp = self.send(req).await?;
        self.read_json(resp).await
    }

    /// Reads the JSON body of a successful answer.
    pub(crate) async fn read_json<T: DeserializeOwned>(
        &self,
        resp: Response,
    ) -> Result<T, Failure> {
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| Failure::transport(&self.shown, e))?;
        serde_json::from_slice(&bytes).map_err(|e| Failure::undecodable(&self.shown, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_percent_encoded() {
        assert_eq!(encode("a b/c%?#"), "a%20b%2Fc%25%3F%23");
        assert_eq!(encode("ok-1.txt"), "ok-1.txt");
        assert_eq!(encode("é"), "%C3%A9");
        assert_eq!(encode_path(".."), ".%2F..");
        assert_eq!(encode_path("a/../b"), "a%2F..%2Fb");
    }
}
