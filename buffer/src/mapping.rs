//! The cluster mapping table: (context, layer, head, cluster) → the cluster's blocks, each
//! with where it can be read now (Gpu slot if cached, and its home: Host slot or Disk slot).
//!
//! Reads are lock-free: a reader pins a `crossbeam-epoch` guard, loads a bucket pointer and
//! scans the bucket. Writers (under one `parking_lot` mutex) never restructure a published
//! bucket: they build a new one, swap the pointer and defer freeing the old one until every
//! reader that could see it has unpinned — so a reader never sees a half-written entry.
//!
//! The one exception is a block's Gpu slot, the field that admissions and evictions change
//! all the time: it is an atomic word in the published entry, stored in place. An admission
//! or eviction therefore writes one word — no bucket copy, no allocation, no garbage for the
//! plan threads' epoch pins — and a reader sees either the old slot or the new one. (Either
//! may be stale by the time it pins: pins check the slot's owner, see `Reader::pin`.)

#![allow(unsafe_code)] // epoch-protected pointers; each dereference says why it is sound

use crate::{BlockId, ClusterKey, Tier};
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned, Shared};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

const NO_SLOT: u32 = u32::MAX;

/// Where one block of a cluster can be read, as of the lookup that returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLocation {
    block: BlockId,
    gpu_slot: u32,
    home_tier: Tier,
    home_slot: u32,
}

impl BlockLocation {
    pub(crate) fn new(block: BlockId, home_tier: Tier, home_slot: u32) -> Self {
        Self { block, gpu_slot: NO_SLOT, home_tier, home_slot }
    }

    /// The block.
    pub fn block(&self) -> BlockId {
        self.block
    }

    /// The fastest tier holding the block: `Gpu` when cached, else its home (`Host` or `Disk`).
    /// This is the source tier a plan records at lookup time.
    pub fn tier(&self) -> Tier {
        if self.gpu_slot != NO_SLOT {
            Tier::Gpu
        } else {
            self.home_tier
        }
    }

    /// The Gpu slot, when cached.
    pub fn gpu_slot(&self) -> Option<u32> {
        (self.gpu_slot != NO_SLOT).then_some(self.gpu_slot)
    }

    /// The home tier (`Host` or `Disk`) and slot.
    pub fn home(&self) -> (Tier, u32) {
        (self.home_tier, self.home_slot)
    }

    pub(crate) fn with_gpu_slot(mut self, slot: Option<u32>) -> Self {
        self.gpu_slot = slot.unwrap_or(NO_SLOT);
        self
    }
}

/// A block location as published in the table: the Gpu slot is an atomic word that
/// admissions and evictions store in place; the rest changes only copy-on-write.
struct Stored {
    block: BlockId,
    gpu_slot: AtomicU32,
    home_tier: Tier,
    home_slot: u32,
}

impl Stored {
    fn new(l: &BlockLocation) -> Self {
        Self { block: l.block, gpu_slot: AtomicU32::new(l.gpu_slot), home_tier: l.home_tier, home_slot: l.home_slot }
    }

    #[inline]
    fn load(&self) -> BlockLocation {
        // Acquire pairs with the Release store in `update_block`; a reader still checks the slot's
        // owner when it pins, so a slot that changed since is never served for this block.
        let gpu_slot = self.gpu_slot.load(Ordering::Acquire);
        BlockLocation { block: self.block, gpu_slot, home_tier: self.home_tier, home_slot: self.home_slot }
    }
}

impl Clone for Stored {
    fn clone(&self) -> Self {
        Self::new(&self.load())
    }
}

/// The blocks of one cluster as a lookup found them: each [`BlockLocation`] is read when it
/// is asked for, so a block admitted to (or evicted from) the Gpu tier after the lookup shows
/// its new slot. Valid while the [`MappingReader`] that returned it lives.
#[derive(Clone, Copy)]
pub struct Locations<'r>(&'r [Stored]);

impl<'r> Locations<'r> {
    /// Number of blocks.
    #[inline]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the cluster has no blocks.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Block `i`'s location as of now.
    #[inline]
    pub fn get(&self, i: usize) -> Option<BlockLocation> {
        self.0.get(i).map(Stored::load)
    }

    /// The first block's location as of now.
    #[inline]
    pub fn first(&self) -> Option<BlockLocation> {
        self.get(0)
    }

    /// Every block's location as of now, in order.
    #[inline]
    pub fn iter(&self) -> LocationsIter<'r> {
        LocationsIter(self.0.iter())
    }

    /// The locations copied out.
    pub fn to_vec(&self) -> Vec<BlockLocation> {
        self.iter().collect()
    }
}

impl<'r> IntoIterator for Locations<'r> {
    type Item = BlockLocation;
    type IntoIter = LocationsIter<'r>;

    fn into_iter(self) -> LocationsIter<'r> {
        self.iter()
    }
}

/// The iterator of [`Locations`]: each block's location, read as it is reached.
#[derive(Clone)]
pub struct LocationsIter<'r>(std::slice::Iter<'r, Stored>);

impl Iterator for LocationsIter<'_> {
    type Item = BlockLocation;

    #[inline]
    fn next(&mut self) -> Option<BlockLocation> {
        self.0.next().map(Stored::load)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl ExactSizeIterator for LocationsIter<'_> {}

impl std::fmt::Debug for Locations<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq for Locations<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

/// Block lists up to this long live inside the entry: one cache miss fewer per lookup.
const INLINE_BLOCKS: usize = 4;

#[derive(Clone)]
struct Entry {
    key: ClusterKey,
    len: u32,
    inline: [Stored; INLINE_BLOCKS],
    heap: Box<[Stored]>,
}

impl Entry {
    fn new(key: ClusterKey, blocks: &[BlockLocation]) -> Self {
        let unused = BlockLocation::new(BlockId(0), Tier::Host, 0);
        let len = blocks.len() as u32;
        if blocks.len() <= INLINE_BLOCKS {
            let inline = std::array::from_fn(|i| Stored::new(blocks.get(i).unwrap_or(&unused)));
            Self { key, len, inline, heap: Box::new([]) }
        } else {
            let inline = std::array::from_fn(|_| Stored::new(&unused));
            Self { key, len, inline, heap: blocks.iter().map(Stored::new).collect() }
        }
    }

    #[inline]
    fn blocks(&self) -> &[Stored] {
        if self.len as usize <= INLINE_BLOCKS {
            &self.inline[..self.len as usize]
        } else {
            &self.heap
        }
    }
}

/// A bucket once published: immutable but for its entries' Gpu slots (see the module docs).
/// The first entry is stored in the bucket itself (with a load factor of at most 1 most
/// buckets hold one entry): bucket pointer, then the entry.
struct Bucket {
    first: Entry,
    rest: Vec<Entry>,
}

impl Bucket {
    fn from_entries(mut entries: Vec<Entry>) -> Option<Self> {
        if entries.is_empty() {
            return None;
        }
        let first = entries.swap_remove(0);
        Some(Self { first, rest: entries })
    }

    #[inline]
    fn find(&self, key: &ClusterKey) -> Option<&[Stored]> {
        if self.first.key == *key {
            return Some(self.first.blocks());
        }
        self.rest.iter().find(|e| e.key == *key).map(Entry::blocks)
    }

    fn entries(&self) -> impl Iterator<Item = &Entry> {
        std::iter::once(&self.first).chain(&self.rest)
    }
}

struct Table {
    buckets: Box<[Atomic<Bucket>]>,
    mask: usize,
}

impl Table {
    fn with_buckets(n: usize) -> Self {
        debug_assert!(n.is_power_of_two());
        Self { buckets: (0..n).map(|_| Atomic::null()).collect(), mask: n - 1 }
    }

    fn bucket_of(&self, key: &ClusterKey) -> &Atomic<Bucket> {
        &self.buckets[hash(key) as usize & self.mask]
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        for bucket in self.buckets.iter() {
            // SAFETY: a table is dropped either by `MappingTable::drop` (`&mut self`: no reader) or
            // by an epoch's deferred destruction after every reader that could see it unpinned;
            // its buckets were never shared with another table (a resize deep-copies them).
            unsafe {
                let shared = bucket.load(Ordering::Relaxed, epoch::unprotected());
                if !shared.is_null() {
                    drop(shared.into_owned());
                }
            }
        }
    }
}

fn hash(key: &ClusterKey) -> u64 {
    // Cheap multiplicative mixing: keys are dense small integers, so a strong hash buys nothing.
    let a = key.context.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let b = (u64::from(key.layer) << 32 | u64::from(key.head)).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    let c = u64::from(key.cluster).wrapping_mul(0x1656_67B1_9E37_79F9);
    let x = a ^ b.rotate_left(23) ^ c.rotate_left(41);
    x ^ (x >> 29)
}

/// The cluster mapping table (see the module docs).
pub struct MappingTable {
    table: Atomic<Table>,
    writer: Mutex<()>,
    len: AtomicUsize,
}

impl Default for MappingTable {
    fn default() -> Self {
        Self::new()
    }
}

impl MappingTable {
    /// An empty table.
    pub fn new() -> Self {
        Self { table: Atomic::new(Table::with_buckets(64)), writer: Mutex::new(()), len: AtomicUsize::new(0) }
    }

    /// Number of clusters mapped.
    pub fn len(&self) -> usize {
        // Relaxed: a statistic.
        self.len.load(Ordering::Relaxed)
    }

    /// Whether no cluster is mapped.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Frees retired buckets whose readers are gone, on the calling thread (the maintainer's),
    /// so the plan threads' epoch pins find little garbage to collect. A pin collects at most
    /// a few sealed bags of garbage (crossbeam-epoch: 8 × 64 objects), and every 128th pin of
    /// a plan thread would run what is left inline, a latency spike of tens of µs right at
    /// the p99 of plan latency. So this collects in several rounds: up to 8 × 8 × 64 objects
    /// that no reader can see any more (garbage retired moments ago waits for the next call).
    pub(crate) fn collect_garbage(&self) {
        const ROUNDS: usize = 8;
        for _ in 0..ROUNDS {
            epoch::pin().flush();
        }
    }

    /// A reader for a batch of lookups (one epoch pin for all of them).
    pub fn reader(&self) -> MappingReader<'_> {
        MappingReader { table: self, guard: epoch::pin() }
    }

    /// The blocks of `key` as of now, copied out (for callers that do not batch).
    pub fn get(&self, key: &ClusterKey) -> Option<Vec<BlockLocation>> {
        self.reader().get(key).map(|l| l.to_vec())
    }

    fn lookup<'g>(&self, key: &ClusterKey, guard: &'g Guard) -> Option<&'g [Stored]> {
        // Acquire pairs with the writers' Release stores: the table and bucket contents are
        // fully written before their pointers are published.
        let table = self.table.load(Ordering::Acquire, guard);
        // SAFETY: the table pointer is never null (set in `new`, replaced only by a non-null one)
        // and a replaced table is destroyed only after `guard` (pinned now) is released.
        let table = unsafe { table.deref() };
        let bucket = table.bucket_of(key).load(Ordering::Acquire, guard);
        // SAFETY: a non-null bucket stays allocated while `guard` is pinned: writers retire
        // buckets with `defer_destroy`, and tables destroy theirs only after the epoch passes.
        let bucket = unsafe { bucket.as_ref() }?;
        bucket.find(key)
    }

    fn lookup_many<'g>(&self, keys: &[ClusterKey], guard: &'g Guard, out: &mut Vec<Option<Locations<'g>>>) {
        const CHUNK: usize = 16;
        let table = self.table.load(Ordering::Acquire, guard);
        // SAFETY: as in `lookup`.
        let table = unsafe { table.deref() };
        for chunk in keys.chunks(CHUNK) {
            // Two phases, so the cache misses of different keys overlap instead of queueing
            // behind each other: first every bucket pointer, then every bucket.
            let mut buckets = [Shared::<Bucket>::null(); CHUNK];
            for (bucket, key) in buckets.iter_mut().zip(chunk) {
                *bucket = table.bucket_of(key).load(Ordering::Acquire, guard);
            }
            for (bucket, key) in buckets.iter().zip(chunk) {
                // SAFETY: as in `lookup`.
                out.push(unsafe { bucket.as_ref() }.and_then(|b| b.find(key)).map(Locations));
            }
        }
    }

    /// Sets (or replaces) the blocks of `key`.
    pub fn insert(&self, key: ClusterKey, blocks: Vec<BlockLocation>) {
        self.modify(&key, |_| Some(blocks));
    }

    /// Removes `key`; returns whether it was mapped.
    pub fn remove(&self, key: &ClusterKey) -> bool {
        let mut found = false;
        self.modify(key, |old| {
            found = old.is_some();
            None
        });
        found
    }

    /// Rewrites the location of block `index` of `key`, if present and still `block`. A
    /// change of the Gpu slot alone is stored in place (one atomic word); any other change
    /// publishes a new bucket.
    pub(crate) fn update_block(
        &self,
        key: &ClusterKey,
        index: usize,
        block: BlockId,
        f: impl FnOnce(BlockLocation) -> BlockLocation,
    ) -> bool {
        let writer = self.writer.lock();
        let guard = epoch::pin();
        let Some(stored) = self.lookup(key, &guard).and_then(|b| b.get(index)).filter(|s| s.block == block) else {
            return false;
        };
        let old = stored.load();
        let new = f(old);
        if (new.block, new.home_tier, new.home_slot) == (old.block, old.home_tier, old.home_slot) {
            // Release: whatever the writer published before (the slot's bytes and owner) is
            // visible to a reader that loads this slot. Under the writer lock, so a concurrent
            // copy-on-write of the bucket cannot copy the old value after this store.
            stored.gpu_slot.store(new.gpu_slot, Ordering::Release);
        } else {
            self.modify_locked(key, &guard, |old| {
                let mut blocks = old?.to_vec();
                blocks[index] = new;
                Some(blocks)
            });
        }
        drop(writer);
        true
    }

    /// Copy-on-write update of one key: `f` sees the current blocks and returns the new ones
    /// (`None`: remove the key).
    fn modify(&self, key: &ClusterKey, f: impl FnOnce(Option<Locations<'_>>) -> Option<Vec<BlockLocation>>) {
        let _writer = self.writer.lock();
        self.modify_locked(key, &epoch::pin(), f);
    }

    /// [`Self::modify`] with the writer lock held by the caller.
    fn modify_locked(
        &self,
        key: &ClusterKey,
        guard: &Guard,
        f: impl FnOnce(Option<Locations<'_>>) -> Option<Vec<BlockLocation>>,
    ) {
        let table_ptr = self.table.load(Ordering::Acquire, guard);
        // SAFETY: as in `lookup`; moreover only writers (we hold their lock) replace tables.
        let table = unsafe { table_ptr.deref() };
        let slot = table.bucket_of(key);
        let old = slot.load(Ordering::Acquire, guard);
        // SAFETY: as in `lookup`.
        let old_entries: Vec<&Entry> = unsafe { old.as_ref() }.map_or(Vec::new(), |b| b.entries().collect());
        let position = old_entries.iter().position(|e| e.key == *key);
        let new_blocks = f(position.map(|i| Locations(old_entries[i].blocks())));
        let mut entries: Vec<Entry> = old_entries.iter().filter(|e| e.key != *key).map(|e| (*e).clone()).collect();
        let delta: isize = match (position.is_some(), new_blocks.is_some()) {
            (false, true) => 1,
            (true, false) => -1,
            _ => 0,
        };
        if let Some(blocks) = new_blocks {
            entries.push(Entry::new(*key, &blocks));
        }
        let new = Bucket::from_entries(entries).map_or(Shared::null(), |b| Owned::new(b).into_shared(guard));
        // Release: the new bucket's contents are visible to readers that load its pointer.
        slot.store(new, Ordering::Release);
        if !old.is_null() {
            // SAFETY: `old` is unreachable from the table now; readers that loaded it hold guards,
            // and destruction waits for them.
            unsafe { guard.defer_destroy(old) };
        }
        let len = self.len.load(Ordering::Relaxed).wrapping_add_signed(delta);
        self.len.store(len, Ordering::Relaxed);
        if len > table.buckets.len() {
            self.grow(table, table_ptr, guard);
        }
    }

    /// Doubles the bucket count (writer lock held): deep-copies every entry into a new table.
    fn grow(&self, table: &Table, table_ptr: Shared<'_, Table>, guard: &Guard) {
        let new = Table::with_buckets(table.buckets.len() * 2);
        let mut fresh: Vec<Vec<Entry>> = (0..new.buckets.len()).map(|_| Vec::new()).collect();
        for bucket in table.buckets.iter() {
            // SAFETY: as in `lookup`.
            if let Some(b) = unsafe { bucket.load(Ordering::Acquire, guard).as_ref() } {
                for entry in b.entries() {
                    fresh[hash(&entry.key) as usize & new.mask].push(entry.clone());
                }
            }
        }
        for (slot, entries) in new.buckets.iter().zip(fresh) {
            if let Some(bucket) = Bucket::from_entries(entries) {
                slot.store(Owned::new(bucket), Ordering::Relaxed);
            }
        }
        // Release: the new table and its buckets are complete before readers can load it.
        self.table.store(Owned::new(new), Ordering::Release);
        // SAFETY: the old table is unreachable now; its Drop frees its own buckets once every
        // reader pinned before this store has unpinned.
        unsafe { guard.defer_destroy(table_ptr) };
    }
}

impl Drop for MappingTable {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no reader or writer is left; the pointer is the live table.
        unsafe {
            drop(self.table.load(Ordering::Relaxed, epoch::unprotected()).into_owned());
        }
    }
}

/// A batch of lock-free lookups under one epoch pin. Holds back memory reclamation while it
/// lives: keep it for one plan, not longer.
pub struct MappingReader<'a> {
    table: &'a MappingTable,
    guard: Guard,
}

impl MappingReader<'_> {
    /// The blocks of `key`, or `None` when the cluster is not mapped.
    #[inline]
    pub fn get(&self, key: &ClusterKey) -> Option<Locations<'_>> {
        self.table.lookup(key, &self.guard).map(Locations)
    }

    /// Looks up a batch of clusters (a plan's retrieval set): appends to `out` one entry per
    /// key, in order. Faster than `get` per key: the cache misses of the keys overlap.
    pub fn get_many<'r>(&'r self, keys: &[ClusterKey], out: &mut Vec<Option<Locations<'r>>>) {
        self.table.lookup_many(keys, &self.guard, out);
    }
}

#[cfg(test)]
mod tests;
