//! Shared by the backends' build scripts (`#[path]`-included, not part of the crate):
//! compiles a std-only program with the same `rustc` and target as the build, statically
//! linked when it can be (or a `no_std` shared object), so the backend can embed it with
//! `include_bytes!`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `OUT_DIR/out_name`, and a note to cargo that `src` is an input.
fn output(src: &str, out_name: &str) -> PathBuf {
    println!("cargo:rerun-if-changed={src}");
    let Ok(out) = env::var("OUT_DIR").map(PathBuf::from) else {
        panic!("cargo did not set OUT_DIR");
    };
    out.join(out_name)
}

/// The build's `rustc` compiling `src` as a `crate_type` named `crate_name` into `out`,
/// small (size-optimized, aborting on panic, stripped), for the build's target, without
/// the flags meant for the outer crate (coverage, sanitizers...).
fn rustc(crate_type: &str, crate_name: &str, out: &Path, src: &str) -> Command {
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let target = env::var("TARGET").unwrap_or_default();
    let mut c = Command::new(rustc);
    c.args(["--edition", "2021", "--crate-type", crate_type])
        .args(["--crate-name", crate_name])
        .args(["-C", "opt-level=s", "-C", "panic=abort"])
        .args(["-C", "debuginfo=0", "-C", "strip=symbols"])
        .args(["--cap-lints", "warn"]);
    if !target.is_empty() {
        c.args(["--target", &target]);
    }
    c.arg("-o").arg(out).arg(src);
    c.env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS");
    c
}

fn ok(mut c: Command) -> bool {
    c.status().map(|s| s.success()).unwrap_or(false)
}

/// Compiles `src` (the crate root of a std-only program; the caller tells cargo about any
/// module files it declares) as `crate_name` into `OUT_DIR/out_name` and returns that path.
/// `libs` are the std-only, dependency-free library crates it uses, as (crate name, crate
/// root): each is compiled first, with the same flags, into an rlib in `OUT_DIR` and passed
/// with `--extern` (cargo is told to rerun when anything beside its root changes).
/// Tries, in order: static non-PIE (no start-up relocations), static PIE, and, when
/// `allow_dynamic`, a dynamically linked binary. Panics (failing the build) naming `what`
/// when none links.
#[allow(dead_code)]
pub fn compile(
    src: &str,
    crate_name: &str,
    out_name: &str,
    allow_dynamic: bool,
    what: &str,
    libs: &[(&str, &str)],
) -> PathBuf {
    let bin = output(src, out_name);
    let Some(dir) = bin.parent().map(Path::to_path_buf) else {
        panic!("no directory for {}", bin.display());
    };
    for (_, root) in libs {
        if let Some(lib_dir) = Path::new(root).parent() {
            println!("cargo:rerun-if-changed={}", lib_dir.display());
        }
    }
    // 0: static, non-PIE; 1: static PIE; 2: dynamic.
    let flags = |c: &mut Command, mode: u8| {
        if mode < 2 {
            c.args(["-C", "target-feature=+crt-static"]);
        }
        if mode == 0 {
            c.args(["-C", "relocation-model=static"]);
        }
    };
    let build = |mode: u8| {
        let mut externs = Vec::new();
        for (name, root) in libs {
            let rlib = dir.join(format!("lib{name}-{out_name}-{mode}.rlib"));
            let mut c = rustc("rlib", name, &rlib, root);
            flags(&mut c, mode);
            if !ok(c) {
                return false;
            }
            externs.push(format!("{name}={}", rlib.display()));
        }
        let mut c = rustc("bin", crate_name, &bin, src);
        flags(&mut c, mode);
        for e in &externs {
            c.args(["--extern", e]);
        }
        ok(c)
    };
    let modes: &[u8] = if allow_dynamic { &[0, 1, 2] } else { &[0, 1] };
    if !modes.iter().any(|&m| build(m)) {
        panic!("could not compile {what} ({src})");
    }
    bin
}

/// Compiles `src` (a single-file `no_std` library) as a shared object `crate_name` into
/// `OUT_DIR/out_name` and returns that path. Panics (failing the build) naming `what` when
/// it does not link.
#[allow(dead_code)]
pub fn compile_cdylib(src: &str, crate_name: &str, out_name: &str, what: &str) -> PathBuf {
    let lib = output(src, out_name);
    if !ok(rustc("cdylib", crate_name, &lib, src)) {
        panic!("could not compile {what} ({src})");
    }
    lib
}
