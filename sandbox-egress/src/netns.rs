//! The veth + nftables transport (Linux): a path from a sandbox's network namespace to the
//! egress proxy and nowhere else.
//!
//! [`VethConfig::setup`] creates a veth pair (host end `host_if` with `host_ip`, sandbox end
//! `sandbox_if` with `sandbox_ip`, default route via `host_ip`) and installs two nftables
//! tables:
//! - **host side** (the enforcing one, out of the sandbox's reach even if it is root in its own
//!   user namespace): TCP arriving on `host_if` for any port other than the proxy's is
//!   `redirect`ed to the transparent listener (so the proxy reads the original destination
//!   with `SO_ORIGINAL_DST`, see [`SoOriginalDst`]), UDP 53 to the DNS responder; `input` from
//!   `host_if` accepts only the proxy's ports on `host_ip` and drops everything else (ICMP,
//!   IPv6, other ports of the host); `forward` from or to `host_if` is dropped, so the host never
//!   routes sandbox packets anywhere.
//! - **sandbox side** (defence in depth): `output` allows `lo`, TCP out of `sandbox_if` and UDP
//!   53 to `host_ip`; everything else (other UDP, ICMP, IPv6) is dropped.
//!
//! [`VethConfig::teardown`] deletes the host end (which deletes its peer) and the host table.
//! It needs `ip`, `nsenter` and `nft` and `CAP_NET_ADMIN` over both namespaces.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Stdio;

use sandbox_core::Error;
use tokio::net::TcpStream;

use crate::proxy::OriginalDst;

/// A network namespace to run commands in.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Netns {
    /// The caller's own namespace.
    Current,
    /// A namespace made with `ip netns add NAME` (`/var/run/netns/NAME`).
    Named(String),
    /// The namespace of this process (e.g. a sandbox's init).
    Pid(i32),
    /// A namespace file (e.g. `/proc/<pid>/fd/<n>` of an open namespace descriptor). It can
    /// be the host side of a veth pair, not the sandbox side (`ip` moves links by pid or name).
    Path(PathBuf),
}

impl Netns {
    fn path(&self) -> Option<PathBuf> {
        match self {
            Netns::Current => None,
            Netns::Named(n) => Some(PathBuf::from(format!("/var/run/netns/{n}"))),
            Netns::Pid(p) => Some(PathBuf::from(format!("/proc/{p}/ns/net"))),
            Netns::Path(p) => Some(p.clone()),
        }
    }

    /// What `ip link set ... netns X` takes.
    fn ip_arg(&self) -> Option<String> {
        match self {
            Netns::Current => None,
            Netns::Named(n) => Some(n.clone()),
            Netns::Pid(p) => Some(p.to_string()),
            Netns::Path(_) => None,
        }
    }

    /// Runs `program args` inside this namespace, with `stdin` as its input, and returns its
    /// stdout. The child is spawned from a short-lived thread that joined the namespace
    /// (`setns`), so no `nsenter` process is needed.
    pub(crate) async fn output(
        &self,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<Vec<u8>, Error> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job = Job::new(self, program, args, stdin);
        let what = job.what.clone();
        std::thread::Builder::new()
            .name("egress-netns".into())
            .spawn(move || {
                let _ = tx.send(job.run());
            })
            .map_err(|e| Error::io("egress netns: start a thread", e))?;
        rx.await.unwrap_or_else(|_| {
            Err(Error::io(
                format!("egress netns: run {what}"),
                std::io::Error::other("helper thread lost"),
            ))
        })
    }

    /// [`Netns::output`] for synchronous callers (blocks on a helper thread).
    pub(crate) fn output_blocking(
        &self,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<Vec<u8>, Error> {
        let job = Job::new(self, program, args, stdin);
        let what = job.what.clone();
        std::thread::Builder::new()
            .name("egress-netns".into())
            .spawn(move || job.run())
            .map_err(|e| Error::io("egress netns: start a thread", e))?
            .join()
            .unwrap_or_else(|_| {
                Err(Error::io(
                    format!("egress netns: run {what}"),
                    std::io::Error::other("helper thread panicked"),
                ))
            })
    }
}

/// One command to run in a namespace, owned so it can move to a helper thread.
struct Job {
    ns: Option<PathBuf>,
    program: String,
    args: Vec<String>,
    input: Option<String>,
    what: String,
}

impl Job {
    fn new(ns: &Netns, program: &str, args: &[&str], stdin: Option<&str>) -> Job {
        Job {
            ns: ns.path(),
            program: program.to_string(),
            args: args.iter().map(|a| a.to_string()).collect(),
            input: stdin.map(str::to_string),
            what: format!("{program} {}", args.join(" ")),
        }
    }

    /// Runs the command (on the calling thread, which joins the namespace) and checks it.
    fn run(self) -> Result<Vec<u8>, Error> {
        let out = run_blocking(self.ns, &self.program, &self.args, self.input)
            .map_err(|e| Error::io(format!("egress netns: run {}", self.what), e))?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(Error::invalid(
                "network",
                format!(
                    "egress netns setup: `{}` failed ({}): {}",
                    self.what,
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ))
        }
    }
}

/// Runs a command after joining `ns` (on a dedicated thread: `setns` changes the thread).
fn run_blocking(
    ns: Option<PathBuf>,
    program: &str,
    args: &[String],
    input: Option<String>,
) -> std::io::Result<std::process::Output> {
    use std::io::Write;
    if let Some(p) = ns {
        let f = std::fs::File::open(&p)?;
        // SAFETY: setns on this dedicated, short-lived thread only; `f` is an open netns file.
        if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let (Some(text), Some(mut pipe)) = (input, child.stdin.take()) {
        pipe.write_all(text.as_bytes())?;
    }
    child.wait_with_output()
}

/// One sandbox's veth pair and rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VethConfig {
    /// Host-side interface name (≤ 15 bytes, unique per sandbox).
    pub host_if: String,
    /// Sandbox-side interface name (≤ 15 bytes).
    pub sandbox_if: String,
    /// Address of the host end: the proxy's listeners bind here.
    pub host_ip: Ipv4Addr,
    /// Address of the sandbox end.
    pub sandbox_ip: Ipv4Addr,
    /// Prefix length of the link (30 is enough).
    pub prefix: u8,
    /// The explicit proxy port on `host_ip`.
    pub proxy_port: u16,
    /// The transparent listener's port on `host_ip` (all other TCP is redirected there).
    pub transparent_port: Option<u16>,
    /// The DNS responder's UDP port on `host_ip` (UDP 53 is redirected there).
    pub dns_port: Option<u16>,
}

fn valid_ifname(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 15
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl VethConfig {
    /// The host-side nftables table name of this sandbox.
    pub fn host_table(&self) -> String {
        format!("agent_sandbox_{}", self.host_if.replace('-', "_"))
    }

    fn check(&self) -> Result<(), Error> {
        if !valid_ifname(&self.host_if) || !valid_ifname(&self.sandbox_if) {
            return Err(Error::invalid(
                "network.veth",
                "interface names must be 1-15 of [A-Za-z0-9_-]",
            ));
        }
        if self.prefix == 0 || self.prefix > 30 {
            return Err(Error::invalid("network.veth", "prefix must be 1-30"));
        }
        Ok(())
    }

    /// The host-side ruleset (an `nft -f` script).
    pub fn host_ruleset(&self) -> String {
        let (h, ip, p) = (&self.host_if, self.host_ip, self.proxy_port);
        let mut tcp_ports = vec![p];
        let mut nat = String::new();
        if let Some(d) = self.dns_port {
            nat.push_str(&format!(
                "    iifname \"{h}\" udp dport 53 redirect to :{d}\n"
            ));
        }
        if let Some(t) = self.transparent_port {
            tcp_ports.push(t);
            nat.push_str(&format!(
                "    iifname \"{h}\" meta l4proto tcp tcp dport != {{ {p}, {t} }} redirect to :{t}\n"
            ));
        }
        let tcp: Vec<String> = tcp_ports.iter().map(u16::to_string).collect();
        let mut input = format!(
            "    iifname \"{h}\" ip daddr {ip} tcp dport {{ {} }} accept\n",
            tcp.join(", ")
        );
        if let Some(d) = self.dns_port {
            input.push_str(&format!(
                "    iifname \"{h}\" ip daddr {ip} udp dport {d} accept\n"
            ));
        }
        let table = self.host_table();
        format!(
            "table inet {table} {{\n  chain prerouting {{\n    type nat hook prerouting priority dstnat; policy accept;\n{nat}  }}\n  chain input {{\n    type filter hook input priority filter; policy accept;\n{input}    iifname \"{h}\" drop\n  }}\n  chain forward {{\n    type filter hook forward priority filter; policy accept;\n    iifname \"{h}\" drop\n    oifname \"{h}\" drop\n  }}\n}}\n"
        )
    }

    /// The sandbox-side ruleset (defence in depth).
    pub fn sandbox_ruleset(&self) -> String {
        let (s, ip) = (&self.sandbox_if, self.host_ip);
        format!(
            "table inet agent_sandbox {{\n  chain output {{\n    type filter hook output priority filter; policy drop;\n    oifname \"lo\" accept\n    oifname \"{s}\" meta nfproto ipv4 meta l4proto tcp accept\n    oifname \"{s}\" ip daddr {ip} udp dport 53 accept\n  }}\n}}\n"
        )
    }

    /// Creates the veth pair between `host` and `sandbox` and installs both rulesets. On error,
    /// whatever was created is removed again.
    pub async fn setup(&self, host: &Netns, sandbox: &Netns) -> Result<(), Error> {
        self.setup_with(host, sandbox, true).await
    }

    /// Like [`setup`](Self::setup) but without the per-link host table: for a host namespace
    /// that already holds [`shared_host_ruleset`] for every link.
    pub async fn setup_link(&self, host: &Netns, sandbox: &Netns) -> Result<(), Error> {
        self.setup_with(host, sandbox, false).await
    }

    async fn setup_with(&self, host: &Netns, sandbox: &Netns, table: bool) -> Result<(), Error> {
        self.check()?;
        let Some(target) = sandbox.ip_arg() else {
            return Err(Error::invalid(
                "network.veth",
                "the sandbox side must be another namespace",
            ));
        };
        let mut res = self.setup_link_inner(host, sandbox, &target).await;
        if res.is_ok() && table {
            res = host
                .output("nft", &["-f", "-"], Some(&self.host_ruleset()))
                .await
                .map(|_| ());
        }
        if res.is_err() {
            if table {
                self.teardown(host).await;
            } else {
                self.teardown_link(host).await;
            }
        }
        res
    }

    async fn setup_link_inner(
        &self,
        host: &Netns,
        sandbox: &Netns,
        target: &str,
    ) -> Result<(), Error> {
        // Three processes: one `ip -batch` per side and the sandbox's `nft -f`.
        let (h, s) = (self.host_if.as_str(), self.sandbox_if.as_str());
        let host_script = format!(
            "link add {h} type veth peer name {s}\nlink set {s} netns {target}\naddr add {}/{} dev {h}\nlink set {h} up\n",
            self.host_ip, self.prefix
        );
        host.output("ip", &["-batch", "-"], Some(&host_script))
            .await?;
        let sandbox_script = format!(
            "addr add {}/{} dev {s}\nlink set {s} up\nlink set lo up\nroute add default via {} dev {s}\n",
            self.sandbox_ip, self.prefix, self.host_ip
        );
        sandbox
            .output("ip", &["-batch", "-"], Some(&sandbox_script))
            .await?;
        sandbox
            .output("nft", &["-f", "-"], Some(&self.sandbox_ruleset()))
            .await?;
        Ok(())
    }

    /// Removes the host end (its peer goes with it) and the host table. Idempotent.
    pub async fn teardown(&self, host: &Netns) {
        self.teardown_link(host).await;
        let _ = host
            .output(
                "nft",
                &["delete", "table", "inet", &self.host_table()],
                None,
            )
            .await;
    }

    /// Removes the host end (its peer goes with it). Idempotent.
    pub async fn teardown_link(&self, host: &Netns) {
        let _ = host
            .output("ip", &["link", "del", &self.host_if], None)
            .await;
    }
}

/// The host-side ruleset for every link whose host end is named `<if_prefix>*`, installed
/// once in a namespace that holds only such links (the enforcer's egress namespace): TCP to
/// any port but the proxy's is redirected to the transparent listener, UDP 53 to the DNS
/// responder; a link may reach only the proxy's ports on **its own** host address (`fib
/// daddr . iif type local`), so a sandbox cannot talk to another sandbox's listeners and be
/// judged by that sandbox's policy; everything else from the links is dropped, and nothing is
/// forwarded.
pub fn shared_host_ruleset(
    table: &str,
    if_prefix: &str,
    proxy_port: u16,
    transparent_port: u16,
    dns_port: u16,
) -> String {
    let (p, t, d) = (proxy_port, transparent_port, dns_port);
    let m = format!("iifname \"{if_prefix}*\"");
    format!(
        "table inet {table} {{\n  chain prerouting {{\n    type nat hook prerouting priority dstnat; policy accept;\n    {m} udp dport 53 redirect to :{d}\n    {m} meta l4proto tcp tcp dport != {{ {p}, {t} }} redirect to :{t}\n  }}\n  chain input {{\n    type filter hook input priority filter; policy accept;\n    {m} fib daddr . iif type != local drop\n    {m} tcp dport {{ {p}, {t} }} accept\n    {m} udp dport {d} accept\n    {m} drop\n  }}\n  chain forward {{\n    type filter hook forward priority filter; policy drop;\n  }}\n}}\n"
    )
}

/// Reads the pre-NAT destination of a redirected connection (`SO_ORIGINAL_DST`, IPv4).
/// A connection that was not redirected reports its own local address: that is treated as
/// unknown, so the proxy can never be pointed at itself.
#[derive(Debug, Default, Clone, Copy)]
pub struct SoOriginalDst;

impl OriginalDst for SoOriginalDst {
    fn original_dst(&self, stream: &TcpStream) -> Option<SocketAddr> {
        let fd = stream.as_raw_fd();
        // SAFETY: sockaddr_in is plain old data; all-zero is a valid value.
        let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: fd is a live socket owned by `stream`; `addr`/`len` point to a writable
        // sockaddr_in of the size passed, which is what SO_ORIGINAL_DST writes.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_IP,
                libc::SO_ORIGINAL_DST,
                (&mut addr as *mut libc::sockaddr_in).cast(),
                &mut len,
            )
        };
        if rc != 0 || i32::from(addr.sin_family) != libc::AF_INET {
            return None;
        }
        let dst = SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
            u16::from_be(addr.sin_port),
        ));
        match stream.local_addr() {
            Ok(local) if local == dst => None,
            Ok(_) => Some(dst),
            Err(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> VethConfig {
        VethConfig {
            host_if: "egh-1".into(),
            sandbox_if: "egs-1".into(),
            host_ip: Ipv4Addr::new(10, 201, 7, 1),
            sandbox_ip: Ipv4Addr::new(10, 201, 7, 2),
            prefix: 30,
            proxy_port: 3128,
            transparent_port: Some(3129),
            dns_port: Some(5353),
        }
    }

    #[test]
    fn rulesets() {
        let c = cfg();
        let host = c.host_ruleset();
        assert!(host.contains("table inet agent_sandbox_egh_1"), "{host}");
        assert!(
            host.contains("tcp dport != { 3128, 3129 } redirect to :3129"),
            "{host}"
        );
        assert!(host.contains("udp dport 53 redirect to :5353"), "{host}");
        assert!(
            host.contains("ip daddr 10.201.7.1 tcp dport { 3128, 3129 } accept"),
            "{host}"
        );
        assert!(host.contains("iifname \"egh-1\" drop"), "{host}");
        let sb = c.sandbox_ruleset();
        assert!(sb.contains("policy drop;"), "{sb}");
        assert!(
            sb.contains("ip daddr 10.201.7.1 udp dport 53 accept"),
            "{sb}"
        );
        let bad = VethConfig {
            host_if: "a name; rm".into(),
            ..cfg()
        };
        assert!(bad.check().is_err());
    }
}
