//! `/dev/null`, `/dev/zero` and `/dev/urandom` for WASI guests, as virtual files.
//!
//! WASI has no devices: a guest resolves `/dev/...` against its preopened folders like any
//! path, and programs that open `os.devnull` (Python's `subprocess`, logging set-ups) fail
//! with `ENOENT`. Every store therefore preopens a folder of the process's own at `/dev`,
//! read-only, holding three empty files. The `path_open` shadow marks a descriptor opened
//! on one of them (asked read-only of wasmtime-wasi whatever the guest asked, so that a
//! write-mode open succeeds on the read-only folder), and the `fd_read`, `fd_pread`,
//! `fd_write` and `fd_pwrite` shadows answer for those descriptors: reads give nothing
//! (`null`), zeros (`zero`) or random bytes (`urandom`, from the host's), writes are
//! accepted and dropped. Nothing of the host's `/dev` is reachable, and the folder cannot
//! be changed by a guest (read-only preopen).

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::OnceLock;

use sandbox_core::{Error, Result};
use wasmtime::{AsContextMut, Caller, Linker};
use wasmtime_wasi::p1::wasi_snapshot_preview1 as snapshot1;
use wasmtime_wasi::runtime::in_tokio;

use crate::host::{Host, P1};

use crate::TIER;

/// The guest path of the device folder.
pub(crate) const GUEST_DIR: &str = "/dev";

/// A virtual device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Device {
    /// Reads end at once; writes vanish.
    Null,
    /// Reads give zeros; writes vanish.
    Zero,
    /// Reads give random bytes; writes vanish.
    Urandom,
}

impl Device {
    /// The device a path under the device folder names, if any (`null`, `./zero`...).
    pub(crate) fn named(path: &str) -> Option<Device> {
        match path.trim_start_matches("./").trim_end_matches('/') {
            "null" => Some(Device::Null),
            "zero" => Some(Device::Zero),
            "urandom" | "random" => Some(Device::Urandom),
            _ => None,
        }
    }

    /// Fills `buf` as a read of this device does; returns how many bytes were read.
    pub(crate) fn fill(self, buf: &mut [u8]) -> usize {
        match self {
            Device::Null => 0,
            Device::Zero => {
                buf.fill(0);
                buf.len()
            }
            Device::Urandom => match host_random(buf) {
                Ok(()) => buf.len(),
                Err(_) => 0,
            },
        }
    }
}

/// The descriptors of one store that are devices.
#[derive(Debug, Default)]
pub(crate) struct Devices {
    /// The preopened device folder's descriptor.
    pub(crate) dir_fd: Option<u32>,
    open: HashMap<u32, Device>,
}

impl Devices {
    /// The device behind `fd`, if it is one.
    pub(crate) fn get(&self, fd: u32) -> Option<Device> {
        self.open.get(&fd).copied()
    }

    /// Records `fd` as `device` (or forgets it with `None`).
    pub(crate) fn track(&mut self, fd: u32, device: Option<Device>) {
        match device {
            Some(d) => {
                self.open.insert(fd, d);
            }
            None => {
                self.open.remove(&fd);
            }
        }
    }

    /// `fd` was renumbered to `to`.
    pub(crate) fn renumber(&mut self, fd: u32, to: u32) {
        let d = self.open.remove(&fd);
        self.track(to, d);
    }
}

/// The host folder preopened at [`GUEST_DIR`]: made once per process, four empty files
/// (`random` reads as `urandom`). Named like the sandbox folders, with this process's id, so
/// that the sweep of the next process removes it once this one is gone.
pub(crate) fn host_dir() -> Result<&'static Path> {
    static DIR: OnceLock<std::result::Result<std::path::PathBuf, std::sync::Arc<std::io::Error>>> =
        OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let make = || -> std::io::Result<std::path::PathBuf> {
            let d = tempfile::Builder::new()
                .prefix(&format!(
                    "{}{}-dev-",
                    crate::scratch::PREFIX,
                    std::process::id()
                ))
                .tempdir()?
                .keep();
            for name in ["null", "zero", "urandom", "random"] {
                std::fs::write(d.join(name), b"")?;
            }
            Ok(d)
        };
        make().map_err(std::sync::Arc::new)
    });
    match dir {
        Ok(d) => Ok(d.as_path()),
        Err(e) => Err(Error::backend_caused(
            TIER,
            "making the folder of the guests' /dev files",
            std::sync::Arc::clone(e),
        )),
    }
}

fn host_random(buf: &mut [u8]) -> std::io::Result<()> {
    static URANDOM: OnceLock<std::io::Result<std::fs::File>> = OnceLock::new();
    match URANDOM.get_or_init(|| std::fs::File::open("/dev/urandom")) {
        Ok(f) => {
            let mut f: &std::fs::File = f;
            f.read_exact(buf)
        }
        Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
    }
}

/// `EEXIST`.
const ERRNO_EXIST: i32 = 20;
/// `EFAULT`.
const ERRNO_FAULT: i32 = 21;
/// `Rights::FD_READ` and `Rights::FD_WRITE` of `path_open`.
const RIGHT_READ: i64 = 1 << 1;
const RIGHT_WRITE: i64 = 1 << 6;
/// `Oflags::CREAT`, `EXCL` and `TRUNC`.
const OFLAGS_CREAT: i32 = 1;
const OFLAGS_EXCL: i32 = 4;
const OFLAGS_TRUNC: i32 = 8;
/// `Fdflags::NONBLOCK` (the only flag kept on a device).
const FDFLAGS_NONBLOCK: i32 = 4;

/// What a `path_open` on `dir` of `path` becomes: `None` when it is not a device; else the
/// device and the `(rights_base, oflags, fdflags)` to ask wasmtime-wasi for (read-only,
/// nothing created or truncated), or the errno to answer at once.
pub(crate) fn open_request(
    devices: &Devices,
    dir: u32,
    path: &str,
    rights_base: i64,
    oflags: i32,
    fdflags: i32,
) -> Option<std::result::Result<(Device, i64, i32, i32), i32>> {
    if devices.dir_fd != Some(dir) {
        return None;
    }
    let device = Device::named(path)?;
    if oflags & OFLAGS_CREAT != 0 && oflags & OFLAGS_EXCL != 0 {
        return Some(Err(ERRNO_EXIST));
    }
    Some(Ok((
        device,
        (rights_base & !RIGHT_WRITE) | RIGHT_READ,
        oflags & !(OFLAGS_CREAT | OFLAGS_EXCL | OFLAGS_TRUNC),
        fdflags & FDFLAGS_NONBLOCK,
    )))
}

/// Reads (`write == false`) or writes the iovecs at `iovs` on `device`, storing the byte
/// count at `out`; returns the errno (0 on success).
pub(crate) fn io(
    data: &mut [u8],
    device: Device,
    write: bool,
    iovs: u32,
    iovs_len: u32,
    out: u32,
) -> i32 {
    let word = |data: &[u8], at: usize| -> Option<u32> {
        let b = data.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut total: u32 = 0;
    for i in 0..(iovs_len as usize).min(1024) {
        let at = iovs as usize + i * 8;
        let (Some(ptr), Some(len)) = (word(data, at), word(data, at + 4)) else {
            return ERRNO_FAULT;
        };
        let (ptr, len) = (ptr as usize, len as usize);
        let Some(buf) = ptr.checked_add(len).and_then(|end| data.get_mut(ptr..end)) else {
            return ERRNO_FAULT;
        };
        let n = if write { len } else { device.fill(buf) };
        total = total.saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
        if !write && n < len {
            break;
        }
    }
    let at = out as usize;
    match at.checked_add(4).and_then(|end| data.get_mut(at..end)) {
        Some(dst) => {
            dst.copy_from_slice(&total.to_le_bytes());
            0
        }
        None => ERRNO_FAULT,
    }
}

/// Preopens the device folder at [`GUEST_DIR`], after the others (so its descriptor is the
/// next one), unless one of `preopens` is already there (a mount at `/dev`).
pub(crate) fn preopen(
    b: &mut wasmtime_wasi::WasiCtxBuilder,
    preopens: &[crate::host::Preopen],
) -> Result<Devices> {
    let mut devices = Devices::default();
    if preopens
        .iter()
        .any(|p| p.guest.trim_end_matches('/') == GUEST_DIR)
    {
        return Ok(devices);
    }
    let dir = host_dir()?;
    b.preopened_dir(dir, GUEST_DIR, wasmtime_wasi::FsPerms::ReadOnly)
        .map_err(|e| Error::io_path("preopen", dir, std::io::Error::other(format!("{e:#}"))))?;
    devices.dir_fd = Some(3 + u32::try_from(preopens.len()).unwrap_or(u32::MAX));
    Ok(devices)
}

/// Registers the `fd_read` and `fd_pread` shadows (devices first, then wasmtime-wasi's).
pub(crate) fn add_shadows(l: &mut Linker<Host>) -> wasmtime::Result<()> {
    l.func_wrap(
        P1,
        "fd_read",
        |mut c: Caller<'_, Host>,
         fd: i32,
         iovs: i32,
         iovs_len: i32,
         nread: i32|
         -> wasmtime::Result<i32> {
            if let Some(errno) = device_io(&mut c, fd, false, iovs, iovs_len, nread) {
                return Ok(errno);
            }
            crate::host::call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::fd_read(ctx, mem, fd, iovs, iovs_len, nread))
            })
        },
    )?;
    l.func_wrap(
        P1,
        "fd_pread",
        |mut c: Caller<'_, Host>,
         fd: i32,
         iovs: i32,
         iovs_len: i32,
         offset: i64,
         nread: i32|
         -> wasmtime::Result<i32> {
            if let Some(errno) = device_io(&mut c, fd, false, iovs, iovs_len, nread) {
                return Ok(errno);
            }
            crate::host::call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::fd_pread(
                    ctx, mem, fd, iovs, iovs_len, offset, nread,
                ))
            })
        },
    )?;
    Ok(())
}

/// For a read or write of a virtual device's descriptor: `Some(errno)`, the call answered
/// (see `devices`); `None` when `fd` is not a device.
pub(crate) fn device_io(
    c: &mut Caller<'_, Host>,
    fd: i32,
    write: bool,
    iovs: i32,
    iovs_len: i32,
    out: i32,
) -> Option<i32> {
    let device = c.data().devices.get(fd as u32)?;
    let Some(mem) = crate::host::memory(c) else {
        return Some(ERRNO_FAULT);
    };
    let data = mem.data_mut(c.as_context_mut());
    Some(crate::devices::io(
        data,
        device,
        write,
        iovs as u32,
        iovs_len as u32,
        out as u32,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_read_as_their_namesakes() {
        assert_eq!(Device::named("null"), Some(Device::Null));
        assert_eq!(Device::named("./zero"), Some(Device::Zero));
        assert_eq!(Device::named("urandom"), Some(Device::Urandom));
        assert_eq!(Device::named("sda"), None);
        let mut buf = [7u8; 32];
        assert_eq!(Device::Null.fill(&mut buf), 0);
        assert_eq!(Device::Zero.fill(&mut buf), 32);
        assert_eq!(buf, [0u8; 32]);
        let (mut a, mut b) = ([0u8; 32], [0u8; 32]);
        assert_eq!(Device::Urandom.fill(&mut a), 32);
        Device::Urandom.fill(&mut b);
        assert_ne!(a, b);
        // Guest memory: two iovecs (8 bytes at 100, 8 at 200), the count at 300.
        let mut mem = vec![9u8; 400];
        for (at, v) in [(0usize, 100u32), (4, 8), (8, 200), (12, 8)] {
            mem[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        assert_eq!(io(&mut mem, Device::Zero, false, 0, 2, 300), 0);
        assert_eq!(&mem[100..108], &[0u8; 8]);
        assert_eq!(&mem[200..208], &[0u8; 8]);
        assert_eq!(&mem[300..304], &16u32.to_le_bytes());
        assert_eq!(io(&mut mem, Device::Null, false, 0, 2, 300), 0);
        assert_eq!(&mem[300..304], &0u32.to_le_bytes());
        assert_eq!(io(&mut mem, Device::Null, true, 0, 2, 300), 0);
        assert_eq!(&mem[300..304], &16u32.to_le_bytes());
        assert_eq!(io(&mut mem, Device::Null, true, 0, 2, 398), ERRNO_FAULT);
        // A write-mode open becomes a read-only one; an exclusive create fails.
        let d = Devices {
            dir_fd: Some(5),
            open: HashMap::new(),
        };
        assert!(open_request(&d, 4, "null", RIGHT_WRITE, 0, 0).is_none());
        assert!(open_request(&d, 5, "sda", RIGHT_WRITE, 0, 0).is_none());
        assert_eq!(
            open_request(&d, 5, "null", RIGHT_WRITE, OFLAGS_CREAT | OFLAGS_TRUNC, 1),
            Some(Ok((Device::Null, RIGHT_READ, 0, 0)))
        );
        assert_eq!(
            open_request(&d, 5, "null", 0, OFLAGS_CREAT | OFLAGS_EXCL, 0),
            Some(Err(ERRNO_EXIST))
        );
        let dir = host_dir().unwrap();
        assert!(dir.join("null").is_file() && dir.join("urandom").is_file());
    }
}
