//! The PQ index (PQCache): keys of every KV head product-quantized into `m` sub-spaces of
//! `2^b` centroids, a per-query lookup table that scores every token from its codes, and an
//! exact top-k of those approximate scores plus sink and local tokens. Codebooks are trained
//! in the background after prefill; until they are ready every token is in the steady zone
//! (attended exactly). Decode tokens that leave the local window are encoded with the
//! existing centroids.
//!
//! Tokens live in arrival order in two regions per head: the *base* (everything present
//! when the codebook build started, shared with the build thread) and the *tail* (later
//! tokens). A [`RowSpan`]'s `unit` names the region: 0 base, 1 tail. Under an encoded codec
//! (`hack2`, `kv43`) the base rows past the sink are kept only in encoded form and attended
//! on their codes; the codebooks are trained on the plain keys.

mod adaptive;
mod build;
mod codes;
mod home;
mod pages;
mod params;
mod snapshot;

pub use adaptive::{BuildShape, IterationChoice, IterationModel};
pub use codes::PackedCodes;
pub use params::{PqLayout, PqParams};
pub use snapshot::PqSnapshot;

use crate::build::BuildHandle;
use crate::codec::{EncodedRows, RowCodec};
use crate::error::{Error, Result};
use crate::home::RowHome;
use crate::method::{
    batch_tokens, check_shape, coalesce, push_narrow, AccessMethod, HeadPlan, IndexLayout, IndexStats, RowSource,
    RowSpan, Selection, SelectionMode, Snapshots, ZoneBudget,
};
use crate::rows::{HeadRows, PlainRows, Run, SelectionRows};
use attnstore_kernels::cpu::kmeans::nearest_centroids;
use attnstore_kernels::cpu::pq::{candidates_max, scores_each, scores_max, scores_max_strided, Lut};
use attnstore_kernels::cpu::scoring::{rank_key, threshold_from_sample, top_keys, top_r_set};
use attnstore_kernels::Element;
use build::{BuildJob, BuildSlot, Built};
use pages::HomedBase;
use std::ops::Range;
use std::sync::Arc;

/// Tokens whose codes are unpacked and scored at a time.
const SCORE_TILE: usize = 4096;

/// Buffers of one planning thread, kept between plans so a decode step allocates no
/// per-token arrays.
#[derive(Default)]
struct PlanScratch {
    scores: Vec<Vec<f32>>,
    tile: Vec<u8>,
    sample: Vec<f32>,
    candidates: Vec<(u32, f32)>,
}

thread_local! {
    static PLAN_SCRATCH: std::cell::RefCell<PlanScratch> = std::cell::RefCell::new(PlanScratch::default());
}

#[derive(Debug, Clone, Default)]
struct HeadKv<E> {
    /// Base rows; under an encoded codec only the sink rows (the rest are in `coded`).
    base_keys: Arc<Vec<E>>,
    base_values: Vec<E>,
    /// Base rows from the sink on, encoded: HACK 2-bit rows (`hack2`) or one [`Kv43Head`]
    /// (`kv43`: whole key groups coded, the last partial group in f16).
    ///
    /// [`Kv43Head`]: attnstore_kernels::Kv43Head
    coded: Option<EncodedRows>,
    tail_keys: Vec<E>,
    tail_values: Vec<E>,
}

/// PQCache's product-quantization index over the KV heads of one layer.
#[derive(Debug)]
pub struct PqIndex<E> {
    params: PqParams,
    kv_heads: usize,
    head_dim: usize,
    heads: Vec<HeadKv<E>>,
    tokens: usize,
    base_len: usize,
    build: Option<Arc<BuildSlot>>,
    /// Per head: codes of decode tokens encoded with the existing codebooks, positions
    /// `built.end..built.end + len`.
    extra: Vec<PackedCodes>,
    /// How base rows past the sink are stored: plain, 2-bit (`hack2`) or 4+3-bit (`kv43`).
    codec: RowCodec,
    /// Sink rows kept plain in the base region (encoded or homed rows start after them).
    base_sink: usize,
    /// The row home of the base rows past the sink, when the engine gives one
    /// ([`PqIndex::with_home`]).
    home: Option<Arc<dyn RowHome>>,
    /// Where those rows are in the home, once the base is made.
    homed: Option<HomedBase>,
}

impl<E> Drop for PqIndex<E> {
    fn drop(&mut self) {
        if let (Some(home), Some(base)) = (&self.home, &self.homed) {
            base.free(home.as_ref(), self.kv_heads);
        }
    }
}

impl<E: Element> PqIndex<E> {
    /// An empty index for `kv_heads` heads of dimension `head_dim`.
    pub fn new(params: PqParams, kv_heads: usize, head_dim: usize) -> Result<Self> {
        params.validate(head_dim)?;
        check_shape(kv_heads, head_dim)?;
        Ok(Self {
            params,
            kv_heads,
            head_dim,
            heads: vec![HeadKv::default(); kv_heads],
            tokens: 0,
            base_len: 0,
            build: None,
            extra: Vec::new(),
            codec: RowCodec::Plain,
            base_sink: 0,
            home: None,
            homed: None,
        })
    }

    /// This index emptied (after a failed restore), with its parameters, codec and home.
    fn emptied(&mut self) -> Result<()> {
        let home = self.home.take();
        let mut empty = Self::new(self.params, self.kv_heads, self.head_dim)?.with_codec(self.codec)?;
        empty.home = home;
        *self = empty;
        Ok(())
    }

    /// Stores the prefill (base) rows past the sink encoded once the codebook build starts:
    /// in HACK 2-bit form (`hack2`) or as kv43 rows (`kv43`: whole key groups coded, the
    /// base's last partial key group in f16); decode tokens (the tail) stay in the plain
    /// type. The codebooks are trained on the plain keys either way. A codec the head
    /// dimension cannot take is a typed error.
    pub fn with_codec(mut self, codec: impl Into<RowCodec>) -> Result<Self> {
        let codec = codec.into();
        codec.check(self.head_dim)?;
        self.codec = codec;
        Ok(self)
    }

    /// The parameters.
    pub fn params(&self) -> &PqParams {
        &self.params
    }

    /// The build handle, once a build has started (see [`AccessMethod::build_handle`]).
    pub fn handle(&self) -> Option<BuildHandle> {
        self.build.as_ref().map(|s| BuildHandle::new(Arc::clone(s) as Arc<dyn crate::build::BuildState>))
    }

    /// The trained codebook of KV head `h` (`m × codes × d/m`, sub-space major) and the
    /// number of centroids per sub-space, once the build is done.
    pub fn codebook(&self, h: usize) -> Option<(&[f32], usize)> {
        self.built().and_then(|b| b.codebooks.get(h).map(|c| (c.as_slice(), b.codes)))
    }

    /// The codes (one per sub-space) of the token at `position` of KV head `h`, if it has
    /// been encoded.
    pub fn codes_of(&self, h: usize, position: usize) -> Option<Vec<u8>> {
        let built = self.built()?;
        let (sink, end) = (self.sink_len(), built.end);
        if h >= self.kv_heads || position < sink || position >= self.coded_end() {
            return None;
        }
        let mut out = Vec::new();
        match position < end {
            true => built.packed[h].unpack(position - sink, 1, &mut out),
            false => self.extra[h].unpack(position - end, 1, &mut out),
        }
        Some(out)
    }

    fn built(&self) -> Option<&Arc<Built>> {
        self.build.as_ref().and_then(|s| s.get())
    }

    fn sink_len(&self) -> usize {
        self.params.sink_tokens.min(self.tokens)
    }

    /// First position not covered by codes: tokens from here on are in the steady zone.
    fn coded_end(&self) -> usize {
        match self.built() {
            Some(b) => b.end + self.extra.first().map_or(0, |e| e.len()),
            None => self.sink_len(),
        }
    }

    /// Keys and values of positions `range` of head `h`, which must lie in one region.
    fn rows(&self, h: usize, unit: u32, rows: Range<usize>) -> (&[E], &[E]) {
        let d = self.head_dim;
        let kv = &self.heads[h];
        let r = rows.start * d..rows.end * d;
        match unit {
            0 => (&kv.base_keys[r.clone()], &kv.base_values[r]),
            _ => (&kv.tail_keys[r.clone()], &kv.tail_values[r]),
        }
    }

    /// Positions `range` as spans of the regions they fall in.
    fn spans_of(&self, range: Range<usize>) -> impl Iterator<Item = RowSpan> {
        let b = self.base_len;
        let base = range.start.min(b)..range.end.min(b);
        let tail = range.start.max(b) - b..range.end.max(b) - b;
        [(0u32, base), (1u32, tail)].into_iter().filter(|(_, r)| !r.is_empty()).map(|(unit, r)| RowSpan {
            unit,
            start: r.start as u32,
            end: r.end as u32,
        })
    }

    fn position_span(&self, p: usize) -> RowSpan {
        let (unit, row) = if p < self.base_len { (0, p) } else { (1, p - self.base_len) };
        RowSpan { unit, start: row as u32, end: row as u32 + 1 }
    }

    fn steady_ranges(&self) -> [Range<usize>; 2] {
        [0..self.sink_len(), self.coded_end()..self.tokens]
    }

    fn steady_plan(&self) -> HeadPlan {
        let tail = self.tokens - self.coded_end();
        HeadPlan {
            exact: false,
            steady_tokens: self.sink_len() + tail,
            pending_tokens: tail.saturating_sub(self.params.local_tokens),
            selections: Vec::new(),
        }
    }

    fn ingest(&mut self, keys: &[f32], values: &[f32]) -> Result<()> {
        let n = batch_tokens(self.kv_heads, self.head_dim, keys, values)?;
        if self.tokens + n > u32::MAX as usize {
            return Err(Error::InvalidParameter {
                what: "tokens",
                message: format!("a head holds at most {} tokens", u32::MAX),
            });
        }
        let d = self.head_dim;
        let before = self.heads.first().map_or(0, |kv| kv.tail_keys.len());
        for (h, kv) in self.heads.iter_mut().enumerate() {
            push_narrow(&mut kv.tail_keys, &keys[h * n * d..(h + 1) * n * d]);
            push_narrow(&mut kv.tail_values, &values[h * n * d..(h + 1) * n * d]);
        }
        self.tokens += n;
        let done = if self.build.is_none() { self.start_build_if_due() } else { self.encode_pending() };
        if let Err(e) = done {
            // Neither makes the base nor pushes codes unless it succeeds (a full row home, a
            // failed read): the batch is undone and the index is as it was.
            for kv in &mut self.heads {
                kv.tail_keys.truncate(before);
                kv.tail_values.truncate(before);
            }
            self.tokens -= n;
            return Err(e);
        }
        Ok(())
    }

    /// Starts the codebook build once enough tokens lie outside the steady zone: all tokens
    /// so far become the base region, shared with the build.
    fn start_build_if_due(&mut self) -> Result<()> {
        let Some((start, end)) = self.build_range(self.tokens) else { return Ok(()) };
        let layout = self.params.layout(self.tokens);
        let keys = self.make_base(start, layout)?;
        let job = BuildJob { keys, head_dim: self.head_dim, start, end, layout, params: self.params };
        self.build = Some(job.launch(self.params.background));
        Ok(())
    }

    /// The positions a build at `tokens` tokens encodes (`start..end`: past the sink, before
    /// the local window), or `None` when they are fewer than `min_build_tokens`.
    fn build_range(&self, tokens: usize) -> Option<(usize, usize)> {
        let p = &self.params;
        let start = p.sink_tokens.min(tokens);
        let end = tokens.saturating_sub(p.local_tokens).max(start);
        (end - start >= p.min_build_tokens).then_some((start, end))
    }

    /// Makes every token so far the base region (coded from `start` on under `layout`) and
    /// returns each head's plain keys for the codebook build.
    fn make_base(&mut self, start: usize, layout: PqLayout) -> Result<Vec<Arc<Vec<E>>>> {
        let d = self.head_dim;
        // Rows past the sink go to the row home first: all of them, or an error with
        // nothing changed.
        let homed = self.home_base(start)?;
        let mut jobs = Vec::with_capacity(self.kv_heads);
        for (h, kv) in self.heads.iter_mut().enumerate() {
            let keys = Arc::new(std::mem::take(&mut kv.tail_keys));
            let values = std::mem::take(&mut kv.tail_values);
            jobs.push(Arc::clone(&keys));
            let seed = self.params.seed ^ 0x4841_434b ^ (h as u64) << 40;
            match self.codec.encode(&keys[start * d..], &values[start * d..], d, seed)? {
                Some(rows) => {
                    // The build thread keeps its own reference to the plain keys until the
                    // codebooks are trained; the index keeps only the encoded rows.
                    kv.coded = Some(rows);
                    kv.base_keys = Arc::new(keys[..start * d].to_vec());
                    kv.base_values = values[..start * d].to_vec();
                }
                None if homed.is_some() => {
                    // The build keeps the plain keys until it is done; the rest are homed.
                    kv.base_keys = Arc::new(keys[..start * d].to_vec());
                    kv.base_values = values[..start * d].to_vec();
                }
                None => {
                    kv.base_keys = keys;
                    kv.base_values = values;
                }
            }
        }
        self.homed = homed;
        self.base_sink = start;
        self.base_len = self.tokens;
        self.extra = vec![PackedCodes::new(layout); self.kv_heads];
        Ok(jobs)
    }

    /// Keys of positions `range` of head `h`, widened, appended to `out`: encoded base rows
    /// as their codes stand for them (2-bit rows decoded, kv43 rows dequantized), homed base
    /// rows read from the row home.
    fn key_rows(&self, h: usize, range: Range<usize>, out: &mut Vec<f32>) -> Result<()> {
        let d = self.head_dim;
        let kv = &self.heads[h];
        let (sink, base) = (self.base_sink, self.base_len);
        let widen = |rows: &[E], out: &mut Vec<f32>| {
            let at = out.len();
            out.resize(at + rows.len(), 0.0);
            E::widen(rows, &mut out[at..]);
        };
        // The sink, the rows past it, the tail.
        let sink_rows = range.start.min(sink)..range.end.min(sink);
        let past = range.start.clamp(sink, base)..range.end.clamp(sink, base);
        let tail = range.start.max(base) - base..range.end.max(base) - base;
        widen(&kv.base_keys[sink_rows.start * d..sink_rows.end * d], out);
        if !past.is_empty() {
            let rows = past.start - sink..past.end - sink;
            match (&kv.coded, &self.homed) {
                (Some(EncodedRows::Hack(coded)), _) => out.extend_from_slice(&coded.decode_rows(rows).0),
                (Some(EncodedRows::Kv43(coded)), _) => crate::kv43_pieces::kv43_keys(coded, rows, out)?,
                (None, Some(homed)) => self.homed_keys(h, homed, rows, out)?,
                (None, None) => widen(&kv.base_keys[past.start * d..past.end * d], out),
            }
        }
        widen(&kv.tail_keys[tail.start * d..tail.end * d], out);
        Ok(())
    }

    /// The runs that read `spans` (plain rows in one pass, then the encoded or homed base
    /// rows past the sink, adjacent rows merged into ranges).
    fn span_runs(&self, kv_head: usize, spans: &[RowSpan]) -> Vec<Run<'_>> {
        let rows = |s: &RowSpan| {
            let (k, v) = self.rows(kv_head, s.unit, s.start as usize..s.end as usize);
            PlainRows::of(k, v)
        };
        let kv = &self.heads[kv_head];
        if kv.coded.is_none() && self.homed.is_none() {
            return vec![Run::Plain(spans.iter().map(rows).collect())];
        }
        let sink = self.base_sink;
        let (mut plain, mut ranges) = (Vec::new(), Vec::new());
        for s in spans {
            let (a, b) = (s.start as usize, s.end as usize);
            if s.unit != 0 {
                plain.push(*s);
                continue;
            }
            if a < sink {
                plain.push(RowSpan { unit: 0, start: s.start, end: b.min(sink) as u32 });
            }
            if b > sink {
                ranges.push(a.max(sink) - sink..b - sink);
            }
        }
        vec![Run::Plain(plain.iter().map(rows).collect()), self.past_sink_run(kv_head, ranges)]
    }

    /// The run that reads base rows `ranges` past the sink, encoded (on their codes) or
    /// homed (only called when they are one of the two).
    fn past_sink_run(&self, kv_head: usize, ranges: Vec<Range<usize>>) -> Run<'_> {
        match (&self.heads[kv_head].coded, &self.homed) {
            (Some(EncodedRows::Hack(coded)), _) => Run::Encoded { rows: coded, ranges },
            (Some(EncodedRows::Kv43(coded)), _) => Run::Kv43 { rows: coded, ranges },
            (None, Some(homed)) => Run::Homed { clusters: homed.clusters::<E>(), ranges },
            (None, None) => unreachable!("past_sink_run without encoded or homed rows"),
        }
    }

    /// Encodes, with the existing codebooks, every token that has left the local window
    /// since the build (no-op while the build runs).
    fn encode_pending(&mut self) -> Result<()> {
        let Some(built) = self.built().cloned() else { return Ok(()) };
        let from = self.coded_end();
        let to = self.tokens.saturating_sub(self.params.local_tokens);
        if to <= from {
            return Ok(());
        }
        let (m, d) = (built.layout.subspaces, self.head_dim);
        let sub = d / m;
        let n = to - from;
        let (mut wide, mut x, mut nearest) = (Vec::with_capacity(n * d), Vec::with_capacity(n * sub), Vec::new());
        // Every head's codes first, pushed only when all are made (a homed read can fail).
        let mut all = Vec::with_capacity(self.kv_heads);
        for h in 0..self.kv_heads {
            wide.clear();
            self.key_rows(h, from..to, &mut wide)?;
            let mut codes = vec![0u8; n * m];
            for j in 0..m {
                x.clear();
                for row in wide.chunks_exact(d) {
                    x.extend_from_slice(&row[j * sub..(j + 1) * sub]);
                }
                let book = &built.codebooks[h][j * built.codes * sub..(j + 1) * built.codes * sub];
                nearest_centroids(&x, book, sub, &mut nearest)?;
                for (i, &c) in nearest.iter().enumerate() {
                    codes[i * m + j] = c as u8;
                }
            }
            all.push(codes);
        }
        for (h, codes) in all.iter().enumerate() {
            self.extra[h].push(codes)?;
        }
        Ok(())
    }

    fn lut(&self, built: &Built, kv_head: usize, q: &[f32]) -> Result<Lut> {
        let d = self.head_dim;
        let scale = 1.0 / (d as f32).sqrt();
        let (m, codes) = (built.layout.subspaces, built.codes);
        Ok(Lut::build_transposed(q, q.len() / d, &built.codebooks_t[kv_head], m, codes, scale)?)
    }

    /// Calls `f(first_token, codes)` for runs of coded tokens of `kv_head` in order (token
    /// `i` is position `sink + i`): the packed bytes directly when `b = 8`, else unpacked
    /// tiles.
    fn for_code_runs(&self, built: &Built, kv_head: usize, tile: &mut Vec<u8>, mut f: impl FnMut(usize, &[u8])) {
        let mut first = 0;
        for codes in [&built.packed[kv_head], &self.extra[kv_head]] {
            match codes.as_bytes() {
                Some(bytes) => f(first, bytes),
                None => {
                    for s in (0..codes.len()).step_by(SCORE_TILE) {
                        tile.clear();
                        codes.unpack(s, SCORE_TILE.min(codes.len() - s), tile);
                        f(first + s, tile);
                    }
                }
            }
            first += codes.len();
        }
    }

    /// Approximate scores of every coded token (positions `sink..coded_end`) for the group
    /// `q` into `scratch.scores`: the best over heads, or one vector per head.
    fn score(&self, built: &Built, kv_head: usize, q: &[f32], per_head: bool, scratch: &mut PlanScratch) -> Result<()> {
        let g = q.len() / self.head_dim;
        let lut = self.lut(built, kv_head, q)?;
        let PlanScratch { scores: out, tile, .. } = scratch;
        out.resize_with(if per_head { g } else { 1 }, Vec::new);
        out.truncate(if per_head { g } else { 1 });
        out.iter_mut().for_each(Vec::clear);
        self.for_code_runs(built, kv_head, tile, |_, codes| {
            if per_head {
                scores_each(&lut, codes, out);
            } else {
                scores_max(&lut, codes, &mut out[0]);
            }
        });
        Ok(())
    }

    /// The per-KV-head top-`k` with the threshold pass fused into scoring: score every 16th
    /// token, take a threshold that about 1.25 k tokens reach, then score all tokens keeping
    /// only those at or above it. `None` when the shortcut does not apply or kept fewer than
    /// `k` (the caller then scores everything).
    fn fused_top_k(
        &self,
        built: &Built,
        kv_head: usize,
        q: &[f32],
        k: usize,
        scratch: &mut PlanScratch,
    ) -> Option<Vec<u32>> {
        const STRIDE: usize = 16;
        let n = self.coded_end() - self.sink_len();
        if n < 8192 || k == 0 || k > n / 8 {
            return None;
        }
        let lut = self.lut(built, kv_head, q).ok()?;
        let PlanScratch { tile, sample, candidates, .. } = scratch;
        sample.clear();
        for codes in [&built.packed[kv_head], &self.extra[kv_head]] {
            match codes.as_bytes() {
                Some(bytes) => scores_max_strided(&lut, bytes, STRIDE, sample),
                None => {
                    tile.clear();
                    codes.sample(STRIDE, tile);
                    scores_max(&lut, tile, sample);
                }
            }
        }
        let t = threshold_from_sample(sample, STRIDE, k)?;
        candidates.clear();
        self.for_code_runs(built, kv_head, tile, |first, codes| {
            candidates_max(&lut, codes, first as u32, t, candidates)
        });
        (candidates.len() >= k).then(|| top_keys(candidates.iter().map(|&(i, s)| rank_key(s, i)).collect(), k))
    }

    fn selection(&self, built: &Built, first_head: usize, heads: usize, scores: &[f32], k: usize) -> Selection {
        self.selection_of(built, first_head, heads, scores.len(), top_r_set(scores, k))
    }

    /// The selection of coded tokens `chosen` (ascending, token `i` = position `sink + i`)
    /// out of `scored`.
    fn selection_of(
        &self,
        built: &Built,
        first_head: usize,
        heads: usize,
        scored: usize,
        chosen: Vec<u32>,
    ) -> Selection {
        let sink = self.sink_len();
        let mut spans: Vec<RowSpan> = chosen.iter().map(|&i| self.position_span(sink + i as usize)).collect();
        coalesce(&mut spans);
        let codes_bytes = built.packed[0].bytes() + self.extra[0].bytes();
        Selection {
            first_head,
            heads,
            retrieve: spans,
            retrieve_tokens: chosen.len(),
            scored,
            scored_bytes: codes_bytes + built.codebooks_t[0].len() * 4,
            dropped_tokens: scored - chosen.len(),
            ..Selection::default()
        }
    }
}

impl<E: Element> AccessMethod for PqIndex<E> {
    fn name(&self) -> &'static str {
        "pq"
    }

    fn stats(&self) -> IndexStats {
        let elem = E::DTYPE.size_bytes();
        let built = self.built();
        let index_bytes = built.map_or(0, |b| {
            b.packed.iter().chain(&self.extra).map(PackedCodes::bytes).sum::<usize>()
                + b.codebooks.iter().chain(&b.codebooks_t).map(|c| c.len() * 4).sum::<usize>()
        });
        let steady_tail = self.tokens - self.coded_end();
        // Encoded rows count their codes, metadata and any f16 rows (kv43's partial group).
        let coded: usize = self.heads.iter().filter_map(|kv| kv.coded.as_ref()).map(EncodedRows::bytes).sum();
        let coded_rows = self.heads[0].coded.as_ref().map_or(0, EncodedRows::rows);
        IndexStats {
            tokens: self.tokens,
            kv_bytes: 2 * (self.tokens - coded_rows) * self.kv_heads * self.head_dim * elem + coded,
            index_bytes,
            segments: usize::from(built.is_some()),
            clusters: built.map_or(0, |b| b.codes * b.layout.subspaces),
            pending_tokens: steady_tail.saturating_sub(self.params.local_tokens),
            indexed_tokens: self.coded_end() - self.sink_len(),
        }
    }

    fn append(&mut self, keys: &[f32], values: &[f32]) -> Result<()> {
        self.ingest(keys, values)
    }

    fn plan_exact(&self) -> HeadPlan {
        HeadPlan { exact: true, ..self.steady_plan() }
    }

    /// Top-k of the approximate scores (`retrieve_tokens` tokens) plus the steady zone.
    /// There are no cluster value sums, so estimation budgets are ignored.
    fn plan_head(&self, kv_head: usize, q: &[f32], budget: &ZoneBudget) -> HeadPlan {
        // Before the codebooks exist nothing is coded: attend everything, marked exact so
        // execution does not depend on whether the build finishes in between.
        let Some(built) = self.built() else { return self.plan_exact() };
        let mut plan = self.steady_plan();
        if self.coded_end() == self.sink_len() {
            return plan;
        }
        let g = q.len() / self.head_dim;
        let per_head = budget.mode == SelectionMode::PerQueryHead;
        // Lut::build only fails on shapes the engine validated before planning.
        PLAN_SCRATCH.with_borrow_mut(|scratch| {
            let k = budget.retrieve_tokens;
            if !per_head {
                if let Some(chosen) = self.fused_top_k(built, kv_head, q, k, scratch) {
                    let n = self.coded_end() - self.sink_len();
                    plan.selections = vec![self.selection_of(built, 0, g, n, chosen)];
                    return plan;
                }
            }
            if self.score(built, kv_head, q, per_head, scratch).is_err() {
                return self.plan_exact();
            }
            plan.selections = if per_head {
                scratch.scores.iter().enumerate().map(|(j, s)| self.selection(built, j, 1, s, k)).collect()
            } else {
                vec![self.selection(built, 0, g, &scratch.scores[0], k)]
            };
            plan
        })
    }

    fn build_handle(&self) -> Option<BuildHandle> {
        self.handle()
    }

    fn catch_up(&mut self) -> Result<bool> {
        let before = self.coded_end();
        self.encode_pending()?;
        Ok(self.coded_end() != before)
    }

    fn snapshots(&self) -> Option<&dyn Snapshots> {
        Some(self)
    }

    fn snapshots_mut(&mut self) -> Option<&mut dyn Snapshots> {
        Some(self)
    }
}

impl<E: Element> RowSource for PqIndex<E> {
    fn head_rows<'a>(&'a self, kv_head: usize, plan: &'a HeadPlan) -> HeadRows<'a> {
        let kv = &self.heads[kv_head];
        if plan.exact {
            let mut steady = Vec::with_capacity(3);
            match &kv.coded {
                Some(EncodedRows::Hack(coded)) => {
                    steady.push(Run::Encoded { rows: coded, ranges: vec![0..coded.rows()] })
                }
                Some(EncodedRows::Kv43(coded)) => steady.push(Run::Kv43 { rows: coded, ranges: vec![0..coded.rows()] }),
                None => {}
            }
            if let Some(homed) = &self.homed {
                steady.push(Run::Homed { clusters: homed.clusters::<E>(), ranges: vec![0..homed.rows()] });
            }
            steady.push(Run::Plain(vec![PlainRows::of(&kv.base_keys, &kv.base_values)]));
            steady.push(Run::Plain(vec![PlainRows::of(&kv.tail_keys, &kv.tail_values)]));
            return HeadRows { steady, ..HeadRows::default() };
        }
        let spans: Vec<RowSpan> = self.steady_ranges().into_iter().flat_map(|r| self.spans_of(r)).collect();
        let selections = plan
            .selections
            .iter()
            .map(|sel| SelectionRows {
                first_head: sel.first_head,
                heads: sel.heads,
                retrieve: vec![self.span_runs(kv_head, &sel.retrieve)],
                clusters: Vec::new(),
                estimate: None,
            })
            .collect();
        HeadRows { steady: self.span_runs(kv_head, &spans), scan: Vec::new(), selections }
    }

    fn exact_positions(&self, _kv_head: usize, plan: &HeadPlan, j: usize) -> Vec<u32> {
        if plan.exact {
            return (0..self.tokens as u32).collect();
        }
        let mut out: Vec<u32> = self.steady_ranges().into_iter().flat_map(|r| r.start as u32..r.end as u32).collect();
        for sel in plan.selections.iter().filter(|s| (s.first_head..s.first_head + s.heads).contains(&j)) {
            for span in &sel.retrieve {
                let offset = if span.unit == 0 { 0 } else { self.base_len as u32 };
                out.extend(span.start + offset..span.end + offset);
            }
        }
        out
    }
}

impl<E: Element> Snapshots for PqIndex<E> {
    fn layout(&self) -> Option<IndexLayout> {
        self.snapshot().map(IndexLayout::Pq)
    }

    fn layout_end(&self) -> Option<u64> {
        self.built().map(|b| b.end as u64)
    }

    fn restore(&mut self, layout: &IndexLayout, keys: &[f32], values: &[f32]) -> Result<bool> {
        let IndexLayout::Pq(snapshot) = layout else { return Err(layout.wrong_method("pq")) };
        PqIndex::restore(self, snapshot, keys, values)?;
        Ok(true)
    }

    fn encoded_segments(&self) -> Option<usize> {
        PqIndex::encoded_segments(self)
    }

    fn home_needs_layout(&self) -> bool {
        true
    }

    fn encoded_home(&self, from_segment: usize) -> Option<Result<crate::EncodedHome>> {
        PqIndex::encoded_home(self, from_segment)
    }

    fn restore_encoded(&mut self, home: crate::EncodedHome) -> Result<bool> {
        PqIndex::restore_encoded(self, home)?;
        Ok(true)
    }
}
