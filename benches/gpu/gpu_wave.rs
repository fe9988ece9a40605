//! A whole wave-index decode step on the GPU (feature `cuda`; run by `benches/gpu/run.sh`
//! beside PyTorch SDPA). One layer, 32 q / 8 kv heads, d = 128, f16, batch 1.
//!
//! The layer is laid out by the wave index's segmented k-means; that build is timed on all
//! CPU cores and wholly on the device from f16 KV in device memory (an `index_build` row),
//! then the CPU's layout is used (the other contexts of the throughput run are built on the
//! device). All KV lives
//! in mapped pinned host memory; the GPU holds the meta index (centroids, mean values,
//! sizes, row ranges) and a Gpu-tier cache of 5% of the KV rows in 16-row blocks under LRU
//! (the steady zone's blocks resident). Each timed step is everything a decode step needs,
//! with no host work between the kernels: centroid scoring and top-r (1.8% of the tokens),
//! the row list of the retrieved clusters and the steady zone, attention over it (cache hits
//! from device memory, misses zero-copy over PCIe), the estimation partial of every other
//! cluster, and the merge. The query moves slowly (a path between two synthetic queries).
//! After each step the host reads the selection back and admits the missed blocks (the
//! maintainer's work, timed separately, off the decode path). 100 warm-up steps, then 100
//! measured. The same steps are also timed without the cache, with all KV in HBM, and
//! launched kernel by kernel instead of replayed from a CUDA graph (with the host time each
//! takes to enqueue), and the last step's output is compared with exact attention.
//!
//! Then the throughput run: as many contexts as a 100 GiB pinned host budget holds for a
//! 32-layer 8B model at this length (6 at 128K), each with its own layer, KV, 5% Gpu tier
//! and moving query, stepped together by one batched launch (every request on its own
//! streams, one graph for the batch).

use attnstore_bench::{SynthContext, SynthParams};
use attnstore_kernels::cpu::attention::exact_attention;
use attnstore_kernels::cpu::reference::rel_l2;
use attnstore_kernels::cuda::{DeviceWave, GpuBackend, GpuCache, MappedKv, WaveCache, WaveJob, WaveStep, WaveTable};
use attnstore_kernels::layout::{ClusteredLayer, LayoutParams};
use attnstore_kernels::{AttnShape, HeadsView};
use serde_json::json;
use std::collections::HashSet;
use std::time::Instant;

#[path = "common.rs"]
#[allow(dead_code, reason = "shared with the other GPU benches; the list-of-lengths argument is theirs")]
mod common;
use common::{gpu_or_exit, median, tokens_arg, Lru, BLOCK};

fn main() {
    let (tokens, gpu) = (tokens_arg(), gpu_or_exit());
    let shape = AttnShape::new(32, 8, 128).expect("shape");
    let (kvh, d) = (shape.kv_heads, shape.head_dim);
    let synth = SynthContext::generate(SynthParams::new(shape, tokens, 42));
    // The index build (segmented k-means and layout) on all CPU cores: the baseline of the
    // device build below.
    let t0 = Instant::now();
    let layer = ClusteredLayer::build(&synth.keys, &synth.values, kvh, d, LayoutParams::default()).expect("layout");
    let cpu_s = t0.elapsed().as_secs_f64();
    // The whole build on the device, from f16 KV already in device memory (where the prefill
    // leaves it): timed to the layout ready in device memory, its copy to the host apart; and
    // once with no k-means update step (centring, one assignment, layout) to split the time.
    let kv_dev = gpu.upload_f32(&synth.keys, &synth.values, kvh).expect("upload");
    let build = |params: LayoutParams| {
        let (mut dev_us, mut copy_us, mut last) = (vec![], vec![], None);
        for _ in 0..3 {
            gpu.stream().synchronize().expect("sync");
            let t0 = Instant::now();
            let lay = gpu.build_layout(&kv_dev, params).expect("device build");
            lay.synchronize(&gpu).expect("sync");
            dev_us.push(t0.elapsed().as_secs_f64() * 1e6);
            let t1 = Instant::now();
            let host = lay.download(&gpu).expect("download");
            copy_us.push(t1.elapsed().as_secs_f64() * 1e6);
            last = Some((lay.iterations, lay.converged, host.clusters));
        }
        (median(dev_us), median(copy_us), last.expect("three builds"))
    };
    let (dev_us, copy_us, (iterations, converged, clusters)) = build(LayoutParams::default());
    let (prep_us, _, _) = build(LayoutParams { max_iters: 0, ..LayoutParams::default() });
    println!(
        "{}",
        json!({
            "bench": "index_build", "device": "cuda", "method": "wave_layout_device", "tokens": tokens,
            "kv_heads": 8, "head_dim": 128, "time_us": dev_us.round(), "us_per_1k_tokens": (dev_us * 1e3 / tokens as f64).round(),
            "download_us": copy_us.round(), "no_update_step_us": prep_us.round(), "iterations": iterations,
            "converged": converged, "clusters": clusters,
            "baseline": "wave_layout_cpu_kmeans", "baseline_time_us": (cpu_s * 1e6).round(),
            "speedup": (cpu_s * 1e6 / dev_us * 100.0).round() / 100.0,
            "cpu_threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
        })
    );
    drop(kv_dev);
    let r = ((tokens as f64 * 0.018) / 16.0).ceil() as usize;
    let (qa, qb) = (synth.queries(0), synth.queries(1));
    drop(synth);
    let mut req = Request::new(&gpu, &shape, layer, (qa, qb), r);
    let layer = &req.layer;
    let hbm = gpu.upload(&bits(&layer.keys), &bits(&layer.values), kvh).expect("upload");
    let steps = 200;
    let (mut step_us, mut host_us, mut hbm_us, mut admit_us, mut eager_us) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut enqueue_graph_us, mut enqueue_eager_us) = (vec![], vec![]);
    let mut tally = Tally::default();
    let mut last = (Vec::new(), Vec::new());
    for step in 0..steps {
        let q = req.query(step, steps);
        gpu.set_wave_query(&mut req.job, &q).expect("query");
        let (us, enqueue) = req.timed_step(&gpu);
        let out = gpu.fetch_wave(&req.job).expect("output");
        let selection = gpu.wave_selection(&req.job).expect("selection");
        let a_us = req.keep_tier(&gpu, &selection, &mut tally);
        if step >= steps / 2 {
            step_us.push(us);
            admit_us.push(a_us);
            enqueue_graph_us.push(enqueue);
            // The same step launched kernel by kernel (cache as of after the admissions).
            req.job.set_graphs(false);
            let (e, e_enqueue) = req.timed_step(&gpu);
            eager_us.push(e);
            enqueue_eager_us.push(e_enqueue);
            req.job.set_graphs(true);
            host_us.push(
                gpu.time_ms(|| gpu.launch_wave(&req.wave, req.host.pointers(), None, &mut req.job)).expect("host")
                    * 1e3,
            );
            hbm_us.push(
                gpu.time_ms(|| gpu.launch_wave(&req.wave, hbm.pointers(&gpu), None, &mut req.job)).expect("hbm") * 1e3,
            );
            last = (q, out);
        } else if step == steps / 2 - 1 {
            tally = Tally::default();
        }
    }
    // Where a step's time goes (one more step, events between its phases; median of 20).
    let names = ["select_us", "estimation_us", "row_list_us", "attention_us", "merge_us"];
    let mut phases = vec![Vec::new(); names.len()];
    for _ in 0..20 {
        let ms = gpu
            .wave_phases(&req.wave, req.host.pointers(), Some(WaveCache::Layer(&req.cache, &req.table)), &mut req.job)
            .expect("phases");
        phases.iter_mut().zip(ms).for_each(|(p, t)| p.push(t * 1e3));
    }
    let phase_json: serde_json::Map<String, serde_json::Value> =
        names.iter().zip(phases).map(|(n, p)| (n.to_string(), json!((median(p) * 100.0).round() / 100.0))).collect();
    let (q, out) = last;
    let layer = &req.layer;
    let kview = HeadsView::new(&layer.keys, kvh, layer.rows, d).expect("view");
    let vview = HeadsView::new(&layer.values, kvh, layer.rows, d).expect("view");
    let exact: Vec<f64> =
        exact_attention(&shape, &q, kview, vview).expect("exact").iter().map(|&x| f64::from(x)).collect();
    let err = rel_l2(&out, &exact);
    let round = |x: f64| (x * 100.0).round() / 100.0;
    let common = json!({
        "bench": "decode", "device": "cuda", "tokens": tokens, "batch": 1, "q_heads": 32, "kv_heads": 8,
        "head_dim": 128, "dtype": "f16", "codec": "f16", "retrieve_clusters": r, "clusters": req.wave.clusters(),
        "estimated_clusters": req.wave.clusters() - r, "exact_tokens": round(tally.exact_tokens(kvh)),
        "rel_l2_error": (err * 1e4).round() / 1e4, "steps_measured": steps / 2, "warmup_steps": steps / 2,
    });
    let row = |method: &str, t: f64, extra: serde_json::Value| {
        let mut v = common.clone();
        v["method"] = json!(method);
        v["time_us"] = json!(round(t));
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        println!("{v}");
    };
    row(
        "wave_step_host_gpu_tier",
        median(step_us),
        json!({
            "hit_ratio": tally.hit_ratio(), "gpu_tier_frac": 0.05, "bytes_pcie_per_step": tally.pcie_bytes(d),
            "admit_us": round(median(admit_us)), "phases": phase_json, "launch": "graph",
            "host_enqueue_us": round(median(enqueue_graph_us)),
        }),
    );
    row(
        "wave_step_host_gpu_tier_eager",
        median(eager_us),
        json!({ "launch": "kernel by kernel", "host_enqueue_us": round(median(enqueue_eager_us)) }),
    );
    row("wave_step_host", median(host_us), json!({}));
    row("wave_step_hbm", median(hbm_us), json!({}));
    drop(hbm);
    batch_run(&gpu, &shape, tokens, r, req);
}

/// The throughput run: as many requests as the host budget admits, stepped together.
fn batch_run(gpu: &GpuBackend, shape: &AttnShape, tokens: usize, r: usize, first: Request) {
    // A 32-layer 8B model (8 KV heads, d = 128, f16 K and V) in a 100 GiB pinned host budget.
    let kv_per_seq = 32 * tokens * 8 * 128 * 2 * 2;
    let batch = (100usize << 30) / kv_per_seq;
    if batch < 2 {
        println!(
            "{}",
            json!({"bench": "throughput_skipped", "tokens": tokens, "batch": batch,
            "why": "the host budget holds fewer than two contexts at this length"})
        );
        return;
    }
    let mut reqs = vec![first];
    for i in 1..batch {
        eprintln!("context {} of {batch}: generating and laying it out on the GPU", i + 1);
        let synth = SynthContext::generate(SynthParams::new(*shape, tokens, 42 + i as u64));
        let layer = ClusteredLayer::build_on_device(gpu, &synth.keys, &synth.values, 8, 128, LayoutParams::default())
            .expect("layout on the GPU");
        let queries = (synth.queries(0), synth.queries(1));
        reqs.push(Request::new(gpu, shape, layer, queries, r));
    }
    let mut lanes = gpu.wave_batch(batch).expect("streams");
    let steps = 200;
    let (mut graph_us, mut eager_us, mut tally) = (vec![], vec![], Tally::default());
    // Host wall time from the first launch to the last output fetched: the batch graph, and
    // each request's own graph launched on its lane in turn (`launch_wave_lane`, what the
    // engine does), measured in the same steps.
    let (mut graph_wall, mut lanes_wall) = (vec![], vec![]);
    for step in 0..steps {
        for req in &mut reqs {
            let q = req.query(step, steps);
            gpu.set_wave_query(&mut req.job, &q).expect("query");
        }
        let mut launch = |graphs: bool, reqs: &mut [Request]| {
            lanes.set_graphs(graphs);
            let mut batch: Vec<WaveStep<'_>> = reqs.iter_mut().map(Request::step).collect();
            gpu.time_ms(|| gpu.launch_wave_batch(&mut lanes, &mut batch)).expect("batch") * 1e3
        };
        let t0 = std::time::Instant::now();
        let us = launch(true, &mut reqs);
        for req in &mut reqs {
            gpu.fetch_wave_selected(&mut req.job).expect("fetch");
        }
        let graph_wall_us = t0.elapsed().as_secs_f64() * 1e6;
        let eager = if step >= steps / 2 { Some(launch(false, &mut reqs)) } else { None };
        lanes.set_graphs(true);
        let t0 = std::time::Instant::now();
        for (i, q) in reqs.iter_mut().enumerate() {
            gpu.launch_wave_lane(&lanes, i, &mut q.step()).expect("lane");
        }
        for req in &mut reqs {
            gpu.fetch_wave_selected(&mut req.job).expect("fetch");
        }
        let lanes_wall_us = t0.elapsed().as_secs_f64() * 1e6;
        if step >= steps / 2 {
            graph_wall.push(graph_wall_us);
            lanes_wall.push(lanes_wall_us);
        }
        for req in &mut reqs {
            let selection = gpu.wave_selection(&req.job).expect("selection");
            req.keep_tier(gpu, &selection, &mut tally);
        }
        if let Some(e) = eager {
            graph_us.push(us);
            eager_us.push(e);
        } else if step == steps / 2 - 1 {
            tally = Tally::default();
        }
    }
    let t = median(graph_us);
    let round = |x: f64| (x * 100.0).round() / 100.0;
    println!(
        "{}",
        json!({
            "bench": "decode", "device": "cuda", "method": "wave_batch_host_gpu_tier", "tokens": tokens, "batch": batch,
            "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "f16", "time_us": round(t),
            "us_per_request": round(t / batch as f64), "tokens_per_s_layer": (batch as f64 / (t * 1e-6)).round(),
            "eager_time_us": round(median(eager_us)), "graph_wall_us": round(median(graph_wall)),
            "lanes_wall_us": round(median(lanes_wall)), "hit_ratio": tally.hit_ratio(), "gpu_tier_frac": 0.05,
            "bytes_pcie_per_step": tally.pcie_bytes(128), "host_budget_gib": 100, "steps_measured": steps / 2,
        })
    );
}

/// f16 values as the bits the GPU backend takes.
fn bits(x: &[half::f16]) -> Vec<u16> {
    x.iter().map(|h| h.to_bits()).collect()
}

/// One context of the bench: its layer, KV in mapped pinned memory, meta index, step
/// buffers, and its Gpu tier (5% of its KV rows in 16-row blocks, the steady zone resident,
/// the rest under LRU).
struct Request {
    layer: ClusteredLayer,
    queries: (Vec<f32>, Vec<f32>),
    host: MappedKv,
    wave: DeviceWave,
    job: WaveJob,
    cache: GpuCache,
    table: WaveTable,
    lru: Lru,
}

impl Request {
    fn new(
        gpu: &GpuBackend,
        shape: &AttnShape,
        layer: ClusteredLayer,
        queries: (Vec<f32>, Vec<f32>),
        r: usize,
    ) -> Self {
        let kvh = shape.kv_heads;
        let host = gpu.pin(&bits(&layer.keys), &bits(&layer.values), kvh).expect("pin");
        let wave = gpu.upload_wave(&layer).expect("meta index");
        let job = gpu.prepare_wave(shape, &wave, r).expect("prepare");
        let cache_rows = (layer.rows * kvh / 20).next_multiple_of(BLOCK);
        let mut cache = gpu.cache(cache_rows).expect("cache");
        let mut table = gpu.wave_table(&wave, BLOCK).expect("table");
        let mut next = 0u32;
        let mut resident = Vec::new();
        for h in 0..kvh {
            for b in layer.indexed / BLOCK..layer.rows.div_ceil(BLOCK) {
                let rows = b * BLOCK..((b + 1) * BLOCK).min(layer.rows);
                resident.extend(rows.enumerate().map(|(i, t)| (h as u32, t as u32, next + i as u32)));
                table.set(h, b, Some(next)).expect("table");
                next += BLOCK as u32;
            }
        }
        let lru = Lru::new((cache_rows - next as usize) / BLOCK, next);
        gpu.admit(host.pointers(), &mut cache, &resident).expect("admit steady");
        gpu.upload_table(&mut table).expect("table");
        Self { layer, queries, host, wave, job, cache, table, lru }
    }

    /// This request's next step over the host KV and its Gpu tier, as a batch takes it.
    fn step(&mut self) -> WaveStep<'_> {
        WaveStep {
            wave: &self.wave,
            kv: self.host.pointers(),
            cache: Some(WaveCache::Layer(&self.cache, &self.table)),
            job: &mut self.job,
        }
    }

    /// One step over the host KV and the Gpu tier: its GPU microseconds (events) and the
    /// host's microseconds to enqueue it.
    fn timed_step(&mut self, gpu: &GpuBackend) -> (f64, f64) {
        let mut enqueue = 0.0;
        let ms = gpu
            .time_ms(|| {
                let t0 = Instant::now();
                let done = gpu.launch_wave(
                    &self.wave,
                    self.host.pointers(),
                    Some(WaveCache::Layer(&self.cache, &self.table)),
                    &mut self.job,
                );
                enqueue = t0.elapsed().as_secs_f64() * 1e6;
                done
            })
            .expect("step");
        (ms * 1e3, enqueue)
    }

    /// Step `step` of `steps`'s query: a path between two synthetic queries.
    fn query(&self, step: usize, steps: usize) -> Vec<f32> {
        let a = step as f32 / steps as f32;
        self.queries.0.iter().zip(&self.queries.1).map(|(x, y)| (1.0 - a) * x + a * y).collect()
    }

    /// After a step: counts the blocks it read (hits and misses as of the table it ran with)
    /// into `tally` and admits the missed blocks (the maintainer's work); returns the
    /// admission's microseconds.
    fn keep_tier(&mut self, gpu: &GpuBackend, selection: &[Vec<u32>], tally: &mut Tally) -> f64 {
        let mut used = HashSet::new();
        let mut misses = Vec::new();
        tally.rows_listed += (self.layer.rows - self.layer.indexed) * selection.len();
        for (h, chosen) in selection.iter().enumerate() {
            for &c in chosen {
                let range = self.layer.cluster_rows(h, c as usize);
                tally.rows_listed += range.len();
                for b in range.start / BLOCK..range.end.div_ceil(BLOCK) {
                    if used.insert((h, b)) {
                        tally.lookups += 1;
                        if self.table.get(h, b).is_some() {
                            tally.hits += 1;
                            self.lru.touch((h, b));
                        } else {
                            misses.push((h, b));
                        }
                    }
                }
            }
        }
        tally.miss_rows += misses.len() * BLOCK;
        tally.steps += 1;
        let mut entries = Vec::new();
        for &(h, b) in &misses {
            if let Some((slot, victim)) = self.lru.admit((h, b), &used) {
                if let Some((vh, vb)) = victim {
                    self.table.set(vh, vb, None).expect("table");
                }
                self.table.set(h, b, Some(slot)).expect("table");
                let rows = b * BLOCK..((b + 1) * BLOCK).min(self.layer.indexed);
                entries.extend(rows.enumerate().map(|(i, t)| (h as u32, t as u32, slot + i as u32)));
            }
        }
        gpu.time_ms(|| {
            gpu.admit(self.host.pointers(), &mut self.cache, &entries)?;
            gpu.upload_table(&mut self.table)
        })
        .expect("admit")
            * 1e3
    }
}

/// Gpu-tier counts over measured steps.
#[derive(Default)]
struct Tally {
    hits: usize,
    lookups: usize,
    miss_rows: usize,
    rows_listed: usize,
    steps: usize,
}

impl Tally {
    fn hit_ratio(&self) -> f64 {
        (self.hits as f64 / self.lookups.max(1) as f64 * 1000.0).round() / 1000.0
    }

    /// Mean bytes read over PCIe per step and request (K and V rows of missed blocks).
    fn pcie_bytes(&self, d: usize) -> f64 {
        (self.miss_rows as f64 * (2 * d * 2) as f64 / self.steps.max(1) as f64).round()
    }

    /// Mean rows attended exactly per KV head and step.
    fn exact_tokens(&self, kv_heads: usize) -> f64 {
        self.rows_listed as f64 / (self.steps.max(1) * kv_heads) as f64
    }
}
