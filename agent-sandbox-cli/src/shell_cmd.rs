//! `agent-sandbox shell`: an interactive terminal in a fresh sandbox, like `docker run -it`.
//!
//! The sandbox's command (`/bin/sh` unless given) runs on a pseudo-terminal inside
//! (`ExecRequest::tty`). Our terminal goes to raw mode, so every key (Ctrl-C too) reaches
//! the sandbox's terminal, which turns it into signals for the job in its foreground; the
//! window size follows ours (`SIGWINCH`). Our terminal's settings are restored when the
//! shell ends, on an error, a panic, `SIGTERM` or `SIGHUP`; the exit code is the shell's.

use std::io::{Read, Write};
use std::process::ExitCode;
use std::sync::Mutex;

use agent_sandbox::{ExecEvent, ExecRequest, Language, Runtime, SandboxSpec, TierChoice};

use crate::args::TierArg;
use crate::{EXIT_SANDBOX_FAILED, EXIT_USAGE};

/// `agent-sandbox shell`.
#[derive(clap::Args, Debug)]
pub(crate) struct ShellArgs {
    /// The tier (container, gvisor, ...) or `auto`: the selector's choice for a shell.
    #[arg(long, value_name = "TIER", value_parser = crate::args::parse_tier, default_value = "auto")]
    tier: TierArg,
    /// Start from this OCI image (as `run --image`).
    #[arg(long, value_name = "REF", value_parser = crate::image_cmd::parse_reference)]
    image: Option<agent_sandbox::ImageRef>,
    /// Publish sandbox port SPORT on the host while the shell runs (as `run -p`). Repeatable.
    #[arg(long = "publish", short = 'p', value_name = "[[ADDR:]HPORT:]SPORT", value_parser = crate::args::parse_publish)]
    publish: Vec<(u16, std::net::SocketAddr)>,
    /// Set an environment variable inside. Repeatable.
    #[arg(long = "env", value_name = "K=V", value_parser = crate::args::parse_env)]
    env: Vec<(String, String)>,
    /// Memory limit, MiB.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(4..))]
    memory: Option<u64>,
    #[command(flatten)]
    remote: crate::serve_cmd::ServerArgs,
    /// The command (default `/bin/sh`), after `--`.
    #[arg(last = true, value_name = "CMD")]
    argv: Vec<String>,
}

/// Our terminal's settings before raw mode, restored by [`restore`] (once).
static SAVED: Mutex<Option<(i32, libc::termios)>> = Mutex::new(None);

/// Puts `fd`'s terminal in raw mode, keeping its settings for [`restore`].
fn raw_mode(fd: i32) -> std::io::Result<()> {
    // SAFETY: tcgetattr/tcsetattr on an fd we hold, with a zeroed termios filled by the call.
    unsafe {
        let mut t: libc::termios = std::mem::zeroed();
        if libc::tcgetattr(fd, &mut t) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if let Ok(mut s) = SAVED.lock() {
            *s = Some((fd, t));
        }
        let mut raw = t;
        libc::cfmakeraw(&mut raw);
        if libc::tcsetattr(fd, libc::TCSANOW, &raw) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Restores our terminal's settings, if raw mode changed them (idempotent).
fn restore() {
    let saved = SAVED.lock().ok().and_then(|mut s| s.take());
    if let Some((fd, t)) = saved {
        // SAFETY: tcsetattr with the settings tcgetattr gave for this fd.
        unsafe { libc::tcsetattr(fd, libc::TCSANOW, &t) };
    }
}

/// Restores the terminal when dropped: on every return path and on a panic's unwinding.
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        restore();
    }
}

/// Our window's size, if `fd` is a terminal.
fn window(fd: i32) -> Option<(u16, u16)> {
    // SAFETY: TIOCGWINSZ into a zeroed local.
    unsafe {
        let mut ws: libc::winsize = std::mem::zeroed();
        (libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) == 0 && ws.ws_row > 0 && ws.ws_col > 0)
            .then_some((ws.ws_row, ws.ws_col))
    }
}

pub(crate) async fn run(args: ShellArgs) -> ExitCode {
    let mut b = SandboxSpec::builder(Language::Shell);
    for (k, v) in &args.env {
        b = b.env(k, v);
    }
    if let Some(r) = &args.image {
        b = b.image(r.to_string());
    }
    if let Some(m) = args.memory {
        b = b.memory_mib(m);
    }
    // An interactive session lasts as long as the person wants: no per-command wall time.
    b = b.wall_time(std::time::Duration::from_secs(24 * 3600));
    let spec = match b.build() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("agent-sandbox: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let rt = if args.remote.server.is_some() {
        match crate::serve_cmd::remote_runtime(&args.remote).await {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("agent-sandbox: {e}");
                return ExitCode::from(EXIT_SANDBOX_FAILED);
            }
        }
    } else {
        match args.tier {
            TierArg::Auto => Runtime::builder().with_default_tiers(),
            TierArg::Tier(t) => Runtime::builder().with_tiers(&[t]),
        }
        .build()
    };
    let choice = match args.tier {
        TierArg::Auto => TierChoice::Auto(agent_sandbox::Question::new(Language::Shell)),
        TierArg::Tier(t) => TierChoice::Tier(t),
    };
    let sb = match rt.create(&spec, choice).await {
        Ok(sb) => sb,
        Err(e) => {
            eprintln!("agent-sandbox: {e}");
            return ExitCode::from(EXIT_SANDBOX_FAILED);
        }
    };
    let code = session(sb.as_ref(), &args).await;
    let _ = sb.destroy().await;
    code
}

async fn session(sb: &dyn agent_sandbox::Sandbox, args: &ShellArgs) -> ExitCode {
    for &(port, host) in &args.publish {
        match sb.publish(port, host).await {
            Ok(at) => eprintln!("agent-sandbox: sandbox port {port} published on {at}"),
            Err(e) => {
                eprintln!("agent-sandbox: {e}");
                return ExitCode::from(EXIT_SANDBOX_FAILED);
            }
        }
    }
    let (stdin_fd, stdout_fd) = (0, 1);
    let interactive = window(stdin_fd).is_some();
    let (rows, cols) = window(stdout_fd).or(window(stdin_fd)).unwrap_or((24, 80));
    let argv = if args.argv.is_empty() {
        vec!["/bin/sh".to_string()]
    } else {
        args.argv.clone()
    };
    let term = std::env::var("TERM").unwrap_or_else(|_| "xterm".into());
    let req = ExecRequest::argv(argv).tty(rows, cols).env("TERM", term);
    let mut p = match sb.spawn(req).await {
        Ok(p) => p,
        Err(e) => {
            eprintln!("agent-sandbox: {e}");
            return ExitCode::from(EXIT_SANDBOX_FAILED);
        }
    };
    let _restore = Restore;
    if interactive {
        if let Err(e) = raw_mode(stdin_fd) {
            eprintln!("agent-sandbox: cannot put the terminal in raw mode: {e}");
        }
    }
    // Keys: a thread reads our stdin (blocking) and hands chunks over.
    let (keys_tx, mut keys) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut input = std::io::stdin().lock();
        loop {
            match input.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if keys_tx.blocking_send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    let mut winch = signal(tokio::signal::unix::SignalKind::window_change());
    let mut term = signal(tokio::signal::unix::SignalKind::terminate());
    let mut hup = signal(tokio::signal::unix::SignalKind::hangup());
    let mut stdin_open = true;
    let mut out = std::io::stdout();
    loop {
        tokio::select! {
            ev = p.next() => match ev {
                Some(Ok(ExecEvent::Stdout(b) | ExecEvent::Stderr(b))) => {
                    let _ = out.write_all(&b);
                    let _ = out.flush();
                }
                Some(Ok(ExecEvent::Exit(r))) => {
                    let code = r.exit_code.unwrap_or(i32::from(EXIT_SANDBOX_FAILED));
                    return ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(EXIT_SANDBOX_FAILED));
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    restore();
                    eprintln!("\r\nagent-sandbox: {e}");
                    return ExitCode::from(EXIT_SANDBOX_FAILED);
                }
                None => return ExitCode::from(EXIT_SANDBOX_FAILED),
            },
            k = keys.recv(), if stdin_open => match k {
                Some(k) => {
                    if p.write_stdin(k).await.is_err() {
                        stdin_open = false;
                    }
                }
                // Our stdin ended (not a terminal): the shell gets end-of-file.
                None => {
                    stdin_open = false;
                    let _ = p.close_stdin().await;
                }
            },
            _ = recv(&mut winch) => {
                if let Some((r, c)) = window(stdout_fd).or(window(stdin_fd)) {
                    let _ = p.resize(r, c).await;
                }
            }
            _ = recv(&mut term) => return ExitCode::from(128 + 15),
            _ = recv(&mut hup) => return ExitCode::from(128 + 1),
        }
    }
}

fn signal(kind: tokio::signal::unix::SignalKind) -> Option<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(kind).ok()
}

async fn recv(s: &mut Option<tokio::signal::unix::Signal>) {
    match s {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}
