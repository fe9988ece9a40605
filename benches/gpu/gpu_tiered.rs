//! Decode from host memory with a Gpu-tier cache (feature `cuda`; run by
//! `benches/gpu/run.sh`). One layer, 32 q / 8 kv heads, d=128, f16, batch 1.
//!
//! All KV lives in mapped pinned host memory. A cache in device memory holds 5% of the
//! KV rows (in 16-row blocks) under LRU. Each decode step's query moves slowly (a linear
//! path between two synthetic queries, as consecutive decode queries do): per KV head the
//! steady zone (sink 4 + local 64, always resident) plus the best 1.8% of tokens, chosen as
//! the 16-row blocks whose mean key scores highest for the group (planning on the CPU,
//! not timed). The decode kernel reads hits from the cache and misses from host memory in
//! one pass; afterwards the missed blocks are admitted (LRU eviction) by a copy kernel,
//! timed separately (it is the maintainer's work, off the decode path). After 100 warm-up
//! steps, 100 measured steps report the kernel time, hit ratio and bytes over PCIe.

use attnstore_bench::{SynthContext, SynthParams};
use attnstore_kernels::cpu::scoring::{score_group, top_r};
use attnstore_kernels::cuda::RowRef;
use attnstore_kernels::AttnShape;
use serde_json::json;

#[path = "common.rs"]
#[allow(dead_code, reason = "shared with the other GPU benches; the list-of-lengths argument is theirs")]
mod common;
use common::{gpu_or_exit, median, tokens_arg, Lru, BLOCK};

fn main() {
    let (tokens, gpu) = (tokens_arg(), gpu_or_exit());
    let shape = AttnShape::new(32, 8, 128).expect("shape");
    let (kvh, g, d) = (shape.kv_heads, shape.group(), shape.head_dim);
    let synth = SynthContext::generate(SynthParams::new(shape, tokens, 42));
    let bits = |x: &[f32]| x.iter().map(|&f| half::f16::from_f32(f).to_bits()).collect::<Vec<u16>>();
    let host = gpu.pin(&bits(&synth.keys), &bits(&synth.values), kvh).expect("pin");
    // Block means (the blocks' "centroids"), per head.
    let blocks = tokens / BLOCK;
    let means: Vec<Vec<f32>> = (0..kvh)
        .map(|h| {
            let keys = &synth.keys[h * tokens * d..(h + 1) * tokens * d];
            keys.chunks_exact(BLOCK * d)
                .flat_map(|b| (0..d).map(move |j| b.chunks_exact(d).map(|r| r[j]).sum::<f32>() / BLOCK as f32))
                .collect()
        })
        .collect();
    let retrieve_blocks = ((tokens as f64 * 0.018) / BLOCK as f64).ceil() as usize;
    // Cache: 5% of all KV rows; the steady zone (68 rows per head) is resident at the front.
    let cache_rows = (tokens * kvh) / 20;
    let mut cache = gpu.cache(cache_rows).expect("cache");
    let steady: Vec<u32> = (0..4).chain(tokens as u32 - 64..tokens as u32).collect();
    let steady_entries: Vec<(u32, u32, u32)> =
        (0..kvh as u32).flat_map(|h| steady.iter().enumerate().map(move |(i, &r)| (h, r, h * 68 + i as u32))).collect();
    gpu.admit(host.pointers(), &mut cache, &steady_entries).expect("admit steady");
    let first_free = (kvh * 68) as u32;
    let mut lru = Lru::new((cache_rows - kvh * 68) / BLOCK, first_free);
    let (qa, qb) = (synth.queries(0), synth.queries(1));
    let steps = 200;
    let (mut kernel_us, mut admit_us, mut hits, mut lookups, mut miss_rows, mut uncached_us) =
        (vec![], vec![], 0usize, 0usize, vec![], vec![]);
    for step in 0..steps {
        let a = step as f32 / steps as f32;
        let q: Vec<f32> = qa.iter().zip(&qb).map(|(x, y)| (1.0 - a) * x + a * y).collect();
        let mut lists: Vec<Vec<RowRef>> = Vec::with_capacity(kvh);
        let mut uncached: Vec<Vec<u32>> = Vec::with_capacity(kvh);
        let mut misses = Vec::new();
        let mut used = std::collections::HashSet::new();
        for h in 0..kvh {
            let mut scores = vec![Vec::new(); g];
            score_group(&q[h * g * d..(h + 1) * g * d], g, &means[h], 1.0, &mut scores);
            let best: Vec<f32> =
                (0..blocks).map(|b| scores.iter().map(|s| s[b]).fold(f32::NEG_INFINITY, f32::max)).collect();
            let chosen = top_r(&best, retrieve_blocks);
            let mut list: Vec<RowRef> = (0..68u32).map(|i| RowRef::Cache(h as u32 * 68 + i)).collect();
            let mut plain: Vec<u32> = steady.clone();
            for &b in &chosen {
                let b = b as usize;
                let rows = (b * BLOCK) as u32..((b + 1) * BLOCK) as u32;
                plain.extend(rows.clone());
                used.insert((h, b));
                lookups += 1;
                match lru.slot_of.get(&(h, b)).copied() {
                    Some(slot) => {
                        hits += 1;
                        lru.touch((h, b));
                        list.extend((0..BLOCK as u32).map(|i| RowRef::Cache(slot + i)));
                    }
                    None => {
                        list.extend(rows.map(RowRef::Kv));
                        misses.push((h, b));
                    }
                }
            }
            lists.push(list);
            uncached.push(plain);
        }
        let mut job = gpu.prepare_refs(&shape, &q, tokens, Some(&lists), cache.slots()).expect("prepare");
        let us = gpu.time_ms(|| gpu.launch_cached(host.pointers(), Some(&cache), &mut job)).expect("decode") * 1e3;
        // Admission of the missed blocks (after the decode on the same stream).
        let mut entries = Vec::new();
        for &(h, b) in &misses {
            if let Some((slot, _)) = lru.admit((h, b), &used) {
                entries.extend((0..BLOCK as u32).map(|i| (h as u32, (b * BLOCK) as u32 + i, slot + i)));
            }
        }
        let a_us = gpu.time_ms(|| gpu.admit(host.pointers(), &mut cache, &entries)).expect("admit") * 1e3;
        if step >= steps / 2 {
            kernel_us.push(us);
            admit_us.push(a_us);
            miss_rows.push(misses.len() * BLOCK);
            let mut plain_job = gpu.prepare(&shape, &q, tokens, Some(&uncached)).expect("prepare");
            uncached_us.push(gpu.time_ms(|| gpu.launch(host.pointers(), &mut plain_job)).expect("uncached") * 1e3);
        } else if step == steps / 2 - 1 {
            hits = 0;
            lookups = 0;
        }
    }
    let row_bytes = 2 * d * 2;
    let mean_miss = miss_rows.iter().sum::<usize>() as f64 / miss_rows.len() as f64;
    let (t, base) = (median(kernel_us), median(uncached_us));
    println!(
        "{}",
        json!({
            "bench": "decode", "device": "cuda", "method": "sparse_host_gpu_tier", "tokens": tokens, "batch": 1,
            "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "f16", "codec": "f16",
            "time_us": (t * 100.0).round() / 100.0,
            "no_cache_time_us": (base * 100.0).round() / 100.0,
            "speedup_vs_no_cache": ((base / t) * 1000.0).round() / 1000.0,
            "hit_ratio": ((hits as f64 / lookups.max(1) as f64) * 1000.0).round() / 1000.0,
            "gpu_tier_frac": 0.05, "steps_measured": steps / 2, "warmup_steps": steps / 2,
            "bytes_pcie_per_step": (mean_miss * row_bytes as f64).round(),
            "admit_us": (median(admit_us) * 100.0).round() / 100.0,
            "exact_tokens": retrieve_blocks * BLOCK + 68,
        })
    );
}
