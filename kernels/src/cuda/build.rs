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
        let dims = Dims::new(kv_heads, tokens, &geo, params.tokens_per_cluster)?;
        let s = &self.stream;
        let mut trace = Trace::new(s)?;
        let (n_cent, lay_len) = (kv_heads * geo.clusters, (kv_heads * tokens * d).max(1));
        let mut out = DeviceLayout {
            kv_heads,
            rows: tokens,
            indexed: geo.indexed,
            clusters: geo.clusters,
            iterations: 0,
            converged: true,
            keys: written(s, lay_len)?,
            values: written(s, lay_len)?,
            positions: written(s, (kv_heads * tokens).max(1))?,
            // Zeros: a layer with nothing indexed has no sort to write its (all-zero) offsets.
            offsets: s.alloc_zeros((kv_heads * (geo.clusters + 1)).max(1)).map_err(gpu_err("allocating the layout"))?,
            centroids: written(s, (n_cent * d).max(1))?,
            value_means: written(s, (n_cent * d).max(1))?,
            head_dim: d,
            geo,
            tokens_per_cluster: params.tokens_per_cluster,
        };
        trace.mark(s, "allocation")?;
        if dims.jobs > 0 {
            let (unit, mut assign) = self.unit_rows(kv, &dims, params, seed, &mut out.centroids)?;
            trace.mark(s, "centring, unit rows, initial centroids")?;
            (out.iterations, out.converged) =
                self.kmeans(&dims, params.max_iters, &unit, &mut assign, &mut out.centroids, &mut trace)?;
            self.rank(&dims, &assign, dims.sink, dims.tokens, &mut out.offsets, &mut out.positions)?;
        }
        self.lay_out(kv, &dims, &mut out)?;
        trace.mark(s, "layout (counting sort, gather, cluster means)")?;
        trace.report(out.iterations);
        Ok(out)
    }

    /// Centres every job's keys, writes them as f16 unit rows (each row's assignment set to
    /// none) and the initial centroids; returns the unit rows and the assignments.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn unit_rows(
        &self,
        kv: &DeviceKv,
        dims: &Dims,
        params: LayoutParams,
        seed: &(dyn Fn(usize, usize) -> u64 + Sync),
        centroids: &mut CudaSlice<u16>,
    ) -> Result<(CudaSlice<u16>, CudaSlice<i32>)> {
        let (s, d, up) = (&self.stream, self.head_dim, gpu_err);
        let mut mean_sum = s.alloc_zeros::<f32>(dims.jobs * d).map_err(up("allocating k-means buffers"))?;
        let mut unit = written::<u16>(s, dims.units * d)?;
        let mut assign = written::<i32>(s, dims.units)?;
        let cfg = LaunchConfig { grid_dim: (dims.jobs as u32, 8, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = s.launch_builder(&self.build.mean);
        b.arg(&kv.keys).arg(&dims.tokens).arg(&dims.sink).arg(&dims.indexed).arg(&dims.seg).arg(&dims.segments);
        b.arg(&mut mean_sum);
        // SAFETY: job j's rows sink + s·seg + r (r < its length) are < tokens of head h <
        // kv_heads, inside kv.keys; mean_sum holds jobs × head_dim floats.
        unsafe { b.launch(cfg) }.map_err(up("launching lay_mean"))?;
        let mut b = s.launch_builder(&self.build.unit);
        b.arg(&kv.keys).arg(&dims.heads).arg(&dims.tokens).arg(&dims.sink).arg(&dims.indexed).arg(&dims.seg);
        b.arg(&dims.segments).arg(&mean_sum).arg(&mut unit).arg(&mut assign);
        // SAFETY: one warp per unit row < kv_heads × indexed (checked in the kernel); reads
        // a key row of its head and its job's mean, writes its own unit row and assignment.
        unsafe { b.launch(spread(dims.units, 32)) }.map_err(up("launching lay_unit"))?;
        // Initial centroids: the rows the CPU's k-means starts from (seeded per job), drawn
        // on host threads while the device centres the keys.
        let segments = dims.segments as usize;
        let init: Vec<i32> = (0..dims.jobs)
            .into_par_iter()
            .flat_map_iter(|j| {
                let (h, sg) = (j / segments, j % segments);
                let n = (dims.seg as usize).min(dims.indexed as usize - sg * dims.seg as usize);
                initial_rows(n, n.div_ceil(params.tokens_per_cluster), seed(h, sg)).into_iter().map(|r| r as i32)
            })
            .collect();
        let init = s.clone_htod(&init).map_err(up("copying initial rows"))?;
        let mut b = s.launch_builder(&self.build.init);
        b.arg(&unit).arg(&init).arg(&dims.heads).arg(&dims.indexed).arg(&dims.seg).arg(&dims.kfull);
        b.arg(&dims.clusters).arg(centroids);
        // SAFETY: one warp per centroid < kv_heads × clusters; init holds one row per
        // centroid, below its job's length (initial_rows), so the unit row is in bounds.
        unsafe { b.launch(spread(dims.centroids, 32)) }.map_err(up("launching lay_init"))?;
        Ok((unit, assign))
    }

    /// Spherical k-means steps until no row moves (after at least one step) or `max_iters`
    /// steps ran, ending on an assignment; returns the steps and whether it converged.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn kmeans(
        &self,
        dims: &Dims,
        max_iters: usize,
        unit: &CudaSlice<u16>,
        assign: &mut CudaSlice<i32>,
        centroids: &mut CudaSlice<u16>,
        trace: &mut Trace,
    ) -> Result<(usize, bool)> {
        let (s, d, up) = (&self.stream, self.head_dim, gpu_err);
        let mut changed = s.alloc_zeros::<i32>(1).map_err(up("allocating k-means buffers"))?;
        let mut members = written::<u32>(s, dims.units)?;
        let mut member_offsets = written::<u32>(s, dims.heads as usize * (dims.clusters as usize + 1))?;
        let rows_per_cta = 4 * 16 * if d <= 128 { 2 } else { 1 }; // AS_WARPS · 16 · AS_MT
        let assign_cfg = LaunchConfig {
            grid_dim: ((dims.seg as usize).div_ceil(rows_per_cta) as u32, dims.jobs as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut iterations = 0;
        loop {
            s.memset_zeros(&mut changed).map_err(up("clearing the change count"))?;
            let mut b = s.launch_builder(&self.build.assign);
            b.arg(unit).arg(&*centroids).arg(&dims.indexed).arg(&dims.seg).arg(&dims.segments).arg(&dims.kfull);
            b.arg(&dims.clusters).arg(&dims.tpc).arg(&mut *assign).arg(&mut changed);
            // SAFETY: CTA (x, j) reads unit rows of job j below its length and the job's
            // ⌈len / tpc⌉ centroids (< clusters of the head), writes those rows' assignment.
            unsafe { b.launch(assign_cfg) }.map_err(up("launching lay_assign"))?;
            let moved = s.clone_dtoh(&changed).map_err(up("copying the change count"))?[0];
            trace.mark(s, "assignment")?;
            if iterations > 0 && moved == 0 {
                return Ok((iterations, true));
            }
            if iterations == max_iters {
                return Ok((iterations, false));
            }
            iterations += 1;
            self.rank(dims, assign, 0, dims.indexed, &mut member_offsets, &mut members)?;
            let mut b = s.launch_builder(&self.build.centroids);
            b.arg(unit).arg(&member_offsets).arg(&members).arg(&dims.heads).arg(&dims.indexed).arg(&dims.clusters);
            b.arg(&mut *centroids);
            // SAFETY: one warp per centroid < kv_heads × clusters; its members lie between
            // two offsets of its head (≤ indexed) and name rows below indexed.
            unsafe { b.launch(spread(dims.centroids, 32)) }.map_err(up("launching lay_centroids"))?;
            trace.mark(s, "centroid update")?;
        }
    }

    /// `lay_rank`: every job's rows sorted by cluster (stable) into `order` (row stride
    /// `row_stride`, values from `first`), and each cluster's offset within its head.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn rank(
        &self,
        dims: &Dims,
        assign: &CudaSlice<i32>,
        first: i32,
        row_stride: i32,
        offsets: &mut CudaSlice<u32>,
        order: &mut CudaSlice<u32>,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (dims.jobs as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: (dims.kfull * 4) as u32,
        };
        let mut b = self.stream.launch_builder(&self.build.rank);
        b.arg(assign).arg(&first).arg(&dims.indexed).arg(&row_stride).arg(&dims.seg).arg(&dims.segments);
        b.arg(&dims.kfull).arg(&dims.clusters).arg(&dims.tpc).arg(offsets).arg(order);
        // SAFETY: one warp per job; its cursor array holds kfull ints (the dynamic size) and
        // every assignment is below the job's cluster count; head h's offsets are written
        // below clusters + 1 and its order below indexed ≤ row_stride (the callers pass
        // indexed or tokens, with buffers of kv_heads rows of that stride).
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching lay_rank"))?;
        Ok(())
    }

    /// The layout's rows (indexed ones from their sorted positions, then the steady zone) and
    /// every cluster's mean key and value.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn lay_out(&self, kv: &DeviceKv, dims: &Dims, out: &mut DeviceLayout) -> Result<()> {
        let (s, d) = (&self.stream, self.head_dim);
        let rows = dims.heads as usize * dims.tokens as usize;
        if rows > 0 {
            let mut b = s.launch_builder(&self.build.gather);
            b.arg(&kv.keys).arg(&kv.values).arg(&dims.heads).arg(&dims.tokens).arg(&dims.sink).arg(&dims.indexed);
            b.arg(&mut out.positions).arg(&mut out.keys).arg(&mut out.values);
            // SAFETY: head_dim / 8 threads per layout row < kv_heads × tokens; every position
            // is a token < tokens (lay_rank's indexed rows, the steady zone's computed here).
            unsafe { b.launch(spread(rows, d / 8)) }.map_err(gpu_err("launching lay_gather"))?;
        }
        if dims.centroids > 0 {
            let mut b = s.launch_builder(&self.build.means);
            b.arg(&out.keys).arg(&out.values).arg(&out.offsets).arg(&dims.heads).arg(&dims.tokens);
            b.arg(&dims.clusters).arg(&mut out.centroids).arg(&mut out.value_means);
            // SAFETY: one warp per cluster < kv_heads × clusters; its rows lie between two
            // offsets of its head, both ≤ indexed ≤ tokens.
            unsafe { b.launch(spread(dims.centroids, 32)) }.map_err(gpu_err("launching lay_means"))?;
        }
        Ok(())
    }
}

/// A build's sizes as its kernels take them (i32), checked to fit, and its launch counts.
struct Dims {
    heads: i32,
    tokens: i32,
    sink: i32,
    indexed: i32,
    seg: i32,
    segments: i32,
    kfull: i32,
    clusters: i32,
    tpc: i32,
    /// (head, segment) jobs.
    jobs: usize,
    /// Indexed rows of all heads.
    units: usize,
    /// Centroids of all heads.
    centroids: usize,
}

impl Dims {
    fn new(kv_heads: usize, tokens: usize, geo: &Geometry, tokens_per_cluster: usize) -> Result<Self> {
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
        Ok(Self {
            heads: kv_heads as i32,
            tokens: tokens as i32,
            sink: geo.sink as i32,
            indexed: geo.indexed as i32,
            seg: geo.seg as i32,
            segments: geo.segments as i32,
            kfull: geo.kfull as i32,
            clusters: geo.clusters as i32,
            tpc: tokens_per_cluster as i32,
            jobs,
            units: kv_heads * geo.indexed,
            centroids: kv_heads * geo.clusters,
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
