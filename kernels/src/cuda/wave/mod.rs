//! A whole wave-index decode step on the GPU (`wave.cu`): centroid scoring and top-r, the
//! retrieved clusters expanded into a row list (Gpu-tier hits as cache rows), attention over
//! those rows and the steady zone, the estimation partial of every other cluster (on a
//! second stream, beside the row list and the attention), and the merge — no host work
//! between the launches. The host only reads
//! the selection back afterwards, to keep the Gpu tier (admissions are the maintainer's
//! work, off the decode path).

mod hack;
mod io;
mod launch;
mod timing;
mod upload;

use hack::{DeviceGroups, HackBuffers};

pub use io::{DeviceIo, IoDType};
use launch::Graphs;
pub use launch::WaveBatch;
pub use timing::StreamMark;

use super::MAX_GROUP;
use super::NO_STEADY;
use super::{
    chunk_rows, device_address, gpu_err, DecodeJob, DeviceCentroids, GpuBackend, GpuCache, KvPointers, SelectJob,
    SharedRows,
};
use crate::arena_wave::ArenaWave;
use crate::error::{Error, Result};
use crate::layout::ClusteredLayer;
use crate::shape::AttnShape;
use cudarc::driver::{sys, CudaEvent, CudaGraph, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice, PushKernelArg};
use std::sync::Arc;

/// CTAs per KV head that share writing its row list (`wave_expand`).
const EXPAND_SPLIT: usize = 8;

/// A [`ClusteredLayer`]'s meta index in device memory: centroids, mean values, log sizes and
/// row ranges of every cluster of every KV head (the KV rows themselves stay where the
/// caller put them, e.g. [`GpuBackend::pin`]ned host memory).
pub struct DeviceWave {
    cent: DeviceCentroids,
    value_means: CudaSlice<u16>,
    log_size: CudaSlice<f32>,
    offsets: CudaSlice<i32>,
    kv_heads: usize,
    clusters: usize,
    indexed: usize,
    rows: usize,
    largest: usize,
    /// Set for a layer whose indexed rows live in a shared arena ([`GpuBackend::upload_arena_wave`]).
    arena: Option<ArenaRows>,
    /// Set for an arena layer of 2-bit rows: where its value blocks are.
    groups: Option<DeviceGroups>,
}

/// The parts of an arena layer ([`ArenaWave`]) besides its meta index: where each indexed
/// row is in the arena, and the steady zone in device memory.
struct ArenaRows {
    /// `kv_heads × indexed` arena rows.
    row_map: CudaSlice<i32>,
    /// Steady rows, `capacity × kv_heads × head_dim` (row `i` of head `h` at `i·kv_heads + h`).
    keys: CudaSlice<u16>,
    values: CudaSlice<u16>,
    /// The steady zone's length (one int the row list reads, so graphs outlive appends).
    len: CudaSlice<i32>,
    /// Mapped pinned staging of the steady rows (keys, then values, laid out like the device
    /// zone): [`GpuBackend::set_steady`] writes rows there, the
    /// step's `step_ingest` copies what changed (no copy call on the host).
    stage: Mailbox<u16>,
    /// Mapped pinned `[length, first row changed since the last step]`.
    marks: Mailbox<i32>,
    /// The backend's stream: dropping the staging waits for the steps that read it.
    stream: Arc<CudaStream>,
    capacity: usize,
    /// Rows written so far.
    synced: usize,
    /// One past the highest arena row the map names.
    arena_rows: usize,
}

impl Drop for ArenaRows {
    fn drop(&mut self) {
        // The staging is freed with this: the steps reading it must be done (a failure here
        // means the context is broken and nothing runs any more).
        let _ = self.stream.synchronize();
    }
}

impl DeviceWave {
    /// Steady-zone rows written to the device (an arena layer; 0 otherwise).
    pub fn steady_rows(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.synced)
    }

    /// Steady-zone rows an arena layer holds at most.
    pub fn steady_capacity(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.capacity)
    }

    /// Clusters per KV head.
    pub fn clusters(&self) -> usize {
        self.clusters
    }

    /// Rows per KV head (the KV a launch reads must hold at least these).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// For a layer of 2-bit rows, per KV head one past the highest value-block id (what
    /// [`WaveFetched::blocks`] names); `None` for f16 rows.
    pub fn block_id_end(&self) -> Option<&[u32]> {
        self.groups.as_ref().map(|g| &g.table.id_end[..])
    }
}

/// Pinned host memory read and written by the host without a driver call (cudarc's own
/// accessors synchronize on an event first: a driver call each, which on a slow host costs
/// more than the step's small copies). Whoever launches work reading or writing it must wait
/// for that work before touching it from the host (a job's `done` event, a layer's next step
/// only after its fetch): that is what the accessors rely on.
struct Mailbox<T> {
    memory: PinnedHostSlice<T>,
    /// Host address of the first element (taken once at allocation).
    addr: usize,
    /// Its device address (the memory is device-mapped: kernels read and write it in place
    /// over PCIe).
    dev: u64,
}

impl<T: cudarc::driver::ValidAsZeroBits> Mailbox<T> {
    fn len(&self) -> usize {
        self.memory.len()
    }

    #[allow(unsafe_code, reason = "reads pinned memory without cudarc's synchronizing accessor")]
    fn as_slice(&self) -> &[T] {
        // SAFETY: `addr` is the start of the live allocation `memory` owns, of `len` elements,
        // initialized at allocation (zero-filled); no device work touches it now (the type's
        // contract above), and `&self` excludes host writers.
        unsafe { std::slice::from_raw_parts(self.addr as *const T, self.len()) }
    }

    #[allow(unsafe_code, reason = "writes pinned memory without cudarc's synchronizing accessor")]
    fn as_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.len()) }
    }
}

/// A layer's meta index on the host, for [`GpuBackend::upload_meta`].
struct MetaParts<'a> {
    centroids: &'a [half::f16],
    value_means: &'a [half::f16],
    sizes: &'a [u32],
    offsets: &'a [u32],
}

/// Which row blocks of a [`DeviceWave`]'s layer sit in a [`GpuCache`]: per KV head and block
/// of `block_rows` rows, the cache row of the block's first row. Kept on the host by the
/// caller's replacement policy and copied to the device with [`GpuBackend::upload_table`].
pub struct WaveTable {
    host: Vec<i32>,
    dev: CudaSlice<i32>,
    block_rows: usize,
    blocks_per_head: usize,
    kv_heads: usize,
    /// Cache rows the table names (one past the highest).
    needs: usize,
}

impl WaveTable {
    /// Rows per block.
    pub fn block_rows(&self) -> usize {
        self.block_rows
    }

    /// Blocks per KV head.
    pub fn blocks_per_head(&self) -> usize {
        self.blocks_per_head
    }

    /// The first cache row of block `block` of head `h`, when cached.
    pub fn get(&self, h: usize, block: usize) -> Option<u32> {
        let s = *self.host.get(h * self.blocks_per_head + block)?;
        u32::try_from(s).ok()
    }

    /// Records that block `block` of head `h` is (`Some(first cache row)`) or is not cached.
    pub fn set(&mut self, h: usize, block: usize, slot: Option<u32>) -> Result<()> {
        if h >= self.kv_heads || block >= self.blocks_per_head {
            return Err(Error::InvalidArgument {
                what: "wave table",
                message: format!(
                    "block ({h}, {block}) is outside {} heads × {} blocks",
                    self.kv_heads, self.blocks_per_head
                ),
            });
        }
        let value = match slot {
            Some(s) if s <= i32::MAX as u32 - self.block_rows as u32 => {
                self.needs = self.needs.max(s as usize + self.block_rows);
                s as i32
            }
            Some(s) => {
                return Err(Error::InvalidArgument {
                    what: "wave table",
                    message: format!("cache row {s} is too large"),
                })
            }
            None => -1,
        };
        self.host[h * self.blocks_per_head + block] = value;
        Ok(())
    }
}

/// A step's Gpu-tier cache as the kernels take it (zeros: none).
struct CacheArgs {
    keys: u64,
    values: u64,
    rows: i32,
    table: u64,
    block_rows: i32,
    blocks_per_head: i32,
    slot_rows: i32,
}

/// The buffers of one wave decode step (reused step after step): the selection, the row
/// lists, the partials of attention and estimation, the output.
pub struct WaveJob {
    select: SelectJob,
    decode: DecodeJob,
    scan: CudaSlice<i32>,
    /// The step's selection as the host gets it (`kv_heads × r`; −c−1 for a missed cluster),
    /// written by `wave_expand` and copied to the selection mailbox by the merge.
    flags: CudaSlice<i32>,
    mark: CudaSlice<i32>,
    /// The estimation's partials (`kv_heads × est_chunks × group × (head_dim + 2)`), written
    /// on the side stream while the row list and the attention run on the main one.
    est_part: CudaSlice<f32>,
    est_chunks: usize,
    per_cta: usize,
    graphs: Graphs,
    /// Pinned host buffers for the step's queries, output and selection: copies from and to
    /// them are asynchronous (pageable memory makes each copy a wait of its own).
    io: JobIo,
    /// A 2-bit layer's piece lists and homomorphic partials.
    hack: Option<HackBuffers>,
}

/// Words of a step's I/O descriptor the host writes (`IO_QUERY` … `IO_TOKEN` in `decode.cu`).
const IO_DESC_WORDS: usize = 4;
/// Words of its device copy (`IO_WORDS`: the host's and `IO_BAD`).
const IO_DEV_WORDS: usize = 5;

/// See [`WaveJob::io`].
struct JobIo {
    q: Mailbox<f32>,
    out: Mailbox<f32>,
    sel: Mailbox<i32>,
    /// Recorded after a launch of the job alone: the step, with its reads and writes of the
    /// mailboxes, is done.
    done: Arc<CudaEvent>,
    /// The event that marks the end of the job's last launch (its own `done`, or the batch's
    /// when it ran in one: one record per batch, not per job), until waited for.
    pending: Option<Arc<CudaEvent>>,
    /// The step's I/O descriptor (`IO_*` words of `decode.cu`: the caller's query and output
    /// addresses, their element type, the step's token), written by the host before each
    /// launch; all zero for a step whose query is in `q`.
    desc: Mailbox<u64>,
    /// Its device copy (step_ingest writes it, attn_merge reads it), with the `IO_BAD` word.
    desc_dev: CudaSlice<u64>,
    /// A caller's non-finite query element: its index + 1 and bits (zero: none).
    status: Mailbox<i32>,
    /// The caller's tensors of the next launch (`launch_wave_lane_io`), taken by it.
    device: Option<io::DeviceIo>,
    /// The token of the last step over caller memory (from 1).
    token: u64,
    /// The event that orders a step over the caller's device memory after the caller's
    /// stream (`launch_wave_lane_io`), made by the first such step.
    caller: Option<CudaEvent>,
}

impl JobIo {
    /// Writes the descriptor of the launch about to be made: the caller's tensors of a
    /// `launch_wave_lane_io` (which waited for the job's previous step), or none, and clears
    /// the status. A step over the mailbox's query after another such step leaves both as
    /// they are (nothing to change, and the previous step may still be running).
    fn write_descriptor(&mut self) {
        let words = match self.device.take() {
            Some(io) => {
                self.token += 1;
                [io.query, io.output, io.dtype.code() as u64, self.token]
            }
            None if self.desc.as_slice()[0] == 0 => return,
            None => [0; IO_DESC_WORDS],
        };
        self.desc.as_mut().copy_from_slice(&words);
        self.status.as_mut().fill(0);
    }

    /// Waits for the job's last step (without noting that it is done).
    fn wait_shared(&self) -> Result<()> {
        if let Some(e) = &self.pending {
            e.synchronize().map_err(gpu_err("waiting for the step"))?;
        }
        Ok(())
    }

    /// Waits for the job's last step unless that was already done.
    fn wait(&mut self) -> Result<()> {
        if let Some(e) = &self.pending {
            // A later record of a batch's event only marks a later point: waiting for it is
            // never too early.
            e.synchronize().map_err(gpu_err("waiting for the step"))?;
            self.pending = None;
        }
        Ok(())
    }
}

impl WaveJob {
    /// Whether steps of this job are captured into CUDA graphs and replayed (the default), or
    /// launched kernel by kernel (to compare the two; results are the same).
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs.off = !on;
    }
}

/// The Gpu-tier cache a step reads hits from.
#[derive(Clone, Copy)]
pub enum WaveCache<'a> {
    /// A layer's own cache and block table ([`GpuBackend::wave_table`]).
    Layer(&'a GpuCache, &'a WaveTable),
    /// A cache shared by many layers (the buffer manager's Gpu tier), for an arena layer.
    Arena(ArenaCache),
}

/// A Gpu-tier block pool in device memory shared by every layer, with its table: per arena
/// block (`block_rows` arena rows), the pool slot holding a copy, or −1. Slot `s` holds cache
/// rows `s·block_rows..(s + 1)·block_rows`, laid out like the arena block.
#[derive(Debug, Clone, Copy)]
pub struct ArenaCache {
    /// The pool's rows (`rows` = slots × `block_rows`).
    pub rows: SharedRows,
    /// Device address of the table (`i32` per arena block).
    pub table: u64,
    /// Arena rows per block (and cache rows per slot).
    pub block_rows: usize,
}

/// One request of a batched step ([`GpuBackend::launch_wave_batch`]): what
/// [`GpuBackend::launch_wave`] takes.
pub struct WaveStep<'a> {
    /// The request's layer (meta index).
    pub wave: &'a DeviceWave,
    /// Where its KV rows are: a layer's `kv_heads × rows` array, or the shared arena (head
    /// stride 0) of an arena layer.
    pub kv: KvPointers,
    /// Its Gpu-tier cache, if any.
    pub cache: Option<WaveCache<'a>>,
    /// Its buffers (queries set with [`GpuBackend::set_wave_query`]).
    pub job: &'a mut WaveJob,
}

/// What a wave step gave back ([`GpuBackend::fetch_wave_selected`]).
#[derive(Debug, Clone, PartialEq)]
pub struct WaveFetched {
    /// The attention output, `q_heads × head_dim`.
    pub output: Vec<f32>,
    /// The clusters retrieved, `per_head` words per KV head (unordered within a head): cluster
    /// `c` as `c` when every row of it was read from the Gpu-tier cache, as `!c` (−c−1) when a
    /// row of it was read from the KV rows (the pinned Host arena for an engine layer): a
    /// miss, as the step's own table lookups saw it. Kept as the step wrote it, so fetching
    /// costs one copy; [`Self::selection`] and [`Self::missed`] decode it.
    pub flagged: Vec<i32>,
    /// Words per KV head (the step's retrieved clusters per head).
    pub per_head: usize,
    /// For a layer of 2-bit rows, the value blocks the step read, `blocks_per_head` words
    /// per KV head: block id `b` as `b` when every page of it was read from the Gpu tier, as
    /// `!b` when not (a miss), `i32::MAX` past the head's list. Empty for f16 rows.
    pub blocks: Vec<i32>,
    /// Words of `blocks` per KV head.
    pub blocks_per_head: usize,
}

/// The cluster of a flagged word (a miss `c` is written `!c`): `w ^ (w >> 31)`, no branch.
fn flagged_cluster(w: i32) -> u32 {
    (w ^ (w >> 31)) as u32
}

impl WaveFetched {
    /// Per KV head, the words of `flagged`.
    fn heads(&self) -> impl Iterator<Item = &[i32]> {
        self.flagged.chunks(self.per_head.max(1))
    }

    /// The clusters retrieved per KV head (unordered).
    pub fn selection(&self) -> Vec<Vec<u32>> {
        self.heads().map(|h| h.iter().map(|&w| flagged_cluster(w)).collect()).collect()
    }

    /// Per KV head, the retrieved clusters that were missed (see [`Self::flagged`]).
    pub fn missed(&self) -> Vec<Vec<u32>> {
        self.heads().map(|h| h.iter().filter(|&&w| w < 0).map(|&w| flagged_cluster(w)).collect()).collect()
    }

    /// The real clusters retrieved and, of those, missed, over every KV head: ids at or past
    /// `real[h]` are padding (a head with no entry has none). Branch-free, so it vectorizes:
    /// a step's thread counts with it on the way back from the device.
    pub fn count_real(&self, real: &[u32]) -> (usize, usize) {
        let (mut retrieved, mut missed) = (0usize, 0usize);
        for (h, words) in self.heads().enumerate() {
            let real = real.get(h).copied().unwrap_or(0);
            let (mut r, mut m) = (0u32, 0u32);
            for &w in words {
                let is_real = u32::from(flagged_cluster(w) < real);
                r += is_real;
                m += is_real & u32::from(w < 0);
            }
            retrieved += r as usize;
            missed += m as usize;
        }
        (retrieved, missed)
    }
}

impl GpuBackend {
    /// Buffers for decode steps of `shape` over `wave` retrieving `r` clusters per KV head.
    pub fn prepare_wave(&self, shape: &AttnShape, wave: &DeviceWave, r: usize) -> Result<WaveJob> {
        if shape.kv_heads != wave.kv_heads || shape.head_dim != self.head_dim || shape.group() > MAX_GROUP {
            return Err(Error::InvalidArgument {
                what: "shape",
                message: format!(
                    "the layer has {} KV heads and the kernels head_dim {} (groups ≤ {MAX_GROUP}); got {shape:?}",
                    wave.kv_heads, self.head_dim
                ),
            });
        }
        let zeros = vec![0.0f32; shape.query_len()];
        let mut select = self.prepare_select(shape, &zeros, &wave.cent, r)?;
        select.group_scores = Some(
            self.stream
                .alloc_zeros::<f32>(shape.q_heads * wave.clusters)
                .map_err(gpu_err("allocating wave buffers"))?,
        );
        let steady = wave.rows - wave.indexed;
        // Room per head for the steady zone and the r largest clusters (only the steady zone
        // for 2-bit rows: their clusters are listed as pieces of value blocks).
        let capacity = if wave.groups.is_some() { steady } else { steady + r * wave.largest };
        // Chunks sized for a typical list (r average clusters) and a grid for 1.25 times that: a
        // longer list is covered by CTAs taking several chunks (attn_partial's chunk loop).
        let typical = if wave.groups.is_some() { steady } else { steady + r * wave.indexed.div_ceil(wave.clusters) };
        let chunk = chunk_rows(typical, shape.kv_heads);
        let chunks = capacity.min(typical + typical / 4).div_ceil(chunk).max(1);
        // Chunks of a multiple of 128 clusters (four 32-cluster tiles), at most ~64 CTAs per head.
        let per_cta = wave.clusters.div_ceil(64).next_multiple_of(128);
        let est_chunks = wave.clusters.div_ceil(per_cta);
        let s = &self.stream;
        let alloc_i = |n: usize| s.alloc_zeros::<i32>(n.max(1)).map_err(gpu_err("allocating wave buffers"));
        let alloc_f = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(gpu_err("allocating wave buffers"));
        let decode = DecodeJob {
            q: s.clone_htod(&zeros).map_err(gpu_err("copying queries"))?,
            rows: Some((alloc_i(shape.kv_heads * capacity)?, alloc_i(shape.kv_heads + 1)?)),
            part: alloc_f(shape.kv_heads * chunks * shape.group() * (self.head_dim + 2))?,
            out: alloc_f(shape.query_len())?,
            lse: alloc_f(shape.q_heads)?,
            chunks,
            chunk,
            identity_rows: wave.rows,
            cache_slots: 0,
            shape: *shape,
            scale: shape.scale(),
        };
        let hack = match &wave.groups {
            Some(g) => Some(self.hack_buffers(shape, g, r)?),
            None => None,
        };
        let cap = hack.as_ref().map_or(0, |h| h.cap);
        let job = WaveJob {
            select,
            decode,
            scan: alloc_i(shape.kv_heads * EXPAND_SPLIT * (r + 1))?,
            flags: alloc_i(shape.kv_heads * (r + cap))?,
            mark: alloc_i(shape.kv_heads * wave.clusters)?,
            est_part: alloc_f(shape.kv_heads * est_chunks * shape.group() * (self.head_dim + 2))?,
            est_chunks,
            per_cta,
            graphs: Graphs::default(),
            io: self.job_io(shape, r, cap)?,
            hack,
        };
        self.settle()?;
        Ok(job)
    }

    /// Waits until everything enqueued on the backend's stream has run. Buffers are allocated
    /// (and zeroed, and uploaded) in that stream's order (cudarc allocates with
    /// `cuMemAllocAsync`), while a step on a batch lane's streams does not wait for the
    /// backend's stream: a layer or job made for a lane is settled before it is handed out, or
    /// the lane's kernels could run before its memory exists or holds its zeros. (Without it,
    /// a batch of 39 contexts whose layers were made again after a decode segment faulted
    /// with `CUDA_ERROR_LAUNCH_FAILED`, or crashed the process, a run or two later.)
    pub(super) fn settle(&self) -> Result<()> {
        self.stream.synchronize().map_err(gpu_err("settling new device buffers"))
    }

    /// Sets the queries (`q_heads × head_dim`) of `job`'s next step: written to the job's
    /// pinned buffer, which the step copies to the device as it starts (so a replayed graph
    /// takes them with no copy call). Waits for the job's previous step first.
    pub fn set_wave_query(&self, job: &mut WaveJob, q: &[f32]) -> Result<()> {
        let want = job.decode.shape.query_len();
        if q.len() != want {
            return Err(Error::ShapeMismatch { what: "queries (q_heads × head_dim)", expected: want, got: q.len() });
        }
        if let Some(bad) = crate::first_non_finite(q) {
            return Err(Error::InvalidArgument { what: "queries", message: format!("element {bad} is not finite") });
        }
        // The job's last step must be done with the buffer (it long is when it was fetched).
        job.io.wait()?;
        job.io.q.as_mut().copy_from_slice(q);
        Ok(())
    }

    /// A job's pinned buffers (`blocks`: value-block words per head a 2-bit step reports).
    fn job_io(&self, shape: &AttnShape, r: usize, blocks: usize) -> Result<JobIo> {
        let q = self.mailbox::<f32>(shape.query_len())?;
        let out = self.mailbox::<f32>(shape.query_len())?;
        let sel = self.mailbox::<i32>(shape.kv_heads * (r + blocks))?;
        let done = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(gpu_err("creating an event"))?;
        let desc = self.mailbox::<u64>(IO_DESC_WORDS)?;
        let desc_dev = self.stream.alloc_zeros::<u64>(IO_DEV_WORDS).map_err(gpu_err("allocating a descriptor"))?;
        let status = self.mailbox::<i32>(2)?;
        Ok(JobIo {
            q,
            out,
            sel,
            done: Arc::new(done),
            pending: None,
            desc,
            desc_dev,
            status,
            device: None,
            token: 0,
            caller: None,
        })
    }

    /// Waits for the step and returns its output (`q_heads × head_dim`), the clusters it
    /// retrieved per KV head (unordered) and which of them it missed: [`GpuBackend::fetch_wave`]
    /// and the selection of [`GpuBackend::wave_selection`] with one wait.
    pub fn fetch_wave_selected(&self, job: &mut WaveJob) -> Result<WaveFetched> {
        // The step ends with copies of both into the job's pinned buffers.
        job.io.wait()?;
        let words = job.io.sel.as_slice();
        let clusters = job.decode.shape.kv_heads * job.select.r;
        Ok(WaveFetched {
            output: job.io.out.as_slice().to_vec(),
            flagged: words[..clusters].to_vec(),
            per_head: job.select.r,
            blocks: if job.hack.is_some() { words[clusters..].to_vec() } else { Vec::new() },
            blocks_per_head: job.hack.as_ref().map_or(0, |h| h.cap),
        })
    }

    /// A mailbox of `len` elements, zeroed: pinned host memory mapped into the device's
    /// address space.
    fn mailbox<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default>(
        &self,
        len: usize,
    ) -> Result<Mailbox<T>> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        let mut memory = self.pinned_zeroed::<T>(flags, len)?;
        let dev = super::mapped_device_pointer(&mut memory)?;
        let addr = memory.as_mut_ptr().map_err(gpu_err("reading a pinned pointer"))? as usize;
        Ok(Mailbox { memory, addr, dev })
    }

    /// The checks every launch of a step makes before it enqueues anything.
    fn check_steps(&self, steps: &[WaveStep<'_>]) -> Result<()> {
        for s in steps {
            let (wave, kv, job) = (s.wave, s.kv, &*s.job);
            let kv_needs = wave.arena.as_ref().map_or(wave.rows, |a| a.arena_rows);
            if kv.rows < kv_needs
                || job.mark.len() < wave.kv_heads * wave.clusters
                || job.decode.identity_rows != wave.rows
                || job.hack.is_some() != wave.groups.is_some()
            {
                return Err(Error::InvalidArgument {
                    what: "wave launch",
                    message: format!(
                        "the job or the KV ({} rows) does not belong to this layer ({kv_needs} rows, {} clusters per head)",
                        kv.rows, wave.clusters
                    ),
                });
            }
            match (s.cache, &wave.arena) {
                (Some(WaveCache::Layer(c, t)), None) => {
                    if t.needs > c.slots || t.host.len() != wave.kv_heads * wave.rows.div_ceil(t.block_rows) {
                        return Err(Error::InvalidArgument {
                            what: "wave cache",
                            message: format!("the table names {} cache rows, the cache has {}", t.needs, c.slots),
                        });
                    }
                }
                (Some(WaveCache::Arena(a)), Some(_)) => {
                    let steady = wave.steady_capacity() * wave.kv_heads;
                    if a.block_rows == 0 || a.rows.rows + steady > i32::MAX as usize || a.table == 0 {
                        return Err(Error::InvalidArgument {
                            what: "wave cache",
                            message: format!(
                                "an arena cache needs a table, rows per block and < 2^31 rows with the steady zone; got {a:?}"
                            ),
                        });
                    }
                }
                (None, _) => {}
                (Some(_), _) => {
                    return Err(Error::InvalidArgument {
                        what: "wave cache",
                        message: "an arena layer takes an arena cache, a layer of its own rows its own table".into(),
                    })
                }
            }
        }
        Ok(())
    }

    /// The launches of one step on `main` and `side` (the estimation), checked by
    /// [`GpuBackend::check_steps`]; `phase_done` runs after each phase's launches are enqueued.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    #[allow(clippy::too_many_arguments, reason = "a step's streams and its four parts")]
    fn wave_step(
        &self,
        main: &Arc<CudaStream>,
        side: &Arc<CudaStream>,
        wave: &DeviceWave,
        kv: KvPointers,
        cache: Option<WaveCache<'_>>,
        job: &mut WaveJob,
        phase_done: &mut dyn FnMut(&'static str, &CudaStream) -> Result<()>,
    ) -> Result<()> {
        self.step_inputs(main, wave, job)?;
        let mark = device_address(&job.mark, main);
        self.launch_select_marking(main, &wave.cent, &mut job.select, mark)?;
        phase_done("select", main)?;
        self.launch_estimation(main, side, wave, job)?;
        phase_done("estimation", side)?;
        let c = self.cache_args(cache);
        let hack = match &wave.groups {
            Some(groups) => {
                // The retrieved clusters as pieces of value blocks, attended homomorphically;
                // the row list below is then the steady zone alone.
                self.launch_hack_pieces(main, wave, groups, &c, kv, job)?;
                phase_done("row list", main)?;
                self.launch_hack_attention(main, groups, job)?;
                phase_done("2-bit attention", main)?;
                job.hack.as_ref().map(|h| (device_address(&h.part, main), h.chunks))
            }
            None => None,
        };
        let r = if wave.groups.is_some() { 0 } else { job.select.r as i32 };
        self.launch_row_list(main, wave, &c, r, job)?;
        if hack.is_none() {
            phase_done("row list", main)?;
        }
        let steady = match &wave.arena {
            Some(a) => (c.rows, device_address(&a.keys, main), device_address(&a.values, main)),
            None => NO_STEADY,
        };
        let head_stride = if wave.arena.is_some() { 0 } else { (kv.rows * self.head_dim) as i64 };
        self.launch_attn(main, (kv.keys, kv.values, head_stride), (c.keys, c.values), steady, &mut job.decode)?;
        phase_done("attention", main)?;
        main.join(side).map_err(gpu_err("ordering the streams"))?;
        let sh = job.decode.shape;
        let lse = device_address(&job.decode.lse, main);
        let est = (device_address(&job.est_part, main), job.est_chunks);
        // The output and the flagged selection go to the job's mailboxes (job_io: q_heads ×
        // head_dim floats and the flags' ints).
        let copies = super::MailboxCopies {
            out: job.io.out.dev,
            words_src: device_address(&job.flags, main),
            words: job.flags.len(),
            words_dst: job.io.sel.dev,
            io: device_address(&job.io.desc_dev, main),
        };
        let parts = [est, hack.unwrap_or((0, 0))];
        self.launch_merge(main, &sh, &job.decode.part, job.decode.chunks, &mut job.decode.out, lse, parts, copies)?;
        phase_done("merge", main)
    }

    /// The estimation of every cluster the selection did not mark, on `side` once the
    /// selection on `main` is done (it needs nothing else): beside the row list and the
    /// attention.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn launch_estimation(
        &self,
        main: &Arc<CudaStream>,
        side: &Arc<CudaStream>,
        wave: &DeviceWave,
        job: &mut WaveJob,
    ) -> Result<()> {
        let sh = job.decode.shape;
        let n = wave.clusters as i32;
        side.join(main).map_err(gpu_err("ordering the streams"))?;
        let per_cta = job.per_cta as i32;
        let cfg = LaunchConfig {
            grid_dim: (job.est_chunks as u32, sh.kv_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = side.launch_builder(&self.est[sh.group() - 1]);
        let scores = job.select.group_scores.as_ref().expect("a wave job keeps group scores");
        b.arg(scores).arg(&wave.value_means).arg(&wave.log_size).arg(&n).arg(&mut job.mark);
        b.arg(&per_cta).arg(&mut job.est_part);
        // SAFETY: group scores hold q_heads × n floats and mark kv_heads × n ints, both written
        // by this step's selection, which the side stream waits for (each mark is read and
        // cleared by one thread); mean values hold kv_heads × n × head_dim f16, log sizes
        // kv_heads × n; the CTAs write est_part's est_chunks chunks per head, which it was
        // sized for. The previous step's merge read est_part on the main stream before this
        // step's selection, so it is not overwritten early.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching est_partial"))?;
        Ok(())
    }

    /// The row list of the step's attention (`wave_expand`): the steady zone and the `r`
    /// retrieved clusters per head (r = 0: the steady zone alone).
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn launch_row_list(
        &self,
        main: &Arc<CudaStream>,
        wave: &DeviceWave,
        c: &CacheArgs,
        r: i32,
        job: &mut WaveJob,
    ) -> Result<()> {
        let (n, kvh) = (wave.clusters as i32, wave.kv_heads as i32);
        let (indexed, rows) = (wave.indexed as i32, wave.rows as i32);
        let (map, steady_len) = match &wave.arena {
            Some(a) => (device_address(&a.row_map, main), device_address(&a.len, main)),
            None => (0u64, 0u64),
        };
        let (list, list_offsets) = job.decode.rows.as_mut().expect("a wave job has row lists");
        let cfg = LaunchConfig {
            grid_dim: (wave.kv_heads as u32, EXPAND_SPLIT as u32, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = main.launch_builder(&self.expand);
        b.arg(&job.select.out).arg(&r).arg(&wave.offsets).arg(&n).arg(&kvh).arg(&indexed).arg(&rows);
        b.arg(&c.table).arg(&c.block_rows).arg(&c.blocks_per_head).arg(&c.slot_rows);
        b.arg(&map).arg(&steady_len).arg(&c.rows);
        b.arg(&mut job.scan).arg(list).arg(list_offsets).arg(&mut job.flags);
        // SAFETY: out holds r ≤ select.r distinct cluster ids < n per head (select_scored),
        // offsets kv_heads × (n + 1) increasing row bounds ≤ indexed, so each head's list has
        // at most steady + r × largest entries ≤ the capacity allocated per head (steady only
        // for a 2-bit layer, which passes r = 0; an arena layer's steady length ≤ its
        // capacity, set_steady); the table (checked above, or the arena cache's owner's claim)
        // names cache rows < the cache's rows; an arena layer's row map holds kv_heads ×
        // indexed rows < the arena's (check_steps); scan holds kv_heads × EXPAND_SPLIT ×
        // (select.r + 1) (one slice per CTA) and flags at least kv_heads × select.r.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching wave_expand"))?;
        Ok(())
    }

    /// A step's first launch (`step_ingest`): the job's queries from its mapped pinned buffer
    /// into the device buffers the kernels read, and an arena layer's steady rows staged since
    /// the last step.
    #[allow(unsafe_code, reason = "kernel launches take raw addresses")]
    fn step_inputs(&self, main: &Arc<CudaStream>, wave: &DeviceWave, job: &mut WaveJob) -> Result<()> {
        let q_words = (job.decode.shape.query_len() * 4 / 16) as i32;
        let (q_select, q_decode) = (device_address(&job.select.q, main), device_address(&job.decode.q, main));
        // Enough CTAs that every thread copies one 16-byte word of the queries: one round trip
        // over PCIe.
        let ctas = (q_words as u32).div_ceil(256).max(1);
        let cfg = LaunchConfig { grid_dim: (ctas, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (sk, sv, marks, k, v, len, row_words) = match &wave.arena {
            Some(a) => {
                let half = (a.capacity * wave.kv_heads * self.head_dim * 2) as u64;
                let row_words = (wave.kv_heads * self.head_dim * 2 / 16) as i32;
                let at = |x: &CudaSlice<u16>| device_address(x, main);
                let len = device_address(&a.len, main);
                (a.stage.dev, a.stage.dev + half, a.marks.dev, at(&a.keys), at(&a.values), len, row_words)
            }
            None => (0, 0, 0, 0, 0, 0, 0),
        };
        // A 2-bit layer's queries in 8 bits for hack_arena; none otherwise.
        let (q8, qmeta) = match &job.hack {
            Some(h) => (device_address(&h.q8, main), device_address(&h.qmeta, main)),
            None => (0u64, 0u64),
        };
        let mut b = main.launch_builder(&self.ingest);
        b.arg(&job.io.q.dev).arg(&q_select).arg(&q_decode).arg(&q_words);
        b.arg(&job.io.desc.dev).arg(&mut job.io.desc_dev).arg(&job.io.status.dev);
        b.arg(&sk).arg(&sv).arg(&marks).arg(&k).arg(&v).arg(&len).arg(&row_words).arg(&q8).arg(&qmeta);
        // SAFETY: the query source is the job's mapped pinned buffer of query_len floats (alive
        // as long as the job; a graph replaying this launch is kept by the job or by a batch
        // whose key holds its address), both device buffers hold query_len floats, and
        // query_len · 4 bytes is a multiple of 16 (head_dim is a multiple of 32); one thread
        // per 16-byte word. The descriptor (mapped, IO_DESC_WORDS), its device copy
        // (IO_DEV_WORDS) and the status (mapped, two ints) are the job's; a non-zero query
        // address in the descriptor names query_len readable elements of its type and its
        // output as many writable ones (launch_wave_lane_io's contract). For an arena
        // layer the staging (mapped, 2 × capacity rows of kv_heads × head_dim f16, whose row
        // size is a multiple of 16 bytes) and the device zone have the same layout; the marks
        // hold [length ≤ capacity, first changed row] (set_steady checks both), so every
        // copied word is inside both; the length int is the zone's. Otherwise marks is 0 and
        // no steady pointer is read. For a 2-bit layer q8 and qmeta are the job's buffers of
        // query_len / 4 words and query_len / 64 × 3 floats (hack_buffers; head_dim is a
        // multiple of 64 there), else 0.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching step_ingest"))?;
        Ok(())
    }

    /// Waits for the step and returns its output (`q_heads × head_dim`).
    pub fn fetch_wave(&self, job: &WaveJob) -> Result<Vec<f32>> {
        // A step launched on a batch lane is not ordered before the backend's stream copy.
        job.io.wait_shared()?;
        self.fetch(&job.decode)
    }

    /// The clusters the last step retrieved per KV head (unordered).
    pub fn wave_selection(&self, job: &WaveJob) -> Result<Vec<Vec<u32>>> {
        job.io.wait_shared()?;
        self.fetch_select(&job.select)
    }
}

#[cfg(test)]
mod tests {
    use super::WaveFetched;

    #[test]
    fn flagged_words_decode_to_the_selection_its_misses_and_the_real_counts() {
        // Head 0: 16 retrieved, 3 missed (2, 5, 13), all real (20 real clusters). Head 1
        // (10 real clusters): 12 and 15 are the padding of a shorter head (15 flagged missed),
        // one real miss (9).
        let mut flagged: Vec<i32> = (0..16).map(|c| if [2, 5, 13].contains(&c) { !c } else { c }).collect();
        flagged.extend([1, 2, !9, 12, !15]);
        let fetched = WaveFetched { output: Vec::new(), flagged, per_head: 16, blocks: Vec::new(), blocks_per_head: 0 };
        assert_eq!(fetched.selection(), vec![(0..16).collect::<Vec<u32>>(), vec![1, 2, 9, 12, 15]]);
        assert_eq!(fetched.missed(), vec![vec![2, 5, 13], vec![9, 15]]);
        assert_eq!(fetched.count_real(&[20, 10]), (16 + 3, 3 + 1));
        // A head with no real clusters counts nothing.
        assert_eq!(fetched.count_real(&[20]), (16, 3));
    }
}
