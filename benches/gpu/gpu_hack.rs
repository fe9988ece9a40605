//! GPU benchmark of the `hack2` codec (feature `cuda`, run on the GPU machine by
//! `benches/gpu/hack.sh`): one layer, 32 q heads / 8 kv heads, d=128, batch 1. Times, with
//! CUDA events (median of 30 after warm-up), over the same rows:
//! - `hack2_homomorphic`: attention computed on the 2-bit codes (dp4a integer products);
//! - `hack2_dequant_attend`: dequantize the 2-bit rows to f16, then the exact f16 kernel
//!   (what a codec without homomorphic attention does every step);
//! - `exact_f16`: the exact f16 kernel over the original f16 rows in HBM;
//! - `hack2_homomorphic_sparse`: the homomorphic kernel over a sparse plan's rows only
//!   (per KV head, 1.8% of the tokens in runs of 16, as a wave plan's retrieved clusters),
//!   reading only the value blocks they touch;
//! - `hack2_homomorphic_paged`: the kernel the engine runs over 2-bit blocks homed in the
//!   buffer manager, over every row, each value block read in place from 2 KiB pages
//!   scattered in device memory (as Gpu-tier blocks are);
//! - `kv43_homomorphic`: the `kv43` codec's kernel (4-bit per-channel keys, 3-bit values,
//!   0.25× f16's bytes) over every row, on the codes (`GpuBackend::launch_kv43`).
//!
//! Prints one JSON line per configuration with the bytes read; `compare.py` adds PyTorch
//! SDPA over f16 KV measured in the same command and prints the ratios.

use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::{AttnShape, HackParams, HackRows, Kv43Head, Kv43Params};
use serde_json::json;

#[path = "common.rs"]
#[allow(dead_code, reason = "shared with the other GPU benches; this one needs three of its pieces")]
mod common;
use common::{gpu_or_exit, median, tokens_list_arg};

fn main() {
    let tokens_list = tokens_list_arg("32768,131072");
    let gpu = gpu_or_exit();
    eprintln!("device: {}", gpu.name());
    let shape = AttnShape::new(32, 8, 128).expect("shape");
    let d = shape.head_dim;
    for tokens in tokens_list {
        let mut g = SplitMix64::new(tokens as u64);
        let n = shape.kv_len(tokens);
        let k: Vec<half::f16> = (0..n).map(|_| half::f16::from_f32(g.normal())).collect();
        let v: Vec<half::f16> = (0..n).map(|_| half::f16::from_f32(g.normal())).collect();
        let q: Vec<f32> = (0..shape.query_len()).map(|_| g.normal()).collect();
        // Encoding is CPU work done once per stored block; one thread per head.
        let heads: Vec<HackRows> = std::thread::scope(|s| {
            let jobs: Vec<_> = (0..shape.kv_heads)
                .map(|h| {
                    let (k, v) = (&k[h * tokens * d..(h + 1) * tokens * d], &v[h * tokens * d..(h + 1) * tokens * d]);
                    s.spawn(move || {
                        let mut rows = HackRows::new(d, HackParams::default()).expect("rows");
                        rows.push_rows(k, v, &mut SplitMix64::new(h as u64)).expect("encode");
                        rows
                    })
                })
                .collect();
            jobs.into_iter().map(|j| j.join().expect("encoder thread")).collect()
        });
        let bits = |x: &[half::f16]| x.iter().map(|h| h.to_bits()).collect::<Vec<u16>>();
        let f16_kv = gpu.upload(&bits(&k), &bits(&v), shape.kv_heads).expect("upload f16");
        let dev = gpu.upload_hack(&heads).expect("upload 2-bit rows");
        let mut deq = gpu.alloc_kv(shape.kv_heads, tokens).expect("f16 buffers");
        let mut hack_job = gpu.prepare_hack(&shape, &q, &dev).expect("prepare");
        let mut exact_job = gpu.prepare(&shape, &q, tokens, None).expect("prepare");
        let time = |f: &mut dyn FnMut()| {
            for _ in 0..5 {
                f();
            }
            gpu.synchronize().expect("sync");
            median(
                (0..30)
                    .map(|_| {
                        gpu.time_ms(|| {
                            f();
                            Ok(())
                        })
                        .expect("time")
                            * 1e3
                    })
                    .collect(),
            )
        };
        let homomorphic = time(&mut || gpu.launch_hack(&dev, &mut hack_job).expect("launch"));
        // A sparse plan's retrieval zone: 1.8% of the tokens per head, runs of 16 rows.
        let runs = (tokens * 18 / 1000).div_ceil(16);
        let ranges: Vec<Vec<std::ops::Range<usize>>> = (0..shape.kv_heads)
            .map(|_| {
                (0..runs)
                    .map(|_| {
                        let start = g.below(tokens / 16) * 16;
                        start..(start + 16).min(tokens)
                    })
                    .collect()
            })
            .collect();
        let touched: usize = ranges
            .iter()
            .map(|runs| {
                let mut blocks: Vec<usize> = runs.iter().map(|r| r.start / 64).collect();
                blocks.sort_unstable();
                blocks.dedup();
                blocks.len()
            })
            .sum();
        let mut sparse_job = gpu.prepare_hack_rows(&shape, &q, &dev, &ranges).expect("prepare sparse");
        let sparse = time(&mut || gpu.launch_hack(&dev, &mut sparse_job).expect("launch"));
        let sparse_bytes = dev.bytes() * touched / (shape.kv_heads * tokens.div_ceil(64));
        let dequant_attend = time(&mut || {
            gpu.dequantize_hack(&dev, &mut deq).expect("dequantize");
            gpu.launch(deq.pointers(&gpu), &mut exact_job).expect("launch");
        });
        let exact = time(&mut || gpu.launch(f16_kv.pointers(&gpu), &mut exact_job).expect("launch"));
        let pages = gpu.upload_hack_pages(&heads, 2048, 1).expect("upload pages");
        let mut paged_job = gpu.prepare_hack_paged(&shape, &q, pages.groups(), pages.page_bytes()).expect("prepare");
        let paged = time(&mut || gpu.launch_hack_paged(&mut paged_job).expect("launch"));
        // kv43 rows of the same KV, encoded per head in parallel.
        let kv43: Vec<Kv43Head> = std::thread::scope(|s| {
            let jobs: Vec<_> = (0..shape.kv_heads)
                .map(|h| {
                    let wide = |x: &[half::f16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
                    let (k, v) = (
                        wide(&k[h * tokens * d..(h + 1) * tokens * d]),
                        wide(&v[h * tokens * d..(h + 1) * tokens * d]),
                    );
                    s.spawn(move || {
                        let mut head = Kv43Head::new(d, Kv43Params::default()).expect("kv43 head");
                        head.append(&k, &v).expect("encode");
                        head
                    })
                })
                .collect();
            jobs.into_iter().map(|j| j.join().expect("encoder thread")).collect()
        });
        let dev43 = gpu.upload_kv43(&kv43).expect("upload kv43 rows");
        let mut kv43_job = gpu.prepare_kv43(&shape, &q, &dev43).expect("prepare kv43");
        let kv43_us = time(&mut || gpu.launch_kv43(&dev43, None, &mut kv43_job).expect("launch kv43"));
        // Tuning: the kv43 kernel at other CTA targets (`ATTNSTORE_BENCH_KV43_CTAS=1024,4096`),
        // each a line `kv43_homomorphic_ctas{N}`.
        for ctas in std::env::var("ATTNSTORE_BENCH_KV43_CTAS")
            .unwrap_or_default()
            .split(',')
            .filter_map(|c| c.parse::<usize>().ok())
        {
            std::env::set_var("ATTNSTORE_KV43_CTAS", ctas.to_string());
            let mut job = gpu.prepare_kv43(&shape, &q, &dev43).expect("prepare kv43");
            std::env::remove_var("ATTNSTORE_KV43_CTAS");
            let us = time(&mut || gpu.launch_kv43(&dev43, None, &mut job).expect("launch kv43"));
            println!(
                "{}",
                json!({"bench": "decode", "device": "cuda", "method": format!("kv43_homomorphic_ctas{ctas}"), "tokens": tokens,
                       "batch": 1, "codec": "kv43", "time_us": (us * 10.0).round() / 10.0, "bytes": dev43.bytes()})
            );
        }
        let f16_bytes = 2 * n * 2;
        for (method, us, bytes) in [
            ("hack2_homomorphic", homomorphic, dev.bytes()),
            ("hack2_dequant_attend", dequant_attend, dev.bytes() + 2 * f16_bytes),
            ("exact_f16", exact, f16_bytes),
            ("hack2_homomorphic_sparse", sparse, sparse_bytes),
            ("hack2_homomorphic_paged", paged, pages.bytes()),
            ("kv43_homomorphic", kv43_us, dev43.bytes()),
        ] {
            println!(
                "{}",
                json!({"bench": "decode", "device": "cuda", "method": method, "tokens": tokens, "batch": 1,
                       "q_heads": 32, "kv_heads": 8, "head_dim": 128, 
                       "codec": if method == "exact_f16" { "f16" } else if method.starts_with("kv43") { "kv43" } else { "hack2" },
                       "time_us": (us * 10.0).round() / 10.0, "bytes": bytes,
                       "gbps": ((bytes as f64 / us / 1e3) * 10.0).round() / 10.0})
            );
        }
    }
}
