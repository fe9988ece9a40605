//! GPU decode benchmark (feature `cuda`, run on the GPU machine by `benches/gpu/run.sh`):
//! one layer, 32 q heads / 8 kv heads, d=128, f16, batch 1. Times, with CUDA events
//! (median of 30 after warm-up):
//! - `exact`: attnstore's flash-decoding kernel over all KV in device memory;
//! - `sparse_hbm`: the same kernel over a sparse plan's rows (steady 4 + 64, retrieval
//!   1.8% in 16-row clusters) with KV in device memory;
//! - `sparse_host`: the same rows read zero-copy from mapped pinned host memory (KV never
//!   in HBM: what a Gpu-tier miss costs).
//!
//! Prints one JSON line per configuration; `compare.py` adds PyTorch SDPA measured in the
//! same command and prints the ratios.

use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::AttnShape;
use serde_json::json;

#[path = "common.rs"]
#[allow(dead_code, reason = "shared with the other GPU benches; this one needs three of its pieces")]
mod common;
use common::{gpu_or_exit, median, tokens_list_arg};

fn main() {
    let tokens_list = tokens_list_arg("32768,131072,524288");
    let gpu = gpu_or_exit();
    eprintln!("device: {}", gpu.name());
    let shape = AttnShape::new(32, 8, 128).expect("shape");
    for tokens in tokens_list {
        let mut g = SplitMix64::new(tokens as u64);
        let n = shape.kv_len(tokens);
        let k: Vec<u16> = (0..n).map(|_| half::f16::from_f32(g.normal()).to_bits()).collect();
        let v: Vec<u16> = (0..n).map(|_| half::f16::from_f32(g.normal()).to_bits()).collect();
        let q: Vec<f32> = (0..shape.query_len()).map(|_| g.normal()).collect();
        let device = gpu.upload(&k, &v, shape.kv_heads).expect("upload");
        let host = gpu.pin(&k, &v, shape.kv_heads).expect("pin");
        drop((k, v));
        let retrieve = (tokens as f64 * 0.018).ceil() as usize;
        let lists: Vec<Vec<u32>> = (0..shape.kv_heads)
            .map(|_| {
                let mut l: Vec<u32> = (0..4).chain(tokens as u32 - 64..tokens as u32).collect();
                while l.len() < retrieve + 68 {
                    let s = 4 + g.below(tokens - 100) as u32 / 16 * 16;
                    l.extend(s..s + 16);
                }
                l.sort_unstable();
                l.dedup();
                l
            })
            .collect();
        let rows_attended: usize = lists.iter().map(Vec::len).sum::<usize>() / shape.kv_heads;
        let mut exact = gpu.prepare(&shape, &q, tokens, None).expect("prepare");
        let mut sparse = gpu.prepare(&shape, &q, tokens, Some(&lists)).expect("prepare");
        let time = |job: &mut attnstore_kernels::cuda::DecodeJob, ptrs| {
            for _ in 0..5 {
                gpu.launch(ptrs, job).expect("launch");
            }
            gpu.synchronize().expect("sync");
            median((0..30).map(|_| gpu.time_ms(|| gpu.launch(ptrs, job)).expect("time") * 1e3).collect())
        };
        let exact_us = time(&mut exact, device.pointers(&gpu));
        let hbm_us = time(&mut sparse, device.pointers(&gpu));
        let host_us = time(&mut sparse, host.pointers());
        // Scoring + top-r: over cluster centroids (one per 16 tokens, r = 1.8% of tokens in
        // clusters) and over every key (r = 1.8% of tokens), both per KV head.
        let mut select_rows = Vec::new();
        for (what, n, r) in [
            ("score_select_clusters", tokens / 16, (tokens as f64 * 0.018 / 16.0).ceil() as usize),
            ("score_select_tokens", tokens, (tokens as f64 * 0.018).ceil() as usize),
        ] {
            let cent: Vec<u16> =
                (0..shape.kv_heads * n * 128).map(|_| half::f16::from_f32(g.normal()).to_bits()).collect();
            let dev = gpu.upload_centroids(&cent, shape.kv_heads).expect("centroids");
            let mut job = gpu.prepare_select(&shape, &q, &dev, r).expect("prepare select");
            for _ in 0..5 {
                gpu.launch_select(&dev, &mut job).expect("select");
            }
            gpu.synchronize().expect("sync");
            let us = median(
                (0..30).map(|_| gpu.time_ms(|| gpu.launch_select(&dev, &mut job)).expect("time") * 1e3).collect(),
            );
            select_rows.push((what, n, r, us));
        }
        for (what, n, r, us) in select_rows {
            println!(
                "{}",
                json!({"bench": "select", "device": "cuda", "method": what, "tokens": tokens, "kv_heads": 8,
                       "q_heads": 32, "head_dim": 128, "scored_per_head": n, "r": r,
                       "time_us": (us * 100.0).round() / 100.0})
            );
        }
        let kv_bytes = 2 * shape.kv_len(tokens) * 2;
        let sparse_bytes = 2 * rows_attended * shape.kv_heads * 128 * 2;
        for (method, us, bytes, tier) in [
            ("exact", exact_us, kv_bytes, "gpu"),
            ("sparse_hbm", hbm_us, sparse_bytes, "gpu"),
            ("sparse_host", host_us, sparse_bytes, "host"),
        ] {
            println!(
                "{}",
                json!({
                    "bench": "decode", "device": "cuda", "method": method, "tokens": tokens, "batch": 1,
                    "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "f16", "codec": "f16",
                    "time_us": (us * 100.0).round() / 100.0, "exact_tokens": if method == "exact" { tokens } else { rows_attended },
                    "bytes_read": bytes, "kv_tier": tier,
                    "gbps": (bytes as f64 / us / 1e3 * 10.0).round() / 10.0,
                })
            );
        }
    }
}
