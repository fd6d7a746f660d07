//! E2B's signed file URLs (`download_url`, `upload_url`): `/files?path=P&username=U&
//! signature=v1_S[&signature_expiration=T]`, where `S` is the unpadded base64 of
//! `sha256("P:OP:U:TOKEN[:T]")`, `OP` `read` (GET) or `write` (POST) and `TOKEN` the
//! sandbox's envd access token. Such a URL stands in for `X-Access-Token` on that one path and
//! operation until `T` (Unix seconds), so a browser or `curl` can fetch a file.
//!
//! The SDKs build the URL on the sandbox's own host (`49983-ID.DOMAIN`, which `--e2b-domain`
//! routes); under `E2B_SANDBOX_URL` it names no sandbox, so the server finds the one whose
//! token made the signature ([`find`]): one SHA-256 per E2B sandbox of the server (off the
//! async workers), compared in constant time, nothing learned from a miss. A URL signed for
//! no path is never valid (an upload's parts would name their own files).

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::Response;
use base64::Engine;
use sha2::{Digest, Sha256};

use crate::{Entry, Shared, Token};

/// The signed-URL parameters of a `/files` request.
#[derive(Clone)]
pub(crate) struct Signed {
    path: String,
    user: String,
    signature: String,
    expiration: Option<i64>,
    op: &'static str,
}

impl Signed {
    /// The request's signed-URL parameters, if it is a `/files` read or write carrying a
    /// `signature`.
    pub(crate) fn of(req: &Request) -> Option<Signed> {
        if req.uri().path() != "/files" {
            return None;
        }
        let op = match *req.method() {
            Method::GET => "read",
            Method::POST => "write",
            _ => return None,
        };
        let (mut path, mut user, mut signature, mut expiration) = (None, None, None, None);
        let mut twice = false;
        for (k, v) in form_urlencoded::parse(req.uri().query()?.as_bytes()) {
            let slot = match k.as_ref() {
                "path" => &mut path,
                "username" => &mut user,
                "signature" => &mut signature,
                "signature_expiration" => &mut expiration,
                _ => continue,
            };
            // A parameter given twice could be read one way here and another by the handler
            // (`?path=/secret&path=signed.txt`): such a URL is never valid.
            twice |= slot.replace(v.into_owned()).is_some();
        }
        let signature = signature?;
        Some(Signed {
            path: path.unwrap_or_default(),
            user: user.unwrap_or_default(),
            signature: if twice { String::new() } else { signature },
            // Unparsable: kept as a value no signature was made with (so it fails as one).
            expiration: expiration.map(|t| t.parse().unwrap_or(i64::MIN)),
            op,
        })
    }

    /// Whether `token` made this signature (constant time in its bytes).
    fn made_with(&self, token: &Token) -> bool {
        let mut raw = format!("{}:{}:{}:{}", self.path, self.op, self.user, token.reveal());
        if let Some(t) = self.expiration {
            raw.push_str(&format!(":{t}"));
        }
        let digest = Sha256::digest(raw.as_bytes());
        let want = format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
        );
        let got = self.signature.as_bytes();
        want.len() == got.len()
            && want
                .as_bytes()
                .iter()
                .zip(got)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }

    /// `None` when `token` made this signature and it has not expired, else the 401 (E2B's
    /// wording: `invalid signature`, `signature is already expired`).
    pub(crate) fn check(&self, token: &Token) -> Option<Response> {
        // A URL signed for no path would let an upload name any file in its parts.
        if self.path.is_empty() || !self.made_with(token) {
            return Some(invalid());
        }
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        match self.expiration {
            Some(t) if t < now => Some(super::api_error(
                StatusCode::UNAUTHORIZED,
                "signature is already expired",
            )),
            _ => None,
        }
    }
}

/// The 401 of a signature no sandbox's token made.
pub(crate) fn invalid() -> Response {
    super::api_error(StatusCode::UNAUTHORIZED, "invalid signature")
}

/// The E2B sandbox whose envd token made `sig` (a signed URL that names no sandbox).
pub(crate) fn find(s: &Shared, sig: &Signed) -> Option<Arc<Entry>> {
    let all: Vec<Arc<Entry>> = s.lock().values().cloned().collect();
    all.into_iter()
        .find(|e| e.e2b.get().is_some_and(|m| sig.made_with(&m.access_token)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(uri: &str, method: Method) -> Request {
        axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .body(axum::body::Body::empty())
            .unwrap()
    }

    /// E2B's own construction (the SDKs' `get_signature`), for the test.
    fn sign(path: &str, op: &str, user: &str, token: &str, exp: Option<i64>) -> String {
        let raw = match exp {
            Some(t) => format!("{path}:{op}:{user}:{token}:{t}"),
            None => format!("{path}:{op}:{user}:{token}"),
        };
        let d = Sha256::digest(raw.as_bytes());
        format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(d)
        )
    }

    fn enc(s: &str) -> String {
        form_urlencoded::byte_serialize(s.as_bytes()).collect()
    }

    #[test]
    fn signatures_bind_path_operation_user_token_and_expiry() {
        let token = Token::generate();
        let t = token.reveal();
        let later = time::OffsetDateTime::now_utc().unix_timestamp() + 100;
        let good = sign("dir/a b.txt", "read", "user", t, Some(later));
        let uri = format!(
            "/files?path={}&username=user&signature={}&signature_expiration={later}",
            enc("dir/a b.txt"),
            enc(&good)
        );
        let s = Signed::of(&req(&uri, Method::GET)).unwrap();
        assert!(s.check(&token).is_none(), "a good signature");
        // The same URL as a write, by another token, with another path or expiry: refused.
        assert!(Signed::of(&req(&uri, Method::POST))
            .unwrap()
            .check(&token)
            .is_some());
        assert!(s.check(&Token::generate()).is_some());
        for (from, to) in [
            ("a+b.txt", "a+c.txt"),
            ("username=user", "username=root"),
            (
                &format!("expiration={later}"),
                &format!("expiration={}", later + 1),
            ),
            (&format!("expiration={later}"), "expiration=soon"),
        ] {
            let bad = uri.replace(from, to);
            let s = Signed::of(&req(&bad, Method::GET)).unwrap();
            assert!(s.check(&token).is_some(), "{bad}");
        }
        // Expired: refused even though the signature is good.
        let past = later - 200;
        let old = sign("x", "read", "", t, Some(past));
        let uri = format!(
            "/files?path=x&signature={}&signature_expiration={past}",
            enc(&old)
        );
        let r = Signed::of(&req(&uri, Method::GET))
            .unwrap()
            .check(&token)
            .unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        // No expiry: good for as long as the token is.
        let forever = sign("x", "write", "", t, None);
        let uri = format!("/files?path=x&signature={}", enc(&forever));
        assert!(Signed::of(&req(&uri, Method::POST))
            .unwrap()
            .check(&token)
            .is_none());
        // A parameter twice is never valid, whichever copy the signature covers.
        let good = sign("b", "read", "", t, None);
        for uri in [
            format!("/files?path=%2Fsecret&path=b&signature={}", enc(&good)),
            format!("/files?path=b&path=%2Fsecret&signature={}", enc(&good)),
            format!("/files?path=b&signature={0}&signature={0}", enc(&good)),
        ] {
            let s = Signed::of(&req(&uri, Method::GET)).unwrap();
            assert!(s.check(&token).is_some(), "{uri}");
        }
        // Not a signed URL: other paths, no signature.
        assert!(Signed::of(&req("/files?path=x", Method::GET)).is_none());
        assert!(Signed::of(&req("/envs?signature=v1_x", Method::GET)).is_none());
    }
}
