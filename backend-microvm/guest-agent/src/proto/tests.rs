//! Every request and response round trip; truncated, extended and random payloads are
//! malformed, never a panic or a large allocation; the framing's length checks and skips.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn split(frame: &[u8]) -> (Header, &[u8]) {
    let mut h = [0u8; HEADER_LEN];
    h.copy_from_slice(&frame[..HEADER_LEN]);
    let h = Header::parse(&h);
    assert_eq!(h.len as usize, frame.len() - HEADER_LEN);
    (h, &frame[HEADER_LEN..])
}

fn requests() -> Vec<Request> {
    vec![
        Request::Exec(ExecRequest {
            argv: vec!["sh".into(), "-c".into(), "echo hi".into()],
            env: vec![("A".into(), "b=c".into()), ("EMPTY".into(), String::new())],
            cwd: "/workspace/sub".into(),
            stdin: b"\x00\xffinput".to_vec(),
            timeout_ms: 1500,
            max_output: 1 << 20,
        }),
        Request::Exec(ExecRequest::default()),
        Request::WriteFile {
            path: "a/b.txt".into(),
            mode: 0o644,
            append: true,
            data: vec![7; 1000],
        },
        Request::ReadFile {
            path: "x".into(),
            max: u64::MAX,
        },
        Request::List {
            path: String::new(),
        },
        Request::Ping,
        Request::Hold,
        Request::Release,
        Request::Shutdown,
        Request::Kill { target: 42 },
        Request::Spawn {
            exec: ExecRequest {
                argv: vec!["sh".into()],
                ..ExecRequest::default()
            },
            tty: Some((24, 80)),
            window: 1 << 20,
        },
        Request::Spawn {
            exec: ExecRequest::default(),
            tty: None,
            window: 0,
        },
        Request::Input {
            target: 3,
            data: b"ls\n".to_vec(),
        },
        Request::CloseInput { target: 3 },
        Request::Signal {
            target: 3,
            signo: 2,
        },
        Request::Resize {
            target: 3,
            rows: 30,
            cols: 100,
        },
        Request::Grant {
            target: 3,
            bytes: 65536,
        },
        Request::Connect {
            port: 8080,
            window: 1 << 17,
        },
        Request::Refresh {
            hostname: "mvm-0123".into(),
            entropy: vec![9; 64],
            unix_nanos: 1_700_000_000_000_000_000,
        },
        Request::Trust {
            ca_pem: b"-----BEGIN CERTIFICATE-----\n".to_vec(),
        },
        Request::Network {
            net: "10.200.0.6/30,10.200.0.5".into(),
        },
        Request::Watch {
            path: "/workspace/src".into(),
            recursive: true,
            window: 1 << 16,
        },
    ]
}

fn responses() -> Vec<Response> {
    vec![
        Response::Stdout(b"out".to_vec()),
        Response::Stderr(Vec::new()),
        Response::Exit(ExitInfo {
            code: Some(3),
            signal: None,
            timed_out: false,
            truncated: true,
        }),
        Response::Exit(ExitInfo {
            code: None,
            signal: Some(9),
            timed_out: true,
            truncated: false,
        }),
        Response::Data(vec![0; 70_000]),
        Response::Entries(vec![
            Entry {
                name: "f".into(),
                kind: EntryKind::File,
                size: 12,
            },
            Entry {
                name: "d".into(),
                kind: EntryKind::Dir,
                size: 0,
            },
            Entry {
                name: "l".into(),
                kind: EntryKind::Symlink,
                size: 1,
            },
            Entry {
                name: "o".into(),
                kind: EntryKind::Other,
                size: 0,
            },
        ]),
        Response::Ok,
        Response::Error {
            kind: ErrorKind::PathEscape,
            message: "no".into(),
        },
        Response::Pong { source_hash: 1 },
        Response::Ready {
            source_hash: SOURCE_HASH,
        },
        Response::FsEvent(FsEvent {
            kind: FsKind::Rename,
            path: "sub/f.txt".into(),
            is_dir: false,
        }),
        Response::FsEvent(FsEvent {
            kind: FsKind::Lost,
            path: String::new(),
            is_dir: true,
        }),
    ]
}

#[test]
fn requests_round_trip() {
    for (i, r) in requests().into_iter().enumerate() {
        let f = r.encode(i as u32 + 1);
        let (h, p) = split(&f);
        assert_eq!(h.id, i as u32 + 1);
        assert_eq!(Request::decode(h.kind, p).unwrap(), r);
    }
}

#[test]
fn responses_round_trip() {
    for (i, r) in responses().into_iter().enumerate() {
        let f = r.encode(i as u32);
        let (h, p) = split(&f);
        assert_eq!(Response::decode(h.kind, p).unwrap(), r);
    }
}

#[test]
fn truncated_or_extended_payloads_are_malformed() {
    for r in requests() {
        let f = r.encode(1);
        let (h, p) = split(&f);
        for cut in 0..p.len() {
            assert_eq!(
                Request::decode(h.kind, &p[..cut]),
                Err(Malformed),
                "{r:?} cut {cut}"
            );
        }
        let mut longer = p.to_vec();
        longer.push(0);
        assert_eq!(Request::decode(h.kind, &longer), Err(Malformed));
    }
    for r in responses() {
        let f = r.encode(1);
        let (h, p) = split(&f);
        for cut in 0..p.len().min(300) {
            assert_eq!(Response::decode(h.kind, &p[..cut]), Err(Malformed));
        }
    }
}

#[test]
fn garbage_never_panics_or_overallocates() {
    // A forged list count of 4 billion must fail before any allocation.
    let mut p = Vec::new();
    p.extend_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(Request::decode(K_EXEC, &p), Err(Malformed));
    assert_eq!(Response::decode(K_ENTRIES, &p), Err(Malformed));
    // Unknown kinds, bad flags, bad enum codes, invalid UTF-8.
    assert_eq!(Request::decode(0, &[]), Err(Malformed));
    assert_eq!(Request::decode(K_STDOUT, &[0, 0, 0, 0]), Err(Malformed));
    assert_eq!(Response::decode(K_EXEC, &[]), Err(Malformed));
    assert_eq!(Response::decode(K_EXIT, &[0xff; 9]), Err(Malformed));
    assert_eq!(Response::decode(K_ERROR, &[9, 0, 0, 0, 0]), Err(Malformed));
    assert_eq!(
        Response::decode(K_FS_EVENT, &[6, 0, 0, 0, 0, 0]),
        Err(Malformed)
    );
    assert_eq!(
        Request::decode(K_LIST, &[2, 0, 0, 0, 0xc3, 0x28]),
        Err(Malformed)
    );
    assert_eq!(
        Request::decode(K_WRITE, &[0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0]),
        Err(Malformed)
    );
    // Pseudo-random bytes (a fixed seed) for every kind.
    let mut rng = fastrand::Rng::with_seed(0x1234_5678_9abc_def0);
    for len in 0..200usize {
        let buf: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
        for kind in 0..=255u8 {
            let _ = Request::decode(kind, &buf);
            let _ = Response::decode(kind, &buf);
        }
    }
}

#[test]
fn read_frame_checks_length_before_allocating() {
    let mut f = Vec::new();
    f.extend_from_slice(&u32::MAX.to_le_bytes());
    f.extend_from_slice(&[K_PING, 7, 0, 0, 0]);
    match read_frame(&mut &f[..], MAX_PAYLOAD) {
        Err(ReadError::TooLarge(h)) => {
            assert_eq!(h.id, 7);
            assert_eq!(h.len, u32::MAX);
        }
        other => panic!("{other:?}"),
    }
    // Clean EOF, EOF inside the header, EOF inside the payload.
    assert!(matches!(read_frame(&mut &[][..], MAX_PAYLOAD), Ok(None)));
    assert!(matches!(
        read_frame(&mut &[1u8, 0][..], MAX_PAYLOAD),
        Err(ReadError::Truncated)
    ));
    let ping = Request::List { path: "abc".into() }.encode(3);
    assert!(matches!(
        read_frame(&mut &ping[..ping.len() - 1], MAX_PAYLOAD),
        Err(ReadError::Truncated)
    ));
    // Two frames back to back, then EOF.
    let mut two = ping.clone();
    two.extend(Request::Ping.encode(4));
    let mut r = &two[..];
    let (h, p) = read_frame(&mut r, MAX_PAYLOAD).unwrap().unwrap();
    assert_eq!(
        (h.id, Request::decode(h.kind, &p).unwrap()),
        (3, Request::List { path: "abc".into() })
    );
    let (h, _) = read_frame(&mut r, MAX_PAYLOAD).unwrap().unwrap();
    assert_eq!(h.id, 4);
    assert!(read_frame(&mut r, MAX_PAYLOAD).unwrap().is_none());
}

#[test]
fn skip_bytes_keeps_the_stream_in_sync() {
    let mut data = vec![1u8; 20_000];
    data.extend(Request::Ping.encode(9));
    let mut r = &data[..];
    skip_bytes(&mut r, 20_000).unwrap();
    let (h, _) = read_frame(&mut r, 16).unwrap().unwrap();
    assert_eq!(h.id, 9);
    assert!(skip_bytes(&mut &[0u8; 3][..], 4).is_err());
}
