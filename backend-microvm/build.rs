//! Compiles the guest agent (`guest-agent/src/main.rs`, std only) with the same `rustc` as a
//! static binary, so the library can embed it as `/init` of the guest's initramfs
//! (`env!("MICROVM_GUEST_AGENT")` is its path).

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=guest-agent/src/main.rs");
    println!("cargo:rerun-if-changed=guest-agent/src/proto.rs");
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let target = env::var("TARGET").unwrap_or_default();
    let Ok(out) = env::var("OUT_DIR").map(PathBuf::from) else {
        panic!("cargo did not set OUT_DIR");
    };
    let bin = out.join("microvm-guest-agent");
    // The guest has no C library: the agent must be static. 0: static, non-PIE (no start-up
    // relocations); 1: static PIE.
    let build = |mode: u8| {
        let mut c = Command::new(&rustc);
        c.args([
            "--edition",
            "2021",
            "--crate-type",
            "bin",
            "--crate-name",
            "microvm_guest_agent",
        ])
        .args([
            "-C",
            "opt-level=s",
            "-C",
            "panic=abort",
            "-C",
            "debuginfo=0",
            "-C",
            "strip=symbols",
            "-C",
            "target-feature=+crt-static",
        ])
        .args(["--cap-lints", "warn"]);
        if !target.is_empty() {
            c.args(["--target", &target]);
        }
        if mode == 0 {
            c.args(["-C", "relocation-model=static"]);
        }
        c.arg("-o").arg(&bin).arg("guest-agent/src/main.rs");
        // Do not inherit flags meant for the outer crate (coverage, sanitizers...).
        c.env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("RUSTFLAGS");
        c
    };
    let ok = |mut c: Command| c.status().map(|s| s.success()).unwrap_or(false);
    if !ok(build(0)) && !ok(build(1)) {
        panic!(
            "could not compile the guest agent (guest-agent/src/main.rs) statically with {rustc}"
        );
    }
    println!("cargo:rustc-env=MICROVM_GUEST_AGENT={}", bin.display());
}
