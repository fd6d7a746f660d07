//! The guest's network: `agent.net=<addr>/<prefix>,<gateway>` on the kernel command line
//! configures `eth0` (the VMM's virtio-net device) with that IPv4 address, a default route
//! through the gateway, and `/etc/resolv.conf` naming the gateway as the DNS server (the
//! host side answers DNS there and polices everything else). Without `agent.net=` the guest
//! has no network module loaded and no interface but `lo`.
//!
//! Plain ioctls (`SIOCSIFADDR`, `SIOCSIFNETMASK`, `SIOCSIFFLAGS`, `SIOCADDRT`): the agent
//! needs no `ip` binary in the guest, which an image may not have.

use std::fs;
use std::io;
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::c_int;
use crate::setup::{load_modules, MODULES};

/// The list of the network modules in the initramfs (see `initramfs::NET_MODULES_DEP`).
pub(crate) const NET_MODULES_DEP: &str = "net-modules.dep";
/// The interface the VMM's device becomes.
const IFACE: &str = "eth0";
/// How long the driver may take to create the interface.
const IFACE_WAIT: Duration = Duration::from_secs(10);

/// `agent.net=`: the guest's address, prefix length and gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NetConfig {
    pub(crate) addr: Ipv4Addr,
    pub(crate) prefix: u8,
    pub(crate) gateway: Ipv4Addr,
}

/// Reads `agent.net=` from a kernel command line (`None`: no network).
pub(crate) fn net_config(cmdline: &str) -> Result<Option<NetConfig>, String> {
    let Some(v) = cmdline
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("agent.net="))
        .next_back()
    else {
        return Ok(None);
    };
    let bad = || format!("agent.net={v}: expected <IPv4 address>/<prefix 1-30>,<IPv4 gateway>");
    let (cidr, gateway) = v.split_once(',').ok_or_else(bad)?;
    let (addr, prefix) = cidr.split_once('/').ok_or_else(bad)?;
    let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
    let prefix: u8 = prefix.parse().map_err(|_| bad())?;
    let gateway: Ipv4Addr = gateway.parse().map_err(|_| bad())?;
    if !(1..=30).contains(&prefix) || addr.is_unspecified() || gateway.is_unspecified() {
        return Err(bad());
    }
    let mask = u32::MAX << (32 - u32::from(prefix));
    if u32::from(addr) & mask != u32::from(gateway) & mask || addr == gateway {
        return Err(format!(
            "agent.net={v}: the gateway must be another address on the guest's network"
        ));
    }
    Ok(Some(NetConfig {
        addr,
        prefix,
        gateway,
    }))
}

/// The network modules' list, or why the initramfs has none.
pub(crate) fn net_modules_list(dir: &Path) -> Result<String, String> {
    fs::read_to_string(dir.join(NET_MODULES_DEP)).map_err(|e| {
        format!(
            "this initramfs has no network modules ({NET_MODULES_DEP}: {e}); it was built by an \
             older version: install the guest again"
        )
    })
}

/// Loads the network driver, waits for `eth0`, and configures it and the route.
pub(crate) fn bring_up(c: &NetConfig) -> Result<(), String> {
    let list = net_modules_list(Path::new(MODULES))?;
    if let Some(e) = load_modules(Path::new(MODULES), &list).first() {
        return Err(format!("loading the network driver: {e}"));
    }
    let sys = Path::new("/sys/class/net").join(IFACE);
    let start = Instant::now();
    while !sys.exists() {
        if start.elapsed() > IFACE_WAIT {
            return Err(format!(
                "no {IFACE} after {IFACE_WAIT:?}: the VM has no network device, or its driver \
                 did not bind"
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    configure(c).map_err(|e| format!("configuring {IFACE}: {e}"))
}

/// Moves a configured `eth0` to another link's settings (a guest restored onto a network of
/// its own): down (the kernel drops its routes and neighbour entries, among them the old
/// gateway's MAC), the new address, up with the default route, and `resolv.conf`.
pub(crate) fn reconfigure(c: &NetConfig) -> Result<(), String> {
    with_socket(|fd| {
        let mut flags = ifreq(SockAddr::inet(Ipv4Addr::UNSPECIFIED));
        ioctl_on(fd, SIOCGIFFLAGS, &mut flags, "read the flags")?;
        flags.addr.family &= !IFF_UP;
        ioctl_on(fd, SIOCSIFFLAGS, &mut flags, "take it down")?;
        configure_on(fd, c)
    })
    .map_err(|e| format!("reconfiguring {IFACE}: {e}"))?;
    write_resolv_conf(c)
}

/// Writes `/etc/resolv.conf` (after any root switch, so in the root commands see).
pub(crate) fn write_resolv_conf(c: &NetConfig) -> Result<(), String> {
    // An image's own file may be a symlink (systemd-resolved): replace it.
    let path = Path::new("/etc/resolv.conf");
    let _ = fs::remove_file(path);
    fs::write(path, format!("nameserver {}\n", c.gateway))
        .map_err(|e| format!("writing {}: {e}", path.display()))
}

extern "C" {
    fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int;
    fn close(fd: c_int) -> c_int;
}

const AF_INET: u16 = 2;
const SOCK_DGRAM: c_int = 2;
const SOCK_CLOEXEC: c_int = 0o2000000;
const SIOCGIFFLAGS: u64 = 0x8913;
const SIOCSIFFLAGS: u64 = 0x8914;
const SIOCSIFADDR: u64 = 0x8916;
const SIOCSIFNETMASK: u64 = 0x891c;
const SIOCADDRT: u64 = 0x890b;
const IFF_UP: u16 = 1;
const RTF_UP: u16 = 1;
const RTF_GATEWAY: u16 = 2;

/// `struct sockaddr` holding a `sockaddr_in`.
#[repr(C)]
#[derive(Clone, Copy)]
struct SockAddr {
    family: u16,
    port: u16,
    addr: [u8; 4],
    zero: [u8; 8],
}

impl SockAddr {
    fn inet(a: Ipv4Addr) -> SockAddr {
        SockAddr {
            family: AF_INET,
            port: 0,
            addr: a.octets(),
            zero: [0; 8],
        }
    }
}

/// `struct ifreq` with its union as a `sockaddr` or the flags.
#[repr(C)]
struct IfReq {
    name: [u8; 16],
    addr: SockAddr,
    pad: [u8; 8],
}

/// `struct rtentry` (x86-64 layout).
#[repr(C)]
struct RtEntry {
    pad1: u64,
    dst: SockAddr,
    gateway: SockAddr,
    genmask: SockAddr,
    flags: u16,
    pad2: i16,
    pad3: u64,
    pad4: *mut std::ffi::c_void,
    metric: i16,
    dev: *mut std::ffi::c_char,
    mtu: u64,
    window: u64,
    irtt: u16,
}

fn ifreq(addr: SockAddr) -> IfReq {
    ifreq_for(IFACE, addr)
}

fn ifreq_for(iface: &str, addr: SockAddr) -> IfReq {
    let mut name = [0u8; 16];
    name[..iface.len()].copy_from_slice(iface.as_bytes());
    IfReq {
        name,
        addr,
        pad: [0; 8],
    }
}

fn configure(c: &NetConfig) -> io::Result<()> {
    with_socket(|fd| configure_on(fd, c))
}

/// Runs `f` with an `AF_INET` datagram socket (for the interface ioctls), closed after.
fn with_socket(f: impl FnOnce(c_int) -> io::Result<()>) -> io::Result<()> {
    // SAFETY: socket(2) with constant arguments.
    let fd = unsafe { socket(c_int::from(AF_INET), SOCK_DGRAM | SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let r = f(fd);
    // SAFETY: closing the socket made above.
    unsafe { close(fd) };
    r
}

/// Brings the loopback interface up (the kernel gives it 127.0.0.1 then): programs in the
/// guest talk to each other over `localhost` with or without a network device.
pub(crate) fn loopback_up() -> io::Result<()> {
    with_socket(|fd| {
        let mut flags = ifreq_for("lo", SockAddr::inet(Ipv4Addr::UNSPECIFIED));
        ioctl_on(fd, SIOCGIFFLAGS, &mut flags, "read the flags of lo")?;
        flags.addr.family |= IFF_UP;
        ioctl_on(fd, SIOCSIFFLAGS, &mut flags, "bring lo up")
    })
}

fn ioctl_on<T>(fd: c_int, req: u64, arg: &mut T, what: &str) -> io::Result<()> {
    // SAFETY: each request used here reads (and for SIOCGIFFLAGS writes) a structure of the
    // kernel's layout, which `T` is (`IfReq` or `RtEntry`, `repr(C)`, at least as large).
    if unsafe { crate::interactive::ioctl(fd, req, arg as *mut T) } < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

fn configure_on(fd: c_int, c: &NetConfig) -> io::Result<()> {
    let mask = Ipv4Addr::from(u32::MAX << (32 - u32::from(c.prefix)));
    ioctl_on(
        fd,
        SIOCSIFADDR,
        &mut ifreq(SockAddr::inet(c.addr)),
        "set the address",
    )?;
    ioctl_on(
        fd,
        SIOCSIFNETMASK,
        &mut ifreq(SockAddr::inet(mask)),
        "set the netmask",
    )?;
    let mut flags = ifreq(SockAddr::inet(Ipv4Addr::UNSPECIFIED));
    ioctl_on(fd, SIOCGIFFLAGS, &mut flags, "read the flags")?;
    // The flags are the union's first `short`: the sockaddr's `family` field here.
    flags.addr.family |= IFF_UP;
    ioctl_on(fd, SIOCSIFFLAGS, &mut flags, "bring it up")?;
    let any = SockAddr::inet(Ipv4Addr::UNSPECIFIED);
    let mut route = RtEntry {
        pad1: 0,
        dst: any,
        gateway: SockAddr::inet(c.gateway),
        genmask: any,
        flags: RTF_UP | RTF_GATEWAY,
        pad2: 0,
        pad3: 0,
        pad4: std::ptr::null_mut(),
        metric: 0,
        dev: std::ptr::null_mut(),
        mtu: 0,
        window: 0,
        irtt: 0,
    };
    ioctl_on(fd, SIOCADDRT, &mut route, "add the default route")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_net_is_parsed_and_checked() {
        assert_eq!(net_config("console=ttyS0 quiet").unwrap(), None);
        assert_eq!(
            net_config("agent.root=/dev/vda agent.net=10.200.0.2/30,10.200.0.1").unwrap(),
            Some(NetConfig {
                addr: Ipv4Addr::new(10, 200, 0, 2),
                prefix: 30,
                gateway: Ipv4Addr::new(10, 200, 0, 1),
            })
        );
        for bad in [
            "agent.net=",
            "agent.net=10.200.0.2",
            "agent.net=10.200.0.2/30",
            "agent.net=10.200.0.2/31,10.200.0.1",
            "agent.net=10.200.0.2/0,10.200.0.1",
            "agent.net=10.200.0.2/30,10.201.0.1",
            "agent.net=10.200.0.2/30,10.200.0.2",
            "agent.net=0.0.0.0/30,10.200.0.1",
            "agent.net=::1/30,10.200.0.1",
        ] {
            assert!(net_config(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn structures_have_the_kernels_sizes() {
        assert_eq!(std::mem::size_of::<SockAddr>(), 16);
        assert_eq!(std::mem::size_of::<IfReq>(), 40);
        assert_eq!(std::mem::size_of::<RtEntry>(), 120);
        assert_eq!(std::mem::offset_of!(RtEntry, flags), 56);
        assert_eq!(std::mem::offset_of!(RtEntry, dev), 88);
    }

    #[test]
    fn an_initramfs_without_network_modules_is_named_as_such() {
        let dir = std::env::temp_dir().join(format!("agent-net-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let e = net_modules_list(&dir).unwrap_err();
        assert!(e.contains("install the guest again"), "{e}");
        fs::write(dir.join(NET_MODULES_DEP), "kernel/virtio_net.ko:\n").unwrap();
        assert_eq!(net_modules_list(&dir).unwrap(), "kernel/virtio_net.ko:\n");
        let _ = fs::remove_dir_all(&dir);
    }
}
