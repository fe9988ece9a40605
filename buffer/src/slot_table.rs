//! The slot table: one `i32` per Host-arena slot, the Gpu slot of the block homed there when
//! that block is cached in the Gpu tier, else -1. A GPU step that chooses its clusters on the
//! device reads it to serve each row from the Gpu tier or, zero-copy, from the Host arena.
//!
//! The host mirror is always kept (tests, tools); with feature `cuda` and a Gpu tier in device
//! memory, a device copy is written on the Gpu pool's stream, from the mirror in pinned memory.
//! Standalone operations write an entry and wait ([`SlotTable::set`], [`SlotTable::clear`]);
//! a maintenance round stages its entries in the mirror ([`SlotTable::stage`]) and writes them
//! to the device in the round's batch, after its slots' bytes ([`SlotTable::write_staged`]).
//! An entry is cleared before its Gpu slot can be overwritten and set only once the slot's bytes
//! are on the device, or ordered before it (see `docs/buffer-manager.md`, "Device-planned reads").

use crate::arena::{DeviceBatch, FramePool};
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

/// Staged entries at most this far apart are written to the device as one copy (the entries
/// between are rewritten with the values they already hold there): one call per cluster's
/// run of Host slots rather than one per entry.
const COPY_GAP_ENTRIES: u32 = 256;

/// The table: host mirror, and the device copy when the Gpu tier lives in device memory.
pub(crate) struct SlotTable {
    /// The host mirror when there is no device copy (with one, the mirror is the device
    /// table's pinned host side, and this is empty). Written only under the manager's state lock.
    host: Box<[AtomicI32]>,
    #[cfg(feature = "cuda")]
    device: Option<crate::cuda::Table>,
    /// A device write failed: the device copy may be stale, so it is not handed out any more.
    broken: AtomicBool,
    /// Entries of the table (the Host arena's slots).
    len: usize,
}

impl SlotTable {
    /// A table of `host_slots` entries, all uncached; with a device copy when `gpu` has a
    /// device mirror (a failure to allocate it is said once and leaves the host mirror only).
    pub(crate) fn new(host_slots: usize, gpu: &FramePool) -> Self {
        #[cfg(not(feature = "cuda"))]
        let _ = gpu;
        #[cfg(feature = "cuda")]
        let device = match gpu.device_table(host_slots) {
            Some(Ok(table)) => Some(table),
            Some(Err(why)) => {
                eprintln!("attnstore-buffer: no device slot table ({why}); device-planned reads are off");
                None
            }
            None => None,
        };
        #[cfg(feature = "cuda")]
        let boxed = if device.is_some() { 0 } else { host_slots };
        #[cfg(not(feature = "cuda"))]
        let boxed = host_slots;
        Self {
            host: (0..boxed).map(|_| AtomicI32::new(UNCACHED)).collect(),
            #[cfg(feature = "cuda")]
            device,
            broken: AtomicBool::new(false),
            len: host_slots,
        }
    }

    /// The host mirror.
    fn entries(&self) -> &[AtomicI32] {
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.device {
            return &device.mirror()[..self.len];
        }
        &self.host
    }

    /// The Gpu slot published for `host_slot` (host mirror), or `None`.
    pub(crate) fn get(&self, host_slot: u32) -> Option<u32> {
        // Relaxed: written under the state lock; an unlocked reader gets a hint, as documented.
        let entry = self.entries().get(host_slot as usize)?.load(Ordering::Relaxed);
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

    /// Stores `gpu_slot` (or, for `None`, the empty entry) for `host_slot` in the host mirror
    /// only, for [`SlotTable::write_staged`] to write to the device later in the same batch.
    pub(crate) fn stage(&self, host_slot: u32, gpu_slot: Option<u32>) {
        let value =
            gpu_slot.map_or(UNCACHED, |g| i32::try_from(g).expect("Gpu slots fit an i32 (checked at construction)"));
        // Relaxed: written under the state lock, like every mirror write.
        self.entries()[host_slot as usize].store(value, Ordering::Relaxed);
    }

    /// Enqueues the device writes of the staged entries `host_slots` (in any order, repeats
    /// allowed; sorted here) from the host mirror, on the Gpu pool's stream inside `batch`, so
    /// after the batch's slot copies; the batch waits for them. The caller holds the state lock
    /// through the batch (the mirror does not change before the copies ran). A failure marks
    /// the device copy broken and is returned.
    pub(crate) fn write_staged(&self, batch: &DeviceBatch, host_slots: &mut [u32]) -> Result<(), String> {
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.device {
            // Relaxed: only the state lock's holder writes; the flag orders nothing.
            if self.broken.load(Ordering::Relaxed) {
                return Ok(());
            }
            host_slots.sort_unstable();
            let mut ranges = Vec::new();
            let mut i = 0;
            while i < host_slots.len() {
                let first = host_slots[i];
                let mut last = first;
                while i < host_slots.len() && host_slots[i] <= last.saturating_add(COPY_GAP_ENTRIES) {
                    last = last.max(host_slots[i]);
                    i += 1;
                }
                ranges.push((first as usize, (last - first) as usize + 1));
            }
            // The entries are written only under the state lock, which the caller holds until
            // `batch`'s call returns, and that call waits for the copies.
            if let Err(why) = device.enqueue_entries(batch, &ranges) {
                self.mark_broken(&why);
                return Err(why);
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (batch, host_slots, COPY_GAP_ENTRIES);
        Ok(())
    }

    /// Stops handing out the device copy (it may be stale after a failed device write).
    pub(crate) fn mark_broken(&self, why: &str) {
        #[cfg(feature = "cuda")]
        if self.device.is_some() && !self.broken.swap(true, Ordering::Relaxed) {
            eprintln!(
                "attnstore-buffer: a device write failed ({why}); the device slot table is off (device-planned reads)"
            );
        }
        #[cfg(not(feature = "cuda"))]
        let _ = why;
    }

    fn write(&self, host_slot: u32, value: i32) -> Result<(), String> {
        self.entries()[host_slot as usize].store(value, Ordering::Relaxed);
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.device {
            // Relaxed: only the state lock's holder writes; the flag orders nothing.
            if !self.broken.load(Ordering::Relaxed) {
                if let Err(why) = device.write(host_slot as usize, value) {
                    self.mark_broken(&why);
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
            return Some(DeviceSlotTable { address: device.base(), entries: self.len });
        }
        None
    }

    /// Entries of the table (the Host arena's slots).
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}
