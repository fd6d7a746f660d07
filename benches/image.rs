//! Images: what starting from an OCI image costs, side by side in one run.
//!
//! `cargo bench -p agent-sandbox --bench image` (root; `scripts/test-image.sh` first, and the
//! `docker-registry`, `skopeo` packages). The image is Debian 13 `minbase` + python3 + numpy
//! (one layer, ~75 MB gzip, ~200 MB unpacked).
//!
//! - `container` / `gvisor`: `create + first command (/bin/true)` from the host-tools view and
//!   from the cached image (destroy not timed). Targets: image ≤ 1.2x (container), ≤ 1.1x
//!   (gVisor) of host tools.
//! - `pull`: a first pull + unpack of the image from the CNCF registry on loopback into an
//!   empty cache (`ImageStore::pull`), against `skopeo copy docker://… oci:DIR` followed by
//!   `tar -xzf` of its layer, the same bytes over the same loopback.
//! - Printed after the runs: 50 container sandboxes from the image, each writing 1 MiB; the
//!   cache's growth (expected 0) and each sandbox's own disk (its overlay's upper layer).

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use agent_sandbox::image::testing::LocalRegistry;
use agent_sandbox::image::ImageStore;
use agent_sandbox::{Backend, ExecRequest, Language, ResolvedSecrets, SandboxSpec};
use backend_container::ContainerBackend;
use backend_gvisor::GvisorBackend;
use criterion::{criterion_group, criterion_main, Criterion};

fn layout() -> Option<PathBuf> {
    let dir = std::env::var_os("AGENT_SANDBOX_TEST_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/agent-sandbox-images"))
        .join("trixie-numpy");
    if dir.join("index.json").is_file() {
        Some(dir)
    } else {
        eprintln!(
            "SKIP image benches: no {} (run scripts/test-image.sh)",
            dir.display()
        );
        None
    }
}

fn spec(image: Option<&str>) -> SandboxSpec {
    let mut b = SandboxSpec::builder(Language::Shell);
    if let Some(i) = image {
        b = b.image(i);
    }
    b.build().unwrap()
}

/// Times create + `/bin/true` of `spec` on `backend`; the destroy is not timed.
fn create_and_true(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    rt: &tokio::runtime::Runtime,
    backend: &dyn Backend,
    spec: &SandboxSpec,
) {
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let sb = backend.create(spec, ResolvedSecrets::none()).await.unwrap();
                    assert!(sb
                        .exec(ExecRequest::argv(["/bin/true"]))
                        .await
                        .unwrap()
                        .success());
                    total += t.elapsed();
                    sb.destroy().await.unwrap();
                }
                total
            })
        })
    });
}

/// The CNCF registry on loopback holding the image as `bench/python:1` (its directory
/// dropped with it).
fn registry(layout: &Path) -> Option<(LocalRegistry, tempfile::TempDir)> {
    if let Some(why) = LocalRegistry::unavailable() {
        eprintln!("SKIP pull bench: {why}");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let reg = LocalRegistry::start(dir.path()).unwrap();
    // Pushed as tag `python3`, the layout's tag.
    reg.push(layout, "python3", "bench/python", &[]).unwrap();
    Some((reg, dir))
}

fn du(path: &Path) -> u64 {
    let out = Command::new("du")
        .args(["-s", "-B1"])
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn images(c: &mut Criterion) {
    let Some(layout) = layout() else { return };
    let image = format!("oci:{}:python3", layout.display());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let store = ImageStore::builder(cache.path()).build().unwrap();
    // Cached before anything is timed.
    rt.block_on(store.ensure(&image.parse().unwrap())).unwrap();
    let (host, from_image) = (spec(None), spec(Some(&image)));

    let container = ContainerBackend::builder()
        .image_store(store.clone())
        .build()
        .unwrap();
    if rt.block_on(container.probe()).available {
        let mut g = c.benchmark_group("image/container");
        g.sample_size(20).measurement_time(Duration::from_secs(8));
        create_and_true(
            &mut g,
            "create + first command: host tools",
            &rt,
            &container,
            &host,
        );
        create_and_true(
            &mut g,
            "create + first command: cached image",
            &rt,
            &container,
            &from_image,
        );
        g.finish();
    }
    let gvisor = GvisorBackend::builder()
        .image_store(store.clone())
        .build()
        .unwrap();
    if rt.block_on(gvisor.probe()).available {
        let mut g = c.benchmark_group("image/gvisor");
        g.sample_size(10).measurement_time(Duration::from_secs(10));
        create_and_true(
            &mut g,
            "create + first command: host tools",
            &rt,
            &gvisor,
            &host,
        );
        create_and_true(
            &mut g,
            "create + first command: cached image",
            &rt,
            &gvisor,
            &from_image,
        );
        g.finish();
    }

    if let Some((reg, _dir)) = registry(&layout) {
        let reference = format!("{}/bench/python:python3", reg.addr());
        let mut g = c.benchmark_group("image/pull");
        g.sample_size(10).measurement_time(Duration::from_secs(30));
        g.bench_function("ours: pull + unpack (empty cache)", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let dir = tempfile::tempdir().unwrap();
                    let s = ImageStore::builder(dir.path()).build().unwrap();
                    let t = Instant::now();
                    rt.block_on(s.pull(&reference.parse().unwrap())).unwrap();
                    total += t.elapsed();
                }
                total
            })
        });
        g.bench_function("skopeo copy + tar -xzf", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let dir = tempfile::tempdir().unwrap();
                    let t = Instant::now();
                    let st = Command::new("/usr/bin/skopeo")
                        .args(["copy", "--quiet", "--src-tls-verify=false"])
                        .arg(format!("docker://{reference}"))
                        .arg(format!("oci:{}:x", dir.path().join("oci").display()))
                        .status()
                        .unwrap();
                    assert!(st.success());
                    let rootfs = dir.path().join("rootfs");
                    std::fs::create_dir(&rootfs).unwrap();
                    // The largest blob is the layer.
                    let blobs = dir.path().join("oci/blobs/sha256");
                    let layer = std::fs::read_dir(&blobs)
                        .unwrap()
                        .flatten()
                        .max_by_key(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
                        .unwrap()
                        .path();
                    let st = Command::new("tar")
                        .args(["-xzf"])
                        .arg(&layer)
                        .arg("-C")
                        .arg(&rootfs)
                        .status()
                        .unwrap();
                    assert!(st.success());
                    total += t.elapsed();
                }
                total
            })
        });
        g.finish();
        let layer_bytes = du(&layout.join("blobs"));
        eprintln!("pull: the layout's blobs take {layer_bytes} bytes (MB/s = that / time)");
    }

    // Density: 50 sandboxes from one image, each writing 1 MiB.
    if rt.block_on(container.probe()).available {
        let before = du(cache.path());
        let sandboxes: Vec<_> = (0..50)
            .map(|_| {
                rt.block_on(container.create(&from_image, ResolvedSecrets::none()))
                    .unwrap()
            })
            .collect();
        let mut own = String::new();
        for sb in &sandboxes {
            let r = rt
                .block_on(sb.exec(ExecRequest::code(
                    "head -c 1048576 /dev/zero > /var/tmp/own-1MiB && du -s -B1 /var/tmp/own-1MiB",
                )))
                .unwrap();
            assert!(r.success(), "{r:?}");
            own = r
                .stdout_str()
                .split_whitespace()
                .next()
                .unwrap_or("")
                .to_owned();
        }
        let after = du(cache.path());
        eprintln!(
            "density: 50 container sandboxes from one image, 1 MiB written each: cache {} -> {} bytes \
             (growth {}); each sandbox's own disk: {own} bytes in its overlay's upper layer (its tmpfs)",
            before,
            after,
            after as i64 - before as i64
        );
        for sb in sandboxes {
            rt.block_on(sb.destroy()).unwrap();
        }
    }
}

criterion_group!(benches, images);
criterion_main!(benches);
