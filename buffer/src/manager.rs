//! The buffer manager: blocks with a home (Host arena slot, or Disk slot when spilled), an
//! optional copy in the Gpu tier's cache, the cluster mapping table, and the queue of access
//! records that the maintainer turns into admissions and evictions.
//!
//! Two paths. The *plan path* ([`Reader`]) is lock-free: mapping-table lookup, then a pin on
//! the slot the location names and a check that the slot still holds the block. The *write
//! path* (allocate, write, free, spill, reload, admit, evict) runs under one state mutex taken
//! with a bound; it only ever *tries* a slot's exclusive latch, so a pinned block is never
//! overwritten, moved or evicted: the operation fails with [`Error::Pinned`] or picks another victim.
//!
//! This module holds the configuration, the state and the mechanics every path shares; the
//! paths are its submodules: `blocks` (allocate, write, free, clusters), `moves` (spill,
//! reload, admit, evict), `reader` (the plan path), `device` (device-planned reads and the
//! cluster reads they log), `maintain` and `round` (the maintainer's rounds), `inspect` (stats
//! and checks).

mod blocks;
mod device;
mod inspect;
mod maintain;
mod moves;
mod reader;
mod round;

pub use device::{FlaggedReads, LayerReads};
pub use reader::{PinGuard, Reader};

use crate::arena::{FramePool, SlotWrite, NO_OWNER};
use crate::device_read::Epochs;
use crate::disk::{DiskConfig, DiskTier};
use crate::mapping::{BlockLocation, MappingTable};
use crate::replacer::{ReplacerKind, SanityReplacer};
use crate::slot_table::SlotTable;
use crate::stats::TierCounters;
use crate::{BlockId, BlockKey, BlockLayout, ClusterKey, Error, MemoryBudget, Replacer, Reservation, Result, Tier};
use crossbeam_queue::ArrayQueue;
use device::ClusterReads;
use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
    /// Admissions a batched round makes at most ([`ROUND_ADMISSIONS`]; tests lower it).
    round_admissions: usize,
    queued_records: AtomicU64,
    dropped: AtomicU64,
    /// Cluster reads of device steps superseded by a newer step of the same layer.
    superseded: AtomicU64,
    counters: [TierCounters; 3],
}

/// Admissions one batched maintenance round makes at most (32 MiB of 2 KiB blocks): a round
/// holds the state lock from its first admission to its device writes' end, and writers
/// (appends, stores) wait for that lock for at most [`BufferConfig::lock_timeout`]. With 39
/// contexts of 2-bit rows stepping at once, an unbounded round after their decode segments
/// (every new block a miss) held it past the 1 s bound and an append failed. Misses past the
/// bound are not admitted this round; the steps that keep reading them log them again.
pub const ROUND_ADMISSIONS: usize = 16_384;

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
            round_admissions: ROUND_ADMISSIONS,
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

    /// Lowers the admissions a batched round makes at most (tests).
    #[cfg(test)]
    pub(crate) fn set_round_admissions(&mut self, n: usize) {
        self.round_admissions = n;
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
        &self.counters[tier.index()]
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
                self.counters(Tier::Gpu).failed(Tier::Gpu, "slot_table");
            }
        }
    }

    /// Clears the slot-table entry of the block homed at `home` (its Gpu copy goes, or it
    /// leaves the Host slot): before the Gpu slot can be overwritten.
    fn unpublish(&self, home: Home) {
        if let Home::Host(host_slot) = home {
            if self.slot_table.clear(host_slot).is_err() {
                self.counters(Tier::Gpu).failed(Tier::Gpu, "slot_table");
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
}
