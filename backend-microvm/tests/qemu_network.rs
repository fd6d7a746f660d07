#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The microVM tier's network, guest side, on a real Linux kernel: [`GuestNetwork`] (what
//! the backend gives a sandbox with a policy other than deny-all: its own network namespace,
//! attached to the real egress enforcer, with a TAP bridged to the enforcer's link) hands its
//! TAP to QEMU, whose guest is Debian's kernel with our initramfs (Linux's own virtio-net
//! driver); the agent configures `eth0` from `agent.net=`. Then the policy is checked from
//! inside the guest, with busybox's `wget` and `nslookup`: an allowed host answers through
//! the proxy, a host outside the allowlist and the metadata address are refused, a direct
//! connection is intercepted and refused, DNS answers only allowed names, a policy update
//! takes effect on the next connection, the decisions show as events, and detaching removes
//! the link. Our own virtio-net device is tested against small guests in `tests/virtio_net.rs`
//! (this host's KVM cannot boot Linux; see `docs/microvm-network.md`).
//!
//! Traffic stays on this machine: the upstream server listens on loopback, the test resolver
//! maps the test names to 127.0.0.1 (and `meta.test` to 169.254.169.254), the test dialer
//! refuses every non-loopback address without sending anything. Needs root, `ip`, `nft` and
//! `qemu-system-x86_64` (scripts/test.sh installs them).

#[path = "common/egress.rs"]
mod egress;
#[path = "common/qemu.rs"]
mod qemu;

use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use backend_microvm::network::GuestNetwork;
use egress::*;
use qemu::*;
use sandbox_core::egress::EgressEnforcer;

/// QEMU's arguments for a virtio-net device on `net`'s TAP (handed over as fd 10) with the
/// MAC `net` gives the guest.
fn tap_args(net: &GuestNetwork) -> Vec<String> {
    let mac = backend_microvm::devices::virtio::net::format_mac(&net.device().mac);
    vec![
        "-netdev".into(),
        "tap,id=n0,fd=10".into(),
        "-device".into(),
        format!("virtio-net-device,netdev=n0,mac={mac}"),
    ]
}

/// Why these tests cannot run here (no QEMU, not root), if they cannot.
fn missing() -> Option<String> {
    if let Some(why) = qemu_missing() {
        return Some(why);
    }
    // SAFETY: geteuid has no preconditions.
    (unsafe { libc::geteuid() } != 0).then(|| "the egress enforcer needs root".to_string())
}

/// A runtime for the enforcer and the upstream server on loopback (its port); `None`,
/// saying why, where the tests cannot run.
fn runtime_and_server() -> Option<(tokio::runtime::Runtime, u16)> {
    if let Some(why) = missing() {
        eprintln!("SKIP: {why}");
        return None;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let port = rt.block_on(http_server());
    Some((rt, port))
}

/// What the guest says of its `eth0` and its `/etc/resolv.conf`.
fn eth0_and_resolver(c: &backend_microvm::agent_client::AgentClient) -> String {
    let (code, out, err) = exec(
        c,
        &[
            "sh",
            "-c",
            "ip -4 addr show eth0 2>/dev/null || ifconfig eth0; cat /etc/resolv.conf",
        ],
        &[],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    out
}

#[test]
fn the_egress_enforcer_polices_a_linux_guest_on_its_tap() {
    let Some((rt, port)) = runtime_and_server() else {
        return;
    };
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let veth = enforcer();
    let enforcer: Arc<dyn EgressEnforcer> = Arc::new(veth.clone());
    let id = format!("qemu-net-{}", std::process::id());
    let mut net = rt
        .block_on(GuestNetwork::attach(
            Arc::clone(&enforcer),
            &id,
            &allow(&["allowed.test"]),
        ))
        .unwrap();
    let links_attached = rt.block_on(veth.links()).unwrap();
    assert_eq!(links_attached.len(), 1, "{links_attached:?}");
    let a = net.address();
    assert_eq!(
        net.agent_param(),
        format!("agent.net={}/{},{}", a.addr, a.prefix, a.gateway)
    );
    let dir = tempfile::tempdir().unwrap();
    let extra = Extra {
        append: net.agent_param(),
        args: tap_args(&net),
        tap: Some(net.tap().as_raw_fd()),
    };
    let (mut qemu, c) = boot(dir.path(), &extra);

    // The agent configured eth0 from agent.net= and named the gateway as the DNS server.
    let out = eth0_and_resolver(&c);
    assert!(out.contains(&a.addr.to_string()), "{out}");
    assert!(out.contains(&format!("nameserver {}", a.gateway)), "{out}");

    // The loopback interface is up (a server on localhost in the guest is reachable).
    let (code, out, err) = exec(&c, &["ping", "-c", "1", "-W", "5", "127.0.0.1"], &[]);
    assert_eq!(code, Some(0), "loopback: {out}{err}");

    // Every command gets the enforcer's proxy variables (the backend adds them to the env).
    let proxy_env = net.env().to_vec();
    let env: Vec<(&str, &str)> = proxy_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let wget = |url: &str, env: &[(&str, &str)]| {
        // `timeout`, not wget's `-T`: Debian 12's busybox wget crashes with that.
        exec(&c, &["timeout", "20", "wget", "-q", "-O", "-", url], env)
    };
    let allowed = format!("http://allowed.test:{port}/");
    let (code, out, err) = wget(&allowed, &env);
    assert_eq!(
        code,
        Some(0),
        "the allowed host through the proxy: {out}{err}"
    );
    assert_eq!(out, format!("hello allowed.test:{port}"));
    let other = format!("http://other.test:{port}/");
    let (code, out, err) = wget(&other, &env);
    assert_ne!(code, Some(0), "a host outside the allowlist: {out}{err}");
    let (code, out, err) = wget("http://169.254.169.254/latest/meta-data/", &env);
    assert_ne!(code, Some(0), "the metadata address: {out}{err}");
    // Without the proxy variables: TCP to any address is intercepted (transparently) and
    // judged by the same policy.
    let (code, out, err) = wget(&format!("http://10.201.0.9:{port}/"), &[]);
    assert_ne!(code, Some(0), "a direct connection: {out}{err}");
    // DNS through the gateway answers allowed names only.
    // IPv4 only (the test names have no AAAA), and a few tries: under a loaded emulator one
    // UDP answer can come after busybox gave up.
    let mut tries = Vec::new();
    for _ in 0..5 {
        let (_, out, err) = exec(&c, &["nslookup", "-type=a", "allowed.test"], &[]);
        let answered = out.contains("127.0.0.1");
        tries.push(format!("{out}{err}"));
        if answered {
            break;
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    assert!(
        tries.last().is_some_and(|t| t.contains("127.0.0.1")),
        "allowed name: {tries:?}"
    );
    let (_, out, _) = exec(&c, &["nslookup", "-type=a", "other.test"], &[]);
    assert!(
        !out.contains("127.0.0.1"),
        "a name outside the allowlist: {out}"
    );

    // The decisions, as the sandbox's caller reads them.
    let events = enforcer.events(&id).unwrap();
    let has = |host: Option<&str>, ip: Option<IpAddr>, allowed: bool| {
        events.iter().any(|e| {
            e.allowed == allowed
                && host.is_none_or(|h| e.host.as_deref() == Some(h))
                && ip.is_none_or(|i| e.ip == Some(i))
        })
    };
    assert!(has(Some("allowed.test"), None, true), "{events:#?}");
    assert!(has(Some("other.test"), None, false), "{events:#?}");
    assert!(has(None, Some(ip("10.201.0.9")), false), "{events:#?}");

    // A policy update holds from the next connection.
    enforcer
        .update(&id, &allow(&["allowed.test", "other.test"]))
        .unwrap();
    let (code, out, err) = wget(&other, &env);
    assert_eq!(code, Some(0), "after the update: {out}{err}");
    assert_eq!(out, format!("hello other.test:{port}"));

    // Detached (as destroy does): the link is gone, and with it the way out.
    rt.block_on(net.detach());
    assert!(rt.block_on(veth.links()).unwrap().is_empty());
    let (code, out, err) = wget(&allowed, &env);
    assert_ne!(code, Some(0), "after detach: {out}{err}");
    shut_down(&mut qemu, &c);
}

/// Proxy-held secrets, guest side, on a real Linux kernel: the test image (Debian 13, its own
/// Python) is the guest's root, its network is a [`GuestNetwork`] attached to the real
/// enforcer with a secret bound to `allowed.test` (`GuestNetwork::bind_secrets`, as the
/// backend does), and the agent puts the proxy's CA in the guest's bundles (`Trust`). Python's
/// `urllib` inside sends the placeholder it holds to an HTTPS server on loopback behind a
/// test CA the guest does not know: the server receives the real value, the guest only ever
/// holds the placeholder, and the echo comes back with the placeholder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_linux_guest_uses_a_proxy_held_secret_it_never_holds() {
    if let Some(why) = missing() {
        eprintln!("SKIP: {why}");
        return;
    }
    const VALUE: &str = "ghp_REALVALUEofTheToken0123456789abcdefgh";
    let dir = tempfile::tempdir().unwrap();
    let (disk, path) = match test_image_disk(dir.path()).await {
        Ok(d) => d,
        Err(why) => {
            eprintln!("SKIP: {why}");
            return;
        }
    };
    let upstream_ca =
        sandbox_egress::testing::TestCa::new("agent-sandbox test upstream CA").unwrap();
    let server = sandbox_egress::testing::EchoServer::start(&upstream_ca, &["allowed.test"])
        .await
        .unwrap();
    let veth = enforcer_trusting(&upstream_ca);
    let enforcer: Arc<dyn EgressEnforcer> = Arc::new(veth.clone());
    let spec = sandbox_core::SandboxSpec::builder(sandbox_core::Language::Shell)
        .network(allow(&["allowed.test"]))
        .secret_via_proxy("API_TOKEN", "API_TOKEN", ["allowed.test"])
        .build()
        .unwrap();
    let secrets = sandbox_core::ResolvedSecrets::resolve(
        &spec.secrets,
        &sandbox_core::MapSecretSource::new().with("API_TOKEN", VALUE),
    )
    .unwrap();
    let id = format!("qemu-secret-{}", std::process::id());
    let mut net = GuestNetwork::attach(Arc::clone(&enforcer), &id, &spec.network)
        .await
        .unwrap();
    let ca_pem = net.bind_secrets(&secrets.proxied()).unwrap();
    let mut args = disk_args(disk.path());
    args.extend(tap_args(&net));
    let extra = Extra {
        append: format!("agent.root=/dev/vda {}", net.agent_param()),
        args,
        tap: Some(net.tap().as_raw_fd()),
    };
    let (mut qemu, c) = tokio::task::block_in_place(|| boot(dir.path(), &extra));
    tokio::task::block_in_place(|| c.trust(&ca_pem, CALL)).unwrap();

    // Every command's environment, as the backend gives it: the image's PATH, the proxy
    // variables, the placeholder and the variables naming the bundle.
    let mut vars: Vec<(String, String)> = net.env().to_vec();
    vars.push(("PATH".into(), path));
    let env: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let placeholder = &vars.iter().find(|(k, _)| k == "API_TOKEN").unwrap().1;
    assert_eq!(placeholder.len(), VALUE.len());
    assert_ne!(placeholder, VALUE);
    assert!(
        vars.iter()
            .any(|(k, v)| k == "SSL_CERT_FILE" && v == "/etc/agent-sandbox-ca.crt"),
        "{vars:?}"
    );
    let port = server.port;
    let run =
        |code: String| tokio::task::block_in_place(|| exec(&c, &["python3", "-c", &code], &env));
    let (code, out, err) = run(format!(
        "import os, urllib.request as u\n\
         q = u.Request('https://allowed.test:{port}/qemu', \
         headers={{'Authorization': 'Bearer ' + os.environ['API_TOKEN']}})\n\
         print(u.urlopen(q, timeout=60).read().decode())"
    ));
    assert_eq!(code, Some(0), "{out}{err}");
    let got = server.heads().last().cloned().unwrap_or_default();
    assert!(got.contains("GET /qemu "), "{got}");
    assert!(got.contains(&format!("Bearer {VALUE}\r\n")), "{got}");
    // The echo came back with the placeholder (the proxy puts it back), never the value.
    assert!(out.contains(placeholder.as_str()), "{out}");
    assert!(!out.contains(VALUE), "{out}");
    // Programs that ignore the variables trust the system bundle, which holds the CA too.
    let (code, out, err) = run(format!(
        "import os, ssl, urllib.request as u\n\
         for v in ('SSL_CERT_FILE', 'REQUESTS_CA_BUNDLE'): os.environ.pop(v, None)\n\
         c = ssl.create_default_context(cafile='/etc/ssl/certs/ca-certificates.crt')\n\
         print(u.urlopen('https://allowed.test:{port}/system', timeout=60, context=c).status)"
    ));
    assert_eq!((code, out.as_str()), (Some(0), "200\n"), "{err}");
    // Nowhere inside: no process's environment, no file under /etc, /tmp or the workspace.
    let (code, out, err) = tokio::task::block_in_place(|| {
        exec(
            &c,
            &[
                "sh",
                "-c",
                &format!(
                    "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c -- '{VALUE}'; \
                     grep -rs -l -- '{VALUE}' /workspace /tmp /etc; echo done"
                ),
            ],
            &env,
        )
    });
    assert_eq!((code, out.as_str()), (Some(0), "0\ndone\n"), "{err}");
    net.detach().await;
    tokio::task::block_in_place(|| shut_down(&mut qemu, &c));
}

/// A guest restored from a snapshot onto a link of its own, guest side: the guest is booted
/// configured for one sandbox's network (`agent.net=` of the first [`GuestNetwork`], as the
/// snapshot's guest was) while its device is on the TAP of another (the copy's own link, as a
/// restore gives it). Nothing gets out until the agent's `Network` request moves `eth0` to
/// the new link's address, route and resolver; then the allowed host answers through the
/// proxy on that link. A malformed value is refused.
#[test]
fn a_guest_moved_to_another_link_reaches_the_proxy_there() {
    let Some((rt, port)) = runtime_and_server() else {
        return;
    };
    let enforcer: Arc<dyn EgressEnforcer> = Arc::new(enforcer());
    let policy = allow(&["allowed.test"]);
    let pid = std::process::id();
    let mut old = rt
        .block_on(GuestNetwork::attach(
            Arc::clone(&enforcer),
            &format!("qemu-old-{pid}"),
            &policy,
        ))
        .unwrap();
    let mut new = rt
        .block_on(GuestNetwork::attach(
            Arc::clone(&enforcer),
            &format!("qemu-new-{pid}"),
            &policy,
        ))
        .unwrap();
    assert_ne!(old.address().addr, new.address().addr);
    let dir = tempfile::tempdir().unwrap();
    let extra = Extra {
        append: old.agent_param(),
        args: tap_args(&new),
        tap: Some(new.tap().as_raw_fd()),
    };
    let (mut qemu, c) = boot(dir.path(), &extra);
    let vars = new.env().to_vec();
    let env: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let allowed = format!("http://allowed.test:{port}/");
    let wget = |secs: &str| {
        exec(
            &c,
            &["timeout", secs, "wget", "-q", "-O", "-", &allowed],
            &env,
        )
    };
    let (code, out, err) = wget("5");
    assert_ne!(
        code,
        Some(0),
        "still configured for the old link: {out}{err}"
    );

    let e = c.network("10.0.0.1/33,10.0.0.2", CALL).unwrap_err();
    assert!(e.to_string().contains("agent.net"), "{e}");
    c.network(&new.agent_net(), CALL).unwrap();
    let out = eth0_and_resolver(&c);
    let a = new.address();
    assert!(out.contains(&a.addr.to_string()), "{out}");
    assert!(!out.contains(&old.address().addr.to_string()), "{out}");
    assert!(out.contains(&format!("nameserver {}", a.gateway)), "{out}");
    let (code, out, err) = wget("20");
    assert_eq!(code, Some(0), "through the new link's proxy: {out}{err}");
    assert_eq!(out, format!("hello allowed.test:{port}"));
    rt.block_on(old.detach());
    rt.block_on(new.detach());
    shut_down(&mut qemu, &c);
}
