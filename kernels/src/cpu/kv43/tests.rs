//! kv43's tests: codes round-trip, the homomorphic arithmetic equals dequantize-then-
//! multiply, fast paths equal their references, row runs, rows as they arrive, bad input.

use super::*;
use crate::random::SplitMix64;

/// The kernels to test: AVX2 (or portable) always, AVX-512 too where the CPU has it (else
/// a printed reason).
fn kernel_choices() -> Vec<bool> {
    if attention::wide_kernels() {
        vec![false, true]
    } else {
        println!("skipping the AVX-512 kv43 kernels: this CPU (or ATTNSTORE_HACK_KERNEL=avx2) does not run them");
        vec![false]
    }
}

/// Keys with outlier channels (as real models' are) and plain values.
fn data(rows: usize, d: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix64::new(seed);
    let keys = (0..rows * d).map(|i| rng.normal() * if i % d < 3 { 8.0 } else { 1.0 }).collect();
    let values = (0..rows * d).map(|_| rng.normal()).collect();
    let q = (0..d).map(|_| rng.normal()).collect();
    (keys, values, q)
}

#[test]
fn codes_round_trip_within_half_a_step_and_bytes_match_the_formula() {
    for (d, params) in [
        (64, Kv43Params::default()),
        (128, Kv43Params { key_bits: 4, value_bits: 3, key_group: 64, value_block: 64 }),
        (256, Kv43Params { key_bits: 4, value_bits: 3, key_group: 256, value_block: 32 }),
        (64, Kv43Params { key_bits: 5, ..Kv43Params::default() }),
        (128, Kv43Params { key_bits: 5, value_bits: 3, key_group: 128, value_block: 128 }),
        (64, Kv43Params { value_bits: 4, ..Kv43Params::default() }),
        (128, Kv43Params { key_bits: 5, value_bits: 4, key_group: 256, value_block: 128 }),
    ] {
        let rows = 2 * params.key_group;
        let (k, v, _) = data(rows, d, 3);
        let enc = Kv43Rows::encode(&k, &v, d, params).unwrap();
        let (dk, dv) = enc.dequantize();
        for j in 0..rows {
            for c in 0..d {
                let (g, b) = (j / params.key_group, j / params.value_block);
                let ks = enc.key_scale[g * d + c].to_f32();
                let vs = enc.value_scale[b * d + c].to_f32();
                // Half a step, plus the f16 rounding of the minimum and scale.
                assert!((dk[j * d + c] - k[j * d + c]).abs() <= 0.5 * ks + 1e-2 * ks.max(1e-3) + 4e-3, "key {j},{c}");
                assert!((dv[j * d + c] - v[j * d + c]).abs() <= 0.5 * vs + 1e-2 * vs.max(1e-3) + 4e-3, "value {j},{c}");
            }
        }
        assert_eq!(
            enc.bytes() as f64,
            params.bytes_per_token(d) * rows as f64,
            "d = {d}: {} bytes for {rows} rows",
            enc.bytes()
        );
    }
    // The default layout is a quarter of f16's bytes at every supported d: d/2 + 3d/8
    // bytes of codes, d/32 of code sums, d/32 of key and d/16 of value metadata.
    for d in [64, 128, 256] {
        assert_eq!(Kv43Params::default().bytes_per_token(d), 0.25 * 4.0 * d as f64, "d = {d}");
    }
    // A fifth key bit costs d/8 bytes; 128-token value blocks save 2d/64 of metadata.
    let k5 = Kv43Params { key_bits: 5, ..Kv43Params::default() };
    assert_eq!(k5.bytes_per_token(64) - Kv43Params::default().bytes_per_token(64), 8.0);
    let v128 = Kv43Params { value_block: 128, ..Kv43Params::default() };
    assert_eq!(Kv43Params::default().bytes_per_token(64) - v128.bytes_per_token(64), 2.0);
    // A fourth value bit costs d/8 bytes too.
    let v4 = Kv43Params { value_bits: 4, ..Kv43Params::default() };
    assert_eq!(v4.bytes_per_token(64) - Kv43Params::default().bytes_per_token(64), 8.0);
}

#[test]
fn five_bit_keys_use_31_levels_and_halve_the_key_step() {
    let d = 64;
    let (k, v, _) = data(128, d, 31);
    let four = Kv43Rows::encode(&k, &v, d, Kv43Params::default()).unwrap();
    let five = Kv43Rows::encode(&k, &v, d, Kv43Params { key_bits: 5, ..Kv43Params::default() }).unwrap();
    let codes: Vec<u8> = (0..128).flat_map(|j| (0..d).map(move |c| (j, c))).map(|(j, c)| five.key_code(j, c)).collect();
    // Every level is used somewhere (the first three channels' outliers span the range)
    // and none is above 31.
    assert_eq!(codes.iter().copied().max(), Some(31));
    assert!(codes.iter().any(|&c| c > 15 && c < 31));
    for c in 0..d {
        let (s4, s5) = (four.key_scale[c].to_f32(), five.key_scale[c].to_f32());
        assert!((s4 / s5 - 31.0 / 15.0).abs() < 0.01, "channel {c}: steps {s4} and {s5}");
    }
    let err = |e: &Kv43Rows| {
        let (dk, _) = e.dequantize();
        dk.iter().zip(&k).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>()
    };
    assert!(err(&five) < 0.3 * err(&four), "5-bit error {} vs 4-bit {}", err(&five), err(&four));
}

#[test]
fn homomorphic_scores_and_values_equal_dequantize_then_multiply() {
    for (key_bits, value_bits, value_block) in [(4, 3, 64), (5, 3, 64), (4, 3, 128), (4, 4, 64), (5, 4, 128)] {
        homomorphic_equals_dequantized(Kv43Params { key_bits, value_bits, value_block, ..Kv43Params::default() });
    }
}

fn homomorphic_equals_dequantized(params: Kv43Params) {
    let d = 128;
    let (k, v, q) = data(256, d, 5);
    let enc = Kv43Rows::encode(&k, &v, d, params).unwrap();
    let (dk, dv) = enc.dequantize();
    let scale = 1.0 / (d as f32).sqrt();
    // Scores: the same 8-bit query, dequantized, times the dequantized keys (f64).
    let got = enc.scores(&q, scale);
    let mut gq = GroupQuery::new(d);
    for (j, &s) in got.iter().enumerate() {
        let g = j / params.key_group;
        enc.group_channels(g, &mut gq.key_scale, &mut gq.key_min);
        gq.prepare(&q);
        let want: f64 = (0..d)
            .map(|c| {
                let (a, b) = gq.ab[c / PART];
                let qs = f64::from(a) + f64::from(b) * f64::from(gq.w[c]);
                let ks = f64::from(enc.key_scale[g * d + c].to_f32());
                // q_c·k_c = q_c m_c + (q_c s_c)·u: the scaled query's code stands for q_c s_c.
                let u = if ks > 0.0 {
                    (f64::from(dk[j * d + c]) - f64::from(enc.key_min[g * d + c].to_f32())) / ks
                } else {
                    0.0
                };
                f64::from(q[c]) * f64::from(enc.key_min[g * d + c].to_f32()) + qs * u
            })
            .sum::<f64>()
            * f64::from(scale);
        assert!((f64::from(s) - want).abs() <= 1e-4 * want.abs().max(1.0), "row {j}: {s} vs {want}");
    }
    // Values: the same 8-bit probabilities times the dequantized values.
    let out = enc.attend(&q, scale);
    let max = got.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let p: Vec<f32> = got.iter().map(|s| (s - max).exp()).collect();
    let (mut want, mut total) = (vec![0.0f64; d], 0.0f64);
    // Probabilities coded per 64 rows, also inside 128-row value blocks.
    assert_eq!(params.probability_rows(), 64);
    for block in p.chunks(params.probability_rows()).enumerate() {
        let (b, ps) = block;
        let step = ps.iter().copied().fold(0.0f32, f32::max) / P_LEVELS;
        for (i, &x) in ps.iter().enumerate() {
            let w = f64::from(step) * f64::from((x / step).round().min(P_LEVELS));
            total += w;
            let t = b * params.probability_rows() + i;
            want.iter_mut().enumerate().for_each(|(c, o)| *o += w * f64::from(dv[t * d + c]));
        }
    }
    for (c, (&o, w)) in out.iter().zip(&want).enumerate() {
        let w = w / total;
        assert!((f64::from(o) - w).abs() <= 1e-4 * w.abs().max(0.1), "channel {c}: {o} vs {w}");
    }
}

#[test]
fn the_8_bit_query_and_7_bit_probabilities_add_little_to_the_rounding_error() {
    use crate::cpu::reference::{attend_f64, rel_l2};
    let d = 128;
    let (k, v, _) = data(512, d, 7);
    let enc = Kv43Rows::encode(&k, &v, d, Kv43Params::default()).unwrap();
    let (dk, dv) = enc.dequantize();
    let scale = 1.0 / (d as f32).sqrt();
    for row in [17, 300] {
        // A query aimed at one row, as decode queries mostly are (attend_f64 scales by 1/√d).
        let q: Vec<f32> = k[row * d..(row + 1) * d].iter().map(|x| x * 0.3).collect();
        let exact = attend_f64(&q, &k, &v, None);
        let rounding = rel_l2(&attend_f64(&q, &dk, &dv, None).iter().map(|&x| x as f32).collect::<Vec<_>>(), &exact);
        let codes = rel_l2(&enc.attend(&q, scale), &exact);
        println!("row {row}: on the codes {codes:.4}, rounding alone {rounding:.4}");
        assert!(codes <= rounding * 1.25 + 0.01, "row {row}: on the codes {codes}, rounding alone {rounding}");
        // 3-bit codes of Gaussian values: a step of ~6σ/7, an error of ~0.25σ per value.
        assert!(rounding < 0.3, "row {row}: rounding alone {rounding}");
    }
}

#[test]
fn heads_together_equal_each_head_alone() {
    let v4 = Kv43Params { value_bits: 4, ..Kv43Params::default() };
    for (d, heads, params) in [(64, 1, v4), (128, 4, Kv43Params::default()), (128, 4, v4), (256, 3, v4)] {
        let (keys, values, _) = data(384, d, 5 + d as u64);
        let rows = Kv43Rows::encode(&keys, &values, d, params).unwrap();
        let mut rng = SplitMix64::new(9);
        let q: Vec<f32> = (0..heads * d).map(|_| rng.normal()).collect();
        let together = rows.attend_heads(&q, heads, 0.1).unwrap();
        for h in 0..heads {
            let alone = rows.attend(&q[h * d..(h + 1) * d], 0.1);
            let alone: Vec<f64> = alone.iter().map(|&x| f64::from(x)).collect();
            let err = crate::cpu::reference::rel_l2(&together[h * d..(h + 1) * d], &alone);
            // Only the vectorized exp differs (a few ulp), which can move an 8-bit code.
            assert!(err < 2e-3, "d = {d}, head {h}: {err}");
        }
    }
    let rows = Kv43Rows::encode(&vec![0.5; 128 * 64], &vec![0.5; 128 * 64], 64, Kv43Params::default()).unwrap();
    assert!(matches!(rows.attend_heads(&[0.0; 100], 2, 1.0), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(rows.attend_heads(&[], 0, 1.0), Err(Error::ShapeMismatch { .. })));
}

#[test]
fn groups_are_encoded_once_when_they_fill_and_the_partial_group_is_attended_exactly() {
    let (d, heads, n) = (128, 4, 128 * 3 + 50);
    let (keys, values, _) = data(n, d, 21);
    // f16 first, as the head keeps rows before encoding them.
    let r16 = |x: &[f32]| x.iter().map(|&v| f16::from_f32(v).to_f32()).collect::<Vec<_>>();
    let (k16, v16) = (r16(&keys), r16(&values));
    let mut head = Kv43Head::new(d, Kv43Params::default()).unwrap();
    let mut seen: Vec<Kv43Rows> = Vec::new();
    for (i, (k, v)) in keys.chunks(7 * d).zip(values.chunks(7 * d)).enumerate() {
        head.append(k, v).unwrap();
        // What is encoded is a prefix of whole groups, and an encoded group never changes.
        let done = head.encoded_rows();
        assert_eq!(done % 128, 0, "chunk {i}");
        assert!(done <= head.rows() && head.rows() - done < 128, "chunk {i}");
        if let Some(e) = head.encoded() {
            let whole = Kv43Rows::encode(&k16[..done * d], &v16[..done * d], d, Kv43Params::default()).unwrap();
            assert_eq!(*e, whole, "chunk {i}: the groups differ from encoding them at once");
            if let Some(prev) = seen.last() {
                assert_eq!(
                    e.key_codes[..prev.key_codes.len()],
                    prev.key_codes[..],
                    "chunk {i}: a group was re-encoded"
                );
                assert_eq!(e.value_planes[..prev.value_planes.len()], prev.value_planes[..]);
            }
            seen.push(e.clone());
        }
    }
    assert_eq!((head.rows(), head.encoded_rows()), (n, 384));
    assert_eq!(head.bytes(), head.encoded().unwrap().bytes() + 4 * 50 * d);
    // Attention: the codes' arithmetic over the encoded rows, exact over the 50 in f16,
    // close to exact attention over the dequantized rows and the f16 tail.
    let mut rng = SplitMix64::new(4);
    let q: Vec<f32> = (0..heads * d).map(|_| rng.normal() * 0.3).collect();
    let out = head.attend(&q, heads, 0.09).unwrap();
    let (dk, dv) = head.encoded().unwrap().dequantize();
    let (mut ak, mut av) = (dk, dv);
    ak.extend_from_slice(&k16[384 * d..]);
    av.extend_from_slice(&v16[384 * d..]);
    for h in 0..heads {
        let qs: Vec<f32> = q[h * d..(h + 1) * d].iter().map(|x| x * 0.09 * (d as f32).sqrt()).collect();
        let want = crate::cpu::reference::attend_f64(&qs, &ak, &av, None);
        let err = crate::cpu::reference::rel_l2(&out[h * d..(h + 1) * d], &want);
        println!("head {h}: codes + exact tail vs exact over the dequantized rows: {err:.5}");
        assert!(err < 0.05, "head {h}: {err}");
    }
    // Only the tail: exact attention of its f16 rows.
    let mut small = Kv43Head::new(d, Kv43Params::default()).unwrap();
    small.append(&keys[..10 * d], &values[..10 * d]).unwrap();
    let qs: Vec<f32> = q[..d].iter().map(|x| x * 0.09 * (d as f32).sqrt()).collect();
    let want = crate::cpu::reference::attend_f64(&qs, &k16[..10 * d], &v16[..10 * d], None);
    assert!(crate::cpu::reference::rel_l2(&small.attend(&q[..d], 1, 0.09).unwrap(), &want) < 1e-5);
    // Bad input changes nothing.
    let before = head.rows();
    assert!(matches!(head.append(&keys[..d], &values[..d - 1]), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(head.append(&[f32::NAN; 128], &[0.0; 128]), Err(Error::InvalidArgument { .. })));
    assert_eq!(head.rows(), before);
    assert!(Kv43Head::new(d, Kv43Params::default()).unwrap().attend(&q[..d], 1, 0.1).is_err());
    assert!(Kv43Head::new(100, Kv43Params::default()).is_err());
}

#[test]
fn row_runs_attend_only_their_rows_and_splits_at_blocks_merge_back() {
    use crate::cpu::reference::{attend_f64, rel_l2};
    let (d, heads, n) = (128, 4, 128 * 3 + 40);
    let (keys, values, _) = data(n, d, 31);
    let mut head = Kv43Head::new(d, Kv43Params::default()).unwrap();
    head.append(&keys, &values).unwrap();
    let (dk, dv) = head.dequantize();
    let mut rng = SplitMix64::new(8);
    let q: Vec<f32> = (0..heads * d).map(|_| rng.normal() * 0.3).collect();
    let scale = 1.0 / (d as f32).sqrt();
    let run = |ranges: &[Range<usize>]| {
        let mut parts = vec![Partial::empty(d); heads];
        head.attend_runs(&q, scale, ranges, &mut parts).unwrap();
        parts
    };
    // Runs across key groups, value blocks and the f16 tail: close to exact attention
    // over the same dequantized rows (the 8-bit query and 8-bit probabilities' error).
    let ranges = [5..70, 100..300, 390..420];
    let got: Vec<f32> = run(&ranges).iter().flat_map(Partial::finish).collect();
    let pick = |x: &[f32]| -> Vec<f32> { ranges.iter().flat_map(|r| x[r.start * d..r.end * d].to_vec()).collect() };
    let (sk, sv) = (pick(&dk), pick(&dv));
    for h in 0..heads {
        let want = attend_f64(&q[h * d..(h + 1) * d], &sk, &sv, None);
        let err = rel_l2(&got[h * d..(h + 1) * d], &want);
        assert!(err < 0.05, "head {h}: {err}");
    }
    // Split at value-block boundaries and merged: the same codes, the same answer.
    let whole = run(&[5..420]);
    let mut merged = vec![Partial::empty(d); heads];
    for r in [5..64, 64..192, 192..384, 384..420] {
        merged.iter_mut().zip(run(&[r])).for_each(|(a, b)| a.merge(&b));
    }
    for (a, b) in whole.iter().zip(&merged) {
        let b: Vec<f64> = b.finish().iter().map(|&x| f64::from(x)).collect();
        let err = rel_l2(&a.finish(), &b);
        assert!(err < 1e-5, "{err}");
    }
    // No rows: nothing changes; bad ranges and shapes are typed errors.
    assert!(run(&[]).iter().all(Partial::is_empty));
    let mut parts = vec![Partial::empty(d); heads];
    assert!(matches!(head.attend_runs(&q, scale, &[0..n + 1], &mut parts), Err(Error::InvalidArgument { .. })));
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = [9..3];
    assert!(matches!(head.attend_runs(&q, scale, &backwards, &mut parts), Err(Error::InvalidArgument { .. })));
    let mut short = vec![Partial::empty(d - 1); heads];
    assert!(matches!(head.attend_runs(&q, scale, &[0..4], &mut short), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(head.attend_runs(&q[..d], scale, &[0..4], &mut parts), Err(Error::ShapeMismatch { .. })));
    assert!(parts.iter().all(Partial::is_empty));
}

#[test]
fn fast_scores_equal_the_reference_exactly() {
    for (d, key_bits) in [64, 128, 256].into_iter().flat_map(|d| [(d, 4), (d, 5)]) {
        let (keys, values, q) = data(256, d, 11 + d as u64);
        let params = Kv43Params { key_bits, ..Kv43Params::default() };
        let rows = Kv43Rows::encode(&keys, &values, d, params).unwrap();
        assert_eq!(rows.scores(&q, 0.125), rows.scores_reference(&q, 0.125), "d = {d}, {key_bits}-bit keys");
    }
}

#[test]
fn bad_parameters_and_rows_are_typed_errors() {
    let (k, v, _) = data(128, 64, 1);
    for params in [
        Kv43Params { key_bits: 4, value_bits: 3, key_group: 96, value_block: 64 },
        Kv43Params { key_bits: 4, value_bits: 3, key_group: 128, value_block: 12 },
        Kv43Params { key_bits: 4, value_bits: 3, key_group: 0, value_block: 64 },
        Kv43Params { key_bits: 3, ..Kv43Params::default() },
        Kv43Params { key_bits: 6, ..Kv43Params::default() },
        Kv43Params { value_bits: 2, ..Kv43Params::default() },
        Kv43Params { value_bits: 5, ..Kv43Params::default() },
    ] {
        assert!(matches!(Kv43Rows::encode(&k, &v, 64, params), Err(Error::InvalidArgument { .. })), "{params:?}");
    }
    assert!(Kv43Rows::encode(&k, &v, 48, Kv43Params::default()).is_err(), "d not a multiple of 64");
    assert!(Kv43Rows::encode(&k[..64 * 64], &v[..64 * 64], 64, Kv43Params::default()).is_err(), "a partial key group");
    assert!(Kv43Rows::encode(&k, &v[1..], 64, Kv43Params::default()).is_err(), "lengths differ");
    let mut nan = k.clone();
    nan[5] = f32::NAN;
    assert!(Kv43Rows::encode(&nan, &v, 64, Kv43Params::default()).is_err(), "NaN");
}

#[test]
fn tile_scores_of_every_head_count_equal_the_reference_exactly() {
    // Partial tiles at both ends of a run, key groups of 24 rows (three tiles), d with
    // three partitions, and more heads than one kernel pass serves.
    for (d, params) in [
        (64, Kv43Params { key_bits: 4, value_bits: 3, key_group: 24, value_block: 8 }),
        (128, Kv43Params::default()),
        (192, Kv43Params { key_bits: 4, value_bits: 3, key_group: 64, value_block: 32 }),
        (64, Kv43Params { key_bits: 5, value_bits: 3, key_group: 24, value_block: 8 }),
        (128, Kv43Params { key_bits: 5, value_bits: 3, key_group: 128, value_block: 128 }),
    ] {
        let rows = 3 * params.key_group;
        let (keys, values, _) = data(rows, d, 40 + d as u64);
        let enc = Kv43Rows::encode(&keys, &values, d, params).unwrap();
        for heads in 1..=6 {
            let mut rng = SplitMix64::new(heads as u64);
            let q: Vec<f32> = (0..heads * d).map(|_| rng.normal()).collect();
            let mut got = vec![0.0; heads * rows];
            enc.scores_heads(&q, heads, 0.2, &mut got);
            for h in 0..heads {
                let want = enc.scores_reference(&q[h * d..(h + 1) * d], 0.2);
                assert_eq!(got[h * rows..(h + 1) * rows], want[..], "d = {d}, {heads} heads, head {h}");
            }
            // A run that starts and ends inside tiles writes only its rows, with either kernel
            // (asking for another block's codes as it goes changes nothing).
            let g = 1;
            let run = g * params.key_group + 3..(g + 1) * params.key_group - 5;
            for wide in kernel_choices() {
                let mut queries = attention::GroupQueries::for_kernels(heads, d, wide);
                queries.prepare(&enc, g, &q);
                let mut out = vec![f32::NAN; heads * rows];
                enc.score_rows(&queries, run.clone(), 0.2, &mut out, (rows, 0), Some(0));
                for (i, (&o, &w)) in out.iter().zip(&got).enumerate() {
                    if run.contains(&(i % rows)) {
                        assert_eq!(o, w, "d = {d}, {heads} heads, score {i}, AVX-512 {wide}");
                    } else {
                        assert!(o.is_nan(), "d = {d}, {heads} heads: score {i} outside the run was written");
                    }
                }
            }
            let mut queries = attention::GroupQueries::for_kernels(heads, d, false);
            queries.prepare(&enc, g, &q);
            // The portable tile kernel (the fast path of targets without AVX2) too.
            let t = g * params.key_group / TILE;
            let parts = d / PART;
            let (codes, sums) = (&enc.key_codes[t * TILE * d / 2..][..TILE * d / 2], &enc.key_sums[t * TILE * parts..]);
            let high = if params.key_bits == 5 { &enc.key_high[t * d..(t + 1) * d] } else { &[][..] };
            for h in 0..heads {
                let tile = (codes, high, &sums[..TILE * parts]);
                let portable = attention::tile_scores_portable(tile, &queries, h, 0.2);
                assert_eq!(portable[..], got[h * rows + t * TILE..][..TILE], "d = {d}, head {h}: portable tile");
            }
        }
    }
}

#[test]
fn fast_codes_equal_the_scalar_rounding_exactly() {
    let mut rng = SplitMix64::new(17);
    // Exact halves (ties round away from zero), values below the minimum and above the top
    // level, a NaN, and lengths that leave every remainder of eight.
    let mut x: Vec<f32> = (0..203).map(|_| rng.normal() * 3.0 + 1.0).collect();
    x.extend([0.5, 1.5, 2.5, -0.5, 0.49999997, 14.5, 15.5, 300.0, f32::NAN, -7.0]);
    for len in [0, 1, 7, 8, 9, 64, 100, x.len()] {
        let x = &x[..len];
        for (min, step, levels) in [(-2.0, 0.5, 15.0), (0.0, 1.0, 15.0), (-5.0, 0.037, 255.0), (1.0, 3.0, 7.0)] {
            let (mut fast, mut scalar) = (vec![0u8; len], vec![0u8; len]);
            code_run::<false>(x, min, step, levels, &mut fast);
            code_run_scalar::<false>(x, min, step, levels, &mut scalar);
            assert_eq!(fast, scalar, "{len} values, min {min}, step {step}, levels {levels}");
            // Queries: a product with the step's inverse.
            code_run::<true>(x, min, 1.0 / step, levels, &mut fast);
            code_run_scalar::<true>(x, min, 1.0 / step, levels, &mut scalar);
            assert_eq!(fast, scalar, "{len} values, min {min}, inverse step {}, levels {levels}", 1.0 / step);
        }
        // Probabilities: in [0, 1], with the block's largest at 255 steps.
        let p: Vec<f32> = x.iter().map(|v| if v.is_nan() { *v } else { (v.abs() / 10.0).min(1.0) }).collect();
        for step in [1.0 / 255.0, 0.5 / 255.0, 0.013] {
            let (mut fast, mut scalar) = (vec![0u8; len], vec![0u8; len]);
            let sums = (probability_codes(&p, step, &mut fast), probability_codes_scalar(&p, step, &mut scalar));
            assert_eq!((fast, sums.0), (scalar, sums.1), "{len} probabilities, step {step}");
        }
    }
}

#[test]
fn value_weighing_for_every_head_count_equals_the_reference() {
    // Blocks of one, three and eight 8-row groups and of 128 rows (widened twice), the
    // largest probability codes everywhere (the 16-bit sums' bound) or random ones.
    // 3- and 4-bit values; random values, or every code but one per block at its largest
    // (the 16-bit sums' bound with the largest probabilities).
    let cases = [(64, 8), (128, 24), (64, 64), (128, 128)]
        .into_iter()
        .flat_map(|c| [(c, 3, false), (c, 4, false), (c, 3, true), (c, 4, true)]);
    for ((d, vb), value_bits, saturated) in cases {
        let params = Kv43Params { key_bits: 4, value_bits, key_group: 8 * vb, value_block: vb };
        let (keys, mut values, _) = data(params.key_group, d, vb as u64);
        if saturated {
            values.iter_mut().enumerate().for_each(|(i, v)| *v = if (i / d) % vb == 0 { 0.0 } else { 1.0 });
        }
        let enc = Kv43Rows::encode(&keys, &values, d, params).unwrap();
        let bits = usize::from(value_bits);
        let planes = &enc.value_planes[..vb / 8 * bits * d];
        let mut rng = SplitMix64::new(3);
        for heads in 1..=9 {
            for full in [true, false] {
                let p: Vec<u8> =
                    (0..heads * vb).map(|_| if full { 255 } else { (rng.next_u64() % 256) as u8 }).collect();
                let mut want = vec![0u32; heads * d];
                let mut z = vec![0u8; vb * d];
                unpack_value_codes(planes, d, bits, &mut z);
                if saturated {
                    assert_eq!(z.iter().copied().max(), Some((1 << bits) - 1));
                }
                weigh_value_codes(&z, d, &p, &mut want);
                for wide in kernel_choices() {
                    let mut got = vec![u32::MAX; heads * d];
                    // The planes asked for ahead (as the decode asks for a later block's) change nothing.
                    let pl = (planes, bits, planes);
                    attention::weigh_value_planes(pl, d, &p, (&mut Vec::new(), &mut Vec::new()), &mut got, wide);
                    let what =
                        format!("d = {d}, block {vb}, {bits}-bit values, {heads} heads, full {full}, AVX-512 {wide}");
                    assert_eq!(got, want, "{what}");
                }
            }
        }
    }
}

#[test]
fn heads_taken_apart_into_arrays_come_back_equal() {
    for (d, params, rows) in [
        (64, Kv43Params::default(), 0),
        (64, Kv43Params::default(), 50),
        (64, Kv43Params::default(), 128),
        (128, Kv43Params { key_bits: 4, value_bits: 3, key_group: 64, value_block: 64 }, 3 * 64 + 17),
        (256, Kv43Params { key_bits: 4, value_bits: 3, key_group: 256, value_block: 32 }, 2 * 256 + 255),
        (128, Kv43Params { key_bits: 5, value_bits: 3, key_group: 128, value_block: 128 }, 3 * 128 + 5),
        (64, Kv43Params { key_bits: 4, value_bits: 4, key_group: 128, value_block: 32 }, 2 * 128 + 9),
    ] {
        let (k, v, q) = data(rows.max(1), d, 17);
        let mut head = Kv43Head::new(d, params).unwrap();
        head.append(&k[..rows * d], &v[..rows * d]).unwrap();
        let back = Kv43Head::from_arrays(d, params, head.arrays()).unwrap();
        assert_eq!(back, head, "d = {d}, {rows} rows");
        assert_eq!(back.arrays(), head.arrays());
        if rows > 0 {
            let qs: Vec<f32> = q.iter().chain(&q).copied().collect();
            assert_eq!(back.attend(&qs, 2, 0.1).unwrap(), head.attend(&qs, 2, 0.1).unwrap());
        }
    }
}

#[test]
fn arrays_that_do_not_fit_are_typed_errors_naming_what_was_wrong() {
    let (d, params) = (64, Kv43Params::default());
    let (k, v, _) = data(2 * 128 + 5, d, 23);
    let mut head = Kv43Head::new(d, params).unwrap();
    head.append(&k, &v).unwrap();
    let a = head.arrays();
    let check = |a: Kv43Arrays<'_>, expect: &str| {
        let e = Kv43Head::from_arrays(d, params, a).unwrap_err().to_string();
        assert!(e.contains(expect), "{e:?} should say {expect:?}");
    };
    check(Kv43Arrays { rows: 100, ..a }, "not a multiple of the key group");
    check(Kv43Arrays { key_codes: &a.key_codes[1..], ..a }, "key codes");
    check(Kv43Arrays { value_planes: &a.value_planes[..10], ..a }, "value planes");
    check(Kv43Arrays { key_sums: &a.key_sums[2..], ..a }, "key code sums");
    check(Kv43Arrays { value_scale: &[], ..a }, "value scales");
    let mut min = a.key_min.to_vec();
    min[3] = f16::NAN;
    check(Kv43Arrays { key_min: &min, ..a }, "key minimum 3");
    let mut scale = a.value_scale.to_vec();
    scale[7] = f16::from_f32(-1.0);
    check(Kv43Arrays { value_scale: &scale, ..a }, "value scale 7");
    let mut codes = a.key_codes.to_vec();
    codes[40] ^= 0x10;
    check(Kv43Arrays { key_codes: &codes, ..a }, "stored key code sum");
    check(Kv43Arrays { tail_values: &a.tail_values[d..], ..a }, "partial group");
    let long: Vec<f16> = vec![f16::ZERO; 128 * d];
    check(Kv43Arrays { tail_keys: &long, tail_values: &long, ..a }, "fewer than a key group");
    let mut tail = a.tail_keys.to_vec();
    tail[1] = f16::INFINITY;
    check(Kv43Arrays { tail_keys: &tail, ..a }, "partial group entry 1");
    let wrong = Kv43Params { key_bits: 4, value_bits: 3, key_group: 100, value_block: 64 };
    assert!(Kv43Head::from_arrays(d, wrong, a).is_err());
    assert!(Kv43Head::from_arrays(48, params, a).is_err());
}

#[test]
fn five_bit_arrays_check_their_fifth_bits() {
    let (d, params) = (64, Kv43Params { key_bits: 5, ..Kv43Params::default() });
    let (k, v, _) = data(128 + 3, d, 29);
    let mut head = Kv43Head::new(d, params).unwrap();
    head.append(&k, &v).unwrap();
    let a = head.arrays();
    assert_eq!(a.key_high.len(), 128 * d / 8);
    assert_eq!(Kv43Head::from_arrays(d, params, a).unwrap(), head);
    let e = Kv43Head::from_arrays(d, params, Kv43Arrays { key_high: &a.key_high[1..], ..a }).unwrap_err();
    assert!(e.to_string().contains("key fifth bits"), "{e}");
    let mut high = a.key_high.to_vec();
    high[9] ^= 0x04;
    let e = Kv43Head::from_arrays(d, params, Kv43Arrays { key_high: &high, ..a }).unwrap_err();
    assert!(e.to_string().contains("stored key code sum"), "{e}");
    // 4-bit parameters refuse fifth bits; 5-bit ones refuse their absence.
    assert!(Kv43Head::from_arrays(d, Kv43Params::default(), a).is_err());
}

#[test]
fn avx512_decode_equals_the_avx2_decode() {
    // Whole runs and runs that start and end inside tiles and blocks, 4- and 5-bit keys,
    // 3- and 4-bit values, probability blocks of 64 rows and of a 24-row value block (the
    // AVX2 probabilities there), 1 to 6 heads. The scores and value sums are equal bit for
    // bit (tests above); only the 16-lane `exp` may round differently from the 8-lane one.
    if !kernel_choices().contains(&true) {
        return;
    }
    for (d, params) in [
        (128, Kv43Params::default()),
        (64, Kv43Params { key_bits: 5, value_bits: 4, key_group: 128, value_block: 128 }),
        (192, Kv43Params { key_bits: 4, value_bits: 3, key_group: 48, value_block: 24 }),
    ] {
        let rows = 12 * params.key_group;
        let (keys, values, _) = data(rows, d, 7 + d as u64);
        let enc = Kv43Rows::encode(&keys, &values, d, params).unwrap();
        for heads in [1, 4, 6] {
            let mut rng = SplitMix64::new(heads as u64 + 50);
            let q: Vec<f32> = (0..heads * d).map(|_| rng.normal()).collect();
            for ranges in [vec![0..rows], vec![3..70, 130..131, 200..rows - 9]] {
                let mut out = [false, true].map(|wide| {
                    let mut parts = vec![Partial::empty(d); heads];
                    enc.attend_runs_on(&q, 0.1, &ranges, &mut parts, wide).unwrap();
                    parts
                });
                let [avx2, wide] = &mut out;
                for (h, (a, w)) in avx2.iter().zip(wide.iter()).enumerate() {
                    assert_eq!(a.m, w.m, "d = {d}, head {h}: the running maximum");
                    assert!((a.l - w.l).abs() <= 1e-5 * a.l, "d = {d}, head {h}: l {} vs {}", a.l, w.l);
                    let (a, w) = (a.finish(), w.finish());
                    for (c, (x, y)) in a.iter().zip(&w).enumerate() {
                        assert!((x - y).abs() <= 1e-4 * (1.0 + x.abs()), "d = {d}, head {h}, channel {c}: {x} vs {y}");
                    }
                }
            }
        }
    }
}

#[test]
fn value_nibble_words_hold_the_codes_of_the_planes() {
    let mut rng = SplitMix64::new(43);
    for (bits, d, rows) in [(3, 64, 64), (4, 128, 128), (3, 256, 8)] {
        let planes: Vec<u8> = (0..rows / 8 * bits * d).map(|_| rng.next_u64() as u8).collect();
        let mut z = vec![0u8; rows * d];
        unpack_value_codes(&planes, d, bits, &mut z);
        let words = value_nibble_words(&planes, d, bits);
        assert_eq!(words.len(), rows / 8 * d);
        for t in 0..rows {
            for c in 0..d {
                let w = words[(t / 8) * d + c];
                let code = (w >> (8 * (t % 4) + 4 * ((t % 8) / 4))) & 0xf;
                assert_eq!(code, u32::from(z[t * d + c]), "bits {bits} row {t} channel {c}");
            }
        }
    }
}

#[test]
fn buffers_kept_between_calls_change_no_result() {
    // One thread's calls of several shapes in turn (its buffers kept and reused where the
    // shape repeats) give what each call gives on a fresh thread, bit for bit.
    let params = Kv43Params::default();
    let heads_of: Vec<(usize, Kv43Rows)> = [128, 64]
        .into_iter()
        .map(|d| {
            let (keys, values, _) = data(4 * params.key_group, d, 90 + d as u64);
            (d, Kv43Rows::encode(&keys, &values, d, params).unwrap())
        })
        .collect();
    let rows = 4 * params.key_group;
    let calls = [
        (0, 4, vec![0..rows]),
        (0, 4, vec![3..70, 300..rows]),
        (1, 1, vec![10..20]),
        (1, 1, vec![0..rows]),
        (0, 4, vec![64..65]),
        (0, 4, vec![65..66]),
    ];
    let run = |i: usize, wide: bool| {
        let (which, heads, ranges) = &calls[i];
        let (d, enc) = &heads_of[*which];
        let mut rng = SplitMix64::new(i as u64);
        let q: Vec<f32> = (0..heads * d).map(|_| rng.normal()).collect();
        let mut parts = vec![Partial::empty(*d); *heads];
        enc.attend_runs_on(&q, 0.1, ranges, &mut parts, wide).unwrap();
        parts.iter().flat_map(|p| p.finish()).collect::<Vec<f32>>()
    };
    for wide in kernel_choices() {
        let in_turn: Vec<Vec<f32>> = (0..calls.len()).map(|i| run(i, wide)).collect();
        for (i, got) in in_turn.iter().enumerate() {
            let fresh = std::thread::scope(|s| s.spawn(|| run(i, wide)).join().unwrap());
            assert_eq!(got, &fresh, "call {i}, AVX-512 {wide}");
        }
    }
}

#[test]
fn the_prefetch_knob_is_parsed_and_bad_words_are_named() {
    use attention::{parse_prefetch, Hint, PrefetchPlan};
    let plan = |blocks, hint, spread| PrefetchPlan { blocks, hint, spread };
    assert_eq!(parse_prefetch(""), Ok(plan(4, Some(Hint::L2), true)));
    assert_eq!(parse_prefetch("8"), Ok(plan(8, Some(Hint::L2), true)));
    assert_eq!(parse_prefetch("4, burst"), Ok(plan(4, Some(Hint::L2), false)));
    assert_eq!(parse_prefetch("2,t0,burst"), Ok(plan(2, Some(Hint::L1), false)));
    assert_eq!(parse_prefetch("4,nta"), Ok(plan(4, Some(Hint::NonTemporal), true)));
    assert_eq!(parse_prefetch("t2"), Ok(plan(4, Some(Hint::L3), true)));
    assert_eq!(parse_prefetch("0"), Ok(plan(0, None, true)), "0 asks for nothing");
    let e = parse_prefetch("four").unwrap_err();
    assert!(e.contains("\"four\" is not a block count"), "{e}");
    let e = parse_prefetch("4,spred").unwrap_err();
    assert!(e.contains("unknown word \"spred\""), "{e}");
}
