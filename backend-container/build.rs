//! Compiles the sandbox init (`init/main.rs` and its modules, std only) with the same `rustc`
//! and target, statically linked when the C library allows it, so the library can embed it.

#[path = "../sandbox-core/build-support/static_bin.rs"]
mod static_bin;

fn main() {
    println!("cargo:rerun-if-changed=../sandbox-core/build-support/static_bin.rs");
    // The whole directory: `main.rs`, its modules and `proto.rs` (cargo scans a directory for
    // any modified file).
    println!("cargo:rerun-if-changed=init");
    let bin = static_bin::compile(
        "init/main.rs",
        "agent_sandbox_init",
        "agent-sandbox-init",
        true,
        "the sandbox init",
    );
    println!("cargo:rustc-env=AGENT_SANDBOX_INIT={}", bin.display());
}
