//! The buffer manager: blocks with a home (Host arena slot, or Disk slot when spilled), an
//! optional copy in the Gpu tier's cache, the cluster mapping table, and the queue of access
//! records that the maintainer turns into admissions and evictions.
//!
//! Two paths. The *plan path* ([`Reader`]) is lock-free: mapping-table lookup, then a pin on
//! the slot the location names and a check that the slot still holds the block. The *write
//! path* (allocate, write, free, spill, reload, admit, evict) runs under one state mutex taken
//! with a bound; it only ever *tries* a slot's exclusive latch, so a pinned block is never
//! overwritten, moved or evicted: the operation fails with [`Error::Pinned`] or picks another victim.

mod round;

use crate::arena::{FramePool, HostMemoryKind, PinFailure, SlotRead, SlotWrite, NO_OWNER};
use crate::device_read::{DeviceRead, Epochs};
use crate::disk::{DiskConfig, DiskTier};
use crate::mapping::{BlockLocation, Locations, MappingReader, MappingTable};
use crate::replacer::{ReplacerKind, SanityReplacer};
use crate::slot_table::{DeviceSlotTable, SlotTable};
use crate::stats::{BufferStats, TierCounters};
use crate::{BlockId, BlockKey, BlockLayout, ClusterKey, Error, MemoryBudget, Replacer, Reservation, Result, Tier};
use crossbeam_queue::ArrayQueue;
use parking_lot::{Mutex, MutexGuard};
use round::Round;
use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Settings of a [`BufferManager`].
#[derive(Debug, Clone)]
pub struct BufferConfig {
    /// Block size.
    pub layout: BlockLayout,
    /// Slots of the Host arena (the host-memory budget in blocks).
    pub host_blocks: usize,
    /// Slots of the Gpu tier's cache (0: no Gpu tier).
    pub gpu_blocks: usize,
    /// Replacement policy of the Gpu tier.
    pub replacer: ReplacerKind,
    /// The Disk tier (`None`: a full Host tier is an error instead of a spill).
    pub disk: Option<DiskConfig>,
    /// Capacity of the access-record queue, in batches (a [`Reader`] logs its records as one
    /// batch when dropped); batches beyond it are dropped and their records counted. The
    /// queue of cluster reads ([`BufferManager::log_cluster_reads`]) has the same capacity.
    pub access_queue_batches: usize,
    /// Bound on waiting for the state lock (write path and the readers' slow path).
    pub lock_timeout: Duration,
    /// Wrap the replacer in [`SanityReplacer`] (tests, fuzzing).
    pub check_replacer: bool,
    /// A host-memory budget the arena's bytes are reserved from (the engine's), so a manager
    /// that does not fit fails with [`Error::OutOfMemory`] before mapping anything.
    pub host_budget: Option<Arc<MemoryBudget>>,
    /// Use the GPU when the `cuda` feature is on and GPU 0 answers: the Host arena in pinned,
    /// device-mapped memory (`cuMemHostAlloc`), and the Gpu tier mirrored in device memory
    /// (CPU readers use its host side, pinned too as the source of asynchronous copies;
    /// kernels read `gpu_device_base`). Otherwise (and on any failure, said once) anonymous
    /// host memory. [`BufferManager::host_memory`] and [`BufferManager::gpu_device_base`] say
    /// what it got.
    pub pinned_host: bool,
}

impl BufferConfig {
    /// 2 KiB blocks, `host_blocks` in the Host arena, `gpu_blocks` cached, LRU, no Disk tier,
    /// a queue of 4096 batches, a 1 s lock bound.
    pub fn new(host_blocks: usize, gpu_blocks: usize) -> Self {
        Self {
            layout: BlockLayout::default(),
            host_blocks,
            gpu_blocks,
            replacer: ReplacerKind::Lru,
            disk: None,
            access_queue_batches: 4096,
            lock_timeout: Duration::from_secs(1),
            check_replacer: cfg!(debug_assertions),
            host_budget: None,
            pinned_host: true,
        }
    }
}

/// Where a block's bytes live when not cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    Host(u32),
    Disk(u32),
    /// The bytes were lost (corrupt on disk, failed write): never served; a write restores it.
    Lost(&'static str),
}

impl Home {
    fn tier(self) -> Tier {
        match self {
            Home::Host(_) => Tier::Host,
            Home::Disk(_) | Home::Lost(_) => Tier::Disk,
        }
    }
}

#[derive(Debug)]
struct BlockMeta {
    #[allow(dead_code)] // kept for inspection and the engine's per-head accounting later
    key: BlockKey,
    cluster: Option<(ClusterKey, u32)>,
    home: Home,
    gpu_slot: Option<u32>,
}

impl BlockMeta {
    fn location(&self, block: BlockId) -> BlockLocation {
        let (tier, slot) = match self.home {
            Home::Host(s) => (Tier::Host, s),
            Home::Disk(s) => (Tier::Disk, s),
            Home::Lost(_) => (Tier::Disk, u32::MAX),
        };
        BlockLocation::new(block, tier, slot).with_gpu_slot(self.gpu_slot)
    }
}

struct State {
    blocks: crate::block::IdMap<BlockMeta>,
    next_id: u64,
    replacer: Box<dyn Replacer>,
}

impl State {
    fn meta(&self, block: BlockId) -> Result<&BlockMeta> {
        self.blocks.get(&block).ok_or(Error::UnknownBlock { block })
    }
    fn meta_mut(&mut self, block: BlockId) -> Result<&mut BlockMeta> {
        self.blocks.get_mut(&block).ok_or(Error::UnknownBlock { block })
    }
}

/// One access of a plan, for the maintainer.
#[derive(Debug, Clone, Copy)]
struct AccessRecord {
    block: BlockId,
    /// The Gpu slot that served it (a hit), or `u32::MAX` (a miss: admission candidate).
    gpu_slot: u32,
}

const MISS: u32 = u32::MAX;
const TIERS: [Tier; 3] = Tier::ALL;

fn tier_index(tier: Tier) -> usize {
    match tier {
        Tier::Gpu => 0,
        Tier::Host => 1,
        Tier::Disk => 2,
    }
}

/// The buffer manager (see the module docs).
///
/// ```
/// use attnstore_buffer::{BufferConfig, BufferManager, ClusterKey, Tier};
///
/// let buffers = BufferManager::new(BufferConfig::new(64, 8))?;
/// let key = ClusterKey { context: 1, layer: 0, head: 0, cluster: 3 };
/// let blocks = buffers.store_cluster(key, &[7u8; 3000])?; // two 2 KiB blocks
/// let reader = buffers.reader();
/// let first = reader.cluster(&key).expect("mapped").first().expect("two blocks");
/// assert_eq!(first.tier(), Tier::Host);
/// let pinned = reader.pin(&first)?; // never evicted or overwritten while held
/// assert_eq!(pinned[0], 7);
/// drop((pinned, reader));
/// buffers.maintain(usize::MAX); // admits the missed block into the Gpu tier
/// assert_eq!(buffers.tier_of(blocks[0])?, Tier::Gpu);
/// # Ok::<(), attnstore_buffer::Error>(())
/// ```
pub struct BufferManager {
    layout: BlockLayout,
    replacer_name: &'static str,
    /// Held for the manager's life: the arena's bytes in the engine's host budget.
    _host_reservation: Option<Reservation>,
    lock_timeout: Duration,
    host: FramePool,
    gpu: FramePool,
    disk: Option<DiskTier>,
    mapping: MappingTable,
    state: Mutex<State>,
    queue: ArrayQueue<Vec<AccessRecord>>,
    /// Clusters read by device-planned steps (no pins, so no access records).
    cluster_reads: ArrayQueue<ClusterReads>,
    /// The background maintainer's thread, woken when a device step logs its cluster reads
    /// (see [`BufferManager::set_waker`]).
    waker: Mutex<Option<std::thread::Thread>>,
    /// Host slot → Gpu slot of the block homed there, for device-planned steps.
    slot_table: SlotTable,
    /// Device reads in flight and the Gpu slots they keep from reuse.
    epochs: Epochs,
    /// `maintain` batches a round's device writes and publishes its admissions at the end (the
    /// Gpu tier has a device mirror; forced on in tests and the fuzz driver).
    batched_rounds: bool,
    queued_records: AtomicU64,
    dropped: AtomicU64,
    /// Cluster reads of device steps superseded by a newer step of the same layer.
    superseded: AtomicU64,
    counters: [TierCounters; 3],
}

impl BufferManager {
    /// A buffer manager with empty tiers.
    pub fn new(config: BufferConfig) -> Result<Self> {
        if config.access_queue_batches == 0 {
            return Err(Error::BadConfig { what: "access_queue_batches", expected: "at least 1", got: 0 });
        }
        let block_bytes = config.layout.block_bytes();
        let host_reservation = match &config.host_budget {
            Some(budget) => Some(budget.reserve(config.host_blocks.saturating_mul(block_bytes))?),
            None => None,
        };
        let disk = match config.disk {
            Some(disk) => {
                if !block_bytes.is_multiple_of(crate::disk::DIRECT_IO_ALIGN) {
                    return Err(Error::Unaligned {
                        what: "block size for O_DIRECT",
                        expected_multiple: crate::disk::DIRECT_IO_ALIGN,
                        got: block_bytes,
                    });
                }
                Some(DiskTier::open(disk, block_bytes)?)
            }
            None => None,
        };
        if i32::try_from(config.gpu_blocks).is_err() {
            // The slot table stores Gpu slots as i32 (-1: not cached) for the kernels.
            return Err(Error::BadConfig { what: "gpu_blocks", expected: "< 2^31", got: config.gpu_blocks as u64 });
        }
        let mut replacer = config.replacer.build(config.gpu_blocks)?;
        if config.check_replacer {
            replacer = Box::new(SanityReplacer::new(replacer));
        }
        let host = FramePool::new(Tier::Host, config.host_blocks, block_bytes, config.pinned_host)?;
        let gpu = FramePool::new(Tier::Gpu, config.gpu_blocks, block_bytes, config.pinned_host)?;
        let slot_table = SlotTable::new(host.capacity(), &gpu);
        let batched_rounds = gpu.device_base().is_some();
        Ok(Self {
            layout: config.layout,
            replacer_name: replacer.name(),
            _host_reservation: host_reservation,
            lock_timeout: config.lock_timeout,
            host,
            gpu,
            disk,
            mapping: MappingTable::new(),
            state: Mutex::new(State { blocks: crate::block::IdMap::default(), next_id: 1, replacer }),
            queue: ArrayQueue::new(config.access_queue_batches),
            cluster_reads: ArrayQueue::new(config.access_queue_batches),
            waker: Mutex::new(None),
            slot_table,
            epochs: Epochs::new(),
            batched_rounds,
            queued_records: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            superseded: AtomicU64::new(0),
            counters: Default::default(),
        })
    }

    /// Makes `maintain` batch its rounds as with a Gpu tier in device memory, on a machine
    /// without one too (tests and the fuzz driver check the batched path on the CPU).
    pub(crate) fn force_batched_rounds(&mut self) {
        self.batched_rounds = true;
    }

    /// The block layout.
    pub fn layout(&self) -> BlockLayout {
        self.layout
    }

    /// The cluster mapping table.
    pub fn mapping(&self) -> &MappingTable {
        &self.mapping
    }

    /// The Disk tier, when configured (for tools and benches).
    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
    }

    fn counters(&self, tier: Tier) -> &TierCounters {
        &self.counters[tier_index(tier)]
    }

    /// Adds a batch of reads to the shared counters (Gpu hits, Gpu misses, Host hits): once
    /// per plan or per round, not per block, so plan threads share no counter line per pin.
    fn count_reads(&self, [gpu_hits, gpu_misses, host_hits]: [u64; 3]) {
        let (gpu, host) = (self.counters(Tier::Gpu), self.counters(Tier::Host));
        for (counter, n) in [(&gpu.hits, gpu_hits), (&gpu.misses, gpu_misses), (&host.hits, host_hits)] {
            if n > 0 {
                TierCounters::add(counter, n);
            }
        }
    }

    fn state(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .try_lock_for(self.lock_timeout)
            .ok_or(Error::Timeout { op: "buffer state lock", limit_ms: self.lock_timeout.as_millis() as u64 })
    }

    /// Latches a slot whose owner is known to the state lock's holder. A reader that raced
    /// with a move may hold a pin for a moment (to find the slot moved), so spin briefly.
    fn lock_slot<'p>(&self, pool: &'p FramePool, slot: u32, block: BlockId, op: &'static str) -> Result<SlotWrite<'p>> {
        let mut last = 0;
        for attempt in 0..1000 {
            match pool.lock(slot) {
                Ok(w) => return Ok(w),
                Err(pins) if block.0 != NO_OWNER && pool.owner(slot) == block.0 => {
                    // A real pin by a reader of this very block: refuse at once.
                    return Err(Error::Pinned { block, pins, op });
                }
                Err(pins) => last = pins,
            }
            if attempt > 100 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        Err(Error::Pinned { block, pins: last, op })
    }

    /// Queues a batch of access records, or drops and counts them when the queue is full
    /// (never blocks). One push per plan keeps the plan path off the queue's cache lines.
    fn log(&self, records: Vec<AccessRecord>) {
        let n = records.len() as u64;
        if n == 0 {
            return;
        }
        // Relaxed: statistics.
        match self.queue.push(records) {
            Ok(()) => self.queued_records.fetch_add(n, Ordering::Relaxed),
            Err(_) => self.dropped.fetch_add(n, Ordering::Relaxed),
        };
    }

    fn remap(&self, block: BlockId, meta: &BlockMeta) {
        if let Some((key, index)) = meta.cluster {
            let location = meta.location(block);
            self.mapping.update_block(&key, index as usize, block, |_| location);
        }
    }

    /// Publishes in the slot table that the block homed at `home` is cached in `gpu_slot`:
    /// only once the slot's bytes are on the device.
    fn publish(&self, home: Home, gpu_slot: u32) {
        if let Home::Host(host_slot) = home {
            if self.slot_table.set(host_slot, gpu_slot).is_err() {
                TierCounters::add(&self.counters(Tier::Gpu).failures, 1);
            }
        }
    }

    /// Clears the slot-table entry of the block homed at `home` (its Gpu copy goes, or it
    /// leaves the Host slot): before the Gpu slot can be overwritten.
    fn unpublish(&self, home: Home) {
        if let Home::Host(host_slot) = home {
            if self.slot_table.clear(host_slot).is_err() {
                TierCounters::add(&self.counters(Tier::Gpu).failures, 1);
            }
        }
    }

    /// Gives up an emptied Gpu slot (owner cleared, untracked by the replacer, no table entry
    /// names it): back to the free list, or into the quarantine while an older device read is
    /// in flight.
    fn retire_gpu_slot(&self, slot: u32) {
        if self.epochs.retire(slot) {
            self.gpu.release_slot(slot);
        }
    }

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
            TierCounters::add(&self.counters(Tier::Disk).failures, 1);
            return Err(e);
        }
        self.counters(Tier::Disk).moved(self.layout.block_bytes(), started);
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
                    TierCounters::add(&self.counters(Tier::Disk).failures, 1);
                    self.remap(block, state.meta(block)?);
                    return Err(e);
                }
                self.counters(Tier::Disk).moved(self.layout.block_bytes(), started);
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
    fn uncache_locked(&self, state: &mut State, block: BlockId, op: &'static str) -> Result<()> {
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
            TierCounters::add(&self.counters(Tier::Disk).failures, 1);
            return Err(e); // the block stays on Host, intact
        }
        self.counters(Tier::Disk).moved(self.layout.block_bytes(), started);
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
        self.counters(Tier::Host).moved(self.layout.block_bytes(), started);
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
    fn disk_failure(&self, state: &mut State, block: BlockId, disk_slot: u32, error: &Error) {
        TierCounters::add(&self.counters(Tier::Disk).failures, 1);
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

    fn admit_locked(&self, state: &mut State, block: BlockId) -> Result<u32> {
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
                        TierCounters::add(&self.counters(Tier::Gpu).failures, 1);
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
                TierCounters::add(&self.counters(Tier::Gpu).failures, 1);
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
        self.counters(Tier::Gpu).moved(self.layout.block_bytes(), started);
        Ok(slot)
    }

    /// Takes the replacer's victim out of the Gpu tier: clears the slot-table entry of its
    /// block (at once, or in the host mirror only, noting the Host slot in `staged` for a
    /// round's batch), empties and untracks the slot, and returns it latched; the caller gives
    /// it up. [`Error::DeviceReadsInFlight`] when nothing is evictable but slots are
    /// quarantined, [`Error::TierFull`] when every tracked slot is pinned (the caller counts
    /// the failure: a round's own unpublished admissions are untracked, which is none).
    fn take_victim(&self, state: &mut State, staged: Option<&mut Vec<u32>>) -> Result<SlotWrite<'_>> {
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
    fn fill_from_home(&self, state: &mut State, block: BlockId, home: Home, w: &mut SlotWrite<'_>) -> Result<()> {
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

    /// Reads `blocks` by id like [`BufferManager::read`], with the Disk reads among them batched
    /// into one submission.
    fn read_many(&self, blocks: &[BlockId]) -> Vec<Result<PinGuard<'_>>> {
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

    /// What backs the Host arena: anonymous memory, or pinned memory the GPU reads in place
    /// (with the arena's device address).
    pub fn host_memory(&self) -> HostMemoryKind {
        self.host.memory_kind()
    }

    /// Device address of the Gpu tier's slot 0 when the tier lives in device memory (feature
    /// `cuda` and a GPU): slot `s` (`BlockLocation::gpu_slot`) is at `base + s × block_bytes`.
    /// Admissions write the device copy on the pool's own stream before the slot is published.
    pub fn gpu_device_base(&self) -> Option<u64> {
        self.gpu.device_base()
    }

    /// The Host slot of `block` when its home is the Host arena (with [`Self::host_memory`]'s
    /// device base, what a zero-copy GPU gather reads: `base + slot × block_bytes`).
    pub fn host_slot(&self, block: BlockId) -> Result<Option<u32>> {
        let state = self.state()?;
        Ok(match state.meta(block)?.home {
            Home::Host(slot) => Some(slot),
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

    /// The device copy of the slot table, for a kernel that chooses its clusters on the
    /// device: an `i32` per Host slot, the Gpu slot of the block homed there (read at
    /// [`Self::gpu_device_base`]) or -1 (read the row from the Host arena,
    /// [`Self::host_memory`]). A kernel reads it only inside a [`DeviceRead`]
    /// ([`Self::device_read`]) taken before its launch. `None` without a Gpu tier in device
    /// memory (no feature `cuda`, no GPU, `gpu_blocks == 0`) or after a failed write to it.
    ///
    /// An entry is cleared on the device before its Gpu slot can be overwritten, and set only
    /// after the slot's new bytes are on the device or ordered before it on the Gpu pool's
    /// stream (the one stream that writes both: standalone operations wait for each write, a
    /// [`Self::maintain`] round enqueues its bytes, then its entries, and waits once), so a
    /// kernel never follows an entry to a half-written slot.
    pub fn device_slot_table(&self) -> Option<DeviceSlotTable> {
        self.slot_table.device()
    }

    /// Starts a device read: hold the guard from before launching a GPU step that reads the
    /// slot table and the Gpu tier until its results are back. While it lives, a Gpu slot whose
    /// table entry is cleared after this call is not reused for another block (it waits in a
    /// quarantine; admissions that would need it fail with [`Error::DeviceReadsInFlight`]).
    /// Without live guards nothing changes: an evicted slot is reused at once. Cheap (one
    /// short lock), meant once per GPU step.
    ///
    /// ```
    /// use attnstore_buffer::{BufferConfig, BufferManager, ClusterKey};
    ///
    /// let buffers = BufferManager::new(BufferConfig::new(64, 8))?;
    /// let key = ClusterKey { context: 1, layer: 0, head: 0, cluster: 0 };
    /// buffers.store_cluster(key, &[1u8; 2048])?;
    /// let step = buffers.device_read(); // before the launch
    /// // ... launch the kernel with buffers.device_slot_table(), wait for its results ...
    /// drop(step);
    /// buffers.log_cluster_reads(vec![key]); // what the step read, for the maintainer
    /// buffers.maintain(usize::MAX);
    /// # Ok::<(), attnstore_buffer::Error>(())
    /// ```
    pub fn device_read(&self) -> DeviceRead<'_> {
        DeviceRead::new(&self.epochs, &self.gpu)
    }

    /// Logs the clusters a device-planned step read (it takes no pins, so it logs no access
    /// records), for the maintainer: [`Self::maintain`] counts a hit for each block cached in
    /// the Gpu tier (and tells the replacer), and admits each block homed on Host that is not
    /// (a Gpu miss and a Host hit). Disk-homed or lost blocks count nothing (a device step
    /// reads only the Gpu tier and the Host arena); clusters freed since are skipped. Never
    /// blocks: when the queue is full the keys are dropped and counted with the dropped
    /// access records. A cluster counts as one record.
    pub fn log_cluster_reads(&self, keys: Vec<ClusterKey>) {
        self.push_cluster_reads(ClusterReads::Keys(keys));
    }

    /// [`Self::log_cluster_reads`] for the clusters a device step read, layer by layer (one
    /// entry per request of the step, so one round handles the whole step): the maintainer
    /// makes the keys, so the step's thread hands over its selections as it got them. Ids
    /// without a mapped cluster (padding) are skipped like clusters freed since. A round applies
    /// only the newest queued reads of each layer (see `take_cluster_reads`): a step's reads
    /// that a newer step of its layer overtook in the queue are superseded, not applied.
    pub fn log_layer_reads(&self, layers: Vec<LayerReads>) {
        self.push_cluster_reads(ClusterReads::Layers(layers.into_iter().map(StepReads::Ids).collect()));
    }

    /// [`Self::log_layer_reads`] for selections as a device step flagged them
    /// ([`FlaggedReads`]): the step's thread hands over the flagged words as it got them, and
    /// the maintainer picks the ids to apply (every miss, the hits of the sample) only for the
    /// newest reads of each layer, which a round applies. So a step spends no host time
    /// sorting its selection into reads.
    pub fn log_flagged_reads(&self, layers: Vec<FlaggedReads>) {
        self.push_cluster_reads(ClusterReads::Layers(layers.into_iter().map(StepReads::Flagged).collect()));
    }

    /// Puts `reads` in the queue, counted as queued, or as dropped when the queue is full.
    fn queue_cluster_reads(&self, reads: ClusterReads) {
        let n = reads.len() as u64;
        // Relaxed: statistics.
        match self.cluster_reads.push(reads) {
            Ok(()) => self.queued_records.fetch_add(n, Ordering::Relaxed),
            Err(_) => self.dropped.fetch_add(n, Ordering::Relaxed),
        };
    }

    fn push_cluster_reads(&self, reads: ClusterReads) {
        let n = reads.len() as u64;
        if n == 0 {
            return;
        }
        self.queue_cluster_reads(reads);
        // A device step's misses are read from the Host arena until they are admitted: wake
        // the maintainer now rather than at the end of its idle sleep or pause (one futex
        // wake per step when it is parked, nothing when it is busy).
        if let Some(thread) = self.waker.lock().as_ref() {
            thread.unpark();
        }
    }

    /// Names the thread that runs [`Self::maintain`] in the background (a parked maintainer
    /// is unparked when a device step logs its cluster reads); `None` stops the wake-ups.
    /// [`crate::Maintainer`] registers itself.
    pub fn set_waker(&self, thread: Option<std::thread::Thread>) {
        *self.waker.lock() = thread;
    }

    /// Stops the wake-ups if `thread` is the one registered (a maintainer leaving does not
    /// unregister a newer one).
    pub(crate) fn clear_waker(&self, thread: std::thread::ThreadId) {
        let mut waker = self.waker.lock();
        if waker.as_ref().is_some_and(|t| t.id() == thread) {
            *waker = None;
        }
    }

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

    /// Processes queued access records and cluster reads (whole batches, taken from both
    /// queues in turn until at least `max_records` or both are empty): hits update the
    /// replacer, misses are admitted into the Gpu tier (evicting by policy). Returns the
    /// records processed (a logged cluster counts as one).
    /// The [`Maintainer`](crate::Maintainer) thread calls this; tests may call it directly.
    ///
    /// With the Gpu tier in device memory a round is *batched*: its device writes (admitted
    /// slots' bytes, then the slot-table entries it changed) go asynchronously on the Gpu
    /// pool's stream, it waits once at the end, and only then publishes its admissions (owner
    /// tags, mapping table) and gives up its victims' slots. So a victim's slot is reused by a
    /// later round, never the round that evicted it: an admission that finds no free slot
    /// evicts for itself and waits, and a round evicts no more victims than it has admissions
    /// waiting beyond the slots already quarantined. A block is admitted once per round. Without
    /// a device mirror each admission is made and published at once, as by [`Self::admit`].
    pub fn maintain(&self, max_records: usize) -> usize {
        let mut records = Vec::new();
        let mut clusters = Vec::new();
        let limit = max_records.min(1 << 16);
        while records.len() < limit {
            let Some(batch) = self.queue.pop() else { break };
            self.queued_records.fetch_sub(batch.len() as u64, Ordering::Relaxed);
            records.extend(batch);
        }
        self.take_cluster_reads(limit.saturating_sub(records.len()), &mut clusters);
        let processed = records.len() + clusters.len();
        if processed == 0 || self.gpu.capacity() == 0 {
            return processed;
        }
        // The previous round's retired mapping buckets are past every reader by now: free
        // them here rather than in a plan thread's epoch pin.
        self.mapping.collect_garbage();
        let Ok(mut state) = self.state() else {
            TierCounters::add(&self.counters(Tier::Gpu).failures, 1);
            return records.len();
        };
        let trace = trace_rounds().then(Instant::now);
        let mut round = self.batched_rounds.then(|| Round::new(trace.is_some()));
        for record in &records {
            if record.gpu_slot != MISS {
                let cached = state.blocks.get(&record.block).and_then(|m| m.gpu_slot);
                if cached == Some(record.gpu_slot) {
                    state.replacer.access(record.gpu_slot);
                }
            } else if let Some(round) = round.as_mut() {
                self.admit_batched(&mut state, record.block, round);
            } else {
                match self.admit_locked(&mut state, record.block) {
                    // Freed or lost since the access: nothing to admit.
                    Ok(_) | Err(Error::UnknownBlock { .. } | Error::Missing { .. }) => {}
                    Err(_) => {} // counted where it failed (full of pinned slots, disk errors)
                }
            }
        }
        let mut counts = ClusterReadCounts::default();
        if !clusters.is_empty() {
            // One epoch pin and overlapping lookups for the round's clusters (those freed since
            // the step are skipped: nothing to keep warm). The lists stay readable under the
            // pin while the round remaps blocks; Gpu slots are read as the round goes.
            let reader = self.mapping.reader();
            let mut lists = Vec::with_capacity(clusters.len());
            reader.get_many(&clusters, &mut lists);
            for locations in lists.into_iter().flatten() {
                self.resolve_cluster_read(&mut state, locations, round.as_mut(), &mut counts);
            }
        }
        counts.add_to(self);
        let admitted = round.as_ref().map_or(0, Round::admitted);
        let steps = round.as_ref().and_then(Round::times);
        let chosen = trace.map(|t| t.elapsed());
        if let Some(round) = round {
            self.finish_round(&mut state, round);
        }
        drop(state);
        self.mapping.collect_garbage();
        if let (Some(t), Some(chosen)) = (trace, chosen) {
            eprintln!(
                "attnstore-buffer: round of {} records and {} cluster reads: {admitted} batched admissions; {:.2} ms choosing, {:.2} ms in all",
                records.len(),
                clusters.len(),
                chosen.as_secs_f64() * 1e3,
                t.elapsed().as_secs_f64() * 1e3
            );
            if let Some(steps) = steps {
                let names = ["victims", "latches", "fills"];
                let parts: Vec<String> = names
                    .iter()
                    .zip(steps)
                    .map(|(n, (d, c))| format!("{n} {c} in {:.2} ms", d.as_secs_f64() * 1e3))
                    .collect();
                eprintln!("attnstore-buffer:   {}", parts.join(", "));
            }
        }
        processed
    }

    /// Takes the queued cluster reads a round applies into `clusters`: logged keys
    /// ([`Self::log_cluster_reads`]) in order while fewer than `budget` are taken (the rest stay
    /// queued for later rounds), and of the device steps' reads ([`Self::log_layer_reads`],
    /// [`Self::log_flagged_reads`]) only the newest of each (context, layer) — all of them are drained, the older ones superseded
    /// (counted in [`BufferStats::superseded_cluster_reads`], not applied). A step logs what it
    /// read so the maintainer admits its misses and keeps its hits warm; when steps come faster
    /// than rounds, a round applying the queued steps one by one works on ever older
    /// selections (at 1M tokens the queue grew through a whole run and the steps found only a
    /// third of their clusters in the Gpu tier), while the newest step of a layer says best
    /// what its next step will read.
    fn take_cluster_reads(&self, budget: usize, clusters: &mut Vec<ClusterKey>) {
        let mut newest: Vec<StepReads> = Vec::new();
        let mut later = Vec::new();
        let mut superseded = 0u64;
        while let Some(reads) = self.cluster_reads.pop() {
            // Relaxed: statistics.
            self.queued_records.fetch_sub(reads.len() as u64, Ordering::Relaxed);
            match reads {
                ClusterReads::Keys(keys) if clusters.len() < budget && later.is_empty() => clusters.extend(keys),
                ClusterReads::Keys(keys) => later.push(ClusterReads::Keys(keys)),
                ClusterReads::Layers(layers) => {
                    for reads in layers {
                        match newest.iter_mut().find(|n| n.layer_key() == reads.layer_key()) {
                            Some(older) => {
                                superseded += older.len() as u64;
                                *older = reads;
                            }
                            None => newest.push(reads),
                        }
                    }
                }
            }
        }
        self.superseded.fetch_add(superseded, Ordering::Relaxed);
        // Keys beyond the budget go back, in order, for the next rounds (a full queue drops and
        // counts them as a push would).
        for keys in later {
            self.queue_cluster_reads(keys);
        }
        ClusterReads::Layers(newest).append_to(clusters);
    }

    /// Applies one cluster read of a device-planned step (see [`Self::log_cluster_reads`]):
    /// the cluster's blocks as the mapping table listed them at the round's lookup, counting
    /// their Gpu hits and misses in `counts`.
    ///
    /// Under the state lock the mapping table says what the blocks' metadata says (every
    /// change of a block's tier or Gpu slot is remapped before the lock is released; a round's
    /// own admissions are published only at its end, and `admit_batched` admits a block once
    /// per round), so a hit costs one replacer touch and an owner-tag read, no metadata
    /// lookup: rounds stay short and the blocks a step missed reach the Gpu tier sooner.
    fn resolve_cluster_read<'s>(
        &'s self,
        state: &mut State,
        locations: Locations<'_>,
        mut round: Option<&mut Round<'s>>,
        counts: &mut ClusterReadCounts,
    ) {
        for location in locations.iter() {
            // Each location is read now, but the slot it names may be mid-move: a cached
            // location counts only while its slot's owner tag still names the block (set when
            // an admission is published, cleared on eviction).
            let cached = location.gpu_slot().filter(|&slot| self.gpu.owner(slot) == location.block().0);
            match (cached, location.home().0) {
                (Some(slot), _) => {
                    debug_assert_eq!(state.blocks.get(&location.block()).and_then(|m| m.gpu_slot), Some(slot));
                    state.replacer.access(slot);
                    counts.gpu_hits += 1;
                }
                (None, Tier::Host) => {
                    counts.gpu_misses += 1;
                    // Refusals for pins or copy errors count as failures where they happen;
                    // waiting for device reads in flight does not.
                    match round.as_deref_mut() {
                        Some(round) => self.admit_batched(state, location.block(), round),
                        None => {
                            let _ = self.admit_locked(state, location.block());
                        }
                    }
                }
                // A device step does not read Disk: nothing was served, nothing to admit.
                (None, _) => {}
            }
        }
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

/// The clusters a device step read in one layer of one context, for
/// [`BufferManager::log_layer_reads`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerReads {
    /// Context id.
    pub context: u64,
    /// Layer index.
    pub layer: u32,
    /// Cluster ids read, per KV head (`per_head[h]` for head `h`).
    pub per_head: Vec<Vec<u32>>,
}

/// A device step's retrieved clusters in one layer of one context as its kernels flagged
/// them, for [`BufferManager::log_flagged_reads`]. A round applies every real miss and, of the
/// real hits, those whose id ≡ `hit_turn` (mod `hit_every`): a step that logs a rotating
/// share of its hits keeps the clusters it keeps retrieving recent without resolving each of
/// them at every step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlaggedReads {
    /// Context id.
    pub context: u64,
    /// Layer index.
    pub layer: u32,
    /// `per_head` words per KV head, head after head: cluster `c` as `c` when the step read it
    /// wholly from the Gpu tier (a hit), as `!c` (that is −c−1) when it read a row of it from
    /// elsewhere (a miss).
    pub flagged: Vec<i32>,
    /// Words per KV head (the last head may be cut short by a short `flagged`).
    pub per_head: usize,
    /// Real clusters per KV head: ids at or past it are padding and skipped (a head with no
    /// entry has none).
    pub real: Vec<u32>,
    /// One in this many hits is applied (0 or 1: every hit).
    pub hit_every: u32,
    /// Which residue of the ids, mod `hit_every`, the applied hits have.
    pub hit_turn: u32,
}

impl FlaggedReads {
    /// The ids a round applies: per KV head, every real miss and the real hits of the sample,
    /// in the order flagged.
    pub fn resolve(&self) -> LayerReads {
        let every = self.hit_every.max(1);
        let turn = self.hit_turn % every;
        let per_head = if self.per_head == 0 {
            Vec::new()
        } else {
            self.flagged
                .chunks(self.per_head)
                .enumerate()
                .map(|(h, words)| {
                    let real = self.real.get(h).copied().unwrap_or(0);
                    words
                        .iter()
                        .filter_map(|&w| {
                            let (c, missed) = if w < 0 { (!w as u32, true) } else { (w as u32, false) };
                            (c < real && (missed || c % every == turn)).then_some(c)
                        })
                        .collect()
                })
                .collect()
        };
        LayerReads { context: self.context, layer: self.layer, per_head }
    }
}

/// One step's reads of one layer as queued: ids, or flagged words resolved by the round.
enum StepReads {
    Ids(LayerReads),
    Flagged(FlaggedReads),
}

impl StepReads {
    fn layer_key(&self) -> (u64, u32) {
        match self {
            StepReads::Ids(r) => (r.context, r.layer),
            StepReads::Flagged(r) => (r.context, r.layer),
        }
    }

    /// Records: ids logged, or every flagged cluster (before the round's sampling).
    fn len(&self) -> usize {
        match self {
            StepReads::Ids(r) => r.per_head.iter().map(Vec::len).sum(),
            StepReads::Flagged(r) => r.flagged.len(),
        }
    }
}

/// A batch of cluster reads in the maintainer's queue.
enum ClusterReads {
    /// Keys as logged ([`BufferManager::log_cluster_reads`]).
    Keys(Vec<ClusterKey>),
    /// Device steps' reads per layer ([`BufferManager::log_layer_reads`],
    /// [`BufferManager::log_flagged_reads`]).
    Layers(Vec<StepReads>),
}

impl ClusterReads {
    /// Clusters read (each counts as one record).
    fn len(&self) -> usize {
        match self {
            ClusterReads::Keys(keys) => keys.len(),
            ClusterReads::Layers(layers) => layers.iter().map(StepReads::len).sum(),
        }
    }

    /// Appends the reads as keys.
    fn append_to(self, out: &mut Vec<ClusterKey>) {
        match self {
            ClusterReads::Keys(keys) => out.extend(keys),
            ClusterReads::Layers(layers) => {
                for reads in layers {
                    let LayerReads { context, layer, per_head } = match reads {
                        StepReads::Ids(r) => r,
                        StepReads::Flagged(r) => r.resolve(),
                    };
                    for (head, ids) in per_head.into_iter().enumerate() {
                        let head = head as u32;
                        out.extend(ids.into_iter().map(|cluster| ClusterKey { context, layer, head, cluster }));
                    }
                }
            }
        }
    }
}

/// Gpu hits and misses of a round's cluster reads, added to the tier counters once per round
/// (a Gpu miss of a device step is a Host hit: it read the Host arena).
#[derive(Default)]
struct ClusterReadCounts {
    gpu_hits: u64,
    gpu_misses: u64,
}

impl ClusterReadCounts {
    fn add_to(&self, buffers: &BufferManager) {
        buffers.count_reads([self.gpu_hits, self.gpu_misses, self.gpu_misses]);
    }
}

/// Whether `ATTNSTORE_BUFFER_TRACE` asks for a line per maintenance round on stderr (records,
/// admissions, time), read once.
fn trace_rounds() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("ATTNSTORE_BUFFER_TRACE").is_some())
}
