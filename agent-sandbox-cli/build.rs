//! Links the `agent-sandbox` CLI with packed relative relocations (`DT_RELR`) where the
//! C library it is built against can load them.
//!
//! Why: the CLI is one large position-independent executable (every tier's engine is in
//! it), and the dynamic loader applies ~70,000 relative relocations at every start: about
//! 0.7 ms of CPU on a 2-vCPU host, a fifth of what `bwrap` takes for a whole one-shot run.
//! `DT_RELR` stores them as a bitmap the loader walks far faster. The binary stays
//! position-independent (full ASLR); only the relocation table's encoding changes.
//!
//! When: glibc loads `DT_RELR` from 2.36 on, and a binary linked with it requires that
//! (its `GLIBC_ABI_DT_RELR` version). So the flag is passed only for a native build
//! (`TARGET == HOST`, a `*-linux-gnu` target) on a host whose own glibc is 2.36 or newer,
//! as reported by `getconf GNU_LIBC_VERSION`; a cross build, another C library, an older
//! glibc or `AGENT_SANDBOX_NO_RELR=1` links as before. A linker too old to know the flag
//! (GNU ld before 2.38) ignores it with a warning. A binary built here and copied to a host
//! with an older glibc will not start there (the loader names the missing version); build
//! with `AGENT_SANDBOX_NO_RELR=1` for such hosts.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=AGENT_SANDBOX_NO_RELR");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let (target, host) = (var("TARGET"), var("HOST"));
    if target != host || !target.ends_with("-linux-gnu") || !var("AGENT_SANDBOX_NO_RELR").is_empty()
    {
        return;
    }
    if glibc_version().is_some_and(|v| v >= (2, 36)) {
        println!("cargo:rustc-link-arg-bin=agent-sandbox=-Wl,-z,pack-relative-relocs");
    }
}

/// The host's glibc version (`getconf GNU_LIBC_VERSION` prints `glibc 2.36`).
fn glibc_version() -> Option<(u32, u32)> {
    let out = Command::new("getconf")
        .arg("GNU_LIBC_VERSION")
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let version = text.trim().strip_prefix("glibc ")?;
    let mut parts = version.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts
        .next()?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()?;
    Some((major, minor))
}
