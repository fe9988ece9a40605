//! kv43's AVX2 kernels: the scores of up to four query heads over an 8-row key tile (rows in
//! lanes, so no horizontal sums), the 3- or 4-bit value codes made from their planes and weighed
//! by 8-bit probabilities for up to four heads, and the exact round-to-nearest of a run of
//! codes (the query's 8-bit codes and the probabilities' 8-bit ones).

use std::arch::x86_64::*;

use super::{PART, TILE};

/// `codes[i] = clamp(round((x[i] − min) / step), 0, levels)` as `u8`, with `f32::round`'s
/// ties away from zero, eight at a time; the scalar loop of [`super::code_run`] exactly (the
/// same subtraction and division; `round` as `trunc` plus one where the exact fraction is
/// at least ½, after the clamp below at 0 and before the one above, as `f32::clamp` and
/// `as u8` treat a NaN: 0). `step > 0` (with `INVERSE`, the step's inverse: a product).
#[target_feature(enable = "avx2")]
pub(super) fn code_run<const INVERSE: bool>(x: &[f32], min: f32, step: f32, levels: f32, codes: &mut [u8]) {
    let (m, s, top) = (_mm256_set1_ps(min), _mm256_set1_ps(step), _mm256_set1_ps(levels));
    let (zero, half, one) = (_mm256_setzero_ps(), _mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let (mut xs, mut cs) = (x.chunks_exact(8), codes.chunks_exact_mut(8));
    for (v, out) in (&mut xs).zip(&mut cs) {
        let v: __m256 = bytemuck::pod_read_unaligned(bytemuck::cast_slice(v));
        // max(q, 0) gives 0 for a NaN (its second operand), as `clamp` then `as u8` do.
        let scaled =
            if INVERSE { _mm256_mul_ps(_mm256_sub_ps(v, m), s) } else { _mm256_div_ps(_mm256_sub_ps(v, m), s) };
        let q = _mm256_max_ps(scaled, zero);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(q);
        let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_sub_ps(q, t), half), one);
        let c = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_add_ps(t, up), top));
        // Eight 32-bit codes ≤ 255 narrowed to bytes (the packs work per 128-bit lane).
        let w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
        let b: [u8; 16] = bytemuck::cast(_mm_packus_epi16(w, w));
        out.copy_from_slice(&b[..8]);
    }
    super::code_run_scalar::<INVERSE>(xs.remainder(), min, step, levels, cs.into_remainder());
}

/// `codes[i] = min(round(x[i] / step), 255)` for probabilities `x[i] ≥ 0` (a NaN gives
/// 255, as `f32::min` does), eight at a time; returns the codes' sum. Exactly the scalar
/// loop of [`super::probability_codes`].
#[target_feature(enable = "avx2")]
pub(super) fn probability_codes(x: &[f32], step: f32, codes: &mut [u8]) -> u32 {
    let (s, top) = (_mm256_set1_ps(step), _mm256_set1_ps(super::P_LEVELS));
    let (zero, half, one) = (_mm256_setzero_ps(), _mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let mut sum = _mm256_setzero_si256();
    let (mut xs, mut cs) = (x.chunks_exact(8), codes.chunks_exact_mut(8));
    for (v, out) in (&mut xs).zip(&mut cs) {
        let v: __m256 = bytemuck::pod_read_unaligned(bytemuck::cast_slice(v));
        // min(q, 255) gives 255 for a NaN (its second operand), as `f32::min` does.
        let q = _mm256_max_ps(_mm256_min_ps(_mm256_div_ps(v, s), top), zero);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(q);
        let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_sub_ps(q, t), half), one);
        let c = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_add_ps(t, up), top));
        sum = _mm256_add_epi32(sum, c);
        let w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
        let b: [u8; 16] = bytemuck::cast(_mm_packus_epi16(w, w));
        out.copy_from_slice(&b[..8]);
    }
    let lanes: [u32; 8] = bytemuck::cast(sum);
    lanes.iter().sum::<u32>() + super::probability_codes_scalar(xs.remainder(), step, cs.into_remainder())
}

/// The scores of `H` query heads over one key tile (`TILE` = 8 rows; see `Kv43Rows::key_codes`
/// for the layout): `out[h][r] = scale·(qm_h + Σ_k (a_hk·U_rk + b_hk·dot_hrk))`, in that
/// order of float operations, as `scores_reference`. Rows are in 32-bit lanes, so the
/// integer products need no horizontal sums: per 8 channels one load, the nibbles split
/// once, and per head two `vpmaddubsw` of the broadcast query codes (unsigned, ≤ 255)
/// against the key codes (≤ 15): 16-bit lanes of ≤ 7,650 each, two octets summed to
/// ≤ 30,600 (no overflow), then `vpmaddwd` with ones adds a row's two lanes into 32 bits.
/// With 5-bit keys (`HIGH`) each octet's fifth bits (one byte per row) are spread to their
/// row's lane and added to the nibbles as 16; codes ≤ 31 make 16-bit lanes of ≤ 15,810,
/// one octet ≤ 31,620, so those are widened after every octet.
/// `codes`: `TILE·d/2` bytes; `high`: the tile's `d` bytes of fifth bits (`HIGH`) or
/// nothing; `sums`: the tile's code sums (`d/64 × TILE`); `w[h]`: head `h`'s `d` query
/// codes, four to a little-endian word; `a[h]`, `b[h]`: its partitions' minima and steps.
#[target_feature(enable = "avx2")]
pub(super) fn tile_scores<const H: usize, const HIGH: bool>(
    (codes, high, sums): (&[u8], &[u8], &[u16]),
    w: [&[u32]; H],
    (a, b, qm): ([&[f32]; H], [&[f32]; H], [f32; H]),
    scale: f32,
    out: &mut [[f32; TILE]; H],
) {
    let parts = sums.len() / TILE;
    // The lengths every read below relies on, stated once so the compiler can drop the
    // per-read bounds checks.
    assert!(codes.len() == parts * PART / 8 * 32 && w.iter().all(|w| w.len() == parts * PART / 4), "tile shapes");
    assert!(a.iter().chain(&b).all(|x| x.len() == parts), "partition shapes");
    assert!(high.len() == if HIGH { parts * PART } else { 0 }, "fifth-bit shapes");
    let nibble = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    // Byte `i` of a row's lane takes bit `i` (low nibbles: channels 8o + i) or bit `4 + i`
    // (high nibbles: channels 8o + 4 + i) of the row's fifth-bit byte.
    let (lo_bits, hi_bits) = (_mm256_set1_epi32(0x0804_0201), _mm256_set1_epi32(0x8040_2010_u32 as i32));
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
    );
    let sixteen = _mm256_set1_epi8(16);
    let fifth =
        |x: __m256i, bits: __m256i| _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, bits), bits), sixteen);
    // Octets summed in 16 bits before widening: two with 4-bit codes, one with 5-bit.
    let run = if HIGH { 1 } else { 2 };
    let mut s = qm.map(|x| _mm256_set1_ps(x));
    for k in 0..parts {
        let mut dot = [_mm256_setzero_si256(); H];
        for first in (0..PART / 8).step_by(run) {
            let mut acc = [_mm256_setzero_si256(); H];
            for o in k * PART / 8 + first..k * PART / 8 + first + run {
                let x: __m256i = bytemuck::pod_read_unaligned(&codes[o * 32..o * 32 + 32]);
                let mut lo = _mm256_and_si256(x, nibble);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), nibble);
                if HIGH {
                    let rows = _mm_cvtsi64_si128(bytemuck::pod_read_unaligned::<i64>(&high[o * 8..o * 8 + 8]));
                    // Row r's byte in every byte of lane r.
                    let x = _mm256_shuffle_epi8(_mm256_cvtepu8_epi32(rows), spread);
                    lo = _mm256_or_si256(lo, fifth(x, lo_bits));
                    hi = _mm256_or_si256(hi, fifth(x, hi_bits));
                }
                for h in 0..H {
                    let (ql, qh) = (_mm256_set1_epi32(w[h][2 * o] as i32), _mm256_set1_epi32(w[h][2 * o + 1] as i32));
                    let p = _mm256_add_epi16(_mm256_maddubs_epi16(ql, lo), _mm256_maddubs_epi16(qh, hi));
                    acc[h] = _mm256_add_epi16(acc[h], p);
                }
            }
            for h in 0..H {
                dot[h] = _mm256_add_epi32(dot[h], _mm256_madd_epi16(acc[h], ones));
            }
        }
        let u: __m128i = bytemuck::pod_read_unaligned(bytemuck::cast_slice(&sums[k * TILE..(k + 1) * TILE]));
        let u = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(u));
        for h in 0..H {
            let t = _mm256_add_ps(
                _mm256_mul_ps(_mm256_set1_ps(a[h][k]), u),
                _mm256_mul_ps(_mm256_set1_ps(b[h][k]), _mm256_cvtepi32_ps(dot[h])),
            );
            s[h] = _mm256_add_ps(s[h], t);
        }
    }
    for h in 0..H {
        out[h] = bytemuck::cast(_mm256_mul_ps(s[h], _mm256_set1_ps(scale)));
    }
}

/// See `weigh_value_planes`, for `H` heads: per eight rows and 32 channels the three (four
/// with `FOUR`-bit values) planes loaded once; each row's codes made in registers (bit `r` of
/// every byte to bit 0 by a 16-bit shift and a byte mask, then `b0 + 2·b1 + 4·b2 (+ 8·b3)`
/// by byte adds); each row pair interleaved so `vpmaddubsw` multiplies the rows' two
/// probability codes (unsigned, ≤ 255, `weights[h·rows/2 + i]` broadcast, made once per
/// block by the caller) by a channel's two codes (signed operand, ≤ 7 or ≤ 15): pair sums
/// ≤ 3,570 (7,650), summed in 16 bits over up to 32 (16) rows, ≤ 57,120 (61,200) unsigned,
/// and then widened to 32. `weights`: `H × rows/2` words, row `2i` in the low byte.
#[target_feature(enable = "avx2")]
pub(super) fn weigh_value_planes<const H: usize, const FOUR: bool>(
    planes: &[u8],
    d: usize,
    weights: &[[u16; 16]],
    dot: &mut [u32],
) {
    let bits = if FOUR { 4 } else { 3 };
    // 8-row groups summed in 16 bits before widening.
    let run = if FOUR { 2 } else { 4 };
    let rows = planes.len() / (bits * d) * 8;
    let one = _mm256_set1_epi8(1);
    let zero = _mm256_setzero_si256();
    let weight = |h: usize, pair: usize| -> __m256i { bytemuck::cast(weights[h * rows / 2 + pair]) };
    for c0 in (0..d).step_by(32) {
        let mut acc = [[zero; 4]; H];
        let (mut lo, mut hi) = ([zero; H], [zero; H]);
        for (i, group) in planes.chunks_exact(bits * d).enumerate() {
            let load = |b: usize| -> __m256i { bytemuck::pod_read_unaligned(&group[b * d + c0..b * d + c0 + 32]) };
            let (p0, p1, p2) = (load(0), load(1), load(2));
            let p3 = if FOUR { load(3) } else { zero };
            let code = |r: i32| {
                let n = _mm_cvtsi32_si128(r);
                let bit = |x: __m256i| _mm256_and_si256(_mm256_srl_epi16(x, n), one);
                let (b0, b1, mut b2) = (bit(p0), bit(p1), bit(p2));
                if FOUR {
                    // b2 + 2·b3, doubled twice below: 4·b2 + 8·b3.
                    let b3 = bit(p3);
                    b2 = _mm256_add_epi8(b2, _mm256_add_epi8(b3, b3));
                }
                let b2 = _mm256_add_epi8(b2, b2);
                _mm256_add_epi8(b0, _mm256_add_epi8(_mm256_add_epi8(b1, b1), _mm256_add_epi8(b2, b2)))
            };
            for r in (0..8).step_by(2) {
                let (x, y) = (code(r as i32), code(r as i32 + 1));
                let (ul, uh) = (_mm256_unpacklo_epi8(x, y), _mm256_unpackhi_epi8(x, y));
                for h in 0..H {
                    let w = weight(h, 4 * i + r / 2);
                    lo[h] = _mm256_add_epi16(lo[h], _mm256_maddubs_epi16(w, ul));
                    hi[h] = _mm256_add_epi16(hi[h], _mm256_maddubs_epi16(w, uh));
                }
            }
            // Widened every `run` groups (and at the end): ≤ 57,120 (61,200), which 16 bits
            // hold unsigned. lo: channels 0..8 | 16..24, hi: 8..16 | 24..32 (unpack works
            // per lane).
            if i % run == run - 1 || i + 1 == rows / 8 {
                for h in 0..H {
                    let a = &mut acc[h];
                    let wide = |x: __m128i| _mm256_cvtepu16_epi32(x);
                    a[0] = _mm256_add_epi32(a[0], wide(_mm256_castsi256_si128(lo[h])));
                    a[1] = _mm256_add_epi32(a[1], wide(_mm256_castsi256_si128(hi[h])));
                    a[2] = _mm256_add_epi32(a[2], wide(_mm256_extracti128_si256::<1>(lo[h])));
                    a[3] = _mm256_add_epi32(a[3], wide(_mm256_extracti128_si256::<1>(hi[h])));
                    (lo[h], hi[h]) = (zero, zero);
                }
            }
        }
        for (h, a) in acc.iter().enumerate() {
            for (k, v) in a.iter().enumerate() {
                let lanes: [u32; 8] = bytemuck::cast(*v);
                let at = h * d + c0 + 8 * k;
                dot[at..at + 8].copy_from_slice(&lanes);
            }
        }
    }
}
