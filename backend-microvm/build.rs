//! Compiles the guest agent (`guest-agent/src/main.rs`, std only) with the same `rustc` as a
//! static binary, so the library can embed it as `/init` of the guest's initramfs
//! (`env!("MICROVM_GUEST_AGENT")` is its path).

#[path = "../sandbox-core/build-support/static_bin.rs"]
mod static_bin;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../sandbox-core/build-support/static_bin.rs");
    // Every module of the agent (main.rs, proto.rs, root.rs, ...).
    println!("cargo:rerun-if-changed=guest-agent/src");
    // The guest has no C library: the agent must be static.
    let bin = static_bin::compile(
        "guest-agent/src/main.rs",
        "microvm_guest_agent",
        "microvm-guest-agent",
        false,
        "the guest agent statically",
        &[("sandbox_agent_proto", "../sandbox-agent-proto/src/lib.rs")],
    );
    println!("cargo:rustc-env=MICROVM_GUEST_AGENT={}", bin.display());
}
