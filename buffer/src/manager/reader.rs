//! The plan path: a [`Reader`] looks clusters up in the mapping table without locks and pins
//! their blocks ([`PinGuard`]); Disk blocks and blocks that moved since the lookup are read by
//! id under the state lock instead. A reader hands its access records to the maintainer's queue
//! as one batch per plan.

use super::{AccessRecord, BlockMeta, BufferManager, Home, MISS};
use crate::arena::{PinFailure, SlotRead};
use crate::mapping::{BlockLocation, Locations, MappingReader};
use crate::stats::TierCounters;
use crate::{BlockId, ClusterKey, Error, Result, Tier};
use std::cell::{Cell, RefCell};

impl BufferManager {
    /// A reader for one plan: lock-free cluster lookups and pins.
    pub fn reader(&self) -> Reader<'_> {
        self.reader_logging(true)
    }

    /// A reader for a scan (an exact plan reading every block once): like [`Self::reader`],
    /// but its pins log no access records, so a scan neither admits what it reads into the
    /// Gpu tier nor evicts the blocks sparse plans keep re-reading (scan resistance, as a
    /// database's sequential scan bypasses its buffer pool's recency list). Hits still count.
    pub fn scan_reader(&self) -> Reader<'_> {
        self.reader_logging(false)
    }

    fn reader_logging(&self, track: bool) -> Reader<'_> {
        Reader {
            buffers: self,
            mapping: self.mapping.reader(),
            records: RefCell::new(Vec::new()),
            counts: Cell::new([0; 3]),
            track,
        }
    }

    /// Reads `blocks` by id like [`BufferManager::read`], with the Disk reads among them batched
    /// into one submission.
    fn read_many(&self, blocks: &[BlockId]) -> Vec<Result<PinGuard<'_>>> {
        let _span = tracing::trace_span!("read_blocks", blocks = blocks.len()).entered();
        let mut state = match self.state() {
            Ok(state) => state,
            Err(e) => return blocks.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut disk_items = Vec::new();
        let mut disk_positions = Vec::new();
        for (i, &block) in blocks.iter().enumerate() {
            if let Ok(BlockMeta { home: Home::Disk(slot), gpu_slot: None, .. }) = state.meta(block) {
                disk_items.push((*slot, block));
                disk_positions.push(i);
            }
        }
        let mut staged: Vec<Option<Box<[u8]>>> = vec![None; blocks.len()];
        let mut disk_results = Vec::new();
        if let Some(disk) = &self.disk {
            let block_bytes = self.layout.block_bytes();
            disk_results = disk.read_blocks(&disk_items, |k, bytes| {
                let mut copy = vec![0u8; block_bytes].into_boxed_slice();
                copy.copy_from_slice(bytes);
                staged[disk_positions[k]] = Some(copy);
            });
        }
        let mut disk_failed = vec![None; blocks.len()];
        for ((&(slot, block), result), &i) in disk_items.iter().zip(disk_results).zip(&disk_positions) {
            if let Err(e) = result {
                self.disk_failure(&mut state, block, slot, &e);
                disk_failed[i] = Some(e);
            }
        }
        let mut records = Vec::new();
        let results = blocks
            .iter()
            .enumerate()
            .map(|(i, &block)| {
                if let Some(e) = disk_failed[i].take() {
                    return Err(e);
                }
                match staged[i].take() {
                    Some(bytes) => {
                        if self.gpu.capacity() > 0 {
                            TierCounters::add(&self.counters(Tier::Gpu).misses, 1);
                        }
                        TierCounters::add(&self.counters(Tier::Host).misses, 1);
                        TierCounters::add(&self.counters(Tier::Disk).hits, 1);
                        records.push(AccessRecord { block, gpu_slot: MISS });
                        Ok(PinGuard { block, tier: Tier::Disk, bytes: PinBytes::Staged(bytes) })
                    }
                    // Not on Disk after all (moved since the lookup): the one-block path.
                    None => Err(Error::WrongTier { block, expected: Tier::Disk, got: Tier::Host }),
                }
            })
            .collect::<Vec<_>>();
        drop(state);
        self.log(records);
        // Blocks that were not on Disk any more are read one by one.
        results
            .into_iter()
            .zip(blocks)
            .map(|(result, &block)| match result {
                Err(Error::WrongTier { expected: Tier::Disk, .. }) => self.read(block),
                other => other,
            })
            .collect()
    }

    /// Reads `block` by id (the slow path of [`Reader::pin`]: takes the state lock, bounded).
    pub fn read(&self, block: BlockId) -> Result<PinGuard<'_>> {
        let mut state = self.state()?;
        let meta = state.meta(block)?;
        let (gpu_slot, home) = (meta.gpu_slot, meta.home);
        if let Some(slot) = gpu_slot {
            if let Ok(read) = self.gpu.pin(slot, block.0) {
                TierCounters::add(&self.counters(Tier::Gpu).hits, 1);
                self.log(vec![AccessRecord { block, gpu_slot: slot }]);
                return Ok(PinGuard { block, tier: Tier::Gpu, bytes: PinBytes::Frame(read) });
            }
        }
        if self.gpu.capacity() > 0 {
            TierCounters::add(&self.counters(Tier::Gpu).misses, 1);
        }
        let guard = match home {
            Home::Host(slot) => {
                let read = self.host.pin(slot, block.0).unwrap_or_else(|failure| {
                    panic!("read: host slot {slot} of {block} unreadable under the state lock ({failure:?})")
                });
                TierCounters::add(&self.counters(Tier::Host).hits, 1);
                PinGuard { block, tier: Tier::Host, bytes: PinBytes::Frame(read) }
            }
            Home::Disk(disk_slot) => {
                let disk = self.disk.as_ref().expect("a Disk home implies a Disk tier");
                let mut out = vec![0u8; self.layout.block_bytes()].into_boxed_slice();
                let result = disk.read_blocks(&[(disk_slot, block)], |_, bytes| out.copy_from_slice(bytes)).remove(0);
                if let Err(e) = result {
                    self.disk_failure(&mut state, block, disk_slot, &e);
                    return Err(e);
                }
                TierCounters::add(&self.counters(Tier::Host).misses, 1);
                TierCounters::add(&self.counters(Tier::Disk).hits, 1);
                PinGuard { block, tier: Tier::Disk, bytes: PinBytes::Staged(out) }
            }
            Home::Lost(reason) => return Err(Error::Missing { block, reason }),
        };
        self.log(vec![AccessRecord { block, gpu_slot: MISS }]);
        Ok(guard)
    }
}

/// Lock-free reads for one plan: cluster lookups (one epoch pin for the whole batch) and pins.
/// Every pin logs an access record; the reader hands them to the maintainer's queue as one
/// batch when dropped (or at [`Reader::flush`]), never blocking. Keep a reader for one plan.
pub struct Reader<'a> {
    buffers: &'a BufferManager,
    mapping: MappingReader<'a>,
    records: RefCell<Vec<AccessRecord>>,
    /// Gpu hits, Gpu misses, Host hits of this reader, added to the shared counters on flush.
    counts: Cell<[u64; 3]>,
    /// Log access records (false for scans).
    track: bool,
}

impl Drop for Reader<'_> {
    fn drop(&mut self) {
        self.flush();
    }
}

impl<'a> Reader<'a> {
    /// Hands the access records logged so far to the maintainer's queue and adds this reader's
    /// hit counts to the shared statistics.
    pub fn flush(&self) {
        let records = std::mem::take(&mut *self.records.borrow_mut());
        self.buffers.log(records);
        self.buffers.count_reads(self.counts.take());
    }

    fn note(&self, block: BlockId, gpu_slot: u32, tier: Tier) {
        if self.track {
            self.records.borrow_mut().push(AccessRecord { block, gpu_slot });
        }
        let mut counts = self.counts.get();
        match tier {
            Tier::Gpu => counts[0] += 1,
            _ => {
                counts[1] += u64::from(self.buffers.gpu.capacity() > 0);
                counts[2] += 1;
            }
        }
        self.counts.set(counts);
    }

    /// The blocks of cluster `key` with their locations as of now, or `None` if unmapped.
    #[inline]
    pub fn cluster(&self, key: &ClusterKey) -> Option<Locations<'_>> {
        self.mapping.get(key)
    }

    /// The blocks of each cluster of `keys` (a plan's retrieval set), appended to `out` in
    /// order; faster than [`Reader::cluster`] per key because the lookups' cache misses overlap.
    pub fn clusters<'r>(&'r self, keys: &[ClusterKey], out: &mut Vec<Option<Locations<'r>>>) {
        self.mapping.get_many(keys, out);
    }

    /// Pins every block of `locations` (a plan's retrieval set): Gpu and Host blocks as
    /// [`Reader::pin`] does, and all the blocks that must come from Disk in one batched read
    /// (one state-lock acquisition, one submission), instead of one I/O per block.
    pub fn pin_all(&self, locations: &[BlockLocation]) -> Vec<Result<PinGuard<'a>>> {
        let mut out: Vec<Option<Result<PinGuard<'a>>>> = Vec::with_capacity(locations.len());
        let mut from_disk = Vec::new();
        for (i, location) in locations.iter().enumerate() {
            if location.gpu_slot().is_none() && location.home().0 == Tier::Disk {
                from_disk.push(i);
                out.push(None);
            } else {
                out.push(Some(self.pin(location)));
            }
        }
        if !from_disk.is_empty() {
            let blocks: Vec<BlockId> = from_disk.iter().map(|&i| locations[i].block()).collect();
            let staged = self.buffers.read_many(&blocks);
            for (i, result) in from_disk.into_iter().zip(staged) {
                out[i] = Some(result);
            }
        }
        out.into_iter().map(|r| r.expect("every location was pinned")).collect()
    }

    /// Pins the block at `location` (from [`Reader::cluster`]). Serves it from the Gpu tier if
    /// the cached copy is still there, else from its Host slot, else through the slow path
    /// (Disk read, or a block that moved since the lookup). The guard says which tier served it.
    pub fn pin(&self, location: &BlockLocation) -> Result<PinGuard<'a>> {
        let buffers = self.buffers;
        let block = location.block();
        if let Some(slot) = location.gpu_slot() {
            if let Ok(read) = buffers.gpu.pin(slot, block.0) {
                self.note(block, slot, Tier::Gpu);
                return Ok(PinGuard { block, tier: Tier::Gpu, bytes: PinBytes::Frame(read) });
            }
        }
        if let (Tier::Host, slot) = location.home() {
            for attempt in 0..64 {
                match buffers.host.pin(slot, block.0) {
                    Ok(read) => {
                        self.note(block, MISS, Tier::Host);
                        return Ok(PinGuard { block, tier: Tier::Host, bytes: PinBytes::Frame(read) });
                    }
                    Err(PinFailure::Busy) if attempt < 32 => std::hint::spin_loop(),
                    Err(PinFailure::Busy) => std::thread::yield_now(),
                    Err(PinFailure::Moved) => break,
                }
            }
        }
        buffers.read(block)
    }
}

enum PinBytes<'a> {
    Frame(SlotRead<'a>),
    Staged(Box<[u8]>),
}

/// A pinned block: its bytes cannot be evicted, overwritten or moved while the guard lives.
/// Dereferences to the block's payload. (A block read from Disk is a private staged copy.)
pub struct PinGuard<'a> {
    block: BlockId,
    tier: Tier,
    bytes: PinBytes<'a>,
}

impl PinGuard<'_> {
    /// The block.
    pub fn block(&self) -> BlockId {
        self.block
    }

    /// The tier that served the read (what a plan records as the block's source tier).
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The Gpu or Host slot pinned (`None` for a staged Disk read).
    pub fn slot(&self) -> Option<u32> {
        match &self.bytes {
            PinBytes::Frame(read) => Some(read.slot()),
            PinBytes::Staged(_) => None,
        }
    }
}

impl std::ops::Deref for PinGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.bytes {
            PinBytes::Frame(read) => read.bytes(),
            PinBytes::Staged(bytes) => bytes,
        }
    }
}

impl std::fmt::Debug for PinGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinGuard").field("block", &self.block).field("tier", &self.tier).finish()
    }
}
