//! Shared by the backends' build scripts (`#[path]`-included, not part of the crate):
//! compiles a std-only program with the same `rustc` and target as the build, statically
//! linked when it can be (or a `no_std` shared object), so the backend can embed it with
//! `include_bytes!`.

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// Compiles `src` (a single-file, std-only program) as `crate_name` into `OUT_DIR/out_name`
/// and returns that path. Tries, in order: static non-PIE (no start-up relocations), static
/// PIE, and, when `allow_dynamic`, a dynamically linked binary. Panics (failing the build)
/// naming `what` when none links.
#[allow(dead_code)]
pub fn compile(
    src: &str,
    crate_name: &str,
    out_name: &str,
    allow_dynamic: bool,
    what: &str,
) -> PathBuf {
    println!("cargo:rerun-if-changed={src}");
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let target = env::var("TARGET").unwrap_or_default();
    let Ok(out) = env::var("OUT_DIR").map(PathBuf::from) else {
        panic!("cargo did not set OUT_DIR");
    };
    let bin = out.join(out_name);
    // 0: static, non-PIE; 1: static PIE; 2: dynamic.
    let build = |mode: u8| {
        let mut c = Command::new(&rustc);
        c.args([
            "--edition",
            "2021",
            "--crate-type",
            "bin",
            "--crate-name",
            crate_name,
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
        c.arg("-o").arg(&bin).arg(src);
        // Do not inherit flags meant for the outer crate (coverage, sanitizers...).
        c.env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("RUSTFLAGS");
        c
    };
    let ok = |mut c: Command| c.status().map(|s| s.success()).unwrap_or(false);
    let modes: &[u8] = if allow_dynamic { &[0, 1, 2] } else { &[0, 1] };
    if !modes.iter().any(|&m| ok(build(m))) {
        panic!("could not compile {what} ({src}) with {rustc}");
    }
    bin
}

/// Compiles `src` (a single-file `no_std` library) as a shared object `crate_name` into
/// `OUT_DIR/out_name` and returns that path. Panics (failing the build) naming `what` when
/// it does not link.
#[allow(dead_code)]
pub fn compile_cdylib(src: &str, crate_name: &str, out_name: &str, what: &str) -> PathBuf {
    println!("cargo:rerun-if-changed={src}");
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let target = env::var("TARGET").unwrap_or_default();
    let Ok(out) = env::var("OUT_DIR").map(PathBuf::from) else {
        panic!("cargo did not set OUT_DIR");
    };
    let lib = out.join(out_name);
    let mut c = Command::new(&rustc);
    c.args([
        "--edition",
        "2021",
        "--crate-type",
        "cdylib",
        "--crate-name",
        crate_name,
    ])
    .args([
        "-C",
        "opt-level=s",
        "-C",
        "panic=abort",
        "-C",
        "debuginfo=0",
    ])
    .args(["-C", "strip=symbols", "--cap-lints", "warn"]);
    if !target.is_empty() {
        c.args(["--target", &target]);
    }
    c.arg("-o").arg(&lib).arg(src);
    c.env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS");
    if !c.status().map(|s| s.success()).unwrap_or(false) {
        panic!("could not compile {what} ({src}) with {rustc}");
    }
    lib
}
