//! The GPU side of the `kv43` codec: the encoded rows of every KV head in device memory and
//! homomorphic decode attention over all of them (`kv43_partial_g{G}` in `kv43.cu`, one
//! kernel per GQA group size, then the shared merge kernel), the arithmetic of
//! `Kv43Rows::attend_runs` on the CPU: per key group the queries coded to 8 bits against
//! the channel scales, `dp4a` scores on the 4- (or 5-) bit key codes, 8-bit probabilities per
//! 64 rows and `dp4a` value sums on the 3- (or 4-) bit codes. The f16 rows beside the codes
//! (each piece's partial key group, a context's steady zone) can live on the device too
//! ([`Kv43SideRows`], appended as they arrive): the plain kernel attends them in the same
//! launch sequence and the merge folds both, so a step needs no host-side attention.

use super::{chunk_rows, device_address, gpu_err, AttnRows, GpuBackend, MAX_GROUP, NO_STEADY};
use crate::cpu::kv43::{Kv43Head, Kv43Params};
use crate::error::{Error, Result};
use crate::kv43_lists::Kv43Lists;
use crate::shape::AttnShape;
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PinnedHostSlice, PushKernelArg};

/// Rows of a probability block on the GPU (the kernels' `K43_ROWS`).
const BLOCK: usize = 64;
/// CTAs a decode aims for (`ATTNSTORE_KV43_CTAS` overrides it, for tuning: [`kv43_ctas`]).
const KV43_CTAS: usize = 2048;

/// The CTAs a kv43 decode aims for: `ATTNSTORE_KV43_CTAS` when set to a positive number,
/// else [`KV43_CTAS`].
fn kv43_ctas() -> usize {
    std::env::var("ATTNSTORE_KV43_CTAS").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(KV43_CTAS)
}

/// The encoded kv43 rows of every KV head of one layer in device memory.
pub struct DeviceKv43 {
    kc: CudaSlice<u8>,
    /// Fifth key bits (5-bit keys), else `None`.
    khigh: Option<CudaSlice<u8>>,
    kmin: CudaSlice<u16>,
    kscale: CudaSlice<u16>,
    ksum: CudaSlice<u16>,
    /// Value codes as nibble words (`value_nibble_words`), per head `rows/8 × head_dim`.
    vw: CudaSlice<u32>,
    vmin: CudaSlice<u16>,
    vscale: CudaSlice<u16>,
    params: Kv43Params,
    rows: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl DeviceKv43 {
    /// Encoded rows per KV head.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Device bytes of codes and metadata.
    pub fn bytes(&self) -> usize {
        self.kc.len()
            + self.khigh.as_ref().map_or(0, CudaSlice::len)
            + 4 * self.vw.len()
            + 2 * (self.kmin.len() + self.kscale.len() + self.ksum.len() + self.vmin.len() + self.vscale.len())
    }
}

/// f16 rows a kv43 decode attends beside the codes (each piece's partial key group, a
/// context's steady zone) in device memory, row after row, each row its KV heads' keys then
/// their values: key `h` of row `r` at `(2r · kv_heads + h) · head_dim`, its value
/// `kv_heads · head_dim` later. Appended as they arrive ([`GpuBackend::append_kv43_side`])
/// up to a fixed capacity, one copy per append.
pub struct Kv43SideRows {
    /// `capacity × 2 × kv_heads × head_dim` f16 bits.
    kv: CudaSlice<u16>,
    /// `2r · kv_heads` for `r < capacity`: the plain kernel's row list, shared by every KV head.
    list: CudaSlice<i32>,
    rows: usize,
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Rows per CTA of the plain kernel.
    chunk: usize,
    /// Page-locked staging of one row's keys and values: a decode step appends one row (of
    /// every KV head), and a copy from pageable memory costs ~10 µs of driver staging on the
    /// H100 host; larger appends are copied from the caller's memory.
    stage: PinnedHostSlice<u16>,
}

impl Kv43SideRows {
    /// Rows held (per KV head).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows it can hold (per KV head).
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Device buffers of a listed launch ([`Kv43Lists`]), kept with the job until its next one.
struct ListedBuffers {
    /// Everything the host lists, packed (`ListedLayout`) and copied in one piece from
    /// `stage` (page-locked, as long: no staging by the driver).
    packed: CudaSlice<u8>,
    stage: PinnedHostSlice<u8>,
    part: CudaSlice<f32>,
}

/// Where each list sits in a listed launch's packed bytes: the masks (u64) first, then the
/// host partials (f32), the block offsets and blocks, the side-row entries and their offsets
/// (i32), each at a multiple of its size.
struct ListedLayout {
    extra: usize,
    off: usize,
    block: usize,
    side: usize,
    side_off: usize,
    len: usize,
}

impl ListedLayout {
    fn of(kv_heads: usize, blocks: usize, extra: usize, side: usize) -> Self {
        let extra_at = 8 * blocks;
        let off = extra_at + 4 * extra;
        let block = off + 4 * (kv_heads + 1);
        let side_at = block + 4 * blocks;
        let side_off = side_at + 4 * side;
        ListedLayout { extra: extra_at, off, block, side: side_at, side_off, len: side_off + 4 * (kv_heads + 1) }
    }
}

/// Buffers of one kv43 decode launch.
pub struct Kv43Job {
    q: CudaSlice<f32>,
    /// Page-locked staging of the queries and the output: asynchronous copies, no staging
    /// by the driver.
    q_host: PinnedHostSlice<f32>,
    out_host: PinnedHostSlice<f32>,
    part: CudaSlice<f32>,
    /// The plain kernel's partials over side rows (allocated by the first launch with some).
    side_part: Option<CudaSlice<f32>>,
    /// The last listed launch's lists and partials.
    listed: Option<ListedBuffers>,
    out: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    chunks: usize,
    chunk_blocks: usize,
    shape: AttnShape,
    scale: f32,
}

impl Kv43Job {
    /// The attention shape the job was prepared for.
    pub fn shape(&self) -> AttnShape {
        self.shape
    }
}

impl GpuBackend {
    /// The kv43 kernel for a GQA group of `group` heads, or the typed error for a head
    /// dimension the kernels were not compiled for (or a group past MAX_GROUP).
    fn kv43_kernel(&self, group: usize) -> Result<&CudaFunction> {
        let kernels = self.kv43_partial.as_ref().ok_or_else(|| Error::InvalidArgument {
            what: "head_dim",
            message: format!(
                "the GPU kv43 kernels need a head dimension that is a multiple of 64, got {}",
                self.head_dim
            ),
        })?;
        kernels.get(group.wrapping_sub(1)).ok_or_else(|| Error::InvalidArgument {
            what: "group",
            message: format!("the kv43 kernels serve groups of 1 to {MAX_GROUP} query heads, got {group}"),
        })
    }

    /// Copies the encoded rows of every KV head (the same parameters and encoded row count
    /// for all; key groups and value blocks multiples of 64 rows) to device memory. Each
    /// head's partial key group (f16 rows not yet encoded) is not copied.
    pub fn upload_kv43(&self, heads: &[Kv43Head]) -> Result<DeviceKv43> {
        let pieces: Vec<Vec<&Kv43Head>> = heads.iter().map(|h| vec![h]).collect();
        self.upload_kv43_pieces(&pieces)
    }

    /// [`GpuBackend::upload_kv43`] of heads held in pieces (e.g. a wave index's segments):
    /// per KV head the encoded rows of its pieces one after another (whole key groups each;
    /// every piece's partial key group is left out, for the caller to attend on the host).
    /// Every head needs the same parameters, head dimension and encoded rows in all.
    pub fn upload_kv43_pieces(&self, heads: &[Vec<&Kv43Head>]) -> Result<DeviceKv43> {
        self.kv43_kernel(1)?;
        let d = self.head_dim;
        let bad = |message: String| Err(Error::InvalidArgument { what: "kv43 rows", message });
        let Some(first) = heads.first().and_then(|p| p.first()) else { return bad("no KV heads to upload".into()) };
        let params = first.params();
        let encoded = |pieces: &[&Kv43Head]| pieces.iter().map(|p| p.encoded_rows()).sum::<usize>();
        let rows = encoded(&heads[0]);
        if heads.iter().any(|p| encoded(p) != rows || p.iter().any(|h| h.params() != params || h.head_dim() != d)) {
            return bad(format!("every head needs the same parameters, encoded row count and head dimension {d}"));
        }
        if !params.key_group.is_multiple_of(BLOCK) || !params.value_block.is_multiple_of(BLOCK) || rows == 0 {
            return bad(format!(
                "the GPU kernels need key groups and value blocks of whole {BLOCK}-row blocks and some encoded rows, got {params:?} and {rows} rows"
            ));
        }
        let bits = |x: &[half::f16]| x.iter().map(|v| v.to_bits()).collect::<Vec<u16>>();
        let (mut kc, mut khigh, mut kmin, mut kscale, mut ksum, mut vw, mut vmin, mut vscale) =
            (vec![], vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        let value_bits = usize::from(params.value_bits);
        for a in heads.iter().flatten().map(|h| h.arrays()) {
            kc.extend_from_slice(a.key_codes);
            khigh.extend_from_slice(a.key_high);
            kmin.extend(bits(a.key_min));
            kscale.extend(bits(a.key_scale));
            ksum.extend_from_slice(a.key_sums);
            vw.extend(crate::cpu::kv43::value_nibble_words(a.value_planes, d, value_bits));
            vmin.extend(bits(a.value_min));
            vscale.extend(bits(a.value_scale));
        }
        let up8 = |x: &[u8]| self.stream.clone_htod(x).map_err(gpu_err("copying kv43 codes"));
        let up16 = |x: &[u16]| self.stream.clone_htod(x).map_err(gpu_err("copying kv43 metadata"));
        Ok(DeviceKv43 {
            kc: up8(&kc)?,
            khigh: if khigh.is_empty() { None } else { Some(up8(&khigh)?) },
            kmin: up16(&kmin)?,
            kscale: up16(&kscale)?,
            ksum: up16(&ksum)?,
            vw: self.stream.clone_htod(&vw).map_err(gpu_err("copying kv43 value codes"))?,
            vmin: up16(&vmin)?,
            vscale: up16(&vscale)?,
            params,
            rows,
            kv_heads: heads.len(),
            head_dim: d,
        })
    }

    /// Device memory for `capacity` f16 side rows of `kv_heads` KV heads ([`Kv43SideRows`]),
    /// none held yet.
    pub fn alloc_kv43_side(&self, kv_heads: usize, capacity: usize) -> Result<Kv43SideRows> {
        if kv_heads == 0 || capacity == 0 || capacity > i32::MAX as usize / kv_heads {
            return Err(Error::InvalidArgument {
                what: "kv43 side rows",
                message: format!(
                    "need some KV heads and a capacity of 1 to {} rows, got {kv_heads} heads and {capacity} rows",
                    i32::MAX as usize / kv_heads.max(1)
                ),
            });
        }
        let n = capacity * 2 * kv_heads * self.head_dim;
        let list: Vec<i32> = (0..capacity).map(|r| (2 * r * kv_heads) as i32).collect();
        Ok(Kv43SideRows {
            kv: self.stream.alloc_zeros::<u16>(n).map_err(gpu_err("allocating kv43 side rows"))?,
            list: self.stream.clone_htod(&list).map_err(gpu_err("copying the side rows' list"))?,
            rows: 0,
            capacity,
            kv_heads,
            head_dim: self.head_dim,
            chunk: chunk_rows(capacity, kv_heads),
            stage: self.pinned_zeroed(0, 2 * kv_heads * self.head_dim)?,
        })
    }

    /// Appends rows to `side`: `keys` and `values` are f16 bits, `n × kv_heads × head_dim`
    /// each, row after row with the KV heads of a row together (a wave index's `SteadyRows`).
    /// One copy, ordered on the stream before the next launch.
    pub fn append_kv43_side(&self, side: &mut Kv43SideRows, keys: &[u16], values: &[u16]) -> Result<()> {
        let per_row = side.kv_heads * self.head_dim;
        let n = keys.len() / per_row;
        if side.head_dim != self.head_dim
            || keys.len() != n * per_row
            || values.len() != keys.len()
            || side.rows + n > side.capacity
        {
            return Err(Error::InvalidArgument {
                what: "kv43 side rows",
                message: format!(
                    "rows of {per_row} values each (keys {}, values {}, head dimension {} for {}) must fit the {} free of {}",
                    keys.len(),
                    values.len(),
                    side.head_dim,
                    self.head_dim,
                    side.capacity - side.rows,
                    side.capacity
                ),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let span = 2 * side.rows * per_row..2 * (side.rows + n) * per_row;
        let err = gpu_err("copying kv43 side rows");
        let interleave = |to: &mut [u16]| {
            for ((row, k), v) in
                to.chunks_exact_mut(2 * per_row).zip(keys.chunks_exact(per_row)).zip(values.chunks_exact(per_row))
            {
                row[..per_row].copy_from_slice(k);
                row[per_row..].copy_from_slice(v);
            }
        };
        if n == 1 {
            // Waits for the last copy out of the staging, if one is in flight.
            interleave(side.stage.as_mut_slice().map_err(&err)?);
            self.stream.memcpy_htod(&side.stage, &mut side.kv.slice_mut(span)).map_err(&err)?;
        } else {
            let mut rows = vec![0u16; 2 * n * per_row];
            interleave(&mut rows);
            self.stream.memcpy_htod(&rows, &mut side.kv.slice_mut(span)).map_err(&err)?;
        }
        side.rows += n;
        Ok(())
    }

    /// Prepares a homomorphic decode of `q` (`q_heads × head_dim`) over every encoded row
    /// of `dev`.
    pub fn prepare_kv43(&self, shape: &AttnShape, q: &[f32], dev: &DeviceKv43) -> Result<Kv43Job> {
        self.check_kv43_queries(shape, q, dev.kv_heads)?;
        let blocks = dev.rows / BLOCK;
        let chunk_blocks = (blocks * shape.kv_heads).div_ceil(kv43_ctas()).max(1);
        let chunks = blocks.div_ceil(chunk_blocks);
        let part_len = shape.kv_heads * chunks * shape.group() * (shape.head_dim + 2);
        let mut job = Kv43Job {
            q: self.stream.alloc_zeros::<f32>(q.len()).map_err(gpu_err("allocating queries"))?,
            q_host: self.pinned_zeroed(0, q.len())?,
            out_host: self.pinned_zeroed(0, shape.query_len())?,
            part: self.stream.alloc_zeros::<f32>(part_len).map_err(gpu_err("allocating partials"))?,
            side_part: None,
            listed: None,
            out: self.stream.alloc_zeros::<f32>(shape.query_len()).map_err(gpu_err("allocating the output"))?,
            lse: self.stream.alloc_zeros::<f32>(shape.q_heads).map_err(gpu_err("allocating the output"))?,
            chunks,
            chunk_blocks,
            shape: *shape,
            scale: shape.scale(),
        };
        self.stage_kv43_queries(&mut job, q)?;
        Ok(job)
    }

    /// Copies `q` (checked) through the job's page-locked staging into its device queries,
    /// ordered on the stream.
    fn stage_kv43_queries(&self, job: &mut Kv43Job, q: &[f32]) -> Result<()> {
        // Waits for the last copy out of the staging, if one is in flight.
        job.q_host.as_mut_slice().map_err(gpu_err("staging queries"))?[..q.len()].copy_from_slice(q);
        self.stream.memcpy_htod(&job.q_host, &mut job.q).map_err(gpu_err("copying queries"))
    }

    /// Copies the next queries `q` (`q_heads × head_dim`, finite) into `job`, so a decode step
    /// repeated over the same rows allocates nothing.
    pub fn requery_kv43(&self, job: &mut Kv43Job, q: &[f32]) -> Result<()> {
        self.check_kv43_queries(&job.shape, q, job.shape.kv_heads)?;
        self.stage_kv43_queries(job, q)
    }

    /// The shape check of every codec job (`check_codec_shape`) and finite queries: what a
    /// kv43 launch needs of `q` before it is copied to the device.
    fn check_kv43_queries(&self, shape: &AttnShape, q: &[f32], kv_heads: usize) -> Result<()> {
        self.check_codec_shape(shape, q, kv_heads)?;
        match crate::first_non_finite(q) {
            Some(i) => Err(Error::InvalidArgument { what: "queries", message: format!("element {i} is not finite") }),
            None => Ok(()),
        }
    }

    /// Enqueues the kv43 decode over `dev` (a job of [`GpuBackend::prepare_kv43`] for it),
    /// the plain kernel over the f16 rows of `side` when given, and the merge of both's
    /// partials into the job's output.
    #[allow(unsafe_code, reason = "the kernel launch's contract is checked here")]
    pub fn launch_kv43(&self, dev: &DeviceKv43, side: Option<&Kv43SideRows>, job: &mut Kv43Job) -> Result<()> {
        self.check_kv43_launch(dev, side, job)?;
        if job.chunks * job.chunk_blocks < dev.rows / BLOCK {
            return Err(Error::InvalidArgument {
                what: "kv43 job",
                message: "the job was not prepared for these rows on this backend (prepare_kv43)".into(),
            });
        }
        let (chunks, chunk_blocks) = (job.chunks, job.chunk_blocks);
        // SAFETY: the launch covers every block (chunks × chunk_blocks ≥ blocks, checked
        // above) of dev, whose shape the job's matches (check_kv43_launch); part holds
        // kv_heads × chunks × group partials (prepare_kv43); no list.
        unsafe {
            self.launch_kv43_kernel(dev, &job.q, job.scale, &job.shape, (chunks, chunk_blocks), &mut job.part, None)?
        };
        let side_part = match side.filter(|s| s.rows > 0) {
            Some(s) => self.launch_kv43_side(s, None, job)?,
            None => (0, 0),
        };
        let lse = device_address(&job.lse, &self.stream);
        let copies = super::MailboxCopies::default();
        self.launch_merge(&self.stream, &job.shape, &job.part, chunks, &mut job.out, lse, [side_part, (0, 0)], copies)
    }

    /// Enqueues a sparse kv43 decode: the kv43 kernel over the listed blocks of `dev` (each
    /// block's unmasked rows), the plain kernel over each KV head's listed rows of `side`,
    /// and the merge of both's partials and the host's (`lists.extra`) into the job's
    /// output. `job` is one of [`GpuBackend::prepare_kv43`] for `dev`; the lists are copied
    /// to the device and kept with the job until its next launch.
    #[allow(unsafe_code, reason = "the kernel launch's contract is checked here")]
    pub fn launch_kv43_listed(
        &self,
        dev: &DeviceKv43,
        side: &Kv43SideRows,
        lists: &Kv43Lists,
        job: &mut Kv43Job,
    ) -> Result<()> {
        self.check_kv43_launch(dev, Some(side), job)?;
        let sh = job.shape;
        let bad = |message: String| Err(Error::InvalidArgument { what: "kv43 lists", message });
        let blocks = dev.rows / BLOCK;
        if lists.blocks.len() != sh.kv_heads || lists.side.len() != sh.kv_heads {
            return bad(format!(
                "{} block lists and {} side-row lists for {} KV heads",
                lists.blocks.len(),
                lists.side.len(),
                sh.kv_heads
            ));
        }
        for (h, list) in lists.blocks.iter().enumerate() {
            if list.windows(2).any(|w| w[0].0 >= w[1].0) || list.last().is_some_and(|b| b.0 as usize >= blocks) {
                return bad(format!("KV head {h}: blocks must ascend and be below the {blocks} encoded"));
            }
        }
        if let Some(h) = lists.side.iter().position(|l| l.iter().any(|&r| r as usize >= side.rows)) {
            return bad(format!("KV head {h}: a side row past the {} held", side.rows));
        }
        let per_head = self.head_dim + 2;
        if !lists.extra.is_empty() && lists.extra.len() != sh.q_heads * per_head {
            return bad(format!(
                "host partials of {} floats, expected none or {} ({} query heads × {per_head})",
                lists.extra.len(),
                sh.q_heads * per_head,
                sh.q_heads
            ));
        }
        let offsets = |n: &mut dyn Iterator<Item = usize>| -> Vec<i32> {
            std::iter::once(0)
                .chain(n.scan(0, |at, len| {
                    *at += len as i32;
                    Some(*at)
                }))
                .collect()
        };
        let listed: usize = lists.blocks.iter().map(Vec::len).sum();
        let longest = lists.blocks.iter().map(Vec::len).max().unwrap_or(0);
        let chunk_blocks = listed.div_ceil(kv43_ctas()).max(1);
        let chunks = longest.div_ceil(chunk_blocks).max(1);
        let sides: usize = lists.side.iter().map(Vec::len).sum();
        let at = ListedLayout::of(sh.kv_heads, listed, lists.extra.len(), sides);
        let part_len = sh.kv_heads * chunks * sh.group() * per_head;
        let old = job.listed.take();
        let (packed, part) = match old {
            Some(b) => (
                Some((b.packed, b.stage)).filter(|p| p.0.len() >= at.len),
                Some(b.part).filter(|p| p.len() >= part_len),
            ),
            None => (None, None),
        };
        let err = gpu_err("copying kv43 lists");
        let (packed, mut stage) = match packed {
            Some(p) => p,
            None => {
                let cap = at.len.next_power_of_two();
                (self.stream.alloc_zeros::<u8>(cap).map_err(&err)?, self.pinned_zeroed(0, cap)?)
            }
        };
        // Waits for the last copy out of the staging, if one is in flight.
        let bytes = stage.as_mut_slice().map_err(&err)?;
        let mut put = |at: usize, x: &[u8]| bytes[at..at + x.len()].copy_from_slice(x);
        for (i, b) in lists.blocks.iter().flatten().enumerate() {
            put(8 * i, &b.1.to_ne_bytes());
            put(at.block + 4 * i, &(b.0 as i32).to_ne_bytes());
        }
        for (i, x) in lists.extra.iter().enumerate() {
            put(at.extra + 4 * i, &x.to_ne_bytes());
        }
        for (i, r) in lists.side.iter().flatten().enumerate() {
            put(at.side + 4 * i, &((2 * *r as usize * side.kv_heads) as i32).to_ne_bytes());
        }
        for (i, x) in offsets(&mut lists.blocks.iter().map(Vec::len)).iter().enumerate() {
            put(at.off + 4 * i, &x.to_ne_bytes());
        }
        for (i, x) in offsets(&mut lists.side.iter().map(Vec::len)).iter().enumerate() {
            put(at.side_off + 4 * i, &x.to_ne_bytes());
        }
        let part = match part {
            Some(p) => p,
            None => self.stream.alloc_zeros::<f32>(part_len).map_err(gpu_err("allocating partials"))?,
        };
        let mut buffers = ListedBuffers { packed, stage, part };
        // The whole staging (the lists and whatever follows them, unread).
        self.stream.memcpy_htod(&buffers.stage, &mut buffers.packed).map_err(&err)?;
        let base = device_address(&buffers.packed, &self.stream);
        let addr = |offset: usize| base + offset as u64;
        let list = (addr(at.off), addr(at.block), addr(0));
        // SAFETY: every listed block is below dev's blocks and the offsets cover the lists
        // (checked and packed above, each at its place in `packed`, 4- or 8-byte aligned),
        // chunks × chunk_blocks cover the longest list; part holds kv_heads × chunks × group
        // partials (allocated above); the lists live in the job until its next launch, after
        // the caller's fetch.
        unsafe {
            self.launch_kv43_kernel(dev, &job.q, job.scale, &sh, (chunks, chunk_blocks), &mut buffers.part, Some(list))?
        };
        let longest_side = lists.side.iter().map(Vec::len).max().unwrap_or(0);
        let side_part = match longest_side {
            0 => (0, 0),
            n => self.launch_kv43_side(side, Some(((addr(at.side), addr(at.side_off)), n)), job)?,
        };
        let extra = if lists.extra.is_empty() { (0, 0) } else { (addr(at.extra), 1) };
        let lse = device_address(&job.lse, &self.stream);
        let copies = super::MailboxCopies::default();
        let merged =
            self.launch_merge(&self.stream, &sh, &buffers.part, chunks, &mut job.out, lse, [side_part, extra], copies);
        job.listed = Some(buffers);
        merged
    }

    /// What every kv43 launch needs of its copy, side rows and job: the job's shape for the
    /// copy's KV heads on this backend's head dimension, and side rows of the same.
    fn check_kv43_launch(&self, dev: &DeviceKv43, side: Option<&Kv43SideRows>, job: &Kv43Job) -> Result<()> {
        let sh = job.shape;
        self.kv43_kernel(sh.group())?;
        if sh.kv_heads != dev.kv_heads || dev.head_dim != self.head_dim || sh.head_dim != self.head_dim {
            return Err(Error::InvalidArgument {
                what: "kv43 job",
                message: "the job was not prepared for these rows on this backend (prepare_kv43)".into(),
            });
        }
        if let Some(s) = side.filter(|s| s.kv_heads != sh.kv_heads || s.head_dim != self.head_dim) {
            return Err(Error::InvalidArgument {
                what: "kv43 side rows",
                message: format!(
                    "side rows of {} KV heads of dimension {} for a job of {} of dimension {}",
                    s.kv_heads, s.head_dim, sh.kv_heads, self.head_dim
                ),
            });
        }
        Ok(())
    }

    /// Enqueues `kv43_partial` over `dev` into `part`: `chunks` CTAs per KV head of
    /// `chunk_blocks` blocks (or list entries) each; `list`: the device addresses of the
    /// per-head offsets, blocks and masks, or `None` for every block.
    ///
    /// # Safety
    /// `sh` matches `dev` on this backend (check_kv43_launch); `part` holds kv_heads × chunks
    /// × group partials; without a list chunks × chunk_blocks cover dev's blocks; a list's
    /// offsets (kv_heads + 1) bound its entries, every entry is a block of dev, and every
    /// buffer lives until the stream has run the kernel.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    #[allow(clippy::too_many_arguments, reason = "the rows, the queries, the grid, the partials and the list")]
    unsafe fn launch_kv43_kernel(
        &self,
        dev: &DeviceKv43,
        q: &CudaSlice<f32>,
        scale: f32,
        sh: &AttnShape,
        (chunks, chunk_blocks): (usize, usize),
        part: &mut CudaSlice<f32>,
        list: Option<(u64, u64, u64)>,
    ) -> Result<()> {
        let f = self.kv43_kernel(sh.group())?;
        let p = dev.params;
        let (rows, key_group, value_block) = (dev.rows as i32, p.key_group as i32, p.value_block as i32);
        let chunk_blocks = chunk_blocks as i32;
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, sh.kv_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let null = 0u64;
        let (off, block, mask) = list.unwrap_or((0, 0, 0));
        let mut b = self.stream.launch_builder(f);
        b.arg(&dev.kc);
        match &dev.khigh {
            Some(x) => b.arg(x),
            None => b.arg(&null),
        };
        b.arg(&dev.kmin).arg(&dev.kscale).arg(&dev.ksum).arg(&dev.vw).arg(&dev.vmin).arg(&dev.vscale);
        b.arg(&rows).arg(&key_group).arg(&value_block);
        b.arg(q).arg(&scale).arg(&chunk_blocks).arg(part);
        b.arg(&off).arg(&block).arg(&mask);
        // SAFETY: dev holds kv_heads × rows encoded rows in the layout kv43_partial reads
        // (the CPU arrays of `Kv43Head::arrays`, the value planes as nibble words,
        // concatenated per head in upload_kv43, whose parameters fit the kernel: key groups
        // and value blocks of whole 64-row blocks, the fifth-bit plane present exactly for
        // 5-bit keys); q holds q_heads × head_dim queries; the caller's contract for the
        // grid, part and the list.
        unsafe { b.launch(cfg) }.map_err(gpu_err("launching kv43_partial"))?;
        Ok(())
    }

    /// Enqueues the plain kernel over the rows of `side` into the job's side partials
    /// (allocated when short); returns their device address and how many there are per KV
    /// head (the merge's second buffer). `listed`: per-KV-head row lists (the device
    /// addresses of the entries, `2r · kv_heads` for side row `r`, and of their
    /// `kv_heads + 1` offsets; the longest list's length) instead of every row.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    fn launch_kv43_side(
        &self,
        side: &Kv43SideRows,
        listed: Option<((u64, u64), usize)>,
        job: &mut Kv43Job,
    ) -> Result<(u64, usize)> {
        let sh = job.shape;
        let per_chunk = sh.kv_heads * sh.group() * (self.head_dim + 2);
        let (list, identity, chunk) = match listed {
            Some((list, longest)) => (list, longest, chunk_rows(longest, sh.kv_heads)),
            None => ((device_address(&side.list, &self.stream), 0), side.rows, side.chunk),
        };
        let chunks = identity.div_ceil(chunk);
        if job.side_part.as_ref().is_none_or(|p| p.len() < chunks * per_chunk) {
            let need = side.capacity.div_ceil(chunk).max(chunks) * per_chunk;
            job.side_part = Some(self.stream.alloc_zeros::<f32>(need).map_err(gpu_err("allocating partials"))?);
        }
        let part = job.side_part.as_mut().expect("allocated above");
        let base = device_address(&side.kv, &self.stream);
        let rows = AttnRows {
            // Values kv_heads · head_dim f16s (2 bytes each) after a row's keys; KV head h's
            // rows h · head_dim after head 0's.
            kv: (base, base + (side.kv_heads * self.head_dim * 2) as u64, self.head_dim as i64),
            list,
            identity,
            chunk,
            chunks,
            cache: (0, 0, NO_STEADY.0),
            steady: (0, 0),
        };
        // SAFETY: every list entry is 2r · kv_heads for a side row r < side.rows ≤ capacity
        // (the shared list's first `side.rows` entries, or the caller's per-head lists, whose
        // offsets bound them), so KV head h reads the key at (2r · kv_heads + h) · head_dim
        // and the value kv_heads · head_dim after it, inside the capacity × 2 · kv_heads ·
        // head_dim elements of side.kv (alloc_kv43_side);
        // no entry is negative, so the cache and steady addresses are never read; part holds
        // kv_heads × chunks × group partials (allocated above); side, the lists and job are
        // borrowed until the caller's fetch synchronizes the stream.
        unsafe { self.launch_attn_rows(&self.stream, &sh, &job.q, job.scale, rows, part)? };
        Ok((device_address(part, &self.stream), chunks))
    }

    /// Waits for the stream and copies a kv43 decode's output back (`q_heads × head_dim`),
    /// through the job's page-locked staging.
    pub fn fetch_kv43(&self, job: &mut Kv43Job) -> Result<Vec<f32>> {
        self.stream.memcpy_dtoh(&job.out, &mut job.out_host).map_err(gpu_err("copying the output back"))?;
        // The stream's wait (the context's scheduling, not the staging event's blocking wake-up),
        // after which the event cudarc recorded after the copy has completed.
        self.stream.synchronize().map_err(gpu_err("waiting for the kv43 decode"))?;
        Ok(job.out_host.as_slice().map_err(gpu_err("copying the output back"))?.to_vec())
    }
}
