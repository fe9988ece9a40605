//! The GPU side of the `hack2` codec: 2-bit rows of every KV head in device memory,
//! homomorphic decode attention over them (`hack_partial` + the shared merge kernel), and
//! the dequantize-then-attend baseline (`hack_dequant`, then the exact f16 kernel).

use super::{device_address, gpu_err, DeviceKv, GpuBackend, MAX_GROUP};
use crate::cpu::hack::{HackParams, Quantized8};
use crate::cpu::hack_rows::HackRows;
use crate::error::{Error, Result};
use crate::shape::AttnShape;
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

/// Rows of a value block (Π); the GPU kernels are compiled for Π = 64.
const BLOCK: usize = 64;
/// CTAs a homomorphic decode aims for (`ATTNSTORE_HACK_CTAS` overrides it, for tuning).
const HACK_CTAS: usize = 4096;

/// The 2-bit rows of every KV head of one layer in device memory.
pub struct DeviceHack {
    kc: CudaSlice<u8>,
    kmin: CudaSlice<u16>,
    kscale: CudaSlice<u16>,
    ksum: CudaSlice<u16>,
    vc: CudaSlice<u8>,
    vmin: CudaSlice<u16>,
    vscale: CudaSlice<u16>,
    rows: usize,
    kv_heads: usize,
}

impl DeviceHack {
    /// Rows per KV head.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Device bytes of codes and metadata.
    pub fn bytes(&self) -> usize {
        self.kc.len() + self.vc.len() + 2 * (self.kmin.len() * 3 + self.vmin.len() * 2)
    }
}

/// Buffers of one homomorphic decode launch.
pub struct HackJob {
    q8: CudaSlice<u32>,
    qmeta: CudaSlice<f32>,
    part: CudaSlice<f32>,
    out: CudaSlice<f32>,
    chunks: usize,
    chunk_blocks: usize,
    shape: AttnShape,
    scale: f32,
    /// A sparse plan's rows: per KV head `n` listed value blocks and their 64-bit row masks.
    sel: Option<(CudaSlice<i32>, CudaSlice<u64>, usize)>,
}

/// Per KV head, the value blocks that `ranges` touch and a 64-bit mask of their selected
/// rows, padded to the same count with empty masks: `(blocks, masks, per head)`.
fn row_masks(ranges: &[Vec<std::ops::Range<usize>>], rows: usize) -> (Vec<i32>, Vec<u64>, usize) {
    let per_head: Vec<Vec<(i32, u64)>> = ranges
        .iter()
        .map(|runs| {
            let mut masks = std::collections::BTreeMap::<usize, u64>::new();
            for r in runs {
                for row in r.start..r.end.min(rows) {
                    *masks.entry(row / BLOCK).or_default() |= 1u64 << (row % BLOCK);
                }
            }
            masks.into_iter().map(|(b, m)| (b as i32, m)).collect()
        })
        .collect();
    let n = per_head.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let (mut blocks, mut masks) = (Vec::with_capacity(n * ranges.len()), Vec::with_capacity(n * ranges.len()));
    for head in &per_head {
        for i in 0..n {
            let (b, m) = head.get(i).copied().unwrap_or((0, 0));
            blocks.push(b);
            masks.push(m);
        }
    }
    (blocks, masks, n)
}

/// 8-bit query codes per 64-dim partition (packed four to a word, dimension order) and per
/// partition `[scale, minimum, scale·Σcodes + 64·minimum]`: what `hack_partial` reads.
fn quantize_queries(q: &[f32], d: usize) -> (Vec<u32>, Vec<f32>) {
    // With d a multiple of 64, 64-value partitions of the whole query never cross heads.
    debug_assert!(d.is_multiple_of(BLOCK));
    let q8 = Quantized8::encode(q, HackParams::default());
    let meta = (0..q8.mins.len())
        .flat_map(|k| {
            let (sc, lo) = (q8.scales[k], q8.mins[k]);
            [sc, lo, sc * q8.sums[k] as f32 + BLOCK as f32 * lo]
        })
        .collect();
    let words = q8.codes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    (words, meta)
}

impl GpuBackend {
    /// A hack2 kernel, or the typed error for a head dimension it was not compiled for.
    fn hack_kernel<'a>(&self, f: &'a Option<CudaFunction>) -> Result<&'a CudaFunction> {
        f.as_ref().ok_or_else(|| Error::InvalidArgument {
            what: "head_dim",
            message: format!(
                "the GPU hack2 kernels need a head dimension that is a multiple of 64, got {}",
                self.head_dim
            ),
        })
    }

    /// Copies the 2-bit rows of every KV head (all with the same row count, Π = 64) to
    /// device memory.
    pub fn upload_hack(&self, heads: &[HackRows]) -> Result<DeviceHack> {
        let d = self.head_dim;
        let rows = heads.first().map_or(0, HackRows::rows);
        let bad = |message: String| Err(Error::InvalidArgument { what: "hack rows", message });
        self.hack_kernel(&self.hack_partial)?;
        if heads.iter().any(|h| h.rows() != rows || h.params().partition != BLOCK) {
            return bad("every head needs the same row count and partition Π = 64".into());
        }
        let bits = |x: &[half::f16]| x.iter().map(|v| v.to_bits()).collect::<Vec<u16>>();
        let (mut kc, mut kmin, mut kscale, mut ksum, mut vc, mut vmin, mut vscale) =
            (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        for h in heads {
            let a = h.arrays();
            kc.extend_from_slice(a.key_codes);
            kmin.extend(bits(a.key_min));
            kscale.extend(bits(a.key_scale));
            ksum.extend_from_slice(a.key_sum);
            vc.extend_from_slice(a.value_codes);
            vmin.extend(bits(a.value_min));
            vscale.extend(bits(a.value_scale));
        }
        if kc.len() != heads.len() * rows * d / 4 || vmin.len() != heads.len() * rows.div_ceil(BLOCK) * d {
            return bad(format!("rows of head dimension {d} expected"));
        }
        let up8 = |x: &[u8]| self.stream.clone_htod(x).map_err(gpu_err("copying 2-bit codes"));
        let up16 = |x: &[u16]| self.stream.clone_htod(x).map_err(gpu_err("copying 2-bit metadata"));
        Ok(DeviceHack {
            kc: up8(&kc)?,
            kmin: up16(&kmin)?,
            kscale: up16(&kscale)?,
            ksum: up16(&ksum)?,
            vc: up8(&vc)?,
            vmin: up16(&vmin)?,
            vscale: up16(&vscale)?,
            rows,
            kv_heads: heads.len(),
        })
    }

    /// Prepares a homomorphic decode of `q` (`q_heads × head_dim`) over all rows of `dev`.
    pub fn prepare_hack(&self, shape: &AttnShape, q: &[f32], dev: &DeviceHack) -> Result<HackJob> {
        self.prepare_hack_with(shape, q, dev, None)
    }

    /// Prepares a homomorphic decode of `q` over the rows of a sparse plan: `ranges[h]`,
    /// the row runs of KV head `h` (e.g. its retrieved clusters), as `HackRows::attend`
    /// takes them on the CPU. Only the value blocks they touch are read.
    pub fn prepare_hack_rows(
        &self,
        shape: &AttnShape,
        q: &[f32],
        dev: &DeviceHack,
        ranges: &[Vec<std::ops::Range<usize>>],
    ) -> Result<HackJob> {
        if ranges.len() != dev.kv_heads {
            return Err(Error::ShapeMismatch {
                what: "row runs per KV head",
                expected: dev.kv_heads,
                got: ranges.len(),
            });
        }
        if let Some(r) = ranges.iter().flatten().find(|r| r.end > dev.rows) {
            return Err(Error::InvalidArgument {
                what: "row runs",
                message: format!("rows {r:?} past the {} rows of each head", dev.rows),
            });
        }
        self.prepare_hack_with(shape, q, dev, Some(ranges))
    }

    fn prepare_hack_with(
        &self,
        shape: &AttnShape,
        q: &[f32],
        dev: &DeviceHack,
        ranges: Option<&[Vec<std::ops::Range<usize>>]>,
    ) -> Result<HackJob> {
        if shape.head_dim != self.head_dim || shape.group() > MAX_GROUP || shape.kv_heads != dev.kv_heads {
            return Err(Error::InvalidArgument {
                what: "shape",
                message: format!(
                    "head_dim {} (backend {}), group {} (at most {MAX_GROUP}), kv_heads {} (rows hold {})",
                    shape.head_dim,
                    self.head_dim,
                    shape.group(),
                    shape.kv_heads,
                    dev.kv_heads
                ),
            });
        }
        if q.len() != shape.query_len() {
            return Err(Error::ShapeMismatch { what: "queries", expected: shape.query_len(), got: q.len() });
        }
        let (words, meta) = quantize_queries(q, shape.head_dim);
        let sel = match ranges {
            Some(r) => {
                let (blocks, masks, n) = row_masks(r, dev.rows);
                let b = self.stream.clone_htod(&blocks).map_err(gpu_err("copying the selected blocks"))?;
                let m = self.stream.clone_htod(&masks).map_err(gpu_err("copying the row masks"))?;
                Some((b, m, n))
            }
            None => None,
        };
        let blocks = sel.as_ref().map_or(dev.rows.div_ceil(BLOCK), |s| s.2).max(1);
        // About HACK_CTAS CTAs in all: each CTA walks its blocks one after another
        // (three barriers per 64 rows), so more, shorter CTAs hide more latency.
        let ctas: usize = std::env::var("ATTNSTORE_HACK_CTAS").ok().and_then(|v| v.parse().ok()).unwrap_or(HACK_CTAS);
        let chunk_blocks = (blocks * shape.kv_heads).div_ceil(ctas.max(1)).max(1);
        let chunks = blocks.div_ceil(chunk_blocks);
        let part_len = shape.kv_heads * chunks * shape.group() * (shape.head_dim + 2);
        Ok(HackJob {
            q8: self.stream.clone_htod(&words).map_err(gpu_err("copying queries"))?,
            qmeta: self.stream.clone_htod(&meta).map_err(gpu_err("copying queries"))?,
            part: self.stream.alloc_zeros::<f32>(part_len).map_err(gpu_err("allocating partials"))?,
            out: self.stream.alloc_zeros::<f32>(shape.query_len()).map_err(gpu_err("allocating the output"))?,
            chunks,
            chunk_blocks,
            shape: *shape,
            scale: shape.scale(),
            sel,
        })
    }

    /// Enqueues the homomorphic decode and the merge of its partials.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub fn launch_hack(&self, dev: &DeviceHack, job: &mut HackJob) -> Result<()> {
        let f = self.hack_kernel(&self.hack_partial)?;
        let sh = job.shape;
        let (rows, group, chunk_blocks) = (dev.rows as i32, sh.group() as i32, job.chunk_blocks as i32);
        let cfg = LaunchConfig {
            grid_dim: (job.chunks as u32, sh.kv_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&dev.kc).arg(&dev.kmin).arg(&dev.kscale).arg(&dev.ksum).arg(&dev.vc).arg(&dev.vmin).arg(&dev.vscale);
        b.arg(&rows).arg(&job.q8).arg(&job.qmeta).arg(&job.scale).arg(&group).arg(&chunk_blocks).arg(&mut job.part);
        // Dense: null selection pointers (the kernel then walks every block).
        let (null, n_sel) = (0u64, job.sel.as_ref().map_or(0, |s| s.2 as i32));
        match &job.sel {
            Some((blocks, masks, _)) => b.arg(blocks).arg(masks).arg(&n_sel),
            None => b.arg(&null).arg(&null).arg(&n_sel),
        };
        // SAFETY: dev holds kv_heads × rows rows in the layout hack_partial reads (checked in
        // upload_hack); q8/qmeta hold q_heads queries and part kv_heads × chunks × group
        // partials (sized in prepare_hack for this shape, whose kv_heads match dev); a
        // selection holds kv_heads × n block ids below the head's block count (row_masks
        // lists only blocks of rows < dev.rows, checked in prepare_hack_rows) and n masks.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching hack_partial"))?;
        self.launch_merge(
            &self.stream,
            &sh,
            &job.part,
            job.chunks,
            &mut job.out,
            0,
            (0, 0),
            super::MailboxCopies::default(),
        )
    }

    /// Waits for the stream and copies a homomorphic decode's output back.
    pub fn fetch_hack(&self, job: &HackJob) -> Result<Vec<f32>> {
        self.stream.clone_dtoh(&job.out).map_err(gpu_err("copying the output back"))
    }

    /// Device f16 buffers for `rows` rows of every KV head (the dequantize-then-attend
    /// baseline writes into them).
    pub fn alloc_kv(&self, kv_heads: usize, rows: usize) -> Result<DeviceKv> {
        let n = kv_heads * rows * self.head_dim;
        let keys = self.stream.alloc_zeros::<u16>(n).map_err(gpu_err("allocating keys"))?;
        let values = self.stream.alloc_zeros::<u16>(n).map_err(gpu_err("allocating values"))?;
        Ok(DeviceKv { keys, values, rows })
    }

    /// Enqueues the dequantization of `dev` into the f16 buffers `kv`.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub fn dequantize_hack(&self, dev: &DeviceHack, kv: &mut DeviceKv) -> Result<()> {
        let f = self.hack_kernel(&self.hack_dequant)?;
        if kv.rows != dev.rows || kv.keys.len() != dev.kv_heads * dev.rows * self.head_dim {
            return Err(Error::ShapeMismatch {
                what: "f16 buffers for the dequantized rows",
                expected: dev.kv_heads * dev.rows * self.head_dim,
                got: kv.keys.len(),
            });
        }
        let rows = dev.rows as i32;
        let cfg = LaunchConfig {
            grid_dim: (dev.rows.div_ceil(BLOCK) as u32, dev.kv_heads as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (k, v) = (device_address(&kv.keys, &self.stream), device_address(&kv.values, &self.stream));
        let mut b = self.stream.launch_builder(f);
        b.arg(&dev.kc).arg(&dev.kmin).arg(&dev.kscale).arg(&dev.vc).arg(&dev.vmin).arg(&dev.vscale).arg(&rows);
        b.arg(&k).arg(&v);
        // SAFETY: kv holds kv_heads × rows × head_dim f16 values for each of K and V (checked
        // above); dev's arrays match that shape (checked in upload_hack).
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching hack_dequant"))?;
        Ok(())
    }
}
