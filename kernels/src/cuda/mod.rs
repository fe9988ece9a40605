//! The CUDA backend (feature `cuda`): decode attention kernels compiled at run time by NVRTC
//! for the device's architecture (PTX cached on disk, keyed by a hash of the source and the
//! compile options), launched through cudarc with dynamic loading, so building needs no
//! CUDA and a machine without a GPU gets a typed error, not a crash.
//!
//! What is here: exact and row-list (sparse plan) decode attention, flash-decoding style
//! (`decode.cu`), over KV in device memory or in mapped pinned host memory (zero-copy), with
//! Gpu-tier cache rows; centroid scoring and top-r selection; the HACK 2-bit kernels
//! (`hack.cu`); the kv43 homomorphic decode (`kv43.cu`, [`GpuBackend::launch_kv43`]); and
//! a whole wave-index decode step with no host work between its kernels (`wave.cu`,
//! [`GpuBackend::launch_wave`]); the whole index build on the device — centring,
//! segmented spherical k-means on the tensor cores and the layout (`build.cu`,
//! [`GpuBackend::build_layout`]).

use crate::error::{Error, Result};
use crate::shape::AttnShape;
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::sync::Arc;

mod blocks;
mod build;
mod hack;
mod kv43;
mod wave;
pub use blocks::{CudaBlock, CudaBlocks};
pub use build::{DeviceLayout, MAX_SEGMENT_CLUSTERS};
pub use hack::{DeviceHack, DevicePages, HackJob, PagedGroup, MAX_PAGES};
pub use kv43::{DeviceKv43, Kv43Job, Kv43SideRows};
pub use wave::{
    ArenaCache, DeviceIo, DeviceWave, IoDType, StreamMark, WaveBatch, WaveCache, WaveFetched, WaveJob, WaveStep,
    WaveTable,
};

const SOURCE: &str = concat!(
    include_str!("decode.cu"),
    include_str!("hack.cu"),
    include_str!("kv43.cu"),
    include_str!("wave.cu"),
    include_str!("hack_wave.cu"),
    include_str!("build.cu"),
    include_str!("io.cu")
);
/// CTAs a launch aims for: enough to keep every SM busy with several CTAs, so the
/// latency of each row's load is hidden (an H100 has 132 SMs), few enough that the merge
/// has not too many chunks to fold.
const TARGET_CTAS: usize = 1024;

/// Rows per CTA: a power of two in 16..=1024 that gives about [`TARGET_CTAS`] CTAs.
fn chunk_rows(longest: usize, kv_heads: usize) -> usize {
    (longest * kv_heads).div_ceil(TARGET_CTAS).next_power_of_two().clamp(16, 1024)
}
/// `attn_partial`'s steady-buffer arguments when there is none: every cache row is below
/// `cache_rows`.
const NO_STEADY: (i32, u64, u64) = (i32::MAX, 0, 0);

/// The rows one `attn_partial` launch reads (device addresses; 0 for what is absent).
#[derive(Clone, Copy)]
struct AttnRows {
    /// Keys, values and the elements between KV heads.
    kv: (u64, u64, i64),
    /// The row list and its per-KV-head offsets (`kv_heads + 1`), or the list with offsets 0
    /// (one list of `identity` entries shared by every KV head), or (0, 0): rows `0..identity`.
    list: (u64, u64),
    identity: usize,
    /// Rows per CTA.
    chunk: usize,
    /// CTAs (partials) per KV head.
    chunks: usize,
    /// Gpu-tier cache keys and values, and the cache rows before the steady buffer's.
    cache: (u64, u64, i32),
    /// The device-resident steady buffer's keys and values.
    steady: (u64, u64),
}

/// The largest GQA group the compiled kernels hold in registers.
pub const MAX_GROUP: usize = 8;

fn gpu_err(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Gpu { what, message: e.to_string() }
}

/// A GPU, its stream and the compiled decode kernels for one head dimension.
pub struct GpuBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// A second stream: a wave step's estimation runs on it beside the row list and the
    /// attention.
    side: Arc<CudaStream>,
    /// `attn_partial_g{G}` for G = 1..=MAX_GROUP (index G − 1).
    partial: Vec<CudaFunction>,
    merge: CudaFunction,
    admit: CudaFunction,
    /// Scores every centroid and counts the first radix level (`score_hist`).
    score_hist: CudaFunction,
    /// Finishes the radix select from that count (`select_scored`).
    select_scored: CudaFunction,
    /// Over more scores per head than one CTA keeps in registers: candidates at or above the
    /// r-th score's first-level bin (`select_filter`), then the select over them
    /// (`select_candidates`).
    select_filter: CudaFunction,
    select_candidates: CudaFunction,
    expand: CudaFunction,
    ingest: CudaFunction,
    /// The caller's device tensors read into a step and written from it (`io.cu`).
    io_import: CudaFunction,
    io_export: CudaFunction,
    /// `est_partial_g{G}` for G = 1..=MAX_GROUP (index G − 1).
    est: Vec<CudaFunction>,
    /// The whole index build on the device (`build.cu`).
    build: BuildKernels,
    /// The hack2 kernels (compiled for head dimensions that are a multiple of 64).
    /// `hack_partial_g{G}` and `hack_paged_g{G}` for G = 1..=MAX_GROUP (index G − 1).
    hack_partial: Option<Vec<CudaFunction>>,
    hack_paged: Option<Vec<CudaFunction>>,
    hack_dequant: Option<CudaFunction>,
    /// The 2-bit wave step's kernels (`hack_wave.cu`), with the hack2 kernels.
    hack_wave: Option<HackWaveKernels>,
    /// The kv43 kernels (`kv43.cu`, head dimensions that are a multiple of 64):
    /// `kv43_partial_g{G}` for G = 1..=MAX_GROUP (index G − 1).
    kv43_partial: Option<Vec<CudaFunction>>,
    head_dim: usize,
    /// The host buffer [`GpuBackend::upload_f32`] narrows a layer into, kept between calls:
    /// a 128K-token layer of 8 KV heads of 128 dimensions is 512 MiB of f16, and new memory
    /// for each layer of a long prompt would fault every page of it in (`docs/python.md`,
    /// "Ingest"). It keeps the largest layer uploaded until the backend is dropped.
    narrowed: std::sync::Mutex<Vec<u16>>,
}

/// `hack_arena_g{G}` for G = 1..=MAX_GROUP (index G − 1) and `hack_expand`.
struct HackWaveKernels {
    arena: Vec<CudaFunction>,
    expand: CudaFunction,
}

/// The kernels of [`GpuBackend::build_layout`], in the order it launches them.
struct BuildKernels {
    mean: CudaFunction,
    unit: CudaFunction,
    init: CudaFunction,
    assign: CudaFunction,
    rank: CudaFunction,
    centroids: CudaFunction,
    gather: CudaFunction,
    means: CudaFunction,
}

/// Cluster centroids (the meta index) of every KV head in device memory, f16.
pub struct DeviceCentroids {
    data: CudaSlice<u16>,
    per_head: usize,
}

/// Buffers of one scoring + top-r launch.
pub struct SelectJob {
    q: CudaSlice<f32>,
    scores: CudaSlice<f32>,
    out: CudaSlice<i32>,
    /// The first radix level's histogram of each head's scores (`[h][2048]`), counted while
    /// scoring and cleared by the select that reads it.
    hist0: CudaSlice<u32>,
    /// Every query head's score of every centroid (`[h][g][n]`), kept for a wave step's
    /// estimation zone.
    group_scores: Option<CudaSlice<f32>>,
    /// With more than [`SELECT_IN_REGISTERS`] scores per head: each head's candidates
    /// (`[h][n]` score indices) and their counts (`[h]`, zero between steps).
    candidates: Option<(CudaSlice<i32>, CudaSlice<u32>)>,
    r: usize,
    shape: AttnShape,
}

/// Threads of a select CTA (`select_scored`, `select_candidates`).
const SELECT_THREADS: usize = 1024;

/// Scores each select thread keeps in registers (`RADIX_REGS` in `decode.cu`, defined from
/// this when the module is compiled).
const RADIX_REGS: usize = 8;

/// Scores per head that one select CTA keeps in registers; past it the select first filters
/// candidates with many CTAs per head.
const SELECT_IN_REGISTERS: usize = SELECT_THREADS * RADIX_REGS;

/// One entry of a sparse plan's row list on the GPU: a row of the layer's KV (wherever it
/// lives: device or mapped host memory), or a slot of the Gpu-tier cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowRef {
    /// Row of the KV head.
    Kv(u32),
    /// Slot of the [`GpuCache`] (one row per slot).
    Cache(u32),
}

/// The Gpu tier's block pool for decode: `slots` rows of keys and values in device memory.
pub struct GpuCache {
    keys: CudaSlice<u16>,
    values: CudaSlice<u16>,
    slots: usize,
}

impl GpuCache {
    /// Rows it holds.
    pub fn slots(&self) -> usize {
        self.slots
    }
}

/// Where a layer's KV lives for a launch: device pointers to f16 keys and values laid out
/// `kv_heads × rows × head_dim`.
#[derive(Debug, Clone, Copy)]
pub struct KvPointers {
    /// Keys.
    pub keys: u64,
    /// Values.
    pub values: u64,
    /// Rows per head (elements between heads = rows × head_dim).
    pub rows: usize,
}

/// Rows addressed by one index for all KV heads (no head stride): K row `i` at
/// `keys + i·head_dim`, its V row at `values + i·head_dim`. The buffer manager's blocks
/// (`[K × R][V × R]`) in its pinned arena or its device Gpu tier are such rows, with
/// `values = keys + R rows` and row `slot·2R + r`.
#[derive(Debug, Clone, Copy)]
pub struct SharedRows {
    /// Device address of row 0's keys.
    pub keys: u64,
    /// Device address of row 0's values.
    pub values: u64,
    /// Rows addressable (a row list entry must be below it).
    pub rows: usize,
}

/// KV of one layer copied to device memory.
pub struct DeviceKv {
    keys: CudaSlice<u16>,
    values: CudaSlice<u16>,
    rows: usize,
}

/// KV of one layer in pinned host memory mapped into the device's address space: kernels
/// read it over PCIe directly, block by block, with no copies issued.
pub struct MappedKv {
    keys: PinnedHostSlice<u16>,
    values: PinnedHostSlice<u16>,
    key_ptr: u64,
    value_ptr: u64,
    rows: usize,
}

/// Buffers of one decode launch: queries, the row lists of a sparse plan, partials, output.
pub struct DecodeJob {
    q: CudaSlice<f32>,
    rows: Option<(CudaSlice<i32>, CudaSlice<i32>)>,
    part: CudaSlice<f32>,
    out: CudaSlice<f32>,
    /// Per query head, `m + ln l` of the merged partial (see `attn_merge`).
    lse: CudaSlice<f32>,
    /// Partials per KV head in `part`: the attention launch's CTAs per KV head, and what the
    /// merge folds.
    chunks: usize,
    chunk: usize,
    identity_rows: usize,
    cache_slots: usize,
    shape: AttnShape,
    scale: f32,
}

impl GpuBackend {
    /// Opens GPU 0 and compiles (or loads from the on-disk cache) the kernels for
    /// `head_dim`, which must be a multiple of 32 up to 256.
    #[allow(
        unsafe_code,
        reason = "the driver library is probed, and cudarc's event tracking turned off, by unsafe calls"
    )]
    pub fn new(head_dim: usize) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(32) || head_dim > 256 {
            return Err(Error::InvalidArgument {
                what: "head_dim",
                message: format!("the GPU kernels take a multiple of 32 up to 256, got {head_dim}"),
            });
        }
        // SAFETY: loading the driver library runs only its initializers, as cudarc's own
        // first call does (which panics where there is none: a machine without a GPU).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::Gpu {
                what: "opening GPU 0",
                message: "the CUDA driver library could not be loaded".into(),
            });
        }
        let ctx = CudaContext::new(0).map_err(gpu_err("opening GPU 0"))?;
        // SAFETY: called before this context allocates anything. Every buffer of this backend
        // is allocated on `stream`, used on it or on streams that `stream` joins before the
        // launch that used them returns (the wave step's side stream and batch lanes), and
        // freed stream-ordered on it, so cudarc's per-buffer events add nothing but host
        // calls (a wait and a record per kernel argument) — and they would forbid capturing a
        // step into a graph.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(gpu_err("creating a stream"))?;
        let side = stream.fork().map_err(gpu_err("creating a stream"))?;
        let (major, minor) = ctx.compute_capability().map_err(gpu_err("reading the compute capability"))?;
        let ptx = compiled(head_dim, major, minor)?;
        let module = ctx.load_module(ptx).map_err(gpu_err("loading the decode module"))?;
        let per_group = |name: &str| {
            (1..=MAX_GROUP)
                .map(|g| module.load_function(&format!("{name}_g{g}")))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(gpu_err("loading a per-group kernel"))
        };
        let partial = per_group("attn_partial")?;
        let merge = module.load_function("attn_merge").map_err(gpu_err("attn_merge"))?;
        let admit = module.load_function("admit_rows").map_err(gpu_err("admit_rows"))?;
        let score_hist = module.load_function("score_hist").map_err(gpu_err("score_hist"))?;
        let select_scored = module.load_function("select_scored").map_err(gpu_err("select_scored"))?;
        let select_filter = module.load_function("select_filter").map_err(gpu_err("select_filter"))?;
        let select_candidates = module.load_function("select_candidates").map_err(gpu_err("select_candidates"))?;
        let expand = module.load_function("wave_expand").map_err(gpu_err("wave_expand"))?;
        let ingest = module.load_function("step_ingest").map_err(gpu_err("step_ingest"))?;
        let est = per_group("est_partial")?;
        let io_import = module.load_function("io_import").map_err(gpu_err("io_import"))?;
        let io_export = module.load_function("io_export").map_err(gpu_err("io_export"))?;
        let load = |name: &'static str| module.load_function(name).map_err(gpu_err(name));
        let build = BuildKernels {
            mean: load("lay_mean")?,
            unit: load("lay_unit")?,
            init: load("lay_init")?,
            assign: load("lay_assign")?,
            rank: load("lay_rank")?,
            centroids: load("lay_centroids")?,
            gather: load("lay_gather")?,
            means: load("lay_means")?,
        };
        let (hack_partial, hack_paged, hack_dequant, hack_wave) = if head_dim.is_multiple_of(64) {
            (
                Some(per_group("hack_partial")?),
                Some(per_group("hack_paged")?),
                Some(load("hack_dequant")?),
                Some(HackWaveKernels { arena: per_group("hack_arena")?, expand: load("hack_expand")? }),
            )
        } else {
            (None, None, None, None)
        };
        let kv43_partial = if head_dim.is_multiple_of(64) { Some(per_group("kv43_partial")?) } else { None };
        Ok(Self {
            ctx,
            stream,
            side,
            partial,
            merge,
            admit,
            score_hist,
            select_scored,
            select_filter,
            select_candidates,
            expand,
            ingest,
            io_import,
            io_export,
            est,
            build,
            hack_partial,
            hack_paged,
            hack_dequant,
            hack_wave,
            kv43_partial,
            head_dim,
            narrowed: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown GPU".into())
    }

    /// The head dimension the kernels were compiled for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The stream every launch of this backend goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Copies f16 keys and values (`kv_heads × rows × head_dim`, as bits) to device memory.
    pub fn upload(&self, keys: &[u16], values: &[u16], kv_heads: usize) -> Result<DeviceKv> {
        let rows = self.rows_of(keys, values, kv_heads)?;
        let k = self.stream.clone_htod(keys).map_err(gpu_err("copying keys"))?;
        let v = self.stream.clone_htod(values).map_err(gpu_err("copying values"))?;
        Ok(DeviceKv { keys: k, values: v, rows })
    }

    /// [`GpuBackend::upload`] of f32 keys and values, narrowed to f16 on host threads first
    /// (how a layer that arrives in host memory reaches the device build), into a buffer the
    /// backend keeps between calls; concurrent calls take turns.
    pub fn upload_f32(&self, keys: &[f32], values: &[f32], kv_heads: usize) -> Result<DeviceKv> {
        use rayon::prelude::*;
        let mut narrowed = self.narrowed.lock().unwrap_or_else(|e| e.into_inner());
        narrowed.clear();
        narrowed.par_extend(keys.par_iter().chain(values.par_iter()).map(|&v| half::f16::from_f32(v).to_bits()));
        let (k, v) = narrowed.split_at(keys.len());
        self.upload(k, v, kv_heads)
    }

    /// Copies f16 keys and values into mapped pinned host memory.
    pub fn pin(&self, keys: &[u16], values: &[u16], kv_heads: usize) -> Result<MappedKv> {
        let rows = self.rows_of(keys, values, kv_heads)?;
        let mut k = self.alloc_mapped(keys.len())?;
        let mut v = self.alloc_mapped(values.len())?;
        k.as_mut_slice().map_err(gpu_err("writing pinned keys"))?.copy_from_slice(keys);
        v.as_mut_slice().map_err(gpu_err("writing pinned values"))?.copy_from_slice(values);
        let key_ptr = mapped_device_pointer(&mut k)?;
        let value_ptr = mapped_device_pointer(&mut v)?;
        Ok(MappedKv { keys: k, values: v, key_ptr, value_ptr, rows })
    }

    fn rows_of(&self, keys: &[u16], values: &[u16], kv_heads: usize) -> Result<usize> {
        let per_row = kv_heads * self.head_dim;
        if kv_heads == 0 || !keys.len().is_multiple_of(per_row) || values.len() != keys.len() {
            return Err(Error::ShapeMismatch {
                what: "keys/values (kv_heads × rows × head_dim, equal lengths)",
                expected: keys.len() / per_row.max(1) * per_row,
                got: values.len(),
            });
        }
        Ok(keys.len() / per_row)
    }

    /// Page-locked host memory for `len` elements (at least one) allocated with `flags`
    /// (`CU_MEMHOSTALLOC_*`), zeroed.
    #[allow(unsafe_code, reason = "cudarc's pinned allocation leaves the memory unset")]
    fn pinned_zeroed<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Default + Copy>(
        &self,
        flags: u32,
        len: usize,
    ) -> Result<PinnedHostSlice<T>> {
        // SAFETY: zero-filled below before any read; T is valid as zero bits.
        let mut host = unsafe { self.ctx.alloc_pinned_with_flags::<T>(len.max(1), flags) }
            .map_err(gpu_err("allocating pinned memory"))?;
        host.as_mut_slice().map_err(gpu_err("allocating pinned memory"))?.fill(T::default());
        Ok(host)
    }

    #[allow(unsafe_code, reason = "pinned, device-mapped host allocation")]
    fn alloc_mapped(&self, len: usize) -> Result<PinnedHostSlice<u16>> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: the allocation is fully overwritten (copy_from_slice) before any read, and
        // u16 has no invalid bit patterns.
        unsafe { self.ctx.alloc_pinned_with_flags::<u16>(len, flags) }.map_err(gpu_err("allocating pinned memory"))
    }

    /// Prepares a decode of queries `q` (`q_heads × head_dim`) over all rows
    /// (`rows = None`) or over a row list per KV head (a sparse plan's attended rows).
    pub fn prepare(
        &self,
        shape: &AttnShape,
        q: &[f32],
        identity_rows: usize,
        rows: Option<&[Vec<u32>]>,
    ) -> Result<DecodeJob> {
        let lists = rows.map(|l| l.iter().map(|r| r.iter().map(|&x| RowRef::Kv(x)).collect()).collect::<Vec<Vec<_>>>());
        self.prepare_refs(shape, q, identity_rows, lists.as_deref(), 0)
    }

    /// [`GpuBackend::prepare`] with row lists that mix KV rows and Gpu-tier cache slots
    /// (`cache_slots` = slots of the cache the job will be launched with).
    pub fn prepare_refs(
        &self,
        shape: &AttnShape,
        q: &[f32],
        identity_rows: usize,
        rows: Option<&[Vec<RowRef>]>,
        cache_slots: usize,
    ) -> Result<DecodeJob> {
        if shape.head_dim != self.head_dim || shape.group() > MAX_GROUP {
            return Err(Error::InvalidArgument {
                what: "shape",
                message: format!(
                    "compiled for head_dim {} and groups up to {MAX_GROUP}; got head_dim {} group {}",
                    self.head_dim,
                    shape.head_dim,
                    shape.group()
                ),
            });
        }
        if q.len() != shape.query_len() {
            return Err(Error::ShapeMismatch {
                what: "queries (q_heads × head_dim)",
                expected: shape.query_len(),
                got: q.len(),
            });
        }
        if identity_rows > i32::MAX as usize || cache_slots > i32::MAX as usize {
            return Err(Error::InvalidArgument {
                what: "rows",
                message: "at most 2^31 − 1 rows per head and cache slots".into(),
            });
        }
        let s = &self.stream;
        let (lists, longest) = match rows {
            None => (None, identity_rows),
            Some(lists) => {
                if lists.len() != shape.kv_heads {
                    return Err(Error::ShapeMismatch {
                        what: "row lists (one per KV head)",
                        expected: shape.kv_heads,
                        got: lists.len(),
                    });
                }
                let mut offsets = vec![0i32];
                let mut flat = Vec::new();
                for l in lists {
                    for &r in l {
                        flat.push(match r {
                            RowRef::Kv(x) if (x as usize) < identity_rows => x as i32,
                            RowRef::Cache(x) if (x as usize) < cache_slots => -(x as i32) - 1,
                            bad => {
                                return Err(Error::InvalidArgument {
                                    what: "row list",
                                    message: format!(
                                    "{bad:?} is beyond the {identity_rows} rows of a head / {cache_slots} cache slots"
                                ),
                                })
                            }
                        });
                    }
                    offsets.push(flat.len() as i32);
                }
                flat.push(0); // never empty: a zero-length device buffer cannot be allocated
                let f = s.clone_htod(&flat).map_err(gpu_err("copying row lists"))?;
                let o = s.clone_htod(&offsets).map_err(gpu_err("copying row offsets"))?;
                (Some((f, o)), lists.iter().map(Vec::len).max().unwrap_or(0))
            }
        };
        let chunk = chunk_rows(longest, shape.kv_heads);
        let chunks = longest.div_ceil(chunk).max(1);
        let part_len = shape.kv_heads * chunks * shape.group() * (self.head_dim + 2);
        Ok(DecodeJob {
            q: s.clone_htod(q).map_err(gpu_err("copying queries"))?,
            rows: lists,
            part: s.alloc_zeros::<f32>(part_len).map_err(gpu_err("allocating partials"))?,
            out: s.alloc_zeros::<f32>(shape.query_len()).map_err(gpu_err("allocating the output"))?,
            lse: s.alloc_zeros::<f32>(shape.q_heads).map_err(gpu_err("allocating the output"))?,
            chunks,
            chunk,
            identity_rows,
            cache_slots,
            shape: *shape,
            scale: 1.0 / (shape.head_dim as f32).sqrt(),
        })
    }

    /// Copies centroids (`kv_heads × n × head_dim`, f16 bits) to device memory.
    pub fn upload_centroids(&self, centroids: &[u16], kv_heads: usize) -> Result<DeviceCentroids> {
        let per_head = self.rows_of(centroids, centroids, kv_heads)?;
        let data = self.stream.clone_htod(centroids).map_err(gpu_err("copying centroids"))?;
        Ok(DeviceCentroids { data, per_head })
    }

    /// Prepares scoring every centroid against the group's queries (best head) and picking
    /// the `r` best per KV head.
    pub fn prepare_select(&self, shape: &AttnShape, q: &[f32], cent: &DeviceCentroids, r: usize) -> Result<SelectJob> {
        if q.len() != shape.query_len() || shape.head_dim != self.head_dim {
            return Err(Error::ShapeMismatch {
                what: "queries (q_heads × head_dim)",
                expected: shape.query_len(),
                got: q.len(),
            });
        }
        if r == 0 || r > cent.per_head {
            return Err(Error::InvalidArgument {
                what: "r",
                message: format!("must be in 1..={} (centroids per head), got {r}", cent.per_head),
            });
        }
        let s = &self.stream;
        let h = shape.kv_heads;
        let alloc_f = |n: usize| s.alloc_zeros::<f32>(n).map_err(gpu_err("allocating selection buffers"));
        let alloc_i = |n: usize| s.alloc_zeros::<i32>(n).map_err(gpu_err("allocating selection buffers"));
        Ok(SelectJob {
            q: s.clone_htod(q).map_err(gpu_err("copying queries"))?,
            scores: alloc_f(h * cent.per_head)?,
            out: alloc_i(h * r)?,
            hist0: s.alloc_zeros::<u32>(h * 2048).map_err(gpu_err("allocating selection buffers"))?,
            group_scores: None,
            candidates: if cent.per_head > SELECT_IN_REGISTERS {
                let counts = s.alloc_zeros::<u32>(h).map_err(gpu_err("allocating selection buffers"))?;
                Some((alloc_i(h * cent.per_head)?, counts))
            } else {
                None
            },
            r,
            shape: *shape,
        })
    }

    /// Enqueues centroid scoring and the per-head top-r selection: one pass scores every
    /// centroid and counts the first level of a radix select on the way, and one CTA per head
    /// finishes the exact radix select over all the head's scores (no sort).
    pub fn launch_select(&self, cent: &DeviceCentroids, job: &mut SelectJob) -> Result<()> {
        self.launch_select_marking(&self.stream, cent, job, 0)
    }

    /// [`GpuBackend::launch_select`] that also sets `mark[h][c] = 1` for every selected
    /// cluster `c` of head `h` (`mark`: a device address of kv_heads × n ints, or 0: none).
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn launch_select_marking(
        &self,
        stream: &Arc<CudaStream>,
        cent: &DeviceCentroids,
        job: &mut SelectJob,
        mark: u64,
    ) -> Result<()> {
        let sh = job.shape;
        let (n, r) = (cent.per_head as i32, job.r as i32);
        let scale = 1.0 / (sh.head_dim as f32).sqrt();
        let group = sh.group() as i32;
        // One thread per centroid.
        let cfg = LaunchConfig {
            grid_dim: (cent.per_head.div_ceil(256) as u32, sh.kv_heads as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&self.score_hist);
        b.arg(&cent.data).arg(&n).arg(&job.q).arg(&scale).arg(&group).arg(&mut job.scores);
        let group_scores = job.group_scores.as_ref().map_or(0, |g| device_address(g, stream));
        b.arg(&group_scores).arg(&mut job.hist0);
        // SAFETY: cent holds kv_heads × n × head_dim f16 values and q the group queries of
        // every head (checked in prepare_select); one thread per centroid (< n) writes its
        // score (scores: kv_heads × n) and its group's scores (when kept: kv_heads × group ×
        // n); the histogram holds kv_heads × 2048 counters.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching score_hist"))?;
        let cfg = LaunchConfig {
            grid_dim: (sh.kv_heads as u32, 1, 1),
            block_dim: (SELECT_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        if let Some((cand, counts)) = job.candidates.as_mut() {
            // Four scores per thread of 256-thread CTAs.
            let filter = LaunchConfig {
                grid_dim: (cent.per_head.div_ceil(1024) as u32, sh.kv_heads as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = stream.launch_builder(&self.select_filter);
            b.arg(&job.scores).arg(&n).arg(&r).arg(&job.hist0).arg(&mut *cand).arg(&mut *counts);
            // SAFETY: reads kv_heads × n scores and kv_heads × 2048 counters; appends at most n
            // indices per head to cand (kv_heads × n) through its head's counter (zero on entry:
            // allocated zeroed, cleared by select_candidates).
            unsafe { b.launch(filter) }.map_err(gpu_err("launching select_filter"))?;
            let mut b = stream.launch_builder(&self.select_candidates);
            b.arg(&job.scores).arg(&n).arg(&r).arg(&mut job.hist0).arg(&*cand).arg(&mut *counts);
            b.arg(&mut job.out).arg(&mark);
            // SAFETY: reads each head's counted candidates (indices < n, at least r of them:
            // the filter's bin holds the r-th score), writes r indices per head to out
            // (kv_heads × r), clears the head's counters; mark (when given) holds kv_heads × n.
            unsafe { b.launch(cfg) }.map_err(gpu_err("launching select_candidates"))?;
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.select_scored);
        b.arg(&job.scores).arg(&n).arg(&r).arg(&mut job.hist0).arg(&mut job.out).arg(&mark);
        // SAFETY: reads the n scores and the 2048 counters of each head (zeroing the
        // counters), writes exactly r indices < n per head (1 ≤ r ≤ n, checked in
        // prepare_select); mark (when given) holds kv_heads × n ints.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching select_scored"))?;
        Ok(())
    }

    /// The selected centroid indices per KV head (unordered).
    pub fn fetch_select(&self, job: &SelectJob) -> Result<Vec<Vec<u32>>> {
        let out = self.stream.clone_dtoh(&job.out).map_err(gpu_err("copying the selection back"))?;
        Ok(out.chunks(job.r).map(|c| c.iter().map(|&i| i as u32).collect()).collect())
    }

    /// Every centroid's score (best head of the group), `kv_heads × n`, as the job's last
    /// [`GpuBackend::launch_select`] computed and selected over them (for checks).
    pub fn select_scores(&self, job: &SelectJob) -> Result<Vec<f32>> {
        self.stream.clone_dtoh(&job.scores).map_err(gpu_err("copying scores back"))
    }

    /// A Gpu-tier cache of `slots` rows (keys and values) in device memory.
    pub fn cache(&self, slots: usize) -> Result<GpuCache> {
        let n = slots.max(1) * self.head_dim;
        let keys = self.stream.alloc_zeros::<u16>(n).map_err(gpu_err("allocating the cache"))?;
        let values = self.stream.alloc_zeros::<u16>(n).map_err(gpu_err("allocating the cache"))?;
        Ok(GpuCache { keys, values, slots })
    }

    /// Enqueues copies of rows `(kv head, row)` of `kv` into cache slots: the admission of
    /// missed blocks, one warp per row (from mapped host memory this is a zero-copy read).
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub fn admit(&self, kv: KvPointers, cache: &mut GpuCache, entries: &[(u32, u32, u32)]) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        if let Some(bad) = entries.iter().find(|e| e.1 as usize >= kv.rows || e.2 as usize >= cache.slots) {
            return Err(Error::InvalidArgument {
                what: "admission",
                message: format!("{bad:?}: rows < {}, slots < {}", kv.rows, cache.slots),
            });
        }
        let s = &self.stream;
        let col = |f: fn(&(u32, u32, u32)) -> u32| entries.iter().map(|e| f(e) as i32).collect::<Vec<i32>>();
        let heads = s.clone_htod(&col(|e| e.0)).map_err(gpu_err("copying admissions"))?;
        let rows = s.clone_htod(&col(|e| e.1)).map_err(gpu_err("copying admissions"))?;
        let slots = s.clone_htod(&col(|e| e.2)).map_err(gpu_err("copying admissions"))?;
        let n = entries.len() as i32;
        let head_stride = (kv.rows * self.head_dim) as i64;
        let cfg = LaunchConfig {
            grid_dim: ((entries.len() * 32).div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.launch_builder(&self.admit);
        b.arg(&kv.keys).arg(&kv.values).arg(&head_stride).arg(&heads).arg(&rows).arg(&slots).arg(&n);
        b.arg(&mut cache.keys).arg(&mut cache.values);
        // SAFETY: every (head, row) was checked < (kv heads implied by kv, kv.rows) — heads
        // come from the caller's plan over this layer — and every slot < cache.slots; one
        // warp per entry copies head_dim elements of K and V.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching admit_rows"))?;
        Ok(())
    }

    /// Enqueues the two kernels of `job` over `kv` (returns before they finish).
    pub fn launch(&self, kv: KvPointers, job: &mut DecodeJob) -> Result<()> {
        self.launch_cached(kv, None, job)
    }

    /// [`GpuBackend::launch`] for a job whose row lists name Gpu-tier cache slots: hits are
    /// read from `cache` (device memory), misses from `kv`, in the same kernel.
    pub fn launch_cached(&self, kv: KvPointers, cache: Option<&GpuCache>, job: &mut DecodeJob) -> Result<()> {
        if cache.map_or(0, |c| c.slots) < job.cache_slots {
            return Err(Error::InvalidArgument {
                what: "cache",
                message: format!(
                    "the job names {} cache slots, the cache has {}",
                    job.cache_slots,
                    cache.map_or(0, |c| c.slots)
                ),
            });
        }
        if kv.rows < job.identity_rows {
            return Err(Error::InvalidArgument {
                what: "kv",
                message: format!("{} rows per head, the job needs {}", kv.rows, job.identity_rows),
            });
        }
        let (ck, cv) = match cache {
            Some(c) => (device_address(&c.keys, &self.stream), device_address(&c.values, &self.stream)),
            None => (0, 0),
        };
        // `kv` holds kv_heads × rows × head_dim f16 values (a DeviceKv or MappedKv the caller
        // keeps alive until the stream is synchronized); the cache's slots were checked above.
        self.launch_partial((kv.keys, kv.values, (kv.rows * self.head_dim) as i64), (ck, cv), job)
    }

    /// Enqueues `attn_partial` over keys/values at `k`/`v` (`head_stride` elements between
    /// KV heads) and cache rows at `ck`/`cv` (0: none), then the merge. The callers have
    /// checked that every row-list entry addresses memory they keep alive and unchanged until
    /// the stream is synchronized.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn launch_partial(
        &self,
        (k, v, head_stride): (u64, u64, i64),
        (ck, cv): (u64, u64),
        job: &mut DecodeJob,
    ) -> Result<()> {
        self.launch_attn(&self.stream, (k, v, head_stride), (ck, cv), NO_STEADY, job)?;
        let lse = device_address(&job.lse, &self.stream);
        let sh = job.shape;
        self.launch_merge(
            &self.stream,
            &sh,
            &job.part,
            job.chunks,
            &mut job.out,
            lse,
            [(0, 0); 2],
            MailboxCopies::default(),
        )
    }

    /// Enqueues `attn_partial` alone (see [`GpuBackend::launch_partial`]): `chunks` CTAs per
    /// KV head, one partial each.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn launch_attn(
        &self,
        stream: &Arc<CudaStream>,
        (k, v, head_stride): (u64, u64, i64),
        (ck, cv): (u64, u64),
        (cache_rows, sk, sv): (i32, u64, u64),
        job: &mut DecodeJob,
    ) -> Result<()> {
        let (rows, offsets) = match &job.rows {
            Some((f, o)) => (device_address(f, stream), device_address(o, stream)),
            None => (0u64, 0u64),
        };
        let rows = AttnRows {
            kv: (k, v, head_stride),
            list: (rows, offsets),
            identity: job.identity_rows,
            chunk: job.chunk,
            chunks: job.chunks,
            cache: (ck, cv, cache_rows),
            steady: (sk, sv),
        };
        // SAFETY: row-list entries were checked in `prepare_refs` to be < identity_rows or <
        // cache_slots (a wave job's lists are written on the device from checked cluster
        // bounds and cache table, and name steady rows past cache_rows only when sk/sv hold
        // them), and the callers checked those against the memory at k/v, ck/cv and sk/sv;
        // q and part were sized for this shape and `chunks`, the grid's width.
        unsafe { self.launch_attn_rows(stream, &job.shape, &job.q, job.scale, rows, &mut job.part) }
    }

    /// Enqueues `attn_partial_g{G}` over `rows` with queries `q` (`q_heads × head_dim`),
    /// writing `rows.chunks` partials per KV head to `part`.
    ///
    /// # Safety
    /// Every row `rows` names (its list's entries, or `0..identity` without a list, in the
    /// memory its addresses and strides describe) must be readable device memory kept alive
    /// and unchanged until the stream passes the kernel, and `part` must hold `kv_heads ×
    /// chunks × group × (head_dim + 2)` floats.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    unsafe fn launch_attn_rows(
        &self,
        stream: &Arc<CudaStream>,
        sh: &AttnShape,
        q: &CudaSlice<f32>,
        scale: f32,
        rows: AttnRows,
        part: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let AttnRows { kv: (k, v, head_stride), list: (list, offsets), cache: (ck, cv, cache_rows), .. } = rows;
        let (identity, chunk) = (rows.identity as i32, rows.chunk as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows.chunks as u32, sh.kv_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&self.partial[sh.group() - 1]);
        b.arg(&k).arg(&v).arg(&head_stride).arg(q).arg(&scale);
        b.arg(&list).arg(&offsets).arg(&identity).arg(&chunk).arg(part);
        b.arg(&ck).arg(&cv).arg(&cache_rows).arg(&rows.steady.0).arg(&rows.steady.1);
        // SAFETY: the caller's contract (above) for the rows and part; q holds the shape's
        // queries.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching attn_partial"))?;
        Ok(())
    }

    /// Enqueues the log-sum-exp merge of `chunks` partials per query head (`part`, laid out
    /// `[kv_head][chunk][group][head_dim + 2]`) into `out` (`q_heads × head_dim`).
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    #[allow(
        clippy::too_many_arguments,
        reason = "the stream, the shape, three buffers with their sizes and the mailbox copies"
    )]
    fn launch_merge(
        &self,
        stream: &Arc<CudaStream>,
        sh: &AttnShape,
        part: &CudaSlice<f32>,
        chunks: usize,
        out: &mut CudaSlice<f32>,
        lse: u64,
        [(part2, chunks2), (part3, chunks3)]: [(u64, usize); 2],
        copies: MailboxCopies,
    ) -> Result<()> {
        let need = sh.kv_heads * chunks * sh.group() * (self.head_dim + 2);
        if part.len() < need || out.len() < sh.query_len() {
            return Err(Error::ShapeMismatch { what: "merge partials", expected: need, got: part.len() });
        }
        let (chunks, group, chunks2, chunks3) = (chunks as i32, sh.group() as i32, chunks2 as i32, chunks3 as i32);
        let words = copies.words as i32;
        // 32 warps per query head (MERGE_WARPS in decode.cu).
        let cfg = LaunchConfig { grid_dim: (sh.q_heads as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(&self.merge);
        b.arg(part).arg(&chunks).arg(&group).arg(out).arg(&lse).arg(&part2).arg(&chunks2);
        b.arg(&part3).arg(&chunks3).arg(&copies.out);
        b.arg(&copies.words_src).arg(&words).arg(&copies.words_dst).arg(&copies.io);
        // SAFETY: part holds kv_heads × chunks × group partials and out q_heads × head_dim
        // floats (both checked above); part2 and part3 (when not 0) kv_heads × chunks2 (and
        // chunks3) × group partials (the caller's wave job allocated them so); copies.out (when not 0) is the device address
        // of the caller's mapped buffer of q_heads × head_dim floats, and words_src / words_dst
        // (when not 0) of `words` ints each, and io (when not 0) a device descriptor whose
        // output names q_heads × head_dim writable elements of its type or is 0
        // (MailboxCopies' contract); one CTA per query head.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching attn_merge"))?;
        Ok(())
    }

    /// [`GpuBackend::launch_cached`] over [`SharedRows`] (row lists index `kv`'s rows, and
    /// `Cache` entries `cache`'s rows, the same for every KV head): a plan's retrieved blocks
    /// read where the buffer manager keeps them — Gpu-tier hits from device memory, the rest
    /// zero-copy from the pinned arena — in one kernel, without copies.
    pub fn launch_shared(&self, kv: SharedRows, cache: Option<SharedRows>, job: &mut DecodeJob) -> Result<()> {
        let cache_rows = cache.map_or(0, |c| c.rows);
        if job.rows.is_none() || kv.rows < job.identity_rows || cache_rows < job.cache_slots {
            return Err(Error::InvalidArgument {
                what: "shared rows",
                message: format!(
                    "a row-list job over {} rows and {} cache rows needs at least {} and {}",
                    kv.rows, cache_rows, job.identity_rows, job.cache_slots
                ),
            });
        }
        let (ck, cv) = cache.map_or((0, 0), |c| (c.keys, c.values));
        // One address space for every KV head: head stride 0.
        self.launch_partial((kv.keys, kv.values, 0), (ck, cv), job)
    }

    /// Waits for the stream and returns the job's unnormalized partial `(o, m, l)` per query
    /// head (its chunks merged), to be merged with partials computed elsewhere (another
    /// launch, the CPU's estimation zone).
    pub fn fetch_partials(&self, job: &DecodeJob) -> Result<Vec<crate::Partial>> {
        self.merged_partials(&job.out, &job.lse)
    }

    /// The partial `(o, m, l)` per query head of a merge's normalized output `out` and the
    /// log of its denominator `lse`: `(out, lse, 1)` (empty where no row counted).
    fn merged_partials(&self, out: &CudaSlice<f32>, lse: &CudaSlice<f32>) -> Result<Vec<crate::Partial>> {
        let out = self.stream.clone_dtoh(out).map_err(gpu_err("copying the output back"))?;
        let lse = self.stream.clone_dtoh(lse).map_err(gpu_err("copying the output back"))?;
        let d = self.head_dim;
        Ok(lse
            .iter()
            .enumerate()
            .map(|(qh, &m)| {
                if m == f32::NEG_INFINITY {
                    crate::Partial::empty(d)
                } else {
                    crate::Partial { o: out[qh * d..(qh + 1) * d].to_vec(), m, l: 1.0 }
                }
            })
            .collect())
    }

    /// Waits for the stream and copies the output (`q_heads × head_dim`) back.
    pub fn fetch(&self, job: &DecodeJob) -> Result<Vec<f32>> {
        self.stream.clone_dtoh(&job.out).map_err(gpu_err("copying the output back"))
    }

    /// Waits until every launch on the stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(gpu_err("synchronizing"))
    }

    /// Milliseconds the stream spends on `f`'s launches, measured with events.
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        let e0 =
            self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(gpu_err("creating an event"))?;
        let e1 =
            self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(gpu_err("creating an event"))?;
        e0.record(&self.stream).map_err(gpu_err("recording an event"))?;
        f()?;
        e1.record(&self.stream).map_err(gpu_err("recording an event"))?;
        e1.synchronize().map_err(gpu_err("waiting for an event"))?;
        Ok(e0.elapsed_ms(&e1).map_err(gpu_err("reading an event"))? as f64)
    }
}

/// `i32`s in device memory (e.g. the block table of an [`ArenaCache`]).
pub struct DeviceInts {
    data: CudaSlice<i32>,
    address: u64,
}

impl DeviceInts {
    /// Device address of the first element.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

impl GpuBackend {
    /// Copies `values` to device memory (synchronized: usable by any stream's next launch).
    pub fn upload_ints(&self, values: &[i32]) -> Result<DeviceInts> {
        let data = self.stream.clone_htod(values).map_err(gpu_err("copying ints"))?;
        self.stream.synchronize().map_err(gpu_err("synchronizing"))?;
        let address = device_address(&data, &self.stream);
        Ok(DeviceInts { data, address })
    }
}

impl DeviceKv {
    /// Pointers for [`GpuBackend::launch`].
    pub fn pointers(&self, gpu: &GpuBackend) -> KvPointers {
        KvPointers {
            keys: device_address(&self.keys, &gpu.stream),
            values: device_address(&self.values, &gpu.stream),
            rows: self.rows,
        }
    }
}

impl MappedKv {
    /// Pointers for [`GpuBackend::launch`]: device addresses of the mapped host memory.
    pub fn pointers(&self) -> KvPointers {
        KvPointers { keys: self.key_ptr, values: self.value_ptr, rows: self.rows }
    }

    /// Bytes of pinned host memory held (keys and values).
    pub fn bytes(&self) -> usize {
        (self.keys.len() + self.values.len()) * 2
    }
}

fn device_address<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (ptr, _sync) = s.device_ptr(stream);
    ptr
}

#[allow(unsafe_code, reason = "cuMemHostGetDevicePointer is a raw driver call")]
fn mapped_device_pointer<T>(host: &mut PinnedHostSlice<T>) -> Result<u64>
where
    T: cudarc::driver::ValidAsZeroBits,
{
    let p = host.as_mut_ptr().map_err(gpu_err("reading a pinned pointer"))?;
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: `p` is the start of a live allocation made with CU_MEMHOSTALLOC_DEVICEMAP in
    // the current context; the driver writes one device address into `dptr`.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, p as *mut _, 0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Gpu { what: "mapping pinned memory", message: format!("{r:?}") });
    }
    Ok(dptr)
}

/// PTX of the decode module for `head_dim` on compute capability `major.minor`: from the
/// on-disk cache when present, else compiled by NVRTC and cached.
fn compiled(head_dim: usize, major: i32, minor: i32) -> Result<Ptx> {
    let arch: &'static str = match (major, minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => {
            return Err(Error::Gpu {
                what: "architecture",
                message: format!("compute capability {major}.{minor} is not supported"),
            })
        }
    };
    let mut defines = vec![
        format!("-DHEAD_DIM={head_dim}"),
        format!("-DMAX_GROUP={MAX_GROUP}"),
        format!("-DRADIX_REGS={RADIX_REGS}"),
    ];
    // Tuning only: the kv43 kernels' minimum resident CTAs per SM (`kv43.cu`, K43_MIN_BLOCKS).
    if let Some(n) = std::env::var("ATTNSTORE_KV43_MIN_BLOCKS").ok().and_then(|v| v.parse::<u32>().ok()) {
        defines.push(format!("-DK43_MIN_BLOCKS={n}"));
    }
    let key = fnv1a(format!("{SOURCE}{arch}{defines:?}").as_bytes());
    let dir = std::env::var_os("ATTNSTORE_PTX_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("attnstore-ptx"));
    let path = dir.join(format!("decode-{key:016x}.ptx"));
    if let Ok(src) = std::fs::read_to_string(&path) {
        return Ok(Ptx::from_src(src));
    }
    let opts =
        CompileOptions { arch: Some(arch), options: defines.to_vec(), use_fast_math: Some(true), ..Default::default() };
    let ptx = compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| Error::Gpu { what: "NVRTC compile", message: e.to_string() })?;
    // The cache is an optimization: a failed write costs a compile next time, nothing more.
    let _ = std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(&path, ptx.to_src()));
    Ok(ptx)
}

/// FNV-1a, 64 bits: a stable cache key (std's hasher is randomized per process).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Where a merge also writes its results for the host (device addresses; 0 for none): the
/// output (`q_heads × head_dim` floats) to `out`, and `words` ints from `words_src` (device
/// memory the step wrote) to `words_dst`. Each address names a buffer at least that long.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MailboxCopies {
    pub(crate) out: u64,
    pub(crate) words_src: u64,
    pub(crate) words: usize,
    pub(crate) words_dst: u64,
    /// A wave step's I/O descriptor in device memory (`IO_WORDS` words, `decode.cu`), or 0:
    /// the merge also writes the caller's output tensor it names.
    pub(crate) io: u64,
}
