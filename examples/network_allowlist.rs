//! A coding agent that may fetch packages from PyPI and nothing else: an allowlist enforced
//! by the egress proxy, the metadata endpoint refused even so, every decision audited, and the
//! policy tightened while the sandbox runs.
//!
//! `cargo run -p agent-sandbox --example network_allowlist` (root: the container tier and
//! the egress enforcer create namespaces and veth links; this reaches pypi.org for real).

use agent_sandbox::{ExecRequest, Language, NetworkPolicy, Runtime, SandboxSpec, Tier, TierChoice};

/// What the agent runs: one request that should work, and two that must not.
const FETCH: &str = r#"
import os, socket, urllib.request
def get(url):
    try:
        with urllib.request.urlopen(url, timeout=20) as r:      # honours HTTPS_PROXY
            return "%d, %d bytes" % (r.status, len(r.read()))
    except Exception as e:
        return "refused: %s" % e
print("pypi      :", get("https://pypi.org/simple/six/"))
print("elsewhere :", get("https://example.com/"))
print("metadata  :", get("http://169.254.169.254/latest/meta-data/"))
# Code that ignores the proxy variables is captured too: it never gets a direct route.
s = socket.socket()
s.settimeout(5)
try:
    s.connect(("169.254.169.254", 80))
    s.sendall(b"GET /latest/meta-data/ HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n")
    print("raw socket:", (s.recv(100) or b"closed by the proxy").split(b"\r\n")[0])
except OSError as e:
    print("raw socket:", e)
"#;

#[tokio::main]
async fn main() -> agent_sandbox::Result<()> {
    let rt = Runtime::new();
    let policy = NetworkPolicy::allow_hosts(["pypi.org", "files.pythonhosted.org:443"])?;
    let spec = SandboxSpec::builder(Language::Python)
        .network(policy)
        .build()?;
    let sandbox = rt.create(&spec, TierChoice::Tier(Tier::Container)).await?;

    let out = sandbox.exec(ExecRequest::code(FETCH)).await?;
    print!("{}", out.stdout_str());
    eprint!("{}", out.stderr_str());

    // Every decision, allowed or not, is in the sandbox's audit log.
    println!("\naudit log:");
    for event in sandbox.network_events().await? {
        println!("  {event}");
    }

    // Tighten the policy while the sandbox runs: the next connection is refused.
    sandbox.set_network_policy(NetworkPolicy::DenyAll).await?;
    let out = sandbox
        .exec(ExecRequest::code(
            "import urllib.request\ntry:\n    urllib.request.urlopen('https://pypi.org/simple/six/', timeout=20)\nexcept Exception as e:\n    print('after DenyAll:', e)",
        ))
        .await?;
    print!("\n{}", out.stdout_str());
    sandbox.destroy().await
}
