//! Reaching into a guest from a host function: its memory export, bytes and words of it,
//! and calls to wasmtime-wasi's own preview-1 functions.

use wasmtime::{AsContext, AsContextMut, Caller, Extern, Memory};
use wasmtime_wasi::p1::wasi_snapshot_preview1::WasiSnapshotPreview1;
use wasmtime_wasi::p1::WasiP1Ctx;

use super::Host;

/// Calls one of wasmtime-wasi's own preview-1 functions from a shadow, the way its linker
/// glue does (memory export, hostcall fuel).
pub(crate) fn call_p1<R>(
    c: &mut Caller<'_, Host>,
    f: impl FnOnce(&mut WasiP1Ctx, &mut wiggle::GuestMemory<'_>) -> wasmtime::Result<R>,
) -> wasmtime::Result<R> {
    let export = c.get_export("memory");
    let fuel = c.as_context_mut().hostcall_fuel();
    let Some(Extern::Memory(m)) = export else {
        wasmtime::bail!("missing required memory export");
    };
    let (mem, host) = m.data_and_store_mut(&mut *c);
    let ctx = &mut host.wasi;
    WasiSnapshotPreview1::set_hostcall_fuel(ctx, fuel);
    let mut gm = wiggle::GuestMemory::Unshared(mem);
    f(ctx, &mut gm)
}

pub(crate) fn memory(c: &mut Caller<'_, Host>) -> Option<Memory> {
    match c.get_export("memory") {
        Some(Extern::Memory(m)) => Some(m),
        _ => None,
    }
}

pub(super) fn read_bytes(
    c: &Caller<'_, Host>,
    mem: Memory,
    ptr: u32,
    len: usize,
) -> Option<Vec<u8>> {
    let data = mem.data(c.as_context());
    let start = ptr as usize;
    let end = start.checked_add(len)?;
    data.get(start..end).map(<[u8]>::to_vec)
}

pub(super) fn write_bytes(c: &mut Caller<'_, Host>, mem: Memory, ptr: u32, bytes: &[u8]) -> bool {
    let data = mem.data_mut(c.as_context_mut());
    let start = ptr as usize;
    match start
        .checked_add(bytes.len())
        .and_then(|end| data.get_mut(start..end))
    {
        Some(dst) => {
            dst.copy_from_slice(bytes);
            true
        }
        None => false,
    }
}

/// A little-endian `u32` of guest memory at `at`.
pub(super) fn read_u32(c: &Caller<'_, Host>, mem: Memory, at: u32) -> Option<u32> {
    let b = read_bytes(c, mem, at, 4)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}
