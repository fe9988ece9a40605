//! The wave index's whole build on the device (`build.cu`): a layer's f16 KV in device
//! memory is centred, clustered (segmented spherical k-means with the assignment on the
//! tensor cores) and laid out cluster after cluster, with its meta index, without a round
//! trip to the host. [`DeviceLayout::download`] hands the result over as a
//! [`ClusteredLayer`], the CPU build's type.

use super::{gpu_err, DeviceKv, GpuBackend};
use crate::cpu::kmeans::initial_rows;
use crate::error::{Error, Result};
use crate::layout::{ClusteredLayer, LayoutParams};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::f16;
use half::vec::HalfBitsVecExt;
use rayon::prelude::*;

/// Most clusters one segment may have on the device path (a segment's cluster counts pass
/// through one CTA's shared memory).
pub const MAX_SEGMENT_CLUSTERS: usize = 8192;

/// A layer laid out by [`GpuBackend::build_layout`], in device memory: the fields of a
/// [`ClusteredLayer`] (same meaning and order), plus how its k-means ended.
pub struct DeviceLayout {
    /// KV heads.
    pub kv_heads: usize,
    /// Rows per head (every token once).
    pub rows: usize,
    /// Rows per head in clusters; the steady zone follows.
    pub indexed: usize,
    /// Clusters per head.
    pub clusters: usize,
    /// K-means update steps run.
    pub iterations: usize,
    /// Whether the last assignment changed nothing.
    pub converged: bool,
    keys: CudaSlice<u16>,
    values: CudaSlice<u16>,
    positions: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    centroids: CudaSlice<u16>,
    value_means: CudaSlice<u16>,
    head_dim: usize,
    geo: Geometry,
    tokens_per_cluster: usize,
}

/// Where a layer's segments and clusters are (every segment but the last is full).
#[derive(Debug, Clone, Copy)]
struct Geometry {
    sink: usize,
    indexed: usize,
    seg: usize,
    segments: usize,
    /// Clusters of a full segment.
    kfull: usize,
    /// Clusters per head.
    clusters: usize,
}

impl Geometry {
    fn new(tokens: usize, p: LayoutParams) -> Result<Self> {
        p.validate()?;
        let steady = (p.sink_tokens + p.local_tokens).min(tokens);
        let sink = p.sink_tokens.min(steady);
        let indexed = tokens - steady;
        let seg = p.segment_tokens.min(indexed.max(1));
        let segments = indexed.div_ceil(seg);
        let kfull = seg.div_ceil(p.tokens_per_cluster);
        let last = indexed - segments.saturating_sub(1) * seg;
        let clusters = if segments == 0 { 0 } else { (segments - 1) * kfull + last.div_ceil(p.tokens_per_cluster) };
        if kfull > MAX_SEGMENT_CLUSTERS {
            return Err(Error::InvalidArgument {
                what: "layout params",
                message: format!(
                    "the device build takes at most {MAX_SEGMENT_CLUSTERS} clusters per segment, got {kfull} \
                     ({} tokens per segment, {} per cluster)",
                    p.segment_tokens, p.tokens_per_cluster
                ),
            });
        }
        Ok(Self { sink, indexed, seg, segments, kfull, clusters })
    }

    /// Rows of segment `s`.
    fn len(&self, s: usize) -> usize {
        self.seg.min(self.indexed - s * self.seg)
    }
}

/// `ATTNSTORE_BUILD_TRACE`: where a device build's time goes. When set, every phase waits
/// for the device and its time is summed under its name (this serializes the phases; the
/// untraced build only waits once per k-means step, for its change count).
struct Trace {
    at: Option<std::time::Instant>,
    phases: Vec<(&'static str, f64, usize)>,
}

impl Trace {
    fn new(s: &cudarc::driver::CudaStream) -> Result<Self> {
        if std::env::var_os("ATTNSTORE_BUILD_TRACE").is_none() {
            return Ok(Self { at: None, phases: Vec::new() });
        }
        s.synchronize().map_err(gpu_err("waiting for the device"))?;
        Ok(Self { at: Some(std::time::Instant::now()), phases: Vec::new() })
    }

    fn mark(&mut self, s: &cudarc::driver::CudaStream, phase: &'static str) -> Result<()> {
        let Some(at) = self.at else { return Ok(()) };
        s.synchronize().map_err(gpu_err("waiting for the device"))?;
        let now = std::time::Instant::now();
        let ms = (now - at).as_secs_f64() * 1e3;
        match self.phases.iter_mut().find(|p| p.0 == phase) {
            Some(p) => {
                p.1 += ms;
                p.2 += 1;
            }
            None => self.phases.push((phase, ms, 1)),
        }
        self.at = Some(now);
        Ok(())
    }

    fn report(&self, iterations: usize) {
        if self.at.is_some() {
            let parts: Vec<String> = self.phases.iter().map(|(p, ms, n)| format!("{p} {ms:.2} ms ({n}×)")).collect();
            eprintln!("attnstore-kernels: device index build, {iterations} update steps: {}", parts.join(", "));
        }
    }
}

/// A device buffer of `len` elements that the build's kernels write in full before anything
/// reads it (each caller names the kernel that does), so it is not cleared first: the
/// layout's and the k-means' buffers are hundreds of MB at 128K tokens.
#[allow(unsafe_code, reason = "uninitialized device allocation")]
fn written<T: cudarc::driver::DeviceRepr>(
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>> {
    // SAFETY: the memory is device memory of plain integer types (every bit pattern is a
    // value), and the build writes every element before it reads or returns it: keys, values
    // and positions by lay_gather (indexed positions by lay_rank first), centroids by lay_init,
    // value means by lay_means, unit rows and assignments by lay_unit, member lists by lay_rank.
    unsafe { s.alloc::<T>(len) }.map_err(gpu_err("allocating device build buffers"))
}

/// Launch geometry of one thread per item, `per` threads an item, 256 a CTA.
fn spread(items: usize, per: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: ((items * per).div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

impl GpuBackend {
    /// Builds the wave layout of one layer whose KV (`kv`: `kv_heads × tokens × head_dim`
    /// f16, as [`GpuBackend::upload`] or a prefill leaves it) is in device memory, as
    /// [`ClusteredLayer::build`] does on the CPU: per (head, segment) the keys are centred and
    /// normalized, clustered from the same initial rows by spherical k-means (at most
    /// `params.max_iters` update steps, fewer once no row moves), and every head's rows are
    /// laid out cluster after cluster (stable: token order within a cluster), then the sinks
    /// and the local window. Results differ from the CPU's only where f16 unit rows and the
    /// tensor cores' rounding flip a near tie, and where a cluster loses every member (the
    /// CPU re-seeds it; here it keeps its centroid).
    pub fn build_layout(&self, kv: &DeviceKv, params: LayoutParams) -> Result<DeviceLayout> {
        self.build_layout_seeded(kv, params, &|h, s| params.seed ^ ((h as u64) << 32 | s as u64))
    }

    /// [`GpuBackend::build_layout`] with the k-means of segment `s` of head `h` seeded with
    /// `seed(h, s)` (e.g. the wave index's own seeds, so that the device starts from the rows
    /// the index's CPU build would).
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub fn build_layout_seeded(
        &self,
        kv: &DeviceKv,
        params: LayoutParams,
        seed: &(dyn Fn(usize, usize) -> u64 + Sync),
    ) -> Result<DeviceLayout> {
        let d = self.head_dim;
        let tokens = kv.rows;
        let kv_heads = kv.keys.len() / (tokens * d).max(1);
        let geo = Geometry::new(tokens, params)?;
        if kv_heads * tokens > i32::MAX as usize / 2 || kv_heads * geo.clusters > i32::MAX as usize / 32 {
            return Err(Error::InvalidArgument {
                what: "layer",
                message: format!("{kv_heads} heads × {tokens} tokens is beyond the device build's 2^30 rows"),
            });
        }
        let jobs = kv_heads * geo.segments;
        if jobs > 65_535 {
            // The assignment's grid has a CTA row per job (a grid's y extent is at most 65535).
            return Err(Error::InvalidArgument {
                what: "layer",
                message: format!(
                    "{kv_heads} heads × {} segments is beyond the device build's 65535 (head, segment) jobs",
                    geo.segments
                ),
            });
        }
        let s = &self.stream;
        let up = gpu_err;
        let mut trace = Trace::new(s)?;
        let units = kv_heads * geo.indexed;
        let n_cent = kv_heads * geo.clusters;
        let (tokens_i, sink_i, indexed_i, seg_i) = (tokens as i32, geo.sink as i32, geo.indexed as i32, geo.seg as i32);
        let (segments_i, kfull_i, clusters_i) = (geo.segments as i32, geo.kfull as i32, geo.clusters as i32);
        let (heads_i, tpc_i) = (kv_heads as i32, params.tokens_per_cluster as i32);
        let lay_len = (kv_heads * tokens * d).max(1);
        let mut keys = written::<u16>(s, lay_len)?;
        let mut values = written::<u16>(s, lay_len)?;
        let mut positions = written::<u32>(s, (kv_heads * tokens).max(1))?;
        // Zeros: a layer with nothing indexed has no sort to write its (all-zero) offsets.
        let mut offsets =
            s.alloc_zeros::<u32>((kv_heads * (geo.clusters + 1)).max(1)).map_err(up("allocating the layout"))?;
        let mut centroids = written::<u16>(s, (n_cent * d).max(1))?;
        let mut value_means = written::<u16>(s, (n_cent * d).max(1))?;
        let (mut iterations, mut converged) = (0, true);
        trace.mark(s, "allocation")?;
        if jobs > 0 {
            let mut mean_sum = s.alloc_zeros::<f32>(jobs * d).map_err(up("allocating k-means buffers"))?;
            let mut unit = written::<u16>(s, units * d)?;
            let mut assign = written::<i32>(s, units)?;
            let mut changed = s.alloc_zeros::<i32>(1).map_err(up("allocating k-means buffers"))?;

            let cfg = LaunchConfig { grid_dim: (jobs as u32, 8, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            let mut b = s.launch_builder(&self.build.mean);
            b.arg(&kv.keys).arg(&tokens_i).arg(&sink_i).arg(&indexed_i).arg(&seg_i).arg(&segments_i).arg(&mut mean_sum);
            // SAFETY: job j's rows sink + s·seg + r (r < its length) are < tokens of head h <
            // kv_heads, inside kv.keys; mean_sum holds jobs × head_dim floats.
            unsafe { b.launch(cfg) }.map_err(up("launching lay_mean"))?;
            let mut b = s.launch_builder(&self.build.unit);
            b.arg(&kv.keys).arg(&heads_i).arg(&tokens_i).arg(&sink_i).arg(&indexed_i).arg(&seg_i).arg(&segments_i);
            b.arg(&mean_sum).arg(&mut unit).arg(&mut assign);
            // SAFETY: one warp per unit row < kv_heads × indexed (checked in the kernel); reads
            // a key row of its head and its job's mean, writes its own unit row and assignment.
            unsafe { b.launch(spread(units, 32)) }.map_err(up("launching lay_unit"))?;
            // Initial centroids: the rows the CPU's k-means starts from (seeded per job),
            // drawn on host threads while the device centres the keys.
            let init: Vec<i32> = (0..jobs)
                .into_par_iter()
                .flat_map_iter(|j| {
                    let (h, sg) = (j / geo.segments, j % geo.segments);
                    let n = geo.len(sg);
                    initial_rows(n, n.div_ceil(params.tokens_per_cluster), seed(h, sg)).into_iter().map(|r| r as i32)
                })
                .collect();
            let init = s.clone_htod(&init).map_err(up("copying initial rows"))?;
            let mut b = s.launch_builder(&self.build.init);
            b.arg(&unit).arg(&init).arg(&heads_i).arg(&indexed_i).arg(&seg_i).arg(&kfull_i).arg(&clusters_i);
            b.arg(&mut centroids);
            // SAFETY: one warp per centroid < kv_heads × clusters; init holds one row per
            // centroid, below its job's length (initial_rows), so the unit row is in bounds.
            unsafe { b.launch(spread(n_cent, 32)) }.map_err(up("launching lay_init"))?;

            let rows_per_cta = 4 * 16 * if d <= 128 { 2 } else { 1 }; // AS_WARPS · 16 · AS_MT
            let assign_cfg = LaunchConfig {
                grid_dim: (geo.seg.div_ceil(rows_per_cta) as u32, jobs as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let rank_cfg = LaunchConfig {
                grid_dim: (jobs as u32, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: (geo.kfull * 4) as u32,
            };
            let mut members = written::<u32>(s, units)?;
            let mut member_offsets = written::<u32>(s, kv_heads * (geo.clusters + 1))?;
            let zero = 0i32;
            trace.mark(s, "centring, unit rows, initial centroids")?;
            converged = false;
            loop {
                s.memset_zeros(&mut changed).map_err(up("clearing the change count"))?;
                let mut b = s.launch_builder(&self.build.assign);
                b.arg(&unit).arg(&centroids).arg(&indexed_i).arg(&seg_i).arg(&segments_i).arg(&kfull_i);
                b.arg(&clusters_i).arg(&tpc_i).arg(&mut assign).arg(&mut changed);
                // SAFETY: CTA (x, j) reads unit rows of job j below its length and the job's
                // ⌈len / tpc⌉ centroids (< clusters of the head), writes those rows' assignment.
                unsafe { b.launch(assign_cfg) }.map_err(up("launching lay_assign"))?;
                let moved = s.clone_dtoh(&changed).map_err(up("copying the change count"))?[0];
                trace.mark(s, "assignment")?;
                if iterations > 0 && moved == 0 {
                    converged = true;
                    break;
                }
                if iterations == params.max_iters {
                    break;
                }
                iterations += 1;
                let mut b = s.launch_builder(&self.build.rank);
                b.arg(&assign).arg(&zero).arg(&indexed_i).arg(&indexed_i).arg(&seg_i).arg(&segments_i).arg(&kfull_i);
                b.arg(&clusters_i).arg(&tpc_i).arg(&mut member_offsets).arg(&mut members);
                // SAFETY: one warp per job; its cursor array holds kfull ints (the dynamic
                // size), every assignment is below the job's cluster count; member offsets of
                // head h are written below clusters + 1, its members below indexed.
                unsafe { b.launch(rank_cfg) }.map_err(up("launching lay_rank"))?;
                let mut b = s.launch_builder(&self.build.centroids);
                b.arg(&unit).arg(&member_offsets).arg(&members).arg(&heads_i).arg(&indexed_i).arg(&clusters_i);
                b.arg(&mut centroids);
                // SAFETY: one warp per centroid < kv_heads × clusters; its members lie between
                // two offsets of its head (≤ indexed) and name rows below indexed.
                unsafe { b.launch(spread(n_cent, 32)) }.map_err(up("launching lay_centroids"))?;
                trace.mark(s, "centroid update")?;
            }
            let mut b = s.launch_builder(&self.build.rank);
            b.arg(&assign).arg(&sink_i).arg(&indexed_i).arg(&tokens_i).arg(&seg_i).arg(&segments_i).arg(&kfull_i);
            b.arg(&clusters_i).arg(&tpc_i).arg(&mut offsets).arg(&mut positions);
            // SAFETY: as above, with the layout's offsets and positions (head h's below
            // clusters + 1 and indexed ≤ tokens).
            unsafe { b.launch(rank_cfg) }.map_err(up("launching lay_rank"))?;
        }
        if kv_heads * tokens > 0 {
            let mut b = s.launch_builder(&self.build.gather);
            b.arg(&kv.keys).arg(&kv.values).arg(&heads_i).arg(&tokens_i).arg(&sink_i).arg(&indexed_i);
            b.arg(&mut positions).arg(&mut keys).arg(&mut values);
            // SAFETY: head_dim / 8 threads per layout row < kv_heads × tokens; every position
            // is a token < tokens (lay_rank's indexed rows, the steady zone's computed here).
            unsafe { b.launch(spread(kv_heads * tokens, d / 8)) }.map_err(up("launching lay_gather"))?;
        }
        if n_cent > 0 {
            let rows_i = tokens as i32;
            let mut b = s.launch_builder(&self.build.means);
            b.arg(&keys).arg(&values).arg(&offsets).arg(&heads_i).arg(&rows_i).arg(&clusters_i);
            b.arg(&mut centroids).arg(&mut value_means);
            // SAFETY: one warp per cluster < n_cent; its rows lie between two offsets of its
            // head, both ≤ indexed ≤ tokens.
            unsafe { b.launch(spread(n_cent, 32)) }.map_err(up("launching lay_means"))?;
        }
        trace.mark(s, "layout (counting sort, gather, cluster means)")?;
        trace.report(iterations);
        Ok(DeviceLayout {
            kv_heads,
            rows: tokens,
            indexed: geo.indexed,
            clusters: geo.clusters,
            iterations,
            converged,
            keys,
            values,
            positions,
            offsets,
            centroids,
            value_means,
            head_dim: d,
            geo,
            tokens_per_cluster: params.tokens_per_cluster,
        })
    }
}

impl DeviceLayout {
    /// Copies the layout to host memory as a [`ClusteredLayer`] (waits for the build).
    pub fn download(&self, gpu: &GpuBackend) -> Result<ClusteredLayer> {
        let s = gpu.stream();
        let ints = |x: &CudaSlice<u32>, n: usize| -> Result<Vec<u32>> {
            let mut v = s.clone_dtoh(x).map_err(gpu_err("copying the layout back"))?;
            v.truncate(n);
            Ok(v)
        };
        // f16 bits come back as u16 and are reinterpreted in place (no per-element pass).
        let bits = |x: &CudaSlice<u16>, n: usize| -> Result<Vec<f16>> {
            let mut v = s.clone_dtoh(x).map_err(gpu_err("copying the layout back"))?;
            v.truncate(n);
            Ok(v.reinterpret_into())
        };
        let (h, d) = (self.kv_heads, self.head_dim);
        let kv = h * self.rows * d;
        Ok(ClusteredLayer {
            kv_heads: h,
            head_dim: d,
            rows: self.rows,
            indexed: self.indexed,
            clusters: self.clusters,
            keys: bits(&self.keys, kv)?,
            values: bits(&self.values, kv)?,
            positions: ints(&self.positions, h * self.rows)?,
            offsets: ints(&self.offsets, h * (self.clusters + 1))?,
            centroids: bits(&self.centroids, h * self.clusters * d)?,
            value_means: bits(&self.value_means, h * self.clusters * d)?,
        })
    }

    /// Every segment of a head: its first row among the indexed rows, its rows, and its
    /// clusters' numbers within the head (the same for every head).
    pub fn segments(&self) -> Vec<(usize, usize, std::ops::Range<usize>)> {
        (0..self.geo.segments)
            .map(|s| {
                let len = self.geo.len(s);
                let c0 = s * self.geo.kfull;
                (s * self.geo.seg, len, c0..c0 + len.div_ceil(self.tokens_per_cluster))
            })
            .collect()
    }

    /// Copies back only the clustering: the token of every row (`kv_heads × rows`, cluster
    /// order, the steady zone last) and every head's cluster offsets (`kv_heads ×
    /// (clusters + 1)`), as in a [`ClusteredLayer`]. What a host that keeps its own copy of
    /// the KV needs to lay it out.
    pub fn download_order(&self, gpu: &GpuBackend) -> Result<(Vec<u32>, Vec<u32>)> {
        let s = gpu.stream();
        let mut positions = s.clone_dtoh(&self.positions).map_err(gpu_err("copying the layout back"))?;
        let mut offsets = s.clone_dtoh(&self.offsets).map_err(gpu_err("copying the layout back"))?;
        positions.truncate(self.kv_heads * self.rows);
        offsets.truncate(self.kv_heads * (self.clusters + 1));
        Ok((positions, offsets))
    }

    /// Waits until the build's kernels are done (for timing).
    pub fn synchronize(&self, gpu: &GpuBackend) -> Result<()> {
        gpu.stream().synchronize().map_err(gpu_err("waiting for the layout build"))
    }
}
