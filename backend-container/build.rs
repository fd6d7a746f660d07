//! Compiles the sandbox init (`init/main.rs`, std only) with the same `rustc` and target,
//! statically linked when the C library allows it, so the library can embed it.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=init/main.rs");
    println!("cargo:rerun-if-changed=init/proto.rs");
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let target = env::var("TARGET").unwrap_or_default();
    let Ok(out) = env::var("OUT_DIR").map(PathBuf::from) else {
        panic!("cargo did not set OUT_DIR");
    };
    let bin = out.join("agent-sandbox-init");
    // 0: static, non-PIE (no start-up relocations); 1: static PIE; 2: dynamic.
    let base = |mode: u8| {
        let mut c = Command::new(&rustc);
        c.args([
            "--edition",
            "2021",
            "--crate-type",
            "bin",
            "--crate-name",
            "agent_sandbox_init",
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
        ])
        .args(["--cap-lints", "warn"]);
        if !target.is_empty() {
            c.args(["--target", &target]);
        }
        if mode < 2 {
            c.args(["-C", "target-feature=+crt-static"]);
        }
        if mode == 0 {
            c.args(["-C", "relocation-model=static"]);
        }
        c.arg("-o").arg(&bin).arg("init/main.rs");
        // Do not inherit flags meant for the outer crate (coverage, sanitizers...).
        c.env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("RUSTFLAGS");
        c
    };
    let ok = |mut c: Command| c.status().map(|s| s.success()).unwrap_or(false);
    if !ok(base(0)) && !ok(base(1)) && !ok(base(2)) {
        panic!("could not compile the sandbox init (init/main.rs) with {rustc}");
    }
    println!("cargo:rustc-env=AGENT_SANDBOX_INIT={}", bin.display());
}
