//! A client for a runsc sandbox's control socket, used to start commands without a
//! `runsc exec` process.
//!
//! `runsc exec` is a ~30 ms round trip here: a new runsc process (Go runtime start-up, state
//! loading) that makes two calls on the sandbox's control socket and waits. The calls
//! themselves cost ~5 ms, so the backend makes them directly.
//!
//! ## The protocol
//! The socket is the abstract Unix stream socket `@runsc-sandbox.<id>\0`. Abstract sockets
//! belong to a network namespace: for a sandbox in a namespace of its own (egress), the
//! connection is made from a short-lived thread that joined it (a socket keeps the namespace
//! it was made in). Each call uses its own connection:
//! 1. The request is one JSON object `{"method": ..., "arg": ...}`, sent with its file
//!    descriptors (SCM_RIGHTS) attached to its first bytes.
//! 2. The reply is one JSON object `{"success": bool, "err": string, "result": ...}`.
//!
//! Two methods are used:
//! - `containerManager.ExecuteAsync`: starts a process; the stdio files are the payload; the
//!   result is its pid inside the sandbox.
//! - `containerManager.WaitPID`: returns its raw wait status once it has exited.
//!
//! The argument fields are exactly those `runsc exec` of the runsc this backend drives sends,
//! read from its traffic. `Limits` is `null`, as `runsc exec` sends it, so a command gets the
//! same rlimits either way.
//!
//! This is runsc's internal interface, not a stable API. Any failure to *start* a command
//! this way (no such socket, an unknown method, a reply we do not understand) is reported as
//! [`CallError::Unavailable`], and the caller falls back to `runsc exec` for good. A command
//! that did start is never started twice.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

use serde_json::{json, Value};

/// Why a call failed.
#[derive(Debug)]
pub(crate) enum CallError {
    /// The interface is not there or not understood; `runsc exec` must be used instead.
    Unavailable(String),
    /// The sandbox refused the request (e.g. the executable does not exist).
    Remote(String),
    /// The connection failed mid-call (e.g. the sandbox died).
    Io(io::Error),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Unavailable(m) => write!(f, "control socket unavailable: {m}"),
            CallError::Remote(m) => write!(f, "{m}"),
            CallError::Io(e) => write!(f, "control socket: {e}"),
        }
    }
}

/// Connects to sandbox `id`'s control socket, in network namespace `netns` (ours if `None`).
fn connect(id: &str, netns: Option<&File>) -> Result<UnixStream, CallError> {
    let name = format!("runsc-sandbox.{id}\0");
    let addr = SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| CallError::Unavailable(format!("socket name: {e}")))?;
    let dial = || {
        UnixStream::connect_addr(&addr).map_err(|e| CallError::Unavailable(format!("connect: {e}")))
    };
    let Some(ns) = netns else { return dial() };
    std::thread::scope(|sc| {
        sc.spawn(|| {
            // SAFETY: setns moves only this thread, which ends right after the connect.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(CallError::Unavailable(format!(
                    "join the sandbox's network namespace: {}",
                    io::Error::last_os_error()
                )));
            }
            dial()
        })
        .join()
        .unwrap_or_else(|_| Err(CallError::Unavailable("connect thread panicked".into())))
    })
}

/// Connects and sends `method(arg)` with `fds`; the reply is still to be read.
fn send_request(
    id: &str,
    netns: Option<&File>,
    method: &str,
    arg: Value,
    fds: &[RawFd],
) -> Result<UnixStream, CallError> {
    let s = connect(id, netns)?;
    let body = serde_json::to_vec(&json!({ "method": method, "arg": arg }))
        .map_err(|e| CallError::Unavailable(e.to_string()))?;
    let iov = [io::IoSlice::new(&body)];
    let cmsg = [nix::sys::socket::ControlMessage::ScmRights(fds)];
    let cm: &[nix::sys::socket::ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    let mut sent = nix::sys::socket::sendmsg::<()>(
        s.as_raw_fd(),
        &iov,
        cm,
        nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(|e| CallError::Io(e.into()))?;
    while sent < body.len() {
        let n = nix::sys::socket::send(
            s.as_raw_fd(),
            &body[sent..],
            nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
        )
        .map_err(|e| CallError::Io(e.into()))?;
        sent += n;
    }
    Ok(s)
}

/// Adds `chunk` to `buf`; the reply once `buf` holds a whole JSON object.
fn take_reply(buf: &mut Vec<u8>, chunk: &[u8]) -> Result<Option<Value>, CallError> {
    if chunk.is_empty() {
        return Err(CallError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the sandbox closed its control socket before replying",
        )));
    }
    buf.extend_from_slice(chunk);
    match serde_json::Deserializer::from_slice(buf)
        .into_iter::<Value>()
        .next()
    {
        Some(Ok(v)) => Ok(Some(v)),
        Some(Err(e)) if e.is_eof() => Ok(None),
        Some(Err(e)) => Err(CallError::Unavailable(format!("reply: {e}"))),
        None => Ok(None),
    }
}

/// One call, blocking: sends `method(arg)` with `fds`, returns the `result`. `timeout`
/// bounds the wait for the reply.
fn call(
    id: &str,
    netns: Option<&File>,
    method: &str,
    arg: Value,
    fds: &[RawFd],
    timeout: Duration,
) -> Result<Value, CallError> {
    let mut s = send_request(id, netns, method, arg, fds)?;
    s.set_read_timeout(Some(timeout)).map_err(CallError::Io)?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 4096];
    let reply = loop {
        let n = s.read(&mut chunk).map_err(CallError::Io)?;
        if let Some(v) = take_reply(&mut buf, &chunk[..n])? {
            break v;
        }
    };
    result_of(method, reply)
}

/// The same call, waiting for the reply without holding a thread.
async fn call_async(
    id: &str,
    netns: Option<&File>,
    method: &str,
    arg: Value,
) -> Result<Value, CallError> {
    use tokio::io::AsyncReadExt;
    let s = send_request(id, netns, method, arg, &[])?;
    s.set_nonblocking(true).map_err(CallError::Io)?;
    let mut s = tokio::net::UnixStream::from_std(s).map_err(CallError::Io)?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 4096];
    let reply = loop {
        let n = s.read(&mut chunk).await.map_err(CallError::Io)?;
        if let Some(v) = take_reply(&mut buf, &chunk[..n])? {
            break v;
        }
    };
    result_of(method, reply)
}

/// The `result` of a reply, or why there is none.
fn result_of(method: &str, reply: Value) -> Result<Value, CallError> {
    if reply["success"] == Value::Bool(true) {
        return Ok(reply["result"].clone());
    }
    let err = reply["err"].as_str().unwrap_or("").to_string();
    // urpc reports errors as text only; "unknown method" is how it says a method does not
    // exist in this runsc version (no code or field says so).
    if err.is_empty() || err.contains("unknown method") {
        return Err(CallError::Unavailable(format!("{method}: {reply}")));
    }
    Err(CallError::Remote(err))
}

/// What to start.
pub(crate) struct Exec<'a> {
    pub argv: &'a [String],
    pub env: &'a [String],
    pub cwd: &'a str,
    pub uid: u32,
    pub gid: u32,
    /// stdin, stdout, stderr.
    pub stdio: [RawFd; 3],
}

/// Starts a process in container `id` (no capabilities at all); returns its pid there.
pub(crate) fn execute(id: &str, netns: Option<&File>, x: &Exec<'_>) -> Result<i32, CallError> {
    let none = json!({
        "PermittedCaps": 0, "InheritableCaps": 0, "EffectiveCaps": 0,
        "BoundingCaps": 0, "AmbientCaps": 0,
    });
    let arg = json!({
        "filename": "",
        "argv": x.argv,
        "envv": x.env,
        "MountNamespace": null,
        "wd": x.cwd,
        "KUID": x.uid,
        "KGID": x.gid,
        "ExtraKGIDs": [],
        "Capabilities": none,
        "StdioIsPty": false,
        "ContainerID": id,
        "PIDNamespace": null,
        "Limits": null,
    });
    let r = call(
        id,
        netns,
        "containerManager.ExecuteAsync",
        arg,
        &x.stdio,
        Duration::from_secs(30),
    )?;
    r.as_i64()
        .and_then(|p| i32::try_from(p).ok())
        .filter(|p| *p > 0)
        .ok_or_else(|| CallError::Unavailable(format!("ExecuteAsync result: {r}")))
}

/// Waits for process `pid` of container `id`; returns its raw wait status. Holds no
/// thread while the process runs.
pub(crate) async fn wait_pid(id: &str, netns: Option<&File>, pid: i32) -> Result<i32, CallError> {
    let r = call_async(
        id,
        netns,
        "containerManager.WaitPID",
        json!({ "PID": pid, "CID": id }),
    )
    .await?;
    r.as_i64()
        .and_then(|s| i32::try_from(s).ok())
        .ok_or_else(|| CallError::Io(io::Error::other(format!("WaitPID result: {r}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_sandbox_is_unavailable_not_an_error() {
        let e = wait_pid("no-such-sandbox-for-this-test", None, 1)
            .await
            .unwrap_err();
        assert!(matches!(e, CallError::Unavailable(_)), "{e}");
    }

    #[test]
    fn a_fake_server_sees_the_request_and_its_fds() {
        use std::io::Write;
        use std::os::unix::net::UnixListener;
        let id = format!("asb-test-{}", std::process::id());
        let addr =
            SocketAddr::from_abstract_name(format!("runsc-sandbox.{id}\0").as_bytes()).unwrap();
        let l = UnixListener::bind_addr(&addr).unwrap();
        let server = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut buf = vec![0u8; 4096];
            let mut fds = nix::cmsg_space!([RawFd; 3]);
            let mut iov = [io::IoSliceMut::new(&mut buf)];
            let m = nix::sys::socket::recvmsg::<()>(
                c.as_raw_fd(),
                &mut iov,
                Some(&mut fds),
                nix::sys::socket::MsgFlags::empty(),
            )
            .unwrap();
            let n_fds = m
                .cmsgs()
                .unwrap()
                .map(|c| match c {
                    nix::sys::socket::ControlMessageOwned::ScmRights(v) => v.len(),
                    _ => 0,
                })
                .sum::<usize>();
            let n = m.bytes;
            let req: Value = serde_json::from_slice(&buf[..n]).unwrap();
            // Reply in two pieces: the client must wait for the whole object.
            c.write_all(br#"{"success":true,"err":"","#).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            c.write_all(br#""result":42}"#).unwrap();
            (req, n_fds)
        });
        let (argv, env) = (vec!["/bin/true".to_string()], vec!["A=b".to_string()]);
        let pid = execute(
            &id,
            None,
            &Exec {
                argv: &argv,
                env: &env,
                cwd: "/workspace",
                uid: 1000,
                gid: 1000,
                stdio: [0, 1, 2],
            },
        )
        .unwrap();
        assert_eq!(pid, 42);
        let (req, n_fds) = server.join().unwrap();
        assert_eq!(n_fds, 3);
        assert_eq!(req["method"], "containerManager.ExecuteAsync");
        assert_eq!(req["arg"]["argv"][0], "/bin/true");
        assert_eq!(req["arg"]["KUID"], 1000);
        assert_eq!(req["arg"]["Capabilities"]["BoundingCaps"], 0);
        assert_eq!(req["arg"]["ContainerID"], id.as_str());
    }
}
