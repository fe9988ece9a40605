//! The PQ index: full-k equals exact attention, decode tokens reuse the codebooks, the
//! background build falls back to exact attention until ready, the adaptive iteration limit
//! and convergence, and the quality of its top-k.

#[path = "index_common/mod.rs"]
mod common;

use attnstore_index::{AccessMethod, FlatIndex, PqIndex, PqLayout, PqParams, RowSource, SelectionMode, ZoneBudget};
use attnstore_kernels::cpu::reference::rel_l2;
use attnstore_kernels::cpu::scoring::{score_rows, top_r};
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::{AttnShape, HackParams};
use common::{randn, reference, run};
use std::collections::HashSet;
use std::time::Duration;

fn small(layout: PqLayout) -> PqParams {
    PqParams {
        subspaces: Some(layout.subspaces),
        bits: Some(layout.bits),
        min_build_tokens: 256,
        background: false,
        ..PqParams::default()
    }
}

/// Keys drawn around a few centres (so k-means has structure to find and converges).
fn clustered(kv_heads: usize, tokens: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut g = SplitMix64::new(seed);
    let centres: Vec<f32> = (0..8 * d).map(|_| g.normal() * 3.0).collect();
    (0..kv_heads * tokens)
        .flat_map(|i| {
            let c = (i * 7919) % 8;
            (0..d).map(|j| centres[c * d + j] + g.normal() * 0.3).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn k_equal_to_all_tokens_equals_exact_attention() {
    let shape = AttnShape::new(8, 2, 32).unwrap();
    let tokens = 1500;
    let (k, v, q) =
        (randn(shape.kv_len(tokens), 1, 1.0), randn(shape.kv_len(tokens), 2, 1.0), randn(shape.query_len(), 3, 2.0));
    let want = reference::<f32>(&shape, &q, &k, &v, tokens);
    for layout in
        [PqLayout { subspaces: 2, bits: 6 }, PqLayout { subspaces: 4, bits: 8 }, PqLayout { subspaces: 8, bits: 4 }]
    {
        let mut pq = PqIndex::<f32>::new(small(layout), 2, 32).unwrap();
        pq.prefill(&k, &v).unwrap();
        // Decode tokens past the build are encoded too; they must also be attended.
        let (k2, v2) = (randn(2 * 100 * 32, 4, 1.0), randn(2 * 100 * 32, 5, 1.0));
        pq.append(&k2, &v2).unwrap();
        let (ka, va) = (concat(&k, &k2, tokens, 100, 64), concat(&v, &v2, tokens, 100, 64));
        let want_all = reference::<f32>(&shape, &q, &ka, &va, tokens + 100);
        assert!(pq.stats().indexed_tokens > tokens - 100, "{:?}", pq.stats());
        assert!(rel_l2(&run(&pq, &shape, &q, None), &want_all) <= 1e-5);
        for mode in [SelectionMode::PerQueryHead, SelectionMode::PerKvHead] {
            let all = ZoneBudget { retrieve_tokens: tokens + 100, estimate_tokens: 0, mode };
            let err = rel_l2(&run(&pq, &shape, &q, Some(&all)), &want_all);
            assert!(err <= 1e-5, "{layout:?} {mode:?}: {err}");
        }
        let _ = &want;
    }
}

/// Joins two `heads × n × d` batches into one `heads × (n1+n2) × d` array.
fn concat(a: &[f32], b: &[f32], n1: usize, n2: usize, row: usize) -> Vec<f32> {
    let d = row / 2;
    let heads = a.len() / (n1 * d);
    (0..heads).flat_map(|h| [&a[h * n1 * d..(h + 1) * n1 * d], &b[h * n2 * d..(h + 1) * n2 * d]].concat()).collect()
}

#[test]
fn decode_tokens_are_encoded_with_the_existing_centroids() {
    let d = 16;
    let layout = PqLayout { subspaces: 4, bits: 5 };
    let mut pq = PqIndex::<f32>::new(small(layout), 1, d).unwrap();
    let prefill = 1200;
    pq.prefill(&clustered(1, prefill, d, 7), &randn(prefill * d, 8, 1.0)).unwrap();
    let (book, codes) = pq.codebook(0).map(|(b, c)| (b.to_vec(), c)).unwrap();
    let before = pq.stats().indexed_tokens;
    // Decode one token at a time: each is encoded once it leaves the 64-token window.
    let decode = randn(300 * d, 9, 2.0);
    for t in 0..300 {
        pq.append(&decode[t * d..(t + 1) * d], &randn(d, 100 + t as u64, 1.0)).unwrap();
    }
    assert_eq!(pq.codebook(0).map(|(b, _)| b.to_vec()), Some(book.clone()), "codebooks must not change");
    assert_eq!(pq.stats().indexed_tokens, before + 300, "every token that left the window is coded");
    let sub = d / layout.subspaces;
    for t in [0usize, 150, 235] {
        let key = &decode[t * d..(t + 1) * d];
        let got = pq.codes_of(0, prefill + t).expect("decode token encoded");
        for (j, &c) in got.iter().enumerate() {
            let x = &key[j * sub..(j + 1) * sub];
            let dist = |i: usize| {
                let cen = &book[(j * codes + i) * sub..][..sub];
                x.iter().zip(cen).map(|(a, b)| (a - b) * (a - b)).sum::<f32>()
            };
            let best = (0..codes).min_by(|&a, &b| dist(a).total_cmp(&dist(b))).unwrap();
            assert!(
                (dist(c as usize) - dist(best)).abs() < 1e-5,
                "token {t} sub-space {j}: code {c} vs nearest {best}"
            );
        }
    }
    // Tokens still in the local window have no codes yet.
    assert!(pq.codes_of(0, prefill + 236).is_none());
}

#[test]
fn plans_attend_everything_exactly_until_the_background_build_is_ready() {
    let shape = AttnShape::new(4, 2, 64).unwrap();
    let tokens = 48 * 1024;
    let (k, v, q) =
        (randn(shape.kv_len(tokens), 11, 1.0), randn(shape.kv_len(tokens), 12, 1.0), randn(shape.query_len(), 13, 2.0));
    let params = PqParams { background: true, ..PqParams::default() };
    let mut pq = PqIndex::<f32>::new(params, 2, 64).unwrap();
    pq.prefill(&k, &v).unwrap();
    let handle = pq.build_handle().expect("a build started");
    let budget = ZoneBudget { retrieve_tokens: 1000, estimate_tokens: 0, mode: SelectionMode::PerKvHead };
    let plan = pq.plan_head(0, &q[..2 * 64], &budget);
    if !handle.is_ready() {
        // Observed before the build finished: every token is in the steady zone.
        assert!(plan.exact && plan.selections.is_empty(), "{plan:?}");
        let err = rel_l2(&run(&pq, &shape, &q, Some(&budget)), &reference::<f32>(&shape, &q, &k, &v, tokens));
        assert!(err <= 1e-5, "{err}");
    }
    assert!(handle.wait(Duration::from_secs(120)).unwrap(), "build finished");
    let report = handle.report().unwrap();
    assert_eq!(report.layout, PqLayout { subspaces: 4, bits: 8 }, "PQCache's layout beyond 16K tokens");
    let plan = pq.plan_head(0, &q[..2 * 64], &budget);
    assert_eq!(plan.steady_tokens, 4 + 64);
    assert_eq!(plan.selections[0].retrieve_tokens, 1000);
}

#[test]
fn build_respects_the_time_budget_and_stops_at_convergence() {
    let d = 32;
    let tokens = 4096;
    let k = clustered(2, tokens, d, 21);
    let v = randn(2 * tokens * d, 22, 1.0);
    // Generous limit, clustered data: every sub-space converges well before 200 iterations.
    let params = PqParams { max_iters: 200, ..small(PqLayout { subspaces: 2, bits: 4 }) };
    let mut pq = PqIndex::<f32>::new(params, 2, d).unwrap();
    pq.prefill(&k, &v).unwrap();
    let r = pq.build_handle().unwrap().report().unwrap();
    assert_eq!(r.iters_limit, 200);
    assert_eq!(r.converged_jobs, r.jobs, "{r:?}");
    assert!(r.iters_run < 200, "{r:?}");
    // A time budget: the chosen limit is predicted to fit it, and the run obeys the limit.
    let budget = Duration::from_millis(40);
    let params = PqParams { build_budget: Some(budget), max_iters: 1000, ..small(PqLayout { subspaces: 2, bits: 8 }) };
    let mut pq = PqIndex::<f32>::new(params, 2, d).unwrap();
    pq.prefill(&randn(2 * tokens * d, 23, 1.0), &v).unwrap();
    let r = pq.build_handle().unwrap().report().unwrap();
    assert!(r.iters_limit >= 1 && r.iters_limit < 1000, "{r:?}");
    assert!(r.iters_run <= r.iters_limit, "{r:?}");
    let predicted = r.predicted.unwrap();
    assert!(predicted <= budget || r.iters_limit == 1, "{r:?}");
}

#[test]
fn pq_top_k_finds_most_of_the_true_top_k() {
    let shape = AttnShape::new(4, 1, 64).unwrap();
    let tokens = 8192;
    let k = clustered(1, tokens, 64, 31);
    let v = randn(tokens * 64, 32, 1.0);
    let mut pq = PqIndex::<f32>::new(small(PqLayout { subspaces: 8, bits: 8 }), 1, 64).unwrap();
    pq.prefill(&k, &v).unwrap();
    let mut flat = FlatIndex::<f32>::new(1, 64).unwrap();
    flat.prefill(&k, &v).unwrap();
    let mut recall = 0.0;
    for s in 0..4 {
        // A query aimed at one key: its neighbourhood is the true top-k.
        let target = (s * 1999) % tokens;
        let q: Vec<f32> = (0..4 * 64)
            .map(|i| k[target * 64 + i % 64] * 0.5 + randn(1, 40 + i as u64 + s as u64 * 1000, 0.2)[0])
            .collect();
        let n = 400;
        let budget = ZoneBudget { retrieve_tokens: n, estimate_tokens: 0, mode: SelectionMode::PerQueryHead };
        let plan = pq.plan_head(0, &q, &budget);
        let got: HashSet<u32> = pq.exact_positions(0, &plan, 0).into_iter().collect();
        let mut scores = Vec::new();
        score_rows(&q[..64], &k, 0.125, &mut scores);
        let truth = top_r(&scores, n);
        recall += truth.iter().filter(|t| got.contains(t)).count() as f64 / n as f64;
    }
    recall /= 4.0;
    assert!(recall >= 0.6, "recall {recall}");
    let _ = shape;
}

#[test]
fn bad_parameters_are_typed_errors() {
    let base = PqParams::default();
    assert!(PqIndex::<f32>::new(PqParams { bits: Some(9), ..base }, 2, 64).is_err());
    assert!(PqIndex::<f32>::new(PqParams { subspaces: Some(8), ..base }, 2, 36).is_err());
    assert!(PqIndex::<f32>::new(base, 0, 64).is_err());
    let mut pq = PqIndex::<f32>::new(small(PqLayout { subspaces: 2, bits: 4 }), 2, 8).unwrap();
    assert!(pq.append(&[0.0; 15], &[0.0; 15]).is_err(), "shape checked before anything changes");
    assert_eq!(pq.stats().tokens, 0);
}

#[test]
fn fused_threshold_top_k_selects_exactly_the_top_k_of_all_pq_scores() {
    // 20K tokens, k ≪ n: the planner takes the sampled-threshold path; its choice must be
    // the top-k of the full PQ score array computed independently from codebook and codes.
    let (g, d, tokens) = (4, 64, 20_000);
    let mut pq = PqIndex::<f32>::new(small(PqLayout { subspaces: 4, bits: 8 }), 1, d).unwrap();
    pq.prefill(&clustered(1, tokens, d, 51), &randn(tokens * d, 52, 1.0)).unwrap();
    let q = randn(g * d, 53, 1.0);
    let k = 700;
    let plan =
        pq.plan_head(0, &q, &ZoneBudget { retrieve_tokens: k, estimate_tokens: 0, mode: SelectionMode::PerKvHead });
    let (book, codes) = pq.codebook(0).map(|(b, c)| (b.to_vec(), c)).unwrap();
    let lut = attnstore_kernels::cpu::pq::Lut::build(&q, g, &book, 4, codes, 1.0 / (d as f32).sqrt()).unwrap();
    let coded: Vec<usize> = (0..tokens).filter(|&p| pq.codes_of(0, p).is_some()).collect();
    let all_codes: Vec<u8> = coded.iter().flat_map(|&p| pq.codes_of(0, p).unwrap()).collect();
    let mut scores = Vec::new();
    attnstore_kernels::cpu::pq::scores_max(&lut, &all_codes, &mut scores);
    let want: HashSet<u32> = top_r(&scores, k).into_iter().map(|i| coded[i as usize] as u32).collect();
    let steady: HashSet<u32> = (0..4).chain(tokens as u32 - 64..tokens as u32).collect();
    let got: HashSet<u32> = pq.exact_positions(0, &plan, 0).into_iter().filter(|p| !steady.contains(p)).collect();
    assert_eq!(got.len(), k);
    assert_eq!(got, want);
}

#[test]
fn hack2_base_rows_serve_exact_and_top_k_plans_and_decode_keys_are_still_encoded() {
    // Values with per-channel means, as real values have; keys clustered.
    let shape = AttnShape::new(8, 2, 64).unwrap();
    let tokens = 1500;
    let k = clustered(2, tokens, 64, 11);
    let mu = randn(64, 12, 2.0);
    let v: Vec<f32> = randn(shape.kv_len(tokens), 13, 0.5).iter().enumerate().map(|(i, x)| mu[i % 64] + x).collect();
    let q = randn(shape.query_len(), 14, 0.3);
    let params = small(PqLayout { subspaces: 4, bits: 6 });
    let mut plain = PqIndex::<f32>::new(params, 2, 64).unwrap();
    let mut hack = PqIndex::<f32>::new(params, 2, 64).unwrap().with_codec(Some(HackParams::default())).unwrap();
    let (k2, v2) = (clustered(2, 100, 64, 15), randn(2 * 100 * 64, 16, 0.5));
    for pq in [&mut plain, &mut hack] {
        pq.prefill(&k, &v).unwrap();
        pq.append(&k2, &v2).unwrap();
    }
    let (ps, hs) = (plain.stats(), hack.stats());
    assert_eq!(ps.indexed_tokens, hs.indexed_tokens, "decode tokens past the build are PQ-coded under hack2 too");
    assert!(hs.kv_bytes * 3 < ps.kv_bytes, "{} vs {}", hs.kv_bytes, ps.kv_bytes);
    let exact_plain = run(&plain, &shape, &q, None);
    let exact_hack = run(&hack, &shape, &q, None);
    let want: Vec<f64> = exact_plain.iter().map(|&x| f64::from(x)).collect();
    let err = rel_l2(&exact_hack, &want);
    assert!(err < 0.1, "hack2 exact vs f32 exact: {err}");
    // Retrieving every token reads the same rows as the exact plan.
    let all = ZoneBudget { retrieve_tokens: tokens + 100, estimate_tokens: 0, mode: SelectionMode::PerKvHead };
    let exact_hack64: Vec<f64> = exact_hack.iter().map(|&x| f64::from(x)).collect();
    assert!(rel_l2(&run(&hack, &shape, &q, Some(&all)), &exact_hack64) < 1e-4);
    // A top-k plan over 2-bit rows stays near the same plan over plain rows.
    let some = ZoneBudget { retrieve_tokens: 300, estimate_tokens: 0, mode: SelectionMode::PerKvHead };
    let sparse_plain: Vec<f64> = run(&plain, &shape, &q, Some(&some)).iter().map(|&x| f64::from(x)).collect();
    let err = rel_l2(&run(&hack, &shape, &q, Some(&some)), &sparse_plain);
    assert!(err < 0.1, "hack2 vs plain top-k: {err}");
}
