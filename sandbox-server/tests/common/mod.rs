//! What the server's suites share: a real server on loopback (or a Unix socket) over the
//! test-only unisolated backend, driven by `curl`.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::sync::Arc;

use backend_unisolated::UnisolatedBackend;
use sandbox_server::{Listener, OneBackend, Server, ServerConfig, Token};

pub fn unisolated() -> Arc<OneBackend> {
    Arc::new(OneBackend(Arc::new(
        UnisolatedBackend::new_without_isolation(),
    )))
}

/// A running server: its base URL, token, a way to stop it, and the server.
pub struct Running {
    pub base: String,
    pub token: Token,
    pub stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
    pub server: Server,
}

pub async fn start(config: ServerConfig) -> Running {
    let server = Server::new(unisolated(), config);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    let token = Token::generate();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let s = server.clone();
    let t = token.clone();
    let task = tokio::spawn(async move {
        s.serve(Listener::Tcp(l, t), async {
            let _ = rx.await;
        })
        .await
    });
    Running {
        base,
        token,
        stop: Some(stop),
        task,
        server,
    }
}

/// `curl` (blocking, on a blocking thread): (HTTP status, body).
pub async fn curl(args: Vec<String>) -> (u16, String) {
    tokio::task::spawn_blocking(move || {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "30", "-w", "\n%{http_code}"])
            .args(&args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap();
        (code.trim().parse().unwrap(), body.to_string())
    })
    .await
    .unwrap()
}

impl Running {
    pub fn auth(&self) -> String {
        format!("Authorization: Bearer {}", self.token.reveal())
    }

    pub async fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let mut a = vec![
            "-X".to_string(),
            method.to_string(),
            "-H".to_string(),
            self.auth(),
        ];
        // A large body goes through a file: one argument may not pass 128 KiB.
        let file = tempfile::NamedTempFile::new().unwrap();
        if let Some(b) = body {
            std::fs::write(file.path(), b).unwrap();
            a.extend([
                "-H".into(),
                "Content-Type: application/json".into(),
                "--data-binary".into(),
                format!("@{}", file.path().display()),
            ]);
        }
        a.push(format!("{}{path}", self.base));
        curl(a).await
    }

    pub async fn json(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> (u16, serde_json::Value) {
        let (code, text) = self.call(method, path, body).await;
        let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
        (code, v)
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.await.unwrap().unwrap();
    }
}

pub fn kind(v: &serde_json::Value) -> &str {
    v["error"]["kind"].as_str().unwrap_or("(no error kind)")
}
