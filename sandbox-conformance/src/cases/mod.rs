//! The table of cases, grouped by concern.

use sandbox_core::{ExecRequest, ExecResult, LimitKind, NetworkMode, Sandbox};

use crate::{Case, Checked, Need};

mod caps;
mod exec;
mod files;
mod limits;

/// Every case, in table order.
pub fn cases() -> &'static [Case] {
    CASES
}

/// Declares a case whose check is an `async fn(&Ctx) -> Checked`.
macro_rules! case {
    ($id:literal, $desc:literal, [$($need:expr),* $(,)?], $check:path) => {
        Case {
            id: $id,
            description: $desc,
            needs: &[$($need),*],
            check: |cx| Box::pin($check(cx)),
        }
    };
}

use Need::*;

static CASES: &[Case] = &[
    case!(
        "exit.zero",
        "a command that exits 0 reports exit code 0 and success",
        [Code],
        exec::exit_zero
    ),
    case!(
        "exit.one",
        "a command that exits 1 reports exit code 1, no limit",
        [Code],
        exec::exit_one
    ),
    case!(
        "exit.not-found",
        "an argv command that does not exist exits 127",
        [Argv],
        exec::not_found
    ),
    case!(
        "exit.not-executable",
        "an argv command naming a file that cannot be executed exits 126",
        [Argv],
        exec::not_executable
    ),
    case!(
        "exit.killed",
        "a command killed by SIGKILL reports 137",
        [Shell],
        exec::killed
    ),
    case!(
        "io.separate",
        "stdout and stderr are captured apart, byte for byte",
        [Code],
        exec::separate
    ),
    case!(
        "io.stdin",
        "stdin is fed and closed; without stdin the command reads EOF",
        [Code],
        exec::stdin
    ),
    case!(
        "io.devices",
        "/dev/null, /dev/zero and /dev/urandom exist and behave",
        [Code],
        exec::devices
    ),
    case!(
        "env.spec-only",
        "commands see the spec's and the call's env, nothing of the host's",
        [Code],
        exec::env_only
    ),
    case!(
        "env.secret-redacted",
        "a secret exposed as env reaches the code and never the captured output",
        [Code],
        exec::secret_redacted
    ),
    case!(
        "env.secret-redacted-stream",
        "a secret exposed as env never reaches streamed output either",
        [Code, Streaming],
        exec::secret_redacted_stream
    ),
    case!(
        "cwd.default",
        "commands start in /workspace",
        [Code],
        exec::cwd_default
    ),
    case!(
        "cwd.request",
        "a call's cwd is where the command starts",
        [Code],
        exec::cwd_request
    ),
    case!(
        "files.api",
        "write_file / read_file / list round-trip bytes and directories",
        [],
        files::api_roundtrip
    ),
    case!(
        "files.inside",
        "files written through the API are seen inside, and the reverse",
        [Code],
        files::inside
    ),
    case!(
        "files.alias",
        "the workspace at a second path (`workspace_alias`) is the same directory; or is Unsupported",
        [Code],
        files::alias
    ),
    case!(
        "files.not-found",
        "reading a missing file is NotFound",
        [],
        files::not_found
    ),
    case!(
        "files.watch",
        "a watch sees what code inside changes, refuses escapes, ends with the sandbox; or is Unsupported",
        [Code],
        files::watch
    ),
    case!(
        "path.dotdot",
        "`..` leaving the workspace is PathEscape in every file call",
        [],
        files::dotdot
    ),
    case!(
        "path.absolute",
        "an absolute path outside /workspace is PathEscape",
        [],
        files::absolute
    ),
    case!(
        "path.symlink",
        "a symlink leading out of the workspace is PathEscape, never followed",
        [],
        files::symlink
    ),
    case!(
        "limit.wall-time",
        "a command past its wall time is killed: limit wall-time, exit 137",
        [Code, Limit(LimitKind::WallTime)],
        limits::wall_time
    ),
    case!(
        "limit.memory",
        "allocating past the memory limit reports limit memory",
        [Code, Limit(LimitKind::Memory)],
        limits::memory
    ),
    case!(
        "limit.output",
        "an output flood is stopped: limit output, truncated, capped",
        [Code, Limit(LimitKind::Output)],
        limits::output
    ),
    case!(
        "limit.pids",
        "forking past the pids limit reports limit pids",
        [Shell, Limit(LimitKind::Pids)],
        limits::pids
    ),
    case!(
        "limit.disk",
        "filling the workspace past disk_bytes reports limit disk",
        [Code, Limit(LimitKind::Disk)],
        limits::disk
    ),
    case!(
        "net.deny-all",
        "deny-all: no route out, 169.254.169.254 unreachable",
        [Code, Network(NetworkMode::DenyAll)],
        limits::deny_all
    ),
    case!(
        "isolation.no-userns",
        "sandboxed code cannot create namespaces (shell, Python, argv)",
        [Shell, Argv, ProcessIsolation],
        limits::no_userns
    ),
    case!(
        "snapshot.restore",
        "a restored snapshot has the same workspace files",
        [Snapshot],
        files::snapshot_restore
    ),
    case!(
        "lifecycle.destroy-twice",
        "destroy is idempotent",
        [],
        caps::destroy_twice
    ),
    case!(
        "lifecycle.gone",
        "every call after destroy is SandboxGone",
        [],
        caps::gone_after_destroy
    ),
    case!(
        "caps.languages",
        "each claimed language runs hello-world; others are Unsupported at create",
        [],
        caps::languages
    ),
    case!(
        "caps.argv",
        "argv is claimed and runs, or is Unsupported",
        [],
        caps::argv
    ),
    case!(
        "caps.streaming",
        "streaming is claimed and streams, or is Unsupported",
        [],
        caps::streaming
    ),
    case!(
        "caps.processes",
        "background processes are claimed and run beside execs, or are Unsupported",
        [Code],
        caps::processes
    ),
    case!(
        "process.io-signals",
        "a process reads stdin as it is written, streams its output, and SIGINT reaches its handler",
        [Code, Processes],
        caps::process_io_signals
    ),
    case!(
        "process.signal-defaults",
        "every signal starts at its default and unblocked, though the caller ignores or blocks some",
        [Shell, Argv, Processes],
        caps::process_signal_defaults
    ),
    case!(
        "caps.tty",
        "terminals are claimed and have the asked size, or are Unsupported",
        [Shell],
        caps::tty
    ),
    case!(
        "caps.publish",
        "published ports are claimed and open and close, or are Unsupported",
        [],
        caps::publish
    ),
    case!(
        "caps.usage",
        "resource usage is claimed and counts, or is Unsupported",
        [Code],
        caps::usage
    ),
    case!(
        "caps.pause-resume",
        "pause/resume is claimed and works, or is Unsupported",
        [],
        caps::pause_resume
    ),
    case!(
        "caps.snapshots",
        "snapshots are claimed and work, or are Unsupported",
        [],
        caps::snapshots
    ),
    case!(
        "caps.network",
        "network modes not claimed are Unsupported at create",
        [],
        caps::network
    ),
    case!(
        "caps.images",
        "images not claimed are Unsupported at create",
        [NoImages],
        caps::images
    ),
];

/// Runs `req` in `sb`; an error is a failure naming `what`.
pub(crate) async fn run(
    sb: &dyn Sandbox,
    what: &str,
    req: ExecRequest,
) -> Result<ExecResult, String> {
    sb.exec(req)
        .await
        .map_err(|e| format!("{what}: exec failed: {e}"))
}

/// Fails with the result's details unless `ok`.
pub(crate) fn expect(ok: bool, what: &str, r: &ExecResult) -> Checked {
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what}: exit {:?}, limit {:?}, truncated {}, stdout {:?}, stderr {:?}",
            r.exit_code,
            r.limit,
            r.truncated,
            clip(&r.stdout_str()),
            clip(&r.stderr_str())
        ))
    }
}

/// The first 300 characters of `s`.
pub(crate) fn clip(s: &str) -> String {
    let mut c: String = s.chars().take(300).collect();
    if c.len() < s.len() {
        c.push('…');
    }
    c
}
