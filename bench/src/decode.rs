//! `attnstore bench`: exact CPU attention (with its memory-bandwidth ceiling) against the
//! sparse plans of the wave and PQ indexes and an oracle exact top-k, all in the same run,
//! on synthetic contexts. Prints ratios against same-run baselines plus absolute figures (BENCH.md).

use crate::memory;
use crate::report::Row;
use crate::synth::{SynthContext, SynthParams};
use crate::Result;
use attnstore::{
    AttnShape, Budget, Codec, ContextId, ContextSpec, DType, Engine, EngineConfig, EstimateShare, Method, PqParams,
    Request, SelectionMode, WaveParams,
};
use attnstore_kernels::cpu::attention::exact_attention;
use attnstore_kernels::cpu::reference::{reference_attention, rel_l2};
use attnstore_kernels::cpu::scoring::{score_group, score_rows, top_r};
use attnstore_kernels::{narrow_vec, Element, HeadsView};
use half::{bf16, f16};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use std::collections::HashSet;
use std::time::Instant;

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Context lengths.
    pub tokens: Vec<usize>,
    /// Heads and head dimension.
    pub shape: AttnShape,
    /// Storage type of the exact baseline (and of plain contexts).
    pub dtype: DType,
    /// Codec of the wave and PQ contexts; with `hack2` the bench also times exact attention
    /// over the 2-bit rows against the plain exact baseline.
    pub codec: Codec,
    /// Decode steps (distinct queries) per configuration.
    pub queries: usize,
    /// Timed repetitions per query (median reported).
    pub reps: usize,
    /// Retrieval fraction.
    pub retrieve: f64,
    /// Retrieval floor in tokens.
    pub retrieve_floor: usize,
    /// Budget scales: every sparse method and the oracle run once per scale, with the
    /// retrieval fraction and floor multiplied by it (the points of the accuracy/cost
    /// frontier). Each positive; `[1.0]` measures the budget as given.
    pub scales: Vec<f64>,
    /// Estimation shares to compare.
    pub estimates: Vec<EstimateShare>,
    /// Selection modes to compare.
    pub modes: Vec<SelectionMode>,
    /// Seed of the synthetic data.
    pub seed: u64,
    /// Show progress bars on stderr.
    pub progress: bool,
    /// Access methods to measure (the oracle top-k always runs).
    pub methods: Vec<BenchMethod>,
    /// Time budget for the PQ codebook build (adaptive iteration limit); `None`: the cap.
    pub pq_build_budget: Option<std::time::Duration>,
}

/// An access method `attnstore bench` can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchMethod {
    /// The wave index (RetroInfer).
    Wave,
    /// The PQ index (PQCache).
    Pq,
}

impl BenchConfig {
    /// Bytes a run over `tokens` tokens holds at its peak (see [`memory::run_bytes`]): the
    /// synthetic f32 keys and values, their copies in the baseline's type, the memory-read
    /// baseline's buffer of the same size (freed before the engine's contexts are made),
    /// and the flat, wave and PQ contexts the methods measured need. `None` past `u64`.
    pub fn bytes_needed(&self, tokens: usize) -> Option<u64> {
        let shape = &self.shape;
        let f32_kv = SynthParams::new(*shape, tokens, self.seed).kv_bytes()?;
        let copies = f32_kv / 4 * self.dtype.size_bytes() as u64;
        let stored = |codec: Codec, method: Method| memory::context_bytes(shape, codec, &method, tokens);
        let mut contexts = stored(Codec::from(self.dtype), Method::Flat)?;
        if self.methods.contains(&BenchMethod::Wave) || self.codec.is_encoded() {
            contexts = contexts.checked_add(stored(self.codec, Method::Wave(WaveParams::default()))?)?;
        }
        if self.methods.contains(&BenchMethod::Pq) {
            contexts = contexts.checked_add(stored(self.codec, Method::Pq(PqParams::default()))?)?;
        }
        memory::run_bytes(shape, tokens, copies.checked_add(copies.max(contexts)))
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

fn time_us(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e6
}

/// Runs every configuration; `emit` receives each row as soon as it is measured.
pub fn run(cfg: &BenchConfig, emit: &mut dyn FnMut(&Row)) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &tokens in &cfg.tokens {
        let mut sink = |r: Row| {
            emit(&r);
            rows.push(r);
        };
        match cfg.dtype {
            DType::F32 => run_length::<f32>(cfg, tokens, &mut sink)?,
            DType::F16 => run_length::<f16>(cfg, tokens, &mut sink)?,
            DType::Bf16 => run_length::<bf16>(cfg, tokens, &mut sink)?,
        }
    }
    Ok(rows)
}

fn progress(cfg: &BenchConfig, tokens: usize, steps: usize) -> ProgressBar {
    if !cfg.progress {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(steps as u64);
    if let Ok(style) = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_prefix(format!("{tokens} tokens"));
    pb
}

/// Sums a buffer with all threads: the plain memory-read ceiling for streaming `bytes`.
fn memread_us(buf: &[u64], reps: usize) -> f64 {
    median(
        (0..reps)
            .map(|_| {
                time_us(|| {
                    let s = buf
                        .par_chunks(1 << 16)
                        .map(|c| c.iter().fold(0u64, |a, x| a.wrapping_add(*x)))
                        .reduce(|| 0, u64::wrapping_add);
                    std::hint::black_box(s);
                })
            })
            .collect(),
    )
}

/// A row with a time, its same-run baseline and their ratio.
fn timed_row(
    cfg: &BenchConfig,
    (bench, method, tokens): (&str, &str, usize),
    time_us: f64,
    baseline: &str,
    baseline_us: f64,
) -> Row {
    let mut r = base_row(cfg, bench, method, tokens);
    r.set("time_us", time_us)
        .set("baseline", baseline)
        .set("baseline_time_us", baseline_us)
        .set("speedup", baseline_us / time_us);
    r
}

fn base_row(cfg: &BenchConfig, bench: &str, method: &str, tokens: usize) -> Row {
    let mut r = Row::new(bench, method);
    r.set("tokens", tokens)
        .set("batch", 1)
        .set("q_heads", cfg.shape.q_heads)
        .set("kv_heads", cfg.shape.kv_heads)
        .set("head_dim", cfg.shape.head_dim)
        .set("dtype", cfg.dtype.name())
        .set("codec", cfg.codec.to_string());
    r
}

fn run_length<E: Element>(cfg: &BenchConfig, tokens: usize, emit: &mut dyn FnMut(Row)) -> Result<()> {
    let shape = cfg.shape;
    let (d, reps) = (shape.head_dim, cfg.reps.max(1));
    let combos: Vec<(SelectionMode, EstimateShare)> =
        cfg.modes.iter().flat_map(|&m| cfg.estimates.iter().map(move |&e| (m, e))).collect();
    let wave_runs = if cfg.methods.contains(&BenchMethod::Wave) { combos.len() } else { 0 };
    let pq_runs = if cfg.methods.contains(&BenchMethod::Pq) { cfg.modes.len() } else { 0 };
    let scales = cfg.scales.len();
    let pb =
        progress(cfg, tokens, 6 + cfg.queries + scales * (cfg.queries * (wave_runs + pq_runs) + 1 + pq_runs.min(1)));
    pb.set_message("generating synthetic KV");
    let synth = SynthContext::generate(SynthParams::new(shape, tokens, cfg.seed));
    let queries: Vec<Vec<f32>> = (0..cfg.queries as u64).map(|i| synth.queries(i)).collect();
    let kb: Vec<E> = narrow_vec(&synth.keys);
    let vb: Vec<E> = narrow_vec(&synth.values);
    let kview = HeadsView::new(&kb, shape.kv_heads, tokens, d)?;
    let vview = HeadsView::new(&vb, shape.kv_heads, tokens, d)?;
    let kv_bytes = 2 * shape.kv_len(tokens) * E::DTYPE.size_bytes();
    pb.inc(1);

    pb.set_message("memory-read baseline and exact attention, interleaved");
    // Every speed is a ratio against a baseline timed in the same loop, interleaved rep by
    // rep, so that the noise of a shared machine hits both alike.
    let buf: Vec<u64> = (0..kv_bytes / 8).map(|i| i as u64).collect();
    let exact_once = |q: &[f32]| {
        time_us(|| {
            std::hint::black_box(exact_attention(&shape, q, kview, vview).ok());
        })
    };
    let (mut mem_samples, mut samples) = (Vec::new(), Vec::new());
    for q in &queries {
        for _ in 0..reps {
            mem_samples.push(memread_us(&buf, 1));
            samples.push(exact_once(q));
        }
    }
    drop(buf);
    let mem_us = median(mem_samples);
    let mut r = base_row(cfg, "memread", "sum", tokens);
    r.set("time_us", mem_us).set("gbps", kv_bytes as f64 / mem_us / 1e3).set("bytes_host", kv_bytes);
    emit(r);
    pb.inc(1);
    let exact_us = median(samples);
    let mut r = timed_row(cfg, ("decode", "exact", tokens), exact_us, "memread", mem_us);
    r.set("gbps", kv_bytes as f64 / exact_us / 1e3).set("exact_tokens", tokens).set("bytes_host", kv_bytes);
    emit(r);
    pb.inc(1);

    pb.set_message("index build (wave prefill)");
    let engine = Engine::in_memory(EngineConfig::default())?;
    let spec = ContextSpec::new(shape, 1).with_dtype(cfg.dtype);
    let coded = spec.clone().with_codec(cfg.codec);
    let wave = engine.create_context(coded.clone().with_method(Method::Wave(WaveParams::default())))?;
    if cfg.methods.contains(&BenchMethod::Wave) || cfg.codec.is_encoded() {
        measure_wave_build(cfg, &engine, wave, &synth, tokens, emit)?;
    }
    pb.inc(1);
    let flat = engine.create_context(spec.with_method(Method::Flat))?;
    engine.prefill(flat, 0, &synth.keys, &synth.values)?;
    pb.inc(1);

    let mut references = Vec::new();
    for q in &queries {
        pb.set_message("f64 reference attention");
        references.push(reference_attention(&shape, q, kview, vview, None));
        pb.inc(1);
    }

    let ctx = Inputs { engine: &engine, shape, queries: &queries, references: &references, kview, vview, reps };
    if cfg.codec.is_encoded() {
        pb.set_message(format!("exact attention over {} rows", cfg.codec));
        let run = measure_sparse(&ctx, wave, &Budget::full(), &exact_once, &pb)?;
        let mut r = base_row(cfg, "decode", "exact_hack2", tokens);
        run.fill(&mut r);
        emit(r);
    }
    let pq = if cfg.methods.contains(&BenchMethod::Pq) {
        pb.set_message("index build (pq, background k-means)");
        Some(build_pq(cfg, &engine, &coded, &synth, tokens, emit)?)
    } else {
        None
    };
    pb.inc(1);
    for (i, &scale) in cfg.scales.iter().enumerate() {
        let (retrieve, floor) = (cfg.retrieve * scale, (cfg.retrieve_floor as f64 * scale).round() as usize);
        let scaled = Budget::default().with_retrieve(retrieve).with_retrieve_floor(floor);
        let mut default_exact_tokens = None;
        if cfg.methods.contains(&BenchMethod::Wave) {
            for &(mode, share) in &combos {
                pb.set_message(format!("wave {} estimate {} (scale {scale})", mode.name(), share_name(share)));
                let run = measure_sparse(&ctx, wave, &scaled.with_mode(mode).with_estimate(share), &exact_once, &pb)?;
                default_exact_tokens.get_or_insert(run.exact_tokens.round() as usize);
                let mut r = base_row(cfg, "decode", "wave", tokens);
                r.set("selection", mode.name())
                    .set("retrieve_frac", retrieve)
                    .set("estimate_frac", share_value(share))
                    .set("scale", scale);
                run.fill(&mut r);
                emit(r);
            }
        }
        // Every method attends the same number of tokens exactly: what the first wave plan
        // did, or the steady zone plus the retrieval budget when wave is not measured.
        let steady = WaveParams::default().sink_tokens + WaveParams::default().local_tokens;
        let n = default_exact_tokens.unwrap_or_else(|| steady + scaled.resolve(tokens).retrieve_tokens);
        let top_n = Budget::default()
            .with_retrieve(0.0)
            .with_retrieve_floor(n.saturating_sub(steady))
            .with_estimate(EstimateShare::Fraction(0.0));
        if let Some(pq) = pq {
            if i == 0 {
                pb.set_message("pq scoring + top-k vs exact q·k scores");
                measure_pq_scoring(cfg, &ctx, pq, &top_n, n, tokens, emit)?;
            }
            pb.inc(1);
            for &mode in &cfg.modes {
                pb.set_message(format!("pq {} (scale {scale})", mode.name()));
                let run = measure_sparse(&ctx, pq, &top_n.with_mode(mode), &exact_once, &pb)?;
                let mut r = base_row(cfg, "decode", "pq", tokens);
                r.set("selection", mode.name()).set("scale", scale);
                run.fill(&mut r);
                emit(r);
            }
        }
        pb.set_message(format!("oracle top-k (flat index, scale {scale})"));
        let mut r = measure_oracle(cfg, &ctx, flat, n, &exact_once, tokens)?;
        r.set("scale", scale);
        emit(r);
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(())
}

/// Creates the PQ context, prefills it, waits for its codebooks and reports the build.
fn build_pq(
    cfg: &BenchConfig,
    engine: &Engine,
    coded: &ContextSpec,
    synth: &SynthContext,
    tokens: usize,
    emit: &mut dyn FnMut(Row),
) -> Result<ContextId> {
    let params = PqParams { build_budget: cfg.pq_build_budget, ..PqParams::default() };
    let pq = engine.create_context(coded.clone().with_method(Method::Pq(params)))?;
    let started = Instant::now();
    engine.prefill(pq, 0, &synth.keys, &synth.values)?;
    let returned_us = started.elapsed().as_secs_f64() * 1e6;
    engine.wait_index(pq, 0, std::time::Duration::from_secs(3600))?;
    let ready_us = started.elapsed().as_secs_f64() * 1e6;
    let stats = engine.stats(pq, 0)?;
    let mut r = base_row(cfg, "index_build", "pq", tokens);
    r.set("time_us", ready_us)
        .set("prefill_return_us", returned_us)
        .set("us_per_1k_tokens", ready_us / (tokens as f64 / 1000.0))
        .set("index_bytes", stats.index_bytes)
        .set("index_bytes_per_token_head", stats.index_bytes as f64 / (tokens * cfg.shape.kv_heads) as f64)
        .set("kv_bytes", stats.kv_bytes)
        .set("index_frac", stats.index_bytes as f64 / stats.kv_bytes.max(1) as f64);
    if let Some(b) = engine.index_build(pq, 0)? {
        r.set("subspaces", b.layout.subspaces)
            .set("bits", b.layout.bits)
            .set("train_rows", b.train_rows)
            .set("iters_limit", b.iters_limit)
            .set("iters_run", b.iters_run)
            .set("converged_jobs", b.converged_jobs)
            .set("jobs", b.jobs);
        if let (Some(budget), Some(pred)) = (b.budget, b.predicted) {
            r.set("build_budget_us", budget.as_secs_f64() * 1e6).set("predicted_us", pred.as_secs_f64() * 1e6);
        }
    }
    emit(r);
    Ok(pq)
}

/// Times PQ's planning (scoring every key through the codebooks and a top-`n`) against
/// exact q·k scores of every key, interleaved.
fn measure_pq_scoring<E: Element>(
    cfg: &BenchConfig,
    inp: &Inputs<'_, E>,
    pq: ContextId,
    budget: &Budget,
    n: usize,
    tokens: usize,
    emit: &mut dyn FnMut(Row),
) -> Result<()> {
    let (shape, d) = (inp.shape, inp.shape.head_dim);
    let req = |q: &Vec<f32>| [Request::new(pq, 0, q.clone())];
    let (mut pq_samples, mut exact_samples) = (vec![], vec![]);
    let scale = 1.0 / (d as f32).sqrt();
    for q in inp.queries {
        for _ in 0..inp.reps {
            exact_samples.push(time_us(|| {
                let g = shape.group();
                let scores: Vec<usize> = (0..shape.kv_heads)
                    .into_par_iter()
                    .map(|h| {
                        let mut out = vec![Vec::new(); g];
                        score_group(&q[h * g * d..(h + 1) * g * d], g, inp.kview.head(h), scale, &mut out);
                        out.len()
                    })
                    .collect();
                std::hint::black_box(scores);
            }));
            let mut plan = None;
            pq_samples.push(time_us(|| plan = Some(inp.engine.plan(&req(q), budget))));
            plan.transpose()?;
        }
    }
    let (pq_us, exact_us) = (median(pq_samples), median(exact_samples));
    let mut r = timed_row(cfg, ("scoring", "pq", tokens), pq_us, "exact_scores", exact_us);
    r.set("selection", SelectionMode::PerKvHead.name()).set("exact_tokens", n);
    emit(r);
    Ok(())
}

/// The oracle: an exact top-`n` of the true scores over the flat context, timed against
/// exact attention, its error against the f64 references.
fn measure_oracle<E: Element>(
    cfg: &BenchConfig,
    inp: &Inputs<'_, E>,
    flat: ContextId,
    n: usize,
    exact_once: &dyn Fn(&[f32]) -> f64,
    tokens: usize,
) -> Result<Row> {
    let budget =
        Budget::default().with_retrieve(0.0).with_retrieve_floor(n).with_estimate(EstimateShare::Fraction(0.0));
    let (mut samples, mut errs, mut base_samples) = (vec![], vec![], vec![]);
    for (q, reference) in inp.queries.iter().zip(inp.references) {
        let req = [Request::new(flat, 0, q.clone())];
        let mut out = Vec::new();
        for _ in 0..inp.reps {
            base_samples.push(exact_once(q));
            let t = Instant::now();
            let plan = inp.engine.plan(&req, &budget)?;
            out = inp.engine.execute(&plan)?;
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
        errs.push(rel_l2(&out[0], reference));
    }
    let mut r = timed_row(cfg, ("decode", "oracle_topk", tokens), median(samples), "exact", median(base_samples));
    r.set("selection", SelectionMode::PerQueryHead.name())
        .set("rel_l2_error", errs.iter().sum::<f64>() / errs.len().max(1) as f64)
        .set("recall", 1.0)
        .set("exact_tokens", n);
    Ok(r)
}

/// Prefills the wave context (building its index before returning) and reports the build.
fn measure_wave_build(
    cfg: &BenchConfig,
    engine: &Engine,
    wave: ContextId,
    synth: &SynthContext,
    tokens: usize,
    emit: &mut dyn FnMut(Row),
) -> Result<()> {
    let started = Instant::now();
    engine.prefill(wave, 0, &synth.keys, &synth.values)?;
    let build_us = started.elapsed().as_secs_f64() * 1e6;
    let stats = engine.stats(wave, 0)?;
    let mut r = base_row(cfg, "index_build", "wave", tokens);
    r.set("time_us", build_us)
        .set("us_per_1k_tokens", build_us / (tokens as f64 / 1000.0))
        .set("index_bytes", stats.index_bytes)
        .set("kv_bytes", stats.kv_bytes)
        .set("index_frac", stats.index_bytes as f64 / stats.kv_bytes.max(1) as f64)
        .set("segments", stats.segments)
        .set("clusters", stats.clusters);
    emit(r);
    Ok(())
}

/// What every sparse measurement shares.
struct Inputs<'a, E> {
    engine: &'a Engine,
    shape: AttnShape,
    queries: &'a [Vec<f32>],
    references: &'a [Vec<f64>],
    kview: HeadsView<'a, E>,
    vview: HeadsView<'a, E>,
    reps: usize,
}

/// Medians and means of one sparse configuration over all queries.
struct SparseRun {
    us: f64,
    plan_us: f64,
    execute_us: f64,
    base_us: f64,
    err: f64,
    oracle_err: f64,
    recall: f64,
    exact_tokens: f64,
    bytes: usize,
}

impl SparseRun {
    fn fill(&self, r: &mut Row) {
        r.set("time_us", self.us)
            .set("plan_us", self.plan_us)
            .set("execute_us", self.execute_us)
            .set("baseline", "exact")
            .set("baseline_time_us", self.base_us)
            .set("speedup", self.base_us / self.us)
            .set("rel_l2_error", self.err)
            .set("oracle_rel_l2_error", self.oracle_err)
            .set("recall", self.recall)
            .set("exact_tokens", self.exact_tokens.round())
            .set("bytes_host", self.bytes)
            .set("bytes_gpu", 0)
            .set("bytes_disk", 0);
    }
}

/// Times plan + execute of `ctx` under `budget` interleaved with exact attention, and
/// measures the output error against f64, the error of an oracle top-k attending as many
/// tokens exactly, and the recall of the true top-k.
fn measure_sparse<E: Element>(
    inp: &Inputs<'_, E>,
    ctx: ContextId,
    budget: &Budget,
    exact_once: &dyn Fn(&[f32]) -> f64,
    pb: &ProgressBar,
) -> Result<SparseRun> {
    let (shape, d) = (inp.shape, inp.shape.head_dim);
    let (mut samples, mut errs, mut oracle_errs, mut recalls, mut exact_tok, mut bytes) =
        (vec![], vec![], vec![], vec![], vec![], 0);
    let (mut plan_samples, mut exec_samples, mut base_samples) = (vec![], vec![], vec![]);
    for (q, reference) in inp.queries.iter().zip(inp.references) {
        let req = [Request::new(ctx, 0, q.clone())];
        let mut out = Vec::new();
        let mut last_plan = None;
        for _ in 0..inp.reps {
            base_samples.push(exact_once(q));
            let t = Instant::now();
            let plan = inp.engine.plan(&req, budget)?;
            let planned = t.elapsed().as_secs_f64() * 1e6;
            out = inp.engine.execute(&plan)?;
            let total = t.elapsed().as_secs_f64() * 1e6;
            samples.push(total);
            plan_samples.push(planned);
            exec_samples.push(total - planned);
            last_plan = Some(plan);
        }
        let Some(plan) = last_plan else { continue };
        errs.push(rel_l2(&out[0], reference));
        bytes = plan.requests[0].cost.total_bytes();
        // Oracle: the true top-N tokens of every query head, N = what the plan attends exactly.
        let mut subsets = Vec::with_capacity(shape.q_heads);
        let mut recall = 0.0;
        let mut scores = Vec::new();
        for j in 0..shape.q_heads {
            let attended = inp.engine.exact_positions(&plan, 0, j)?;
            let n = attended.len();
            exact_tok.push(n as f64);
            score_rows(&q[j * d..(j + 1) * d], inp.kview.head(j / shape.group()), 1.0 / (d as f32).sqrt(), &mut scores);
            let top = top_r(&scores, n);
            let set: HashSet<u32> = top.iter().copied().collect();
            recall += attended.iter().filter(|t| set.contains(t)).count() as f64 / n.max(1) as f64;
            subsets.push(top);
        }
        recalls.push(recall / shape.q_heads as f64);
        let oracle: Vec<f32> =
            reference_attention(&shape, q, inp.kview, inp.vview, Some(&subsets)).iter().map(|&x| x as f32).collect();
        oracle_errs.push(rel_l2(&oracle, reference));
        pb.inc(1);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Ok(SparseRun {
        us: median(samples),
        plan_us: median(plan_samples),
        execute_us: median(exec_samples),
        base_us: median(base_samples),
        err: mean(&errs),
        oracle_err: mean(&oracle_errs),
        recall: mean(&recalls),
        exact_tokens: mean(&exact_tok),
        bytes,
    })
}

fn share_value(share: EstimateShare) -> serde_json::Value {
    match share {
        EstimateShare::Fraction(f) => f.into(),
        EstimateShare::Rest => "rest".into(),
    }
}

/// `0.232` or `rest`.
fn share_name(share: EstimateShare) -> String {
    match share {
        EstimateShare::Fraction(f) => format!("{f}"),
        EstimateShare::Rest => "rest".into(),
    }
}
