#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Integration tests on loopback: explicit HTTP, CONNECT (real TLS with a test CA),
//! transparent sniffing, DNS responder, policy updates, audit, unregister.

mod common;

use std::net::SocketAddr;

use common::*;
use sandbox_core::{DecisionRule, NetworkPolicy};
use sandbox_egress::dns::{build_query, parse_response, Rcode, TYPE_A, TYPE_AAAA};
use sandbox_egress::{AuditRule, ListenOptions, StreamMode, Via};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

#[tokio::test]
async fn http_forward_to_an_allowed_name() {
    let h = Harness::new();
    let port = http_server().await;
    let reg = h
        .proxy
        .register("sb1", policy(&["allowed.test"]))
        .await
        .unwrap();
    let resp = proxy_request(
        reg.proxy_addr,
        &format!(
            "GET http://allowed.test:{port}/hello?x=1 HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: Basic eA==\r\n\r\n"
        ),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 200 OK"), "{resp}");
    assert!(
        resp.contains(&format!(
            "host=allowed.test:{port} path=/hello?x=1 proxyauth=false"
        )),
        "{resp}"
    );
    let audit = h.proxy.audit("sb1").unwrap();
    assert_eq!(audit.len(), 1);
    let e = &audit[0];
    assert!(e.allowed);
    assert_eq!(e.via, Via::Http);
    assert_eq!(e.host.as_deref(), Some("allowed.test"));
    assert_eq!(e.ip, Some(ip("127.0.0.1")));
    assert_eq!(e.port, port);
    assert_eq!(
        e.rule,
        AuditRule::Policy(DecisionRule::Host("allowed.test".into()))
    );
    assert_eq!(h.dials(), vec![SocketAddr::new(ip("127.0.0.1"), port)]);
}

#[tokio::test]
async fn http_forward_refuses_a_name_not_listed() {
    let h = Harness::new();
    let port = http_server().await;
    let reg = h
        .proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    let resp = proxy_request(
        reg.proxy_addr,
        &format!("GET http://other.test:{port}/ HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n"),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 403 Forbidden"), "{resp}");
    assert!(resp.contains("X-Agent-Sandbox-Egress: denied"), "{resp}");
    assert!(h.dials().is_empty());
    assert!(h.lookups().is_empty(), "a refused name is never resolved");
    let e = &h.proxy.audit("sb").unwrap()[0];
    assert!(!e.allowed);
    assert_eq!(e.rule, AuditRule::Policy(DecisionRule::NotListed));
    // a Host header that disagrees with the URI is refused, not routed by either
    let resp = proxy_request(
        reg.proxy_addr,
        &format!("GET http://allowed.test:{port}/ HTTP/1.1\r\nHost: other.test\r\n\r\n"),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(h.dials().is_empty());
}

#[tokio::test]
async fn connect_to_a_local_tls_server_with_a_test_ca() {
    let h = Harness::new();
    let srv = tls::server().await;
    let reg = h
        .proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    let (head, stream) = connect(reg.proxy_addr, &format!("allowed.test:{}", srv.port)).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let reply = tls::talk(&srv.connector, stream, "ping").await;
    assert_eq!(reply, "tls-ok:ping");
    let e = &h.proxy.audit("sb").unwrap()[0];
    assert!(e.allowed);
    assert_eq!(e.via, Via::Connect);
    assert_eq!(e.port, srv.port);
}

#[tokio::test]
async fn connect_refusals_never_dial() {
    let h = Harness::new();
    let reg = h
        .proxy
        .register(
            "sb",
            policy(&["allowed.test", "meta.test", "mixed.test", "private.test"]),
        )
        .await
        .unwrap();
    for (target, want) in [
        ("other.test:443", DecisionRule::NotListed),
        ("meta.test:80", DecisionRule::LinkLocal),
        ("mixed.test:80", DecisionRule::LinkLocal),
        (
            "private.test:80",
            DecisionRule::PrivateRange("private 10.0.0.0/8".into()),
        ),
        ("169.254.169.254:80", DecisionRule::LinkLocal),
        ("[fe80::1]:80", DecisionRule::LinkLocal),
        (
            "10.1.2.3:80",
            DecisionRule::PrivateRange("private 10.0.0.0/8".into()),
        ),
    ] {
        let (head, mut s) = connect(reg.proxy_addr, target).await;
        assert!(head.starts_with("HTTP/1.1 403"), "{target}: {head}");
        let rest = read_all(&mut s).await;
        assert!(rest.contains("refused"), "{rest}");
        let last = h.proxy.audit("sb").unwrap().pop().unwrap();
        assert!(!last.allowed, "{target}");
        assert_eq!(last.rule, AuditRule::Policy(want), "{target}");
    }
    assert!(h.dials().is_empty(), "the proxy dialed: {:?}", h.dials());
    // a malformed CONNECT target is refused too
    let (head, _) = connect(reg.proxy_addr, "allowed.test").await;
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    assert!(h.dials().is_empty());
}

#[tokio::test]
async fn policy_update_takes_effect_on_the_next_connection() {
    let h = Harness::new();
    let port = echo_server().await;
    let reg = h
        .proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    let (head, mut open_tunnel) = connect(reg.proxy_addr, &format!("allowed.test:{port}")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");

    h.proxy
        .update_policy("sb", policy(&["other.test"]))
        .unwrap();
    let (head, _) = connect(reg.proxy_addr, &format!("allowed.test:{port}")).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    let (head, _) = connect(reg.proxy_addr, &format!("other.test:{port}")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // the tunnel opened before the update is left alone
    open_tunnel.write_all(b"still-open").await.unwrap();
    let mut buf = [0u8; 10];
    guard(open_tunnel.read_exact(&mut buf)).await.unwrap();
    assert_eq!(&buf, b"still-open");

    h.proxy.update_policy("sb", NetworkPolicy::DenyAll).unwrap();
    let (head, _) = connect(reg.proxy_addr, &format!("other.test:{port}")).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    let verdicts: Vec<(Option<String>, bool)> = h
        .proxy
        .audit("sb")
        .unwrap()
        .into_iter()
        .map(|e| (e.host, e.allowed))
        .collect();
    let s = |n: &str| Some(n.to_string());
    assert_eq!(
        verdicts,
        vec![
            (s("allowed.test"), true),
            (s("allowed.test"), false),
            (s("other.test"), true),
            (s("other.test"), false)
        ]
    );
    // an invalid policy is refused and the old one stays
    let bad = NetworkPolicy::Allow {
        hosts: vec![],
        cidrs: vec!["169.254.0.0/16".parse().unwrap()],
        ports: vec![],
    };
    assert!(h.proxy.update_policy("sb", bad).is_err());
    assert_eq!(h.proxy.policy("sb").unwrap(), NetworkPolicy::DenyAll);
}

#[tokio::test]
async fn unregister_closes_listeners_and_tunnels() {
    let h = Harness::new();
    let port = echo_server().await;
    let reg = h
        .proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    let (head, mut tunnel) = connect(reg.proxy_addr, &format!("allowed.test:{port}")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    tunnel.write_all(b"x").await.unwrap();
    let mut b = [0u8; 1];
    guard(tunnel.read_exact(&mut b)).await.unwrap();

    let log = h.proxy.unregister("sb").await.unwrap();
    assert_eq!(log.len(), 1);
    // the open tunnel is closed by the proxy
    let mut rest = Vec::new();
    let _ = guard(tunnel.read_to_end(&mut rest)).await;
    assert!(rest.is_empty());
    // the listener is gone
    match TcpStream::connect(reg.proxy_addr).await {
        Err(_) => {}
        Ok(mut s) => assert_eq!(read_all(&mut s).await, "", "listener still serving"),
    }
    assert!(h.proxy.audit("sb").is_err());
    assert!(h.proxy.update_policy("sb", NetworkPolicy::DenyAll).is_err());
    assert!(h.proxy.unregister("sb").await.is_err());
    // the id can be registered again
    h.proxy.register("sb", policy(&[])).await.unwrap();
    assert!(
        h.proxy.register("sb", policy(&[])).await.is_err(),
        "duplicate id"
    );
}

#[tokio::test]
async fn each_sandbox_is_judged_by_its_own_policy() {
    let h = Harness::new();
    let port = echo_server().await;
    let mut regs = Vec::new();
    for i in 0..40 {
        let host = if i % 2 == 0 {
            "allowed.test"
        } else {
            "other.test"
        };
        regs.push(
            h.proxy
                .register(&format!("sb{i}"), policy(&[host]))
                .await
                .unwrap(),
        );
    }
    for (i, reg) in regs.iter().enumerate() {
        let (head, _) = connect(reg.proxy_addr, &format!("allowed.test:{port}")).await;
        assert_eq!(
            head.starts_with("HTTP/1.1 200"),
            i % 2 == 0,
            "sb{i}: {head}"
        );
        let audit = h.proxy.audit(&reg.sandbox_id).unwrap();
        assert_eq!(audit.len(), 1);
        assert_eq!(audit[0].sandbox_id, reg.sandbox_id);
    }
    for reg in &regs {
        h.proxy.unregister(&reg.sandbox_id).await.unwrap();
    }
    assert!(h.proxy.sandboxes().is_empty());
}

fn transparent(original_dst: Option<SocketAddr>) -> StreamMode {
    StreamMode::Transparent { original_dst }
}

/// Runs `serve_stream` on one end of an in-memory pipe; returns the other end.
fn piped(h: &Harness, id: &str, mode: StreamMode) -> tokio::io::DuplexStream {
    let (client, server) = tokio::io::duplex(64 * 1024);
    let proxy = h.proxy.clone();
    let id = id.to_string();
    tokio::spawn(async move {
        let _ = proxy.serve_stream(&id, server, mode).await;
    });
    client
}

#[tokio::test]
async fn transparent_tls_is_decided_by_sni_and_goes_to_the_resolved_name() {
    let h = Harness::new();
    let srv = tls::server().await;
    h.proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    // The sandbox dialed 127.0.0.9 (say, a stale address): the proxy connects to what
    // allowed.test resolves to, on the port the sandbox dialed.
    let orig = SocketAddr::new(ip("127.0.0.9"), srv.port);
    let client = piped(&h, "sb", transparent(Some(orig)));
    let reply = tls::talk(&srv.connector, client, "via-sni").await;
    assert_eq!(reply, "tls-ok:via-sni");
    let e = &h.proxy.audit("sb").unwrap()[0];
    assert_eq!((e.via, e.allowed), (Via::TransparentTls, true));
    assert_eq!(e.host.as_deref(), Some("allowed.test"));
    assert_eq!(h.dials(), vec![SocketAddr::new(ip("127.0.0.1"), srv.port)]);
}

#[tokio::test]
async fn transparent_listener_http_host_and_refusals() {
    let h = Harness::new();
    let port = http_server().await;
    let reg = h
        .proxy
        .register_with(
            "sb",
            policy(&["allowed.test"]),
            ListenOptions::default().transparent_port(Some(0)),
        )
        .await
        .unwrap();
    let t = reg.transparent_addr.unwrap();
    let resp = proxy_request(
        t,
        &format!("GET /t HTTP/1.1\r\nHost: allowed.test:{port}\r\n\r\n"),
    )
    .await;
    assert!(
        resp.contains(&format!("host=allowed.test:{port} path=/t")),
        "{resp}"
    );
    let resp = proxy_request(
        t,
        &format!("GET /t HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n"),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");
    // no Host, no SNI, and the original destination is unknown (NoOriginalDst): refused
    let mut s = TcpStream::connect(t).await.unwrap();
    s.write_all(b"\x00\x01binary").await.unwrap();
    assert_eq!(read_all(&mut s).await, "");
    let audit = h.proxy.audit("sb").unwrap();
    let last = audit.last().unwrap();
    assert!(!last.allowed);
    assert!(
        matches!(last.rule, AuditRule::Malformed(_)),
        "{:?}",
        last.rule
    );
    assert_eq!(h.dials().len(), 1);
}

#[tokio::test]
async fn transparent_opaque_tcp_is_decided_by_address_and_port() {
    let h = Harness::new();
    let port = echo_server().await;
    // only loopback listed, and only this port
    let p = NetworkPolicy::Allow {
        hosts: vec![],
        cidrs: vec!["127.0.0.0/8".parse().unwrap()],
        ports: vec![port],
    };
    h.proxy.register("sb", p).await.unwrap();
    let mut c = piped(
        &h,
        "sb",
        transparent(Some(SocketAddr::new(ip("127.0.0.1"), port))),
    );
    c.write_all(b"SSH-2.0-test\r\n").await.unwrap();
    let mut buf = [0u8; 14];
    guard(c.read_exact(&mut buf)).await.unwrap();
    assert_eq!(&buf, b"SSH-2.0-test\r\n");

    for (dst, rule) in [
        ("169.254.169.254:80", DecisionRule::LinkLocal),
        (
            "10.201.0.5:22",
            DecisionRule::PrivateRange("private 10.0.0.0/8".into()),
        ),
        (
            &*format!("127.0.0.1:{}", port.wrapping_add(1).max(1)),
            DecisionRule::Port(port.wrapping_add(1).max(1)),
        ),
    ] {
        let mut c = piped(&h, "sb", transparent(Some(dst.parse().unwrap())));
        c.write_all(b"\x00payload").await.unwrap();
        assert_eq!(read_all(&mut c).await, "", "{dst}");
        let last = h.proxy.audit("sb").unwrap().pop().unwrap();
        assert_eq!(
            (last.allowed, last.rule),
            (false, AuditRule::Policy(rule)),
            "{dst}"
        );
        assert_eq!(last.via, Via::TransparentTcp);
    }
    assert_eq!(h.dials(), vec![SocketAddr::new(ip("127.0.0.1"), port)]);
}

#[tokio::test]
async fn transparent_tls_refusals() {
    let h = Harness::new();
    let srv = tls::server().await;
    h.proxy
        .register("sb", policy(&["other.test", "meta.test"]))
        .await
        .unwrap();
    // SNI allowed.test is not listed (even though loopback is): refused, nothing dialed
    let c = piped(
        &h,
        "sb",
        transparent(Some(SocketAddr::new(ip("127.0.0.1"), srv.port))),
    );
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("allowed.test").unwrap();
    assert!(guard(srv.connector.connect(name, c)).await.is_err());
    let last = h.proxy.audit("sb").unwrap().pop().unwrap();
    assert_eq!(last.rule, AuditRule::Policy(DecisionRule::NotListed));
    assert_eq!(last.via, Via::TransparentTls);
    assert!(h.dials().is_empty());
}

async fn dns_ask(
    sock: &UdpSocket,
    to: SocketAddr,
    id: u16,
    name: &str,
    qtype: u16,
) -> (Rcode, Vec<std::net::IpAddr>) {
    sock.send_to(&build_query(id, name, qtype), to)
        .await
        .unwrap();
    let mut buf = [0u8; 1500];
    let (n, _) = guard(sock.recv_from(&mut buf)).await.unwrap();
    let (rid, rcode, addrs) = parse_response(&buf[..n]).unwrap();
    assert_eq!(rid, id);
    (rcode, addrs)
}

#[tokio::test]
async fn dns_responder_answers_only_allowed_names_with_allowed_addresses() {
    let h = Harness::new();
    let reg = h
        .proxy
        .register_with(
            "sb",
            policy(&["allowed.test", "meta.test", "mixed.test", "v6.test"]),
            ListenOptions::default().dns_port(Some(0)),
        )
        .await
        .unwrap();
    let dns = reg.dns_addr.unwrap();
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    assert_eq!(
        dns_ask(&sock, dns, 1, "allowed.test", TYPE_A).await,
        (Rcode::NoError, vec![ip("127.0.0.1")])
    );
    assert_eq!(
        dns_ask(&sock, dns, 2, "ALLOWED.test.", TYPE_AAAA).await,
        (Rcode::NoError, vec![])
    );
    assert_eq!(
        dns_ask(&sock, dns, 3, "v6.test", TYPE_AAAA).await,
        (Rcode::NoError, vec![ip("::1")])
    );
    assert_eq!(
        dns_ask(&sock, dns, 4, "other.test", TYPE_A).await,
        (Rcode::NxDomain, vec![])
    );
    // listed names that resolve to the metadata endpoint get only their allowed addresses
    assert_eq!(
        dns_ask(&sock, dns, 5, "meta.test", TYPE_A).await,
        (Rcode::NoError, vec![])
    );
    assert_eq!(
        dns_ask(&sock, dns, 6, "mixed.test", TYPE_A).await,
        (Rcode::NoError, vec![ip("127.0.0.1")])
    );
    let audit = h.proxy.audit("sb").unwrap();
    assert!(audit.iter().any(|e| e.host.as_deref() == Some("meta.test")
        && !e.allowed
        && e.rule == AuditRule::Policy(DecisionRule::LinkLocal)));
    assert!(audit.iter().all(|e| e.via == Via::Dns));
    // a refused name is never looked up on the host (no DNS tunnel through us)
    assert_eq!(
        dns_ask(&sock, dns, 7, "c2VjcmV0.exfil.test", TYPE_A)
            .await
            .0,
        Rcode::NxDomain
    );
    assert!(!h.lookups().iter().any(|n| n.contains("exfil")));
    // the policy update applies to the next query
    h.proxy.update_policy("sb", NetworkPolicy::DenyAll).unwrap();
    assert_eq!(
        dns_ask(&sock, dns, 8, "allowed.test", TYPE_A).await.0,
        Rcode::Refused
    );
    assert!(h.dials().is_empty());
}

#[tokio::test]
async fn unix_socket_transport_serves_explicit_proxy_clients() {
    // The Unix-socket transport: the host end of a socket carried into the sandbox is handed
    // to serve_stream; the sandbox side speaks plain proxy protocol.
    let h = Harness::new();
    let port = http_server().await;
    h.proxy
        .register("sb", policy(&["allowed.test"]))
        .await
        .unwrap();
    let (mut sandbox_end, host_end) = tokio::net::UnixStream::pair().unwrap();
    let proxy = h.proxy.clone();
    let task = tokio::spawn(async move {
        proxy
            .serve_stream("sb", host_end, StreamMode::Explicit)
            .await
    });
    sandbox_end
        .write_all(format!("GET http://allowed.test:{port}/u HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let resp = read_all(&mut sandbox_end).await;
    assert!(
        resp.contains(&format!("host=allowed.test:{port} path=/u")),
        "{resp}"
    );
    drop(sandbox_end);
    guard(task).await.unwrap().unwrap();
    // an unknown sandbox is refused
    let (_a, b) = tokio::net::UnixStream::pair().unwrap();
    assert!(h
        .proxy
        .serve_stream("nope", b, StreamMode::Explicit)
        .await
        .is_err());
}
