//! A whole plan, with the seal, through the init's wire format.

use super::*;
use crate::proto::{Dec, DecodeInit, Enc, EncodeInit};
use sandbox_core::Language;

#[test]
fn plan_round_trips_through_the_wire_format() {
    let spec = SandboxSpec::new(Language::Shell);
    let bpf = crate::seccomp::program_bytes();
    let mut ops = plan(&Plan {
        spec: &spec,
        landlock: Some(3),
        host: &host_ops(),
        user: 1000,
        hostname: "sandbox",
        resolv_conf: "",
        ca_bundle: None,
        caps: tmpfs_caps(&spec),
        loopback: true,
        layers: &[],
        workspace_fd: false,
    })
    .unwrap()
    .all();
    ops.extend(seal_ops(Some(&bpf)));
    let mut e = Enc::default();
    e.ops(&ops);
    assert_eq!(Dec::new(&e.0).ops().unwrap(), ops);
}
