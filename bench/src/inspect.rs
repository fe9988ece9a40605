//! `attnstore inspect`: one synthetic wave context served twice in the same run — rows kept
//! in the index, and rows homed in the buffer manager — decode steps planned and executed on
//! both (same queries, interleaved), then the buffer manager's tier statistics.

use crate::memory;
use crate::plot::TierSample;
use crate::report::Row;
use crate::synth::{SynthContext, SynthParams};
use crate::Result;
use attnstore::{
    AttnShape, BlockLayout, Budget, BufferSettings, BufferStats, Codec, ContextId, ContextSpec, DType, Engine,
    EngineConfig, Method, Plan, Request,
};
use attnstore_kernels::HackView;
use indicatif::{ProgressBar, ProgressStyle};
use std::time::Instant;

/// Settings of [`run`].
#[derive(Debug, Clone)]
pub struct InspectConfig {
    /// Context length.
    pub tokens: usize,
    /// Heads and head dimension.
    pub shape: AttnShape,
    /// Codec of the stored rows (`hack2`: the buffer manager homes them in 2-bit form).
    pub codec: Codec,
    /// Sparse decode steps (distinct queries).
    pub steps: usize,
    /// Of those, steps that also run an exact (full-budget) plan on both engines.
    pub exact_steps: usize,
    /// The sparse budget.
    pub budget: Budget,
    /// The buffer manager; `host_blocks == 0` sizes the arena to hold the whole context.
    pub buffers: BufferSettings,
    /// Block size of the buffer manager.
    pub block: BlockLayout,
    /// Seed of the synthetic data.
    pub seed: u64,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

impl InspectConfig {
    /// Bytes a run of these settings over `tokens` tokens holds at its peak (see
    /// [`memory::run_bytes`]): the synthetic f32 keys and values, the wave context
    /// with its rows in the index, and the buffered one: its index, and the Host and Gpu
    /// arenas as far as the context fills them (a Host arena that holds the whole context
    /// rounds every cluster up to whole blocks: about twice the rows). Measured: peak RSS of
    /// `attnstore inspect --tokens 128K` 3.78 GiB, estimated 4.0 GiB. `None` past `u64`.
    pub fn bytes_needed(&self, tokens: usize) -> Option<u64> {
        let block = self.block.block_bytes();
        let whole = blocks_for_codec(&self.shape, self.codec, tokens, block);
        let host = match self.buffers.host_blocks {
            0 => whole,
            n => n.min(whole),
        };
        let arenas = (host as u64).checked_add(self.buffers.gpu_blocks as u64)?.checked_mul(block as u64)?;
        let in_index = memory::context_bytes(&self.shape, self.codec, &Method::default(), tokens)?;
        let plain_rows = memory::context_bytes(&self.shape, self.codec, &Method::Flat, tokens)?;
        let buffered = in_index.saturating_sub(plain_rows).checked_add(arenas)?;
        memory::run_bytes(&self.shape, tokens, in_index.checked_add(buffered))
    }
}

/// What [`run`] measured.
#[derive(Debug, Clone)]
pub struct InspectReport {
    /// Timing rows: prefill, sparse and exact decode, rows in the index vs in the buffer manager.
    pub rows: Vec<Row>,
    /// EXPLAIN of the last sparse plan over the buffered context.
    pub explain: String,
    /// The buffer manager's statistics at the end.
    pub stats: BufferStats,
    /// Largest relative L2 difference between the two engines' outputs (0 when identical).
    pub max_rel_diff: f64,
    /// Per decode step, the buffered engine's hits and misses per tier during the step.
    pub tier_steps: Vec<TierSample>,
}

/// Host blocks that hold all indexed rows of a context: per cluster, K and V each round up
/// to whole blocks (clusters average 16 tokens, so ≤ tokens / 16 + segments partial blocks).
pub fn blocks_for_context(shape: &AttnShape, dtype: DType, tokens: usize, block_bytes: usize) -> usize {
    let per_block = (block_bytes / (shape.head_dim * dtype.size_bytes())).max(1);
    let per_head = tokens.div_ceil(per_block) + tokens / 8 + 64;
    2 * per_head * shape.kv_heads
}

/// Host blocks that hold all indexed rows of a context of `codec`: as
/// [`blocks_for_context`] for plain rows; for `hack2`, per value block of Π rows its 2-bit
/// bytes rounded up to whole blocks (one short block per segment besides).
pub fn blocks_for_codec(shape: &AttnShape, codec: Codec, tokens: usize, block_bytes: usize) -> usize {
    let Some(params) = codec.hack() else {
        return blocks_for_context(shape, codec.plain_dtype(), tokens, block_bytes);
    };
    let p = params.partition;
    let per_group = HackView::group_len(shape.head_dim, params, p).div_ceil(block_bytes.max(1));
    let groups = tokens.div_ceil(p) + tokens / 1024 + 8;
    groups * per_group * shape.kv_heads
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(f64::NAN)
}

fn timed(
    engine: &Engine,
    ctx: ContextId,
    q: &[f32],
    budget: &Budget,
    times: &mut Vec<f64>,
) -> Result<(Vec<f32>, Plan)> {
    let t = Instant::now();
    let plan = engine.plan(&[Request::new(ctx, 0, q.to_vec())], budget)?;
    let out = engine.execute(&plan)?.remove(0);
    times.push(t.elapsed().as_secs_f64() * 1e6);
    Ok((out, plan))
}

fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        num += (f64::from(*x) - f64::from(*y)).powi(2);
        den += f64::from(*y).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Each tier's hits and misses between two snapshots of the statistics.
fn tier_delta(step: usize, before: &BufferStats, after: &BufferStats) -> TierSample {
    let tiers = after
        .tiers
        .iter()
        .map(|t| {
            let (hits, misses) = before.tier(t.tier).map_or((0, 0), |b| (b.hits, b.misses));
            (t.tier.name(), t.hits.saturating_sub(hits), t.misses.saturating_sub(misses))
        })
        .collect();
    TierSample { step, tiers }
}

/// Runs the comparison (see the module docs).
pub fn run(cfg: &InspectConfig) -> Result<InspectReport> {
    let config = EngineConfig { block: cfg.block, ..EngineConfig::default() };
    let mut settings = cfg.buffers.clone();
    if settings.host_blocks == 0 {
        settings.host_blocks = blocks_for_codec(&cfg.shape, cfg.codec, cfg.tokens, config.block.block_bytes());
        settings.gpu_blocks = settings.host_blocks / 20;
    }
    let plain = Engine::in_memory(config.clone())?;
    let buffered = Engine::in_memory(EngineConfig { buffers: Some(settings), ..config })?;
    let synth = SynthContext::generate(SynthParams::new(cfg.shape, cfg.tokens, cfg.seed));
    let spec = ContextSpec::new(cfg.shape, 1).with_codec(cfg.codec);
    let mut prefill = [0.0; 2];
    let mut ctxs = [ContextId(0); 2];
    for (i, engine) in [&plain, &buffered].into_iter().enumerate() {
        ctxs[i] = engine.create_context(spec.clone())?;
        let t = Instant::now();
        engine.prefill(ctxs[i], 0, &synth.keys, &synth.values)?;
        prefill[i] = t.elapsed().as_secs_f64() * 1e6;
    }
    let pb = if cfg.progress { ProgressBar::new(cfg.steps as u64) } else { ProgressBar::hidden() };
    if let Ok(style) = ProgressStyle::with_template("decode steps [{bar:30}] {pos}/{len} ({elapsed})") {
        pb.set_style(style.progress_chars("=> "));
    }
    let (mut sparse, mut exact) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    let mut max_rel_diff = 0.0f64;
    let mut explain = String::new();
    let mut tier_steps = Vec::with_capacity(cfg.steps);
    for step in 0..cfg.steps {
        let q = synth.queries(step as u64);
        let mut runs: Vec<(usize, &Budget)> = vec![(0, &cfg.budget), (1, &cfg.budget)];
        let full = Budget::full();
        if step < cfg.exact_steps {
            runs.extend([(2, &full), (3, &full)]);
        }
        // Alternate which engine goes first, so neither always finds the caches warm.
        if step % 2 == 1 {
            runs.swap(0, 1);
            if runs.len() == 4 {
                runs.swap(2, 3);
            }
        }
        let mut outs: [Vec<f32>; 4] = Default::default();
        let before = buffered.buffer_stats();
        for (which, budget) in runs {
            let (engine, times) = match which {
                0 => (&plain, &mut sparse[0]),
                1 => (&buffered, &mut sparse[1]),
                2 => (&plain, &mut exact[0]),
                _ => (&buffered, &mut exact[1]),
            };
            let (out, plan) = timed(engine, ctxs[which % 2], &q, budget, times)?;
            if which == 1 {
                explain = plan.explain();
            }
            outs[which] = out;
        }
        if let (Some(a), Some(b)) = (before, buffered.buffer_stats()) {
            tier_steps.push(tier_delta(step, &a, &b));
        }
        max_rel_diff = max_rel_diff.max(rel_diff(&outs[1], &outs[0]));
        if step < cfg.exact_steps {
            max_rel_diff = max_rel_diff.max(rel_diff(&outs[3], &outs[2]));
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    let stats = buffered.buffer_stats().expect("configured with a buffer manager");
    let mut rows = Vec::new();
    let mut row = |what: &str, times: &mut [Vec<f64>; 2]| {
        let [a, b] = times;
        a.sort_by(f64::total_cmp);
        b.sort_by(f64::total_cmp);
        for (method, t, base) in [("rows-in-index", &*a, &*a), ("rows-in-buffer-manager", &*b, &*a)] {
            if t.is_empty() {
                continue;
            }
            let mut r = Row::new("inspect", method);
            r.set("what", what)
                .set("tokens", cfg.tokens as u64)
                .set("steps", t.len() as u64)
                .set("p50_us", percentile(t, 0.5))
                .set("p99_us", percentile(t, 0.99))
                .set("baseline", "rows-in-index")
                .set("ratio_p50", percentile(t, 0.5) / percentile(base, 0.5));
            rows.push(r);
        }
    };
    row("sparse decode", &mut sparse);
    row("exact decode", &mut exact);
    for (method, us) in [("rows-in-index", prefill[0]), ("rows-in-buffer-manager", prefill[1])] {
        let mut r = Row::new("inspect", method);
        r.set("what", "prefill")
            .set("tokens", cfg.tokens as u64)
            .set("steps", 1u64)
            .set("p50_us", us)
            .set("p99_us", us)
            .set("baseline", "rows-in-index")
            .set("ratio_p50", us / prefill[0]);
        rows.push(r);
    }
    // For an installed metrics recorder (`attnstore inspect --prometheus`): the buffered
    // engine's tiers as they ended.
    buffered.publish_metrics();
    Ok(InspectReport { rows, explain, stats, max_rel_diff, tier_steps })
}
