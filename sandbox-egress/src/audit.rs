//! The audit log: every decision, as a `tracing` event and in a bounded per-sandbox ring.

use std::collections::VecDeque;
use std::fmt;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::SystemTime;

use sandbox_core::DecisionRule;
use serde::{Deserialize, Serialize};

/// How the sandbox asked for the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Via {
    /// An HTTP/1.1 forward-proxy request (absolute URI), decided by its host.
    Http,
    /// A `CONNECT host:port` tunnel, decided by its target.
    Connect,
    /// Redirected TCP, decided by the sniffed HTTP `Host`.
    TransparentHttp,
    /// Redirected TCP, decided by the sniffed TLS SNI.
    TransparentTls,
    /// Redirected TCP, decided by the original destination address and port.
    TransparentTcp,
    /// A query to the DNS responder.
    Dns,
}

impl Via {
    /// The kebab-case name (as serialized).
    pub fn name(self) -> &'static str {
        match self {
            Via::Http => "http",
            Via::Connect => "connect",
            Via::TransparentHttp => "transparent-http",
            Via::TransparentTls => "transparent-tls",
            Via::TransparentTcp => "transparent-tcp",
            Via::Dns => "dns",
        }
    }
}

/// Why a connection was allowed or refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "detail", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum AuditRule {
    /// `NetworkPolicy::decide` (or the name pre-check that mirrors it) decided.
    Policy(DecisionRule),
    /// The request could not be understood (no usable destination).
    Malformed(String),
    /// The name did not resolve (or timed out).
    Unresolvable(String),
    /// The TLS ClientHello offered Encrypted Client Hello: the real name is hidden.
    EchRefused,
    /// A proxy-held secret's placeholder was replaced by its value (allowed entries only).
    SecretSubstituted {
        /// The secret's name (never its value).
        secret: String,
        /// Where in the request (`header authorization`, `request target`, `body`, ...).
        place: String,
    },
    /// A placeholder was on its way to a host its secret is not bound to: refused, and a
    /// sign that something in the sandbox tried to send the credential elsewhere.
    SecretLeakAttempt {
        /// The secret's name.
        secret: String,
        /// Where in the request.
        place: String,
    },
}

impl fmt::Display for AuditRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuditRule::Policy(r) => r.fmt(f),
            AuditRule::Malformed(why) => write!(f, "malformed request: {why}"),
            AuditRule::Unresolvable(why) => write!(f, "name does not resolve: {why}"),
            AuditRule::EchRefused => {
                f.write_str("encrypted ClientHello hides the destination: refused")
            }
            AuditRule::SecretSubstituted { secret, place } => {
                write!(f, "secret {secret} substituted in the {place}")
            }
            AuditRule::SecretLeakAttempt { secret, place } => write!(
                f,
                "leak attempt: the placeholder of secret {secret} in the {place}, to a host it \
                 is not bound to"
            ),
        }
    }
}

/// One decision of the egress proxy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct AuditEntry {
    /// When it was decided.
    pub time: SystemTime,
    /// The sandbox that asked.
    pub sandbox_id: String,
    /// How it asked.
    pub via: Via,
    /// The name it asked for (`None` for a bare address).
    pub host: Option<String>,
    /// The address decided on (for a name: the resolved address that decided), if any.
    pub ip: Option<IpAddr>,
    /// The destination port (0 for DNS queries).
    pub port: u16,
    /// Whether the policy allowed it.
    pub allowed: bool,
    /// The rule that decided.
    pub rule: AuditRule,
    /// For an allowed destination that could not be reached: why.
    pub error: Option<String>,
}

impl AuditEntry {
    /// Emits the entry as a structured `tracing` event (target `sandbox_egress::audit`):
    /// `info` when allowed, `warn` when denied.
    pub fn trace(&self) {
        let host = self.host.as_deref().unwrap_or("");
        let ip = self.ip.map(|i| i.to_string()).unwrap_or_default();
        let rule = self.rule.to_string();
        let error = self.error.as_deref().unwrap_or("");
        if self.allowed {
            tracing::info!(target: "sandbox_egress::audit", sandbox = %self.sandbox_id,
                via = ?self.via, host, ip = %ip, port = self.port, allowed = true,
                rule = %rule, error, "egress allowed");
        } else {
            tracing::warn!(target: "sandbox_egress::audit", sandbox = %self.sandbox_id,
                via = ?self.via, host, ip = %ip, port = self.port, allowed = false,
                rule = %rule, "egress denied");
        }
    }
}

/// A bounded ring of the latest entries of one sandbox.
#[derive(Debug)]
pub(crate) struct AuditRing {
    cap: usize,
    entries: Mutex<VecDeque<AuditEntry>>,
    dropped: Mutex<u64>,
}

impl AuditRing {
    pub(crate) fn new(cap: usize) -> Self {
        AuditRing {
            cap: cap.max(1),
            entries: Mutex::new(VecDeque::new()),
            dropped: Mutex::new(0),
        }
    }

    pub(crate) fn push(&self, e: AuditEntry) {
        e.trace();
        let mut q = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() == self.cap {
            q.pop_front();
            *self.dropped.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        }
        q.push_back(e);
    }

    pub(crate) fn snapshot(&self) -> Vec<AuditEntry> {
        let q = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        q.iter().cloned().collect()
    }

    pub(crate) fn dropped(&self) -> u64 {
        *self.dropped.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(port: u16) -> AuditEntry {
        AuditEntry {
            time: SystemTime::now(),
            sandbox_id: "sb".into(),
            via: Via::Connect,
            host: Some("a.test".into()),
            ip: None,
            port,
            allowed: false,
            rule: AuditRule::Policy(DecisionRule::NotListed),
            error: None,
        }
    }

    #[test]
    fn ring_is_bounded_and_keeps_the_latest() {
        let r = AuditRing::new(3);
        for p in 1..=5 {
            r.push(entry(p));
        }
        let ports: Vec<u16> = r.snapshot().iter().map(|e| e.port).collect();
        assert_eq!(ports, vec![3, 4, 5]);
        assert_eq!(r.dropped(), 2);
    }

    /// Captures the fields of every event.
    #[derive(Default, Clone)]
    struct Capture(std::sync::Arc<Mutex<Vec<EventFields>>>);

    type EventFields = Vec<(String, String)>;

    struct Fields(Vec<(String, String)>);

    impl tracing::field::Visit for Fields {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
            self.0
                .push((field.name().to_string(), format!("{value:?}")));
        }
        fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
            self.0.push((field.name().to_string(), value.to_string()));
        }
    }

    impl tracing::Subscriber for Capture {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, e: &tracing::Event<'_>) {
            let mut f = Fields(vec![
                ("target".into(), e.metadata().target().into()),
                ("level".into(), e.metadata().level().to_string()),
            ]);
            e.record(&mut f);
            self.0.lock().unwrap().push(f.0);
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    #[test]
    fn every_entry_is_a_structured_tracing_event() {
        let cap = Capture::default();
        let ring = AuditRing::new(8);
        let allowed = || {
            let mut ok = entry(80);
            ok.allowed = true;
            ok.ip = Some("127.0.0.1".parse().unwrap());
            ok.rule = AuditRule::Policy(DecisionRule::Host("a.test".into()));
            ok
        };
        // tracing caches each callsite's interest when it is first hit: another test thread
        // hitting one first, while this test's subscriber is being installed, could cache
        // "never" for it. Both callsites are hit here first, and the cache is rebuilt under
        // this test's subscriber before the events that count.
        let warm = AuditRing::new(2);
        warm.push(entry(443));
        warm.push(allowed());
        tracing::subscriber::with_default(cap.clone(), || {
            tracing::callsite::rebuild_interest_cache();
            ring.push(entry(443));
            ring.push(allowed());
        });
        let events = cap.0.lock().unwrap().clone();
        assert_eq!(events.len(), 2);
        let get = |ev: &Vec<(String, String)>, k: &str| {
            ev.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert_eq!(get(&events[0], "target"), "sandbox_egress::audit");
        assert_eq!(get(&events[0], "level"), "WARN");
        assert_eq!(get(&events[0], "sandbox"), "sb");
        assert_eq!(get(&events[0], "host"), "a.test");
        assert_eq!(get(&events[0], "port"), "443");
        assert_eq!(get(&events[0], "allowed"), "false");
        assert_eq!(
            get(&events[0], "rule"),
            "destination is not in the allowlist"
        );
        assert_eq!(get(&events[1], "level"), "INFO");
        assert_eq!(get(&events[1], "ip"), "127.0.0.1");
        assert_eq!(get(&events[1], "allowed"), "true");
    }

    #[test]
    fn entries_serialize() {
        let j = serde_json::to_string(&entry(443)).unwrap();
        assert!(j.contains("\"not-listed\""), "{j}");
    }
}
