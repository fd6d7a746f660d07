//! Deciding a destination: names checked before they are resolved, every resolved address
//! decided by the sandbox's policy, the verdict audited, and the upstream connection opened.

use super::*;

/// Most addresses of one name that are decided on and tried.
const MAX_ADDRS: usize = 16;

/// A refusal, already audited.
pub(super) struct Refused {
    status: u16,
    reason: &'static str,
    text: String,
}

pub(super) fn refusal_response(r: &Refused) -> Vec<u8> {
    http::response(
        r.status,
        r.reason,
        &format!("agent-sandbox egress: {}\n", r.text),
        &[("X-Agent-Sandbox-Egress", "denied")],
    )
}

pub(super) fn refuse(
    sb: &SandboxState,
    via: Via,
    host: Option<&str>,
    ip: Option<IpAddr>,
    port: u16,
    rule: AuditRule,
) -> Refused {
    let (status, reason) = match &rule {
        AuditRule::Policy(_) | AuditRule::EchRefused | AuditRule::SecretLeakAttempt { .. } => {
            (403, "Forbidden")
        }
        AuditRule::SecretSubstituted { .. } => (500, "Internal Server Error"),
        AuditRule::Malformed(_) => (400, "Bad Request"),
        AuditRule::Unresolvable(_) => (502, "Bad Gateway"),
    };
    let text = match (host, ip) {
        (Some(h), _) => format!("{h}:{port} refused: {rule}"),
        (None, Some(ip)) => format!("{ip}:{port} refused: {rule}"),
        (None, None) => format!("refused: {rule}"),
    };
    sb.audit.push(AuditEntry {
        time: SystemTime::now(),
        sandbox_id: sb.id.clone(),
        via,
        host: host.map(str::to_string),
        ip,
        port,
        allowed: false,
        rule,
        error: None,
    });
    Refused {
        status,
        reason,
        text,
    }
}

pub(super) fn refuse_malformed(
    sb: &SandboxState,
    via: Via,
    dest: Option<&Dest>,
    port: u16,
    why: &str,
) -> Refused {
    let ip = match dest {
        Some(Dest::Ip(ip)) => Some(*ip),
        _ => None,
    };
    refuse(
        sb,
        via,
        dest.and_then(Dest::name),
        ip,
        port,
        AuditRule::Malformed(why.to_string()),
    )
}

/// Whether a name may be looked up at all under `policy`, before resolution. Names no host
/// rule could allow are never resolved: a lookup of `<secret>.attacker.example` would leak the
/// secret to the attacker's name server even though the connection is refused.
pub(crate) fn precheck_name(
    policy: &NetworkPolicy,
    name: &str,
    port: Option<u16>,
) -> Result<(), DecisionRule> {
    match policy {
        NetworkPolicy::DenyAll => Err(DecisionRule::DenyAll),
        NetworkPolicy::Allow { hosts, ports, .. } => {
            if let Some(p) = port {
                if !ports.is_empty() && !ports.contains(&p) {
                    return Err(DecisionRule::Port(p));
                }
            }
            let hit = hosts.iter().any(|r| match port {
                Some(p) => r.matches(name, p),
                None => r.pattern.matches(name),
            });
            if hit {
                Ok(())
            } else {
                Err(DecisionRule::NotListed)
            }
        }
        NetworkPolicy::AllowInternet { deny, .. } => {
            for r in deny {
                if let sandbox_core::DenyRule::Host(p) = r {
                    if p.matches(name) {
                        return Err(DecisionRule::Denied(r.to_string()));
                    }
                }
            }
            Ok(())
        }
        // A policy this version does not know: nothing is allowed.
        _ => Err(DecisionRule::DenyAll),
    }
}

/// Resolves `name` on the host, with the timeout and the address bound.
pub(super) async fn resolve(inner: &Inner, name: &str) -> Result<Vec<IpAddr>, String> {
    match tokio::time::timeout(inner.config.resolve_timeout, inner.resolver.resolve(name)).await {
        Err(_) => Err("resolution timed out".into()),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(v)) if v.is_empty() => Err("no addresses".into()),
        Ok(Ok(mut v)) => {
            v.truncate(MAX_ADDRS);
            Ok(v)
        }
    }
}

/// Decides and opens one upstream connection. Every address is decided by
/// `NetworkPolicy::decide` after resolution; if any address of a name is refused, the whole
/// name is refused (an answer mixing a public address with the metadata endpoint is a
/// rebinding attempt); only allowed addresses are dialed.
pub(super) async fn open(
    inner: &Inner,
    sb: &SandboxState,
    via: Via,
    dest: &Dest,
    port: u16,
) -> Result<Box<dyn UpstreamStream>, Refused> {
    let policy = sb.policy();
    let name = dest.name();
    let addrs = match dest {
        Dest::Ip(ip) => vec![*ip],
        Dest::Name(n) => {
            if let Err(rule) = precheck_name(&policy, n, Some(port)) {
                return Err(refuse(sb, via, name, None, port, AuditRule::Policy(rule)));
            }
            match resolve(inner, n).await {
                Ok(a) => a,
                Err(why) => {
                    return Err(refuse(
                        sb,
                        via,
                        name,
                        None,
                        port,
                        AuditRule::Unresolvable(why),
                    ))
                }
            }
        }
    };
    let mut allowed = Vec::with_capacity(addrs.len());
    for ip in addrs {
        let d = policy.decide(name, ip, port);
        if !d.allowed {
            return Err(refuse(
                sb,
                via,
                name,
                Some(ip),
                port,
                AuditRule::Policy(d.rule),
            ));
        }
        allowed.push((ip, d.rule));
    }
    let mut last_err = String::from("no address");
    let mut last = None;
    for (ip, rule) in allowed {
        let addr = SocketAddr::new(ip, port);
        let res = tokio::time::timeout(inner.config.connect_timeout, inner.dialer.dial(addr)).await;
        match res {
            Ok(Ok(stream)) => {
                sb.audit.push(AuditEntry {
                    time: SystemTime::now(),
                    sandbox_id: sb.id.clone(),
                    via,
                    host: name.map(str::to_string),
                    ip: Some(ip),
                    port,
                    allowed: true,
                    rule: AuditRule::Policy(rule),
                    error: None,
                });
                return Ok(stream);
            }
            Ok(Err(e)) => last_err = e.to_string(),
            Err(_) => last_err = "connect timed out".into(),
        }
        last = Some((ip, rule));
    }
    let (ip, rule) = last.map_or((None, DecisionRule::NotListed), |(i, r)| (Some(i), r));
    sb.audit.push(AuditEntry {
        time: SystemTime::now(),
        sandbox_id: sb.id.clone(),
        via,
        host: name.map(str::to_string),
        ip,
        port,
        allowed: true,
        rule: AuditRule::Policy(rule),
        error: Some(last_err.clone()),
    });
    Err(Refused {
        status: 502,
        reason: "Bad Gateway",
        text: format!("{dest}:{port}: {last_err}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allow(hosts: &[&str], cidrs: &[&str], ports: &[u16]) -> NetworkPolicy {
        NetworkPolicy::Allow {
            hosts: hosts.iter().map(|h| h.parse().unwrap()).collect(),
            cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            ports: ports.to_vec(),
        }
    }

    #[test]
    fn precheck_only_resolves_names_a_host_rule_could_allow() {
        let p = allow(
            &["allowed.test", "*.wild.test:443"],
            &["10.201.0.0/16"],
            &[],
        );
        assert!(precheck_name(&p, "allowed.test", Some(80)).is_ok());
        assert!(precheck_name(&p, "a.wild.test", Some(443)).is_ok());
        assert!(precheck_name(&p, "a.wild.test", Some(80)).is_err());
        assert!(precheck_name(&p, "a.wild.test", None).is_ok());
        assert_eq!(
            precheck_name(&p, "secret.attacker.test", Some(443)),
            Err(DecisionRule::NotListed)
        );
        assert_eq!(
            precheck_name(&NetworkPolicy::DenyAll, "allowed.test", None),
            Err(DecisionRule::DenyAll)
        );
        let p = allow(&["allowed.test"], &[], &[443]);
        assert_eq!(
            precheck_name(&p, "allowed.test", Some(80)),
            Err(DecisionRule::Port(80))
        );
        let inet = NetworkPolicy::AllowInternet {
            deny: vec!["*.evil.test".parse().unwrap()],
            private: vec![],
        };
        assert!(precheck_name(&inet, "ok.test", Some(443)).is_ok());
        assert!(precheck_name(&inet, "x.evil.test", Some(443)).is_err());
    }
}
