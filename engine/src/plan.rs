//! The planner: turns a request and a budget into a physical plan — per KV head the steady
//! zone, the retrieved row spans, the estimated clusters — and counts what it will read.
//! Planning reads only cluster meta data, never KV rows, and never touches a GPU.

use crate::budget::Budget;
use crate::config::EngineConfig;
use crate::context::{ContextId, Layer};
use crate::error::{check_finite, Error, Result};
use crate::spec::{ContextSpec, LayerKind, Method};
use attnstore_buffer::Tier;
use attnstore_index::{HeadPlan, ZoneBudget};
use attnstore_kernels::{AttnShape, Codec, DType};
use rayon::prelude::*;

/// One attention request of a decode step: a layer of a context and the query vectors of
/// all its query heads (`q_heads × head_dim`, post-RoPE).
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The context.
    pub context: ContextId,
    /// The layer.
    pub layer: usize,
    /// Query vectors, `q_heads × head_dim`.
    pub queries: Vec<f32>,
}

impl Request {
    /// A request for `layer` of `context`.
    pub fn new(context: ContextId, layer: usize, queries: Vec<f32>) -> Self {
        Self { context, layer, queries }
    }
}

/// How a request is executed.
#[derive(Debug, Clone, PartialEq)]
pub enum Strategy {
    /// Every token attended exactly, and why the planner chose it.
    Exact {
        /// The reason, for EXPLAIN.
        reason: String,
    },
    /// Tripartite (or top-k) sparse attention under these token budgets.
    Sparse {
        /// Resolved budgets.
        zone: ZoneBudget,
    },
}

/// What a plan will touch, summed over all query heads of a request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PlanCost {
    /// Steady-zone tokens per KV head.
    pub steady_tokens: usize,
    /// Of those, tokens waiting to be indexed.
    pub pending_tokens: usize,
    /// Clusters retrieved (all selections).
    pub retrieve_clusters: usize,
    /// Tokens attended exactly in retrieval zones (all selections).
    pub retrieve_tokens: usize,
    /// Blocks the retrieval zones read (K and V).
    pub retrieve_blocks: usize,
    /// Those blocks per tier, `[gpu, host, disk]`: looked up in the buffer manager's
    /// mapping table at planning time when the rows live there (`buffered`), else all host.
    pub tier_blocks: [usize; 3],
    /// The retrieved rows live in the buffer manager and `tier_blocks` was looked up.
    pub buffered: bool,
    /// Clusters estimated (all selections).
    pub estimate_clusters: usize,
    /// Tokens those clusters stand for.
    pub estimate_tokens: usize,
    /// Clusters dropped (all selections).
    pub dropped_clusters: usize,
    /// Tokens dropped (all selections).
    pub dropped_tokens: usize,
    /// Centroids (or keys, for a flat top-k) scored.
    pub scored: usize,
    /// Bytes of meta data read for scoring and estimation.
    pub meta_bytes: usize,
    /// Bytes of KV rows read (steady + retrieved, or all for exact).
    pub kv_bytes: usize,
    /// Bytes read per tier: `[gpu, host, disk]`.
    pub tier_bytes: [usize; 3],
    /// Bytes exact attention over the same layer reads.
    pub exact_bytes: usize,
    /// Bytes of the retrieved rows (encoded sizes under the `hack2` codec).
    pub retrieve_bytes: usize,
}

impl PlanCost {
    /// Bytes the plan reads in total.
    pub fn total_bytes(&self) -> usize {
        self.tier_bytes.iter().sum()
    }
}

/// The plan of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestPlan {
    /// The context.
    pub context: ContextId,
    /// The layer.
    pub layer: usize,
    /// Layer version at plan time (execution refuses a changed layer).
    pub(crate) version: u64,
    /// Tokens of the layer at plan time.
    pub tokens: usize,
    /// Shape of the context.
    pub shape: AttnShape,
    /// Storage type.
    pub dtype: DType,
    /// Codec of the context's stored rows.
    pub codec: Codec,
    /// Access method (`wave`, `flat`, `window`).
    pub method: &'static str,
    /// Layer kind.
    pub kind: LayerKind,
    /// Query vectors.
    pub queries: Vec<f32>,
    /// Exact or sparse, and why.
    pub strategy: Strategy,
    /// One plan per KV head (a device-selected plan's hold only the steady zone: its
    /// clusters are chosen at execution).
    pub heads: Vec<HeadPlan>,
    /// Per KV head and selection, the blocks of the retrieved clusters as the buffer
    /// manager's mapping table gave them at planning time (each one's source tier is
    /// `location.tier()`; execution pins exactly these). Empty lists when the rows are not
    /// homed per cluster.
    pub blocks: Vec<Vec<Vec<attnstore_buffer::BlockLocation>>>,
    /// Set when the clusters are chosen on the GPU at execution ([`crate::Engine::plan_gpu`]).
    pub device: Option<DeviceSelection>,
    /// Why [`crate::Engine::plan_gpu`] planned this sparse request on the host instead (its
    /// clusters chosen from the index's meta data before execution), e.g. a codec or method
    /// the device step does not read; `None` for device-selected and exact plans, and for
    /// every plan of [`crate::Engine::plan`]. EXPLAIN prints it.
    pub host_planned: Option<String>,
    /// What the plan touches.
    pub cost: PlanCost,
}

/// A sparse wave plan whose clusters the GPU chooses when it runs: per KV head the top
/// `clusters_per_head` clusters by the group's best centroid score are attended exactly and
/// every other cluster is estimated. Planning then reads no meta data at all; the Gpu-tier
/// hits and Host-arena misses are known only after execution (`GpuRun`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSelection {
    /// Clusters retrieved per KV head.
    pub clusters_per_head: usize,
    /// Clusters per KV head.
    pub clusters: usize,
    /// Tokens indexed per KV head.
    pub indexed_tokens: usize,
    /// Tokens the retrieved clusters hold on average per KV head (the budget's retrieval
    /// zone in clusters of the average size). The CPU executor runs a device-selected plan
    /// by retrieving this many tokens.
    pub retrieve_tokens: usize,
}

impl RequestPlan {
    /// Tokens attended exactly by query head `q_head` (steady + retrieved, or all).
    pub fn exact_tokens(&self, q_head: usize) -> usize {
        let g = self.shape.group();
        let head = &self.heads[q_head / g];
        if head.exact {
            return self.tokens;
        }
        let j = q_head % g;
        head.steady_tokens
            + head
                .selections
                .iter()
                .filter(|s| (s.first_head..s.first_head + s.heads).contains(&j))
                .map(|s| s.retrieve_tokens)
                .sum::<usize>()
    }
}

impl RequestPlan {
    /// This plan with its clusters chosen as `heads` (a device-selected plan, analyzed after
    /// the GPU chose them): an ordinary sparse plan, its cost counted from `heads`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "used by the GPU executor"))]
    pub(crate) fn chosen(&self, heads: Vec<HeadPlan>, layer: &Layer, config: &EngineConfig) -> RequestPlan {
        let row_bytes = self.shape.head_dim * self.dtype.size_bytes();
        let rows = RowBytes { plain: 2 * row_bytes, indexed: self.codec.kv_row_bytes(self.shape.head_dim) };
        let blocks = crate::exec::record_blocks(layer, &heads);
        let cost = cost_of(&heads, &blocks, self.tokens, rows, self.cost.exact_bytes, config);
        RequestPlan { heads, blocks, device: None, cost, ..self.clone() }
    }
}

/// A physical plan for a batch of requests.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The budget it was planned under.
    pub budget: Budget,
    /// One plan per request, in request order.
    pub requests: Vec<RequestPlan>,
    /// Bandwidth the cost estimate assumes (GB/s).
    pub host_read_gbps: f64,
}

pub(crate) fn plan_request(
    spec: &ContextSpec,
    layer: &Layer,
    request: &Request,
    budget: &Budget,
    config: &EngineConfig,
    on_device: bool,
) -> Result<RequestPlan> {
    let shape = spec.shape;
    if request.queries.len() != shape.query_len() {
        return Err(Error::ShapeMismatch {
            what: "queries (q_heads × head_dim)",
            expected: shape.query_len(),
            got: request.queries.len(),
        });
    }
    check_finite("queries", &request.queries)?;
    let stats = layer.method.stats();
    let tokens = stats.tokens;
    let elem = spec.dtype.size_bytes();
    let row_bytes = shape.head_dim * elem;
    let codec = spec.codec_of(request.layer);
    let rows = RowBytes { plain: 2 * row_bytes, indexed: codec.kv_row_bytes(shape.head_dim) };
    let exact_bytes = stats.kv_bytes;
    let zone = budget.resolve(tokens);
    let building = layer.method.build_handle().is_some_and(|h| !h.is_ready());
    let exact_reason = match (layer.kind, spec.method) {
        (LayerKind::SlidingWindow(w), _) => {
            Some(format!("sliding-window layer: its last {w} tokens are always attended"))
        }
        _ if budget.exact => Some("the budget is full".to_string()),
        (_, Method::Pq(_)) if building => Some(format!(
            "the pq codebooks are still being built in the background: all {tokens} tokens attended exactly until ready"
        )),
        _ if layer.rebuilding => Some(format!(
            "the index is being rebuilt after recovery: all {tokens} tokens attended exactly until it is ready"
        )),
        (_, Method::Wave(_) | Method::Pq(_)) if stats.indexed_tokens == 0 => {
            Some(format!("nothing indexed yet: all {tokens} tokens are in the steady zone"))
        }
        (_, Method::Wave(_) | Method::Pq(_)) if tokens <= budget.short_context_tokens => Some(format!(
            "short context: {tokens} tokens, at most the budget's {} (a sparse plan would save little here)",
            budget.short_context_tokens
        )),
        (_, Method::Wave(_) | Method::Pq(_)) => {
            let sparse = estimated_sparse_bytes(&shape, &stats, &zone, rows, spec.method);
            (sparse as f64 >= budget.exact_threshold * exact_bytes as f64).then(|| {
                format!(
                    "cheaper than sparse: a sparse plan would read ~{} of the {} exact attention reads (threshold {:.0}%)",
                    human_bytes(sparse),
                    human_bytes(exact_bytes),
                    budget.exact_threshold * 100.0
                )
            })
        }
        (_, Method::Flat) => None,
    };
    let g = shape.group();
    let d = shape.head_dim;
    let q = &request.queries;
    let host_planned = match exact_reason {
        None if on_device => why_host_planned(spec, codec, &zone, config, stats.clusters),
        _ => None,
    };
    let device = match exact_reason {
        None if on_device && host_planned.is_none() => {
            let indexed = stats.indexed_tokens;
            let avg = indexed as f64 / stats.clusters as f64;
            let r = ((zone.retrieve_tokens.min(indexed) as f64 / avg).ceil() as usize).clamp(1, stats.clusters);
            let retrieve_tokens = ((r as f64 * avg).round() as usize).min(indexed);
            Some(DeviceSelection {
                clusters_per_head: r,
                clusters: stats.clusters,
                indexed_tokens: indexed,
                retrieve_tokens,
            })
        }
        _ => None,
    };
    let (strategy, (heads, blocks)): (Strategy, (Vec<HeadPlan>, Vec<_>)) = match exact_reason {
        Some(reason) => {
            (Strategy::Exact { reason }, (0..shape.kv_heads).map(|_| (layer.method.plan_exact(), Vec::new())).unzip())
        }
        None if device.is_some() => {
            let steady = HeadPlan {
                exact: false,
                steady_tokens: tokens - stats.indexed_tokens,
                pending_tokens: stats.pending_tokens,
                selections: Vec::new(),
            };
            (Strategy::Sparse { zone }, (vec![steady; shape.kv_heads], vec![Vec::new(); shape.kv_heads]))
        }
        None => (
            Strategy::Sparse { zone },
            (0..shape.kv_heads)
                .into_par_iter()
                .map(|h| {
                    let plan = layer.method.plan_head(h, &q[h * g * d..(h + 1) * g * d], &zone);
                    let blocks = crate::exec::record_head_blocks(layer, h, &plan);
                    (plan, blocks)
                })
                .unzip(),
        ),
    };
    let mut cost = cost_of(&heads, &blocks, tokens, rows, exact_bytes, config);
    if let Some(dev) = &device {
        device_cost(&mut cost, dev, shape.kv_heads, row_bytes, rows);
    }
    Ok(RequestPlan {
        context: request.context,
        layer: request.layer,
        version: layer.version,
        tokens,
        shape,
        dtype: spec.dtype,
        codec,
        method: layer.method.name(),
        kind: layer.kind,
        queries: request.queries.clone(),
        strategy,
        heads,
        blocks,
        device,
        host_planned,
        cost,
    })
}

/// Why a sparse request that [`crate::Engine::plan_gpu`] was asked to leave to the device
/// cannot be: the first condition of the device step it misses, or `None` when it meets
/// them all (a wave index with clusters, f16 rows — plain, or `hack2` with per-token keys —
/// homed in the buffer manager's arena, one selection per KV head).
fn why_host_planned(
    spec: &ContextSpec,
    codec: Codec,
    zone: &attnstore_index::ZoneBudget,
    config: &EngineConfig,
    clusters: usize,
) -> Option<String> {
    if !matches!(spec.method, Method::Wave(_)) {
        return Some(format!("{} method: the device step selects clusters of a wave index", spec.method.name()));
    }
    if spec.dtype != DType::F16 {
        return Some(format!("{} rows: the device step reads f16 rows", spec.dtype));
    }
    if !device_codec(codec, spec.shape.head_dim) {
        return Some(format!(
            "{codec} rows: the device step reads plain f16 rows or hack2 rows with per-token keys and a head dimension that is a multiple of 64"
        ));
    }
    if zone.mode != attnstore_index::SelectionMode::PerKvHead {
        return Some("one selection per query head: the device step selects once per KV head".to_string());
    }
    if config.buffers.is_none() {
        return Some("no buffer manager: the device step reads rows homed in its Host arena".to_string());
    }
    (clusters == 0).then(|| "no clusters in the index yet".to_string())
}

impl Plan {
    /// Refuses GPU execution of a plan with a request whose codec's GPU kernels cannot serve
    /// it, before anything runs: an [`Error::NoGpuKernels`] naming the first. `kv43`'s kernel
    /// reads a layer's encoded rows from its device copy, every row or listed blocks of them
    /// (`GpuBackend::launch_kv43` / `launch_kv43_listed`): it serves host-made plans
    /// (`host_kv43`: the caller runs them on it), exact or with one selection per KV head,
    /// whose key groups and value blocks are whole 64-row blocks and whose head dimension is
    /// a multiple of 64.
    #[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code, reason = "the GPU path is built with cuda"))]
    pub(crate) fn check_gpu_codecs(&self, host_kv43: bool) -> Result<()> {
        for r in &self.requests {
            let Some(p) = r.codec.kv43() else { continue };
            let exact = r.heads.iter().all(|h| h.exact);
            let why = if !host_kv43 {
                "this GPU path has no kv43 kernels (Engine::execute_gpu runs host-made kv43 plans)".to_string()
            } else if r.device.is_some() {
                "kv43 rows have no device-selected step: plan on the host (Engine::plan) for Engine::execute_gpu"
                    .to_string()
            } else if !exact && r.heads.iter().any(|h| h.exact || h.selections.len() > 1) {
                "kv43's GPU kernels serve exact plans and plans of one selection per KV head \
                 (SelectionMode::PerKvHead)"
                    .to_string()
            } else if !p.key_group.is_multiple_of(64) || !p.value_block.is_multiple_of(64) {
                format!(
                    "kv43's GPU kernel needs key groups and value blocks of whole 64-row blocks, got {} and {}",
                    p.key_group, p.value_block
                )
            } else if !r.shape.head_dim.is_multiple_of(64) {
                format!("kv43's GPU kernel needs a head dimension that is a multiple of 64, got {}", r.shape.head_dim)
            } else {
                continue;
            };
            return Err(Error::NoGpuKernels { context: r.context, layer: r.layer, codec: r.codec, why });
        }
        Ok(())
    }
}

/// Whether the device step reads rows of `codec`: f16 rows, or `hack2` rows (HACK's
/// per-token keys, Π = 64) of a head dimension its kernels take (a multiple of 64).
fn device_codec(codec: Codec, head_dim: usize) -> bool {
    match codec {
        Codec::F16 => true,
        Codec::Hack2(p) => p == attnstore_kernels::HackParams::default() && head_dim.is_multiple_of(64),
        _ => false,
    }
}

/// Adds what a device-selected plan reads besides its steady zone: the centroids it scores,
/// the retrieved clusters' rows (average sizes) and the estimated clusters' mean values. The
/// tier of the retrieved rows is decided on the GPU; they are counted as host reads.
fn device_cost(c: &mut PlanCost, dev: &DeviceSelection, kv_heads: usize, row_bytes: usize, rows: RowBytes) {
    let (r, n) = (dev.clusters_per_head, dev.clusters);
    c.retrieve_clusters = r * kv_heads;
    c.retrieve_tokens = dev.retrieve_tokens * kv_heads;
    c.retrieve_bytes = rows.indexed_bytes(c.retrieve_tokens);
    c.kv_bytes += c.retrieve_bytes;
    c.estimate_clusters = (n - r) * kv_heads;
    c.estimate_tokens = (dev.indexed_tokens - dev.retrieve_tokens) * kv_heads;
    c.scored = n * kv_heads;
    c.meta_bytes = (n + n - r) * row_bytes * kv_heads;
    c.tier_bytes = [0, c.kv_bytes + c.meta_bytes, 0];
}

/// Bytes a sparse plan would read, before planning it: scoring meta data (centroids, or PQ
/// codes and codebooks), steady and retrieved KV (once per query head in per-query-head
/// mode, the worst case), estimated value means (wave only).
fn estimated_sparse_bytes(
    shape: &AttnShape,
    stats: &attnstore_index::IndexStats,
    zone: &ZoneBudget,
    rows: RowBytes,
    method: Method,
) -> usize {
    let row_bytes = rows.plain / 2;
    let readers = match zone.mode {
        attnstore_index::SelectionMode::PerQueryHead => shape.group(),
        attnstore_index::SelectionMode::PerKvHead => 1,
    };
    let indexed = stats.indexed_tokens;
    let steady = stats.tokens - indexed;
    let avg = (indexed as f64 / stats.clusters.max(1) as f64).max(1.0);
    let (scoring, est_clusters) = match method {
        Method::Pq(_) => (stats.index_bytes / shape.kv_heads.max(1), 0),
        _ => (stats.clusters * row_bytes, (zone.estimate_tokens.min(indexed) as f64 / avg) as usize),
    };
    let per_head = scoring
        + steady * rows.plain
        + rows.indexed_bytes(zone.retrieve_tokens.min(indexed) * readers)
        + est_clusters * row_bytes * readers;
    per_head * shape.kv_heads
}

/// Bytes of one token's K and V rows in one KV head: plain (steady zone) and as stored in
/// indexed units (encoded under the `hack2` codec).
#[derive(Debug, Clone, Copy)]
struct RowBytes {
    plain: usize,
    indexed: f64,
}

impl RowBytes {
    fn indexed_bytes(self, tokens: usize) -> usize {
        (tokens as f64 * self.indexed).ceil() as usize
    }
}

fn cost_of(
    heads: &[HeadPlan],
    blocks: &[crate::exec::HeadBlocks],
    tokens: usize,
    rows: RowBytes,
    exact_bytes: usize,
    config: &EngineConfig,
) -> PlanCost {
    let mut c = PlanCost { exact_bytes, ..PlanCost::default() };
    let row_bytes = rows.plain / 2;
    // Retrieved rows read from buffer-manager blocks: their row bytes, and block bytes per tier.
    let (mut buffered_rows, mut buffered_bytes) = (0, [0usize; 3]);
    for (h, head) in heads.iter().enumerate() {
        c.steady_tokens = head.steady_tokens;
        c.pending_tokens = head.pending_tokens;
        if head.exact {
            c.kv_bytes += head.steady_tokens * rows.plain + rows.indexed_bytes(tokens - head.steady_tokens.min(tokens));
            continue;
        }
        c.kv_bytes += head.steady_tokens * rows.plain;
        let (mut scored, mut scored_bytes) = (0, 0);
        for (i, s) in head.selections.iter().enumerate() {
            c.retrieve_clusters += s.retrieve_clusters;
            c.retrieve_tokens += s.retrieve_tokens;
            let recorded = blocks.get(h).and_then(|b| b.get(i)).map_or(&[][..], |b| &b[..]);
            if recorded.is_empty() {
                let blocks = s
                    .retrieve
                    .iter()
                    .map(|sp| 2 * config.block.blocks_for(rows.indexed_bytes(sp.len()).div_ceil(2)))
                    .sum::<usize>();
                c.retrieve_blocks += blocks;
                c.tier_blocks[Tier::Host as usize] += blocks;
            } else {
                let per_tier = crate::exec::blocks_per_tier(recorded);
                for (t, n) in per_tier.into_iter().enumerate() {
                    c.tier_blocks[t] += n;
                    buffered_bytes[t] += n * config.block.block_bytes();
                }
                c.retrieve_blocks += recorded.len();
                buffered_rows += rows.indexed_bytes(s.retrieve_tokens);
                c.buffered = true;
            }
            c.retrieve_bytes += rows.indexed_bytes(s.retrieve_tokens);
            c.kv_bytes += rows.indexed_bytes(s.retrieve_tokens);
            c.estimate_clusters += s.estimate.len();
            c.estimate_tokens += s.estimate_tokens;
            c.meta_bytes += s.estimate.len() * row_bytes;
            c.dropped_clusters += s.dropped_clusters;
            c.dropped_tokens += s.dropped_tokens;
            scored = scored.max(s.scored);
            scored_bytes = scored_bytes.max(s.scored_bytes);
        }
        // Centroids (keys, codes) of a head are read once per head, whatever the mode.
        c.scored += scored;
        c.meta_bytes += scored_bytes;
    }
    c.tier_bytes = buffered_bytes;
    c.tier_bytes[Tier::Host as usize] += c.kv_bytes + c.meta_bytes - buffered_rows;
    c
}

/// `1234567` → `"1.2 MB"`.
pub(crate) fn human_bytes(b: usize) -> String {
    let b = b as f64;
    match b {
        _ if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        _ if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        _ if b >= 1e3 => format!("{:.1} KB", b / 1e3),
        _ => format!("{b:.0} B"),
    }
}

#[cfg(test)]
mod tests {
    use crate::*;

    /// kv43's GPU kernels serve host-made plans, exact or of one selection per KV head: a
    /// plan of one selection per query head over a kv43 layer, or any kv43 plan on a GPU path
    /// without kv43 kernels, is refused with a typed error naming the layer, the codec and
    /// why; exact and per-KV-head kv43 plans and plain plans pass the check.
    #[test]
    fn a_kv43_plan_its_gpu_kernels_cannot_serve_is_refused_with_a_typed_error() {
        let shape = AttnShape::new(4, 1, 64).unwrap();
        let engine = Engine::in_memory(EngineConfig::default()).unwrap();
        let kv43 =
            engine.create_context(ContextSpec::new(shape, 1).with_codec(Codec::Kv43(Kv43Params::default()))).unwrap();
        let plain = engine.create_context(ContextSpec::new(shape, 1)).unwrap();
        let mut rng = attnstore_kernels::random::SplitMix64::new(2);
        let k: Vec<f32> = (0..3000 * 64).map(|_| rng.normal()).collect();
        let q: Vec<f32> = (0..4 * 64).map(|_| rng.normal()).collect();
        for ctx in [kv43, plain] {
            engine.prefill(ctx, 0, &k, &k).unwrap();
        }
        let requests = [Request::new(plain, 0, q.clone()), Request::new(kv43, 0, q.clone())];
        let exact = engine.plan(&requests, &Budget::full()).unwrap();
        assert!(exact.check_gpu_codecs(true).is_ok());
        let budget = Budget::default().with_retrieve_floor(0).with_retrieve(0.05).with_exact_threshold(2.0);
        let sparse = engine.plan(&requests, &budget).unwrap();
        assert!(sparse.requests[1].heads.iter().any(|h| !h.exact), "a 5% budget over 3000 rows is sparse");
        assert!(sparse.check_gpu_codecs(true).is_ok(), "one selection per KV head");
        let per_query = engine.plan(&requests, &budget.with_mode(SelectionMode::PerQueryHead)).unwrap();
        assert!(per_query.requests[1].heads.iter().any(|h| h.selections.len() > 1));
        for (plan, host_kv43, says) in
            [(&per_query, true, "one selection per KV head"), (&exact, false, "no kv43 kernels")]
        {
            match plan.check_gpu_codecs(host_kv43) {
                Err(e @ Error::NoGpuKernels { context, layer: 0, codec: Codec::Kv43(_), .. }) if context == kv43 => {
                    assert!(e.to_string().contains(says), "{e}");
                    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
                }
                other => panic!("expected NoGpuKernels for the kv43 request, got {other:?}"),
            }
        }
        let plan = engine
            .plan(
                &requests[..1],
                &Budget::default().with_retrieve_floor(0).with_retrieve(0.05).with_exact_threshold(2.0),
            )
            .unwrap();
        assert!(plan.check_gpu_codecs(false).is_ok());
    }
}
