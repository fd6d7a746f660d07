//! Wire protocol between the host (`backend_microvm::agent_client`) and the guest agent.
//!
//! This file is compiled three times: into the agent binary (build.rs runs `rustc` on
//! `main.rs`, with `sandbox-agent-proto` as an rlib), into the `microvm-guest-agent` crate,
//! and into the library through `#[path = "../guest-agent/src/proto.rs"]`. Keep it std-only
//! and panic-free. The framing, the codec primitives and the source hash are
//! `sandbox-agent-proto`'s; this file has the agent's messages.
//!
//! The channel is one byte stream (virtio-console, `/dev/hvc0` in the guest). Every message is
//! one frame (`sandbox_agent_proto::frame`): a fixed 9-byte header `[u32 payload length][u8
//! kind][u32 request id]` (little endian) followed by the payload. The host picks the
//! request ids; every response frame carries the id of the request it answers, so several
//! requests may be in flight and an exec's output streams as many `Stdout`/`Stderr` frames
//! before its final `Exit`. Id 0 is reserved for messages that answer no request (`Ready`,
//! and errors about frames whose id is unknown).
//!
//! Payload values: integers little endian; byte strings and UTF-8 strings as `u32 length` +
//! bytes; lists as `u32 count` + items. A payload longer than [`MAX_PAYLOAD`], an unknown kind,
//! a truncated field, trailing bytes or invalid UTF-8 make the frame malformed: decoders return
//! an error and never allocate more than the payload they were given.

#![allow(dead_code)]

use sandbox_agent_proto::{fnv1a, Dec, DecodeError, Enc};

pub use sandbox_agent_proto::frame::{read_frame, skip_bytes, ReadError};
// The host reads headers itself (the agent does not).
#[allow(unused_imports)]
pub use sandbox_agent_proto::frame::{Header, HEADER_LEN};

/// FNV-1a of the agent's sources (this file, `main.rs` and its modules) and of
/// `sandbox-agent-proto`'s, computed at compile time on both sides: the agent announces it
/// in [`Response::Ready`] and [`Response::Pong`] so the host can tell an agent built from
/// other sources (a stale initramfs) from a matching one.
pub const SOURCE_HASH: u64 = sandbox_agent_proto::SOURCE_HASH
    ^ fnv1a(include_bytes!("proto.rs"))
    ^ fnv1a(include_bytes!("main.rs"))
    ^ fnv1a(include_bytes!("root.rs"))
    ^ fnv1a(include_bytes!("interactive.rs"))
    ^ fnv1a(include_bytes!("exec.rs"))
    ^ fnv1a(include_bytes!("files.rs"))
    ^ fnv1a(include_bytes!("net.rs"))
    ^ fnv1a(include_bytes!("setup.rs"))
    ^ fnv1a(include_bytes!("identity.rs"))
    ^ fnv1a(include_bytes!("trust.rs"))
    ^ fnv1a(include_bytes!("watch.rs"))
    // `main.rs`'s unit tests: not in the binary, but every source beside `main.rs` counts
    // (the test that checks the list reads the directory).
    ^ fnv1a(include_bytes!("tests.rs"));

/// Largest payload a frame may carry (4 MiB of data plus room for the other fields).
pub const MAX_PAYLOAD: usize = (4 << 20) + 64 * 1024;
/// Largest data chunk the agent puts in one `Stdout`/`Stderr`/`Data` frame.
pub const CHUNK: usize = 64 * 1024;
/// Largest file content the host sends in one `WriteFile` frame (bigger files are sent as
/// several frames, the later ones with `append`).
pub const WRITE_CHUNK: usize = 1 << 20;
/// Largest stdin an exec request may carry.
pub const MAX_STDIN: usize = 4 << 20;
/// What one output frame of a background process costs of its window at least (a frame of
/// fewer bytes costs this much), so that a window also bounds the frames in flight: the
/// host's queue per request holds a window's worth of frames whatever their sizes.
pub const FRAME_COST: u32 = 1024;

// Request kinds (host -> guest).
const K_EXEC: u8 = 1;
const K_WRITE: u8 = 2;
const K_READ: u8 = 3;
const K_LIST: u8 = 4;
const K_PING: u8 = 5;
const K_SHUTDOWN: u8 = 6;
const K_KILL: u8 = 7;
const K_SPAWN: u8 = 8;
const K_INPUT: u8 = 9;
const K_CLOSE_INPUT: u8 = 10;
const K_SIGNAL: u8 = 11;
const K_RESIZE: u8 = 12;
const K_GRANT: u8 = 13;
const K_CONNECT: u8 = 14;
const K_REFRESH: u8 = 15;
const K_HOLD: u8 = 16;
const K_RELEASE: u8 = 17;
const K_TRUST: u8 = 18;
const K_NETWORK: u8 = 19;
const K_WATCH: u8 = 20;
// Response kinds (guest -> host).
const K_STDOUT: u8 = 64;
const K_STDERR: u8 = 65;
const K_EXIT: u8 = 66;
const K_DATA: u8 = 67;
const K_ENTRIES: u8 = 68;
const K_OK: u8 = 69;
const K_ERROR: u8 = 70;
const K_PONG: u8 = 71;
const K_READY: u8 = 72;
const K_FS_EVENT: u8 = 73;

/// One command to run in the guest.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExecRequest {
    /// Program and arguments; `argv[0]` is looked up in `PATH` when it has no `/`.
    pub argv: Vec<String>,
    /// The whole environment of the program (the agent adds a default `PATH` if absent).
    pub env: Vec<(String, String)>,
    /// Working directory; empty means the workspace root.
    pub cwd: String,
    /// Bytes written to the program's standard input, which is then closed.
    pub stdin: Vec<u8>,
    /// Wall timeout in milliseconds (0: none). On expiry the agent kills the program's
    /// process group and reports `timed_out`.
    pub timeout_ms: u64,
    /// Most bytes of stdout plus stderr forwarded to the host (0: no limit); the rest is read
    /// and dropped, and the exit reports `truncated`.
    pub max_output: u64,
}

/// A request from the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Run a program: answered by `Stdout`/`Stderr` chunks and one `Exit` (or one `Error`).
    Exec(ExecRequest),
    /// Write a file under the workspace (parents are created): answered by `Ok` or `Error`.
    WriteFile {
        /// Path, relative to the workspace or absolute under `/workspace`.
        path: String,
        /// Permission bits for a new file.
        mode: u32,
        /// Append to the file instead of truncating it first.
        append: bool,
        /// Content.
        data: Vec<u8>,
    },
    /// Read a whole file: answered by `Data` chunks then `Ok`, or by `Error`.
    ReadFile {
        /// Path, relative to the workspace or absolute under `/workspace`.
        path: String,
        /// Refuse (with `TooLarge`) files bigger than this.
        max: u64,
    },
    /// List a directory: answered by `Entries` or `Error`.
    List {
        /// Path, relative to the workspace or absolute under `/workspace`.
        path: String,
    },
    /// Liveness and version check: answered by `Pong`.
    Ping,
    /// Kill every process and power the guest off (reboot in the guest, which the VMM treats
    /// as the end of the VM); answered by `Ok` first. In test mode the agent just exits.
    Shutdown,
    /// Kill the process group of the exec (or spawn) with request id `target`, or abort the
    /// connection `Connect` opened with that id: answered by `Ok`, or `Error(NotFound)` if
    /// it is not running.
    Kill {
        /// Request id of the exec to kill.
        target: u32,
    },
    /// Start a background process: answered by `Ok` once it is started (so that `Input`
    /// and `Signal` frames find it), then like `Exec` (`Stdout`/`Stderr` chunks and one
    /// `Exit`; or one `Error` instead of all that), but its input stays open for `Input` frames after the request's `stdin`, and
    /// its output is flow-controlled: the agent sends at most `window` bytes of output
    /// before the host grants more (`Grant`), and leaves the rest in the process's pipe,
    /// where a writer blocks as on any full pipe. Each frame costs its length, at least
    /// [`FRAME_COST`]; the host grants back what it has consumed. `max_output` is not
    /// applied.
    Spawn {
        /// The command, as for `Exec`.
        exec: ExecRequest,
        /// A terminal of (rows, cols) cells as its stdin, stdout and stderr (and controlling
        /// terminal of its own session); `None`: pipes.
        tty: Option<(u16, u16)>,
        /// Output bytes the agent may send before the first `Grant`.
        window: u32,
    },
    /// Bytes for the input of the process spawned by request `target`: answered by `Ok` once
    /// written, `Error(NotFound)` if it is not running (or its input is closed).
    Input {
        /// Request id of the `Spawn`.
        target: u32,
        /// The bytes.
        data: Vec<u8>,
    },
    /// Closes the input of the process spawned by request `target` (on a terminal: the
    /// end-of-file character, Ctrl-D): answered by `Ok` or `Error(NotFound)`.
    CloseInput {
        /// Request id of the `Spawn`.
        target: u32,
    },
    /// Sends signal `signo` to the process group of exec or spawn `target`: answered by `Ok`
    /// or `Error(NotFound)`.
    Signal {
        /// Request id of the `Exec` or `Spawn`.
        target: u32,
        /// The signal number.
        signo: i32,
    },
    /// Resizes the terminal of the process spawned by request `target`: answered by `Ok`,
    /// `Error(NotFound)`, or `Error(Invalid)` when it has no terminal.
    Resize {
        /// Request id of the `Spawn`.
        target: u32,
        /// Rows.
        rows: u16,
        /// Columns.
        cols: u16,
    },
    /// Lets the agent send `bytes` more output of the process spawned by request `target`
    /// (or of the connection opened by it).
    /// Not answered (an unknown target is ignored: the process may just have ended).
    Grant {
        /// Request id of the `Spawn` or `Connect`.
        target: u32,
        /// More bytes of window.
        bytes: u32,
    },
    /// Opens a TCP connection to `port` on the guest's loopback (127.0.0.1, else `::1`), for
    /// a port published on the host: answered by `Ok` once connected, or by
    /// `Error(NotFound)` when nothing accepts there. Then it is driven like a `Spawn`
    /// without a terminal: what the guest's server sends comes as `Stdout` chunks within the
    /// window (`Grant`), `Input` frames go to the server, `CloseInput` half-closes the
    /// connection (the server reads its end), `Kill` aborts it; one `Exit` (code 0) once the
    /// server has closed its side and all it sent was forwarded.
    Connect {
        /// The port inside the guest.
        port: u16,
        /// Bytes the agent may send before the first `Grant`.
        window: u32,
    },
    /// Holds every frame of the agent from now on (`Ok` is the last one) until `Release`:
    /// the host snapshots the VM in between, so no frame is cut by the snapshot and a
    /// restored agent sends nothing before its new host is ready (its background processes
    /// block on their output meanwhile). Requests are still read and carried out; their
    /// answers wait. `Shutdown` releases it.
    Hold,
    /// Ends a `Hold`: answered by `Ok` first, then what waited goes out.
    Release,
    /// Gives the guest a fresh identity, for a sandbox just booted or restored from a
    /// snapshot (whose copies would otherwise share the snapshot's random state, clock and
    /// name): sets the hostname, mixes `entropy` into the kernel's pool and reseeds its
    /// random generator (`RNDADDENTROPY`, `RNDRESEEDCRNG`), and sets the wall clock. Answered
    /// by `Ok`, or `Error` naming the step that failed. Only as pid 1 (in a guest): a test
    /// agent on a host answers `Error(Invalid)`.
    Refresh {
        /// The new hostname (1-64 of `[A-Za-z0-9-]`).
        hostname: String,
        /// Random bytes from the host (at most 512).
        entropy: Vec<u8>,
        /// The host's wall clock, nanoseconds since the Unix epoch.
        unix_nanos: u64,
    },
    /// Makes the guest's TLS clients trust the egress proxy's interception CA (a sandbox with
    /// proxy-held secrets): the root's system bundle with `ca_pem` appended is written to
    /// [`CA_BUNDLE`] and over [`SYSTEM_BUNDLE`] (both relative to the root; a symbolic link
    /// on the way is refused, never followed). Answered by `Ok`, or `Error` naming the path
    /// that failed. Only as pid 1 (in a guest): a test agent on a host answers
    /// `Error(Invalid)`.
    Trust {
        /// PEM certificates (at most 64 KiB).
        ca_pem: Vec<u8>,
    },
    /// Moves `eth0` to another link's settings, for a guest restored from a snapshot onto a
    /// network of its own (its device now reaches another link, with another address and
    /// gateway): takes the interface down (which drops its routes and its neighbour entries,
    /// such as the old gateway's MAC), sets the address, brings it up with the default route
    /// and rewrites `/etc/resolv.conf`. `net` is what `agent.net=` takes
    /// (`<addr>/<prefix>,<gateway>`). Answered by `Ok`, `Error(Invalid)` for a bad value (or
    /// not pid 1), `Error(Io)` naming the step that failed.
    Network {
        /// `<addr>/<prefix>,<gateway>`.
        net: String,
    },
    /// Watches a workspace directory (and, `recursive`, every directory beneath it, also
    /// those made later; a directory that appears is reported with what it already holds):
    /// answered by `Ok` once watching, the tree beneath taken in (or one `Error`: `NotFound`,
    /// `PathEscape` also for a symbolic link on the way, `Invalid` for a file, `TooLarge`
    /// past [`MAX_WATCHES`] in the guest), then `FsEvent`s within the
    /// window, as a `Spawn`'s output (each costs [`event_cost`]; `Grant` gives more). Events beyond the window wait in the guest's
    /// kernel; when its queue overflows (or past [`MAX_WATCH_DIRS`] directories or
    /// [`MAX_WATCH_DIR_BYTES`] of their names) a `Lost`
    /// event says so. One `Exit` ends it: after the `Remove` or `Rename` of the directory
    /// itself (path empty), or once `Kill` (of this request's id) stopped it. `Refresh` (a
    /// guest restored from a snapshot) stops every watch: they were the snapshot's host's.
    Watch {
        /// The directory, relative to the workspace or absolute under `/workspace`.
        path: String,
        /// Also the directories beneath it.
        recursive: bool,
        /// Bytes of events the agent may send before the first `Grant`.
        window: u32,
    },
}

/// Most watches open at once in the guest (the host side's per-sandbox limit).
pub const MAX_WATCHES: usize = 64;
/// Most directories one watch holds.
pub const MAX_WATCH_DIRS: usize = 4096;
/// Most bytes of directory names (relative paths) one watch holds.
pub const MAX_WATCH_DIR_BYTES: usize = 512 * 1024;

/// What one `FsEvent` costs of its watch's window: its path's length, at least
/// [`FRAME_COST`] and at most a quarter of the smallest window a host grants in halves (so
/// one event never waits for more window than the host gives back).
pub fn event_cost(path_len: usize) -> u32 {
    let most = 16 * 1024;
    u32::try_from(path_len.clamp(FRAME_COST as usize, most)).unwrap_or(FRAME_COST)
}

/// What happened, in a `FsEvent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsKind {
    /// Created, or moved in.
    Create,
    /// Content changed.
    Write,
    /// Removed.
    Remove,
    /// Moved away.
    Rename,
    /// Mode, owner or times changed.
    Chmod,
    /// Events were lost (the guest kernel's queue overflowed, or the watch holds all the
    /// directories it may); `path` is empty.
    Lost,
}

/// One change in a watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsEvent {
    /// What happened.
    pub kind: FsKind,
    /// The entry, relative to the watched directory; empty for the directory itself.
    pub path: String,
    /// Whether the entry is a directory.
    pub is_dir: bool,
}

/// Where a guest with proxy-held secrets finds the certificates it trusts, relative to its
/// root: `sandbox_core::egress::CA_BUNDLE_PATH`, which the host's `SSL_CERT_FILE`... name.
pub const CA_BUNDLE: &str = "etc/agent-sandbox-ca.crt";

/// The system bundle of Debian-family roots, relative to the root
/// (`sandbox_core::egress::SYSTEM_CA_BUNDLE`): `Trust` writes over it too.
pub const SYSTEM_BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";

/// The line `Trust` writes between the root's own certificates and the CA, the same as
/// `sandbox_core::egress::SecretPlan::ca_bundle` writes for the other tiers (a second
/// `Trust` cuts the bundle there).
pub const CA_MARK: &str =
    "# agent-sandbox: the egress proxy's interception CA (proxy-held secrets)\n";

/// How an exec ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExitInfo {
    /// Exit code, if the program exited by itself.
    pub code: Option<i32>,
    /// Signal number, if the program was killed by a signal.
    pub signal: Option<i32>,
    /// Whether the agent killed it because its timeout expired.
    pub timed_out: bool,
    /// Whether output beyond `max_output` was dropped.
    pub truncated: bool,
}

/// Kind of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link (not followed).
    Symlink,
    /// Anything else.
    Other,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// File name.
    pub name: String,
    /// Kind.
    pub kind: EntryKind,
    /// Size in bytes.
    pub size: u64,
}

/// Category of an error reported by the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The path does not exist.
    NotFound,
    /// The path leaves the workspace.
    PathEscape,
    /// The file or request is bigger than allowed.
    TooLarge,
    /// The request is well-formed but makes no sense (empty argv, a directory to read...).
    Invalid,
    /// An I/O error in the guest.
    Io,
    /// A malformed frame.
    Protocol,
}

/// A message from the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// A chunk of an exec's standard output.
    Stdout(Vec<u8>),
    /// A chunk of an exec's standard error.
    Stderr(Vec<u8>),
    /// The exec ended (last frame of an exec).
    Exit(ExitInfo),
    /// A chunk of a file's content.
    Data(Vec<u8>),
    /// A directory listing.
    Entries(Vec<Entry>),
    /// The request succeeded.
    Ok,
    /// The request failed.
    Error {
        /// Category.
        kind: ErrorKind,
        /// Human-readable detail.
        message: String,
    },
    /// Answer to `Ping`.
    Pong {
        /// The agent's [`SOURCE_HASH`].
        source_hash: u64,
    },
    /// Sent once, with id 0, when the agent starts serving.
    Ready {
        /// The agent's [`SOURCE_HASH`].
        source_hash: u64,
    },
    /// A change seen by a `Watch`.
    FsEvent(FsEvent),
}

/// A malformed payload (the reason is dropped: the peer is told only that it was).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

impl From<DecodeError> for Malformed {
    fn from(_: DecodeError) -> Malformed {
        Malformed
    }
}

fn encode_exec(e: &mut Enc, x: &ExecRequest) {
    e.strs(&x.argv);
    e.list(&x.env, |e, (k, v)| {
        e.str(k);
        e.str(v);
    });
    e.str(&x.cwd);
    e.bytes(&x.stdin);
    e.u64(x.timeout_ms);
    e.u64(x.max_output);
}

fn decode_exec(d: &mut Dec<'_>) -> Result<ExecRequest, DecodeError> {
    Ok(ExecRequest {
        argv: d.strs()?,
        env: d.list(8, |d| Ok::<_, DecodeError>((d.str()?, d.str()?)))?,
        cwd: d.str()?,
        stdin: d.bytes()?.to_vec(),
        timeout_ms: d.u64()?,
        max_output: d.u64()?,
    })
}

impl Request {
    /// Encodes this request as one frame with id `id`.
    pub fn encode(&self, id: u32) -> Vec<u8> {
        let mut e;
        match self {
            Request::Exec(x) => {
                e = Enc::frame(K_EXEC, id);
                encode_exec(&mut e, x);
            }
            Request::Spawn { exec, tty, window } => {
                e = Enc::frame(K_SPAWN, id);
                encode_exec(&mut e, exec);
                match tty {
                    Some((rows, cols)) => {
                        e.bool(true);
                        e.u16(*rows);
                        e.u16(*cols);
                    }
                    None => e.bool(false),
                }
                e.u32(*window);
            }
            Request::Input { target, data } => {
                e = Enc::frame(K_INPUT, id);
                e.u32(*target);
                e.bytes(data);
            }
            Request::CloseInput { target } => {
                e = Enc::frame(K_CLOSE_INPUT, id);
                e.u32(*target);
            }
            Request::Signal { target, signo } => {
                e = Enc::frame(K_SIGNAL, id);
                e.u32(*target);
                e.i32(*signo);
            }
            Request::Resize { target, rows, cols } => {
                e = Enc::frame(K_RESIZE, id);
                e.u32(*target);
                e.u16(*rows);
                e.u16(*cols);
            }
            Request::Grant { target, bytes } => {
                e = Enc::frame(K_GRANT, id);
                e.u32(*target);
                e.u32(*bytes);
            }
            Request::Connect { port, window } => {
                e = Enc::frame(K_CONNECT, id);
                e.u16(*port);
                e.u32(*window);
            }
            Request::Refresh {
                hostname,
                entropy,
                unix_nanos,
            } => {
                e = Enc::frame(K_REFRESH, id);
                e.str(hostname);
                e.bytes(entropy);
                e.u64(*unix_nanos);
            }
            Request::WriteFile {
                path,
                mode,
                append,
                data,
            } => {
                e = Enc::frame(K_WRITE, id);
                e.str(path);
                e.u32(*mode);
                e.bool(*append);
                e.bytes(data);
            }
            Request::ReadFile { path, max } => {
                e = Enc::frame(K_READ, id);
                e.str(path);
                e.u64(*max);
            }
            Request::List { path } => {
                e = Enc::frame(K_LIST, id);
                e.str(path);
            }
            Request::Ping => e = Enc::frame(K_PING, id),
            Request::Hold => e = Enc::frame(K_HOLD, id),
            Request::Release => e = Enc::frame(K_RELEASE, id),
            Request::Trust { ca_pem } => {
                e = Enc::frame(K_TRUST, id);
                e.bytes(ca_pem);
            }
            Request::Network { net } => {
                e = Enc::frame(K_NETWORK, id);
                e.str(net);
            }
            Request::Watch {
                path,
                recursive,
                window,
            } => {
                e = Enc::frame(K_WATCH, id);
                e.str(path);
                e.bool(*recursive);
                e.u32(*window);
            }
            Request::Shutdown => e = Enc::frame(K_SHUTDOWN, id),
            Request::Kill { target } => {
                e = Enc::frame(K_KILL, id);
                e.u32(*target);
            }
        }
        e.finish_frame()
    }

    /// Decodes a request payload of the given kind.
    pub fn decode(kind: u8, payload: &[u8]) -> Result<Request, Malformed> {
        let mut d = Dec::new(payload);
        let r = match kind {
            K_EXEC => Request::Exec(decode_exec(&mut d)?),
            K_SPAWN => Request::Spawn {
                exec: decode_exec(&mut d)?,
                tty: if d.bool()? {
                    Some((d.u16()?, d.u16()?))
                } else {
                    None
                },
                window: d.u32()?,
            },
            K_INPUT => Request::Input {
                target: d.u32()?,
                data: d.bytes()?.to_vec(),
            },
            K_CLOSE_INPUT => Request::CloseInput { target: d.u32()? },
            K_SIGNAL => Request::Signal {
                target: d.u32()?,
                signo: d.i32()?,
            },
            K_RESIZE => Request::Resize {
                target: d.u32()?,
                rows: d.u16()?,
                cols: d.u16()?,
            },
            K_GRANT => Request::Grant {
                target: d.u32()?,
                bytes: d.u32()?,
            },
            K_CONNECT => Request::Connect {
                port: d.u16()?,
                window: d.u32()?,
            },
            K_REFRESH => Request::Refresh {
                hostname: d.str()?,
                entropy: d.bytes()?.to_vec(),
                unix_nanos: d.u64()?,
            },
            K_WRITE => Request::WriteFile {
                path: d.str()?,
                mode: d.u32()?,
                append: d.bool()?,
                data: d.bytes()?.to_vec(),
            },
            K_READ => Request::ReadFile {
                path: d.str()?,
                max: d.u64()?,
            },
            K_LIST => Request::List { path: d.str()? },
            K_PING => Request::Ping,
            K_HOLD => Request::Hold,
            K_RELEASE => Request::Release,
            K_TRUST => Request::Trust {
                ca_pem: d.bytes()?.to_vec(),
            },
            K_NETWORK => Request::Network { net: d.str()? },
            K_WATCH => Request::Watch {
                path: d.str()?,
                recursive: d.bool()?,
                window: d.u32()?,
            },
            K_SHUTDOWN => Request::Shutdown,
            K_KILL => Request::Kill { target: d.u32()? },
            _ => return Err(Malformed),
        };
        d.end()?;
        Ok(r)
    }
}

fn kind_code(k: EntryKind) -> u8 {
    match k {
        EntryKind::File => 0,
        EntryKind::Dir => 1,
        EntryKind::Symlink => 2,
        EntryKind::Other => 3,
    }
}

fn fs_code(k: FsKind) -> u8 {
    match k {
        FsKind::Create => 0,
        FsKind::Write => 1,
        FsKind::Remove => 2,
        FsKind::Rename => 3,
        FsKind::Chmod => 4,
        FsKind::Lost => 5,
    }
}

fn err_code(k: ErrorKind) -> u8 {
    match k {
        ErrorKind::NotFound => 1,
        ErrorKind::PathEscape => 2,
        ErrorKind::TooLarge => 3,
        ErrorKind::Invalid => 4,
        ErrorKind::Io => 5,
        ErrorKind::Protocol => 6,
    }
}

impl Response {
    /// A chunk of a command's output: `Stderr` or `Stdout`.
    pub fn output(stderr: bool, data: Vec<u8>) -> Response {
        if stderr {
            Response::Stderr(data)
        } else {
            Response::Stdout(data)
        }
    }

    /// Encodes this response as one frame with id `id`.
    pub fn encode(&self, id: u32) -> Vec<u8> {
        let mut e;
        match self {
            Response::Stdout(b) => {
                e = Enc::frame(K_STDOUT, id);
                e.bytes(b);
            }
            Response::Stderr(b) => {
                e = Enc::frame(K_STDERR, id);
                e.bytes(b);
            }
            Response::Exit(x) => {
                e = Enc::frame(K_EXIT, id);
                let flags = u8::from(x.code.is_some())
                    | (u8::from(x.signal.is_some()) << 1)
                    | (u8::from(x.timed_out) << 2)
                    | (u8::from(x.truncated) << 3);
                e.u8(flags);
                e.i32(x.code.unwrap_or(0));
                e.i32(x.signal.unwrap_or(0));
            }
            Response::Data(b) => {
                e = Enc::frame(K_DATA, id);
                e.bytes(b);
            }
            Response::Entries(list) => {
                e = Enc::frame(K_ENTRIES, id);
                e.list(list, |e, x| {
                    e.str(&x.name);
                    e.u8(kind_code(x.kind));
                    e.u64(x.size);
                });
            }
            Response::Ok => e = Enc::frame(K_OK, id),
            Response::Error { kind, message } => {
                e = Enc::frame(K_ERROR, id);
                e.u8(err_code(*kind));
                e.str(message);
            }
            Response::Pong { source_hash } => {
                e = Enc::frame(K_PONG, id);
                e.u64(*source_hash);
            }
            Response::Ready { source_hash } => {
                e = Enc::frame(K_READY, id);
                e.u64(*source_hash);
            }
            Response::FsEvent(ev) => {
                e = Enc::frame(K_FS_EVENT, id);
                e.u8(fs_code(ev.kind));
                e.bool(ev.is_dir);
                e.str(&ev.path);
            }
        }
        e.finish_frame()
    }

    /// Decodes a response payload of the given kind.
    pub fn decode(kind: u8, payload: &[u8]) -> Result<Response, Malformed> {
        let mut d = Dec::new(payload);
        let r = match kind {
            K_STDOUT => Response::Stdout(d.bytes()?.to_vec()),
            K_STDERR => Response::Stderr(d.bytes()?.to_vec()),
            K_EXIT => {
                let flags = d.u8()?;
                if flags & !0x0f != 0 {
                    return Err(Malformed);
                }
                let code = d.i32()?;
                let signal = d.i32()?;
                Response::Exit(ExitInfo {
                    code: (flags & 1 != 0).then_some(code),
                    signal: (flags & 2 != 0).then_some(signal),
                    timed_out: flags & 4 != 0,
                    truncated: flags & 8 != 0,
                })
            }
            K_DATA => Response::Data(d.bytes()?.to_vec()),
            K_ENTRIES => Response::Entries(d.list(13, |d| {
                Ok::<_, Malformed>(Entry {
                    name: d.str()?,
                    kind: match d.u8()? {
                        0 => EntryKind::File,
                        1 => EntryKind::Dir,
                        2 => EntryKind::Symlink,
                        3 => EntryKind::Other,
                        _ => return Err(Malformed),
                    },
                    size: d.u64()?,
                })
            })?),
            K_OK => Response::Ok,
            K_ERROR => {
                let kind = match d.u8()? {
                    1 => ErrorKind::NotFound,
                    2 => ErrorKind::PathEscape,
                    3 => ErrorKind::TooLarge,
                    4 => ErrorKind::Invalid,
                    5 => ErrorKind::Io,
                    6 => ErrorKind::Protocol,
                    _ => return Err(Malformed),
                };
                Response::Error {
                    kind,
                    message: d.str()?,
                }
            }
            K_PONG => Response::Pong {
                source_hash: d.u64()?,
            },
            K_READY => Response::Ready {
                source_hash: d.u64()?,
            },
            K_FS_EVENT => Response::FsEvent(FsEvent {
                kind: match d.u8()? {
                    0 => FsKind::Create,
                    1 => FsKind::Write,
                    2 => FsKind::Remove,
                    3 => FsKind::Rename,
                    4 => FsKind::Chmod,
                    5 => FsKind::Lost,
                    _ => return Err(Malformed),
                },
                is_dir: d.bool()?,
                path: d.str()?,
            }),
            _ => return Err(Malformed),
        };
        d.end()?;
        Ok(r)
    }
}

// A path of its own: this file is itself loaded through `#[path]` (by `main.rs` and by
// the library), and such a file's plain `mod tests;` is looked for beside it, where
// `main.rs`'s tests are.
#[cfg(test)]
#[path = "proto/tests.rs"]
mod tests;
