//! Product-quantization scoring (PQCache): a per-query lookup table of sub-space dot
//! products, `LUT[j][c] = scale · q_j · centroid_j[c]`, and the approximate score of a token
//! as the sum of its `m` table entries. The table keeps one lane per query head of a GQA
//! group, so one pass over a KV head's codes scores the whole group.

use crate::error::{Error, Result};
use wide::f32x4;

/// Entries per sub-space in a lookup table: codes are bytes, so a table row is indexed by
/// any `u8` without a bounds check and unused entries (b < 8) are simply never read.
pub const LUT_ROWS: usize = 256;

/// A lookup table for one query group: `m` sub-spaces × 256 codes × `lanes` query heads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Lut {
    /// `m × 256 × lanes`, head-minor.
    pub values: Vec<f32>,
    /// Sub-spaces.
    pub subspaces: usize,
    /// Query heads scored (the group).
    pub heads: usize,
    /// Lanes per entry: `heads` rounded up to 1, 2, 4 or 8 (padding lanes copy head 0, so a
    /// maximum over lanes is the maximum over heads); `heads` itself above 8.
    pub lanes: usize,
}

fn lanes_for(heads: usize) -> usize {
    match heads {
        0 | 1 => 1,
        2 => 2,
        3 | 4 => 4,
        5..=8 => 8,
        _ => heads,
    }
}

impl Lut {
    /// Builds the table of the `heads` queries `q` (`heads × d`) against `codebooks`
    /// (`m × codes × d/m`, sub-space major) with `codes` ≤ 256 centroids per sub-space.
    pub fn build(q: &[f32], heads: usize, codebooks: &[f32], m: usize, codes: usize, scale: f32) -> Result<Self> {
        let (d, sub) = Self::check(q, heads, codebooks, m, codes)?;
        let lanes = lanes_for(heads);
        let mut values = vec![0.0f32; m * LUT_ROWS * lanes];
        // Per sub-space one small matrix product: (heads × sub) · (codes × sub)ᵀ.
        let mut qj = vec![0.0f32; heads * sub];
        let mut dots = vec![0.0f32; heads * codes];
        for j in 0..m {
            for h in 0..heads {
                qj[h * sub..(h + 1) * sub].copy_from_slice(&q[h * d + j * sub..][..sub]);
            }
            super::gemm::matmul_transposed(
                &qj,
                &codebooks[j * codes * sub..(j + 1) * codes * sub],
                &mut dots,
                heads,
                codes,
                sub,
            );
            for c in 0..codes {
                let entry = &mut values[(j * LUT_ROWS + c) * lanes..][..lanes];
                for (lane, e) in entry.iter_mut().enumerate() {
                    let h = if lane < heads { lane } else { 0 };
                    *e = scale * dots[h * codes + c];
                }
            }
        }
        Ok(Self { values, subspaces: m, heads, lanes })
    }

    /// [`Lut::build`] from codebooks stored transposed per sub-space (`m × d/m × codes`):
    /// every table row is then a run of contiguous multiply-adds over the codes, with no
    /// per-entry reduction. This is the decode-time path.
    pub fn build_transposed(
        q: &[f32],
        heads: usize,
        codebooks_t: &[f32],
        m: usize,
        codes: usize,
        scale: f32,
    ) -> Result<Self> {
        let (d, sub) = Self::check(q, heads, codebooks_t, m, codes)?;
        let lanes = lanes_for(heads);
        let mut values = vec![0.0f32; m * LUT_ROWS * lanes];
        let mut row = vec![0.0f32; codes];
        for j in 0..m {
            let block = &codebooks_t[j * sub * codes..(j + 1) * sub * codes];
            for lane in 0..lanes {
                let h = if lane < heads { lane } else { 0 };
                if h != lane {
                    // A padding lane copies head 0, already in the table.
                    for c in 0..codes {
                        values[(j * LUT_ROWS + c) * lanes + lane] = values[(j * LUT_ROWS + c) * lanes];
                    }
                    continue;
                }
                row.iter_mut().for_each(|r| *r = 0.0);
                for (x, centroid_dim) in q[h * d + j * sub..][..sub].iter().zip(block.chunks_exact(codes)) {
                    let x = x * scale;
                    row.iter_mut().zip(centroid_dim).for_each(|(r, c)| *r = x.mul_add(*c, *r));
                }
                for (c, v) in row.iter().enumerate() {
                    values[(j * LUT_ROWS + c) * lanes + lane] = *v;
                }
            }
        }
        Ok(Self { values, subspaces: m, heads, lanes })
    }

    /// Checks shapes; returns (head dimension, sub-space dimension).
    fn check(q: &[f32], heads: usize, codebooks: &[f32], m: usize, codes: usize) -> Result<(usize, usize)> {
        if heads == 0 || m == 0 || codes == 0 || codes > LUT_ROWS {
            return Err(Error::InvalidArgument {
                what: "lookup table",
                message: format!("need heads > 0, sub-spaces > 0 and 1..=256 codes; got {heads}, {m}, {codes}"),
            });
        }
        let d = q.len() / heads;
        if d * heads != q.len() || d == 0 || !d.is_multiple_of(m) {
            return Err(Error::ShapeMismatch {
                what: "queries (heads × d, d a multiple of m)",
                expected: heads * d,
                got: q.len(),
            });
        }
        let sub = d / m;
        if codebooks.len() != m * codes * sub {
            return Err(Error::ShapeMismatch {
                what: "codebooks (m × codes × d/m)",
                expected: m * codes * sub,
                got: codebooks.len(),
            });
        }
        Ok((d, sub))
    }
}

/// Codebooks `m × codes × sub` (sub-space major, rows = centroids) transposed to
/// `m × sub × codes`, the layout of [`Lut::build_transposed`].
pub fn transpose_codebooks(codebooks: &[f32], m: usize, codes: usize) -> Vec<f32> {
    let sub = codebooks.len() / (m * codes).max(1);
    let mut t = vec![0.0f32; codebooks.len()];
    for j in 0..m {
        for c in 0..codes {
            for e in 0..sub {
                t[(j * sub + e) * codes + c] = codebooks[(j * codes + c) * sub + e];
            }
        }
    }
    t
}

/// Appends to `out` the best approximate score over the group's heads for every token of
/// `codes` (`n × m` bytes, token-major): the per-KV-head selection score.
pub fn scores_max(lut: &Lut, codes: &[u8], out: &mut Vec<f32>) {
    macro_rules! go {
        ($($m:literal),*; $($p:literal),*) => {
            go!(@m [$($m),*] [$($p),*])
        };
        (@m [$($m:literal),*] $ps:tt) => {
            match lut.subspaces {
                $($m => go!(@p $m $ps),)*
                _ => generic_max(lut, codes, out),
            }
        };
        (@p $m:literal [$($p:literal),*]) => {
            match lut.lanes {
                4 => quad_max::<$m>(&lut.values, codes, out),
                $($p => fixed_max::<$m, $p>(&lut.values, codes, out),)*
                _ => generic_max(lut, codes, out),
            }
        };
    }
    go!(1, 2, 4, 8; 1, 2, 8)
}

/// Appends the best score over the group's heads of every `stride`-th token of `codes`
/// (`n × m` bytes): the sample a top-k threshold is estimated from.
pub fn scores_max_strided(lut: &Lut, codes: &[u8], stride: usize, out: &mut Vec<f32>) {
    fn gather<const M: usize>(codes: &[u8], stride: usize) -> Vec<u8> {
        let tokens: &[[u8; M]] = bytemuck::cast_slice(&codes[..codes.len() / M * M]);
        let picked: Vec<[u8; M]> = tokens.iter().step_by(stride).copied().collect();
        bytemuck::cast_slice(&picked).to_vec()
    }
    let stride = stride.max(1);
    let m = lut.subspaces;
    if lut.lanes == 4 {
        match m {
            1 => return quad_max_strided::<1>(&lut.values, codes, stride, out),
            2 => return quad_max_strided::<2>(&lut.values, codes, stride, out),
            4 => return quad_max_strided::<4>(&lut.values, codes, stride, out),
            8 => return quad_max_strided::<8>(&lut.values, codes, stride, out),
            _ => {}
        }
    }
    let sample = match m {
        1 => gather::<1>(codes, stride),
        2 => gather::<2>(codes, stride),
        4 => gather::<4>(codes, stride),
        8 => gather::<8>(codes, stride),
        _ => codes.chunks_exact(m).step_by(stride).flatten().copied().collect(),
    };
    scores_max(lut, &sample, out);
}

/// Appends `(index, score)` for every token of `codes` whose best score over the group's
/// heads is at least `t`; token `i` of `codes` has index `first + i`. This fuses the
/// threshold pass of a top-k into scoring, so no per-token score array is written.
pub fn candidates_max(lut: &Lut, codes: &[u8], first: u32, t: f32, out: &mut Vec<(u32, f32)>) {
    if lut.lanes == 4 {
        let tv = f32x4::splat(t);
        let mut at = first;
        let mut go = |values: &[f32], codes: &[u8], sub: usize| match sub {
            1 => quad_candidates::<1>(values, codes, tv, &mut at, out),
            2 => quad_candidates::<2>(values, codes, tv, &mut at, out),
            4 => quad_candidates::<4>(values, codes, tv, &mut at, out),
            _ => quad_candidates::<8>(values, codes, tv, &mut at, out),
        };
        if matches!(lut.subspaces, 1 | 2 | 4 | 8) {
            go(&lut.values, codes, lut.subspaces);
            return;
        }
    }
    let mut scores = Vec::with_capacity(codes.len() / lut.subspaces);
    scores_max(lut, codes, &mut scores);
    out.extend(scores.iter().enumerate().filter(|(_, &s)| s >= t).map(|(i, &s)| (first + i as u32, s)));
}

/// The lane-wise maximum of four vectors (three vector max operations): over heads when
/// they hold one head each, over tokens when they hold one token each.
#[inline(always)]
fn lane_max([a, b, c, d]: [f32x4; 4]) -> f32x4 {
    a.fast_max(b).fast_max(c.fast_max(d))
}

/// The candidate pass of the four-head case. Almost every token falls below the threshold,
/// so each quad of tokens is first tested as a whole: the lane-wise maximum of the four
/// tokens' head sums (three vector max operations) against `t`. Only a quad with some
/// lane at or above `t` pays for the transpose that names the tokens.
fn quad_candidates<const M: usize>(values: &[f32], codes: &[u8], t: f32x4, at: &mut u32, out: &mut Vec<(u32, f32)>) {
    let (sum, tokens) = quad_sums::<M>(values, codes);
    let mut emit = |sums: [f32x4; 4], n: usize, at: u32| {
        let best = lane_max(f32x4::transpose(sums));
        // Lanes past `n` hold zero sums: mask them off.
        let mut mask = best.simd_ge(t).to_bitmask() & ((1u32 << n) - 1);
        let b = best.to_array();
        while mask != 0 {
            let lane = mask.trailing_zeros() as usize;
            out.push((at + lane as u32, b[lane]));
            mask &= mask - 1;
        }
    };
    let quads = tokens.chunks_exact(4);
    let rest = quads.remainder();
    for quad in quads {
        let sums = [sum(&quad[0]), sum(&quad[1]), sum(&quad[2]), sum(&quad[3])];
        let any = lane_max(sums);
        if any.simd_ge(t).to_bitmask() != 0 {
            emit(sums, 4, *at);
        }
        *at += 4;
    }
    if !rest.is_empty() {
        let sum_at = |i: usize| rest.get(i).map_or(f32x4::ZERO, &sum);
        emit([sum_at(0), sum_at(1), sum_at(2), sum_at(3)], rest.len(), *at);
        *at += rest.len() as u32;
    }
}

/// Appends to `out[h]` the approximate score of head `h` for every token of `codes`
/// (`n × m` bytes): the per-query-head selection scores. `out` has one vector per head.
pub fn scores_each(lut: &Lut, codes: &[u8], out: &mut [Vec<f32>]) {
    if lut.lanes == 4 && lut.heads == 4 {
        match lut.subspaces {
            1 => return quad_each::<1>(&lut.values, codes, out),
            2 => return quad_each::<2>(&lut.values, codes, out),
            4 => return quad_each::<4>(&lut.values, codes, out),
            8 => return quad_each::<8>(&lut.values, codes, out),
            _ => {}
        }
    }
    let (m, p) = (lut.subspaces, lut.lanes);
    let mut acc = vec![0.0f32; p];
    for c in codes.chunks_exact(m) {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (j, &code) in c.iter().enumerate() {
            let e = &lut.values[(j * LUT_ROWS + code as usize) * p..][..p];
            acc.iter_mut().zip(e).for_each(|(a, v)| *a += v);
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            o.push(*a);
        }
    }
}

/// The hot loop with the sub-space count and lane count known at compile time: per token,
/// `M` table rows of `P` lanes summed in registers, then the maximum lane.
fn fixed_max<const M: usize, const P: usize>(values: &[f32], codes: &[u8], out: &mut Vec<f32>) {
    let rows: &[[f32; P]] = bytemuck::cast_slice(values);
    let tables: [&[[f32; P]; LUT_ROWS]; M] = std::array::from_fn(|j| {
        rows[j * LUT_ROWS..(j + 1) * LUT_ROWS].try_into().expect("a lookup table holds 256 rows per sub-space")
    });
    let tokens: &[[u8; M]] = bytemuck::cast_slice(&codes[..codes.len() / M * M]);
    out.extend(tokens.iter().map(|c| {
        let mut acc = tables[0][c[0] as usize];
        for j in 1..M {
            let e = &tables[j][c[j] as usize];
            for p in 0..P {
                acc[p] += e[p];
            }
        }
        // A plain comparison (scores are finite) compiles to maxss; f32::max's NaN rule does not.
        let mut best = acc[0];
        for &a in &acc[1..] {
            best = if a > best { a } else { best };
        }
        best
    }));
}

/// The four-head table rows of `values` per sub-space, and `codes` as tokens: the sum of a
/// token's `M` rows is its four head scores in one vector.
#[inline(always)]
fn quad_sums<'a, const M: usize>(
    values: &'a [f32],
    codes: &'a [u8],
) -> (impl Fn(&[u8; M]) -> f32x4 + 'a, &'a [[u8; M]]) {
    let rows: &[[f32; 4]] = bytemuck::cast_slice(values);
    let tables: [&[[f32; 4]; LUT_ROWS]; M] = std::array::from_fn(|j| {
        rows[j * LUT_ROWS..(j + 1) * LUT_ROWS].try_into().expect("a lookup table holds 256 rows per sub-space")
    });
    let sum = move |c: &[u8; M]| {
        let mut acc = f32x4::from(tables[0][c[0] as usize]);
        for j in 1..M {
            acc += f32x4::from(tables[j][c[j] as usize]);
        }
        acc
    };
    (sum, bytemuck::cast_slice(&codes[..codes.len() / M * M]))
}

/// The four-head case (the common GQA group), four tokens at a time: each token's four
/// head sums are one vector, and the four vectors are transposed into one vector per head
/// holding four tokens — so the maximum over heads is three vertical max operations, and
/// per-head scores are four plain stores.
#[inline(always)]
fn quad_tokens<const M: usize>(values: &[f32], codes: &[u8], mut emit: impl FnMut([f32x4; 4], usize)) {
    let (sum, tokens) = quad_sums::<M>(values, codes);
    let quads = tokens.chunks_exact(4);
    let rest = quads.remainder();
    for quad in quads {
        emit(f32x4::transpose([sum(&quad[0]), sum(&quad[1]), sum(&quad[2]), sum(&quad[3])]), 4);
    }
    if !rest.is_empty() {
        let at = |t: usize| rest.get(t).map_or(f32x4::ZERO, &sum);
        emit(f32x4::transpose([at(0), at(1), at(2), at(3)]), rest.len());
    }
}

fn quad_max<const M: usize>(values: &[f32], codes: &[u8], out: &mut Vec<f32>) {
    out.reserve(codes.len() / M);
    quad_tokens::<M>(values, codes, |heads, n| {
        let best = lane_max(heads).to_array();
        if n == 4 {
            out.extend_from_slice(&best);
        } else {
            out.extend_from_slice(&best[..n]);
        }
    });
}

/// [`quad_max`] over every `stride`-th token, read in place.
fn quad_max_strided<const M: usize>(values: &[f32], codes: &[u8], stride: usize, out: &mut Vec<f32>) {
    let (sum, tokens) = quad_sums::<M>(values, codes);
    let mut picked = tokens.iter().step_by(stride);
    out.reserve(tokens.len() / stride + 1);
    loop {
        let quad = [picked.next(), picked.next(), picked.next(), picked.next()];
        let n = quad.iter().take_while(|t| t.is_some()).count();
        if n == 0 {
            return;
        }
        let heads = f32x4::transpose(quad.map(|t| t.map_or(f32x4::ZERO, &sum)));
        out.extend_from_slice(&lane_max(heads).to_array()[..n]);
    }
}

fn quad_each<const M: usize>(values: &[f32], codes: &[u8], out: &mut [Vec<f32>]) {
    quad_tokens::<M>(values, codes, |heads, n| {
        for (o, h) in out.iter_mut().zip(heads) {
            o.extend_from_slice(&h.to_array()[..n]);
        }
    });
}

fn generic_max(lut: &Lut, codes: &[u8], out: &mut Vec<f32>) {
    let (m, p) = (lut.subspaces, lut.lanes);
    let mut acc = vec![0.0f32; p];
    out.extend(codes.chunks_exact(m).map(|c| {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (j, &code) in c.iter().enumerate() {
            let e = &lut.values[(j * LUT_ROWS + code as usize) * p..][..p];
            acc.iter_mut().zip(e).for_each(|(a, v)| *a += v);
        }
        acc.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::SplitMix64;

    /// Scores by reconstructing each token's key from its codes and taking dot products.
    fn reconstructed(
        q: &[f32],
        heads: usize,
        cb: &[f32],
        m: usize,
        k: usize,
        codes: &[u8],
        scale: f32,
    ) -> Vec<Vec<f32>> {
        let d = q.len() / heads;
        let sub = d / m;
        let mut out = vec![Vec::new(); heads];
        for c in codes.chunks_exact(m) {
            let key: Vec<f32> = (0..m).flat_map(|j| cb[(j * k + c[j] as usize) * sub..][..sub].to_vec()).collect();
            for (h, o) in out.iter_mut().enumerate() {
                o.push(scale * q[h * d..(h + 1) * d].iter().zip(&key).map(|(a, b)| a * b).sum::<f32>());
            }
        }
        out
    }

    #[test]
    fn table_scores_equal_dot_products_with_reconstructed_keys() {
        let mut g = SplitMix64::new(5);
        for (heads, m, k) in [(1, 1, 16), (3, 2, 64), (4, 4, 256), (7, 8, 32), (12, 2, 16)] {
            let d = 32;
            let q: Vec<f32> = (0..heads * d).map(|_| g.normal()).collect();
            let cb: Vec<f32> = (0..m * k * (d / m)).map(|_| g.normal()).collect();
            let codes: Vec<u8> = (0..101 * m).map(|_| g.below(k) as u8).collect();
            let lut = Lut::build(&q, heads, &cb, m, k, 0.25).unwrap();
            let lut_t = Lut::build_transposed(&q, heads, &transpose_codebooks(&cb, m, k), m, k, 0.25).unwrap();
            for (a, b) in lut.values.iter().zip(&lut_t.values) {
                assert!((a - b).abs() < 1e-4, "transposed table: {a} vs {b}");
            }
            let want = reconstructed(&q, heads, &cb, m, k, &codes, 0.25);
            let mut each = vec![Vec::new(); heads];
            scores_each(&lut, &codes, &mut each);
            let mut best = Vec::new();
            scores_max(&lut, &codes, &mut best);
            let mut strided = Vec::new();
            scores_max_strided(&lut, &codes, 3, &mut strided);
            for (i, s) in strided.iter().enumerate() {
                assert!((s - best[i * 3]).abs() < 1e-4, "strided sample {i}");
            }
            let mut cands = Vec::new();
            let t = best[7];
            candidates_max(&lut, &codes, 10, t, &mut cands);
            let above: Vec<u32> = (0..best.len()).filter(|&i| best[i] >= t).map(|i| i as u32 + 10).collect();
            assert_eq!(cands.iter().map(|c| c.0).collect::<Vec<_>>(), above, "candidates at or above {t}");
            for t in 0..101 {
                let mut mx = f32::NEG_INFINITY;
                for h in 0..heads {
                    assert!(
                        (each[h][t] - want[h][t]).abs() < 1e-4,
                        "heads={heads} m={m}: {} vs {}",
                        each[h][t],
                        want[h][t]
                    );
                    mx = mx.max(want[h][t]);
                }
                assert!((best[t] - mx).abs() < 1e-4, "heads={heads} m={m}: max {} vs {mx}", best[t]);
            }
        }
    }

    #[test]
    fn bad_tables_are_rejected() {
        let q = vec![0.0f32; 2 * 8];
        assert!(Lut::build(&q, 2, &[0.0; 3 * 4 * 2], 3, 4, 1.0).is_err(), "m must divide d");
        assert!(Lut::build(&q, 2, &vec![0.0; 2 * 300 * 4], 2, 300, 1.0).is_err(), "at most 256 codes");
        assert!(Lut::build(&q, 2, &[0.0; 5], 2, 4, 1.0).is_err(), "codebook size");
    }
}
