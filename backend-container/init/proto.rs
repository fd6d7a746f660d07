//! Wire format between the library and the sandbox init (`init/main.rs`).
//!
//! This file is compiled three times: into the library (`#[path]` module), into the init
//! program, which build.rs compiles with plain `rustc` (std only, with `sandbox-agent-proto`
//! as an rlib), and into the `container-init` workspace package (lints and unit tests). Keep
//! it std-only and panic-free: a malformed message decodes to [`Malformed`], never a panic.
//! The codec primitives ([`Enc`], [`Dec`]) and the source hash are `sandbox-agent-proto`'s;
//! this file has the init's messages and how they are laid out ([`EncodeInit`],
//! [`DecodeInit`]).
//!
//! Bootstrap: the library's zygote clones the init (pid 1 of new user and pid namespaces, a
//! child of the library through `CLONE_PARENT`) with the socket as stdin, on request or ahead
//! of time. The library writes its id maps (its user namespace exists from the `clone`) and
//! sends `MSG_START` and `MSG_MAPS` back to back. The init says `REP_BOOT`, creates its other
//! namespaces (a spare has them from its `clone`, and its `lo` up), takes `MSG_MAPS` (already
//! there: no round trip) and becomes root inside, waits for `MSG_CGROUPS` (fds attached: the
//! sandbox's cgroup files, opened by the library; the init writes `0` to each to move itself
//! in) and says `REP_INIT`.
//!
//! Transport: one `SOCK_SEQPACKET` socketpair; one message per packet:
//! `[u32 kind][u64 id][payload]` (little endian, as every value of a payload), file
//! descriptors travel as `SCM_RIGHTS`.
//! Payloads larger than [`INLINE_MAX`] travel in a memfd passed as the *last* fd and
//! flagged with [`FLAG_BIG`] in `kind`'s high bit.

// Each side uses its half (the library encodes ops and decodes replies, the init the
// reverse): whatever one of them leaves unused is the other's.
#![allow(dead_code)]

/// FNV-1a of the init's sources (every `.rs` file of `init/`: this file, `main.rs` and its
/// modules, XORed; a test in `main.rs` checks that none is missing) and of
/// `sandbox-agent-proto`'s, computed at compile time in both the library and the init: the
/// init reports its value in `REP_BOOT`, so a library that embeds an init built from other
/// sources (a stale build-script output, e.g. when another checkout shares the target
/// directory) fails clearly instead of speaking a different protocol.
pub const SOURCE_HASH: u64 = sandbox_agent_proto::SOURCE_HASH
    ^ fnv1a(include_bytes!("proto.rs"))
    ^ fnv1a(include_bytes!("main.rs"))
    ^ fnv1a(include_bytes!("channel.rs"))
    ^ fnv1a(include_bytes!("harden.rs"))
    ^ fnv1a(include_bytes!("setup.rs"))
    ^ fnv1a(include_bytes!("spawn.rs"))
    ^ fnv1a(include_bytes!("supervise.rs"))
    ^ fnv1a(include_bytes!("sys.rs"))
    ^ fnv1a(include_bytes!("test_util.rs"))
    ^ fnv1a(include_bytes!("zygote.rs"));

pub use sandbox_agent_proto::{fnv1a, Dec, DecodeError, Enc};

/// Largest payload sent inline in a packet.
pub const INLINE_MAX: usize = 48 * 1024;
/// Receive buffer size of the init (header + inline payload).
pub const PACKET_MAX: usize = INLINE_MAX + 64;
/// Set in `kind` when the payload travels in a memfd (the last fd).
pub const FLAG_BIG: u32 = 0x8000_0000;

/// Largest request the zygote reads (its requests are a letter and a few bytes; an `R`
/// request, a one-shot teardown handed over, carries paths). The library sends nothing
/// larger.
pub const ZYGOTE_REQUEST_MAX: usize = 4096;

// library -> init
/// Build the root filesystem and lock the init down: payload = [`Op`] list.
pub const MSG_SETUP: u32 = 1;
/// Run a command: payload = [`ExecSpec`]; fds: stdout, stderr, then stdin if [`EXEC_STDIN`].
pub const MSG_EXEC: u32 = 3;
/// Kill the whole process tree of exec `id` (its supervisor does it).
pub const MSG_KILL: u32 = 4;
/// Liveness check.
pub const MSG_PING: u32 = 5;
/// Bootstrap (id 0): the uid/gid maps of the init's user namespace are written.
pub const MSG_MAPS: u32 = 6;
/// Bootstrap (id 0): the sandbox's cgroup files to join (as fds).
pub const MSG_CGROUPS: u32 = 7;
/// Send signal `i32` to exec `id`'s process group: on the exec's own socket (a spare's, or
/// one given with [`EXEC_JOB`]), handled by its supervisor while the command's leader lives.
pub const MSG_SIGNAL: u32 = 9;
/// Create a TCP socket in the sandbox's network namespace (payload: u8 family, 4 or 6) for
/// the library to connect to a published port: `REP_OK` with the socket attached.
pub const MSG_SOCKET: u32 = 10;
/// Bootstrap (id 0): the first message: a sandbox is wanted. Until then a freshly cloned
/// init (perhaps cloned ahead of time, see the zygote) only waits.
pub const MSG_START: u32 = 8;

// init -> library
/// Request `id` succeeded.
pub const REP_OK: u32 = 100;
/// Request `id` failed: payload = u32 op index, i32 errno, message.
pub const REP_ERR: u32 = 101;
/// Exec `id` finished: payload = i32 wait status, u8 spawned (0: never started), u64 when
/// the command was running (CLOCK_MONOTONIC ns; 0: unknown), u8 flags ([`EXITED_REUSABLE`]).
pub const REP_EXITED: u32 = 103;
/// `REP_EXITED` flag (a spare's exec only): the exec left nothing behind and its supervisor
/// waits for another `MSG_EXEC` on the same socket.
pub const EXITED_REUSABLE: u8 = 1;
/// Bootstrap (id 0): the init got `MSG_START` (its maps were written before it). Payload: u64
/// [`SOURCE_HASH`], u8 flags ([`BOOT_LO_UP`]).
pub const REP_BOOT: u32 = 104;
/// `REP_BOOT` flag: the init (a spare, cloned with all its namespaces) has brought its `lo`
/// up already.
pub const BOOT_LO_UP: u8 = 1;
/// Bootstrap (id 0): the init is in its namespaces and cgroups (no payload).
pub const REP_INIT: u32 = 105;
/// (id 0) A spare supervisor is ready: the fd attached is a socket to it. The library may
/// send it one `MSG_EXEC` (same framing, with the stdio fds); that exec's replies and
/// `MSG_KILL` requests then travel on this socket instead of the control socket.
pub const REP_SPARE: u32 = 106;

/// (exec id) The command runs on a terminal ([`EXEC_TTY`]): the attached fd is its
/// pseudo-terminal's master, sent by the supervisor before anything else about the exec.
pub const REP_PTY: u32 = 107;

/// Where the init keeps the overlay's upper directory open (rootfs-directory mode).
pub const UPPER_FD: u32 = 10;

/// Exec flag: a stdin fd is attached (else stdin is /dev/null).
pub const EXEC_STDIN: u32 = 1;
/// Exec flag: keep uid 0 inside but drop every capability (rootless mode).
pub const EXEC_STAY_ROOT: u32 = 4;
/// Exec flag: the last fd (after the stdio ones) is the exec's own socket: its replies and
/// its `MSG_KILL`/`MSG_SIGNAL` requests travel there, as with a spare (a background process,
/// which must not hold the spare that serves short execs).
pub const EXEC_JOB: u32 = 8;
/// Exec flag: run the command on a new pseudo-terminal of `ExecSpec::tty`'s size (its
/// session leader, stdin/stdout/stderr on the terminal); the master goes to the library
/// in [`REP_PTY`].
pub const EXEC_TTY: u32 = 16;

/// One root-filesystem setup step, run in order by the init.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `mount(src, dst, fstype, flags, data)`; empty strings mean NULL.
    Mount {
        src: String,
        dst: String,
        fstype: String,
        flags: u64,
        data: String,
    },
    /// Bind mount `src` on `dst` (recursive).
    Bind { src: String, dst: String },
    /// `mount_setattr(dst, AT_RECURSIVE?, set, clear)`.
    SetAttr {
        path: String,
        set: u64,
        clear: u64,
        recursive: bool,
    },
    /// `mkdir -p` with a mode for the last component.
    Mkdir { path: String, mode: u32 },
    /// Creates (or truncates) a file with content.
    WriteFile {
        path: String,
        mode: u32,
        data: Vec<u8>,
    },
    /// Creates an empty file if missing (a bind target).
    Touch { path: String },
    /// `symlink(target, path)`.
    Symlink { target: String, path: String },
    /// `lchown(path, uid, gid)`.
    Chown { path: String, uid: u32, gid: u32 },
    /// `pivot_root` into `newroot`, then detach the old root.
    Pivot { newroot: String },
    /// `sethostname`.
    Hostname { name: String },
    /// Brings the loopback interface up.
    LoopbackUp,
    /// `unshare(flags)`; `optional` ones may fail with EINVAL.
    Unshare { flags: u64, optional: bool },
    /// `chdir`.
    Chdir { path: String },
    /// Sets an rlimit on the init itself (inherited by every exec).
    Rlimit { resource: u32, soft: u64, hard: u64 },
    /// `pivot_root(newroot, put_old)` keeping the old root reachable, then `chdir("/")`.
    PivotOld { newroot: String, put_old: String },
    /// `no_new_privs`, then a Landlock domain handling `handled` rights and granting each
    /// rule's rights beneath its path (missing paths are skipped).
    Landlock {
        handled: u64,
        rules: Vec<(String, u64)>,
    },
    /// `no_new_privs`, then this seccomp filter (`struct sock_filter` array bytes).
    Seccomp { bpf: Vec<u8> },
    /// The overlay's lower layer at `dst`: the detached (idmapped) mount passed as the
    /// message's first fd, moved there with `move_mount`; without an fd, a read-only bind of
    /// `src`.
    Lower { src: String, dst: String },
    /// Opens directory `path` and keeps it open (close-on-exec) as fd number `fd`, so the
    /// library can reach it through `/proc/<init>/fd/<fd>` after `pivot_root`.
    KeepDir { path: String, fd: u32 },
    /// Empties the init's capability bounding set, once: every command it starts then execs
    /// without a way back to any capability (cheaper than 64 `prctl`s in every exec).
    DropBoundingSet,
}

/// One command to start.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExecSpec {
    /// `EXEC_*` flags.
    pub flags: u32,
    /// uid/gid inside the sandbox to run as (ignored with `EXEC_STAY_ROOT`).
    pub uid: u32,
    /// gid inside.
    pub gid: u32,
    /// Working directory.
    pub cwd: String,
    /// argv.
    pub argv: Vec<String>,
    /// `K=V` strings: the whole environment.
    pub env: Vec<String>,
    /// (resource, soft, hard).
    pub rlimits: Vec<(u32, u64, u64)>,
    /// The terminal's (rows, cols), with [`EXEC_TTY`].
    pub tty: (u16, u16),
}

/// A malformed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

impl From<DecodeError> for Malformed {
    fn from(_: DecodeError) -> Malformed {
        Malformed
    }
}

/// The init's messages, encoded with [`Enc`].
pub trait EncodeInit {
    /// A message's start: `kind` then `id`; the payload is appended after it.
    fn header(kind: u32, id: u64) -> Self;
    /// Appends one op: a `u8` tag, then its fields in declaration order.
    fn op(&mut self, op: &Op);
    /// Appends an op list: `u32` count, then each op (a `MSG_SETUP` payload).
    fn ops(&mut self, ops: &[Op]);
    /// Appends an [`ExecSpec`] (a `MSG_EXEC` payload).
    fn exec(&mut self, x: &ExecSpec);
}

impl EncodeInit for Enc {
    fn header(kind: u32, id: u64) -> Enc {
        let mut e = Enc::new();
        e.u32(kind);
        e.u64(id);
        e
    }

    fn op(&mut self, op: &Op) {
        match op {
            Op::Mount {
                src,
                dst,
                fstype,
                flags,
                data,
            } => {
                self.u8(1);
                self.str(src);
                self.str(dst);
                self.str(fstype);
                self.u64(*flags);
                self.str(data);
            }
            Op::Bind { src, dst } => {
                self.u8(2);
                self.str(src);
                self.str(dst);
            }
            Op::SetAttr {
                path,
                set,
                clear,
                recursive,
            } => {
                self.u8(3);
                self.str(path);
                self.u64(*set);
                self.u64(*clear);
                self.u8(u8::from(*recursive));
            }
            Op::Mkdir { path, mode } => {
                self.u8(4);
                self.str(path);
                self.u32(*mode);
            }
            Op::WriteFile { path, mode, data } => {
                self.u8(5);
                self.str(path);
                self.u32(*mode);
                self.bytes(data);
            }
            Op::Touch { path } => {
                self.u8(6);
                self.str(path);
            }
            Op::Symlink { target, path } => {
                self.u8(7);
                self.str(target);
                self.str(path);
            }
            Op::Chown { path, uid, gid } => {
                self.u8(8);
                self.str(path);
                self.u32(*uid);
                self.u32(*gid);
            }
            Op::Pivot { newroot } => {
                self.u8(9);
                self.str(newroot);
            }
            Op::Hostname { name } => {
                self.u8(10);
                self.str(name);
            }
            Op::LoopbackUp => self.u8(11),
            Op::Unshare { flags, optional } => {
                self.u8(12);
                self.u64(*flags);
                self.u8(u8::from(*optional));
            }
            Op::Chdir { path } => {
                self.u8(13);
                self.str(path);
            }
            Op::Rlimit {
                resource,
                soft,
                hard,
            } => {
                self.u8(14);
                self.u32(*resource);
                self.u64(*soft);
                self.u64(*hard);
            }
            Op::PivotOld { newroot, put_old } => {
                self.u8(15);
                self.str(newroot);
                self.str(put_old);
            }
            Op::Landlock { handled, rules } => {
                self.u8(16);
                self.u64(*handled);
                self.list(rules, |e, (p, r)| {
                    e.str(p);
                    e.u64(*r);
                });
            }
            Op::Seccomp { bpf } => {
                self.u8(17);
                self.bytes(bpf);
            }
            Op::Lower { src, dst } => {
                self.u8(18);
                self.str(src);
                self.str(dst);
            }
            Op::KeepDir { path, fd } => {
                self.u8(19);
                self.str(path);
                self.u32(*fd);
            }
            Op::DropBoundingSet => self.u8(20),
        }
    }

    fn ops(&mut self, ops: &[Op]) {
        self.list(ops, |e, op| e.op(op));
    }

    fn exec(&mut self, x: &ExecSpec) {
        self.u32(x.flags);
        self.u32(x.uid);
        self.u32(x.gid);
        self.str(&x.cwd);
        self.strs(&x.argv);
        self.strs(&x.env);
        self.list(&x.rlimits, |e, (r, s, h)| {
            e.u32(*r);
            e.u64(*s);
            e.u64(*h);
        });
        self.u32(u32::from(x.tty.0) << 16 | u32::from(x.tty.1));
    }
}

/// The init's messages, decoded with [`Dec`]; a count is checked against the bytes left
/// before anything is reserved for it.
pub trait DecodeInit {
    /// Reads one op; an unknown tag is malformed.
    fn op(&mut self) -> Result<Op, Malformed>;
    /// Reads an op list.
    fn ops(&mut self) -> Result<Vec<Op>, Malformed>;
    /// Reads an [`ExecSpec`].
    fn exec(&mut self) -> Result<ExecSpec, Malformed>;
}

impl DecodeInit for Dec<'_> {
    fn op(&mut self) -> Result<Op, Malformed> {
        Ok(match self.u8()? {
            1 => Op::Mount {
                src: self.str()?,
                dst: self.str()?,
                fstype: self.str()?,
                flags: self.u64()?,
                data: self.str()?,
            },
            2 => Op::Bind {
                src: self.str()?,
                dst: self.str()?,
            },
            3 => Op::SetAttr {
                path: self.str()?,
                set: self.u64()?,
                clear: self.u64()?,
                recursive: self.u8()? != 0,
            },
            4 => Op::Mkdir {
                path: self.str()?,
                mode: self.u32()?,
            },
            5 => Op::WriteFile {
                path: self.str()?,
                mode: self.u32()?,
                data: self.bytes()?.to_vec(),
            },
            6 => Op::Touch { path: self.str()? },
            7 => Op::Symlink {
                target: self.str()?,
                path: self.str()?,
            },
            8 => Op::Chown {
                path: self.str()?,
                uid: self.u32()?,
                gid: self.u32()?,
            },
            9 => Op::Pivot {
                newroot: self.str()?,
            },
            10 => Op::Hostname { name: self.str()? },
            11 => Op::LoopbackUp,
            12 => Op::Unshare {
                flags: self.u64()?,
                optional: self.u8()? != 0,
            },
            13 => Op::Chdir { path: self.str()? },
            14 => Op::Rlimit {
                resource: self.u32()?,
                soft: self.u64()?,
                hard: self.u64()?,
            },
            15 => Op::PivotOld {
                newroot: self.str()?,
                put_old: self.str()?,
            },
            16 => Op::Landlock {
                handled: self.u64()?,
                rules: self.list(12, |d| Ok::<_, DecodeError>((d.str()?, d.u64()?)))?,
            },
            17 => Op::Seccomp {
                bpf: self.bytes()?.to_vec(),
            },
            18 => Op::Lower {
                src: self.str()?,
                dst: self.str()?,
            },
            19 => Op::KeepDir {
                path: self.str()?,
                fd: self.u32()?,
            },
            20 => Op::DropBoundingSet,
            _ => return Err(Malformed),
        })
    }

    fn ops(&mut self) -> Result<Vec<Op>, Malformed> {
        self.list(1, |d| d.op())
    }

    fn exec(&mut self) -> Result<ExecSpec, Malformed> {
        let flags = self.u32()?;
        let uid = self.u32()?;
        let gid = self.u32()?;
        let cwd = self.str()?;
        let argv = self.strs()?;
        let env = self.strs()?;
        let rlimits = self.list(20, |d| Ok::<_, DecodeError>((d.u32()?, d.u64()?, d.u64()?)))?;
        let tty = self.u32()?;
        Ok(ExecSpec {
            flags,
            uid,
            gid,
            cwd,
            argv,
            env,
            rlimits,
            tty: ((tty >> 16) as u16, tty as u16),
        })
    }
}

// The unit tests, in `proto/tests.rs` (named by `#[path]`: this file is itself a `#[path]`
// module, whose children would be looked for beside it). Test code only, so not part of
// `SOURCE_HASH` (the init's source check reads the files of `init/` itself).
#[cfg(test)]
#[path = "proto/tests.rs"]
mod tests;
