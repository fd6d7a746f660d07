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
        &[("sandbox_agent_proto", "../sandbox-agent-proto/src/lib.rs")],
    );
    println!("cargo:rustc-env=AGENT_SANDBOX_INIT={}", bin.display());
    // The image's identity (FNV-1a 64 of its bytes): the name of its cached copy on disk
    // (see `src/init_image.rs`), so that another build never runs this one's copy.
    let Ok(bytes) = std::fs::read(&bin) else {
        panic!("read the built sandbox init {}", bin.display());
    };
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &c| {
        (h ^ u64::from(c)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    println!("cargo:rustc-env=AGENT_SANDBOX_INIT_HASH={hash:016x}");
}
