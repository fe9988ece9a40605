//! The write path for blocks and clusters: allocate a block (in the Host arena, or on Disk when
//! the arena is full), overwrite it, free it; map a cluster to its blocks, store a cluster's
//! bytes all or nothing, free a whole cluster. Each operation runs under the state lock and only
//! tries slot latches, so a pinned block refuses the change instead of taking it.

use super::{BlockMeta, BufferManager, Home, State};
use crate::arena::NO_OWNER;
use crate::{BlockId, BlockKey, ClusterKey, Error, Result, Tier};
use std::time::Instant;

impl BufferManager {
    /// A new block of `key`, zero-filled, homed in the Host arena — or on Disk when the arena is
    /// full (a spill), or [`Error::TierFull`] without a Disk tier.
    pub fn allocate(&self, key: BlockKey) -> Result<BlockId> {
        let mut state = self.state()?;
        self.allocate_locked(&mut state, key)
    }

    fn allocate_locked(&self, state: &mut State, key: BlockKey) -> Result<BlockId> {
        let block = BlockId(state.next_id);
        let home = self.new_home(block, &[])?;
        state.next_id += 1;
        state.blocks.insert(block, BlockMeta { key, cluster: None, home, gpu_slot: None });
        Ok(block)
    }

    /// A home for `block` holding `payload` (zero-padded): a Host slot, else a Disk slot.
    fn new_home(&self, block: BlockId, payload: &[u8]) -> Result<Home> {
        if let Some(slot) = self.host.alloc_slot() {
            let mut w = match self.lock_slot(&self.host, slot, BlockId(NO_OWNER), "allocate") {
                Ok(w) => w,
                Err(e) => {
                    self.host.release_slot(slot);
                    return Err(e);
                }
            };
            let bytes = w.bytes_mut();
            bytes[..payload.len()].copy_from_slice(payload);
            bytes[payload.len()..].fill(0);
            w.set_owner(block.0);
            return Ok(Home::Host(slot));
        }
        let Some(disk) = &self.disk else {
            return Err(Error::TierFull { tier: Tier::Host, capacity_blocks: self.host.capacity() });
        };
        let slot = disk.alloc_slot()?;
        let started = Instant::now();
        if let Err(e) = disk.write_blocks(&[(slot, block, payload)]).remove(0) {
            disk.free_slot(slot);
            self.counters(Tier::Disk).failed(Tier::Disk, "disk_write");
            return Err(e);
        }
        self.counters(Tier::Disk).moved(Tier::Disk, self.layout.block_bytes(), started);
        Ok(Home::Disk(slot))
    }

    /// Overwrites `block` with `bytes` (at most a block; the rest is zero-filled). Drops the
    /// block's Gpu copy first. Fails with [`Error::Pinned`] while a reader pins it.
    pub fn write(&self, block: BlockId, bytes: &[u8]) -> Result<()> {
        let mut state = self.state()?;
        self.write_locked(&mut state, block, bytes)
    }

    fn write_locked(&self, state: &mut State, block: BlockId, bytes: &[u8]) -> Result<()> {
        if bytes.len() > self.layout.block_bytes() {
            return Err(Error::WrongLength { expected: self.layout.block_bytes(), got: bytes.len() });
        }
        let home = state.meta(block)?.home;
        if let Home::Host(slot) = home {
            // Check the pin before dropping the Gpu copy, so a refused write changes nothing.
            let mut w = self.lock_slot(&self.host, slot, block, "overwrite")?;
            self.uncache_locked(state, block, "overwrite")?;
            let out = w.bytes_mut();
            out[..bytes.len()].copy_from_slice(bytes);
            out[bytes.len()..].fill(0);
            return Ok(());
        }
        self.uncache_locked(state, block, "overwrite")?;
        match home {
            Home::Host(_) => unreachable!("handled above"),
            Home::Disk(slot) => {
                let disk = self.disk.as_ref().expect("a Disk home implies a Disk tier");
                let started = Instant::now();
                if let Err(e) = disk.write_blocks(&[(slot, block, bytes)]).remove(0) {
                    // The old bytes may be torn: the block is lost until written again.
                    disk.free_slot(slot);
                    let meta = state.meta_mut(block)?;
                    meta.home = Home::Lost("a write to disk failed");
                    self.counters(Tier::Disk).failed(Tier::Disk, "disk_write");
                    self.remap(block, state.meta(block)?);
                    return Err(e);
                }
                self.counters(Tier::Disk).moved(Tier::Disk, self.layout.block_bytes(), started);
                Ok(())
            }
            Home::Lost(_) => {
                let home = self.new_home(block, bytes)?;
                let meta = state.meta_mut(block)?;
                meta.home = home;
                self.remap(block, state.meta(block)?);
                Ok(())
            }
        }
    }

    /// Drops the Gpu copy of `block`, if any (refused while pinned).
    pub(super) fn uncache_locked(&self, state: &mut State, block: BlockId, op: &'static str) -> Result<()> {
        let Some(slot) = state.meta(block)?.gpu_slot else { return Ok(()) };
        let mut w = self.lock_slot(&self.gpu, slot, block, op)?;
        self.unpublish(state.meta(block)?.home);
        w.set_owner(NO_OWNER);
        drop(w);
        state.replacer.remove(slot);
        self.retire_gpu_slot(slot);
        state.meta_mut(block)?.gpu_slot = None;
        self.remap(block, state.meta(block)?);
        Ok(())
    }

    /// Frees `block` and its slots in every tier; removes it from its cluster's block list.
    /// [`Error::DoubleFree`] for a block freed before, [`Error::Pinned`] while pinned.
    pub fn free(&self, block: BlockId) -> Result<()> {
        let mut state = self.state()?;
        self.free_locked(&mut state, block)
    }

    fn free_locked(&self, state: &mut State, block: BlockId) -> Result<()> {
        let Some(meta) = state.blocks.get(&block) else {
            return Err(if block.0 > 0 && block.0 < state.next_id {
                Error::DoubleFree { block }
            } else {
                Error::UnknownBlock { block }
            });
        };
        let home = meta.home;
        // Take every latch first, so a refusal leaves everything as it was.
        let host_latch = match home {
            Home::Host(slot) => Some(self.lock_slot(&self.host, slot, block, "free")?),
            _ => None,
        };
        let gpu_latch = match meta.gpu_slot {
            Some(slot) => Some((slot, self.lock_slot(&self.gpu, slot, block, "free")?)),
            None => None,
        };
        let meta = state.blocks.remove(&block).expect("checked above");
        if let Some((key, index)) = meta.cluster {
            self.detach_locked(state, key, index as usize);
        }
        if let Some((slot, mut w)) = gpu_latch {
            self.unpublish(home);
            w.set_owner(NO_OWNER);
            drop(w);
            state.replacer.remove(slot);
            self.retire_gpu_slot(slot);
        }
        if let (Some(mut w), Home::Host(slot)) = (host_latch, home) {
            w.set_owner(NO_OWNER);
            drop(w);
            self.host.release_slot(slot);
        }
        if let Home::Disk(slot) = home {
            self.disk.as_ref().expect("a Disk home implies a Disk tier").free_slot(slot);
        }
        Ok(())
    }

    /// Removes block `index` from cluster `key`'s list and renumbers the blocks after it.
    fn detach_locked(&self, state: &mut State, key: ClusterKey, index: usize) {
        let Some(mut blocks) = self.mapping.get(&key) else { return };
        if index >= blocks.len() {
            return;
        }
        blocks.remove(index);
        for (i, location) in blocks.iter().enumerate().skip(index) {
            if let Some(meta) = state.blocks.get_mut(&location.block()) {
                meta.cluster = Some((key, i as u32));
            }
        }
        if blocks.is_empty() {
            self.mapping.remove(&key);
        } else {
            // Rebuild from the block table: the copied locations may be older than the metadata.
            let fresh = blocks.iter().map(|l| state.blocks[&l.block()].location(l.block())).collect();
            self.mapping.insert(key, fresh);
        }
    }

    /// Maps cluster `key` to `blocks` (in order). A cluster mapped before loses its old list
    /// (its blocks stay allocated, detached). [`Error::AlreadyAttached`] if a block belongs
    /// to another cluster.
    pub fn attach(&self, key: ClusterKey, blocks: &[BlockId]) -> Result<()> {
        let mut state = self.state()?;
        self.attach_locked(&mut state, key, blocks)
    }

    fn attach_locked(&self, state: &mut State, key: ClusterKey, blocks: &[BlockId]) -> Result<()> {
        for (i, &block) in blocks.iter().enumerate() {
            match state.meta(block)?.cluster {
                Some((cluster, _)) if cluster != key => return Err(Error::AlreadyAttached { block, cluster }),
                _ if blocks[..i].contains(&block) => return Err(Error::AlreadyAttached { block, cluster: key }),
                _ => {}
            }
        }
        if let Some(old) = self.mapping.get(&key) {
            for location in old {
                if let Some(meta) = state.blocks.get_mut(&location.block()) {
                    meta.cluster = None;
                }
            }
        }
        let mut locations = Vec::with_capacity(blocks.len());
        for (i, &block) in blocks.iter().enumerate() {
            let meta = state.meta_mut(block)?;
            meta.cluster = Some((key, i as u32));
            locations.push(meta.location(block));
        }
        self.mapping.insert(key, locations);
        Ok(())
    }

    /// Stores a cluster's bytes: allocates `blocks_for(bytes.len())` blocks of the cluster's
    /// head, writes them (the last zero-padded) and maps the cluster to them. All or nothing.
    pub fn store_cluster(&self, key: ClusterKey, bytes: &[u8]) -> Result<Vec<BlockId>> {
        let mut state = self.state()?;
        let mut blocks = Vec::with_capacity(self.layout.blocks_for(bytes.len()));
        let result = (|| {
            for chunk in bytes.chunks(self.layout.block_bytes()) {
                let block = self.allocate_locked(&mut state, key.block_key())?;
                blocks.push(block);
                self.write_locked(&mut state, block, chunk)?;
            }
            self.attach_locked(&mut state, key, &blocks)
        })();
        if let Err(e) = result {
            for &block in &blocks {
                // Fresh, unpinned blocks: freeing cannot fail but for a broken invariant.
                self.free_locked(&mut state, block).expect("freeing a block of a failed store");
            }
            return Err(e);
        }
        Ok(blocks)
    }

    /// Frees every block of cluster `key` and unmaps it; returns the blocks freed. Stops at the
    /// first block that cannot be freed (pinned): the rest stay mapped.
    pub fn free_cluster(&self, key: ClusterKey) -> Result<usize> {
        let mut state = self.state()?;
        let blocks = self.mapping.get(&key).unwrap_or_default();
        for location in &blocks {
            self.free_locked(&mut state, location.block())?;
        }
        Ok(blocks.len())
    }
}
