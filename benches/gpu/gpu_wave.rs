//! A whole wave-index decode step on the GPU (feature `cuda`; run by `benches/gpu/run.sh`
//! beside PyTorch SDPA). One layer, 32 q / 8 kv heads, d = 128, f16, batch 1.
//!
//! The layer is laid out by the wave index's segmented k-means; that build is timed on the
//! GPU and on all CPU cores (an `index_build` row), then the CPU's layout is used. All KV lives
//! in mapped pinned host memory; the GPU holds the meta index (centroids, mean values,
//! sizes, row ranges) and a Gpu-tier cache of 5% of the KV rows in 16-row blocks under LRU
//! (the steady zone's blocks resident). Each timed step is everything a decode step needs,
//! with no host work between the kernels: centroid scoring and top-r (1.8% of the tokens),
//! the row list of the retrieved clusters and the steady zone, attention over it (cache hits
//! from device memory, misses zero-copy over PCIe), the estimation partial of every other
//! cluster, and the merge. The query moves slowly (a path between two synthetic queries).
//! After each step the host reads the selection back and admits the missed blocks (the
//! maintainer's work, timed separately, off the decode path). 100 warm-up steps, then 100
//! measured. The same steps are also timed without the cache and with all KV in HBM, and
//! the last step's output is compared with exact attention.

use attnstore::synth::{SynthContext, SynthParams};
use attnstore_kernels::cpu::attention::exact_attention;
use attnstore_kernels::cpu::reference::rel_l2;
use attnstore_kernels::cuda::WaveTable;
use attnstore_kernels::layout::{ClusteredLayer, LayoutParams};
use attnstore_kernels::{AttnShape, HeadsView};
use serde_json::json;
use std::collections::HashSet;
use std::time::Instant;

#[path = "common.rs"]
mod common;
use common::{gpu_or_exit, median, tokens_arg, Lru, BLOCK};

fn main() {
    let (tokens, gpu) = (tokens_arg(), gpu_or_exit());
    let shape = AttnShape::new(32, 8, 128).expect("shape");
    let (kvh, d) = (shape.kv_heads, shape.head_dim);
    let synth = SynthContext::generate(SynthParams::new(shape, tokens, 42));
    // The index build (segmented k-means and layout), on the GPU and on all CPU cores.
    let t0 = Instant::now();
    let on_gpu = ClusteredLayer::build_on_gpu(&gpu, &synth.keys, &synth.values, kvh, d, LayoutParams::default())
        .expect("layout on the GPU");
    let gpu_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let layer = ClusteredLayer::build(&synth.keys, &synth.values, kvh, d, LayoutParams::default()).expect("layout");
    let cpu_s = t0.elapsed().as_secs_f64();
    println!(
        "{}",
        json!({
            "bench": "index_build", "device": "cuda", "method": "wave_layout_gpu_kmeans", "tokens": tokens,
            "kv_heads": 8, "head_dim": 128, "time_us": (gpu_s * 1e6).round(), "us_per_1k_tokens": (gpu_s * 1e9 / tokens as f64).round(),
            "baseline": "wave_layout_cpu_kmeans", "baseline_time_us": (cpu_s * 1e6).round(),
            "speedup": (cpu_s / gpu_s * 100.0).round() / 100.0, "cpu_threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
            "clusters": on_gpu.clusters,
        })
    );
    drop(on_gpu);
    let bits = |x: &[half::f16]| x.iter().map(|h| h.to_bits()).collect::<Vec<u16>>();
    let (kb, vb) = (bits(&layer.keys), bits(&layer.values));
    let host = gpu.pin(&kb, &vb, kvh).expect("pin");
    let hbm = gpu.upload(&kb, &vb, kvh).expect("upload");
    let wave = gpu.upload_wave(&layer).expect("meta index");
    let r = ((tokens as f64 * 0.018) / 16.0).ceil() as usize;
    let mut job = gpu.prepare_wave(&shape, &wave, r).expect("prepare");
    // The Gpu tier: 5% of all KV rows, in 16-row blocks; the steady zone's blocks resident.
    let cache_rows = (layer.rows * kvh / 20).next_multiple_of(BLOCK);
    let mut cache = gpu.cache(cache_rows).expect("cache");
    let mut table: WaveTable = gpu.wave_table(&wave, BLOCK).expect("table");
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
    let mut lru = Lru::new((cache_rows - next as usize) / BLOCK, next);
    gpu.admit(host.pointers(), &mut cache, &resident).expect("admit steady");
    gpu.upload_table(&mut table).expect("table");
    let (qa, qb) = (synth.queries(0), synth.queries(1));
    let steps = 200;
    let (mut step_us, mut host_us, mut hbm_us, mut admit_us) = (vec![], vec![], vec![], vec![]);
    let (mut hits, mut lookups, mut miss_rows, mut listed, mut fallbacks) = (0usize, 0usize, vec![], vec![], 0usize);
    let mut last = (Vec::new(), Vec::new());
    for step in 0..steps {
        let a = step as f32 / steps as f32;
        let q: Vec<f32> = qa.iter().zip(&qb).map(|(x, y)| (1.0 - a) * x + a * y).collect();
        gpu.set_wave_query(&mut job, &q).expect("query");
        let us =
            gpu.time_ms(|| gpu.launch_wave(&wave, host.pointers(), Some((&cache, &table)), &mut job)).expect("step")
                * 1e3;
        let out = gpu.fetch_wave(&job).expect("output");
        let (selection, fell_back) = gpu.wave_selection(&job).expect("selection");
        // Blocks the step read, hits and misses as of the table it ran with.
        let mut used = HashSet::new();
        let mut misses = Vec::new();
        let mut rows_listed = layer.rows - layer.indexed;
        for (h, chosen) in selection.iter().enumerate() {
            for &c in chosen {
                let range = layer.cluster_rows(h, c as usize);
                rows_listed += range.len();
                for b in range.start / BLOCK..range.end.div_ceil(BLOCK) {
                    if used.insert((h, b)) {
                        lookups += 1;
                        if table.get(h, b).is_some() {
                            hits += 1;
                            lru.touch((h, b));
                        } else {
                            misses.push((h, b));
                        }
                    }
                }
            }
        }
        // Admission of the missed blocks, after the step.
        let mut entries = Vec::new();
        for &(h, b) in &misses {
            if let Some((slot, victim)) = lru.admit((h, b), &used) {
                if let Some((vh, vb)) = victim {
                    table.set(vh, vb, None).expect("table");
                }
                table.set(h, b, Some(slot)).expect("table");
                let rows = b * BLOCK..((b + 1) * BLOCK).min(layer.indexed);
                entries.extend(rows.enumerate().map(|(i, t)| (h as u32, t as u32, slot + i as u32)));
            }
        }
        let a_us = gpu
            .time_ms(|| {
                gpu.admit(host.pointers(), &mut cache, &entries)?;
                gpu.upload_table(&mut table)
            })
            .expect("admit")
            * 1e3;
        if step >= steps / 2 {
            step_us.push(us);
            admit_us.push(a_us);
            miss_rows.push(misses.len() * BLOCK);
            listed.push(rows_listed / kvh);
            fallbacks += fell_back;
            host_us.push(gpu.time_ms(|| gpu.launch_wave(&wave, host.pointers(), None, &mut job)).expect("host") * 1e3);
            hbm_us.push(gpu.time_ms(|| gpu.launch_wave(&wave, hbm.pointers(&gpu), None, &mut job)).expect("hbm") * 1e3);
            last = (q, out);
        } else if step == steps / 2 - 1 {
            hits = 0;
            lookups = 0;
        }
    }
    // Where a step's time goes (one more step, events between its phases; median of 20).
    let names = ["select_us", "estimation_us", "row_list_us", "attention_us", "merge_us"];
    let mut phases = vec![Vec::new(); names.len()];
    for _ in 0..20 {
        let ms = gpu.wave_phases(&wave, host.pointers(), Some((&cache, &table)), &mut job).expect("phases");
        phases.iter_mut().zip(ms).for_each(|(p, t)| p.push(t * 1e3));
    }
    let phase_json: serde_json::Map<String, serde_json::Value> =
        names.iter().zip(phases).map(|(n, p)| (n.to_string(), json!((median(p) * 100.0).round() / 100.0))).collect();
    let (q, out) = last;
    let kview = HeadsView::new(&layer.keys, kvh, layer.rows, d).expect("view");
    let vview = HeadsView::new(&layer.values, kvh, layer.rows, d).expect("view");
    let exact: Vec<f64> =
        exact_attention(&shape, &q, kview, vview).expect("exact").iter().map(|&x| f64::from(x)).collect();
    let err = rel_l2(&out, &exact);
    let row_bytes = 2 * d * 2;
    let mean_miss = miss_rows.iter().sum::<usize>() as f64 / miss_rows.len() as f64;
    let exact_tokens = listed.iter().sum::<usize>() as f64 / listed.len() as f64;
    let round = |x: f64| (x * 100.0).round() / 100.0;
    let common = json!({
        "bench": "decode", "device": "cuda", "tokens": tokens, "batch": 1, "q_heads": 32, "kv_heads": 8,
        "head_dim": 128, "dtype": "f16", "codec": "f16", "retrieve_clusters": r, "clusters": wave.clusters(),
        "estimated_clusters": wave.clusters() - r, "exact_tokens": round(exact_tokens), "rel_l2_error": (err * 1e4).round() / 1e4,
        "steps_measured": steps / 2, "warmup_steps": steps / 2, "select_fallbacks": fallbacks,
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
            "hit_ratio": (hits as f64 / lookups.max(1) as f64 * 1000.0).round() / 1000.0,
            "gpu_tier_frac": 0.05, "bytes_pcie_per_step": (mean_miss * row_bytes as f64).round(),
            "admit_us": round(median(admit_us)), "phases": phase_json,
        }),
    );
    row("wave_step_host", median(host_us), json!({}));
    row("wave_step_hbm", median(hbm_us), json!({}));
}
