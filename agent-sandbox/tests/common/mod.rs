//! Shared parts of the tests of proxy-held secrets: a test PKI, HTTPS servers on loopback
//! (an echo, a real `git http-backend` behind Basic auth, a PEP 503 package index behind
//! Basic auth), the egress enforcer that reaches only loopback, and a host-side scan of a
//! sandbox's processes' memory.
//!
//! Traffic stays on this machine: the resolver maps the test names to 127.0.0.1 and the
//! dialer refuses every other address.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::collections::BTreeSet;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use base64::Engine as _;
use sandbox_egress::{
    Dialer, ProxyConfig, StaticResolver, TcpDialer, UpstreamStream, VethEnforcer,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::rustls::pki_types::CertificateDer;

/// Dials loopback only.
#[derive(Debug, Default)]
pub struct GuardDialer;

#[async_trait]
impl Dialer for GuardDialer {
    async fn dial(&self, addr: SocketAddr) -> io::Result<Box<dyn UpstreamStream>> {
        if !addr.ip().is_loopback() {
            return Err(io::Error::other(format!("test dialer refuses {addr}")));
        }
        TcpDialer.dial(addr).await
    }
}

/// A fresh test CA and a TLS acceptor for `names` under it.
pub struct TestPki {
    pub ca: CertificateDer<'static>,
    pub acceptor: tokio_rustls::TlsAcceptor,
}

impl TestPki {
    pub fn new(names: &[&str]) -> TestPki {
        let ca = sandbox_egress::testing::TestCa::new("agent-sandbox test upstream CA").unwrap();
        TestPki {
            ca: ca.der(),
            acceptor: tokio_rustls::TlsAcceptor::from(ca.server_config(names).unwrap()),
        }
    }
}

/// The real egress enforcer, trusting `upstream_ca` for the servers, with `names` resolving
/// to 127.0.0.1 and a dialer that reaches loopback only; `None` (after printing why) where it
/// cannot run here: the tests skip on its own word (it needs root for network namespaces).
pub fn enforcer(upstream_ca: CertificateDer<'static>, names: &[&str]) -> Option<VethEnforcer> {
    let mut r = StaticResolver::new();
    for n in names {
        r = r.with(n, &["127.0.0.1".parse().unwrap()]);
    }
    sandbox_egress::testing::enforcer_or_skip(
        VethEnforcer::builder()
            .config(ProxyConfig::default().upstream_roots(vec![upstream_ca]))
            .resolver(Arc::new(r))
            .dialer(Arc::new(GuardDialer))
            .build(),
    )
}

/// One HTTP/1.1 request as a server received it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// Path and query.
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The request line and headers as received.
    pub head: String,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `Authorization: Basic` credentials, decoded.
    pub fn basic_auth(&self) -> Option<(String, String)> {
        let v = self.header("authorization")?;
        let b64 = v.strip_prefix("Basic ")?;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .ok()?;
        let s = String::from_utf8(raw).ok()?;
        let (u, p) = s.split_once(':')?;
        Some((u.to_string(), p.to_string()))
    }

    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }

    pub fn query(&self) -> &str {
        self.target.split_once('?').map(|(_, q)| q).unwrap_or("")
    }
}

/// What a handler answers.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn new(status: u16, content_type: &str, body: impl Into<Vec<u8>>) -> Response {
        Response {
            status,
            headers: vec![("Content-Type".into(), content_type.into())],
            body: body.into(),
        }
    }

    pub fn with_header(mut self, k: &str, v: &str) -> Response {
        self.headers.push((k.into(), v.into()));
        self
    }

    /// 401 asking for Basic credentials.
    pub fn unauthorized() -> Response {
        Response::new(401, "text/plain", "credentials required\n")
            .with_header("WWW-Authenticate", "Basic realm=\"agent-sandbox test\"")
    }
}

pub type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// A running HTTPS (or plain HTTP) server on 127.0.0.1 and every request it received.
pub struct Server {
    pub port: u16,
    pub requests: Arc<Mutex<Vec<Request>>>,
}

impl Server {
    pub fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }
}

/// Serves `handler` on a loopback port: over TLS with `acceptor`, else plain HTTP.
/// Connections are kept alive; handlers run on blocking threads (a CGI program is fine).
pub async fn serve(acceptor: Option<tokio_rustls::TlsAcceptor>, handler: Handler) -> Server {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let got = requests.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let (acceptor, got, handler) = (acceptor.clone(), got.clone(), handler.clone());
            tokio::spawn(async move {
                match acceptor {
                    Some(a) => {
                        if let Ok(t) = a.accept(s).await {
                            connection(t, got, handler).await;
                        }
                    }
                    None => connection(s, got, handler).await,
                }
            });
        }
    });
    Server { port, requests }
}

async fn connection<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    got: Arc<Mutex<Vec<Request>>>,
    handler: Handler,
) {
    let mut buf = Vec::new();
    loop {
        let Some(req) = read_request(&mut s, &mut buf).await else {
            return;
        };
        got.lock().unwrap().push(req.clone());
        let close = req
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"));
        let h = handler.clone();
        let resp = tokio::task::spawn_blocking(move || h(&req)).await.unwrap();
        let mut out = format!("HTTP/1.1 {} X\r\n", resp.status);
        for (k, v) in &resp.headers {
            out.push_str(&format!("{k}: {v}\r\n"));
        }
        out.push_str(&format!("Content-Length: {}\r\n\r\n", resp.body.len()));
        let mut bytes = out.into_bytes();
        bytes.extend_from_slice(&resp.body);
        if s.write_all(&bytes).await.is_err() || s.flush().await.is_err() || close {
            let _ = s.shutdown().await;
            return;
        }
    }
}

/// Reads more into `buf`; false at the end of the stream.
async fn fill<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> bool {
    let mut c = [0u8; 16 << 10];
    match s.read(&mut c).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&c[..n]);
            true
        }
    }
}

async fn read_request<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> Option<Request> {
    let end = loop {
        if let Some(i) = memchr::memmem::find(buf, b"\r\n\r\n") {
            break i + 4;
        }
        if !fill(s, buf).await {
            return None;
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    buf.drain(..end);
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let method = first.next()?.to_string();
    let target = first.next()?.to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let line_end = loop {
                if let Some(i) = memchr::memmem::find(buf, b"\r\n") {
                    break i;
                }
                if !fill(s, buf).await {
                    return None;
                }
            };
            let size_s = String::from_utf8_lossy(&buf[..line_end]).into_owned();
            let size = usize::from_str_radix(size_s.split(';').next()?.trim(), 16).ok()?;
            buf.drain(..line_end + 2);
            while buf.len() < size + 2 {
                if !fill(s, buf).await {
                    return None;
                }
            }
            body.extend_from_slice(&buf[..size]);
            buf.drain(..size + 2);
            if size == 0 {
                break;
            }
        }
    } else if let Some(n) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while buf.len() < n {
            if !fill(s, buf).await {
                return None;
            }
        }
        body = buf.drain(..n).collect();
    }
    Some(Request {
        method,
        target,
        headers,
        body,
        head,
    })
}

/// Answers every request with the head it received.
pub fn echo() -> Handler {
    Arc::new(|r: &Request| Response::new(200, "text/plain", r.head.clone()))
}

/// A bare repository under `root` (`<root>/repo.git`) with one commit holding `README`.
pub fn git_repo(root: &Path) -> PathBuf {
    let work = root.join("work");
    let bare = root.join("repo.git");
    let git = |args: &[&str], dir: &Path| {
        let out = std::process::Command::new("git")
            .args(["-c", "user.email=t@example.invalid", "-c", "user.name=t"])
            .args(["-c", "init.defaultBranch=main"])
            .args(args)
            .current_dir(dir)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("HOME", root)
            .output()
            .unwrap();
        assert!(out.status.success(), "git {args:?}: {out:?}");
    };
    std::fs::create_dir_all(&work).unwrap();
    git(&["init", "-q"], &work);
    std::fs::write(work.join("README"), "served by git http-backend\n").unwrap();
    git(&["add", "README"], &work);
    git(&["commit", "-q", "-m", "first"], &work);
    git(
        &["clone", "-q", "--bare", work.to_str().unwrap(), "repo.git"],
        root,
    );
    bare
}

/// `git http-backend` (CGI) serving the repositories under `project_root`, only to Basic
/// credentials `user`:`password` (401 otherwise). Every response carries the password it
/// accepted in `X-Echo-Token` (for the masking check).
pub fn git_http_backend(project_root: PathBuf, user: &str, password: &str) -> Handler {
    let (user, password) = (user.to_string(), password.to_string());
    Arc::new(move |r: &Request| {
        match r.basic_auth() {
            Some((u, p)) if u == user && p == password => {}
            _ => return Response::unauthorized(),
        }
        let mut cmd = std::process::Command::new("/usr/lib/git-core/git-http-backend");
        cmd.env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("HOME", &project_root)
            .env("GIT_PROJECT_ROOT", &project_root)
            .env("GIT_HTTP_EXPORT_ALL", "1")
            .env("GATEWAY_INTERFACE", "CGI/1.1")
            .env("SERVER_PROTOCOL", "HTTP/1.1")
            .env("REQUEST_METHOD", &r.method)
            .env("PATH_INFO", r.path())
            .env("QUERY_STRING", r.query())
            .env("REMOTE_USER", &user)
            .env("REMOTE_ADDR", "127.0.0.1")
            .env("CONTENT_LENGTH", r.body.len().to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for (h, var) in [
            ("content-type", "CONTENT_TYPE"),
            ("content-encoding", "HTTP_CONTENT_ENCODING"),
            ("git-protocol", "HTTP_GIT_PROTOCOL"),
        ] {
            if let Some(v) = r.header(h) {
                cmd.env(var, v);
            }
        }
        let mut child = cmd.spawn().unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let body = r.body.clone();
        let feeder = std::thread::spawn(move || {
            use std::io::Write;
            let _ = stdin.write_all(&body);
        });
        let out = child.wait_with_output().unwrap();
        feeder.join().unwrap();
        let Some(split) = memchr::memmem::find(&out.stdout, b"\r\n\r\n")
            .map(|i| (i, 4))
            .or_else(|| memchr::memmem::find(&out.stdout, b"\n\n").map(|i| (i, 2)))
        else {
            return Response::new(
                500,
                "text/plain",
                format!("git http-backend: {}", String::from_utf8_lossy(&out.stderr)),
            );
        };
        let head = String::from_utf8_lossy(&out.stdout[..split.0]).into_owned();
        let mut resp = Response {
            status: 200,
            headers: Vec::new(),
            body: out.stdout[split.0 + split.1..].to_vec(),
        };
        for line in head.lines() {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            let v = v.trim();
            if k.eq_ignore_ascii_case("status") {
                resp.status = v.split(' ').next().unwrap().parse().unwrap();
            } else {
                resp.headers.push((k.trim().to_string(), v.to_string()));
            }
        }
        resp.with_header("X-Echo-Token", &password)
    })
}

/// A wheel of the package `name` (a PEP 427 archive made by the host's Python), its file
/// name and bytes.
pub fn wheel(dir: &Path, name: &str, version: &str) -> (String, Vec<u8>) {
    let dist = name.replace('-', "_");
    let file = format!("{dist}-{version}-py3-none-any.whl");
    let script = format!(
        r#"
import base64, hashlib, zipfile, sys
files = {{
    "{dist}/__init__.py": "VALUE = 42\n",
    "{dist}-{version}.dist-info/METADATA": "Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
    "{dist}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}}
record = []
with zipfile.ZipFile(sys.argv[1], "w") as z:
    for n, t in files.items():
        z.writestr(n, t)
        h = base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{{n}},sha256={{h}},{{len(t.encode())}}")
    record.append("{dist}-{version}.dist-info/RECORD,,")
    z.writestr("{dist}-{version}.dist-info/RECORD", "\n".join(record) + "\n")
"#
    );
    let path = dir.join(&file);
    let out = std::process::Command::new("/usr/bin/python3")
        .args(["-c", &script])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "making the wheel: {out:?}");
    (file, std::fs::read(&path).unwrap())
}

/// A PEP 503 simple index serving one wheel of `project`, only to Basic credentials
/// `user`:`password` (401 otherwise). The project page echoes the password it accepted in
/// the wheel link's query (`?echo=...`, for the masking check: pip logs the link and asks
/// for it, so the placeholder comes back through the proxy and the value reaches the
/// server again).
pub fn package_index(
    project: &str,
    wheel_name: String,
    wheel: Vec<u8>,
    user: &str,
    password: &str,
) -> Handler {
    use sha2::Digest;
    let sha = hex::encode(sha2::Sha256::digest(&wheel));
    let (project, user, password) = (project.to_string(), user.to_string(), password.to_string());
    Arc::new(move |r: &Request| {
        match r.basic_auth() {
            Some((u, p)) if u == user && p == password => {}
            _ => return Response::unauthorized(),
        }
        let html = |body: String| {
            Response::new(
                200,
                "text/html",
                format!("<!DOCTYPE html>\n<html><body>\n{body}</body></html>\n"),
            )
        };
        match r.path() {
            "/simple/" => html(format!("<a href=\"/simple/{project}/\">{project}</a>\n")),
            p if p == format!("/simple/{project}/") => html(format!(
                "<a href=\"/files/{wheel_name}?echo={password}#sha256={sha}\">{wheel_name}</a>\n"
            )),
            p if p == format!("/files/{wheel_name}") => {
                Response::new(200, "application/octet-stream", wheel.clone())
            }
            _ => Response::new(404, "text/plain", "not here\n"),
        }
    })
}

/// Host processes that belong to a sandbox: those whose command line names `tag` (its id
/// or state directory: runsc's sandbox and gofer processes; a tagged process of ours in a
/// container), the processes in the pid namespaces of those, and all their descendants.
pub fn sandbox_processes(tags: &[&str]) -> BTreeSet<i32> {
    let procs: Vec<(i32, i32, Vec<u8>, Option<PathBuf>)> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| *p != std::process::id() as i32)
        .filter_map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            let ppid = stat.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()?;
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).ok()?;
            let ns = std::fs::read_link(format!("/proc/{p}/ns/pid")).ok();
            Some((p, ppid, cmd, ns))
        })
        .collect();
    let mut set: BTreeSet<i32> = procs
        .iter()
        .filter(|(_, _, cmd, _)| {
            tags.iter()
                .any(|t| memchr::memmem::find(cmd, t.as_bytes()).is_some())
        })
        .map(|(p, ..)| *p)
        .collect();
    let host_ns = std::fs::read_link("/proc/self/ns/pid").ok();
    let nss: BTreeSet<PathBuf> = procs
        .iter()
        .filter(|(p, ..)| set.contains(p))
        .filter_map(|(_, _, _, ns)| ns.clone())
        .filter(|ns| Some(ns) != host_ns.as_ref())
        .collect();
    for (p, _, _, ns) in &procs {
        if ns.as_ref().is_some_and(|n| nss.contains(n)) {
            set.insert(*p);
        }
    }
    loop {
        let before = set.len();
        for (p, ppid, ..) in &procs {
            if set.contains(ppid) {
                set.insert(*p);
            }
        }
        if set.len() == before {
            return set;
        }
    }
}

/// What a scan of processes' memory saw.
#[derive(Debug, Default)]
pub struct MemoryScan {
    /// Bytes read.
    pub bytes: u64,
    /// `(pid, where)` of each needle's hits, per needle.
    pub hits: Vec<Vec<(i32, String)>>,
}

/// Reads, from the host, the memory of `pids`: every readable mapping through
/// `/proc/<pid>/mem` (per `/proc/<pid>/maps`), except shared memory files, which are read
/// whole through the process's file descriptors instead (gVisor keeps its sandboxed
/// processes' memory in one such file, `runsc-memory`; reading its holes through a mapping
/// would allocate them), and records where each of `needles` occurs.
pub fn scan_memory(pids: &BTreeSet<i32>, needles: &[&[u8]]) -> MemoryScan {
    let finders: Vec<memchr::memmem::Finder<'_>> =
        needles.iter().map(memchr::memmem::Finder::new).collect();
    let overlap = needles.iter().map(|n| n.len()).max().unwrap_or(1);
    let mut scan = MemoryScan {
        bytes: 0,
        hits: vec![Vec::new(); needles.len()],
    };
    let look = |pid: i32, place: &str, data: &[u8], scan: &mut MemoryScan| {
        for (i, f) in finders.iter().enumerate() {
            if let Some(at) = f.find(data) {
                let around = &data[at.saturating_sub(160)..(at + 160).min(data.len())];
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                scan.hits[i].push((
                    pid,
                    format!(
                        "{} ({place}): ...{}...",
                        String::from_utf8_lossy(&cmd).replace('\0', " "),
                        String::from_utf8_lossy(around).escape_debug()
                    ),
                ));
            }
        }
    };
    let mut seen_files = BTreeSet::new();
    for &pid in pids {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
            continue;
        };
        let Ok(mem) = std::fs::File::open(format!("/proc/{pid}/mem")) else {
            continue;
        };
        for line in maps.lines() {
            let mut f = line.split_whitespace();
            let (Some(range), Some(perms)) = (f.next(), f.next()) else {
                continue;
            };
            let name = line
                .splitn(6, char::is_whitespace)
                .nth(5)
                .unwrap_or("")
                .trim();
            if !perms.starts_with('r')
                || name.starts_with("/memfd:")
                || name.starts_with("/dev/")
                || name == "[vvar]"
                || name == "[vsyscall]"
            {
                continue;
            }
            let (a, b) = range.split_once('-').unwrap();
            let (a, b) = (
                u64::from_str_radix(a, 16).unwrap(),
                u64::from_str_radix(b, 16).unwrap(),
            );
            let mut off = a;
            let mut carry: Vec<u8> = Vec::new();
            while off < b {
                let n = (b - off).min(4 << 20) as usize;
                let mut chunk = vec![0u8; n];
                let Ok(got) = mem.read_at(&mut chunk, off) else {
                    break;
                };
                if got == 0 {
                    break;
                }
                chunk.truncate(got);
                scan.bytes += got as u64;
                carry.extend_from_slice(&chunk);
                look(pid, &format!("{line} @{off:x}"), &carry, &mut scan);
                let keep = carry.len().min(overlap);
                carry.drain(..carry.len() - keep);
                off += got as u64;
            }
        }
        // Shared memory files (memfd), read whole, once each.
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let t = target.to_string_lossy().into_owned();
            if !t.starts_with("/memfd:") {
                continue;
            }
            let Ok(file) = std::fs::File::open(fd.path()) else {
                continue;
            };
            // SAFETY: fstat on an fd we own into a zeroed stat buffer.
            let key = unsafe {
                use std::os::fd::AsRawFd;
                let mut st: libc::stat = std::mem::zeroed();
                if libc::fstat(file.as_raw_fd(), &mut st) != 0 {
                    continue;
                }
                (st.st_dev, st.st_ino)
            };
            if !seen_files.insert(key) {
                continue;
            }
            read_data_regions(&file, overlap, |off, data| {
                scan.bytes += data.len() as u64;
                look(pid, &format!("fd {t} @{off:x}"), data, &mut scan);
            });
        }
    }
    scan
}

/// Calls `f` on the data of `file` region by region (`SEEK_DATA`/`SEEK_HOLE`: holes are
/// never read), in chunks of up to 4 MiB, each with the last `overlap` bytes of the one
/// before it in front.
fn read_data_regions(file: &std::fs::File, overlap: usize, mut f: impl FnMut(u64, &[u8])) {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let Ok(len) = file.metadata().map(|m| m.len()) else {
        return;
    };
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: lseek on a valid fd has no memory effects.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            return;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return;
        }
        let mut carry: Vec<u8> = Vec::new();
        let mut off = data as u64;
        while off < hole as u64 {
            let n = (hole as u64 - off).min(4 << 20) as usize;
            let mut chunk = vec![0u8; n];
            let got = match file.read_at(&mut chunk, off) {
                Ok(0) | Err(_) => return,
                Ok(g) => g,
            };
            carry.extend_from_slice(&chunk[..got]);
            f(off, &carry);
            let keep = carry.len().min(overlap);
            carry.drain(..carry.len() - keep);
            off += got as u64;
        }
        pos = hole;
    }
}

/// The files under `dir` (not following links) that hold `needle`.
pub fn files_holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    let finder = memchr::memmem::Finder::new(needle);
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                todo.push(e.path());
            } else if ft.is_file() {
                if let Ok(b) = std::fs::read(e.path()) {
                    if finder.find(&b).is_some() {
                        out.push(e.path());
                    }
                }
            }
        }
    }
    out
}
