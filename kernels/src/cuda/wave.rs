//! A whole wave-index decode step on the GPU (`wave.cu`): centroid scoring and top-r, the
//! retrieved clusters expanded into a row list (Gpu-tier hits as cache rows), attention over
//! those rows and the steady zone, the estimation partial of every other cluster (on a
//! second stream, beside the row list and the attention), and the merge — no host work
//! between the launches. The host only reads
//! the selection back afterwards, to keep the Gpu tier (admissions are the maintainer's
//! work, off the decode path).

use super::MAX_GROUP;
use super::{
    chunk_rows, device_address, gpu_err, DecodeJob, DeviceCentroids, GpuBackend, GpuCache, KvPointers, SelectJob,
};
use crate::error::{Error, Result};
use crate::layout::ClusteredLayer;
use crate::shape::AttnShape;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

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
}

impl DeviceWave {
    /// Clusters per KV head.
    pub fn clusters(&self) -> usize {
        self.clusters
    }

    /// Rows per KV head (the KV a launch reads must hold at least these).
    pub fn rows(&self) -> usize {
        self.rows
    }
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

/// The buffers of one wave decode step (reused step after step): the selection, the row
/// lists, the partials of attention and estimation, the output.
pub struct WaveJob {
    select: SelectJob,
    decode: DecodeJob,
    scan: CudaSlice<i32>,
    mark: CudaSlice<i32>,
    /// The estimation's partials (`kv_heads × est_chunks × group × (head_dim + 2)`), written
    /// on the side stream while the row list and the attention run on the main one.
    est_part: CudaSlice<f32>,
    stamp: i32,
    est_chunks: usize,
    per_cta: usize,
}

impl GpuBackend {
    /// Copies `layer`'s meta index to device memory.
    pub fn upload_wave(&self, layer: &ClusteredLayer) -> Result<DeviceWave> {
        if layer.head_dim != self.head_dim {
            return Err(Error::ShapeMismatch { what: "layer head_dim", expected: self.head_dim, got: layer.head_dim });
        }
        if layer.rows > i32::MAX as usize || layer.clusters == 0 {
            return Err(Error::InvalidArgument {
                what: "layer",
                message: format!("needs 1..2^31 clusters and rows, got {} and {}", layer.clusters, layer.rows),
            });
        }
        let bits = |x: &[half::f16]| x.iter().map(|v| v.to_bits()).collect::<Vec<u16>>();
        let cent = self.upload_centroids(&bits(&layer.centroids), layer.kv_heads)?;
        let s = &self.stream;
        let log_size: Vec<f32> = (0..layer.kv_heads)
            .flat_map(|h| (0..layer.clusters).map(move |c| (h, c)))
            .map(|(h, c)| match layer.size(h, c) {
                0 => f32::NEG_INFINITY,
                n => (n as f32).ln(),
            })
            .collect();
        let offsets: Vec<i32> = layer.offsets.iter().map(|&o| o as i32).collect();
        Ok(DeviceWave {
            cent,
            value_means: s.clone_htod(&bits(&layer.value_means)).map_err(gpu_err("copying mean values"))?,
            log_size: s.clone_htod(&log_size).map_err(gpu_err("copying cluster sizes"))?,
            offsets: s.clone_htod(&offsets).map_err(gpu_err("copying cluster offsets"))?,
            kv_heads: layer.kv_heads,
            clusters: layer.clusters,
            indexed: layer.indexed,
            rows: layer.rows,
            largest: layer.largest_cluster(),
        })
    }

    /// An empty table of `block_rows`-row blocks over `wave`'s rows (nothing cached).
    pub fn wave_table(&self, wave: &DeviceWave, block_rows: usize) -> Result<WaveTable> {
        if block_rows == 0 {
            return Err(Error::InvalidArgument { what: "block_rows", message: "must be positive".into() });
        }
        let blocks_per_head = wave.rows.div_ceil(block_rows);
        let host = vec![-1i32; wave.kv_heads * blocks_per_head];
        let dev = self.stream.clone_htod(&host).map_err(gpu_err("copying the wave table"))?;
        Ok(WaveTable { host, dev, block_rows, blocks_per_head, kv_heads: wave.kv_heads, needs: 0 })
    }

    /// Enqueues a copy of the table's host side to the device (the next launch sees it).
    pub fn upload_table(&self, table: &mut WaveTable) -> Result<()> {
        self.stream.memcpy_htod(&table.host, &mut table.dev).map_err(gpu_err("copying the wave table"))
    }

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
        // Room per head for the steady zone and the r largest clusters.
        let capacity = steady + r * wave.largest;
        // Chunks sized for a typical list (r average clusters) and a grid for 1.25 times that: a
        // longer list is covered by CTAs taking several chunks (attn_partial's chunk loop).
        let typical = steady + r * wave.indexed.div_ceil(wave.clusters);
        let chunk = chunk_rows(typical, shape.kv_heads);
        let chunks = capacity.min(typical + typical / 4).div_ceil(chunk).max(1);
        // Tiles of 128 clusters (EST_ROWS in wave.cu, one per thread), at most ~64 CTAs per head.
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
        Ok(WaveJob {
            select,
            decode,
            scan: alloc_i(shape.kv_heads * EXPAND_SPLIT * (r + 1))?,
            mark: alloc_i(shape.kv_heads * wave.clusters)?,
            est_part: alloc_f(shape.kv_heads * est_chunks * shape.group() * (self.head_dim + 2))?,
            stamp: 0,
            est_chunks,
            per_cta,
        })
    }

    /// Enqueues a copy of the step's queries (`q_heads × head_dim`) into `job`.
    pub fn set_wave_query(&self, job: &mut WaveJob, q: &[f32]) -> Result<()> {
        let want = job.decode.shape.query_len();
        if q.len() != want {
            return Err(Error::ShapeMismatch { what: "queries (q_heads × head_dim)", expected: want, got: q.len() });
        }
        if let Some(bad) = q.iter().position(|x| !x.is_finite()) {
            return Err(Error::InvalidArgument { what: "queries", message: format!("element {bad} is not finite") });
        }
        self.stream.memcpy_htod(q, &mut job.select.q).map_err(gpu_err("copying queries"))?;
        self.stream.memcpy_htod(q, &mut job.decode.q).map_err(gpu_err("copying queries"))
    }

    /// Enqueues one decode step of `job` over `wave`, whose KV rows are at `kv` (device or
    /// mapped host memory, `kv_heads × rows × head_dim`), with the blocks `table` names read
    /// from `cache` instead. Returns before the kernels finish; [`GpuBackend::fetch_wave`]
    /// waits and returns the output.
    pub fn launch_wave(
        &self,
        wave: &DeviceWave,
        kv: KvPointers,
        cache: Option<(&GpuCache, &WaveTable)>,
        job: &mut WaveJob,
    ) -> Result<()> {
        self.wave_step(wave, kv, cache, job, &mut |_, _| Ok(()))
    }

    /// Runs one step like [`GpuBackend::launch_wave`] and returns the milliseconds of its
    /// phases, measured with events: selection (scoring + top-r), estimation (on the side
    /// stream, from the end of the selection), row list, attention, merge (which waits for the
    /// estimation first).
    pub fn wave_phases(
        &self,
        wave: &DeviceWave,
        kv: KvPointers,
        cache: Option<(&GpuCache, &WaveTable)>,
        job: &mut WaveJob,
    ) -> Result<Vec<f64>> {
        let record = |stream: &CudaStream| {
            stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(gpu_err("recording an event"))
        };
        let start = record(&self.stream)?;
        let mut events: Vec<(&'static str, bool, CudaEvent)> = Vec::new();
        self.wave_step(wave, kv, cache, job, &mut |name, stream| {
            events.push((name, std::ptr::eq(stream, &*self.side), record(stream)?));
            Ok(())
        })?;
        self.stream.synchronize().map_err(gpu_err("synchronizing"))?;
        // Each phase runs from the previous event on its stream; the side stream's first
        // phase starts when the selection ends.
        let elapsed =
            |a: &CudaEvent, b: &CudaEvent| Ok(f64::from(a.elapsed_ms(b).map_err(gpu_err("reading an event"))?));
        let mut out = Vec::new();
        let (mut main_prev, mut side_prev): (&CudaEvent, Option<&CudaEvent>) = (&start, None);
        for (name, side, e) in &events {
            if *side {
                out.push(elapsed(side_prev.unwrap_or(main_prev), e)?);
                side_prev = Some(e);
            } else {
                out.push(elapsed(main_prev, e)?);
                main_prev = e;
                if *name == "select" {
                    side_prev = Some(e);
                }
            }
        }
        Ok(out)
    }

    /// The launches of one step; `phase_done` runs after each phase's launches are enqueued.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn wave_step(
        &self,
        wave: &DeviceWave,
        kv: KvPointers,
        cache: Option<(&GpuCache, &WaveTable)>,
        job: &mut WaveJob,
        phase_done: &mut dyn FnMut(&'static str, &CudaStream) -> Result<()>,
    ) -> Result<()> {
        if kv.rows < wave.rows
            || job.mark.len() < wave.kv_heads * wave.clusters
            || job.decode.identity_rows != wave.rows
        {
            return Err(Error::InvalidArgument {
                what: "wave launch",
                message: format!(
                    "the job or the KV ({} rows) does not belong to this layer ({} rows, {} clusters per head)",
                    kv.rows, wave.rows, wave.clusters
                ),
            });
        }
        if let Some((c, t)) = cache {
            if t.needs > c.slots || t.host.len() != wave.kv_heads * wave.rows.div_ceil(t.block_rows) {
                return Err(Error::InvalidArgument {
                    what: "wave cache",
                    message: format!("the table names {} cache rows, the cache has {}", t.needs, c.slots),
                });
            }
        }
        job.stamp = job.stamp.wrapping_add(1).max(1);
        let mark = device_address(&job.mark, &self.stream);
        self.launch_select_marking(&wave.cent, &mut job.select, mark, job.stamp)?;
        phase_done("select", &self.stream)?;
        let sh = job.decode.shape;
        let (r, n, kvh) = (job.select.r as i32, wave.clusters as i32, wave.kv_heads as i32);
        // The estimation needs only the selection: it runs on the side stream, beside the
        // row list and the attention.
        self.side.join(&self.stream).map_err(gpu_err("ordering the streams"))?;
        let group = sh.group() as i32;
        let (per_cta, stride) = (job.per_cta as i32, job.est_chunks as i32);
        let cfg = LaunchConfig {
            grid_dim: (job.est_chunks as u32, sh.kv_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.side.launch_builder(&self.est);
        let scores = job.select.group_scores.as_ref().expect("a wave job keeps group scores");
        b.arg(scores).arg(&wave.value_means).arg(&wave.log_size).arg(&n).arg(&job.mark).arg(&job.stamp);
        b.arg(&group).arg(&per_cta).arg(&mut job.est_part).arg(&stride).arg(&0i32);
        // SAFETY: group scores hold q_heads × n floats and mark kv_heads × n ints, both written
        // by this step's selection, which the side stream waits for; mean values hold kv_heads
        // × n × head_dim f16, log sizes kv_heads × n; the CTAs write est_part's est_chunks
        // chunks per head, which it was sized for. The previous step's merge read est_part
        // on the main stream before this step's selection, so it is not overwritten early.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching est_partial"))?;
        phase_done("estimation", &self.side)?;
        let (indexed, rows) = (wave.indexed as i32, wave.rows as i32);
        let (table, block_rows, per_head) = match cache {
            Some((_, t)) => (device_address(&t.dev, &self.stream), t.block_rows as i32, t.blocks_per_head as i32),
            None => (0u64, 1, 0),
        };
        let (list, list_offsets) = job.decode.rows.as_mut().expect("a wave job has row lists");
        let cfg = LaunchConfig {
            grid_dim: (wave.kv_heads as u32, EXPAND_SPLIT as u32, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.expand);
        b.arg(&job.select.out).arg(&r).arg(&wave.offsets).arg(&n).arg(&kvh).arg(&indexed).arg(&rows);
        b.arg(&table).arg(&block_rows).arg(&per_head);
        b.arg(&mut job.scan).arg(list).arg(list_offsets);
        // SAFETY: out holds r distinct cluster ids < n per head (select_candidates), offsets
        // kv_heads × (n + 1) increasing row bounds ≤ indexed, so each head's list has at most
        // steady + r × largest entries = the capacity allocated per head; the table (checked
        // above) names cache rows < cache.slots; scan holds kv_heads × EXPAND_SPLIT × (r + 1)
        // (one slice per CTA).
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching wave_expand"))?;
        phase_done("row list", &self.stream)?;
        let ck = cache.map_or(0, |(c, _)| device_address(&c.keys, &self.stream));
        let cv = cache.map_or(0, |(c, _)| device_address(&c.values, &self.stream));
        self.launch_attn((kv.keys, kv.values, (kv.rows * self.head_dim) as i64), (ck, cv), &mut job.decode)?;
        phase_done("attention", &self.stream)?;
        self.stream.join(&self.side).map_err(gpu_err("ordering the streams"))?;
        let lse = device_address(&job.decode.lse, &self.stream);
        let est = (device_address(&job.est_part, &self.stream), job.est_chunks);
        self.launch_merge(&sh, &job.decode.part, job.decode.chunks, &mut job.decode.out, lse, est)?;
        phase_done("merge", &self.stream)
    }

    /// Waits for the step and returns its output (`q_heads × head_dim`).
    pub fn fetch_wave(&self, job: &WaveJob) -> Result<Vec<f32>> {
        self.fetch(&job.decode)
    }

    /// The clusters the last step retrieved per KV head (unordered) and how many heads had
    /// to select over all their scores because the sampled threshold misjudged.
    pub fn wave_selection(&self, job: &WaveJob) -> Result<(Vec<Vec<u32>>, usize)> {
        let fallback = self.stream.clone_dtoh(&job.select.fallback).map_err(gpu_err("copying flags back"))?;
        Ok((self.fetch_select(&job.select)?, fallback.iter().filter(|&&f| f != 0).count()))
    }
}
