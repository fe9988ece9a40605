//! CUDA kernels against the CPU kernels (run only with `--features cuda` and
//! `ATTNSTORE_GPU=1`, on the GPU machine through `../shared/gpu/stage`).
#![cfg(feature = "cuda")]

use attnstore_kernels::cpu::attention::exact_attention;
use attnstore_kernels::cpu::reference::{reference_attention, rel_l2};
use attnstore_kernels::cuda::{ArenaCache, GpuBackend, SharedRows, WaveCache, WaveStep};
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
    let Some(gpu) = gpu() else { return };
    let shape = AttnShape::new(32, 8, 128).unwrap();
    // 8192 centroids per head keep the select's keys in registers (1024 threads × 8); 20000
    // (not a multiple of 1024) first filters candidates with many CTAs per head.
    for (n, seed) in [(8192, 12), (20_000, 13)] {
        check_select(&gpu, &shape, n, seed);
    }
    // Past the registers: a job launched again (its candidate counts and histogram cleared
    // by the last launch) chooses the same clusters, and equal scores (every centroid the
    // same) still give r distinct indices.
    let n = 20_000;
    let mut g = SplitMix64::new(15);
    let q: Vec<f32> = (0..shape.query_len()).map(|_| g.normal()).collect();
    let cent: Vec<f16> = narrow_vec(&(0..8 * n * 128).map(|_| g.normal()).collect::<Vec<f32>>());
    let dev = gpu.upload_centroids(&bits(&cent), 8).unwrap();
    let mut job = gpu.prepare_select(&shape, &q, &dev, 300).unwrap();
    let sorted = |mut x: Vec<Vec<u32>>| {
        x.iter_mut().for_each(|h| h.sort_unstable());
        x
    };
    gpu.launch_select(&dev, &mut job).unwrap();
    let first = sorted(gpu.fetch_select(&job).unwrap());
    for _ in 0..3 {
        gpu.launch_select(&dev, &mut job).unwrap();
        assert_eq!(sorted(gpu.fetch_select(&job).unwrap()), first, "a launch again chooses the same");
    }
    let same = vec![f16::from_f32(0.5); 8 * n * 128];
    let dev = gpu.upload_centroids(&bits(&same), 8).unwrap();
    for r in [1, 777, n] {
        let mut job = gpu.prepare_select(&shape, &q, &dev, r).unwrap();
        for _ in 0..2 {
            gpu.launch_select(&dev, &mut job).unwrap();
            for (h, mut got) in gpu.fetch_select(&job).unwrap().into_iter().enumerate() {
                got.sort_unstable();
                got.dedup();
                assert_eq!(got.len(), r, "head {h}: r distinct indices among equal scores");
                assert!(got.iter().all(|&i| (i as usize) < n));
            }
        }
    }
}

/// Scores and the top-r selection of `n` random centroids per KV head against the CPU's.
fn check_select(gpu: &GpuBackend, shape: &AttnShape, n: usize, seed: u64) {
    use attnstore_kernels::cpu::scoring::{score_group, top_r};
    let mut g = SplitMix64::new(seed);
    let cent: Vec<f16> = narrow_vec(&(0..8 * n * 128).map(|_| g.normal()).collect::<Vec<f32>>());
    let q: Vec<f32> = (0..shape.query_len()).map(|_| g.normal()).collect();
    let dev = gpu.upload_centroids(&bits(&cent), 8).unwrap();
    for r in [1, 148, 2000] {
        let mut job = gpu.prepare_select(shape, &q, &dev, r).unwrap();
        gpu.launch_select(&dev, &mut job).unwrap();
        let chosen = gpu.fetch_select(&job).unwrap();
        let scores = gpu.select_scores(&job).unwrap();
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
            assert!(overlap + 2 >= r, "n={n} h={h} r={r}: overlap {overlap}");
        }
    }
    assert!(gpu.prepare_select(shape, &q, &dev, 0).is_err());
    assert!(gpu.prepare_select(shape, &q, &dev, n + 1).is_err());
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

/// The CPU homomorphic kernel over `runs[h]` of each head's 2-bit rows: the outputs the GPU
/// kernels must give (the same integer products, 7-bit probabilities per 64-row block).
fn cpu_homomorphic(
    heads: &[attnstore_kernels::HackRows],
    shape: &AttnShape,
    q: &[f32],
    runs: &[Vec<std::ops::Range<usize>>],
) -> Vec<f64> {
    let (d, g) = (shape.head_dim, shape.group());
    let mut out = Vec::new();
    for (h, (rows, runs)) in heads.iter().zip(runs).enumerate() {
        let mut parts = vec![attnstore_kernels::Partial::empty(d); g];
        let qh = &q[h * g * d..(h + 1) * g * d];
        rows.attend(qh, shape.scale(), runs, &mut parts, &mut attnstore_kernels::HackScratch::default());
        out.extend(parts.iter().flat_map(|p| p.finish()).map(f64::from));
    }
    out
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
        let d = shape.head_dim;
        let err = rel_l2(&got, &cpu_homomorphic(&heads, &shape, &q, &vec![vec![0..tokens]; shape.kv_heads]));
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

#[test]
fn homomorphic_decode_over_a_sparse_plans_rows_on_the_gpu_equals_the_cpu_kernel() {
    let Some(gpu) = gpu() else { return };
    let shape = AttnShape::new(32, 8, 128).unwrap();
    let tokens = 20_000;
    let (k, v, q) = data(&shape, tokens, 77);
    let heads = hack_heads(&shape, tokens, &k, &v);
    let dev = gpu.upload_hack(&heads).unwrap();
    // Per head, runs like a wave plan's retrieved clusters (some inside one value block,
    // some across blocks), a different set per head; one head selects a single row.
    let mut rng = SplitMix64::new(5);
    let ranges: Vec<Vec<std::ops::Range<usize>>> = (0..shape.kv_heads)
        .map(|h| match h {
            3 => vec![tokens - 1..tokens],
            _ => (0..40 + 10 * h)
                .map(|_| {
                    let start = rng.below(tokens - 40);
                    start..start + 1 + rng.below(39)
                })
                .collect(),
        })
        .collect();
    let mut job = gpu.prepare_hack_rows(&shape, &q, &dev, &ranges).unwrap();
    gpu.launch_hack(&dev, &mut job).unwrap();
    let got = gpu.fetch_hack(&job).unwrap();
    // Overlapping runs on the GPU count a row once: give the CPU the same row set.
    let runs: Vec<Vec<_>> = ranges
        .iter()
        .map(|r| {
            let mut set: Vec<usize> = r.iter().flat_map(|r| r.clone()).collect();
            set.sort_unstable();
            set.dedup();
            set.iter().map(|&r| r..r + 1).collect()
        })
        .collect();
    let err = rel_l2(&got, &cpu_homomorphic(&heads, &shape, &q, &runs));
    assert!(err <= 1e-3, "sparse rows: GPU vs CPU homomorphic {err}");
    // Rows past the end, or runs for the wrong number of heads, are typed errors.
    let mut bad = ranges.clone();
    bad[0].push(tokens..tokens + 1);
    assert!(gpu.prepare_hack_rows(&shape, &q, &dev, &bad).is_err());
    assert!(gpu.prepare_hack_rows(&shape, &q, &dev, &ranges[1..]).is_err());
}

#[test]
fn homomorphic_decode_over_paged_groups_on_the_gpu_equals_the_cpu_kernel() {
    let Some(gpu) = gpu() else { return };
    let shape = AttnShape::new(32, 8, 128).unwrap();
    // 5000 rows: 78 full value blocks and a last one of 8 rows.
    let tokens = 5000;
    let (k, v, q) = data(&shape, tokens, 91);
    let heads = hack_heads(&shape, tokens, &k, &v);
    let blocks = tokens.div_ceil(64);
    let mut groups: Vec<Vec<attnstore_kernels::cuda::PagedGroup>> = Vec::new();
    // Pages of the buffer manager's 2 KiB (a power of two: the kernel shifts) and of 1984
    // bytes (it divides).
    for page in [2048, 1984] {
        // Every value block's group bytes in pages at shuffled places of one buffer, as the
        // buffer manager scatters a cluster's blocks.
        let pages = gpu.upload_hack_pages(&heads, page, 13).unwrap();
        assert_eq!(pages.groups().iter().map(Vec::len).collect::<Vec<_>>(), vec![blocks; shape.kv_heads]);
        // Per head: a different subset of blocks with random row masks; head 2 also lists
        // the short last block, head 5 every row of every block.
        let mut rng = SplitMix64::new(17);
        let mut runs: Vec<Vec<std::ops::Range<usize>>> = Vec::new();
        groups.clear();
        for (h, all_blocks) in pages.groups().iter().enumerate() {
            let (mut list, mut rows) = (Vec::new(), Vec::new());
            for (b, all) in all_blocks.iter().enumerate() {
                let mask = match h {
                    5 => all.mask,
                    2 if b == blocks - 1 => all.mask,
                    _ if rng.below(3) == 0 => (rng.next_u64() & rng.next_u64()) & all.mask,
                    _ => 0,
                };
                if mask == 0 {
                    continue;
                }
                list.push(attnstore_kernels::cuda::PagedGroup { mask, ..all.clone() });
                rows.extend((0..64).filter(|r| mask >> r & 1 == 1).map(|r| b * 64 + r..b * 64 + r + 1));
            }
            groups.push(list);
            runs.push(rows);
        }
        let cpu = cpu_homomorphic(&heads, &shape, &q, &runs);
        let mut job = gpu.prepare_hack_paged(&shape, &q, &groups, page).unwrap();
        gpu.launch_hack_paged(&mut job).unwrap();
        let got: Vec<f32> = gpu.fetch_hack_partials(&job).unwrap().iter().flat_map(|p| p.finish()).collect();
        let err = rel_l2(&got, &cpu);
        assert!(err <= 1e-3, "paged groups, pages of {page} bytes: GPU vs CPU homomorphic {err}");
    }
    let page = 1984;
    // Groups that do not fit their layout are typed errors.
    let mut bad = groups.clone();
    bad[0][0].pages.pop();
    assert!(gpu.prepare_hack_paged(&shape, &q, &bad, page).is_err(), "a page missing");
    let mut bad = groups.clone();
    bad[2].last_mut().unwrap().mask = u64::MAX;
    assert!(gpu.prepare_hack_paged(&shape, &q, &bad, page).is_err(), "rows past the short block");
    assert!(gpu.prepare_hack_paged(&shape, &q, &groups[1..], page).is_err(), "groups for 7 of 8 heads");
    assert!(gpu.prepare_hack_paged(&shape, &q, &groups, 2050).is_err(), "pages not a multiple of 4 bytes");
}

/// The CPU's tripartite attention over one step of a [`ClusteredLayer`] with the GPU's
/// selection: exact over the steady zone and the selected clusters, estimation over every
/// other non-empty cluster.
fn cpu_wave_step(
    layer: &attnstore_kernels::layout::ClusteredLayer,
    shape: &AttnShape,
    q: &[f32],
    selection: &[Vec<u32>],
) -> Vec<f32> {
    use attnstore_kernels::cpu::attention::{attend_spans, Scratch};
    use attnstore_kernels::cpu::estimate::{estimate_partial, EstimateItem};
    use attnstore_kernels::Partial;
    let (d, g, n, rows) = (shape.head_dim, shape.group(), layer.clusters, layer.rows);
    let scale = shape.scale();
    let mut out = Vec::new();
    for (h, chosen) in selection.iter().enumerate() {
        let qg = &q[h * g * d..(h + 1) * g * d];
        let (hk, hv) = (&layer.keys[h * rows * d..(h + 1) * rows * d], &layer.values[h * rows * d..(h + 1) * rows * d]);
        let mut spans: Vec<(&[f16], &[f16])> = vec![(&hk[layer.indexed * d..], &hv[layer.indexed * d..])];
        for &c in chosen {
            let r = layer.cluster_rows(h, c as usize);
            spans.push((&hk[r.start * d..r.end * d], &hv[r.start * d..r.end * d]));
        }
        let mut parts = vec![Partial::empty(d); g];
        attend_spans(qg, scale, spans, &mut parts, &mut Scratch::default());
        let chosen: std::collections::HashSet<u32> = chosen.iter().copied().collect();
        for (j, part) in parts.iter_mut().enumerate() {
            let qj = &qg[j * d..(j + 1) * d];
            let items = (0..n).filter(|&c| !chosen.contains(&(c as u32)) && layer.size(h, c) > 0).map(|c| {
                let cent = &layer.centroids[(h * n + c) * d..(h * n + c + 1) * d];
                EstimateItem {
                    score: scale * cent.iter().zip(qj).map(|(x, y)| x.to_f32() * y).sum::<f32>(),
                    size: layer.size(h, c) as f32,
                    value_mean: &layer.value_means[(h * n + c) * d..(h * n + c + 1) * d],
                }
            });
            part.merge(&estimate_partial(d, items));
            out.extend(part.finish());
        }
    }
    out
}

/// A layer of 8192 + 68 tokens per head (keys near 32 topic directions per head, values
/// random) clustered like the wave index, and a query near a few topics per head.
fn clustered_layer() -> (AttnShape, attnstore_kernels::layout::ClusteredLayer, Vec<f32>) {
    use attnstore_kernels::layout::{ClusteredLayer, LayoutParams};
    let shape = AttnShape::new(32, 8, 128).unwrap();
    let (d, kvh, tokens) = (128, 8, 8192 + 68);
    let mut g = SplitMix64::new(21);
    // Keys near 32 topic directions per head (cluster structure), values random.
    let topics: Vec<f32> = (0..kvh * 32 * d).map(|_| g.normal()).collect();
    let mut keys = Vec::with_capacity(kvh * tokens * d);
    for h in 0..kvh {
        for _ in 0..tokens {
            let t = g.below(32);
            keys.extend((0..d).map(|j| 2.0 * topics[(h * 32 + t) * d + j] + g.normal()));
        }
    }
    let values: Vec<f32> = (0..kvh * tokens * d).map(|_| g.normal()).collect();
    let q: Vec<f32> = (0..shape.query_len())
        .map(|i| 0.3 * topics[(i / 512 * 32 + i / 128 % 4) * d + i % d] + 0.1 * g.normal())
        .collect();
    let layer =
        ClusteredLayer::build(&keys, &values, kvh, d, LayoutParams { segment_tokens: 2048, ..Default::default() })
            .unwrap();
    (shape, layer, q)
}

#[test]
fn an_arena_layer_step_equals_the_same_layer_read_from_its_own_rows() {
    use attnstore_kernels::{ArenaWave, HeadClusters};
    let Some(gpu) = gpu() else { return };
    let (shape, layer, q) = clustered_layer();
    let (d, kvh, per_block) = (128, 8, 4);
    let block_rows = 2 * per_block;
    // Scatter every head's clusters into blocks of 4 tokens ([K × 4][V × 4]) at shuffled
    // places of one arena, the way the buffer manager homes them.
    let blocks: usize =
        (0..kvh).map(|h| (0..layer.clusters).map(|c| layer.size(h, c).div_ceil(per_block)).sum::<usize>()).sum();
    let mut places: Vec<usize> = (0..blocks + 7).collect();
    let mut g = SplitMix64::new(5);
    for i in (1..places.len()).rev() {
        places.swap(i, g.below(i + 1));
    }
    let mut arena = vec![0u16; places.len() * block_rows * d];
    let (kb, vb) = (bits(&layer.keys), bits(&layer.values));
    let mut maps: Vec<Vec<u32>> = vec![Vec::new(); kvh];
    let mut block_of: Vec<Vec<usize>> = vec![Vec::new(); kvh]; // arena block of every cluster row
    let mut next = 0;
    for h in 0..kvh {
        for c in 0..layer.clusters {
            let rows: Vec<usize> = layer.cluster_rows(h, c).collect();
            for chunk in rows.chunks(per_block) {
                let at = places[next];
                next += 1;
                for (i, &t) in chunk.iter().enumerate() {
                    let src = (h * layer.rows + t) * d;
                    let k = (at * block_rows + i) * d;
                    arena[k..k + d].copy_from_slice(&kb[src..src + d]);
                    arena[k + per_block * d..k + per_block * d + d].copy_from_slice(&vb[src..src + d]);
                    maps[h].push((at * block_rows + i) as u32);
                    block_of[h].push(at);
                }
            }
        }
    }
    let sizes: Vec<Vec<u32>> =
        (0..kvh).map(|h| (0..layer.clusters).map(|c| layer.size(h, c) as u32).collect()).collect();
    let n = layer.clusters;
    let heads: Vec<HeadClusters<'_>> = (0..kvh)
        .map(|h| HeadClusters {
            sizes: &sizes[h],
            centroids: &layer.centroids[h * n * d..(h + 1) * n * d],
            value_means: &layer.value_means[h * n * d..(h + 1) * n * d],
            rows: &maps[h],
        })
        .collect();
    let arena_layer = ArenaWave::new(d, &heads).unwrap();
    let mut wave = gpu.upload_arena_wave(&arena_layer, 128).unwrap();
    // The steady zone (rows indexed..rows of each head), row-major over heads, in two writes.
    let steady = layer.rows - layer.indexed;
    let steady_rows = |src: &[u16], from: usize, to: usize| -> Vec<u16> {
        (from..to)
            .flat_map(|i| (0..kvh).flat_map(move |h| (0..d).map(move |j| (h, i, j))))
            .map(|(h, i, j)| src[(h * layer.rows + layer.indexed + i) * d + j])
            .collect()
    };
    gpu.set_steady(&mut wave, 0, &steady_rows(&kb, 0, 40), &steady_rows(&vb, 0, 40)).unwrap();
    gpu.set_steady(&mut wave, 40, &steady_rows(&kb, 40, steady), &steady_rows(&vb, 40, steady)).unwrap();
    assert_eq!(wave.steady_rows(), steady);
    // A gap, an overflow and a ragged row are typed errors.
    assert!(gpu.set_steady(&mut wave, steady + 1, &steady_rows(&kb, 0, 1), &steady_rows(&vb, 0, 1)).is_err());
    let too_many = steady_rows(&kb, 0, 60);
    assert!(gpu.set_steady(&mut wave, 100, &too_many[..], &too_many[..]).is_err());
    assert!(gpu.set_steady(&mut wave, steady, &kb[..d], &vb[..d]).is_err());
    let pinned_arena = gpu.pin(&arena, &arena, 1).unwrap();
    let pinned = pinned_arena.pointers();
    let row_bytes = (d * 2) as u64;
    let kv = attnstore_kernels::cuda::KvPointers {
        keys: pinned.keys,
        values: pinned.keys + per_block as u64 * row_bytes,
        rows: places.len() * block_rows,
    };
    // The reference: the same layer read from its own rows.
    let own = gpu.pin(&kb, &vb, kvh).unwrap();
    let own_wave = gpu.upload_wave(&layer).unwrap();
    let r = 24;
    let mut own_job = gpu.prepare_wave(&shape, &own_wave, r).unwrap();
    gpu.set_wave_query(&mut own_job, &q).unwrap();
    gpu.launch_wave(&own_wave, own.pointers(), None, &mut own_job).unwrap();
    let want: Vec<f64> = gpu.fetch_wave(&own_job).unwrap().iter().map(|&x| f64::from(x)).collect();
    let mut job = gpu.prepare_wave(&shape, &wave, r).unwrap();
    gpu.set_wave_query(&mut job, &q).unwrap();
    gpu.launch_wave(&wave, kv, None, &mut job).unwrap();
    let got = gpu.fetch_wave(&job).unwrap();
    let sorted = |mut x: Vec<Vec<u32>>| {
        x.iter_mut().for_each(|h| h.sort_unstable());
        x
    };
    let selection = sorted(gpu.wave_selection(&job).unwrap());
    assert_eq!(selection, sorted(gpu.wave_selection(&own_job).unwrap()), "same meta index, same clusters");
    assert!(rel_l2(&got, &want) <= 1e-5, "arena rows: {}", rel_l2(&got, &want));
    // A shared Gpu-tier pool holding copies of every other block of the retrieved clusters:
    // hits come from it, and the output is unchanged.
    let mut table = vec![-1i32; places.len()];
    let mut pool = Vec::new();
    for (h, chosen) in selection.iter().enumerate() {
        let offsets = arena_layer.offsets();
        for &c in chosen.iter().step_by(2) {
            let (lo, hi) = (offsets[h * (n + 1) + c as usize], offsets[h * (n + 1) + c as usize + 1]);
            for t in lo..hi {
                let at = block_of[h][t as usize];
                if table[at] < 0 {
                    table[at] = (pool.len() / (block_rows * d)) as i32;
                    pool.extend_from_slice(&arena[at * block_rows * d..(at + 1) * block_rows * d]);
                }
            }
        }
    }
    let slots = pool.len() / (block_rows * d);
    assert!(slots > 0);
    let pool_kv = gpu.upload(&pool, &pool, 1).unwrap();
    let device_pool = pool_kv.pointers(&gpu);
    let device_table = gpu.upload_ints(&table).unwrap();
    let cache = ArenaCache {
        rows: SharedRows {
            keys: device_pool.keys,
            values: device_pool.keys + per_block as u64 * row_bytes,
            rows: slots * block_rows,
        },
        table: device_table.address(),
        block_rows,
    };
    gpu.launch_wave(&wave, kv, Some(WaveCache::Arena(cache)), &mut job).unwrap();
    let cached = gpu.fetch_wave(&job).unwrap();
    assert!(rel_l2(&cached, &want) <= 1e-5, "arena rows with cache hits: {}", rel_l2(&cached, &want));
    // One more steady row (the next decode token) is attended at once, graph or not.
    // Its key is 20 times the first query of each group: it outscores every stored key.
    let extra_k: Vec<u16> = (0..kvh * d).map(|i| f16::from_f32(20.0 * q[(i / d) * 4 * d + i % d]).to_bits()).collect();
    let extra_v: Vec<u16> = (0..kvh * d).map(|_| f16::from_f32(5.0).to_bits()).collect();
    gpu.set_steady(&mut wave, steady, &extra_k, &extra_v).unwrap();
    gpu.launch_wave(&wave, kv, Some(WaveCache::Arena(cache)), &mut job).unwrap();
    let appended = gpu.fetch_wave(&job).unwrap();
    let moved = rel_l2(&appended, &want);
    assert!(moved > 1e-2, "an appended steady row must change the output ({moved})");
    job.set_graphs(false);
    gpu.launch_wave(&wave, kv, Some(WaveCache::Arena(cache)), &mut job).unwrap();
    let eager = gpu.fetch_wave(&job).unwrap();
    assert!(rel_l2(&eager, &appended.iter().map(|&x| f64::from(x)).collect::<Vec<_>>()) <= 1e-6);
    // A layer of its own rows with an arena cache, or an arena layer with a layer table, is
    // refused before any launch.
    assert!(gpu.launch_wave(&own_wave, own.pointers(), Some(WaveCache::Arena(cache)), &mut own_job).is_err());
    let short = attnstore_kernels::cuda::KvPointers { rows: 10, ..kv };
    assert!(gpu.launch_wave(&wave, short, None, &mut job).is_err(), "an arena smaller than the row map");
}

#[test]
fn a_whole_wave_step_on_the_gpu_equals_the_cpu_over_its_selection_with_and_without_cache() {
    use attnstore_kernels::cpu::scoring::{score_group, top_r};
    let Some(gpu) = gpu() else { return };
    let (shape, layer, q) = clustered_layer();
    let (d, kvh) = (128, 8);
    let mapped = gpu.pin(&bits(&layer.keys), &bits(&layer.values), kvh).unwrap();
    let wave = gpu.upload_wave(&layer).unwrap();
    assert_eq!(wave.clusters(), 512);
    let r = 24;
    let mut job = gpu.prepare_wave(&shape, &wave, r).unwrap();
    gpu.set_wave_query(&mut job, &q).unwrap();
    gpu.launch_wave(&wave, mapped.pointers(), None, &mut job).unwrap();
    let got = gpu.fetch_wave(&job).unwrap();
    let selection = gpu.wave_selection(&job).unwrap();
    // The selection is a top-r of the group's best centroid scores.
    for (h, chosen) in selection.iter().enumerate() {
        let mut s = vec![Vec::new(); 4];
        let cent: Vec<f16> = layer.centroids[h * 512 * d..(h + 1) * 512 * d].to_vec();
        score_group(&q[h * 512..(h + 1) * 512], 4, &cent, shape.scale(), &mut s);
        let best: Vec<f32> = (0..512).map(|c| s.iter().map(|x| x[c]).fold(f32::NEG_INFINITY, f32::max)).collect();
        let kth = best[top_r(&best, r)[r - 1] as usize];
        let mut distinct = chosen.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), r, "head {h}: r distinct clusters");
        assert!(chosen.iter().all(|&c| best[c as usize] >= kth - 1e-3), "head {h}: a cluster below the r-th score");
    }
    let want = cpu_wave_step(&layer, &shape, &q, &selection);
    for qh in 0..shape.q_heads {
        let wide: Vec<f64> = want[qh * d..(qh + 1) * d].iter().map(|&x| f64::from(x)).collect();
        let err = rel_l2(&got[qh * d..(qh + 1) * d], &wide);
        assert!(err <= 2e-3, "query head {qh}: {err}");
    }
    // The same step with part of the retrieved clusters and the steady zone in the Gpu tier:
    // hits come from the cache, the rest from pinned memory, and the output is unchanged.
    let mut cache = gpu.cache(4096).unwrap();
    let mut table = gpu.wave_table(&wave, 16).unwrap();
    let mut entries = Vec::new();
    let mut next = 0u32;
    for (h, chosen) in selection.iter().enumerate() {
        let mut blocks: Vec<usize> =
            chosen.iter().step_by(2).flat_map(|&c| layer.cluster_rows(h, c as usize)).map(|t| t / 16).collect();
        blocks.push(layer.rows / 16);
        blocks.dedup();
        for b in blocks {
            if next as usize + 16 > cache.slots() || table.get(h, b).is_some() {
                continue;
            }
            let rows = b * 16..((b + 1) * 16).min(layer.rows);
            entries.extend(rows.enumerate().map(|(i, t)| (h as u32, t as u32, next + i as u32)));
            table.set(h, b, Some(next)).unwrap();
            next += 16;
        }
    }
    assert!(next > 0);
    gpu.admit(mapped.pointers(), &mut cache, &entries).unwrap();
    gpu.upload_table(&mut table).unwrap();
    gpu.launch_wave(&wave, mapped.pointers(), Some(WaveCache::Layer(&cache, &table)), &mut job).unwrap();
    let cached = gpu.fetch_wave(&job).unwrap();
    // The step's own view of its misses: a retrieved cluster is missed iff a row of it lies in
    // a block the table names no cache row for (it was read from the KV rows).
    let fetched = gpu.fetch_wave_selected(&mut job).unwrap();
    assert_eq!(fetched.output, cached);
    let (mut hits, mut misses) = (0, 0);
    let missed = fetched.missed();
    for (h, chosen) in fetched.selection().iter().enumerate() {
        let mut want: Vec<u32> = chosen
            .iter()
            .copied()
            .filter(|&c| layer.cluster_rows(h, c as usize).any(|t| table.get(h, t / 16).is_none()))
            .collect();
        let mut got = missed[h].clone();
        want.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, want, "head {h}: the missed clusters");
        misses += want.len();
        hits += chosen.len() - want.len();
    }
    assert!(hits > 0 && misses > 0, "the step had both hits ({hits}) and misses ({misses})");
    let sorted = |mut x: Vec<Vec<u32>>| {
        x.iter_mut().for_each(|h| h.sort_unstable());
        x
    };
    assert_eq!(sorted(gpu.wave_selection(&job).unwrap()), sorted(selection.clone()), "same query, same clusters");
    // Rows may be listed in another order (the selection's order is not fixed), so the sums
    // may round differently; the rows and their values are the same.
    let err = rel_l2(&cached, &got.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>());
    assert!(err <= 1e-5, "cache hits change the output: {err}");
    // Another query: the marks of the last step's selection were cleared (each step's
    // estimation skips exactly its own retrieved clusters), and launching kernel by kernel
    // gives what the replayed graph gives.
    let q2: Vec<f32> = q.iter().enumerate().map(|(i, x)| if i % 3 == 0 { -x } else { x * 1.5 }).collect();
    gpu.set_wave_query(&mut job, &q2).unwrap();
    gpu.launch_wave(&wave, mapped.pointers(), Some(WaveCache::Layer(&cache, &table)), &mut job).unwrap();
    let second = gpu.fetch_wave(&job).unwrap();
    let selection2 = gpu.wave_selection(&job).unwrap();
    assert_ne!(sorted(selection2.clone()), sorted(selection.clone()), "the second query retrieves other clusters");
    let want2: Vec<f64> = cpu_wave_step(&layer, &shape, &q2, &selection2).iter().map(|&x| f64::from(x)).collect();
    assert!(rel_l2(&second, &want2) <= 2e-3, "second step: {}", rel_l2(&second, &want2));
    job.set_graphs(false);
    gpu.launch_wave(&wave, mapped.pointers(), Some(WaveCache::Layer(&cache, &table)), &mut job).unwrap();
    let eager = gpu.fetch_wave(&job).unwrap();
    assert!(rel_l2(&eager, &second.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>()) <= 1e-6);
    job.set_graphs(true);
    // A batch runs both queries at once, each request on its own streams, and gives each
    // request what it gets alone.
    let mut other = gpu.prepare_wave(&shape, &wave, r).unwrap();
    gpu.set_wave_query(&mut job, &q).unwrap();
    gpu.set_wave_query(&mut other, &q2).unwrap();
    let mut batch = gpu.wave_batch(2).unwrap();
    for _ in 0..2 {
        let mut steps = [
            WaveStep {
                wave: &wave,
                kv: mapped.pointers(),
                cache: Some(WaveCache::Layer(&cache, &table)),
                job: &mut job,
            },
            WaveStep { wave: &wave, kv: mapped.pointers(), cache: None, job: &mut other },
        ];
        gpu.launch_wave_batch(&mut batch, &mut steps).unwrap();
        let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
        assert!(rel_l2(&gpu.fetch_wave(&job).unwrap(), &wide(&cached)) <= 1e-5, "batched request 0");
        assert!(rel_l2(&gpu.fetch_wave(&other).unwrap(), &wide(&second)) <= 1e-5, "batched request 1");
    }
    // Each request launched alone on a lane of its own (twice: captured, then replayed, and
    // on swapped lanes, a graph per lane): the same outputs, and fetch_wave waits for the
    // lane, which the backend's stream does not.
    for lanes in [[0, 1], [0, 1], [1, 0]] {
        let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
        let cache = Some(WaveCache::Layer(&cache, &table));
        gpu.launch_wave_lane(
            &batch,
            lanes[0],
            &mut WaveStep { wave: &wave, kv: mapped.pointers(), cache, job: &mut job },
        )
        .unwrap();
        gpu.launch_wave_lane(
            &batch,
            lanes[1],
            &mut WaveStep { wave: &wave, kv: mapped.pointers(), cache: None, job: &mut other },
        )
        .unwrap();
        assert!(rel_l2(&gpu.fetch_wave(&other).unwrap(), &wide(&second)) <= 1e-5, "lane request 1, lanes {lanes:?}");
        let got = gpu.fetch_wave_selected(&mut job).unwrap();
        assert!(rel_l2(&got.output, &wide(&cached)) <= 1e-5, "lane request 0, lanes {lanes:?}");
        assert_eq!(sorted(got.selection()), sorted(selection.clone()), "lane request 0 retrieves what it did alone");
    }
    let step = &mut WaveStep { wave: &wave, kv: mapped.pointers(), cache: None, job: &mut other };
    assert!(gpu.launch_wave_lane(&batch, 2, step).is_err(), "a lane past the batch's");
    let mut one = [WaveStep { wave: &wave, kv: mapped.pointers(), cache: None, job: &mut other }];
    assert!(gpu.launch_wave_batch(&mut gpu.wave_batch(0).unwrap(), &mut one).is_err(), "more requests than streams");
    // Bad inputs are typed errors, before any launch.
    let small = gpu.cache(16).unwrap();
    assert!(gpu.launch_wave(&wave, mapped.pointers(), Some(WaveCache::Layer(&small, &table)), &mut job).is_err());
    assert!(gpu.set_wave_query(&mut job, &q[1..]).is_err());
    let mut nan = q.clone();
    nan[7] = f32::NAN;
    assert!(gpu.set_wave_query(&mut job, &nan).is_err());
    assert!(table.set(kvh, 0, Some(0)).is_err());
    assert!(gpu.prepare_wave(&shape, &wave, 0).is_err());
    assert!(gpu.prepare_wave(&AttnShape::new(8, 2, 128).unwrap(), &wave, 4).is_err());
}

/// Mean cosine of every indexed row's centred, normalized key to its cluster's normalized
/// member sum, per (head, segment) as the build centres them: the k-means objective a layout
/// reached.
fn layout_objective(l: &attnstore_kernels::layout::ClusteredLayer, keys: &[f32], tokens: usize, seg: usize) -> f64 {
    let d = l.head_dim;
    let (mut total, mut n) = (0.0f64, 0usize);
    for h in 0..l.kv_heads {
        // The centred unit key of every token, per segment of the indexed tokens.
        let sink = l.positions[h * tokens + l.indexed..].iter().take_while(|&&p| (p as usize) < l.indexed).count();
        let mut unit = vec![0.0f32; tokens * d];
        for s0 in (0..l.indexed).step_by(seg) {
            let r = sink + s0..sink + (s0 + seg).min(l.indexed);
            let mut rows = keys[(h * tokens + r.start) * d..(h * tokens + r.end) * d].to_vec();
            attnstore_kernels::cpu::kmeans::center_and_normalize(&mut rows, d);
            unit[r.start * d..r.end * d].copy_from_slice(&rows);
        }
        for c in 0..l.clusters {
            let rows = l.cluster_rows(h, c);
            let mut sum = vec![0.0f32; d];
            for r in rows.clone() {
                let t = l.positions[h * tokens + r] as usize;
                sum.iter_mut().zip(&unit[t * d..(t + 1) * d]).for_each(|(a, b)| *a += b);
            }
            let norm = sum.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-30);
            for r in rows {
                let t = l.positions[h * tokens + r] as usize;
                total += unit[t * d..(t + 1) * d].iter().zip(&sum).map(|(a, b)| (a * b / norm) as f64).sum::<f64>();
                n += 1;
            }
        }
    }
    total / n.max(1) as f64
}

#[test]
fn the_device_build_lays_out_a_layer_like_the_cpu_build() {
    use attnstore_kernels::layout::{ClusteredLayer, LayoutParams};
    use attnstore_kernels::Error;
    let Some(gpu) = gpu() else { return };
    let d = 128;
    let mut g = SplitMix64::new(71);
    let topics: Vec<f32> = (0..40 * d).map(|_| g.normal() * 2.0).collect();
    for (kvh, tokens, seg, tpc, iters) in [
        (2usize, 3000usize, 1024usize, 16usize, 10usize),
        (3, 20_000, 8192, 16, 10),
        (1, 900, 256, 7, 0),
        (2, 50, 64, 16, 10),
    ] {
        let keys: Vec<f32> = (0..kvh * tokens)
            .flat_map(|_| {
                let t = g.below(40);
                (0..d)
                    .map(|j| topics[t * d + j] + 0.8 * g.normal() + if j == 5 { 9.0 } else { 0.0 })
                    .collect::<Vec<_>>()
            })
            .collect();
        let values: Vec<f32> = (0..kvh * tokens * d).map(|_| g.normal()).collect();
        let p =
            LayoutParams { segment_tokens: seg, tokens_per_cluster: tpc, max_iters: iters, ..LayoutParams::default() };
        let dev = ClusteredLayer::build_on_device(&gpu, &keys, &values, kvh, d, p).unwrap();
        let cpu = ClusteredLayer::build(&keys, &values, kvh, d, p).unwrap();
        let what = format!("{kvh} heads × {tokens} tokens, segments of {seg}, {tpc} per cluster");
        assert_eq!((dev.clusters, dev.indexed, dev.rows), (cpu.clusters, cpu.indexed, cpu.rows), "{what}");
        for h in 0..kvh {
            let pos = &dev.positions[h * tokens..(h + 1) * tokens];
            let mut sorted = pos.to_vec();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..tokens as u32).collect::<Vec<_>>(), "{what}: a permutation of the tokens");
            assert_eq!(
                &pos[dev.indexed..],
                &cpu.positions[h * tokens + cpu.indexed..(h + 1) * tokens],
                "{what}: steady zone"
            );
            assert_eq!(dev.offsets[h * (dev.clusters + 1) + dev.clusters] as usize, dev.indexed, "{what}");
            for c in 0..dev.clusters {
                let rows = dev.cluster_rows(h, c);
                assert!(rows.start <= rows.end, "{what}: offsets ascend");
                let members = &pos[rows.clone()];
                assert!(members.windows(2).all(|w| w[0] < w[1]), "{what}: token order kept within a cluster");
                // Every member lies in the segment the cluster belongs to.
                let same = cpu.cluster_rows(h, c);
                let seg_of = |p: u32| (p as usize - 4) / seg;
                if let (Some(&a), Some(&b)) = (members.first(), cpu.positions[h * tokens + same.start..].first()) {
                    if !same.is_empty() {
                        assert_eq!(seg_of(a), seg_of(b), "{what}: cluster {c} in its segment");
                    }
                }
                for j in [0, 5, d - 1] {
                    let n = rows.len().max(1) as f32;
                    let mk = members.iter().map(|&t| keys[(h * tokens + t as usize) * d + j]).sum::<f32>() / n;
                    let mv = members.iter().map(|&t| values[(h * tokens + t as usize) * d + j]).sum::<f32>() / n;
                    let (gk, gv) = (
                        dev.centroids[(h * dev.clusters + c) * d + j],
                        dev.value_means[(h * dev.clusters + c) * d + j],
                    );
                    assert!((gk.to_f32() - mk).abs() <= 2e-2 + 2e-3 * mk.abs(), "{what}: mean key {gk} vs {mk}");
                    assert!((gv.to_f32() - mv).abs() <= 2e-2, "{what}: mean value {gv} vs {mv}");
                }
            }
            for r in [0, dev.indexed / 2, tokens - 1] {
                let t = pos[r] as usize;
                for j in [0, 77] {
                    assert_eq!(
                        dev.keys[(h * tokens + r) * d + j],
                        f16::from_f32(keys[(h * tokens + t) * d + j]),
                        "{what}"
                    );
                    assert_eq!(
                        dev.values[(h * tokens + r) * d + j],
                        f16::from_f32(values[(h * tokens + t) * d + j]),
                        "{what}"
                    );
                }
            }
        }
        if iters == 0 {
            // No update step: every row is in the cluster of its nearest initial centroid, the
            // rows the CPU starts from (f16 unit rows may flip a near tie).
            use attnstore_kernels::cpu::kmeans::{center_and_normalize, initial_centroids, nearest_centroids};
            let (mut same, mut all) = (0, 0);
            for h in 0..kvh {
                for (s, s0) in (0..dev.indexed).step_by(seg).enumerate() {
                    let r = 4 + s0..4 + (s0 + seg).min(dev.indexed);
                    let mut unit = keys[(h * tokens + r.start) * d..(h * tokens + r.end) * d].to_vec();
                    center_and_normalize(&mut unit, d);
                    let (k, kfull) = (r.len().div_ceil(tpc), seg.div_ceil(tpc));
                    let init = initial_centroids(&unit, d, k, p.seed ^ ((h as u64) << 32 | s as u64));
                    let mut nearest = Vec::new();
                    nearest_centroids(&unit, &init, d, &mut nearest).unwrap();
                    for c in 0..k {
                        for row in dev.cluster_rows(h, s * kfull + c) {
                            let t = dev.positions[h * tokens + row] as usize;
                            same += usize::from(nearest[t - r.start] as usize == c);
                            all += 1;
                        }
                    }
                }
            }
            assert_eq!(all, dev.indexed * kvh, "{what}");
            assert!(
                same * 1000 >= all * 995,
                "{what}: {same} of {all} rows in their nearest initial centroid's cluster"
            );
        }
        if dev.indexed > 0 {
            let (od, oc) = (layout_objective(&dev, &keys, tokens, seg), layout_objective(&cpu, &keys, tokens, seg));
            eprintln!("{what}: k-means objective device {od:.5}, CPU {oc:.5}");
            assert!(od >= oc - 0.01 * oc.abs(), "{what}: device objective {od} vs CPU {oc}");
        }
    }
    // Bad inputs are typed errors.
    let (keys, values) = (vec![0.5f32; 2 * 300 * d], vec![0.5f32; 2 * 300 * d]);
    let zero = LayoutParams { tokens_per_cluster: 0, ..LayoutParams::default() };
    assert!(matches!(
        ClusteredLayer::build_on_device(&gpu, &keys, &values, 2, d, zero),
        Err(Error::InvalidArgument { .. })
    ));
    let huge = LayoutParams { segment_tokens: 12_000, tokens_per_cluster: 1, ..LayoutParams::default() };
    let many: Vec<f32> = vec![0.5; 9000 * d];
    assert!(matches!(
        ClusteredLayer::build_on_device(&gpu, &many, &many, 1, d, huge),
        Err(Error::InvalidArgument { .. })
    ));
    let mut nan = keys.clone();
    nan[17] = f32::NAN;
    assert!(ClusteredLayer::build_on_device(&gpu, &nan, &values, 2, d, LayoutParams::default()).is_err());
    assert!(ClusteredLayer::build_on_device(&gpu, &keys[d..], &values, 2, d, LayoutParams::default()).is_err());
    assert!(matches!(
        ClusteredLayer::build_on_device(&gpu, &keys, &values, 4, 64, LayoutParams::default()),
        Err(Error::ShapeMismatch { .. })
    ));
}

/// Every KV head's rows of `k`, `v` (`[kv_head][token][d]`, f16) as kv43 heads, encoded
/// group by group as they arrive.
fn kv43_heads(
    shape: &AttnShape,
    tokens: usize,
    k: &[f16],
    v: &[f16],
    params: attnstore_kernels::Kv43Params,
) -> Vec<attnstore_kernels::Kv43Head> {
    let d = shape.head_dim;
    (0..shape.kv_heads)
        .map(|h| {
            let mut head = attnstore_kernels::Kv43Head::new(d, params).unwrap();
            let r = h * tokens * d..(h + 1) * tokens * d;
            let wide = |x: &[f16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            head.append(&wide(&k[r.clone()]), &wide(&v[r])).unwrap();
            head
        })
        .collect()
}

#[test]
fn kv43_decode_on_the_gpu_equals_the_cpu_kernel() {
    let Some(gpu) = gpu() else { return };
    let five = attnstore_kernels::Kv43Params { key_bits: 5, value_bits: 4, key_group: 256, value_block: 128 };
    for (q_heads, tokens, params) in [
        (32, 4096, attnstore_kernels::Kv43Params::default()),
        (24, 8192, five),
        (8, 131_072, attnstore_kernels::Kv43Params::default()),
    ] {
        let shape = AttnShape::new(q_heads, 8, 128).unwrap();
        let (k, v, q) = data(&shape, tokens, tokens as u64 + 5);
        let heads = kv43_heads(&shape, tokens, &k, &v, params);
        let dev = gpu.upload_kv43(&heads).unwrap();
        assert_eq!(dev.rows(), tokens);
        let mut job = gpu.prepare_kv43(&shape, &q, &dev).unwrap();
        gpu.launch_kv43(&dev, None, &mut job).unwrap();
        let got = gpu.fetch_kv43(&mut job).unwrap();
        let (d, g) = (shape.head_dim, shape.group());
        let cpu: Vec<f64> = heads
            .iter()
            .enumerate()
            .flat_map(|(h, head)| head.attend(&q[h * g * d..(h + 1) * g * d], g, shape.scale()).unwrap())
            .map(f64::from)
            .collect();
        let err = rel_l2(&got, &cpu);
        assert!(err <= 1e-3, "q_heads={q_heads} tokens={tokens} {params:?}: GPU vs CPU kv43 {err}");
        // Against exact attention over the f16 rows: the codec's own error, printed only (on
        // these random rows attention is nearly uniform, so the output is an average of
        // noise and its relative error is the codes' per-element error, ~0.27; the codec's
        // accuracy is tested on the CPU and measured on real models).
        let kview = HeadsView::new(&k, shape.kv_heads, tokens, 128).unwrap();
        let vview = HeadsView::new(&v, shape.kv_heads, tokens, 128).unwrap();
        let codec_err = rel_l2(&got, &reference_attention(&shape, &q, kview, vview, None));
        eprintln!("kv43 on the GPU, {q_heads} q heads, {tokens} tokens, {params:?}: vs CPU {err:.2e}, vs exact f16 {codec_err:.4}");
        // The next step's queries into the same job: the CPU kernel's answer for them.
        let q2: Vec<f32> = q.iter().rev().map(|x| 0.5 * x).collect();
        gpu.requery_kv43(&mut job, &q2).unwrap();
        gpu.launch_kv43(&dev, None, &mut job).unwrap();
        let got2 = gpu.fetch_kv43(&mut job).unwrap();
        let cpu2: Vec<f64> = heads
            .iter()
            .enumerate()
            .flat_map(|(h, head)| head.attend(&q2[h * g * d..(h + 1) * g * d], g, shape.scale()).unwrap())
            .map(f64::from)
            .collect();
        let err2 = rel_l2(&got2, &cpu2);
        assert!(err2 <= 1e-3 && rel_l2(&got2, &cpu) > 1e-2, "requeried job: {err2}");
        assert!(gpu.requery_kv43(&mut job, &q2[1..]).is_err(), "a short requery");
    }
    // Rows in pieces (a wave index's segments, each with a partial key group the upload
    // leaves out), the partial groups and more f16 rows (a steady zone, appended in three
    // steps) as side rows: the kernels and the merge on the device equal the CPU over every
    // row (the codes by the CPU kernel, the f16 rows exactly).
    let shape = AttnShape::new(16, 8, 128).unwrap();
    let (k, v, q) = data(&shape, 3000, 17);
    let params = attnstore_kernels::Kv43Params::default();
    let (d, g, kvh) = (shape.head_dim, shape.group(), shape.kv_heads);
    let cut = 1700;
    let piece = |rows: std::ops::Range<usize>| -> Vec<attnstore_kernels::Kv43Head> {
        let n = rows.len();
        let take = |x: &[f16]| -> Vec<f16> {
            (0..kvh).flat_map(|h| x[(h * 3000 + rows.start) * d..(h * 3000 + rows.end) * d].to_vec()).collect()
        };
        kv43_heads(&shape, n, &take(&k), &take(&v), params)
    };
    let (first, second) = (piece(0..cut), piece(cut..2900));
    let lists: Vec<Vec<&attnstore_kernels::Kv43Head>> = first.iter().zip(&second).map(|(a, b)| vec![a, b]).collect();
    let dev = gpu.upload_kv43_pieces(&lists).unwrap();
    let coded = first[0].encoded_rows() + second[0].encoded_rows();
    assert_eq!(dev.rows(), coded);
    // Side rows, row after row with a row's KV heads together: both pieces' partial groups,
    // then rows 2900..3000 of `k`, `v` as the steady zone.
    let (mut sk, mut sv) = (Vec::new(), Vec::new());
    for p in 0..2 {
        for r in 0..lists[0][p].rows() - lists[0][p].encoded_rows() {
            for pieces in &lists {
                let (pk, pv) = pieces[p].partial_group();
                sk.extend(pk[r * d..(r + 1) * d].iter().map(|x| x.to_bits()));
                sv.extend(pv[r * d..(r + 1) * d].iter().map(|x| x.to_bits()));
            }
        }
    }
    for t in 2900..3000 {
        for h in 0..kvh {
            sk.extend(k[(h * 3000 + t) * d..(h * 3000 + t + 1) * d].iter().map(|x| x.to_bits()));
            sv.extend(v[(h * 3000 + t) * d..(h * 3000 + t + 1) * d].iter().map(|x| x.to_bits()));
        }
    }
    let side_rows = sk.len() / (kvh * d);
    let mut side = gpu.alloc_kv43_side(kvh, side_rows + 7).unwrap();
    // Appended in three steps, one of a single row (staged in page-locked memory).
    let (split, one) = ((side_rows - 30) * kvh * d, (side_rows - 29) * kvh * d);
    gpu.append_kv43_side(&mut side, &sk[..split], &sv[..split]).unwrap();
    gpu.append_kv43_side(&mut side, &sk[split..one], &sv[split..one]).unwrap();
    gpu.append_kv43_side(&mut side, &sk[one..], &sv[one..]).unwrap();
    assert_eq!(side.rows(), side_rows);
    assert!(gpu.append_kv43_side(&mut side, &sk[..8 * kvh * d], &sv[..8 * kvh * d]).is_err(), "past the capacity");
    assert!(gpu.append_kv43_side(&mut side, &sk[..d], &sv[..d]).is_err(), "part of a row");
    let mut job = gpu.prepare_kv43(&shape, &q, &dev).unwrap();
    gpu.launch_kv43(&dev, Some(&side), &mut job).unwrap();
    let got = gpu.fetch_kv43(&mut job).unwrap();
    // The CPU over KV head h's pieces' rows `ranges(h)` (codes, and partial key groups
    // exactly), steady rows `first_steady..` of 2900..3000 and the host partials `extra`.
    let cpu_over = |ranges: &dyn Fn(usize) -> [Vec<std::ops::Range<usize>>; 2],
                    first_steady: usize,
                    extra: &[attnstore_kernels::Partial]|
     -> Vec<f64> {
        let mut out = Vec::new();
        for (h, pieces) in lists.iter().enumerate() {
            let qh = &q[h * g * d..(h + 1) * g * d];
            let mut parts = vec![attnstore_kernels::Partial::empty(d); g];
            for (p, rs) in pieces.iter().zip(ranges(h)) {
                p.attend_runs(qh, shape.scale(), &rs, &mut parts).unwrap();
            }
            let steady = (h * 3000 + 2900 + first_steady) * d..(h * 3000 + 3000) * d;
            let scratch = &mut attnstore_kernels::cpu::attention::Scratch::default();
            attnstore_kernels::cpu::attention::attend_spans(
                qh,
                shape.scale(),
                [(&k[steady.clone()], &v[steady])],
                &mut parts,
                scratch,
            );
            for (j, part) in parts.iter_mut().enumerate() {
                if let Some(e) = extra.get(h * g + j) {
                    part.merge(e);
                }
            }
            out.extend(parts.iter().flat_map(attnstore_kernels::Partial::finish).map(f64::from));
        }
        out
    };
    let cpu = cpu_over(&|h| [vec![0..lists[h][0].rows()], vec![0..lists[h][1].rows()]], 0, &[]);
    let err = rel_l2(&got, &cpu);
    assert!(err <= 1e-3, "kv43 pieces with side rows: GPU vs CPU {err}");
    // A sparse decode over the same copy: per KV head other row ranges of each piece (some
    // in its partial key group, so side rows), every steady row but the first three, and a
    // host partial per query head folded in; the same job, launched twice, equals the CPU
    // over the same rows and partials.
    let groups: Vec<usize> = lists[0].iter().map(|p| p.rows() - p.encoded_rows()).collect();
    let ranges = |h: usize| -> [Vec<std::ops::Range<usize>>; 2] {
        [vec![h * 50 + 10..h * 50 + 300, 900..905, 1600..1690], vec![0..64, 700 + h..701 + h, 1100..1190 + h]]
    };
    let extra: Vec<attnstore_kernels::Partial> = (0..shape.q_heads)
        .map(|j| attnstore_kernels::Partial {
            m: 0.25 * j as f32 - 1.0,
            l: 1.0 + j as f32,
            o: (0..d).map(|c| ((c * 7 + j) % 13) as f32 / 13.0 - 0.4).collect(),
        })
        .collect();
    let mut sparse = attnstore_kernels::Kv43Lists::default();
    for (h, pieces) in lists.iter().enumerate() {
        let (mut coded_ranges, mut side_list, mut at) = (Vec::new(), Vec::new(), 0);
        for (p, rs) in ranges(h).iter().enumerate() {
            let enc = pieces[p].encoded_rows();
            let before: usize = groups[..p].iter().sum();
            for r in rs {
                if r.start < enc {
                    coded_ranges.push(at + r.start..at + r.end.min(enc));
                }
                side_list.extend((r.start.max(enc)..r.end).map(|x| (before + x - enc) as u32));
            }
            at += enc;
        }
        side_list.extend((groups.iter().sum::<usize>() + 3..side_rows).map(|x| x as u32));
        sparse.blocks.push(attnstore_kernels::Kv43Lists::block_masks(coded_ranges));
        sparse.side.push(side_list);
    }
    sparse.extra = extra.iter().flat_map(|p| p.o.iter().copied().chain([p.m, p.l])).collect();
    let want = cpu_over(&ranges, 3, &extra);
    for round in 0..2 {
        gpu.launch_kv43_listed(&dev, &side, &sparse, &mut job).unwrap();
        let got = gpu.fetch_kv43(&mut job).unwrap();
        let err = rel_l2(&got, &want);
        assert!(err <= 1e-3, "round {round}: a listed kv43 decode, GPU vs CPU {err}");
    }
    // Listed blocks past the copy, out of order, or side rows past those held are refused.
    let mut bad = sparse.clone();
    bad.blocks[1].push((dev.rows() as u32 / 64, 1));
    assert!(gpu.launch_kv43_listed(&dev, &side, &bad, &mut job).is_err(), "a block past the copy");
    let mut bad = sparse.clone();
    bad.blocks[0].reverse();
    assert!(gpu.launch_kv43_listed(&dev, &side, &bad, &mut job).is_err(), "blocks out of order");
    let mut bad = sparse.clone();
    bad.side[2].push(side_rows as u32);
    assert!(gpu.launch_kv43_listed(&dev, &side, &bad, &mut job).is_err(), "a side row past those held");
    let mut bad = sparse.clone();
    bad.extra.pop();
    assert!(gpu.launch_kv43_listed(&dev, &side, &bad, &mut job).is_err(), "short host partials");
    // A side of other KV heads is refused.
    let other = gpu.alloc_kv43_side(4, 16).unwrap();
    assert!(gpu.launch_kv43(&dev, Some(&other), &mut job).is_err(), "side rows of 4 KV heads");
    assert!(gpu.alloc_kv43_side(kvh, 0).is_err(), "no capacity");
    // Rows of one head dimension on a backend of another: typed errors, no launch.
    let narrow = GpuBackend::new(64).unwrap();
    assert!(narrow.launch_kv43(&dev, None, &mut job).is_err(), "codes of d = 128 on a d = 64 backend");
    assert!(narrow.append_kv43_side(&mut side, &sk[..kvh * 64], &sv[..kvh * 64]).is_err(), "side rows of d = 128");
    // Bad inputs are typed errors.
    let shape = AttnShape::new(8, 8, 128).unwrap();
    let (k, v, mut q) = data(&shape, 1024, 3);
    let odd = attnstore_kernels::Kv43Params { key_bits: 4, value_bits: 3, key_group: 24, value_block: 8 };
    assert!(gpu.upload_kv43(&kv43_heads(&shape, 1008, &k, &v, odd)).is_err(), "24-row key groups");
    let dev = gpu.upload_kv43(&kv43_heads(&shape, 1024, &k, &v, attnstore_kernels::Kv43Params::default())).unwrap();
    q[5] = f32::NAN;
    assert!(gpu.prepare_kv43(&shape, &q, &dev).is_err(), "a NaN query");
    assert!(gpu.prepare_kv43(&shape, &q[..64], &dev).is_err(), "a short query");
}
