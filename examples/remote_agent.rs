//! An agent whose sandboxes live in `agent-sandbox serve`: the same `Runtime` and traits as
//! a local agent, with the server's tiers registered as its backends (`RemoteBackend`).
//!
//! ```sh
//! agent-sandbox serve &     # prints where its token is
//! AGENT_SANDBOX_SERVER=http://127.0.0.1:7878 \
//! AGENT_SANDBOX_TOKEN_FILE=$XDG_RUNTIME_DIR/agent-sandbox/token \
//!   cargo run -p agent-sandbox --features server,remote --example remote_agent
//! ```
//!
//! Without `AGENT_SANDBOX_SERVER` the example starts a server of its own on loopback (what
//! `serve` runs) and talks to it over HTTP, so it runs anywhere.

use std::sync::Arc;

use agent_sandbox::remote::{RemoteConfig, RemoteServer};
use agent_sandbox::server::{Listener, Server, ServerConfig, Token};
use agent_sandbox::{
    ExecRequest, Language, ObjectSnapshotStore, Question, Runtime, SandboxSpec, Signal, Tier,
    TierChoice,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The body of `GET path` at `at` (HTTP/1.0), retried while the server starts listening.
async fn fetch(at: std::net::SocketAddr, path: &str) -> String {
    for _ in 0..100 {
        if let Ok(mut c) = tokio::net::TcpStream::connect(at).await {
            let _ = c
                .write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
                .await;
            let mut answer = String::new();
            let _ = c.read_to_string(&mut answer).await;
            if answer.starts_with("HTTP/1.0 200") {
                return answer
                    .split_once("\r\n\r\n")
                    .map(|(_, body)| body.to_string())
                    .unwrap_or_default();
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    String::new()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The server: named by the environment, else one of our own on loopback.
    let _own;
    let config = match std::env::var("AGENT_SANDBOX_SERVER") {
        Ok(url) => {
            let config = RemoteConfig::new(&url)?;
            match std::env::var_os("AGENT_SANDBOX_TOKEN_FILE") {
                Some(f) => config.token_file(f)?,
                None => config,
            }
        }
        Err(_) => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let url = format!("http://{}", listener.local_addr()?);
            let token = Token::generate();
            // Its snapshots go to a directory of its own (`serve --state-dir`).
            let state =
                std::env::temp_dir().join(format!("remote-agent-server-{}", std::process::id()));
            let config = ServerConfig::default()
                .snapshot_store(Arc::new(ObjectSnapshotStore::local(&state)?));
            let server = Server::new(Arc::new(Runtime::new()), config);
            let t = token.clone();
            _own = tokio::spawn(async move {
                server
                    .serve(Listener::Tcp(listener, t), std::future::pending())
                    .await
            });
            println!("started a server at {url}");
            RemoteConfig::new(&url)?.token(token.reveal())
        }
    };
    let server = RemoteServer::connect(config.label("agent", "remote_agent")).await?;

    // A runtime whose backends are the server's tiers: the selector picks among them.
    let mut b = Runtime::builder();
    for backend in server.backends() {
        b = b.backend(Arc::new(backend));
    }
    let rt = b.build();
    let spec = SandboxSpec::new(Language::Python);
    let sandbox = match rt
        .create(&spec, TierChoice::Auto(Question::new(Language::Python)))
        .await
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("the server has no tier for Python here: {e}");
            return Ok(());
        }
    };
    println!(
        "sandbox {} on the server's {} tier",
        sandbox.id(),
        sandbox.tier()
    );

    // Turn 1 and 2 of an agent: files persist between turns.
    sandbox
        .write_file("data.csv", b"name,score\nada,9\nalan,7\n")
        .await?;
    let out = sandbox
        .exec(ExecRequest::code(
            "import csv\nrows = list(csv.DictReader(open('data.csv')))\n\
             open('mean.txt', 'w').write(str(sum(int(r['score']) for r in rows) / len(rows)))\n\
             print(len(rows), 'rows')",
        ))
        .await?;
    print!("turn 1: {}", out.stdout_str());
    let mean = sandbox.read_file("mean.txt").await?;
    println!("turn 2: mean score {}", String::from_utf8_lossy(&mean));

    // A snapshot into a store of our own, and a second sandbox from it.
    let dir = std::env::temp_dir().join(format!("remote-agent-{}", std::process::id()));
    let store = ObjectSnapshotStore::local(&dir)?;
    let id = sandbox.snapshot(&store).await?;
    let copy = rt.restore(&store, &id).await?;
    println!(
        "restored {} from snapshot {}: mean.txt = {}",
        copy.id(),
        &id.to_string()[..12],
        String::from_utf8_lossy(&copy.read_file("mean.txt").await?)
    );
    copy.destroy().await?;

    // A dev server on the server: a container sandbox (the tier with background processes
    // and ports), a web server in it, published on the server's loopback (the same host
    // here), a page fetched, then Ctrl-C.
    let spec = SandboxSpec::new(Language::Shell);
    match rt.create(&spec, TierChoice::Tier(Tier::Container)).await {
        Ok(dev) => {
            dev.write_file("index.html", b"<h1>served by the server's sandbox</h1>\n")
                .await?;
            let mut web = dev
                .spawn(ExecRequest::argv([
                    "python3",
                    "-m",
                    "http.server",
                    "8000",
                    "--bind",
                    "127.0.0.1",
                ]))
                .await?;
            let at = dev.publish(8000, ([127, 0, 0, 1], 0).into()).await?;
            let page = fetch(at, "/index.html").await;
            println!(
                "GET http://{at}/index.html (on the server's host) -> {:?}",
                page.trim_end()
            );
            assert!(page.contains("served by the server's sandbox"), "{page:?}");
            web.signal(Signal::Interrupt).await?;
            let r = web.wait(Some(std::time::Duration::from_secs(30))).await?;
            println!("the web server stopped with exit code {:?}", r.exit_code);
            dev.destroy().await?;
        }
        Err(e) => println!("(no container sandbox on this server, so no dev server: {e})"),
    }
    sandbox.destroy().await?;
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(
        std::env::temp_dir().join(format!("remote-agent-server-{}", std::process::id())),
    );
    Ok(())
}
