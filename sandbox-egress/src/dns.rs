//! A tiny DNS responder: A/AAAA answers only for names the policy could allow.
//! (Hand-written, not a DNS library: one uncompressed question in and A/AAAA answers out is
//! ~150 bounded, fuzzed lines; a full message parser such as `hickory-proto` would put its
//! whole surface in front of every sandbox.)
//!
//! The sandbox's `/etc/resolv.conf` points at it. It never forwards the query: the name is
//! checked against the policy first (so a query for `secret.attacker.example` is not even
//! looked up, which closes the DNS-tunnel exfiltration path), resolved on the host, and only
//! the addresses `decide` allows are returned. Parsing is bounded: one question, no name
//! compression in the question, at most 255 bytes of name.

use std::net::IpAddr;

/// Record type A.
pub const TYPE_A: u16 = 1;
/// Record type AAAA.
pub const TYPE_AAAA: u16 = 28;
/// Class IN.
const CLASS_IN: u16 = 1;

/// Response codes we send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
#[non_exhaustive]
pub enum Rcode {
    /// The name exists (the answer may be empty).
    NoError = 0,
    /// The query could not be parsed.
    FormErr = 1,
    /// Resolution failed on the host.
    ServFail = 2,
    /// The name is not one the policy allows.
    NxDomain = 3,
    /// Not a standard query.
    NotImp = 4,
    /// The policy refuses all names (deny-all) or the class is not IN.
    Refused = 5,
}

/// A parsed DNS query (one question).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Query {
    /// The query id.
    pub id: u16,
    /// The flags word as sent.
    pub flags: u16,
    /// The name, lower-case, without trailing dot (`None` if it is not a valid host name:
    /// it is answered NXDOMAIN without being looked up).
    pub name: Option<String>,
    /// The question exactly as sent (name + type + class), echoed in the answer.
    pub question: Vec<u8>,
    /// Query type.
    pub qtype: u16,
    /// Query class.
    pub qclass: u16,
}

/// Why a message could not be taken as a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueryError {
    /// Too short to even carry an id: drop it.
    Drop,
    /// Answer with this code (the id and flags are known).
    Reply {
        /// The id to echo.
        id: u16,
        /// The flags to echo.
        flags: u16,
        /// The code.
        rcode: Rcode,
    },
}

/// Parses a query datagram.
pub fn parse_query(msg: &[u8]) -> Result<Query, QueryError> {
    if msg.len() < 12 {
        return Err(QueryError::Drop);
    }
    let id = u16::from_be_bytes([msg[0], msg[1]]);
    let flags = u16::from_be_bytes([msg[2], msg[3]]);
    let reply = |rcode| QueryError::Reply { id, flags, rcode };
    if flags & 0x8000 != 0 {
        return Err(QueryError::Drop); // a response, not a query: never answer it (no loops)
    }
    if (flags >> 11) & 0xf != 0 {
        return Err(reply(Rcode::NotImp));
    }
    let qd = u16::from_be_bytes([msg[4], msg[5]]);
    let an = u16::from_be_bytes([msg[6], msg[7]]);
    let ns = u16::from_be_bytes([msg[8], msg[9]]);
    if qd != 1 || an != 0 || ns != 0 {
        return Err(reply(Rcode::FormErr));
    }
    let mut i = 12;
    let mut labels: Vec<&[u8]> = Vec::new();
    let mut name_len = 0usize;
    loop {
        let Some(&len) = msg.get(i) else {
            return Err(reply(Rcode::FormErr));
        };
        i += 1;
        if len == 0 {
            break;
        }
        if len & 0xc0 != 0 {
            return Err(reply(Rcode::FormErr)); // compression/extended labels in a question
        }
        let len = usize::from(len);
        name_len += len + 1;
        if name_len > 255 {
            return Err(reply(Rcode::FormErr));
        }
        let Some(label) = msg.get(i..i + len) else {
            return Err(reply(Rcode::FormErr));
        };
        labels.push(label);
        i += len;
    }
    let Some(tc) = msg.get(i..i + 4) else {
        return Err(reply(Rcode::FormErr));
    };
    let qtype = u16::from_be_bytes([tc[0], tc[1]]);
    let qclass = u16::from_be_bytes([tc[2], tc[3]]);
    let question = msg[12..i + 4].to_vec();
    let joined = labels.join(&b'.');
    let name = crate::tls::valid_host_name(&joined);
    Ok(Query {
        id,
        flags,
        name,
        question,
        qtype,
        qclass,
    })
}

/// Builds the response to `q` with `rcode` and these answer addresses (only those matching
/// the query type are written, at most 8 so the answer fits 512 bytes).
pub fn build_response(q: &Query, rcode: Rcode, addrs: &[IpAddr], ttl: u32) -> Vec<u8> {
    let answers: Vec<&IpAddr> = addrs
        .iter()
        .filter(|a| match a {
            IpAddr::V4(_) => q.qtype == TYPE_A,
            IpAddr::V6(_) => q.qtype == TYPE_AAAA,
        })
        .take(8)
        .collect();
    let mut out = Vec::with_capacity(12 + q.question.len() + answers.len() * 28);
    out.extend_from_slice(&q.id.to_be_bytes());
    // QR=1, opcode 0, AA=0, TC=0, RD copied, RA=1, rcode.
    let flags = 0x8000 | (q.flags & 0x0100) | 0x0080 | u16::from(rcode as u8);
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&q.question);
    for a in answers {
        out.extend_from_slice(&[0xc0, 0x0c]); // pointer to the question's name
        let (ty, data): (u16, Vec<u8>) = match a {
            IpAddr::V4(v4) => (TYPE_A, v4.octets().to_vec()),
            IpAddr::V6(v6) => (TYPE_AAAA, v6.octets().to_vec()),
        };
        out.extend_from_slice(&ty.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(&data);
    }
    out
}

/// Builds a bare error response when the query could not be parsed past its header.
pub fn build_error(id: u16, flags: u16, rcode: Rcode) -> Vec<u8> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(&id.to_be_bytes());
    let flags = 0x8000 | (flags & 0x7900) | 0x0080 | u16::from(rcode as u8);
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&[0; 8]);
    out
}

/// Whether the query is class IN.
pub(crate) fn is_class_in(q: &Query) -> bool {
    q.qclass == CLASS_IN
}

/// Builds a query datagram (tests and clients).
pub fn build_query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&0x0100u16.to_be_bytes()); // RD
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&[0; 6]);
    for label in name.trim_end_matches('.').split('.') {
        let l = &label.as_bytes()[..label.len().min(63)];
        out.push(l.len() as u8);
        out.extend_from_slice(l);
    }
    out.push(0);
    out.extend_from_slice(&qtype.to_be_bytes());
    out.extend_from_slice(&CLASS_IN.to_be_bytes());
    out
}

/// A parsed response (tests and clients): rcode and the A/AAAA addresses of the answer.
pub fn parse_response(msg: &[u8]) -> Option<(u16, Rcode, Vec<IpAddr>)> {
    if msg.len() < 12 || msg[2] & 0x80 == 0 {
        return None;
    }
    let id = u16::from_be_bytes([msg[0], msg[1]]);
    let rcode = match msg[3] & 0x0f {
        0 => Rcode::NoError,
        1 => Rcode::FormErr,
        2 => Rcode::ServFail,
        3 => Rcode::NxDomain,
        4 => Rcode::NotImp,
        5 => Rcode::Refused,
        _ => return None,
    };
    let qd = u16::from_be_bytes([msg[4], msg[5]]);
    let an = u16::from_be_bytes([msg[6], msg[7]]);
    let mut i = 12;
    for _ in 0..qd {
        i = skip_name(msg, i)? + 4;
    }
    let mut addrs = Vec::new();
    for _ in 0..an {
        i = skip_name(msg, i)?;
        let h = msg.get(i..i + 10)?;
        let ty = u16::from_be_bytes([h[0], h[1]]);
        let len = usize::from(u16::from_be_bytes([h[8], h[9]]));
        let data = msg.get(i + 10..i + 10 + len)?;
        match (ty, len) {
            (TYPE_A, 4) => addrs.push(IpAddr::from(<[u8; 4]>::try_from(data).ok()?)),
            (TYPE_AAAA, 16) => addrs.push(IpAddr::from(<[u8; 16]>::try_from(data).ok()?)),
            _ => {}
        }
        i += 10 + len;
    }
    Some((id, rcode, addrs))
}

fn skip_name(msg: &[u8], mut i: usize) -> Option<usize> {
    for _ in 0..128 {
        let len = *msg.get(i)?;
        if len == 0 {
            return Some(i + 1);
        }
        if len & 0xc0 == 0xc0 {
            return Some(i + 2);
        }
        i += 1 + usize::from(len);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_built_query_round_trip() {
        // dig-style query for allowed.test A, id 0x1234, RD, written out byte by byte.
        let q: &[u8] = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\
            \x07allowed\x04test\x00\x00\x01\x00\x01";
        assert_eq!(q, build_query(0x1234, "allowed.test", TYPE_A).as_slice());
        let parsed = parse_query(q).unwrap();
        assert_eq!(parsed.name.as_deref(), Some("allowed.test"));
        assert_eq!((parsed.qtype, parsed.id), (TYPE_A, 0x1234));
        let ips: Vec<IpAddr> = vec!["127.0.0.1".parse().unwrap(), "::1".parse().unwrap()];
        let resp = build_response(&parsed, Rcode::NoError, &ips, 30);
        let (id, rcode, addrs) = parse_response(&resp).unwrap();
        assert_eq!((id, rcode), (0x1234, Rcode::NoError));
        assert_eq!(addrs, vec![ips[0]]); // only the A record for an A query
        assert_eq!(resp[2] & 0x01, 0x01, "RD copied");
    }

    #[test]
    fn edns_additional_record_is_tolerated() {
        let mut q = build_query(7, "Allowed.TEST.", TYPE_AAAA);
        q[11] = 1; // ARCOUNT = 1
        q.extend_from_slice(&[0, 0, 41, 0x10, 0, 0, 0, 0, 0, 0, 0]); // OPT RR
        let p = parse_query(&q).unwrap();
        assert_eq!(p.name.as_deref(), Some("allowed.test"));
        assert_eq!(p.qtype, TYPE_AAAA);
    }

    #[test]
    fn malformed_queries() {
        assert_eq!(parse_query(b"short"), Err(QueryError::Drop));
        let mut resp = build_query(1, "a.test", TYPE_A);
        resp[2] |= 0x80;
        assert_eq!(parse_query(&resp), Err(QueryError::Drop));
        // compression pointer in the question
        let mut q = build_query(2, "a.test", TYPE_A);
        q[12] = 0xc0;
        assert!(matches!(
            parse_query(&q),
            Err(QueryError::Reply {
                rcode: Rcode::FormErr,
                ..
            })
        ));
        // truncated everywhere
        let q = build_query(3, "allowed.test", TYPE_A);
        for n in 12..q.len() {
            assert!(matches!(
                parse_query(&q[..n]),
                Err(QueryError::Reply {
                    rcode: Rcode::FormErr,
                    ..
                })
            ));
        }
        // two questions
        let mut q = build_query(4, "a.test", TYPE_A);
        q[5] = 2;
        assert!(parse_query(&q).is_err());
        // an inverse query (opcode 1)
        let mut q = build_query(5, "a.test", TYPE_A);
        q[2] |= 0x08;
        assert!(matches!(
            parse_query(&q),
            Err(QueryError::Reply {
                rcode: Rcode::NotImp,
                ..
            })
        ));
        // a name over 255 bytes
        let long = vec!["a".repeat(63); 5].join(".");
        assert!(parse_query(&build_query(6, &long, TYPE_A)).is_err());
        // a label with odd bytes parses but is not a host name
        let mut q = build_query(8, "a.test", TYPE_A);
        q[13] = b'\0';
        assert_eq!(parse_query(&q).unwrap().name, None);
    }

    /// The fuzz seed: `DNS_FUZZ_SEED` (decimal) if set, else a fixed one.
    fn fuzz_seed() -> u64 {
        std::env::var("DNS_FUZZ_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x2545_f491_4f6c_dd1d)
    }

    /// Mutated, truncated and random datagrams, and random answers: parsing never panics,
    /// whatever parses is consistent, and every response built parses back.
    #[test]
    fn fuzz_never_panics() {
        let seed = fuzz_seed();
        let mut rng = fastrand::Rng::with_seed(seed);
        let samples = [
            build_query(9, "allowed.test", TYPE_A),
            build_query(10, "a.b-c.d_e.example", TYPE_AAAA),
            build_query(11, &vec!["x".repeat(63); 3].join("."), 255),
        ];
        for round in 0..30_000u32 {
            let mut b = match round % 3 {
                // Random bytes behind a plausible header (so the name parser is reached).
                0 => {
                    let len = rng.usize(..300);
                    let mut b: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
                    if b.len() >= 12 {
                        b[2..12].copy_from_slice(&[1, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
                    }
                    b
                }
                _ => {
                    let mut b = samples[rng.usize(..3)].clone();
                    for _ in 0..rng.usize(..4) {
                        let i = rng.usize(..b.len());
                        b[i] = rng.u8(..);
                    }
                    b
                }
            };
            b.truncate(rng.usize(..=b.len()));
            match parse_query(&b) {
                Ok(q) => {
                    assert!(
                        b[12..].starts_with(&q.question),
                        "seed {seed} round {round}"
                    );
                    if let Some(name) = &q.name {
                        assert!(name.len() <= 253 && *name == name.to_ascii_lowercase());
                    }
                    let addrs: Vec<IpAddr> = (0..rng.usize(..12))
                        .map(|_| {
                            if rng.bool() {
                                IpAddr::from(rng.u32(..).to_be_bytes())
                            } else {
                                IpAddr::from(u128::from(rng.u64(..)).to_be_bytes())
                            }
                        })
                        .collect();
                    let resp = build_response(&q, Rcode::NoError, &addrs, 1);
                    let (id, rcode, got) = parse_response(&resp).unwrap_or_else(|| {
                        panic!("seed {seed} round {round}: a built response does not parse")
                    });
                    assert_eq!((id, rcode), (q.id, Rcode::NoError));
                    assert!(got.len() <= addrs.len().min(8), "seed {seed} round {round}");
                }
                Err(QueryError::Drop) => assert!(b.len() < 12 || b[2] & 0x80 != 0),
                Err(QueryError::Reply { id, .. }) => {
                    assert_eq!(id, u16::from_be_bytes([b[0], b[1]]));
                }
            }
            let _ = parse_response(&b);
        }
    }
}
