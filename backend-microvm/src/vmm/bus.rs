//! A small address-range bus for port I/O and MMIO exits.

use std::sync::{Arc, Mutex};

/// A device on the bus. Both calls get the offset from the device's base address; the data
/// slice is the access (1, 2, 4 or 8 bytes, or longer for `rep` string I/O). Implementations
/// must not panic on any offset or size: the guest chooses them.
pub trait BusDevice: Send {
    /// A guest read: fill `data`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// A guest write.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// A shared device handle.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Clone)]
struct Entry {
    base: u64,
    len: u64,
    dev: SharedDevice,
}

/// Devices by address range. Ranges never overlap (insertion checks).
#[derive(Clone, Default)]
pub struct Bus {
    entries: Vec<Entry>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<String> = self
            .entries
            .iter()
            .map(|e| format!("{:#x}+{:#x}", e.base, e.len))
            .collect();
        f.debug_struct("Bus").field("ranges", &ranges).finish()
    }
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `dev` at `[base, base+len)`. Returns false (and adds nothing) if the range is
    /// empty, wraps, or overlaps a device already there.
    pub fn insert(&mut self, base: u64, len: u64, dev: SharedDevice) -> bool {
        let Some(end) = base.checked_add(len) else {
            return false;
        };
        if len == 0 {
            return false;
        }
        if self
            .entries
            .iter()
            .any(|e| base < e.base.saturating_add(e.len) && e.base < end)
        {
            return false;
        }
        self.entries.push(Entry { base, len, dev });
        self.entries.sort_by_key(|e| e.base);
        true
    }

    fn find(&self, addr: u64) -> Option<(&Entry, u64)> {
        let i = self.entries.partition_point(|e| e.base <= addr);
        let e = self.entries.get(i.checked_sub(1)?)?;
        let off = addr - e.base;
        (off < e.len).then_some((e, off))
    }

    /// Dispatches a read. Returns false when no device is at `addr` (`data` is then left
    /// as the caller filled it).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((e, off)) => {
                // A poisoned lock means a device panicked earlier (caught); keep serving.
                let mut d = e.dev.lock().unwrap_or_else(|p| p.into_inner());
                d.read(off, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a write. Returns false when no device is at `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((e, off)) => {
                let mut d = e.dev.lock().unwrap_or_else(|p| p.into_inner());
                d.write(off, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rec(Vec<(u64, Vec<u8>)>);
    impl BusDevice for Rec {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn ranges_dispatch_and_never_overlap() {
        let mut bus = Bus::new();
        let a: SharedDevice = Arc::new(Mutex::new(Rec(vec![])));
        assert!(bus.insert(0x100, 0x10, a.clone()));
        assert!(!bus.insert(0x108, 0x10, a.clone()));
        assert!(!bus.insert(0xf8, 0x10, a.clone()));
        assert!(!bus.insert(u64::MAX, 2, a.clone()));
        assert!(bus.insert(0x110, 0x10, a.clone()));
        let mut d = [0u8; 2];
        assert!(bus.read(0x105, &mut d));
        assert_eq!(d, [5, 5]);
        assert!(!bus.read(0x120, &mut d));
        assert!(!bus.read(0xff, &mut d));
        assert!(bus.write(0x111, &[1]));
    }
}
