//! The wire format's unit tests: every op and message round-trips, malformed input is an
//! error (never a panic or a huge allocation), the source hash and the wire constants.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

/// One of every op, with values that differ field by field (a swapped pair of fields
/// in the encoder or decoder would not round-trip).
fn every_op() -> Vec<Op> {
    vec![
        Op::Mount {
            src: "overlay".into(),
            dst: "/new".into(),
            fstype: "overlay".into(),
            flags: 0x0102_0304_0506_0708,
            data: "lowerdir=/l,upperdir=/u".into(),
        },
        Op::Bind {
            src: "/host/ws".into(),
            dst: "/new/workspace".into(),
        },
        Op::SetAttr {
            path: "/new".into(),
            set: 1,
            clear: 2,
            recursive: true,
        },
        Op::SetAttr {
            path: "/new/x".into(),
            set: 3,
            clear: u64::MAX,
            recursive: false,
        },
        Op::Mkdir {
            path: "/new/tmp".into(),
            mode: 0o1777,
        },
        Op::WriteFile {
            path: "/new/etc/hostname".into(),
            mode: 0o644,
            data: vec![0, 1, 2, 255, b'\n'],
        },
        Op::Touch {
            path: "/new/dev/null".into(),
        },
        Op::Symlink {
            target: "/proc/self/fd".into(),
            path: "/new/dev/fd".into(),
        },
        Op::Chown {
            path: "/new/workspace".into(),
            uid: 1000,
            gid: 1001,
        },
        Op::Pivot {
            newroot: "/new".into(),
        },
        Op::Hostname {
            name: "sandbox".into(),
        },
        Op::LoopbackUp,
        Op::Unshare {
            flags: 0x0200_0000,
            optional: true,
        },
        Op::Unshare {
            flags: 0x0002_0000,
            optional: false,
        },
        Op::Chdir {
            path: "/workspace".into(),
        },
        Op::Rlimit {
            resource: 4,
            soft: 7,
            hard: 9,
        },
        Op::PivotOld {
            newroot: "/new".into(),
            put_old: "/new/.old".into(),
        },
        Op::Landlock {
            handled: 0x7ff2,
            rules: vec![("/tmp".into(), 0x7ff2), ("/dev/null".into(), 0x4002)],
        },
        Op::Landlock {
            handled: 0,
            rules: Vec::new(),
        },
        Op::Seccomp {
            bpf: (0..64).collect(),
        },
        Op::Lower {
            src: "/rootfs".into(),
            dst: "/new/lower".into(),
        },
        Op::KeepDir {
            path: "/upper".into(),
            fd: UPPER_FD,
        },
        Op::DropBoundingSet,
        // Empty and non-ASCII strings.
        Op::Mount {
            src: String::new(),
            dst: "/ñ/ü".into(),
            fstype: String::new(),
            flags: 0,
            data: String::new(),
        },
    ]
}

fn exec_spec() -> ExecSpec {
    ExecSpec {
        flags: EXEC_STDIN | EXEC_STAY_ROOT,
        uid: 1000,
        gid: 1001,
        cwd: "/workspace".into(),
        argv: vec!["sh".into(), "-c".into(), "echo hi".into(), String::new()],
        env: vec!["PATH=/usr/bin:/bin".into(), "HOME=/workspace".into()],
        rlimits: vec![(7, 1024, 4096), (1, u64::MAX, u64::MAX)],
        tty: (24, 80),
    }
}

fn encoded_op(op: &Op) -> Vec<u8> {
    let mut e = Enc::default();
    e.op(op);
    e.0
}

#[test]
fn every_op_round_trips() {
    for op in every_op() {
        let b = encoded_op(&op);
        let mut d = Dec::new(&b);
        assert_eq!(d.op(), Ok(op.clone()));
        assert!(d.rest().is_empty(), "{op:?} left bytes behind");
    }
}

#[test]
fn op_lists_round_trip() {
    let ops = every_op();
    let mut e = Enc::default();
    e.ops(&ops);
    let mut d = Dec::new(&e.0);
    assert_eq!(d.ops(), Ok(ops));
    assert!(d.rest().is_empty());
    let mut e = Enc::default();
    e.ops(&[]);
    assert_eq!(Dec::new(&e.0).ops(), Ok(Vec::new()));
}

#[test]
fn exec_specs_round_trip() {
    for x in [exec_spec(), ExecSpec::default()] {
        let mut e = Enc::default();
        e.exec(&x);
        let mut d = Dec::new(&e.0);
        assert_eq!(d.exec(), Ok(x));
        assert!(d.rest().is_empty());
    }
}

#[test]
fn headers_and_scalars_round_trip() {
    let mut e = Enc::header(MSG_EXEC | FLAG_BIG, u64::MAX - 1);
    e.u8(0xab);
    e.i32(-2);
    e.u32(u32::MAX);
    e.u64(1 << 40);
    e.bytes(b"\0raw\xff");
    e.str("text");
    e.strs(&["a".into(), String::new()]);
    e.0.extend_from_slice(b"tail");
    let mut d = Dec::new(&e.0);
    assert_eq!(d.u32(), Ok(MSG_EXEC | FLAG_BIG));
    assert_eq!(d.u64(), Ok(u64::MAX - 1));
    assert_eq!(d.u8(), Ok(0xab));
    assert_eq!(d.i32(), Ok(-2));
    assert_eq!(d.u32(), Ok(u32::MAX));
    assert_eq!(d.u64(), Ok(1 << 40));
    assert_eq!(d.bytes(), Ok(&b"\0raw\xff"[..]));
    assert_eq!(d.str(), Ok("text".to_string()));
    assert_eq!(d.strs(), Ok(vec!["a".to_string(), String::new()]));
    assert_eq!(d.rest(), b"tail");
    // Little endian, as documented: `[u32 kind][u64 id]`.
    assert_eq!(
        Enc::header(0x0102_0304, 5).0,
        [4, 3, 2, 1, 5, 0, 0, 0, 0, 0, 0, 0]
    );
}

#[test]
fn truncated_input_is_malformed() {
    // Every strict prefix of an encoding fails to decode, for every op, an op list and
    // an exec spec: no field is read past the end, and nothing panics.
    type Decodes = fn(&mut Dec<'_>) -> bool;
    let mut messages: Vec<(Vec<u8>, Decodes)> = Vec::new();
    for op in every_op() {
        messages.push((encoded_op(&op), |d| d.op().is_ok()));
    }
    let mut e = Enc::default();
    e.ops(&every_op());
    messages.push((e.0, |d| d.ops().is_ok()));
    let mut e = Enc::default();
    e.exec(&exec_spec());
    messages.push((e.0, |d| d.exec().is_ok()));
    for (bytes, decodes) in messages {
        assert!(decodes(&mut Dec::new(&bytes)));
        for cut in 0..bytes.len() {
            assert!(
                !decodes(&mut Dec::new(&bytes[..cut])),
                "a {cut}-byte prefix of {bytes:?} decoded"
            );
        }
    }
}

#[test]
fn unknown_op_tags_are_malformed() {
    let known: Vec<u8> = every_op().iter().map(|op| encoded_op(op)[0]).collect();
    for tag in 0..=u8::MAX {
        if !known.contains(&tag) {
            // Followed by plenty of bytes: the tag alone decides.
            let mut b = vec![tag];
            b.extend_from_slice(&[0; 64]);
            assert_eq!(Dec::new(&b).op(), Err(Malformed), "tag {tag}");
        }
    }
}

#[test]
fn invalid_utf8_is_malformed() {
    let mut e = Enc::default();
    e.u8(6); // Touch
    e.bytes(b"/bad\xff");
    assert_eq!(Dec::new(&e.0).op(), Err(Malformed));
    let mut e = Enc::default();
    e.bytes(&[0xc3]);
    assert!(Dec::new(&e.0).str().is_err());
}

#[test]
fn huge_lengths_and_counts_are_malformed_without_huge_allocations() {
    // A length or count of u32::MAX in a short message fails on the first missing
    // byte; the decoders reserve a bounded number of slots, whatever the count says.
    let max = u32::MAX.to_le_bytes();
    assert!(Dec::new(&max).bytes().is_err());
    assert!(Dec::new(&max).str().is_err());
    assert!(Dec::new(&max).strs().is_err());
    assert_eq!(Dec::new(&max).ops(), Err(Malformed));
    let mut landlock = vec![16];
    landlock.extend_from_slice(&0u64.to_le_bytes());
    landlock.extend_from_slice(&max);
    assert_eq!(Dec::new(&landlock).op(), Err(Malformed));
    let mut e = Enc::default();
    e.exec(&ExecSpec::default());
    let n = e.0.len();
    e.0[n - 8..n - 4].copy_from_slice(&max); // the rlimit count (the terminal size follows)
    assert_eq!(Dec::new(&e.0).exec(), Err(Malformed));
}

#[test]
fn source_hash_is_fnv1a_of_both_sources() {
    // FNV-1a 64 reference values.
    assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    let sources: [&[u8]; 10] = [
        include_bytes!("../proto.rs"),
        include_bytes!("../main.rs"),
        include_bytes!("../channel.rs"),
        include_bytes!("../harden.rs"),
        include_bytes!("../setup.rs"),
        include_bytes!("../spawn.rs"),
        include_bytes!("../supervise.rs"),
        include_bytes!("../sys.rs"),
        include_bytes!("../test_util.rs"),
        include_bytes!("../zygote.rs"),
    ];
    let init = sources.iter().fold(0, |h, s| h ^ fnv1a(s));
    assert_eq!(SOURCE_HASH, init ^ sandbox_agent_proto::SOURCE_HASH);
}

#[test]
fn wire_constants_are_distinct() {
    let requests = [
        MSG_SETUP,
        MSG_EXEC,
        MSG_KILL,
        MSG_PING,
        MSG_MAPS,
        MSG_CGROUPS,
        MSG_START,
    ];
    let replies = [REP_OK, REP_ERR, REP_EXITED, REP_BOOT, REP_INIT, REP_SPARE];
    let all: Vec<u32> = requests.iter().chain(&replies).copied().collect();
    for (i, a) in all.iter().enumerate() {
        assert_eq!(a & FLAG_BIG, 0, "kind {a} collides with FLAG_BIG");
        assert!(!all[i + 1..].contains(a), "kind {a} used twice");
    }
}

// A packet holds the header and the largest inline payload.
const _: () = assert!(PACKET_MAX >= INLINE_MAX + 12);
