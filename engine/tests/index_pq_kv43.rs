//! A PQ index over `kv43` rows: its base rows past the sink are encoded once when the
//! codebook build starts (whole key groups, the last partial group in f16), its plans attend
//! them on the codes, a plan that retrieves every token answers as exact attention over the
//! rows the codes stand for, its stats count the encoded bytes, and it is restored from its
//! encoded home (pieces of whole key groups) to the index it came from.

#[allow(dead_code, reason = "helpers shared by the test files; this one uses some")]
#[path = "index_common/mod.rs"]
mod common;

use attnstore_index::{AccessMethod, EncodedHome, EncodedRows, PqIndex, PqParams, SelectionMode, ZoneBudget};
use attnstore_kernels::cpu::reference::{attend_f64, rel_l2};
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::{AttnShape, Codec, HackParams, Kv43Head, Kv43Params};
use common::{append_in_batches, run, token_slice};
use half::f16;

const HEADS: usize = 2;
const D: usize = 64;

fn shape() -> AttnShape {
    AttnShape::new(8, HEADS, D).unwrap()
}

fn params() -> PqParams {
    PqParams { min_build_tokens: 256, local_tokens: 32, background: false, ..PqParams::default() }
}

fn kv43() -> Codec {
    Codec::Kv43(Kv43Params::default())
}

/// `HEADS × tokens × D` keys with three 6× outlier channels and values around channel means.
fn data(tokens: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut g = SplitMix64::new(seed);
    let mu: Vec<f32> = (0..D).map(|_| g.normal()).collect();
    let n = HEADS * tokens * D;
    let k = (0..n).map(|i| g.normal() * if i % D < 3 { 6.0 } else { 1.0 }).collect();
    let v = (0..n).map(|i| mu[i % D] + 0.5 * g.normal()).collect();
    (k, v)
}

fn queries(seed: u64, scale: f32) -> Vec<f32> {
    let mut g = SplitMix64::new(seed);
    (0..shape().query_len()).map(|_| g.normal() * scale).collect()
}

fn empty(codec: Codec) -> PqIndex<f16> {
    PqIndex::<f16>::new(params(), HEADS, D).unwrap().with_codec(codec).unwrap()
}

/// Prefill `prefill` of `total` tokens (the base region), then append the rest in batches.
fn build(codec: Codec, (k, v): (&[f32], &[f32]), total: usize, prefill: usize) -> PqIndex<f16> {
    let mut pq = empty(codec);
    let s = |x: &[f32]| token_slice(x, (HEADS, D), total, 0, prefill);
    pq.prefill(&s(k), &s(v)).unwrap();
    append_in_batches(&mut pq, (k, v), (HEADS, D), total, prefill);
    pq
}

fn f16_rows(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| f16::from_f32(v).to_f32()).collect()
}

/// Exact attention (f64) of every query head over the rows a kv43 PQ index of `k`/`v` with
/// base region `0..base` stands for: f16 sink and tail, the base past the sink encoded as one
/// [`Kv43Head`] and dequantized (`plain`: the f16 rows themselves). Also returns the bytes
/// of those encoded rows over all heads.
fn reference(k: &[f32], v: &[f32], q: &[f32], (total, base): (usize, usize), plain: bool) -> (Vec<f64>, usize) {
    let (g, sink) = (shape().group(), params().sink_tokens);
    let (mut out, mut coded_bytes) = (Vec::new(), 0);
    for h in 0..HEADS {
        let rows = |x: &[f32], a: usize, b: usize| f16_rows(&x[(h * total + a) * D..(h * total + b) * D]);
        let mut coded = Kv43Head::new(D, Kv43Params::default()).unwrap();
        coded.append(&rows(k, sink, base), &rows(v, sink, base)).unwrap();
        coded_bytes += coded.bytes();
        let (ck, cv) = if plain { (rows(k, sink, base), rows(v, sink, base)) } else { coded.dequantize() };
        let rk = [rows(k, 0, sink), ck, rows(k, base, total)].concat();
        let rv = [rows(v, 0, sink), cv, rows(v, base, total)].concat();
        for j in 0..g {
            out.extend(attend_f64(&q[(h * g + j) * D..(h * g + j + 1) * D], &rk, &rv, None));
        }
    }
    (out, coded_bytes)
}

#[test]
fn a_full_budget_pq_plan_over_kv43_equals_exact_attention_over_the_same_rows() {
    // 2,500 prefill tokens: 2,496 base rows past the sink, 19 key groups and 64 rows in f16.
    let (total, prefill) = (2900, 2500);
    let (k, v) = data(total, 1);
    let pq = build(kv43(), (&k, &v), total, prefill);
    let stats = pq.stats();
    assert_eq!(stats.tokens, total);
    let q = queries(2, 0.4);
    let (dequantized, coded_bytes) = reference(&k, &v, &q, (total, prefill), false);
    let (f16_ref, _) = reference(&k, &v, &q, (total, prefill), true);
    // The base past the sink is held as kv43 rows, and the stats count their bytes (codes,
    // metadata, the partial group's f16 rows); everything else is f16.
    let plain_rows = total - (prefill - params().sink_tokens);
    assert_eq!(stats.kv_bytes, coded_bytes + 2 * plain_rows * HEADS * D * 2, "{stats:?}");

    // Exact plan: the base on its codes, within the codec's arithmetic (8-bit queries per
    // key group, 8-bit probabilities per 64 rows) of exact attention over the rows the codes
    // stand for, much nearer than the f16 rows are (the rounding of 4 + 3 bits).
    let exact = run(&pq, &shape(), &q, None);
    let rounding = rel_l2(&dequantized.iter().map(|&x| x as f32).collect::<Vec<_>>(), &f16_ref);
    let err = rel_l2(&exact, &dequantized);
    println!("exact plan over kv43: {err:.2e} from the dequantized rows (rounding alone {rounding:.2e})");
    assert!(err < 0.01 && err < rounding / 2.0, "{err} vs rounding {rounding}");

    // A sparse plan whose retrieval zone is every coded token, adjacent tokens merged into
    // one range per region: the same kv43 rows in one run, so the exact plan's answer up to
    // the order partials merge in (1e-5).
    for mode in [SelectionMode::PerKvHead, SelectionMode::PerQueryHead] {
        let all = ZoneBudget { retrieve_tokens: total, estimate_tokens: 0, mode };
        let plan = pq.plan_head(0, &q[..shape().group() * D], &all);
        assert!(!plan.exact && !plan.selections.is_empty(), "{plan:?}");
        let spans: Vec<(u32, u32, u32)> =
            plan.selections[0].retrieve.iter().map(|s| (s.unit, s.start, s.end)).collect();
        assert_eq!(spans, [(0, 4, prefill as u32), (1, 0, (total - 32 - prefill) as u32)], "{plan:?}");
        let sparse = run(&pq, &shape(), &q, Some(&all));
        let to_exact = rel_l2(&sparse, &exact.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
        println!("{mode:?} retrieve-all: {to_exact:.2e} from the exact plan");
        assert!(to_exact < 1e-5, "{to_exact}");
    }

    // Right after the prefill the base's last 32 rows (its local window at the build) are
    // not coded yet: they are in the steady zone, still attended on their codes, and the
    // value blocks they share with retrieved rows are cut in two, whose probabilities are
    // coded against each part's own maximum. Still the dequantized rows' answer within the
    // codec's arithmetic.
    let k0 = token_slice(&k, (HEADS, D), total, 0, prefill);
    let v0 = token_slice(&v, (HEADS, D), total, 0, prefill);
    let fresh = build(kv43(), (&k0, &v0), prefill, prefill);
    let (dequantized, _) = reference(&k0, &v0, &q, (prefill, prefill), false);
    let all = ZoneBudget { retrieve_tokens: prefill, estimate_tokens: 0, mode: SelectionMode::PerKvHead };
    let plan = fresh.plan_head(0, &q[..shape().group() * D], &all);
    assert_eq!((plan.steady_tokens, plan.selections[0].retrieve_tokens), (4 + 32, prefill - 4 - 32), "{plan:?}");
    let (exact, sparse) = (run(&fresh, &shape(), &q, None), run(&fresh, &shape(), &q, Some(&all)));
    let (e1, e2) = (rel_l2(&exact, &dequantized), rel_l2(&sparse, &dequantized));
    println!("right after the prefill: exact {e1:.2e}, retrieve-all {e2:.2e} from the dequantized rows");
    assert!(e1 < 0.01 && e2 < 0.01 && e2 < rounding / 2.0, "{e1} {e2}");
}

#[test]
fn decode_tokens_of_a_kv43_base_are_coded_from_the_keys_the_codes_stand_for() {
    // The base's last `local_tokens` rows get their PQ codes after the build, from their
    // dequantized keys (as `hack2` decodes its 2-bit rows): an index restored from the same
    // f16 rows codes them the same way.
    let (total, prefill) = (2700, 2500);
    let (k, v) = data(total, 3);
    let a = build(kv43(), (&k, &v), total, prefill);
    let mut b = empty(kv43());
    b.restore(
        &a.snapshot().unwrap(),
        &token_slice(&k, (HEADS, D), total, 0, prefill),
        &token_slice(&v, (HEADS, D), total, 0, prefill),
    )
    .unwrap();
    append_in_batches(&mut b, (&k, &v), (HEADS, D), total, prefill);
    assert_eq!(a.stats(), b.stats());
    for h in 0..HEADS {
        for p in [4, 1000, prefill - 33, prefill - 1, prefill, total - 40] {
            assert_eq!(a.codes_of(h, p), b.codes_of(h, p), "head {h} position {p}");
        }
        assert!(a.codes_of(h, prefill - 1).is_some(), "the base's local window is coded once it leaves it");
    }
    let q = queries(4, 1.0);
    let zone = ZoneBudget { retrieve_tokens: 100, estimate_tokens: 0, mode: SelectionMode::PerKvHead };
    assert_eq!(run(&a, &shape(), &q, Some(&zone)), run(&b, &shape(), &q, Some(&zone)));
}

#[test]
fn a_kv43_pq_index_restored_from_its_encoded_home_is_the_index_it_came_from() {
    // 9,000 prefill tokens: base rows past the sink in pieces of 8,192 rows (64 key groups)
    // and the rest, 804 rows ending in a partial key group of 36.
    let (total, prefill) = (9300, 9000);
    let (k, v) = data(total, 5);
    let original = build(kv43(), (&k, &v), total, prefill);
    assert_eq!(original.encoded_segments(), Some(2));
    assert_eq!(build(Codec::F16, (&k, &v), 600, 600).encoded_segments(), None, "plain rows: no encoded home");
    let home = original.encoded_home(0).unwrap().unwrap();
    assert_eq!((home.segments.len(), home.tail_start, home.tokens), (2, prefill as u64, total as u64));
    let lens: Vec<u64> = home.segments.iter().map(|s| s.len).collect();
    assert_eq!(lens, [8192, prefill as u64 - 4 - 8192]);
    for (u, seg) in home.segments.iter().enumerate() {
        for h in &seg.heads {
            let Some(rows) = h.rows.kv43() else { panic!("kv43 rows") };
            let partial = rows.rows() - rows.encoded_rows();
            assert_eq!(partial, if u == 0 { 0 } else { (prefill - 4) % 128 }, "segment {u}");
        }
    }
    let later = original.encoded_home(2).unwrap().unwrap();
    assert!(later.segments.is_empty() && later.steady == home.steady, "the base is written once");

    let snapshot = original.snapshot();
    let with = |mut h: EncodedHome| {
        h.pq = snapshot.clone();
        h
    };
    let mut restored = empty(kv43());
    let err = restored.restore_encoded(home.clone()).unwrap_err();
    assert!(err.to_string().contains("carries no codebooks"), "{err}");
    restored.restore_encoded(with(home.clone())).unwrap();
    assert_eq!(restored.snapshot(), original.snapshot());
    assert_eq!(restored.stats(), original.stats());
    let mut original = original;
    for round in 0..2 {
        for h in 0..HEADS {
            for p in [4, 5000, 8999, 9100, total - 40] {
                assert_eq!(restored.codes_of(h, p), original.codes_of(h, p), "head {h} position {p}");
            }
        }
        let q = queries(20 + round, 2.0);
        assert_eq!(run(&restored, &shape(), &q, None), run(&original, &shape(), &q, None), "exact, round {round}");
        let zone = ZoneBudget { retrieve_tokens: 200, estimate_tokens: 0, mode: SelectionMode::PerQueryHead };
        assert_eq!(run(&restored, &shape(), &q, Some(&zone)), run(&original, &shape(), &q, Some(&zone)));
        // Decoding goes on the same way from the restored index.
        let more = 150;
        let (k2, v2) = data(more, 30 + round);
        for pq in [&mut original, &mut restored] {
            append_in_batches(pq, (&k2, &v2), (HEADS, D), more, 0);
        }
        assert_eq!(restored.stats(), original.stats());
    }

    // Homes that do not fit are typed errors that change nothing.
    let mut broken: Vec<(&str, EncodedHome)> = Vec::new();
    let mut h = with(home.clone());
    h.segments.pop();
    broken.push(("a missing segment", h));
    let mut h = with(home.clone());
    h.segments.swap(0, 1);
    broken.push(("segments out of order", h));
    let mut h = with(home.clone());
    h.segments[0].heads[1] = h.segments[1].heads[1].clone();
    broken.push(("a head with the last piece's rows (a partial key group) in the first", h));
    let mut h = with(home.clone());
    let hack = attnstore_kernels::HackRows::new(D, HackParams::default()).unwrap();
    h.segments[0].heads[0].rows = EncodedRows::Hack(hack);
    broken.push(("2-bit rows in a kv43 home", h));
    let mut h = with(home.clone());
    h.steady[0].sink_values[3] = f16::NAN;
    broken.push(("a NaN sink value", h));
    for (what, h) in broken {
        let mut pq = empty(kv43());
        let err = pq.restore_encoded(h).unwrap_err();
        assert!(err.to_string().contains("encoded pq index"), "{what}: {err}");
        assert_eq!(pq.stats().tokens, 0, "{what}");
        assert!(pq.snapshot().is_none(), "{what}");
    }
    let err = empty(Codec::Hack2(HackParams::default())).restore_encoded(with(home.clone())).unwrap_err();
    assert!(err.to_string().contains("kv43 rows, expected 2-bit rows"), "{err}");
    assert!(empty(Codec::F16).restore_encoded(with(home.clone())).is_err(), "an index without the codec");
    assert!(restored.restore_encoded(with(home)).is_err(), "a non-empty index");
}
