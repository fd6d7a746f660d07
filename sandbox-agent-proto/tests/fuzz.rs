//! Fuzz-style round trips, seeded and bounded: random frames read back as written, and
//! random or truncated bytes never make the codec or the frame reader panic, over-read or
//! allocate beyond the bound.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use sandbox_agent_proto::frame::skip_bytes;
use sandbox_agent_proto::{read_frame, write_frame, Dec, DecodeError, Enc, ReadError};

// Each test seeds its generator with a fixed seed: the same sequence every run.
use fastrand::Rng;

/// `n` random bytes.
fn bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut b = vec![0; n];
    rng.fill(&mut b);
    b
}

/// One value of each kind the codec has.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    U8(u8),
    Bool(bool),
    U16(u16),
    U32(u32),
    I32(i32),
    U64(u64),
    Bytes(Vec<u8>),
    Str(String),
    Strs(Vec<String>),
}

fn random_string(rng: &mut Rng) -> String {
    let n = rng.usize(..12);
    (0..n)
        .map(|_| ['a', 'ñ', '/', ' ', '\0', '€'][rng.usize(..6)])
        .collect()
}

fn random_value(rng: &mut Rng) -> Value {
    match rng.u32(..9) {
        0 => Value::U8(rng.u8(..)),
        1 => Value::Bool(rng.bool()),
        2 => Value::U16(rng.u16(..)),
        3 => Value::U32(rng.u32(..)),
        4 => Value::I32(rng.i32(..)),
        5 => Value::U64(rng.u64(..)),
        6 => {
            let n = rng.usize(..40);
            Value::Bytes(bytes(rng, n))
        }
        7 => Value::Str(random_string(rng)),
        _ => Value::Strs((0..rng.usize(..4)).map(|_| random_string(rng)).collect()),
    }
}

fn encode(e: &mut Enc, v: &Value) {
    match v {
        Value::U8(x) => e.u8(*x),
        Value::Bool(x) => e.bool(*x),
        Value::U16(x) => e.u16(*x),
        Value::U32(x) => e.u32(*x),
        Value::I32(x) => e.i32(*x),
        Value::U64(x) => e.u64(*x),
        Value::Bytes(x) => e.bytes(x),
        Value::Str(x) => e.str(x),
        Value::Strs(x) => e.strs(x),
    }
}

/// Decodes a value shaped like `like`.
fn decode(d: &mut Dec<'_>, like: &Value) -> Result<Value, DecodeError> {
    Ok(match like {
        Value::U8(_) => Value::U8(d.u8()?),
        Value::Bool(_) => Value::Bool(d.bool()?),
        Value::U16(_) => Value::U16(d.u16()?),
        Value::U32(_) => Value::U32(d.u32()?),
        Value::I32(_) => Value::I32(d.i32()?),
        Value::U64(_) => Value::U64(d.u64()?),
        Value::Bytes(_) => Value::Bytes(d.bytes()?.to_vec()),
        Value::Str(_) => Value::Str(d.str()?),
        Value::Strs(_) => Value::Strs(d.strs()?),
    })
}

#[test]
fn random_messages_round_trip_and_every_prefix_fails_cleanly() {
    let mut rng = Rng::with_seed(0x9e37_79b9_7f4a_7c15);
    for _ in 0..500 {
        let values: Vec<Value> = (0..rng.usize(..8) + 1)
            .map(|_| random_value(&mut rng))
            .collect();
        let mut e = Enc::new();
        for v in &values {
            encode(&mut e, v);
        }
        let bytes = e.into_vec();
        let mut d = Dec::new(&bytes);
        for v in &values {
            assert_eq!(decode(&mut d, v).as_ref(), Ok(v));
        }
        assert_eq!(d.end(), Ok(()));
        // Every strict prefix fails on some value, without panicking.
        for cut in 0..bytes.len() {
            let mut d = Dec::new(&bytes[..cut]);
            let all = values.iter().all(|v| decode(&mut d, v).is_ok());
            assert!(!all, "a {cut}-byte prefix of {values:?} decoded");
        }
    }
}

#[test]
fn random_bytes_never_panic_or_over_read() {
    let mut rng = Rng::with_seed(0x1234_5678_9abc_def0);
    let shapes: Vec<Value> = (0..64).map(|_| random_value(&mut rng)).collect();
    for len in 0..300usize {
        let buf = bytes(&mut rng, len);
        for start in 0..shapes.len() {
            let mut d = Dec::new(&buf);
            for like in shapes[start..].iter().take(6) {
                let before = d.position();
                match decode(&mut d, like) {
                    Ok(_) => assert!(d.position() > before || matches!(like, Value::Strs(_))),
                    // A failed read consumes nothing.
                    Err(_) => assert_eq!(d.position(), before),
                }
                assert!(d.position() <= buf.len());
            }
        }
    }
}

#[test]
fn random_frames_read_back_and_bad_streams_fail_cleanly() {
    let mut rng = Rng::with_seed(0xdead_beef_cafe_f00d);
    const MAX: usize = 4096;
    let mut stream = Vec::new();
    let mut frames = Vec::new();
    for _ in 0..300 {
        let kind = rng.u8(..);
        let id = rng.u32(..);
        let n = rng.usize(..600);
        let payload = bytes(&mut rng, n);
        write_frame(&mut stream, kind, id, &payload).unwrap();
        frames.push((kind, id, payload));
    }
    let mut r = &stream[..];
    for (kind, id, payload) in &frames {
        let (h, p) = read_frame(&mut r, MAX).unwrap().unwrap();
        assert_eq!((h.kind, h.id, &p), (*kind, *id, payload));
    }
    assert!(read_frame(&mut r, MAX).unwrap().is_none());
    // Cut anywhere: the frames before the cut read back, then a clean end (at a boundary)
    // or `Truncated`, never a panic.
    for _ in 0..200 {
        let cut = rng.usize(..stream.len());
        let mut r = &stream[..cut];
        loop {
            match read_frame(&mut r, MAX) {
                Ok(Some(_)) => {}
                Ok(None) | Err(ReadError::Truncated) => break,
                Err(e) => panic!("{e:?}"),
            }
        }
    }
    // Random streams: whatever the headers say, nothing larger than the bound is
    // allocated; a frame refused as too large is skipped and reading goes on.
    for _ in 0..200 {
        let n = rng.usize(..2000);
        let junk = bytes(&mut rng, n);
        let mut r = &junk[..];
        for _ in 0..64 {
            match read_frame(&mut r, 256) {
                Ok(Some((h, p))) => assert!(p.len() <= 256 && p.len() == h.len as usize),
                Ok(None) | Err(ReadError::Truncated) => break,
                Err(ReadError::TooLarge(h)) => {
                    if skip_bytes(&mut r, u64::from(h.len)).is_err() {
                        break;
                    }
                }
                Err(ReadError::Io(e)) => panic!("{e}"),
            }
        }
    }
}
