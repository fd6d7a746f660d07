//! The published-port relay (`/etc/agent-sandbox/relay PORT` inside a gVisor sandbox): one
//! per connection from the host; also the keeper of background processes (`relay serve`,
//! `attach`, `session`: `keep.rs`). It connects to `PORT` on the sandbox's loopback (127.0.0.1,
//! then ::1), says how that went in one byte on stdout (`0`: connected; `1`, then a line:
//! refused, with the reason), then copies stdin to the connection and the connection to
//! stdout until both ends are done.
//!
//! Why a program inside: gVisor's network stack runs in its Sentry, not in the network
//! namespace, and this runsc has no port-forwarding call, so the only way in under a
//! deny-all policy is a process inside that connects for us. std only, compiled by the
//! crate's build script, statically linked where the C library allows (so an image's own
//! libc does not matter).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpStream};

mod keep;

/// Every signal's disposition back to its default and an empty signal mask, for a command's
/// child between `fork` and `execve`: not this program's ignored `SIGPIPE` (the Rust
/// runtime's), nor the caught `SIGINT` and `SIGQUIT` of `relay session`, nor anything else
/// the keeper inherited.
pub(crate) use sandbox_agent_proto::signals::reset_signals;

/// Copies this program's stdin to `up` on a thread of its own (then `input_done(up)`), and
/// `down` to its stdout, unbuffered, until `down` ends; returns the stdin thread.
fn copy_both<W: Write + Send + 'static>(
    mut up: W,
    down: &mut impl Read,
    input_done: fn(&mut W),
) -> std::thread::JoinHandle<()> {
    let t = std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = stdin.read(&mut buf) {
            if n == 0 || up.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        input_done(&mut up);
    });
    let mut stdout = std::io::stdout().lock();
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = down.read(&mut buf) {
        if n == 0
            || stdout
                .write_all(&buf[..n])
                .and_then(|()| stdout.flush())
                .is_err()
        {
            break;
        }
    }
    t
}

fn main() {
    // Background processes that survive a checkpoint (see `keep.rs`).
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some((mode, rest)) = args.split_first() {
        let code = match mode.as_str() {
            "serve" => Some(keep::serve(rest)),
            "attach" => Some(keep::attach(rest)),
            "session" => Some(keep::session(rest)),
            _ => None,
        };
        if let Some(code) = code {
            std::process::exit(code);
        }
    }
    let port = std::env::args().nth(1).and_then(|p| p.parse::<u16>().ok());
    let mut out = std::io::stdout().lock();
    let Some(port) = port else {
        let _ = out.write_all(b"1usage: relay PORT\n");
        std::process::exit(2);
    };
    let mut last = String::from("no address tried");
    let mut conn = None;
    for addr in [
        SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        SocketAddr::from((Ipv6Addr::LOCALHOST, port)),
    ] {
        match TcpStream::connect(addr) {
            Ok(s) => {
                conn = Some(s);
                break;
            }
            Err(e) => last = format!("{addr}: {e}"),
        }
    }
    let Some(conn) = conn else {
        let _ = out.write_all(format!("1{last}\n").as_bytes());
        std::process::exit(1);
    };
    let _ = conn.set_nodelay(true);
    if out.write_all(b"0").and_then(|()| out.flush()).is_err() {
        std::process::exit(1);
    }
    drop(out);
    let Ok(up) = conn.try_clone() else {
        std::process::exit(1);
    };
    // The host's bytes to the server (its end of input half-closes the connection), the
    // server's to the host.
    let mut down = conn;
    let t = copy_both(up, &mut down, |up| {
        let _ = up.shutdown(Shutdown::Write);
    });
    // The server has finished sending. Wait for the host's input only if it is already
    // done; otherwise end here (its reader thread with us): a server that closes its side
    // and goes on reading is rare, a client that holds its side open after the reply is not.
    if t.is_finished() {
        let _ = t.join();
    }
    let _ = down.shutdown(Shutdown::Both);
    std::process::exit(0);
}
