//! The 2-bit (`hack2`) wave step's own parts (`hack_wave.cu`): the layer's value-block table
//! on the device, a job's piece lists and homomorphic partials, and the two launches that
//! replace the f16 step's cluster rows — the pieces of the retrieved clusters, and attention
//! over them read in place from the Gpu tier or the pinned Host arena.

use super::*;
use crate::arena_wave::{ArenaGroups, GroupSummary};

/// A 2-bit layer's value-block table in device memory ([`ArenaGroups`]).
pub(super) struct DeviceGroups {
    pages: CudaSlice<i32>,
    rows: CudaSlice<i32>,
    ids: CudaSlice<i32>,
    bounds: CudaSlice<i32>,
    piece_group: CudaSlice<i32>,
    piece_mask: CudaSlice<u64>,
    /// What the host keeps of the table (piece counts size a job's lists; ids' ends name
    /// the real blocks).
    pub(super) table: GroupSummary,
}

impl DeviceGroups {
    /// The table's device addresses (part of a step's graph key).
    pub(super) fn key(&self, stream: &Arc<CudaStream>) -> [u64; 6] {
        [
            device_address(&self.pages, stream),
            device_address(&self.rows, stream),
            device_address(&self.ids, stream),
            device_address(&self.bounds, stream),
            device_address(&self.piece_group, stream),
            device_address(&self.piece_mask, stream),
        ]
    }
}

/// A job's buffers for a 2-bit layer: per KV head a list of `cap` pieces (the value block's
/// page addresses as the step resolved them, its rows, the row mask) and its length, and the
/// homomorphic kernel's partials (`chunks` per head).
pub(super) struct HackBuffers {
    list_addr: CudaSlice<u64>,
    list_rows: CudaSlice<i32>,
    list_mask: CudaSlice<u64>,
    counts: CudaSlice<i32>,
    pub(super) part: CudaSlice<f32>,
    /// The step's queries in 8 bits (`q_heads × head_dim / 4` words, written by
    /// `step_ingest`) and their scales, minima and correction terms (`q_heads × head_dim / 64
    /// × 3`).
    pub(super) q8: CudaSlice<u32>,
    pub(super) qmeta: CudaSlice<f32>,
    pub(super) chunks: usize,
    pub(super) cap: usize,
}

/// CTAs per KV head of the homomorphic kernel at most (each takes an even share of the
/// head's listed pieces, one warp per piece).
const HACK_CHUNKS_MAX: usize = 256;

/// Pieces a CTA of the homomorphic kernel takes when the selection takes its typical
/// pieces: one per warp (`ARENA_WARPS` in `hack_wave.cu`), so a step's pieces are all in
/// flight at once. (Eight, two per warp, measured no better on the H200 at 128K, session 49:
/// batch-1 step 95.6 against 100.7 µs, batch of 16 658 against 664 µs, medians of two
/// alternating runs each; the knob that chose it is gone.)
const PIECES_PER_CTA: usize = 4;

/// Converts a table's `u32` entries to the kernels' `i32` (checked at upload).
fn ints(x: &[u32]) -> Vec<i32> {
    x.iter().map(|&v| v as i32).collect()
}

impl GpuBackend {
    /// Copies `g` (padded to `clusters` per head by `ArenaWave::new_encoded`) to the device.
    pub(super) fn upload_groups(&self, g: &ArenaGroups, kv_heads: usize, clusters: usize) -> Result<DeviceGroups> {
        let bad = |message: String| Error::InvalidArgument { what: "arena groups", message };
        if self.hack_wave.is_none() {
            return Err(self.hack_head_dim_error());
        }
        if g.piece_bounds.len() != kv_heads * (clusters + 1) || g.id_end.len() != kv_heads {
            return Err(bad(format!(
                "{} bounds and {} heads of ids for {kv_heads} heads of {clusters} clusters (pad with ArenaWave::new_encoded)",
                g.piece_bounds.len(),
                g.id_end.len()
            )));
        }
        let row_bytes = 2 * self.head_dim;
        if g.page_bytes == 0 || !g.page_bytes.is_multiple_of(row_bytes) || g.page_bytes > i32::MAX as usize {
            return Err(bad(format!("pages of {} bytes are not whole f16 rows of {row_bytes} bytes", g.page_bytes)));
        }
        if !g.page_bytes.is_power_of_two() {
            return Err(bad(format!(
                "the 2-bit kernel reads pages of a power of two bytes (the buffer manager's 2 KiB blocks), got {}",
                g.page_bytes
            )));
        }
        let too_big = |x: &[u32]| x.iter().any(|&v| v > i32::MAX as u32);
        if too_big(&g.ids) || too_big(&g.piece_bounds) || g.rows.len() > i32::MAX as usize {
            return Err(bad("ids, pieces and value blocks must stay below 2^31".into()));
        }
        let s = &self.stream;
        let up_i = |x: Vec<i32>| s.clone_htod(&x).map_err(gpu_err("copying the value-block table"));
        Ok(DeviceGroups {
            pages: up_i(g.pages.clone())?,
            rows: up_i(ints(&g.rows))?,
            ids: up_i(ints(&g.ids))?,
            bounds: up_i(ints(&g.piece_bounds))?,
            piece_group: up_i(ints(&g.piece_group))?,
            piece_mask: s.clone_htod(&g.piece_mask).map_err(gpu_err("copying the value-block table"))?,
            table: g.summary(),
        })
    }

    /// A job's piece lists for steps retrieving `r` clusters per KV head of `g`'s layer.
    pub(super) fn hack_buffers(&self, shape: &AttnShape, g: &DeviceGroups, r: usize) -> Result<HackBuffers> {
        let cap = g.table.pieces_for(r).max(1);
        let typical = (r * g.table.pieces).div_ceil(g.table.bounds.max(1)).max(1);
        let chunks = typical.div_ceil(PIECES_PER_CTA).clamp(1, HACK_CHUNKS_MAX);
        let s = &self.stream;
        let n = shape.kv_heads * cap;
        const ALLOCATING: &str = "allocating the piece lists";
        Ok(HackBuffers {
            list_addr: s.alloc_zeros::<u64>(n * crate::GROUP_PAGES).map_err(gpu_err(ALLOCATING))?,
            list_rows: s.alloc_zeros::<i32>(n).map_err(gpu_err(ALLOCATING))?,
            list_mask: s.alloc_zeros::<u64>(n).map_err(gpu_err(ALLOCATING))?,
            counts: s.alloc_zeros::<i32>(shape.kv_heads).map_err(gpu_err(ALLOCATING))?,
            part: s
                .alloc_zeros::<f32>(shape.kv_heads * chunks * shape.group() * (self.head_dim + 2))
                .map_err(gpu_err(ALLOCATING))?,
            q8: s.alloc_zeros::<u32>(shape.query_len() / 4).map_err(gpu_err(ALLOCATING))?,
            qmeta: s.alloc_zeros::<f32>(shape.query_len() / 64 * 3).map_err(gpu_err(ALLOCATING))?,
            chunks,
            cap,
        })
    }

    /// `hack_expand`: the step's retrieved clusters as pieces per KV head, each with its
    /// pages' addresses (looked up in the Gpu tier's table: hits there, misses in the Host
    /// arena at `kv.keys`), their flags and the value blocks'.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub(super) fn launch_hack_pieces(
        &self,
        main: &Arc<CudaStream>,
        wave: &DeviceWave,
        g: &DeviceGroups,
        c: &CacheArgs,
        kv: KvPointers,
        job: &mut WaveJob,
    ) -> Result<()> {
        let kernels = self.hack_wave.as_ref().ok_or_else(|| self.hack_head_dim_error())?;
        let h = job.hack.as_mut().expect("a 2-bit layer's job has piece lists (check_steps)");
        let (r, n, cap) = (job.select.r as i32, wave.clusters as i32, h.cap as i32);
        let page_bytes = g.table.page_bytes as i32;
        let cfg = LaunchConfig {
            grid_dim: (wave.kv_heads as u32, EXPAND_SPLIT as u32, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = main.launch_builder(&kernels.expand);
        b.arg(&job.select.out).arg(&r).arg(&g.bounds).arg(&n).arg(&g.piece_group).arg(&g.piece_mask);
        b.arg(&g.pages).arg(&g.ids).arg(&g.rows).arg(&c.table).arg(&kv.keys).arg(&c.keys).arg(&page_bytes);
        b.arg(&cap).arg(&mut job.scan).arg(&mut h.list_addr).arg(&mut h.list_rows).arg(&mut h.list_mask);
        b.arg(&mut h.counts).arg(&mut job.flags);
        // SAFETY: out holds r distinct cluster ids < n per head (select_scored); bounds hold
        // kv_heads × (n + 1) increasing piece bounds into piece_group / piece_mask, whose
        // groups index the pages (MAX_PAGES each) and ids of the table (upload_groups); any
        // r clusters of a head have at most cap pieces (pieces_for), so the lists (kv_heads ×
        // cap) and the flags (kv_heads × (r + cap)) hold them; scan holds kv_heads ×
        // EXPAND_SPLIT × (r + 1); the table (when not 0) has an entry per arena block, and
        // the pages name arena blocks below the arena's (check_steps: kv.keys is the Host
        // arena's base) or, through the table, Gpu slots of the arena cache at c.keys (its
        // owner's claim), each page_bytes long; list_addr holds cap × MAX_PAGES addresses
        // per head.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching hack_expand"))?;
        Ok(())
    }

    /// `hack_arena_g{G}`: homomorphic attention over the listed pieces, each page read from
    /// the Gpu tier when the table holds it there, else zero-copy from the Host arena.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub(super) fn launch_hack_attention(
        &self,
        main: &Arc<CudaStream>,
        g: &DeviceGroups,
        job: &mut WaveJob,
    ) -> Result<()> {
        let kernels = self.hack_wave.as_ref().ok_or_else(|| self.hack_head_dim_error())?;
        let sh = job.decode.shape;
        let h = job.hack.as_mut().expect("a 2-bit layer's job has piece lists (check_steps)");
        let f = kernels.arena.get(sh.group() - 1).ok_or_else(|| Error::InvalidArgument {
            what: "group",
            message: format!("the hack2 kernels serve groups of 1 to {MAX_GROUP} query heads, got {}", sh.group()),
        })?;
        let cfg = LaunchConfig {
            grid_dim: (h.chunks as u32, sh.kv_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // A power of two (upload_groups).
        let page_shift = g.table.page_bytes.trailing_zeros() as i32;
        let (cap, scale) = (h.cap as i32, sh.scale());
        let mut b = main.launch_builder(f);
        b.arg(&h.list_addr).arg(&h.list_rows).arg(&h.list_mask).arg(&h.counts).arg(&cap).arg(&page_shift);
        b.arg(&h.q8).arg(&h.qmeta).arg(&scale).arg(&mut h.part);
        // SAFETY: the lists hold counts[h] ≤ cap pieces per head, written by hack_expand
        // before this on the same stream: per piece its row count and the addresses of its
        // value block's pages in the Host arena or the Gpu tier (2^page_shift bytes each, holding the
        // group layout of the block, upload_groups), which the step's DeviceRead keeps from
        // being overwritten until it is fetched; q8 and qmeta hold the queries in 8 bits
        // (q_heads × head_dim / 4 words, q_heads × head_dim / 64 × 3 floats, written by
        // step_ingest before this on the same stream); part holds kv_heads × chunks × group
        // partials.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching hack_arena"))?;
        Ok(())
    }
}
