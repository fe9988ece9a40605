//! Frames: a pool of block slots in one arena of host memory, each slot with a latch (an
//! atomic pin count, or "exclusive" while a writer fills it) and an owner tag (the id of the
//! block it holds). The Host tier and the Gpu tier's host side are both a `FramePool`; with a
//! GPU the Gpu tier's pool also has a device mirror its slots are copied to (`crate::cuda`).
//!
//! Readers pin a slot and then check its owner, so a reader holding a stale location either
//! finds its block or learns it moved; writers only ever *try* the exclusive latch, so a
//! pinned slot is never overwritten and nobody waits on a latch.

#![allow(unsafe_code)] // raw slot memory behind the latch protocol; every block says why it is sound

use crate::{Error, Result, Tier};
use memmap2::MmapMut;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Latch value of a slot held exclusively by a writer.
const EXCLUSIVE: u32 = u32::MAX;

/// Owner tag of an empty slot (block ids start at 1).
pub(crate) const NO_OWNER: u64 = 0;

struct Frame {
    /// Pin count, or `EXCLUSIVE`.
    latch: AtomicU32,
    /// Id of the block held, `NO_OWNER` when empty. Written only under the exclusive latch.
    owner: AtomicU64,
}

/// The arena's memory: anonymous memory, or (feature `cuda`, a GPU present; the Host tier, and
/// the Gpu tier's host side when it has a device mirror) pinned host memory mapped into the
/// device's address space, so GPU kernels read Host blocks in place (zero-copy) and copies to
/// the device run asynchronously at full PCIe speed.
enum HostMemory {
    Anonymous(#[expect(dead_code, reason = "held only to keep the mapping alive")] MmapMut),
    #[cfg(feature = "cuda")]
    Pinned(crate::cuda::Pinned),
}

/// What backs a [`FramePool`]'s arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostMemoryKind {
    /// Anonymous `mmap` memory (no GPU, or the `cuda` feature is off).
    Anonymous,
    /// Pinned host memory from `cuMemHostAlloc(DEVICEMAP | PORTABLE)`; the device sees the
    /// arena at the given base address.
    Pinned {
        /// Device address of the arena's first byte (slot `s` is at `base + s × block_bytes`).
        device_base: u64,
    },
}

impl HostMemory {
    /// `pinned`: try pinned memory first (feature `cuda`); a failure is said once per tier.
    fn allocate(tier: Tier, bytes: usize, pinned: bool) -> Result<(Self, *mut u8)> {
        #[cfg(feature = "cuda")]
        if pinned {
            match crate::cuda::Pinned::allocate(bytes.max(1)) {
                Ok(mut p) => {
                    let base = p.host_ptr();
                    return Ok((HostMemory::Pinned(p), base));
                }
                Err(why) => {
                    static HOST: std::sync::Once = std::sync::Once::new();
                    static GPU: std::sync::Once = std::sync::Once::new();
                    let once = if tier == Tier::Host { &HOST } else { &GPU };
                    once.call_once(|| {
                        eprintln!("attnstore-buffer: no pinned host memory for the {tier} tier ({why}); using mmap")
                    });
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (tier, pinned);
        // An mmap failure is the kernel refusing memory: a typed error, never an abort.
        let mut map = MmapMut::map_anon(bytes.max(1)).map_err(|_| Error::OutOfMemory {
            tier: Tier::Host,
            requested_bytes: bytes,
            available_bytes: 0,
            limit_bytes: bytes,
        })?;
        // Transparent huge pages where the kernel grants them on request (`madvise`, the
        // common setting): every block written into the arena for the first time faults its
        // page in, and at 4 KiB a 128K-token layer's rows are 131,072 faults. Only advice: a
        // kernel that refuses it leaves 4 KiB pages.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        let base = map.as_mut_ptr();
        Ok((HostMemory::Anonymous(map), base))
    }

    fn kind(&self) -> HostMemoryKind {
        match self {
            HostMemory::Anonymous(_) => HostMemoryKind::Anonymous,
            #[cfg(feature = "cuda")]
            HostMemory::Pinned(p) => HostMemoryKind::Pinned { device_base: p.device_base() },
        }
    }
}

/// A fixed number of block slots in one arena, with latches and a free list.
pub(crate) struct FramePool {
    block_bytes: usize,
    /// The Gpu tier on a machine with a GPU: every slot mirrored in device memory.
    #[cfg(feature = "cuda")]
    device: Option<crate::cuda::Device>,
    /// Keeps the mapping alive; never touched after `base` was taken from it.
    _memory: HostMemory,
    base: *mut u8,
    frames: Box<[Frame]>,
    free: Mutex<Vec<u32>>,
}

// SAFETY: the raw `base` pointer is owned by `_memory` for the pool's life; slot bytes are only
// reached through `SlotRead`/`SlotWrite`, whose latch protocol rules out a write racing any other
// access to the same slot. Everything else in the pool is atomics or locks.
unsafe impl Send for FramePool {}
// SAFETY: as for `Send`: shared access to slot memory is mediated by the per-slot latches.
unsafe impl Sync for FramePool {}

/// Why a pin failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PinFailure {
    /// A writer holds the slot exclusively right now.
    Busy,
    /// The slot holds another block (or none).
    Moved,
}

impl FramePool {
    /// A pool of `slots` slots of `block_bytes` each, all free. `want_pinned` (feature `cuda`,
    /// a GPU answering): a Host arena in pinned, device-mapped memory; a Gpu pool with a device
    /// mirror, and its host side in pinned memory (the source of asynchronous copies).
    pub(crate) fn new(tier: Tier, slots: usize, block_bytes: usize, want_pinned: bool) -> Result<Self> {
        let slots_u32 = u32::try_from(slots).map_err(|_| Error::BadConfig {
            what: "slots",
            expected: "< 2^32",
            got: slots as u64,
        })?;
        let bytes = slots.checked_mul(block_bytes).ok_or(Error::OutOfMemory {
            tier,
            requested_bytes: usize::MAX,
            available_bytes: 0,
            limit_bytes: 0,
        })?;
        #[cfg(feature = "cuda")]
        let device = match (want_pinned && tier == Tier::Gpu && bytes > 0).then(|| crate::cuda::Device::allocate(bytes))
        {
            Some(Ok(d)) => Some(d),
            Some(Err(why)) => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| eprintln!("attnstore-buffer: Gpu tier in host memory only ({why})"));
                None
            }
            None => None,
        };
        #[cfg(feature = "cuda")]
        let pinned = want_pinned && (tier == Tier::Host || device.is_some());
        #[cfg(not(feature = "cuda"))]
        let pinned = want_pinned && tier == Tier::Host;
        let (memory, base) = HostMemory::allocate(tier, bytes, pinned)?;
        let frames = (0..slots).map(|_| Frame { latch: AtomicU32::new(0), owner: AtomicU64::new(NO_OWNER) }).collect();
        // Lowest slot first out: pop() from the end of a reversed list.
        let free = Mutex::new((0..slots_u32).rev().collect());
        Ok(Self {
            block_bytes,
            #[cfg(feature = "cuda")]
            device,
            _memory: memory,
            base,
            frames,
            free,
        })
    }

    /// Device address of slot 0 when the pool is mirrored in device memory (the Gpu tier on a
    /// machine with a GPU): slot `s` is at `base + s × block_bytes`.
    pub(crate) fn device_base(&self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        if let Some(d) = &self.device {
            return Some(d.base());
        }
        None
    }

    /// A device array of `entries` `i32`s (all -1) beside the pool's device mirror, written on
    /// the same stream; `None` when the pool has no device mirror.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_table(&self, entries: usize) -> Option<std::result::Result<crate::cuda::Table, String>> {
        self.device.as_ref().map(|d| d.table(entries))
    }

    /// What backs the arena.
    pub(crate) fn memory_kind(&self) -> HostMemoryKind {
        self._memory.kind()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.frames.len()
    }

    pub(crate) fn free_slots(&self) -> usize {
        self.free.lock().len()
    }

    /// Takes a free slot, or `None` when all are in use.
    pub(crate) fn alloc_slot(&self) -> Option<u32> {
        self.free.lock().pop()
    }

    /// Returns a slot to the free list. The caller has cleared its owner under the latch.
    pub(crate) fn release_slot(&self, slot: u32) {
        debug_assert_eq!(self.owner(slot), NO_OWNER, "a released slot is empty");
        self.free.lock().push(slot);
    }

    /// The block id held by `slot` now (a hint unless the caller holds a latch).
    pub(crate) fn owner(&self, slot: u32) -> u64 {
        // Relaxed: under a latch the latch's acquire orders it; without one it is only a hint.
        self.frames[slot as usize].owner.load(Ordering::Relaxed)
    }

    /// Pins held on `slot` now (`u32::MAX`: exclusively latched).
    #[cfg(test)]
    pub(crate) fn pins(&self, slot: u32) -> u32 {
        self.frames[slot as usize].latch.load(Ordering::Relaxed)
    }

    /// Pins `slot` for reading if it holds block `owner`.
    pub(crate) fn pin(&self, slot: u32, owner: u64) -> Result<SlotRead<'_>, PinFailure> {
        let frame = self.frames.get(slot as usize).ok_or(PinFailure::Moved)?;
        // Acquire on success pairs with the Release of `unlock`, so the owner tag and the bytes
        // a writer stored under the exclusive latch are visible to this reader.
        frame
            .latch
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |pins| (pins < EXCLUSIVE - 1).then(|| pins + 1))
            .map_err(|_| PinFailure::Busy)?;
        let read = SlotRead { pool: self, slot };
        if frame.owner.load(Ordering::Relaxed) != owner {
            return Err(PinFailure::Moved); // `read` drops and unpins
        }
        Ok(read)
    }

    /// Latches `slot` exclusively, or returns the pins that prevent it.
    pub(crate) fn lock(&self, slot: u32) -> Result<SlotWrite<'_>, u32> {
        let frame = &self.frames[slot as usize];
        // Acquire pairs with the readers' Release unpin: their reads happen before our writes.
        match frame.latch.compare_exchange(0, EXCLUSIVE, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => Ok(SlotWrite { pool: self, slot }),
            Err(pins) => Err(if pins == EXCLUSIVE { 0 } else { pins }),
        }
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        // wrapping_add: pointer arithmetic without dereference; in bounds since slot < capacity.
        self.base.wrapping_add(slot as usize * self.block_bytes)
    }

    /// One batch of device writes: enqueues the copy of every slot in `latched` to the device
    /// mirror on the pool's stream without waiting (neighbouring slots as one copy), then runs
    /// `then` (which may enqueue more writes on the same stream, ordered after these copies:
    /// the slot table's entries), then waits for all of it once. The caller holds the latches
    /// through the call, so no slot changes before its copy ran. Without a device mirror it
    /// only runs `then`. An error (a failed enqueue, or the wait) leaves the device copies of
    /// the batch's slots unknown; `then` runs only if every copy was enqueued, and the wait
    /// happens in every case.
    pub(crate) fn mirror_batch(
        &self,
        latched: &[&SlotWrite<'_>],
        then: impl FnOnce(&DeviceBatch),
    ) -> std::result::Result<(), String> {
        let batch = DeviceBatch { _private: () };
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.device {
            let mut slots: Vec<u32> = latched
                .iter()
                .map(|w| {
                    assert!(std::ptr::eq(w.pool, self), "mirror_batch: a latch of another pool");
                    w.slot
                })
                .collect();
            slots.sort_unstable();
            // Waits on every exit, unwinding included: no copy outlives the latches.
            let wait = WaitOnDrop { device, waited: false };
            let mut runs = Vec::new();
            let mut i = 0;
            while i < slots.len() {
                let first = slots[i];
                let mut n = 1;
                while i + n < slots.len() && slots[i + n] == first + n as u32 {
                    n += 1;
                }
                runs.push((first as usize * self.block_bytes, self.slot_ptr(first).cast_const(), n * self.block_bytes));
                i += n;
            }
            // SAFETY: each run's slots are exclusively latched by guards the caller holds until
            // this call returns (latches are exclusive, so the sorted slots are distinct), and
            // `wait` synchronizes the stream before that: no CPU write reaches these bytes before
            // the copies ran, and the arena outlives them. In bounds: every slot < capacity.
            let enqueued = unsafe { device.enqueue_copies(&runs) };
            if enqueued.is_ok() {
                then(&batch);
            }
            return enqueued.and(wait.wait());
        }
        let _ = latched;
        then(&batch);
        Ok(())
    }
}

/// Proof, for writes to the pool's stream enqueued without waiting (the slot table's entries),
/// that they are waited for before the batch's call returns: only [`FramePool::mirror_batch`]
/// makes one, and it synchronizes the stream after its closure.
pub(crate) struct DeviceBatch {
    _private: (),
}

/// Synchronizes the pool's stream when dropped, unless waited for already.
#[cfg(feature = "cuda")]
struct WaitOnDrop<'d> {
    device: &'d crate::cuda::Device,
    waited: bool,
}

#[cfg(feature = "cuda")]
impl WaitOnDrop<'_> {
    fn wait(mut self) -> std::result::Result<(), String> {
        self.waited = true;
        self.device.synchronize()
    }
}

#[cfg(feature = "cuda")]
impl Drop for WaitOnDrop<'_> {
    fn drop(&mut self) {
        if !self.waited {
            let _ = self.device.synchronize();
        }
    }
}

/// A pinned slot: shared read access to its bytes until dropped.
pub(crate) struct SlotRead<'a> {
    pool: &'a FramePool,
    slot: u32,
}

impl SlotRead<'_> {
    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `slot < capacity` (checked when pinned), so the range lies inside the live
        // mapping; the pin (latch > 0) keeps every writer out, as writers need latch == 0 to
        // take `EXCLUSIVE`, so no `&mut` to these bytes exists while this `&[u8]` lives.
        unsafe { std::slice::from_raw_parts(self.pool.slot_ptr(self.slot), self.pool.block_bytes) }
    }
}

impl Drop for SlotRead<'_> {
    fn drop(&mut self) {
        // Release: our reads of the bytes happen before a later writer's exclusive latch.
        self.pool.frames[self.slot as usize].latch.fetch_sub(1, Ordering::Release);
    }
}

/// An exclusively latched slot: write access to its bytes and owner tag until dropped.
pub(crate) struct SlotWrite<'a> {
    pool: &'a FramePool,
    slot: u32,
}

impl SlotWrite<'_> {
    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }

    pub(crate) fn owner(&self) -> u64 {
        self.pool.frames[self.slot as usize].owner.load(Ordering::Relaxed)
    }

    /// Tags the slot with its new owner (readers see it once the latch is released).
    pub(crate) fn set_owner(&mut self, owner: u64) {
        self.pool.frames[self.slot as usize].owner.store(owner, Ordering::Relaxed);
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: in bounds as in `SlotRead::bytes`; the exclusive latch means no reader or other
        // writer can reach this slot, and `&self` rules out a `&mut` from this guard meanwhile.
        unsafe { std::slice::from_raw_parts(self.pool.slot_ptr(self.slot), self.pool.block_bytes) }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: in bounds as above; the exclusive latch makes this guard the only access to the
        // slot, and `&mut self` makes the returned slice the only reference through the guard.
        unsafe { std::slice::from_raw_parts_mut(self.pool.slot_ptr(self.slot), self.pool.block_bytes) }
    }

    /// Copies the slot's bytes to its device mirror, if the pool has one (before the latch
    /// is released, so no reader of either copy sees a half-written slot).
    pub(crate) fn mirror(&self) -> std::result::Result<(), String> {
        #[cfg(feature = "cuda")]
        if let Some(d) = &self.pool.device {
            return d.copy_in(self.slot as usize * self.pool.block_bytes, self.bytes());
        }
        Ok(())
    }
}

impl Drop for SlotWrite<'_> {
    fn drop(&mut self) {
        // Release: the bytes and owner written under the latch are visible to the next pinner.
        self.pool.frames[self.slot as usize].latch.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `THPeligible` line of `/proc/self/smaps` for the mapping holding `addr`.
    #[cfg(target_os = "linux")]
    fn thp_eligible(addr: usize) -> Option<bool> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            // A mapping's first line starts with its address range, `lo-hi` in hex.
            let range = line.split_whitespace().next().and_then(|r| r.split_once('-'));
            if let Some((Ok(lo), Ok(hi))) =
                range.map(|(lo, hi)| (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)))
            {
                inside = (lo..hi).contains(&addr);
                continue;
            }
            if inside {
                if let Some(v) = line.strip_prefix("THPeligible:") {
                    return Some(v.trim() == "1");
                }
            }
        }
        None
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn an_anonymous_arena_asks_for_huge_pages() {
        let setting = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if !setting.contains("[madvise]") {
            eprintln!("skipped: transparent huge pages are {:?} here, not granted on request", setting.trim());
            return;
        }
        let pool = FramePool::new(Tier::Host, 4096, 2048, false).unwrap(); // 8 MiB
        assert_eq!(pool.memory_kind(), HostMemoryKind::Anonymous);
        assert_eq!(thp_eligible(pool.base as usize), Some(true), "the arena's mapping is not THP-eligible");
        // The advice is what makes it eligible: a plain mapping of the same size is not.
        let plain = MmapMut::map_anon(8 << 20).unwrap();
        assert_eq!(thp_eligible(plain.as_ptr() as usize), Some(false));
    }

    #[test]
    fn a_pinned_slot_cannot_be_latched_and_a_latched_slot_cannot_be_pinned() {
        let pool = FramePool::new(Tier::Host, 4, 64, false).unwrap();
        let slot = pool.alloc_slot().unwrap();
        {
            let mut w = pool.lock(slot).unwrap();
            w.bytes_mut().fill(7);
            w.set_owner(42);
            assert_eq!(pool.pin(slot, 42).err(), Some(PinFailure::Busy));
        }
        let r = pool.pin(slot, 42).unwrap();
        assert!(r.bytes().iter().all(|&b| b == 7));
        assert_eq!(pool.lock(slot).err(), Some(1));
        assert_eq!(pool.pin(slot, 43).err(), Some(PinFailure::Moved));
        drop(r);
        assert_eq!(pool.pins(slot), 0);
        assert!(pool.lock(slot).is_ok());
        assert_eq!(pool.free_slots(), 3);
    }
}
