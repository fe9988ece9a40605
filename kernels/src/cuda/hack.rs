//! The GPU side of the `hack2` codec: 2-bit rows of every KV head in device memory,
//! homomorphic decode attention over them (`hack_partial_g{G}` + the shared merge kernel)
//! or over value blocks read in place from pages such as the buffer manager's blocks
//! (`hack_paged_g{G}`), one kernel per GQA group size, and the dequantize-then-attend
//! baseline (`hack_dequant`, then the exact f16 kernel).

use super::{device_address, gpu_err, DeviceKv, GpuBackend, MAX_GROUP};
use crate::cpu::hack::{HackParams, Quantized8};
use crate::cpu::hack_rows::{HackRows, HackView};
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

/// Pages a value block in the group layout may span on the device (`MAX_PAGES` in
/// `hack.cu`): 8 blocks of the buffer manager's default 2 KiB hold a group of head
/// dimension 256 (10.5 KiB).
pub const MAX_PAGES: usize = crate::arena_wave::GROUP_PAGES;

/// Buffers of one homomorphic decode launch.
pub struct HackJob {
    q8: CudaSlice<u32>,
    qmeta: CudaSlice<f32>,
    part: CudaSlice<f32>,
    out: CudaSlice<f32>,
    /// Log of each query head's softmax denominator (with `out`, its partial).
    lse: CudaSlice<f32>,
    chunks: usize,
    chunk_blocks: usize,
    shape: AttnShape,
    scale: f32,
    sel: Selection,
}

/// The value blocks a [`HackJob`] attends.
enum Selection {
    /// Every value block of a [`DeviceHack`].
    All,
    /// A sparse plan's rows of a [`DeviceHack`]: per KV head `n` listed value blocks and
    /// their 64-bit row masks.
    Rows { blocks: CudaSlice<i32>, masks: CudaSlice<u64>, n: usize },
    /// Value blocks in the group layout spread over pages ([`PagedGroup`]): per KV head `n`
    /// groups, each with [`MAX_PAGES`] page addresses, a row mask and a row count.
    Paged { pages: CudaSlice<u64>, masks: CudaSlice<u64>, rows: CudaSlice<i32>, n: usize, page_bytes: usize },
}

/// One value block of Π = 64 rows in the group layout of [`HackRows::group_bytes`] as the
/// device reads it in place: spread over fixed-size pages (the buffer manager's blocks, in
/// its pinned Host arena or its Gpu tier) that need not be adjacent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedGroup {
    /// Device address of each page, in the group's byte order. The memory must stay
    /// readable by the device, unchanged, until the job's results are fetched.
    pub pages: Vec<u64>,
    /// Rows the group holds (Π, or fewer for a segment's last block).
    pub rows: usize,
    /// The rows to attend (bit `r` = row `r`; only bits below `rows`).
    pub mask: u64,
}

/// The 2-bit rows of every KV head as value blocks in the group layout, spread over pages
/// of device memory in shuffled order, the way the buffer manager scatters a layer's
/// blocks: what [`GpuBackend::prepare_hack_paged`] reads, for tests and benchmarks of the
/// paged kernel without a buffer manager.
pub struct DevicePages {
    _data: CudaSlice<u8>,
    groups: Vec<Vec<PagedGroup>>,
    page_bytes: usize,
    bytes: usize,
}

impl DevicePages {
    /// Per KV head, every value block with every row in its mask.
    pub fn groups(&self) -> &[Vec<PagedGroup>] {
        &self.groups
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Bytes of the groups (without the pages' padding).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
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

/// 8-bit query codes per 64-dim partition (packed four to a word, in the order of
/// `hack.cu`'s score loop) and per partition `[scale, minimum, scale·Σcodes + 64·minimum]`:
/// what the hack kernels read.
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
    // Per 16 dimensions, word s holds dims s, 4 + s, 8 + s, 12 + s: the order in which the
    // kernel isolates key codes (`(key word >> 2s) & 0x03030303`, byte i = dim 4i + s).
    let words = q8
        .codes
        .chunks_exact(16)
        .flat_map(|c| (0..4).map(move |s| u32::from_le_bytes([c[s], c[4 + s], c[8 + s], c[12 + s]])))
        .collect();
    (words, meta)
}

/// One CTA per (chunk of listed value blocks, KV head), 128 threads.
fn hack_grid(job: &HackJob) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (job.chunks as u32, job.shape.kv_heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl GpuBackend {
    /// The hack2 kernel of `f` for a GQA group of `group` heads, or the typed error for a
    /// head dimension the kernels were not compiled for (or a group past MAX_GROUP).
    fn hack_kernel<'a>(&self, f: &'a Option<Vec<CudaFunction>>, group: usize) -> Result<&'a CudaFunction> {
        let kernels = f.as_ref().ok_or_else(|| self.hack_head_dim_error())?;
        kernels.get(group.wrapping_sub(1)).ok_or_else(|| Error::InvalidArgument {
            what: "group",
            message: format!("the hack2 kernels serve groups of 1 to {MAX_GROUP} query heads, got {group}"),
        })
    }

    /// The typed error for a head dimension the hack2 kernels were not compiled for.
    pub(super) fn hack_head_dim_error(&self) -> Error {
        Error::InvalidArgument {
            what: "head_dim",
            message: format!(
                "the GPU hack2 kernels need a head dimension that is a multiple of 64, got {}",
                self.head_dim
            ),
        }
    }

    /// Copies the 2-bit rows of every KV head (all with the same row count, Π = 64) to
    /// device memory.
    pub fn upload_hack(&self, heads: &[HackRows]) -> Result<DeviceHack> {
        per_token_only(heads)?;
        let d = self.head_dim;
        let rows = heads.first().map_or(0, HackRows::rows);
        let bad = |message: String| Err(Error::InvalidArgument { what: "hack rows", message });
        self.hack_kernel(&self.hack_partial, 1)?;
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

    /// Copies the 2-bit rows of every KV head (Π = 64) to device memory as value blocks in
    /// the group layout over pages of `page_bytes`, placed in an order shuffled by `seed`.
    pub fn upload_hack_pages(&self, heads: &[HackRows], page_bytes: usize, seed: u64) -> Result<DevicePages> {
        per_token_only(heads)?;
        self.hack_kernel(&self.hack_paged, 1)?;
        if page_bytes == 0 || !page_bytes.is_multiple_of(4) || heads.iter().any(|h| h.params().partition != BLOCK) {
            return Err(Error::InvalidArgument {
                what: "pages",
                message: format!("pages of a positive multiple of 4 bytes (got {page_bytes}) over rows of Π = 64"),
            });
        }
        let groups: Vec<Vec<Vec<u8>>> =
            heads.iter().map(|h| (0..h.groups()).map(|b| h.group_bytes(b)).collect()).collect();
        let total: usize = groups.iter().flatten().map(|g| g.len().div_ceil(page_bytes)).sum();
        let mut order: Vec<usize> = (0..total).collect();
        let mut rng = crate::random::SplitMix64::new(seed);
        for i in (1..total).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let mut arena = vec![0u8; total * page_bytes];
        let mut slots = order.iter();
        let mut placed: Vec<Vec<(Vec<usize>, usize)>> = Vec::with_capacity(heads.len());
        for (head, rows) in groups.iter().zip(heads) {
            let mut list = Vec::with_capacity(head.len());
            for (b, bytes) in head.iter().enumerate() {
                let mut at = Vec::new();
                for (chunk, &slot) in bytes.chunks(page_bytes).zip(slots.by_ref()) {
                    arena[slot * page_bytes..slot * page_bytes + chunk.len()].copy_from_slice(chunk);
                    at.push(slot);
                }
                list.push((at, (rows.rows() - b * BLOCK).min(BLOCK)));
            }
            placed.push(list);
        }
        let data = self.stream.clone_htod(&arena).map_err(gpu_err("copying pages"))?;
        self.stream.synchronize().map_err(gpu_err("synchronizing"))?;
        let base = device_address(&data, &self.stream);
        let groups = placed
            .into_iter()
            .map(|list| {
                list.into_iter()
                    .map(|(slots, rows)| PagedGroup {
                        pages: slots.iter().map(|&s| base + (s * page_bytes) as u64).collect(),
                        rows,
                        mask: if rows >= BLOCK { u64::MAX } else { (1u64 << rows) - 1 },
                    })
                    .collect()
            })
            .collect();
        let bytes = heads.iter().map(HackRows::bytes).sum();
        Ok(DevicePages { _data: data, groups, page_bytes, bytes })
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
        self.check_codec_shape(shape, q, dev.kv_heads)?;
        let (sel, listed) = match ranges {
            Some(r) => {
                let (blocks, masks, n) = row_masks(r, dev.rows);
                let blocks = self.stream.clone_htod(&blocks).map_err(gpu_err("copying the selected blocks"))?;
                let masks = self.stream.clone_htod(&masks).map_err(gpu_err("copying the row masks"))?;
                (Selection::Rows { blocks, masks, n }, n)
            }
            None => (Selection::All, dev.rows.div_ceil(BLOCK)),
        };
        self.hack_job(shape, q, sel, listed)
    }

    /// Prepares a homomorphic decode of `q` (`q_heads × head_dim`) over value blocks read in
    /// place where they are stored: `groups[h]`, the blocks of KV head `h` (each listed
    /// once), in the group layout over pages of `page_bytes` (see [`PagedGroup`]).
    /// [`GpuBackend::fetch_hack_partials`] returns the partials, to merge with rows attended
    /// elsewhere. A group whose row count, mask or page count does not fit is a typed error.
    pub fn prepare_hack_paged(
        &self,
        shape: &AttnShape,
        q: &[f32],
        groups: &[Vec<PagedGroup>],
        page_bytes: usize,
    ) -> Result<HackJob> {
        self.hack_kernel(&self.hack_paged, 1)?;
        self.check_codec_shape(shape, q, groups.len())?;
        let bad = |message: String| Err(Error::InvalidArgument { what: "paged 2-bit groups", message });
        if page_bytes == 0 || !page_bytes.is_multiple_of(4) {
            return bad(format!("pages must be a positive multiple of 4 bytes, got {page_bytes}"));
        }
        for (h, head) in groups.iter().enumerate() {
            for (i, g) in head.iter().enumerate() {
                let pages = HackView::group_len(self.head_dim, HackParams::default(), g.rows).div_ceil(page_bytes);
                let beyond = if g.rows >= BLOCK { 0 } else { g.mask >> g.rows };
                if g.rows == 0 || g.rows > BLOCK || beyond != 0 {
                    return bad(format!("group {i} of head {h}: {} rows, mask {:#x}", g.rows, g.mask));
                }
                if g.pages.len() != pages || pages > MAX_PAGES || g.pages.contains(&0) {
                    return bad(format!(
                        "group {i} of head {h}: {} page addresses for {pages} pages of {page_bytes} bytes (at most {MAX_PAGES}, none 0)",
                        g.pages.len()
                    ));
                }
            }
        }
        let n = groups.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let (mut pages, mut masks, mut rows) =
            (vec![0u64; groups.len() * n * MAX_PAGES], vec![0u64; groups.len() * n], vec![1i32; groups.len() * n]);
        for (h, head) in groups.iter().enumerate() {
            for (i, g) in head.iter().enumerate() {
                let at = h * n + i;
                pages[at * MAX_PAGES..at * MAX_PAGES + g.pages.len()].copy_from_slice(&g.pages);
                masks[at] = g.mask;
                rows[at] = g.rows as i32;
            }
        }
        // Padding entries (heads with fewer groups) have an empty mask: no page is read.
        let sel = Selection::Paged {
            pages: self.stream.clone_htod(&pages).map_err(gpu_err("copying page addresses"))?,
            masks: self.stream.clone_htod(&masks).map_err(gpu_err("copying the row masks"))?,
            rows: self.stream.clone_htod(&rows).map_err(gpu_err("copying group rows"))?,
            n,
            page_bytes,
        };
        self.hack_job(shape, q, sel, n)
    }

    /// A typed error unless `shape` fits the compiled kernels and `kv_heads` heads of rows,
    /// and `q` holds its queries (the hack2 and kv43 jobs' shared check).
    pub(super) fn check_codec_shape(&self, shape: &AttnShape, q: &[f32], kv_heads: usize) -> Result<()> {
        if shape.head_dim != self.head_dim || shape.group() > MAX_GROUP || shape.kv_heads != kv_heads {
            return Err(Error::InvalidArgument {
                what: "shape",
                message: format!(
                    "head_dim {} (backend {}), group {} (at most {MAX_GROUP}), kv_heads {} (rows hold {kv_heads})",
                    shape.head_dim,
                    self.head_dim,
                    shape.group(),
                    shape.kv_heads,
                ),
            });
        }
        if q.len() != shape.query_len() {
            return Err(Error::ShapeMismatch { what: "queries", expected: shape.query_len(), got: q.len() });
        }
        Ok(())
    }

    /// The job's buffers: `q` quantized, partials for `listed` value blocks per KV head.
    fn hack_job(&self, shape: &AttnShape, q: &[f32], sel: Selection, listed: usize) -> Result<HackJob> {
        let (words, meta) = quantize_queries(q, shape.head_dim);
        let blocks = listed.max(1);
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
            lse: self.stream.alloc_zeros::<f32>(shape.q_heads).map_err(gpu_err("allocating the output"))?,
            chunks,
            chunk_blocks,
            shape: *shape,
            scale: shape.scale(),
            sel,
        })
    }

    /// Enqueues the homomorphic decode over `dev` (a job of [`GpuBackend::prepare_hack`] or
    /// [`GpuBackend::prepare_hack_rows`] for it) and the merge of its partials.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub fn launch_hack(&self, dev: &DeviceHack, job: &mut HackJob) -> Result<()> {
        let sh = job.shape;
        let f = self.hack_kernel(&self.hack_partial, sh.group())?;
        if sh.kv_heads != dev.kv_heads || matches!(job.sel, Selection::Paged { .. }) {
            return Err(Error::InvalidArgument {
                what: "hack job",
                message: "the job was not prepared for these rows (prepare_hack or prepare_hack_rows)".into(),
            });
        }
        let (rows, chunk_blocks) = (dev.rows as i32, job.chunk_blocks as i32);
        let cfg = hack_grid(job);
        let mut b = self.stream.launch_builder(f);
        b.arg(&dev.kc).arg(&dev.kmin).arg(&dev.kscale).arg(&dev.ksum).arg(&dev.vc).arg(&dev.vmin).arg(&dev.vscale);
        b.arg(&rows).arg(&job.q8).arg(&job.qmeta).arg(&job.scale).arg(&chunk_blocks).arg(&mut job.part);
        // Dense: null selection pointers (the kernel then walks every block).
        let null = 0u64;
        let n_sel = match &job.sel {
            Selection::Rows { n, .. } => *n as i32,
            _ => 0,
        };
        match &job.sel {
            Selection::Rows { blocks, masks, .. } => b.arg(blocks).arg(masks).arg(&n_sel),
            _ => b.arg(&null).arg(&null).arg(&n_sel),
        };
        // SAFETY: dev holds kv_heads × rows rows in the layout hack_partial reads (checked in
        // upload_hack); q8/qmeta hold q_heads queries and part kv_heads × chunks × group
        // partials (sized in hack_job for this shape, whose kv_heads match dev, checked
        // above); a selection holds kv_heads × n block ids below the head's block count
        // (row_masks lists only blocks of rows < dev.rows, checked in prepare_hack_rows) and
        // n masks.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching hack_partial"))?;
        self.merge_hack(job)
    }

    /// Enqueues the homomorphic decode of a [`GpuBackend::prepare_hack_paged`] job and the
    /// merge of its partials. The pages must stay readable and unchanged until
    /// [`GpuBackend::fetch_hack_partials`] returns.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub fn launch_hack_paged(&self, job: &mut HackJob) -> Result<()> {
        let f = self.hack_kernel(&self.hack_paged, job.shape.group())?;
        let Selection::Paged { pages, masks, rows, n, page_bytes } = &job.sel else {
            return Err(Error::InvalidArgument {
                what: "hack job",
                message: "launch_hack_paged runs jobs of prepare_hack_paged".into(),
            });
        };
        let (n, page_bytes) = (*n as i32, *page_bytes as i32);
        let chunk_blocks = job.chunk_blocks as i32;
        let cfg = hack_grid(job);
        let mut b = self.stream.launch_builder(f);
        b.arg(pages).arg(masks).arg(rows).arg(&n).arg(&page_bytes);
        b.arg(&job.q8).arg(&job.qmeta).arg(&job.scale).arg(&chunk_blocks).arg(&mut job.part);
        // SAFETY: pages/masks/rows hold kv_heads × n entries (MAX_PAGES addresses each),
        // every group's row count, mask and page count checked in prepare_hack_paged against
        // its layout for this head dimension (the kernel reads only the group's bytes, below
        // its page count × page_bytes, and no page of an empty-mask padding entry's rows
        // beyond what the mask names); the caller keeps the pages device-readable until the
        // results are fetched. q8/qmeta/part are sized for this shape (hack_job).
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching hack_paged"))?;
        self.merge_hack(job)
    }

    /// Enqueues the merge of a homomorphic decode's partials into its output and lse.
    fn merge_hack(&self, job: &mut HackJob) -> Result<()> {
        let lse = device_address(&job.lse, &self.stream);
        let copies = super::MailboxCopies::default();
        self.launch_merge(&self.stream, &job.shape, &job.part, job.chunks, &mut job.out, lse, [(0, 0); 2], copies)
    }

    /// Waits for the stream and copies a homomorphic decode's output back.
    pub fn fetch_hack(&self, job: &HackJob) -> Result<Vec<f32>> {
        self.stream.clone_dtoh(&job.out).map_err(gpu_err("copying the output back"))
    }

    /// Waits for the stream and returns a homomorphic decode's partial `(o, m, l)` per query
    /// head, to merge with partials computed elsewhere (the CPU's steady and estimation zones).
    pub fn fetch_hack_partials(&self, job: &HackJob) -> Result<Vec<crate::Partial>> {
        self.merged_partials(&job.out, &job.lse)
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
        let f = self.hack_dequant.as_ref().ok_or_else(|| self.hack_head_dim_error())?;
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

/// The GPU kernels score HACK's per-token keys; per-channel keys (`hack2c`) would need the
/// query scaled and quantized per value block on the device, which they do not do yet.
fn per_token_only(heads: &[HackRows]) -> Result<()> {
    if heads.iter().any(|h| h.params().per_channel()) {
        return Err(Error::InvalidArgument {
            what: "hack rows",
            message: "2-bit rows with per-channel keys (hack2c) have no GPU kernel yet: use hack2 on the GPU, or the CPU executor".into(),
        });
    }
    Ok(())
}
