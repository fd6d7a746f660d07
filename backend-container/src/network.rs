//! The sandbox's network namespace: the one place where its network is set up.
//!
//! Every sandbox gets a fresh network namespace (made by its init) in which `lo` is brought up
//! (as root by the library, from a short-lived thread that joins the namespace, while the
//! init builds the root filesystem; rootless, where the library may not
//! join it, by the init), and nothing else: no interface, no route, so no packet can leave,
//! whatever the code does (TCP, UDP, ICMP, raw sockets, IPv6, DNS). That is
//! [`NetworkPolicy::DenyAll`](sandbox_core::NetworkPolicy), enforced by the kernel alone.
//!
//! Any other policy needs an [`EgressEnforcer`](sandbox_core::EgressEnforcer) plugged in with
//! [`ContainerBackendBuilder::egress`](crate::ContainerBackendBuilder::egress) (`sandbox-egress`'s
//! `VethEnforcer` is the one the facade uses). The backend then:
//! 1. asks the enforcer to `prepare` the sandbox before its init starts: the plan's
//!    `/etc/resolv.conf` goes into the rootfs plan, its proxy variables into every command's
//!    environment;
//! 2. `attach`es the new namespace (by the init's pid) before any command runs: the enforcer
//!    gives it one veth link whose only destination is the egress proxy (everything else is
//!    redirected to the proxy or dropped on the far side, out of the sandbox's reach);
//! 3. forwards [`Sandbox::set_network_policy`](sandbox_core::Sandbox::set_network_policy) and
//!    [`Sandbox::network_events`](sandbox_core::Sandbox::network_events) to it;
//! 4. `detach`es on destroy (and in the background when a sandbox is dropped).
//!
//! Proxy-held secrets ([`SecretExposure::Proxy`](sandbox_core::SecretExposure::Proxy)): the
//! backend asks the enforcer to `bind_secrets` right after `prepare`; each secret's variable
//! gets its placeholder, and the certificates the sandbox trusts
//! ([`SecretPlan::ca_bundle`](sandbox_core::SecretPlan::ca_bundle): its root's system
//! bundle, the image's or the host's `/etc/ssl/certs/ca-certificates.crt`, plus the proxy's
//! interception CA) are written to `/etc/agent-sandbox-ca.crt`, which `SSL_CERT_FILE`,
//! `REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE`, `PIP_CERT`, `GIT_SSL_CAINFO` and
//! `NODE_EXTRA_CA_CERTS` name for OpenSSL, Python, curl, pip, git and Node
//! ([`CA_BUNDLE_VARS`](sandbox_core::egress::CA_BUNDLE_VARS)).

/// `/etc/resolv.conf` of a sandbox without network.
pub(crate) const DEFAULT_RESOLV_CONF: &str =
    "# agent-sandbox: no network (this namespace has only loopback)\noptions timeout:1 attempts:1\n";

/// Brings `lo` up in the network namespace of process `pid`, from a short-lived thread of
/// ours that joins it (a thread's network namespace is its own; the thread then exits, so no
/// thread of the process stays inside). Needs `CAP_SYS_ADMIN` over both namespaces (root).
/// Runs in parallel with the init's filesystem setup: the ~0.1 ms the interface takes to come
/// up (IPv4 and IPv6 addresses and routes) leaves the create's critical path.
pub(crate) fn loopback_up(pid: libc::pid_t) -> tokio::sync::oneshot::Receiver<std::io::Result<()>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    // Opened here, while `pid` is surely our live init (the thread may run after a failed
    // create reaped it, when the pid could name another process).
    let ns = match std::fs::File::open(format!("/proc/{pid}/ns/net")) {
        Ok(f) => f,
        Err(e) => {
            let _ = tx.send(Err(e));
            return rx;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("asb-netns-lo".into())
        .stack_size(64 << 10)
        .spawn(move || {
            let _ = tx.send(lo_up_in(&ns));
        });
    if let Err(e) = spawned {
        let (tx2, rx2) = tokio::sync::oneshot::channel();
        let _ = tx2.send(Err(e));
        return rx2;
    }
    rx
}

fn lo_up_in(ns: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
    nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
    // SAFETY: socket(2); the fd is ours.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this fd.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    // SAFETY: a zeroed `ifreq` is valid; the two ioctls read and write it in place.
    unsafe {
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (d, s) in ifr.ifr_name.iter_mut().zip(b"lo") {
            *d = *s as libc::c_char;
        }
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &ifr) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
