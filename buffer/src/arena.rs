//! Frames: a pool of block slots in one arena of host memory, each slot with a latch (an
//! atomic pin count, or "exclusive" while a writer fills it) and an owner tag (the id of the
//! block it holds). The Host tier and the Gpu tier's CPU stand-in are both a `FramePool`.
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

/// The arena's memory: anonymous memory, or (feature `cuda`, Host tier, a GPU present)
/// pinned host memory mapped into the device's address space, so GPU kernels read blocks
/// in place (zero-copy) and copies to the device run at full PCIe speed.
enum HostMemory {
    Anonymous(#[expect(dead_code, reason = "held only to keep the mapping alive")] MmapMut),
    #[cfg(feature = "cuda")]
    Pinned(pinned::Pinned),
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
    fn allocate(tier: Tier, bytes: usize, want_pinned: bool) -> Result<(Self, *mut u8)> {
        #[cfg(feature = "cuda")]
        if want_pinned && tier == Tier::Host {
            match pinned::Pinned::allocate(bytes.max(1)) {
                Ok(mut p) => {
                    let base = p.host_ptr();
                    return Ok((HostMemory::Pinned(p), base));
                }
                Err(why) => {
                    static ONCE: std::sync::Once = std::sync::Once::new();
                    ONCE.call_once(|| eprintln!("attnstore-buffer: no pinned host memory ({why}); using mmap"));
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (tier, want_pinned);
        // An mmap failure is the kernel refusing memory: a typed error, never an abort.
        let mut map = MmapMut::map_anon(bytes.max(1)).map_err(|_| Error::OutOfMemory {
            tier: Tier::Host,
            requested_bytes: bytes,
            available_bytes: 0,
            limit_bytes: bytes,
        })?;
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

/// Pinned, device-mapped host memory through cudarc (dynamic loading: a machine without the
/// CUDA driver gets an error here, never a crash).
#[cfg(feature = "cuda")]
mod pinned {
    use cudarc::driver::{sys, CudaContext, PinnedHostSlice};
    use std::sync::Arc;

    /// GPU 0's primary context, or why there is none. cudarc panics when it cannot load the
    /// driver library; that means "no GPU here", not a crash.
    fn open_gpu() -> Result<Arc<CudaContext>, String> {
        std::panic::catch_unwind(|| CudaContext::new(0))
            .map_err(|_| "the CUDA driver library could not be loaded".to_string())?
            .map_err(|e| format!("no usable GPU 0: {e:?}"))
    }

    pub(super) struct Pinned {
        slice: PinnedHostSlice<u8>,
        device_base: u64,
        _ctx: Arc<CudaContext>,
    }

    impl Pinned {
        pub(super) fn allocate(bytes: usize) -> Result<Self, String> {
            let ctx = open_gpu()?;
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            // SAFETY: the slice's bytes are uninitialized host memory; the arena only hands out
            // slot bytes after a writer filled them (owner tags), and u8 has no invalid values.
            let mut slice = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, flags) }
                .map_err(|e| format!("cuMemHostAlloc of {bytes} bytes failed: {e:?}"))?;
            let host = slice.as_mut_ptr().map_err(|e| format!("pinned pointer: {e:?}"))?;
            let mut device: sys::CUdeviceptr = 0;
            // SAFETY: `host` is the start of a live DEVICEMAP allocation of this context, and
            // `device` is a valid out-pointer; flags must be 0.
            let status = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) };
            if status != sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuMemHostGetDevicePointer failed: {status:?}"));
            }
            Ok(Self { slice, device_base: device, _ctx: ctx })
        }

        pub(super) fn host_ptr(&mut self) -> *mut u8 {
            // Checked in `allocate`; the slice never moves.
            self.slice.as_mut_ptr().expect("pinned pointer checked at allocation")
        }

        pub(super) fn device_base(&self) -> u64 {
            self.device_base
        }
    }

    /// The Gpu tier's slots in device memory: a mirror of the pool's host-side slots that
    /// kernels read at `base + slot × block_bytes`, written on the pool's own stream.
    pub(super) struct Device {
        slice: cudarc::driver::CudaSlice<u8>,
        base: u64,
        stream: Arc<cudarc::driver::CudaStream>,
        ctx: Arc<CudaContext>,
    }

    impl Device {
        pub(super) fn allocate(bytes: usize) -> Result<Self, String> {
            use cudarc::driver::DevicePtr;
            let ctx = open_gpu()?;
            let stream = ctx.new_stream().map_err(|e| format!("creating a stream: {e:?}"))?;
            let slice = stream.alloc_zeros::<u8>(bytes).map_err(|e| format!("cuMemAlloc of {bytes} bytes: {e:?}"))?;
            let base = {
                let (ptr, _sync) = slice.device_ptr(&stream);
                ptr
            };
            Ok(Self { slice, base, stream, ctx })
        }

        pub(super) fn base(&self) -> u64 {
            self.base
        }

        /// Copies `src` to device offset `offset` on the pool's stream and waits for it.
        pub(super) fn copy_in(&self, offset: usize, src: &[u8]) -> Result<(), String> {
            if offset + src.len() > self.slice.len() {
                return Err(format!("{} bytes at {offset} overrun the {}-byte pool", src.len(), self.slice.len()));
            }
            self.ctx.bind_to_thread().map_err(|e| format!("binding the context: {e:?}"))?;
            // SAFETY: the destination range lies inside the live allocation (checked above);
            // `src` is a host slice that outlives the copy, because the stream is synchronized
            // before returning.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(self.base + offset as u64, src, self.stream.cu_stream())
            }
            .map_err(|e| format!("cuMemcpyHtoDAsync: {e:?}"))?;
            self.stream.synchronize().map_err(|e| format!("synchronizing the copy: {e:?}"))
        }

        /// An array of `entries` `i32`s in device memory, all -1, written on this pool's stream.
        pub(super) fn table(&self, entries: usize) -> Result<Table, String> {
            use cudarc::driver::DevicePtr;
            self.ctx.bind_to_thread().map_err(|e| format!("binding the context: {e:?}"))?;
            let slice = self
                .stream
                .clone_htod(&vec![-1i32; entries.max(1)])
                .map_err(|e| format!("allocating a {entries}-entry table: {e:?}"))?;
            self.stream.synchronize().map_err(|e| format!("synchronizing the table's upload: {e:?}"))?;
            let base = {
                let (ptr, _sync) = slice.device_ptr(&self.stream);
                ptr
            };
            Ok(Table { slice, base, stream: Arc::clone(&self.stream), ctx: Arc::clone(&self.ctx) })
        }
    }

    /// An `i32` array in device memory beside a [`Device`] pool, written entry by entry on the
    /// pool's stream (so a write is ordered after every copy into the pool issued before it).
    pub(crate) struct Table {
        slice: cudarc::driver::CudaSlice<i32>,
        base: u64,
        stream: Arc<cudarc::driver::CudaStream>,
        ctx: Arc<CudaContext>,
    }

    impl Table {
        pub(crate) fn base(&self) -> u64 {
            self.base
        }

        /// Writes `value` at `index` on the pool's stream and waits until it is in device memory.
        pub(crate) fn write(&self, index: usize, value: i32) -> Result<(), String> {
            if index >= self.slice.len() {
                return Err(format!("entry {index} of a {}-entry table", self.slice.len()));
            }
            self.ctx.bind_to_thread().map_err(|e| format!("binding the context: {e:?}"))?;
            let src = [value];
            // SAFETY: the destination (4 bytes at entry `index`, checked above) lies inside the
            // live i32 allocation, which was made on this stream; `src` lives on this frame until
            // the stream is synchronized below, so the copy never reads a dead buffer.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    self.base + (index * std::mem::size_of::<i32>()) as u64,
                    &src,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| format!("cuMemcpyHtoDAsync: {e:?}"))?;
            self.stream.synchronize().map_err(|e| format!("synchronizing the entry: {e:?}"))
        }
    }
}

/// A device-resident `i32` array written on the Gpu pool's stream (the slot table's device copy).
#[cfg(feature = "cuda")]
pub(crate) use pinned::Table as DeviceTable;

/// A fixed number of block slots in one arena, with latches and a free list.
pub(crate) struct FramePool {
    block_bytes: usize,
    /// The Gpu tier on a machine with a GPU: every slot mirrored in device memory.
    #[cfg(feature = "cuda")]
    device: Option<pinned::Device>,
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
    /// A pool of `slots` slots of `block_bytes` each, all free. `want_pinned`: a Host
    /// arena in pinned, device-mapped memory when the `cuda` feature is on and a GPU answers.
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
        let (memory, base) = HostMemory::allocate(tier, bytes, want_pinned)?;
        let frames = (0..slots).map(|_| Frame { latch: AtomicU32::new(0), owner: AtomicU64::new(NO_OWNER) }).collect();
        // Lowest slot first out: pop() from the end of a reversed list.
        let free = Mutex::new((0..slots_u32).rev().collect());
        #[cfg(feature = "cuda")]
        let device = match (want_pinned && tier == Tier::Gpu && bytes > 0).then(|| pinned::Device::allocate(bytes)) {
            Some(Ok(d)) => Some(d),
            Some(Err(why)) => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| eprintln!("attnstore-buffer: Gpu tier in host memory only ({why})"));
                None
            }
            None => None,
        };
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
    pub(crate) fn device_table(&self, entries: usize) -> Option<std::result::Result<DeviceTable, String>> {
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
