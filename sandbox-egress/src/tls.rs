//! A small, bounded TLS ClientHello parser: just enough to read the SNI host name.
//! (Hand-written, not rustls: the proxy needs only the name and the ECH flag from bytes it
//! then forwards unchanged, and rustls reads a ClientHello only by starting a server-side
//! handshake on a connection that is mostly spliced, not terminated.)
//!
//! It never allocates more than [`MAX_HANDSHAKE`] bytes, never panics on any input (every
//! read is bounds-checked through a small cursor) and reassembles a ClientHello split over several
//! TLS records. It does not decrypt or alter anything: the bytes it looked at are forwarded
//! unchanged to the upstream once the connection is allowed.

/// The largest ClientHello we accept (post-quantum key shares make them ~2 KiB today).
pub const MAX_HANDSHAKE: usize = 64 * 1024;

/// TLS record content type of a handshake record.
const CONTENT_HANDSHAKE: u8 = 0x16;
/// Handshake message type of a ClientHello.
const CLIENT_HELLO: u8 = 1;
/// Extension number of `server_name`.
const EXT_SERVER_NAME: u16 = 0;
/// Extension number of `encrypted_client_hello` (ECH).
const EXT_ECH: u16 = 0xfe0d;

/// What the first bytes of a connection say about TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClientHelloSniff {
    /// Too few bytes yet: read more and call again.
    NeedMore,
    /// The bytes do not start a TLS handshake.
    NotTls,
    /// A TLS handshake that is not a valid ClientHello (or is over the size bound).
    Malformed(&'static str),
    /// A complete ClientHello.
    ClientHello(ClientHello),
}

/// The parts of a ClientHello the egress proxy decides on.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientHello {
    /// The SNI host name (lower-case, no trailing dot), if the client sent one.
    pub server_name: Option<String>,
    /// Whether the client offered Encrypted Client Hello (the real name is then hidden).
    pub ech: bool,
}

/// Bounds-checked big-endian reader.
struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Cursor { buf }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.buf.len() {
            return None;
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    /// A vector with a `len_bytes`-byte length prefix.
    fn vec8(&mut self) -> Option<Cursor<'a>> {
        let n = self.u8()?;
        self.take(usize::from(n)).map(Cursor::new)
    }

    fn vec16(&mut self) -> Option<Cursor<'a>> {
        let n = self.u16()?;
        self.take(usize::from(n)).map(Cursor::new)
    }

    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// Parses the start of a connection as a TLS ClientHello.
///
/// `buf` holds every byte received so far. The result is [`ClientHelloSniff::NeedMore`] while
/// the (possibly multi-record) ClientHello is incomplete.
pub fn parse_client_hello(buf: &[u8]) -> ClientHelloSniff {
    if buf.is_empty() {
        return ClientHelloSniff::NeedMore;
    }
    if buf[0] != CONTENT_HANDSHAKE {
        return ClientHelloSniff::NotTls;
    }
    // Reassemble the handshake message from consecutive handshake records.
    let mut msg: Vec<u8> = Vec::new();
    let mut rest = Cursor::new(buf);
    let needed = loop {
        let Some(header) = rest.take(5) else {
            return ClientHelloSniff::NeedMore;
        };
        if header[0] != CONTENT_HANDSHAKE {
            return ClientHelloSniff::Malformed("non-handshake record inside the ClientHello");
        }
        if header[1] != 3 {
            return ClientHelloSniff::NotTls;
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 || len > 16384 + 2048 {
            return ClientHelloSniff::Malformed("bad TLS record length");
        }
        let Some(payload) = rest.take(len) else {
            return ClientHelloSniff::NeedMore;
        };
        if msg.len() + payload.len() > MAX_HANDSHAKE + 4 {
            return ClientHelloSniff::Malformed("ClientHello too large");
        }
        msg.extend_from_slice(payload);
        if msg.len() >= 4 {
            if msg[0] != CLIENT_HELLO {
                return ClientHelloSniff::Malformed("first handshake message is not a ClientHello");
            }
            let body =
                (usize::from(msg[1]) << 16) | (usize::from(msg[2]) << 8) | usize::from(msg[3]);
            if body > MAX_HANDSHAKE {
                return ClientHelloSniff::Malformed("ClientHello too large");
            }
            if msg.len() >= 4 + body {
                break body;
            }
        }
    };
    match parse_body(&msg[4..4 + needed]) {
        Ok(hello) => ClientHelloSniff::ClientHello(hello),
        Err(why) => ClientHelloSniff::Malformed(why),
    }
}

fn parse_body(body: &[u8]) -> Result<ClientHello, &'static str> {
    let mut c = Cursor::new(body);
    let bad = "truncated ClientHello";
    let version = c.u16().ok_or(bad)?;
    if version >> 8 != 3 {
        return Err("unknown ClientHello version");
    }
    c.take(32).ok_or(bad)?; // random
    let session = c.vec8().ok_or(bad)?;
    if session.buf.len() > 32 {
        return Err("session id too long");
    }
    let suites = c.vec16().ok_or(bad)?;
    if suites.buf.is_empty() || suites.buf.len() % 2 != 0 {
        return Err("bad cipher suite list");
    }
    let compression = c.vec8().ok_or(bad)?;
    if compression.buf.is_empty() {
        return Err("empty compression method list");
    }
    let mut hello = ClientHello {
        server_name: None,
        ech: false,
    };
    if c.is_empty() {
        return Ok(hello); // no extensions at all (old clients)
    }
    let mut exts = c.vec16().ok_or(bad)?;
    if !c.is_empty() {
        return Err("trailing bytes after the extensions");
    }
    let mut seen_sni = false;
    while !exts.is_empty() {
        let ty = exts.u16().ok_or(bad)?;
        let mut data = exts.vec16().ok_or(bad)?;
        match ty {
            EXT_SERVER_NAME => {
                if seen_sni {
                    return Err("duplicate server_name extension");
                }
                seen_sni = true;
                hello.server_name = parse_sni(&mut data)?;
            }
            EXT_ECH => hello.ech = true,
            _ => {}
        }
    }
    Ok(hello)
}

fn parse_sni(data: &mut Cursor<'_>) -> Result<Option<String>, &'static str> {
    let bad = "malformed server_name extension";
    if data.is_empty() {
        return Ok(None); // a server's empty acknowledgement; tolerate it
    }
    let mut list = data.vec16().ok_or(bad)?;
    if !data.is_empty() {
        return Err(bad);
    }
    let mut name = None;
    while !list.is_empty() {
        let kind = list.u8().ok_or(bad)?;
        let value = list.vec16().ok_or(bad)?;
        if kind != 0 {
            continue; // unknown name types are skipped (RFC 6066)
        }
        if name.is_some() {
            return Err("more than one host_name in server_name");
        }
        name = Some(valid_host_name(value.buf).ok_or("invalid SNI host name")?);
    }
    Ok(name)
}

/// Checks a DNS host name (as bytes) and returns it lower-case without a trailing dot.
pub(crate) fn valid_host_name(raw: &[u8]) -> Option<String> {
    let raw = raw.strip_suffix(b".").unwrap_or(raw);
    if raw.is_empty() || raw.len() > 253 {
        return None;
    }
    for label in raw.split(|b| *b == b'.') {
        if label.is_empty()
            || label.len() > 63
            || !label
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
        {
            return None;
        }
    }
    std::str::from_utf8(raw).ok().map(str::to_ascii_lowercase)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds a TLS 1.2-style ClientHello record by hand with the given extensions.
    pub(crate) fn hand_built(extensions: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut body = vec![0x03, 0x03];
        body.extend_from_slice(&[7u8; 32]); // random
        body.push(0); // no session id
        body.extend_from_slice(&[0x00, 0x04, 0x13, 0x01, 0xc0, 0x2f]); // 2 suites
        body.extend_from_slice(&[0x01, 0x00]); // null compression
        let mut exts = Vec::new();
        for (ty, data) in extensions {
            exts.extend_from_slice(&ty.to_be_bytes());
            exts.extend_from_slice(&(data.len() as u16).to_be_bytes());
            exts.extend_from_slice(data);
        }
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![CLIENT_HELLO];
        hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        let mut rec = vec![CONTENT_HANDSHAKE, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    pub(crate) fn sni_ext(name: &str) -> (u16, Vec<u8>) {
        let mut entry = vec![0u8];
        entry.extend_from_slice(&(name.len() as u16).to_be_bytes());
        entry.extend_from_slice(name.as_bytes());
        let mut data = (entry.len() as u16).to_be_bytes().to_vec();
        data.extend_from_slice(&entry);
        (EXT_SERVER_NAME, data)
    }

    fn sni_of(buf: &[u8]) -> Option<String> {
        match parse_client_hello(buf) {
            ClientHelloSniff::ClientHello(h) => h.server_name,
            other => panic!("not a ClientHello: {other:?}"),
        }
    }

    #[test]
    fn hand_built_hello_with_sni() {
        let rec = hand_built(&[(10, vec![0, 2, 0, 29]), sni_ext("Allowed.Test.")]);
        assert_eq!(sni_of(&rec).as_deref(), Some("allowed.test"));
        // every strict prefix asks for more bytes, never errs or panics
        for n in 0..rec.len() {
            assert_eq!(
                parse_client_hello(&rec[..n]),
                ClientHelloSniff::NeedMore,
                "{n}"
            );
        }
    }

    #[test]
    fn without_sni_or_extensions() {
        assert_eq!(sni_of(&hand_built(&[])), None);
        let rec = hand_built(&[(10, vec![0, 2, 0, 29])]);
        assert_eq!(sni_of(&rec), None);
    }

    #[test]
    fn ech_is_reported() {
        let rec = hand_built(&[sni_ext("public.test"), (EXT_ECH, vec![1, 2, 3])]);
        match parse_client_hello(&rec) {
            ClientHelloSniff::ClientHello(h) => {
                assert!(h.ech);
                assert_eq!(h.server_name.as_deref(), Some("public.test"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn split_over_two_records() {
        let rec = hand_built(&[sni_ext("split.test")]);
        let hs = &rec[5..];
        let (a, b) = hs.split_at(10);
        let mut two = vec![CONTENT_HANDSHAKE, 3, 1];
        two.extend_from_slice(&(a.len() as u16).to_be_bytes());
        two.extend_from_slice(a);
        two.extend_from_slice(&[CONTENT_HANDSHAKE, 3, 1]);
        two.extend_from_slice(&(b.len() as u16).to_be_bytes());
        two.extend_from_slice(b);
        assert_eq!(sni_of(&two).as_deref(), Some("split.test"));
        assert_eq!(
            parse_client_hello(&two[..two.len() - 1]),
            ClientHelloSniff::NeedMore
        );
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(
            parse_client_hello(b"GET / HTTP/1.1\r\n"),
            ClientHelloSniff::NotTls
        );
        assert!(matches!(
            parse_client_hello(&hand_built(&[sni_ext("a.test"), sni_ext("b.test")])),
            ClientHelloSniff::Malformed(_)
        ));
        assert!(matches!(
            parse_client_hello(&hand_built(&[sni_ext("bad name.test")])),
            ClientHelloSniff::Malformed(_)
        ));
        assert!(matches!(
            parse_client_hello(&hand_built(&[sni_ext("")])),
            ClientHelloSniff::Malformed(_)
        ));
        // a handshake length over the bound is refused before buffering it
        let mut huge = vec![
            CONTENT_HANDSHAKE,
            3,
            1,
            0x10,
            0x00,
            CLIENT_HELLO,
            0xff,
            0xff,
            0xff,
        ];
        huge.resize(5 + 0x1000, 0);
        assert!(matches!(
            parse_client_hello(&huge),
            ClientHelloSniff::Malformed(_)
        ));
        // a server hello (type 2) is not a ClientHello
        let mut rec = hand_built(&[]);
        rec[5] = 2;
        assert!(matches!(
            parse_client_hello(&rec),
            ClientHelloSniff::Malformed(_)
        ));
    }

    #[test]
    fn fuzz_mutations_never_panic() {
        // A tiny deterministic seeded fuzzer: flip, truncate and extend real ClientHellos.
        let seeds = [
            hand_built(&[sni_ext("allowed.test"), (10, vec![0, 2, 0, 29])]),
            include_bytes!("../tests/data/openssl_client_hello.bin").to_vec(),
        ];
        // `TLS_FUZZ_SEED` (decimal) replays another run.
        let seed: u64 = std::env::var("TLS_FUZZ_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x9e37_79b9_7f4a_7c15);
        let mut rng = fastrand::Rng::with_seed(seed);
        for seed in &seeds {
            for _ in 0..20_000 {
                let mut buf = seed.clone();
                for _ in 0..rng.usize(1..=4) {
                    let i = rng.usize(..buf.len());
                    buf[i] = rng.u8(..);
                }
                let cut = rng.usize(..=buf.len());
                buf.truncate(cut);
                check(&buf);
            }
        }
        for _ in 0..20_000 {
            let len = rng.usize(..600);
            let mut buf: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            if !buf.is_empty() {
                buf[0] = CONTENT_HANDSHAKE;
            }
            check(&buf);
        }
        // Well-formed records around random extensions (server_name lists with random
        // entries among them), split into random records, then truncated: the parser gets
        // deep, and a prefix of what parses only ever asks for more.
        for round in 0..5_000u32 {
            let mut exts = Vec::new();
            for _ in 0..rng.usize(..5) {
                let ty = [EXT_SERVER_NAME, EXT_ECH, 10, rng.u16(..)][rng.usize(..4)];
                let data = if ty == EXT_SERVER_NAME && rng.bool() {
                    let mut list = Vec::new();
                    for _ in 0..rng.usize(..3) {
                        let name: Vec<u8> = (0..rng.usize(..20))
                            .map(|_| b"ab.-_Z9\0\xff"[rng.usize(..9)])
                            .collect();
                        list.push(rng.u8(..3));
                        list.extend_from_slice(&(name.len() as u16).to_be_bytes());
                        list.extend_from_slice(&name);
                    }
                    let mut data = (list.len() as u16).to_be_bytes().to_vec();
                    data.extend_from_slice(&list);
                    data
                } else {
                    (0..rng.usize(..40)).map(|_| rng.u8(..)).collect()
                };
                exts.push((ty, data));
            }
            let one = hand_built(&exts);
            // Re-split the handshake message into records of random sizes.
            let hs = &one[5..];
            let mut buf = Vec::new();
            let mut at = 0;
            while at < hs.len() {
                let n = rng.usize(1..=64).min(hs.len() - at);
                buf.extend_from_slice(&[CONTENT_HANDSHAKE, 3, 1]);
                buf.extend_from_slice(&(n as u16).to_be_bytes());
                buf.extend_from_slice(&hs[at..at + n]);
                at += n;
            }
            let whole = parse_client_hello(&buf);
            assert!(
                !matches!(whole, ClientHelloSniff::NeedMore | ClientHelloSniff::NotTls),
                "seed {seed} round {round}: {whole:?}"
            );
            let cut = rng.usize(..buf.len());
            let part = parse_client_hello(&buf[..cut]);
            if matches!(whole, ClientHelloSniff::ClientHello(_)) {
                assert_eq!(
                    part,
                    ClientHelloSniff::NeedMore,
                    "seed {seed} round {round}"
                );
            }
            check(&buf[..cut]);
        }
    }

    /// Parses `buf` (it must not panic) and checks what a ClientHello result holds.
    fn check(buf: &[u8]) {
        if let ClientHelloSniff::ClientHello(h) = parse_client_hello(buf) {
            if let Some(name) = h.server_name {
                assert_eq!(valid_host_name(name.as_bytes()).as_deref(), Some(&*name));
            }
        }
    }

    #[test]
    fn openssl_captured_client_hello() {
        // Captured from `openssl s_client -connect 127.0.0.1:PORT -servername allowed.test`.
        let bytes = include_bytes!("../tests/data/openssl_client_hello.bin");
        assert_eq!(sni_of(bytes).as_deref(), Some("allowed.test"));
    }
}
