//! Engine plans as whole device steps (feature `cuda`; run by `benches/gpu/run.sh` beside
//! PyTorch SDPA): what an inference runtime embedding attnstore gets per layer and decode
//! step, host work included. One layer, 32 q / 8 kv heads, d = 128, f16.
//!
//! Each context's indexed rows live in the engine's buffer manager: blocks homed in the
//! pinned Host arena, a Gpu tier of 5% of them in device memory kept by the background
//! maintainer (CLOCK), fed by the cluster reads each device step logs. A timed step is
//! `Engine::plan_gpu` + `Engine::execute_gpu` for the step's requests, after one decode
//! token was appended to each context (untimed: the steady zone grows by a row per step and
//! the device copy takes it), with a slowly moving query. 100 warm-up steps
//! (`ATTNSTORE_BENCH_WARMUP` for more), then 100 measured (also with a maintenance round
//! after each step, untimed and reported apart, as `gpu_wave` keeps its tier); a batch of as
//! many contexts as a 100 GiB pinned host budget holds for a
//! 32-layer 8B model at this length (6 at 128K), stepped by one plan; and, for comparison,
//! the engine's older GPU path (`Engine::plan` on the CPU, then `execute_gpu`).
//!
//! `ATTNSTORE_BENCH_CODEC=hack2` stores the indexed rows as 2-bit blocks: the batch the 100 GiB budget
//! holds grows by f16's bytes over hack2's, up to `ATTNSTORE_BENCH_MAX_BATCH` (default 8).
//! `ATTNSTORE_BENCH_BATCH_RUNS=N` measures the batch N times (a query path each);
//! `ATTNSTORE_BENCH_GPU_FRAC` sets the Gpu tier's share of the blocks (default 0.05).

use attnstore::{
    AttnShape, Budget, BufferSettings, Codec, ContextId, ContextSpec, Engine, EngineConfig, Request, Tier,
};
use attnstore_bench::{SynthContext, SynthParams};
use serde_json::json;
use std::time::Instant;

#[path = "common.rs"]
#[allow(dead_code, reason = "shared with the other GPU benches; this one needs two of its pieces")]
mod common;
use common::{median, tokens_arg};

/// Measured steps (and the default number of warm-up steps).
const STEPS: usize = 100;

/// Warm-up steps before each measured run: `ATTNSTORE_BENCH_WARMUP` (at least 100, the
/// default). At 1M tokens a cold Gpu tier takes longer than 100 steps to warm (the first
/// rounds admit tens of thousands of blocks), so the steady state needs more.
fn warmup_steps() -> usize {
    static WARM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *WARM.get_or_init(|| {
        std::env::var("ATTNSTORE_BENCH_WARMUP").ok().and_then(|v| v.parse().ok()).unwrap_or(STEPS).max(STEPS)
    })
}

fn main() {
    let tokens = tokens_arg();
    let shape = AttnShape::new(32, 8, 128).expect("shape");
    let codec: Codec = std::env::var("ATTNSTORE_BENCH_CODEC")
        .map_or(Codec::F16, |c| c.parse().unwrap_or_else(|e| panic!("ATTNSTORE_BENCH_CODEC={c}: {e}")));
    let max_batch = std::env::var("ATTNSTORE_BENCH_MAX_BATCH").ok().and_then(|v| v.parse().ok()).unwrap_or(8usize);
    // A 32-layer model's KV per sequence in the codec's bytes per token and KV head.
    let kv_per_seq = (32.0 * tokens as f64 * 8.0 * codec.kv_row_bytes(128)) as usize;
    let batch = ((100usize << 30) / kv_per_seq).clamp(1, max_batch);
    // Context 0 appends a token per step in each run: three alone, then the batch runs and
    // the maintained batch run (and one run of slack).
    let batch_runs = std::env::var("ATTNSTORE_BENCH_BATCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(1usize);
    let total = tokens + (5 + batch_runs.max(1)) * (warmup_steps() + STEPS) + 8;
    let host_blocks = batch * attnstore_bench::blocks_for_codec(&shape, codec, total, 2048);
    // The maintainer's pause after a round of work (default 100 µs): `ATTNSTORE_MAINTAINER_PAUSE_US`.
    let mut settings = BufferSettings::new(host_blocks);
    // The Gpu tier's share of the Host arena's blocks (default 5%): `ATTNSTORE_BENCH_GPU_FRAC`.
    // hack2 blocks are ~6x smaller than f16's, so the same device memory per context holds
    // ~6x their share.
    let gpu_frac: f64 = std::env::var("ATTNSTORE_BENCH_GPU_FRAC").ok().and_then(|v| v.parse().ok()).unwrap_or(0.05);
    settings.gpu_blocks = ((host_blocks as f64 * gpu_frac) as usize).max(1);
    if let Some(us) = std::env::var("ATTNSTORE_MAINTAINER_PAUSE_US").ok().and_then(|v| v.parse().ok()) {
        settings.maintainer_pause = std::time::Duration::from_micros(us);
    }
    let pause_us = settings.maintainer_pause.as_micros() as u64;
    let settings_gpu_bytes = settings.gpu_blocks * 2048;
    let engine =
        Engine::in_memory(EngineConfig { buffers: Some(settings), ..EngineConfig::default() }).expect("engine");
    if engine.buffer_stats().is_none_or(|s| !s.gpu_on_device) {
        eprintln!("no GPU-backed buffer manager (needs a GPU and pinned memory)");
        std::process::exit(2);
    }
    // The first context is prefilled on the CPU (all cores), the others with the clustering
    // on the GPU (`Engine::prefill_gpu`): both timed, from f32 KV in host memory to an index
    // ready to plan. `ATTNSTORE_BENCH_PREFILL=cpu` prefills every context on the CPU, so two
    // builds whose device clustering differs can be compared on the same layouts.
    let cpu_only = std::env::var("ATTNSTORE_BENCH_PREFILL").is_ok_and(|v| v == "cpu");
    let mut ctxs = Vec::new();
    let (mut cpu_prefill_us, mut gpu_prefill_us) = (Vec::new(), Vec::new());
    for i in 0..batch {
        eprintln!("context {} of {batch}: generating and prefilling {tokens} tokens", i + 1);
        let synth = SynthContext::generate(SynthParams::new(shape, total, 42 + i as u64));
        let ctx = engine.create_context(ContextSpec::new(shape, 1).with_codec(codec)).expect("context");
        let (k, v) = synth.slice(0, tokens);
        let t = Instant::now();
        if i == 0 || cpu_only {
            engine.prefill(ctx, 0, &k, &v).expect("prefill");
            cpu_prefill_us.push(t.elapsed().as_secs_f64() * 1e6);
        } else {
            assert!(engine.prefill_gpu(ctx, 0, &k, &v).expect("prefill"), "clustered on the GPU");
            gpu_prefill_us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        ctxs.push(Context { ctx, synth, at: tokens });
    }
    if !gpu_prefill_us.is_empty() {
        let (gpu, cpu) = (median(gpu_prefill_us.clone()), cpu_prefill_us[0]);
        println!(
            "{}",
            json!({"bench": "engine_prefill", "device": "cuda", "method": "engine_prefill_gpu", "tokens": tokens, "codec": codec.to_string(),
                "kv_heads": 8, "head_dim": 128, "time_us": gpu.round(), "runs": gpu_prefill_us.len(),
                "baseline": "engine_prefill_cpu", "baseline_time_us": cpu.round(),
                "cpu_threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
                "speedup": (cpu / gpu * 100.0).round() / 100.0})
        );
    }
    let budget = Budget::default();
    let round = |x: f64| (x * 100.0).round() / 100.0;
    let common = json!({"bench": "decode", "device": "cuda", "tokens": tokens, "q_heads": 32, "kv_heads": 8,
        "head_dim": 128, "dtype": "f16", "codec": codec.to_string(), "kv_bytes_per_seq_32_layers": kv_per_seq, "gpu_tier_frac": gpu_frac, "gpu_tier_bytes": settings_gpu_bytes, "steps_measured": STEPS, "steps_warmup": warmup_steps(),
        "maintainer_pause_us": pause_us, "prefill": if cpu_only { "cpu" } else { "context 0 cpu, others gpu" },
        // CUDA's hardware queues for the batch's lane streams (8 unless the environment says).
        "cuda_device_max_connections": std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok()});
    let row = |method: &str, n: usize, t: f64, extra: serde_json::Value| {
        let mut v = common.clone();
        v["method"] = json!(method);
        v["batch"] = json!(n);
        v["time_us"] = json!(round(t));
        v["tokens_per_s_layer"] = json!((n as f64 / (t * 1e-6)).round());
        extra.as_object().into_iter().flatten().for_each(|(k, x)| v[k] = x.clone());
        println!("{v}");
    };
    // Batch 1 through the device path (the maintainer in the background; then also a
    // maintenance round after each step, untimed, as gpu_wave keeps its tier), the
    // CPU-planned GPU path, then the batch.
    for (path, (method, between)) in
        [("engine_device_step", false), ("engine_device_step_maintained", true)].into_iter().enumerate()
    {
        let r = steps(&engine, &mut ctxs[..1], &budget, true, between, path as u64);
        let extra = json!({"plan_us": round(r.plan_us), "hit_ratio": r.hit, "step_hit_ratio": r.step_hit,
            "plan": "plan_gpu", "maintain_us": round(r.maintain_us)});
        row(method, 1, r.step_us, extra);
    }
    let explain = engine.plan_gpu(&[ctxs[0].request(0, 0)], &budget).expect("plan").explain();
    eprintln!("{explain}");
    let r = steps(&engine, &mut ctxs[..1], &budget, false, true, 2);
    let extra = json!({"plan_us": round(r.plan_us), "hit_ratio": r.hit, "plan": "plan"});
    row("engine_cpu_planned_gpu_step", 1, r.step_us, extra);
    if batch > 1 {
        // `ATTNSTORE_BENCH_BATCH_RUNS` measured runs of the batch (default 1), each on a query
        // path of its own: several same-process figures for ratios against SDPA.
        let plain =
            (0..batch_runs.max(1)).map(|i| ("engine_device_batch", false, if i == 0 { 3 } else { 4 + i as u64 }));
        for (method, between, path) in plain.chain([("engine_device_batch_maintained", true, 4)]) {
            let r = steps(&engine, &mut ctxs, &budget, true, between, path);
            let extra = json!({"plan_us": round(r.plan_us), "hit_ratio": r.hit, "step_hit_ratio": r.step_hit,
                "us_per_request": round(r.step_us / batch as f64), "host_budget_gib": 100,
                "maintain_us": round(r.maintain_us)});
            row(method, batch, r.step_us, extra);
        }
    }
}

/// What [`steps`] measured.
struct Measured {
    /// Median time of a step (plan + execute), µs.
    step_us: f64,
    /// Median planning time, µs.
    plan_us: f64,
    /// Median time of the maintenance round after a step (0 without), µs.
    maintain_us: f64,
    /// The Gpu tier's hit ratio over the measured steps, as the buffer manager counts them
    /// (every miss, a sample of the hits of device steps: see `GpuRun::device_missed`).
    hit: f64,
    /// Retrieved clusters found wholly in the Gpu tier by the device steps themselves, over
    /// the measured steps (NaN for CPU-planned steps).
    step_hit: f64,
}

/// One context and the next token to append.
struct Context {
    ctx: ContextId,
    synth: SynthContext,
    at: usize,
}

impl Context {
    /// A request with the query of step `step` of a run's warm-up and measured steps on path
    /// `path` (from synthetic query 2·path to query 2·path + 1: each measured run walks a
    /// path of its own, so no run finds the Gpu tier warmed by an earlier run over the same
    /// queries).
    fn request(&self, step: usize, path: u64) -> Request {
        let (a, b) = (self.synth.queries(2 * path), self.synth.queries(2 * path + 1));
        let of = warmup_steps() + STEPS;
        let w = (step % of) as f32 / of as f32;
        Request::new(self.ctx, 0, a.iter().zip(&b).map(|(x, y)| (1.0 - w) * x + w * y).collect())
    }
}

/// Warm-up and measured steps over `ctxs` (one plan for all of them), with a maintenance
/// round after each step when `between`.
fn steps(
    engine: &Engine,
    ctxs: &mut [Context],
    budget: &Budget,
    on_device: bool,
    between: bool,
    path: u64,
) -> Measured {
    let (mut times, mut plans, mut maintains) = (Vec::new(), Vec::new(), Vec::new());
    let mut before = None;
    let (mut clusters, mut missed) = (0usize, 0usize);
    let warm = warmup_steps();
    for step in 0..warm + STEPS {
        for c in ctxs.iter_mut() {
            let (k, v) = c.synth.slice(c.at, c.at + 1);
            engine.append(c.ctx, 0, &k, &v).expect("append");
            c.at += 1;
        }
        let requests: Vec<Request> = ctxs.iter().map(|c| c.request(step, path)).collect();
        let t0 = Instant::now();
        let plan =
            if on_device { engine.plan_gpu(&requests, budget) } else { engine.plan(&requests, budget) }.expect("plan");
        let planned = t0.elapsed().as_secs_f64() * 1e6;
        let (_, run) = engine.execute_gpu(&plan).expect("execute");
        let t = t0.elapsed().as_secs_f64() * 1e6;
        assert_eq!(run.on_cpu, 0, "every request on the GPU: {run:?}");
        if step >= warm {
            clusters += run.device_clusters;
            missed += run.device_missed;
        }
        if step == warm {
            before = engine.buffer_stats();
        }
        if step >= warm {
            times.push(t);
            plans.push(planned);
        }
        if between {
            let t0 = Instant::now();
            engine.buffer_manager().expect("buffers").maintain(usize::MAX);
            if step >= warm {
                maintains.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let gpu = |s: &attnstore::BufferStats| s.tier(Tier::Gpu).map_or((0, 0), |t| (t.hits, t.misses));
    let (h0, m0) = before.as_ref().map_or((0, 0), gpu);
    let (h1, m1) = engine.buffer_stats().as_ref().map_or((0, 0), gpu);
    let hit = (h1 - h0) as f64 / ((h1 - h0) + (m1 - m0)).max(1) as f64;
    Measured {
        step_us: median(times),
        plan_us: median(plans),
        maintain_us: if maintains.is_empty() { 0.0 } else { median(maintains) },
        hit: (hit * 1000.0).round() / 1000.0,
        step_hit: (1000.0 * (1.0 - missed as f64 / clusters as f64)).round() / 1000.0,
    }
}
