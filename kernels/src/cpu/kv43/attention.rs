//! kv43's fast decode attention for a GQA group at once ([`Kv43Rows::attend_runs`]): per key
//! group each head's 8-bit query made once ([`GroupQueries`]); per 8-row key tile the scores
//! of up to four heads from one read of the codes; per value block the probabilities coded
//! to 8 bits and the value codes weighed for up to four heads from one unpacking. AVX2
//! kernels where the target has them (`avx2.rs`), portable loops otherwise; both equal the
//! scalar references in `mod.rs` (`scores_reference`, `attend`'s value loop) exactly.

use half::slice::HalfFloatSliceExt;
use std::ops::Range;

use super::{check_runs, probability_codes, GroupQuery, Kv43Rows, PART, TILE};
use crate::cpu::partial::Partial;
use crate::error::{Error, Result};

/// Heads one pass of a kernel serves (their accumulators stay in registers).
const HEADS_PER_PASS: usize = 4;
/// Rows (whole tiles) one call of the score kernels covers.
const RUN_ROWS: usize = 64;

/// Every head's query prepared for one key group, in buffers reused from group to group:
/// per head its `d` 8-bit codes of `q∘s` (channel order, four to a little-endian word, as
/// the tile kernel broadcasts them), per head and partition the codes' minimum `a` and step
/// `b`, and `qm = Σ_c q_c m_c`.
pub(super) struct GroupQueries {
    one: GroupQuery,
    d: usize,
    w: Vec<u32>,
    /// With the AVX-512 kernels (`Some`), per head and pair of octets the words of `w` as
    /// `avx512::tile_scores` reads them: the low nibbles' words of both octets (each octet's
    /// word broadcast over its 256-bit half), then the high nibbles' (`heads × d/8`).
    wide: Option<Vec<[u32; 16]>>,
    a: Vec<f32>,
    b: Vec<f32>,
    qm: Vec<f32>,
}

impl GroupQueries {
    /// Buffers for `heads` queries of dimension `d`, for the fastest kernels this CPU has.
    pub(super) fn new(heads: usize, d: usize) -> Self {
        Self::for_kernels(heads, d, wide_kernels())
    }

    /// [`GroupQueries::new`] for the AVX-512 kernels (`wide`, where the CPU has them) or the
    /// AVX2 / portable ones.
    pub(super) fn for_kernels(heads: usize, d: usize, wide: bool) -> Self {
        let parts = d / PART;
        let one = GroupQuery::new(d);
        Self {
            one,
            d,
            w: vec![0; heads * d / 4],
            wide: wide.then(|| vec![[0; 16]; heads * d / 8]),
            a: vec![0.0; heads * parts],
            b: vec![0.0; heads * parts],
            qm: vec![0.0; heads],
        }
    }

    /// Codes the queries `q` (`heads × d`) against key group `g` of `rows`: the group's
    /// channels converted once, each head as [`GroupQuery::prepare`].
    pub(super) fn prepare(&mut self, rows: &Kv43Rows, g: usize, q: &[f32]) {
        let (d, parts) = (self.d, self.d / PART);
        rows.group_channels(g, &mut self.one.key_scale, &mut self.one.key_min);
        #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
        if let Some(wide) = &mut self.wide {
            #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
            // SAFETY: `wide` is `Some` only where `wide_kernels()` found the CPU has AVX-512
            // F/BW, VNNI, VBMI and GFNI (or a test asked after checking the same); every slice
            // read inside is bounds-checked.
            unsafe {
                let channels = (&self.one.key_scale[..], &self.one.key_min[..]);
                super::avx512::prepare_queries(
                    q,
                    channels,
                    &mut self.w,
                    wide,
                    (&mut self.a, &mut self.b, &mut self.qm),
                );
            }
            return;
        }
        for (h, qh) in q.chunks_exact(d).enumerate() {
            self.one.prepare(qh);
            self.qm[h] = self.one.qm;
            for (x, c) in self.w[h * d / 4..(h + 1) * d / 4].iter_mut().zip(self.one.w.chunks_exact(4)) {
                *x = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            for (k, &(a, b)) in self.one.ab.iter().enumerate() {
                (self.a[h * parts + k], self.b[h * parts + k]) = (a, b);
            }
        }
    }

    fn heads(&self) -> usize {
        self.qm.len()
    }
}

/// One value block's buffers while [`Kv43Rows::attend_runs`] folds it: per head the rows'
/// scores (`heads × probability_rows`, `-∞` for rows not attended), their 8-bit probability codes,
/// step and code sum, the codes as broadcast row-pair weights for the AVX2 kernel, the
/// weighed value codes (`heads × d`), the portable path's unpacked codes and the block's
/// value metadata.
struct Block {
    scores: Vec<f32>,
    codes: Vec<u8>,
    steps: Vec<f32>,
    sums: Vec<u32>,
    weights: Vec<[u16; 16]>,
    dot: Vec<u32>,
    z: Vec<u8>,
    mins: Vec<f32>,
    scales: Vec<f32>,
    /// Per head the running maximum before the block and the block's largest score (the
    /// AVX-512 probabilities).
    m: Vec<f32>,
    top: Vec<f32>,
    /// The AVX-512 kernels (as the queries' `wide`).
    wide: bool,
}

/// Buffer shapes: query heads, head dimension, probability rows, AVX-512 kernels.
type BufferShape = (usize, usize, usize, bool);

thread_local! {
    /// Each thread's query and block buffers of its last [`Kv43Rows::attend_runs`] call, kept
    /// for the next call of the same shape (an exact scan calls it once per 2,048-row task;
    /// allocating and zeroing ~10 KB each time was 2–3% of the step). Nothing read leaks
    /// between calls: queries are prepared for every key group and a block's buffers are
    /// written before they are read, its scores reset to -∞ when it is folded.
    static BUFFERS: std::cell::RefCell<Option<(BufferShape, GroupQueries, Block)>> =
        const { std::cell::RefCell::new(None) };
}

impl Block {
    fn new(heads: usize, d: usize, vb: usize, wide: bool) -> Self {
        Self {
            wide,
            scores: vec![f32::NEG_INFINITY; heads * vb],
            codes: vec![0; heads * vb],
            steps: vec![0.0; heads],
            sums: vec![0; heads],
            weights: Vec::new(),
            dot: vec![0; heads * d],
            z: Vec::new(),
            mins: vec![0.0; d],
            scales: vec![0.0; d],
            m: vec![0.0; heads],
            top: vec![0.0; heads],
        }
    }
}

impl Kv43Rows {
    /// Homomorphic decode attention of `heads` query heads sharing this KV head (`q`:
    /// `heads × d`; a GQA group), each row's codes read once for all of them: with
    /// [`Kv43Rows::attend_runs`] over every row. The arithmetic of [`Kv43Rows::attend`] per
    /// head, with a vectorized `exp`. Returns `heads × d`.
    pub fn attend_heads(&self, q: &[f32], heads: usize, scale: f32) -> Result<Vec<f32>> {
        let d = self.d;
        let mut parts = vec![Partial::empty(d); heads];
        if heads == 0 {
            return Err(Error::ShapeMismatch { what: "kv43 queries (heads × d)", expected: d, got: q.len() });
        }
        self.attend_runs(q, scale, &[0..self.rows], &mut parts)?;
        Ok(parts.iter().flat_map(Partial::finish).collect())
    }

    /// Folds rows `ranges` (each within `0..rows()`; any order, sorted and disjoint is what
    /// plans give) into the online-softmax partials `parts` of `parts.len()` query heads
    /// sharing this KV head (`q`: `heads × d`), with [`Kv43Rows::attend`]'s arithmetic per
    /// head: per key group the heads' 8-bit codes of `q∘s` are made once, per value block
    /// the selected rows are scored (whole 8-row tiles, up to four heads per read of the
    /// codes), their probabilities coded to 8 bits against the block's largest and the
    /// values weighed on their codes (unpacked once for up to four heads). Rows outside
    /// `ranges` get probability code 0, so they add nothing (no value code sums needed), as
    /// in `HackRows::attend`.
    pub fn attend_runs(&self, q: &[f32], scale: f32, ranges: &[Range<usize>], parts: &mut [Partial]) -> Result<()> {
        self.attend_runs_on(q, scale, ranges, parts, wide_kernels())
    }

    /// [`Kv43Rows::attend_runs`] on the AVX-512 kernels (`wide`, only where
    /// [`wide_kernels`] says the CPU has them) or the AVX2 / portable ones.
    pub(super) fn attend_runs_on(
        &self,
        q: &[f32],
        scale: f32,
        ranges: &[Range<usize>],
        parts: &mut [Partial],
        wide: bool,
    ) -> Result<()> {
        let (d, p) = (self.d, self.params);
        let heads = parts.len();
        check_runs(q, d, self.rows, ranges, parts)?;
        // Probability blocks (a value block, or 64 rows of a longer one).
        let vb = p.probability_rows();
        let shape = (heads, d, vb, wide);
        let (mut queries, mut block) =
            BUFFERS.with(|b| b.borrow_mut().take()).filter(|(kept, ..)| *kept == shape).map_or_else(
                || (GroupQueries::for_kernels(heads, d, wide), Block::new(heads, d, vb, wide)),
                |(_, q, b)| (q, b),
            );
        let plan = prefetch_plan();
        let (mut group, mut current) = (None, None);
        // The blocks before the first one asked for ahead: in one burst now (else a task's
        // first blocks, e.g. 4 of an exact scan's 32, would wait on memory line by line).
        if let Some(first) = ranges.iter().find(|r| !r.is_empty()) {
            let (b0, last) = (first.start / vb, (first.end - 1) / vb);
            for b in b0..(b0 + plan.blocks).min(last + 1) {
                self.prefetch_block(b, vb, false, true);
                self.prefetch_block(b, vb, true, true);
            }
        }
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            let mut j = r.start;
            while j < r.end {
                let b = j / vb;
                let end = r.end.min((b + 1) * vb);
                if current != Some(b) {
                    if let Some(done) = current {
                        self.fold_block(done, &mut block, parts);
                    }
                    current = Some(b);
                    self.prefetch_block(b + plan.blocks, vb, false, !plan.spread);
                }
                // A value block lies in one key group (key groups are whole value blocks).
                let g = j / p.key_group;
                if group != Some(g) {
                    queries.prepare(self, g, q);
                    group = Some(g);
                }
                let ahead = plan.spread.then_some(b + plan.blocks);
                self.score_rows(&queries, j..end, scale, &mut block.scores, (vb, b * vb), ahead);
                j = end;
            }
        }
        if let Some(done) = current {
            self.fold_block(done, &mut block, parts);
        }
        // Every block folded left its scores at -∞, as `Block::new` makes them.
        BUFFERS.with(|b| *b.borrow_mut() = Some((shape, queries, block)));
        Ok(())
    }

    /// Asks the CPU to bring probability block `b`'s codes into its caches, if the block
    /// exists: its key code sums and fifth bits (and its key group's minima and scales where
    /// the block starts one), or (`values`) its value minima and scales, and with `codes`
    /// its key codes or value planes too. The decode asks for the key half
    /// before a block's scores and the value half before its values, so the requests come
    /// in two bursts (or, with [`PrefetchPlan::spread`], the codes in small pieces from
    /// inside the kernels). A hint: results never depend on it. Each array is read in
    /// pieces of a few KB per block, too short for the hardware prefetchers to follow
    /// across pages: without it the decode waited on memory (out of cache, 26 against 15 ns
    /// per row and KV head on one Zen 4 core).
    fn prefetch_block(&self, b: usize, vb: usize, values: bool, codes: bool) {
        let (d, rows) = (self.d, b * vb..(b + 1) * vb);
        if rows.end > self.rows {
            return;
        }
        if values {
            let (np, mb) = (self.params.planes(), rows.start / self.params.value_block);
            if codes {
                prefetch(self.block_planes(b, vb, np));
            }
            if rows.start % self.params.value_block == 0 {
                prefetch(bytemuck::cast_slice(&self.value_min[mb * d..(mb + 1) * d]));
                prefetch(bytemuck::cast_slice(&self.value_scale[mb * d..(mb + 1) * d]));
            }
            return;
        }
        if codes {
            prefetch(&self.key_codes[rows.start * d / 2..rows.end * d / 2]);
        }
        let group = self.params.key_group;
        if rows.start % group == 0 {
            let g = rows.start / group;
            prefetch(bytemuck::cast_slice(&self.key_min[g * d..(g + 1) * d]));
            prefetch(bytemuck::cast_slice(&self.key_scale[g * d..(g + 1) * d]));
        }
        prefetch(bytemuck::cast_slice(&self.key_sums[rows.start * (d / PART)..rows.end * (d / PART)]));
        if !self.key_high.is_empty() {
            prefetch(&self.key_high[rows.start * d / 8..rows.end * d / 8]);
        }
    }

    /// Probability block `b`'s value planes (`np` planes per 8 rows; empty past the rows).
    fn block_planes(&self, b: usize, vb: usize, np: usize) -> &[u8] {
        let rows = (b * vb).min(self.rows)..((b + 1) * vb).min(self.rows);
        &self.value_planes[rows.start / 8 * np * self.d..rows.end / 8 * np * self.d]
    }

    /// Scores of every head of `queries` (prepared for the rows' key group) over `rows`:
    /// head `h`'s score of row `j` into `out[h·stride + j − base]`. Whole tiles are scored;
    /// only `rows` are written. With `ahead` (a probability block; `rows` lie in one), the
    /// kernel asks for the key codes of the same rows of block `ahead` as it goes (the
    /// AVX-512 one spreads them over its tiles; the others ask at once).
    pub(super) fn score_rows(
        &self,
        queries: &GroupQueries,
        rows: Range<usize>,
        scale: f32,
        out: &mut [f32],
        (stride, base): (usize, usize),
        ahead: Option<usize>,
    ) {
        let (d, parts) = (self.d, self.d / PART);
        let (t0, t1) = (rows.start / TILE, rows.end.div_ceil(TILE));
        let vb = self.params.probability_rows();
        for c0 in (t0..t1).step_by(RUN_ROWS / TILE) {
            let c1 = t1.min(c0 + RUN_ROWS / TILE);
            // The same tiles of block `ahead`, whose key codes the kernel asks for as it goes.
            let next = ahead.map_or(0..0, |b| {
                let at = b * vb + c0 * TILE % vb;
                at.min(self.rows)..(at + (c1 - c0) * TILE).min(self.rows)
            });
            let ahead_codes = &self.key_codes[next.start * d / 2..next.end * d / 2];
            let codes = &self.key_codes[c0 * TILE * d / 2..c1 * TILE * d / 2];
            let sums = &self.key_sums[c0 * TILE * parts..c1 * TILE * parts];
            let high = if self.key_high.is_empty() { &[][..] } else { &self.key_high[c0 * d..c1 * d] };
            let live = rows.start.max(c0 * TILE)..rows.end.min(c1 * TILE);
            // Whole tiles are scored straight into `out`; a run that starts or ends inside a
            // tile goes through a scratch, as the kernels write whole tiles.
            let (whole, span) = (live == (c0 * TILE..c1 * TILE), (c1 - c0) * TILE);
            let mut scratch = None;
            for h0 in (0..queries.heads()).step_by(HEADS_PER_PASS) {
                let n = (queries.heads() - h0).min(HEADS_PER_PASS);
                let ahead = if h0 == 0 { ahead_codes } else { &[] };
                let mut to: [&mut [f32]; HEADS_PER_PASS] = Default::default();
                if whole {
                    for (slot, row) in to.iter_mut().zip(out.chunks_mut(stride).skip(h0).take(n)) {
                        *slot = &mut row[live.start - base..live.end - base];
                    }
                } else {
                    let rows = scratch.get_or_insert([[0.0f32; RUN_ROWS]; HEADS_PER_PASS]);
                    for (slot, row) in to.iter_mut().zip(rows.iter_mut()) {
                        *slot = &mut row[..span];
                    }
                }
                score_tiles((codes, high, sums), queries, h0..h0 + n, scale, &mut to[..n], ahead);
                if let Some(scratch) = &scratch {
                    for (h, scores) in (h0..h0 + n).zip(scratch) {
                        let at = h * stride + live.start - base;
                        out[at..at + live.len()].copy_from_slice(&scores[live.start - c0 * TILE..live.end - c0 * TILE]);
                    }
                }
            }
        }
    }

    /// [`Kv43Rows::score_rows`] of every row for `heads` queries (`q`: `heads × d`) into
    /// `out` (`heads × rows`).
    pub(super) fn scores_heads(&self, q: &[f32], heads: usize, scale: f32, out: &mut [f32]) {
        let group = self.params.key_group;
        let mut queries = GroupQueries::new(heads, self.d);
        for g in 0..self.rows / group {
            queries.prepare(self, g, q);
            self.score_rows(&queries, g * group..(g + 1) * group, scale, out, (self.rows, 0), None);
        }
    }

    /// Folds value block `b`'s scored rows (`block.scores`, `-∞` for rows not attended) into
    /// `parts` and resets the scores: per head the block's largest score raises the running
    /// maximum, the probabilities relative to it are coded to 8 bits against the block's
    /// largest, and the values are weighed on their codes.
    fn fold_block(&self, b: usize, block: &mut Block, parts: &mut [Partial]) {
        let (d, vb) = (self.d, self.params.probability_rows());
        let plan = prefetch_plan();
        let (ahead, spread) = (b + plan.blocks, plan.spread);
        self.prefetch_block(ahead, vb, true, !spread);
        // The value block whose minima and scales the rows share.
        let mb = b * vb / self.params.value_block;
        let live = match wide_probabilities(block, parts, vb) {
            Some(live) => live,
            None => probabilities(block, parts, vb),
        };
        block.scores.iter_mut().for_each(|s| *s = f32::NEG_INFINITY);
        if !live {
            return;
        }
        let np = self.params.planes();
        let planes = &self.value_planes[b * vb / 8 * np * d..(b + 1) * vb / 8 * np * d];
        let next = if spread && ahead > b { self.block_planes(ahead, vb, np) } else { &[] };
        let scratch = (&mut block.weights, &mut block.z);
        weigh_value_planes((planes, np, next), d, &block.codes, scratch, &mut block.dot, block.wide);
        self.value_min[mb * d..(mb + 1) * d].convert_to_f32_slice(&mut block.mins);
        self.value_scale[mb * d..(mb + 1) * d].convert_to_f32_slice(&mut block.scales);
        for (h, part) in parts.iter_mut().enumerate() {
            let (step, sum) = (block.steps[h], block.sums[h] as f32);
            if step == 0.0 {
                continue;
            }
            let dh = &block.dot[h * d..(h + 1) * d];
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma",
                target_feature = "f16c"
            ))]
            if block.wide && d.is_multiple_of(16) {
                #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
                // SAFETY: `block.wide` only where `wide_kernels()` found the CPU has AVX-512
                // (or a test asked after checking the same); every slice read inside is
                // bounds-checked.
                unsafe {
                    super::avx512::fold_values(&mut part.o, dh, (&block.mins, &block.scales), (step, sum))
                };
                continue;
            }
            for (((o, &x), &m), &s) in part.o.iter_mut().zip(dh).zip(&block.mins).zip(&block.scales) {
                *o += step * (m * sum + s * x as f32);
            }
        }
    }
}

/// Per head the block's largest score raises the running maximum of `parts`, and the
/// block's probabilities relative to it are coded to 8 bits against the block's largest
/// (`block.codes`, `steps`, `sums`; `l` takes their sum): one head at a time. Returns
/// whether any head attends a row of the block.
fn probabilities(block: &mut Block, parts: &mut [Partial], vb: usize) -> bool {
    let mut live = false;
    for (h, part) in parts.iter_mut().enumerate() {
        let row = &mut block.scores[h * vb..(h + 1) * vb];
        let codes = &mut block.codes[h * vb..(h + 1) * vb];
        let top = super::max_of(row);
        block.steps[h] = 0.0;
        codes.iter_mut().for_each(|c| *c = 0);
        if top == f32::NEG_INFINITY {
            continue;
        }
        part.rescale_to(part.m.max(top));
        crate::cpu::microkernel::exp_shifted_sum(row, part.m);
        let step = super::max_of(row).max(0.0) / super::P_LEVELS;
        if step == 0.0 {
            continue;
        }
        block.sums[h] = probability_codes(row, step, codes);
        block.steps[h] = step;
        part.l += step * block.sums[h] as f32;
        live = true;
    }
    live
}

/// [`probabilities`] for every head in one call of the AVX-512 kernel, where the block uses
/// the AVX-512 kernels and its rows are a multiple of 16 (else `None`).
fn wide_probabilities(block: &mut Block, parts: &mut [Partial], vb: usize) -> Option<bool> {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if block.wide && vb.is_multiple_of(16) {
        for (m, part) in block.m.iter_mut().zip(parts.iter()) {
            *m = part.m;
        }
        #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
        // SAFETY: `block.wide` only where `wide_kernels()` found the CPU has AVX-512 F/BW,
        // VNNI, VBMI and GFNI (or a test asked after checking the same); every slice read
        // inside is bounds-checked.
        unsafe {
            super::avx512::block_probabilities(
                &block.scores,
                (&block.m, &mut block.top),
                &mut block.codes,
                (&mut block.steps, &mut block.sums),
            )
        };
        let mut live = false;
        for (h, part) in parts.iter_mut().enumerate() {
            if block.top[h] == f32::NEG_INFINITY {
                continue;
            }
            part.rescale_to(part.m.max(block.top[h]));
            if block.steps[h] > 0.0 {
                part.l += block.steps[h] * block.sums[h] as f32;
                live = true;
            }
        }
        return Some(live);
    }
    let _ = (block, parts, vb);
    None
}

/// Probability blocks ahead of the one being decoded whose codes are prefetched.
const PREFETCH_BLOCKS: usize = 4;

/// Cache levels a prefetch can ask for (`prefetcht0`, `t1`, `t2`, `nta`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Hint {
    L1,
    L2,
    L3,
    NonTemporal,
}

/// How far ahead, into which cache and in what pieces the decode prefetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PrefetchPlan {
    /// Probability blocks ahead of the one being decoded (0: no prefetch).
    pub(super) blocks: usize,
    /// The cache asked for (`None`: no prefetch).
    pub(super) hint: Option<Hint>,
    /// The AVX-512 kernels ask for the codes of block `b + blocks` in small pieces as they
    /// decode block `b` (a share per pair of key tiles, per 32 value channels) instead of
    /// in two bursts per block (the small arrays still come in bursts; the AVX2 and portable
    /// kernels ask for their share at once).
    pub(super) spread: bool,
}

/// The plan without the knob: [`PREFETCH_BLOCKS`] ahead, into L2, spread.
const DEFAULT_PREFETCH: PrefetchPlan = PrefetchPlan { blocks: PREFETCH_BLOCKS, hint: Some(Hint::L2), spread: true };

/// [`PREFETCH_BLOCKS`] ahead into the second-level cache, the codes spread over the
/// kernels, unless `ATTNSTORE_KV43_PREFETCH=N[,t0|t1|t2|nta][,burst]` (a tuning knob for
/// measuring other CPUs; `0` turns prefetching off, `burst` asks for each block's codes at
/// once, as before session 56) says otherwise. Read once; a value it cannot read is named on
/// stderr and the default kept. Spread, on one Zen 4 core out
/// of cache: 16.2–17.0 ns per row and KV head against 19.3–20.2 in two bursts.
fn prefetch_plan() -> PrefetchPlan {
    static PLAN: std::sync::OnceLock<PrefetchPlan> = std::sync::OnceLock::new();
    *PLAN.get_or_init(|| {
        let knob = std::env::var("ATTNSTORE_KV43_PREFETCH").unwrap_or_default();
        parse_prefetch(&knob).unwrap_or_else(|message| {
            eprintln!("attnstore: ignoring ATTNSTORE_KV43_PREFETCH={knob:?}: {message}");
            DEFAULT_PREFETCH
        })
    })
}

/// The plan `knob` names (empty: the default), or what was wrong with it.
pub(super) fn parse_prefetch(knob: &str) -> std::result::Result<PrefetchPlan, String> {
    let mut plan = DEFAULT_PREFETCH;
    for (i, word) in knob.split(',').map(str::trim).enumerate().filter(|(_, w)| !w.is_empty()) {
        match word {
            "t0" => plan.hint = Some(Hint::L1),
            "t1" => plan.hint = Some(Hint::L2),
            "t2" => plan.hint = Some(Hint::L3),
            "nta" => plan.hint = Some(Hint::NonTemporal),
            "burst" => plan.spread = false,
            "spread" => plan.spread = true,
            n if i == 0 => {
                plan.blocks = n.parse().map_err(|_| {
                    format!("{n:?} is not a block count: expected N[,t0|t1|t2|nta][,burst], e.g. 4 or 8,t0,burst")
                })?
            }
            other => {
                return Err(format!(
                    "unknown word {other:?}: expected t0, t1, t2, nta, spread or burst after the count"
                ))
            }
        }
    }
    if plan.blocks == 0 {
        plan.hint = None;
    }
    Ok(plan)
}

/// Asks the CPU to bring `bytes` into its second-level cache (one `prefetcht1` per 64-byte
/// line, or what `ATTNSTORE_KV43_PREFETCH` says: see `prefetch_plan`); no effect on any result. Not the crate's
/// `cpu::prefetch::prefetch`: that one asks for the first-level cache (27–28 ns per row and
/// KV head out of cache here against 19.3), and a variant of it with this hint, its counted
/// loop unrolled, was slower too (20–26 ns against 19–21 in alternated runs on this VM,
/// session 55).
pub fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_NTA, _MM_HINT_T0, _MM_HINT_T1, _MM_HINT_T2};
        match prefetch_plan().hint {
            Some(Hint::L2) => prefetch_lines::<_MM_HINT_T1>(bytes),
            Some(Hint::L1) => prefetch_lines::<_MM_HINT_T0>(bytes),
            Some(Hint::L3) => prefetch_lines::<_MM_HINT_T2>(bytes),
            Some(Hint::NonTemporal) => prefetch_lines::<_MM_HINT_NTA>(bytes),
            None => {}
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// One `HINT` prefetch per 64-byte line of `bytes`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines<const HINT: i32>(bytes: &[u8]) {
    for at in (0..bytes.len()).step_by(64) {
        #[allow(unsafe_code, reason = "the prefetch intrinsic takes a raw pointer")]
        // SAFETY: the address lies inside `bytes`; a prefetch neither faults nor writes.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<HINT>(bytes[at..].as_ptr().cast())
        };
    }
}

/// True where the AVX-512 kernels (`avx512.rs`) run: the build has AVX2 and the CPU AVX-512
/// F/BW, VNNI, VBMI and GFNI, unless the environment says `ATTNSTORE_HACK_KERNEL=avx2`.
pub(super) fn wide_kernels() -> bool {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    return crate::cpu::hack_avx512::available();
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c")))]
    false
}

/// The scores of `heads` (at most four) of `queries` over a run of whole key tiles (`codes`,
/// the fifth bits `high` or nothing, `sums`; at most `RUN_ROWS` rows) into `out` (one
/// slice per head, as long as the run's whole tiles): AVX-512's [`super::avx512::tile_scores`] where
/// the queries are prepared for it, else AVX2's [`super::avx2::tile_scores`] where the
/// target has it, else [`tile_scores_portable`], tile by tile.
fn score_tiles(
    (codes, high, sums): (&[u8], &[u8], &[u16]),
    queries: &GroupQueries,
    heads: Range<usize>,
    scale: f32,
    out: &mut [&mut [f32]],
    ahead: &[u8],
) {
    let (d, parts) = (queries.d, queries.d / PART);
    let h0 = heads.start;
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if let Some(wide) = &queries.wide {
        macro_rules! pass {
            ($n:literal) => {{
                let w: [&[[u32; 16]]; $n] = std::array::from_fn(|i| &wide[(h0 + i) * d / 8..(h0 + i + 1) * d / 8]);
                let a: [&[f32]; $n] = std::array::from_fn(|i| &queries.a[(h0 + i) * parts..(h0 + i + 1) * parts]);
                let b: [&[f32]; $n] = std::array::from_fn(|i| &queries.b[(h0 + i) * parts..(h0 + i + 1) * parts]);
                let qm: [f32; $n] = std::array::from_fn(|i| queries.qm[h0 + i]);
                let out: &mut [&mut [f32]; $n] = (&mut out[..$n]).try_into().expect("one slice per head");
                #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
                // SAFETY: `queries.wide` is `Some` only where `wide_kernels()` found the CPU
                // has AVX-512 F/BW, VNNI, VBMI and GFNI (or a test asked for it after checking
                // the same); every slice read inside is bounds-checked.
                unsafe {
                    if high.is_empty() {
                        super::avx512::tile_scores::<$n, false>((codes, high, sums), w, (a, b, qm), (scale, ahead), out)
                    } else {
                        super::avx512::tile_scores::<$n, true>((codes, high, sums), w, (a, b, qm), (scale, ahead), out)
                    }
                }
            }};
        }
        match heads.len() {
            1 => pass!(1),
            2 => pass!(2),
            3 => pass!(3),
            _ => pass!(4),
        }
        return;
    }
    prefetch(ahead);
    let tile_bytes = TILE * d / 2;
    for (i, codes) in codes.chunks_exact(tile_bytes).enumerate() {
        let sums = &sums[i * TILE * parts..(i + 1) * TILE * parts];
        let high = if high.is_empty() { high } else { &high[i * d..(i + 1) * d] };
        #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
        {
            macro_rules! pass {
                ($n:literal) => {{
                    let w: [&[u32]; $n] = std::array::from_fn(|i| &queries.w[(h0 + i) * d / 4..(h0 + i + 1) * d / 4]);
                    let a: [&[f32]; $n] = std::array::from_fn(|i| &queries.a[(h0 + i) * parts..(h0 + i + 1) * parts]);
                    let b: [&[f32]; $n] = std::array::from_fn(|i| &queries.b[(h0 + i) * parts..(h0 + i + 1) * parts]);
                    let qm: [f32; $n] = std::array::from_fn(|i| queries.qm[h0 + i]);
                    let mut tile = [[0.0f32; TILE]; $n];
                    #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
                    // SAFETY: compiled only when the build enables avx2 for the whole program
                    // (cfg above), so every CPU that runs the binary has it; every slice read
                    // inside is bounds-checked.
                    unsafe {
                        if high.is_empty() {
                            super::avx2::tile_scores::<$n, false>((codes, high, sums), w, (a, b, qm), scale, &mut tile)
                        } else {
                            super::avx2::tile_scores::<$n, true>((codes, high, sums), w, (a, b, qm), scale, &mut tile)
                        }
                    }
                    for (o, t) in out.iter_mut().zip(&tile) {
                        o[i * TILE..(i + 1) * TILE].copy_from_slice(t);
                    }
                }};
            }
            match heads.len() {
                1 => pass!(1),
                2 => pass!(2),
                3 => pass!(3),
                _ => pass!(4),
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
        for (h, o) in heads.clone().zip(out.iter_mut()) {
            o[i * TILE..(i + 1) * TILE].copy_from_slice(&tile_scores_portable((codes, high, sums), queries, h, scale));
        }
    }
}

/// Head `h`'s scores over one key tile one code at a time, with the float operations of
/// `scores_reference` in its order.
#[cfg_attr(all(target_arch = "x86_64", target_feature = "avx2"), allow(dead_code, reason = "the tests' oracle there"))]
pub(super) fn tile_scores_portable(
    (codes, high, sums): (&[u8], &[u8], &[u16]),
    queries: &GroupQueries,
    h: usize,
    scale: f32,
) -> [f32; TILE] {
    let (d, parts) = (queries.d, queries.d / PART);
    let w: Vec<u8> = queries.w[h * d / 4..(h + 1) * d / 4].iter().flat_map(|x| x.to_le_bytes()).collect();
    std::array::from_fn(|r| {
        let mut s = queries.qm[h];
        for k in 0..parts {
            let dot: u32 = (k * PART..(k + 1) * PART)
                .map(|c| u32::from(w[c]) * u32::from(super::key_code(codes, high, d, r, c)))
                .sum();
            let (a, b) = (queries.a[h * parts + k], queries.b[h * parts + k]);
            s += a * f32::from(sums[k * TILE + r]) + b * dot as f32;
        }
        s * scale
    })
}

/// `dot[h·d + c] = Σ_t P[h][t]·z[t][c]` for every head `h` of `p` (`heads × rows` 8-bit
/// probability codes) over one value block's 3- or 4-bit codes, read from their `bits`
/// planes per 8 rows (`rows/8 × bits × d` bytes): with AVX2 the codes of two rows made in
/// registers and weighed
/// for up to four heads per pass (`weights`: scratch for the broadcast row pairs); else
/// through `z` (scratch, `rows × d`) one code per byte (`unpack_value_codes`,
/// `weigh_value_codes`: the reference). `ahead`: bytes to ask the caches for (the value
/// planes of a block further on, or nothing; spread over the AVX-512 kernel's channels).
pub(super) fn weigh_value_planes(
    (planes, bits, ahead): (&[u8], usize, &[u8]),
    d: usize,
    p: &[u8],
    (weights, z): (&mut Vec<[u16; 16]>, &mut Vec<u8>),
    dot: &mut [u32],
    wide: bool,
) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if wide {
        let rows = planes.len() / (bits * d) * 8;
        let heads = p.len() / rows;
        for h0 in (0..heads).step_by(HEADS_PER_PASS) {
            let n = (heads - h0).min(HEADS_PER_PASS);
            let out = &mut dot[h0 * d..(h0 + n) * d];
            macro_rules! pass {
                ($n:literal, $four:literal) => {{
                    let ph: [&[u8]; $n] = std::array::from_fn(|i| &p[(h0 + i) * rows..(h0 + i + 1) * rows]);
                    #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
                    // SAFETY: callers pass `wide` only where `wide_kernels()` found the CPU
                    // has AVX-512 F/BW, VNNI, VBMI and GFNI (or a test asked after checking the
                    // same); every slice read inside is bounds-checked.
                    unsafe {
                        let ahead = if h0 == 0 { ahead } else { &[] };
                        super::avx512::weigh_value_planes::<$n, $four>((planes, ahead), d, ph, out)
                    }
                }};
            }
            match (n, bits == 4) {
                (1, false) => pass!(1, false),
                (2, false) => pass!(2, false),
                (3, false) => pass!(3, false),
                (_, false) => pass!(4, false),
                (1, true) => pass!(1, true),
                (2, true) => pass!(2, true),
                (3, true) => pass!(3, true),
                (_, true) => pass!(4, true),
            }
        }
        return;
    }
    prefetch(ahead);
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    {
        let _ = &z;
        let rows = planes.len() / (bits * d) * 8;
        weights.clear();
        weights.extend(p.chunks_exact(2).map(|pair| [u16::from_le_bytes([pair[0], pair[1]]); 16]));
        let heads = p.len() / rows;
        for h0 in (0..heads).step_by(HEADS_PER_PASS) {
            let n = (heads - h0).min(HEADS_PER_PASS);
            let w = &weights[h0 * rows / 2..(h0 + n) * rows / 2];
            let out = &mut dot[h0 * d..(h0 + n) * d];
            #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
            // SAFETY: compiled only when the build enables avx2 for the whole program (cfg
            // above); every slice read inside is bounds-checked.
            unsafe {
                match (n, bits == 4) {
                    (1, false) => super::avx2::weigh_value_planes::<1, false>(planes, d, w, out),
                    (2, false) => super::avx2::weigh_value_planes::<2, false>(planes, d, w, out),
                    (3, false) => super::avx2::weigh_value_planes::<3, false>(planes, d, w, out),
                    (_, false) => super::avx2::weigh_value_planes::<4, false>(planes, d, w, out),
                    (1, true) => super::avx2::weigh_value_planes::<1, true>(planes, d, w, out),
                    (2, true) => super::avx2::weigh_value_planes::<2, true>(planes, d, w, out),
                    (3, true) => super::avx2::weigh_value_planes::<3, true>(planes, d, w, out),
                    (_, true) => super::avx2::weigh_value_planes::<4, true>(planes, d, w, out),
                }
            }
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
    {
        let _ = (&weights, wide);
        z.resize(planes.len() / (bits * d) * 8 * d, 0);
        super::unpack_value_codes(planes, d, bits, z);
        super::weigh_value_codes(z, d, p, dot);
    }
}
