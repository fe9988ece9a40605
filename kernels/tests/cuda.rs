//! CUDA kernels against the CPU kernels (run only with `--features cuda` and
//! `ATTNSTORE_GPU=1`, on the GPU machine through `../shared/gpu/stage`).
#![cfg(feature = "cuda")]

use attnstore_kernels::cpu::attention::exact_attention;
use attnstore_kernels::cpu::reference::{reference_attention, rel_l2};
use attnstore_kernels::cuda::GpuBackend;
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::{narrow_vec, AttnShape, HeadsView};
use half::f16;

fn gpu() -> Option<GpuBackend> {
    if std::env::var("ATTNSTORE_GPU").as_deref() != Ok("1") {
        eprintln!("skipped: set ATTNSTORE_GPU=1 on a machine with a GPU to run the CUDA tests");
        return None;
    }
    Some(GpuBackend::new(128).expect("ATTNSTORE_GPU=1 but no usable GPU"))
}

fn data(shape: &AttnShape, tokens: usize, seed: u64) -> (Vec<f16>, Vec<f16>, Vec<f32>) {
    let mut g = SplitMix64::new(seed);
    let k: Vec<f32> = (0..shape.kv_len(tokens)).map(|_| g.normal()).collect();
    let v: Vec<f32> = (0..shape.kv_len(tokens)).map(|_| g.normal()).collect();
    let q: Vec<f32> = (0..shape.query_len()).map(|_| g.normal() * 2.0).collect();
    (narrow_vec(&k), narrow_vec(&v), q)
}

fn bits(x: &[f16]) -> Vec<u16> {
    x.iter().map(|h| h.to_bits()).collect()
}

#[test]
fn exact_decode_on_the_gpu_equals_the_cpu_kernel() {
    let Some(gpu) = gpu() else { return };
    for (q_heads, tokens) in [(32, 5000), (8, 131_072), (24, 777)] {
        let shape = AttnShape::new(q_heads, 8.min(q_heads), 128).unwrap();
        let (k, v, q) = data(&shape, tokens, tokens as u64);
        let kv = gpu.upload(&bits(&k), &bits(&v), shape.kv_heads).unwrap();
        let mut job = gpu.prepare(&shape, &q, tokens, None).unwrap();
        gpu.launch(kv.pointers(&gpu), &mut job).unwrap();
        let got = gpu.fetch(&job).unwrap();
        let kview = HeadsView::new(&k, shape.kv_heads, tokens, 128).unwrap();
        let vview = HeadsView::new(&v, shape.kv_heads, tokens, 128).unwrap();
        let cpu = exact_attention(&shape, &q, kview, vview).unwrap();
        let reference = reference_attention(&shape, &q, kview, vview, None);
        let (e_gpu, e_cpu) = (rel_l2(&got, &reference), rel_l2(&cpu, &reference));
        assert!(e_gpu <= 1e-4, "q_heads={q_heads} tokens={tokens}: GPU error {e_gpu} (CPU {e_cpu})");
    }
}

#[test]
fn row_lists_over_mapped_host_memory_equal_attention_over_those_rows() {
    let Some(gpu) = gpu() else { return };
    let shape = AttnShape::new(32, 8, 128).unwrap();
    let tokens = 20_000;
    let (k, v, q) = data(&shape, tokens, 5);
    let mapped = gpu.pin(&bits(&k), &bits(&v), shape.kv_heads).unwrap();
    let mut g = SplitMix64::new(6);
    // Per KV head: a steady zone (first 4, last 64) plus clusters of 16 rows at random.
    let lists: Vec<Vec<u32>> = (0..shape.kv_heads)
        .map(|_| {
            let mut l: Vec<u32> = (0..4).chain(tokens as u32 - 64..tokens as u32).collect();
            for _ in 0..20 {
                let s = 4 + g.below(tokens - 100) as u32;
                l.extend(s..s + 16);
            }
            l.sort_unstable();
            l.dedup();
            l
        })
        .collect();
    let mut job = gpu.prepare(&shape, &q, tokens, Some(&lists)).unwrap();
    gpu.launch(mapped.pointers(), &mut job).unwrap();
    let got = gpu.fetch(&job).unwrap();
    let kview = HeadsView::new(&k, shape.kv_heads, tokens, 128).unwrap();
    let vview = HeadsView::new(&v, shape.kv_heads, tokens, 128).unwrap();
    let subsets: Vec<Vec<u32>> = (0..shape.q_heads).map(|j| lists[j / shape.group()].clone()).collect();
    let want = reference_attention(&shape, &q, kview, vview, Some(&subsets));
    let err = rel_l2(&got, &want);
    assert!(err <= 1e-4, "{err}");
    // Every row listed is exact attention again.
    let all: Vec<Vec<u32>> = (0..shape.kv_heads).map(|_| (0..tokens as u32).collect()).collect();
    let mut job = gpu.prepare(&shape, &q, tokens, Some(&all)).unwrap();
    gpu.launch(mapped.pointers(), &mut job).unwrap();
    let err = rel_l2(&gpu.fetch(&job).unwrap(), &reference_attention(&shape, &q, kview, vview, None));
    assert!(err <= 1e-4, "all rows listed: {err}");
}

#[test]
fn bad_gpu_inputs_are_typed_errors() {
    let Some(gpu) = gpu() else { return };
    let shape = AttnShape::new(8, 2, 128).unwrap();
    let q = vec![0.0f32; shape.query_len()];
    assert!(gpu.prepare(&shape, &q, 100, Some(&[vec![5], vec![100]])).is_err(), "row beyond the head");
    assert!(gpu.prepare(&shape, &q[1..], 100, None).is_err(), "query length");
    let wide_group = AttnShape::new(32, 2, 128).unwrap();
    assert!(gpu.prepare(&wide_group, &vec![0.0; wide_group.query_len()], 100, None).is_err(), "group of 16");
    assert!(GpuBackend::new(100).is_err(), "head_dim not a multiple of 32");
    assert!(gpu.upload(&[0; 300], &[0; 300], 2).is_err(), "ragged KV");
}

#[test]
fn cache_hits_and_host_misses_in_one_plan_equal_attention_over_those_rows() {
    use attnstore_kernels::cuda::RowRef;
    let Some(gpu) = gpu() else { return };
    let shape = AttnShape::new(32, 8, 128).unwrap();
    let tokens = 4096;
    let (k, v, q) = data(&shape, tokens, 8);
    let mapped = gpu.pin(&bits(&k), &bits(&v), shape.kv_heads).unwrap();
    let mut cache = gpu.cache(1000).unwrap();
    // Rows 100..300 of the first heads are admitted (1000 slots); the plan reads 100..400 of
    // every head, so some rows are cache hits and the rest misses read from pinned memory.
    let admitted: Vec<(u32, u32, u32)> = (0..8u32)
        .flat_map(|h| (100..300u32).map(move |r| (h, r)))
        .enumerate()
        .map(|(i, (h, r))| (h, r, i as u32))
        .take(1000)
        .collect();
    gpu.admit(mapped.pointers(), &mut cache, &admitted).unwrap();
    let slot_of: std::collections::HashMap<(u32, u32), u32> = admitted.iter().map(|&(h, r, s)| ((h, r), s)).collect();
    let lists: Vec<Vec<RowRef>> = (0..8u32)
        .map(|h| (100..400u32).map(|r| slot_of.get(&(h, r)).map_or(RowRef::Kv(r), |&s| RowRef::Cache(s))).collect())
        .collect();
    assert!(
        lists.iter().flatten().any(|r| matches!(r, RowRef::Cache(_)))
            && lists.iter().flatten().any(|r| matches!(r, RowRef::Kv(_)))
    );
    let mut job = gpu.prepare_refs(&shape, &q, tokens, Some(&lists), cache.slots()).unwrap();
    gpu.launch_cached(mapped.pointers(), Some(&cache), &mut job).unwrap();
    let got = gpu.fetch(&job).unwrap();
    let kview = HeadsView::new(&k, shape.kv_heads, tokens, 128).unwrap();
    let vview = HeadsView::new(&v, shape.kv_heads, tokens, 128).unwrap();
    let subsets: Vec<Vec<u32>> = (0..shape.q_heads).map(|_| (100..400).collect()).collect();
    let err = rel_l2(&got, &reference_attention(&shape, &q, kview, vview, Some(&subsets)));
    assert!(err <= 1e-4, "{err}");
    // A job naming more slots than the cache has is refused before launch.
    assert!(gpu.prepare_refs(&shape, &q, tokens, Some(&lists), 10).is_err());
    assert!(gpu.launch_cached(mapped.pointers(), None, &mut job).is_err());
}

#[test]
fn centroid_scoring_and_top_r_on_the_gpu_match_the_cpu() {
    use attnstore_kernels::cpu::scoring::{score_group, top_r};
    let Some(gpu) = gpu() else { return };
    let shape = AttnShape::new(32, 8, 128).unwrap();
    let n = 8192;
    let mut g = SplitMix64::new(12);
    let cent: Vec<f16> = narrow_vec(&(0..8 * n * 128).map(|_| g.normal()).collect::<Vec<f32>>());
    let q: Vec<f32> = (0..shape.query_len()).map(|_| g.normal()).collect();
    let dev = gpu.upload_centroids(&bits(&cent), 8).unwrap();
    for r in [1, 148, 2000] {
        let mut job = gpu.prepare_select(&shape, &q, &dev, r).unwrap();
        gpu.launch_select(&dev, &mut job).unwrap();
        let chosen = gpu.fetch_select(&dev, &mut job).unwrap();
        let scores = gpu.select_scores(&dev, &mut job).unwrap();
        for h in 0..8 {
            let mut cpu = vec![Vec::new(); 4];
            score_group(
                &q[h * 512..(h + 1) * 512],
                4,
                &cent[h * n * 128..(h + 1) * n * 128],
                1.0 / 128f32.sqrt(),
                &mut cpu,
            );
            let best: Vec<f32> = (0..n).map(|c| cpu.iter().map(|s| s[c]).fold(f32::NEG_INFINITY, f32::max)).collect();
            for c in 0..n {
                assert!((scores[h * n + c] - best[c]).abs() < 1e-3 * (1.0 + best[c].abs()), "score h={h} c={c}");
            }
            let mut got = chosen[h].clone();
            got.sort_unstable();
            got.dedup();
            assert_eq!(got.len(), r, "r distinct indices");
            // The GPU's set is a true top-r of its own scores (ties at the threshold may differ
            // from the CPU's choice, so compare scores, not indices).
            let gpu_scores = &scores[h * n..(h + 1) * n];
            let kth = gpu_scores[top_r(gpu_scores, r)[r - 1] as usize];
            assert!(got.iter().all(|&i| gpu_scores[i as usize] >= kth - 1e-6), "h={h} r={r}: below the r-th score");
            let want: std::collections::HashSet<u32> = top_r(&best, r).into_iter().collect();
            let overlap = got.iter().filter(|i| want.contains(i)).count();
            assert!(overlap + 2 >= r, "h={h} r={r}: overlap {overlap}");
        }
    }
    assert!(gpu.prepare_select(&shape, &q, &dev, 0).is_err());
    assert!(gpu.prepare_select(&shape, &q, &dev, n + 1).is_err());
}

/// 2-bit rows of every KV head of `k`/`v` (`kv_heads × tokens × d`).
fn hack_heads(shape: &AttnShape, tokens: usize, k: &[f16], v: &[f16]) -> Vec<attnstore_kernels::HackRows> {
    let d = shape.head_dim;
    (0..shape.kv_heads)
        .map(|h| {
            let mut rows = attnstore_kernels::HackRows::new(d, attnstore_kernels::HackParams::default()).unwrap();
            let r = h * tokens * d..(h + 1) * tokens * d;
            rows.push_rows(&k[r.clone()], &v[r], &mut SplitMix64::new(h as u64)).unwrap();
            rows
        })
        .collect()
}

#[test]
fn homomorphic_decode_on_the_gpu_equals_the_cpu_kernel_and_dequantize_then_attend() {
    let Some(gpu) = gpu() else { return };
    for (q_heads, tokens) in [(32, 5000), (8, 131_072), (24, 777)] {
        let shape = AttnShape::new(q_heads, 8.min(q_heads), 128).unwrap();
        let (k, v, q) = data(&shape, tokens, tokens as u64 + 1);
        let heads = hack_heads(&shape, tokens, &k, &v);
        let dev = gpu.upload_hack(&heads).unwrap();
        let mut job = gpu.prepare_hack(&shape, &q, &dev).unwrap();
        gpu.launch_hack(&dev, &mut job).unwrap();
        let got = gpu.fetch_hack(&job).unwrap();
        // The CPU kernel: the same integer products, 7-bit probabilities per 64-row block.
        let (d, g) = (shape.head_dim, shape.group());
        let mut cpu = Vec::new();
        for (h, rows) in heads.iter().enumerate() {
            let mut parts = vec![attnstore_kernels::Partial::empty(d); g];
            let qh = &q[h * g * d..(h + 1) * g * d];
            rows.attend(qh, shape.scale(), &[0..tokens], &mut parts, &mut attnstore_kernels::HackScratch::default());
            cpu.extend(parts.iter().flat_map(|p| p.finish()));
        }
        let cpu64: Vec<f64> = cpu.iter().map(|&x| f64::from(x)).collect();
        let err = rel_l2(&got, &cpu64);
        assert!(err <= 1e-3, "q_heads={q_heads} tokens={tokens}: GPU vs CPU homomorphic {err}");
        // Dequantize, then the exact f16 kernel: the same rows, no 8-bit operands.
        let mut kv = gpu.alloc_kv(shape.kv_heads, tokens).unwrap();
        gpu.dequantize_hack(&dev, &mut kv).unwrap();
        let mut exact = gpu.prepare(&shape, &q, tokens, None).unwrap();
        gpu.launch(kv.pointers(&gpu), &mut exact).unwrap();
        let deq = gpu.fetch(&exact).unwrap();
        let mut dk = Vec::new();
        let mut dv = Vec::new();
        for rows in &heads {
            let (a, b) = rows.decode_rows(0..tokens);
            dk.extend(a);
            dv.extend(b);
        }
        let (dk, dv): (Vec<f16>, Vec<f16>) = (narrow_vec(&dk), narrow_vec(&dv));
        let kview = HeadsView::new(&dk, shape.kv_heads, tokens, d).unwrap();
        let vview = HeadsView::new(&dv, shape.kv_heads, tokens, d).unwrap();
        let reference = reference_attention(&shape, &q, kview, vview, None);
        assert!(rel_l2(&deq, &reference) <= 1e-3, "dequantized rows on the GPU differ from the CPU's");
        // The 8-bit query and 7-bit probabilities cost little next to the 2-bit rows.
        let homomorphic = rel_l2(&got, &reference);
        assert!(homomorphic <= 0.05, "homomorphic vs dequantized attention: {homomorphic}");
    }
}
