//! The virtio-net device, driven by a tiny guest (its own polling driver, in
//! `guests/tiny.c`): frames both ways over a datagram socketpair and over a real TAP device
//! in a network namespace the test makes; malformed chains, frames too large for the
//! guest's buffers, a flood nobody reads (with buffers posted, and a guest that never drives
//! the device), and a host side that disappears.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::sync::Arc;
use std::time::Duration;

use backend_microvm::devices::virtio::net::{open_tap_in, NetCounters};
use backend_microvm::vmm::{Entry, NetConfig, Vm, VmExit};
use common::*;

const MAC: [u8; 6] = [0x02, 0x61, 0x73, 0x62, 0x00, 0x07];
const HOST_MAC: [u8; 6] = [0x02, 0x61, 0x73, 0x62, 0x00, 0xfe];
const ETHERTYPE: [u8; 2] = [0x88, 0xb5];

macro_rules! skip_without_kvm {
    () => {
        if let Some(why) = skip_reason() {
            eprintln!("SKIP: {why}");
            return;
        }
    };
}

/// A VM with a network device whose host side is `fd`, running tiny-guest test `test`.
fn start(fd: OwnedFd, test: u64) -> Vm {
    let mut c = cfg();
    c.net = Some(NetConfig::new(MAC, Arc::new(fd)));
    let (mut vm, entry) = vm_with_guest(c);
    vm.start(Entry::user(entry).with_arg(test)).unwrap();
    vm
}

/// An Ethernet frame from the host to the guest carrying `payload`.
fn host_frame(payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&HOST_MAC);
    f.extend_from_slice(&ETHERTYPE);
    f.extend_from_slice(payload);
    f
}

/// Sends frames until the socket pushes back (at most 100,000); returns how many went.
fn flood(host: &UnixDatagram) -> usize {
    host.set_nonblocking(true).unwrap();
    let mut flooded = 0;
    while flooded < 100_000 {
        match host.send(&host_frame(b"flood")) {
            Ok(_) => flooded += 1,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("flood: {e}"),
        }
    }
    flooded
}

/// `sock.recv(buf)`, again when a signal interrupted it (a socket with a receive timeout
/// answers `EINTR` whatever the handler's `SA_RESTART`).
fn recv(sock: &UnixDatagram, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match sock.recv(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// Checks the guest's frame: broadcast, from its MAC, our EtherType, its payload.
fn assert_guest_frame(f: &[u8]) {
    assert_eq!(&f[..6], &[0xff; 6], "destination: broadcast");
    assert_eq!(&f[6..12], &MAC, "source: the configured MAC");
    assert_eq!(&f[12..14], &ETHERTYPE);
    assert_eq!(&f[14..], b"frame from the guest");
}

fn counters(vm: &Vm) -> Arc<NetCounters> {
    vm.net_counters().expect("the VM has a network device")
}

#[test]
fn frames_travel_both_ways_over_a_socketpair() {
    skip_without_kvm!();
    let (host, dev) = UnixDatagram::pair().unwrap();
    host.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let vm = start(dev.into(), t::NET_ECHO);
    let mut buf = [0u8; 2048];
    let n = recv(&host, &mut buf).expect("the guest's frame");
    assert_guest_frame(&buf[..n]);
    host.send(&host_frame(b"frame from the host")).unwrap();
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 15 });
    let serial = String::from_utf8_lossy(&vm.serial_output()).into_owned();
    assert!(
        serial.contains("guest got: frame from the host"),
        "{serial}"
    );
    // The guest read its MAC from the config space (each byte printed as a 64-bit hex).
    assert!(serial.contains("mac 0x0000000000000002"), "{serial}");
    assert_eq!(counters(&vm).snapshot(), (1, 0, 1, 0));
}

#[test]
fn a_chain_shorter_than_the_header_is_dropped_and_counted() {
    skip_without_kvm!();
    let (host, dev) = UnixDatagram::pair().unwrap();
    let vm = start(dev.into(), t::NET_BAD_THEN_GOOD);
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 16 });
    host.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 2048];
    let n = host.recv(&mut buf).expect("the good frame");
    assert_guest_frame(&buf[..n]);
    assert_eq!(
        host.recv(&mut buf).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "only the good frame reaches the host"
    );
    let (rx, rx_dropped, tx, tx_dropped) = counters(&vm).snapshot();
    assert_eq!((rx, rx_dropped, tx, tx_dropped), (0, 0, 1, 1));
}

#[test]
fn an_oversized_frame_is_dropped_and_a_flood_stays_bounded() {
    skip_without_kvm!();
    let (host, dev) = UnixDatagram::pair().unwrap();
    let vm = start(dev.into(), t::NET_SMALL_BUFFERS);
    assert!(wait_serial(&vm, "R"));
    // Larger than the guest's 256-byte buffers.
    host.send(&host_frame(&[b'x'; 1000])).unwrap();
    host.send(&host_frame(b"frame from the host")).unwrap();
    // Then more than anyone reads: the socket fills and refuses, the device holds at most
    // one frame, and the VM carries on.
    let flooded = flood(&host);
    assert!(flooded < 100_000, "the socket never pushed back");
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 17 });
    let serial = String::from_utf8_lossy(&vm.serial_output()).into_owned();
    assert!(
        serial.contains("guest got: frame from the host"),
        "{serial}"
    );
    let (rx, rx_dropped, _, _) = counters(&vm).snapshot();
    assert_eq!(
        (rx, rx_dropped),
        (1, 1),
        "one delivered, the oversized one dropped"
    );
}

#[test]
fn a_guest_that_never_drives_the_device_leaves_a_flood_in_the_host_side() {
    skip_without_kvm!();
    let (host, dev) = UnixDatagram::pair().unwrap();
    // The guest never touches its network device (no feature negotiation, no queues, no
    // DRIVER_OK): it prints and waits.
    let vm = start(dev.into(), t::WAIT_GO);
    assert!(wait_serial(&vm, "W"));
    let flooded = flood(&host);
    // The device read nothing for a guest without buffers: the socket's own bound pushed
    // back, nothing was delivered or queued in the VMM, and the guest runs on.
    assert!(flooded < 100_000, "the socket never pushed back");
    assert!(flooded > 0);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(counters(&vm).snapshot(), (0, 0, 0, 0));
    assert_eq!(vm.exit(), None);
    set_go(&vm);
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 11 });
    assert_eq!(vm.virtio_errors(), vec![None]);
}

#[test]
fn a_host_side_that_disappears_drops_frames_and_the_vm_runs_on() {
    skip_without_kvm!();
    let (host, dev) = UnixDatagram::pair().unwrap();
    let vm = start(dev.into(), t::NET_BAD_THEN_WAIT);
    assert!(wait_serial(&vm, "W"));
    drop(host);
    set_go(&vm);
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 16 });
    let (_, _, tx, tx_dropped) = counters(&vm).snapshot();
    assert_eq!(tx, 1, "the frame sent before the host side went");
    assert_eq!(tx_dropped, 3, "the short chain and both frames after");
}

/// A network namespace made for one test (`ip netns`), deleted on drop.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Option<Netns> {
        let name = format!("asb-net-{tag}-{}", std::process::id());
        let ok = std::process::Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Netns(name))
    }

    fn path(&self) -> std::path::PathBuf {
        format!("/run/netns/{}", self.0).into()
    }

    fn ip(&self, args: &[&str]) {
        let st = std::process::Command::new("ip")
            .args(["-n", &self.0])
            .args(args)
            .status()
            .unwrap();
        assert!(st.success(), "ip -n {} {args:?}", self.0);
    }

    fn sysctl(&self, kv: &str) {
        let st = std::process::Command::new("ip")
            .args(["netns", "exec", &self.0, "sysctl", "-qw", kv])
            .status()
            .unwrap();
        assert!(st.success(), "sysctl {kv} in {}", self.0);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .status();
    }
}

/// A raw packet socket on interface `ifname` of namespace `ns`, for our EtherType only.
fn packet_socket(ns: &Netns, ifname: &str) -> (OwnedFd, i32) {
    let path = ns.path();
    let ifname = std::ffi::CString::new(ifname).unwrap();
    std::thread::spawn(move || {
        let nsf = std::fs::File::open(path).unwrap();
        // SAFETY: setns on this short-lived thread, with a descriptor we hold open.
        let entered = unsafe { libc::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(entered, 0, "{}", std::io::Error::last_os_error());
        let proto = u16::from_be_bytes(ETHERTYPE).to_be();
        // SAFETY: socket(2) with constant arguments.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
        assert!(raw >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: `raw` was just made and is owned by nobody else.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        // SAFETY: if_nametoindex reads a NUL-terminated string.
        let index = unsafe { libc::if_nametoindex(ifname.as_ptr()) } as i32;
        assert!(index > 0);
        // SAFETY: a zeroed sockaddr_ll is valid; we fill what bind needs.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = index;
        // SAFETY: bind with a sockaddr_ll of its stated size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        let tv = libc::timeval {
            tv_sec: 30,
            tv_usec: 0,
        };
        // SAFETY: setsockopt with a timeval of its stated size.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        (fd, index)
    })
    .join()
    .unwrap()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn frames_travel_both_ways_through_a_tap_in_a_network_namespace() {
    skip_without_kvm!();
    if !is_root() || !std::path::Path::new("/dev/net/tun").exists() {
        eprintln!("SKIP: TAP devices need root and /dev/net/tun");
        return;
    }
    let Some(ns) = Netns::new("tap") else {
        eprintln!("SKIP: `ip netns add` failed (is iproute2 installed?)");
        return;
    };
    // Only our frames on the link: no IPv6 neighbour discovery towards the guest.
    ns.sysctl("net.ipv6.conf.default.disable_ipv6=1");
    let (tap, name) = open_tap_in(&ns.path(), "asbtap0").unwrap();
    assert_eq!(name, "asbtap0");
    ns.ip(&["link", "set", "asbtap0", "up"]);
    let (sock, index) = packet_socket(&ns, "asbtap0");
    let vm = start(tap, t::NET_ECHO);
    let mut buf = [0u8; 2048];
    // SAFETY: recv into a live buffer of its size.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    assert!(
        n > 0,
        "the guest's frame: {}",
        std::io::Error::last_os_error()
    );
    assert_guest_frame(&buf[..n as usize]);
    let reply = host_frame(b"frame from the host");
    // SAFETY: a zeroed sockaddr_ll is valid; we fill what sendto needs.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = libc::AF_PACKET as u16;
    to.sll_ifindex = index;
    to.sll_halen = 6;
    to.sll_addr[..6].copy_from_slice(&MAC);
    // SAFETY: sendto from a live buffer with a sockaddr_ll of its stated size.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            reply.as_ptr().cast(),
            reply.len(),
            0,
            (&to as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    assert_eq!(
        sent,
        reply.len() as isize,
        "{}",
        std::io::Error::last_os_error()
    );
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 15 });
    let serial = String::from_utf8_lossy(&vm.serial_output()).into_owned();
    assert!(
        serial.contains("guest got: frame from the host"),
        "{serial}"
    );
    assert_eq!(counters(&vm).snapshot(), (1, 0, 1, 0));
}

#[test]
fn a_tap_deleted_under_a_running_vm_drops_frames_and_the_vm_runs_on() {
    skip_without_kvm!();
    if !is_root() || !std::path::Path::new("/dev/net/tun").exists() {
        eprintln!("SKIP: TAP devices need root and /dev/net/tun");
        return;
    }
    let Some(ns) = Netns::new("del") else {
        eprintln!("SKIP: `ip netns add` failed (is iproute2 installed?)");
        return;
    };
    let (tap, _) = open_tap_in(&ns.path(), "asbtap1").unwrap();
    ns.ip(&["link", "set", "asbtap1", "up"]);
    let vm = start(tap, t::NET_BAD_THEN_WAIT);
    assert!(wait_serial(&vm, "W"));
    ns.ip(&["link", "del", "asbtap1"]);
    set_go(&vm);
    assert_eq!(vm.wait(), VmExit::GuestExit { code: 16 });
    let (_, _, tx, tx_dropped) = counters(&vm).snapshot();
    eprintln!("after the delete: {tx} frames sent, {tx_dropped} dropped");
    assert_eq!(tx + tx_dropped, 4, "every chain accounted for");
    assert!(
        tx_dropped >= 3,
        "the short chain and both frames after the delete"
    );
}

#[test]
fn a_snapshot_restores_onto_a_new_host_side_and_needs_one() {
    skip_without_kvm!();
    let (host, dev) = UnixDatagram::pair().unwrap();
    let vm = start(dev.into(), t::NET_BAD_THEN_WAIT);
    assert!(wait_serial(&vm, "W"));
    let dir = tempfile::tempdir().unwrap();
    vm.snapshot(dir.path()).unwrap();
    drop(vm);
    drop(host);
    // Without a network device, or with another MAC: refused, nothing started.
    for other in [None, Some([0x02, 0, 0, 0, 0, 0x99])] {
        let mut c = cfg();
        if let Some(mac) = other {
            let (_h, d) = UnixDatagram::pair().unwrap();
            c.net = Some(NetConfig::new(mac, Arc::new(d.into())));
        }
        let e = Vm::restore(dir.path(), c).unwrap_err();
        assert!(
            matches!(e, backend_microvm::vmm::VmmError::SnapshotIncompatible(_)),
            "{e}"
        );
    }
    // With one: the restored guest's frames reach the new host side.
    let (host2, dev2) = UnixDatagram::pair().unwrap();
    host2
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut c = cfg();
    c.net = Some(NetConfig::new(MAC, Arc::new(dev2.into())));
    let restored = Vm::restore(dir.path(), c).unwrap();
    set_go(&restored);
    let mut buf = [0u8; 2048];
    for _ in 0..2 {
        let n = recv(&host2, &mut buf).expect("a frame from the restored guest");
        assert_guest_frame(&buf[..n]);
    }
    assert_eq!(restored.wait(), VmExit::GuestExit { code: 16 });
}
