#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Adversarial tests: rebinding, exfiltration through lookups, address tricks, ECH, floods,
//! garbage. All traffic stays on loopback; the test dialer refuses anything else.

mod common;

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use common::*;
use sandbox_core::DecisionRule;
use sandbox_egress::dns::{build_query, parse_response, Rcode, TYPE_A};
use sandbox_egress::{
    AuditRule, EgressProxy, ListenOptions, ProxyConfig, Resolver, StreamMode, Via,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

/// Answers loopback the first time, then the metadata endpoint (DNS rebinding).
#[derive(Debug, Default)]
struct RebindingResolver {
    calls: AtomicUsize,
}

#[async_trait]
impl Resolver for RebindingResolver {
    async fn resolve(&self, _host: &str) -> io::Result<Vec<IpAddr>> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            Ok(vec![ip("127.0.0.1")])
        } else {
            Ok(vec![ip("169.254.169.254")])
        }
    }
}

#[tokio::test]
async fn dns_rebinding_between_lookup_and_connect_is_refused_without_dialing() {
    let dialer = Arc::new(GuardDialer::default());
    let proxy = EgressProxy::builder()
        .resolver(Arc::new(RebindingResolver::default()))
        .dialer(dialer.clone())
        .build();
    let reg = proxy
        .register_with(
            "sb",
            policy(&["rebind.test"]),
            ListenOptions::default().dns_port(Some(0)),
        )
        .await
        .unwrap();
    // the sandbox's lookup sees an allowed address...
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    sock.send_to(
        &build_query(1, "rebind.test", TYPE_A),
        reg.dns_addr.unwrap(),
    )
    .await
    .unwrap();
    let mut buf = [0u8; 512];
    let (n, _) = guard(sock.recv_from(&mut buf)).await.unwrap();
    assert_eq!(
        parse_response(&buf[..n]).unwrap(),
        (1, Rcode::NoError, vec![ip("127.0.0.1")])
    );
    // ...but the proxy resolves again at connect time and judges that answer.
    let (head, _) = connect(reg.proxy_addr, "rebind.test:80").await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert!(dialer.dials.lock().unwrap().is_empty());
    let last = proxy.audit("sb").unwrap().pop().unwrap();
    assert_eq!(last.ip, Some(ip("169.254.169.254")));
    assert_eq!(last.rule, AuditRule::Policy(DecisionRule::LinkLocal));
}

#[tokio::test]
async fn address_tricks_are_refused_without_lookup_or_dial() {
    let h = Harness::new();
    let reg = h
        .proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    for target in [
        "2130706433:80",
        "0x7f.0.0.1:80",
        "0177.0.0.1:80",
        "127.1:80",
        "[fe80::1%eth0]:80",
        "allowed.test%2eevil.test:443",
        "user@allowed.test:443",
        "allowed.test:99999",
        "allowed.test:0",
        "[::ffff:169.254.169.254]:80",
        "[::ffff:10.0.0.1]:80",
    ] {
        let (head, _) = connect(reg.proxy_addr, target).await;
        assert!(
            head.starts_with("HTTP/1.1 400") || head.starts_with("HTTP/1.1 403"),
            "{target}: {head}"
        );
    }
    assert!(h.dials().is_empty(), "{:?}", h.dials());
    assert!(h.lookups().is_empty(), "{:?}", h.lookups());
}

#[tokio::test]
async fn connect_through_refused_names_never_reaches_a_resolver() {
    let h = Harness::new();
    let reg = h
        .proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    for i in 0..20 {
        let (head, _) = connect(reg.proxy_addr, &format!("chunk{i}-c2VjcmV0.exfil.test:443")).await;
        assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    }
    assert!(h.lookups().is_empty(), "{:?}", h.lookups());
}

#[tokio::test]
async fn ech_client_hellos_are_refused() {
    let h = Harness::new();
    let port = echo_server().await;
    h.proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    let (mut c, server) = tokio::io::duplex(4096);
    let proxy = h.proxy.clone();
    let orig = SocketAddr::new(ip("127.0.0.1"), port);
    tokio::spawn(async move {
        let _ = proxy
            .serve_stream(
                "sb",
                server,
                StreamMode::Transparent {
                    original_dst: Some(orig),
                },
            )
            .await;
    });
    c.write_all(&client_hello("allowed.test", true))
        .await
        .unwrap();
    assert_eq!(read_all(&mut c).await, "");
    let last = h.proxy.audit("sb").unwrap().pop().unwrap();
    assert_eq!((last.allowed, last.rule), (false, AuditRule::EchRefused));
    assert!(h.dials().is_empty());

    // the same hello without ECH goes through (to the echo server, which echoes it)
    let (mut c, server) = tokio::io::duplex(4096);
    let proxy = h.proxy.clone();
    tokio::spawn(async move {
        let _ = proxy
            .serve_stream(
                "sb",
                server,
                StreamMode::Transparent {
                    original_dst: Some(orig),
                },
            )
            .await;
    });
    let hello = client_hello("allowed.test", false);
    c.write_all(&hello).await.unwrap();
    let mut back = vec![0u8; hello.len()];
    guard(c.read_exact(&mut back)).await.unwrap();
    assert_eq!(back, hello);
    assert_eq!(
        h.proxy.audit("sb").unwrap().pop().unwrap().via,
        Via::TransparentTls
    );
}

#[tokio::test]
async fn oversized_and_garbage_heads_are_refused() {
    let h = Harness::with_config(ProxyConfig::default().max_head_bytes(4096));
    let reg = h
        .proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    let mut s = TcpStream::connect(reg.proxy_addr).await.unwrap();
    let big = format!(
        "GET http://allowed.test/ HTTP/1.1\r\nX: {}\r\n",
        "a".repeat(8000)
    );
    let _ = s.write_all(big.as_bytes()).await;
    let resp = read_all(&mut s).await;
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp}");

    let mut rng = fastrand::Rng::with_seed(0x1234_5678_9abc_def1);
    for _ in 0..100 {
        let mut junk: Vec<u8> = (0..64).map(|_| rng.u8(..)).collect();
        junk.extend_from_slice(b"\r\n\r\n");
        let mut s = TcpStream::connect(reg.proxy_addr).await.unwrap();
        let _ = s.write_all(&junk).await;
        let resp = read_all(&mut s).await;
        assert!(resp.is_empty() || resp.starts_with("HTTP/1.1 4"), "{resp}");
    }
    assert!(h.dials().is_empty());
}

#[tokio::test]
async fn connection_cap_per_sandbox() {
    let h = Harness::with_config(ProxyConfig::default().max_connections_per_sandbox(2));
    let port = http_server().await;
    let reg = h
        .proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    let idle1 = TcpStream::connect(reg.proxy_addr).await.unwrap();
    let idle2 = TcpStream::connect(reg.proxy_addr).await.unwrap();
    let mut third = TcpStream::connect(reg.proxy_addr).await.unwrap();
    let _ = third
        .write_all(format!("GET http://allowed.test:{port}/ HTTP/1.1\r\n\r\n").as_bytes())
        .await;
    assert_eq!(
        read_all(&mut third).await,
        "",
        "third connection should be dropped"
    );
    drop((idle1, idle2));
    // slots come back once the idle connections are gone (eventually; bounded retries)
    let mut ok = false;
    for _ in 0..200 {
        let resp = proxy_request(
            reg.proxy_addr,
            &format!("GET http://allowed.test:{port}/ HTTP/1.1\r\n\r\n"),
        )
        .await;
        if resp.starts_with("HTTP/1.1 200") {
            ok = true;
            break;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(ok, "slots never came back");
}

#[tokio::test]
async fn audit_ring_is_bounded_and_keeps_denials() {
    let h = Harness::with_config(ProxyConfig::default().audit_capacity(4));
    let reg = h
        .proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    for i in 0..10 {
        let (head, _) = connect(reg.proxy_addr, &format!("n{i}.other.test:443")).await;
        assert!(head.starts_with("HTTP/1.1 403"));
    }
    let audit = h.proxy.audit("sb").unwrap();
    assert_eq!(audit.len(), 4);
    assert_eq!(h.proxy.audit_dropped("sb").unwrap(), 6);
    assert_eq!(audit[3].host.as_deref(), Some("n9.other.test"));
    assert!(audit.iter().all(|e| !e.allowed));
}

#[tokio::test]
async fn dns_garbage_and_floods() {
    let h = Harness::new();
    let reg = h
        .proxy
        .register_with(
            "sb",
            policy(&["allowed.test"]),
            ListenOptions::default().dns_port(Some(0)),
        )
        .await
        .unwrap();
    let dns = reg.dns_addr.unwrap();
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut rng = fastrand::Rng::with_seed(0xdead_beef_cafe_f00d);
    for _ in 0..300 {
        let mut q = build_query(3, "allowed.test", TYPE_A);
        let i = rng.usize(..q.len());
        q[i] ^= rng.u8(..) | 1;
        q[2] &= 0x7f; // keep it a query so we get an answer to wait for... or not
        sock.send_to(&q, dns).await.unwrap();
    }
    // the responder is still alive and correct
    sock.send_to(&build_query(999, "allowed.test", TYPE_A), dns)
        .await
        .unwrap();
    let mut buf = [0u8; 1500];
    loop {
        let (n, _) = guard(sock.recv_from(&mut buf)).await.unwrap();
        if let Some((999, rcode, addrs)) = parse_response(&buf[..n]) {
            assert_eq!((rcode, addrs), (Rcode::NoError, vec![ip("127.0.0.1")]));
            break;
        }
    }
    assert!(h.dials().is_empty());
    assert!(
        h.lookups().iter().all(|n| n == "allowed.test"),
        "{:?}",
        h.lookups()
    );
}

#[tokio::test]
async fn allow_internet_still_refuses_link_local_and_unlisted_private() {
    let h = Harness::new();
    let port = echo_server().await;
    let p = sandbox_core::NetworkPolicy::AllowInternet {
        deny: vec!["other.test".parse().unwrap()],
        private: vec!["127.0.0.0/8".parse().unwrap()],
    };
    let reg = h.proxy.register("sb", p).await.unwrap();
    let (head, _) = connect(reg.proxy_addr, &format!("allowed.test:{port}")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    for (target, rule) in [
        ("meta.test:80", DecisionRule::LinkLocal),
        ("169.254.169.254:80", DecisionRule::LinkLocal),
        (
            "private.test:80",
            DecisionRule::PrivateRange("private 10.0.0.0/8".into()),
        ),
        ("other.test:80", DecisionRule::Denied("other.test".into())),
    ] {
        let (head, _) = connect(reg.proxy_addr, target).await;
        assert!(head.starts_with("HTTP/1.1 403"), "{target}: {head}");
        let last = h.proxy.audit("sb").unwrap().pop().unwrap();
        assert_eq!(last.rule, AuditRule::Policy(rule), "{target}");
    }
    assert_eq!(h.dials().len(), 1);
    assert!(!h.lookups().contains(&"other.test".to_string()));
}

#[tokio::test]
async fn many_sandboxes_register_and_unregister_cleanly() {
    let h = Harness::new();
    let mut regs = Vec::new();
    for i in 0..200 {
        let opts = ListenOptions::default()
            .transparent_port(Some(0))
            .dns_port(Some(0));
        regs.push(
            h.proxy
                .register_with(&format!("sb{i}"), policy(&["allowed.test"]), opts)
                .await
                .unwrap(),
        );
    }
    assert_eq!(h.proxy.sandboxes().len(), 200);
    for r in &regs {
        h.proxy.unregister(&r.sandbox_id).await.unwrap();
    }
    assert!(h.proxy.sandboxes().is_empty());
    // every port is free again: binding them all succeeds
    for r in &regs {
        std::net::TcpListener::bind(r.proxy_addr).unwrap();
        std::net::TcpListener::bind(r.transparent_addr.unwrap()).unwrap();
        std::net::UdpSocket::bind(r.dns_addr.unwrap()).unwrap();
    }
}
