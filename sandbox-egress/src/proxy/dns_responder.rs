//! The DNS responder: each sandbox's queries answered under its policy, with only the
//! addresses it may connect to.

use super::decide::{precheck_name, resolve};
use super::*;

/// The ports a DNS answer is judged for: a name is answered if some port the policy allows
/// for it would be allowed.
fn candidate_ports(policy: &NetworkPolicy, name: &str) -> Vec<u16> {
    let mut out = Vec::new();
    if let NetworkPolicy::Allow { hosts, ports, .. } = policy {
        out.extend(ports.iter().copied());
        out.extend(
            hosts
                .iter()
                .filter(|r| r.pattern.matches(name))
                .filter_map(|r| r.port),
        );
    }
    if out.is_empty() {
        out.extend([443, 80]);
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Answers one DNS query under the sandbox's current policy.
async fn answer_dns(inner: &Inner, sb: &SandboxState, msg: &[u8]) -> Option<Vec<u8>> {
    let ttl = inner.config.dns_ttl;
    let q = match dns::parse_query(msg) {
        Ok(q) => q,
        Err(dns::QueryError::Drop) => return None,
        Err(dns::QueryError::Reply { id, flags, rcode }) => {
            return Some(dns::build_error(id, flags, rcode))
        }
    };
    let policy = sb.policy();
    let audit = |host: Option<&str>, ip, allowed, rule| {
        sb.audit.push(AuditEntry {
            time: SystemTime::now(),
            sandbox_id: sb.id.clone(),
            via: Via::Dns,
            host: host.map(str::to_string),
            ip,
            port: 0,
            allowed,
            rule,
            error: None,
        })
    };
    if !dns::is_class_in(&q) {
        return Some(dns::build_response(&q, Rcode::Refused, &[], ttl));
    }
    let Some(name) = q.name.clone() else {
        audit(
            None,
            None,
            false,
            AuditRule::Malformed("query name is not a host name".into()),
        );
        return Some(dns::build_response(&q, Rcode::NxDomain, &[], ttl));
    };
    if let Err(rule) = precheck_name(&policy, &name, None) {
        let code = if rule == DecisionRule::DenyAll {
            Rcode::Refused
        } else {
            Rcode::NxDomain
        };
        audit(Some(&name), None, false, AuditRule::Policy(rule));
        return Some(dns::build_response(&q, code, &[], ttl));
    }
    if q.qtype != dns::TYPE_A && q.qtype != dns::TYPE_AAAA {
        return Some(dns::build_response(&q, Rcode::NoError, &[], ttl));
    }
    let addrs = match resolve(inner, &name).await {
        Ok(a) => a,
        Err(why) => {
            audit(Some(&name), None, false, AuditRule::Unresolvable(why));
            return Some(dns::build_response(&q, Rcode::NxDomain, &[], ttl));
        }
    };
    let ports = candidate_ports(&policy, &name);
    let mut ok = Vec::new();
    for ip in addrs {
        let wanted = match ip {
            IpAddr::V4(_) => q.qtype == dns::TYPE_A,
            IpAddr::V6(_) => q.qtype == dns::TYPE_AAAA,
        };
        if !wanted {
            continue;
        }
        let mut last = None;
        for p in &ports {
            let d = policy.decide(Some(&name), ip, *p);
            if d.allowed {
                last = Some(d);
                break;
            }
            last = Some(d);
        }
        if let Some(d) = last {
            audit(
                Some(&name),
                Some(ip),
                d.allowed,
                AuditRule::Policy(d.rule.clone()),
            );
            if d.allowed {
                ok.push(ip);
            }
        }
    }
    Some(dns::build_response(&q, Rcode::NoError, &ok, ttl))
}

pub(super) async fn dns_loop(inner: Arc<Inner>, sb: Arc<SandboxState>, sock: UdpSocket) {
    let sock = Arc::new(sock);
    let mut buf = vec![0u8; 1500];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(target: "sandbox_egress", sandbox = %sb.id, error = %e, "dns recv");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = sb.slots.clone().try_acquire_owned() else {
            continue;
        };
        let msg = buf[..n.min(buf.len())].to_vec();
        let (inner, sb, sock) = (inner.clone(), sb.clone(), sock.clone());
        let mut stop = sb.shutdown.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                resp = answer_dns(&inner, &sb, &msg) => {
                    if let Some(r) = resp {
                        let _ = sock.send_to(&r, peer).await;
                    }
                }
                _ = stopped(&mut stop) => {}
            }
            drop(permit);
        });
    }
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
    fn dns_candidate_ports() {
        let p = allow(&["a.test:8443", "b.test"], &[], &[]);
        assert_eq!(candidate_ports(&p, "a.test"), vec![8443]);
        assert_eq!(candidate_ports(&p, "b.test"), vec![80, 443]);
        let p = allow(&["a.test"], &[], &[22]);
        assert_eq!(candidate_ports(&p, "a.test"), vec![22]);
    }
}
