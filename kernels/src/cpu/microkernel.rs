//! Register-blocked inner kernels of [`super::attention`] on 8-lane vectors (`wide::f32x8`,
//! AVX2+FMA with the workspace's x86-64-v3 target): scores of a tile of keys against `G`
//! query heads, and the value accumulation `o_i += p_i[t]·v_t`.
//!
//! Keys and values are widened from their storage type inside the loops (one conversion
//! per 8 elements, reused for all `G` heads), so no f32 copy of a tile is ever written.
//! Accumulators are small fixed arrays that stay in registers: scores take 2 tokens × `G`
//! heads, values `G` heads × `V` vectors of the head dimension.

use crate::element::Element;
use wide::f32x8;

/// Head dimensions up to `8 × MAX_D8` (256) take the score kernel's chunk-major query path.
const MAX_D8: usize = 32;

/// `out[i·stride + t] = scale · q_i·k_t` for `G` query rows `q` (`G × d8` vectors) and `n`
/// key rows `k` (`n × 8·d8` elements). While it scores rows `t, t+1` it prefetches rows
/// `t, t+1` of both `ahead` slices (the caller passes keys a few rows further on and this
/// tile's values), so memory streams while the core computes.
#[inline(always)]
#[allow(clippy::too_many_arguments, reason = "a hot inner kernel: its operands stay separate")]
pub(crate) fn scores<const G: usize, E: Element>(
    q: &[f32x8],
    k: &[E],
    n: usize,
    d8: usize,
    scale: f32,
    out: &mut [f32],
    stride: usize,
    ahead: [&[E]; 2],
) {
    let q = &q[..G * d8];
    let d = d8 * 8;
    // The queries chunk-major (`qt[c·G + i]` = chunk c of head i), so the inner loop walks
    // them in step with the key chunks and indexes nothing (no bounds checks in the loop).
    let mut qt = [f32x8::ZERO; 4 * MAX_D8];
    let qt = &mut qt[..G * d8.min(MAX_D8)];
    for (c, chunk) in qt.chunks_exact_mut(G).enumerate() {
        for (i, x) in chunk.iter_mut().enumerate() {
            *x = q[i * d8 + c];
        }
    }
    let qt = &*qt;
    let mut t = 0;
    while t + 2 <= n {
        for rows in ahead {
            if let Some(r) = rows.get(t * d..(t + 2) * d) {
                super::prefetch::prefetch(r);
            }
        }
        let (k0, k1) = (&k[t * d..(t + 1) * d], &k[(t + 1) * d..(t + 2) * d]);
        let mut acc = [[f32x8::ZERO; 2]; G];
        if d8 <= MAX_D8 {
            for ((c0, c1), qc) in k0.chunks_exact(8).zip(k1.chunks_exact(8)).zip(qt.chunks_exact(G)) {
                let (a0, a1) = (E::load8(c0), E::load8(c1));
                for (acc_i, &qv) in acc.iter_mut().zip(qc) {
                    acc_i[0] = qv.mul_add(a0, acc_i[0]);
                    acc_i[1] = qv.mul_add(a1, acc_i[1]);
                }
            }
        } else {
            for (c, (c0, c1)) in k0.chunks_exact(8).zip(k1.chunks_exact(8)).enumerate() {
                let (a0, a1) = (E::load8(c0), E::load8(c1));
                for (i, acc_i) in acc.iter_mut().enumerate() {
                    let qv = q[i * d8 + c];
                    acc_i[0] = qv.mul_add(a0, acc_i[0]);
                    acc_i[1] = qv.mul_add(a1, acc_i[1]);
                }
            }
        }
        let sums = pair_sums(&acc);
        for (i, pair) in sums.chunks_exact(2).enumerate().take(G) {
            out[i * stride + t] = pair[0] * scale;
            out[i * stride + t + 1] = pair[1] * scale;
        }
        t += 2;
    }
    if t < n {
        let mut acc = [f32x8::ZERO; G];
        for (c, c0) in k[t * d..(t + 1) * d].chunks_exact(8).enumerate() {
            let a0 = E::load8(c0);
            for (i, acc_i) in acc.iter_mut().enumerate() {
                *acc_i = q[i * d8 + c].mul_add(a0, *acc_i);
            }
        }
        for (i, acc_i) in acc.iter().enumerate() {
            out[i * stride + t] = acc_i.reduce_add() * scale;
        }
    }
}

/// The lane sums of up to four heads' pairs of score accumulators, `[h0 t0, h0 t1, h1 t0,
/// …]` (heads past `G` sum to 0): one transposing tree of `vhaddps` for all eight on AVX
/// (10 instructions, where eight separate horizontal sums take ~56: at 2 rows × 4 heads a
/// step, that was a quarter of the score kernel's instructions).
#[inline(always)]
fn pair_sums<const G: usize>(acc: &[[f32x8; 2]; G]) -> [f32; 8] {
    let mut x = [f32x8::ZERO; 8];
    for (pair, a) in x.chunks_exact_mut(2).zip(acc) {
        pair.copy_from_slice(a);
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
    {
        #[allow(unsafe_code, reason = "calling a #[target_feature] helper")]
        // SAFETY: compiled only when the build enables AVX for the whole program (cfg
        // above), so every CPU that runs the binary has it.
        unsafe {
            sums8_avx(bytemuck::cast(x))
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx")))]
    x.map(|v| v.reduce_add())
}

/// `[Σx0, …, Σx7]`: `vhaddps` of pairs, then of pairs of those, leaves per 128-bit half
/// the half-sums of four vectors in order; adding the halves finishes them.
#[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
#[inline]
#[target_feature(enable = "avx")]
fn sums8_avx(x: [std::arch::x86_64::__m256; 8]) -> [f32; 8] {
    use std::arch::x86_64::*;
    let four = |a: __m256, b: __m256, c: __m256, d: __m256| {
        let h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
        _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
    };
    bytemuck::cast(_mm256_set_m128(four(x[4], x[5], x[6], x[7]), four(x[0], x[1], x[2], x[3])))
}

/// `o_i += Σ_t p[i·stride + t] · row(t)` for `G` heads over `n` rows fetched by `row(t)`
/// (each `8·d8` elements: the estimation zone's gathered cluster value means, or a tile's
/// value rows when [`accumulate_tile`] does not apply), `V` vectors of the head dimension at
/// a time. Requires `d8 % V == 0`.
#[inline(always)]
pub(crate) fn accumulate_rows<'a, const G: usize, const V: usize, E: Element>(
    p: &[f32],
    stride: usize,
    row: impl Fn(usize) -> &'a [E],
    n: usize,
    d8: usize,
    o: &mut [&mut [f32]; G],
) {
    debug_assert!(d8.is_multiple_of(V));
    let d = d8 * 8;
    // Each head's weights as a slice of exactly `n`: indexing them by `t < n` needs no
    // bounds check inside the row loop.
    let ps: [&[f32]; G] = std::array::from_fn(|i| &p[i * stride..i * stride + n]);
    for blk in (0..d).step_by(V * 8) {
        let mut acc = columns::<G, V>(o, blk);
        for t in 0..n {
            add_row(&mut acc, &ps, t, &widened::<V, E>(row(t), blk));
        }
        store_columns(&acc, o, blk);
    }
}

/// [`accumulate_rows`] over a tile's contiguous value rows `v` (`n` rows of `8·d8`), two
/// rows a step from `chunks_exact`: the slice bounds of each step are then fixed lengths
/// and loop-invariant offsets, where fetching every row through a closure re-checked them
/// (~10 of a step's ~50 instructions, callgrind, G = 4, V = 2).
#[inline(always)]
pub(crate) fn accumulate_tile<const G: usize, const V: usize, E: Element>(
    p: &[f32],
    stride: usize,
    v: &[E],
    n: usize,
    d8: usize,
    o: &mut [&mut [f32]; G],
) {
    debug_assert!(d8.is_multiple_of(V));
    let d = d8 * 8;
    let v = &v[..n * d];
    let ps: [&[f32]; G] = std::array::from_fn(|i| &p[i * stride..i * stride + n]);
    for blk in (0..d).step_by(V * 8) {
        let mut acc = columns::<G, V>(o, blk);
        let mut pairs = v.chunks_exact(2 * d);
        for (t, pair) in (&mut pairs).enumerate().map(|(i, x)| (2 * i, x)) {
            let (r0, r1) = (widened::<V, E>(&pair[..d], blk), widened::<V, E>(&pair[d..], blk));
            add_row(&mut acc, &ps, t, &r0);
            add_row(&mut acc, &ps, t + 1, &r1);
        }
        if !pairs.remainder().is_empty() {
            add_row(&mut acc, &ps, n - 1, &widened::<V, E>(pairs.remainder(), blk));
        }
        store_columns(&acc, o, blk);
    }
}

/// Columns `blk..blk + 8·V` of each head's output, as vectors.
#[inline(always)]
fn columns<const G: usize, const V: usize>(o: &[&mut [f32]; G], blk: usize) -> [[f32x8; V]; G] {
    let mut acc = [[f32x8::ZERO; V]; G];
    for (a, oi) in acc.iter_mut().zip(o.iter()) {
        for (x, lanes) in a.iter_mut().zip(oi[blk..blk + V * 8].chunks_exact(8)) {
            *x = bytemuck::pod_read_unaligned(bytemuck::cast_slice(lanes));
        }
    }
    acc
}

/// Writes [`columns`] back.
#[inline(always)]
fn store_columns<const G: usize, const V: usize>(acc: &[[f32x8; V]; G], o: &mut [&mut [f32]; G], blk: usize) {
    for (a, oi) in acc.iter().zip(o.iter_mut()) {
        for (x, lanes) in a.iter().zip(oi[blk..blk + V * 8].chunks_exact_mut(8)) {
            lanes.copy_from_slice(&x.to_array());
        }
    }
}

/// Columns `blk..blk + 8·V` of one row, widened to f32.
#[inline(always)]
fn widened<const V: usize, E: Element>(row: &[E], blk: usize) -> [f32x8; V] {
    let lanes = &row[blk..blk + V * 8];
    std::array::from_fn(|k| E::load8(&lanes[k * 8..k * 8 + 8]))
}

/// `acc_i += ps_i[t] · row` for every head `i`.
#[inline(always)]
fn add_row<const G: usize, const V: usize>(acc: &mut [[f32x8; V]; G], ps: &[&[f32]; G], t: usize, row: &[f32x8; V]) {
    for (a, pi) in acc.iter_mut().zip(ps) {
        let w = f32x8::splat(pi[t]);
        for (x, &v) in a.iter_mut().zip(row) {
            *x = w.mul_add(v, *x);
        }
    }
}

/// `exp(s − m)` in place over `s` (a multiple of 8 long), returning the sum.
#[inline(always)]
pub(crate) fn exp_shifted_sum(s: &mut [f32], m: f32) -> f32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    {
        #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
        // SAFETY: compiled only when the build enables avx2 and fma for the whole program
        // (cfg above), so every CPU that runs the binary has them.
        unsafe {
            super::hack_avx2::exp_shifted_sum(s, m)
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
    exp_shifted_sum_wide(s, m)
}

/// [`exp_shifted_sum`] on `wide`'s vectors (targets without AVX2 and FMA).
#[cfg_attr(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"), allow(dead_code))]
fn exp_shifted_sum_wide(s: &mut [f32], m: f32) -> f32 {
    let mv = f32x8::splat(m);
    let mut sum = f32x8::ZERO;
    for lanes in s.chunks_exact_mut(8) {
        let e = (f32x8::from(<[f32; 8]>::try_from(&*lanes).unwrap_or_default()) - mv).exp();
        lanes.copy_from_slice(&e.to_array());
        sum += e;
    }
    sum.reduce_add()
}
