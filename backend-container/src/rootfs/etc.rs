//! The generated `/etc` files of a sandbox (`passwd`, `group`, `hostname`, `hosts`,
//! `resolv.conf`...) and how a plan writes them.

use super::Roots;
use crate::proto::Op;

/// The file under `/etc` holding [`Plan::ca_bundle`](super::Plan::ca_bundle)
/// ([`CA_BUNDLE_PATH`](sandbox_core::egress::CA_BUNDLE_PATH)).
pub(crate) const CA_BUNDLE_NAME: &str = "agent-sandbox-ca.crt";

/// The generated `/etc` files of a host-tools root (name, content): they depend only on the
/// command user, the hostname and `resolv.conf`, which makes them a template's key.
pub(crate) fn etc_files(
    user: u32,
    (name, home): (&str, &str),
    hostname: &str,
    resolv_conf: &str,
) -> Vec<(&'static str, String)> {
    let u = user;
    let passwd = if u == 0 {
        format!(
            "root:x:0:0:sandbox:{home}:/bin/sh\n\
             nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
    } else {
        format!(
            "root:x:0:0:root:/root:/bin/sh\n{name}:x:{u}:{u}:{name}:{home}:/bin/sh\n\
             nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
    };
    let group = if u == 0 {
        "root:x:0:\nnogroup:x:65534:\n".to_string()
    } else {
        format!("root:x:0:\n{name}:x:{u}:\nnogroup:x:65534:\n")
    };
    let h = hostname;
    vec![
        ("passwd", passwd),
        ("group", group),
        ("hostname", format!("{h}\n")),
        (
            "hosts",
            format!(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{h}\n"
            ),
        ),
        ("resolv.conf", resolv_conf.to_string()),
        (
            "nsswitch.conf",
            "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n\
             protocols: files\nservices: files\nethers: files\nrpc: files\n"
                .to_string(),
        ),
        (
            "gitconfig",
            "[user]\n\tname = sandbox\n\temail = sandbox@localhost\n[safe]\n\tdirectory = *\n\
             [init]\n\tdefaultBranch = main\n"
                .to_string(),
        ),
    ]
}

/// The generated `/etc` files, written.
pub(super) fn write_etc(ops: &mut Vec<Op>, r: Roots<'_>, files: Vec<(&'static str, String)>) {
    for (name, content) in files {
        ops.push(Op::WriteFile {
            path: r.at(&format!("/etc/{name}")),
            mode: 0o644,
            data: content.into_bytes(),
        });
    }
}
