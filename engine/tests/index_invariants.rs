//! DESIGN.md invariants of the access methods, checked against f64 reference attention.

#[path = "index_common/mod.rs"]
mod common;

use attnstore_index::{AccessMethod, FlatIndex, RowSource, SelectionMode, WaveIndex, WaveParams, ZoneBudget};
use attnstore_kernels::cpu::reference::rel_l2;
use attnstore_kernels::{AttnShape, HackParams, KeyLayout};
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
    // HACK's per-token keys and per-channel keys (hack2c) alike.
    for params in [HackParams::default(), HackParams::default().with_keys(KeyLayout::PerChannel)] {
        let mut plain = WaveIndex::<f16>::new(small_params(), 2, 64).unwrap();
        let mut hack = WaveIndex::<f16>::new(small_params(), 2, 64).unwrap().with_codec(Some(params)).unwrap();
        for w in [&mut plain, &mut hack] {
            w.prefill(&k, &v).unwrap();
        }
        let (ps, hs) = (plain.stats(), hack.stats());
        assert_eq!((ps.segments, ps.clusters), (hs.segments, hs.clusters), "the codec does not change the index");
        assert!(hs.kv_bytes * 4 < ps.kv_bytes, "{} vs {}", hs.kv_bytes, ps.kv_bytes);
        let want = reference::<f16>(&shape, &q, &k, &v, tokens);
        let exact = run(&hack, &shape, &q, None);
        let err = rel_l2(&exact, &want);
        assert!(err < 0.05, "{params:?}: exact plan vs f64 reference: {err}");
        // Retrieving every cluster reads the same rows block by block: the same result.
        let all = ZoneBudget { retrieve_tokens: tokens, estimate_tokens: 0, mode: SelectionMode::PerKvHead };
        assert!(
            rel_l2(&run(&hack, &shape, &q, Some(&all)), &exact.iter().map(|&x| f64::from(x)).collect::<Vec<_>>())
                < 1e-5
        );
        // A tripartite plan over 2-bit rows stays near the same plan over f16 rows.
        let sparse = ZoneBudget { retrieve_tokens: 300, estimate_tokens: usize::MAX, mode: SelectionMode::PerKvHead };
        let (a, b) = (run(&hack, &shape, &q, Some(&sparse)), run(&plain, &shape, &q, Some(&sparse)));
        let err = rel_l2(&a, &b.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
        assert!(err < 0.05, "{params:?} vs f16 under the same sparse budget: {err}");
    }
    assert!(WaveIndex::<f16>::new(small_params(), 2, 30).unwrap().with_codec(Some(HackParams::default())).is_err());
}
