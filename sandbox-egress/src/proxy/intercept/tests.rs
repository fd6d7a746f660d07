//! Request targets and response framing inside intercepted connections.

use super::request::{origin_target, with_target};
use super::response::{response_body, Body};
use super::*;

#[test]
fn request_targets_must_name_this_connection() {
    let t = |target: &str| origin_target("GET", target, "api.test", 443);
    assert_eq!(t("/a?b"), Ok(None));
    assert_eq!(origin_target("OPTIONS", "*", "api.test", 443), Ok(None));
    assert_eq!(t("https://api.test/x?y"), Ok(Some("/x?y".into())));
    assert_eq!(t("HTTPS://API.TEST:443"), Ok(Some("/".into())));
    assert_eq!(t("https://api.test?q"), Ok(Some("/?q".into())));
    assert_eq!(
        origin_target("GET", "http://api.test:8080/p", "api.test", 8080),
        Ok(Some("/p".into()))
    );
    for bad in [
        "*",
        "https://other.test/",
        "https://api.test.other.test/",
        "https://api.test@other.test/",
        "https://api.test:444/",
        "http://api.test/",
        "api.test:443",
        "ftp://api.test/",
        "https:///x",
    ] {
        assert!(t(bad).is_err(), "{bad}");
    }
    assert_eq!(
        with_target(
            b"GET https://api.test/x HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET",
            "/x",
            1
        ),
        b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"
    );
}

#[test]
fn response_framing() {
    let h = |pairs: &[(&'static str, &'static str)]| -> Vec<httparse::Header<'static>> {
        pairs
            .iter()
            .map(|(n, v)| httparse::Header {
                name: n,
                value: v.as_bytes(),
            })
            .collect()
    };
    let body =
        |pairs: &[(&'static str, &'static str)], code, head| response_body(&h(pairs), code, head);
    assert!(matches!(
        body(&[("Content-Length", "5")], 200, false),
        Ok(Body::Length(5))
    ));
    assert!(matches!(
        body(&[("Content-Length", "5")], 200, true),
        Ok(Body::None)
    ));
    assert!(matches!(
        body(&[("Content-Length", "5")], 204, false),
        Ok(Body::None)
    ));
    assert!(matches!(
        body(&[("Content-Length", "5")], 304, false),
        Ok(Body::None)
    ));
    assert!(matches!(body(&[], 101, false), Ok(Body::UntilClose)));
    assert!(matches!(body(&[], 200, false), Ok(Body::UntilClose)));
    assert!(matches!(
        body(
            &[("Transfer-Encoding", "Chunked"), ("Content-Length", "5")],
            200,
            false
        ),
        Ok(Body::Chunked)
    ));
    assert!(matches!(
        body(
            &[("Content-Length", "5"), ("Content-Length", "5")],
            200,
            false
        ),
        Ok(Body::Length(5))
    ));
    for bad in [
        &[("Transfer-Encoding", "gzip, chunked")][..],
        &[("Transfer-Encoding", "gzip")],
        &[
            ("Transfer-Encoding", "chunked"),
            ("Transfer-Encoding", "chunked"),
        ],
        &[("Content-Length", "5"), ("Content-Length", "6")],
        &[("Content-Length", "+5")],
        &[("Content-Length", "5, 5")],
    ] {
        assert!(body(bad, 200, false).is_err(), "{bad:?}");
    }
    assert_eq!(chunk_size(b"1a;ext=1\r\n"), Some(26));
    assert_eq!(chunk_size(b"0\r\n"), Some(0));
    for bad in [&b"+1\r\n"[..], b"\r\n", b"x\r\n", b"ffffffffffffffff\r\n"] {
        assert_eq!(chunk_size(bad), None);
    }
    assert_eq!(digits("42"), Some(42));
    assert_eq!(digits("+42"), None);
    assert_eq!(digits(""), None);
}
