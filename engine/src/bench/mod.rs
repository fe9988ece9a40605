//! `attnstore bench`: exact CPU attention (with its memory-bandwidth ceiling) against the
//! wave index's sparse plans and an oracle exact top-k, all in the same run, on synthetic
//! contexts. Prints ratios against same-run baselines plus absolute figures (BENCH.md).

mod report;

pub use report::{table, Row};

use crate::budget::{Budget, EstimateShare};
use crate::engine::{Engine, EngineConfig};
use crate::error::Result;
use crate::plan::Request;
use crate::spec::{ContextSpec, Method};
use crate::synth::{SynthContext, SynthParams};
use crate::WaveParams;
use attnstore_index::SelectionMode;
use attnstore_kernels::cpu::attention::exact_attention;
use attnstore_kernels::cpu::reference::{reference_attention, rel_l2};
use attnstore_kernels::cpu::scoring::{score_rows, top_r};
use attnstore_kernels::{narrow_vec, AttnShape, DType, Element, HeadsView};
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
    /// Storage type.
    pub dtype: DType,
    /// Decode steps (distinct queries) per configuration.
    pub queries: usize,
    /// Timed repetitions per query (median reported).
    pub reps: usize,
    /// Retrieval fraction.
    pub retrieve: f64,
    /// Retrieval floor in tokens.
    pub retrieve_floor: usize,
    /// Estimation shares to compare.
    pub estimates: Vec<EstimateShare>,
    /// Selection modes to compare.
    pub modes: Vec<SelectionMode>,
    /// Seed of the synthetic data.
    pub seed: u64,
    /// Show progress bars on stderr.
    pub progress: bool,
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

fn base_row(cfg: &BenchConfig, bench: &str, method: &str, tokens: usize) -> Row {
    let mut r = Row::new(bench, method);
    r.set("tokens", tokens)
        .set("batch", 1)
        .set("q_heads", cfg.shape.q_heads)
        .set("kv_heads", cfg.shape.kv_heads)
        .set("head_dim", cfg.shape.head_dim)
        .set("dtype", cfg.dtype.name())
        .set("codec", cfg.dtype.name());
    r
}

fn run_length<E: Element>(cfg: &BenchConfig, tokens: usize, emit: &mut dyn FnMut(Row)) -> Result<()> {
    let shape = cfg.shape;
    let (d, reps) = (shape.head_dim, cfg.reps.max(1));
    let combos: Vec<(SelectionMode, EstimateShare)> =
        cfg.modes.iter().flat_map(|&m| cfg.estimates.iter().map(move |&e| (m, e))).collect();
    let pb = progress(cfg, tokens, 5 + cfg.queries * (1 + combos.len()) + 1);
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
    let mut r = base_row(cfg, "decode", "exact", tokens);
    r.set("time_us", exact_us)
        .set("baseline", "memread")
        .set("baseline_time_us", mem_us)
        .set("speedup", mem_us / exact_us)
        .set("gbps", kv_bytes as f64 / exact_us / 1e3)
        .set("exact_tokens", tokens)
        .set("bytes_host", kv_bytes);
    emit(r);
    pb.inc(1);

    pb.set_message("index build (wave prefill)");
    let engine = Engine::in_memory(EngineConfig::default())?;
    let spec = ContextSpec::new(shape, 1).with_dtype(cfg.dtype);
    let wave = engine.create_context(spec.clone().with_method(Method::Wave(WaveParams::default())))?;
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

    let mut default_exact_tokens = None;
    for &(mode, share) in &combos {
        pb.set_message(format!("wave {} estimate {}", mode.name(), share_name(share)));
        let budget = Budget::default()
            .with_retrieve(cfg.retrieve)
            .with_retrieve_floor(cfg.retrieve_floor)
            .with_mode(mode)
            .with_estimate(share);
        let (mut samples, mut errs, mut oracle_errs, mut recalls, mut exact_tok, mut bytes) =
            (vec![], vec![], vec![], vec![], vec![], 0);
        let (mut plan_samples, mut exec_samples, mut base_samples) = (vec![], vec![], vec![]);
        for (q, reference) in queries.iter().zip(&references) {
            let req = [Request::new(wave, 0, q.clone())];
            let mut out = Vec::new();
            let mut last_plan = None;
            for _ in 0..reps {
                base_samples.push(exact_once(q));
                let t = Instant::now();
                let plan = engine.plan(&req, &budget)?;
                let planned = t.elapsed().as_secs_f64() * 1e6;
                out = engine.execute(&plan)?;
                let total = t.elapsed().as_secs_f64() * 1e6;
                samples.push(total);
                plan_samples.push(planned);
                exec_samples.push(total - planned);
                last_plan = Some(plan);
            }
            let Some(plan) = last_plan else { continue };
            errs.push(rel_l2(&out[0], reference));
            bytes = plan.requests[0].cost.total_bytes();
            // Oracle: the true top-N tokens of every query head, N = what the wave plan attends exactly.
            let mut subsets = Vec::with_capacity(shape.q_heads);
            let mut recall = 0.0;
            let mut scores = Vec::new();
            for j in 0..shape.q_heads {
                let attended = engine.exact_positions(&plan, 0, j)?;
                let n = attended.len();
                exact_tok.push(n as f64);
                score_rows(&q[j * d..(j + 1) * d], kview.head(j / shape.group()), 1.0 / (d as f32).sqrt(), &mut scores);
                let top = top_r(&scores, n);
                let set: HashSet<u32> = top.iter().copied().collect();
                recall += attended.iter().filter(|t| set.contains(t)).count() as f64 / n.max(1) as f64;
                subsets.push(top);
            }
            recalls.push(recall / shape.q_heads as f64);
            let oracle: Vec<f32> =
                reference_attention(&shape, q, kview, vview, Some(&subsets)).iter().map(|&x| x as f32).collect();
            oracle_errs.push(rel_l2(&oracle, reference));
            pb.inc(1);
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let us = median(samples);
        let avg_exact = mean(&exact_tok);
        if default_exact_tokens.is_none() {
            default_exact_tokens = Some(avg_exact.round() as usize);
        }
        let base_us = median(base_samples);
        let mut r = base_row(cfg, "decode", "wave", tokens);
        r.set("selection", mode.name())
            .set("retrieve_frac", cfg.retrieve)
            .set("estimate_frac", share_value(share))
            .set("time_us", us)
            .set("plan_us", median(plan_samples))
            .set("execute_us", median(exec_samples))
            .set("baseline", "exact")
            .set("baseline_time_us", base_us)
            .set("speedup", base_us / us)
            .set("rel_l2_error", mean(&errs))
            .set("oracle_rel_l2_error", mean(&oracle_errs))
            .set("recall", mean(&recalls))
            .set("exact_tokens", avg_exact.round())
            .set("bytes_host", bytes)
            .set("bytes_gpu", 0)
            .set("bytes_disk", 0);
        emit(r);
    }

    pb.set_message("oracle top-k (flat index)");
    let n = default_exact_tokens.unwrap_or(cfg.retrieve_floor);
    let budget =
        Budget::default().with_retrieve(0.0).with_retrieve_floor(n).with_estimate(EstimateShare::Fraction(0.0));
    let (mut samples, mut errs, mut base_samples) = (vec![], vec![], vec![]);
    for (q, reference) in queries.iter().zip(&references) {
        let req = [Request::new(flat, 0, q.clone())];
        let mut out = Vec::new();
        for _ in 0..reps {
            base_samples.push(exact_once(q));
            let t = Instant::now();
            let plan = engine.plan(&req, &budget)?;
            out = engine.execute(&plan)?;
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
        errs.push(rel_l2(&out[0], reference));
    }
    let us = median(samples);
    let base_us = median(base_samples);
    let mut r = base_row(cfg, "decode", "oracle_topk", tokens);
    r.set("selection", SelectionMode::PerQueryHead.name())
        .set("time_us", us)
        .set("baseline", "exact")
        .set("baseline_time_us", base_us)
        .set("speedup", base_us / us)
        .set("rel_l2_error", errs.iter().sum::<f64>() / errs.len().max(1) as f64)
        .set("recall", 1.0)
        .set("exact_tokens", n);
    emit(r);
    pb.finish_and_clear();
    Ok(())
}

fn share_value(share: EstimateShare) -> serde_json::Value {
    match share {
        EstimateShare::Fraction(f) => f.into(),
        EstimateShare::Rest => "rest".into(),
    }
}

/// `0.232` or `rest`.
pub fn share_name(share: EstimateShare) -> String {
    match share {
        EstimateShare::Fraction(f) => format!("{f}"),
        EstimateShare::Rest => "rest".into(),
    }
}
