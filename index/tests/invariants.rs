//! DESIGN.md invariants of the access methods, checked against f64 reference attention.

mod common;

use attnstore_index::{AccessMethod, FlatIndex, SelectionMode, WaveIndex, WaveParams, ZoneBudget};
use attnstore_kernels::cpu::reference::rel_l2;
use attnstore_kernels::{AttnShape, HackParams};
use common::{randn, reference, run};
use half::f16;

fn small_params() -> WaveParams {
    WaveParams { segment_tokens: 512, decode_segment_tokens: 128, ..WaveParams::default() }
}

#[test]
fn full_budget_equals_exact_attention_in_f32() {
    let shape = AttnShape::new(8, 2, 32).unwrap();
    let tokens = 2000;
    let (k, v, q) =
        (randn(shape.kv_len(tokens), 1, 1.0), randn(shape.kv_len(tokens), 2, 1.0), randn(shape.query_len(), 3, 2.0));
    let mut wave = WaveIndex::<f32>::new(small_params(), 2, 32).unwrap();
    wave.prefill(&k, &v).unwrap();
    assert!(wave.stats().segments >= 3, "the test must exercise several segments");
    let want = reference::<f32>(&shape, &q, &k, &v, tokens);
    assert!(rel_l2(&run(&wave, &shape, &q, None), &want) <= 1e-5);
    for mode in [SelectionMode::PerQueryHead, SelectionMode::PerKvHead] {
        let all = ZoneBudget { retrieve_tokens: tokens, estimate_tokens: 0, mode };
        let err = rel_l2(&run(&wave, &shape, &q, Some(&all)), &want);
        assert!(err <= 1e-5, "{mode:?}: {err}");
    }
}

#[test]
fn estimation_over_clusters_of_size_one_equals_exact() {
    let shape = AttnShape::new(4, 1, 16).unwrap();
    let tokens = 600;
    let (k, v, q) =
        (randn(shape.kv_len(tokens), 4, 1.0), randn(shape.kv_len(tokens), 5, 1.0), randn(shape.query_len(), 6, 2.0));
    let params =
        WaveParams { segment_tokens: 256, decode_segment_tokens: 64, tokens_per_cluster: 1, ..WaveParams::default() };
    let mut wave = WaveIndex::<f16>::new(params, 1, 16).unwrap();
    wave.prefill(&k, &v).unwrap();
    let estimate_all =
        ZoneBudget { retrieve_tokens: 0, estimate_tokens: usize::MAX, mode: SelectionMode::PerQueryHead };
    let plan = wave.plan_head(0, &q, &estimate_all);
    assert!(plan.selections.iter().all(|s| s.retrieve_tokens == 0 && s.estimate_tokens + plan.steady_tokens == tokens));
    let err = rel_l2(&run(&wave, &shape, &q, Some(&estimate_all)), &reference::<f16>(&shape, &q, &k, &v, tokens));
    assert!(err <= 1e-4, "{err}");
}

#[test]
fn incremental_segments_equal_a_rebuild_for_full_budget() {
    let shape = AttnShape::new(4, 2, 16).unwrap();
    let (prefill, decode) = (700, 450);
    let total = prefill + decode;
    let (k, v, q) =
        (randn(shape.kv_len(total), 7, 1.0), randn(shape.kv_len(total), 8, 1.0), randn(shape.query_len(), 9, 2.0));
    let head_major = |x: &[f32], from: usize, to: usize| -> Vec<f32> {
        (0..2).flat_map(|h| x[(h * total + from) * 16..(h * total + to) * 16].to_vec()).collect()
    };
    let mut rebuilt = WaveIndex::<f32>::new(small_params(), 2, 16).unwrap();
    rebuilt.prefill(&k, &v).unwrap();
    let mut incremental = WaveIndex::<f32>::new(small_params(), 2, 16).unwrap();
    incremental.prefill(&head_major(&k, 0, prefill), &head_major(&v, 0, prefill)).unwrap();
    let before = incremental.stats().segments;
    for t in prefill..total {
        incremental.append(&head_major(&k, t, t + 1), &head_major(&v, t, t + 1)).unwrap();
    }
    let stats = incremental.stats();
    assert!(stats.segments >= before + 3, "decode must have built segments: {before} -> {}", stats.segments);
    assert_eq!(stats.tokens, total);
    assert!(stats.pending_tokens < 128);
    let a = run(&incremental, &shape, &q, None);
    let b = run(&rebuilt, &shape, &q, None);
    let want = reference::<f32>(&shape, &q, &k, &v, total);
    assert!(rel_l2(&a, &want) <= 1e-5 && rel_l2(&b, &want) <= 1e-5);
    // Every position is stored exactly once.
    let mut pos = incremental.exact_positions(1, &incremental.plan_exact(), 0);
    pos.sort_unstable();
    assert_eq!(pos, (0..total as u32).collect::<Vec<_>>());
}

#[test]
fn flat_top_k_of_all_tokens_equals_exact_and_smaller_k_attends_the_true_top() {
    let shape = AttnShape::new(4, 2, 16).unwrap();
    let tokens = 300;
    let (k, v, q) =
        (randn(shape.kv_len(tokens), 10, 1.0), randn(shape.kv_len(tokens), 11, 1.0), randn(shape.query_len(), 12, 1.0));
    let mut flat = FlatIndex::<f32>::new(2, 16).unwrap();
    flat.append(&k, &v).unwrap();
    let all = ZoneBudget { retrieve_tokens: tokens, estimate_tokens: 0, mode: SelectionMode::PerQueryHead };
    let want = reference::<f32>(&shape, &q, &k, &v, tokens);
    assert!(rel_l2(&run(&flat, &shape, &q, Some(&all)), &want) <= 1e-5);
    let ten = ZoneBudget { retrieve_tokens: 10, ..all };
    let plan = flat.plan_head(0, &q[..2 * 16], &ten);
    let got = flat.exact_positions(0, &plan, 1);
    assert_eq!(got.len(), 10);
    let score = |t: usize| (0..16).map(|i| q[16 + i] * k[t * 16 + i]).sum::<f32>();
    let worst_in = got.iter().map(|&t| score(t as usize)).fold(f32::INFINITY, f32::min);
    let best_out = (0..tokens).filter(|t| !got.contains(&(*t as u32))).map(score).fold(f32::NEG_INFINITY, f32::max);
    assert!(worst_in >= best_out);
}

#[test]
fn bad_shapes_are_rejected_and_leave_the_index_unchanged() {
    let mut wave = WaveIndex::<f32>::new(small_params(), 2, 16).unwrap();
    let (k, v) = (randn(2 * 100 * 16, 1, 1.0), randn(2 * 100 * 16, 2, 1.0));
    wave.prefill(&k, &v).unwrap();
    let before = wave.stats();
    assert!(wave.append(&k[..31], &v[..31]).is_err());
    assert!(wave.append(&k[..32], &v[..64]).is_err());
    assert_eq!(wave.stats(), before);
    assert!(WaveIndex::<f32>::new(WaveParams { tokens_per_cluster: 0, ..WaveParams::default() }, 2, 16).is_err());
    assert!(WaveIndex::<f32>::new(WaveParams { decode_segment_tokens: 9000, ..WaveParams::default() }, 2, 16).is_err());
}

#[test]
fn hack2_segments_serve_exact_and_sparse_plans_from_a_fifth_of_the_bytes() {
    // Values with per-channel means and keys around a few directions, as real KV has:
    // 2-bit codes then keep the attention output close to exact.
    let shape = AttnShape::new(8, 2, 64).unwrap();
    let tokens = 3000;
    let mu = randn(64, 40, 2.0);
    let v: Vec<f32> = randn(shape.kv_len(tokens), 41, 0.5).iter().enumerate().map(|(i, x)| mu[i % 64] + x).collect();
    let dirs = randn(4 * 64, 42, 1.0);
    let k: Vec<f32> = randn(shape.kv_len(tokens), 43, 0.3)
        .iter()
        .enumerate()
        .map(|(i, x)| dirs[(i / 64 % 4) * 64 + i % 64] + x)
        .collect();
    let q = randn(shape.query_len(), 44, 1.5);
    let mut plain = WaveIndex::<f16>::new(small_params(), 2, 64).unwrap();
    let mut hack =
        WaveIndex::<f16>::new(small_params(), 2, 64).unwrap().with_codec(Some(HackParams::default())).unwrap();
    for w in [&mut plain, &mut hack] {
        w.prefill(&k, &v).unwrap();
    }
    let (ps, hs) = (plain.stats(), hack.stats());
    assert_eq!((ps.segments, ps.clusters), (hs.segments, hs.clusters), "the codec does not change the index");
    assert!(hs.kv_bytes * 4 < ps.kv_bytes, "{} vs {}", hs.kv_bytes, ps.kv_bytes);
    let want = reference::<f16>(&shape, &q, &k, &v, tokens);
    let exact = run(&hack, &shape, &q, None);
    let err = rel_l2(&exact, &want);
    assert!(err < 0.05, "hack2 exact plan vs f64 reference: {err}");
    // Retrieving every cluster reads the same rows block by block: the same result.
    let all = ZoneBudget { retrieve_tokens: tokens, estimate_tokens: 0, mode: SelectionMode::PerKvHead };
    assert!(
        rel_l2(&run(&hack, &shape, &q, Some(&all)), &exact.iter().map(|&x| f64::from(x)).collect::<Vec<_>>()) < 1e-5
    );
    // A tripartite plan over 2-bit rows stays near the same plan over f16 rows.
    let sparse = ZoneBudget { retrieve_tokens: 300, estimate_tokens: usize::MAX, mode: SelectionMode::PerKvHead };
    let (a, b) = (run(&hack, &shape, &q, Some(&sparse)), run(&plain, &shape, &q, Some(&sparse)));
    let err = rel_l2(&a, &b.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
    assert!(err < 0.05, "hack2 vs f16 under the same sparse budget: {err}");
    assert!(WaveIndex::<f16>::new(small_params(), 2, 30).unwrap().with_codec(Some(HackParams::default())).is_err());
}

/// What a GPU homomorphic kernel computes from [`AccessMethod::gpu_hack_work`], done here
/// on the CPU: each listed value block's bytes read from its buffer-manager blocks, its
/// masked rows attended with the 8-bit query, merged with the CPU's partials.
fn emulate_gpu_hack_step(
    manager: &attnstore_buffer::BufferManager,
    work: &attnstore_index::GpuHackWork,
    q: &[f32],
    d: usize,
) -> (Vec<f32>, usize) {
    use attnstore_kernels::{HackScratch, HackView, Partial};
    let mut parts = work.cpu.clone();
    let mut scratch = HackScratch::default();
    let reader = manager.reader();
    let mut rows = 0;
    let mut at = 0;
    for group in &work.groups {
        let mut bytes = Vec::new();
        let locations = &work.locations[at..at + group.blocks as usize];
        at += group.blocks as usize;
        for pin in reader.pin_all(locations) {
            bytes.extend_from_slice(&pin.expect("a block in memory pins"));
        }
        let aligned: Vec<u16> = bytes.chunks(2).map(|b| u16::from_le_bytes([b[0], *b.get(1).unwrap_or(&0)])).collect();
        let view = HackView::from_group(d, HackParams::default(), group.rows as usize, bytemuck::cast_slice(&aligned))
            .unwrap();
        view.quantize_queries(q, parts.len(), &mut scratch);
        let runs: Vec<_> = (0..64).filter(|r| group.mask >> r & 1 == 1).map(|r| r..r + 1).collect();
        rows += runs.len();
        let mut sub = vec![Partial::empty(d); parts.len()];
        view.attend_quantized(1.0 / (d as f32).sqrt(), &runs, &mut sub, &mut scratch);
        parts.iter_mut().zip(&sub).for_each(|(p, s)| p.merge(s));
    }
    (parts.iter().flat_map(Partial::finish).collect(), rows)
}

#[test]
fn gpu_hack_work_lists_the_blocks_and_rows_that_attend_as_the_cpu_executor_does() {
    use attnstore_buffer::{BufferConfig, BufferManager};
    use attnstore_index::BlockStore;
    use std::sync::Arc;
    let shape = AttnShape::new(8, 2, 64).unwrap();
    let (g, d) = (shape.group(), shape.head_dim);
    let tokens = 3000;
    let (k, v) = (randn(shape.kv_len(tokens), 51, 1.0), randn(shape.kv_len(tokens), 52, 1.0));
    let config = BufferConfig { pinned_host: false, ..BufferConfig::new(8192, 0) };
    let manager = Arc::new(BufferManager::new(config).unwrap());
    let mut wave = WaveIndex::<f16>::new(small_params(), 2, 64)
        .unwrap()
        .with_codec(Some(HackParams::default()))
        .unwrap()
        .with_blocks(BlockStore::new(Arc::clone(&manager), 1, 0))
        .unwrap();
    wave.prefill(&k, &v).unwrap();
    let indexed = wave.stats().indexed_tokens;
    assert!(wave.stats().segments >= 3 && indexed > 2000, "{:?}", wave.stats());
    let sparse = ZoneBudget { retrieve_tokens: 300, estimate_tokens: usize::MAX, mode: SelectionMode::PerKvHead };
    for step in 0..3u64 {
        let q = randn(shape.query_len(), 60 + step, 2.0);
        for h in 0..shape.kv_heads {
            let qg = &q[h * g * d..(h + 1) * g * d];
            for plan in [wave.plan_exact(), wave.plan_head(h, qg, &sparse)] {
                let want: Vec<f64> = wave
                    .execute_head(h, qg, &plan, &mut attnstore_kernels::cpu::attention::Scratch::default())
                    .unwrap()
                    .iter()
                    .flat_map(|p| p.finish())
                    .map(f64::from)
                    .collect();
                let work = wave.gpu_hack_work(h, qg, &plan).expect("homed 2-bit rows").unwrap();
                assert_eq!(work.scan, plan.exact);
                let (got, rows) = emulate_gpu_hack_step(&manager, &work, qg, d);
                let expected_rows = if plan.exact { indexed } else { plan.selections[0].retrieve_tokens };
                assert_eq!(rows, expected_rows, "step {step} head {h} exact={}", plan.exact);
                let err = rel_l2(&got, &want);
                assert!(err <= 1e-5, "step {step} head {h} exact={}: {err}", plan.exact);
            }
        }
    }
    // One selection per query head cannot share one row mask per KV head: the CPU runs it.
    let q = randn(shape.query_len(), 70, 2.0);
    let per_q = ZoneBudget { mode: SelectionMode::PerQueryHead, ..sparse };
    assert!(wave.gpu_hack_work(0, &q[..g * d], &wave.plan_head(0, &q[..g * d], &per_q)).is_none());
    // Plain rows, or 2-bit rows kept in the index, are not served this way.
    let mut unhomed =
        WaveIndex::<f16>::new(small_params(), 2, 64).unwrap().with_codec(Some(HackParams::default())).unwrap();
    unhomed.prefill(&k, &v).unwrap();
    assert!(unhomed.gpu_hack_work(0, &q[..g * d], &unhomed.plan_exact()).is_none());
}
