//! Moves between tiers: spill a block's home from the Host arena to Disk and reload it (crc32c
//! checked; a corrupt block is lost from then on), admit a copy into the Gpu tier (taking the
//! replacer's victim when it is full) and evict it. The maintainer's admissions come through
//! here, or through `round` when a round is batched.

use super::{BufferManager, Home, State};
use crate::arena::{SlotWrite, NO_OWNER};
use crate::stats::TierCounters;
use crate::{BlockId, Error, Result, Tier};
use std::time::Instant;

impl BufferManager {
    /// Moves `block`'s home from the Host arena to Disk (its Gpu copy, if any, stays).
    pub fn spill(&self, block: BlockId) -> Result<()> {
        let mut state = self.state()?;
        let home = state.meta(block)?.home;
        let Home::Host(slot) = home else {
            return Err(Error::WrongTier { block, expected: Tier::Host, got: home.tier() });
        };
        let Some(disk) = &self.disk else {
            return Err(Error::TierFull { tier: Tier::Disk, capacity_blocks: 0 });
        };
        let mut w = self.lock_slot(&self.host, slot, block, "spill")?;
        let disk_slot = disk.alloc_slot()?;
        let started = Instant::now();
        if let Err(e) = disk.write_blocks(&[(disk_slot, block, w.bytes())]).remove(0) {
            disk.free_slot(disk_slot);
            self.counters(Tier::Disk).failed(Tier::Disk, "disk_write");
            return Err(e); // the block stays on Host, intact
        }
        self.counters(Tier::Disk).moved(Tier::Disk, self.layout.block_bytes(), started);
        if state.meta(block)?.gpu_slot.is_some() {
            // The Gpu copy stays, but the Host slot will hold another block.
            self.unpublish(home);
        }
        w.set_owner(NO_OWNER);
        drop(w);
        let meta = state.meta_mut(block)?;
        meta.home = Home::Disk(disk_slot);
        self.remap(block, state.meta(block)?);
        self.host.release_slot(slot);
        TierCounters::add(&self.counters(Tier::Host).evictions, 1);
        Ok(())
    }

    /// Reads a block back from Disk, checks its crc32c, and homes it in the Host arena.
    /// A mismatch is [`Error::Corrupt`] and the block is lost (never served) from then on.
    pub fn reload(&self, block: BlockId) -> Result<()> {
        let mut state = self.state()?;
        let home = state.meta(block)?.home;
        let disk_slot = match home {
            Home::Disk(slot) => slot,
            Home::Lost(reason) => return Err(Error::Missing { block, reason }),
            Home::Host(_) => return Err(Error::WrongTier { block, expected: Tier::Disk, got: Tier::Host }),
        };
        let disk = self.disk.as_ref().expect("a Disk home implies a Disk tier");
        let slot = self
            .host
            .alloc_slot()
            .ok_or(Error::TierFull { tier: Tier::Host, capacity_blocks: self.host.capacity() })?;
        let started = Instant::now();
        let mut w = match self.lock_slot(&self.host, slot, BlockId(NO_OWNER), "reload") {
            Ok(w) => w,
            Err(e) => {
                self.host.release_slot(slot);
                return Err(e);
            }
        };
        let result = disk.read_blocks(&[(disk_slot, block)], |_, bytes| w.bytes_mut().copy_from_slice(bytes)).remove(0);
        if let Err(e) = result {
            drop(w);
            self.host.release_slot(slot);
            self.disk_failure(&mut state, block, disk_slot, &e);
            return Err(e);
        }
        w.set_owner(block.0);
        drop(w);
        self.counters(Tier::Host).moved(Tier::Host, self.layout.block_bytes(), started);
        disk.free_slot(disk_slot);
        let meta = state.meta_mut(block)?;
        meta.home = Home::Host(slot);
        if let Some(gpu_slot) = meta.gpu_slot {
            self.publish(Home::Host(slot), gpu_slot);
        }
        self.remap(block, state.meta(block)?);
        Ok(())
    }

    /// Counts a failed disk read; a corrupt or missing block is lost from then on.
    pub(super) fn disk_failure(&self, state: &mut State, block: BlockId, disk_slot: u32, error: &Error) {
        let kind = match error {
            Error::Corrupt { .. } => "corrupt",
            Error::Missing { .. } => "missing",
            _ => "disk_read",
        };
        self.counters(Tier::Disk).failed(Tier::Disk, kind);
        if matches!(error, Error::Corrupt { .. } | Error::Missing { .. }) {
            if let Some(meta) = state.blocks.get_mut(&block) {
                meta.home = Home::Lost(if matches!(error, Error::Corrupt { .. }) {
                    "corrupt on disk"
                } else {
                    "no intact copy on disk"
                });
                self.disk.as_ref().expect("a Disk home implies a Disk tier").free_slot(disk_slot);
                self.remap(block, &state.blocks[&block]);
            }
        }
    }

    /// Copies `block` into the Gpu tier (evicting a victim chosen by the replacer if full);
    /// returns its Gpu slot. [`Error::TierFull`] when every Gpu slot is pinned.
    pub fn admit(&self, block: BlockId) -> Result<u32> {
        let mut state = self.state()?;
        self.admit_locked(&mut state, block)
    }

    pub(super) fn admit_locked(&self, state: &mut State, block: BlockId) -> Result<u32> {
        let meta = state.meta(block)?;
        if let Some(slot) = meta.gpu_slot {
            state.replacer.access(slot);
            return Ok(slot);
        }
        let home = meta.home;
        if let Home::Lost(reason) = home {
            return Err(Error::Missing { block, reason });
        }
        let started = Instant::now();
        let mut w = match self.gpu.alloc_slot() {
            Some(slot) => match self.lock_slot(&self.gpu, slot, BlockId(NO_OWNER), "admit") {
                Ok(w) => w,
                Err(e) => {
                    self.gpu.release_slot(slot);
                    return Err(e);
                }
            },
            None => {
                let w = self.take_victim(state, None).inspect_err(|e| {
                    if matches!(e, Error::TierFull { .. }) {
                        self.counters(Tier::Gpu).failed(Tier::Gpu, "full");
                    }
                })?;
                if !self.epochs.retire(w.slot()) {
                    // An older device read may still read the victim's bytes: it stays
                    // quarantined, and this block waits for a later round.
                    drop(w);
                    return Err(Error::DeviceReadsInFlight { quarantined_blocks: self.epochs.quarantined() });
                }
                w
            }
        };
        let slot = w.slot();
        let copied = self.fill_from_home(state, block, home, &mut w).and_then(|()| {
            w.mirror().map_err(|message| Error::Io {
                op: "copy to gpu",
                block: Some(block),
                kind: std::io::ErrorKind::Other,
                message,
            })
        });
        if let Err(e) = copied {
            if matches!(e, Error::Io { op: "copy to gpu", .. }) {
                self.counters(Tier::Gpu).failed(Tier::Gpu, "copy");
            }
            w.set_owner(NO_OWNER);
            drop(w);
            self.gpu.release_slot(slot);
            return Err(e);
        }
        w.set_owner(block.0);
        drop(w);
        state.replacer.insert(slot);
        let meta = state.meta_mut(block)?;
        meta.gpu_slot = Some(slot);
        // The bytes are on the device (the mirror waited for its copy): publish the slot.
        self.publish(home, slot);
        self.remap(block, state.meta(block)?);
        self.counters(Tier::Gpu).moved(Tier::Gpu, self.layout.block_bytes(), started);
        Ok(slot)
    }

    /// Takes the replacer's victim out of the Gpu tier: clears the slot-table entry of its
    /// block (at once, or in the host mirror only, noting the Host slot in `staged` for a
    /// round's batch), empties and untracks the slot, and returns it latched; the caller gives
    /// it up. [`Error::DeviceReadsInFlight`] when nothing is evictable but slots are
    /// quarantined, [`Error::TierFull`] when every tracked slot is pinned (the caller counts
    /// the failure: a round's own unpublished admissions are untracked, which is none).
    pub(super) fn take_victim(&self, state: &mut State, staged: Option<&mut Vec<u32>>) -> Result<SlotWrite<'_>> {
        let mut taken = None;
        let gpu = &self.gpu;
        let victim = state.replacer.evict(&mut |slot| match gpu.lock(slot) {
            Ok(w) => {
                taken = Some(w);
                true
            }
            Err(_) => false, // pinned by a reader: never evicted
        });
        let (Some(_), Some(mut w)) = (victim, taken) else {
            let quarantined_blocks = self.epochs.quarantined();
            if quarantined_blocks > 0 {
                // Not a failure: slots come back when the device reads in flight end.
                return Err(Error::DeviceReadsInFlight { quarantined_blocks });
            }
            return Err(Error::TierFull { tier: Tier::Gpu, capacity_blocks: self.gpu.capacity() });
        };
        let old = BlockId(w.owner());
        if let Some(old_meta) = state.blocks.get_mut(&old) {
            match (staged, old_meta.home) {
                (Some(staged), Home::Host(host_slot)) => {
                    self.slot_table.stage(host_slot, None);
                    staged.push(host_slot);
                }
                (Some(_), _) => {}
                (None, home) => self.unpublish(home),
            }
            old_meta.gpu_slot = None;
            self.remap(old, &state.blocks[&old]);
        }
        TierCounters::add(&self.counters(Tier::Gpu).evictions, 1);
        w.set_owner(NO_OWNER);
        Ok(w)
    }

    /// Copies `block`'s bytes from its home into the host side of a latched Gpu slot. A failed
    /// Disk read is counted (and a corrupt block lost) here.
    pub(super) fn fill_from_home(
        &self,
        state: &mut State,
        block: BlockId,
        home: Home,
        w: &mut SlotWrite<'_>,
    ) -> Result<()> {
        match home {
            Home::Host(host_slot) => match self.host.pin(host_slot, block.0) {
                Ok(read) => {
                    w.bytes_mut().copy_from_slice(read.bytes());
                    Ok(())
                }
                // Only state-lock holders latch Host slots: a failure is a broken invariant.
                Err(failure) => panic!("admit: host slot {host_slot} of {block} unreadable ({failure:?})"),
            },
            Home::Disk(disk_slot) => {
                let disk = self.disk.as_ref().expect("a Disk home implies a Disk tier");
                let result = disk.read_blocks(&[(disk_slot, block)], |_, bytes| w.bytes_mut().copy_from_slice(bytes));
                result.into_iter().next().expect("one result").inspect_err(|e| {
                    self.disk_failure(state, block, disk_slot, e);
                })
            }
            Home::Lost(reason) => Err(Error::Missing { block, reason }),
        }
    }

    /// Drops `block`'s Gpu copy. [`Error::WrongTier`] if not cached, [`Error::Pinned`] if pinned.
    pub fn evict(&self, block: BlockId) -> Result<()> {
        let mut state = self.state()?;
        let meta = state.meta(block)?;
        if meta.gpu_slot.is_none() {
            return Err(Error::WrongTier { block, expected: Tier::Gpu, got: meta.home.tier() });
        }
        self.uncache_locked(&mut state, block, "evict")?;
        TierCounters::add(&self.counters(Tier::Gpu).evictions, 1);
        Ok(())
    }
}
