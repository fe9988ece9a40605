//! The wave index (RetroInfer): per KV head, a steady zone (sink + local window), segments
//! of tokens clustered by spherical k-means and stored cluster-contiguous, and a directory
//! of cluster meta data. Decode tokens that leave the local window wait as *pending* tokens
//! (attended exactly) until a decode segment's worth has collected, then are clustered.

use crate::codec::RowCodec;
use crate::directory::Directory;
use crate::encoded::EncodedHome;
use crate::error::{Error, Result};
use crate::home::RowHome;
use crate::method::{
    batch_tokens, check_shape, coalesce, push_narrow, AccessMethod, Clustered, HeadPlan, IndexLayout, IndexStats,
    RowSource, RowStorage, Selection, SelectionMode, Snapshots, SteadyRows, ZoneBudget,
};
use crate::rows::{HeadRows, PlainRows, SelectionRows};
use crate::segment::{assemble_segment, build_head_segment, BuildParams, ClusterMeta, HeadSegment, SegmentRows};
use attnstore_kernels::cpu::scoring::{score_group_into, select_zones};
use attnstore_kernels::Element;
use half::f16;
use rayon::prelude::*;
use std::sync::Arc;

mod snapshot;
pub use snapshot::{HeadLayout, SegmentLayout, WaveLayout};

/// Structure of a wave index. The defaults are RetroInfer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaveParams {
    /// First tokens of the context kept apart and always attended (attention sinks).
    pub sink_tokens: usize,
    /// Most recent tokens kept apart and always attended.
    pub local_tokens: usize,
    /// Tokens per segment at prefill.
    pub segment_tokens: usize,
    /// Pending decode tokens that trigger clustering of a new segment.
    pub decode_segment_tokens: usize,
    /// Average tokens per cluster (clusters per segment = tokens / this).
    pub tokens_per_cluster: usize,
    /// Upper bound on k-means iterations per segment.
    pub max_iters: usize,
    /// Seed of the k-means initialization.
    pub seed: u64,
}

impl WaveParams {
    /// Seed of the k-means of segment `unit` (0 = the first) of KV head `head`: a device
    /// build seeded with it starts from the rows the index's own build starts from.
    pub fn segment_seed(&self, unit: usize, head: usize) -> u64 {
        self.seed ^ (unit as u64).wrapping_mul(0x9E37_79B9) ^ (head as u64) << 40
    }

    /// How a prefill of `tokens` tokens into an empty index is cut: the sink's length, then
    /// the clustered segments as (first token, tokens), in order. The tokens after the last
    /// segment (the local window and fewer than `decode_segment_tokens` pending ones) stay
    /// in the steady zone.
    pub fn prefill_segments(&self, tokens: usize) -> (usize, Vec<(usize, usize)>) {
        let sink = self.sink_tokens.min(tokens);
        let mut pending = (tokens - sink).saturating_sub(self.local_tokens);
        let (mut segments, mut first) = (Vec::new(), sink);
        while pending >= self.decode_segment_tokens.max(1) && self.segment_tokens > 0 {
            let len = pending.min(self.segment_tokens);
            segments.push((first, len));
            first += len;
            pending -= len;
        }
        (sink, segments)
    }
}

impl Default for WaveParams {
    fn default() -> Self {
        Self {
            sink_tokens: 4,
            local_tokens: 64,
            segment_tokens: 8192,
            decode_segment_tokens: 1024,
            tokens_per_cluster: 16,
            max_iters: 10,
            seed: 0x5eed,
        }
    }
}

impl WaveParams {
    /// Checks that every size is usable.
    pub fn validate(&self) -> Result<()> {
        let bad = |what, message: &str| Err(Error::InvalidParameter { what, message: message.to_string() });
        if self.segment_tokens == 0 {
            return bad("segment_tokens", "must be positive (RetroInfer uses 8192)");
        }
        if self.decode_segment_tokens == 0 || self.decode_segment_tokens > self.segment_tokens {
            return bad("decode_segment_tokens", "must be in 1..=segment_tokens (RetroInfer uses 1024)");
        }
        if self.tokens_per_cluster == 0 || self.tokens_per_cluster > self.decode_segment_tokens {
            return bad("tokens_per_cluster", "must be in 1..=decode_segment_tokens (RetroInfer uses 16)");
        }
        if self.max_iters == 0 {
            return bad("max_iters", "must be positive (RetroInfer uses 10)");
        }
        Ok(())
    }
}

/// Rows one rayon task attends in an exact plan (a multiple of the 2-bit codec's 64-row
/// value blocks, so no block is split).
const EXACT_CHUNK: usize = 2048;

/// Centroids one rayon task scores while planning.
const SCORE_CHUNK: usize = 2048;

/// Each centroid's best score over the heads of a group (`scores[j]`: head `j`'s scores).
/// The best of each column of `scores` (one row per query head) into `best`.
fn group_max_into(scores: &[&mut [f32]], best: &mut [f32]) {
    let Some((first, rest)) = scores.split_first() else { return };
    best.copy_from_slice(&first[..best.len()]);
    for s in rest {
        // A plain comparison vectorizes (scores are finite); f32::max's NaN rule does not.
        best.iter_mut().zip(s.iter()).for_each(|(b, &x)| *b = if x > *b { x } else { *b });
    }
}

#[derive(Debug, Clone, Default)]
struct HeadStore<E> {
    sink_keys: Vec<E>,
    sink_values: Vec<E>,
    segments: Vec<HeadSegment<E>>,
    dir: Directory<E>,
    /// Pending then local tokens, positions `tail_start..tokens`.
    tail_keys: Vec<E>,
    tail_values: Vec<E>,
}

/// RetroInfer's segmented cluster index over the KV heads of one layer.
#[derive(Debug)]
pub struct WaveIndex<E> {
    params: WaveParams,
    kv_heads: usize,
    head_dim: usize,
    heads: Vec<HeadStore<E>>,
    tokens: usize,
    sink_len: usize,
    tail_start: usize,
    /// The codec of segment rows (the steady zone stays plain).
    codec: RowCodec,
    /// Segment rows live in this row home when set (one home cluster per cluster, or per
    /// 2-bit value block).
    home: Option<Arc<dyn RowHome>>,
}

impl<E> Drop for WaveIndex<E> {
    fn drop(&mut self) {
        if let Some(home) = &self.home {
            for (h, head) in self.heads.iter().enumerate() {
                for ids in head.segments.iter().filter_map(HeadSegment::homed_ids) {
                    home.free(h, ids);
                }
            }
        }
    }
}

impl<E: Element> WaveIndex<E> {
    /// An empty index for `kv_heads` heads of dimension `head_dim`.
    pub fn new(params: WaveParams, kv_heads: usize, head_dim: usize) -> Result<Self> {
        params.validate()?;
        check_shape(kv_heads, head_dim)?;
        Ok(Self {
            params,
            kv_heads,
            head_dim,
            heads: vec![HeadStore::default(); kv_heads],
            tokens: 0,
            sink_len: 0,
            tail_start: 0,
            codec: RowCodec::Plain,
            home: None,
        })
    }

    /// Stores every segment built from now on encoded (`hack2`: HACK 2-bit rows; `kv43`:
    /// 4-bit keys and 3-bit values per channel), or plain. The steady zone (sink, local
    /// window, pending tokens) stays in the plain type.
    pub fn with_codec(mut self, codec: impl Into<RowCodec>) -> Result<Self> {
        let codec = codec.into();
        codec.check(self.head_dim)?;
        if self.home.is_some() || self.tokens > 0 {
            return Err(Error::InvalidParameter {
                what: "codec",
                message: "the codec is chosen on an empty index, before its rows are homed anywhere".into(),
            });
        }
        self.codec = codec;
        Ok(self)
    }

    /// Homes the rows of every segment built from now on in `home` (the engine's buffer
    /// manager): one home cluster per directory cluster, with the directory's ids. The
    /// steady zone and the directory stay in the index. Only for an empty index whose rows
    /// fit a block. With the `hack2` codec ([`WaveIndex::with_codec`] first) the encoded
    /// rows are homed instead, one home cluster per value block of Π rows (a value block
    /// spans clusters; see `HackRows::group_bytes`), numbered on per head.
    pub fn with_home(mut self, home: Arc<dyn RowHome>) -> Result<Self> {
        if self.tokens > 0 {
            return Err(Error::InvalidParameter {
                what: "row home",
                message: "only an empty index can move its segments to a row home".into(),
            });
        }
        if self.codec.kv43().is_some() {
            return Err(Error::InvalidParameter {
                what: "row home",
                message: "kv43 segments stay in the index's memory (no row home layout for them yet)".into(),
            });
        }
        if !self.codec.is_encoded() {
            home.check_row_bytes(self.head_dim * E::DTYPE.size_bytes())?;
        }
        self.home = Some(home);
        Ok(self)
    }

    /// True when segment rows live in a row home.
    pub fn is_homed(&self) -> bool {
        self.home.is_some()
    }

    /// The structure parameters.
    pub fn params(&self) -> &WaveParams {
        &self.params
    }

    /// The directory (cluster meta data) of KV head `h`.
    pub fn directory(&self, h: usize) -> &Directory<E> {
        &self.heads[h].dir
    }

    fn check_batch(&self, keys: &[f32], values: &[f32]) -> Result<usize> {
        let n = batch_tokens(self.kv_heads, self.head_dim, keys, values)?;
        if self.tokens + n > u32::MAX as usize {
            return Err(Error::InvalidParameter {
                what: "tokens",
                message: format!("a head holds at most {} tokens", u32::MAX),
            });
        }
        Ok(n)
    }

    fn ingest(&mut self, keys: &[f32], values: &[f32], max_segment: usize) -> Result<()> {
        let n = self.check_batch(keys, values)?;
        let before = (self.sink_len, self.tail_start, self.tokens);
        let lens: Vec<(usize, usize)> = self.heads.iter().map(|s| (s.sink_keys.len(), s.tail_keys.len())).collect();
        let result = self.push_and_cut(keys, values, n, max_segment);
        if result.is_err() {
            // A failed segment build (e.g. the buffer manager is full) leaves the index as it was.
            (self.sink_len, self.tail_start, self.tokens) = before;
            for (store, &(sink, tail)) in self.heads.iter_mut().zip(&lens) {
                store.sink_keys.truncate(sink);
                store.sink_values.truncate(sink);
                store.tail_keys.truncate(tail);
                store.tail_values.truncate(tail);
            }
        }
        result
    }

    /// Appends, per head of a batch of `n` tokens (`kv_heads × n × head_dim`), tokens
    /// `..sink` to the sink and tokens `tail_from..` to the tail.
    fn push_steady(&mut self, keys: &[f32], values: &[f32], n: usize, sink: usize, tail_from: usize) {
        let d = self.head_dim;
        for (h, store) in self.heads.iter_mut().enumerate() {
            let (k, v) = (&keys[h * n * d..(h + 1) * n * d], &values[h * n * d..(h + 1) * n * d]);
            push_narrow(&mut store.sink_keys, &k[..sink * d]);
            push_narrow(&mut store.sink_values, &v[..sink * d]);
            push_narrow(&mut store.tail_keys, &k[tail_from * d..]);
            push_narrow(&mut store.tail_values, &v[tail_from * d..]);
        }
    }

    fn push_and_cut(&mut self, keys: &[f32], values: &[f32], n: usize, max_segment: usize) -> Result<()> {
        let to_sink = (self.params.sink_tokens - self.sink_len.min(self.params.sink_tokens)).min(n);
        self.push_steady(keys, values, n, to_sink, to_sink);
        self.sink_len += to_sink;
        if self.tail_start < self.sink_len {
            self.tail_start = self.sink_len;
        }
        self.tokens += n;
        self.cut_segments(max_segment)
    }

    /// Clusters pending tokens into segments of at most `max_segment` tokens, as long as at
    /// least a decode segment's worth is pending.
    fn cut_segments(&mut self, max_segment: usize) -> Result<()> {
        let tail = self.tokens - self.tail_start;
        let mut pending = tail.saturating_sub(self.params.local_tokens);
        let mut cuts = Vec::new();
        let mut start = 0;
        while pending >= self.params.decode_segment_tokens {
            let len = pending.min(max_segment);
            cuts.push((start, len));
            start += len;
            pending -= len;
        }
        if cuts.is_empty() {
            return Ok(());
        }
        let d = self.head_dim;
        let first_unit = self.heads[0].segments.len();
        let jobs: Vec<(usize, usize)> = (0..self.kv_heads).flat_map(|h| (0..cuts.len()).map(move |c| (h, c))).collect();
        let built = jobs
            .par_iter()
            .map(|&(h, c)| {
                let (s, len) = cuts[c];
                let store = &self.heads[h];
                let params = BuildParams {
                    tokens_per_cluster: self.params.tokens_per_cluster,
                    max_iters: self.params.max_iters,
                    seed: self.segment_seed(first_unit + c, h),
                };
                let (mut seg, metas) = build_head_segment(
                    &store.tail_keys[s * d..(s + len) * d],
                    &store.tail_values[s * d..(s + len) * d],
                    (self.tail_start + s) as u32,
                    d,
                    params,
                )?;
                seg.encode(self.codec, d, params.seed ^ 0x4841_434b)?;
                Ok((seg, metas))
            })
            .collect::<Result<Vec<_>>>()?;
        self.push_segments(&jobs, first_unit, built)?;
        for store in &mut self.heads {
            store.tail_keys.drain(..start * d);
            store.tail_values.drain(..start * d);
        }
        self.tail_start += start;
        Ok(())
    }

    /// Seed of the clustering (and of the 2-bit rounding) of segment `unit` of head `h`.
    fn segment_seed(&self, unit: usize, h: usize) -> u64 {
        self.params.segment_seed(unit, h)
    }

    /// Stores built segments (`jobs[i]` = (head, segment − `first_unit`) of `built[i]`): rows
    /// to the buffer manager when the index has one (all or nothing), clusters into the
    /// directory.
    fn push_segments(
        &mut self,
        jobs: &[(usize, usize)],
        first_unit: usize,
        mut built: Vec<(HeadSegment<E>, Vec<ClusterMeta>)>,
    ) -> Result<()> {
        let d = self.head_dim;
        if let (Some(home), Some(_)) = (self.home.as_deref(), self.codec.hack()) {
            // 2-bit rows: one cluster per value block, numbered on from the head's last one.
            let end = |s: &HeadStore<E>| s.segments.iter().filter_map(HeadSegment::homed_ids).map(|r| r.end).max();
            let first: Vec<u32> = self.heads.iter().map(|s| end(s).unwrap_or(0)).collect();
            let mut next = first.clone();
            for (&(h, _), (seg, _)) in jobs.iter().zip(built.iter_mut()) {
                if let Err(e) = seg.move_hack_to(home, h, next[h], d) {
                    for (head, (&a, &b)) in first.iter().zip(&next).enumerate() {
                        home.free(head, a..b);
                    }
                    return Err(e);
                }
                next[h] = seg.homed_ids().map_or(next[h], |r| r.end);
            }
        } else if let Some(home) = self.home.as_deref() {
            // Sequentially, in the order the directory numbers clusters; all or nothing.
            let mut next: Vec<u32> = self.heads.iter().map(|s| s.dir.len() as u32).collect();
            for (&(h, _), (seg, metas)) in jobs.iter().zip(built.iter_mut()) {
                if let Err(e) = seg.move_to(home, h, next[h], metas, d) {
                    for (head, store) in self.heads.iter().enumerate() {
                        home.free(head, store.dir.len() as u32..next[head]);
                    }
                    return Err(e);
                }
                next[h] += metas.len() as u32;
            }
        }
        for (&(h, c), (seg, metas)) in jobs.iter().zip(built) {
            let store = &mut self.heads[h];
            store.dir.push_segment((first_unit + c) as u32, &metas);
            store.segments.push(seg);
        }
        Ok(())
    }

    fn tail_len(&self) -> usize {
        self.tokens - self.tail_start
    }

    fn indexed_tokens(&self) -> usize {
        self.tail_start - self.sink_len
    }

    /// Chooses retrieved and estimated clusters from one score per cluster.
    fn select(&self, dir: &Directory<E>, scores: &[f32], budget: &ZoneBudget) -> (Vec<u32>, Vec<u32>) {
        let n = scores.len();
        let avg = (self.indexed_tokens() as f64 / n as f64).max(1.0);
        // Room for twice the clusters an average size needs (it grows when they fall short).
        let guess = ((budget.retrieve_tokens as f64 / avg).ceil() as usize * 2 + 8).min(n);
        let estimate =
            (budget.estimate_tokens != usize::MAX).then(|| (budget.estimate_tokens as f64 / avg).round() as usize);
        select_zones(scores, &dir.sizes, budget.retrieve_tokens, guess, estimate)
    }

    #[allow(clippy::too_many_arguments)]
    fn selection(
        &self,
        dir: &Directory<E>,
        first_head: usize,
        scores: &[Vec<f32>],
        choice: &[f32],
        budget: &ZoneBudget,
    ) -> Selection {
        let (retrieve, estimate) = self.select(dir, choice, budget);
        self.selection_of(dir, first_head, scores, retrieve, estimate)
    }

    /// The selection that retrieves `retrieve` and estimates `estimate` (directory ids).
    fn selection_of(
        &self,
        dir: &Directory<E>,
        first_head: usize,
        scores: &[Vec<f32>],
        mut retrieve: Vec<u32>,
        estimate: Vec<u32>,
    ) -> Selection {
        retrieve.sort_unstable();
        let mut spans: Vec<_> = retrieve.iter().map(|&id| dir.spans[id as usize]).collect();
        let retrieve_tokens = spans.iter().map(|s| s.len()).sum::<usize>();
        coalesce(&mut spans);
        let estimate_tokens = estimate.iter().map(|&id| dir.sizes[id as usize] as usize).sum::<usize>();
        let estimate_scores = scores.iter().flat_map(|s| estimate.iter().map(|&id| s[id as usize])).collect();
        Selection {
            first_head,
            heads: scores.len(),
            retrieve: spans,
            retrieve_clusters: retrieve.len(),
            retrieve_tokens,
            dropped_clusters: dir.len() - retrieve.len() - estimate.len(),
            dropped_tokens: self.indexed_tokens() - retrieve_tokens - estimate_tokens,
            estimate,
            estimate_scores,
            estimate_tokens,
            scored: dir.len(),
            scored_bytes: dir.len() * self.head_dim * E::DTYPE.size_bytes(),
            retrieve_ids: retrieve,
        }
    }

    /// Every query head's scaled score of every centroid of `dir` (`q`: the group's queries),
    /// then the group's best score of each centroid (the per-KV-head choice), empty unless
    /// `best` is asked for.
    fn group_scores(&self, dir: &Directory<E>, q: &[f32], best: bool) -> (Vec<Vec<f32>>, Vec<f32>) {
        let d = self.head_dim;
        let scale = 1.0 / (d as f32).sqrt();
        let g = q.len() / d;
        // Centroid scoring in chunks on rayon threads: with more cores than KV heads the
        // planner would otherwise leave most of them idle. Each chunk takes its best scores
        // while they are in L1.
        // Each chunk writes its scores (and best scores) in place: no per-chunk vectors to
        // allocate and concatenate after the parallel pass.
        let n = dir.len();
        let mut scores = vec![vec![0.0f32; n]; g];
        let mut best_scores = vec![0.0f32; if best { n } else { 0 }];
        let mut pieces: Vec<(Vec<&mut [f32]>, &mut [f32])> = Vec::with_capacity(n.div_ceil(SCORE_CHUNK));
        let mut best_pieces = best_scores.chunks_mut(SCORE_CHUNK);
        for _ in 0..n.div_ceil(SCORE_CHUNK) {
            pieces.push((Vec::with_capacity(g), best_pieces.next().unwrap_or_default()));
        }
        for s in &mut scores {
            for (piece, part) in pieces.iter_mut().zip(s.chunks_mut(SCORE_CHUNK)) {
                piece.0.push(part);
            }
        }
        pieces.into_par_iter().zip(dir.centroids.par_chunks(SCORE_CHUNK * d)).for_each(|((mut out, top), rows)| {
            score_group_into(q, g, rows, scale, &mut out);
            if best {
                group_max_into(&out, top);
            }
        });
        (scores, best_scores)
    }

    fn steady_plan(&self) -> HeadPlan {
        let tail = self.tail_len();
        HeadPlan {
            exact: false,
            steady_tokens: self.sink_len + tail,
            pending_tokens: tail.saturating_sub(self.params.local_tokens),
            selections: Vec::new(),
        }
    }
}

impl<E: Element> AccessMethod for WaveIndex<E> {
    fn name(&self) -> &'static str {
        "wave"
    }

    fn stats(&self) -> IndexStats {
        let elem = E::DTYPE.size_bytes();
        let steady = self.sink_len + self.tail_len();
        let segments: usize = self.heads.iter().flat_map(|h| &h.segments).map(HeadSegment::kv_bytes).sum();
        IndexStats {
            tokens: self.tokens,
            kv_bytes: 2 * steady * self.kv_heads * self.head_dim * elem + segments,
            index_bytes: self.heads.iter().map(|s| s.dir.bytes() + 4 * self.indexed_tokens()).sum(),
            segments: self.heads[0].segments.len(),
            clusters: self.heads[0].dir.len(),
            pending_tokens: self.tail_len().saturating_sub(self.params.local_tokens),
            indexed_tokens: self.indexed_tokens(),
        }
    }

    fn append(&mut self, keys: &[f32], values: &[f32]) -> Result<()> {
        self.ingest(keys, values, self.params.decode_segment_tokens)
    }

    /// Prefill batches are cut into prefill-sized segments (default 8192 tokens).
    fn prefill(&mut self, keys: &[f32], values: &[f32]) -> Result<()> {
        self.ingest(keys, values, self.params.segment_tokens)
    }

    fn plan_exact(&self) -> HeadPlan {
        HeadPlan { exact: true, ..self.steady_plan() }
    }

    fn plan_head(&self, kv_head: usize, q: &[f32], budget: &ZoneBudget) -> HeadPlan {
        let mut plan = self.steady_plan();
        let dir = &self.heads[kv_head].dir;
        if dir.is_empty() {
            return plan;
        }
        let traced = plan_trace().then(std::time::Instant::now);
        let per_kv_head = budget.mode == SelectionMode::PerKvHead;
        let (scores, best) = self.group_scores(dir, q, per_kv_head);
        let scored = traced.map(|t| t.elapsed());
        plan.selections = if per_kv_head {
            vec![self.selection(dir, 0, &scores, &best, budget)]
        } else {
            scores.iter().enumerate().map(|(j, s)| self.selection(dir, j, std::slice::from_ref(s), s, budget)).collect()
        };
        if let (Some(t), Some(scored)) = (traced, scored) {
            eprintln!(
                "attnstore-index: plan of kv head {kv_head}: scoring {:.0} us, selection {:.0} us",
                scored.as_secs_f64() * 1e6,
                (t.elapsed() - scored).as_secs_f64() * 1e6
            );
        }
        plan
    }

    fn clustered(&self) -> Option<&dyn Clustered> {
        Some(self)
    }

    fn snapshots(&self) -> Option<&dyn Snapshots> {
        Some(self)
    }

    fn snapshots_mut(&mut self) -> Option<&mut dyn Snapshots> {
        Some(self)
    }
}

impl<E: Element> RowSource for WaveIndex<E> {
    fn head_rows<'a>(&'a self, kv_head: usize, plan: &'a HeadPlan) -> HeadRows<'a> {
        let store = &self.heads[kv_head];
        let steady = vec![
            crate::rows::Run::Plain(vec![PlainRows::of(&store.sink_keys, &store.sink_values)]),
            crate::rows::Run::Plain(vec![PlainRows::of(&store.tail_keys, &store.tail_values)]),
        ];
        if plan.exact {
            // Every segment row, in runs of EXACT_CHUNK rows (parallel jobs merged by
            // log-sum-exp: the executor parallelizes over KV heads only otherwise).
            let scan = store
                .segments
                .iter()
                .flat_map(|s| {
                    let n = s.positions.len();
                    (0..n).step_by(EXACT_CHUNK).map(move |a| s.run(vec![a..(a + EXACT_CHUNK).min(n)]))
                })
                .collect();
            return HeadRows { steady, scan, selections: Vec::new() };
        }
        let plain_homed = !self.codec.is_encoded() && self.home.is_some();
        let selections = plan
            .selections
            .iter()
            .map(|sel| {
                let (retrieve, clusters) = if plain_homed {
                    // Whole clusters: the engine reads the blocks its plan recorded.
                    let sizes = &store.dir.sizes;
                    (Vec::new(), sel.retrieve_ids.iter().map(|&id| (id, sizes[id as usize] as usize)).collect())
                } else {
                    // Spans are sorted by segment (coalesce sorts them): one job per segment.
                    let jobs = sel
                        .retrieve
                        .chunk_by(|a, b| a.unit == b.unit)
                        .map(|runs| {
                            let ranges = runs.iter().map(|r| r.start as usize..r.end as usize).collect();
                            vec![store.segments[runs[0].unit as usize].run(ranges)]
                        })
                        .collect();
                    (jobs, Vec::new())
                };
                let zone = store.dir.estimate_zone(sel);
                SelectionRows {
                    first_head: sel.first_head,
                    heads: sel.heads,
                    retrieve,
                    clusters,
                    estimate: Some(Box::new(zone)),
                }
            })
            .collect();
        HeadRows { steady, scan: Vec::new(), selections }
    }

    fn exact_positions(&self, kv_head: usize, plan: &HeadPlan, j: usize) -> Vec<u32> {
        let store = &self.heads[kv_head];
        let mut out: Vec<u32> = (0..self.sink_len as u32).chain(self.tail_start as u32..self.tokens as u32).collect();
        if plan.exact {
            store.segments.iter().for_each(|s| out.extend_from_slice(&s.positions));
            return out;
        }
        for sel in plan.selections.iter().filter(|s| (s.first_head..s.first_head + s.heads).contains(&j)) {
            for span in &sel.retrieve {
                out.extend_from_slice(
                    &store.segments[span.unit as usize].positions[span.start as usize..span.end as usize],
                );
            }
        }
        out
    }
}

impl<E: Element> Clustered for WaveIndex<E> {
    fn storage(&self) -> RowStorage {
        match (&self.home, self.codec) {
            (None, _) => RowStorage::Memory,
            (Some(_), RowCodec::Hack2(_)) => RowStorage::HomedEncoded,
            // `with_home` refuses kv43: only plain rows are homed otherwise.
            (Some(_), RowCodec::Plain | RowCodec::Kv43(_)) => RowStorage::Homed,
        }
    }

    fn dtype(&self) -> attnstore_kernels::DType {
        E::DTYPE
    }

    fn cluster_sizes(&self, kv_head: usize) -> &[u32] {
        &self.heads[kv_head].dir.sizes
    }

    fn directory_f16(&self, kv_head: usize) -> (Vec<f16>, Vec<f16>) {
        let bits = |x: &[E]| -> Vec<f16> { x.iter().map(|v| f16::from_f32(v.to_f32())).collect() };
        let dir = &self.heads[kv_head].dir;
        (bits(&dir.centroids), bits(&dir.value_means))
    }

    fn indexed_end(&self) -> usize {
        self.tail_start
    }

    fn indexed_tokens(&self) -> usize {
        WaveIndex::indexed_tokens(self)
    }

    fn steady_rows_from(&self, from: usize) -> Option<SteadyRows> {
        if E::DTYPE != attnstore_kernels::DType::F16 {
            return None;
        }
        let (d, sink) = (self.head_dim, self.sink_len);
        let len = sink + self.tail_len();
        let n = len.saturating_sub(from);
        let mut out = SteadyRows {
            len,
            keys: Vec::with_capacity(n * self.kv_heads * d),
            values: Vec::with_capacity(n * self.kv_heads * d),
        };
        // E is f16 here: its bits as they are.
        let bits = |x: &[E], to: &mut Vec<u16>| to.extend_from_slice(bytemuck::cast_slice::<E, u16>(x));
        for i in from..len {
            for head in &self.heads {
                let (k, v, at) = if i < sink {
                    (&head.sink_keys, &head.sink_values, i)
                } else {
                    (&head.tail_keys, &head.tail_values, i - sink)
                };
                bits(&k[at * d..(at + 1) * d], &mut out.keys);
                bits(&v[at * d..(at + 1) * d], &mut out.values);
            }
        }
        Some(out)
    }

    fn kv43_segments(&self, kv_head: usize) -> Option<Vec<&attnstore_kernels::Kv43Head>> {
        let segments = &self.heads[kv_head].segments;
        if segments.is_empty() {
            return None;
        }
        segments.iter().map(|s| s.kv43_rows()).collect()
    }

    fn kv43_clusters(&self, kv_head: usize) -> Option<Vec<crate::RowSpan>> {
        let store = &self.heads[kv_head];
        let kv43 = |unit: u32| {
            matches!(store.segments.get(unit as usize)?.rows, crate::segment::SegmentRows::Kv43(_)).then_some(())
        };
        store.dir.spans.iter().map(|span| kv43(span.unit).map(|()| *span)).collect()
    }

    fn encoded_clusters(&self, kv_head: usize) -> Option<Vec<(crate::HomedGroups, std::ops::Range<u32>)>> {
        let store = &self.heads[kv_head];
        store
            .dir
            .spans
            .iter()
            .map(|span| match &store.segments.get(span.unit as usize)?.rows {
                crate::segment::SegmentRows::HomedEncoded(g) => Some((*g, span.start..span.end)),
                _ => None,
            })
            .collect()
    }

    fn plan_head_retrieving(&self, kv_head: usize, q: &[f32], retrieve: &[u32]) -> HeadPlan {
        let mut plan = self.steady_plan();
        let dir = &self.heads[kv_head].dir;
        if dir.is_empty() {
            return plan;
        }
        let mut chosen = vec![false; dir.len()];
        retrieve.iter().filter(|&&id| (id as usize) < dir.len()).for_each(|&id| chosen[id as usize] = true);
        let retrieve: Vec<u32> = (0..dir.len() as u32).filter(|&id| chosen[id as usize]).collect();
        let estimate: Vec<u32> =
            (0..dir.len() as u32).filter(|&id| !chosen[id as usize] && dir.sizes[id as usize] > 0).collect();
        let (scores, _) = self.group_scores(dir, q, false);
        plan.selections = vec![self.selection_of(dir, 0, &scores, retrieve, estimate)];
        plan
    }
}

/// Whether `ATTNSTORE_PLAN_TRACE` is set: each planned KV head then prints the time its
/// centroid scoring and its selection took (read once per process).
fn plan_trace() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("ATTNSTORE_PLAN_TRACE").is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnstore_kernels::random::SplitMix64;

    #[test]
    fn kv43_segments_are_encoded_once_in_storage_order_and_never_again() {
        use attnstore_kernels::{Codec, Kv43Head, Kv43Params};
        let p = WaveParams { segment_tokens: 512, decode_segment_tokens: 128, ..WaveParams::default() };
        let (h, d, prefill, decode) = (2, 64, 1500, 400);
        let mut g = SplitMix64::new(17);
        let total = prefill + decode;
        let k: Vec<f32> = (0..h * total * d).map(|_| g.normal()).collect();
        let v: Vec<f32> = (0..h * total * d).map(|_| g.normal()).collect();
        let batch = |x: &[f32], a: usize, b: usize| -> Vec<f32> {
            (0..h).flat_map(|hh| x[(hh * total + a) * d..(hh * total + b) * d].to_vec()).collect()
        };
        let mut wave = WaveIndex::<f16>::new(p, h, d).unwrap().with_codec(Codec::Kv43(Kv43Params::default())).unwrap();
        wave.prefill(&batch(&k, 0, prefill), &batch(&v, 0, prefill)).unwrap();
        let encoded = |w: &WaveIndex<f16>| -> Vec<Vec<Kv43Head>> {
            w.heads.iter().map(|s| s.segments.iter().map(|seg| seg.kv43_rows().unwrap().clone()).collect()).collect()
        };
        // Each segment holds its rows in storage (cluster) order, encoded from their f16
        // values, and nothing plain.
        let check = |w: &WaveIndex<f16>| {
            let layout = w.layout();
            for (u, seg) in layout.segments.iter().enumerate() {
                for (hh, hl) in seg.heads.iter().enumerate() {
                    let row = |x: &[f32], pos: u32| -> Vec<f32> {
                        let at = (hh * total + pos as usize) * d;
                        x[at..at + d].iter().map(|&y| f16::from_f32(y).to_f32()).collect()
                    };
                    let sk: Vec<f32> = hl.positions.iter().flat_map(|&pos| row(&k, pos)).collect();
                    let sv: Vec<f32> = hl.positions.iter().flat_map(|&pos| row(&v, pos)).collect();
                    let mut want = Kv43Head::new(d, Kv43Params::default()).unwrap();
                    want.append(&sk, &sv).unwrap();
                    assert_eq!(w.heads[hh].segments[u].kv43_rows(), Some(&want), "segment {u} head {hh}");
                }
            }
        };
        check(&wave);
        let before = encoded(&wave);
        assert!(before[0].len() >= 2, "the test must build several segments");
        // Decode tokens build new segments; the old ones are never encoded again.
        for t in (prefill..total).step_by(37) {
            let e = (t + 37).min(total);
            wave.append(&batch(&k, t, e), &batch(&v, t, e)).unwrap();
        }
        let after = encoded(&wave);
        assert!(after[0].len() > before[0].len(), "decode tokens must build a segment");
        for (a, b) in after.iter().zip(&before) {
            assert_eq!(&a[..b.len()], &b[..]);
        }
        check(&wave);
        // Every cluster is one span of its segment; the spans tile each segment's rows once,
        // as many rows as the directory says the cluster has.
        for (hh, segments) in after.iter().enumerate() {
            let spans = wave.kv43_clusters(hh).expect("kv43 segments");
            assert_eq!(spans.iter().map(|s| s.end - s.start).collect::<Vec<_>>(), wave.cluster_sizes(hh));
            let mut sorted = spans.clone();
            sorted.sort_by_key(|s| (s.unit, s.start));
            for (u, seg) in segments.iter().enumerate() {
                let mut at = 0;
                for s in sorted.iter().filter(|s| s.unit as usize == u) {
                    assert_eq!(s.start, at, "head {hh} segment {u}: spans tile its rows");
                    at = s.end;
                }
                assert_eq!(at as usize, seg.rows(), "head {hh} segment {u}");
            }
        }
        let mut plain = WaveIndex::<f16>::new(p, h, d).unwrap();
        plain.prefill(&batch(&k, 0, prefill), &batch(&v, 0, prefill)).unwrap();
        assert!(plain.kv43_clusters(0).is_none(), "plain rows");
        // A quarter of f16's bytes for the encoded rows (a little more: partial groups in f16).
        let segment_rows: usize = after[0].iter().map(Kv43Head::rows).sum();
        let coded: usize = wave.heads.iter().flat_map(|s| &s.segments).map(HeadSegment::kv_bytes).sum();
        assert!(coded * 10 < 4 * h * segment_rows * d * 2 * 2, "{coded} bytes for {segment_rows} rows per head");
        assert!(WaveIndex::<f16>::new(p, h, 48).unwrap().with_codec(Codec::Kv43(Kv43Params::default())).is_err());
    }

    #[test]
    fn prefill_segments_is_how_a_prefill_into_an_empty_index_cuts() {
        let p = WaveParams { segment_tokens: 2048, decode_segment_tokens: 512, ..WaveParams::default() };
        let mut g = SplitMix64::new(9);
        for tokens in [3usize, 68, 579, 580, 2000, 2048 + 68 + 4 + 511, 2048 + 68 + 4 + 512, 3 * 2048 + 700] {
            let (h, d) = (2, 8);
            let k: Vec<f32> = (0..h * tokens * d).map(|_| g.normal()).collect();
            let mut index = WaveIndex::<f32>::new(p, h, d).unwrap();
            index.prefill(&k, &k).unwrap();
            let layout = index.layout();
            let (sink, segments) = p.prefill_segments(tokens);
            assert_eq!(sink as u64, layout.sink_len, "{tokens} tokens");
            let got: Vec<(usize, usize)> = layout.segments.iter().map(|s| (s.first as usize, s.len as usize)).collect();
            assert_eq!(segments, got, "{tokens} tokens");
            let end = segments.last().map_or(sink, |&(first, len)| first + len);
            assert_eq!(end as u64, layout.tail_start, "{tokens} tokens");
        }
    }
}
