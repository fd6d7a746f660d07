//! A real userland from an OCI image in every Linux tier this host can run: Debian 13's
//! python3 (3.13, where the host has 3.11) built by `scripts/test-image.sh` (mmdebstrap),
//! started from an OCI layout through the library and from the real CNCF registry on loopback
//! through the CLI, as users do. Tiers that cannot start images refuse with `Unsupported`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agent_sandbox::image::ImageStore;
use agent_sandbox::{
    Error, ExecRequest, Language, Question, Runtime, SandboxSpec, Tier, TierChoice,
};

/// The layout `scripts/test-image.sh` makes, or why there is none.
fn test_image() -> Result<PathBuf, String> {
    let dir = std::env::var_os("AGENT_SANDBOX_TEST_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/agent-sandbox-images"))
        .join("trixie-numpy");
    if dir.join("index.json").is_file() {
        Ok(dir)
    } else {
        Err(format!(
            "no test image at {} (scripts/test-image.sh builds it; scripts/test.sh runs that)",
            dir.display()
        ))
    }
}

/// [`test_image`], or `None` after printing why the test skips.
fn test_image_or_skip() -> Option<PathBuf> {
    test_image().map_err(|why| eprintln!("SKIP: {why}")).ok()
}

fn python_spec(image: &str) -> SandboxSpec {
    SandboxSpec::builder(Language::Python)
        .image(image)
        .wall_time(Duration::from_secs(60))
        .build()
        .unwrap()
}

const PROBE: &str = "import sys, pathlib\n\
    data = pathlib.Path('/workspace/in.txt').read_text()\n\
    pathlib.Path('/workspace/out.txt').write_text(data.upper())\n\
    print('%d.%d' % sys.version_info[:2])";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_python_runs_in_every_linux_tier() {
    let Some(layout) = test_image_or_skip() else {
        return;
    };
    let cache = tempfile::tempdir().unwrap();
    let store = ImageStore::builder(cache.path()).build().unwrap();
    let rt = Runtime::builder()
        .with_default_tiers()
        .image_store(store.clone())
        .build();
    let spec = python_spec(&format!("oci:{}:python3", layout.display()));
    let mut ran = 0;
    for status in rt.probe().await {
        let tier = status.tier;
        let caps = rt.backend(tier).map(|b| b.capabilities());
        if !caps.as_ref().is_some_and(|c| c.images) {
            // Honest refusal, named.
            if status.available {
                match rt.create(&spec, TierChoice::Tier(tier)).await {
                    Err(Error::Unsupported { what, .. }) => {
                        assert!(what.contains("image"), "{tier}: {what}")
                    }
                    Err(e) => panic!("{tier}: expected Unsupported, got {e}"),
                    Ok(_) => panic!("{tier}: started an image it cannot run"),
                }
            }
            continue;
        }
        if !status.available {
            eprintln!("SKIP {tier}: {}", status.reason);
            continue;
        }
        let sb = rt.create(&spec, TierChoice::Tier(tier)).await.unwrap();
        sb.write_file("in.txt", b"shout").await.unwrap();
        let r = sb.exec(ExecRequest::code(PROBE)).await.unwrap();
        assert!(r.success(), "{tier}: {r:?}");
        assert_eq!(
            r.stdout_str(),
            "3.13\n",
            "{tier}: the image's Python, not the host's"
        );
        assert_eq!(sb.read_file("out.txt").await.unwrap(), b"SHOUT", "{tier}");
        if caps.as_ref().is_some_and(|c| c.publish && c.processes) {
            assert_eq!(serve_and_fetch(sb.as_ref()).await, "SHOUT", "{tier}");
        }
        sb.destroy().await.unwrap();
        ran += 1;
    }
    eprintln!("ran on {ran} tiers");

    // Auto passes over tiers without images (wasm ranks first for untrusted Python).
    if rt
        .probe()
        .await
        .iter()
        .any(|s| s.available && rt.backend(s.tier).is_some_and(|b| b.capabilities().images))
    {
        let sb = rt
            .create(&spec, TierChoice::Auto(Question::new(Language::Python)))
            .await
            .unwrap();
        assert!(
            matches!(sb.tier(), Tier::Container | Tier::Gvisor | Tier::Microvm),
            "{}",
            sb.tier()
        );
        sb.destroy().await.unwrap();
    }
}

/// The image's own `python3 -m http.server` serving the workspace, published on the host's
/// loopback: the body of `GET /out.txt` from the host.
async fn serve_and_fetch(sb: &dyn agent_sandbox::Sandbox) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut server = sb
        .spawn(ExecRequest::argv([
            "python3",
            "-m",
            "http.server",
            "8000",
            "--bind",
            "127.0.0.1",
            "--directory",
            "/workspace",
        ]))
        .await
        .unwrap();
    let at = sb
        .publish(8000, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut reply = String::new();
    // The server needs a moment to listen: until then a connection closes empty.
    for _ in 0..100 {
        let mut c = tokio::net::TcpStream::connect(at).await.unwrap();
        c.write_all(b"GET /out.txt HTTP/1.0\r\n\r\n").await.unwrap();
        let mut all = Vec::new();
        let _ = c.read_to_end(&mut all).await;
        reply = String::from_utf8_lossy(&all).into_owned();
        if !reply.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server
        .signal(agent_sandbox::Signal::Terminate)
        .await
        .unwrap();
    let _ = server.wait(Some(Duration::from_secs(30))).await;
    assert!(reply.starts_with("HTTP/1.0 200"), "{reply:?}");
    reply
        .rsplit("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The CNCF registry on loopback holding the test image as `trixie/python3:13`, in a
/// temporary directory (dropped with it).
struct Registry {
    inner: agent_sandbox::image::testing::LocalRegistry,
    reference: String,
    _dir: tempfile::TempDir,
}

fn registry(layout: &std::path::Path) -> Option<Registry> {
    use agent_sandbox::image::testing::LocalRegistry;
    if let Some(why) = LocalRegistry::unavailable() {
        eprintln!("SKIP: {why}");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let inner = LocalRegistry::start(dir.path()).unwrap();
    inner
        .push(layout, "python3", "trixie/python3", &[])
        .unwrap();
    let reference = format!("{}/trixie/python3:python3", inner.addr());
    Some(Registry {
        inner,
        reference,
        _dir: dir,
    })
}

fn cli(args: &[&str], cache: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(args)
        .env("AGENT_SANDBOX_IMAGE_CACHE", cache)
        .output()
        .unwrap()
}

#[test]
fn the_cli_runs_an_image_from_a_plain_http_loopback_registry() {
    let Some(layout) = test_image_or_skip() else {
        return;
    };
    let Some(reg) = registry(&layout) else { return };
    let cache = tempfile::tempdir().unwrap();
    let reference = reg.reference.clone();

    // `docker run`-like: no flag for the plain-HTTP loopback registry.
    let out = cli(
        &[
            "run",
            "--tier",
            "container",
            "--image",
            &reference,
            "-c",
            "import sys; print('%d.%d' % sys.version_info[:2])",
        ],
        cache.path(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("container tier is unavailable") {
        eprintln!("SKIP: {stderr}");
        return;
    }
    assert!(out.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "3.13\n");

    // No command: the image's own (`Cmd` is python3, reading stdin: none, so it exits 0).
    let out = cli(
        &["run", "--tier", "container", "--image", &reference],
        cache.path(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let ls = cli(&["image", "ls", "--json"], cache.path());
    let v: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
    assert_eq!(v["images"][0]["references"][0], reference.as_str());
    assert_eq!(v["images"][0]["in_use"], false);

    let rm = cli(&["image", "rm", &reference, "--json"], cache.path());
    let v: serde_json::Value = serde_json::from_slice(&rm.stdout).unwrap();
    assert_eq!(v["layers"], 1, "{v}");
    let ls = cli(&["image", "ls", "--json"], cache.path());
    let v: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
    assert_eq!(v["images"].as_array().map(Vec::len), Some(0));
    assert_eq!(v["bytes"], 0);

    // Bad input: a tag that does not exist is a usage error naming it.
    let out = cli(
        &[
            "image",
            "pull",
            &format!("{}/trixie/python3:nope", reg.inner.addr()),
        ],
        cache.path(),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
}

#[test]
fn a_pull_killed_halfway_leaves_nothing_in_use_and_runs_again() {
    let Some(layout) = test_image_or_skip() else {
        return;
    };
    let Some(reg) = registry(&layout) else { return };
    let cache = tempfile::tempdir().unwrap();
    let reference = reg.reference.clone();
    let mut child = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["image", "pull", &reference])
        .env("AGENT_SANDBOX_IMAGE_CACHE", cache.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Killed once the download has started (a partial blob in tmp/) or the unpack has.
    let tmp = cache.path().join("tmp");
    let start = Instant::now();
    let mut killed_mid_way = false;
    while start.elapsed() < Duration::from_secs(60) {
        let busy = std::fs::read_dir(&tmp)
            .map(|d| {
                d.flatten()
                    .any(|e| e.metadata().is_ok_and(|m| m.len() > 0 || m.is_dir()))
            })
            .unwrap_or(false);
        if busy {
            let _ = child.kill();
            killed_mid_way = true;
            break;
        }
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = child.wait();
    assert!(
        killed_mid_way,
        "the pull finished before it could be killed"
    );
    // Nothing half-made is in place: every blob is whole (named by its digest), no layer
    // or image record exists yet.
    for e in std::fs::read_dir(cache.path().join("blobs/sha256"))
        .unwrap()
        .flatten()
    {
        use sha2::Digest;
        let bytes = std::fs::read(e.path()).unwrap();
        assert_eq!(
            hex::encode(sha2::Sha256::digest(&bytes)),
            e.file_name().to_string_lossy(),
            "a partial blob was put in place"
        );
    }
    let ls = cli(&["image", "ls", "--json"], cache.path());
    let v: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
    assert_eq!(v["images"].as_array().map(Vec::len), Some(0), "{v}");

    // Run again: it completes; prune then clears the killed pull's leftovers.
    let again = cli(&["image", "pull", &reference], cache.path());
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let out = cli(
        &[
            "run",
            "--tier",
            "container",
            "--image",
            &reference,
            "-c",
            "print('ok')",
        ],
        cache.path(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !stderr.contains("container tier is unavailable") {
        assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n", "{stderr}");
    }
    assert!(cli(&["image", "prune"], cache.path()).status.success());
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_of_image_sandboxes_restore_on_every_linux_tier() {
    let Some(layout) = test_image_or_skip() else {
        return;
    };
    let cache = tempfile::tempdir().unwrap();
    let store = ImageStore::builder(cache.path()).build().unwrap();
    let rt = Runtime::builder()
        .with_default_tiers()
        .image_store(store)
        .build();
    let spec = SandboxSpec::builder(Language::Shell)
        .image(format!("oci:{}:python3", layout.display()))
        .wall_time(Duration::from_secs(60))
        .build()
        .unwrap();
    for status in rt.probe().await {
        let tier = status.tier;
        let Some(caps) = rt.backend(tier).map(|b| b.capabilities()) else {
            continue;
        };
        if !caps.images || caps.snapshots.is_empty() {
            continue;
        }
        if !status.available {
            eprintln!("SKIP {tier}: {}", status.reason);
            continue;
        }
        let snaps = tempfile::tempdir().unwrap();
        let snaps = agent_sandbox::ObjectSnapshotStore::local(snaps.path()).unwrap();
        let sb = rt.create(&spec, TierChoice::Tier(tier)).await.unwrap();
        let r = sb
            .exec(ExecRequest::code(
                "echo in-root > /etc/marker && echo in-ws > /workspace/w && echo ok",
            ))
            .await
            .unwrap();
        assert!(r.success(), "{tier}: {r:?}");
        let id = sb.snapshot(&snaps).await.unwrap();
        sb.destroy().await.unwrap();
        let back = rt.restore(&snaps, &id).await.unwrap();
        let r = back
            .exec(ExecRequest::code(
                "cat /etc/marker /workspace/w; python3 -c 'import sys; print(sys.version_info[1])'",
            ))
            .await
            .unwrap();
        assert!(r.success(), "{tier}: {r:?}");
        assert_eq!(r.stdout_str(), "in-root\nin-ws\n13\n", "{tier}");
        back.destroy().await.unwrap();
    }
}
