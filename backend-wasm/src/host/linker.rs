//! The linker: WASI preview 1 with the file functions shadowed (the open-file count, the
//! disk quota, the virtual devices, stdout and stderr written straight into the capped
//! pipes), plus `poll_oneoff` (see `poll`) and the `host.call` door (see `door`).

use sandbox_core::{LimitKind, Result};
use wasmtime::{Caller, Engine, Linker};
use wasmtime_wasi::p1::wasi_snapshot_preview1 as snapshot1;
use wasmtime_wasi::runtime::in_tokio;

use super::door::door;
use super::guest::{call_p1, memory, read_bytes, read_u32};
use super::poll::poll_oneoff;
use super::{Host, ERRNO_FAULT, ERRNO_INVAL, ERRNO_MFILE, ERRNO_NOSPC, OFLAGS_CREAT, P1};
use crate::engine::{self, Flavor};

/// The shared linker of `flavor`: WASI preview 1 (with `path_open`, `fd_close`,
/// `fd_renumber` and `poll_oneoff` shadowed) plus `host.call`.
pub(crate) fn linker(flavor: Flavor) -> Result<&'static Linker<Host>> {
    engine::shared_linker(flavor, build_linker)
}

fn build_linker(engine: &Engine) -> wasmtime::Result<Linker<Host>> {
    let mut l: Linker<Host> = Linker::new(engine);
    wasmtime_wasi::p1::add_to_linker_sync(&mut l, |h: &mut Host| &mut h.wasi)?;
    l.allow_shadowing(true);

    l.func_wrap(
        P1,
        "path_open",
        |mut c: Caller<'_, Host>,
         fd: i32,
         dirflags: i32,
         path: i32,
         path_len: i32,
         oflags: i32,
         rights_base: i64,
         rights_inh: i64,
         fdflags: i32,
         out: i32|
         -> wasmtime::Result<i32> {
            let metered = {
                let h = c.data_mut();
                if h.open_files >= h.max_open_files {
                    h.open_files_hit = true;
                    return Ok(ERRNO_MFILE);
                }
                let metered = h.disk.metered(fd as u32);
                // A create may make a file (or open one that exists: counted anyway).
                if metered && oflags & OFLAGS_CREAT != 0 && !h.disk.admit(0, 1) {
                    return Ok(ERRNO_NOSPC);
                }
                metered
            };
            // A virtual device is opened read-only (see `devices`) and marked.
            let (mut device, mut rights_base, mut oflags, mut fdflags) =
                (None, rights_base, oflags, fdflags);
            if c.data().devices.dir_fd == Some(fd as u32) {
                let name = memory(&mut c)
                    .and_then(|m| read_bytes(&c, m, path as u32, path_len as u32 as usize))
                    .and_then(|b| String::from_utf8(b).ok())
                    .unwrap_or_default();
                match crate::devices::open_request(
                    &c.data().devices,
                    fd as u32,
                    &name,
                    rights_base,
                    oflags,
                    fdflags,
                ) {
                    Some(Ok((d, r, o, f))) => {
                        (device, rights_base, oflags, fdflags) = (Some(d), r, o, f)
                    }
                    Some(Err(errno)) => return Ok(errno),
                    None => {}
                }
            }
            let r = call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::path_open(
                    ctx,
                    mem,
                    fd,
                    dirflags,
                    path,
                    path_len,
                    oflags,
                    rights_base,
                    rights_inh,
                    fdflags,
                    out,
                ))
            })?;
            if r == 0 {
                let opened = memory(&mut c).and_then(|m| read_u32(&c, m, out as u32));
                let h = c.data_mut();
                h.open_files += 1;
                if let Some(new_fd) = opened {
                    h.disk.track(new_fd, metered);
                    h.devices.track(new_fd, device);
                }
            }
            Ok(r)
        },
    )?;
    l.func_wrap(
        P1,
        "fd_close",
        |mut c: Caller<'_, Host>, fd: i32| -> wasmtime::Result<i32> {
            let r = call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::fd_close(ctx, mem, fd))
            })?;
            if r == 0 {
                let h = c.data_mut();
                h.open_files = h.open_files.saturating_sub(1);
                h.stdio_moved |= fd == 1 || fd == 2;
                h.disk.track(fd as u32, false);
                h.devices.track(fd as u32, None);
            }
            Ok(r)
        },
    )?;
    l.func_wrap(
        P1,
        "fd_renumber",
        |mut c: Caller<'_, Host>, from: i32, to: i32| -> wasmtime::Result<i32> {
            let r = call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::fd_renumber(ctx, mem, from, to))
            })?;
            if r == 0 && from != to {
                let h = c.data_mut();
                h.stdio_moved |= [from, to].iter().any(|f| *f == 1 || *f == 2);
                h.open_files = h.open_files.saturating_sub(1);
                let metered = h.disk.metered(from as u32);
                h.disk.track(to as u32, metered);
                h.disk.track(from as u32, false);
                h.devices.renumber(from as u32, to as u32);
            }
            Ok(r)
        },
    )?;
    l.func_wrap(P1, "fd_write", fd_write)?;
    crate::devices::add_shadows(&mut l)?;
    l.func_wrap(
        P1,
        "fd_pwrite",
        |mut c: Caller<'_, Host>,
         fd: i32,
         iovs: i32,
         iovs_len: i32,
         offset: i64,
         nwritten: i32|
         -> wasmtime::Result<i32> {
            if let Some(errno) =
                crate::devices::device_io(&mut c, fd, true, iovs, iovs_len, nwritten)
            {
                return Ok(errno);
            }
            if let Some(errno) = admit_write(&mut c, fd, iovs, iovs_len) {
                return Ok(errno);
            }
            call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::fd_pwrite(
                    ctx, mem, fd, iovs, iovs_len, offset, nwritten,
                ))
            })
        },
    )?;
    l.func_wrap(
        P1,
        "path_create_directory",
        |mut c: Caller<'_, Host>, fd: i32, path: i32, path_len: i32| -> wasmtime::Result<i32> {
            let h = c.data_mut();
            if h.disk.metered(fd as u32) && !h.disk.admit(0, 1) {
                return Ok(ERRNO_NOSPC);
            }
            call_p1(&mut c, |ctx, mem| {
                in_tokio(snapshot1::path_create_directory(
                    ctx, mem, fd, path, path_len,
                ))
            })
        },
    )?;
    l.func_wrap(P1, "poll_oneoff", poll_oneoff)?;
    l.func_wrap(
        "host",
        "call",
        |mut c: Caller<'_, Host>,
         req: i32,
         len: i32,
         out_pp: i32,
         out_lp: i32|
         -> wasmtime::Result<i32> {
            door(&mut c, req as u32, len as u32, out_pp as u32, out_lp as u32)
        },
    )?;
    Ok(l)
}

/// `fd_write`: stdout and stderr go straight from guest memory into the capped pipes
/// (all iovecs, no copy past the cap); anything else goes to wasmtime-wasi.
fn fd_write(
    mut c: Caller<'_, Host>,
    fd: i32,
    iovs: i32,
    iovs_len: i32,
    nwritten: i32,
) -> wasmtime::Result<i32> {
    if !((fd == 1 || fd == 2) && !c.data().stdio_moved) {
        if let Some(errno) = crate::devices::device_io(&mut c, fd, true, iovs, iovs_len, nwritten) {
            return Ok(errno);
        }
        if let Some(errno) = admit_write(&mut c, fd, iovs, iovs_len) {
            return Ok(errno);
        }
        return call_p1(&mut c, |ctx, mem| {
            in_tokio(snapshot1::fd_write(ctx, mem, fd, iovs, iovs_len, nwritten))
        });
    }
    let Some(mem) = memory(&mut c) else {
        return Ok(ERRNO_FAULT);
    };
    let (data, h) = mem.data_and_store_mut(&mut c);
    let pipe = if fd == 1 { &h.stdout } else { &h.stderr };
    let word = |at: usize| -> Option<u32> {
        let b = data.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut total: u32 = 0;
    for i in 0..(iovs_len as u32 as usize).min(1024) {
        let at = (iovs as u32 as usize) + i * 8;
        let (Some(ptr), Some(len)) = (word(at), word(at + 4)) else {
            return Ok(ERRNO_FAULT);
        };
        let (ptr, len) = (ptr as usize, len as usize);
        let Some(bytes) = ptr.checked_add(len).and_then(|end| data.get(ptr..end)) else {
            return Ok(ERRNO_FAULT);
        };
        pipe.push(bytes);
        let Some(t) = total.checked_add(len as u32) else {
            return Ok(ERRNO_INVAL);
        };
        total = t;
    }
    if pipe.flooded() {
        // Far past the cap: the command is stopped, not only truncated (as in every tier).
        h.ctl.hit = Some(LimitKind::Output);
        return Err(wasmtime::Error::msg("output limit reached"));
    }
    let at = nwritten as u32 as usize;
    match at.checked_add(4).and_then(|end| data.get_mut(at..end)) {
        Some(dst) => dst.copy_from_slice(&total.to_le_bytes()),
        None => return Ok(ERRNO_FAULT),
    }
    Ok(0)
}

/// For a write of the iovecs at `iovs` to `fd`: `Some(errno)` when `fd` is under the
/// sandbox's private folders and the bytes do not fit their cap (`ENOSPC`), or the iovecs
/// cannot be read (`EFAULT`); `None` to go on.
fn admit_write(c: &mut Caller<'_, Host>, fd: i32, iovs: i32, iovs_len: i32) -> Option<i32> {
    if !c.data().disk.metered(fd as u32) {
        return None;
    }
    let Some(mem) = memory(c) else {
        return Some(ERRNO_FAULT);
    };
    let mut total: u64 = 0;
    for i in 0..(iovs_len as u32).min(1024) {
        let at = (iovs as u32).wrapping_add(i * 8).wrapping_add(4);
        let Some(len) = read_u32(c, mem, at) else {
            return Some(ERRNO_FAULT);
        };
        total = total.saturating_add(u64::from(len));
    }
    (!c.data_mut().disk.admit(total, 0)).then_some(ERRNO_NOSPC)
}
