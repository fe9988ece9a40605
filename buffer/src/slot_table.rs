//! The slot table: one `i32` per Host-arena slot, the Gpu slot of the block homed there when
//! that block is cached in the Gpu tier, else -1. A GPU step that chooses its clusters on the
//! device reads it to serve each row from the Gpu tier or, zero-copy, from the Host arena.
//!
//! The host mirror is always kept (tests, tools); with feature `cuda` and a Gpu tier in device
//! memory, a device copy is written synchronously on the Gpu pool's stream. The manager calls
//! [`SlotTable::clear`] before a Gpu slot can be overwritten and [`SlotTable::set`] only after
//! the slot's bytes are on the device (see `docs/buffer-manager.md`, "Device-planned reads").

use crate::arena::FramePool;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// Entry of a Host slot whose block is not cached in the Gpu tier (or that holds no block).
const UNCACHED: i32 = -1;

/// Where a GPU kernel finds the device copy of the slot table.
///
/// `address` is the device address of an `i32` array with `entries` entries, one per Host
/// slot: entry `h` is the Gpu slot (`gpu_device_base + slot × block_bytes`) of the block homed
/// in Host slot `h` when it is cached, else -1 (read it from the Host arena). A kernel may read
/// the table only while a [`DeviceRead`](crate::DeviceRead) taken before its launch is alive:
/// that guard is what keeps a Gpu slot named by an entry it saw from being reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlotTable {
    /// Device address of entry 0.
    pub address: u64,
    /// Entries (the Host arena's slots).
    pub entries: usize,
}

/// The table: host mirror, and the device copy when the Gpu tier lives in device memory.
pub(crate) struct SlotTable {
    /// Written only under the manager's state lock.
    host: Box<[AtomicI32]>,
    #[cfg(feature = "cuda")]
    device: Option<crate::arena::DeviceTable>,
    /// A device write failed: the device copy may be stale, so it is not handed out any more.
    broken: AtomicBool,
}

impl SlotTable {
    /// A table of `host_slots` entries, all uncached; with a device copy when `gpu` has a
    /// device mirror (a failure to allocate it is said once and leaves the host mirror only).
    pub(crate) fn new(host_slots: usize, gpu: &FramePool) -> Self {
        #[cfg(not(feature = "cuda"))]
        let _ = gpu;
        Self {
            host: (0..host_slots).map(|_| AtomicI32::new(UNCACHED)).collect(),
            #[cfg(feature = "cuda")]
            device: match gpu.device_table(host_slots) {
                Some(Ok(table)) => Some(table),
                Some(Err(why)) => {
                    eprintln!("attnstore-buffer: no device slot table ({why}); device-planned reads are off");
                    None
                }
                None => None,
            },
            broken: AtomicBool::new(false),
        }
    }

    /// The Gpu slot published for `host_slot` (host mirror), or `None`.
    pub(crate) fn get(&self, host_slot: u32) -> Option<u32> {
        // Relaxed: written under the state lock; an unlocked reader gets a hint, as documented.
        let entry = self.host.get(host_slot as usize)?.load(Ordering::Relaxed);
        u32::try_from(entry).ok()
    }

    /// Publishes `gpu_slot` for the block homed in `host_slot`. Call only once the Gpu slot's
    /// bytes are on the device. A failed device write is returned (the entry stays -1 there).
    pub(crate) fn set(&self, host_slot: u32, gpu_slot: u32) -> Result<(), String> {
        let value = i32::try_from(gpu_slot).expect("Gpu slots fit an i32 (checked at construction)");
        self.write(host_slot, value)
    }

    /// Clears `host_slot`'s entry. Call before the Gpu slot it named can be overwritten; the
    /// device copy is cleared before this returns (or the table is marked broken).
    pub(crate) fn clear(&self, host_slot: u32) -> Result<(), String> {
        self.write(host_slot, UNCACHED)
    }

    fn write(&self, host_slot: u32, value: i32) -> Result<(), String> {
        self.host[host_slot as usize].store(value, Ordering::Relaxed);
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.device {
            // Relaxed: only the state lock's holder writes; the flag orders nothing.
            if !self.broken.load(Ordering::Relaxed) {
                if let Err(why) = device.write(host_slot as usize, value) {
                    self.broken.store(true, Ordering::Relaxed);
                    eprintln!("attnstore-buffer: slot table write failed ({why}); device-planned reads are off");
                    return Err(why);
                }
            }
        }
        Ok(())
    }

    /// The device copy, unless absent or broken by a failed write.
    pub(crate) fn device(&self) -> Option<DeviceSlotTable> {
        if self.broken.load(Ordering::Relaxed) {
            return None;
        }
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.device {
            return Some(DeviceSlotTable { address: device.base(), entries: self.host.len() });
        }
        None
    }

    /// Entries of the table (the Host arena's slots).
    pub(crate) fn len(&self) -> usize {
        self.host.len()
    }
}
