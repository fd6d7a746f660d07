//! The network decision: the invariants of every mode, the rules, parsing and serde.

use super::*;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn allow(hosts: &[&str], cidrs: &[&str], ports: &[u16]) -> NetworkPolicy {
    NetworkPolicy::Allow {
        hosts: hosts.iter().map(|h| h.parse().unwrap()).collect(),
        cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
        ports: ports.to_vec(),
    }
}

fn internet() -> NetworkPolicy {
    NetworkPolicy::AllowInternet {
        deny: vec![],
        private: vec![],
    }
}

const PUBLIC: &str = "93.184.216.34";

#[test]
fn default_is_deny_all() {
    let p = NetworkPolicy::default();
    assert_eq!(p, NetworkPolicy::DenyAll);
    let d = p.decide(Some("example.com"), ip(PUBLIC), 443);
    assert!(!d.allowed);
    assert_eq!(d.rule, DecisionRule::DenyAll);
}

#[test]
fn metadata_refused_in_every_mode() {
    let everything = NetworkPolicy::Allow {
        hosts: vec![
            "*.internal".parse().unwrap(),
            "metadata.google.internal".parse().unwrap(),
        ],
        cidrs: vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()],
        ports: vec![],
    };
    let modes = [
        NetworkPolicy::DenyAll,
        everything,
        internet(),
        NetworkPolicy::AllowInternet {
            deny: vec![],
            private: vec!["10.0.0.0/8".parse().unwrap()],
        },
    ];
    let addrs = [
        "169.254.169.254",
        "169.254.0.1",
        "169.254.255.255",
        "fe80::1",
        "febf::1",
        "::ffff:169.254.169.254",
        "fd00:ec2::254",
    ];
    for p in &modes {
        for a in &addrs[..6] {
            for host in [
                None,
                Some("metadata.google.internal"),
                Some("169.254.169.254"),
            ] {
                let d = p.decide(host, ip(a), 80);
                assert!(!d.allowed, "{p:?} allowed {a}");
                if !matches!(p, NetworkPolicy::DenyAll) || *a != "fd00:ec2::254" {
                    assert_eq!(d.rule, DecisionRule::LinkLocal, "{p:?} {a}");
                }
            }
        }
        // AWS's IPv6 metadata address is ULA: refused unless listed.
        assert!(!p.decide(None, ip(addrs[6]), 80).allowed);
    }
}

/// IPv6 forms that carry an IPv4 address are judged as that address: NAT64 of the
/// metadata endpoint is link-local, 6to4 and IPv4-compatible forms of loopback are
/// loopback, Teredo's inverted client address is decoded.
#[test]
fn ipv6_forms_embedding_ipv4_are_judged_as_the_ipv4_address() {
    let all = internet();
    for (v6, rule) in [
        ("64:ff9b::a9fe:a9fe", DecisionRule::LinkLocal),
        ("64:ff9b:1::a9fe:a9fe", DecisionRule::LinkLocal),
        ("2002:a9fe:a9fe::1", DecisionRule::LinkLocal),
        ("::169.254.169.254", DecisionRule::LinkLocal),
        (
            "2001:0:4136:e378:8000:63bf:5601:5601",
            DecisionRule::LinkLocal,
        ),
        ("::ffff:169.254.169.254", DecisionRule::LinkLocal),
        ("::ffff:0:a9fe:a9fe", DecisionRule::LinkLocal),
        (
            "64:ff9b::7f00:1",
            DecisionRule::PrivateRange("loopback 127.0.0.0/8".into()),
        ),
        (
            "2002:0a00:0001::",
            DecisionRule::PrivateRange("private 10.0.0.0/8".into()),
        ),
    ] {
        let d = all.decide(None, ip(v6), 80);
        assert_eq!((d.allowed, d.rule), (false, rule), "{v6}");
    }
    // IPv6's own loopback stays IPv6 loopback; a public NAT64 address stays public.
    assert_eq!(embedded_v4("::1".parse().unwrap()), None);
    assert!(all.decide(None, ip("64:ff9b::5db8:d822"), 80).allowed);
    assert!(all.decide(None, ip("2606:4700::1111"), 80).allowed);
}

/// An IPv4-mapped range is matched as the IPv4 range it maps, with its prefix less 96:
/// `::ffff:0.0.0.0/96` is all of IPv4, which does not list loopback explicitly (its prefix
/// once underflowed into a mask that matched everything).
#[test]
fn mapped_ranges_match_with_their_ipv4_prefix() {
    let all_v4 = allow(&[], &["::ffff:0.0.0.0/96"], &[]);
    assert!(!all_v4.decide(None, ip("127.0.0.1"), 80).allowed);
    assert!(all_v4.decide(None, ip(PUBLIC), 80).allowed);
    let lo = allow(&[], &["::ffff:127.0.0.0/104"], &[]);
    assert!(lo.decide(None, ip("127.0.0.1"), 80).allowed);
    assert!(!lo.decide(None, ip("10.0.0.1"), 80).allowed);
    let narrow = allow(&[], &["::ffff:10.1.2.0/120"], &[]);
    assert!(narrow.decide(None, ip("10.1.2.3"), 80).allowed);
    assert!(!narrow.decide(None, ip("10.1.3.3"), 80).allowed);
}

/// On a server, loopback, private space and the host's own addresses are refused whatever
/// the client's policy lists, and the refusal names the operator's flag.
#[test]
fn a_server_guard_refuses_its_own_networks_whatever_the_policy() {
    let guard = ServerNetworks::new([ip("203.0.113.7")]);
    let open = allow(
        &["*.example.com"],
        &["127.0.0.0/8", "10.0.0.0/8", "203.0.113.0/24", "0.0.0.0/0"],
        &[],
    );
    for target in [
        "127.0.0.1",
        "10.1.2.3",
        "203.0.113.7",
        "::ffff:127.0.0.1",
        "::1",
    ] {
        let d = open.decide_guarded(Some("a.example.com"), ip(target), 443, Some(&guard));
        assert!(!d.allowed, "{target}");
        assert!(
            matches!(d.rule, DecisionRule::ServerNetwork(_)),
            "{target}: {:?}",
            d.rule
        );
        assert!(d.rule.to_string().contains("--allow-private-networks"));
    }
    // Another public address of the allowed range is still allowed, and without the guard
    // the policy alone decides.
    assert!(
        open.decide_guarded(None, ip("203.0.113.8"), 443, Some(&guard))
            .allowed
    );
    assert!(
        open.decide_guarded(None, ip("127.0.0.1"), 443, None)
            .allowed
    );
    assert_eq!(
        open.private_ranges_listed().as_deref(),
        Some("127.0.0.0/8 (inside loopback 127.0.0.0/8)")
    );
    assert_eq!(
        allow(&[], &["0.0.0.0/0"], &[]).private_ranges_listed(),
        None
    );
    assert_eq!(internet().private_ranges_listed(), None);
}

#[test]
fn link_local_cidr_is_rejected_by_validate() {
    let p = allow(&[], &["169.254.169.254/32"], &[]);
    assert!(p.validate().is_err());
    // and even if someone skips validation, decide still refuses
    assert!(!p.decide(None, ip("169.254.169.254"), 80).allowed);
}

#[test]
fn rebinding_allowed_name_to_private_or_loopback_is_refused() {
    let p = allow(&["allowed.test", "*.example.com"], &[], &[]);
    for target in [
        "127.0.0.1",
        "10.0.0.5",
        "172.16.3.4",
        "192.168.1.1",
        "100.64.0.1",
        "0.0.0.1",
        "::1",
        "fd12::1",
        "::ffff:127.0.0.1",
        "::ffff:10.1.2.3",
    ] {
        let d = p.decide(Some("allowed.test"), ip(target), 443);
        assert!(!d.allowed, "{target} should be refused");
        assert!(
            matches!(d.rule, DecisionRule::PrivateRange(_)),
            "{target}: {:?}",
            d.rule
        );
    }
    assert!(p.decide(Some("allowed.test"), ip(PUBLIC), 443).allowed);
    assert!(p.decide(Some("api.example.com"), ip(PUBLIC), 443).allowed);
}

#[test]
fn explicit_private_cidr_allows_only_its_range() {
    let p = allow(&["allowed.test"], &["10.201.0.0/16"], &[]);
    let d = p.decide(Some("allowed.test"), ip("10.201.1.2"), 80);
    assert!(d.allowed);
    assert_eq!(d.rule, DecisionRule::Host("allowed.test".into()));
    // a different private address is still refused even for an allowed name
    assert!(!p.decide(Some("allowed.test"), ip("10.202.1.2"), 80).allowed);
    // a bare IP in the listed range is allowed by cidr
    assert_eq!(
        p.decide(None, ip("10.201.9.9"), 22).rule,
        DecisionRule::Cidr("10.201.0.0/16".into())
    );
    // a public address that no rule matches is refused
    assert_eq!(p.decide(None, ip(PUBLIC), 80).rule, DecisionRule::NotListed);
}

#[test]
fn wide_cidr_does_not_count_as_explicit_private() {
    let p = allow(&[], &["0.0.0.0/0"], &[]);
    assert!(p.decide(None, ip(PUBLIC), 80).allowed);
    assert!(!p.decide(None, ip("127.0.0.1"), 80).allowed);
    assert!(!p.decide(None, ip("10.0.0.1"), 80).allowed);
    let p = allow(&[], &["127.0.0.0/8"], &[]);
    assert!(p.decide(None, ip("127.0.0.1"), 80).allowed);
    let p = allow(&[], &["::1/128"], &[]);
    assert!(p.decide(None, ip("::1"), 80).allowed);
}

#[test]
fn wildcards() {
    let pat: HostPattern = "*.Example.COM.".parse().unwrap();
    assert!(pat.matches("a.example.com"));
    assert!(pat.matches("A.B.EXAMPLE.com."));
    assert!(!pat.matches("example.com"));
    assert!(!pat.matches("badexample.com"));
    assert!(!pat.matches("example.com.evil.net"));
    let exact: HostPattern = "example.com".parse().unwrap();
    assert!(exact.matches("EXAMPLE.com."));
    assert!(!exact.matches("a.example.com"));
    for bad in [
        "*",
        "*.",
        "a.*.com",
        "exa mple.com",
        "",
        "10.0.0.1",
        "*example.com",
    ] {
        assert!(bad.parse::<HostPattern>().is_err(), "{bad:?} accepted");
    }
}

#[test]
fn ports() {
    let p = allow(&["api.test:443", "any.test"], &[], &[]);
    assert!(p.decide(Some("api.test"), ip(PUBLIC), 443).allowed);
    assert!(!p.decide(Some("api.test"), ip(PUBLIC), 80).allowed);
    assert!(p.decide(Some("any.test"), ip(PUBLIC), 8080).allowed);
    let p = allow(&["any.test"], &[], &[443]);
    assert_eq!(
        p.decide(Some("any.test"), ip(PUBLIC), 80).rule,
        DecisionRule::Port(80)
    );
    assert!(p.decide(Some("any.test"), ip(PUBLIC), 443).allowed);
    assert!("a.test:0".parse::<HostRule>().is_err());
    assert!("a.test:99999".parse::<HostRule>().is_err());
    assert!(allow(&[], &[], &[0]).validate().is_err());
}

#[test]
fn literal_ip_as_host_is_judged_by_address_only() {
    let p = allow(&["allowed.test"], &[], &[]);
    assert!(!p.decide(Some(PUBLIC), ip(PUBLIC), 80).allowed);
}

#[test]
fn allow_internet_refuses_private_by_default_and_honours_deny() {
    let p = NetworkPolicy::AllowInternet {
        deny: vec![
            "*.evil.test".parse().unwrap(),
            "203.0.113.0/24".parse().unwrap(),
        ],
        private: vec!["10.201.0.0/16".parse().unwrap()],
    };
    assert_eq!(
        p.decide(Some("ok.test"), ip(PUBLIC), 443).rule,
        DecisionRule::Internet
    );
    assert!(!p.decide(Some("x.evil.test"), ip(PUBLIC), 443).allowed);
    assert!(!p.decide(None, ip("203.0.113.7"), 443).allowed);
    assert!(!p.decide(None, ip("192.168.0.1"), 443).allowed);
    assert!(!p.decide(None, ip("127.0.0.1"), 443).allowed);
    assert!(p.decide(None, ip("10.201.0.1"), 443).allowed);
    assert!(!internet().decide(None, ip("10.201.0.1"), 443).allowed);
    assert!(internet().decide(None, ip("2001:db8::1"), 443).allowed);
}

#[test]
fn non_unicast_refused() {
    for a in ["0.0.0.0", "255.255.255.255", "224.0.0.1", "::", "ff02::1"] {
        let d = internet().decide(None, ip(a), 80);
        assert!(!d.allowed, "{a}");
    }
}

#[test]
fn cidr_parsing_and_contains() {
    let c: Cidr = "10.201.0.0/16".parse().unwrap();
    assert!(c.contains(ip("10.201.255.1")));
    assert!(!c.contains(ip("10.202.0.1")));
    assert!(!c.contains(ip("::1")));
    assert!("10.0.0.0/33".parse::<Cidr>().is_err());
    assert!("nonsense".parse::<Cidr>().is_err());
    assert_eq!("1.2.3.4".parse::<Cidr>().unwrap().prefix, 32);
    let all: Cidr = "0.0.0.0/0".parse().unwrap();
    assert!(all.contains(ip("8.8.8.8")));
    let v6: Cidr = "2001:db8::/32".parse().unwrap();
    assert!(v6.contains(ip("2001:db8:1::1")));
}

#[test]
fn serde_round_trip() {
    let p = allow(
        &["*.example.com:443", "api.test"],
        &["10.201.0.0/16"],
        &[443],
    );
    let j = serde_json::to_string(&p).unwrap();
    assert!(j.contains("\"mode\":\"allow\""), "{j}");
    assert_eq!(serde_json::from_str::<NetworkPolicy>(&j).unwrap(), p);
    let bad = r#"{"mode":"allow","hosts":["a b"]}"#;
    assert!(serde_json::from_str::<NetworkPolicy>(bad).is_err());
    let d: NetworkPolicy = serde_json::from_str(r#"{"mode":"deny-all"}"#).unwrap();
    assert_eq!(d, NetworkPolicy::DenyAll);
}
