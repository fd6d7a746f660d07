//! E2B's signed file URLs, played by someone who holds one URL (or none) and no token: the
//! signature covers the path, the operation, the user and the expiry, and only the token of
//! the sandbox it opens could have made it.

use base64::Engine;
use sha2::{Digest, Sha256};

use super::*;

/// E2B's SDKs' construction of a signature (`get_signature`).
fn sign(path: &str, op: &str, user: &str, token: &str, expiration: Option<i64>) -> String {
    let raw = match expiration {
        Some(t) => format!("{path}:{op}:{user}:{token}:{t}"),
        None => format!("{path}:{op}:{user}:{token}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    let b64 = base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest);
    format!("v1_{}", b64.replace('+', "%2B").replace('/', "%2F"))
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A request with no token and no routing header, as a browser sends a signed URL made
/// under `E2B_SANDBOX_URL`; `host`: the `Host` it names.
fn bare(method: &str, target: &str, host: &str) -> Vec<u8> {
    format!("{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
        .into_bytes()
}

/// A good signed read opens one file of one sandbox; a changed path, operation or expiry, an
/// expired one, one made with another sandbox's token or a random one, a parameter given
/// twice: each a 401 in E2B's words, nothing read. By host name (`--e2b-domain`) the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_file_urls_open_exactly_what_they_sign() {
    let domain = "sandboxes.test";
    let s = serve(ServerConfig::default().e2b_domain(domain)).await;
    let sb = s.create(&s.a).await;
    let theirs = s.create(&s.b).await;
    let host_file = std::fs::read("/etc/passwd").unwrap();
    let path = "/etc/passwd"; // the unisolated backend's own view is the host's
    let later = now() + 600;

    let good = format!(
        "/files?path={path}&signature={}&signature_expiration={later}",
        sign(path, "read", "", &sb.token, Some(later))
    );
    let r = s.send(&bare("GET", &good, "localhost")).await;
    assert_eq!(r.status, 200, "a good signed URL: {}", r.text());
    assert_eq!(r.body, host_file);
    // By host name, the sandbox named in it.
    let by_host = format!("49983-{}.{domain}", sb.id);
    let r = s.send(&bare("GET", &good, &by_host)).await;
    assert_eq!(r.status, 200, "by host name: {}", r.text());
    // ...and not another one's: the signature is not its token's.
    let r = s
        .send(&bare(
            "GET",
            &good,
            &format!("49983-{}.{domain}", theirs.id),
        ))
        .await;
    assert_eq!(r.status, 401, "another sandbox's host: {}", r.text());

    let expired_at = now() - 10;
    let past = format!(
        "/files?path={path}&signature={}&signature_expiration={expired_at}",
        sign(path, "read", "", &sb.token, Some(expired_at))
    );
    let forged = sign(path, "read", "", Token::generate().reveal(), None);
    let cases = [
        (
            "GET",
            good.replace("path=/etc/passwd", "path=/etc/shadow"),
            "invalid signature",
        ),
        ("POST", good.clone(), "invalid signature"),
        (
            "GET",
            good.replace(&format!("={later}"), &format!("={}", later + 1)),
            "invalid signature",
        ),
        (
            "GET",
            good.replace(&format!("&signature_expiration={later}"), ""),
            "invalid signature",
        ),
        ("GET", format!("{good}&username=root"), "invalid signature"),
        (
            "GET",
            format!("/files?path=/etc/shadow&{}", &good[7..]),
            "invalid signature",
        ),
        (
            "GET",
            format!("/files?path={path}&signature={forged}"),
            "invalid signature",
        ),
        ("GET", past, "signature is already expired"),
    ];
    for (method, target, why) in cases {
        for host in ["localhost".to_string(), by_host.clone()] {
            let r = s.send(&bare(method, &target, &host)).await;
            let what = format!("{method} {target} to {host}");
            assert_eq!(r.status, 401, "{what}: {}", r.text());
            assert_eq!(r.json(), json!({"code": 401, "message": why}), "{what}");
        }
    }
    // An upload URL signed for one path writes that path only, whatever its parts are
    // named (envd's rule: `path` wins); one signed for no path is refused.
    let boundary = "XyZzY";
    let multipart = |name: &str| {
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
             Content-Type: application/octet-stream\r\n\r\nuploaded\r\n--{boundary}--\r\n"
        )
    };
    let post = |target: &str, body: &str| {
        format!(
            "POST {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Content-Type: multipart/form-data; boundary={boundary}\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    };
    let signed_in = sign("/workspace/in.txt", "write", "", &sb.token, None);
    let r = s
        .send(&post(
            &format!("/files?path=/workspace/in.txt&signature={signed_in}"),
            &multipart("/workspace/evil.txt"),
        ))
        .await;
    assert_eq!(r.status, 200, "a signed upload: {}", r.text());
    let read = |p: &str| {
        envd_request(
            &sb.id,
            Some(&sb.token),
            &[],
            "GET",
            &format!("/files?path={p}"),
            b"",
        )
    };
    let r = s.send(&read("/workspace/in.txt")).await;
    assert_eq!((r.status, r.text()), (200, "uploaded".to_string()));
    let r = s.send(&read("/workspace/evil.txt")).await;
    assert_eq!(r.status, 404, "a part's own name was written: {}", r.text());
    let no_path = sign("", "write", "", &sb.token, None);
    let r = s
        .send(&post(
            &format!("/files?signature={no_path}"),
            &multipart("/workspace/evil.txt"),
        ))
        .await;
    assert_eq!(r.status, 401, "a URL signed for no path: {}", r.text());
    let r = s.send(&read("/workspace/evil.txt")).await;
    assert_eq!(r.status, 404, "{}", r.text());

    // Client b's own sandbox is opened by a URL its token signed, and only that one.
    let r = s
        .send(&bare(
            "GET",
            &format!(
                "/files?path={path}&signature={}",
                sign(path, "read", "", &theirs.token, None)
            ),
            "localhost",
        ))
        .await;
    assert_eq!(r.status, 200, "b's signed URL: {}", r.text());
    s.assert_serves(Some(&sb)).await;
    s.stop().await;
}
