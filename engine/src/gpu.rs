//! The GPU executor (feature `cuda`): runs a plan's exactly attended rows on the GPU, reading
//! them where the buffer manager keeps them — Gpu-tier hits from device memory, the rest
//! zero-copy from the pinned, device-mapped Host arena — in one decode kernel launch per
//! request; the steady zone (a few dozen rows per head) and the estimation zone are computed
//! on the CPU (`exec::device::gpu_work`) and merged with the GPU's partials by log-sum-exp.
//!
//! Blocks are pinned (CPU latches) from before the launch until the results are back, so the
//! maintainer can neither evict nor overwrite a slot a kernel reads. Requests the GPU cannot
//! serve — rows not homed in the buffer manager, not f16, one selection per query head, a
//! block only on Disk, no GPU — run on the CPU executor; the result says how many ran where.
//! Plans over `kv43` layers (rows held by the index) run the kv43 kernel over a device copy
//! of the layer's encoded rows and the plain kernel over its f16 rows (partial key groups and
//! the steady zone, appended step by step), merged on the device; the copy is kept per layer
//! with its launch buffers and made again when the segments change. Exact plans read every
//! encoded row; sparse plans of one selection per KV head read listed 64-row blocks with
//! row masks, and their estimation zone, computed on the CPU, joins the device merge. Plans
//! of one selection per query head, and device-selected kv43 requests, are refused
//! (`Error::NoGpuKernels`).
//!
//! Plans made by [`Engine::plan_gpu`] go further: the whole step runs on the device, each
//! request from its own graph on a lane of its own, launched as soon as its layer copy and
//! query are ready (`GpuBackend::launch_wave_lane`), so the device runs the first requests
//! while the host prepares the next; the lanes run at once. (One graph for every request of
//! the plan, `launch_wave_batch`, took ~23 µs to launch for six on the H100 host, and the
//! device waited for all of it.) Each
//! layer keeps a device copy of its meta index, of the Host-arena row of every indexed row
//! (for `hack2` rows: of every value block's arena blocks, and each cluster's value blocks
//! with their row masks) and of its steady zone (`DeviceLayer`), made again when a segment
//! is added (decode tokens are appended to the steady zone step by step). The kernels read Gpu-tier hits through the
//! buffer manager's device slot table, under a `DeviceRead` that keeps the maintainer from
//! overwriting any slot the table named; afterwards the step's selection is read back and
//! logged as cluster reads, so the maintainer keeps the Gpu tier warm: every cluster the step
//! missed (the row-list kernel flags them as it looks the table up) and a rotating sample of
//! its hits, enough for recency (for `hack2` rows, the value blocks it read: the buffer
//! manager keys those rows by value block).

use std::collections::HashMap;
use std::sync::Arc;

use attnstore_buffer::{FlaggedReads, HostMemoryKind, Tier};
use attnstore_kernels::cuda::{
    ArenaCache, CudaBlock, CudaBlocks, DeviceIo, DeviceKv43, DeviceWave, GpuBackend, Kv43SideRows, KvPointers,
    PagedGroup, SharedRows, WaveBatch, WaveCache, WaveFetched, WaveJob, WaveStep,
};
use attnstore_kernels::{Backend, BlockRows, Partial};
use parking_lot::Mutex;
use rayon::prelude::*;

use crate::analyze::Analysis;
use crate::context::{ContextId, Layer};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::exec::device::{gpu_hack_work, gpu_kv43_work, gpu_work, kv43_cluster_table, kv43_side_rows, GpuHackWork};
use crate::exec::{Meter, RequestActual, Zone};
use crate::plan::{Plan, RequestPlan};
use std::time::{Duration, Instant};

/// EXPLAIN ANALYZE's counters of one GPU execution ([`Engine::execute_gpu_analyze`]).
pub(crate) struct GpuMeters {
    /// One per request.
    meters: Vec<Meter>,
    /// What the CPU executor counted for a request the GPU could not serve.
    on_cpu: Vec<Option<RequestActual>>,
    /// Device time of the device-selected steps.
    device_time: Option<Duration>,
}

impl GpuMeters {
    fn new(requests: usize) -> Self {
        Self {
            meters: (0..requests).map(|_| Meter::default()).collect(),
            on_cpu: vec![None; requests],
            device_time: None,
        }
    }

    fn analysis(self, wall: Duration) -> Analysis {
        let requests = self.meters.iter().zip(self.on_cpu).map(|(m, cpu)| cpu.unwrap_or_else(|| m.actual())).collect();
        Analysis { requests, wall, device_time: self.device_time }
    }
}

/// Steady-zone rows a device copy holds beyond the zone's length when it is made (decode
/// tokens append there until the next segment is built; past it the copy is made again).
const STEADY_SLACK: usize = 2048;

/// GPU backends per head dimension (each compiles its kernels once), and the device copies
/// of layers that device-selected plans ran over.
#[derive(Default)]
pub(crate) struct GpuExec {
    backends: Mutex<HashMap<usize, Arc<GpuBackend>>>,
    device: Mutex<DeviceState>,
}

#[derive(Default)]
struct DeviceState {
    layers: HashMap<(ContextId, usize), DeviceLayer>,
    /// The device copies of kv43 layers that exact plans ran over.
    kv43: HashMap<(ContextId, usize), DeviceKv43Layer>,
    /// Steps over kv43 copies so far: each copy is stamped with the step that last used it.
    kv43_steps: u64,
    /// Streams for batched steps, per head dimension.
    batches: HashMap<usize, WaveBatch>,
}

/// A layer's device copy for device-selected steps.
struct DeviceLayer {
    wave: DeviceWave,
    /// The index's indexed tokens when copied: a new segment changes it (and the copy).
    indexed: usize,
    /// Buffers per retrieved-cluster count.
    jobs: Vec<(usize, WaveJob)>,
    /// Real clusters per head (ids past them are the device's padding).
    real_clusters: Vec<u32>,
    /// Buffer-manager key prefix of its clusters.
    keys: (u64, u32),
    tokens_per_block: usize,
    /// The clusters the last step retrieved (for [`Engine::analyze_gpu`]; its output taken).
    last: Option<WaveFetched>,
    /// Device steps run over this copy (which of its hits a step logs, `HIT_TOUCH_EVERY`).
    steps: u64,
    /// For 2-bit rows, per KV head and value-block id, the arena blocks the value block
    /// spans (a step logs the value blocks it read, by id, instead of clusters; the ids'
    /// ends are the device copy's `block_id_end`).
    block_pages: Option<Vec<Vec<u8>>>,
}

/// Rows of slack a kv43 layer's device side rows get beyond what they hold when made: decode
/// steps append to the steady zone until the next segment is built (which makes the copy
/// again).
const KV43_SIDE_SLACK: usize = 2048;

/// A kv43 layer's device copy: the encoded rows of every KV head's pieces
/// (`GpuBackend::upload_kv43_pieces`), made again when the pieces change, and the f16 rows
/// beside them (the pieces' partial key groups, then the steady zone, appended step by step).
struct DeviceKv43Layer {
    rows: DeviceKv43,
    /// `(encoded rows, rows)` of KV head 0's pieces when copied, in order.
    made_of: Vec<(usize, usize)>,
    side: Kv43SideRows,
    /// The last step's launch buffers (the next step of the same shape copies its queries in).
    job: Option<attnstore_kernels::cuda::Kv43Job>,
    /// The step that last used it (`DeviceState::kv43_steps`).
    used: u64,
    /// Where each directory cluster's rows are in the copy (a sparse step's lists).
    table: attnstore_kernels::Kv43ClusterTable,
}

/// Side rows on the device holding every row of `all` (a layer's side rows from its first),
/// with [`KV43_SIDE_SLACK`] rows to spare for the decode steps' appends.
fn side_rows_of(gpu: &GpuBackend, kv_heads: usize, all: &attnstore_index::SteadyRows) -> Result<Kv43SideRows> {
    let mut side = gpu.alloc_kv43_side(kv_heads, all.len + KV43_SIDE_SLACK)?;
    gpu.append_kv43_side(&mut side, &all.keys, &all.values)?;
    Ok(side)
}

/// The idle kv43 copy least recently used, if any (the one an upload that ran out of device
/// memory frees first).
fn least_recent_kv43<V>(
    copies: &HashMap<(ContextId, usize), V>,
    used: impl Fn(&V) -> u64,
) -> Option<(ContextId, usize)> {
    copies.iter().min_by_key(|(_, c)| used(c)).map(|(k, _)| *k)
}

/// Whether a GPU error is the device running out of memory (which freeing memory cures, as
/// opposed to a fault that stays with the context).
fn out_of_device_memory(e: &Error) -> bool {
    matches!(e, Error::Kernel(attnstore_kernels::Error::Gpu { message, .. }) if message.contains("OUT_OF_MEMORY"))
}

/// A kv43 request launched on the device, until its output is fetched
/// (`Engine::finish_kv43`).
struct LaunchedKv43 {
    key: (ContextId, usize),
    /// Its layer's copy (out of `DeviceState::kv43` until fetched), holding the launch's job.
    copy: DeviceKv43Layer,
    gpu: Arc<GpuBackend>,
    launched: Instant,
    /// The zone its device time counts in: the scan (exact plans) or retrieval.
    zone: Zone,
    trace: PhaseTrace,
}

/// A request launched on the device, until its output is fetched.
struct Launched {
    /// Its index in the plan.
    request: usize,
    key: (ContextId, usize),
    /// Its layer's copy (out of `DeviceState::layers` while the step runs).
    layer: DeviceLayer,
    /// Which of the layer's jobs the step runs in.
    job: usize,
    head_dim: usize,
    gpu: Arc<GpuBackend>,
}

/// A device step logs every cluster it missed but only one in `HIT_TOUCH_EVERY` of its hits,
/// by cluster id, rotating with the layer's step count ([`FlaggedReads`]): a hit cluster the
/// steps keep retrieving is touched in the replacer every few steps, which recency needs,
/// instead of at every step. At 1M tokens a step retrieves ~9,400 clusters, nearly all hits,
/// and resolving each in the maintainer (a mapping lookup, a replacer touch per block) made a
/// round span several steps, so the misses of those steps were read from the Host arena.
const HIT_TOUCH_EVERY: u64 = 8;

impl GpuExec {
    /// Forgets the device copies of `context`'s layers (it was dropped).
    pub(crate) fn forget(&self, context: ContextId) {
        let mut device = self.device.lock();
        device.layers.retain(|(c, _), _| *c != context);
        device.kv43.retain(|(c, _), _| *c != context);
    }
}

/// `layer`'s device copy: `cached` brought up to date (steady rows appended), or made anew
/// when there is none, a segment was added or the steady zone outgrew it. `None` when the
/// layer cannot run on the device (see `exec::device::arena_layer`; e.g. a block spilled).
fn device_layer(
    gpu: &GpuBackend,
    cached: Option<DeviceLayer>,
    layer: &Layer,
    kv_heads: usize,
    d: usize,
) -> Result<Option<DeviceLayer>> {
    let indexed = layer.method.stats().indexed_tokens;
    if let Some(mut dl) = cached.filter(|dl| dl.indexed == indexed) {
        let synced = dl.wave.steady_rows();
        let Some(rows) = layer.method.clustered().and_then(|c| c.steady_rows_from(synced)) else { return Ok(None) };
        if rows.len >= synced && rows.len <= dl.wave.steady_capacity() {
            if rows.len > synced {
                gpu.set_steady(&mut dl.wave, synced, &rows.keys, &rows.values)?;
            }
            return Ok(Some(dl));
        }
    }
    let arena = match crate::exec::device::arena_layer(layer, kv_heads, d) {
        Some(Ok(arena)) => arena,
        // Not servable here (or a block not in the Host arena): the CPU runs it.
        None | Some(Err(_)) => return Ok(None),
    };
    let Some(steady) = layer.method.clustered().and_then(|c| c.steady_rows_from(0)) else { return Ok(None) };
    let mut wave = gpu.upload_arena_wave(&arena.wave, steady.len + STEADY_SLACK)?;
    gpu.set_steady(&mut wave, 0, &steady.keys, &steady.values)?;
    let block_pages = wave.block_id_end().map(|_| arena.block_pages);
    Ok(Some(DeviceLayer {
        wave,
        indexed,
        jobs: Vec::new(),
        real_clusters: arena.real_clusters.iter().map(|&n| n as u32).collect(),
        keys: (arena.context, arena.layer),
        tokens_per_block: arena.tokens_per_block,
        last: None,
        steps: 0,
        block_pages,
    }))
}

impl GpuExec {
    pub(crate) fn backend(&self, head_dim: usize) -> Result<Arc<GpuBackend>> {
        let mut map = self.backends.lock();
        if let Some(b) = map.get(&head_dim) {
            return Ok(Arc::clone(b));
        }
        let b = Arc::new(GpuBackend::new(head_dim)?);
        map.insert(head_dim, Arc::clone(&b));
        Ok(b)
    }
}

/// Phase times of one GPU call, printed to stderr when `ATTNSTORE_GPU_TRACE` is set (read
/// once per process): host phases, and for a device step the device time from before its
/// launch to its end (the step launched as usual, from its graph). With `ATTNSTORE_GPU_TRACE=device` a single
/// device step instead runs eagerly with an event per kernel phase (select, estimate, row
/// list, attention, merge), to see where device time goes.
struct PhaseTrace {
    on: bool,
    /// Single device steps run eagerly, phase by phase.
    eager: bool,
    last: std::time::Instant,
    phases: Vec<(&'static str, f64)>,
    /// Milliseconds of a traced device step (its phases, when eager).
    device_ms: Vec<f64>,
}

impl PhaseTrace {
    fn new() -> Self {
        // Read once per process: this runs on every device step.
        static MODE: std::sync::OnceLock<(bool, bool)> = std::sync::OnceLock::new();
        let (on, eager) = *MODE.get_or_init(|| {
            let mode = std::env::var("ATTNSTORE_GPU_TRACE").ok();
            (mode.is_some(), mode.as_deref() == Some("device"))
        });
        Self { on, eager, last: std::time::Instant::now(), phases: Vec::new(), device_ms: Vec::new() }
    }

    fn mark(&mut self, phase: &'static str) {
        if self.on {
            self.phases.push((phase, self.last.elapsed().as_secs_f64() * 1e6));
            self.last = std::time::Instant::now();
        }
    }

    fn print(&self) {
        if self.on {
            let parts: Vec<String> = self.phases.iter().map(|(p, us)| format!("{p} {us:.0}")).collect();
            let device: Vec<String> = self.device_ms.iter().map(|ms| format!("{:.0}", ms * 1e3)).collect();
            eprintln!("gpu request (us): {}; device (us): {}", parts.join(", "), device.join(" "));
        }
    }
}

/// Where a device step reads rows: the pinned Host arena (every block's home) and the Gpu
/// tier's pool with its slot table, both addressed in rows of `per_block` K rows then
/// `per_block` V rows per block.
struct ArenaRows {
    host_base: u64,
    host_blocks: usize,
    /// Device address of the Gpu tier's pool, when it lives in device memory.
    gpu_base: Option<u64>,
    /// Device address of the slot table, when there is one.
    table: Option<u64>,
    gpu_blocks: usize,
    per_block: usize,
    row_bytes: usize,
}

impl ArenaRows {
    /// The rows of `manager` (whose Host arena is pinned at `host_base`, sized by `settings`)
    /// for blocks of `per_block` tokens of head dimension `head_dim` (f16).
    fn of(
        manager: &attnstore_buffer::BufferManager,
        settings: &crate::BufferSettings,
        host_base: u64,
        per_block: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            host_base,
            host_blocks: settings.host_blocks,
            gpu_base: manager.gpu_device_base(),
            table: manager.device_slot_table().map(|t| t.address),
            gpu_blocks: settings.gpu_blocks,
            per_block,
            row_bytes: head_dim * 2,
        }
    }

    /// The Host arena's rows and the Gpu tier's, one index for every KV head.
    fn shared(&self) -> (SharedRows, Option<SharedRows>) {
        let block_rows = 2 * self.per_block;
        let shift = (self.per_block * self.row_bytes) as u64;
        let host =
            SharedRows { keys: self.host_base, values: self.host_base + shift, rows: self.host_blocks * block_rows };
        let cache =
            self.gpu_base.map(|b| SharedRows { keys: b, values: b + shift, rows: self.gpu_blocks * block_rows });
        (host, cache)
    }

    /// The same as a wave step takes them (the cache only with its slot table).
    fn pointers(&self) -> (KvPointers, Option<WaveCache<'static>>) {
        let (host, cache) = self.shared();
        let kv = KvPointers { keys: host.keys, values: host.values, rows: host.rows };
        let cache = cache
            .zip(self.table)
            .map(|(rows, table)| WaveCache::Arena(ArenaCache { rows, table, block_rows: 2 * self.per_block }));
        (kv, cache)
    }
}

/// [`GpuBackend::launch_wave_lane_io`] of a request of [`Engine::attend_device`].
#[allow(unsafe_code, reason = "the caller's device pointers")]
fn launch_io(
    gpu: &GpuBackend,
    batch: &WaveBatch,
    lane: usize,
    step: &mut WaveStep<'_>,
    io: &DeviceIo,
) -> attnstore_kernels::Result<()> {
    // SAFETY: `io` names the caller's device tensors of this request's shape and type, valid
    // until `Engine::attend_device` returns (its contract), and the step is fetched before
    // it returns.
    unsafe { gpu.launch_wave_lane_io(batch, lane, step, io) }
}

/// What [`Engine::execute_gpu`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuRun {
    /// Requests executed on the GPU.
    pub on_gpu: usize,
    /// Requests executed on the CPU (the GPU could not serve them).
    pub on_cpu: usize,
    /// Retrieved blocks read from the Gpu tier (device memory).
    pub gpu_blocks: usize,
    /// Retrieved blocks read zero-copy from the pinned Host arena.
    pub host_blocks: usize,
    /// Of the requests on the GPU, those whose clusters the GPU chose (plans of
    /// [`Engine::plan_gpu`]). Their blocks are not counted above: the buffer manager's tier
    /// statistics count them when the maintainer processes the step's cluster reads.
    pub device_selected: usize,
    /// Clusters the device-selected requests retrieved (all KV heads).
    pub device_clusters: usize,
    /// Of those, clusters with a row read from the Host arena rather than the Gpu tier at the
    /// step (the device's own view of its misses). The buffer manager's Gpu-tier statistics
    /// see every miss but only a sample of the hits (see `HIT_TOUCH_EVERY` in `gpu.rs`), so
    /// `1 − device_missed / device_clusters` is the step's hit ratio by cluster.
    pub device_missed: usize,
}

impl GpuRun {
    /// Adds `other`'s counts to these.
    pub(crate) fn absorb(&mut self, other: &GpuRun) {
        self.on_gpu += other.on_gpu;
        self.on_cpu += other.on_cpu;
        self.gpu_blocks += other.gpu_blocks;
        self.host_blocks += other.host_blocks;
        self.device_selected += other.device_selected;
        self.device_clusters += other.device_clusters;
        self.device_missed += other.device_missed;
    }
}

impl Engine {
    /// Runs `plan` like [`Engine::execute`], on the GPU for every request it can serve (see
    /// the module docs of `gpu.rs`), on the CPU for the others; outputs in request order.
    /// Needs [`EngineConfig::buffers`](crate::EngineConfig::buffers) on a machine where the
    /// buffer manager got pinned host memory; otherwise every request runs on the CPU.
    pub fn execute_gpu(&self, plan: &Plan) -> Result<(Vec<Vec<f32>>, GpuRun)> {
        let start = Instant::now();
        let done = self.run_gpu(plan, None)?;
        crate::metrics::executed(plan, start.elapsed(), true);
        Ok(done)
    }

    /// EXPLAIN ANALYZE on the GPU: runs `plan` like [`Engine::execute_gpu`] (same outputs)
    /// while counting per request and zone what was read and where from. Host-planned
    /// requests count the blocks their kernel read per tier and the rows in them (in the
    /// retrieve zone, or the scan zone for an exact plan), the CPU's steady rows and
    /// estimated clusters, and the kernel's wall time (`gpu_time`); device-selected requests
    /// count from the step's own record of what it read: the device copy's steady rows, the
    /// rows and blocks of every cluster it retrieved (a block of a missed cluster read from
    /// the Host arena, of a hit from the Gpu tier) and the clusters it estimated, with the
    /// steps' device time in [`Analysis::device_time`]. Requests that ran on the CPU count
    /// as [`Engine::execute_analyze`] does.
    pub fn execute_gpu_analyze(&self, plan: &Plan) -> Result<(Vec<Vec<f32>>, GpuRun, Analysis)> {
        let _span = tracing::debug_span!("execute_gpu_analyze", requests = plan.requests.len()).entered();
        let mut meters = GpuMeters::new(plan.requests.len());
        let start = Instant::now();
        let (outputs, run) = self.run_gpu(plan, Some(&mut meters))?;
        Ok((outputs, run, meters.analysis(start.elapsed())))
    }

    /// [`Engine::execute_gpu`], counting into `meters` when given.
    pub(crate) fn run_gpu(&self, plan: &Plan, mut meters: Option<&mut GpuMeters>) -> Result<(Vec<Vec<f32>>, GpuRun)> {
        plan.check_gpu_codecs(true)?;
        let mut run = GpuRun::default();
        let mut done: Vec<Option<Vec<f32>>> = vec![None; plan.requests.len()];
        let device: Vec<usize> = (0..plan.requests.len()).filter(|&i| plan.requests[i].device.is_some()).collect();
        if !device.is_empty() {
            self.execute_device(plan, &device, &[], &mut done, &mut run, meters.as_deref_mut())?;
        }
        // kv43 requests are all launched first (the first of each layer copy: a second
        // request of the same copy runs when the first is back), then fetched in order, so
        // the host prepares the next request while the device runs the last.
        let mut kv43: Vec<Option<LaunchedKv43>> = (0..plan.requests.len()).map(|_| None).collect();
        let mut copies = std::collections::HashSet::new();
        for (i, r) in plan.requests.iter().enumerate() {
            if done[i].is_none()
                && r.device.is_none()
                && r.codec.kv43().is_some()
                && copies.insert((r.context, r.layer))
            {
                kv43[i] = self.launch_kv43_request(r, meters.as_deref().map(|m| &m.meters[i]))?;
            }
        }
        let mut outputs = Vec::with_capacity(plan.requests.len());
        for (i, (r, done)) in plan.requests.iter().zip(done).enumerate() {
            if let Some(out) = done {
                outputs.push(out);
                continue;
            }
            // A device-selected plan the device could not serve runs on the CPU.
            let meter = meters.as_deref().map(|m| &m.meters[i]);
            let on_gpu = match kv43[i].take() {
                Some(launched) => Some(self.finish_kv43(launched, meter)?),
                None if r.device.is_some() => None,
                None => self.execute_request_gpu(r, &mut run, meter)?,
            };
            match on_gpu {
                Some(out) => {
                    run.on_gpu += 1;
                    outputs.push(out);
                }
                None => {
                    run.on_cpu += 1;
                    let single =
                        Plan { budget: plan.budget, requests: vec![r.clone()], host_read_gbps: plan.host_read_gbps };
                    match meters.as_deref_mut() {
                        Some(m) => {
                            let (mut out, analysis) = self.execute_analyze(&single)?;
                            m.on_cpu[i] = analysis.requests.first().copied();
                            outputs.push(out.remove(0));
                        }
                        None => outputs.push(self.execute_unrecorded(&single)?.remove(0)),
                    }
                }
            }
        }
        Ok((outputs, run))
    }

    /// Runs the device-selected requests `which` of `plan` on the device, filling their
    /// outputs; requests it cannot serve are left `None`. Each request is launched on a lane
    /// of its own as soon as its layer copy and query are ready
    /// (`GpuBackend::launch_wave_lane`), so the device runs the first requests while the host
    /// prepares the next; then every output is fetched and the selections are logged.
    /// `io[i]`, where given, holds request `i`'s query and output in the caller's device
    /// memory (its plan's host query is then not read).
    #[allow(clippy::too_many_arguments, reason = "the plan, what runs, its device I/O and what it produced")]
    pub(crate) fn execute_device(
        &self,
        plan: &Plan,
        which: &[usize],
        io: &[Option<DeviceIo>],
        outputs: &mut [Option<Vec<f32>>],
        run: &mut GpuRun,
        mut meters: Option<&mut GpuMeters>,
    ) -> Result<()> {
        let Some(manager) = self.buffer_manager() else { return Ok(()) };
        let HostMemoryKind::Pinned { device_base: host_base } = manager.host_memory() else { return Ok(()) };
        let Some(settings) = self.config().buffers.as_ref() else { return Ok(()) };
        let mut trace = PhaseTrace::new();
        let ctxs = which.iter().map(|&i| self.context(plan.requests[i].context)).collect::<Result<Vec<_>>>()?;
        // Layers stay read-locked until the results are back: their rows cannot move.
        let guards = which
            .iter()
            .zip(&ctxs)
            .map(|(&i, ctx)| {
                let r = &plan.requests[i];
                let layer = crate::engine::layer_of(ctx, r.context, r.layer)?;
                let g = layer.read_recursive();
                crate::engine::check_fresh(r, &g)?;
                Ok(g)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut state = self.gpu.device.lock();
        // A lane per request of each head dimension.
        let mut dims: Vec<(usize, usize)> = Vec::new();
        for &i in which {
            let d = plan.requests[i].shape.head_dim;
            match dims.iter_mut().find(|x| x.0 == d) {
                Some(x) => x.1 += 1,
                None => dims.push((d, 1)),
            }
        }
        for &(d, n) in &dims {
            if state.batches.get(&d).is_none_or(|b| b.capacity() < n) {
                let batch = self.gpu.backend(d)?.wave_batch(n.max(4))?;
                state.batches.insert(d, batch);
            }
        }
        // One traced step runs eagerly, phase by phase; else the device time of the whole
        // step is measured (one head dimension only) from a mark before the first launch.
        let eager = trace.eager && which.len() == 1;
        let timed = (trace.on || meters.is_some()) && !eager && dims.len() == 1;
        let before = if timed { self.gpu.backend(dims[0].0)?.mark().ok() } else { None };
        // The maintainer overwrites no slot the table names until every step is fetched.
        let reads = manager.device_read();
        let mut launched: Vec<Launched> = Vec::with_capacity(which.len());
        let mut result = Ok(());
        for (&i, layer) in which.iter().zip(&guards) {
            let r = &plan.requests[i];
            let key = (r.context, r.layer);
            if launched.iter().any(|l| l.key == key) {
                continue; // the same layer twice in one batch: the second runs on the CPU
            }
            let lane = launched.iter().filter(|l| l.head_dim == r.shape.head_dim).count();
            let arena = |per_block| ArenaRows::of(manager, settings, host_base, per_block, r.shape.head_dim);
            let io = io.get(i).copied().flatten();
            match self.launch_request(&mut state, r, i, io, layer, lane, arena, eager, &mut trace) {
                Ok(Some(l)) => launched.push(l),
                Ok(None) => {}
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        trace.mark("prepare + launch");
        let after = match (&before, timed) {
            (Some(_), true) => state.batches.get(&dims[0].0).and_then(|b| {
                let gpu = self.gpu.backend(dims[0].0).ok()?;
                gpu.mark_lanes(b, launched.len()).ok()
            }),
            _ => None,
        };
        if result.is_err() {
            // A launch failed part way: nothing may still read the slots or the buffers.
            for b in state.batches.values() {
                let _ = b.synchronize();
            }
        }
        let fetched: Vec<_> =
            launched.iter_mut().map(|l| l.gpu.fetch_wave_selected(&mut l.layer.jobs[l.job].1)).collect();
        trace.mark("step + fetch");
        drop(reads);
        trace.mark("release");
        if let (Some(a), Some(b)) = (before, after) {
            trace.device_ms = a.ms_until(&b).into_iter().collect();
        }
        if let Some(m) = meters.as_deref_mut() {
            m.device_time = trace.device_ms.first().map(|&ms| Duration::from_secs_f64(ms / 1e3));
        }
        let mut logged = Vec::with_capacity(launched.len());
        for (l, got) in launched.iter_mut().zip(fetched) {
            let Ok(mut got) = got else {
                result = result.and(got.map(|_| ()).map_err(Error::from));
                continue;
            };
            if result.is_err() {
                continue;
            }
            if let Some((index, value)) = l.gpu.io_status(&l.layer.jobs[l.job].1) {
                result = Err(Error::NonFinite { what: "device queries", index, value });
                continue;
            }
            outputs[l.request] = Some(std::mem::take(&mut got.output));
            run.on_gpu += 1;
            run.device_selected += 1;
            let dl = &mut l.layer;
            dl.steps += 1;
            // The step's thread only counts (branch-free); the maintainer picks the ids it
            // applies (FlaggedReads::resolve): sorting them here cost ~7 µs per request.
            let (retrieved, missed) = got.count_real(&dl.real_clusters);
            run.device_clusters += retrieved;
            run.device_missed += missed;
            if let Some(m) = meters.as_deref() {
                let at = which.iter().position(|&i| i == l.request).expect("launched from `which`");
                let block_bytes = manager.layout().block_bytes();
                meter_device_step(
                    &m.meters[l.request],
                    &guards[at],
                    dl,
                    &got,
                    plan.requests[l.request].shape.head_dim,
                    block_bytes,
                );
            }
            // A 2-bit layer's blocks are keyed by value block: the step logs those it read.
            let (flagged, per_head, real) = match dl.wave.block_id_end() {
                Some(end) => (got.blocks.clone(), got.blocks_per_head, end.to_vec()),
                None => (got.flagged.clone(), got.per_head, dl.real_clusters.clone()),
            };
            logged.push(FlaggedReads {
                context: dl.keys.0,
                layer: dl.keys.1,
                flagged,
                per_head,
                real,
                hit_every: HIT_TOUCH_EVERY as u32,
                hit_turn: (dl.steps % HIT_TOUCH_EVERY) as u32,
            });
            dl.last = Some(got);
        }
        trace.mark("selection");
        if !logged.is_empty() {
            manager.log_flagged_reads(logged);
        }
        trace.mark("log");
        trace.print();
        for l in launched {
            state.layers.insert(l.key, l.layer);
        }
        drop(guards);
        result
    }

    /// Brings request `i`'s layer copy up to date, sets its query and launches its step on
    /// lane `lane` of its head dimension's batch (or, `eager`, phase by phase for the trace).
    /// With `io`, the query is read from and the output written to the caller's device
    /// memory (never eagerly). `None`: the layer cannot run on the device (the CPU runs the
    /// request).
    #[allow(clippy::too_many_arguments, reason = "the executor's state, the request and where it runs")]
    fn launch_request(
        &self,
        state: &mut DeviceState,
        r: &RequestPlan,
        i: usize,
        io: Option<DeviceIo>,
        layer: &Layer,
        lane: usize,
        arena: impl Fn(usize) -> ArenaRows,
        eager: bool,
        trace: &mut PhaseTrace,
    ) -> Result<Option<Launched>> {
        let d = r.shape.head_dim;
        let dev = r.device.as_ref().expect("a device-selected request");
        let key = (r.context, r.layer);
        let gpu = self.gpu.backend(d)?;
        let cached = state.layers.remove(&key);
        let Some(mut dl) = device_layer(&gpu, cached, layer, r.shape.kv_heads, d)? else { return Ok(None) };
        let job = match dl.jobs.iter().position(|(n, _)| *n == dev.clusters_per_head) {
            Some(at) => at,
            None => {
                let n = dev.clusters_per_head.min(dl.wave.clusters());
                let job = match gpu.prepare_wave(&r.shape, &dl.wave, n) {
                    Ok(job) => job,
                    Err(e) => {
                        state.layers.insert(key, dl);
                        return Err(e.into());
                    }
                };
                dl.jobs.push((dev.clusters_per_head, job));
                dl.jobs.len() - 1
            }
        };
        let (kv, cache) = arena(dl.tokens_per_block).pointers();
        let DeviceLayer { wave, jobs, .. } = &mut dl;
        let mut step = WaveStep { wave, kv, cache, job: &mut jobs[job].1 };
        let launched = match io {
            Some(io) => {
                let batch = state.batches.get(&d).expect("a batch per head dimension (execute_device)");
                launch_io(&gpu, batch, lane, &mut step, &io)
            }
            None => gpu.set_wave_query(step.job, &r.queries).and_then(|()| {
                if eager {
                    gpu.wave_phases(step.wave, step.kv, step.cache, step.job).map(|ms| trace.device_ms = ms)
                } else {
                    let batch = state.batches.get(&d).expect("a batch per head dimension (execute_device)");
                    gpu.launch_wave_lane(batch, lane, &mut step)
                }
            }),
        };
        if let Err(e) = launched {
            state.layers.insert(key, dl);
            return Err(e.into());
        }
        Ok(Some(Launched { request: i, key, layer: dl, job, head_dim: d, gpu }))
    }

    /// EXPLAIN ANALYZE for device-selected plans: `plan` with every device-selected request
    /// turned into an ordinary sparse plan retrieving the clusters the GPU chose the last
    /// time it ran that request's layer (every other cluster estimated), its blocks' tiers
    /// looked up now. [`Engine::execute`] of the result attends exactly what the GPU did.
    /// A request whose layer has not run on the device is an [`Error::InvalidSpec`].
    pub fn analyze_gpu(&self, plan: &Plan) -> Result<Plan> {
        let state = self.gpu.device.lock();
        let mut out = plan.clone();
        for r in out.requests.iter_mut().filter(|r| r.device.is_some()) {
            let ctx = self.context(r.context)?;
            let layer = crate::engine::layer_of(&ctx, r.context, r.layer)?;
            let guard = layer.read_recursive();
            crate::engine::check_fresh(r, &guard)?;
            let selection = match state.layers.get(&(r.context, r.layer)).and_then(|dl| dl.last.as_ref()) {
                Some(last) if last.flagged.len() == r.shape.kv_heads * last.per_head => last.selection(),
                _ => {
                    return Err(Error::InvalidSpec(format!(
                        "{} layer {} has not run on the device: nothing to analyze",
                        r.context, r.layer
                    )))
                }
            };
            let (g, d) = (r.shape.group(), r.shape.head_dim);
            let clustered = guard
                .method
                .clustered()
                .filter(|c| c.storage() != attnstore_index::RowStorage::Memory)
                .ok_or_else(|| Error::InvalidSpec(format!("{} layer {} cannot be analyzed", r.context, r.layer)))?;
            let heads = (0..r.shape.kv_heads)
                .map(|h| clustered.plan_head_retrieving(h, &r.queries[h * g * d..(h + 1) * g * d], &selection[h]))
                .collect::<Vec<_>>();
            *r = r.chosen(heads, &guard, self.config());
        }
        Ok(out)
    }

    /// One request on the GPU, or `None` when it must run on the CPU.
    fn execute_request_gpu(
        &self,
        r: &RequestPlan,
        run: &mut GpuRun,
        meter: Option<&Meter>,
    ) -> Result<Option<Vec<f32>>> {
        if r.codec.kv43().is_some() {
            return match self.launch_kv43_request(r, meter)? {
                Some(launched) => self.finish_kv43(launched, meter).map(Some),
                None => Ok(None),
            };
        }
        let mut trace = PhaseTrace::new();
        let ctx = self.context(r.context)?;
        let layer = crate::engine::layer_of(&ctx, r.context, r.layer)?;
        let guard = layer.read_recursive();
        crate::engine::check_fresh(r, &guard)?;
        let sh = r.shape;
        let (g, d) = (sh.group(), sh.head_dim);
        let layer: &crate::context::Layer = &guard;
        let Some(manager) = self.buffer_manager() else { return Ok(None) };
        let HostMemoryKind::Pinned { device_base: host_base } = manager.host_memory() else { return Ok(None) };
        // Per KV head on rayon threads (the estimation partials are CPU work).
        let hack: Option<Vec<_>> = (0..sh.kv_heads)
            .into_par_iter()
            .map(|h| gpu_hack_work(layer, h, &r.queries[h * g * d..(h + 1) * g * d], d, &r.heads[h], meter))
            .collect();
        if let Some(works) = hack {
            let works = works.into_iter().collect::<std::result::Result<Vec<_>, _>>()?;
            trace.mark("work");
            return self.execute_hack_gpu(r, manager, host_base, &works, run, &mut trace, meter);
        }
        let works: Option<Vec<_>> = (0..sh.kv_heads)
            .into_par_iter()
            .map(|h| gpu_work(layer, h, &r.queries[h * g * d..(h + 1) * g * d], d, &r.heads[h], &r.blocks[h], meter))
            .collect();
        let Some(works) = works else { return Ok(None) };
        let works = works.into_iter().collect::<std::result::Result<Vec<_>, _>>()?;
        trace.mark("work");
        // Pin every block (CPU latches keep the maintainer off the slots the kernel reads).
        let reader = manager.reader();
        let locations: Vec<_> = works.iter().flat_map(|w| w.blocks.iter().map(|(l, _)| *l)).collect();
        let pins = reader.pin_all(&locations).into_iter().collect::<std::result::Result<Vec<_>, _>>()?;
        let per_block = works.first().map_or(1, |w| w.tokens_per_block);
        // An exact plan's GPU rows are its scan; a sparse plan's are its retrieved rows.
        let zone = meter.map(|m| m.zone(if r.heads.iter().all(|h| h.exact) { Zone::Scan } else { Zone::Retrieve }));
        let block_bytes = manager.layout().block_bytes();
        let mut blocks: Vec<Vec<BlockRows<CudaBlock>>> = Vec::with_capacity(sh.kv_heads);
        let mut pin_at = 0;
        for w in &works {
            let mut list = Vec::with_capacity(w.blocks.len());
            for &(_, n) in &w.blocks {
                let pin = &pins[pin_at];
                pin_at += 1;
                let Some(slot) = pin.slot() else { return Ok(None) }; // a Disk read: CPU
                if let Some(z) = zone {
                    z.pinned(pin.tier(), block_bytes);
                    z.block_rows(n as usize);
                }
                let block = match pin.tier() {
                    Tier::Gpu => {
                        run.gpu_blocks += 1;
                        CudaBlock::Cache(slot)
                    }
                    _ => {
                        run.host_blocks += 1;
                        CudaBlock::Host(slot)
                    }
                };
                list.push(BlockRows { block, rows: 0..n as usize });
            }
            blocks.push(list);
        }
        trace.mark("pins+lists");
        let gpu = self.gpu.backend(d)?;
        let Some(settings) = self.config().buffers.as_ref() else { return Ok(None) };
        let (host, cache) = ArenaRows::of(manager, settings, host_base, per_block, d).shared();
        trace.mark("backend");
        let mut parts: Vec<Partial> = (0..sh.q_heads).map(|_| Partial::empty(d)).collect();
        let scale = 1.0 / (d as f32).sqrt();
        let launched = Instant::now();
        CudaBlocks::new(&gpu, host, cache).attend_blocks(&r.queries, scale, per_block, &blocks, &mut parts)?;
        if let Some(z) = zone {
            z.gpu_since(launched);
        }
        trace.mark("launch+fetch");
        // The kernel is done: the blocks may move again.
        drop(pins);
        drop(reader);
        trace.mark("unpin");
        Ok(Some(merged_output(parts, works.iter().map(|w| &w.cpu[..]), g, &mut trace)))
    }

    /// Launches a request over a kv43 layer on the GPU, to be fetched by
    /// [`Engine::finish_kv43`]: the homomorphic kernel reads the encoded rows from the layer's
    /// device copy (made on the first such request, and again when the index's segments
    /// change; its launch buffers are kept with it) — every row for an exact plan, the
    /// retrieved rows' 64-row blocks with row masks for a sparse one — the plain kernel the
    /// f16 rows beside them (each piece's partial key group, and the steady zone, whose new
    /// rows are copied up first; a sparse plan lists the retrieved ones), and the merge folds
    /// both, and a sparse plan's estimation zone computed here, on the device: the host
    /// copies the query and lists in and the output back. Counts the rows read into `meter`.
    /// `None` when the plan or the layer is not served this way (rows not a wave index's kv43
    /// segments, steady rows not f16): the CPU runs it.
    fn launch_kv43_request(&self, r: &RequestPlan, meter: Option<&Meter>) -> Result<Option<LaunchedKv43>> {
        let mut trace = PhaseTrace::new();
        let ctx = self.context(r.context)?;
        let layer = crate::engine::layer_of(&ctx, r.context, r.layer)?;
        let guard = layer.read_recursive();
        crate::engine::check_fresh(r, &guard)?;
        let layer: &crate::context::Layer = &guard;
        let sh = r.shape;
        let works: Option<Vec<_>> = (0..sh.kv_heads).map(|h| gpu_kv43_work(layer, h, &r.heads[h])).collect();
        let Some(works) = works else { return Ok(None) };
        trace.mark("work");
        let gpu = self.gpu.backend(sh.head_dim)?;
        let key = (r.context, r.layer);
        // Segments never change once built: their rows say which copy this is.
        let made_of: Vec<(usize, usize)> = works[0].pieces.iter().map(|p| (p.encoded_rows(), p.rows())).collect();
        // Out of the map while it runs (other layers' requests go on); put back after.
        let cached = self.gpu.device.lock().kv43.remove(&key).filter(|c| c.made_of == made_of);
        let (mut copy, synced) = match cached {
            Some(c) => {
                let synced = c.side.rows();
                (c, synced)
            }
            None => {
                let Some(side) = kv43_side_rows(layer, &works, 0) else { return Ok(None) };
                let Some(table) = kv43_cluster_table(layer, sh.kv_heads) else { return Ok(None) };
                let pieces: Vec<Vec<&attnstore_kernels::Kv43Head>> = works.iter().map(|w| w.pieces.clone()).collect();
                let (rows, side_rows) = self.with_kv43_room(|| {
                    Ok((gpu.upload_kv43_pieces(&pieces)?, side_rows_of(&gpu, sh.kv_heads, &side)?))
                })?;
                (DeviceKv43Layer { rows, made_of, side: side_rows, job: None, used: 0, table }, side.len)
            }
        };
        trace.mark("device copy");
        // The steady zone's rows appended since (a copy whose zone shrank or outgrew its
        // capacity is made again from its first side row).
        let Some(new) = kv43_side_rows(layer, &works, synced) else { return Ok(None) };
        if new.len < synced || new.len > copy.side.capacity() {
            let all = kv43_side_rows(layer, &works, 0).expect("f16 steady rows, as just read");
            copy.side = side_rows_of(&gpu, sh.kv_heads, &all)?;
        } else {
            gpu.append_kv43_side(&mut copy.side, &new.keys, &new.values)?;
        }
        trace.mark("side rows");
        let mut job = match copy.job.take().filter(|j| j.shape() == sh) {
            Some(mut job) => {
                gpu.requery_kv43(&mut job, &r.queries)?;
                job
            }
            None => gpu.prepare_kv43(&sh, &r.queries, &copy.rows)?,
        };
        trace.mark("queries");
        let exact = r.heads.iter().all(|h| h.exact);
        let lists = if exact {
            if let Some(m) = meter {
                works.iter().for_each(|w| w.meter(sh.head_dim, m));
            }
            None
        } else {
            // A sparse plan: its retrieved rows and steady zone listed, its estimation zone
            // computed here (per KV head on rayon threads) and folded in by the merge.
            let (d, g) = (sh.head_dim, sh.group());
            let heads: Option<Vec<_>> = works.par_iter().map(|w| w.listed(d, g, &copy.table, meter)).collect();
            let Some(heads) = heads else {
                self.gpu.device.lock().kv43.insert(key, DeviceKv43Layer { job: Some(job), ..copy });
                return Ok(None);
            };
            let mut lists = attnstore_kernels::Kv43Lists::default();
            for h in heads {
                lists.blocks.push(h.blocks);
                lists.side.push(h.side);
                for p in &h.estimate {
                    lists.extra.extend_from_slice(&p.o);
                    lists.extra.extend([p.m, p.l]);
                }
            }
            trace.mark("lists");
            Some(lists)
        };
        let launched = Instant::now();
        let launch = match &lists {
            None => gpu.launch_kv43(&copy.rows, Some(&copy.side), &mut job),
            Some(lists) => gpu.launch_kv43_listed(&copy.rows, &copy.side, lists, &mut job),
        };
        copy.job = Some(job);
        if let Err(e) = launch {
            self.gpu.device.lock().kv43.insert(key, copy);
            return Err(e.into());
        }
        trace.mark("launch");
        let zone = if exact { Zone::Scan } else { Zone::Retrieve };
        Ok(Some(LaunchedKv43 { key, copy, gpu, launched, zone, trace }))
    }

    /// Waits for a request of [`Engine::launch_kv43_request`] and returns its output; its
    /// layer's copy goes back for the next step.
    fn finish_kv43(&self, launched: LaunchedKv43, meter: Option<&Meter>) -> Result<Vec<f32>> {
        let LaunchedKv43 { key, mut copy, gpu, launched, zone, mut trace } = launched;
        let job = copy.job.as_mut().expect("a launched copy holds its job");
        let out = gpu.fetch_kv43(job)?;
        if let Some(m) = meter {
            m.zone(zone).gpu_since(launched);
        }
        trace.mark("fetch");
        let mut device = self.gpu.device.lock();
        device.kv43_steps += 1;
        copy.used = device.kv43_steps;
        device.kv43.insert(key, copy);
        drop(device);
        trace.print();
        Ok(out)
    }

    /// Runs `make` (a kv43 copy's allocations); while it runs out of device memory, frees the
    /// least recently used idle kv43 copy and tries again (copies in use by a launched step
    /// are out of the map, so never freed here). The error stands when none is left.
    fn with_kv43_room<T>(&self, mut make: impl FnMut() -> Result<T>) -> Result<T> {
        loop {
            match make() {
                Err(e) if out_of_device_memory(&e) => {
                    let mut device = self.gpu.device.lock();
                    let Some(key) = least_recent_kv43(&device.kv43, |c| c.used) else { return Err(e) };
                    device.kv43.remove(&key);
                    tracing::debug!(context = %key.0, layer = key.1, "kv43 device copy freed for room");
                }
                done => return done,
            }
        }
    }

    /// A request over 2-bit (`hack2`) value blocks on the GPU: the homomorphic kernel reads
    /// each block the plan attends in place, pinned, from the Gpu tier or zero-copy from the
    /// pinned Host arena (`GpuBackend::prepare_hack_paged`), and its partials merge with the
    /// CPU's steady and estimation zones. `None` when a block is only on Disk (or the Gpu
    /// tier has no device copy): the CPU runs the request.
    #[allow(clippy::too_many_arguments, reason = "the request, where its blocks are, and what to count")]
    fn execute_hack_gpu(
        &self,
        r: &RequestPlan,
        manager: &attnstore_buffer::BufferManager,
        host_base: u64,
        works: &[GpuHackWork],
        run: &mut GpuRun,
        trace: &mut PhaseTrace,
        meter: Option<&Meter>,
    ) -> Result<Option<Vec<f32>>> {
        let sh = r.shape;
        let (g, d) = (sh.group(), sh.head_dim);
        // An exact plan is a scan: its pins log no accesses (as on the CPU).
        let reader = if works.iter().all(|w| w.scan) { manager.scan_reader() } else { manager.reader() };
        let locations: Vec<_> = works.iter().flat_map(|w| w.locations.iter().copied()).collect();
        let pins = reader.pin_all(&locations).into_iter().collect::<std::result::Result<Vec<_>, _>>()?;
        let page = manager.layout().block_bytes();
        let gpu_base = manager.gpu_device_base();
        let mut pinned = pins.iter();
        let mut groups: Vec<Vec<PagedGroup>> = Vec::with_capacity(works.len());
        let (mut gpu_blocks, mut host_blocks) = (0, 0);
        let zone = meter.map(|m| m.zone(if works.iter().all(|w| w.scan) { Zone::Scan } else { Zone::Retrieve }));
        for w in works {
            let mut list = Vec::with_capacity(w.groups.len());
            for grp in &w.groups {
                let mut pages = Vec::with_capacity(grp.blocks as usize);
                for pin in pinned.by_ref().take(grp.blocks as usize) {
                    let Some(slot) = pin.slot() else { return Ok(None) }; // a Disk read: CPU
                    let base = match (pin.tier(), gpu_base) {
                        (Tier::Gpu, Some(b)) => {
                            gpu_blocks += 1;
                            b
                        }
                        (Tier::Gpu, None) => return Ok(None),
                        _ => {
                            host_blocks += 1;
                            host_base
                        }
                    };
                    pages.push(base + u64::from(slot) * page as u64);
                    if let Some(z) = zone {
                        z.pinned(pin.tier(), page);
                    }
                }
                if let Some(z) = zone {
                    z.block_rows(grp.mask.count_ones() as usize);
                }
                list.push(PagedGroup { pages, rows: grp.rows as usize, mask: grp.mask });
            }
            groups.push(list);
        }
        trace.mark("pins+pages");
        let gpu = self.gpu.backend(d)?;
        let mut parts: Vec<Partial> = (0..sh.q_heads).map(|_| Partial::empty(d)).collect();
        let launched = Instant::now();
        if groups.iter().any(|l| !l.is_empty()) {
            let mut job = gpu.prepare_hack_paged(&sh, &r.queries, &groups, page)?;
            gpu.launch_hack_paged(&mut job)?;
            trace.mark("launch");
            for (p, got) in parts.iter_mut().zip(gpu.fetch_hack_partials(&job)?) {
                p.merge(&got);
            }
        }
        if let Some(z) = zone {
            z.gpu_since(launched);
        }
        // The kernel is done: the blocks may move again.
        drop(pins);
        drop(reader);
        trace.mark("fetch");
        run.gpu_blocks += gpu_blocks;
        run.host_blocks += host_blocks;
        Ok(Some(merged_output(parts, works.iter().map(|w| &w.cpu[..]), g, trace)))
    }
}

/// Counts a device-selected step of `dl` into `meter` from what the step reports it read
/// (`got`): the device copy's steady rows (once per KV head), per KV head the rows of every
/// real cluster it retrieved and their blocks (`R` rows each; a missed cluster's from the
/// Host arena, a hit's from the Gpu tier), and the real clusters it did not retrieve,
/// which it estimated. Cluster sizes come from the host layer the copy was made of.
fn meter_device_step(meter: &Meter, layer: &Layer, dl: &DeviceLayer, got: &WaveFetched, d: usize, block_bytes: usize) {
    let Some(clustered) = layer.method.clustered() else { return };
    let kv_heads = dl.real_clusters.len();
    let steady = dl.wave.steady_rows() * kv_heads;
    meter.zone(Zone::Steady).index_rows(steady, steady * 2 * d * 2);
    let (retrieve, estimate) = (meter.zone(Zone::Retrieve), meter.zone(Zone::Estimate));
    let per_block = dl.tokens_per_block.max(1);
    for (h, (chosen, missed)) in got.selection().iter().zip(got.missed()).enumerate() {
        let (real, sizes) = (dl.real_clusters[h], clustered.cluster_sizes(h));
        let mut retrieved = 0;
        for &c in chosen.iter().filter(|&&c| c < real) {
            let size = sizes.get(c as usize).copied().unwrap_or(0) as usize;
            if dl.block_pages.is_none() {
                let tier = if missed.contains(&c) { Tier::Host } else { Tier::Gpu };
                for _ in 0..size.div_ceil(per_block) {
                    retrieve.pinned(tier, block_bytes);
                }
            }
            retrieve.block_rows(size);
            retrieved += 1;
        }
        estimate.index_rows(real as usize - retrieved, 0);
    }
    // A 2-bit layer's reads are its listed value blocks, each spanning a few arena blocks.
    if let (Some(end), Some(pages)) = (dl.wave.block_id_end(), &dl.block_pages) {
        for (h, words) in got.blocks.chunks(got.blocks_per_head.max(1)).enumerate() {
            for &w in words {
                let (id, tier) = if w < 0 { (!w as u32, Tier::Host) } else { (w as u32, Tier::Gpu) };
                if id >= end.get(h).copied().unwrap_or(0) {
                    continue;
                }
                let n = pages.get(h).and_then(|p| p.get(id as usize)).copied().unwrap_or(0);
                for _ in 0..n {
                    retrieve.pinned(tier, block_bytes);
                }
            }
        }
    }
}

/// The request's output: the GPU's partials `parts` (one per query head) merged with each KV
/// head's CPU partials (`cpu`, one slice of `g` per KV head: the steady and estimation zones).
fn merged_output<'a>(
    mut parts: Vec<Partial>,
    cpu: impl Iterator<Item = &'a [Partial]>,
    g: usize,
    trace: &mut PhaseTrace,
) -> Vec<f32> {
    for (h, group) in cpu.enumerate() {
        for (j, c) in group.iter().enumerate() {
            parts[h * g + j].merge(c);
        }
    }
    trace.mark("merge");
    trace.print();
    parts.iter().flat_map(Partial::finish).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upload that ran out of device memory frees the idle kv43 copy used longest ago;
    /// only the device's out-of-memory error counts as that (a launch failure stays).
    #[test]
    fn room_for_a_kv43_copy_is_made_from_the_least_recently_used_and_only_for_out_of_memory() {
        let mut copies: HashMap<(ContextId, usize), u64> = HashMap::new();
        assert_eq!(least_recent_kv43(&copies, |&u| u), None, "nothing to free");
        copies.insert((ContextId(1), 0), 7);
        copies.insert((ContextId(2), 3), 2);
        copies.insert((ContextId(1), 1), 9);
        assert_eq!(least_recent_kv43(&copies, |&u| u), Some((ContextId(2), 3)));
        copies.remove(&(ContextId(2), 3));
        assert_eq!(least_recent_kv43(&copies, |&u| u), Some((ContextId(1), 0)));
        let gpu = |message: &str| {
            Error::Kernel(attnstore_kernels::Error::Gpu { what: "allocating", message: message.to_string() })
        };
        assert!(out_of_device_memory(&gpu("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")")));
        assert!(!out_of_device_memory(&gpu("DriverError(CUDA_ERROR_LAUNCH_FAILED, \"unspecified launch failure\")")));
        assert!(!out_of_device_memory(&Error::InvalidSpec("OUT_OF_MEMORY".into())));
    }
}
