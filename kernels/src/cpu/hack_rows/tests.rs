//! Tests of the 2-bit rows: rebuilding from arrays, row runs and groups, homomorphic
//! attention against dequantize-then-attend and exact attention, scratch reuse, storage size,
//! and the 7-bit probability rounding of every SIMD lane.

use super::attention::quantize_probs;
use super::*;
use crate::cpu::attention::{attend_rows, Scratch};
use crate::cpu::hack::{KeyLayout, Quantized8};
use crate::cpu::partial::Partial;

fn randn(n: usize, seed: u64) -> Vec<f32> {
    SplitMix64::new(seed).normals(n)
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    (num / b.iter().map(|y| y * y).sum::<f32>()).sqrt()
}

/// The scores of block `block`'s key `k` (dequantized) for each of the `g` heads of `q`,
/// computed in f32 with the same 8-bit query quantization as the homomorphic path: of the
/// raw query (per-token keys), or of the query scaled by the block's channel ranges, against
/// the normalized key, plus `q·m` (per-channel keys).
fn dequantized_scores(rows: &HackRows, q: &[f32], g: usize, block: usize, k: &[f32]) -> Vec<f32> {
    let (d, params) = (rows.d, rows.params);
    (0..g)
        .map(|h| {
            let qh = &q[h * d..(h + 1) * d];
            if !params.per_channel() {
                let q8 = Quantized8::encode(qh, params).decode();
                return q8.iter().zip(k).map(|(a, b)| a * b).sum::<f32>();
            }
            let (m, r) = (&rows.kc_min[block * d..(block + 1) * d], &rows.kc_range[block * d..(block + 1) * d]);
            let scaled: Vec<f32> = qh.iter().zip(r).map(|(x, r)| x * r.to_f32()).collect();
            let q8 = Quantized8::encode(&scaled, params).decode();
            let offset: f32 = qh.iter().zip(m).map(|(x, m)| x * m.to_f32()).sum();
            let normalized = k.iter().zip(m.iter().zip(r)).map(|(x, (m, r))| {
                let r = r.to_f32();
                if r > 0.0 {
                    (x - m.to_f32()) / r
                } else {
                    0.0
                }
            });
            q8.iter().zip(normalized).map(|(a, b)| a * b).sum::<f32>() + offset
        })
        .collect()
}

/// Attention over `ranges` computed in f32 from the dequantized rows, with the same
/// 8-bit query and probability quantization as the homomorphic path.
fn dequantized(rows: &HackRows, q: &[f32], g: usize, ranges: &[Range<usize>]) -> Vec<Vec<f32>> {
    let (d, p) = (rows.d, rows.params.partition);
    let scale = 1.0 / (d as f32).sqrt();
    let mut selected: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
    selected.sort_unstable();
    (0..g)
        .map(|h| {
            let mut part = Partial::empty(d);
            for block in selected.chunk_by(|a, b| a / p == b / p) {
                let mut sc = Vec::new();
                let mut vals = Vec::new();
                for &r in block {
                    let (k, v) = rows.decode_rows(r..r + 1);
                    sc.push(dequantized_scores(rows, q, g, r / p, &k)[h] * scale);
                    vals.push(v);
                }
                let m = part.m.max(sc.iter().copied().fold(f32::NEG_INFINITY, f32::max));
                part.rescale_to(m);
                let pr: Vec<f32> = sc.iter().map(|x| (x - m).exp()).collect();
                let step = pr.iter().copied().fold(0.0, f32::max) / P_LEVELS;
                for (w, v) in pr.iter().zip(&vals) {
                    let w = (w / step).round() * step;
                    part.l += w;
                    part.o.iter_mut().zip(v).for_each(|(o, x)| *o += w * x);
                }
            }
            part.finish()
        })
        .collect()
}

/// Both key layouts.
const LAYOUTS: [KeyLayout; 2] = [KeyLayout::PerToken, KeyLayout::PerChannel];

fn store(tokens: usize, d: usize, seed: u64) -> (HackRows, Vec<f32>, Vec<f32>) {
    let (k, v) = (randn(tokens * d, seed), randn(tokens * d, seed + 1));
    let mut rows = HackRows::new(d, HackParams::default()).unwrap();
    let mut rng = SplitMix64::new(seed + 2);
    let full = tokens / 64 * 64;
    rows.push_rows(&k[..full * d], &v[..full * d], &mut rng).unwrap();
    rows.push_rows(&k[full * d..], &v[full * d..], &mut rng).unwrap();
    (rows, k, v)
}

#[test]
fn rows_rebuilt_from_their_arrays_attend_identically_and_damaged_arrays_are_refused() {
    let d = 64;
    let (rows, _, _) = store(150, d, 21); // a short last block of 22 rows
    let a = rows.arrays();
    let again = HackRows::from_arrays(d, rows.params(), rows.rows(), a).unwrap();
    let q = randn(2 * d, 5);
    let ranges = [0..150, 3..40, 130..150];
    for r in &ranges {
        let (mut x, mut y) = (vec![Partial::empty(d); 2], vec![Partial::empty(d); 2]);
        rows.attend(&q, 0.125, std::slice::from_ref(r), &mut x, &mut HackScratch::default());
        again.attend(&q, 0.125, std::slice::from_ref(r), &mut y, &mut HackScratch::default());
        for (x, y) in x.iter().zip(&y) {
            assert_eq!(x.finish(), y.finish(), "rows {r:?}");
        }
    }
    assert_eq!(again.bytes(), rows.bytes());
    // One row too many for the arrays.
    let err = HackRows::from_arrays(d, rows.params(), 151, a).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { what: "key codes", .. }), "{err}");
    // A flipped key code no longer matches its stored sum.
    let mut codes = a.key_codes.to_vec();
    codes[5] ^= 0b01;
    let err = HackRows::from_arrays(d, rows.params(), 150, HackArrays { key_codes: &codes, ..a }).unwrap_err();
    assert!(err.to_string().contains("code sum"), "{err}");
    // A code in the padding of the short last block.
    let mut codes = a.value_codes.to_vec();
    let last = codes.len() - 1;
    codes[last] |= 0b1100_0000;
    let err = HackRows::from_arrays(d, rows.params(), 150, HackArrays { value_codes: &codes, ..a }).unwrap_err();
    assert!(err.to_string().contains("past its rows"), "{err}");
    // A NaN scale.
    let mut scales = a.value_scale.to_vec();
    scales[3] = f16::NAN;
    let err = HackRows::from_arrays(d, rows.params(), 150, HackArrays { value_scale: &scales, ..a }).unwrap_err();
    assert!(err.to_string().contains("value scale 3"), "{err}");
}

#[test]
fn row_runs_on_block_boundaries_split_and_join_back_to_the_same_rows() {
    let cases = [(128, 64, 300), (64, 32, 96), (36, 16, 21)];
    for ((d, partition, tokens), keys) in cases.into_iter().flat_map(|c| LAYOUTS.map(|k| (c, k))) {
        let params = HackParams::new(partition).unwrap().with_keys(keys);
        let mut rows = HackRows::new(d, params).unwrap();
        rows.push_rows(&randn(tokens * d, 41), &randn(tokens * d, 42), &mut SplitMix64::new(43)).unwrap();
        // Pieces of two blocks, the last one short when the rows are.
        let cuts: Vec<usize> = (0..tokens).step_by(2 * partition).chain([tokens]).collect();
        let pieces: Vec<HackView<'_>> = cuts.windows(2).map(|w| rows.view_rows(w[0]..w[1]).unwrap()).collect();
        let q = randn(2 * d, 44);
        let scale = 1.0 / (d as f32).sqrt();
        let mut whole = vec![Partial::empty(d); 2];
        rows.attend(&q, scale, &[0..tokens], &mut whole, &mut HackScratch::default());
        let mut parts = vec![Partial::empty(d); 2];
        for v in &pieces {
            v.attend(&q, scale, &[0..v.rows()], &mut parts, &mut HackScratch::default());
        }
        for (a, b) in whole.iter().zip(&parts) {
            let (a, b) = (a.clone().finish(), b.clone().finish());
            let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(err < 1e-4, "d={d}: pieces attend as the whole ({err})");
        }
        let again = HackRows::from_groups(d, params, &pieces).unwrap();
        assert_eq!(again.rows(), tokens);
        let copies: Vec<HackRows> = pieces.iter().map(HackView::to_rows).collect();
        assert_eq!(copies.iter().map(HackRows::rows).sum::<usize>(), tokens);
        assert_eq!(copies[0].decode_rows(0..pieces[0].rows()), rows.decode_rows(0..pieces[0].rows()));
        assert_eq!(again.decode_rows(0..tokens), rows.decode_rows(0..tokens), "d={d}");
        assert_eq!(again.bytes(), rows.bytes());
        // Off a block boundary, past the end, or pieces of another shape: typed errors.
        assert!(rows.view_rows(1..partition).is_err());
        assert!(rows.view_rows(0..tokens + 1).is_err());
        if tokens > partition + 1 {
            assert!(rows.view_rows(0..partition + 1).is_err());
        }
        let other = HackParams::new(if partition == 16 { 32 } else { 16 }).unwrap();
        assert!(HackRows::from_groups(d, other, &pieces).is_err());
        let flipped = params.with_keys(if params.per_channel() { KeyLayout::PerToken } else { KeyLayout::PerChannel });
        assert!(HackRows::from_groups(d, flipped, &pieces).is_err(), "pieces of the other key layout");
    }
}

#[test]
fn value_blocks_in_the_group_layout_attend_as_the_rows_they_came_from() {
    let cases = [(128, 64, 150), (64, 32, 96), (36, 16, 21)];
    for ((d, partition, tokens), keys) in cases.into_iter().flat_map(|c| LAYOUTS.map(|k| (c, k))) {
        let params = HackParams::new(partition).unwrap().with_keys(keys);
        let (k, v) = (randn(tokens * d, 31), randn(tokens * d, 32));
        let mut rows = HackRows::new(d, params).unwrap();
        rows.push_rows(&k, &v, &mut SplitMix64::new(33)).unwrap();
        let q = randn(3 * d, 34);
        let scale = 1.0 / (d as f32).sqrt();
        // Each group in a u16 buffer (2-byte aligned), as a buffer manager block would hold it.
        let buffers: Vec<Vec<u16>> = (0..rows.groups())
            .map(|g| {
                let bytes = rows.group_bytes(g);
                let n = (g * partition..((g + 1) * partition).min(tokens)).len();
                assert_eq!(bytes.len(), HackView::group_len(d, params, n), "d={d} group {g}");
                let mut words = vec![0u16; bytes.len().div_ceil(2)];
                bytemuck::cast_slice_mut::<u16, u8>(&mut words)[..bytes.len()].copy_from_slice(&bytes);
                words
            })
            .collect();
        let views: Vec<HackView<'_>> = buffers
            .iter()
            .enumerate()
            .map(|(g, w)| {
                let n = (g * partition..((g + 1) * partition).min(tokens)).len();
                HackView::from_group(d, params, n, bytemuck::cast_slice(w)).unwrap()
            })
            .collect();
        // Attending group by group with the queries quantized once = attending the rows.
        let ranges = [0..tokens, 3..(tokens / 2), (tokens - 5)..tokens];
        for r in &ranges {
            let mut whole = vec![Partial::empty(d); 3];
            rows.attend(&q, scale, std::slice::from_ref(r), &mut whole, &mut HackScratch::default());
            let mut pieces = vec![Partial::empty(d); 3];
            let mut s = HackScratch::default();
            views[0].quantize_queries(&q, 3, &mut s);
            for (g, view) in views.iter().enumerate() {
                let lo = g * partition;
                let local = r.start.max(lo).saturating_sub(lo)..r.end.min(lo + view.rows()).saturating_sub(lo);
                if !local.is_empty() {
                    view.attend_quantized(scale, &[local], &mut pieces, &mut s);
                }
            }
            for (a, b) in whole.iter().zip(&pieces) {
                assert_eq!(a.finish(), b.finish(), "d={d} Π={partition} rows {r:?}");
            }
        }
        let again = HackRows::from_groups(d, params, &views).unwrap();
        assert_eq!((again.rows(), again.bytes()), (rows.rows(), rows.bytes()));
        assert_eq!(again.group_bytes(views.len() - 1), rows.group_bytes(views.len() - 1));
        // Too few bytes, or a short group before the last, are typed errors.
        let short = &bytemuck::cast_slice::<u16, u8>(&buffers[0])[..10];
        assert!(HackView::from_group(d, params, partition.min(tokens), short).is_err());
        if views.len() > 1 {
            let last = views.len() - 1;
            assert!(
                HackRows::from_groups(d, params, &[views[last], views[0]]).is_err() || views[last].rows() == partition
            );
        }
    }
}

#[test]
fn homomorphic_attention_equals_dequantize_then_attend_on_any_row_runs() {
    // Head dims and group sizes that take every kernel path: one or two rows per AVX2
    // score vector, head groups padded to four, the scalar path for Π = 32 and for blocks
    // of more than 64 rows (Π = 128).
    let cases =
        [(128, 4, 64), (64, 3, 64), (256, 1, 64), (64, 2, 32), (128, 5, 64), (192, 2, 64), (32, 4, 64), (64, 2, 128)];
    for ((d, g, partition), keys) in cases.into_iter().flat_map(|c| LAYOUTS.map(|k| (c, k))) {
        let (k, v) = (randn(300 * d, 1), randn(300 * d, 2));
        let mut rows = HackRows::new(d, HackParams::new(partition).unwrap().with_keys(keys)).unwrap();
        rows.push_rows(&k, &v, &mut SplitMix64::new(3)).unwrap();
        let q: Vec<f32> = randn(g * d, 9).iter().map(|x| x * 2.0).collect();
        for ranges in [vec![0..300], vec![5..21, 60..70, 200..201, 290..300], vec![100..164, 10..12]] {
            let mut parts = vec![Partial::empty(d); g];
            rows.attend(&q, 1.0 / (d as f32).sqrt(), &ranges, &mut parts, &mut HackScratch::default());
            let want = dequantized(&rows, &q, g, &ranges);
            for (p, w) in parts.iter().zip(&want) {
                let err = rel(&p.finish(), w);
                assert!(err < 2e-5, "d={d} g={g} Π={partition} {keys:?} {ranges:?}: homomorphic vs dequantized {err}");
            }
        }
    }
}

#[test]
fn two_bit_attention_is_close_to_exact_and_splits_merge() {
    // Values with per-channel means (as real values have): the attention output is
    // then signal, not an average of noise that 2 bits cannot resolve.
    let (d, g, tokens) = (64, 2, 1000);
    let mu = randn(d, 30);
    let k = randn(tokens * d, 31);
    let v: Vec<f32> = randn(tokens * d, 32).iter().enumerate().map(|(i, x)| 2.0 * mu[i % d] + 0.5 * x).collect();
    let mut rows = HackRows::new(d, HackParams::default()).unwrap();
    rows.push_rows(&k, &v, &mut SplitMix64::new(33)).unwrap();
    let q = randn(g * d, 4);
    let scale = 1.0 / (d as f32).sqrt();
    let mut exact = vec![Partial::empty(d); g];
    attend_rows(&q, scale, &k, &v, &mut exact, &mut Scratch::default());
    let mut whole = vec![Partial::empty(d); g];
    rows.attend(&q, scale, &[0..tokens], &mut whole, &mut HackScratch::default());
    // Split at block boundaries the arithmetic is the same; inside a block each side
    // quantizes its probabilities on its own, which moves the result by about a step.
    let split = |cut: usize, tol: f32| {
        let (mut a, mut b) = (vec![Partial::empty(d); g], vec![Partial::empty(d); g]);
        rows.attend(&q, scale, &[0..cut, 704..1000], &mut a, &mut HackScratch::default());
        rows.attend(&q, scale, &[cut..704], &mut b, &mut HackScratch::default());
        for j in 0..g {
            a[j].merge(&b[j]);
            let err = rel(&a[j].finish(), &whole[j].finish());
            assert!(err < tol, "split at {cut}: {err}");
        }
    };
    split(320, 1e-5);
    split(333, 2e-2);
    for j in 0..g {
        let err = rel(&whole[j].finish(), &exact[j].finish());
        assert!(err < 0.05, "2-bit attention vs exact: {err}");
    }
}

#[test]
fn a_scratch_reused_or_primed_attends_as_a_fresh_one() {
    let (d, g, tokens) = (128, 4, 300);
    let (rows, _, _) = store(tokens, d, 40);
    let scale = 1.0 / (d as f32).sqrt();
    let (q1, q2) = (randn(g * d, 41), randn(g * d, 42));
    let run = |q: &[f32], s: &mut HackScratch| {
        let mut parts = vec![Partial::empty(d); g];
        rows.attend(q, scale, &[3..250], &mut parts, s);
        parts.iter().flat_map(Partial::finish).collect::<Vec<f32>>()
    };
    let fresh = |q: &[f32]| run(q, &mut HackScratch::default());
    assert_ne!(fresh(&q1), fresh(&q2), "the two steps must differ for the test to mean anything");
    // The same scratch, queries changing between steps (and back).
    let mut s = HackScratch::default();
    for q in [&q1, &q2, &q2, &q1] {
        assert_eq!(run(q, &mut s), fresh(q));
    }
    // A scratch primed without a view, then cloned.
    let mut primed = HackScratch::default();
    primed.quantize(&q2, g, d, rows.params()).unwrap();
    assert_eq!(run(&q2, &mut primed.clone()), fresh(&q2));
    assert_eq!(run(&q1, &mut primed.clone()), fresh(&q1));
    assert!(matches!(primed.quantize(&q1[..d], g, d, rows.params()), Err(Error::ShapeMismatch { .. })));
}

#[test]
fn storage_is_under_a_fifth_of_f16_and_rows_round_trip_within_a_step() {
    let d = 128;
    let (rows, k, v) = store(640, d, 5);
    let ratio = rows.bytes() as f64 / (640 * d * 2 * 2) as f64;
    assert!(ratio <= 0.2, "{ratio}");
    let (dk, dv) = rows.decode_rows(0..640);
    // Each value is within one quantization step (range/3) of its partition's range.
    for (orig, dec) in [(&k, &dk), (&v, &dv)] {
        let worst = orig.iter().zip(dec.iter()).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(worst < 3.5, "{worst}");
    }
    assert!(!rows.is_sealed());
    let mut sealed = rows.clone();
    let mut rng = SplitMix64::new(1);
    sealed.push_rows(&k[..3 * d], &v[..3 * d], &mut rng).unwrap();
    assert!(sealed.is_sealed());
    assert!(sealed.push_rows(&k[..d], &v[..d], &mut rng).is_err(), "a short block ends the store");
    assert!(sealed.push_rows(&k[..d + 1], &v[..d], &mut rng).is_err());
    assert!(HackRows::new(30, HackParams::default()).is_err());
}

#[test]
fn probabilities_round_to_seven_bits_in_every_lane_and_remainder() {
    let mut rng = SplitMix64::new(77);
    for n in [0, 1, 7, 8, 15, 16, 17, 31, 33, 64] {
        let x: Vec<f32> = (0..n).map(|_| 3.0 * rng.normal()).collect();
        let m = super::super::simd::max_of(&x);
        assert_eq!(m, x.iter().copied().fold(f32::NEG_INFINITY, f32::max), "n={n}");
        if n == 0 {
            continue;
        }
        let inv = P_LEVELS; // the block max is the running max: its probability is 1 → 127
        let mut codes = vec![0u8; n];
        let sum = quantize_probs(&x, m, inv, &mut codes);
        assert_eq!(sum, codes.iter().map(|&c| u32::from(c)).sum::<u32>(), "n={n}");
        for (i, (&c, &xi)) in codes.iter().zip(&x).enumerate() {
            let want = (xi - m).exp() * inv;
            assert!(c <= 127 && (f32::from(c) - want).abs() <= 0.5 + 1e-4, "n={n} i={i}: {c} for {want}");
            if xi == m {
                assert_eq!(c, 127, "n={n}: the maximum takes the top code");
            }
        }
    }
}

#[test]
fn per_channel_keys_survive_outlier_channels_that_per_token_keys_do_not() {
    // Keys as SmolLM2's post-RoPE keys are: a few channels of magnitude ~15 next to channels
    // near 1. Per-token ranges are set by the outliers and the other channels collapse;
    // normalized per channel over each block, every channel keeps its four levels.
    let (d, g, tokens) = (64, 3, 1024);
    let outliers = [3usize, 17, 40];
    let k: Vec<f32> = randn(tokens * d, 51)
        .iter()
        .enumerate()
        .map(|(i, x)| if outliers.contains(&(i % d)) { 15.0 + 0.5 * x } else { *x })
        .collect();
    let mu = randn(d, 52);
    let v: Vec<f32> = randn(tokens * d, 53).iter().enumerate().map(|(i, x)| 2.0 * mu[i % d] + 0.5 * x).collect();
    let q: Vec<f32> = randn(g * d, 54).iter().map(|x| x * 0.5).collect();
    let scale = 1.0 / (d as f32).sqrt();
    let mut exact = vec![Partial::empty(d); g];
    attend_rows(&q, scale, &k, &v, &mut exact, &mut Scratch::default());
    let error = |keys: KeyLayout| {
        let mut rows = HackRows::new(d, HackParams::default().with_keys(keys)).unwrap();
        rows.push_rows(&k, &v, &mut SplitMix64::new(55)).unwrap();
        let mut parts = vec![Partial::empty(d); g];
        rows.attend(&q, scale, &[0..tokens], &mut parts, &mut HackScratch::default());
        let (dk, _) = rows.decode_rows(0..tokens);
        let key_err = rel(&dk, &k);
        let out_err = (0..g).map(|j| rel(&parts[j].finish(), &exact[j].finish())).fold(0.0f32, f32::max);
        (key_err, out_err)
    };
    let (token_keys, token_out) = error(KeyLayout::PerToken);
    let (channel_keys, channel_out) = error(KeyLayout::PerChannel);
    assert!(channel_keys < token_keys / 3.0, "key error per channel {channel_keys} vs per token {token_keys}");
    assert!(channel_out < token_out / 2.0, "attention error per channel {channel_out} vs per token {token_out}");
    // Each key within one step of its normalized row (≤ a third of its channel's range in
    // the block) of the original.
    let mut rows = HackRows::new(d, HackParams::default().with_keys(KeyLayout::PerChannel)).unwrap();
    rows.push_rows(&k, &v, &mut SplitMix64::new(55)).unwrap();
    let (dk, _) = rows.decode_rows(0..tokens);
    for (i, (a, b)) in k.iter().zip(&dk).enumerate() {
        let (block, c) = (i / d / 64, i % d);
        let range = rows.kc_range[block * d + c].to_f32();
        assert!((a - b).abs() <= range / 3.0 * 0.5 + 0.02 * range + 1e-3, "key {i}: {a} vs {b} (range {range})");
    }
}

#[test]
fn per_channel_keys_and_values_round_to_nearest_and_reproduce() {
    // Rounding to nearest takes no randomness: any two seeds give the same codes.
    let (d, tokens) = (64, 200);
    let (k, v) = (randn(tokens * d, 61), randn(tokens * d, 62));
    let params = HackParams::default().with_keys(KeyLayout::PerChannel);
    let encode = |seed| {
        let mut rows = HackRows::new(d, params).unwrap();
        rows.push_rows(&k, &v, &mut SplitMix64::new(seed)).unwrap();
        rows
    };
    let (a, b) = (encode(1), encode(2));
    assert_eq!(a.decode_rows(0..tokens), b.decode_rows(0..tokens));
    assert_eq!(a.bytes(), b.bytes());
    // The stored bytes: the per-token layout plus an f16 minimum and range per channel and block.
    let plain = HackRows::new(d, HackParams::default()).unwrap();
    let mut plain = plain;
    plain.push_rows(&k, &v, &mut SplitMix64::new(1)).unwrap();
    assert_eq!(a.bytes(), plain.bytes() + tokens.div_ceil(64) * d * 4);
    // Values to nearest: each within half a step of the original.
    let (_, dv) = a.decode_rows(0..tokens);
    for (i, (x, y)) in v.iter().zip(&dv).enumerate() {
        let (block, c) = (i / d / 64, i % d);
        let step = a.v_scale[block * d + c].to_f32();
        assert!((x - y).abs() <= 0.5 * step + 2e-3 * step.max(1.0), "value {i}: {x} vs {y} (step {step})");
    }
}

#[test]
fn damaged_channel_metadata_is_refused() {
    let d = 64;
    let mut rows = HackRows::new(d, HackParams::default().with_keys(KeyLayout::PerChannel)).unwrap();
    rows.push_rows(&randn(100 * d, 71), &randn(100 * d, 72), &mut SplitMix64::new(73)).unwrap();
    let a = rows.arrays();
    assert_eq!(a.key_channel_min.len(), 2 * d);
    let err =
        HackRows::from_arrays(d, rows.params(), 100, HackArrays { key_channel_range: &a.key_channel_range[..d], ..a })
            .unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { what: "key channel ranges", .. }), "{err}");
    let mut bad = a.key_channel_range.to_vec();
    bad[5] = f16::NAN;
    let err = HackRows::from_arrays(d, rows.params(), 100, HackArrays { key_channel_range: &bad, ..a }).unwrap_err();
    assert!(err.to_string().contains("key channel scale 5"), "{err}");
    // Per-token arrays read as per-channel rows (or the reverse) do not fit.
    assert!(HackRows::from_arrays(d, HackParams::default(), 100, a).is_err());
}
