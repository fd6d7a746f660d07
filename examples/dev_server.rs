//! An agent starts a dev server in the background, publishes its port, checks a page from
//! the host, reads the server's log, then stops it: the container tier (tier 2), with the
//! default network policy (`DenyAll`): the port is reachable from the host, the sandbox
//! still cannot connect out.
//!
//! `cargo run -p agent-sandbox --example dev_server` (Linux, root or rootless with user
//! namespaces; see `agent-sandbox probe`).

use std::time::Duration;

use agent_sandbox::{
    ExecEvent, ExecRequest, Language, Runtime, SandboxSpec, Signal, Tier, TierChoice,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A small app: the page the agent is working on.
const PAGE: &str = "<h1>hello from the sandbox</h1>\n";

#[tokio::main]
async fn main() -> agent_sandbox::Result<()> {
    let rt = Runtime::new();
    let spec = SandboxSpec::builder(Language::Shell)
        .memory_mib(256)
        .build()?;
    let sb = match rt.create(&spec, TierChoice::Tier(Tier::Container)).await {
        Ok(sb) => sb,
        Err(e) => {
            eprintln!("cannot create a container sandbox here: {e}");
            eprintln!("(`cargo run -p agent-sandbox-cli -- probe` says why)");
            std::process::exit(2);
        }
    };
    sb.write_file("site/index.html", PAGE.as_bytes()).await?;

    // 1. The server, in the background: the call returns at once.
    let mut server = sb
        .spawn(ExecRequest::argv([
            "python3",
            "-u",
            "-m",
            "http.server",
            "8000",
            "--bind",
            "127.0.0.1",
            "--directory",
            "/workspace/site",
        ]))
        .await?;
    println!(
        "started process {} (python3 -m http.server 8000)",
        server.id()
    );

    // 2. Published on a port of the host's loopback that the OS picks.
    let at = sb.publish(8000, ([127, 0, 0, 1], 0).into()).await?;
    println!("published sandbox port 8000 on http://{at}/");

    // 3. The agent's check, from the host (a plain HTTP/1.0 GET; the server needs a moment
    //    to listen, so refused or empty answers are retried).
    let mut page = String::new();
    for _ in 0..100 {
        if let Ok(mut c) = tokio::net::TcpStream::connect(at).await {
            c.write_all(b"GET /index.html HTTP/1.0\r\n\r\n").await.ok();
            let mut buf = String::new();
            c.read_to_string(&mut buf).await.ok();
            if buf.starts_with("HTTP/1.0 200") {
                page = buf;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let body = page.split("\r\n\r\n").nth(1).unwrap_or_default();
    println!("GET /index.html -> {:?}", body.trim_end());
    assert_eq!(body, PAGE, "the page served from inside the sandbox");

    // 4. Other turns run beside it; the process list shows it.
    let r = sb
        .exec(ExecRequest::argv(["python3", "-c", "print(6 * 7)"]))
        .await?;
    println!("an exec beside it: {}", r.stdout_str().trim());
    for p in sb.processes().await? {
        println!("process {}: {} ({:?})", p.id, p.command, p.state);
    }

    // 5. Stop it and read its log (http.server logs each request on stderr).
    server.signal(Signal::Interrupt).await?;
    let mut log = Vec::new();
    while let Some(ev) = server.next().await {
        match ev? {
            ExecEvent::Stdout(b) | ExecEvent::Stderr(b) => log.extend_from_slice(&b),
            ExecEvent::Exit(r) => {
                println!("server exited with {:?}", r.exit_code);
                break;
            }
            _ => {}
        }
    }
    let log = String::from_utf8_lossy(&log);
    let request = log.lines().find(|l| l.contains("GET /index.html"));
    println!("server log: {}", request.unwrap_or("(no request logged)"));
    assert!(request.is_some(), "the server logged the request: {log}");
    sb.destroy().await
}
