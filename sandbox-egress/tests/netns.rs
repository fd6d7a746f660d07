#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The veth + nftables transport, end to end, between two network namespaces this test
//! creates (`ip netns add`) and deletes. Addresses 10.201.7.0/30 exist only inside them; the
//! proxy dials only loopback (the test dialer refuses anything else).

mod common;

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::Arc;

use common::*;
use sandbox_core::DecisionRule;
use sandbox_egress::dns::{build_query, parse_response, Rcode, TYPE_A};
use sandbox_egress::netns::{Netns, SoOriginalDst, VethConfig};
use sandbox_egress::{AuditRule, EgressProxy, Sockets, Via};
use tokio::io::AsyncWriteExt;

fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root to create network namespaces".into());
    }
    for tool in ["ip", "nft", "nsenter"] {
        let found = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {tool}"))
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !found {
            return Some(format!(
                "`{tool}` is not installed (apt-get install iproute2 nftables util-linux)"
            ));
        }
    }
    None
}

/// Deletes the namespaces even if the test panics.
struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// Runs `f` on a thread that joined namespace `name`: sockets it creates stay in that
/// namespace wherever they are used afterwards.
fn in_netns<T: Send + 'static>(name: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{name}");
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).unwrap();
        // SAFETY: `ns` is an open netns file; setns changes only this thread's namespace.
        let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap()
}

async fn connect_from(ns: &str, to: &str) -> tokio::net::TcpStream {
    let to: SocketAddr = to.parse().unwrap();
    let s = in_netns(ns, move || std::net::TcpStream::connect(to).unwrap());
    s.set_nonblocking(true).unwrap();
    tokio::net::TcpStream::from_std(s).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn veth_and_nftables_send_everything_to_the_proxy() {
    if let Some(why) = skip_reason() {
        eprintln!("SKIP: {why}");
        return;
    }
    let tag = std::process::id() % 100_000;
    let (hns, sns) = (format!("egt-h-{tag}"), format!("egt-s-{tag}"));
    let guard_ns = Namespaces(vec![hns.clone(), sns.clone()]);
    for n in &guard_ns.0 {
        let _ = Command::new("ip")
            .args(["netns", "del", n])
            .stderr(std::process::Stdio::null())
            .status();
        assert!(Command::new("ip")
            .args(["netns", "add", n])
            .status()
            .unwrap()
            .success());
    }
    let host = Netns::Named(hns.clone());
    let cfg = VethConfig {
        host_if: format!("egh{tag}"),
        sandbox_if: format!("egs{tag}"),
        host_ip: "10.201.7.1".parse().unwrap(),
        sandbox_ip: "10.201.7.2".parse().unwrap(),
        prefix: 30,
        proxy_port: 3128,
        transparent_port: Some(3129),
        dns_port: Some(5353),
    };
    cfg.setup(&host, &Netns::Named(sns.clone())).await.unwrap();

    // The proxy's sockets live in the host-side namespace, on the veth's host address.
    let (sockets, other_tcp, other_udp) = in_netns(&hns, || {
        (
            Sockets::new(
                std::net::TcpListener::bind("10.201.7.1:3128").unwrap(),
                Some(std::net::TcpListener::bind("10.201.7.1:3129").unwrap()),
                Some(std::net::UdpSocket::bind("10.201.7.1:5353").unwrap()),
            ),
            // services of the "host" the sandbox must not reach directly
            std::net::TcpListener::bind("10.201.7.1:2223").unwrap(),
            std::net::UdpSocket::bind("10.201.7.1:9999").unwrap(),
        )
    });
    other_tcp.set_nonblocking(true).unwrap();
    other_udp.set_nonblocking(true).unwrap();
    let dialer = Arc::new(GuardDialer::default());
    let proxy = EgressProxy::builder()
        .resolver(Arc::new(test_resolver()))
        .dialer(dialer.clone())
        .original_dst(Arc::new(SoOriginalDst))
        .build();
    proxy
        .register_with_sockets("sb", policy(&["allowed.test"]), sockets)
        .await
        .unwrap();
    let http_port = http_server().await;

    // 1. explicit proxy
    let mut s = connect_from(&sns, "10.201.7.1:3128").await;
    s.write_all(format!("GET http://allowed.test:{http_port}/e HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let resp = read_all(&mut s).await;
    assert!(resp.contains("path=/e"), "{resp}");

    // 2. transparent: a plain connection to some port is redirected; the Host decides and
    //    SO_ORIGINAL_DST supplies the port.
    let mut s = connect_from(&sns, &format!("10.201.7.1:{http_port}")).await;
    s.write_all(b"GET /t HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        .await
        .unwrap();
    let resp = read_all(&mut s).await;
    assert!(resp.contains("host=allowed.test path=/t"), "{resp}");
    let last = proxy.audit("sb").unwrap().pop().unwrap();
    assert_eq!(
        (last.via, last.port, last.allowed),
        (Via::TransparentHttp, http_port, true)
    );

    // 3. a direct connection to another service bypassing the proxy lands in the proxy and is
    //    refused by address (the original destination is read through the redirect)
    let mut s = connect_from(&sns, "10.201.7.1:2223").await;
    let _ = s.write_all(b"\x00raw").await;
    assert_eq!(read_all(&mut s).await, "");
    let last = proxy.audit("sb").unwrap().pop().unwrap();
    assert_eq!(last.via, Via::TransparentTcp);
    assert_eq!((last.ip, last.port), (Some(ip("10.201.7.1")), 2223));
    assert_eq!(
        last.rule,
        AuditRule::Policy(DecisionRule::PrivateRange("private 10.0.0.0/8".into()))
    );
    assert!(
        other_tcp.accept().is_err(),
        "the bypass reached the service"
    );

    // 4. DNS to port 53 reaches the responder; other UDP is dropped
    let udp = in_netns(&sns, || std::net::UdpSocket::bind("10.201.7.2:0").unwrap());
    udp.send_to(b"leak", "10.201.7.1:9999").ok();
    udp.set_nonblocking(true).unwrap();
    let udp = tokio::net::UdpSocket::from_std(udp).unwrap();
    udp.send_to(&build_query(42, "allowed.test", TYPE_A), "10.201.7.1:53")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let (n, _) = guard(udp.recv_from(&mut buf)).await.unwrap();
    assert_eq!(
        parse_response(&buf[..n]).unwrap(),
        (42, Rcode::NoError, vec![ip("127.0.0.1")])
    );
    let mut b = [0u8; 16];
    assert!(
        other_udp.recv_from(&mut b).is_err(),
        "UDP to another port got through"
    );

    // only loopback was dialed, twice
    assert_eq!(dialer.dials.lock().unwrap().len(), 2);

    // teardown leaves nothing behind
    proxy.unregister("sb").await.unwrap();
    cfg.teardown(&host).await;
    let link = Command::new("ip")
        .args(["-n", &hns, "link", "show", &cfg.host_if])
        .output()
        .unwrap();
    assert!(!link.status.success(), "veth still there");
    let table = Command::new("ip")
        .args([
            "netns",
            "exec",
            &hns,
            "nft",
            "list",
            "table",
            "inet",
            &cfg.host_table(),
        ])
        .output()
        .unwrap();
    assert!(!table.status.success(), "nft table still there");
    drop(guard_ns);
    let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(!list.contains(&hns) && !list.contains(&sns), "{list}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_veth_sandboxes_leave_nothing_behind() {
    if let Some(why) = skip_reason() {
        eprintln!("SKIP: {why}");
        return;
    }
    // 20 by default to keep CI short; EGRESS_NETNS_MANY=200 for the full issue check.
    let n: usize = std::env::var("EGRESS_NETNS_MANY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
        .min(250);
    let tag = std::process::id() % 100_000;
    let hns = format!("egm-h-{tag}");
    let mut names = vec![hns.clone()];
    names.extend((0..n).map(|i| format!("egm-s-{tag}-{i}")));
    let guard_ns = Namespaces(names.clone());
    for name in &names {
        assert!(Command::new("ip")
            .args(["netns", "add", name])
            .status()
            .unwrap()
            .success());
    }
    let host = Netns::Named(hns.clone());
    let proxy = EgressProxy::builder()
        .resolver(Arc::new(test_resolver()))
        .dialer(Arc::new(GuardDialer::default()))
        .original_dst(Arc::new(SoOriginalDst))
        .build();
    let mut cfgs = Vec::new();
    for i in 0..n {
        let i8 = u8::try_from(i).unwrap();
        let cfg = VethConfig {
            host_if: format!("egh{tag}x{i}"),
            sandbox_if: format!("egs{tag}x{i}"),
            host_ip: std::net::Ipv4Addr::new(10, 201, i8, 1),
            sandbox_ip: std::net::Ipv4Addr::new(10, 201, i8, 2),
            prefix: 30,
            proxy_port: 3128,
            transparent_port: Some(3129),
            dns_port: None,
        };
        cfg.setup(&host, &Netns::Named(names[i + 1].clone()))
            .await
            .unwrap();
        let ip = cfg.host_ip;
        let sockets = in_netns(&hns, move || {
            Sockets::new(
                std::net::TcpListener::bind((ip, 3128)).unwrap(),
                Some(std::net::TcpListener::bind((ip, 3129)).unwrap()),
                None,
            )
        });
        proxy
            .register_with_sockets(&format!("sb{i}"), policy(&["allowed.test"]), sockets)
            .await
            .unwrap();
        cfgs.push(cfg);
    }
    // each sandbox reaches its own proxy listener only
    let mut s = connect_from(&names[1], "10.201.0.1:3128").await;
    s.write_all(b"GET http://other.test/ HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    assert!(read_all(&mut s).await.starts_with("HTTP/1.1 403"));
    assert_eq!(proxy.audit("sb0").unwrap().len(), 1);

    for (i, cfg) in cfgs.iter().enumerate() {
        proxy.unregister(&format!("sb{i}")).await.unwrap();
        cfg.teardown(&host).await;
    }
    let links = Command::new("ip")
        .args(["-n", &hns, "-o", "link"])
        .output()
        .unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(!links.contains("egh"), "{links}");
    let tables = Command::new("ip")
        .args(["netns", "exec", &hns, "nft", "list", "tables"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&tables.stdout).trim(), "");
    drop(guard_ns);
    let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(!list.contains(&format!("-{tag}")), "{list}");
}
