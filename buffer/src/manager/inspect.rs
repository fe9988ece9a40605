//! Read-only views for tools, tests and `attnstore inspect`: a block's tier, loss and Disk
//! location, the slot table's entries and a check of them against the blocks' metadata (for the
//! fuzz driver), and [`BufferStats`], the counters of every tier.

use super::{BufferManager, Home, TIERS};
#[cfg(test)]
use crate::arena::FramePool;
use crate::disk::DiskTier;
use crate::stats::BufferStats;
use crate::{BlockId, Result, Tier};
use std::path::PathBuf;
use std::sync::atomic::Ordering;

impl BufferManager {
    /// The fastest tier holding `block` now.
    pub fn tier_of(&self, block: BlockId) -> Result<Tier> {
        let state = self.state()?;
        Ok(state.meta(block)?.location(block).tier())
    }

    /// Whether `block`'s bytes are lost (a corrupt read-back or a failed write).
    pub fn is_lost(&self, block: BlockId) -> Result<bool> {
        Ok(matches!(self.state()?.meta(block)?.home, Home::Lost(_)))
    }

    /// Segment file and offset of `block` when its home is on Disk (corruption tests, tools).
    pub fn disk_location(&self, block: BlockId) -> Result<Option<(PathBuf, u64)>> {
        let state = self.state()?;
        Ok(match state.meta(block)?.home {
            Home::Disk(slot) => self.disk.as_ref().map(|d| d.slot_location(slot)),
            _ => None,
        })
    }

    /// The slot table's entry for Host slot `host_slot` (host mirror): the Gpu slot of the
    /// block homed there when it is cached in the Gpu tier, else `None` (also for a slot out
    /// of range). For tests and tools; exact when no write is in progress, a hint otherwise.
    /// Kept on machines without a GPU too.
    pub fn slot_table_entry(&self, host_slot: u32) -> Option<u32> {
        self.slot_table.get(host_slot)
    }

    /// Checks the slot table against the blocks' metadata (every Host-homed cached block's
    /// entry names its Gpu slot, every other entry is empty) and that every Gpu slot is cached,
    /// free or quarantined; for the fuzz driver. Takes the state lock.
    pub(crate) fn check_slot_table(&self) -> std::result::Result<(), String> {
        let state = self.state().map_err(|e| e.to_string())?;
        let mut expected = vec![None; self.slot_table.len()];
        let mut cached = 0;
        for (block, meta) in &state.blocks {
            cached += usize::from(meta.gpu_slot.is_some());
            if let Home::Host(host_slot) = meta.home {
                expected[host_slot as usize] = meta.gpu_slot.map(|g| (g, *block));
            }
        }
        for (host_slot, want) in expected.into_iter().enumerate() {
            let got = self.slot_table.get(host_slot as u32);
            if got != want.map(|(g, _)| g) {
                return Err(format!("slot table entry of Host slot {host_slot} is {got:?}, expected {want:?}"));
            }
        }
        let (free, quarantined) = (self.gpu.free_slots(), self.epochs.quarantined());
        if cached + free + quarantined != self.gpu.capacity() {
            return Err(format!(
                "{cached} cached + {free} free + {quarantined} quarantined Gpu slots, capacity {}",
                self.gpu.capacity()
            ));
        }
        Ok(())
    }

    /// The Gpu tier's pool, for unit tests that look at slot bytes no block owns.
    #[cfg(test)]
    pub(crate) fn gpu_pool(&self) -> &FramePool {
        &self.gpu
    }

    /// A snapshot of the counters of every tier.
    pub fn stats(&self) -> BufferStats {
        let mut tiers = Vec::new();
        for tier in TIERS {
            let (capacity, used) = match tier {
                Tier::Gpu => (self.gpu.capacity(), self.gpu.capacity() - self.gpu.free_slots()),
                Tier::Host => (self.host.capacity(), self.host.capacity() - self.host.free_slots()),
                Tier::Disk => match &self.disk {
                    Some(d) => (d.capacity_blocks(), d.used_blocks()),
                    None => continue,
                },
            };
            tiers.push(self.counters(tier).snapshot(tier, capacity, used));
        }
        BufferStats {
            block_bytes: self.layout.block_bytes(),
            tiers,
            dropped_access_records: self.dropped.load(Ordering::Relaxed),
            superseded_cluster_reads: self.superseded.load(Ordering::Relaxed),
            queued_access_records: self.queued_records.load(Ordering::Relaxed) as usize,
            replacer: self.replacer_name,
            disk_backend: self.disk.as_ref().map(DiskTier::backend_name),
            host_memory: self.host.memory_kind(),
            gpu_on_device: self.gpu.device_base().is_some(),
            gpu_quarantined_blocks: self.epochs.quarantined(),
        }
    }
}
