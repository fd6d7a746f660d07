//! Sleeping guests: `poll_oneoff` shadowed so that a sleep never outlasts the call's
//! deadline.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sandbox_core::LimitKind;
use wasmtime::{Caller, Trap};
use wasmtime_wasi::p1::wasi_snapshot_preview1 as snapshot1;
use wasmtime_wasi::runtime::in_tokio;

use super::guest::{call_p1, memory, read_bytes, write_bytes};
use super::{Host, ERRNO_FAULT, ERRNO_INVAL, ERRNO_NOTSUP};

/// `poll_oneoff`, so that sleeps never outlast the call's deadline: when every
/// subscription is a clock (a sleep), the host sleeps itself, at most until the deadline,
/// and then traps with the wall-time limit. Other subscriptions (fd readiness: stdin and
/// files are always ready) go to wasmtime-wasi's implementation.
pub(super) fn poll_oneoff(
    mut c: Caller<'_, Host>,
    subs_ptr: i32,
    events_ptr: i32,
    nsubs: i32,
    nevents_ptr: i32,
) -> wasmtime::Result<i32> {
    const SUB: usize = 48;
    const EVENT: usize = 32;
    let Some(mem) = memory(&mut c) else {
        return Ok(ERRNO_NOTSUP);
    };
    let n = nsubs as u32 as usize;
    if n == 0 {
        return Ok(ERRNO_INVAL);
    }
    let Some(raw) = n
        .checked_mul(SUB)
        .and_then(|len| read_bytes(&c, mem, subs_ptr as u32, len))
    else {
        return Ok(ERRNO_FAULT);
    };
    let le64 = |b: &[u8], at: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(a)
    };
    let all_clocks = raw.chunks(SUB).all(|s| s[8] == 0);
    if !all_clocks {
        return call_p1(&mut c, |ctx, mem| {
            in_tokio(snapshot1::poll_oneoff(
                ctx,
                mem,
                subs_ptr,
                events_ptr,
                nsubs,
                nevents_ptr,
            ))
        });
    }
    // Each clock subscription's wake time, as a duration from now.
    let base = c.data().mono_base;
    let mut waits = Vec::with_capacity(n);
    for s in raw.chunks(SUB) {
        let clock_id = u32::from_le_bytes([s[16], s[17], s[18], s[19]]);
        let timeout = le64(s, 24);
        let abstime = u16::from_le_bytes([s[40], s[41]]) & 1 == 1;
        let wait = if !abstime {
            Duration::from_nanos(timeout)
        } else {
            let now = match clock_id {
                0 => SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
                    .unwrap_or(0),
                1 => u64::try_from(base.elapsed().as_nanos()).unwrap_or(u64::MAX),
                _ => return Ok(ERRNO_INVAL),
            };
            Duration::from_nanos(timeout.saturating_sub(now))
        };
        waits.push((le64(s, 0), wait));
    }
    let shortest = waits.iter().map(|w| w.1).min().unwrap_or(Duration::ZERO);
    let start = Instant::now();
    let deadline = c.data().ctl.deadline;
    let wake = start + shortest;
    if wake > deadline {
        std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
        c.data_mut().ctl.hit = Some(LimitKind::WallTime);
        return Err(Trap::Interrupt.into());
    }
    std::thread::sleep(wake.saturating_duration_since(Instant::now()));
    let waited = start.elapsed();
    let mut events = Vec::new();
    for (userdata, wait) in &waits {
        if *wait <= waited {
            let mut e = [0u8; EVENT];
            e[0..8].copy_from_slice(&userdata.to_le_bytes());
            // error 0, type 0 (clock): already zero.
            events.extend_from_slice(&e);
        }
    }
    let count = (events.len() / EVENT) as u32;
    if !write_bytes(&mut c, mem, events_ptr as u32, &events)
        || !write_bytes(&mut c, mem, nevents_ptr as u32, &count.to_le_bytes())
    {
        return Ok(ERRNO_FAULT);
    }
    Ok(0)
}
