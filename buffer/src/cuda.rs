//! The CUDA side of the buffer manager (feature `cuda`): pinned host memory for the arenas, the
//! Gpu tier's slots in device memory with the one stream that writes them, and the slot table's
//! device copy beside them with its pinned host mirror. Every device write goes on that stream,
//! so stream order is what orders a slot's bytes before the table entry naming it
//! (`docs/buffer-manager.md`, "Device-planned reads"). cudarc loads the driver dynamically: a
//! machine without it gets an error here, never a crash.

#![allow(unsafe_code)] // FFI: pinned allocations and raw host-to-device copies; every block says why it is sound

use crate::arena::DeviceBatch;
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, PinnedHostSlice};
use std::sync::atomic::AtomicI32;
use std::sync::Arc;

/// GPU 0's primary context, or why there is none. cudarc panics when it cannot load the
/// driver library; that means "no GPU here", not a crash, so the library is looked for
/// first (the panic, still caught, would print its message and a backtrace).
fn open_gpu() -> Result<Arc<CudaContext>, String> {
    // SAFETY: loading the driver library runs only its initializers, as cudarc's own first
    // call does.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver library could not be loaded".to_string());
    }
    std::panic::catch_unwind(|| CudaContext::new(0))
        .map_err(|_| "the CUDA driver library could not be loaded".to_string())?
        .map_err(|e| format!("no usable GPU 0: {e:?}"))
}

fn bind(ctx: &CudaContext) -> Result<(), String> {
    ctx.bind_to_thread().map_err(|e| format!("binding the context: {e:?}"))
}

/// Enqueues a copy of `bytes` bytes from host address `src` to device address `dst` on `stream`.
///
/// # Safety
/// `dst..dst + bytes` lies inside a live device allocation; `src..src + bytes` stays allocated
/// and unwritten until `stream` has been synchronized (the copy may run any time before that).
unsafe fn enqueue_htod(dst: u64, src: *const u8, bytes: usize, stream: &CudaStream) -> Result<(), String> {
    // SAFETY: the caller's contract above; the stream is live (borrowed).
    let status = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream.cu_stream()) };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuMemcpyHtoDAsync of {bytes} bytes: {status:?}"));
    }
    Ok(())
}

/// One host-to-device copy of a batch: `bytes` bytes from host address `src` to device address
/// `dst`.
#[derive(Clone, Copy)]
pub(crate) struct HostCopy {
    pub(crate) dst: u64,
    pub(crate) src: *const u8,
    pub(crate) bytes: usize,
}

/// Whether the driver has `cuMemcpyBatchAsync_v2` (CUDA 13.0 and later). Asked once: cudarc
/// loads a missing symbol with a panic, so the version decides before the first call.
fn batch_copies_supported() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        let mut version = 0;
        // SAFETY: a valid out-pointer; the driver library is loaded (a context exists).
        let status = unsafe { sys::cuDriverGetVersion(&mut version) };
        status == sys::CUresult::CUDA_SUCCESS && version >= 13000
    })
}

/// Enqueues `copies` on `stream`: one `cuMemcpyBatchAsync` call where the driver has it (the
/// copies of a batch run in no particular order among themselves, the batch as a whole in
/// stream order), else one `cuMemcpyHtoDAsync` each. A call per 2 KiB block cost ~2 µs of
/// host time on the GPU machine's host, which made a maintenance round admitting a few hundred
/// blocks take most of a millisecond.
///
/// # Safety
/// Every copy's destination lies inside a live device allocation, and its source stays
/// allocated and unwritten until `stream` has been synchronized.
unsafe fn enqueue_batch(copies: &[HostCopy], stream: &CudaStream) -> Result<(), String> {
    if copies.len() > 1 && batch_copies_supported() {
        let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.dst).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.src as sys::CUdeviceptr).collect();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.bytes).collect();
        let nowhere = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID, id: 0 };
        // ANY: the sources are pinned and left alone until the stream is synchronized (the
        // caller's contract), so the driver may read them whenever it likes.
        let mut attrs = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
            srcLocHint: nowhere,
            dstLocHint: nowhere,
            flags: 0,
        }];
        let mut first = [0usize];
        // SAFETY: the three arrays hold `copies.len()` entries each, one attribute applies from
        // copy 0 on; the ranges are the caller's contract; the stream is live (borrowed).
        let status = unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                copies.len(),
                attrs.as_mut_ptr(),
                first.as_mut_ptr(),
                1,
                stream.cu_stream(),
            )
        };
        if status == sys::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        if status != sys::CUresult::CUDA_ERROR_NOT_SUPPORTED {
            return Err(format!("cuMemcpyBatchAsync of {} copies: {status:?}", copies.len()));
        }
    }
    for c in copies {
        // SAFETY: the caller's contract, copy by copy.
        unsafe { enqueue_htod(c.dst, c.src, c.bytes, stream)? };
    }
    Ok(())
}

/// Pinned, device-mapped host memory (`cuMemHostAlloc(DEVICEMAP | PORTABLE)`): the Host arena
/// (kernels read it in place) and the Gpu tier's host side (the source of its device copies,
/// which are only truly asynchronous from page-locked memory).
pub(crate) struct Pinned {
    slice: PinnedHostSlice<u8>,
    device_base: u64,
    _ctx: Arc<CudaContext>,
}

impl Pinned {
    pub(crate) fn allocate(bytes: usize) -> Result<Self, String> {
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

    pub(crate) fn host_ptr(&mut self) -> *mut u8 {
        // Checked in `allocate`; the slice never moves.
        self.slice.as_mut_ptr().expect("pinned pointer checked at allocation")
    }

    pub(crate) fn device_base(&self) -> u64 {
        self.device_base
    }
}

/// The Gpu tier's slots in device memory: a mirror of the pool's host-side slots that kernels
/// read at `base + slot × block_bytes`, written on the pool's own stream.
pub(crate) struct Device {
    slice: CudaSlice<u8>,
    base: u64,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl Device {
    pub(crate) fn allocate(bytes: usize) -> Result<Self, String> {
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

    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Enqueues copies of `(offset, src, bytes)`: `bytes` bytes at host address `src` to device
    /// offset `offset`, on the pool's stream in one batch ([`enqueue_batch`]), without waiting.
    ///
    /// # Safety
    /// Every source stays allocated and unwritten until [`Device::synchronize`] returns.
    pub(crate) unsafe fn enqueue_copies(&self, copies: &[(usize, *const u8, usize)]) -> Result<(), String> {
        if let Some(&(offset, _, bytes)) = copies.iter().find(|&&(o, _, b)| o + b > self.slice.len()) {
            return Err(format!("{bytes} bytes at {offset} overrun the {}-byte pool", self.slice.len()));
        }
        bind(&self.ctx)?;
        let copies: Vec<HostCopy> = copies
            .iter()
            .map(|&(offset, src, bytes)| HostCopy { dst: self.base + offset as u64, src, bytes })
            .collect();
        // SAFETY: every destination lies inside the live allocation (checked above); the sources'
        // lifetime is the caller's contract.
        unsafe { enqueue_batch(&copies, &self.stream) }
    }

    /// Waits until every write enqueued on the pool's stream is done.
    pub(crate) fn synchronize(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(|e| format!("synchronizing the pool's stream: {e:?}"))
    }

    /// Copies `src` to device offset `offset` on the pool's stream and waits for it.
    pub(crate) fn copy_in(&self, offset: usize, src: &[u8]) -> Result<(), String> {
        // SAFETY: `src` is borrowed until this returns, and the stream is synchronized before.
        unsafe { self.enqueue_copies(&[(offset, src.as_ptr(), src.len())])? };
        self.synchronize()
    }

    /// An array of `entries` `i32`s in device memory, all -1, written on this pool's stream,
    /// with its host mirror in pinned memory (also all -1).
    pub(crate) fn table(&self, entries: usize) -> Result<Table, String> {
        use cudarc::driver::DevicePtr;
        bind(&self.ctx)?;
        let len = entries.max(1);
        let slice = self
            .stream
            .clone_htod(&vec![-1i32; len])
            .map_err(|e| format!("allocating a {entries}-entry table: {e:?}"))?;
        self.synchronize()?;
        let base = {
            let (ptr, _sync) = slice.device_ptr(&self.stream);
            ptr
        };
        let mirror = PinnedEntries::allocate(&self.ctx, len, -1)?;
        Ok(Table { slice, base, mirror, stream: Arc::clone(&self.stream), ctx: Arc::clone(&self.ctx) })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Copies still in flight read the pool's host side, which is freed after this.
        let _ = self.synchronize();
    }
}

/// `i32` entries in page-locked host memory, read and written as atomics on the host and copied
/// to the device asynchronously (a copy's source must stay put until it ran).
struct PinnedEntries {
    /// Owns the memory; `entries` points into it.
    _slice: PinnedHostSlice<i32>,
    entries: *const AtomicI32,
    len: usize,
}

// SAFETY: the memory is owned by `_slice` (itself Send + Sync) for the value's life and only
// reached as `&[AtomicI32]`, which is Send + Sync.
unsafe impl Send for PinnedEntries {}
// SAFETY: as for `Send`: shared access goes through atomics only.
unsafe impl Sync for PinnedEntries {}

impl PinnedEntries {
    fn allocate(ctx: &Arc<CudaContext>, len: usize, value: i32) -> Result<Self, String> {
        // Portable, not write-combined: the host reads these entries too.
        // SAFETY: the memory is uninitialized until written below; it is only read after.
        let mut slice = unsafe { ctx.alloc_pinned_with_flags::<i32>(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| format!("cuMemHostAlloc of {len} table entries: {e:?}"))?;
        let ptr = slice.as_mut_ptr().map_err(|e| format!("pinned pointer: {e:?}"))?;
        for i in 0..len {
            // SAFETY: `i < len`, the allocation's length in i32s; writing initializes it.
            unsafe { ptr.add(i).write(value) };
        }
        Ok(Self { _slice: slice, entries: ptr.cast::<AtomicI32>().cast_const(), len })
    }

    fn entries(&self) -> &[AtomicI32] {
        // SAFETY: `len` initialized i32s at `entries` (page-aligned), alive as long as `self`;
        // AtomicI32 has the size, alignment and bit validity of i32, and after `allocate` the
        // memory is only reached through this shared slice of atomics.
        unsafe { std::slice::from_raw_parts(self.entries, self.len) }
    }
}

/// An `i32` array in device memory beside a [`Device`] pool, with a pinned host mirror, written
/// on the pool's stream (so a write is ordered after every copy into the pool issued before it).
pub(crate) struct Table {
    slice: CudaSlice<i32>,
    base: u64,
    mirror: PinnedEntries,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl Table {
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// The host mirror (pinned): the source of [`Table::enqueue_entries`].
    pub(crate) fn mirror(&self) -> &[AtomicI32] {
        &self.mirror.entries()[..self.slice.len()]
    }

    /// Writes `value` at `index` on the pool's stream and waits until it is in device memory.
    pub(crate) fn write(&self, index: usize, value: i32) -> Result<(), String> {
        if index >= self.slice.len() {
            return Err(format!("entry {index} of a {}-entry table", self.slice.len()));
        }
        bind(&self.ctx)?;
        let src = [value];
        // SAFETY: the destination (4 bytes at entry `index`, checked above) lies inside the live
        // i32 allocation; `src` lives on this frame until the stream is synchronized below, so
        // the copy never reads a dead buffer.
        unsafe {
            enqueue_htod(
                self.base + (index * size_of::<i32>()) as u64,
                src.as_ptr().cast(),
                size_of::<i32>(),
                &self.stream,
            )
        }?;
        self.stream.synchronize().map_err(|e| format!("synchronizing the entry: {e:?}"))
    }

    /// Enqueues copies of the host mirror's entries `first..first + count`, for every
    /// `(first, count)` of `ranges`, to the device table on the pool's stream inside `batch`
    /// (one batch of copies, [`enqueue_batch`]), without waiting (the batch waits). The copies
    /// read the mirror when they run: the caller does not write those entries before the batch
    /// ends (the manager's state lock), or the device gets the later value.
    pub(crate) fn enqueue_entries(&self, batch: &DeviceBatch, ranges: &[(usize, usize)]) -> Result<(), String> {
        let _ = batch;
        if let Some(&(first, count)) = ranges.iter().find(|&&(f, c)| f + c > self.slice.len()) {
            return Err(format!("entries {first}..{} of a {}-entry table", first + count, self.slice.len()));
        }
        bind(&self.ctx)?;
        let copies: Vec<HostCopy> = ranges
            .iter()
            .map(|&(first, count)| {
                let offset = first * size_of::<i32>();
                HostCopy {
                    dst: self.base + offset as u64,
                    // wrapping_add: an address for the driver, in bounds (checked above).
                    src: self.mirror.entries.cast::<u8>().wrapping_add(offset),
                    bytes: count * size_of::<i32>(),
                }
            })
            .collect();
        // SAFETY: every range lies inside both live allocations (checked above: the mirror has
        // the device table's length); the mirror outlives the copies, because `Table`'s drop
        // synchronizes the stream before its fields are freed. A write to the mirror racing a
        // copy gives the device a stale or newer value, never a memory error (atomics on the
        // host, a DMA read outside the program).
        unsafe { enqueue_batch(&copies, &self.stream) }
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // Copies still in flight read the mirror, which is freed after this.
        let _ = self.stream.synchronize();
    }
}
