//! Compiles the `statx` compatibility shim (`shim/statx_compat.rs`, `no_std`) into a shared
//! object the library embeds (x86-64 Linux only; see the shim's docs for why), and the
//! published-port relay (`relay/main.rs`, std only) into a program it embeds (statically
//! linked where the C library allows).

#[path = "../sandbox-core/build-support/static_bin.rs"]
mod static_bin;

fn main() {
    println!("cargo:rerun-if-changed=../sandbox-core/build-support/static_bin.rs");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if arch == "x86_64" && os == "linux" {
        let lib = static_bin::compile_cdylib(
            "shim/statx_compat.rs",
            "statx_compat",
            "libstatx_compat.so",
            "the statx compatibility shim",
        );
        println!("cargo:rustc-env=AGENT_SANDBOX_STATX_SHIM={}", lib.display());
    }
    println!("cargo:rerun-if-changed=relay/keep.rs");
    let relay = static_bin::compile(
        "relay/main.rs",
        "agent_sandbox_relay",
        "agent-sandbox-relay",
        true,
        "the published-port relay",
        &[("sandbox_agent_proto", "../sandbox-agent-proto/src/lib.rs")],
    );
    println!("cargo:rustc-env=AGENT_SANDBOX_RELAY={}", relay.display());
}
